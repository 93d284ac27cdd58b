/* forward.c: model preparation, run scratch and the step: MODEL.md §1 as one loop over layers
 * built from the blocks of forward_blocks.c. */
#include "common/model/forward.h"

#include <assert.h>
#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/model/forward_internal.h"
#include "common/util/machine.h"
#include "kernels/cpu/numfmt.h"

/* ---- shared helpers ------------------------------------------------------------------------ */

di_status fwd_op_fail(di_error *err, di_status st, const char *what, int32_t layer)
{
    if (layer >= 0)
        return di_fail(err, st, "layer %d: %s failed (%s)", layer, what, di_status_str(st));
    return di_fail(err, st, "%s failed (%s)", what, di_status_str(st));
}

static size_t dtype_bytes(fwd_dtype dt)
{
    static const size_t sz[] = {2, 4, 4, 8, 1};
    return sz[dt];
}

void fwd_dump(const fwd_run *r, const char *name, int32_t layer, fwd_dtype dt, const void *data,
              uint64_t d0, uint64_t d1, uint64_t d2)
{
    const fwd_model *m = r->m;
    if (!m->opt.dump)
        return;
    size_t bytes = (size_t)(d0 * (d1 ? d1 : 1) * (d2 ? d2 : 1)) * dtype_bytes(dt);
    void *host = malloc(bytes ? bytes : 1);
    if (!host)
        return; /* a debug hook: dropping a dump is harmless */
    m->be->ops.to_host(m->be->ctx, host, data, bytes);
    fwd_tensor t = {.name = name, .layer = layer, .dtype = dt, .ndim = d2 ? 3 : (d1 ? 2 : 1),
                    .dims = {d0, d1, d2}, .data = host};
    m->opt.dump(m->opt.dump_userdata, &t);
    free(host);
}

/* ---- model: weight views ------------------------------------------------------------------- */

static void *own(fwd_model *m, size_t bytes)
{
    if (m->n_owned == m->cap_owned) {
        uint32_t cap = m->cap_owned ? 2 * m->cap_owned : 64;
        void **n = realloc(m->owned, cap * sizeof(void *));
        if (!n)
            return NULL;
        m->owned = n;
        m->cap_owned = cap;
    }
    void *p = NULL;
    if (posix_memalign(&p, 64, bytes ? bytes : 64) != 0)
        return NULL;
    m->owned[m->n_owned++] = p;
    return p;
}

/* Collects the first failure while resolving weights; later calls are no-ops. */
typedef struct resolver {
    fwd_model *m;
    di_error *err;
    di_status st;
} resolver;

static int require(resolver *rs, const model_tensor *t, model_wfmt fmt, const char *what)
{
    if (rs->st != DI_OK)
        return 0;
    if (t->fmt == fmt)
        return 1;
    rs->st = di_fail(rs->err, DI_EINVAL, "%s: weight %s %s", what, t->name ? t->name : "",
                     t->fmt == MODEL_WFMT_NONE ? "is missing" : "has an unexpected format");
    return 0;
}

#define DEV_CHUNK_BYTES ((size_t)64 << 20)
#define DEV_ALIGN 256

/* Where the ops read a weight: the host view itself, or for a device backend
 * (kern_backend.device_memory) a copy in backend memory, cut from chunks of DEV_CHUNK_BYTES
 * (a larger tensor gets a chunk of its own) at DEV_ALIGN-byte offsets. NULL after a failure. */
static const void *place(resolver *rs, const void *host, size_t bytes, const char *what)
{
    fwd_model *m = rs->m;
    const kern_backend *be = m->be;
    if (!be->device_memory)
        return host;
    if (rs->st != DI_OK || !host)
        return NULL;
    size_t at = (m->dev_used + DEV_ALIGN - 1) / DEV_ALIGN * DEV_ALIGN;
    if (m->n_dev_chunks == 0 || at + bytes > m->dev_cap) {
        if (m->n_dev_chunks == m->cap_dev_chunks) {
            uint32_t cap = m->cap_dev_chunks ? 2 * m->cap_dev_chunks : 16;
            void **n = realloc(m->dev_chunks, cap * sizeof(void *));
            if (!n) {
                rs->st = di_fail(rs->err, DI_ENOMEM, "%s: weight chunk table", what);
                return NULL;
            }
            m->dev_chunks = n;
            m->cap_dev_chunks = cap;
        }
        size_t cap = bytes > DEV_CHUNK_BYTES ? bytes : DEV_CHUNK_BYTES;
        void *chunk = be->ops.alloc(be->ctx, cap);
        if (!chunk) {
            rs->st = di_fail(rs->err, DI_ENOMEM, "%s: %zu bytes of backend memory for weights",
                             what, cap);
            return NULL;
        }
        m->dev_chunks[m->n_dev_chunks++] = chunk;
        m->dev_cap = cap;
        at = 0;
    }
    uint8_t *dst = (uint8_t *)m->dev_chunks[m->n_dev_chunks - 1] + at;
    be->ops.from_host(be->ctx, dst, host, bytes);
    m->dev_used = at + bytes;
    return dst;
}

/* A naturally aligned view of a BF16 or F32 tensor (a copy when the mapping is not), placed. */
static const void *aligned(resolver *rs, const model_tensor *t, model_wfmt fmt, const char *what)
{
    if (!require(rs, t, fmt, what))
        return NULL;
    size_t esz = fmt == MODEL_WFMT_F32 ? 4 : 2;
    size_t bytes = (size_t)(t->rows * t->cols) * esz;
    if ((uintptr_t)t->data % esz == 0 || rs->m->be->device_memory)
        return place(rs, t->data, bytes, what);
    void *p = own(rs->m, bytes);
    if (!p) {
        rs->st = di_fail(rs->err, DI_ENOMEM, "%s: aligned copy of %s", what, t->name);
        return NULL;
    }
    memcpy(p, t->data, bytes);
    return p;
}

/* A quantised tensor's data and scale, placed. */
static const uint8_t *quantised(resolver *rs, const model_tensor *t, const uint8_t **scale,
                                const char *what)
{
    *scale = place(rs, t->scale, model_tensor_scale_bytes(t), what);
    return place(rs, t->data, model_tensor_data_bytes(t), what);
}

