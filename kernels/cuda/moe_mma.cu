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
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <math.h>
#include <stdint.h>

#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/cuda_internal.h"
#include "kernels/cuda/moe_dev.cuh"
#include "kernels/cuda/numfmt_dev.cuh"

#define MMA_WARPS 8  /* warps per block, splitting the inputs */
#define MMA_TILE 32  /* outputs per block: two m16 tiles */
#define MMA_MT 2     /* m16 tiles per warp */

/* ---- the codes pre-pass: (A) of bf16 rows into E4M3 codes as FP16 (within each 8 inputs
 * in the order 0, 2, 1, 3, 4, 6, 5, 7) and one fp32 scale per 32 (infinite when the block holds an
 * infinity, so that the products stay infinite as the twin's dequantised sums are) ---- */

__global__ void mma_codes_kernel(const uint16_t *src, uint32_t n_rows, uint32_t K, __half *codes,
                                 float *scales)
{
    size_t t = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    const uint32_t quads = K / 4;
    bool valid = t < (size_t)n_rows * quads;
    size_t row = valid ? t / quads : 0;
    uint32_t col = valid ? (uint32_t)(t % quads) * 4 : 0;
    float v[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    if (valid)
        for (int i = 0; i < 4; i++)
            v[i] = dev_bf16_to_f32(src[row * K + col + i]);
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

static di_status launch_codes(cuda_ctx *c, const uint16_t *src, uint32_t rows, uint32_t K,
                              void *codes, float *scales)
{
    size_t threads = (size_t)rows * (K / 4), blocks = (threads + CUDA_THREADS - 1) / CUDA_THREADS;
    if (blocks == 0)
        return DI_OK;
    if (blocks > 0x7fffffffu)
        return cuda_fail(c, DI_EINVAL, "moe mma: %u rows of %u to quantise", rows, K);
    mma_codes_kernel<<<(unsigned)blocks, CUDA_THREADS, 0, c->stream>>>(src, rows, K,
                                                                       (__half *)codes, scales);
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

/* ---- the kernel: UP = W1 and W3 with SwiGLU, else W2; NT n8 tiles of group rows ---- */

template <int NT, bool UP, bool FP8>
__global__ void __launch_bounds__(MMA_WARPS * 32, 2) moe_mma_kernel(cuda_moe_grouped a)
{
    constexpr int MATS = UP ? 2 : 1, PER = MMA_MT * NT * 4, ACC = MATS * PER;
    __shared__ float red[MMA_WARPS][ACC][32];
    const uint32_t K = UP ? a.dim : a.inter, N = UP ? a.inter : a.dim, nb = K / 32;
    const uint32_t tiles = (N + MMA_TILE - 1) / MMA_TILE;
    const cuda_moe_group gr = a.groups[blockIdx.x / tiles];
    const uint32_t j0 = (blockIdx.x % tiles) * MMA_TILE, n = gr.n;
    const uint32_t warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
    const bool aligned = a.aligned != 0;
    const __half *codes = (const __half *)(UP ? a.xc : a.hc);
    const float *scales = UP ? a.xcs : a.hcs;
    /* rows of this lane's B column (group row g of each n tile) and of its two D columns;
     * ~0u past the group */
    uint32_t rcol[NT][3];
#pragma unroll
    for (int nt = 0; nt < NT; nt++) {
#pragma unroll
        for (int h = 0; h < 3; h++) {
            uint32_t r = h == 2 ? nt * 8 + g : nt * 8 + 2 * t + h;
            rcol[nt][h] = r >= n ? ~0u
                                 : (!UP || !a.pair ? gr.start + r
                                                   : (uint32_t)a.pair[gr.start + r] / a.top_k);
        }
    }
    /* the weight rows of this lane: tile mt, rows g and g + 8 (clamped inside the matrix) */
    uint32_t jr[MMA_MT][2];
#pragma unroll
    for (int mt = 0; mt < MMA_MT; mt++)
        for (int h = 0; h < 2; h++) {
            uint32_t j = j0 + mt * 16 + g + 8 * h;
            jr[mt][h] = j < N ? j : N - 1;
        }
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
#pragma unroll
        for (int nt = 0; nt < NT; nt++) {
            bx[nt] = make_uint4(0u, 0u, 0u, 0u);
            if (rcol[nt][2] != ~0u)
                bx[nt] = *reinterpret_cast<const uint4 *>(codes + (size_t)rcol[nt][2] * K +
                                                          b * 32 + 8 * t);
#pragma unroll
            for (int h = 0; h < 2; h++)
                sx[nt][h] = rcol[nt][h] != ~0u ? scales[(size_t)rcol[nt][h] * nb + b] : 0.0f;
        }
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
                    float *ac = acc + m * PER + (mt * NT + nt) * 4;
                    ac[0] = fmaf(d[0], sw0 * sx[nt][0], ac[0]);
                    ac[1] = fmaf(d[1], sw0 * sx[nt][1], ac[1]);
                    ac[2] = fmaf(d[2], sw1 * sx[nt][0], ac[2]);
                    ac[3] = fmaf(d[3], sw1 * sx[nt][1], ac[3]);
                }
            }
        }
    }
