/* config.h: the model's configuration as one validated struct (MODEL.md §0, §0.1, §7.3).
 *
 * A config comes from an HF-style config.json: the released nested layout (top level with
 * `text_config`, `quantization_config`, token ids; `vision_config` ignored) or a flat file with
 * the same HF key names (our small configs). The reference's flat ModelArgs names (dim,
 * n_layers, ...) are accepted as aliases. One table of rows (key, type, field offset, default,
 * bounds, required) drives parsing, defaults, validation messages, writing and the model id.
 *
 * After parsing, model_config_validate() checks cross-key consistency and fills the derived
 * part of the struct: the per-layer roles table (MODEL.md §0.1), the YOCO boundary, the Engram
 * prime tables and hash multipliers (MODEL.md §2.9) and the model id.
 *
 * Shipped configs are compiled into the library and usable by name: "v41-flash" (the released
 * geometry), "tiny" and "small" (every structural feature at CPU-test size; see
 * common/model/configs/README.md).
 *
 * Terms (MODEL.md §0.1): "ratio" = compression ratio of a layer's long-range path (0 = window
 * only; 1 = one entry per token; 2 = pairs pooled). "KV source"/"owner" = computes the
 * compressed KV and the index keys of its band; "index source" = runs its own indexer query
 * side; "reuse" = reads the nearest source at or below it.
 */
#ifndef DI_MODEL_CONFIG_H
#define DI_MODEL_CONFIG_H

#include <jansson.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/kvfmt/kv_layout.h"
#include "common/util/status.h"

#define MODEL_MAX_LAYERS 128u        /* backbone layers */
#define MODEL_MAX_MTP 8u             /* draft (DSpark) stages */
#define MODEL_MAX_ENTRIES (MODEL_MAX_LAYERS + MODEL_MAX_MTP) /* compress_ratios entries */
#define MODEL_MAX_ENGRAM_LAYERS 4u   /* layers with an Engram module */
#define MODEL_MAX_NGRAM 5u           /* largest engram_max_ngram_size (orders 2..5) */
#define MODEL_MAX_ENGRAM_HEADS 16u   /* engram_n_heads */
#define MODEL_MAX_ENGRAM_COLS ((MODEL_MAX_NGRAM - 1u) * MODEL_MAX_ENGRAM_HEADS) /* hash columns */
#define MODEL_MAX_DRAFT_TAPS 8u      /* dspark_target_layer_ids */
#define MODEL_NAME_MAX 64u

/* Routing score function (scoring_func). Only sqrtsoftplus is implemented. */
typedef enum model_score_func {
    MODEL_SCORE_SQRTSOFTPLUS = 0, /* score = sqrt(softplus(logit)) */
} model_score_func;

/* Storage format of routed experts (quantization_config.expert_dtype). */
typedef enum model_expert_dtype {
    MODEL_EXPERT_FP4 = 0, /* E2M1 packed in I8, low nibble first, UE8M0 scale per 1x32 */
} model_expert_dtype;

/* quantization_config. Only the released scheme is accepted (anything else: DI_EUNSUPPORTED). */
typedef struct model_quant {
    uint32_t weight_block_rows;    /* FP8 weight scale block, rows; 32 */
    uint32_t weight_block_cols;    /* FP8 weight scale block, columns; 32 */
    model_expert_dtype expert;     /* routed-expert storage; FP4 */
} model_quant;

/* What one layer (backbone layer or draft stage) does, derived from the config (MODEL.md
 * §0.1). Written by model_config_validate(); read by the forward and the loader. */
