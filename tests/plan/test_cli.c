/* di-plan as an operator runs it: the built binary (DI_BUILD_ROOT/tools/plan/di-plan) with
 * JSON on stdin. Good inputs give the expected JSON and exit 0; bad inputs exit 1 with one
 * line on stderr naming the key and nothing on stdout; usage errors exit 2. */
#include <criterion/criterion.h>
#include <fcntl.h>
#include <jansson.h>
#include <math.h>
#include <spawn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

extern char **environ;

typedef struct cli_run {
    int rc;          /* exit status */
    char out[16384]; /* stdout */
    char err[2048];  /* stderr */
} cli_run;

static int temp_file(char *path, const char *text)
{
    strcpy(path, "/tmp/di-plan-test-XXXXXX");
    int fd = mkstemp(path);
    cr_assert_geq(fd, 0);
    if (text)
        cr_assert_eq(write(fd, text, strlen(text)), (ssize_t)strlen(text));
    return fd;
}

static void slurp(const char *path, char *buf, size_t cap)
{
    FILE *f = fopen(path, "rb");
    cr_assert_not_null(f);
    size_t n = fread(buf, 1, cap - 1, f);
    buf[n] = 0;
    fclose(f);
    unlink(path);
}

/* Runs di-plan with up to 3 arguments and `input` on stdin. */
static cli_run run_plan(const char *a1, const char *a2, const char *input)
{
    const char *root = getenv("DI_BUILD_ROOT");
    cr_assert_not_null(root, "DI_BUILD_ROOT is not set (run through meson test)");
    char bin[4096];
    snprintf(bin, sizeof(bin), "%s/tools/plan/di-plan", root);
    char in_path[64], out_path[64], err_path[64];
    close(temp_file(in_path, input ? input : ""));
    close(temp_file(out_path, NULL));
    close(temp_file(err_path, NULL));
    posix_spawn_file_actions_t fa;
    posix_spawn_file_actions_init(&fa);
    posix_spawn_file_actions_addopen(&fa, 0, in_path, O_RDONLY, 0);
    posix_spawn_file_actions_addopen(&fa, 1, out_path, O_WRONLY | O_TRUNC, 0);
    posix_spawn_file_actions_addopen(&fa, 2, err_path, O_WRONLY | O_TRUNC, 0);
    char *argv[4] = {bin, (char *)a1, (char *)a2, NULL};
    pid_t pid;
    cr_assert_eq(posix_spawn(&pid, bin, &fa, NULL, argv, environ), 0, "cannot run %s", bin);
    posix_spawn_file_actions_destroy(&fa);
    int status = 0;
    cr_assert_eq(waitpid(pid, &status, 0), pid);
    cr_assert(WIFEXITED(status), "di-plan did not exit normally");
    cli_run r = {.rc = WEXITSTATUS(status)};
    slurp(out_path, r.out, sizeof(r.out));
    slurp(err_path, r.err, sizeof(r.err));
    unlink(in_path);
    return r;
}

static json_t *run_ok(const char *cmd, const char *input)
{
    cli_run r = run_plan(cmd, NULL, input);
    cr_assert_eq(r.rc, 0, "di-plan %s failed (%d): %s", cmd, r.rc, r.err);
    cr_assert_str_empty(r.err);
    json_error_t je;
    json_t *j = json_loads(r.out, 0, &je);
    cr_assert_not_null(j, "output is not JSON: %s (%s)", r.out, je.text);
    return j;
}

/* Bad input: exit 1, nothing on stdout, exactly one line on stderr containing `needle`. */
static void run_bad(const char *cmd, const char *input, const char *needle)
{
    cli_run r = run_plan(cmd, NULL, input);
    cr_assert_eq(r.rc, 1, "di-plan %s exited %d for %s", cmd, r.rc, input);
    cr_assert_str_empty(r.out, "stdout not empty: %s", r.out);
    size_t len = strlen(r.err);
    cr_assert(len > 0 && r.err[len - 1] == '\n' && !memchr(r.err, '\n', len - 1),
              "stderr is not one line: '%s'", r.err);
    cr_assert(strncmp(r.err, "di-plan ", 8) == 0, "%s", r.err);
    cr_assert(strstr(r.err, needle) != NULL, "stderr '%s' lacks '%s'", r.err, needle);
}

