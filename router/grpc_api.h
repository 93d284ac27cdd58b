/* grpc_api.h: the router's gRPC API (common/net/proto/router.proto) over a backend. Prefix:
 * gapi_.
 *
 * Generate is a server stream: a first message with the request id, one message per token
 * (id, logprob, alternatives, the text it releases through the streaming detokeniser), and a
 * last one with the finish reason, usage and any held-back text. Requests are checked by the
 * HTTP API's own parser (router/openai.c, oai_parse and oai_tokenize, with the same limits),
 * so both APIs accept and refuse exactly the same requests with the same one-line messages.
 * A client that cancels (or goes away, or passes its deadline) and Abort by request id each
 * abort the backend request; it is aborted once whatever arrives first and however often.
 * RegisterRank (admin token) hands a rank's self-registration to the embedder's callback.
 */
#ifndef DI_ROUTER_GRPC_API_H
#define DI_ROUTER_GRPC_API_H

#include <stdbool.h>
#include <stdint.h>

#include "common/tokenizer/tokenizer.h"
#include "common/util/log.h"
#include "common/util/status.h"
#include "router/backend.h"
#include "router/openai.h"

#define GAPI_SERVICE "/di.router.Router/"

/* A rank announced itself: role 0 prefill, 1 decode; addr "HOST:PORT" (port checked). Fills
 * *heartbeat_ms and *ranks (of that role). Returns DI_OK or a failure for the caller. */
typedef di_status (*gapi_register_fn)(void *ud, int role, const char *addr,
                                      uint32_t *heartbeat_ms, uint32_t *ranks, di_error *err);

typedef struct gapi_config {
    const char *listen;          /* "HOST:PORT"; port 0 picks one */
    const tok_tokenizer *tok;    /* detokeniser and encoder; outlives the server */
    rt_backend backend;          /* where tokens come from */
    oai_limits limits;           /* the HTTP API's bounds (limits.model: the served name) */
    bool add_bos;                /* prepend BOS to text prompts (as the HTTP API) */
    uint32_t request_timeout_ms; /* Generate's deadline when the client's is later; >= 1 */
    const char *token;           /* client bearer token for Generate/Abort; NULL: none */
    const char *admin_token;     /* for RegisterRank; NULL: RegisterRank only without tokens */
    gapi_register_fn on_register; /* NULL: RegisterRank answers EUNSUPPORTED */
    void *register_ud;
    unsigned threads;            /* gRPC worker threads, >= 1 */
    const di_logger *log;        /* failed calls at debug level; may be NULL */
} gapi_config;

typedef struct gapi_server gapi_server;

/* Binds and serves. DI_OK with *out and *port; DI_EINVAL (config), DI_EUNAVAIL (cannot bind),
 * DI_ENOMEM. */
di_status gapi_start(const gapi_config *cfg, gapi_server **out, int *port, di_error *err);
/* Stops serving: streams in flight are cancelled (their backend requests aborted) after
 * grace_ms, and every one has ended when it returns. NULL-safe. */
void gapi_stop(gapi_server *g, uint32_t grace_ms);
/* Generate streams alive now (for tests). */
unsigned gapi_live(gapi_server *g);

#endif
