/* di-generate with a real di-kvstore on loopback (started and stopped here, data in a temp
 * directory): a prompt run again with the store populated gives the same logits and tokens bit
 * for bit while prefill computes only the uncached tail; so does a prompt sharing a prefix with
 * an earlier one, and a prompt continuing an earlier response. Missing window states, a store
 * that is down, frozen or killed mid-run, a corrupt or wrong object: the generation completes
 * with the same output and one warning line. The blocks written are found by di-kvctl inspect.
 *
 * The reference of every comparison is di-generate without a store and with the same YOCO
 * truncation (compact, every engine's default). */
#include <criterion/criterion.h>
#include <errno.h>
#include <fcntl.h>
#include <jansson.h>
#include <math.h>
#include <netinet/in.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include "common/model/config.h"
#include "common/util/clock.h"
#include "common/net/kv_client.h"
#include "common/model/shard_sums.h"
#include "kvstore/disk.h"
#include "tests/kvstore/harness.h"
#include "tests/kvstore/helpers.h"

static char g_dir[256];     /* this test's temporary directory */

static void setup(void)
{
    th_tmpdir(g_dir);
}

static void teardown(void)
{
    th_rmtree(g_dir);
}

/* Timeouts: the cases take 2 to 12 s each (two at a time; 41 s and 18 s of CPU for the binary)
 * on the 2-core machine at a load average of 13; 240 s (360 s for the demo model) leaves 20x.
 * What kept them long: every run built the tiny model's random weights again (now they load
 * the checkpoint the test made once) and a 5,000-token prompt (2,048 now). */
TestSuite(generate_kvstore, .init = setup, .fini = teardown, .timeout = 240);

/* ---- prompts ---- */

#define MAX_IDS 8192

typedef struct ids {
    int32_t v[MAX_IDS];
    uint32_t n;
} ids;

/* n ids from a simple generator (distinct streams for distinct `salt`), below `vocab`. */
static void ids_make(ids *p, uint32_t n, uint32_t salt, uint32_t vocab)
{
    p->n = 0;
    for (uint32_t i = 0; i < n; i++)
        p->v[p->n++] = 3 + (int32_t)((i * (37u + 2 * salt) + 11u * salt + 5u) % (vocab - 3));
}

static void ids_append(ids *p, const ids *q, uint32_t from, uint32_t n)
{
    for (uint32_t i = 0; i < n && p->n < MAX_IDS; i++)
        p->v[p->n++] = q->v[from + i];
}

/* "a,b,c" into a malloc'd string. */
static char *ids_str(const ids *p)
{
    char *s = malloc((size_t)p->n * 12 + 1), *w = s;
    for (uint32_t i = 0; i < p->n; i++)
        w += sprintf(w, i ? ",%d" : "%d", p->v[i]);
    *w = 0;
    return s;
}

/* ---- running di-generate ---- */

typedef struct gen_res {
    int rc;
    char *out;               /* stdout */
    char *err;               /* stderr */
    json_t *json;            /* stdout parsed (--json), or NULL */
} gen_res;

static const char *build_root(void)
{
    const char *b = getenv("DI_BUILD_ROOT");
    cr_assert(b, "DI_BUILD_ROOT is not set (run under meson test)");
    return b;
}

static char *slurp(const char *path)
{
    FILE *f = fopen(path, "r");
    cr_assert(f, "%s", path);
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *buf = malloc((size_t)n + 1);
    cr_assert_eq(fread(buf, 1, (size_t)n, f), (size_t)n);
    buf[n] = 0;
    fclose(f);
    return buf;
}

/* Writes the ids of prompt p to DIR/name and returns the path (static buffer per call site). */
static void write_ids(const char *name, const ids *const *prompts, int n, char *path)
{
    snprintf(path, 512, "%s/%s", g_dir, name);
    FILE *f = fopen(path, "w");
    cr_assert(f);
    for (int i = 0; i < n; i++) {
        char *s = ids_str(prompts[i]);
        fprintf(f, "%s\n", s);
        free(s);
    }
    cr_assert_eq(fclose(f), 0);
}

/* Runs di-generate --quiet --json on the prompts with extra args (printf format). */
static void gen(gen_res *r, const ids *const *prompts, int n, const char *fmt, ...)
{
    char args[2048], path[512], cmd[4096];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(args, sizeof args, fmt, ap);
    va_end(ap);
    write_ids("prompts.txt", prompts, n, path);
    snprintf(cmd, sizeof cmd, "%s/tools/generate/di-generate --quiet --json --ids-file %s %s "
             "> %s/out 2> %s/err", build_root(), path, args, g_dir, g_dir);
    int rc = system(cmd);
    r->rc = WIFEXITED(rc) ? WEXITSTATUS(rc) : -1;
    snprintf(path, sizeof path, "%s/out", g_dir);
    r->out = slurp(path);
    snprintf(path, sizeof path, "%s/err", g_dir);
    r->err = slurp(path);
    r->json = json_loads(r->out, 0, NULL);
}

static void gen_free(gen_res *r)
{
    free(r->out);
    free(r->err);
    json_decref(r->json);
    memset(r, 0, sizeof(*r));
}

static void gen_ok(const gen_res *r)
{
    cr_assert_eq(r->rc, 0, "di-generate exit %d: %s", r->rc, r->err);
    cr_assert(r->json, "no JSON on stdout: %s", r->out);
}

static long long stat_of(const gen_res *r, const char *key)
{
    json_t *s = json_object_get(r->json, "stats");
    return json_integer_value(json_object_get(s, key));
}

static long long kv_stat(const gen_res *r, const char *key)
{
    json_t *s = json_object_get(json_object_get(r->json, "stats"), "kvstore");
    cr_assert(s, "no kvstore stats: %s", r->out);
    json_t *v = json_object_get(s, key);
    return json_is_boolean(v) ? json_is_true(v) : json_integer_value(v);
}

