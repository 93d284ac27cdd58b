/* group.c: rendezvous, star collectives and the all-to-all of a rank group (group.h). */
#include "common/ep/group.h"

#include <errno.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <unistd.h>

#include "common/util/clock.h"
#include "common/util/hostport.h"
#include "common/util/sha256.h"

#define EP_MAGIC 0x50454944u /* "DIEP" */
#define EP_NONCE 32u

/* Ops of a frame (the header's op): the collectives, the rendezvous's start frame, and the
 * reason rank 0 sends every rank before it ends a failed group (payload: the status as an
 * int32, then the message without its NUL). */
enum { OP_START = 100, OP_A2A = 200, OP_ABORT = 300 };

/* Rank 0's reasons go out within this long (or the group's timeout when shorter). */
#define ABORT_SEND_MS 1000u
/* A rank whose write to rank 0 failed looks for rank 0's reason this long. */
#define ABORT_READ_MS 200u
/* The ranks other than 0 wait for rank 0 at most this much longer than the group's timeout. */
#define ABORT_GRACE_MS 1000u

/* Reasons rank 0 gives a refused rank (one byte). */
enum { HELLO_OK = 0, HELLO_BAD_TOKEN, HELLO_BAD_WORLD, HELLO_BAD_RANK, HELLO_DUP_RANK };

typedef struct frame_hdr {
    uint32_t magic;
    uint32_t op;             /* ep_reduce value, OP_A2A or OP_START */
    uint64_t round;          /* collectives completed before this one */
    uint64_t len;            /* payload bytes */
} frame_hdr;

struct ep_group {
    uint32_t rank, world;
    uint32_t timeout_ms;
    uint64_t max_frame;
    int *fds;                /* rank 0: [world] connection of rank r (fds[0] = -1);
                                others: fds[0] = the connection to rank 0 */
    bool failed;             /* a collective failed: the group is unusable */
    int64_t cut;             /* rank 0: the rank whose outgoing stream a failed write left
                                inside a frame (-1: none); it gets no reason */
    di_error fail;           /* the first failure */
    ep_group_stats stats;
    uint8_t **bufs;          /* [world] receive buffers (rank 0: one per rank; others: [0]) */
    uint64_t *caps;          /* [world] their capacities */
    uint8_t *out;            /* rank 0: a reply being built */
    uint64_t out_cap;
};

/* ---- I/O with deadlines ---- */

static uint64_t deadline_after(uint32_t ms) { return di_mono_ns() + (uint64_t)ms * 1000000ull; }

static int ms_left(uint64_t deadline)
{
    uint64_t now = di_mono_ns();
    if (now >= deadline)
        return 0;
    uint64_t ms = (deadline - now + 999999) / 1000000;
    return ms > 60000 ? 60000 : (int)ms;
}

/* Waits for fd to be ready for `events`: DI_OK, DI_ETIMEDOUT, DI_EIO. */
static di_status wait_fd(int fd, short events, uint64_t deadline, const char *who, di_error *err)
{
    for (;;) {
        int left = ms_left(deadline);
        if (left == 0)
            return di_fail(err, DI_ETIMEDOUT, "%s: no answer within the deadline", who);
        struct pollfd p = {.fd = fd, .events = events};
        int n = poll(&p, 1, left);
        if (n > 0)
            return DI_OK;
        if (n < 0 && errno != EINTR)
            return di_fail(err, DI_EIO, "%s: poll: %s", who, strerror(errno));
    }
}

static di_status read_all(int fd, void *buf, uint64_t len, uint64_t deadline, const char *who,
                          di_error *err)
{
    uint8_t *p = buf;
    while (len) {
        di_status st = wait_fd(fd, POLLIN, deadline, who, err);
        if (st != DI_OK)
            return st;
        ssize_t n = recv(fd, p, len > (1u << 30) ? (1u << 30) : len, MSG_DONTWAIT);
        if (n == 0)
            return di_fail(err, DI_EIO, "%s closed the connection (the process ended?)", who);
        if (n < 0) {
            if (errno == EINTR || errno == EAGAIN || errno == EWOULDBLOCK)
                continue;
            if (errno == ECONNRESET)
                return di_fail(err, DI_EIO, "%s closed the connection (the process ended?)",
                               who);
            return di_fail(err, DI_EIO, "%s: read: %s", who, strerror(errno));
        }
        p += n;
        len -= (uint64_t)n;
    }
    return DI_OK;
}

