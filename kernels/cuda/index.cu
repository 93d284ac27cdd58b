/* index.cu: the indexer (MODEL.md §2.7): scores of the compressed entries (kern_index_scores),
 * layer 20's candidate blocks (kern_index_candidates) and the top-k selection
 * (kern_index_topk). C twins: kernels/cpu/ops_index.c.
 *
 * Scores, one CTA per (group of rows, tile of IDX_TE entries), tensor cores through WMMA. A group
 * is one row, or with kern_cuda_config.index_group_rows up to IDX_GROUP_ROWS consecutive rows
 * of one sequence (a decode step's 1 + nextn rows), which read the same keys: the tile's index
 * keys are decoded once for the group (E2M1 x UE8M0: exact in bf16) and, for every 32-number
 * block of the head
 * width, Q K^T restricted to that block is two 16x16x16 MMAs into a fresh fp32 accumulator. The
 * queries are (B) fake-quantised, so every product in a block is a multiple of the same power
 * of two below 2^13 times it and the block's sum is exact in fp32 whatever the order; the blocks
 * are then added in double in block order (in registers) and rounded to fp32 once: the twin's
 * fp32(double dot), bit for bit
 * (queries that are not FP4 values round differently, within a few fp32 ulps). Then the
 * reference's BF16 roundings (MODEL.md §2.7), as the twin: each head's dot rounded to bf16,
 * ReLU, times the head weight bf16(bf16 w * w_scale), the product rounded to bf16, the heads
 * summed in fp32 in head order by one thread per entry; the score is rounded to bf16.
 * Tolerance: bf16 1 ulp.
 *
 * Prefill: a sequence of at least kern_cuda_config.index_block_rows rows in the call (16 by
 * default; decode steps stay on the kernel above) is scored by the block kernel: one CTA per
 * (block of IDXB_ROWS consecutive rows of the sequence, span of IDXB_SPAN entries), one warp
 * per row. The CTA stages its rows' queries (heads padded to 16) in shared memory once and walks
 * its span's IDX_TE-entry tiles up to the block's widest row (past it: -inf), decoding each tile
 * once for all its rows. A warp computes, per 16 entries, the entries x heads product of its
 * row by m16n8k16 mma.sync (keys as A, queries as B, both through ldmatrix), each 32-number
 * block into a fresh fp32 accumulator and the blocks added in double in block order in
 * registers: the same exact block sums and the same double sum as above, so the same bits.
 * The BF16 roundings and the head weights are applied on the accumulators; the head sum runs
 * in head order along the four lanes that hold an entry's heads (two heads per lane and n-tile,
 * passed on by shuffles), so each score is the twin's fp32 sum in head order. Entries past a
 * row's own bound (inside the block's tiles) and outside the candidate mask get -inf.
 *
 * Selection (candidates and top-k), one CTA per row: the rank of an item is the twin's 64-bit
 * key (order-preserving bits of the score above the complemented index, so ties go to the lower
 * index). A radix select over the 32 score bits (4 passes of 8 bits) finds the score V of the
 * k-th best item and how many items scoring V are kept; a counting scan in index order finds the
 * last kept index among those; the kept items are then written in ascending index order. Exact.
 */
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

#define IDX_TE 64                     /* entries per scores CTA */
#define IDX_GROUP_ROWS 8              /* rows of one sequence per scores CTA at most */
#define IDX_WARPS 8
#define IDX_THREADS (IDX_WARPS * 32)
#define IDX_MAX_HEADS 64
#define IDX_MAX_HD 256
#define IDX_SUB (IDX_THREADS / IDX_TE) /* threads per entry in the head sum */
#define IDX_SMEM_LIMIT (227 * 1024)
#define IDXB_ROWS 8                   /* rows per block-kernel CTA: one warp each */
#define IDXB_THREADS (IDXB_ROWS * 32)
#define IDXB_SPAN 512                 /* entries per block-kernel CTA (tiles of IDX_TE) */
#define IDXB_MAX_HEADS 32             /* heads of the block kernel: four n-tiles of 8 */
#define SEL_THREADS 256
#define SEL_WARPS (SEL_THREADS / 32)
#define SEL_SHARED (3 + SEL_WARPS)

typedef wmma::fragment<wmma::matrix_a, 16, 16, 16, __nv_bfloat16, wmma::row_major> ifrag_a;
typedef wmma::fragment<wmma::matrix_b, 16, 16, 16, __nv_bfloat16, wmma::col_major> ifrag_bt;
typedef wmma::fragment<wmma::accumulator, 16, 16, 16, float> ifrag_c;

typedef struct scores_args {
    const uint16_t *q;          /* [T, nh, hd] */
    const uint16_t *w;          /* [T, nh] */
    double w_scale;
    const int32_t *n_visible;   /* [T] device */
    const int32_t *row_seq;     /* [T] device */
    const cuda_seq *seqs;
    const uint32_t *tables;
    const uint8_t *blocks;      /* the key owner's pool */
    size_t block_bytes, index_offset, index_entry_bytes;
    uint32_t per_block;
    const uint8_t *cand_mask;   /* [T, cand_stride] or NULL */
    size_t cand_stride;
    uint32_t cand_block;
    float *scores;              /* [T, stride] */
    size_t stride;
    const uint32_t *groups;     /* [n_groups][2]: a group's first row and row count */
    uint32_t n_heads, head_dim, max_vis, group0;
} scores_args;

typedef struct scores_smem {
    size_t q, k, part, hw, kp, total;
} scores_smem;

static __host__ __device__ uint32_t heads_pad(uint32_t nh)
{
    return (nh + 15) / 16 * 16;
}

