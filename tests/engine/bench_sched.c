/* bench_sched: the scheduler's CPU time per decode step, per running request.
 *
 * A COMPLETION engine with R running requests (64 and 256), nextn 5, decodes for a few
 * thousand steps; the synthetic runner accepts each draft with probability 0.7. Only
 * sched_schedule + sched_process_outputs are timed, on the thread's CPU clock; the runner is
 * not. The figure is ns per request per step; the target is under 1,000 ns. Each size runs
 * with MTP varlen off and on; with varlen on the runner reports draft confidences (acceptance
 * spread 0.2 around 0.7, noise 0.05) and the step-time table is the explainer's fit, 8.8 ms +
 * 0.0168 ms per row, at every recorded graph size.
 *
 * The hardware reference, measured in the same run: one memcpy pass over the bytes the
 * scheduler must touch per request per step (its sequence, its plan entry and row tokens, its
 * result and its output), hot in cache as the scheduler's are. A scheduler cannot do its work
 * in less time than it takes to move its working set once; the ratio says how far above that
 * floor it is.
 *
 * Usage: bench_sched [steps] (default 3000). Prints one block per size, then "ok" or the
 * first size that missed the target (exit 1).
 */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/engine/graphs.h"
#include "common/engine/scheduler.h"
#include "common/engine/synth.h"
#include "common/util/clock.h"

typedef struct bench_result {
    double ns_per_req;   /* median over repetitions */
    double ns_per_step;
    double memcpy_ns_per_req;
    size_t bytes_per_req;
    double rows_per_step;
} bench_result;

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

static int die(const char *what, const di_error *e)
{
    fprintf(stderr, "bench_sched: %s: %s\n", what, e->msg);
    return 1;
}

/* The step-time table: 8.8 ms + 0.0168 ms per row at every recorded size for r requests. */
static varlen_graph_time *bench_table(uint32_t r, uint32_t *n)
{
    graph_sizes g;
    if (graph_sizes_init(&g, r, 5, 8, NULL) != DI_OK)
        return NULL;
    varlen_graph_time *t = malloc(g.count * sizeof(*t));
    for (size_t i = 0; t && i < g.count; i++)
        t[i] = (varlen_graph_time){g.sizes[i], 8.8 + 0.0168 * g.sizes[i]};
    *n = (uint32_t)g.count;
    graph_sizes_free(&g);
    return t;
}

/* R running requests, each with 1,000 tokens of prompt KV; none ends during the run. */
static int bench_setup(uint32_t r, uint32_t steps, bool varlen, sched **out, synth **yout)
{
    sched_config c;
    sched_config_default(&c);
    c.type = SCHED_COMPLETION;
    c.max_num_seqs = r;
    c.num_slots = r;
    c.nextn = 5;
    c.max_model_len = 1000 + 6 * (steps + 200) + 64;
    c.num_blocks = 1 + r * (c.max_model_len / 128 + 2);
    c.max_waiting = r;
    varlen_graph_time *table = NULL;
    if (varlen && !(table = bench_table(r, &c.n_step_ms))) {
        fprintf(stderr, "bench_sched: out of memory for the step-time table\n");
        return 1;
    }
    c.varlen = varlen;
    c.step_ms = table;
    di_error e;
    di_status st = sched_create(&c, out, &e);
    free(table);
    if (st != DI_OK)
        return die("create", &e);
    static int32_t tok[1001];
    for (int i = 0; i < 1001; i++)
        tok[i] = 3 + i % 1000;
    for (uint32_t i = 0; i < r; i++) {
        sched_request q = {.id = i, .prompt = tok, .prompt_len = 1000, .output = tok + 1000,
                           .output_len = 1, .max_tokens = c.max_model_len, .ignore_eos = true,
                           .kv_cached = 1000, .window_cached = true};
        if (sched_add_request(*out, &q, &e) != DI_OK)
            return die("add", &e);
    }
    synth_config sc = {.seed = 42, .nextn = 5, .vocab_size = 32000, .eos_token = -1,
                       .accept_rate = 0.7, .confidences = varlen,
                       .accept_spread = varlen ? 0.2 : 0.0, .conf_noise = varlen ? 0.05 : 0.0};
    if (synth_create(&sc, r, NULL, yout, &e) != DI_OK)
        return die("synth", &e);
    return 0;
}

