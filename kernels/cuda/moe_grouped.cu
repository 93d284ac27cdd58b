/* moe_grouped.cu: the routed experts of moe_experts for decode-sized batches (the grouped
 * path; moe.cu picks it, builds the groups and runs the shared expert and the combine).
 *
 * The (row, slot) pairs are bucketed by expert (moe.cu, the twin's order); a group is one
 * expert's bucket, or a piece of CUDA_MOE_GROUP_ROWS rows of a larger one. Two launches cover
 * every group:
 *  - up: block (group, tile of 8 x warp_rows outputs of W1 and W3; warp_rows is 8, or fewer
 *    when the launch would have under 4 blocks per SM). The group's input rows (x quantised
 *    by (A) beforehand, exact in bf16) are staged in shared memory; each warp takes warp_rows
 *    output rows j in turn, and for each its lanes stride over the inputs 8 at a time: 4 bytes of
 *    packed E2M1 of W1 and of W3 and their UE8M0 scale straight from the checkpoint layout,
 *    dequantised in registers (code * scale in fp32, the twin's exact values), multiplied with
 *    every row of the group (one 16-byte shared load per row: consecutive lanes read
 *    consecutive 16 bytes, no bank conflict), fp32 accumulators per row. A butterfly sums the
 *    lanes; lane r rounds g and u of row r to bf16 as the twin's linear does, applies SwiGLU
 *    with the clamp and the routing weight (dev_swiglu, the twin's double expressions) and
 *    stores h. Each weight byte is read once per group: the group's rows reuse it from
 *    registers.
 *  - h is quantised by (A) in place (cuda_fakequant_rows, as the twin before W2);
 *  - down: the same tiling over W2 with the group's h rows, storing og = bf16(fp32 sum).
 * The shared expert of a call of at most 16 rows runs the same kernels as one group (FP8:
 * 8 bytes of E4M3 per lane and step, the scale of the row's 32-row block; rows straight from
 * x, no routing weight).
 * Rows past the group's count are skipped by warp-uniform branches; output rows past the
 * width end the warp's loop (the width need not be a multiple of the tile); the inputs of a
 * lane's step lie inside the row because widths are multiples of 32.
 *
 * What is exact: the weights, the quantised inputs, SwiGLU given g and u, the bf16 roundings.
 * What differs: the fp32 sums run in another order than the twin's double sums, so g, u and
 * og can differ by an ulp of bf16, and an h moved by one FP8 step before W2 (kernels.h's
 * moe_experts tolerance covers it).
 *
 * Cost: the weights of the used experts once (plus the group's rows from L2 per block); the
 * work per weight is one dequantisation and one FMA per row, so a group of many rows is
 * compute-bound on the CUDA cores, which is why the path is for small groups only.
 */
#include <cuda_runtime.h>
#include <stdint.h>

#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/cuda_internal.h"
#include "kernels/cuda/moe_dev.cuh"
#include "kernels/cuda/numfmt_dev.cuh"

#define GRP_WARPS 8                              /* warps per block */
#define GRP_WARP_ROWS 8                          /* output rows per warp, at most */
#define GRP_STEP 256                             /* inputs a warp covers per step (8 a lane) */
#define GRP_DEFAULT_SMEM (48 * 1024)             /* dynamic shared memory without opting in */
#define GRP_BLOCKS_PER_SM 4                      /* fewer output rows per warp (more blocks)
                                                  * until a launch has this many blocks per
                                                  * SM, to keep enough loads in flight */

/* ---- device helpers ---- */

/* 4 bytes of packed E2M1 (8 values) at p: one load when aligned, else byte by byte */
__device__ __forceinline__ uint32_t load_w4(const uint8_t *p, bool aligned)
{
    if (aligned)
        return __ldg(reinterpret_cast<const unsigned int *>(p));
    return (uint32_t)__ldg(p) | (uint32_t)__ldg(p + 1) << 8 | (uint32_t)__ldg(p + 2) << 16 |
           (uint32_t)__ldg(p + 3) << 24;
}