static di_status write_all(int fd, const void *buf, uint64_t len, uint64_t deadline,
                           const char *who, di_error *err)
{
    const uint8_t *p = buf;
    while (len) {
        di_status st = wait_fd(fd, POLLOUT, deadline, who, err);
        if (st != DI_OK)
            return st;
        ssize_t n = send(fd, p, len > (1u << 30) ? (1u << 30) : len,
                         MSG_DONTWAIT | MSG_NOSIGNAL);
        if (n < 0) {
            if (errno == EINTR || errno == EAGAIN || errno == EWOULDBLOCK)
                continue;
            if (errno == ECONNRESET || errno == EPIPE)
                return di_fail(err, DI_EIO, "%s closed the connection (the process ended?)",
                               who);
            return di_fail(err, DI_EIO, "%s: write: %s", who, strerror(errno));
        }
        p += n;
        len -= (uint64_t)n;
    }
    return DI_OK;
}

/* ---- addresses ---- */

static di_status resolve(const char *addr, bool allow_zero, bool allow_remote, bool passive,
                         struct addrinfo **out, di_error *err)
{
    di_hostport hp;
    di_status st = di_hostport_parse(addr, allow_zero, &hp, err);
    if (st != DI_OK)
        return st;
    if (!allow_remote && !di_hostport_is_loopback(&hp))
        return di_fail(err, DI_EINVAL, "%s is not a loopback address (the group listens on "
                       "loopback unless told otherwise)", addr);
    char host[DI_HOST_MAX + 3], port[8];
    size_t hl = strlen(hp.host);
    if (hp.host[0] == '[') {
        memcpy(host, hp.host + 1, hl - 2);
        host[hl - 2] = 0;
    } else {
        memcpy(host, hp.host, hl + 1);
    }
    snprintf(port, sizeof port, "%u", hp.port);
    struct addrinfo hints = {.ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM,
                             .ai_flags = passive ? AI_PASSIVE : 0};
    int rc = getaddrinfo(host, port, &hints, out);
    if (rc != 0)
        return di_fail(err, DI_EINVAL, "%s: %s", addr, gai_strerror(rc));
    return DI_OK;
}

di_status ep_group_listen(const char *addr, bool allow_remote, int *fd, uint16_t *port,
                          di_error *err)
{
    struct addrinfo *ai;
    di_status st = resolve(addr, true, allow_remote, true, &ai, err);
    if (st != DI_OK)
        return st;
    int s = socket(ai->ai_family, SOCK_STREAM, 0);
    int one = 1;
    if (s < 0 || setsockopt(s, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one) != 0 ||
        bind(s, ai->ai_addr, ai->ai_addrlen) != 0 || listen(s, (int)EP_MAX_WORLD) != 0) {
        st = di_fail(err, DI_EIO, "listening on %s: %s", addr, strerror(errno));
        if (s >= 0)
            close(s);
        freeaddrinfo(ai);
        return st;
    }
    freeaddrinfo(ai);
    struct sockaddr_storage ss;
    socklen_t sl = sizeof ss;
    if (getsockname(s, (struct sockaddr *)&ss, &sl) != 0) {
        close(s);
        return di_fail(err, DI_EIO, "listening on %s: getsockname: %s", addr, strerror(errno));
    }
    *port = ntohs(ss.ss_family == AF_INET6 ? ((struct sockaddr_in6 *)&ss)->sin6_port
                                           : ((struct sockaddr_in *)&ss)->sin_port);
    *fd = s;
    return DI_OK;
}

di_status ep_rank_from_hostname(const char *host, uint32_t *rank, di_error *err)
{
    size_t n = host ? strlen(host) : 0, i = n;
    while (i > 0 && host[i - 1] >= '0' && host[i - 1] <= '9')
        i--;
    uint64_t v = 0;
    for (size_t k = i; k < n && v < EP_MAX_WORLD; k++)
        v = v * 10 + (uint64_t)(host[k] - '0');
    if (i == n || n - i > 3 || v >= EP_MAX_WORLD)
        return di_fail(err, DI_EINVAL, "host name '%.64s' does not end in a rank below %u (a "
                       "StatefulSet pod's ordinal)", host ? host : "", EP_MAX_WORLD);
    *rank = (uint32_t)v;
    return DI_OK;
}

/* ---- the handshake ---- */

