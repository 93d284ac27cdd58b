/* di-generate end to end on a tiny checkpoint written by di-mkmodel: outputs agree across
 * speculative and plain decoding and with the forward API, the logits dump is exact, and bad
 * inputs get a clear one-line error and a non-zero exit. */
#include <criterion/criterion.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "tests/forward/fwd_fixture.h"

static char g_dir[256];      /* the test's temporary directory */
static char g_model[300];    /* tiny checkpoint, seed 1 */

static const char *build_root(void)
{
    const char *b = getenv("DI_BUILD_ROOT");
    cr_assert(b, "DI_BUILD_ROOT is not set (run under meson test)");
    return b;
}

static void setup(void)
{
    snprintf(g_dir, sizeof g_dir, "%s/di-gen-test-XXXXXX", getenv("TMPDIR") ? getenv("TMPDIR") : "/tmp");
    cr_assert(mkdtemp(g_dir));
    snprintf(g_model, sizeof g_model, "%s/tiny", g_dir);
    char cmd[1024];
    snprintf(cmd, sizeof cmd, "%s/tools/mkmodel/di-mkmodel --quiet --seed 1 tiny %s > /dev/null",
             build_root(), g_model);
    cr_assert_eq(system(cmd), 0, "%s", cmd);
}

static void teardown(void)
{
    char cmd[400];
    snprintf(cmd, sizeof cmd, "rm -rf %s", g_dir);
    if (system(cmd) != 0)
        fprintf(stderr, "could not remove %s\n", g_dir);
}

/* Runs di-generate with args; stdout and stderr into malloc'd strings; returns the exit code. */
static int gen(const char *args, char **out, char **err)
{
    char cmd[4096];
    snprintf(cmd, sizeof cmd, "%s/tools/generate/di-generate --quiet %s > %s/out 2> %s/err",
             build_root(), args, g_dir, g_dir);
    int rc = system(cmd);
    char path[300];
    char **dst[2] = {out, err};
    const char *names[2] = {"out", "err"};
    for (int i = 0; i < 2; i++) {
        snprintf(path, sizeof path, "%s/%s", g_dir, names[i]);
        FILE *f = fopen(path, "r");
        cr_assert(f);
        char *buf = calloc(1, 1 << 20);
        size_t n = fread(buf, 1, (1 << 20) - 1, f);
        buf[n] = 0;
        fclose(f);
        if (dst[i])
            *dst[i] = buf;
        else
            free(buf);
    }
    return WIFEXITED(rc) ? WEXITSTATUS(rc) : -1;
}

TestSuite(generate, .init = setup, .fini = teardown, .timeout = 120);

Test(generate, greedy_tokens_agree_across_spec_decode_and_in_memory_weights)
{
    char args[1024], *a, *b, *c;
    snprintf(args, sizeof args, "--model %s --ids 3,17,42,99,100 --ids 5,6,7 --max-tokens 24 "
             "--temperature 0 --nextn 0", g_model);
    {
        int rc_ = gen(args, &a, NULL);
        cr_assert_eq(rc_, 0);
    }
    snprintf(args, sizeof args, "--model %s --ids 3,17,42,99,100 --ids 5,6,7 --max-tokens 24 "
             "--temperature 0 --nextn 5", g_model);
    {
        int rc_ = gen(args, &b, NULL);
        cr_assert_eq(rc_, 0);
    }
    snprintf(args, sizeof args, "--config tiny --weights-seed 1 --ids 3,17,42,99,100 --ids 5,6,7 "
             "--max-tokens 24 --temperature 0 --nextn 3");
    {
        int rc_ = gen(args, &c, NULL);
        cr_assert_eq(rc_, 0);
    }
    cr_assert(strstr(a, "request 1 (length):") && strstr(a, "request 2 (length):"), "%s", a);
    cr_assert_str_eq(a, b);
    cr_assert_str_eq(a, c);
    free(a);
    free(b);
    free(c);
}

