/* check_step: the graph machinery of the CUDA backend (kern_cuda_graphs) on small segments: a
 * segment captured, the next with the same actions launched as kept with its new uploaded
 * metadata, one whose arguments or kernels changed captured afresh, an op failing inside a
 * segment (what was logged before it runs), device work bypassing the log refused, each
 * result against the host's copy; then the one-step-ahead fix-up (kern_cuda_step_ahead)
 * against its C twin (kernels/cpu/step_ahead.h), bit for bit: random steps of 1 to 64
 * sequences with 0 to 3 drafts, accepted counts from 0 (a finished sequence: placeholder rows) to all, rows in
 * shuffled order with gaps; the same calls captured into a CUDA graph and replayed with new
 * inputs in the same buffers; a bad accepted count reported at the next synchronisation.
 * --bench: device time of one fix-up of 64 sequences, eager and as a graph node.
 * Exit 0: all match; 1: a mismatch; 2: setup error. */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/util/clock.h"
#include "kernels/cpu/step_ahead.h"
#include "kernels/cuda/backend_cuda.h"
#include "tests/gpu/check_util.h"
#include "tests/gpu/gpu_common.h"

static const char usage[] =
    "usage: check_step [--bench] [--seed N]\n"
    "  the CUDA one-step-ahead fix-up against its C twin; --bench adds its timing\n";

/* Host inputs and outputs of one case, and the device copies. */
typedef struct step_bufs {
    kern_step_ahead h;          /* host arrays */
    kern_step_ahead d;          /* device arrays, same sizes */
} step_bufs;

static void *dev_of(chk_env *env, const void *h, size_t bytes)
{
    return chk_dev_copy(env, h, bytes ? bytes : 8);
}

static void make_case(chk_env *env, di_rng *rng, uint32_t n_seqs, uint32_t nextn, step_bufs *b)
{
    const uint32_t per = nextn + 1, stride = per, gap = 3, rows = n_seqs * (per + gap) + 1;
    kern_step_ahead *h = &b->h;
    memset(h, 0, sizeof(*h));
    h->n_seqs = n_seqs, h->nextn = nextn, h->n_rows = rows, h->out_stride = stride;
    int64_t *base = chk_malloc(n_seqs * 8u + 8);
    int32_t *acc = chk_malloc(n_seqs * 4u + 8), *toks = chk_malloc(n_seqs * stride * 4u + 8);
    int32_t *drafts = chk_malloc(n_seqs * nextn * 4u + 8);
    uint32_t *row0 = chk_malloc(n_seqs * 4u + 8), *order = chk_malloc(n_seqs * 4u + 8);
    for (uint32_t s = 0; s < n_seqs; s++)
        order[s] = s;
    for (uint32_t s = n_seqs; s > 1; s--) { /* sequences placed in shuffled order */
        uint32_t j = (uint32_t)di_rng_below(rng, s), t = order[s - 1];
        order[s - 1] = order[j], order[j] = t;
    }
    for (uint32_t s = 0; s < n_seqs; s++) {
        base[s] = (int64_t)di_rng_below(rng, 1u << 20);
        acc[s] = (int32_t)di_rng_below(rng, per + 1);
        row0[s] = order[s] * (per + gap) + (uint32_t)di_rng_below(rng, gap + 1);
        for (uint32_t j = 0; j < stride; j++)
            toks[s * stride + j] = (int32_t)di_rng_below(rng, 129280);
        for (uint32_t j = 0; j < nextn; j++)
            drafts[s * nextn + j] = (int32_t)di_rng_below(rng, 129280);
    }
    free(order);
    h->base_len = base, h->accepted = acc, h->tokens = toks, h->drafts = drafts, h->row0 = row0;
    h->seqlen_k = chk_malloc(n_seqs * 8u + 8), h->ids = chk_malloc(rows * 4u);
    h->positions = chk_malloc(rows * 8u), h->live = chk_malloc(rows);
    chk_poison(h->seqlen_k, n_seqs * 8u), chk_poison(h->ids, rows * 4u);
    chk_poison(h->positions, rows * 8u), chk_poison(h->live, rows);
    kern_step_ahead *d = &b->d;
    *d = *h;
    d->base_len = dev_of(env, base, n_seqs * 8u), d->accepted = dev_of(env, acc, n_seqs * 4u);
    d->tokens = dev_of(env, toks, n_seqs * stride * 4u);
    d->drafts = dev_of(env, drafts, n_seqs * nextn * 4u), d->row0 = dev_of(env, row0, n_seqs * 4u);
    d->seqlen_k = dev_of(env, h->seqlen_k, n_seqs * 8u), d->ids = dev_of(env, h->ids, rows * 4u);
    d->positions = dev_of(env, h->positions, rows * 8u), d->live = dev_of(env, h->live, rows);
}

