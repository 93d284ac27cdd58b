/* The rank group across processes: rendezvous of 2 and 4 ranks, the vote and the all-to-all,
 * a wrong token, a rank that dies or is killed (named by every rank), a rank that hangs,
 * lockstep lost, bad options. */
#include <criterion/criterion.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "common/ep/group.h"
#include "common/util/clock.h"

static const char *TOKEN = "0123456789abcdef-group-token";

typedef int (*rank_fn)(ep_group *g, void *ud);

/* Binds rank 0's socket on loopback and writes its address. */
static int listen_any(char addr[64])
{
    int fd;
    uint16_t port;
    di_error e;
    cr_assert_eq(ep_group_listen("127.0.0.1:0", false, &fd, &port, &e), DI_OK, "%s", e.msg);
    snprintf(addr, 64, "127.0.0.1:%u", port);
    return fd;
}

static ep_group_options opts(const char *addr, int lfd, uint32_t rank, uint32_t world,
                             uint32_t timeout_ms)
{
    return (ep_group_options){.addr = addr, .listen_fd = lfd, .rank = rank, .world = world,
                              .token = TOKEN, .timeout_ms = timeout_ms};
}

/* Forks a rank: joins with o and runs fn; the exit status is fn's (100 + join failure). */
static pid_t fork_rank(ep_group_options o, rank_fn fn, void *ud)
{
    pid_t pid = fork();
    cr_assert(pid >= 0);
    if (pid == 0) {
        ep_group *g;
        di_error e;
        di_status st = ep_group_join(&o, &g, &e);
        if (st != DI_OK) {
            fprintf(stderr, "rank %u: %s\n", o.rank, e.msg);
            _exit(st == DI_EAUTH ? 99 : 100);
        }
        int rc = fn ? fn(g, ud) : 0;
        ep_group_close(g);
        _exit(rc);
    }
    return pid;
}

/* Forks ranks 1..world-1 of a group on loopback, rank r running fns[r], and joins as rank 0
 * (every rank with deadline timeout_ms); pids[r] receives rank r's process. */
static ep_group *start_group(uint32_t world, uint32_t timeout_ms, const rank_fn *fns,
                             pid_t *pids)
{
    char addr[64];
    int lfd = listen_any(addr);
    for (uint32_t r = 1; r < world; r++)
        pids[r] = fork_rank(opts(addr, -1, r, world, timeout_ms), fns[r], NULL);
    ep_group *g;
    di_error e;
    ep_group_options o = opts(addr, lfd, 0, world, timeout_ms);
    cr_assert_eq(ep_group_join(&o, &g, &e), DI_OK, "%s", e.msg);
    return g;
}

static int wait_rank(pid_t pid)
{
    int ws;
    cr_assert_eq(waitpid(pid, &ws, 0), pid);
    return WIFEXITED(ws) ? WEXITSTATUS(ws) : 128 + WTERMSIG(ws);
}

/* ---- the script every rank runs ---- */

static bool flag_of(uint32_t rank, int i) { return ((i * 7 + rank * 3) % 5) != 0; }
static uint64_t len_of(uint32_t s, uint32_t d, int i) { return (s * 7u + d * 3u + (uint32_t)i) % 50; }
static uint8_t byte_of(uint32_t s, uint32_t d, uint64_t k) { return (uint8_t)(s * 31 + d * 17 + k); }

