/* rig.c: see rig.h. */
#include "tests/serve/rig.h"

#include <criterion/criterion.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <stdbool.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include "common/util/clock.h"
#include "tests/kvstore/helpers.h"

char g_dir[256];

const char *build_root(void)
{
    const char *b = getenv("DI_BUILD_ROOT");
    cr_assert(b, "DI_BUILD_ROOT is not set (run under meson test)");
    return b;
}

/* ---- processes ---- */

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

void proc_spawn(proc *p, const char *rel, const char *name, const char *const *args)
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
    p->ready_fd = ready[0];
}

void proc_ready(proc *p, const char *name)
{
    int fd = p->ready_fd;
    char buf[32] = {0};
    size_t got = 0;
    struct pollfd pf = {.fd = fd, .events = POLLIN};
    while (got < sizeof buf - 1 && !memchr(buf, '\n', got) && poll(&pf, 1, 60000) > 0) {
        ssize_t k = read(fd, buf + got, sizeof buf - 1 - got);
        if (k <= 0)
            break;
        got += (size_t)k;
    }
    close(fd);
    p->ready_fd = -1;
    p->port = atoi(buf);
    cr_assert_gt(p->port, 0, "%s did not start (see %s)", name, p->log);
    snprintf(p->target, sizeof p->target, "127.0.0.1:%d", p->port);
}

void proc_start(proc *p, const char *rel, const char *name, const char *const *args)
{
    proc_spawn(p, rel, name, args);
    proc_ready(p, name);
}

int proc_stop(proc *p)
{
    if (!p->pid)
        return 0;
    kill(p->pid, SIGTERM);
    int status = 0;
    waitpid(p->pid, &status, 0);
    p->pid = 0;
    return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

void proc_kill(proc *p)
{
    if (!p->pid)
        return;
    kill(p->pid, SIGKILL);
    waitpid(p->pid, NULL, 0);
    p->pid = 0;
}

/* ---- the deployment ---- */

static const char *const k_store_args[] = {
    "--dram-bytes", "256MiB", "--dram-handoff-share", "0.2",
    "--handoff-max-bytes", "2MiB", "--durability", "none", NULL};

uint8_t *unary(const proc *p, const char *method, const void *req, size_t len, size_t *rlen,
               di_status *st, di_error *err)
{
    rpc_client *c;
    rpc_client_config cfg = {.target = p->target};
    cr_assert_eq(rpc_client_open(&cfg, &c, err), DI_OK, "%s", err->msg);
    uint8_t *rep = NULL;
    *st = rpc_client_call(c, method, req, len, 5000, &rep, rlen, err);
    rpc_client_close(c);
    return *st == DI_OK ? rep : NULL;
}

Di__Engine__Load get_load(const proc *p, const char *svc)
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

void engine_spawn(proc *p, const char *exe, const char *name, const rig *r,
                  const char *const *extra)
{
    const char *args[48] = {"--config", r->config ? r->config : "tiny", "--weights-seed", SEED,
                          "--kvstore",
                          r->store.target, "--chunk", CHUNK, "--threads", "1", "--nextn",
                          r->nextn, "--blocks", r->blocks ? r->blocks : "256",
                          "--kvstore-deadline", r->kv_deadline ? r->kv_deadline : "2s", "--drain",
                          r->drain ? r->drain : "20s", NULL};
    size_t n = 0;
    while (args[n])
        n++;
    for (size_t i = 0; extra && extra[i]; i++) {
        cr_assert_lt(n + 1, sizeof args / sizeof args[0], "too many arguments");
        args[n++] = extra[i];
    }
    args[n] = NULL;
    proc_spawn(p, exe, name, args);
}

void engine_start(proc *p, const char *exe, const char *name, const rig *r)
{
    engine_spawn(p, exe, name, r, NULL);
    proc_ready(p, name);
}

void rig_start(rig *r, const char *nextn)
{
    r->nextn = nextn;
    char dir[300];
    snprintf(dir, sizeof dir, "%s/store", g_dir);
    /* the store's model id covers the weights: it is started on the checkpoint of the
     * engines' random weights (config tiny unless r->config, seed 0), manifest included */
    const char *config = r->config ? r->config : "tiny";
    static char ckpt[300];
    char cmd[1024];
    snprintf(ckpt, sizeof ckpt, "%s/ckpt-%s", g_dir, config);
    snprintf(cmd, sizeof cmd, "test -d %s || %s/tools/mkmodel/di-mkmodel --quiet %s %s "
             "> /dev/null", ckpt, build_root(), config, ckpt);
    cr_assert_eq(system(cmd), 0, "%s", cmd);
    const char *args[40] = {"--model", ckpt};
    int n = 2;
    for (int i = 0; k_store_args[i]; i++)
        args[n++] = k_store_args[i];
    for (int i = 0; r->store_extra && r->store_extra[i] && n < 36; i++)
        args[n++] = r->store_extra[i];
    args[n++] = "--nextn"; /* the ring size of window states follows the drafts */
    args[n++] = nextn;
    args[n] = NULL;
    th_store_start(&r->store, dir, args);
    engine_start(&r->prefill, "prefill/di-prefill", "prefill", r);
    engine_start(&r->decode, "decode/di-decode", "decode", r);
    r->load0[0] = get_load(&r->prefill, "prefill.Prefill");
    r->load0[1] = get_load(&r->decode, "decode.Decode");
}

json_t *kvctl_stats(const rig *r)
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

void assert_clean(const rig *r)
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
    json_decref(j);
    cr_assert_eq(leases, 0, "%lld leases left in the store", (long long)leases);
    long long handoffs = rig_handoffs(r);
    cr_assert_eq(handoffs, 0, "%lld handoff objects left in the store", handoffs);
}

