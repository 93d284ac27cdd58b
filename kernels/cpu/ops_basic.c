/* CPU ops: embedding, RMSNorm, RoPE, hyper-connection mixes/collapse/expand, fake
 * quantisation, row copies. */
#include <stdlib.h>

#include "kernels/cpu/cpu_internal.h"
#include "kernels/cpu/simd.h"
#include "kernels/cpu/step_ahead.h"

/* ---- embed ---- */

static di_status cpu_embed(void *ctx, const kern_embed *p)
{
    const int32_t *ids = p->ids_dev ? p->ids_dev : p->ids;
    for (uint32_t t = 0; t < p->n_rows; t++) /* ids_dev were not checked by the caller */
        if (ids[t] < 0 || (uint32_t)ids[t] >= p->vocab) {
            assert(p->ids_dev);
            return DI_EINVAL;
        }
    for (uint32_t t = 0; t < p->n_rows; t++) {
        const uint16_t *src = p->table + (size_t)ids[t] * p->dim;
        for (uint32_t c = 0; c < p->n_copies; c++)
            memcpy(p->out + ((size_t)t * p->n_copies + c) * p->dim, src, p->dim * 2);
    }
    return DI_OK;
}

/* ---- rmsnorm ---- */

typedef struct rms_job {
    const cpu_ctx *c;
    const kern_rmsnorm *p;
} rms_job;

static void rms_rows(void *arg, uint32_t r0, uint32_t r1, uint32_t worker)
{
    const kern_rmsnorm *p = ((rms_job *)arg)->p;
    float *x = cpu_xmalloc((size_t)p->dim * sizeof(float));
    assert(x);
    for (uint32_t r = r0; r < r1; r++) {
        cpu_bf16_to_f32(p->x + (size_t)r * p->x_stride, x, p->dim);
        float inv = cpu_rms_scale(cpu_sumsq(x, p->dim), p->dim, p->eps);
        uint16_t *y = p->y + (size_t)r * p->y_stride;
        for (uint32_t i = 0; i < p->dim; i++) {
            float w = p->weight ? bf(p->weight[i]) : 1.0f;
            y[i] = to_bf(w * (x[i] * inv));
        }
    }
    free(x);
}

static di_status cpu_rmsnorm(void *ctx, const kern_rmsnorm *p)
{
    rms_job j = {ctx, p};
    cpu_for(ctx, p->n_rows, 64, rms_rows, &j);
    return DI_OK;
}

/* ---- rope ---- */

/* The rope_dim/2 frequencies of MODEL.md §2.4: f_i = fp32(base^(-2i/d)); with YaRN,
 * fp32(f_i * (1 - ramp) + fp32(f_i / factor) * ramp), the blend in double. */
static void rope_freqs(const kern_rope *p, float *f)
{
    uint32_t half = p->rope_dim / 2;
    double d = (double)p->rope_dim, b = (double)p->base;
    double lo = 0, hi = 0;
    if (p->yarn) {
        const double two_pi = 6.283185307179586;
        double cf = d * log(p->yarn_orig_len / (two_pi * p->yarn_beta_fast)) / (2.0 * log(b));
        double cs = d * log(p->yarn_orig_len / (two_pi * p->yarn_beta_slow)) / (2.0 * log(b));
        lo = floor(cf) > 0 ? floor(cf) : 0;
        hi = ceil(cs) < d - 1 ? ceil(cs) : d - 1;
    }
    for (uint32_t i = 0; i < half; i++) {
        float f32 = (float)pow(b, -2.0 * i / d);
        double fi = f32;
        if (p->yarn) {
            double span = hi - lo > 0.001 ? hi - lo : 0.001;
            double ramp = ((double)i - lo) / span;
            ramp = ramp < 0 ? 0 : (ramp > 1 ? 1 : ramp);
            double scaled = (float)(fi / p->yarn_factor);
            fi = fi * (1.0 - ramp) + scaled * ramp;
        }
        f[i] = (float)fi;
    }
}

typedef struct rope_job {
    const kern_rope *p;
    const float *f;
} rope_job;

static void rope_rows(void *arg, uint32_t r0, uint32_t r1, uint32_t worker)
{
    rope_job *j = arg;
    const kern_rope *p = j->p;
    uint32_t half = p->rope_dim / 2;
    float cs[256], sn[256];
    for (uint32_t r = r0; r < r1; r++) {
        float pos = (float)p->positions[r];
        for (uint32_t i = 0; i < half; i++) {
            float ang = pos * j->f[i];
            cs[i] = (float)cos((double)ang);
            sn[i] = (float)sin((double)ang);
            if (p->inverse)
                sn[i] = -sn[i];
        }
        for (uint32_t h = 0; h < p->n_heads; h++) {
            uint16_t *x = p->x + (size_t)r * p->row_stride + (size_t)h * p->head_stride + p->offset;
            for (uint32_t i = 0; i < half; i++) {
                float x0 = bf(x[2 * i]), x1 = bf(x[2 * i + 1]);
                x[2 * i] = to_bf(x0 * cs[i] - x1 * sn[i]);
                x[2 * i + 1] = to_bf(x0 * sn[i] + x1 * cs[i]);
            }
        }
    }
}

