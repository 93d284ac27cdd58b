/* nccl_xport.c: NCCL communicator and all-to-all of an expert-parallel group (nccl_xport.h). */
#include "common/ep/nccl_xport.h"

#include <cuda_runtime_api.h>
#include <nccl.h>
#include <poll.h>
#include <stdlib.h>
#include <string.h>

#include "common/util/clock.h"

struct ep_nccl {
    ncclComm_t comm;
    uint32_t rank, world;
    uint32_t timeout_ms;
    int device;
    int aborted;                 /* the communicator was aborted: every later call fails */
};

static di_status cuda_fail(di_error *err, cudaError_t e, const char *what)
{
    return di_fail(err, DI_EIO, "%s: %s", what, cudaGetErrorString(e));
}

/* Polls the communicator until its pending operation is done or the deadline passes; aborts
 * it on a failure or at the deadline. */
static di_status wait_comm(ep_nccl *x, uint64_t deadline, const char *what, di_error *err)
{
    for (;;) {
        ncclResult_t r;
        ncclResult_t q = ncclCommGetAsyncError(x->comm, &r);
        if (q != ncclSuccess)
            r = q;
        if (r == ncclSuccess)
            return DI_OK;
        if (r != ncclInProgress) {
            ncclCommAbort(x->comm);
            x->aborted = 1;
            return di_fail(err, DI_EIO, "%s: %s", what, ncclGetErrorString(r));
        }
        if (di_mono_ns() >= deadline) {
            ncclCommAbort(x->comm);
            x->aborted = 1;
            return di_fail(err, DI_ETIMEDOUT, "%s: not done within %u ms (a rank is gone?)",
                           what, x->timeout_ms);
        }
        poll(NULL, 0, 1);
    }
}

/* Waits for the stream with the deadline, watching the communicator. */
static di_status wait_stream(ep_nccl *x, cudaStream_t s, uint64_t deadline, const char *what,
                             di_error *err)
{
    for (;;) {
        cudaError_t e = cudaStreamQuery(s);
        if (e == cudaSuccess)
            return DI_OK;
        if (e != cudaErrorNotReady)
            return cuda_fail(err, e, what);
        di_status st = wait_comm(x, deadline, what, err);
        if (st != DI_OK)
            return st;
        if (di_mono_ns() >= deadline) {
            ncclCommAbort(x->comm);
            x->aborted = 1;
            return di_fail(err, DI_ETIMEDOUT, "%s: the stream did not finish within %u ms",
                           what, x->timeout_ms);
        }
        poll(NULL, 0, 1);
    }
}

di_status ep_nccl_open(ep_group *g, int device, uint32_t timeout_ms, ep_nccl **out,
                       di_error *err)
{
    uint32_t rank = ep_group_rank(g), world = ep_group_world(g);
    if (timeout_ms == 0)
        return di_fail(err, DI_EINVAL, "NCCL exchange: timeout must be at least 1 ms");
    int n_dev = 0;
    cudaError_t ce = cudaGetDeviceCount(&n_dev);
    if (ce != cudaSuccess)
        return cuda_fail(err, ce, "NCCL exchange: no CUDA device");
    if (device < 0 || device >= n_dev)
        return di_fail(err, DI_EINVAL, "NCCL exchange: rank %u wants GPU %d, this machine has "
                       "%d (one GPU a rank: %u ranks need %u GPUs, or --device)", rank, device,
                       n_dev, world, world);
    ce = cudaSetDevice(device);
    if (ce != cudaSuccess)
        return cuda_fail(err, ce, "NCCL exchange: cudaSetDevice");
    /* rank 0 draws the id; the group carries it to the others (an all-to-all from rank 0) */
    ncclUniqueId id;
    memset(&id, 0, sizeof id);
    if (rank == 0) {
        ncclResult_t r = ncclGetUniqueId(&id);
        if (r != ncclSuccess)
            return di_fail(err, DI_EIO, "NCCL exchange: ncclGetUniqueId: %s",
                           ncclGetErrorString(r));
    }
    ep_buf *send = calloc(world, sizeof(ep_buf)), *recv = calloc(world, sizeof(ep_buf));
    ep_nccl *x = calloc(1, sizeof *x);
    if (!send || !recv || !x) {
        free(send);
        free(recv);
        free(x);
        return di_fail(err, DI_ENOMEM, "NCCL exchange");
    }
    for (uint32_t d = 0; rank == 0 && d < world; d++)
        send[d] = (ep_buf){&id, sizeof id};
    di_status st = ep_group_alltoallv(g, send, recv, err);
    if (st == DI_OK && recv[0].len != sizeof id)
        st = di_fail(err, DI_EPROTO, "NCCL exchange: rank 0 sent no communicator id");
    if (st == DI_OK)
        memcpy(&id, recv[0].data, sizeof id);
    free(send);
    free(recv);
    if (st != DI_OK) {
        free(x);
        return st;
    }
    x->rank = rank;
    x->world = world;
    x->timeout_ms = timeout_ms;
    x->device = device;
    ncclConfig_t cfg = NCCL_CONFIG_INITIALIZER;
    cfg.blocking = 0; /* every wait polls with a deadline */
    ncclResult_t r = ncclCommInitRankConfig(&x->comm, (int)world, id, (int)rank, &cfg);
    if (r != ncclSuccess && r != ncclInProgress) {
        free(x);
        return di_fail(err, DI_EIO, "NCCL exchange: ncclCommInitRankConfig: %s",
                       ncclGetErrorString(r));
    }
    uint64_t deadline = di_mono_ns() + (uint64_t)timeout_ms * 1000000ull;
    if ((st = wait_comm(x, deadline, "NCCL exchange: communicator of the group", err)) !=
        DI_OK) {
        free(x);
        return st;
    }
    *out = x;
    return DI_OK;
}

