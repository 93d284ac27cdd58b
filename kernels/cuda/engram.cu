/* engram.cu: Engram (MODEL.md §2.9): the n-gram hashing (kern_engram_hash), the table lookup
 * (kern_engram_lookup) and the gated residual update (kern_engram_gate). C twins:
 * kernels/cpu/ops_engram.c.
 *
 *  - hash: the lookback tokens of every row (the step's ids or the sequence's history, mapped
 *    to compressed ids, padded from the first position before 0 on) are resolved on the host,
 *    where the ids, the map and the constants live; one device thread per output then does the
 *    rolling uint64 hash, modulo and offset. Exact. With ids_dev (the step's ids in device
 *    memory, one step ahead) the step's own rows are resolved by the kernel through a device
 *    copy of the map; an id outside the vocabulary raises the error flag.
 *  - lookup: one block per (row, column), E4M3 x UE8M0 into bf16: exact. A table generated on
 *    demand (row_fn) is served by reading the hash ids back, generating the rows on the host
 *    and uploading them (one synchronisation per call). Row ids outside the table give NaN
 *    (the twin asserts).
 *  - gate: one block per (row, copy): the three sums (h^2, key^2, h * w * key) in double in
 *    another order than the twin (every product is exact in double), then the twin's scalar
 *    steps and roundings on one thread, then the update in the twin's double expression.
 *    Tolerance: bf16 1 ulp.
 */
#include <cuda_runtime.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/cuda_internal.h"
#include "kernels/cuda/numfmt_dev.cuh"

#define ENGRAM_MAX_NGRAM 8            /* the twin's limit */
#define GATE_WARPS (CUDA_THREADS / 32)

/* ---- device helpers ---- */

__device__ __forceinline__ double warp_sum_e(double v)
{
    for (int off = 16; off > 0; off /= 2)
        v += __shfl_xor_sync(0xffffffffu, v, off);
    return v;
}

/* ---- kernels ---- */

/* One thread per (row, layer, column): R_0 = tok_0 * M_0, R_i = R_{i-1} ^ (tok_i * M_i) up to
 * the column's n-gram order, then R mod prime + offset. tok [T, max_ngram]; constants
 * [n_layers, ...] in device memory. */
__global__ void engram_hash_kernel(const uint64_t *tok, const uint64_t *mult, const uint64_t *primes,
                                   const uint64_t *offsets, uint32_t n_rows, uint32_t n_layers,
                                   uint32_t max_ngram, uint32_t n_heads, int64_t *out,
                                   const int32_t *ids_dev, const int32_t *map, uint32_t vocab,
                                   int *error)
{
    const uint32_t cols = (max_ngram - 1) * n_heads;
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (size_t)n_rows * n_layers * cols)
        return;
    uint32_t col = (uint32_t)(i % cols), l = (uint32_t)((i / cols) % n_layers);
    size_t t = i / cols / n_layers;
    uint32_t n = col / n_heads + 1; /* n-gram order n + 1 */
    const uint64_t *tk = tok + t * max_ngram, *m = mult + (size_t)l * max_ngram;
    uint64_t v[ENGRAM_MAX_NGRAM];
    for (uint32_t k = 0; k <= n; k++) {
        v[k] = tk[k];
        if (v[k] >> 63) { /* ids_dev: the id of step row v & ~bit 63, mapped here */
            int32_t id = ids_dev[v[k] & 0x7fffffffu];
            if (id < 0 || (uint32_t)id >= vocab) {
                atomicOr(error, CUDA_ERR_DEV_ID);
                id = 0;
            }
            v[k] = (uint64_t)map[id];
        }
    }
    uint64_t r = v[0] * m[0];
    for (uint32_t k = 1; k <= n; k++)
        r ^= v[k] * m[k];
    size_t c = (size_t)l * cols + col;
    out[i] = (int64_t)(r % primes[c] + offsets[c]);
}

/* One block per (row, column): out[t, col*hd + i] = e4m3(code) * ue8m0(scale), bf16. rows:
 * the table's row of each (row, column) from hash (stride hash_stride), or NULL with
 * direct = codes staged in (row, column) order. */
