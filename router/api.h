/* api.h: the router's HTTP routes (OpenAI completions and chat, models, health, metrics) over
 * a backend. Prefix: api_.
 *
 * A generation request is parsed and bounded by router/openai.c, tokenised, handed to the
 * backend, and its tokens are detokenised here with the tokenizer's streaming detokeniser;
 * stop strings are matched on the text (text that could begin a stop string is held back until
 * it cannot), and the response is one JSON object or server-sent events. A client that goes
 * away, or a stop string, aborts the backend request at once, exactly once.
 */
#ifndef DI_ROUTER_API_H
#define DI_ROUTER_API_H

#include <stdbool.h>
#include <stddef.h>

#include "common/tokenizer/tokenizer.h"
#include "router/backend.h"
#include "router/http.h"
#include "router/openai.h"

typedef struct api_ctx api_ctx;

typedef struct api_config {
    const tok_tokenizer *tok; /* detokeniser and chat encoder; must outlive the api */
    rt_backend backend;       /* where tokens come from */
    oai_limits limits;        /* request bounds; limits.model is the served name */
    bool add_bos;             /* prepend BOS to completion text prompts */
    uint64_t request_timeout_ms; /* a request still running after this is aborted (a whole
                                    reply: 504; a stream ends with finish_reason "abort");
                                    0 = no limit */
} api_config;

/* Returns DI_OK with *out, DI_EINVAL (no tokenizer or model name), DI_ENOMEM. */
di_status api_new(const api_config *cfg, api_ctx **out, di_error *err);
void api_free(api_ctx *a); /* NULL-safe; call after the HTTP server stopped */

/* The route table; handlers take the api_ctx as their app pointer. */
const http_route *api_routes(size_t *n);

/* Requests by outcome, for tests and /metrics. */
typedef struct api_counts {
    uint64_t ok;        /* finished normally */
    uint64_t failed;    /* failed in the backend */
    uint64_t cancelled; /* the client went away first */
    uint64_t running;   /* in flight now */
} api_counts;
void api_get_counts(api_ctx *a, api_counts *c);

#endif
