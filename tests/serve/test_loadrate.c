/* GetLoad's rates over a recent window (common/serve/loadrate.h), on a fake clock: a rank that
 * slows down reports its new speed once the window has passed, not its average since start; an
 * idle rank keeps the last figure; bursts inside the window are weighted by engine time. */
#include <criterion/criterion.h>

#include "common/serve/loadrate.h"

#define S 1000000000ull /* one second, ns */
#define MS 1000000ull

/* Steps of `step_ns` each doing `amount`, back to back from t0 for `secs` seconds of wall
 * time, with the engine busy `busy_pct` percent of the time; the time after the last step. */
static uint64_t run(loadrate *r, uint64_t t0, uint32_t secs, double amount, uint64_t step_ns,
                    uint32_t busy_pct)
{
    uint64_t t = t0, wall = step_ns * 100 / busy_pct;
    while (t + wall <= t0 + secs * S) {
        t += wall;
        loadrate_add(r, t, amount, step_ns);
    }
    return t;
}

Test(loadrate, empty_is_zero_and_ignores_zero_time)
{
    loadrate r;
    loadrate_init(&r);
    cr_assert_eq(loadrate_per_s(&r, 5 * S), 0.0);
    loadrate_add(&r, 5 * S, 100, 0);
    cr_assert_eq(loadrate_per_s(&r, 5 * S), 0.0);
}

Test(loadrate, rate_is_amount_over_engine_time)
{
    loadrate r;
    loadrate_init(&r);
    /* 256 tokens per 50 ms step, engine busy half of the time: 5,120 tokens/s of engine time */
    uint64_t t = run(&r, 100 * S, 4, 256, 50 * MS, 50);
    cr_assert_float_eq(loadrate_per_s(&r, t), 5120.0, 1e-6);
}

Test(loadrate, a_slowdown_shows_within_the_window)
{
    loadrate r;
    loadrate_init(&r);
    /* 60 s at 10 ms per decode step, then 3x slower */
    uint64_t t = run(&r, 1000 * S, 60, 1, 10 * MS, 100);
    cr_assert_float_eq(loadrate_per_s(&r, t), 100.0, 1e-6);
    t = run(&r, t, LOADRATE_WINDOW_S / 2, 1, 30 * MS, 100);
    double mid = loadrate_per_s(&r, t);
    cr_assert(mid < 80.0 && mid > 33.4, "half a window later: %.2f steps/s", mid);
    t = run(&r, t, LOADRATE_WINDOW_S + 1, 1, 30 * MS, 100);
    /* a since-start average would still say ~77 steps/s (13 ms); the window says 33.3 */
    cr_assert_float_eq(loadrate_per_s(&r, t), 1000.0 / 30, 1e-6);
}

Test(loadrate, idle_keeps_the_last_figure_and_the_window_restarts)
{
    loadrate r;
    loadrate_init(&r);
    uint64_t t = run(&r, 50 * S, 5, 128, 20 * MS, 100); /* 6,400 tokens/s */
    cr_assert_float_eq(loadrate_per_s(&r, t), 6400.0, 1e-6);
    t += 3600 * S; /* an hour idle: the last figure stays */
    cr_assert_float_eq(loadrate_per_s(&r, t), 6400.0, 1e-6);
    /* then one step at another speed: that step alone is the window */
    loadrate_add(&r, t, 128, 64 * MS);
    cr_assert_float_eq(loadrate_per_s(&r, t), 2000.0, 1e-6);
    /* an old bucket whose ring position is reused is not counted twice */
    loadrate_add(&r, t + LOADRATE_WINDOW_S * S, 128, 32 * MS);
    cr_assert_float_eq(loadrate_per_s(&r, t + LOADRATE_WINDOW_S * S), 4000.0, 1e-6);
}

Test(loadrate, a_clock_read_before_the_last_sample_counts_the_window_behind_it)
{
    loadrate r;
    loadrate_init(&r);
    loadrate_add(&r, 20 * S, 10, 1 * S);
    loadrate_add(&r, 21 * S, 30, 1 * S);
    /* a reader whose clock is a second behind sees the first sample only */
    cr_assert_float_eq(loadrate_per_s(&r, 20 * S + 500 * MS), 10.0, 1e-9);
    cr_assert_float_eq(loadrate_per_s(&r, 21 * S), 20.0, 1e-9);
}
