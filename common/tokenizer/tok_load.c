/* tok_load.c: tokenizer.json (and tokenizer_config.json) -> tok_tokenizer.
 *
 * Each section of the file has one loader below, and each declared "type" one row in a
 * table; a type with no row is refused with its name. The order: the model (vocab, merges),
 * the added tokens, the normalizer, the pre-tokenizer, the post-processor and decoder checks,
 * then the per-id tables (stored form and decoded bytes of every id).
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/tokenizer/tok_internal.h"
#include "common/util/json_read.h"

#define TOK_MAX_IDS (1 << 24)                /* ids beyond 16.7 M are refused */
#define TOK_MAX_FILE_BYTES ((size_t)1 << 30) /* tokenizer.json above 1 GiB is refused */

/* A token text for messages: at most 40 bytes. */
#define SHOW(s, n) (int)((n) > 40 ? 40 : (n)), (s)

static const char GPT2_PATTERN[] =
    "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+";

/* The "type" of a section, or a message naming what is missing. */
static di_status type_of(const json_t *obj, const char *what, const char **type, di_error *err)
{
    if (!json_is_object(obj))
        return di_fail(err, DI_EINVAL, "%s: expected an object, got %s", what,
                       di_json_type_name(obj));
    di_status st = di_json_str(obj, "type", type, err);
    if (st)
        di_error_prefix(err, "%s: ", what);
    return st;
}

/* A JSON string's bytes (may hold NUL), or an error naming what it is. */
static di_status str_of(const json_t *v, const char *what, size_t index, const char **s,
                        size_t *n, di_error *err)
{
    if (!json_is_string(v))
        return di_fail(err, DI_EINVAL, "%s[%zu]: expected a string, got %s", what, index,
                       di_json_type_name(v));
    *s = json_string_value(v);
    *n = json_string_length(v);
    return DI_OK;
}

/* ---- model ------------------------------------------------------------------------------ */

/* An option of the BPE model that must be absent, null, false or empty. */
static di_status bpe_option_off(const json_t *model, const char *key, di_error *err)
{
    const json_t *v = json_object_get(model, key);
    if (!v || json_is_null(v) || json_is_false(v) || (json_is_string(v) && !json_string_length(v)) ||
        (json_is_number(v) && json_number_value(v) == 0.0))
        return DI_OK;
    return di_fail(err, DI_EUNSUPPORTED, "unsupported BPE option '%s' (only null/false/empty)",
                   key);
}

static di_status load_vocab(tok_tokenizer *t, const json_t *vocab, int32_t *max_id,
                            di_error *err)
{
    if (!json_is_object(vocab))
        return di_fail(err, DI_EINVAL, "model: key 'vocab': expected an object, got %s",
                       di_json_type_name(vocab));
    di_status st = tok_smap_init(&t->vocab, json_object_size(vocab), err);
    const char *key;
    size_t klen;
    json_t *v;
    *max_id = -1;
    json_object_keylen_foreach((json_t *)vocab, key, klen, v)
    {
        if (st)
            break;
        if (!json_is_integer(v) || json_integer_value(v) < 0 ||
            json_integer_value(v) >= TOK_MAX_IDS)
            return di_fail(err, DI_EINVAL, "model.vocab['%.*s']: expected an id in [0, %d)",
                           SHOW(key, klen), TOK_MAX_IDS);
        int32_t id = (int32_t)json_integer_value(v), found;
        st = tok_smap_put(&t->vocab, key, klen, id, &found, err);
        if (id > *max_id)
            *max_id = id;
    }
    return st;
}

/* One merge: its two parts, from "a b" or ["a", "b"]. */
static di_status merge_parts(const json_t *m, size_t rank, const char **a, size_t *an,
                             const char **b, size_t *bn, di_error *err)
{
    if (json_is_array(m) && json_array_size(m) == 2) {
        di_status st = str_of(json_array_get(m, 0), "model.merges", rank, a, an, err);
        if (!st)
            st = str_of(json_array_get(m, 1), "model.merges", rank, b, bn, err);
        return st;
    }
    const char *s;
    size_t n;
    di_status st = str_of(m, "model.merges", rank, &s, &n, err);
    if (st)
        return di_fail(err, DI_EINVAL, "model.merges[%zu]: expected \"a b\" or [\"a\", \"b\"]",
                       rank);
    const char *sp = memchr(s, ' ', n);
    if (!sp || memchr(sp + 1, ' ', n - (size_t)(sp + 1 - s)))
        return di_fail(err, DI_EINVAL, "model.merges[%zu] '%.*s': expected two tokens and one space",
                       rank, SHOW(s, n));
    *a = s;
    *an = (size_t)(sp - s);
    *b = sp + 1;
    *bn = n - *an - 1;
    return DI_OK;
}

