/* engine.h: the engine loop of one rank, as a library: add a request, abort it, step; outputs
 * come back through a callback. One loop for every embedder (di-generate, di-sim, the prefill
 * and decode services, the engine tests), synchronous or one step ahead (sched_config.async).
 *
 * The engine owns the scheduler (scheduler.h) and one request record per live request, keyed
 * by its id once; the scheduler's sequence holds the request's one token history. The model
 * is behind an executor (engine_executor): the model runner and di-sim's synthetic runner both
 * implement it. The engine tells the executor about a request before its first plan
 * (exec.add) and forgets it exactly once (exec.remove), after the last plan that may carry it
 * has been processed: at once in a synchronous engine, one step later when a finished request
 * rides the step already scheduled, or when an aborted request's step in flight is processed.
 *
 * ---- Request lifecycle ----
 *
 *   engine_add -> WAITING/RUNNING (scheduler) -> final output (stop, length, abort, failed,
 *   preempted, handoff) -> record RETIRING (executor state kept while a plan in flight may
 *   carry it) -> record freed (exec.remove called once)
 *
 * A PROMPT engine's FINISHED_HANDOFF request keeps its blocks and slot until engine_release
 * (or engine_abort, which releases it): the service exports the handoff first (DESIGN.md §3).
 *
 * ---- One step ----
 *
 *   sync:  schedule N -> exec.step N -> process N -> outputs of N
 *   async: schedule N+1 -> process N (outputs of N) -> fixup N+1 from N -> exec.step N+1;
 *          a plan with process_now is processed at once; engine_flush processes the plan
 *          still in flight when no work is left.
 *   async with exec.issue/collect: schedule N+1 -> issue N+1 ahead (when the executor can) ->
 *          collect N -> process N -> fixup N+1 from N -> issue N+1 (when it was not yet);
 *          step N+1 is collected at the next engine_step (or engine_flush), so the executor
 *          runs N+1 while the host collects and processes N.
 *
 * Thread safety: none; one engine per rank, driven by one thread. The callbacks run on that
 * thread, from inside engine_step / engine_abort / engine_flush; they must not call back into
 * the engine, except engine_release of the request whose handoff output it is (a service that
 * saved the KV at once).
 */
#ifndef DI_ENGINE_ENGINE_H
#define DI_ENGINE_ENGINE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/engine/scheduler.h"
#include "common/util/alloc.h"
#include "common/util/status.h"

typedef struct engine engine;

/* What runs the plans: the model runner, a synthetic runner, a test double. */
typedef struct engine_executor {
    void *ctx; /* passed to every call */
    /* Learns a request before its first plan; `args` is engine_add's executor argument (the
     * model runner: a runner_request). DI_OK or a code the engine returns from engine_add
     * (nothing is added then). NULL: nothing to do. */
    di_status (*add)(void *ctx, const sched_request *req, const void *args, di_error *err);
    /* Forgets a request: called exactly once for each request add accepted. NULL: nothing. */
    void (*remove)(void *ctx, uint64_t id);
    /* Runs a plan; results[i] for plan->seqs[i] (plan->n_seqs of them; a placeholder plan
     * still runs: results are then ignored). A request that fails alone gets
     * SCHED_RESULT_FAILED; a failure return fails the step (engine_step returns it). */
    di_status (*step)(void *ctx, const sched_plan *plan, sched_seq_result *results,
                      di_error *err);
    /* Optional, both or neither: step split in two, so that one step ahead (sched_config.async)
     * the executor may be given step N+1 before it hands over step N's results. issue starts
     * a plan and sets *issued; collect waits for it and fills its results (as step does).
     * With `ahead` step N is issued and not collected: the executor issues N+1 only when it
     * can without N's results on the host, else leaves *issued false and the engine collects
     * and processes N, fixes N+1 up and issues it again without `ahead` (which must issue).
     * Plans are collected in the order they were issued; a failure of either fails the step
     * as step's does. NULL: step. */
    di_status (*issue)(void *ctx, const sched_plan *plan, bool ahead, bool *issued,
                       di_error *err);
    di_status (*collect)(void *ctx, const sched_plan *plan, sched_seq_result *results,
                         di_error *err);
} engine_executor;

