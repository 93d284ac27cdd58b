/* di-sim end to end: run the binary, read its JSON, check the numbers are sane and add up. */
#include <math.h>
#include <sys/wait.h>
#include <criterion/criterion.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static json_t *run_sim(const char *args, int *rc)
{
    const char *root = getenv("DI_BUILD_ROOT");
    cr_assert_not_null(root, "DI_BUILD_ROOT is set by meson");
    char cmd[1024];
    snprintf(cmd, sizeof(cmd), "%s/tools/sim/di-sim --quiet --json %s 2>/dev/null", root, args);
    FILE *f = popen(cmd, "r");
    cr_assert_not_null(f);
    static char buf[1 << 16];
    size_t n = fread(buf, 1, sizeof(buf) - 1, f);
    buf[n] = 0;
    int st = pclose(f);
    *rc = WIFEXITED(st) ? WEXITSTATUS(st) : -1;
    if (*rc != 0)
        return NULL;
    json_error_t je;
    json_t *j = json_loads(buf, 0, &je);
    cr_assert_not_null(j, "di-sim printed bad JSON: %s", je.text);
    return j;
}

static double num(json_t *o, const char *path)
{
    char key[128];
    snprintf(key, sizeof(key), "%s", path);
    json_t *cur = o;
    for (char *tok = strtok(key, "."); tok; tok = strtok(NULL, "."))
        cur = json_object_get(cur, tok);
    cr_assert(json_is_number(cur), "no number at %s", path);
    return json_number_value(cur);
}

static void ordered(json_t *j, const char *what)
{
    char k[64];
    double v[4];
    const char *names[4] = {"p50", "p90", "p99", "max"};
    for (int i = 0; i < 4; i++) {
        snprintf(k, sizeof(k), "%s.%s", what, names[i]);
        v[i] = num(j, k);
        cr_assert(v[i] >= 0, "%s negative", k);
        if (i)
            cr_assert(v[i] >= v[i - 1], "%s: %s < %s", what, names[i], names[i - 1]);
    }
}

#define SMALL "--requests 200 --rate 20 --ranks 2 --blocks 4000 --max-num-seqs 32 --seed 7"

Test(sim, small_run_is_self_consistent, .timeout = 60)
{
    int rc;
    json_t *j = run_sim(SMALL, &rc);
    cr_assert_eq(rc, 0);
    cr_assert_eq(num(j, "requests"), 200);
    cr_assert_eq(num(j, "finished"), 200, "every request finishes");
    cr_assert_eq(num(j, "rejected"), 0);
    cr_assert_eq(num(j, "finish.length"), 200, "each runs to its output length");
    cr_assert_eq(num(j, "output_tokens"), num(j, "output_tokens_expected"),
                 "tokens out == sum of output lengths");
    cr_assert_eq(num(j, "preemptions.stop") + num(j, "preemptions.recompute"), 0);
    ordered(j, "ttft_ms");
    ordered(j, "tpot_ms");
    cr_assert_gt(num(j, "ttft_ms.p50"), 0);
    cr_assert_gt(num(j, "tpot_ms.p50"), 0);
    /* with nextn 5 a step makes at most 6 tokens: TPOT >= the shortest decode step / 6 */
    cr_assert_geq(num(j, "tpot_ms.p50"), 8.8 / 6);
    double group = num(j, "steps.group");
    cr_assert_eq(num(j, "steps.prompt") + num(j, "steps.decode"), 2 * group,
                 "each of the 2 ranks runs every lockstep step");
    double usage = num(j, "cache_usage.mean");
    cr_assert(usage > 0 && usage <= num(j, "cache_usage.max") && num(j, "cache_usage.max") <= 1);
    double acc = num(j, "draft_acceptance");
    cr_assert(acc > 0.2 && acc < 0.7, "acceptance %g for a = 0.7 under the prefix rule", acc);
    double tps = num(j, "output_tokens_per_second");
    cr_assert_lt(fabs(tps * num(j, "sim_seconds") - num(j, "output_tokens")), 1.0);
    cr_assert_gt(num(j, "sched_cpu_ns_per_step.p50"), 0);
    json_decref(j);
}

Test(sim, a_seed_repeats_the_run, .timeout = 60)
{
    int rc;
    json_t *a = run_sim(SMALL " --async", &rc);
    json_t *b = run_sim(SMALL " --async", &rc);
    json_t *c = run_sim(SMALL " --async --seed 8", &rc);
    const char *same[] = {"sim_seconds", "output_tokens", "ttft_ms.p99", "tpot_ms.p50",
                          "steps.group", "cache_usage.max", "draft_acceptance"};
    int differ = 0;
    for (size_t i = 0; i < sizeof(same) / sizeof(same[0]); i++) {
        cr_assert_eq(num(a, same[i]), num(b, same[i]), "%s differs between runs", same[i]);
        differ += num(a, same[i]) != num(c, same[i]);
    }
    cr_assert_geq(differ, 5, "another seed gives another run (%d figures differ)", differ);
    json_decref(a);
    json_decref(b);
    json_decref(c);
}

