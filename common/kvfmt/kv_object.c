/* kv_object.c: checks of store objects against what a reader expects. */
#include "common/kvfmt/kv_object.h"

#include <string.h>

/* First 8 bytes of a key in hex, for messages. */
static void key_prefix(const uint8_t key[32], char out[17])
{
    static const char digits[] = "0123456789abcdef";
    for (int i = 0; i < 8; i++) {
        out[2 * i] = digits[key[i] >> 4];
        out[2 * i + 1] = digits[key[i] & 15];
    }
    out[16] = '\0';
}

/* The header fields an object must carry for the caller's request. */
static di_status expect_header(const void *obj, const uint8_t key[32], uint32_t token_count,
                               uint64_t first_position, const char *what, di_error *err)
{
    kv_header h;
    memcpy(&h, obj, sizeof h);
    if (memcmp(h.key, key, 32) != 0) {
        char a[17], b[17];
        key_prefix(h.key, a);
        key_prefix(key, b);
        return di_fail(err, DI_ECORRUPT, "%s names key %s..., expected %s...", what, a, b);
    }
    if (h.first_position != first_position)
        return di_fail(err, DI_ECORRUPT, "%s starts at position %llu, expected %llu", what,
                       (unsigned long long)h.first_position,
                       (unsigned long long)first_position);
    if (h.token_count != token_count)
        return di_fail(err, DI_ECORRUPT, "%s holds %u tokens, expected %u", what, h.token_count,
                       token_count);
    return DI_OK;
}

/* ---- checks ---- */

di_status kvio_block_check(const kv_geometry *g, const void *obj, size_t bytes,
                           const uint8_t key[32], uint64_t first_position, di_error *err)
{
    if (!g || !obj || !key)
        return di_fail(err, DI_EINVAL, "block check: geometry, object and key are required");
    di_status st = kv_object_verify(obj, bytes, KV_BLOCK_MAGIC, g, err);
    if (st == DI_OK)
        st = expect_header(obj, key, g->block_tokens, first_position, "block", err);
    return st;
}

di_status kvio_window_check(const kv_geometry *g, const void *obj, size_t bytes,
                            const uint8_t key[32], uint64_t position, di_error *err)
{
    if (!g || !obj || !key)
        return di_fail(err, DI_EINVAL, "window check: geometry, object and key are required");
    if (position > UINT32_MAX)
        return di_fail(err, DI_ECORRUPT, "window state at position %llu: beyond the format",
                       (unsigned long long)position);
    di_status st = kv_object_verify(obj, bytes, KV_WINDOW_MAGIC, g, err);
    if (st == DI_OK)
        st = expect_header(obj, key, (uint32_t)position, position, "window state", err);
    return st;
}
