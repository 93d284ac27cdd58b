/* moe.c: dispatch, serve, combine and EPLB of one rank's MoE layers (moe.h). */
#include "common/ep/moe.h"

#include <stdlib.h>
#include <string.h>

#include "common/util/clock.h"

#include "kernels/kern_ep.h"

/* A dispatch segment: seg_hdr, then n_pairs pair_rec, then n_pairs rows [n_pairs, dim] bf16
 * (the rows only without a device transport; with one they go device to device, the gathered
 * rows of destination d at rows first[d] .. first[d] + cnt[d]).
 * A combine segment: the served pairs' outputs [n_pairs, dim] bf16, in dispatch order (with a
 * device transport: device to device into the outputs buffer, at the same rows). */
typedef struct seg_hdr {
    uint32_t layer;          /* backbone layer of the pairs; UINT32_MAX when there are none */
    uint32_t n_pairs;
    uint32_t done;           /* 1: the sender's step has ended */
    uint32_t pad;
} seg_hdr;

typedef struct pair_rec {
    uint32_t slot;           /* local slot on the receiving rank */
    float weight;            /* routing weight */
} pair_rec;

/* One part of an expert's weights inside its slot's buffer. */
enum { PART_W1, PART_W1S, PART_W3, PART_W3S, PART_W2, PART_W2S, PARTS };

/* Host buffer, pinned through the ep ops (kern_ep.h) so that the backend copies at full
 * speed; grows keeping its bytes. */
typedef struct hbuf {
    uint8_t *p;
    size_t len, cap;
} hbuf;

/* Host scratch (malloc). */
typedef struct ebuf {
    uint8_t *p;
    size_t len, cap;
} ebuf;

/* Backend-memory scratch (kern_ops.alloc); grows without keeping its bytes. */
typedef struct bbuf {
    void *p;
    size_t cap;
} bbuf;

struct ep_moe {
    ep_group *g;
    const kern_backend *be;
    kern_ep_ops xo;                 /* combine and pinned memory of the backend */
    const model_weights *w;
    uint32_t rank, world;
    uint32_t E, K, D, inter, L, S;  /* experts, top-k, dim, expert width, layers, slots/rank */
    float swiglu_limit;
    size_t part_off[PARTS], part_len[PARTS];
    size_t blob;                    /* bytes of one expert's weights in a slot */
    ep_placement *place;            /* [L] */
    ep_placement *prev;             /* [L] the layout a layer's last change replaced (none
                                       when the layer did not change at the last re-plan) */
    bool *was_revert;               /* [L] that change was a revert */
    uint8_t **slot_mem;             /* [L * S] this rank's slot buffers (backend memory) */
    kern_expert *views;             /* [L * S] views into them */
    uint32_t interval;              /* eplb_interval */
    uint32_t win_steps;             /* steps in the window so far */
    uint64_t *window;               /* [interval][L][world * S] pairs served per slot */
    uint64_t *step_counts;          /* [L][S] pairs this rank's slots served this step */
    ep_moe_stats stats;
    ep_dev_xport dx;                /* the device transport (dx.alltoallv NULL: none) */
    uint64_t *last_pairs;           /* [L] pairs this rank's slots served in the last step */
    uint64_t *soff, *slen, *roff, *rlen; /* [world] byte ranges of a device all-to-all */
    bbuf rx;                        /* [pairs, dim] rows received through the device transport */
    /* scratch */
    hbuf *seg;                      /* [world] dispatch segments being built */
    hbuf *out;                      /* [world] combine segments being built */
    ep_buf *send, *recv;            /* [world] */
    uint32_t *nth, *cnt, *first;    /* [E], [world], [world] (first pair of each destination) */
    ebuf pairs;                     /* per pair: destination, index there, slot */
    ebuf meta;                      /* host ids, weights, gather rows, combine positions */
    ebuf served;                    /* ids and weights of a served segment */
    ebuf segs;                      /* the received segments, kept over the device transport */
    bbuf xg;                        /* [pairs, dim] rows gathered by destination */
    bbuf sx, sid, swt, sy;          /* a served segment: rows, slots, weights, outputs */
    bbuf outs;                      /* [pairs, dim] the outputs that came back */
    bbuf shared;                    /* shared expert scratch */
};

static int hbuf_reserve(ep_moe *m, hbuf *b, size_t need)
{
    if (need <= b->cap)
        return 0;
    size_t c = b->cap ? b->cap : 4096;
    while (c < need)
        c *= 2;
    uint8_t *n = m->xo.host_alloc(m->xo.ctx, c);
    if (!n)
        return -1;
    if (b->len)
        memcpy(n, b->p, b->len);
    if (b->p)
        m->xo.host_free(m->xo.ctx, b->p);
    b->p = n;
    b->cap = c;
    return 0;
}

static int ebuf_reserve(ebuf *b, size_t need)
{
    if (need <= b->cap)
        return 0;
    size_t c = b->cap ? b->cap : 4096;
    while (c < need)
        c *= 2;
    uint8_t *n = realloc(b->p, c);
    if (!n)
        return -1;
    b->p = n;
    b->cap = c;
    return 0;
}

/* The backend's message of its last failure. */
static const char *be_msg(const ep_moe *m)
{
    const char *msg = m->xo.last_error ? m->xo.last_error(m->xo.ctx) : NULL;
    return msg && *msg ? msg : "the backend gave no message";
}

/* b at least `need` bytes of backend memory. */
static di_status bbuf_reserve(ep_moe *m, bbuf *b, size_t need, di_error *err)
{
    if (need <= b->cap && b->p)
        return DI_OK;
    size_t c = b->cap ? b->cap : 4096;
    while (c < need)
        c *= 2;
    if (b->p)
        m->be->ops.free(m->be->ctx, b->p);
    b->cap = 0;
    if (!(b->p = m->be->ops.alloc(m->be->ctx, c)))
        return di_fail(err, DI_ENOMEM, "%zu bytes of %s memory for the exchange", c,
                       m->be->name);
    b->cap = c;
    return DI_OK;
}

