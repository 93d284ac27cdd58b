/* gemm.cu: y = x @ W^T with bf16 operands and fp32 accumulation, through cuBLASLt (where a
 * library GEMM fits), or a plain CUDA-core kernel when cuBLASLt offers no algorithm for the
 * shape and alignment (or the backend was built with simple_gemm). Both accumulate in fp32; the
 * tolerance is the one kernels.h gives kern_linear.
 *
 * Row-major to column-major mapping. cuBLASLt is column-major; our tensors are row-major:
 *   x [m, k] row-major, row stride ldx  ==  X' = x^T: column-major [k, m], ld ldx
 *   W [n, k] row-major, row stride ldw  ==  W' = W^T: column-major [k, n], ld ldw
 *   y [m, n] row-major, row stride ldy  ==  Y' = y^T: column-major [n, m], ld ldy
 * and y = x W^T is y^T = W x^T, i.e. Y' = op(A) op(B) with A = W' (TRANSA = T, so op(A) is
 * [n, k]) and B = X' (TRANSB = N, [k, m]). Both operands are then read along k, the layout
 * ("TN") the tensor-core kernels prefer. Groups are a strided batch: batch b uses
 * x + b*x_batch, W + b*w_batch, y + b*y_batch with the same leading dimensions.
 * accumulate is beta = 1 with C = D = y (an in-place update, same layout).
 *
 * Batch-invariant mode (kern_cuda_set_batch_invariant): cuBLASLt picks an algorithm per m
 * (tiles, split-k), so a row's sums can come in another order when the call has another
 * number of rows. In the mode every GEMM runs in chunks of CUDA_BI_ROWS rows: the chunk's rows
 * of x are copied into a staging buffer of exactly that many rows (zeros below them), the GEMM
 * runs with m = CUDA_BI_ROWS, the buffer's leading dimensions and 256-byte alignment, so one
 * plan (one algorithm) serves every call of a given (n, k, groups), and the chunk's rows of y
 * are copied out (and in first, to accumulate). A row's output then depends on its own inputs
 * only: the same algorithm computes it with the same tiles in the same order whatever the
 * other rows hold. Cost: a call of m rows reads the weight ceil(m / 64) times and moves its
 * rows of x and y twice; at decode sizes (m <= 64) the weight is read once, as before.
 */
#include <cublasLt.h>
#include <cuda_runtime.h>
#include <string.h>

#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/cuda_internal.h"
#include "kernels/cuda/numfmt_dev.cuh"

#define SIMPLE_TILE 16

/* ---- the plain kernel: one output per thread, 16x16 tiles of x and W in shared memory ---- */

template <bool OUT_F32>
__global__ void gemm_simple_kernel(cuda_gemm g)
{
    __shared__ float xs[SIMPLE_TILE][SIMPLE_TILE + 1];
    __shared__ float ws[SIMPLE_TILE][SIMPLE_TILE + 1];
    const uint32_t tx = threadIdx.x, ty = threadIdx.y;
    const uint32_t row = blockIdx.y * SIMPLE_TILE + ty;   /* output row (m) */
    const uint32_t col = blockIdx.x * SIMPLE_TILE + tx;   /* output column (n) */
    const uint32_t wrow = blockIdx.x * SIMPLE_TILE + ty;  /* W row this thread loads */
    const uint16_t *x = g.x + (size_t)blockIdx.z * g.x_batch;
    const uint16_t *w = g.w + (size_t)blockIdx.z * g.w_batch;
    float acc = 0.0f;
    for (uint32_t k0 = 0; k0 < g.k; k0 += SIMPLE_TILE) {
        xs[ty][tx] = row < g.m ? dev_bf16_to_f32(x[(size_t)row * g.ldx + k0 + tx]) : 0.0f;
        ws[ty][tx] = wrow < g.n ? dev_bf16_to_f32(w[(size_t)wrow * g.ldw + k0 + tx]) : 0.0f;
        __syncthreads();
#pragma unroll
        for (int kk = 0; kk < SIMPLE_TILE; kk++)
            acc = fmaf(xs[ty][kk], ws[tx][kk], acc);
        __syncthreads();
    }
    if (row >= g.m || col >= g.n)
        return;
    size_t at = (size_t)blockIdx.z * g.y_batch + (size_t)row * g.ldy + col;
    if (OUT_F32) {
        float *y = (float *)g.y;
        y[at] = g.accumulate ? y[at] + acc : acc;
    } else {
        ((uint16_t *)g.y)[at] = dev_f32_to_bf16(acc);
    }
}