static int32_t vocab_id(const tok_tokenizer *t, const char *s, size_t n)
{
    return tok_smap_get(&t->vocab, s, n);
}

static void merge_store(tok_tokenizer *t, int32_t left, int32_t right, int32_t rank,
                        int32_t merged)
{
    uint64_t key = ((uint64_t)(uint32_t)left << 32) | (uint32_t)right;
    size_t i = (size_t)((key * 0x9E3779B97F4A7C15ull) >> 20) & t->merge_mask;
    while (t->merges[i].key != UINT64_MAX && t->merges[i].key != key)
        i = (i + 1) & t->merge_mask;
    /* A repeated pair takes the later rank, as HF's merge map does. */
    t->merges[i] = (tok_merge_slot){key, rank, merged};
}

static di_status load_merges(tok_tokenizer *t, const json_t *merges, di_error *err)
{
    if (!json_is_array(merges))
        return di_fail(err, DI_EINVAL, "model: key 'merges': expected an array, got %s",
                       di_json_type_name(merges));
    size_t n = json_array_size(merges), slots = 16;
    if (n >= TOK_MAX_IDS)
        return di_fail(err, DI_EINVAL, "model.merges: %zu merges is too many", n);
    while (slots < 2 * n)
        slots *= 2;
    t->merges = malloc(slots * sizeof *t->merges);
    if (!t->merges)
        return di_fail(err, DI_ENOMEM, "out of memory for %zu merges", n);
    memset(t->merges, 0xFF, slots * sizeof *t->merges);
    t->merge_mask = slots - 1;
    tok_buf joined = {0};
    di_status st = DI_OK;
    for (size_t r = 0; r < n && !st; r++) {
        const char *a, *b;
        size_t an, bn;
        st = merge_parts(json_array_get(merges, r), r, &a, &an, &b, &bn, err);
        if (st)
            break;
        int32_t ia = vocab_id(t, a, an), ib = vocab_id(t, b, bn);
        joined.n = 0;
        st = tok_buf_append(&joined, a, an, err);
        if (!st)
            st = tok_buf_append(&joined, b, bn, err);
        int32_t im = st ? -1 : vocab_id(t, joined.p, joined.n);
        if (!st && (ia < 0 || ib < 0 || im < 0)) {
            const char *miss = ia < 0 ? a : ib < 0 ? b : joined.p;
            size_t mn = ia < 0 ? an : ib < 0 ? bn : joined.n;
            st = di_fail(err, DI_EINVAL, "model.merges[%zu]: token '%.*s' is not in the vocabulary",
                         r, SHOW(miss, mn));
        }
        if (!st)
            merge_store(t, ia, ib, (int32_t)r, im);
    }
    tok_buf_free(&joined);
    t->n_merges = (int32_t)n;
    return st;
}

static di_status load_model(tok_tokenizer *t, const json_t *model, int32_t *max_id,
                            di_error *err)
{
    const char *type;
    di_status st = type_of(model, "model", &type, err);
    if (st)
        return st;
    if (strcmp(type, "BPE") != 0)
        return di_fail(err, DI_EUNSUPPORTED, "unsupported model type '%s' (only BPE)", type);
    static const char *const OFF[] = {"dropout", "fuse_unk", "byte_fallback",
                                      "continuing_subword_prefix", "end_of_word_suffix"};
    for (size_t i = 0; i < sizeof OFF / sizeof OFF[0] && !st; i++)
        st = bpe_option_off(model, OFF[i], err);
    if (!st)
        st = di_json_bool_opt(model, "ignore_merges", &t->ignore_merges, err);
    if (!st)
        st = load_vocab(t, json_object_get(model, "vocab"), max_id, err);
    if (!st)
        st = load_merges(t, json_object_get(model, "merges"), err);
    const char *unk = NULL;
    if (!st)
        st = di_json_str_opt(model, "unk_token", &unk, err);
    if (st)
        return st;
    t->unk_id = -1;
    if (unk && (t->unk_id = vocab_id(t, unk, strlen(unk))) < 0)
        return di_fail(err, DI_EINVAL, "model: unk_token '%s' is not in the vocabulary", unk);
    return DI_OK;
}

