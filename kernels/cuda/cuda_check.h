/* cuda_check.h: the one boundary where CUDA and cuBLASLt errors become di_status (STYLE.md H3).
 * Included by .cu files only. */
#ifndef DI_KERNELS_CUDA_CHECK_H
#define DI_KERNELS_CUDA_CHECK_H

#include <cublasLt.h>
#include <cuda_runtime.h>

#include "common/util/status.h"

/* Maps a cudaError_t to a di_status and writes "what: cuda error text" into err. */
static inline di_status di_cuda_status(cudaError_t e, const char *what, di_error *err)
{
    if (e == cudaSuccess)
        return DI_OK;
    di_status st = DI_EINTERNAL;
    if (e == cudaErrorMemoryAllocation)
        st = DI_ENOMEM;
    else if (e == cudaErrorInvalidValue || e == cudaErrorInvalidConfiguration)
        st = DI_EINVAL;
    else if (e == cudaErrorNoDevice || e == cudaErrorInsufficientDriver)
        st = DI_EUNAVAIL;
    else if (e == cudaErrorNoKernelImageForDevice || e == cudaErrorUnsupportedPtxVersion)
        st = DI_EUNSUPPORTED;
    return di_fail(err, st, "%s: %s (%s)", what, cudaGetErrorString(e), cudaGetErrorName(e));
}

/* Checks the launch that just happened (configuration errors show at once). */
static inline di_status di_cuda_launch_status(const char *kernel, di_error *err)
{
    return di_cuda_status(cudaGetLastError(), kernel, err);
}

/* Maps a cuBLASLt status to a di_status and writes "what: cuBLAS status name" into err. */
static inline di_status di_cublas_status(cublasStatus_t s, const char *what, di_error *err)
{
    if (s == CUBLAS_STATUS_SUCCESS)
        return DI_OK;
    di_status st = DI_EINTERNAL;
    if (s == CUBLAS_STATUS_ALLOC_FAILED)
        st = DI_ENOMEM;
    else if (s == CUBLAS_STATUS_INVALID_VALUE)
        st = DI_EINVAL;
    else if (s == CUBLAS_STATUS_NOT_SUPPORTED || s == CUBLAS_STATUS_ARCH_MISMATCH)
        st = DI_EUNSUPPORTED;
    return di_fail(err, st, "%s: %s (%s)", what, cublasLtGetStatusString(s),
                   cublasLtGetStatusName(s));
}

#endif
