/* store.h: the KV store core: the object index, the DRAM slab tier and the RocksDB tier behind
 * one mutex, with the disk I/O done outside it, and a sweeper thread.
 *
 * The store owns no network: the caller maps the DRAM arena (with UCX in di-kvstore, plain
 * memory in tests) and hands its address in; clients read and write slots of it directly, and
 * the store only learns of that through alloc/commit and lease/release.
 *
 * Write path: kvs_alloc reserves a slot (invisible), the client fills it, kvs_commit verifies
 * every object's kv_header (checksum, key, model) in the slot, writes the batch to RocksDB at
 * the configured durability and only then makes the objects visible and acknowledges them. A
 * crash at any point before the RocksDB write leaves nothing on disk; after it, a complete and
 * verified object.
 *
 * Read path: kvs_lease pins the object and returns its slot; an object not in DRAM is read
 * from RocksDB into a slot first and verified; a corrupt disk copy is dropped (deleted) and
 * reported as a miss with DI_ENOENT and a message saying so. kvs_release unpins. A DRAM copy
 * that rots after it was verified is caught by the reader's own verification; the reader
 * reports it (kvs_report_corrupt), the store verifies it again and drops it from DRAM, and the
 * next lease loads the disk copy.
 *
 * Start: a RocksDB file that cannot be read (a flipped byte in an SST's footer, index or meta
 * block) is set aside by kvdisk_repair; the store starts with the rest and reports the count
 * (kvs_stats.disk.files_lost) and the reason in its log.
 *
 * Every function is thread-safe. Outputs are written only on success.
 */
#ifndef DI_KVSTORE_STORE_H
#define DI_KVSTORE_STORE_H

#include <stddef.h>
#include <stdint.h>

#include "common/kvfmt/kv_layout.h"
#include "common/kvfmt/kv_keys.h"
#include "common/util/log.h"
#include "common/util/status.h"
#include "kvstore/disk.h"
#include "kvstore/index.h"

typedef struct kvs_config {
    void *arena;                               /* DRAM tier memory (64-byte aligned) */
    uint64_t arena_bytes;                      /* its size */
    uint64_t dram_capacity;                    /* DRAM bound (bytes, <= arena); 0 = arena */
    double dram_share[KVKEY_CLASS_COUNT];      /* arena fraction per class */
    kv_geometry geometry;                      /* model the KV belongs to (verification) */
    uint64_t object_bytes[KVKEY_CLASS_COUNT];  /* exact block and window sizes; handoff max */
    kvdisk_config disk;                        /* RocksDB directory and durability */
    uint64_t disk_capacity;                    /* disk bound (object bytes) */
    uint64_t ttl_ms[KVKEY_CLASS_COUNT];        /* per class; 0 = never */
    uint64_t alloc_timeout_ms;                 /* uncommitted allocations reclaimed after */
    uint64_t lease_max_ms;                     /* longest lease */
    uint32_t max_leases;                       /* lease records */
    uint32_t max_objects;                      /* index entries */
    uint32_t sweep_interval_ms;                /* sweeper period; 0 = 200 */
    const di_logger *log;                      /* debug lines; may be NULL */
} kvs_config;

typedef struct kvs_store kvs_store;

/* Opens the disk tier, rebuilds the index from it (objects come back not in DRAM) and starts
 * the sweeper. DI_OK; DI_EINVAL (config, geometry stamp mismatch); RocksDB errors; DI_ENOMEM.
 * *out written only on success. */
di_status kvs_open(const kvs_config *cfg, kvs_store **out, di_error *err);
/* Stops the sweeper, finishes queued disk deletes, closes RocksDB. NULL-safe; returns NULL. */
kvs_store *kvs_close(kvs_store *s);

/* Longest cached prefix (kvidx_lookup). */
void kvs_lookup(kvs_store *s, const kvkey *keys, size_t n, uint32_t *blocks_hit,
                uint32_t *windows, size_t max_windows, size_t *n_windows);

/* Reserves a slot for an object. Blocks and window states must have exactly their size,
 * handoffs at most the handoff maximum (DI_EINVAL otherwise). *offset is the slot's offset in
 * the arena. Other codes as kvidx_alloc (DI_EEXIST: already stored). */
di_status kvs_alloc(kvs_store *s, int cls, const kvkey *key, uint64_t bytes, uint64_t *alloc_id,
                    uint64_t *offset, di_error *err);
/* Commits a batch: st[i] and errs[i] (may be NULL) receive each item's outcome. Items that
 * verify are written in one RocksDB batch; DI_OK for an item means it is durable at the
 * configured level and visible. Failures: DI_ENOENT/DI_ETIMEDOUT (allocation unknown or
 * expired), DI_ECORRUPT (bytes in the slot fail verification), DI_ENOSPC/DI_EIO (disk). */
