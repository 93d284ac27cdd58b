/* tok_engram.c: Engram's compressed-token map (MODEL.md §2.9 step 1).
 *
 * The reference builds it with HF normalizers over each id's single-token decode:
 *   NFKC, NFD, StripAccents (drops General_Category Mark), Lowercase (per character),
 *   Replace([ \t\r\n]+ -> " "), Replace(^ $ -> U+E000), Strip (White_Space), Replace(U+E000
 *   -> " "), keeping the decoded text when the result is empty, and keying tokens whose decode
 *   contains U+FFFD by their stored form. Keys get ids in order of first appearance.
 * utf8proc gives NFKC, NFD, categories and simple lowercase; the one character whose full
 * lowercase differs from its simple one (U+0130) is split by NFD before lowercasing, so the
 * two agree here.
 */
#include <stdlib.h>
#include <string.h>
#include <utf8proc.h>

#include "common/tokenizer/tok_internal.h"

/* Unicode's White_Space property (what Rust's char::is_whitespace tests). */
static bool is_white_space(uint32_t c)
{
    return (c >= 0x09 && c <= 0x0D) || c == 0x20 || c == 0x85 || c == 0xA0 || c == 0x1680 ||
           (c >= 0x2000 && c <= 0x200A) || c == 0x2028 || c == 0x2029 || c == 0x202F ||
           c == 0x205F || c == 0x3000;
}

static bool is_mark(uint32_t c)
{
    utf8proc_category_t k = utf8proc_category((utf8proc_int32_t)c);
    return k == UTF8PROC_CATEGORY_MN || k == UTF8PROC_CATEGORY_MC || k == UTF8PROC_CATEGORY_ME;
}

static bool is_collapsed_space(uint32_t c)
{
    return c == ' ' || c == '\t' || c == '\r' || c == '\n';
}

/* Marks dropped, lowercase, [ \t\r\n]+ collapsed: s (valid UTF-8, NFD) -> out. */
static di_status fold(const char *s, size_t n, tok_buf *out, di_error *err)
{
    const uint8_t *u = (const uint8_t *)s;
    bool in_space = false;
    di_status st = DI_OK;
    for (size_t i = 0; i < n && !st;) {
        uint32_t c;
        i += tok_utf8_decode(u + i, n - i, &c);
        if (is_mark(c))
            continue;
        if (is_collapsed_space(c)) {
            if (!in_space)
                st = tok_buf_append(out, " ", 1, err);
            in_space = true;
            continue;
        }
        in_space = false;
        uint8_t enc[4];
        c = (uint32_t)utf8proc_tolower((utf8proc_int32_t)c);
        st = tok_buf_append(out, enc, tok_utf8_encode(c, enc), err);
    }
    return st;
}

/* White_Space stripped from both ends (unless the text is exactly " "), U+E000 -> ' '. */
static di_status strip_and_unsentinel(const tok_buf *in, tok_buf *out, di_error *err)
{
    const uint8_t *u = (const uint8_t *)in->p;
    size_t a = 0, b = in->n;
    if (!(in->n == 1 && u[0] == ' ')) {
        uint32_t c;
        while (a < b) {
            size_t k = tok_utf8_decode(u + a, b - a, &c);
            if (!is_white_space(c))
                break;
            a += k;
        }
        while (b > a) {
            size_t j = b - 1;
            while (j > a && (u[j] & 0xC0) == 0x80)
                j--;
            tok_utf8_decode(u + j, b - j, &c);
            if (!is_white_space(c))
                break;
            b = j;
        }
    }
    di_status st = DI_OK;
    for (size_t i = a; i < b && !st;) {
        uint32_t c;
        size_t k = tok_utf8_decode(u + i, b - i, &c);
        st = c == 0xE000 ? tok_buf_append(out, " ", 1, err) : tok_buf_append(out, u + i, k, err);
        i += k;
    }
    return st;
}

/* The key of one token's decoded text (valid UTF-8 without U+FFFD) into key. */
static di_status normal_key(const char *text, size_t n, tok_buf *key, tok_buf *scratch,
                            di_error *err)
{
    char *nfkc = NULL, *nfd = NULL;
    size_t nfkc_n = 0, nfd_n = 0;
    di_status st = tok_unicode_form(text, n, TOK_NORM_NFKC, &nfkc, &nfkc_n, err);
    if (!st)
        st = tok_unicode_form(nfkc, nfkc_n, TOK_NORM_NFD, &nfd, &nfd_n, err);
    scratch->n = 0;
    key->n = 0;
    if (!st)
        st = fold(nfd, nfd_n, scratch, err);
    if (!st)
        st = strip_and_unsentinel(scratch, key, err);
    if (!st && key->n == 0)
        st = tok_buf_append(key, text, n, err); /* empty: keep the text itself */
    free(nfkc);
    free(nfd);
    return st;
}

