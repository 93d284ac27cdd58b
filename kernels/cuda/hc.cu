/* hc.cu: the manifold-constrained hyper-connections (MODEL.md §2.3): the per-site mixes with the
 * Sinkhorn normalisation (kern_hc_mixes), the collapse of the residual copies (kern_hc_collapse)
 * and the expand/mix after a sublayer (kern_hc_expand). C twins: kernels/cpu/ops_basic.c
 * (mixes_rows, sinkhorn, collapse_rows, expand_rows).
 *
 * Arithmetic order on the device, against the twin:
 *  - mixes: the sum of squares and the (2+hc)*hc dot products fn[i] . v are summed in double
 *    (every product of two floats is exact there; a block per 1,024 inputs of a row, more
 *    when the rows fill the GPU, or from 96 rows on a block per 32 rows and 1,024 inputs with
 *    fn staged once for its rows; then a block per row adds the blocks in order) in another
 *    order than the twin's lanes, so
 *    their fp32 roundings match except at a double rounding tie; every later step is the twin's
 *    step for step (fp32 multiply and add with the _rn intrinsics so that nothing is fused,
 *    sigmoid and Sinkhorn in double, the Sinkhorn one thread per entry). Tolerance: abs 1e-5 (kernels.h).
 *  - collapse and expand: each output is the twin's double expression in the twin's order
 *    (products of fp32 and bf16 are exact in double), rounded once to fp32 then to bf16:
 *    bit-identical.
 */
#include <cuda_runtime.h>
#include <math.h>
#include <stdint.h>

#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/cuda_internal.h"
#include "kernels/cuda/numfmt_dev.cuh"

#define HC_MAX 8                      /* copies supported (the twin's HC_MAX) */
#define HC_CHUNK 24                   /* mixes accumulated per pass over a row (one pass at hc 4) */
#define HC_WARPS (CUDA_THREADS / 32)
#define HC_SPLIT_K 1024               /* least inputs of a row per block of hc_mixes' first pass */
#define HC_BLOCKS_PER_SM 8            /* first-pass blocks per SM the split aims at */

/* ---- device helpers ---- */

__device__ __forceinline__ double warp_sum_d(double v)
{
    for (int off = 16; off > 0; off /= 2)
        v += __shfl_xor_sync(0xffffffffu, v, off);
    return v;
}

__device__ __forceinline__ double sigmoid_d(double x)
{
    return 1.0 / (1.0 + exp(-x));
}

/* The twin's sinkhorn(): row softmax + eps, a column step, then (iters - 1) x (row step,
 * column step), all in double, in place on s[hc * hc] in shared memory. Thread e < hc * hc
 * owns entry (e / hc, e % hc) and computes its row's or column's sum itself in the twin's
 * order, so every entry gets the twin's expression bit for bit; every thread of the block
 * must call it. */
__device__ void sinkhorn_dev(double *s, uint32_t hc, uint32_t iters, double eps)
{
    const uint32_t e = threadIdx.x, i = e / hc, j = e % hc;
    const bool own = e < hc * hc;
    double v = own ? s[e] : 0.0, sum = 0.0;
    if (own) {
        double mx = s[i * hc];
        for (uint32_t k = 1; k < hc; k++)
            mx = s[i * hc + k] > mx ? s[i * hc + k] : mx;
        v = exp(v - mx);
    }
    __syncthreads();
    if (own)
        s[e] = v;
    __syncthreads();
    if (own) {
        for (uint32_t k = 0; k < hc; k++)
            sum += s[i * hc + k];
        v = v / sum + eps;
    }
    for (uint32_t it = 0; it < iters; it++) {
        if (it > 0) {
            __syncthreads();
            if (own)
                s[e] = v;
            __syncthreads();
            if (own) {
                sum = 0.0;
                for (uint32_t k = 0; k < hc; k++)
                    sum += s[i * hc + k];
                v /= sum + eps;
            }
        }
        __syncthreads();
        if (own)
            s[e] = v;
        __syncthreads();
        if (own) {
            sum = 0.0;
            for (uint32_t k = 0; k < hc; k++)
                sum += s[k * hc + j];
            v /= sum + eps;
        }
    }
    __syncthreads();
    if (own)
        s[e] = v;
    __syncthreads();
}

