/* check_cache: the CUDA backend's cache writes against their C twins (kern_cpu_create's table):
 * ring_store (encode this step's window entries by (A), commit the last ring_positions rows of
 * each sequence into its slot's ring), compress_pool (ratio-r pooling with the pending-token
 * state) and compressed_store (main entries by (C) and index keys by (B) into the paged
 * blocks). Every one is exact (kernels.h): the whole pool, every slot and the local entries are
 * compared byte for byte, so a write outside the right place shows too (they start as random
 * bytes, the same on both sides). Layouts are skewed off alignment (the tiny model's entries are
 * 66 and 17 bytes); sequences start mid-group, run past the ring, or have no slot.
 * With --bench: the ops at V4.1-Flash shapes next to the copy bandwidth of the same run.
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
    "usage: check_cache [--bench] [--seed N]\n"
    "  CUDA ring_store, compress_pool, compressed_store against the C twins; --bench adds\n"
    "  bandwidths at V4.1-Flash shapes\n";

#define MAX_SEQS 6

static uint32_t total_rows(const chk_seq_shape *s, uint32_t n)
{
    uint32_t t = 0;
    for (uint32_t i = 0; i < n; i++)
        t += s[i].n_rows;
    return t;
}

static void seqs_text(char *out, size_t cap, const chk_seq_shape *s, uint32_t n)
{
    size_t len = 0;
    for (uint32_t i = 0; i < n && len < cap; i++)
        len += (size_t)snprintf(out + len, cap - len, "%s%u@%" PRId64 "%s", i ? "," : "",
                                s[i].n_rows, s[i].pos0, s[i].has_slot ? "" : "(no slot)");
}

/* ---- ring_store ---- */

typedef struct ring_case {
    uint32_t n_seqs;
    chk_seq_shape seqs[MAX_SEQS];
    uint32_t dim, ring;
    size_t ring_offset;
    int encode, commit, mode;
} ring_case;

static void check_ring_store(chk_env *env, const ring_case *rc)
{
    di_rng rng;
    uint64_t seed = chk_case_rng(env, &rng);
    uint32_t T = total_rows(rc->seqs, rc->n_seqs), dim = rc->dim;
    size_t eb = (size_t)dim + dim / 32, slot_bytes = rc->ring_offset + rc->ring * eb + 7;
    chk_kv kv;
    chk_kv_shape ks = {.entries_per_block = 4, .dim = 32, .index_dim = 32};
    chk_kv_make(env, &kv, &ks, rc->n_seqs, rc->seqs, slot_bytes, &rng);
    uint16_t *x = chk_malloc((size_t)T * dim * 2);
    chk_fill_bf16(x, (size_t)T * dim, rc->mode, &rng);
    size_t lbytes = (size_t)T * eb;
    uint8_t *local = chk_malloc(lbytes), *lg = chk_malloc(lbytes);
    uint8_t *slots = chk_malloc(slot_bytes * rc->n_seqs + 1);
    for (size_t i = 0; i < lbytes; i++)
        local[i] = (uint8_t)di_rng_u32(&rng);
    char sq[160], what[320];
    seqs_text(sq, sizeof(sq), rc->seqs, rc->n_seqs);
    snprintf(what, sizeof(what), "ring_store seqs=[%s] dim=%u ring=%u ring_offset=%zu encode=%d "
             "commit=%d mode=%s seed=%" PRIu64, sq, dim, rc->ring, rc->ring_offset, rc->encode,
             rc->commit, chk_mode_name[rc->mode], seed);
    uint16_t *dx = chk_dev_copy(env, x, (size_t)T * dim * 2);
    uint8_t *dlocal = chk_dev_copy(env, local, lbytes);
    kern_ring_store p = {.n_rows = T, .dim = dim, .kv = rc->encode ? dx : NULL,
                         .commit = rc->commit, .n_seqs = rc->n_seqs, .seqs = kv.seqs_d,
                         .ring_offset = rc->ring_offset, .ring_positions = rc->ring,
                         .local = dlocal};
    size_t bad = chk_gpu_status(env, env->gpu.ops.ring_store(env->gpu.ctx, &p), what);
    chk_get(env, lg, dlocal, lbytes);
    chk_kv_get(env, &kv, NULL, slots);
    p.kv = rc->encode ? x : NULL, p.seqs = kv.seqs_h, p.local = local;
    chk_cpu_status(env->cpu.ops.ring_store(env->cpu.ctx, &p), what);
    if (!bad) {
        bad = chk_cmp_bytes(what, local, lg, lbytes);
        bad += chk_cmp_bytes(what, kv.slots_h, slots, slot_bytes * rc->n_seqs);
    }
    chk_count(env, bad);
    chk_dev_free(env, dx), chk_dev_free(env, dlocal);
    chk_kv_free(env, &kv);
    free(x), free(local), free(lg), free(slots);
}

