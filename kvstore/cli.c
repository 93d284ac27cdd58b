#include "kvstore/cli.h"

#include <ctype.h>
#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "common/util/hostport.h"
#include "common/util/machine.h"

/* ---------------------------------------------------------------- units */

typedef struct unit {
    const char *suffix;
    double scale;
} unit;

static const unit size_units[] = {
    {"", 1}, {"B", 1}, {"K", 1024.0}, {"KiB", 1024.0}, {"KB", 1024.0},
    {"M", 1048576.0}, {"MiB", 1048576.0}, {"MB", 1048576.0},
    {"G", 1073741824.0}, {"GiB", 1073741824.0}, {"GB", 1073741824.0},
    {"T", 1099511627776.0}, {"TiB", 1099511627776.0}, {"TB", 1099511627776.0},
};

static const unit time_units[] = {
    {"", 1}, {"ms", 1}, {"s", 1e3}, {"m", 6e4}, {"min", 6e4}, {"h", 3.6e6}, {"d", 8.64e7},
};

static di_status parse_units(const char *s, const unit *units, size_t n_units, const char *what,
                             uint64_t *out, di_error *err)
{
    if (!s || !*s)
        return di_fail(err, DI_EINVAL, "empty %s", what);
    errno = 0;
    char *end;
    double v = strtod(s, &end);
    if (end == s || errno || !(v >= 0) || isinf(v))
        return di_fail(err, DI_EINVAL, "\"%s\" is not a %s", s, what);
    for (size_t i = 0; i < n_units; i++)
        if (strcmp(end, units[i].suffix) == 0) {
            double x = v * units[i].scale;
            if (x >= 1.8e19)
                return di_fail(err, DI_ERANGE, "%s \"%s\" is too large", what, s);
            *out = (uint64_t)llround(x);
            return DI_OK;
        }
    return di_fail(err, DI_EINVAL, "\"%s\" is not a %s (unknown unit \"%s\")", s, what, end);
}

di_status kvcli_parse_size(const char *s, uint64_t *out, di_error *err)
{
    return parse_units(s, size_units, sizeof(size_units) / sizeof(size_units[0]), "size", out,
                       err);
}

di_status kvcli_parse_duration(const char *s, uint64_t *out, di_error *err)
{
    return parse_units(s, time_units, sizeof(time_units) / sizeof(time_units[0]), "duration",
                       out, err);
}

void kvcli_format_size(uint64_t b, char *buf, size_t n)
{
    di_machine_format_bytes(b, buf, n);
}

void kvcli_format_duration(uint64_t ms, char *buf, size_t n)
{
    if (ms == UINT64_MAX)
        snprintf(buf, n, "never");
    else if (ms < 1000)
        snprintf(buf, n, "%llums", (unsigned long long)ms);
    else if (ms < 60000)
        snprintf(buf, n, "%llus", (unsigned long long)(ms / 1000));
    else if (ms < 3600000)
        snprintf(buf, n, "%llum %llus", (unsigned long long)(ms / 60000),
                 (unsigned long long)(ms / 1000 % 60));
    else if (ms < 86400000)
        snprintf(buf, n, "%lluh %llum", (unsigned long long)(ms / 3600000),
                 (unsigned long long)(ms / 60000 % 60));
    else
        snprintf(buf, n, "%llud %lluh", (unsigned long long)(ms / 86400000),
                 (unsigned long long)(ms / 3600000 % 24));
}

/* ---------------------------------------------------------------- options */

static di_status check_bounds(const kvcli_opt *o, double v, di_error *err)
{
    const char *unit = o->kind == KVCLI_DURATION ? " ms" : o->kind == KVCLI_SIZE ? " bytes" : "";
    if (o->max <= 0 && v < o->min)
        return di_fail(err, DI_ERANGE, "--%s: %.15g%s is below the least, %.15g%s", o->name, v,
                       unit, o->min, unit);
    if (v < o->min || (o->max > 0 && v > o->max))
        return di_fail(err, DI_ERANGE, "--%s: %.15g%s is outside [%.15g, %.15g]", o->name, v,
                       unit, o->min, o->max);
    return DI_OK;
}