long long rig_handoffs(const rig *r)
{
    json_t *j = kvctl_stats(r);
    json_int_t n = json_integer_value(
        json_object_get(json_object_get(json_object_get(j, "classes"), "handoff"), "objects"));
    json_decref(j);
    return (long long)n;
}

void rig_wait_no_handoffs(const rig *r, uint32_t ms)
{
    uint64_t until = di_mono_ns() + (uint64_t)ms * 1000000u;
    long long n;
    while ((n = rig_handoffs(r)) != 0 && di_mono_ns() < until)
        usleep(20000);
    cr_assert_eq(n, 0, "%lld handoff objects still in the store after %u ms", n, ms);
}

void rig_stop(rig *r)
{
    cr_assert_eq(proc_stop(&r->prefill), 0, "di-prefill did not drain cleanly");
    cr_assert_eq(proc_stop(&r->decode), 0, "di-decode did not drain cleanly");
    th_store_stop(&r->store);
}

/* ---- di-generate ---- */

void gen(gen_res *g, const char *fmt, ...)
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

void rig_write_prompts(const char *path, const uint32_t *lens, size_t n, uint32_t salt)
{
    FILE *f = fopen(path, "w");
    cr_assert(f);
    for (uint32_t i = 0; i < n; i++) {
        for (uint32_t k = 0; k < lens[i]; k++)
            fprintf(f, k ? ",%u" : "%u", 2 + (k * 7919u + i * 104729u + salt * 31u) % 4000u);
        fputc('\n', f);
    }
    cr_assert_eq(fclose(f), 0);
}

void rig_same_outputs(const gen_res *a, const gen_res *b, const uint32_t *lens, size_t n_lens,
                      const char *what)
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
                             i < n_lens ? lens[i] : 0u, keys[k]);
            free(sx);
            free(sy);
        }
    }
}

/* ---- scratch directory ---- */

void rig_setup(void)
{
    th_tmpdir(g_dir);
}

void rig_teardown(void)
{
    th_rmtree(g_dir);
}

/* ---- direct calls ---- */

rpc_client *client(const proc *p)
{
    rpc_client *c;
    di_error err;
    rpc_client_config cfg = {.target = p->target};
    cr_assert_eq(rpc_client_open(&cfg, &c, &err), DI_OK, "%s", err.msg);
    return c;
}

void prompt_ids(uint32_t *ids, uint32_t n, uint32_t salt)
{
    for (uint32_t k = 0; k < n; k++)
        ids[k] = 2 + (k * 7919u + salt * 31u) % 4000u;
}

Di__Engine__SamplingParams no_eos(uint32_t max_tokens)
{
    Di__Engine__SamplingParams sp = DI__ENGINE__SAMPLING_PARAMS__INIT;
    sp.max_tokens = max_tokens;
    sp.eos_id = -1;
    sp.has_eos_id = 1;
    return sp;
}

Di__Prefill__PrefillReply *prefill(rpc_client *c, const char *rid, const uint32_t *ids,
                                   uint32_t n, uint32_t max_tokens, uint32_t timeout_ms,
                                   di_status *st, di_error *err)
{
    Di__Engine__SamplingParams sp = no_eos(max_tokens);
    return prefill_with(c, rid, ids, n, &sp, timeout_ms, st, err);
}

