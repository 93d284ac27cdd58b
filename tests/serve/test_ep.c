/* di-prefill and di-decode as expert-parallel rank groups of 2 on loopback (tiny model, CPU
 * backend, the CPU exchange): each rank a full service with its own port, the group's MoE
 * exchange under every step. Requests sent to one rank of each group (the other idle), to the
 * other, and to both at once give the same tokens, logprobs and finish as the same requests
 * through single-rank services; an idle group stays idle (CPU time); a rank killed mid-request
 * fails its peer's request with an error naming it, within the deadline, and the peer then
 * reports NOT_SERVING and refuses requests; a rank with the wrong group token is refused and
 * the group still forms with the right one. */
#include <criterion/criterion.h>
#include <pthread.h>
#include <signal.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "common/ep/group.h"
#include "common/util/clock.h"
#include "tests/serve/rig.h"

#define TOKEN "0123456789abcdef0123456789abcdef-ep-test-group"

static void write_file(const char *path, const char *text)
{
    FILE *f = fopen(path, "w");
    cr_assert(f, "%s", path);
    fputs(text, f);
    cr_assert_eq(fclose(f), 0);
}

/* Spawns rank `rank` of a group of 2 of exe (rank 0 gets the listening socket lfd). */
static void rank_spawn(proc *p, const rig *r, const char *exe, const char *name, uint32_t rank,
                       const char *addr, int lfd, const char *token_file,
                       const char *const *more)
{
    char rank_s[8], fd_s[16];
    snprintf(rank_s, sizeof rank_s, "%u", rank);
    snprintf(fd_s, sizeof fd_s, "%d", lfd);
    const char *args[32] = {"--rank", rank_s, "--world", "2", "--ep-addr", addr,
                            "--ep-token-file", token_file, "--ep-timeout", "20s"};
    size_t n = 10;
    if (rank == 0) {
        args[n++] = "--ep-listen-fd";
        args[n++] = fd_s;
    }
    for (size_t i = 0; more && more[i]; i++)
        args[n++] = more[i];
    args[n] = NULL;
    engine_spawn(p, exe, name, r, args);
}

/* A group's socket: bound by the test and handed to rank 0 (as a launcher does). */
static int group_listen(char *addr, size_t cap)
{
    int fd;
    uint16_t port;
    di_error err;
    cr_assert_eq(ep_group_listen("127.0.0.1:0", false, &fd, &port, &err), DI_OK, "%s",
                 err.msg);
    snprintf(addr, cap, "127.0.0.1:%u", port);
    return fd;
}

/* Starts both ranks of a group of exe ("prefill/di-prefill") named name0, name1. */
static void group_start(proc rk[2], const rig *r, const char *exe, const char *name,
                        const char *const *more)
{
    char addr[32], tok[300], n0[64], n1[64];
    snprintf(tok, sizeof tok, "%s/ep.token", g_dir);
    write_file(tok, TOKEN "\n");
    snprintf(n0, sizeof n0, "%s0", name);
    snprintf(n1, sizeof n1, "%s1", name);
    int lfd = group_listen(addr, sizeof addr);
    rank_spawn(&rk[0], r, exe, n0, 0, addr, lfd, tok, more);
    close(lfd);
    rank_spawn(&rk[1], r, exe, n1, 1, addr, -1, tok, more);
    proc_ready(&rk[0], n0);
    proc_ready(&rk[1], n1);
}

static bool health_serving(const proc *p, const char *svc)
{
    char method[64];
    snprintf(method, sizeof method, "/di.%s/Health", svc);
    size_t len = 0;
    di_status st;
    di_error err;
    uint8_t *rep = unary(p, method, NULL, 0, &len, &st, &err);
    cr_assert_eq(st, DI_OK, "%s", err.msg);
    Di__Engine__HealthReply *h = di__engine__health_reply__unpack(NULL, len, rep);
    free(rep);
    cr_assert_not_null(h);
    bool serving = h->serving;
    di__engine__health_reply__free_unpacked(h, NULL);
    return serving;
}