static di_status launch_simple(cuda_ctx *c, const cuda_gemm *g, cudaStream_t stream)
{
    if (g->k % SIMPLE_TILE != 0)
        return cuda_fail(c, DI_EINVAL, "gemm: k %u is not a multiple of %d", g->k, SIMPLE_TILE);
    dim3 block(SIMPLE_TILE, SIMPLE_TILE);
    dim3 grid((g->n + SIMPLE_TILE - 1) / SIMPLE_TILE, (g->m + SIMPLE_TILE - 1) / SIMPLE_TILE,
              g->batch);
    if (grid.y > 65535 || grid.z > 65535)
        return cuda_fail(c, DI_EINVAL, "gemm: m %u or batch %u too large for the plain kernel",
                         g->m, g->batch);
    if (g->out_f32)
        cuda_launch(c, "gemm_simple_kernel", gemm_simple_kernel<true>, grid, block, 0, stream, *g);
    else
        cuda_launch(c, "gemm_simple_kernel", gemm_simple_kernel<false>, grid, block, 0, stream, *g);
    di_status st = cuda_launched(c, "gemm_simple_kernel");
    if (st == DI_OK)
        c->stats.gemm_simple++;
    return st;
}

/* ---- cuBLASLt plans ---- */

/* Alignment in bytes (a power of two, at most 256) that every batch's pointer has. */
static uint32_t known_align(const void *p, size_t batch_stride_bytes, uint32_t batch)
{
    uint64_t a = (uint64_t)(uintptr_t)p | 256u;
    if (batch > 1)
        a |= batch_stride_bytes;
    return (uint32_t)(a & (~a + 1));
}

static void plan_destroy(cuda_plan *pl)
{
    if (!pl->used)
        return;
    if (pl->ly)
        cublasLtMatrixLayoutDestroy(pl->ly);
    if (pl->lx)
        cublasLtMatrixLayoutDestroy(pl->lx);
    if (pl->lw)
        cublasLtMatrixLayoutDestroy(pl->lw);
    if (pl->desc)
        cublasLtMatmulDescDestroy(pl->desc);
    memset(pl, 0, sizeof(*pl));
}

void cuda_gemm_release(cuda_ctx *c)
{
    for (int i = 0; i < CUDA_PLAN_SLOTS; i++)
        plan_destroy(&c->plans[i]);
    c->plan_next = 0;
    if (c->bi)
        cudaFree(c->bi);
    c->bi = NULL;
    c->bi_bytes = 0;
}

static di_status lt(cuda_ctx *c, cublasStatus_t s, const char *what)
{
    return di_cublas_status(s, what, &c->last);
}

static di_status set_batch(cuda_ctx *c, cublasLtMatrixLayout_t l, uint32_t batch, uint64_t stride)
{
    int32_t count = (int32_t)batch;
    int64_t offset = (int64_t)stride;
    di_status st = lt(c, cublasLtMatrixLayoutSetAttribute(l, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT,
                                                          &count, sizeof(count)),
                      "cuBLASLt layout batch count");
    if (st == DI_OK)
        st = lt(c, cublasLtMatrixLayoutSetAttribute(l, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET,
                                                    &offset, sizeof(offset)),
                "cuBLASLt layout batch offset");
    return st;
}

