/* check_attn: the CUDA backend's sparse_attn against its C twin (kern_cpu_create's table), with
 * kernels.h's tolerance: per element |o - o_cpu| <= 2e-2 and, per (row, head), cosine >= 0.9999.
 * Key sets: the window ring (older positions) and this step's local entries, the compressed
 * entries of each row's top-k list read through block tables (ids ascending, -1 padded, with
 * sequences' blocks scattered over the pool), window clips (window_lo), draft blocks
 * (ring_hi: the ring up to P plus every row of the block), rows without a long-range list;
 * heads 1, 4, 8, 20 and 64 (a partial group of 16), head widths 64, 128, 512; queries from zeros
 * to large (one-hot softmax) and sinks that dominate; prefill chunks (rows whose window crosses
 * the chunk start, chunks longer than the window, at V4.1-Flash width too), decode and prefill
 * rows in one call, top-k lists with empty slots among the ids and ids past the block table
 * (empty on the device; the twin, which asserts them, is given -1 there). Every case also runs
 * with q and out two bytes off 16-byte alignment, on the kernel of one CTA per (row, 16 heads)
 * (kern_cuda_config.attn_old) and in batch-invariant mode. Outputs are poisoned first; in batch-invariant mode the last sequence
 * alone must give its rows of the batch bit for bit.
 * With --bench: V4.1-Flash shapes (64 heads of 512, window 128 + 512 top-k entries): decode
 * batches and prefill chunks of 4,096 and 16,384 rows, on the tile kernel and on the kernel of
 * one CTA per (row, 16 heads) in the same run, next to the copy bandwidth and the BF16 GEMM
 * ceiling measured in the same run.
 * Exit 0: all match; 1: a mismatch (parameters and first mismatches printed); 2: setup error. */
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/cpu/numfmt.h"
#include "kernels/cuda/backend_cuda.h"
#include "tests/gpu/check_util.h"
#include "tests/gpu/gpu_common.h"

static const char usage[] =
    "usage: check_attn [--bench] [--seed N]\n"
    "  CUDA sparse_attn against the C twin; --bench adds V4.1-Flash decode and prefill timings\n";

#define MAX_SEQS 6
#define ATOL 2e-2
#define MIN_COS 0.9999

/* The backend with kern_cuda_config.attn_old: every row on the kernel of one CTA per (row,
 * 16 heads), the path of prefill chunks before the tile kernel took them (set in main). */
static kern_backend *g_old;

typedef struct attn_case {
    uint32_t n_seqs;
    chk_seq_shape seqs[MAX_SEQS];
    int64_t window_lo[MAX_SEQS];    /* 0: no clip */
    int32_t ring_hi[MAX_SEQS];      /* -1: normal rows; >= 0: a draft block */
    uint32_t heads, hd, window, ring;
    uint32_t topk_n;                /* 0: no long-range list (topk NULL) */
    uint32_t ratio;                 /* visible compressed entries (p + 1) / ratio */
    uint32_t per_block;
    int qmode;
    float sink_scale;
    int holes;                      /* 1: of each row's ids, about 1/4 made -1 and 1/8 past the
                                     * block table (-1 for the twin) */
} attn_case;

/* Per (row, head): elements within ATOL and cosine >= MIN_COS. Returns mismatches. */
static size_t compare_heads(const char *what, const uint16_t *c, const uint16_t *g, uint32_t rows,
                            uint32_t heads, uint32_t hd, double *worst_abs, double *worst_cos)
{
    size_t bad = 0, shown = 0;
    for (uint32_t r = 0; r < rows; r++)
        for (uint32_t h = 0; h < heads; h++) {
            const uint16_t *cr = c + ((size_t)r * heads + h) * hd, *gr = g + ((size_t)r * heads + h) * hd;
            double dot = 0, nc = 0, ng = 0;
            for (uint32_t d = 0; d < hd; d++) {
                double x = di_bf16_to_f32(cr[d]), y = di_bf16_to_f32(gr[d]);
                double diff = fabs(x - y);
                if (!(diff <= ATOL)) {
                    if (shown++ < 5)
                        fprintf(stderr, "MISMATCH %s: row %u head %u [%u]: cpu %.6g gpu %.6g\n",
                                what, r, h, d, x, y);
                    bad++;
                } else if (diff > *worst_abs) {
                    *worst_abs = diff;
                }
                dot += x * y, nc += x * x, ng += y * y;
            }
            double cs = nc == 0 && ng == 0 ? 1.0 : dot / sqrt(nc * ng);
            if (!(cs >= MIN_COS) && nc > 1e-12) {
                if (shown++ < 5)
                    fprintf(stderr, "MISMATCH %s: row %u head %u cosine %.7f\n", what, r, h, cs);
                bad++;
            }
            if (nc > 1e-12 && cs < *worst_cos)
                *worst_cos = cs;
        }
    return bad;
}

