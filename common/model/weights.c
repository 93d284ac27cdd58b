/* weights.c: the tensor manifest of a config, the checkpoint loader (views into mapped
 * shards) and value access (see weights.h). */
#include "common/model/weights_priv.h"

#include <assert.h>
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/util/hash64.h"
#include "common/util/philox.h"
#include "kernels/cpu/numfmt.h"

/* ---- manifest ----------------------------------------------------------------------------- */

/* Emits specs through the callback; one name buffer reused. */
typedef struct emitter {
    model_spec_fn fn;
    void *ud;
    di_error *err;
    char name[160];
} emitter;

static di_status emit(emitter *em, model_tensor *dst, model_wfmt fmt, uint64_t rows,
                      uint64_t cols, model_init init, double std, uint32_t flags)
{
    model_tensor_spec s = {
        .name = em->name, .fmt = fmt, .ndim = cols ? 2 : 1, .rows = rows, .cols = cols ? cols : 1,
        .init = init, .std = std, .flags = flags, .dst = dst,
    };
    return em->fn(em->ud, &s, em->err);
}

/* A Linear weight [out, in]: N(0, 1/in). */
static di_status emit_linear(emitter *em, model_tensor *dst, model_wfmt fmt, uint64_t out,
                             uint64_t in)
{
    return emit(em, dst, fmt, out, in, MODEL_INIT_NORMAL, 1.0 / sqrt((double)in), 0);
}

#define NAME(em, ...) snprintf((em)->name, sizeof (em)->name, __VA_ARGS__)
#define TRY(x)                                                                               \
    do {                                                                                     \
        di_status st_ = (x);                                                                 \
        if (st_ != DI_OK)                                                                    \
            return st_;                                                                      \
    } while (0)

/* Destination helper: NULL-safe member address. */
#define DST(base, member) ((base) ? &(base)->member : NULL)

static di_status emit_norm(emitter *em, model_tensor *dst, uint64_t n)
{
    return emit(em, dst, MODEL_WFMT_BF16, n, 0, MODEL_INIT_ONES, 0, 0);
}

static di_status emit_hc(emitter *em, const model_config *c, const char *p, const char *site,
                         model_hc_weights *hc)
{
    uint64_t mixes = (2 + (uint64_t)c->hc_mult) * c->hc_mult;
    NAME(em, "%shc_%s_fn", p, site);
    TRY(emit(em, DST(hc, fn), MODEL_WFMT_F32, mixes, (uint64_t)c->hc_mult * c->dim,
             MODEL_INIT_NORMAL, 1e-4, 0));
    NAME(em, "%shc_%s_base", p, site);
    TRY(emit(em, DST(hc, base), MODEL_WFMT_F32, mixes, 0, MODEL_INIT_ZEROS, 0, 0));
    NAME(em, "%shc_%s_scale", p, site);
    return emit(em, DST(hc, scale), MODEL_WFMT_F32, 3, 0, MODEL_INIT_ONES, 0, 0);
}

static di_status emit_attn(emitter *em, const model_config *c, const char *p,
                           model_attn_weights *a)
{
    uint64_t qdim = (uint64_t)c->n_heads * c->head_dim, odim = (uint64_t)c->o_groups * c->o_lora_rank;
    NAME(em, "%sattn.wq_a.weight", p);
    TRY(emit_linear(em, DST(a, wq_a), MODEL_WFMT_FP8_32X32, c->q_lora_rank, c->dim));
    NAME(em, "%sattn.q_norm.weight", p);
    TRY(emit_norm(em, DST(a, q_norm), c->q_lora_rank));
    NAME(em, "%sattn.wq_b.weight", p);
    TRY(emit_linear(em, DST(a, wq_b), MODEL_WFMT_FP8_32X32, qdim, c->q_lora_rank));
    NAME(em, "%sattn.wkv.weight", p);
    TRY(emit_linear(em, DST(a, wkv), MODEL_WFMT_FP8_32X32, c->head_dim, c->dim));
    NAME(em, "%sattn.kv_norm.weight", p);
    TRY(emit_norm(em, DST(a, kv_norm), c->head_dim));
    NAME(em, "%sattn.wo_a.weight", p);
    TRY(emit_linear(em, DST(a, wo_a), MODEL_WFMT_FP8_32X32, odim, qdim / c->o_groups));
    NAME(em, "%sattn.wo_b.weight", p);
    TRY(emit_linear(em, DST(a, wo_b), MODEL_WFMT_FP8_32X32, c->dim, odim));
    NAME(em, "%sattn.attn_sink", p);
    return emit(em, DST(a, attn_sink), MODEL_WFMT_F32, c->n_heads, 0, MODEL_INIT_ZEROS, 0, 0);
}

