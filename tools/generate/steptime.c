/* steptime.c: MTP varlen's step-time table for di-generate, given with --step-ms or measured
 * at start-up.
 *
 * The measurement times a decode-shaped step of every recorded graph size on the forward and
 * backend the run uses (runner_exec_time_step: the logits of every row included, the sampler
 * and the draft head not). On the CPU backend there are no recorded graphs and every row
 * costs time, so the table is close to a line through the origin, unlike a GPU's, which is
 * nearly flat until the batch fills the device: varlen here weighs drafts against CPU time,
 * and its choices say nothing about a GPU run. */
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "common/engine/graphs.h"
#include "tools/generate/gen.h"

enum { GEN_TIME_RUNS = 3 };

di_status gen_parse_step_ms(const char *text, varlen_graph_time **out, uint32_t *n,
                            di_error *err)
{
    size_t cap = 1;
    for (const char *p = text; *p; p++)
        cap += *p == ',';
    varlen_graph_time *t = malloc(cap * sizeof(*t));
    if (!t)
        return di_fail(err, DI_ENOMEM, "step-time table");
    uint32_t k = 0;
    const char *p = text;
    for (;;) {
        char *end;
        errno = 0;
        unsigned long rows = strtoul(p, &end, 10);
        double ms = 0;
        bool ok = end != p && *p != '-' && *end == ':' && rows >= 1 && rows <= UINT32_MAX &&
                  !errno;
        if (ok) {
            const char *q = end + 1;
            ms = strtod(q, &end);
            ok = end != q && (*end == ',' || *end == 0) && !errno && ms >= VARLEN_MIN_MS &&
                 ms <= VARLEN_MAX_MS;
        }
        if (!ok) {
            free(t);
            int len = (int)strcspn(p, ",");
            return di_fail(err, DI_EINVAL, "'%.*s' is not ROWS:MS (rows >= 1, ms in [%g, %g])",
                           len < 40 ? len : 40, p, VARLEN_MIN_MS, VARLEN_MAX_MS);
        }
        t[k++] = (varlen_graph_time){(uint32_t)rows, ms};
        if (*end == 0)
            break;
        p = end + 1;
    }
    *out = t;
    *n = k;
    return DI_OK;
}

/* Times every recorded size; the table on stderr unless quiet. */
static di_status measure(const gen_args *a, runner_exec *ex, const graph_sizes *g,
                         varlen_graph_time *t, di_error *err)
{
    if (!a->quiet)
        fprintf(stderr, "di-generate: varlen: timing decode steps at %zu graph sizes (up to %u "
                "rows) on the %s backend\n", g->count, g->max_rows,
                strcmp(a->backend, "cuda") == 0 ? "CUDA" : "CPU");
    for (size_t i = 0; i < g->count; i++) {
        double ms;
        di_status st = runner_exec_time_step(ex, g->sizes[i], GEN_TIME_RUNS, &ms, err);
        if (st != DI_OK) {
            di_error_prefix(err, "varlen: timing %u rows: ", g->sizes[i]);
            return st;
        }
        t[i] = (varlen_graph_time){g->sizes[i], ms < VARLEN_MIN_MS ? VARLEN_MIN_MS : ms};
    }
    if (a->quiet)
        return DI_OK;
    fprintf(stderr, "di-generate: varlen: step ms by rows (fastest of %d, forward with every "
            "row's logits; sampler %g ms):", GEN_TIME_RUNS, a->sampler_ms);
    for (size_t i = 0; i < g->count; i++)
        fprintf(stderr, " %u:%.3g", t[i].rows, t[i].step_ms);
    if (strcmp(a->backend, "cuda") == 0)
        fprintf(stderr, "\ndi-generate: varlen: steps run without recorded graphs here, so "
                "launch costs are in every size\n");
    else
        fprintf(stderr, "\ndi-generate: varlen: the CPU backend has no recorded graphs and every "
                "row costs time, so varlen's choices here say nothing about a GPU\n");
    return DI_OK;
}

di_status gen_step_table(const gen_args *a, runner_exec *ex, uint32_t seqs, uint32_t nextn,
                         uint32_t interval, varlen_graph_time **out, uint32_t *n,
                         di_error *err)
{
    if (nextn == 0)
        return di_fail(err, DI_EINVAL, "--varlen needs drafts to choose from: a model with "
                       "draft stages and --nextn of at least 1");
    if (a->step_ms) {
        varlen_graph_time *t = malloc(a->n_step_ms * sizeof(*t));
        if (!t)
            return di_fail(err, DI_ENOMEM, "step-time table");
        memcpy(t, a->step_ms, a->n_step_ms * sizeof(*t));
        *out = t;
        *n = a->n_step_ms;
        return DI_OK;
    }
    graph_sizes g;
    di_status st = graph_sizes_init(&g, seqs, nextn, interval, err);
    if (st != DI_OK)
        return st;
    varlen_graph_time *t = malloc(g.count * sizeof(*t));
    st = t ? measure(a, ex, &g, t, err) : di_fail(err, DI_ENOMEM, "step-time table");
    if (st == DI_OK) {
        *out = t;
        *n = (uint32_t)g.count;
    } else {
        free(t);
    }
    graph_sizes_free(&g);
    return st;
}
