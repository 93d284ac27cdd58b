/* varlen.h: how many drafts each request checks in a decode step (MTP varlen; DESIGN.md §3,
 * explainer Pass 2 "Choosing how many drafts to check").
 *
 * Each request always gets its own row, which always yields one token. Its drafts are offered
 * with their confidences: the chance that the draft is accepted, already multiplied along the
 * request (draft i counts only if drafts 0..i-1 passed), so they never increase within a
 * request. The greedy scan:
 *
 *   1. sort every draft of every request by confidence, highest first; ties go to the lower
 *      request, then to the earlier draft;
 *   2. start with one row per request and expected tokens = number of requests;
 *   3. add drafts in that order; after each, expected tokens = requests + sum of the added
 *      confidences, and the step costs step_ms of the smallest measured graph size that holds
 *      the rows, plus sampler_ms;
 *   4. keep the prefix with the most expected tokens per ms (ties keep the shorter prefix);
 *   5. the rows of that prefix go to its drafts: a request checks as many drafts as it has in
 *      the prefix, which are always its first ones, so no request checks draft i+1 without
 *      draft i.
 *
 * Worked example (explainer): W .95 .90 .80, X .85 .60 .30, Y .50 .20 .10, Z .30 .10 .05;
 * graphs 4 rows 8.1 ms, 8 rows 8.6 ms, 16 rows 12.0 ms; sampler 0.4 ms -> 8 rows, W checks 3
 * drafts, X 1, Y and Z none (7.50 tokens / 9.0 ms).
 */
#ifndef DI_ENGINE_VARLEN_H
#define DI_ENGINE_VARLEN_H

#include <stddef.h>
#include <stdint.h>

#include "common/util/alloc.h"
#include "common/util/status.h"

/* Most requests and most drafts per request one call accepts (bounds the work and memory). */
#define VARLEN_MAX_REQUESTS (1u << 20)
#define VARLEN_MAX_DRAFTS 64u
/* Step and sampler times a table may hold (ms): below a nanosecond or above 11 days the
 * tokens-per-ms figure stops being a finite number. */
#define VARLEN_MIN_MS 1e-6
#define VARLEN_MAX_MS 1e9

/* One request's drafts, written by the caller. */
typedef struct varlen_request {
    const double *conf;  /* [num_drafts] cumulative acceptance chance of draft i, in [0, 1],
                            non-increasing in i; may be NULL when num_drafts is 0 */
    uint32_t num_drafts; /* drafts proposed (nextn); 0..VARLEN_MAX_DRAFTS */
} varlen_request;

/* One measured graph size, written by the caller (the start-up measurement). */
typedef struct varlen_graph_time {
    uint32_t rows;  /* rows of the recorded graph; >= 1, unique within a table */
    double step_ms; /* measured time of one step on it (ms); VARLEN_MIN_MS..VARLEN_MAX_MS */
} varlen_graph_time;

/* The chosen verify lengths, written by varlen_schedule. */
typedef struct varlen_plan {
    uint32_t num_requests;  /* requests planned (= the input count) */
    uint32_t *drafts;       /* [num_requests] drafts each request checks; owned */
    uint32_t rows;          /* rows of the step = num_requests + sum(drafts) */
    uint32_t graph_rows;    /* graph size the step runs on: smallest measured size >= rows */
    double expected_tokens; /* num_requests + sum of the checked drafts' confidences */
    double step_ms;         /* step_ms of graph_rows + sampler_ms */
    double tokens_per_ms;   /* expected_tokens / step_ms, the maximised figure */
} varlen_plan;

/* Runs the greedy scan over n requests against a step-time table of ntimes graph sizes (any
 * order). sampler_ms is the sampler's time per step (0..VARLEN_MAX_MS).
 * Returns DI_OK and fills *out; DI_EINVAL when n is 0 or above VARLEN_MAX_REQUESTS, a request
 * has more than VARLEN_MAX_DRAFTS drafts, a confidence is outside [0, 1] or increases within
 * its request, the table is empty, has a repeated or zero size or a bad time, or its largest
 * size is smaller than n (not even one row per request fits); DI_ENOMEM. On failure *out is
 * untouched. */
di_status varlen_schedule(const varlen_request *reqs, uint32_t n, const varlen_graph_time *times,
                          size_t ntimes, double sampler_ms, varlen_plan *out, di_error *err);

/* Frees the drafts array and zeroes the plan. NULL-safe. */
void varlen_plan_free(varlen_plan *plan);

/* ---- A reusable planner (the scheduler's per-step path) ----
 *
 * The same scan as varlen_schedule, with the step-time table validated and sorted once and
 * every scratch array allocated at creation, so a plan allocates nothing. The ranking is a
 * stable radix sort of the drafts laid out in request order (stability gives the ties to the
 * lower request, then the earlier draft) on 32 bits of each confidence: O(D) per key byte
 * that differs between the D drafts, with no data-dependent branches; confidences that differ
 * only below those 32 bits (a relative 2^-31) are then ordered by an insertion pass, which is
 * quadratic only for contrived input. Both entry points run this code: identical plans. */
typedef struct varlen_planner varlen_planner;

/* The figures of one plan (varlen_plan without the drafts array). */
typedef struct varlen_summary {
    uint32_t rows;          /* num_requests + sum(drafts) */
    uint32_t graph_rows;    /* smallest measured size >= rows */
    double expected_tokens; /* num_requests + sum of the checked drafts' confidences */
    double step_ms;         /* step_ms of graph_rows + sampler_ms */
    double tokens_per_ms;   /* expected_tokens / step_ms */
} varlen_summary;

/* Creates a planner for the table (any order) and sampler_ms, for calls of up to max_requests
 * requests holding up to max_drafts drafts in total; memory from a (NULL: libc).
 * DI_OK with *out set; DI_EINVAL (the table or sampler_ms, as varlen_schedule; max_requests 0
 * or above VARLEN_MAX_REQUESTS; max_drafts above max_requests * VARLEN_MAX_DRAFTS); DI_ENOMEM.
 * On failure *out is untouched. */
di_status varlen_planner_create(const varlen_graph_time *times, size_t ntimes,
                                double sampler_ms, uint32_t max_requests, uint32_t max_drafts,
                                const di_alloc *a, varlen_planner **out, di_error *err);
/* NULL-safe. */
void varlen_planner_free(varlen_planner *p);
/* Largest measured graph size (rows): at most this many requests fit one plan. */
uint32_t varlen_planner_largest(const varlen_planner *p);

/* Plans n requests: drafts[i] receives request i's draft count, *sum (optional) the figures.
 * No allocation. DI_OK; DI_EINVAL (n is 0 or above the planner's max_requests, the drafts
 * above its max_drafts, a request as varlen_schedule, or n above the largest graph); on
 * failure drafts and *sum are untouched. */
di_status varlen_planner_run(varlen_planner *p, const varlen_request *reqs, uint32_t n,
                             uint32_t *drafts, varlen_summary *sum, di_error *err);

#endif