/* ---- kernels ---- */

/* Pass 1: block (row, split) sums its split_k inputs of the row (the last split fewer):
 * pass 0 also sums the squares; pass q accumulates mixes [q*HC_CHUNK, (q+1)*HC_CHUNK). Thread
 * sums fold by warp shuffles, then the warps in order, into part[row][split][n_mix + 1] (the
 * mixes, then the sum of squares). */
__global__ void hc_mixes_part_kernel(kern_hc_mixes p, uint32_t splits, uint32_t split_k,
                                     double *part_out)
{
    __shared__ double part[HC_WARPS][HC_CHUNK + 1];
    const uint32_t hc = p.n_copies, width = hc * p.dim, n_mix = (2 + hc) * hc;
    const uint32_t row = blockIdx.x / splits, sp = blockIdx.x % splits;
    const uint32_t k_lo = sp * split_k, k_hi = width - k_lo > split_k ? k_lo + split_k : width;
    const uint16_t *v = p.h + (size_t)row * width;
    double *out = part_out + ((size_t)row * splits + sp) * (n_mix + 1);
    const uint32_t lane = threadIdx.x & 31, warp = threadIdx.x / 32;
    for (uint32_t i0 = 0; i0 < n_mix; i0 += HC_CHUNK) {
        double acc[HC_CHUNK], sq = 0.0;
#pragma unroll
        for (int i = 0; i < HC_CHUNK; i++)
            acc[i] = 0.0;
        for (uint32_t k = k_lo + threadIdx.x; k < k_hi; k += blockDim.x) {
            double x = (double)dev_bf16_to_f32(v[k]);
            sq += x * x;
#pragma unroll
            for (int i = 0; i < HC_CHUNK; i++)
                if (i0 + i < n_mix)
                    acc[i] += (double)p.fn[(size_t)(i0 + i) * width + k] * x;
        }
#pragma unroll
        for (int i = 0; i < HC_CHUNK; i++) {
            double s = warp_sum_d(acc[i]);
            if (lane == 0)
                part[warp][i] = s;
        }
        sq = warp_sum_d(sq);
        if (lane == 0)
            part[warp][HC_CHUNK] = sq;
        __syncthreads();
        if (threadIdx.x <= HC_CHUNK) {
            double s = 0.0;
            for (uint32_t w = 0; w < HC_WARPS; w++)
                s += part[w][threadIdx.x];
            if (threadIdx.x == HC_CHUNK) {
                if (i0 == 0)
                    out[n_mix] = s;
            } else if (i0 + threadIdx.x < n_mix) {
                out[i0 + threadIdx.x] = s;
            }
        }
        __syncthreads();
    }
}

/* Pass 1 at prefill sizes: block (group of HC_ROWS rows, split of HC_SPLIT_K inputs) stages
 * the split's fn columns once, HC_STAGE inputs at a time, as doubles in shared memory, with the
 * group's inputs; thread (mix i, quad q) sums fn[i] . v for the rows 4q .. 4q + 3 over the
 * split in input order (the 8 threads after them the rows' squares), so every fn value read
 * from memory serves HC_ROWS rows instead of one, and every one read from shared memory four.
 * Needs (n_mix + 1) * 8 <= CUDA_THREADS (hc <= 4). Writes part[row][split][n_mix + 1] as
 * hc_mixes_part_kernel does. */
#define HC_ROWS 32
#define HC_QUADS (HC_ROWS / 4)
#define HC_STAGE 64
#define HC_VROW (HC_ROWS + 2) /* doubles per staged input: its rows, padded so that the
                               * staging stores of consecutive inputs spread over the banks */
