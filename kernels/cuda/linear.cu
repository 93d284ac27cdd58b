/* linear.cu: the linear layers y = x @ W^T (kern_linear: linear_fp8, linear_fp4, linear_bf16 with
 * groups, head; C twin: kernels/cpu/ops_linear.c, cpu_linear_run).
 *
 * FP8 and FP4 weights: the rows of x are fake-quantised by procedure (A) into a bf16 scratch
 * (exact, the twin's cpu_act_quant_fp8), the weight is dequantised into a bf16 scratch (exact:
 * an E4M3 or E2M1 value times a UE8M0 power of two has at most 4 significant bits), and one
 * BF16 GEMM with fp32 accumulation (gemm.cu, cuBLASLt) computes y. BF16 weights (linear_bf16,
 * head) go to the GEMM directly, groups as a strided batch. Only the accumulation order differs
 * from the twin's double sums: tolerance |y - y_cpu| <= 1e-2 * max(1, |y_cpu|), cosine >= 0.9999
 * per row (kernels.h).
 *
 * Cost: dequantising per call reads the weight once (1 or 1/2 byte per value) and writes then
 * re-reads it as bf16 (2 + 2 bytes per value), about 5x (FP8) or 9x (FP4) the weight bytes of
 * a fused kernel; at decode sizes (m <= 64) that is the whole cost. A fused FP8/FP4 GEMM that
 * dequantises in registers (wgmma on sm_90a) is the next step (docs/cuda.md).
 */
#include <cuda_runtime.h>
#include <stdint.h>

#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/cuda_internal.h"
#include "kernels/cuda/numfmt_dev.cuh"

/* ---- device helpers ---- */

/* byte j (0..15) of a 16-byte vector; j is a compile-time constant after unrolling */
__device__ __forceinline__ uint32_t byte_at(const uint4 &v, int j)
{
    uint32_t w = j < 4 ? v.x : (j < 8 ? v.y : (j < 12 ? v.z : v.w));
    return (w >> (8 * (j & 3))) & 0xffu;
}

__device__ __forceinline__ uint4 load16(const uint8_t *p, bool aligned)
{
    if (aligned)
        return *reinterpret_cast<const uint4 *>(p);
    uint32_t w[4];
#pragma unroll
    for (int i = 0; i < 4; i++)
        w[i] = (uint32_t)p[4 * i] | (uint32_t)p[4 * i + 1] << 8 | (uint32_t)p[4 * i + 2] << 16 |
               (uint32_t)p[4 * i + 3] << 24;
    return make_uint4(w[0], w[1], w[2], w[3]);
}

__device__ __forceinline__ uint32_t pack2(float a, float b)
{
    return (uint32_t)dev_f32_to_bf16(a) | (uint32_t)dev_f32_to_bf16(b) << 16;
}

/* ---- kernels: each thread turns 16 bytes of codes into bf16 values (16 for FP8, 32 for FP4);
 * out is the [n, k] bf16 scratch (256-byte aligned, k % 32 == 0, so every store is aligned) ---- */

template <bool ALIGNED>
__global__ void dequant_fp8_kernel(const uint8_t *w, const uint8_t *scale, uint16_t *out,
                                   uint32_t n, uint32_t k)
{
    const uint32_t chunks = k / 16, kb = k / 32;
    size_t t = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= (size_t)n * chunks)
        return;
    size_t row = t / chunks;
    uint32_t c = (uint32_t)(t % chunks);
    uint4 q = load16(w + row * k + (size_t)c * 16, ALIGNED);
    const float s = dev_ue8m0_decode(scale[(row / 32) * kb + c / 2]);
    uint32_t o[8];
#pragma unroll
    for (int j = 0; j < 8; j++)
        o[j] = pack2(dev_e4m3_decode((uint8_t)byte_at(q, 2 * j)) * s,
                     dev_e4m3_decode((uint8_t)byte_at(q, 2 * j + 1)) * s);
    uint4 *dst = reinterpret_cast<uint4 *>(out + row * k + (size_t)c * 16);
    dst[0] = make_uint4(o[0], o[1], o[2], o[3]);
    dst[1] = make_uint4(o[4], o[5], o[6], o[7]);
}

template <bool ALIGNED>
__global__ void dequant_fp4_kernel(const uint8_t *w, const uint8_t *scale, uint16_t *out,
                                   uint32_t n, uint32_t k)
{
    const uint32_t kb = k / 32;
    size_t t = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= (size_t)n * kb)
        return;
    size_t row = t / kb;
    uint32_t b = (uint32_t)(t % kb);
    uint4 q = load16(w + row * (k / 2) + (size_t)b * 16, ALIGNED);
    const float s = dev_ue8m0_decode(scale[row * kb + b]);
    uint32_t o[16];
