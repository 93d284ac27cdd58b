/* moe_mma.cu: the grouped path of moe_experts on the tensor cores (mma.sync, FP16 operands, fp32
 * accumulation). cuda_moe_grouped_run (moe_grouped.cu) calls it unless
 * kern_cuda_config.moe_cuda_cores is set.
 *
 * Numbers: x quantised by (A) is code_x * s_x (E4M3, a power of two per 32 inputs); a routed
 * weight is code_w * s_w (E2M1, a power of two per 32 inputs of its row), the shared expert's
 * code_w * s_w (E4M3, a power of two per 32x32 block). Every E2M1 value is an E4M3 value times
 * 2^6 (its magnitude bits moved to bits 2-4, the sign to bit 7: 0.5 becomes the subnormal 2^-7),
 * and every E4M3 value is an FP16 value (cvt.rn.f16x2.e4m3x2, sm_89 and up, exact). So for each
 * 32-input block b two m16n8k16 FP16 mma give sum code_x * code_w with exact products and fp32
 * accumulation, and the fp32 accumulators take D_b * (s_w * 2^6 * s_x): the scales stay out of
 * the tensor core. (An E4M3 mma, m16n8k32, would skip the conversion, but the tensor core's
 * reduced-precision FP8 accumulation moved outputs by up to 1.05x the op's tolerance.)
 *
 * Work: a block takes one group (one expert's rows, at most 16) and 32 outputs (two m16 tiles);
 * its 8 warps split the inputs (split-k: warp w takes a contiguous run of 32-input blocks) and
 * sum their accumulators through shared memory in a fixed order (the same order whatever the
 * rows: batch invariant). The group's rows are the mma's n (8 or 16). Each lane reads 4 bytes
 * of packed E2M1 (FP8: 8 bytes of E4M3) of two weight rows per block, several blocks in
 * flight; x's codes come from a pre-pass (mma_codes_kernel) as FP16 in the order the A
 * fragments take them: within every 8 inputs 0, 2, 1, 3, 4, 6, 5, 7, which is how the low and
 * high nibbles of a 4-byte E2M1 word fall into the A registers without a permute.
 *
 * What is exact: weights, quantised inputs (x's codes are (A) applied again to the (A)-quantised
 * x: the same values), each product; SwiGLU and the bf16 roundings as the CUDA-core kernel does
 * them. What differs from the twin: the sum order (fp32), within the moe_experts tolerance.
 */
#include <cooperative_groups.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/cuda_internal.h"
#include "kernels/cuda/moe_dev.cuh"
#include "kernels/cuda/mma_dev.cuh"
#include "kernels/cuda/numfmt_dev.cuh"

namespace cg = cooperative_groups;

#define MMA_WARPS 8  /* warps per block, splitting the inputs */
#define MMA_TILE 32  /* outputs per block: two m16 tiles */
#define MMA_MT 2     /* m16 tiles per warp */

/* ---- the codes pre-pass: (A) of bf16 rows into E4M3 codes as FP16 (within each 8 inputs
 * in the order 0, 2, 1, 3, 4, 6, 5, 7) and one fp32 scale per 32 (infinite when the block holds an
 * infinity, so that the products stay infinite as the twin's dequantised sums are) ---- */

