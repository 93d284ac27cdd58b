#include "common/util/log_limit.h"

#include <stdarg.h>
#include <stdio.h>
#include <string.h>

void di_log_limit_init(di_log_limit *l, const char *what, di_log_level level, uint32_t burst,
                       uint64_t interval_ms)
{
    memset(l, 0, sizeof(*l));
    pthread_mutex_init(&l->mu, NULL);
    l->what = what ? what : "lines";
    l->level = level;
    l->burst = burst ? burst : 1;
    l->interval_ns = (interval_ms ? interval_ms : 1) * 1000000ull;
}

void di_log_limit_destroy(di_log_limit *l)
{
    pthread_mutex_destroy(&l->mu);
}

/* "1234567" -> "1,234,567" */
static void thousands(char *out, size_t cap, uint64_t v)
{
    char digits[24];
    int n = snprintf(digits, sizeof(digits), "%llu", (unsigned long long)v);
    size_t k = 0;
    for (int i = 0; i < n && k + 2 < cap; i++) {
        if (i > 0 && (n - i) % 3 == 0)
            out[k++] = ',';
        out[k++] = digits[i];
    }
    out[k] = 0;
}

/* Called with l->mu held: builds the summary line of the current interval into line and
 * resets the interval. Returns the count it reports (0: nothing to say). */
static uint64_t summarise(di_log_limit *l, uint64_t now_ns, char *line, size_t cap)
{
    uint64_t n = l->suppressed;
    if (n > 0) {
        char count[32];
        thousands(count, sizeof(count), n);
        double secs = (double)(now_ns - l->window_start_ns) / 1e9;
        snprintf(line, cap, "%s more %s in the last %.0f s (last: %s)", count, l->what,
                 secs < 1 ? 1 : secs, l->last);
    }
    l->suppressed = 0;
    l->logged = 0;
    l->window_start_ns = now_ns;
    return n;
}

void di_log_limited(const di_logger *lg, di_log_limit *l, uint64_t now_ns, const char *fmt, ...)
{
    if (!di_log_enabled(lg, l->level))
        return;
    char summary[512], line[sizeof(l->last)];
    uint64_t reported = 0;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(line, sizeof(line), fmt, ap);
    va_end(ap);
    pthread_mutex_lock(&l->mu);
    if (!l->started) {
        l->started = 1;
        l->window_start_ns = now_ns;
    }
    if (now_ns >= l->window_start_ns + l->interval_ns || now_ns < l->window_start_ns)
        reported = summarise(l, now_ns, summary, sizeof(summary));
    int pass = l->logged < l->burst;
    if (pass)
        l->logged++;
    else {
        l->suppressed++;
        l->suppressed_total++;
        memcpy(l->last, line, sizeof(l->last));
    }
    pthread_mutex_unlock(&l->mu);
    if (reported)
        di_log(lg, l->level, "%s", summary);
    if (pass)
        di_log(lg, l->level, "%s", line);
}

uint64_t di_log_limit_flush(const di_logger *lg, di_log_limit *l, uint64_t now_ns, int force)
{
    char summary[512];
    uint64_t reported = 0;
    pthread_mutex_lock(&l->mu);
    if (l->suppressed > 0 && (force || now_ns >= l->window_start_ns + l->interval_ns))
        reported = summarise(l, now_ns, summary, sizeof(summary));
    pthread_mutex_unlock(&l->mu);
    if (reported)
        di_log(lg, l->level, "%s", summary);
    return reported;
}
