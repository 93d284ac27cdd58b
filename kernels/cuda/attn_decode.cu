/* attn_decode.cu: the tile kernel of sparse attention with a sink, for every row of the call,
 * decode rows (1 + nextn a sequence) and prefill chunks alike (kern_sparse_attn, MODEL.md §2.5
 * steps 5-8; C twin: kernels/cpu/ops_attn.c; attn.cu checks the op and calls
 * cuda_attn_tiles). Keys are values (MQA over one latent).
 *
 * A row's key slots are the twin's: the window slots (a normal row: `window` slots, empty ones
 * included, positions of this step from `local` and older ones from the ring, so a prefill row
 * whose window crosses the chunk start reads both; a draft block: the ring up to ring_hi, then
 * every row of the block), then one slot per top-k position (-1 and ids past the block table
 * empty). One CTA per (row, split of the slots, group of up to 64 heads): every head of the
 * group in one CTA, so each entry is read and decoded once for the scores and the values of
 * all of them. A split is a range of `chunk` slots (a multiple of 16); the CTA walks it by
 * tiles, a tile being the split's part of one 64-slot softmax block:
 *  1. the tile's slot addresses (one thread per slot, compacted by ballot), the entries decoded
 *     into bf16 in shared memory (E4M3 x UE8M0 ring entries and E2M1 x E4M3 compressed ones
 *     are exact in bf16), zero rows up to a multiple of 16;
 *  2. S = Q K^T by m16n8k16 bf16 mma.sync (fp32 accumulation), s = fp32(S * scale);
 *  3. the twin's blockwise step per head: m_b = max(m, the tile's s), alpha = fp32
 *     exp(m - m_b), p = fp32 exp(s - m_b) (exp in double), l = l * alpha + fp32(sum p),
 *     P = bf16(p);
 *  4. O = O * alpha + P V by mma.sync, the accumulators in registers (64 heads x hd fp32 over
 *     16 warps).
 * With one split the CTA finishes the row: out = bf16(O / (l + exp(sink - m))). With more, it
 * writes (O, m, l) and a second kernel combines the splits in split order: M = max m_j,
 * f_j = fp32 exp(m_j - M), O = sum O_j f_j, l = sum l_j f_j + exp(sink - M) (fp32, in that
 * order), out = bf16(O / l); with one split f = 1 and the two ways give the same bits.
 * Against the twin: the dot products are exact products summed in fp32 in another order (the
 * twin: double), the block sums of P V in fp32 (the twin: double), and a split starts its own
 * running max, so where a split does not start at slot 0 its p are rounded to bf16 against
 * another max (a relative 2^-9 per weight at most): within kernels.h's abs 2e-2 and cosine
 * 0.9999 per head.
 * Splits: about one CTA per SM for the call (floor(SMs / (rows x head groups)) splits of at
 * least 64 slots), so a call of at least as many rows as SMs (a prefill chunk, a large decode
 * batch) takes one split and no combine. The plan depends on the call's row count, so a row's
 * bits may change with the batch; in batch-invariant mode the plan depends on the row's
 * sequence alone: rows of sequences of at most CUDA_ATTN_DECODE_ROWS rows take splits of
 * CUDA_ATTN_BI_CHUNK slots, the others one split (two launches where a call holds both, each
 * over its list of rows). */
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/cuda_internal.h"
#include "kernels/cuda/mma_dev.cuh"
#include "kernels/cuda/numfmt_dev.cuh"

#define AD_HG 64                      /* heads per CTA */
#define AD_TE 64                      /* slots per tile: the softmax block */
#define AD_WARPS 16
#define AD_THREADS (AD_WARPS * 32)
#define AD_MAX_HD 512
#define AD_NT 16                      /* n8 output tiles per warp (hd 512: 64 over 4 warps) */
#define AD_SLD (AD_TE + 8)            /* row stride of S (floats) */
#define AD_PLD (AD_TE + 8)            /* row stride of P (bf16) */
#define AD_SPLIT_UNIT 16              /* slots: a split is a multiple of this */
#define AD_COMBINE_THREADS 128
#define AD_MAX_SPLIT 1024             /* splits per row at most (the combine's factors) */
#define AD_MIN_SPLIT AD_TE            /* slots per split at least, unless the mode fixes it */

typedef struct ad_smem {
    size_t q, k, s, p, stage, ptr, fmt, lut, head, misc, total;
} ad_smem;

/* Bytes of a staged entry (the larger of the two formats, in 16-byte chunks). */
static __host__ __device__ uint32_t ad_stage_stride(uint32_t hd)
{
    uint32_t ring = hd + hd / 32, comp = hd / 2 + hd / 16, m = ring > comp ? ring : comp;
    return (m + 15) / 16 * 16;
}

