/* ep.c: the C twin of the expert-parallel combine and the host ops (kernels/kern_ep.h). */
#include "kernels/kern_ep.h"

#include <stdlib.h>

#include "kernels/cpu/numfmt.h"

di_status kern_ep_combine_ref(const kern_ep_combine *p)
{
    size_t TK = (size_t)p->n_rows * p->top_k, D = p->dim;
    for (size_t i = 0; i < TK; i++)
        if (p->pos[i] < 0 || (uint32_t)p->pos[i] >= p->n_outs)
            return DI_EINVAL;
    for (size_t t = 0; t < p->n_rows; t++) {
        const int32_t *pos = p->pos + t * p->top_k;
        for (size_t d = 0; d < D; d++) {
            double acc = 0.0;
            for (uint32_t k = 0; k < p->top_k; k++)
                acc += (double)di_bf16_to_f32(p->outs[(size_t)pos[k] * D + d]);
            if (p->shared)
                acc += (double)di_bf16_to_f32(p->shared[t * D + d]);
            p->y[t * D + d] = di_f32_to_bf16((float)acc);
        }
    }
    return DI_OK;
}

static di_status host_combine(void *ctx, const kern_ep_combine *p)
{
    (void)ctx;
    return kern_ep_combine_ref(p);
}

static void *host_alloc(void *ctx, size_t bytes)
{
    (void)ctx;
    return aligned_alloc(64, (bytes + 63) / 64 * 64);
}

static void host_free(void *ctx, void *p)
{
    (void)ctx;
    free(p);
}

void kern_ep_ops_host(kern_ep_ops *out)
{
    *out = (kern_ep_ops){.ctx = NULL, .combine = host_combine, .host_alloc = host_alloc,
                         .host_free = host_free};
}