Di__Prefill__PrefillReply *prefill_with(rpc_client *c, const char *rid, const uint32_t *ids,
                                        uint32_t n, const Di__Engine__SamplingParams *sp,
                                        uint32_t timeout_ms, di_status *st, di_error *err)
{
    Di__Prefill__PrefillRequest m = DI__PREFILL__PREFILL_REQUEST__INIT;
    m.request_id = (char *)rid;
    m.n_prompt = n;
    m.prompt = (uint32_t *)ids;
    m.sampling = (Di__Engine__SamplingParams *)sp;
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

rpc_stream *decode_open(rpc_client *c, const char *rid, const uint32_t *ids, uint32_t n,
                        const Di__Prefill__PrefillReply *pr, uint32_t max_tokens)
{
    Di__Engine__SamplingParams sp = no_eos(max_tokens);
    return decode_open_with(c, rid, ids, n, pr, &sp, 60000);
}

rpc_stream *decode_open_with(rpc_client *c, const char *rid, const uint32_t *ids, uint32_t n,
                             const Di__Prefill__PrefillReply *pr,
                             const Di__Engine__SamplingParams *sp, uint32_t deadline_ms)
{
    Di__Decode__DecodeRequest m = DI__DECODE__DECODE_REQUEST__INIT;
    m.request_id = (char *)rid;
    m.handoff = pr->handoff;
    m.n_prompt = n;
    m.prompt = (uint32_t *)ids;
    m.first = pr->first;
    m.sampling = (Di__Engine__SamplingParams *)sp;
    uint8_t buf[65536];
    size_t len = di__decode__decode_request__pack(&m, buf);
    rpc_stream *s;
    di_error err;
    cr_assert_eq(rpc_stream_open(c, "/di.decode.Decode/Decode", buf, len, deadline_ms, &s, &err),
                 DI_OK, "%s", err.msg);
    return s;
}

Di__Decode__DecodeToken *stream_next(rpc_stream *s, di_status *st)
{
    uint8_t *msg = NULL;
    size_t len = 0;
    int done = 0;
    di_error err;
    *st = rpc_stream_read(s, &msg, &len, &done, &err);
    if (done || *st != DI_OK) {
        free(msg);
        return NULL;
    }
    Di__Decode__DecodeToken *t = di__decode__decode_token__unpack(NULL, len, msg);
    free(msg);
    cr_assert_not_null(t, "a stream message that is no DecodeToken");
    return t;
}

uint32_t stream_read(rpc_stream *s, uint32_t max, int *ended, di_status *st, di_error *err)
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

uint64_t model_id_of(const proc *p)
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

void flight_start(flight *f, rig *r, const char *rid, uint32_t n, uint32_t max_tokens,
                  uint32_t reads)
{
    flight_start_at(f, r, &r->decode, rid, n, max_tokens, reads);
}

void flight_start_at(flight *f, rig *r, const proc *decode, const char *rid, uint32_t n,
                     uint32_t max_tokens, uint32_t reads)
{
    f->pc = client(&r->prefill);
    f->dc = client(decode);
    prompt_ids(f->ids, n, n);
    di_status st;
    di_error err;
    int ended;
    f->pr = prefill(f->pc, rid, f->ids, n, max_tokens, 30000, &st, &err);
    cr_assert_not_null(f->pr, "%s", err.msg);
    f->s = decode_open(f->dc, rid, f->ids, n, f->pr, max_tokens);
    cr_assert_eq(stream_read(f->s, reads, &ended, &st, &err), reads, "%s", err.msg);
}

di_status flight_end(flight *f, di_error *err)
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

void *abort_later(void *arg)
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

uint32_t rig_cancels(void)
{
    const char *env = getenv("DI_DISAGG_CANCELS");
    return env ? (uint32_t)atoi(env) : 200;
}

/* ---- the KV of a 16,384-token V4.1-Flash prompt ---- */

void flash_store_start(th_store *s, const char *name)
{
    char dir[300];
    snprintf(dir, sizeof dir, "%s/%s", g_dir, name);
    const char *args[] = {"--geometry", "v41-flash", "--nextn", "5", "--dram-bytes", "1GiB",
                          "--durability", "none", NULL};
    th_store_start(s, dir, args);
}

size_t flash_16k_bytes(const kv_geometry *g)
{
    return FLASH_16K_BLOCKS * kv_block_bytes(g) + kv_window_state_bytes(g);
}

void flash_16k_items(const kv_geometry *g, kvc_item *items, uint8_t *buf)
{
    size_t bb = kv_block_bytes(g), wb = kv_window_state_bytes(g);
    for (uint32_t i = 0; i <= FLASH_16K_BLOCKS; i++) {
        bool win = i == FLASH_16K_BLOCKS;
        items[i] = (kvc_item){.cls = win ? KVKEY_WINDOW : KVKEY_BLOCK, .key = th_key(1000 + i),
                              .buf = buf + (size_t)i * bb, .cap = win ? wb : bb};
        th_fill_object(items[i].buf, items[i].cap, win ? KV_WINDOW_MAGIC : KV_BLOCK_MAGIC, g,
                       &items[i].key, i);
    }
}
