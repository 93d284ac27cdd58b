/* di-sim end to end: run the binary, read its JSON, check the numbers are sane and add up. */
#include <math.h>
#include <sys/wait.h>
#include <criterion/criterion.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>

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
    const char *same[] = {"sim_seconds", "output_tokens", "ttft_ms.p99", "tpot_ms.p50",
                          "steps.group", "cache_usage.max", "draft_acceptance"};
    for (size_t i = 0; i < sizeof(same) / sizeof(same[0]); i++)
        cr_assert_eq(num(a, same[i]), num(b, same[i]), "%s differs between runs", same[i]);
    json_decref(a);
    json_decref(b);
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