static const uint16_t *bf16w(resolver *rs, const model_tensor *t, const char *what)
{
    return aligned(rs, t, MODEL_WFMT_BF16, what);
}

static const float *f32w(resolver *rs, const model_tensor *t, const char *what)
{
    return aligned(rs, t, MODEL_WFMT_F32, what);
}

static const uint8_t *fp8w(resolver *rs, const model_tensor *t, const uint8_t **scale,
                           const char *what)
{
    if (!require(rs, t, MODEL_WFMT_FP8_32X32, what))
        return NULL;
    return quantised(rs, t, scale, what);
}

/* wo_a as BF16: as stored, or the FP8 x UE8M0 values, which are exact in BF16. */
static const uint16_t *wo_a_bf16(resolver *rs, const model_tensor *t, const char *what)
{
    if (rs->st == DI_OK && t->fmt == MODEL_WFMT_BF16)
        return bf16w(rs, t, what);
    if (!require(rs, t, MODEL_WFMT_FP8_32X32, what))
        return NULL;
    /* a device backend keeps only its placed copy: the host one is temporary there */
    int temp = rs->m->be->device_memory;
    size_t bytes = (size_t)(t->rows * t->cols) * 2;
    uint16_t *out = temp ? malloc(bytes ? bytes : 2) : own(rs->m, bytes);
    if (!out) {
        rs->st = di_fail(rs->err, DI_ENOMEM, "%s: BF16 copy of %s", what, t->name);
        return NULL;
    }
    const uint8_t *q = t->data;
    for (uint64_t r = 0; r < t->rows; r++)
        for (uint64_t c = 0; c < t->cols; c++) {
            float s = di_ue8m0_decode(t->scale[(r / 32) * t->scale_cols + c / 32]);
            out[r * t->cols + c] = di_f32_to_bf16(di_e4m3_decode(q[r * t->cols + c]) * s);
        }
    const uint16_t *placed = place(rs, out, bytes, what);
    if (temp)
        free(out);
    return placed;
}

static void expert_view(resolver *rs, const model_expert_weights *e, model_wfmt fmt,
                        kern_expert *out, const char *what)
{
    if (!require(rs, &e->w1, fmt, what) || !require(rs, &e->w2, fmt, what) ||
        !require(rs, &e->w3, fmt, what))
        return;
    out->w1 = quantised(rs, &e->w1, &out->w1_scale, what);
    out->w2 = quantised(rs, &e->w2, &out->w2_scale, what);
    out->w3 = quantised(rs, &e->w3, &out->w3_scale, what);
}

static void site_view(resolver *rs, const model_hc_weights *h, fwd_site_w *out, const char *what)
{
    out->fn = f32w(rs, &h->fn, what);
    out->base = f32w(rs, &h->base, what);
    out->scale = f32w(rs, &h->scale, what);
}

static void layer_view(resolver *rs, const model_layer_weights *src, uint32_t id,
                       fwd_layer_w *L)
{
    fwd_model *m = rs->m;
    const model_config *c = m->cfg;
    char what[48];
    if (id < c->n_layers)
        snprintf(what, sizeof what, "layer %u", id);
    else
        snprintf(what, sizeof what, "draft stage %u", id - c->n_layers);
    L->id = id;
    L->role = &c->roles[id];
    L->engram_slot = -1;
    L->attn_norm = bf16w(rs, &src->attn_norm, what);
    L->ffn_norm = bf16w(rs, &src->ffn_norm, what);
    site_view(rs, &src->hc_attn, &L->hc_attn, what);
    site_view(rs, &src->hc_ffn, &L->hc_ffn, what);
    const model_attn_weights *a = &src->attn;
    L->wq_a = fp8w(rs, &a->wq_a, &L->wq_a_s, what);
    L->q_norm = bf16w(rs, &a->q_norm, what);
    L->wq_b = fp8w(rs, &a->wq_b, &L->wq_b_s, what);
    L->wkv = fp8w(rs, &a->wkv, &L->wkv_s, what);
    L->kv_norm = bf16w(rs, &a->kv_norm, what);
    L->wo_a = wo_a_bf16(rs, &a->wo_a, what);
    L->wo_b = fp8w(rs, &a->wo_b, &L->wo_b_s, what);
    L->sink = f32w(rs, &a->attn_sink, what);
    if (L->role->owns_compressor) {
        L->c_wkv = bf16w(rs, &src->compressor.wkv, what);
        if (L->role->ratio > 1)
            L->c_wgate = bf16w(rs, &src->compressor.wgate, what);
        L->c_norm = bf16w(rs, &src->compressor.norm, what);
    }
    if (L->role->owns_indexer) {
        L->i_wq_b = fp8w(rs, &src->indexer.wq_b, &L->i_wq_b_s, what);
        L->i_wproj = bf16w(rs, &src->indexer.weights_proj, what);
    }
    if (L->role->owns_index_keys) {
        L->i_wk = bf16w(rs, &src->indexer.wk, what);
        L->i_knorm = bf16w(rs, &src->indexer.k_norm, what);
    }
    const model_ffn_weights *f = &src->ffn;
    L->n_experts = f->n_experts;
    L->top_k = id < c->n_layers ? c->n_activated_experts : c->dspark_n_activated_experts;
    L->gate = bf16w(rs, &f->gate, what);
    L->gate_bias = f->gate_bias.fmt == MODEL_WFMT_NONE ? NULL : f32w(rs, &f->gate_bias, what);
    if (rs->st == DI_OK && (L->top_k == 0 || L->top_k > L->n_experts || !f->experts))
        rs->st = di_fail(rs->err, DI_EINVAL, "%s: %u experts cannot route top-%u", what,
                         L->n_experts, L->top_k);
    /* expert parallelism: the hook's ranks hold the routed experts of the backbone layers (the
     * checkpoint may have only this rank's: no table here, nothing placed on the device) */
    bool hooked = m->opt.moe_fn && id < c->n_layers;
    if (rs->st == DI_OK && !hooked) {
        L->experts = own(m, (size_t)L->n_experts * sizeof(kern_expert));
        if (!L->experts)
            rs->st = di_fail(rs->err, DI_ENOMEM, "%s: expert table", what);
    }
    for (uint32_t e = 0; rs->st == DI_OK && !hooked && e < L->n_experts; e++)
        expert_view(rs, &f->experts[e], MODEL_WFMT_FP4_1X32, &L->experts[e], what);
    if (c->n_shared_experts)
        expert_view(rs, &f->shared, MODEL_WFMT_FP8_32X32, &L->shared, what);
    if (id < c->n_layers && L->role->engram >= 0 && rs->st == DI_OK) {
        const model_engram_weights *e = src->engram;
        if (!e) {
            rs->st = di_fail(rs->err, DI_EINVAL, "%s: Engram module missing", what);
            return;
        }
        L->engram_slot = L->role->engram;
        L->engram = e;
        L->e_wkv = fp8w(rs, &e->wkv, &L->e_wkv_s, what);
        L->e_q = bf16w(rs, &e->q_weight, what);
        L->e_k = bf16w(rs, &e->k_weight, what);
        if (rs->st == DI_OK && !e->seeded && e->table.fmt != MODEL_WFMT_FP8_1X32)
            rs->st = di_fail(rs->err, DI_EINVAL, "%s: Engram table missing", what);
        if (!e->seeded)
            L->e_table = quantised(rs, &e->table, &L->e_table_s, what);
    }
}