/* ---- compress_pool ---- */

typedef struct pool_case {
    uint32_t n_seqs;
    chk_seq_shape seqs[MAX_SEQS];
    uint32_t dim, ratio, spare;
    size_t state_offset;
    int gmode;                  /* 0 N(0,1); 1 sharp (x 60); 2 ties (g integers 0..2); 3 zeros */
} pool_case;

static void fill_g(float *g, size_t n, int gmode, di_rng *rng)
{
    for (size_t i = 0; i < n; i++) {
        double v = di_rng_normal(rng);
        g[i] = gmode == 1 ? (float)(v * 60) : gmode == 2 ? (float)di_rng_below(rng, 3)
                                                          : gmode == 3 ? 0.0f : (float)v;
    }
}

static void check_compress_pool(chk_env *env, const pool_case *pc)
{
    di_rng rng;
    uint64_t seed = chk_case_rng(env, &rng);
    uint32_t T = total_rows(pc->seqs, pc->n_seqs), dim = pc->dim;
    uint32_t state_tokens = pc->ratio - 1 + pc->spare;
    size_t tok = (size_t)2 * dim * 4, slot_bytes = pc->state_offset + state_tokens * tok + 3;
    chk_kv kv;
    chk_kv_shape ks = {.entries_per_block = 4, .dim = 32, .index_dim = 32};
    chk_kv_make(env, &kv, &ks, pc->n_seqs, pc->seqs, slot_bytes, &rng);
    /* pending tokens: N(0,1) a and g of the sharpness asked for, at unaligned addresses */
    float *buf = chk_malloc(tok);
    for (uint32_t s = 0; s < pc->n_seqs; s++)
        for (uint32_t k = 0; k < state_tokens; k++) {
            chk_fill_f32(buf, dim, 1.0, &rng);
            fill_g(buf + dim, dim, pc->gmode, &rng);
            memcpy(kv.slots_h + s * slot_bytes + pc->state_offset + k * tok, buf, tok);
        }
    chk_put(env, kv.slots_d, kv.slots_h, slot_bytes * pc->n_seqs + 1);
    float *a = chk_malloc((size_t)T * dim * 4), *g = chk_malloc((size_t)T * dim * 4);
    chk_fill_f32(a, (size_t)T * dim, 1.0, &rng);
    fill_g(g, (size_t)T * dim, pc->gmode, &rng);
    int32_t *row_seq = chk_malloc((size_t)T * 4), *emit = chk_malloc((size_t)T * 4);
    uint32_t n_emit = 0;
    for (uint32_t s = 0; s < pc->n_seqs; s++)
        for (uint32_t i = 0; i < pc->seqs[s].n_rows; i++) {
            uint32_t row = kv.seqs_h[s].row0 + i;
            row_seq[row] = (int32_t)s;
            if ((pc->seqs[s].pos0 + i + 1) % pc->ratio == 0)
                emit[n_emit++] = (int32_t)row;
        }
    uint16_t *lc = chk_malloc(((size_t)n_emit + 1) * dim * 2), *lg = chk_malloc(((size_t)n_emit + 1) * dim * 2);
    uint8_t *slots = chk_malloc(slot_bytes * pc->n_seqs + 1);
    chk_fill_u16(lc, (size_t)(n_emit + 1) * dim, CHK_POISON_BF16);
    char sq[160], what[320];
    seqs_text(sq, sizeof(sq), pc->seqs, pc->n_seqs);
    snprintf(what, sizeof(what), "compress_pool seqs=[%s] dim=%u ratio=%u state_tokens=%u "
             "state_offset=%zu gmode=%d emits=%u seed=%" PRIu64, sq, dim, pc->ratio, state_tokens,
             pc->state_offset, pc->gmode, n_emit, seed);
    float *da = chk_dev_copy(env, a, (size_t)T * dim * 4), *dg = chk_dev_copy(env, g, (size_t)T * dim * 4);
    uint16_t *dl = chk_dev_copy(env, lc, ((size_t)n_emit + 1) * dim * 2);
    kern_compress_pool p = {.n_rows = T, .dim = dim, .ratio = pc->ratio, .a = da, .g = dg,
                            .n_seqs = pc->n_seqs, .seqs = kv.seqs_d, .row_seq = row_seq,
                            .state_offset = pc->state_offset, .state_tokens = state_tokens,
                            .n_emit = n_emit, .emit_row = emit, .latent = dl};
    size_t bad = chk_gpu_status(env, env->gpu.ops.compress_pool(env->gpu.ctx, &p), what);
    chk_get(env, lg, dl, ((size_t)n_emit + 1) * dim * 2);
    chk_kv_get(env, &kv, NULL, slots);
    p.a = a, p.g = g, p.seqs = kv.seqs_h, p.latent = lc;
    chk_cpu_status(env->cpu.ops.compress_pool(env->cpu.ctx, &p), what);
    if (!bad) {
        bad = chk_cmp_bf16_exact(what, lc, lg, ((size_t)n_emit + 1) * dim);
        bad += chk_cmp_bytes(what, kv.slots_h, slots, slot_bytes * pc->n_seqs);
    }
    chk_count(env, bad);
    chk_dev_free(env, da), chk_dev_free(env, dg), chk_dev_free(env, dl);
    chk_kv_free(env, &kv);
    free(buf), free(a), free(g), free(row_seq), free(emit), free(lc), free(lg), free(slots);
}