/* ---- added tokens --------------------------------------------------------------------------- */

static di_status load_added_one(tok_tokenizer *t, const json_t *a, size_t i, int32_t *max_id,
                                di_error *err)
{
    int64_t id;
    const char *content;
    size_t clen;
    bool special = false, normalized, flag;
    if (!json_is_object(a))
        return di_fail(err, DI_EINVAL, "added_tokens[%zu]: expected an object", i);
    di_status st = di_json_int_range(a, "id", 0, TOK_MAX_IDS - 1, &id, err);
    if (!st)
        st = str_of(json_object_get(a, "content"), "added_tokens content", i, &content, &clen, err);
    if (!st && clen == 0)
        st = di_fail(err, DI_EINVAL, "empty content");
    if (!st)
        st = di_json_bool_opt(a, "special", &special, err);
    normalized = !special; /* HF's default */
    if (!st)
        st = di_json_bool_opt(a, "normalized", &normalized, err);
    static const char *const FLAGS[] = {"lstrip", "rstrip", "single_word"};
    for (size_t k = 0; k < 3 && !st; k++) {
        flag = false;
        st = di_json_bool_opt(a, FLAGS[k], &flag, err);
        if (!st && flag)
            st = di_fail(err, DI_EUNSUPPORTED, "unsupported added token flag '%s' = true",
                         FLAGS[k]);
    }
    if (!st && tok_utf8_valid_prefix((const uint8_t *)content, clen) != clen)
        st = di_fail(err, DI_EINVAL, "content is not valid UTF-8");
    int32_t found;
    if (!st)
        st = tok_smap_put(&t->added_by_text, content, clen, (int32_t)id, &found, err);
    if (!st)
        st = tok_trie_add(normalized ? &t->added_norm : &t->added_raw, (const uint8_t *)content,
                          clen, (int32_t)id, err);
    if (st) {
        di_error_prefix(err, "added_tokens[%zu]: ", i);
        return st;
    }
    if ((int32_t)id > *max_id)
        *max_id = (int32_t)id;
    return DI_OK;
}

static di_status load_added(tok_tokenizer *t, const json_t *added, int32_t *max_id,
                            di_error *err)
{
    di_status st = tok_smap_init(&t->added_by_text, 64, err);
    if (st || !added || json_is_null(added))
        return st;
    if (!json_is_array(added))
        return di_fail(err, DI_EINVAL, "key 'added_tokens': expected an array, got %s",
                       di_json_type_name(added));
    for (size_t i = 0; i < json_array_size(added) && !st; i++)
        st = load_added_one(t, json_array_get(added, i), i, max_id, err);
    t->n_added = json_array_size(added);
    return st;
}

/* ---- normalizer ------------------------------------------------------------------------------ */

typedef struct norm_row {
    const char *type;   /* tokenizer.json name */
    tok_norm_form form; /* what it does */
} norm_row;

static const norm_row NORMALIZERS[] = {
    {"NFC", TOK_NORM_NFC},
    {"NFD", TOK_NORM_NFD},
    {"NFKC", TOK_NORM_NFKC},
    {"NFKD", TOK_NORM_NFKD},
};

