/* Small hand-built tokenizer.json files: BPE merge order, the pieces a file may declare, and
 * every section the loader refuses, each with the message a user sees. The expected pieces of
 * the BPE and ByteLevel tests are what HF tokenizers 0.23.2 gives for the same files. */
#include <criterion/criterion.h>
#include <stdlib.h>
#include <string.h>

#include "common/tokenizer/tok_internal.h"
#include "tests/tokenizer/tok_test_util.h"

/* A byte-level vocabulary: ids 0..255 are the 256 bytes (GPT-2 map, in byte order), then the
 * merged tokens in the order of `merges` ("a b" strings over byte-level text). */
static json_t *mini_json(const char *const *merges, size_t nmerges)
{
    json_t *vocab = json_object();
    uint32_t b2c[256];
    int16_t c2b[TOK_BYTE_MAP_CPS];
    tok_byte_map(b2c, c2b);
    for (int b = 0; b < 256; b++) {
        uint8_t u[5] = {0};
        tok_utf8_encode(b2c[b], u);
        json_object_set_new(vocab, (const char *)u, json_integer(b));
    }
    json_t *ml = json_array();
    for (size_t i = 0; i < nmerges; i++) {
        char joined[64];
        const char *sp = strchr(merges[i], ' ');
        snprintf(joined, sizeof joined, "%.*s%s", (int)(sp - merges[i]), merges[i], sp + 1);
        if (!json_object_get(vocab, joined))
            json_object_set_new(vocab, joined, json_integer(256 + (json_int_t)i));
        json_array_append_new(ml, json_string(merges[i]));
    }
    return json_pack("{s:[], s:n, s:{s:s, s:o, s:o}, s:{s:s, s:b, s:b}, s:{s:s}, s:n}",
                     "added_tokens", "normalizer", "model", "type", "BPE", "vocab", vocab,
                     "merges", ml, "pre_tokenizer", "type", "ByteLevel", "add_prefix_space", 0,
                     "use_regex", 1, "decoder", "type", "ByteLevel", "post_processor");
}

static di_status load_obj(json_t *j, tok_tokenizer **t, di_error *e)
{
    char *text = json_dumps(j, JSON_COMPACT);
    di_status st = tok_load_json(text, strlen(text), t, e);
    free(text);
    json_decref(j);
    return st;
}

static tok_tokenizer *mini(const char *const *merges, size_t n)
{
    tok_tokenizer *t = NULL;
    di_error e;
    cr_assert_eq(load_obj(mini_json(merges, n), &t, &e), DI_OK, "%s", e.msg);
    return t;
}

/* The ids of text as a string of token texts joined by '|', for readable expectations. */
static char *pieces(const tok_tokenizer *t, const char *text)
{
    tok_ids ids = tt_encode(t, text, strlen(text));
    tok_buf b = {0};
    di_error e;
    for (size_t i = 0; i < ids.n; i++) {
        size_t n = 0;
        const uint8_t *p = tok_token_bytes(t, ids.v[i], &n);
        cr_assert_not_null(p);
        if (i)
            tok_buf_append(&b, "|", 1, &e);
        tok_buf_append(&b, p, n, &e);
    }
    tok_buf_append(&b, "", 0, &e);
    tok_ids_free(&ids);
    return b.p;
}

static void expect_pieces(const tok_tokenizer *t, const char *text, const char *want)
{
    char *got = pieces(t, text);
    cr_assert_str_eq(got, want, "text '%s'", text);
    free(got);
}

Test(loader, bpe_lowest_rank_first)
{
    static const char *const M[] = {"b c", "a b"};
    tok_tokenizer *t = mini(M, 2);
    expect_pieces(t, "abc", "a|bc");
    expect_pieces(t, "ab", "ab");
    expect_pieces(t, "abcab", "a|bc|ab");
    tok_free(t);
}

Test(loader, bpe_leftmost_among_equal_ranks)
{
    static const char *const M[] = {"a a"};
    tok_tokenizer *t = mini(M, 1);
    expect_pieces(t, "aaa", "aa|a");
    expect_pieces(t, "aaaaa", "aa|aa|a");
    tok_free(t);
}

