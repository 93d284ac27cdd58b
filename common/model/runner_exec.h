/* runner_exec.h: runs the engine's step plans on the forward pass and the sampler.
 *
 * For each plan (common/engine/scheduler.h) it does the fork copies, runs one forward step over
 * the plan's sequences, samples the rows the plan consumes, and fills one sched_seq_result per
 * entry:
 *  - a prompt chunk with `sample` (the final chunk): the last row's token (sampler case 0 at
 *    position seqlen_k);
 *  - a decode entry [t, d1 .. dk]: speculative verification of the k drafts against the rows'
 *    logits (sampler_verify: accepted drafts, then the resample or the bonus token); k is the
 *    plan's (seqlen_q - 1), so with MTP varlen an entry checks only the first k of its nextn
 *    drafts;
 *  - with teacher forcing, the forced continuation replaces sampling: drafts are accepted while
 *    they equal the forced tokens, and each produced token is the forced one;
 *  - then, when the model has draft stages and nextn > 0, new drafts from the position of the
 *    last accepted row (MODEL.md §2.11), sampled by the draft head with the draft stream, with
 *    the confidence head's cumulative chances (result draft_conf, for varlen).
 * It never frees or reuses KV: block and slot ids come from the plan.
 *
 * With `ahead` (an engine that schedules one step ahead), the rows of a decode entry that
 * continues the previous step are written by the backend's step_ahead op from that step's
 * outcome, checked against the plan, and the step runs on them. With `overlap` as well, a
 * decode step without drafts is issued before the previous step is collected
 * (runner_exec_issue): the host plans and issues step N+1 while the backend runs step N.
 *
 * Per request the executor keeps the tokens by position (the Engram lookback reads up to three
 * before a chunk), the sampling parameters, the draft head's logits of the pending drafts (the
 * verifier needs the draft distribution) and the sampler results of the latest step.
 */
#ifndef DI_MODEL_RUNNER_EXEC_H
#define DI_MODEL_RUNNER_EXEC_H

#include <stdbool.h>
#include <stdint.h>

#include "common/engine/engine.h"
#include "common/engine/scheduler.h"
#include "common/model/forward.h"
#include "common/model/runner.h"
#include "common/sampling/sampler.h"

typedef struct runner_exec runner_exec;

/* Called once for every produced token with the raw fp32 logits of the row that made it (the
 * row at `position`, whose token is the next one), before any sampling step. */
typedef void (*runner_logits_fn)(void *userdata, uint64_t request_id, int64_t position,
                                 const float *logits, uint32_t vocab);

/* Loads the KV a plan entry brings from the store (sched_seq_plan.n_load, load_window) into
 * its blocks and state slot; called after the plan's copies and before its forward. A failure
 * fails the step. */
typedef di_status (*runner_load_fn)(void *userdata, fwd_kv *kv, const sched_seq_plan *entry,
                                    di_error *err);

typedef struct runner_exec_options {
    fwd_options fwd;          /* nextn, max_rows, YOCO, dump hook; the token map is taken from
                                 the runner_model */
    uint32_t n_blocks;        /* KV blocks (the scheduler's num_blocks) */
    uint32_t n_slots;         /* state slots (the scheduler's num_slots) */
    runner_logits_fn on_logits; /* may be NULL */
    void *logits_userdata;
    runner_load_fn on_load;   /* NULL: plans that load KV are refused (DI_EUNSUPPORTED) */
    void *load_userdata;
    int host_sampling;        /* 1: always copy the logits to the host and sample there. 0: a
                                 step whose every sampled entry draws one fresh row (a prompt's
                                 last row or a decode row without drafts, no forced tokens, no
                                 on_logits) samples with the backend's `sample` entry when it
                                 has one, and the logits stay in its memory; same results
                                 (sampler_backend.h) */
    int pad_steps;            /* decode plans run on their recorded graph size
                                 (sched_plan.graph_rows), the plan's padding_rows as
                                 placeholder rows (fwd_seq.placeholder): 0 = when the backend
                                 keeps graphs (kern_backend.graphs), 1 = always, -1 = never.
                                 Same results either way; a step that would exceed max_rows
                                 runs unpadded */
    int ahead;                /* 1: the rows of a decode entry that continues the previous
                                 step (sched_seq_plan.tokens_from_prev, an engine with
                                 sched_config.async) are written by the backend's step_ahead
                                 op from that step's outcome (its accepted tokens and new
                                 drafts), on backend memory, and the step runs on them; the
                                 op's rows, positions and key lengths must be the plan's (the
                                 scheduler's host fix-up): a difference fails the step
                                 (DI_EINTERNAL). Same results as 0; needs the backend's
                                 step_ahead entry (DI_EUNSUPPORTED at create) */
    int overlap;              /* 1 (needs ahead): a decode step whose entries have no drafts
                                 (nextn 0), no forced tokens and no KV to load is issued
                                 before the previous step is collected (runner_exec_issue
                                 with ahead): its continuing rows are the op's from the
                                 previous step's sampled tokens in backend memory, the
                                 forward reads its ids there, the sampler's outcomes stay
                                 there until collect; the host fix-up must equal the op's
                                 rows, checked at collect (DI_EINTERNAL). Same results as 0 */
} runner_exec_options;

/* What the executor counted. */
typedef struct runner_exec_stats {
    uint64_t steps;           /* steps run (placeholder plans not counted) */
    uint64_t ahead_steps;     /* steps with rows written by the step_ahead op */
    uint64_t ahead_entries;   /* plan entries whose rows the op wrote */
    uint64_t overlap_steps;   /* steps issued before the previous one was collected */
} runner_exec_stats;