/* The tokens of every request, as one JSON text. */
static char *tokens_of(const gen_res *r)
{
    json_t *all = json_array();
    json_t *reqs = json_object_get(r->json, "requests");
    for (size_t i = 0; i < json_array_size(reqs); i++)
        json_array_append(all, json_object_get(json_array_get(reqs, i), "tokens"));
    char *s = json_dumps(all, JSON_COMPACT);
    json_decref(all);
    return s;
}

/* How many leading output tokens of the first request the two runs share. */
static size_t same_tokens_prefix(const gen_res *a, const gen_res *b)
{
    json_t *ta = json_object_get(json_array_get(json_object_get(a->json, "requests"), 0), "tokens");
    json_t *tb = json_object_get(json_array_get(json_object_get(b->json, "requests"), 0), "tokens");
    size_t n = 0;
    while (n < json_array_size(ta) && n < json_array_size(tb) &&
           json_integer_value(json_array_get(ta, n)) == json_integer_value(json_array_get(tb, n)))
        n++;
    return n;
}

static void same_tokens(const gen_res *a, const gen_res *b, const char *what)
{
    char *x = tokens_of(a), *y = tokens_of(b);
    cr_assert_str_eq(x, y, "%s: tokens differ", what);
    free(x);
    free(y);
}

/* Both logits dumps exist and are equal byte for byte (%.9g prints every fp32 exactly). */
static void same_dump(const char *a, const char *b, const char *what)
{
    char pa[512], pb[512];
    snprintf(pa, sizeof pa, "%s/%s", g_dir, a);
    snprintf(pb, sizeof pb, "%s/%s", g_dir, b);
    char *x = slurp(pa), *y = slurp(pb);
    cr_assert(strlen(x) > 100, "%s: empty dump", what);
    cr_assert(strcmp(x, y) == 0, "%s: logits differ", what);
    free(x);
    free(y);
}

/* Lines of stderr (each "di-generate: warning: ..." under --quiet). */
static int count_lines(const char *s)
{
    int n = 0;
    for (; *s; s++)
        n += *s == '\n';
    return n;
}

/* ---- the store ---- */

/* The store for the engines' model: `--config NAME` in di-generate builds di-mkmodel's
 * checkpoint of NAME at seed 0, so the store is started with --model on that checkpoint (its
 * model id covers the weights; a config-only id would match no engine). */
static void store_start(th_store *s, const char *geometry, const char *const *extra)
{
    static char dir[300], ckpt[300];
    snprintf(dir, sizeof dir, "%s/kv", g_dir);
    snprintf(ckpt, sizeof ckpt, "%s/ckpt-%s", g_dir, geometry);
    char cmd[1024];
    snprintf(cmd, sizeof cmd, "test -d %s || %s/tools/mkmodel/di-mkmodel --quiet %s %s > /dev/null",
             ckpt, build_root(), geometry, ckpt);
    cr_assert_eq(system(cmd), 0, "%s", cmd);
    const char *args[24] = {"--model", ckpt, "--dram-bytes", "64MiB", "--disk-bytes",
                            "1GiB", "--log-level", "warn"};
    int n = 8;
    for (int i = 0; extra && extra[i] && n < 23; i++)
        args[n++] = extra[i];
    args[n] = NULL;
    th_store_start(s, dir, args);
}

/* The engines' KV geometry for the checkpoint store_start made: the model id from the config
 * and the manifest's weights fingerprint, the default YOCO mode. */
static kv_geometry geometry_of(const char *config)
{
    model_config c;
    di_error e;
    char ckpt[300];
    uint8_t weights[DI_SHA256_BYTES];
    snprintf(ckpt, sizeof ckpt, "%s/ckpt-%s", g_dir, config);
    cr_assert_eq(model_config_builtin(config, &c, &e), DI_OK, "%s", e.msg);
    cr_assert_eq(shard_sums_read_fingerprint(ckpt, weights, &e), DI_OK, "%s", e.msg);
    c.model_id = model_config_id_with_weights(&c, weights);
    kv_geometry g;
    model_config_kv_geometry(&c, 5, &g);
    return g;
}

static kvkey block_key_of(const kv_geometry *g, const ids *p, uint32_t j)
{
    kvkey keys[64];
    size_t n;
    di_error e;
    cr_assert_eq(kvkey_chain(g->model_id, 128, p->v, p->n, keys, 64, &n, &e), DI_OK, "%s", e.msg);
    cr_assert(j < n);
    return keys[j];
}

/* The tiny model as every run here loads it: di-mkmodel's checkpoint of tiny at seed 0 (the
 * weights --config tiny builds, and the checkpoint the store is started on), made once per
 * test, not built again by every run. */
static const char *tiny(void)
{
    static char args[400];
    char cmd[1024];
    snprintf(cmd, sizeof cmd, "test -d %s/ckpt-tiny || %s/tools/mkmodel/di-mkmodel --quiet tiny "
             "%s/ckpt-tiny > /dev/null", g_dir, build_root(), g_dir);
    cr_assert_eq(system(cmd), 0, "%s", cmd);
    snprintf(args, sizeof args, "--model %s/ckpt-tiny --max-tokens 8", g_dir);
    return args;
}

/* The reference: tiny at temperature 0 without a store, logits in base.jsonl. */
static void baseline(gen_res *r, const ids *p)
{
    const ids *pp[] = {p};
    gen(r, pp, 1, "%s --temperature 0 --yoco compact --dump-logits %s/base.jsonl", tiny(), g_dir);
    gen_ok(r);
}

/* ---- the central case ---- */

/* Cold (empty store) and warm runs of one prompt on a config's checkpoint (the one the store
 * was started on): logits and tokens bit-identical to a run without a store, at temperature 0
 * and (n_modes 2) sampled with a fixed seed; the warm prefill computes only the tail after the
 * cached blocks. */