static di_status emit_compressor(emitter *em, const model_config *c, const char *p,
                                 uint32_t ratio, model_compressor_weights *cw)
{
    NAME(em, "%sattn.compressor.wkv.weight", p);
    TRY(emit_linear(em, DST(cw, wkv), MODEL_WFMT_BF16, c->head_dim, c->dim));
    if (ratio > 1) {
        NAME(em, "%sattn.compressor.wgate.weight", p);
        TRY(emit_linear(em, DST(cw, wgate), MODEL_WFMT_BF16, c->head_dim, c->dim));
    }
    NAME(em, "%sattn.compressor.norm.weight", p);
    return emit_norm(em, DST(cw, norm), c->head_dim);
}

static di_status emit_indexer(emitter *em, const model_config *c, const char *p, bool keys,
                              model_indexer_weights *ix)
{
    NAME(em, "%sattn.indexer.wq_b.weight", p);
    TRY(emit_linear(em, DST(ix, wq_b), MODEL_WFMT_FP8_32X32,
                    (uint64_t)c->index_n_heads * c->index_head_dim, c->q_lora_rank));
    NAME(em, "%sattn.indexer.weights_proj.weight", p);
    TRY(emit_linear(em, DST(ix, weights_proj), MODEL_WFMT_BF16, c->index_n_heads, c->dim));
    if (!keys)
        return DI_OK;
    NAME(em, "%sattn.indexer.wk.weight", p);
    TRY(emit_linear(em, DST(ix, wk), MODEL_WFMT_BF16, c->index_head_dim, c->head_dim));
    NAME(em, "%sattn.indexer.k_norm.weight", p);
    return emit_norm(em, DST(ix, k_norm), c->index_head_dim);
}

static di_status emit_expert(emitter *em, const model_config *c, const char *stem,
                             model_wfmt fmt, model_expert_weights *e)
{
    NAME(em, "%s.w1.weight", stem);
    TRY(emit_linear(em, DST(e, w1), fmt, c->moe_inter_dim, c->dim));
    NAME(em, "%s.w2.weight", stem);
    TRY(emit_linear(em, DST(e, w2), fmt, c->dim, c->moe_inter_dim));
    NAME(em, "%s.w3.weight", stem);
    return emit_linear(em, DST(e, w3), fmt, c->moe_inter_dim, c->dim);
}

static di_status emit_ffn(emitter *em, const model_config *c, const char *p, uint32_t n_experts,
                          model_ffn_weights *f)
{
    NAME(em, "%sffn.gate.weight", p);
    TRY(emit_linear(em, DST(f, gate), MODEL_WFMT_BF16, n_experts, c->dim));
    NAME(em, "%sffn.gate.bias", p);
    TRY(emit(em, DST(f, gate_bias), MODEL_WFMT_F32, n_experts, 0, MODEL_INIT_GATE_BIAS, 0, 0));
    NAME(em, "%sffn.gate.bias_vl", p);
    TRY(emit(em, DST(f, gate_bias_vl), MODEL_WFMT_F32, n_experts, 0, MODEL_INIT_ZEROS, 0,
             MODEL_SPEC_OPTIONAL));
    char stem[128];
    for (uint32_t e = 0; e < n_experts; e++) {
        snprintf(stem, sizeof stem, "%sffn.experts.%u", p, e);
        TRY(emit_expert(em, c, stem, MODEL_WFMT_FP4_1X32, f ? &f->experts[e] : NULL));
    }
    snprintf(stem, sizeof stem, "%sffn.shared_experts", p);
    return emit_expert(em, c, stem, MODEL_WFMT_FP8_32X32, DST(f, shared));
}

