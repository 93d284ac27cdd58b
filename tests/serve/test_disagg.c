/* Disaggregated serving on loopback: a real di-kvstore, one di-prefill and one di-decode
 * (tiny model, CPU backend), driven by di-generate --prefill/--decode. Tokens and logprobs
 * equal a local di-generate run's bit for bit (prompt lengths around multiples of 128 and over
 * one chunk; temperature 0 and 0.8 with several seeds; drafts on and off). After every test
 * both ranks' free blocks and slots are back at their starting values (GetLoad) and the store
 * holds no lease and no handoff (di-kvctl stats --json). Failures: a handoff that is not in
 * the store, a decode killed mid-stream, the store killed and brought back, cancels at random
 * moments, a drain with work in flight. */
#include <criterion/criterion.h>
#include <fcntl.h>
#include <jansson.h>
#include <poll.h>
#include <pthread.h>
#include <stdbool.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include "common/net/decode.pb-c.h"
#include "common/net/engine.pb-c.h"
#include "common/net/prefill.pb-c.h"
#include "common/net/rpc.h"
#include "common/util/clock.h"
#include "tests/kvstore/harness.h"
#include "tests/kvstore/helpers.h"

#define CHUNK "256"

/* Helpers the benchmark build (DI_DISAGG_BENCH) does not call. */
#define MAYBE_UNUSED __attribute__((unused))
#define SEED "0" /* di-mkmodel's seed: the store is started on that checkpoint */

static char g_dir[256];

static const char *build_root(void)
{
    const char *b = getenv("DI_BUILD_ROOT");
    cr_assert(b, "DI_BUILD_ROOT is not set (run under meson test)");
    return b;
}

/* ---- processes ---- */

typedef struct proc {
    pid_t pid;
    int port;
    char target[64];
    char log[300];
} proc;

/* In the child: stderr to the log, killed with the test process, then the program. */
static void child_exec(const char *exe, const char *const *argv, int logfd, int unused_fd,
                       pid_t parent)
{
    dup2(logfd, STDERR_FILENO);
    close(logfd);
    close(unused_fd);
    if (prctl(PR_SET_PDEATHSIG, SIGKILL) != 0 || getppid() != parent)
        _exit(127);
    execv(exe, (char *const *)argv);
    _exit(127);
}

/* Starts build/<rel> with args (NULL-terminated) plus --listen 127.0.0.1:0 --ready-fd. */
static void proc_start(proc *p, const char *rel, const char *name, const char *const *args)
{
    char exe[512], fd_arg[16];
    snprintf(exe, sizeof exe, "%s/%s", build_root(), rel);
    snprintf(p->log, sizeof p->log, "%s/%s.log", g_dir, name);
    int ready[2];
    cr_assert_eq(pipe(ready), 0);
    snprintf(fd_arg, sizeof fd_arg, "%d", ready[1]);
    const char *argv[64];
    int n = 0;
    argv[n++] = exe;
    argv[n++] = "--listen";
    argv[n++] = "127.0.0.1:0";
    argv[n++] = "--ready-fd";
    argv[n++] = fd_arg;
    for (int i = 0; args && args[i]; i++)
        argv[n++] = args[i];
    argv[n] = NULL;
    int logfd = open(p->log, O_WRONLY | O_CREAT | O_APPEND, 0644);
    cr_assert_geq(logfd, 0, "%s", p->log);
    pid_t parent = getpid(), pid = fork();
    cr_assert_geq(pid, 0);
    if (pid == 0)
        child_exec(exe, argv, logfd, ready[0], parent);
    close(logfd);
    close(ready[1]);
    p->pid = pid;
    char buf[32] = {0};
    size_t got = 0;
    struct pollfd pf = {.fd = ready[0], .events = POLLIN};
    while (got < sizeof buf - 1 && !memchr(buf, '\n', got) && poll(&pf, 1, 60000) > 0) {
        ssize_t k = read(ready[0], buf + got, sizeof buf - 1 - got);
        if (k <= 0)
            break;
        got += (size_t)k;
    }
    close(ready[0]);
    p->port = atoi(buf);
    cr_assert_gt(p->port, 0, "%s did not start (see %s)", name, p->log);
    snprintf(p->target, sizeof p->target, "127.0.0.1:%d", p->port);
}