static di_status cpu_rope(void *ctx, const kern_rope *p)
{
    assert(p->rope_dim % 2 == 0 && p->rope_dim <= 512);
    float f[256];
    rope_freqs(p, f);
    rope_job j = {p, f};
    cpu_for(ctx, p->n_rows, 64, rope_rows, &j);
    return DI_OK;
}

/* ---- hyper-connections ---- */

#define HC_MAX 8

/* Sinkhorn normalisation of an hc x hc matrix in place (MODEL.md §2.3 step 7), in double:
 * row softmax + eps, a column step, then (iters - 1) x (row step, column step). */
static void sinkhorn(double *s, uint32_t hc, uint32_t iters, double eps)
{
    for (uint32_t i = 0; i < hc; i++) {
        double *row = s + i * hc, mx = row[0], sum = 0.0;
        for (uint32_t j = 1; j < hc; j++)
            mx = row[j] > mx ? row[j] : mx;
        for (uint32_t j = 0; j < hc; j++) {
            row[j] = exp(row[j] - mx);
            sum += row[j];
        }
        for (uint32_t j = 0; j < hc; j++)
            row[j] = row[j] / sum + eps;
    }
    for (uint32_t it = 0; it < iters; it++) {
        if (it > 0) {
            for (uint32_t i = 0; i < hc; i++) {
                double sum = 0.0;
                for (uint32_t j = 0; j < hc; j++)
                    sum += s[i * hc + j];
                for (uint32_t j = 0; j < hc; j++)
                    s[i * hc + j] /= sum + eps;
            }
        }
        for (uint32_t j = 0; j < hc; j++) {
            double sum = 0.0;
            for (uint32_t i = 0; i < hc; i++)
                sum += s[i * hc + j];
            for (uint32_t i = 0; i < hc; i++)
                s[i * hc + j] /= sum + eps;
        }
    }
}

typedef struct mixes_job {
    const kern_hc_mixes *p;
} mixes_job;

static void mixes_rows(void *arg, uint32_t r0, uint32_t r1, uint32_t worker)
{
    const kern_hc_mixes *p = ((mixes_job *)arg)->p;
    uint32_t hc = p->n_copies, width = hc * p->dim, n_mix = (2 + hc) * hc;
    float *v = cpu_xmalloc((size_t)width * sizeof(float));
    assert(v);
    float m[(2 + HC_MAX) * HC_MAX];
    for (uint32_t t = r0; t < r1; t++) {
        cpu_bf16_to_f32(p->h + (size_t)t * width, v, width);
        float rs = cpu_rms_scale(cpu_sumsq(v, width), width, p->norm_eps);
        for (uint32_t i = 0; i < n_mix; i++)
            m[i] = (float)cpu_dot(p->fn + (size_t)i * width, v, width) * rs;
        for (uint32_t c = 0; c < hc; c++) {
            float zp = m[c] * p->scale[0] + p->base[c];
            float zq = m[hc + c] * p->scale[1] + p->base[hc + c];
            p->pre[t * hc + c] = (float)sigmoid_d(zp) + (float)p->eps;
            p->post[t * hc + c] = (float)(2.0 * sigmoid_d(zq));
        }
        double z[HC_MAX * HC_MAX];
        for (uint32_t i = 0; i < hc * hc; i++)
            z[i] = m[2 * hc + i] * p->scale[2] + p->base[2 * hc + i]; /* fp32, then exact */
        sinkhorn(z, hc, p->sinkhorn_iters, p->eps);
        float *comb = p->comb + (size_t)t * hc * hc;
        for (uint32_t i = 0; i < hc * hc; i++)
            comb[i] = (float)z[i];
    }
    free(v);
}

static di_status cpu_hc_mixes(void *ctx, const kern_hc_mixes *p)
{
    assert(p->n_copies >= 1 && p->n_copies <= HC_MAX && p->sinkhorn_iters >= 1);
    mixes_job j = {p};
    cpu_for(ctx, p->n_rows, 4, mixes_rows, &j);
    return DI_OK;
}

typedef struct collapse_job {
    const kern_hc_collapse *p;
} collapse_job;

