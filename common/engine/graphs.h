/* graphs.h: the recorded-graph sizes of decode steps and the choice of one per step.
 *
 * Sizes are the powers of two up to `interval` (8 by default), then every multiple of the
 * interval, up to max_rows = max_num_seqs * (1 + nextn); max_rows itself is always a size. A
 * step with R rows runs on the smallest size >= R and pads the difference with placeholder rows
 * that route nowhere. Example: max_num_seqs 4, nextn 5 -> 1, 2, 4, 8, 16, 24; max_num_seqs 64,
 * nextn 5 -> 1, 2, 4, 8, 16, 24, 32, ..., 384, and 37 rows run on the 40-row graph.
 */
#ifndef DI_ENGINE_GRAPHS_H
#define DI_ENGINE_GRAPHS_H

#include <stddef.h>
#include <stdint.h>

#include "common/util/status.h"

typedef struct graph_sizes {
    uint32_t *sizes;  /* ascending row counts, owned */
    size_t count;     /* number of sizes */
    uint32_t max_rows; /* largest size = max_num_seqs * (1 + nextn) */
} graph_sizes;

/* Builds the size list. interval must be >= 1, max_num_seqs >= 1.
 * DI_EINVAL for bad arguments, DI_ENOMEM; on failure *out is untouched. */
di_status graph_sizes_init(graph_sizes *out, uint32_t max_num_seqs, uint32_t nextn,
                           uint32_t interval, di_error *err);
void graph_sizes_free(graph_sizes *g);

/* Smallest size >= rows, or 0 when rows exceeds max_rows (the step must be split). rows 0
 * selects the smallest graph (a placeholder step still runs one row). */
uint32_t graph_sizes_select(const graph_sizes *g, uint32_t rows);

#endif