static int script(ep_group *g, void *ud)
{
    (void)ud;
    uint32_t R = ep_group_rank(g), W = ep_group_world(g);
    vote v = ep_group_vote(g);
    di_error e;
    for (int i = 0; i < 20; i++) {
        bool all = true, any = false, out;
        for (uint32_t r = 0; r < W; r++) {
            all &= flag_of(r, i);
            any |= flag_of(r, i);
        }
        if (v.all(v.userdata, flag_of(R, i), &out, &e) != DI_OK || out != all)
            return 1;
        if (v.any(v.userdata, flag_of(R, i), &out, &e) != DI_OK || out != any)
            return 2;
        uint64_t vals[3] = {R + 1, (uint64_t)i * R, R == W - 1 ? 1000 : R};
        if (ep_group_allreduce(g, EP_REDUCE_SUM, vals, 2, &e) != DI_OK ||
            vals[0] != (uint64_t)W * (W + 1) / 2 || vals[1] != (uint64_t)i * W * (W - 1) / 2)
            return 3;
        if (ep_group_allreduce(g, EP_REDUCE_MAX, &vals[2], 1, &e) != DI_OK || vals[2] != 1000)
            return 4;
        uint8_t data[EP_MAX_WORLD][64];
        ep_buf send[EP_MAX_WORLD], recv[EP_MAX_WORLD];
        for (uint32_t d = 0; d < W; d++) {
            send[d] = (ep_buf){data[d], len_of(R, d, i)};
            for (uint64_t k = 0; k < send[d].len; k++)
                data[d][k] = byte_of(R, d, k);
        }
        if (ep_group_alltoallv(g, send, recv, &e) != DI_OK)
            return 5;
        for (uint32_t s = 0; s < W; s++) {
            if (recv[s].len != len_of(s, R, i))
                return 6;
            for (uint64_t k = 0; k < recv[s].len; k++)
                if (((const uint8_t *)recv[s].data)[k] != byte_of(s, R, k))
                    return 7;
        }
    }
    return 0;
}

static void run_group(uint32_t world)
{
    char addr[64];
    int lfd = listen_any(addr);
    pid_t pids[8];
    for (uint32_t r = 1; r < world; r++)
        pids[r] = fork_rank(opts(addr, -1, r, world, 20000), script, NULL);
    ep_group *g;
    di_error e;
    ep_group_options o = opts(addr, lfd, 0, world, 20000);
    cr_assert_eq(ep_group_join(&o, &g, &e), DI_OK, "%s", e.msg);
    cr_expect_eq(script(g, NULL), 0);
    ep_group_stats s = ep_group_get_stats(g);
    cr_expect_eq(s.rounds, 20 * 5);
    cr_expect_eq(s.refused, 0);
    ep_group_close(g);
    for (uint32_t r = 1; r < world; r++)
        cr_expect_eq(wait_rank(pids[r]), 0, "rank %u", r);
}

Test(ep_group, two_ranks_vote_reduce_and_exchange, .timeout = 60) { run_group(2); }
Test(ep_group, four_ranks_vote_reduce_and_exchange, .timeout = 60) { run_group(4); }

Test(ep_group, one_rank_needs_no_network)
{
    ep_group_options o = opts(NULL, -1, 0, 1, 1000);
    ep_group *g;
    di_error e;
    cr_assert_eq(ep_group_join(&o, &g, &e), DI_OK, "%s", e.msg);
    cr_expect_eq(script(g, NULL), 0);
    ep_group_close(g);
}

static int refused_two_then_script(ep_group *g, void *ud)
{
    (void)ud;
    return ep_group_get_stats(g).refused == 2 ? script(g, NULL) : 77;
}

Test(ep_group, wrong_token_is_refused_and_the_right_rank_still_joins, .timeout = 60)
{
    char addr[64];
    int lfd = listen_any(addr);
    /* rank 0 gathers in a process of its own while the intruders knock one after the other */
    pid_t root = fork_rank(opts(addr, lfd, 0, 2, 30000), refused_two_then_script, NULL);
    close(lfd);
    ep_group_options bad = opts(addr, -1, 1, 2, 20000);
    bad.token = "not-the-group-token-at-all";
    cr_assert_eq(wait_rank(fork_rank(bad, NULL, NULL)), 99,
                 "a wrong token must be refused with DI_EAUTH");
    ep_group_options wrong_world = opts(addr, -1, 1, 3, 20000);
    cr_assert_eq(wait_rank(fork_rank(wrong_world, NULL, NULL)), 99);
    pid_t good = fork_rank(opts(addr, -1, 1, 2, 20000), script, NULL);
    cr_expect_eq(wait_rank(good), 0);
    cr_expect_eq(wait_rank(root), 0, "rank 0 must have refused two and then run the script");
}

