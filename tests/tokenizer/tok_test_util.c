#include "tests/tokenizer/tok_test_util.h"

#include <criterion/criterion.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

const char *tt_source_path(const char *rel)
{
    static char buf[4096];
    const char *root = getenv("DI_SOURCE_ROOT");
    snprintf(buf, sizeof buf, "%s/%s", root && *root ? root : ".", rel);
    return buf;
}

tok_tokenizer *tt_deepseek(void)
{
    const char *path = tt_source_path("data/tokenizer/deepseek-v3/tokenizer.json");
    tok_tokenizer *t = NULL;
    di_error e;
    di_status st = tok_load_file(path, &t, &e);
    cr_assert_eq(st, DI_OK, "%s (run deploy/local/install-deps.sh to fetch the tokenizer)",
                 e.msg);
    return t;
}

char *tt_read_file(const char *path, size_t *len)
{
    FILE *f = fopen(path, "rb");
    if (!f)
        return NULL;
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *p = malloc((size_t)n + 1);
    if (p && fread(p, 1, (size_t)n, f) != (size_t)n) {
        free(p);
        p = NULL;
    }
    fclose(f);
    if (p) {
        p[n] = '\0';
        *len = (size_t)n;
    }
    return p;
}

json_t *tt_load_json(const char *rel)
{
    json_error_t je;
    const char *path = tt_source_path(rel);
    json_t *j = json_load_file(path, JSON_ALLOW_NUL, &je);
    cr_assert_not_null(j, "%s: %s (line %d)", path, je.text, je.line);
    return j;
}

void tt_json_ids(const json_t *arr, tok_ids *out)
{
    cr_assert(json_is_array(arr), "expected an array of ids");
    di_error e;
    for (size_t i = 0; i < json_array_size(arr); i++) {
        const json_t *v = json_array_get(arr, i);
        cr_assert(json_is_integer(v), "id %zu is not an integer", i);
        cr_assert_eq(tok_ids_push(out, (int32_t)json_integer_value(v), &e), DI_OK);
    }
}

tok_ids tt_encode(const tok_tokenizer *t, const char *text, size_t len)
{
    tok_ids ids = {0};
    di_error e;
    di_status st = tok_encode(t, text, len, &ids, &e);
    cr_assert_eq(st, DI_OK, "encode failed: %s", e.msg);
    return ids;
}

di_status tt_load_text(const char *json, tok_tokenizer **out, di_error *err)
{
    return tok_load_json(json, strlen(json), out, err);
}
