/* config.c: config.json -> model_config through one table of keys, then the consistency rules
 * and the derived roles (see config.h). */
#include "common/model/config.h"

#include <assert.h>
#include <errno.h>
#include <float.h>
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "common/model/config_builtin.h"
#include "common/util/hash64.h"
#include "common/util/json_read.h"

/* ---- the key table ------------------------------------------------------------------------ */

typedef enum cfg_type {
    CFG_U32,      /* uint32_t field */
    CFG_I32,      /* int32_t field (-1 = none) */
    CFG_U64,      /* uint64_t field */
    CFG_F64,      /* double field */
    CFG_BOOL,     /* bool field */
    CFG_ENUM,     /* string from names[]; index stored as int (offset NO_FIELD: checked only) */
    CFG_U32_LIST, /* uint32_t array; count (uint32_t) at aux */
    CFG_U64_LIST, /* uint64_t array; count (uint32_t) at aux */
    CFG_U64_OPT,  /* uint64_t field; presence (bool) at aux */
    CFG_U32_PAIR, /* [a, b] into two consecutive uint32_t fields */
} cfg_type;

/* When a key must be present. */
typedef enum cfg_need {
    NEED_NO = 0,  /* optional: default applies */
    NEED_ALWAYS,  /* required */
    NEED_ENGRAM,  /* required when engram_layer_ids is not empty */
    NEED_MTP,     /* required when num_nextn_predict_layers > 0 */
    NEED_CAND,    /* required when candidate_source_layer_id is set */
} cfg_need;

enum {
    F_TOP = 1u << 0,    /* written at the top level of the nested file (not in text_config) */
    F_ID = 1u << 1,     /* part of the model id */
    F_OMIT = 1u << 2,   /* not written when equal to the default (or absent) */
};

#define NO_FIELD SIZE_MAX
#define OFF(f) offsetof(model_config, f)

typedef struct cfg_row {
    const char *key;           /* HF name; dotted for nested objects ("rope_scaling.factor") */
    const char *alias;         /* the reference's ModelArgs name, or NULL */
    cfg_type type;
    size_t offset;             /* offsetof the field in model_config, or NO_FIELD */
    size_t aux;                /* lists: offsetof the count; U64_OPT: offsetof the flag */
    uint32_t max_count;        /* lists: capacity */
    cfg_need need;
    double def;                /* default for optional scalars */
    double lo, hi;             /* bounds of the value (each element for lists) */
    const char *const *names;  /* CFG_ENUM: accepted strings (first = written one) */
    uint32_t flags;            /* F_* */
} cfg_row;

static const char *const k_score_names[] = {"sqrtsoftplus", NULL};
static const char *const k_expert_names[] = {"fp4", NULL};
static const char *const k_fp8_names[] = {"fp8", NULL};
static const char *const k_dynamic_names[] = {"dynamic", NULL};
static const char *const k_ue8m0_names[] = {"ue8m0", NULL};
static const char *const k_yarn_names[] = {"yarn", NULL};
static const char *const k_silu_names[] = {"silu", NULL};
static const char *const k_topk_names[] = {"noaux_tc", NULL};

#define U32MAX 4294967295.0
#define BIG 9007199254740992.0 /* 2^53: integers above are not exact in a double */

