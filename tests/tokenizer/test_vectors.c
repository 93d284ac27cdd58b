/* The committed vectors (tests/tokenizer/vectors.json, written by gen_vectors.js from the npm
 * reference encoder): ids match id for id, decode round-trips, and streaming one id at a time
 * adds up to the whole decode without ever yielding invalid UTF-8. */
#include <criterion/criterion.h>
#include <stdlib.h>
#include <string.h>

#include "common/tokenizer/tok_internal.h"
#include "common/util/philox.h"
#include "tests/tokenizer/tok_test_util.h"

typedef struct vec {
    const char *text; /* borrowed from the JSON */
    size_t len;       /* bytes */
    tok_ids want;     /* hf_ids when present, else ids */
    bool hf_differs;  /* the npm package gives other ids (HF's are expected) */
} vec;

typedef struct vec_set {
    json_t *root; /* owns the texts */
    vec *v;       /* [n] */
    size_t n;     /* vectors */
} vec_set;

static vec_set load_vectors(void)
{
    vec_set s = {tt_load_json("tests/tokenizer/vectors.json"), NULL, 0};
    json_t *arr = json_object_get(s.root, "vectors");
    cr_assert(json_is_array(arr));
    s.n = json_array_size(arr);
    s.v = calloc(s.n, sizeof *s.v);
    for (size_t i = 0; i < s.n; i++) {
        json_t *o = json_array_get(arr, i);
        json_t *text = json_object_get(o, "text");
        json_t *hf = json_object_get(o, "hf_ids");
        cr_assert(json_is_string(text), "vector %zu has no text", i);
        s.v[i].text = json_string_value(text);
        s.v[i].len = json_string_length(text);
        s.v[i].hf_differs = hf != NULL;
        tt_json_ids(hf ? hf : json_object_get(o, "ids"), &s.v[i].want);
    }
    return s;
}

static void free_vectors(vec_set *s)
{
    for (size_t i = 0; i < s->n; i++)
        tok_ids_free(&s->v[i].want);
    free(s->v);
    json_decref(s->root);
}

Test(vectors, encode_matches_reference_id_for_id)
{
    tok_tokenizer *t = tt_deepseek();
    vec_set s = load_vectors();
    cr_assert_geq(s.n, 300, "only %zu vectors", s.n);
    size_t bad = 0, hf = 0;
    for (size_t i = 0; i < s.n; i++) {
        tok_ids got = tt_encode(t, s.v[i].text, s.v[i].len);
        const tok_ids *w = &s.v[i].want;
        size_t k = 0;
        while (k < got.n && k < w->n && got.v[k] == w->v[k])
            k++;
        if (k != got.n || k != w->n) {
            bad++;
            cr_log_error("vector %zu '%.40s': first difference at id %zu (got %d, want %d)", i,
                         s.v[i].text, k, k < got.n ? got.v[k] : -1, k < w->n ? w->v[k] : -1);
        }
        hf += s.v[i].hf_differs;
        tok_ids_free(&got);
    }
    cr_assert_eq(bad, 0, "%zu of %zu vectors differ", bad, s.n);
    cr_log_info("%zu vectors match (%zu where HF's ids differ from the npm package)", s.n, hf);
    free_vectors(&s);
    tok_free(t);
}

Test(vectors, decode_round_trips)
{
    tok_tokenizer *t = tt_deepseek();
    vec_set s = load_vectors();
    di_error e;
    for (size_t i = 0; i < s.n; i++) {
        char *text = NULL;
        size_t len = 0;
        const tok_ids *w = &s.v[i].want;
        cr_assert_eq(tok_decode(t, w->v, w->n, 0, &text, &len, &e), DI_OK, "%s", e.msg);
        cr_assert_eq(len, s.v[i].len, "vector %zu", i);
        cr_assert_eq(memcmp(text, s.v[i].text, len), 0, "vector %zu", i);
        free(text);
    }
    free_vectors(&s);
    tok_free(t);
}

/* Streams ids one at a time: every piece is valid UTF-8, at most 3 bytes are ever held back,
 * and the pieces plus the finish equal tok_decode of the same ids. */
