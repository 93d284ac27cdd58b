/* di-kvctl against a real store: every subcommand, tables and --json, and its failures (bad
 * token, bad arguments, a capacity beyond the arena). */
#include <criterion/criterion.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>

#ifdef DI_KVCTL_TOKENIZER
#include "common/tokenizer/tokenizer.h"
#endif
#include "tests/kvstore/harness.h"
#include "tests/kvstore/helpers.h"

#define BLOCK 4224
#define WINDOW 8320

typedef struct fx {
    char dir[256];
    char tok[300];
    th_store s;
} fx;

/* Runs di-kvctl with the admin token and args; returns the exit status, output in out. */
static int kvctl(const fx *f, const char *token_file, const char *args, char *out, size_t cap)
{
    char cmd[8192];
    snprintf(cmd, sizeof(cmd), "%s/kvstore/di-kvctl --target %s %s%s %s 2>&1",
             getenv("DI_BUILD_ROOT"), f->s.target, token_file ? "--admin-token-file " : "",
             token_file ? token_file : "", args);
    FILE *p = popen(cmd, "r");
    cr_assert_not_null(p);
    size_t n = fread(out, 1, cap - 1, p);
    out[n] = '\0';
    int status = pclose(p);
    return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

static json_t *kvctl_json(const fx *f, const char *args)
{
    static char out[1 << 16];
    cr_assert_eq(kvctl(f, f->tok, args, out, sizeof(out)), 0, "di-kvctl %s: %s", args, out);
    json_error_t je;
    json_t *j = json_loads(out, 0, &je);
    cr_assert_not_null(j, "not JSON (%s): %s", je.text, out);
    return j;
}

/* A 300-token prompt: blocks 0 and 1 and the window state at 256 are stored. */
static void setup(fx *f, int32_t *tokens)
{
    th_tmpdir(f->dir);
    snprintf(f->tok, sizeof(f->tok), "%s.admin", f->dir);
    FILE *t = fopen(f->tok, "w");
    fputs("admin-secret\n", t);
    fclose(t);
    const char *args[] = {"--block-bytes", "4224", "--window-bytes", "8320",
                          "--handoff-max-bytes", "16512", "--dram-bytes", "8MiB",
                          "--admin-token-file", f->tok, NULL};
    th_store_start(&f->s, f->dir, args);
    kvc_client *c = th_client(&f->s, NULL);
    for (int i = 0; i < 300; i++)
        tokens[i] = 1000 + i;
    kv_geometry g;
    kv_geometry_v41_flash(5, &g);
    kvkey keys[2];
    size_t nk;
    cr_assert_eq(kvkey_chain(g.model_id, 128, tokens, 300, keys, 2, &nk, NULL), DI_OK);
    cr_assert_eq(nk, 2);
    uint8_t *obj = malloc(WINDOW);
    di_error e;
    for (int i = 0; i < 2; i++) {
        th_fill_object(obj, BLOCK, KV_BLOCK_MAGIC, &g, &keys[i], 0);
        cr_assert_eq(kvc_put1(c, KVKEY_BLOCK, &keys[i], obj, BLOCK, &e), DI_OK, "%s", e.msg);
    }
    th_fill_object(obj, WINDOW, KV_WINDOW_MAGIC, &g, &keys[1], 0);
    cr_assert_eq(kvc_put1(c, KVKEY_WINDOW, &keys[1], obj, WINDOW, &e), DI_OK, "%s", e.msg);
    free(obj);
    kvc_close(c);
}

static void teardown(fx *f)
{
    th_store_stop(&f->s);
    remove(f->tok);
    th_rmtree(f->dir);
}

static void ids_arg(const int32_t *tokens, int n, char *buf, size_t cap)
{
    size_t o = (size_t)snprintf(buf, cap, "--ids ");
    for (int i = 0; i < n; i++)
        o += (size_t)snprintf(buf + o, cap - o, "%s%d", i ? "," : "", tokens[i]);
}

Test(kvctl, stats_and_inspect, .timeout = 60)
{
    fx f;
    int32_t tokens[300];
    setup(&f, tokens);
    json_t *s = kvctl_json(&f, "--json stats");
    json_t *cls = json_object_get(s, "classes");
    cr_assert_eq(json_integer_value(json_object_get(json_object_get(cls, "block"), "objects")), 2);
    cr_assert_eq(json_integer_value(json_object_get(json_object_get(cls, "window"), "objects")), 1);
    cr_assert_eq(json_integer_value(json_object_get(s, "commits")), 3);
    cr_assert_str_eq(json_string_value(json_object_get(s, "durability")), "wal");
    json_decref(s);

    char args[4096], out[1 << 15];
    ids_arg(tokens, 300, args, sizeof(args));
    char jargs[4200];
    snprintf(jargs, sizeof(jargs), "--json inspect %s", args);
    json_t *in = kvctl_json(&f, jargs);
    cr_assert_eq(json_integer_value(json_object_get(in, "full_blocks")), 2);
    cr_assert_eq(json_integer_value(json_object_get(in, "cached_prefix_blocks")), 2);
    json_t *b1 = json_array_get(json_object_get(in, "blocks"), 1);
    cr_assert(json_is_object(json_object_get(b1, "window_state")), "window state at 256");
    cr_assert(json_is_null(json_object_get(json_array_get(json_object_get(in, "blocks"), 0),
                                           "window_state")));
    json_decref(in);

    /* The same prompt from a file, as a table. */
    char path[300];
    snprintf(path, sizeof(path), "%s.ids", f.dir);
    FILE *fp = fopen(path, "w");
    for (int i = 0; i < 300; i++)
        fprintf(fp, "%d%c", tokens[i], i % 20 == 19 ? '\n' : ' ');
    fclose(fp);
    char cmd[400];
    snprintf(cmd, sizeof(cmd), "inspect %s", path);
    cr_assert_eq(kvctl(&f, f.tok, cmd, out, sizeof(out)), 0, "%s", out);
    cr_assert(strstr(out, "300 tokens, 2 full blocks"), "%s", out);
    cr_assert(strstr(out, "cached prefix: 2 blocks (256 tokens); resumable with its window "
                          "state at token 256"),
              "%s", out);
    remove(path);
    cr_assert_eq(kvctl(&f, f.tok, "stats", out, sizeof(out)), 0, "%s", out);
    cr_assert(strstr(out, "block") && strstr(out, "hit rate") && strstr(out, "transfer"), "%s",
              out);
    teardown(&f);
}

Test(kvctl, ttl_capacity_evict_compact, .timeout = 60)
{
    fx f;
    int32_t tokens[300];
    setup(&f, tokens);
    json_t *t = kvctl_json(&f, "--json ttl set handoff 90s");
    cr_assert_eq(json_integer_value(json_object_get(t, "handoff")), 90000);
    cr_assert_eq(json_integer_value(json_object_get(t, "block")), 3 * 86400000);
    json_decref(t);
    json_t *c = kvctl_json(&f, "--json capacity set dram 4MiB");
    cr_assert_eq(json_integer_value(json_object_get(c, "dram_bytes")), 4 << 20);
    cr_assert_eq(json_integer_value(json_object_get(c, "dram_arena_bytes")), 8 << 20);
    json_decref(c);
    char out[4096];
    cr_assert_eq(kvctl(&f, f.tok, "capacity set dram 1TiB", out, sizeof(out)), 1);
    cr_assert(strstr(out, "exceeds the arena"), "%s", out);
    json_t *ev = kvctl_json(&f, "--json evict --class block --dram-only --all");
    cr_assert_eq(json_integer_value(json_object_get(ev, "evicted")), 2);
    json_decref(ev);
    ev = kvctl_json(&f, "--json evict --class block,window --all");
    cr_assert_eq(json_integer_value(json_object_get(ev, "evicted")), 3);
    json_decref(ev);
    json_t *s = kvctl_json(&f, "--json stats");
    cr_assert_eq(json_integer_value(json_object_get(
                     json_object_get(json_object_get(s, "classes"), "block"), "objects")),
                 0);
    json_decref(s);
    cr_assert_eq(kvctl(&f, f.tok, "compact", out, sizeof(out)), 0, "%s", out);
    cr_assert(strstr(out, "RocksDB files"), "%s", out);
    teardown(&f);
}

Test(kvctl, refusals_and_usage, .timeout = 60)
{
    fx f;
    int32_t tokens[300];
    setup(&f, tokens);
    char out[8192], bad[300];
    snprintf(bad, sizeof(bad), "%s.bad", f.dir);
    FILE *t = fopen(bad, "w");
    fputs("not-the-token\n", t);
    fclose(t);
    cr_assert_eq(kvctl(&f, bad, "stats", out, sizeof(out)), 1);
    cr_assert(strstr(out, "admin token"), "%s", out);
    cr_assert_eq(kvctl(&f, NULL, "stats", out, sizeof(out)), 1, "no token: %s", out);
    cr_assert_eq(kvctl(&f, f.tok, "", out, sizeof(out)), 2);
    cr_assert(strstr(out, "usage"), "%s", out);
    cr_assert_eq(kvctl(&f, f.tok, "frobnicate", out, sizeof(out)), 2);
    cr_assert(strstr(out, "unknown command"), "%s", out);
    cr_assert_eq(kvctl(&f, f.tok, "ttl set lemon 5s", out, sizeof(out)), 2);
    cr_assert(strstr(out, "unknown class"), "%s", out);
    cr_assert_eq(kvctl(&f, f.tok, "inspect --ids 1,x,3", out, sizeof(out)), 2);
    cr_assert(strstr(out, "not an id"), "%s", out);
    cr_assert_eq(kvctl(&f, f.tok, "evict", out, sizeof(out)), 2, "evict needs --all or keys");
    cr_assert_eq(kvctl(&f, f.tok, "--help", out, sizeof(out)), 0);
    cr_assert(strstr(out, "inspect") && strstr(out, "--json"), "%s", out);
    remove(bad);
    teardown(&f);
}

#ifdef DI_KVCTL_TOKENIZER
/* inspect --text tokenizes the prompt (here with a small byte-level tokenizer from the fuzz
 * corpus) and finds the blocks written for the same ids. */
Test(kvctl, inspect_a_text_prompt, .timeout = 60)
{
    fx f;
    int32_t unused[300];
    setup(&f, unused);
    char tokpath[512], textpath[300];
    snprintf(tokpath, sizeof(tokpath), "%s/tests/fuzz/tokenizer_corpus/tokenizer_deepseek_like.json",
             getenv("DI_SOURCE_ROOT"));
    tok_tokenizer *t;
    di_error e;
    cr_assert_eq(tok_load_file(tokpath, &t, &e), DI_OK, "%s", e.msg);
    char text[2048] = "";
    for (int i = 0; i < 40; i++)
        strcat(text, "the store keeps KV blocks for days. ");
    tok_ids ids = {0};
    cr_assert_eq(tok_encode(t, text, strlen(text), &ids, &e), DI_OK, "%s", e.msg);
    cr_assert_geq(ids.n, 256, "%zu tokens", ids.n);
    kv_geometry g;
    kv_geometry_v41_flash(5, &g);
    kvkey keys[2];
    size_t nk;
    cr_assert_eq(kvkey_chain(g.model_id, 128, ids.v, 256, keys, 2, &nk, NULL), DI_OK);
    kvc_client *c = th_client(&f.s, NULL);
    uint8_t obj[BLOCK];
    th_fill_object(obj, BLOCK, KV_BLOCK_MAGIC, &g, &keys[0], 0);
    cr_assert_eq(kvc_put1(c, KVKEY_BLOCK, &keys[0], obj, BLOCK, &e), DI_OK, "%s", e.msg);
    kvc_close(c);
    snprintf(textpath, sizeof(textpath), "%s.txt", f.dir);
    FILE *fp = fopen(textpath, "w");
    fputs(text, fp);
    fclose(fp);
    char args[1200];
    snprintf(args, sizeof(args), "--json inspect --text %s --tokenizer %s", textpath, tokpath);
    json_t *in = kvctl_json(&f, args);
    cr_assert_eq(json_integer_value(json_object_get(in, "tokens")), (json_int_t)ids.n);
    cr_assert_eq(json_integer_value(json_object_get(in, "cached_prefix_blocks")), 1);
    json_decref(in);
    remove(textpath);
    tok_ids_free(&ids);
    tok_free(t);
    teardown(&f);
}
#endif
