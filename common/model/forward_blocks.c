/* forward_blocks.c: the building blocks of a layer (STYLE.md H6): hyper-connection sites,
 * attention with its window ring, the compressed-KV owner, the indexer, MoE and Engram.
 * Every intermediate carries its shape and a debug name with the layer index. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "common/model/forward_internal.h"

/* Indexer scores are computed in row blocks of at most this many bytes. */
#define SCORE_BUDGET_BYTES ((size_t)128 << 20)

kern_rope fwd_rope_params(const fwd_model *m, uint32_t ratio)
{
    const model_config *c = m->cfg;
    kern_rope p = {.rope_dim = c->rope_head_dim, .yarn_factor = (float)c->rope_factor,
                   .yarn_orig_len = (float)c->original_seq_len,
                   .yarn_beta_fast = (float)c->beta_fast, .yarn_beta_slow = (float)c->beta_slow};
    p.base = (float)(ratio ? c->compress_rope_theta : c->rope_theta);
    p.yarn = ratio != 0;
    return p;
}

/* RoPE on the last rope_dim numbers of each of n_heads heads of width head_dim. */
static di_status rope(fwd_run *r, uint32_t ratio, uint16_t *x, uint32_t n_rows, uint32_t n_heads,
                      uint32_t head_dim, const int64_t *pos, int inverse, int32_t layer,
                      di_error *err)
{
    kern_rope p = fwd_rope_params(r->m, ratio);
    p.n_rows = n_rows;
    p.n_heads = n_heads;
    p.x = x;
    p.row_stride = (size_t)n_heads * head_dim;
    p.head_stride = head_dim;
    p.offset = head_dim - p.rope_dim;
    p.positions = pos;
    p.inverse = inverse;
    FWD_TRY(err, layer, r->m->be->ops.rope(r->m->be->ctx, &p));
    return DI_OK;
}

static di_status rmsnorm(fwd_run *r, uint16_t *x, uint32_t n_rows, uint32_t dim,
                         const uint16_t *w, int32_t layer, di_error *err)
{
    kern_rmsnorm p = {.n_rows = n_rows, .dim = dim, .x = x, .x_stride = dim, .weight = w,
                      .y = x, .y_stride = dim, .eps = (float)r->m->cfg->norm_eps};
    FWD_TRY(err, layer, r->m->be->ops.rmsnorm(r->m->be->ctx, &p));
    return DI_OK;
}

/* y [m, n] = x [m, k] @ W^T with an FP8 weight and FP8 activations, bf16 out. */
static di_status linear_fp8(fwd_run *r, const uint16_t *x, uint32_t m, uint32_t k,
                            const uint8_t *w, const uint8_t *ws, uint32_t n, uint16_t *y,
                            int32_t layer, di_error *err)
{
    kern_linear p = {.m = m, .n = n, .k = k, .groups = 1, .x = x, .x_stride = k, .w = w,
                     .w_scale = ws, .y = y, .y_stride = n};
    FWD_TRY(err, layer, r->m->be->ops.linear_fp8(r->m->be->ctx, &p));
    return DI_OK;
}

/* y = x @ W^T with a bf16 weight (exact bf16 inputs, fp32 accumulation), bf16 or f32 out. */
static di_status linear_bf16(fwd_run *r, const uint16_t *x, uint32_t m, uint32_t k,
                             const uint16_t *w, uint32_t n, void *y, int out_f32, int32_t layer,
                             di_error *err)
{
    kern_linear p = {.m = m, .n = n, .k = k, .groups = 1, .x = x, .x_stride = k, .w = w,
                     .out_f32 = out_f32, .y = y, .y_stride = n};
    FWD_TRY(err, layer, r->m->be->ops.linear_bf16(r->m->be->ctx, &p));
    return DI_OK;
}

/* ---- hyper-connection sites ---------------------------------------------------------------- */