void kvs_commit(kvs_store *s, const uint64_t *alloc_ids, size_t n, di_status *st, di_error *errs);
/* Drops an uncommitted allocation. DI_OK, DI_ENOENT (unknown or reclaimed), DI_ESTATE
 * (committing). */
di_status kvs_abort(kvs_store *s, uint64_t alloc_id, di_error *err);

/* A granted lease. */
typedef struct kvs_lease_info {
    uint64_t lease_id;     /* for kvs_release */
    uint64_t offset;       /* slot offset in the arena */
    uint64_t bytes;        /* object size */
    uint64_t expires_in_ms;
} kvs_lease_info;

/* Pins an object in DRAM for lease_ms (loading and verifying it from disk if needed). DI_OK,
 * DI_ENOENT (absent, expired, or dropped as corrupt: the message says which), DI_EFULL (no
 * DRAM slot or lease record), DI_ETIMEDOUT (deadline_ns passed waiting for another load),
 * disk read errors. */
di_status kvs_lease(kvs_store *s, int cls, const kvkey *key, uint64_t lease_ms,
                    uint64_t deadline_ns, kvs_lease_info *info, di_error *err);
/* Ends a lease. DI_OK; DI_ETIMEDOUT when it had timed out first (bytes read under it may be
 * stale); DI_ENOENT for an unknown id. */
di_status kvs_release(kvs_store *s, uint64_t lease_id, di_error *err);
/* A reader found the DRAM copy of an object failing verification. The store verifies the copy
 * itself (a report alone changes nothing) and, when it is bad, drops it from DRAM and counts it
 * in corrupt_dropped; the disk copy stays, so the next lease loads and verifies that (or
 * reports a miss if it is bad too). DI_OK: the copy was corrupt and is dropped; DI_EEXIST: the
 * copy verifies (the damage happened on the way to the reader: read again); DI_ENOENT: no DRAM
 * copy (not stored, or dropped already); DI_EINVAL. */
di_status kvs_report_corrupt(kvs_store *s, int cls, const kvkey *key, di_error *err);
/* Deletes an object: invisible at once; gone from disk when this returns, or when the last
 * lease on it ends. DI_OK, DI_ENOENT. */
di_status kvs_delete(kvs_store *s, int cls, const kvkey *key, di_error *err);

/* ---- admin ---- */
typedef struct kvs_stats {
    kvidx_stats idx;                              /* counters and per-class sizes */
    kvslab_class_stats slab[KVKEY_CLASS_COUNT];   /* DRAM slots per class */
    uint64_t dram_capacity;                       /* bytes */
    uint64_t dram_arena_bytes;
    uint64_t ttl_ms[KVKEY_CLASS_COUNT];
    kvdisk_usage disk;                            /* RocksDB figures */
    uint64_t get_bytes;                           /* bytes leased since start */
    uint64_t put_bytes;                           /* bytes committed since start */
    double get_bytes_per_s;                       /* over the last 10 s */
    double put_bytes_per_s;
    uint64_t uptime_ms;
    uint64_t disk_meta_bad;                       /* meta records dropped at open (checksum) */
} kvs_stats;
void kvs_get_stats(kvs_store *s, kvs_stats *out);

di_status kvs_set_ttl(kvs_store *s, int cls, uint64_t ttl_ms, di_error *err);
/* tier 0 = DRAM, 1 = disk. Lowering evicts at once. DI_ERANGE / DI_EINVAL with the reason. */
di_status kvs_set_capacity(kvs_store *s, int tier, uint64_t bytes, di_error *err);
void kvs_inspect(kvs_store *s, int cls, const kvkey *key, kvidx_info *info, uint64_t *now_ms);
void kvs_evict(kvs_store *s, unsigned class_mask, int dram_only, uint64_t *evicted,
               uint64_t *skipped);
/* Evicts one object (DRAM copy only, or entirely). DI_OK, DI_ENOENT, DI_EBUSY (leased). */
di_status kvs_evict_key(kvs_store *s, int cls, const kvkey *key, int dram_only, di_error *err);
/* Sweeps expired objects, then compacts RocksDB. */
void kvs_compact(kvs_store *s, uint64_t *expired, uint64_t *sst_before, uint64_t *sst_after);

/* The store clock (ms, wall-anchored, monotonic while running). */
uint64_t kvs_now_ms(kvs_store *s);
/* Test hook: the disk tier (for kvdisk_fail_write_after). */
kvdisk *kvs_disk(kvs_store *s);

#endif
