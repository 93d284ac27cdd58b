/* sampler_internal.h: the workspace layout and the helpers shared by the sampler's files.
 * Not part of the public API (sampler.h). */
#ifndef DI_SAMPLING_SAMPLER_INTERNAL_H
#define DI_SAMPLING_SAMPLER_INTERNAL_H

#include "common/sampling/sampler.h"

#define SAMPLER_HIST_BINS 2048u        /* radix digit of 11 bits */
#define SAMPLER_RESIDUAL_SLOT SAMPLER_DIST_SLOTS
#define SAMPLER_ALL_SLOTS (SAMPLER_DIST_SLOTS + 1)

/* Token ids and masses of one distribution (a slot). */
typedef struct sampler_slot {
    int32_t *ids;   /* [capacity] */
    uint32_t *mass; /* [capacity] */
} sampler_slot;

struct sampler_workspace {
    uint32_t capacity;  /* largest n_vocab a row may have */
    uint32_t *a_key;    /* [capacity] scratch pairs (key, id): key sample, weights, sort */
    int32_t *a_id;      /* [capacity] */
    uint32_t *b_key;    /* [capacity] second scratch pair set (selection, sort ping-pong) */
    int32_t *b_id;      /* [capacity] */
    uint32_t *c_key;    /* [capacity] candidates (ordered logit key, id) in id order */
    int32_t *c_id;      /* [capacity] */
    uint32_t *dense;    /* [capacity] per-token mass, all zero between calls */
    sampler_slot slot[SAMPLER_ALL_SLOTS]; /* caller slots, then the residual slot */
    uint32_t hist[3 * SAMPLER_HIST_BINS]; /* radix histograms (the sort counts 3 digits) */
    void *mem;          /* the one allocation behind every array */
};

/* Steps 1-9 into any slot (including the residual slot's neighbours); no argument checks
 * beyond the row itself. */
di_status sampler_process_slot(const sampler_row *row, sampler_workspace *ws, unsigned slot,
                               sampler_dist *out, di_error *err);

/* Sorts n (key, id) pairs by key ascending, stable (LSD radix, digits of 11, 11 and 10 bits);
 * the result is in (key, id) again. tmp_key/tmp_id need n entries, hist 3 * 2048. */
void sampler_sort_pairs(uint32_t *key, int32_t *id, uint32_t n, uint32_t *tmp_key,
                        int32_t *tmp_id, uint32_t *hist);

/* The draw index for threshold u in [0, 1): first index whose cumulative mass exceeds
 * floor(u * 2^53) * total / 2^53. */
uint32_t sampler_pick_index(const uint32_t *mass, uint32_t n, uint64_t total, double u);

/* Seed of a row: the request's, or the draft's for a draft row. */
uint64_t sampler_row_seed(const sampler_row *row);

#endif
