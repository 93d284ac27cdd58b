/* scheduler.h: the scheduler of one DP rank (DESIGN.md §3; explainer Passes 2-3).
 *
 * Pure C, no I/O, no clock: a step takes the rank's queues and returns a step plan; the runner
 * executes it and hands back the step results; process_outputs turns them into request
 * outputs. Nothing is allocated per step (requests are allocated when they are added).
 *
 * ---- Usage (offline, one rank, synchronous) ----
 *
 *   sched_config cfg;
 *   sched_config_default(&cfg);            // then set num_blocks, num_slots, nextn, ...
 *   sched *s;
 *   sched_create(&cfg, &s, &err);
 *   sched_add_request(s, &(sched_request){.id = 1, .prompt = p, .prompt_len = n,
 *                                          .max_tokens = 256}, &err);
 *   while (sched_has_work(s)) {
 *       sched_plan *plan;
 *       sched_schedule(s, &plan, &err);    // the step: prefill chunks or decode rows
 *       run the model on plan->seqs[0 .. n_seqs)  ->  results[0 .. n_seqs)
 *       const sched_output *outs; size_t n;
 *       sched_process_outputs(s, plan, results, plan->n_seqs, &outs, &n, &err);
 *       for each outs[i]: stream outs[i].tokens; outs[i].finish != NONE ends the request
 *   }
 *   sched_destroy(s);
 * MTP varlen (off by default): set cfg.varlen, cfg.step_ms / n_step_ms (the measured time of
 * one step per recorded graph size) and cfg.sampler_ms; the runner returns each request's
 * cumulative draft confidences with its drafts (sched_seq_result.n_conf, draft_conf), and a
 * decode entry's seqlen_q - 1 is the number of drafts it checks (see "MTP varlen" below).
 * With the default vote intervals a NORMAL engine looks at waiting prompts only every 70
 * decode steps (the explainer's behaviour, and what a group of ranks needs); a single offline
 * rank that wants prompts started at once sets prefill_attempt_interval = 1.
 *
 * ---- Several ranks ----
 * Give each rank's scheduler a `vote` (vote.h) of the same group and drive every rank in
 * lockstep: `for (;;) { sched_group_has_work(s, &more); if (!more) break; schedule; run;
 * process; }`. A rank with nothing to do gets a placeholder plan (one fake row, block 0,
 * routes nowhere) and must still run it: the other ranks' MoE exchange waits for it.
 *
 * ---- One step ahead (cfg.async) ----
 * The runner schedules step N+1 before it processes step N, so the CPU work overlaps the
 * device. At most two plans are unprocessed; they are processed in order. For a sequence in
 * both, N+1's plan carries tokens_from_prev = 1: its row tokens and seqlen_k assume step N
 * accepted every draft; sched_plan_fixup() (or the device, from N's results) copies N's
 * sampled token and new drafts into N+1's rows and takes the rejected drafts off seqlen_k and
 * first_position. A plan with process_now (every prompt step) must be processed before the
 * next schedule: prompt steps drain the pipeline. A request that finishes in step N may ride
 * N+1; it produces nothing there, and its blocks and slot come back only after N+1 is
 * processed (deferred release), so a step in flight never sees its blocks reused. When no rank
 * has work left, process the plan still in flight (sched_has_work ignores it).
 *
 *   sched_plan *prev = NULL;  results_prev;
 *   while (sched_has_work(s) || prev) {
 *       sched_plan *plan = NULL;
 *       if (sched_has_work(s)) sched_schedule(s, &plan, &err);
 *       if (prev) { sched_process_outputs(s, prev, results_prev, ...); prev = NULL; }
 *       if (!plan) continue;
 *       sched_plan_fixup(plan, ...previous plan and results...);   // device does this on GPU
 *       run plan -> results;
 *       if (plan->process_now) sched_process_outputs(s, plan, results, ...);
 *       else { prev = plan; results_prev = results; }
 *   }
 *
 * ---- Rules (DESIGN.md §3) ----
 * NORMAL: a step is all prefill or all decode. Every prefill_attempt_interval (70) decode
 *   steps is an ALL point, every prefill_any_attempt_interval (100) an ANY point (ALL wins
 *   when both); a prompt step resets the count to 0, so the step after a prompt step is an
 *   ALL point. At a point a rank wants prefill when the head of waiting is schedulable and
 *   cache usage <= cache_usage_threshold, or the head already holds its reservation (a prompt
 *   between chunks: continuing it takes no new block, and stopping it at a full cache could
 *   stall the engine with nothing running); the group votes (AND at ALL, OR at ANY). If the vote
 *   passes, each rank picks its chunks and a second vote asks whether any rank picked any: if
 *   none did, the step is decode; if another rank did and this one did not, this rank runs an
 *   empty (placeholder) prompt step. A cut prompt ends the step.
 * PROMPT: prefill only, no vote, keeps looking after a cut (which matters when
 *   max_chunk_tokens leaves budget). A prompt whose prefill is done is FINISHED_HANDOFF: it
 *   keeps its blocks and slot until sched_release (the service has saved its KV).
 * COMPLETION: decode only, no vote. Requests arrive with their prompt KV in the store
 *   (kv_cached = len - 1) and are admitted into running when blocks and a slot allow (and
 *   cache usage <= the threshold, unless it holds its reservation: a fork child); preemption
 *   can only stop.
 * Prefill: chunks fill max_num_batched_tokens in waiting order. A new prompt reserves all its
 *   blocks, ceil((len + inflight + drafts) / 128), and a state slot on its first chunk;
 *   max_num_seqs caps the sequences holding a slot (running, or between chunks). A cut prompt
 *   goes back to the front of waiting; when the head of waiting cannot be scheduled (blocks,
 *   slot, max_num_seqs, not schedulable, still in flight) the queue waits behind it. Waiting
 *   sequences that hold a reservation (cut prompts, fork children) always come first, so no
 *   head waiting for blocks stands in front of what would free them.
 * Decode: every running sequence gets 1 + nextn rows (its newest token + drafts, padded with
 *   pad_token; varlen: 1 + its share of the drafts), or fewer when it may produce fewer tokens
 *   (max_tokens, max_model_len; 1 row at least); advance_optimistically(rows) at schedule time,
 *   commit(accepted + 1) at process time; blocks beyond what its next step needs go back. When
 *   the free list cannot serve a sequence: sort running by output length, longest first; serve
 *   from the back; preempt from the front (stop: FINISHED_PREEMPTED, blocks freed; recompute,
 *   NORMAL only: back to the front of waiting, behind the prompts between chunks, its outputs
 *   kept as prompt continuation, KV dropped). Unlike the original, a sequence that needs no new
 *   block never causes a preemption. Under async, a victim still in flight frees its blocks only
 *   after that step; a sequence those blocks would serve sits this step out instead of
 *   preempting more.
 * MTP varlen (cfg.varlen, off by default as in DeepSeek's engine; explainer Pass 2, "Choosing
 *   how many drafts to check"): a decode step first decides who is served and who is preempted
 *   as if every request checked all its drafts (the rows above), so every decision stays
 *   feasible; then the varlen scan (varlen.h) runs over the served requests with their newest
 *   confidences and the step-time table, and each entry gets 1 + drafts_i rows (drafts_i never
 *   above what the request may still produce). Blocks a request holds beyond its actual rows go
 *   back at once; in-flight rows and num_tokens follow the actual rows. The graph is the
 *   smallest recorded size >= the rows, which is the scan's own pick when the table measures
 *   every recorded size (a table that skips sizes can only make the recorded one smaller).
 *   Config: nextn >= 1; 1..SCHED_MAX_STEP_MS entries, each a recorded graph size (graphs.h)
 *   once, with a time in [VARLEN_MIN_MS, VARLEN_MAX_MS]; the largest >= max_num_seqs, so one
 *   row for every request that may run always fits (a smaller table is refused at create:
 *   there is no fallback); sampler_ms in [0, VARLEN_MAX_MS].
 *   Confidences: the runner returns each request's cumulative draft confidences with its new
 *   drafts (sched_seq_result.draft_conf); process_outputs stores them on the sequence with the
 *   drafts. The scan uses the newest processed ones. Synchronous: those of the step just
 *   processed, i.e. of exactly the drafts the next step checks. Async: when step N+1 is
 *   scheduled, step N (which proposes N+1's drafts) is still in flight, so the scan uses the
 *   confidences step N-1 returned, two rounds back; the total and each share are fixed at
 *   schedule time (DeepSeek's device re-ranks the shares within the total with step N's
 *   confidences; nothing here does). A request that finished in step N still gets its share
 *   in N+1 (the sampler does not zero its confidences here).
 *   A request without confidences checks no drafts. That is a request admitted to a COMPLETION
 *   engine with only its first token, a fork child, one recomputed after preemption (each of
 *   these holds no real drafts: its draft rows would be pad tokens that cannot pass), or one
 *   served by a runner without a confidence head (then varlen means no speculation). Checking
 *   all of them instead would spend rows the scan cannot weigh against the others, and the
 *   cost of "none" is at most one step of drafts per request.
 * Abort (any queue, in flight or not): one final output with finish "abort", blocks and slot
 *   freed exactly once (deferred while in flight).
 * Graphs: a decode plan's rows run on the smallest recorded size >= rows (graphs.h); the plan
 *   says how many padding rows the runner adds.
 *
 * Thread safety: none; one scheduler per rank, used by one thread.
 */