static void cold_then_warm(const char *config, uint32_t vocab, uint32_t len, uint32_t hit,
                           int n_modes)
{
    th_store s;
    store_start(&s, config, NULL);
    ids p;
    ids_make(&p, len, 1, vocab);
    const ids *ps[] = {&p};
    static const char *modes[] = {"--temperature 0", "--temperature 0.9 --top-p 0.95 --seed 7"};
    for (int m = 0; m < n_modes; m++) {
        gen_res base, cold, warm;
        gen(&base, ps, 1, "--model %s/ckpt-%s --max-tokens 4 %s --yoco compact --dump-logits "
            "%s/base.jsonl", g_dir, config, modes[m], g_dir);
        gen_ok(&base);
        gen(&cold, ps, 1, "--model %s/ckpt-%s --max-tokens 4 %s --kvstore %s --dump-logits "
            "%s/cold.jsonl", g_dir, config, modes[m], s.target, g_dir);
        gen_ok(&cold);
        gen(&warm, ps, 1, "--model %s/ckpt-%s --max-tokens 4 %s --kvstore %s --dump-logits "
            "%s/warm.jsonl", g_dir, config, modes[m], s.target, g_dir);
        gen_ok(&warm);
        cr_assert_str_eq(cold.err, "", "no warning expected: %s", cold.err);
        cr_assert_str_eq(warm.err, "", "no warning expected: %s", warm.err);
        same_dump("base.jsonl", "cold.jsonl", "cold run");
        same_dump("base.jsonl", "warm.jsonl", "warm run");
        same_tokens(&base, &warm, "warm run");
        same_tokens(&base, &cold, "cold run");
        long long first = m == 0 ? len : len - hit; /* the sampled pass finds the store filled */
        cr_assert_eq(stat_of(&cold, "prefill_tokens"), first);
        cr_assert_eq(stat_of(&warm, "prefill_tokens"), len - hit);
        cr_assert_eq(kv_stat(&warm, "hit_tokens"), hit);
        cr_assert_eq(kv_stat(&warm, "blocks_loaded"), hit / 128);
        cr_assert_eq(kv_stat(&warm, "windows_loaded"), 1);
        if (m == 0) {
            cr_assert_eq(kv_stat(&cold, "blocks_stored"), len / 128);
            cr_assert_eq(kv_stat(&warm, "blocks_stored"), 0, "the blocks are already stored");
        }
        fprintf(stderr, "%s, %u-token prompt, %s: prefill tokens without the store %lld, cold "
                "%lld, warm %lld\n", config, len, modes[m], stat_of(&base, "prefill_tokens"),
                stat_of(&cold, "prefill_tokens"), stat_of(&warm, "prefill_tokens"));
        gen_free(&base);
        gen_free(&cold);
        gen_free(&warm);
    }
    th_store_stop(&s);
}

Test(generate_kvstore, a_cached_prompt_gives_the_same_logits_and_prefills_only_its_tail_tiny)
{
    cold_then_warm("tiny", 4096, 420, 256, 2);
}

/* The demo model (Engram, the real vocabulary) at temperature 0 only: the sampled pass adds
 * nothing model-specific to the tiny case above, and halves the heaviest test here. */
Test(generate_kvstore, a_cached_prompt_gives_the_same_logits_and_prefills_only_its_tail_demo,
     .timeout = 360)
{
    cold_then_warm("demo", 129280, 700, 512, 1);
}

/* A prompt sharing its first 300 tokens with an earlier, different prompt reuses the two whole
 * blocks inside the shared part (the window state at 256 was stored by the earlier prompt as
 * the point a rerun of it resumes from). */
Test(generate_kvstore, a_prompt_sharing_a_prefix_with_an_earlier_one_reuses_its_blocks)
{
    th_store s;
    store_start(&s, "tiny", NULL);
    ids a, b, tail;
    ids_make(&a, 420, 1, 4096);
    ids_make(&tail, 300, 2, 4096);
    b.n = 0;
    ids_append(&b, &a, 0, 300);
    ids_append(&b, &tail, 0, 300);
    const ids *pa[] = {&a}, *pb[] = {&b};
    gen_res first, base, warm;
    gen(&first, pa, 1, "%s --temperature 0 --kvstore %s", tiny(), s.target);
    gen_ok(&first);
    baseline(&base, &b);
    gen(&warm, pb, 1, "%s --temperature 0 --kvstore %s --dump-logits %s/warm.jsonl", tiny(),
        s.target, g_dir);
    gen_ok(&warm);
    same_dump("base.jsonl", "warm.jsonl", "shared prefix");
    same_tokens(&base, &warm, "shared prefix");
    cr_assert_eq(kv_stat(&warm, "hit_tokens"), 256);
    cr_assert_eq(stat_of(&warm, "prefill_tokens"), 600 - 256);
    gen_free(&first);
    gen_free(&base);
    gen_free(&warm);
    th_store_stop(&s);
}

/* The blocks a response fills and the window state at its last multiple of 128 are stored when
 * it ends: the next turn (prompt + response + new text) resumes after the response. */
Test(generate_kvstore, the_next_turn_resumes_after_the_stored_response)
{
    th_store s;
    store_start(&s, "tiny", NULL);
    ids p, q, more;
    ids_make(&p, 200, 3, 4096);
    ids_make(&more, 150, 4, 4096);
    const ids *pp[] = {&p};
    gen_res r1, base, warm;
    gen(&r1, pp, 1, "--model %s/ckpt-tiny --max-tokens 200 --ignore-eos --temperature 0 "
        "--kvstore %s", g_dir, s.target);
    gen_ok(&r1);
    json_t *toks = json_object_get(json_array_get(json_object_get(r1.json, "requests"), 0),
                                   "tokens");
    cr_assert_eq(json_array_size(toks), 200);
    q = p;
    for (size_t i = 0; i < 200; i++)
        q.v[q.n++] = (int32_t)json_integer_value(json_array_get(toks, i));
    ids_append(&q, &more, 0, 150);
    const ids *pq[] = {&q};
    baseline(&base, &q);
    gen(&warm, pq, 1, "%s --temperature 0 --kvstore %s --dump-logits %s/warm.jsonl", tiny(),
        s.target, g_dir);
    gen_ok(&warm);
    same_dump("base.jsonl", "warm.jsonl", "next turn");
    same_tokens(&base, &warm, "next turn");
    cr_assert_eq(kv_stat(&warm, "hit_tokens"), 384, "blocks 1-2 and the window at 384 came "
                 "from the response");
    cr_assert_eq(stat_of(&warm, "prefill_tokens"), 550 - 384);
    gen_free(&r1);
    gen_free(&base);
    gen_free(&warm);
    th_store_stop(&s);
}

