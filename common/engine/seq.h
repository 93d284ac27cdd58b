/* seq.h: one request as the engine sees it (a sequence).
 *
 * A sequence holds its tokens (prompt then outputs), how many positions have KV, the blocks
 * that hold that KV, its state slot, its drafts and its limits. The scheduler (scheduler.h) owns
 * every sequence; this module only keeps one sequence's fields consistent.
 *
 * Positions and counters (explainer Pass 2, "Sequence r1 after add_request"):
 *   len          tokens known: prompt_len prompt tokens, then the outputs appended so far.
 *   num_tokens   positions whose KV is written, or will be written by a step already
 *                scheduled ("optimistic"): a decode step advances it by all its rows at
 *                schedule time (seq_advance_optimistically) and takes back the rejected drafts
 *                when its results are processed (seq_commit_processed_tokens). The KV of
 *                rejected drafts is left in place; the next step's rows overwrite it.
 *   A decoding sequence with nothing in flight has num_tokens == len - 1: its newest token
 *   has no KV yet and is row 0 of its next step.
 *
 * Worked example (explainer Pass 3, "When the verifier says no"): num_tokens 1,999, len
 * 2,000; advance_optimistically(6) -> 2,005; the step accepts d1, d2 and samples t, so
 * len 2,003; commit_processed_tokens(rows 6, valid 3) -> 2,002.
 *
 * ---- The state machine (seq_set_status asserts every transition against seq_transitions) ----
 *
 *              sched_schedule: final prefill chunk scheduled, or COMPLETION admission
 *   WAITING ───────────────────────────────────────────────────────────────▶ RUNNING
 *     │  ▲                                                                     │
 *     │  └──── sched_schedule: decode preemption, recompute mode ──────────────┤
 *     │                                                                        │
 *     ├─ sched_abort ───────────────────▶ FINISHED_ABORTED ◀──── sched_abort ──┤
 *     └─ sched_process_outputs: the runner failed this request                 │
 *                                    ──▶ FINISHED_FAILED ◀─────────────────────┤
 *                                                                              │
 *   sched_process_outputs, on appending tokens:                                │
 *     a stop token (unless ignore_eos)          ──▶ FINISHED_STOPPED ◀─────────┤
 *     max_tokens outputs or max_model_len       ──▶ FINISHED_LENGTH_CAPPED ◀───┤
 *     the grammar left no allowed token         ──▶ FINISHED_GRAMMAR_FAILED ◀──┤
 *     PROMPT engine, prefill done: KV stays held ──▶ FINISHED_HANDOFF ◀────────┤
 *   sched_schedule: decode preemption, stop mode ──▶ FINISHED_PREEMPTED ◀──────┘
 *
 * FINISHED_* states are final. A finished sequence may still be in a step in flight (async
 * scheduling); it keeps its blocks and slot until that step is processed (deferred release).
 * FINISHED_HANDOFF keeps them until sched_release (the prefill service has saved the KV).
 */
#ifndef DI_ENGINE_SEQ_H
#define DI_ENGINE_SEQ_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/util/alloc.h"
#include "common/util/status.h"

#define SEQ_BLOCK_TOKENS 128u /* token positions per KV block (DESIGN.md §5) */
#define SEQ_MAX_NEXTN 15u     /* most drafts a sequence carries */
#define SEQ_MAX_STOP_IDS 64u  /* most stop token ids per request */

typedef enum seq_status {
    SEQ_WAITING = 0,
    SEQ_RUNNING,
    SEQ_FINISHED_STOPPED,
    SEQ_FINISHED_LENGTH_CAPPED,
    SEQ_FINISHED_ABORTED,
    SEQ_FINISHED_PREEMPTED,
    SEQ_FINISHED_GRAMMAR_FAILED,
    SEQ_FINISHED_FAILED,
    SEQ_FINISHED_HANDOFF,
    SEQ_STATUS_COUNT
} seq_status;

/* Which scheduler queue holds the sequence (written by the scheduler only). */
typedef enum seq_where {
    SEQ_IN_NONE = 0, /* ended: in no queue (maybe still in a step in flight, or held) */
    SEQ_IN_WAITING,  /* in the waiting queue */
    SEQ_IN_PREFILL,  /* a prefill chunk of it is scheduled and not yet processed */
    SEQ_IN_RUNNING,  /* in the running list (decoding) */
} seq_where;

