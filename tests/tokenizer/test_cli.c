/* di-tokenize run as a user would: stdin in, stdout and stderr out, exit codes. */
#include <criterion/criterion.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "tests/tokenizer/tok_test_util.h"

/* One run: exit code, stdout and stderr (malloc'd, NUL-terminated). */
typedef struct cli_run {
    int rc;    /* exit status */
    char *out; /* stdout */
    char *err; /* stderr */
} cli_run;

static char dir[64];

static void setup(void)
{
    strcpy(dir, "/tmp/di-tokenize-test-XXXXXX");
    cr_assert_not_null(mkdtemp(dir));
}

static void teardown(void)
{
    char cmd[128];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
    cr_assert_eq(system(cmd), 0);
}

static const char *bin(void)
{
    static char path[4096];
    const char *b = getenv("DI_BUILD_ROOT");
    snprintf(path, sizeof path, "%s/tools/tokenize/di-tokenize", b ? b : "build");
    return path;
}

/* Runs `env di-tokenize args` with `in` (len bytes) on stdin. */
static cli_run run(const char *env, const char *args, const char *in, size_t len)
{
    char pin[128], pout[128], perr[128], cmd[8192];
    snprintf(pin, sizeof pin, "%s/in", dir);
    snprintf(pout, sizeof pout, "%s/out", dir);
    snprintf(perr, sizeof perr, "%s/err", dir);
    FILE *f = fopen(pin, "wb");
    cr_assert_not_null(f);
    cr_assert_eq(fwrite(in, 1, len, f), len);
    fclose(f);
    snprintf(cmd, sizeof cmd, "env %s '%s' %s < '%s' > '%s' 2> '%s'", env ? env : "", bin(), args,
             pin, pout, perr);
    int st = system(cmd);
    cli_run r = {WIFEXITED(st) ? WEXITSTATUS(st) : -1, NULL, NULL};
    size_t n;
    r.out = tt_read_file(pout, &n);
    r.err = tt_read_file(perr, &n);
    cr_assert(r.out && r.err);
    return r;
}

static void done(cli_run *r)
{
    free(r->out);
    free(r->err);
}

/* stderr is exactly one line naming the program. */
static void one_line_error(const cli_run *r, const char *part)
{
    cr_assert_eq(strncmp(r->err, "di-tokenize: ", 13), 0, "stderr: %s", r->err);
    cr_assert(strchr(r->err, '\n') == r->err + strlen(r->err) - 1, "one line: %s", r->err);
    cr_assert(strstr(r->err, part) != NULL, "'%s' lacks '%s'", r->err, part);
}

TestSuite(cli, .init = setup, .fini = teardown);

Test(cli, encode_decode_and_bos)
{
    const char *text = "Hello, world! The quick brown fox jumps over the lazy dog 12345.";
    cli_run r = run(NULL, "", text, strlen(text));
    cr_assert_eq(r.rc, 0, "%s", r.err);
    cr_assert_str_eq(r.out, "[19923,14,2058,3,455,4787,13769,46012,54994,1060,270,41638,6397,"
                            "223,6895,1883,16]\n");
    done(&r);
    r = run(NULL, "--bos", "hi", 2);
    cr_assert_eq(r.rc, 0, "%s", r.err);
    cr_assert_str_eq(r.out, "[0,6366]\n");
    done(&r);
    const char *ids = "[0,19923,14,2058,1]";
    r = run(NULL, "--decode", ids, strlen(ids));
    cr_assert_eq(r.rc, 0, "%s", r.err);
    cr_assert_str_eq(r.out, "<｜begin▁of▁sentence｜>Hello, world<｜end▁of▁sentence｜>");
    done(&r);
    r = run(NULL, "--decode --skip-special", ids, strlen(ids));
    cr_assert_str_eq(r.out, "Hello, world");
    done(&r);
    r = run(NULL, "", "", 0);
    cr_assert_eq(r.rc, 0);
    cr_assert_str_eq(r.out, "[]\n");
    done(&r);
}

Test(cli, chat_prompt)
{
    const char *msgs = "[{\"role\": \"system\", \"content\": \"S\"}, {\"role\": \"user\", "
                       "\"content\": \"hi\"}, {\"role\": \"assistant\", \"content\": \"yo\"}, "
                       "{\"role\": \"user\", \"content\": \"q\"}]";
    cli_run r = run(NULL, "--chat", msgs, strlen(msgs));
    cr_assert_eq(r.rc, 0, "%s", r.err);
    /* the npm package's apply_chat_template(msgs, {tokenize: true, add_generation_prompt}) */
    cr_assert_str_eq(r.out, "[0,53,128803,6366,128804,14371,1,128803,83,128804]\n");
    done(&r);
    r = run(NULL, "--chat", "[{\"role\": \"robot\"}]", 19);
    cr_assert_eq(r.rc, 1);
    one_line_error(&r, "unknown role 'robot'");
    done(&r);
    r = run(NULL, "--chat", "[{", 2);
    cr_assert_eq(r.rc, 1);
    one_line_error(&r, "invalid JSON");
    done(&r);
}