#ifndef DI_ENGINE_SCHEDULER_H
#define DI_ENGINE_SCHEDULER_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/engine/seq.h"
#include "common/engine/varlen.h"
#include "common/engine/vote.h"
#include "common/util/alloc.h"
#include "common/util/status.h"

typedef struct sched sched;

typedef enum sched_engine_type {
    SCHED_NORMAL = 0, /* prefill and decode in one process, with the ALL/ANY vote */
    SCHED_PROMPT,     /* prefill only (prefill service) */
    SCHED_COMPLETION, /* decode only (decode service) */
    SCHED_TYPE_COUNT
} sched_engine_type;

typedef enum sched_preempt_mode {
    SCHED_PREEMPT_STOP = 0,  /* the victim ends FINISHED_PREEMPTED */
    SCHED_PREEMPT_RECOMPUTE, /* the victim goes back to waiting (NORMAL only) */
    SCHED_PREEMPT_COUNT
} sched_preempt_mode;

/* Why a request ended, as reported in an output. */
typedef enum sched_finish {
    SCHED_FINISH_NONE = 0,  /* not finished */
    SCHED_FINISH_STOP,      /* end token or a stop id */
    SCHED_FINISH_LENGTH,    /* max_tokens or max_model_len */
    SCHED_FINISH_ABORT,     /* sched_abort */
    SCHED_FINISH_PREEMPTED, /* stopped to free KV blocks */
    SCHED_FINISH_GRAMMAR,   /* the grammar left no allowed token */
    SCHED_FINISH_FAILED,    /* the runner failed this request (sampler error, KV load) */
    SCHED_FINISH_HANDOFF,   /* PROMPT engine: prefill done, KV held for the decode side */
    SCHED_FINISH_COUNT
} sched_finish;