static di_status emit_engram(emitter *em, const model_config *c, uint32_t l, uint32_t slot,
                             model_engram_weights *g)
{
    uint64_t width = c->engram_head_dim, in = (uint64_t)c->engram_cols * width;
    NAME(em, "layers.%u.engram.embed.weight", l);
    model_tensor_spec s = {
        .name = em->name, .fmt = MODEL_WFMT_FP8_1X32, .ndim = 2,
        .rows = c->engram_num_embeddings[slot], .cols = width, .init = MODEL_INIT_ENGRAM,
        .flags = c->has_engram_table_seed ? MODEL_SPEC_SEEDABLE : 0, .engram_layer = l,
        .dst = DST(g, table),
    };
    TRY(em->fn(em->ud, &s, em->err));
    NAME(em, "layers.%u.engram.wkv.weight", l);
    TRY(emit_linear(em, DST(g, wkv), MODEL_WFMT_FP8_32X32, ((uint64_t)c->hc_mult + 1) * c->dim,
                    in));
    NAME(em, "layers.%u.engram.q_weight", l);
    TRY(emit(em, DST(g, q_weight), MODEL_WFMT_BF16, c->hc_mult, c->dim, MODEL_INIT_ONES, 0, 0));
    NAME(em, "layers.%u.engram.k_weight", l);
    return emit(em, DST(g, k_weight), MODEL_WFMT_BF16, c->hc_mult, c->dim, MODEL_INIT_ONES, 0, 0);
}

/* The parts every layer and draft stage has: norms, mHC, attention, MoE. */
static di_status emit_block(emitter *em, const model_config *c, const char *p,
                            uint32_t n_experts, model_layer_weights *lw)
{
    NAME(em, "%sattn_norm.weight", p);
    TRY(emit_norm(em, DST(lw, attn_norm), c->dim));
    NAME(em, "%sffn_norm.weight", p);
    TRY(emit_norm(em, DST(lw, ffn_norm), c->dim));
    TRY(emit_hc(em, c, p, "attn", DST(lw, hc_attn)));
    TRY(emit_hc(em, c, p, "ffn", DST(lw, hc_ffn)));
    return emit_attn(em, c, p, DST(lw, attn));
}

static di_status emit_layer(emitter *em, const model_config *c, uint32_t l, model_weights *w)
{
    char p[32];
    snprintf(p, sizeof p, "layers.%u.", l);
    model_layer_weights *lw = w ? &w->layers[l] : NULL;
    const model_layer_role *r = model_config_role(c, l);
    TRY(emit_block(em, c, p, c->n_routed_experts, lw));
    if (r->owns_compressor)
        TRY(emit_compressor(em, c, p, r->ratio, DST(lw, compressor)));
    if (r->owns_indexer)
        TRY(emit_indexer(em, c, p, r->owns_index_keys, DST(lw, indexer)));
    TRY(emit_ffn(em, c, p, c->n_routed_experts, DST(lw, ffn)));
    if (r->engram >= 0)
        TRY(emit_engram(em, c, l, (uint32_t)r->engram, w ? &w->engrams[r->engram] : NULL));
    return DI_OK;
}