/* Every key the model reads. Rows with F_ID make the model id; the order is part of it. */
static const cfg_row k_rows[] = {
    /* key, alias, type, offset, aux, max, need, default, lo, hi, names, flags */
    {"vocab_size", NULL, CFG_U32, OFF(vocab_size), 0, 0, NEED_ALWAYS, 0, 1, 1 << 30, NULL, F_ID},
    {"bos_token_id", NULL, CFG_U32, OFF(bos_token_id), 0, 0, NEED_NO, 0, 0, U32MAX, NULL, F_TOP},
    {"eos_token_id", NULL, CFG_U32, OFF(eos_token_id), 0, 0, NEED_NO, 1, 0, U32MAX, NULL, F_TOP},
    {"pad_token_id", NULL, CFG_U32, OFF(pad_token_id), 0, 0, NEED_NO, 2, 0, U32MAX, NULL, F_TOP},
    {"image_token_id", NULL, CFG_I32, OFF(image_token_id), 0, 0, NEED_NO, -1, -1, 2147483647.0,
     NULL, F_TOP | F_OMIT},
    {"hidden_size", "dim", CFG_U32, OFF(dim), 0, 0, NEED_ALWAYS, 0, 1, 1 << 20, NULL, F_ID},
    {"num_hidden_layers", "n_layers", CFG_U32, OFF(n_layers), 0, 0, NEED_ALWAYS, 0, 1,
     MODEL_MAX_LAYERS, NULL, F_ID},
    {"num_nextn_predict_layers", "n_mtp_layers", CFG_U32, OFF(n_mtp), 0, 0, NEED_NO, 0, 0,
     MODEL_MAX_MTP, NULL, F_ID},
    {"num_attention_heads", "n_heads", CFG_U32, OFF(n_heads), 0, 0, NEED_ALWAYS, 0, 1, 4096,
     NULL, F_ID},
    {"num_key_value_heads", NULL, CFG_U32, OFF(n_kv_heads), 0, 0, NEED_NO, 1, 1, 1, NULL, F_ID},
    {"head_dim", NULL, CFG_U32, OFF(head_dim), 0, 0, NEED_ALWAYS, 0, 1, 1 << 16, NULL, F_ID},
    {"qk_rope_head_dim", "rope_head_dim", CFG_U32, OFF(rope_head_dim), 0, 0, NEED_ALWAYS, 0, 2,
     1 << 16, NULL, F_ID},
    {"q_lora_rank", NULL, CFG_U32, OFF(q_lora_rank), 0, 0, NEED_ALWAYS, 0, 1, 1 << 20, NULL,
     F_ID},
    {"o_groups", NULL, CFG_U32, OFF(o_groups), 0, 0, NEED_ALWAYS, 0, 1, 4096, NULL, F_ID},
    {"o_lora_rank", NULL, CFG_U32, OFF(o_lora_rank), 0, 0, NEED_ALWAYS, 0, 1, 1 << 20, NULL,
     F_ID},
    {"sliding_window", "window_size", CFG_U32, OFF(window), 0, 0, NEED_ALWAYS, 0, 1, 1 << 20,
     NULL, F_ID},
    {"compress_ratios", NULL, CFG_U32_LIST, OFF(compress_ratios), OFF(n_compress_ratios),
     MODEL_MAX_ENTRIES, NEED_ALWAYS, 0, 0, KV_BLOCK_TOKENS, NULL, F_ID},
    {"kv_source_layer_ids", "kv_source_layers", CFG_U32_LIST, OFF(kv_source_layers),
     OFF(n_kv_sources), KV_MAX_OWNERS, NEED_NO, 0, 0, MODEL_MAX_LAYERS - 1, NULL, F_ID},
    {"index_source_layer_ids", "index_source_layers", CFG_U32_LIST, OFF(index_source_layers),
     OFF(n_index_sources), MODEL_MAX_LAYERS, NEED_NO, 0, 0, MODEL_MAX_LAYERS - 1, NULL, F_ID},
    {"candidate_source_layer_id", "candidate_source_layer", CFG_I32,
     OFF(candidate_source_layer), 0, 0, NEED_NO, -1, -1, MODEL_MAX_LAYERS - 1, NULL,
     F_ID | F_OMIT},
    {"candidate_topk_blocks", NULL, CFG_U32, OFF(candidate_topk_blocks), 0, 0, NEED_CAND, 0, 1,
     1 << 24, NULL, F_ID},
    {"candidate_block_size", NULL, CFG_U32, OFF(candidate_block_size), 0, 0, NEED_CAND, 0, 1,
     1 << 16, NULL, F_ID},
    {"index_n_heads", NULL, CFG_U32, OFF(index_n_heads), 0, 0, NEED_ALWAYS, 0, 1, 4096, NULL,
     F_ID},
    {"index_head_dim", NULL, CFG_U32, OFF(index_head_dim), 0, 0, NEED_ALWAYS, 0, 1, 1 << 16,
     NULL, F_ID},
    {"index_topk", NULL, CFG_U32, OFF(index_topk), 0, 0, NEED_ALWAYS, 0, 1, 1 << 24, NULL, F_ID},
    {"rope_theta", NULL, CFG_F64, OFF(rope_theta), 0, 0, NEED_ALWAYS, 0, 1, 1e12, NULL, F_ID},
    {"compress_rope_theta", NULL, CFG_F64, OFF(compress_rope_theta), 0, 0, NEED_ALWAYS, 0, 1,
     1e12, NULL, F_ID},
    {"rope_scaling.type", "rope_scaling.rope_type", CFG_ENUM, NO_FIELD, 0, 0, NEED_NO, 0, 0, 0,
     k_yarn_names, 0},
    {"rope_scaling.factor", "rope_factor", CFG_F64, OFF(rope_factor), 0, 0, NEED_ALWAYS, 0, 1,
     1e6, NULL, F_ID},
    {"rope_scaling.original_max_position_embeddings", "original_seq_len", CFG_U64,
     OFF(original_seq_len), 0, 0, NEED_ALWAYS, 0, 1, BIG, NULL, F_ID},
    {"rope_scaling.beta_fast", "beta_fast", CFG_F64, OFF(beta_fast), 0, 0, NEED_ALWAYS, 0, 0,
     1e6, NULL, F_ID},
    {"rope_scaling.beta_slow", "beta_slow", CFG_F64, OFF(beta_slow), 0, 0, NEED_ALWAYS, 0, 0, 1e6,
     NULL, F_ID},
    {"max_position_embeddings", NULL, CFG_U64, OFF(max_position_embeddings), 0, 0, NEED_NO,
     1048576, 1, BIG, NULL, 0},
    {"rms_norm_eps", "norm_eps", CFG_F64, OFF(norm_eps), 0, 0, NEED_ALWAYS, 0, 0, 1, NULL, F_ID},
    {"n_routed_experts", NULL, CFG_U32, OFF(n_routed_experts), 0, 0, NEED_ALWAYS, 0, 1, 65536,
     NULL, F_ID},
    {"num_experts_per_tok", "n_activated_experts", CFG_U32, OFF(n_activated_experts), 0, 0,
     NEED_ALWAYS, 0, 1, 65536, NULL, F_ID},
    {"n_shared_experts", NULL, CFG_U32, OFF(n_shared_experts), 0, 0, NEED_ALWAYS, 0, 1, 1, NULL,
     F_ID},
    {"moe_intermediate_size", "moe_inter_dim", CFG_U32, OFF(moe_inter_dim), 0, 0, NEED_ALWAYS, 0,
     1, 1 << 20, NULL, F_ID},
    {"scoring_func", "score_func", CFG_ENUM, OFF(score_func), 0, 0, NEED_NO, 0, 0, 0,
     k_score_names, F_ID},
    {"topk_method", NULL, CFG_ENUM, NO_FIELD, 0, 0, NEED_NO, 0, 0, 0, k_topk_names, 0},
    {"norm_topk_prob", NULL, CFG_BOOL, OFF(norm_topk_prob), 0, 0, NEED_NO, 1, 0, 1, NULL, F_ID},
    {"routed_scaling_factor", "route_scale", CFG_F64, OFF(route_scale), 0, 0, NEED_ALWAYS, 0, 0,
     1e6, NULL, F_ID},
    {"gate_temp", NULL, CFG_F64, OFF(gate_temp), 0, 0, NEED_NO, 1.0, 1e-6, 1e6, NULL,
     F_ID | F_OMIT},
    {"swiglu_limit", NULL, CFG_F64, OFF(swiglu_limit), 0, 0, NEED_ALWAYS, 0, 0, 1e6, NULL, F_ID},
    {"hidden_act", NULL, CFG_ENUM, NO_FIELD, 0, 0, NEED_NO, 0, 0, 0, k_silu_names, 0},
    {"hc_mult", NULL, CFG_U32, OFF(hc_mult), 0, 0, NEED_ALWAYS, 0, 4, 4, NULL, F_ID},
    {"hc_sinkhorn_iters", NULL, CFG_U32, OFF(hc_sinkhorn_iters), 0, 0, NEED_ALWAYS, 0, 1, 1000,
     NULL, F_ID},
    {"hc_eps", NULL, CFG_F64, OFF(hc_eps), 0, 0, NEED_ALWAYS, 0, 0, 1, NULL, F_ID},
    {"engram_layer_ids", NULL, CFG_U32_LIST, OFF(engram_layer_ids), OFF(n_engram_layers),
     MODEL_MAX_ENGRAM_LAYERS, NEED_NO, 0, 0, MODEL_MAX_LAYERS - 1, NULL, F_ID},
    {"engram_num_embeddings", NULL, CFG_U64_LIST, OFF(engram_num_embeddings),
     OFF(n_engram_num_embeddings),
     MODEL_MAX_ENGRAM_LAYERS, NEED_ENGRAM, 0, 1, BIG, NULL, F_ID},
    {"engram_max_ngram_size", NULL, CFG_U32, OFF(engram_max_ngram_size), 0, 0, NEED_ENGRAM, 0, 2,
     MODEL_MAX_NGRAM, NULL, F_ID},
    {"engram_n_heads", NULL, CFG_U32, OFF(engram_n_heads), 0, 0, NEED_ENGRAM, 0, 1,
     MODEL_MAX_ENGRAM_HEADS, NULL, F_ID},
    {"engram_head_dim", NULL, CFG_U32, OFF(engram_head_dim), 0, 0, NEED_ENGRAM, 0, 1, 4096,
     NULL, F_ID},
    {"engram_vocab_size", NULL, CFG_U64, OFF(engram_vocab_size), 0, 0, NEED_ENGRAM, 0, 2,
     1099511627776.0 /* 2^40 */, NULL, F_ID},
    {"engram_compressed_vocab_size", NULL, CFG_U32, OFF(engram_compressed_vocab_size), 0, 0,
     NEED_ENGRAM, 0, 1, 1 << 29, NULL, F_ID},
    {"engram_pad_token_id", "engram_pad_id", CFG_U32, OFF(engram_pad_id), 0, 0, NEED_ENGRAM, 0, 0,
     1 << 29, NULL, F_ID},
    {"engram_table_seed", NULL, CFG_U64_OPT, OFF(engram_table_seed), OFF(has_engram_table_seed),
     0, NEED_NO, 0, 0, BIG, NULL, F_OMIT},
    {"dspark_block_size", NULL, CFG_U32, OFF(dspark_block_size), 0, 0, NEED_MTP, 0, 1, 64, NULL,
     F_ID},
    {"dspark_noise_token_id", NULL, CFG_U32, OFF(dspark_noise_token_id), 0, 0, NEED_MTP, 0, 0,
     U32MAX, NULL, F_ID},
    {"dspark_target_layer_ids", NULL, CFG_U32_LIST, OFF(dspark_target_layers),
     OFF(n_dspark_targets), MODEL_MAX_DRAFT_TAPS, NEED_MTP, 0, 0, MODEL_MAX_LAYERS - 1, NULL,
     F_ID},
    {"dspark_markov_rank", NULL, CFG_U32, OFF(dspark_markov_rank), 0, 0, NEED_MTP, 0, 1, 1 << 16,
     NULL, F_ID},
    {"dspark_n_routed_experts", NULL, CFG_U32, OFF(dspark_n_routed_experts), 0, 0, NEED_MTP, 0, 1,
     65536, NULL, F_ID},
    {"dspark_num_experts_per_tok", "dspark_n_activated_experts", CFG_U32,
     OFF(dspark_n_activated_experts), 0, 0, NEED_MTP, 0, 1, 65536, NULL, F_ID},
    {"quantization_config.quant_method", NULL, CFG_ENUM, NO_FIELD, 0, 0, NEED_NO, 0, 0, 0,
     k_fp8_names, F_TOP},
    {"quantization_config.activation_scheme", NULL, CFG_ENUM, NO_FIELD, 0, 0, NEED_NO, 0, 0, 0,
     k_dynamic_names, F_TOP},
    {"quantization_config.weight_block_size", NULL, CFG_U32_PAIR, OFF(quant.weight_block_rows),
     0, 0, NEED_NO, 32, 32, 32, NULL, F_TOP | F_ID},
    {"quantization_config.scale_fmt", NULL, CFG_ENUM, NO_FIELD, 0, 0, NEED_NO, 0, 0, 0,
     k_ue8m0_names, F_TOP},
    {"quantization_config.expert_dtype", NULL, CFG_ENUM, OFF(quant.expert), 0, 0, NEED_NO, 0, 0,
     0, k_expert_names, F_TOP | F_ID},
};
#define N_ROWS (sizeof k_rows / sizeof k_rows[0])