static bool log_has(const proc *p, const char *needle)
{
    FILE *f = fopen(p->log, "r");
    if (!f)
        return false;
    static char buf[1 << 20];
    size_t n = fread(buf, 1, sizeof buf - 1, f);
    fclose(f);
    buf[n] = 0;
    return strstr(buf, needle) != NULL;
}

/* ---- outputs ---- */

static const uint32_t k_lens[] = {1, 5, 129, 300};
#define N_LENS (sizeof k_lens / sizeof k_lens[0])

static void same_outputs(const gen_res *a, const gen_res *b, const char *what)
{
    cr_assert_eq(json_array_size(json_object_get(a->json, "requests")), N_LENS, "%s: requests",
                 what);
    rig_same_outputs(a, b, k_lens, N_LENS, what);
}


/* Runs di-generate through (prefill, decode) pairs at once: runs[i] gets the output of
 * --prefill pre[i] --decode dec[i]. */
static void gen_at_once(gen_res *runs, const proc *const *pre, const proc *const *dec, int n,
                        const char *args)
{
    char cmd[8192];
    size_t len = (size_t)snprintf(cmd, sizeof cmd, "pids=;");
    for (int i = 0; i < n; i++)
        len += (size_t)snprintf(cmd + len, sizeof cmd - len, " %s/tools/generate/di-generate "
                                "--quiet --json --prefill %s --decode %s %s > %s/run%d.out "
                                "2> %s/run%d.err & pids=\"$pids $!\";", build_root(),
                                pre[i]->target, dec[i]->target, args, g_dir, i, g_dir, i);
    snprintf(cmd + len, sizeof cmd - len, " rc=0; for p in $pids; do wait $p || rc=1; done; "
             "exit $rc");
    int rc = system(cmd);
    for (int i = 0; i < n; i++) {
        char path[300];
        snprintf(path, sizeof path, "%s/run%d.out", g_dir, i);
        runs[i].json = json_load_file(path, 0, NULL);
        snprintf(path, sizeof path, "%s/run%d.err", g_dir, i);
        FILE *f = fopen(path, "r");
        size_t k = f ? fread(runs[i].err, 1, sizeof runs[i].err - 1, f) : 0;
        runs[i].err[k] = 0;
        if (f)
            fclose(f);
        runs[i].rc = runs[i].json ? 0 : 1;
        cr_assert_eq(WIFEXITED(rc) ? WEXITSTATUS(rc) : -1, 0, "a run failed: %s",
                     runs[i].err);
        cr_assert_not_null(runs[i].json, "run %d: %s", i, runs[i].err);
    }
}


/* CPU seconds (user + system) process pid has used. */
static double cpu_s(pid_t pid)
{
    char path[64], buf[2048];
    snprintf(path, sizeof path, "/proc/%d/stat", (int)pid);
    FILE *f = fopen(path, "r");
    cr_assert(f, "%s", path);
    size_t n = fread(buf, 1, sizeof buf - 1, f);
    fclose(f);
    buf[n] = 0;
    const char *p = strrchr(buf, ')');
    cr_assert(p);
    unsigned long long ut = 0, stime = 0;
    /* after ")": state ppid pgrp session tty tpgid flags minflt cminflt majflt cmajflt utime
     * stime */
    cr_assert_eq(sscanf(p + 2, "%*c %*d %*d %*d %*d %*d %*u %*u %*u %*u %*u %llu %llu", &ut,
                        &stime), 2);
    return (double)(ut + stime) / (double)sysconf(_SC_CLK_TCK);
}

/* The store, single-rank services, a decode group of 2 (with opts) and a stream of max_tokens
 * on its rank 0 of which 3 tokens are read. */
static void decode_group_streaming(rig *r, proc dg[2], flight *f, const char *const *opts,
                                   const char *rid, uint32_t n, uint32_t max_tokens)
{
    rig_start(r, "0");
    group_start(dg, r, "decode/di-decode", "edecode", opts);
    flight_start_at(f, r, &dg[0], rid, n, max_tokens, 3);
}

