/* log.h: logging through a callback chosen by the embedder.
 *
 * Library code (common/, kernels/) never prints; where it has something worth a debug line it
 * calls di_log() on the di_logger it was handed, and the level is checked before any
 * formatting. Services build one logger in main.c (di_logger_stderr) and pass it down. A NULL
 * logger drops everything.
 */
#ifndef DI_UTIL_LOG_H
#define DI_UTIL_LOG_H

#include <stdarg.h>

typedef enum di_log_level {
    DI_LOG_ERROR = 0,
    DI_LOG_WARN = 1,
    DI_LOG_INFO = 2,
    DI_LOG_DEBUG = 3,
} di_log_level;

/* Receives one formatted line (no trailing newline). */
typedef void (*di_log_fn)(void *userdata, di_log_level level, const char *line);

typedef struct di_logger {
    di_log_fn fn;       /* sink; NULL drops every line */
    void *userdata;     /* passed to fn */
    di_log_level level; /* lines above this level are dropped before formatting */
    const char *prefix; /* prepended to every line ("kvstore", "rank 3"); may be NULL */
} di_logger;

/* True when a line at `level` would be emitted: test this before costly argument work. */
static inline int di_log_enabled(const di_logger *lg, di_log_level level)
{
    return lg && lg->fn && level <= lg->level;
}

void di_log(const di_logger *lg, di_log_level level, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
void di_vlog(const di_logger *lg, di_log_level level, const char *fmt, va_list ap);

/* A logger writing "2026-11-29T16:36:17.123Z INFO prefix: line" to stderr. */
di_logger di_logger_stderr(di_log_level level, const char *prefix);

/* Parses "error", "warn", "info" or "debug"; returns -1 for anything else. */
int di_log_level_parse(const char *s);

#endif
