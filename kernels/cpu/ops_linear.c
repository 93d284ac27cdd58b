/* CPU ops: linear layers (FP8 x FP8 32x32, FP8 x FP4 1x32, BF16 with groups) and the head.
 *
 * Each input row is dequantised once to fp32 (fake-quantised by procedure (A) for the FP8
 * and FP4 weights), each weight tile of 16 rows once per task to fp32; an output element is
 * then one dot product accumulated in double (cpu_dot) and rounded once to fp32 (then to bf16
 * for bf16 outputs), whatever the number of rows in the call.
 */
#include <stdlib.h>

#include "kernels/cpu/cpu_internal.h"

#define LIN_TILE 16
/* Below this many multiply-adds a call runs on the calling thread: waking the pool costs more
 * than the work (decode steps are made of such calls). */
#define LIN_PARALLEL_MACS ((uint64_t)1 << 20)

typedef struct lin_job {
    const cpu_ctx *c;
    const kern_linear *p;
    kern_wfmt fmt;
    float *xf;                  /* [m, groups*k] fp32 inputs */
    size_t xw;                  /* groups*k */
    uint32_t tiles;             /* tiles per group */
    float **wbuf;               /* per worker [LIN_TILE, k] */
} lin_job;

static void lin_inputs(void *arg, uint32_t r0, uint32_t r1, uint32_t worker)
{
    lin_job *j = arg;
    for (uint32_t r = r0; r < r1; r++) {
        const uint16_t *x = j->p->x + (size_t)r * j->p->x_stride;
        float *o = j->xf + (size_t)r * j->xw;
        if (j->fmt == KERN_W_BF16)
            cpu_bf16_to_f32(x, o, j->xw);
        else
            cpu_act_quant_fp8(j->c, x, o, j->xw);
    }
}

static void lin_store(const kern_linear *p, uint32_t m, size_t col, double sum)
{
    float v = (float)sum;
    if (p->out_f32) {
        float *y = (float *)p->y + (size_t)m * p->y_stride + col;
        *y = p->accumulate ? *y + v : v;
    } else {
        ((uint16_t *)p->y)[(size_t)m * p->y_stride + col] = to_bf(v);
    }
}

static void lin_tile(void *arg, uint32_t task, uint32_t worker)
{
    lin_job *j = arg;
    const kern_linear *p = j->p;
    uint32_t g = task / j->tiles, n0 = (task % j->tiles) * LIN_TILE;
    uint32_t nt = p->n - n0 < LIN_TILE ? p->n - n0 : LIN_TILE;
    float *w = j->wbuf[worker];
    cpu_dequant_rows(j->c, j->fmt, p->w, p->w_scale, p->k, g * p->n + n0, nt, w);
    for (uint32_t m = 0; m < p->m; m++) {
        const float *x = j->xf + (size_t)m * j->xw + (size_t)g * p->k;
        size_t col = (size_t)g * p->n + n0;
        uint32_t i = 0;
        for (; i + 4 <= nt; i += 4) {
            double r[4];
            cpu_dot4(x, w + (size_t)i * p->k, w + (size_t)(i + 1) * p->k,
                     w + (size_t)(i + 2) * p->k, w + (size_t)(i + 3) * p->k, p->k, r);
            for (int q = 0; q < 4; q++)
                lin_store(p, m, col + i + q, r[q]);
        }
        for (; i < nt; i++)
            lin_store(p, m, col + i, cpu_dot(x, w + (size_t)i * p->k, p->k));
    }
}

di_status cpu_linear_run(const cpu_ctx *c, const kern_linear *p, kern_wfmt fmt)
{
    uint32_t groups = p->groups ? p->groups : 1;
    assert(p->k % 32 == 0);
    assert(fmt == KERN_W_BF16 || groups == 1);
    assert(!p->accumulate || p->out_f32);
    if (p->m == 0 || p->n == 0)
        return DI_OK;
    lin_job j = {.c = c, .p = p, .fmt = fmt, .xw = (size_t)groups * p->k};
    j.tiles = (p->n + LIN_TILE - 1) / LIN_TILE;
    uint32_t workers = kpool_workers(c->pool);
    j.xf = cpu_xmalloc((size_t)p->m * j.xw * sizeof(float));
    j.wbuf = calloc(workers, sizeof(float *));
    di_status st = (j.xf && j.wbuf) ? DI_OK : DI_ENOMEM;
    for (uint32_t i = 0; st == DI_OK && i < workers; i++)
        if (!(j.wbuf[i] = cpu_xmalloc((size_t)LIN_TILE * p->k * sizeof(float))))
            st = DI_ENOMEM;
    if (st == DI_OK) {
        uint64_t macs = (uint64_t)p->m * p->n * p->k * groups;
        if (macs < LIN_PARALLEL_MACS) {
            lin_inputs(&j, 0, p->m, 0);
            for (uint32_t t = 0; t < groups * j.tiles; t++)
                lin_tile(&j, t, 0);
        } else {
            cpu_for(c, p->m, 8, lin_inputs, &j);
            kpool_run(c->pool, groups * j.tiles, lin_tile, &j);
        }
    }
    for (uint32_t i = 0; j.wbuf && i < workers; i++)
        free(j.wbuf[i]);
    free(j.wbuf);
    free(j.xf);
    return st;
}

static di_status cpu_linear_fp8(void *ctx, const kern_linear *p)
{
    return cpu_linear_run(ctx, p, KERN_W_FP8);
}

static di_status cpu_linear_fp4(void *ctx, const kern_linear *p)
{
    return cpu_linear_run(ctx, p, KERN_W_FP4);
}

static di_status cpu_linear_bf16(void *ctx, const kern_linear *p)
{
    return cpu_linear_run(ctx, p, KERN_W_BF16);
}

static di_status cpu_head(void *ctx, const kern_linear *p)
{
    assert(p->out_f32);
    return cpu_linear_run(ctx, p, KERN_W_BF16);
}

void cpu_ops_linear(kern_ops *ops)
{
    ops->linear_fp8 = cpu_linear_fp8;
    ops->linear_fp4 = cpu_linear_fp4;
    ops->linear_bf16 = cpu_linear_bf16;
    ops->head = cpu_head;
}
