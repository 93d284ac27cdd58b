/* attn.cu: sparse attention with a learned sink (kern_sparse_attn, MODEL.md §2.5 steps 5-8; C
 * twin: kernels/cpu/ops_attn.c): the op's entry (its checks) and the kernel it ran before the
 * tile kernel of attn_decode.cu, which now takes every row, decode and prefill alike. This
 * kernel runs only under kern_cuda_config.attn_old, which check_attn holds to the twin on every
 * case and times against the tile kernel in the same run; it covers nothing the tile kernel does
 * not (the tile kernel has no key-slot limit, takes any q and out alignment). Key set of row t
 * of sequence s at position p: the window positions (this step's entries from `local`, older
 * ones from the sequence's ring, or for a draft block the ring up to ring_hi and every row of
 * the block) and the compressed entries of the row's top-k list, read from the paged blocks.
 * Keys are values (MQA over one latent).
 *
 * One CTA per (row, group of ATTN_HG = 16 heads), ATTN_WARPS warps, tensor cores through WMMA
 * (bf16 operands, fp32 accumulation):
 *  1. the row's entry list (addresses, formats and the 64-slot block of each entry's key slot)
 *     in shared memory; top-k ids of -1 and ids past the block table are dropped (the twin
 *     keeps -1 as empty slots and asserts the rest);
 *  2. scores: for each tile of ATTN_TE entries, the entries are decoded into bf16 (E4M3 x UE8M0
 *     ring entries and E2M1 x E4M3 compressed entries are exact in bf16) and S = Q K^T is one
 *     16 x 16 tile per warp; s = fp32(S * scale);
 *  3. softmax with the sink, the reference kernel's rounding (MODEL.md §2.5 (a)-(d)): m_b = the
 *     running max (from -1e30) after key-slot block b, M the last; p = fp32 exp(s - m_b) for
 *     an entry of block b, weight w = bf16(p) * exp(m_b - M) (the rescalings the blockwise
 *     walk applies later, as one factor), denominator sum p * exp(m_b - M) + exp(sink - M);
 *     w is split into w_hi = bf16(w) and w_lo = bf16(w - w_hi): with one block (or a max that
 *     the first block already holds) w = bf16(p) exactly and w_lo = 0;
 *  4. O = w_hi V + w_lo V, the tiles decoded again; out = bf16(O / denominator).
 * Against the twin (blockwise fp32 walk, exp in double): the dot products are exact products
 * summed in fp32 in another order, the rescaling chain is one fp32 factor, and a weight carries
 * ~2^-16 relative error where the max moved between blocks; outputs agree well within
 * kernels.h's abs 2e-2 and cosine 0.9999 per head. Each row's arithmetic does not depend on
 * the other rows of the call. */
#include <assert.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <math.h>
#include <mma.h>
#include <stdint.h>
#include <string.h>

#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/cuda_internal.h"
#include "kernels/cuda/mma_dev.cuh"
#include "kernels/cuda/numfmt_dev.cuh"

using namespace nvcuda;

#define ATTN_HG 16                            /* heads per CTA: the WMMA tile's rows */
#define ATTN_TE 64                            /* entries decoded per tile */
#define ATTN_WARPS 8
#define ATTN_THREADS (ATTN_WARPS * 32)
#define ATTN_QK_WARPS (ATTN_TE / 16)          /* warps computing one tile's scores */
#define ATTN_MAX_HD 512
#define ATTN_MAX_NJ (ATTN_MAX_HD / 16 / ATTN_WARPS) /* output column tiles per warp */
#define ATTN_LANES (ATTN_THREADS / ATTN_HG)   /* softmax lanes per head */
#define ATTN_SMEM_LIMIT (227 * 1024)
#define ATTN_BLOCK 64                         /* key slots per softmax block */
#define ATTN_MAX_BLK 128                      /* blocks per row at most (fmt holds 7 bits) */