static void assert_int_array(const json_t *a, const long long *want, size_t n)
{
    cr_assert(json_is_array(a));
    cr_assert_eq(json_array_size(a), n);
    for (size_t i = 0; i < n; i++)
        cr_assert_eq(json_integer_value(json_array_get(a, i)), want[i], "[%zu]", i);
}

static double num(const json_t *o, const char *key)
{
    const json_t *v = json_object_get(o, key);
    cr_assert(json_is_number(v), "key %s missing from output", key);
    return json_number_value(v);
}

/* ---- help and usage ------------------------------------------------------------------------ */

Test(cli, help_lists_every_command)
{
    cli_run r = run_plan("--help", NULL, NULL);
    cr_assert_eq(r.rc, 0);
    const char *cmds[] = {"eplb", "varlen", "graphs", "store"};
    for (int i = 0; i < 4; i++) {
        cr_assert(strstr(r.out, cmds[i]) != NULL, "--help lacks %s", cmds[i]);
        cli_run h = run_plan(cmds[i], "--help", NULL);
        cr_assert_eq(h.rc, 0, "%s --help", cmds[i]);
        cr_assert(strstr(h.out, "input keys") != NULL);
        cr_assert(strstr(h.out, "example") != NULL);
    }
    cli_run h = run_plan("eplb", "--help", NULL);
    cr_assert(strstr(h.out, "slots_per_gpu") && strstr(h.out, "(optional)"), "%s", h.out);
    h = run_plan("store", "-h", NULL);
    cr_assert(strstr(h.out, "window_state_bytes") != NULL);
}

Test(cli, usage_errors_exit_2)
{
    cli_run r = run_plan(NULL, NULL, NULL);
    cr_assert_eq(r.rc, 2);
    cr_assert(strstr(r.err, "usage") != NULL);
    r = run_plan("bogus", NULL, "{}");
    cr_assert_eq(r.rc, 2);
    cr_assert(strstr(r.err, "unknown command 'bogus'") != NULL, "%s", r.err);
    r = run_plan("eplb", "--fast", "{}");
    cr_assert_eq(r.rc, 2);
    cr_assert(strstr(r.err, "unknown option '--fast'") != NULL, "%s", r.err);
}

/* The example input printed by each --help runs as shown. */
Test(cli, help_examples_run)
{
    const char *cmds[] = {"eplb", "varlen", "graphs", "store"};
    for (int i = 0; i < 4; i++) {
        cli_run h = run_plan(cmds[i], "--help", NULL);
        char *start = strstr(h.out, "echo '");
        cr_assert_not_null(start);
        start += 6;
        char *end = strstr(start, "' | di-plan");
        cr_assert_not_null(end);
        *end = 0;
        json_decref(run_ok(cmds[i], start));
    }
}

/* ---- eplb ----------------------------------------------------------------------------------- */

/* Pass 1 toy on 2 GPUs x 3 slots from the start-up layout {0 1 2} {3 0 1}: start
 * GPU0 1.5 + 1 + 6 = 8.5, GPU1 1 + 1.5 + 1 = 3.5, moe_lb 8.5 / 6 = 1.417; the plan
 * {2 1 3} {2 0 0} balances to 6 and 6 (worked in test_eplb.c). */
