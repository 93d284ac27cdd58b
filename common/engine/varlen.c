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
static di_status sorted_table(const varlen_graph_time *times, size_t ntimes,
                              const di_alloc *a, varlen_graph_time **out, di_error *err)
{
    if (!times || ntimes == 0)
        return di_fail(err, DI_EINVAL, "step_ms: the step-time table is empty");
    for (size_t i = 0; i < ntimes; i++) {
        if (times[i].rows == 0)
            return di_fail(err, DI_EINVAL, "step_ms: graph size 0");
        if (!(times[i].step_ms >= VARLEN_MIN_MS && times[i].step_ms <= VARLEN_MAX_MS))
            return di_fail(err, DI_EINVAL, "step_ms: %u rows take %g ms, must be > 0, between "
                           "%g and %g ms", times[i].rows, times[i].step_ms, VARLEN_MIN_MS,
                           VARLEN_MAX_MS);
    }
    varlen_graph_time *t = di_alloc_mem(a, ntimes * sizeof(*t));
    if (!t)
        return di_fail(err, DI_ENOMEM, "out of memory for the step-time table");
    memcpy(t, times, ntimes * sizeof(*t));
    qsort(t, ntimes, sizeof(*t), cmp_graph_rows);
    for (size_t i = 1; i < ntimes; i++)
        if (t[i].rows == t[i - 1].rows) {
            uint32_t r = t[i].rows;
            di_alloc_release(a, t);
            return di_fail(err, DI_EINVAL, "step_ms: graph size %u appears twice", r);
        }
    *out = t;
    return DI_OK;
}

/* Radix sort of the ranking: 8 passes of one byte each over a 64-bit key. */
#define VARLEN_RADIX_PASSES 8
#define VARLEN_RADIX_BUCKETS 256

struct varlen_planner {
    varlen_graph_time *t;  /* [ntimes] the table, sorted by rows (owned) */
    size_t ntimes;
    double sampler_ms;     /* added to every size's time */
    uint32_t max_requests; /* capacity of one call */
    uint32_t max_drafts;   /* capacity of one call, drafts of all requests together */
    ranked_draft *a, *b;   /* [max_drafts] the ranking and the sort's second buffer */
    uint32_t (*hist)[VARLEN_RADIX_BUCKETS]; /* [1] counts, then offsets, of one key byte */
    const di_alloc *alloc; /* what everything above came from */
};

/* The sort key: ascending keys are descending confidences. A confidence is in [0, 1] (-0 is
 * made +0), and the IEEE bits of non-negative doubles grow with the value, so the complement
 * of the bits orders them highest first. */
static uint64_t rank_key(double c)
{
    uint64_t bits;
    c += 0.0;
    memcpy(&bits, &c, sizeof(bits));
    return ~bits;
}

/* Ranks every draft: laid out in request order, then a stable LSD radix sort on rank_key, so
 * equal confidences keep the lower request, then the earlier draft, first (the ranking of
 * varlen.h). Only the key bytes that differ between drafts are sorted on (drafts from float
 * confidences share their low bytes; confidences of one range share the top byte): per such
 * byte one counting loop and one scatter loop, O(D), no data-dependent branches. Returns the
 * sorted buffer (p->a or p->b). */