static __host__ __device__ ad_smem ad_layout(uint32_t hd)
{
    ad_smem L;
    size_t ld = (size_t)hd + 8;
    L.q = 0;
    L.k = L.q + dev_smem_round(AD_HG * ld * 2);
    L.s = L.k + dev_smem_round(AD_TE * ld * 2);
    L.p = L.s + dev_smem_round((size_t)AD_HG * AD_SLD * 4);
    L.stage = L.p + dev_smem_round((size_t)AD_HG * AD_PLD * 2);
    L.ptr = L.stage + dev_smem_round((size_t)AD_TE * ad_stage_stride(hd));
    L.fmt = L.ptr + dev_smem_round(2 * AD_TE * sizeof(void *));
    L.lut = L.fmt + dev_smem_round(2 * AD_TE);
    L.head = L.lut + dev_smem_round((256 + 16) * 4);
    L.misc = L.head + dev_smem_round(4 * AD_HG * 4);
    L.total = L.misc + dev_smem_round(16 * 4);
    return L;
}

/* ---- device helpers ---- */

__device__ __forceinline__ uint32_t ad_pack(float a, float b)
{
    return (uint32_t)dev_f32_to_bf16(a) | (uint32_t)dev_f32_to_bf16(b) << 16;
}

/* Where a row's window slots come from. */
typedef struct ad_win {
    int64_t first;              /* position of window slot 0 */
    int64_t pos;                /* the row's position */
    uint32_t n_win;             /* filled window slots */
    uint32_t n_ring;            /* draft block: ring slots before the block's rows */
    uint32_t slots;             /* window slots (filled or not) */
} ad_win;

__device__ __forceinline__ ad_win ad_window(const cuda_attn_args &a, const cuda_seq &s, uint32_t t)
{
    ad_win w;
    w.pos = s.pos0 + ((int64_t)t - s.row0);
    w.n_ring = 0;
    if (s.ring_hi >= 0) {
        w.first = s.ring_hi - (int64_t)a.window + 1 < 0 ? 0 : s.ring_hi - (int64_t)a.window + 1;
        w.n_ring = (uint32_t)(s.ring_hi - w.first + 1);
        w.n_win = w.n_ring + s.n_rows;
        w.slots = w.n_win;
    } else {
        int64_t lo = w.pos - (int64_t)a.window + 1;
        if (lo < 0)
            lo = 0;
        if (s.window_lo > 0 && w.pos >= s.window_lo && lo < s.window_lo)
            lo = s.window_lo;
        w.first = lo;
        w.n_win = (uint32_t)(w.pos - lo + 1);
        w.slots = a.window;
    }
    return w;
}

/* The entry of key slot i of row t (NULL: an empty slot); *fmt 0 ring format, 1 compressed. */
__device__ __forceinline__ const uint8_t *ad_slot(const cuda_attn_args &a, const cuda_seq &s,
                                                  const ad_win &w, uint32_t t, uint32_t i,
                                                  uint8_t *fmt)
{
    const size_t eb = (size_t)a.head_dim + a.head_dim / 32;
    *fmt = 0;
    if (i < w.slots) {
        if (i >= w.n_win)
            return NULL;
        if (s.ring_hi >= 0 && i >= w.n_ring)
            return a.local + (size_t)(s.row0 + i - w.n_ring) * eb;
        int64_t pos = w.first + i;
        if (s.ring_hi < 0 && pos >= s.pos0)
            return a.local + (size_t)(s.row0 + (pos - s.pos0)) * eb;
        return s.slot + a.ring_offset + (size_t)((uint64_t)pos % a.ring_positions) * eb;
    }
    uint32_t j = i - w.slots;
    if (!a.topk || j >= a.topk_n)
        return NULL;
    int32_t id = a.topk[(size_t)t * a.topk_n + j];
    *fmt = 1;
    return id < 0 ? NULL : cuda_entry_addr(a.blocks, a.block_bytes, a.per_block, a.main_offset,
                                           a.main_entry_bytes, &s, a.tables, id);
}

/* Decodes entries [0, n_pad) of the tile into Ks [AD_TE][ld] bf16 (zero rows from n on):
 * sixteen numbers per thread and step, from the staged copy (fmt bit 1) or from global memory
 * (16-byte loads where the entry is aligned). fmt bit 0: the format (0 ring, 1 compressed). */