/* Top-k lists: per row, min(topk_n, visible) distinct ids ascending, then -1. */
static void make_topk(int32_t *topk, const attn_case *ac, const chk_kv *kv, di_rng *rng)
{
    for (uint32_t s = 0; s < ac->n_seqs; s++)
        for (uint32_t i = 0; i < ac->seqs[s].n_rows; i++) {
            int64_t pos = ac->seqs[s].pos0 + i;
            uint64_t vis = (uint64_t)(pos + 1) / ac->ratio;
            if (vis > ac->seqs[s].n_entries)
                vis = ac->seqs[s].n_entries;
            uint64_t want = vis < ac->topk_n ? vis : ac->topk_n, n = 0;
            int32_t *out = topk + (size_t)(kv->seqs_h[s].row0 + i) * ac->topk_n;
            for (uint64_t j = 0; j < vis && n < want; j++) /* selection sampling: ascending */
                if (di_rng_below(rng, vis - j) < want - n)
                    out[n++] = (int32_t)j;
            for (; n < ac->topk_n; n++)
                out[n] = -1;
        }
}

typedef struct attn_bufs {
    uint16_t *q, *out;
    uint8_t *local;
    int32_t *topk;
    float *sink;
} attn_bufs;

static kern_sparse_attn attn_params(const attn_case *ac, uint32_t rows, const attn_bufs *b,
                                    const kern_kv_pool *pool, uint32_t n_seqs, const kern_seq *seqs,
                                    size_t ring_offset)
{
    kern_sparse_attn p = {.n_rows = rows, .n_heads = ac->heads, .head_dim = ac->hd,
                          .window = ac->window, .ring_positions = ac->ring, .q = b->q,
                          .local = b->local, .ring_offset = ring_offset,
                          .topk = ac->topk_n ? b->topk : NULL, .topk_n = ac->topk_n,
                          .pool = *pool, .n_seqs = n_seqs, .seqs = seqs, .sink = b->sink,
                          .scale = (float)(1.0 / sqrt((double)ac->hd)), .out = b->out};
    return p;
}

/* The last sequence alone (rows moved to row 0) must give its rows of the batch bit for bit. */
static size_t check_alone(chk_env *env, const char *what, const attn_case *ac, const chk_kv *kv,
                          const attn_bufs *dev, const uint16_t *batch_out, size_t ring_offset)
{
    uint32_t s = ac->n_seqs - 1, r0 = kv->seqs_d[s].row0, n = ac->seqs[s].n_rows;
    size_t qrow = (size_t)ac->heads * ac->hd, eb = (size_t)ac->hd + ac->hd / 32;
    attn_bufs one = {.q = (uint16_t *)dev->q + r0 * qrow, .local = dev->local + r0 * eb,
                     .topk = dev->topk + (size_t)r0 * ac->topk_n, .sink = dev->sink};
    one.out = chk_dev_alloc(env, (size_t)n * qrow * 2);
    kern_seq q = kv->seqs_d[s];
    q.row0 = 0;
    kern_sparse_attn p = attn_params(ac, n, &one, &kv->pool_d, 1, &q, ring_offset);
    size_t bad = chk_gpu_status(env, env->gpu.ops.sparse_attn(env->gpu.ctx, &p), what);
    uint16_t *alone = chk_malloc((size_t)n * qrow * 2);
    chk_get(env, alone, one.out, (size_t)n * qrow * 2);
    char w2[640];
    snprintf(w2, sizeof(w2), "%s (sequence %u alone vs in the batch)", what, s);
    if (!bad)
        bad = chk_cmp_bf16_exact(w2, batch_out + r0 * qrow, alone, (size_t)n * qrow);
    chk_dev_free(env, one.out);
    free(alone);
    return bad;
}