typedef wmma::fragment<wmma::matrix_a, 16, 16, 16, __nv_bfloat16, wmma::row_major> frag_a;
typedef wmma::fragment<wmma::matrix_b, 16, 16, 16, __nv_bfloat16, wmma::col_major> frag_bt;
typedef wmma::fragment<wmma::matrix_b, 16, 16, 16, __nv_bfloat16, wmma::row_major> frag_b;
typedef wmma::fragment<wmma::accumulator, 16, 16, 16, float> frag_c;

/* Byte offsets of the shared buffers for a head width and entry capacity. */
typedef struct attn_smem {
    size_t q, k, s, ph, pl, ptr, fmt, lut, blk, misc, total;
} attn_smem;

static __host__ __device__ attn_smem attn_layout(uint32_t hd, uint32_t ne_pad)
{
    attn_smem L;
    size_t ldq = (size_t)hd + 8;
    L.q = 0;
    L.k = L.q + dev_smem_round(ATTN_HG * ldq * 2);
    L.s = L.k + dev_smem_round(ATTN_TE * ldq * 2);
    L.ph = L.s + dev_smem_round((size_t)ATTN_HG * ne_pad * 4);
    L.pl = L.ph + dev_smem_round((size_t)ATTN_HG * ne_pad * 2);
    L.ptr = L.pl + dev_smem_round((size_t)ATTN_HG * ne_pad * 2);
    L.fmt = L.ptr + dev_smem_round((size_t)ne_pad * sizeof(void *));
    L.lut = L.fmt + dev_smem_round(ne_pad);
    L.blk = L.lut + dev_smem_round((256 + 16) * 4);
    L.misc = L.blk + dev_smem_round(((size_t)ATTN_HG * ATTN_MAX_BLK + ATTN_MAX_BLK + 1) * 4);
    L.total = L.misc + dev_smem_round((ATTN_HG + 8) * 4);
    return L;
}

/* ---- device helpers ---- */

__device__ __forceinline__ uint32_t pack_bf16(float a, float b)
{
    return (uint32_t)dev_f32_to_bf16(a) | (uint32_t)dev_f32_to_bf16(b) << 16;
}

/* Decodes entries e0 .. e0 + ATTN_TE - 1 of the list into Ks [ATTN_TE][ldq] bf16 (zeros past
 * n_ent). Format (fmt bit 0) 0: ring entry (hd E4M3, hd/32 UE8M0); 1: compressed (hd/2 packed
 * E2M1, hd/16 E4M3). Eight numbers per thread and step. */
__device__ void decode_tile(const uint8_t *const *ptr, const uint8_t *fmt, uint32_t e0,
                            uint32_t n_ent, uint32_t hd, uint16_t *Ks, uint32_t ldq,
                            const float *lut8, const float *lut4)
{
    const uint32_t chunks = hd / 8;
    for (uint32_t i = threadIdx.x; i < ATTN_TE * chunks; i += blockDim.x) {
        uint32_t e = i / chunks, c = (i % chunks) * 8;
        uint32_t w[4] = {0u, 0u, 0u, 0u};
        if (e0 + e < n_ent) {
            const uint8_t *src = ptr[e0 + e];
            if ((fmt[e0 + e] & 1u) == 0) {
                float s = dev_ue8m0_decode(src[hd + c / 32]);
#pragma unroll
                for (int k = 0; k < 4; k++)
                    w[k] = pack_bf16(lut8[src[c + 2 * k]] * s, lut8[src[c + 2 * k + 1]] * s);
            } else {
                float s = lut8[src[hd / 2 + c / 16]];
#pragma unroll
                for (int k = 0; k < 4; k++) {
                    uint32_t b = src[c / 2 + k];
                    w[k] = pack_bf16(lut4[b & 15u] * s, lut4[b >> 4] * s);
                }
            }
        }
        *reinterpret_cast<uint4 *>(Ks + (size_t)e * ldq + c) = make_uint4(w[0], w[1], w[2], w[3]);
    }
}

/* First window position row `pos` of sequence s reads (the twin's window_lo_of). */
__device__ __forceinline__ int64_t window_first(const cuda_attn_args &a, const cuda_seq &s, int64_t pos)
{
    int64_t lo = pos - (int64_t)a.window + 1;
    if (lo < 0)
        lo = 0;
    if (s.window_lo > 0 && pos >= s.window_lo && lo < s.window_lo)
        lo = s.window_lo;
    return lo;
}

