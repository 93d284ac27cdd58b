/* A few thousand seeded mutations of tokenizer.json files, regex patterns and input bytes,
 * through the loader, the regex translator and the encoder: every call ends in success or in
 * a refusal with a message, never in a crash (the libFuzzer harnesses in tests/fuzz/ run the
 * same paths under ASan and UBSan for as long as one likes). */
#include <criterion/criterion.h>
#include <dirent.h>
#include <stdlib.h>
#include <string.h>

#include "common/tokenizer/tok_internal.h"
#include "common/util/philox.h"
#include "tests/tokenizer/tok_test_util.h"

static const char *const FRAGMENTS[] = {
    "null", "[]", "{}", "\"x\"", "-1", "1e999", "99999999999", "\"\\u0000\"", "{\"type\": \"Split\"}",
    "\"Regex\"", "\"\\\\\"", "[", "}", "\"ByteLevel\"", "\"Sequence\"", "true", "\"Ġ\"",
    "\"<｜User｜>\"", "\"\\\\p{L}\"", "\"(?!\"", ",", ":", "\"\\\\s+(?!\\\\S)\"", "\"Isolated\"",
    "\"Removed\"", "{\"id\": 7, \"content\": \"a\"}", "\"NFKC\"", "0", "2147483648", "\"ab c\"",
};

static size_t pick(di_rng *r, size_t n)
{
    return n ? (size_t)di_rng_below(r, n) : 0;
}

/* One random edit of buf. */
static void mutate(di_rng *r, tok_buf *b)
{
    di_error e;
    size_t at = pick(r, b->n + 1), len = 1 + pick(r, 16);
    switch (pick(r, 5)) {
    case 0: /* flip a byte */
        if (b->n)
            b->p[pick(r, b->n)] = (char)di_rng_u32(r);
        break;
    case 1: /* delete a span */
        if (at + len > b->n)
            len = b->n - at;
        memmove(b->p + at, b->p + at + len, b->n - at - len);
        b->n -= len;
        break;
    case 2: { /* insert a JSON fragment */
        const char *f = FRAGMENTS[pick(r, sizeof FRAGMENTS / sizeof FRAGMENTS[0])];
        size_t fl = strlen(f);
        tok_buf_reserve(b, fl, &e);
        memmove(b->p + at + fl, b->p + at, b->n - at);
        memcpy(b->p + at, f, fl);
        b->n += fl;
        break;
    }
    case 3: /* truncate */
        b->n = at;
        break;
    default: /* duplicate a span */
        if (at + len <= b->n) {
            tok_buf_reserve(b, len, &e);
            memmove(b->p + at + len, b->p + at, b->n - at);
            b->n += len;
        }
        break;
    }
}

/* A random node of the JSON tree (descending 0..6 levels). */
static json_t *random_node(di_rng *r, json_t *root, json_t **parent, const char **key,
                           size_t *index)
{
    json_t *cur = root;
    *parent = NULL;
    for (size_t depth = pick(r, 7); depth > 0; depth--) {
        size_t n = json_is_object(cur) ? json_object_size(cur) : json_array_size(cur);
        if (!n)
            break;
        size_t k = pick(r, n);
        *parent = cur;
        if (json_is_object(cur)) {
            void *it = json_object_iter(cur);
            while (k-- && it)
                it = json_object_iter_next(cur, it);
            *key = json_object_iter_key(it);
            cur = json_object_iter_value(it);
        } else {
            *index = k;
            cur = json_array_get(cur, k);
        }
    }
    return cur;
}

/* One random edit of the JSON tree: a value replaced by a fragment, or a member removed. */
static void mutate_tree(di_rng *r, json_t *root)
{
    json_t *parent;
    const char *key = NULL;
    size_t index = 0;
    random_node(r, root, &parent, &key, &index);
    if (!parent)
        return;
    json_t *v = json_loads(FRAGMENTS[pick(r, sizeof FRAGMENTS / sizeof FRAGMENTS[0])],
                           JSON_DECODE_ANY | JSON_ALLOW_NUL, NULL);
    bool remove = v == NULL || pick(r, 3) == 0;
    if (json_is_object(parent)) {
        char k[256];
        snprintf(k, sizeof k, "%s", key);
        if (remove)
            json_object_del(parent, k);
        else
            json_object_set(parent, k, v);
    } else if (remove) {
        json_array_remove(parent, index);
    } else {
        json_array_set(parent, index, v);
    }
    json_decref(v);
}

