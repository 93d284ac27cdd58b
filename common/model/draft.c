/* draft.c: the DSpark draft model (MODEL.md §2.11): its rings, written by every main step, and
 * the proposal of nextn tokens with the Markov correction and the confidence head. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "common/model/forward_internal.h"

/* ---- rings ---------------------------------------------------------------------------------- */

di_status fwd_draft_rings(fwd_run *r, fwd_kv *kv, di_error *err)
{
    fwd_model *m = r->m;
    const model_config *c = m->cfg;
    const kern_backend *be = m->be;
    uint32_t T = r->rows.n, D = c->dim, hd = c->head_dim;
    if (T == 0)
        return DI_OK;
    /* mx = main_norm(main_proj [m_t0 | m_t1 | ...]) [T, D] */
    kern_linear mp = {.m = T, .n = D, .k = c->n_dspark_targets * D, .groups = 1, .x = r->taps,
                      .x_stride = (size_t)c->n_dspark_targets * D, .w = m->main_proj,
                      .w_scale = m->main_proj_s, .y = r->mx, .y_stride = D};
    FWD_TRY(err, -1, be->ops.linear_fp8(be->ctx, &mp));
    kern_rmsnorm mn = {.n_rows = T, .dim = D, .x = r->mx, .x_stride = D, .weight = m->main_norm,
                       .y = r->mx, .y_stride = D, .eps = (float)c->norm_eps};
    FWD_TRY(err, -1, be->ops.rmsnorm(be->ctx, &mn));
    fwd_dump(r, "draft.mx", -1, FWD_BF16, r->mx, T, D, 0);
    for (uint32_t s = 0; s < c->n_mtp; s++) {
        const fwd_layer_w *L = &m->layers[c->n_layers + s];
        int32_t id = (int32_t)L->id;
        /* main_kv [T, hd] = FP8(RoPE(kv_norm(wkv_s mx), p)) into the stage's ring */
        kern_linear w = {.m = T, .n = hd, .k = D, .groups = 1, .x = r->mx, .x_stride = D,
                         .w = L->wkv, .w_scale = L->wkv_s, .y = r->kv, .y_stride = hd};
        FWD_TRY(err, id, be->ops.linear_fp8(be->ctx, &w));
        kern_rmsnorm n = {.n_rows = T, .dim = hd, .x = r->kv, .x_stride = hd,
                          .weight = L->kv_norm, .y = r->kv, .y_stride = hd,
                          .eps = (float)c->norm_eps};
        FWD_TRY(err, id, be->ops.rmsnorm(be->ctx, &n));
        kern_rope rp = fwd_rope_params(m, 0);
        rp.n_rows = T, rp.n_heads = 1, rp.x = r->kv, rp.row_stride = hd, rp.head_stride = hd;
        rp.offset = hd - rp.rope_dim, rp.positions = r->rows.pos;
        FWD_TRY(err, id, be->ops.rope(be->ctx, &rp));
        kern_ring_store rs = {.n_rows = T, .dim = hd, .kv = r->kv, .commit = 1,
                              .n_seqs = r->rows.n_seqs, .seqs = r->rows.seqs,
                              .ring_offset = state_draft_ring_offset(&m->geom, s),
                              .ring_positions = m->geom.ring_positions, .local = r->local};
        FWD_TRY(err, id, be->ops.ring_store(be->ctx, &rs));
    }
    return DI_OK;
}

/* ---- proposal ------------------------------------------------------------------------------ */

static di_status check_draft(const fwd_run *r, const fwd_kv *kv, uint32_t n_reqs,
                             const fwd_draft_req *reqs, uint32_t nextn, fwd_draft_sample_fn sample,
                             const fwd_draft_out *out, di_error *err)
{
    const model_config *c = r->m->cfg;
    if (c->n_mtp == 0)
        return di_fail(err, DI_EUNSUPPORTED, "the model has no draft stages");
    if (!kv || !reqs || !sample || !out || !out->tokens || !out->confidence || !out->cumulative)
        return di_fail(err, DI_EINVAL, "draft: requests, sampler and outputs are required");
    if (memcmp(&kv->geom, &r->m->geom, sizeof(kv_geometry)) != 0)
        return di_fail(err, DI_EINVAL, "draft: the KV storage was made for another geometry");
    if (nextn == 0 || nextn > c->dspark_block_size)
        return di_fail(err, DI_EINVAL, "draft: nextn %u outside [1, %u]", nextn,
                       c->dspark_block_size);
    if (n_reqs == 0 || (uint64_t)n_reqs * c->dspark_block_size > r->max_rows)
        return di_fail(err, DI_EINVAL, "draft: %u requests of %u rows exceed max_rows %u",
                       n_reqs, c->dspark_block_size, r->max_rows);
    for (uint32_t i = 0; i < n_reqs; i++) {
        const fwd_draft_req *q = &reqs[i];
        if (q->slot >= kv->n_slots)
            return di_fail(err, DI_EINVAL, "draft request %u: slot %u outside the pool", i,
                           q->slot);
        if (q->pos < 0 || (uint64_t)q->pos + 1 + c->dspark_block_size > c->max_position_embeddings)
            return di_fail(err, DI_EINVAL, "draft request %u: position %lld outside the context",
                           i, (long long)q->pos);
        if (q->next < 0 || (uint32_t)q->next >= c->vocab_size)
            return di_fail(err, DI_EINVAL, "draft request %u: token %d outside the vocabulary",
                           i, q->next);
        for (uint32_t j = 0; j < i; j++)
            if (reqs[j].slot == q->slot)
                return di_fail(err, DI_EINVAL, "draft requests %u and %u share slot %u", j, i,
                               q->slot);
    }
    return DI_OK;
}

