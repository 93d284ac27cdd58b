/* rpc.h: gRPC (C core, completion-queue API) with protobuf-c payloads, for services and their
 * clients: unary calls answered at once or later, and server-streaming calls. Messages travel
 * as raw bytes; callers pack and unpack them with protobuf-c.
 *
 * Server: tables of methods (H2), one row per method:
 *     name, handler, default deadline, idempotent or not, largest request, least role;
 * and for asynchronous methods: name, start function, stream or not, then the same limits.
 * The server checks the caller's token and role, the request size and the deadline before a
 * handler runs, so handlers see only well-formed traffic from permitted callers. Each call
 * completes exactly once: the handler's status becomes the gRPC status (di_status_grpc), the
 * message the status details, and the di_status name travels in the trailing metadata key
 * "di-status" so that clients recover the exact code.
 *
 * Auth: callers send "authorization: Bearer <token>". A caller presenting the admin token has
 * the ADMIN role, the engine token the ENGINE role. Engine methods accept ENGINE or ADMIN (or
 * anyone when no engine token is configured); admin methods accept ADMIN only (or anyone when
 * no token at all is configured). A missing or unknown token is DI_EAUTH (UNAUTHENTICATED), a
 * known token without the role DI_EPERM (PERMISSION_DENIED). TLS is used when a certificate and
 * key are given; with a client CA too, clients must present certificates signed by it.
 *
 * Threads: the server runs `threads` workers on one completion queue; handlers run on them and
 * must be thread-safe. A client is used by one thread at a time for unary calls
 * (rpc_client_cancel excepted); streams have their own queues, so any number of threads may
 * each read their own stream of one client at once.
 *
 * Asynchronous calls (rows of the asynchronous table): the start function runs on a
 * worker thread after the same checks, and either fails (the server answers with its status)
 * or takes the call handle and returns DI_OK. From then on any thread (the engine's output
 * callback, say) may write stream messages with rpc_call_write and must end the call exactly
 * once with rpc_call_finish. Cancellation (the client cancels, goes away, the deadline passes
 * or the server stops) is seen at most once per call: the cancel function registered with
 * rpc_call_on_cancel runs once, with no lock held, and rpc_call_cancelled turns 1. After a
 * cancel, writes fail with DI_ECANCELED and rpc_call_finish only releases the handle. The
 * deadline is the earlier of the client's and the row's default_deadline_ms; the server
 * enforces it with its own timer.
 *
 * States of a call handle (rpc.c asserts them):
 *     STARTED --write*--> STARTED --finish--> FINISHED (status queued after the messages)
 *     STARTED --cancel--> CANCELLED --finish--> FINISHED (nothing more is sent)
 * The handle is freed when the handler has finished it and gRPC has returned every batch.
 */
#ifndef DI_NET_RPC_H
#define DI_NET_RPC_H

#include <stddef.h>
#include <stdint.h>

#include "common/util/log.h"
#include "common/util/status.h"

typedef enum rpc_role {
    RPC_ROLE_NONE = 0,   /* no or unknown token */
    RPC_ROLE_ENGINE = 1, /* the shared engine token */
    RPC_ROLE_ADMIN = 2,  /* the admin token */
} rpc_role;

/* What a handler receives. */
typedef struct rpc_request {
    const char *method;    /* full method name */
    const uint8_t *data;   /* request message bytes (may be NULL when len is 0) */
    size_t len;            /* their length */
    rpc_role role;         /* the caller's role */
    uint64_t deadline_ns;  /* di_mono_ns() time by which the reply is due */
    const char *peer;      /* "ipv4:127.0.0.1:41234" */
} rpc_request;

/* What a handler returns on success: malloc'd message bytes the server frees. */
typedef struct rpc_reply {
    uint8_t *data; /* malloc'd; NULL for an empty message */
    size_t len;
} rpc_reply;

typedef di_status (*rpc_handler_fn)(void *svc, const rpc_request *req, rpc_reply *reply,
                                    di_error *err);

/* An asynchronous call, owned by the handler from a DI_OK start until rpc_call_finish. */
typedef struct rpc_call rpc_call;

/* Starts an asynchronous call. DI_OK: the handler owns `call` and must finish it exactly once
 * (possibly before returning). Any other status: the server answers with it and err's message;
 * the handler must not touch `call` again. req (and its bytes) is valid only during the call. */
typedef di_status (*rpc_start_fn)(void *svc, const rpc_request *req, rpc_call *call,
                                  di_error *err);

