/* moe_wide.h: moe_experts' routed experts for prefill-sized buckets (moe_wide.cu): one launch
 * per projection over every (expert, up to 128 rows) tile, BF16 tensor cores with the FP4
 * weight dequantised exactly in shared memory. */
#ifndef DI_KERNELS_CUDA_MOE_WIDE_H
#define DI_KERNELS_CUDA_MOE_WIDE_H

#include <stddef.h>
#include <stdint.h>

#include "kernels/cuda/cuda_internal.h"

/* Rows of one tile: a larger bucket is split into tiles of this many rows. */
#define CUDA_MOE_WIDE_ROWS 128

/* One launch: y[start + r][j] = bf16(sum_k a[start + r][k] * W[j][k]) for every tile (the
 * group's start and n, n <= CUDA_MOE_WIDE_ROWS, its expert's weights) and every output j < n_out.
 * up = 1: W1 into y0 and W3 into y1 (k = dim, n_out = inter); up = 0: W2 into y0 (k = inter,
 * n_out = dim). a holds the (A)-quantised rows in bucket order (bf16, exact), stride k. Every
 * pointer is device memory; the weights 16-byte aligned (the caller checks). */
typedef struct cuda_moe_wide {
    const cuda_moe_group *tiles; /* [n_tiles] */
    uint32_t n_tiles;
    const uint16_t *a;
    uint32_t k, n_out;
    int up;
    uint16_t *y0, *y1;
    size_t ldy;                 /* stride of y0 and y1 in elements */
} cuda_moe_wide;

/* 1 when a projection of k inputs and n outputs fits the kernel (k % 64 == 0, n even). */
int cuda_moe_wide_fits(uint32_t k, uint32_t n);

di_status cuda_moe_wide_run(cuda_ctx *c, const cuda_moe_wide *w);

#endif