static di_status load_normalizer(tok_tokenizer *t, const json_t *n, int depth, di_error *err)
{
    if (!n || json_is_null(n))
        return DI_OK;
    const char *type;
    di_status st = type_of(n, "normalizer", &type, err);
    if (st)
        return st;
    if (strcmp(type, "Sequence") == 0) {
        const json_t *list = json_object_get(n, "normalizers");
        if (!json_is_array(list))
            return di_fail(err, DI_EINVAL, "normalizer Sequence: key 'normalizers': expected an array");
        if (depth > 4)
            return di_fail(err, DI_EUNSUPPORTED, "normalizer Sequences nested too deep");
        for (size_t i = 0; i < json_array_size(list) && !st; i++)
            st = load_normalizer(t, json_array_get(list, i), depth + 1, err);
        return st;
    }
    for (size_t i = 0; i < sizeof NORMALIZERS / sizeof NORMALIZERS[0]; i++) {
        if (strcmp(type, NORMALIZERS[i].type) != 0)
            continue;
        if (t->n_norm == TOK_MAX_NORMS)
            return di_fail(err, DI_EUNSUPPORTED, "more than %d normalizers", TOK_MAX_NORMS);
        t->norm[t->n_norm++] = NORMALIZERS[i].form;
        return DI_OK;
    }
    return di_fail(err, DI_EUNSUPPORTED, "unsupported normalizer type '%s'", type);
}

/* ---- pre-tokenizer ----------------------------------------------------------------------------- */

static di_status add_step(tok_tokenizer *t, tok_step **s, di_error *err)
{
    if (t->n_steps == TOK_MAX_STEPS)
        return di_fail(err, DI_EUNSUPPORTED, "more than %d pre_tokenizers", TOK_MAX_STEPS);
    *s = &t->step[t->n_steps++];
    memset(*s, 0, sizeof **s);
    return DI_OK;
}

static di_status load_split(tok_tokenizer *t, const json_t *p, di_error *err)
{
    const json_t *pat = json_object_get(p, "pattern");
    const json_t *rx = json_is_object(pat) ? json_object_get(pat, "Regex") : NULL;
    const json_t *lit = json_is_object(pat) ? json_object_get(pat, "String") : NULL;
    const json_t *text = json_is_string(rx) ? rx : lit;
    if (!json_is_string(text))
        return di_fail(err, DI_EINVAL,
                       "pre_tokenizer Split: key 'pattern': expected {\"Regex\": s} or {\"String\": s}");
    const char *behavior;
    bool invert = false;
    di_status st = di_json_str(p, "behavior", &behavior, err);
    if (!st)
        st = di_json_bool_opt(p, "invert", &invert, err);
    if (st) {
        di_error_prefix(err, "pre_tokenizer Split: ");
        return st;
    }
    bool removed = strcmp(behavior, "Removed") == 0;
    if (!removed && strcmp(behavior, "Isolated") != 0)
        return di_fail(err, DI_EUNSUPPORTED,
                       "unsupported Split behavior '%s' (only Isolated, Removed)", behavior);
    tok_step *s = NULL;
    if ((st = add_step(t, &s, err)))
        return st;
    s->kind = TOK_STEP_SPLIT;
    s->removed = removed;
    s->invert = invert;
    st = tok_regex_compile(json_string_value(text), json_string_length(text), text == rx, &s->re,
                           err);
    if (st)
        di_error_prefix(err, "pre_tokenizer Split: ");
    return st;
}

static di_status load_bytelevel(tok_tokenizer *t, const json_t *p, di_error *err)
{
    bool prefix = false, use_regex = true;
    di_status st = di_json_bool_opt(p, "add_prefix_space", &prefix, err);
    if (!st)
        st = di_json_bool_opt(p, "use_regex", &use_regex, err);
    tok_step *s = NULL;
    if (!st)
        st = add_step(t, &s, err);
    if (st) {
        di_error_prefix(err, "pre_tokenizer ByteLevel: ");
        return st;
    }
    s->kind = TOK_STEP_BYTELEVEL;
    s->add_prefix_space = prefix;
    if (use_regex)
        st = tok_regex_compile(GPT2_PATTERN, strlen(GPT2_PATTERN), true, &s->re, err);
    return st;
}

static di_status load_pretok(tok_tokenizer *t, const json_t *p, int depth, di_error *err);