/* Shared buffers of a CTA of `rows` rows. */
static __host__ __device__ scores_smem scores_layout(uint32_t nh, uint32_t hd, uint32_t rows)
{
    scores_smem L;
    size_t ld = (size_t)hd + 8, nq = (size_t)rows * heads_pad(nh);
    L.q = 0;
    L.k = L.q + dev_smem_round(nq * ld * 2);
    L.part = L.k + dev_smem_round((size_t)IDX_TE * ld * 2);
    L.hw = L.part + dev_smem_round(nq * IDX_TE * 4);
    L.kp = L.hw + dev_smem_round(nq * 8);
    L.total = L.kp + dev_smem_round(IDX_TE * sizeof(void *));
    return L;
}

/* Shared buffers of a block-kernel CTA: the rows' queries (heads padded to 16), one key tile,
 * its key addresses and the rows' head weights. */
static __host__ __device__ scores_smem block_layout(uint32_t nh, uint32_t hd)
{
    scores_smem L;
    size_t ld = (size_t)hd + 8, nq = (size_t)IDXB_ROWS * heads_pad(nh);
    L.q = 0;
    L.k = L.q + dev_smem_round(nq * ld * 2);
    L.kp = L.k + dev_smem_round((size_t)IDX_TE * ld * 2);
    L.hw = L.kp + dev_smem_round(IDX_TE * sizeof(void *));
    L.part = 0;
    L.total = L.hw + dev_smem_round(nq * 4);
    return L;
}

/* ---- device helpers ---- */

__device__ __forceinline__ float bf16_round_dev(float x)
{
    return dev_bf16_to_f32(dev_f32_to_bf16(x));
}

/* A head's term of a score: bf16(w * relu(bf16(dot))), as the twin. */
__device__ __forceinline__ float head_term(double dot, float w)
{
    float d = bf16_round_dev((float)dot);
    return bf16_round_dev(__fmul_rn(w, d > 0.0f ? d : 0.0f));
}

