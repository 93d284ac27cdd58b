/* moe.h: the MoE layers of one rank of an expert-parallel group (docs/ep.md).
 *
 * Every rank runs attention for its own requests; at each backbone layer's MoE the gate's
 * (row, expert) pairs go to the ranks whose slots hold the chosen copies (place.h), the
 * experts run there, and the outputs come back and are combined on the row's rank in the
 * order of the one-rank kernel (kern_moe_experts: a row's experts by ascending id, then the
 * shared expert, summed in double and rounded to BF16 once). A routed expert's output for a
 * row does not depend on the other rows it runs with, so the result is the one-rank result,
 * bit for bit.
 *
 * Rounds. One exchange ROUND is two all-to-alls: dispatch (each rank sends every rank a
 * segment: the layer, its done flag and its pairs with their rows) and combine (each rank
 * returns the outputs of the pairs it served). A rank inside its forward joins one round per
 * MoE layer; a rank whose step has ended (ep_moe_step_end) keeps joining rounds with an empty,
 * done segment, serving the others, until a round in which every rank is done. Ranks may so
 * run different numbers of layers in a step (a placeholder step runs none, a prefill chunk or
 * a decode with drafts one forward each); no rank waits for a vote inside a step.
 *
 * EPLB. The serving rank counts the pairs each of its slots served, per step. Every
 * eplb_interval steps (steps are in lockstep, so every rank re-plans at the same step) the
 * ranks sum the window's per-slot counts, fold them into per-expert loads, and run
 * eplb_rebalance for each layer; a layer keeps its layout unless the plan is strictly better
 * (the guard). A layer that changed at the previous re-plan is first looked at again
 * (eplb_judge): when its new layout is worse on this window than the one it replaced, it
 * goes back to that one instead of planning (a revert is never reverted). Experts that change slots move: a rank whose new slot needs an expert it does
 * not hold receives its weights from the lowest rank that held it, in one all-to-all.
 *
 * Weights. Each rank keeps its own slots' routed experts in buffers of the backend's memory,
 * copied from the checkpoint at start (loaded with ep_moe_keep_expert, the checkpoint holds
 * only those) and from other ranks after a re-plan. The shared expert and the draft stages'
 * MoE run on every rank.
 *
 * Backends. The experts' weights, the rows and the outputs live in the backend's memory; the
 * transport is the group's (CPU sockets). On a device backend (kern_backend.device_memory)
 * the rows for each destination are gathered on the device (copy_rows) and copied once a
 * destination into pinned host segments; a served segment's rows, slots and weights go to the
 * device, run with the backend's moe_experts there and their outputs come back; the outputs
 * received go to the device and the combine (kern_ep.h) runs there, the shared expert with
 * the backend's linear ops. With a device transport (ep_moe_options.dx: NCCL, nccl_xport.h)
 * the segments carry only the header and the pairs' records; the gathered rows and the
 * outputs go device to device, one contiguous range a destination.
 */
#ifndef DI_EP_MOE_H
#define DI_EP_MOE_H

#include <stdbool.h>
#include <stdint.h>

#include "common/ep/group.h"
#include "common/ep/place.h"
#include "common/model/weights.h"
#include "common/util/status.h"
#include "kernels/kern_ep.h"
#include "kernels/kernels.h"

typedef struct ep_moe ep_moe;

/* A transport of device buffers (NCCL: nccl_xport.h), in place of the group's host segments
 * for the rows and the outputs: rank d gets send + send_off[d] .. + send_len[d]; rank s's
 * bytes land at recv + recv_off[s] (recv_len[s] bytes, known from the dispatch headers, which
 * still cross the group). Every rank calls it in lockstep, twice a round (dispatch, combine),
 * also with nothing to send. */
typedef struct ep_dev_xport {
    void *ctx;
    di_status (*alltoallv)(void *ctx, const void *send, const uint64_t *send_off,
                           const uint64_t *send_len, void *recv, const uint64_t *recv_off,
                           const uint64_t *recv_len, di_error *err);
} ep_dev_xport;

/* The group itself as a device transport for a backend of host memory (the CPU backend): the
 * byte ranges cross the group's sockets. It checks the path the device transport takes on a
 * machine without GPUs. */