di_status fwd_hc_site_in(fwd_run *r, uint32_t T, const fwd_site_w *site, const uint16_t *norm,
                         const float *pre_in, size_t pre_stride, float *pre_out, float *post,
                         float *comb, int32_t layer, di_error *err)
{
    const fwd_model *m = r->m;
    const model_config *c = m->cfg;
    kern_hc_mixes mx = {.n_rows = T, .n_copies = c->hc_mult, .dim = c->dim, .h = r->h,
                        .fn = site->fn, .base = site->base, .scale = site->scale,
                        .sinkhorn_iters = c->hc_sinkhorn_iters, .eps = c->hc_eps,
                        .norm_eps = (float)c->norm_eps, .pre = pre_out, .post = post,
                        .comb = comb};
    FWD_TRY(err, layer, m->be->ops.hc_mixes(m->be->ctx, &mx)); /* [T, hc], [T, hc], [T, hc, hc] */
    kern_hc_collapse col = {.n_rows = T, .n_copies = c->hc_mult, .dim = c->dim, .h = r->h,
                            .pre = pre_in, .pre_stride = pre_stride, .out = r->x,
                            .out_stride = c->dim};
    FWD_TRY(err, layer, m->be->ops.hc_collapse(m->be->ctx, &col)); /* x [T, D] */
    return rmsnorm(r, r->x, T, c->dim, norm, layer, err);
}

di_status fwd_hc_expand(fwd_run *r, uint32_t T, const float *post, const float *comb,
                        int32_t layer, di_error *err)
{
    const fwd_model *m = r->m;
    const model_config *c = m->cfg;
    kern_hc_expand ex = {.n_rows = T, .n_copies = c->hc_mult, .dim = c->dim, .y = r->y,
                         .h = r->h, .post = post, .comb = comb, .out = r->h2};
    FWD_TRY(err, layer, m->be->ops.hc_expand(m->be->ctx, &ex)); /* H' [T, hc, D] */
    uint16_t *t = r->h;
    r->h = r->h2;
    r->h2 = t;
    return DI_OK;
}

/* ---- compressed KV owner (MODEL.md §2.6, index keys of §2.7) ------------------------------- */

static kern_kv_pool owner_pool(const fwd_model *m, const fwd_kv *kv, uint32_t owner)
{
    const kv_geometry *g = &m->geom;
    kern_kv_pool p = {.blocks = kv->blocks, .block_bytes = kv->block_bytes,
                      .entries_per_block = kv_owner_entries_per_block(g, owner),
                      .main_offset = kv_owner_main_offset(g, owner, 0),
                      .main_entry_bytes = kv_main_entry_bytes(g),
                      .index_offset = kv_owner_index_offset(g, owner, 0),
                      .index_entry_bytes = kv_index_entry_bytes(g)};
    return p;
}

/* Rows completing a group of `ratio` tokens emit compressed entry j = (p + 1) / ratio - 1. */
static uint32_t plan_emits(fwd_run *r, uint32_t ratio)
{
    uint32_t n = 0;
    for (uint32_t t = 0; t < r->rows.n_live; t++) { /* placeholder rows store nothing */
        int64_t p = r->rows.pos[t];
        if ((p + 1) % ratio)
            continue;
        r->emit_row[n] = (int32_t)t;
        r->emit_id[n] = (p + 1) / ratio - 1;
        r->emit_pos[n] = r->emit_id[n] * ratio;
        r->emit_seq[n] = r->rows.row_seq[t];
        n++;
    }
    return n;
}