/* Most entries of a varlen step-time table. */
#define SCHED_MAX_STEP_MS 65536u

typedef struct sched_config {
    sched_engine_type type;           /* NORMAL */
    uint32_t max_num_batched_tokens;  /* prefill tokens per step; 32,768 */
    uint32_t max_num_seqs;            /* sequences holding a slot (running + between chunks); 64 */
    uint32_t max_model_len;           /* positions per request, prompt included; 131,072 */
    uint32_t nextn;                   /* drafts per decode step (0 = no speculation); 5 */
    uint32_t num_blocks;              /* KV blocks of 128 positions, block 0 included */
    uint32_t num_slots;               /* state slots; >= max_num_seqs; 2 x max_num_seqs */
    uint32_t prefill_attempt_interval;     /* ALL vote every this many decode steps; 70 */
    uint32_t prefill_any_attempt_interval; /* ANY vote every this many decode steps; 100 */
    double cache_usage_threshold;     /* want prefill / admit only at or below; 0.9 */
    sched_preempt_mode preempt_mode;  /* STOP */
    uint32_t graph_interval;          /* recorded graph sizes: powers of 2 up to it, then
                                         multiples of it; 8 */
    bool chunked_prefill;             /* cut prompts to the budget; true */
    bool async;                       /* one-step-ahead scheduling; false */
    uint32_t max_waiting;             /* cap on waiting requests (DI_EFULL beyond); 4,096 */
    uint32_t max_chunk_tokens;        /* most tokens of one prompt per step, 0 = budget; a cut
                                         chunk ends on a multiple of it; 0 */
    int32_t eos_token;                /* end token, -1 for none; -1 */
    int32_t pad_token;                /* token of padded draft rows and placeholders; 0 */
    uint32_t vocab_size;              /* token ids must be below it; 0 = unchecked */
    bool varlen;                      /* MTP varlen: each decode step picks how many drafts each
                                         request checks (see "MTP varlen" above); false */
    const varlen_graph_time *step_ms; /* varlen: measured time of one step per recorded graph
                                         size (ms); copied by sched_create; NULL */
    uint32_t n_step_ms;               /* entries of step_ms; 0 */
    double sampler_ms;                /* varlen: the sampler's time per step (ms), added to
                                         every size; 0 */
    const vote *vote;                 /* rank group; NULL = a single rank (copied) */
    const di_alloc *alloc;            /* allocator; NULL = libc (must outlive the scheduler) */
} sched_config;