/* ---- compressed_store ---- */

typedef struct cstore_case {
    uint32_t n_seqs;
    uint32_t entries[MAX_SEQS]; /* entries each sequence's table reaches */
    uint32_t dim, index_dim;    /* index_dim 0: no index keys */
    uint32_t per_block, skew;
    int mode;
} cstore_case;

static void check_compressed_store(chk_env *env, const cstore_case *cc)
{
    di_rng rng;
    uint64_t seed = chk_case_rng(env, &rng);
    chk_seq_shape seqs[MAX_SEQS];
    for (uint32_t s = 0; s < cc->n_seqs; s++)
        seqs[s] = (chk_seq_shape){.n_rows = 1, .pos0 = 0, .n_entries = cc->entries[s], .has_slot = 1};
    chk_kv kv;
    chk_kv_shape ks = {.entries_per_block = cc->per_block, .dim = cc->dim,
                       .index_dim = cc->index_dim ? cc->index_dim : 32, .skew = cc->skew};
    chk_kv_make(env, &kv, &ks, cc->n_seqs, seqs, 16, &rng);
    /* a random half of every sequence's entries, each once, sequences interleaved */
    uint32_t cap = 0;
    for (uint32_t s = 0; s < cc->n_seqs; s++)
        cap += cc->entries[s];
    int64_t *ids = chk_malloc((size_t)(cap + 1) * 8);
    int32_t *eseq = chk_malloc((size_t)(cap + 1) * 4);
    uint32_t n = 0;
    for (uint32_t j = 0; j < cap; j++)
        for (uint32_t s = 0; s < cc->n_seqs; s++)
            if (j < cc->entries[s] && (di_rng_below(&rng, 2) || j + 1 == cc->entries[s])) {
                ids[n] = j;
                eseq[n++] = (int32_t)s;
            }
    uint16_t *main = chk_malloc((size_t)n * cc->dim * 2 + 2);
    uint16_t *index = chk_malloc((size_t)n * (cc->index_dim + 1) * 2 + 2);
    chk_fill_bf16(main, (size_t)n * cc->dim, cc->mode, &rng);
    chk_fill_bf16(index, (size_t)n * cc->index_dim, cc->mode, &rng);
    size_t bbytes = chk_kv_block_bytes(&kv) * kv.n_blocks;
    uint8_t *blocks = chk_malloc(bbytes);
    char what[256];
    snprintf(what, sizeof(what), "compressed_store seqs=%u entries=%u dim=%u index_dim=%u "
             "per_block=%u skew=%u mode=%s seed=%" PRIu64, cc->n_seqs, n, cc->dim, cc->index_dim,
             cc->per_block, cc->skew, chk_mode_name[cc->mode], seed);
    uint16_t *dmain = chk_dev_copy(env, main, (size_t)n * cc->dim * 2 + 2);
    uint16_t *dindex = chk_dev_copy(env, index, (size_t)n * (cc->index_dim + 1) * 2 + 2);
    kern_compressed_store p = {.n_entries = n, .dim = cc->dim, .index_dim = cc->index_dim,
                               .main = dmain, .index = cc->index_dim ? dindex : NULL,
                               .entry_id = ids, .entry_seq = eseq, .seqs = kv.seqs_d,
                               .pool = kv.pool_d};
    size_t bad = chk_gpu_status(env, env->gpu.ops.compressed_store(env->gpu.ctx, &p), what);
    chk_kv_get(env, &kv, blocks, NULL);
    p.main = main, p.index = cc->index_dim ? index : NULL, p.seqs = kv.seqs_h, p.pool = kv.pool_h;
    chk_cpu_status(env->cpu.ops.compressed_store(env->cpu.ctx, &p), what);
    if (!bad)
        bad = chk_cmp_bytes(what, kv.blocks_h, blocks, bbytes);
    chk_count(env, bad);
    chk_dev_free(env, dmain), chk_dev_free(env, dindex);
    chk_kv_free(env, &kv);
    free(ids), free(eseq), free(main), free(index), free(blocks);
}

