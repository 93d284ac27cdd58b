/* CPU ops: linear layers (FP8 x FP8 32x32, FP8 x FP4 1x32, BF16 with groups) and the head.
 *
 * Each input row is dequantised once (fake-quantised by procedure (A) for the FP8 and FP4
 * weights) and widened to double; each weight tile of 16 rows once per task. An output element
 * is then one dot product accumulated in double, 8 lanes in a fixed order, and rounded once to
 * fp32 (then to bf16 for bf16 outputs), whatever the number of rows in the call. The products
 * of two fp32 values are exact in double, so a fused multiply-add gives the same sums as a
 * multiply then an add: the kernels may contract.
 */
#include <stdlib.h>

#include "kernels/cpu/cpu_internal.h"
#include "kernels/cpu/simd.h"

#define LIN_TILE 16
/* Below this many multiply-adds a call runs on the calling thread: waking the pool costs more
 * than the work (decode steps are made of such calls). */
#define LIN_PARALLEL_MACS ((uint64_t)1 << 20)

typedef struct lin_job {
    const cpu_ctx *c;
    const kern_linear *p;
    kern_wfmt fmt;
    double *xd;                 /* [m, groups*k] inputs, widened */
    size_t xw;                  /* groups*k */
    uint32_t tiles;             /* tiles per group */
    float **wbuf;               /* per worker [LIN_TILE, k] fp32 tile */
    double **wdbuf;             /* per worker [LIN_TILE, k] the same widened */
} lin_job;

static void lin_inputs(void *arg, uint32_t r0, uint32_t r1, uint32_t worker)
{
    lin_job *j = arg;
    float *f = cpu_xmalloc(j->xw * sizeof(float));
    assert(f);
    for (uint32_t r = r0; r < r1; r++) {
        const uint16_t *x = j->p->x + (size_t)r * j->p->x_stride;
        if (j->fmt == KERN_W_BF16)
            cpu_bf16_to_f32(x, f, j->xw);
        else
            cpu_act_quant_fp8(j->c, x, f, j->xw);
        cpu_widen(f, j->xd + (size_t)r * j->xw, j->xw);
    }
    free(f);
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
    float *wf = j->wbuf[worker];
    double *w = j->wdbuf[worker];
    size_t k = p->k;
    cpu_dequant_rows(j->c, j->fmt, p->w, p->w_scale, p->k, g * p->n + n0, nt, wf);
    cpu_widen(wf, w, (size_t)nt * k);
    size_t col = (size_t)g * p->n + n0;
    for (uint32_t m = 0; m < p->m; m += 2) {
        const double *x0 = j->xd + (size_t)m * j->xw + (size_t)g * k;
        const double *x1 = m + 1 < p->m ? x0 + j->xw : NULL;
        uint32_t i = 0;
        for (; i + 4 <= nt; i += 4) {
            double r[2][4];
            cpu_dotd_2x4(x0, x1, w + (size_t)i * k, k, r);
            for (int q = 0; q < 4; q++) {
                lin_store(p, m, col + i + q, r[0][q]);
                if (x1)
                    lin_store(p, m + 1, col + i + q, r[1][q]);
            }
        }
        for (; i < nt; i++) {
            lin_store(p, m, col + i, cpu_dotd(x0, w + (size_t)i * k, k));
            if (x1)
                lin_store(p, m + 1, col + i, cpu_dotd(x1, w + (size_t)i * k, k));
        }
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
    j.xd = cpu_xmalloc((size_t)p->m * j.xw * sizeof(double));
    j.wbuf = calloc(workers, sizeof(float *));
    j.wdbuf = calloc(workers, sizeof(double *));
    di_status st = (j.xd && j.wbuf && j.wdbuf) ? DI_OK : DI_ENOMEM;
    for (uint32_t i = 0; st == DI_OK && i < workers; i++)
        if (!(j.wbuf[i] = cpu_xmalloc((size_t)LIN_TILE * p->k * sizeof(float))) ||
            !(j.wdbuf[i] = cpu_xmalloc((size_t)LIN_TILE * p->k * sizeof(double))))
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
    for (uint32_t i = 0; j.wdbuf && i < workers; i++)
        free(j.wdbuf[i]);
    free(j.wbuf);
    free(j.wdbuf);
    free(j.xd);
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
