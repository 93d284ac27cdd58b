/* sched_internal.h: the scheduler's state, shared by sched.c (requests, checks),
 * sched_step.c (building plans) and sched_process.c (applying results). Not a public header.
 */
#ifndef DI_ENGINE_SCHED_INTERNAL_H
#define DI_ENGINE_SCHED_INTERNAL_H

#include "common/engine/blkmgr.h"
#include "common/engine/graphs.h"
#include "common/engine/scheduler.h"
#include "common/engine/seq.h"
#include "common/engine/slots.h"
#include "common/engine/varlen.h"

/* What an engine type may do: one row per type. */
typedef struct sched_type_row {
    const char *name;        /* "normal", "prompt", "completion" */
    bool prefill;            /* schedules prompt steps */
    bool decode;             /* schedules decode steps */
    bool votes;              /* ALL/ANY vote on the step type */
    bool look_after_cut;     /* keeps picking prompts after cutting one */
    bool recompute;          /* may preempt by recompute */
    bool hold_after_prefill; /* a finished prompt becomes FINISHED_HANDOFF */
} sched_type_row;

extern const sched_type_row sched_type_rows[SCHED_TYPE_COUNT];

/* One plan slot: the public plan plus what the scheduler needs to apply its results. */
typedef struct sched_step {
    sched_plan plan;        /* handed to the runner */
    sched_seq_plan *entries; /* [max_num_seqs] plan.seqs points here */
    seq **seqs;             /* [max_num_seqs] the sequence of each entry (NULL: placeholder) */
    uint32_t *gens;         /* [max_num_seqs] the sequence's gen when scheduled */
    int32_t *rows;          /* [max_num_seqs * (1 + nextn)] decode row tokens */
    sched_copy *copies;     /* [cap_copies] fork copies done before this step; each block copy
                               holds a reference on its source until the step is processed */
    bool in_flight;         /* scheduled, not processed */
} sched_step;

struct sched {
    sched_config cfg;              /* copy of the caller's config */
    const sched_type_row *type;    /* row of cfg.type */
    vote vote;                     /* copy of cfg.vote, or vote_local() */
    const di_alloc *alloc;         /* cfg.alloc */
    blkmgr *bm;                    /* KV blocks */
    slots *sl;                     /* state slots */
    graph_sizes graphs;            /* recorded decode graph sizes */
    uint32_t rows;                 /* decode rows per sequence: 1 + nextn */
    uint32_t table_cap;            /* block-table entries per sequence */

    seq **wq;                      /* [wq_cap] waiting queue, a ring */
    uint32_t wq_cap, wq_head, wq_len;
    seq **run;                     /* [max_num_seqs] running sequences (decoding) */
    uint32_t n_run;
    uint32_t n_active;             /* sequences holding a slot that count against max_num_seqs:
                                      running + prefilling + between chunks */

    seq *all;                      /* every live sequence (doubly linked) */
    uint32_t n_live, max_live;     /* live count and its cap */
    uint64_t *map_keys;            /* [map_mask + 1] id map, linear probing */
    seq **map_vals;                /* NULL = empty cell */
    uint32_t map_mask;

    sched_step steps[2];           /* plans: at most 1 (sync) or 2 (async) in flight */
    uint32_t step_first;           /* index of the oldest plan in flight */
    uint32_t n_in_flight;          /* plans in flight */
    uint64_t step_no;              /* next plan's number */
    uint32_t decode_step;          /* decode steps since the last prompt step */

    seq **order;                   /* [max_num_seqs] scratch: running sorted for preemption */
    uint32_t *need;                /* [max_num_seqs] scratch: blocks each sequence needs */
    uint32_t *chunk;               /* [max_num_seqs] scratch: chosen prefill chunk sizes */
    seq **served;                  /* [max_num_seqs] scratch: the sequences a decode step
                                      serves, in entry order (entries are made once varlen has
                                      chosen their rows) */
    uint32_t n_served;

    varlen_planner *vl;            /* cfg.varlen: the scan with the table and its scratch */
    varlen_graph_time *step_ms;    /* cfg.varlen: copy of the table (cfg.step_ms points here) */
    varlen_request *vl_reqs;       /* [max_num_seqs] scratch: the served sequences' drafts */
    uint32_t *vl_drafts;           /* [max_num_seqs] scratch: drafts each one checks */

    sched_copy *pend;              /* [cap_copies] fork copies waiting for the next plan */
    uint32_t n_pend, cap_copies;

    sched_output *outs;            /* [cap_outs] outputs of the current delivery */
    uint32_t n_outs, cap_outs;
    int32_t *out_tokens;           /* [cap_out_tokens] their tokens */
    uint32_t n_out_tokens, cap_out_tokens;
    bool outs_delivered;           /* outs were returned: clear before adding more */

    sched_stats stats;
};

/* sched.c */
seq *sched_map_get(const sched *s, uint64_t id);
void sched_wq_push_front(sched *s, seq *q);
/* Inserts q behind the leading run of waiting sequences that hold a reservation (prompts
 * between chunks, fork children), so those are always first: they need no new block, and a
 * head that waits for blocks must not stall them (they are what would free blocks). */
void sched_wq_push_after_reserved(sched *s, seq *q);
seq *sched_wq_at(const sched *s, uint32_t i);
void sched_wq_pop_front(sched *s, uint32_t n);
void sched_run_add(sched *s, seq *q);
void sched_run_remove(sched *s, seq *q);
/* Returns q's blocks and slot to the pools (now: nothing of q is in flight). */
void sched_release_resources(sched *s, seq *q);
/* q ended or was sent back: release now when nothing is in flight, else mark it pending. A
 * finished, non-held sequence with nothing pending is destroyed. */
void sched_settle(sched *s, seq *q);
/* Ends q with status `to` (a FINISHED_* state): leaves its queue, settles. */
void sched_finish_seq(sched *s, seq *q, seq_status to);
/* Appends an output (clearing delivered ones first). tokens may be NULL when n == 0. */
void sched_emit(sched *s, const seq *q, const int32_t *tokens, uint32_t n, sched_finish f);
sched_finish sched_finish_of(seq_status st);

/* sched_step.c */
bool sched_head_ready(const sched *s);
/* The head of waiting is ready and may start now: cache usage is at or below the threshold,
 * or it already holds its reservation (continuing it takes no new block). */
bool sched_head_may_start(const sched *s);

#endif