Test(generate, sampled_tokens_depend_on_the_seed_only)
{
    char args[1024], *a, *b, *c;
    snprintf(args, sizeof args, "--model %s --ids 9,8,7 --max-tokens 20 --seed 5 --top-p 0.9",
             g_model);
    {
        int rc_ = gen(args, &a, NULL);
        cr_assert_eq(rc_, 0);
    }
    /* the same request in a batch with another one gives the same tokens */
    snprintf(args, sizeof args, "--model %s --ids 1,2,3,4 --ids 9,8,7 --max-tokens 20 --seed 5 "
             "--top-p 0.9", g_model);
    {
        int rc_ = gen(args, &b, NULL);
        cr_assert_eq(rc_, 0);
    }
    snprintf(args, sizeof args, "--model %s --ids 9,8,7 --max-tokens 20 --seed 6 --top-p 0.9",
             g_model);
    {
        int rc_ = gen(args, &c, NULL);
        cr_assert_eq(rc_, 0);
    }
    const char *tail = strchr(a, ':');
    cr_assert(strstr(b, tail) != NULL, "batched:\n%s\nalone:\n%s", b, a);
    cr_assert_str_neq(a, c);
    free(a);
    free(b);
    free(c);
}

/* The dump holds the raw logits of the prompt's last row, then of every teacher-forced row,
 * equal bit for bit to a prefill of prompt + forced ids through the forward API. */
Test(generate, dump_logits_equal_the_forward_prefill)
{
    char args[1024], *out;
    static const int32_t ids[] = {3, 17, 42, 99, 100, 7, 8, 9, 4000, 12};
    snprintf(args, sizeof args, "--model %s --ids 3,17,42,99,100 --teacher-force 7,8,9,4000,12 "
             "--dump-logits %s/d.jsonl --json", g_model, g_dir);
    {
        int rc_ = gen(args, &out, NULL);
        cr_assert_eq(rc_, 0);
    }
    json_error_t je;
    json_t *doc = json_loads(out, 0, &je);
    cr_assert(doc, "%s", je.text);
    json_t *toks = json_object_get(json_array_get(json_object_get(doc, "requests"), 0), "tokens");
    cr_assert_eq(json_array_size(toks), 6, "5 forced tokens and one sampled after them");
    for (int i = 0; i < 5; i++)
        cr_assert_eq(json_integer_value(json_array_get(toks, (size_t)i)), ids[5 + i]);
    json_decref(doc);
    free(out);

    runner_model rm;
    kern_backend be;
    di_error e;
    cr_assert_eq(kern_cpu_create(1, &be, &e), DI_OK);
    cr_assert_eq(runner_model_load(g_model, NULL, &rm, &e), DI_OK, "%s", e.msg);
    fwd_options o = {.max_rows = 16, .token_map = rm.token_map, .token_map_pad = rm.token_map_pad};
    fwd_model *m;
    fwd_run *r;
    fwd_kv *kv;
    cr_assert_eq(fwd_model_create(rm.w, &be, &o, &m, &e), DI_OK, "%s", e.msg);
    cr_assert_eq(fwd_run_create(m, &r, &e), DI_OK);
    cr_assert_eq(fwd_kv_create(fwd_model_geometry(m), &be, 2, 1, &kv, &e), DI_OK);
    uint32_t blocks[1] = {1};
    fwd_seq q = {.n_rows = 10, .pos0 = 0, .tokens = ids, .blocks = blocks, .n_blocks = 1};
    int32_t rows[6] = {4, 5, 6, 7, 8, 9};
    uint32_t V = rm.w->config.vocab_size;
    float *want = malloc(6 * V * sizeof(float));
    fwd_step st = {.n_seqs = 1, .seqs = &q, .n_logit_rows = 6, .logit_rows = rows};
    cr_assert_eq(fwd_step_run(r, kv, &st, want, &e), DI_OK, "%s", e.msg);

    char path[300];
    snprintf(path, sizeof path, "%s/d.jsonl", g_dir);
    FILE *f = fopen(path, "r");
    cr_assert(f);
    char *line = NULL;
    size_t cap = 0;
    int n = 0;
    while (getline(&line, &cap, f) > 0) {
        json_t *row = json_loads(line, 0, &je);
        cr_assert(row, "line %d: %s", n, je.text);
        cr_assert_eq(json_integer_value(json_object_get(row, "position")), 4 + n);
        json_t *lg = json_object_get(row, "logits");
        cr_assert_eq(json_array_size(lg), V);
        for (uint32_t v = 0; v < V; v++) {
            float got = (float)json_number_value(json_array_get(lg, v));
            cr_assert_eq(got, want[(size_t)n * V + v], "row %d logit %u: %.9g vs %.9g", n, v,
                         got, want[(size_t)n * V + v]);
        }
        json_decref(row);
        n++;
    }
    cr_assert_eq(n, 6, "prompt's last row and 5 teacher-forced rows");
    free(line);
    fclose(f);
    free(want);
    fwd_kv_free(kv);
    fwd_run_free(r);
    fwd_model_free(m);
    runner_model_free(&rm);
    kern_cpu_destroy(&be);
}