/* One row of a service's method table. */
typedef struct rpc_method {
    const char *name;             /* "/pkg.Service/Method" */
    rpc_handler_fn handler;       /* runs on a server thread */
    uint32_t default_deadline_ms; /* applied when the client's deadline is later or absent */
    int idempotent;               /* 1: safe to retry (documentation and client retry policy) */
    uint32_t max_request_bytes;   /* larger requests fail with DI_EFULL before the handler */
    rpc_role role;                /* least role allowed (ENGINE or ADMIN) */
} rpc_method;

/* One row of a service's table of asynchronous methods (reply later, or a server stream). */
typedef struct rpc_async_method {
    const char *name;             /* "/pkg.Service/Method" */
    rpc_start_fn start;           /* runs on a server thread; the call is finished later */
    int streaming;                /* 1: server stream of messages; 0: one reply message */
    uint32_t default_deadline_ms; /* applied when the client's deadline is later or absent */
    int idempotent;               /* 1: safe to retry */
    uint32_t max_request_bytes;   /* larger requests fail with DI_EFULL before start */
    rpc_role role;                /* least role allowed (ENGINE or ADMIN) */
} rpc_async_method;

/* Most messages queued on one stream and not yet taken by gRPC (a slow reader): writes beyond
 * it fail with DI_EFULL. */
#define RPC_STREAM_MAX_QUEUED 4096

/* Called once for every call that fails (at any stage), for the embedder's log. */
typedef void (*rpc_error_fn)(void *ud, const char *method, const char *peer, di_status st,
                             const char *msg);

typedef struct rpc_server_config {
    const char *listen;             /* "127.0.0.1:0" (0 picks a free port) */
    const rpc_method *methods;      /* the table of methods answered at once */
    size_t n_methods;
    const rpc_async_method *async_methods; /* the table of asynchronous methods */
    size_t n_async_methods;
    void *svc;                      /* handed to every handler */
    unsigned threads;               /* worker threads (>= 1) */
    const char *engine_token;       /* NULL: engine methods need no token */
    const char *admin_token;        /* NULL: admin methods open only when no token is set */
    const char *tls_cert_pem;       /* server certificate chain; NULL: plaintext */
    const char *tls_key_pem;        /* its private key */
    const char *tls_client_ca_pem;  /* NULL: no client certificates asked for */
    rpc_error_fn on_error;          /* may be NULL */
    void *on_error_ud;
} rpc_server_config;

typedef struct rpc_server rpc_server;

/* Binds, registers the methods and starts the workers. *port receives the bound port.
 * DI_OK, DI_EINVAL (bad table or config, half a TLS pair), DI_EUNAVAIL (cannot bind),
 * DI_ENOMEM. */
di_status rpc_server_start(const rpc_server_config *cfg, rpc_server **out, int *port,
                           di_error *err);
/* Stops accepting calls, lets calls in flight finish for up to grace_ms, then cancels the rest,
 * waits for the workers and frees everything. NULL-safe; returns NULL. */
rpc_server *rpc_server_stop(rpc_server *srv, uint32_t grace_ms);
/* Calls accepted and not yet freed (synchronous ones being handled or sending, asynchronous
 * handles alive): 0 when idle. For tests and GetLoad. */
unsigned rpc_server_live_calls(rpc_server *srv);

/* ---- asynchronous calls (server side); every function is thread-safe ---- */

/* Registers the function to run once when the call is cancelled (client cancel or
 * disconnection, deadline, server stop); `why` is DI_ECANCELED, DI_ETIMEDOUT or DI_EUNAVAIL.
 * If the call is already cancelled it runs at once, on this thread. Call it at most once,
 * before finishing. It may call rpc_call_finish itself. Once rpc_call_finish has returned the
 * function is not running and never will, so its `ud` may be freed then. */
void rpc_call_on_cancel(rpc_call *call, void (*fn)(void *ud, di_status why), void *ud);
/* 1 once the call was cancelled (the engine may poll this instead of a callback). */
int rpc_call_cancelled(rpc_call *call);
/* The call's deadline, di_mono_ns() time. */
uint64_t rpc_call_deadline_ns(const rpc_call *call);
/* Queues one message of a streaming call (the bytes are copied). DI_OK, DI_ECANCELED (the call
 * was cancelled: stop producing), DI_EFULL (RPC_STREAM_MAX_QUEUED messages wait: the client
 * reads too slowly), DI_ERANGE (over 2 GiB), DI_ESTATE (not a stream, or already finished),
 * DI_ENOMEM. */
di_status rpc_call_write(rpc_call *call, const void *msg, size_t len, di_error *err);
/* Ends the call: st (DI_OK or a failure with msg as the status text) goes to the client after
 * every queued message; for a unary call, `reply` (len bytes, copied; ignored unless st is
 * DI_OK) is the reply message. After a cancel it only releases the handle. The handle must not
 * be used afterwards. It waits for a cancel function running on another thread: do not call
 * it while holding a lock that the cancel function takes. */