#pragma unroll
    for (int i = 0; i < ACC; i++)
        red[warp][i][lane] = acc[i];
    __syncthreads();
    /* element (i, l) of every warp's accumulators: i = (mt * NT + nt) * 4 + q */
    for (uint32_t e = threadIdx.x; e < (uint32_t)PER * 32; e += blockDim.x) {
        uint32_t i = e / 32, l = e % 32, q = i % 4, mt = i / 4 / NT, nt = i / 4 % NT;
        uint32_t j = j0 + mt * 16 + l / 4 + (q / 2) * 8, r = nt * 8 + 2 * (l % 4) + q % 2;
        if (j >= N || r >= n)
            continue;
        float sa = 0.0f, sb = 0.0f;
        for (int w = 0; w < MMA_WARPS; w++) {
            sa += red[w][i][l];
            if (UP)
                sb += red[w][PER + i][l];
        }
        const size_t row = (size_t)gr.start + r;
        if (UP) {
            float gv = dev_bf16_to_f32(dev_f32_to_bf16(sa));
            float uv = dev_bf16_to_f32(dev_f32_to_bf16(sb));
            a.h[row * N + j] = dev_swiglu(gv, uv, a.limit, a.pair != NULL,
                                          a.pair ? a.weights[a.pair[row]] : 1.0f);
        } else {
            a.og[row * N + j] = dev_f32_to_bf16(sa);
        }
    }
}

/* ---- launchers ---- */

template <int NT, bool UP, bool FP8>
static di_status launch_mma(cuda_ctx *c, const cuda_moe_grouped *g)
{
    const uint32_t N = UP ? g->inter : g->dim;
    const uint64_t blocks = (uint64_t)g->n_groups * ((N + MMA_TILE - 1) / MMA_TILE);
    const char *name = UP ? "moe_mma_kernel<up>" : "moe_mma_kernel<down>";
    if (blocks > 0x7fffffffu)
        return cuda_fail(c, DI_EINVAL, "%s: %u groups x %u outputs in one launch", name,
                         g->n_groups, N);
    moe_mma_kernel<NT, UP, FP8><<<(unsigned)blocks, MMA_WARPS * 32, 0, c->stream>>>(*g);
    return cuda_launched(c, name);
}

template <bool UP>
static di_status launch_nt(cuda_ctx *c, const cuda_moe_grouped *g)
{
    if (g->max_rows <= 8)
        return g->fp8 ? launch_mma<1, UP, true>(c, g) : launch_mma<1, UP, false>(c, g);
    return g->fp8 ? launch_mma<2, UP, true>(c, g) : launch_mma<2, UP, false>(c, g);
}

di_status cuda_moe_mma_run(cuda_ctx *c, const cuda_moe_grouped *g)
{
    static_assert(CUDA_MOE_GROUP_ROWS <= 16, "launch_nt instantiates up to two n8 tiles");
    const uint32_t x_rows = g->pair ? g->n_pairs / g->top_k : g->n_pairs; /* rows of x */
    di_status st = launch_codes(c, g->xq, x_rows, g->dim, g->xc, g->xcs);
    if (st == DI_OK)
        st = launch_nt<true>(c, g);
    if (st == DI_OK)
        st = launch_codes(c, g->h, g->n_pairs, g->inter, g->hc, g->hcs);
    if (st == DI_OK)
        st = launch_nt<false>(c, g);
    return st;
}