/* ---- missing window states ---- */

/* The largest difference over the first `rows` rows of the two dumps. */
static double max_logit_diff_rows(const char *a, const char *b, int rows)
{
    char pa[512], pb[512];
    snprintf(pa, sizeof pa, "%s/%s", g_dir, a);
    snprintf(pb, sizeof pb, "%s/%s", g_dir, b);
    char *x = slurp(pa), *y = slurp(pb);
    double worst = 0;
    char *sx = NULL, *sy = NULL;
    int row = 0;
    for (char *lx = strtok_r(x, "\n", &sx), *ly = strtok_r(y, "\n", &sy); lx && ly && row < rows;
         lx = strtok_r(NULL, "\n", &sx), ly = strtok_r(NULL, "\n", &sy), row++) {
        json_t *jx = json_loads(lx, 0, NULL), *jy = json_loads(ly, 0, NULL);
        json_t *vx = json_object_get(jx, "logits"), *vy = json_object_get(jy, "logits");
        for (size_t i = 0; i < json_array_size(vx); i++) {
            double d = fabs(json_number_value(json_array_get(vx, i)) -
                            json_number_value(json_array_get(vy, i)));
            worst = d > worst ? d : worst;
        }
        json_decref(jx);
        json_decref(jy);
    }
    free(x);
    free(y);
    return worst;
}

static double max_abs_logit(const char *a)
{
    char pa[512];
    snprintf(pa, sizeof pa, "%s/%s", g_dir, a);
    char *x = slurp(pa);
    double worst = 0;
    char *sx = NULL;
    for (char *lx = strtok_r(x, "\n", &sx); lx; lx = strtok_r(NULL, "\n", &sx)) {
        json_t *jx = json_loads(lx, 0, NULL);
        json_t *vx = json_object_get(jx, "logits");
        for (size_t i = 0; i < json_array_size(vx); i++) {
            double d = fabs(json_number_value(json_array_get(vx, i)));
            worst = d > worst ? d : worst;
        }
        json_decref(jx);
    }
    free(x);
    return worst;
}

/* With window states at every boundary (--kvstore-window-every 1), losing the one at the hit
 * resumes exactly one block earlier: the tail + 128 tokens, same logits. With every window
 * state gone (di-kvctl evict --class window --all) the default is no hit and a full prefill;
 * --kvstore-replay replays 128 tokens instead (tail + 128), which is close but not exact, and
 * stores nothing it computed. */
Test(generate_kvstore, a_missing_window_state_costs_128_tokens_or_a_full_prefill)
{
    th_store s;
    store_start(&s, "tiny", NULL);
    kv_geometry g = geometry_of("tiny");
    ids p;
    ids_make(&p, 420, 5, 4096);
    const ids *pp[] = {&p};
    gen_res base, r1, r2, r3, r4;
    baseline(&base, &p);
    gen(&r1, pp, 1, "%s --temperature 0 --kvstore %s --kvstore-window-every 1", tiny(), s.target);
    gen_ok(&r1);
    cr_assert_eq(kv_stat(&r1, "windows_stored"), 3, "window states at 128, 256 and 384");
    /* the window state at 256 (keyed by block 1) is lost */
    kvc_client *c = th_client(&s, NULL);
    kvkey k1 = block_key_of(&g, &p, 1);
    di_error e;
    cr_assert_eq(kvc_delete1(c, KVKEY_WINDOW, &k1, &e), DI_OK, "%s", e.msg);
    kvc_close(c);
    gen(&r2, pp, 1, "%s --temperature 0 --kvstore %s --dump-logits %s/r2.jsonl", tiny(), s.target,
        g_dir);
    gen_ok(&r2);
    same_dump("base.jsonl", "r2.jsonl", "resume one block back");
    same_tokens(&base, &r2, "resume one block back");
    cr_assert_eq(stat_of(&r2, "prefill_tokens"), 420 - 256 + 128);
    cr_assert_eq(kv_stat(&r2, "hit_tokens"), 128);
    /* every window state is lost */
    char cmd[1024];
    snprintf(cmd, sizeof cmd, "%s/kvstore/di-kvctl --target %s evict --class window --all "
             "> %s/evict.out 2>&1", build_root(), s.target, g_dir);
    cr_assert_eq(system(cmd), 0, "%s", cmd);
    gen(&r3, pp, 1, "%s --temperature 0 --kvstore %s --kvstore-replay --dump-logits "
        "%s/r3.jsonl", tiny(), s.target, g_dir);
    gen_ok(&r3);
    cr_assert_eq(stat_of(&r3, "prefill_tokens"), 420 - 256 + 128, "a 128-token replay");
    cr_assert_eq(kv_stat(&r3, "replay_tokens"), 128);
    cr_assert_eq(kv_stat(&r3, "blocks_loaded"), 2);
    cr_assert_eq(kv_stat(&r3, "windows_loaded"), 0);
    cr_assert_eq(kv_stat(&r3, "blocks_stored") + kv_stat(&r3, "windows_stored"), 0,
                 "a replayed request stores nothing");
    /* Bounded: the rows whose inputs are the same (up to the first output token that differs)
     * stay within a fraction of the logits' own range. Measured (tiny, weights seed 0): 0.288
     * at the prompt's last position, 0.87 over the first 4 rows, logits up to 4.06 in size;
     * 5.4 over all rows, where the outputs have parted. */
    size_t same = same_tokens_prefix(&base, &r3);
    cr_assert_geq(same, 1, "the first token after a 128-token replay is the full prefill's");
    double d0 = max_logit_diff_rows("base.jsonl", "r3.jsonl", 1);
    double dc = max_logit_diff_rows("base.jsonl", "r3.jsonl", (int)same + 1);
    double scale = max_abs_logit("base.jsonl");
    fprintf(stderr, "bounded replay: largest logit difference to a full prefill %.3g at the last "
            "prompt position, %.3g over the %zu rows with the same inputs; largest logit %.3g\n",
            d0, dc, same + 1, scale);
    cr_assert(d0 > 0, "clipped windows change the logits (if this became exact, make the replay "
              "the default)");
    cr_assert(d0 < 0.15 * scale, "replay off by %.3g at the last prompt position (logits up to "
              "%.3g)", d0, scale);
    cr_assert(dc < 0.5 * scale, "replay off by %.3g over the rows with the same inputs (logits "
              "up to %.3g)", dc, scale);
    gen(&r4, pp, 1, "%s --temperature 0 --kvstore %s --dump-logits %s/r4.jsonl", tiny(), s.target,
        g_dir);
    gen_ok(&r4);
    same_dump("base.jsonl", "r4.jsonl", "no window state at all");
    cr_assert_eq(stat_of(&r4, "prefill_tokens"), 420);
    cr_assert_eq(kv_stat(&r4, "hit_tokens"), 0);
    cr_assert_eq(kv_stat(&r4, "windows_stored"), 2, "the resume points are stored again");
    gen_free(&base);
    gen_free(&r1);
    gen_free(&r2);
    gen_free(&r3);
    gen_free(&r4);
    th_store_stop(&s);
}

