/* mkmodel.h: write a random-weight checkpoint in the released format (behind di-mkmodel).
 *
 * Output directory (MODEL.md §7): config.json (nested HF layout), model.safetensors.index.json
 * ({"metadata": {"total_size"}, "weight_map"}), shards model-0000i-of-0000n.safetensors of a
 * bounded size holding every tensor of the config's manifest with its dtype, shape and `.scale`
 * sibling, and, for configs with Engram, engram_token_map.json (a fixed random map of token ids
 * into the compressed vocabulary, the pad token to the Engram pad id; MODEL.md's fallback when
 * there is no tokenizer.json).
 *
 * Values (MODEL.md §5): Linear weights N(0, 1/fan_in) quantised to the stored format (FP8
 * E4M3 with a UE8M0 scale per 32x32 block, s = 2^ceil(log2(amax / 448)); FP4 E2M1 with a UE8M0
 * scale per 1x32, procedure (B)); BF16 weights rounded to nearest even; embeddings N(0, 1);
 * norm gains 1; attn_sink 0; router bias 0 (or N(0, s^2)); hc_fn N(0, 1e-8), hc_base 0,
 * hc_scale 1; Engram q/k weights 1; Engram tables from model_engram_seeded_row(). Every
 * element is a pure function of (seed, tensor name, element index), so the bytes do not
 * depend on sharding or order, and the same seed writes the same bytes (on one C library: the
 * normals go through log, sin and cos).
 *
 * Engram tables: written when they take at most engram_auto_limit bytes (MKMODEL_ENGRAM_AUTO),
 * else replaced by the config extension key engram_table_seed (the 189 GiB of the full model).
 */
#ifndef DI_MODEL_MKMODEL_H
#define DI_MODEL_MKMODEL_H

#include <stdbool.h>
#include <stdint.h>

#include "common/model/config.h"
#include "common/util/status.h"

typedef enum mkmodel_engram_mode {
    MKMODEL_ENGRAM_AUTO = 0, /* write when small enough, else seed */
    MKMODEL_ENGRAM_WRITE,    /* always write the table tensors */
    MKMODEL_ENGRAM_SEED,     /* never write them: config gets engram_table_seed */
} mkmodel_engram_mode;

/* Progress, reported after each tensor written. */
typedef struct mkmodel_progress {
    uint64_t tensors_done;   /* tensors written (scales count) */
    uint64_t tensors_total;
    uint64_t bytes_done;     /* tensor data bytes written */
    uint64_t bytes_total;
    uint32_t shard;          /* 1-based shard being written */
    uint32_t n_shards;
} mkmodel_progress;

typedef struct mkmodel_options {
    uint64_t seed;                /* generator seed */
    uint64_t shard_bytes;         /* target shard size in bytes (a tensor larger than it gets
                                     a shard of its own); default 2 GiB */
    uint64_t max_bytes;           /* refuse a larger checkpoint unless force; 0 = no limit;
                                     default 64 GB */
    bool force;                   /* write above max_bytes, into a non-empty directory */
    double gate_bias_std;         /* router bias N(0, s^2); 0 (default) = zero biases */
    mkmodel_engram_mode engram;   /* default AUTO */
    uint64_t engram_auto_limit;   /* AUTO writes tables up to this many bytes; default 1 GiB */
    void (*progress)(void *userdata, const mkmodel_progress *p); /* may be NULL */
    void *progress_userdata;
} mkmodel_options;

/* What a write produces. */
typedef struct mkmodel_plan {
    model_config config;          /* the config written (engram_table_seed set when seeded);
                                     after a write, model_id covers the weights written (the
                                     id model_weights_load gives the checkpoint) */
    bool engram_seeded;           /* tables replaced by the seed */
    uint64_t tensors;             /* tensors in the index */
    uint64_t params;              /* parameters (manifest count; seeded tables included) */
    uint64_t bytes;               /* tensor data bytes (the index's total_size) */
    uint32_t n_shards;
} mkmodel_plan;

void mkmodel_options_default(mkmodel_options *opt);

/* The plan for cfg under opt without writing anything. DI_EINVAL for bad options; DI_ENOSPC
 * when the checkpoint exceeds max_bytes and force is off ("checkpoint of 509.3 GB exceeds the
 * 64.0 GB limit"). *out written only on success. */
di_status mkmodel_plan_for(const model_config *cfg, const mkmodel_options *opt,
                           mkmodel_plan *out, di_error *err);

/* Writes the checkpoint into dir (created if missing; refused when it already holds files,
 * unless force). plan may be NULL. Returns DI_OK, the errors of mkmodel_plan_for, DI_EEXIST
 * (non-empty directory), DI_EIO. On failure files already written may remain, but config.json
 * is written last (and, with force, an old one is removed first), so an incomplete directory
 * never loads. The checksum manifest (shard_sums.h) follows config.json. */
di_status mkmodel_write(const model_config *cfg, const char *dir, const mkmodel_options *opt,
                        mkmodel_plan *plan, di_error *err);

/* Writes the checksum manifest of the checkpoint in dir (any checkpoint in the released
 * format: config.json, the index and its shards), hashing with `threads` threads (0: one per
 * CPU). model_id (may be NULL) receives the checkpoint's model id. Returns DI_OK, the errors
 * of model_config_load, st_index_load and shard_sums_write. */
di_status mkmodel_write_sums(const char *dir, uint32_t threads, uint64_t *model_id,
                             di_error *err);

#endif