static di_status plan_layouts(cuda_ctx *c, const cuda_plan_key *k, cuda_plan *pl)
{
    int32_t ta = CUBLAS_OP_T, tb = CUBLAS_OP_N;
    di_status st = lt(c, cublasLtMatmulDescCreate(&pl->desc, CUBLAS_COMPUTE_32F, CUDA_R_32F),
                      "cublasLtMatmulDescCreate");
    if (st == DI_OK)
        st = lt(c, cublasLtMatmulDescSetAttribute(pl->desc, CUBLASLT_MATMUL_DESC_TRANSA, &ta,
                                                  sizeof(ta)),
                "cuBLASLt TRANSA");
    if (st == DI_OK)
        st = lt(c, cublasLtMatmulDescSetAttribute(pl->desc, CUBLASLT_MATMUL_DESC_TRANSB, &tb,
                                                  sizeof(tb)),
                "cuBLASLt TRANSB");
    if (st == DI_OK)
        st = lt(c, cublasLtMatrixLayoutCreate(&pl->lw, CUDA_R_16BF, k->k, k->n, (int64_t)k->ldw),
                "cuBLASLt layout of W");
    if (st == DI_OK)
        st = lt(c, cublasLtMatrixLayoutCreate(&pl->lx, CUDA_R_16BF, k->k, k->m, (int64_t)k->ldx),
                "cuBLASLt layout of x");
    if (st == DI_OK)
        st = lt(c, cublasLtMatrixLayoutCreate(&pl->ly, k->out_f32 ? CUDA_R_32F : CUDA_R_16BF,
                                              k->n, k->m, (int64_t)k->ldy),
                "cuBLASLt layout of y");
    if (st == DI_OK && k->batch > 1) {
        st = set_batch(c, pl->lw, k->batch, k->w_batch);
        if (st == DI_OK)
            st = set_batch(c, pl->lx, k->batch, k->x_batch);
        if (st == DI_OK)
            st = set_batch(c, pl->ly, k->batch, k->y_batch);
    }
    return st;
}

/* Asks the heuristic for the best algorithm under our workspace and alignments. No algorithm
 * (NOT_SUPPORTED or an empty answer) is not an error: the plan then uses the plain kernel. */
static di_status plan_algo(cuda_ctx *c, const cuda_plan_key *k, cuda_plan *pl)
{
    cublasLtMatmulPreference_t pref = NULL;
    di_status st = lt(c, cublasLtMatmulPreferenceCreate(&pref), "cublasLtMatmulPreferenceCreate");
    if (st != DI_OK)
        return st;
    uint64_t ws = c->workspace_bytes;
    const struct {
        cublasLtMatmulPreferenceAttributes_t attr;
        uint32_t value;
    } aligns[] = {
        {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, k->align_w},
        {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, k->align_x},
        {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, k->align_y},
        {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, k->align_y},
    };
    st = lt(c, cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                                    &ws, sizeof(ws)),
            "cuBLASLt workspace preference");
    /* a bf16 output: split-k partial sums only in the fp32 compute type (the in-place and
     * output-type reductions add bf16-rounded partials, several ulps off the fp32 sum: seen on
     * the H200 at m = 33-40, n = 70-100, k = 2048-3200, up to 30x the linear tolerance) */
    uint32_t reduce = CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE;
    if (st == DI_OK && !k->out_f32)
        st = lt(c, cublasLtMatmulPreferenceSetAttribute(pref,
                                                        CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK,
                                                        &reduce, sizeof(reduce)),
                "cuBLASLt reduction preference");
    for (size_t i = 0; st == DI_OK && i < sizeof(aligns) / sizeof(aligns[0]); i++)
        st = lt(c, cublasLtMatmulPreferenceSetAttribute(pref, aligns[i].attr, &aligns[i].value,
                                                        sizeof(aligns[i].value)),
                "cuBLASLt alignment preference");
    if (st == DI_OK) {
        cublasLtMatmulHeuristicResult_t res;
        memset(&res, 0, sizeof(res));
        int found = 0;
        cublasStatus_t s = cublasLtMatmulAlgoGetHeuristic(c->lt, pl->desc, pl->lw, pl->lx, pl->ly,
                                                          pl->ly, pref, 1, &res, &found);
        if (s == CUBLAS_STATUS_SUCCESS && found > 0 && res.state == CUBLAS_STATUS_SUCCESS &&
            res.workspaceSize <= c->workspace_bytes) {
            pl->algo = res.algo;
            pl->have_algo = 1;
        } else if (s != CUBLAS_STATUS_SUCCESS && s != CUBLAS_STATUS_NOT_SUPPORTED) {
            st = lt(c, s, "cublasLtMatmulAlgoGetHeuristic");
        }
    }
    cublasLtMatmulPreferenceDestroy(pref);
    return st;
}

