/* place.h: where the experts of one MoE layer sit across the ranks of a group (docs/ep.md).
 *
 * A layout from the EPLB policy (eplb.h) says which logical expert each PHYSICAL slot holds;
 * physical slot p lives on rank p / slots_per_rank as its local slot p % slots_per_rank. An
 * expert may have several copies (redundant slots). The placement adds the logical ->
 * physical map: expert e's copies are its slots in ascending order, and the gate sends the
 * n-th token routed to e in a step (rows in step order, a row's top-k in gate order) to copy
 * n mod (copies of e). The choice depends only on the step's own routing, so every rank makes
 * the same one and the copies of an expert share its tokens evenly.
 */
#ifndef DI_EP_PLACE_H
#define DI_EP_PLACE_H

#include <stdint.h>

#include "common/engine/eplb.h"
#include "common/util/status.h"

typedef struct ep_placement {
    uint32_t n_ranks;        /* ranks of the group */
    uint32_t slots_per_rank; /* expert slots on each rank */
    uint32_t n_experts;      /* logical experts E */
    int32_t *slot_expert;    /* [n_ranks * slots_per_rank] expert of each physical slot (owned) */
    uint32_t *copy_start;    /* [E + 1] expert e's copies are copies[copy_start[e] ..
                                copy_start[e + 1]) (owned) */
    uint32_t *copies;        /* [n_ranks * slots_per_rank] physical slots by expert, ascending
                                (owned) */
} ep_placement;

/* Builds the placement of a layout that holds every expert at least once and no empty slot.
 * DI_EINVAL (the layout check's message), DI_ENOMEM; *out untouched on failure. */
di_status ep_placement_build(const eplb_layout *l, uint32_t n_experts, ep_placement *out,
                             di_error *err);
/* Frees the arrays and zeroes the struct. NULL-safe. */
void ep_placement_free(ep_placement *p);

/* The physical slot of the nth token routed to expert e in a step (e < n_experts). */
static inline uint32_t ep_placement_pick(const ep_placement *p, uint32_t e, uint32_t nth)
{
    uint32_t n = p->copy_start[e + 1] - p->copy_start[e];
    return p->copies[p->copy_start[e] + nth % n];
}

/* The layout view of a placement (borrows slot_expert). */
static inline eplb_layout ep_placement_layout(const ep_placement *p)
{
    return (eplb_layout){.num_gpus = p->n_ranks, .slots_per_gpu = p->slots_per_rank,
                         .slot_expert = p->slot_expert};
}

#endif