Test(loader, bpe_merges_chain_and_skip_stale_pairs)
{
    /* "ab" forms first; then "abc" from (ab, c); the pair (b, c) went stale with it. */
    static const char *const M[] = {"a b", "ab c", "b c", "abc abc"};
    tok_tokenizer *t = mini(M, 4);
    expect_pieces(t, "abc", "abc");
    expect_pieces(t, "abcabc", "abcabc");
    expect_pieces(t, "bcabc", "bc|abc");
    tok_free(t);
}

Test(loader, bytelevel_regex_and_prefix_space)
{
    static const char *const M[] = {"Ġ h", "Ġh i"};
    json_t *j = mini_json(M, 2);
    tok_tokenizer *t = NULL;
    di_error e;
    json_object_set_new(json_object_get(j, "pre_tokenizer"), "add_prefix_space", json_true());
    cr_assert_eq(load_obj(j, &t, &e), DI_OK, "%s", e.msg);
    expect_pieces(t, "hi hi", " hi| hi");
    expect_pieces(t, " hi", " hi");
    tok_free(t);
}

Test(loader, split_removed_and_invert)
{
    static const char *const M[] = {"a b"};
    json_t *j = mini_json(M, 1);
    json_t *seq = json_pack("{s:s, s:[{s:s, s:{s:s}, s:s, s:b}, {s:s, s:b, s:b}]}", "type",
                            "Sequence", "pretokenizers", "type", "Split", "pattern", "String",
                            "-", "behavior", "Removed", "invert", 0, "type", "ByteLevel",
                            "add_prefix_space", 0, "use_regex", 0);
    json_object_set_new(j, "pre_tokenizer", seq);
    tok_tokenizer *t = NULL;
    di_error e;
    cr_assert_eq(load_obj(j, &t, &e), DI_OK, "%s", e.msg);
    expect_pieces(t, "ab-ab--b", "ab|ab|b");
    tok_free(t);
}

Test(loader, added_tokens_leftmost_longest_and_normalized_pass)
{
    static const char *const M[] = {"a b"};
    json_t *j = mini_json(M, 1);
    json_t *added = json_pack(
        "[{s:i, s:s, s:b, s:b}, {s:i, s:s, s:b, s:b}, {s:i, s:s, s:b, s:b}]", "id", 300,
        "content", "<x>", "special", 1, "normalized", 0, "id", 301, "content", "<x>y",
        "special", 0, "normalized", 0, "id", 302, "content", "Å", "special", 0, "normalized", 1);
    json_object_set_new(j, "added_tokens", added);
    json_object_set_new(j, "normalizer", json_pack("{s:s, s:[{s:s}]}", "type", "Sequence",
                                                   "normalizers", "type", "NFC"));
    tok_tokenizer *t = NULL;
    di_error e;
    cr_assert_eq(load_obj(j, &t, &e), DI_OK, "%s", e.msg);
    tok_ids ids = tt_encode(t, "ab<x>y<x>A\xcc\x8a", strlen("ab<x>y<x>A\xcc\x8a"));
    int32_t want[] = {256, 301, 300, 302}; /* A + U+030A becomes Å under NFC */
    cr_assert_eq(ids.n, 4);
    for (int k = 0; k < 4; k++)
        cr_assert_eq(ids.v[k], want[k], "id %d", k);
    tok_ids_free(&ids);
    tok_free(t);
}

Test(loader, ignore_merges_takes_whole_words)
{
    static const char *const M[] = {"a b", "c d"};
    json_t *j = mini_json(M, 2);
    json_t *vocab = json_object_get(json_object_get(j, "model"), "vocab");
    json_object_set_new(vocab, "abcd", json_integer(400));
    json_object_set_new(json_object_get(j, "model"), "ignore_merges", json_true());
    tok_tokenizer *t = NULL;
    di_error e;
    cr_assert_eq(load_obj(j, &t, &e), DI_OK, "%s", e.msg);
    tok_ids ids = tt_encode(t, "abcd", 4);
    cr_assert_eq(ids.n, 1);
    cr_assert_eq(ids.v[0], 400);
    tok_ids_free(&ids);
    expect_pieces(t, "abc", "ab|c");
    tok_free(t);
}

