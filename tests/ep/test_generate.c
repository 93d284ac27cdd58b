/* di-generate --ep-ranks N against one rank holding every expert: the same tokens and logprobs,
 * bit for bit, with 2 and 4 rank processes, an idle rank running placeholder steps, redundant
 * slots and EPLB re-plans that move expert weights between the ranks mid-run. */
#include <criterion/criterion.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "common/ep/group.h"

/* Three prompts of different lengths; sampled with a temperature so every logprob matters. */
#define PROMPTS "--ids 5,6,7,8,9 --ids 11,12,13 --ids 20,21,22,23,24,25,26,27,28,29,30"
#define COMMON "--config tiny --threads 1 --max-tokens 10 --temperature 0.8 --seed 7 " \
               "--ignore-eos --json --quiet " PROMPTS

/* Runs di-generate with args; returns its JSON (NULL on a failure, *rc its exit status). */
static json_t *run_generate(const char *args, int *rc, char *errbuf, size_t errcap)
{
    const char *root = getenv("DI_BUILD_ROOT");
    cr_assert_not_null(root, "DI_BUILD_ROOT is set by meson");
    char errf[] = "/tmp/di-ep-err-XXXXXX";
    int efd = mkstemp(errf);
    cr_assert(efd >= 0);
    char cmd[2048];
    snprintf(cmd, sizeof cmd, "%s/tools/generate/di-generate %s 2>%s", root, args, errf);
    FILE *f = popen(cmd, "r");
    cr_assert_not_null(f);
    json_error_t je;
    json_t *j = json_loadf(f, 0, &je);
    int st = pclose(f);
    *rc = WIFEXITED(st) ? WEXITSTATUS(st) : -1;
    ssize_t n = read(efd, errbuf, errcap - 1);
    errbuf[n > 0 ? n : 0] = 0;
    close(efd);
    unlink(errf);
    if (*rc != 0) {
        json_decref(j);
        return NULL;
    }
    return j;
}

static json_t *must_run(const char *args)
{
    int rc;
    char err[4096];
    json_t *j = run_generate(args, &rc, err, sizeof err);
    cr_assert_not_null(j, "di-generate %s exited %d: %s", args, rc, err);
    return j;
}

static uint64_t sum_of(json_t *arr)
{
    uint64_t s = 0;
    size_t i;
    json_t *v;
    json_array_foreach(arr, i, v) s += (uint64_t)json_integer_value(v);
    return s;
}

/* The requests of a group run equal the one-rank run's, bit for bit (tokens, logprobs printed
 * with 9 significant digits, which round-trip a float exactly). */
static int64_t at(json_t *ep, const char *key, size_t r)
{
    return json_integer_value(json_array_get(json_object_get(ep, key), r));
}

/* Each rank holds only its slots' experts: in backend memory, slots x one expert's bytes (the
 * one-rank group's total scaled by its slots: it has one slot an expert), and out of the
 * checkpoint, the distinct experts of its start-up slots (S consecutive slots: min(S, E) of
 * them). g1 is the group of one rank. */
static void check_resident(json_t *ep, json_t *g1, uint32_t ranks)
{
    json_t *ep1 = json_object_get(json_object_get(g1, "stats"), "ep");
    int64_t E = json_integer_value(json_object_get(ep1, "slots_per_rank"));
    int64_t S = json_integer_value(json_object_get(ep, "slots_per_rank"));
    int64_t slots1 = at(ep1, "expert_slot_bytes", 0), ckpt1 = at(ep1, "checkpoint_expert_bytes", 0);
    cr_assert(E > 0 && S > 0 && slots1 > 0 && ckpt1 > 0, "stats.ep of one rank: %lld %lld",
              (long long)slots1, (long long)ckpt1);
    int64_t held = S < E ? S : E;
    for (size_t r = 0; r < ranks; r++) {
        cr_expect_eq(at(ep, "expert_slot_bytes", r), slots1 / E * S,
                     "%u ranks, rank %zu: %lld bytes of expert slots, expected %lld", ranks, r,
                     (long long)at(ep, "expert_slot_bytes", r), (long long)(slots1 / E * S));
        cr_expect_eq(at(ep, "checkpoint_expert_bytes", r), ckpt1 / E * held,
                     "%u ranks, rank %zu: %lld expert bytes loaded, expected %lld", ranks, r,
                     (long long)at(ep, "checkpoint_expert_bytes", r),
                     (long long)(ckpt1 / E * held));
    }
}

