/* config_engram.c: the Engram hash tables derived from the config (MODEL.md §2.9): the prime
 * bucket counts and the hash multipliers, the latter drawn exactly as NumPy's default_rng
 * draws them (SeedSequence -> PCG64 XSL-RR -> bounded Lemire), so that configs other than the
 * released one hash like the reference too. */
#include <assert.h>
#include <inttypes.h>
#include <string.h>

#include "common/model/config.h"

/* ---- primes ------------------------------------------------------------------------------- */

static uint64_t mulmod(uint64_t a, uint64_t b, uint64_t m)
{
    return (uint64_t)((unsigned __int128)a * b % m);
}

static uint64_t powmod(uint64_t b, uint64_t e, uint64_t m)
{
    uint64_t r = 1 % m;
    b %= m;
    while (e) {
        if (e & 1)
            r = mulmod(r, b, m);
        b = mulmod(b, b, m);
        e >>= 1;
    }
    return r;
}

bool model_is_prime_u64(uint64_t n)
{
    static const uint64_t small[] = {2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37};
    if (n < 2)
        return false;
    for (size_t i = 0; i < sizeof small / sizeof small[0]; i++) {
        if (n == small[i])
            return true;
        if (n % small[i] == 0)
            return false;
    }
    uint64_t d = n - 1;
    int s = 0;
    while ((d & 1) == 0) {
        d >>= 1;
        s++;
    }
    /* These 12 witnesses decide every n < 3.3e24, so the test is exact for 64-bit n. */
    for (size_t i = 0; i < sizeof small / sizeof small[0]; i++) {
        uint64_t x = powmod(small[i], d, n);
        if (x == 1 || x == n - 1)
            continue;
        bool composite = true;
        for (int r = 1; r < s; r++) {
            x = mulmod(x, x, n);
            if (x == n - 1) {
                composite = false;
                break;
            }
        }
        if (composite)
            return false;
    }
    return true;
}

static bool used_before(const uint64_t *used, size_t n, uint64_t p)
{
    for (size_t i = 0; i < n; i++)
        if (used[i] == p)
            return true;
    return false;
}

di_status model_engram_primes(uint32_t n_layers, uint32_t n_orders, uint32_t n_heads,
                              uint64_t vocab_size,
                              uint64_t primes[MODEL_MAX_ENGRAM_LAYERS][MODEL_MAX_ENGRAM_COLS],
                              di_error *err)
{
    if (n_layers > MODEL_MAX_ENGRAM_LAYERS || n_orders + 1 > MODEL_MAX_NGRAM ||
        n_heads > MODEL_MAX_ENGRAM_HEADS || n_orders == 0 || n_heads == 0)
        return di_fail(err, DI_EINVAL,
                       "Engram tables of %u layers x %u n-gram orders x %u heads exceed the "
                       "supported %u x %u x %u (or are empty)", n_layers, n_orders, n_heads,
                       MODEL_MAX_ENGRAM_LAYERS, MODEL_MAX_NGRAM - 1, MODEL_MAX_ENGRAM_HEADS);
    if (vocab_size < 2 || vocab_size > (1ull << 62))
        return di_fail(err, DI_EINVAL, "engram_vocab_size %" PRIu64 " outside [2, 2^62]",
                       vocab_size);
    uint64_t used[MODEL_MAX_ENGRAM_LAYERS * MODEL_MAX_ENGRAM_COLS];
    size_t n_used = 0;
    for (uint32_t k = 0; k < n_layers; k++) {
        for (uint32_t o = 0; o < n_orders; o++) {
            uint64_t cur = vocab_size - 1;
            for (uint32_t h = 0; h < n_heads; h++) {
                uint64_t c = cur + 1;
                while (!model_is_prime_u64(c) || used_before(used, n_used, c))
                    c++;
                used[n_used++] = c;
                primes[k][o * n_heads + h] = c;
                cur = c;
            }
        }
    }
    return DI_OK;
}

/* ---- NumPy default_rng, enough of it to draw the multipliers ------------------------------ */

/* SeedSequence constants (numpy/random/bit_generator.pyx). */
#define SS_INIT_A 0x43b0d7e5u
#define SS_MULT_A 0x931e8875u
#define SS_INIT_B 0x8b51f9ddu
#define SS_MULT_B 0x58f38dedu
#define SS_MIX_MULT_L 0xca01f9ddu
#define SS_MIX_MULT_R 0x4973f715u
#define SS_XSHIFT 16
#define SS_POOL 4