void ep_dev_xport_group(ep_group *g, ep_dev_xport *out);

typedef struct ep_moe_options {
    ep_group *group;         /* the rank group (must outlive the MoE) */
    const kern_backend *be;  /* the backend that runs the experts */
    const kern_ep_ops *dev_ops; /* its exchange ops (kern_ep_ops_cuda); NULL: a host-memory
                                   backend's (kern_ep_ops_host); required on a device backend */
    const model_weights *w;  /* the checkpoint: the source of this rank's slots at start */
    uint32_t min_redundant;  /* redundant slots at least (eplb_redundant_count rounds up) */
    uint32_t eplb_interval;  /* steps between re-plans; 0 = never */
    const ep_dev_xport *dx;  /* the rows and outputs go through it (backend memory, laid out by
                                destination); NULL: inside the group's host segments */
} ep_moe_options;

/* What the rank did (ep_moe_get_stats). */
typedef struct ep_moe_stats {
    uint32_t slots_per_rank; /* expert slots on each rank */
    uint32_t redundant;      /* slots beyond the experts, in the group */
    uint64_t steps;          /* ep_moe_step_end calls */
    uint64_t rounds;         /* exchange rounds joined */
    uint64_t serve_rounds;   /* of those, after this rank's step had ended */
    uint64_t pairs_sent;     /* (row, expert) pairs of this rank's rows */
    uint64_t pairs_served;   /* pairs this rank's slots ran */
    uint64_t replans;        /* re-plans that changed at least one layer (reverts count) */
    uint64_t layers_replanned; /* layers that took a new plan */
    uint64_t layers_kept;    /* layers the guard kept (plan not strictly better) */
    uint64_t replans_reverted; /* layers that went back to their previous layout: the new
                                  one was worse on the next window (eplb_judge) */
    uint64_t experts_moved;  /* expert weights this rank received from others */
    uint64_t bytes_moved;    /* bytes of them */
    uint64_t slot_bytes;     /* backend memory of this rank's expert slots (its resident
                                routed experts: slots_per_rank x layers x one expert) */
    uint64_t xchg_ns;        /* time inside the exchange's all-to-alls (waiting for the
                                other ranks included) */
    uint64_t dev_bytes_sent; /* rows and outputs sent through the device transport */
} ep_moe_stats;

/* Creates the MoE of this rank: the start-up layout (eplb.h) of every backbone layer on
 * world x slots_per_rank slots, and this rank's slot weights, copied from w (which needs
 * only those: ep_moe_keep_expert). DI_EINVAL (options, a device backend without dev_ops, a
 * model without routed experts, an expert of this rank not loaded), DI_ENOMEM. */
di_status ep_moe_create(const ep_moe_options *o, ep_moe **out, di_error *err);
void ep_moe_free(ep_moe *m); /* NULL-safe; before the backend is closed */

/* The checkpoint filter of a rank (model_load_options.keep_expert): the experts of its
 * start-up slots. */
typedef struct ep_expert_filter {
    uint32_t rank, world, min_redundant;
} ep_expert_filter;
bool ep_moe_keep_expert(void *filter, const model_config *c, uint32_t layer, uint32_t expert);

/* The forward's hook (fwd_options.moe_fn): the MoE of backbone layer `layer` on this rank's
 * rows, p as the one-rank kernel would get it (its experts table is not read). Writes p->y.
 * DI_OK; the group's failures; DI_EPROTO (a malformed segment); the backend's codes. */
di_status ep_moe_layer(void *m, uint32_t layer, const kern_moe_experts *p, di_error *err);

/* Ends this rank's step: serves rounds until every rank has ended its step, then counts the
 * step and re-plans when the interval is reached. The group's failures, DI_ENOMEM. */
di_status ep_moe_step_end(ep_moe *m, di_error *err);

const ep_moe_stats *ep_moe_get_stats(const ep_moe *m);
/* The pairs this rank's slots served in the last ended step, per backbone layer ([layers]). */
const uint64_t *ep_moe_last_step_pairs(const ep_moe *m);
uint32_t ep_moe_layers(const ep_moe *m);
/* The current placement of a backbone layer. */
const ep_placement *ep_moe_placement(const ep_moe *m, uint32_t layer);

#endif
