/* CPU op: sparse attention with a sink over the window and the compressed entries.
 *
 * Phase 1 decodes every cache entry the call reads exactly once (window positions of each
 * sequence, the union of its rows' compressed picks) into fp32; phase 2 computes each row
 * from those, in parallel over rows. A row's result does not depend on the other rows.
 *
 * Each row follows the reference kernel's numerics (MODEL.md §2.5): its key slots (the window
 * slots, empty ones included, then the compressed picks, -1 included) are walked in blocks of
 * ATTN_BLOCK with a running fp32 max and an fp32 denominator of the fp32 probabilities, while
 * the numerator takes each probability rounded to BF16 before the product with its value.
 */
#include <stdlib.h>

#include "kernels/cpu/cpu_internal.h"
#include "kernels/cpu/simd.h"

#define ATTN_BLOCK 64u          /* key slots per softmax block */

typedef struct seq_buf {
    double *win;                /* [n_win, hd] window entries (widened) */
    int64_t wlo;                /* normal rows: position of win[0] */
    uint32_t n_win;
    uint32_t n_ring;            /* draft block: ring entries before the local rows */
    int64_t ring_lo;            /* draft block: position of win[0] */
    int32_t *cmap;              /* [cmap_n] compressed id -> row of comp, -1 unused */
    uint32_t cmap_n;
    double *comp;               /* [n_comp, hd] */
} seq_buf;

typedef struct dec_item {
    const uint8_t *src;
    double *dst;
    int main_fmt;               /* 1: compressed FP4 entry, 0: FP8 ring entry */
} dec_item;

typedef struct attn_job {
    const cpu_ctx *c;
    const kern_sparse_attn *p;
    seq_buf *bufs;
    int32_t *row_seq;           /* [T] */
    dec_item *items;
    uint32_t n_items;
    uint32_t max_ents;          /* entries per row at most */
    size_t ring_entry;          /* bytes of a ring entry */
} attn_job;

static void decode_items(void *arg, uint32_t i0, uint32_t i1, uint32_t worker)
{
    attn_job *j = arg;
    uint32_t hd = j->p->head_dim;
    float *f = cpu_xmalloc(hd * sizeof(float));
    assert(f);
    for (uint32_t i = i0; i < i1; i++) {
        if (j->items[i].main_fmt)
            cpu_decode_main_entry(j->c, j->items[i].src, hd, f);
        else
            cpu_decode_ring_entry(j->c, j->items[i].src, hd, f);
        cpu_widen(f, j->items[i].dst, hd);
    }
    free(f);
}

/* Source bytes of window position q of sequence s: this step's local entry or the ring. */
static const uint8_t *window_src(const attn_job *j, const kern_seq *q, int64_t pos)
{
    const kern_sparse_attn *p = j->p;
    if (pos >= q->pos0 && q->ring_hi < 0)
        return p->local + (size_t)(q->row0 + (pos - q->pos0)) * j->ring_entry;
    assert(q->slot);
    return q->slot + p->ring_offset + (size_t)((uint64_t)pos % p->ring_positions) * j->ring_entry;
}

static int64_t window_lo_of(const kern_sparse_attn *p, const kern_seq *q, int64_t pos)
{
    int64_t lo = pos - (int64_t)p->window + 1;
    if (lo < 0)
        lo = 0;
    if (q->window_lo > 0 && pos >= q->window_lo && lo < q->window_lo)
        lo = q->window_lo;
    return lo;
}