/* Order-preserving bits of a score (the twin's rank_key without the index). */
__device__ __forceinline__ uint32_t score_key(float f)
{
    uint32_t u = __float_as_uint(f);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

/* Block-wide rank of a flag: *rank = flags set in the threads below this one; returns the
 * block's count. Every thread calls it; wc holds one word per warp. */
__device__ uint32_t block_rank(bool flag, uint32_t *wc, uint32_t *rank)
{
    const uint32_t lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    unsigned m = __ballot_sync(0xffffffffu, flag);
    if (lane == 0)
        wc[warp] = (uint32_t)__popc(m);
    __syncthreads();
    uint32_t before = 0, total = 0;
    for (uint32_t w = 0; w < blockDim.x / 32; w++) {
        before += w < warp ? wc[w] : 0u;
        total += wc[w];
    }
    *rank = before + (uint32_t)__popc(m & ((1u << lane) - 1u));
    __syncthreads();
    return total;
}

/* The threshold of the k best of v[0, n) (0 < k < n): V, the score key of the k-th best, and
 * last, the largest index among the kept items whose key is V. An item e is kept when its key
 * is above V, or equal to V with e <= last. Every thread of the block calls it; hist holds 256
 * counters, shared SEL_SHARED words. */
__device__ void select_threshold(const float *v, uint32_t n, uint32_t k, uint32_t *hist,
                                 uint32_t *shared, uint32_t *V_out, uint32_t *last_out)
{
    uint32_t prefix = 0, fixed = 0;
    /* shared[0]: remaining count to take among keys matching the prefix; shared[1]: digit */
    if (threadIdx.x == 0)
        shared[0] = k;
    for (int shift = 24; shift >= 0; shift -= 8) {
        for (uint32_t i = threadIdx.x; i < 256; i += blockDim.x)
            hist[i] = 0;
        __syncthreads();
        for (uint32_t e = threadIdx.x; e < n; e += blockDim.x) {
            uint32_t key = score_key(v[e]);
            if ((key & fixed) == prefix)
                atomicAdd(&hist[(key >> shift) & 255u], 1u);
        }
        __syncthreads();
        if (threadIdx.x == 0) {
            uint32_t want = shared[0], above = 0, d = 255;
            for (;; d--) {
                if (above + hist[d] >= want || d == 0)
                    break;
                above += hist[d];
            }
            shared[0] = want - above;
            shared[1] = d;
        }
        __syncthreads();
        prefix |= shared[1] << shift;
        fixed |= 255u << shift;
    }
    const uint32_t V = prefix, take = shared[0]; /* keys == V to keep, lowest indices first */
    /* the take-th item (in index order) whose key is V: shared[2]; per-warp counts after it */
    uint32_t *wc = shared + 3;
    uint32_t seen = 0;
    if (threadIdx.x == 0)
        shared[2] = n - 1;
    __syncthreads();
    for (uint32_t base = 0; base < n; base += blockDim.x) {
        uint32_t e = base + threadIdx.x, rank = 0;
        bool hit = e < n && score_key(v[e]) == V;
        uint32_t total = block_rank(hit, wc, &rank);
        if (hit && seen + rank + 1 == take)
            shared[2] = e;
        seen += total;
        if (seen >= take)
            break;
    }
    __syncthreads();
    *V_out = V;
    *last_out = shared[2];
    __syncthreads();
}

/* ---- kernels ---- */

/* Decodes index keys e0 .. e0 + IDX_TE - 1 of sequence s into Ks (zeros for entries not
 * scored): hd/2 packed E2M1 then hd/32 UE8M0 per key. The keys' addresses first (one thread
 * per key, into kp), then four numbers per thread and step. */
__device__ void decode_keys(const scores_args &a, const cuda_seq &s, uint32_t e0, uint32_t nv,
                            uint16_t *Ks, uint32_t ld, const uint8_t **kp)
{
    const uint32_t hd = a.head_dim, quads = hd / 4;
    for (uint32_t e = threadIdx.x; e < IDX_TE; e += blockDim.x)
        kp[e] = e0 + e < nv ? cuda_entry_addr(a.blocks, a.block_bytes, a.per_block, a.index_offset,
                                              a.index_entry_bytes, &s, a.tables, e0 + e)
                            : NULL;
    __syncthreads();
    for (uint32_t i = threadIdx.x; i < IDX_TE * quads; i += blockDim.x) {
        uint32_t e = i / quads, c = (i % quads) * 4;
        uint32_t w0 = 0, w1 = 0;
        const uint8_t *src = kp[e];
        if (src) {
            float sc = dev_ue8m0_decode(src[hd / 2 + c / 32]);
            uint32_t b0 = src[c / 2], b1 = src[c / 2 + 1];
            w0 = (uint32_t)dev_f32_to_bf16(dev_e2m1_decode((uint8_t)(b0 & 15u)) * sc) |
                 (uint32_t)dev_f32_to_bf16(dev_e2m1_decode((uint8_t)(b0 >> 4)) * sc) << 16;
            w1 = (uint32_t)dev_f32_to_bf16(dev_e2m1_decode((uint8_t)(b1 & 15u)) * sc) |
                 (uint32_t)dev_f32_to_bf16(dev_e2m1_decode((uint8_t)(b1 >> 4)) * sc) << 16;
        }
        *reinterpret_cast<uint2 *>(Ks + (size_t)e * ld + c) = make_uint2(w0, w1);
    }
}

__global__ void __launch_bounds__(IDX_THREADS)
index_scores_kernel(scores_args a)
{
    extern __shared__ __align__(128) uint8_t idx_smem_buf[];
    const uint32_t g = a.group0 + blockIdx.y, e0 = blockIdx.x * IDX_TE;
    const uint32_t t0 = a.groups[2 * g], n_rows = a.groups[2 * g + 1];
    const uint32_t hd = a.head_dim, ld = hd + 8, nh = a.n_heads, nhp = heads_pad(nh);
    uint32_t nv = 0; /* the group's widest row */
    for (uint32_t r = 0; r < n_rows; r++)
        nv = (uint32_t)a.n_visible[t0 + r] > nv ? (uint32_t)a.n_visible[t0 + r] : nv;
    if (e0 >= nv) { /* nothing visible in the tile: -inf up to the call's widest row */
        for (uint32_t i = threadIdx.x; i < n_rows * IDX_TE; i += blockDim.x) {
            uint32_t e = e0 + i % IDX_TE;
            if (e < a.max_vis)
                a.scores[(size_t)(t0 + i / IDX_TE) * a.stride + e] = -INFINITY;
        }
        return;
    }
    const scores_smem L = scores_layout(nh, hd, n_rows);
    uint16_t *Qs = (uint16_t *)(idx_smem_buf + L.q), *Ks = (uint16_t *)(idx_smem_buf + L.k);
    float *part = (float *)(idx_smem_buf + L.part);
    double *hw = (double *)(idx_smem_buf + L.hw);
    const cuda_seq s = a.seqs[a.row_seq[t0]];
    const uint32_t nq = n_rows * nhp; /* query rows: row r's head h at r * nhp + h */
    for (uint32_t i = threadIdx.x; i < nq * hd; i += blockDim.x) {
        uint32_t qr = i / hd, d = i % hd, r = qr / nhp, h = qr % nhp;
        Qs[qr * ld + d] = h < nh ? a.q[((size_t)(t0 + r) * nh + h) * hd + d] : 0;
    }
    for (uint32_t qr = threadIdx.x; qr < nq; qr += blockDim.x) { /* bf16(bf16 w * the exact scale) */
        uint32_t r = qr / nhp, h = qr % nhp;
        hw[qr] = h < nh ? (double)dev_bf16_to_f32(dev_f32_to_bf16(
                              (float)((double)dev_bf16_to_f32(a.w[(size_t)(t0 + r) * nh + h]) *
                                      a.w_scale)))
                        : 0.0;
    }
    decode_keys(a, s, e0, nv, Ks, ld, (const uint8_t **)(idx_smem_buf + L.kp));
    __syncthreads();
    /* part[qr][e] = fp32 of the sum over the 32-number blocks, in block order and in double,
     * of q[qr] . k[e] restricted to the block (each block's sum exact in fp32) */
    const uint32_t warp = threadIdx.x / 32, n_m = nq / 16, n_pairs = n_m * (IDX_TE / 16);
    for (uint32_t pr = warp; pr < n_pairs; pr += IDX_WARPS) {
        uint32_t mt = pr / (IDX_TE / 16), nt = pr % (IDX_TE / 16);
        ifrag_c acc, sum;
        double dsum[sizeof(acc.x) / sizeof(acc.x[0])];
        for (int i = 0; i < acc.num_elements; i++)
            dsum[i] = 0.0;
        for (uint32_t b = 0; b < hd / 32; b++) {
            wmma::fill_fragment(acc, 0.0f);
            for (uint32_t k = b * 32; k < b * 32 + 32; k += 16) {
                ifrag_a fa;
                ifrag_bt fb;
                wmma::load_matrix_sync(fa, (const __nv_bfloat16 *)(Qs + (size_t)mt * 16 * ld + k), ld);
                wmma::load_matrix_sync(fb, (const __nv_bfloat16 *)(Ks + (size_t)nt * 16 * ld + k), ld);
                wmma::mma_sync(acc, fa, fb, acc);
            }
            for (int i = 0; i < acc.num_elements; i++)
                dsum[i] += (double)acc.x[i];
        }
        for (int i = 0; i < sum.num_elements; i++)
            sum.x[i] = (float)dsum[i];
        wmma::store_matrix_sync(part + (size_t)mt * 16 * IDX_TE + nt * 16, sum, IDX_TE,
                                wmma::mem_row_major);
    }
    __syncthreads();
    /* each head's term bf16(w * relu(bf16(dot))) in place, in parallel; then per (row, entry)
     * one thread sums the terms in head order (fp32, as the twin) */
    for (uint32_t i = threadIdx.x; i < nq * IDX_TE; i += blockDim.x) {
        const uint32_t qr = i / IDX_TE;
        float d = dev_bf16_to_f32(dev_f32_to_bf16(part[i]));
        part[i] = dev_bf16_to_f32(dev_f32_to_bf16(__fmul_rn((float)hw[qr], d > 0.0f ? d : 0.0f)));
    }
    __syncthreads();
    for (uint32_t i = threadIdx.x; i < n_rows * IDX_TE; i += blockDim.x) {
        const uint32_t r = i / IDX_TE, e = i % IDX_TE, ge = e0 + e, t = t0 + r;
        if (ge >= a.max_vis)
            continue;
        float acc = 0.0f;
        for (uint32_t h = 0; h < nh; h++)
            acc = __fadd_rn(acc, part[(size_t)(r * nhp + h) * IDX_TE + e]);
        const uint32_t nvt = (uint32_t)a.n_visible[t];
        bool masked = a.cand_mask && !a.cand_mask[(size_t)t * a.cand_stride + ge / a.cand_block];
        a.scores[(size_t)t * a.stride + ge] =
            ge >= nvt || masked ? -INFINITY : dev_bf16_to_f32(dev_f32_to_bf16((float)acc));
    }
}

/* One warp's row over 16 entries e0 + [0, 16) of the tile in Ks (entry mt * 16 of the tile):
 * the scores of its row (query rows Qr, head weights hwr). */
__device__ __forceinline__ void block_row_scores(const scores_args &a, const uint16_t *Ks,
                                                 const uint16_t *Qr, const float *hwr,
                                                 uint32_t ld, uint32_t t, uint32_t nvt,
                                                 uint32_t e0, uint32_t mt)
{
    const uint32_t lane = threadIdx.x % 32, nt_n = (a.n_heads + 7) / 8;
    double ds[4][4] = {}; /* [n-tile][fragment element]: the blocks' sum so far */
    const uint16_t *ka = Ks + (size_t)(mt * 16 + lane % 16) * ld + (lane / 16) * 8;
    const uint16_t *qb = Qr + (size_t)((lane / 16) * 8 + lane % 8) * ld + ((lane / 8) % 2) * 8;
    for (uint32_t b = 0; b < a.head_dim / 32; b++) {
        float acc[4][4] = {}; /* this 32-number block's sums */
#pragma unroll
        for (uint32_t k = 0; k < 32; k += 16) {
            uint32_t af[4], bf[4];
            dev_ldm_x4(af, ka + b * 32 + k);
#pragma unroll
            for (uint32_t np = 0; np < 2; np++) {
                if (2 * np >= nt_n)
                    break;
                dev_ldm_x4(bf, qb + (size_t)np * 16 * ld + b * 32 + k);
                dev_mma_bf16(acc[2 * np], af, bf[0], bf[1]);
                if (2 * np + 1 < nt_n)
                    dev_mma_bf16(acc[2 * np + 1], af, bf[2], bf[3]);
            }
        }
#pragma unroll
        for (int nt = 0; nt < 4; nt++)
#pragma unroll
            for (int i = 0; i < 4; i++)
                ds[nt][i] += (double)acc[nt][i];
    }
    /* lane (g, c) holds entries g and g + 8, heads nt * 8 + 2c and + 1: the head sum in head
     * order passes along c = 0..3 for each n-tile in turn */
    const uint32_t c = lane % 4, quad = lane & ~3u;
    float s0 = 0.0f, s1 = 0.0f;
#pragma unroll
    for (uint32_t nt = 0; nt < 4; nt++) {
        if (nt >= nt_n)
            break;
        const float w0 = hwr[nt * 8 + 2 * c], w1 = hwr[nt * 8 + 2 * c + 1];
        const float e00 = head_term(ds[nt][0], w0), e01 = head_term(ds[nt][1], w1);
        const float e10 = head_term(ds[nt][2], w0), e11 = head_term(ds[nt][3], w1);
#pragma unroll
        for (uint32_t cc = 0; cc < 4; cc++) {
            float n0 = __fadd_rn(__fadd_rn(s0, e00), e01), n1 = __fadd_rn(__fadd_rn(s1, e10), e11);
            s0 = __shfl_sync(0xffffffffu, n0, quad | cc);
            s1 = __shfl_sync(0xffffffffu, n1, quad | cc);
        }
    }
    if (c < 2) {
        const uint32_t ge = e0 + lane / 4 + c * 8;
        if (ge < a.max_vis) {
            bool masked = a.cand_mask && !a.cand_mask[(size_t)t * a.cand_stride + ge / a.cand_block];
            a.scores[(size_t)t * a.stride + ge] =
                ge >= nvt || masked ? -INFINITY : bf16_round_dev(c == 0 ? s0 : s1);
        }
    }
}

/* The block kernel (file comment): CTA (span blockIdx.x, block of rows a.group0 + blockIdx.y). */
__global__ void __launch_bounds__(IDXB_THREADS, 2)
index_scores_block_kernel(scores_args a)
{
    extern __shared__ __align__(128) uint8_t idx_smem_buf[];
    const uint32_t g = a.group0 + blockIdx.y, span0 = blockIdx.x * IDXB_SPAN;
    const uint32_t t0 = a.groups[2 * g], n_rows = a.groups[2 * g + 1];
    const uint32_t span1 = span0 + IDXB_SPAN < a.max_vis ? span0 + IDXB_SPAN : a.max_vis;
    uint32_t nv = 0; /* the block's widest row */
    for (uint32_t r = 0; r < n_rows; r++)
        nv = (uint32_t)a.n_visible[t0 + r] > nv ? (uint32_t)a.n_visible[t0 + r] : nv;
    const uint32_t live = nv < span1 ? nv : span1; /* entries [span0, live) are scored */
    /* the span's tiles past the block's widest row: -inf */
    const uint32_t dead0 = live > span0 ? (live + IDX_TE - 1) / IDX_TE * IDX_TE : span0;
    if (dead0 < span1) {
        const uint32_t w = span1 - dead0;
        for (uint32_t i = threadIdx.x; i < n_rows * w; i += blockDim.x)
            a.scores[(size_t)(t0 + i / w) * a.stride + dead0 + i % w] = -INFINITY;
    }
    if (live <= span0)
        return;
    const uint32_t hd = a.head_dim, ld = hd + 8, nh = a.n_heads, nhp = heads_pad(nh);
    const scores_smem L = block_layout(nh, hd);
    uint16_t *Qs = (uint16_t *)(idx_smem_buf + L.q), *Ks = (uint16_t *)(idx_smem_buf + L.k);
    float *hw = (float *)(idx_smem_buf + L.hw);
    const uint8_t **kp = (const uint8_t **)(idx_smem_buf + L.kp);
    const cuda_seq s = a.seqs[a.row_seq[t0]];
    const uint32_t oct = hd / 8; /* 16-byte pieces of a head's query */
    for (uint32_t i = threadIdx.x; i < IDXB_ROWS * nhp * oct; i += blockDim.x) {
        const uint32_t qr = i / oct, d = (i % oct) * 8, r = qr / nhp, h = qr % nhp;
        uint4 v = make_uint4(0, 0, 0, 0);
        if (r < n_rows && h < nh)
            v = *reinterpret_cast<const uint4 *>(a.q + ((size_t)(t0 + r) * nh + h) * hd + d);
        *reinterpret_cast<uint4 *>(Qs + (size_t)qr * ld + d) = v;
    }
    for (uint32_t qr = threadIdx.x; qr < IDXB_ROWS * nhp; qr += blockDim.x) {
        const uint32_t r = qr / nhp, h = qr % nhp;
        hw[qr] = r < n_rows && h < nh
                     ? bf16_round_dev((float)((double)dev_bf16_to_f32(a.w[(size_t)(t0 + r) * nh + h]) *
                                              a.w_scale))
                     : 0.0f;
    }
    const uint32_t warp = threadIdx.x / 32, t = t0 + warp;
    const uint32_t nvt = warp < n_rows ? (uint32_t)a.n_visible[t] : 0;
    for (uint32_t e0 = span0; e0 < live; e0 += IDX_TE) {
        __syncthreads(); /* the previous tile's keys are read */
        decode_keys(a, s, e0, nv, Ks, ld, kp);
        __syncthreads();
        if (warp >= n_rows)
            continue;
        for (uint32_t mt = 0; mt < IDX_TE / 16; mt++) {
            const uint32_t m0 = e0 + mt * 16;
            if (m0 >= span1)
                break;
            if (m0 >= nvt) { /* past the row's bound: -inf */
                const uint32_t ge = m0 + threadIdx.x % 32;
                if (threadIdx.x % 32 < 16 && ge < span1)
                    a.scores[(size_t)t * a.stride + ge] = -INFINITY;
                continue;
            }
            block_row_scores(a, Ks, Qs + (size_t)warp * nhp * ld, hw + warp * nhp, ld, t, nvt,
                             m0, mt);
        }
    }
}

/* Candidate block scores: bs[t][b] = max of the block's visible scores (the twin's sequential
 * `>` scan from -inf), the newest block +inf. */
__global__ void cand_scores_kernel(const float *scores, size_t stride, const int32_t *n_visible,
                                   uint32_t block, uint32_t width, uint32_t n_rows, float *bs)
{
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (size_t)n_rows * width)
        return;
    uint32_t t = (uint32_t)(i / width), b = (uint32_t)(i % width);
    int32_t nv = n_visible[t];
    uint32_t nb = nv > 0 ? ((uint32_t)nv + block - 1) / block : 0;
    if (b >= nb)
        return;
    const float *sc = scores + (size_t)t * stride;
    float m = -INFINITY;
    for (uint32_t e = b * block; e < (b + 1) * block && e < (uint32_t)nv; e++)
        m = sc[e] > m ? sc[e] : m;
    if (b == (uint32_t)(nv - 1) / block)
        m = INFINITY;
    bs[i] = m;
}