/* A mutant of base: byte edits of its text, or edits of its JSON tree. */
static void make_mutant(di_rng *r, const char *base, size_t len, tok_buf *out)
{
    di_error e;
    json_t *tree = pick(r, 2) ? json_loadb(base, len, JSON_ALLOW_NUL, NULL) : NULL;
    if (tree) {
        for (size_t m = 1 + pick(r, 3); m > 0; m--)
            mutate_tree(r, tree);
        char *text = json_dumps(tree, JSON_COMPACT | JSON_ENSURE_ASCII);
        tok_buf_appends(out, text ? text : "", &e);
        free(text);
        json_decref(tree);
        return;
    }
    tok_buf_append(out, base, len, &e);
    for (size_t m = 1 + pick(r, 4); m > 0; m--)
        mutate(r, out);
}

static void exercise(const tok_tokenizer *t, di_rng *r)
{
    static const char *const TEXT[] = {"hello there 12345", "你好 世界", "<｜User｜>a<|EOT|>",
                                       "a--b  \t\n", "\xf0\x9f\x91\x8b\xf0\x9f\x8f\xbd!"};
    di_error e;
    for (size_t k = 0; k < sizeof TEXT / sizeof TEXT[0]; k++) {
        tok_ids ids = {0};
        di_status st = tok_encode(t, TEXT[k], strlen(TEXT[k]), &ids, &e);
        cr_assert(st == DI_OK || (st < 0 && e.msg[0]), "encode: %d without a message", st);
        char *out = NULL;
        size_t len = 0;
        if (st == DI_OK && tok_decode(t, ids.v, ids.n, pick(r, 2), &out, &len, &e) == DI_OK)
            free(out);
        tok_ids_free(&ids);
    }
}

Test(mutations, tokenizer_json_pieces)
{
    const char *dir = tt_source_path("tests/fuzz/tokenizer_corpus");
    DIR *d = opendir(dir);
    cr_assert_not_null(d, "%s", dir);
    char names[8][4608];
    size_t nfiles = 0;
    struct dirent *de;
    while ((de = readdir(d)) && nfiles < 8)
        if (strstr(de->d_name, ".json"))
            snprintf(names[nfiles++], sizeof names[0], "%s/%s", dir, de->d_name);
    closedir(d);
    cr_assert_geq(nfiles, 3);
    di_rng r;
    di_rng_init(&r, 2024);
    size_t loaded = 0, refused = 0;
    for (size_t f = 0; f < nfiles; f++) {
        size_t len = 0;
        char *base = tt_read_file(names[f], &len);
        cr_assert_not_null(base);
        for (int it = 0; it < 1200; it++) {
            tok_buf b = {0};
            di_error e = {0};
            make_mutant(&r, base, len, &b);
            tok_tokenizer *t = NULL;
            di_status st = tok_load_json(b.p, b.n, &t, &e);
            if (st == DI_OK) {
                loaded++;
                exercise(t, &r);
                tok_free(t);
            } else {
                refused++;
                cr_assert(st < 0 && e.msg[0], "refusal %d without a message", st);
                cr_assert_null(t);
            }
            tok_buf_free(&b);
        }
        free(base);
    }
    cr_log_info("mutated tokenizer.json: %zu loaded, %zu refused", loaded, refused);
    cr_assert_gt(loaded, 300, "mutations that keep the file valid are exercised too");
    cr_assert_gt(refused, 100);
}

