#include "common/kvfmt/kv_keys.h"

#include <openssl/evp.h>
#include <stdlib.h>
#include <string.h>

#include "common/util/hash64.h"

static const char *const class_names[KVKEY_CLASS_COUNT] = {"block", "window", "handoff"};

const char *kvkey_class_name(int cls)
{
    return cls >= 0 && cls < (int)KVKEY_CLASS_COUNT ? class_names[cls] : "?";
}

int kvkey_class_parse(const char *s)
{
    for (int i = 0; s && i < (int)KVKEY_CLASS_COUNT; i++)
        if (strcmp(s, class_names[i]) == 0)
            return i;
    return -1;
}

static void put_le64(uint8_t *p, uint64_t v)
{
    for (int i = 0; i < 8; i++)
        p[i] = (uint8_t)(v >> (8 * i));
}

static void put_le32(uint8_t *p, uint32_t v)
{
    for (int i = 0; i < 4; i++)
        p[i] = (uint8_t)(v >> (8 * i));
}

/* Feeds token ids as int32 little-endian, 256 at a time through a stack buffer. */
static int digest_tokens(EVP_MD_CTX *md, const int32_t *tokens, size_t n)
{
    uint8_t buf[1024];
    while (n > 0) {
        size_t take = n < sizeof(buf) / 4 ? n : sizeof(buf) / 4;
        for (size_t i = 0; i < take; i++)
            put_le32(buf + 4 * i, (uint32_t)tokens[i]);
        if (EVP_DigestUpdate(md, buf, take * 4) != 1)
            return 0;
        tokens += take;
        n -= take;
    }
    return 1;
}

/* One chain step on an existing digest context. Returns 1 on success. */
static int chain_step(EVP_MD_CTX *md, const uint8_t prev[KVKEY_BYTES], uint64_t model_id,
                      const int32_t *tokens, size_t n_tokens, uint8_t out[KVKEY_BYTES])
{
    uint8_t mid[8];
    put_le64(mid, model_id);
    unsigned int len = 0;
    return EVP_DigestInit_ex(md, EVP_sha256(), NULL) == 1 &&
           EVP_DigestUpdate(md, prev, KVKEY_BYTES) == 1 && EVP_DigestUpdate(md, mid, 8) == 1 &&
           digest_tokens(md, tokens, n_tokens) && EVP_DigestFinal_ex(md, out, &len) == 1 &&
           len == KVKEY_BYTES;
}

di_status kvkey_block(const kvkey *prev, uint64_t model_id, const int32_t *tokens,
                      uint32_t n_tokens, kvkey *out, di_error *err)
{
    if (!tokens || n_tokens == 0)
        return di_fail(err, DI_EINVAL, "a block key needs at least one token");
    if (!out)
        return di_fail(err, DI_EINVAL, "kvkey_block: out is NULL");
    static const uint8_t zeros[KVKEY_BYTES];
    EVP_MD_CTX *md = EVP_MD_CTX_new();
    if (!md)
        return di_fail(err, DI_ENOMEM, "cannot allocate a SHA-256 context");
    kvkey k;
    int ok = chain_step(md, prev ? prev->b : zeros, model_id, tokens, n_tokens, k.b);
    EVP_MD_CTX_free(md);
    if (!ok)
        return di_fail(err, DI_EINTERNAL, "SHA-256 failed in OpenSSL");
    *out = k;
    return DI_OK;
}

di_status kvkey_chain(uint64_t model_id, uint32_t block_tokens, const int32_t *tokens,
                      size_t n_tokens, kvkey *keys, size_t max_keys, size_t *n_keys,
                      di_error *err)
{
    if (block_tokens == 0)
        return di_fail(err, DI_EINVAL, "block_tokens must be positive");
    if (!n_keys || (n_tokens > 0 && !tokens) || (max_keys > 0 && !keys))
        return di_fail(err, DI_EINVAL, "kvkey_chain: NULL pointer with a non-zero count");
    size_t m = n_tokens / block_tokens;
    if (m > max_keys)
        m = max_keys;
    if (m == 0) {
        *n_keys = 0;
        return DI_OK;
    }
    EVP_MD_CTX *md = EVP_MD_CTX_new();
    if (!md)
        return di_fail(err, DI_ENOMEM, "cannot allocate a SHA-256 context");
    /* Computed into a scratch array so that keys stays untouched on failure. */
    kvkey *tmp = malloc(m * sizeof(*tmp));
    if (!tmp) {
        EVP_MD_CTX_free(md);
        return di_fail(err, DI_ENOMEM, "cannot allocate %zu keys", m);
    }
    static const uint8_t zeros[KVKEY_BYTES];
    int ok = 1;
    for (size_t i = 0; i < m && ok; i++)
        ok = chain_step(md, i ? tmp[i - 1].b : zeros, model_id, tokens + i * block_tokens,
                        block_tokens, tmp[i].b);
    if (ok)
        memcpy(keys, tmp, m * sizeof(*tmp));
    free(tmp);
    EVP_MD_CTX_free(md);
    if (!ok)
        return di_fail(err, DI_EINTERNAL, "SHA-256 failed in OpenSSL");
    *n_keys = m;
    return DI_OK;
}

