/* eplb.h: expert placement across the GPUs of an expert-parallel group (EPLB; DESIGN.md §3,
 * explainer Pass 1 "Spreading work across chips", Pass 3 "When one expert gets too much").
 *
 * Words. A logical EXPERT is one of the model's routed experts (0..E-1). A SLOT is a place for
 * one expert's weights on one GPU; each GPU has the same number of slots. A COPY is an expert
 * in a slot; an expert may have several, and the gate splits its tokens evenly between them,
 * so a copy carries (expert's tokens) / (expert's copy count). A WINDOW is the tokens routed
 * to each expert at each of a few recent steps.
 *
 * Balance. A GPU's load at a step is the sum of its copies' loads. The layer waits for the
 * busiest GPU, so
 *     moe_lb = sum over steps of max GPU load / sum over steps of mean GPU load  (>= 1).
 *
 * Redundant slots. Slots beyond E hold extra copies. Their count is rounded up so that
 * (E + redundant) % ep_size == 0: EP8 with 384 experts and at least 32 -> 32 (416 slots, 52 a
 * GPU); EP63 with at least 63 -> 447 % 63 = 6, so 57 more: 120 (504 slots, 8 a GPU).
 *
 * Start-up layout. Slot s (counted GPU by GPU: GPU g holds slots g*S .. g*S+S-1) holds expert
 * s mod E: slots 0..E-1 hold each expert once, the redundant slots copy experts 0, 1, 2, ... in
 * index order regardless of load. 5 experts on 2 GPUs of 3 slots: {e0 e1 e2} {e3 e4 e0}.
 *
 * The plan, from a window:
 *   Stage A (replicate): every expert starts with one copy. Each redundant slot, one at a time,
 *     goes to the expert whose extra copy leaves the smallest sum over steps of the hottest
 *     single copy (of any expert) at that step. Ties go to the lower expert id. No cap on an
 *     expert's copies.
 *   Stage B (place): copies are ordered by their load summed over the window, heaviest first
 *     (ties: lower expert id; copies of one expert are interchangeable). Each goes to the GPU,
 *     among those with a free slot, that minimises the sum over steps of the busiest GPU's load
 *     after placing it. Ties go to the lower GPU. Within a GPU, slots fill in placement order.
 *   Guard (ours, DESIGN.md §3): the greedy plan can be worse than the layout it replaces on
 *     the very window it was planned from (explainer, "When greedy makes it worse"). The
 *     current layout is kept unless the plan's moe_lb is strictly lower.
 *   Second look (eplb_judge): a plan is fitted to the window it was planned from; when the
 *     load shifts it can be worse on the next window than the layout it replaced. On the
 *     window after a change, the applied layout's moe_lb is compared with the one the previous
 *     layout would have had on that same window; the change is reverted when the applied
 *     layout's is strictly higher. A revert is itself a change, but it is never reverted: two
 *     reverts of one layer always have a plan the guard accepted between them.
 *
 * Scores are sums of fractions, compared as doubles: two scores within a relative 1e-9 of each
 * other count as a tie (so float rounding cannot break the tie rules), and the guard needs the
 * plan to be lower by more than that.
 */
#ifndef DI_ENGINE_EPLB_H
#define DI_ENGINE_EPLB_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/util/status.h"

/* A slot holding no expert (only in layouts given to eplb_moe_lb; plans fill every slot). */
#define EPLB_NO_EXPERT (-1)
/* Bounds on one call's sizes. */
#define EPLB_MAX_EXPERTS (1u << 16)
#define EPLB_MAX_STEPS (1u << 20)
#define EPLB_MAX_WINDOW_CELLS (1u << 26)  /* steps x experts */
#define EPLB_MAX_SLOTS (1u << 20)         /* GPUs x slots per GPU */
/* Most elementary steps one stage may take: stage A costs redundant x steps x experts, stage B
 * slots x GPUs x steps (about half a minute on one core at the bound). Larger shapes are
 * refused rather than left to run for hours. */
#define EPLB_MAX_WORK (1ull << 33)
/* Relative tolerance under which two scores tie. */
#define EPLB_TIE_REL 1e-9

/* The load of a window, written by the caller (from the per-slot arrival counts). */
typedef struct eplb_window {
    const double *load;   /* [num_steps][num_experts] tokens routed to each logical expert at
                             each step; finite, >= 0, some > 0 */
    uint32_t num_steps;   /* steps in the window; >= 1 */
    uint32_t num_experts; /* logical experts E; >= 1 */
} eplb_window;

/* Which expert sits in each slot. Written by the eplb_* functions that fill one (or by the
 * caller for a current layout); owns slot_expert. */