/* The defaults named above, num_blocks 1,025 and num_slots 128. */
void sched_config_default(sched_config *c);
/* Every field in range and consistent. DI_OK or DI_EINVAL naming the field. */
di_status sched_config_validate(const sched_config *c, di_error *err);
const char *sched_engine_type_name(sched_engine_type t);    /* "normal", "prompt", ... */
int sched_engine_type_parse(const char *name);              /* -1 when unknown */
const char *sched_preempt_mode_name(sched_preempt_mode m);  /* "stop", "recompute" */
int sched_preempt_mode_parse(const char *name);             /* -1 when unknown */
const char *sched_finish_name(sched_finish f);              /* "stop", "abort", ... */

/* A request to add. Zero-initialise, then set what you need. */
typedef struct sched_request {
    uint64_t id;              /* unique among live requests */
    const int32_t *prompt;    /* prompt tokens (copied) */
    uint32_t prompt_len;      /* >= 1; prompt_len + output_len < max_model_len */
    const int32_t *output;    /* tokens already generated, e.g. the first token of a handoff */
    uint32_t output_len;
    uint32_t max_tokens;      /* output limit, counting output[]; >= 1 */
    const int32_t *stop_ids;  /* extra stop tokens (copied) */
    uint32_t n_stop_ids;      /* <= SEQ_MAX_STOP_IDS */
    bool ignore_eos;          /* the end token does not stop it */
    bool has_grammar;         /* preemption stops it even in recompute mode */
    bool hold;                /* not schedulable until sched_set_schedulable */
    uint64_t arrival_ns;      /* caller's clock */
    uint32_t kv_cached;       /* leading positions whose KV the runner loads from the store
                                 (prefix hit, prefix.h; or the prompt of a handoff) */
    uint32_t replay;          /* of those, positions rerun to rebuild the window (0 or 128) */
    bool window_cached;       /* the window state at kv_cached - replay is loaded too */
    const int32_t *drafts;    /* drafts its first decode step checks (a handoff's; copied) */
    uint32_t n_drafts;        /* <= nextn; 0 = none */
} sched_request;

/* ---- The step plan (schedule's output, the runner's input) ---- */

#define SCHED_PLACEHOLDER_ID UINT64_MAX

/* One scheduled sequence. Row r (0 <= r < seqlen_q) is token tokens[r] at position
 * first_position + r; it attends to positions [max(window_start, ...), seqlen_k) and writes
 * its KV into block block_table[pos / 128] at offset pos % 128, and its window entry into
 * ring index pos mod ring of state slot state_slot. */