TestSuite(ep_serve, .init = rig_setup, .fini = rig_teardown, .timeout = 600);

/* Both groups against the single-rank services: one rank busy, then the other, then both. */
Test(ep_serve, groups_equal_single_ranks)
{
    rig r = {0};
    rig_start(&r, "1");
    proc pg[2], dg[2];
    const char *const eplb[] = {"--ep-redundant", "2", "--eplb-interval", "4", NULL};
    group_start(pg, &r, "prefill/di-prefill", "eprefill", eplb);
    group_start(dg, &r, "decode/di-decode", "edecode", eplb);
    cr_assert(health_serving(&pg[0], "prefill.Prefill") &&
              health_serving(&pg[1], "prefill.Prefill") &&
              health_serving(&dg[0], "decode.Decode") && health_serving(&dg[1], "decode.Decode"));

    char prompts[300], args[600];
    snprintf(prompts, sizeof prompts, "%s/prompts.txt", g_dir);
    rig_write_prompts(prompts, k_lens, N_LENS, 5);
    snprintf(args, sizeof args, "--ids-file %s --max-tokens 8 --ignore-eos --temperature 0.8 "
             "--seed 7 --logprobs 2", prompts);
    gen_res ref, runs[2];
    const proc *sp[1] = {&r.prefill}, *sd[1] = {&r.decode};
    gen_at_once(&ref, sp, sd, 1, args);

    /* rank 0 of each group busy, rank 1 idle; then the other way round */
    for (int k = 0; k < 2; k++) {
        const proc *p[1] = {&pg[k]}, *d[1] = {&dg[k]};
        gen_at_once(runs, p, d, 1, args);
        same_outputs(&runs[0], &ref, k ? "ranks 1" : "ranks 0");
        json_decref(runs[0].json);
    }
    /* both ranks of both groups busy at once, crossed */
    const proc *p2[2] = {&pg[0], &pg[1]}, *d2[2] = {&dg[1], &dg[0]};
    gen_at_once(runs, p2, d2, 2, args);
    same_outputs(&runs[0], &ref, "prefill rank 0, decode rank 1, at once");
    same_outputs(&runs[1], &ref, "prefill rank 1, decode rank 0, at once");
    json_decref(runs[0].json);
    json_decref(runs[1].json);
    json_decref(ref.json);

    /* an idle group sleeps between its votes: well under a fifth of a core each */
    const proc *all[4] = {&pg[0], &pg[1], &dg[0], &dg[1]};
    double c0[4];
    for (int i = 0; i < 4; i++)
        c0[i] = cpu_s(all[i]->pid);
    uint64_t t0 = di_mono_ns();
    usleep(1500000);
    double wall = (double)(di_mono_ns() - t0) / 1e9;
    for (int i = 0; i < 4; i++) {
        double used = cpu_s(all[i]->pid) - c0[i];
        cr_log_info("idle rank %d: %.3f s of CPU in %.3f s", i, used, wall);
        cr_assert_lt(used, 0.2 * wall, "an idle rank used %.3f s of CPU in %.3f s", used, wall);
    }

    for (int i = 0; i < 4; i++) /* the whole group drains at once */
        kill(all[i]->pid, SIGTERM);
    for (int i = 0; i < 4; i++) {
        int status = 0;
        cr_assert_eq(waitpid(all[i]->pid, &status, 0), all[i]->pid);
        ((proc *)all[i])->pid = 0;
        cr_assert(WIFEXITED(status) && WEXITSTATUS(status) == 0, "rank %d did not stop "
                  "cleanly (status %d)", i, status);
    }
    /* every rank joined the exchange and served pairs of the others' rows */
    for (int i = 0; i < 4; i++) {
        cr_assert(log_has(all[i], "rank group: "), "no group stats in %s", all[i]->log);
        cr_assert(!log_has(all[i], " 0 pairs served"), "rank served nothing: %s", all[i]->log);
        cr_assert(!log_has(all[i], "leaving the rank group while it has work"), "%s",
                  all[i]->log);
    }
    assert_clean(&r);
    rig_stop(&r);
}