static void free_case(chk_env *env, step_bufs *b)
{
    kern_step_ahead *h = &b->h, *d = &b->d;
    free((void *)h->base_len), free((void *)h->accepted), free((void *)h->tokens);
    free((void *)h->drafts), free((void *)h->row0), free(h->seqlen_k), free(h->ids);
    free(h->positions), free(h->live);
    chk_dev_free(env, (void *)d->base_len), chk_dev_free(env, (void *)d->accepted);
    chk_dev_free(env, (void *)d->tokens), chk_dev_free(env, (void *)d->drafts);
    chk_dev_free(env, (void *)d->row0), chk_dev_free(env, d->seqlen_k), chk_dev_free(env, d->ids);
    chk_dev_free(env, d->positions), chk_dev_free(env, d->live);
}

/* The device outputs against the twin's; 0 when equal. */
static size_t compare(chk_env *env, const step_bufs *b, const char *what)
{
    const kern_step_ahead *h = &b->h, *d = &b->d;
    size_t bytes[4] = {h->n_seqs * 8u, h->n_rows * 4u, h->n_rows * 8u, h->n_rows};
    const void *hp[4] = {h->seqlen_k, h->ids, h->positions, h->live};
    const void *dp[4] = {d->seqlen_k, d->ids, d->positions, d->live};
    static const char *names[4] = {"seqlen_k", "ids", "positions", "live"};
    size_t bad = 0;
    for (int i = 0; i < 4; i++) {
        void *g = chk_malloc(bytes[i] + 8);
        chk_get(env, g, dp[i], bytes[i]);
        if (memcmp(g, hp[i], bytes[i]) != 0 && bad++ < 4)
            fprintf(stderr, "MISMATCH %s: %s differs from the twin\n", what, names[i]);
        free(g);
    }
    return bad;
}

static void check_case(chk_env *env, uint32_t n_seqs, uint32_t nextn, int graph)
{
    di_rng rng;
    uint64_t seed = chk_case_rng(env, &rng);
    char what[128];
    snprintf(what, sizeof what, "step ahead seqs=%u nextn=%u%s seed=%" PRIu64, n_seqs, nextn,
             graph ? " (graph, replayed with new inputs)" : "", seed);
    step_bufs b;
    make_case(env, &rng, n_seqs, nextn, &b);
    di_error e;
    size_t bad = 0;
    if (graph && kern_cuda_graphs(&env->gpu, 1, &e) != DI_OK)
        bad++;
    if (kern_cuda_step_ahead(&env->gpu, &b.d, &e) != DI_OK || kern_cuda_sync(&env->gpu, &e) != DI_OK) {
        fprintf(stderr, "FAIL %s: %s\n", what, e.msg);
        bad++;
    }
    if (graph && !bad) { /* new inputs in the same buffers, the graph launched again */
        int32_t *acc = (int32_t *)b.h.accepted;
        for (uint32_t s = 0; s < n_seqs; s++)
            acc[s] = (int32_t)di_rng_below(&rng, nextn + 2);
        chk_put(env, (void *)b.d.accepted, acc, n_seqs * 4u);
        if (kern_cuda_graph_relaunch(&env->gpu, &e) != DI_OK ||
            kern_cuda_sync(&env->gpu, &e) != DI_OK) {
            fprintf(stderr, "FAIL %s: relaunch: %s\n", what, e.msg);
            bad++;
        }
    }
    if (graph)
        kern_cuda_graphs(&env->gpu, 0, &e);
    if (kern_step_ahead_run(&b.h, &e) != DI_OK) {
        fprintf(stderr, "FAIL %s: twin: %s\n", what, e.msg);
        bad++;
    }
    if (!bad)
        bad = compare(env, &b, what);
    chk_count(env, bad);
    free_case(env, &b);
}

static void check_bad_count(chk_env *env)
{
    di_rng rng;
    chk_case_rng(env, &rng);
    step_bufs b;
    make_case(env, &rng, 4, 2, &b);
    int32_t acc[4] = {1, 4, 2, 0}; /* 4 > out_stride 3 */
    chk_put(env, (void *)b.d.accepted, acc, sizeof(acc));
    di_error e;
    size_t bad = chk_expect(env, kern_cuda_step_ahead(&env->gpu, &b.d, &e), DI_OK,
                            "step ahead with accepted 4 of 3 (queued)");
    bad += chk_expect(env, kern_cuda_sync(&env->gpu, &e), DI_EINVAL, "the sync reports it");
    bad += chk_expect(env, kern_cuda_sync(&env->gpu, &e), DI_OK, "once");
    chk_count(env, bad);
    free_case(env, &b);
}

