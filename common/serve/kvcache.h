/* kvcache.h: an engine's KV cache in the store: prefix hits, loads and stores of blocks and
 * window states, every store call on the transfer thread (transfer.h). di-generate --kvstore,
 * di-prefill and di-decode use it; the engine thread drives it.
 *
 * Admission (kvcache_admit, before the request enters the engine): the chain keys of the
 * prompt's full blocks; then, as one job on the transfer thread, a lookup, the prefix-hit rule
 * (prefix.h, with the cap prompt_len - always_compute) and a get of the hit's blocks and window
 * state into host buffers, each object verified by the client and checked against what the
 * request expects (kv_io.h: key, positions, model); an unusable object shrinks the hit (the
 * rule runs again) and a sound object stored under the wrong key is deleted. The request waits
 * outside the engine while this runs (the hit is only known then), so no step waits for it;
 * kvcache_poll then says KVCACHE_ADMIT with what was obtained (kv_cached, replay,
 * window_cached), and the embedder adds the request with those. A failed lookup or get (store
 * down, deadline) is no failure: the event comes with no hit, and the request computes its
 * whole prompt. While the store backs off after a failure, admissions do not wait for it.
 *   Default: the hit resumes exactly where a window state exists (the newest one at or below
 *   the block hit, else no hit). allow_replay lets the rule replay 128 tokens with clipped
 *   windows when the window state is missing: not exact, so such a request stores nothing.
 * Load (kvcache_load, the executor's loader, before the forward of the request's first chunk):
 *   the buffers into the request's own blocks and state slot (kv_io imports).
 * After each step's forward (kvcache_after_step): the window state is copied at each wanted
 *   multiple of 128 the request just reached (prompts must be cut at multiples of 128:
 *   sched_config.max_chunk_tokens = 128; a decode step overshoots by at most nextn); when the
 *   prompt's last chunk ran, its new full blocks (read from the request's blocks, which it still
 *   holds) and those window states go to the store as one store job. Blocks the response fills
 *   are copied as they fill; at the request's end (kvcache_finished) they go with the window
 *   state at the last multiple of 128 it reached as one store job. The step never waits for a
 *   store: the copies are in host memory, the job runs on the transfer thread.
 * Window states kept: where a rerun of the same prompt resumes, at the last multiple of 128 of
 *   the prompt and of the response, and every Nth multiple with window_every.
 * Requests continued from a handoff (di-decode) are registered with kvcache_track: they load
 *   nothing here; the blocks their response fills and their last window state are stored.
 *
 * Failures: a store job that fails is retried after the transfer thread's back-off (max_attempts
 * calls), then dropped with one warning; warnings are rate-limited (one line per
 * warn_interval_ns, counting the lines left out). Only the request the job belongs to is
 * touched, and the store is never given up: the next job after the back-off calls it again.
 * A store whose model or formats differ (kvcache_check) is refused for good: that is no failure
 * to recover from.
 *
 * The embedder's own store calls (di-prefill's handoff, di-decode's pull and delete) run on the
 * same threads through kvcache_call, in submission order with the cache's jobs of their kind:
 * the blocks of a prompt are stored before a handoff submitted after them. With a load client,
 * loads run on a second transfer thread (each thread has its own back-off).
 *
 * Request records are keyed by the engine's request id; a record lives until the request is
 * finished or forgotten and its jobs have completed. Thread safety: every function from the
 * embedder's engine thread; the store's calls run on the transfer thread only.
 */
#ifndef DI_SERVE_KVCACHE_H
#define DI_SERVE_KVCACHE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/engine/scheduler.h"
#include "common/model/state.h"
#include "common/net/kv_client.h"
#include "common/serve/transfer.h"
#include "common/util/log.h"
#include "common/util/status.h"

typedef struct kvcache kvcache;

typedef struct kvcache_options {
    kvc_client *client;        /* the store; borrowed; called on the transfer thread only */
    kvc_client *load_client;   /* optional, borrowed: loads (admissions, XFER_LOAD calls) get a
                                  transfer thread and client of their own, so that they never
                                  wait behind stores; NULL: one thread for both */
    const char *target;        /* HOST:PORT for the lines ("KV store at ..."); may be NULL */
    bool allow_replay;         /* a missing window state may cost a 128-token replay */
    uint32_t window_every;     /* also keep the window state at every Nth multiple of 128; 0 off */
    uint32_t always_compute;   /* positions at the prompt's end prefill always computes:
                                  max(ring_positions, YOCO keep_tokens); >= 1 */
    bool store_prompt;         /* store a prompt's new full blocks and window states */
    bool store_response;       /* store the blocks a response fills and its last window state */
    uint32_t max_jobs;         /* transfer jobs not yet polled; 0 = 4096 */
    uint32_t max_attempts;     /* calls per store job; 0 = 3 */
    uint64_t backoff_ns;       /* first back-off after a failed call; 0 = 100 ms */
    uint64_t max_backoff_ns;   /* longest back-off; 0 = 2 s */
    uint64_t warn_interval_ns; /* at most one warning line per interval; 0 = 10 s */
    const di_logger *log;      /* warnings (WARN) and per-request lines (INFO); may be NULL */
    void (*notify)(void *ud);  /* optional: a job finished (transfer thread; poll soon) */
    void *notify_ud;
} kvcache_options;

typedef enum kvcache_event_kind {
    KVCACHE_ADMIT = 0,         /* kvcache_admit finished: add the request with the hit */
    KVCACHE_CALL,              /* a kvcache_call finished */
} kvcache_event_kind;