static void check_attn(chk_env *env, const attn_case *ac, double *worst_abs, double *worst_cos)
{
    di_rng rng;
    uint64_t seed = chk_case_rng(env, &rng);
    uint32_t T = 0, hd = ac->hd;
    for (uint32_t s = 0; s < ac->n_seqs; s++)
        T += ac->seqs[s].n_rows;
    size_t eb = (size_t)hd + hd / 32, ring_offset = (size_t)ac->ring * eb + 3;
    size_t slot_bytes = ring_offset + (size_t)ac->ring * eb + 5;
    chk_kv kv;
    chk_kv_shape ks = {.entries_per_block = ac->per_block, .dim = hd, .index_dim = 32, .skew = 1};
    chk_kv_make(env, &kv, &ks, ac->n_seqs, ac->seqs, slot_bytes, &rng);
    chk_kv_fill_rings(env, &kv, ring_offset, ac->ring, hd, 1.0f, &rng);
    for (uint32_t s = 0; s < ac->n_seqs; s++) {
        kv.seqs_h[s].window_lo = kv.seqs_d[s].window_lo = ac->window_lo[s];
        kv.seqs_h[s].ring_hi = kv.seqs_d[s].ring_hi = ac->ring_hi[s];
    }
    size_t qn = (size_t)T * ac->heads * hd, tn = (size_t)T * (ac->topk_n ? ac->topk_n : 1);
    attn_bufs h = {.q = chk_malloc(qn * 2), .out = chk_malloc(qn * 2), .local = chk_malloc(T * eb),
                   .topk = chk_malloc(tn * 4), .sink = chk_malloc(ac->heads * 4)};
    chk_fill_bf16(h.q, qn, ac->qmode, &rng);
    float x[512];
    for (uint32_t t = 0; t < T; t++) {
        chk_fill_f32(x, hd, 1.0, &rng);
        di_quant_fp8_b32(x, hd, h.local + t * eb, h.local + t * eb + hd);
    }
    if (ac->topk_n)
        make_topk(h.topk, ac, &kv, &rng);
    int32_t *gtopk = chk_malloc(tn * 4); /* the device's list: ids past the table where the
                                          * twin's has -1 */
    memcpy(gtopk, h.topk, tn * 4);
    for (uint32_t s = 0; ac->holes && s < ac->n_seqs; s++) {
        const kern_seq *q = &kv.seqs_h[s];
        for (size_t i = (size_t)q->row0 * ac->topk_n; i < (size_t)(q->row0 + q->n_rows) * ac->topk_n; i++) {
            uint32_t r = di_rng_below(&rng, 8);
            if (h.topk[i] >= 0 && r < 2) {
                h.topk[i] = gtopk[i] = -1;
            } else if (h.topk[i] >= 0 && r == 2) {
                h.topk[i] = -1;
                gtopk[i] = (int32_t)((uint64_t)q->n_blocks * ac->per_block + di_rng_below(&rng, 1000));
            }
        }
    }
    chk_fill_f32(h.sink, ac->heads, ac->sink_scale, &rng);
    chk_fill_u16(h.out, qn, CHK_POISON_BF16);
    attn_bufs d = {.q = chk_dev_copy(env, h.q, qn * 2), .out = chk_dev_copy(env, h.out, qn * 2),
                   .local = chk_dev_copy(env, h.local, T * eb),
                   .topk = chk_dev_copy(env, gtopk, tn * 4),
                   .sink = chk_dev_copy(env, h.sink, ac->heads * 4)};
    char sq[200], what[400];
    size_t len = 0;
    for (uint32_t s = 0; s < ac->n_seqs; s++)
        len += (size_t)snprintf(sq + len, sizeof(sq) - len, "%s%u@%" PRId64 "%s", s ? "," : "",
                                ac->seqs[s].n_rows, ac->seqs[s].pos0,
                                ac->ring_hi[s] >= 0 ? "(draft)" : ac->window_lo[s] ? "(clip)" : "");
    snprintf(what, sizeof(what), "sparse_attn seqs=[%s] heads=%u hd=%u window=%u ring=%u topk=%u "
             "ratio=%u per_block=%u q=%s sink_scale=%g%s seed=%" PRIu64, sq, ac->heads, hd,
             ac->window, ac->ring, ac->topk_n, ac->ratio, ac->per_block,
             chk_mode_name[ac->qmode], (double)ac->sink_scale, ac->holes ? " holes" : "", seed);
    kern_sparse_attn p = attn_params(ac, T, &d, &kv.pool_d, ac->n_seqs, kv.seqs_d, ring_offset);
    size_t bad = chk_gpu_status(env, env->gpu.ops.sparse_attn(env->gpu.ctx, &p), what);
    uint16_t *gout = chk_malloc(qn * 2);
    chk_get(env, gout, d.out, qn * 2);
    p = attn_params(ac, T, &h, &kv.pool_h, ac->n_seqs, kv.seqs_h, ring_offset);
    chk_cpu_status(env->cpu.ops.sparse_attn(env->cpu.ctx, &p), what);
    if (!bad)
        bad = compare_heads(what, h.out, gout, T, ac->heads, hd, worst_abs, worst_cos);
    char w2[480];
    /* q and out two bytes off 16-byte alignment (the vector loads and stores give way) */
    snprintf(w2, sizeof(w2), "%s (q and out misaligned)", what);
    uint16_t *mq = chk_dev_alloc(env, qn * 2 + 16), *mo = chk_dev_alloc(env, qn * 2 + 16);
    attn_bufs dm = d;
    dm.q = mq + 1, dm.out = mo + 1;
    chk_put(env, dm.q, h.q, qn * 2);
    p = attn_params(ac, T, &dm, &kv.pool_d, ac->n_seqs, kv.seqs_d, ring_offset);
    if (!bad)
        bad = chk_gpu_status(env, env->gpu.ops.sparse_attn(env->gpu.ctx, &p), w2);
    if (!bad) {
        chk_get(env, gout, dm.out, qn * 2);
        bad = compare_heads(w2, h.out, gout, T, ac->heads, hd, worst_abs, worst_cos);
    }
    chk_dev_free(env, mq), chk_dev_free(env, mo);
    /* the kernel of one CTA per (row, 16 heads) on the same case */
    p = attn_params(ac, T, &d, &kv.pool_d, ac->n_seqs, kv.seqs_d, ring_offset);
    snprintf(w2, sizeof(w2), "%s (attn_old)", what);
    if (!bad)
        bad = chk_gpu_status(env, g_old->ops.sparse_attn(g_old->ctx, &p), w2);
    if (!bad) {
        di_error e;
        bad = chk_gpu_status(env, kern_cuda_sync(g_old, &e), w2);
        chk_get(env, gout, d.out, qn * 2);
        bad = compare_heads(w2, h.out, gout, T, ac->heads, hd, worst_abs, worst_cos);
    }
    /* batch-invariant mode: within tolerance, and the last sequence alone gives its rows of
     * the batch bit for bit */
    snprintf(w2, sizeof(w2), "%s (batch-invariant mode)", what);
    kern_cuda_set_batch_invariant(&env->gpu, 1);
    if (!bad)
        bad = chk_gpu_status(env, env->gpu.ops.sparse_attn(env->gpu.ctx, &p), w2);
    if (!bad) {
        chk_get(env, gout, d.out, qn * 2);
        bad = compare_heads(w2, h.out, gout, T, ac->heads, hd, worst_abs, worst_cos);
    }
    if (!bad)
        bad = check_alone(env, w2, ac, &kv, &d, gout, ring_offset);
    kern_cuda_set_batch_invariant(&env->gpu, 0);
    chk_count(env, bad);
    chk_dev_free(env, d.q), chk_dev_free(env, d.out), chk_dev_free(env, d.local);
    chk_dev_free(env, d.topk), chk_dev_free(env, d.sink);
    chk_kv_free(env, &kv);
    free(h.q), free(h.out), free(h.local), free(h.topk), free(h.sink), free(gout), free(gtopk);
}