Test(cli, bad_input_gets_one_line_and_nonzero_exit)
{
    cli_run r = run(NULL, "", "ok\xff\xfe", 4);
    cr_assert_eq(r.rc, 1);
    one_line_error(&r, "not valid UTF-8 at byte 2");
    cr_assert_str_eq(r.out, "");
    done(&r);
    r = run(NULL, "--decode", "[1, 2, 999999]", 14);
    cr_assert_eq(r.rc, 1);
    one_line_error(&r, "token id 999999 at position 2");
    done(&r);
    r = run(NULL, "--decode", "[1, \"x\"]", 8);
    cr_assert_eq(r.rc, 1);
    one_line_error(&r, "element 1 is not a 32-bit integer");
    done(&r);
    r = run(NULL, "--decode", "{}", 2);
    cr_assert_eq(r.rc, 1);
    one_line_error(&r, "expected a JSON array");
    done(&r);
    r = run(NULL, "--decode", "[1,", 3);
    cr_assert_eq(r.rc, 1);
    one_line_error(&r, "invalid JSON");
    done(&r);
}

Test(cli, usage_errors_and_help)
{
    cli_run r = run(NULL, "--frobnicate", "", 0);
    cr_assert_eq(r.rc, 2);
    one_line_error(&r, "unknown option '--frobnicate'");
    done(&r);
    r = run(NULL, "--chat --bos", "", 0);
    cr_assert_eq(r.rc, 2);
    one_line_error(&r, "--bos");
    done(&r);
    r = run(NULL, "--decode --chat", "", 0);
    cr_assert_eq(r.rc, 2);
    done(&r);
    r = run(NULL, "--vocab-size -3 --engram-map -", "", 0);
    cr_assert_eq(r.rc, 2);
    one_line_error(&r, "'-3' is not an integer");
    done(&r);
    r = run(NULL, "--tokenizer", "", 0);
    cr_assert_eq(r.rc, 2);
    one_line_error(&r, "needs an argument");
    done(&r);
    r = run(NULL, "--help", "", 0);
    cr_assert_eq(r.rc, 0);
    static const char *const OPTS[] = {"--tokenizer", "--decode", "--chat", "--bos",
                                       "--skip-special", "--engram-map", "--vocab-size",
                                       "--pad-id", "--help"};
    for (size_t i = 0; i < sizeof OPTS / sizeof OPTS[0]; i++)
        cr_assert(strstr(r.out, OPTS[i]) != NULL, "--help lacks %s", OPTS[i]);
    done(&r);
}

Test(cli, tokenizer_file_problems)
{
    cli_run r = run("DI_TOKENIZER=/nonexistent/tokenizer.json", "", "x", 1);
    cr_assert_eq(r.rc, 1);
    one_line_error(&r, "/nonexistent/tokenizer.json");
    done(&r);
    /* a truncated copy, alone in a folder (no tokenizer_config.json: --bos has no BOS) */
    size_t len = 0;
    char *text = tt_read_file(tt_source_path("data/tokenizer/deepseek-v3/tokenizer.json"), &len);
    cr_assert_not_null(text);
    char path[128], env[160], args[160];
    snprintf(path, sizeof path, "%s/cut.json", dir);
    FILE *f = fopen(path, "wb");
    fwrite(text, 1, len / 3, f);
    fclose(f);
    snprintf(args, sizeof args, "--tokenizer '%s'", path);
    r = run(NULL, args, "x", 1);
    cr_assert_eq(r.rc, 1);
    one_line_error(&r, "invalid JSON");
    done(&r);
    snprintf(path, sizeof path, "%s/whole.json", dir);
    f = fopen(path, "wb");
    fwrite(text, 1, len, f);
    fclose(f);
    free(text);
    snprintf(env, sizeof env, "DI_TOKENIZER='%s'", path);
    r = run(env, "--bos", "x", 1);
    cr_assert_eq(r.rc, 1);
    one_line_error(&r, "no BOS token known");
    done(&r);
    r = run(env, "", "x", 1);
    cr_assert_eq(r.rc, 0, "%s", r.err);
    cr_assert_str_eq(r.out, "[90]\n");
    done(&r);
}

Test(cli, engram_map_file)
{
    char args[256], path[128];
    snprintf(path, sizeof path, "%s/engram_token_map.json", dir);
    snprintf(args, sizeof args, "--engram-map '%s' --vocab-size 129280", path);
    cli_run r = run(NULL, args, "", 0);
    cr_assert_eq(r.rc, 0, "%s", r.err);
    done(&r);
    json_error_t je;
    json_t *j = json_load_file(path, 0, &je);
    cr_assert_not_null(j, "%s", je.text);
    cr_assert_eq(json_integer_value(json_object_get(j, "vocab_size")), 129280);
    cr_assert_eq(json_integer_value(json_object_get(j, "compressed_vocab_size")), 98627);
    cr_assert_eq(json_integer_value(json_object_get(j, "pad_token_id")), 2);
    json_t *map = json_object_get(j, "map");
    cr_assert_eq(json_array_size(map), 129280);
    cr_assert_eq(json_integer_value(json_array_get(map, 2)), 2);
    cr_assert_eq(json_integer_value(json_array_get(map, 129279)), 2);
    json_decref(j);
    r = run(NULL, "--engram-map - --pad-id 200000", "", 0);
    cr_assert_eq(r.rc, 1);
    one_line_error(&r, "pad_token_id 200000");
    done(&r);
    r = run(NULL, "--engram-map /nonexistent/dir/map.json", "", 0);
    cr_assert_eq(r.rc, 1);
    one_line_error(&r, "cannot write /nonexistent/dir/map.json");
    done(&r);
}
