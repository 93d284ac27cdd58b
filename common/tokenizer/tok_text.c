/* tok_text.c: byte buffers, UTF-8 validation and lossy repair, the GPT-2 byte map. */
#include <stdlib.h>
#include <string.h>

#include "common/tokenizer/tok_internal.h"

di_status tok_buf_reserve(tok_buf *b, size_t extra, di_error *err)
{
    if (extra > SIZE_MAX / 2 - b->n - 1)
        return di_fail(err, DI_ENOMEM, "buffer of %zu + %zu bytes is too large", b->n, extra);
    size_t need = b->n + extra + 1;
    if (need <= b->cap)
        return DI_OK;
    size_t cap = b->cap ? b->cap : 64;
    while (cap < need)
        cap *= 2;
    char *p = realloc(b->p, cap);
    if (!p)
        return di_fail(err, DI_ENOMEM, "out of memory growing a buffer to %zu bytes", cap);
    b->p = p;
    b->cap = cap;
    return DI_OK;
}

di_status tok_buf_append(tok_buf *b, const void *data, size_t len, di_error *err)
{
    di_status st = tok_buf_reserve(b, len, err);
    if (st)
        return st;
    if (len)
        memcpy(b->p + b->n, data, len);
    b->n += len;
    b->p[b->n] = '\0';
    return DI_OK;
}

di_status tok_buf_appends(tok_buf *b, const char *s, di_error *err)
{
    return tok_buf_append(b, s, strlen(s), err);
}

void tok_buf_free(tok_buf *b)
{
    if (!b)
        return;
    free(b->p);
    b->p = NULL;
    b->n = b->cap = 0;
}

/* ---- UTF-8 -------------------------------------------------------------------------------- */

/* For a lead byte: the number of continuation bytes and the allowed range of the first one
 * (later ones are always 0x80..0xBF). need 0 with lo > hi marks an invalid lead. */
typedef struct utf8_lead {
    uint8_t need; /* continuation bytes */
    uint8_t lo;   /* first continuation byte, lowest */
    uint8_t hi;   /* first continuation byte, highest */
} utf8_lead;

static utf8_lead lead_of(uint8_t b)
{
    if (b < 0x80)
        return (utf8_lead){0, 1, 0};
    if (b < 0xC2)
        return (utf8_lead){0, 1, 0}; /* continuation byte or overlong C0/C1: invalid */
    if (b < 0xE0)
        return (utf8_lead){1, 0x80, 0xBF};
    if (b == 0xE0)
        return (utf8_lead){2, 0xA0, 0xBF};
    if (b == 0xED)
        return (utf8_lead){2, 0x80, 0x9F};
    if (b < 0xF0)
        return (utf8_lead){2, 0x80, 0xBF};
    if (b == 0xF0)
        return (utf8_lead){3, 0x90, 0xBF};
    if (b < 0xF4)
        return (utf8_lead){3, 0x80, 0xBF};
    if (b == 0xF4)
        return (utf8_lead){3, 0x80, 0x8F};
    return (utf8_lead){0, 1, 0}; /* F5..FF */
}

/* Examines the sequence starting at s[0]: returns its length when it is a whole valid
 * character; otherwise 0 and *bad = the length of the maximal invalid subpart (>= 1), or
 * *bad = 0 when the input ends inside a valid prefix. */
static size_t utf8_step(const uint8_t *s, size_t n, size_t *bad)
{
    uint8_t b = s[0];
    *bad = 0;
    if (b < 0x80)
        return 1;
    utf8_lead L = lead_of(b);
    if (L.need == 0) {
        *bad = 1;
        return 0;
    }
    for (size_t k = 1; k <= L.need; k++) {
        if (k >= n)
            return 0; /* incomplete */
        uint8_t lo = k == 1 ? L.lo : 0x80, hi = k == 1 ? L.hi : 0xBF;
        if (s[k] < lo || s[k] > hi) {
            *bad = k;
            return 0;
        }
    }
    return (size_t)L.need + 1;
}

