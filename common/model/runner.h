/* runner.h: what an offline run needs around the forward pass: a checkpoint loaded with its
 * Engram token map, or a random-weight model built from a config and a seed.
 *
 * The Engram compressed-token map (MODEL.md, engine choices) is built from tokenizer.json
 * when the model directory has one (by the caller, with the tokenizer module:
 * tok_engram_map_build, then runner_model_set_token_map), else read from
 * engram_token_map.json there ({"vocab_size", "compressed_vocab_size", "pad_token_id",
 * "map": [...]}); with neither, the forward uses token id modulo the compressed vocabulary.
 */
#ifndef DI_MODEL_RUNNER_H
#define DI_MODEL_RUNNER_H

#include <stdbool.h>
#include <stdint.h>

#include "common/model/weights.h"
#include "common/util/status.h"

typedef struct runner_model {
    model_weights *w;            /* owned */
    int32_t *token_map;          /* [vocab_size] or NULL (identity rule); owned */
    int32_t token_map_pad;       /* pad token id named by the map file; -1 without a file */
    bool has_tokenizer;          /* the directory holds tokenizer.json: its map takes precedence
                                    over the map file (runner_model_set_token_map) */
} runner_model;

/* Loads the checkpoint in dir (model_weights_load with opt, may be NULL) and its token map
 * file. Returns the loader's codes, or DI_ECORRUPT for a malformed map file (wrong size,
 * entries outside the compressed vocabulary). *out written only on success. */
di_status runner_model_load(const char *dir, const model_load_options *opt, runner_model *out,
                            di_error *err);

/* Builds random weights (MODEL.md §5, the di-mkmodel generator) for a shipped config name or a
 * config file, with the given seed: the checkpoint is written to a private temporary directory
 * under tmp_root (NULL: $TMPDIR or /tmp), mapped, and its files are removed at once, so only
 * the memory mapping remains. Same codes as runner_model_load plus the generator's; DI_ENOSPC,
 * before anything is written, when the checkpoint is above di-mkmodel's 64 GB limit or the
 * free space under the temporary root. */
di_status runner_model_random(const char *config, uint64_t seed, const char *tmp_root,
                              const model_load_options *opt, runner_model *out, di_error *err);

/* Replaces the token map with a copy of map[vocab_size] (values checked against the
 * compressed vocabulary) and its pad token. DI_EINVAL (with the bad entry), DI_ENOMEM. */
di_status runner_model_set_token_map(runner_model *m, const int32_t *map, uint32_t vocab_size,
                                     int32_t pad_token, di_error *err);

/* The model cannot run without a map the caller must build: DI_EUNSUPPORTED when Engram
 * layers exist, tokenizer.json is there and no map was loaded or set. */
di_status runner_model_check_token_map(const runner_model *m, const char *dir, di_error *err);

void runner_model_free(runner_model *m); /* NULL-safe; frees what the struct owns */

#endif