/* Rows [next, noise, ...] at positions P+1 .. P+B; each reads its ring up to P and every row
 * of its block (no causal mask inside the block). */
static void draft_rows(fwd_run *r, fwd_kv *kv, uint32_t n_reqs, const fwd_draft_req *reqs)
{
    const model_config *c = r->m->cfg;
    uint32_t B = c->dspark_block_size;
    fwd_rows *R = &r->rows;
    R->n = n_reqs * B;
    R->n_live = R->n;
    R->n_seqs = n_reqs;
    for (uint32_t i = 0; i < n_reqs; i++) {
        kern_seq *k = &R->seqs[i];
        memset(k, 0, sizeof(*k));
        k->row0 = i * B;
        k->n_rows = B;
        k->pos0 = reqs[i].pos + 1;
        k->slot = fwd_kv_slot(kv, reqs[i].slot);
        k->ring_hi = (int32_t)reqs[i].pos;
        R->keep[i] = 0;
        for (uint32_t j = 0; j < B; j++) {
            uint32_t t = i * B + j;
            R->pos[t] = reqs[i].pos + 1 + j;
            R->row_seq[t] = (int32_t)i;
            R->src[t] = (int32_t)t;
            r->ids[t] = j == 0 ? reqs[i].next : (int32_t)c->dspark_noise_token_id;
        }
    }
}

/* The stages on the block rows; leaves hc_pre(H, pre) (un-normed) in r->hfin [N, D]. */
static di_status draft_stages(fwd_run *r, fwd_kv *kv, di_error *err)
{
    fwd_model *m = r->m;
    const model_config *c = m->cfg;
    const kern_backend *be = m->be;
    uint32_t N = r->rows.n, hc = c->hc_mult;
    kern_embed e = {.n_rows = N, .dim = c->dim, .n_copies = hc, .vocab = c->vocab_size,
                    .ids = r->ids, .table = m->embed, .out = r->h};
    FWD_TRY(err, -1, be->ops.embed(be->ctx, &e)); /* H [N, hc, D] */
    di_status st;
    for (uint32_t s = 0; s < c->n_mtp; s++) {
        const fwd_layer_w *L = &m->layers[c->n_layers + s];
        int32_t id = (int32_t)L->id;
        const float *pre_in = s == 0 ? r->onehot : r->pre;
        if ((st = fwd_hc_site_in(r, N, &L->hc_attn, L->attn_norm, pre_in, s == 0 ? 0 : hc,
                                 r->a_pre, r->a_post, r->a_comb, id, err)) != DI_OK ||
            (st = fwd_attention(r, kv, L, state_draft_ring_offset(&m->geom, s), 0, NULL,
                                err)) != DI_OK ||
            (st = fwd_hc_expand(r, N, r->a_post, r->a_comb, id, err)) != DI_OK ||
            (st = fwd_hc_site_in(r, N, &L->hc_ffn, L->ffn_norm, r->a_pre, hc, r->f_pre,
                                 r->f_post, r->f_comb, id, err)) != DI_OK ||
            (st = fwd_moe(r, L, err)) != DI_OK ||
            (st = fwd_hc_expand(r, N, r->f_post, r->f_comb, id, err)) != DI_OK)
            return st;
        fwd_dump(r, "H", id, FWD_BF16, r->h, N, hc, c->dim);
        float *t = r->pre;
        r->pre = r->f_pre;
        r->f_pre = t;
    }
    kern_hc_collapse col = {.n_rows = N, .n_copies = hc, .dim = c->dim, .h = r->h, .pre = r->pre,
                            .pre_stride = hc, .out = r->hfin, .out_stride = c->dim};
    FWD_TRY(err, -1, be->ops.hc_collapse(be->ctx, &col)); /* x [N, D], not normed */
    return DI_OK;
}

