/* stats.h: the figures di-bench reports, from per-request records. Pure. Prefix: bst_.
 *
 * Per request: TTFT (request sent to first text), E2E (sent to the end), TPOT = (E2E - TTFT) /
 * (output tokens - 1) for requests with at least 2 output tokens, and every gap between two
 * text events (ITL). Percentiles use linear interpolation between closest ranks (numpy's
 * default). Goodput counts requests that met every SLO given (a 0 SLO is not checked). The
 * prefix-cache hit rate is the completed requests' cached prompt tokens (the router's
 * usage.prompt_tokens_details.cached_tokens) over their prompt tokens.
 */
#ifndef DI_BENCH_STATS_H
#define DI_BENCH_STATS_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

typedef struct bst_req {
    int ok;            /* 1: completed with status 200 and [DONE] */
    double ttft_s;     /* sent -> first text */
    double e2e_s;      /* sent -> end */
    uint32_t in_tok;   /* prompt tokens */
    uint32_t out_tok;  /* output tokens (usage, else text events) */
    uint32_t cached_tok; /* prompt tokens served from the KV store (usage) */
} bst_req;

typedef struct bst_dist {
    double mean, median, p90, p99, max;
    size_t n;
} bst_dist;

typedef struct bst_slo {
    double ttft_s, tpot_s, e2e_s; /* 0: not checked */
} bst_slo;

typedef struct bst_report {
    size_t completed, failed;
    double duration_s;        /* first send to last end */
    uint64_t in_tokens, out_tokens;
    uint64_t cached_tokens;   /* of in_tokens, served from the KV store */
    double hit_rate;          /* cached_tokens / in_tokens; 0 when no prompt token */
    double req_per_s, out_tok_per_s, total_tok_per_s;
    double goodput_req_per_s; /* requests meeting every SLO, per second */
    bst_dist ttft, tpot, itl, e2e; /* seconds */
} bst_report;

/* Sorts v in place and fills d. n may be 0 (all zeros). */
void bst_dist_of(double *v, size_t n, bst_dist *d);

/* Linear-interpolated percentile p in [0, 100] of sorted v (n >= 1). */
double bst_percentile(const double *sorted, size_t n, double p);

/* Builds the report; itl holds n_itl gaps (sorted in place). Returns 0, or -1 when out of
 * memory. */
int bst_report_of(const bst_req *reqs, size_t n, double *itl, size_t n_itl, double duration_s,
                  const bst_slo *slo, bst_report *out);

/* The table (vllm bench serve's layout) and the JSON object (one line). */
void bst_print_table(FILE *f, const bst_report *r, const char *title);
void bst_print_json(FILE *f, const bst_report *r, double rate);

#endif
