/* Cache writes (rings, compressed entries, compressor state) and sparse attention of the CPU
 * backend against byte-level and double-precision formulations. */
#include <criterion/criterion.h>

#include "common/kvfmt/kv_layout.h"
#include "common/model/config.h"
#include "tests/forward/testutil.h"

/* One sequence's view for the ops. */
static kern_seq seq_of(uint32_t row0, uint32_t n, int64_t pos0, uint8_t *slot,
                       const uint32_t *blocks, uint32_t n_blocks)
{
    kern_seq s = {.row0 = row0, .n_rows = n, .pos0 = pos0, .slot = slot, .blocks = blocks,
                  .n_blocks = n_blocks, .window_lo = 0, .ring_hi = -1};
    return s;
}

Test(ops_cache, ring_entries_are_procedure_a_bytes_at_position_mod_ring)
{
    kern_backend be = test_backend(2);
    di_rng r;
    di_rng_init(&r, 21);
    const uint32_t dim = 64, R = 14, T = 40, eb = dim + dim / 32;
    uint16_t *kv = malloc(T * dim * 2);
    fill_bf16(kv, T * dim, FILL_LIMITS, &r, 1.0f);
    uint8_t *local = malloc(T * eb), *slot = calloc(1, 16 + R * eb);
    kern_seq s = seq_of(0, T, 1000, slot, NULL, 0);
    kern_ring_store p = {.n_rows = T, .dim = dim, .kv = kv, .commit = 0, .n_seqs = 1, .seqs = &s,
                         .ring_offset = 16, .ring_positions = R, .local = local};
    cr_assert_eq(be.ops.ring_store(be.ctx, &p), DI_OK);
    for (uint32_t i = 0; i < R * eb; i++)
        cr_assert_eq(slot[16 + i], 0, "encode alone must not touch the ring");
    float x[64];
    uint8_t codes[64], sc[2];
    for (uint32_t t = 0; t < T; t++) {
        for (uint32_t i = 0; i < dim; i++)
            x[i] = di_bf16_to_f32(kv[t * dim + i]);
        di_quant_fp8_b32(x, dim, codes, sc);
        cr_assert_eq(memcmp(local + t * eb, codes, dim), 0, "row %u codes", t);
        cr_assert_eq(memcmp(local + t * eb + dim, sc, 2), 0, "row %u scales", t);
    }
    p.kv = NULL;
    p.commit = 1;
    cr_assert_eq(be.ops.ring_store(be.ctx, &p), DI_OK);
    /* the last R rows (positions 1026..1039) land at slot pos mod R; nothing else is written */
    for (uint32_t t = T - R; t < T; t++) {
        uint32_t sl = (uint32_t)((1000 + t) % R);
        cr_assert_eq(memcmp(slot + 16 + sl * eb, local + t * eb, eb), 0, "position %u", 1000 + t);
    }
    for (uint32_t i = 0; i < 16; i++)
        cr_assert_eq(slot[i], 0, "bytes before the ring untouched");
    free(kv);
    free(local);
    free(slot);
    kern_cpu_destroy(&be);
}

