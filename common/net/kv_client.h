/* kv_client.h: the KV store client library, linked by the prefill and decode engines, the
 * router and di-kvctl.
 *
 * One kvc_client talks to one store: control over gRPC (common/net/rpc.h), KV bytes on one of
 * two data paths (kvc_options.data_path):
 *   UCX:  active messages between the caller's buffers and the store's DRAM tier
 *         (common/net/ucx_xport.h), each against a one-time ticket the control call returned
 *         for that object (shared memory on one host, RDMA across hosts);
 *   gRPC: the bytes inside Get replies and Put requests, on the control channel with its TLS
 *         and token (any network, no UCX).
 * It connects lazily and again after a store restart (the store id changes), so callers
 * just retry a call that returned DI_EUNAVAIL.
 *
 *   get  = Lease (one RPC for a batch, a ticket per object) + one UCX request per object that
 *          the store answers with the object's bytes into the caller's buffer + checks of every
 *          object's kv_header (checksum, key, model). The store releases each lease once it sent
 *          the bytes: no Release call unless a transfer failed.
 *   put  = Alloc (one RPC, a ticket per object) + one UCX message per object that the store
 *          receives into the allocated slot and acknowledges + Commit (one RPC); the store
 *          verifies each object and acknowledges it only once durable at its --durability level.
 *
 * On the gRPC path: get = Get (one RPC per up to KVC_GRPC_MAX_DATA bytes of objects) + the same
 * checks; put = Put (allocation, copy and commit in one RPC per up to KVC_GRPC_MAX_DATA bytes).
 *
 * The verification of a batch is shared between the caller and verify_threads helpers as the
 * objects arrive.
 *
 * Every call has a deadline (kvc_options.deadline_ms unless the call takes one) and returns a
 * di_status with a message: DI_EUNAVAIL (store down or unreachable), DI_ETIMEDOUT (deadline),
 * DI_ENOENT (not stored, expired, or dropped as corrupt), DI_EPERM / DI_EAUTH (token),
 * DI_EFULL / DI_ENOSPC (store out of DRAM slots, leases or disk), DI_ECORRUPT (bytes failed
 * verification after a transfer), DI_EINVAL (bad arguments, wrong object size). Batch calls
 * return per-item results and DI_OK when the batch as a whole ran.
 *
 * A client is used by one thread at a time (kvc_cancel excepted); engines open one per thread.
 */
#ifndef DI_NET_KV_CLIENT_H
#define DI_NET_KV_CLIENT_H

#include <stddef.h>
#include <stdint.h>

#include "common/kvfmt/kv_layout.h"
#include "common/kvfmt/kv_keys.h"
#include "common/util/log.h"
#include "common/util/status.h"

#define KVC_SERVICE "/di.kvstore.KvStore/"
#define KVC_MAX_BATCH 1024u    /* most items in one Alloc, Commit, Lease, Release or Delete */
#define KVC_MAX_LOOKUP 16384u  /* most keys in one Lookup or Inspect (2M tokens) */
/* The gRPC data path: the largest Get reply or Put request (both ends set gRPC's message
 * limits to it), and the object bytes one message may carry (the rest is headroom for keys,
 * statuses and framing). */
#define KVC_GRPC_MAX_MESSAGE (64u << 20)
#define KVC_GRPC_MAX_DATA (KVC_GRPC_MAX_MESSAGE - (1u << 20))

/* Which data path moves the bytes. */
typedef enum kvc_data_path {
    KVC_PATH_AUTO = 0, /* UCX when the store offers it and is on this host (a loopback target)
                          or rdma_devices are given and UCX comes up; else gRPC */
    KVC_PATH_UCX = 1,  /* UCX only (DI_EUNAVAIL when the store does not offer it) */
    KVC_PATH_GRPC = 2, /* gRPC only */
} kvc_data_path;
/* Bits of the data paths a store offers (kvc_store_info.data_paths). */
#define KVC_PATHS_UCX 1u
#define KVC_PATHS_GRPC 2u