static void model_views(resolver *rs)
{
    fwd_model *m = rs->m;
    const model_weights *w = m->w;
    const model_config *c = m->cfg;
    m->embed = bf16w(rs, &w->embed, "model");
    m->head = bf16w(rs, &w->head, "model");
    m->norm = bf16w(rs, &w->norm, "model");
    for (uint32_t l = 0; l < c->n_layers; l++)
        layer_view(rs, &w->layers[l], l, &m->layers[l]);
    for (uint32_t s = 0; s < c->n_mtp; s++)
        layer_view(rs, &w->drafts[s].block, c->n_layers + s, &m->layers[c->n_layers + s]);
    if (c->n_mtp == 0)
        return;
    const model_draft_weights *d0 = &w->drafts[0], *dl = &w->drafts[c->n_mtp - 1];
    m->main_proj = fp8w(rs, &d0->main_proj, &m->main_proj_s, "draft stage 0");
    m->main_norm = bf16w(rs, &d0->main_norm, "draft stage 0");
    m->draft_norm = bf16w(rs, &dl->norm, "last draft stage");
    m->markov_embed = bf16w(rs, &dl->markov_embed, "last draft stage");
    m->markov_head = bf16w(rs, &dl->markov_head, "last draft stage");
    m->conf_proj = bf16w(rs, &dl->confidence_proj, "last draft stage");
}

/* ---- model: options, Engram constants ------------------------------------------------------ */

static di_status check_options(const model_config *c, const fwd_options *o, di_error *err)
{
    if (o->max_rows == 0 || o->max_rows > (1u << 24))
        return di_fail(err, DI_EINVAL, "max_rows %u outside [1, 16777216]", o->max_rows);
    if (c->n_mtp && o->nextn > c->dspark_block_size)
        return di_fail(err, DI_EINVAL, "nextn %u exceeds the draft block size %u", o->nextn,
                       c->dspark_block_size);
    if (o->nextn > 64)
        return di_fail(err, DI_EINVAL, "nextn %u exceeds 64", o->nextn);
    if (o->yoco > FWD_YOCO_MASK)
        return di_fail(err, DI_EINVAL, "unknown YOCO truncation mode %d", (int)o->yoco);
    uint32_t ring = kv_ring_positions_for(c->window, o->nextn, 0);
    if (o->yoco != FWD_YOCO_OFF && o->keep_tokens < ring)
        return di_fail(err, DI_EINVAL,
                       "YOCO keep_tokens %u is below the ring size %u (window %u + nextn %u + "
                       "1): after a rollback the window must still be there",
                       o->keep_tokens, ring, c->window, o->nextn);
    return DI_OK;
}

static di_status engram_setup(fwd_model *m, const int32_t *map, int32_t pad_token, di_error *err)
{
    const model_config *c = m->cfg;
    uint32_t ne = c->n_engram_layers, cols = c->engram_cols, N = c->engram_max_ngram_size;
    if (ne == 0)
        return DI_OK;
    m->tmap = malloc((size_t)c->vocab_size * sizeof(int32_t));
    m->e_mult = malloc((size_t)ne * N * sizeof(uint64_t));
    m->e_primes = malloc((size_t)ne * cols * sizeof(uint64_t));
    m->e_offsets = malloc((size_t)ne * cols * sizeof(uint64_t));
    if (!m->tmap || !m->e_mult || !m->e_primes || !m->e_offsets)
        return di_fail(err, DI_ENOMEM, "Engram tables");
    for (uint32_t t = 0; t < c->vocab_size; t++) {
        int32_t v = map ? map[t] : (int32_t)(t % c->engram_compressed_vocab_size);
        if (v < 0 || (uint32_t)v >= c->engram_compressed_vocab_size)
            return di_fail(err, DI_EINVAL, "Engram token map: token %u maps to %d, outside "
                           "[0, %u)", t, v, c->engram_compressed_vocab_size);
        m->tmap[t] = v;
    }
    int64_t pad = pad_token >= 0 ? pad_token : (int64_t)c->engram_pad_id;
    if (pad >= c->vocab_size)
        return di_fail(err, DI_EINVAL, "Engram pad token %lld outside the vocabulary",
                       (long long)pad);
    m->engram_pad = m->tmap[pad];
    for (uint32_t e = 0; e < ne; e++) {
        memcpy(m->e_mult + (size_t)e * N, c->engram_multipliers[e], N * sizeof(uint64_t));
        memcpy(m->e_primes + (size_t)e * cols, c->engram_primes[e], cols * sizeof(uint64_t));
        memcpy(m->e_offsets + (size_t)e * cols, c->engram_offsets[e], cols * sizeof(uint64_t));
    }
    return DI_OK;
}