/* ---- refused inputs ---- */

static void check_refusals(chk_env *env)
{
    kern_ops *o = &env->gpu.ops;
    void *c = env->gpu.ctx;
    di_rng rng;
    chk_case_rng(env, &rng);
    chk_seq_shape ss[1] = {{.n_rows = 2, .pos0 = 5, .n_entries = 4, .has_slot = 1}};
    chk_kv kv;
    chk_kv_shape ks = {.entries_per_block = 2, .dim = 32, .index_dim = 32};
    chk_kv_make(env, &kv, &ks, 1, ss, 4096, &rng);
    uint8_t *d = chk_dev_alloc(env, 1 << 16);
    size_t bad = 0;
    kern_ring_store rs = {.n_rows = 2, .dim = 48, .kv = (uint16_t *)d, .n_seqs = 1,
                          .seqs = kv.seqs_d, .ring_positions = 8, .local = d + 4096};
    bad += chk_expect(env, o->ring_store(c, NULL), DI_EINVAL, "ring_store(NULL)");
    bad += chk_expect(env, o->ring_store(c, &rs), DI_EINVAL, "ring_store dim 48");
    int32_t row_seq[2] = {0, 0}, emit[1] = {0};
    kern_compress_pool cp = {.n_rows = 2, .dim = 32, .ratio = 1, .a = (float *)d, .g = (float *)d,
                             .n_seqs = 1, .seqs = kv.seqs_d, .row_seq = row_seq,
                             .state_tokens = 2, .n_emit = 1, .emit_row = emit,
                             .latent = (uint16_t *)(d + 8192)};
    bad += chk_expect(env, o->compress_pool(c, &cp), DI_EINVAL, "compress_pool ratio 1");
    cp.ratio = 2; /* row 0 is position 5: (5 + 1) % 2 == 0 is a group end; row 1 (6) is not */
    emit[0] = 1;
    bad += chk_expect(env, o->compress_pool(c, &cp), DI_EINVAL, "compress_pool emit at position 6");
    emit[0] = 2;
    bad += chk_expect(env, o->compress_pool(c, &cp), DI_EINVAL, "compress_pool emit row 2 of 2");
    int64_t id[1] = {4};
    int32_t es[1] = {0};
    kern_compressed_store cs = {.n_entries = 1, .dim = 32, .index_dim = 32,
                                .main = (uint16_t *)d, .entry_id = id, .entry_seq = es,
                                .seqs = kv.seqs_d, .pool = kv.pool_d};
    bad += chk_expect(env, o->compressed_store(c, &cs), DI_EINVAL,
                      "compressed_store entry 4 past a 2-block table of 2 per block");
    id[0] = 3;
    bad += chk_expect(env, o->compressed_store(c, &cs), DI_OK, "compressed_store after refusals");
    chk_sync(env);
    chk_count(env, bad);
    printf("refused inputs: %s\n", bad ? "MISMATCHES" : "all refused with DI_EINVAL");
    chk_dev_free(env, d);
    chk_kv_free(env, &kv);
}