static di_status load_pretok_seq(tok_tokenizer *t, const json_t *p, int depth, di_error *err)
{
    const json_t *list = json_object_get(p, "pretokenizers");
    if (!json_is_array(list))
        return di_fail(err, DI_EINVAL,
                       "pre_tokenizer Sequence: key 'pretokenizers': expected an array");
    if (depth > 4)
        return di_fail(err, DI_EUNSUPPORTED, "pre_tokenizer Sequences nested too deep");
    di_status st = DI_OK;
    for (size_t i = 0; i < json_array_size(list) && !st; i++)
        st = load_pretok(t, json_array_get(list, i), depth + 1, err);
    return st;
}

typedef struct pretok_row {
    const char *type; /* tokenizer.json name */
    di_status (*load)(tok_tokenizer *t, const json_t *p, di_error *err); /* NULL: Sequence */
} pretok_row;

static const pretok_row PRETOKENIZERS[] = {
    {"Sequence", NULL},
    {"Split", load_split},
    {"ByteLevel", load_bytelevel},
};

static di_status load_pretok(tok_tokenizer *t, const json_t *p, int depth, di_error *err)
{
    const char *type;
    di_status st = type_of(p, "pre_tokenizer", &type, err);
    if (st)
        return st;
    for (size_t i = 0; i < sizeof PRETOKENIZERS / sizeof PRETOKENIZERS[0]; i++) {
        if (strcmp(type, PRETOKENIZERS[i].type) != 0)
            continue;
        return PRETOKENIZERS[i].load ? PRETOKENIZERS[i].load(t, p, err)
                                     : load_pretok_seq(t, p, depth, err);
    }
    return di_fail(err, DI_EUNSUPPORTED, "unsupported pre_tokenizer type '%s'", type);
}

static di_status check_pretok(const tok_tokenizer *t, di_error *err)
{
    for (size_t i = 0; i < t->n_steps; i++) {
        bool last = i + 1 == t->n_steps;
        if ((t->step[i].kind == TOK_STEP_BYTELEVEL) != last)
            return di_fail(err, DI_EUNSUPPORTED,
                           "pre_tokenizer must end with one ByteLevel (byte-level BPE only)");
    }
    if (t->n_steps == 0)
        return di_fail(err, DI_EUNSUPPORTED,
                       "pre_tokenizer is null: byte-level BPE needs a ByteLevel pre_tokenizer");
    return DI_OK;
}

/* ---- post-processor and decoder ------------------------------------------------------------------ */

static di_status check_bytelevel_only(const json_t *v, const char *what, bool null_ok,
                                      di_error *err)
{
    if (!v || json_is_null(v)) {
        if (null_ok)
            return DI_OK;
        return di_fail(err, DI_EUNSUPPORTED, "%s is null: byte-level BPE needs a ByteLevel %s",
                       what, what);
    }
    const char *type;
    di_status st = type_of(v, what, &type, err);
    if (st)
        return st;
    if (strcmp(type, "ByteLevel") != 0)
        return di_fail(err, DI_EUNSUPPORTED, "unsupported %s type '%s' (only ByteLevel)", what,
                       type);
    return DI_OK;
}

/* ---- per-id tables -------------------------------------------------------------------------------- */

static di_status store_id(tok_tokenizer *t, int32_t id, const char *s, size_t n,
                          const uint8_t *bytes, size_t bn, uint8_t flags, di_error *err)
{
    size_t off = t->pool.n;
    di_status st = tok_buf_append(&t->pool, s, n, err);
    if (!st)
        st = tok_buf_append(&t->pool, "", 1, err);
    size_t boff = t->pool.n;
    if (!st)
        st = tok_buf_append(&t->pool, bytes, bn, err);
    if (!st)
        st = tok_buf_append(&t->pool, "", 1, err);
    if (!st && t->pool.n > UINT32_MAX)
        st = di_fail(err, DI_ENOMEM, "token strings exceed 4 GiB");
    if (st)
        return st;
    t->str_off[id] = (uint32_t)off;
    t->str_len[id] = (uint32_t)n;
    t->bytes_off[id] = (uint32_t)boff;
    t->bytes_len[id] = (uint32_t)bn;
    t->id_flags[id] = flags;
    return DI_OK;
}

/* The bytes a vocab string stands for: each code point through the GPT-2 map, or, when one of
 * them is not in the map, the string's own UTF-8 (HF's ByteLevel decoder does the same). */
