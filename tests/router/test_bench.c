/* di-bench: its statistics, and a run against di-router with the test backend whose counts
 * must come out exactly (every request completes, every token is counted). */
#include <criterion/criterion.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "proc.h"
#include "tools/bench/stats.h"

/* di-router with the test backend and the extra flags; host receives "127.0.0.1:PORT". */
static pid_t bench_router(char *const *extra, char *host, size_t cap)
{
    int port;
    pid_t pid = proc_start_router(extra, &port);
    snprintf(host, cap, "127.0.0.1:%d", port);
    return pid;
}

/* Creates the empty file named by the mkstemp template. */
static void temp_file(char *tmpl)
{
    int fd = mkstemp(tmpl);
    cr_assert_geq(fd, 0);
    close(fd);
}

/* Runs di-bench with args, then stops the router pid; asserts that di-bench exited 0. */
static void bench_ok(pid_t pid, char *const *args, char *out, size_t cap)
{
    int rc = proc_run(proc_bin("tools/bench/di-bench"), args, out, cap);
    cr_expect_eq(proc_stop(pid), 0);
    cr_assert_eq(rc, 0, "%s", out);
}

Test(bench, percentiles_interpolate_like_numpy)
{
    double v[] = {4, 1, 3, 2, 5};
    bst_dist d;
    bst_dist_of(v, 5, &d);
    cr_expect_float_eq(d.mean, 3.0, 1e-12);
    cr_expect_float_eq(d.median, 3.0, 1e-12);
    cr_expect_float_eq(d.p90, 4.6, 1e-12);  /* numpy.percentile([1..5], 90) */
    cr_expect_float_eq(d.p99, 4.96, 1e-12);
    cr_expect_float_eq(d.max, 5.0, 0);
    double one[] = {7};
    bst_dist_of(one, 1, &d);
    cr_expect(d.median == 7 && d.p99 == 7);
    bst_dist_of(NULL, 0, &d);
    cr_expect(d.n == 0 && d.mean == 0);
}

Test(bench, goodput_counts_requests_meeting_every_slo)
{
    bst_req r[4] = {
        {1, 0.010, 0.110, 10, 11, 0}, /* tpot 10 ms */
        {1, 0.300, 0.400, 10, 11, 0}, /* ttft too slow */
        {1, 0.010, 0.510, 10, 11, 0}, /* tpot 50 ms: too slow */
        {0, 0, 0, 0, 0, 0},        /* failed */
    };
    bst_slo slo = {0.1, 0.02, 0};
    bst_report rep;
    cr_assert_eq(bst_report_of(r, 4, NULL, 0, 2.0, &slo, &rep), 0);
    cr_expect_eq(rep.completed, 3);
    cr_expect_eq(rep.failed, 1);
    cr_expect_float_eq(rep.goodput_req_per_s, 0.5, 1e-12);
    cr_expect_float_eq(rep.req_per_s, 1.5, 1e-12);
    cr_expect_eq(rep.out_tokens, 33);
    cr_expect_float_eq(rep.tpot.median, 0.01, 1e-12); /* 10, 10 and 50 ms */
}

Test(bench, against_the_router, .timeout = 120)
{
    char host[32], json_path[] = "/tmp/di-bench-test-XXXXXX";
    pid_t pid = bench_router((char *[]){"--test-delay", "1ms", NULL}, host, sizeof host);
    temp_file(json_path);
    char *args[] = {"di-bench", "--host", host, "--num-prompts", "24", "--request-rate", "100",
                    "--arrival", "fixed", "--max-concurrency", "4", "--input-len", "40",
                    "--output-len", "6", "--shared-prefix-len", "16", "--json", json_path,
                    "--goodput-e2e", "60s", NULL};
    char out[16384];
    bench_ok(pid, args, out, sizeof out);
    cr_expect(strstr(out, "Successful requests:") && strstr(out, "P99 TTFT (ms):"), "%s", out);
    cr_expect(strstr(out, "di-bench: 24/24 done, 0 failed") != NULL, "no progress lines: %s",
              out);
    json_t *o = json_load_file(json_path, JSON_DISABLE_EOF_CHECK, NULL);
    unlink(json_path);
    cr_assert_not_null(o);
    cr_expect_eq(json_integer_value(json_object_get(o, "completed")), 24);
    cr_expect_eq(json_integer_value(json_object_get(o, "failed")), 0);
    /* 24 prompts of 16 shared + 40 random ids, 6 tokens each (ignore_eos). */
    cr_expect_eq(json_integer_value(json_object_get(o, "total_input_tokens")), 24 * 56);
    cr_expect_eq(json_integer_value(json_object_get(o, "total_output_tokens")), 24 * 6);
    cr_expect_gt(json_real_value(json_object_get(o, "median_ttft_ms")), 0);
    cr_expect_gt(json_real_value(json_object_get(o, "mean_itl_ms")), 0);
    cr_expect_float_eq(json_real_value(json_object_get(o, "request_goodput")),
                       json_real_value(json_object_get(o, "request_throughput")), 1e-9);
    json_decref(o);
}

