/* nccl_xport.h: the device exchange of an expert-parallel group: an NCCL communicator over the
 * group's GPUs (one process per GPU) and the all-to-all the MoE dispatch and combine ride on
 * when the experts' tensors live in device memory (docs/ep.md).
 *
 * The communicator is made from a unique id that rank 0 draws and sends the other ranks over
 * the CPU group (group.h), so the GPUs meet where the group met and with its token. It is
 * non-blocking: every call polls the communicator's state against a deadline and aborts it
 * (ncclCommAbort) when the deadline passes or a peer fails, so a dead rank ends the exchange
 * with DI_ETIMEDOUT or DI_EIO instead of a hang.
 *
 * The all-to-all is grouped ncclSend/ncclRecv of byte ranges on one stream; the counts come
 * first (an all-to-all of one uint64 per peer) so each rank knows what it receives. The
 * combine adds a row's expert outputs on the host-side order of moe.h (ascending expert id,
 * then the shared expert), whatever order the bytes arrived in.
 *
 * Built with -Dcuda when the toolkit has NCCL (cudatk_dir). The MoE exchange takes it as its
 * device transport (ep_nccl_dev_xport; di-generate --ep-transport nccl). It has not run yet:
 * there was no multi-GPU machine to run it on; the CPU tests check the exchange's device path
 * with the group standing in for it (ep_dev_xport_group).
 */
#ifndef DI_EP_NCCL_XPORT_H
#define DI_EP_NCCL_XPORT_H

#include <stdint.h>

#include "common/ep/group.h"
#include "common/ep/moe.h"
#include "common/util/status.h"

typedef struct ep_nccl ep_nccl;

/* Makes the communicator of the group's ranks on CUDA device `device` (rank 0 draws the id,
 * the group carries it). Every rank calls it in lockstep. DI_OK; DI_EIO (CUDA or NCCL, with
 * its message); DI_ETIMEDOUT; the group's failures; DI_ENOMEM. */
di_status ep_nccl_open(ep_group *g, int device, uint32_t timeout_ms, ep_nccl **out,
                       di_error *err);
/* The communicator as the MoE exchange's device transport (moe.h): ep_nccl_alltoallv on the
 * legacy default stream, which waits for the backend's stream before and is waited for after
 * (the backend's stream is a blocking one). */
void ep_nccl_dev_xport(ep_nccl *x, ep_dev_xport *out);

/* Aborts the communicator if it is still in use, then frees it. NULL-safe. */
void ep_nccl_close(ep_nccl *x);

/* All-to-all of device byte ranges on `stream` (a cudaStream_t): rank d gets
 * send + send_off[d] .. + send_len[d]; this rank's data from rank s lands at recv +
 * recv_off[s] (recv_len[s] bytes, which the caller learnt with ep_nccl_counts). Waits for the
 * stream with the deadline. DI_OK; DI_ETIMEDOUT (the communicator is aborted); DI_EIO. */
di_status ep_nccl_alltoallv(ep_nccl *x, const void *send, const uint64_t *send_off,
                            const uint64_t *send_len, void *recv, const uint64_t *recv_off,
                            const uint64_t *recv_len, void *stream, di_error *err);

/* All-to-all of one uint64 per peer: the sizes of the next ep_nccl_alltoallv (device arrays
 * of world entries). DI_OK; DI_ETIMEDOUT; DI_EIO. */
di_status ep_nccl_counts(ep_nccl *x, const uint64_t *send_counts, uint64_t *recv_counts,
                         void *stream, di_error *err);

#endif