/* One output of one request, as the scheduler produced it. */
typedef struct engine_output {
    uint64_t request_id;
    void *user;                  /* the engine_add argument */
    const int32_t *tokens;       /* new tokens (valid during the callback) */
    uint32_t n_tokens;
    sched_finish finish;         /* NONE while the request goes on */
    uint32_t n_generated;        /* output tokens so far */
    const sched_plan *plan;      /* the plan that produced it; NULL for an abort's output */
    int32_t entry;               /* its index in plan->seqs, -1 when it has none (abort, or a
                                    preemption output) */
    const sched_seq_result *result; /* the executor's result for that entry, or NULL */
} engine_output;

typedef void (*engine_output_fn)(void *userdata, const engine_output *out);

typedef struct engine_config {
    sched_config sched;          /* the scheduler's config (async: one step ahead) */
    engine_executor exec;        /* step is required */
    engine_output_fn on_output;  /* every output; may be NULL */
    void *userdata;              /* passed to on_output */
    uint64_t (*clock_ns)(void);  /* clock for the scheduler's time (stats.sched_ns); NULL =
                                    not measured */
} engine_config;

typedef struct engine_stats {
    uint64_t steps;              /* plans run by the executor */
    uint64_t exec_added;         /* exec.add calls that succeeded */
    uint64_t exec_removed;       /* exec.remove calls */
    uint32_t live;               /* request records (added, not yet removed from the executor) */
    uint64_t sched_ns;           /* clock_ns time in schedule, process and fixup, in all */
    uint64_t last_sched_ns;      /* of that, in the latest engine_step / engine_flush */
    uint64_t issued_ahead;       /* plans issued before the previous one was collected */
} engine_stats;

/* Creates an engine (and its scheduler). DI_OK; DI_EINVAL (config, no exec.step); DI_ENOMEM.
 * *out untouched on failure. */
di_status engine_create(const engine_config *cfg, engine **out, di_error *err);
/* Removes every live request from the executor (once each), then frees the engine and its
 * scheduler. No output is produced. NULL-safe. */
void engine_destroy(engine *e);

/* Adds a request: exec.add (with exec_args), then the scheduler; `user` comes back with each of
 * its outputs. DI_OK; the scheduler's codes (DI_EINVAL, DI_EEXIST, DI_EFULL, DI_ENOMEM) or
 * exec.add's; on failure nothing is left behind (exec.remove is called when exec.add had
 * accepted it). */
di_status engine_add(engine *e, const sched_request *req, const void *exec_args, void *user,
                     di_error *err);

/* Aborts a request from any state (waiting, between chunks, running, in flight, finished and
 * held for handoff): its one final output (finish "abort") goes to on_output, unless it had
 * already ended with a handoff; blocks, slot and executor state are released exactly once
 * (after the plan in flight that carries it). DI_OK; DI_ENOENT (no live request has the id). */
di_status engine_abort(engine *e, uint64_t id, di_error *err);

/* Releases a FINISHED_HANDOFF request (PROMPT engine) once its KV has been exported. DI_OK;
 * DI_ENOENT; DI_ESTATE (not finished with a handoff). */
di_status engine_release(engine *e, uint64_t id, di_error *err);

/* Makes a request added with hold = true schedulable (its KV has arrived). DI_OK; DI_ENOENT;
 * DI_ESTATE. */
di_status engine_set_ready(engine *e, uint64_t id, di_error *err);

/* One step: schedule, run, process (see above). *ran (optional) is set when a plan was run.
 * DI_OK; the scheduler's or the executor's failure, with the engine unusable but still
 * destroyable. */
di_status engine_step(engine *e, bool *ran, di_error *err);

/* Processes the plan in flight (async), if any. DI_OK or the scheduler's failure. */
di_status engine_flush(engine *e, di_error *err);

/* Requests waiting or running (not counting a plan in flight or held handoffs). */
bool engine_has_work(const engine *e);
/* Runs engine_step until no work is left, then engine_flush; at most max_steps steps (0 = no
 * cap: DI_EINTERNAL beyond it). */
di_status engine_run(engine *e, uint64_t max_steps, di_error *err);

sched *engine_sched(const engine *e); /* the scheduler (inspection, votes) */
const engine_stats *engine_get_stats(const engine *e);

#endif