/* ---- the sweeps ---- */

#define SEQ(n, p, e, s) {.n_rows = (n), .pos0 = (p), .n_entries = (e), .has_slot = (s)}

static void sweep(chk_env *env)
{
    static const ring_case rings[] = {
        {1, {SEQ(1, 0, 4, 1)}, 512, 134, 0, 1, 1, CHK_NORMAL},
        {3, {SEQ(1, 133, 4, 1), SEQ(1, 1000, 4, 1), SEQ(1, 7, 4, 1)}, 512, 134, 528 * 3, 1, 1, CHK_EDGES},
        {2, {SEQ(63, 100, 4, 1), SEQ(200, 0, 4, 1)}, 64, 134, 66 * 134 + 1, 1, 1, CHK_NORMAL},
        {2, {SEQ(6, 40, 4, 0), SEQ(6, 134 * 5 - 3, 4, 1)}, 128, 129, 5, 1, 1, CHK_LARGE},
        {1, {SEQ(127, 3, 4, 1)}, 512, 134, 0, 1, 0, CHK_TINY},
        {2, {SEQ(3, 9, 4, 1), SEQ(300, 77, 4, 1)}, 96, 134, 17, 0, 1, CHK_NORMAL},
        {4, {SEQ(1, 0, 4, 1), SEQ(2, 1, 4, 0), SEQ(5, 200, 4, 1), SEQ(1, 65535, 4, 1)}, 32, 6, 3, 1, 1, CHK_SPECIALS},
        {1, {SEQ(130, 0, 4, 1)}, 512, 134, 0, 1, 1, CHK_ZEROS},
    };
    int c0 = env->checks;
    for (size_t i = 0; i < sizeof(rings) / sizeof(rings[0]); i++)
        check_ring_store(env, &rings[i]);
    printf("ring_store: %d cases\n", env->checks - c0);

    static const pool_case pools[] = {
        {1, {SEQ(1, 1, 4, 1)}, 512, 2, 6, 0, 0},
        {3, {SEQ(1, 5, 4, 1), SEQ(1, 6, 4, 1), SEQ(1, 1001, 4, 1)}, 512, 2, 6, 3, 1},
        {2, {SEQ(63, 0, 4, 1), SEQ(64, 7, 4, 1)}, 64, 2, 6, 1, 2},
        {2, {SEQ(5, 2, 4, 1), SEQ(9, 13, 4, 1)}, 128, 4, 6, 2, 0},
        {1, {SEQ(40, 3, 4, 1)}, 32, 16, 0, 7, 1},
        {2, {SEQ(3, 1, 4, 1), SEQ(2, 4, 4, 1)}, 96, 3, 1, 5, 3},
        {4, {SEQ(1, 2, 4, 1), SEQ(2, 3, 4, 1), SEQ(127, 130, 4, 1), SEQ(1, 0, 4, 1)}, 512, 2, 6, 0, 2},
        /* placeholder rows: sequences at 0 without a slot save nothing */
        {3, {SEQ(4, 9, 4, 1), SEQ(7, 0, 4, 0), SEQ(3, 0, 4, 0)}, 64, 2, 6, 1, 0},
    };
    c0 = env->checks;
    for (size_t i = 0; i < sizeof(pools) / sizeof(pools[0]); i++)
        check_compress_pool(env, &pools[i]);
    printf("compress_pool: %d cases\n", env->checks - c0);

    static const cstore_case cs[] = {
        {1, {1}, 512, 128, 64, 0, CHK_NORMAL},
        {3, {64, 130, 7}, 512, 128, 64, 0, CHK_EDGES},
        {2, {300, 40}, 64, 32, 128, 1, CHK_NORMAL},
        {2, {9, 33}, 128, 64, 4, 3, CHK_LARGE},
        {1, {200}, 512, 0, 64, 0, CHK_TINY},
        {4, {5, 1, 17, 2}, 32, 32, 2, 5, CHK_SPECIALS},
        {1, {63}, 96, 96, 8, 2, CHK_ZEROS},
        {2, {127, 128}, 512, 128, 128, 0, CHK_ARANGE},
    };
    c0 = env->checks;
    for (size_t i = 0; i < sizeof(cs) / sizeof(cs[0]); i++)
        check_compressed_store(env, &cs[i]);
    printf("compressed_store: %d cases\n", env->checks - c0);
    check_refusals(env);
}