static di_status set_value(const kvcli_opt *o, const char *v, void *opts, di_error *err)
{
    char *field = (char *)opts + o->offset;
    uint64_t u = 0;
    di_status st = DI_OK;
    char *end;
    switch (o->kind) {
    case KVCLI_STRING:
        *(const char **)field = v;
        return DI_OK;
    case KVCLI_FLAG:
        *(int *)field = 1;
        return DI_OK;
    case KVCLI_ADDR:
    case KVCLI_LISTEN:
        st = di_hostport_parse(v, o->kind == KVCLI_LISTEN, NULL, err);
        if (st != DI_OK) {
            di_error_prefix(err, "--%s: ", o->name);
            return st;
        }
        *(const char **)field = v;
        return DI_OK;
    case KVCLI_SIZE:
        st = kvcli_parse_size(v, &u, err);
        break;
    case KVCLI_DURATION:
        st = kvcli_parse_duration(v, &u, err);
        break;
    case KVCLI_UINT:
        errno = 0;
        u = strtoull(v, &end, 10);
        if (!*v || *end || errno || v[0] == '-')
            st = di_fail(err, DI_EINVAL, "\"%s\" is not a non-negative integer", v);
        break;
    case KVCLI_INT: {
        errno = 0;
        long long x = strtoll(v, &end, 10);
        if (!*v || *end || errno)
            return di_fail(err, DI_EINVAL, "--%s: \"%s\" is not an integer", o->name, v);
        st = check_bounds(o, (double)x, err);
        if (st == DI_OK)
            *(int64_t *)field = x;
        return st;
    }
    case KVCLI_DOUBLE: {
        errno = 0;
        double d = strtod(v, &end);
        if (!*v || *end || errno || isnan(d))
            return di_fail(err, DI_EINVAL, "--%s: \"%s\" is not a number", o->name, v);
        st = check_bounds(o, d, err);
        if (st == DI_OK)
            *(double *)field = d;
        return st;
    }
    }
    if (st != DI_OK) {
        di_error_prefix(err, "--%s: ", o->name);
        return st;
    }
    st = check_bounds(o, (double)u, err);
    if (st == DI_OK)
        *(uint64_t *)field = u;
    return st;
}

di_status kvcli_defaults(const kvcli_opt *rows, size_t n, void *opts, di_error *err)
{
    for (size_t i = 0; i < n; i++)
        if (rows[i].def && rows[i].kind != KVCLI_FLAG) {
            di_status st = set_value(&rows[i], rows[i].def, opts, err);
            if (st != DI_OK)
                return st;
        }
    return DI_OK;
}

static const kvcli_opt *find_opt(const kvcli_opt *rows, size_t n, const char *name, size_t len)
{
    for (size_t i = 0; i < n; i++)
        if (strlen(rows[i].name) == len && strncmp(rows[i].name, name, len) == 0)
            return &rows[i];
    return NULL;
}

di_status kvcli_parse(const kvcli_opt *rows, size_t n, int argc, char **argv, int first,
                      void *opts, int *next, int *help, di_error *err)
{
    *help = 0;
    int i = first;
    for (; i < argc; i++) {
        const char *a = argv[i];
        if (strcmp(a, "--help") == 0 || strcmp(a, "-h") == 0) {
            *help = 1;
            continue;
        }
        if (strncmp(a, "--", 2) != 0 || a[2] == '\0')
            break;
        const char *name = a + 2;
        const char *eq = strchr(name, '=');
        size_t len = eq ? (size_t)(eq - name) : strlen(name);
        const kvcli_opt *o = find_opt(rows, n, name, len);
        if (!o)
            return di_fail(err, DI_EINVAL, "unknown option --%.*s (see --help)", (int)len, name);
        const char *v = NULL;
        if (o->kind == KVCLI_FLAG) {
            if (eq)
                return di_fail(err, DI_EINVAL, "--%s takes no value", o->name);
        } else if (eq)
            v = eq + 1;
        else if (i + 1 < argc)
            v = argv[++i];
        else
            return di_fail(err, DI_EINVAL, "--%s needs a value (%s)", o->name, o->metavar);
        di_status st = set_value(o, v, opts, err);
        if (st != DI_OK)
            return st;
    }
    *next = i;
    return DI_OK;
}

void kvcli_print_options(FILE *f, const kvcli_opt *rows, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        const kvcli_opt *o = &rows[i];
        char head[64];
        snprintf(head, sizeof(head), "--%s%s%s", o->name, o->metavar ? " " : "",
                 o->metavar ? o->metavar : "");
        fprintf(f, "  %-28s %s", head, o->help);
        if (o->def)
            fprintf(f, " [%s]", o->def);
        fputc('\n', f);
    }
}

/* ---------------------------------------------------------------- tokens */

di_status kvcli_token(const char *file, const char *env, char **out, di_error *err)
{
    *out = NULL;
    char buf[512];
    if (file) {
        FILE *f = fopen(file, "r");
        if (!f)
            return di_fail(err, DI_ENOENT, "cannot open token file %s: %s", file, strerror(errno));
        char *line = fgets(buf, sizeof(buf), f);
        fclose(f);
        if (!line)
            return di_fail(err, DI_EINVAL, "token file %s is empty", file);
    } else if (env && getenv(env)) {
        snprintf(buf, sizeof(buf), "%s", getenv(env));
    } else
        return DI_OK;
    size_t n = strlen(buf);
    while (n > 0 && isspace((unsigned char)buf[n - 1]))
        buf[--n] = '\0';
    if (n == 0)
        return di_fail(err, DI_EINVAL, "empty token in %s", file ? file : env);
    *out = strdup(buf);
    if (!*out)
        return di_fail(err, DI_ENOMEM, "cannot copy the token");
    return DI_OK;
}