__global__ void mma_codes_kernel(const uint16_t *src, size_t ld, uint32_t n_rows, uint32_t K,
                                 __half *codes, float *scales)
{
    size_t t = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    const uint32_t quads = K / 4;
    bool valid = t < (size_t)n_rows * quads;
    size_t row = valid ? t / quads : 0;
    uint32_t col = valid ? (uint32_t)(t % quads) * 4 : 0;
    float v[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    if (valid)
        for (int i = 0; i < 4; i++)
            v[i] = dev_bf16_to_f32(src[row * ld + col + i]);
    float amax = fmaxf(fmaxf(fabsf(v[0]), fabsf(v[1])), fmaxf(fabsf(v[2]), fabsf(v[3])));
    amax = dev_group_max(amax, QUANT4_GROUP(NUMFMT_FP8_B32)); /* every lane takes part */
    uint8_t code[4], se;
    float deq[4];
    quant4<NUMFMT_FP8_B32>(v, amax, code, deq, se);
    if (!valid)
        return;
    /* inputs 0-3 (4-7) of an 8 go to places 0, 2, 1, 3 (4, 6, 5, 7) */
    __half *o = codes + row * K + col;
    o[0] = __float2half_rn(dev_e4m3_decode(code[0]));
    o[2] = __float2half_rn(dev_e4m3_decode(code[1]));
    o[1] = __float2half_rn(dev_e4m3_decode(code[2]));
    o[3] = __float2half_rn(dev_e4m3_decode(code[3]));
    if (col % 32 == 0)
        scales[row * (K / 32) + col / 32] = isinf(amax) ? INFINITY : dev_ue8m0_decode(se);
}

static di_status launch_codes(cuda_ctx *c, const uint16_t *src, size_t ld, uint32_t rows,
                              uint32_t K, void *codes, float *scales)
{
    size_t threads = (size_t)rows * (K / 4), blocks = (threads + CUDA_THREADS - 1) / CUDA_THREADS;
    if (blocks == 0)
        return DI_OK;
    if (blocks > 0x7fffffffu)
        return cuda_fail(c, DI_EINVAL, "moe mma: %u rows of %u to quantise", rows, K);
    cuda_launch(c, "mma_codes_kernel", mma_codes_kernel, (unsigned)blocks, CUDA_THREADS, 0,
                c->stream, src, ld, rows, K, (__half *)codes, scales);
    return cuda_launched(c, "mma_codes_kernel");
}

/* ---- device helpers ---- */

/* 4 bytes at p: one load when aligned, else byte by byte */
__device__ __forceinline__ uint32_t mma_ld4(const uint8_t *p, bool aligned)
{
    if (aligned)
        return __ldg(reinterpret_cast<const unsigned int *>(p));
    return (uint32_t)__ldg(p) | (uint32_t)__ldg(p + 1) << 8 | (uint32_t)__ldg(p + 2) << 16 |
           (uint32_t)__ldg(p + 3) << 24;
}

/* The E4M3 codes of E2M1 values times 2^-6: the low nibbles of w's bytes (even inputs) and the
 * high ones (odd inputs), byte j from byte j of w. */
__device__ __forceinline__ uint32_t e2m1_lo(uint32_t w)
{
    return ((w & 0x07070707u) << 2) | ((w & 0x08080808u) << 4);
}

__device__ __forceinline__ uint32_t e2m1_hi(uint32_t w)
{
    return ((w >> 2) & 0x1c1c1c1cu) | (w & 0x80808080u);
}

/* Two E4M3 codes (a 16-bit half of r: hi selects the upper) as an FP16 pair, exact */
__device__ __forceinline__ uint32_t e4m3x2_f16(uint32_t r, bool hi)
{
    uint32_t d;
    uint16_t h = (uint16_t)(hi ? r >> 16 : r & 0xffffu);
    asm("cvt.rn.f16x2.e4m3x2 %0, %1;\n" : "=r"(d) : "h"(h));
    return d;
}

/* d += A (16 x 16, FP16) B (16 x 8, FP16), fp32 */
__device__ __forceinline__ void mma_f16(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2,
                                        uint32_t a3, uint32_t b0, uint32_t b1)
{
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

/* One weight row's share of a 32-input block for this lane (inputs 8t..8t+7 of the block):
 * the two A registers (even inputs, odd inputs) and the row's scale (times 2^6 for E2M1). */
template <bool FP8>
__device__ __forceinline__ void mma_wrow(const uint8_t *w, const uint8_t *s, uint32_t j,
                                         uint32_t K, uint32_t b, uint32_t t, bool aligned,
                                         uint32_t &lo, uint32_t &hi, float &sc)
{
    if (FP8) {
        const uint8_t *p = w + (size_t)j * K + b * 32 + 8 * t;
        uint32_t x = mma_ld4(p, aligned), y = mma_ld4(p + 4, aligned);
        lo = __byte_perm(x, y, 0x6420), hi = __byte_perm(x, y, 0x7531);
        sc = dev_ue8m0_decode(__ldg(s + (size_t)(j / 32) * (K / 32) + b));
    } else {
        uint32_t x = mma_ld4(w + (size_t)j * (K / 2) + b * 16 + 4 * t, aligned);
        lo = e2m1_lo(x), hi = e2m1_hi(x);
        sc = dev_ue8m0_decode(__ldg(s + (size_t)j * (K / 32) + b)) * 64.0f;
    }
}

/* The mmas of one 32-input block for one m16 tile: lo0/hi0 and lo1/hi1 are rows g and g + 8
 * (E4M3 codes, even and odd inputs), sw0/sw1 their scales; ac the tile's NT * 4 accumulators. */
template <int NT>
__device__ __forceinline__ void mma_tile(uint32_t lo0, uint32_t hi0, uint32_t lo1, uint32_t hi1,
                                         float sw0, float sw1, const uint4 (&bx)[NT],
                                         const float (&sx)[NT][2], float *ac)
{
    /* FP16 pairs of inputs (0, 2), (1, 3), (4, 6), (5, 7) of rows g and g + 8 */
    const uint32_t p0[4] = {e4m3x2_f16(lo0, false), e4m3x2_f16(hi0, false),
                            e4m3x2_f16(lo0, true), e4m3x2_f16(hi0, true)};
    const uint32_t p1[4] = {e4m3x2_f16(lo1, false), e4m3x2_f16(hi1, false),
                            e4m3x2_f16(lo1, true), e4m3x2_f16(hi1, true)};
#pragma unroll
    for (int nt = 0; nt < NT; nt++) {
        float d[4] = {0.0f, 0.0f, 0.0f, 0.0f};
        mma_f16(d, p0[0], p1[0], p0[1], p1[1], bx[nt].x, bx[nt].y);
        mma_f16(d, p0[2], p1[2], p0[3], p1[3], bx[nt].z, bx[nt].w);
        float *a = ac + nt * 4;
        a[0] = fmaf(d[0], sw0 * sx[nt][0], a[0]);
        a[1] = fmaf(d[1], sw0 * sx[nt][1], a[1]);
        a[2] = fmaf(d[2], sw1 * sx[nt][0], a[2]);
        a[3] = fmaf(d[3], sw1 * sx[nt][1], a[3]);
    }
}

/* x's (or h's) codes and scales of block b for this lane's B column and D columns */
template <int NT>
__device__ __forceinline__ void mma_xblock(const __half *codes, const float *scales,
                                           const uint32_t (&rcol)[NT][3], uint32_t K,
                                           uint32_t nb, uint32_t b, uint32_t t, uint4 (&bx)[NT],
                                           float (&sx)[NT][2])
{
#pragma unroll
    for (int nt = 0; nt < NT; nt++) {
        bx[nt] = make_uint4(0u, 0u, 0u, 0u);
        if (rcol[nt][2] != ~0u)
            bx[nt] = *reinterpret_cast<const uint4 *>(codes + (size_t)rcol[nt][2] * K + b * 32 +
                                                      8 * t);
#pragma unroll
        for (int h = 0; h < 2; h++)
            sx[nt][h] = rcol[nt][h] != ~0u ? scales[(size_t)rcol[nt][h] * nb + b] : 0.0f;
    }
}

/* The rows of this lane's B column (group row g of each n tile) and of its two D columns;
 * ~0u past the group */
template <int NT, bool UP>
__device__ __forceinline__ void mma_rcols(const cuda_moe_grouped &a, const cuda_moe_group &gr,
                                          uint32_t g, uint32_t t, uint32_t (&rcol)[NT][3])
{
#pragma unroll
    for (int nt = 0; nt < NT; nt++) {
#pragma unroll
        for (int h = 0; h < 3; h++) {
            uint32_t r = h == 2 ? nt * 8 + g : nt * 8 + 2 * t + h;
            rcol[nt][h] = r >= gr.n ? ~0u
                                    : (!UP || !a.pair ? gr.start + r
                                                      : (uint32_t)a.pair[gr.start + r] / a.top_k);
        }
    }
}

/* The weight rows of this lane: tile mt, rows g and g + 8 (clamped inside the matrix) */
__device__ __forceinline__ void mma_jrows(uint32_t j0, uint32_t N, uint32_t g,
                                          uint32_t (&jr)[MMA_MT][2])
{
#pragma unroll
    for (int mt = 0; mt < MMA_MT; mt++)
#pragma unroll
        for (int h = 0; h < 2; h++) {
            uint32_t j = j0 + mt * 16 + g + 8 * h;
            jr[mt][h] = j < N ? j : N - 1;
        }
}

/* The epilogue of output (i, l) of the accumulators given its sums: SwiGLU (UP) or bf16 */
template <int NT, bool UP>
__device__ __forceinline__ void mma_store(const cuda_moe_grouped &a, const cuda_moe_group &gr,
                                          uint32_t j0, uint32_t N, uint32_t e, float sa, float sb)
{
    const uint32_t i = e / 32, l = e % 32, q = i % 4, mt = i / 4 / NT, nt = i / 4 % NT;
    const uint32_t j = j0 + mt * 16 + l / 4 + (q / 2) * 8, r = nt * 8 + 2 * (l % 4) + q % 2;
    if (j >= N || r >= gr.n)
        return;
    const size_t row = (size_t)gr.start + r;
    if (UP) {
        float gv = dev_bf16_to_f32(dev_f32_to_bf16(sa));
        float uv = dev_bf16_to_f32(dev_f32_to_bf16(sb));
        a.h[row * N + j] = dev_swiglu(gv, uv, a.limit, a.pair != NULL,
                                      a.pair ? a.weights[a.pair[row]] : 1.0f);
    } else {
        a.og[row * (a.og_ld ? a.og_ld : N) + j] = dev_f32_to_bf16(sa);
    }
}

/* The warps' accumulators (red[warp][i][lane], ACC of them) summed in warp order, then SwiGLU
 * (UP) or the bf16 store; every thread of the block calls it after a __syncthreads. */
template <int NT, bool UP>
__device__ __forceinline__ void mma_finish(const cuda_moe_grouped &a, const cuda_moe_group &gr,
                                           uint32_t j0, uint32_t N, const float *red)
{
    constexpr int MATS = UP ? 2 : 1, PER = MMA_MT * NT * 4, ACC = MATS * PER;
    /* element (i, l) of every warp's accumulators: e = i * 32 + l */
    for (uint32_t e = threadIdx.x; e < (uint32_t)PER * 32; e += blockDim.x) {
        float sa = 0.0f, sb = 0.0f;
        for (int w = 0; w < MMA_WARPS; w++) {
            sa += red[(size_t)w * ACC * 32 + e];
            if (UP)
                sb += red[(size_t)w * ACC * 32 + PER * 32 + e];
        }
        mma_store<NT, UP>(a, gr, j0, N, e, sa, sb);
    }
}

/* ---- the kernel: UP = W1 and W3 with SwiGLU, else W2; NT n8 tiles of group rows ---- */

template <int NT, bool UP, bool FP8>
__global__ void __launch_bounds__(MMA_WARPS * 32, 2) moe_mma_kernel(cuda_moe_grouped a)
{
    constexpr int MATS = UP ? 2 : 1, PER = MMA_MT * NT * 4, ACC = MATS * PER;
    __shared__ float red[MMA_WARPS][ACC][32];
    const uint32_t K = UP ? a.dim : a.inter, N = UP ? a.inter : a.dim, nb = K / 32;
    const uint32_t tiles = (N + MMA_TILE - 1) / MMA_TILE;
    if (a.n_groups_dev && blockIdx.x / tiles >= *a.n_groups_dev)
        return; /* past the groups the device bucketing wrote */
    const cuda_moe_group gr = a.groups ? a.groups[blockIdx.x / tiles] : a.one;
    const uint32_t j0 = (blockIdx.x % tiles) * MMA_TILE;
    const uint32_t warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
    const bool aligned = a.aligned != 0;
    const __half *codes = (const __half *)(UP ? a.xc : a.hc);
    const float *scales = UP ? a.xcs : a.hcs;
    uint32_t rcol[NT][3];
    mma_rcols<NT, UP>(a, gr, g, t, rcol);
    uint32_t jr[MMA_MT][2];
    mma_jrows(j0, N, g, jr);
    float acc[ACC];
#pragma unroll
    for (int i = 0; i < ACC; i++)
        acc[i] = 0.0f;
    const uint32_t per = (nb + MMA_WARPS - 1) / MMA_WARPS;
    const uint32_t b_lo = warp * per < nb ? warp * per : nb;
    const uint32_t b_hi = b_lo + per < nb ? b_lo + per : nb;
#pragma unroll(NT == 1 && !FP8 ? 4 : 2)
    for (uint32_t b = b_lo; b < b_hi; b++) {
        uint4 bx[NT];
        float sx[NT][2];
        mma_xblock<NT>(codes, scales, rcol, K, nb, b, t, bx, sx);
#pragma unroll
        for (int m = 0; m < MATS; m++) {
            const uint8_t *w = m == 0 ? (UP ? gr.w1 : gr.w2) : gr.w3;
            const uint8_t *s = m == 0 ? (UP ? gr.s1 : gr.s2) : gr.s3;
#pragma unroll
            for (int mt = 0; mt < MMA_MT; mt++) {
                uint32_t lo0, hi0, lo1, hi1;
                float sw0, sw1;
                mma_wrow<FP8>(w, s, jr[mt][0], K, b, t, aligned, lo0, hi0, sw0);
                mma_wrow<FP8>(w, s, jr[mt][1], K, b, t, aligned, lo1, hi1, sw1);
                mma_tile<NT>(lo0, hi0, lo1, hi1, sw0, sw1, bx, sx, acc + m * PER + mt * NT * 4);
            }
        }
    }
#pragma unroll
    for (int i = 0; i < ACC; i++)
        red[warp][i][lane] = acc[i];
    __syncthreads();
    mma_finish<NT, UP>(a, gr, j0, N, &red[0][0][0]);
}

/* ---- the staged kernel: the same products, the weights streamed through shared memory
 * (a.aligned16), the inputs of a one-group launch split over the blocks of a cluster ----
 *
 * Split-k over blocks: a launch has `splits` (S, 1..8) blocks per (group, 32 outputs), one
 * thread-block cluster; block r of it takes the r-th run of ceil(nb / S) 32-input blocks, its 8
 * warps a contiguous run of that each. S is a function of the shape (stg_splits: a linear
 * layer's rows or the shared expert when their outputs leave SMs idle; 1 for the routed
 * experts), and every sum is added in a fixed order: the result never depends on timing or on
 * the other rows of the call.
 *
 * Each warp copies its run by stages of STG_BYTES bytes of each of the block's 32 weight rows:
 * every lane copies 16-byte pieces with cp.async (four lanes take one row's 64 contiguous bytes,
 * a warp instruction 8 rows), stg_n stages per warp, all but one in flight while the mmas read
 * the oldest from shared memory in the fragment order of mma_wrow. Rows are STG_ROW bytes apart
 * (64 + 16: rows g = 0..7 at word offsets 20 g, so the 4-byte reads of a warp fall in 32
 * distinct banks).
 *
 * Sums: each warp's fp32 accumulators as in moe_mma_kernel; the block adds its warps in warp
 * order; with S > 1 the cluster's blocks then add the blocks' sums in rank order, reading each
 * other's shared memory (each block finishes a share of the outputs). With S = 1 this is
 * moe_mma_kernel's order: the same bits. */

#define STG_BYTES 64                 /* bytes of a weight row per stage */
#define STG_ROW (STG_BYTES + 16)     /* shared-memory stride of a row */
#define STG_SPLITS 8                 /* most blocks of a cluster splitting the inputs */

/* Stages per warp: two (one computed, one in flight) up to 16 rows; four for a linear layer's
 * 17-64 rows, whose registers leave one block an SM. */
template <int NT, bool UP>
__host__ __device__ constexpr uint32_t stg_n()
{
    return NT <= 2 ? 2u : 4u;
}

template <int NT, bool UP>
__host__ __device__ constexpr size_t stg_stage_bytes()
{
    return (size_t)MMA_WARPS * stg_n<NT, UP>() * (UP ? 2 : 1) * MMA_TILE * STG_ROW;
}

/* The accumulators of a thread, and the shared memory of the sums: every warp's (red), then the
 * block's (part) */
template <int NT, bool UP>
__host__ __device__ constexpr int stg_acc()
{
    return (UP ? 2 : 1) * MMA_MT * NT * 4;
}

template <int NT, bool UP>
__host__ __device__ constexpr size_t stg_sum_bytes()
{
    return (size_t)(MMA_WARPS + 1) * stg_acc<NT, UP>() * 32 * sizeof(float);
}

template <int NT, bool UP>
static size_t stg_smem()
{
    return stg_stage_bytes<NT, UP>() > stg_sum_bytes<NT, UP>() ? stg_stage_bytes<NT, UP>()
                                                                 : stg_sum_bytes<NT, UP>();
}

/* The E4M3 codes of one weight row's share of block b (bytes at p, in shared memory): as
 * mma_wrow, from shared memory */
template <bool FP8>
__device__ __forceinline__ void stg_wbits(const uint8_t *p, uint32_t &lo, uint32_t &hi)
{
    if (FP8) {
        uint32_t x = *reinterpret_cast<const uint32_t *>(p);
        uint32_t y = *reinterpret_cast<const uint32_t *>(p + 4);
        lo = __byte_perm(x, y, 0x6420), hi = __byte_perm(x, y, 0x7531);
    } else {
        uint32_t x = *reinterpret_cast<const uint32_t *>(p);
        lo = e2m1_lo(x), hi = e2m1_hi(x);
    }
}

template <bool FP8>
__device__ __forceinline__ float stg_wscale(const uint8_t *s, uint32_t j, uint32_t K, uint32_t b)
{
    if (FP8)
        return dev_ue8m0_decode(__ldg(s + (size_t)(j / 32) * (K / 32) + b));
    return dev_ue8m0_decode(__ldg(s + (size_t)j * (K / 32) + b)) * 64.0f;
}

template <int NT, bool UP, bool FP8>
__global__ void __launch_bounds__(MMA_WARPS * 32, NT <= 2 ? 2 : 1)
    moe_stg_kernel(cuda_moe_grouped a, uint32_t splits, uint32_t per)
{
    constexpr int MATS = UP ? 2 : 1, PER = MMA_MT * NT * 4, ACC = stg_acc<NT, UP>();
    constexpr uint32_t BB = FP8 ? 32 : 16;          /* bytes of a row per 32-input block */
    constexpr uint32_t SB = STG_BYTES / BB;         /* blocks per stage */
    constexpr uint32_t NS = stg_n<NT, UP>();
    constexpr uint32_t MATB = MMA_TILE * STG_ROW, STAGEB = MATS * MATB;
    extern __shared__ uint4 stg_raw[];
    uint8_t *smem = reinterpret_cast<uint8_t *>(stg_raw);
    const uint32_t K = UP ? a.dim : a.inter, N = UP ? a.inter : a.dim, nb = K / 32;
    const size_t rowb = (size_t)K * BB / 32;
    const uint32_t tiles = (N + MMA_TILE - 1) / MMA_TILE;
    const uint32_t rank = blockIdx.x % splits, blk = blockIdx.x / splits;
    if (a.n_groups_dev && blk / tiles >= *a.n_groups_dev)
        return; /* past the groups the device bucketing wrote (the whole cluster) */
    const cuda_moe_group gr = a.groups ? a.groups[blk / tiles] : a.one;
    const uint32_t j0 = (blk % tiles) * MMA_TILE;
    const uint32_t warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
    const __half *codes = (const __half *)(UP ? a.xc : a.hc);
    const float *scales = UP ? a.xcs : a.hcs;
    uint8_t *wbuf = smem + (size_t)warp * NS * STAGEB;
    uint32_t rcol[NT][3];
    mma_rcols<NT, UP>(a, gr, g, t, rcol);
    uint32_t jr[MMA_MT][2];
    mma_jrows(j0, N, g, jr);
    /* the runs: this block's of the cluster's inputs, this warp's of the block's */
    const uint32_t nbs = (nb + splits - 1) / splits;
    const uint32_t kb_lo = rank * nbs < nb ? rank * nbs : nb;
    const uint32_t kb_hi = kb_lo + nbs < nb ? kb_lo + nbs : nb;
    const uint32_t b_lo = kb_lo + warp * per < kb_hi ? kb_lo + warp * per : kb_hi;
    const uint32_t b_hi = b_lo + per < kb_hi ? b_lo + per : kb_hi;
    const uint32_t n_st = (b_hi - b_lo + SB - 1) / SB;
    /* the copies of this lane: row lane / 4 + 8 i, piece lane % 4 */
    const uint8_t *src[MATS][4];
#pragma unroll
    for (int m = 0; m < MATS; m++) {
        const uint8_t *w = m == 0 ? (UP ? gr.w1 : gr.w2) : gr.w3;
#pragma unroll
        for (int i = 0; i < 4; i++) {
            uint32_t j = j0 + lane / 4 + 8 * i;
            src[m][i] = w + (size_t)(j < N ? j : N - 1) * rowb + (lane % 4) * 16;
        }
    }
    /* stage s: blocks [b_lo + s SB, min(+SB, b_hi)); a piece past b_hi is not copied */
    auto load = [&](uint32_t st) {
        const uint32_t b0 = b_lo + st * SB, bytes = (b_hi - b0 < SB ? b_hi - b0 : SB) * BB;
        uint8_t *dst = wbuf + (st % NS) * STAGEB + (lane / 4) * STG_ROW + (lane % 4) * 16;
        if ((lane % 4) * 16 < bytes)
#pragma unroll
            for (int m = 0; m < MATS; m++)
#pragma unroll
                for (int i = 0; i < 4; i++)
                    dev_cp_async16(dst + m * MATB + i * 8 * STG_ROW, src[m][i] + (size_t)b0 * BB);
    };
#pragma unroll
    for (uint32_t st = 0; st + 1 < NS; st++) {
        if (st < n_st)
            load(st);
        dev_cp_async_commit();
    }
    float acc[ACC];
#pragma unroll
    for (int i = 0; i < ACC; i++)
        acc[i] = 0.0f;
    for (uint32_t st = 0; st < n_st; st++) {
        if (st + NS - 1 < n_st)
            load(st + NS - 1);
        dev_cp_async_commit();
        dev_cp_async_wait<NS - 1>();
        __syncwarp();
        const uint8_t *buf = wbuf + (st % NS) * STAGEB;
        const uint32_t b0 = b_lo + st * SB, nbst = b_hi - b0 < SB ? b_hi - b0 : SB;
#pragma unroll
        for (uint32_t bb = 0; bb < SB; bb++) {
            if (bb >= nbst)
                break;
            const uint32_t b = b0 + bb;
            uint4 bx[NT];
            float sx[NT][2];
            mma_xblock<NT>(codes, scales, rcol, K, nb, b, t, bx, sx);
#pragma unroll
            for (int m = 0; m < MATS; m++) {
                const uint8_t *s = m == 0 ? (UP ? gr.s1 : gr.s2) : gr.s3;
                const uint8_t *mb = buf + m * MATB + bb * BB + (FP8 ? 8 : 4) * t;
#pragma unroll
                for (int mt = 0; mt < MMA_MT; mt++) {
                    uint32_t lo0, hi0, lo1, hi1;
                    stg_wbits<FP8>(mb + (mt * 16 + g) * STG_ROW, lo0, hi0);
                    stg_wbits<FP8>(mb + (mt * 16 + g + 8) * STG_ROW, lo1, hi1);
                    const float sw0 = stg_wscale<FP8>(s, jr[mt][0], K, b);
                    const float sw1 = stg_wscale<FP8>(s, jr[mt][1], K, b);
                    mma_tile<NT>(lo0, hi0, lo1, hi1, sw0, sw1, bx, sx,
                                 acc + m * PER + mt * NT * 4);
                }
            }
        }
        __syncwarp(); /* this buffer is loaded again NS - 1 stages on */
    }
    dev_cp_async_wait<0>();
    __syncthreads(); /* the stages' memory now holds the sums */
    float *red = reinterpret_cast<float *>(smem);
#pragma unroll
    for (int i = 0; i < ACC; i++)
        red[((size_t)warp * ACC + i) * 32 + lane] = acc[i];
    __syncthreads();
    if (splits == 1) {
        mma_finish<NT, UP>(a, gr, j0, N, red);
        return;
    }
    /* the block's sums (warp order), then the cluster's (rank order), each block finishing
     * every splits-th output element */
    float *part = red + (size_t)MMA_WARPS * ACC * 32;
    for (uint32_t e = threadIdx.x; e < (uint32_t)ACC * 32; e += blockDim.x) {
        float s = 0.0f;
        for (int w = 0; w < MMA_WARPS; w++)
            s += red[(size_t)w * ACC * 32 + e];
        part[e] = s;
    }
    cg::cluster_group cl = cg::this_cluster();
    cl.sync();
    for (uint32_t e = rank * blockDim.x + threadIdx.x; e < (uint32_t)PER * 32;
         e += splits * blockDim.x) {
        float sa = 0.0f, sb = 0.0f;
        for (uint32_t q = 0; q < splits; q++) {
            const float *pq = cl.map_shared_rank(part, q);
            sa += pq[e];
            if (UP)
                sb += pq[PER * 32 + e];
        }
        mma_store<NT, UP>(a, gr, j0, N, e, sa, sb);
    }
    cl.sync(); /* no block leaves while another reads its sums */
}

/* ---- launchers ---- */

/* Blocks per (group, 32 outputs) splitting the inputs: 1 for the routed experts' launches
 * (their groups fill the device from one row on; measured on the H200, split by the launch's
 * fill, moe_experts took 26% longer at 1 row and 43% at 8); for one group (a linear layer's
 * rows, the shared expert) whose tiles leave the device under half its blocks (two an SM), as
 * many as fill it, at most STG_SPLITS, each warp at least one 32-input block. A function of the
 * shape alone: batch invariant. */
static uint32_t stg_splits(cuda_ctx *c, uint32_t tiles, uint32_t nb, const cuda_moe_grouped *g)
{
    if (c->stream_nosplit || g->pair || g->n_groups != 1)
        return 1;
    const uint32_t slots =
        2u * (uint32_t)cuda_device_attr(c, cudaDevAttrMultiProcessorCount, &c->sm_count, 132);
    if (2 * tiles > slots)
        return 1;
    uint32_t s = slots / tiles;
    s = s > STG_SPLITS ? STG_SPLITS : s;
    while (s > 1 && nb / s < MMA_WARPS)
        s--;
    return s;
}

template <int NT, bool UP, bool FP8>
static di_status launch_mma(cuda_ctx *c, const cuda_moe_grouped *g)
{
    const uint32_t N = UP ? g->inter : g->dim, K = UP ? g->dim : g->inter;
    const uint32_t tiles = (N + MMA_TILE - 1) / MMA_TILE;
    const uint64_t blocks = (uint64_t)g->n_groups * tiles;
    const char *name = UP ? "moe_mma_kernel<up>" : "moe_mma_kernel<down>";
    if (blocks * STG_SPLITS > 0x7fffffffu)
        return cuda_fail(c, DI_EINVAL, "%s: %u groups x %u outputs in one launch", name,
                         g->n_groups, N);
    if (!g->aligned16) {
        if constexpr (NT <= 2) {
            cuda_launch(c, name, moe_mma_kernel<NT, UP, FP8>, (unsigned)blocks, MMA_WARPS * 32, 0,
                        c->stream, *g);
            return cuda_launched(c, name);
        }
        return cuda_fail(c, DI_EINVAL, "%s: %u rows need 16-byte aligned weights", name,
                         g->max_rows);
    }
    /* the staged kernel: its shared memory opted in above 48 KiB (the attribute is per device
     * and function; setting it again is harmless) */
    name = UP ? "moe_stg_kernel<up>" : "moe_stg_kernel<down>";
    const uint32_t nb = K / 32, splits = stg_splits(c, tiles, nb, g);
    const uint32_t per = ((nb + splits - 1) / splits + MMA_WARPS - 1) / MMA_WARPS;
    const size_t smem = stg_smem<NT, UP>();
    di_status st = cuda_check(c, cudaFuncSetAttribute(moe_stg_kernel<NT, UP, FP8>,
                                                      cudaFuncAttributeMaxDynamicSharedMemorySize,
                                                      (int)smem),
                              "moe_stg_kernel: cudaFuncSetAttribute");
    if (st != DI_OK)
        return st;
    st = cuda_launch_cluster(c, name, moe_stg_kernel<NT, UP, FP8>, (unsigned)(blocks * splits),
                             MMA_WARPS * 32, smem, c->stream, splits, *g, splits, per);
    if (st == DI_OK && splits > 1)
        c->stats.stream_split++;
    return st == DI_OK ? cuda_launched(c, name) : st;
}

/* The n8 tiles of the group rows: up to 16 rows (every MoE group) on one or two; a linear
 * layer's 17-64 rows on four or eight (the down launch only). */
template <bool UP>
static di_status launch_nt(cuda_ctx *c, const cuda_moe_grouped *g)
{
    if (g->max_rows <= 8)
        return g->fp8 ? launch_mma<1, UP, true>(c, g) : launch_mma<1, UP, false>(c, g);
    if (g->max_rows <= 16)
        return g->fp8 ? launch_mma<2, UP, true>(c, g) : launch_mma<2, UP, false>(c, g);
    if constexpr (!UP) {
        if (g->max_rows <= 32)
            return g->fp8 ? launch_mma<4, UP, true>(c, g) : launch_mma<4, UP, false>(c, g);
        if (g->max_rows <= 64)
            return g->fp8 ? launch_mma<8, UP, true>(c, g) : launch_mma<8, UP, false>(c, g);
    }
    return cuda_fail(c, DI_EINVAL, "moe mma: %u rows in a group", g->max_rows);
}

di_status cuda_moe_mma_run(cuda_ctx *c, const cuda_moe_grouped *g)
{
    static_assert(CUDA_MOE_GROUP_ROWS <= 16, "launch_nt instantiates up to two n8 tiles");
    const uint32_t x_rows = g->pair ? g->n_pairs / g->top_k : g->n_pairs; /* rows of x */
    di_status st = launch_codes(c, g->xq, g->x_ld ? g->x_ld : g->dim, x_rows, g->dim, g->xc,
                                g->xcs);
    if (st == DI_OK)
        st = launch_nt<true>(c, g);
    if (st == DI_OK)
        st = launch_codes(c, g->h, g->inter, g->n_pairs, g->inter, g->hc, g->hcs);
    if (st == DI_OK)
        st = launch_nt<false>(c, g);
    return st;
}

/* A linear layer's rows as the one group of the down launch: K = p->k inputs (the group's h is
 * x's codes), N = p->n outputs written to y with its stride; the weight streamed once through
 * shared memory. The same numbers as the linear path (x quantised by (A), exact products,
 * fp32 sums, one bf16 rounding), summed in another order, within the linear tolerance. */
di_status cuda_linear_stream(cuda_ctx *c, const kern_linear *p, int fp8)
{
    if (p->m > CUDA_LINEAR_STREAM_ROWS)
        return cuda_fail(c, DI_EINVAL, "weight-streaming kernel: %u rows (at most %d)", p->m,
                         CUDA_LINEAR_STREAM_ROWS);
    const size_t codes_bytes = cuda_align_up((size_t)p->m * p->k * sizeof(__half));
    uint8_t *scratch;
    di_status st = cuda_scratch(c, codes_bytes + (size_t)p->m * (p->k / 32) * sizeof(float),
                                &scratch);
    if (st != DI_OK)
        return st;
    cuda_moe_grouped g;
    memset(&g, 0, sizeof(g));
    g.n_groups = 1, g.groups = NULL, g.max_rows = p->m, g.fp8 = fp8 != 0;
    g.aligned = 1, g.aligned16 = 1;
    g.one.w2 = (const uint8_t *)p->w, g.one.s2 = p->w_scale, g.one.start = 0, g.one.n = p->m;
    g.dim = p->n, g.inter = p->k, g.n_pairs = p->m;
    g.og = (uint16_t *)p->y, g.og_ld = p->y_stride;
    g.hc = scratch, g.hcs = (float *)(scratch + codes_bytes);
    st = launch_codes(c, p->x, p->x_stride, p->m, p->k, g.hc, g.hcs);
    if (st == DI_OK)
        st = launch_nt<false>(c, &g);
    if (st == DI_OK)
        c->stats.linear_stream++;
    return st;
}

void cuda_stream_config(cuda_ctx *c, int stream_splits, int linear_stream_rows)
{
    c->stream_nosplit = stream_splits == 1;
    c->linear_stream_rows = linear_stream_rows < 0    ? 0
                            : linear_stream_rows == 0 ? CUDA_LINEAR_STREAM_DEFAULT
                            : linear_stream_rows > CUDA_LINEAR_STREAM_ROWS
                                ? CUDA_LINEAR_STREAM_ROWS
                                : linear_stream_rows;
}

extern "C" di_status kern_cuda_set_stream(kern_backend *be, int stream_splits,
                                          int linear_stream_rows)
{
    if (!be || !be->ctx || !be->name || strcmp(be->name, "cuda") != 0)
        return DI_EINVAL;
    cuda_stream_config((cuda_ctx *)be->ctx, stream_splits, linear_stream_rows);
    return DI_OK;
}
