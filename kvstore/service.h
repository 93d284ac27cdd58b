/* service.h: the KV store's gRPC service (di.kvstore.KvStore): one method-table row per RPC
 * (handler, default deadline, idempotent or not, largest request, role) and handlers that
 * unpack protobuf-c requests, call the store and pack replies. Malformed messages get
 * DI_EPROTO with the message type; wrong key lengths, classes or batch sizes DI_EINVAL. Item
 * failures that point at a fault (corrupt bytes, disk errors, exhaustion) are logged once here
 * with the peer and the key; misses are not logged. */
#ifndef DI_KVSTORE_SERVICE_H
#define DI_KVSTORE_SERVICE_H

#include <stddef.h>
#include <stdint.h>

#include "common/net/rpc.h"
#include "common/util/log_limit.h"
#include "kvstore/store.h"

typedef struct kvsvc_config {
    kvs_store *store;            /* the store (not owned) */
    kv_geometry geometry;        /* reported by Connect */
    uint64_t object_bytes[KVKEY_CLASS_COUNT];
    const void *worker_addr;     /* UCX worker address (copied) */
    size_t worker_addr_len;
    const void *rkey;            /* packed remote key of the arena (copied) */
    size_t rkey_len;
    uint64_t arena_base;         /* arena address as peers see it */
    uint64_t arena_bytes;
    uint64_t store_id;           /* random per start */
    int durability;              /* kvdisk_durability */
    uint32_t lease_default_ms;   /* lease when a request asks for 0 */
    uint32_t lease_max_ms;
    const di_logger *log;        /* item-failure lines */
} kvsvc_config;

typedef struct kvsvc kvsvc;

/* DI_OK, DI_ENOMEM. */
di_status kvsvc_create(const kvsvc_config *cfg, kvsvc **out, di_error *err);
kvsvc *kvsvc_free(kvsvc *svc);
/* Periodic work (about once a second): writes the counts of rate-limited log lines. */
void kvsvc_tick(kvsvc *svc);
/* The method table (static); pass svc as the server's svc pointer. */
const rpc_method *kvsvc_methods(size_t *n);

#endif