Test(bench, usage_errors)
{
    char out[4096];
    char *bad_sweep[] = {"di-bench", "--sweep", "1,x", NULL};
    cr_expect_eq(proc_run(proc_bin("tools/bench/di-bench"), bad_sweep, out, sizeof out), 2);
    char *plot_alone[] = {"di-bench", "--plot", "/tmp/x.png", NULL};
    cr_expect_eq(proc_run(proc_bin("tools/bench/di-bench"), plot_alone, out, sizeof out), 2);
    char *help[] = {"di-bench", "--help", NULL};
    cr_expect_eq(proc_run(proc_bin("tools/bench/di-bench"), help, out, sizeof out), 0);
    cr_expect(strstr(out, "--request-rate") != NULL, "%s", out);
    /* Nobody listening: the run fails with a clear line, not a hang. */
    char *nobody[] = {"di-bench", "--host", "127.0.0.1:1", "--num-prompts", "2", NULL};
    cr_expect_eq(proc_run(proc_bin("tools/bench/di-bench"), nobody, out, sizeof out), 1);
    cr_expect(strstr(out, "cannot connect") != NULL, "%s", out);
}

Test(bench, sweep_runs_each_rate, .timeout = 120)
{
    char host[32], json_path[] = "/tmp/di-bench-sweep-XXXXXX";
    pid_t pid = bench_router(NULL, host, sizeof host);
    temp_file(json_path);
    char *args[] = {"di-bench", "--host", host, "--num-prompts", "6", "--sweep", "200,400",
                    "--input-len", "8", "--output-len", "3", "--json", json_path, NULL};
    char out[16384];
    bench_ok(pid, args, out, sizeof out);
    FILE *f = fopen(json_path, "r");
    char line[4096];
    double rates[2] = {0};
    int n = 0;
    while (n < 3 && fgets(line, sizeof line, f)) {
        json_t *o = json_loads(line, 0, NULL);
        cr_assert_not_null(o, "%s", line);
        if (n < 2)
            rates[n] = json_real_value(json_object_get(o, "request_rate")) +
                       (double)json_integer_value(json_object_get(o, "request_rate"));
        cr_expect_eq(json_integer_value(json_object_get(o, "completed")), 6);
        json_decref(o);
        n++;
    }
    fclose(f);
    unlink(json_path);
    cr_expect_eq(n, 2, "one JSON line per rate");
    cr_expect(rates[0] == 200 && rates[1] == 400, "rates %g %g", rates[0], rates[1]);
}

Test(bench, hit_rate_is_cached_over_prompt_tokens, .timeout = 120)
{
    /* The test backend reports 16 cached tokens per request: 16 of 56 prompt tokens. */
    char host[32], json_path[] = "/tmp/di-bench-hit-XXXXXX";
    pid_t pid = bench_router((char *[]){"--test-cached", "16", NULL}, host, sizeof host);
    temp_file(json_path);
    char *args[] = {"di-bench", "--host", host, "--num-prompts", "10", "--input-len", "40",
                    "--output-len", "3", "--shared-prefix-len", "16", "--json", json_path,
                    NULL};
    char out[16384];
    bench_ok(pid, args, out, sizeof out);
    cr_expect(strstr(out, "Prefix cache hit rate (%):") != NULL, "%s", out);
    cr_expect(strstr(out, "28.57") != NULL, "16/56 = 28.57%% in the table: %s", out);
    json_t *o = json_load_file(json_path, JSON_DISABLE_EOF_CHECK, NULL);
    unlink(json_path);
    cr_assert_not_null(o);
    cr_expect_eq(json_integer_value(json_object_get(o, "total_cached_tokens")), 10 * 16);
    cr_expect_float_eq(json_real_value(json_object_get(o, "prefix_cache_hit_rate")), 16.0 / 56,
                       1e-5);
    json_decref(o);
}