di_status fwd_model_create(const model_weights *w, const kern_backend *be,
                           const fwd_options *opt, fwd_model **out, di_error *err)
{
    if (!w || !be || !opt || !out)
        return di_fail(err, DI_EINVAL, "forward model: weights, backend, options and output "
                       "are required");
    di_status st = check_options(&w->config, opt, err);
    if (st != DI_OK)
        return st;
    fwd_model *m = calloc(1, sizeof(*m));
    if (!m)
        return di_fail(err, DI_ENOMEM, "forward model");
    m->w = w;
    m->cfg = &w->config;
    m->be = be;
    m->opt = *opt;
    m->opt.token_map = NULL;
    model_config_kv_geometry_yoco(m->cfg, opt->nextn, (uint32_t)opt->yoco, &m->geom);
    m->index_w_scale = pow((double)m->cfg->index_head_dim, -0.5) *
                       pow((double)m->cfg->index_n_heads, -0.5);
    m->layers = calloc(m->cfg->n_layers + m->cfg->n_mtp, sizeof(fwd_layer_w));
    if (!m->layers)
        st = di_fail(err, DI_ENOMEM, "forward model layers");
    if (st == DI_OK)
        st = kv_geometry_validate(&m->geom, err);
    if (st == DI_OK)
        st = engram_setup(m, opt->token_map, opt->token_map_pad, err);
    if (st == DI_OK) {
        resolver rs = {m, err, DI_OK};
        model_views(&rs);
        st = rs.st;
    }
    if (st != DI_OK) {
        fwd_model_free(m);
        return st;
    }
    *out = m;
    return DI_OK;
}

void fwd_model_free(fwd_model *m)
{
    if (!m)
        return;
    for (uint32_t i = 0; i < m->n_owned; i++)
        free(m->owned[i]);
    free(m->owned);
    for (uint32_t i = 0; i < m->n_dev_chunks; i++)
        m->be->ops.free(m->be->ctx, m->dev_chunks[i]);
    free(m->dev_chunks);
    free(m->layers);
    free(m->tmap);
    free(m->e_mult);
    free(m->e_primes);
    free(m->e_offsets);
    free(m);
}

const kv_geometry *fwd_model_geometry(const fwd_model *m)
{
    return &m->geom;
}

const model_config *fwd_model_config(const fwd_model *m)
{
    return m->cfg;
}

/* ---- run scratch --------------------------------------------------------------------------- */

/* One scratch buffer: where it goes and how many bytes per row (0 = fixed `fixed` bytes). */
typedef struct buf_row {
    size_t off;                 /* offsetof(fwd_run, field) */
    size_t per_row;             /* bytes per row */
    size_t fixed;               /* bytes independent of the row count */
} buf_row;

#define RB(field, bytes) {offsetof(fwd_run, field), (bytes), 0}
#define FB(field, bytes) {offsetof(fwd_run, field), 0, (bytes)}

di_status fwd_run_create(fwd_model *m, fwd_run **out, di_error *err)
{
    if (!m || !out)
        return di_fail(err, DI_EINVAL, "run: model and output are required");
    const model_config *c = m->cfg;
    size_t D = c->dim, hc = c->hc_mult, hd = c->head_dim, H = c->n_heads;
    size_t ih = c->index_n_heads, id = c->index_head_dim;
    size_t E = c->n_routed_experts > c->dspark_n_routed_experts ? c->n_routed_experts
                                                                 : c->dspark_n_routed_experts;
    size_t K = c->n_activated_experts > c->dspark_n_activated_experts
                   ? c->n_activated_experts : c->dspark_n_activated_experts;
    size_t ne = c->n_engram_layers, cols = c->engram_cols, ew = c->engram_head_dim;
    size_t taps = c->n_dspark_targets ? c->n_dspark_targets : 1;
    const buf_row rows[] = {
        RB(h, hc * D * 2), RB(h2, hc * D * 2), RB(pre, hc * 4), RB(a_pre, hc * 4),
        RB(a_post, hc * 4), RB(a_comb, hc * hc * 4), RB(f_pre, hc * 4), RB(f_post, hc * 4),
        RB(f_comb, hc * hc * 4), FB(onehot, hc * 4), FB(mean_pre, hc * 4), RB(x, D * 2),
        RB(y, D * 2), RB(qr, c->q_lora_rank * 2), RB(q, H * hd * 2), RB(kv, hd * 2),
        RB(local, kv_ring_entry_bytes(&m->geom)), RB(o, H * hd * 2),
        RB(z, (size_t)c->o_groups * c->o_lora_rank * 2), RB(ca, hd * 4), RB(cg, hd * 4),
        RB(latent, hd * 2), RB(cmain, hd * 2), RB(ckey, id * 2), RB(iq, ih * id * 2),
        RB(iw, ih * 2), RB(topk, (size_t)c->index_topk * 4), RB(glog, E * 4), RB(eids, K * 4),
        RB(ew, K * 4), RB(hash, (ne ? ne * cols : 1) * 8), RB(erows, (ne ? cols * ew : 1) * 2),
        RB(ekv, (ne ? (hc + 1) * D : 1) * 2), RB(taps, taps * D * 2), RB(mx, D * 2),
        RB(hfin, D * 2), RB(hsel, D * 2),
    };
    size_t T = m->opt.max_rows;
    if (!m->be->device_memory) {
        /* Host scratch past physical memory would be killed mid-run: refuse it here. */
        uint64_t total = 0;
        for (size_t i = 0; i < sizeof(rows) / sizeof(rows[0]); i++)
            total += rows[i].fixed + (uint64_t)rows[i].per_row * T;
        char what[64];
        snprintf(what, sizeof(what), "scratch of steps of %zu rows:", T);
        di_status st = di_machine_check_memory(what, total, err);
        if (st != DI_OK)
            return st;
    }
    fwd_run *r = calloc(1, sizeof(*r));
    if (!r)
        return di_fail(err, DI_ENOMEM, "run scratch");
    r->m = m;
    r->max_rows = m->opt.max_rows;
    di_status st = DI_OK;
    for (size_t i = 0; i < sizeof(rows) / sizeof(rows[0]) && st == DI_OK; i++) {
        size_t bytes = rows[i].fixed + rows[i].per_row * T;
        void *p = m->be->ops.alloc(m->be->ctx, bytes);
        if (!p)
            st = di_fail(err, DI_ENOMEM, "run scratch: %zu bytes", bytes);
        memcpy((char *)r + rows[i].off, &p, sizeof(p));
    }
    fwd_rows *rr[2] = {&r->rows, &r->rows2};
    for (int k = 0; k < 2 && st == DI_OK; k++) {
        rr[k]->pos = malloc(T * sizeof(int64_t));
        rr[k]->row_seq = malloc(T * sizeof(int32_t));
        rr[k]->src = malloc(T * sizeof(int32_t));
        rr[k]->seqs = malloc(T * sizeof(kern_seq));
        rr[k]->keep = malloc(T * sizeof(int64_t));
        if (!rr[k]->pos || !rr[k]->row_seq || !rr[k]->src || !rr[k]->seqs || !rr[k]->keep)
            st = di_fail(err, DI_ENOMEM, "run metadata");
    }
    r->nvis = malloc(T * sizeof(int32_t));
    r->emit_row = malloc(T * sizeof(int32_t));
    r->emit_id = malloc(T * sizeof(int64_t));
    r->emit_pos = malloc(T * sizeof(int64_t));
    r->emit_seq = malloc(T * sizeof(int32_t));
    r->ids = malloc(T * sizeof(int32_t));
    r->sel = malloc(T * sizeof(int32_t));
    if (st == DI_OK && (!r->nvis || !r->emit_row || !r->emit_id || !r->emit_pos ||
                        !r->emit_seq || !r->ids || !r->sel))
        st = di_fail(err, DI_ENOMEM, "run metadata");
    if (st != DI_OK) {
        fwd_run_free(r);
        return st;
    }
    float one[16] = {0}, mean[16];
    one[0] = 1.0f;
    for (size_t i = 0; i < hc; i++)
        mean[i] = 1.0f / (float)hc;
    m->be->ops.from_host(m->be->ctx, r->onehot, one, hc * 4);
    m->be->ops.from_host(m->be->ctx, r->mean_pre, mean, hc * 4);
    *out = r;
    return DI_OK;
}