static void bbuf_free(ep_moe *m, bbuf *b)
{
    if (b->p)
        m->be->ops.free(m->be->ctx, b->p);
    b->p = NULL;
    b->cap = 0;
}

static size_t align64(size_t n) { return (n + 63) & ~(size_t)63; }

/* ---- slot weights ---- */

static const model_tensor *part_tensor(const model_expert_weights *x, int part)
{
    return part < PART_W3 ? &x->w1 : part < PART_W2 ? &x->w3 : &x->w2;
}

static size_t part_bytes(const model_tensor *t, int part)
{
    return part % 2 ? model_tensor_scale_bytes(t) : model_tensor_data_bytes(t);
}

static void set_view(ep_moe *m, uint32_t layer, uint32_t s)
{
    uint8_t *b = m->slot_mem[(size_t)layer * m->S + s];
    kern_expert *v = &m->views[(size_t)layer * m->S + s];
    v->w1 = b + m->part_off[PART_W1];
    v->w1_scale = b + m->part_off[PART_W1S];
    v->w3 = b + m->part_off[PART_W3];
    v->w3_scale = b + m->part_off[PART_W3S];
    v->w2 = b + m->part_off[PART_W2];
    v->w2_scale = b + m->part_off[PART_W2S];
}

/* A slot buffer of backend memory. */
static uint8_t *slot_alloc(ep_moe *m)
{
    return m->be->ops.alloc(m->be->ctx, m->blob);
}

static void slot_free(ep_moe *m, uint8_t *b)
{
    if (b)
        m->be->ops.free(m->be->ctx, b);
}

/* Copies expert e of the checkpoint into a new slot buffer (through host scratch). */
static di_status load_slot(ep_moe *m, uint32_t layer, uint32_t e, uint8_t **out, di_error *err)
{
    const model_expert_weights *x = &m->w->layers[layer].ffn.experts[e];
    if (ebuf_reserve(&m->meta, m->blob) != 0)
        return di_fail(err, DI_ENOMEM, "expert slot of %zu bytes", m->blob);
    memset(m->meta.p, 0, m->blob);
    for (int p = 0; p < PARTS; p++) {
        const model_tensor *t = part_tensor(x, p);
        const void *src = p % 2 ? (const void *)t->scale : t->data;
        if (t->fmt == MODEL_WFMT_NONE)
            return di_fail(err, DI_EINVAL, "layer %u expert %u: not loaded (the checkpoint was "
                           "loaded for another rank)", layer, e);
        if (part_bytes(t, p) != m->part_len[p] || !src)
            return di_fail(err, DI_EINVAL, "layer %u expert %u: weights of another shape than "
                           "the first's", layer, e);
        memcpy(m->meta.p + m->part_off[p], src, m->part_len[p]);
    }
    uint8_t *b = slot_alloc(m);
    if (!b)
        return di_fail(err, DI_ENOMEM, "expert slot of %zu bytes of %s memory", m->blob,
                       m->be->name);
    m->be->ops.from_host(m->be->ctx, b, m->meta.p, m->blob);
    *out = b;
    return DI_OK;
}

/* ---- create ---- */

di_status ep_moe_create(const ep_moe_options *o, ep_moe **out, di_error *err)
{
    if (!o || !o->group || !o->be || !o->w || !out)
        return di_fail(err, DI_EINVAL, "expert parallelism: group, backend and weights are "
                       "required");
    if (o->be->device_memory && !o->dev_ops)
        return di_fail(err, DI_EINVAL, "expert parallelism: backend %s keeps tensors on the "
                       "device and needs its exchange ops (kern_ep.h)", o->be->name);
    const model_config *c = &o->w->config;
    if (c->n_routed_experts == 0 || c->n_layers == 0 || !o->w->layers[0].ffn.experts ||
        c->dim % 32 || c->moe_inter_dim % 32)
        return di_fail(err, DI_EINVAL, "expert parallelism: the model has no routed experts");
    if (c->n_activated_experts == 0 || c->n_activated_experts > 64)
        return di_fail(err, DI_EINVAL, "expert parallelism: top-%u routing (1..64)",
                       c->n_activated_experts);
    ep_moe *m = calloc(1, sizeof *m);
    if (!m)
        return di_fail(err, DI_ENOMEM, "expert parallelism");
    m->g = o->group;
    m->be = o->be;
    if (o->dev_ops)
        m->xo = *o->dev_ops;
    else
        kern_ep_ops_host(&m->xo);
    m->w = o->w;
    m->rank = ep_group_rank(o->group);
    m->world = ep_group_world(o->group);
    m->E = c->n_routed_experts;
    m->K = c->n_activated_experts;
    m->D = c->dim;
    m->inter = c->moe_inter_dim;
    m->L = c->n_layers;
    m->swiglu_limit = (float)c->swiglu_limit;
    m->interval = o->eplb_interval;
    if (o->dx)
        m->dx = *o->dx;
    uint32_t R;
    di_status st = eplb_redundant_count(m->E, o->min_redundant, m->world, &R, err);
    if (st != DI_OK) {
        free(m);
        return st;
    }
    m->S = (m->E + R) / m->world;
    m->stats.slots_per_rank = m->S;
    m->stats.redundant = R;
    /* FP4 [inter, dim] (w1, w3) and [dim, inter] (w2), UE8M0 scales per 32 of a row */
    size_t wb = (size_t)m->inter * m->D / 2, sb = (size_t)m->inter * m->D / 32;
    const size_t len[PARTS] = {wb, sb, wb, sb, wb, sb};
    for (int p = 0; p < PARTS; p++) {
        m->part_off[p] = m->blob;
        m->part_len[p] = len[p];
        m->blob += align64(m->part_len[p]);
    }
    size_t LS = (size_t)m->L * m->S, W = m->world;
    m->place = calloc(m->L, sizeof(ep_placement));
    m->prev = calloc(m->L, sizeof(ep_placement));
    m->was_revert = calloc(m->L, sizeof(bool));
    m->slot_mem = calloc(LS, sizeof(uint8_t *));
    m->views = calloc(LS, sizeof(kern_expert));
    m->step_counts = calloc(LS, sizeof(uint64_t));
    m->window = calloc((size_t)(m->interval ? m->interval : 1) * m->L * W * m->S,
                       sizeof(uint64_t));
    m->seg = calloc(W, sizeof(hbuf));
    m->out = calloc(W, sizeof(hbuf));
    m->send = calloc(W, sizeof(ep_buf));
    m->recv = calloc(W, sizeof(ep_buf));
    m->nth = calloc(m->E, sizeof(uint32_t));
    m->cnt = calloc(W, sizeof(uint32_t));
    m->first = calloc(W, sizeof(uint32_t));
    m->last_pairs = calloc(m->L, sizeof(uint64_t));
    m->soff = calloc(4 * W, sizeof(uint64_t));
    if (m->soff) {
        m->slen = m->soff + W;
        m->roff = m->slen + W;
        m->rlen = m->roff + W;
    }
    if (!m->last_pairs || !m->soff || !m->place || !m->prev || !m->was_revert ||
        !m->slot_mem || !m->views || !m->step_counts || !m->window || !m->seg || !m->out ||
        !m->send || !m->recv || !m->nth || !m->cnt || !m->first) {
        ep_moe_free(m);
        return di_fail(err, DI_ENOMEM, "expert parallelism tables");
    }
    for (uint32_t l = 0; st == DI_OK && l < m->L; l++) {
        eplb_layout lay;
        if ((st = eplb_startup_layout(m->E, m->world, m->S, &lay, err)) != DI_OK)
            break;
        st = ep_placement_build(&lay, m->E, &m->place[l], err);
        eplb_layout_free(&lay);
        for (uint32_t s = 0; st == DI_OK && s < m->S; s++) {
            uint32_t e = (uint32_t)m->place[l].slot_expert[m->rank * m->S + s];
            if ((st = load_slot(m, l, e, &m->slot_mem[(size_t)l * m->S + s], err)) == DI_OK)
                set_view(m, l, s);
        }
    }
    m->stats.slot_bytes = (uint64_t)LS * m->blob;
    if (st != DI_OK) {
        ep_moe_free(m);
        return st;
    }
    *out = m;
    return DI_OK;
}