/* HMAC-SHA256(token, nonce || rank || world). */
static void hello_mac(const char *token, const uint8_t nonce[EP_NONCE], uint32_t rank,
                      uint32_t world, uint8_t out[DI_SHA256_BYTES])
{
    uint8_t key[64] = {0}, pad[64], inner[DI_SHA256_BYTES];
    size_t tl = strlen(token);
    if (tl > 64)
        di_sha256_portable(token, tl, key);
    else
        memcpy(key, token, tl);
    di_sha256 s;
    for (int i = 0; i < 64; i++)
        pad[i] = key[i] ^ 0x36;
    di_sha256_init(&s);
    di_sha256_update(&s, pad, 64);
    di_sha256_update(&s, nonce, EP_NONCE);
    di_sha256_update(&s, &rank, 4);
    di_sha256_update(&s, &world, 4);
    di_sha256_final(&s, inner);
    for (int i = 0; i < 64; i++)
        pad[i] = key[i] ^ 0x5c;
    di_sha256_init(&s);
    di_sha256_update(&s, pad, 64);
    di_sha256_update(&s, inner, sizeof inner);
    di_sha256_final(&s, out);
}

typedef struct hello_req {
    uint32_t magic, rank, world, pad;
    uint8_t mac[DI_SHA256_BYTES];
} hello_req;

typedef struct hello_chal {
    uint32_t magic, world;
    uint8_t nonce[EP_NONCE];
} hello_chal;

static const char *hello_reason(uint8_t r)
{
    switch (r) {
    case HELLO_BAD_TOKEN: return "wrong group token";
    case HELLO_BAD_WORLD: return "world size differs from rank 0's";
    case HELLO_BAD_RANK: return "rank outside 1..world-1";
    case HELLO_DUP_RANK: return "another process already joined as this rank";
    default: return "unknown reason";
    }
}

/* Rank 0: one accepted connection's handshake. Returns the rank (> 0) that joined, 0 when the
 * connection was refused (and closed). */
static uint32_t admit(ep_group *g, int c, const char *token, uint64_t deadline)
{
    uint64_t dl = deadline_after(g->timeout_ms < 2000 ? g->timeout_ms : 2000);
    if (dl > deadline)
        dl = deadline;
    hello_chal ch = {.magic = EP_MAGIC, .world = g->world};
    hello_req rq;
    di_error e;
    uint8_t verdict = HELLO_BAD_TOKEN;
    if (getrandom(ch.nonce, sizeof ch.nonce, 0) != (ssize_t)sizeof ch.nonce ||
        write_all(c, &ch, sizeof ch, dl, "a joining rank", &e) != DI_OK ||
        read_all(c, &rq, sizeof rq, dl, "a joining rank", &e) != DI_OK || rq.magic != EP_MAGIC) {
        close(c);
        return 0;
    }
    uint8_t mac[DI_SHA256_BYTES];
    hello_mac(token, ch.nonce, rq.rank, rq.world, mac);
    uint8_t diff = 0;
    for (size_t i = 0; i < sizeof mac; i++)
        diff |= mac[i] ^ rq.mac[i];
    if (diff)
        verdict = HELLO_BAD_TOKEN;
    else if (rq.world != g->world)
        verdict = HELLO_BAD_WORLD;
    else if (rq.rank == 0 || rq.rank >= g->world)
        verdict = HELLO_BAD_RANK;
    else if (g->fds[rq.rank] >= 0)
        verdict = HELLO_DUP_RANK;
    else
        verdict = HELLO_OK;
    if (write_all(c, &verdict, 1, dl, "a joining rank", &e) != DI_OK || verdict != HELLO_OK) {
        close(c);
        return 0;
    }
    g->fds[rq.rank] = c;
    return rq.rank;
}