/* SIGTERM (drain) and the exit status. */
static int proc_stop(proc *p)
{
    if (!p->pid)
        return 0;
    kill(p->pid, SIGTERM);
    int status = 0;
    waitpid(p->pid, &status, 0);
    p->pid = 0;
    return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

MAYBE_UNUSED static void proc_kill(proc *p)
{
    if (!p->pid)
        return;
    kill(p->pid, SIGKILL);
    waitpid(p->pid, NULL, 0);
    p->pid = 0;
}

/* ---- the deployment ---- */

typedef struct rig {
    th_store store;
    proc prefill, decode;
    const char *nextn;
    const char *drain;          /* --drain of both ranks; NULL: 20s */
    const char *blocks;         /* --blocks of both ranks; NULL: 256 */
    Di__Engine__Load load0[2];  /* GetLoad of prefill, decode at start */
} rig;

static const char *const k_store_args[] = {
    "--dram-bytes", "256MiB", "--dram-handoff-share", "0.2",
    "--handoff-max-bytes", "2MiB", "--durability", "none", NULL};

/* One unary call to p (no token); the reply bytes (free them), or NULL with *st set. */
static uint8_t *unary(const proc *p, const char *method, const void *req, size_t len,
                      size_t *rlen, di_status *st, di_error *err)
{
    rpc_client *c;
    rpc_client_config cfg = {.target = p->target};
    cr_assert_eq(rpc_client_open(&cfg, &c, err), DI_OK, "%s", err->msg);
    uint8_t *rep = NULL;
    *st = rpc_client_call(c, method, req, len, 5000, &rep, rlen, err);
    rpc_client_close(c);
    return *st == DI_OK ? rep : NULL;
}

static Di__Engine__Load get_load(const proc *p, const char *svc)
{
    char method[64];
    snprintf(method, sizeof method, "/di.%s/GetLoad", svc);
    size_t len = 0;
    di_status st;
    di_error err;
    uint8_t *rep = unary(p, method, NULL, 0, &len, &st, &err);
    cr_assert_eq(st, DI_OK, "%s", err.msg);
    Di__Engine__Load *l = di__engine__load__unpack(NULL, len, rep);
    cr_assert_not_null(l);
    Di__Engine__Load out = *l;
    di__engine__load__free_unpacked(l, NULL);
    free(rep);
    return out;
}

static void engine_start(proc *p, const char *exe, const char *name, const rig *r)
{
    const char *args[] = {"--config", "tiny", "--weights-seed", SEED, "--kvstore",
                          r->store.target, "--chunk", CHUNK, "--threads", "1", "--nextn",
                          r->nextn, "--blocks", r->blocks ? r->blocks : "256",
                          "--kvstore-deadline", "2s", "--drain",
                          r->drain ? r->drain : "20s", NULL};
    proc_start(p, exe, name, args);
}

static void rig_start(rig *r, const char *nextn)
{
    r->nextn = nextn;
    char dir[300];
    snprintf(dir, sizeof dir, "%s/store", g_dir);
    /* the store's model id covers the weights: it is started on the checkpoint of the
     * engines' random weights (config tiny, seed 0), manifest included */
    static char ckpt[300];
    char cmd[1024];
    snprintf(ckpt, sizeof ckpt, "%s/ckpt-tiny", g_dir);
    snprintf(cmd, sizeof cmd, "test -d %s || %s/tools/mkmodel/di-mkmodel --quiet tiny %s "
             "> /dev/null", ckpt, build_root(), ckpt);
    cr_assert_eq(system(cmd), 0, "%s", cmd);
    const char *args[20] = {"--model", ckpt};
    int n = 2;
    for (int i = 0; k_store_args[i]; i++)
        args[n++] = k_store_args[i];
    args[n++] = "--nextn"; /* the ring size of window states follows the drafts */
    args[n++] = nextn;
    args[n] = NULL;
    th_store_start(&r->store, dir, args);
    engine_start(&r->prefill, "prefill/di-prefill", "prefill", r);
    engine_start(&r->decode, "decode/di-decode", "decode", r);
    r->load0[0] = get_load(&r->prefill, "prefill.Prefill");
    r->load0[1] = get_load(&r->decode, "decode.Decode");
}

static json_t *kvctl_stats(const rig *r)
{
    char cmd[1024], path[300];
    snprintf(path, sizeof path, "%s/stats.json", g_dir);
    snprintf(cmd, sizeof cmd, "%s/kvstore/di-kvctl --target %s --json stats > %s",
             build_root(), r->store.target, path);
    cr_assert_eq(system(cmd), 0, "di-kvctl stats failed");
    json_t *j = json_load_file(path, 0, NULL);
    cr_assert_not_null(j);
    return j;
}

/* Nothing leaked: blocks and slots back on both ranks, no lease and no handoff in the store.
 * A rank may still be finishing a cancelled request: wait up to 10 s for it. */
MAYBE_UNUSED static void assert_clean(const rig *r)
{
    const proc *ps[2] = {&r->prefill, &r->decode};
    const char *svc[2] = {"prefill.Prefill", "decode.Decode"};
    for (int i = 0; i < 2; i++) {
        Di__Engine__Load l;
        uint64_t until = di_mono_ns() + 10000000000ull;
        do {
            l = get_load(ps[i], svc[i]);
            if (l.free_blocks == r->load0[i].free_blocks &&
                l.free_slots == r->load0[i].free_slots && !l.running && !l.waiting)
                break;
            usleep(50000);
        } while (di_mono_ns() < until);
        cr_assert_eq(l.free_blocks, r->load0[i].free_blocks, "%s: %u free blocks, %u at start",
                     svc[i], l.free_blocks, r->load0[i].free_blocks);
        cr_assert_eq(l.free_slots, r->load0[i].free_slots, "%s: %u free slots, %u at start",
                     svc[i], l.free_slots, r->load0[i].free_slots);
        cr_assert_eq(l.running + l.waiting, 0, "%s: requests left", svc[i]);
    }
    json_t *j = kvctl_stats(r);
    json_int_t leases = json_integer_value(json_object_get(j, "leases_active"));
    json_int_t handoffs = json_integer_value(
        json_object_get(json_object_get(json_object_get(j, "classes"), "handoff"), "objects"));
    json_decref(j);
    cr_assert_eq(leases, 0, "%lld leases left in the store", (long long)leases);
    cr_assert_eq(handoffs, 0, "%lld handoff objects left in the store", (long long)handoffs);
}

static void rig_stop(rig *r)
{
    cr_assert_eq(proc_stop(&r->prefill), 0, "di-prefill did not drain cleanly");
    cr_assert_eq(proc_stop(&r->decode), 0, "di-decode did not drain cleanly");
    th_store_stop(&r->store);
}

/* ---- prompts and di-generate ---- */

static const uint32_t k_lens[] = {1, 5, 127, 128, 129, 255, 256, 257, 300, 383, 384, 385, 600};
#define N_LENS (sizeof k_lens / sizeof k_lens[0])

static void write_prompts(const char *path, uint32_t salt)
{
    FILE *f = fopen(path, "w");
    cr_assert(f);
    for (uint32_t i = 0; i < N_LENS; i++) {
        for (uint32_t k = 0; k < k_lens[i]; k++)
            fprintf(f, k ? ",%u" : "%u", 2 + (k * 7919u + i * 104729u + salt * 31u) % 4000u);
        fputc('\n', f);
    }
    cr_assert_eq(fclose(f), 0);
}

typedef struct gen_res {
    int rc;
    json_t *json;
    char err[4096];
} gen_res;

static void gen(gen_res *g, const char *fmt, ...)
{
    char args[2048], cmd[4096], out[300], errp[300];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(args, sizeof args, fmt, ap);
    va_end(ap);
    snprintf(out, sizeof out, "%s/gen.out", g_dir);
    snprintf(errp, sizeof errp, "%s/gen.err", g_dir);
    snprintf(cmd, sizeof cmd, "%s/tools/generate/di-generate --quiet --json %s > %s 2> %s",
             build_root(), args, out, errp);
    int rc = system(cmd);
    g->rc = WIFEXITED(rc) ? WEXITSTATUS(rc) : -1;
    g->json = json_load_file(out, 0, NULL);
    g->err[0] = 0;
    FILE *f = fopen(errp, "r");
    if (f) {
        size_t n = fread(g->err, 1, sizeof g->err - 1, f);
        g->err[n] = 0;
        fclose(f);
    }
}

/* Tokens, logprobs and finish of every request equal (logprobs as printed: %.9g of a float is
 * exact). */
static void same_outputs(const gen_res *a, const gen_res *b, const char *what)
{
    json_t *ra = json_object_get(a->json, "requests"), *rb = json_object_get(b->json, "requests");
    cr_assert_eq(json_array_size(ra), json_array_size(rb), "%s: request counts", what);
    for (size_t i = 0; i < json_array_size(ra); i++) {
        json_t *x = json_array_get(ra, i), *y = json_array_get(rb, i);
        const char *keys[] = {"tokens", "logprobs", "finish"};
        for (int k = 0; k < 3; k++) {
            size_t fl = JSON_COMPACT | JSON_ENCODE_ANY | JSON_REAL_PRECISION(9);
            char *sx = json_dumps(json_object_get(x, keys[k]), fl);
            char *sy = json_dumps(json_object_get(y, keys[k]), fl);
            cr_assert_str_eq(sx, sy, "%s: request %zu (%u tokens): %s differ", what, i + 1,
                             k_lens[i], keys[k]);
            free(sx);
            free(sy);
        }
    }
}

MAYBE_UNUSED static void compare_runs(const rig *r, const char *sampling, uint32_t salt)
{
    char prompts[300], what[200];
    snprintf(prompts, sizeof prompts, "%s/prompts-%u.txt", g_dir, salt);
    write_prompts(prompts, salt);
    gen_res local, remote;
    gen(&local, "--config tiny --weights-seed " SEED " --chunk " CHUNK " --threads 1 --nextn %s "
        "--ids-file %s --max-tokens 10 --ignore-eos %s", r->nextn, prompts, sampling);
    cr_assert_eq(local.rc, 0, "local run: %s", local.err);
    gen(&remote, "--prefill %s --decode %s --ids-file %s --max-tokens 10 --ignore-eos %s",
        r->prefill.target, r->decode.target, prompts, sampling);
    cr_assert_eq(remote.rc, 0, "remote run: %s", remote.err);
    snprintf(what, sizeof what, "nextn %s, %s", r->nextn, sampling);
    same_outputs(&remote, &local, what);
    json_t *st = json_object_get(remote.json, "stats");
    cr_assert(json_real_value(json_object_get(st, "ttft_ms_mean")) > 0, "remote timings");
    cr_assert(json_real_value(json_object_get(st, "kv_pulled_bytes_mean")) > 0, "KV pulled");
    json_decref(local.json);
    json_decref(remote.json);
}

static void setup(void)
{
    th_tmpdir(g_dir);
}

static void teardown(void)
{
    th_rmtree(g_dir);
}

#ifndef DI_DISAGG_BENCH
TestSuite(disagg, .init = setup, .fini = teardown, .timeout = 600);

Test(disagg, drafts_on_equal_local_runs)
{
    rig r = {0};
    rig_start(&r, "5");
    compare_runs(&r, "--temperature 0 --seed 1", 1);
    assert_clean(&r);
    compare_runs(&r, "--temperature 0.8 --seed 7 --logprobs 3", 2);
    compare_runs(&r, "--temperature 0.8 --seed 12345", 3);
    assert_clean(&r);
    rig_stop(&r);
}

Test(disagg, drafts_off_equal_local_runs)
{
    rig r = {0};
    rig_start(&r, "0");
    compare_runs(&r, "--temperature 0 --seed 1", 4);
    compare_runs(&r, "--temperature 0.8 --seed 99", 5);
    assert_clean(&r);
    rig_stop(&r);
}

/* ---- direct calls ---- */

static rpc_client *client(const proc *p)
{
    rpc_client *c;
    di_error err;
    rpc_client_config cfg = {.target = p->target};
    cr_assert_eq(rpc_client_open(&cfg, &c, &err), DI_OK, "%s", err.msg);
    return c;
}

static void prompt_ids(uint32_t *ids, uint32_t n, uint32_t salt)
{
    for (uint32_t k = 0; k < n; k++)
        ids[k] = 2 + (k * 7919u + salt * 31u) % 4000u;
}

/* Default sampling (temperature 1), max_tokens, the end token off. */
static Di__Engine__SamplingParams no_eos(uint32_t max_tokens)
{
    Di__Engine__SamplingParams sp = DI__ENGINE__SAMPLING_PARAMS__INIT;
    sp.max_tokens = max_tokens;
    sp.eos_id = -1;
    sp.has_eos_id = 1;
    return sp;
}

/* Prefill of n ids; the reply (free it) or NULL with *st and err set. */
static Di__Prefill__PrefillReply *prefill(rpc_client *c, const char *rid, const uint32_t *ids,
                                          uint32_t n, uint32_t max_tokens, uint32_t timeout_ms,
                                          di_status *st, di_error *err)
{
    Di__Engine__SamplingParams sp = no_eos(max_tokens);
    Di__Prefill__PrefillRequest m = DI__PREFILL__PREFILL_REQUEST__INIT;
    m.request_id = (char *)rid;
    m.n_prompt = n;
    m.prompt = (uint32_t *)ids;
    m.sampling = &sp;
    uint8_t buf[65536], *rep = NULL;
    size_t len = di__prefill__prefill_request__pack(&m, buf), rlen = 0;
    *st = rpc_client_call(c, "/di.prefill.Prefill/Prefill", buf, len, timeout_ms, &rep, &rlen,
                          err);
    if (*st != DI_OK)
        return NULL;
    Di__Prefill__PrefillReply *r = di__prefill__prefill_reply__unpack(NULL, rlen, rep);
    free(rep);
    cr_assert_not_null(r);
    return r;
}

/* Opens the Decode stream of a prefill's reply. */
static rpc_stream *decode_open(rpc_client *c, const char *rid, const uint32_t *ids, uint32_t n,
                               const Di__Prefill__PrefillReply *pr, uint32_t max_tokens)
{
    Di__Engine__SamplingParams sp = no_eos(max_tokens);
    Di__Decode__DecodeRequest m = DI__DECODE__DECODE_REQUEST__INIT;
    m.request_id = (char *)rid;
    m.handoff = pr->handoff;
    m.n_prompt = n;
    m.prompt = (uint32_t *)ids;
    m.first = pr->first;
    m.sampling = &sp;
    uint8_t buf[65536];
    size_t len = di__decode__decode_request__pack(&m, buf);
    rpc_stream *s;
    di_error err;
    cr_assert_eq(rpc_stream_open(c, "/di.decode.Decode/Decode", buf, len, 60000, &s, &err),
                 DI_OK, "%s", err.msg);
    return s;
}

/* Reads up to max messages; returns how many, *st the final status when the stream ended
 * (*ended 1). */
static uint32_t stream_read(rpc_stream *s, uint32_t max, int *ended, di_status *st,
                            di_error *err)
{
    uint32_t got = 0;
    *ended = 0;
    *st = DI_OK;
    while (got < max) {
        uint8_t *msg = NULL;
        size_t len = 0;
        int done = 0;
        *st = rpc_stream_read(s, &msg, &len, &done, err);
        free(msg);
        if (done || *st != DI_OK) {
            *ended = 1;
            break;
        }
        got++;
    }
    return got;
}

static uint64_t model_id_of(const proc *p)
{
    size_t len = 0;
    di_status st;
    di_error err;
    uint8_t *rep = unary(p, "/di.decode.Decode/Health", NULL, 0, &len, &st, &err);
    cr_assert_eq(st, DI_OK, "%s", err.msg);
    Di__Engine__HealthReply *h = di__engine__health_reply__unpack(NULL, len, rep);
    free(rep);
    cr_assert(h && h->serving && h->model_id && !strcmp(h->backend, "cpu"));
    uint64_t id = h->model_id;
    di__engine__health_reply__free_unpacked(h, NULL);
    return id;
}

/* A bad request gets one clear line; a handoff that is not in the store is ENOENT. */
Test(disagg, bad_requests_and_a_missing_handoff_are_refused_clearly)
{
    rig r = {0};
    rig_start(&r, "5");
    rpc_client *pc = client(&r.prefill), *dc = client(&r.decode);
    uint32_t ids[8] = {5, 6, 7, 4095, 4096};
    di_status st;
    di_error err;
    cr_assert_null(prefill(pc, "bad-1", ids, 5, 4, 10000, &st, &err));
    cr_assert_eq(st, DI_EINVAL);
    cr_assert(strstr(err.msg, "prompt[4]: 4096 is outside the vocabulary"), "%s", err.msg);
    cr_assert_null(prefill(pc, "bad id", ids, 3, 4, 10000, &st, &err));
    cr_assert(st == DI_EINVAL && strstr(err.msg, "request_id"), "%s", err.msg);
    cr_assert_null(prefill(pc, "bad-2", ids, 3, 0x7fffffff, 10000, &st, &err));
    cr_assert(st == DI_EINVAL && strstr(err.msg, "max_tokens"), "%s", err.msg);
    /* a manifest naming a handoff the store does not hold */
    Di__Engine__Token first = DI__ENGINE__TOKEN__INIT;
    first.id = 9;
    uint8_t key[32] = {1, 2, 3};
    Di__Prefill__HandoffManifest man = DI__PREFILL__HANDOFF_MANIFEST__INIT;
    man.model_id = model_id_of(&r.decode);
    man.handoff_key = (ProtobufCBinaryData){32, key};
    man.handoff_bytes = 1 << 20;
    Di__Prefill__PrefillReply fake = DI__PREFILL__PREFILL_REPLY__INIT;
    fake.first = &first;
    fake.handoff = &man;
    int ended;
    rpc_stream *s = decode_open(dc, "nohandoff", ids, 3, &fake, 8);
    cr_assert_eq(stream_read(s, 100, &ended, &st, &err), 0);
    cr_assert(ended && st == DI_ENOENT && strstr(err.msg, "not in the store"), "%s: %s",
              di_status_name(st), err.msg);
    rpc_stream_close(s);
    man.model_id ^= 1; /* another model's handoff */
    s = decode_open(dc, "othermodel", ids, 3, &fake, 8);
    stream_read(s, 100, &ended, &st, &err);
    cr_assert(st == DI_EINVAL && strstr(err.msg, "model_id"), "%s", err.msg);
    rpc_stream_close(s);
    /* a real handoff decoded for another prompt is refused, and then nobody takes it */
    Di__Prefill__PrefillReply *pr = prefill(pc, "real-1", ids, 3, 8, 30000, &st, &err);
    cr_assert_not_null(pr, "%s", err.msg);
    ids[0] = 6;
    s = decode_open(dc, "real-1", ids, 3, pr, 8);
    stream_read(s, 100, &ended, &st, &err);
    cr_assert(st == DI_EINVAL && strstr(err.msg, "not this request's"), "%s", err.msg);
    rpc_stream_close(s);
    ids[0] = 5;
    s = decode_open(dc, "real-1", ids, 3, pr, 8);
    cr_assert_eq(stream_read(s, 100, &ended, &st, &err), 7, "%s", err.msg);
    cr_assert(ended && st == DI_OK, "%s", err.msg);
    rpc_stream_close(s);
    di__prefill__prefill_reply__free_unpacked(pr, NULL);
    rpc_client_close(pc);
    rpc_client_close(dc);
    assert_clean(&r);
    rig_stop(&r);
}

/* A request prefilled and decoding: `reads` tokens already read from its stream. */
typedef struct flight {
    rpc_client *pc, *dc;
    uint32_t ids[300];
    Di__Prefill__PrefillReply *pr;
    rpc_stream *s;
} flight;

static void flight_start(flight *f, rig *r, const char *rid, uint32_t n, uint32_t max_tokens,
                         uint32_t reads)
{
    f->pc = client(&r->prefill);
    f->dc = client(&r->decode);
    prompt_ids(f->ids, n, n);
    di_status st;
    di_error err;
    int ended;
    f->pr = prefill(f->pc, rid, f->ids, n, max_tokens, 30000, &st, &err);
    cr_assert_not_null(f->pr, "%s", err.msg);
    f->s = decode_open(f->dc, rid, f->ids, n, f->pr, max_tokens);
    cr_assert_eq(stream_read(f->s, reads, &ended, &st, &err), reads, "%s", err.msg);
}

/* Reads the rest of the stream; its final status. */
static di_status flight_end(flight *f, di_error *err)
{
    int ended;
    di_status st;
    stream_read(f->s, 100000, &ended, &st, err);
    cr_assert(ended);
    rpc_stream_close(f->s);
    di__prefill__prefill_reply__free_unpacked(f->pr, NULL);
    rpc_client_close(f->pc);
    rpc_client_close(f->dc);
    return st;
}

/* Decode killed mid-stream: the caller's stream ends with an error; prefill and the store
 * keep nothing. */
Test(disagg, decode_killed_mid_stream_ends_the_callers_stream)
{
    rig r = {0};
    rig_start(&r, "5");
    flight f;
    flight_start(&f, &r, "killed-1", 300, 3000, 5);
    proc_kill(&r.decode);
    di_error err;
    di_status st = flight_end(&f, &err);
    cr_assert_neq(st, DI_OK, "the stream must end with an error");
    engine_start(&r.decode, "decode/di-decode", "decode2", &r);
    assert_clean(&r);
    rig_stop(&r);
}

/* The store killed: the request fails with one clear line and leaks nothing on the ranks;
 * once the store is back the next request is served and equals the local run. */
Test(disagg, store_killed_then_back)
{
    rig r = {0};
    rig_start(&r, "5");
    th_store_kill(&r.store);
    gen_res g;
    gen(&g, "--prefill %s --decode %s --ids 5,6,7 --max-tokens 4", r.prefill.target,
        r.decode.target);
    cr_assert_neq(g.rc, 0);
    cr_assert(strstr(g.err, "handoff to the store"), "%s", g.err);
    json_decref(g.json);
    Di__Engine__Load l = get_load(&r.prefill, "prefill.Prefill");
    cr_assert_eq(l.free_blocks, r.load0[0].free_blocks);
    cr_assert_eq(l.free_slots, r.load0[0].free_slots);
    th_store_restart(&r.store);
    compare_runs(&r, "--temperature 0.8 --seed 3", 10);
    assert_clean(&r);
    rig_stop(&r);
}

/* Aborts at random moments (queued, between chunks, handing off, loading, decoding) and
 * streams cancelled mid-way leak nothing. DI_DISAGG_CANCELS sets how many (default 200). */
typedef struct aborter {
    const proc *p;
    const char *method;
    char rid[32];
    uint32_t delay_us;
} aborter;

static void *abort_later(void *arg)
{
    aborter *a = arg;
    usleep(a->delay_us);
    Di__Engine__AbortRequest m = DI__ENGINE__ABORT_REQUEST__INIT;
    m.request_id = a->rid;
    uint8_t buf[256];
    size_t rlen;
    di_status st;
    di_error err;
    free(unary(a->p, a->method, buf, di__engine__abort_request__pack(&m, buf), &rlen, &st,
               &err));
    return NULL;
}

Test(disagg, random_cancels_leak_nothing)
{
    rig r = {0};
    rig_start(&r, "5");
    const char *env = getenv("DI_DISAGG_CANCELS");
    uint32_t n = env ? (uint32_t)atoi(env) : 200;
    rpc_client *pc = client(&r.prefill), *dc = client(&r.decode);
    uint32_t ids[700], seed = 12345, served = 0, aborted = 0;
    for (uint32_t i = 0; i < n; i++) {
        seed = seed * 1103515245u + 12345u;
        uint32_t len = 1 + (seed >> 8) % 600, max_tokens = 2 + (seed >> 4) % 40;
        prompt_ids(ids, len, i);
        char rid[32];
        snprintf(rid, sizeof rid, "c-%u", i);
        aborter ab = {.p = &r.prefill, .method = "/di.prefill.Prefill/Abort",
                      .delay_us = (seed >> 12) % 40000};
        snprintf(ab.rid, sizeof ab.rid, "%s", rid);
        pthread_t t;
        bool abort_prefill = i % 2 == 0;
        if (abort_prefill)
            pthread_create(&t, NULL, abort_later, &ab);
        di_status st;
        di_error err;
        Di__Prefill__PrefillReply *pr = prefill(pc, rid, ids, len, max_tokens, 30000, &st,
                                                &err);
        if (abort_prefill)
            pthread_join(t, NULL);
        if (!pr) {
            cr_assert_eq(st, DI_ECANCELED, "prefill %u: %s", i, err.msg);
            aborted++;
            continue;
        }
        rpc_stream *s = decode_open(dc, rid, ids, len, pr, max_tokens);
        int ended;
        uint32_t want = (seed >> 16) % 8;
        ab = (aborter){.p = &r.decode, .method = "/di.decode.Decode/Abort",
                       .delay_us = (seed >> 3) % 20000};
        snprintf(ab.rid, sizeof ab.rid, "%s", rid);
        if (i % 3 == 0) { /* an Abort at a random moment, maybe while loading */
            pthread_create(&t, NULL, abort_later, &ab);
            stream_read(s, 100000, &ended, &st, &err);
            pthread_join(t, NULL);
        } else { /* the client goes away after a few tokens */
            stream_read(s, want + 1, &ended, &st, &err);
            if (!ended)
                rpc_stream_cancel(s);
        }
        cr_assert(st == DI_OK || st == DI_ECANCELED, "decode %u: %s: %s", i,
                  di_status_name(st), err.msg);
        served += st == DI_OK && ended;
        rpc_stream_close(s);
        di__prefill__prefill_reply__free_unpacked(pr, NULL);
    }
    rpc_client_close(pc);
    rpc_client_close(dc);
    cr_log_info("%u requests: %u aborted in prefill, %u decoded to the end", n, aborted, served);
    assert_clean(&r);
    rig_stop(&r);
}

/* Reads a Decode stream to its end: the finish of its last message, the tokens it carried. */
static Di__Engine__Finish stream_finish(rpc_stream *s, uint32_t *tokens, di_status *st)
{
    Di__Engine__Finish f = DI__ENGINE__FINISH__FINISH_NONE;
    *tokens = 0;
    for (;;) {
        uint8_t *msg = NULL;
        size_t len = 0;
        int done = 0;
        di_error err;
        *st = rpc_stream_read(s, &msg, &len, &done, &err);
        if (done || *st != DI_OK) {
            free(msg);
            return f;
        }
        Di__Decode__DecodeToken *t = di__decode__decode_token__unpack(NULL, len, msg);
        free(msg);
        cr_assert_not_null(t);
        *tokens += t->token != NULL;
        f = t->finish;
        di__decode__decode_token__free_unpacked(t, NULL);
    }
}

/* A decode rank out of KV blocks stops a request (preemption mode STOP): its stream's last
 * message says FINISH_PREEMPTED; the other request runs to its length; nothing leaks. */
Test(disagg, preemption_in_decode_ends_the_victim_with_preempted)
{
    rig r = {.blocks = "16"}; /* 15 usable blocks: 1,920 positions */
    rig_start(&r, "5");
    flight a, b;
    flight_start(&a, &r, "big-a", 300, 1500, 1);
    flight_start(&b, &r, "big-b", 299, 1500, 1);
    uint32_t na, nb;
    di_status sa, sb;
    Di__Engine__Finish fa = stream_finish(a.s, &na, &sa), fb = stream_finish(b.s, &nb, &sb);
    cr_assert(sa == DI_OK && sb == DI_OK, "%s %s", di_status_name(sa), di_status_name(sb));
    bool a_pre = fa == DI__ENGINE__FINISH__FINISH_PREEMPTED;
    bool b_pre = fb == DI__ENGINE__FINISH__FINISH_PREEMPTED;
    cr_assert(a_pre != b_pre, "exactly one victim (finishes %d and %d)", fa, fb);
    cr_assert_eq(a_pre ? fb : fa, DI__ENGINE__FINISH__FINISH_LENGTH);
    cr_assert_lt(a_pre ? na : nb, 1499, "the victim stopped early");
    di_error err;
    flight_end(&a, &err);
    flight_end(&b, &err);
    assert_clean(&r);
    rig_stop(&r);
}

/* SIGTERM with a stream in flight and a short --drain: the stream ends with UNAVAILABLE, the
 * rank exits 0, and nothing is left in the store. */
Test(disagg, drain_fails_what_it_cannot_finish_and_exits_0)
{
    rig r = {.drain = "300ms"};
    rig_start(&r, "5");
    flight f;
    flight_start(&f, &r, "drain-1", 40, 4000, 3);
    cr_assert_eq(proc_stop(&r.decode), 0, "di-decode drains and exits 0");
    di_error err;
    di_status st = flight_end(&f, &err);
    cr_assert_eq(st, DI_EUNAVAIL, "%s: %s", di_status_name(st), err.msg);
    engine_start(&r.decode, "decode/di-decode", "decode2", &r);
    assert_clean(&r);
    rig_stop(&r);
}
/* ---- prefix hits: what the store gives prefill, what decode leaves for the next turn ---- */

/* One prompt of n ids in a file of its own, for di-generate --ids-file. */
static void ids_file(char *path, size_t cap, const char *name, const uint32_t *ids, uint32_t n)
{
    snprintf(path, cap, "%s/%s.txt", g_dir, name);
    FILE *f = fopen(path, "w");
    cr_assert(f);
    for (uint32_t k = 0; k < n; k++)
        fprintf(f, k ? ",%u" : "%u", ids[k]);
    fputc('\n', f);
    cr_assert_eq(fclose(f), 0);
}

/* The prompt through both services (remote) or a local run, temperature 0, end token off. */
static void run_one(gen_res *g, const rig *r, bool remote, const uint32_t *ids, uint32_t n,
                    uint32_t max_tokens, const char *name)
{
    char path[300];
    ids_file(path, sizeof path, name, ids, n);
    if (remote)
        gen(g, "--prefill %s --decode %s --ids-file %s --max-tokens %u --ignore-eos "
            "--temperature 0", r->prefill.target, r->decode.target, path, max_tokens);
    else
        gen(g, "--config tiny --weights-seed " SEED " --chunk " CHUNK " --threads 1 --nextn %s "
            "--ids-file %s --max-tokens %u --ignore-eos --temperature 0", r->nextn, path,
            max_tokens);
    cr_assert_eq(g->rc, 0, "%s run of %s: %s", remote ? "remote" : "local", name, g->err);
}

static json_int_t req_int(const gen_res *g, const char *key)
{
    json_t *q = json_array_get(json_object_get(g->json, "requests"), 0);
    return json_integer_value(json_object_get(q, key));
}

static json_int_t store_stat(const rig *r, const char *cls, const char *key)
{
    json_t *j = kvctl_stats(r);
    json_t *v = cls ? json_object_get(json_object_get(json_object_get(j, "classes"), cls), key)
                    : json_object_get(j, key);
    json_int_t x = json_integer_value(v);
    json_decref(j);
    return x;
}

/* Store jobs run after the reply: wait (10 s at most) until the store holds this many. */
static void wait_objects(const rig *r, json_int_t blocks, json_int_t windows)
{
    uint64_t until = di_mono_ns() + 10000000000ull;
    json_int_t b, w;
    do {
        b = store_stat(r, "block", "objects");
        w = store_stat(r, "window", "objects");
        if (b >= blocks && w >= windows)
            return;
        usleep(50000);
    } while (di_mono_ns() < until);
    cr_assert_fail("the store holds %lld blocks and %lld window states, want %lld and %lld",
                   (long long)b, (long long)w, (long long)blocks, (long long)windows);
}

/* Waits (30 s at most) until the log of p has a line with `what`. */
static void wait_log(const proc *p, const char *what)
{
    uint64_t until = di_mono_ns() + 30000000000ull;
    char buf[65536];
    do {
        FILE *f = fopen(p->log, "r");
        size_t n = f ? fread(buf, 1, sizeof buf - 1, f) : 0;
        if (f)
            fclose(f);
        buf[n] = 0;
        if (strstr(buf, what))
            return;
        usleep(20000);
    } while (di_mono_ns() < until);
    cr_assert_fail("%s: no line with \"%s\" in %s", p->log, what, buf);
}

/* Two prompts: a of 700 ids, b of 720 sharing a's first 640 (5 blocks). */
static void shared_prompts(uint32_t *a, uint32_t *b)
{
    prompt_ids(a, 700, 41);
    memcpy(b, a, 640 * sizeof(uint32_t));
    for (uint32_t k = 640; k < 720; k++)
        b[k] = 2 + (k * 131u + 17u) % 4000u;
}

/* The second prompt sharing a long prefix with the first is served from the store: prefill
 * computes only the rest (the reply's cached_tokens and GetLoad's counts), the store counted
 * the hit, and the output equals a local run's bit for bit. b = 720 tokens: the hit is capped at
 * (720 - 140) / 128 = 4 blocks, where a left its window state (a rerun of a resumes there). */
Test(disagg, a_prompt_sharing_a_long_prefix_is_served_from_the_store)
{
    rig r = {0};
    rig_start(&r, "5");
    uint32_t a[700], b[720];
    shared_prompts(a, b);
    gen_res g1, g2, local;
    run_one(&g1, &r, true, a, 700, 4, "a");
    cr_assert_eq(req_int(&g1, "cached_tokens"), 0, "the store was empty");
    Di__Engine__Load l0 = get_load(&r.prefill, "prefill.Prefill");
    json_int_t hits0 = store_stat(&r, NULL, "lookup_hits");
    run_one(&g2, &r, true, b, 720, 8, "b");
    cr_assert_eq(req_int(&g2, "cached_tokens"), 512);
    Di__Engine__Load l1 = get_load(&r.prefill, "prefill.Prefill");
    cr_assert_eq(l1.prompt_tokens_cached - l0.prompt_tokens_cached, 512);
    cr_assert_eq(l1.prompt_tokens_computed - l0.prompt_tokens_computed, 720 - 512,
                 "prefill computed %llu tokens",
                 (unsigned long long)(l1.prompt_tokens_computed - l0.prompt_tokens_computed));
    cr_assert_geq(store_stat(&r, NULL, "lookup_hits") - hits0, 5, "a's 5 blocks were hit");
    cr_assert_eq(l1.store_failures, 0);
    run_one(&local, &r, false, b, 720, 8, "b-local");
    same_outputs(&g2, &local, "b from the store");
    json_decref(g1.json);
    json_decref(g2.json);
    json_decref(local.json);
    assert_clean(&r);
    rig_stop(&r);
}

/* The next turn of a conversation (the prompt, the response, more) hits the block decode
 * stored as the response filled it, and the window state decode stored at its last multiple
 * of 128: 300 prompt tokens + 200 generated = 499 positions of KV, blocks 0-1 from prefill and
 * block 2 with the window state at 384 from decode; the 600-token next turn resumes at 384
 * (prefill alone would have left 256). */
Test(disagg, the_next_turn_hits_the_blocks_decode_stored)
{
    rig r = {0};
    rig_start(&r, "5");
    uint32_t p[300], q[600];
    prompt_ids(p, 300, 43);
    gen_res g1, g2, local;
    run_one(&g1, &r, true, p, 300, 200, "turn1");
    json_t *toks = json_object_get(json_array_get(json_object_get(g1.json, "requests"), 0),
                                   "tokens");
    cr_assert_eq(json_array_size(toks), 200);
    memcpy(q, p, sizeof p);
    for (uint32_t k = 0; k < 200; k++)
        q[300 + k] = (uint32_t)json_integer_value(json_array_get(toks, k));
    for (uint32_t k = 500; k < 600; k++)
        q[k] = 2 + (k * 61u + 5u) % 4000u;
    wait_objects(&r, 3, 3); /* decode's put runs after its stream ended */
    run_one(&g2, &r, true, q, 600, 8, "turn2");
    cr_assert_eq(req_int(&g2, "cached_tokens"), 384, "decode's block 2 and window at 384");
    run_one(&local, &r, false, q, 600, 8, "turn2-local");
    same_outputs(&g2, &local, "the next turn from the store");
    json_decref(g1.json);
    json_decref(g2.json);
    json_decref(local.json);
    assert_clean(&r);
    rig_stop(&r);
}

typedef struct thaw {
    const proc *p;
    const char *line;
    pid_t store;
} thaw;

/* Continues the stopped store once the rank's log has the line. */
static void *thaw_when(void *arg)
{
    thaw *t = arg;
    wait_log(t->p, t->line);
    kill(t->store, SIGCONT);
    return NULL;
}

/* The store frozen while prefill looks a prompt up: the lookup fails at its deadline, the
 * prompt is computed (same output as a local run) and its handoff stored once the store is
 * back; the next prompt hits again (the store is never given up). Then the store frozen while
 * decode stores a response: the stream is served whole, the put is dropped after its attempts
 * (GetLoad counts it), and once the store is back decode stores the next responses and the
 * next turn hits them. */
Test(disagg, the_store_frozen_during_a_load_or_a_store_costs_only_the_hit)
{
    rig r = {0};
    rig_start(&r, "5");
    uint32_t a[700], b[720];
    shared_prompts(a, b);
    gen_res g1, g2, g3, local;
    run_one(&g1, &r, true, a, 700, 4, "a");
    /* the load */
    cr_assert_eq(kill(r.store.pid, SIGSTOP), 0);
    thaw t = {.p = &r.prefill, .line = "computing the prompt without it", .store = r.store.pid};
    pthread_t th;
    cr_assert_eq(pthread_create(&th, NULL, thaw_when, &t), 0);
    run_one(&g2, &r, true, b, 720, 8, "b");
    pthread_join(th, NULL);
    cr_assert_eq(req_int(&g2, "cached_tokens"), 0, "the lookup failed: no hit");
    run_one(&local, &r, false, b, 720, 8, "b-local");
    same_outputs(&g2, &local, "b without the store");
    Di__Engine__Load l = get_load(&r.prefill, "prefill.Prefill");
    cr_assert_geq(l.store_failures, 1);
    run_one(&g3, &r, true, b, 720, 8, "b-again");
    cr_assert_eq(req_int(&g3, "cached_tokens"), 512, "the store is used again");
    same_outputs(&g3, &local, "b from the store again");
    json_decref(g1.json);
    json_decref(g2.json);
    json_decref(g3.json);
    json_decref(local.json);
    /* the store of a response */
    rpc_client *pc = client(&r.prefill), *dc = client(&r.decode);
    uint32_t p[300];
    prompt_ids(p, 300, 47);
    di_status st;
    di_error err;
    Di__Prefill__PrefillReply *pr = prefill(pc, "frozen-store", p, 300, 200, 60000, &st, &err);
    cr_assert_eq(st, DI_OK, "%s", err.msg);
    json_int_t blocks0 = store_stat(&r, "block", "objects");
    rpc_stream *s = decode_open(dc, "frozen-store", p, 300, pr, 200);
    int ended;
    cr_assert_eq(stream_read(s, 1, &ended, &st, &err), 1, "%s", err.msg);
    uint64_t until = di_mono_ns() + 10000000000ull; /* decode deleted the handoff it pulled */
    while (store_stat(&r, "handoff", "objects") && di_mono_ns() < until)
        usleep(20000);
    cr_assert_eq(kill(r.store.pid, SIGSTOP), 0);
    uint32_t got = 1 + stream_read(s, 1000, &ended, &st, &err);
    cr_assert(ended && st == DI_OK, "the stream is served whole: %s", err.msg);
    cr_assert_eq(got, 199, "every token of the response");
    wait_log(&r.decode, "not stored; the store is tried again");
    cr_assert_eq(kill(r.store.pid, SIGCONT), 0);
    rpc_stream_close(s);
    di__prefill__prefill_reply__free_unpacked(pr, NULL);
    rpc_client_close(pc);
    rpc_client_close(dc);
    l = get_load(&r.decode, "decode.Decode");
    cr_assert_geq(l.store_failures, 1, "the dropped put is counted");
    cr_assert_eq(store_stat(&r, "block", "objects"), blocks0, "the response was not stored");
    /* back: the next turn of another conversation hits what decode stores now */
    uint32_t q[600];
    prompt_ids(q, 300, 53);
    gen_res t1, t2;
    run_one(&t1, &r, true, q, 300, 200, "turn1");
    json_t *toks = json_object_get(json_array_get(json_object_get(t1.json, "requests"), 0),
                                   "tokens");
    for (uint32_t k = 0; k < 200; k++)
        q[300 + k] = (uint32_t)json_integer_value(json_array_get(toks, k));
    for (uint32_t k = 500; k < 600; k++)
        q[k] = 2 + (k * 67u + 3u) % 4000u;
    wait_objects(&r, blocks0 + 3, 0);
    run_one(&t2, &r, true, q, 600, 8, "turn2");
    cr_assert_eq(req_int(&t2, "cached_tokens"), 384, "decode stores again");
    json_decref(t1.json);
    json_decref(t2.json);
    assert_clean(&r);
    rig_stop(&r);
}

#endif /* !DI_DISAGG_BENCH */

#ifdef DI_DISAGG_BENCH
/* ---- benchmarks (meson test --benchmark --suite serve) ---- */

TestSuite(disagg_bench, .init = setup, .fini = teardown, .timeout = 900);

static double best_of(double a, double b)
{
    return a == 0 || b < a ? b : a;
}

/* The KV pull of a 16,384-token V4.1-Flash-geometry prompt: 128 full blocks + the partial 129th
 * (decode pulls every block the prompt touches) + the window state, from a real di-kvstore on
 * this host through kv_client (verified gets), next to memcpy of the same bytes in the same run. */
Test(disagg_bench, kv_pull_of_a_16k_prompt_next_to_memcpy)
{
    char dir[300];
    snprintf(dir, sizeof dir, "%s/store", g_dir);
    const char *args[] = {"--geometry", "v41-flash", "--nextn", "5", "--dram-bytes", "1GiB",
                          "--durability", "none", NULL};
    th_store store = {0};
    th_store_start(&store, dir, args);
    kvc_client *c = th_client(&store, NULL);
    kvc_store_info info;
    di_error err;
    cr_assert_eq(kvc_info(c, &info, &err), DI_OK, "%s", err.msg);
    const kv_geometry *g = &info.geometry;
    enum { NB = 129 };
    size_t bb = kv_block_bytes(g), wb = kv_window_state_bytes(g), total = NB * bb + wb;
    kvc_item items[NB + 1];
    uint8_t *src = aligned_alloc(64, (total + 63) / 64 * 64);
    uint8_t *dst = aligned_alloc(64, (total + 63) / 64 * 64);
    cr_assert(src && dst);
    for (uint32_t i = 0; i <= NB; i++) {
        bool win = i == NB;
        items[i] = (kvc_item){.cls = win ? KVKEY_WINDOW : KVKEY_BLOCK, .key = th_key(1000 + i),
                              .buf = src + (size_t)i * bb, .cap = win ? wb : bb};
        th_fill_object(items[i].buf, items[i].cap, win ? KV_WINDOW_MAGIC : KV_BLOCK_MAGIC, g,
                       &items[i].key, i);
    }
    cr_assert_eq(kvc_put(c, items, NB + 1, &err), DI_OK, "%s", err.msg);
    for (uint32_t i = 0; i <= NB; i++)
        cr_assert_eq(items[i].status, DI_OK, "put %u: %s", i, items[i].error.msg);
    double pull = 0, copy = 0;
    for (int rep = 0; rep < 7; rep++) {
        for (uint32_t i = 0; i <= NB; i++)
            items[i].buf = dst + (size_t)i * bb;
        uint64_t t0 = di_mono_ns();
        cr_assert_eq(kvc_get(c, items, NB + 1, &err), DI_OK, "%s", err.msg);
        double t = (double)(di_mono_ns() - t0) / 1e9;
        for (uint32_t i = 0; i <= NB; i++)
            cr_assert_eq(items[i].status, DI_OK, "get %u: %s", i, items[i].error.msg);
        pull = best_of(pull, t);
        t0 = di_mono_ns();
        memcpy(dst, src, total);
        __asm__ volatile("" : : "r"(dst) : "memory");
        copy = best_of(copy, (double)(di_mono_ns() - t0) / 1e9);
    }
    cr_assert(memcmp(dst, src, total) == 0);
    printf("KV pull, 16,384-token V4.1-Flash prompt (%d blocks of %zu B + window state of %zu "
           "B = %.1f MB), verified kvc_get from di-kvstore on this host (%s): best of 7 %.2f ms "
           "= %.2f GB/s; memcpy of the same bytes, same run: %.2f ms = %.2f GB/s; pull / memcpy "
           "= %.2f\n", NB, bb, wb, total / 1e6, "UCX active messages",
           pull * 1e3, total / pull / 1e9, copy * 1e3, total / copy / 1e9, copy / pull);
    free(src);
    free(dst);
    kvc_close(c);
    th_store_stop(&store);
}

/* Per-prompt TTFT and time per output token: disaggregated (di-prefill -> store -> di-decode,
 * one prompt at a time) next to the local engine running each prompt alone (prefill_s and
 * decode_s / decode_tokens of di-generate), tiny model, CPU, same prompts. */
Test(disagg_bench, ttft_and_tpot_disaggregated_vs_local)
{
    rig r = {0};
    rig_start(&r, "5");
    const uint32_t lens[] = {128, 512, 1000, 2000};
    printf("tiny model, CPU, 1 thread per rank, chunk " CHUNK ", 32 output tokens, nextn 5\n");
    for (size_t i = 0; i < sizeof lens / sizeof lens[0]; i++) {
        char path[300];
        snprintf(path, sizeof path, "%s/b%zu.txt", g_dir, i);
        FILE *f = fopen(path, "w");
        for (uint32_t k = 0; k < lens[i]; k++)
            fprintf(f, k ? ",%u" : "%u", 2 + (k * 7919u + (uint32_t)i * 31u) % 4000u);
        fputc('\n', f);
        fclose(f);
        gen_res loc, rem;
        gen(&loc, "--config tiny --weights-seed " SEED " --chunk " CHUNK " --threads 1 --nextn "
            "5 --ids-file %s --max-tokens 32 --ignore-eos", path);
        gen(&rem, "--prefill %s --decode %s --ids-file %s --max-tokens 32 --ignore-eos",
            r.prefill.target, r.decode.target, path);
        cr_assert(loc.rc == 0 && rem.rc == 0, "%s %s", loc.err, rem.err);
        json_t *ls = json_object_get(loc.json, "stats"), *rs = json_object_get(rem.json, "stats");
        double lt = json_real_value(json_object_get(ls, "prefill_s")) * 1e3;
        double ld = json_real_value(json_object_get(ls, "decode_s")) * 1e3 /
                    (double)json_integer_value(json_object_get(ls, "decode_tokens"));
        printf("prompt %5u tokens: TTFT local %.1f ms, disaggregated %.1f ms; per output token "
               "local %.2f ms, disaggregated %.2f ms; KV pulled %.0f B in %.2f ms\n", lens[i],
               lt, json_real_value(json_object_get(rs, "ttft_ms_mean")), ld,
               json_real_value(json_object_get(rs, "tpot_ms_mean")),
               json_real_value(json_object_get(rs, "kv_pulled_bytes_mean")),
               json_real_value(json_object_get(rs, "kv_pull_ms_mean")));
        json_decref(loc.json);
        json_decref(rem.json);
    }
    rig_stop(&r);
}

/* A prompt whose prefix is in the store, against the same prompt's cold TTFT and against the
 * floor of its warm TTFT: di-generate --kvstore on the same prompt and store, one process, its
 * prefill time (the same hit loaded, the same tail computed over the same context). B shares
 * all of A but its last 64 tokens; the hit is capped at L - 140. */
Test(disagg_bench, ttft_of_a_prefix_hit_vs_cold_and_the_compute_floor)
{
    rig r = {0};
    rig_start(&r, "5");
    const uint32_t lens[] = {1000, 2000, 4000};
    printf("tiny model, CPU, 1 thread per rank, chunk " CHUNK ", 8 output tokens, nextn 5\n");
    for (size_t i = 0; i < sizeof lens / sizeof lens[0]; i++) {
        uint32_t L = lens[i];
        char pa[300], pb[300];
        snprintf(pa, sizeof pa, "%s/ha%zu.txt", g_dir, i);
        snprintf(pb, sizeof pb, "%s/hb%zu.txt", g_dir, i);
        FILE *fa = fopen(pa, "w"), *fb = fopen(pb, "w");
        for (uint32_t k = 0; k < L; k++) {
            uint32_t t = 2 + (k * 7919u + (uint32_t)i * 131u + 7u) % 4000u;
            fprintf(fa, k ? ",%u" : "%u", t);
            fprintf(fb, k ? ",%u" : "%u", k < L - 64 ? t : 2 + (k * 37u + 11u) % 4000u);
        }
        fputc('\n', fa);
        fputc('\n', fb);
        fclose(fa);
        fclose(fb);
        gen_res cold, warm, floor_run;
        gen(&cold, "--prefill %s --decode %s --ids-file %s --max-tokens 8 --ignore-eos",
            r.prefill.target, r.decode.target, pa);
        gen(&warm, "--prefill %s --decode %s --ids-file %s --max-tokens 8 --ignore-eos",
            r.prefill.target, r.decode.target, pb);
        cr_assert(cold.rc == 0 && warm.rc == 0, "%s %s", cold.err, warm.err);
        json_int_t cached = json_integer_value(json_object_get(
            json_array_get(json_object_get(warm.json, "requests"), 0), "cached_tokens"));
        uint32_t tail = L - (uint32_t)cached;
        gen(&floor_run, "--config tiny --weights-seed " SEED " --chunk " CHUNK " --threads 1 "
            "--nextn 5 --ids-file %s --max-tokens 8 --ignore-eos --kvstore %s", pb,
            r.store.target);
        cr_assert_eq(floor_run.rc, 0, "%s", floor_run.err);
        cr_assert_eq(json_integer_value(json_object_get(json_object_get(json_object_get(
                         floor_run.json, "stats"), "kvstore"), "hit_tokens")), cached,
                     "the same hit");
        double ct = json_real_value(json_object_get(json_object_get(cold.json, "stats"),
                                                    "ttft_ms_mean"));
        double wt = json_real_value(json_object_get(json_object_get(warm.json, "stats"),
                                                    "ttft_ms_mean"));
        double ft_ms = json_real_value(json_object_get(json_object_get(floor_run.json, "stats"),
                                                       "prefill_s")) * 1e3;
        printf("prompt %5u tokens: TTFT cold %.1f ms; warm %.1f ms with %lld tokens from the "
               "store, %u computed; floor (di-generate --kvstore, the same hit, prefill) %.1f "
               "ms\n", L, ct, wt, (long long)cached, tail, ft_ms);
        json_decref(cold.json);
        json_decref(warm.json);
        json_decref(floor_run.json);
    }
    rig_stop(&r);
}
#endif