di_status kvkey_handoff(uint64_t model_id, const char *request_id, kvkey *out, di_error *err)
{
    if (!request_id || !*request_id)
        return di_fail(err, DI_EINVAL, "a handoff key needs a non-empty request id");
    if (!out)
        return di_fail(err, DI_EINVAL, "kvkey_handoff: out is NULL");
    static const char tag[] = "di-handoff";
    uint8_t mid[8];
    put_le64(mid, model_id);
    EVP_MD_CTX *md = EVP_MD_CTX_new();
    if (!md)
        return di_fail(err, DI_ENOMEM, "cannot allocate a SHA-256 context");
    kvkey k;
    unsigned int len = 0;
    int ok = EVP_DigestInit_ex(md, EVP_sha256(), NULL) == 1 &&
             EVP_DigestUpdate(md, tag, sizeof(tag) - 1) == 1 &&
             EVP_DigestUpdate(md, mid, 8) == 1 &&
             EVP_DigestUpdate(md, request_id, strlen(request_id)) == 1 &&
             EVP_DigestFinal_ex(md, k.b, &len) == 1 && len == KVKEY_BYTES;
    EVP_MD_CTX_free(md);
    if (!ok)
        return di_fail(err, DI_EINTERNAL, "SHA-256 failed in OpenSSL");
    *out = k;
    return DI_OK;
}

/* Every check of a stored object once its payload checksum is known. */
static di_status check_object(int cls, const kvkey *key, const void *obj, size_t bytes,
                              const kv_geometry *g, uint64_t payload_sum, di_error *err)
{
    kv_header h;
    memcpy(&h, obj, sizeof(h));
    uint32_t magic;
    switch (cls) {
    case KVKEY_BLOCK:
        magic = KV_BLOCK_MAGIC;
        break;
    case KVKEY_WINDOW:
        magic = KV_WINDOW_MAGIC;
        break;
    case KVKEY_HANDOFF:
        magic = h.magic == KV_WINDOW_MAGIC || h.magic == KV_HANDOFF_MAGIC ? h.magic
                                                                          : KV_BLOCK_MAGIC;
        break;
    default:
        return di_fail(err, DI_EINVAL, "unknown object class %d", cls);
    }
    di_status st = kv_header_check(obj, bytes, magic, g, err);
    /* a misdirected object (another key's header) is named as such before the checksum, which
     * covers the header and would fail too */
    if (st == DI_OK && memcmp(h.key, key->b, KVKEY_BYTES) != 0)
        st = di_fail(err, DI_ECORRUPT, "the header names another key than the object's");
    if (st == DI_OK)
        st = kv_checksum_check(obj, payload_sum, err);
    return st;
}

di_status kvkey_object_verify(int cls, const kvkey *key, const void *obj, size_t bytes,
                              const kv_geometry *g, di_error *err)
{
    if (!key || !obj || !g)
        return di_fail(err, DI_EINVAL, "kvkey_object_verify: NULL argument");
    if (bytes < KV_HEADER_BYTES)
        return di_fail(err, DI_ECORRUPT, "object of %zu bytes is shorter than its header",
                       bytes);
    uint64_t sum = di_hash64((const uint8_t *)obj + KV_HEADER_BYTES, bytes - KV_HEADER_BYTES,
                             g->model_id);
    return check_object(cls, key, obj, bytes, g, sum, err);
}

di_status kvkey_object_copy_verify(int cls, const kvkey *key, void *dst, const void *src,
                                   size_t bytes, const kv_geometry *g, di_error *err)
{
    if (!key || !dst || !src || !g)
        return di_fail(err, DI_EINVAL, "kvkey_object_copy_verify: NULL argument");
    if (bytes < KV_HEADER_BYTES)
        return di_fail(err, DI_ECORRUPT, "object of %zu bytes is shorter than its header",
                       bytes);
    /* Checked on the copy: what the caller gets is exactly what was verified. */
    memcpy(dst, src, KV_HEADER_BYTES);
    uint64_t sum = di_hash64_copy((uint8_t *)dst + KV_HEADER_BYTES,
                                  (const uint8_t *)src + KV_HEADER_BYTES, bytes - KV_HEADER_BYTES,
                                  g->model_id);
    return check_object(cls, key, dst, bytes, g, sum, err);
}

void kvkey_hex(const kvkey *k, char out[2 * KVKEY_BYTES + 1])
{
    static const char digits[] = "0123456789abcdef";
    for (unsigned i = 0; i < KVKEY_BYTES; i++) {
        out[2 * i] = digits[k->b[i] >> 4];
        out[2 * i + 1] = digits[k->b[i] & 15];
    }
    out[2 * KVKEY_BYTES] = '\0';
}

static int hex_digit(char c)
{
    if (c >= '0' && c <= '9')
        return c - '0';
    if (c >= 'a' && c <= 'f')
        return c - 'a' + 10;
    if (c >= 'A' && c <= 'F')
        return c - 'A' + 10;
    return -1;
}

di_status kvkey_parse_hex(const char *s, kvkey *out, di_error *err)
{
    if (!s || !out)
        return di_fail(err, DI_EINVAL, "kvkey_parse_hex: NULL argument");
    kvkey k;
    for (unsigned i = 0; i < 2 * KVKEY_BYTES; i++) {
        int d = hex_digit(s[i]);
        if (d < 0)
            return di_fail(err, DI_EINVAL,
                           "key must be 64 hex digits; character %u is %s", i,
                           s[i] ? "not a hex digit" : "missing (too short)");
        if (i % 2 == 0)
            k.b[i / 2] = (uint8_t)(d << 4);
        else
            k.b[i / 2] |= (uint8_t)d;
    }
    if (s[2 * KVKEY_BYTES] != '\0')
        return di_fail(err, DI_EINVAL, "key must be 64 hex digits; got more");
    *out = k;
    return DI_OK;
}
