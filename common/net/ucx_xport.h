/* ucx_xport.h: the UCX transport of KV bytes (UCP active messages, UCX 1.13).
 *
 * The store never exposes memory to peers: its context enables active messages only (no RMA or
 * atomics, so UCX's software RMA handlers, which write or read any address a peer names, are
 * not registered), it registers and packs no remote key, and it moves bytes only against a
 * one-time ticket that the authenticated gRPC control call issued for one object:
 *
 *   get: the client sends GET {cookie, ticket}; the store checks the ticket (object, length,
 *        expiry) and answers DATA {cookie, status} carrying exactly that object's bytes, which
 *        the client receives into the buffer it chose for the cookie.
 *   put: the client sends PUT {cookie, ticket} with the object's bytes; the store checks the
 *        ticket and that the length is the allocation's, receives the bytes into the allocated
 *        slot only, and answers ACK {cookie, status} once they are there.
 *
 * Transports are fixed here, whatever UCX_TLS says: posix shared memory (queues created mode
 * 0600 and opened through /proc/PID/fd) and self on one host; on other hosts only the verbs
 * transports rc and ud on rdma_devices. Messages are eager only (rendezvous is off, and the store
 * drops a rendezvous PUT), so no memory key is exchanged in either direction; endpoint ids on
 * the wire go through UCX's checked map. UCX's tcp transport is never enabled: its receive path
 * writes a peer's "put" to any address (no key, no check) and its listener takes every
 * interface. So the KV data path opens no network socket.
 *
 * Handles: ucxt_ctx (context + one worker), ucxt_peer (endpoint to a remote worker). Each is
 * created and destroyed explicitly; destroy functions are NULL-safe. A ucxt_ctx and everything
 * made from it is used by one thread at a time, except that ucxt_progress_start runs a thread
 * of its own on a context created with `threaded` set (the store: it serves from that thread).
 *
 * ucxt_fetch and ucxt_send return only when every operation they started has completed
 * (successfully, in error, or cancelled at the deadline), so the caller's buffers are never
 * written after they return. ucs_status_t is translated to di_status here: UCS_ERR_NO_MEMORY ->
 * DI_ENOMEM, timeouts -> DI_ETIMEDOUT, unreachable or reset peers -> DI_EUNAVAIL, everything
 * else -> DI_EIO.
 */
#ifndef DI_NET_UCX_XPORT_H
#define DI_NET_UCX_XPORT_H

#include <stddef.h>
#include <stdint.h>

#include "common/util/status.h"

typedef struct ucxt_ctx ucxt_ctx;
typedef struct ucxt_peer ucxt_peer;

#define UCXT_TICKET_BYTES 16

/* A one-time permission to move one object, issued over the authenticated control channel. */
typedef struct ucxt_ticket {
    uint8_t b[UCXT_TICKET_BYTES];
} ucxt_ticket;

/* Creates a UCP context with active messages only (and wakeup, for the progress thread) and one
 * worker, on the transports above. threaded: the worker may be progressed by
 * ucxt_progress_start's thread while other threads use the context. rdma_devices: NULL or "" for
 * this host only, else a UCX_NET_DEVICES list of verbs ports ("mlx5_0:1"). DI_OK,
 * DI_EUNSUPPORTED (UCX refused the features), DI_ENOMEM, DI_EIO. */
di_status ucxt_create(int threaded, const char *rdma_devices, ucxt_ctx **out, di_error *err);
/* Stops the progress thread if running, then releases the worker and context. Peers made from
 * it must be closed first. NULL-safe; returns NULL. */
ucxt_ctx *ucxt_destroy(ucxt_ctx *ctx);

/* The worker's address, to give to peers. *buf is malloc'd (free() it). */
di_status ucxt_worker_address(ucxt_ctx *ctx, void **buf, size_t *len, di_error *err);

/* Starts a thread that progresses the worker (waiting on its event fd while idle). The store
 * serves transfers from it. DI_ESTATE when already running or the context is not threaded. */
di_status ucxt_progress_start(ucxt_ctx *ctx, di_error *err);
/* Stops the progress thread (no-op when not running). */
void ucxt_progress_stop(ucxt_ctx *ctx);

