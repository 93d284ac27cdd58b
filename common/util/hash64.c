#include "common/util/hash64.h"

#include <string.h>

#define K1 0x9FB21C651E98DF25ull
#define K2 0xC2B2AE3D27D4EB4Full
#define K3 0x165667B19E3779F9ull
#define K4 0xD6E8FEB86659FD93ull

static inline uint64_t rotl64(uint64_t x, int r)
{
    return (x << r) | (x >> (64 - r));
}

static inline uint64_t load64(const unsigned char *p)
{
    uint64_t v;
    memcpy(&v, p, 8);
    return v; /* little-endian hosts only: the formats of this project are little-endian */
}

static inline uint64_t lane(uint64_t acc, uint64_t w)
{
    acc += w * K2;
    acc = rotl64(acc, 29);
    return acc * K1;
}

static inline uint64_t avalanche(uint64_t h)
{
    h ^= h >> 31;
    h *= K4;
    h ^= h >> 29;
    h *= K3;
    h ^= h >> 32;
    return h;
}

/* The one definition of the hash. When dst is not NULL every byte read is also stored there,
 * so a copy and its checksum take one pass over memory; always_inline lets the compiler drop
 * the stores (and the test) from di_hash64. */
static inline __attribute__((always_inline)) uint64_t hash_body(const unsigned char *p, size_t len,
                                                                uint64_t seed, unsigned char *dst)
{
    const unsigned char *end = p + len;
    uint64_t h;
    if (len >= 32) {
        uint64_t a = seed + K1 + K2, b = seed + K2, c = seed, d = seed - K1;
        const unsigned char *stop = end - 32;
        do {
            uint64_t w0 = load64(p), w1 = load64(p + 8), w2 = load64(p + 16), w3 = load64(p + 24);
            if (dst) {
                memcpy(dst, &w0, 8);
                memcpy(dst + 8, &w1, 8);
                memcpy(dst + 16, &w2, 8);
                memcpy(dst + 24, &w3, 8);
                dst += 32;
            }
            a = lane(a, w0);
            b = lane(b, w1);
            c = lane(c, w2);
            d = lane(d, w3);
            p += 32;
        } while (p <= stop);
        h = rotl64(a, 1) + rotl64(b, 7) + rotl64(c, 12) + rotl64(d, 18);
        h = (h ^ lane(0, a)) * K1 + K4;
        h = (h ^ lane(0, b)) * K1 + K4;
        h = (h ^ lane(0, c)) * K1 + K4;
        h = (h ^ lane(0, d)) * K1 + K4;
    } else {
        h = seed + K3;
    }
    if (dst)
        memcpy(dst, p, (size_t)(end - p));
    h += (uint64_t)len;
    while (p + 8 <= end) {
        h ^= lane(0, load64(p));
        h = rotl64(h, 27) * K1 + K4;
        p += 8;
    }
    while (p < end) {
        h ^= (uint64_t)(*p) * K3;
        h = rotl64(h, 11) * K1;
        p++;
    }
    return avalanche(h);
}

uint64_t di_hash64(const void *data, size_t len, uint64_t seed)
{
    return hash_body(data, len, seed, NULL);
}

uint64_t di_hash64_copy(void *dst, const void *src, size_t len, uint64_t seed)
{
    return hash_body(src, len, seed, dst);
}