/* copy_rows of 4 rows of 64 bytes in the order rows[4] (the row list is the op's uploaded
 * metadata), checked against the host's copy; in place (overlap: staged, a second kernel) when
 * inplace. Returns mismatches. */
static size_t graph_copy(chk_env *env, uint8_t *src, uint8_t *dst, const int32_t *rows,
                         int inplace, const char *what)
{
    uint8_t h[256], g[256], want[256];
    for (int i = 0; i < 256; i++)
        h[i] = (uint8_t)(i * 7 + (inplace ? 3 : 1) + (uintptr_t)dst);
    for (int r = 0; r < 4; r++)
        memcpy(want + r * 64, h + rows[r] * 64, 64);
    chk_put(env, src, h, sizeof(h));
    kern_copy_rows c = {.n_rows = 4, .row_bytes = 64, .src = src, .src_stride = 64,
                        .rows = rows, .dst = inplace ? src : dst, .dst_stride = 64};
    di_error e;
    di_status st = env->gpu.ops.copy_rows(env->gpu.ctx, &c);
    if (st == DI_OK)
        st = kern_cuda_sync(&env->gpu, &e);
    if (st != DI_OK) {
        fprintf(stderr, "FAIL %s: %s\n", what, kern_cuda_last_error(&env->gpu));
        return 1;
    }
    chk_get(env, g, inplace ? src : dst, sizeof(g));
    if (memcmp(g, want, sizeof(g)) != 0) {
        fprintf(stderr, "MISMATCH %s: rows copied wrong\n", what);
        return 1;
    }
    return 0;
}

static size_t graph_expect(const kern_cuda_stats *a, const kern_cuda_stats *b, uint64_t inst,
                           uint64_t replays, const char *what)
{
    uint64_t i = b->graph_instantiations - a->graph_instantiations;
    uint64_t r = b->graph_replays - a->graph_replays;
    if (i == inst && r == replays)
        return 0;
    fprintf(stderr, "MISMATCH %s: %" PRIu64 " instantiated and %" PRIu64 " launched as kept, "
            "expected %" PRIu64 " and %" PRIu64 "\n", what, i, r, inst, replays);
    return 1;
}

