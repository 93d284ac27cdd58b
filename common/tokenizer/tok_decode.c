/* tok_decode.c: ids -> text, whole or streamed one id at a time.
 *
 * Both paths concatenate each token's bytes and repair them with tok_utf8_lossy, which turns
 * each maximal invalid subsequence into U+FFFD. The stream holds back a trailing incomplete
 * character (at most 3 bytes) until the next id completes or breaks it; because the repair
 * decides every byte from the bytes after it only as far as the end of its own sequence, the
 * streamed pieces add up to exactly the whole decode.
 */
#include <assert.h>
#include <stdlib.h>
#include <string.h>

#include "common/tokenizer/tok_internal.h"

/* The bytes of one id for decoding: DI_ERANGE for an id outside the vocabulary or without a
 * token; *skip is set for special tokens under TOK_DECODE_SKIP_SPECIAL. */
static di_status id_bytes(const tok_tokenizer *t, int32_t id, unsigned flags, size_t pos,
                          const uint8_t **b, size_t *n, bool *skip, di_error *err)
{
    if (id < 0 || id >= t->n_ids)
        return di_fail(err, DI_ERANGE, "token id %d at position %zu is outside the vocabulary [0, %d)",
                       id, pos, t->n_ids);
    if (!(t->id_flags[id] & TOK_ID_PRESENT))
        return di_fail(err, DI_ERANGE, "token id %d at position %zu has no token", id, pos);
    *skip = (flags & TOK_DECODE_SKIP_SPECIAL) && (t->id_flags[id] & TOK_ID_SPECIAL);
    *b = (const uint8_t *)t->pool.p + t->bytes_off[id];
    *n = t->bytes_len[id];
    return DI_OK;
}

di_status tok_decode(const tok_tokenizer *t, const int32_t *ids, size_t n, unsigned flags,
                     char **out, size_t *out_len, di_error *err)
{
    if (!t || !out || !out_len || (!ids && n))
        return di_fail(err, DI_EINVAL, "tok_decode: tokenizer, ids and outputs must not be NULL");
    if (flags & ~(unsigned)TOK_DECODE_SKIP_SPECIAL)
        return di_fail(err, DI_EINVAL, "tok_decode: unknown flags 0x%x", flags);
    tok_buf raw = {0}, text = {0};
    di_status st = tok_buf_reserve(&raw, 4 * n, err);
    for (size_t i = 0; i < n && !st; i++) {
        const uint8_t *b;
        size_t bn;
        bool skip;
        st = id_bytes(t, ids[i], flags, i, &b, &bn, &skip, err);
        if (!st && !skip)
            st = tok_buf_append(&raw, b, bn, err);
    }
    size_t used;
    if (!st)
        st = tok_utf8_lossy((const uint8_t *)raw.p, raw.n, true, &text, &used, err);
    if (!st && !text.p)
        st = tok_buf_append(&text, "", 0, err);
    tok_buf_free(&raw);
    if (st) {
        tok_buf_free(&text);
        return st;
    }
    *out = text.p;
    *out_len = text.n;
    return DI_OK;
}

/* ---- streams -------------------------------------------------------------------------------- */

struct tok_stream {
    const tok_tokenizer *t; /* borrowed; outlives the stream */
    unsigned flags;         /* TOK_DECODE_* */
    uint8_t pending[4];     /* incomplete character held back */
    size_t npending;        /* bytes in pending (0..3) */
    tok_buf work;           /* pending + the new token's bytes */
    tok_buf text;           /* the text handed out by the last call */
};

di_status tok_stream_new(const tok_tokenizer *t, unsigned flags, tok_stream **out, di_error *err)
{
    if (!t || !out)
        return di_fail(err, DI_EINVAL, "tok_stream_new: tokenizer and out must not be NULL");
    if (flags & ~(unsigned)TOK_DECODE_SKIP_SPECIAL)
        return di_fail(err, DI_EINVAL, "tok_stream_new: unknown flags 0x%x", flags);
    tok_stream *s = calloc(1, sizeof *s);
    if (!s)
        return di_fail(err, DI_ENOMEM, "out of memory for a detokenisation stream");
    s->t = t;
    s->flags = flags;
    *out = s;
    return DI_OK;
}

/* Repairs pending + bytes[0, n) into s->text, keeping an incomplete tail unless final. */
static di_status stream_emit(tok_stream *s, const uint8_t *bytes, size_t n, bool final,
                             di_error *err)
{
    s->work.n = 0;
    s->text.n = 0;
    di_status st = tok_buf_append(&s->work, s->pending, s->npending, err);
    if (!st)
        st = tok_buf_append(&s->work, bytes, n, err);
    if (!st)
        st = tok_buf_append(&s->text, "", 0, err);
    size_t used = 0;
    if (!st)
        st = tok_utf8_lossy((const uint8_t *)s->work.p, s->work.n, final, &s->text, &used, err);
    if (st)
        return st;
    s->npending = s->work.n - used;
    assert(s->npending <= 3); /* a longer prefix is never an incomplete character */
    memcpy(s->pending, s->work.p + used, s->npending);
    return DI_OK;
}

di_status tok_stream_push(tok_stream *s, int32_t id, const char **text, size_t *len,
                          di_error *err)
{
    if (!s || !text || !len)
        return di_fail(err, DI_EINVAL, "tok_stream_push: stream and outputs must not be NULL");
    const uint8_t *b;
    size_t n;
    bool skip;
    di_status st = id_bytes(s->t, id, s->flags, 0, &b, &n, &skip, err);
    if (st)
        return st;
    uint8_t keep[4];
    size_t nkeep = s->npending;
    memcpy(keep, s->pending, nkeep);
    st = stream_emit(s, b, skip ? 0 : n, false, err);
    if (st) {
        memcpy(s->pending, keep, nkeep); /* unchanged on failure */
        s->npending = nkeep;
        return st;
    }
    *text = s->text.p;
    *len = s->text.n;
    return DI_OK;
}

di_status tok_stream_finish(tok_stream *s, const char **text, size_t *len, di_error *err)
{
    if (!s || !text || !len)
        return di_fail(err, DI_EINVAL, "tok_stream_finish: stream and outputs must not be NULL");
    di_status st = stream_emit(s, NULL, 0, true, err);
    if (st)
        return st;
    *text = s->text.p;
    *len = s->text.n;
    return DI_OK;
}

size_t tok_stream_pending(const tok_stream *s)
{
    return s ? s->npending : 0;
}

void tok_stream_free(tok_stream *s)
{
    if (!s)
        return;
    tok_buf_free(&s->work);
    tok_buf_free(&s->text);
    free(s);
}
