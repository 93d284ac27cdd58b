/* group.h: a rank group of expert parallelism: one process per GPU (or per CPU rank), met over
 * TCP, with the small collectives the schedulers vote with and the all-to-all the MoE exchange
 * rides on (docs/ep.md).
 *
 * Rendezvous. Rank 0 listens on the address given (loopback by default); every other rank
 * connects to it, retrying until the deadline. Rank 0 sends a 32-byte random challenge; the
 * rank answers with its rank, the world size and HMAC-SHA256(group token, challenge || rank ||
 * world). Rank 0 refuses a wrong token (DI_EAUTH to that rank), a world size that differs, a
 * rank outside 1..world-1 and a rank that already joined, each with a one-byte reason, and
 * goes on waiting for the right ranks; the token itself never crosses the wire. When every
 * rank has joined, rank 0 sends each a start frame; a group that is not complete by the
 * deadline fails on every rank (DI_ETIMEDOUT).
 *
 * Collectives. The CPU transport is a star through rank 0: a rank sends its frame (op, round
 * number, payload) to rank 0, which checks that every rank made the same call (a different op
 * or round is lockstep lost: DI_EINTERNAL), computes the answers and sends each rank its own.
 * Every read and write waits at most timeout_ms. A rank that dies closes its socket: rank 0
 * sees the end of stream, names the rank, sends every other rank the failure (status and
 * message) and closes every connection, so the others fail at once instead of waiting for
 * their deadline, with the status of rank 0's failure and a message naming the rank that
 * failed ("rank 0 ended the group: rank 2 closed the connection ..."). The ranks other than 0
 * give a collective a quarter more time than timeout_ms (at most 1 s more), so that when a rank
 * hangs, rank 0 reaches its deadline first and the others hear which rank it was. After any failure the group is unusable: each
 * later call returns DI_ECANCELED with the first failure's message.
 *
 * Frames are bounded (max_frame bytes of payload); integers travel in the host's byte order
 * (ranks of one group run on one kind of machine).
 *
 * Thread safety: none; one thread per rank calls the group.
 */
#ifndef DI_EP_GROUP_H
#define DI_EP_GROUP_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/engine/vote.h"
#include "common/util/status.h"

#define EP_MAX_WORLD 256u            /* ranks in a group at most */
#define EP_TOKEN_MIN 16u             /* bytes of a group token at least */
#define EP_TOKEN_MAX 512u            /* and at most */
#define EP_FRAME_MAX_DEFAULT (1ull << 30) /* payload bytes of one frame by default */

typedef struct ep_group ep_group;

typedef struct ep_group_options {
    const char *addr;        /* HOST:PORT rank 0 listens on and the others connect to */
    int listen_fd;           /* rank 0: a socket already listening there (ep_group_listen);
                                -1: rank 0 binds addr itself */
    uint32_t rank;           /* this rank, < world */
    uint32_t world;          /* ranks in the group, 1 .. EP_MAX_WORLD */
    const char *token;       /* shared group token, EP_TOKEN_MIN .. EP_TOKEN_MAX bytes */
    uint32_t timeout_ms;     /* deadline of the rendezvous and of every collective's wait;
                                >= 1 */
    uint64_t max_frame;      /* payload bytes of one frame at most; 0 = EP_FRAME_MAX_DEFAULT */
    bool allow_remote;       /* false: addr must be a loopback address */
} ep_group_options;

/* What a group has done (for stats and tests). */
typedef struct ep_group_stats {
    uint64_t rounds;         /* collectives completed */
    uint64_t bytes_sent;     /* payload bytes this rank wrote */
    uint64_t bytes_received; /* payload bytes this rank read */
    uint32_t refused;        /* rank 0: connections refused at the rendezvous */
} ep_group_stats;

/* Binds and listens on addr (port 0 picks one; loopback unless allow_remote) for rank 0 of a
 * group started by another process (di-generate --ep-ranks binds, then forks). *fd is the
 * socket (close-on-exec off, so a child keeps it across exec), *port the bound port.
 * DI_EINVAL (address), DI_EIO (bind/listen with the reason). */
di_status ep_group_listen(const char *addr, bool allow_remote, int *fd, uint16_t *port,
                          di_error *err);

/* A rank from a host name that ends in its ordinal, as the pods of a StatefulSet behind a
 * headless Service are named ("ep-decode-3" -> 3; rank 0's address is then
 * "ep-decode-0.SERVICE:PORT"). DI_EINVAL when the name does not end in a number below
 * EP_MAX_WORLD; *rank written only on success. */
di_status ep_rank_from_hostname(const char *host, uint32_t *rank, di_error *err);

/* Joins (rank > 0) or gathers (rank 0) the group. DI_OK with *out; DI_EINVAL (options);
 * DI_EAUTH (this rank was refused: token, rank or world size, with the reason);
 * DI_ETIMEDOUT (group not complete by the deadline); DI_EIO; DI_ENOMEM. Rank 0 takes
 * listen_fd over (it is closed when the group closes, also on failure). */
di_status ep_group_join(const ep_group_options *opt, ep_group **out, di_error *err);
/* Closes every connection. NULL-safe. */
void ep_group_close(ep_group *g);

uint32_t ep_group_rank(const ep_group *g);
uint32_t ep_group_world(const ep_group *g);
ep_group_stats ep_group_get_stats(const ep_group *g);

/* Element-wise reductions of ep_group_allreduce. */
typedef enum ep_reduce {
    EP_REDUCE_AND = 1,
    EP_REDUCE_OR,
    EP_REDUCE_WORK,          /* OR of "work left" (kept apart so a mixed-up call is caught) */
    EP_REDUCE_SUM,
    EP_REDUCE_MAX,
} ep_reduce;

/* In-place element-wise reduction of vals[0..n) over the ranks (n <= max_frame / 8, the same on
 * every rank). DI_OK; DI_EINVAL (n); the group's failures (above). */
di_status ep_group_allreduce(ep_group *g, ep_reduce op, uint64_t *vals, uint32_t n,
                             di_error *err);

/* Bytes one rank sends another, or received from one. */
typedef struct ep_buf {
    const void *data;
    uint64_t len;
} ep_buf;

/* All-to-all of variable-sized buffers: send[d] goes to rank d (send[rank] to this rank), and
 * recv[s] receives what rank s sent here; recv's memory belongs to the group and stays valid
 * until the next collective. Every rank calls it, with empty buffers where it has nothing.
 * DI_OK; DI_ERANGE (a frame above max_frame); the group's failures. */
di_status ep_group_alltoallv(ep_group *g, const ep_buf *send, ep_buf *recv, di_error *err);

/* The scheduler's vote (vote.h) over this group: all = AND, any = OR, any_work = WORK. The
 * group must outlive the vote. */
vote ep_group_vote(ep_group *g);

#endif