__global__ void __launch_bounds__(CUDA_THREADS) hc_mixes_rows_kernel(kern_hc_mixes p,
                                                                     uint32_t splits,
                                                                     double *part_out)
{
    extern __shared__ __align__(16) double hc_smem[];
    const uint32_t hc = p.n_copies, width = hc * p.dim, n_mix = (2 + hc) * hc;
    const uint32_t fr = n_mix + 1;                   /* fs row, padded as vs's */
    double *vs = hc_smem;                            /* [HC_STAGE][HC_VROW] */
    double *fs = hc_smem + (size_t)HC_STAGE * HC_VROW; /* [HC_STAGE][fr] */
    const uint32_t sp = blockIdx.x % splits, row0 = (blockIdx.x / splits) * HC_ROWS;
    const uint32_t k_lo = sp * HC_SPLIT_K;
    const uint32_t k_hi = width - k_lo > HC_SPLIT_K ? k_lo + HC_SPLIT_K : width;
    const uint32_t tid = threadIdx.x, rows = p.n_rows - row0 < HC_ROWS ? p.n_rows - row0 : HC_ROWS;
    const bool mix = tid < n_mix * HC_QUADS, square = !mix && tid < (n_mix + 1) * HC_QUADS;
    const uint32_t i = mix ? tid / HC_QUADS : n_mix, q = tid % HC_QUADS;
    double acc[4] = {0.0, 0.0, 0.0, 0.0};
    for (uint32_t k0 = k_lo; k0 < k_hi; k0 += HC_STAGE) {
        const uint32_t nk = k_hi - k0 < HC_STAGE ? k_hi - k0 : HC_STAGE;
        __syncthreads();
        for (uint32_t e = tid; e < nk * n_mix; e += blockDim.x) {
            uint32_t m = e / nk, k = e % nk; /* consecutive threads read consecutive inputs */
            fs[k * fr + m] = (double)p.fn[(size_t)m * width + k0 + k];
        }
        for (uint32_t e = tid; e < nk * HC_ROWS; e += blockDim.x) {
            uint32_t rr = e / nk, k = e % nk;
            vs[k * HC_VROW + rr] = rr < rows ? (double)dev_bf16_to_f32(
                                                   p.h[(size_t)(row0 + rr) * width + k0 + k])
                                             : 0.0;
        }
        __syncthreads();
        if (mix || square) {
            for (uint32_t k = 0; k < nk; k++) {
                const double2 v01 = *reinterpret_cast<const double2 *>(vs + k * HC_VROW + 4 * q);
                const double2 v23 = *reinterpret_cast<const double2 *>(vs + k * HC_VROW + 4 * q + 2);
                const double v[4] = {v01.x, v01.y, v23.x, v23.y};
                const double f = mix ? fs[k * fr + i] : 0.0;
#pragma unroll
                for (int j = 0; j < 4; j++)
                    acc[j] += (mix ? f : v[j]) * v[j];
            }
        }
    }
#pragma unroll
    for (int j = 0; j < 4; j++)
        if ((mix || square) && 4 * q + j < rows)
            part_out[((size_t)(row0 + 4 * q + j) * splits + sp) * (n_mix + 1) + i] = acc[j];
}

/* Pass 2: one block of HC_MAX * HC_MAX threads per row: the splits summed in order, then the
 * twin's roundings from there on (the Sinkhorn over the block, one thread per entry). */
__global__ void __launch_bounds__(HC_MAX * HC_MAX) hc_mixes_finish_kernel(kern_hc_mixes p,
                                                                         uint32_t splits,
                                                                         const double *part_in)
{
    __shared__ double tot[(2 + HC_MAX) * HC_MAX + 1];
    __shared__ double z[HC_MAX * HC_MAX];
    const uint32_t t = blockIdx.x;
    const uint32_t hc = p.n_copies, width = hc * p.dim, n_mix = (2 + hc) * hc;
    const double *in = part_in + (size_t)t * splits * (n_mix + 1);
    for (uint32_t i = threadIdx.x; i <= n_mix; i += blockDim.x) {
        double s = 0.0;
        for (uint32_t sp = 0; sp < splits; sp++)
            s += in[(size_t)sp * (n_mix + 1) + i];
        tot[i] = s;
    }
    __syncthreads();
    /* the twin's roundings: mean of squares to fp32, + eps in fp32, rsqrt in double to fp32 */
    float ms = (float)(tot[n_mix] / (double)width);
    float rs = (float)(1.0 / sqrt((double)__fadd_rn(ms, p.norm_eps)));
    const uint32_t c = threadIdx.x;
    if (c < hc) {
        float m_pre = __fmul_rn((float)tot[c], rs), m_post = __fmul_rn((float)tot[hc + c], rs);
        float zp = __fadd_rn(__fmul_rn(m_pre, p.scale[0]), p.base[c]);
        float zq = __fadd_rn(__fmul_rn(m_post, p.scale[1]), p.base[hc + c]);
        p.pre[(size_t)t * hc + c] = __fadd_rn((float)sigmoid_d((double)zp), (float)p.eps);
        p.post[(size_t)t * hc + c] = (float)(2.0 * sigmoid_d((double)zq));
    }
    if (c < hc * hc) {
        float m = __fmul_rn((float)tot[2 * hc + c], rs);
        z[c] = (double)__fadd_rn(__fmul_rn(m, p.scale[2]), p.base[2 * hc + c]);
    }
    __syncthreads();
    sinkhorn_dev(z, hc, p.sinkhorn_iters, p.eps);
    if (c < hc * hc)
        p.comb[(size_t)t * hc * hc + c] = (float)z[c];
}