static di_status compress(fwd_run *r, fwd_kv *kv, const fwd_layer_w *L, di_error *err)
{
    fwd_model *m = r->m;
    const model_config *c = m->cfg;
    const kern_backend *be = m->be;
    int32_t l = (int32_t)L->id;
    uint32_t T = r->rows.n, hd = c->head_dim, id = c->index_head_dim, ratio = L->role->ratio;
    uint32_t owner = (uint32_t)L->role->kv_owner;
    uint32_t E = plan_emits(r, ratio);
    di_status st;
    if (ratio > 1) {
        /* a, g [T, hd] fp32 from fp32 weights; pooled into latent [E, hd] */
        if ((st = linear_bf16(r, r->x, T, c->dim, L->c_wkv, hd, r->ca, 1, l, err)) != DI_OK ||
            (st = linear_bf16(r, r->x, T, c->dim, L->c_wgate, hd, r->cg, 1, l, err)) != DI_OK)
            return st;
        kern_compress_pool p = {.n_rows = T, .dim = hd, .ratio = ratio, .a = r->ca, .g = r->cg,
                                .n_seqs = r->rows.n_seqs, .seqs = r->rows.seqs,
                                .row_seq = r->rows.row_seq,
                                .state_offset = state_compressor_offset(&m->geom, owner),
                                .state_tokens = state_compressor_tokens(&m->geom, owner),
                                .n_emit = E, .emit_row = r->emit_row, .latent = r->latent};
        FWD_TRY(err, l, be->ops.compress_pool(be->ctx, &p));
    } else if ((st = linear_bf16(r, r->x, T, c->dim, L->c_wkv, hd, r->latent, 0, l, err)) != DI_OK) {
        return st; /* ratio 1: latent [T, hd] bf16, every row emits */
    }
    if (E == 0)
        return DI_OK;
    if ((st = rmsnorm(r, r->latent, E, hd, L->c_norm, l, err)) != DI_OK)
        return st;
    fwd_dump(r, "compress.latent", l, FWD_BF16, r->latent, E, hd, 0); /* [E, hd] */
    if (L->role->owns_index_keys) {
        /* index keys [E, id]: norm, RoPE at j*r, stored FP4 (B) */
        if ((st = linear_bf16(r, r->latent, E, hd, L->i_wk, id, r->ckey, 0, l, err)) != DI_OK ||
            (st = rmsnorm(r, r->ckey, E, id, L->i_knorm, l, err)) != DI_OK ||
            (st = rope(r, ratio, r->ckey, E, 1, id, r->emit_pos, 0, l, err)) != DI_OK)
            return st;
    }
    /* main entries [E, hd]: RoPE at j*r, stored FP4 (C) */
    kern_copy_rows cp = {.n_rows = E, .row_bytes = (size_t)hd * 2, .src = r->latent,
                         .src_stride = (size_t)hd * 2, .dst = r->cmain, .dst_stride = (size_t)hd * 2};
    FWD_TRY(err, l, be->ops.copy_rows(be->ctx, &cp));
    if ((st = rope(r, ratio, r->cmain, E, 1, hd, r->emit_pos, 0, l, err)) != DI_OK)
        return st;
    fwd_dump(r, "compress.main", l, FWD_BF16, r->cmain, E, hd, 0); /* [E, hd] before (C) */
    if (L->role->owns_index_keys)
        fwd_dump(r, "compress.key", l, FWD_BF16, r->ckey, E, id, 0); /* [E, id] before (B) */
    kern_compressed_store cs = {.n_entries = E, .dim = hd, .index_dim = id, .main = r->cmain,
                                .index = L->role->owns_index_keys ? r->ckey : NULL,
                                .entry_id = r->emit_id, .entry_seq = r->emit_seq,
                                .seqs = r->rows.seqs, .pool = owner_pool(m, kv, owner)};
    FWD_TRY(err, l, be->ops.compressed_store(be->ctx, &cs));
    return DI_OK;
}

/* ---- indexer (MODEL.md §2.7) --------------------------------------------------------------- */

/* Makes room for scores of `rows` rows of `width` entries. */
static di_status ensure_scores(fwd_run *r, size_t rows, size_t width, di_error *err)
{
    const kern_backend *be = r->m->be;
    size_t need = rows * width;
    if (r->scores_cap < need) {
        /* grow by half again at least (up to the budget): a decode step's width grows with the
         * context, and a device backend's free waits for its queue */
        size_t grown = r->scores_cap + r->scores_cap / 2, limit = SCORE_BUDGET_BYTES / 4;
        size_t cap = grown < limit ? grown : limit;
        cap = cap > need ? cap : need;
        if (r->scores)
            be->ops.free(be->ctx, r->scores);
        r->scores = be->ops.alloc(be->ctx, cap * sizeof(float));
        r->scores_cap = r->scores ? cap : 0;
        if (!r->scores)
            return di_fail(err, DI_ENOMEM, "indexer scores of %zu x %zu", rows, width);
    }
    r->scores_stride = width;
    return DI_OK;
}

static di_status ensure_cand(fwd_run *r, size_t width, di_error *err)
{
    const kern_backend *be = r->m->be;
    if (r->cand && r->cand_stride >= width)
        return DI_OK;
    if (r->cand)
        be->ops.free(be->ctx, r->cand);
    width = (width / 256 + 1) * 256; /* room for 2048 more entries before the next growth */
    r->cand = be->ops.alloc(be->ctx, (size_t)r->max_rows * width);
    r->cand_stride = r->cand ? width : 0;
    if (!r->cand)
        return di_fail(err, DI_ENOMEM, "candidate blocks of %zu", width);
    return DI_OK;
}

