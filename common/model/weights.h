/* weights.h: a checkpoint directory loaded as tensor views (MODEL.md §7).
 *
 * The directory holds the released layout: a nested config.json, model.safetensors.index.json
 * and shards, tensors named as the reference code's modules (`layers.N.attn.wq_a.weight`,
 * `mtp.S.*`, `embed.weight`, `head.weight`, `norm.weight`), quantised weights with a `.scale`
 * sibling in F8_E8M0. The loader maps every shard read-only, checks each expected tensor's
 * presence, dtype and shape against the config ("layers.3.attn.wkv.weight: shape [512, 64],
 * expected [512, 128]"), reports tensors of known namespaces that the config does not
 * explain, and ignores the vision tower (`vision.*`, `aligner.*`, `image_*`).
 *
 * Config, weights and run state are separate (STYLE.md H6): this module only describes where
 * each weight lives. Weights stay in the mapping; the only owned copy is the optional BF16
 * wo_a (MODEL_LOAD_WO_A_BF16). Every model_tensor names its logical shape [rows, cols] (the
 * math's [out, in]) and its storage format; FP4 weights are [rows, cols] logically and
 * [rows, cols/2] bytes on disk.
 *
 * wo_a: the checkpoint stores it FP8 with 32x32 scales; the reference computes it as a BF16
 * einsum on FP8 x scale rounded to BF16. Every E4M3 value times a power-of-two UE8M0 scale is
 * exactly a BF16 number, so the FP8 view IS the reference's BF16 matrix, losslessly: the
 * default keeps it FP8 (no copy) and the forward dequantises on the fly and multiplies without
 * quantising the activation. MODEL_LOAD_WO_A_BF16 instead materialises BF16 copies in one owned
 * allocation (for a backend that wants a plain BF16 GEMM).
 *
 * Engram tables: either tensors in the checkpoint (F8_E4M3 [rows, head_dim] with scale
 * [rows, head_dim/32]) or, when config.json carries our extension key `engram_table_seed` and
 * the tensors are absent, rows generated on demand from (seed, layer, row) with Philox; the
 * generator (di-mkmodel) writes small tables with the very same function, so both give the
 * same numbers. model_engram_row() fetches a row either way.
 */
#ifndef DI_MODEL_WEIGHTS_H
#define DI_MODEL_WEIGHTS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/model/config.h"
#include "common/model/safetensors.h"
#include "common/model/shard_sums.h"
#include "common/util/log.h"
#include "common/util/status.h"

/* Storage format of one weight: data layout plus the layout of its scale. */
typedef enum model_wfmt {
    MODEL_WFMT_NONE = 0,   /* absent (optional weight not in this layer) */
    MODEL_WFMT_F32,        /* fp32 [rows, cols] row-major */
    MODEL_WFMT_BF16,       /* bf16 [rows, cols] row-major */
    MODEL_WFMT_FP8_32X32,  /* E4M3 codes [rows, cols]; UE8M0 scale [ceil(rows/32),
                              ceil(cols/32)]: value = e4m3 * 2^(s[r/32][c/32] - 127) */
    MODEL_WFMT_FP8_1X32,   /* E4M3 codes [rows, cols]; UE8M0 scale [rows, cols/32] (Engram table) */
    MODEL_WFMT_FP4_1X32,   /* E2M1 [rows, cols/2] bytes, element 2i in the low nibble;
                              UE8M0 scale [rows, cols/32] */
} model_wfmt;

/* A view of one weight. Data and scale point into a shard's mapping (or the owned wo_a copy)
 * and are NOT aligned in general: read multi-byte elements with memcpy. */
typedef struct model_tensor {
    const char *name;        /* checkpoint name ("layers.3.attn.wkv.weight"); debug name */
    model_wfmt fmt;          /* storage format; NONE when absent */
    uint32_t ndim;           /* logical dimensions: 1 (vector) or 2 (matrix) */
    uint64_t rows;           /* logical rows (out features); elements for a vector */
    uint64_t cols;           /* logical columns (in features); 1 for a vector */
    const void *data;        /* first byte of the values */
    const uint8_t *scale;    /* UE8M0 scale bytes (quantised formats), else NULL */
    uint64_t scale_rows;     /* scale matrix rows */
    uint64_t scale_cols;     /* scale matrix columns (its row stride in bytes) */
} model_tensor;