typedef struct model_layer_role {
    uint32_t ratio;            /* compress ratio: 0 window only; 1 per token; 2 pairs */
    int32_t kv_source;         /* layer whose compressed KV (and index keys) this layer reads:
                                  the nearest KV source at or below it; -1 when ratio is 0 */
    int32_t kv_owner;          /* index of kv_source in kv_geometry.owner_layer[]; -1 */
    int32_t index_source;      /* layer whose top-k list this layer uses: the nearest index
                                  source at or below it; -1 when ratio is 0 */
    int32_t index_key_source;  /* layer whose index keys its indexer scores (= kv_source) when
                                  the layer owns an indexer; -1 otherwise */
    bool owns_compressor;      /* computes the band's compressed KV (layer is a KV source) */
    bool owns_index_keys;      /* computes index keys (indexer wk, k_norm): KV sources */
    bool owns_indexer;         /* runs its own indexer query side (wq_b, weights_proj) */
    bool publishes_candidates; /* the candidate source: publishes candidate blocks */
    bool uses_candidates;      /* its indexer scores only inside the candidate blocks */
    bool yarn;                 /* RoPE with compress_rope_theta and YaRN (ratio != 0) */
    int32_t engram;            /* slot in engram_layer_ids of the Engram module in front of
                                  this layer; -1 none */
    int32_t draft_tap;         /* slot in dspark_target_layer_ids: this layer's input is
                                  recorded for the draft model; -1 none */
} model_layer_role;

/* The whole configuration. Parsed fields carry the HF key name in their comment; "derived"
 * fields are written by model_config_validate(). Widths are counts of numbers. */