/* ---- reading one row ---------------------------------------------------------------------- */

/* obj[path] where path may hold one dot ("rope_scaling.factor"). */
static json_t *get_path(const json_t *obj, const char *path)
{
    if (!obj || !json_is_object(obj))
        return NULL;
    const char *dot = strchr(path, '.');
    if (!dot)
        return json_object_get(obj, path);
    char head[64];
    size_t n = (size_t)(dot - path);
    if (n >= sizeof head)
        return NULL;
    memcpy(head, path, n);
    head[n] = '\0';
    json_t *inner = json_object_get(obj, head);
    if (!inner || !json_is_object(inner))
        return NULL;
    return json_object_get(inner, dot + 1);
}

/* The value of a row: text_config first, then the top level; the HF name before the alias.
 * *used gets the name found. NULL (and *used = row key) when absent or null. */
static json_t *find_value(const json_t *root, const json_t *text, const cfg_row *row,
                          const char **used)
{
    const char *names[2] = {row->key, row->alias};
    const json_t *where[2] = {text, root};
    for (int n = 0; n < 2; n++) {
        if (!names[n])
            continue;
        for (int w = 0; w < 2; w++) {
            json_t *v = get_path(where[w], names[n]);
            if (v && !json_is_null(v)) {
                *used = names[n];
                return v;
            }
        }
    }
    *used = row->key;
    return NULL;
}

static void *field(model_config *c, size_t off)
{
    return (char *)c + off;
}

static di_status read_integer(const json_t *v, const char *key, long idx, double lo, double hi,
                              double *out, di_error *err)
{
    char where[96];
    if (idx >= 0)
        snprintf(where, sizeof where, "key '%s'[%ld]", key, idx);
    else
        snprintf(where, sizeof where, "key '%s'", key);
    if (!json_is_integer(v))
        return di_fail(err, DI_EINVAL, "%s: expected an integer, got %s", where,
                       di_json_type_name(v));
    json_int_t x = json_integer_value(v);
    if ((double)x < lo || (double)x > hi)
        return di_fail(err, DI_EINVAL, "%s: %lld outside [%.0f, %.0f]", where, (long long)x, lo,
                       hi);
    *out = (double)x;
    return DI_OK;
}

static di_status read_list(model_config *c, const cfg_row *row, const json_t *v, const char *key,
                           di_error *err)
{
    if (!json_is_array(v))
        return di_fail(err, DI_EINVAL, "key '%s': expected an array, got %s", key,
                       di_json_type_name(v));
    size_t n = json_array_size(v);
    if (n > row->max_count)
        return di_fail(err, DI_EINVAL, "key '%s': %zu entries, at most %u supported", key, n,
                       row->max_count);
    for (size_t i = 0; i < n; i++) {
        double x;
        di_status st = read_integer(json_array_get(v, i), key, (long)i, row->lo, row->hi, &x, err);
        if (st != DI_OK)
            return st;
        if (row->type == CFG_U32_LIST)
            ((uint32_t *)field(c, row->offset))[i] = (uint32_t)x;
        else
            ((uint64_t *)field(c, row->offset))[i] = (uint64_t)x;
    }
    *(uint32_t *)field(c, row->aux) = (uint32_t)n;
    return DI_OK;
}

