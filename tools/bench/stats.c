/* stats.c: percentiles, throughput and goodput (see stats.h). */
#include "tools/bench/stats.h"

#include <stdlib.h>
#include <string.h>

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

double bst_percentile(const double *v, size_t n, double p)
{
    double pos = p / 100.0 * (double)(n - 1);
    size_t lo = (size_t)pos;
    if (lo + 1 >= n)
        return v[n - 1];
    return v[lo] + (v[lo + 1] - v[lo]) * (pos - (double)lo);
}

void bst_dist_of(double *v, size_t n, bst_dist *d)
{
    *d = (bst_dist){.n = n};
    if (n == 0)
        return;
    qsort(v, n, sizeof *v, cmp_double);
    double sum = 0;
    for (size_t i = 0; i < n; i++)
        sum += v[i];
    d->mean = sum / (double)n;
    d->median = bst_percentile(v, n, 50);
    d->p90 = bst_percentile(v, n, 90);
    d->p99 = bst_percentile(v, n, 99);
    d->max = v[n - 1];
}

int bst_report_of(const bst_req *reqs, size_t n, double *itl, size_t n_itl, double duration_s,
                  const bst_slo *slo, bst_report *out)
{
    double *ttft = malloc((n ? n : 1) * sizeof *ttft);
    double *tpot = malloc((n ? n : 1) * sizeof *tpot);
    double *e2e = malloc((n ? n : 1) * sizeof *e2e);
    if (!ttft || !tpot || !e2e) {
        free(ttft), free(tpot), free(e2e);
        return -1;
    }
    bst_report r = {.duration_s = duration_s};
    size_t nt = 0, good = 0;
    for (size_t i = 0; i < n; i++) {
        const bst_req *q = &reqs[i];
        if (!q->ok) {
            r.failed++;
            continue;
        }
        ttft[r.completed] = q->ttft_s;
        e2e[r.completed] = q->e2e_s;
        r.completed++;
        r.in_tokens += q->in_tok;
        r.out_tokens += q->out_tok;
        r.cached_tokens += q->cached_tok < q->in_tok ? q->cached_tok : q->in_tok;
        double tp = 0;
        if (q->out_tok > 1)
            tpot[nt++] = tp = (q->e2e_s - q->ttft_s) / (q->out_tok - 1);
        if ((!slo->ttft_s || q->ttft_s <= slo->ttft_s) && (!slo->tpot_s || tp <= slo->tpot_s) &&
            (!slo->e2e_s || q->e2e_s <= slo->e2e_s))
            good++;
    }
    bst_dist_of(ttft, r.completed, &r.ttft);
    bst_dist_of(tpot, nt, &r.tpot);
    bst_dist_of(e2e, r.completed, &r.e2e);
    bst_dist_of(itl, n_itl, &r.itl);
    r.hit_rate = r.in_tokens ? (double)r.cached_tokens / (double)r.in_tokens : 0;
    if (duration_s > 0) {
        r.req_per_s = (double)r.completed / duration_s;
        r.out_tok_per_s = (double)r.out_tokens / duration_s;
        r.total_tok_per_s = (double)(r.in_tokens + r.out_tokens) / duration_s;
        r.goodput_req_per_s = (double)good / duration_s;
    }
    free(ttft), free(tpot), free(e2e);
    *out = r;
    return 0;
}

void bst_print_table(FILE *f, const bst_report *r, const char *title)
{
    fprintf(f, "============ %s ============\n", title);
    fprintf(f, "%-34s%12zu\n", "Successful requests:", r->completed);
    fprintf(f, "%-34s%12zu\n", "Failed requests:", r->failed);
    fprintf(f, "%-34s%12.2f\n", "Benchmark duration (s):", r->duration_s);
    fprintf(f, "%-34s%12llu\n", "Total input tokens:", (unsigned long long)r->in_tokens);
    fprintf(f, "%-34s%12llu\n", "Total cached prompt tokens:",
            (unsigned long long)r->cached_tokens);
    fprintf(f, "%-34s%12llu\n", "Total generated tokens:", (unsigned long long)r->out_tokens);
    fprintf(f, "%-34s%12.2f\n", "Request throughput (req/s):", r->req_per_s);
    fprintf(f, "%-34s%12.2f\n", "Request goodput (req/s):", r->goodput_req_per_s);
    fprintf(f, "%-34s%12.2f\n", "Output token throughput (tok/s):", r->out_tok_per_s);
    fprintf(f, "%-34s%12.2f\n", "Total token throughput (tok/s):", r->total_tok_per_s);
    fprintf(f, "%-34s%12.2f\n", "Prefix cache hit rate (%):", r->hit_rate * 100);
    const struct {
        const char *name;
        const bst_dist *d;
    } rows[] = {{"TTFT", &r->ttft}, {"TPOT", &r->tpot}, {"ITL", &r->itl}, {"E2EL", &r->e2e}};
    for (size_t i = 0; i < 4; i++) {
        fprintf(f, "---- %s ----\n", rows[i].name);
        fprintf(f, "Mean %s (ms):%*s%12.2f\n", rows[i].name, (int)(25 - strlen(rows[i].name)), "",
                rows[i].d->mean * 1e3);
        fprintf(f, "Median %s (ms):%*s%12.2f\n", rows[i].name, (int)(23 - strlen(rows[i].name)),
                "", rows[i].d->median * 1e3);
        fprintf(f, "P90 %s (ms):%*s%12.2f\n", rows[i].name, (int)(26 - strlen(rows[i].name)), "",
                rows[i].d->p90 * 1e3);
        fprintf(f, "P99 %s (ms):%*s%12.2f\n", rows[i].name, (int)(26 - strlen(rows[i].name)), "",
                rows[i].d->p99 * 1e3);
    }
    fprintf(f, "==================================================\n");
}

static void dist_json(FILE *f, const char *name, const bst_dist *d)
{
    fprintf(f, ",\"mean_%s_ms\":%.6g,\"median_%s_ms\":%.6g,\"p90_%s_ms\":%.6g,\"p99_%s_ms\":%.6g",
            name, d->mean * 1e3, name, d->median * 1e3, name, d->p90 * 1e3, name, d->p99 * 1e3);
}

void bst_print_json(FILE *f, const bst_report *r, double rate)
{
    fprintf(f, "{\"request_rate\":%.6g,\"completed\":%zu,\"failed\":%zu,\"duration_s\":%.6g,"
               "\"total_input_tokens\":%llu,\"total_output_tokens\":%llu,"
               "\"total_cached_tokens\":%llu,\"prefix_cache_hit_rate\":%.6g,"
               "\"request_throughput\":%.6g,\"request_goodput\":%.6g,"
               "\"output_throughput\":%.6g,\"total_token_throughput\":%.6g",
            rate, r->completed, r->failed, r->duration_s, (unsigned long long)r->in_tokens,
            (unsigned long long)r->out_tokens, (unsigned long long)r->cached_tokens, r->hit_rate,
            r->req_per_s, r->goodput_req_per_s,
            r->out_tok_per_s, r->total_tok_per_s);
    dist_json(f, "ttft", &r->ttft);
    dist_json(f, "tpot", &r->tpot);
    dist_json(f, "itl", &r->itl);
    dist_json(f, "e2el", &r->e2e);
    fprintf(f, "}\n");
}