void ep_nccl_close(ep_nccl *x)
{
    if (!x)
        return;
    if (!x->aborted)
        ncclCommAbort(x->comm); /* also when an operation is still pending */
    free(x);
}

/* The grouped sends and receives of one all-to-all, then the wait. */
static di_status exchange(ep_nccl *x, const uint8_t *send, const uint64_t *send_off,
                          const uint64_t *send_len, uint8_t *recv, const uint64_t *recv_off,
                          const uint64_t *recv_len, cudaStream_t s, const char *what,
                          di_error *err)
{
    if (x->aborted)
        return di_fail(err, DI_ECANCELED, "%s: the communicator was aborted earlier", what);
    uint64_t deadline = di_mono_ns() + (uint64_t)x->timeout_ms * 1000000ull;
    ncclResult_t r = ncclGroupStart();
    for (uint32_t p = 0; r == ncclSuccess && p < x->world; p++) {
        if (send_len[p])
            r = ncclSend(send + send_off[p], send_len[p], ncclUint8, (int)p, x->comm, s);
        if (r == ncclSuccess && recv_len[p])
            r = ncclRecv(recv + recv_off[p], recv_len[p], ncclUint8, (int)p, x->comm, s);
    }
    ncclResult_t e = ncclGroupEnd();
    if (r == ncclSuccess)
        r = e;
    if (r != ncclSuccess && r != ncclInProgress) {
        ncclCommAbort(x->comm);
        x->aborted = 1;
        return di_fail(err, DI_EIO, "%s: %s", what, ncclGetErrorString(r));
    }
    di_status st = wait_comm(x, deadline, what, err);
    return st == DI_OK ? wait_stream(x, s, deadline, what, err) : st;
}

di_status ep_nccl_alltoallv(ep_nccl *x, const void *send, const uint64_t *send_off,
                            const uint64_t *send_len, void *recv, const uint64_t *recv_off,
                            const uint64_t *recv_len, void *stream, di_error *err)
{
    return exchange(x, send, send_off, send_len, recv, recv_off, recv_len,
                    (cudaStream_t)stream, "NCCL all-to-all", err);
}

di_status ep_nccl_counts(ep_nccl *x, const uint64_t *send_counts, uint64_t *recv_counts,
                         void *stream, di_error *err)
{
    uint64_t *off = malloc((size_t)x->world * 8), *len = malloc((size_t)x->world * 8);
    if (!off || !len) {
        free(off);
        free(len);
        return di_fail(err, DI_ENOMEM, "NCCL counts");
    }
    for (uint32_t p = 0; p < x->world; p++) {
        off[p] = (uint64_t)p * 8;
        len[p] = 8;
    }
    di_status st = exchange(x, (const uint8_t *)send_counts, off, len, (uint8_t *)recv_counts,
                            off, len, (cudaStream_t)stream, "NCCL counts", err);
    free(off);
    free(len);
    return st;
}

static di_status dev_a2a(void *ctx, const void *send, const uint64_t *send_off,
                         const uint64_t *send_len, void *recv, const uint64_t *recv_off,
                         const uint64_t *recv_len, di_error *err)
{
    return exchange(ctx, send, send_off, send_len, recv, recv_off, recv_len, (cudaStream_t)0,
                    "NCCL all-to-all", err);
}

void ep_nccl_dev_xport(ep_nccl *x, ep_dev_xport *out)
{
    *out = (ep_dev_xport){.ctx = x, .alltoallv = dev_a2a};
}