static di_status read_enum(model_config *c, const cfg_row *row, const json_t *v, const char *key,
                           di_error *err)
{
    if (!json_is_string(v))
        return di_fail(err, DI_EINVAL, "key '%s': expected a string, got %s", key,
                       di_json_type_name(v));
    const char *s = json_string_value(v);
    for (int i = 0; row->names[i]; i++) {
        if (strcmp(s, row->names[i]) == 0) {
            if (row->offset != NO_FIELD)
                *(int *)field(c, row->offset) = i;
            return DI_OK;
        }
    }
    char known[128] = "";
    for (int i = 0; row->names[i]; i++)
        snprintf(known + strlen(known), sizeof known - strlen(known), "%s%s", i ? ", " : "",
                 row->names[i]);
    return di_fail(err, DI_EUNSUPPORTED, "key '%s': '%s' not supported (supported: %s)", key, s,
                   known);
}

static di_status read_pair(model_config *c, const cfg_row *row, const json_t *v, const char *key,
                           di_error *err)
{
    if (!json_is_array(v) || json_array_size(v) != 2)
        return di_fail(err, DI_EINVAL, "key '%s': expected an array of 2 integers", key);
    for (size_t i = 0; i < 2; i++) {
        double x;
        di_status st = read_integer(json_array_get(v, i), key, (long)i, row->lo, row->hi, &x, err);
        if (st != DI_OK)
            return st;
        ((uint32_t *)field(c, row->offset))[i] = (uint32_t)x;
    }
    return DI_OK;
}

static di_status read_scalar(model_config *c, const cfg_row *row, const json_t *v,
                             const char *key, di_error *err)
{
    double x = 0;
    di_status st;
    switch (row->type) {
    case CFG_F64:
        if (!json_is_number(v))
            return di_fail(err, DI_EINVAL, "key '%s': expected a number, got %s", key,
                           di_json_type_name(v));
        x = json_number_value(v);
        if (!(x >= row->lo && x <= row->hi))
            return di_fail(err, DI_EINVAL, "key '%s': %g outside [%g, %g]", key, x, row->lo,
                           row->hi);
        *(double *)field(c, row->offset) = x;
        return DI_OK;
    case CFG_BOOL:
        if (!json_is_boolean(v))
            return di_fail(err, DI_EINVAL, "key '%s': expected true or false, got %s", key,
                           di_json_type_name(v));
        *(bool *)field(c, row->offset) = json_is_true(v);
        return DI_OK;
    default:
        break;
    }
    st = read_integer(v, key, -1, row->lo, row->hi, &x, err);
    if (st != DI_OK)
        return st;
    switch (row->type) {
    case CFG_U32: *(uint32_t *)field(c, row->offset) = (uint32_t)x; break;
    case CFG_I32: *(int32_t *)field(c, row->offset) = (int32_t)x; break;
    case CFG_U64: *(uint64_t *)field(c, row->offset) = (uint64_t)x; break;
    case CFG_U64_OPT:
        *(uint64_t *)field(c, row->offset) = (uint64_t)x;
        *(bool *)field(c, row->aux) = true;
        break;
    default: assert(0);
    }
    return DI_OK;
}

static di_status read_row(model_config *c, const cfg_row *row, const json_t *v, const char *key,
                          di_error *err)
{
    switch (row->type) {
    case CFG_U32_LIST:
    case CFG_U64_LIST: return read_list(c, row, v, key, err);
    case CFG_ENUM: return read_enum(c, row, v, key, err);
    case CFG_U32_PAIR: return read_pair(c, row, v, key, err);
    default: return read_scalar(c, row, v, key, err);
    }
}

static void set_default(model_config *c, const cfg_row *row)
{
    if (row->offset == NO_FIELD)
        return;
    switch (row->type) {
    case CFG_U32: *(uint32_t *)field(c, row->offset) = (uint32_t)row->def; break;
    case CFG_I32: *(int32_t *)field(c, row->offset) = (int32_t)row->def; break;
    case CFG_U64: *(uint64_t *)field(c, row->offset) = (uint64_t)row->def; break;
    case CFG_F64: *(double *)field(c, row->offset) = row->def; break;
    case CFG_BOOL: *(bool *)field(c, row->offset) = row->def != 0; break;
    case CFG_ENUM: *(int *)field(c, row->offset) = 0; break;
    case CFG_U32_LIST:
    case CFG_U64_LIST: *(uint32_t *)field(c, row->aux) = 0; break;
    case CFG_U64_OPT:
        *(uint64_t *)field(c, row->offset) = 0;
        *(bool *)field(c, row->aux) = false;
        break;
    case CFG_U32_PAIR:
        ((uint32_t *)field(c, row->offset))[0] = (uint32_t)row->def;
        ((uint32_t *)field(c, row->offset))[1] = (uint32_t)row->def;
        break;
    }
}

static bool need_applies(const model_config *c, cfg_need need)
{
    switch (need) {
    case NEED_ALWAYS: return true;
    case NEED_ENGRAM: return c->n_engram_layers > 0;
    case NEED_MTP: return c->n_mtp > 0;
    case NEED_CAND: return c->candidate_source_layer >= 0;
    default: return false;
    }
}

static const char *need_reason(cfg_need need)
{
    switch (need) {
    case NEED_ENGRAM: return " (required when engram_layer_ids is not empty)";
    case NEED_MTP: return " (required when num_nextn_predict_layers > 0)";
    case NEED_CAND: return " (required when candidate_source_layer_id is set)";
    default: return "";
    }
}

/* Pass 1 reads every present key (defaults for the rest); pass 2 reports missing required
 * keys, whose condition may depend on keys read in pass 1. */
static di_status read_rows(model_config *c, const json_t *root, const json_t *text,
                           di_error *err)
{
    bool present[N_ROWS];
    for (size_t i = 0; i < N_ROWS; i++) {
        const char *used;
        json_t *v = find_value(root, text, &k_rows[i], &used);
        present[i] = v != NULL;
        set_default(c, &k_rows[i]);
        if (v) {
            di_status st = read_row(c, &k_rows[i], v, used, err);
            if (st != DI_OK)
                return st;
        }
    }
    for (size_t i = 0; i < N_ROWS; i++)
        if (!present[i] && need_applies(c, k_rows[i].need))
            return di_fail(err, DI_EINVAL, "missing key '%s'%s", k_rows[i].key,
                           need_reason(k_rows[i].need));
    return DI_OK;
}

/* ---- consistency rules -------------------------------------------------------------------- */

static bool in_list(const uint32_t *list, uint32_t n, uint32_t x)
{
    for (uint32_t i = 0; i < n; i++)
        if (list[i] == x)
            return true;
    return false;
}

/* Largest entry of an ascending list that is <= x, or -1. */
static int32_t nearest_at_or_below(const uint32_t *list, uint32_t n, uint32_t x)
{
    int32_t best = -1;
    for (uint32_t i = 0; i < n && list[i] <= x; i++)
        best = (int32_t)list[i];
    return best;
}

