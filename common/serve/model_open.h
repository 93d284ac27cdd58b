/* model_open.h: one call that opens what an engine runs on: the model (a checkpoint directory,
 * or random weights from a config and a seed), its tokenizer, and the Engram token map built
 * from that tokenizer (MODEL.md: it takes precedence over engram_token_map.json), checked so
 * that the model can run.
 *
 * Tokenizer: the one named, else the model directory's tokenizer.json, else, when the caller
 * needs one (text prompts), the default (tok_default_path: $DI_TOKENIZER or the one
 * install-deps.sh fetched); none otherwise. A build without the tokenizer module opens no
 * tokenizer and refuses need_tokenizer.
 */
#ifndef DI_SERVE_MODEL_OPEN_H
#define DI_SERVE_MODEL_OPEN_H

#include <stdbool.h>
#include <stdint.h>

#include "common/model/runner.h"
#include "common/util/status.h"

struct tok_tokenizer;

typedef struct serve_model_options {
    const char *model_dir;            /* checkpoint directory, or NULL for random weights */
    const char *config;               /* random weights: shipped name or config file; NULL =
                                         "small" */
    uint64_t weights_seed;            /* random weights' seed */
    const char *tokenizer;            /* tokenizer.json to use; NULL = the model directory's */
    bool need_tokenizer;              /* text will be encoded: fall back to the default one,
                                         and its ids must fit the model's vocabulary */
    const model_load_options *load;   /* loader flags and progress; may be NULL */
} serve_model_options;

typedef struct serve_model {
    runner_model rm;                  /* weights and token map */
    struct tok_tokenizer *tok;        /* the tokenizer, or NULL */
} serve_model;

/* Opens the model, the tokenizer and the Engram map. DI_OK (*out owns them); the loader's and
 * the tokenizer's codes with the file named; DI_EINVAL (a tokenizer with ids beyond the
 * vocabulary when need_tokenizer); DI_EUNSUPPORTED (no tokenizer module but need_tokenizer; or
 * an Engram model whose map cannot be built). Nothing is left open on failure. */
di_status serve_model_open(const serve_model_options *opt, serve_model *out, di_error *err);

/* Frees what serve_model_open opened. NULL-safe, and safe on a zeroed struct. */
void serve_model_close(serve_model *m);

#endif
