/* moe_wide.cu: the routed experts' projections of moe_experts when buckets are prefill-sized
 * (hundreds of rows per expert). C twin: kernels/cpu/ops_moe.c (through the linear path's
 * numbers: (A)-quantised activations, exactly dequantised FP4 weights, fp32 sums, one bf16
 * rounding).
 *
 * One launch per projection covers every tile of the call: a block takes one tile (up to 128
 * rows of one expert's bucket) and 128 outputs, 8 warps of 64 x 32 (a warp skips the 16-row
 * pieces past the tile's rows), K in steps of 64 through a three-stage cp.async pipeline. The
 * activation rows arrive as bf16 (x or h quantised by (A): a value of at most 4 significant
 * bits times a power of two, exact in bf16); the weight arrives as packed E2M1 with its UE8M0
 * scale per 32 inputs and is dequantised once per block and step into a bf16 tile in shared
 * memory: byte permutes (prmt) turn a word of eight codes into four bf16 pairs in registers
 * (wide_e2m1x8), and one bf16x2 multiply applies the scale, exact while the scale lies in
 * [2^-107, 2^103] (every product is then a normal number); other scales (and NaN) take the C
 * twin's fp32 expression, rounded once as the linear path's dequantisation does. Both operands
 * are therefore the linear path's exact values; mma.sync m16n8k16 (BF16, fp32 accumulation)
 * sums them in a fixed order per output, so a row's result depends on nothing else in the call
 * (batch invariant within the path). Only the order of the fp32 sums differs from the linear
 * path (cuBLASLt): the same tolerance (kernels.h's moe_experts bound).
 *
 * The first version (kern_cuda_config.moe_wide_tile = KERN_CUDA_WIDE_FIRST, kept for the
 * bench) looked the pairs up in a 256-entry table in shared memory: 16 lookups a thread and
 * step, conflicting on the banks, on a kernel bound by shared memory (ncu: L1/shared 75%). The
 * permutes read nothing from it (L1/shared 60%, the call 7-8% faster, docs/cuda.md). The other
 * shape, KERN_CUDA_WIDE_W64 (4 warps of 64 x 64: 16 MACs per fragment byte against 11), is
 * slower on the H200: at 245 registers a thread, two blocks of 4 warps an SM leave too few
 * warps to hide the latencies. Every shape gives the same bits: each output's products and the
 * order of its sums are the same, only which warp computes it changes (check_moe compares
 * them).
 *
 * Compared with the linear path per expert, the weight is never written out as bf16 (that path
 * reads the FP4 weight, writes and reads back four times its bytes per call) and one launch
 * replaces two dequantisations and one cuBLASLt GEMM per expert and projection.
 */
#include <cuda_runtime.h>
#include <stdint.h>

#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/moe_wide.h"
#include "kernels/cuda/mma_dev.cuh"
#include "kernels/cuda/numfmt_dev.cuh"

#define WIDE_BM 128               /* rows per block (= CUDA_MOE_WIDE_ROWS) */
#define WIDE_BK 64                /* inputs per pipeline step */
#define WIDE_STAGES 3
#define WIDE_AROW (WIDE_BK + 8)   /* bf16 per shared row: 144 bytes, so that the 8 rows of an
                                   * ldmatrix phase fall on distinct banks */
#define WIDE_WROW (WIDE_BK / 2)   /* packed weight bytes per row and step */

static_assert(WIDE_BM == CUDA_MOE_WIDE_ROWS, "tile rows");

/* A shape of the kernel: two warps of 64 rows along the tile's rows and WNW warps of WN
 * outputs along the outputs (a block of WNW * WN outputs, 64 * WNW threads), two blocks an SM,
 * the E2M1 pairs from byte permutes (REG 1) or the byte table (REG 0). */