/* ---- a store that fails ---- */

static int free_port(void)
{
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    socklen_t len = sizeof a;
    cr_assert_eq(bind(fd, (struct sockaddr *)&a, sizeof a), 0);
    cr_assert_eq(getsockname(fd, (struct sockaddr *)&a, &len), 0);
    close(fd);
    return ntohs(a.sin_port);
}

/* One warning line (the rest of the failures within the rate limit are left out) that says
 * the run goes on without the store and tries it again, naming what failed. */
static void one_warning(const gen_res *r, const char *what)
{
    cr_assert_eq(count_lines(r->err), 1, "one line expected:\n%s", r->err);
    cr_assert(strstr(r->err, "di-generate: warning: KV store at "), "%s", r->err);
    cr_assert(strstr(r->err, "tried again after a back-off"), "%s", r->err);
    cr_assert(!strstr(r->err, "for the rest of this run"), "%s", r->err);
    cr_assert(strstr(r->err, what), "'%s' expected in: %s", what, r->err);
}

Test(generate_kvstore, a_store_that_is_down_or_frozen_costs_one_warning_and_nothing_else)
{
    ids p;
    ids_make(&p, 420, 6, 4096);
    const ids *pp[] = {&p};
    gen_res base, down, frozen;
    baseline(&base, &p);
    gen(&down, pp, 1, "%s --temperature 0 --kvstore 127.0.0.1:%d --kvstore-deadline 300ms "
        "--dump-logits %s/down.jsonl", tiny(), free_port(), g_dir);
    gen_ok(&down);
    one_warning(&down, "connecting failed");
    same_dump("base.jsonl", "down.jsonl", "store down");
    same_tokens(&base, &down, "store down");
    cr_assert_eq(kv_stat(&down, "load_failures"), 1, "the lookup failed: no hit");
    cr_assert_eq(kv_stat(&down, "store_failures"), 1, "the put failed after its attempts");
    cr_assert_eq(kv_stat(&down, "retries"), 2, "the put was tried again after back-offs");
    cr_assert_eq(kv_stat(&down, "refused"), 0);
    /* a store that accepts connections but never answers: the deadline */
    th_store s;
    store_start(&s, "tiny", NULL);
    cr_assert_eq(kill(s.pid, SIGSTOP), 0);
    gen(&frozen, pp, 1, "%s --temperature 0 --kvstore %s --kvstore-deadline 300ms "
        "--dump-logits %s/frozen.jsonl", tiny(), s.target, g_dir);
    cr_assert_eq(kill(s.pid, SIGCONT), 0);
    gen_ok(&frozen);
    one_warning(&frozen, "Deadline");
    same_dump("base.jsonl", "frozen.jsonl", "store frozen");
    gen_free(&base);
    gen_free(&down);
    gen_free(&frozen);
    th_store_stop(&s);
}

/* The store dies after the prompts were looked up and their cached prefixes read, before the
 * first put: the cached prompt still resumes from what it read, the put fails with one line,
 * and both outputs are those of a run without a store. The first prompt is long and uncached,
 * so its prefill (the time before the first put: seconds for 2,048 tokens) is long against the
 * reaction to the line that says the prompts were looked up (milliseconds). */