static json_t *check_group(json_t *one, uint32_t ranks, const char *extra)
{
    char args[1024];
    snprintf(args, sizeof args, COMMON " --ep-ranks %u --ep-timeout 60000 %s", ranks, extra);
    json_t *j = must_run(args);
    json_t *a = json_object_get(one, "requests"), *b = json_object_get(j, "requests");
    cr_assert_eq(json_array_size(a), 3);
    for (size_t i = 0; i < 3; i++) {
        json_t *ra = json_array_get(a, i), *rb = json_array_get(b, i);
        char *sa = json_dumps(json_object_get(ra, "tokens"), JSON_COMPACT);
        char *sb = json_dumps(json_object_get(rb, "tokens"), JSON_COMPACT);
        cr_expect_str_eq(sb, sa, "%u ranks, request %zu: tokens differ", ranks, i + 1);
        free(sa);
        free(sb);
        cr_expect_eq(json_array_size(json_object_get(ra, "tokens")), 10);
    }
    cr_expect(json_equal(a, b), "%u ranks: requests (tokens, logprobs, finish) differ", ranks);
    json_t *ep = json_object_get(json_object_get(j, "stats"), "ep");
    cr_assert_not_null(ep, "stats.ep");
    cr_expect_eq(json_integer_value(json_object_get(ep, "ranks")), ranks);
    /* every rank ran every step of the group */
    json_t *steps = json_object_get(ep, "steps");
    for (size_t r = 1; r < ranks; r++)
        cr_expect_eq(json_integer_value(json_array_get(steps, r)),
                     json_integer_value(json_array_get(steps, 0)));
    /* every pair sent was served somewhere */
    cr_expect_eq(sum_of(json_object_get(ep, "pairs_sent")),
                 sum_of(json_object_get(ep, "pairs_served")));
    return j;
}

Test(ep_generate, two_and_four_ranks_equal_one_rank_bit_for_bit, .timeout = 240)
{
    json_t *one = must_run(COMMON);
    cr_assert_null(json_object_get(json_object_get(one, "stats"), "ep"));
    json_t *g1 = check_group(one, 1, "");

    /* 2 ranks, 2 redundant slots (5 a rank), a re-plan every 3 steps */
    json_t *two = check_group(one, 2, "--ep-redundant 2 --eplb-interval 3");
    json_t *ep = json_object_get(json_object_get(two, "stats"), "ep");
    cr_expect_eq(json_integer_value(json_object_get(ep, "slots_per_rank")), 5);
    check_resident(ep, g1, 2);
    cr_expect_geq(json_integer_value(json_object_get(ep, "replans")), 1, "no re-plan applied");
    cr_expect_gt(sum_of(json_object_get(ep, "experts_received")), 0, "no weights moved");
    /* every revert follows a plan the guard accepted */
    json_t *rv = json_object_get(ep, "replans_reverted");
    cr_expect(json_is_integer(rv), "no replans_reverted");
    cr_expect_leq(json_integer_value(rv),
                  json_integer_value(json_object_get(ep, "layers_replanned")));
    json_decref(two);

    /* 4 ranks for 3 prompts: rank 3 has none and runs placeholder steps the whole time,
     * serving the others' pairs; the re-plans move weights to and from it */
    json_t *four = check_group(one, 4, "--ep-redundant 4 --eplb-interval 3");
    ep = json_object_get(json_object_get(four, "stats"), "ep");
    json_t *ph = json_object_get(ep, "placeholder_steps");
    json_t *steps = json_object_get(ep, "steps");
    cr_expect_eq(json_integer_value(json_array_get(ph, 3)),
                 json_integer_value(json_array_get(steps, 3)), "rank 3 has only placeholders");
    cr_expect_gt(json_integer_value(json_array_get(ph, 3)), 0);
    cr_expect_eq(json_integer_value(json_array_get(json_object_get(ep, "pairs_sent"), 3)), 0);
    cr_expect_gt(json_integer_value(json_array_get(json_object_get(ep, "pairs_served"), 3)), 0,
                 "the idle rank serves the others' experts");
    cr_expect_gt(json_integer_value(json_array_get(json_object_get(ep, "serve_rounds"), 3)), 0);
    cr_expect_geq(json_integer_value(json_object_get(ep, "replans")), 1);
    cr_expect_gt(sum_of(json_object_get(ep, "experts_received")), 0);
    check_resident(ep, g1, 4);
    json_decref(four);
    json_decref(g1);
    json_decref(one);
}

Test(ep_generate, one_rank_group_without_replans_equals_the_plain_run, .timeout = 120)
{
    json_t *one = must_run(COMMON);
    json_t *g = check_group(one, 1, "");
    json_t *ep = json_object_get(json_object_get(g, "stats"), "ep");
    cr_expect_eq(json_integer_value(json_object_get(ep, "replans")), 0);
    json_decref(g);
    json_decref(one);
}

