/* tok_test_util.h: helpers shared by the tokenizer tests. */
#ifndef DI_TESTS_TOK_TEST_UTIL_H
#define DI_TESTS_TOK_TEST_UTIL_H

#include <jansson.h>
#include <stddef.h>

#include "common/tokenizer/tokenizer.h"

/* $DI_SOURCE_ROOT/rel (the source tree, set by meson test), in a static buffer. */
const char *tt_source_path(const char *rel);

/* The DeepSeek V3 tokenizer of data/tokenizer/deepseek-v3/ (fails the test with a hint to run
 * deploy/local/install-deps.sh when it is missing). */
tok_tokenizer *tt_deepseek(void);

/* A JSON file of the source tree, parsed (fails the test when it cannot be read). */
json_t *tt_load_json(const char *rel);

/* A whole file into a malloc'd buffer (NUL-terminated); NULL when it cannot be read. */
char *tt_read_file(const char *path, size_t *len);

/* A JSON array of integers as ids (fails the test on anything else). */
void tt_json_ids(const json_t *arr, tok_ids *out);

/* Encodes text (must succeed) into a fresh list. */
tok_ids tt_encode(const tok_tokenizer *t, const char *text, size_t len);

/* Loads a tokenizer from JSON text; returns the status, the message in err. */
di_status tt_load_text(const char *json, tok_tokenizer **out, di_error *err);

#endif
