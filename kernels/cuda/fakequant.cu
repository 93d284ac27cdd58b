/* fakequant.cu: fake quantisation of bf16 rows, x <- bf16(dequant(quant(x))) by procedure (A),
 * (B) or (C) (kern_fakequant; C twin: kernels/cpu/ops_basic.c, cpu_fakequant). Exact: the
 * device helpers do the C twin's arithmetic and every dequantised value is exact in bf16.
 * Also the input quantisation of linear_fp8 and linear_fp4 (cuda_fakequant_rows). */
#include <cuda_runtime.h>
#include <stdint.h>

#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/cuda_internal.h"
#include "kernels/cuda/numfmt_dev.cuh"

/* ---- kernel: each thread owns 4 consecutive numbers of one row; 8 consecutive threads
 * cover a 32-number block ((A), (B)), 4 threads a 16-number block ((C)). Rows hold a whole
 * number of blocks, so a block never straddles two rows and its threads sit in one aligned
 * group of lanes. ---- */

template <int PROC>
__global__ void fakequant_kernel(const uint16_t *src, size_t src_stride, uint16_t *dst,
                                 size_t dst_stride, uint32_t n_rows, uint32_t quads_per_row)
{
    size_t t = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    bool valid = t < (size_t)n_rows * quads_per_row;
    size_t row = valid ? t / quads_per_row : 0;
    size_t col = valid ? (t % quads_per_row) * 4 : 0;
    float v[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    if (valid) {
        const uint16_t *s = src + row * src_stride + col;
#pragma unroll
        for (int i = 0; i < 4; i++)
            v[i] = dev_bf16_to_f32(s[i]);
    }
    /* every lane takes part in the shuffles, valid or not */
    uint8_t code[4], se;
    float deq[4];
    quant4_group<PROC>(v, code, deq, se);
    if (!valid)
        return;
    uint16_t *d = dst + row * dst_stride + col;
#pragma unroll
    for (int i = 0; i < 4; i++)
        d[i] = dev_f32_to_bf16(deq[i]);
}

/* ---- launcher ---- */

static di_status launch_fakequant(cuda_ctx *c, kern_qfmt fmt, const uint16_t *src,
                                  size_t src_stride, uint16_t *dst, size_t dst_stride,
                                  uint32_t n_rows, uint32_t n, cudaStream_t stream)
{
    uint32_t quads = n / 4;
    size_t threads = (size_t)n_rows * quads;
    size_t blocks = (threads + CUDA_THREADS - 1) / CUDA_THREADS;
    if (blocks > 0x7fffffffu)
        return cuda_fail(c, DI_EINVAL, "fakequant: %u rows of %u numbers is too many for one launch",
                         n_rows, n);
    switch (fmt) {
    case KERN_Q_FP8_B32:
        cuda_launch(c, "fakequant_kernel", fakequant_kernel<NUMFMT_FP8_B32>, (unsigned)blocks,
                    CUDA_THREADS, 0, stream, src, src_stride, dst, dst_stride, n_rows, quads);
        break;
    case KERN_Q_FP4_B32:
        cuda_launch(c, "fakequant_kernel", fakequant_kernel<NUMFMT_FP4_B32>, (unsigned)blocks,
                    CUDA_THREADS, 0, stream, src, src_stride, dst, dst_stride, n_rows, quads);
        break;
    case KERN_Q_FP4_B16:
        cuda_launch(c, "fakequant_kernel", fakequant_kernel<NUMFMT_FP4_B16>, (unsigned)blocks,
                    CUDA_THREADS, 0, stream, src, src_stride, dst, dst_stride, n_rows, quads);
        break;
    }
    return cuda_launched(c, "fakequant_kernel");
}

di_status cuda_fakequant_rows(cuda_ctx *c, kern_qfmt fmt, const uint16_t *src, size_t src_stride,
                              uint16_t *dst, size_t dst_stride, uint32_t n_rows, uint32_t n)
{
    uint32_t block = fmt == KERN_Q_FP4_B16 ? 16 : 32;
    if (fmt != KERN_Q_FP8_B32 && fmt != KERN_Q_FP4_B32 && fmt != KERN_Q_FP4_B16)
        return cuda_fail(c, DI_EINVAL, "fakequant: unknown format %d", (int)fmt);
    if (n % block != 0)
        return cuda_fail(c, DI_EINVAL, "fakequant: n %u is not a multiple of the block %u", n,
                         block);
    if (n_rows == 0 || n == 0)
        return DI_OK;
    if (!src || !dst)
        return cuda_fail(c, DI_EINVAL, "fakequant: x is NULL");
    if (src_stride < n || dst_stride < n)
        return cuda_fail(c, DI_EINVAL, "fakequant: row stride %zu below n %u",
                         src_stride < dst_stride ? src_stride : dst_stride, n);
    return launch_fakequant(c, fmt, src, src_stride, dst, dst_stride, n_rows, n, c->stream);
}

/* ---- table entry ---- */

di_status cuda_op_fakequant(void *ctx, const kern_fakequant *p)
{
    cuda_ctx *c = (cuda_ctx *)ctx;
    di_status st = cuda_op_begin(c, p, "fakequant");
    if (st != DI_OK)
        return st;
    return cuda_fakequant_rows(c, p->fmt, p->x, p->stride, p->x, p->stride, p->n_rows, p->n);
}