Test(ep_generate, bad_group_options_exit_2_with_one_line, .timeout = 60)
{
    static const struct {
        const char *args, *needle;
    } cases[] = {
        {"--config tiny --ids 1,2 --ep-ranks 2 --dump-logits /dev/null", "--dump-logits"},
        {"--config tiny --ids 1,2 --ep-ranks 2 --logprobs 2", "--logprobs"},
        {"--config tiny --ids 1,2 --ep-ranks 0", "--ep-ranks"},
        {"--config tiny --ids 1,2 --ep-ranks 65", "--ep-ranks"},
        {"--config tiny --ids 1,2 --rank 2 --world 2 --ep-addr 127.0.0.1:1", "--rank 2"},
        {"--config tiny --ids 1,2 --rank 1 --world 2", "--ep-addr"},
        {"--config tiny --ids 1,2 --ep-ranks 2 --world 2", "--ep-ranks"},
        {"--config tiny --ids 1,2 --rank 1 --world 2 --ep-addr 127.0.0.1:99999", "--ep-addr"},
        {"--config tiny --ids 1,2 --ep-ranks 2 --ep-transport nccl", "--backend cuda"},
        {"--config tiny --ids 1,2 --ep-ranks 2 --ep-transport ucx", "--ep-transport"},
        {"--config tiny --ids 1,2 --ep-transport nccl", "--ep-ranks"},
        {"--config tiny --bench decode", "--ep-ranks"},
        {"--config tiny --bench prefill --ep-ranks 2", "--bench"},
        {"--config tiny --bench-seqs 4 --ep-ranks 2", "--bench decode"},
        {"--config tiny --bench decode --bench-seqs 0 --ep-ranks 2", "--bench-seqs"},
        {"--config tiny --ids 1,2 --bench decode --ep-ranks 2", "own prompts"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        int rc;
        char err[4096];
        char args[512];
        snprintf(args, sizeof args, "%s --quiet", cases[i].args);
        unsetenv("DI_EP_TOKEN");
        json_t *j = run_generate(args, &rc, err, sizeof err);
        cr_expect_null(j);
        cr_expect_eq(rc, 2, "'%s' exited %d: %s", cases[i].args, rc, err);
        cr_expect(strstr(err, cases[i].needle) != NULL, "'%s': %s", cases[i].args, err);
        cr_expect(strchr(err, '\n') == err + strlen(err) - 1, "one line: %s", err);
    }
}

static double num(json_t *o, const char *key)
{
    json_t *v = json_object_get(o, key);
    cr_assert(json_is_number(v), "bench.%s is a number", key);
    return json_number_value(v);
}

/* --bench decode with 2 ranks: the figures are there and sane (a step takes time, the p90 is
 * not below the median, the exchange's share is a share, moe_lb is between 1 and the ranks). */
Test(ep_generate, the_decode_benchmark_reports_sane_figures, .timeout = 120)
{
    json_t *j = must_run("--config tiny --threads 1 --bench decode --bench-seqs 4 "
                         "--bench-context 8 --max-tokens 6 --ep-ranks 2 --ep-redundant 2 "
                         "--eplb-interval 2 --json --quiet");
    json_t *stats = json_object_get(j, "stats"), *b = json_object_get(stats, "bench");
    cr_assert_not_null(b, "stats.bench");
    cr_expect_eq(json_array_size(json_object_get(j, "requests")), 4, "4 sequences");
    cr_expect_eq(num(b, "ranks"), 2);
    cr_expect_eq(num(b, "seqs"), 4);
    cr_expect_eq(num(b, "context"), 8);
    cr_expect_str_eq(json_string_value(json_object_get(b, "transport")), "cpu");
    double steps = num(b, "decode_steps"), med = num(b, "step_ms_median");
    cr_expect(steps >= 3 && steps <= 6, "decode steps %g (6 tokens, the first from prefill)",
              steps);
    cr_expect(med > 0, "step median %g ms", med);
    cr_expect(num(b, "step_ms_p90") >= med, "p90 %g below the median %g", num(b, "step_ms_p90"),
              med);
    cr_expect(num(b, "tokens_per_s") > 0);
    double x = num(b, "exchange_share");
    cr_expect(x > 0 && x < 1, "exchange share %g", x);
    double lb = num(b, "moe_lb_median"), lb90 = num(b, "moe_lb_p90"), lbm = num(b, "moe_lb_mean");
    cr_expect(lb >= 1 && lb90 >= lb && lb90 <= 2 && lbm >= 1 && lbm <= 2,
              "moe_lb median %g p90 %g mean %g", lb, lb90, lbm);
    /* every request ran to its 6 tokens (no end token in the benchmark) */
    for (size_t i = 0; i < 4; i++)
        cr_expect_eq(json_array_size(json_object_get(json_array_get(json_object_get(j,
                     "requests"), i), "tokens")), 6);
    json_decref(j);
}

Test(ep_generate, a_rank_without_the_token_is_refused, .timeout = 60)
{
    int rc;
    char err[4096];
    unsetenv("DI_EP_TOKEN");
    json_t *j = run_generate("--config tiny --ids 1,2 --rank 1 --world 2 --ep-addr "
                             "127.0.0.1:1 --quiet", &rc, err, sizeof err);
    cr_expect_null(j);
    cr_expect_eq(rc, 2);
    cr_expect(strstr(err, "DI_EP_TOKEN") != NULL, "%s", err);
}

/* Rank 1 with another token is refused by rank 0 (exit 1, "wrong group token"), and rank 0,
 * left alone, gives up at its deadline with the count of ranks that joined. */
Test(ep_generate, a_rank_with_a_wrong_token_is_refused_and_rank_0_gives_up, .timeout = 120)
{
    int fd;
    uint16_t port;
    di_error e;
    cr_assert_eq(ep_group_listen("127.0.0.1:0", false, &fd, &port, &e), DI_OK, "%s", e.msg);
    close(fd); /* a free port for rank 0 */
    const char *root = getenv("DI_BUILD_ROOT");
    char cmd[2048];
    snprintf(cmd, sizeof cmd,
             "G=%s/tools/generate/di-generate; A='--config tiny --ids 1,2 --quiet --world 2 "
             "--ep-addr 127.0.0.1:%u --ep-timeout 2500'; "
             "DI_EP_TOKEN=the-right-group-token-0123 $G $A --rank 0 >/dev/null 2>/tmp/di-ep-r0.$$ & "
             "DI_EP_TOKEN=a-wrong-group-token-45678 $G $A --rank 1 2>&1 >/dev/null; "
             "echo \"rank1=$?\"; wait $!; echo \"rank0=$?\"; cat /tmp/di-ep-r0.$$; "
             "rm -f /tmp/di-ep-r0.$$", root, port);
    FILE *f = popen(cmd, "r");
    cr_assert_not_null(f);
    char out[8192];
    size_t n = fread(out, 1, sizeof out - 1, f);
    out[n] = 0;
    pclose(f);
    cr_expect(strstr(out, "wrong group token") != NULL, "%s", out);
    cr_expect(strstr(out, "rank1=1") != NULL, "%s", out);
    cr_expect(strstr(out, "rank0=1") != NULL, "%s", out);
    cr_expect(strstr(out, "1 of 2 ranks joined") != NULL, "%s", out);
}

/* A rank killed mid-run: the launcher stops the other ranks, waits for them and reports the
 * dead rank at once (not at the group's deadline), leaving no rank process behind. */
Test(ep_generate, a_killed_rank_ends_the_group_at_once, .timeout = 120)
{
    const char *root = getenv("DI_BUILD_ROOT");
    char cmd[2048];
    snprintf(cmd, sizeof cmd,
             "G=%s/tools/generate/di-generate; "
             /* the children of $1 whose command line has $2 (from /proc: no procps needed) */
             "kids() { for d in /proc/[0-9]*; do [ \"$(cut -d' ' -f4 $d/stat 2>/dev/null)\" = "
             "\"$1\" ] && tr '\\0' ' ' < $d/cmdline 2>/dev/null | grep -q -- \"$2\" && "
             "echo ${d#/proc/}; done; }; "
             "$G --config tiny --threads 1 --ids 1,2,3 --ids 4,5 --max-tokens 100000 "
             "--ignore-eos --quiet --ep-ranks 2 --ep-timeout 60000 >/dev/null 2>/tmp/di-ep-k.$$ & "
             "L=$!; sleep 3; R=$(kids $L '--rank 1 '); R0=$(kids $L '--rank 0 '); [ -n \"$R0\" ] || echo norank; [ -n \"$R\" ] || { echo norank; kill $L; }; "
             "t0=$(date +%%s%%N); kill -9 $R; wait $L; rc=$?; t1=$(date +%%s%%N); "
             "echo \"rc=$rc ms=$(( (t1 - t0) / 1000000 ))\"; "
             "echo \"left=$( [ -n \"$R0\" ] && [ -e /proc/$R0 ] && echo 1 || echo 0)\"; cat /tmp/di-ep-k.$$; rm -f /tmp/di-ep-k.$$",
             root);
    FILE *f = popen(cmd, "r");
    cr_assert_not_null(f);
    char out[8192];
    size_t n = fread(out, 1, sizeof out - 1, f);
    out[n] = 0;
    pclose(f);
    cr_expect(strstr(out, "norank") == NULL, "rank 1 was not found: %s", out);
    cr_expect(strstr(out, "rc=1 ") != NULL, "%s", out);
    cr_expect(strstr(out, "rank 1 of 2 failed (exit status 137") != NULL, "%s", out);
    cr_expect(strstr(out, "left=0") != NULL, "%s", out);
    const char *ms = strstr(out, "ms=");
    cr_assert_not_null(ms, "%s", out);
    cr_expect_lt(atoi(ms + 3), 20000, "the group took too long to end: %s", out);
}