void ep_moe_free(ep_moe *m)
{
    if (!m)
        return;
    for (uint32_t l = 0; m->place && l < m->L; l++)
        ep_placement_free(&m->place[l]);
    for (uint32_t l = 0; m->prev && l < m->L; l++)
        ep_placement_free(&m->prev[l]);
    for (size_t i = 0; m->slot_mem && i < (size_t)m->L * m->S; i++)
        slot_free(m, m->slot_mem[i]);
    for (uint32_t r = 0; r < m->world; r++) {
        if (m->seg && m->seg[r].p)
            m->xo.host_free(m->xo.ctx, m->seg[r].p);
        if (m->out && m->out[r].p)
            m->xo.host_free(m->xo.ctx, m->out[r].p);
    }
    bbuf *bb[] = {&m->xg, &m->sx, &m->sid, &m->swt, &m->sy, &m->outs, &m->shared, &m->rx};
    for (size_t i = 0; i < sizeof bb / sizeof bb[0]; i++)
        bbuf_free(m, bb[i]);
    free(m->place);
    free(m->prev);
    free(m->was_revert);
    free(m->slot_mem);
    free(m->views);
    free(m->step_counts);
    free(m->window);
    free(m->seg);
    free(m->out);
    free(m->send);
    free(m->recv);
    free(m->nth);
    free(m->cnt);
    free(m->first);
    free(m->last_pairs);
    free(m->soff);
    free(m->pairs.p);
    free(m->meta.p);
    free(m->served.p);
    free(m->segs.p);
    free(m);
}

const ep_moe_stats *ep_moe_get_stats(const ep_moe *m) { return &m->stats; }

const uint64_t *ep_moe_last_step_pairs(const ep_moe *m) { return m->last_pairs; }

uint32_t ep_moe_layers(const ep_moe *m) { return m->L; }

const ep_placement *ep_moe_placement(const ep_moe *m, uint32_t layer)
{
    return layer < m->L ? &m->place[layer] : NULL;
}

/* ---- one round ---- */

/* Runs the pairs of one received dispatch segment on this rank's slots. Without a device
 * transport the rows follow the records in the segment, go to backend memory and the outputs
 * come back into m->out[src]; with one the rows are in m->rx and the outputs go to m->sy, both
 * at m->roff[src]. */
