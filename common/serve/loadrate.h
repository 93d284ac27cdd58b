/* loadrate.h: a rate over a recent window, for GetLoad's measured figures (prefill tokens per
 * second of engine time, decode step time).
 *
 * Each engine step adds a sample: an amount (prompt tokens, decode steps) and the engine time
 * it took. Samples land in one-second buckets of a ring covering LOADRATE_WINDOW_S seconds; the
 * rate is the amount over the engine time of the buckets inside the window that ends now, so a
 * rank that slowed down reports its new speed within the window, not an average since start.
 * While the window holds no sample (an idle rank) the rate is the last one measured; 0 until the
 * first sample.
 *
 * Time is passed in (monotonic nanoseconds), so tests drive it with a fake clock. Not thread
 * safe: one writer, callers lock around it.
 */
#ifndef DI_SERVE_LOADRATE_H
#define DI_SERVE_LOADRATE_H

#include <stdint.h>

#define LOADRATE_WINDOW_S 10u

typedef struct loadrate_bucket {
    uint64_t second;   /* now_ns / 1e9 of the samples it holds; 0 = empty */
    double amount;     /* amount added in that second (tokens, steps) */
    uint64_t busy_ns;  /* engine time those samples took, ns */
} loadrate_bucket;

typedef struct loadrate {
    loadrate_bucket b[LOADRATE_WINDOW_S]; /* ring, indexed by second % LOADRATE_WINDOW_S */
    double last;                          /* the last rate measured (amount per second) */
} loadrate;

/* Empties r. */
void loadrate_init(loadrate *r);
/* Adds `amount` done in `busy_ns` of engine time, at now_ns. A sample with busy_ns 0 is
 * ignored. */
void loadrate_add(loadrate *r, uint64_t now_ns, double amount, uint64_t busy_ns);
/* Amount per second of engine time over the window ending at now_ns; the last rate measured
 * when the window holds no sample; 0 before the first sample. */
double loadrate_per_s(loadrate *r, uint64_t now_ns);

#endif