/* The 8 weights of a 4-byte word (value i in nibble i: element 2j in the low nibble of byte
 * j) times the block scale s. A code's magnitude bits placed at bit 22 of an fp32 make its
 * value times 2^-126 (code 1 the subnormal 2^-127), so one exact multiply by 2^126 gives the
 * E2M1 value, the sign bit moved to bit 31; then the twin's fp32 product with the scale. */
__device__ __forceinline__ void dequant8(uint32_t w, float s, float (&v)[8])
{
#pragma unroll
    for (int i = 0; i < 8; i++) {
        uint32_t bits = ((w >> (4 * i + 3)) & 1u) << 31 | ((w >> (4 * i)) & 7u) << 22;
        v[i] = __uint_as_float(bits) * 0x1p126f * s;
    }
}

/* 8 bytes of E4M3 (8 values) at p: one load when aligned, else byte by byte */
__device__ __forceinline__ uint2 load_w8(const uint8_t *p, bool aligned)
{
    if (aligned)
        return __ldg(reinterpret_cast<const uint2 *>(p));
    return make_uint2(load_w4(p, false), load_w4(p + 4, false));
}

/* The 8 weights of 8 E4M3 codes times the block scale s (the twin's fp32 products). */
__device__ __forceinline__ void dequant8_fp8(uint2 q, float s, float (&v)[8])
{
#pragma unroll
    for (int i = 0; i < 8; i++)
        v[i] = dev_e4m3_decode((uint8_t)(((i < 4 ? q.x : q.y) >> (8 * (i & 3))) & 0xffu)) * s;
}

/* The 8 weights of one lane's step at inputs [k0, k0 + 8) of a weight row: FP4 rows are
 * packed E2M1 (k/2 bytes) with a UE8M0 scale per 32 inputs (row scale pointer rs); FP8 rows
 * are E4M3 (k bytes) with the scale row of their 32-row block (rs). */
template <bool FP8>
__device__ __forceinline__ void load_step(const uint8_t *row, const uint8_t *rs, uint32_t k0,
                                          bool aligned, float (&v)[8])
{
    float s = dev_ue8m0_decode(__ldg(rs + k0 / 32));
    if (FP8)
        dequant8_fp8(load_w8(row + k0, aligned), s, v);
    else
        dequant8(load_w4(row + k0 / 2, aligned), s, v);
}

__device__ __forceinline__ float warp_sum(float v)
{
#pragma unroll
    for (int off = 16; off > 0; off /= 2)
        v += __shfl_xor_sync(0xffffffffu, v, off);
    return v;
}

/* acc[r] += w . x_r over the 8 inputs of this step, for the first n rows staged at xs + k0
 * (row stride K); n is the same for the whole warp. */