static void collapse_rows(void *arg, uint32_t r0, uint32_t r1, uint32_t worker)
{
    const kern_hc_collapse *p = ((collapse_job *)arg)->p;
    for (uint32_t t = r0; t < r1; t++) {
        const float *pre = p->pre + (size_t)t * p->pre_stride;
        const uint16_t *h = p->h + (size_t)t * p->n_copies * p->dim;
        uint16_t *o = p->out + (size_t)t * p->out_stride;
        for (uint32_t d = 0; d < p->dim; d++) {
            double acc = (double)pre[0] * bf(h[d]);
            for (uint32_t c = 1; c < p->n_copies; c++)
                acc += (double)pre[c] * bf(h[(size_t)c * p->dim + d]);
            o[d] = to_bf((float)acc);
        }
    }
}

static di_status cpu_hc_collapse(void *ctx, const kern_hc_collapse *p)
{
    collapse_job j = {p};
    cpu_for(ctx, p->n_rows, 64, collapse_rows, &j);
    return DI_OK;
}

typedef struct expand_job {
    const kern_hc_expand *p;
} expand_job;

static void expand_rows(void *arg, uint32_t r0, uint32_t r1, uint32_t worker)
{
    const kern_hc_expand *p = ((expand_job *)arg)->p;
    uint32_t hc = p->n_copies, D = p->dim;
    for (uint32_t t = r0; t < r1; t++) {
        const uint16_t *h = p->h + (size_t)t * hc * D, *y = p->y + (size_t)t * D;
        const float *post = p->post + (size_t)t * hc, *comb = p->comb + (size_t)t * hc * hc;
        uint16_t *o = p->out + (size_t)t * hc * D;
        for (uint32_t j = 0; j < hc; j++) {
            for (uint32_t d = 0; d < D; d++) {
                double s = (double)comb[j] * bf(h[d]);
                for (uint32_t i = 1; i < hc; i++)
                    s += (double)comb[i * hc + j] * bf(h[(size_t)i * D + d]);
                o[(size_t)j * D + d] = to_bf((float)((double)post[j] * bf(y[d]) + s));
            }
        }
    }
}

static di_status cpu_hc_expand(void *ctx, const kern_hc_expand *p)
{
    assert(p->out != p->h);
    expand_job j = {p};
    cpu_for(ctx, p->n_rows, 32, expand_rows, &j);
    return DI_OK;
}

/* ---- fake quantisation ---- */

typedef struct fq_job {
    const cpu_ctx *c;
    const kern_fakequant *p;
} fq_job;

static void fq_rows(void *arg, uint32_t r0, uint32_t r1, uint32_t worker)
{
    fq_job *j = arg;
    const kern_fakequant *p = j->p;
    float *x = cpu_xmalloc((size_t)p->n * sizeof(float));
    assert(x);
    for (uint32_t r = r0; r < r1; r++) {
        uint16_t *row = p->x + (size_t)r * p->stride;
        if (p->fmt == KERN_Q_FP8_B32) {
            cpu_act_quant_fp8(j->c, row, x, p->n);
        } else {
            cpu_bf16_to_f32(row, x, p->n);
            if (p->fmt == KERN_Q_FP4_B32)
                di_fakequant_fp4_b32(x, p->n);
            else
                di_fakequant_fp4_b16(x, p->n);
        }
        for (uint32_t i = 0; i < p->n; i++)
            row[i] = to_bf(x[i]);
    }
    free(x);
}

static di_status cpu_fakequant(void *ctx, const kern_fakequant *p)
{
    assert(p->n % (p->fmt == KERN_Q_FP4_B16 ? 16 : 32) == 0);
    fq_job j = {ctx, p};
    cpu_for(ctx, p->n_rows, 64, fq_rows, &j);
    return DI_OK;
}

/* ---- row copies ---- */

static di_status cpu_copy_rows(void *ctx, const kern_copy_rows *p)
{
    for (uint32_t i = 0; i < p->n_rows; i++) {
        size_t src = p->rows ? (size_t)p->rows[i] : i;
        assert(p->dst != p->src || src >= i);
        memmove((uint8_t *)p->dst + i * p->dst_stride,
                (const uint8_t *)p->src + src * p->src_stride, p->row_bytes);
    }
    return DI_OK;
}

static di_status cpu_step_ahead(void *ctx, const kern_step_ahead *p)
{
    (void)ctx;
    return kern_step_ahead_run(p, NULL);
}

void cpu_ops_basic(kern_ops *ops)
{
    ops->embed = cpu_embed;
    ops->rmsnorm = cpu_rmsnorm;
    ops->rope = cpu_rope;
    ops->hc_mixes = cpu_hc_mixes;
    ops->hc_collapse = cpu_hc_collapse;
    ops->hc_expand = cpu_hc_expand;
    ops->fakequant = cpu_fakequant;
    ops->copy_rows = cpu_copy_rows;
    ops->step_ahead = cpu_step_ahead;
}