template <int WNW, int WN, int REG>
struct wide_shape {
    static constexpr int wnw = WNW, wn = WN, reg = REG;
    static constexpr int threads = 64 * WNW;
    static constexpr int bn = WNW * WN;
    /* shared memory: the stages' activation and raw weight tiles, the dequantised weight
     * tile, the byte table */
    static constexpr int a_bytes = WIDE_BM * WIDE_AROW * 2;
    static constexpr int w_bytes = bn * WIDE_WROW;
    static constexpr int stage_bytes = a_bytes + w_bytes;
    static constexpr int b_bytes = bn * WIDE_AROW * 2;
    static constexpr int smem = WIDE_STAGES * stage_bytes + b_bytes + 256 * 4;
    static constexpr int a_pieces = WIDE_BM * WIDE_BK / 8 / threads; /* 16-byte pieces a thread */
    static constexpr int w_pieces = bn * 2 / threads;
    static constexpr int dq = bn * 2 / threads; /* 32-input runs a thread dequantises a step */
    static_assert(WN % 16 == 0 && a_pieces * threads * 8 == WIDE_BM * WIDE_BK &&
                      w_pieces * threads == bn * 2 && dq >= 1 && 2 * smem <= 227 * 1024,
                  "block shape");
};

__device__ __forceinline__ void ldsm_x4(uint32_t (&r)[4], const void *smem)
{
    unsigned s = (unsigned)__cvta_generic_to_shared(smem);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(s));
}

