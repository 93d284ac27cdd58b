/* fp8_ceiling.h: the FP8 matrix-rate ceiling of a run, for benchmarks that compare a prefill
 * chunk against it: cuBLASLt E4M3 x E4M3 with fp32 accumulation and bf16 output, on random
 * codes, at given shapes. */
#ifndef DI_TESTS_GPU_FP8_CEILING_H
#define DI_TESTS_GPU_FP8_CEILING_H

#include <stddef.h>
#include <stdint.h>

#include "tests/gpu/check_util.h"

/* One GEMM y[m, n] = x[m, k] w[n, k]^T. */
typedef struct chk_fp8_shape {
    uint32_t m, n, k;
    const char *what;
} chk_fp8_shape;

/* The FP8 rate over the shapes (their flops over the sum of their median times), TFLOP/s;
 * each shape's rate printed on its own line. With the DeepSeek block scales when this
 * cuBLASLt offers them for the device (the weight per 128 x 128, the activations per 1 x 128:
 * *block_scaled = 1), else one scale per tensor (*block_scaled = 0). -1 when no FP8 algorithm
 * runs (the reason printed). */
double chk_fp8_ceiling(chk_env *env, const chk_fp8_shape *shapes, size_t n, int *block_scaled);

#endif
