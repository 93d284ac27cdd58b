/* kern_ep.h: the device side of the expert-parallel exchange (common/ep/moe.h): the combine of
 * a row's expert outputs that came back from the ranks, and pinned host memory for the
 * transfers. The rows sent to each rank are gathered with the backend's copy_rows.
 *
 * kern_ep_combine: y[t] = bf16(fp32(sum over k of outs[pos[t][k]] + shared[t])), the sum in
 * double, the row's experts in the order of pos (the caller gives them by ascending expert
 * id), then the shared expert: the order and the one rounding of kern_moe_experts' combine,
 * so the result is the one-rank result, bit for bit. Exact (the CUDA kernel equals the C twin
 * bit for bit). pos is host metadata (kernels.h's convention: a device backend copies it).
 */
#ifndef DI_KERNELS_KERN_EP_H
#define DI_KERNELS_KERN_EP_H

#include <stddef.h>
#include <stdint.h>

#include "common/util/status.h"
#include "kernels/kernels.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct kern_ep_combine {
    uint32_t n_rows;
    uint32_t dim;
    uint32_t top_k;
    uint32_t n_outs;            /* rows of outs (every pos below it) */
    const uint16_t *outs;       /* [n_outs, dim] bf16: the expert outputs of the pairs */
    const int32_t *pos;         /* [n_rows, top_k] host: row of outs of the row's k-th expert */
    const uint16_t *shared;     /* [n_rows, dim] bf16 shared expert output, or NULL */
    uint16_t *y;                /* [n_rows, dim] bf16 */
} kern_ep_combine;

/* What the exchange needs from a backend beyond kern_ops. */
typedef struct kern_ep_ops {
    void *ctx;                  /* the backend's (kern_backend.ctx) */
    /* DI_OK; DI_EINVAL (a pos outside [0, n_outs)); the backend's failure */
    di_status (*combine)(void *ctx, const kern_ep_combine *p);
    /* host memory the backend copies from and to at full speed (pinned); NULL on failure */
    void *(*host_alloc)(void *ctx, size_t bytes);
    void (*host_free)(void *ctx, void *p);
    /* the message of the backend's last failed op, or NULL (the CPU backend keeps none) */
    const char *(*last_error)(void *ctx);
} kern_ep_ops;

/* The C twin of the combine. DI_EINVAL for a pos out of range (nothing written then). */
di_status kern_ep_combine_ref(const kern_ep_combine *p);
/* The ops of a host-memory backend: the C twin, malloc and free. */
void kern_ep_ops_host(kern_ep_ops *out);
/* The ops of a CUDA backend (kernels/cuda/ep.cu; builds with -Dcuda only): the combine kernel
 * on the backend's stream, cudaHostAlloc. DI_EINVAL when be is not a CUDA backend. */
di_status kern_ep_ops_cuda(const kern_backend *be, kern_ep_ops *out, di_error *err);

#ifdef __cplusplus
}
#endif

#endif
