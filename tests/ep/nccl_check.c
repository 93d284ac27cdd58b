/* ep_nccl_check: the NCCL exchange of a group on a GPU machine (not a CI test: CI has no GPU).
 * Joins a group of one rank (or --rank/--world/--addr with $DI_EP_TOKEN, one process per GPU),
 * makes the communicator, exchanges counts, then an all-to-all of a patterned buffer, and
 * checks every byte that arrived. Exit 0 when all of it holds. */
#include <cuda_runtime_api.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/ep/nccl_xport.h"

static uint8_t pattern(uint32_t src, uint32_t dst, uint64_t k)
{
    return (uint8_t)(src * 73 + dst * 29 + k * 7 + (k >> 9));
}

int main(int argc, char **argv)
{
    uint32_t rank = 0, world = 1;
    const char *addr = NULL;
    for (int i = 1; i + 1 < argc; i += 2) {
        if (!strcmp(argv[i], "--rank"))
            rank = (uint32_t)atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "--world"))
            world = (uint32_t)atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "--addr"))
            addr = argv[i + 1];
    }
    const char *tok = getenv("DI_EP_TOKEN");
    ep_group_options go = {.addr = addr, .listen_fd = -1, .rank = rank, .world = world,
                           .token = tok ? tok : "a group of one rank only", .timeout_ms = 30000};
    ep_group *g;
    ep_nccl *x;
    di_error e;
    if (ep_group_join(&go, &g, &e) != DI_OK) {
        fprintf(stderr, "ep_nccl_check: %s\n", e.msg);
        return 1;
    }
    int ndev = 0;
    cudaGetDeviceCount(&ndev);
    if (ndev == 0 || ep_nccl_open(g, (int)(rank % (uint32_t)ndev), 30000, &x, &e) != DI_OK) {
        fprintf(stderr, "ep_nccl_check: rank %u: %s\n", rank, ndev ? e.msg : "no GPU");
        return 1;
    }
    const uint64_t per = 3u << 20; /* bytes to each peer */
    uint64_t W = world, total = per * W;
    uint8_t *h_send = malloc(total), *h_recv = malloc(total);
    uint64_t *off = malloc(W * 8), *len = malloc(W * 8), *cnt = malloc(W * 8);
    for (uint64_t d = 0; d < W; d++) {
        off[d] = d * per;
        len[d] = per - d; /* a different size to each peer */
        for (uint64_t k = 0; k < per; k++)
            h_send[d * per + k] = pattern(rank, (uint32_t)d, k);
    }
    void *d_send, *d_recv, *d_cnt_s, *d_cnt_r;
    cudaStream_t s;
    cudaStreamCreate(&s);
    cudaMalloc(&d_send, total);
    cudaMalloc(&d_recv, total);
    cudaMalloc(&d_cnt_s, W * 8);
    cudaMalloc(&d_cnt_r, W * 8);
    cudaMemcpy(d_send, h_send, total, cudaMemcpyHostToDevice);
    cudaMemset(d_recv, 0, total);
    cudaMemcpy(d_cnt_s, len, W * 8, cudaMemcpyHostToDevice);
    int bad = 0;
    if (ep_nccl_counts(x, d_cnt_s, d_cnt_r, s, &e) != DI_OK) {
        fprintf(stderr, "ep_nccl_check: counts: %s\n", e.msg);
        return 1;
    }
    cudaMemcpy(cnt, d_cnt_r, W * 8, cudaMemcpyDeviceToHost);
    for (uint64_t src = 0; src < W; src++)
        bad += cnt[src] != per - rank;
    if (ep_nccl_alltoallv(x, d_send, off, len, d_recv, off, cnt, s, &e) != DI_OK) {
        fprintf(stderr, "ep_nccl_check: all-to-all: %s\n", e.msg);
        return 1;
    }
    cudaMemcpy(h_recv, d_recv, total, cudaMemcpyDeviceToHost);
    for (uint64_t src = 0; src < W; src++)
        for (uint64_t k = 0; k < cnt[src]; k++)
            bad += h_recv[src * per + k] != pattern((uint32_t)src, rank, k);
    printf("ep_nccl_check: rank %u of %u: counts and %llu bytes from each of %u ranks: %s\n",
           rank, world, (unsigned long long)(per - rank), world, bad ? "MISMATCH" : "ok");
    ep_nccl_close(x);
    ep_group_close(g);
    return bad ? 1 : 0;
}