/* Keeps the top_blocks best block scores of each row: mask[t][b] = kept and not -inf; zeros
 * up to width. */
__global__ void cand_select_kernel(const float *bs, const int32_t *n_visible, uint32_t block,
                                   uint32_t width, uint32_t top_blocks, uint8_t *mask,
                                   size_t mask_stride)
{
    __shared__ uint32_t hist[256], shared[SEL_SHARED];
    const uint32_t t = blockIdx.x;
    const int32_t nv = n_visible[t];
    const uint32_t nb = nv > 0 ? ((uint32_t)nv + block - 1) / block : 0;
    const float *v = bs + (size_t)t * width;
    uint8_t *m = mask + (size_t)t * mask_stride;
    uint32_t V = 0, last = 0;
    bool all = top_blocks >= nb;
    if (!all && top_blocks > 0)
        select_threshold(v, nb, top_blocks, hist, shared, &V, &last);
    for (uint32_t b = threadIdx.x; b < width; b += blockDim.x) {
        uint8_t keep = 0;
        if (b < nb && top_blocks > 0) {
            uint32_t key = score_key(v[b]);
            keep = (all || key > V || (key == V && b <= last)) && v[b] != -INFINITY;
        }
        m[b] = keep;
    }
}

/* The k best scores of each row, ascending ids, -1 after them. */
__global__ void topk_select_kernel(const float *scores, size_t stride, const int32_t *n_visible,
                                   uint32_t k, int32_t *out)
{
    __shared__ uint32_t hist[256], shared[SEL_SHARED], wc[SEL_WARPS];
    const uint32_t t = blockIdx.x;
    const int32_t nvs = n_visible[t];
    const uint32_t n = nvs > 0 ? (uint32_t)nvs : 0;
    const float *v = scores + (size_t)t * stride;
    int32_t *o = out + (size_t)t * k;
    uint32_t V = 0, last = 0;
    bool all = k >= n;
    if (!all && k > 0)
        select_threshold(v, n, k, hist, shared, &V, &last);
    uint32_t written = 0;
    for (uint32_t base = 0; base < n && k > 0; base += blockDim.x) {
        uint32_t e = base + threadIdx.x, rank = 0;
        bool keep = false;
        if (e < n) {
            uint32_t key = score_key(v[e]);
            keep = all || key > V || (key == V && e <= last);
        }
        uint32_t total = block_rank(keep, wc, &rank);
        if (keep)
            o[written + rank] = (int32_t)e;
        written += total;
    }
    for (uint32_t i = (all ? n : k) + threadIdx.x; i < k; i += blockDim.x)
        o[i] = -1;
}