static di_status vocab_bytes(const int16_t *c2b, const char *s, size_t n, tok_buf *out,
                             di_error *err)
{
    out->n = 0;
    size_t i = 0;
    if (tok_utf8_valid_prefix((const uint8_t *)s, n) == n) {
        while (i < n) {
            uint32_t cp;
            size_t k = tok_utf8_decode((const uint8_t *)s + i, n - i, &cp);
            if (cp >= TOK_BYTE_MAP_CPS || c2b[cp] < 0)
                break;
            uint8_t b = (uint8_t)c2b[cp];
            di_status st = tok_buf_append(out, &b, 1, err);
            if (st)
                return st;
            i += k;
        }
    }
    if (i == n)
        return DI_OK;
    out->n = 0;
    return tok_buf_append(out, s, n, err);
}

static di_status build_tables(tok_tokenizer *t, int32_t max_id, di_error *err)
{
    t->n_ids = max_id + 1;
    size_t n = (size_t)t->n_ids;
    t->id_flags = calloc(n ? n : 1, 1);
    t->str_off = calloc(n ? n : 1, sizeof *t->str_off);
    t->str_len = calloc(n ? n : 1, sizeof *t->str_len);
    t->bytes_off = calloc(n ? n : 1, sizeof *t->bytes_off);
    t->bytes_len = calloc(n ? n : 1, sizeof *t->bytes_len);
    if (!t->id_flags || !t->str_off || !t->str_len || !t->bytes_off || !t->bytes_len)
        return di_fail(err, DI_ENOMEM, "out of memory for %d token ids", t->n_ids);
    int16_t c2b[TOK_BYTE_MAP_CPS];
    tok_byte_map(t->byte_cp, c2b);
    tok_buf bytes = {0};
    di_status st = tok_buf_append(&t->pool, "", 1, err); /* offset 0: the empty string */
    const tok_smap *v = &t->vocab;
    for (size_t e = 0; e < v->count && !st; e++) {
        const char *s = v->pool.p + v->key_off[e];
        int32_t id = v->val[e];
        if (t->id_flags[id])
            st = di_fail(err, DI_EINVAL, "model.vocab: id %d is given to two tokens", id);
        if (!st)
            st = vocab_bytes(c2b, s, v->key_len[e], &bytes, err);
        if (!st)
            st = store_id(t, id, s, v->key_len[e], (const uint8_t *)bytes.p, bytes.n,
                          TOK_ID_PRESENT, err);
    }
    tok_buf_free(&bytes);
    /* Added tokens override the vocab entry of their id: decode yields their content. */
    const tok_smap *a = &t->added_by_text;
    for (size_t e = 0; e < a->count && !st; e++) {
        const char *s = a->pool.p + a->key_off[e];
        st = store_id(t, a->val[e], s, a->key_len[e], (const uint8_t *)s, a->key_len[e],
                      TOK_ID_PRESENT | TOK_ID_ADDED, err);
    }
    for (int b = 0; b < 256 && !st; b++) {
        uint8_t u[4];
        size_t k = tok_utf8_encode(t->byte_cp[b], u);
        t->byte_id[b] = tok_smap_get(&t->vocab, u, k);
        if (t->byte_id[b] < 0)
            t->byte_id[b] = t->unk_id;
    }
    return st;
}

/* Marks special added tokens (a second pass: build_tables stored them without the flag). */
static void mark_special(tok_tokenizer *t, const json_t *added)
{
    for (size_t i = 0; i < json_array_size(added); i++) {
        const json_t *a = json_array_get(added, i);
        int32_t id = (int32_t)json_integer_value(json_object_get(a, "id"));
        if (json_is_true(json_object_get(a, "special")) && id >= 0 && id < t->n_ids)
            t->id_flags[id] |= TOK_ID_SPECIAL;
    }
}

/* ---- whole file ---------------------------------------------------------------------------------- */