Test(cli, eplb_plans_from_startup_layout)
{
    json_t *j = run_ok("eplb", "{\"num_gpus\": 2, \"slots_per_gpu\": 3, \"load\": [[3, 2, 6, 1]]}");
    json_t *g = json_object_get(j, "gpus");
    cr_assert_eq(json_array_size(g), 2);
    assert_int_array(json_array_get(g, 0), (const long long[]){2, 1, 3}, 3);
    assert_int_array(json_array_get(g, 1), (const long long[]){2, 0, 0}, 3);
    cr_assert(fabs(num(j, "moe_lb_current") - 8.5 / 6) < 1e-9);
    cr_assert(fabs(num(j, "moe_lb_plan") - 1.0) < 1e-9);
    cr_assert(json_is_false(json_object_get(j, "kept_current")));
    json_decref(j);
}

/* "When greedy makes it worse" (test_eplb.c): the plan is 39/35, the current 37/35, so the
 * current layout comes back. */
Test(cli, eplb_keeps_a_better_current_layout)
{
    json_t *j = run_ok("eplb", "{\"num_gpus\": 2, \"slots_per_gpu\": 3, "
                               "\"load\": [[15, 40, 60, 50, 60], [35, 20, 20, 30, 20]], "
                               "\"current\": [[0, 1, 2], [3, 4, 0]]}");
    json_t *g = json_object_get(j, "gpus");
    assert_int_array(json_array_get(g, 0), (const long long[]){0, 1, 2}, 3);
    assert_int_array(json_array_get(g, 1), (const long long[]){3, 4, 0}, 3);
    cr_assert(fabs(num(j, "moe_lb_current") - 37.0 / 35) < 1e-9);
    cr_assert(fabs(num(j, "moe_lb_plan") - 39.0 / 35) < 1e-9);
    cr_assert(json_is_true(json_object_get(j, "kept_current")));
    json_decref(j);
}

/* ---- varlen, graphs, store: good inputs --------------------------------------------------- */

/* The explainer's W/X/Y/Z (worked in test_varlen.c): 8 rows, W 3 drafts, X 1, Y and Z 0. */
Test(cli, varlen_wxyz)
{
    json_t *j = run_ok("varlen", "{\"confidences\": [[0.95, 0.90, 0.80], [0.85, 0.60, 0.30], "
                                 "[0.50, 0.20, 0.10], [0.30, 0.10, 0.05]], \"step_ms\": "
                                 "{\"4\": 8.1, \"8\": 8.6, \"16\": 12.0}, \"sampler_ms\": 0.4}");
    cr_assert_eq(num(j, "rows"), 8);
    assert_int_array(json_object_get(j, "drafts"), (const long long[]){3, 1, 0, 0}, 4);
    cr_assert(fabs(num(j, "tokens_per_ms") - 7.5 / 9.0) < 1e-9);
    json_decref(j);
    j = run_ok("varlen", "{\"confidences\": [[0.95, 0.90, 0.80], [0.85, 0.60, 0.30], "
                         "[0.50, 0.20, 0.10], [0.30, 0.10, 0.05]], \"step_ms\": "
                         "{\"4\": 8.1, \"8\": 8.6, \"16\": 10.4}, \"sampler_ms\": 0.4}");
    cr_assert_eq(num(j, "rows"), 16);
    assert_int_array(json_object_get(j, "drafts"), (const long long[]){3, 3, 3, 3}, 4);
    cr_assert(fabs(num(j, "tokens_per_ms") - 9.65 / 10.8) < 1e-9);
    json_decref(j);
    /* a request with no drafts */
    j = run_ok("varlen", "{\"confidences\": [[], [0.5]], \"step_ms\": {\"2\": 1, \"3\": 1}, "
                         "\"sampler_ms\": 0}");
    assert_int_array(json_object_get(j, "drafts"), (const long long[]){0, 1}, 2);
    json_decref(j);
}

/* DESIGN.md §3: 4 x 6 = 24 rows -> 1 2 4 8 16 24; 64 x 6 with interval 32 -> 1 2 4 8 16 32
 * then every 32 up to 384. */