static di_status check_ascending(const char *key, const uint32_t *list, uint32_t n,
                                 uint32_t limit, const char *limit_name, di_error *err)
{
    for (uint32_t i = 0; i < n; i++) {
        if (list[i] >= limit)
            return di_fail(err, DI_EINVAL, "%s: layer %u is not below %s %u", key, list[i],
                           limit_name, limit);
        if (i > 0 && list[i] <= list[i - 1])
            return di_fail(err, DI_EINVAL, "%s must be strictly ascending (%u after %u)", key,
                           list[i], list[i - 1]);
    }
    return DI_OK;
}

typedef struct width_rule {
    const char *what;  /* name in the message */
    uint64_t value;
} width_rule;

/* MODEL.md §5: every Linear input width and every quantised block row is a multiple of 32. */
static di_status check_widths(const model_config *c, di_error *err)
{
    if (c->n_heads % c->o_groups != 0)
        return di_fail(err, DI_EINVAL, "num_attention_heads %u is not divisible by o_groups %u",
                       c->n_heads, c->o_groups);
    const width_rule rules[] = {
        {"hidden_size", c->dim},
        {"q_lora_rank", c->q_lora_rank},
        {"head_dim", c->head_dim},
        {"index_head_dim", c->index_head_dim},
        {"moe_intermediate_size", c->moe_inter_dim},
        {"o_lora_rank", c->o_lora_rank},
        {"num_attention_heads * head_dim / o_groups (wo_a input)",
         (uint64_t)c->n_heads * c->head_dim / c->o_groups},
        {"engram_head_dim", c->n_engram_layers ? c->engram_head_dim : 32},
    };
    for (size_t i = 0; i < sizeof rules / sizeof rules[0]; i++)
        if (rules[i].value % 32 != 0)
            return di_fail(err, DI_EINVAL,
                           "%s %" PRIu64 " must be a multiple of 32 (FP8/FP4 block width)",
                           rules[i].what, rules[i].value);
    if (c->rope_head_dim % 2 != 0 || c->rope_head_dim > c->head_dim ||
        c->rope_head_dim > c->index_head_dim)
        return di_fail(err, DI_EINVAL,
                       "qk_rope_head_dim %u must be even and at most head_dim %u and "
                       "index_head_dim %u",
                       c->rope_head_dim, c->head_dim, c->index_head_dim);
    return DI_OK;
}

static di_status check_ratios(const model_config *c, di_error *err)
{
    uint32_t want = c->n_layers + c->n_mtp;
    if (c->n_compress_ratios != want)
        return di_fail(err, DI_EINVAL,
                       "compress_ratios has %u entries, expected %u (num_hidden_layers %u + "
                       "num_nextn_predict_layers %u)",
                       c->n_compress_ratios, want, c->n_layers, c->n_mtp);
    for (uint32_t l = 0; l < want; l++) {
        uint32_t r = c->compress_ratios[l];
        if (r != 0 && KV_BLOCK_TOKENS % r != 0)
            return di_fail(err, DI_EINVAL, "compress_ratios[%u] = %u does not divide the %u-token "
                           "block", l, r, KV_BLOCK_TOKENS);
        if (l >= c->n_layers && r != 0)
            return di_fail(err, DI_EINVAL,
                           "compress_ratios[%u] (draft stage %u) is %u, expected 0: draft stages "
                           "are window-only", l, l - c->n_layers, r);
    }
    return DI_OK;
}

static di_status check_source_lists(const model_config *c, di_error *err)
{
    di_status st = check_ascending("kv_source_layer_ids", c->kv_source_layers, c->n_kv_sources,
                                   c->n_layers, "num_hidden_layers", err);
    if (st == DI_OK)
        st = check_ascending("index_source_layer_ids", c->index_source_layers,
                             c->n_index_sources, c->n_layers, "num_hidden_layers", err);
    if (st != DI_OK)
        return st;
    for (uint32_t i = 0; i < c->n_kv_sources; i++) {
        uint32_t l = c->kv_source_layers[i];
        if (c->compress_ratios[l] == 0)
            return di_fail(err, DI_EINVAL,
                           "kv_source_layer_ids: layer %u has compress ratio 0 (window only); a "
                           "KV source needs ratio != 0", l);
        if (!in_list(c->index_source_layers, c->n_index_sources, l))
            return di_fail(err, DI_EINVAL,
                           "KV source layer %u is not in index_source_layer_ids: it owns the "
                           "index keys of its band", l);
    }
    for (uint32_t i = 0; i < c->n_index_sources; i++) {
        uint32_t l = c->index_source_layers[i];
        if (c->compress_ratios[l] == 0)
            return di_fail(err, DI_EINVAL,
                           "index_source_layer_ids: layer %u has compress ratio 0 (window only); "
                           "an index source needs ratio != 0", l);
    }
    return DI_OK;
}

static uint32_t first_ratio1_layer(const model_config *c)
{
    for (uint32_t l = 0; l < c->n_layers; l++)
        if (c->compress_ratios[l] == 1)
            return l;
    return c->n_layers;
}

/* Every ratio != 0 layer reads the nearest KV source at or below it; the group of a source
 * (it and its readers) must not contain the first ratio-1 layer unless the source is that
 * layer (YOCO); readers share the source's ratio. */
static di_status check_kv_groups(const model_config *c, uint32_t boundary, di_error *err)
{
    for (uint32_t l = 0; l < c->n_layers; l++) {
        uint32_t r = c->compress_ratios[l];
        if (r == 0)
            continue;
        int32_t src = nearest_at_or_below(c->kv_source_layers, c->n_kv_sources, l);
        if (src < 0)
            return di_fail(err, DI_EINVAL,
                           "layer %u has compress ratio %u but no KV source at or below it "
                           "(kv_source_layer_ids)", l, r);
        if ((uint32_t)src < boundary && l >= boundary)
            return di_fail(err, DI_EINVAL,
                           "layer %u reads KV source layer %u across the YOCO boundary at layer "
                           "%u (the first ratio-1 layer): a KV-sharing group must not cross it; "
                           "make layer %u a KV source", l, src, boundary, boundary);
        if (c->compress_ratios[src] != r)
            return di_fail(err, DI_EINVAL,
                           "layer %u has compress ratio %u but reads KV source layer %d of ratio "
                           "%u", l, r, src, c->compress_ratios[src]);
    }
    return DI_OK;
}