static di_status build(tok_tokenizer *t, const json_t *root, di_error *err)
{
    if (!json_is_object(root))
        return di_fail(err, DI_EINVAL, "tokenizer.json: expected an object at the top");
    const json_t *model = json_object_get(root, "model");
    const json_t *added = json_object_get(root, "added_tokens");
    int32_t max_vocab = -1, max_added = -1;
    t->bos_id = t->eos_id = t->pad_id = t->unk_id = -1;
    di_status st = model ? load_model(t, model, &max_vocab, err)
                         : di_fail(err, DI_EINVAL, "tokenizer.json: missing key 'model'");
    if (!st)
        st = load_added(t, added, &max_added, err);
    if (!st)
        st = load_normalizer(t, json_object_get(root, "normalizer"), 0, err);
    const json_t *pre = json_object_get(root, "pre_tokenizer");
    if (!st && pre && !json_is_null(pre))
        st = load_pretok(t, pre, 0, err);
    if (!st)
        st = check_pretok(t, err);
    if (!st)
        st = check_bytelevel_only(json_object_get(root, "post_processor"), "post_processor",
                                  true, err);
    if (!st)
        st = check_bytelevel_only(json_object_get(root, "decoder"), "decoder", false, err);
    if (!st)
        st = build_tables(t, max_vocab > max_added ? max_vocab : max_added, err);
    if (!st)
        mark_special(t, added);
    if (!st)
        tok_cache_init(t);
    return st;
}

di_status tok_load_json(const char *text, size_t len, tok_tokenizer **out, di_error *err)
{
    if (!text || !out)
        return di_fail(err, DI_EINVAL, "tok_load_json: text and out must not be NULL");
    json_error_t je;
    json_t *root = json_loadb(text, len, JSON_REJECT_DUPLICATES | JSON_ALLOW_NUL, &je);
    if (!root)
        return di_fail(err, DI_EINVAL, "tokenizer.json: invalid JSON at line %d column %d: %s",
                       je.line, je.column, je.text);
    tok_tokenizer *t = calloc(1, sizeof *t);
    di_status st = t ? build(t, root, err)
                     : di_fail(err, DI_ENOMEM, "out of memory for a tokenizer");
    json_decref(root);
    if (st) {
        tok_free(t);
        return st;
    }
    *out = t;
    return DI_OK;
}

/* ---- files -------------------------------------------------------------------------------------- */

static di_status read_file(const char *path, char **data, size_t *len, di_error *err)
{
    FILE *f = fopen(path, "rb");
    if (!f)
        return di_fail(err, errno == ENOENT ? DI_ENOENT : DI_EIO, "%s: %s", path, strerror(errno));
    tok_buf b = {0};
    di_status st = DI_OK;
    for (;;) {
        if ((st = tok_buf_reserve(&b, 1 << 20, err)))
            break;
        size_t k = fread(b.p + b.n, 1, b.cap - b.n - 1, f);
        b.n += k;
        if (b.n > TOK_MAX_FILE_BYTES) {
            st = di_fail(err, DI_ERANGE, "%s: larger than %zu bytes", path, TOK_MAX_FILE_BYTES);
            break;
        }
        if (k == 0) {
            if (ferror(f))
                st = di_fail(err, DI_EIO, "%s: read error", path);
            break;
        }
    }
    fclose(f);
    if (st) {
        tok_buf_free(&b);
        return st;
    }
    *data = b.p;
    *len = b.n;
    return DI_OK;
}

/* bos_token and friends: a string, {"content": string}, or null. */
static di_status config_token(const tok_tokenizer *t, const json_t *cfg, const char *key,
                              int32_t *id, di_error *err)
{
    const json_t *v = json_object_get(cfg, key);
    if (json_is_object(v))
        v = json_object_get(v, "content");
    if (!v || json_is_null(v))
        return DI_OK;
    if (!json_is_string(v))
        return di_fail(err, DI_EINVAL, "tokenizer_config.json: key '%s': expected a string", key);
    const char *s = json_string_value(v);
    size_t n = json_string_length(v);
    int32_t x = tok_token_id(t, s, n);
    if (x < 0)
        return di_fail(err, DI_EINVAL, "tokenizer_config.json: %s '%.*s' is not a token", key,
                       SHOW(s, n));
    *id = x;
    return DI_OK;
}

