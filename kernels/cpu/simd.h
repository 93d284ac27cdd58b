/* simd.h: 16-lane fp32 vectors for the CPU ops (GCC vector extensions; not a public header).
 *
 * A lane computes exactly what scalar code would for its indices, so results are the same on
 * every instruction set: CPU_SIMD builds a function for AVX-512, AVX2 and the baseline and picks
 * one at load time; there is no fused multiply-add (ISO C mode keeps contraction off). Helpers
 * taking or returning vectors are always_inline: a call between clones of different vector
 * ABIs would pass them wrongly.
 */
#ifndef DI_KERNELS_CPU_SIMD_H
#define DI_KERNELS_CPU_SIMD_H

#include <stdint.h>
#include <string.h>

typedef float v16f __attribute__((vector_size(64)));
typedef float v8f __attribute__((vector_size(32)));
typedef double v8d __attribute__((vector_size(64)));
typedef uint32_t v16u __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));
typedef uint16_t v16h __attribute__((vector_size(32)));
typedef uint8_t v16b __attribute__((vector_size(16)));

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define CPU_SIMD __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define CPU_SIMD
#endif

static inline __attribute__((always_inline)) v16f v16_load(const float *p)
{
    v16f v;
    memcpy(&v, p, sizeof(v));
    return v;
}

static inline __attribute__((always_inline)) void v16_store(float *p, v16f v)
{
    memcpy(p, &v, sizeof(v));
}

static inline __attribute__((always_inline)) v16f v16_zero(void)
{
    v16f v = {0};
    return v;
}

static inline __attribute__((always_inline)) v8d v8d_zero(void)
{
    v8d v = {0};
    return v;
}

/* The low and high 8 floats of 16 as doubles (exact). */
static inline __attribute__((always_inline)) v8d v8d_lo(const float *p)
{
    v8f f;
    memcpy(&f, p, sizeof(f));
    return __builtin_convertvector(f, v8d);
}

/* Folds 8 double lanes in the fixed order v[j] += v[j + s], s = 4, 2, 1. */
static inline __attribute__((always_inline)) double v8d_fold(v8d v)
{
    double a[8];
    memcpy(a, &v, sizeof(a));
    for (int s = 4; s >= 1; s /= 2)
        for (int j = 0; j < s; j++)
            a[j] += a[j + s];
    return a[0];
}

/* Folds the lanes in the fixed order v[j] += v[j + s], s = 8, 4, 2, 1; returns lane 0. */
static inline __attribute__((always_inline)) float v16_fold(v16f v)
{
    float a[16];
    v16_store(a, v);
    for (int s = 8; s >= 1; s /= 2)
        for (int j = 0; j < s; j++)
            a[j] += a[j + s];
    return a[0];
}

#endif