static di_status check_candidates(const model_config *c, di_error *err)
{
    int32_t cs = c->candidate_source_layer;
    if (cs >= 0) {
        if ((uint32_t)cs >= c->n_layers || !in_list(c->kv_source_layers, c->n_kv_sources,
                                                    (uint32_t)cs))
            return di_fail(err, DI_EINVAL,
                           "candidate_source_layer_id %d must be a KV source layer", cs);
        uint64_t cand = (uint64_t)c->candidate_topk_blocks * c->candidate_block_size;
        if (cand < c->index_topk)
            return di_fail(err, DI_EINVAL,
                           "candidate_topk_blocks %u * candidate_block_size %u = %" PRIu64
                           " is below index_topk %u",
                           c->candidate_topk_blocks, c->candidate_block_size, cand,
                           c->index_topk);
    }
    for (uint32_t i = 0; i < c->n_index_sources; i++) {
        uint32_t l = c->index_source_layers[i];
        if (in_list(c->kv_source_layers, c->n_kv_sources, l))
            continue;
        int32_t src = nearest_at_or_below(c->kv_source_layers, c->n_kv_sources, l);
        if (cs < 0 || src != cs)
            return di_fail(err, DI_EINVAL,
                           "index source layer %u is not a KV source and does not lie in the "
                           "band of candidate_source_layer_id %d: a re-indexing layer scores "
                           "only inside published candidate blocks", l, cs);
    }
    return DI_OK;
}

static di_status check_engram(model_config *c, di_error *err)
{
    if (c->n_engram_layers == 0)
        return DI_OK;
    di_status st = check_ascending("engram_layer_ids", c->engram_layer_ids, c->n_engram_layers,
                                   c->n_layers, "num_hidden_layers", err);
    if (st != DI_OK)
        return st;
    if (c->n_engram_num_embeddings != c->n_engram_layers)
        return di_fail(err, DI_EINVAL,
                       "engram_num_embeddings has %u entries, expected %u (one per "
                       "engram_layer_ids entry)", c->n_engram_num_embeddings,
                       c->n_engram_layers);
    if (c->engram_pad_id >= c->engram_compressed_vocab_size)
        return di_fail(err, DI_EINVAL,
                       "engram_pad_token_id %u is not below engram_compressed_vocab_size %u",
                       c->engram_pad_id, c->engram_compressed_vocab_size);
    uint32_t orders = c->engram_max_ngram_size - 1;
    st = model_engram_primes(c->n_engram_layers, orders, c->engram_n_heads, c->engram_vocab_size,
                             c->engram_primes, err);
    if (st != DI_OK)
        return st;
    uint32_t cols = orders * c->engram_n_heads;
    for (uint32_t k = 0; k < c->n_engram_layers; k++) {
        uint64_t sum = 0;
        for (uint32_t j = 0; j < cols; j++) {
            c->engram_offsets[k][j] = sum;
            sum += c->engram_primes[k][j];
        }
        if (sum != c->engram_num_embeddings[k])
            return di_fail(err, DI_EINVAL,
                           "engram_num_embeddings[%u] is %" PRIu64 ", but the prime search from "
                           "engram_vocab_size %" PRIu64 " gives %" PRIu64 " rows for layer %u",
                           k, c->engram_num_embeddings[k], c->engram_vocab_size, sum,
                           c->engram_layer_ids[k]);
    }
    c->engram_cols = cols;
    return DI_OK;
}

static di_status check_tokens_and_moe(const model_config *c, di_error *err)
{
    const struct {
        const char *key;
        uint32_t id;
    } ids[] = {
        {"bos_token_id", c->bos_token_id},
        {"eos_token_id", c->eos_token_id},
        {"pad_token_id", c->pad_token_id},
        {"dspark_noise_token_id", c->n_mtp ? c->dspark_noise_token_id : 0},
    };
    for (size_t i = 0; i < sizeof ids / sizeof ids[0]; i++)
        if (ids[i].id >= c->vocab_size)
            return di_fail(err, DI_EINVAL, "%s %u is not below vocab_size %u", ids[i].key,
                           ids[i].id, c->vocab_size);
    if (c->n_activated_experts > c->n_routed_experts)
        return di_fail(err, DI_EINVAL, "num_experts_per_tok %u exceeds n_routed_experts %u",
                       c->n_activated_experts, c->n_routed_experts);
    if (c->n_mtp == 0)
        return DI_OK;
    if (c->dspark_n_activated_experts > c->dspark_n_routed_experts)
        return di_fail(err, DI_EINVAL,
                       "dspark_num_experts_per_tok %u exceeds dspark_n_routed_experts %u",
                       c->dspark_n_activated_experts, c->dspark_n_routed_experts);
    if (c->n_dspark_targets == 0)
        return di_fail(err, DI_EINVAL, "dspark_target_layer_ids is empty");
    return check_ascending("dspark_target_layer_ids", c->dspark_target_layers,
                           c->n_dspark_targets, c->n_layers, "num_hidden_layers", err);
}

/* Fills roles[] (MODEL.md §0.1) from checked lists. */
static void derive_roles(model_config *c)
{
    memset(c->roles, 0, sizeof c->roles);
    for (uint32_t l = 0; l < c->n_layers + c->n_mtp; l++) {
        model_layer_role *ro = &c->roles[l];
        bool backbone = l < c->n_layers;
        ro->ratio = c->compress_ratios[l];
        ro->kv_source = ro->kv_owner = ro->index_source = ro->index_key_source = -1;
        ro->engram = ro->draft_tap = -1;
        ro->yarn = ro->ratio != 0;
        if (!backbone)
            continue;
        for (uint32_t k = 0; k < c->n_engram_layers; k++)
            if (c->engram_layer_ids[k] == l)
                ro->engram = (int32_t)k;
        for (uint32_t k = 0; k < c->n_dspark_targets && c->n_mtp; k++)
            if (c->dspark_target_layers[k] == l)
                ro->draft_tap = (int32_t)k;
        if (ro->ratio == 0)
            continue;
        ro->kv_source = nearest_at_or_below(c->kv_source_layers, c->n_kv_sources, l);
        for (uint32_t k = 0; k < c->n_kv_sources; k++)
            if ((int32_t)c->kv_source_layers[k] == ro->kv_source)
                ro->kv_owner = (int32_t)k;
        ro->index_source = nearest_at_or_below(c->index_source_layers, c->n_index_sources, l);
        ro->owns_compressor = ro->kv_source == (int32_t)l;
        ro->owns_index_keys = ro->owns_compressor;
        ro->owns_indexer = ro->index_source == (int32_t)l;
        ro->index_key_source = ro->owns_indexer ? ro->kv_source : -1;
        ro->publishes_candidates = c->candidate_source_layer == (int32_t)l;
        ro->uses_candidates = ro->owns_indexer && !ro->owns_index_keys;
        assert(ro->index_source >= ro->kv_source);
    }
}