__global__ void engram_lookup_kernel(const int64_t *hash, size_t hash_stride, const uint8_t *table,
                                     const uint8_t *scale, uint64_t table_rows, uint32_t n_cols,
                                     uint32_t hd, int direct, uint16_t *out)
{
    const size_t t = blockIdx.x / n_cols, col = blockIdx.x % n_cols;
    uint16_t *o = out + ((size_t)t * n_cols + col) * hd;
    int64_t row = direct ? (int64_t)blockIdx.x : hash[t * hash_stride + col];
    if (!direct && (row < 0 || (uint64_t)row >= table_rows)) {
        for (uint32_t i = threadIdx.x; i < hd; i += blockDim.x)
            o[i] = 0x7fc0; /* NaN: a row outside the table */
        return;
    }
    const uint8_t *cd = table + (size_t)row * hd, *sc = scale + (size_t)row * (hd / 32);
    for (uint32_t i = threadIdx.x; i < hd; i += blockDim.x)
        o[i] = dev_f32_to_bf16(dev_e4m3_decode(cd[i]) * dev_ue8m0_decode(sc[i / 32]));
}

/* One block per (row, copy). */
__global__ void engram_gate_kernel(kern_engram_gate p)
{
    __shared__ double part[GATE_WARPS][3];
    __shared__ double gate_s;
    const uint32_t D = p.dim, hc = p.n_copies, c = blockIdx.x % hc;
    const size_t t = blockIdx.x / hc;
    uint16_t *h = p.h + (t * hc + c) * D;
    const uint16_t *key = p.kv + t * (hc + 1) * D + (size_t)c * D;
    const uint16_t *value = p.kv + t * (hc + 1) * D + (size_t)hc * D;
    const uint16_t *qw = p.q_weight + (size_t)c * D, *kw = p.k_weight + (size_t)c * D;
    double sh = 0.0, sk = 0.0, sd = 0.0;
    for (uint32_t d = threadIdx.x; d < D; d += blockDim.x) {
        float hf = dev_bf16_to_f32(h[d]), kf = dev_bf16_to_f32(key[d]);
        /* w = fp32(q * k) is exact; fp32(h * w) too (8 + 16 significant bits) */
        float hw = __fmul_rn(hf, __fmul_rn(dev_bf16_to_f32(qw[d]), dev_bf16_to_f32(kw[d])));
        sh += (double)hf * (double)hf;
        sk += (double)kf * (double)kf;
        sd += (double)hw * (double)kf;
    }
    sh = warp_sum_e(sh), sk = warp_sum_e(sk), sd = warp_sum_e(sd);
    const uint32_t lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    if (lane == 0) {
        part[warp][0] = sh;
        part[warp][1] = sk;
        part[warp][2] = sd;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        double th = 0.0, tk = 0.0, td = 0.0;
        for (uint32_t w = 0; w < GATE_WARPS; w++) {
            th += part[w][0];
            tk += part[w][1];
            td += part[w][2];
        }
        /* the twin: rstd per copy in double over fp32 means; dot = fp32(fp32(fp32(sum) *
         * fp32(r_h * r_k)) / fp32(sqrt(D))); gate = fp32(sigmoid(sign * sqrt(max(|dot|, clamp)))) */
        double rh = 1.0 / sqrt((double)(float)(th / D) + p.eps);
        double rk = 1.0 / sqrt((double)(float)(tk / D) + p.eps);
        float dot = __fdiv_rn(__fmul_rn((float)td, (float)(rh * rk)), (float)sqrt((double)D));
        double mag = fabs((double)dot) > p.clamp ? fabs((double)dot) : p.clamp;
        double sgn = dot > 0.0f ? 1.0 : (dot < 0.0f ? -1.0 : 0.0);
        gate_s = (double)(float)(1.0 / (1.0 + exp(-(sgn * sqrt(mag)))));
    }
    __syncthreads();
    const double gate = gate_s;
    for (uint32_t d = threadIdx.x; d < D; d += blockDim.x) {
        double hv = (double)dev_bf16_to_f32(h[d]);
        h[d] = dev_f32_to_bf16((float)__dadd_rn(hv, __dmul_rn(gate, (double)dev_bf16_to_f32(value[d]))));
    }
}