/* A command line di-generate must refuse, and what its error says. */
typedef struct refusal {
    const char *args;
    const char *msg;
} refusal;

/* Every refusal: non-zero exit, one line on stderr naming the problem. */
static void expect_refusals(const refusal *cases, size_t n)
{
    char args[1024], *err;
    for (size_t i = 0; i < n; i++) {
        snprintf(args, sizeof args, "--model %s %s", g_model, cases[i].args);
        int rc = gen(args, NULL, &err);
        cr_assert_neq(rc, 0, "%s: exit 0", cases[i].args);
        cr_assert(strstr(err, cases[i].msg) != NULL, "%s: stderr '%s'", cases[i].args, err);
        cr_assert(strchr(err, '\n') == err + strlen(err) - 1, "one line: '%s'", err);
        free(err);
    }
}

Test(generate, bad_inputs_fail_with_a_clear_error)
{
    refusal cases[] = {
        {"--ids 3,99999", "outside the vocabulary"},
        {"--ids ,", "empty prompt"},
        {"--ids 3,x", "not a non-negative integer"},
        {"--max-model-len 5 --ids 1,2,3,4,5,6", "exceeds the context limit"},
        {"--top-p 1.5 --ids 3", "top_p 1.5 outside (0, 1]"},
        {"--top-p 0 --ids 3", "top_p 0 outside (0, 1]"},
        {"--temperature -1 --ids 3", "temperature -1 outside"},
        {"--yoco compact --keep-tokens 100 --ids 3", "below the ring size 134"},
        {"--nextn 9 --ids 3", "--nextn"},
        {"--no-such-flag", "unknown option"},
        {"--teacher-force 1,5000 --ids 3", "outside the vocabulary"},
        {"--backend tpu --ids 3", "'tpu' is not cpu or cuda"},
        {"--device 64 --ids 3", "--device"},
        /* no CUDA in the build, no driver, or no device 63: refused whichever applies */
        {"--backend cuda --device 63 --ids 3", "--backend cuda"},
    };
    expect_refusals(cases, sizeof(cases) / sizeof(cases[0]));
}

/* Copies the checkpoint to dir/name and sets text_config.key (or the top level) to value. */
static void edited_copy(const char *name, const char *key, json_t *value)
{
    char cmd[1024], path[600];
    snprintf(cmd, sizeof cmd, "cp -r %s %s/%s", g_model, g_dir, name);
    cr_assert_eq(system(cmd), 0);
    snprintf(path, sizeof path, "%s/%s/config.json", g_dir, name);
    json_error_t je;
    json_t *doc = json_load_file(path, 0, &je);
    cr_assert(doc, "%s", je.text);
    json_t *tc = json_object_get(doc, "text_config");
    json_object_set_new(tc ? tc : doc, key, value);
    cr_assert_eq(json_dump_file(doc, path, JSON_INDENT(1)), 0);
    json_decref(doc);
}