#pragma unroll
    for (int j = 0; j < 16; j++) {
        uint32_t byte = byte_at(q, j); /* element 2j in the low nibble */
        o[j] = pack2(dev_e2m1_decode((uint8_t)(byte & 15u)) * s,
                     dev_e2m1_decode((uint8_t)(byte >> 4)) * s);
    }
    uint4 *dst = reinterpret_cast<uint4 *>(out + row * k + (size_t)b * 32);
#pragma unroll
    for (int i = 0; i < 4; i++)
        dst[i] = make_uint4(o[4 * i], o[4 * i + 1], o[4 * i + 2], o[4 * i + 3]);
}

/* ---- launchers ---- */

static di_status launch_dequant(cuda_ctx *c, kern_wfmt fmt, const kern_linear *p, uint16_t *out,
                                cudaStream_t stream)
{
    size_t per_row = fmt == KERN_W_FP8 ? p->k / 16 : p->k / 32;
    size_t blocks = ((size_t)p->n * per_row + CUDA_THREADS - 1) / CUDA_THREADS;
    if (blocks > 0x7fffffffu)
        return cuda_fail(c, DI_EINVAL, "linear: weight [%u, %u] too large for one launch", p->n,
                         p->k);
    bool aligned = (uintptr_t)p->w % 16 == 0;
    const uint8_t *w = (const uint8_t *)p->w;
    if (fmt == KERN_W_FP8 && aligned)
        cuda_launch(c, "dequant_fp8_kernel", dequant_fp8_kernel<true>, (unsigned)blocks,
                    CUDA_THREADS, 0, stream, w, p->w_scale, out, p->n, p->k);
    else if (fmt == KERN_W_FP8)
        cuda_launch(c, "dequant_fp8_kernel", dequant_fp8_kernel<false>, (unsigned)blocks,
                    CUDA_THREADS, 0, stream, w, p->w_scale, out, p->n, p->k);
    else if (aligned)
        cuda_launch(c, "dequant_fp4_kernel", dequant_fp4_kernel<true>, (unsigned)blocks,
                    CUDA_THREADS, 0, stream, w, p->w_scale, out, p->n, p->k);
    else
        cuda_launch(c, "dequant_fp4_kernel", dequant_fp4_kernel<false>, (unsigned)blocks,
                    CUDA_THREADS, 0, stream, w, p->w_scale, out, p->n, p->k);
    return cuda_launched(c, fmt == KERN_W_FP8 ? "dequant_fp8_kernel" : "dequant_fp4_kernel");
}

/* ---- parameter checks shared by the four entries ---- */

static const char *fmt_name(kern_wfmt fmt)
{
    return fmt == KERN_W_FP8 ? "linear_fp8" : (fmt == KERN_W_FP4 ? "linear_fp4" : "linear_bf16");
}

/* DI_OK when p describes a valid call for a weight of format fmt (the head: f32 logits, one
 * group); *run = 0 when there is nothing to compute (m or n is 0). */
static di_status linear_check(cuda_ctx *c, const kern_linear *p, kern_wfmt fmt, const char *op,
                              int head, int *run)
{
    uint32_t groups = p->groups ? p->groups : 1;
    *run = 0;
    if (head && (!p->out_f32 || groups != 1))
        return cuda_fail(c, DI_EINVAL, "%s: needs out_f32 = 1 and one group (out_f32 %d, groups %u)",
                         op, p->out_f32, groups);
    if (p->k == 0 || p->k % 32 != 0)
        return cuda_fail(c, DI_EINVAL, "%s: k %u is not a positive multiple of 32", op, p->k);
    if (groups > 1 && fmt != KERN_W_BF16)
        return cuda_fail(c, DI_EINVAL, "%s: groups %u > 1 needs a bf16 weight", op, groups);
    if (p->accumulate && !p->out_f32)
        return cuda_fail(c, DI_EINVAL, "%s: accumulate needs out_f32", op);
    if ((uint64_t)groups * p->k > 0x7fffffffu || (uint64_t)groups * p->n > 0x7fffffffu ||
        p->m > 0x7fffffffu)
        return cuda_fail(c, DI_EINVAL, "%s: m %u, n %u, k %u x groups %u exceed int32", op, p->m,
                         p->n, p->k, groups);
    if (p->m == 0 || p->n == 0)
        return DI_OK;
    if (!p->x || !p->w || !p->y)
        return cuda_fail(c, DI_EINVAL, "%s: x, w or y is NULL", op);
    if (fmt != KERN_W_BF16 && !p->w_scale)
        return cuda_fail(c, DI_EINVAL, "%s: w_scale is NULL", op);
    if (p->x_stride < (size_t)groups * p->k)
        return cuda_fail(c, DI_EINVAL, "%s: x_stride %zu below groups*k %zu", op, p->x_stride,
                         (size_t)groups * p->k);
    if (p->y_stride < (size_t)groups * p->n)
        return cuda_fail(c, DI_EINVAL, "%s: y_stride %zu below groups*n %zu", op, p->y_stride,
                         (size_t)groups * p->n);
    *run = 1;
    return DI_OK;
}