/* ---- launchers ---- */

static di_status launch_hash(cuda_ctx *c, const kern_engram_hash *p, const uint64_t *tok,
                             const uint64_t *mult, const uint64_t *primes, const uint64_t *offsets,
                             const int32_t *map, cudaStream_t stream)
{
    size_t n = (size_t)p->n_rows * p->n_layers * (p->max_ngram - 1) * p->n_heads;
    if (n / CUDA_THREADS >= 0x7fffffffu)
        return cuda_fail(c, DI_EINVAL, "engram_hash: %zu outputs", n);
    cuda_launch(c, "engram_hash_kernel", engram_hash_kernel,
                (unsigned)((n + CUDA_THREADS - 1) / CUDA_THREADS), CUDA_THREADS, 0, stream, tok,
                mult, primes, offsets, p->n_rows, p->n_layers, p->max_ngram, p->n_heads, p->out,
                p->ids_dev, map, p->vocab, c->err_flag_dev);
    return cuda_launched(c, "engram_hash_kernel");
}

static di_status launch_lookup(cuda_ctx *c, const kern_engram_lookup *p, const uint8_t *table,
                               const uint8_t *scale, int direct, cudaStream_t stream)
{
    cuda_launch(c, "engram_lookup_kernel", engram_lookup_kernel, p->n_rows * p->n_cols,
                CUDA_THREADS, 0, stream, p->hash, p->hash_stride, table, scale, p->table_rows,
                p->n_cols, p->head_dim, direct, p->out);
    return cuda_launched(c, "engram_lookup_kernel");
}

static di_status launch_gate(cuda_ctx *c, const kern_engram_gate *p, cudaStream_t stream)
{
    cuda_launch(c, "engram_gate_kernel", engram_gate_kernel, p->n_rows * p->n_copies, CUDA_THREADS,
                0, stream, *p);
    return cuda_launched(c, "engram_gate_kernel");
}

/* ---- table entries ---- */

/* The row's lookback tokens (the twin's token_at and sticky padding) into tok[max_ngram]. */
static di_status row_tokens(cuda_ctx *c, const kern_engram_hash *p, uint32_t t, uint64_t *tok)
{
    int32_t si = p->row_seq[t];
    if (si < 0)
        return cuda_fail(c, DI_EINVAL, "engram_hash: row_seq[%u] = %d", t, si);
    const kern_seq *q = &p->seqs[si];
    if (t < q->row0 || t >= q->row0 + q->n_rows)
        return cuda_fail(c, DI_EINVAL, "engram_hash: row %u is not among sequence %d's rows", t, si);
    int64_t pos = q->pos0 + (t - q->row0);
    int blocked = 0;
    for (uint32_t i = 0; i < p->max_ngram; i++) {
        int64_t at = pos - (int64_t)i;
        blocked |= at < 0;
        if (blocked) {
            tok[i] = (uint64_t)p->pad_id;
            continue;
        }
        int32_t id;
        if (at >= q->pos0 && p->ids_dev) { /* resolved by the kernel from device memory */
            tok[i] = (1ull << 63) | (uint64_t)(q->row0 + (at - q->pos0));
            continue;
        }
        if (at >= q->pos0) {
            id = p->ids[q->row0 + (at - q->pos0)];
        } else {
            int64_t hi = at - (q->pos0 - (int64_t)q->n_history);
            if (hi < 0 || !q->history)
                return cuda_fail(c, DI_EINVAL, "engram_hash: row %u needs position %lld, before "
                                 "the sequence's %u history tokens", t, (long long)at, q->n_history);
            id = q->history[hi];
        }
        if (id < 0 || (uint32_t)id >= p->vocab)
            return cuda_fail(c, DI_EINVAL, "engram_hash: token %d at position %lld outside the "
                             "vocabulary %u", id, (long long)at, p->vocab);
        tok[i] = (uint64_t)p->token_map[id];
    }
    return DI_OK;
}

/* The token map in device memory for ids_dev: copied once per map (compared with the
 * caller's on every call, replaced when it differs). */
