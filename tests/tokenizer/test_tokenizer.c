/* The tokenizer's loader, encoder and decoder: the DEPS.md oracle vectors, special tokens,
 * BPE order on small hand-built vocabularies, and every refusal the loader and encoder make. */
#include <criterion/criterion.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "common/tokenizer/tok_internal.h"
#include "tests/tokenizer/tok_test_util.h"

static void assert_ids(const tok_ids *got, const int32_t *want, size_t n, const char *what)
{
    cr_assert_eq(got->n, n, "%s: %zu ids, expected %zu", what, got->n, n);
    for (size_t i = 0; i < n; i++)
        cr_assert_eq(got->v[i], want[i], "%s: id %zu is %d, expected %d", what, i, got->v[i],
                     want[i]);
}

/* A text and the ids it must encode to. */
typedef struct enc_row {
    const char *text; /* UTF-8 */
    int32_t ids[8];   /* expected ids */
    size_t n;         /* how many */
} enc_row;

static void check_rows(const tok_tokenizer *t, const enc_row *rows, size_t n)
{
    for (size_t r = 0; r < n; r++) {
        tok_ids ids = tt_encode(t, rows[r].text, strlen(rows[r].text));
        assert_ids(&ids, rows[r].ids, rows[r].n, rows[r].text);
        tok_ids_free(&ids);
    }
}

static char *decode_ok(const tok_tokenizer *t, const int32_t *ids, size_t n, unsigned flags)
{
    char *text = NULL;
    size_t len = 0;
    di_error e;
    cr_assert_eq(tok_decode(t, ids, n, flags, &text, &len, &e), DI_OK, "%s", e.msg);
    cr_assert_eq(strlen(text), len);
    return text;
}

/* DEPS.md §7: three strings whose ids the npm package and HF's Rust tokenizers agree on. */
Test(tokenizer, deps_oracle_vectors)
{
    static const char *const TEXT[3] = {
        "Hello, world! The quick brown fox jumps over the lazy dog 12345.",
        "你好，世界！今天天气很好，我们去公园散步吧。",
        "def greet(name):\n    return f\"Hi {name} 👋🚀\"  # ✅ done\n",
    };
    static const int32_t V0[] = {19923, 14, 2058, 3, 455, 4787, 13769, 46012, 54994,
                                 1060, 270, 41638, 6397, 223, 6895, 1883, 16};
    static const int32_t V1[] = {30594, 303, 3427, 1175, 5237, 16652, 12210,
                                 303, 61835, 17781, 52843, 2996, 320};
    static const int32_t V2[] = {3465, 49166, 17984, 3395, 361, 1354, 285, 4,
                                 23166, 680, 2852, 95, 52780, 236, 74287, 225,
                                 4, 223, 1823, 82981, 3989, 201};
    const int32_t *want[3] = {V0, V1, V2};
    size_t nwant[3] = {17, 13, 22};
    tok_tokenizer *t = tt_deepseek();
    for (int k = 0; k < 3; k++) {
        tok_ids ids = tt_encode(t, TEXT[k], strlen(TEXT[k]));
        assert_ids(&ids, want[k], nwant[k], TEXT[k]);
        char *back = decode_ok(t, ids.v, ids.n, 0);
        cr_assert_str_eq(back, TEXT[k]);
        free(back);
        tok_ids_free(&ids);
    }
    tok_free(t);
}

Test(tokenizer, vocabulary_and_config_ids)
{
    tok_tokenizer *t = tt_deepseek();
    cr_assert_eq(tok_vocab_size(t), 128815);
    cr_assert_eq(tok_bos_id(t), 0);
    cr_assert_eq(tok_eos_id(t), 1);
    cr_assert_eq(tok_pad_id(t), 1, "tokenizer_config.json's pad_token is the EOS text");
    cr_assert_eq(tok_token_id(t, "Ġthe", strlen("Ġthe")), 270);
    cr_assert_eq(tok_token_id(t, "<｜User｜>", strlen("<｜User｜>")), 128803);
    cr_assert_eq(tok_token_id(t, "no such token", 13), -1);
    cr_assert(tok_is_special(t, 0));
    cr_assert(tok_is_special(t, 128805), "<|EOT|> is flagged special");
    cr_assert(!tok_is_special(t, 128803), "<｜User｜> is not special");
    cr_assert(!tok_is_special(t, 270));
    size_t n = 0;
    cr_assert_str_eq(tok_token_str(t, 128804, &n), "<｜Assistant｜>");
    cr_assert_null(tok_token_str(t, 128815, &n));
    const uint8_t *b = tok_token_bytes(t, 270, &n);
    cr_assert_eq(n, 4);
    cr_assert_eq(memcmp(b, " the", 4), 0);
    tok_free(t);
}

