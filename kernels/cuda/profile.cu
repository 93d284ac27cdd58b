/* profile.cu: per-op device time of the CUDA backend (kern_cuda_profile). While on, each op's
 * start (cuda_op_begin) records an event on the stream; the time from one op's start to the
 * next op's start is charged to the first (its kernels, and the host work and waits inside it
 * that leave the stream idle). A full event ring is drained at the next op start: one stream
 * synchronisation per CUDA_PROF_EVENTS ops, so a profiled step runs a little slower than an
 * unprofiled one. */
#include <cuda_runtime.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/cuda/backend_cuda.h"
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/cuda_internal.h"

/* Adds the time between events i and i + 1 to event i's op. */
static di_status charge(cuda_ctx *c, uint32_t i)
{
    cuda_prof *p = c->prof;
    float ms = 0.0f;
    di_status st = cuda_check(c, cudaEventElapsedTime(&ms, p->ev[i], p->ev[i + 1]),
                              "profile: cudaEventElapsedTime");
    if (st != DI_OK)
        return st;
    uint32_t k = 0;
    while (k < p->n_ops && p->ops[k].op != p->name[i])
        k++;
    if (k == p->n_ops) {
        if (k == CUDA_PROF_OPS)
            return DI_OK; /* more distinct names than the table holds: not charged */
        p->ops[k].op = p->name[i], p->ops[k].ms = 0, p->ops[k].calls = 0;
        p->n_ops++;
    }
    p->ops[k].ms += ms;
    p->ops[k].calls++;
    return DI_OK;
}

/* Waits for the recorded events and charges every closed interval; the last event stays as
 * the first of the ring. */
static di_status drain(cuda_ctx *c)
{
    cuda_prof *p = c->prof;
    if (p->n_ev == 0)
        return DI_OK;
    di_status st = cuda_check(c, cudaEventSynchronize(p->ev[p->n_ev - 1]),
                              "profile: cudaEventSynchronize");
    for (uint32_t i = 0; st == DI_OK && i + 1 < p->n_ev; i++)
        st = charge(c, i);
    cudaEvent_t last = p->ev[p->n_ev - 1];
    p->ev[p->n_ev - 1] = p->ev[0], p->ev[0] = last;
    p->name[0] = p->name[p->n_ev - 1];
    p->n_ev = 1;
    return st;
}

di_status cuda_prof_mark(cuda_ctx *c, const char *op)
{
    cuda_prof *p = c->prof;
    di_status st = p->n_ev == CUDA_PROF_EVENTS ? drain(c) : DI_OK;
    if (st != DI_OK)
        return st;
    st = cuda_check(c, cudaEventRecord(p->ev[p->n_ev], c->stream), "profile: cudaEventRecord");
    if (st == DI_OK)
        p->name[p->n_ev++] = op;
    return st;
}

void cuda_prof_free(cuda_ctx *c)
{
    if (!c->prof)
        return;
    for (uint32_t i = 0; i < CUDA_PROF_EVENTS; i++)
        if (c->prof->ev[i])
            cudaEventDestroy(c->prof->ev[i]);
    free(c->prof);
    c->prof = NULL;
}

di_status kern_cuda_profile(kern_backend *be, int on, di_error *err)
{
    if (!be || !be->ctx || strcmp(be->name, "cuda") != 0)
        return di_fail(err, DI_EINVAL, "kern_cuda_profile: not a CUDA backend");
    cuda_ctx *c = (cuda_ctx *)be->ctx;
    cuda_prof_free(c);
    if (!on)
        return DI_OK;
    if (cuda_graph_break(c) != DI_OK) { /* profiled ops run eagerly */
        if (err)
            *err = c->last;
        return DI_EINTERNAL;
    }
    c->prof = (cuda_prof *)calloc(1, sizeof(cuda_prof));
    if (!c->prof)
        return di_fail(err, DI_ENOMEM, "kern_cuda_profile: state");
    di_status st = cuda_check(c, cudaSetDevice(c->device), "cudaSetDevice");
    for (uint32_t i = 0; st == DI_OK && i < CUDA_PROF_EVENTS; i++)
        st = cuda_check(c, cudaEventCreate(&c->prof->ev[i]), "profile: cudaEventCreate");
    if (st != DI_OK) {
        cuda_prof_free(c);
        return di_fail(err, st, "%s", c->last.msg);
    }
    return DI_OK;
}

static int by_time(const void *a, const void *b)
{
    double x = ((const kern_cuda_op_time *)a)->ms, y = ((const kern_cuda_op_time *)b)->ms;
    return x < y ? 1 : (x > y ? -1 : 0);
}

di_status kern_cuda_profile_read(kern_backend *be, kern_cuda_op_time *out, size_t cap,
                                 size_t *n_out, di_error *err)
{
    *n_out = 0;
    if (!be || !be->ctx || strcmp(be->name, "cuda") != 0 || !((cuda_ctx *)be->ctx)->prof)
        return di_fail(err, DI_EINVAL, "kern_cuda_profile_read: profiling is off");
    cuda_ctx *c = (cuda_ctx *)be->ctx;
    /* close the last op's interval at the end of the queue */
    di_status st = cuda_prof_mark(c, NULL);
    if (st == DI_OK)
        st = drain(c);
    if (st != DI_OK)
        return di_fail(err, st, "%s", c->last.msg);
    cuda_prof *p = c->prof;
    for (uint32_t k = 0; k < p->n_ops; k++)
        if (p->ops[k].op && *n_out < cap)
            out[(*n_out)++] = p->ops[k];
    qsort(out, *n_out, sizeof(*out), by_time);
    p->n_ops = 0;
    p->n_ev = 0;
    return DI_OK;
}
