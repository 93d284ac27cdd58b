/* cache.cu: the cache writes of the attention (MODEL.md §2.5-2.7; byte layouts of
 * common/kvfmt/kv_layout.h): window ring entries (kern_ring_store), the ratio-r compressor
 * pooling with its pending-token state (kern_compress_pool) and the compressed entries with
 * their index keys in the paged blocks (kern_compressed_store). C twins:
 * kernels/cpu/ops_cache.c.
 *
 * Every output here is exact against the twin:
 *  - ring entries and compressed entries are the quantisation procedures (A), (C) and (B) of
 *    numfmt_dev.cuh, bit-identical to numfmt.c (one thread per 4 numbers, the block maximum by
 *    shuffles), packed low nibble first;
 *  - the pooling does the twin's double arithmetic per channel in the twin's order (max, exp,
 *    sum, then the weighted sum with fp32 weights), so results match except where CUDA's and the
 *    C library's double exp differ by an ulp right at an fp32 rounding tie;
 *  - commits and state saves are byte copies (cuda_copy_list), queued after the reads of the
 *    same call as in the twin.
 * Addresses (ring slots, blocks of the block tables, state slots) are resolved on the host
 * from the step metadata and uploaded with it. State slots and entries need not be aligned
 * (the tiny model's entries are 66 and 17 bytes), so bytes are written one at a time. */
#include <assert.h>
#include <cuda_runtime.h>
#include <math.h>
#include <stdint.h>

#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/cuda_internal.h"
#include "kernels/cuda/numfmt_dev.cuh"

#define POOL_RMAX 16 /* largest compression ratio (the twin's RMAX) */

/* ---- device helpers ---- */