typedef struct eplb_layout {
    uint32_t num_gpus;      /* GPUs in the expert-parallel group; >= 1 */
    uint32_t slots_per_gpu; /* expert slots per GPU; >= 1 */
    int32_t *slot_expert;   /* [num_gpus][slots_per_gpu] expert id in [0, E), or
                               EPLB_NO_EXPERT; owned */
} eplb_layout;

/* What eplb_rebalance decided. Owns its layout. */
typedef struct eplb_decision {
    eplb_layout layout;    /* the layout to use: the plan, or a copy of the current one */
    double moe_lb_current; /* current layout's moe_lb on the window */
    double moe_lb_plan;    /* greedy plan's moe_lb on the window */
    bool kept_current;     /* true when the plan was not strictly better */
} eplb_decision;

/* What eplb_judge decided on the window after a change. */
typedef struct eplb_verdict {
    double moe_lb_applied;  /* the applied layout's moe_lb on the window */
    double moe_lb_previous; /* the layout it replaced, on the same window */
    bool revert;            /* true: return to the previous layout */
} eplb_verdict;

/* The second look at a change (see above), on the window that followed it. applied is the
 * layout in use, previous the one it replaced (same shape, every expert at least once, no
 * empty slot). was_revert: the change was itself a revert, which is kept (both moe_lb are
 * still given). DI_EINVAL for a bad window or layouts of different shapes; *out written on
 * success. */
di_status eplb_judge(const eplb_window *w, const eplb_layout *applied,
                     const eplb_layout *previous, bool was_revert, eplb_verdict *out,
                     di_error *err);

/* Redundant-slot count: the smallest R >= min_redundant with (num_experts + R) % ep_size == 0.
 * DI_EINVAL when num_experts or ep_size is 0 or the total passes EPLB_MAX_SLOTS. *out written
 * only on success. */
di_status eplb_redundant_count(uint32_t num_experts, uint32_t min_redundant, uint32_t ep_size,
                               uint32_t *out, di_error *err);

/* Allocates a layout with every slot EPLB_NO_EXPERT. DI_EINVAL for zero or too many slots,
 * DI_ENOMEM. *out untouched on failure. */
di_status eplb_layout_init(eplb_layout *out, uint32_t num_gpus, uint32_t slots_per_gpu,
                           di_error *err);
/* Frees slot_expert and zeroes the struct. NULL-safe. */
void eplb_layout_free(eplb_layout *l);

/* The start-up layout (see above) for num_experts experts on num_gpus x slots_per_gpu slots.
 * DI_EINVAL when there are fewer slots than experts; DI_ENOMEM. *out untouched on failure. */
di_status eplb_startup_layout(uint32_t num_experts, uint32_t num_gpus, uint32_t slots_per_gpu,
                              eplb_layout *out, di_error *err);

/* Checks a layout against E experts: ids in [0, E) or EPLB_NO_EXPERT (only when allow_empty),
 * and, when every_expert, each expert has at least one copy. DI_EINVAL naming the GPU and
 * slot otherwise. */
di_status eplb_layout_check(const eplb_layout *l, uint32_t num_experts, bool allow_empty,
                            bool every_expert, di_error *err);

/* moe_lb of a layout on a window. Empty slots are allowed; an expert with tokens in the
 * window must have a copy. DI_EINVAL for a bad window or layout; *out written on success. */
di_status eplb_moe_lb(const eplb_window *w, const eplb_layout *l, double *out, di_error *err);

/* Stage A: copies[e] (>= 1, summing to E + redundant) for the window. copies is caller-owned
 * with num_experts entries, written only on success. DI_EINVAL for a bad window or work above
 * EPLB_MAX_WORK. */
di_status eplb_replicate(const eplb_window *w, uint32_t redundant, uint32_t *copies,
                         di_error *err);

/* Stage B: places copies[e] copies of each expert on num_gpus x slots_per_gpu slots. The copy
 * counts must be >= 1 and sum to exactly num_gpus * slots_per_gpu. DI_EINVAL (also for work
 * above EPLB_MAX_WORK), DI_ENOMEM; *out untouched on failure. */
di_status eplb_place(const eplb_window *w, const uint32_t *copies, uint32_t num_gpus,
                     uint32_t slots_per_gpu, eplb_layout *out, di_error *err);

/* Stage A then stage B for every slot of num_gpus x slots_per_gpu (at least E of them). */
di_status eplb_plan(const eplb_window *w, uint32_t num_gpus, uint32_t slots_per_gpu,
                    eplb_layout *out, di_error *err);

/* Plans on the current layout's shape and applies the guard. current must give every expert
 * at least one copy and hold no empty slot. DI_EINVAL, DI_ENOMEM; *out untouched on
 * failure. */
di_status eplb_rebalance(const eplb_window *w, const eplb_layout *current, eplb_decision *out,
                         di_error *err);
/* Frees the decision's layout. NULL-safe. */
void eplb_decision_free(eplb_decision *d);

#endif