__device__ __forceinline__ void mma_bf16(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                         uint32_t b1)
{
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, "
                 "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ uint32_t mul_bf16x2(uint32_t a, uint32_t b)
{
    uint32_t d;
    asm("mul.rn.bf16x2 %0, %1, %2;\n" : "=r"(d) : "r"(a), "r"(b));
    return d;
}

__device__ __forceinline__ uint32_t wide_pack(float a, float b)
{
    return (uint32_t)dev_f32_to_bf16(a) | (uint32_t)dev_f32_to_bf16(b) << 16;
}

/* Step kt's activation rows and raw weight rows into stage st. Rows past the tile repeat its
 * last row (never stored), outputs past n_out repeat the last output. */
template <class S>
__device__ __forceinline__ void wide_load(uint8_t *stage, const uint16_t *a, uint32_t k,
                                          uint32_t rows, const uint8_t *w, uint32_t n0,
                                          uint32_t n_out, uint32_t kt)
{
    const uint32_t tid = threadIdx.x;
    uint16_t *as = (uint16_t *)stage;
#pragma unroll
    for (int i = 0; i < S::a_pieces; i++) {
        uint32_t piece = tid + i * S::threads, r = piece / 8, c = piece % 8;
        uint32_t src = r < rows ? r : rows - 1;
        dev_cp_async16(as + r * WIDE_AROW + c * 8, a + (size_t)src * k + (size_t)kt * WIDE_BK + c * 8);
    }
    uint8_t *ws = stage + S::a_bytes;
#pragma unroll
    for (int i = 0; i < S::w_pieces; i++) {
        uint32_t piece = tid + i * S::threads, r = piece / 2, c = piece % 2;
        uint32_t j = n0 + r < n_out ? n0 + r : n_out - 1;
        dev_cp_async16(ws + r * WIDE_WROW + c * 16,
                  w + (size_t)j * (k / 2) + (size_t)kt * WIDE_WROW + c * 16);
    }
}

__device__ __forceinline__ uint32_t wide_prmt(uint32_t a, uint32_t b, uint32_t sel)
{
    uint32_t d;
    asm("prmt.b32 %0, %1, %2, %3;\n" : "=r"(d) : "r"(a), "r"(b), "r"(sel));
    return d;
}

/* A word of packed E2M1 (eight values, low nibble first) as four bf16 pairs, in registers:
 * byte permutes look each magnitude's high and low bf16 byte up in two 8-entry tables held in
 * the instruction's operands (hi: 00 3F 3F 3F 40 40 40 40, lo: 00 00 80 C0 00 40 80 C0), the
 * sign bits are moved to bit 7 of the high bytes, and two more permutes interleave the bytes
 * into pairs. The same bits as the byte table's entries (tests/gpu/check_moe.c compares the
 * shapes bit for bit). */
__device__ __forceinline__ void wide_e2m1x8(uint32_t w, uint32_t (&o)[4])
{
    const uint32_t sel = w & 0x77777777u, w4 = w << 4;
#pragma unroll
    for (int h = 0; h < 2; h++) {
        const uint32_t sh = h ? sel >> 16 : sel;
        uint32_t hi = wide_prmt(0x3F3F3F00u, 0x40404040u, sh);
        const uint32_t lo = wide_prmt(0xC0800000u, 0xC0804000u, sh);
        hi |= wide_prmt(w4, w, h ? 0x7362u : 0x5140u) & 0x80808080u;
        o[2 * h] = wide_prmt(lo, hi, 0x5140u);
        o[2 * h + 1] = wide_prmt(lo, hi, 0x7362u);
    }
}

/* One thread dequantises 32 inputs (16 bytes, one scale) of one output row into bs: the E2M1
 * pairs from the byte table (REG 0) or from byte permutes in registers (REG 1). */
template <int REG>
__device__ __forceinline__ void wide_dequant(const uint8_t *raw, uint8_t sc, const uint32_t *lut,
                                             uint16_t *dst)
{
    uint4 q = *reinterpret_cast<const uint4 *>(raw);
    uint32_t wd[4] = {q.x, q.y, q.z, q.w}, o[16];
    if (sc >= 20 && sc <= 230) {
        /* 2^(sc - 127) as a bf16 pair */
        uint32_t s = (uint32_t)sc << 7;
        s |= s << 16;
        if (REG) {
#pragma unroll
            for (int i = 0; i < 4; i++) {
                uint32_t v[4];
                wide_e2m1x8(wd[i], v);
#pragma unroll
                for (int e = 0; e < 4; e++)
                    o[4 * i + e] = mul_bf16x2(v[e], s);
            }
        } else {
#pragma unroll
            for (int i = 0; i < 16; i++)
                o[i] = mul_bf16x2(lut[(wd[i / 4] >> (8 * (i % 4))) & 0xffu], s);
        }
    } else {
        const float s = dev_ue8m0_decode(sc);
#pragma unroll
        for (int i = 0; i < 16; i++) {
            uint32_t byte = (wd[i / 4] >> (8 * (i % 4))) & 0xffu;
            o[i] = wide_pack(dev_e2m1_decode((uint8_t)(byte & 15u)) * s,
                             dev_e2m1_decode((uint8_t)(byte >> 4)) * s);
        }
    }
    uint4 *d = reinterpret_cast<uint4 *>(dst);
#pragma unroll
    for (int i = 0; i < 4; i++)
        d[i] = make_uint4(o[4 * i], o[4 * i + 1], o[4 * i + 2], o[4 * i + 3]);
}

/* grid: x = output block (and, for up, W1 then W3), y = tile */
template <class S>
__global__ void __launch_bounds__(S::threads, 2) moe_wide_kernel(cuda_moe_wide p)
{
    constexpr int WNW = S::wnw, WN = S::wn, REG = S::reg, STAGES = WIDE_STAGES;
    constexpr int NJ = WN / 8;  /* n8 pieces of a warp */
    extern __shared__ __align__(16) uint8_t wide_smem[];
    uint16_t *bs = (uint16_t *)(wide_smem + STAGES * S::stage_bytes);
    uint32_t *lut = (uint32_t *)(wide_smem + STAGES * S::stage_bytes + S::b_bytes);
    const uint32_t tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
    const uint32_t n_blocks = (p.n_out + S::bn - 1) / S::bn;
    const uint32_t which = blockIdx.x / n_blocks, n0 = (blockIdx.x % n_blocks) * S::bn;
    const cuda_moe_group t = p.tiles[blockIdx.y];
    const uint8_t *w, *ws;
    uint16_t *y;
    if (!p.up)
        w = t.w2, ws = t.s2, y = p.y0;
    else if (which == 0)
        w = t.w1, ws = t.s1, y = p.y0;
    else
        w = t.w3, ws = t.s3, y = p.y1;
    const uint32_t k = p.k, KT = k / WIDE_BK, rows = t.n;
    const uint16_t *a = p.a + (size_t)t.start * k;

    /* the byte table (its shape only): byte b's two E2M1 values (low nibble first) as a bf16
     * pair */
    for (uint32_t b = tid; b < 256 && !REG; b += S::threads)
        lut[b] = wide_pack(dev_e2m1_decode((uint8_t)(b & 15u)), dev_e2m1_decode((uint8_t)(b >> 4)));

#pragma unroll
    for (int s = 0; s < STAGES - 1; s++) {
        if ((uint32_t)s < KT)
            wide_load<S>(wide_smem + s * S::stage_bytes, a, k, rows, w, n0, p.n_out, s);
        dev_cp_async_commit();
    }
    /* this thread's dequantisation: runs u = tid + i * threads, output row u / 2, inputs
     * [32 (u % 2), 32 (u % 2) + 32) of each step */
    const uint8_t *scale[S::dq];
    uint8_t sc[S::dq];
#pragma unroll
    for (int i = 0; i < S::dq; i++) {
        const uint32_t u = tid + i * S::threads, dr = u / 2;
        const uint32_t dj = n0 + dr < p.n_out ? n0 + dr : p.n_out - 1;
        scale[i] = ws + (size_t)dj * (k / 32) + u % 2;
        sc[i] = scale[i][0];
    }

    /* this warp's outputs: rows [wrow, wrow + 64) of the tile, outputs [wcol, wcol + WN); live:
     * its 16-row pieces holding rows of the tile (a bucket's last tile is partial) */
    const uint32_t wrow = warp / WNW * 64, wcol = warp % WNW * WN;
    const uint32_t live = rows > wrow ? (rows - wrow + 15) / 16 : 0;
    float acc[4][NJ][4];
#pragma unroll
    for (int i = 0; i < 4; i++)
#pragma unroll
        for (int j = 0; j < NJ; j++)
#pragma unroll
            for (int e = 0; e < 4; e++)
                acc[i][j][e] = 0.0f;

    /* step j's weights, raw in its stage, dequantised into dst (every thread its runs) */
    auto dequant = [&](uint32_t j, uint16_t *dst) {
        const uint8_t *raw = wide_smem + (j % STAGES) * S::stage_bytes + S::a_bytes;
#pragma unroll
        for (int i = 0; i < S::dq; i++) {
            const uint32_t u = tid + i * S::threads, dr = u / 2, dh = u % 2;
            const uint8_t sc_next = j + 1 < KT ? scale[i][(size_t)(j + 1) * 2] : 0;
            wide_dequant<REG>(raw + dr * WIDE_WROW + dh * 16, sc[i], lut,
                              dst + dr * WIDE_AROW + dh * 32);
            sc[i] = sc_next;
        }
    };
    /* step j's products: its activation stage against the dequantised tile bsj */
    auto products = [&](uint32_t j, const uint16_t *bsj) {
        const uint16_t *as = (const uint16_t *)(wide_smem + (j % STAGES) * S::stage_bytes);
#pragma unroll
        for (int kk = 0; kk < WIDE_BK / 16; kk++) {
            uint32_t af[4][4], bf[NJ / 2][4];
#pragma unroll
            for (int i = 0; i < 4; i++)
                ldsm_x4(af[i], as + (wrow + i * 16 + (lane & 15)) * WIDE_AROW + kk * 16 +
                                   (lane >> 4) * 8);
#pragma unroll
            for (int h = 0; h < NJ / 2; h++)
                ldsm_x4(bf[h], bsj + (wcol + h * 16 + (lane & 7) + ((lane >> 4) << 3)) * WIDE_AROW +
                                   kk * 16 + ((lane >> 3) & 1) * 8);
#pragma unroll
            for (int i = 0; i < 4; i++)
                if ((uint32_t)i < live)
#pragma unroll
                    for (int jj = 0; jj < NJ; jj++)
                        mma_bf16(acc[i][jj], af[i], bf[jj / 2][(jj % 2) * 2],
                                 bf[jj / 2][(jj % 2) * 2 + 1]);
        }
    };

    for (uint32_t kt = 0; kt < KT; kt++) {
        dev_cp_async_wait<STAGES - 2>();
        __syncthreads();
        const uint32_t next = kt + STAGES - 1;
        if (next < KT)
            wide_load<S>(wide_smem + (next % STAGES) * S::stage_bytes, a, k, rows, w, n0, p.n_out,
                         next);
        dev_cp_async_commit();
        dequant(kt, bs);
        __syncthreads();
        products(kt, bs);
    }
    dev_cp_async_wait<0>();

    const uint32_t g = lane / 4, tq = lane % 4;
#pragma unroll
    for (int i = 0; i < 4; i++)
#pragma unroll
        for (int h = 0; h < 2; h++) {
            uint32_t r = wrow + i * 16 + g + h * 8;
            if (r >= rows)
                continue;
            uint16_t *yr = y + (size_t)(t.start + r) * p.ldy;
#pragma unroll
            for (int j = 0; j < NJ; j++) {
                uint32_t col = n0 + wcol + j * 8 + tq * 2;
                if (col < p.n_out)
                    *reinterpret_cast<uint32_t *>(yr + col) =
                        wide_pack(acc[i][j][2 * h], acc[i][j][2 * h + 1]);
            }
        }
}

int cuda_moe_wide_fits(uint32_t k, uint32_t n)
{
    return k > 0 && k % WIDE_BK == 0 && n > 0 && n % 2 == 0;
}

/* One block shape's launch over every tile of the call. */
template <class S>
static di_status wide_launch(cuda_ctx *c, const cuda_moe_wide *w)
{
    di_status st = cuda_check(c, cudaFuncSetAttribute(moe_wide_kernel<S>,
                                                      cudaFuncAttributeMaxDynamicSharedMemorySize,
                                                      S::smem),
                              "moe_wide: cudaFuncSetAttribute");
    if (st != DI_OK)
        return st;
    uint32_t nb = (w->n_out + S::bn - 1) / S::bn;
    dim3 grid(nb * (w->up ? 2 : 1), w->n_tiles);
    cuda_launch(c, "moe_wide_kernel", moe_wide_kernel<S>, grid, S::threads, S::smem, c->stream,
                *w);
    return cuda_launched(c, "moe_wide_kernel");
}

di_status cuda_moe_wide_run(cuda_ctx *c, const cuda_moe_wide *w)
{
    if (!cuda_moe_wide_fits(w->k, w->n_out) || w->ldy % 2 || w->n_tiles > 65535u)
        return cuda_fail(c, DI_EINVAL, "moe_wide: k %u, n %u, ldy %zu, %u tiles", w->k, w->n_out,
                         w->ldy, w->n_tiles);
    if (w->n_tiles == 0)
        return DI_OK;
    /* by kern_cuda_config.moe_wide_tile: KERN_CUDA_WIDE_* in order */
    static di_status (*const launch[KERN_CUDA_WIDE_SHAPES])(cuda_ctx *, const cuda_moe_wide *) = {
        wide_launch<wide_shape<4, 32, 1>>, wide_launch<wide_shape<4, 32, 0>>,
        wide_launch<wide_shape<2, 64, 1>>};
    return launch[c->moe_wide_tile](c, w);
}