/* "auto", "ucx", "grpc" -> *out. DI_OK or DI_EINVAL with the accepted names. */
di_status kvc_data_path_parse(const char *s, kvc_data_path *out, di_error *err);
const char *kvc_data_path_name(kvc_data_path p);

typedef struct kvc_options {
    const char *target;          /* "host:port" of di-kvstore */
    const char *token;           /* engine or admin token; NULL when the store has none */
    const char *tls_ca_pem;      /* NULL: plaintext gRPC */
    const char *tls_target_name; /* name on the store's certificate; NULL: the host */
    const char *tls_cert_pem;    /* client certificate chain (mutual TLS: a store started with
                                    --tls-client-ca); NULL: none */
    const char *tls_key_pem;     /* its private key */
    uint32_t deadline_ms;        /* per call; 0 = 10,000 */
    uint32_t lease_ms;           /* lease asked for by gets; 0 = 10,000 */
    uint64_t model_id;           /* refuse a store holding another model's KV; 0 = any */
    int verify;                  /* 1 (default when built by kvc_options_default): verify
                                    objects after every get */
    int verify_threads;          /* helper threads sharing the per-object copy and verification
                                    work of a batch with the caller; 0 = all on the caller */
    const char *rdma_devices;    /* UCX verbs ports for stores on other hosts ("mlx5_0:1");
                                    NULL: stores on this host only */
    kvc_data_path data_path;     /* KVC_PATH_AUTO (default), _UCX or _GRPC */
    const di_logger *log;        /* debug lines; may be NULL */
} kvc_options;

/* Defaults: deadline 10 s, lease 10 s, verify on, one verification thread. */
void kvc_options_default(kvc_options *o);

typedef struct kvc_client kvc_client;

/* Creates a client; nothing is sent until the first call. DI_OK, DI_EINVAL, DI_ENOMEM. */
di_status kvc_open(const kvc_options *o, kvc_client **out, di_error *err);
/* NULL-safe; returns NULL. */
kvc_client *kvc_close(kvc_client *c);
/* Cancels the RPC in flight (from another thread); the call returns DI_ECANCELED. */
void kvc_cancel(kvc_client *c);

/* What the store told us at connect time. */
typedef struct kvc_store_info {
    uint64_t store_id;          /* changes when the store restarts */
    kv_geometry geometry;       /* model geometry (for verification and keys) */
    uint64_t object_bytes[KVKEY_CLASS_COUNT]; /* block, window; handoff maximum */
    char durability[8];         /* "none", "wal", "fsync" */
    uint32_t lease_max_ms;
    uint64_t ttl_ms[KVKEY_CLASS_COUNT]; /* TTL per class at connect time, ms; 0 = never (or a
                                           store that does not say) */
    uint32_t data_paths;        /* KVC_PATHS_* the store offers */
    kvc_data_path path;         /* the one this client uses (UCX or GRPC) */
} kvc_store_info;
/* Connects if needed and returns the store's description. DI_OK; DI_EUNAVAIL, DI_ETIMEDOUT,
 * DI_EAUTH, DI_EINVAL (the store holds another model than options.model_id). */
di_status kvc_info(kvc_client *c, kvc_store_info *out, di_error *err);

/* Longest cached prefix of a prompt's block keys: *blocks_hit leading blocks are stored;
 * windows[0..*n_windows) lists each k <= *blocks_hit with a window state at 128*k. Hits refresh
 * the objects' TTLs. DI_OK; DI_EINVAL (more than KVC_MAX_LOOKUP keys, NULL pointers); the
 * call's failures (DI_EUNAVAIL, DI_ETIMEDOUT, DI_EAUTH, ...). Outputs written only on DI_OK. */
di_status kvc_lookup(kvc_client *c, const kvkey *keys, size_t n, uint32_t *blocks_hit,
                     uint32_t *windows, size_t max_windows, size_t *n_windows, di_error *err);

