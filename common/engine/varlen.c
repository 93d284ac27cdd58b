#include "common/engine/varlen.h"

#include <assert.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

/* One draft in the global ranking. */
typedef struct ranked_draft {
    double conf;  /* cumulative acceptance chance */
    uint32_t req; /* request index */
    uint32_t idx; /* draft index within the request */
} ranked_draft;

static int cmp_ranked(const void *pa, const void *pb)
{
    const ranked_draft *a = pa, *b = pb;
    if (a->conf != b->conf)
        return a->conf > b->conf ? -1 : 1;
    if (a->req != b->req)
        return a->req < b->req ? -1 : 1;
    return a->idx < b->idx ? -1 : (a->idx > b->idx);
}

static int cmp_graph_rows(const void *pa, const void *pb)
{
    const varlen_graph_time *a = pa, *b = pb;
    return a->rows < b->rows ? -1 : (a->rows > b->rows);
}

static di_status check_request(const varlen_request *r, uint32_t i, di_error *err)
{
    if (r->num_drafts > VARLEN_MAX_DRAFTS)
        return di_fail(err, DI_EINVAL, "confidences[%u] has %u drafts, more than %u", i,
                       r->num_drafts, VARLEN_MAX_DRAFTS);
    if (r->num_drafts && !r->conf)
        return di_fail(err, DI_EINVAL, "confidences[%u] is NULL", i);
    for (uint32_t d = 0; d < r->num_drafts; d++) {
        double c = r->conf[d];
        if (!(c >= 0.0 && c <= 1.0))
            return di_fail(err, DI_EINVAL, "confidences[%u][%u] = %g outside [0, 1]", i, d, c);
        if (d > 0 && c > r->conf[d - 1])
            return di_fail(err, DI_EINVAL,
                           "confidences[%u][%u] = %g exceeds confidences[%u][%u] = %g (they are "
                           "cumulative, so they must not increase)",
                           i, d, c, i, d - 1, r->conf[d - 1]);
    }
    return DI_OK;
}

/* Validates the table and returns a copy sorted by rows (caller frees). */
static di_status sorted_table(const varlen_graph_time *times, size_t ntimes, uint32_t n,
                              varlen_graph_time **out, di_error *err)
{
    if (!times || ntimes == 0)
        return di_fail(err, DI_EINVAL, "step_ms: the step-time table is empty");
    for (size_t i = 0; i < ntimes; i++) {
        if (times[i].rows == 0)
            return di_fail(err, DI_EINVAL, "step_ms: graph size 0");
        if (!(isfinite(times[i].step_ms) && times[i].step_ms > 0.0))
            return di_fail(err, DI_EINVAL, "step_ms: %u rows take %g ms, must be > 0",
                           times[i].rows, times[i].step_ms);
    }
    varlen_graph_time *t = malloc(ntimes * sizeof(*t));
    if (!t)
        return di_fail(err, DI_ENOMEM, "out of memory for the step-time table");
    memcpy(t, times, ntimes * sizeof(*t));
    qsort(t, ntimes, sizeof(*t), cmp_graph_rows);
    for (size_t i = 1; i < ntimes; i++)
        if (t[i].rows == t[i - 1].rows) {
            uint32_t r = t[i].rows;
            free(t);
            return di_fail(err, DI_EINVAL, "step_ms: graph size %u appears twice", r);
        }
    if (t[ntimes - 1].rows < n) {
        uint32_t r = t[ntimes - 1].rows;
        free(t);
        return di_fail(err, DI_EINVAL,
                       "step_ms: largest graph (%u rows) cannot hold one row for each of %u "
                       "requests", r, n);
    }
    *out = t;
    return DI_OK;
}

