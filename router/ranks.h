/* ranks.h: the router's live rank table: placement (router/placement.h) under a lock, one gRPC
 * channel per rank, and a poller thread that takes every rank's heartbeat. Prefix: rk_.
 *
 * Heartbeats are polled, not pushed: every heartbeat interval the poller calls each rank's
 * GetLoad (prefill.proto and decode.proto both have it) with a deadline of one interval. A
 * reply is the heartbeat (its load feeds placement); no reply is a missed one, and a rank
 * that reports `draining` counts as a failed call. Polling was chosen over ranks pushing
 * heartbeats because it tests the path the router's own calls take (router -> rank, through
 * the same channel and token), needs nothing new in the services, and keeps the router the
 * only clock that decides health. Ranks come from flags (rk_add) or announce themselves with
 * the router's RegisterRank (router.proto), which adds them the same way; a rank that leaves
 * rotation stays in the table and comes back once it answers again (placement's rules).
 *
 * A second thread watches the channels that are not connected, all at once
 * (rpc_clients_wait_connected): a channel reconnects only while some thread waits on it, and
 * when one connects the poller calls that rank's GetLoad at once, so a rank restarted on its
 * port is back in rotation within about one heartbeat interval of answering, and the rounds
 * over the other ranks never wait for a rank that is down.
 */
#ifndef DI_ROUTER_RANKS_H
#define DI_ROUTER_RANKS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/net/rpc.h"
#include "common/util/log.h"
#include "common/util/status.h"
#include "router/placement.h"

typedef struct rk_config {
    pl_config placement;       /* its heartbeat_ns is the polling interval */
    pl_policy policy;
    const char *engine_token;  /* bearer token the ranks want; NULL: none */
    const char *tls_ca_pem;    /* NULL: plaintext gRPC to the ranks */
    const di_logger *log;      /* new ranks at info; health and decisions at debug; may be NULL */
} rk_config;

typedef struct rk_table rk_table;

/* Creates the table and starts the poller. DI_OK, DI_EINVAL (placement config), DI_ENOMEM. */
di_status rk_new(const rk_config *cfg, rk_table **out, di_error *err);
/* Stops the poller and closes the channels. NULL-safe. */
void rk_free(rk_table *t);

/* Adds a rank (or refreshes one: same role and address). *n_role receives the ranks of that
 * role (may be NULL). DI_OK, DI_EINVAL, DI_ENOSPC, DI_ENOMEM. */
di_status rk_add(rk_table *t, pl_role role, const char *addr, bool registered, uint32_t *n_role,
                 di_error *err);

/* A rank chosen for a call: its index, address and channel (valid until rk_free). */
typedef struct rk_pick {
    long idx;                /* -1: none */
    char addr[PL_ADDR_MAX];  /* HOST:PORT */
    rpc_client *client;
} rk_pick;

/* Placement under the lock (see placement.h); exclude SIZE_MAX for none. */
rk_pick rk_pick_prefill(rk_table *t, uint64_t prompt, uint64_t cached, size_t exclude);
rk_pick rk_pick_decode(rk_table *t, uint32_t blocks, size_t exclude);
/* A prefill ended: computed tokens leave the queue; ok and seconds > 0 update the rate. */
void rk_prefill_done(rk_table *t, size_t idx, uint64_t computed, double seconds, bool ok);
/* A decode ended (ok false: the rank failed the call). */
void rk_decode_done(rk_table *t, size_t idx, uint32_t blocks, bool ok);
/* Ranks of a role that can take work now (healthy or suspect). */
size_t rk_usable(rk_table *t, pl_role role);
/* The health of rank idx (PL_OUT when idx is out of range); for tests and logs. */
pl_health rk_health(rk_table *t, size_t idx);
/* A copy of rank idx's record (health, last heartbeat, load); false when idx is out of range.
 * For tests and logs. */
bool rk_rank(rk_table *t, size_t idx, pl_rank *out);
/* Polls every rank once now, on this thread (a start that wants loads before the first
 * request). */
void rk_poll_once(rk_table *t);
/* Heartbeat poll rounds done so far (for tests). */
uint64_t rk_polls(rk_table *t);

#endif