/* The row's entry list: window entries (threads in parallel), then the valid top-k ids
 * compacted in list order by warp 0. fmt[i] = format | block << 1, block = the entry's key
 * slot / ATTN_BLOCK: window slots first (a normal row's window takes `window` slots, empty ones
 * included), then one slot per top-k position, -1 included. Returns the entry count (all
 * threads). */
__device__ uint32_t build_entries(const cuda_attn_args &a, uint32_t t, const uint8_t **ptr,
                                  uint8_t *fmt, uint32_t *misc)
{
    const cuda_seq s = a.seqs[a.row_seq[t]];
    const size_t eb = (size_t)a.head_dim + a.head_dim / 32;
    const int64_t pos = s.pos0 + ((int64_t)t - s.row0);
    int64_t first;                            /* position of the first window entry */
    uint32_t n_win, n_ring = 0;
    if (s.ring_hi >= 0) {
        first = s.ring_hi - (int64_t)a.window + 1 < 0 ? 0 : s.ring_hi - (int64_t)a.window + 1;
        n_ring = (uint32_t)(s.ring_hi - first + 1);
        n_win = n_ring + s.n_rows;
    } else {
        first = window_first(a, s, pos);
        n_win = (uint32_t)(pos - first + 1);
    }
    for (uint32_t i = threadIdx.x; i < n_win; i += blockDim.x) {
        const uint8_t *src;
        if (s.ring_hi >= 0 && i >= n_ring) {
            src = a.local + (size_t)(s.row0 + i - n_ring) * eb;
        } else {
            int64_t w = first + i;
            if (s.ring_hi < 0 && w >= s.pos0)
                src = a.local + (size_t)(s.row0 + (w - s.pos0)) * eb;
            else
                src = s.slot + a.ring_offset + (size_t)((uint64_t)w % a.ring_positions) * eb;
        }
        ptr[i] = src;
        fmt[i] = (uint8_t)(i / ATTN_BLOCK << 1);
    }
    if (threadIdx.x < 32) {
        const uint32_t lane = threadIdx.x;
        uint32_t n = 0;
        const uint32_t slot0 = s.ring_hi >= 0 ? n_win : a.window; /* first top-k slot */
        for (uint32_t i0 = 0; a.topk && i0 < a.topk_n; i0 += 32) {
            const uint8_t *src = NULL;
            if (i0 + lane < a.topk_n) {
                int32_t id = a.topk[(size_t)t * a.topk_n + i0 + lane];
                if (id >= 0)
                    src = cuda_entry_addr(a.blocks, a.block_bytes, a.per_block, a.main_offset,
                                          a.main_entry_bytes, &s, a.tables, id);
            }
            unsigned m = __ballot_sync(0xffffffffu, src != NULL);
            if (src) {
                uint32_t at = n_win + n + (uint32_t)__popc(m & ((1u << lane) - 1u));
                ptr[at] = src;
                fmt[at] = (uint8_t)(1u | (slot0 + i0 + lane) / ATTN_BLOCK << 1);
            }
            n += (uint32_t)__popc(m);
        }
        if (lane == 0)
            misc[0] = n_win + n;
    }
    __syncthreads();
    return misc[0];
}

/* ---- kernel ---- */