size_t tok_utf8_valid_prefix(const uint8_t *s, size_t n)
{
    size_t i = 0;
    while (i < n) {
        if (s[i] < 0x80) {
            i++;
            continue;
        }
        size_t bad;
        size_t k = utf8_step(s + i, n - i, &bad);
        if (!k)
            return i;
        i += k;
    }
    return n;
}

static const uint8_t REPLACEMENT[3] = {0xEF, 0xBF, 0xBD};

di_status tok_utf8_lossy(const uint8_t *s, size_t n, bool final, tok_buf *out, size_t *used,
                         di_error *err)
{
    size_t i = 0, run = 0; /* run: start of the pending valid stretch */
    di_status st = tok_buf_reserve(out, n + 3, err);
    while (!st && i < n) {
        if (s[i] < 0x80) {
            i++;
            continue;
        }
        size_t bad;
        size_t k = utf8_step(s + i, n - i, &bad);
        if (k) {
            i += k;
            continue;
        }
        if (!bad && !final)
            break; /* hold back an incomplete character */
        st = tok_buf_append(out, s + run, i - run, err);
        if (!st)
            st = tok_buf_append(out, REPLACEMENT, 3, err);
        i += bad ? bad : n - i;
        run = i;
    }
    if (!st)
        st = tok_buf_append(out, s + run, i - run, err);
    if (!st)
        *used = i;
    return st;
}

size_t tok_utf8_decode(const uint8_t *s, size_t n, uint32_t *cp)
{
    uint8_t b = s[0];
    if (b < 0x80 || n < 2) {
        *cp = b;
        return 1;
    }
    if (b < 0xE0) {
        *cp = ((uint32_t)(b & 0x1F) << 6) | (s[1] & 0x3F);
        return 2;
    }
    if (b < 0xF0 || n < 4) {
        *cp = ((uint32_t)(b & 0x0F) << 12) | ((uint32_t)(s[1] & 0x3F) << 6) | (s[2] & 0x3F);
        return 3;
    }
    *cp = ((uint32_t)(b & 0x07) << 18) | ((uint32_t)(s[1] & 0x3F) << 12) |
          ((uint32_t)(s[2] & 0x3F) << 6) | (s[3] & 0x3F);
    return 4;
}

size_t tok_utf8_encode(uint32_t cp, uint8_t *out)
{
    if (cp < 0x80) {
        out[0] = (uint8_t)cp;
        return 1;
    }
    if (cp < 0x800) {
        out[0] = (uint8_t)(0xC0 | (cp >> 6));
        out[1] = (uint8_t)(0x80 | (cp & 0x3F));
        return 2;
    }
    if (cp < 0x10000) {
        out[0] = (uint8_t)(0xE0 | (cp >> 12));
        out[1] = (uint8_t)(0x80 | ((cp >> 6) & 0x3F));
        out[2] = (uint8_t)(0x80 | (cp & 0x3F));
        return 3;
    }
    out[0] = (uint8_t)(0xF0 | (cp >> 18));
    out[1] = (uint8_t)(0x80 | ((cp >> 12) & 0x3F));
    out[2] = (uint8_t)(0x80 | ((cp >> 6) & 0x3F));
    out[3] = (uint8_t)(0x80 | (cp & 0x3F));
    return 4;
}

/* ---- GPT-2 byte map ------------------------------------------------------------------------
 * Printable bytes ('!'..'~', 0xA1..0xAC, 0xAE..0xFF) stand for themselves; the other 68 bytes,
 * in increasing order, take the code points 256, 257, ... (so ' ' is U+0120 'Ġ'). */

static bool byte_is_printable(unsigned b)
{
    return (b >= 0x21 && b <= 0x7E) || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE);
}

void tok_byte_map(uint32_t byte_to_cp[256], int16_t cp_to_byte[TOK_BYTE_MAP_CPS])
{
    uint32_t next = 256;
    for (uint32_t c = 0; c < TOK_BYTE_MAP_CPS; c++)
        cp_to_byte[c] = -1;
    for (unsigned b = 0; b < 256; b++) {
        byte_to_cp[b] = byte_is_printable(b) ? b : next++;
        cp_to_byte[byte_to_cp[b]] = (int16_t)b;
    }
}