/* ---- benchmark: V4.1-Flash shapes, bytes each op must move over its time ---- */

enum { B_DIM = 512, B_IDIM = 128, B_RING = 134 };

typedef struct bench_arg {
    chk_env *env;
    int op;                     /* 0 ring_store encode + commit, 1 compress_pool, 2 compressed_store */
    uint32_t rows;
    chk_kv *kv;
    uint16_t *x, *idx, *lat;
    uint8_t *local;
    float *a, *g;
    int32_t *row_seq, *emit;
    int64_t *ids;
    uint32_t n_emit;
} bench_arg;

static di_status bench_call(void *varg, int i)
{
    bench_arg *b = varg;
    kern_backend *g = &b->env->gpu;
    if (b->op == 0) {
        kern_ring_store p = {.n_rows = b->rows, .dim = B_DIM, .kv = b->x, .commit = 1,
                             .n_seqs = b->kv->n_seqs, .seqs = b->kv->seqs_d, .ring_offset = 0,
                             .ring_positions = B_RING, .local = b->local};
        return g->ops.ring_store(g->ctx, &p);
    }
    if (b->op == 1) {
        kern_compress_pool p = {.n_rows = b->rows, .dim = B_DIM, .ratio = 2, .a = b->a, .g = b->g,
                                .n_seqs = b->kv->n_seqs, .seqs = b->kv->seqs_d,
                                .row_seq = b->row_seq, .state_offset = (size_t)B_RING * 528,
                                .state_tokens = 7, .n_emit = b->n_emit, .emit_row = b->emit,
                                .latent = b->lat};
        return g->ops.compress_pool(g->ctx, &p);
    }
    kern_compressed_store p = {.n_entries = b->rows, .dim = B_DIM, .index_dim = B_IDIM,
                               .main = b->x, .index = b->idx, .entry_id = b->ids,
                               .entry_seq = b->row_seq, .seqs = b->kv->seqs_d, .pool = b->kv->pool_d};
    return g->ops.compressed_store(g->ctx, &p);
}

