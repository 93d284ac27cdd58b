/* rope.cu: rotary embedding of interleaved pairs with optional YaRN, in place (kern_rope; C twin:
 * kernels/cpu/ops_basic.c, rope_freqs and rope_rows).
 *
 * The frequencies are computed on the host with the twin's formula and roundings (double,
 * rounded to fp32 where it rounds), then uploaded with the positions. On the device: the angle
 * fp32(pos * f_i), cos and sin in double rounded to fp32 (CUDA's double cos/sin are within 2 ulp
 * of double, so the fp32 result is the twin's except within 2^-29 of a rounding tie), and the
 * rotation in fp32 with separate multiplies and adds, as the twin (no fused multiply-add).
 * Tolerance: bf16 1ulp. */
#include <cuda_runtime.h>
#include <math.h>
#include <stdint.h>

#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/cuda_internal.h"
#include "kernels/cuda/numfmt_dev.cuh"

#define ROPE_MAX_DIM 512

/* ---- host helper: the rope_dim/2 frequencies, the twin's arithmetic step for step:
 * f_i = fp32(base^(-2i/d)); with YaRN, fp32(f_i * (1 - ramp) + fp32(f_i / factor) * ramp) in
 * double, ramp the clamped linear ramp between the correction dimensions lo and hi. ---- */

static void rope_freqs_host(const kern_rope *p, float *f)
{
    uint32_t half = p->rope_dim / 2;
    double d = (double)p->rope_dim, b = (double)p->base;
    double lo = 0, hi = 0;
    if (p->yarn) {
        const double two_pi = 6.283185307179586;
        double cf = d * log((double)p->yarn_orig_len / (two_pi * (double)p->yarn_beta_fast)) /
                    (2.0 * log(b));
        double cs = d * log((double)p->yarn_orig_len / (two_pi * (double)p->yarn_beta_slow)) /
                    (2.0 * log(b));
        lo = floor(cf) > 0 ? floor(cf) : 0;
        hi = ceil(cs) < d - 1 ? ceil(cs) : d - 1;
    }
    for (uint32_t i = 0; i < half; i++) {
        float f32 = (float)pow(b, -2.0 * (double)i / d);
        double fi = f32;
        if (p->yarn) {
            double span = hi - lo > 0.001 ? hi - lo : 0.001;
            double ramp = ((double)i - lo) / span;
            ramp = ramp < 0 ? 0 : (ramp > 1 ? 1 : ramp);
            double scaled = (float)(fi / (double)p->yarn_factor);
            fi = fi * (1.0 - ramp) + scaled * ramp;
        }
        f[i] = (float)fi;
    }
}

/* ---- kernel: one block per row; the row's cos/sin table in shared memory, then every
 * (head, pair) of the row ---- */

__global__ void rope_kernel(uint16_t *x, size_t row_stride, size_t head_stride, uint32_t offset,
                            uint32_t half, uint32_t n_heads, const int64_t *positions,
                            const float *freqs, int inverse)
{
    __shared__ float cs[ROPE_MAX_DIM / 2], sn[ROPE_MAX_DIM / 2];
    const float pos = (float)positions[blockIdx.x];
    for (uint32_t i = threadIdx.x; i < half; i += blockDim.x) {
        double s, c;
        sincos((double)__fmul_rn(pos, freqs[i]), &s, &c);
        cs[i] = (float)c;
        sn[i] = inverse ? -(float)s : (float)s;
    }
    __syncthreads();
    uint16_t *xr = x + (size_t)blockIdx.x * row_stride + offset;
    for (uint32_t j = threadIdx.x; j < n_heads * half; j += blockDim.x) {
        uint32_t h = j / half, i = j % half;
        uint16_t *e = xr + (size_t)h * head_stride + 2 * i;
        float x0 = dev_bf16_to_f32(e[0]), x1 = dev_bf16_to_f32(e[1]);
        e[0] = dev_f32_to_bf16(__fsub_rn(__fmul_rn(x0, cs[i]), __fmul_rn(x1, sn[i])));
        e[1] = dev_f32_to_bf16(__fadd_rn(__fmul_rn(x0, sn[i]), __fmul_rn(x1, cs[i])));
    }
}

/* ---- launcher ---- */

static di_status launch_rope(cuda_ctx *c, const kern_rope *p, const int64_t *dev_pos,
                             const float *dev_freqs, cudaStream_t stream)
{
    cuda_launch(c, "rope_kernel", rope_kernel, p->n_rows, CUDA_THREADS, 0, stream, p->x,
                p->row_stride, p->head_stride, p->offset, p->rope_dim / 2, p->n_heads, dev_pos,
                dev_freqs, p->inverse);
    return cuda_launched(c, "rope_kernel");
}

/* ---- table entry ---- */

di_status cuda_op_rope(void *ctx, const kern_rope *p)
{
    cuda_ctx *c = (cuda_ctx *)ctx;
    di_status st = cuda_op_begin(c, p, "rope");
    if (st != DI_OK)
        return st;
    if (p->rope_dim % 2 != 0 || p->rope_dim > ROPE_MAX_DIM)
        return cuda_fail(c, DI_EINVAL, "rope: rope_dim %u must be even and at most %d",
                         p->rope_dim, ROPE_MAX_DIM);
    if (p->n_rows == 0 || p->n_heads == 0 || p->rope_dim == 0)
        return DI_OK;
    if (!p->x || !p->positions)
        return cuda_fail(c, DI_EINVAL, "rope: x or positions is NULL");
    if (p->n_rows > 0x7fffffffu || (uint64_t)p->n_heads * (p->rope_dim / 2) > 0xffffffffu)
        return cuda_fail(c, DI_EINVAL, "rope: %u rows x %u heads is too many for one launch",
                         p->n_rows, p->n_heads);
    if (p->yarn && !(p->yarn_factor > 0.0f))
        return cuda_fail(c, DI_EINVAL, "rope: yarn_factor %g must be positive",
                         (double)p->yarn_factor);
    float freqs[ROPE_MAX_DIM / 2];
    rope_freqs_host(p, freqs);
    size_t pos_bytes = cuda_align_up((size_t)p->n_rows * sizeof(int64_t));
    size_t f_bytes = (size_t)(p->rope_dim / 2) * sizeof(float);
    uint8_t *scratch;
    st = cuda_scratch(c, pos_bytes + f_bytes, &scratch);
    if (st == DI_OK)
        st = cuda_upload(c, scratch, p->positions, (size_t)p->n_rows * sizeof(int64_t));
    if (st == DI_OK)
        st = cuda_upload(c, scratch + pos_bytes, freqs, f_bytes);
    if (st != DI_OK)
        return st;
    return launch_rope(c, p, (const int64_t *)scratch, (const float *)(scratch + pos_bytes),
                       c->stream);
}