typedef struct kvcache_event {
    kvcache_event_kind kind;
    uint64_t id;               /* the request */
    void *user;                /* as given to kvcache_admit / kvcache_call */
    di_status status;          /* ADMIT: DI_OK; CALL: the call's (DI_ECANCELED when canceled) */
    di_error err;              /* its message */
    uint32_t kv_cached;        /* ADMIT: sched_request.kv_cached */
    uint32_t replay;           /* ADMIT: sched_request.replay */
    bool window_cached;        /* ADMIT: sched_request.window_cached */
} kvcache_event;

/* What the store did so far. */
typedef struct kvcache_stats {
    uint64_t admitted;          /* admissions completed */
    uint64_t hit_tokens;        /* prompt positions whose KV came from the store, replay excluded */
    uint64_t replay_tokens;     /* positions recomputed by replays */
    uint64_t blocks_loaded, windows_loaded;
    uint64_t blocks_stored, windows_stored; /* acknowledged puts (already stored included) */
    uint64_t errors;            /* failed jobs and unusable objects */
    uint64_t load_failures;     /* admissions that got no hit because a store call failed */
    uint64_t store_failures;    /* store jobs dropped after their attempts */
    uint64_t retries;           /* store calls after a failed one (transfer thread) */
    bool refused;               /* kvcache_check refused the store: it is not used */
} kvcache_stats;

/* Creates the cache and its transfer thread for KV of geometry g. DI_OK; DI_EINVAL (options);
 * DI_ENOMEM; DI_EINTERNAL (thread). *out set only on DI_OK. */
di_status kvcache_create(const kvcache_options *o, const kv_geometry *g, kvcache **out,
                         di_error *err);
/* Cancels the queued jobs, waits for a running one and frees everything (events not polled
 * are dropped; kvcache_call contexts of canceled jobs are not freed: poll first). NULL-safe. */
void kvcache_destroy(kvcache *k);

/* Asks the store once (on the calling thread, before any job) whether it keeps KV of this
 * geometry (model id, object sizes, ring size). DI_OK; DI_EINVAL (another model or format:
 * the cache is refused for good, every admission gets no hit, nothing is stored; the caller
 * says so); the call's failure (DI_EUNAVAIL, DI_ETIMEDOUT, ...: one rate-limited warning, and
 * the cache goes on and tries the store later). */
di_status kvcache_check(kvcache *k, di_error *err);

/* Starts the admission of request id (prompt[0 .. len), at most max_tokens output tokens):
 * exactly one KVCACHE_ADMIT event follows unless it is forgotten first. DI_OK; DI_EINVAL (id
 * 0, empty prompt); DI_EEXIST (id live); DI_ENOMEM. */
di_status kvcache_admit(kvcache *k, uint64_t id, const int32_t *prompt, uint32_t len,
                        uint32_t max_tokens, void *user, di_error *err);

/* Registers request id continued from a handoff: tokens[0 .. n) are prompt and output so far,
 * whose full blocks and window states are in the store already; its response's blocks are
 * stored as they fill (store_response). DI_OK; DI_EINVAL; DI_EEXIST; DI_ENOMEM. */
di_status kvcache_track(kvcache *k, uint64_t id, const int32_t *tokens, uint32_t n,
                        uint32_t max_tokens, di_error *err);

/* runner_load_fn (userdata = the kvcache): imports the fetched objects into the entry's blocks
 * and slot. DI_EINTERNAL when the plan asks for other KV than was fetched. */
di_status kvcache_load(void *userdata, fwd_kv *kv, const sched_seq_plan *entry, di_error *err);

/* Whether request id was admitted with objects to load (kvcache_load must run for it). */
bool kvcache_has_load(const kvcache *k, uint64_t id);

/* After a step's forward and before its outputs are processed: copies what the step completed
 * and submits the store job of a finished prompt. results[i] belongs to plan->seqs[i]. DI_OK;
 * DI_EINTERNAL (a position beyond the request's record); DI_ENOMEM. Store failures are not
 * returned (see above). */
di_status kvcache_after_step(kvcache *k, fwd_kv *kv, const sched_plan *plan,
                             const sched_seq_result *results, di_error *err);

/* The request ended with finish f: what its response completed goes to the store (not after
 * FAILED or ABORT), and the request is forgotten. Unknown ids are ignored. */
void kvcache_finished(kvcache *k, uint64_t id, sched_finish f);

/* Forgets request id (aborted, or never added): its queued jobs are canceled, its copies
 * dropped, no admission event of it follows (kvcache_call events do). Unknown ids are ignored. */
void kvcache_forget(kvcache *k, uint64_t id);

/* An embedder's store call, run as a job on the transfer thread: fn(ctx, client, err) returns
 * DI_OK or the failure (retried after the back-off while o->max_attempts allow). Exactly one
 * KVCACHE_CALL event follows, with user, including after kvcache_forget of id (DI_ECANCELED
 * when it had not started). DI_OK; DI_EFULL; DI_ENOMEM; DI_EINVAL. */
typedef di_status (*kvcache_call_fn)(void *ctx, kvc_client *c, di_error *err);
di_status kvcache_call(kvcache *k, xfer_kind kind, uint64_t id, kvcache_call_fn fn, void *ctx,
                       void *user, const xfer_job_opts *o, di_error *err);

/* Takes up to max finished events (oldest first); never blocks. Returns how many. */
size_t kvcache_poll(kvcache *k, kvcache_event *out, size_t max);

/* Waits until every job submitted so far has finished or timeout_ns passes (then poll).
 * DI_OK; DI_ETIMEDOUT. */
di_status kvcache_wait(kvcache *k, uint64_t timeout_ns, di_error *err);

/* Jobs submitted and not yet polled. */
uint32_t kvcache_pending(const kvcache *k);
/* Requests with a record (live, or waiting for their jobs). */
uint32_t kvcache_records(const kvcache *k);

kvcache_stats kvcache_get_stats(const kvcache *k); /* NULL-safe (zeros) */

#endif