static void bench(chk_env *env)
{
    double copy = gpu_copy_gbs((size_t)1 << 30, 20);
    static const uint32_t rows[] = {64, 384};
    printf("\n%-34s %6s %9s %9s %10s %8s\n", "op (V4.1-Flash shapes)", "rows", "us", "GB/s",
           "copy GB/s", "of copy");
    for (int r = 0; r < 2; r++) {
        uint32_t T = rows[r];
        di_rng rng;
        chk_case_rng(env, &rng);
        chk_seq_shape *ss = chk_malloc(T * sizeof(*ss));
        for (uint32_t s = 0; s < T; s++) /* decode rows: one per sequence, odd positions emit */
            ss[s] = (chk_seq_shape){.n_rows = 1, .pos0 = 1001 + 2 * s, .n_entries = 600 + s, .has_slot = 1};
        chk_kv kv;
        chk_kv_shape ks = {.entries_per_block = 64, .dim = B_DIM, .index_dim = B_IDIM, .raw = 1};
        size_t slot = (size_t)B_RING * 528 + 7 * 2 * B_DIM * 4;
        chk_kv_make(env, &kv, &ks, T, ss, slot, &rng);
        bench_arg b = {.env = env, .rows = T, .kv = &kv, .n_emit = T};
        uint16_t *hx = chk_malloc((size_t)T * B_DIM * 2);
        chk_fill_bf16(hx, (size_t)T * B_DIM, CHK_NORMAL, &rng);
        b.x = chk_dev_copy(env, hx, (size_t)T * B_DIM * 2);
        b.idx = chk_dev_copy(env, hx, (size_t)T * B_IDIM * 2);
        b.lat = chk_dev_alloc(env, (size_t)T * B_DIM * 2);
        b.local = chk_dev_alloc(env, (size_t)T * 528);
        float *hf = chk_malloc((size_t)T * B_DIM * 4);
        chk_fill_f32(hf, (size_t)T * B_DIM, 1.0, &rng);
        b.a = chk_dev_copy(env, hf, (size_t)T * B_DIM * 4);
        b.g = chk_dev_copy(env, hf, (size_t)T * B_DIM * 4);
        b.row_seq = chk_malloc(T * 4);
        b.emit = chk_malloc(T * 4);
        b.ids = chk_malloc(T * 8);
        for (uint32_t s = 0; s < T; s++) {
            b.row_seq[s] = b.emit[s] = (int32_t)s;
            b.ids[s] = 500 + s;
        }
        static const char *const names[] = {"ring_store encode+commit [T,512]",
                                            "compress_pool r=2 [T,512] fp32", "compressed_store (C)+(B)"};
        for (int op = 0; op < 3; op++) {
            b.op = op;
            double ms = chk_time_ms(env, bench_call, &b, 3, 30);
            double bytes = op == 0 ? T * (B_DIM * 2.0 + 2 * 528.0 + 528.0)
                                   : op == 1 ? T * (B_DIM * 4.0 * 2 * 2 + B_DIM * 2.0 + B_DIM * 8.0)
                                             : T * (B_DIM * 2.0 + B_IDIM * 2.0 + 288 + 68);
            if (ms <= 0) {
                printf("%-34s %6u failed (message above)\n", names[op], T);
                continue;
            }
            double gbs = bytes / (ms * 1e-3) / 1e9;
            printf("%-34s %6u %9.1f %9.0f %10.0f %7.0f%%\n", names[op], T, ms * 1e3, gbs, copy,
                   100.0 * gbs / copy);
        }
        chk_dev_free(env, b.x), chk_dev_free(env, b.idx), chk_dev_free(env, b.lat);
        chk_dev_free(env, b.local), chk_dev_free(env, b.a), chk_dev_free(env, b.g);
        free(b.row_seq), free(b.emit), free(b.ids), free(hx), free(hf), free(ss);
        chk_kv_free(env, &kv);
    }
    printf("(one decode row per sequence; times include the host-side metadata upload; these ops "
           "move little data, so launch and upload costs dominate)\n");
}

int main(int argc, char **argv)
{
    chk_env env;
    int want_bench = chk_init(&env, argc, argv, usage);
    sweep(&env);
    return chk_finish(&env, "check_cache", want_bench, bench);
}