Test(ep_group, incomplete_group_times_out_at_the_deadline, .timeout = 60)
{
    char addr[64];
    int lfd = listen_any(addr);
    ep_group_options o = opts(addr, lfd, 0, 3, 300);
    pid_t one = fork_rank(opts(addr, -1, 1, 3, 5000), NULL, NULL);
    ep_group *g;
    di_error e;
    uint64_t t0 = di_mono_ns();
    cr_assert_eq(ep_group_join(&o, &g, &e), DI_ETIMEDOUT);
    cr_expect(strstr(e.msg, "1 of 3") || strstr(e.msg, "2 of 3"), "%s", e.msg);
    cr_expect_lt(di_mono_ns() - t0, 4000000000ull);
    /* the rank that had joined sees rank 0 go away */
    cr_expect_eq(wait_rank(one), 100);
}

static int hang(ep_group *g, void *ud)
{
    (void)g;
    (void)ud;
    pause(); /* alive but silent, until killed */
    return 0;
}

static int die_at_once(ep_group *g, void *ud)
{
    (void)g;
    (void)ud;
    return 0; /* exits without a single collective */
}

/* Exit code of a rank that saw a collective fail: 42 for status want naming rank 2 (the one
 * that died or hangs), 44 for want naming another, 43 for another status, 0 for none. */
static int named_rank2_as(di_status want, di_status st, const di_error *e)
{
    if (st == DI_OK)
        return 0;
    const char *at = strstr(e->msg, "rank 2");
    if (st != want || !at || (at[6] >= '0' && at[6] <= '9')) {
        fprintf(stderr, "%s: %s\n", di_status_name(st), e->msg);
        return st == want ? 44 : 43;
    }
    return 42;
}

static int named_rank2(di_status st, const di_error *e)
{
    return named_rank2_as(DI_EIO, st, e);
}

static int reduce_once(ep_group *g, void *ud)
{
    (void)ud;
    uint64_t v = 1;
    di_error e;
    return named_rank2(ep_group_allreduce(g, EP_REDUCE_SUM, &v, 1, &e), &e);
}

Test(ep_group, a_rank_dying_fails_the_others_at_once, .timeout = 60)
{
    uint32_t timeout = 30000;
    pid_t pids[3];
    ep_group *g = start_group(3, timeout, (rank_fn[]){NULL, reduce_once, die_at_once}, pids);
    di_error e;
    uint64_t t0 = di_mono_ns();
    uint64_t v = 1;
    cr_assert_eq(ep_group_allreduce(g, EP_REDUCE_SUM, &v, 1, &e), DI_EIO);
    cr_expect(strstr(e.msg, "rank 2") != NULL, "%s", e.msg);
    /* the failure is seen at once, long before the deadline */
    cr_expect_lt(di_mono_ns() - t0, (uint64_t)timeout * 1000000ull / 3);
    /* later calls fail with the first failure's message */
    cr_expect_eq(ep_group_allreduce(g, EP_REDUCE_SUM, &v, 1, &e), DI_ECANCELED);
    cr_expect(strstr(e.msg, "rank 2") != NULL, "%s", e.msg);
    ep_group_close(g);
    cr_expect_eq(wait_rank(pids[2]), 0);
    cr_expect_eq(wait_rank(pids[1]), 42, "rank 1 must fail with DI_EIO naming rank 2");
}

Test(ep_group, a_silent_rank_times_out_within_the_deadline, .timeout = 60)
{
    char addr[64];
    int lfd = listen_any(addr);
    pid_t r1 = fork_rank(opts(addr, -1, 1, 2, 20000), hang, NULL);
    ep_group *g;
    di_error e;
    ep_group_options o = opts(addr, lfd, 0, 2, 400);
    cr_assert_eq(ep_group_join(&o, &g, &e), DI_OK, "%s", e.msg);
    uint64_t t0 = di_mono_ns();
    bool out;
    vote v = ep_group_vote(g);
    cr_expect_eq(v.any_work(v.userdata, true, &out, &e), DI_ETIMEDOUT);
    uint64_t dt = di_mono_ns() - t0;
    cr_expect_geq(dt, 350000000ull);
    cr_expect_lt(dt, 10000000000ull);
    ep_group_close(g);
    kill(r1, SIGKILL);
    cr_expect_eq(wait_rank(r1), 128 + SIGKILL);
}