static di_status plan_get(cuda_ctx *c, const cuda_plan_key *k, cuda_plan **out)
{
    for (int i = 0; i < CUDA_PLAN_SLOTS; i++)
        if (c->plans[i].used && memcmp(&c->plans[i].key, k, sizeof(*k)) == 0) {
            *out = &c->plans[i];
            return DI_OK;
        }
    cuda_plan *pl = &c->plans[c->plan_next];
    c->plan_next = (c->plan_next + 1) % CUDA_PLAN_SLOTS;
    plan_destroy(pl);
    pl->used = 1; /* so plan_destroy releases a half-built plan */
    pl->key = *k;
    di_status st = plan_layouts(c, k, pl);
    if (st == DI_OK)
        st = plan_algo(c, k, pl);
    if (st != DI_OK) {
        plan_destroy(pl);
        return st;
    }
    c->stats.plans_built++;
    *out = pl;
    return DI_OK;
}

static void plan_key(const cuda_gemm *g, cuda_plan_key *k)
{
    memset(k, 0, sizeof(*k));
    size_t ysz = g->out_f32 ? 4 : 2;
    k->m = g->m;
    k->n = g->n;
    k->k = g->k;
    k->batch = g->batch;
    k->out_f32 = g->out_f32 ? 1 : 0;
    k->align_x = known_align(g->x, g->x_batch * 2, g->batch);
    k->align_w = known_align(g->w, g->w_batch * 2, g->batch);
    k->align_y = known_align(g->y, g->y_batch * ysz, g->batch);
    k->ldx = g->ldx;
    k->ldw = g->ldw;
    k->ldy = g->ldy;
    if (g->batch > 1) {
        k->x_batch = g->x_batch;
        k->w_batch = g->w_batch;
        k->y_batch = g->y_batch;
    }
}

static di_status gemm_once(cuda_ctx *c, const cuda_gemm *g)
{
    if (g->accumulate && !g->out_f32)
        return cuda_fail(c, DI_EINVAL, "gemm: accumulate needs an f32 output");
    if (cuda_graph_log_gemm(c, g)) /* issued with the segment (cuda_gemm_issue) */
        return DI_OK;
    return cuda_gemm_issue(c, g);
}

di_status cuda_gemm_issue(cuda_ctx *c, const cuda_gemm *g)
{
    if (c->simple_gemm)
        return launch_simple(c, g, c->stream);
    cuda_plan_key key;
    plan_key(g, &key);
    cuda_plan *pl = NULL;
    di_status st = plan_get(c, &key, &pl);
    if (st == DI_OK && !pl->have_algo)
        return launch_simple(c, g, c->stream);
    if (st == DI_OK) {
        const float alpha = 1.0f, beta = g->accumulate ? 1.0f : 0.0f;
        cublasStatus_t s = cublasLtMatmul(c->lt, pl->desc, &alpha, g->w, pl->lw, g->x, pl->lx,
                                          &beta, g->y, pl->ly, g->y, pl->ly, &pl->algo,
                                          c->workspace, c->workspace_bytes, c->stream);
        if (s == CUBLAS_STATUS_NOT_SUPPORTED) { /* refused at run time: the plan falls back */
            pl->have_algo = 0;
            return launch_simple(c, g, c->stream);
        }
        st = lt(c, s, "cublasLtMatmul");
    }
    if (st != DI_OK) {
        di_error_prefix(&c->last, "gemm m=%u n=%u k=%u batch=%u ldx=%zu ldy=%zu: ", g->m, g->n,
                        g->k, g->batch, g->ldx, g->ldy);
        return st;
    }
    c->stats.gemm_cublaslt++;
    return DI_OK;
}

/* ---- batch-invariant mode ---- */

/* The staging buffer of the mode, at least `bytes` (grown in steps of 1 MiB after the queue
 * has drained). */
