#include "common/engine/varlen.h"

#include <assert.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

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

/* The ranking is sorted as 64-bit elements: a 32-bit key (rank_drafts) above the draft's
 * entry number (its place in request order). */
#define VARLEN_RADIX_BUCKETS 256
#define VARLEN_IDX_BITS 6 /* who[] packs req << 6 | idx (idx < VARLEN_MAX_DRAFTS = 64) */
_Static_assert(VARLEN_MAX_DRAFTS <= 1u << VARLEN_IDX_BITS, "draft index fits who[]");
_Static_assert((uint64_t)VARLEN_MAX_REQUESTS << VARLEN_IDX_BITS <= UINT32_MAX, "who[] fits");
_Static_assert((uint64_t)VARLEN_MAX_REQUESTS * VARLEN_MAX_DRAFTS <= UINT32_MAX,
               "entry numbers fit the low half of a ranking element");

struct varlen_planner {
    varlen_graph_time *t;  /* [ntimes] the table, sorted by rows (owned) */
    size_t ntimes;
    double sampler_ms;     /* added to every size's time */
    uint32_t max_requests; /* capacity of one call */
    uint32_t max_drafts;   /* capacity of one call, drafts of all requests together */
    double *conf;          /* [max_drafts] each entry's confidence, entries in request order */
    uint32_t *who;         /* [max_drafts] each entry's request << 6 | draft index */
    uint64_t *a, *b;       /* [max_drafts] the ranking (key << 32 | entry) and a second buffer */
    uint32_t *hist;        /* [VARLEN_RADIX_BUCKETS] counts, then offsets, of one key byte */
    const di_alloc *alloc; /* what everything above came from */
};

/* The IEEE bits of a confidence in [0, 1] (-0 is made +0): they grow with the value. */
static uint64_t conf_bits(double c)
{
    uint64_t bits;
    c += 0.0;
    memcpy(&bits, &c, sizeof(bits));
    return bits;
}

/* Stable LSD radix sort of r[0..k) on the key bytes that differ between drafts (drafts from
 * float confidences share their low bits, confidences of one range their top byte): per byte
 * a counting loop and a scatter loop, O(D), no data-dependent branches. Returns the sorted
 * buffer (r or tmp). */
static uint64_t *radix_by_key(uint64_t *r, uint64_t *tmp, size_t k, uint32_t differ,
                              uint32_t *h)
{
    for (int b = 0; b < 4; b++) {
        int shift = 32 + 8 * b;
        if (((differ >> (8 * b)) & 0xff) == 0)
            continue; /* every key has this byte */
        memset(h, 0, VARLEN_RADIX_BUCKETS * sizeof(*h));
        for (size_t i = 0; i < k; i++)
            h[(r[i] >> shift) & 0xff]++;
        uint32_t at = 0;
        for (int v = 0; v < VARLEN_RADIX_BUCKETS; v++) {
            uint32_t c = h[v];
            h[v] = at;
            at += c;
        }
        for (size_t i = 0; i < k; i++)
            tmp[h[(r[i] >> shift) & 0xff]++] = r[i];
        uint64_t *x = r;
        r = tmp;
        tmp = x;
    }
    return r;
}

/* Ranks every draft (the ranking of varlen.h: highest first, ties to the lower request, then
 * to the earlier draft). The drafts are laid out in request order; the key of each is 32 bits
 * of its confidence's bits, complemented so that ascending keys are descending confidences:
 * the 32 bits ending at the highest bit that differs between drafts. Bits above it are the
 * same in every draft, so when no lower bit differs (confidences from floats within a range
 * of 2^-6 .. 1 differ in about 26 bits) keys and confidences are in the same order and the
 * stable radix sort is the ranking. Otherwise runs of equal keys are put in order of the full
 * confidence by a stable insertion; such runs hold confidences within a relative 2^-31 of each
 * other, and equal confidences never move, so they are short except for contrived input. */
static const uint64_t *rank_drafts(varlen_planner *p, const varlen_request *reqs, uint32_t n,
                                   size_t *count)
{
    uint64_t any = 0, all = ~0ull;
    size_t k = 0;
    for (uint32_t i = 0; i < n; i++)
        for (uint32_t d = 0; d < reqs[i].num_drafts; d++) {
            uint64_t bits = conf_bits(reqs[i].conf[d]);
            p->conf[k] = reqs[i].conf[d];
            p->who[k] = i << VARLEN_IDX_BITS | d;
            any |= bits;
            all &= bits;
            k++;
        }
    *count = k;
    uint64_t differ = k ? any ^ all : 0;
    if (differ == 0)
        for (size_t i = 0; i < k; i++)
            p->a[i] = i; /* all equal: request order is the ranking */
    if (differ == 0)
        return p->a;
    int top = 63 - __builtin_clzll(differ), shift = top > 31 ? top - 31 : 0;
    for (size_t i = 0; i < k; i++)
        p->a[i] = (uint64_t)(uint32_t)~(conf_bits(p->conf[i]) >> shift) << 32 | i;
    uint64_t *r = radix_by_key(p->a, p->b, k, (uint32_t)(differ >> shift), p->hist);
    if ((differ & ((1ull << shift) - 1)) == 0)
        return r;
    for (size_t i = 1; i < k; i++) {
        uint64_t e = r[i];
        double c = p->conf[(uint32_t)e];
        size_t j = i;
        while (j > 0 && r[j - 1] >> 32 == e >> 32 && p->conf[(uint32_t)r[j - 1]] < c) {
            r[j] = r[j - 1];
            j--;
        }
        r[j] = e;
    }
    return r;
}

/* The scan proper: best prefix length of the ranking, with its figures. */
typedef struct scan_best {
    size_t drafts;   /* prefix length */
    uint32_t graph;  /* graph rows */
    double tokens;   /* expected tokens */
    double step_ms;  /* graph time + sampler */
} scan_best;

static scan_best scan(const uint64_t *r, const double *conf, size_t total, uint32_t n,
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
        tokens += conf[(uint32_t)r[k]];
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
        p->conf = di_alloc_mem(a, nd * sizeof(*p->conf));
        p->who = di_alloc_mem(a, nd * sizeof(*p->who));
        p->a = di_alloc_mem(a, nd * sizeof(*p->a));
        p->b = di_alloc_mem(a, nd * sizeof(*p->b));
        p->hist = di_alloc_mem(a, VARLEN_RADIX_BUCKETS * sizeof(*p->hist));
    }
    if (!p || !p->conf || !p->who || !p->a || !p->b || !p->hist) {
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
    di_alloc_release(a, p->conf);
    di_alloc_release(a, p->who);
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
    const uint64_t *r = rank_drafts(p, reqs, n, &total);
    scan_best b = scan(r, p->conf, total, n, p->t, p->ntimes, p->sampler_ms);
    memset(drafts, 0, (size_t)n * sizeof(*drafts));
    for (size_t k = 0; k < b.drafts; k++) {
        uint32_t who = p->who[(uint32_t)r[k]], req = who >> VARLEN_IDX_BITS;
        /* A prefix of the ranking holds each request's first drafts, in order. */
        assert((who & ((1u << VARLEN_IDX_BITS) - 1)) == drafts[req]);
        drafts[req]++;
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