Test(cli, graphs_sizes)
{
    json_t *j = run_ok("graphs", "{\"max_num_seqs\": 4, \"nextn\": 5}");
    assert_int_array(json_object_get(j, "sizes"), (const long long[]){1, 2, 4, 8, 16, 24}, 6);
    cr_assert_eq(num(j, "max_rows"), 24);
    json_decref(j);
    j = run_ok("graphs", "{\"max_num_seqs\": 64, \"nextn\": 5, \"interval\": 32}");
    json_t *sz = json_object_get(j, "sizes");
    cr_assert_eq(json_array_size(sz), 6 + 11);
    cr_assert_eq(json_integer_value(json_array_get(sz, 5)), 32);
    cr_assert_eq(json_integer_value(json_array_get(sz, 6)), 64);
    cr_assert_eq(json_integer_value(json_array_get(sz, 16)), 384);
    json_decref(j);
}

/* KV sizes: V4.1-Flash's 114,048-byte blocks and 891 bytes per token; 129 blocks for the
 * explainer's 16,389-token prompt, whose next token lands in ring slot 41; 391 blocks for the
 * 50,000-token prompt. The small configs come from their own geometry. */
Test(cli, kv_sizes)
{
    json_t *j = run_ok("kv", "{\"config\": \"v41-flash\", \"tokens\": [16389, 50000]}");
    cr_assert_eq(num(j, "block_bytes"), 114048);
    cr_assert_eq(num(j, "bytes_per_token"), 891.0);
    cr_assert_eq(num(j, "ring_positions"), 134);
    cr_assert_eq(num(j, "ring_entry_bytes"), 528);
    cr_assert_eq(num(j, "ring_bytes_per_layer") * 20, 1415040, "the explainer's stored region");
    json_t *reqs = json_object_get(j, "requests");
    cr_assert_eq(json_array_size(reqs), 2);
    cr_assert_eq(num(json_array_get(reqs, 0), "blocks"), 129);
    cr_assert_eq(num(json_array_get(reqs, 0), "paged_kv_bytes"), 129.0 * 114048);
    cr_assert_eq(num(json_array_get(reqs, 0), "next_ring_slot"), 41);
    cr_assert_eq(num(json_array_get(reqs, 1), "blocks"), 391);
    double slot = num(j, "state_slot_bytes");
    cr_assert(slot > 3.0e6 && slot < 3.2e6, "state slot %g bytes, about 3.1 MB", slot);
    json_decref(j);
    /* nextn 3 shrinks the ring to 132; backtracking 10 widens it to 138 */
    j = run_ok("kv", "{\"nextn\": 3}");
    cr_assert_eq(num(j, "ring_positions"), 132);
    cr_assert_eq(json_array_size(json_object_get(j, "requests")), 0);
    json_decref(j);
    j = run_ok("kv", "{\"nextn\": 3, \"backtracking\": 10}");
    cr_assert_eq(num(j, "ring_positions"), 138);
    json_decref(j);
    /* a small config and an inline object give the same sizes */
    j = run_ok("kv", "{\"config\": \"tiny\", \"tokens\": 300}");
    double tiny_block = num(j, "block_bytes");
    cr_assert(tiny_block > 128 && tiny_block < 114048);
    cr_assert_eq(num(json_array_get(json_object_get(j, "requests"), 0), "blocks"), 3);
    json_decref(j);
}

