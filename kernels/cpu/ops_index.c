/* CPU ops: indexer scores, layer-20 candidate blocks, top-k with the tie rule.
 *
 * Selection ranks by (score descending, index ascending). Each candidate gets a unique 64-bit
 * key (order-preserving bits of the score above the complemented index), the k-th largest key
 * is found by quickselect, and the winners are read back in ascending index order, so the
 * result is exact and deterministic without sorting.
 */
#include <stdlib.h>

#include "kernels/cpu/cpu_internal.h"

/* ---- selection ---- */

static uint64_t rank_key(float score, uint32_t index)
{
    uint32_t u;
    memcpy(&u, &score, 4);
    u = (u & 0x80000000u) ? ~u : (u | 0x80000000u);
    return ((uint64_t)u << 32) | (uint64_t)(0xffffffffu - index);
}

static void swap64(uint64_t *a, uint64_t *b)
{
    uint64_t t = *a;
    *a = *b;
    *b = t;
}

/* The k-th largest (1-based) of v[0..n), n >= k >= 1; reorders v. */
static uint64_t kth_largest(uint64_t *v, uint32_t n, uint32_t k)
{
    uint32_t lo = 0, hi = n - 1, want = k - 1; /* position in descending order */
    for (;;) {
        if (lo == hi)
            return v[lo];
        uint32_t mid = lo + (hi - lo) / 2;
        /* median of three to the hi end as pivot */
        if (v[mid] > v[lo])
            swap64(&v[mid], &v[lo]);
        if (v[hi] > v[lo])
            swap64(&v[hi], &v[lo]);
        if (v[mid] > v[hi])
            swap64(&v[mid], &v[hi]);
        uint64_t pivot = v[hi];
        uint32_t store = lo;
        for (uint32_t i = lo; i < hi; i++)
            if (v[i] > pivot)
                swap64(&v[i], &v[store++]);
        swap64(&v[store], &v[hi]);
        if (want == store)
            return v[store];
        if (want < store)
            hi = store - 1;
        else
            lo = store + 1;
    }
}

/* Marks keep[i] = 1 for the k best of score[0..n) (score desc, index asc), 0 elsewhere.
 * scratch holds n keys. */
static void select_best(const float *score, uint32_t n, uint32_t k, uint8_t *keep,
                        uint64_t *scratch)
{
    if (k >= n) {
        memset(keep, 1, n);
        return;
    }
    memset(keep, 0, n);
    if (k == 0)
        return;
    for (uint32_t i = 0; i < n; i++)
        scratch[i] = rank_key(score[i], i);
    uint64_t thr = kth_largest(scratch, n, k);
    for (uint32_t i = 0; i < n; i++)
        keep[i] = rank_key(score[i], i) >= thr;
}

/* ---- scores ---- */

typedef struct iseq_buf {
    double *keys;               /* [n, head_dim] dequantised index keys, widened */
    uint32_t n;
} iseq_buf;

typedef struct iscore_job {
    const cpu_ctx *c;
    const kern_index_scores *p;
    iseq_buf *bufs;
    uint32_t n_seqs;
    uint32_t *item_seq;         /* decode items: sequence and entry */
    uint32_t *item_entry;
    int32_t max_vis;
} iscore_job;

static void iscore_decode(void *arg, uint32_t i0, uint32_t i1, uint32_t worker)
{
    iscore_job *j = arg;
    const kern_index_scores *p = j->p;
    float f[1024];
    assert(p->head_dim <= 1024);
    for (uint32_t i = i0; i < i1; i++) {
        uint32_t s = j->item_seq[i], e = j->item_entry[i];
        cpu_decode_index_entry(j->c, cpu_entry_addr(&p->pool, &p->seqs[s], e, 1), p->head_dim, f);
        cpu_widen(f, j->bufs[s].keys + (size_t)e * p->head_dim, p->head_dim);
    }
}