static di_status serve_segment(ep_moe *m, uint32_t src, const seg_hdr *h, const uint8_t *body,
                               di_error *err)
{
    uint32_t n = h->n_pairs;
    bool dev = m->dx.alltoallv != NULL;
    const pair_rec *recs = (const pair_rec *)body;
    const uint16_t *rows = (const uint16_t *)(body + (size_t)n * sizeof(pair_rec));
    size_t row_bytes = (size_t)m->D * 2, rb = (size_t)n * row_bytes;
    if (ebuf_reserve(&m->served, (size_t)n * 8) != 0 ||
        (!dev && hbuf_reserve(m, &m->out[src], rb) != 0))
        return di_fail(err, DI_ENOMEM, "serving %u pairs", n);
    int32_t *ids = (int32_t *)m->served.p;
    float *wts = (float *)(m->served.p + (size_t)n * 4);
    for (uint32_t i = 0; i < n; i++) {
        if (recs[i].slot >= m->S)
            return di_fail(err, DI_EPROTO, "rank %u sent a pair for slot %u (this rank has %u)",
                           src, recs[i].slot, m->S);
        ids[i] = (int32_t)recs[i].slot;
        wts[i] = recs[i].weight;
        m->step_counts[(size_t)h->layer * m->S + recs[i].slot]++;
    }
    di_status st;
    if ((!dev && (st = bbuf_reserve(m, &m->sx, rb, err)) != DI_OK) ||
        (st = bbuf_reserve(m, &m->sid, (size_t)n * 4, err)) != DI_OK ||
        (st = bbuf_reserve(m, &m->swt, (size_t)n * 4, err)) != DI_OK ||
        (!dev && (st = bbuf_reserve(m, &m->sy, rb, err)) != DI_OK))
        return st;
    const kern_ops *ops = &m->be->ops;
    void *x = dev ? (uint8_t *)m->rx.p + m->roff[src] : m->sx.p;
    void *y = dev ? (uint8_t *)m->sy.p + m->roff[src] : m->sy.p;
    if (!dev)
        ops->from_host(m->be->ctx, m->sx.p, rows, rb);
    ops->from_host(m->be->ctx, m->sid.p, ids, (size_t)n * 4);
    ops->from_host(m->be->ctx, m->swt.p, wts, (size_t)n * 4);
    /* the one-rank kernel with one expert a row and no shared expert: y is each pair's
     * expert output, exactly (bf16 -> double -> bf16) */
    kern_moe_experts q = {.n_rows = n, .dim = m->D, .inter = m->inter, .shared_inter = 0,
                          .n_experts = m->S, .top_k = 1, .x = x, .ids = m->sid.p,
                          .weights = m->swt.p, .experts = &m->views[(size_t)h->layer * m->S],
                          .swiglu_limit = m->swiglu_limit, .y = y};
    if ((st = ops->moe_experts(m->be->ctx, &q)) != DI_OK)
        return di_fail(err, st, "layer %u: experts of %u pairs from rank %u: %s", h->layer, n,
                       src, be_msg(m));
    if (!dev) {
        ops->to_host(m->be->ctx, m->out[src].p, m->sy.p, rb);
        m->out[src].len = rb;
    }
    m->stats.pairs_served += n;
    return DI_OK;
}

/* Dispatch (m->send, built by the caller), serve, combine. *all_done when every rank's segment
 * said done (there is no combine then); otherwise m->recv holds each rank's outputs of the
 * pairs this rank sent it, valid until the next collective. */
static di_status group_a2a(ep_moe *m, di_error *err)
{
    uint64_t t0 = di_mono_ns();
    di_status st = ep_group_alltoallv(m->g, m->send, m->recv, err);
    m->stats.xchg_ns += di_mono_ns() - t0;
    return st;
}

/* One device all-to-all of m->soff/slen -> m->roff/rlen. */
static di_status dev_a2a(ep_moe *m, const void *send, void *recv, const char *what,
                         di_error *err)
{
    uint64_t t0 = di_mono_ns();
    di_status st = m->dx.alltoallv(m->dx.ctx, send, m->soff, m->slen, recv, m->roff, m->rlen,
                                   err);
    m->stats.xchg_ns += di_mono_ns() - t0;
    for (uint32_t d = 0; d < m->world; d++)
        m->stats.dev_bytes_sent += m->slen[d];
    if (st != DI_OK)
        di_error_prefix(err, "%s: ", what);
    return st;
}

/* The byte ranges of this rank's pairs by destination (m->first, m->cnt: the gathered rows and
 * the outputs buffer) and of the pairs each rank sent (the received headers, in rank order). */
static void dev_ranges(ep_moe *m, uint64_t *pos_off, uint64_t *pos_len, uint64_t *recv_off,
                       uint64_t *recv_len)
{
    size_t row_bytes = (size_t)m->D * 2;
    uint64_t at = 0;
    for (uint32_t s = 0; s < m->world; s++) {
        seg_hdr h;
        memcpy(&h, m->recv[s].data, sizeof h);
        pos_off[s] = (uint64_t)m->first[s] * row_bytes;
        pos_len[s] = (uint64_t)m->cnt[s] * row_bytes;
        recv_off[s] = at;
        recv_len[s] = (uint64_t)h.n_pairs * row_bytes;
        at += recv_len[s];
    }
}

static di_status round_trip(ep_moe *m, bool *all_done, di_error *err)
{
    di_status st = group_a2a(m, err);
    if (st != DI_OK)
        return st;
    m->stats.rounds++;
    bool dev = m->dx.alltoallv != NULL;
    uint64_t seg_row = dev ? 0 : 2ull * m->D;
    bool done = true;
    for (uint32_t s = 0; s < m->world; s++) {
        const ep_buf *b = &m->recv[s];
        seg_hdr h;
        if (b->len < sizeof h)
            return di_fail(err, DI_EPROTO, "rank %u sent a dispatch segment of %llu bytes", s,
                           (unsigned long long)b->len);
        memcpy(&h, b->data, sizeof h);
        if (b->len != sizeof h + (uint64_t)h.n_pairs * (sizeof(pair_rec) + seg_row) ||
            (h.n_pairs && h.layer >= m->L))
            return di_fail(err, DI_EPROTO, "rank %u sent a malformed dispatch segment (layer "
                           "%u, %u pairs, %llu bytes)", s, h.layer, h.n_pairs,
                           (unsigned long long)b->len);
        done &= h.done != 0;
        m->out[s].len = 0;
    }
    *all_done = done;
    if (done)
        return DI_OK;
    if (dev) {
        /* the received headers and records outlive the group's buffers (a transport may use
         * the group, ep_dev_xport_group) */
        size_t all = 0;
        for (uint32_t s = 0; s < m->world; s++)
            all += m->recv[s].len;
        if (ebuf_reserve(&m->segs, all) != 0)
            return di_fail(err, DI_ENOMEM, "%zu bytes of dispatch records", all);
        size_t at = 0;
        for (uint32_t s = 0; s < m->world; s++) {
            memcpy(m->segs.p + at, m->recv[s].data, m->recv[s].len);
            m->recv[s].data = m->segs.p + at;
            at += m->recv[s].len;
        }
        /* the rows: this rank's gathered rows by destination -> m->rx by source */
        dev_ranges(m, m->soff, m->slen, m->roff, m->rlen);
        uint64_t total = m->roff[m->world - 1] + m->rlen[m->world - 1];
        if ((st = bbuf_reserve(m, &m->rx, total, err)) != DI_OK ||
            (st = bbuf_reserve(m, &m->sy, total, err)) != DI_OK ||
            (st = dev_a2a(m, m->xg.p, m->rx.p, "dispatch", err)) != DI_OK)
            return st;
    }
    for (uint32_t s = 0; s < m->world; s++) {
        seg_hdr h;
        memcpy(&h, m->recv[s].data, sizeof h);
        if (h.n_pairs &&
            (st = serve_segment(m, s, &h, (const uint8_t *)m->recv[s].data + sizeof h, err)) !=
                DI_OK)
            return st;
    }
    if (dev) {
        /* the outputs: m->sy by source -> back into m->outs at the pairs' gathered rows */
        dev_ranges(m, m->roff, m->rlen, m->soff, m->slen);
        return dev_a2a(m, m->sy.p, m->outs.p, "combine", err);
    }
    for (uint32_t s = 0; s < m->world; s++)
        m->send[s] = (ep_buf){m->out[s].p, m->out[s].len};
    return group_a2a(m, err);
}

