/* rmsnorm.cu: RMSNorm of bf16 rows (kern_rmsnorm; C twin: kernels/cpu/ops_basic.c, cpu_rmsnorm
 * with cpu_rms_scale). With the twin's roundings: the sum of squares in double (each square of
 * a float is exact there), the mean rounded to fp32, + eps in fp32, 1/sqrt in double rounded
 * to fp32, then y = bf16(fp32(w * fp32(x * r))). Only the order of the double sum differs from
 * the twin, so results are bit-identical unless that sum rounds (tolerance: bf16 1ulp). */
#include <cuda_runtime.h>
#include <stdint.h>

#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/cuda_internal.h"
#include "kernels/cuda/numfmt_dev.cuh"

/* ---- device helpers ---- */

__device__ __forceinline__ double warp_sum(double v)
{
    for (int off = 16; off > 0; off /= 2)
        v += __shfl_xor_sync(0xffffffffu, v, off);
    return v;
}

/* ---- kernel: one block of CUDA_THREADS threads per row. The row is read twice (sum, then
 * scale); the writes come after the whole sum, so y may alias x. ---- */

__global__ void rmsnorm_kernel(const uint16_t *x, size_t x_stride, const uint16_t *weight,
                               uint16_t *y, size_t y_stride, uint32_t dim, float eps)
{
    __shared__ double partial[CUDA_THREADS / 32];
    __shared__ float scale;
    const uint16_t *xr = x + (size_t)blockIdx.x * x_stride;
    uint16_t *yr = y + (size_t)blockIdx.x * y_stride;
    double acc = 0.0;
    for (uint32_t i = threadIdx.x; i < dim; i += blockDim.x) {
        double v = (double)dev_bf16_to_f32(xr[i]);
        acc += v * v;
    }
    acc = warp_sum(acc);
    if ((threadIdx.x & 31) == 0)
        partial[threadIdx.x / 32] = acc;
    __syncthreads();
    if (threadIdx.x == 0) {
        double sum = 0.0;
        for (uint32_t w = 0; w < blockDim.x / 32; w++)
            sum += partial[w];
        float ms = (float)(sum / (double)dim);
        scale = (float)(1.0 / sqrt((double)__fadd_rn(ms, eps)));
    }
    __syncthreads();
    const float r = scale;
    for (uint32_t i = threadIdx.x; i < dim; i += blockDim.x) {
        float w = weight ? dev_bf16_to_f32(weight[i]) : 1.0f;
        yr[i] = dev_f32_to_bf16(__fmul_rn(w, __fmul_rn(dev_bf16_to_f32(xr[i]), r)));
    }
}

/* ---- launcher ---- */

static di_status launch_rmsnorm(cuda_ctx *c, const kern_rmsnorm *p, cudaStream_t stream)
{
    cuda_launch(c, "rmsnorm_kernel", rmsnorm_kernel, p->n_rows, CUDA_THREADS, 0, stream, p->x,
                p->x_stride, p->weight, p->y, p->y_stride, p->dim, p->eps);
    return cuda_launched(c, "rmsnorm_kernel");
}

/* ---- table entry ---- */

di_status cuda_op_rmsnorm(void *ctx, const kern_rmsnorm *p)
{
    cuda_ctx *c = (cuda_ctx *)ctx;
    di_status st = cuda_op_begin(c, p, "rmsnorm");
    if (st != DI_OK)
        return st;
    if (p->n_rows == 0)
        return DI_OK;
    if (p->dim == 0)
        return cuda_fail(c, DI_EINVAL, "rmsnorm: dim is 0");
    if (!p->x || !p->y)
        return cuda_fail(c, DI_EINVAL, "rmsnorm: x or y is NULL");
    if (p->x_stride < p->dim || p->y_stride < p->dim)
        return cuda_fail(c, DI_EINVAL, "rmsnorm: row strides %zu, %zu below dim %u", p->x_stride,
                         p->y_stride, p->dim);
    if (p->n_rows > 0x7fffffffu)
        return cuda_fail(c, DI_EINVAL, "rmsnorm: %u rows is too many for one launch", p->n_rows);
    return launch_rmsnorm(c, p, c->stream);
}