static bool has_replacement(const uint8_t *b, size_t n)
{
    static const uint8_t FFFD[3] = {0xEF, 0xBF, 0xBD};
    return n >= 3 && memmem(b, n, FFFD, 3) != NULL;
}

/* The key of one id: its normalised text, or its stored form for part of a character. */
static di_status id_key(const tok_tokenizer *t, int32_t id, tok_buf *key, tok_buf *scratch,
                        di_error *err)
{
    size_t bn = 0, sn = 0;
    const uint8_t *b = tok_token_bytes(t, id, &bn);
    if (!b) {
        key->n = 0; /* an id with no token decodes to "" */
        return tok_buf_append(key, "", 0, err);
    }
    if (tok_utf8_valid_prefix(b, bn) != bn || has_replacement(b, bn)) {
        const char *s = tok_token_str(t, id, &sn);
        key->n = 0;
        return tok_buf_append(key, s, sn, err);
    }
    return normal_key((const char *)b, bn, key, scratch, err);
}

di_status tok_engram_map_build(const tok_tokenizer *t, int32_t vocab_size, int32_t pad_token_id,
                               tok_engram_map **out, di_error *err)
{
    if (!t || !out)
        return di_fail(err, DI_EINVAL, "tok_engram_map_build: tokenizer and out must not be NULL");
    int32_t n = t->n_ids;
    if (vocab_size == 0)
        vocab_size = n;
    if (vocab_size < n)
        return di_fail(err, DI_EINVAL, "vocab_size %d is below the tokenizer's %d ids",
                       vocab_size, n);
    if (pad_token_id < 0 || pad_token_id >= n)
        return di_fail(err, DI_EINVAL, "pad_token_id %d outside the tokenizer's ids [0, %d)",
                       pad_token_id, n);
    tok_engram_map *m = calloc(1, sizeof *m);
    int32_t *map = malloc((size_t)vocab_size * sizeof *map);
    tok_smap keys;
    tok_buf key = {0}, scratch = {0};
    di_status st = (m && map) ? tok_smap_init(&keys, (size_t)n, err)
                              : di_fail(err, DI_ENOMEM, "out of memory for the Engram map");
    bool keys_ready = !st;
    int32_t next = 0;
    for (int32_t id = 0; id < n && !st; id++) {
        int32_t found;
        st = id_key(t, id, &key, &scratch, err);
        if (!st)
            st = tok_smap_put(&keys, key.p, key.n, next, &found, err);
        if (!st)
            map[id] = found >= 0 ? found : next++;
    }
    for (int32_t id = n; id < vocab_size && !st; id++)
        map[id] = map[pad_token_id];
    if (keys_ready)
        tok_smap_free(&keys);
    tok_buf_free(&key);
    tok_buf_free(&scratch);
    if (st) {
        free(map);
        free(m);
        return st;
    }
    *m = (tok_engram_map){vocab_size, n, next, pad_token_id, map};
    *out = m;
    return DI_OK;
}

di_status tok_engram_map_to_json(const tok_engram_map *m, json_t **out, di_error *err)
{
    if (!m || !out)
        return di_fail(err, DI_EINVAL, "tok_engram_map_to_json: map and out must not be NULL");
    json_t *arr = json_array();
    json_t *o = json_object();
    int bad = !arr || !o;
    for (int32_t i = 0; i < m->vocab_size && !bad; i++)
        bad = json_array_append_new(arr, json_integer(m->map[i]));
    if (!bad)
        bad = json_object_set_new(o, "vocab_size", json_integer(m->vocab_size)) ||
              json_object_set_new(o, "compressed_vocab_size",
                                  json_integer(m->compressed_vocab_size)) ||
              json_object_set_new(o, "pad_token_id", json_integer(m->pad_token_id)) ||
              json_object_set(o, "map", arr);
    json_decref(arr);
    if (bad) {
        json_decref(o);
        return di_fail(err, DI_ENOMEM, "out of memory writing the Engram map as JSON");
    }
    *out = o;
    return DI_OK;
}

void tok_engram_map_free(tok_engram_map *m)
{
    if (!m)
        return;
    free(m->map);
    free(m);
}