/* One thread per (row, d): the copies summed in the twin's order, c = 0 first. */
__global__ void hc_collapse_kernel(kern_hc_collapse p)
{
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (size_t)p.n_rows * p.dim)
        return;
    size_t t = i / p.dim, d = i % p.dim;
    const float *pre = p.pre + t * p.pre_stride;
    const uint16_t *h = p.h + t * p.n_copies * p.dim + d;
    double acc = __dmul_rn((double)pre[0], (double)dev_bf16_to_f32(h[0]));
    for (uint32_t c = 1; c < p.n_copies; c++)
        acc = __dadd_rn(acc, __dmul_rn((double)pre[c], (double)dev_bf16_to_f32(h[(size_t)c * p.dim])));
    p.out[t * p.out_stride + d] = dev_f32_to_bf16((float)acc);
}

/* One thread per (row, d), all output copies j: s = sum_i comb[i][j] h_i in the twin's order,
 * then post_j * y + s. HCT > 0: the copy count compiled in (registers); 0: p.n_copies. */
template <int HCT>
__global__ void hc_expand_kernel(kern_hc_expand p)
{
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (size_t)p.n_rows * p.dim)
        return;
    const uint32_t hc = HCT > 0 ? (uint32_t)HCT : p.n_copies, D = p.dim;
    size_t t = i / D, d = i % D;
    const uint16_t *h = p.h + t * hc * D + d;
    const float *post = p.post + t * hc, *comb = p.comb + t * hc * hc;
    double hv[HCT > 0 ? HCT : HC_MAX];
#pragma unroll
    for (uint32_t c = 0; c < hc; c++)
        hv[c] = (double)dev_bf16_to_f32(h[(size_t)c * D]);
    double y = (double)dev_bf16_to_f32(p.y[t * D + d]);
    uint16_t *o = p.out + t * hc * D + d;
#pragma unroll
    for (uint32_t j = 0; j < hc; j++) {
        double s = __dmul_rn((double)comb[j], hv[0]);
#pragma unroll
        for (uint32_t c = 1; c < hc; c++)
            s = __dadd_rn(s, __dmul_rn((double)comb[c * hc + j], hv[c]));
        o[(size_t)j * D] = dev_f32_to_bf16((float)__dadd_rn(__dmul_rn((double)post[j], y), s));
    }
}

/* ---- launchers ---- */

static unsigned elem_blocks(size_t n)
{
    return (unsigned)((n + CUDA_THREADS - 1) / CUDA_THREADS);
}

/* Inputs of a row per first-pass block: HC_SPLIT_K while the rows alone leave the GPU short
 * of HC_BLOCKS_PER_SM blocks per SM (decode: few rows, many blocks per row), else the fewest
 * multiples of it that still give that many blocks, down to the whole row (prefill: a block
 * per row, each block's closing reduction paid once per row, not once per 1,024 inputs). The
 * double sums then come in another order per row count: their fp32 roundings differ only at
 * a double rounding tie, as against the twin. */
static uint32_t hc_split_k(cuda_ctx *c, uint32_t rows, uint32_t width)
{
    if (c->batch_invariant) /* one split for every row count: the same sums in the same order */
        return HC_SPLIT_K;
    const uint64_t want = (uint64_t)HC_BLOCKS_PER_SM *
                          cuda_device_attr(c, cudaDevAttrMultiProcessorCount, &c->sm_count, 132);
    const uint32_t most = (width + HC_SPLIT_K - 1) / HC_SPLIT_K; /* splits of HC_SPLIT_K */
    uint64_t splits = (want + rows - 1) / rows;
    if (splits >= most)
        return HC_SPLIT_K;
    if (splits < 1)
        splits = 1;
    const uint32_t units = (uint32_t)((most + splits - 1) / splits); /* HC_SPLIT_K per split */
    return units * HC_SPLIT_K;
}