/* Ranks every draft (caller frees *out). */
static di_status rank_drafts(const varlen_request *reqs, uint32_t n, ranked_draft **out,
                             size_t *count, di_error *err)
{
    size_t total = 0;
    for (uint32_t i = 0; i < n; i++)
        total += reqs[i].num_drafts;
    ranked_draft *r = malloc((total ? total : 1) * sizeof(*r));
    if (!r)
        return di_fail(err, DI_ENOMEM, "out of memory for %zu drafts", total);
    size_t k = 0;
    for (uint32_t i = 0; i < n; i++)
        for (uint32_t d = 0; d < reqs[i].num_drafts; d++)
            r[k++] = (ranked_draft){.conf = reqs[i].conf[d], .req = i, .idx = d};
    qsort(r, total, sizeof(*r), cmp_ranked);
    *out = r;
    *count = total;
    return DI_OK;
}

/* The scan proper: best prefix length of the ranking, with its figures. */
typedef struct scan_best {
    size_t drafts;   /* prefix length */
    uint32_t graph;  /* graph rows */
    double tokens;   /* expected tokens */
    double step_ms;  /* graph time + sampler */
} scan_best;

static scan_best scan(const ranked_draft *r, size_t total, uint32_t n,
                      const varlen_graph_time *t, size_t ntimes, double sampler_ms)
{
    uint32_t largest = t[ntimes - 1].rows;
    size_t room = largest - n; /* drafts that still fit the largest graph */
    size_t limit = total < room ? total : room;
    size_t g = 0;
    double tokens = n;
    scan_best best = {0};
    double best_rate = -1.0;
    for (size_t k = 0;; k++) {
        uint32_t rows = n + (uint32_t)k;
        while (t[g].rows < rows)
            g++;
        double ms = t[g].step_ms + sampler_ms;
        double rate = tokens / ms;
        if (rate > best_rate) {
            best_rate = rate;
            best = (scan_best){.drafts = k, .graph = t[g].rows, .tokens = tokens, .step_ms = ms};
        }
        if (k == limit)
            break;
        tokens += r[k].conf;
    }
    return best;
}

di_status varlen_schedule(const varlen_request *reqs, uint32_t n, const varlen_graph_time *times,
                          size_t ntimes, double sampler_ms, varlen_plan *out, di_error *err)
{
    if (!out)
        return di_fail(err, DI_EINVAL, "varlen plan output is NULL");
    if (n == 0 || !reqs)
        return di_fail(err, DI_EINVAL, "confidences: no requests to plan");
    if (n > VARLEN_MAX_REQUESTS)
        return di_fail(err, DI_EINVAL, "%u requests, more than %u", n, VARLEN_MAX_REQUESTS);
    if (!(isfinite(sampler_ms) && sampler_ms >= 0.0))
        return di_fail(err, DI_EINVAL, "sampler_ms %g must be finite and >= 0", sampler_ms);
    di_status st;
    for (uint32_t i = 0; i < n; i++)
        if ((st = check_request(&reqs[i], i, err)) != DI_OK)
            return st;
    varlen_graph_time *t = NULL;
    if ((st = sorted_table(times, ntimes, n, &t, err)) != DI_OK)
        return st;
    ranked_draft *r = NULL;
    size_t total = 0;
    uint32_t *drafts = calloc(n, sizeof(*drafts));
    if (!drafts) {
        free(t);
        return di_fail(err, DI_ENOMEM, "out of memory for %u requests", n);
    }
    if ((st = rank_drafts(reqs, n, &r, &total, err)) != DI_OK) {
        free(t);
        free(drafts);
        return st;
    }
    scan_best b = scan(r, total, n, t, ntimes, sampler_ms);
    for (size_t k = 0; k < b.drafts; k++) {
        /* A prefix of the ranking holds each request's first drafts, in order. */
        assert(r[k].idx == drafts[r[k].req]);
        drafts[r[k].req]++;
    }
    free(r);
    free(t);
    *out = (varlen_plan){
        .num_requests = n,
        .drafts = drafts,
        .rows = n + (uint32_t)b.drafts,
        .graph_rows = b.graph,
        .expected_tokens = b.tokens,
        .step_ms = b.step_ms,
        .tokens_per_ms = b.tokens / b.step_ms,
    };
    return DI_OK;
}

void varlen_plan_free(varlen_plan *plan)
{
    if (!plan)
        return;
    free(plan->drafts);
    memset(plan, 0, sizeof(*plan));
}