/* ---- the layer ---- */

/* The shared expert on the rank's rows: o = W2 swiglu(W1 x, W3 x) with FP8 weights, as the
 * one-rank kernel computes it (backend memory). */
static di_status shared_expert(ep_moe *m, const kern_moe_experts *p, uint16_t **o,
                               di_error *err)
{
    size_t T = p->n_rows, SI = p->shared_inter;
    di_status st = bbuf_reserve(m, &m->shared, (T * SI * 3 + T * m->D) * 2, err);
    if (st != DI_OK)
        return st;
    uint16_t *g = m->shared.p, *u = g + T * SI, *h = u + T * SI, *y = h + T * SI;
    const kern_ops *ops = &m->be->ops;
    kern_linear l = {.m = (uint32_t)T, .n = (uint32_t)SI, .k = m->D, .groups = 1, .x = p->x,
                     .x_stride = m->D, .w = p->shared.w1, .w_scale = p->shared.w1_scale, .y = g,
                     .y_stride = SI};
    st = ops->linear_fp8(m->be->ctx, &l);
    l.w = p->shared.w3, l.w_scale = p->shared.w3_scale, l.y = u;
    if (st == DI_OK)
        st = ops->linear_fp8(m->be->ctx, &l);
    kern_swiglu sw = {.n_rows = (uint32_t)T, .n = (uint32_t)SI, .g = g, .u = u, .stride = SI,
                      .w = NULL, .limit = p->swiglu_limit, .h = h};
    if (st == DI_OK)
        st = ops->swiglu(m->be->ctx, &sw);
    kern_linear l2 = {.m = (uint32_t)T, .n = m->D, .k = (uint32_t)SI, .groups = 1, .x = h,
                      .x_stride = SI, .w = p->shared.w2, .w_scale = p->shared.w2_scale, .y = y,
                      .y_stride = m->D};
    if (st == DI_OK)
        st = ops->linear_fp8(m->be->ctx, &l2);
    if (st != DI_OK)
        return di_fail(err, st, "shared expert of %zu rows: %s", T, be_msg(m));
    *o = y;
    return DI_OK;
}

/* The dispatch segments of a layer's pairs (m->seg): header, the pairs' records, their rows.
 * The rows are gathered by destination in backend memory (copy_rows) and copied out once a
 * destination. dst/slot/idx as planned by the caller; m->first[d] is d's first pair in the
 * gathered order. */
static di_status build_segments(ep_moe *m, uint32_t layer, const kern_moe_experts *p,
                                const uint32_t *dst, const uint32_t *slot, const uint32_t *idx,
                                const float *wts, int32_t *src_row, di_error *err)
{
    uint32_t K = p->top_k, D = m->D, W = m->world;
    size_t NP = (size_t)p->n_rows * K, row_bytes = (size_t)D * 2;
    bool dev = m->dx.alltoallv != NULL; /* the rows stay in m->xg */
    for (uint32_t d = 0, at = 0; d < W; d++) {
        m->first[d] = at;
        at += m->cnt[d];
        size_t need = sizeof(seg_hdr) +
                      (size_t)m->cnt[d] * (sizeof(pair_rec) + (dev ? 0 : row_bytes));
        m->seg[d].len = 0;
        if (hbuf_reserve(m, &m->seg[d], need) != 0)
            return di_fail(err, DI_ENOMEM, "dispatch of %u pairs", m->cnt[d]);
        seg_hdr h = {.layer = layer, .n_pairs = m->cnt[d], .done = 0};
        memcpy(m->seg[d].p, &h, sizeof h);
        m->seg[d].len = need;
    }
    for (size_t i = 0; i < NP; i++) {
        uint8_t *b = m->seg[dst[i]].p + sizeof(seg_hdr);
        pair_rec r = {.slot = slot[i], .weight = wts[i]};
        memcpy(b + (size_t)idx[i] * sizeof(pair_rec), &r, sizeof r);
        src_row[m->first[dst[i]] + idx[i]] = (int32_t)(i / K);
    }
    di_status st = bbuf_reserve(m, &m->xg, NP * row_bytes, err);
    if (st != DI_OK)
        return st;
    kern_copy_rows cp = {.n_rows = (uint32_t)NP, .row_bytes = row_bytes, .src = p->x,
                         .src_stride = row_bytes, .rows = src_row, .dst = m->xg.p,
                         .dst_stride = row_bytes};
    if (NP && (st = m->be->ops.copy_rows(m->be->ctx, &cp)) != DI_OK)
        return di_fail(err, st, "layer %u: gathering %zu rows: %s", layer, NP, be_msg(m));
    for (uint32_t d = 0; d < W && !dev; d++)
        if (m->cnt[d])
            m->be->ops.to_host(m->be->ctx, m->seg[d].p + sizeof(seg_hdr) +
                                               (size_t)m->cnt[d] * sizeof(pair_rec),
                               (uint8_t *)m->xg.p + (size_t)m->first[d] * row_bytes,
                               (size_t)m->cnt[d] * row_bytes);
    return DI_OK;
}