/* One refused file per row: a JSON path to change, its new value, the code, a message part. */
typedef struct refusal_row {
    const char *section; /* top-level key, or "model" */
    const char *key;     /* key inside it; NULL: replace the section */
    const char *value;   /* JSON text of the new value */
    di_status code;      /* expected status */
    const char *msg;     /* expected part of the message */
} refusal_row;

static const refusal_row REFUSALS[] = {
    {"model", "type", "\"WordPiece\"", DI_EUNSUPPORTED, "unsupported model type 'WordPiece'"},
    {"model", "byte_fallback", "true", DI_EUNSUPPORTED, "'byte_fallback'"},
    {"model", "dropout", "0.1", DI_EUNSUPPORTED, "'dropout'"},
    {"model", "vocab", "[]", DI_EINVAL, "key 'vocab': expected an object"},
    {"model", "merges", "[\"a\"]", DI_EINVAL, "expected two tokens and one space"},
    {"model", "merges", "[\"a zz\"]", DI_EINVAL, "token 'zz' is not in the vocabulary"},
    {"model", "merges", "[3]", DI_EINVAL, "model.merges[0]"},
    {"model", "unk_token", "\"<unk>\"", DI_EINVAL, "unk_token '<unk>' is not in the vocabulary"},
    {"pre_tokenizer", NULL, "{\"type\": \"Metaspace\"}", DI_EUNSUPPORTED,
     "unsupported pre_tokenizer type 'Metaspace'"},
    {"pre_tokenizer", NULL, "null", DI_EUNSUPPORTED, "ByteLevel"},
    {"pre_tokenizer", NULL,
     "{\"type\": \"Sequence\", \"pretokenizers\": [{\"type\": \"ByteLevel\"}, {\"type\": "
     "\"Split\", \"pattern\": {\"String\": \"x\"}, \"behavior\": \"Isolated\"}]}",
     DI_EUNSUPPORTED, "must end with one ByteLevel"},
    {"pre_tokenizer", NULL,
     "{\"type\": \"Sequence\", \"pretokenizers\": [{\"type\": \"Split\", \"pattern\": "
     "{\"Regex\": \"x\"}, \"behavior\": \"MergedWithPrevious\"}, {\"type\": \"ByteLevel\"}]}",
     DI_EUNSUPPORTED, "unsupported Split behavior 'MergedWithPrevious'"},
    {"pre_tokenizer", NULL,
     "{\"type\": \"Sequence\", \"pretokenizers\": [{\"type\": \"Split\", \"pattern\": "
     "{\"Regex\": \"(ab\"}, \"behavior\": \"Isolated\"}, {\"type\": \"ByteLevel\"}]}",
     DI_EINVAL, "regex rejected by PCRE2"},
    {"pre_tokenizer", NULL,
     "{\"type\": \"Sequence\", \"pretokenizers\": [{\"type\": \"Split\", \"pattern\": "
     "{\"Regex\": \"[a[b]]\"}, \"behavior\": \"Isolated\"}, {\"type\": \"ByteLevel\"}]}",
     DI_EUNSUPPORTED, "nested bracket"},
    {"pre_tokenizer", NULL,
     "{\"type\": \"Sequence\", \"pretokenizers\": [{\"type\": \"Split\", \"pattern\": "
     "{\"Other\": \"x\"}, \"behavior\": \"Isolated\"}, {\"type\": \"ByteLevel\"}]}",
     DI_EINVAL, "key 'pattern'"},
    {"normalizer", NULL, "{\"type\": \"Lowercase\"}", DI_EUNSUPPORTED,
     "unsupported normalizer type 'Lowercase'"},
    {"normalizer", NULL, "{\"type\": \"Sequence\"}", DI_EINVAL, "key 'normalizers'"},
    {"decoder", NULL, "{\"type\": \"WordPiece\"}", DI_EUNSUPPORTED,
     "unsupported decoder type 'WordPiece'"},
    {"decoder", NULL, "null", DI_EUNSUPPORTED, "decoder is null"},
    {"post_processor", NULL, "{\"type\": \"TemplateProcessing\"}", DI_EUNSUPPORTED,
     "unsupported post_processor type 'TemplateProcessing'"},
    {"added_tokens", NULL, "[{\"id\": 300, \"content\": \"<m>\", \"lstrip\": true}]",
     DI_EUNSUPPORTED, "unsupported added token flag 'lstrip'"},
    {"added_tokens", NULL, "[{\"id\": -4, \"content\": \"<m>\"}]", DI_EINVAL,
     "added_tokens[0]"},
    {"added_tokens", NULL, "[{\"id\": 300, \"content\": \"\"}]", DI_EINVAL, "empty content"},
    {"added_tokens", NULL, "{}", DI_EINVAL, "key 'added_tokens': expected an array"},
    {"model", NULL, "null", DI_EINVAL, "missing key 'model'"},
    {"model", "type", "7", DI_EINVAL, "model: key 'type'"},
};