typedef struct sched_seq_plan {
    uint64_t request_id;        /* SCHED_PLACEHOLDER_ID for a placeholder row */
    uint32_t seqlen_q;          /* rows this step: the chunk (prefill), or 1 + nextn or fewer
                                   near the request's limit (decode) */
    uint32_t seqlen_k;          /* KV positions visible once the rows are in: first_position +
                                   seqlen_q */
    uint32_t first_position;    /* position of row 0 */
    const int32_t *tokens;      /* [seqlen_q] row tokens: the chunk, or the newest token then
                                   the drafts (padded with pad_token) */
    const uint32_t *block_table; /* [n_blocks] blocks covering positions [0, seqlen_k) and any
                                   reserved beyond; [0] for a placeholder */
    uint32_t n_blocks;
    int32_t state_slot;         /* state slot of its rings, -1 for a placeholder */
    uint32_t draft_slot;        /* draft-pool row (state_slot + 1), 0 = none/placeholder */
    uint32_t n_load;            /* before this step: load the KV of positions [0, n_load) from
                                   the store into the block table; 0 = nothing to load */
    bool load_window;           /* before this step: load the window state at first_position */
    uint32_t window_start;      /* no window read below this position (bounded replay), 0 */
    bool sample;                /* its last row is sampled and its result consumed: decode, or
                                   the final chunk of a prompt (earlier chunks: result ignored) */
    bool tokens_from_prev;      /* async: it is in the previous unprocessed step; the rows'
                                   tokens and seqlen_k assume that step accepted every draft
                                   (sched_plan_fixup corrects them) */
    uint32_t prev_index;        /* with tokens_from_prev: its entry index in that step */
} sched_seq_plan;

/* A copy the runner does before the step's forward (a fork), in list order. */
typedef enum sched_copy_kind {
    SCHED_COPY_BLOCK = 0, /* the KV bytes of block src into block dst */
    SCHED_COPY_SLOT,      /* the whole state slot src (rings, compressor state) into dst */
} sched_copy_kind;

typedef struct sched_copy {
    sched_copy_kind kind;
    uint32_t src;
    uint32_t dst;
} sched_copy;

typedef struct sched_plan {
    uint64_t step;              /* step number on this rank, from 0 */
    bool prompt_run;            /* prefill step (all entries are prompt chunks) */
    bool placeholder;           /* no real work on this rank: one fake row, block 0 */
    bool process_now;           /* must be processed before the next schedule (prompt steps) */
    uint32_t n_seqs;            /* entries */
    sched_seq_plan *seqs;       /* [n_seqs] */
    uint32_t n_rows;            /* sum of seqlen_q (1 for a placeholder) */
    uint32_t graph_rows;        /* decode: recorded graph size used (>= n_rows); 0 for prefill */
    uint32_t padding_rows;      /* graph_rows - n_rows: placeholder rows the runner appends */
    uint32_t n_preempted;       /* sequences preempted while building this plan */
    uint32_t n_copies;          /* fork copies to do before this step's forward */
    const sched_copy *copies;   /* [n_copies] */
} sched_plan;
/* Before a plan's forward the runner does, in this order: the copies (list order), then each
 * entry's loads (n_load blocks, load_window). A slot or block a copy writes may belong to a
 * new owner in the same plan; that owner's loads and rows come after and overwrite it. */

/* ---- Step results (the runner's output, process_outputs' input), one per plan entry ---- */

typedef enum sched_result_status {
    SCHED_RESULT_OK = 0,
    SCHED_RESULT_FAILED,          /* this request failed (sampler error, KV load failure) */
    SCHED_RESULT_GRAMMAR_FAILED,  /* every token was masked by the grammar */
} sched_result_status;