/* ---- the two paths ---- */

/* FP8 / FP4 weight: up to c->linear_stream_rows rows (bf16 output, no accumulate, the
 * weight 16-byte aligned, cuBLASLt not bypassed, not in batch-invariant mode) on the
 * weight-streaming tensor-core kernel (moe_mma.cu); else quantise x, dequantise W, GEMM (in
 * batch-invariant mode the GEMM's fixed 64-row chunks, gemm.cu). */
static di_status linear_quantised(cuda_ctx *c, const kern_linear *p, kern_wfmt fmt)
{
    if (p->m <= (uint32_t)c->linear_stream_rows && !p->out_f32 && !p->accumulate &&
        !c->simple_gemm &&
        !c->batch_invariant && (uintptr_t)p->w % 16 == 0)
        return cuda_linear_stream(c, p, fmt == KERN_W_FP8);
    size_t xq_bytes = cuda_align_up((size_t)p->m * p->k * sizeof(uint16_t));
    size_t wd_bytes = cuda_align_up((size_t)p->n * p->k * sizeof(uint16_t));
    uint8_t *scratch;
    di_status st = cuda_scratch(c, xq_bytes + wd_bytes, &scratch);
    if (st != DI_OK)
        return st;
    uint16_t *xq = (uint16_t *)scratch;              /* [m, k] bf16, (A)-quantised x */
    uint16_t *wd = (uint16_t *)(scratch + xq_bytes); /* [n, k] bf16, dequantised W */
    st = cuda_fakequant_rows(c, KERN_Q_FP8_B32, p->x, p->x_stride, xq, p->k, p->m, p->k);
    if (st == DI_OK)
        st = launch_dequant(c, fmt, p, wd, c->stream);
    if (st != DI_OK)
        return st;
    cuda_gemm g = {};
    g.m = p->m, g.n = p->n, g.k = p->k, g.batch = 1;
    g.x = xq, g.ldx = p->k;
    g.w = wd, g.ldw = p->k;
    g.y = p->y, g.ldy = p->y_stride;
    g.out_f32 = p->out_f32, g.accumulate = p->accumulate;
    return cuda_gemm_run(c, &g);
}

/* BF16 weight [groups*n, k]: one GEMM per group as a strided batch. */
static di_status linear_plain(cuda_ctx *c, const kern_linear *p)
{
    uint32_t groups = p->groups ? p->groups : 1;
    cuda_gemm g = {};
    g.m = p->m, g.n = p->n, g.k = p->k, g.batch = groups;
    g.x = p->x, g.ldx = p->x_stride, g.x_batch = p->k;
    g.w = (const uint16_t *)p->w, g.ldw = p->k, g.w_batch = (size_t)p->n * p->k;
    g.y = p->y, g.ldy = p->y_stride, g.y_batch = p->n;
    g.out_f32 = p->out_f32, g.accumulate = p->accumulate;
    return cuda_gemm_run(c, &g);
}

di_status cuda_linear_run(cuda_ctx *c, const kern_linear *p, kern_wfmt fmt)
{
    int run = 0;
    di_status st = linear_check(c, p, fmt, fmt_name(fmt), 0, &run);
    if (st != DI_OK || !run)
        return st;
    st = fmt == KERN_W_BF16 ? linear_plain(c, p) : linear_quantised(c, p, fmt);
    if (st != DI_OK)
        di_error_prefix(&c->last, "%s: ", fmt_name(fmt));
    return st;
}

static di_status linear_entry(void *ctx, const kern_linear *p, kern_wfmt fmt, const char *op,
                              int head)
{
    cuda_ctx *c = (cuda_ctx *)ctx;
    di_status st = cuda_op_begin(c, p, op);
    int run = 0;
    if (st == DI_OK)
        st = linear_check(c, p, fmt, op, head, &run);
    if (st != DI_OK || !run)
        return st;
    st = fmt == KERN_W_BF16 ? linear_plain(c, p) : linear_quantised(c, p, fmt);
    if (st != DI_OK)
        di_error_prefix(&c->last, "%s: ", op);
    return st;
}

/* ---- table entries ---- */

di_status cuda_op_linear_fp8(void *ctx, const kern_linear *p)
{
    return linear_entry(ctx, p, KERN_W_FP8, fmt_name(KERN_W_FP8), 0);
}

di_status cuda_op_linear_fp4(void *ctx, const kern_linear *p)
{
    return linear_entry(ctx, p, KERN_W_FP4, fmt_name(KERN_W_FP4), 0);
}

di_status cuda_op_linear_bf16(void *ctx, const kern_linear *p)
{
    return linear_entry(ctx, p, KERN_W_BF16, fmt_name(KERN_W_BF16), 0);
}

di_status cuda_op_head(void *ctx, const kern_linear *p)
{
    return linear_entry(ctx, p, KERN_W_BF16, "head", 1);
}