Test(tokenizer, added_tokens_inside_text)
{
    tok_tokenizer *t = tt_deepseek();
    static const enc_row ROWS[] = {
        {"<｜User｜>hi<｜Assistant｜>", {128803, 6366, 128804}, 3},
        {"<|EOT|>x", {128805, 90}, 2},
        {"a<｜begin▁of▁sentence｜>b", {67, 0, 68}, 3},
        {"<｜place▁holder▁no▁10｜><｜place▁holder▁no▁1｜>", {128010, 128001}, 2},
        /* near misses stay text */
        {"<｜User｜ >", {30, 28217, 6756, 28217, 1955}, 5},
    };
    check_rows(t, ROWS, sizeof ROWS / sizeof ROWS[0]);
    tok_free(t);
}

/* Where the npm package (JavaScript \s) and HF's Rust tokenizers (Oniguruma \s) disagree, we
 * follow HF: U+0085 is white space, U+FEFF and U+180E are not. Ids from HF tokenizers 0.23.2. */
Test(tokenizer, white_space_follows_oniguruma)
{
    tok_tokenizer *t = tt_deepseek();
    static const enc_row ROWS[] = {
        {"x \xc2\x85\xc2\x85 y", {90, 1203, 230, 129, 230, 383}, 6},
        {"x  \xef\xbb\xbf\xef\xbb\xbfy", {90, 223, 223, 15251, 15251, 91}, 6},
        {"a\xe1\xa0\x8e b", {67, 115522, 239, 291}, 4},
    };
    check_rows(t, ROWS, sizeof ROWS / sizeof ROWS[0]);
    tok_free(t);
}

Test(tokenizer, decode_special_and_partial_characters)
{
    tok_tokenizer *t = tt_deepseek();
    int32_t ids[] = {0, 19923, 1};
    char *s = decode_ok(t, ids, 3, 0);
    cr_assert_str_eq(s, "<｜begin▁of▁sentence｜>Hello<｜end▁of▁sentence｜>");
    free(s);
    s = decode_ok(t, ids, 3, TOK_DECODE_SKIP_SPECIAL);
    cr_assert_str_eq(s, "Hello");
    free(s);
    /* 52780 is "Ġð Ł ĳ": a space and 3 of the 4 bytes of 👋 (236 is the last one). */
    int32_t part[] = {52780};
    s = decode_ok(t, part, 1, 0);
    cr_assert_str_eq(s, " \xef\xbf\xbd", "an incomplete character decodes to U+FFFD");
    free(s);
    int32_t whole[] = {52780, 236};
    s = decode_ok(t, whole, 2, 0);
    cr_assert_str_eq(s, " 👋");
    free(s);
    s = decode_ok(t, NULL, 0, 0);
    cr_assert_str_eq(s, "");
    free(s);
    tok_free(t);
}

Test(tokenizer, decode_refuses_bad_ids)
{
    tok_tokenizer *t = tt_deepseek();
    char *out = (char *)"untouched";
    size_t len = 7;
    di_error e;
    int32_t bad[][2] = {{5, -1}, {5, 128815}, {5, INT32_MAX}};
    for (int k = 0; k < 3; k++) {
        cr_assert_eq(tok_decode(t, bad[k], 2, 0, &out, &len, &e), DI_ERANGE);
        cr_assert(strstr(e.msg, "position 1") != NULL, "%s", e.msg);
        cr_assert_str_eq(out, "untouched");
        cr_assert_eq(len, 7);
    }
    cr_assert_eq(tok_decode(t, bad[0], 1, 0x80, &out, &len, &e), DI_EINVAL);
    cr_assert_eq(tok_decode(NULL, bad[0], 1, 0, &out, &len, &e), DI_EINVAL);
    tok_free(t);
}

Test(tokenizer, encode_refuses_invalid_utf8)
{
    tok_tokenizer *t = tt_deepseek();
    static const struct {
        const char *bytes;
        size_t at;
    } ROWS[] = {
        {"ok\x80", 2},                 /* lone continuation byte */
        {"\xc0\x80", 0},               /* overlong NUL */
        {"ab\xed\xa0\x80", 2},         /* UTF-16 surrogate */
        {"\xf5\x80\x80\x80", 0},       /* above U+10FFFF */
        {"\xf4\x90\x80\x80", 0},       /* above U+10FFFF */
        {"x\xe4\xbd", 1},              /* truncated 3-byte character */
        {"\xe0\x9f\xbf", 0},           /* overlong 3-byte form */
        {"fine\xff tail", 4},
    };
    di_error e;
    for (size_t r = 0; r < sizeof ROWS / sizeof ROWS[0]; r++) {
        tok_ids ids = {0};
        cr_assert_eq(tok_ids_push(&ids, 77, &e), DI_OK);
        di_status st = tok_encode(t, ROWS[r].bytes, strlen(ROWS[r].bytes), &ids, &e);
        cr_assert_eq(st, DI_EINVAL, "row %zu", r);
        char want[64];
        snprintf(want, sizeof want, "at byte %zu", ROWS[r].at);
        cr_assert(strstr(e.msg, want) != NULL, "row %zu: %s", r, e.msg);
        cr_assert_eq(ids.n, 1, "the list is unchanged on failure");
        cr_assert_eq(ids.v[0], 77);
        tok_ids_free(&ids);
    }
    tok_ids ids = {0};
    cr_assert_eq(tok_encode(t, NULL, 3, &ids, &e), DI_EINVAL);
    cr_assert_eq(tok_encode(t, "", 0, &ids, &e), DI_OK);
    cr_assert_eq(ids.n, 0);
    cr_assert_eq(tok_encode(t, "x", TOK_MAX_INPUT_BYTES + 1, &ids, &e), DI_ERANGE);
    tok_free(t);
}

