/* ep_peer_bw: the GPU-to-GPU bandwidth of this machine, the limit the expert-parallel exchange
 * runs against (tests/gpu/ep_bench.sh prints it next to the exchange's own rate).
 *
 *   ep_peer_bw [GPUS] [MIB]
 *
 * For every ordered pair of the first GPUS devices (default: all), a copy of MIB MiB (default
 * 256) from one to the other alone (cudaMemcpyPeerAsync, peer access on where the devices
 * allow it), best of 3; then all pairs at once, one stream a pair (the traffic of an
 * all-to-all): each GPU's outgoing rate. Prints one JSON object. Exit 2 on a bad argument or
 * fewer than 2 GPUs, 1 on a CUDA failure. */
#include <cuda_runtime_api.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

enum { MAX_GPUS = 16, RUNS = 3 };

static double now_s(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec / 1e9;
}

static int check(cudaError_t e, const char *what)
{
    if (e == cudaSuccess)
        return 0;
    fprintf(stderr, "ep_peer_bw: %s: %s\n", what, cudaGetErrorString(e));
    return 1;
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

static int sync_all(int n)
{
    for (int d = 0; d < n; d++)
        if (check(cudaSetDevice(d), "cudaSetDevice") || check(cudaDeviceSynchronize(), "sync"))
            return 1;
    return 0;
}

int main(int argc, char **argv)
{
    if (argc > 1 && (!strcmp(argv[1], "--help") || !strcmp(argv[1], "-h"))) {
        printf("usage: ep_peer_bw [GPUS] [MIB]: GPU-to-GPU copy bandwidth, each pair alone and "
               "all pairs at once (JSON)\n");
        return 0;
    }
    int have = 0;
    if (check(cudaGetDeviceCount(&have), "cudaGetDeviceCount"))
        return 1;
    long n = argc > 1 ? strtol(argv[1], NULL, 10) : have;
    long mib = argc > 2 ? strtol(argv[2], NULL, 10) : 256;
    if (n < 2 || n > have || n > MAX_GPUS || mib < 1 || mib > 4096) {
        fprintf(stderr, "ep_peer_bw: %ld GPUs of %d (2..%d) and %ld MiB (1..4096)\n", n, have,
                MAX_GPUS, mib);
        return 2;
    }
    size_t bytes = (size_t)mib << 20;
    void *src[MAX_GPUS], *dst[MAX_GPUS][MAX_GPUS];
    cudaStream_t st[MAX_GPUS][MAX_GPUS];
    memset(dst, 0, sizeof dst);
    for (int a = 0; a < n; a++) {
        if (check(cudaSetDevice(a), "cudaSetDevice") ||
            check(cudaMalloc(&src[a], bytes), "cudaMalloc") ||
            check(cudaMemset(src[a], a + 1, bytes), "cudaMemset"))
            return 1;
        for (int b = 0; b < n; b++) {
            if (a == b)
                continue;
            int ok = 0;
            cudaDeviceCanAccessPeer(&ok, a, b);
            if (ok)
                cudaDeviceEnablePeerAccess(b, 0); /* already enabled is fine */
            cudaGetLastError();
            if (check(cudaMalloc(&dst[a][b], bytes), "cudaMalloc") ||
                check(cudaStreamCreate(&st[a][b]), "cudaStreamCreate"))
                return 1;
        }
    }
    /* dst[a][b] lives on device a and receives from b; the copy runs on b's stream to a */
    double pair[MAX_GPUS * MAX_GPUS];
    int np = 0;
    for (int a = 0; a < n; a++)
        for (int b = 0; b < n; b++) {
            if (a == b)
                continue;
            double best = 1e30;
            for (int r = 0; r < RUNS; r++) {
                if (sync_all((int)n))
                    return 1;
                double t0 = now_s();
                cudaSetDevice(b);
                if (check(cudaMemcpyPeerAsync(dst[a][b], a, src[b], b, bytes, st[b][a]),
                          "cudaMemcpyPeerAsync") ||
                    check(cudaStreamSynchronize(st[b][a]), "cudaStreamSynchronize"))
                    return 1;
                double t = now_s() - t0;
                best = t < best ? t : best;
            }
            pair[np++] = (double)bytes / best / 1e9;
        }
    qsort(pair, (size_t)np, sizeof pair[0], cmp_double);
    double all_best = 1e30;
    for (int r = 0; r < RUNS; r++) {
        if (sync_all((int)n))
            return 1;
        double t0 = now_s();
        for (int a = 0; a < n; a++)
            for (int b = 0; b < n; b++) {
                if (a == b)
                    continue;
                cudaSetDevice(b);
                if (check(cudaMemcpyPeerAsync(dst[a][b], a, src[b], b, bytes, st[b][a]),
                          "cudaMemcpyPeerAsync"))
                    return 1;
            }
        if (sync_all((int)n))
            return 1;
        double t = now_s() - t0;
        all_best = t < all_best ? t : all_best;
    }
    printf("{\"gpus\": %ld, \"mib\": %ld, \"pair_gbs_min\": %.1f, \"pair_gbs_median\": %.1f, "
           "\"pair_gbs_max\": %.1f, \"alltoall_gbs_per_gpu\": %.1f}\n",
           n, mib, pair[0], pair[np / 2], pair[np - 1],
           (double)bytes * (double)(n - 1) / all_best / 1e9);
    return 0;
}
