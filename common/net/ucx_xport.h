/* ucx_xport.h: the UCX transport of KV bytes (UCP RMA, UCX 1.13).
 *
 * The store maps its DRAM arena with UCP_MEM_MAP_ALLOCATE, which on one host places it in
 * shared memory that peers read and write one-sidedly (no progress by the store needed); over
 * TCP the gets and puts are emulated with active messages and the store's progress thread
 * serves them. The store hands its worker address and the arena's packed remote key to
 * clients through the gRPC control API; clients move bytes with ucxt_get / ucxt_put.
 *
 * Handles: ucxt_ctx (context + one worker), ucxt_region (mapped memory), ucxt_peer (endpoint to
 * a remote worker), ucxt_rkey (unpacked remote key). Each is created and destroyed explicitly;
 * destroy functions are NULL-safe. A ucxt_ctx and everything made from it is used by one thread
 * at a time, except that ucxt_progress_start runs a thread of its own on a context created with
 * `threaded` set.
 *
 * Transfers are requests that complete exactly once: ucxt_get and ucxt_put return only when
 * every operation they started has completed (successfully, in error, or cancelled by a forced
 * close at the deadline), so the caller's buffers are never written after they return.
 * ucs_status_t is translated to di_status here: UCS_ERR_NO_MEMORY -> DI_ENOMEM, timeouts ->
 * DI_ETIMEDOUT, unreachable or reset peers -> DI_EUNAVAIL, everything else -> DI_EIO.
 */
#ifndef DI_NET_UCX_XPORT_H
#define DI_NET_UCX_XPORT_H

#include <stddef.h>
#include <stdint.h>

#include "common/util/status.h"

typedef struct ucxt_ctx ucxt_ctx;
typedef struct ucxt_region ucxt_region;
typedef struct ucxt_peer ucxt_peer;
typedef struct ucxt_rkey ucxt_rkey;

/* Creates a UCP context with RMA (and wakeup, for the progress thread) and one worker.
 * threaded: the worker may be progressed by ucxt_progress_start's thread while other threads
 * use the context. DI_OK, DI_EUNSUPPORTED (UCX refused the features), DI_ENOMEM, DI_EIO. */
di_status ucxt_create(int threaded, ucxt_ctx **out, di_error *err);
/* Stops the progress thread if running, then releases the worker and context. Regions, peers
 * and keys made from it must be destroyed first. NULL-safe; returns NULL. */
ucxt_ctx *ucxt_destroy(ucxt_ctx *ctx);

/* The worker's address, to give to peers. *buf is malloc'd (free() it). */
di_status ucxt_worker_address(ucxt_ctx *ctx, void **buf, size_t *len, di_error *err);

/* Starts a thread that progresses the worker (waiting on its event fd while idle). Needed for
 * transports that emulate RMA (TCP) and for endpoint wire-up. DI_ESTATE when already running or
 * the context is not threaded. */
di_status ucxt_progress_start(ucxt_ctx *ctx, di_error *err);

/* Stops the progress thread (no-op when not running). */
void ucxt_progress_stop(ucxt_ctx *ctx);

/* Allocates and maps `bytes` of memory peers can get from and put into (UCP_MEM_MAP_ALLOCATE;
 * falls back to mapping page-aligned malloc'd memory when UCX cannot allocate). DI_OK, DI_ENOMEM,
 * DI_EIO. */
di_status ucxt_region_map(ucxt_ctx *ctx, uint64_t bytes, ucxt_region **out, di_error *err);
void *ucxt_region_base(const ucxt_region *r);
uint64_t ucxt_region_bytes(const ucxt_region *r);
/* 1 when UCX allocated the memory (true one-sided access over shared memory). */
int ucxt_region_allocated(const ucxt_region *r);
/* Packs the region's remote key. *buf is malloc'd (free() it). */
di_status ucxt_region_rkey(ucxt_region *r, void **buf, size_t *len, di_error *err);
/* Unmaps. NULL-safe; returns NULL. */
ucxt_region *ucxt_region_unmap(ucxt_region *r);

/* Connects to a remote worker address. peer_errors selects UCP_ERR_HANDLING_MODE_PEER: a dead
 * peer then fails the requests instead of hanging them, and a deadline can force-close the
 * endpoint; but UCX 1.13's shared-memory transports do not support it, so on one host it would
 * push every transfer onto TCP. Use it for stores on other hosts only; on one host gets and
 * puts are one-sided copies that cannot hang on a dead store. DI_OK, DI_EINVAL, DI_EUNAVAIL,
 * DI_EIO. */
di_status ucxt_peer_connect(ucxt_ctx *ctx, const void *addr, size_t len, int peer_errors,
                            ucxt_peer **out, di_error *err);
/* 1 once the peer has failed (reset, error callback, forced close after a deadline): the caller
 * must connect again. */
int ucxt_peer_failed(const ucxt_peer *p);
/* Closes the endpoint (forcibly if it failed). NULL-safe; returns NULL. */
ucxt_peer *ucxt_peer_close(ucxt_peer *p);

/* Unpacks a remote key received from the peer. DI_OK, DI_EINVAL (bad buffer), DI_EIO. */
di_status ucxt_rkey_unpack(ucxt_peer *p, const void *buf, size_t len, ucxt_rkey **out,
                           di_error *err);
ucxt_rkey *ucxt_rkey_free(ucxt_rkey *k);
/* A local pointer to the remote address when UCX has mapped the peer's memory into this
 * process (shared-memory transports: the peer is on this host). Loads and stores through it
 * are one-sided accesses to the peer's memory. DI_OK, or DI_EUNSUPPORTED when the memory is
 * not mapped here (the peer is elsewhere: use ucxt_get / ucxt_put). */
di_status ucxt_rkey_ptr(ucxt_rkey *k, uint64_t remote, void **local, di_error *err);

/* One transfer of a batch. */
typedef struct ucxt_op {
    uint64_t remote;   /* remote virtual address */
    void *local;       /* local buffer (read by puts, written by gets) */
    uint64_t len;      /* bytes */
} ucxt_op;

/* Called as each get of ucxt_get completes successfully, in completion order (so a caller can
 * start verifying while later gets run). */
typedef void (*ucxt_done_fn)(void *ud, size_t index);

/* Reads n remote ranges into local buffers, at most `window` operations in flight. Returns when
 * all completed: DI_OK; DI_ETIMEDOUT at deadline_ns (di_mono_ns clock; the peer is then closed
 * and marked failed); DI_EUNAVAIL / DI_EIO when the peer failed. done may be NULL. */
di_status ucxt_get(ucxt_peer *p, ucxt_rkey *k, const ucxt_op *ops, size_t n, uint32_t window,
                   uint64_t deadline_ns, ucxt_done_fn done, void *ud, di_error *err);
/* Writes n local buffers to remote ranges, then flushes the endpoint so the bytes are in remote
 * memory when it returns DI_OK. Same codes as ucxt_get. */
di_status ucxt_put(ucxt_peer *p, ucxt_rkey *k, const ucxt_op *ops, size_t n, uint32_t window,
                   uint64_t deadline_ns, di_error *err);

#endif