static di_status emit_draft(emitter *em, const model_config *c, uint32_t s, model_weights *w)
{
    char p[32];
    snprintf(p, sizeof p, "mtp.%u.", s);
    model_draft_weights *d = w ? &w->drafts[s] : NULL;
    TRY(emit_block(em, c, p, c->dspark_n_routed_experts, DST(d, block)));
    TRY(emit_ffn(em, c, p, c->dspark_n_routed_experts, DST(d, block.ffn)));
    if (s == 0) {
        NAME(em, "mtp.0.main_proj.weight");
        TRY(emit_linear(em, DST(d, main_proj), MODEL_WFMT_FP8_32X32, c->dim,
                        (uint64_t)c->n_dspark_targets * c->dim));
        NAME(em, "mtp.0.main_norm.weight");
        TRY(emit_norm(em, DST(d, main_norm), c->dim));
    }
    if (s + 1 < c->n_mtp)
        return DI_OK;
    NAME(em, "%snorm.weight", p);
    TRY(emit_norm(em, DST(d, norm), c->dim));
    NAME(em, "%smarkov_head.embed.weight", p);
    TRY(emit(em, DST(d, markov_embed), MODEL_WFMT_BF16, c->vocab_size, c->dspark_markov_rank,
             MODEL_INIT_NORMAL, 1.0, 0));
    NAME(em, "%smarkov_head.head.weight", p);
    TRY(emit_linear(em, DST(d, markov_head), MODEL_WFMT_BF16, c->vocab_size,
                    c->dspark_markov_rank));
    NAME(em, "%sconfidence_head.proj.weight", p);
    return emit_linear(em, DST(d, confidence_proj), MODEL_WFMT_BF16, 1,
                       (uint64_t)c->dim + c->dspark_markov_rank);
}

static di_status enumerate(const model_config *c, model_weights *w, model_spec_fn fn, void *ud,
                           di_error *err)
{
    emitter em = {.fn = fn, .ud = ud, .err = err};
    NAME(&em, "embed.weight");
    TRY(emit(&em, DST(w, embed), MODEL_WFMT_BF16, c->vocab_size, c->dim, MODEL_INIT_NORMAL, 1.0,
             0));
    for (uint32_t l = 0; l < c->n_layers; l++)
        TRY(emit_layer(&em, c, l, w));
    for (uint32_t s = 0; s < c->n_mtp; s++)
        TRY(emit_draft(&em, c, s, w));
    NAME(&em, "norm.weight");
    TRY(emit_norm(&em, DST(w, norm), c->dim));
    NAME(&em, "head.weight");
    return emit_linear(&em, DST(w, head), MODEL_WFMT_BF16, c->vocab_size, c->dim);
}

di_status model_manifest_into(const model_config *cfg, model_weights *w, model_spec_fn fn,
                              void *userdata, di_error *err)
{
    return enumerate(cfg, w, fn, userdata, err);
}

di_status model_weights_manifest(const model_config *cfg, model_spec_fn fn, void *userdata,
                                 di_error *err)
{
    if (!cfg || !fn)
        return di_fail(err, DI_EINVAL, "config and callback must not be NULL");
    return enumerate(cfg, NULL, fn, userdata, err);
}

void model_spec_disk(const model_tensor_spec *s, model_disk_layout *out)
{
    model_disk_layout d;
    memset(&d, 0, sizeof d);
    d.ndim = s->ndim;
    d.shape[0] = s->rows;
    d.shape[1] = s->ndim == 2 ? s->cols : 0;
    switch (s->fmt) {
    case MODEL_WFMT_F32: d.dtype = ST_F32; break;
    case MODEL_WFMT_BF16: d.dtype = ST_BF16; break;
    case MODEL_WFMT_FP8_32X32:
        d.dtype = ST_F8_E4M3;
        d.scale_ndim = 2;
        d.scale_shape[0] = (s->rows + 31) / 32;
        d.scale_shape[1] = (s->cols + 31) / 32;
        break;
    case MODEL_WFMT_FP8_1X32:
        d.dtype = ST_F8_E4M3;
        d.scale_ndim = 2;
        d.scale_shape[0] = s->rows;
        d.scale_shape[1] = s->cols / 32;
        break;
    case MODEL_WFMT_FP4_1X32:
        d.dtype = ST_I8;
        d.shape[1] = s->cols / 2;
        d.scale_ndim = 2;
        d.scale_shape[0] = s->rows;
        d.scale_shape[1] = s->cols / 32;
        break;
    case MODEL_WFMT_NONE: assert(0); break;
    }
    *out = d;
}

