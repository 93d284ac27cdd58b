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
        {1, 0.010, 0.110, 10, 11}, /* tpot 10 ms */
        {1, 0.300, 0.400, 10, 11}, /* ttft too slow */
        {1, 0.010, 0.510, 10, 11}, /* tpot 50 ms: too slow */
        {0, 0, 0, 0, 0},           /* failed */
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
    int port;
    pid_t pid = proc_start_router((char *[]){"--test-delay", "1ms", NULL}, &port);
    char host[32], json_path[] = "/tmp/di-bench-test-XXXXXX";
    snprintf(host, sizeof host, "127.0.0.1:%d", port);
    int fd = mkstemp(json_path);
    cr_assert_geq(fd, 0);
    close(fd);
    char *args[] = {"di-bench", "--host", host, "--num-prompts", "24", "--request-rate", "100",
                    "--arrival", "fixed", "--max-concurrency", "4", "--input-len", "40",
                    "--output-len", "6", "--shared-prefix-len", "16", "--json", json_path,
                    "--goodput-e2e", "60s", NULL};
    char out[16384];
    int rc = proc_run(proc_bin("tools/bench/di-bench"), args, out, sizeof out);
    cr_expect_eq(proc_stop(pid), 0);
    cr_assert_eq(rc, 0, "%s", out);
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
    int port;
    pid_t pid = proc_start_router(NULL, &port);
    char host[32], json_path[] = "/tmp/di-bench-sweep-XXXXXX";
    snprintf(host, sizeof host, "127.0.0.1:%d", port);
    int fd = mkstemp(json_path);
    cr_assert_geq(fd, 0);
    close(fd);
    char *args[] = {"di-bench", "--host", host, "--num-prompts", "6", "--sweep", "200,400",
                    "--input-len", "8", "--output-len", "3", "--json", json_path, NULL};
    char out[16384];
    int rc = proc_run(proc_bin("tools/bench/di-bench"), args, out, sizeof out);
    cr_expect_eq(proc_stop(pid), 0);
    cr_assert_eq(rc, 0, "%s", out);
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
