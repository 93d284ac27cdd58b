/* The UCX transport (common/net/ucx_xport.h) between two processes: a child serves one buffer
 * through tickets like the store; the parent fetches and sends with good and bad tickets. */
#include <criterion/criterion.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "common/net/ucx_xport.h"
#include "common/util/clock.h"

#define AREA (4u << 20)
#define OBJ (1u << 20) /* rendezvous-sized */

/* The child's state: one area, two tickets (0: get of [0, OBJ), 1: put into [OBJ, 2 OBJ)). */
typedef struct served {
    uint8_t *area;
    ucxt_ticket t[2];
    int used[2];
} served;

static di_status begin(served *sv, int which, const ucxt_ticket *t, ucxt_grant *g)
{
    if (memcmp(t->b, sv->t[which].b, sizeof(t->b)) != 0 || sv->used[which])
        return DI_EAUTH;
    sv->used[which] = 1;
    g->addr = sv->area + (size_t)which * OBJ;
    g->len = OBJ;
    g->token = sv;
    return DI_OK;
}

static di_status get_begin(void *ud, const ucxt_ticket *t, ucxt_grant *g)
{
    return begin(ud, 0, t, g);
}

static di_status put_begin(void *ud, const ucxt_ticket *t, uint64_t len, ucxt_grant *g)
{
    return len == OBJ ? begin(ud, 1, t, g) : DI_EINVAL;
}

static void end(void *ud, void *token, di_status st)
{
    (void)ud;
    (void)token;
    (void)st;
}

/* What the child sends through the pipe. */
typedef struct offer {
    size_t addr_len;
    uint8_t addr[2048];
    ucxt_ticket t[2];
} offer;

static void serve(int wfd, int rfd)
{
    ucxt_ctx *c;
    void *addr;
    offer o = {0};
    served sv = {.area = malloc(AREA)};
    for (int i = 0; i < 2; i++)
        for (int k = 0; k < UCXT_TICKET_BYTES; k++)
            sv.t[i].b[k] = (uint8_t)(rand() + i);
    memcpy(o.t, sv.t, sizeof(o.t));
    for (size_t i = 0; i < AREA; i++)
        sv.area[i] = (uint8_t)(i * 7 + 1);
    ucxt_server_ops ops = {get_begin, end, put_begin, end, &sv};
    if (!sv.area || ucxt_create(1, NULL, &c, NULL) || ucxt_serve(c, &ops, NULL) ||
        ucxt_worker_address(c, &addr, &o.addr_len, NULL) || o.addr_len > sizeof(o.addr) ||
        ucxt_progress_start(c, NULL))
        _exit(2);
    memcpy(o.addr, addr, o.addr_len);
    free(addr);
    if (write(wfd, &o, sizeof(o)) != (ssize_t)sizeof(o))
        _exit(3);
    char b;
    if (read(rfd, &b, 1) != 1) /* parent done */
        _exit(4);
    ucxt_progress_stop(c);
    /* The put landed in the second object, the rest is untouched. */
    int ok = 1;
    for (size_t i = 0; i < AREA; i++) {
        uint8_t want = i >= OBJ && i < 2 * OBJ ? (uint8_t)(i * 3) : (uint8_t)(i * 7 + 1);
        ok &= sv.area[i] == want;
    }
    ucxt_destroy(c);
    _exit(ok ? 0 : 5);
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

Test(ucx, tickets_move_exactly_their_object_and_only_once, .timeout = 60)
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
    offer o;
    read_full(up[0], &o, sizeof(o));
    ucxt_ctx *c;
    ucxt_peer *p;
    di_error e;
    cr_assert_eq(ucxt_create(0, NULL, &c, &e), DI_OK, "%s", e.msg);
    cr_assert_eq(ucxt_peer_connect(c, o.addr, o.addr_len, 0, &p, &e), DI_OK, "%s", e.msg);
    uint8_t *buf = malloc(2 * OBJ);
    uint64_t deadline = di_mono_ns() + 20000000000ull;

    /* A forged ticket moves nothing. */
    ucxt_xfer x = {.buf = buf, .len = 2 * OBJ};
    memset(buf, 0, 2 * OBJ);
    cr_assert_eq(ucxt_fetch(p, &x, 1, 1, deadline, NULL, NULL, &e), DI_OK, "%s", e.msg);
    cr_assert_eq(x.status, DI_EAUTH);
    cr_assert_eq(x.got, 0);

    /* The get ticket reads exactly its object. */
    x = (ucxt_xfer){.ticket = o.t[0], .buf = buf, .len = 2 * OBJ};
    cr_assert_eq(ucxt_fetch(p, &x, 1, 1, deadline, NULL, NULL, &e), DI_OK, "%s", e.msg);
    cr_assert_eq(x.status, DI_OK, "%s", di_status_name(x.status));
    cr_assert_eq(x.got, OBJ);
    for (size_t i = 0; i < OBJ; i++)
        cr_assert_eq(buf[i], (uint8_t)(i * 7 + 1), "byte %zu", i);
    /* ... once. */
    cr_assert_eq(ucxt_fetch(p, &x, 1, 1, deadline, NULL, NULL, &e), DI_OK, "%s", e.msg);
    cr_assert_eq(x.status, DI_EAUTH);

    /* A put of the wrong length and a put with the get's ticket are refused. */
    for (size_t i = 0; i < 2 * OBJ; i++)
        buf[i] = (uint8_t)(i + OBJ) * 3;
    x = (ucxt_xfer){.ticket = o.t[1], .buf = buf, .len = OBJ + 64};
    cr_assert_eq(ucxt_send(p, &x, 1, 1, deadline, &e), DI_OK, "%s", e.msg);
    cr_assert_eq(x.status, DI_EINVAL);
    x = (ucxt_xfer){.ticket = o.t[0], .buf = buf, .len = OBJ};
    cr_assert_eq(ucxt_send(p, &x, 1, 1, deadline, &e), DI_OK, "%s", e.msg);
    cr_assert_eq(x.status, DI_EAUTH);
    /* The put ticket writes its object, acknowledged. */
    x = (ucxt_xfer){.ticket = o.t[1], .buf = buf, .len = OBJ};
    cr_assert_eq(ucxt_send(p, &x, 1, 1, deadline, &e), DI_OK, "%s", e.msg);
    cr_assert_eq(x.status, DI_OK, "%s", di_status_name(x.status));

    /* A malformed header gets no reply and moves nothing. */
    di_status rs = DI_OK;
    uint64_t got = 0;
    cr_assert_eq(ucxt_raw_request(p, 0, "xx", 2, NULL, 0, buf, OBJ, &rs, &got,
                                  di_mono_ns() + 300000000ull, &e),
                 DI_ETIMEDOUT);
    p = ucxt_peer_close(p);
    c = ucxt_destroy(c);
    free(buf);
    char b = 1;
    cr_assert_eq(write(down[1], &b, 1), 1);
    int status = 0;
    waitpid(pid, &status, 0);
    cr_assert(WIFEXITED(status) && WEXITSTATUS(status) == 0,
              "the server's memory outside the put object changed or it failed (%d)", status);
}