static di_status bi_buffer(cuda_ctx *c, size_t bytes, uint8_t **out)
{
    if (c->bi_bytes < bytes) {
        di_status st = cuda_graph_break(c); /* queued work may still use the old buffer */
        if (st == DI_OK)
            st = cuda_check(c, cudaStreamSynchronize(c->stream), "cudaStreamSynchronize");
        if (st != DI_OK)
            return st;
        if (c->bi)
            cudaFree(c->bi);
        c->bi = NULL;
        c->bi_bytes = 0;
        size_t want = (bytes + ((size_t)1 << 20) - 1) & ~(((size_t)1 << 20) - 1);
        if (cudaMalloc(&c->bi, want) != cudaSuccess) {
            cudaGetLastError();
            c->bi = NULL;
            return cuda_fail(c, DI_ENOMEM, "gemm: %zu bytes of batch-invariant staging", want);
        }
        c->bi_bytes = want;
        di_status rs = cuda_graph_resume(c);
        if (rs != DI_OK)
            return rs;
    }
    *out = c->bi;
    return DI_OK;
}

static di_status gemm_invariant(cuda_ctx *c, const cuda_gemm *g)
{
    if (g->batch > 1 && (g->x_batch != g->k || g->y_batch != g->n))
        return cuda_fail(c, DI_EUNSUPPORTED, "gemm: batch-invariant mode takes groups side by "
                                             "side in a row (x_batch %zu for k %u, y_batch %zu "
                                             "for n %u)", g->x_batch, g->k, g->y_batch, g->n);
    const size_t xw = (size_t)g->batch * g->k, yw = (size_t)g->batch * g->n;
    const size_t ysz = g->out_f32 ? 4 : 2;
    const size_t xb = cuda_align_up((size_t)CUDA_BI_ROWS * xw * 2);
    const size_t yb = cuda_align_up((size_t)CUDA_BI_ROWS * yw * ysz);
    uint8_t *buf = NULL;
    di_status st = bi_buffer(c, xb + yb, &buf);
    if (st != DI_OK)
        return st;
    cuda_gemm f = *g;
    f.m = CUDA_BI_ROWS;
    f.x = (const uint16_t *)buf, f.ldx = xw;
    f.y = buf + xb, f.ldy = yw;
    const uint8_t *x = (const uint8_t *)g->x;
    uint8_t *y = (uint8_t *)g->y;
    for (uint32_t r0 = 0; r0 < g->m && st == DI_OK; r0 += CUDA_BI_ROWS) {
        const uint32_t rows = g->m - r0 < CUDA_BI_ROWS ? g->m - r0 : CUDA_BI_ROWS;
        st = cuda_copy_2d(c, buf, xw * 2, x + (size_t)r0 * g->ldx * 2, g->ldx * 2, xw * 2, rows,
                          "gemm: rows into the batch-invariant staging");
        if (st == DI_OK && rows < CUDA_BI_ROWS)
            st = cuda_memset(c, buf + (size_t)rows * xw * 2, 0,
                             (size_t)(CUDA_BI_ROWS - rows) * xw * 2,
                             "gemm: zero rows of the staging");
        if (st == DI_OK && g->accumulate)
            st = cuda_copy_2d(c, buf + xb, yw * ysz, y + (size_t)r0 * g->ldy * ysz,
                              g->ldy * ysz, yw * ysz, rows, "gemm: y into the staging");
        if (st == DI_OK)
            st = gemm_once(c, &f);
        if (st == DI_OK)
            st = cuda_copy_2d(c, y + (size_t)r0 * g->ldy * ysz, g->ldy * ysz, buf + xb, yw * ysz,
                              yw * ysz, rows, "gemm: rows out of the staging");
        if (st == DI_OK)
            c->stats.gemm_invariant++;
    }
    return st;
}

di_status cuda_gemm_run(cuda_ctx *c, const cuda_gemm *g)
{
    if (g->m == 0 || g->n == 0 || g->batch == 0)
        return DI_OK;
    return c->batch_invariant ? gemm_invariant(c, g) : gemm_once(c, g);
}

extern "C" di_status kern_cuda_set_batch_invariant(kern_backend *be, int on)
{
    if (!be || !be->ctx || !be->name || strcmp(be->name, "cuda") != 0)
        return DI_EINVAL;
    ((cuda_ctx *)be->ctx)->batch_invariant = on != 0;
    return DI_OK;
}