static void check_graph_paths(chk_env *env)
{
    uint8_t *a = chk_dev_alloc(env, 1024), *b = chk_dev_alloc(env, 1024);
    static const int32_t fwd[4] = {0, 1, 2, 3}, rev[4] = {3, 1, 0, 2};
    di_error e;
    kern_cuda_stats s0, s1;
    size_t bad = chk_expect(env, kern_cuda_graphs(&env->gpu, 1, &e), DI_OK, "graphs on");
    kern_cuda_get_stats(&env->gpu, &s0);
    bad += graph_copy(env, a, b, fwd, 0, "graph: first segment");
    kern_cuda_get_stats(&env->gpu, &s1);
    bad += graph_expect(&s0, &s1, 1, 0, "graph: first segment (captured)");
    s0 = s1;
    /* the same kernels and sizes with another row list: the kept graph, its upload's bytes new */
    bad += graph_copy(env, a, b, rev, 0, "graph: same segment, other row list");
    kern_cuda_get_stats(&env->gpu, &s1);
    bad += graph_expect(&s0, &s1, 0, 1, "graph: same segment, other row list (kept graph)");
    s0 = s1;
    /* the rows' addresses are uploaded too (copy items): still the kept graph */
    bad += graph_copy(env, a + 512, b + 512, fwd, 0, "graph: other buffers");
    kern_cuda_get_stats(&env->gpu, &s1);
    bad += graph_expect(&s0, &s1, 0, 1, "graph: other buffers (uploaded addresses: kept graph)");
    s0 = s1;
    bad += graph_copy(env, a, b, rev, 1, "graph: in place");
    kern_cuda_get_stats(&env->gpu, &s1);
    bad += graph_expect(&s0, &s1, 1, 0, "graph: a staged copy (other kernels: captured)");
    int charged = 0;
    for (int k = 0; k < 8; k++)
        charged |= strncmp(s1.graph_misses[k].what, "copy_rows: ", 11) == 0;
    if (!charged && bad++ < 4)
        fprintf(stderr, "MISMATCH graph: the staged copy's capture is not charged to copy_rows "
                "('%s')\n", s1.graph_misses[0].what);
    s0 = s1;
    bad += graph_copy(env, a, b, fwd, 0, "graph: the first segment again");
    kern_cuda_get_stats(&env->gpu, &s1);
    bad += graph_expect(&s0, &s1, 0, 1, "graph: the first segment again (kept graph)");
    /* an op failing inside a segment: the copy logged before it still runs */
    uint8_t h[64], g[64];
    for (int i = 0; i < 64; i++)
        h[i] = (uint8_t)(200 - i);
    chk_put(env, a + 768, h, sizeof(h));
    kern_copy_rows c = {.n_rows = 1, .row_bytes = 64, .src = a + 768, .src_stride = 64,
                        .dst = b + 768, .dst_stride = 64};
    kern_rmsnorm r = {.n_rows = 1, .dim = 64, .x = NULL, .x_stride = 64, .y = (uint16_t *)b,
                      .y_stride = 64, .eps = 1e-6f};
    bad += chk_expect(env, env->gpu.ops.copy_rows(env->gpu.ctx, &c), DI_OK, "graph: copy");
    bad += chk_expect(env, env->gpu.ops.rmsnorm(env->gpu.ctx, &r), DI_EINVAL,
                      "graph: rmsnorm with x NULL inside the segment");
    bad += chk_expect(env, kern_cuda_sync(&env->gpu, &e), DI_OK, "graph: sync after it");
    chk_get(env, g, b + 768, sizeof(g));
    if (memcmp(g, h, sizeof(g)) != 0 && bad++ < 4)
        fprintf(stderr, "MISMATCH graph: the copy before the failed op did not run\n");
    /* device work queued on the stream behind the log's back is reported, not run out of order */
    bad += chk_expect(env, env->gpu.ops.copy_rows(env->gpu.ctx, &c), DI_OK, "graph: copy (2)");
    cudaMemsetAsync(b, 0, 64, (cudaStream_t)kern_cuda_stream(&env->gpu));
    bad += chk_expect(env, kern_cuda_sync(&env->gpu, &e), DI_EINTERNAL,
                      "graph: a memset outside the log inside a segment");
    bad += chk_expect(env, kern_cuda_sync(&env->gpu, &e), DI_OK, "graph: the next sync");
    kern_cuda_graphs(&env->gpu, 0, &e);
    chk_count(env, bad);
    printf("graphs: captured, kept graph launched with new metadata, captured when the kernels "
           "changed, a failed op inside a segment, work outside the log refused: %s\n",
           bad ? "MISMATCHES" : "as eager");
    chk_dev_free(env, a), chk_dev_free(env, b);
}

static void bench(chk_env *env)
{
    di_rng rng;
    chk_case_rng(env, &rng);
    step_bufs b;
    make_case(env, &rng, 64, 3, &b);
    di_error e;
    const int n = 2000;
    for (int mode = 0; mode < 2; mode++) {
        if (mode)
            kern_cuda_graphs(&env->gpu, 1, &e);
        kern_cuda_step_ahead(&env->gpu, &b.d, &e);
        kern_cuda_sync(&env->gpu, &e);
        uint64_t t0 = di_mono_ns();
        for (int i = 0; i < n; i++)
            if (mode)
                kern_cuda_graph_relaunch(&env->gpu, &e);
            else
                kern_cuda_step_ahead(&env->gpu, &b.d, &e);
        kern_cuda_sync(&env->gpu, &e);
        double us = (double)(di_mono_ns() - t0) / 1e3 / n;
        printf("step ahead, 64 sequences x 4 rows, %s: %.2f us per call (back to back)\n",
               mode ? "graph relaunched" : "eager launch", us);
        if (mode)
            kern_cuda_graphs(&env->gpu, 0, &e);
    }
    free_case(env, &b);
}

int main(int argc, char **argv)
{
    chk_env env;
    int want_bench = chk_init(&env, argc, argv, usage);
    static const uint32_t seqs[] = {1, 3, 8, 64};
    check_graph_paths(&env);
    int c0 = env.checks;
    for (size_t i = 0; i < 4; i++)
        for (uint32_t nextn = 0; nextn <= 3; nextn++)
            check_case(&env, seqs[i], nextn, 0);
    check_case(&env, 8, 3, 1);
    check_case(&env, 64, 1, 1);
    check_bad_count(&env);
    printf("step ahead: %d cases against the twin (two as graphs replayed with new inputs), a "
           "bad accepted count reported at the next synchronisation\n", env.checks - c0);
    return chk_finish(&env, "check_step", want_bench, bench);
}