static void iscore_rows(void *arg, uint32_t r0, uint32_t r1, uint32_t worker)
{
    iscore_job *j = arg;
    const kern_index_scores *p = j->p;
    uint32_t hd = p->head_dim, nh = p->n_heads;
    float *qf = cpu_xmalloc((size_t)nh * hd * sizeof(float));
    double *qd = cpu_xmalloc((size_t)nh * hd * sizeof(double));
    assert(qf && qd);
    for (uint32_t t = r0; t < r1; t++) {
        const iseq_buf *b = &j->bufs[p->row_seq[t]];
        int32_t nv = p->n_visible[t];
        float *out = p->scores + (size_t)t * p->stride;
        const uint16_t *w = p->w + (size_t)t * nh;
        double hw[256];
        assert(nh <= 256);
        for (uint32_t h = 0; h < nh; h++) /* bf16(bf16 weight * the exact scale) */
            hw[h] = di_bf16_round((float)((double)bf(w[h]) * p->w_scale));
        cpu_bf16_to_f32(p->q + (size_t)t * nh * hd, qf, (size_t)nh * hd);
        cpu_widen(qf, qd, (size_t)nh * hd);
        for (int32_t e = 0; e < j->max_vis; e++) {
            if (e >= nv || (p->cand_mask &&
                            !p->cand_mask[(size_t)t * p->cand_stride + (uint32_t)e / p->cand_block])) {
                out[e] = -INFINITY;
                continue;
            }
            const double *k = b->keys + (size_t)e * hd;
            float acc = 0.0f;
            for (uint32_t h = 0; h < nh; h++) {
                float d = di_bf16_round((float)cpu_dotd(qd + (size_t)h * hd, k, hd));
                acc += di_bf16_round((float)hw[h] * (d > 0.0f ? d : 0.0f));
            }
            out[e] = di_bf16_round(acc);
        }
    }
    free(qf);
    free(qd);
}

static di_status cpu_index_scores(void *ctx, const kern_index_scores *p)
{
    iscore_job j = {.c = ctx, .p = p};
    uint32_t n_seqs = 0;
    for (uint32_t t = 0; t < p->n_rows; t++) {
        if ((uint32_t)p->row_seq[t] + 1 > n_seqs)
            n_seqs = (uint32_t)p->row_seq[t] + 1;
        if (p->n_visible[t] > j.max_vis)
            j.max_vis = p->n_visible[t];
    }
    assert((size_t)j.max_vis <= p->stride);
    j.n_seqs = n_seqs;
    j.bufs = calloc(n_seqs ? n_seqs : 1, sizeof(iseq_buf));
    di_status st = j.bufs ? DI_OK : DI_ENOMEM;
    uint32_t n_items = 0;
    for (uint32_t t = 0; st == DI_OK && t < p->n_rows; t++) {
        iseq_buf *b = &j.bufs[p->row_seq[t]];
        if ((uint32_t)p->n_visible[t] > b->n)
            b->n = (uint32_t)p->n_visible[t];
    }
    for (uint32_t s = 0; st == DI_OK && s < n_seqs; s++) {
        n_items += j.bufs[s].n;
        j.bufs[s].keys = cpu_xmalloc((size_t)(j.bufs[s].n ? j.bufs[s].n : 1) * p->head_dim *
                                     sizeof(double));
        if (!j.bufs[s].keys)
            st = DI_ENOMEM;
    }
    if (st == DI_OK) {
        j.item_seq = malloc((size_t)(n_items ? n_items : 1) * sizeof(uint32_t));
        j.item_entry = malloc((size_t)(n_items ? n_items : 1) * sizeof(uint32_t));
        if (!j.item_seq || !j.item_entry)
            st = DI_ENOMEM;
    }
    if (st == DI_OK) {
        uint32_t i = 0;
        for (uint32_t s = 0; s < n_seqs; s++)
            for (uint32_t e = 0; e < j.bufs[s].n; e++, i++) {
                j.item_seq[i] = s;
                j.item_entry[i] = e;
            }
        cpu_for(ctx, n_items, 512, iscore_decode, &j);
        cpu_for(ctx, p->n_rows, 1, iscore_rows, &j);
    }
    for (uint32_t s = 0; j.bufs && s < n_seqs; s++)
        free(j.bufs[s].keys);
    free(j.bufs);
    free(j.item_seq);
    free(j.item_entry);
    return st;
}