/* Decode rank 1 killed while rank 0 streams: the stream ends with an error naming rank 1
 * within seconds, rank 0 reports NOT_SERVING and refuses a new request, naming it too. */
Test(ep_serve, decode_rank_killed_mid_request)
{
    rig r = {0};
    proc dg[2];
    flight f;
    const char *const slow[] = {"--step-delay-ms", "20", NULL};
    decode_group_streaming(&r, dg, &f, slow, "k1", 64, 2000);
    proc_kill(&dg[1]);
    uint64_t t0 = di_mono_ns();
    di_error err;
    di_status st = flight_end(&f, &err);
    double waited = (double)(di_mono_ns() - t0) / 1e9;
    cr_assert_neq(st, DI_OK, "the stream finished although rank 1 died");
    cr_assert(strstr(err.msg, "rank 1"), "the error does not name rank 1: %s", err.msg);
    cr_assert_lt(waited, 15.0, "the failure took %.1f s", waited);
    cr_assert(!health_serving(&dg[0], "decode.Decode"), "rank 0 still reports SERVING");

    /* a new request is refused at once with the group's failure */
    rpc_client *pc = client(&r.prefill), *dc = client(&dg[0]);
    int ended = 0;
    Di__Prefill__PrefillReply *pr2 = prefill(pc, "k2", f.ids, 64, 5, 30000, &st, &err);
    cr_assert_not_null(pr2, "%s", err.msg);
    rpc_stream *s2 = decode_open(dc, "k2", f.ids, 64, pr2, 5);
    uint32_t got = stream_read(s2, 100, &ended, &st, &err);
    cr_assert(ended && got == 0 && st == DI_EUNAVAIL, "a new request: %u tokens, %s", got,
              di_status_name(st));
    cr_assert(strstr(err.msg, "rank 1"), "the refusal does not name rank 1: %s", err.msg);
    rpc_stream_close(s2);
    di__prefill__prefill_reply__free_unpacked(pr2, NULL);
    rpc_client_close(pc);
    rpc_client_close(dc);
    proc_stop(&dg[0]);
    rig_stop(&r);
}

/* SIGTERM to both ranks of a decode group while rank 0 streams: rank 1 has nothing of its own
 * to drain but keeps serving the exchange until rank 0's stream is done; both exit 0. */
Test(ep_serve, group_drains_together)
{
    rig r = {0};
    proc dg[2];
    flight f;
    const char *const slow[] = {"--step-delay-ms", "20", NULL};
    decode_group_streaming(&r, dg, &f, slow, "d1", 30, 60);
    kill(dg[1].pid, SIGTERM);
    kill(dg[0].pid, SIGTERM);
    int ended = 0;
    di_status st;
    di_error err;
    uint32_t got = stream_read(f.s, 1000, &ended, &st, &err);
    cr_assert(ended && st == DI_OK, "the stream: %s (%s)", di_status_name(st), err.msg);
    cr_assert_eq(got, 60 - 1 - 3, "%u more tokens", got); /* the first came from prefill */
    cr_assert_eq(flight_end(&f, &err), DI_OK, "%s", err.msg);
    for (int i = 0; i < 2; i++) {
        int status = 0;
        cr_assert_eq(waitpid(dg[i].pid, &status, 0), dg[i].pid);
        dg[i].pid = 0;
        cr_assert(WIFEXITED(status) && WEXITSTATUS(status) == 0, "rank %d: status %d", i,
                  status);
        cr_assert(!log_has(&dg[i], "ERROR"), "rank %d logged an error: %s", i, dg[i].log);
    }
    rig_stop(&r);
}

/* Decode rank 1 stopped (a hung rank, SIGSTOP) while rank 0 streams: rank 0 fails the stream at
 * the group's deadline, naming rank 1, and GetLoad says draining (the router's cue). */