/* An fp32 at any byte address (pending tokens follow the rings in a slot, unaligned). */
__device__ __forceinline__ float load_f32_any(const uint8_t *p)
{
    if (((uintptr_t)p & 3u) == 0)
        return *reinterpret_cast<const float *>(p);
    uint32_t u = (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
    return __uint_as_float(u);
}

/* ---- kernels ---- */

/* Procedure PROC on rows of n bf16 numbers: row e (src + e * n) goes to dst[e]: the codes
 * (n bytes for (A), n/2 packed bytes for (B) and (C)) then the scale bytes. One thread per 4
 * numbers; a block's threads are consecutive lanes (n is a multiple of the block). */
template <int PROC>
__global__ void quant_rows_kernel(const uint16_t *src, uint32_t n, uint32_t n_rows,
                                  uint8_t *const *dst, uint8_t *dst_base, size_t dst_stride)
{
    const uint32_t quads = n / 4, block = PROC == NUMFMT_FP4_B16 ? 16 : 32;
    size_t t = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    bool valid = t < (size_t)n_rows * quads;
    size_t row = valid ? t / quads : 0;
    uint32_t col = valid ? (uint32_t)(t % quads) * 4 : 0;
    float v[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    if (valid) {
        const uint16_t *s = src + row * n + col;
#pragma unroll
        for (int i = 0; i < 4; i++)
            v[i] = dev_bf16_to_f32(s[i]);
    }
    uint8_t code[4], se;
    float deq[4];
    quant4_group<PROC>(v, code, deq, se); /* every lane takes part in the shuffles */
    if (!valid)
        return;
    uint8_t *e = dst ? dst[row] : dst_base + row * dst_stride;
    if (PROC == NUMFMT_FP8_B32) {
#pragma unroll
        for (int i = 0; i < 4; i++)
            e[col + i] = code[i];
        if (col % 32 == 0)
            e[n + col / 32] = se;
    } else {
        e[col / 2] = (uint8_t)((code[0] & 0x0f) | (code[1] & 0x0f) << 4);
        e[col / 2 + 1] = (uint8_t)((code[2] & 0x0f) | (code[3] & 0x0f) << 4);
        if (col % block == 0)
            e[n / 2 + col / block] = se;
    }
}

/* One thread per (emitted entry, channel): the twin's pool_emit for one channel. src holds,
 * per entry, `ratio` pairs of addresses (a, g) of the group's tokens, oldest first. */
__global__ void compress_pool_kernel(const uint8_t *const *src, uint32_t ratio, uint32_t dim,
                                     uint32_t n_emit, uint16_t *latent)
{
    size_t t = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= (size_t)n_emit * dim)
        return;
    size_t e = t / dim;
    uint32_t d = (uint32_t)(t % dim);
    const uint8_t *const *s = src + e * 2 * ratio;
    float a[POOL_RMAX], g[POOL_RMAX];
    for (uint32_t i = 0; i < ratio; i++) {
        a[i] = load_f32_any(s[2 * i] + (size_t)d * 4);
        g[i] = load_f32_any(s[2 * i + 1] + (size_t)d * 4);
    }
    double mx = g[0];
    for (uint32_t i = 1; i < ratio; i++)
        mx = g[i] > mx ? g[i] : mx;
    double ex[POOL_RMAX], sum = 0.0;
    for (uint32_t i = 0; i < ratio; i++) {
        ex[i] = exp((double)g[i] - mx);
        sum += ex[i];
    }
    double acc = 0.0;
    for (uint32_t i = 0; i < ratio; i++)
        acc = __dadd_rn(acc, __dmul_rn((double)(float)(ex[i] / sum), (double)a[i]));
    latent[e * dim + d] = dev_f32_to_bf16((float)acc);
}

/* ---- launchers ---- */

static unsigned blocks_for(size_t threads)
{
    return (unsigned)((threads + CUDA_THREADS - 1) / CUDA_THREADS);
}

/* rows [n_rows, n] quantised by fmt into dst[row] (a device array) or dst_base + row * stride */
static di_status launch_quant_rows(cuda_ctx *c, kern_qfmt fmt, const uint16_t *src, uint32_t n,
                                   uint32_t n_rows, uint8_t *const *dst, uint8_t *dst_base,
                                   size_t dst_stride, cudaStream_t stream)
{
    assert(n % (fmt == KERN_Q_FP4_B16 ? 16 : 32) == 0);
    size_t threads = (size_t)n_rows * (n / 4);
    if (blocks_for(threads) == 0 || threads / CUDA_THREADS >= 0x7fffffffu)
        return cuda_fail(c, DI_EINVAL, "quantise: %u rows of %u numbers", n_rows, n);
    unsigned grid = blocks_for(threads);
    if (fmt == KERN_Q_FP8_B32)
        cuda_launch(c, "quant_rows_kernel", quant_rows_kernel<NUMFMT_FP8_B32>, grid, CUDA_THREADS,
                    0, stream, src, n, n_rows, dst, dst_base, dst_stride);
    else if (fmt == KERN_Q_FP4_B32)
        cuda_launch(c, "quant_rows_kernel", quant_rows_kernel<NUMFMT_FP4_B32>, grid, CUDA_THREADS,
                    0, stream, src, n, n_rows, dst, dst_base, dst_stride);
    else
        cuda_launch(c, "quant_rows_kernel", quant_rows_kernel<NUMFMT_FP4_B16>, grid, CUDA_THREADS,
                    0, stream, src, n, n_rows, dst, dst_base, dst_stride);
    return cuda_launched(c, "quant_rows_kernel");
}

static di_status launch_compress_pool(cuda_ctx *c, const uint8_t *const *src, const kern_compress_pool *p,
                                      cudaStream_t stream)
{
    size_t threads = (size_t)p->n_emit * p->dim;
    if (threads / CUDA_THREADS >= 0x7fffffffu)
        return cuda_fail(c, DI_EINVAL, "compress_pool: %u entries of %u", p->n_emit, p->dim);
    cuda_launch(c, "compress_pool_kernel", compress_pool_kernel, blocks_for(threads), CUDA_THREADS,
                0, stream, src, p->ratio, p->dim, p->n_emit, p->latent);
    return cuda_launched(c, "compress_pool_kernel");
}

/* ---- shared checks ---- */

/* DI_EINVAL unless every sequence's rows lie inside the step's n_rows and its first position is
 * not negative. */
static di_status check_seq_rows(cuda_ctx *c, const char *op, const kern_seq *seqs, uint32_t n,
                                uint32_t n_rows)
{
    for (uint32_t s = 0; s < n; s++) {
        const kern_seq *q = &seqs[s];
        if ((uint64_t)q->row0 + q->n_rows > n_rows || q->pos0 < 0)
            return cuda_fail(c, DI_EINVAL, "%s: sequence %u has rows %u..%llu outside the %u rows "
                             "or position %lld negative", op, s, q->row0,
                             (unsigned long long)q->row0 + q->n_rows, n_rows, (long long)q->pos0);
    }
    return DI_OK;
}

/* ---- ring_store ---- */

/* Copy items of the commit: the last ring_positions rows of each sequence with a slot. */
static di_status ring_commit_items(cuda_ctx *c, const kern_ring_store *p, size_t eb, size_t *off,
                                   uint32_t *n, uint64_t *bits)
{
    *n = 0;
    di_status st = check_seq_rows(c, "ring_store", p->seqs, p->n_seqs, p->n_rows);
    if (st != DI_OK)
        return st;
    for (uint32_t s = 0; s < p->n_seqs; s++)
        if (p->seqs[s].slot)
            *n += p->seqs[s].n_rows > p->ring_positions ? p->ring_positions : p->seqs[s].n_rows;
    st = cuda_meta_push(c, NULL, (size_t)(*n ? *n : 1) * sizeof(cuda_copy_item), off);
    if (st != DI_OK)
        return st;
    cuda_copy_item *it = (cuda_copy_item *)cuda_meta_at(c, *off);
    uint32_t k = 0;
    for (uint32_t s = 0; s < p->n_seqs; s++) {
        const kern_seq *q = &p->seqs[s];
        if (!q->slot)
            continue;
        uint32_t first = q->n_rows > p->ring_positions ? q->n_rows - p->ring_positions : 0;
        for (uint32_t i = first; i < q->n_rows; i++, k++) {
            uint64_t pos = (uint64_t)(q->pos0 + i);
            it[k].src = p->local + (size_t)(q->row0 + i) * eb;
            it[k].dst = q->slot + p->ring_offset + (size_t)(pos % p->ring_positions) * eb;
            *bits |= (uint64_t)(uintptr_t)it[k].src | (uint64_t)(uintptr_t)it[k].dst;
        }
    }
    return DI_OK;
}

di_status cuda_op_ring_store(void *ctx, const kern_ring_store *p)
{
    cuda_ctx *c = (cuda_ctx *)ctx;
    di_status st = cuda_op_begin(c, p, "ring_store");
    if (st != DI_OK)
        return st;
    if (p->dim == 0 || p->dim % 32 != 0 || p->ring_positions == 0)
        return cuda_fail(c, DI_EINVAL, "ring_store: dim %u must be a positive multiple of 32 and "
                         "ring_positions %u positive", p->dim, p->ring_positions);
    if (p->n_rows == 0 || (!p->kv && !p->commit))
        return DI_OK;
    if (!p->local || (p->commit && p->n_seqs && !p->seqs))
        return cuda_fail(c, DI_EINVAL, "ring_store: local or seqs is NULL");
    size_t eb = (size_t)p->dim + p->dim / 32;
    if (p->kv && (st = launch_quant_rows(c, KERN_Q_FP8_B32, p->kv, p->dim, p->n_rows, NULL,
                                         p->local, eb, c->stream)) != DI_OK)
        return st;
    if (!p->commit)
        return DI_OK;
    cuda_meta_reset(c);
    size_t off = 0;
    uint32_t n = 0;
    uint64_t bits = eb;
    uint8_t *dev = NULL;
    if ((st = ring_commit_items(c, p, eb, &off, &n, &bits)) != DI_OK || n == 0)
        return st;
    if ((st = cuda_meta_upload(c, 0, 0, &dev, NULL)) != DI_OK)
        return st;
    return cuda_copy_list(c, (const cuda_copy_item *)(dev + off), n, eb, cuda_align_of(bits));
}

/* ---- compress_pool ---- */

/* Per emitted entry, the (a, g) addresses of its group's tokens: this step's rows or the
 * sequence's pending-token state. */
static di_status pool_sources(cuda_ctx *c, const kern_compress_pool *p, size_t *off)
{
    size_t tok = (size_t)2 * p->dim * sizeof(float);
    di_status st = cuda_meta_push(c, NULL, (size_t)p->n_emit * 2 * p->ratio * sizeof(uint8_t *), off);
    if (st != DI_OK)
        return st;
    const uint8_t **src = (const uint8_t **)cuda_meta_at(c, *off);
    for (uint32_t e = 0; e < p->n_emit; e++) {
        int32_t row = p->emit_row[e];
        if (row < 0 || (uint32_t)row >= p->n_rows)
            return cuda_fail(c, DI_EINVAL, "compress_pool: emit_row[%u] = %d outside the %u rows",
                             e, row, p->n_rows);
        int32_t si = p->row_seq[row];
        if (si < 0 || (uint32_t)si >= p->n_seqs)
            return cuda_fail(c, DI_EINVAL, "compress_pool: row %d in sequence %d of %u", row, si,
                             p->n_seqs);
        const kern_seq *q = &p->seqs[si];
        int64_t pos = q->pos0 + (row - (int64_t)q->row0);
        if (row < (int64_t)q->row0 || row >= (int64_t)q->row0 + q->n_rows || (pos + 1) % p->ratio)
            return cuda_fail(c, DI_EINVAL, "compress_pool: emit row %d (position %lld) does not "
                             "complete a group of %u in sequence %d", row, (long long)pos,
                             p->ratio, si);
        int64_t start = pos + 1 - p->ratio;
        if (start < q->pos0 && (!q->slot || q->pos0 - start > p->state_tokens))
            return cuda_fail(c, DI_EINVAL, "compress_pool: position %lld of sequence %d needs "
                             "pending tokens from before %lld that its slot does not hold",
                             (long long)pos, si, (long long)q->pos0);
        for (uint32_t i = 0; i < p->ratio; i++) {
            int64_t tp = start + i;
            const uint8_t *a, *g;
            if (tp >= q->pos0) {
                size_t r = q->row0 + (size_t)(tp - q->pos0);
                a = (const uint8_t *)(p->a + r * p->dim);
                g = (const uint8_t *)(p->g + r * p->dim);
            } else {
                a = q->slot + p->state_offset + (size_t)((uint64_t)tp % p->state_tokens) * tok;
                g = a + (size_t)p->dim * sizeof(float);
            }
            src[((size_t)e * p->ratio + i) * 2] = a;
            src[((size_t)e * p->ratio + i) * 2 + 1] = g;
        }
    }
    return DI_OK;
}

/* Copy items saving each sequence's last state_tokens rows (a then g) into its slot. */
static di_status pool_state_items(cuda_ctx *c, const kern_compress_pool *p, size_t *off,
                                  uint32_t *n, uint64_t *bits)
{
    size_t row_bytes = (size_t)p->dim * sizeof(float), tok = 2 * row_bytes;
    *n = 0;
    di_status st = check_seq_rows(c, "compress_pool", p->seqs, p->n_seqs, p->n_rows);
    if (st != DI_OK)
        return st;
    for (uint32_t s = 0; s < p->n_seqs; s++) /* no slot (placeholder rows): nothing saved */
        if (p->seqs[s].slot)
            *n += 2 * (p->seqs[s].n_rows > p->state_tokens ? p->state_tokens : p->seqs[s].n_rows);
    st = cuda_meta_push(c, NULL, (size_t)(*n ? *n : 1) * sizeof(cuda_copy_item), off);
    if (st != DI_OK)
        return st;
    cuda_copy_item *it = (cuda_copy_item *)cuda_meta_at(c, *off);
    uint32_t k = 0;
    for (uint32_t s = 0; s < p->n_seqs; s++) {
        const kern_seq *q = &p->seqs[s];
        if (!q->slot)
            continue;
        uint32_t first = q->n_rows > p->state_tokens ? q->n_rows - p->state_tokens : 0;
        for (uint32_t i = first; i < q->n_rows; i++) {
            uint64_t pos = (uint64_t)(q->pos0 + i);
            uint8_t *dst = q->slot + p->state_offset + (size_t)(pos % p->state_tokens) * tok;
            it[k].src = (const uint8_t *)(p->a + (size_t)(q->row0 + i) * p->dim);
            it[k++].dst = dst;
            it[k].src = (const uint8_t *)(p->g + (size_t)(q->row0 + i) * p->dim);
            it[k++].dst = dst + row_bytes;
            *bits |= (uint64_t)(uintptr_t)dst | (uint64_t)(uintptr_t)it[k - 2].src |
                     (uint64_t)(uintptr_t)it[k - 1].src;
        }
    }
    return DI_OK;
}

di_status cuda_op_compress_pool(void *ctx, const kern_compress_pool *p)
{
    cuda_ctx *c = (cuda_ctx *)ctx;
    di_status st = cuda_op_begin(c, p, "compress_pool");
    if (st != DI_OK)
        return st;
    if (p->ratio < 2 || p->ratio > POOL_RMAX || p->state_tokens < p->ratio - 1 || p->dim == 0)
        return cuda_fail(c, DI_EINVAL, "compress_pool: ratio %u outside [2, %d], state_tokens %u "
                         "below ratio - 1, or dim %u", p->ratio, POOL_RMAX, p->state_tokens, p->dim);
    if (p->n_rows == 0)
        return DI_OK;
    if (!p->a || !p->g || !p->seqs || !p->row_seq || (p->n_emit && (!p->emit_row || !p->latent)))
        return cuda_fail(c, DI_EINVAL, "compress_pool: a tensor or metadata pointer is NULL");
    cuda_meta_reset(c);
    size_t src_off = 0, state_off = 0;
    uint32_t n_state = 0;
    uint64_t bits = (size_t)p->dim * sizeof(float);
    uint8_t *dev = NULL;
    if ((st = pool_sources(c, p, &src_off)) != DI_OK ||
        (st = pool_state_items(c, p, &state_off, &n_state, &bits)) != DI_OK ||
        (st = cuda_meta_upload(c, 0, 0, &dev, NULL)) != DI_OK)
        return st;
    /* emit first: the state saves below may overwrite pending tokens these groups read */
    if (p->n_emit &&
        (st = launch_compress_pool(c, (const uint8_t *const *)(dev + src_off), p, c->stream)) != DI_OK)
        return st;
    return cuda_copy_list(c, (const cuda_copy_item *)(dev + state_off), n_state,
                          (size_t)p->dim * sizeof(float), cuda_align_of(bits));
}

/* ---- compressed_store ---- */

/* Destination address of every entry's main part (and index key) in its block. */
static di_status cstore_targets(cuda_ctx *c, const kern_compressed_store *p, size_t *main_off,
                                size_t *index_off)
{
    const kern_kv_pool *pool = &p->pool;
    di_status st = cuda_meta_push(c, NULL, (size_t)p->n_entries * sizeof(uint8_t *), main_off);
    if (st == DI_OK && p->index)
        st = cuda_meta_push(c, NULL, (size_t)p->n_entries * sizeof(uint8_t *), index_off);
    if (st != DI_OK)
        return st;
    for (uint32_t e = 0; e < p->n_entries; e++) {
        int32_t si = p->entry_seq[e];
        int64_t j = p->entry_id[e];
        if (si < 0 || j < 0)
            return cuda_fail(c, DI_EINVAL, "compressed_store: entry %u has sequence %d, id %lld",
                             e, si, (long long)j);
        const kern_seq *q = &p->seqs[si];
        uint64_t b = (uint64_t)j / pool->entries_per_block;
        if (b >= q->n_blocks || !q->blocks)
            return cuda_fail(c, DI_EINVAL, "compressed_store: entry %lld of sequence %d needs "
                             "block-table entry %llu of %u", (long long)j, si,
                             (unsigned long long)b, q->n_blocks);
        uint8_t *blk = pool->blocks + (size_t)q->blocks[b] * pool->block_bytes;
        size_t slot = (size_t)((uint64_t)j % pool->entries_per_block);
        ((uint8_t **)cuda_meta_at(c, *main_off))[e] =
            blk + pool->main_offset + slot * pool->main_entry_bytes;
        if (p->index)
            ((uint8_t **)cuda_meta_at(c, *index_off))[e] =
                blk + pool->index_offset + slot * pool->index_entry_bytes;
    }
    return DI_OK;
}

di_status cuda_op_compressed_store(void *ctx, const kern_compressed_store *p)
{
    cuda_ctx *c = (cuda_ctx *)ctx;
    di_status st = cuda_op_begin(c, p, "compressed_store");
    if (st != DI_OK)
        return st;
    if (p->dim == 0 || p->dim % 32 != 0 || (p->index && (p->index_dim == 0 || p->index_dim % 32)))
        return cuda_fail(c, DI_EINVAL, "compressed_store: dim %u and index_dim %u must be positive "
                         "multiples of 32", p->dim, p->index_dim);
    if (p->n_entries == 0)
        return DI_OK;
    if (!p->main || !p->entry_id || !p->entry_seq || !p->seqs || !p->pool.blocks ||
        p->pool.entries_per_block == 0)
        return cuda_fail(c, DI_EINVAL, "compressed_store: a tensor or metadata pointer is NULL, "
                         "or the pool has no entries per block");
    if (p->pool.main_entry_bytes < (size_t)p->dim / 2 + p->dim / 16 ||
        (p->index && p->pool.index_entry_bytes < (size_t)p->index_dim / 2 + p->index_dim / 32))
        return cuda_fail(c, DI_EINVAL, "compressed_store: entry sizes %zu, %zu too small for dims "
                         "%u, %u", p->pool.main_entry_bytes, p->pool.index_entry_bytes, p->dim,
                         p->index_dim);
    cuda_meta_reset(c);
    size_t main_off = 0, index_off = 0;
    uint8_t *dev = NULL;
    if ((st = cstore_targets(c, p, &main_off, &index_off)) != DI_OK ||
        (st = cuda_meta_upload(c, 0, 0, &dev, NULL)) != DI_OK)
        return st;
    st = launch_quant_rows(c, KERN_Q_FP4_B16, p->main, p->dim, p->n_entries,
                           (uint8_t *const *)(dev + main_off), NULL, 0, c->stream);
    if (st == DI_OK && p->index)
        st = launch_quant_rows(c, KERN_Q_FP4_B32, p->index, p->index_dim, p->n_entries,
                               (uint8_t *const *)(dev + index_off), NULL, 0, c->stream);
    return st;
}
