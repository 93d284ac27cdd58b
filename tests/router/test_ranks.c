/* The rank table's heartbeat poller against ranks in processes of their own (fake_rank), in a
 * process that runs no gRPC server (so nothing but the table drives its channels): a rank
 * killed and restarted on the same port is back in rotation within 2 s of answering again,
 * while the other rank's heartbeats and load kept coming. */
#include <criterion/criterion.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

#include "common/util/clock.h"
#include "proc.h"
#include "router/ranks.h"

#define ENGINE_TOKEN "engine-token-0123456789"
#define HEARTBEAT_MS 1000u

/* Starts fake_rank for role on port (0: any); its port in *port. */
static pid_t fake_up(pl_role role, int *port)
{
    char portarg[16];
    snprintf(portarg, sizeof portarg, "%d", *port);
    char *args[] = {"fake_rank", role == PL_PREFILL ? "prefill" : "decode", portarg, NULL,
                    ENGINE_TOKEN, NULL};
    return proc_start_ready(proc_bin("tests/router/fake_rank"), args, 3, port);
}

static void fake_kill(pid_t pid)
{
    kill(pid, SIGKILL);
    int ws;
    waitpid(pid, &ws, 0);
}

static pl_rank rank_of(rk_table *t, size_t idx)
{
    pl_rank r;
    cr_assert(rk_rank(t, idx, &r));
    return r;
}

/* Waits up to ms for rank idx to reach health h; the seconds it took. */
static double wait_health(rk_table *t, size_t idx, pl_health h, uint32_t ms)
{
    uint64_t t0 = di_mono_ns();
    while (rk_health(t, idx) != h && di_mono_ns() - t0 < (uint64_t)ms * 1000000ull)
        usleep(5000);
    cr_assert_eq(rk_health(t, idx), h, "rank %zu: %s after %u ms, want %s", idx,
                 pl_health_name(rk_health(t, idx)), ms, pl_health_name(h));
    return (double)(di_mono_ns() - t0) / 1e9;
}

Test(ranks, a_restarted_rank_is_back_within_2_s_while_the_others_keep_reporting,
     .timeout = 90)
{
    int pport = 0, dport = 0;
    pid_t pre = fake_up(PL_PREFILL, &pport);
    pid_t dec = fake_up(PL_DECODE, &dport);
    rk_config rc = {.placement = pl_config_default(), .policy = PL_POLICY_ESTIMATE,
                    .engine_token = ENGINE_TOKEN};
    rc.placement.heartbeat_ns = HEARTBEAT_MS * 1000000ull; /* the default interval */
    rc.placement.suspect_after = 1;                         /* out after 2 missed: sooner */
    rc.placement.out_after = 2;
    rk_table *t = NULL;
    di_error e = {0};
    cr_assert_eq(rk_new(&rc, &t, &e), DI_OK, "%s", e.msg);
    char addr[32];
    snprintf(addr, sizeof addr, "127.0.0.1:%d", pport);
    cr_assert_eq(rk_add(t, PL_PREFILL, addr, false, NULL, &e), DI_OK, "%s", e.msg); /* 0 */
    snprintf(addr, sizeof addr, "127.0.0.1:%d", dport);
    cr_assert_eq(rk_add(t, PL_DECODE, addr, false, NULL, &e), DI_OK, "%s", e.msg); /* 1 */
    uint64_t polls = rk_polls(t);
    for (int i = 0; i < 2000 && rk_polls(t) < polls + 2; i++)
        usleep(5000);
    cr_assert_eq(rk_health(t, 0), PL_HEALTHY);
    cr_assert_eq(rk_health(t, 1), PL_HEALTHY);
    /* The prefill rank dies: out of rotation after 2 missed heartbeats; staying down a while
     * longer lets the channel's reconnection back-off reach its longest (1 s). */
    uint32_t before = rank_of(t, 1).load.running;
    fake_kill(pre);
    wait_health(t, 0, PL_OUT, 20000);
    usleep(1200000);
    pl_rank d = rank_of(t, 1);
    cr_expect_geq(d.load.running, before + 2, "the decode rank's load stopped updating while "
                  "the prefill rank was down (%u -> %u)", before, d.load.running);
    cr_expect_lt(di_mono_ns() - d.last_beat_ns, 3ull * HEARTBEAT_MS * 1000000ull,
                 "the decode rank's last heartbeat is old");
    /* Back on the same port: in rotation again (2 good heartbeats) within 2 s. */
    pre = fake_up(PL_PREFILL, &pport);
    double secs = wait_health(t, 0, PL_HEALTHY, 10000);
    fprintf(stderr, "ranks: the restarted rank was back in rotation %.3f s after it answered "
            "again (heartbeat %u ms)\n", secs, HEARTBEAT_MS);
    cr_expect_lt(secs, 2.0, "back in rotation only %.3f s after answering again", secs);
    cr_expect_eq(rk_health(t, 1), PL_HEALTHY);
    rk_free(t);
    fake_kill(pre);
    fake_kill(dec);
}
