/* philox.h: Philox-4x32-10, the counter-based generator behind every random draw.
 *
 * A draw is a pure function of (key, counter): nothing is carried between calls, so the same
 * (seed, stream) gives the same number on any thread, batch row or machine. This is what makes
 * sampling batch invariant (DESIGN.md §6) and random weights reproducible from a seed.
 * Algorithm: Salmon et al., "Parallel random numbers: as easy as 1, 2, 3" (SC'11), with the
 * published multipliers and Weyl constants; checked against its known-answer vectors in
 * tests/util.
 */
#ifndef DI_UTIL_PHILOX_H
#define DI_UTIL_PHILOX_H

#include <stdint.h>

/* One block: four 32-bit outputs for counter ctr[4] under key key[2]. */
void philox4x32_10(const uint32_t ctr[4], const uint32_t key[2], uint32_t out[4]);

/* The sampler's keyed uniform: key = seed (64 bits), counter = (stream, index), result in
 * [0, 1) with 53 random bits. index selects among several numbers of one stream (0 for the
 * first). */
double di_philox_uniform(uint64_t seed, uint64_t stream, uint32_t index);

/* A sequential stream of numbers for simulations and weight generation: (seed, next counter).
 * Deterministic for a given seed; one struct per consumer, no shared state. */
typedef struct di_rng {
    uint64_t seed;     /* key */
    uint64_t counter;  /* next block index */
    uint32_t buf[4];   /* current block */
    int avail;         /* unread words left in buf (0..4) */
} di_rng;

void di_rng_init(di_rng *rng, uint64_t seed);
uint32_t di_rng_u32(di_rng *rng);
uint64_t di_rng_u64(di_rng *rng);
/* Uniform in [0, 1) with 53 random bits. */
double di_rng_uniform(di_rng *rng);
/* Uniform integer in [0, n); n > 0. Unbiased (rejection). */
uint64_t di_rng_below(di_rng *rng, uint64_t n);
/* Standard normal (Box-Muller on two uniforms). */
double di_rng_normal(di_rng *rng);

#endif