/* What a request asks for, copied into the sequence by seq_create. */
typedef struct seq_params {
    uint64_t id;              /* request id, unique among live sequences (caller) */
    const int32_t *prompt;    /* prompt_len token ids; copied */
    uint32_t prompt_len;      /* >= 1 */
    const int32_t *output;    /* tokens already generated (handoff, fork); NULL when none */
    uint32_t output_len;      /* count of output[] */
    uint32_t max_tokens;      /* most output tokens in total, counting output[]; >= 1 */
    const int32_t *stop_ids;  /* token ids that end the request; copied */
    uint32_t n_stop_ids;      /* <= SEQ_MAX_STOP_IDS */
    int32_t eos;              /* the model's end token, -1 for none */
    bool ignore_eos;          /* the end token does not stop the request (stop_ids still do) */
    bool has_grammar;         /* grammar-constrained: never recomputed after preemption */
    uint64_t arrival_ns;      /* arrival time, caller's clock (ns) */
    uint32_t token_capacity;  /* tokens to reserve room for (>= prompt + output lens) */
    uint32_t block_capacity;  /* block-table entries to reserve room for */
} seq_params;

/* One sequence. Fields marked (sched) are written by the scheduler only. */
typedef struct seq {
    uint64_t id;               /* request id (caller) */
    seq_status status;         /* state machine above; change only with seq_set_status */
    seq_where where;           /* queue holding it (sched) */

    int32_t *tokens;           /* [cap_tokens]: prompt, then outputs (inline storage) */
    uint32_t prompt_len;       /* prompt tokens; for a recomputed sequence the original prompt */
    uint32_t len;              /* tokens known (prompt + outputs) */
    uint32_t cap_tokens;       /* room in tokens[] */
    uint32_t max_tokens;       /* output limit (tokens) */

    uint32_t num_tokens;       /* positions with KV written or scheduled (see top) */
    uint32_t prev_num_tokens;  /* num_tokens before the last advance_optimistically */
    uint32_t *blocks;          /* [cap_blocks] block table: block i holds positions
                                  [128 i, 128 i + 128) (inline storage) */
    uint32_t n_blocks;         /* entries in use */
    uint32_t cap_blocks;       /* room in blocks[] */
    bool reserved;             /* holds the blocks and slot of its whole prompt (sched) */
    int32_t state_slot;        /* state-slot id, -1 for none (sched) */
    uint32_t draft_slot;       /* draft-pool row: state_slot + 1, 0 for none (sched) */

    uint32_t n_load;           /* leading positions whose KV the runner must load from the store
                                  before the first chunk (prefix hit, handoff); 0 after that */
    bool load_window;          /* with n_load: also load the window state at num_tokens */
    uint32_t window_start;     /* no window read goes below this position (bounded replay) */

    uint32_t inflight_steps;   /* scheduled steps holding it, not yet processed (sched) */
    uint32_t inflight_rows;    /* rows of those steps (sched) */
    uint32_t gen;              /* bumped when a recompute preemption discards its KV; results
                                  of steps scheduled before are then ignored (sched) */
    bool release_pending;      /* blocks and slot go back once inflight_steps is 0 (sched) */

    int32_t drafts[SEQ_MAX_NEXTN]; /* draft tokens for its next decode step */
    uint32_t n_drafts;         /* drafts held (0..nextn); missing ones are padded */
    double draft_conf[SEQ_MAX_NEXTN]; /* cumulative acceptance chance of drafts[i] from the
                                  draft model's confidence head, non-increasing (MTP varlen);
                                  written with the drafts by sched_process_outputs */
    uint32_t n_conf;           /* confidences held: 0 (none reported yet) or n_drafts */

    int32_t *stop_ids;         /* [n_stop_ids] extra stop tokens (inline storage) */
    uint32_t n_stop_ids;
    int32_t eos;               /* end token, -1 for none */
    bool ignore_eos;           /* the end token does not stop it */
    bool has_grammar;          /* stop instead of recompute on preemption */
    bool schedulable;          /* false while its inputs are not ready (sched_set_schedulable) */
    uint64_t arrival_ns;       /* arrival time (caller's clock) */
    uint32_t n_preempted;      /* times it was preempted (recompute) */

    uint32_t run_idx;          /* index in the running list while SEQ_IN_RUNNING (sched) */
    uint32_t plan_idx;         /* its entry index in the latest step that holds it (sched) */
    struct seq *all_prev;      /* the scheduler's list of live sequences (sched) */
    struct seq *all_next;
} seq;