/* Bytes each rank sends each other rank in the all-to-all of the test below: more than the
 * socket buffers hold, so that a rank is still writing when rank 0 gives up. */
#define BIG_SEGMENT (4u << 20)

static int big_exchange(ep_group *g, void *ud)
{
    (void)ud;
    uint32_t W = ep_group_world(g);
    uint8_t *data = calloc(1, BIG_SEGMENT);
    if (!data)
        return 45;
    ep_buf send[EP_MAX_WORLD], recv[EP_MAX_WORLD];
    for (uint32_t d = 0; d < W; d++)
        send[d] = (ep_buf){data, BIG_SEGMENT};
    di_error e;
    int rc = named_rank2(ep_group_alltoallv(g, send, recv, &e), &e);
    free(data);
    return rc;
}

/* Rank 2 of 4 is killed: rank 0 sees its connection end and names it, and ranks 1 and 3, which
 * only talk to rank 0, must name rank 2 too (not rank 0, whose connection closes next), also
 * rank 3, which is still writing its frame when rank 0 gives up. */
Test(ep_group, a_killed_rank_is_named_by_every_rank, .timeout = 60)
{
    uint32_t timeout = 30000;
    pid_t pids[4];
    ep_group *g = start_group(4, timeout,
                              (rank_fn[]){NULL, big_exchange, hang, big_exchange}, pids);
    kill(pids[2], SIGKILL);
    cr_expect_eq(wait_rank(pids[2]), 128 + SIGKILL);
    uint64_t t0 = di_mono_ns();
    cr_expect_eq(big_exchange(g, NULL), 42);
    ep_group_close(g);
    cr_expect_eq(wait_rank(pids[1]), 42, "rank 1 must fail with DI_EIO naming rank 2");
    cr_expect_eq(wait_rank(pids[3]), 42, "rank 3 must fail with DI_EIO naming rank 2");
    cr_expect_lt(di_mono_ns() - t0, (uint64_t)timeout * 1000000ull / 3);
}

static int reduce_until_timeout(ep_group *g, void *ud)
{
    (void)ud;
    uint64_t v = 1;
    di_error e;
    return named_rank2_as(DI_ETIMEDOUT, ep_group_allreduce(g, EP_REDUCE_SUM, &v, 1, &e), &e);
}

/* Rank 2 of 3 hangs: rank 0 reaches its deadline first (the others wait a quarter longer) and
 * names rank 2, and so does rank 1, at about the same time. */
Test(ep_group, a_silent_rank_is_named_by_every_rank, .timeout = 60)
{
    uint32_t timeout = 4000; /* the others wait 1 s longer: a margin for a loaded machine */
    pid_t pids[3];
    ep_group *g = start_group(3, timeout, (rank_fn[]){NULL, reduce_until_timeout, hang}, pids);
    uint64_t t0 = di_mono_ns();
    cr_expect_eq(reduce_until_timeout(g, NULL), 42);
    cr_expect_eq(wait_rank(pids[1]), 42, "rank 1 must fail with DI_ETIMEDOUT naming rank 2");
    cr_expect_lt(di_mono_ns() - t0, 3ull * timeout * 1000000ull);
    ep_group_close(g);
    kill(pids[2], SIGKILL);
    cr_expect_eq(wait_rank(pids[2]), 128 + SIGKILL);
}

static int vote_or(ep_group *g, void *ud)
{
    (void)ud;
    vote v = ep_group_vote(g);
    bool out;
    di_error e;
    return v.any(v.userdata, true, &out, &e) == DI_OK ? 0 : 5;
}