static uint32_t ss_hashmix(uint32_t value, uint32_t *hash_const)
{
    value ^= *hash_const;
    *hash_const *= SS_MULT_A;
    value *= *hash_const;
    value ^= value >> SS_XSHIFT;
    return value;
}

static uint32_t ss_mix(uint32_t x, uint32_t y)
{
    uint32_t r = SS_MIX_MULT_L * x - SS_MIX_MULT_R * y;
    r ^= r >> SS_XSHIFT;
    return r;
}

/* The pool of SeedSequence(entropy) for a non-negative entropy below 2^64. */
static void ss_pool(uint64_t entropy, uint32_t pool[SS_POOL])
{
    uint32_t words[2];
    size_t n = 0;
    do { /* little-endian 32-bit words; zero gives one word */
        words[n++] = (uint32_t)entropy;
        entropy >>= 32;
    } while (entropy);
    uint32_t hc = SS_INIT_A;
    for (size_t i = 0; i < SS_POOL; i++)
        pool[i] = ss_hashmix(i < n ? words[i] : 0, &hc);
    for (size_t src = 0; src < SS_POOL; src++)
        for (size_t dst = 0; dst < SS_POOL; dst++)
            if (src != dst)
                pool[dst] = ss_mix(pool[dst], ss_hashmix(pool[src], &hc));
}

/* generate_state(n_words64, uint64): 2n uint32 words paired little-endian. */
static void ss_generate64(const uint32_t pool[SS_POOL], size_t n, uint64_t *out)
{
    uint32_t hc = SS_INIT_B;
    for (size_t i = 0; i < 2 * n; i++) {
        uint32_t v = pool[i % SS_POOL];
        v ^= hc;
        hc *= SS_MULT_B;
        v *= hc;
        v ^= v >> SS_XSHIFT;
        if (i % 2 == 0)
            out[i / 2] = v;
        else
            out[i / 2] |= (uint64_t)v << 32;
    }
}

typedef struct pcg64 {
    unsigned __int128 state;
    unsigned __int128 inc;
} pcg64;

static const unsigned __int128 k_pcg_mult =
    ((unsigned __int128)0x2360ed051fc65da4ull << 64) | 0x4385df649fccf645ull;

static void pcg64_step(pcg64 *r)
{
    r->state = r->state * k_pcg_mult + r->inc;
}

static uint64_t pcg64_next(pcg64 *r)
{
    pcg64_step(r);
    uint64_t x = (uint64_t)(r->state >> 64) ^ (uint64_t)r->state;
    unsigned rot = (unsigned)(r->state >> 122);
    return (x >> rot) | (x << ((64 - rot) & 63));
}

/* PCG64(SeedSequence(seed)): state words (s0, s1) = high, low of the initial state; (i0, i1)
 * of the stream. */
static void pcg64_seed(pcg64 *r, uint64_t seed)
{
    uint32_t pool[SS_POOL];
    uint64_t v[4];
    ss_pool(seed, pool);
    ss_generate64(pool, 4, v);
    unsigned __int128 s = ((unsigned __int128)v[0] << 64) | v[1];
    unsigned __int128 i = ((unsigned __int128)v[2] << 64) | v[3];
    r->state = 0;
    r->inc = (i << 1) | 1;
    pcg64_step(r);
    r->state += s;
    pcg64_step(r);
}

/* Uniform integer in [0, rng] (rng inclusive, above 2^32) by Lemire's method, as NumPy. */
static uint64_t bounded_lemire64(pcg64 *r, uint64_t rng)
{
    uint64_t excl = rng + 1;
    unsigned __int128 m = (unsigned __int128)pcg64_next(r) * excl;
    uint64_t left = (uint64_t)m;
    if (left < excl) {
        uint64_t threshold = (UINT64_MAX - rng) % excl;
        while (left < threshold) {
            m = (unsigned __int128)pcg64_next(r) * excl;
            left = (uint64_t)m;
        }
    }
    return (uint64_t)(m >> 64);
}

void model_engram_multipliers(uint32_t layer_id, uint32_t compressed_vocab, uint32_t n,
                              uint64_t *out)
{
    assert(compressed_vocab >= 1 && compressed_vocab <= (1u << 29) && n <= 16);
    uint64_t half = (uint64_t)INT64_MAX / compressed_vocab / 2;
    assert(half - 1 > UINT32_MAX); /* NumPy's 64-bit path */
    pcg64 r;
    pcg64_seed(&r, 10007ull * layer_id);
    for (uint32_t i = 0; i < n; i++)
        out[i] = 2 * bounded_lemire64(&r, half - 1) + 1;
}