template <int R>
__device__ __forceinline__ void rows_fma(const uint16_t *xs, uint32_t K, uint32_t k0, uint32_t n,
                                         const float (&w)[8], float (&acc)[R])
{
#pragma unroll
    for (int r = 0; r < R; r++) {
        if ((uint32_t)r >= n)
            break;
        uint4 q = *reinterpret_cast<const uint4 *>(xs + (size_t)r * K + k0);
        uint32_t h[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
        for (int i = 0; i < 4; i++) {
            acc[r] = fmaf(w[2 * i], __uint_as_float(h[i] << 16), acc[r]);
            acc[r] = fmaf(w[2 * i + 1], __uint_as_float(h[i] & 0xffff0000u), acc[r]);
        }
    }
}

/* ---- the kernel: UP = W1 and W3 with SwiGLU, else W2; R >= every group's n; FP8: E4M3
 * weights with 32x32 scales (the shared expert), else packed E2M1 with 1x32 scales ---- */

template <int R, bool UP, bool FP8>
__global__ void __launch_bounds__(GRP_WARPS * 32) moe_grouped_kernel(cuda_moe_grouped a,
                                                                     uint32_t warp_rows)
{
    extern __shared__ __align__(16) uint16_t grp_xs[]; /* [n, K] the group's input rows */
    const uint32_t K = UP ? a.dim : a.inter, N = UP ? a.inter : a.dim;
    const uint32_t tile_rows = GRP_WARPS * warp_rows, tiles = (N + tile_rows - 1) / tile_rows;
    if (a.n_groups_dev && blockIdx.x / tiles >= *a.n_groups_dev)
        return; /* past the groups the device bucketing wrote */
    const cuda_moe_group gr = a.groups[blockIdx.x / tiles];
    const uint32_t tile = blockIdx.x % tiles, n = gr.n;
    const uint32_t vecs = K / 8; /* 16-byte pieces of a row */
    for (uint32_t i = threadIdx.x; i < n * vecs; i += blockDim.x) {
        uint32_t r = i / vecs, v = i % vecs;
        size_t xrow = a.pair ? (size_t)(a.pair[gr.start + r] / (int32_t)a.top_k)
                             : (size_t)gr.start + r;
        const uint16_t *src = UP ? a.xq + xrow * K : a.h + (size_t)(gr.start + r) * K;
        reinterpret_cast<uint4 *>(grp_xs + (size_t)r * K)[v] =
            reinterpret_cast<const uint4 *>(src)[v];
    }
    __syncthreads();
    const uint32_t warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const uint8_t *wa = UP ? gr.w1 : gr.w2, *sa = UP ? gr.s1 : gr.s2;
    const bool aligned = a.aligned != 0;
    for (uint32_t q = 0; q < warp_rows; q++) {
        const uint32_t j = tile * tile_rows + warp * warp_rows + q;
        if (j >= N) /* the same j on every lane */
            break;
        float acc_a[R], acc_b[R];
#pragma unroll
        for (int r = 0; r < R; r++)
            acc_a[r] = 0.0f, acc_b[r] = 0.0f;
        const size_t w_off = FP8 ? (size_t)j * K : (size_t)j * (K / 2);
        const size_t s_off = FP8 ? (size_t)(j / 32) * (K / 32) : (size_t)j * (K / 32);
        const uint8_t *ra = wa + w_off, *rsa = sa + s_off;
        const uint8_t *rb = UP ? gr.w3 + w_off : NULL, *rsb = UP ? gr.s3 + s_off : NULL;
#pragma unroll 2
        for (uint32_t k0 = lane * 8; k0 < K; k0 += GRP_STEP) {
            float w[8];
            load_step<FP8>(ra, rsa, k0, aligned, w);
            rows_fma<R>(grp_xs, K, k0, n, w, acc_a);
            if (UP) {
                load_step<FP8>(rb, rsb, k0, aligned, w);
                rows_fma<R>(grp_xs, K, k0, n, w, acc_b);
            }
        }
#pragma unroll
        for (int r = 0; r < R; r++) {
            if ((uint32_t)r >= n)
                break;
            acc_a[r] = warp_sum(acc_a[r]);
            if (UP)
                acc_b[r] = warp_sum(acc_b[r]);
        }
#pragma unroll
        for (int r = 0; r < R; r++) {
            if ((uint32_t)r >= n || lane != (uint32_t)r)
                continue;
            const size_t row = (size_t)gr.start + r;
            if (UP) {
                float g = dev_bf16_to_f32(dev_f32_to_bf16(acc_a[r]));
                float u = dev_bf16_to_f32(dev_f32_to_bf16(acc_b[r]));
                a.h[row * N + j] = dev_swiglu(g, u, a.limit, a.pair != NULL,
                                              a.pair ? a.weights[a.pair[row]] : 1.0f);
            } else {
                a.og[row * N + j] = dev_f32_to_bf16(acc_a[r]);
            }
        }
    }
}

/* ---- launchers ---- */

static size_t smem_bytes(uint32_t rows, uint32_t width)
{
    return (size_t)rows * width * sizeof(uint16_t);
}

static int smem_limit(cuda_ctx *c)
{
    return cuda_device_attr(c, cudaDevAttrMaxSharedMemoryPerBlockOptin, &c->smem_optin,
                       GRP_DEFAULT_SMEM);
}

/* Output rows per warp: GRP_WARP_ROWS, halved while the launch would have fewer than
 * GRP_BLOCKS_PER_SM blocks per SM (a step of one or a few rows has few groups). */
static uint32_t warp_rows_for(cuda_ctx *c, uint32_t n_groups, uint32_t outputs)
{
    uint64_t want = (uint64_t)GRP_BLOCKS_PER_SM *
                    cuda_device_attr(c, cudaDevAttrMultiProcessorCount, &c->sm_count, 132);
    uint32_t wr = GRP_WARP_ROWS;
    while (wr > 1 &&
           (uint64_t)n_groups * ((outputs + GRP_WARPS * wr - 1) / (GRP_WARPS * wr)) < want)
        wr /= 2;
    return wr;
}

int cuda_moe_grouped_fits(cuda_ctx *c, uint32_t rows, uint32_t dim, uint32_t inter)
{
    size_t need = smem_bytes(rows, dim > inter ? dim : inter);
    return need <= (size_t)smem_limit(c);
}

template <int R, bool UP, bool FP8>
static di_status launch_one(cuda_ctx *c, const cuda_moe_grouped *g)
{
    const uint32_t N = UP ? g->inter : g->dim, K = UP ? g->dim : g->inter;
    const uint32_t wr = warp_rows_for(c, g->n_groups, N), tile_rows = GRP_WARPS * wr;
    const uint64_t blocks = (uint64_t)g->n_groups * ((N + tile_rows - 1) / tile_rows);
    const char *name = UP ? "moe_grouped_kernel<up>" : "moe_grouped_kernel<down>";
    if (blocks > 0x7fffffffu)
        return cuda_fail(c, DI_EINVAL, "%s: %u groups x %u outputs in one launch", name,
                         g->n_groups, N);
    size_t smem = smem_bytes(g->max_rows, K);
    if (smem > GRP_DEFAULT_SMEM) {
        const void *fn = (const void *)moe_grouped_kernel<R, UP, FP8>;
        cudaError_t e = cudaFuncSetAttribute(fn, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                             (int)smem);
        di_status st = cuda_check(c, e, "cudaFuncSetAttribute(moe_grouped_kernel)");
        if (st != DI_OK)
            return st;
    }
    cuda_launch(c, "moe_grouped_kernel", moe_grouped_kernel<R, UP, FP8>, (unsigned)blocks,
                GRP_WARPS * 32, smem, c->stream, *g, wr);
    return cuda_launched(c, name);
}

/* The smallest instantiated row count that holds max_rows. */
template <bool UP, bool FP8>
static di_status launch_rows(cuda_ctx *c, const cuda_moe_grouped *g)
{
    if (g->max_rows <= 1)
        return launch_one<1, UP, FP8>(c, g);
    if (g->max_rows <= 2)
        return launch_one<2, UP, FP8>(c, g);
    if (g->max_rows <= 4)
        return launch_one<4, UP, FP8>(c, g);
    if (g->max_rows <= 8)
        return launch_one<8, UP, FP8>(c, g);
    return launch_one<16, UP, FP8>(c, g);
}

template <bool UP>
static di_status launch_fmt(cuda_ctx *c, const cuda_moe_grouped *g)
{
    return g->fp8 ? launch_rows<UP, true>(c, g) : launch_rows<UP, false>(c, g);
}

di_status cuda_moe_grouped_run(cuda_ctx *c, const cuda_moe_grouped *g)
{
    static_assert(CUDA_MOE_GROUP_ROWS <= 16, "launch_rows instantiates up to 16 rows");
    if (g->n_groups == 0)
        return DI_OK;
    if (g->max_rows < 1 || g->max_rows > CUDA_MOE_GROUP_ROWS || g->dim % 32 || g->inter % 32)
        return cuda_fail(c, DI_EINVAL, "moe grouped: %u rows per group, dim %u, inter %u",
                         g->max_rows, g->dim, g->inter);
    if (!cuda_moe_grouped_fits(c, g->max_rows, g->dim, g->inter))
        return cuda_fail(c, DI_EINVAL, "moe grouped: %u rows of %u inputs exceed the shared "
                         "memory of a block", g->max_rows, g->dim > g->inter ? g->dim : g->inter);
    if (!c->moe_cuda_cores)
        return cuda_moe_mma_run(c, g);
    di_status st = launch_fmt<true>(c, g);
    if (st == DI_OK)
        st = cuda_fakequant_rows(c, KERN_Q_FP8_B32, g->h, g->inter, g->h, g->inter, g->n_pairs,
                                 g->inter);
    if (st == DI_OK)
        st = launch_fmt<false>(c, g);
    return st;
}
