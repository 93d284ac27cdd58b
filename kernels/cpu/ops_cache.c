/* CPU ops: cache writes (window rings, compressor pending state, compressed entries) and the
 * ratio-r compressor pooling. Byte layouts: common/kvfmt/kv_layout.h. */
#include <stdlib.h>

#include "kernels/cpu/cpu_internal.h"

/* ---- window rings ---- */

typedef struct ring_job {
    const kern_ring_store *p;
} ring_job;

static void ring_encode(void *arg, uint32_t r0, uint32_t r1, uint32_t worker)
{
    const kern_ring_store *p = ((ring_job *)arg)->p;
    size_t eb = (size_t)p->dim + p->dim / 32;
    float *x = cpu_xmalloc((size_t)p->dim * sizeof(float));
    assert(x);
    for (uint32_t t = r0; t < r1; t++) {
        uint8_t *e = p->local + (size_t)t * eb;
        cpu_bf16_to_f32(p->kv + (size_t)t * p->dim, x, p->dim);
        cpu_quant_fp8(x, p->dim, e, e + p->dim);
    }
    free(x);
}

static di_status cpu_ring_store(void *ctx, const kern_ring_store *p)
{
    assert(p->dim % 32 == 0 && p->ring_positions > 0);
    ring_job j = {p};
    if (p->kv)
        cpu_for(ctx, p->n_rows, 64, ring_encode, &j);
    if (!p->commit)
        return DI_OK;
    size_t eb = (size_t)p->dim + p->dim / 32;
    for (uint32_t s = 0; s < p->n_seqs; s++) {
        const kern_seq *q = &p->seqs[s];
        if (!q->slot)
            continue;
        uint32_t first = q->n_rows > p->ring_positions ? q->n_rows - p->ring_positions : 0;
        for (uint32_t i = first; i < q->n_rows; i++) {
            uint64_t pos = (uint64_t)(q->pos0 + i);
            uint8_t *dst = q->slot + p->ring_offset + (pos % p->ring_positions) * eb;
            memcpy(dst, p->local + (size_t)(q->row0 + i) * eb, eb);
        }
    }
    return DI_OK;
}

/* ---- compressor pooling (ratio > 1) ---- */

/* a and g of a token at position pos: from this step's rows, or copied out of the pending
 * state (its bytes follow the rings in the slot and need not be 4-byte aligned). */
static void pool_token(const kern_compress_pool *p, const kern_seq *q, int64_t pos, float *a_buf,
                       float *g_buf, const float **a, const float **g)
{
    if (pos >= q->pos0) {
        size_t row = q->row0 + (size_t)(pos - q->pos0);
        *a = p->a + row * p->dim;
        *g = p->g + row * p->dim;
    } else {
        const uint8_t *st = q->slot + p->state_offset +
                            (size_t)((uint64_t)pos % p->state_tokens) * 2 * p->dim * sizeof(float);
        memcpy(a_buf, st, p->dim * sizeof(float));
        memcpy(g_buf, st + p->dim * sizeof(float), p->dim * sizeof(float));
        *a = a_buf;
        *g = g_buf;
    }
}

typedef struct pool_job {
    const kern_compress_pool *p;
} pool_job;

