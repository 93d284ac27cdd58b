/* pd_backend.h: the backend (router/backend.h) over di-prefill and di-decode
 * (common/net/proto/prefill.proto and decode.proto). Prefix: pd_.
 *
 * One thread per request:
 *   1. cached tokens: with a KV store, the prompt's block chain keys (common/kvfmt/kv_keys.h,
 *      with the store's model id and block size) are looked up (kvc_lookup); the hit blocks
 *      times the block size are the cached tokens placement counts as loaded, not computed.
 *      Without a store, or when the lookup fails, 0.
 *   2. Prefill on the rank placement picks (router/ranks.h), under --prefill-timeout. A
 *      failure before the first token (any status but a cancel) is retried once on another
 *      rank; the failed rank's call counts against its health.
 *   3. The first token is relayed; unless it ended the request, Decode streams on the decode
 *      rank placement picks (with the blocks prompt + max_tokens need), under
 *      --decode-timeout, and every token is relayed as it arrives.
 *   4. A decode rank that fails, dies or preempts the request mid-stream: when the store holds
 *      the prompt's first block at least and another decode rank can take the request, the
 *      prompt plus the tokens relayed so far is prefilled again (request id + "-cN") and
 *      decoded there for the rest of max_tokens with the same seed; on_continue says so
 *      (at most twice a request). Otherwise the request ends with an error
 *      that says why it was not continued.
 * A request that ends aborted or failed (or was continued) has the handoff objects of its ids
 * deleted from the store afterwards (one no decode rank took would stay until its TTL).
 * abort cancels the call in flight at once (the rank's cancel function runs, which aborts the
 * request there) and the request ends with RT_FINISH_ABORT. FINISH_STOP (EOS or a stop id) is
 * reported as RT_FINISH_EOS without the token.
 */
#ifndef DI_ROUTER_PD_BACKEND_H
#define DI_ROUTER_PD_BACKEND_H

#include <stdint.h>

#include "common/net/kv_client.h"
#include "common/util/log.h"
#include "router/backend.h"
#include "router/ranks.h"

typedef struct pd_config {
    rk_table *ranks;              /* placement and channels; outlives the backend */
    kvc_client *store;            /* KV store for cached-prefix lookups; NULL: none. Used by
                                     one request at a time (a lock); outlives the backend */
    uint32_t prefill_timeout_ms;  /* deadline of one Prefill call, >= 1 */
    uint32_t decode_timeout_ms;   /* deadline of the whole Decode stream, >= 1 */
    uint32_t block_tokens;        /* tokens per KV block for the decode reservation (128) */
    const di_logger *log;         /* failures at info, decisions at debug; may be NULL */
} pd_config;

typedef struct pd_backend pd_backend;

/* DI_OK with *out; DI_EINVAL (no ranks, a zero timeout or block size), DI_ENOMEM. */
di_status pd_new(const pd_config *cfg, pd_backend **out, di_error *err);
/* Aborts every request in flight and waits for them to end. NULL-safe. */
void pd_free(pd_backend *b);
rt_backend pd_backend_iface(pd_backend *b);
/* Requests started, prefill retries, requests running now (for tests). */
void pd_counts(pd_backend *b, uint64_t *started, uint64_t *retries, uint64_t *running);
/* Prompt tokens the store lookups found cached, summed over requests (for tests). */
uint64_t pd_store_hits(pd_backend *b);

#endif
