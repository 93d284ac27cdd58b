/* log_limit.h: rate-limited log lines for failures that can repeat per item.
 *
 * A full disk fails every put; one line per failed item floods the log. A di_log_limit lets
 * the first `burst` lines of each interval through and counts the rest; the first line after
 * the interval (or di_log_limit_flush, called periodically and at shutdown) reports them:
 *
 *     1,234 more puts failed in the last 10 s (last: ... disk full ...)
 *
 * The struct belongs to its embedder (one per kind of failure, in the service or store
 * struct); calls are thread-safe. The clock is passed in (di_mono_ns), so tests drive time.
 */
#ifndef DI_UTIL_LOG_LIMIT_H
#define DI_UTIL_LOG_LIMIT_H

#include <pthread.h>
#include <stdint.h>

#include "common/util/log.h"

typedef struct di_log_limit {
    pthread_mutex_t mu;       /* guards everything below */
    const char *what;         /* what a suppressed line was: "puts failed" (static string) */
    di_log_level level;       /* level of the lines and of the summary */
    uint32_t burst;           /* lines let through per interval */
    uint64_t interval_ns;     /* interval length */
    int started;              /* 1 once the first line opened an interval */
    uint64_t window_start_ns; /* start of the current interval (caller's clock) */
    uint32_t logged;          /* lines let through in the current interval */
    uint64_t suppressed;      /* lines counted instead of logged since the last summary */
    uint64_t suppressed_total; /* since init (tests, stats) */
    char last[384];           /* the last suppressed line */
} di_log_limit;

/* burst >= 1 and interval_ms >= 1 (clamped up). what must outlive the limiter. */
void di_log_limit_init(di_log_limit *l, const char *what, di_log_level level, uint32_t burst,
                       uint64_t interval_ms);
void di_log_limit_destroy(di_log_limit *l);

/* Logs the line, or counts it when this interval's burst is spent. now_ns: di_mono_ns(). */
void di_log_limited(const di_logger *lg, di_log_limit *l, uint64_t now_ns, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));

/* Writes the summary of the lines counted so far if the interval is over (or force is set).
 * Returns how many lines the summary reported (0: none written). */
uint64_t di_log_limit_flush(const di_logger *lg, di_log_limit *l, uint64_t now_ns, int force);

#endif