/* ---- candidate blocks ---- */

typedef struct sel_job {
    const void *p;
    uint32_t width;             /* scratch items per row */
} sel_job;

static void cand_rows(void *arg, uint32_t r0, uint32_t r1, uint32_t worker)
{
    sel_job *j = arg;
    const kern_index_candidates *p = j->p;
    float *bs = malloc((size_t)(j->width ? j->width : 1) * sizeof(float));
    uint8_t *keep = malloc(j->width ? j->width : 1);
    uint64_t *scratch = malloc((size_t)(j->width ? j->width : 1) * sizeof(uint64_t));
    assert(bs && keep && scratch);
    for (uint32_t t = r0; t < r1; t++) {
        int32_t nv = p->n_visible[t];
        uint32_t nb = nv > 0 ? ((uint32_t)nv + p->block - 1) / p->block : 0;
        const float *sc = p->scores + (size_t)t * p->stride;
        uint8_t *mask = p->mask + (size_t)t * p->mask_stride;
        memset(mask, 0, j->width);
        for (uint32_t b = 0; b < nb; b++) {
            float m = -INFINITY;
            for (uint32_t e = b * p->block; e < (b + 1) * p->block && e < (uint32_t)nv; e++)
                m = sc[e] > m ? sc[e] : m;
            bs[b] = m;
        }
        if (nb == 0)
            continue;
        bs[(uint32_t)(nv - 1) / p->block] = INFINITY; /* the newest, partly filled block */
        select_best(bs, nb, p->top_blocks, keep, scratch);
        for (uint32_t b = 0; b < nb; b++)
            mask[b] = keep[b] && bs[b] != -INFINITY;
    }
    free(bs);
    free(keep);
    free(scratch);
}

static di_status cpu_index_candidates(void *ctx, const kern_index_candidates *p)
{
    assert(p->block >= 1);
    int32_t mx = 0;
    for (uint32_t t = 0; t < p->n_rows; t++)
        mx = p->n_visible[t] > mx ? p->n_visible[t] : mx;
    uint32_t width = ((uint32_t)mx + p->block - 1) / p->block;
    assert(width <= p->mask_stride);
    sel_job j = {p, width};
    cpu_for(ctx, p->n_rows, 1, cand_rows, &j);
    return DI_OK;
}

/* ---- top-k ---- */

static void topk_rows(void *arg, uint32_t r0, uint32_t r1, uint32_t worker)
{
    sel_job *j = arg;
    const kern_index_topk *p = j->p;
    uint8_t *keep = malloc(j->width ? j->width : 1);
    uint64_t *scratch = malloc((size_t)(j->width ? j->width : 1) * sizeof(uint64_t));
    assert(keep && scratch);
    for (uint32_t t = r0; t < r1; t++) {
        int32_t nv = p->n_visible[t];
        int32_t *out = p->out + (size_t)t * p->k;
        uint32_t n = 0;
        if (nv > 0) {
            select_best(p->scores + (size_t)t * p->stride, (uint32_t)nv, p->k, keep, scratch);
            for (uint32_t e = 0; e < (uint32_t)nv; e++)
                if (keep[e])
                    out[n++] = (int32_t)e;
        }
        for (; n < p->k; n++)
            out[n] = -1;
    }
    free(keep);
    free(scratch);
}

static di_status cpu_index_topk(void *ctx, const kern_index_topk *p)
{
    int32_t mx = 0;
    for (uint32_t t = 0; t < p->n_rows; t++)
        mx = p->n_visible[t] > mx ? p->n_visible[t] : mx;
    sel_job j = {p, (uint32_t)mx};
    cpu_for(ctx, p->n_rows, 1, topk_rows, &j);
    return DI_OK;
}

void cpu_ops_index(kern_ops *ops)
{
    ops->index_scores = cpu_index_scores;
    ops->index_candidates = cpu_index_candidates;
    ops->index_topk = cpu_index_topk;
}