void model_scale_name(const char *name, char *out, size_t cap)
{
    size_t n = strlen(name);
    const char *suffix = ".weight";
    size_t sl = strlen(suffix);
    if (n > sl && strcmp(name + n - sl, suffix) == 0)
        snprintf(out, cap, "%.*s.scale", (int)(n - sl), name);
    else
        snprintf(out, cap, "%s.scale", name);
}

static uint64_t layout_bytes(const model_disk_layout *d, bool scale)
{
    uint32_t nd = scale ? d->scale_ndim : d->ndim;
    const uint64_t *sh = scale ? d->scale_shape : d->shape;
    if (scale && nd == 0)
        return 0;
    uint64_t n = 1;
    for (uint32_t i = 0; i < nd; i++)
        n *= sh[i];
    return st_dtype_bytes(scale ? ST_F8_E8M0 : d->dtype, n);
}

static di_status count_spec(void *ud, const model_tensor_spec *s, di_error *err)
{
    model_manifest_totals *t = ud;
    model_disk_layout d;
    model_spec_disk(s, &d);
    uint64_t bytes = layout_bytes(&d, false) + layout_bytes(&d, true);
    uint64_t tensors = d.scale_ndim ? 2 : 1;
    t->tensors += tensors;
    t->bytes += bytes;
    if (!(s->flags & MODEL_SPEC_OPTIONAL))
        t->params += s->rows * s->cols;
    if (s->init == MODEL_INIT_ENGRAM) {
        t->engram_table_bytes += bytes;
        t->engram_table_tensors += tensors;
    }
    return DI_OK;
}

void model_manifest_count(const model_config *cfg, model_manifest_totals *out)
{
    model_manifest_totals t;
    memset(&t, 0, sizeof t);
    di_status st = enumerate(cfg, NULL, count_spec, &t, NULL);
    assert(st == DI_OK);
    (void)st;
    *out = t;
}

/* ---- random values ------------------------------------------------------------------------ */

/* The two normals of pair `pair` (elements 2 pair and 2 pair + 1). */
static void normal_pair(uint64_t key, uint64_t pair, double out[2])
{
    const uint32_t ctr[4] = {(uint32_t)pair, (uint32_t)(pair >> 32), 0x6e6f726du /* "norm" */,
                             0};
    const uint32_t k[2] = {(uint32_t)key, (uint32_t)(key >> 32)};
    uint32_t o[4];
    philox4x32_10(ctr, k, o);
    /* two uniforms with 53 bits; u1 in (0, 1] keeps the logarithm finite */
    uint64_t a = (((uint64_t)o[0] << 32) | o[1]) >> 11, b = (((uint64_t)o[2] << 32) | o[3]) >> 11;
    double u1 = ((double)a + 1.0) / 9007199254740992.0, u2 = (double)b / 9007199254740992.0;
    double r = sqrt(-2.0 * log(u1)), t = 6.283185307179586 * u2;
    out[0] = r * cos(t);
    out[1] = r * sin(t);
}

double model_random_normal(uint64_t key, uint64_t index)
{
    double v[2];
    normal_pair(key, index / 2, v);
    return v[index % 2];
}

void model_random_normals(uint64_t key, uint64_t first, uint64_t n, double scale, float *out)
{
    uint64_t i = 0;
    double v[2];
    if (n > 0 && first % 2) {
        normal_pair(key, first / 2, v);
        out[i++] = (float)(scale * v[1]);
    }
    for (; i + 1 < n; i += 2) {
        normal_pair(key, (first + i) / 2, v);
        out[i] = (float)(scale * v[0]);
        out[i + 1] = (float)(scale * v[1]);
    }
    if (i < n)
        out[i] = (float)(scale * model_random_normal(key, first + i));
}