/* Attention core of a layer or draft stage (MODEL.md §2.5). */
typedef struct model_attn_weights {
    model_tensor wq_a;       /* [q_lora_rank, dim] FP8 */
    model_tensor q_norm;     /* [q_lora_rank] BF16 */
    model_tensor wq_b;       /* [n_heads * head_dim, q_lora_rank] FP8 */
    model_tensor wkv;        /* [head_dim, dim] FP8 */
    model_tensor kv_norm;    /* [head_dim] BF16 */
    model_tensor wo_a;       /* [o_groups * o_lora_rank, n_heads * head_dim / o_groups]:
                                FP8 32x32 (default) or BF16 (MODEL_LOAD_WO_A_BF16) */
    model_tensor wo_b;       /* [dim, o_groups * o_lora_rank] FP8 */
    model_tensor attn_sink;  /* [n_heads] F32 */
} model_attn_weights;

/* Compressor of a KV source (MODEL.md §2.6). */
typedef struct model_compressor_weights {
    model_tensor wkv;        /* [head_dim, dim] BF16 */
    model_tensor wgate;      /* [head_dim, dim] BF16; ratio > 1 only (NONE for ratio 1) */
    model_tensor norm;       /* [head_dim] BF16 */
} model_compressor_weights;

/* Indexer of an index source (MODEL.md §2.7). */
typedef struct model_indexer_weights {
    model_tensor wq_b;         /* [index_n_heads * index_head_dim, q_lora_rank] FP8 */
    model_tensor weights_proj; /* [index_n_heads, dim] BF16 */
    model_tensor wk;           /* [index_head_dim, head_dim] BF16; index-key owners only */
    model_tensor k_norm;       /* [index_head_dim] BF16; index-key owners only */
} model_indexer_weights;

/* One mHC site (MODEL.md §2.3); mixes = (2 + hc_mult) * hc_mult = 24. */
typedef struct model_hc_weights {
    model_tensor fn;         /* [24, hc_mult * dim] F32 */
    model_tensor base;       /* [24] F32 */
    model_tensor scale;      /* [3] F32 */
} model_hc_weights;

/* One SwiGLU expert: routed (FP4 1x32) or shared (FP8 32x32). */
typedef struct model_expert_weights {
    model_tensor w1;         /* [inter, dim] gate branch */
    model_tensor w2;         /* [dim, inter] down */
    model_tensor w3;         /* [inter, dim] up branch */
} model_expert_weights;

/* MoE of a layer or draft stage (MODEL.md §2.8). */
typedef struct model_ffn_weights {
    uint32_t n_experts;              /* routed experts (n_routed_experts or dspark_...) */
    model_tensor gate;               /* [n_experts, dim] BF16 router */
    model_tensor gate_bias;          /* [n_experts] F32 selection bias */
    model_tensor gate_bias_vl;       /* [n_experts] F32 image-token bias; NONE if absent */
    model_expert_weights *experts;   /* [n_experts] routed, FP4 (owned array of views) */
    model_expert_weights shared;     /* shared expert, FP8 (n_shared_experts == 1) */
} model_ffn_weights;

/* Engram module in front of a layer (MODEL.md §2.9). */
typedef struct model_engram_weights {
    uint32_t layer;          /* backbone layer it sits in front of */
    uint32_t slot;           /* index in engram_layer_ids */
    uint64_t rows;           /* table rows (engram_num_embeddings[slot]) */
    uint32_t width;          /* row width (engram_head_dim) */
    model_tensor table;      /* [rows, width] FP8 1x32; data NULL when seeded */
    bool seeded;             /* rows come from engram_table_seed, not from the checkpoint */
    uint64_t seed;           /* engram_table_seed when seeded */
    model_tensor wkv;        /* [(hc_mult + 1) * dim, engram_cols * width] FP8 */
    model_tensor q_weight;   /* [hc_mult, dim] BF16 */
    model_tensor k_weight;   /* [hc_mult, dim] BF16 */
} model_engram_weights;

