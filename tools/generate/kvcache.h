/* kvcache.h: di-generate with a KV store (--kvstore): the engine's KV cache of
 * common/serve/kvcache.h (prefix hits, loads, window states at multiples of 128, block copies
 * as they fill, puts; every store call on its transfer thread) as an offline run uses it.
 *
 * The prompts are admitted before the first step (gen_kv_admit each, then gen_kv_collect: the
 * lookups and reads run on the transfer thread, the run waits for them once); each enters the
 * engine with kv_cached / replay / window_cached for what was obtained (gen_kv_hit). The store
 * jobs of what the steps compute run while the engine goes on; gen_kv_drain waits for them at
 * the end, so the JSON stats count them all.
 *
 * Failures of the store never fail a generation: a failed call prints one warning (at most
 * one line per 10 s), the request it belongs to goes without the hit or its KV is not stored,
 * and the store is tried again after a back-off. A store that keeps another model's KV is not
 * used at all (one warning). An unusable object prints one line ("ignoring it") and is computed.
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
    uint64_t load_failures;    /* prompts that got no hit because a store call failed */
    uint64_t store_failures;   /* store jobs dropped after their attempts */
    uint64_t retries;          /* store calls after a failed one */
    bool refused;              /* the store keeps another model's KV: not used */
} gen_kv_stats;

/* Opens the client and checks that the store keeps KV of geometry g (model id, object sizes,
 * ring size). A store of another model is not an error: one warning, and the returned handle
 * does nothing; a store that is down: one warning, and it is tried again later. DI_OK;
 * DI_EINVAL (options); DI_ENOMEM; DI_EUNSUPPORTED in a build without the services. *out set
 * only on DI_OK. */
di_status gen_kv_open(const gen_kv_options *o, const kv_geometry *g, gen_kv **out,
                      di_error *err);
/* Waits for the store jobs still out (bounded), then frees everything. NULL-safe. */
void gen_kv_close(gen_kv *k);

/* Starts the admission of request `id` (prompt[0 .. len)). DI_OK; DI_EINVAL (unknown id or
 * admitted twice); DI_ENOMEM. */
di_status gen_kv_admit(gen_kv *k, uint64_t id, const int32_t *prompt, uint32_t len,
                       di_error *err);
/* Waits until every admission started has completed. DI_OK; DI_ETIMEDOUT. */
di_status gen_kv_collect(gen_kv *k, di_error *err);
/* Sets sr's kv_cached, replay and window_cached from the completed admission of sr->id. */
void gen_kv_hit(const gen_kv *k, sched_request *sr);

/* runner_load_fn: imports the fetched objects into the entry's blocks and slot. DI_EINTERNAL
 * when the plan asks for other KV than was fetched. */
di_status gen_kv_load(void *userdata, fwd_kv *kv, const sched_seq_plan *entry, di_error *err);

/* After a step's forward and before its outputs are processed: copies what the step completed
 * and submits the store job of a finished prompt. results[i] belongs to plan->seqs[i]. DI_OK;
 * DI_ENOMEM. Store failures are logged, never returned. */
di_status gen_kv_after_step(gen_kv *k, fwd_kv *kv, const sched_plan *plan,
                            const sched_seq_result *results, di_error *err);

/* The request ended (finish reason f): stores what its response completed and forgets it. */
void gen_kv_finished(gen_kv *k, uint64_t id, sched_finish f);

/* Waits for the store jobs still out (bounded by their deadlines and back-offs). */
void gen_kv_drain(gen_kv *k);

/* Store activity so far; NULL-safe (zeros). */
gen_kv_stats gen_kv_get_stats(const gen_kv *k);

#endif