void fwd_run_free(fwd_run *r)
{
    if (!r)
        return;
    const kern_backend *be = r->m->be;
    void *bufs[] = {r->h, r->h2, r->pre, r->a_pre, r->a_post, r->a_comb, r->f_pre, r->f_post,
                    r->f_comb, r->onehot, r->mean_pre, r->x, r->y, r->qr, r->q, r->kv,
                    r->local, r->o, r->z, r->ca, r->cg, r->latent, r->cmain, r->ckey, r->iq,
                    r->iw, r->scores, r->cand, r->topk, r->glog, r->eids, r->ew, r->hash,
                    r->erows, r->ekv, r->taps, r->mx, r->hfin, r->hsel, r->logits};
    for (size_t i = 0; i < sizeof(bufs) / sizeof(bufs[0]); i++)
        if (bufs[i])
            be->ops.free(be->ctx, bufs[i]);
    fwd_rows *rr[2] = {&r->rows, &r->rows2};
    for (int k = 0; k < 2; k++) {
        free(rr[k]->pos);
        free(rr[k]->row_seq);
        free(rr[k]->src);
        free(rr[k]->seqs);
        free(rr[k]->keep);
    }
    free(r->nvis);
    free(r->emit_row);
    free(r->emit_id);
    free(r->emit_pos);
    free(r->emit_seq);
    free(r->ids);
    free(r->sel);
    free(r);
}

/* ---- step: validation and metadata --------------------------------------------------------- */

static di_status check_seq(const fwd_model *m, const fwd_kv *kv, const fwd_seq *s, uint32_t i,
                           di_error *err)
{
    const model_config *c = m->cfg;
    if (s->n_rows == 0 || !s->tokens)
        return di_fail(err, DI_EINVAL, "sequence %u: no rows", i);
    if (s->pos0 < 0 || (uint64_t)s->pos0 + s->n_rows > c->max_position_embeddings)
        return di_fail(err, DI_EINVAL, "sequence %u: positions %lld..%lld outside the context "
                       "limit %llu", i, (long long)s->pos0, (long long)s->pos0 + s->n_rows - 1,
                       (unsigned long long)c->max_position_embeddings);
    for (uint32_t t = 0; t < s->n_rows; t++)
        if (s->tokens[t] < 0 || (uint32_t)s->tokens[t] >= c->vocab_size)
            return di_fail(err, DI_EINVAL, "sequence %u: token id %d at position %lld outside "
                           "the vocabulary [0, %u)", i, s->tokens[t], (long long)s->pos0 + t,
                           c->vocab_size);
    uint64_t need = kv_blocks_for_tokens(&m->geom, (uint64_t)s->pos0 + s->n_rows);
    if (!s->blocks || s->n_blocks < need)
        return di_fail(err, DI_EINVAL, "sequence %u: block table has %u blocks, positions up "
                       "to %lld need %llu", i, s->n_blocks,
                       (long long)s->pos0 + s->n_rows - 1, (unsigned long long)need);
    for (uint32_t b = 0; b < need; b++)
        if (s->blocks[b] >= kv->n_blocks)
            return di_fail(err, DI_EINVAL, "sequence %u: block id %u outside the pool of %u",
                           i, s->blocks[b], kv->n_blocks);
    if (s->slot >= kv->n_slots)
        return di_fail(err, DI_EINVAL, "sequence %u: state slot %u outside the pool of %u", i,
                       s->slot, kv->n_slots);
    if (c->n_engram_layers) {
        uint32_t want = s->pos0 < (int64_t)c->engram_max_ngram_size - 1
                            ? (uint32_t)s->pos0 : c->engram_max_ngram_size - 1;
        if (s->n_history != want || (want && !s->history))
            return di_fail(err, DI_EINVAL, "sequence %u: %u history tokens, the Engram lookback "
                           "at position %lld needs %u", i, s->n_history, (long long)s->pos0,
                           want);
        for (uint32_t h = 0; h < want; h++)
            if (s->history[h] < 0 || (uint32_t)s->history[h] >= c->vocab_size)
                return di_fail(err, DI_EINVAL, "sequence %u: history token %d outside the "
                               "vocabulary", i, s->history[h]);
    }
    if (s->window_start < 0 || s->window_start > s->pos0 + s->n_rows)
        return di_fail(err, DI_EINVAL, "sequence %u: window start %lld outside [0, %lld]", i,
                       (long long)s->window_start, (long long)s->pos0 + s->n_rows);
    if (s->prompt_len < 0 || (s->prompt_len > 0 && s->pos0 + s->n_rows > s->prompt_len))
        return di_fail(err, DI_EINVAL, "sequence %u: prompt rows up to position %lld beyond "
                       "the prompt length %lld", i, (long long)s->pos0 + s->n_rows - 1,
                       (long long)s->prompt_len);
    return DI_OK;
}

