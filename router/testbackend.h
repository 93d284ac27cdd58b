/* testbackend.h: an in-process backend with deterministic tokens, a delay per token and
 * injected failures, for the router's tests and `di-router --test-backend`. Prefix: tb_.
 *
 * Token i of a request is tb_token(seed, prompt, i): a function of the seed, the prompt ids and
 * i only, in [first_id, first_id + span); its logprob is -(i + 1) / 1024 and its k-th alternative
 * has id + k + 1 with logprob -(i + k + 2) / 1024. One thread per request.
 */
#ifndef DI_ROUTER_TESTBACKEND_H
#define DI_ROUTER_TESTBACKEND_H

#include <stdint.h>

#include "router/backend.h"

typedef struct tb_config {
    uint32_t delay_ms;       /* sleep before each token */
    int32_t first_id;        /* token ids start here */
    int32_t span;            /* and cover this many ids, >= 1 */
    int32_t eos_id;          /* id reported as EOS */
    int32_t eos_at;          /* output index at which EOS comes (-1: never) */
    int32_t fail_at;         /* output index at which the request fails (-1: never) */
    int refuse;              /* generate fails with DI_EUNAVAIL */
    uint32_t cached_tokens;  /* reported as served from the store (at most the prompt) */
} tb_config;

typedef struct tb_backend tb_backend;

/* Returns DI_OK with *out, or DI_EINVAL (span < 1) / DI_ENOMEM. */
di_status tb_new(const tb_config *cfg, tb_backend **out, di_error *err);
/* Aborts every request in flight and waits for their threads. NULL-safe. */
void tb_free(tb_backend *b);
/* The backend interface over b. */
rt_backend tb_backend_iface(tb_backend *b);
/* Token i of a request (see above). */
int32_t tb_token(const tb_config *cfg, uint64_t seed, const int32_t *prompt, size_t n, uint32_t i);
/* Counters for tests: requests started, aborts seen by a running request, running now. */
void tb_counts(tb_backend *b, uint64_t *started, uint64_t *aborted, uint64_t *running);

#endif