/* Rows from which hc_mixes takes the rows kernel (below, the per-row kernel: decode sizes). */
#define HC_ROWS_MIN 96

/* The rows kernel: prefill sizes, copies few enough for its threads; not in batch-invariant
 * mode (its sums come in another order than the per-row kernel's, and a row's result must not
 * depend on the row count). */
static int hc_rows_kernel_fits(cuda_ctx *c, const kern_hc_mixes *p)
{
    const uint32_t n_mix = (2 + p->n_copies) * p->n_copies;
    return !c->batch_invariant && (n_mix + 1) * HC_QUADS <= CUDA_THREADS &&
           p->n_rows >= HC_ROWS_MIN;
}

static di_status launch_hc_mixes(cuda_ctx *c, const kern_hc_mixes *p, cudaStream_t stream)
{
    const uint32_t width = p->n_copies * p->dim, n_mix = (2 + p->n_copies) * p->n_copies;
    const int rows_kernel = hc_rows_kernel_fits(c, p);
    const uint32_t split_k = rows_kernel ? HC_SPLIT_K : hc_split_k(c, p->n_rows, width);
    const uint32_t splits = (width + split_k - 1) / split_k;
    const uint64_t blocks = (uint64_t)p->n_rows * splits;
    if (blocks > 0x7fffffffu)
        return cuda_fail(c, DI_EINVAL, "hc_mixes: %u rows x %u splits in one launch", p->n_rows,
                         splits);
    uint8_t *part = NULL;
    di_status st = cuda_scratch(c, (size_t)blocks * (n_mix + 1) * sizeof(double), &part);
    if (st != DI_OK)
        return st;
    if (rows_kernel) {
        const size_t smem = (size_t)HC_STAGE * (HC_VROW + n_mix + 1) * sizeof(double);
        const uint64_t groups = (p->n_rows + HC_ROWS - 1) / HC_ROWS;
        st = cuda_check(c, cudaFuncSetAttribute(hc_mixes_rows_kernel,
                                                cudaFuncAttributeMaxDynamicSharedMemorySize,
                                                (int)smem),
                        "hc_mixes: cudaFuncSetAttribute");
        if (st != DI_OK)
            return st;
        cuda_launch(c, "hc_mixes_rows_kernel", hc_mixes_rows_kernel, (unsigned)(groups * splits),
                    CUDA_THREADS, smem, stream, *p, splits, (double *)part);
        st = cuda_launched(c, "hc_mixes_rows_kernel");
    } else {
        cuda_launch(c, "hc_mixes_part_kernel", hc_mixes_part_kernel, (unsigned)blocks,
                    CUDA_THREADS, 0, stream, *p, splits, split_k, (double *)part);
        st = cuda_launched(c, "hc_mixes_part_kernel");
    }
    if (st != DI_OK)
        return st;
    cuda_launch(c, "hc_mixes_finish_kernel", hc_mixes_finish_kernel, p->n_rows, HC_MAX * HC_MAX, 0,
                stream, *p, splits, (const double *)part);
    return cuda_launched(c, "hc_mixes_finish_kernel");
}

static di_status launch_hc_collapse(cuda_ctx *c, const kern_hc_collapse *p, cudaStream_t stream)
{
    cuda_launch(c, "hc_collapse_kernel", hc_collapse_kernel,
                elem_blocks((size_t)p->n_rows * p->dim), CUDA_THREADS, 0, stream, *p);
    return cuda_launched(c, "hc_collapse_kernel");
}

static di_status launch_hc_expand(cuda_ctx *c, const kern_hc_expand *p, cudaStream_t stream)
{
    unsigned blocks = elem_blocks((size_t)p->n_rows * p->dim);
    if (p->n_copies == 4)
        cuda_launch(c, "hc_expand_kernel", hc_expand_kernel<4>, blocks, CUDA_THREADS, 0, stream,
                    *p);
    else
        cuda_launch(c, "hc_expand_kernel", hc_expand_kernel<0>, blocks, CUDA_THREADS, 0, stream,
                    *p);
    return cuda_launched(c, "hc_expand_kernel");
}