di_status model_config_validate(model_config *cfg, di_error *err)
{
    if (!cfg)
        return di_fail(err, DI_EINVAL, "config is NULL");
    model_config c = *cfg;
    di_status st = check_widths(&c, err);
    if (st == DI_OK)
        st = check_ratios(&c, err);
    if (st == DI_OK)
        st = check_source_lists(&c, err);
    uint32_t boundary = first_ratio1_layer(&c);
    if (st == DI_OK)
        st = check_kv_groups(&c, boundary, err);
    if (st == DI_OK)
        st = check_candidates(&c, err);
    if (st == DI_OK)
        st = check_engram(&c, err);
    if (st == DI_OK)
        st = check_tokens_and_moe(&c, err);
    if (st != DI_OK)
        return st;
    c.yoco_boundary = boundary;
    derive_roles(&c);
    for (uint32_t k = 0; k < c.n_engram_layers; k++)
        model_engram_multipliers(c.engram_layer_ids[k], c.engram_compressed_vocab_size,
                                 c.engram_max_ngram_size, c.engram_multipliers[k]);
    c.model_id = model_config_fingerprint(&c);
    kv_geometry g;
    model_config_kv_geometry(&c, c.dspark_block_size, &g);
    st = kv_geometry_validate(&g, err);
    if (st != DI_OK) {
        di_error_prefix(err, "KV geometry of the config: ");
        return st;
    }
    *cfg = c;
    return DI_OK;
}

/* ---- parsing entry points ----------------------------------------------------------------- */

di_status model_config_from_json(const json_t *root, const char *name, model_config *out,
                                 di_error *err)
{
    if (!root || !out)
        return di_fail(err, DI_EINVAL, "config JSON and output must not be NULL");
    if (!json_is_object(root))
        return di_fail(err, DI_EINVAL, "config: expected a JSON object, got %s",
                       di_json_type_name(root));
    const json_t *text = json_object_get(root, "text_config");
    if (text && !json_is_object(text))
        return di_fail(err, DI_EINVAL, "key 'text_config': expected an object, got %s",
                       di_json_type_name(text));
    model_config *c = calloc(1, sizeof *c);
    if (!c)
        return di_fail(err, DI_ENOMEM, "config: out of memory");
    snprintf(c->name, sizeof c->name, "%s", name ? name : "");
    di_status st = read_rows(c, root, text, err);
    if (st == DI_OK)
        st = model_config_validate(c, err);
    if (st == DI_OK)
        *out = *c;
    free(c);
    return st;
}

di_status model_config_parse(const char *text, size_t len, const char *name, model_config *out,
                             di_error *err)
{
    if (!text)
        return di_fail(err, DI_EINVAL, "config text is NULL");
    json_t *root = NULL;
    di_status st = di_json_parse(text, len, name ? name : "config", &root, err);
    if (st != DI_OK)
        return st;
    st = model_config_from_json(root, name, out, err);
    json_decref(root);
    return st;
}

/* The last path component, for the config's name. */
static const char *path_tail(const char *path)
{
    const char *s = strrchr(path, '/');
    return s && s[1] ? s + 1 : path;
}

di_status model_config_load(const char *path, model_config *out, di_error *err)
{
    if (!path || !out)
        return di_fail(err, DI_EINVAL, "config path and output must not be NULL");
    struct stat sb;
    if (stat(path, &sb) != 0)
        return di_fail(err, errno == ENOENT ? DI_ENOENT : DI_EIO, "config %s: %s", path,
                       strerror(errno));
    char file[4096];
    if (S_ISDIR(sb.st_mode))
        snprintf(file, sizeof file, "%s/config.json", path);
    else
        snprintf(file, sizeof file, "%s", path);
    if (S_ISDIR(sb.st_mode) && stat(file, &sb) != 0)
        return di_fail(err, errno == ENOENT ? DI_ENOENT : DI_EIO, "config %s: %s", file,
                       strerror(errno));
    if (!S_ISREG(sb.st_mode)) /* a FIFO would block, a device never ends */
        return di_fail(err, DI_EINVAL, "config %s: not a regular file", file);
    json_t *root = NULL;
    di_status st = di_json_load_file(file, &root, err);
    if (st != DI_OK)
        return st;
    st = model_config_from_json(root, path_tail(path), out, err);
    json_decref(root);
    if (st != DI_OK)
        di_error_prefix(err, "%s: ", file);
    return st;
}

const char *const *model_config_builtin_names(void)
{
    return model_config_builtin_name_list;
}

const char *model_config_builtin_json(const char *name)
{
    if (!name)
        return NULL;
    for (size_t i = 0; i < model_config_builtin_count; i++)
        if (strcmp(name, model_config_builtins[i].name) == 0)
            return model_config_builtins[i].json;
    return NULL;
}

di_status model_config_builtin(const char *name, model_config *out, di_error *err)
{
    const char *json = model_config_builtin_json(name);
    if (!json)
        return di_fail(err, DI_ENOENT, "no shipped config named '%s' (known: %s)",
                       name ? name : "(null)", model_config_builtin_known);
    return model_config_parse(json, strlen(json), name, out, err);
}

di_status model_config_resolve(const char *name_or_path, model_config *out, di_error *err)
{
    if (!name_or_path)
        return di_fail(err, DI_EINVAL, "config name is NULL");
    if (model_config_builtin_json(name_or_path))
        return model_config_builtin(name_or_path, out, err);
    di_status st = model_config_load(name_or_path, out, err);
    if (st == DI_ENOENT)
        return di_fail(err, DI_ENOENT, "'%s' is neither a shipped config (%s) nor a config file "
                       "or directory", name_or_path, model_config_builtin_known);
    return st;
}

/* ---- writing ------------------------------------------------------------------------------ */

static json_t *row_value(const model_config *c, const cfg_row *row)
{
    const void *f = row->offset == NO_FIELD ? NULL : (const char *)c + row->offset;
    switch (row->type) {
    case CFG_U32: return json_integer(*(const uint32_t *)f);
    case CFG_I32: return json_integer(*(const int32_t *)f);
    case CFG_U64:
    case CFG_U64_OPT: return json_integer((json_int_t) * (const uint64_t *)f);
    case CFG_F64: return json_real(*(const double *)f);
    case CFG_BOOL: return json_boolean(*(const bool *)f);
    case CFG_ENUM: return json_string(row->names[f ? *(const int *)f : 0]);
    case CFG_U32_PAIR: return json_pack("[ii]", ((const uint32_t *)f)[0], ((const uint32_t *)f)[1]);
    case CFG_U32_LIST:
    case CFG_U64_LIST: {
        json_t *a = json_array();
        uint32_t n = *(const uint32_t *)((const char *)c + row->aux);
        for (uint32_t i = 0; a && i < n; i++) {
            json_int_t x = row->type == CFG_U32_LIST ? ((const uint32_t *)f)[i]
                                                     : (json_int_t)((const uint64_t *)f)[i];
            json_array_append_new(a, json_integer(x));
        }
        return a;
    }
    }
    return NULL;
}