Test(ops_cache, compressed_entries_land_in_their_block_and_offset)
{
    kern_backend be = test_backend(2);
    kv_geometry g;
    kv_geometry_v41_flash(5, &g);
    /* the explainer's example on the full geometry: entry 8,194 of the ratio-2 owner (layer 2)
     * -> block table entry 128, offset 2; entry 16,389 of the ratio-1 owner -> 128, offset 5 */
    uint32_t table[130];
    for (uint32_t i = 0; i < 130; i++)
        table[i] = 129 - i; /* physical ids differ from table entries */
    size_t bb = kv_block_bytes(&g);
    uint8_t *pool = calloc(130, bb);
    di_rng r;
    di_rng_init(&r, 22);
    uint16_t main[512], idx[128];
    fill_bf16(main, 512, FILL_NORMAL, &r, 1.0f);
    fill_bf16(idx, 128, FILL_NORMAL, &r, 1.0f);
    kern_seq s = seq_of(0, 1, 16389, NULL, table, 130);
    int64_t ids[2] = {8194, 16389};
    uint32_t owners[2] = {0, 3};
    int32_t seqi = 0;
    for (int k = 0; k < 2; k++) {
        uint32_t o = owners[k];
        kern_compressed_store p = {
            .n_entries = 1, .dim = 512, .index_dim = 128, .main = main, .index = idx,
            .entry_id = &ids[k], .entry_seq = &seqi, .seqs = &s,
            .pool = {.blocks = pool, .block_bytes = bb,
                     .entries_per_block = kv_owner_entries_per_block(&g, o),
                     .main_offset = kv_owner_main_offset(&g, o, 0),
                     .main_entry_bytes = kv_main_entry_bytes(&g),
                     .index_offset = kv_owner_index_offset(&g, o, 0),
                     .index_entry_bytes = kv_index_entry_bytes(&g)}};
        cr_assert_eq(be.ops.compressed_store(be.ctx, &p), DI_OK);
        uint32_t blk = (uint32_t)(ids[k] / kv_owner_entries_per_block(&g, o));
        uint32_t off = (uint32_t)(ids[k] % kv_owner_entries_per_block(&g, o));
        cr_assert_eq(blk, 128);
        cr_assert_eq(off, k == 0 ? 2u : 5u);
        uint8_t *b = pool + (size_t)table[blk] * bb;
        float x[512];
        uint8_t packed[256], sc[32];
        for (int i = 0; i < 512; i++)
            x[i] = di_bf16_to_f32(main[i]);
        di_quant_fp4_b16(x, 512, packed, sc);
        const uint8_t *e = b + kv_owner_main_offset(&g, o, off);
        cr_assert_eq(memcmp(e, packed, 256), 0);
        cr_assert_eq(memcmp(e + 256, sc, 32), 0);
        for (int i = 0; i < 128; i++)
            x[i] = di_bf16_to_f32(idx[i]);
        di_quant_fp4_b32(x, 128, packed, sc);
        e = b + kv_owner_index_offset(&g, o, off);
        cr_assert_eq(memcmp(e, packed, 64), 0);
        cr_assert_eq(memcmp(e + 64, sc, 4), 0);
    }
    /* nothing else in the pool was written: 2 main + 2 index entries of non-zero bytes */
    size_t nonzero = 0;
    for (size_t i = 0; i < 130 * bb; i++)
        nonzero += pool[i] != 0;
    cr_assert(nonzero <= 2 * (288 + 68));
    free(pool);
    kern_cpu_destroy(&be);
}

/* Pooling of a ratio-2 group in double: softmax over the two tokens per channel. */
static double ref_pool(const float *a0, const float *g0, const float *a1, const float *g1, int d)
{
    double m = g0[d] > g1[d] ? g0[d] : g1[d];
    double e0 = exp(g0[d] - m), e1 = exp(g1[d] - m);
    return (e0 * a0[d] + e1 * a1[d]) / (e0 + e1);
}

