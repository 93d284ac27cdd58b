/* libFuzzer target: arbitrary bytes as tokenizer.json. Whatever the loader accepts must then
 * encode and decode without faults; whatever it refuses must come with a message.
 *
 *   build/tests/tokenizer/tokenizer_fuzz_load -max_total_time=60 tests/fuzz/tokenizer_corpus/
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "common/tokenizer/tokenizer.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    tok_tokenizer *t = NULL;
    di_error e = {0};
    if (tok_load_json((const char *)data, size, &t, &e) != DI_OK) {
        if (!e.msg[0])
            abort(); /* a refusal without a message */
        return 0;
    }
    static const char *const TEXT[] = {"Hello, world! 12345 ", "中文 テキスト 👋🏽\n\t ",
                                       "<｜User｜>x<|EOT|>", "a\0b"};
    for (size_t k = 0; k < sizeof TEXT / sizeof TEXT[0]; k++) {
        tok_ids ids = {0};
        size_t n = k == 3 ? 3 : strlen(TEXT[k]);
        if (tok_encode(t, TEXT[k], n, &ids, &e) == DI_OK) {
            char *out = NULL;
            size_t len = 0;
            if (tok_decode(t, ids.v, ids.n, 0, &out, &len, &e) == DI_OK)
                free(out);
        }
        tok_ids_free(&ids);
    }
    tok_free(t);
    return 0;
}