static void pool_emit(void *arg, uint32_t e0, uint32_t e1, uint32_t worker)
{
    const kern_compress_pool *p = ((pool_job *)arg)->p;
    enum { RMAX = 16 };
    const float *a[RMAX], *g[RMAX];
    float *buf = cpu_xmalloc((size_t)2 * RMAX * p->dim * sizeof(float));
    assert(buf);
    for (uint32_t e = e0; e < e1; e++) {
        int32_t row = p->emit_row[e];
        const kern_seq *q = &p->seqs[p->row_seq[row]];
        int64_t pos = q->pos0 + (row - (int32_t)q->row0);
        assert((pos + 1) % p->ratio == 0);
        int64_t start = pos + 1 - p->ratio;
        for (uint32_t i = 0; i < p->ratio; i++)
            pool_token(p, q, start + i, buf + (size_t)2 * i * p->dim,
                       buf + (size_t)(2 * i + 1) * p->dim, &a[i], &g[i]);
        uint16_t *out = p->latent + (size_t)e * p->dim;
        /* per channel: weights fp32(softmax over the group, in double), sum in double */
        for (uint32_t d = 0; d < p->dim; d++) {
            double mx = g[0][d];
            for (uint32_t i = 1; i < p->ratio; i++)
                mx = g[i][d] > mx ? g[i][d] : mx;
            double e[RMAX], sum = 0.0;
            for (uint32_t i = 0; i < p->ratio; i++) {
                e[i] = exp((double)g[i][d] - mx);
                sum += e[i];
            }
            double acc = 0.0;
            for (uint32_t i = 0; i < p->ratio; i++)
                acc += (double)(float)(e[i] / sum) * (double)a[i][d];
            out[d] = to_bf((float)acc);
        }
    }
    free(buf);
}

static di_status cpu_compress_pool(void *ctx, const kern_compress_pool *p)
{
    assert(p->ratio >= 2 && p->ratio <= 16 && p->state_tokens >= p->ratio - 1);
    pool_job j = {p};
    /* emit first: the state writes below may reuse slots that these groups read */
    cpu_for(ctx, p->n_emit, 32, pool_emit, &j);
    size_t tok = (size_t)2 * p->dim;
    for (uint32_t s = 0; s < p->n_seqs; s++) {
        const kern_seq *q = &p->seqs[s];
        if (!q->slot) /* placeholder rows: nothing saved */
            continue;
        uint32_t first = q->n_rows > p->state_tokens ? q->n_rows - p->state_tokens : 0;
        for (uint32_t i = first; i < q->n_rows; i++) {
            uint64_t pos = (uint64_t)(q->pos0 + i);
            uint8_t *dst = q->slot + p->state_offset + (pos % p->state_tokens) * tok * sizeof(float);
            memcpy(dst, p->a + (size_t)(q->row0 + i) * p->dim, p->dim * sizeof(float));
            memcpy(dst + p->dim * sizeof(float), p->g + (size_t)(q->row0 + i) * p->dim,
                   p->dim * sizeof(float));
        }
    }
    return DI_OK;
}

/* ---- compressed entries ---- */

typedef struct cstore_job {
    const kern_compressed_store *p;
} cstore_job;

static void cstore_entries(void *arg, uint32_t e0, uint32_t e1, uint32_t worker)
{
    const kern_compressed_store *p = ((cstore_job *)arg)->p;
    uint32_t w = p->dim > p->index_dim ? p->dim : p->index_dim;
    float *x = cpu_xmalloc((size_t)w * sizeof(float));
    assert(x);
    for (uint32_t e = e0; e < e1; e++) {
        const kern_seq *q = &p->seqs[p->entry_seq[e]];
        uint8_t *dst = cpu_entry_addr(&p->pool, q, p->entry_id[e], 0);
        cpu_bf16_to_f32(p->main + (size_t)e * p->dim, x, p->dim);
        di_quant_fp4_b16(x, p->dim, dst, dst + p->dim / 2);
        if (p->index) {
            dst = cpu_entry_addr(&p->pool, q, p->entry_id[e], 1);
            cpu_bf16_to_f32(p->index + (size_t)e * p->index_dim, x, p->index_dim);
            di_quant_fp4_b32(x, p->index_dim, dst, dst + p->index_dim / 2);
        }
    }
    free(x);
}

static di_status cpu_compressed_store(void *ctx, const kern_compressed_store *p)
{
    assert(p->dim % 32 == 0 && p->index_dim % 32 == 0);
    cstore_job j = {p};
    cpu_for(ctx, p->n_entries, 32, cstore_entries, &j);
    return DI_OK;
}

void cpu_ops_cache(kern_ops *ops)
{
    ops->ring_store = cpu_ring_store;
    ops->compress_pool = cpu_compress_pool;
    ops->compressed_store = cpu_compressed_store;
}