/* One backbone layer (or the block of a draft stage). Optional parts have fmt NONE. */
typedef struct model_layer_weights {
    model_tensor attn_norm;              /* [dim] BF16 */
    model_tensor ffn_norm;               /* [dim] BF16 */
    model_hc_weights hc_attn;            /* attention site */
    model_hc_weights hc_ffn;             /* FFN site */
    model_attn_weights attn;
    bool has_compressor;                 /* role owns_compressor */
    model_compressor_weights compressor;
    bool has_indexer;                    /* role owns_indexer (wk/k_norm iff owns_index_keys) */
    model_indexer_weights indexer;
    model_ffn_weights ffn;
    model_engram_weights *engram;        /* NULL unless an Engram module sits in front */
} model_layer_weights;

/* One DSpark stage (MODEL.md §2.11). */
typedef struct model_draft_weights {
    model_layer_weights block;           /* the stage's Block (ratio 0, draft MoE) */
    model_tensor main_proj;              /* stage 0: [dim, n_targets * dim] FP8; else NONE */
    model_tensor main_norm;              /* stage 0: [dim] BF16; else NONE */
    model_tensor norm;                   /* last stage: [dim] BF16; else NONE */
    model_tensor markov_embed;           /* last stage: [vocab, markov_rank] BF16 */
    model_tensor markov_head;            /* last stage: [vocab, markov_rank] BF16 */
    model_tensor confidence_proj;        /* last stage: [1, dim + markov_rank] BF16 */
} model_draft_weights;

/* Progress of a load, passed to the callback after each tensor is checked (and, with
 * MODEL_LOAD_PREFAULT, read). */
typedef struct model_load_progress {
    uint64_t tensors_done;   /* tensors checked so far */
    uint64_t tensors_total;  /* tensors in the index */
    uint64_t bytes_done;     /* data bytes of the checked tensors */
    uint64_t bytes_total;    /* data bytes of every shard */
    const char *current;     /* name of the tensor just checked */
} model_load_progress;

typedef void (*model_load_progress_fn)(void *userdata, const model_load_progress *p);

enum {
    MODEL_LOAD_WO_A_BF16 = 1u << 0,  /* materialise wo_a as BF16 (owned) instead of FP8 */
    MODEL_LOAD_PREFAULT = 1u << 1,   /* read every mapped page during the load */
    MODEL_LOAD_ALLOW_EXTRA = 1u << 2, /* unexpected tensors: a warning, not an error */
    MODEL_LOAD_TRUST_SUMS = 1u << 3, /* do not verify the checksum manifest: take the weights
                                        fingerprint from it without hashing the shards */
};

typedef struct model_load_options {
    uint32_t flags;                  /* MODEL_LOAD_* */
    model_load_progress_fn progress; /* may be NULL */
    void *progress_userdata;
    const di_logger *log;            /* warnings and debug lines; may be NULL */
    const model_config *config;      /* NULL: read dir/config.json; else use this config
                                        (the directory's config.json is then not read) */
    uint32_t hash_threads;           /* threads hashing the shards; 0 = one per online CPU */
    /* The routed experts of the backbone layers to keep (a rank of an expert-parallel group
     * keeps its own slots' experts); NULL keeps every one. A dropped expert's tensors are
     * still checked (dtype, shape) and hashed with their shard, but its views stay NONE and
     * its pages are not prefaulted. Draft stages' experts are always kept. */
    bool (*keep_expert)(void *userdata, const model_config *c, uint32_t layer, uint32_t expert);
    void *keep_expert_userdata;
} model_load_options;