static di_status indexer(fwd_run *r, fwd_kv *kv, const fwd_layer_w *L, di_error *err)
{
    fwd_model *m = r->m;
    const model_config *c = m->cfg;
    const kern_backend *be = m->be;
    int32_t l = (int32_t)L->id;
    uint32_t T = r->rows.n, ih = c->index_n_heads, id = c->index_head_dim;
    const model_layer_role *src = &c->roles[L->role->index_key_source];
    uint32_t rk = src->ratio;
    int32_t maxv = 0;
    for (uint32_t t = 0; t < T; t++) {
        r->nvis[t] = t < r->rows.n_live ? (int32_t)((r->rows.pos[t] + 1) / rk) : 0;
        maxv = r->nvis[t] > maxv ? r->nvis[t] : maxv;
    }
    di_status st;
    /* queries [T, ih, id]: RoPE at p, FP4 (B) fake quantisation per 32 */
    if ((st = linear_fp8(r, r->qr, T, c->q_lora_rank, L->i_wq_b, L->i_wq_b_s, ih * id, r->iq, l,
                         err)) != DI_OK ||
        (st = rope(r, L->role->ratio, r->iq, T, ih, id, r->rows.pos, 0, l, err)) != DI_OK)
        return st;
    kern_fakequant fq = {.n_rows = T, .n = ih * id, .x = r->iq, .stride = (size_t)ih * id,
                         .fmt = KERN_Q_FP4_B32};
    FWD_TRY(err, l, be->ops.fakequant(be->ctx, &fq));
    /* head weights [T, ih] bf16 */
    if ((st = linear_bf16(r, r->x, T, c->dim, L->i_wproj, ih, r->iw, 0, l, err)) != DI_OK)
        return st;
    /* the scores' row stride rounded up to a power of two (at least 64): a decode step's
     * width grows with the context, and a step of the same stride can replay a CUDA graph */
    size_t width = 64;
    while (width < (size_t)maxv)
        width *= 2;
    size_t block = SCORE_BUDGET_BYTES / (width * sizeof(float));
    block = block < 1 ? 1 : (block > T ? T : block);
    if ((st = ensure_scores(r, block, width, err)) != DI_OK)
        return st;
    size_t cb = c->candidate_block_size, cwidth = ((size_t)(maxv > 0 ? maxv : 1) + cb - 1) / cb;
    if (L->role->publishes_candidates && (st = ensure_cand(r, cwidth, err)) != DI_OK)
        return st;
    for (uint32_t t0 = 0; t0 < T; t0 += (uint32_t)block) {
        uint32_t n = T - t0 < block ? T - t0 : (uint32_t)block;
        kern_index_scores sc = {.n_rows = n, .n_heads = ih, .head_dim = id,
                                .q = r->iq + (size_t)t0 * ih * id, .w = r->iw + (size_t)t0 * ih,
                                .w_scale = m->index_w_scale, .n_visible = r->nvis + t0,
                                .row_seq = r->rows.row_seq + t0, .seqs = r->rows.seqs,
                                .pool = owner_pool(m, kv, (uint32_t)src->kv_owner),
                                .cand_mask = L->role->uses_candidates
                                                 ? r->cand + (size_t)t0 * r->cand_stride : NULL,
                                .cand_stride = r->cand_stride, .cand_block = (uint32_t)cb,
                                .scores = r->scores, .stride = r->scores_stride};
        FWD_TRY(err, l, be->ops.index_scores(be->ctx, &sc)); /* [n, S] */
        if (L->role->publishes_candidates) {
            kern_index_candidates cd = {.n_rows = n, .scores = r->scores,
                                        .stride = r->scores_stride, .n_visible = r->nvis + t0,
                                        .block = (uint32_t)cb,
                                        .top_blocks = c->candidate_topk_blocks,
                                        .mask = r->cand + (size_t)t0 * r->cand_stride,
                                        .mask_stride = r->cand_stride};
            FWD_TRY(err, l, be->ops.index_candidates(be->ctx, &cd)); /* [n, S/cb] */
        }
        kern_index_topk tk = {.n_rows = n, .k = c->index_topk, .scores = r->scores,
                              .stride = r->scores_stride, .n_visible = r->nvis + t0,
                              .out = r->topk + (size_t)t0 * c->index_topk};
        FWD_TRY(err, l, be->ops.index_topk(be->ctx, &tk)); /* [n, topk] */
    }
    return DI_OK;
}

/* ---- attention (MODEL.md §2.5) ------------------------------------------------------------- */