__global__ void __launch_bounds__(ATTN_THREADS)
sparse_attn_kernel(cuda_attn_args a)
{
    extern __shared__ __align__(128) uint8_t attn_smem_buf[];
    const uint32_t hd = a.head_dim, ldq = hd + 8, ne_pad = a.ne_pad;
    const uint32_t t = blockIdx.x, h0 = blockIdx.y * ATTN_HG;
    const uint32_t warp = threadIdx.x / 32;
    const attn_smem L = attn_layout(hd, ne_pad);
    uint16_t *Qs = (uint16_t *)(attn_smem_buf + L.q);
    uint16_t *Ks = (uint16_t *)(attn_smem_buf + L.k);
    float *S = (float *)(attn_smem_buf + L.s);
    uint16_t *Ph = (uint16_t *)(attn_smem_buf + L.ph), *Pl = (uint16_t *)(attn_smem_buf + L.pl);
    const uint8_t **ptr = (const uint8_t **)(attn_smem_buf + L.ptr);
    uint8_t *fmt = attn_smem_buf + L.fmt;
    float *lut8 = (float *)(attn_smem_buf + L.lut), *lut4 = lut8 + 256;
    float *runmax = (float *)(attn_smem_buf + L.blk);          /* [ATTN_HG][ATTN_MAX_BLK] */
    uint32_t *bstart = (uint32_t *)(runmax + ATTN_HG * ATTN_MAX_BLK); /* first entry of block */
    float *denom = (float *)(attn_smem_buf + L.misc);
    uint32_t *misc = (uint32_t *)(denom + ATTN_HG);

    /* decode tables, the row's queries (zero rows past the last head) */
    for (uint32_t i = threadIdx.x; i < 256 + 16; i += blockDim.x)
        lut8[i] = i < 256 ? dev_e4m3_decode((uint8_t)i) : dev_e2m1_decode((uint8_t)(i - 256));
    for (uint32_t i = threadIdx.x; i < ATTN_HG * hd; i += blockDim.x) {
        uint32_t h = i / hd, d = i % hd;
        Qs[h * ldq + d] = h0 + h < a.n_heads ? a.q[((size_t)t * a.n_heads + h0 + h) * hd + d] : 0;
    }
    const uint32_t n_ent = build_entries(a, t, ptr, fmt, misc);
    const uint32_t n_tiles = (n_ent + ATTN_TE - 1) / ATTN_TE;
    const uint32_t n_blk = n_ent ? (fmt[n_ent - 1] >> 1) + 1u : 0u;
    if (threadIdx.x == 0) { /* entries are in slot order: each block is a range of entries */
        uint32_t b = 0;
        for (uint32_t e = 0; e < n_ent; e++)
            while (b <= (uint32_t)(fmt[e] >> 1))
                bstart[b++] = e;
        while (b <= n_blk)
            bstart[b++] = n_ent;
    }
    __syncthreads();

    /* scores: S[h][e] = q_h . k_e */
    for (uint32_t tile = 0; tile < n_tiles; tile++) {
        const uint32_t e0 = tile * ATTN_TE;
        decode_tile(ptr, fmt, e0, n_ent, hd, Ks, ldq, lut8, lut4);
        __syncthreads();
        if (warp < ATTN_QK_WARPS && e0 + warp * 16 < n_ent) {
            frag_c acc;
            wmma::fill_fragment(acc, 0.0f);
            for (uint32_t k = 0; k < hd; k += 16) {
                frag_a fa;
                frag_bt fb;
                wmma::load_matrix_sync(fa, (const __nv_bfloat16 *)(Qs + k), ldq);
                wmma::load_matrix_sync(fb, (const __nv_bfloat16 *)(Ks + (size_t)warp * 16 * ldq + k), ldq);
                wmma::mma_sync(acc, fa, fb, acc);
            }
            wmma::store_matrix_sync(S + e0 + warp * 16, acc, ne_pad, wmma::mem_row_major);
        }
        __syncthreads();
    }

    /* softmax with the sink: ATTN_LANES lanes per head, the row's tiles padded with zero
     * weights */
    {
        const uint32_t h = threadIdx.x / ATTN_LANES, sub = threadIdx.x % ATTN_LANES;
        float *Sh = S + (size_t)h * ne_pad;
        float *rm = runmax + (size_t)h * ATTN_MAX_BLK;
        float m = -1e30f;
        for (uint32_t b = 0; b < n_blk; b++) { /* the running max after each block */
            for (uint32_t e = bstart[b] + sub; e < bstart[b + 1]; e += ATTN_LANES) {
                float s = __fmul_rn(Sh[e], a.scale);
                Sh[e] = s;
                m = s > m ? s : m;
            }
            for (int off = ATTN_LANES / 2; off > 0; off /= 2) {
                float o = __shfl_xor_sync(0xffffffffu, m, off);
                m = o > m ? o : m;
            }
            rm[b] = m;  /* every lane of the head writes the same value */
        }
        __syncwarp();
        const float mx = m;
        float sum = 0.0f;
        for (uint32_t e = sub; e < n_tiles * ATTN_TE; e += ATTN_LANES) {
            float p = 0.0f, w = 0.0f;
            if (e < n_ent) {
                const float mb = rm[fmt[e] >> 1];
                const float f = (float)exp((double)__fsub_rn(mb, mx));
                p = (float)exp((double)__fsub_rn(Sh[e], mb));
                w = __fmul_rn(dev_bf16_to_f32(dev_f32_to_bf16(p)), f);
                p = __fmul_rn(p, f);
            }
            uint16_t hi = dev_f32_to_bf16(w);
            Ph[(size_t)h * ne_pad + e] = hi;
            Pl[(size_t)h * ne_pad + e] = dev_f32_to_bf16(__fsub_rn(w, dev_bf16_to_f32(hi)));
            sum += p;
        }
        for (int off = ATTN_LANES / 2; off > 0; off /= 2)
            sum += __shfl_xor_sync(0xffffffffu, sum, off);
        if (sub == 0) {
            float sk = h0 + h < a.n_heads ? a.sink[h0 + h] : 0.0f;
            denom[h] = __fadd_rn(sum, (float)exp((double)__fsub_rn(sk, mx)));
        }
    }
    __syncthreads();

    /* O = P V: warp w owns output column tiles w, w + ATTN_WARPS, ... */
    const uint32_t nj = hd / 16;
    frag_c acc[ATTN_MAX_NJ];
#pragma unroll
    for (int jj = 0; jj < ATTN_MAX_NJ; jj++)
        wmma::fill_fragment(acc[jj], 0.0f);
    for (uint32_t tile = 0; tile < n_tiles; tile++) {
        const uint32_t e0 = tile * ATTN_TE;
        decode_tile(ptr, fmt, e0, n_ent, hd, Ks, ldq, lut8, lut4);
        __syncthreads();
        for (uint32_t kk = 0; kk < ATTN_TE && e0 + kk < n_ent; kk += 16) {
            frag_a ahi, alo;
            wmma::load_matrix_sync(ahi, (const __nv_bfloat16 *)(Ph + e0 + kk), ne_pad);
            wmma::load_matrix_sync(alo, (const __nv_bfloat16 *)(Pl + e0 + kk), ne_pad);
#pragma unroll
            for (int jj = 0; jj < ATTN_MAX_NJ; jj++) {
                uint32_t j = warp + jj * ATTN_WARPS;
                if (j >= nj)
                    break;
                frag_b fb;
                wmma::load_matrix_sync(fb, (const __nv_bfloat16 *)(Ks + (size_t)kk * ldq + j * 16), ldq);
                wmma::mma_sync(acc[jj], ahi, fb, acc[jj]);
                wmma::mma_sync(acc[jj], alo, fb, acc[jj]);
            }
        }
        __syncthreads();
    }

    /* out = bf16(O / denominator), O staged in the tile buffer as fp32 [ATTN_HG][hd + 4] */
    float *Os = (float *)Ks;
    const uint32_t ldo = hd + 4;
#pragma unroll
    for (int jj = 0; jj < ATTN_MAX_NJ; jj++) {
        uint32_t j = warp + jj * ATTN_WARPS;
        if (j < nj)
            wmma::store_matrix_sync(Os + j * 16, acc[jj], ldo, wmma::mem_row_major);
    }
    __syncthreads();
    for (uint32_t i = threadIdx.x; i < ATTN_HG * hd; i += blockDim.x) {
        uint32_t h = i / hd, d = i % hd;
        if (h0 + h < a.n_heads)
            a.out[((size_t)t * a.n_heads + h0 + h) * hd + d] =
                dev_f32_to_bf16(__fdiv_rn(Os[h * ldo + d], denom[h]));
    }
}

