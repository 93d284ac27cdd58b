/* CPU ops: MoE router, SwiGLU with the asymmetric clamp, routed + shared experts. */
#include <stdlib.h>

#include "kernels/cpu/cpu_internal.h"

/* ---- router ---- */

/* log(1 + e^z) in double, stable for either sign (log-add-exp of 0 and z). */
static double softplus_d(double z)
{
    return z > 0 ? z + log1p(exp(-z)) : log1p(exp(z));
}

static di_status cpu_moe_gate(void *ctx, const kern_moe_gate *p)
{
    assert(p->top_k >= 1 && p->top_k <= p->n_experts && p->n_experts <= 4096);
    float s[4096], sel[4096];
    uint8_t used[4096];
    for (uint32_t t = 0; t < p->n_rows; t++) {
        const float *z = p->logits + (size_t)t * p->n_experts;
        for (uint32_t e = 0; e < p->n_experts; e++) {
            float zt = z[e] / p->temp;
            float sp = (float)softplus_d(zt);
            s[e] = (float)sqrt((double)sp);
            sel[e] = s[e] + (p->bias ? p->bias[e] : 0.0f);
            used[e] = 0;
        }
        int32_t *ids = p->ids + (size_t)t * p->top_k;
        float *w = p->weights + (size_t)t * p->top_k;
        double sum = 0.0;
        for (uint32_t k = 0; k < p->top_k; k++) {
            int32_t best = -1;
            for (uint32_t e = 0; e < p->n_experts; e++)
                if (!used[e] && (best < 0 || sel[e] > sel[best]))
                    best = (int32_t)e;
            used[best] = 1;
            ids[k] = best;
            sum += s[best];
        }
        float norm = (float)(sum + 1e-20);
        for (uint32_t k = 0; k < p->top_k; k++) {
            float wk = (float)((double)s[ids[k]] / (double)norm);
            w[k] = (float)((double)wk * (double)p->route_scale);
        }
    }
    return DI_OK;
}

/* ---- SwiGLU ---- */

static di_status cpu_swiglu(void *ctx, const kern_swiglu *p)
{
    for (uint32_t r = 0; r < p->n_rows; r++) {
        const uint16_t *g = p->g + (size_t)r * p->stride, *u = p->u + (size_t)r * p->stride;
        uint16_t *h = p->h + (size_t)r * p->n;
        float w = p->w ? p->w[r] : 1.0f;
        for (uint32_t i = 0; i < p->n; i++) {
            float gv = bf(g[i]), uv = bf(u[i]);
            if (p->limit > 0.0f) {
                uv = uv < -p->limit ? -p->limit : (uv > p->limit ? p->limit : uv);
                gv = gv > p->limit ? p->limit : gv;
            }
            /* silu = fp32(g sigmoid(g)); h = bf16(fp32(fp32(silu * u) * w)) */
            float silu = (float)((double)gv * sigmoid_d(gv));
            float act = (float)((double)silu * (double)uv);
            if (p->w)
                act = (float)((double)act * (double)w);
            h[i] = to_bf(act);
        }
    }
    return DI_OK;
}

/* ---- experts ---- */

typedef struct expert_bufs {
    uint16_t *x;                /* [n, dim] gathered rows */
    uint16_t *g, *u;            /* [n, inter] */
    uint16_t *h;                /* [n, inter] */
    uint16_t *o;                /* [n, dim] */
    float *w;                   /* [n] routing weights */
} expert_bufs;

/* One expert (or the shared one) on n gathered rows: o = W2 swiglu(W1 x, W3 x, w). */
static di_status run_expert(const cpu_ctx *c, const kern_moe_experts *p, const kern_expert *ex,
                            kern_wfmt fmt, uint32_t n, uint32_t inter, const uint16_t *x,
                            const float *w, expert_bufs *b)
{
    kern_linear l = {.m = n, .n = inter, .k = p->dim, .groups = 1, .x = x, .x_stride = p->dim,
                     .y_stride = inter};
    l.w = ex->w1, l.w_scale = ex->w1_scale, l.y = b->g;
    di_status st = cpu_linear_run(c, &l, fmt);
    l.w = ex->w3, l.w_scale = ex->w3_scale, l.y = b->u;
    if (st == DI_OK)
        st = cpu_linear_run(c, &l, fmt);
    if (st != DI_OK)
        return st;
    kern_swiglu sw = {.n_rows = n, .n = inter, .g = b->g, .u = b->u, .stride = inter, .w = w,
                      .limit = p->swiglu_limit, .h = b->h};
    cpu_swiglu((void *)c, &sw);
    kern_linear l2 = {.m = n, .n = p->dim, .k = inter, .groups = 1, .x = b->h, .x_stride = inter,
                      .w = ex->w2, .w_scale = ex->w2_scale, .y = b->o, .y_stride = p->dim};
    return cpu_linear_run(c, &l2, fmt);
}

