/* gpu_common.h: helpers shared by the CUDA-vs-C checks and benchmarks in tests/gpu.
 * These programs run on the GPU machine (no Criterion there): each exits 0 when every check
 * passes, 1 on a mismatch (printing the parameters), 2 on a setup error. */
#ifndef DI_TESTS_GPU_COMMON_H
#define DI_TESTS_GPU_COMMON_H

#include <cuda_runtime_api.h>
#include <stdio.h>
#include <stdlib.h>

#define GPU_OK(call)                                                                         \
    do {                                                                                     \
        cudaError_t e_ = (call);                                                             \
        if (e_ != cudaSuccess) {                                                             \
            fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #call,                    \
                    cudaGetErrorString(e_));                                                 \
            exit(2);                                                                         \
        }                                                                                    \
    } while (0)

/* Median of n floats (sorts in place). */
static inline float gpu_median(float *v, int n)
{
    for (int i = 1; i < n; i++)
        for (int j = i; j > 0 && v[j - 1] > v[j]; j--) {
            float t = v[j];
            v[j] = v[j - 1];
            v[j - 1] = t;
        }
    return v[n / 2];
}

/* Device-to-device copy bandwidth in GB/s (bytes read + written), median of `reps`, measured
 * on `bytes` bytes: the memory ceiling every memory-bound kernel is compared with. */
static inline double gpu_copy_gbs(size_t bytes, int reps)
{
    void *a, *b;
    GPU_OK(cudaMalloc(&a, bytes));
    GPU_OK(cudaMalloc(&b, bytes));
    GPU_OK(cudaMemset(a, 1, bytes));
    cudaEvent_t t0, t1;
    GPU_OK(cudaEventCreate(&t0));
    GPU_OK(cudaEventCreate(&t1));
    float ms[64];
    if (reps > 64)
        reps = 64;
    GPU_OK(cudaMemcpy(b, a, bytes, cudaMemcpyDeviceToDevice));
    for (int r = 0; r < reps; r++) {
        GPU_OK(cudaEventRecord(t0, 0));
        GPU_OK(cudaMemcpy(b, a, bytes, cudaMemcpyDeviceToDevice));
        GPU_OK(cudaEventRecord(t1, 0));
        GPU_OK(cudaEventSynchronize(t1));
        GPU_OK(cudaEventElapsedTime(&ms[r], t0, t1));
    }
    double med = gpu_median(ms, reps);
    GPU_OK(cudaFree(a));
    GPU_OK(cudaFree(b));
    GPU_OK(cudaEventDestroy(t0));
    GPU_OK(cudaEventDestroy(t1));
    return 2.0 * (double)bytes / (med * 1e-3) / 1e9;
}

#endif