Test(ops_cache, compressor_pools_pairs_across_calls_through_the_pending_state)
{
    kern_backend be = test_backend(2);
    di_rng r;
    di_rng_init(&r, 23);
    const uint32_t dim = 32, T = 9, S = 7; /* ratio 2, spare 6 */
    float *a = malloc(T * dim * 4), *g = malloc(T * dim * 4);
    fill_f32(a, T * dim, FILL_NORMAL, &r, 2.0f);
    fill_f32(g, T * dim, FILL_NORMAL, &r, 3.0f);
    uint8_t *slot = calloc(1, S * 2 * dim * 4);
    uint16_t lat_one[4 * 32], lat_split[4 * 32];
    int32_t row_seq[9] = {0};
    /* one call over positions 0..8 */
    kern_seq s = seq_of(0, T, 0, slot, NULL, 0);
    int32_t emit[4] = {1, 3, 5, 7};
    kern_compress_pool p = {.n_rows = T, .dim = dim, .ratio = 2, .a = a, .g = g, .n_seqs = 1,
                            .seqs = &s, .row_seq = row_seq, .state_offset = 0,
                            .state_tokens = S, .n_emit = 4, .emit_row = emit,
                            .latent = lat_one};
    cr_assert_eq(be.ops.compress_pool(be.ctx, &p), DI_OK);
    /* the same positions in calls of 3, 1 and 5 rows (groups straddle the calls) */
    memset(slot, 0, S * 2 * dim * 4);
    uint32_t cuts[3][2] = {{0, 3}, {3, 1}, {4, 5}};
    int32_t emits[3][2] = {{1, -1}, {0, -1}, {1, 3}}; /* rows (in the call) at odd positions */
    uint32_t ne[3] = {1, 1, 2}, done = 0;
    for (int c = 0; c < 3; c++) {
        kern_seq sc = seq_of(0, cuts[c][1], cuts[c][0], slot, NULL, 0);
        kern_compress_pool q = p;
        q.n_rows = cuts[c][1];
        q.a = a + cuts[c][0] * dim;
        q.g = g + cuts[c][0] * dim;
        q.seqs = &sc;
        q.n_emit = ne[c];
        q.emit_row = emits[c];
        q.latent = lat_split + done * dim;
        cr_assert_eq(be.ops.compress_pool(be.ctx, &q), DI_OK);
        done += ne[c];
    }
    cr_assert_eq(done, 4);
    cr_assert_eq(memcmp(lat_one, lat_split, sizeof(lat_one)), 0,
                 "a split prefill pools exactly as one call");
    for (int j = 0; j < 4; j++)
        for (uint32_t d = 0; d < dim; d++) {
            double ref = ref_pool(a + 2 * j * dim, g + 2 * j * dim, a + (2 * j + 1) * dim,
                                  g + (2 * j + 1) * dim, d);
            cr_assert(fabs(bfd(lat_one[j * dim + d]) - ref) <= fabs(ref) / 256 + 1e-6,
                      "group %d channel %u: %g vs %g", j, d, bfd(lat_one[j * dim + d]), ref);
        }
    /* the pending token of position 8 is in slot 8 mod 7 = 1 */
    cr_assert_eq(memcmp(slot + 1 * 2 * dim * 4, a + 8 * dim, dim * 4), 0);
    cr_assert_eq(memcmp(slot + 1 * 2 * dim * 4 + dim * 4, g + 8 * dim, dim * 4), 0);
    free(a);
    free(g);
    free(slot);
    kern_cpu_destroy(&be);
}

/* ---- sparse attention ---- */

typedef struct attn_fixture {
    uint32_t H, hd, W, R, T;
    uint16_t *q;
    uint8_t *local, *slot, *pool;
    uint32_t blocks[4];
    kern_kv_pool kp;
    float sink[8];
} attn_fixture;

static void attn_setup(attn_fixture *f, di_rng *r, uint32_t T, int64_t pos0)
{
    f->H = 3, f->hd = 64, f->W = 8, f->R = 14, f->T = T;
    uint32_t eb = f->hd + f->hd / 32, mb = f->hd / 2 + f->hd / 16;
    f->q = malloc((size_t)T * f->H * f->hd * 2);
    fill_bf16(f->q, (size_t)T * f->H * f->hd, FILL_NORMAL, r, 1.0f);
    /* local and ring entries: random bytes (valid codes) from random vectors */
    f->local = malloc((size_t)T * eb);
    f->slot = calloc(1, (size_t)f->R * eb);
    float x[64];
    for (uint32_t t = 0; t < T; t++) {
        fill_f32(x, f->hd, FILL_NORMAL, r, 1.0f);
        di_quant_fp8_b32(x, f->hd, f->local + t * eb, f->local + t * eb + f->hd);
    }
    for (uint32_t s = 0; s < f->R; s++) {
        fill_f32(x, f->hd, FILL_NORMAL, r, 1.0f);
        di_quant_fp8_b32(x, f->hd, f->slot + s * eb, f->slot + s * eb + f->hd);
    }
    f->pool = calloc(4, 128 * (size_t)mb);
    for (uint32_t e = 0; e < 4 * 128; e++) {
        fill_f32(x, f->hd, FILL_NORMAL, r, 1.0f);
        di_quant_fp4_b16(x, f->hd, f->pool + e * mb, f->pool + e * mb + f->hd / 2);
    }
    for (int i = 0; i < 4; i++)
        f->blocks[i] = 3 - i;
    kern_kv_pool kp = {.blocks = f->pool, .block_bytes = 128 * (size_t)mb, .entries_per_block = 128,
                       .main_offset = 0, .main_entry_bytes = mb, .index_offset = 0,
                       .index_entry_bytes = 0};
    f->kp = kp;
    for (uint32_t h = 0; h < f->H; h++)
        f->sink[h] = (float)h - 1.0f;
    (void)pos0;
}

