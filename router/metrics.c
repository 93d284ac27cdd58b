/* metrics.c: the registry and its Prometheus text (see metrics.h). */
#include "router/metrics.h"

#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct met_series {
    char instance[96];                    /* "" for the total */
    double value;                         /* counter, gauge; histogram sum */
    unsigned long long counts[MET_MAX_BUCKETS + 1]; /* per bucket (not cumulative), +Inf last */
    unsigned long long n;                 /* histogram observations */
} met_series;

typedef struct met_family {
    met_def def;
    met_series series[MET_MAX_SERIES + 1]; /* [0] is the total */
    size_t n_series;
} met_family;

struct met_registry {
    pthread_mutex_t mu;
    char model[128];
    met_family *fams;
    size_t n;
};

di_status met_new(const met_def *defs, size_t n, const char *model_name, met_registry **out,
                  di_error *err)
{
    for (size_t i = 0; i < n; i++) {
        const met_def *d = &defs[i];
        int ok = d->name && d->help && d->n_buckets <= MET_MAX_BUCKETS &&
                 (d->type != MET_HISTOGRAM || (d->buckets && d->n_buckets > 0));
        for (size_t k = 1; ok && d->type == MET_HISTOGRAM && k < d->n_buckets; k++)
            ok = d->buckets[k] > d->buckets[k - 1];
        if (!ok)
            return di_fail(err, DI_EINVAL, "metrics table row %zu (%s) is malformed", i,
                           d->name ? d->name : "?");
    }
    met_registry *r = calloc(1, sizeof *r);
    met_family *f = calloc(n ? n : 1, sizeof *f);
    if (!r || !f) {
        free(r);
        free(f);
        return di_fail(err, DI_ENOMEM, "out of memory");
    }
    for (size_t i = 0; i < n; i++) {
        f[i].def = defs[i];
        f[i].n_series = 1;
    }
    snprintf(r->model, sizeof r->model, "%s", model_name ? model_name : "");
    r->fams = f;
    r->n = n;
    pthread_mutex_init(&r->mu, NULL);
    *out = r;
    return DI_OK;
}

void met_free(met_registry *r)
{
    if (!r)
        return;
    pthread_mutex_destroy(&r->mu);
    free(r->fams);
    free(r);
}

/* The instance's series, created on first use; NULL past the bound. Under the mutex. */
static met_series *series_of(met_family *f, const char *instance)
{
    for (size_t i = 1; i < f->n_series; i++)
        if (strcmp(f->series[i].instance, instance) == 0)
            return &f->series[i];
    if (f->n_series == MET_MAX_SERIES + 1)
        return NULL;
    met_series *s = &f->series[f->n_series++];
    snprintf(s->instance, sizeof s->instance, "%s", instance);
    return s;
}

static void update(met_registry *r, size_t fam, const char *instance, double v, int observe)
{
    if (!r || fam >= r->n || !isfinite(v))
        return;
    pthread_mutex_lock(&r->mu);
    met_family *f = &r->fams[fam];
    met_series *ss[2] = {&f->series[0], instance && *instance ? series_of(f, instance) : NULL};
    for (int k = 0; k < 2; k++) {
        met_series *s = ss[k];
        if (!s)
            continue;
        s->value += v;
        if (observe) {
            size_t b = 0;
            while (b < f->def.n_buckets && v > f->def.buckets[b])
                b++;
            s->counts[b]++;
            s->n++;
        }
    }
    pthread_mutex_unlock(&r->mu);
}

void met_add(met_registry *r, size_t fam, const char *instance, double v)
{
    if (r && fam < r->n && r->fams[fam].def.type == MET_COUNTER && v < 0)
        return;
    update(r, fam, instance, v, 0);
}

void met_observe(met_registry *r, size_t fam, const char *instance, double v)
{
    if (r && fam < r->n && r->fams[fam].def.type == MET_HISTOGRAM)
        update(r, fam, instance, v, 1);
}

double met_value(met_registry *r, size_t fam, const char *instance)
{
    double v = 0;
    if (!r || fam >= r->n)
        return 0;
    pthread_mutex_lock(&r->mu);
    met_family *f = &r->fams[fam];
    for (size_t i = 0; i < f->n_series; i++)
        if (strcmp(f->series[i].instance, instance ? instance : "") == 0)
            v = f->series[i].value;
    pthread_mutex_unlock(&r->mu);
    return v;
}

/* The shortest of %.15g / %.17g that reads back as v. */
static void fmt_num(char *out, size_t n, double v)
{
    snprintf(out, n, "%.15g", v);
    if (strtod(out, NULL) != v)
        snprintf(out, n, "%.17g", v);
}

/* Label text: model_name="m"[,instance="i"], with \ " and newline escaped. */
static void labels(FILE *o, const char *model, const char *instance, const char *le)
{
    const char *vals[3] = {model, instance && *instance ? instance : NULL, le};
    const char *keys[3] = {"model_name", "rank", "le"};
    fputc('{', o);
    int first = 1;
    for (int k = 0; k < 3; k++) {
        if (!vals[k])
            continue;
        fprintf(o, "%s%s=\"", first ? "" : ",", keys[k]);
        first = 0;
        for (const char *p = vals[k]; *p; p++) {
            if (*p == '\\' || *p == '"')
                fputc('\\', o), fputc(*p, o);
            else if (*p == '\n')
                fputs("\\n", o);
            else
                fputc(*p, o);
        }
        fputc('"', o);
    }
    fputc('}', o);
}

char *met_render(met_registry *r)
{
    char *buf = NULL;
    size_t len = 0;
    FILE *o = open_memstream(&buf, &len);
    if (!o)
        return NULL;
    static const char *const tname[] = {"counter", "gauge", "histogram"};
    pthread_mutex_lock(&r->mu);
    for (size_t i = 0; i < r->n; i++) {
        met_family *f = &r->fams[i];
        fprintf(o, "# HELP %s %s\n# TYPE %s %s\n", f->def.name, f->def.help, f->def.name,
                tname[f->def.type]);
        for (size_t s = 0; s < f->n_series; s++) {
            met_series *ms = &f->series[s];
            if (f->def.type != MET_HISTOGRAM) {
                fputs(f->def.name, o);
                labels(o, r->model, ms->instance, NULL);
                char num[40];
                fmt_num(num, sizeof num, ms->value);
                fprintf(o, " %s\n", num);
                continue;
            }
            unsigned long long cum = 0;
            for (size_t b = 0; b <= f->def.n_buckets; b++) {
                char le[40];
                if (b < f->def.n_buckets)
                    fmt_num(le, sizeof le, f->def.buckets[b]);
                else
                    snprintf(le, sizeof le, "+Inf");
                cum += ms->counts[b];
                fprintf(o, "%s_bucket", f->def.name);
                labels(o, r->model, ms->instance, le);
                fprintf(o, " %llu\n", cum);
            }
            fprintf(o, "%s_sum", f->def.name);
            labels(o, r->model, ms->instance, NULL);
            char num[40];
            fmt_num(num, sizeof num, ms->value);
            fprintf(o, " %s\n%s_count", num, f->def.name);
            labels(o, r->model, ms->instance, NULL);
            fprintf(o, " %llu\n", ms->n);
        }
    }
    pthread_mutex_unlock(&r->mu);
    if (fclose(o) != 0) {
        free(buf);
        return NULL;
    }
    return buf;
}