/* Row index in the submitted step of a row kept by YOCO compact truncation: its first row at
 * or after the keep window of its prompt. */
static int64_t keep_start(const fwd_model *m, const fwd_seq *s)
{
    if (m->opt.yoco == FWD_YOCO_OFF || s->prompt_len <= 0)
        return 0;
    int64_t k = s->prompt_len - (int64_t)m->opt.keep_tokens;
    return k > 0 ? k : 0;
}

static di_status check_step(const fwd_run *r, const fwd_kv *kv, const fwd_step *st,
                            uint32_t *n_rows, di_error *err)
{
    const fwd_model *m = r->m;
    if (!st || !kv || st->n_seqs == 0 || !st->seqs)
        return di_fail(err, DI_EINVAL, "step: no sequences");
    if (memcmp(&kv->geom, &m->geom, sizeof(kv_geometry)) != 0)
        return di_fail(err, DI_EINVAL, "step: the KV storage was made for another geometry");
    uint64_t T = 0, live = 0;
    for (uint32_t i = 0; i < st->n_seqs; i++) {
        if (st->seqs[i].placeholder) { /* only its row count is read */
            if (st->seqs[i].n_rows == 0)
                return di_fail(err, DI_EINVAL, "sequence %u: no placeholder rows", i);
            T += st->seqs[i].n_rows;
            continue;
        }
        if (T > live)
            return di_fail(err, DI_EINVAL, "sequence %u follows placeholder rows", i);
        di_status s = check_seq(m, kv, &st->seqs[i], i, err);
        if (s != DI_OK)
            return s;
        for (uint32_t j = 0; j < i; j++)
            if (st->seqs[j].slot == st->seqs[i].slot)
                return di_fail(err, DI_EINVAL, "sequences %u and %u share state slot %u", j, i,
                               st->seqs[i].slot);
        T += st->seqs[i].n_rows;
        live = T;
    }
    if (T > r->max_rows)
        return di_fail(err, DI_EINVAL, "step of %llu rows exceeds max_rows %u",
                       (unsigned long long)T, r->max_rows);
    if (st->n_logit_rows && !st->logit_rows)
        return di_fail(err, DI_EINVAL, "step: logit rows missing");
    for (uint32_t i = 0; i < st->n_logit_rows; i++) {
        int32_t lr = st->logit_rows[i];
        if (lr < 0 || (uint64_t)lr >= T)
            return di_fail(err, DI_EINVAL, "logit row %d outside the step's %llu rows", lr,
                           (unsigned long long)T);
        if ((uint64_t)lr >= live)
            return di_fail(err, DI_EINVAL, "logit row %d is a placeholder row", lr);
        for (uint32_t j = 0; j < i; j++)
            if (st->logit_rows[j] == lr)
                return di_fail(err, DI_EINVAL, "logit row %d requested twice", lr);
        if (m->opt.yoco == FWD_YOCO_COMPACT) {
            uint32_t base = 0, s = 0;
            while ((uint32_t)lr >= base + st->seqs[s].n_rows)
                base += st->seqs[s++].n_rows;
            int64_t pos = st->seqs[s].pos0 + (lr - (int32_t)base);
            if (pos < keep_start(m, &st->seqs[s]))
                return di_fail(err, DI_EUNSUPPORTED, "logits of prompt position %lld are "
                               "unavailable: YOCO compact truncation skips it in layers >= %u "
                               "(prompt logprobs need truncation off or mask)",
                               (long long)pos, m->cfg->yoco_boundary);
        }
    }
    *n_rows = (uint32_t)T;
    return DI_OK;
}

static void build_rows(fwd_run *r, fwd_kv *kv, const fwd_step *st)
{
    fwd_rows *R = &r->rows;
    uint32_t t = 0;
    R->n_seqs = st->n_seqs;
    R->n_live = 0;
    for (uint32_t i = 0; i < st->n_seqs; i++) {
        const fwd_seq *s = &st->seqs[i];
        kern_seq *k = &R->seqs[i];
        if (s->placeholder) { /* an empty sequence without slot or blocks: nothing to write */
            *k = (kern_seq){.row0 = t, .n_rows = s->n_rows, .ring_hi = -1};
            R->keep[i] = 0;
            for (uint32_t j = 0; j < s->n_rows; j++, t++) {
                R->pos[t] = j;
                R->row_seq[t] = (int32_t)i;
                R->src[t] = (int32_t)t;
                r->ids[t] = 0;
            }
            continue;
        }
        k->row0 = t;
        k->n_rows = s->n_rows;
        k->pos0 = s->pos0;
        k->slot = fwd_kv_slot(kv, s->slot);
        k->blocks = s->blocks;
        k->n_blocks = s->n_blocks;
        k->window_lo = s->window_start;
        k->ring_hi = -1;
        k->history = s->history;
        k->n_history = s->n_history;
        R->keep[i] = keep_start(r->m, s);
        for (uint32_t j = 0; j < s->n_rows; j++, t++) {
            R->pos[t] = s->pos0 + j;
            R->row_seq[t] = (int32_t)i;
            R->src[t] = (int32_t)t;
            r->ids[t] = s->tokens[j];
        }
        R->n_live = t;
    }
    R->n = t;
}

/* ---- YOCO ---------------------------------------------------------------------------------- */

/* Layers >= the boundary: prompt rows never read window keys below their keep window. */
static void clip_windows(fwd_run *r)
{
    for (uint32_t i = 0; i < r->rows.n_seqs; i++)
        if (r->rows.keep[i] > r->rows.seqs[i].window_lo)
            r->rows.seqs[i].window_lo = r->rows.keep[i];
}

static di_status gather(fwd_run *r, void *buf, size_t row_bytes, const int32_t *keep, uint32_t n,
                        di_error *err)
{
    kern_copy_rows c = {.n_rows = n, .row_bytes = row_bytes, .src = buf, .src_stride = row_bytes,
                        .rows = keep, .dst = buf, .dst_stride = row_bytes};
    FWD_TRY(err, -1, r->m->be->ops.copy_rows(r->m->be->ctx, &c));
    return DI_OK;
}

