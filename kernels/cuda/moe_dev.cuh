/* moe_dev.cuh: device pieces shared by moe.cu and moe_grouped.cu. Included by .cu files only. */
#ifndef DI_KERNELS_CUDA_MOE_DEV_CUH
#define DI_KERNELS_CUDA_MOE_DEV_CUH

#include <cuda_runtime.h>
#include <math.h>
#include <stdint.h>

#include "kernels/cuda/numfmt_dev.cuh"

/* SwiGLU of one element with the asymmetric clamp, the twin's (cpu_swiglu) double expressions
 * rounded where it rounds: g' = min(g, limit), u' = clamp(u, -limit, limit) (limit 0: no
 * clamp), silu = fp32(g' sigmoid(g')), h = bf16(fp32(fp32(silu u') w)) (weighted 0: no w). */
__device__ __forceinline__ uint16_t dev_swiglu(float gv, float uv, float limit, bool weighted,
                                               float w)
{
    if (limit > 0.0f) {
        uv = uv < -limit ? -limit : (uv > limit ? limit : uv);
        gv = gv > limit ? limit : gv;
    }
    float silu = (float)((double)gv * (1.0 / (1.0 + exp(-(double)gv))));
    float act = (float)((double)silu * (double)uv);
    if (weighted)
        act = (float)((double)act * (double)w);
    return dev_f32_to_bf16(act);
}

#endif
