/* tok_default.c: where binaries find the tokenizer when none is named. */
#include <stdlib.h>
#include <unistd.h>

#include "common/tokenizer/tokenizer.h"

#ifndef DI_SOURCE_ROOT
#define DI_SOURCE_ROOT "."
#endif

const char *tok_default_path(void)
{
    const char *env = getenv("DI_TOKENIZER");
    if (env && *env)
        return env;
    return access(TOK_DEFAULT_FILE, R_OK) == 0 ? TOK_DEFAULT_FILE : NULL;
}