Test(bench, hit_rate_arithmetic)
{
    bst_req r[3] = {
        {1, 0.01, 0.1, 100, 4, 64},
        {1, 0.01, 0.1, 300, 4, 0},
        {0, 0, 0, 50, 0, 50}, /* failed: not counted */
    };
    bst_slo slo = {0, 0, 0};
    bst_report rep;
    cr_assert_eq(bst_report_of(r, 3, NULL, 0, 1.0, &slo, &rep), 0);
    cr_expect_eq(rep.cached_tokens, 64);
    cr_expect_float_eq(rep.hit_rate, 64.0 / 400, 1e-12);
    bst_req none = {1, 0.01, 0.1, 0, 4, 0};
    cr_assert_eq(bst_report_of(&none, 1, NULL, 0, 1.0, &slo, &rep), 0);
    cr_expect(rep.hit_rate == 0, "no prompt token: 0, not NaN");
}

/* Whether gnuplot is on PATH. */
static int gnuplot_here(void)
{
    return system("command -v gnuplot >/dev/null 2>&1") == 0;
}

Test(bench, sweep_plot_writes_a_png, .timeout = 120)
{
    if (!gnuplot_here())
        cr_skip_test("gnuplot is not installed (Debian: gnuplot-nox)");
    char host[32], dir[] = "/tmp/di-bench-plot-XXXXXX", png[128];
    pid_t pid = bench_router(NULL, host, sizeof host);
    cr_assert_not_null(mkdtemp(dir));
    snprintf(png, sizeof png, "%s/lat.png", dir);
    char *args[] = {"di-bench", "--host", host, "--num-prompts", "4", "--sweep", "100,200,400",
                    "--input-len", "8", "--output-len", "3", "--plot", png, NULL};
    char out[16384];
    bench_ok(pid, args, out, sizeof out);
    unsigned char magic[8] = {0};
    FILE *f = fopen(png, "rb");
    cr_assert_not_null(f, "no %s: %s", png, out);
    size_t got = fread(magic, 1, 8, f);
    fseek(f, 0, SEEK_END);
    long size = ftell(f);
    fclose(f);
    static const unsigned char want[8] = {0x89, 'P', 'N', 'G', '\r', '\n', 0x1a, '\n'};
    cr_expect(got == 8 && memcmp(magic, want, 8) == 0, "%s is not a PNG", png);
    cr_expect_gt(size, 1000, "a PNG of %ld bytes", size);
    char dat[160];
    snprintf(dat, sizeof dat, "%s.dat", png);
    f = fopen(dat, "r");
    cr_assert_not_null(f);
    char line[512];
    int rows = 0;
    while (fgets(line, sizeof line, f))
        rows += line[0] != '#';
    fclose(f);
    cr_expect_eq(rows, 3, "one data row per rate");
    char cmd[256];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
    cr_expect_eq(system(cmd), 0);
}

Test(bench, plot_without_gnuplot_fails_before_any_request)
{
    /* PATH without gnuplot; the host answers nothing, so a run would fail otherwise. */
    setenv("PATH", "/nonexistent-di-bench", 1);
    char out[4096];
    char *args[] = {"di-bench", "--host", "127.0.0.1:1", "--sweep", "1,2", "--plot",
                    "/tmp/di-bench-noplot.png", NULL};
    cr_expect_eq(proc_run(proc_bin("tools/bench/di-bench"), args, out, sizeof out), 1);
    cr_expect(strstr(out, "--plot needs gnuplot") && strstr(out, "gnuplot-nox"), "%s", out);
    cr_expect(strstr(out, "cannot connect") == NULL, "it sent requests first: %s", out);
    cr_expect(access("/tmp/di-bench-noplot.png", F_OK) != 0);
    char *quote[] = {"di-bench", "--sweep", "1", "--plot", "/tmp/it's.png", NULL};
    cr_expect_eq(proc_run(proc_bin("tools/bench/di-bench"), quote, out, sizeof out), 2);
}
