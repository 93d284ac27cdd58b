/* metrics.h: a small metrics registry (counters, gauges, histograms) with one series per
 * instance plus a total, and the Prometheus text exposition (version 0.0.4). Prefix: met_.
 *
 * Families come from a table (met_def rows) fixed at creation. Every update names an
 * instance ("10.0.0.5:7001", or NULL for work not tied to one) and changes both that
 * instance's series (label rank="...": Prometheus keeps `instance` for the scrape target) and
 * the total series (no rank label), so a
 * dashboard sums nothing: it reads the total, or filters by instance. Series per family are
 * bounded (MET_MAX_SERIES); updates for instances past the bound go to the total only. Every
 * series also carries model_name. Thread-safe: one mutex.
 */
#ifndef DI_ROUTER_METRICS_H
#define DI_ROUTER_METRICS_H

#include <stddef.h>

#include "common/util/status.h"

#define MET_MAX_SERIES 64  /* instance series per family (the total not counted) */
#define MET_MAX_BUCKETS 32 /* histogram buckets, +Inf not counted */

typedef enum met_type { MET_COUNTER = 0, MET_GAUGE = 1, MET_HISTOGRAM = 2 } met_type;

typedef struct met_def {
    const char *name;       /* "vllm:time_to_first_token_seconds" */
    met_type type;
    const char *help;       /* one line */
    const double *buckets;  /* histogram upper bounds, increasing; NULL otherwise */
    size_t n_buckets;       /* <= MET_MAX_BUCKETS */
} met_def;

typedef struct met_registry met_registry;

/* Returns DI_OK with *out; DI_EINVAL for a bad table (the message names the row); DI_ENOMEM. */
di_status met_new(const met_def *defs, size_t n, const char *model_name, met_registry **out,
                  di_error *err);
void met_free(met_registry *r); /* NULL-safe */

/* Adds v (>= 0 for counters) to family `fam` (its row index). */
void met_add(met_registry *r, size_t fam, const char *instance, double v);
/* Records one observation in a histogram. */
void met_observe(met_registry *r, size_t fam, const char *instance, double v);

/* The exposition text, malloc'd; NULL when out of memory. */
char *met_render(met_registry *r);

/* The value of a counter or gauge series (instance NULL: the total); 0 when absent. */
double met_value(met_registry *r, size_t fam, const char *instance);

#endif