static di_status token_map_dev(cuda_ctx *c, const kern_engram_hash *p, const int32_t **out)
{
    size_t bytes = (size_t)p->vocab * sizeof(int32_t);
    if (c->tmap_dev && c->tmap_vocab == p->vocab &&
        memcmp(c->tmap_host, p->token_map, bytes) == 0) {
        *out = c->tmap_dev;
        return DI_OK;
    }
    di_status st = cuda_graph_break(c); /* queued work may read the old copy */
    if (st == DI_OK)
        st = cuda_check(c, cudaStreamSynchronize(c->stream), "engram_hash: token map");
    if (st != DI_OK)
        return st;
    cuda_sync_check(c);
    cudaFree(c->tmap_dev);
    free(c->tmap_host);
    c->tmap_dev = NULL, c->tmap_vocab = 0;
    c->tmap_host = (int32_t *)malloc(bytes);
    if (!c->tmap_host || cudaMalloc((void **)&c->tmap_dev, bytes) != cudaSuccess) {
        cudaGetLastError();
        c->tmap_dev = NULL;
        return cuda_fail(c, DI_ENOMEM, "engram_hash: token map of %u ids", p->vocab);
    }
    memcpy(c->tmap_host, p->token_map, bytes);
    st = cuda_check(c, cudaMemcpy(c->tmap_dev, p->token_map, bytes, cudaMemcpyHostToDevice),
                    "engram_hash: token map upload");
    if (st == DI_OK)
        c->tmap_vocab = p->vocab;
    if (st == DI_OK)
        st = cuda_graph_resume(c);
    *out = c->tmap_dev;
    return st;
}

di_status cuda_op_engram_hash(void *ctx, const kern_engram_hash *p)
{
    cuda_ctx *c = (cuda_ctx *)ctx;
    di_status st = cuda_op_begin(c, p, "engram_hash");
    if (st != DI_OK)
        return st;
    if (p->max_ngram < 2 || p->max_ngram > ENGRAM_MAX_NGRAM || p->n_heads == 0 || p->n_layers == 0)
        return cuda_fail(c, DI_EINVAL, "engram_hash: max_ngram %u outside [2, %d], or no heads or "
                         "layers", p->max_ngram, ENGRAM_MAX_NGRAM);
    if (p->n_rows == 0)
        return DI_OK;
    if ((!p->ids && !p->ids_dev) || !p->row_seq || !p->seqs || !p->token_map ||
        !p->multipliers || !p->primes || !p->offsets || !p->out)
        return cuda_fail(c, DI_EINVAL, "engram_hash: a metadata or output pointer is NULL");
    if (p->n_rows > 0x7fffffffu)
        return cuda_fail(c, DI_EINVAL, "engram_hash: %u rows", p->n_rows);
    const int32_t *map = NULL;
    if (p->ids_dev && (st = token_map_dev(c, p, &map)) != DI_OK)
        return st;
    size_t cols = (size_t)(p->max_ngram - 1) * p->n_heads;
    for (size_t i = 0; i < p->n_layers * cols; i++)
        if (p->primes[i] == 0)
            return cuda_fail(c, DI_EINVAL, "engram_hash: prime %zu is 0", i);
    cuda_meta_reset(c);
    size_t tok_off = 0, m_off = 0, p_off = 0, o_off = 0;
    if ((st = cuda_meta_push(c, NULL, (size_t)p->n_rows * p->max_ngram * 8, &tok_off)) != DI_OK)
        return st;
    for (uint32_t t = 0; t < p->n_rows; t++)
        if ((st = row_tokens(c, p, t, (uint64_t *)cuda_meta_at(c, tok_off) + (size_t)t * p->max_ngram)) != DI_OK)
            return st;
    uint8_t *dev = NULL;
    if ((st = cuda_meta_push(c, p->multipliers, (size_t)p->n_layers * p->max_ngram * 8, &m_off)) != DI_OK ||
        (st = cuda_meta_push(c, p->primes, p->n_layers * cols * 8, &p_off)) != DI_OK ||
        (st = cuda_meta_push(c, p->offsets, p->n_layers * cols * 8, &o_off)) != DI_OK ||
        (st = cuda_meta_upload(c, 0, 0, &dev, NULL)) != DI_OK)
        return st;
    return launch_hash(c, p, (const uint64_t *)(dev + tok_off), (const uint64_t *)(dev + m_off),
                       (const uint64_t *)(dev + p_off), (const uint64_t *)(dev + o_off), map,
                       c->stream);
}