/* ---- launchers ---- */

/* One of the scores kernels over n_groups groups (grid y, at most 65,535 a launch) and `spans`
 * spans of entries (grid x), with `smem` bytes of shared memory. */
static di_status launch_scores(cuda_ctx *c, const char *name, void (*kernel)(scores_args),
                               scores_args *a, uint32_t n_groups, uint32_t spans,
                               uint32_t threads, size_t smem, cudaStream_t stream)
{
    di_status st = cuda_check(c, cudaFuncSetAttribute(kernel,
                                                      cudaFuncAttributeMaxDynamicSharedMemorySize,
                                                      (int)smem),
                              "index_scores: cudaFuncSetAttribute");
    for (uint32_t g0 = 0; st == DI_OK && g0 < n_groups; g0 += 65535) {
        a->group0 = g0;
        dim3 grid(spans, n_groups - g0 < 65535 ? n_groups - g0 : 65535);
        cuda_launch(c, name, kernel, grid, threads, smem, stream, *a);
        st = cuda_launched(c, name);
    }
    return st;
}

static di_status launch_candidates(cuda_ctx *c, const kern_index_candidates *p,
                                   const int32_t *dev_nv, float *bs, uint32_t width,
                                   cudaStream_t stream)
{
    size_t n = (size_t)p->n_rows * width;
    cuda_launch(c, "cand_scores_kernel", cand_scores_kernel,
                (unsigned)((n + CUDA_THREADS - 1) / CUDA_THREADS), CUDA_THREADS, 0, stream,
                p->scores, p->stride, dev_nv, p->block, width, p->n_rows, bs);
    di_status st = cuda_launched(c, "cand_scores_kernel");
    if (st != DI_OK)
        return st;
    cuda_launch(c, "cand_select_kernel", cand_select_kernel, p->n_rows, SEL_THREADS, 0, stream, bs,
                dev_nv, p->block, width, p->top_blocks, p->mask, p->mask_stride);
    return cuda_launched(c, "cand_select_kernel");
}

