/* fp8_ceiling.c: see fp8_ceiling.h. The row-major y = x w^T is the column-major
 * y^T = op(w) op(x) with w transposed ("TN", the layout cuBLASLt's FP8 kernels take). */
#include "tests/gpu/fp8_ceiling.h"

/* the toolkit header declares one function without a prototype */
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wstrict-prototypes"
#include <cublasLt.h>
#pragma GCC diagnostic pop
#include <cuda_runtime.h>
#include <stdio.h>
#include <stdlib.h>

#include "common/util/philox.h"
#include "kernels/cuda/backend_cuda.h"

#define FP8_WORKSPACE ((size_t)32 << 20)

typedef struct fp8_gemm {
    cublasLtHandle_t lt;
    cublasLtMatmulDesc_t desc;
    cublasLtMatrixLayout_t a, b, d;
    cublasLtMatmulAlgo_t algo;
    void *w, *x, *y, *sw, *sx, *ws;
    cudaStream_t stream;
} fp8_gemm;

static void fp8_release(fp8_gemm *g)
{
    if (g->desc)
        cublasLtMatmulDescDestroy(g->desc);
    if (g->a)
        cublasLtMatrixLayoutDestroy(g->a);
    if (g->b)
        cublasLtMatrixLayoutDestroy(g->b);
    if (g->d)
        cublasLtMatrixLayoutDestroy(g->d);
    g->desc = NULL, g->a = g->b = g->d = NULL;
}

/* The descriptors of one shape, block-scaled or not, and the heuristic's first algorithm.
 * 0 when cuBLASLt offers none. */
static int fp8_plan(fp8_gemm *g, const chk_fp8_shape *s, int block)
{
    fp8_release(g);
    cublasOperation_t ta = CUBLAS_OP_T, tb = CUBLAS_OP_N;
    if (cublasLtMatmulDescCreate(&g->desc, CUBLAS_COMPUTE_32F, CUDA_R_32F) != CUBLAS_STATUS_SUCCESS)
        return 0;
    cublasLtMatmulDescSetAttribute(g->desc, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof(ta));
    cublasLtMatmulDescSetAttribute(g->desc, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof(tb));
    int32_t ma = block ? CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F
                       : CUBLASLT_MATMUL_MATRIX_SCALE_SCALAR_32F;
    int32_t mb = block ? CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F
                       : CUBLASLT_MATMUL_MATRIX_SCALE_SCALAR_32F;
    if (cublasLtMatmulDescSetAttribute(g->desc, CUBLASLT_MATMUL_DESC_A_SCALE_MODE, &ma,
                                       sizeof(ma)) != CUBLAS_STATUS_SUCCESS ||
        cublasLtMatmulDescSetAttribute(g->desc, CUBLASLT_MATMUL_DESC_B_SCALE_MODE, &mb,
                                       sizeof(mb)) != CUBLAS_STATUS_SUCCESS)
        return 0;
    cublasLtMatmulDescSetAttribute(g->desc, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &g->sw,
                                   sizeof(g->sw));
    cublasLtMatmulDescSetAttribute(g->desc, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &g->sx,
                                   sizeof(g->sx));
    if (cublasLtMatrixLayoutCreate(&g->a, CUDA_R_8F_E4M3, s->k, s->n, s->k) != CUBLAS_STATUS_SUCCESS ||
        cublasLtMatrixLayoutCreate(&g->b, CUDA_R_8F_E4M3, s->k, s->m, s->k) != CUBLAS_STATUS_SUCCESS ||
        cublasLtMatrixLayoutCreate(&g->d, CUDA_R_16BF, s->n, s->m, s->n) != CUBLAS_STATUS_SUCCESS)
        return 0;
    cublasLtMatmulPreference_t pref;
    if (cublasLtMatmulPreferenceCreate(&pref) != CUBLAS_STATUS_SUCCESS)
        return 0;
    size_t wsb = FP8_WORKSPACE;
    cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &wsb,
                                         sizeof(wsb));
    cublasLtMatmulHeuristicResult_t res;
    int found = 0;
    cublasStatus_t st = cublasLtMatmulAlgoGetHeuristic(g->lt, g->desc, g->a, g->b, g->d, g->d,
                                                       pref, 1, &res, &found);
    cublasLtMatmulPreferenceDestroy(pref);
    if (st != CUBLAS_STATUS_SUCCESS || found < 1)
        return 0;
    g->algo = res.algo;
    return 1;
}