/* ---- launcher ---- */

static di_status launch_sparse_attn(cuda_ctx *c, const cuda_attn_args *a, uint32_t n_rows,
                                    cudaStream_t stream)
{
    assert(a->head_dim % 32 == 0 && a->head_dim <= ATTN_MAX_HD && a->ne_pad % ATTN_TE == 0);
    attn_smem L = attn_layout(a->head_dim, a->ne_pad);
    di_status st = cuda_check(c, cudaFuncSetAttribute(sparse_attn_kernel,
                                                      cudaFuncAttributeMaxDynamicSharedMemorySize,
                                                      (int)L.total),
                              "sparse_attn: cudaFuncSetAttribute");
    if (st != DI_OK)
        return st;
    dim3 grid(n_rows, (a->n_heads + ATTN_HG - 1) / ATTN_HG);
    cuda_launch(c, "sparse_attn_kernel", sparse_attn_kernel, grid, ATTN_THREADS, L.total, stream,
                *a);
    return cuda_launched(c, "sparse_attn_kernel");
}

/* ---- table entry ---- */

/* Entries of the largest key set of any row, and whether every ring read has a slot. */
static di_status attn_bound(cuda_ctx *c, const kern_sparse_attn *p, uint32_t *max_ent)
{
    uint64_t mx = 0;
    for (uint32_t i = 0; i < p->n_seqs; i++) {
        const kern_seq *s = &p->seqs[i];
        if (s->n_rows == 0)
            continue;
        uint64_t n_win;
        int reads_ring;
        if (s->ring_hi >= 0) {
            int64_t first = s->ring_hi - (int64_t)p->window + 1 < 0 ? 0 : s->ring_hi - (int64_t)p->window + 1;
            n_win = (uint64_t)(s->ring_hi - first + 1) + s->n_rows;
            reads_ring = 1;
        } else {
            if (s->pos0 < 0)
                return cuda_fail(c, DI_EINVAL, "sparse_attn: sequence %u at position %lld", i,
                                 (long long)s->pos0);
            n_win = 0;
            reads_ring = 0;
            for (uint32_t r = 0; r < s->n_rows; r++) { /* the window of each row */
                int64_t pos = s->pos0 + r, lo = pos - (int64_t)p->window + 1 < 0 ? 0 : pos - (int64_t)p->window + 1;
                if (s->window_lo > 0 && pos >= s->window_lo && lo < s->window_lo)
                    lo = s->window_lo;
                n_win = (uint64_t)(pos - lo + 1) > n_win ? (uint64_t)(pos - lo + 1) : n_win;
                reads_ring |= lo < s->pos0;
            }
        }
        if (reads_ring && !s->slot)
            return cuda_fail(c, DI_EINVAL, "sparse_attn: sequence %u reads its ring but has no "
                             "state slot", i);
        uint64_t n = n_win + (p->topk ? p->topk_n : 0);
        mx = n > mx ? n : mx;
    }
    if (mx > 0x7fffffffu)
        return cuda_fail(c, DI_EUNSUPPORTED, "sparse_attn: %llu keys per row", (unsigned long long)mx);
    *max_ent = (uint32_t)mx;
    return DI_OK;
}

