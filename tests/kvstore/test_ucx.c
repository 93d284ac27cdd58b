/* The UCX transport (common/net/ucx_xport.h) between two processes: a child maps a region and
 * runs a progress thread like the store; the parent puts and gets bytes with it. */
#include <criterion/criterion.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "common/net/ucx_xport.h"
#include "common/util/clock.h"

/* What the child sends through the pipe. */
typedef struct offer {
    uint64_t base, bytes;
    int allocated;
    size_t addr_len, rkey_len;
    uint8_t addr[2048], rkey[512];
} offer;

static void serve(int wfd, int rfd)
{
    ucxt_ctx *c;
    ucxt_region *r;
    void *addr, *rkey;
    offer o = {0};
    if (ucxt_create(1, &c, NULL) || ucxt_region_map(c, 8 << 20, &r, NULL) ||
        ucxt_worker_address(c, &addr, &o.addr_len, NULL) ||
        ucxt_region_rkey(r, &rkey, &o.rkey_len, NULL) || o.addr_len > sizeof(o.addr) ||
        o.rkey_len > sizeof(o.rkey) || ucxt_progress_start(c, NULL))
        _exit(2);
    memset(ucxt_region_base(r), 0xab, 8 << 20);
    o.base = (uint64_t)(uintptr_t)ucxt_region_base(r);
    o.bytes = ucxt_region_bytes(r);
    o.allocated = ucxt_region_allocated(r);
    memcpy(o.addr, addr, o.addr_len);
    memcpy(o.rkey, rkey, o.rkey_len);
    free(addr);
    free(rkey);
    if (write(wfd, &o, sizeof(o)) != (ssize_t)sizeof(o))
        _exit(3);
    char b;
    if (read(rfd, &b, 1) != 1) /* parent done */
        _exit(4);
    ucxt_region_unmap(r);
    ucxt_destroy(c);
    _exit(0);
}

static size_t seen[64];

static void mark(void *ud, size_t i)
{
    (void)ud;
    seen[i]++;
}

static void read_full(int fd, void *buf, size_t n)
{
    size_t got = 0;
    while (got < n) {
        ssize_t r = read(fd, (char *)buf + got, n - got);
        cr_assert_gt(r, 0, "the server child died");
        got += (size_t)r;
    }
}

Test(ucx, put_then_get_between_processes, .timeout = 60)
{
    int up[2], down[2];
    cr_assert_eq(pipe(up), 0);
    cr_assert_eq(pipe(down), 0);
    pid_t pid = fork();
    if (pid == 0) {
        close(up[0]);
        close(down[1]);
        serve(up[1], down[0]);
    }
    close(up[1]);
    close(down[0]);
    offer *o = malloc(sizeof(*o));
    read_full(up[0], o, sizeof(*o));
    cr_assert(o->allocated, "UCP_MEM_MAP_ALLOCATE worked");

    ucxt_ctx *c;
    ucxt_peer *p;
    ucxt_rkey *k;
    di_error e;
    cr_assert_eq(ucxt_create(0, &c, &e), DI_OK, "%s", e.msg);
    cr_assert_eq(ucxt_peer_connect(c, o->addr, o->addr_len, 0, &p, &e), DI_OK, "%s", e.msg);
    cr_assert_eq(ucxt_rkey_unpack(p, o->rkey, o->rkey_len, &k, &e), DI_OK, "%s", e.msg);

    enum { N = 64, LEN = 114048 };
    uint8_t *src = malloc((size_t)N * LEN), *dst = malloc((size_t)N * LEN);
    ucxt_op ops[N];
    for (size_t i = 0; i < N; i++) {
        memset(src + i * LEN, (int)i + 1, LEN);
        ops[i] = (ucxt_op){.remote = o->base + i * LEN, .local = src + i * LEN, .len = LEN};
    }
    uint64_t deadline = di_mono_ns() + 10000000000ull;
    cr_assert_eq(ucxt_put(p, k, ops, N, 8, deadline, &e), DI_OK, "%s", e.msg);
    for (size_t i = 0; i < N; i++)
        ops[i].local = dst + i * LEN;
    memset(dst, 0, (size_t)N * LEN);
    cr_assert_eq(ucxt_get(p, k, ops, N, 4, deadline, mark, NULL, &e), DI_OK, "%s", e.msg);
    cr_assert_eq(memcmp(src, dst, (size_t)N * LEN), 0, "bytes round-trip");
    for (size_t i = 0; i < N; i++)
        cr_assert_eq(seen[i], 1, "op %zu reported %zu times", i, seen[i]);
    /* Untouched remote memory still holds the child's pattern. */
    ucxt_op tail = {.remote = o->base + (8 << 20) - 16, .local = dst, .len = 16};
    cr_assert_eq(ucxt_get(p, k, &tail, 1, 1, deadline, NULL, NULL, &e), DI_OK, "%s", e.msg);
    cr_assert_eq(dst[0], 0xab);
    cr_assert_eq(ucxt_get(NULL, k, &tail, 1, 1, deadline, NULL, NULL, &e), DI_EINVAL);

    ucxt_rkey_free(k);
    ucxt_peer_close(p);
    ucxt_destroy(c);
    cr_assert_eq(write(down[1], "x", 1), 1);
    int status;
    cr_assert_eq(waitpid(pid, &status, 0), pid);
    cr_assert(WIFEXITED(status) && WEXITSTATUS(status) == 0, "server child status %d", status);
    free(src);
    free(dst);
    free(o);
}
