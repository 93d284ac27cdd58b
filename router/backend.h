/* backend.h: what the HTTP front end needs from whatever generates tokens. Prefix: rt_.
 *
 * The real implementation is the prefill/decode client; router/testbackend.c is an in-process
 * one with deterministic tokens for tests. Contract (H7): when generate returns DI_OK, exactly
 * one on_finish follows, also after abort, and on_token calls only come before it, one at a
 * time, from any thread. When generate fails, no callback is made. abort may be called any
 * number of times, before or after on_finish, from any thread; after on_finish it does
 * nothing. The callbacks must not call abort of the same request.
 */
#ifndef DI_ROUTER_BACKEND_H
#define DI_ROUTER_BACKEND_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/util/status.h"

#define RT_MAX_TOP 20 /* alternatives per token */

/* What to generate. */
typedef struct rt_gen_req {
    const int32_t *prompt; /* prompt ids, n_prompt of them (valid during generate only) */
    size_t n_prompt;
    uint32_t max_tokens;   /* output tokens at most */
    float temperature;     /* 0..2 */
    float top_p;           /* (0, 1] */
    int32_t top_k;         /* -1 = off */
    uint64_t seed;         /* the request's seed */
    uint32_t top_logprobs; /* alternatives wanted per token, 0..RT_MAX_TOP */
    bool ignore_eos;       /* do not stop at EOS */
} rt_gen_req;

/* One generated token. */
typedef struct rt_gen_token {
    int32_t id;                  /* token id */
    float logprob;               /* its logprob under the processed distribution */
    int32_t top_ids[RT_MAX_TOP]; /* alternatives, most likely first */
    float top_lps[RT_MAX_TOP];
    uint32_t n_top;
} rt_gen_token;

typedef enum rt_finish {
    RT_FINISH_LENGTH = 0, /* max_tokens reached */
    RT_FINISH_EOS = 1,    /* EOS generated (not reported as a token) */
    RT_FINISH_ABORT = 2,  /* aborted by the caller */
    RT_FINISH_ERROR = 3,  /* failed: status and message say why */
} rt_finish;

typedef struct rt_gen_cb {
    void (*on_token)(void *ud, const rt_gen_token *t);
    /* cached_tokens: prompt tokens that came from the KV store. instance: the rank that
     * served the request ("HOST:PORT"), or NULL when none did. st/msg: DI_OK and "" unless
     * reason is RT_FINISH_ERROR. */
    void (*on_finish)(void *ud, rt_finish reason, uint32_t cached_tokens, const char *instance,
                      di_status st, const char *msg);
    void *ud;
    /* Optional (NULL: not told). The rank `from` failed after n_done tokens and the request
     * continues on `to` ("HOST:PORT" each); the tokens that follow come from there. Called
     * between on_token calls, before on_finish. */
    void (*on_continue)(void *ud, const char *from, const char *to, uint32_t n_done);
} rt_gen_cb;

typedef struct rt_backend {
    /* Starts a generation; *handle identifies it for abort. Returns DI_OK, DI_EUNAVAIL (no
     * rank can take it), DI_EFULL (queues full), DI_ENOMEM. */
    di_status (*generate)(void *self, const rt_gen_req *req, const rt_gen_cb *cb,
                          uint64_t *handle, di_error *err);
    void (*abort)(void *self, uint64_t handle);
    void *self;
} rt_backend;

#endif
