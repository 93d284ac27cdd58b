/* tok_encode.c: text -> ids.
 *
 * The pipeline, as HF tokenizers runs it:
 *   1. added tokens with normalized=false are cut out of the raw text (leftmost-longest);
 *   2. each remaining stretch is normalised, then added tokens with normalized=true are cut
 *      out of it;
 *   3. each remaining stretch goes through the pre-tokenizer steps in order, every step
 *      splitting the pieces of the step before (a recursion: no piece lists are built);
 *   4. the last step (ByteLevel) hands each final piece's bytes to BPE.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <utf8proc.h>

#include "common/tokenizer/tok_internal.h"

void tok_ids_free(tok_ids *ids)
{
    if (!ids)
        return;
    free(ids->v);
    ids->v = NULL;
    ids->n = ids->cap = 0;
}

di_status tok_ids_push(tok_ids *ids, int32_t id, di_error *err)
{
    if (ids->n == ids->cap) {
        size_t cap = ids->cap ? ids->cap * 2 : 256;
        int32_t *v = realloc(ids->v, cap * sizeof *v);
        if (!v)
            return di_fail(err, DI_ENOMEM, "out of memory for %zu token ids", cap);
        ids->v = v;
        ids->cap = cap;
    }
    ids->v[ids->n++] = id;
    return DI_OK;
}

/* ---- normalisation ---------------------------------------------------------------------- */

di_status tok_unicode_form(const char *s, size_t n, tok_norm_form form, char **out,
                           size_t *out_len, di_error *err)
{
    static const utf8proc_option_t OPTS[] = {
        [TOK_NORM_NFC] = UTF8PROC_STABLE | UTF8PROC_COMPOSE,
        [TOK_NORM_NFD] = UTF8PROC_STABLE | UTF8PROC_DECOMPOSE,
        [TOK_NORM_NFKC] = UTF8PROC_STABLE | UTF8PROC_COMPOSE | UTF8PROC_COMPAT,
        [TOK_NORM_NFKD] = UTF8PROC_STABLE | UTF8PROC_DECOMPOSE | UTF8PROC_COMPAT,
    };
    if (n > (size_t)(PTRDIFF_MAX / 8))
        return di_fail(err, DI_ERANGE, "text of %zu bytes is too long to normalise", n);
    utf8proc_uint8_t *dst = NULL;
    utf8proc_ssize_t k = utf8proc_map((const utf8proc_uint8_t *)s, (utf8proc_ssize_t)n, &dst,
                                      OPTS[form]);
    if (k < 0)
        return di_fail(err, k == UTF8PROC_ERROR_NOMEM ? DI_ENOMEM : DI_EINTERNAL,
                       "unicode normalisation failed: %s", utf8proc_errmsg(k));
    *out = (char *)dst;
    *out_len = (size_t)k;
    return DI_OK;
}

/* ---- the pipeline --------------------------------------------------------------------------- */

typedef struct enc_ctx {
    const tok_tokenizer *t;           /* the tokenizer */
    tok_matcher m;                    /* regex scratch for this call */
    tok_buf prefixed[TOK_MAX_STEPS];  /* ByteLevel's " " + piece copies, one per step */
    tok_ids *out;                     /* where ids go */
    di_error *err;                    /* where failures go */
} enc_ctx;

static di_status pretok(enc_ctx *c, size_t k, const char *s, size_t n);

typedef di_status (*piece_fn)(enc_ctx *c, size_t k, const char *s, size_t n);

/* Walks the matches of re over s, handing fn the pieces kept: the stretches between matches
 * (gaps) and the matches themselves, in order. */
static di_status split_pieces(enc_ctx *c, const pcre2_code *re, size_t k, const char *s,
                              size_t n, bool keep_gaps, bool keep_matches, piece_fn fn)
{
    size_t prev = 0, a, b;
    di_status st;
    for (;;) {
        st = tok_regex_next(&c->m, re, s, n, prev, &a, &b, c->err);
        if (st == DI_ENOENT)
            break;
        if (st)
            return st;
        if (a > prev && keep_gaps && (st = fn(c, k, s + prev, a - prev)))
            return st;
        if (keep_matches && (st = fn(c, k, s + a, b - a)))
            return st;
        prev = b;
    }
    return prev < n && keep_gaps ? fn(c, k, s + prev, n - prev) : DI_OK;
}

static di_status next_step(enc_ctx *c, size_t k, const char *s, size_t n)
{
    return pretok(c, k + 1, s, n);
}

static di_status bpe_piece(enc_ctx *c, size_t k, const char *s, size_t n)
{
    (void)k;
    return tok_bpe_word(c->t, (const uint8_t *)s, n, c->out, c->err);
}