/* Compact truncation at the boundary layer, after its compressor saw every row: keeps the rows
 * at or after each prompt's keep window, in order, and moves every per-row buffer that later
 * layers read. A chunk wholly before its keep window leaves the step. */
static di_status compact_rows(fwd_run *r, di_error *err)
{
    const model_config *c = r->m->cfg;
    fwd_rows *A = &r->rows, *B = &r->rows2;
    int32_t *keep = r->sel;
    uint32_t n = 0;
    B->n_seqs = 0;
    for (uint32_t i = 0; i < A->n_seqs; i++) {
        const kern_seq *k = &A->seqs[i];
        uint32_t first = n;
        for (uint32_t j = 0; j < k->n_rows; j++) {
            uint32_t row = k->row0 + j;
            if (A->pos[row] < A->keep[i])
                continue;
            keep[n] = (int32_t)row;
            B->pos[n] = A->pos[row];
            B->src[n] = A->src[row];
            B->row_seq[n] = (int32_t)B->n_seqs;
            n++;
        }
        if (n == first)
            continue;
        B->keep[B->n_seqs] = A->keep[i];
        kern_seq *o = &B->seqs[B->n_seqs++];
        *o = *k;
        o->row0 = first;
        o->n_rows = n - first;
        o->pos0 = B->pos[first];
    }
    B->n = n;
    B->n_live = n - (A->n - A->n_live); /* placeholder rows are kept, last */
    size_t D = c->dim, hc = c->hc_mult;
    size_t taps = c->n_dspark_targets ? c->n_dspark_targets : 1;
    size_t hash = (c->n_engram_layers ? c->n_engram_layers * c->engram_cols : 1) * 8;
    struct {
        void *buf;
        size_t bytes;
    } per_row[] = {
        {r->h, hc * D * 2},       {r->x, D * 2},           {r->a_pre, hc * 4},
        {r->a_post, hc * 4},      {r->a_comb, hc * hc * 4}, {r->taps, taps * D * 2},
        {r->hash, hash},
    };
    for (size_t i = 0; i < sizeof(per_row) / sizeof(per_row[0]); i++) {
        di_status s = gather(r, per_row[i].buf, per_row[i].bytes, keep, n, err);
        if (s != DI_OK)
            return s;
    }
    fwd_rows tmp = *A;
    *A = *B;
    *B = tmp;
    return DI_OK;
}

/* ---- step ---------------------------------------------------------------------------------- */

static di_status engram_hash(fwd_run *r, di_error *err)
{
    const fwd_model *m = r->m;
    const model_config *c = m->cfg;
    if (!c->n_engram_layers)
        return DI_OK;
    kern_engram_hash p = {.n_rows = r->rows.n, .n_layers = c->n_engram_layers,
                          .max_ngram = c->engram_max_ngram_size, .n_heads = c->engram_n_heads,
                          .ids = r->ids, .row_seq = r->rows.row_seq, .seqs = r->rows.seqs,
                          .token_map = m->tmap, .vocab = c->vocab_size, .pad_id = m->engram_pad,
                          .multipliers = m->e_mult, .primes = m->e_primes,
                          .offsets = m->e_offsets, .out = r->hash, .ids_dev = r->ids_dev};
    FWD_TRY(err, -1, m->be->ops.engram_hash(m->be->ctx, &p));
    fwd_dump(r, "engram.hash", -1, FWD_I64, r->hash, r->rows.n, c->n_engram_layers,
             c->engram_cols);
    return DI_OK;
}

/* m_l = mean over the copies of H, the draft model's input from layer l (MODEL.md §1 4b). */
static di_status record_tap(fwd_run *r, const fwd_layer_w *L, di_error *err)
{
    const model_config *c = r->m->cfg;
    uint32_t slot = (uint32_t)L->role->draft_tap;
    kern_hc_collapse p = {.n_rows = r->rows.n, .n_copies = c->hc_mult, .dim = c->dim, .h = r->h,
                          .pre = r->mean_pre, .pre_stride = 0, .out = r->taps + (size_t)slot * c->dim,
                          .out_stride = (size_t)c->n_dspark_targets * c->dim};
    FWD_TRY(err, (int32_t)L->id, r->m->be->ops.hc_collapse(r->m->be->ctx, &p));
    /* [T, D] */
    return DI_OK;
}

/* One backbone layer: Engram, tap, the attention site, the FFN site (MODEL.md §1 step 4). */
static di_status run_layer(fwd_run *r, fwd_kv *kv, uint32_t l, di_error *err)
{
    fwd_model *m = r->m;
    const model_config *c = m->cfg;
    const fwd_layer_w *L = &m->layers[l];
    size_t hc = c->hc_mult;
    di_status st;
    if (l == c->yoco_boundary && m->opt.yoco != FWD_YOCO_OFF)
        clip_windows(r);
    if (L->engram_slot >= 0 && (st = fwd_engram(r, L, err)) != DI_OK)
        return st;
    if (L->role->draft_tap >= 0 && (st = record_tap(r, L, err)) != DI_OK)
        return st;
    /* attention site: mixes of the current stream, collapse with the carried pre */
    const float *pre_in = l == 0 ? r->onehot : r->pre;
    st = fwd_hc_site_in(r, r->rows.n, &L->hc_attn, L->attn_norm, pre_in, l == 0 ? 0 : hc,
                        r->a_pre, r->a_post, r->a_comb, (int32_t)l, err);
    if (st != DI_OK)
        return st;
    fwd_dump(r, "attn_in", (int32_t)l, FWD_BF16, r->x, r->rows.n, c->dim, 0); /* [T, D] */
    int compact = l == c->yoco_boundary && m->opt.yoco == FWD_YOCO_COMPACT;
    st = fwd_attention(r, kv, L, state_ring_offset(&m->geom, l), 1,
                       compact ? compact_rows : NULL, err);
    if (st != DI_OK)
        return st;
    fwd_dump(r, "attn_out", (int32_t)l, FWD_BF16, r->y, r->rows.n, c->dim, 0); /* [T, D] */
    if ((st = fwd_hc_expand(r, r->rows.n, r->a_post, r->a_comb, (int32_t)l, err)) != DI_OK)
        return st;
    /* FFN site: mixes of the updated stream, collapse with the attention site's pre */
    st = fwd_hc_site_in(r, r->rows.n, &L->hc_ffn, L->ffn_norm, r->a_pre, hc, r->f_pre, r->f_post,
                        r->f_comb, (int32_t)l, err);
    if (st != DI_OK)
        return st;
    fwd_dump(r, "ffn_in", (int32_t)l, FWD_BF16, r->x, r->rows.n, c->dim, 0); /* [T, D] */
    if ((st = fwd_moe(r, L, err)) != DI_OK)
        return st;
    fwd_dump(r, "ffn_out", (int32_t)l, FWD_BF16, r->y, r->rows.n, c->dim, 0); /* [T, D] */
    if ((st = fwd_hc_expand(r, r->rows.n, r->f_post, r->f_comb, (int32_t)l, err)) != DI_OK)
        return st;
    fwd_dump(r, "H", (int32_t)l, FWD_BF16, r->h, r->rows.n, hc, c->dim); /* [T, hc, D] */
    float *t = r->pre; /* carry the FFN pre into the next layer */
    r->pre = r->f_pre;
    r->f_pre = t;
    return DI_OK;
}