/* ---- table entries ---- */

/* Rows x dim elements must fit one launch of CUDA_THREADS-thread blocks. */
static di_status check_elems(cuda_ctx *c, const char *op, uint32_t rows, uint32_t dim)
{
    if ((size_t)rows * dim / CUDA_THREADS >= 0x7fffffffu)
        return cuda_fail(c, DI_EINVAL, "%s: %u rows x %u is too many for one launch", op, rows, dim);
    return DI_OK;
}

di_status cuda_op_hc_mixes(void *ctx, const kern_hc_mixes *p)
{
    cuda_ctx *c = (cuda_ctx *)ctx;
    di_status st = cuda_op_begin(c, p, "hc_mixes");
    if (st != DI_OK)
        return st;
    if (p->n_copies < 1 || p->n_copies > HC_MAX)
        return cuda_fail(c, DI_EINVAL, "hc_mixes: n_copies %u outside [1, %d]", p->n_copies, HC_MAX);
    if (p->sinkhorn_iters < 1)
        return cuda_fail(c, DI_EINVAL, "hc_mixes: sinkhorn_iters is 0");
    if (p->n_rows == 0)
        return DI_OK;
    if (p->dim == 0 || (uint64_t)p->n_copies * p->dim > 0x7fffffffu)
        return cuda_fail(c, DI_EINVAL, "hc_mixes: dim %u", p->dim);
    if (!p->h || !p->fn || !p->base || !p->scale || !p->pre || !p->post || !p->comb)
        return cuda_fail(c, DI_EINVAL, "hc_mixes: a tensor pointer is NULL");
    if (p->n_rows > 0x7fffffffu)
        return cuda_fail(c, DI_EINVAL, "hc_mixes: %u rows is too many for one launch", p->n_rows);
    return launch_hc_mixes(c, p, c->stream);
}

di_status cuda_op_hc_collapse(void *ctx, const kern_hc_collapse *p)
{
    cuda_ctx *c = (cuda_ctx *)ctx;
    di_status st = cuda_op_begin(c, p, "hc_collapse");
    if (st != DI_OK)
        return st;
    if (p->n_rows == 0 || p->dim == 0)
        return DI_OK;
    if (p->n_copies < 1)
        return cuda_fail(c, DI_EINVAL, "hc_collapse: n_copies is 0");
    if (!p->h || !p->pre || !p->out)
        return cuda_fail(c, DI_EINVAL, "hc_collapse: h, pre or out is NULL");
    if (p->out_stride < p->dim || (p->pre_stride && p->pre_stride < p->n_copies))
        return cuda_fail(c, DI_EINVAL, "hc_collapse: out_stride %zu below dim %u or pre_stride "
                         "%zu below n_copies %u", p->out_stride, p->dim, p->pre_stride, p->n_copies);
    if ((st = check_elems(c, "hc_collapse", p->n_rows, p->dim)) != DI_OK)
        return st;
    return launch_hc_collapse(c, p, c->stream);
}

di_status cuda_op_hc_expand(void *ctx, const kern_hc_expand *p)
{
    cuda_ctx *c = (cuda_ctx *)ctx;
    di_status st = cuda_op_begin(c, p, "hc_expand");
    if (st != DI_OK)
        return st;
    if (p->n_rows == 0 || p->dim == 0)
        return DI_OK;
    if (p->n_copies < 1 || p->n_copies > HC_MAX)
        return cuda_fail(c, DI_EINVAL, "hc_expand: n_copies %u outside [1, %d]", p->n_copies, HC_MAX);
    if (!p->y || !p->h || !p->post || !p->comb || !p->out)
        return cuda_fail(c, DI_EINVAL, "hc_expand: a tensor pointer is NULL");
    if (p->out == p->h)
        return cuda_fail(c, DI_EINVAL, "hc_expand: out must not alias h");
    if ((st = check_elems(c, "hc_expand", p->n_rows, p->dim)) != DI_OK)
        return st;
    return launch_hc_expand(c, p, c->stream);
}