Test(generate, broken_checkpoints_fail_with_a_clear_error)
{
    char cmd[2048], args[1024], *err;
    /* truncated shard */
    snprintf(cmd, sizeof cmd, "cp -r %s %s/trunc && f=%s/trunc/model-00001-of-00001.safetensors "
             "&& truncate -s $(( $(stat -c %%s $f) - 1000 )) $f", g_model, g_dir, g_dir);
    cr_assert_eq(system(cmd), 0);
    snprintf(args, sizeof args, "--model %s/trunc --ids 3", g_dir);
    {
        int rc_ = gen(args, NULL, &err);
        cr_assert_neq(rc_, 0);
    }
    cr_assert(strstr(err, "truncated") != NULL, "%s", err);
    free(err);
    /* a config that does not match the tensors */
    edited_copy("mism", "hidden_size", json_integer(256));
    snprintf(args, sizeof args, "--model %s/mism --ids 3", g_dir);
    {
        int rc_ = gen(args, NULL, &err);
        cr_assert_neq(rc_, 0);
    }
    cr_assert(strstr(err, "shape") != NULL, "%s", err);
    free(err);
    /* inconsistent owner layers: 3 is not an index source */
    edited_copy("own", "kv_source_layer_ids", json_pack("[i, i]", 3, 4));
    snprintf(args, sizeof args, "--model %s/own --ids 3", g_dir);
    {
        int rc_ = gen(args, NULL, &err);
        cr_assert_neq(rc_, 0);
    }
    cr_assert(strstr(err, "KV source") != NULL, "%s", err);
    free(err);
}

Test(generate, help_and_stdin_prompts)
{
    char cmd[1024], *out;
    snprintf(cmd, sizeof cmd, "--help");
    {
        int rc_ = gen(cmd, &out, NULL);
        cr_assert_eq(rc_, 0);
    }
    cr_assert(strstr(out, "--teacher-force") && strstr(out, "--top-p"), "%s", out);
    free(out);
    snprintf(cmd, sizeof cmd, "--model %s --max-tokens 3 < /dev/null", g_model);
    char *err;
    {
        int rc_ = gen(cmd, NULL, &err);
        cr_assert_neq(rc_, 0);
    }
    cr_assert(strstr(err, "no prompt") != NULL, "%s", err);
    free(err);
    char path[300];
    snprintf(path, sizeof path, "%s/prompts", g_dir);
    FILE *f = fopen(path, "w");
    fputs("3 4 5\n\n6,7\n", f);
    fclose(f);
    snprintf(cmd, sizeof cmd, "--model %s --max-tokens 3 --temperature 0 < %s", g_model, path);
    {
        int rc_ = gen(cmd, &out, NULL);
        cr_assert_eq(rc_, 0);
    }
    cr_assert(strstr(out, "request 1") && strstr(out, "request 2") && !strstr(out, "request 3"),
              "%s", out);
    free(out);
}

/* ---- MTP varlen (--varlen) ---- */

/* The JSON report's "tokens" of every request, as one string, and stats.decode_rows. */
static char *tokens_and_rows(const char *json, double *rows)
{
    json_error_t je;
    json_t *doc = json_loads(json, 0, &je);
    cr_assert(doc, "%s", je.text);
    char *s = json_dumps(json_object_get(doc, "requests"), JSON_COMPACT);
    json_t *r = json_object_get(json_object_get(doc, "stats"), "decode_rows");
    cr_assert(json_is_integer(r), "stats.decode_rows");
    *rows = (double)json_integer_value(r);
    json_decref(doc);
    return s;
}

/* Speculative verification keeps the target distribution, so at temperature 0 the tokens are
 * those of plain decoding whatever drafts each step checks: varlen off, on with the table
 * measured at start-up, on with a table where drafts cost their rows (a line through the
 * origin: no draft pays for its row, none is checked) and on with a flat one (every draft is
 * free: all are checked, as with varlen off). The logprobs agree too: the same rows give the
 * same logits (batch invariance). */