/* Draft acceptance counts real drafts only: a request admitted to decode without drafts pads
 * its draft rows, and those pads are not drafts that failed. With every draft accepted the
 * figure is exactly 1, on every engine. */
Test(sim, acceptance_counts_real_drafts_only, .timeout = 60)
{
    const char *engines[] = {"normal", "completion", "normal --async"};
    for (size_t i = 0; i < sizeof(engines) / sizeof(engines[0]); i++) {
        char args[128];
        snprintf(args, sizeof(args), "--requests 40 --accept 1 --engine %s", engines[i]);
        int rc;
        json_t *j = run_sim(args, &rc);
        cr_assert_eq(rc, 0);
        cr_assert_eq(num(j, "draft_acceptance"), 1.0, "%s: %g", engines[i],
                     num(j, "draft_acceptance"));
        json_decref(j);
    }
}

/* Whole-number options take what they say: 1e4 steps is 10,000, not 1; the largest seed is
 * a seed; a value that is not a whole number, or is out of range, is refused. */
Test(sim, whole_number_options_mean_their_value, .timeout = 60)
{
    int rc;
    json_t *j = run_sim("--requests 5 --max-steps 1e4", &rc);
    cr_assert_eq(rc, 0, "--max-steps 1e4 read as 1 step");
    json_decref(j);
    j = run_sim("--requests 5 --seed 18446744073709551615", &rc);
    cr_assert_eq(rc, 0, "the largest seed is refused");
    json_decref(j);
    j = run_sim("--requests 5 --seed 1e3", &rc);
    cr_assert_eq(rc, 0);
    json_t *k = run_sim("--requests 5 --seed 1000", &rc);
    cr_assert_eq(num(j, "sim_seconds"), num(k, "sim_seconds"), "1e3 and 1000 are one seed");
    cr_assert_eq(num(j, "config.seed"), 1000);
    json_decref(j);
    json_decref(k);
    const char *bad[] = {"--seed 18446744073709551616", "--seed 1.5", "--seed nan",
                         "--requests nan", "--max-steps -1", "--seed ''"};
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        cr_assert_null(run_sim(bad[i], &rc), "%s accepted", bad[i]);
        cr_assert_eq(rc, 2, "%s", bad[i]);
    }
}

Test(sim, a_small_cache_preempts, .timeout = 60)
{
    int rc;
    json_t *j = run_sim("--requests 200 --rate 50 --blocks 400 --seed 3", &rc);
    cr_assert_eq(rc, 0);
    double stopped = num(j, "preemptions.stop");
    cr_assert_gt(stopped, 0);
    cr_assert_eq(num(j, "finish.preempted"), stopped);
    cr_assert_eq(num(j, "finished"), 200);
    cr_assert_lt(num(j, "output_tokens"), num(j, "output_tokens_expected"),
                 "preempted requests stop early");
    cr_assert_gt(num(j, "cache_usage.max"), 0.9);
    json_decref(j);
}

/* Runs di-sim under a memory limit (so a missing check cannot take the machine's memory) and
 * returns its exit status with its stderr in err. The limit is an address-space limit, or
 * the sanitizer's own malloc limit in a sanitizer build (which cannot start under one). */