__device__ void ad_decode(const uint8_t *const *ptr, const uint8_t *fmt, const uint8_t *stage,
                          uint32_t sstride, uint32_t n, uint32_t n_pad, uint32_t hd, uint16_t *Ks,
                          uint32_t ld, const float *lut8, const float *lut4)
{
    const uint32_t chunks = hd / 16;
    for (uint32_t i = threadIdx.x; i < n_pad * chunks; i += blockDim.x) {
        const uint32_t e = i / chunks, c = (i % chunks) * 16;
        uint32_t w[8] = {0u, 0u, 0u, 0u, 0u, 0u, 0u, 0u};
        if (e < n) {
            const uint8_t *src = (fmt[e] & 2u) ? stage + (size_t)e * sstride : ptr[e];
            if ((fmt[e] & 1u) == 0) {
                const float sc = dev_ue8m0_decode(src[hd + c / 32]);
                uint8_t b[16];
                if (((uintptr_t)(src + c) & 15u) == 0) {
                    *reinterpret_cast<uint4 *>(b) = *reinterpret_cast<const uint4 *>(src + c);
                } else {
#pragma unroll
                    for (int k = 0; k < 16; k++)
                        b[k] = src[c + k];
                }
#pragma unroll
                for (int k = 0; k < 8; k++)
                    w[k] = ad_pack(lut8[b[2 * k]] * sc, lut8[b[2 * k + 1]] * sc);
            } else {
                const float sc = lut8[src[hd / 2 + c / 16]];
                uint8_t b[8];
                if (((uintptr_t)(src + c / 2) & 7u) == 0) {
                    *reinterpret_cast<uint2 *>(b) = *reinterpret_cast<const uint2 *>(src + c / 2);
                } else {
#pragma unroll
                    for (int k = 0; k < 8; k++)
                        b[k] = src[c / 2 + k];
                }
#pragma unroll
                for (int k = 0; k < 8; k++)
                    w[k] = ad_pack(lut4[b[k] & 15u] * sc, lut4[b[k] >> 4] * sc);
            }
        }
        uint4 *dst = reinterpret_cast<uint4 *>(Ks + (size_t)e * ld + c);
        dst[0] = make_uint4(w[0], w[1], w[2], w[3]);
        dst[1] = make_uint4(w[4], w[5], w[6], w[7]);
    }
}

/* Tile k of slots [lo, hi): the split's part of one 64-slot block. */
__device__ __forceinline__ void ad_tile(uint32_t lo, uint32_t hi, uint32_t k, uint32_t *b0,
                                        uint32_t *b1)
{
    const uint32_t first = (lo / AD_TE + k) * AD_TE, last = first + AD_TE;
    *b0 = k == 0 ? lo : first;
    *b1 = last < hi ? last : hi;
}

/* Warps 0 and 1: the entries of slots [b0, b1) compacted in slot order into ptr, fmt (bit 1
 * set where the entry is copied to the stage: 16-byte aligned and of a whole number of 16-byte
 * chunks) and misc[2] = their count. */
__device__ void ad_entries(const cuda_attn_args &a, const cuda_seq &s, const ad_win &w, uint32_t t,
                           uint32_t b0, uint32_t b1, const uint8_t **ptr, uint8_t *fmt,
                           uint32_t *misc)
{
    const uint32_t warp = threadIdx.x / 32, lane = threadIdx.x % 32, hd = a.head_dim;
    uint8_t f = 0;
    const uint8_t *src = b0 + threadIdx.x < b1 ? ad_slot(a, s, w, t, b0 + threadIdx.x, &f) : NULL;
    if (src) {
        const uint32_t bytes = f ? hd / 2 + hd / 16 : hd + hd / 32;
        if (((uintptr_t)src & 15u) == 0 && bytes % 16 == 0)
            f |= 2u;
    }
    unsigned m = __ballot_sync(0xffffffffu, src != NULL);
    if (lane == 0)
        misc[warp] = (uint32_t)__popc(m);
    asm volatile("bar.sync 1, 64;\n" ::: "memory");
    uint32_t at = (warp ? misc[0] : 0u) + (uint32_t)__popc(m & ((1u << lane) - 1u));
    if (src) {
        ptr[at] = src;
        fmt[at] = f;
    }
    if (threadIdx.x == 0)
        misc[2] = misc[0] + misc[1];
}

/* All threads: cp.async of the staged entries of a tile (16-byte chunks). */
__device__ void ad_stage_copy(const uint8_t *const *ptr, const uint8_t *fmt, uint32_t n,
                              uint32_t hd, uint8_t *stage, uint32_t sstride)
{
    const uint32_t per = sstride / 16;
    for (uint32_t i = threadIdx.x; i < n * per; i += blockDim.x) {
        const uint32_t e = i / per, k = i % per;
        if (!(fmt[e] & 2u))
            continue;
        const uint32_t bytes = (fmt[e] & 1u) ? hd / 2 + hd / 16 : hd + hd / 32;
        if (k * 16 < bytes)
            dev_cp16(stage + (size_t)e * sstride + k * 16, ptr[e] + k * 16);
    }
    dev_cp_commit();
}

