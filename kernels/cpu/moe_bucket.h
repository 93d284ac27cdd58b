/* moe_bucket.h: the (row, slot) pairs of a moe_experts call bucketed by expert and cut into
 * groups of at most `cap` rows. The C twin of the device bucketing of the CUDA backend
 * (kernels/cuda/moe_bucket.cu), which builds the same arrays on the device so that a decode
 * step never reads the expert ids back (tests/gpu/check_moe.c compares the two). */
#ifndef DI_KERNELS_CPU_MOE_BUCKET_H
#define DI_KERNELS_CPU_MOE_BUCKET_H

#include <stdint.h>

#include "common/util/status.h"

/* The bucketing of one call; every array is the caller's, of the size its comment gives. */
typedef struct kern_moe_buckets {
    uint32_t *count;            /* [n_experts] pairs routed to each expert */
    uint32_t *start;            /* [n_experts + 1] first pair of each bucket (exclusive scan) */
    int32_t *pair;              /* [n_pairs] row * top_k + slot, in bucket order: ascending
                                 * expert, then ascending pair */
    int32_t *pos;               /* [n_pairs] pos[t * top_k + j]: bucket index of row t's j-th
                                 * output, j in ascending (expert, slot) order */
    uint32_t *group_expert;     /* [kern_moe_max_groups()] expert of each group */
    uint32_t *group_start;      /* [same] its first pair in bucket order */
    uint32_t *group_rows;       /* [same] its pairs, 1..cap */
    uint32_t n_groups;          /* groups written: each bucket in pieces of cap, ascending
                                 * expert, pieces in order */
} kern_moe_buckets;

/* The most groups n_pairs pairs over n_experts experts can make with pieces of cap:
 * floor((n_pairs + (cap - 1) * min(n_experts, n_pairs)) / cap), as a bucket of c pairs makes
 * floor((c + cap - 1) / cap) groups. The grid of the device's grouped launches. 0 when cap is
 * 0. Inline: the CUDA backend uses it without this library. */
static inline uint32_t kern_moe_max_groups(uint32_t n_pairs, uint32_t n_experts, uint32_t cap)
{
    if (cap == 0)
        return 0;
    uint64_t used = n_experts < n_pairs ? n_experts : n_pairs;
    return (uint32_t)(((uint64_t)n_pairs + (uint64_t)(cap - 1) * used) / cap);
}

/* Buckets ids [n_rows, top_k] (each in [0, n_experts)) into *out. DI_OK; DI_EINVAL (an id out
 * of range, naming it; cap or top_k 0). */
di_status kern_moe_bucket(const int32_t *ids, uint32_t n_rows, uint32_t top_k, uint32_t n_experts,
                          uint32_t cap, kern_moe_buckets *out, di_error *err);

#endif