di_status ep_moe_layer(void *ud, uint32_t layer, const kern_moe_experts *p, di_error *err)
{
    ep_moe *m = ud;
    if (layer >= m->L || p->top_k != m->K || p->dim != m->D || p->n_experts != m->E ||
        p->inter != m->inter)
        return di_fail(err, DI_EINVAL, "expert parallelism: layer %u with %u experts top-%u "
                       "does not match the model's", layer, p->n_experts, p->top_k);
    const ep_placement *pl = &m->place[layer];
    uint32_t T = p->n_rows, K = p->top_k, D = m->D, W = m->world;
    size_t NP = (size_t)T * K, row_bytes = (size_t)D * 2;
    if (ebuf_reserve(&m->pairs, NP * 12 + 12) != 0 || ebuf_reserve(&m->meta, NP * 16 + 16) != 0)
        return di_fail(err, DI_ENOMEM, "%zu pairs", NP);
    uint32_t *dst = (uint32_t *)m->pairs.p, *idx = dst + NP, *slot = idx + NP;
    int32_t *ids = (int32_t *)m->meta.p, *src_row = ids + NP, *pos = src_row + NP;
    float *wts = (float *)(pos + NP);
    /* the gate's choice, on the host (a device backend copies it back) */
    if (NP) {
        m->be->ops.to_host(m->be->ctx, ids, p->ids, NP * 4);
        m->be->ops.to_host(m->be->ctx, wts, p->weights, NP * 4);
    }
    memset(m->nth, 0, m->E * sizeof(uint32_t));
    memset(m->cnt, 0, W * sizeof(uint32_t));
    /* where each pair goes: the n-th token of an expert to its copy n mod copies */
    for (size_t i = 0; i < NP; i++) {
        int32_t e = ids[i];
        if (e < 0 || (uint32_t)e >= m->E)
            return di_fail(err, DI_EINVAL, "row %zu routes to expert %d", i / K, e);
        uint32_t phys = ep_placement_pick(pl, (uint32_t)e, m->nth[e]++);
        dst[i] = phys / m->S;
        slot[i] = phys % m->S;
        idx[i] = m->cnt[dst[i]]++;
    }
    di_status st = build_segments(m, layer, p, dst, slot, idx, wts, src_row, err);
    if (st != DI_OK)
        return st;
    for (uint32_t d = 0; d < W; d++)
        m->send[d] = (ep_buf){m->seg[d].p, m->seg[d].len};
    m->stats.pairs_sent += NP;
    /* the outputs, by destination in the gathered order, in backend memory (a device
     * transport writes them there during the round) */
    if ((st = bbuf_reserve(m, &m->outs, NP * row_bytes, err)) != DI_OK)
        return st;
    bool all_done;
    if ((st = round_trip(m, &all_done, err)) != DI_OK)
        return st;
    bool dev = m->dx.alltoallv != NULL;
    for (uint32_t d = 0; d < W && !dev; d++)
        if (m->recv[d].len != (uint64_t)m->cnt[d] * row_bytes)
            return di_fail(err, DI_EPROTO, "rank %u returned %llu bytes for %u pairs", d,
                           (unsigned long long)m->recv[d].len, m->cnt[d]);
    for (uint32_t d = 0; d < W && !dev; d++)
        if (m->recv[d].len)
            m->be->ops.from_host(m->be->ctx,
                                 (uint8_t *)m->outs.p + (size_t)m->first[d] * row_bytes,
                                 m->recv[d].data, m->recv[d].len);
    uint16_t *sh = NULL;
    if (T && p->shared_inter && (st = shared_expert(m, p, &sh, err)) != DI_OK)
        return st;
    /* a row's outputs by ascending expert id, then the shared expert (the one-rank order) */
    for (uint32_t t = 0; t < T; t++) {
        uint32_t order[64];
        const int32_t *e = ids + (size_t)t * K;
        for (uint32_t k = 0; k < K; k++) {
            uint32_t j = k;
            while (j > 0 && e[order[j - 1]] > e[k]) {
                order[j] = order[j - 1];
                j--;
            }
            order[j] = k;
        }
        for (uint32_t k = 0; k < K; k++) {
            size_t i = (size_t)t * K + order[k];
            pos[(size_t)t * K + k] = (int32_t)(m->first[dst[i]] + idx[i]);
        }
    }
    kern_ep_combine c = {.n_rows = T, .dim = D, .top_k = K, .n_outs = (uint32_t)NP,
                         .outs = m->outs.p, .pos = pos, .shared = sh, .y = p->y};
    if (T && (st = m->xo.combine(m->xo.ctx, &c)) != DI_OK)
        return di_fail(err, st, "layer %u: combining %u rows: %s", layer, T, be_msg(m));
    return DI_OK;
}

/* ---- the end of a step, EPLB ---- */

/* Moves the weights for the layers whose placement changes (next[l].slot_expert != NULL) and
 * installs the new placements; the ones they replace are kept in m->prev. */