Test(generate, greedy_tokens_are_the_same_with_varlen_on_and_off)
{
    const char *base = "--ids 3,17,42,99,100 --ids 5,6,7 --max-tokens 24 --temperature 0 "
                       "--nextn 5 --json";
    const char *modes[] = {"", "--varlen", "--varlen --step-ms 1:1,2:2,4:4,8:8,12:12",
                           "--varlen --step-ms 1:1,2:1,4:1,8:1,12:1 --sampler-ms 0.5"};
    char *want = NULL, args[1024], *out, *err;
    double rows[4];
    for (int m = 0; m < 4; m++) {
        snprintf(args, sizeof args, "--model %s %s %s", g_model, base, modes[m]);
        int rc = gen(args, &out, &err);
        cr_assert_eq(rc, 0, "%s: %s", modes[m], err);
        char *got = tokens_and_rows(out, &rows[m]);
        if (!want)
            want = got;
        else {
            cr_assert_str_eq(got, want, "%s", modes[m]);
            free(got);
        }
        free(out);
        free(err);
    }
    free(want);
    /* 2 requests, 23 decode steps of 1 + 5 rows, fewer near max_tokens */
    cr_assert_gt(rows[0], 2 * 23 * 5);
    cr_assert_lt(rows[1], rows[0] + 1, "measured table: never more rows than checking all");
    cr_assert_eq(rows[2], 2 * 23, "drafts that cost their rows are never checked");
    cr_assert_eq(rows[3], rows[0], "free drafts are all checked");
}

/* The table measured at start-up is printed (stderr), with what it means on the CPU. */
Test(generate, varlen_reports_its_measured_table)
{
    char cmd[4096];
    snprintf(cmd, sizeof cmd, "%s/tools/generate/di-generate --model %s --ids 3,4 --max-tokens 3 "
             "--varlen > %s/out 2> %s/err", build_root(), g_model, g_dir, g_dir);
    cr_assert_eq(system(cmd), 0);
    char path[300];
    snprintf(path, sizeof path, "%s/err", g_dir);
    FILE *f = fopen(path, "r");
    cr_assert(f);
    static char buf[1 << 14];
    size_t n = fread(buf, 1, sizeof buf - 1, f);
    buf[n] = 0;
    fclose(f);
    cr_assert(strstr(buf, "step ms by rows") && strstr(buf, " 1:") && strstr(buf, " 6:"), "%s",
              buf);
    cr_assert(strstr(buf, "say nothing about a GPU"), "%s", buf);
}

Test(generate, bad_varlen_options_fail_with_a_clear_error)
{
    refusal cases[] = {
        {"--varlen --nextn 0 --ids 3", "--varlen needs drafts"},
        {"--step-ms 1:2 --ids 3", "need --varlen"},
        {"--sampler-ms 1 --ids 3", "need --varlen"},
        {"--varlen --step-ms 1:x --ids 3", "'1:x' is not ROWS:MS"},
        {"--varlen --step-ms 0:1 --ids 3", "'0:1' is not ROWS:MS"},
        {"--varlen --step-ms 1:1,3:1 --ids 3 --ids 4", "3 rows is not a recorded graph size"},
        {"--varlen --step-ms 1:1 --ids 3 --ids 4", "cannot hold one row for each"},
        {"--varlen --sampler-ms nan --ids 3", "--sampler-ms"},
    };
    expect_refusals(cases, sizeof(cases) / sizeof(cases[0]));
}

/* ---- one step ahead (--ahead) ---- */

/* The JSON document of a run, its exit code checked. */
static json_t *gen_json(const char *args)
{
    char *out, *err;
    int rc = gen(args, &out, &err);
    cr_assert_eq(rc, 0, "%s: %s", args, err);
    json_error_t je;
    json_t *doc = json_loads(out, 0, &je);
    cr_assert(doc, "%s: %s", args, je.text);
    free(out);
    free(err);
    return doc;
}

static json_int_t ahead_entries(const json_t *doc)
{
    json_t *v = json_object_get(json_object_get(doc, "stats"), "ahead_entries");
    cr_assert(json_is_integer(v), "stats.ahead_entries");
    return json_integer_value(v);
}

