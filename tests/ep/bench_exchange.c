/* bench_exchange: the CPU exchange of a rank group on this machine. W processes on loopback
 * (default 2, argv[1]); each round every rank sends every other rank `bytes` (argv[2], default
 * 4 MiB) through ep_group_alltoallv. Prints the measured payload rate per rank next to the
 * limit it cannot beat here, measured in the same run: one core's memcpy rate of the same
 * buffer (the star copies every byte through rank 0's socket buffers at least twice), and the
 * round latency of an empty all-to-all next to one vote (allreduce of one word).
 * Run: meson test -C build --benchmark --suite ep */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "common/ep/group.h"
#include "common/util/clock.h"

static double now_s(void) { return (double)di_mono_ns() / 1e9; }

static int rank_main(ep_group *g, uint64_t bytes, int rounds, double *rate, double *empty_us,
                     double *vote_us)
{
    uint32_t W = ep_group_world(g), R = ep_group_rank(g);
    uint8_t *buf = malloc(bytes * W);
    if (!buf)
        return 1;
    memset(buf, (int)R, bytes * W);
    ep_buf send[EP_MAX_WORLD], recv[EP_MAX_WORLD], none[EP_MAX_WORLD];
    for (uint32_t d = 0; d < W; d++) {
        send[d] = (ep_buf){buf + d * bytes, d == R ? 0 : bytes};
        none[d] = (ep_buf){NULL, 0};
    }
    di_error e;
    for (int i = 0; i < 3; i++) /* warm-up */
        if (ep_group_alltoallv(g, send, recv, &e) != DI_OK)
            return 2;
    double t0 = now_s();
    for (int i = 0; i < rounds; i++)
        if (ep_group_alltoallv(g, send, recv, &e) != DI_OK)
            return 3;
    double dt = now_s() - t0;
    *rate = (double)bytes * (W - 1) * rounds / dt; /* bytes this rank sent per second */
    t0 = now_s();
    for (int i = 0; i < 200; i++)
        if (ep_group_alltoallv(g, none, recv, &e) != DI_OK)
            return 4;
    *empty_us = (now_s() - t0) / 200 * 1e6;
    t0 = now_s();
    for (int i = 0; i < 200; i++) {
        uint64_t v = 1;
        if (ep_group_allreduce(g, EP_REDUCE_OR, &v, 1, &e) != DI_OK)
            return 5;
    }
    *vote_us = (now_s() - t0) / 200 * 1e6;
    free(buf);
    return 0;
}

int main(int argc, char **argv)
{
    uint32_t W = argc > 1 ? (uint32_t)atoi(argv[1]) : 2;
    uint64_t bytes = argc > 2 ? strtoull(argv[2], NULL, 10) : (4u << 20);
    int rounds = 20;
    if (W < 2 || W > 16 || bytes == 0 || bytes > (64u << 20)) {
        fprintf(stderr, "usage: bench_exchange [RANKS 2..16] [BYTES <= 64 MiB]\n");
        return 2;
    }
    /* the limit: one core copying the same bytes */
    uint8_t *a = malloc(bytes), *b = malloc(bytes);
    memset(a, 1, bytes);
    memset(b, 2, bytes);
    double t0 = now_s();
    for (int i = 0; i < rounds * 4; i++) {
        memcpy(b, a, bytes);
        a[i % bytes] ^= b[(i * 7) % bytes];
    }
    double memcpy_rate = (double)bytes * rounds * 4 / (now_s() - t0);
    free(a);
    free(b);
    int lfd;
    uint16_t port;
    di_error e;
    if (ep_group_listen("127.0.0.1:0", false, &lfd, &port, &e) != DI_OK) {
        fprintf(stderr, "bench_exchange: %s\n", e.msg);
        return 1;
    }
    char addr[64];
    snprintf(addr, sizeof addr, "127.0.0.1:%u", port);
    ep_group_options o = {.addr = addr, .listen_fd = -1, .world = W,
                          .token = "bench-exchange-group-token", .timeout_ms = 60000};
    pid_t pids[16];
    for (uint32_t r = 1; r < W; r++) {
        pids[r] = fork();
        if (pids[r] == 0) {
            close(lfd);
            ep_group *g;
            o.rank = r;
            double x, y, z;
            if (ep_group_join(&o, &g, &e) != DI_OK)
                _exit(10);
            int rc = rank_main(g, bytes, rounds, &x, &y, &z);
            ep_group_close(g);
            _exit(rc);
        }
    }
    o.rank = 0;
    o.listen_fd = lfd;
    ep_group *g;
    if (ep_group_join(&o, &g, &e) != DI_OK) {
        fprintf(stderr, "bench_exchange: %s\n", e.msg);
        return 1;
    }
    double rate, empty_us, vote_us;
    int rc = rank_main(g, bytes, rounds, &rate, &empty_us, &vote_us);
    ep_group_close(g);
    for (uint32_t r = 1; r < W; r++) {
        int ws;
        waitpid(pids[r], &ws, 0);
        if (!WIFEXITED(ws) || WEXITSTATUS(ws) != 0)
            rc = rc ? rc : 20;
    }
    if (rc) {
        fprintf(stderr, "bench_exchange: a rank failed (%d)\n", rc);
        return 1;
    }
    printf("bench_exchange: %u ranks, %.1f MiB to each peer a round: rank 0 sends %.2f GB/s "
           "(one core's memcpy of the same buffer: %.2f GB/s, %.1f%% of it)\n", W,
           (double)bytes / (1 << 20), rate / 1e9, memcpy_rate / 1e9,
           100.0 * rate / memcpy_rate);
    printf("bench_exchange: empty all-to-all round %.1f us, one vote %.1f us (loopback TCP "
           "through rank 0)\n", empty_us, vote_us);
    return 0;
}