static di_status move_weights(ep_moe *m, ep_placement *next, di_error *err)
{
    uint32_t W = m->world, S = m->S, me = m->rank;
    for (uint32_t d = 0; d < W; d++)
        m->seg[d].len = 0;
    /* every rank walks the same (layer, rank, slot) order: what it sends, what it gets */
    for (uint32_t l = 0; l < m->L; l++) {
        if (!next[l].slot_expert)
            continue;
        const ep_placement *old = &m->place[l];
        for (uint32_t d = 0; d < W; d++)
            for (uint32_t s = 0; s < S; s++) {
                int32_t e = next[l].slot_expert[d * S + s];
                bool held = false;
                for (uint32_t k = 0; k < S && !held; k++)
                    held = old->slot_expert[d * S + k] == e;
                uint32_t src = old->copies[old->copy_start[e]] / S;
                if (held || src != me)
                    continue;
                uint32_t from = old->copies[old->copy_start[e]] % S;
                if (hbuf_reserve(m, &m->seg[d], m->seg[d].len + m->blob) != 0)
                    return di_fail(err, DI_ENOMEM, "expert weights to move");
                m->be->ops.to_host(m->be->ctx, m->seg[d].p + m->seg[d].len,
                                   m->slot_mem[(size_t)l * S + from], m->blob);
                m->seg[d].len += m->blob;
            }
    }
    for (uint32_t d = 0; d < W; d++)
        m->send[d] = (ep_buf){m->seg[d].p, m->seg[d].len};
    di_status st = ep_group_alltoallv(m->g, m->send, m->recv, err);
    if (st != DI_OK)
        return st;
    uint64_t *got = calloc(W, sizeof(uint64_t));
    uint8_t **fresh = calloc((size_t)m->L * S, sizeof(uint8_t *));
    if (!got || !fresh) {
        free(got);
        free(fresh);
        return di_fail(err, DI_ENOMEM, "expert weights to move");
    }
    for (uint32_t l = 0; st == DI_OK && l < m->L; l++) {
        if (!next[l].slot_expert)
            continue;
        const ep_placement *old = &m->place[l];
        for (uint32_t s = 0; st == DI_OK && s < S; s++) {
            int32_t e = next[l].slot_expert[me * S + s];
            uint8_t *b = slot_alloc(m);
            if (!b) {
                st = di_fail(err, DI_ENOMEM, "expert slot of %zu bytes of %s memory", m->blob,
                             m->be->name);
                break;
            }
            fresh[(size_t)l * S + s] = b;
            int32_t local = -1;
            for (uint32_t k = 0; k < S && local < 0; k++)
                if (old->slot_expert[me * S + k] == e)
                    local = (int32_t)k;
            if (local >= 0) {
                kern_copy_rows cp = {.n_rows = 1, .row_bytes = m->blob,
                                     .src = m->slot_mem[(size_t)l * S + (uint32_t)local],
                                     .src_stride = m->blob, .dst = b, .dst_stride = m->blob};
                if ((st = m->be->ops.copy_rows(m->be->ctx, &cp)) != DI_OK)
                    st = di_fail(err, st, "layer %u: copying expert %d: %s", l, e, be_msg(m));
                continue;
            }
            uint32_t src = old->copies[old->copy_start[e]] / S;
            if (m->recv[src].len < got[src] + m->blob) {
                st = di_fail(err, DI_EPROTO, "rank %u sent fewer expert weights than planned",
                             src);
                break;
            }
            m->be->ops.from_host(m->be->ctx, b, (const uint8_t *)m->recv[src].data + got[src],
                                 m->blob);
            got[src] += m->blob;
            m->stats.experts_moved++;
            m->stats.bytes_moved += m->blob;
        }
    }
    for (uint32_t s = 0; st == DI_OK && s < W; s++)
        if (got[s] != m->recv[s].len)
            st = di_fail(err, DI_EPROTO, "rank %u sent more expert weights than planned", s);
    if (st != DI_OK) {
        for (size_t i = 0; i < (size_t)m->L * S; i++)
            slot_free(m, fresh[i]);
        free(fresh);
        free(got);
        return st;
    }
    for (uint32_t l = 0; l < m->L; l++) {
        if (!next[l].slot_expert)
            continue;
        for (uint32_t s = 0; s < S; s++) {
            slot_free(m, m->slot_mem[(size_t)l * S + s]);
            m->slot_mem[(size_t)l * S + s] = fresh[(size_t)l * S + s];
            set_view(m, l, s);
        }
        ep_placement_free(&m->prev[l]);
        m->prev[l] = m->place[l];
        m->place[l] = next[l];
        memset(&next[l], 0, sizeof next[l]);
    }
    free(fresh);
    free(got);
    return DI_OK;
}

/* The window's per-slot counts summed over the group; per layer, the second look at the last
 * change (eplb_judge: a worse change goes back to the previous layout) or else a plan and the
 * guard; the moves. */
static di_status replan(ep_moe *m, di_error *err)
{
    uint32_t PS = m->world * m->S, steps = m->win_steps;
    size_t n = (size_t)steps * m->L * PS;
    if (n > UINT32_MAX)
        return di_fail(err, DI_ERANGE, "EPLB window of %zu counts", n);
    di_status st = ep_group_allreduce(m->g, EP_REDUCE_SUM, m->window, (uint32_t)n, err);
    if (st != DI_OK)
        return st;
    double *load = malloc((size_t)steps * m->E * sizeof(double));
    ep_placement *next = calloc(m->L, sizeof(ep_placement));
    uint8_t *change = calloc(m->L, 1); /* per layer: 0 none, 1 a plan, 2 a revert */
    if (!load || !next || !change) {
        free(load);
        free(next);
        free(change);
        return di_fail(err, DI_ENOMEM, "EPLB window");
    }
    bool changed = false;
    for (uint32_t l = 0; st == DI_OK && l < m->L; l++) {
        const ep_placement *pl = &m->place[l];
        double total = 0;
        memset(load, 0, (size_t)steps * m->E * sizeof(double));
        for (uint32_t t = 0; t < steps; t++)
            for (uint32_t s = 0; s < PS; s++) {
                double v = (double)m->window[((size_t)t * m->L + l) * PS + s];
                load[(size_t)t * m->E + (uint32_t)pl->slot_expert[s]] += v;
                total += v;
            }
        if (total == 0)
            continue; /* nothing routed in the window: nothing to plan from */
        eplb_window w = {.load = load, .num_steps = steps, .num_experts = m->E};
        eplb_layout cur = ep_placement_layout(pl);
        if (m->prev[l].slot_expert) {
            eplb_layout before = ep_placement_layout(&m->prev[l]);
            eplb_verdict v;
            if ((st = eplb_judge(&w, &cur, &before, m->was_revert[l], &v, err)) != DI_OK)
                break;
            if (v.revert) {
                st = ep_placement_build(&before, m->E, &next[l], err);
                change[l] = 2;
                m->stats.replans_reverted++;
                changed = true;
                continue;
            }
        }
        eplb_decision dec;
        if ((st = eplb_rebalance(&w, &cur, &dec, err)) != DI_OK)
            break;
        if (dec.kept_current) {
            m->stats.layers_kept++;
        } else {
            st = ep_placement_build(&dec.layout, m->E, &next[l], err);
            change[l] = 1;
            m->stats.layers_replanned++;
            changed = true;
        }
        eplb_decision_free(&dec);
    }
    if (st == DI_OK && changed) {
        m->stats.replans++;
        st = move_weights(m, next, err);
    }
    /* a layer that did not change now has no change to look at again */
    for (uint32_t l = 0; st == DI_OK && l < m->L; l++) {
        m->was_revert[l] = change[l] == 2;
        if (!change[l])
            ep_placement_free(&m->prev[l]);
    }
    for (uint32_t l = 0; l < m->L; l++)
        ep_placement_free(&next[l]);
    free(next);
    free(change);
    free(load);
    return st;
}