/* With --ahead the engine plans step N+1 before it processes step N and the rows of the
 * continuing sequences are written by the backend's step_ahead op (checked against the
 * scheduler's fix-up inside the executor): the same tokens, logprobs and finish reasons as
 * the synchronous run, over greedy and seeded sampling, with drafts on and off, prompts that
 * join while others decode (--chunk 4 cuts them over several steps) and end at different
 * steps. Seeded sampling with drafts is compared up to the steps near max_tokens: there the
 * one-step-ahead scheduler budgets the rows of step N+1 as if step N accepted every draft,
 * so it may check fewer drafts than the synchronous one (a different, equally valid draw;
 * the executor test compares that case exactly, ahead on and off on one scheduler). */
Test(generate, ahead_gives_the_outputs_of_the_synchronous_run)
{
    const char *base = "--ids 3,17,42,99,100,7,8,9,10,11 --ids 5,6,7 --ids 9,8,7,6,5,4 "
                       "--max-tokens 14 --chunk 4 --logprobs 2 --json";
    const char *modes[] = {"--temperature 0 --nextn 0", "--temperature 0 --nextn 3",
                           "--temperature 0.9 --seed 11 --nextn 0",
                           "--temperature 0.9 --seed 11 --nextn 3"};
    const uint32_t tail[] = {0, 0, 0, 2 * (3 + 1)};
    char args[1024];
    for (int m = 0; m < 4; m++) {
        snprintf(args, sizeof args, "--model %s %s %s", g_model, base, modes[m]);
        json_t *sync = gen_json(args);
        strcat(args, " --ahead");
        json_t *ahead = gen_json(args);
        cr_assert_eq(ahead_entries(sync), 0, "%s", modes[m]);
        cr_assert_gt(ahead_entries(ahead), 3 * 6, "%s: rows written by the op", modes[m]);
        json_t *a = json_object_get(sync, "requests"), *b = json_object_get(ahead, "requests");
        cr_assert_eq(json_array_size(a), 3);
        cr_assert_eq(json_array_size(b), 3);
        for (size_t i = 0; i < 3; i++) {
            json_t *ra = json_array_get(a, i), *rb = json_array_get(b, i);
            cr_assert(json_equal(json_object_get(ra, "finish"), json_object_get(rb, "finish")));
            const char *keys[] = {"tokens", "logprobs"};
            for (int k = 0; k < 2; k++) {
                json_t *xa = json_object_get(ra, keys[k]), *xb = json_object_get(rb, keys[k]);
                cr_assert_eq(json_array_size(xa), 14, "%s: request %zu", modes[m], i + 1);
                cr_assert_eq(json_array_size(xb), 14, "%s: request %zu", modes[m], i + 1);
                for (size_t t = 0; t + tail[m] < 14; t++)
                    cr_assert(json_equal(json_array_get(xa, t), json_array_get(xb, t)),
                              "%s: request %zu %s[%zu]", modes[m], i + 1, keys[k], t);
            }
            if (!tail[m])
                cr_assert(json_equal(ra, rb), "%s: request %zu", modes[m], i + 1);
        }
        /* --overlap: step N+1 issued before step N is read (decode without drafts) */
        snprintf(args, sizeof args, "--model %s %s %s --overlap", g_model, base, modes[m]);
        json_t *ov = gen_json(args);
        json_t *n_ov = json_object_get(json_object_get(ov, "stats"), "overlap_steps");
        cr_assert(json_is_integer(n_ov), "stats.overlap_steps");
        if (strstr(modes[m], "--nextn 0"))
            cr_assert_gt(json_integer_value(n_ov), 5, "%s: steps overlapped", modes[m]);
        else
            cr_assert_eq(json_integer_value(n_ov), 0, "%s: drafts never overlap", modes[m]);
        cr_assert(json_equal(json_object_get(ov, "requests"), tail[m] ? b : a), "%s --overlap",
                  modes[m]);
        json_decref(ov);
        json_decref(sync);
        json_decref(ahead);
    }
    char *err;
    snprintf(args, sizeof args, "--model %s --ids 3,4 --ahead --kvstore 127.0.0.1:1", g_model);
    cr_assert_neq(gen(args, NULL, &err), 0);
    cr_assert(strstr(err, "--ahead runs without"), "%s", err);
    free(err);
}
