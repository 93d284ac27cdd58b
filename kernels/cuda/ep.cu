/* ep.cu: the device side of the expert-parallel exchange (kernels/kern_ep.h): the combine of
 * the expert outputs that came back from the ranks, and pinned host memory. C twin:
 * kernels/cpu/ep.c. One thread per output element sums the row's outputs in double in the
 * order of pos, then the shared expert, and rounds once (double -> fp32 -> bf16), as the twin:
 * moe_experts' own combine kernel (moe.cu, cuda_moe_combine), bit-identical. */
#include <cuda_runtime.h>
#include <string.h>

#include "kernels/kern_ep.h"
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/cuda_internal.h"
#include "kernels/cuda/numfmt_dev.cuh"

static di_status ep_combine(void *ctx, const kern_ep_combine *p)
{
    cuda_ctx *c = (cuda_ctx *)ctx;
    di_status st = cuda_op_begin(c, p, "ep_combine");
    if (st != DI_OK)
        return st;
    if (p->n_rows == 0 || p->dim == 0)
        return DI_OK;
    if (!p->y || (p->top_k && (!p->outs || !p->pos)))
        return cuda_fail(c, DI_EINVAL, "ep_combine: outs, pos or y is NULL");
    size_t TK = (size_t)p->n_rows * p->top_k;
    for (size_t i = 0; i < TK; i++)
        if (p->pos[i] < 0 || (uint32_t)p->pos[i] >= p->n_outs)
            return cuda_fail(c, DI_EINVAL, "ep_combine: pos[%zu] = %d outside [0, %u)", i,
                             p->pos[i], p->n_outs);
    if ((st = cuda_graph_op_enter(c, "ep_combine", p->n_rows)) != DI_OK)
        return st;
    cuda_meta_reset(c);
    size_t off = 0;
    uint8_t *dev = NULL;
    st = cuda_meta_push(c, p->pos, TK ? TK * sizeof(int32_t) : 4, &off);
    if (st == DI_OK)
        st = cuda_meta_upload(c, 0, 0, &dev, NULL);
    if (st == DI_OK) {
        st = cuda_moe_combine(c, p->outs, (const int32_t *)(dev + off), p->top_k, p->shared,
                              p->dim, p->n_rows, p->y, c->stream);
    }
    cuda_graph_op_leave(c, st);
    return st;
}

static void *ep_host_alloc(void *ctx, size_t bytes)
{
    cuda_ctx *c = (cuda_ctx *)ctx;
    void *p = NULL;
    if (cudaSetDevice(c->device) != cudaSuccess ||
        cudaHostAlloc(&p, bytes ? bytes : 1, cudaHostAllocDefault) != cudaSuccess) {
        cudaGetLastError();
        return NULL;
    }
    return p;
}

static void ep_host_free(void *ctx, void *p)
{
    (void)ctx;
    if (p)
        cudaFreeHost(p);
}

static const char *ep_last_error(void *ctx)
{
    return ((const cuda_ctx *)ctx)->last.msg;
}

di_status kern_ep_ops_cuda(const kern_backend *be, kern_ep_ops *out, di_error *err)
{
    if (!be || !be->ctx || !be->name || strcmp(be->name, "cuda") != 0 || !out)
        return di_fail(err, DI_EINVAL, "expert-parallel ops: not a CUDA backend");
    memset(out, 0, sizeof(*out));
    out->ctx = be->ctx;
    out->combine = ep_combine;
    out->host_alloc = ep_host_alloc;
    out->host_free = ep_host_free;
    out->last_error = ep_last_error;
    return DI_OK;
}