di_status fwd_attention(fwd_run *r, fwd_kv *kv, const fwd_layer_w *L, size_t ring_offset,
                        int commit, fwd_compact_fn compact_hook, di_error *err)
{
    fwd_model *m = r->m;
    const model_config *c = m->cfg;
    const kern_backend *be = m->be;
    const model_layer_role *role = L->role;
    int32_t l = (int32_t)L->id;
    uint32_t H = c->n_heads, hd = c->head_dim, G = c->o_groups, qlr = c->q_lora_rank;
    di_status st;
    if (role->owns_compressor && (st = compress(r, kv, L, err)) != DI_OK)
        return st; /* every row, before any YOCO compaction */
    if (compact_hook && (st = compact_hook(r, err)) != DI_OK)
        return st;
    uint32_t T = r->rows.n;
    const int64_t *pos = r->rows.pos;
    /* q path: cq [T, qlr] -> qr = q_norm(cq) -> q [T, H, hd], RoPE on the last rope dims */
    if ((st = linear_fp8(r, r->x, T, c->dim, L->wq_a, L->wq_a_s, qlr, r->qr, l, err)) != DI_OK ||
        (st = rmsnorm(r, r->qr, T, qlr, L->q_norm, l, err)) != DI_OK ||
        (st = linear_fp8(r, r->qr, T, qlr, L->wq_b, L->wq_b_s, H * hd, r->q, l, err)) != DI_OK ||
        (st = rope(r, role->ratio, r->q, T, H, hd, pos, 0, l, err)) != DI_OK)
        return st;
    fwd_dump(r, "attn.q", l, FWD_BF16, r->q, T, H, hd);
    /* window KV [T, hd]: norm, RoPE at p, FP8 (A) entries for this step's rows */
    if ((st = linear_fp8(r, r->x, T, c->dim, L->wkv, L->wkv_s, hd, r->kv, l, err)) != DI_OK ||
        (st = rmsnorm(r, r->kv, T, hd, L->kv_norm, l, err)) != DI_OK ||
        (st = rope(r, role->ratio, r->kv, T, 1, hd, pos, 0, l, err)) != DI_OK)
        return st;
    fwd_dump(r, "attn.kv", l, FWD_BF16, r->kv, T, hd, 0);
    kern_ring_store rs = {.n_rows = T, .dim = hd, .kv = r->kv, .n_seqs = r->rows.n_seqs,
                          .seqs = r->rows.seqs, .ring_offset = ring_offset,
                          .ring_positions = m->geom.ring_positions, .local = r->local};
    FWD_TRY(err, l, be->ops.ring_store(be->ctx, &rs));
    /* long range: the band's top-k list over its KV source's compressed entries */
    kern_kv_pool pool = {0};
    if (role->ratio) {
        if (role->owns_indexer && (st = indexer(r, kv, L, err)) != DI_OK)
            return st;
        pool = owner_pool(m, kv, (uint32_t)role->kv_owner);
        fwd_dump(r, "topk", l, FWD_I32, r->topk, T, c->index_topk, 0); /* [T, topk] */
    }
    kern_sparse_attn at = {.n_rows = T, .n_heads = H, .head_dim = hd, .window = c->window,
                           .ring_positions = m->geom.ring_positions, .q = r->q, .local = r->local,
                           .ring_offset = ring_offset, .topk = role->ratio ? r->topk : NULL,
                           .topk_n = c->index_topk, .pool = pool, .n_seqs = r->rows.n_seqs,
                           .seqs = r->rows.seqs, .sink = L->sink,
                           .scale = (float)(1.0 / sqrt((double)hd)), .out = r->o};
    FWD_TRY(err, l, be->ops.sparse_attn(be->ctx, &at)); /* o [T, H, hd] */
    fwd_dump(r, "attn.o", l, FWD_BF16, r->o, T, H, hd);
    if (commit) { /* after the reads: a long chunk must not overwrite what its first rows read */
        rs.kv = NULL;
        rs.commit = 1;
        FWD_TRY(err, l, be->ops.ring_store(be->ctx, &rs));
    }
    if ((st = rope(r, role->ratio, r->o, T, H, hd, pos, 1, l, err)) != DI_OK)
        return st;
    /* grouped output projection: z [T, G*olr] (bf16 GEMM per group), out = wo_b z [T, D] */
    kern_linear woa = {.m = T, .n = c->o_lora_rank, .k = H * hd / G, .groups = G, .x = r->o,
                       .x_stride = (size_t)H * hd, .w = L->wo_a, .y = r->z,
                       .y_stride = (size_t)G * c->o_lora_rank};
    FWD_TRY(err, l, be->ops.linear_bf16(be->ctx, &woa));
    return linear_fp8(r, r->z, T, G * c->o_lora_rank, L->wo_b, L->wo_b_s, c->dim, r->y, l, err);
}

