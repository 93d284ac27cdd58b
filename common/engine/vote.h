/* vote.h: the small collectives the ranks of one expert-parallel group use to stay in lockstep
 * (explainer Pass 2, "The first engine steps are empty"; Pass 4, "One scheduler per rank, and
 * a vote").
 *
 * Each rank has its own scheduler. In a NORMAL engine they must agree on the step type (all
 * prefill or all decode), and every rank must run every step, even with nothing to do, because
 * the MoE exchange needs every rank's buffer. Three collectives do it:
 *   all(flag)          AND over the ranks: "does every rank want prefill" (ALL points);
 *   any(flag)          OR over the ranks: "does any rank want / did any rank schedule prefill";
 *   any_work(flag)     OR over the ranks: "does any rank still have work" (the driver's loop).
 * They run on a CPU group, not on the GPUs: they are tiny and decide what the GPUs do next.
 *
 * A `vote` is a struct of function pointers plus userdata, so the scheduler does not know how
 * the answer is computed:
 *   - vote_local(): one rank; every collective returns the rank's own flag.
 *   - vote_group: N ranks as threads of one process (tests, di-sim). Each call blocks until
 *     all N ranks made the same call, like an all-reduce; a rank calling a different collective
 *     than the others is a lockstep bug and cancels the group (DI_EINTERNAL to the caller,
 *     DI_ECANCELED to the rest). A process-based group (sockets or shared memory between the
 *     services' ranks) fills the same struct.
 */
#ifndef DI_ENGINE_VOTE_H
#define DI_ENGINE_VOTE_H

#include <stdbool.h>
#include <stdint.h>

#include "common/util/alloc.h"
#include "common/util/status.h"

/* Each returns DI_OK with *out set, or a failure of the group (DI_ECANCELED, DI_ETIMEDOUT,
 * DI_EINTERNAL, DI_EIO for a transport) after which the group is unusable. */
typedef di_status (*vote_fn)(void *userdata, bool flag, bool *out, di_error *err);

typedef struct vote {
    vote_fn all;        /* AND of flag over the ranks */
    vote_fn any;        /* OR of flag over the ranks */
    vote_fn any_work;   /* OR of "this rank has work left" over the ranks */
    void *userdata;     /* passed to each */
    uint32_t rank;      /* this rank (informational) */
    uint32_t n_ranks;   /* ranks in the group (informational) */
} vote;

/* A single rank: each collective returns the flag. */
vote vote_local(void);

/* ---- N ranks as threads of one process ---- */

typedef struct vote_group vote_group;

/* Reductions a group offers directly (di-sim uses MAX to take the slowest rank's step time). */
typedef enum vote_reduce {
    VOTE_REDUCE_AND = 0,
    VOTE_REDUCE_OR,
    VOTE_REDUCE_MAX,
    VOTE_REDUCE_SUM,
    VOTE_REDUCE_WORK, /* OR, kept apart from VOTE_REDUCE_OR so a mixed-up call is caught */
    VOTE_REDUCE_COUNT
} vote_reduce;

/* Creates a group of n_ranks (1 .. 4096). timeout_ms > 0 bounds each wait: a rank that waits
 * longer cancels the group and gets DI_ETIMEDOUT (0 waits forever).
 * DI_OK; DI_EINVAL; DI_ENOMEM; DI_EINTERNAL when a mutex cannot be made. */
di_status vote_group_create(uint32_t n_ranks, uint32_t timeout_ms, const di_alloc *a,
                            vote_group **out, di_error *err);
/* NULL-safe. No rank may be inside a call. */
void vote_group_destroy(vote_group *g);
/* The vote struct rank r passes to its scheduler; r < n_ranks (asserted). */
vote vote_group_rank(vote_group *g, uint32_t rank);
/* All-reduce of a 64-bit value: blocks until every rank called it with the same op.
 * DI_OK with *out set; DI_ECANCELED; DI_ETIMEDOUT; DI_EINTERNAL (ops differ: lockstep lost). */
di_status vote_group_reduce(vote_group *g, uint32_t rank, vote_reduce op, uint64_t value,
                            uint64_t *out, di_error *err);
/* Wakes every waiting rank with DI_ECANCELED and fails every later call: a rank that hits an
 * error calls this so the others do not wait for it forever. */
void vote_group_cancel(vote_group *g);
/* Completed collectives so far. */
uint64_t vote_group_rounds(vote_group *g);

#endif
