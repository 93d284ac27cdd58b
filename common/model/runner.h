/* runner.h: what an offline run needs around the forward pass: a checkpoint loaded with its
 * Engram token map, or a random-weight model built from a config and a seed.
 *
 * The Engram compressed-token map (MODEL.md, engine choices) comes from
 * engram_token_map.json in the model directory ({"vocab_size", "compressed_vocab_size",
 * "pad_token_id", "map": [...]}); without it the forward uses token id modulo the compressed
 * vocabulary. A directory with tokenizer.json but no map file is refused: building the
 * normalised map needs the tokenizer module.
 */
#ifndef DI_MODEL_RUNNER_H
#define DI_MODEL_RUNNER_H

#include <stdint.h>

#include "common/model/weights.h"
#include "common/util/status.h"

typedef struct runner_model {
    model_weights *w;            /* owned */
    int32_t *token_map;          /* [vocab_size] or NULL (identity rule); owned */
    int32_t token_map_pad;       /* pad token id named by the map file; -1 without a file */
} runner_model;

/* Loads the checkpoint in dir (model_weights_load with opt, may be NULL) and its token map.
 * Returns the loader's codes, or DI_ECORRUPT for a malformed map file (wrong size, entries
 * outside the compressed vocabulary), DI_EUNSUPPORTED for a tokenizer.json without a map.
 * *out written only on success. */
di_status runner_model_load(const char *dir, const model_load_options *opt, runner_model *out,
                            di_error *err);

/* Builds random weights (MODEL.md §5, the di-mkmodel generator) for a shipped config name or a
 * config file, with the given seed: the checkpoint is written to a private temporary directory
 * under tmp_root (NULL: $TMPDIR or /tmp), mapped, and its files are removed at once, so only
 * the memory mapping remains. Same codes as runner_model_load plus the generator's (DI_ENOSPC
 * above 64 GB). */
di_status runner_model_random(const char *config, uint64_t seed, const char *tmp_root,
                              const model_load_options *opt, runner_model *out, di_error *err);

void runner_model_free(runner_model *m); /* NULL-safe; frees what the struct owns */

#endif