static void attn_teardown(attn_fixture *f)
{
    free(f->q);
    free(f->local);
    free(f->slot);
    free(f->pool);
}

/* The key set of row t (MODEL.md §2.5 step 5) decoded with numfmt, then softmax with the sink
 * in double. */
static void ref_attn_row(const attn_fixture *f, const kern_seq *s, const int32_t *topk,
                         uint32_t topk_n, uint32_t t, double *out)
{
    uint32_t eb = f->hd + f->hd / 32, mb = f->hd / 2 + f->hd / 16, n = 0;
    int64_t p = s->pos0 + (t - s->row0);
    static float keys[600][64];
    if (s->ring_hi >= 0) {
        int64_t lo = (int64_t)s->ring_hi - (int64_t)f->W + 1;
        lo = lo < 0 ? 0 : lo;
        for (int64_t q = lo; q <= s->ring_hi; q++) {
            const uint8_t *e = f->slot + (q % f->R) * eb;
            di_dequant_fp8_b32(e, e + f->hd, f->hd, keys[n++]);
        }
        for (uint32_t i = 0; i < s->n_rows; i++) {
            const uint8_t *e = f->local + (s->row0 + i) * eb;
            di_dequant_fp8_b32(e, e + f->hd, f->hd, keys[n++]);
        }
    } else {
        int64_t lo = p - (int64_t)f->W + 1;
        lo = lo < 0 ? 0 : lo;
        if (s->window_lo > 0 && p >= s->window_lo && lo < s->window_lo)
            lo = s->window_lo;
        for (int64_t q = lo; q <= p; q++) {
            const uint8_t *e = q >= s->pos0 ? f->local + (s->row0 + (q - s->pos0)) * eb
                                            : f->slot + (q % f->R) * eb;
            di_dequant_fp8_b32(e, e + f->hd, f->hd, keys[n++]);
        }
    }
    for (uint32_t i = 0; topk && i < topk_n; i++) {
        int32_t id = topk[t * topk_n + i];
        if (id < 0)
            continue;
        const uint8_t *e = f->pool + (size_t)s->blocks[id / 128] * 128 * mb + (id % 128) * mb;
        di_dequant_fp4_b16(e, e + f->hd / 2, f->hd, keys[n++]);
    }
    for (uint32_t h = 0; h < f->H; h++) {
        double sc[600], mx = -1e30, den = 0;
        for (uint32_t e = 0; e < n; e++) {
            double d = 0;
            for (uint32_t i = 0; i < f->hd; i++)
                d += bfd(f->q[(t * f->H + h) * f->hd + i]) * keys[e][i];
            sc[e] = d / sqrt((double)f->hd);
            mx = sc[e] > mx ? sc[e] : mx;
        }
        for (uint32_t i = 0; i < f->hd; i++)
            out[h * f->hd + i] = 0;
        for (uint32_t e = 0; e < n; e++) {
            double pe = exp(sc[e] - mx);
            den += pe;
            for (uint32_t i = 0; i < f->hd; i++)
                out[h * f->hd + i] += pe * keys[e][i];
        }
        den += exp(f->sink[h] - mx);
        for (uint32_t i = 0; i < f->hd; i++)
            out[h * f->hd + i] /= den;
    }
}

static void check_attn(const attn_fixture *f, const kern_seq *s, uint32_t n_seqs,
                       const int32_t *topk, uint32_t topk_n, const uint16_t *out)
{
    double ref[3 * 64];
    for (uint32_t k = 0; k < n_seqs; k++)
        for (uint32_t t = s[k].row0; t < s[k].row0 + s[k].n_rows; t++) {
            ref_attn_row(f, &s[k], topk, topk_n, t, ref);
            for (uint32_t i = 0; i < f->H * f->hd; i++)
                cr_assert(fabs(bfd(out[t * f->H * f->hd + i]) - ref[i]) <= 2e-2 * fabs(ref[i]) + 1e-3,
                          "seq %u row %u elem %u: %g vs %g", k, t, i,
                          bfd(out[t * f->H * f->hd + i]), ref[i]);
        }
}