Test(loader, refusals_name_what_is_wrong)
{
    static const char *const M[] = {"a b"};
    for (size_t r = 0; r < sizeof REFUSALS / sizeof REFUSALS[0]; r++) {
        const refusal_row *row = &REFUSALS[r];
        json_t *j = mini_json(M, 1);
        json_error_t je;
        json_t *v = json_loads(row->value, JSON_DECODE_ANY, &je);
        cr_assert_not_null(v, "row %zu: bad test JSON: %s", r, je.text);
        if (row->key)
            json_object_set_new(json_object_get(j, row->section), row->key, v);
        else if (json_is_null(v) && strcmp(row->section, "model") == 0)
            json_object_del(j, "model"), json_decref(v);
        else
            json_object_set_new(j, row->section, v);
        tok_tokenizer *t = (tok_tokenizer *)0x1;
        di_error e;
        di_status st = load_obj(j, &t, &e);
        cr_assert_eq(st, row->code, "row %zu: status %d, message '%s'", r, st, e.msg);
        cr_assert(strstr(e.msg, row->msg) != NULL, "row %zu: message '%s' lacks '%s'", r, e.msg,
                  row->msg);
        cr_assert_eq(t, (tok_tokenizer *)0x1, "row %zu: output written on failure", r);
    }
}

Test(loader, oniguruma_escapes_rewritten_for_pcre2)
{
    static const struct {
        const char *in;
        const char *out;
    } ROWS[] = {
        {"\\s+", "[\\t-\\r\\x{85}\\p{Z}]+"},
        {"\\S", "[^\\t-\\r\\x{85}\\p{Z}]"},
        {"[^\\s\\p{Zs}]", "[^\\t-\\r\\x{85}\\p{Z}\\p{Zs}]"},
        {"\\h\\H", "[0-9A-Fa-f][^0-9A-Fa-f]"},
        {"\\u00e9x", "\\x{00e9}x"},
        {"\\\\s", "\\\\s"},
        {"[]s]\\s", "[]s][\\t-\\r\\x{85}\\p{Z}]"},
        {"[[:alpha:]\\d]", "[[:alpha:]\\d]"},
        {"\\p{Han}+\\p{Cn}\\p{Zs}", "\\p{Han}+\\p{Cn}\\p{Zs}"},
    };
    di_error e;
    for (size_t r = 0; r < sizeof ROWS / sizeof ROWS[0]; r++) {
        tok_buf b = {0};
        cr_assert_eq(tok_regex_translate(ROWS[r].in, strlen(ROWS[r].in), &b, &e), DI_OK, "%s",
                     e.msg);
        tok_buf_append(&b, "", 0, &e);
        cr_assert_str_eq(b.p, ROWS[r].out, "pattern '%s'", ROWS[r].in);
        tok_buf_free(&b);
    }
    static const char *const BAD[] = {"[\\S]", "[a&&b]", "\\Qx\\E", "x\\", "[\\P{L}]",
                                      "[\\p{^So}]"};
    for (size_t r = 0; r < sizeof BAD / sizeof BAD[0]; r++) {
        tok_buf b = {0};
        cr_assert_neq(tok_regex_translate(BAD[r], strlen(BAD[r]), &b, &e), DI_OK, "%s", BAD[r]);
        tok_buf_free(&b);
    }
}