Test(ep_serve, decode_rank_hung_fails_at_deadline)
{
    rig r = {0};
    proc dg[2];
    flight f;
    const char *const opts[] = {"--step-delay-ms", "20", "--ep-timeout", "3s", NULL};
    decode_group_streaming(&r, dg, &f, opts, "h1", 40, 2000);
    kill(dg[1].pid, SIGSTOP);
    uint64_t t0 = di_mono_ns();
    di_error err;
    di_status st = flight_end(&f, &err);
    double waited = (double)(di_mono_ns() - t0) / 1e9;
    proc_kill(&dg[1]);
    cr_assert_neq(st, DI_OK, "the stream finished although rank 1 hung");
    cr_assert(strstr(err.msg, "rank 1") && strstr(err.msg, "deadline"),
              "the error does not name rank 1 and the deadline: %s", err.msg);
    cr_assert(waited > 2.0 && waited < 20.0, "the failure took %.1f s (deadline 3 s)", waited);
    Di__Engine__Load l = get_load(&dg[0], "decode.Decode");
    cr_assert(l.draining, "GetLoad does not say draining");
    proc_stop(&dg[0]);
    rig_stop(&r);
}

typedef struct killer {
    proc *p;
    uint32_t delay_ms;
} killer;

static void *kill_later(void *arg)
{
    killer *k = arg;
    usleep(k->delay_ms * 1000u);
    proc_kill(k->p);
    return NULL;
}

/* Prefill rank 0 killed while rank 1 prefills a long prompt: rank 1 fails it naming rank 0. */
Test(ep_serve, prefill_rank0_killed_mid_request)
{
    rig r = {0};
    rig_start(&r, "1");
    proc pg[2];
    const char *const slow[] = {"--step-delay-ms", "250", NULL};
    group_start(pg, &r, "prefill/di-prefill", "eprefill", slow);
    rpc_client *pc = client(&pg[1]);
    static uint32_t ids[2048];
    prompt_ids(ids, 2048, 9);
    killer k = {&pg[0], 1000};
    pthread_t th;
    pthread_create(&th, NULL, kill_later, &k);
    di_status st;
    di_error err;
    uint64_t t0 = di_mono_ns();
    Di__Prefill__PrefillReply *pr = prefill(pc, "p1", ids, 2048, 5, 60000, &st, &err);
    double waited = (double)(di_mono_ns() - t0) / 1e9;
    pthread_join(th, NULL);
    cr_assert_null(pr, "the prefill finished although rank 0 died");
    cr_assert(strstr(err.msg, "rank 0"), "the error does not name rank 0: %s", err.msg);
    cr_assert_lt(waited, 16.0, "the failure took %.1f s", waited);
    cr_assert(!health_serving(&pg[1], "prefill.Prefill"), "rank 1 still reports SERVING");
    rpc_client_close(pc);
    proc_stop(&pg[1]);
    rig_stop(&r);
}

/* A rank with the wrong group token is refused (and says so); rank 0 keeps waiting, and the
 * group forms with the right rank. Then rank 1 stops alone: rank 0 stops serving, saying why. */