static di_status launch_topk(cuda_ctx *c, const kern_index_topk *p, const int32_t *dev_nv,
                             cudaStream_t stream)
{
    cuda_launch(c, "topk_select_kernel", topk_select_kernel, p->n_rows, SEL_THREADS, 0, stream,
                p->scores, p->stride, dev_nv, p->k, p->out);
    return cuda_launched(c, "topk_select_kernel");
}

/* ---- table entries ---- */

/* The largest visible count; DI_EINVAL for a negative one or one above `cap`. */
static di_status max_visible(cuda_ctx *c, const char *op, const int32_t *nv, uint32_t n_rows,
                             size_t cap, uint32_t *out)
{
    int32_t mx = 0;
    for (uint32_t t = 0; t < n_rows; t++) {
        if (nv[t] < 0 || (size_t)nv[t] > cap)
            return cuda_fail(c, DI_EINVAL, "%s: n_visible[%u] = %d outside [0, %zu]", op, t, nv[t],
                             cap);
        mx = nv[t] > mx ? nv[t] : mx;
    }
    *out = (uint32_t)mx;
    return DI_OK;
}

/* The scores' row groups of one kernel: the runs of consecutive rows of one sequence whose
 * length is in [lo, hi), cut into groups of at most `cap` rows, written as (first row, rows)
 * pairs to grp when it is not NULL; returns their count, the largest in *widest. */