Test(generate_kvstore, a_store_killed_mid_run_costs_one_warning_and_nothing_else)
{
    th_store s;
    store_start(&s, "tiny", NULL);
    ids cached, longp;
    ids_make(&cached, 420, 7, 4096);
    ids_make(&longp, 2048, 8, 4096);
    const ids *pc[] = {&cached}, *both[] = {&longp, &cached};
    gen_res fill, base;
    gen(&fill, pc, 1, "%s --temperature 0 --kvstore %s", tiny(), s.target);
    gen_ok(&fill);
    gen(&base, both, 2, "%s --temperature 0 --yoco compact", tiny());
    gen_ok(&base);
    char path[512], cmd[4096];
    write_ids("both.txt", both, 2, path);
    snprintf(cmd, sizeof cmd, "exec %s/tools/generate/di-generate --json --ids-file %s %s "
             "--temperature 0 --kvstore %s > %s/out", build_root(), path, tiny(), s.target,
             g_dir);
    int pipefd[2];
    cr_assert_eq(pipe(pipefd), 0);
    pid_t pid = fork();
    cr_assert_geq(pid, 0);
    if (pid == 0) {
        dup2(pipefd[1], 2);
        close(pipefd[0]);
        close(pipefd[1]);
        execl("/bin/sh", "sh", "-c", cmd, (char *)NULL);
        _exit(127);
    }
    close(pipefd[1]);
    FILE *err = fdopen(pipefd[0], "r");
    char line[2048], all[16384] = "";
    bool killed = false;
    while (fgets(line, sizeof line, err)) {
        strncat(all, line, sizeof all - strlen(all) - 1);
        if (!killed && strstr(line, "prompt 2:")) {
            th_store_kill(&s);
            killed = true;
        }
    }
    fclose(err);
    int status;
    cr_assert_eq(waitpid(pid, &status, 0), pid);
    cr_assert(killed, "the lookup line never came:\n%s", all);
    cr_assert(WIFEXITED(status) && WEXITSTATUS(status) == 0, "exit 0x%x:\n%s", status, all);
    gen_res run = {.rc = 0};
    snprintf(path, sizeof path, "%s/out", g_dir);
    run.out = slurp(path);
    run.json = json_loads(run.out, 0, NULL);
    gen_ok(&run);
    same_tokens(&base, &run, "store killed mid-run");
    cr_assert(strstr(all, "prompt 2: 256 of 420 tokens from the KV store"), "%s", all);
    cr_assert_eq(stat_of(&run, "prefill_tokens"), 2048 + 420 - 256,
                 "the cached prompt resumed from what was read before the store died");
    const char *w = strstr(all, "warning:");
    cr_assert(w && !strstr(w + 1, "warning:"), "one warning expected:\n%s", all);
    cr_assert(strstr(w, "storing the KV of request 1"), "%s", all);
    cr_assert(strstr(w, "tried again after a back-off"), "%s", all);
    cr_assert_eq(kv_stat(&run, "store_failures"), 1, "the long prompt's put failed (the "
                 "cached one had nothing new to store)");
    gen_free(&fill);
    gen_free(&base);
    gen_free(&run);
}

/* Flips one payload byte of a stored object in the store's RocksDB directory (store stopped). */
static void corrupt_on_disk(th_store *s, const kv_geometry *g, int cls, const kvkey *key)
{
    kvdisk_config dc = {.dir = s->dir, .durability = KVDISK_WAL,
                        .stamp = {.model_id = g->model_id, .block_bytes = kv_block_bytes(g),
                                  .window_bytes = kv_window_state_bytes(g),
                                  .ring_positions = g->ring_positions}};
    kvdisk *d;
    di_error e;
    cr_assert_eq(kvdisk_open(&dc, &d, &e), DI_OK, "%s", e.msg);
    size_t cap = kv_window_state_bytes(g);
    uint8_t *obj = malloc(cap);
    uint64_t bytes;
    cr_assert_eq(kvdisk_get(d, cls, key, obj, cap, &bytes, &e), DI_OK, "%s", e.msg);
    obj[bytes - 3] ^= 0x40;
    kvdisk_item it = {.cls = cls, .key = *key, .data = obj, .bytes = bytes,
                      .last_access_ms = di_wall_ms()};
    cr_assert_eq(kvdisk_put(d, &it, 1, &e), DI_OK, "%s", e.msg);
    kvdisk_close(d);
    free(obj);
}

/* A corrupt disk copy is dropped by the store and reported as a miss; a sound object that names
 * another position is refused by di-generate and deleted. Either way one line, the prompt is
 * computed, the output is unchanged, and the correct object is stored again. */