/* CPU ns of `steps` decode steps (schedule + process), runner excluded. */
static int bench_steps(sched *s, synth *y, uint32_t steps, uint64_t *ns, uint64_t *rows)
{
    di_error e;
    *ns = 0;
    *rows = 0;
    for (uint32_t i = 0; i < steps; i++) {
        sched_plan *p;
        const sched_output *o;
        size_t n;
        uint64_t t0 = di_thread_cpu_ns();
        if (sched_schedule(s, &p, &e) != DI_OK)
            return die("schedule", &e);
        uint64_t t1 = di_thread_cpu_ns();
        const sched_seq_result *r = synth_run(y, p);
        uint64_t t2 = di_thread_cpu_ns();
        if (sched_process_outputs(s, p, r, p->n_seqs, &o, &n, &e) != DI_OK)
            return die("process", &e);
        *ns += (t1 - t0) + (di_thread_cpu_ns() - t2);
        *rows += p->n_rows;
    }
    return 0;
}

/* Thread-CPU ns per request of one memcpy pass over bytes_per_req * r bytes, hot. */
static double bench_memcpy(size_t bytes_per_req, uint32_t r)
{
    size_t n = bytes_per_req * r;
    unsigned char *a = malloc(n), *b = malloc(n);
    if (!a || !b) {
        free(a);
        free(b);
        return -1;
    }
    memset(a, 1, n);
    memset(b, 2, n);
    enum { REPS = 20000 };
    uint64_t t0 = di_thread_cpu_ns();
    for (int i = 0; i < REPS; i++) {
        memcpy(i & 1 ? a : b, i & 1 ? b : a, n);
        __asm__ __volatile__("" : : "r"(a), "r"(b) : "memory");
    }
    double ns = (double)(di_thread_cpu_ns() - t0) / REPS / r;
    free(a);
    free(b);
    return ns;
}

static int bench_size(uint32_t r, uint32_t steps, bool varlen, bench_result *out)
{
    enum { REPS = 5 };
    double per_req[REPS];
    uint64_t rows_total = 0;
    for (int k = 0; k < REPS; k++) {
        sched *s = NULL;
        synth *y = NULL;
        if (bench_setup(r, steps, varlen, &s, &y))
            return 1;
        uint64_t ns, rows;
        if (bench_steps(s, y, 50, &ns, &rows) || bench_steps(s, y, steps, &ns, &rows))
            return 1;
        per_req[k] = (double)ns / steps / r;
        rows_total += rows;
        sched_destroy(s);
        synth_destroy(y);
    }
    qsort(per_req, REPS, sizeof(double), cmp_double);
    out->ns_per_req = per_req[REPS / 2];
    out->ns_per_step = out->ns_per_req * r;
    out->rows_per_step = (double)rows_total / REPS / steps;
    out->bytes_per_req = sizeof(seq) + sizeof(sched_seq_plan) + 6 * sizeof(int32_t) +
                         sizeof(sched_seq_result) + sizeof(sched_output) + 6 * sizeof(int32_t);
    out->memcpy_ns_per_req = bench_memcpy(out->bytes_per_req, r);
    return 0;
}

int main(int argc, char **argv)
{
    uint32_t steps = 3000;
    if (argc > 1) {
        char *end;
        unsigned long v = strtoul(argv[1], &end, 10);
        if (*end || v < 10 || v > 1000000) {
            fprintf(stderr, "bench_sched: steps must be an integer in [10, 1000000]\n");
            return 2;
        }
        steps = (uint32_t)v;
    }
    const uint32_t sizes[2] = {64, 256};
    const double target_ns = 1000.0;
    int missed = 0;
    printf("scheduler CPU time per decode step (schedule + process_outputs, thread CPU clock)\n"
           "COMPLETION engine, nextn 5, draft acceptance 0.7, %u steps, median of 5 runs\n",
           steps);
    for (int k = 0; k < 4; k++) {
        uint32_t r = sizes[k / 2];
        bool varlen = k % 2;
        bench_result b;
        if (bench_size(r, steps, varlen, &b))
            return 1;
        printf("%3u requests, varlen %-3s: %7.1f ns per request per step (%.1f us per step, "
               "%.0f rows), target < %.0f ns: %s\n",
               r, varlen ? "on" : "off", b.ns_per_req, b.ns_per_step / 1000.0, b.rows_per_step,
               target_ns, b.ns_per_req < target_ns ? "met" : "MISSED");
        printf("     baseline: one memcpy pass over the working set (%zu bytes per request), "
               "%.1f ns per request; scheduler / baseline = %.1fx\n",
               b.bytes_per_req, b.memcpy_ns_per_req, b.ns_per_req / b.memcpy_ns_per_req);
        missed += b.ns_per_req >= target_ns;
    }
    printf("%s\n", missed ? "target missed" : "ok");
    return missed ? 1 : 0;
}