Test(mutations, regex_patterns)
{
    static const char *const PIECES[] = {"\\", "[", "]", "^", "\\p{L}", "\\P{So}", "\\p{^N}", "\\s",
                                         "\\S", "\\w", "(", ")", "?", "*", "+", "{1,3}", "a",
                                         "&&", "\\u00e9", "\\Q", "[:alpha:]", "\\h", "|", "(?!",
                                         "\\pL", "\\p{", "é", "\\x{1F600}", "$", "."};
    di_rng r;
    di_rng_init(&r, 77);
    tok_matcher m;
    di_error e;
    cr_assert_eq(tok_matcher_init(&m, &e), DI_OK);
    size_t ok = 0;
    for (int it = 0; it < 3000; it++) {
        tok_buf pat = {0};
        for (size_t k = 1 + pick(&r, 8); k > 0; k--)
            tok_buf_appends(&pat, PIECES[pick(&r, sizeof PIECES / sizeof PIECES[0])], &e);
        pcre2_code *re = NULL;
        di_status st = tok_regex_compile(pat.p, pat.n, pick(&r, 4) != 0, &re, &e);
        if (st == DI_OK) {
            ok++;
            const char *text = "ab é 12 [x] \\ 🫨 ^$";
            size_t a, b, off = 0;
            while (tok_regex_next(&m, re, text, strlen(text), off, &a, &b, &e) == DI_OK) {
                cr_assert(a < b && b <= strlen(text));
                off = b;
            }
            pcre2_code_free(re);
        } else {
            cr_assert(e.msg[0], "refused pattern '%s' without a message", pat.p);
        }
        tok_buf_free(&pat);
    }
    tok_matcher_free(&m);
    cr_assert_gt(ok, 300);
}

/* A random string: raw bytes, or valid UTF-8 drawn from many ranges, or added-token pieces. */
static size_t random_text(di_rng *r, char *out, size_t cap)
{
    static const uint32_t RANGES[][2] = {
        {0x00, 0x7F}, {0x80, 0x7FF}, {0x4E00, 0x9FA5}, {0x3040, 0x30FF}, {0xAC00, 0xD7A3},
        {0x0300, 0x036F}, {0x1F300, 0x1FAFF}, {0xE000, 0xF8FF}, {0x10000, 0x10FFFF},
        {0x2000, 0x206F}, {0x0600, 0x06FF}, {0x0E00, 0x0E7F}, {0xFE00, 0xFEFF},
    };
    static const char *const PIECES[] = {"<｜", "User", "｜>", "<|EOT|>", "▁", "<｜end▁of▁sentence｜>"};
    size_t n = 0, want = pick(r, cap - 8);
    int mode = (int)pick(r, 3);
    while (n < want) {
        if (mode == 0) {
            out[n++] = (char)di_rng_u32(r);
        } else if (mode == 1 || pick(r, 2)) {
            const uint32_t *g = RANGES[pick(r, sizeof RANGES / sizeof RANGES[0])];
            uint32_t cp = g[0] + (uint32_t)pick(r, g[1] - g[0] + 1);
            if (cp >= 0xD800 && cp < 0xE000)
                continue;
            n += tok_utf8_encode(cp, (uint8_t *)out + n);
        } else {
            const char *p = PIECES[pick(r, sizeof PIECES / sizeof PIECES[0])];
            if (n + strlen(p) >= cap)
                break;
            memcpy(out + n, p, strlen(p));
            n += strlen(p);
        }
    }
    return n;
}

Test(mutations, random_bytes_through_the_encoder)
{
    tok_tokenizer *t = tt_deepseek();
    di_rng r;
    di_rng_init(&r, 99);
    size_t valid = 0;
    char buf[320];
    for (int it = 0; it < 3000; it++) {
        size_t n = random_text(&r, buf, sizeof buf);
        bool ok_utf8 = tok_utf8_valid_prefix((const uint8_t *)buf, n) == n;
        tok_ids ids = {0};
        di_error e;
        di_status st = tok_encode(t, buf, n, &ids, &e);
        if (!ok_utf8) {
            cr_assert_eq(st, DI_EINVAL);
            cr_assert(strstr(e.msg, "not valid UTF-8 at byte") != NULL, "%s", e.msg);
            cr_assert_eq(ids.n, 0);
            continue;
        }
        valid++;
        cr_assert_eq(st, DI_OK, "%s", e.msg);
        char *out = NULL;
        size_t len = 0;
        cr_assert_eq(tok_decode(t, ids.v, ids.n, 0, &out, &len, &e), DI_OK);
        cr_assert_eq(len, n, "round trip length");
        cr_assert_eq(memcmp(out, buf, n), 0, "round trip");
        free(out);
        tok_ids_free(&ids);
    }
    cr_assert_gt(valid, 1000);
    tok_free(t);
}
