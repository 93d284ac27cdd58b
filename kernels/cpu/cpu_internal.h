/* cpu_internal.h: shared pieces of the CPU ops (not a public header). */
#ifndef DI_KERNELS_CPU_INTERNAL_H
#define DI_KERNELS_CPU_INTERNAL_H

#include <assert.h>
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "kernels/cpu/numfmt.h"
#include "kernels/cpu/pool.h"
#include "kernels/kernels.h"

/* The backend state handed to every op as ctx. */
typedef struct cpu_ctx {
    kpool *pool;                /* workers */
    float e4m3[256];            /* E4M3 code -> value */
    float e2m1[16];             /* E2M1 code -> value */
    float ue8m0[256];           /* UE8M0 byte -> value */
} cpu_ctx;

#define CPU_LANES 16

static inline float bf(uint16_t h)
{
    return di_bf16_to_f32(h);
}

static inline uint16_t to_bf(float f)
{
    return di_f32_to_bf16(f);
}

/* Dot product of two float vectors accumulated in double (every product is exact), lanes in
 * a fixed order: the caller rounds the sum once. The results do not depend on the vector
 * width of the machine. */
double cpu_dot(const float *a, const float *b, size_t n);
/* Four dot products of a with b0..b3 (each the same as cpu_dot). */
void cpu_dot4(const float *a, const float *b0, const float *b1, const float *b2, const float *b3,
              size_t n, double out[4]);
/* x widened to double (exact). */
void cpu_widen(const float *x, double *out, size_t n);
/* The same sums on operands already widened (floats stored as doubles): cpu_dotd(a, b, n)
 * equals cpu_dot of the original floats. cpu_dotd_2x4: rows x0 and x1 (x1 may be NULL) against
 * 4 consecutive weight rows of length k (k % 8 == 0, rows k apart). */
double cpu_dotd(const double *a, const double *b, size_t n);
void cpu_dotd_2x4(const double *x0, const double *x1, const double *w, size_t k,
                  double out[2][4]);
/* o[i] += a * x[i] in double (x widened floats, a any double). */
void cpu_axpyd(double *o, const double *x, double a, size_t n);
/* Sum of squares, as cpu_dot(a, a, n). */
double cpu_sumsq(const float *a, size_t n);
/* RMS scale 1/sqrt(mean + eps): mean rounded to fp32, + eps in fp32, rsqrt in double, rounded
 * to fp32 (RMSNorm, the mHC mixes). */
float cpu_rms_scale(double sumsq, uint32_t n, float eps);

/* sigmoid in double. */
static inline double sigmoid_d(double x)
{
    return 1.0 / (1.0 + exp(-x));
}

void cpu_bf16_to_f32(const uint16_t *x, float *out, size_t n);
/* Procedure (A) applied to a bf16 row of n numbers (multiple of 32): out = dequant(quant(x)). */
void cpu_act_quant_fp8(const cpu_ctx *c, const uint16_t *x, float *out, size_t n);
/* Procedure (A) on fp32 numbers: codes[n] and scales[n/32]. Same bytes as di_quant_fp8_b32. */
void cpu_quant_fp8(const float *x, size_t n, uint8_t *codes, uint8_t *scales);
/* E4M3 rounding of v (|v| <= 448), the same value as di_e4m3_round. */
float cpu_e4m3_round(float v);

/* Dequantises rows [r0, r0+nr) of a weight matrix [n, k] into out [nr, k] fp32. */
void cpu_dequant_rows(const cpu_ctx *c, kern_wfmt fmt, const void *w, const uint8_t *scale,
                      uint32_t k, uint32_t r0, uint32_t nr, float *out);

/* The linear layer of every kern_linear entry (ops_linear.c), for use inside other ops. */
di_status cpu_linear_run(const cpu_ctx *c, const kern_linear *p, kern_wfmt fmt);

/* Decoders of cache entries into fp32. */
void cpu_decode_ring_entry(const cpu_ctx *c, const uint8_t *e, uint32_t dim, float *out);
void cpu_decode_main_entry(const cpu_ctx *c, const uint8_t *e, uint32_t dim, float *out);
void cpu_decode_index_entry(const cpu_ctx *c, const uint8_t *e, uint32_t dim, float *out);

/* Address of entry j of a sequence in the paged pool (main or index region). */
static inline uint8_t *cpu_entry_addr(const kern_kv_pool *pool, const kern_seq *s, int64_t j,
                                      int index)
{
    uint32_t b = (uint32_t)(j / pool->entries_per_block);
    uint32_t e = (uint32_t)(j % pool->entries_per_block);
    assert(b < s->n_blocks);
    uint8_t *blk = pool->blocks + (size_t)s->blocks[b] * pool->block_bytes;
    if (index)
        return blk + pool->index_offset + (size_t)e * pool->index_entry_bytes;
    return blk + pool->main_offset + (size_t)e * pool->main_entry_bytes;
}

/* 64-byte aligned scratch (uninitialised); free() it. NULL on exhaustion. */
void *cpu_xmalloc(size_t bytes);

/* Runs fn(arg, r0, r1, worker) over [0, n) cut into ranges of at least min_chunk items, in
 * parallel. Each range must only write its own items. */
typedef void (*cpu_range_fn)(void *arg, uint32_t r0, uint32_t r1, uint32_t worker);
void cpu_for(const cpu_ctx *c, uint32_t n, uint32_t min_chunk, cpu_range_fn fn, void *arg);

/* One op family per file; each fills its entries. */
void cpu_ops_basic(kern_ops *ops);   /* embed, rmsnorm, rope, hc_*, fakequant, copy_rows */
void cpu_ops_linear(kern_ops *ops);  /* linear_*, head */
void cpu_ops_cache(kern_ops *ops);   /* ring_store, compress_pool, compressed_store */
void cpu_ops_attn(kern_ops *ops);    /* sparse_attn */
void cpu_ops_index(kern_ops *ops);   /* index_* */
void cpu_ops_moe(kern_ops *ops);     /* moe_gate, swiglu, moe_experts */
void cpu_ops_engram(kern_ops *ops);  /* engram_* */

#endif