/* ---- kernels ---- */

__global__ void __launch_bounds__(AD_THREADS, 1)
attn_tile_kernel(cuda_attn_args a)
{
    extern __shared__ __align__(128) uint8_t ad_smem_buf[];
    const uint32_t lr = blockIdx.x, split = blockIdx.y, h0 = blockIdx.z * AD_HG;
    const uint32_t t = a.rows ? (uint32_t)a.rows[lr] : lr; /* lr: the row of the launch */
    const cuda_seq s = a.seqs[a.row_seq[t]];
    const uint32_t hd = a.head_dim, ld = hd + 8;
    const uint32_t warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const uint32_t nh = a.n_heads - h0 < AD_HG ? a.n_heads - h0 : AD_HG, n_mt = (nh + 15) / 16;
    const ad_smem L = ad_layout(hd);
    uint16_t *Qs = (uint16_t *)(ad_smem_buf + L.q), *Ks = (uint16_t *)(ad_smem_buf + L.k);
    float *S = (float *)(ad_smem_buf + L.s);
    uint16_t *P = (uint16_t *)(ad_smem_buf + L.p);
    uint8_t *stage = ad_smem_buf + L.stage;
    const uint32_t sstride = ad_stage_stride(hd);
    const uint8_t **ptrs = (const uint8_t **)(ad_smem_buf + L.ptr); /* [2][AD_TE] */
    uint8_t *fmts = ad_smem_buf + L.fmt;                           /* [2][AD_TE] */
    float *lut8 = (float *)(ad_smem_buf + L.lut), *lut4 = lut8 + 256;
    float *m_run = (float *)(ad_smem_buf + L.head), *l_run = m_run + AD_HG;
    float *alpha_s = l_run + AD_HG, *den = alpha_s + AD_HG;
    uint32_t *miscs = (uint32_t *)(ad_smem_buf + L.misc);          /* [2][4] */

    for (uint32_t i = threadIdx.x; i < 256 + 16; i += blockDim.x)
        lut8[i] = i < 256 ? dev_e4m3_decode((uint8_t)i) : dev_e2m1_decode((uint8_t)(i - 256));
    {   /* the row's queries of the group, 16 bytes at a time where q is aligned; zero rows
         * past the last head */
        const uint32_t per = hd / 8;
        const uint16_t *qr = a.q + ((size_t)t * a.n_heads + h0) * hd;
        const bool vec = ((uintptr_t)a.q & 15u) == 0;
        for (uint32_t i = threadIdx.x; i < AD_HG * per; i += blockDim.x) {
            uint32_t h = i / per, c = i % per;
            uint4 v = make_uint4(0u, 0u, 0u, 0u);
            if (h < nh && vec) {
                v = __ldg(reinterpret_cast<const uint4 *>(qr + (size_t)h * hd) + c);
            } else if (h < nh) {
                const uint16_t *e = qr + (size_t)h * hd + c * 8;
                v = make_uint4(e[0] | (uint32_t)e[1] << 16, e[2] | (uint32_t)e[3] << 16,
                               e[4] | (uint32_t)e[5] << 16, e[6] | (uint32_t)e[7] << 16);
            }
            *reinterpret_cast<uint4 *>(Qs + (size_t)h * ld + c * 8) = v;
        }
    }
    if (threadIdx.x < AD_HG) {
        m_run[threadIdx.x] = -1e30f;
        l_run[threadIdx.x] = 0.0f;
    }
    const ad_win w = ad_window(a, s, t);
    const uint32_t n_slots = w.slots + (a.topk ? a.topk_n : 0);
    const uint32_t lo = split * a.chunk;
    const uint32_t hi = lo + a.chunk < n_slots ? lo + a.chunk : n_slots;

    const uint32_t mt = warp % 4, ng = warp / 4;  /* the warp's heads and column (entry) group */
    float acc[AD_NT][4];
#pragma unroll
    for (int j = 0; j < AD_NT; j++)
        acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.0f;
    __syncthreads();

    /* tiles: the split's parts of 64-slot blocks; tile k+1's addresses are found during tile
     * k's scores and its entries copied (cp.async) during tile k's softmax and values */
    const uint32_t n_tiles = hi > lo ? (hi - 1) / AD_TE - lo / AD_TE + 1 : 0;
    if (n_tiles > 0) {
        uint32_t b0, b1;
        ad_tile(lo, hi, 0, &b0, &b1);
        if (threadIdx.x < 64)
            ad_entries(a, s, w, t, b0, b1, ptrs, fmts, miscs);
        __syncthreads();
        ad_stage_copy(ptrs, fmts, miscs[2], hd, stage, sstride);
    }
    for (uint32_t k = 0; k < n_tiles; k++) {
        const uint32_t cur = k & 1u, nxt = cur ^ 1u;
        const uint8_t **ptr = ptrs + cur * AD_TE;
        const uint8_t *fmt = fmts + cur * AD_TE;
        dev_cp_wait_all();
        __syncthreads();
        const uint32_t n_e = miscs[cur * 4 + 2], n_pad = (n_e + 15) / 16 * 16;
        /* 1. the tile's entries in bf16 (an empty tile changes nothing: the twin's alpha is 1,
         *    its sum 0) */
        if (n_e)
            ad_decode(ptr, fmt, stage, sstride, n_e, n_pad, hd, Ks, ld, lut8, lut4);
        __syncthreads();
        if (k + 1 < n_tiles && threadIdx.x < 64) {
            uint32_t b0, b1;
            ad_tile(lo, hi, k + 1, &b0, &b1);
            ad_entries(a, s, w, t, b0, b1, ptrs + nxt * AD_TE, fmts + nxt * AD_TE, miscs + nxt * 4);
        }

        /* 2. S = Q K^T: warp (mt, ng) takes heads mt*16.. and entries ng*16.. */
        if (n_e && mt < n_mt && ng * 16 < n_pad) {
            float c0[4] = {0.f, 0.f, 0.f, 0.f}, c1[4] = {0.f, 0.f, 0.f, 0.f};
            const uint16_t *qa = Qs + (size_t)(mt * 16 + (lane & 15)) * ld + (lane >> 4) * 8;
            const uint16_t *kb = Ks + (size_t)(ng * 16 + (lane & 7) + ((lane >> 4) << 3)) * ld +
                                 ((lane >> 3) & 1) * 8;
            for (uint32_t kk = 0; kk < hd; kk += 16) {
                uint32_t fa[4], fb[4];
                dev_ldm_x4(fa, qa + kk);
                dev_ldm_x4(fb, kb + kk);
                dev_mma_bf16(c0, fa, fb[0], fb[1]);
                dev_mma_bf16(c1, fa, fb[2], fb[3]);
            }
            const uint32_t r = mt * 16 + lane / 4, cc = ng * 16 + (lane % 4) * 2;
            float *s0 = S + (size_t)r * AD_SLD + cc, *s1 = s0 + 8 * AD_SLD;
            s0[0] = __fmul_rn(c0[0], a.scale), s0[1] = __fmul_rn(c0[1], a.scale);
            s1[0] = __fmul_rn(c0[2], a.scale), s1[1] = __fmul_rn(c0[3], a.scale);
            s0[8] = __fmul_rn(c1[0], a.scale), s0[9] = __fmul_rn(c1[1], a.scale);
            s1[8] = __fmul_rn(c1[2], a.scale), s1[9] = __fmul_rn(c1[3], a.scale);
        }
        __syncthreads();
        if (k + 1 < n_tiles) /* the stage was read by the decode above */
            ad_stage_copy(ptrs + nxt * AD_TE, fmts + nxt * AD_TE, miscs[nxt * 4 + 2], hd, stage,
                          sstride);

        /* 3. the blockwise softmax step: 8 threads per head */
        if (n_e) {
            const uint32_t h = threadIdx.x / 8, sub = threadIdx.x % 8;
            const float *Sh = S + (size_t)h * AD_SLD;
            const float m_old = m_run[h];
            float mb = m_old;
            for (uint32_t e = sub; e < n_e; e += 8)
                mb = Sh[e] > mb ? Sh[e] : mb;
#pragma unroll
            for (int off = 4; off > 0; off /= 2) {
                float o = __shfl_xor_sync(0xffffffffu, mb, off);
                mb = o > mb ? o : mb;
            }
            double psum = 0.0;
            for (uint32_t e = sub; e < n_pad; e += 8) {
                float p = e < n_e ? (float)exp((double)__fsub_rn(Sh[e], mb)) : 0.0f;
                P[(size_t)h * AD_PLD + e] = dev_f32_to_bf16(p);
                psum += p;
            }
#pragma unroll
            for (int off = 4; off > 0; off /= 2)
                psum += __shfl_xor_sync(0xffffffffu, psum, off);
            if (sub == 0) {
                const float al = (float)exp((double)__fsub_rn(m_old, mb));
                alpha_s[h] = al;
                l_run[h] = __fadd_rn(__fmul_rn(l_run[h], al), (float)psum);
                m_run[h] = mb;
            }
        }
        __syncthreads();

        /* 4. O = O * alpha + P V: warp (mt, ng) owns heads mt*16.. and columns ng*128.. */
        if (n_e && mt < n_mt && ng * AD_NT * 8 < hd) {
            const uint32_t r = mt * 16 + lane / 4;
            const float a0 = alpha_s[r], a1 = alpha_s[r + 8];
#pragma unroll
            for (int j = 0; j < AD_NT; j++) {
                acc[j][0] *= a0, acc[j][1] *= a0;
                acc[j][2] *= a1, acc[j][3] *= a1;
            }
            const uint16_t *pa = P + (size_t)(mt * 16 + (lane & 15)) * AD_PLD + (lane >> 4) * 8;
            const uint16_t *vb = Ks + (size_t)((lane & 7) + ((lane >> 3) & 1) * 8) * ld +
                                 ng * AD_NT * 8 + (lane >> 4) * 8;
            for (uint32_t kk = 0; kk < n_pad; kk += 16) {
                uint32_t fa[4];
                dev_ldm_x4(fa, pa + kk);
#pragma unroll
                for (int jp = 0; jp < AD_NT / 2; jp++) {
                    if (ng * AD_NT * 8 + jp * 16 < hd) {
                        uint32_t fb[4];
                        dev_ldm_x4_t(fb, vb + (size_t)kk * ld + jp * 16);
                        dev_mma_bf16(acc[2 * jp], fa, fb[0], fb[1]);
                        dev_mma_bf16(acc[2 * jp + 1], fa, fb[2], fb[3]);
                    }
                }
            }
        }
    }
    dev_cp_wait_all();
    __syncthreads();

    /* finish the row, or leave the split's (O, m, l) to the combine */
    if (!a.part && threadIdx.x < AD_HG) {
        const uint32_t h = threadIdx.x;
        const float sk = h < nh ? a.sink[h0 + h] : 0.0f;
        den[h] = __fadd_rn(l_run[h], (float)exp((double)__fsub_rn(sk, m_run[h])));
    }
    if (a.part && threadIdx.x < nh) {
        float *ml = a.ml + (((size_t)lr * a.n_split + split) * a.n_heads + h0 + threadIdx.x) * 2;
        ml[0] = m_run[threadIdx.x];
        ml[1] = l_run[threadIdx.x];
    }
    __syncthreads();
    if (mt >= n_mt || ng * AD_NT * 8 >= hd)
        return;
#pragma unroll
    for (int j = 0; j < AD_NT; j++) {
        const uint32_t col = ng * AD_NT * 8 + j * 8 + (lane % 4) * 2;
        if (col >= hd)
            break;
#pragma unroll
        for (int half = 0; half < 2; half++) {
            const uint32_t h = mt * 16 + lane / 4 + half * 8;
            if (h >= nh)
                continue;
            const float x0 = acc[j][2 * half], x1 = acc[j][2 * half + 1];
            if (a.part) {
                float *o = a.part + (((size_t)lr * a.n_split + split) * a.n_heads + h0 + h) * hd + col;
                *reinterpret_cast<float2 *>(o) = make_float2(x0, x1);
            } else {
                uint16_t *o = a.out + ((size_t)t * a.n_heads + h0 + h) * hd + col;
                const uint32_t v = ad_pack(__fdiv_rn(x0, den[h]), __fdiv_rn(x1, den[h]));
                if (((uintptr_t)o & 3u) == 0) {
                    *reinterpret_cast<uint32_t *>(o) = v;
                } else {
                    o[0] = (uint16_t)v;
                    o[1] = (uint16_t)(v >> 16);
                }
            }
        }
    }
}