/* ---- MoE (MODEL.md §2.8) ------------------------------------------------------------------- */

di_status fwd_moe(fwd_run *r, const fwd_layer_w *L, di_error *err)
{
    fwd_model *m = r->m;
    const model_config *c = m->cfg;
    const kern_backend *be = m->be;
    int32_t l = (int32_t)L->id;
    uint32_t T = r->rows.n;
    di_status st;
    /* router logits [T, E] fp32 from the fp32-promoted bf16 gate */
    if ((st = linear_bf16(r, r->x, T, c->dim, L->gate, L->n_experts, r->glog, 1, l, err)) != DI_OK)
        return st;
    kern_moe_gate g = {.n_rows = T, .n_experts = L->n_experts, .top_k = L->top_k,
                       .logits = r->glog, .bias = L->gate_bias, .temp = (float)c->gate_temp,
                       .route_scale = (float)c->route_scale, .ids = r->eids, .weights = r->ew};
    FWD_TRY(err, l, be->ops.moe_gate(be->ctx, &g)); /* ids, weights [T, k] */
    fwd_dump(r, "ffn.ids", l, FWD_I32, r->eids, T, L->top_k, 0);
    /* placeholder rows (the last ones) run no expert: their picks are dropped here, so no
     * expert's load counts them; their y rows keep the attention's output */
    kern_moe_experts e = {.n_rows = r->rows.n_live, .dim = c->dim, .inter = c->moe_inter_dim,
                          .shared_inter = c->n_shared_experts * c->moe_inter_dim,
                          .n_experts = L->n_experts, .top_k = L->top_k, .x = r->x,
                          .ids = r->eids, .weights = r->ew, .experts = L->experts,
                          .shared = L->shared, .swiglu_limit = (float)c->swiglu_limit, .y = r->y};
    if (m->opt.moe_fn && L->id < c->n_layers) /* experts on the ranks that hold them */
        return m->opt.moe_fn(m->opt.moe_userdata, L->id, &e, err); /* collective: even 0 rows */
    if (e.n_rows)
        FWD_TRY(err, l, be->ops.moe_experts(be->ctx, &e)); /* y [n_live, D] */
    return DI_OK;
}

/* ---- Engram (MODEL.md §2.9) ---------------------------------------------------------------- */

static void seeded_row(void *ud, uint64_t row, uint8_t *codes, uint8_t *scales)
{
    const model_engram_weights *e = ud;
    model_engram_seeded_row(e->seed, e->layer, row, e->width, codes, scales);
}

di_status fwd_engram(fwd_run *r, const fwd_layer_w *L, di_error *err)
{
    fwd_model *m = r->m;
    const model_config *c = m->cfg;
    const kern_backend *be = m->be;
    const model_engram_weights *e = L->engram;
    int32_t l = (int32_t)L->id;
    uint32_t T = r->rows.n, cols = c->engram_cols, w = c->engram_head_dim, hc = c->hc_mult;
    kern_engram_lookup lk = {.n_rows = T, .n_cols = cols, .head_dim = w,
                             .hash = r->hash + (size_t)L->engram_slot * cols,
                             .hash_stride = (size_t)c->n_engram_layers * cols,
                             .table = L->e_table, .table_scale = L->e_table_s,
                             .table_rows = e->rows, .row_fn = e->seeded ? seeded_row : NULL,
                             .row_userdata = (void *)e, .out = r->erows};
    FWD_TRY(err, l, be->ops.engram_lookup(be->ctx, &lk)); /* rows [T, cols*w] */
    di_status st = linear_fp8(r, r->erows, T, cols * w, L->e_wkv, L->e_wkv_s, (hc + 1) * c->dim,
                              r->ekv, l, err); /* keys and value [T, (hc+1)*D] */
    if (st != DI_OK)
        return st;
    kern_engram_gate gt = {.n_rows = T, .n_copies = hc, .dim = c->dim, .h = r->h, .kv = r->ekv,
                           .q_weight = L->e_q, .k_weight = L->e_k, .eps = c->norm_eps,
                           .clamp = 1e-6};
    FWD_TRY(err, l, be->ops.engram_gate(be->ctx, &gt)); /* H [T, hc, D] */
    fwd_dump(r, "engram_H", l, FWD_BF16, r->h, T, hc, c->dim);
    return DI_OK;
}