/* The explainer's store example (worked in test_store_plan.c). */
Test(cli, store_example)
{
    json_t *j = run_ok("store",
                       "{\"tokens_per_day\": 155e12, \"input_share\": 0.9, \"input_hit_rate\": "
                       "0.8, \"store_decode_kv\": true, \"retention\": [{\"share\": 0.6, "
                       "\"days\": 3}, {\"share\": 0.4, \"days\": 7}], \"bytes_per_token\": 891, "
                       "\"avg_request_tokens\": 20000, \"server\": {\"ssds\": 20, \"ssd_tb\": "
                       "30.73, \"read_gb_s\": 40, \"ec_data\": 10, \"ec_parity\": 2}}");
    cr_assert(fabs(num(j, "held_tokens") / 199.64e12 - 1) < 1e-9);
    cr_assert(fabs(num(j, "held_bytes") / 1.7787924e17 - 1) < 1e-9);
    cr_assert_eq(num(j, "servers_capacity"), 348);
    cr_assert_eq(num(j, "servers_bandwidth"), 29);
    cr_assert_str_eq(json_string_value(json_object_get(j, "limit")), "capacity");
    cr_assert_eq(num(j, "window_state_bytes_per_request"), 1501184);
    cr_assert(fabs(num(j, "window_state_bytes_per_token") - 75.0592) < 1e-9);
    json_decref(j);
    /* An explicit window_state_bytes overrides the default. */
    j = run_ok("store", "{\"tokens_per_day\": 1e9, \"input_share\": 1, \"input_hit_rate\": 0, "
                        "\"store_decode_kv\": false, \"retention\": [{\"share\": 1, \"days\": "
                        "1}], \"avg_request_tokens\": 1000, \"window_state_bytes\": 5000, "
                        "\"server\": {\"ssds\": 1, \"ssd_tb\": 1, \"read_gb_s\": 1, "
                        "\"ec_data\": 1, \"ec_parity\": 0}}");
    cr_assert_eq(num(j, "window_state_bytes_per_token"), 5);
    cr_assert_eq(num(j, "held_bytes"), 891e9, "default 891 bytes per token");
    json_decref(j);
}

/* ---- bad inputs: one row each ---------------------------------------------------------------- */

typedef struct bad_case {
    const char *cmd;    /* subcommand */
    const char *input;  /* stdin */
    const char *needle; /* must appear in the one-line error */
} bad_case;

#define EP "{\"num_gpus\": 2, \"slots_per_gpu\": 3, "
#define VL_TIMES "\"step_ms\": {\"4\": 1.0}, \"sampler_ms\": 0}"
#define ST_SERVER "\"server\": {\"ssds\": 20, \"ssd_tb\": 30.73, \"read_gb_s\": 40, " \
                  "\"ec_data\": 10, \"ec_parity\": 2}"
#define ST_HEAD "{\"tokens_per_day\": 155e12, \"input_share\": 0.9, \"input_hit_rate\": 0.8, " \
                "\"store_decode_kv\": true, \"avg_request_tokens\": 20000, "