/* Scratch of one proposal call (backend memory unless said). */
typedef struct draft_scratch {
    float *logits;           /* [N, V] */
    uint16_t *e;             /* [n_reqs, rank] Markov embeddings of the current inputs */
    uint16_t *cat;           /* [n_reqs * nextn, D + rank] confidence inputs */
    float *conf;             /* [n_reqs * nextn] confidence logits */
    float *host_row;         /* [V] host */
    int32_t *cur;            /* [n_reqs] host: out_i per request */
    int32_t *rows;           /* [n_reqs] host: gather indices */
} draft_scratch;

static void scratch_free(const kern_backend *be, draft_scratch *s)
{
    void *dev[] = {s->logits, s->e, s->cat, s->conf};
    for (size_t i = 0; i < sizeof(dev) / sizeof(dev[0]); i++)
        if (dev[i])
            be->ops.free(be->ctx, dev[i]);
    free(s->host_row);
    free(s->cur);
    free(s->rows);
}

static di_status scratch_alloc(const kern_backend *be, const model_config *c, uint32_t n_reqs,
                               uint32_t nextn, draft_scratch *s, di_error *err)
{
    size_t N = (size_t)n_reqs * c->dspark_block_size, V = c->vocab_size;
    size_t rank = c->dspark_markov_rank, D = c->dim;
    memset(s, 0, sizeof(*s));
    s->logits = be->ops.alloc(be->ctx, N * V * sizeof(float));
    s->e = be->ops.alloc(be->ctx, (size_t)n_reqs * rank * 2);
    s->cat = be->ops.alloc(be->ctx, (size_t)n_reqs * nextn * (D + rank) * 2);
    s->conf = be->ops.alloc(be->ctx, (size_t)n_reqs * nextn * sizeof(float));
    s->host_row = malloc(V * sizeof(float));
    s->cur = malloc(n_reqs * sizeof(int32_t));
    s->rows = malloc(n_reqs * sizeof(int32_t));
    if (!s->logits || !s->e || !s->cat || !s->conf || !s->host_row || !s->cur || !s->rows) {
        scratch_free(be, s);
        return di_fail(err, DI_ENOMEM, "draft scratch for %u requests", n_reqs);
    }
    return DI_OK;
}

/* Markov step i for every request: e_i = embed[out_i] (also kept for the confidence input),
 * logits_i += e_i @ head^T, out_{i+1} = sample(logits_i). */
static di_status markov_step(fwd_run *r, draft_scratch *s, uint32_t n_reqs, uint32_t i,
                             uint32_t nextn, fwd_draft_sample_fn sample, void *ud,
                             fwd_draft_out *out, di_error *err)
{
    const fwd_model *m = r->m;
    const model_config *c = m->cfg;
    const kern_backend *be = m->be;
    uint32_t B = c->dspark_block_size, V = c->vocab_size, rank = c->dspark_markov_rank;
    uint32_t D = c->dim, W = D + rank;
    kern_copy_rows ge = {.n_rows = n_reqs, .row_bytes = (size_t)rank * 2, .src = m->markov_embed,
                         .src_stride = (size_t)rank * 2, .rows = s->cur, .dst = s->e,
                         .dst_stride = (size_t)rank * 2};
    FWD_TRY(err, -1, be->ops.copy_rows(be->ctx, &ge)); /* e_i [n_reqs, rank] */
    kern_linear mh = {.m = n_reqs, .n = V, .k = rank, .groups = 1, .x = s->e, .x_stride = rank,
                      .w = m->markov_head, .out_f32 = 1, .accumulate = 1,
                      .y = s->logits + (size_t)i * V, .y_stride = (size_t)B * V};
    FWD_TRY(err, -1, be->ops.linear_bf16(be->ctx, &mh)); /* logits_i [n_reqs, V] */
    /* confidence input [x_i | e_i] of draft i */
    for (uint32_t q = 0; q < n_reqs; q++)
        s->rows[q] = (int32_t)(q * B + i);
    kern_copy_rows gx = {.n_rows = n_reqs, .row_bytes = (size_t)D * 2, .src = r->hfin,
                         .src_stride = (size_t)D * 2, .rows = s->rows,
                         .dst = s->cat + (size_t)i * W, .dst_stride = (size_t)nextn * W * 2};
    kern_copy_rows gc = {.n_rows = n_reqs, .row_bytes = (size_t)rank * 2, .src = s->e,
                         .src_stride = (size_t)rank * 2,
                         .dst = s->cat + (size_t)i * W + D, .dst_stride = (size_t)nextn * W * 2};
    FWD_TRY(err, -1, be->ops.copy_rows(be->ctx, &gx));
    FWD_TRY(err, -1, be->ops.copy_rows(be->ctx, &gc));
    for (uint32_t q = 0; q < n_reqs; q++) {
        const float *row = s->logits + ((size_t)q * B + i) * V;
        be->ops.to_host(be->ctx, s->host_row, row, (size_t)V * sizeof(float));
        if (out->logits)
            memcpy(out->logits + ((size_t)q * nextn + i) * V, s->host_row, (size_t)V * 4);
        int32_t tok = -1;
        di_status st = sample(ud, q, i, s->host_row, V, &tok);
        if (st != DI_OK)
            return di_fail(err, st, "draft request %u, draft %u: sampler failed", q, i);
        if (tok < 0 || (uint32_t)tok >= V)
            return di_fail(err, DI_EINTERNAL, "draft request %u: sampler returned token %d", q,
                           tok);
        out->tokens[(size_t)q * nextn + i] = tok;
        s->cur[q] = tok;
    }
    return DI_OK;
}