typedef struct model_config {
    char name[MODEL_NAME_MAX];          /* shipped name or file path tail; informational */

    /* ---- vocabulary and special tokens ---- */
    uint32_t vocab_size;                /* vocab_size; 129280 */
    uint32_t bos_token_id;              /* bos_token_id; 0 */
    uint32_t eos_token_id;              /* eos_token_id; 1 */
    uint32_t pad_token_id;              /* pad_token_id; 2 */
    int32_t image_token_id;             /* image_token_id; -1 when absent (text engine ignores) */

    /* ---- trunk ---- */
    uint32_t dim;                       /* hidden_size; 5120 */
    uint32_t n_layers;                  /* num_hidden_layers; 40 */
    uint32_t n_mtp;                     /* num_nextn_predict_layers: draft stages; 3 */
    uint32_t n_heads;                   /* num_attention_heads; 64 */
    uint32_t n_kv_heads;                /* num_key_value_heads; must be 1 */
    uint32_t head_dim;                  /* head_dim; 512 (no-RoPE part + RoPE part) */
    uint32_t rope_head_dim;             /* qk_rope_head_dim: RoPE on the LAST this many; 64 */
    uint32_t q_lora_rank;               /* q_lora_rank; 1280 */
    uint32_t o_groups;                  /* o_groups; 8 */
    uint32_t o_lora_rank;               /* o_lora_rank; 1024 */
    uint32_t window;                    /* sliding_window: window positions incl. self; 128 */
    uint64_t max_position_embeddings;   /* max_position_embeddings; 1048576 */
    double norm_eps;                    /* rms_norm_eps; 1e-20 */

    /* ---- compression, indexer, candidates ---- */
    uint32_t n_compress_ratios;         /* entries in compress_ratios = n_layers + n_mtp */
    uint32_t compress_ratios[MODEL_MAX_ENTRIES]; /* compress_ratios; layers then draft stages */
    uint32_t n_kv_sources;              /* entries in kv_source_layers */
    uint32_t kv_source_layers[KV_MAX_OWNERS]; /* kv_source_layer_ids, ascending; 2 8 14 20 */
    uint32_t n_index_sources;           /* entries in index_source_layers */
    uint32_t index_source_layers[MODEL_MAX_LAYERS]; /* index_source_layer_ids, ascending */
    int32_t candidate_source_layer;     /* candidate_source_layer_id; 20; -1 = none */
    uint32_t candidate_topk_blocks;     /* candidate_topk_blocks; 2048 */
    uint32_t candidate_block_size;      /* candidate_block_size (entries per block); 8 */
    uint32_t index_n_heads;             /* index_n_heads; 32 */
    uint32_t index_head_dim;            /* index_head_dim; 128 */
    uint32_t index_topk;                /* index_topk: long-range entries per query; 512 */

    /* ---- RoPE ---- */
    double rope_theta;                  /* rope_theta: ratio-0 layers and draft stages; 1e4 */
    double compress_rope_theta;         /* compress_rope_theta: ratio != 0 layers; 1.6e5 */
    double rope_factor;                 /* rope_scaling.factor (YaRN); 16 */
    uint64_t original_seq_len;          /* rope_scaling.original_max_position_embeddings; 65536 */
    double beta_fast;                   /* rope_scaling.beta_fast; 32 */
    double beta_slow;                   /* rope_scaling.beta_slow; 1 */

    /* ---- MoE ---- */
    uint32_t n_routed_experts;          /* n_routed_experts; 384 */
    uint32_t n_activated_experts;       /* num_experts_per_tok; 6 */
    uint32_t n_shared_experts;          /* n_shared_experts; 1 */
    uint32_t moe_inter_dim;             /* moe_intermediate_size; 2304 */
    model_score_func score_func;        /* scoring_func; sqrtsoftplus */
    bool norm_topk_prob;                /* norm_topk_prob; true */
    double route_scale;                 /* routed_scaling_factor; 1.5 */
    double gate_temp;                   /* gate_temp: logits divided by it; 1.0 */
    double swiglu_limit;                /* swiglu_limit: SwiGLU clamp; 10 */

    /* ---- manifold-constrained hyper-connections ---- */
    uint32_t hc_mult;                   /* hc_mult: residual copies; must be 4 */
    uint32_t hc_sinkhorn_iters;         /* hc_sinkhorn_iters; 20 */
    double hc_eps;                      /* hc_eps; 1e-6 */

    /* ---- Engram ---- */
    uint32_t n_engram_layers;           /* entries in engram_layer_ids (0 = no Engram) */
    uint32_t engram_layer_ids[MODEL_MAX_ENGRAM_LAYERS]; /* engram_layer_ids, ascending; 1 14 */
    uint32_t n_engram_num_embeddings;   /* entries in engram_num_embeddings (= n_engram_layers) */
    uint64_t engram_num_embeddings[MODEL_MAX_ENGRAM_LAYERS]; /* engram_num_embeddings: table
                                           rows per Engram layer (= sum of its primes) */
    uint32_t engram_max_ngram_size;     /* engram_max_ngram_size; 4 (orders 2..4) */
    uint32_t engram_n_heads;            /* engram_n_heads; 8 */
    uint32_t engram_head_dim;           /* engram_head_dim: table row width; 256 */
    uint64_t engram_vocab_size;         /* engram_vocab_size: prime search start; 16000000 */
    uint32_t engram_compressed_vocab_size; /* engram_compressed_vocab_size; 99092 */
    uint32_t engram_pad_id;             /* engram_pad_token_id; 2 */
    bool has_engram_table_seed;         /* extension key engram_table_seed present */
    uint64_t engram_table_seed;         /* engram_table_seed (our extension): the checkpoint has
                                           no table tensors; rows are generated from this seed */

    /* ---- DSpark draft model ---- */
    uint32_t dspark_block_size;         /* dspark_block_size: drafts per step; 5 */
    uint32_t dspark_noise_token_id;     /* dspark_noise_token_id; 128799 */
    uint32_t n_dspark_targets;          /* entries in dspark_target_layers */
    uint32_t dspark_target_layers[MODEL_MAX_DRAFT_TAPS]; /* dspark_target_layer_ids; 37 38 39 */
    uint32_t dspark_markov_rank;        /* dspark_markov_rank; 256 */
    uint32_t dspark_n_routed_experts;   /* dspark_n_routed_experts; 128 */
    uint32_t dspark_n_activated_experts; /* dspark_num_experts_per_tok; 3 */

    /* ---- quantization_config ---- */
    model_quant quant;

    /* ---- derived by model_config_validate() ---- */
    uint32_t yoco_boundary;             /* first ratio-1 layer (n_layers when none): KV-sharing
                                           groups never cross it; rings below it persist */
    model_layer_role roles[MODEL_MAX_ENTRIES]; /* [n_layers + n_mtp]: layers then stages */
    uint32_t engram_cols;               /* hash columns per Engram layer:
                                           (engram_max_ngram_size - 1) * engram_n_heads; 24 */
    uint64_t engram_primes[MODEL_MAX_ENGRAM_LAYERS][MODEL_MAX_ENGRAM_COLS];
                                        /* [layer slot][(order - 2) * n_heads + head]: bucket
                                           count P of each hash column (MODEL.md §2.9) */
    uint64_t engram_offsets[MODEL_MAX_ENGRAM_LAYERS][MODEL_MAX_ENGRAM_COLS];
                                        /* first table row of each column: running sums of the
                                           layer's primes (0 for column 0) */
    uint64_t engram_multipliers[MODEL_MAX_ENGRAM_LAYERS][MODEL_MAX_NGRAM];
                                        /* [layer slot][lookback s]: odd hash multipliers, NumPy
                                           default_rng(10007 * layer_id) as the reference draws
                                           them; only s < engram_max_ngram_size used */
    uint64_t model_id;                  /* what the model computes: after parsing, the
                                           fingerprint of every math-relevant key (not the
                                           token ids, the name or engram_table_seed);
                                           model_weights_load mixes in the weights
                                           fingerprint (model_config_id_with_weights), so a
                                           fine-tune with the same config gets another id.
                                           Stable across runs */
} model_config;