Test(generate_kvstore, a_corrupt_or_wrong_object_is_computed_instead_and_replaced)
{
    th_store s;
    store_start(&s, "tiny", NULL);
    kv_geometry g = geometry_of("tiny");
    ids p;
    ids_make(&p, 420, 9, 4096);
    const ids *pp[] = {&p};
    gen_res base, r1, r2, r3, r4, r5;
    baseline(&base, &p);
    gen(&r1, pp, 1, "%s --temperature 0 --kvstore %s", tiny(), s.target);
    gen_ok(&r1);
    th_store_stop(&s);
    kvkey k0 = block_key_of(&g, &p, 0), k1 = block_key_of(&g, &p, 1);
    corrupt_on_disk(&s, &g, KVKEY_BLOCK, &k1);
    th_store_restart(&s);
    gen(&r2, pp, 1, "%s --temperature 0 --kvstore %s --dump-logits %s/r2.jsonl", tiny(), s.target,
        g_dir);
    gen_ok(&r2);
    cr_assert_eq(count_lines(r2.err), 1, "[%s] prefill %lld stored %lld", r2.err, stat_of(&r2, "prefill_tokens"), kv_stat(&r2, "blocks_stored"));
    cr_assert(strstr(r2.err, "prompt 1: 1 object from the KV store unusable (block 1: "), "%s",
              r2.err);
    cr_assert(strstr(r2.err, "corrupt") && strstr(r2.err, "ignoring it"), "%s", r2.err);
    same_dump("base.jsonl", "r2.jsonl", "corrupt block");
    cr_assert_eq(stat_of(&r2, "prefill_tokens"), 420, "no window state below block 1");
    cr_assert_eq(kv_stat(&r2, "blocks_stored"), 2, "blocks 1 and 2 stored again");
    gen(&r3, pp, 1, "%s --temperature 0 --kvstore %s", tiny(), s.target);
    gen_ok(&r3);
    cr_assert_eq(stat_of(&r3, "prefill_tokens"), 420 - 256, "the replaced block is used");
    /* a sound object under block 0's key that holds positions 128-255 */
    kvc_client *c = th_client(&s, NULL);
    di_error e;
    cr_assert_eq(kvc_delete1(c, KVKEY_BLOCK, &k0, &e), DI_OK, "%s", e.msg);
    size_t bb = kv_block_bytes(&g);
    uint8_t *forged = calloc(1, bb);
    kv_header h;
    kv_header_fill(&h, KV_BLOCK_MAGIC, &g, k0.b, 128, 128, forged + KV_HEADER_BYTES,
                   bb - KV_HEADER_BYTES);
    memcpy(forged, &h, sizeof h);
    cr_assert_eq(kvc_put1(c, KVKEY_BLOCK, &k0, forged, bb, &e), DI_OK, "%s", e.msg);
    free(forged);
    gen(&r4, pp, 1, "%s --temperature 0 --kvstore %s --dump-logits %s/r4.jsonl", tiny(), s.target,
        g_dir);
    gen_ok(&r4);
    cr_assert_eq(count_lines(r4.err), 1, "%s", r4.err);
    cr_assert(strstr(r4.err, "block 0: block starts at position 128, expected 0"), "%s", r4.err);
    same_dump("base.jsonl", "r4.jsonl", "wrong block");
    cr_assert_eq(stat_of(&r4, "prefill_tokens"), 420);
    gen(&r5, pp, 1, "%s --temperature 0 --kvstore %s --dump-logits %s/r5.jsonl", tiny(), s.target,
        g_dir);
    gen_ok(&r5);
    cr_assert_str_eq(r5.err, "");
    same_dump("base.jsonl", "r5.jsonl", "after the wrong block was replaced");
    cr_assert_eq(stat_of(&r5, "prefill_tokens"), 420 - 256);
    kvc_close(c);
    gen_free(&base);
    gen_free(&r1);
    gen_free(&r2);
    gen_free(&r3);
    gen_free(&r4);
    gen_free(&r5);
    th_store_stop(&s);
}

/* ---- keys, tokens, bad input ---- */

Test(generate_kvstore, the_blocks_written_are_found_by_kvctl_inspect_of_the_same_prompt)
{
    th_store s;
    store_start(&s, "tiny", NULL);
    ids p;
    ids_make(&p, 420, 10, 4096);
    const ids *pp[] = {&p};
    gen_res r;
    gen(&r, pp, 1, "%s --temperature 0 --kvstore %s", tiny(), s.target);
    gen_ok(&r);
    char *list = ids_str(&p), cmd[32768];
    snprintf(cmd, sizeof cmd, "%s/kvstore/di-kvctl --json --target %s inspect --ids %s > "
             "%s/inspect.json", build_root(), s.target, list, g_dir);
    free(list);
    cr_assert_eq(system(cmd), 0);
    char path[512];
    snprintf(path, sizeof path, "%s/inspect.json", g_dir);
    char *text = slurp(path);
    json_t *doc = json_loads(text, 0, NULL);
    cr_assert(doc, "%s", text);
    json_t *blocks = json_object_get(doc, "blocks");
    cr_assert_eq(json_array_size(blocks), 3);
    for (size_t j = 0; j < 3; j++) {
        json_t *b = json_array_get(blocks, j);
        cr_assert(json_is_object(json_object_get(b, "block_state")), "block %zu missing", j);
        bool window = json_is_object(json_object_get(b, "window_state"));
        cr_assert_eq(window, j >= 1, "window state at the end of block %zu: %d (stored at 256, "
                     "where a rerun resumes, and 384, the prompt's last multiple of 128)", j,
                     window);
    }
    json_decref(doc);
    free(text);
    gen_free(&r);
    th_store_stop(&s);
}

Test(generate_kvstore, the_engine_token_comes_from_its_file_or_the_environment)
{
    char tok[512];
    snprintf(tok, sizeof tok, "%s/engine.token", g_dir);
    FILE *f = fopen(tok, "w");
    fputs("engine-secret-1\n", f);
    fclose(f);
    const char *extra[] = {"--token-file", tok, NULL};
    th_store s;
    store_start(&s, "tiny", extra);
    ids p;
    ids_make(&p, 420, 11, 4096);
    const ids *pp[] = {&p};
    gen_res r1, r2, r3, bad;
    gen(&r1, pp, 1, "%s --temperature 0 --kvstore %s --kvstore-token-file %s", tiny(), s.target,
        tok);
    gen_ok(&r1);
    cr_assert_str_eq(r1.err, "");
    cr_assert_eq(kv_stat(&r1, "blocks_stored"), 3);
    setenv("DI_KVSTORE_TOKEN", "engine-secret-1", 1);
    gen(&r2, pp, 1, "%s --temperature 0 --kvstore %s", tiny(), s.target);
    unsetenv("DI_KVSTORE_TOKEN");
    gen_ok(&r2);
    cr_assert_eq(stat_of(&r2, "prefill_tokens"), 420 - 256);
    gen(&bad, pp, 1, "%s --temperature 0 --kvstore %s", tiny(), s.target);
    gen_ok(&bad);
    one_warning(&bad, "connecting failed");
    same_tokens(&r1, &bad, "without the token");
    gen(&r3, pp, 1, "%s --temperature 0 --kvstore %s --kvstore-token-file %s/none", tiny(),
        s.target, g_dir);
    cr_assert_eq(r3.rc, 2, "a missing token file is bad input");
    cr_assert(strstr(r3.err, "--kvstore-token-file"), "%s", r3.err);
    gen_free(&r1);
    gen_free(&r2);
    gen_free(&r3);
    gen_free(&bad);
    th_store_stop(&s);
}

