/* service.h: the KV store's gRPC service (di.kvstore.KvStore): one method-table row per RPC
 * (handler, default deadline, idempotent or not, largest request, role) and handlers that
 * unpack protobuf-c requests, call the store and pack replies; and the checks of both data
 * paths. UCX: Alloc and Lease issue one-time tickets (kvstore/tickets.h) that are the only way
 * to move bytes into or out of the arena. gRPC: Get and Put carry the bytes in their messages;
 * they take tickets of their own and use them at once, so the copies into and out of the arena
 * go through the same checks (exact length, one use) and no Release, Commit or Abort of another
 * caller can free a slot under a copy. Malformed messages get
 * DI_EPROTO with the message type; wrong key lengths, classes or batch sizes DI_EINVAL. Item
 * failures that point at a fault (corrupt bytes, disk errors, exhaustion) are logged once here
 * with the peer and the key; misses are not logged. */
#ifndef DI_KVSTORE_SERVICE_H
#define DI_KVSTORE_SERVICE_H

#include <stddef.h>
#include <stdint.h>

#include "common/net/rpc.h"
#include "common/net/ucx_xport.h"
#include "common/util/log_limit.h"
#include "kvstore/store.h"

typedef struct kvsvc_config {
    kvs_store *store;            /* the store (not owned) */
    kv_geometry geometry;        /* reported by Connect */
    uint64_t object_bytes[KVKEY_CLASS_COUNT];
    const void *worker_addr;     /* UCX worker address (copied) */
    size_t worker_addr_len;
    uint8_t *arena;              /* the DRAM arena (private to the store) */
    uint64_t arena_bytes;
    uint64_t alloc_timeout_ms;   /* tickets of allocations expire with them */
    uint64_t store_id;           /* random per start */
    int durability;              /* kvdisk_durability */
    uint32_t lease_default_ms;   /* lease when a request asks for 0 */
    uint32_t lease_max_ms;
    const di_logger *log;        /* item-failure lines */
    unsigned data_paths;         /* KVC_PATHS_UCX | KVC_PATHS_GRPC offered; 0 = both */
} kvsvc_config;

typedef struct kvsvc kvsvc;

/* DI_OK, DI_ENOMEM. */
di_status kvsvc_create(const kvsvc_config *cfg, kvsvc **out, di_error *err);
kvsvc *kvsvc_free(kvsvc *svc);
/* Periodic work (about once a second): writes the counts of rate-limited log lines. */
void kvsvc_tick(kvsvc *svc);
/* The method table (static); pass svc as the server's svc pointer. */
const rpc_method *kvsvc_methods(size_t *n);
/* The checks of the UCX data path (tickets against the arena), for ucxt_serve. */
void kvsvc_data_path(kvsvc *svc, ucxt_server_ops *ops);
/* Tickets held (tests and stats). */
uint64_t kvsvc_tickets(kvsvc *svc);

#endif