static uint32_t score_groups(const kern_index_scores *p, uint32_t cap, uint32_t lo, uint32_t hi,
                             uint32_t *grp, uint32_t *widest)
{
    uint32_t g = 0;
    for (uint32_t t = 0; t < p->n_rows;) {
        uint32_t run = 1;
        while (t + run < p->n_rows && p->row_seq[t + run] == p->row_seq[t])
            run++;
        for (uint32_t r = 0; run >= lo && run < hi && r < run; g++) {
            uint32_t n = run - r < cap ? run - r : cap;
            if (grp)
                grp[2 * g] = t + r, grp[2 * g + 1] = n;
            *widest = n > *widest ? n : *widest;
            r += n;
        }
        t += run;
    }
    return g;
}

di_status cuda_op_index_scores(void *ctx, const kern_index_scores *p)
{
    cuda_ctx *c = (cuda_ctx *)ctx;
    di_status st = cuda_op_begin(c, p, "index_scores");
    if (st != DI_OK)
        return st;
    if (p->head_dim == 0 || p->head_dim % 32 || p->head_dim > IDX_MAX_HD || p->n_heads == 0 ||
        p->n_heads > IDX_MAX_HEADS)
        return cuda_fail(c, DI_EUNSUPPORTED, "index_scores: %u heads of %u numbers (this backend "
                         "takes up to %d heads of a multiple of 32 up to %d)", p->n_heads,
                         p->head_dim, IDX_MAX_HEADS, IDX_MAX_HD);
    if (p->n_rows == 0)
        return DI_OK;
    if (!p->q || !p->w || !p->n_visible || !p->row_seq || !p->seqs || !p->scores ||
        (p->cand_mask && p->cand_block == 0))
        return cuda_fail(c, DI_EINVAL, "index_scores: a tensor or metadata pointer is NULL, or "
                         "cand_block is 0");
    uint32_t max_vis = 0;
    if ((st = max_visible(c, "index_scores", p->n_visible, p->n_rows, p->stride, &max_vis)) != DI_OK)
        return st;
    if (max_vis == 0)
        return DI_OK;
    if (!p->pool.blocks || p->pool.entries_per_block == 0 ||
        p->pool.index_entry_bytes < (size_t)p->head_dim / 2 + p->head_dim / 32)
        return cuda_fail(c, DI_EINVAL, "index_scores: the pool has no blocks or entries of %zu "
                         "bytes", p->pool.index_entry_bytes);
    uint32_t n_seqs = 0;
    for (uint32_t t = 0; t < p->n_rows; t++) {
        int32_t s = p->row_seq[t];
        if (s < 0)
            return cuda_fail(c, DI_EINVAL, "index_scores: row_seq[%u] = %d", t, s);
        n_seqs = (uint32_t)s + 1 > n_seqs ? (uint32_t)s + 1 : n_seqs;
        uint64_t need = ((uint64_t)p->n_visible[t] + p->pool.entries_per_block - 1) /
                        p->pool.entries_per_block;
        if (need > p->seqs[s].n_blocks)
            return cuda_fail(c, DI_EINVAL, "index_scores: row %u sees %d entries, its block table "
                             "has %u blocks of %u", t, p->n_visible[t], p->seqs[s].n_blocks,
                             p->pool.entries_per_block);
    }
    /* groups: runs of consecutive rows of one sequence, up to kern_cuda_config.index_group_rows
     * (1 by default), IDX_GROUP_ROWS and what shared memory takes */
    uint32_t group_rows = c->index_group_rows < IDX_GROUP_ROWS ? (uint32_t)c->index_group_rows
                                                               : IDX_GROUP_ROWS;
    const size_t smem = (size_t)cuda_device_attr(c, cudaDevAttrMaxSharedMemoryPerBlockOptin,
                                                 &c->smem_optin, 48 * 1024);
    while (group_rows > 1 && scores_layout(p->n_heads, p->head_dim, group_rows).total > smem)
        group_rows--;
    /* the block kernel for sequences of at least index_block_rows rows in the call (at most
     * IDXB_MAX_HEADS heads, 16-byte aligned queries) */
    uint32_t block_min = c->index_block_rows;
    if (p->n_heads > IDXB_MAX_HEADS || (uintptr_t)p->q % 16 ||
        block_layout(p->n_heads, p->head_dim).total > smem)
        block_min = UINT32_MAX;
    cuda_meta_reset(c);
    size_t seq_off = 0, table_off = 0, nv_off = 0, rs_off = 0, grp_off = 0, blk_off = 0;
    uint8_t *dev = NULL;
    uint32_t widest = 1, bwidest = 1;
    uint32_t n_groups = score_groups(p, group_rows, 0, block_min, NULL, &widest);
    uint32_t n_blocks = score_groups(p, IDXB_ROWS, block_min, UINT32_MAX, NULL, &bwidest);
    group_rows = widest; /* the launch's shared memory: the largest group's (occupancy) */
    if ((st = cuda_meta_seqs(c, "index_scores", p->seqs, n_seqs, 0, &seq_off, &table_off, NULL)) != DI_OK ||
        (st = cuda_meta_push(c, p->n_visible, (size_t)p->n_rows * 4, &nv_off)) != DI_OK ||
        (st = cuda_meta_push(c, p->row_seq, (size_t)p->n_rows * 4, &rs_off)) != DI_OK ||
        (st = cuda_meta_push(c, NULL, (size_t)n_groups * 8, &grp_off)) != DI_OK ||
        (st = cuda_meta_push(c, NULL, (size_t)n_blocks * 8, &blk_off)) != DI_OK)
        return st;
    score_groups(p, group_rows, 0, block_min, (uint32_t *)cuda_meta_at(c, grp_off), &widest);
    score_groups(p, IDXB_ROWS, block_min, UINT32_MAX, (uint32_t *)cuda_meta_at(c, blk_off),
                 &bwidest);
    if ((st = cuda_meta_upload(c, 0, 0, &dev, NULL)) != DI_OK)
        return st;
    uint64_t vis_cap = p->cand_mask ? (uint64_t)p->cand_stride * p->cand_block : p->stride;
    max_vis = cuda_graph_bound(c, max_vis, vis_cap < p->stride ? vis_cap : p->stride);
    scores_args a;
    memset(&a, 0, sizeof(a));
    a.q = p->q, a.w = p->w, a.w_scale = p->w_scale;
    a.n_visible = (const int32_t *)(dev + nv_off), a.row_seq = (const int32_t *)(dev + rs_off);
    a.seqs = (const cuda_seq *)(dev + seq_off), a.tables = (const uint32_t *)(dev + table_off);
    a.blocks = p->pool.blocks, a.block_bytes = p->pool.block_bytes;
    a.index_offset = p->pool.index_offset, a.index_entry_bytes = p->pool.index_entry_bytes;
    a.per_block = p->pool.entries_per_block;
    a.cand_mask = p->cand_mask, a.cand_stride = p->cand_stride, a.cand_block = p->cand_block;
    a.scores = p->scores, a.stride = p->stride;
    a.n_heads = p->n_heads, a.head_dim = p->head_dim, a.max_vis = max_vis;
    assert(p->head_dim <= IDX_MAX_HD && p->n_heads <= IDX_MAX_HEADS);
    a.groups = (const uint32_t *)(dev + grp_off);
    if (n_groups > 0 &&
        (st = launch_scores(c, "index_scores_kernel", index_scores_kernel, &a, n_groups,
                            (max_vis + IDX_TE - 1) / IDX_TE, IDX_THREADS,
                            scores_layout(p->n_heads, p->head_dim, group_rows).total,
                            c->stream)) != DI_OK)
        return st;
    a.groups = (const uint32_t *)(dev + blk_off);
    if (n_blocks == 0)
        return DI_OK;
    return launch_scores(c, "index_scores_block_kernel", index_scores_block_kernel, &a, n_blocks,
                         (max_vis + IDXB_SPAN - 1) / IDXB_SPAN, IDXB_THREADS,
                         block_layout(p->n_heads, p->head_dim).total, c->stream);
}