/* A loaded checkpoint. Read-only after load; any number of threads may read it. */
typedef struct model_weights {
    model_config config;             /* the checkpoint's config (validated) */
    model_tensor embed;              /* [vocab, dim] BF16 */
    model_tensor head;               /* [vocab, dim] BF16 */
    model_tensor norm;               /* [dim] BF16 final norm */
    model_layer_weights *layers;     /* [n_layers] */
    model_draft_weights *drafts;     /* [n_mtp] */
    model_engram_weights *engrams;   /* [n_engram_layers], pointed to by layers[l].engram */
    uint64_t n_tensors;              /* tensors in the checkpoint's index */
    uint64_t n_params;               /* parameters of the text model and draft (logical
                                        elements of every checked tensor, scales excluded;
                                        seeded Engram rows included) */
    uint64_t bytes;                  /* data bytes of every checked tensor */
    uint64_t expert_bytes;           /* data and scale bytes of the backbone layers' routed
                                        experts whose views were kept (keep_expert) */
    uint32_t experts_kept;           /* those experts, over all backbone layers */
    shard_sums_result sums;          /* the weights fingerprint (mixed into config.model_id)
                                        and how it was obtained */
    /* storage (private to the loader) */
    st_index *index;
    st_file **shards;                /* [index->n_shards] */
    void *owned;                     /* the BF16 wo_a copies, or NULL */
    size_t owned_bytes;
    model_expert_weights *expert_pool; /* storage of every ffn.experts array */
} model_weights;

/* Loads the checkpoint in dir. opt may be NULL (defaults). Every shard is hashed once (in
 * parallel, shard_sums.h) for the weights fingerprint and, when the checkpoint has a checksum
 * manifest, checked against it (unless MODEL_LOAD_TRUST_SUMS); config.model_id then covers the
 * config and the weights. Returns DI_OK; DI_ENOENT (no config.json / index / shard);
 * DI_EINVAL or DI_EUNSUPPORTED (config); DI_ECORRUPT naming the tensor for a missing tensor, a
 * wrong dtype or shape, a truncated or malformed shard, an unexpected tensor (unless
 * MODEL_LOAD_ALLOW_EXTRA), or naming the shard and byte range that do not match the checksum
 * manifest; DI_ENOMEM. *out is set only on success;
 * on failure everything mapped or allocated is released. */
di_status model_weights_load(const char *dir, const model_load_options *opt, model_weights **out,
                             di_error *err);
/* Unmaps and frees. NULL-safe. */
void model_weights_free(model_weights *w);

/* ---- the manifest: every tensor a config expects ---- */

/* How di-mkmodel fills a tensor (MODEL.md §5's random-weight recipe). */
typedef enum model_init {
    MODEL_INIT_NORMAL = 0, /* N(0, std^2): Linear weights (std = 1/sqrt(fan_in)), embeddings
                              (std 1), hc_*_fn (std 1e-4) */
    MODEL_INIT_ONES,       /* norm gains, hc_*_scale, Engram q_weight/k_weight */
    MODEL_INIT_ZEROS,      /* attn_sink, hc_*_base, gate bias_vl */
    MODEL_INIT_GATE_BIAS,  /* router bias: 0, or N(0, s^2) with the generator's chosen s */
    MODEL_INIT_ENGRAM,     /* Engram table: model_engram_seeded_row() */
} model_init;

enum {
    MODEL_SPEC_OPTIONAL = 1u << 0, /* may be absent (gate bias_vl: image tokens only) */
    MODEL_SPEC_SEEDABLE = 1u << 1, /* may be absent when config has engram_table_seed */
};

/* One tensor a config expects, in its logical shape; the disk layout follows from fmt
 * (model_spec_disk). */
typedef struct model_tensor_spec {
    const char *name;        /* checkpoint name; valid during the callback only */
    model_wfmt fmt;          /* storage format */
    uint32_t ndim;           /* 1 or 2 */
    uint64_t rows, cols;     /* logical shape (cols 1 for vectors) */
    model_init init;         /* random-weight rule */
    double std;              /* MODEL_INIT_NORMAL: standard deviation */
    uint32_t flags;          /* MODEL_SPEC_* */
    uint32_t engram_layer;   /* MODEL_INIT_ENGRAM: the Engram layer id */
    model_tensor *dst;       /* the loader's destination view; NULL for other callers */
} model_tensor_spec;