di_status cuda_op_sparse_attn(void *ctx, const kern_sparse_attn *p)
{
    cuda_ctx *c = (cuda_ctx *)ctx;
    di_status st = cuda_op_begin(c, p, "sparse_attn");
    if (st != DI_OK)
        return st;
    if (p->head_dim == 0 || p->head_dim % 32 != 0 || p->head_dim > ATTN_MAX_HD)
        return cuda_fail(c, DI_EINVAL, "sparse_attn: head_dim %u must be a positive multiple of "
                         "32 up to %d", p->head_dim, ATTN_MAX_HD);
    if (p->window == 0 || p->ring_positions < p->window)
        return cuda_fail(c, DI_EINVAL, "sparse_attn: window %u must be positive and at most "
                         "ring_positions %u", p->window, p->ring_positions);
    if (p->n_rows == 0 || p->n_heads == 0)
        return DI_OK;
    if (!p->q || !p->local || !p->sink || !p->out || (p->topk && !p->pool.blocks))
        return cuda_fail(c, DI_EINVAL, "sparse_attn: q, local, sink, out or the pool is NULL");
    if (p->topk && (p->pool.entries_per_block == 0 ||
                    p->pool.main_entry_bytes < (size_t)p->head_dim / 2 + p->head_dim / 16))
        return cuda_fail(c, DI_EINVAL, "sparse_attn: pool of %u entries per block of %zu bytes",
                         p->pool.entries_per_block, p->pool.main_entry_bytes);
    if (p->n_rows > 0x7fffffffu || p->n_heads > 65535u * ATTN_HG)
        return cuda_fail(c, DI_EINVAL, "sparse_attn: %u rows x %u heads is too many for one "
                         "launch", p->n_rows, p->n_heads);
    uint32_t max_ent = 0;
    if ((st = attn_bound(c, p, &max_ent)) != DI_OK)
        return st;
    if (!c->attn_old)
        return cuda_attn_tiles(c, p);
    if ((uint64_t)max_ent + p->window > (uint64_t)ATTN_MAX_BLK * ATTN_BLOCK)
        return cuda_fail(c, DI_EUNSUPPORTED, "sparse_attn: %u keys per row and a window of %u "
                         "exceed %d key slots", max_ent, p->window, ATTN_MAX_BLK * ATTN_BLOCK);
    uint32_t ne_pad = (max_ent + ATTN_TE - 1) / ATTN_TE * ATTN_TE;
    if (ne_pad == 0)
        ne_pad = ATTN_TE;
    /* a graph's bound: rounded up while the layout still fits (cuda_graph_bound) */
    uint32_t g_ent = cuda_graph_bound(c, max_ent, (uint64_t)ATTN_MAX_BLK * ATTN_BLOCK - p->window);
    uint32_t g_pad = (g_ent + ATTN_TE - 1) / ATTN_TE * ATTN_TE;
    if (g_pad > ne_pad && attn_layout(p->head_dim, g_pad).total <= ATTN_SMEM_LIMIT)
        ne_pad = g_pad;
    if (attn_layout(p->head_dim, ne_pad).total > ATTN_SMEM_LIMIT)
        return cuda_fail(c, DI_EUNSUPPORTED, "sparse_attn: %u keys per row of %u numbers need "
                         "more shared memory than a block has", max_ent, p->head_dim);
    cuda_meta_reset(c);
    size_t seq_off = 0, table_off = 0, rs_off = 0;
    uint8_t *dev = NULL;
    if ((st = cuda_meta_seqs(c, "sparse_attn", p->seqs, p->n_seqs, p->n_rows, &seq_off,
                             &table_off, &rs_off)) != DI_OK ||
        (st = cuda_meta_upload(c, 0, 0, &dev, NULL)) != DI_OK)
        return st;
    cuda_attn_args a;
    cuda_attn_args_init(&a, p, dev, seq_off, table_off, rs_off);
    a.ne_pad = ne_pad;
    return launch_sparse_attn(c, &a, p->n_rows, c->stream);
}

void cuda_attn_args_init(cuda_attn_args *a, const kern_sparse_attn *p, const uint8_t *dev,
                         size_t seq_off, size_t table_off, size_t row_seq_off)
{
    memset(a, 0, sizeof(*a));
    a->q = p->q, a->local = p->local, a->out = p->out, a->sink = p->sink;
    a->topk = p->topk, a->topk_n = p->topk ? p->topk_n : 0;
    a->seqs = (const cuda_seq *)(dev + seq_off);
    a->tables = (const uint32_t *)(dev + table_off);
    a->row_seq = (const int32_t *)(dev + row_seq_off);
    a->blocks = p->pool.blocks, a->block_bytes = p->pool.block_bytes;
    a->main_offset = p->pool.main_offset, a->main_entry_bytes = p->pool.main_entry_bytes;
    a->per_block = p->pool.entries_per_block;
    a->ring_offset = p->ring_offset, a->ring_positions = p->ring_positions, a->window = p->window;
    a->n_heads = p->n_heads, a->head_dim = p->head_dim, a->scale = p->scale;
}