/* ---- serving (the store) ---- */

/* What a ticket grants: len bytes at addr; token goes back to the matching end call. */
typedef struct ucxt_grant {
    void *addr;
    uint64_t len;
    void *token;
} ucxt_grant;

/* The store's checks, called on the progress thread. begin calls return DI_OK and fill the
 * grant, or refuse (the peer gets the status, no byte moves). Every granted begin is followed
 * by exactly one end call with the outcome (DI_OK once the bytes are sent / have landed). */
typedef struct ucxt_server_ops {
    di_status (*get_begin)(void *ud, const ucxt_ticket *t, ucxt_grant *g);
    void (*get_end)(void *ud, void *token, di_status st);
    di_status (*put_begin)(void *ud, const ucxt_ticket *t, uint64_t len, ucxt_grant *g);
    void (*put_end)(void *ud, void *token, di_status st);
    void *ud;
} ucxt_server_ops;

/* Registers the GET and PUT handlers (before ucxt_progress_start). ops is copied. */
di_status ucxt_serve(ucxt_ctx *ctx, const ucxt_server_ops *ops, di_error *err);
/* Counters of refused requests (bad ticket, wrong length, malformed header), for tests and
 * logs. */
uint64_t ucxt_refused(const ucxt_ctx *ctx);

/* ---- client ---- */

/* Connects to a remote worker address. peer_errors selects UCP_ERR_HANDLING_MODE_PEER (a dead
 * peer then fails requests instead of hanging them); UCX 1.13's shared-memory transports do not
 * support it, so use it for stores on other hosts only. DI_OK, DI_EINVAL, DI_EUNAVAIL, DI_EIO. */
di_status ucxt_peer_connect(ucxt_ctx *ctx, const void *addr, size_t len, int peer_errors,
                            ucxt_peer **out, di_error *err);
/* 1 once the peer has failed (reset, error callback, forced close after a deadline): the caller
 * must connect again. */
int ucxt_peer_failed(const ucxt_peer *p);
/* Closes the endpoint. NULL-safe; returns NULL. */
ucxt_peer *ucxt_peer_close(ucxt_peer *p);

/* One object of a batch. */
typedef struct ucxt_xfer {
    ucxt_ticket ticket;  /* from the control call */
    void *buf;           /* fetch: destination; send: source */
    uint64_t len;        /* fetch: capacity of buf; send: bytes to send */
    uint64_t got;        /* fetch: bytes received */
    di_status status;    /* per-object outcome: DI_OK, the store's refusal, DI_ERANGE (the
                            object does not fit buf), DI_EIO */
} ucxt_xfer;

/* Called as each fetch completes successfully, in completion order (so a caller can start
 * verifying while later ones run). */
typedef void (*ucxt_done_fn)(void *ud, size_t index);

/* Fetches n objects, at most `window` in flight. Returns when all completed: DI_OK (see each
 * status); DI_ETIMEDOUT at deadline_ns (di_mono_ns clock; the peer is then closed and marked
 * failed); DI_EUNAVAIL / DI_EIO when the peer failed. done may be NULL. */
di_status ucxt_fetch(ucxt_peer *p, ucxt_xfer *x, size_t n, uint32_t window, uint64_t deadline_ns,
                     ucxt_done_fn done, void *ud, di_error *err);
/* Sends n objects; returns once the store acknowledged each (status per object). Same codes. */
di_status ucxt_send(ucxt_peer *p, ucxt_xfer *x, size_t n, uint32_t window, uint64_t deadline_ns,
                    di_error *err);

/* ---- raw messages (tests that attack the store) ---- */

/* Sends one GET (is_put 0) or PUT request with this header and data and waits for the reply:
 * its status, and for a GET the bytes received (up to cap). The header may be malformed on
 * purpose (any length). DI_OK when a reply came (see *status); DI_ETIMEDOUT when none came by
 * the deadline. */
di_status ucxt_raw_request(ucxt_peer *p, int is_put, const void *header, size_t header_len,
                           const void *data, size_t len, void *buf, uint64_t cap,
                           di_status *status, uint64_t *got, uint64_t deadline_ns, di_error *err);

#endif