/* One block per (row, head): the splits combined in split order (the factors computed once
 * per split). */
__global__ void __launch_bounds__(AD_COMBINE_THREADS)
attn_combine_kernel(cuda_attn_args a)
{
    __shared__ float f[AD_MAX_SPLIT];
    __shared__ float l_s;
    const uint32_t lr = blockIdx.x, h = blockIdx.y, hd = a.head_dim;
    const uint32_t t = a.rows ? (uint32_t)a.rows[lr] : lr;
    const float *ml = a.ml + ((size_t)lr * a.n_split * a.n_heads + h) * 2;
    const size_t sstride = (size_t)a.n_heads * 2;
    float M = -1e30f;
    for (uint32_t j = 0; j < a.n_split; j++)
        M = ml[j * sstride] > M ? ml[j * sstride] : M;
    for (uint32_t j = threadIdx.x; j < a.n_split; j += blockDim.x)
        f[j] = (float)exp((double)__fsub_rn(ml[j * sstride], M));
    __syncthreads();
    if (threadIdx.x == 0) {
        float l = 0.0f;
        for (uint32_t j = 0; j < a.n_split; j++)
            l = __fadd_rn(l, __fmul_rn(ml[j * sstride + 1], f[j]));
        l_s = __fadd_rn(l, (float)exp((double)__fsub_rn(a.sink[h], M)));
    }
    __syncthreads();
    const float l = l_s;
    const float *part = a.part + ((size_t)lr * a.n_split * a.n_heads + h) * hd;
    const size_t pstride = (size_t)a.n_heads * hd;
    for (uint32_t d = threadIdx.x; d < hd; d += blockDim.x) {
        float o = 0.0f;
        for (uint32_t j = 0; j < a.n_split; j++)
            o = __fadd_rn(o, __fmul_rn(part[j * pstride + d], f[j]));
        a.out[((size_t)t * a.n_heads + h) * hd + d] = dev_f32_to_bf16(__fdiv_rn(o, l));
    }
}