Test(generate_kvstore, bad_store_options_are_refused_with_one_line)
{
    ids p;
    ids_make(&p, 20, 12, 4096);
    const ids *pp[] = {&p};
    static const struct {
        const char *args;
        const char *msg;
    } cases[] = {
        {"--kvstore localhost", "expected HOST:PORT"},
        {"--kvstore 127.0.0.1:99999", "port 99999 outside 1..65535"},
        {"--kvstore 127.0.0.1:0", "port 0 outside 1..65535"},
        {"--kvstore ::1:9470", "IPv6 goes in brackets"},
        {"--kvstore 127.0.0.1:1 --yoco off", "--kvstore needs --yoco compact or mask"},
        {"--kvstore 127.0.0.1:1 --kvstore-deadline 0", "--kvstore-deadline"},
        {"--kvstore 127.0.0.1:1 --kvstore-deadline 5x", "--kvstore-deadline"},
        {"--kvstore 127.0.0.1:1 --kvstore-window-every -1", "--kvstore-window-every"},
        {"--kvstore 127.0.0.1:1 --chunk 64", "--kvstore needs --chunk 128 or more"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        gen_res r;
        gen(&r, pp, 1, "%s %s", tiny(), cases[i].args);
        cr_assert_eq(r.rc, 2, "%s: exit %d", cases[i].args, r.rc);
        cr_assert_eq(count_lines(r.err), 1, "%s: %s", cases[i].args, r.err);
        cr_assert(strstr(r.err, cases[i].msg), "%s: %s", cases[i].args, r.err);
        gen_free(&r);
    }
}

/* The model in dir with `flags`, run with and without the store: the store refuses it (its KV
 * id is not the store's), so it gets no KV, warns once and computes the same logits. */
static void refused_by_the_store(const ids *const *pp, const char *dir, const char *flags,
                                 const char *target, const char *what)
{
    gen_res base, with;
    gen(&base, pp, 1, "--model %s %s --max-tokens 4 --temperature 0 --dump-logits %s/base.jsonl",
        dir, flags, g_dir);
    gen_ok(&base);
    gen(&with, pp, 1, "--model %s %s --max-tokens 4 --temperature 0 --kvstore %s --dump-logits "
        "%s/with.jsonl", dir, flags, target, g_dir);
    gen_ok(&with);
    cr_assert_eq(kv_stat(&with, "hit_tokens"), 0, "%s must not get the KV", what);
    cr_assert_eq(stat_of(&with, "prefill_tokens"), pp[0]->n, "%s", what);
    cr_assert_eq(count_lines(with.err), 1, "%s: one warning: %s", what, with.err);
    cr_assert(strstr(with.err, "holds KV of model"), "%s: %s", what, with.err);
    same_dump("base.jsonl", "with.jsonl", what);
    gen_free(&base);
    gen_free(&with);
}

/* The KV key covers the weights and the YOCO mode: after a model filled the store, a copy of
 * its checkpoint with one weight byte changed (a fine-tune, manifest rewritten) and the same
 * model under --yoco mask each get none of it (the store holds another model's KV: one warning,
 * everything computed, the same logits as without a store); the original still hits. A store
 * given a checkpoint without a checksum manifest refuses to start. */
Test(generate_kvstore, another_checkpoint_or_yoco_mode_never_gets_the_stored_kv)
{
    th_store s;
    store_start(&s, "tiny", NULL);
    char a[400], b[400], cmd[2048];
    snprintf(a, sizeof a, "%s/ckpt-tiny", g_dir);
    snprintf(b, sizeof b, "%s/ckpt-tuned", g_dir);
    /* one byte in the middle of the shard: tensor data (di-mkmodel writes no gaps) */
    snprintf(cmd, sizeof cmd, "cp -r %s %s && f=%s/model-00001-of-00001.safetensors && "
             "n=$(stat -c %%s $f) && printf '\\125' | dd of=$f bs=1 seek=$((n / 2)) conv=notrunc "
             "status=none && %s/tools/mkmodel/di-mkmodel --manifest %s > /dev/null", a, b, b,
             build_root(), b);
    cr_assert_eq(system(cmd), 0, "%s", cmd);
    ids p;
    ids_make(&p, 300, 11, 4096);
    const ids *pp[] = {&p};
    gen_res fill, hit;
    gen(&fill, pp, 1, "--model %s --max-tokens 4 --temperature 0 --kvstore %s", a, s.target);
    gen_ok(&fill);
    cr_assert_eq(kv_stat(&fill, "blocks_stored"), 2);
    gen(&hit, pp, 1, "--model %s --max-tokens 4 --temperature 0 --kvstore %s", a, s.target);
    gen_ok(&hit);
    cr_assert_gt(kv_stat(&hit, "hit_tokens"), 0, "the filling model hits: %s", hit.err);

    refused_by_the_store(pp, b, "", s.target, "a fine-tune");
    refused_by_the_store(pp, a, "--yoco mask", s.target, "another YOCO mode");
    th_store_stop(&s);

    gen_res off;
    gen(&off, pp, 1, "--model %s --yoco off --kvstore %s", a, s.target);
    cr_assert_eq(off.rc, 2, "--kvstore with --yoco off is refused before loading");
    cr_assert(strstr(off.err, "--kvstore needs --yoco compact or mask"), "%s", off.err);

    snprintf(cmd, sizeof cmd, "rm %s/model.safetensors.sha256.json && %s/kvstore/di-kvstore "
             "--model %s --dir %s/kv2 --listen 127.0.0.1:0 > %s/out 2>&1", b, build_root(), b,
             g_dir, g_dir);
    int rc = system(cmd);
    cr_assert(WIFEXITED(rc) && WEXITSTATUS(rc) != 0, "a store without a manifest must not start");
    snprintf(cmd, sizeof cmd, "%s/out", g_dir);
    char *out = slurp(cmd);
    cr_assert(strstr(out, "no checksum manifest") && strstr(out, "di-mkmodel --manifest"), "%s",
              out);
    free(out);
    gen_free(&fill);
    gen_free(&hit);
    gen_free(&off);
}
