/* moe_bucket.cu: moe_experts' (row, slot) pairs bucketed by expert on the device, so that a
 * decode step never reads the ids back (C twin: kernels/cpu/moe_bucket.c, compared by
 * tests/gpu/check_moe.c). One block: the counts by shared-memory atomics (order-free), the
 * bucket and group offsets by one warp's scan, a pair's place by counting the pairs of its
 * expert before it (ascending pairs inside a bucket, as the twin), a row's outputs by ranking
 * its slots' places; then the groups of at most `cap` pairs, with the expert's weights when a
 * table is given. An id outside [0, n_experts) is bucketed as expert 0 and raises the error
 * flag, which the backend reports at its next synchronisation. */
#include <cuda_runtime.h>
#include <stdint.h>

#include "kernels/cuda/cuda_internal.h"

#define BUCKET_THREADS 1024

__device__ __forceinline__ uint32_t bucket_id(const cuda_moe_bucket &a, uint32_t i, int *bad)
{
    int32_t e = a.ids[i];
    if (e < 0 || (uint32_t)e >= a.n_experts) {
        *bad = 1;
        return 0;
    }
    return (uint32_t)e;
}

__global__ void __launch_bounds__(BUCKET_THREADS) moe_bucket_kernel(cuda_moe_bucket a)
{
    extern __shared__ uint32_t bucket_smem[];
    const uint32_t E = a.n_experts, K = a.top_k, P = a.n_rows * a.top_k, cap = a.cap;
    uint32_t *cnt = bucket_smem, *st = cnt + E, *gst = st + E + 1, *q = gst + E + 1;
    __shared__ int bad;
    if (threadIdx.x == 0)
        bad = 0;
    for (uint32_t e = threadIdx.x; e < E; e += blockDim.x)
        cnt[e] = 0;
    __syncthreads();
    for (uint32_t i = threadIdx.x; i < P; i += blockDim.x)
        atomicAdd(&cnt[bucket_id(a, i, &bad)], 1u);
    __syncthreads();
    if (threadIdx.x < 32) { /* exclusive scans of the counts and of the groups per expert */
        const uint32_t lane = threadIdx.x, per = (E + 31) / 32;
        const uint32_t lo = lane * per < E ? lane * per : E, hi = lo + per < E ? lo + per : E;
        uint32_t s = 0, g = 0;
        for (uint32_t e = lo; e < hi; e++)
            s += cnt[e], g += (cnt[e] + cap - 1) / cap;
        uint32_t si = s, gi = g;
        for (int off = 1; off < 32; off *= 2) {
            uint32_t s2 = __shfl_up_sync(0xffffffffu, si, off);
            uint32_t g2 = __shfl_up_sync(0xffffffffu, gi, off);
            if ((int)lane >= off)
                si += s2, gi += g2;
        }
        uint32_t s0 = si - s, g0 = gi - g;
        for (uint32_t e = lo; e < hi; e++) {
            st[e] = s0, gst[e] = g0;
            s0 += cnt[e], g0 += (cnt[e] + cap - 1) / cap;
        }
        if (lane == 31)
            st[E] = si, gst[E] = gi;
    }
    __syncthreads();
    for (uint32_t i = threadIdx.x; i < P; i += blockDim.x) {
        const uint32_t e = bucket_id(a, i, &bad);
        uint32_t rank = 0;
        for (uint32_t j = 0; j < i; j++)
            rank += bucket_id(a, j, &bad) == e;
        q[i] = st[e] + rank;
        a.pair[st[e] + rank] = (int32_t)i;
    }
    __syncthreads();
    for (uint32_t i = threadIdx.x; i < P; i += blockDim.x) {
        const uint32_t t = i / K;
        uint32_t r = 0;
        for (uint32_t s = 0; s < K; s++)
            r += q[t * K + s] < q[i];
        a.pos[t * K + r] = (int32_t)q[i];
    }
    for (uint32_t e = threadIdx.x; e <= E; e += blockDim.x) {
        if (a.start)
            a.start[e] = st[e];
        if (a.count && e < E)
            a.count[e] = cnt[e];
    }
    for (uint32_t e = threadIdx.x; e < E; e += blockDim.x)
        for (uint32_t at = 0, g = gst[e]; at < cnt[e]; at += cap, g++) {
            const uint32_t n = cnt[e] - at < cap ? cnt[e] - at : cap;
            if (a.group_expert)
                a.group_expert[g] = e, a.group_start[g] = st[e] + at, a.group_rows[g] = n;
            if (a.groups) {
                const kern_expert ex = a.experts[e];
                cuda_moe_group gr;
                gr.w1 = ex.w1, gr.s1 = ex.w1_scale, gr.w3 = ex.w3, gr.s3 = ex.w3_scale;
                gr.w2 = ex.w2, gr.s2 = ex.w2_scale, gr.start = st[e] + at, gr.n = n;
                a.groups[g] = gr;
            }
        }
    __syncthreads();
    if (threadIdx.x == 0) {
        *a.n_groups = gst[E];
        if (bad && a.error)
            atomicOr(a.error, CUDA_ERR_MOE_ID);
    }
}

size_t cuda_moe_bucket_smem(uint32_t n_experts, uint32_t n_pairs)
{
    return ((size_t)3 * n_experts + 2 + n_pairs) * sizeof(uint32_t);
}

di_status cuda_moe_bucket_run(cuda_ctx *c, const cuda_moe_bucket *a)
{
    const size_t smem = cuda_moe_bucket_smem(a->n_experts, a->n_rows * a->top_k);
    if (a->cap == 0 || a->top_k == 0 || a->n_experts == 0 || smem > CUDA_BUCKET_SMEM)
        return cuda_fail(c, DI_EINVAL, "moe bucket: cap %u, top_k %u, %u experts, %u pairs "
                         "(at most %zu bytes of shared memory)", a->cap, a->top_k, a->n_experts,
                         a->n_rows * a->top_k, (size_t)CUDA_BUCKET_SMEM);
    if (smem > 48 * 1024) { /* opted in above the default (per function; harmless again) */
        di_status st = cuda_check(c, cudaFuncSetAttribute(moe_bucket_kernel,
                                                          cudaFuncAttributeMaxDynamicSharedMemorySize,
                                                          (int)smem),
                                  "moe_bucket_kernel: cudaFuncSetAttribute");
        if (st != DI_OK)
            return st;
    }
    cuda_launch(c, "moe_bucket_kernel", moe_bucket_kernel, 1, BUCKET_THREADS, smem, c->stream, *a);
    return cuda_launched(c, "moe_bucket_kernel");
}
