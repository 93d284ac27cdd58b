/* kvcache.h: di-generate with a KV store (--kvstore), as a prefill engine uses it.
 *
 * Admission (before a prompt enters the scheduler): the chain keys of its full blocks, a lookup,
 * the prefix-hit rule (prefix.h, with the cap prompt_len - max(ring, YOCO keep window)), then a
 * get of the hit's blocks and window state into host buffers, each object verified by the client
 * and checked against what the request expects (kv_io.h: key, positions, model). The request
 * enters with kv_cached / replay / window_cached for what was actually obtained; a failed get
 * shrinks the hit (the rule runs again) instead of failing anything.
 *   Default: the hit resumes exactly where a window state exists (the newest one at or below
 *   the block hit, else no hit). --kvstore-replay lets the rule replay 128 tokens with clipped
 *   windows when the window state is missing (explainer, "A prefix hit with a missing window"):
 *   128 tokens cheaper than backing off further, but those rows see no window below the replay
 *   start in any layer and rewrite the compressed entries of the block before the hit, so the
 *   logits differ from a full prefill; such a request writes nothing to the store.
 * Load (the executor's loader, before the forward of the request's first chunk): the buffers
 * into the request's own blocks and state slot (kv_io imports; a replay zeroes the slot).
 * After each step's forward: the window state is copied at each wanted multiple of 128 the
 * request just reached (the ring still holds it: chunks end on block boundaries, a decode step
 * overshoots by at most nextn); when the prompt's last chunk ran, every new full block of the
 * prompt (read from the request's blocks, which it still holds) and those window states go to
 * the store in one put, acknowledged before the next step. Blocks the response fills are copied
 * as they fill; at the request's end they go with the window state at the last multiple of 128
 * it reached in one put.
 * Window states kept: at the point a rerun of the same prompt resumes from, at the last multiple
 * of 128 of the prompt and of the response, and every Nth multiple with --kvstore-window-every.
 *
 * Failures of the store never fail a generation: the first failed call (store down, deadline,
 * refused) prints one line ("..., ignoring the KV store for the rest of this run") and the run
 * goes on without it; an unusable object prints one line ("ignoring it") and is computed.
 */
#ifndef DI_TOOLS_GENERATE_KVCACHE_H
#define DI_TOOLS_GENERATE_KVCACHE_H

#include <stdbool.h>
#include <stdint.h>

#include "common/engine/scheduler.h"
#include "common/model/state.h"
#include "common/util/log.h"
#include "common/util/status.h"

typedef struct gen_kv gen_kv;

/* Whether this build has the store client (the services are built). */
bool gen_kv_supported(void);

typedef struct gen_kv_options {
    const char *target;        /* HOST:PORT of di-kvstore */
    const char *token;         /* engine token; NULL when the store has none */
    uint32_t deadline_ms;      /* per store call */
    const char *data_path;     /* "auto" (NULL), "ucx" or "grpc" (kvc_options.data_path) */
    bool allow_replay;         /* --kvstore-replay */
    uint32_t window_every;     /* also keep the window state at every Nth multiple of 128; 0 off */
    uint32_t always_compute;   /* positions at the prompt's end prefill always computes:
                                  max(ring_positions, YOCO keep_tokens) */
    uint32_t n_requests;       /* request ids are 1 .. n_requests */
    uint32_t max_tokens;       /* output limit per request (sizes the token record) */
    const di_logger *log;      /* warnings (WARN) and per-prompt lines (INFO) */
} gen_kv_options;

/* What the store did for the run (the JSON "kvstore" stats). */
typedef struct gen_kv_stats {
    uint64_t hit_tokens;       /* prompt positions whose KV came from the store, replay excluded */
    uint64_t replay_tokens;    /* positions recomputed by replays */
    uint64_t blocks_loaded, windows_loaded;
    uint64_t blocks_stored, windows_stored; /* acknowledged puts (already stored included) */
    uint64_t errors;           /* failed calls and unusable objects */
    bool disabled;             /* the store was given up during the run */
} gen_kv_stats;

/* Opens the client and checks that the store keeps KV of geometry g (model id, object sizes,
 * ring size). A store that is down or of another model is not an error: one warning, and the
 * returned handle does nothing. DI_OK; DI_EINVAL (options); DI_ENOMEM; DI_EUNSUPPORTED in a
 * build without the services. *out set only on DI_OK. */
di_status gen_kv_open(const gen_kv_options *o, const kv_geometry *g, gen_kv **out,
                      di_error *err);
void gen_kv_close(gen_kv *k); /* NULL-safe */

/* Decides and fetches the cached prefix of request `id` (prompt[0 .. len)) and sets sr's
 * kv_cached, replay and window_cached. DI_OK (also when the store fails: then nothing is
 * cached); DI_EINVAL (unknown id); DI_ENOMEM. */
di_status gen_kv_admit(gen_kv *k, uint64_t id, const int32_t *prompt, uint32_t len,
                       sched_request *sr, di_error *err);

/* runner_load_fn: imports the fetched objects into the entry's blocks and slot. DI_EINTERNAL
 * when the plan asks for other KV than was fetched. */
di_status gen_kv_load(void *userdata, fwd_kv *kv, const sched_seq_plan *entry, di_error *err);

/* After a step's forward and before its outputs are processed: copies what the step completed
 * and puts a finished prompt's KV. results[i] belongs to plan->seqs[i]. DI_OK; DI_ENOMEM.
 * Store failures are logged, never returned. */
di_status gen_kv_after_step(gen_kv *k, fwd_kv *kv, const sched_plan *plan,
                            const sched_seq_result *results, di_error *err);

/* The request ended (finish reason f): puts what its response completed and forgets it. */
void gen_kv_finished(gen_kv *k, uint64_t id, sched_finish f);

/* Store activity so far; NULL-safe (zeros). */
gen_kv_stats gen_kv_get_stats(const gen_kv *k);

#endif
