#include "common/util/log.h"

#include <stdio.h>
#include <string.h>
#include <strings.h>
#include <time.h>

static const char *level_name(di_log_level level)
{
    switch (level) {
    case DI_LOG_ERROR:
        return "ERROR";
    case DI_LOG_WARN:
        return "WARN";
    case DI_LOG_INFO:
        return "INFO";
    case DI_LOG_DEBUG:
        return "DEBUG";
    }
    return "?";
}

void di_vlog(const di_logger *lg, di_log_level level, const char *fmt, va_list ap)
{
    if (!di_log_enabled(lg, level))
        return;
    char line[1024];
    int n = 0;
    if (lg->prefix)
        n = snprintf(line, sizeof(line), "%s: ", lg->prefix);
    if (n < 0 || (size_t)n >= sizeof(line))
        n = 0;
    vsnprintf(line + n, sizeof(line) - (size_t)n, fmt, ap);
    for (char *p = line; *p; p++)
        if (*p == '\n' || *p == '\r')
            *p = ' ';
    lg->fn(lg->userdata, level, line);
}

void di_log(const di_logger *lg, di_log_level level, const char *fmt, ...)
{
    if (!di_log_enabled(lg, level))
        return;
    va_list ap;
    va_start(ap, fmt);
    di_vlog(lg, level, fmt, ap);
    va_end(ap);
}

static void stderr_sink(void *userdata, di_log_level level, const char *line)
{
    (void)userdata;
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    struct tm tm;
    gmtime_r(&ts.tv_sec, &tm);
    char stamp[32];
    strftime(stamp, sizeof(stamp), "%Y-%m-%dT%H:%M:%S", &tm);
    fprintf(stderr, "%s.%03ldZ %s %s\n", stamp, ts.tv_nsec / 1000000L, level_name(level), line);
}

di_logger di_logger_stderr(di_log_level level, const char *prefix)
{
    di_logger lg = {.fn = stderr_sink, .userdata = NULL, .level = level, .prefix = prefix};
    return lg;
}

int di_log_level_parse(const char *s)
{
    if (!s)
        return -1;
    static const char *const names[] = {"error", "warn", "info", "debug"};
    for (int i = 0; i < 4; i++)
        if (strcasecmp(s, names[i]) == 0)
            return i;
    return -1;
}
