/* clock.h: time sources. Monotonic for durations and deadlines, realtime for stamps and TTLs
 * that must survive a restart. */
#ifndef DI_UTIL_CLOCK_H
#define DI_UTIL_CLOCK_H

#include <stdint.h>
#include <time.h>

/* Nanoseconds on CLOCK_MONOTONIC: for durations, deadlines and benchmarks. */
static inline uint64_t di_mono_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

/* Milliseconds since the Unix epoch on CLOCK_REALTIME: for expiry times kept on disk. */
static inline uint64_t di_wall_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (uint64_t)ts.tv_sec * 1000ull + (uint64_t)ts.tv_nsec / 1000000ull;
}

/* CPU time of the calling thread, in nanoseconds: for "scheduler CPU time per step". */
static inline uint64_t di_thread_cpu_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

/* The CLOCK_REALTIME time ms milliseconds from now, for pthread_cond_timedwait on a condition
 * variable with the default clock. */
static inline struct timespec di_realtime_in_ms(uint32_t ms)
{
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    ts.tv_sec += ms / 1000;
    ts.tv_nsec += (long)(ms % 1000) * 1000000L;
    if (ts.tv_nsec >= 1000000000L) {
        ts.tv_sec++;
        ts.tv_nsec -= 1000000000L;
    }
    return ts;
}

#endif