/* Split: gaps and matches in order; Removed drops the matches (or, inverted, the gaps). */
static di_status step_split(enc_ctx *c, size_t k, const char *s, size_t n)
{
    const tok_step *step = &c->t->step[k];
    bool keep_gaps = !step->removed || !step->invert;
    bool keep_matches = !step->removed || step->invert;
    return split_pieces(c, step->re, k, s, n, keep_gaps, keep_matches, next_step);
}

/* ByteLevel (always the last step): optional prefix space, optional GPT-2 split, then BPE. */
static di_status step_bytelevel(enc_ctx *c, size_t k, const char *s, size_t n)
{
    const tok_step *step = &c->t->step[k];
    if (step->add_prefix_space && s[0] != ' ') {
        tok_buf *b = &c->prefixed[k];
        di_status st;
        b->n = 0;
        if ((st = tok_buf_append(b, " ", 1, c->err)) || (st = tok_buf_append(b, s, n, c->err)))
            return st;
        s = b->p;
        n = b->n;
    }
    if (!step->re)
        return bpe_piece(c, k, s, n);
    return split_pieces(c, step->re, k, s, n, true, true, bpe_piece);
}

static di_status pretok(enc_ctx *c, size_t k, const char *s, size_t n)
{
    if (n == 0)
        return DI_OK;
    if (c->t->step[k].kind == TOK_STEP_SPLIT)
        return step_split(c, k, s, n);
    return step_bytelevel(c, k, s, n);
}

typedef di_status (*text_fn)(enc_ctx *c, const char *s, size_t n);

/* Cuts the tokens of trie out of s (leftmost-longest), pushing their ids and handing the
 * stretches between them to fn. */
static di_status split_added(enc_ctx *c, const tok_trie *trie, const char *s, size_t n,
                             text_fn fn)
{
    const uint8_t *u = (const uint8_t *)s;
    size_t prev = 0, i = 0, len = 0;
    di_status st;
    if (trie->count == 0)
        return fn(c, s, n);
    while (i < n) {
        if (trie->root[u[i]] < 0) {
            i++;
            continue;
        }
        int32_t id = tok_trie_longest(trie, u + i, n - i, &len);
        if (id < 0) {
            i++;
            continue;
        }
        if (i > prev && (st = fn(c, s + prev, i - prev)))
            return st;
        if ((st = tok_ids_push(c->out, id, c->err)))
            return st;
        i += len;
        prev = i;
    }
    return prev < n ? fn(c, s + prev, n - prev) : DI_OK;
}

static di_status after_norm_split(enc_ctx *c, const char *s, size_t n)
{
    return pretok(c, 0, s, n);
}

/* A stretch between raw added tokens: normalise, then cut out the normalized added tokens. */
static di_status after_raw_split(enc_ctx *c, const char *s, size_t n)
{
    const tok_tokenizer *t = c->t;
    if (t->n_norm == 0)
        return split_added(c, &t->added_norm, s, n, after_norm_split);
    char *cur = NULL;
    size_t cur_n = 0;
    di_status st = DI_OK;
    for (size_t i = 0; i < t->n_norm && !st; i++) {
        char *next = NULL;
        st = tok_unicode_form(cur ? cur : s, cur ? cur_n : n, t->norm[i], &next, &cur_n, c->err);
        free(cur);
        cur = next;
    }
    if (!st)
        st = split_added(c, &t->added_norm, cur, cur_n, after_norm_split);
    free(cur);
    return st;
}

di_status tok_encode(const tok_tokenizer *t, const char *text, size_t len, tok_ids *out,
                     di_error *err)
{
    if (!t || !out || (!text && len))
        return di_fail(err, DI_EINVAL, "tok_encode: tokenizer, text and out must not be NULL");
    if (len > TOK_MAX_INPUT_BYTES)
        return di_fail(err, DI_ERANGE, "input of %zu bytes exceeds the limit of %zu bytes", len,
                       TOK_MAX_INPUT_BYTES);
    size_t valid = tok_utf8_valid_prefix((const uint8_t *)text, len);
    if (valid != len)
        return di_fail(err, DI_EINVAL, "input is not valid UTF-8 at byte %zu", valid);
    if (len == 0)
        return DI_OK;
    enc_ctx c = {.t = t, .out = out, .err = err};
    size_t first = out->n;
    di_status st = tok_matcher_init(&c.m, err);
    if (!st)
        st = split_added(&c, &t->added_raw, text, len, after_raw_split);
    tok_matcher_free(&c.m);
    for (size_t k = 0; k < TOK_MAX_STEPS; k++)
        tok_buf_free(&c.prefixed[k]);
    if (st)
        out->n = first;
    return st;
}