static void stream_check(const tok_tokenizer *t, tok_stream *st, const int32_t *ids, size_t n,
                         unsigned flags, const char *what)
{
    di_error e;
    tok_buf all = {0};
    for (size_t k = 0; k < n; k++) {
        const char *p;
        size_t len;
        cr_assert_eq(tok_stream_push(st, ids[k], &p, &len, &e), DI_OK, "%s", e.msg);
        cr_assert_eq(tok_utf8_valid_prefix((const uint8_t *)p, len), len,
                     "%s: id %zu yielded invalid UTF-8", what, k);
        cr_assert_leq(tok_stream_pending(st), 3);
        tok_buf_append(&all, p, len, &e);
    }
    const char *p;
    size_t len;
    cr_assert_eq(tok_stream_finish(st, &p, &len, &e), DI_OK);
    cr_assert_eq(tok_utf8_valid_prefix((const uint8_t *)p, len), len);
    cr_assert_eq(tok_stream_pending(st), 0);
    tok_buf_append(&all, p, len, &e);
    char *whole = NULL;
    size_t wlen = 0;
    cr_assert_eq(tok_decode(t, ids, n, flags, &whole, &wlen, &e), DI_OK, "%s", e.msg);
    cr_assert_eq(all.n, wlen, "%s: streamed %zu bytes, decode %zu", what, all.n, wlen);
    cr_assert_eq(memcmp(all.p, whole, wlen), 0, "%s: streamed text differs", what);
    free(whole);
    tok_buf_free(&all);
}

Test(vectors, streaming_adds_up_to_decode)
{
    tok_tokenizer *t = tt_deepseek();
    vec_set s = load_vectors();
    tok_stream *st = NULL;
    di_error e;
    cr_assert_eq(tok_stream_new(t, 0, &st, &e), DI_OK);
    size_t held = 0;
    for (size_t i = 0; i < s.n; i++) {
        stream_check(t, st, s.v[i].want.v, s.v[i].want.n, 0, s.v[i].text);
        for (size_t k = 0; k < s.v[i].want.n; k++) {
            size_t n = 0;
            const uint8_t *b = tok_token_bytes(t, s.v[i].want.v[k], &n);
            held += tok_utf8_valid_prefix(b, n) != n; /* a token ending inside a character */
        }
    }
    cr_assert_gt(held, 20, "the vectors exercise held-back bytes (%zu tokens)", held);
    tok_stream_free(st);
    free_vectors(&s);
    tok_free(t);
}

/* Random id sequences: partial characters that never complete, broken sequences, special
 * tokens skipped or kept. The stream must still match the lossy whole decode. */
Test(vectors, streaming_random_ids_matches_lossy_decode)
{
    tok_tokenizer *t = tt_deepseek();
    int32_t nv = tok_vocab_size(t);
    /* tokens that are not whole characters: most of the interesting cases */
    tok_ids partial = {0};
    di_error e;
    for (int32_t id = 0; id < nv; id++) {
        size_t n = 0;
        const uint8_t *b = tok_token_bytes(t, id, &n);
        if (b && tok_utf8_valid_prefix(b, n) != n)
            tok_ids_push(&partial, id, &e);
    }
    cr_assert_gt(partial.n, 100);
    di_rng rng;
    di_rng_init(&rng, 7);
    for (int rep = 0; rep < 400; rep++) {
        int32_t ids[24];
        size_t n = 1 + di_rng_u32(&rng) % 24;
        for (size_t k = 0; k < n; k++) {
            uint32_t r = di_rng_u32(&rng);
            ids[k] = (r & 3) ? partial.v[(r >> 2) % partial.n] : (int32_t)((r >> 2) % (uint32_t)nv);
        }
        unsigned flags = (rep & 1) ? TOK_DECODE_SKIP_SPECIAL : 0;
        tok_stream *st = NULL;
        cr_assert_eq(tok_stream_new(t, flags, &st, &e), DI_OK);
        stream_check(t, st, ids, n, flags, "random ids");
        tok_stream_free(st);
    }
    tok_ids_free(&partial);
    tok_free(t);
}

Test(vectors, stream_refuses_bad_ids_and_stays_usable)
{
    tok_tokenizer *t = tt_deepseek();
    tok_stream *st = NULL;
    di_error e;
    cr_assert_eq(tok_stream_new(t, 0, &st, &e), DI_OK);
    const char *p;
    size_t len;
    cr_assert_eq(tok_stream_push(st, 52780, &p, &len, &e), DI_OK); /* " " + 3 bytes of 👋 */
    cr_assert_eq(len, 1);
    cr_assert_eq(tok_stream_pending(st), 3);
    cr_assert_eq(tok_stream_push(st, -5, &p, &len, &e), DI_ERANGE);
    cr_assert_eq(tok_stream_push(st, 1 << 30, &p, &len, &e), DI_ERANGE);
    cr_assert_eq(tok_stream_pending(st), 3, "a refused id leaves the stream as it was");
    cr_assert_eq(tok_stream_push(st, 236, &p, &len, &e), DI_OK);
    cr_assert_eq(len, 4);
    cr_assert_eq(memcmp(p, "👋", 4), 0);
    cr_assert_eq(tok_stream_new(t, 0x40, &st, &e), DI_EINVAL);
    cr_assert_eq(tok_stream_new(NULL, 0, &st, &e), DI_EINVAL);
    tok_stream_free(st);
    tok_stream_free(NULL);
    tok_free(t);
}