/* ---- host side ---- */

/* A launch over some of the call's rows. */
typedef struct ad_plan {
    uint32_t rows;              /* rows of the launch */
    uint32_t slots;             /* key slots of its largest row */
    uint32_t chunk, n_split;
    size_t scratch;             /* bytes of the splits' partial sums (0: one split) */
} ad_plan;

/* Key slots of a row of sequence s. */
static uint64_t ad_seq_slots(const kern_sparse_attn *p, const kern_seq *s)
{
    uint64_t win = p->window;
    if (s->ring_hi >= 0) {
        int64_t first = s->ring_hi - (int64_t)p->window + 1 < 0 ? 0 : s->ring_hi - (int64_t)p->window + 1;
        win = (uint64_t)(s->ring_hi - first + 1) + s->n_rows;
    }
    return win + (p->topk ? p->topk_n : 0);
}

/* Sequence s in class cls: 0 every sequence, 1 decode (at most CUDA_ATTN_DECODE_ROWS rows),
 * 2 prefill (more). */
static int ad_in_class(const kern_seq *s, int cls)
{
    return s->n_rows > 0 && (cls == 0 || (cls == 1) == (s->n_rows <= CUDA_ATTN_DECODE_ROWS));
}

/* The rows and largest slot count of class cls, and its splits: `chunk` slots a split (0:
 * about one CTA per SM; UINT32_MAX: one split). */