static bool regex_matches(const char *pattern, const char *text)
{
    pcre2_code *re = NULL;
    tok_matcher m;
    di_error e;
    size_t a, b;
    cr_assert_eq(tok_regex_compile(pattern, strlen(pattern), true, &re, &e), DI_OK, "%s: %s",
                 pattern, e.msg);
    cr_assert_eq(tok_matcher_init(&m, &e), DI_OK);
    di_status st = tok_regex_next(&m, re, text, strlen(text), 0, &a, &b, &e);
    cr_assert(st == DI_OK || st == DI_ENOENT, "%s", e.msg);
    tok_matcher_free(&m);
    pcre2_code_free(re);
    return st == DI_OK && a == 0 && b == strlen(text);
}

/* Characters Unicode assigned after PCRE2 10.42's tables (14.0) get HF's (16.0) categories:
 * U+1FAE8 SHAKING FACE is So (15.0), U+11F04 KAWI LETTER A is Lo (15.0), U+1CC00 is So
 * (16.0). U+20C1 (17.0) stays unassigned, as in HF. */
Test(loader, properties_know_unicode_15_and_16)
{
    static const struct {
        const char *pattern;
        const char *text;
        bool match;
    } ROWS[] = {
        {"\\p{So}", "\xf0\x9f\xab\xa8", true},   {"\\p{S}", "\xf0\x9f\xab\xa8", true},
        {"[\\p{P}\\p{S}]+", "!\xf0\x9f\xab\xa8", true},
        {"\\P{So}", "\xf0\x9f\xab\xa8", false},  {"\\p{^S}", "\xf0\x9f\xab\xa8", false},
        {"[^\\p{S}]", "\xf0\x9f\xab\xa8", false}, {"\\pL", "\xf0\x91\xbc\x84", true},
        {"\\w", "\xf0\x91\xbc\x84", true},       {"\\W", "\xf0\x91\xbc\x84", false},
        {"\\p{Lo}+", "\xf0\x91\xbc\x84", true},  {"\\p{So}", "\xf0\x9c\xb0\x80", true},
        {"\\p{Sc}", "\xe2\x83\x81", false},      {"\\p{L}", "a", true},
        {"\\s", "\xe1\xa0\x8e", false},          {"\\s", "\xc2\x85", true},
    };
    for (size_t r = 0; r < sizeof ROWS / sizeof ROWS[0]; r++)
        cr_assert_eq(regex_matches(ROWS[r].pattern, ROWS[r].text), ROWS[r].match, "row %zu: %s",
                     r, ROWS[r].pattern);
}

Test(loader, sparse_ids_decode_refused)
{
    static const char *const M[] = {"a b"};
    json_t *j = mini_json(M, 1);
    json_object_set_new(j, "added_tokens",
                        json_pack("[{s:i, s:s, s:b}]", "id", 1000, "content", "<end>", "special", 1));
    tok_tokenizer *t = NULL;
    di_error e;
    cr_assert_eq(load_obj(j, &t, &e), DI_OK, "%s", e.msg);
    cr_assert_eq(tok_vocab_size(t), 1001);
    int32_t gap[] = {999};
    char *out = NULL;
    size_t len = 0;
    cr_assert_eq(tok_decode(t, gap, 1, 0, &out, &len, &e), DI_ERANGE);
    cr_assert(strstr(e.msg, "has no token") != NULL, "%s", e.msg);
    tok_free(t);
}
