/* sha256.c: SHA-256 through libcrypto when present, else the portable rounds (see sha256.h). */
#include "common/util/sha256.h"

#include <string.h>

#ifdef DI_HAVE_LIBCRYPTO
#include <openssl/evp.h>
#endif

static const uint32_t k_round[64] = {
    0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4, 0xab1c5ed5,
    0xd807aa98, 0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe, 0x9bdc06a7, 0xc19bf174,
    0xe49b69c1, 0xefbe4786, 0x0fc19dc6, 0x240ca1cc, 0x2de92c6f, 0x4a7484aa, 0x5cb0a9dc, 0x76f988da,
    0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7, 0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967,
    0x27b70a85, 0x2e1b2138, 0x4d2c6dfc, 0x53380d13, 0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85,
    0xa2bfe8a1, 0xa81a664b, 0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070,
    0x19a4c116, 0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a, 0x5b9cca4f, 0x682e6ff3,
    0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7, 0xc67178f2,
};

static const uint32_t k_init[8] = {0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a,
                                   0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19};

static inline uint32_t rotr(uint32_t x, unsigned n)
{
    return (x >> n) | (x << (32 - n));
}

/* One 64-byte block into the chaining value h. */
static void compress(uint32_t h[8], const uint8_t *p)
{
    uint32_t w[64];
    for (int i = 0; i < 16; i++)
        w[i] = (uint32_t)p[4 * i] << 24 | (uint32_t)p[4 * i + 1] << 16 |
               (uint32_t)p[4 * i + 2] << 8 | p[4 * i + 3];
    for (int i = 16; i < 64; i++) {
        uint32_t s0 = rotr(w[i - 15], 7) ^ rotr(w[i - 15], 18) ^ (w[i - 15] >> 3);
        uint32_t s1 = rotr(w[i - 2], 17) ^ rotr(w[i - 2], 19) ^ (w[i - 2] >> 10);
        w[i] = w[i - 16] + s0 + w[i - 7] + s1;
    }
    uint32_t a = h[0], b = h[1], c = h[2], d = h[3], e = h[4], f = h[5], g = h[6], k = h[7];
    for (int i = 0; i < 64; i++) {
        uint32_t t1 = k + (rotr(e, 6) ^ rotr(e, 11) ^ rotr(e, 25)) + ((e & f) ^ (~e & g)) +
                      k_round[i] + w[i];
        uint32_t t2 = (rotr(a, 2) ^ rotr(a, 13) ^ rotr(a, 22)) + ((a & b) ^ (a & c) ^ (b & c));
        k = g;
        g = f;
        f = e;
        e = d + t1;
        d = c;
        c = b;
        b = a;
        a = t1 + t2;
    }
    h[0] += a, h[1] += b, h[2] += c, h[3] += d, h[4] += e, h[5] += f, h[6] += g, h[7] += k;
}

static void portable_init(di_sha256 *s)
{
    memcpy(s->h, k_init, sizeof s->h);
    s->total = 0;
}

static void portable_update(di_sha256 *s, const uint8_t *p, size_t len)
{
    size_t have = (size_t)(s->total % 64);
    s->total += len;
    if (have) {
        size_t take = 64 - have < len ? 64 - have : len;
        memcpy(s->buf + have, p, take);
        p += take, len -= take;
        if (have + take < 64)
            return;
        compress(s->h, s->buf);
    }
    for (; len >= 64; p += 64, len -= 64)
        compress(s->h, p);
    memcpy(s->buf, p, len);
}

static void portable_final(di_sha256 *s, uint8_t out[DI_SHA256_BYTES])
{
    uint64_t bits = s->total * 8;
    uint8_t pad[72] = {0x80};
    size_t have = (size_t)(s->total % 64);
    size_t n = (have < 56 ? 56 - have : 120 - have);
    for (int i = 0; i < 8; i++)
        pad[n + i] = (uint8_t)(bits >> (56 - 8 * i));
    portable_update(s, pad, n + 8);
    for (int i = 0; i < 8; i++)
        for (int j = 0; j < 4; j++)
            out[4 * i + j] = (uint8_t)(s->h[i] >> (24 - 8 * j));
}

void di_sha256_portable(const void *data, size_t len, uint8_t out[DI_SHA256_BYTES])
{
    di_sha256 s;
    portable_init(&s);
    portable_update(&s, data, len);
    portable_final(&s, out);
}

bool di_sha256_is_openssl(void)
{
#ifdef DI_HAVE_LIBCRYPTO
    return true;
#else
    return false;
#endif
}

bool di_sha256_init(di_sha256 *s)
{
    s->evp = NULL;
#ifdef DI_HAVE_LIBCRYPTO
    EVP_MD_CTX *md = EVP_MD_CTX_new();
    if (!md || EVP_DigestInit_ex(md, EVP_sha256(), NULL) != 1) {
        EVP_MD_CTX_free(md);
        return false;
    }
    s->evp = md;
#endif
    portable_init(s);
    return true;
}

void di_sha256_update(di_sha256 *s, const void *data, size_t len)
{
#ifdef DI_HAVE_LIBCRYPTO
    if (s->evp) {
        EVP_DigestUpdate(s->evp, data, len);
        return;
    }
#endif
    portable_update(s, data, len);
}

void di_sha256_final(di_sha256 *s, uint8_t out[DI_SHA256_BYTES])
{
#ifdef DI_HAVE_LIBCRYPTO
    if (s->evp) {
        unsigned n = 0;
        EVP_DigestFinal_ex(s->evp, out, &n);
        EVP_MD_CTX_free(s->evp);
        s->evp = NULL;
        return;
    }
#endif
    portable_final(s, out);
}

bool di_sha256_of(const void *data, size_t len, uint8_t out[DI_SHA256_BYTES])
{
    di_sha256 s;
    if (!di_sha256_init(&s))
        return false;
    di_sha256_update(&s, data, len);
    di_sha256_final(&s, out);
    return true;
}

void di_sha256_hex(const uint8_t d[DI_SHA256_BYTES], char out[2 * DI_SHA256_BYTES + 1])
{
    static const char digits[] = "0123456789abcdef";
    for (unsigned i = 0; i < DI_SHA256_BYTES; i++) {
        out[2 * i] = digits[d[i] >> 4];
        out[2 * i + 1] = digits[d[i] & 15];
    }
    out[2 * DI_SHA256_BYTES] = '\0';
}

static int hex_value(char c)
{
    return c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10
                                          : c >= 'A' && c <= 'F' ? c - 'A' + 10 : -1;
}

bool di_sha256_parse_hex(const char *hex, uint8_t out[DI_SHA256_BYTES])
{
    uint8_t d[DI_SHA256_BYTES];
    if (!hex || strlen(hex) != 2 * DI_SHA256_BYTES)
        return false;
    for (unsigned i = 0; i < DI_SHA256_BYTES; i++) {
        int hi = hex_value(hex[2 * i]), lo = hex_value(hex[2 * i + 1]);
        if (hi < 0 || lo < 0)
            return false;
        d[i] = (uint8_t)(hi << 4 | lo);
    }
    memcpy(out, d, sizeof d);
    return true;
}