static di_status gather_ranks(ep_group *g, int lfd, const char *token, uint64_t deadline,
                              di_error *err)
{
    uint32_t joined = 1;
    while (joined < g->world) {
        di_status st = wait_fd(lfd, POLLIN, deadline, "rendezvous", err);
        if (st != DI_OK)
            return di_fail(err, st, "rank 0: %u of %u ranks joined within %u ms", joined,
                           g->world, g->timeout_ms);
        int c = accept(lfd, NULL, NULL);
        if (c < 0) {
            if (errno == EINTR || errno == EAGAIN || errno == ECONNABORTED)
                continue;
            return di_fail(err, DI_EIO, "rank 0: accept: %s", strerror(errno));
        }
        int one = 1;
        setsockopt(c, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
        if (admit(g, c, token, deadline))
            joined++;
        else
            g->stats.refused++;
    }
    frame_hdr h = {.magic = EP_MAGIC, .op = OP_START};
    for (uint32_t r = 1; r < g->world; r++) {
        char who[32];
        snprintf(who, sizeof who, "rank %u", r);
        di_status st = write_all(g->fds[r], &h, sizeof h, deadline, who, err);
        if (st != DI_OK)
            return st;
    }
    return DI_OK;
}

static di_status join_rank0(ep_group *g, const ep_group_options *o, uint64_t deadline,
                            di_error *err)
{
    struct addrinfo *ai;
    di_status st = resolve(o->addr, false, o->allow_remote, false, &ai, err);
    if (st != DI_OK)
        return st;
    int c = -1;
    /* rank 0 may not listen yet: retry until the deadline */
    for (;;) {
        c = socket(ai->ai_family, SOCK_STREAM, 0);
        if (c >= 0 && connect(c, ai->ai_addr, ai->ai_addrlen) == 0)
            break;
        int e = errno;
        if (c >= 0)
            close(c);
        c = -1;
        if (ms_left(deadline) == 0) {
            freeaddrinfo(ai);
            return di_fail(err, DI_ETIMEDOUT, "rank %u: cannot reach rank 0 at %s within %u "
                           "ms: %s", g->rank, o->addr, g->timeout_ms, strerror(e));
        }
        poll(NULL, 0, 20);
    }
    freeaddrinfo(ai);
    int one = 1;
    setsockopt(c, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    g->fds[0] = c;
    hello_chal ch;
    hello_req rq = {.magic = EP_MAGIC, .rank = g->rank, .world = g->world};
    uint8_t verdict;
    if ((st = read_all(c, &ch, sizeof ch, deadline, "rank 0", err)) != DI_OK)
        return st;
    if (ch.magic != EP_MAGIC)
        return di_fail(err, DI_EPROTO, "rank %u: %s does not speak the group protocol",
                       g->rank, o->addr);
    hello_mac(o->token, ch.nonce, g->rank, g->world, rq.mac);
    if ((st = write_all(c, &rq, sizeof rq, deadline, "rank 0", err)) != DI_OK ||
        (st = read_all(c, &verdict, 1, deadline, "rank 0", err)) != DI_OK)
        return st;
    if (verdict != HELLO_OK)
        return di_fail(err, DI_EAUTH, "rank %u: rank 0 refused this rank: %s", g->rank,
                       hello_reason(verdict));
    frame_hdr h;
    if ((st = read_all(c, &h, sizeof h, deadline, "rank 0 (waiting for the other ranks)",
                       err)) != DI_OK)
        return st;
    if (h.magic != EP_MAGIC || h.op != OP_START)
        return di_fail(err, DI_EPROTO, "rank %u: bad start frame from rank 0", g->rank);
    return DI_OK;
}

di_status ep_group_join(const ep_group_options *o, ep_group **out, di_error *err)
{
    int lfd = o ? o->listen_fd : -1;
    di_status st = DI_OK;
    if (!o || !out || o->world == 0 || o->world > EP_MAX_WORLD || o->rank >= o->world)
        st = di_fail(err, DI_EINVAL, "rank group: rank %u of world %u (world 1..%u, rank < "
                     "world)", o ? o->rank : 0, o ? o->world : 0, EP_MAX_WORLD);
    else if (!o->token || strlen(o->token) < EP_TOKEN_MIN || strlen(o->token) > EP_TOKEN_MAX)
        st = di_fail(err, DI_EINVAL, "rank group: the group token must have %u..%u bytes",
                     EP_TOKEN_MIN, EP_TOKEN_MAX);
    else if (o->timeout_ms == 0)
        st = di_fail(err, DI_EINVAL, "rank group: timeout must be at least 1 ms");
    else if (!o->addr && (o->rank != 0 || lfd < 0) && o->world > 1)
        st = di_fail(err, DI_EINVAL, "rank group: no rendezvous address");
    if (st != DI_OK) {
        if (lfd >= 0 && o && o->rank == 0)
            close(lfd);
        return st;
    }
    ep_group *g = calloc(1, sizeof *g);
    if (g) {
        g->fds = malloc(o->world * sizeof(int));
        g->bufs = calloc(o->world, sizeof(uint8_t *));
        g->caps = calloc(o->world, sizeof(uint64_t));
    }
    if (!g || !g->fds || !g->bufs || !g->caps) {
        if (lfd >= 0 && o->rank == 0)
            close(lfd);
        if (g) {
            free(g->fds);
            free(g->bufs);
            free(g->caps);
        }
        free(g);
        return di_fail(err, DI_ENOMEM, "rank group");
    }
    g->rank = o->rank;
    g->world = o->world;
    g->timeout_ms = o->timeout_ms;
    g->max_frame = o->max_frame ? o->max_frame : EP_FRAME_MAX_DEFAULT;
    g->cut = -1;
    for (uint32_t r = 0; r < o->world; r++)
        g->fds[r] = -1;
    uint64_t deadline = deadline_after(o->timeout_ms);
    if (o->world > 1 && o->rank == 0) {
        uint16_t port;
        if (lfd < 0)
            st = ep_group_listen(o->addr, o->allow_remote, &lfd, &port, err);
        if (st == DI_OK)
            st = gather_ranks(g, lfd, o->token, deadline, err);
        if (lfd >= 0)
            close(lfd);
    } else if (o->world > 1) {
        st = join_rank0(g, o, deadline, err);
    } else if (lfd >= 0) {
        close(lfd);
    }
    if (st != DI_OK) {
        ep_group_close(g);
        return st;
    }
    *out = g;
    return DI_OK;
}

void ep_group_close(ep_group *g)
{
    if (!g)
        return;
    for (uint32_t r = 0; r < g->world; r++) {
        if (g->fds[r] >= 0)
            close(g->fds[r]);
        free(g->bufs[r]);
    }
    free(g->fds);
    free(g->bufs);
    free(g->caps);
    free(g->out);
    free(g);
}

uint32_t ep_group_rank(const ep_group *g) { return g->rank; }
uint32_t ep_group_world(const ep_group *g) { return g->world; }
ep_group_stats ep_group_get_stats(const ep_group *g) { return g->stats; }

/* ---- the star round ---- */

static di_status send_frame(ep_group *g, int fd, uint32_t op, uint32_t who, const void *a,
                            uint64_t alen, const void *b, uint64_t blen, uint64_t deadline,
                            di_error *err);

/* Rank 0: sends every other rank the failure (an abort frame) before the connections close,
 * so that each names the rank that failed rather than rank 0, whose connection is all it
 * sees. Best effort within ABORT_SEND_MS: a rank that cannot take a small frame by then is
 * hung, and learns from the end of the stream. */
static void tell_ranks(ep_group *g, di_status st, const di_error *e)
{
    uint8_t msg[4 + sizeof e->msg];
    int32_t code = (int32_t)st;
    size_t n = strnlen(e->msg, sizeof e->msg - 1);
    memcpy(msg, &code, 4);
    memcpy(msg + 4, e->msg, n);
    uint64_t deadline = deadline_after(g->timeout_ms < ABORT_SEND_MS ? g->timeout_ms
                                                                     : ABORT_SEND_MS);
    for (uint32_t r = 1; r < g->world; r++) {
        di_error ignored;
        if (g->fds[r] >= 0 && (int64_t)r != g->cut)
            send_frame(g, g->fds[r], OP_ABORT, r, msg, 4 + n, NULL, 0, deadline, &ignored);
    }
}

/* Marks the group failed (keeping the first message) and closes every connection, so that
 * the other ranks see the end of their stream at once; rank 0 tells them why first. */
static di_status group_fail(ep_group *g, di_status st, const di_error *e, di_error *err)
{
    if (!g->failed) {
        g->failed = true;
        g->fail = *e;
        g->fail.code = st;
        if (g->rank == 0)
            tell_ranks(g, st, e);
    }
    for (uint32_t r = 0; r < g->world; r++)
        if (g->fds[r] >= 0) {
            close(g->fds[r]);
            g->fds[r] = -1;
        }
    if (err)
        *err = *e;
    return st;
}

static di_status grow(uint8_t **buf, uint64_t *cap, uint64_t need)
{
    if (need <= *cap)
        return DI_OK;
    uint64_t c = *cap ? *cap : 4096;
    while (c < need)
        c *= 2;
    uint8_t *n = realloc(*buf, c);
    if (!n)
        return DI_ENOMEM;
    *buf = n;
    *cap = c;
    return DI_OK;
}

/* A rank other than 0: reads the payload of rank 0's abort frame (len bytes) and returns the
 * failure it carries, which names the rank that failed. */
static di_status heard_abort(ep_group *g, int fd, uint64_t len, uint64_t deadline,
                             di_error *err)
{
    uint8_t msg[4 + sizeof err->msg];
    if (len < 4 || len > sizeof msg - 1)
        return di_fail(err, DI_EPROTO, "rank %u: rank 0 sent a malformed abort frame (%llu "
                       "bytes)", g->rank, (unsigned long long)len);
    di_status st = read_all(fd, msg, len, deadline, "rank 0", err);
    if (st != DI_OK)
        return st;
    int32_t code;
    memcpy(&code, msg, 4);
    if (code >= 0 || code < (int32_t)DI_EINTERNAL)
        code = DI_EIO;
    return di_fail(err, (di_status)code, "rank 0 ended the group: %.*s", (int)(len - 4),
                   (const char *)msg + 4);
}

/* A rank other than 0 whose write to rank 0 failed on a closed connection: rank 0 may have
 * sent the reason first (it is then in this rank's receive queue); *st and *e become it. */
static void look_for_abort(ep_group *g, di_status *st, di_error *e)
{
    if (g->rank == 0 || *st != DI_EIO)
        return;
    uint64_t deadline = deadline_after(g->timeout_ms < ABORT_READ_MS ? g->timeout_ms
                                                                     : ABORT_READ_MS);
    frame_hdr h;
    di_error e2;
    if (read_all(g->fds[0], &h, sizeof h, deadline, "rank 0", &e2) != DI_OK ||
        h.magic != EP_MAGIC || h.op != OP_ABORT)
        return;
    di_status st2 = heard_abort(g, g->fds[0], h.len, deadline, &e2);
    if (st2 != DI_EPROTO) {
        *st = st2;
        *e = e2;
    }
}

/* Reads a frame from rank `who` (rank 0 reading rank r, or a rank reading rank 0) into
 * bufs[slot]: checks magic, op, round and the size bound. */
static di_status recv_frame(ep_group *g, int fd, uint32_t slot, uint32_t op, uint32_t who,
                            uint64_t deadline, uint64_t *len, di_error *err)
{
    char name[32];
    snprintf(name, sizeof name, "rank %u", who);
    frame_hdr h;
    di_status st = read_all(fd, &h, sizeof h, deadline, name, err);
    if (st != DI_OK)
        return st;
    if (h.magic != EP_MAGIC)
        return di_fail(err, DI_EPROTO, "rank %u sent a frame without the group's magic", who);
    if (h.op == OP_ABORT && g->rank != 0)
        return heard_abort(g, fd, h.len, deadline, err);
    if (h.op != op || h.round != g->stats.rounds)
        return di_fail(err, DI_EINTERNAL, "lockstep lost: rank %u made call %u (round %llu) "
                       "while rank %u made call %u (round %llu)", who, h.op,
                       (unsigned long long)h.round, g->rank, op,
                       (unsigned long long)g->stats.rounds);
    if (h.len > g->max_frame)
        return di_fail(err, DI_EPROTO, "rank %u sent a frame of %llu bytes (at most %llu)",
                       who, (unsigned long long)h.len, (unsigned long long)g->max_frame);
    if (grow(&g->bufs[slot], &g->caps[slot], h.len ? h.len : 1) != DI_OK)
        return di_fail(err, DI_ENOMEM, "frame of %llu bytes from rank %u",
                       (unsigned long long)h.len, who);
    if ((st = read_all(fd, g->bufs[slot], h.len, deadline, name, err)) != DI_OK)
        return st;
    g->stats.bytes_received += h.len;
    *len = h.len;
    return DI_OK;
}

static di_status send_frame(ep_group *g, int fd, uint32_t op, uint32_t who, const void *a,
                            uint64_t alen, const void *b, uint64_t blen, uint64_t deadline,
                            di_error *err)
{
    char name[32];
    snprintf(name, sizeof name, "rank %u", who);
    frame_hdr h = {.magic = EP_MAGIC, .op = op, .round = g->stats.rounds, .len = alen + blen};
    di_status st = write_all(fd, &h, sizeof h, deadline, name, err);
    if (st == DI_OK && alen)
        st = write_all(fd, a, alen, deadline, name, err);
    if (st == DI_OK && blen)
        st = write_all(fd, b, blen, deadline, name, err);
    if (st == DI_OK)
        g->stats.bytes_sent += alen + blen;
    else if (g->rank == 0)
        g->cut = who;
    return st;
}

/* The deadline of a collective begun now. The ranks other than 0 wait a quarter longer (at
 * most ABORT_GRACE_MS more): when a rank hangs, rank 0 reaches its deadline first, names the
 * silent rank and tells the others, rather than every rank naming rank 0. */
static uint64_t collective_deadline(const ep_group *g)
{
    uint64_t grace = g->rank == 0 ? 0 : g->timeout_ms / 4;
    if (grace > ABORT_GRACE_MS)
        grace = ABORT_GRACE_MS;
    return di_mono_ns() + ((uint64_t)g->timeout_ms + grace) * 1000000ull;
}

static di_status check_usable(ep_group *g, di_error *err)
{
    if (!g->failed)
        return DI_OK;
    di_error e = g->fail;
    return di_fail(err, DI_ECANCELED, "rank group failed earlier: %s", e.msg);
}

/* ---- allreduce ---- */

static uint64_t combine(ep_reduce op, uint64_t a, uint64_t b)
{
    switch (op) {
    case EP_REDUCE_AND: return a && b;
    case EP_REDUCE_SUM: return a + b;
    case EP_REDUCE_MAX: return a > b ? a : b;
    default: return a || b;
    }
}

di_status ep_group_allreduce(ep_group *g, ep_reduce op, uint64_t *vals, uint32_t n,
                             di_error *err)
{
    di_status st = check_usable(g, err);
    if (st != DI_OK)
        return st;
    uint64_t bytes = (uint64_t)n * 8;
    if (bytes > g->max_frame || op < EP_REDUCE_AND || op > EP_REDUCE_MAX)
        return di_fail(err, DI_EINVAL, "allreduce of %u values (op %d)", n, (int)op);
    if (g->world == 1) {
        if (op == EP_REDUCE_AND || op == EP_REDUCE_OR || op == EP_REDUCE_WORK)
            for (uint32_t i = 0; i < n; i++)
                vals[i] = vals[i] != 0;
        g->stats.rounds++;
        return DI_OK;
    }
    uint64_t deadline = collective_deadline(g);
    di_error e;
    uint64_t len;
    if (g->rank == 0) {
        if (op == EP_REDUCE_AND || op == EP_REDUCE_OR || op == EP_REDUCE_WORK)
            for (uint32_t i = 0; i < n; i++)
                vals[i] = vals[i] != 0;
        for (uint32_t r = 1; st == DI_OK && r < g->world; r++) {
            st = recv_frame(g, g->fds[r], r, (uint32_t)op, r, deadline, &len, &e);
            if (st == DI_OK && len != bytes)
                st = di_fail(&e, DI_EINTERNAL, "lockstep lost: rank %u reduces %llu values, "
                             "rank 0 %u", r, (unsigned long long)(len / 8), n);
            const uint64_t *v = (const uint64_t *)g->bufs[r];
            for (uint32_t i = 0; st == DI_OK && i < n; i++)
                vals[i] = combine(op, vals[i], v[i]);
        }
        for (uint32_t r = 1; st == DI_OK && r < g->world; r++)
            st = send_frame(g, g->fds[r], (uint32_t)op, r, vals, bytes, NULL, 0, deadline, &e);
    } else {
        st = send_frame(g, g->fds[0], (uint32_t)op, 0, vals, bytes, NULL, 0, deadline, &e);
        if (st != DI_OK)
            look_for_abort(g, &st, &e);
        if (st == DI_OK)
            st = recv_frame(g, g->fds[0], 0, (uint32_t)op, 0, deadline, &len, &e);
        if (st == DI_OK && len != bytes)
            st = di_fail(&e, DI_EPROTO, "rank 0 answered %llu bytes for %u values",
                         (unsigned long long)len, n);
        if (st == DI_OK)
            memcpy(vals, g->bufs[0], bytes);
    }
    if (st != DI_OK)
        return group_fail(g, st, &e, err);
    g->stats.rounds++;
    return DI_OK;
}

/* ---- all-to-all ----
 * A rank's frame to rank 0: world lengths (u64), then the buffers for ranks 0..world-1.
 * Rank 0's answer to rank d: world lengths, then what ranks 0..world-1 sent d. */

di_status ep_group_alltoallv(ep_group *g, const ep_buf *send, ep_buf *recv, di_error *err)
{
    di_status st = check_usable(g, err);
    if (st != DI_OK)
        return st;
    uint32_t W = g->world;
    uint64_t head = (uint64_t)W * 8, total = head;
    for (uint32_t d = 0; d < W; d++)
        total += send[d].len;
    if (total > g->max_frame)
        return di_fail(err, DI_ERANGE, "all-to-all of %llu bytes from rank %u exceeds the "
                       "frame bound of %llu", (unsigned long long)total, g->rank,
                       (unsigned long long)g->max_frame);
    if (W == 1) {
        recv[0] = send[0];
        g->stats.rounds++;
        return DI_OK;
    }
    uint64_t deadline = collective_deadline(g);
    di_error e;
    uint64_t len;
    if (g->rank != 0) {
        uint64_t *lens = malloc(head);
        if (!lens)
            return di_fail(err, DI_ENOMEM, "all-to-all");
        for (uint32_t d = 0; d < W; d++)
            lens[d] = send[d].len;
        /* one frame: header, lengths, then each buffer */
        char name[16] = "rank 0";
        frame_hdr h = {.magic = EP_MAGIC, .op = OP_A2A, .round = g->stats.rounds, .len = total};
        st = write_all(g->fds[0], &h, sizeof h, deadline, name, &e);
        if (st == DI_OK)
            st = write_all(g->fds[0], lens, head, deadline, name, &e);
        for (uint32_t d = 0; st == DI_OK && d < W; d++)
            if (send[d].len)
                st = write_all(g->fds[0], send[d].data, send[d].len, deadline, name, &e);
        free(lens);
        if (st != DI_OK)
            look_for_abort(g, &st, &e);
        if (st == DI_OK) {
            g->stats.bytes_sent += total;
            st = recv_frame(g, g->fds[0], 0, OP_A2A, 0, deadline, &len, &e);
        }
        const uint64_t *rl = (const uint64_t *)g->bufs[0];
        uint64_t off = head;
        for (uint32_t s = 0; st == DI_OK && s < W; s++) {
            if (len < head || rl[s] > len - off) {
                st = di_fail(&e, DI_EPROTO, "rank 0 sent a malformed all-to-all answer");
                break;
            }
            recv[s] = (ep_buf){g->bufs[0] + off, rl[s]};
            off += rl[s];
        }
        if (st != DI_OK)
            return group_fail(g, st, &e, err);
        g->stats.rounds++;
        return DI_OK;
    }
    /* rank 0: every rank's frame, checked */
    for (uint32_t r = 1; st == DI_OK && r < W; r++) {
        st = recv_frame(g, g->fds[r], r, OP_A2A, r, deadline, &len, &e);
        if (st != DI_OK)
            break;
        const uint64_t *l = (const uint64_t *)g->bufs[r];
        uint64_t sum = head;
        for (uint32_t d = 0; len >= head && d < W && sum <= len; d++)
            sum += l[d] <= len ? l[d] : len + 1;
        if (len < head || sum != len)
            st = di_fail(&e, DI_EPROTO, "rank %u sent a malformed all-to-all frame", r);
    }
    /* the answers: to rank d, what every rank s sent d */
    for (uint32_t d = 0; st == DI_OK && d < W; d++) {
        uint64_t need = head;
        for (uint32_t s = 0; s < W; s++)
            need += s == 0 ? send[d].len : ((const uint64_t *)g->bufs[s])[d];
        if (need > g->max_frame) {
            st = di_fail(&e, DI_ERANGE, "all-to-all answer of %llu bytes to rank %u exceeds "
                         "the frame bound", (unsigned long long)need, d);
            break;
        }
        uint8_t **dst = &g->out;
        uint64_t *cap = &g->out_cap;
        if (d == 0) { /* rank 0 keeps its own answer in bufs[0] */
            dst = &g->bufs[0];
            cap = &g->caps[0];
        }
        if (grow(dst, cap, need) != DI_OK) {
            st = di_fail(&e, DI_ENOMEM, "all-to-all answer of %llu bytes",
                         (unsigned long long)need);
            break;
        }
        uint64_t *ol = (uint64_t *)*dst, off = head;
        for (uint32_t s = 0; s < W; s++) {
            const uint8_t *src;
            uint64_t n;
            if (s == 0) {
                src = send[d].data;
                n = send[d].len;
            } else {
                const uint64_t *l = (const uint64_t *)g->bufs[s];
                uint64_t at = head;
                for (uint32_t k = 0; k < d; k++)
                    at += l[k];
                src = g->bufs[s] + at;
                n = l[d];
            }
            ol[s] = n;
            if (n)
                memcpy(*dst + off, src, n);
            off += n;
        }
        if (d > 0)
            st = send_frame(g, g->fds[d], OP_A2A, d, g->out, need, NULL, 0, deadline, &e);
    }
    if (st != DI_OK)
        return group_fail(g, st, &e, err);
    const uint64_t *rl = (const uint64_t *)g->bufs[0];
    uint64_t off = head;
    for (uint32_t s = 0; s < W; s++) {
        recv[s] = (ep_buf){g->bufs[0] + off, rl[s]};
        off += rl[s];
    }
    g->stats.rounds++;
    return DI_OK;
}

/* ---- the vote ---- */

static di_status vote_op(ep_group *g, ep_reduce op, bool flag, bool *out, di_error *err)
{
    uint64_t v = flag;
    di_status st = ep_group_allreduce(g, op, &v, 1, err);
    if (st == DI_OK)
        *out = v != 0;
    return st;
}

static di_status vote_all(void *ud, bool flag, bool *out, di_error *err)
{
    return vote_op(ud, EP_REDUCE_AND, flag, out, err);
}

static di_status vote_any(void *ud, bool flag, bool *out, di_error *err)
{
    return vote_op(ud, EP_REDUCE_OR, flag, out, err);
}

static di_status vote_work(void *ud, bool flag, bool *out, di_error *err)
{
    return vote_op(ud, EP_REDUCE_WORK, flag, out, err);
}

vote ep_group_vote(ep_group *g)
{
    return (vote){.all = vote_all, .any = vote_any, .any_work = vote_work, .userdata = g,
                  .rank = g->rank, .n_ranks = g->world};
}
