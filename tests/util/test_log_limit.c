/* Rate-limited logging: the first lines of an interval pass, the rest are counted and reported
 * once with their count and the last message; a new interval lets lines through again. */
#include <criterion/criterion.h>
#include <stdio.h>
#include <string.h>

#include "common/util/log_limit.h"

#define MAX_LINES 64

typedef struct sink {
    char lines[MAX_LINES][512];
    int n;
} sink;

static void capture(void *ud, di_log_level level, const char *line)
{
    (void)level;
    sink *s = ud;
    if (s->n < MAX_LINES)
        snprintf(s->lines[s->n++], sizeof(s->lines[0]), "%s", line);
}

#define MS 1000000ull

Test(log_limit, first_lines_pass_then_one_summary_with_the_count)
{
    sink s = {0};
    di_logger lg = {.fn = capture, .userdata = &s, .level = DI_LOG_INFO};
    di_log_limit l;
    di_log_limit_init(&l, "puts failed", DI_LOG_WARN, 3, 10000);
    uint64_t t = 1000 * MS;
    for (int i = 0; i < 1300; i++)
        di_log_limited(&lg, &l, t + (uint64_t)i * MS, "put %d: disk full", i);
    cr_assert_eq(s.n, 3, "%d lines", s.n);
    cr_assert_str_eq(s.lines[2], "put 2: disk full");
    /* Nothing more within the interval, even when flushed without force. */
    cr_assert_eq(di_log_limit_flush(&lg, &l, t + 5000 * MS, 0), 0);
    cr_assert_eq(s.n, 3);
    /* The interval ends: the next line first reports the 1,297 counted ones. */
    di_log_limited(&lg, &l, t + 10000 * MS, "put %d: disk full", 5000);
    cr_assert_eq(s.n, 5, "%d lines", s.n);
    cr_assert_str_eq(s.lines[3], "1,297 more puts failed in the last 10 s (last: put 1299: disk "
                                 "full)");
    cr_assert_str_eq(s.lines[4], "put 5000: disk full");
    cr_assert_eq(l.suppressed_total, 1297);
    di_log_limit_destroy(&l);
}

Test(log_limit, flush_reports_the_rest_and_nothing_twice)
{
    sink s = {0};
    di_logger lg = {.fn = capture, .userdata = &s, .level = DI_LOG_INFO};
    di_log_limit l;
    di_log_limit_init(&l, "commits failed", DI_LOG_WARN, 1, 1000);
    di_log_limited(&lg, &l, 5 * MS, "a");
    di_log_limited(&lg, &l, 6 * MS, "b");
    di_log_limited(&lg, &l, 7 * MS, "c");
    cr_assert_eq(s.n, 1);
    cr_assert_eq(di_log_limit_flush(&lg, &l, 8 * MS, 1), 2);
    cr_assert_eq(s.n, 2);
    cr_assert(strstr(s.lines[1], "2 more commits failed") && strstr(s.lines[1], "(last: c)"),
              "%s", s.lines[1]);
    cr_assert_eq(di_log_limit_flush(&lg, &l, 9000 * MS, 1), 0);
    cr_assert_eq(s.n, 2);
    di_log_limit_destroy(&l);
}

Test(log_limit, a_disabled_level_costs_nothing_and_counts_nothing)
{
    sink s = {0};
    di_logger lg = {.fn = capture, .userdata = &s, .level = DI_LOG_ERROR};
    di_log_limit l;
    di_log_limit_init(&l, "x", DI_LOG_WARN, 1, 1000);
    for (int i = 0; i < 10; i++)
        di_log_limited(&lg, &l, (uint64_t)i * MS, "line %d", i);
    cr_assert_eq(s.n, 0);
    cr_assert_eq(l.suppressed_total, 0);
    di_log_limited(NULL, &l, 0, "no logger");
    di_log_limit_destroy(&l);
}
