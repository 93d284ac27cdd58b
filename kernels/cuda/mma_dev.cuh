/* mma_dev.cuh: the warp-level tensor-core and shared-memory copy instructions the attention,
 * indexer and MoE kernels share (sm_80 and up), and their shared-memory layout rounding.
 * Included by .cu files only. */
#ifndef DI_KERNELS_CUDA_MMA_DEV_CUH
#define DI_KERNELS_CUDA_MMA_DEV_CUH

#include <cuda_runtime.h>
#include <stddef.h>
#include <stdint.h>

/* b rounded up to 128 bytes: the start of a region of a kernel's shared-memory layout. */
static __host__ __device__ __forceinline__ size_t dev_smem_round(size_t b)
{
    return (b + 127) / 128 * 128;
}

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

/* The same three without the memory clobber, for the MoE kernels' pipelines (their stages
 * are ordered by dev_cp_async_wait and barriers alone, so the compiler may move other memory
 * accesses across the copies). */
__device__ __forceinline__ void dev_cp_async16(void *smem, const void *gmem)
{
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dev_smem_addr(smem)),
                 "l"(gmem));
}

__device__ __forceinline__ void dev_cp_async_commit()
{
    asm volatile("cp.async.commit_group;\n" ::);
}

/* Waits until at most N committed groups are still in flight. */
template <int N>
__device__ __forceinline__ void dev_cp_async_wait()
{
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

#endif
