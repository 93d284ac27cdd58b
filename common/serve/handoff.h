/* handoff.h: a request moved from a PROMPT engine (prefill) to a COMPLETION engine (decode)
 * through the handoff object (common/kvfmt/kv_handoff.h) and the store's full blocks.
 *
 * Export side (the request ended with finish "handoff" and still holds its blocks and slot):
 *   handoff_export     the handoff object: tokens, chain keys of the full blocks, the partial
 *                      last block's payload, the whole state slot, the pending drafts and the
 *                      executor state (runner_exec_export_state)
 *   handoff_block      one full block as the store object under its chain key (kv_io.h)
 * then engine_release.
 *
 * Import side:
 *   handoff_requests   the sched_request and runner_request that continue it: prompt, the
 *                      tokens generated so far as output, every position but the newest one's
 *                      KV cached with its window state, held until the blocks are in, the
 *                      pending drafts, the executor state
 *   handoff_load       inside the executor's load hook (runner_exec_options.on_load): the full
 *                      blocks (verified against their chain keys), the partial block and the
 *                      whole slot into the blocks and slot the scheduler chose.
 * Nothing is replayed: decode continues exactly where prefill stopped, so a handed-off request
 * gives the tokens and logprobs of a NORMAL run bit for bit.
 */
#ifndef DI_SERVE_HANDOFF_H
#define DI_SERVE_HANDOFF_H

#include <stddef.h>
#include <stdint.h>

#include "common/engine/engine.h"
#include "common/kvfmt/kv_handoff.h"
#include "common/model/runner_exec.h"
#include "common/model/state.h"
#include "common/util/status.h"

/* Bytes of the largest handoff object of a request of `tokens` tokens on this executor. */
size_t handoff_max_bytes(const runner_exec *ex, uint32_t tokens);

/* Writes the handoff of request id (finished with a handoff in e, run by ex) under key into
 * dst (cap >= handoff_max_bytes); *bytes = its size, *n_full (optional) = its full blocks.
 * DI_OK; DI_ENOENT (not live); DI_ESTATE (not finished with a handoff); DI_EINVAL (cap);
 * DI_ENOMEM. */
di_status handoff_export(engine *e, runner_exec *ex, uint64_t id, const uint8_t key[32],
                         void *dst, size_t cap, size_t *bytes, uint32_t *n_full, di_error *err);

/* Writes full block i (positions [128 i, 128 i + 128)) of the handed-off request id as the
 * store object under its chain key h->block_keys[i] (dst: kv_block_bytes). DI_OK; DI_ENOENT;
 * DI_EINVAL (i beyond its full blocks, cap). */
di_status handoff_block(engine *e, runner_exec *ex, uint64_t id, const kv_handoff *h,
                        uint32_t i, void *dst, size_t cap, di_error *err);

/* Fills *sr and *rq (request id, the handoff's tokens, drafts and executor state; every other
 * field zero) so that engine_add continues the request; the caller sets max_tokens (counting
 * the tokens already generated), ignore_eos, stop ids and rq->params. Pointers point into h. */
void handoff_requests(const kv_handoff *h, uint64_t id, sched_request *sr, runner_request *rq);

/* Imports a handoff into the blocks and slot of plan entry p (its first plan: n_load =
 * h->kv_positions and load_window): full block i from blocks[i] (bytes[i] long, checked
 * against h->block_keys[i]), the partial block and the whole slot from h. DI_OK; DI_EINVAL (an
 * entry that does not load exactly this handoff); DI_ECORRUPT (a block that is not the one
 * named). */
di_status handoff_load(fwd_kv *kv, const sched_seq_plan *p, const kv_handoff *h,
                       const void *const *blocks, const size_t *bytes, di_error *err);

#endif