static bool row_omitted(const model_config *c, const cfg_row *row)
{
    if (!(row->flags & F_OMIT))
        return false;
    const void *f = (const char *)c + row->offset;
    switch (row->type) {
    case CFG_I32: return *(const int32_t *)f == (int32_t)row->def;
    case CFG_F64: return *(const double *)f == row->def;
    case CFG_U64_OPT: return !*(const bool *)((const char *)c + row->aux);
    default: return false;
    }
}

/* Sets obj[path] (one dot allowed), creating the inner object. Steals v. */
static int set_path(json_t *obj, const char *path, json_t *v)
{
    const char *dot = strchr(path, '.');
    if (!dot)
        return json_object_set_new(obj, path, v);
    char head[64];
    size_t n = (size_t)(dot - path);
    assert(n < sizeof head);
    memcpy(head, path, n);
    head[n] = '\0';
    json_t *inner = json_object_get(obj, head);
    if (!inner) {
        inner = json_object();
        if (!inner || json_object_set_new(obj, head, inner) != 0) {
            json_decref(v);
            return -1;
        }
    }
    return json_object_set_new(inner, dot + 1, v);
}

json_t *model_config_to_json(const model_config *cfg)
{
    json_t *root = json_pack("{s:[s],s:s,s:s}", "architectures", "DeepseekV41ForCausalLM",
                             "model_type", "deepseek_v41", "dtype", "bfloat16");
    json_t *text = json_object();
    if (!root || !text || json_object_set(root, "text_config", text) != 0)
        goto fail;
    for (size_t i = 0; i < N_ROWS; i++) {
        const cfg_row *row = &k_rows[i];
        if (row_omitted(cfg, row))
            continue;
        json_t *v = row_value(cfg, row);
        if (!v || set_path(row->flags & F_TOP ? root : text, row->key, v) != 0)
            goto fail;
    }
    json_decref(text);
    return root;
fail:
    json_decref(text);
    json_decref(root);
    return NULL;
}

/* ---- derived views ------------------------------------------------------------------------ */

void model_config_kv_geometry(const model_config *cfg, uint32_t nextn, kv_geometry *out)
{
    model_config_kv_geometry_yoco(cfg, nextn, KV_YOCO_DEFAULT, out);
}

void model_config_kv_geometry_yoco(const model_config *cfg, uint32_t nextn, uint32_t yoco,
                                   kv_geometry *out)
{
    kv_geometry g;
    memset(&g, 0, sizeof g);
    g.block_tokens = KV_BLOCK_TOKENS;
    g.head_dim = cfg->head_dim;
    g.index_head_dim = cfg->index_head_dim;
    g.window = cfg->window;
    g.ring_positions = kv_ring_positions_for(cfg->window, nextn, 0);
    g.n_layers = cfg->n_layers;
    g.n_draft_stages = cfg->n_mtp;
    g.n_owners = cfg->n_kv_sources;
    for (uint32_t k = 0; k < cfg->n_kv_sources && k < KV_MAX_OWNERS; k++) {
        g.owner_layer[k] = cfg->kv_source_layers[k];
        g.owner_ratio[k] = cfg->compress_ratios[cfg->kv_source_layers[k]];
    }
    g.yoco_boundary = first_ratio1_layer(cfg);
    g.model_id = kv_model_id(cfg->model_id, yoco);
    *out = g;
}

/* Appends bytes to a bounded buffer; the fingerprint input. */
typedef struct fp_buf {
    uint8_t bytes[8192];
    size_t n;
} fp_buf;

static void fp_put(fp_buf *b, const void *p, size_t len)
{
    assert(b->n + len <= sizeof b->bytes);
    memcpy(b->bytes + b->n, p, len);
    b->n += len;
}

static void fp_u64(fp_buf *b, uint64_t x)
{
    uint8_t le[8];
    for (int i = 0; i < 8; i++)
        le[i] = (uint8_t)(x >> (8 * i));
    fp_put(b, le, 8);
}

static uint64_t row_u64(const model_config *c, const cfg_row *row, uint32_t i)
{
    const char *f = (const char *)c + row->offset;
    double d;
    uint64_t u;
    switch (row->type) {
    case CFG_U32: return *(const uint32_t *)f;
    case CFG_I32: return (uint64_t)(int64_t) * (const int32_t *)f;
    case CFG_U64: return *(const uint64_t *)f;
    case CFG_U64_OPT: return *(const bool *)((const char *)c + row->aux) ? *(const uint64_t *)f
                                                                         : ~0ull;
    case CFG_F64:
        d = *(const double *)f;
        memcpy(&u, &d, 8);
        return u;
    case CFG_BOOL: return *(const bool *)f;
    case CFG_ENUM: return (uint64_t) * (const int *)f;
    case CFG_U32_PAIR:
    case CFG_U32_LIST: return ((const uint32_t *)f)[i];
    case CFG_U64_LIST: return ((const uint64_t *)f)[i];
    }
    return 0;
}

uint64_t model_config_fingerprint(const model_config *cfg)
{
    fp_buf *b = calloc(1, sizeof *b);
    if (!b)
        return 0;
    for (size_t i = 0; i < N_ROWS; i++) {
        const cfg_row *row = &k_rows[i];
        if (!(row->flags & F_ID))
            continue;
        fp_put(b, row->key, strlen(row->key) + 1);
        uint32_t n = 1;
        if (row->type == CFG_U32_LIST || row->type == CFG_U64_LIST)
            n = *(const uint32_t *)((const char *)cfg + row->aux);
        else if (row->type == CFG_U32_PAIR)
            n = 2;
        fp_u64(b, n);
        for (uint32_t k = 0; k < n; k++)
            fp_u64(b, row_u64(cfg, row, k));
    }
    uint64_t id = di_hash64(b->bytes, b->n, 0x6469636f6e666967ull /* "diconfig" */);
    free(b);
    return id;
}

uint64_t model_config_id_with_weights(const model_config *cfg,
                                      const uint8_t weights_fingerprint[32])
{
    uint8_t in[8 + 32];
    uint64_t config_id = model_config_fingerprint(cfg);
    for (int i = 0; i < 8; i++)
        in[i] = (uint8_t)(config_id >> (8 * i));
    memcpy(in + 8, weights_fingerprint, 32);
    return di_hash64(in, sizeof in, 0x6469776569676874ull /* "diweight" */);
}

int32_t model_config_engram_slot(const model_config *cfg, uint32_t layer)
{
    for (uint32_t k = 0; k < cfg->n_engram_layers; k++)
        if (cfg->engram_layer_ids[k] == layer)
            return (int32_t)k;
    return -1;
}