static int run_sim_limited(const char *args, char *err, size_t cap)
{
    char bin[512], cmd[2048];
    snprintf(bin, sizeof(bin), "%s/tools/sim/di-sim", getenv("DI_BUILD_ROOT"));
    snprintf(cmd, sizeof(cmd), "if ldd '%s' | grep -q libasan; then export ASAN_OPTIONS="
             "\"$ASAN_OPTIONS:malloc_limit_mb=4000:allocator_may_return_null=1\"; else ulimit "
             "-v 4000000; fi; '%s' --quiet %s 2>&1 >/dev/null", bin, bin, args);
    FILE *f = popen(cmd, "r");
    cr_assert_not_null(f);
    size_t n = fread(err, 1, cap - 1, f);
    err[n] = 0;
    int st = pclose(f);
    return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

/* A configuration whose bookkeeping alone would take more than this machine has is refused
 * up front with the figure, before anything is allocated (the kernel would otherwise kill
 * the process halfway, or the machine would swap). */
Test(sim, configurations_beyond_memory_are_refused, .timeout = 60)
{
    char err[1024];
    cr_assert_eq(run_sim_limited("--blocks 2147483648 --ranks 256 --requests 5", err,
                                 sizeof(err)), 2, "%s", err);
    cr_assert(strstr(err, "GB of memory"), "%s", err);
    cr_assert_eq(run_sim_limited("--max-waiting 4194304 --ranks 256 --requests 5", err,
                                 sizeof(err)), 2, "%s", err);
    cr_assert(strstr(err, "GB of memory"), "%s", err);
    cr_assert_eq(run_sim_limited("--requests 5", err, sizeof(err)), 0, "%s", err);
}

/* A report that cannot be written (disk full, reader gone) is a failure, not a success. */
Test(sim, an_unwritable_report_fails, .timeout = 60)
{
    const char *forms[] = {"", "--json", "--help"};
    for (size_t i = 0; i < sizeof(forms) / sizeof(forms[0]); i++) {
        char cmd[1024];
        snprintf(cmd, sizeof(cmd), "%s/tools/sim/di-sim --quiet --requests 5 %s >/dev/full "
                 "2>/dev/null", getenv("DI_BUILD_ROOT"), forms[i]);
        int st = system(cmd);
        cr_assert(WIFEXITED(st) && WEXITSTATUS(st) == 1, "'%s' exited %d", forms[i],
                  WIFEXITED(st) ? WEXITSTATUS(st) : -1);
    }
}

Test(sim, bad_flags_exit_non_zero)
{
    int rc;
    cr_assert_null(run_sim("--rate fast", &rc));
    cr_assert_eq(rc, 2);
    cr_assert_null(run_sim("--engine decode", &rc));
    cr_assert_eq(rc, 2);
    cr_assert_null(run_sim("--slots 3", &rc));
    cr_assert_eq(rc, 2, "num_slots below max_num_seqs");
}

/* ---- MTP varlen ---- */

#define DECODE "--engine completion --rate 0 --requests 600 --blocks 30000 --seed 5 "

/* Output tokens per simulated second of a run. */
static double tps_of(json_t *j)
{
    return num(j, "output_tokens") / num(j, "sim_seconds");
}

/* A varlen run is complete and adds up like any other: every request finishes with its tokens,
 * no draft rows beyond nextn, and requests admitted without confidences are counted. */
Test(sim, varlen_run_is_self_consistent, .timeout = 60)
{
    int rc;
    json_t *j = run_sim(SMALL " --varlen --async --accept-spread 0.3 --conf-noise 0.1", &rc);
    cr_assert_eq(rc, 0);
    cr_assert_eq(num(j, "finished"), 200);
    cr_assert_eq(num(j, "output_tokens"), num(j, "output_tokens_expected"));
    double d = num(j, "draft_rows_per_request");
    cr_assert(d >= 0 && d <= 5, "%g draft rows per request", d);
    cr_assert(json_is_true(json_object_get(json_object_get(j, "config"), "varlen")));
    json_decref(j);
    j = run_sim(DECODE "--max-num-seqs 16 --varlen", &rc);
    cr_assert_eq(rc, 0);
    cr_assert_geq(num(j, "varlen_no_conf"), 600, "each admitted request starts without "
                  "confidences: %g", num(j, "varlen_no_conf"));
    json_decref(j);
}

/* The explainer's argument ("Why dynamic verification loses at 16 and wins at 96") on the
 * step-time model 8.8 ms + 0.0168 ms per row: with 256 requests per step the per-row term is
 * most of the step and varlen, dropping the drafts least likely to pass, raises output tokens
 * per second by more than 10%; with 16 the step is mostly fixed cost and there is little to
 * gain (within 2%), and a miscalibrated confidence head (under-confident by 0.3) makes varlen
 * lose. */
Test(sim, varlen_wins_at_high_load_and_not_at_low_load, .timeout = 60)
{
    int rc;
    json_t *off = run_sim(DECODE "--max-num-seqs 256 --async", &rc);
    json_t *on = run_sim(DECODE "--max-num-seqs 256 --async --varlen", &rc);
    cr_assert_gt(tps_of(on), 1.10 * tps_of(off), "256: varlen %g, off %g tokens/s",
                 tps_of(on), tps_of(off));
    cr_assert_lt(num(on, "tpot_ms.p50"), num(off, "tpot_ms.p50"));
    cr_assert_lt(num(on, "draft_rows_per_request"), 0.7 * num(off, "draft_rows_per_request"));
    json_decref(off);
    json_decref(on);
    off = run_sim(DECODE "--max-num-seqs 16 --async", &rc);
    on = run_sim(DECODE "--max-num-seqs 16 --async --varlen", &rc);
    json_t *bias = run_sim(DECODE "--max-num-seqs 16 --async --varlen --conf-bias -0.3", &rc);
    cr_assert_lt(fabs(tps_of(on) / tps_of(off) - 1), 0.02, "16: varlen %g, off %g tokens/s",
                 tps_of(on), tps_of(off));
    cr_assert_lt(tps_of(bias), 0.97 * tps_of(off), "16, under-confident: varlen %g, off %g",
                 tps_of(bias), tps_of(off));
    json_decref(off);
    json_decref(on);
    json_decref(bias);
}

Test(sim, bad_varlen_flags_exit_non_zero)
{
    const char *bad[] = {"--varlen --nextn 0", "--varlen --decode-ms 0 --decode-ms-per-row 0",
                         "--conf-bias 2", "--conf-noise -0.1", "--accept-spread 1.5",
                         "--varlen-ms-per-row -2"};
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        int rc;
        cr_assert_null(run_sim(bad[i], &rc), "%s accepted", bad[i]);
        cr_assert_eq(rc, 2, "%s", bad[i]);
    }
}
