/* placement.h: which prefill and decode rank a request goes to, and which ranks are in
 * rotation. Pure: no I/O, no clock (callers pass now_ns), no threads (callers lock). Prefix pl_.
 *
 * Ranks come from flags or from self-registration; both send heartbeats with their load.
 *
 * Prefill rank: the least estimated time to start, over ranks in rotation,
 *     t_i = (queued_i + max(prompt - cached, 0)) / rate_i
 * where queued_i is the prompt tokens rank i still has to prefill (its last report plus what
 * the router sent it since), prompt the request's prompt tokens, cached the tokens of this
 * prompt the KV store already holds (they are loaded, not computed), and rate_i the rank's
 * prefill rate in tokens per second (pl_prefill_rate), the first of:
 *   1. the rate the rank reports in its heartbeat (GetLoad: prompt tokens per second of its
 *      prefill steps over the last 10 s);
 *   2. the router's own measurement (an exponential average of its prefill calls' tokens over
 *      their seconds);
 *   3. for a rank not measured yet: the median rate of the measured prefill ranks
 *      (cfg.default_prefill_rate when none is), but no more than its first prefill's tokens
 *      over the time that prefill has been out: a rank still busy with its first prefill is
 *      known to be at most that fast, so a slow new rank stops taking requests while its
 *      first one is running instead of taking every one of them.
 * Ties go to the lower index.
 * Decode rank: among ranks in rotation with at least the blocks the request needs, the fewest
 * running requests, then the most free blocks, then the lower index.
 * Round-robin (for comparison): the next rank in rotation after the last one picked.
 *
 * Health, per rank:
 *     HEALTHY --(missed >= suspect_after heartbeats, or a failed call)--> SUSPECT
 *     SUSPECT --(missed >= out_after heartbeats, or out_after_failures failed calls in a row)
 *             --> OUT
 *     SUSPECT/OUT --(a heartbeat, then healthy_after good heartbeats or calls in a row)
 *             --> HEALTHY
 * "In rotation" means HEALTHY; when no rank of a role is healthy, SUSPECT ones are used rather
 * than failing; OUT ranks never get work. A failed prefill is retried once, on another rank:
 * pick again with `exclude` set to the rank that failed.
 */
#ifndef DI_ROUTER_PLACEMENT_H
#define DI_ROUTER_PLACEMENT_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/util/log.h"
#include "common/util/status.h"

#define PL_MAX_RANKS 256
#define PL_ADDR_MAX 128

typedef enum pl_role { PL_PREFILL = 0, PL_DECODE = 1 } pl_role;
typedef enum pl_health { PL_HEALTHY = 0, PL_SUSPECT = 1, PL_OUT = 2 } pl_health;
typedef enum pl_policy { PL_POLICY_ESTIMATE = 0, PL_POLICY_ROUND_ROBIN = 1 } pl_policy;

typedef struct pl_config {
    uint64_t heartbeat_ns;       /* the interval ranks send heartbeats at */
    uint32_t suspect_after;      /* missed heartbeats to become SUSPECT (>= 1) */
    uint32_t out_after;          /* missed heartbeats to go OUT (> suspect_after) */
    uint32_t out_after_failures; /* failed calls in a row to go OUT (>= 1) */
    uint32_t healthy_after;      /* good heartbeats or calls in a row to come back (>= 1) */
    double default_prefill_rate; /* tokens/s of a rank not measured while no rank is (> 0) */
    double rate_weight;          /* weight of a new measurement in the average, (0, 1] */
} pl_config;

/* What a heartbeat reports. */
typedef struct pl_load {
    uint64_t queued_tokens; /* prompt tokens waiting for prefill on the rank */
    uint32_t running;       /* requests decoding on the rank */
    uint32_t free_blocks;   /* KV blocks free on the rank */
    double prefill_rate;    /* the rank's prefill tokens/s over its last 10 s; 0: none yet */
} pl_load;

typedef struct pl_rank {
    char addr[PL_ADDR_MAX]; /* HOST:PORT */
    pl_role role;
    bool registered;        /* came by self-registration (else from a flag) */
    pl_health health;
    uint64_t last_beat_ns;  /* the last heartbeat (or when added) */
    uint32_t fails;         /* failed calls in a row */
    uint32_t goods;         /* good heartbeats or calls in a row while not HEALTHY */
    bool rate_measured;     /* rate comes from an observation */
    double rate;            /* prefill tokens/s observed by the router (rate_measured) */
    uint64_t first_sent_ns; /* not measured yet: when its first prefill was sent; 0: none out */
    uint64_t first_tokens;  /* the tokens that prefill computes */
    pl_load load;           /* last report, plus the router's own sends since */
} pl_rank;

typedef struct pl_table {
    pl_config cfg;
    pl_policy policy;
    pl_rank ranks[PL_MAX_RANKS];
    size_t n;
    size_t rr_next[2]; /* round-robin cursor per role */
    const di_logger *log; /* decisions at debug level; may be NULL */
} pl_table;

/* A default config: 1 s heartbeats, suspect after 2 missed, out after 5, out after 3 failed
 * calls, back after 2 good, 1,000 tokens/s default rate, weight 0.3. */
pl_config pl_config_default(void);

/* Checks cfg and fills t. DI_EINVAL names the bad field. */
di_status pl_init(pl_table *t, const pl_config *cfg, pl_policy policy, const di_logger *log,
                  di_error *err);

/* Adds a rank (or refreshes one with the same role and address: then registered and the
 * heartbeat time are updated). *idx receives its index. DI_EINVAL (address empty or too long),
 * DI_ENOSPC (PL_MAX_RANKS ranks). */
di_status pl_add(pl_table *t, pl_role role, const char *addr, bool registered, uint64_t now_ns,
                 size_t *idx, di_error *err);

/* A heartbeat with the rank's load. */
void pl_heartbeat(pl_table *t, size_t idx, uint64_t now_ns, const pl_load *load);

/* Applies missed heartbeats at time now_ns. */
void pl_tick(pl_table *t, uint64_t now_ns);

/* The outcome of a call to a rank. */
void pl_call_result(pl_table *t, size_t idx, bool ok);

/* A prefill of `tokens` computed tokens that took `seconds` on rank idx. */
void pl_observe_prefill(pl_table *t, size_t idx, uint64_t tokens, double seconds);

/* The prefill rate placement uses for rank idx at now_ns, tokens/s (the rules above; > 0). */
double pl_prefill_rate(const pl_table *t, size_t idx, uint64_t now_ns);

/* Picks a prefill rank for a prompt at now_ns; exclude is a rank not to use (SIZE_MAX: none).
 * Adds the computed tokens to the rank's queue. *est_s receives the estimate (may be NULL).
 * Returns the index, or -1 when no rank can take it. */
long pl_pick_prefill(pl_table *t, uint64_t prompt, uint64_t cached, size_t exclude,
                     uint64_t now_ns, double *est_s);

/* A prefill sent to idx finished (or failed): its computed tokens leave the queue (and a
 * first prefill is no longer out). */
void pl_prefill_done(pl_table *t, size_t idx, uint64_t computed_tokens);

/* Picks a decode rank with at least `blocks` free blocks; counts the request as running there
 * and takes the blocks. Returns the index or -1. */
long pl_pick_decode(pl_table *t, uint32_t blocks, size_t exclude);

/* A decode on idx ended: running and blocks given back. */
void pl_decode_done(pl_table *t, size_t idx, uint32_t blocks);

const char *pl_health_name(pl_health h);

#endif
