#include "common/util/philox.h"

#include <math.h>

#define PHILOX_M0 0xD2511F53u
#define PHILOX_M1 0xCD9E8D57u
#define PHILOX_W0 0x9E3779B9u
#define PHILOX_W1 0xBB67AE85u

static inline void mulhilo(uint32_t a, uint32_t b, uint32_t *hi, uint32_t *lo)
{
    uint64_t p = (uint64_t)a * (uint64_t)b;
    *hi = (uint32_t)(p >> 32);
    *lo = (uint32_t)p;
}

void philox4x32_10(const uint32_t ctr[4], const uint32_t key[2], uint32_t out[4])
{
    uint32_t c0 = ctr[0], c1 = ctr[1], c2 = ctr[2], c3 = ctr[3];
    uint32_t k0 = key[0], k1 = key[1];
    for (int round = 0; round < 10; round++) {
        uint32_t hi0, lo0, hi1, lo1;
        mulhilo(PHILOX_M0, c0, &hi0, &lo0);
        mulhilo(PHILOX_M1, c2, &hi1, &lo1);
        uint32_t n0 = hi1 ^ c1 ^ k0;
        uint32_t n2 = hi0 ^ c3 ^ k1;
        c0 = n0;
        c1 = lo1;
        c2 = n2;
        c3 = lo0;
        k0 += PHILOX_W0;
        k1 += PHILOX_W1;
    }
    out[0] = c0;
    out[1] = c1;
    out[2] = c2;
    out[3] = c3;
}

static inline double u53(uint32_t a, uint32_t b)
{
    uint64_t x = ((uint64_t)a << 21) ^ ((uint64_t)b >> 11); /* 53 bits */
    x &= (1ull << 53) - 1;
    return (double)x * (1.0 / 9007199254740992.0);
}

double di_philox_uniform(uint64_t seed, uint64_t stream, uint32_t index)
{
    const uint32_t ctr[4] = {(uint32_t)stream, (uint32_t)(stream >> 32), index, 0x5a4d504cu};
    const uint32_t key[2] = {(uint32_t)seed, (uint32_t)(seed >> 32)};
    uint32_t out[4];
    philox4x32_10(ctr, key, out);
    return u53(out[0], out[1]);
}

void di_rng_init(di_rng *rng, uint64_t seed)
{
    rng->seed = seed;
    rng->counter = 0;
    rng->avail = 0;
}

uint32_t di_rng_u32(di_rng *rng)
{
    if (rng->avail == 0) {
        const uint32_t ctr[4] = {(uint32_t)rng->counter, (uint32_t)(rng->counter >> 32), 0,
                                 0x524e4721u};
        const uint32_t key[2] = {(uint32_t)rng->seed, (uint32_t)(rng->seed >> 32)};
        philox4x32_10(ctr, key, rng->buf);
        rng->counter++;
        rng->avail = 4;
    }
    return rng->buf[4 - rng->avail--];
}

uint64_t di_rng_u64(di_rng *rng)
{
    uint64_t hi = di_rng_u32(rng);
    return (hi << 32) | di_rng_u32(rng);
}

double di_rng_uniform(di_rng *rng)
{
    uint32_t a = di_rng_u32(rng);
    uint32_t b = di_rng_u32(rng);
    return u53(a, b);
}

uint64_t di_rng_below(di_rng *rng, uint64_t n)
{
    if (n <= 1)
        return 0;
    uint64_t limit = UINT64_MAX - UINT64_MAX % n;
    uint64_t x;
    do
        x = di_rng_u64(rng);
    while (x >= limit);
    return x % n;
}

double di_rng_normal(di_rng *rng)
{
    double u1 = di_rng_uniform(rng);
    double u2 = di_rng_uniform(rng);
    if (u1 < 1e-300)
        u1 = 1e-300;
    return sqrt(-2.0 * log(u1)) * cos(6.283185307179586 * u2);
}