uint64_t model_tensor_key(uint64_t seed, const char *name)
{
    return di_hash64(name, strlen(name), seed ^ 0x746e737277656967ull /* "weightsrnt" */);
}

void model_engram_seeded_row(uint64_t seed, uint32_t layer_id, uint64_t row, uint32_t width,
                             uint8_t *codes, uint8_t *scales)
{
    assert(width % 32 == 0 && width <= 4096);
    float x[4096];
    uint64_t key = seed ^ (0x656e6772616d0000ull + layer_id); /* "engram" + layer */
    model_random_normals(key, row * width, width, 1.0, x);
    di_quant_fp8_b32(x, width, codes, scales);
}

/* ---- value access ------------------------------------------------------------------------- */

static float load_f32(const uint8_t *p)
{
    float f;
    memcpy(&f, p, 4);
    return f;
}

static uint16_t load_u16(const uint8_t *p)
{
    uint16_t h;
    memcpy(&h, p, 2);
    return h;
}

float model_tensor_get(const model_tensor *t, uint64_t r, uint64_t c)
{
    assert(t->fmt != MODEL_WFMT_NONE && r < t->rows && c < t->cols);
    const uint8_t *d = t->data;
    uint64_t i = r * t->cols + c;
    switch (t->fmt) {
    case MODEL_WFMT_F32: return load_f32(d + 4 * i);
    case MODEL_WFMT_BF16: return di_bf16_to_f32(load_u16(d + 2 * i));
    case MODEL_WFMT_FP8_32X32:
        return di_e4m3_decode(d[i]) * di_ue8m0_decode(t->scale[(r / 32) * t->scale_cols + c / 32]);
    case MODEL_WFMT_FP8_1X32:
        return di_e4m3_decode(d[i]) * di_ue8m0_decode(t->scale[r * t->scale_cols + c / 32]);
    case MODEL_WFMT_FP4_1X32:
        return di_e2m1_decode(di_e2m1_unpack(d + r * (t->cols / 2), c)) *
               di_ue8m0_decode(t->scale[r * t->scale_cols + c / 32]);
    case MODEL_WFMT_NONE: break;
    }
    return 0.0f;
}

void model_tensor_row_f32(const model_tensor *t, uint64_t r, float *out)
{
    assert(r < t->rows);
    for (uint64_t c = 0; c < t->cols; c++)
        out[c] = model_tensor_get(t, r, c);
}

uint64_t model_tensor_data_bytes(const model_tensor *t)
{
    switch (t->fmt) {
    case MODEL_WFMT_F32: return 4 * t->rows * t->cols;
    case MODEL_WFMT_BF16: return 2 * t->rows * t->cols;
    case MODEL_WFMT_FP8_32X32:
    case MODEL_WFMT_FP8_1X32: return t->rows * t->cols;
    case MODEL_WFMT_FP4_1X32: return t->rows * t->cols / 2;
    case MODEL_WFMT_NONE: break;
    }
    return 0;
}

uint64_t model_tensor_scale_bytes(const model_tensor *t)
{
    return t->scale ? t->scale_rows * t->scale_cols : 0;
}

void model_engram_row(const model_engram_weights *e, uint64_t row, float *out)
{
    assert(row < e->rows);
    if (e->seeded) {
        uint8_t codes[4096], scales[128];
        model_engram_seeded_row(e->seed, e->layer, row, e->width, codes, scales);
        di_dequant_fp8_b32(codes, scales, e->width, out);
        return;
    }
    model_tensor_row_f32(&e->table, row, out);
}

di_status model_engram_row_checked(const model_engram_weights *e, uint64_t row, float *out,
                                   di_error *err)
{
    if (!e || !out)
        return di_fail(err, DI_EINVAL, "Engram weights and output must not be NULL");
    if (row >= e->rows)
        return di_fail(err, DI_ERANGE, "Engram row %" PRIu64 " outside the %" PRIu64
                       "-row table of layer %u", row, e->rows, e->layer);
    model_engram_row(e, row, out);
    return DI_OK;
}
