/* step_ahead.cu: the one-step-ahead fix-up on the device (C twin and contract:
 * kernels/cpu/step_ahead.h). One thread per (sequence, row of it); an accepted count out of
 * range writes nothing for that sequence and raises the backend's error flag (reported at the
 * next synchronisation, as the host twin's DI_EINVAL). */
#include <cuda_runtime.h>
#include <stdint.h>

#include "kernels/cpu/step_ahead.h"
#include "kernels/cuda/backend_cuda.h"
#include "kernels/cuda/cuda_internal.h"

__global__ void step_ahead_kernel(kern_step_ahead p, int *error)
{
    const uint32_t per = p.nextn + 1;
    const size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (size_t)p.n_seqs * per)
        return;
    const uint32_t s = (uint32_t)(i / per), j = (uint32_t)(i % per);
    const int32_t a = p.accepted[s];
    if (a < 0 || (uint32_t)a > p.out_stride || p.row0[s] + p.nextn >= p.n_rows) {
        if (error)
            atomicOr(error, CUDA_ERR_STEP_AHEAD);
        return;
    }
    const int64_t len = p.base_len[s] + a;
    if (j == 0)
        p.seqlen_k[s] = a ? len + p.nextn : p.base_len[s];
    const uint32_t r = p.row0[s] + j;
    if (!a) {
        p.ids[r] = 0, p.positions[r] = p.base_len[s], p.live[r] = 0;
        return;
    }
    p.ids[r] = j == 0 ? p.tokens[(size_t)s * p.out_stride + (uint32_t)a - 1]
                      : p.drafts[(size_t)s * p.nextn + j - 1];
    p.positions[r] = len - 1 + j;
    p.live[r] = 1;
}

extern "C" di_status kern_cuda_step_ahead(kern_backend *be, const kern_step_ahead *p,
                                          di_error *err)
{
    if (!be || !be->ctx || !p || p->out_stride == 0)
        return di_fail(err, DI_EINVAL, "step ahead: backend or params NULL, or out_stride 0");
    cuda_ctx *c = (cuda_ctx *)be->ctx;
    const size_t threads = (size_t)p->n_seqs * (p->nextn + 1);
    if (threads == 0)
        return DI_OK;
    if (threads / CUDA_THREADS >= 0x7fffffffu)
        return di_fail(err, DI_EINVAL, "step ahead: %u sequences of %u rows", p->n_seqs,
                       p->nextn + 1);
    di_status st = cuda_graph_op_enter(c, "step_ahead", p->n_seqs);
    if (st == DI_OK)
        st = cuda_check(c, cudaSetDevice(c->device), "cudaSetDevice");
    if (st == DI_OK) {
        cuda_launch(c, "step_ahead_kernel", step_ahead_kernel,
                    (unsigned)((threads + CUDA_THREADS - 1) / CUDA_THREADS), CUDA_THREADS, 0,
                    c->stream, *p, c->err_flag_dev);
        st = cuda_launched(c, "step_ahead_kernel");
    }
    cuda_graph_op_leave(c, st);
    if (st != DI_OK && err)
        *err = c->last;
    return st;
}