/* Final collapse and norm of every live row, then the head on the requested rows only. */
static di_status final_logits(fwd_run *r, const fwd_step *st, float *logits, di_error *err)
{
    fwd_model *m = r->m;
    const model_config *c = m->cfg;
    const kern_backend *be = m->be;
    uint32_t T = r->rows.n, n = st->n_logit_rows;
    kern_hc_collapse col = {.n_rows = T, .n_copies = c->hc_mult, .dim = c->dim, .h = r->h,
                            .pre = r->pre, .pre_stride = c->hc_mult, .out = r->hfin,
                            .out_stride = c->dim};
    FWD_TRY(err, -1, be->ops.hc_collapse(be->ctx, &col));
    kern_rmsnorm nrm = {.n_rows = T, .dim = c->dim, .x = r->hfin, .x_stride = c->dim,
                        .weight = m->norm, .y = r->hfin, .y_stride = c->dim,
                        .eps = (float)c->norm_eps};
    FWD_TRY(err, -1, be->ops.rmsnorm(be->ctx, &nrm));
    fwd_dump(r, "final_h", -1, FWD_BF16, r->hfin, T, c->dim, 0); /* [T, D] */
    if (n == 0)
        return DI_OK;
    for (uint32_t i = 0; i < n; i++) {
        r->sel[i] = -1;
        for (uint32_t t = 0; t < T; t++)
            if (r->rows.src[t] == st->logit_rows[i])
                r->sel[i] = (int32_t)t;
        assert(r->sel[i] >= 0); /* dropped rows were refused by check_step */
    }
    kern_copy_rows g = {.n_rows = n, .row_bytes = (size_t)c->dim * 2, .src = r->hfin,
                        .src_stride = (size_t)c->dim * 2, .rows = r->sel, .dst = r->hsel,
                        .dst_stride = (size_t)c->dim * 2};
    FWD_TRY(err, -1, be->ops.copy_rows(be->ctx, &g));
    size_t bytes = (size_t)n * c->vocab_size * sizeof(float);
    if (r->logits_rows < n) { /* kept between steps: a device backend's free waits */
        if (r->logits)
            be->ops.free(be->ctx, r->logits);
        r->logits = be->ops.alloc(be->ctx, bytes);
        r->logits_rows = r->logits ? n : 0;
        if (!r->logits)
            return di_fail(err, DI_ENOMEM, "logits of %u rows", n);
    }
    kern_linear head = {.m = n, .n = c->vocab_size, .k = c->dim, .groups = 1, .x = r->hsel,
                        .x_stride = c->dim, .w = m->head, .out_f32 = 1, .y = r->logits,
                        .y_stride = c->vocab_size};
    FWD_TRY(err, -1, be->ops.head(be->ctx, &head)); /* [n, V] f32 */
    if (logits) /* NULL: they stay in backend memory (fwd_step_run_keep) */
        be->ops.to_host(be->ctx, logits, r->logits, bytes);
    return DI_OK;
}

/* A checked step; logits NULL keeps them in backend memory. */
static di_status step_run(fwd_run *r, fwd_kv *kv, const fwd_step *st, float *logits,
                          uint32_t T, di_error *err)
{
    di_status s;
    fwd_model *m = r->m;
    const model_config *c = m->cfg;
    build_rows(r, kv, st);
    r->ids_dev = st->ids_dev;
    kern_embed e = {.n_rows = T, .dim = c->dim, .n_copies = c->hc_mult, .vocab = c->vocab_size,
                    .ids = r->ids, .table = m->embed, .out = r->h, .ids_dev = st->ids_dev};
    FWD_TRY(err, -1, m->be->ops.embed(m->be->ctx, &e)); /* H [T, hc, D] */
    if ((s = engram_hash(r, err)) != DI_OK)
        return s;
    for (uint32_t l = 0; l < c->n_layers; l++)
        if ((s = run_layer(r, kv, l, err)) != DI_OK)
            return s;
    if (c->n_mtp && (s = fwd_draft_rings(r, kv, err)) != DI_OK)
        return s;
    return final_logits(r, st, logits, err);
}

di_status fwd_step_run(fwd_run *r, fwd_kv *kv, const fwd_step *st, float *logits, di_error *err)
{
    if (!r)
        return di_fail(err, DI_EINVAL, "step: run is NULL");
    uint32_t T = 0;
    di_status s = check_step(r, kv, st, &T, err);
    if (s != DI_OK)
        return s;
    if (st->n_logit_rows && !logits)
        return di_fail(err, DI_EINVAL, "step: logits output is NULL");
    return step_run(r, kv, st, logits, T, err);
}

di_status fwd_step_run_keep(fwd_run *r, fwd_kv *kv, const fwd_step *st, const float **logits,
                            di_error *err)
{
    if (!r || !logits)
        return di_fail(err, DI_EINVAL, "step: run or logits pointer is NULL");
    uint32_t T = 0;
    di_status s = check_step(r, kv, st, &T, err);
    if (s == DI_OK)
        s = step_run(r, kv, st, NULL, T, err);
    if (s == DI_OK)
        *logits = st->n_logit_rows ? r->logits : NULL;
    return s;
}