typedef struct sched_seq_result {
    sched_result_status status;   /* per request; other requests are unaffected */
    uint32_t n_tokens;            /* decode: accepted drafts + the sampled token (1 .. seqlen_q);
                                     prefill final chunk: 1; ignored for other chunks */
    int32_t tokens[SEQ_MAX_NEXTN + 1]; /* the accepted drafts, then the sampled token */
    uint32_t n_drafts;            /* new drafts for the next step (0 .. nextn) */
    int32_t drafts[SEQ_MAX_NEXTN];
    uint32_t n_conf;              /* confidences of the new drafts: 0 (none) or n_drafts */
    float draft_conf[SEQ_MAX_NEXTN]; /* draft model's cumulative acceptance chance of drafts[i]
                                     (all of drafts[0..i] accepted), in [0, 1], non-increasing;
                                     written by the runner, read by varlen */
} sched_seq_result;

/* ---- Request outputs ---- */

typedef struct sched_output {
    uint64_t request_id;
    const int32_t *tokens;        /* new tokens this step (valid until the next sched_ call) */
    uint32_t n_tokens;
    sched_finish finish;          /* NONE while the request goes on */
    uint32_t n_generated;         /* output tokens of the request so far */
} sched_output;

typedef struct sched_stats {
    uint64_t steps;               /* plans scheduled */
    uint64_t prompt_steps;        /* with prompt_run (placeholder prompt steps included) */
    uint64_t decode_steps;        /* decode plans (placeholders included) */
    uint64_t placeholder_steps;   /* plans with no real sequence */
    uint64_t votes;               /* collectives called by the scheduler */
    uint64_t preempted_stop;      /* sequences stopped by preemption */
    uint64_t preempted_recompute; /* sequences sent back to waiting */
    uint64_t sat_out;             /* decode rows skipped while a victim's blocks were in flight */
    uint64_t prefill_tokens;      /* prompt positions computed */
    uint64_t decode_rows;         /* decode rows scheduled */
    uint64_t varlen_steps;        /* decode plans whose draft counts varlen chose */
    uint64_t varlen_no_conf;      /* of their entries, those without confidences (no drafts) */
    uint64_t output_tokens;       /* tokens appended to requests */
    uint64_t requests_added;
    uint64_t requests_finished;   /* final outputs (abort included) */
} sched_stats;

/* Creates a scheduler. DI_OK; DI_EINVAL (config); DI_ENOMEM. *out untouched on failure. */
di_status sched_create(const sched_config *cfg, sched **out, di_error *err);
/* Frees the scheduler and every request in it. NULL-safe. */
void sched_destroy(sched *s);

/* Adds a request at the back of waiting (COMPLETION: requests whose prompt KV is cached).
 * DI_OK; DI_EINVAL (empty prompt, too long for max_model_len, token ids outside the
 * vocabulary, more blocks than the cache has, a prompt over the budget with chunked prefill
 * off, inconsistent kv_cached/replay/window_cached, a COMPLETION request without its KV);
 * DI_EEXIST (id live); DI_EFULL (max_waiting reached); DI_ENOMEM. Nothing changes on failure. */
di_status sched_add_request(sched *s, const sched_request *req, di_error *err);

/* Aborts a request wherever it is (waiting, between chunks, running, in flight). On DI_OK
 * *out (optional) receives its one final output, finish SCHED_FINISH_ABORT, and the request
 * produces no other output; its blocks and slot are freed now, or once its steps in flight
 * are processed. A FINISHED_HANDOFF request is released instead and *out gets finish NONE
 * (its final output was the handoff). DI_ENOENT when no live request has the id. */
di_status sched_abort(sched *s, uint64_t id, sched_output *out, di_error *err);

/* Forks a decoding request: a new request `child->id` whose prompt is the parent's tokens so
 * far. It shares the parent's full KV blocks and gets copies of the last, partial block and of
 * the parent's state slot (window rings, compressor state); the next plan carries the copies,
 * which the runner does before that step's forward, so the parent's next rows cannot
 * overwrite what is copied. The child holds its blocks and slot from now on (it counts against
 * max_num_seqs) and enters waiting, ahead of requests without a reservation, with the
 * parent's KV counted: its prefill is the one position without KV (in a COMPLETION engine it
 * is admitted straight to decode).
 * child->prompt is ignored; its limits apply.
 * DI_OK; DI_ENOENT (no parent); DI_ESTATE (parent not decoding); DI_EEXIST; DI_EFULL (waiting
 * full, max_num_seqs, no slot or block, too many forks before the next step); DI_EINVAL;
 * DI_ENOMEM. Nothing changes on failure. */
