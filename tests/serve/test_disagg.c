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
#define SEED "3"

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

static void proc_kill(proc *p)
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
    Di__Engine__Load load0[2];  /* GetLoad of prefill, decode at start */
} rig;

static const char *const k_store_args[] = {
    "--geometry", "tiny", "--dram-bytes", "256MiB", "--dram-handoff-share", "0.2",
    "--handoff-max-bytes", "2MiB", "--durability", "none", NULL};

static Di__Engine__Load get_load(const proc *p, const char *svc)
{
    rpc_client *c;
    di_error err;
    rpc_client_config cfg = {.target = p->target};
    cr_assert_eq(rpc_client_open(&cfg, &c, &err), DI_OK, "%s", err.msg);
    char method[64];
    snprintf(method, sizeof method, "/di.%s/GetLoad", svc);
    uint8_t *rep = NULL;
    size_t len = 0;
    cr_assert_eq(rpc_client_call(c, method, NULL, 0, 5000, &rep, &len, &err), DI_OK, "%s",
                 err.msg);
    Di__Engine__Load *l = di__engine__load__unpack(NULL, len, rep);
    cr_assert_not_null(l);
    Di__Engine__Load out = *l;
    di__engine__load__free_unpacked(l, NULL);
    free(rep);
    rpc_client_close(c);
    return out;
}

static void engine_start(proc *p, const char *exe, const char *name, const rig *r)
{
    const char *args[] = {"--config", "tiny", "--weights-seed", SEED, "--kvstore",
                          r->store.target, "--chunk", CHUNK, "--threads", "1", "--nextn",
                          r->nextn, "--blocks", "256", "--drain", "20s", NULL};
    proc_start(p, exe, name, args);
}

static void rig_start(rig *r, const char *nextn)
{
    r->nextn = nextn;
    char dir[300];
    snprintf(dir, sizeof dir, "%s/store", g_dir);
    const char *args[16];
    int n = 0;
    for (; k_store_args[n]; n++)
        args[n] = k_store_args[n];
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
static void assert_clean(const rig *r)
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

static void compare_runs(const rig *r, const char *sampling, uint32_t salt)
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