/* ---- refused inputs ---- */

static void check_refusals(chk_env *env)
{
    kern_ops *o = &env->gpu.ops;
    void *c = env->gpu.ctx;
    uint8_t *d = chk_dev_alloc(env, 1 << 20);
    size_t bad = 0;
    kern_seq q = {.row0 = 0, .n_rows = 1, .pos0 = 10, .ring_hi = -1};
    kern_sparse_attn ok = {.n_rows = 1, .n_heads = 4, .head_dim = 64, .window = 8,
                           .ring_positions = 10, .q = (uint16_t *)d, .local = d + 65536,
                           .n_seqs = 1, .seqs = &q, .sink = (float *)(d + 131072), .scale = 0.125f,
                           .out = (uint16_t *)(d + 196608)};
    kern_sparse_attn p = ok;
    bad += chk_expect(env, o->sparse_attn(c, NULL), DI_EINVAL, "sparse_attn(NULL)");
    p.head_dim = 48;
    bad += chk_expect(env, o->sparse_attn(c, &p), DI_EINVAL, "sparse_attn head_dim 48");
    p = ok, p.head_dim = 544;
    bad += chk_expect(env, o->sparse_attn(c, &p), DI_EINVAL, "sparse_attn head_dim 544");
    p = ok, p.ring_positions = 7;
    bad += chk_expect(env, o->sparse_attn(c, &p), DI_EINVAL, "sparse_attn ring 7 < window 8");
    p = ok;
    bad += chk_expect(env, o->sparse_attn(c, &p), DI_EINVAL,
                      "sparse_attn ring read without a state slot");
    q.slot = d + 262144;
    p.n_rows = 2;
    bad += chk_expect(env, o->sparse_attn(c, &p), DI_EINVAL, "sparse_attn row 1 in no sequence");
    p = ok, p.topk = (int32_t *)d, p.topk_n = 4;
    bad += chk_expect(env, o->sparse_attn(c, &p), DI_EINVAL, "sparse_attn top-k without a pool");
    bad += chk_expect(env, o->sparse_attn(c, &ok), DI_OK, "sparse_attn after refusals");
    chk_sync(env);
    chk_count(env, bad);
    printf("refused inputs: %s\n", bad ? "MISMATCHES" : "all refused with DI_EINVAL");
    chk_dev_free(env, d);
}