di_status cuda_op_index_candidates(void *ctx, const kern_index_candidates *p)
{
    cuda_ctx *c = (cuda_ctx *)ctx;
    di_status st = cuda_op_begin(c, p, "index_candidates");
    if (st != DI_OK)
        return st;
    if (p->block == 0)
        return cuda_fail(c, DI_EINVAL, "index_candidates: block is 0");
    if (p->n_rows == 0)
        return DI_OK;
    if (!p->scores || !p->n_visible || !p->mask)
        return cuda_fail(c, DI_EINVAL, "index_candidates: scores, n_visible or mask is NULL");
    uint32_t max_vis = 0;
    if ((st = max_visible(c, "index_candidates", p->n_visible, p->n_rows, p->stride, &max_vis)) != DI_OK)
        return st;
    uint32_t width = (max_vis + p->block - 1) / p->block;
    if (width <= p->mask_stride) /* a graph's bound (cuda_graph_bound) */
        width = (cuda_graph_bound(c, max_vis, (uint64_t)p->mask_stride * p->block) + p->block -
                 1) / p->block;
    if (width > p->mask_stride)
        return cuda_fail(c, DI_EINVAL, "index_candidates: %u blocks exceed mask_stride %zu", width,
                         p->mask_stride);
    if (width == 0)
        return DI_OK;
    if (p->n_rows > 0x7fffffffu || (size_t)p->n_rows * width / CUDA_THREADS >= 0x7fffffffu)
        return cuda_fail(c, DI_EINVAL, "index_candidates: %u rows x %u blocks", p->n_rows, width);
    cuda_meta_reset(c);
    size_t nv_off = 0;
    uint8_t *dev = NULL, *bs = NULL;
    if ((st = cuda_meta_push(c, p->n_visible, (size_t)p->n_rows * 4, &nv_off)) != DI_OK ||
        (st = cuda_meta_upload(c, 0, (size_t)p->n_rows * width * 4, &dev, &bs)) != DI_OK)
        return st;
    return launch_candidates(c, p, (const int32_t *)(dev + nv_off), (float *)bs, width, c->stream);
}

di_status cuda_op_index_topk(void *ctx, const kern_index_topk *p)
{
    cuda_ctx *c = (cuda_ctx *)ctx;
    di_status st = cuda_op_begin(c, p, "index_topk");
    if (st != DI_OK)
        return st;
    if (p->n_rows == 0 || p->k == 0)
        return DI_OK;
    if (!p->scores || !p->n_visible || !p->out)
        return cuda_fail(c, DI_EINVAL, "index_topk: scores, n_visible or out is NULL");
    if (p->n_rows > 0x7fffffffu)
        return cuda_fail(c, DI_EINVAL, "index_topk: %u rows", p->n_rows);
    uint32_t max_vis = 0;
    if ((st = max_visible(c, "index_topk", p->n_visible, p->n_rows, p->stride, &max_vis)) != DI_OK)
        return st;
    cuda_meta_reset(c);
    size_t nv_off = 0;
    uint8_t *dev = NULL;
    if ((st = cuda_meta_push(c, p->n_visible, (size_t)p->n_rows * 4, &nv_off)) != DI_OK ||
        (st = cuda_meta_upload(c, 0, 0, &dev, NULL)) != DI_OK)
        return st;
    return launch_topk(c, p, (const int32_t *)(dev + nv_off), c->stream);
}