static void ad_plan_class(cuda_ctx *c, const kern_sparse_attn *p, int cls, uint32_t chunk,
                          ad_plan *pl)
{
    memset(pl, 0, sizeof(*pl));
    uint64_t mx = 0;
    for (uint32_t i = 0; i < p->n_seqs; i++) {
        if (!ad_in_class(&p->seqs[i], cls))
            continue;
        pl->rows += p->seqs[i].n_rows;
        uint64_t n = ad_seq_slots(p, &p->seqs[i]);
        mx = n > mx ? n : mx;
    }
    pl->slots = (uint32_t)mx; /* attn.cu bounds it */
    const uint32_t units = (pl->slots + AD_SPLIT_UNIT - 1) / AD_SPLIT_UNIT;
    if (chunk == UINT32_MAX) {
        pl->chunk = units ? units * AD_SPLIT_UNIT : AD_SPLIT_UNIT;
    } else if (chunk) {
        pl->chunk = chunk;
    } else {
        const uint32_t groups = (p->n_heads + AD_HG - 1) / AD_HG;
        const uint32_t sms = (uint32_t)cuda_device_attr(c, cudaDevAttrMultiProcessorCount, &c->sm_count, 132);
        const uint32_t most = (pl->slots + AD_MIN_SPLIT - 1) / AD_MIN_SPLIT;
        uint64_t want = sms / ((uint64_t)pl->rows * groups);
        want = want > most ? most : want;
        want = want < 1 ? 1 : want;
        pl->chunk = units ? (uint32_t)((units + want - 1) / want) * AD_SPLIT_UNIT : AD_SPLIT_UNIT;
    }
    pl->n_split = pl->slots ? (pl->slots + pl->chunk - 1) / pl->chunk : 1;
    if (pl->n_split > AD_MAX_SPLIT) {
        pl->chunk = (pl->slots + AD_MAX_SPLIT - 1) / AD_MAX_SPLIT;
        pl->chunk = (pl->chunk + AD_SPLIT_UNIT - 1) / AD_SPLIT_UNIT * AD_SPLIT_UNIT;
        pl->n_split = (pl->slots + pl->chunk - 1) / pl->chunk;
    }
    pl->scratch = pl->n_split > 1 ? (size_t)pl->rows * pl->n_split * p->n_heads *
                                        ((size_t)p->head_dim + 2) * 4 + 256
                                  : 0;
}