/* ---- the sweep ---- */

#define S(n, p, e, sl) {.n_rows = (n), .pos0 = (p), .n_entries = (e), .has_slot = (sl)}
#define NOCLIP {0, 0, 0, 0, 0, 0}
#define NODRAFT {-1, -1, -1, -1, -1, -1}

static void sweep(chk_env *env)
{
    static const attn_case cases[] = {
        /* V4.1-Flash decode: one row per sequence, full window and a full top-k list */
        {2, {S(1, 5000, 2501, 1), S(1, 700, 351, 1)}, NOCLIP, NODRAFT, 64, 512, 128, 134, 512, 2, 64, CHK_NORMAL, 1.0f, 0},
        /* ratio 1, a short context (top-k not full), 20 heads (a partial group of 16) */
        {3, {S(1, 40, 41, 1), S(1, 0, 1, 0), S(1, 129, 130, 1)}, NOCLIP, NODRAFT, 20, 512, 128, 134, 512, 1, 128, CHK_NORMAL, 3.0f, 0},
        /* a prefill chunk from 0 (no ring reads, no slot) and one continuing mid-window */
        {2, {S(63, 0, 32, 0), S(40, 150, 95, 1)}, NOCLIP, NODRAFT, 4, 64, 128, 134, 64, 2, 64, CHK_NORMAL, 1.0f, 0},
        /* a prefill chunk and decode rows in one call (one launch; in batch-invariant mode two) */
        {3, {S(40, 150, 95, 1), S(1, 5000, 2501, 1), S(6, 3000, 1501, 1)}, NOCLIP, NODRAFT, 64, 512, 128, 134, 512, 2, 64, CHK_NORMAL, 1.0f, 0},
        /* a chunk longer than the window, window clips */
        {2, {S(200, 100, 150, 1), S(30, 300, 301, 1)}, {0, 320, 0, 0, 0, 0}, NODRAFT, 8, 128, 128, 134, 128, 1, 8, CHK_ARANGE, 1.0f, 0},
        {1, {S(127, 1000, 1128, 1)}, {1050, 0, 0, 0, 0, 0}, NODRAFT, 8, 128, 128, 134, 128, 1, 64, CHK_EDGES, 0.5f, 0},
        /* window-only layers (no top-k) and draft blocks (ring up to P plus the block) */
        {3, {S(1, 3, 4, 1), S(5, 9, 4, 1), S(1, 900, 4, 1)}, NOCLIP, NODRAFT, 64, 512, 128, 134, 0, 1, 64, CHK_NORMAL, 1.0f, 0},
        {3, {S(5, 1001, 4, 1), S(5, 1, 4, 1), S(5, 60, 4, 1)}, NOCLIP, {1000, 0, 58, -1, -1, -1}, 64, 512, 128, 134, 0, 1, 64, CHK_NORMAL, 1.0f, 0},
        {2, {S(5, 400, 4, 1), S(5, 7, 4, 1)}, NOCLIP, {399, 6, -1, -1, -1, -1}, 4, 64, 128, 134, 0, 1, 64, CHK_NORMAL, 2.0f, 0},
        /* queries: zeros, ones, large (one-hot softmax), tiny; sinks that dominate */
        {2, {S(1, 5000, 2501, 1), S(3, 2000, 1001, 1)}, NOCLIP, NODRAFT, 64, 512, 128, 134, 512, 2, 64, CHK_ZEROS, 1.0f, 0},
        {2, {S(1, 5000, 2501, 1), S(3, 2000, 1001, 1)}, NOCLIP, NODRAFT, 16, 512, 128, 134, 512, 2, 64, CHK_ONES, 1.0f, 0},
        {1, {S(3, 3000, 3001, 1)}, NOCLIP, NODRAFT, 16, 512, 128, 134, 512, 1, 128, CHK_LARGE, 1.0f, 0},
        {1, {S(3, 3000, 3001, 1)}, NOCLIP, NODRAFT, 1, 512, 128, 134, 512, 1, 128, CHK_TINY, 20.0f, 0},
        {2, {S(4, 500, 251, 1), S(2, 64, 33, 1)}, NOCLIP, NODRAFT, 8, 128, 64, 70, 32, 2, 2, CHK_NORMAL, 30.0f, 0},
        /* a ring of 129 positions (nextn 0), per-block 1 */
        {2, {S(2, 600, 601, 1), S(1, 129, 130, 1)}, NOCLIP, NODRAFT, 4, 64, 128, 129, 16, 1, 1, CHK_NORMAL, 1.0f, 0},
        /* prefill chunks at V4.1-Flash width (64 heads of 512, window 128): a chunk whose first
         * 127 rows' windows cross its start, one from position 0 (top-k lists mostly empty),
         * with empty slots among the ids and ids past the block table */
        {1, {S(150, 1000, 250, 1)}, NOCLIP, NODRAFT, 64, 512, 128, 134, 256, 4, 64, CHK_NORMAL, 1.0f, 1},
        {2, {S(90, 0, 23, 0), S(40, 300, 76, 1)}, NOCLIP, NODRAFT, 64, 512, 128, 134, 64, 4, 16, CHK_NORMAL, 1.0f, 1},
        /* fewer heads at hd 512: 20 (a partial group of 64), 8 and 1; a clipped window */
        {1, {S(140, 200, 101, 1)}, NOCLIP, NODRAFT, 20, 512, 128, 134, 128, 2, 32, CHK_NORMAL, 2.0f, 1},
        {2, {S(70, 60, 31, 1), S(33, 500, 251, 1)}, {0, 510, 0, 0, 0, 0}, NODRAFT, 8, 512, 128, 134, 192, 2, 64, CHK_NORMAL, 1.0f, 1},
        {1, {S(64, 130, 131, 1)}, NOCLIP, NODRAFT, 1, 512, 128, 134, 128, 1, 128, CHK_LARGE, 1.0f, 0},
        /* decode rows, a draft block and a prefill chunk (the last) in one call: in
         * batch-invariant mode two launches, each over its list of rows */
        {3, {S(1, 5000, 2501, 1), S(5, 61, 4, 1), S(100, 900, 451, 1)}, NOCLIP, {-1, 59, -1, -1, -1, -1}, 64, 512, 128, 134, 256, 2, 64, CHK_NORMAL, 1.0f, 1},
    };
    double worst_abs = 0, worst_cos = 1;
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++)
        check_attn(env, &cases[i], &worst_abs, &worst_cos);
    printf("sparse_attn: %d cases; worst |o - o_cpu| %.3g (tolerance %.0e), worst head cosine "
           "%.7f (bound %.4f)\n", env->checks, worst_abs, ATOL, worst_cos, MIN_COS);
    check_refusals(env);
}

