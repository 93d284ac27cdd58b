/* mma_dev.cuh: the warp-level tensor-core and shared-memory copy instructions the attention and
 * indexer kernels share (sm_80 and up). Included by .cu files only. */
#ifndef DI_KERNELS_CUDA_MMA_DEV_CUH
#define DI_KERNELS_CUDA_MMA_DEV_CUH

#include <cuda_runtime.h>
#include <stdint.h>

/* The shared-memory address of a generic pointer into shared memory. */
__device__ __forceinline__ uint32_t dev_smem_addr(const void *p)
{
    return (uint32_t)__cvta_generic_to_shared(p);
}

/* Four 8x8 b16 matrices from shared memory (lane i gives a row address of matrix i / 8). */
__device__ __forceinline__ void dev_ldm_x4(uint32_t *r, const void *p)
{
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(dev_smem_addr(p)));
}

/* The same, each matrix transposed. */
__device__ __forceinline__ void dev_ldm_x4_t(uint32_t *r, const void *p)
{
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(dev_smem_addr(p)));
}

/* d += a b: m16n8k16, bf16 operands, fp32 accumulators. */
__device__ __forceinline__ void dev_mma_bf16(float *d, const uint32_t *a, uint32_t b0, uint32_t b1)
{
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
                 "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

/* 16 bytes global -> shared, asynchronously (cp.async, bypassing L1). */
__device__ __forceinline__ void dev_cp16(void *dst, const void *src)
{
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dev_smem_addr(dst)), "l"(src)
                 : "memory");
}

__device__ __forceinline__ void dev_cp_commit(void)
{
    asm volatile("cp.async.commit_group;\n" ::: "memory");
}

__device__ __forceinline__ void dev_cp_wait_all(void)
{
    asm volatile("cp.async.wait_all;\n" ::: "memory");
}

#endif