static di_status fp8_call(void *arg, int i)
{
    (void)i;
    fp8_gemm *g = arg;
    const float one = 1.0f, zero = 0.0f;
    cublasStatus_t st = cublasLtMatmul(g->lt, g->desc, &one, g->w, g->a, g->x, g->b, &zero, g->y,
                                       g->d, g->y, g->d, &g->algo, g->ws, FP8_WORKSPACE, g->stream);
    return st == CUBLAS_STATUS_SUCCESS && cudaGetLastError() == cudaSuccess ? DI_OK : DI_EINTERNAL;
}

/* random E4M3 codes of magnitude 2^-3 .. 2^3 (exponent fields 4 .. 10), either sign */
static void fp8_fill(uint8_t *p, size_t n, di_rng *rng)
{
    for (size_t i = 0; i < n; i++) {
        uint32_t r = di_rng_u32(rng);
        p[i] = (uint8_t)((r & 0x80) | (4 + (r >> 8) % 7) << 3 | (r >> 16 & 7));
    }
}

double chk_fp8_ceiling(chk_env *env, const chk_fp8_shape *shapes, size_t n, int *block_scaled)
{
    fp8_gemm g = {0};
    g.stream = (cudaStream_t)kern_cuda_stream(&env->gpu);
    if (cublasLtCreate(&g.lt) != CUBLAS_STATUS_SUCCESS) {
        printf("fp8 ceiling: cublasLtCreate failed\n");
        return -1;
    }
    size_t xb = 0, wb = 0, yb = 0, sx = 0, sw = 0;
    for (size_t i = 0; i < n; i++) {
        const chk_fp8_shape *s = &shapes[i];
        size_t kb = (s->k + 127) / 128;
        xb = (size_t)s->m * s->k > xb ? (size_t)s->m * s->k : xb;
        wb = (size_t)s->n * s->k > wb ? (size_t)s->n * s->k : wb;
        yb = (size_t)s->m * s->n * 2 > yb ? (size_t)s->m * s->n * 2 : yb;
        sx = (size_t)s->m * kb > sx ? (size_t)s->m * kb : sx;
        sw = (size_t)(s->n + 127) / 128 * kb > sw ? (size_t)(s->n + 127) / 128 * kb : sw;
    }
    di_rng rng;
    chk_case_rng(env, &rng);
    uint8_t *h = chk_malloc(xb > wb ? xb : wb);
    fp8_fill(h, xb, &rng);
    g.x = chk_dev_copy(env, h, xb);
    fp8_fill(h, wb, &rng);
    g.w = chk_dev_copy(env, h, wb);
    free(h);
    float *ones = chk_malloc((sx > sw ? sx : sw) * sizeof(float));
    for (size_t i = 0; i < (sx > sw ? sx : sw); i++)
        ones[i] = 1.0f;
    g.sx = chk_dev_copy(env, ones, sx * sizeof(float));
    g.sw = chk_dev_copy(env, ones, sw * sizeof(float));
    free(ones);
    g.y = chk_dev_alloc(env, yb);
    g.ws = chk_dev_alloc(env, FP8_WORKSPACE);
    /* block scaling when every shape has an algorithm for it */
    int block = 1;
    for (size_t i = 0; i < n && block; i++)
        block = fp8_plan(&g, &shapes[i], 1);
    double flops = 0, ms_sum = 0;
    for (size_t i = 0; i < n; i++) {
        const chk_fp8_shape *s = &shapes[i];
        if (!fp8_plan(&g, s, block)) {
            printf("fp8 ceiling: cuBLASLt has no FP8 algorithm for %u x %u x %u\n", s->m, s->n, s->k);
            ms_sum = -1;
            break;
        }
        double ms = chk_time_ms(env, fp8_call, &g, 3, 10);
        if (ms <= 0) {
            ms_sum = -1;
            break;
        }
        double f = 2.0 * s->m * (double)s->n * s->k;
        printf("  FP8 GEMM %s (%u x %u x %u, %s): %.3f ms, %.0f TFLOP/s\n", s->what, s->m, s->n,
               s->k, block ? "128-block scales" : "per-tensor scales", ms, f / (ms * 1e-3) / 1e12);
        flops += f, ms_sum += ms;
    }
    fp8_release(&g);
    cublasLtDestroy(g.lt);
    chk_dev_free(env, g.x), chk_dev_free(env, g.w), chk_dev_free(env, g.y);
    chk_dev_free(env, g.sx), chk_dev_free(env, g.sw), chk_dev_free(env, g.ws);
    *block_scaled = block;
    return ms_sum > 0 ? flops / (ms_sum * 1e-3) / 1e12 : -1;
}