/* A table generated on demand: the hash ids read back, the rows made on the host and staged in
 * the work buffer in (row, column) order. */
static di_status lookup_generated(cuda_ctx *c, const kern_engram_lookup *p)
{
    size_t n = (size_t)p->n_rows * p->n_cols, hd = p->head_dim;
    int64_t *hash = (int64_t *)malloc((size_t)p->n_rows * p->hash_stride * 8);
    uint8_t *stage = (uint8_t *)malloc(n * (hd + hd / 32));
    di_status st = hash && stage ? DI_OK : cuda_fail(c, DI_ENOMEM, "engram_lookup: host rows");
    if (st == DI_OK)
        st = cuda_download(c, hash, p->hash, ((size_t)(p->n_rows - 1) * p->hash_stride + p->n_cols) * 8);
    for (size_t i = 0; st == DI_OK && i < n; i++) {
        int64_t row = hash[(i / p->n_cols) * p->hash_stride + i % p->n_cols];
        if (row < 0 || (uint64_t)row >= p->table_rows)
            st = cuda_fail(c, DI_EINVAL, "engram_lookup: row %lld outside the table of %llu",
                           (long long)row, (unsigned long long)p->table_rows);
        else
            p->row_fn(p->row_userdata, (uint64_t)row, stage + i * hd, stage + n * hd + i * (hd / 32));
    }
    uint8_t *w = NULL;
    if (st == DI_OK)
        st = cuda_work(c, n * (hd + hd / 32), &w);
    if (st == DI_OK)
        st = cuda_upload(c, w, stage, n * (hd + hd / 32)); /* a captured segment's copy reads
                                                             * the pinned arena, not stage */
    free(hash);
    free(stage);
    if (st == DI_OK)
        st = launch_lookup(c, p, w, w + n * hd, 1, c->stream);
    return st;
}

di_status cuda_op_engram_lookup(void *ctx, const kern_engram_lookup *p)
{
    cuda_ctx *c = (cuda_ctx *)ctx;
    di_status st = cuda_op_begin(c, p, "engram_lookup");
    if (st != DI_OK)
        return st;
    if (p->head_dim == 0 || p->head_dim % 32)
        return cuda_fail(c, DI_EINVAL, "engram_lookup: head_dim %u is not a positive multiple of 32",
                         p->head_dim);
    if (p->n_rows == 0 || p->n_cols == 0)
        return DI_OK;
    if (!p->hash || !p->out || (!p->table && !p->row_fn) || (p->table && !p->table_scale))
        return cuda_fail(c, DI_EINVAL, "engram_lookup: hash, out, or both the table and row_fn "
                         "are NULL");
    if (p->hash_stride < p->n_cols || (uint64_t)p->n_rows * p->n_cols > 0x7fffffffu)
        return cuda_fail(c, DI_EINVAL, "engram_lookup: hash_stride %zu below %u columns, or %u "
                         "rows too many", p->hash_stride, p->n_cols, p->n_rows);
    if (!p->table)
        return lookup_generated(c, p);
    return launch_lookup(c, p, p->table, p->table_scale, 0, c->stream);
}

di_status cuda_op_engram_gate(void *ctx, const kern_engram_gate *p)
{
    cuda_ctx *c = (cuda_ctx *)ctx;
    di_status st = cuda_op_begin(c, p, "engram_gate");
    if (st != DI_OK)
        return st;
    if (p->n_rows == 0 || p->n_copies == 0 || p->dim == 0)
        return DI_OK;
    if (!p->h || !p->kv || !p->q_weight || !p->k_weight)
        return cuda_fail(c, DI_EINVAL, "engram_gate: h, kv or a weight is NULL");
    if ((uint64_t)p->n_rows * p->n_copies > 0x7fffffffu)
        return cuda_fail(c, DI_EINVAL, "engram_gate: %u rows x %u copies", p->n_rows, p->n_copies);
    return launch_gate(c, p, c->stream);
}