/* Plans phase 1 for one sequence: allocates its buffers and appends its decode items. */
static di_status plan_seq(attn_job *j, uint32_t s, dec_item **items, uint32_t *n_items,
                          uint32_t *cap)
{
    const kern_sparse_attn *p = j->p;
    const kern_seq *q = &p->seqs[s];
    seq_buf *b = &j->bufs[s];
    uint32_t hd = p->head_dim;
    uint32_t need_win, need_comp = 0;
    if (q->ring_hi >= 0) {
        b->ring_lo = q->ring_hi - (int64_t)p->window + 1 < 0 ? 0 : q->ring_hi - (int64_t)p->window + 1;
        b->n_ring = (uint32_t)(q->ring_hi - b->ring_lo + 1);
        b->n_win = b->n_ring + q->n_rows;
    } else {
        b->wlo = window_lo_of(p, q, q->pos0);
        b->n_win = (uint32_t)(q->pos0 + q->n_rows - b->wlo);
    }
    need_win = b->n_win;
    if (p->topk) {
        int32_t mx = -1;
        for (uint32_t r = 0; r < q->n_rows; r++)
            for (uint32_t i = 0; i < p->topk_n; i++)
                if (p->topk[(size_t)(q->row0 + r) * p->topk_n + i] > mx)
                    mx = p->topk[(size_t)(q->row0 + r) * p->topk_n + i];
        b->cmap_n = (uint32_t)(mx + 1);
        if (b->cmap_n) {
            b->cmap = malloc((size_t)b->cmap_n * sizeof(int32_t));
            if (!b->cmap)
                return DI_ENOMEM;
            for (uint32_t i = 0; i < b->cmap_n; i++)
                b->cmap[i] = -1;
            for (uint32_t r = 0; r < q->n_rows; r++)
                for (uint32_t i = 0; i < p->topk_n; i++) {
                    int32_t id = p->topk[(size_t)(q->row0 + r) * p->topk_n + i];
                    if (id >= 0 && b->cmap[id] < 0)
                        b->cmap[id] = (int32_t)need_comp++;
                }
        }
    }
    b->win = cpu_xmalloc((size_t)need_win * hd * sizeof(double));
    b->comp = cpu_xmalloc((size_t)(need_comp ? need_comp : 1) * hd * sizeof(double));
    if (!b->win || !b->comp)
        return DI_ENOMEM;
    if (*n_items + need_win + need_comp > *cap) {
        uint32_t nc = (*n_items + need_win + need_comp) * 2;
        dec_item *ni = realloc(*items, (size_t)nc * sizeof(dec_item));
        if (!ni)
            return DI_ENOMEM;
        *items = ni;
        *cap = nc;
    }
    for (uint32_t i = 0; i < need_win; i++) {
        dec_item *it = &(*items)[(*n_items)++];
        it->dst = b->win + (size_t)i * hd;
        it->main_fmt = 0;
        if (q->ring_hi >= 0)
            it->src = i < b->n_ring ? window_src(j, q, b->ring_lo + i)
                                    : p->local + (size_t)(q->row0 + i - b->n_ring) * j->ring_entry;
        else
            it->src = window_src(j, q, b->wlo + i);
    }
    for (uint32_t id = 0; id < b->cmap_n; id++) {
        if (b->cmap[id] < 0)
            continue;
        dec_item *it = &(*items)[(*n_items)++];
        it->dst = b->comp + (size_t)b->cmap[id] * hd;
        it->src = cpu_entry_addr(&p->pool, q, id, 0);
        it->main_fmt = 1;
    }
    return DI_OK;
}

typedef struct row_scratch {
    const double **ents;
    float *s;
    float *qf;
    double *qd;
    double *o;                  /* [hd] one block's sum of bf16(p) * kv */
    float *acc;                 /* [hd] the running numerator */
} row_scratch;