void rpc_call_finish(rpc_call *call, di_status st, const void *reply, size_t len,
                     const char *msg);

typedef struct rpc_client_config {
    const char *target;            /* "host:port" */
    const char *token;             /* bearer token; NULL: none */
    const char *tls_ca_pem;        /* NULL: plaintext; else the CA that signed the server */
    const char *tls_cert_pem;      /* client certificate (mutual TLS); may be NULL */
    const char *tls_key_pem;       /* its key */
    const char *tls_target_name;   /* name to check the server certificate against; NULL: host */
    uint32_t max_reply_bytes;      /* 0: 64 MiB */
} rpc_client_config;

typedef struct rpc_client rpc_client;

/* Creates a channel (connects lazily). DI_OK, DI_EINVAL, DI_ENOMEM. */
di_status rpc_client_open(const rpc_client_config *cfg, rpc_client **out, di_error *err);
/* NULL-safe; returns NULL. */
rpc_client *rpc_client_close(rpc_client *c);

/* One unary call with a deadline of timeout_ms. On DI_OK, *reply is malloc'd (free() it; NULL
 * for an empty reply) and *reply_len set. Failures: the server's di_status (from "di-status"),
 * or the gRPC status translated (DI_EUNAVAIL when the server is down or unreachable,
 * DI_ETIMEDOUT at the deadline, DI_ECANCELED after rpc_client_cancel). Outputs untouched on
 * failure. */
di_status rpc_client_call(rpc_client *c, const char *method, const void *req, size_t len,
                          uint32_t timeout_ms, uint8_t **reply, size_t *reply_len,
                          di_error *err);
/* Cancels the call in flight, if any (from any thread). */
void rpc_client_cancel(rpc_client *c);
/* Waits up to timeout_ms for the channel to be connected, starting a connection when it is
 * idle. Returns 1 when it is connected, 0 when not by then (the server down, or still
 * connecting). A channel that is not connected makes progress (its reconnection attempts, their
 * back-off timers) only while some thread waits on it: a caller that retries fail-fast calls
 * after DI_EUNAVAIL should wait here between attempts rather than sleep, or a restarted server
 * may be seen only seconds later (gRPC's own backup poll, every 5 s). */
int rpc_client_wait_connected(rpc_client *c, uint32_t timeout_ms);
/* rpc_client_wait_connected over n channels at once, from one thread: waits until every one of
 * cs[0..n) is connected or timeout_ms has passed, starting connections of idle ones and
 * driving the reconnection of each meanwhile (so a server back after a restart is connected
 * within its back-off, whichever channel it is). connected[i] receives 1 when cs[i] is
 * connected at the end. Returns how many are. A channel that does not connect keeps the call
 * waiting the whole timeout. */
size_t rpc_clients_wait_connected(rpc_client *const *cs, size_t n, uint32_t timeout_ms,
                                  int *connected);
/* 1 when the channel is connected now (does not start a connection). */
int rpc_client_connected(rpc_client *c);

/* The client side of a server-streaming call. */
typedef struct rpc_stream rpc_stream;

/* Sends the request and returns at once; the deadline (timeout_ms) covers the whole stream.
 * DI_OK, DI_EINVAL, DI_ENOMEM, DI_EINTERNAL. Failures of the call itself come from reads. */
di_status rpc_stream_open(rpc_client *c, const char *method, const void *req, size_t len,
                          uint32_t timeout_ms, rpc_stream **out, di_error *err);
/* Waits for the next message. DI_OK with *msg (malloc'd; NULL when empty) and *len, and *done
 * 0; or, at the end of the stream, the final status: DI_OK with *done 1, or the failure
 * (the server's di_status, DI_ETIMEDOUT at the deadline, DI_ECANCELED after a cancel,
 * DI_EUNAVAIL when the server is unreachable) with *done 1. Reading after the end repeats the
 * final status. */
di_status rpc_stream_read(rpc_stream *s, uint8_t **msg, size_t *len, int *done, di_error *err);
/* Cancels the stream (from any thread); the server's cancel function runs. */
void rpc_stream_cancel(rpc_stream *s);
/* Cancels the stream if it has not ended, waits for gRPC to let go of it and frees it.
 * NULL-safe; returns NULL. */
rpc_stream *rpc_stream_close(rpc_stream *s);

/* The target the client talks to. */
const char *rpc_client_target(const rpc_client *c);

/* Reads a whole (PEM) file into a NUL-terminated malloc'd string. DI_OK, DI_ENOENT, DI_EIO,
 * DI_ERANGE (over 1 MiB). */
di_status rpc_load_file(const char *path, char **out, di_error *err);

/* di_status for a gRPC status code without a "di-status" trailer. */
di_status rpc_status_from_grpc(int grpc_code);

#endif