/* Queues the tile kernel (and the combine of the splits) over the launch's rows. */
static di_status ad_launch(cuda_ctx *c, const kern_sparse_attn *p, cuda_attn_args a,
                           const ad_plan *pl, const int32_t *rows, uint8_t *scratch)
{
    a.rows = rows;
    a.chunk = pl->chunk, a.n_split = pl->n_split;
    if (pl->n_split > 1) {
        a.part = (float *)scratch;
        a.ml = a.part + (size_t)pl->rows * pl->n_split * p->n_heads * p->head_dim;
    }
    const ad_smem L = ad_layout(p->head_dim);
    dim3 grid(pl->rows, pl->n_split, (p->n_heads + AD_HG - 1) / AD_HG);
    cuda_launch(c, "attn_tile_kernel", attn_tile_kernel, grid, AD_THREADS, L.total, c->stream, a);
    di_status st = cuda_launched(c, "attn_tile_kernel");
    if (st != DI_OK || pl->n_split == 1)
        return st;
    cuda_launch(c, "attn_combine_kernel", attn_combine_kernel, dim3(pl->rows, p->n_heads),
                AD_COMBINE_THREADS, 0, c->stream, a);
    return cuda_launched(c, "attn_combine_kernel");
}

di_status cuda_attn_tiles(cuda_ctx *c, const kern_sparse_attn *p)
{
    const ad_smem L = ad_layout(p->head_dim);
    if (L.total > (size_t)cuda_device_attr(c, cudaDevAttrMaxSharedMemoryPerBlockOptin,
                                           &c->smem_optin, 48 * 1024))
        return cuda_fail(c, DI_EUNSUPPORTED, "sparse_attn: head_dim %u needs %zu bytes of shared "
                         "memory a block, more than the device has", p->head_dim, L.total);
    di_status st = cuda_check(c, cudaFuncSetAttribute(attn_tile_kernel,
                                                      cudaFuncAttributeMaxDynamicSharedMemorySize,
                                                      (int)L.total),
                              "sparse_attn: cudaFuncSetAttribute");
    if (st != DI_OK)
        return st;
    /* the launches: every row, or in batch-invariant mode each class of rows on its own plan */
    ad_plan pl[2];
    int cls[2], n_l = 0;
    if (c->batch_invariant) {
        ad_plan_class(c, p, 1, CUDA_ATTN_BI_CHUNK, &pl[n_l]);
        if (pl[n_l].rows)
            cls[n_l++] = 1;
        ad_plan_class(c, p, 2, UINT32_MAX, &pl[n_l]);
        if (pl[n_l].rows)
            cls[n_l++] = 2;
    } else {
        ad_plan_class(c, p, 0, 0, &pl[0]);
        cls[n_l++] = 0;
    }
    size_t scratch = 0;
    for (int k = 0; k < n_l; k++) /* the launches run in turn on the stream: one scratch */
        scratch = pl[k].scratch > scratch ? pl[k].scratch : scratch;
    cuda_meta_reset(c);
    size_t seq_off = 0, table_off = 0, rs_off = 0, list_off[2] = {0, 0};
    if ((st = cuda_meta_seqs(c, "sparse_attn", p->seqs, p->n_seqs, p->n_rows, &seq_off,
                             &table_off, &rs_off)) != DI_OK)
        return st;
    for (int k = 0; n_l > 1 && k < n_l; k++) /* a launch over part of the rows: its list */
        if ((st = cuda_meta_push(c, NULL, (size_t)pl[k].rows * 4, &list_off[k])) != DI_OK)
            return st;
    for (int k = 0; n_l > 1 && k < n_l; k++) {
        int32_t *list = (int32_t *)cuda_meta_at(c, list_off[k]);
        uint32_t n = 0;
        for (uint32_t i = 0; i < p->n_seqs; i++)
            if (ad_in_class(&p->seqs[i], cls[k]))
                for (uint32_t j = 0; j < p->seqs[i].n_rows; j++)
                    list[n++] = (int32_t)(p->seqs[i].row0 + j);
    }
    uint8_t *dev = NULL, *part = NULL;
    if ((st = cuda_meta_upload(c, 0, scratch, &dev, &part)) != DI_OK)
        return st;
    cuda_attn_args a;
    cuda_attn_args_init(&a, p, dev, seq_off, table_off, rs_off);
    for (int k = 0; k < n_l && st == DI_OK; k++)
        st = ad_launch(c, p, a, &pl[k], n_l > 1 ? (const int32_t *)(dev + list_off[k]) : NULL,
                       part);
    return st;
}