Test(ep_serve, wrong_group_token_refused)
{
    rig r = {0};
    rig_start(&r, "0");
    char addr[32], good[300], bad[300];
    snprintf(good, sizeof good, "%s/good.token", g_dir);
    snprintf(bad, sizeof bad, "%s/bad.token", g_dir);
    write_file(good, TOKEN "\n");
    write_file(bad, "not-the-group-token-at-all-0123456789\n");
    int lfd = group_listen(addr, sizeof addr);
    proc d0, intruder, d1;
    rank_spawn(&d0, &r, "decode/di-decode", "edecode0", 0, addr, lfd, good, NULL);
    close(lfd);
    rank_spawn(&intruder, &r, "decode/di-decode", "intruder", 1, addr, -1, bad, NULL);
    int status = 0;
    uint64_t until = di_mono_ns() + 60000000000ull;
    pid_t w = 0;
    while ((w = waitpid(intruder.pid, &status, WNOHANG)) == 0 && di_mono_ns() < until)
        usleep(20000);
    cr_assert_eq(w, intruder.pid, "the rank with the wrong token did not exit");
    intruder.pid = 0;
    close(intruder.ready_fd);
    cr_assert(WIFEXITED(status) && WEXITSTATUS(status) != 0, "it exited with status 0");
    cr_assert(log_has(&intruder, "wrong group token"), "no reason in %s", intruder.log);
    rank_spawn(&d1, &r, "decode/di-decode", "edecode1", 1, addr, -1, good, NULL);
    proc_ready(&d0, "edecode0");
    proc_ready(&d1, "edecode1");
    cr_assert(health_serving(&d0, "decode.Decode") && health_serving(&d1, "decode.Decode"));
    /* rank 1 stopped alone: rank 0's group ends with the reason, it stops serving */
    cr_assert_eq(proc_stop(&d1), 0);
    uint64_t until2 = di_mono_ns() + 10000000000ull;
    while (health_serving(&d0, "decode.Decode") && di_mono_ns() < until2)
        usleep(20000);
    cr_assert(!health_serving(&d0, "decode.Decode"), "rank 0 serves without its group");
    cr_assert(log_has(&d0, "rank 1 left the group (it stopped)"), "no reason in %s", d0.log);
    cr_assert_eq(proc_stop(&d0), 0);
    rig_stop(&r);
}

/* Group options that cannot work are refused at start with one line naming the option. */
static void refused(const char *args, const char *want)
{
    char cmd[1024], errp[300], buf[2048] = {0};
    snprintf(errp, sizeof errp, "%s/refused.err", g_dir);
    snprintf(cmd, sizeof cmd, "env -u DI_EP_TOKEN %s/decode/di-decode --config tiny --kvstore "
             "127.0.0.1:1 --listen 127.0.0.1:0 %s 2> %s", build_root(), args, errp);
    int rc = system(cmd);
    FILE *f = fopen(errp, "r");
    cr_assert(f);
    size_t n = fread(buf, 1, sizeof buf - 1, f);
    fclose(f);
    buf[n] = 0;
    cr_assert(WIFEXITED(rc) && WEXITSTATUS(rc) == 2, "%s: exit status %d (%s)", args, rc, buf);
    /* the failure is the last line (an informational line may come before it) */
    cr_assert(n > 0 && buf[n - 1] == '\n', "%s: no line: %s", args, buf);
    buf[n - 1] = 0;
    const char *last = strrchr(buf, '\n') ? strrchr(buf, '\n') + 1 : buf;
    cr_assert(!strncmp(last, "di-decode: ", 11) && strstr(last, want), "%s: '%s' not in: %s",
              args, want, last);
}

Test(ep_serve, bad_group_options_refused)
{
    char tok[300], args[600];
    snprintf(tok, sizeof tok, "%s/ep.token", g_dir);
    write_file(tok, TOKEN "\n");
    refused("--ep-addr 127.0.0.1:7000", "a rank group needs --world 2 or more");
    refused("--world 2 --ep-addr 127.0.0.1:7000", "the group token is missing");
    refused("--eplb-interval 5", "need --ep-addr");
    snprintf(args, sizeof args, "--rank 1 --world 2 --ep-addr 127.0.0.1:7000 --ep-token-file %s "
             "--ep-listen-fd 5", tok);
    refused(args, "--ep-listen-fd is rank 0's");
    snprintf(args, sizeof args, "--world 2 --ep-addr 127.0.0.1:7000 --ep-token-file %s "
             "--ep-timeout 1s --ep-idle 600", tok);
    refused(args, "--ep-idle: 600 ms is more than half of --ep-timeout");
    snprintf(args, sizeof args, "--world 2 --ep-addr 10.1.2.3:7000 --ep-token-file %s", tok);
    refused(args, "not a loopback address");
}