di_status sched_fork(sched *s, uint64_t parent_id, const sched_request *child, di_error *err);

/* Releases a FINISHED_HANDOFF request's blocks and slot. DI_OK; DI_ENOENT; DI_ESTATE. */
di_status sched_release(sched *s, uint64_t id, di_error *err);
/* Marks a held request schedulable. DI_OK; DI_ENOENT; DI_ESTATE (not waiting). */
di_status sched_set_schedulable(sched *s, uint64_t id, di_error *err);

/* Builds the next step (see the rules above); in a group, every rank calls it in lockstep.
 * DI_OK with *out pointing at a plan owned by the scheduler, valid until it is processed;
 * DI_ESTATE (a plan must be processed first); a vote failure (vote.h). On failure nothing
 * changes and *out is untouched. */
di_status sched_schedule(sched *s, sched_plan **out, di_error *err);

/* Applies the results of the oldest unprocessed plan: results[i] belongs to plan->seqs[i]
 * (results may be NULL for a placeholder plan). Appends tokens, applies the stop rules,
 * moves finished prompts to running, cut prompts to the front of waiting, releases what ended.
 * DI_OK with outs/n_outs set to this step's outputs (plus the preemption outputs of the
 * schedules since the last call), valid until the next sched_ call; DI_ESTATE (not the oldest
 * unprocessed plan); DI_EINVAL (n_results != n_seqs, a result's counts or tokens out of
 * range, naming the entry). Nothing changes on failure. A processed plan stays readable
 * until the next sched_schedule (for sched_plan_fixup). */
di_status sched_process_outputs(sched *s, const sched_plan *plan,
                                const sched_seq_result *results, size_t n_results,
                                const sched_output **outs, size_t *n_outs, di_error *err);

/* The async correction, on the CPU: for every entry of `next` with tokens_from_prev, copies
 * prev's sampled token and drafts into its rows and subtracts prev's rejected rows from
 * first_position and seqlen_k. `prev` is the plan scheduled just before `next`, `prev_results`
 * its results. An entry whose request failed in prev keeps its pad tokens; one that stopped
 * in prev rides with its last token (its results are ignored either way). */
void sched_plan_fixup(sched_plan *next, const sched_plan *prev,
                      const sched_seq_result *prev_results);

/* Waiting or running requests on this rank (plans in flight and held handoffs do not count). */
bool sched_has_work(const sched *s);
/* The group's answer to "does any rank have work": every rank calls it in lockstep.
 * DI_OK with *out set; a vote failure. */
di_status sched_group_has_work(sched *s, bool *out, di_error *err);

/* Checks every invariant: each sequence (seq_check), the queues (status, order, counts,
 * max_num_seqs), the block pool (blkmgr check against every live block table), the slot pool
 * (each slot held by exactly one sequence that may hold one), the in-flight plans (each
 * sequence's in-flight steps and rows equal to its entries), the id map. DI_OK or DI_EINTERNAL
 * naming the broken rule. O(live sequences + blocks): for tests and debugging. */
di_status sched_check(sched *s, di_error *err);

/* Inspection. */
const sched_stats *sched_get_stats(const sched *s);
const sched_config *sched_get_config(const sched *s);
double sched_cache_usage(const sched *s);         /* used / usable blocks */
uint32_t sched_free_blocks(const sched *s);
uint32_t sched_usable_blocks(const sched *s);
uint32_t sched_free_slots(const sched *s);
uint32_t sched_num_waiting(const sched *s);
uint32_t sched_num_running(const sched *s);
uint32_t sched_num_live(const sched *s);          /* requests not yet released */
uint32_t sched_num_in_flight(const sched *s);     /* unprocessed plans */
uint32_t sched_decode_step(const sched *s);       /* decode steps since the last prompt step */
const seq *sched_find(const sched *s, uint64_t id); /* NULL when not live */

#endif