/* One object of a batch get or put. */
typedef struct kvc_item {
    int cls;           /* kvkey_class */
    kvkey key;         /* object key */
    void *buf;         /* get: destination; put: source (const) */
    uint64_t cap;      /* get: buffer capacity; put: object size */
    uint64_t bytes;    /* get: object size, written on success */
    di_status status;  /* per-item outcome (DI_EEXIST on put: already stored, fine) */
    di_error error;    /* its message */
} kvc_item;

/* Reads up to KVC_MAX_BATCH objects into their buffers. Items that fail (not stored, buffer
 * too small, failed verification) have their own status; a failure of the whole batch
 * (store unreachable, deadline) is returned and marks every item with it. An object that fails
 * verification is reported to the store (ReportCorrupt: the store checks its DRAM copy and
 * drops it if bad) and read once more, which returns the disk copy, a miss, or DI_ECORRUPT
 * again; a corrupt object is never returned as DI_OK. */
di_status kvc_get(kvc_client *c, kvc_item *items, size_t n, di_error *err);
/* Writes up to KVC_MAX_BATCH objects (each a full object with its kv_header). An item is
 * DI_OK once durable at the store's level, DI_EEXIST when already stored. */
di_status kvc_put(kvc_client *c, kvc_item *items, size_t n, di_error *err);
/* Deletes objects; per-item status (DI_ENOENT when absent). */
di_status kvc_delete(kvc_client *c, kvc_item *items, size_t n, di_error *err);

/* Single-object conveniences over the batch calls; they return the batch's failure or else
 * the item's status (DI_OK, DI_ENOENT, DI_EEXIST for a put of a stored object, ...). */
di_status kvc_get1(kvc_client *c, int cls, const kvkey *key, void *buf, uint64_t cap,
                   uint64_t *bytes, di_error *err);
di_status kvc_put1(kvc_client *c, int cls, const kvkey *key, const void *obj, uint64_t bytes,
                   di_error *err);
di_status kvc_delete1(kvc_client *c, int cls, const kvkey *key, di_error *err);

/* ---- lower level: a lease held across the caller's own transfers ---- */

typedef struct kvc_lease {
    uint64_t lease_id;     /* for kvc_release */
    uint8_t ticket[16];    /* one-time: kvc_read uses it */
    uint64_t bytes;        /* object size */
    uint32_t expires_in_ms;
} kvc_lease;
/* Leases one object for lease_ms (clamped by the store). DI_OK (*out written), DI_ENOENT,
 * DI_EFULL (no DRAM slot or lease record), and the call's failures. */
di_status kvc_acquire(kvc_client *c, int cls, const kvkey *key, uint32_t lease_ms, kvc_lease *out,
                      di_error *err);
/* Copies a leased object into buf with verification (unless verify is off), once per lease (the
 * ticket is one-time: a second read is refused with DI_EAUTH; on the gRPC path the object,
 * pinned by the lease, is read with Get and the ticket is left unused). DI_OK, DI_ERANGE (buf too
 * small), DI_ECORRUPT (failed verification; reported to the store, which drops a bad DRAM copy
 * once the lease ends: acquire again), DI_EUNAVAIL (connection lost: acquire again),
 * DI_ETIMEDOUT (the lease expired). buf is written even on failure. */
di_status kvc_read(kvc_client *c, int cls, const kvkey *key, const kvc_lease *l, void *buf,
                   uint64_t cap, di_error *err);
/* Ends a lease. DI_ETIMEDOUT when it had already expired: discard what was read under it. */
di_status kvc_release(kvc_client *c, const kvc_lease *l, di_error *err);

/* ---- raw control calls (di-kvctl and tests) ---- */

/* Sends one request message (already packed) to method name ("Stats") and returns the reply
 * bytes (malloc'd). */
di_status kvc_call(kvc_client *c, const char *method, const void *req, size_t len,
                   uint8_t **reply, size_t *reply_len, di_error *err);

#endif