static const ranked_draft *rank_drafts(varlen_planner *p, const varlen_request *reqs,
                                       uint32_t n, size_t *count)
{
    ranked_draft *src = p->a, *dst = p->b;
    uint64_t any = 0, all = ~0ull;
    size_t k = 0;
    for (uint32_t i = 0; i < n; i++)
        for (uint32_t d = 0; d < reqs[i].num_drafts; d++) {
            src[k] = (ranked_draft){.conf = reqs[i].conf[d], .req = i, .idx = d};
            uint64_t key = rank_key(src[k].conf);
            any |= key;
            all &= key;
            k++;
        }
    *count = k;
    uint64_t differ = k ? any ^ all : 0;
    for (int b = 0; b < VARLEN_RADIX_PASSES; b++) {
        int shift = 8 * b;
        if (((differ >> shift) & 0xff) == 0)
            continue; /* every key has this byte */
        uint32_t *h = p->hist[0];
        memset(h, 0, VARLEN_RADIX_BUCKETS * sizeof(*h));
        for (size_t i = 0; i < k; i++)
            h[(rank_key(src[i].conf) >> shift) & 0xff]++;
        uint32_t at = 0;
        for (int v = 0; v < VARLEN_RADIX_BUCKETS; v++) {
            uint32_t c = h[v];
            h[v] = at;
            at += c;
        }
        for (size_t i = 0; i < k; i++)
            dst[h[(rank_key(src[i].conf) >> shift) & 0xff]++] = src[i];
        ranked_draft *tmp = src;
        src = dst;
        dst = tmp;
    }
    return src;
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

static di_status check_sampler(double sampler_ms, di_error *err)
{
    if (!(sampler_ms >= 0.0 && sampler_ms <= VARLEN_MAX_MS))
        return di_fail(err, DI_EINVAL, "sampler_ms %g must be between 0 and %g ms", sampler_ms,
                       VARLEN_MAX_MS);
    return DI_OK;
}

di_status varlen_planner_create(const varlen_graph_time *times, size_t ntimes,
                                double sampler_ms, uint32_t max_requests, uint32_t max_drafts,
                                const di_alloc *a, varlen_planner **out, di_error *err)
{
    if (!out)
        return di_fail(err, DI_EINVAL, "varlen planner output is NULL");
    if (max_requests == 0 || max_requests > VARLEN_MAX_REQUESTS)
        return di_fail(err, DI_EINVAL, "planner for %u requests, want 1..%u", max_requests,
                       VARLEN_MAX_REQUESTS);
    if ((uint64_t)max_drafts > (uint64_t)max_requests * VARLEN_MAX_DRAFTS)
        return di_fail(err, DI_EINVAL, "planner for %u drafts, more than %u requests of %u",
                       max_drafts, max_requests, VARLEN_MAX_DRAFTS);
    di_status st = check_sampler(sampler_ms, err);
    varlen_graph_time *t = NULL;
    if (st == DI_OK)
        st = sorted_table(times, ntimes, a, &t, err);
    if (st != DI_OK)
        return st;
    varlen_planner *p = di_alloc_zero(a, 1, sizeof(*p));
    size_t nd = max_drafts ? max_drafts : 1;
    if (p) {
        p->alloc = a;
        p->a = di_alloc_mem(a, nd * sizeof(ranked_draft));
        p->b = di_alloc_mem(a, nd * sizeof(ranked_draft));
        p->hist = di_alloc_mem(a, sizeof(*p->hist));
    }
    if (!p || !p->a || !p->b || !p->hist) {
        di_alloc_release(a, t);
        varlen_planner_free(p);
        return di_fail(err, DI_ENOMEM, "out of memory for a planner of %u drafts", max_drafts);
    }
    p->t = t;
    p->ntimes = ntimes;
    p->sampler_ms = sampler_ms;
    p->max_requests = max_requests;
    p->max_drafts = max_drafts;
    *out = p;
    return DI_OK;
}

void varlen_planner_free(varlen_planner *p)
{
    if (!p)
        return;
    const di_alloc *a = p->alloc;
    di_alloc_release(a, p->t);
    di_alloc_release(a, p->a);
    di_alloc_release(a, p->b);
    di_alloc_release(a, p->hist);
    di_alloc_release(a, p);
}

uint32_t varlen_planner_largest(const varlen_planner *p)
{
    return p->t[p->ntimes - 1].rows;
}

/* The requests are valid and within the planner's capacity. */
static di_status check_requests(const varlen_planner *p, const varlen_request *reqs,
                                uint32_t n, di_error *err)
{
    if (n == 0 || !reqs)
        return di_fail(err, DI_EINVAL, "confidences: no requests to plan");
    if (n > p->max_requests)
        return di_fail(err, DI_EINVAL, "%u requests, more than the planner's %u", n,
                       p->max_requests);
    uint64_t total = 0;
    for (uint32_t i = 0; i < n; i++) {
        di_status st = check_request(&reqs[i], i, err);
        if (st != DI_OK)
            return st;
        total += reqs[i].num_drafts;
    }
    if (total > p->max_drafts)
        return di_fail(err, DI_EINVAL, "%llu drafts, more than the planner's %u",
                       (unsigned long long)total, p->max_drafts);
    uint32_t largest = varlen_planner_largest(p);
    if (largest < n)
        return di_fail(err, DI_EINVAL,
                       "step_ms: largest graph (%u rows) cannot hold one row for each of %u "
                       "requests", largest, n);
    return DI_OK;
}

di_status varlen_planner_run(varlen_planner *p, const varlen_request *reqs, uint32_t n,
                             uint32_t *drafts, varlen_summary *sum, di_error *err)
{
    if (!p || !drafts)
        return di_fail(err, DI_EINVAL, "varlen planner and drafts output are required");
    di_status st = check_requests(p, reqs, n, err);
    if (st != DI_OK)
        return st;
    size_t total;
    const ranked_draft *r = rank_drafts(p, reqs, n, &total);
    scan_best b = scan(r, total, n, p->t, p->ntimes, p->sampler_ms);
    memset(drafts, 0, (size_t)n * sizeof(*drafts));
    for (size_t k = 0; k < b.drafts; k++) {
        /* A prefix of the ranking holds each request's first drafts, in order. */
        assert(r[k].idx == drafts[r[k].req]);
        drafts[r[k].req]++;
    }
    if (sum)
        *sum = (varlen_summary){
            .rows = n + (uint32_t)b.drafts,
            .graph_rows = b.graph,
            .expected_tokens = b.tokens,
            .step_ms = b.step_ms,
            .tokens_per_ms = b.tokens / b.step_ms,
        };
    return DI_OK;
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
    di_status st = check_sampler(sampler_ms, err);
    uint64_t total = 0;
    for (uint32_t i = 0; i < n && st == DI_OK; i++) {
        st = check_request(&reqs[i], i, err);
        total += reqs[i].num_drafts;
    }
    varlen_planner *p = NULL;
    if (st == DI_OK)
        st = varlen_planner_create(times, ntimes, sampler_ms, n, (uint32_t)total, NULL, &p,
                                   err);
    if (st != DI_OK)
        return st;
    uint32_t *drafts = calloc(n, sizeof(*drafts));
    if (!drafts) {
        varlen_planner_free(p);
        return di_fail(err, DI_ENOMEM, "out of memory for %u requests", n);
    }
    varlen_summary sum;
    st = varlen_planner_run(p, reqs, n, drafts, &sum, err);
    varlen_planner_free(p);
    if (st != DI_OK) {
        free(drafts);
        return st;
    }
    *out = (varlen_plan){
        .num_requests = n,
        .drafts = drafts,
        .rows = sum.rows,
        .graph_rows = sum.graph_rows,
        .expected_tokens = sum.expected_tokens,
        .step_ms = sum.step_ms,
        .tokens_per_ms = sum.tokens_per_ms,
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