Test(ops_cache, sparse_attention_matches_double_over_window_ring_and_compressed_entries)
{
    kern_backend be = test_backend(2);
    di_rng r;
    di_rng_init(&r, 24);
    attn_fixture f;
    attn_setup(&f, &r, 12, 0);
    /* seq 0: 3 rows at positions 20..22 (window reads ring positions 13..19);
     * seq 1: 9 rows at 0..8 (a chunk longer than the window, from local only), with top-k */
    kern_seq s[2] = {seq_of(0, 3, 20, f.slot, f.blocks, 4), seq_of(3, 9, 0, f.slot, f.blocks, 4)};
    const uint32_t K = 5;
    int32_t topk[12 * 5];
    for (uint32_t t = 0; t < 12; t++)
        for (uint32_t i = 0; i < K; i++)
            topk[t * K + i] = (i == 2 || t % 4 == 0) ? -1 : (int32_t)(t * 37 + i * 101) % 500;
    uint16_t *out = malloc(12 * f.H * f.hd * 2);
    kern_sparse_attn p = {.n_rows = 12, .n_heads = f.H, .head_dim = f.hd, .window = f.W,
                          .ring_positions = f.R, .q = f.q, .local = f.local, .ring_offset = 0,
                          .topk = topk, .topk_n = K, .pool = f.kp, .n_seqs = 2, .seqs = s,
                          .sink = f.sink, .scale = 1.0f / 8.0f, .out = out};
    cr_assert_eq(be.ops.sparse_attn(be.ctx, &p), DI_OK);
    check_attn(&f, s, 2, topk, K, out);
    /* a sequence alone gives the same bits as in the batch */
    kern_seq s1 = seq_of(0, 9, 0, f.slot, f.blocks, 4);
    kern_sparse_attn p1 = p;
    p1.n_rows = 9, p1.q = f.q + 3 * f.H * f.hd, p1.local = f.local + 3 * (f.hd + 2);
    p1.topk = topk + 3 * K, p1.n_seqs = 1, p1.seqs = &s1, p1.out = malloc(9 * f.H * f.hd * 2);
    cr_assert_eq(be.ops.sparse_attn(be.ctx, &p1), DI_OK);
    cr_assert_eq(memcmp(p1.out, out + 3 * f.H * f.hd, 9 * f.H * f.hd * 2), 0);
    free(p1.out);
    /* YOCO clip: rows at or after window_lo read nothing below it */
    s[1].window_lo = 5;
    cr_assert_eq(be.ops.sparse_attn(be.ctx, &p), DI_OK);
    check_attn(&f, s, 2, topk, K, out);
    /* draft block: ring up to position 30, then every row of the block */
    kern_seq d = seq_of(0, 5, 31, f.slot, NULL, 0);
    d.ring_hi = 30;
    p.n_rows = 5, p.topk = NULL, p.n_seqs = 1, p.seqs = &d;
    cr_assert_eq(be.ops.sparse_attn(be.ctx, &p), DI_OK);
    check_attn(&f, &d, 1, NULL, 0, out);
    free(out);
    attn_teardown(&f);
    kern_cpu_destroy(&be);
}

Test(ops_cache, attention_with_no_keys_gives_zeros_and_huge_sink_gives_zeros)
{
    kern_backend be = test_backend(1);
    di_rng r;
    di_rng_init(&r, 25);
    attn_fixture f;
    attn_setup(&f, &r, 1, 0);
    f.sink[0] = f.sink[1] = f.sink[2] = 1e4f;
    kern_seq s = seq_of(0, 1, 0, f.slot, f.blocks, 4);
    uint16_t out[3 * 64];
    kern_sparse_attn p = {.n_rows = 1, .n_heads = f.H, .head_dim = f.hd, .window = f.W,
                          .ring_positions = f.R, .q = f.q, .local = f.local, .n_seqs = 1,
                          .seqs = &s, .sink = f.sink, .scale = 0.125f, .out = out};
    cr_assert_eq(be.ops.sparse_attn(be.ctx, &p), DI_OK);
    for (int i = 0; i < 3 * 64; i++)
        cr_assert_eq(bfd(out[i]), 0.0, "a dominant sink takes all the mass");
    attn_teardown(&f);
    kern_cpu_destroy(&be);
}