/* ---- parsing ---- */

/* Parses a config JSON object (nested HF layout or flat) into *out and validates it
 * (model_config_validate). name is copied into out->name (may be NULL).
 * Returns DI_OK; DI_EINVAL with the key and what was expected ("missing key 'hidden_size'",
 * "key 'head_dim': expected an integer, got string", "key 'num_hidden_layers': 0 outside
 * [1, 128]") or the failed consistency rule; DI_EUNSUPPORTED for a recognised but
 * unimplemented setting (scoring_func softmax, expert_dtype fp8). *out untouched on failure. */
di_status model_config_from_json(const json_t *root, const char *name, model_config *out,
                                 di_error *err);
/* Same from text (len bytes). Parse errors give the line and column. */
di_status model_config_parse(const char *text, size_t len, const char *name, model_config *out,
                             di_error *err);
/* Same from a file path, or from a directory holding config.json. DI_ENOENT when missing,
 * DI_EINVAL when it is not a regular file (a FIFO, a device). */
di_status model_config_load(const char *path, model_config *out, di_error *err);
/* A shipped config by name ("v41-flash", "tiny", "small"). DI_ENOENT for other names (the
 * message lists the known ones). */
di_status model_config_builtin(const char *name, model_config *out, di_error *err);
/* A shipped name, else a file or a directory with config.json. */
di_status model_config_resolve(const char *name_or_path, model_config *out, di_error *err);

/* The shipped configs: names (NULL-terminated list) and the JSON text of one (NULL when the
 * name is unknown). Static data, never freed. */
const char *const *model_config_builtin_names(void);
const char *model_config_builtin_json(const char *name);

/* Checks every consistency rule and fills the derived fields (yoco_boundary, roles,
 * engram_cols/primes/offsets/multipliers, model_id). Rules: dims positive; the MODEL.md §5
 * multiple-of-32 widths; n_kv_heads 1; rope_head_dim even and <= head_dim and
 * <= index_head_dim; n_heads divisible by o_groups; compress_ratios has n_layers + n_mtp
 * entries in {0, 1, 2}, draft stages 0; every ratio divides 128; source lists ascending and
 * inside the backbone; every KV source is an index source with ratio != 0; every ratio != 0
 * layer has a KV source at or below it with the same ratio and an index source at or below it
 * in the same band; a KV-sharing group never crosses the first ratio-1 layer (YOCO); an index
 * source that is not a KV source uses candidate blocks (it lies above the candidate source in
 * its band); the candidate source is a KV source with ratio != 0;
 * candidate_topk_blocks * candidate_block_size >= index_topk; hc_mult 4; Engram layers inside
 * the backbone, engram_num_embeddings equal to the sums of the searched primes, pad id below
 * the compressed vocabulary; draft targets inside the backbone.
 * Returns DI_OK or DI_EINVAL naming the rule and the layer/key. cfg's derived fields are
 * written only on success. */