/* On-disk layout of a spec: dtype and shape of the values, and of the `.scale` sibling
 * (scale_ndim 0 when unquantised). */
typedef struct model_disk_layout {
    st_dtype dtype;
    uint32_t ndim;
    uint64_t shape[2];
    uint32_t scale_ndim;
    uint64_t scale_shape[2];
} model_disk_layout;

void model_spec_disk(const model_tensor_spec *spec, model_disk_layout *out);
/* "<module>.scale" for "<module>.weight" (and "<name>.scale" for other names), into out. */
void model_scale_name(const char *name, char *out, size_t cap);

/* Calls fn once per tensor the (validated) config expects, in a fixed order: embed, layers
 * 0..n-1 (norms, mHC, attention, compressor, indexer, router, experts, shared expert,
 * Engram), draft stages, final norm, head. Stops at and returns the first error of fn. */
typedef di_status (*model_spec_fn)(void *userdata, const model_tensor_spec *spec,
                                   di_error *err);
di_status model_weights_manifest(const model_config *cfg, model_spec_fn fn, void *userdata,
                                 di_error *err);

/* Totals over the manifest: tensors (scales counted separately), parameters (logical
 * elements, scales and optional image-only tensors excluded, Engram tables included) and
 * bytes on disk (values and scales; Engram tables included). */
typedef struct model_manifest_totals {
    uint64_t tensors;
    uint64_t params;
    uint64_t bytes;
    uint64_t engram_table_bytes;  /* part of bytes held by Engram tables */
    uint64_t engram_table_tensors; /* tensors (tables and their scales) */
} model_manifest_totals;
void model_manifest_count(const model_config *cfg, model_manifest_totals *out);

/* ---- random values (di-mkmodel and the seeded Engram table) ---- */

/* Element `index` of a standard normal sequence keyed by `key`: Philox-4x32-10 at counter
 * (index / 2), two uniforms, Box-Muller; pure function of (key, index). */
double model_random_normal(uint64_t key, uint64_t index);
/* out[i] = scale * model_random_normal(key, first + i) for i < n, as floats (fast path). */
void model_random_normals(uint64_t key, uint64_t first, uint64_t n, double scale, float *out);
/* The key of a named tensor under a generator seed (stable across runs and platforms). */
uint64_t model_tensor_key(uint64_t seed, const char *name);

/* ---- reading values ---- */

/* Writes row r of t (cols values) as fp32: decodes BF16/F32, dequantises FP8 and FP4 with
 * their scales. r < rows (asserted). For 1-D tensors row 0 is the whole vector. */
void model_tensor_row_f32(const model_tensor *t, uint64_t r, float *out);
/* One element (r, c) as fp32. */
float model_tensor_get(const model_tensor *t, uint64_t r, uint64_t c);
/* Data bytes of a tensor in its storage format (scales excluded) and of its scale. */
uint64_t model_tensor_data_bytes(const model_tensor *t);
uint64_t model_tensor_scale_bytes(const model_tensor *t);

/* Row `row` of an Engram table as fp32 (exact BF16 values), width numbers, from the checkpoint
 * or generated from the seed. row < e->rows (asserted). */
void model_engram_row(const model_engram_weights *e, uint64_t row, float *out);
/* Same with a bounds check: DI_ERANGE when row >= e->rows. */
di_status model_engram_row_checked(const model_engram_weights *e, uint64_t row, float *out,
                                   di_error *err);

/* The seeded table generator shared by the loader and di-mkmodel: row `row` of the table of
 * Engram layer `layer_id` as E4M3 codes[width] and UE8M0 scales[width/32] (width a multiple
 * of 32). Values are N(0, 1) draws from Philox keyed by seed, quantised per 32 with
 * procedure (A) of MODEL.md §3.2. */
void model_engram_seeded_row(uint64_t seed, uint32_t layer_id, uint64_t row, uint32_t width,
                             uint8_t *codes, uint8_t *scales);

#endif
