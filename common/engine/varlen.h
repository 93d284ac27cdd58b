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

#include "common/util/status.h"

/* Most requests and most drafts per request one call accepts (bounds the work and memory). */
#define VARLEN_MAX_REQUESTS (1u << 20)
#define VARLEN_MAX_DRAFTS 64u

/* One request's drafts, written by the caller. */
typedef struct varlen_request {
    const double *conf;  /* [num_drafts] cumulative acceptance chance of draft i, in [0, 1],
                            non-increasing in i; may be NULL when num_drafts is 0 */
    uint32_t num_drafts; /* drafts proposed (nextn); 0..VARLEN_MAX_DRAFTS */
} varlen_request;

/* One measured graph size, written by the caller (the start-up measurement). */
typedef struct varlen_graph_time {
    uint32_t rows;  /* rows of the recorded graph; >= 1, unique within a table */
    double step_ms; /* measured time of one step on it (ms); finite and > 0 */
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
 * order). sampler_ms is the sampler's time per step (finite, >= 0).
 * Returns DI_OK and fills *out; DI_EINVAL when n is 0 or above VARLEN_MAX_REQUESTS, a request
 * has more than VARLEN_MAX_DRAFTS drafts, a confidence is outside [0, 1] or increases within
 * its request, the table is empty, has a repeated or zero size or a bad time, or its largest
 * size is smaller than n (not even one row per request fits); DI_ENOMEM. On failure *out is
 * untouched. */
di_status varlen_schedule(const varlen_request *reqs, uint32_t n, const varlen_graph_time *times,
                          size_t ntimes, double sampler_ms, varlen_plan *out, di_error *err);

/* Frees the drafts array and zeroes the plan. NULL-safe. */
void varlen_plan_free(varlen_plan *plan);

#endif