Test(ep_group, different_collectives_are_lockstep_lost, .timeout = 60)
{
    char addr[64];
    int lfd = listen_any(addr);
    pid_t r1 = fork_rank(opts(addr, -1, 1, 2, 20000), vote_or, NULL);
    ep_group *g;
    di_error e;
    ep_group_options o = opts(addr, lfd, 0, 2, 20000);
    cr_assert_eq(ep_group_join(&o, &g, &e), DI_OK, "%s", e.msg);
    vote v = ep_group_vote(g);
    bool out;
    cr_expect_eq(v.all(v.userdata, true, &out, &e), DI_EINTERNAL);
    cr_expect(strstr(e.msg, "lockstep lost") != NULL, "%s", e.msg);
    ep_group_close(g);
    cr_expect_eq(wait_rank(r1), 5);
}

Test(ep_group, bad_options_are_refused)
{
    ep_group *g;
    di_error e;
    ep_group_options o = opts("127.0.0.1:1", -1, 0, 0, 1000);
    cr_expect_eq(ep_group_join(&o, &g, &e), DI_EINVAL);
    o = opts("127.0.0.1:1", -1, 2, 2, 1000);
    cr_expect_eq(ep_group_join(&o, &g, &e), DI_EINVAL);
    o = opts("127.0.0.1:1", -1, 1, 2, 1000);
    o.token = "short";
    cr_expect_eq(ep_group_join(&o, &g, &e), DI_EINVAL);
    o = opts("127.0.0.1:1", -1, 1, 2, 0);
    cr_expect_eq(ep_group_join(&o, &g, &e), DI_EINVAL);
    o = opts("10.1.2.3:5000", -1, 1, 2, 1000);
    cr_expect_eq(ep_group_join(&o, &g, &e), DI_EINVAL);
    cr_expect(strstr(e.msg, "loopback") != NULL, "%s", e.msg);
    o = opts("127.0.0.1:99999", -1, 1, 2, 1000);
    cr_expect_eq(ep_group_join(&o, &g, &e), DI_EINVAL);
    int fd;
    uint16_t port;
    cr_expect_eq(ep_group_listen("0.0.0.0:0", false, &fd, &port, &e), DI_EINVAL);
}

Test(ep_group, frames_above_the_bound_are_refused)
{
    ep_group_options o = opts(NULL, -1, 0, 1, 1000);
    o.max_frame = 64;
    ep_group *g;
    di_error e;
    cr_assert_eq(ep_group_join(&o, &g, &e), DI_OK, "%s", e.msg);
    uint8_t big[128] = {0};
    ep_buf send[1] = {{big, sizeof big}}, recv[1];
    cr_expect_eq(ep_group_alltoallv(g, send, recv, &e), DI_ERANGE);
    uint64_t vals[16] = {0};
    cr_expect_eq(ep_group_allreduce(g, EP_REDUCE_SUM, vals, 16, &e), DI_EINVAL);
    ep_group_close(g);
}

Test(ep_group, rank_from_a_statefulset_host_name)
{
    uint32_t r = 99;
    di_error e;
    cr_expect_eq(ep_rank_from_hostname("ep-decode-3", &r, &e), DI_OK);
    cr_expect_eq(r, 3);
    cr_expect_eq(ep_rank_from_hostname("prefill-0", &r, &e), DI_OK);
    cr_expect_eq(r, 0);
    cr_expect_eq(ep_rank_from_hostname("node255", &r, &e), DI_OK);
    cr_expect_eq(r, 255);
    r = 7;
    cr_expect_eq(ep_rank_from_hostname("ep-decode", &r, &e), DI_EINVAL);
    cr_expect(strstr(e.msg, "ep-decode") != NULL, "%s", e.msg);
    cr_expect_eq(ep_rank_from_hostname("ep-256", &r, &e), DI_EINVAL);
    cr_expect_eq(ep_rank_from_hostname("ep-99999999999999999999", &r, &e), DI_EINVAL);
    cr_expect_eq(ep_rank_from_hostname("", &r, &e), DI_EINVAL);
    cr_expect_eq(r, 7, "untouched on failure");
}