static di_status load_config(tok_tokenizer *t, const char *dir, di_error *err)
{
    tok_buf path = {0};
    di_status st = tok_buf_appends(&path, dir, err);
    if (!st)
        st = tok_buf_appends(&path, "tokenizer_config.json", err);
    char *text = NULL;
    size_t len = 0;
    if (!st)
        st = read_file(path.p, &text, &len, err);
    tok_buf_free(&path);
    if (st == DI_ENOENT)
        return DI_OK; /* no config: bos/eos/pad stay -1 */
    json_t *cfg = NULL;
    if (!st)
        st = di_json_parse(text, len, "tokenizer_config.json", &cfg, err);
    free(text);
    if (!st && !json_is_object(cfg))
        st = di_fail(err, DI_EINVAL, "tokenizer_config.json: expected an object");
    if (!st)
        st = config_token(t, cfg, "bos_token", &t->bos_id, err);
    if (!st)
        st = config_token(t, cfg, "eos_token", &t->eos_id, err);
    if (!st)
        st = config_token(t, cfg, "pad_token", &t->pad_id, err);
    json_decref(cfg);
    return st;
}

di_status tok_load_file(const char *path, tok_tokenizer **out, di_error *err)
{
    if (!path || !out)
        return di_fail(err, DI_EINVAL, "tok_load_file: path and out must not be NULL");
    char *text = NULL;
    size_t len = 0;
    tok_tokenizer *t = NULL;
    di_status st = read_file(path, &text, &len, err);
    if (st)
        return st; /* the message names the path */
    st = tok_load_json(text, len, &t, err);
    free(text);
    const char *slash = strrchr(path, '/');
    tok_buf dir = {0};
    if (!st)
        st = slash ? tok_buf_append(&dir, path, (size_t)(slash - path) + 1, err)
                   : tok_buf_appends(&dir, "./", err);
    if (!st)
        st = load_config(t, dir.p, err);
    tok_buf_free(&dir);
    if (st) {
        di_error_prefix(err, "loading %s: ", path);
        tok_free(t);
        return st;
    }
    *out = t;
    return DI_OK;
}

void tok_free(tok_tokenizer *t)
{
    if (!t)
        return;
    tok_cache_free(t);
    for (size_t i = 0; i < t->n_steps; i++)
        pcre2_code_free(t->step[i].re);
    tok_trie_free(&t->added_raw);
    tok_trie_free(&t->added_norm);
    tok_smap_free(&t->vocab);
    tok_smap_free(&t->added_by_text);
    free(t->merges);
    free(t->id_flags);
    free(t->str_off);
    free(t->str_len);
    free(t->bytes_off);
    free(t->bytes_len);
    tok_buf_free(&t->pool);
    free(t);
}

/* ---- queries ------------------------------------------------------------------------------------- */

int32_t tok_vocab_size(const tok_tokenizer *t)
{
    return t ? t->n_ids : 0;
}

int32_t tok_token_id(const tok_tokenizer *t, const char *token, size_t len)
{
    if (!t || !token)
        return -1;
    int32_t id = tok_smap_get(&t->added_by_text, token, len);
    return id >= 0 ? id : tok_smap_get(&t->vocab, token, len);
}

const char *tok_token_str(const tok_tokenizer *t, int32_t id, size_t *len)
{
    if (!t || id < 0 || id >= t->n_ids || !(t->id_flags[id] & TOK_ID_PRESENT))
        return NULL;
    if (len)
        *len = t->str_len[id];
    return t->pool.p + t->str_off[id];
}

const uint8_t *tok_token_bytes(const tok_tokenizer *t, int32_t id, size_t *len)
{
    if (!t || id < 0 || id >= t->n_ids || !(t->id_flags[id] & TOK_ID_PRESENT))
        return NULL;
    if (len)
        *len = t->bytes_len[id];
    return (const uint8_t *)t->pool.p + t->bytes_off[id];
}

bool tok_is_special(const tok_tokenizer *t, int32_t id)
{
    return t && id >= 0 && id < t->n_ids && (t->id_flags[id] & TOK_ID_SPECIAL);
}

int32_t tok_bos_id(const tok_tokenizer *t)
{
    return t ? t->bos_id : -1;
}

int32_t tok_eos_id(const tok_tokenizer *t)
{
    return t ? t->eos_id : -1;
}

int32_t tok_pad_id(const tok_tokenizer *t)
{
    return t ? t->pad_id : -1;
}