di_status ep_moe_step_end(ep_moe *m, di_error *err)
{
    memset(m->cnt, 0, m->world * sizeof(uint32_t)); /* nothing of this rank's to send */
    memset(m->first, 0, m->world * sizeof(uint32_t));
    for (;;) {
        seg_hdr h = {.layer = UINT32_MAX, .n_pairs = 0, .done = 1};
        for (uint32_t d = 0; d < m->world; d++) {
            m->seg[d].len = 0;
            if (hbuf_reserve(m, &m->seg[d], sizeof h) != 0)
                return di_fail(err, DI_ENOMEM, "exchange");
            memcpy(m->seg[d].p, &h, sizeof h);
            m->send[d] = (ep_buf){m->seg[d].p, sizeof h};
        }
        bool all_done;
        di_status st = round_trip(m, &all_done, err);
        if (st != DI_OK)
            return st;
        if (all_done)
            break;
        m->stats.serve_rounds++;
    }
    /* this step's per-slot counts go to the window at this rank's physical slots */
    uint32_t PS = m->world * m->S;
    if (m->interval) {
        for (uint32_t l = 0; l < m->L; l++)
            for (uint32_t s = 0; s < m->S; s++)
                m->window[((size_t)m->win_steps * m->L + l) * PS + m->rank * m->S + s] =
                    m->step_counts[(size_t)l * m->S + s];
        m->win_steps++;
    }
    for (uint32_t l = 0; l < m->L; l++) {
        m->last_pairs[l] = 0;
        for (uint32_t s = 0; s < m->S; s++)
            m->last_pairs[l] += m->step_counts[(size_t)l * m->S + s];
    }
    memset(m->step_counts, 0, (size_t)m->L * m->S * sizeof(uint64_t));
    m->stats.steps++;
    if (!m->interval || m->win_steps < m->interval)
        return DI_OK;
    di_status st = replan(m, err);
    memset(m->window, 0, (size_t)m->interval * m->L * PS * sizeof(uint64_t));
    m->win_steps = 0;
    return st;
}

/* ---- the checkpoint filter ---- */

bool ep_moe_keep_expert(void *filter, const model_config *c, uint32_t layer, uint32_t expert)
{
    const ep_expert_filter *f = filter;
    (void)layer; /* the start-up layout is the same for every layer */
    uint32_t E = c->n_routed_experts, R;
    if (E == 0 || f->world == 0 ||
        eplb_redundant_count(E, f->min_redundant, f->world, &R, NULL) != DI_OK)
        return true; /* ep_moe_create refuses it with the reason */
    /* start-up layout (eplb.h): physical slot p holds expert p mod E */
    uint32_t S = (E + R) / f->world;
    for (uint32_t p = f->rank * S; p < (f->rank + 1) * S; p++)
        if (p % E == expert)
            return true;
    return false;
}

/* ---- the group as a device transport (host-memory backends) ---- */

static di_status group_dev_a2a(void *ctx, const void *send, const uint64_t *send_off,
                               const uint64_t *send_len, void *recv, const uint64_t *recv_off,
                               const uint64_t *recv_len, di_error *err)
{
    ep_group *g = ctx;
    uint32_t W = ep_group_world(g);
    ep_buf *sb = calloc(W, sizeof(ep_buf)), *rb = calloc(W, sizeof(ep_buf));
    di_status st = DI_OK;
    if (!sb || !rb)
        st = di_fail(err, DI_ENOMEM, "device all-to-all of %u ranks", W);
    for (uint32_t d = 0; st == DI_OK && d < W; d++)
        sb[d] = (ep_buf){(uint8_t *)send + send_off[d], send_len[d]};
    if (st == DI_OK)
        st = ep_group_alltoallv(g, sb, rb, err);
    for (uint32_t s = 0; st == DI_OK && s < W; s++) {
        if (rb[s].len != recv_len[s])
            st = di_fail(err, DI_EPROTO, "rank %u sent %llu bytes, %llu were announced", s,
                         (unsigned long long)rb[s].len, (unsigned long long)recv_len[s]);
        else if (rb[s].len)
            memcpy((uint8_t *)recv + recv_off[s], rb[s].data, rb[s].len);
    }
    free(sb);
    free(rb);
    return st;
}

void ep_dev_xport_group(ep_group *g, ep_dev_xport *out)
{
    *out = (ep_dev_xport){.ctx = g, .alltoallv = group_dev_a2a};
}
