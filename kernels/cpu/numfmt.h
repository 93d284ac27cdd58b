/* numfmt.h: the number formats of the model and its caches (MODEL.md §3.1-3.2), in plain C.
 *
 *   BF16   upper 16 bits of fp32, round to nearest even
 *   E4M3   FP8 e4m3fn: bias 7, max 448, min subnormal 2^-9, no infinity, 0x7f/0xff NaN
 *   UE8M0  unsigned exponent byte, value 2^(e-127), used as a power-of-two scale
 *   E2M1   FP4: sign in bit 3, codes 0..7 = 0, .5, 1, 1.5, 2, 3, 4, 6; two per byte, element 2i
 *          in the low nibble
 *
 * Quantisation procedures (the reference's semantics, one block at a time):
 *   (A) FP8, block 32, UE8M0 scale: a = max(amax, 1e-4); s = 2^ceil(log2(a * (1/448)));
 *       q = e4m3(clamp(x / s, -448, 448))                  activations, window KV
 *   (B) FP4, block 32, UE8M0 scale: a = max(amax, 6 * 2^-126); s = 2^ceil(log2(a / 6));
 *       q = e2m1(clamp(x / s, -6, 6))                      index keys/queries, expert weights
 *   (C) FP4, block 16, E4M3 scale: a = max(amax, 6 * 2^-9); s = e4m3(a / 6) (as its value);
 *       q = e2m1(clamp(x / s, -6, 6))                      compressed main KV
 * Every dequantised value q * s is exactly representable in BF16, so "fake quantisation"
 * (quantise then dequantise in place) loses nothing against storing codes and scales.
 */
#ifndef DI_KERNELS_CPU_NUMFMT_H
#define DI_KERNELS_CPU_NUMFMT_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

/* ---- BF16 ---- */
static inline float di_bf16_to_f32(uint16_t h)
{
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t di_f32_to_bf16(float f)
{
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) /* NaN: keep it quiet, keep the sign */
        return (uint16_t)((u >> 16) | 0x0040u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* f rounded to the nearest BF16 value (ties to even), as fp32. */
static inline float di_bf16_round(float f)
{
    return di_bf16_to_f32(di_f32_to_bf16(f));
}

/* ---- E4M3 ---- */
/* x must already be clamped to [-448, 448]; NaN encodes as 0x7f. Round to nearest even. */
uint8_t di_e4m3_encode(float x);
float di_e4m3_decode(uint8_t code);
/* x rounded to the nearest E4M3 value after clamping to [-448, 448]. */
float di_e4m3_round(float x);

/* ---- UE8M0 ---- */
static inline float di_ue8m0_decode(uint8_t e)
{
    if (e == 0xff) {
        uint32_t nan = 0x7fc00000u;
        float f;
        memcpy(&f, &nan, 4);
        return f;
    }
    if (e == 0) /* 2^-127 is subnormal in fp32 */
        return 5.877471754111438e-39f;
    uint32_t u = (uint32_t)e << 23;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* Exponent byte of 2^ceil(log2(x)) for a positive normal fp32 x, from its bits: the exponent
 * field, plus one when the mantissa is non-zero. */
static inline uint8_t di_ue8m0_ceil(float x)
{
    uint32_t u;
    memcpy(&u, &x, 4);
    uint32_t e = (u >> 23) & 0xffu;
    if (u & 0x7fffffu)
        e++;
    return (uint8_t)(e > 0xfe ? 0xfe : e);
}

/* ---- E2M1 ---- */
/* x must already be clamped to [-6, 6]. Ties go to the even code. Sign bit set for x < 0. */
uint8_t di_e2m1_encode(float x);
float di_e2m1_decode(uint8_t code); /* low 4 bits used */
/* Packs n (even) codes, element 2i in the low nibble of byte i. */
void di_e2m1_pack(const uint8_t *codes, size_t n, uint8_t *packed);
static inline uint8_t di_e2m1_unpack(const uint8_t *packed, size_t i)
{
    uint8_t b = packed[i >> 1];
    return (i & 1) ? (uint8_t)(b >> 4) : (uint8_t)(b & 0x0f);
}

/* ---- quantisation procedures ---- */
/* (A) n values (multiple of 32): codes[n], scales[n/32] (UE8M0 bytes). */
void di_quant_fp8_b32(const float *x, size_t n, uint8_t *codes, uint8_t *scales);
/* (B) n values (multiple of 32): packed[n/2], scales[n/32] (UE8M0 bytes). */
void di_quant_fp4_b32(const float *x, size_t n, uint8_t *packed, uint8_t *scales);
/* (C) n values (multiple of 16): packed[n/2], scales[n/16] (E4M3 bytes). */
void di_quant_fp4_b16(const float *x, size_t n, uint8_t *packed, uint8_t *scales);

void di_dequant_fp8_b32(const uint8_t *codes, const uint8_t *scales, size_t n, float *out);
void di_dequant_fp4_b32(const uint8_t *packed, const uint8_t *scales, size_t n, float *out);
void di_dequant_fp4_b16(const uint8_t *packed, const uint8_t *scales, size_t n, float *out);

/* In-place fake quantisation: x <- dequant(quant(x)) with the procedure named. */
void di_fakequant_fp8_b32(float *x, size_t n);
void di_fakequant_fp4_b32(float *x, size_t n);
void di_fakequant_fp4_b16(float *x, size_t n);

#endif