static di_status cpu_moe_experts(void *ctx, const kern_moe_experts *p)
{
    const cpu_ctx *c = ctx;
    uint32_t T = p->n_rows, D = p->dim;
    uint32_t inter_max = p->inter > p->shared_inter ? p->inter : p->shared_inter;
    uint32_t *count = calloc(p->n_experts + 1, sizeof(uint32_t));
    uint32_t *start = calloc(p->n_experts + 1, sizeof(uint32_t));
    int32_t *rows = malloc((size_t)(T ? T : 1) * p->top_k * sizeof(int32_t));
    double *acc = cpu_xmalloc((size_t)(T ? T : 1) * D * sizeof(double));
    expert_bufs b = {0};
    /* a bucket can hold more than T pairs when a row names an expert twice */
    size_t nmax = (size_t)(T ? T : 1) * p->top_k;
    b.x = cpu_xmalloc(nmax * D * 2);
    b.g = cpu_xmalloc(nmax * inter_max * 2);
    b.u = cpu_xmalloc(nmax * inter_max * 2);
    b.h = cpu_xmalloc(nmax * inter_max * 2);
    b.o = cpu_xmalloc(nmax * D * 2);
    b.w = malloc(nmax * sizeof(float));
    di_status st = (count && start && rows && acc && b.x && b.g && b.u && b.h && b.o && b.w)
                       ? DI_OK : DI_ENOMEM;
    if (st == DI_OK) {
        memset(acc, 0, (size_t)T * D * sizeof(double));
        /* bucket (row, slot) pairs by expert, rows ascending inside a bucket */
        for (size_t i = 0; i < (size_t)T * p->top_k; i++) {
            assert(p->ids[i] >= 0 && (uint32_t)p->ids[i] < p->n_experts);
            count[p->ids[i]]++;
        }
        for (uint32_t e = 1; e <= p->n_experts; e++)
            start[e] = start[e - 1] + count[e - 1];
        memset(count, 0, p->n_experts * sizeof(uint32_t));
        for (size_t i = 0; i < (size_t)T * p->top_k; i++) {
            int32_t e = p->ids[i];
            rows[start[e] + count[e]++] = (int32_t)i;
        }
    }
    for (uint32_t e = 0; st == DI_OK && e < p->n_experts; e++) {
        uint32_t n = count[e];
        if (n == 0)
            continue;
        for (uint32_t r = 0; r < n; r++) {
            int32_t pair = rows[start[e] + r];
            memcpy(b.x + (size_t)r * D, p->x + (size_t)(pair / p->top_k) * D, (size_t)D * 2);
            b.w[r] = p->weights[pair];
        }
        st = run_expert(c, p, &p->experts[e], KERN_W_FP4, n, p->inter, b.x, b.w, &b);
        for (uint32_t r = 0; st == DI_OK && r < n; r++) {
            double *a = acc + (size_t)(rows[start[e] + r] / p->top_k) * D;
            const uint16_t *o = b.o + (size_t)r * D;
            for (uint32_t d = 0; d < D; d++)
                a[d] += bf(o[d]);
        }
    }
    if (st == DI_OK && p->shared_inter && T) {
        st = run_expert(c, p, &p->shared, KERN_W_FP8, T, p->shared_inter, p->x, NULL, &b);
        for (size_t i = 0; st == DI_OK && i < (size_t)T * D; i++)
            acc[i] += bf(b.o[i]);
    }
    for (size_t i = 0; st == DI_OK && i < (size_t)T * D; i++)
        p->y[i] = to_bf((float)acc[i]);
    free(count);
    free(start);
    free(rows);
    free(acc);
    free(b.x);
    free(b.g);
    free(b.u);
    free(b.h);
    free(b.o);
    free(b.w);
    return st;
}

void cpu_ops_moe(kern_ops *ops)
{
    ops->moe_gate = cpu_moe_gate;
    ops->swiglu = cpu_swiglu;
    ops->moe_experts = cpu_moe_experts;
}