/* What the executor must know of a request before its first plan. */
typedef struct runner_request {
    uint64_t id;
    const int32_t *prompt;    /* copied */
    uint32_t prompt_len;
    uint32_t max_tokens;      /* sizes the token record: prompt_len + max_tokens positions */
    sampling_params params;   /* copied (a blacklist must outlive the request) */
    const int32_t *forced;    /* teacher-forced continuation (copied); NULL = sample */
    uint32_t n_forced;
    const uint8_t *state;     /* executor state a handoff carries (runner_exec_export_state):
                                 the request continues where that executor left it; NULL =
                                 a new request */
    uint32_t state_bytes;
} runner_request;

/* The outcome of one produced token, for logprobs. */
typedef struct runner_token {
    int32_t token;
    sampler_result res;       /* logprob and top logprobs (processed distribution) */
} runner_token;

/* Creates the forward model, run scratch, KV storage and sampler workspace. DI_EINVAL,
 * DI_ERANGE (the host logits or scratch of steps of max_rows rows exceed physical memory,
 * checked before allocating), DI_ENOMEM, or the forward's codes. rm and be must outlive the
 * executor. */
di_status runner_exec_create(const runner_model *rm, const kern_backend *be,
                             const runner_exec_options *opt, runner_exec **out, di_error *err);
void runner_exec_free(runner_exec *ex); /* NULL-safe */

/* Registers a request (validates its parameters against the vocabulary). DI_EINVAL,
 * DI_EEXIST, DI_ENOMEM. */
di_status runner_exec_add(runner_exec *ex, const runner_request *req, di_error *err);
/* Forgets a request (after its final output). Unknown ids are ignored. */
void runner_exec_remove(runner_exec *ex, uint64_t id);

/* Runs a plan; results[i] is filled for plan->seqs[i]. A request whose sampling fails gets
 * SCHED_RESULT_FAILED (the others go on); DI_OK then. Returns a failure only when the step
 * itself cannot run (the forward's codes), with results untouched. */
di_status runner_exec_step(runner_exec *ex, const sched_plan *plan, sched_seq_result *results,
                           di_error *err);

/* The step split in two (engine_executor.issue and .collect): issue enqueues the plan's step
 * on the backend and returns, collect waits for it and fills results as runner_exec_step
 * does; runner_exec_step is issue then collect. A step that cannot be split (drafts, forced
 * tokens, logits to the host, a backend without a sampler...) runs whole in issue and collect
 * only hands its results over. With `ahead` the previous plan is issued and not collected:
 * the plan is issued only when it qualifies for the overlap (options.overlap), *issued says
 * whether it was; otherwise the caller collects the previous plan, fixes this one up
 * (sched_plan_fixup) and issues it again without `ahead`. At most two plans are in flight;
 * they are collected in the order they were issued. A request's per-step state
 * (runner_exec_tokens, _drafts, _error) changes at collect, so outputs of step N read after
 * N+1 was issued are N's. DI_ESTATE for a plan issued twice, collected before it was issued
 * or out of order, or a third in flight; the step's failures as runner_exec_step's (a failed
 * issue leaves nothing in flight); collect's cross-check of the op's rows: DI_EINTERNAL. */
di_status runner_exec_issue(runner_exec *ex, const sched_plan *plan, bool ahead, bool *issued,
                            di_error *err);
di_status runner_exec_collect(runner_exec *ex, const sched_plan *plan,
                              sched_seq_result *results, di_error *err);

/* The tokens request `id` produced in the latest step that sampled it, with their sampler
 * results; *n = 0 when none. The array stays valid until the next step. */
const runner_token *runner_exec_tokens(const runner_exec *ex, uint64_t id, uint32_t *n);
/* Bytes of a request's executor state: tokens produced, pending drafts and the draft
 * head's logits of them (what runner_request.state takes). */
size_t runner_exec_state_bytes(const runner_exec *ex);
/* Writes request id's executor state into dst (cap >= runner_exec_state_bytes); *n = bytes
 * written. DI_OK; DI_ENOENT (unknown id); DI_EINVAL (cap). */
di_status runner_exec_export_state(const runner_exec *ex, uint64_t id, void *dst, size_t cap,
                                   size_t *n, di_error *err);
/* The request's pending drafts (*n of them; NULL when unknown). Valid until its next step. */
const int32_t *runner_exec_drafts(const runner_exec *ex, uint64_t id, uint32_t *n);

/* The failure message of the request's latest failed step ("" when none). */
const char *runner_exec_error(const runner_exec *ex, uint64_t id);

/* The executor behind the engine loop (engine.h): add takes the request's runner_request as
 * engine_add's exec_args (its id and prompt must be the request's; DI_EINVAL when missing or
 * different), remove is runner_exec_remove, step is runner_exec_step. ex must outlive the
 * engine. */
engine_executor runner_exec_executor(runner_exec *ex);

const fwd_model *runner_exec_model(const runner_exec *ex);
const runner_exec_stats *runner_exec_get_stats(const runner_exec *ex);
/* The KV storage the plans' block and slot ids address (for exporting KV to the store). */
fwd_kv *runner_exec_kv(const runner_exec *ex);

/* Times one decode-shaped step of `rows` rows (MTP varlen's step-time table): ceil(rows /
 * (1 + nextn)) sequences of 1 + nextn rows (the last one shorter) at positions 0.., with the
 * logits of every row, on a scratch KV of their own (the executor's KV and requests are not
 * touched). *ms is the fastest of `reps` runs after one warm-up (wall clock). DI_EINVAL (rows
 * 0 or above max_rows, reps 0), DI_ENOMEM, or the forward's codes; *ms untouched then. */
di_status runner_exec_time_step(runner_exec *ex, uint32_t rows, uint32_t reps, double *ms,
                                di_error *err);

#endif