/* ---- benchmark: V4.1-Flash decode batches and prefill chunks ---- */

enum { B_H = 64, B_HD = 512, B_WIN = 128, B_RING = 134, B_TOPK = 512, B_PER_BLOCK = 128,
       B_POOL = 4096, B_EB = B_HD + B_HD / 32, B_MAIN = B_HD / 2 + B_HD / 16, B_POS = 16383 };

typedef struct bench_arg {
    kern_backend *be;
    kern_sparse_attn p;
} bench_arg;

static di_status bench_call(void *arg, int i)
{
    bench_arg *b = arg;
    (void)i;
    return b->be->ops.sparse_attn(b->be->ctx, &b->p);
}

/* n_seqs sequences of `per` rows (the last at position B_POS), each with its 64 blocks of 128
 * compressed entries drawn from a pool of B_POOL, a full window (this step's rows, the ring
 * before them) and 512 top-k entries per row; timed on the tile kernel and on the kernel of
 * one CTA per (row, 16 heads) (attn_old) in the same run. */
static void bench_rows(chk_env *env, uint32_t n_seqs, uint32_t per, double copy, double peak)
{
    di_rng rng;
    chk_case_rng(env, &rng);
    const uint32_t rows = n_seqs * per;
    size_t block_bytes = 128 + (size_t)B_PER_BLOCK * B_MAIN, slot = (size_t)B_RING * B_EB;
    size_t hbytes = block_bytes * B_POOL > slot * n_seqs ? block_bytes * B_POOL : slot * n_seqs;
    uint8_t *h = chk_malloc(hbytes > (size_t)rows * B_EB ? hbytes : (size_t)rows * B_EB);
    for (size_t i = 0; i < block_bytes * B_POOL; i++) /* codes of any value, scales near 2^-4 */
        h[i] = (uint8_t)di_rng_u32(&rng);
    for (uint32_t b = 0; b < B_POOL; b++)
        for (uint32_t e = 0; e < B_PER_BLOCK; e++)
            for (uint32_t k = 0; k < B_HD / 16; k++)
                h[b * block_bytes + 128 + e * B_MAIN + B_HD / 2 + k] = (uint8_t)(0x28 + di_rng_below(&rng, 8));
    uint8_t *blocks = chk_dev_copy(env, h, block_bytes * B_POOL);
    float x[B_HD];
    for (size_t e = 0; e < (size_t)n_seqs * B_RING; e++) {
        chk_fill_f32(x, B_HD, 1.0, &rng);
        di_quant_fp8_b32(x, B_HD, h + e * B_EB, h + e * B_EB + B_HD);
    }
    uint8_t *slots = chk_dev_copy(env, h, slot * n_seqs);
    uint8_t *local = chk_dev_copy(env, h, (size_t)rows * B_EB);
    free(h);
    uint32_t *tables = chk_malloc((size_t)n_seqs * 64 * 4);
    kern_seq *seqs = chk_malloc(n_seqs * sizeof(kern_seq));
    int32_t *topk = chk_malloc((size_t)rows * B_TOPK * 4);
    for (uint32_t s = 0; s < n_seqs; s++) {
        for (uint32_t b = 0; b < 64; b++)
            tables[s * 64 + b] = (uint32_t)di_rng_below(&rng, B_POOL);
        seqs[s] = (kern_seq){.row0 = s * per, .n_rows = per, .pos0 = B_POS + 1 - per,
                             .slot = slots + s * slot, .blocks = tables + s * 64, .n_blocks = 64,
                             .ring_hi = -1};
    }
    for (uint32_t r = 0; r < rows; r++)
        for (uint32_t i = 0; i < B_TOPK; i++)
            topk[r * B_TOPK + i] = (int32_t)(i * 16 + di_rng_below(&rng, 16));
    size_t qn = (size_t)rows * B_H * B_HD;
    uint16_t *hq = chk_malloc(qn * 2);
    chk_fill_bf16_fast(hq, qn, 0.1f, &rng);
    float sink[B_H];
    chk_fill_f32(sink, B_H, 1.0, &rng);
    bench_arg b;
    b.p = (kern_sparse_attn){.n_rows = rows, .n_heads = B_H, .head_dim = B_HD, .window = B_WIN,
                             .ring_positions = B_RING, .q = chk_dev_copy(env, hq, qn * 2),
                             .local = local, .topk = chk_dev_copy(env, topk, (size_t)rows * B_TOPK * 4),
                             .topk_n = B_TOPK, .n_seqs = n_seqs, .seqs = seqs,
                             .sink = chk_dev_copy(env, sink, sizeof(sink)), .scale = 1.0f / 22.627417f,
                             .out = chk_dev_alloc(env, qn * 2)};
    b.p.pool = (kern_kv_pool){.blocks = blocks, .block_bytes = block_bytes,
                              .entries_per_block = B_PER_BLOCK, .main_offset = 128,
                              .main_entry_bytes = B_MAIN};
    double keys = B_WIN + B_TOPK;
    double flops = 4.0 * rows * B_H * keys * B_HD;
    double bytes = rows * (2.0 * B_H * B_HD * 2 + B_WIN * (double)B_EB + B_TOPK * (double)B_MAIN);
    char label[32];
    snprintf(label, sizeof(label), "%u x %u", n_seqs, per);
    for (int k = 0; k < 2; k++) {
        b.be = k == 0 ? &env->gpu : g_old;
        const int big = rows >= 4096; /* a prefill chunk: ~0.1 s a call on the old kernel */
        double ms = chk_time_ms_on(env, b.be, bench_call, &b, big ? 1 : 3, big ? 5 : 20);
        const char *name = k == 0 ? "sparse_attn tiles" : "  one CTA per 16 heads";
        if (ms > 0) {
            double tf = flops / (ms * 1e-3) / 1e12, gb = bytes / (ms * 1e-3) / 1e9;
            printf("%-24s %9s %9.1f %9.1f %7.0f %6.1f%% %6.1f%%\n", name, label, ms * 1e3, tf, gb,
                   100 * tf / peak, 100 * gb / copy);
        } else {
            printf("%-24s %9s failed (message above)\n", name, label);
        }
    }
    chk_dev_free(env, blocks), chk_dev_free(env, slots), chk_dev_free(env, local);
    chk_dev_free(env, (void *)b.p.q), chk_dev_free(env, (void *)b.p.topk);
    chk_dev_free(env, (void *)b.p.sink), chk_dev_free(env, b.p.out);
    free(tables), free(seqs), free(topk), free(hq);
}

