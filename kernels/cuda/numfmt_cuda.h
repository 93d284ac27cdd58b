/* numfmt_cuda.h: CUDA versions of the quantisation procedures of kernels/cpu/numfmt.h.
 *
 * Same contract as the C twins: (A) FP8 E4M3 with a UE8M0 scale per 32 values, (B) FP4 E2M1
 * with a UE8M0 scale per 32, (C) FP4 E2M1 with an E4M3 scale per 16. Results are bit-identical
 * to the C twins (tests/gpu/check_numfmt.c checks every element). Pointers are device memory.
 */
#ifndef DI_KERNELS_CUDA_NUMFMT_CUDA_H
#define DI_KERNELS_CUDA_NUMFMT_CUDA_H

#include <stddef.h>
#include <stdint.h>

#include "common/util/status.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef enum numfmt_procedure {
    NUMFMT_FP8_B32 = 0,  /* (A) */
    NUMFMT_FP4_B32 = 1,  /* (B) */
    NUMFMT_FP4_B16 = 2,  /* (C) */
} numfmt_procedure;

typedef struct numfmt_quant_params {
    const float *x;      /* [n] input values, device */
    size_t n;            /* multiple of the procedure's block (32, 32, 16) */
    numfmt_procedure procedure;
    uint8_t *codes;      /* (A): [n] E4M3 codes; (B), (C): [n/2] packed E2M1, low nibble first */
    uint8_t *scales;     /* (A), (B): [n/32] UE8M0; (C): [n/16] E4M3 */
    void *stream;        /* cudaStream_t; NULL = default stream */
} numfmt_quant_params;

/* Quantises x into codes and scales. DI_EINVAL for a bad size or NULL pointer; the CUDA error
 * of the launch otherwise. Asynchronous on the stream. */
di_status numfmt_cuda_quant(const numfmt_quant_params *p, di_error *err);

/* In place: x <- dequant(quant(x)) with the procedure (the "fake quantisation" of activations
 * and caches). */
di_status numfmt_cuda_fakequant(float *x, size_t n, numfmt_procedure procedure, void *stream,
                                di_error *err);

#ifdef __cplusplus
}
#endif

#endif