static void attn_row(attn_job *j, uint32_t t, row_scratch *sc)
{
    const kern_sparse_attn *p = j->p;
    const kern_seq *q = &p->seqs[j->row_seq[t]];
    const seq_buf *b = &j->bufs[j->row_seq[t]];
    uint32_t hd = p->head_dim, n = 0;
    int64_t pos = q->pos0 + (t - q->row0);
    if (q->ring_hi >= 0) {
        for (uint32_t i = 0; i < b->n_win; i++)
            sc->ents[n++] = b->win + (size_t)i * hd;
    } else {
        for (int64_t w = window_lo_of(p, q, pos); w <= pos; w++)
            sc->ents[n++] = b->win + (size_t)(w - b->wlo) * hd;
        while (n < p->window) /* empty window slots */
            sc->ents[n++] = NULL;
    }
    if (p->topk) {
        const int32_t *ids = p->topk + (size_t)t * p->topk_n;
        for (uint32_t i = 0; i < p->topk_n; i++)
            sc->ents[n++] = ids[i] >= 0 ? b->comp + (size_t)b->cmap[ids[i]] * hd : NULL;
    }
    assert(n <= j->max_ents);
    for (uint32_t h = 0; h < p->n_heads; h++) {
        const uint16_t *qh = p->q + ((size_t)t * p->n_heads + h) * hd;
        cpu_bf16_to_f32(qh, sc->qf, hd);
        cpu_widen(sc->qf, sc->qd, hd);
        float m = -1e30f, sum = 0.0f;
        for (uint32_t d = 0; d < hd; d++)
            sc->acc[d] = 0.0f;
        for (uint32_t b0 = 0; b0 < n; b0 += ATTN_BLOCK) {
            uint32_t b1 = b0 + ATTN_BLOCK < n ? b0 + ATTN_BLOCK : n;
            float mb = m;
            for (uint32_t e = b0; e < b1; e++) {
                if (!sc->ents[e])
                    continue;
                sc->s[e] = (float)cpu_dotd(sc->qd, sc->ents[e], hd) * p->scale;
                mb = sc->s[e] > mb ? sc->s[e] : mb;
            }
            float alpha = (float)exp((double)(m - mb));
            double psum = 0.0;
            memset(sc->o, 0, hd * sizeof(double));
            for (uint32_t e = b0; e < b1; e++) {
                if (!sc->ents[e])
                    continue;
                float pe = (float)exp((double)(sc->s[e] - mb));
                psum += pe;
                cpu_axpyd(sc->o, sc->ents[e], di_bf16_round(pe), hd);
            }
            sum = sum * alpha + (float)psum;
            for (uint32_t d = 0; d < hd; d++)
                sc->acc[d] = sc->acc[d] * alpha + (float)sc->o[d];
            m = mb;
        }
        sum += (float)exp((double)(p->sink[h] - m));
        uint16_t *out = p->out + ((size_t)t * p->n_heads + h) * hd;
        for (uint32_t d = 0; d < hd; d++)
            out[d] = to_bf(sc->acc[d] / sum);
    }
}

static void attn_rows(void *arg, uint32_t r0, uint32_t r1, uint32_t worker)
{
    attn_job *j = arg;
    uint32_t hd = j->p->head_dim;
    row_scratch sc;
    sc.ents = malloc((size_t)j->max_ents * sizeof(double *));
    sc.qd = cpu_xmalloc((size_t)hd * sizeof(double));
    sc.s = malloc((size_t)j->max_ents * sizeof(float));
    sc.qf = cpu_xmalloc((size_t)hd * sizeof(float));
    sc.o = cpu_xmalloc((size_t)hd * sizeof(double));
    sc.acc = cpu_xmalloc((size_t)hd * sizeof(float));
    assert(sc.ents && sc.s && sc.qf && sc.qd && sc.o && sc.acc);
    for (uint32_t t = r0; t < r1; t++)
        attn_row(j, t, &sc);
    free(sc.ents);
    free(sc.s);
    free(sc.qf);
    free(sc.qd);
    free(sc.o);
    free(sc.acc);
}

static di_status cpu_sparse_attn(void *ctx, const kern_sparse_attn *p)
{
    assert(p->head_dim % 32 == 0 && p->ring_positions >= p->window);
    attn_job j = {.c = ctx, .p = p, .ring_entry = (size_t)p->head_dim + p->head_dim / 32};
    j.bufs = calloc(p->n_seqs ? p->n_seqs : 1, sizeof(seq_buf));
    j.row_seq = malloc((size_t)(p->n_rows ? p->n_rows : 1) * sizeof(int32_t));
    di_status st = (j.bufs && j.row_seq) ? DI_OK : DI_ENOMEM;
    uint32_t cap = 0, max_rows = 0;
    for (uint32_t s = 0; st == DI_OK && s < p->n_seqs; s++) {
        const kern_seq *q = &p->seqs[s];
        for (uint32_t r = 0; r < q->n_rows; r++)
            j.row_seq[q->row0 + r] = (int32_t)s;
        if (q->n_rows > max_rows)
            max_rows = q->n_rows;
        st = plan_seq(&j, s, &j.items, &j.n_items, &cap);
    }
    j.max_ents = p->window + max_rows + (p->topk ? p->topk_n : 0);
    if (st == DI_OK) {
        cpu_for(ctx, j.n_items, 256, decode_items, &j);
        cpu_for(ctx, p->n_rows, 1, attn_rows, &j);
    }
    for (uint32_t s = 0; j.bufs && s < p->n_seqs; s++) {
        free(j.bufs[s].win);
        free(j.bufs[s].comp);
        free(j.bufs[s].cmap);
    }
    free(j.bufs);
    free(j.row_seq);
    free(j.items);
    return st;
}

void cpu_ops_attn(kern_ops *ops)
{
    ops->sparse_attn = cpu_sparse_attn;
}