di_status model_config_validate(model_config *cfg, di_error *err);

/* ---- output ---- */

/* The config as the released nested config.json (top level: architectures, model_type,
 * token ids, quantization_config, text_config with every other key). A new reference the
 * caller json_decref()s; NULL only when out of memory. */
json_t *model_config_to_json(const model_config *cfg);

/* ---- derived views ---- */

/* KV geometry for the config with `nextn` drafts per step (ring = window + nextn + 1):
 * block_tokens 128, head/index widths, owners = KV sources with their ratios, yoco_boundary,
 * n_draft_stages = n_mtp, model_id. cfg must be validated. */
void model_config_kv_geometry(const model_config *cfg, uint32_t nextn, kv_geometry *out);
/* The same for an engine whose prefill runs in YOCO mode `yoco` (KV_YOCO_*): model_id is
 * kv_model_id(cfg->model_id, yoco). model_config_kv_geometry uses KV_YOCO_DEFAULT. */
void model_config_kv_geometry_yoco(const model_config *cfg, uint32_t nextn, uint32_t yoco,
                                   kv_geometry *out);

/* The model id of a checkpoint: the config fingerprint (recomputed from cfg's keys, whatever
 * cfg->model_id holds) mixed with the weights fingerprint of shard_sums.h. */
uint64_t model_config_id_with_weights(const model_config *cfg,
                                      const uint8_t weights_fingerprint[32]);

/* DeepSeek-V4.1-Flash with the given nextn (drafts per step; 5 in production), from the shipped
 * v41-flash config (model_config_kv_geometry), model id included. */
void kv_geometry_v41_flash(uint32_t nextn, kv_geometry *out);

/* The fingerprint stored in cfg->model_id, recomputed from the parsed keys. */
uint64_t model_config_fingerprint(const model_config *cfg);

/* The role of backbone layer l (l < n_layers) or draft stage s (model_config_stage_role). */
static inline const model_layer_role *model_config_role(const model_config *cfg, uint32_t l)
{
    return &cfg->roles[l];
}
static inline const model_layer_role *model_config_stage_role(const model_config *cfg,
                                                              uint32_t s)
{
    return &cfg->roles[cfg->n_layers + s];
}

/* Slot of an Engram layer id in engram_layer_ids, -1 when layer has none. */
int32_t model_config_engram_slot(const model_config *cfg, uint32_t layer);

/* The prime search of MODEL.md §2.9: for each Engram layer (in order), each n-gram order
 * 2..max_ngram and each head, the next prime above the running start (the start resets to
 * vocab_size - 1 for every order), skipping primes already used by any layer. Writes
 * primes[layer][col] for n_layers x n_orders x n_heads columns. DI_EINVAL when the sizes
 * exceed the MODEL_MAX_ENGRAM_* bounds or vocab_size is below 2. */
di_status model_engram_primes(uint32_t n_layers, uint32_t n_orders, uint32_t n_heads,
                              uint64_t vocab_size,
                              uint64_t primes[MODEL_MAX_ENGRAM_LAYERS][MODEL_MAX_ENGRAM_COLS],
                              di_error *err);

/* The hash multipliers of one Engram layer (MODEL.md §2.9 step 3), as the reference draws
 * them: NumPy default_rng(10007 * layer_id).integers(0, half, n) with
 * half = (2^63 - 1) / compressed_vocab / 2, then 2r + 1. Reimplements NumPy's SeedSequence,
 * PCG64 (XSL-RR) and bounded 64-bit Lemire draw. compressed_vocab in [1, 2^29], n <= 16. */
void model_engram_multipliers(uint32_t layer_id, uint32_t compressed_vocab, uint32_t n,
                              uint64_t *out);

/* Deterministic primality test for 64-bit integers (Miller-Rabin with a fixed witness set). */
bool model_is_prime_u64(uint64_t n);

#endif
