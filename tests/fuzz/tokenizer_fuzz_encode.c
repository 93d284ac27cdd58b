/* libFuzzer target: arbitrary bytes through the DeepSeek V3 tokenizer. Valid UTF-8 must encode
 * and decode back to itself, one id at a time as well; invalid UTF-8 must be refused. The same
 * bytes, read as int32 ids, go through decode and a stream.
 *
 *   DI_TOKENIZER=data/tokenizer/deepseek-v3/tokenizer.json \
 *     build/tests/tokenizer/tokenizer_fuzz_encode -max_total_time=60
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "common/tokenizer/tokenizer.h"

#ifndef DI_SOURCE_ROOT
#define DI_SOURCE_ROOT "."
#endif

int LLVMFuzzerInitialize(int *argc, char ***argv);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

/* The one tokenizer of this fuzzing process (libFuzzer's entry points take no context). */
static tok_tokenizer *tok;

int LLVMFuzzerInitialize(int *argc, char ***argv)
{
    (void)argc, (void)argv;
    const char *path = getenv("DI_TOKENIZER");
    di_error e;
    if (tok_load_file(path ? path : DI_SOURCE_ROOT "/data/tokenizer/deepseek-v3/tokenizer.json",
                      &tok, &e) != DI_OK)
        abort(); /* run deploy/local/install-deps.sh, or set DI_TOKENIZER */
    return 0;
}

static void check_text(const uint8_t *data, size_t size)
{
    tok_ids ids = {0};
    di_error e;
    di_status st = tok_encode(tok, (const char *)data, size, &ids, &e);
    if (st == DI_EINVAL) {
        tok_ids_free(&ids);
        return; /* invalid UTF-8 */
    }
    if (st != DI_OK)
        abort();
    char *out = NULL;
    size_t len = 0;
    if (tok_decode(tok, ids.v, ids.n, 0, &out, &len, &e) != DI_OK || len != size ||
        memcmp(out, data, size) != 0)
        abort(); /* decode(encode(s)) != s */
    free(out);
    tok_ids_free(&ids);
}

static void check_ids(const uint8_t *data, size_t size)
{
    size_t n = size / 4;
    int32_t *ids = malloc(n ? n * 4 : 1);
    if (!ids)
        return;
    memcpy(ids, data, n * 4);
    for (size_t i = 0; i < n; i++)
        ids[i] = (int32_t)((uint32_t)ids[i] % 130000u); /* mostly in range, some not */
    char *out = NULL;
    size_t len = 0;
    di_error e;
    if (tok_decode(tok, ids, n, 0, &out, &len, &e) == DI_OK)
        free(out);
    tok_stream *s = NULL;
    if (tok_stream_new(tok, TOK_DECODE_SKIP_SPECIAL, &s, &e) == DI_OK) {
        const char *p;
        for (size_t i = 0; i < n; i++)
            (void)tok_stream_push(s, ids[i], &p, &len, &e);
        (void)tok_stream_finish(s, &p, &len, &e);
        tok_stream_free(s);
    }
    free(ids);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    check_text(data, size);
    check_ids(data, size);
    return 0;
}