static const bad_case bad_cases[] = {
    /* any command */
    {"eplb", "", "invalid JSON"},
    {"eplb", "{\"num_gpus\": 2,", "invalid JSON"},
    {"eplb", "[1, 2]", "expected an object"},
    {"graphs", "{\"max_num_seqs\": 4, \"nextn\": 5, \"extra\": 1}", "unknown key 'extra'"},
    /* eplb */
    {"eplb", "{\"slots_per_gpu\": 3, \"load\": [[1]]}", "missing key 'num_gpus'"},
    {"eplb", EP "\"lod\": [[1]]}", "unknown key 'lod'"},
    {"eplb", EP "\"load\": \"heavy\"}", "key 'load': expected an array, got string"},
    {"eplb", EP "\"load\": [[3, 2, \"6\", 1]]}", "key 'load'[0][2]: expected a number"},
    {"eplb", EP "\"load\": [[3, 2, -6, 1]]}", "key 'load'[0][2]: -6 must be >= 0"},
    {"eplb", EP "\"load\": [[3, 2, 6, 1], [1, 2, 3]]}", "key 'load'[1]: 3 entries"},
    {"eplb", EP "\"load\": []}", "key 'load': empty array"},
    {"eplb", EP "\"load\": [[]]}", "key 'load'[0]: empty array"},
    {"eplb", EP "\"load\": [[0, 0, 0, 0]]}", "load window has no tokens"},
    {"eplb", EP "\"load\": [[1, 1, 1, 1, 1, 1, 1]]}", "cannot hold the 7 experts"},
    {"eplb", "{\"num_gpus\": 0, \"slots_per_gpu\": 3, \"load\": [[1]]}", "'num_gpus'"},
    {"eplb", "{\"num_gpus\": -2, \"slots_per_gpu\": 3, \"load\": [[1]]}", "'num_gpus'"},
    {"eplb", "{\"num_gpus\": 2.5, \"slots_per_gpu\": 3, \"load\": [[1]]}", "'num_gpus'"},
    {"eplb", EP "\"load\": [[3, 2, 6, 1]], \"current\": [[0, 1, 2], [3, 9, 0]]}",
     "key 'current'[1][1]: 9 outside [0, 3]"},
    {"eplb", EP "\"load\": [[3, 2, 6, 1]], \"current\": [[0, 1, 2], [3, 0.5, 0]]}",
     "key 'current'[1][1]: 0.5 is not an integer"},
    {"eplb", EP "\"load\": [[3, 2, 6, 1]], \"current\": [[0, 1, 2], [3, 0]]}",
     "key 'current'[1]: 2 slots, but slots_per_gpu is 3"},
    {"eplb", EP "\"load\": [[3, 2, 6, 1]], \"current\": [[0, 1, 2]]}",
     "key 'current': 1 GPUs, but num_gpus is 2"},
    {"eplb", EP "\"load\": [[3, 2, 6, 1]], \"current\": [[0, 1, 2], [0, 1, 2]]}",
     "current layout: expert 3 has no copy"},
    /* varlen */
    {"varlen", "{\"confidences\": [[0.5]], \"sampler_ms\": 0}", "missing key 'step_ms'"},
    {"varlen", "{\"confidences\": [[0.5, 0.6]], " VL_TIMES,
     "confidences[0][1] = 0.6 exceeds confidences[0][0] = 0.5"},
    {"varlen", "{\"confidences\": [[1.5]], " VL_TIMES, "key 'confidences'[0][0]: 1.5 outside"},
    {"varlen", "{\"confidences\": [0.5], " VL_TIMES, "key 'confidences'[0]: expected an array"},
    {"varlen", "{\"confidences\": [], " VL_TIMES, "key 'confidences': empty array"},
    {"varlen", "{\"confidences\": [[], [], [], [], []], " VL_TIMES,
     "step_ms: largest graph (4 rows) cannot hold one row for each of 5 requests"},
    {"varlen", "{\"confidences\": [[0.5]], \"step_ms\": {\"four\": 1}, \"sampler_ms\": 0}",
     "key 'step_ms': graph size 'four' is not a positive integer"},
    {"varlen", "{\"confidences\": [[0.5]], \"step_ms\": {\"0\": 1}, \"sampler_ms\": 0}",
     "graph size '0'"},
    {"varlen", "{\"confidences\": [[0.5]], \"step_ms\": {\"4\": -1}, \"sampler_ms\": 0}",
     "key 'step_ms'.'4'"},
    {"varlen", "{\"confidences\": [[0.5]], \"step_ms\": {}, \"sampler_ms\": 0}",
     "key 'step_ms': no graph sizes"},
    {"varlen", "{\"confidences\": [[0.5]], \"step_ms\": {\"4\": 1, \"04\": 2}, "
               "\"sampler_ms\": 0}", "graph size 4 appears twice"},
    {"varlen", "{\"confidences\": [[0.5]], \"step_ms\": {\"4\": 1}, \"sampler_ms\": -1}",
     "sampler_ms"},
    {"varlen", "{\"confidences\": [[0.5]], \"step_ms\": {\"4\": 1}}", "missing key 'sampler_ms'"},
    /* graphs */
    {"graphs", "{\"max_num_seqs\": 0, \"nextn\": 5}", "'max_num_seqs'"},
    {"graphs", "{\"max_num_seqs\": 4, \"nextn\": \"5\"}", "key 'nextn': expected an integer"},
    {"graphs", "{\"max_num_seqs\": 4, \"nextn\": 5, \"interval\": 0}", "'interval'"},
    {"graphs", "{\"nextn\": 5}", "missing key 'max_num_seqs'"},
    /* kv */
    {"kv", "{\"config\": \"no-such-model\"}", "key 'config': 'no-such-model'"},
    {"kv", "{\"config\": 7}", "key 'config': expected a name, a path or an object"},
    {"kv", "{\"config\": {\"hidden_size\": 64}}", "key 'config': "},
    {"kv", "{\"tokens\": -1}", "key 'tokens'"},
    {"kv", "{\"tokens\": [1, \"x\"]}", "key 'tokens'[i]"},
    {"kv", "{\"nextn\": 99}", "'nextn'"},
    {"kv", "{\"config\": \"tiny\", \"layers\": 3}", "unknown key 'layers'"},
    /* store */
    {"store", ST_HEAD "\"retention\": [{\"share\": 0.6, \"days\": 3}, {\"share\": 0.3, "
              "\"days\": 7}], " ST_SERVER "}", "retention shares sum to 0.9"},
    {"store", ST_HEAD "\"retention\": [{\"share\": 1, \"day\": 3}], " ST_SERVER "}",
     "key 'retention'[0]: unknown key 'day'"},
    {"store", ST_HEAD "\"retention\": [{\"share\": 1, \"days\": \"3\"}], " ST_SERVER "}",
     "key 'retention'[0]: key 'days': expected a number"},
    {"store", ST_HEAD "\"retention\": [], " ST_SERVER "}", "key 'retention': 0 classes"},
    {"store", ST_HEAD "\"retention\": [{\"share\": 1, \"days\": 3}], \"server\": {\"ssds\": 20,"
              " \"ssd_tb\": 30.73, \"read_gb_s\": 40, \"ec_data\": 10}}",
     "key 'server': missing key 'ec_parity'"},
    {"store", ST_HEAD "\"retention\": [{\"share\": 1, \"days\": 3}], \"server\": {\"ssds\": 0,"
              " \"ssd_tb\": 30.73, \"read_gb_s\": 40, \"ec_data\": 10, \"ec_parity\": 2}}",
     "key 'server': key 'ssds'"},
    {"store", ST_HEAD "\"retention\": [{\"share\": 1, \"days\": 3}], \"server\": {\"ssds\": 20,"
              " \"ssd_tb\": 30.73, \"read_gb_s\": 0, \"ec_data\": 10, \"ec_parity\": 2}}",
     "server.read_gb_s"},
    {"store", "{\"tokens_per_day\": 155e12, \"input_share\": 1.2, \"input_hit_rate\": 0.8, "
              "\"store_decode_kv\": true, \"avg_request_tokens\": 20000, \"retention\": "
              "[{\"share\": 1, \"days\": 3}], " ST_SERVER "}", "input_share 1.2 outside [0, 1]"},
    {"store", "{\"tokens_per_day\": 155e12, \"input_share\": 0.9, \"input_hit_rate\": 0.8, "
              "\"store_decode_kv\": 1, \"avg_request_tokens\": 20000, \"retention\": "
              "[{\"share\": 1, \"days\": 3}], " ST_SERVER "}",
     "key 'store_decode_kv': expected true or false"},
    {"store", ST_HEAD "\"retention\": [{\"share\": 1, \"days\": 3}], "
              "\"window_state_bytes\": -5, " ST_SERVER "}", "window_state_bytes"},
};

Test(cli, bad_inputs_exit_1_with_one_line_naming_the_key)
{
    for (size_t i = 0; i < sizeof(bad_cases) / sizeof(bad_cases[0]); i++)
        run_bad(bad_cases[i].cmd, bad_cases[i].input, bad_cases[i].needle);
}