di_status fwd_draft(fwd_run *r, fwd_kv *kv, uint32_t n_reqs, const fwd_draft_req *reqs,
                    uint32_t nextn, fwd_draft_sample_fn sample, void *ud, fwd_draft_out *out,
                    di_error *err)
{
    if (!r)
        return di_fail(err, DI_EINVAL, "draft: run is NULL");
    di_status st = check_draft(r, kv, n_reqs, reqs, nextn, sample, out, err);
    if (st != DI_OK)
        return st;
    fwd_model *m = r->m;
    const model_config *c = m->cfg;
    const kern_backend *be = m->be;
    uint32_t N = n_reqs * c->dspark_block_size, D = c->dim, rank = c->dspark_markov_rank;
    draft_scratch s;
    if ((st = scratch_alloc(be, c, n_reqs, nextn, &s, err)) != DI_OK)
        return st;
    draft_rows(r, kv, n_reqs, reqs);
    if ((st = draft_stages(r, kv, err)) != DI_OK)
        goto done;
    /* head on the last stage's norm: logits [N, V] fp32 */
    kern_rmsnorm nrm = {.n_rows = N, .dim = D, .x = r->hfin, .x_stride = D,
                        .weight = m->draft_norm, .y = r->hsel, .y_stride = D,
                        .eps = (float)c->norm_eps};
    kern_linear head = {.m = N, .n = c->vocab_size, .k = D, .groups = 1, .x = r->hsel,
                        .x_stride = D, .w = m->head, .out_f32 = 1, .y = s.logits,
                        .y_stride = c->vocab_size};
    if ((st = be->ops.rmsnorm(be->ctx, &nrm)) != DI_OK ||
        (st = be->ops.head(be->ctx, &head)) != DI_OK) {
        st = fwd_op_fail(err, st, "draft head", -1);
        goto done;
    }
    for (uint32_t q = 0; q < n_reqs; q++)
        s.cur[q] = reqs[q].next;
    for (uint32_t i = 0; i < nextn && st == DI_OK; i++)
        st = markov_step(r, &s, n_reqs, i, nextn, sample, ud, out, err);
    if (st != DI_OK)
        goto done;
    /* confidence logits [n_reqs * nextn] = proj([x_i | e_i]) */
    kern_linear cp = {.m = n_reqs * nextn, .n = 1, .k = D + rank, .groups = 1, .x = s.cat,
                      .x_stride = D + rank, .w = m->conf_proj, .out_f32 = 1, .y = s.conf,
                      .y_stride = 1};
    if ((st = be->ops.linear_bf16(be->ctx, &cp)) != DI_OK) {
        st = fwd_op_fail(err, st, "draft confidence", -1);
        goto done;
    }
    be->ops.to_host(be->ctx, out->confidence, s.conf, (size_t)n_reqs * nextn * sizeof(float));
    for (uint32_t q = 0; q < n_reqs; q++) {
        float run = 1.0f;
        for (uint32_t i = 0; i < nextn; i++) {
            float *cf = &out->confidence[(size_t)q * nextn + i];
            *cf = 1.0f / (1.0f + expf(-*cf));
            /* keep it a probability strictly inside (0, 1) even for extreme logits */
            *cf = *cf < 1e-30f ? 1e-30f : (*cf > 0.99999994f ? 0.99999994f : *cf);
            run *= *cf;
            out->cumulative[(size_t)q * nextn + i] = run;
        }
    }
done:
    scratch_free(be, &s);
    return st;
}
