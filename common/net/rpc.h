/* rpc.h: unary gRPC (C core, completion-queue API) with protobuf-c payloads, for services and
 * their clients. Messages travel as raw bytes; callers pack and unpack them with protobuf-c.
 *
 * Server: a table of methods (H2), one row per method:
 *     name, handler, default deadline, idempotent or not, largest request, least role.
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
 * must be thread-safe. A client is used by one thread at a time (rpc_client_cancel excepted).
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

/* One row of a service's method table. */
typedef struct rpc_method {
    const char *name;             /* "/pkg.Service/Method" */
    rpc_handler_fn handler;       /* runs on a server thread */
    uint32_t default_deadline_ms; /* applied when the client's deadline is later or absent */
    int idempotent;               /* 1: safe to retry (documentation and client retry policy) */
    uint32_t max_request_bytes;   /* larger requests fail with DI_EFULL before the handler */
    rpc_role role;                /* least role allowed (ENGINE or ADMIN) */
} rpc_method;

/* Called once for every call that fails (at any stage), for the embedder's log. */
typedef void (*rpc_error_fn)(void *ud, const char *method, const char *peer, di_status st,
                             const char *msg);

typedef struct rpc_server_config {
    const char *listen;             /* "127.0.0.1:0" (0 picks a free port) */
    const rpc_method *methods;      /* the method table */
    size_t n_methods;
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
/* The target the client talks to. */
const char *rpc_client_target(const rpc_client *c);

/* Reads a whole (PEM) file into a NUL-terminated malloc'd string. DI_OK, DI_ENOENT, DI_EIO,
 * DI_ERANGE (over 1 MiB). */
di_status rpc_load_file(const char *path, char **out, di_error *err);

/* di_status for a gRPC status code without a "di-status" trailer. */
di_status rpc_status_from_grpc(int grpc_code);

#endif