static void bench(chk_env *env)
{
    double copy = gpu_copy_gbs((size_t)1 << 30, 20);
    double peak = chk_gemm_ceiling(env);
    printf("\nsparse_attn at V4.1-Flash shapes (decode batches, then prefill chunks of one "
           "sequence): 64 heads of 512, %d window + %d top-k keys per row, the last at position "
           "%d\nceilings measured now: copy %.0f GB/s, BF16 GEMM 8192^3 "
           "%.0f TFLOP/s; FLOPs = 4 x rows x heads x keys x 512 (QK and PV); bytes = q, out and "
           "the keys read once per row\n", B_WIN, B_TOPK, B_POS, copy, peak);
    printf("%-24s %9s %9s %9s %7s %7s %7s\n", "op", "seqs x rows", "us", "TFLOP/s", "GB/s",
           "of GEMM", "of copy");
    bench_rows(env, 1, 1, copy, peak);
    bench_rows(env, 8, 1, copy, peak);
    bench_rows(env, 64, 1, copy, peak);
    bench_rows(env, 64, 6, copy, peak);
    bench_rows(env, 384, 1, copy, peak);
    bench_rows(env, 1, 4096, copy, peak);
    bench_rows(env, 1, 16384, copy, peak);
}

int main(int argc, char **argv)
{
    chk_env env;
    int want_bench = chk_init(&env, argc, argv, usage);
    kern_backend old;
    kern_cuda_config cfg = {.attn_old = 1};
    di_error e;
    if (kern_cuda_create(&cfg, &old, &e) != DI_OK) {
        fprintf(stderr, "CUDA backend (attn_old): %s\n", e.msg);
        return 2;
    }
    g_old = &old;
    sweep(&env);
    int rc = chk_finish(&env, "check_attn", want_bench, bench);
    kern_cuda_destroy(&old);
    return rc;
}