/* Embedded NUL and other control characters are ordinary text. */
Test(tokenizer, control_characters_round_trip)
{
    tok_tokenizer *t = tt_deepseek();
    const char text[] = "a\0b\x01\x1f\x7f\r\n\t\x0b\x0c end";
    size_t n = sizeof text - 1;
    tok_ids ids = tt_encode(t, text, n);
    cr_assert_gt(ids.n, 5);
    char *back = NULL;
    size_t len = 0;
    di_error e;
    cr_assert_eq(tok_decode(t, ids.v, ids.n, 0, &back, &len, &e), DI_OK);
    cr_assert_eq(len, n);
    cr_assert_eq(memcmp(back, text, n), 0);
    free(back);
    tok_ids_free(&ids);
    tok_free(t);
}

/* Long words, numbers and white-space runs: no failure, exact round trip, and a long run of
 * one letter costs no more ids than a BPE of it must (at least 1 per 16 bytes here). */
Test(tokenizer, long_inputs_round_trip)
{
    tok_tokenizer *t = tt_deepseek();
    size_t n = 200000;
    char *s = malloc(n + 1);
    const char fill[] = {'a', '7', ' ', '\n', '\t'};
    for (size_t k = 0; k < sizeof fill; k++) {
        memset(s, fill[k], n);
        s[n] = '\0';
        tok_ids ids = tt_encode(t, s, n);
        cr_assert_gt(ids.n, 0);
        cr_assert_lt(ids.n, n, "fill '%c'", fill[k]);
        char *back = NULL;
        size_t len = 0;
        di_error e;
        cr_assert_eq(tok_decode(t, ids.v, ids.n, 0, &back, &len, &e), DI_OK);
        cr_assert_eq(len, n);
        cr_assert_eq(memcmp(back, s, n), 0, "fill '%c'", fill[k]);
        free(back);
        tok_ids_free(&ids);
    }
    free(s);
    tok_free(t);
}

typedef struct enc_job {
    const tok_tokenizer *t; /* shared */
    const char *text;       /* shared */
    tok_ids ids;            /* this thread's result */
    di_status st;           /* this thread's status */
} enc_job;

static void *enc_thread(void *arg)
{
    enc_job *j = arg;
    di_error e;
    for (int rep = 0; rep < 20 && !j->st; rep++) {
        j->ids.n = 0;
        j->st = tok_encode(j->t, j->text, strlen(j->text), &j->ids, &e);
    }
    return NULL;
}

Test(tokenizer, threads_share_one_tokenizer)
{
    tok_tokenizer *t = tt_deepseek();
    const char *text = "Concurrent encoders share the word cache: the quick brown fox, 12345, "
                       "和 日本語のテキスト, and again the quick brown fox.";
    tok_ids want = tt_encode(t, text, strlen(text));
    enc_job jobs[4];
    pthread_t th[4];
    for (int k = 0; k < 4; k++) {
        jobs[k] = (enc_job){t, text, {0}, DI_OK};
        pthread_create(&th[k], NULL, enc_thread, &jobs[k]);
    }
    for (int k = 0; k < 4; k++) {
        pthread_join(th[k], NULL);
        cr_assert_eq(jobs[k].st, DI_OK);
        assert_ids(&jobs[k].ids, want.v, want.n, "thread");
        tok_ids_free(&jobs[k].ids);
    }
    tok_ids_free(&want);
    tok_free(t);
}

Test(tokenizer, load_file_errors)
{
    tok_tokenizer *t = (tok_tokenizer *)0x1;
    di_error e;
    cr_assert_eq(tok_load_file("/nonexistent/tokenizer.json", &t, &e), DI_ENOENT);
    cr_assert(strstr(e.msg, "/nonexistent/tokenizer.json") != NULL, "%s", e.msg);
    cr_assert_eq(t, (tok_tokenizer *)0x1, "output untouched");
    cr_assert_eq(tok_load_file(NULL, &t, &e), DI_EINVAL);
    /* the real file cut in half: malformed JSON, named with its path */
    size_t len = 0;
    char *text = tt_read_file(tt_source_path("data/tokenizer/deepseek-v3/tokenizer.json"), &len);
    cr_assert_not_null(text);
    cr_assert_eq(tok_load_json(text, len / 2, &t, &e), DI_EINVAL);
    cr_assert(strstr(e.msg, "invalid JSON") != NULL, "%s", e.msg);
    cr_assert_eq(tok_load_json(text, 0, &t, &e), DI_EINVAL);
    free(text);
    tok_free(NULL);
}