/* Allocates a sequence (one allocation holding the struct, tokens, block table and stop ids)
 * in state WAITING with no blocks, slot -1 and num_tokens 0.
 * Returns DI_OK with *out set; DI_EINVAL (bad lengths, capacities or stop ids, the message
 * names the field); DI_ENOMEM. On failure *out is untouched and nothing is allocated. */
di_status seq_create(const seq_params *p, const di_alloc *a, seq **out, di_error *err);
/* Frees a sequence from seq_create. NULL-safe. The caller returns its blocks and slot first. */
void seq_destroy(seq *s, const di_alloc *a);

static inline uint32_t seq_output_len(const seq *s) { return s->len - s->prompt_len; }
static inline bool seq_is_finished(const seq *s) { return s->status >= SEQ_FINISHED_STOPPED; }
/* Blocks covering n positions: ceil(n / 128). */
static inline uint32_t seq_blocks_for(uint64_t positions)
{
    return (uint32_t)((positions + SEQ_BLOCK_TOKENS - 1) / SEQ_BLOCK_TOKENS);
}
/* Blocks a prompt reserves on its first chunk: ceil((len + inflight + drafts) / 128)
 * (explainer: 129 for 16,389 tokens, 391 for 50,000). */
static inline uint32_t seq_reserve_blocks(const seq *s)
{
    return seq_blocks_for((uint64_t)s->len + s->inflight_rows + s->n_drafts);
}

/* advance_optimistically: prev_num_tokens = num_tokens; num_tokens += rows. */
void seq_advance_optimistically(seq *s, uint32_t rows);
/* commit_processed_tokens: a step of `rows` rows wrote KV that is valid for its first
 * `valid` rows (row 0 and the accepted drafts); num_tokens -= rows - valid. With one step in
 * flight this is prev_num_tokens + valid. valid <= rows. */
void seq_commit_processed_tokens(seq *s, uint32_t rows, uint32_t valid);

/* Why appending a token ended the sequence, or SEQ_RUNNING when it did not. */
typedef seq_status seq_stop;
/* Appends one output token and applies the stop rules in order: the end token (unless
 * ignore_eos) or one of stop_ids -> FINISHED_STOPPED; max_tokens outputs or len == max_model_len ->
 * FINISHED_LENGTH_CAPPED. Returns the status the sequence must move to, or SEQ_RUNNING.
 * Precondition: not finished and len < cap_tokens (asserted). */
seq_stop seq_append_token(seq *s, int32_t token, uint32_t max_model_len);

/* Replaces the drafts (n <= SEQ_MAX_NEXTN); their confidences are unknown until
 * seq_set_draft_conf (n_conf becomes 0). */
void seq_set_drafts(seq *s, const int32_t *drafts, uint32_t n);
/* Sets the confidences of the drafts held: n is 0 or n_drafts; each in [0, 1], non-increasing
 * (the caller has checked). */
void seq_set_draft_conf(seq *s, const float *conf, uint32_t n);

/* True when from -> to is an allowed transition (the table in seq.c). */
bool seq_transition_allowed(seq_status from, seq_status to);
/* Moves to `to`; asserts the transition is allowed. */
void seq_set_status(seq *s, seq_status to);
/* "WAITING", "FINISHED_ABORTED", ... */
const char *seq_status_name(seq_status st);

/* Checks the fields of one sequence against its state: lengths within capacity, num_tokens
 * covered by the block table, a slot exactly when it holds a reservation or runs, the draft
 * slot following the state slot, a decoding sequence at num_tokens == len - 1 + in-flight
 * rows, outputs within max_tokens, confidences for none or all of the drafts. DI_OK, or
 * DI_EINTERNAL naming the broken rule. */
di_status seq_check(const seq *s, di_error *err);

#endif
