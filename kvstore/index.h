/* index.h: the store's object index: states, TTL, capacity and eviction, leases.
 *
 * Pure logic with a caller-supplied clock (`now`, milliseconds on the store clock, which is
 * wall-clock anchored at start and monotonic while running), so every rule is unit-tested with
 * a fake clock. No I/O, no locks (the store's mutex covers every call), no logging. The index
 * decides; the store performs the disk reads and writes the index asks for.
 *
 * Object lifecycle (one object = one (class, key)):
 *
 *     kvidx_alloc         kvidx_commit_begin        kvidx_commit_end(ok)
 *   ------------> WRITING ------------------> COMMITTING -----------------> SEALED
 *                   |  kvidx_abort, alloc       | kvidx_commit_end(fail)     |  kvidx_delete, TTL
 *                   |  timeout (sweep)          v                            |  expiry, disk-tier
 *                   +---------------------> (freed)                          |  eviction, corrupt
 *                                                                             v  load, admin evict
 *                                        (freed) <-- disk delete done -- DELETING
 *
 *   WRITING     a DRAM slot is reserved and the writer fills it with a UCX put; invisible to
 *               lookups and leases. Reclaimed if not committed within alloc_timeout_ms.
 *   COMMITTING  the store is verifying the bytes and writing them to RocksDB; invisible.
 *   SEALED      on disk; visible. May also be in DRAM (resident, or loading from disk).
 *   DELETING    invisible; waits until no lease or I/O pins it, then the store deletes it from
 *               disk (kvidx_take_disk_deletes / kvidx_disk_deleted) and the index frees it. A
 *               new allocation of the same key gets DI_EBUSY until then, so a late disk delete
 *               can never remove a newer copy.
 *
 * DRAM residency of a SEALED object: NONE -> LOADING (kvidx_lease reserved a slot; the store
 * reads the disk copy into it) -> RESIDENT (kvidx_load_done ok) -> NONE (DRAM eviction).
 *
 * Pins: every lease pins its object, and the store pins an object around its own I/O. A pinned
 * object is never expired, evicted or freed and its DRAM slot is never reused; a lease held
 * across its object's expiry keeps it readable, and the object goes when the last pin goes.
 *
 * TTL: an object expires ttl_ms[class] after its last hit (commit, lookup hit, lease, re-put);
 * a TTL change applies to every object of the class at once. Eviction, in DRAM (per class, to
 * honour slot limits) and on disk (across classes, to honour the byte capacity), takes expired
 * objects first, then the least recently used; pinned objects are skipped.
 */
#ifndef DI_KVSTORE_INDEX_H
#define DI_KVSTORE_INDEX_H

#include <stddef.h>
#include <stdint.h>

#include "common/kvfmt/kv_keys.h"
#include "common/util/status.h"
#include "kvstore/slab.h"

typedef enum kvidx_state {
    KVIDX_WRITING = 0,
    KVIDX_COMMITTING = 1,
    KVIDX_SEALED = 2,
    KVIDX_DELETING = 3,
} kvidx_state;

typedef enum kvidx_dram {
    KVIDX_DRAM_NONE = 0,     /* no DRAM copy */
    KVIDX_DRAM_LOADING = 1,  /* slot reserved, disk read in progress */
    KVIDX_DRAM_RESIDENT = 2, /* slot holds the verified object */
} kvidx_dram;

/* Why an object left the index (for stats and logs). */
typedef enum kvidx_reason {
    KVIDX_GONE_DELETED = 0,  /* kvidx_delete */
    KVIDX_GONE_EXPIRED = 1,  /* TTL */
    KVIDX_GONE_EVICTED = 2,  /* disk-tier capacity or admin evict */
    KVIDX_GONE_CORRUPT = 3,  /* disk copy failed verification */
    KVIDX_GONE_FAILED = 4,   /* commit failed */
} kvidx_reason;

typedef struct kvidx_obj kvidx_obj;

/* Links of one doubly linked list an object can be on. */
typedef struct kvidx_link {
    kvidx_obj *prev; /* towards the head (more recent) */
    kvidx_obj *next; /* towards the tail (less recent) */
} kvidx_link;

/* One object. Every field is written by the index only; the store reads cls, key, bytes,
 * slot, state and dram. */
struct kvidx_obj {
    kvkey key;                   /* object key */
    uint8_t cls;                 /* kvkey_class */
    uint8_t state;               /* kvidx_state */
    uint8_t dram;                /* kvidx_dram */
    uint8_t disk_queue;          /* DELETING: 0 not queued, 1 queued, 2 handed to the store */
    uint8_t on_disk;             /* 1 once a disk write may have happened (delete needed) */
    uint8_t has_slot;            /* 1 while a DRAM slot is held */
    uint8_t reason;              /* DELETING: kvidx_reason */
    uint8_t dram_bad;            /* 1: the DRAM copy failed verification and left DRAM; the
                                    slot goes with the last pin (readers still hold it) */
    uint32_t pins;               /* leases + store I/O pins */
    uint32_t slot;               /* DRAM slot (valid when has_slot) */
    uint32_t gen;                /* allocation generation, part of the allocation id */
    uint64_t bytes;              /* object size (bytes) */
    uint64_t last_access_ms;     /* last hit (store clock); expiry = this + ttl of the class */
    uint64_t persisted_access_ms; /* last_access_ms value on disk (written by the store too) */
    uint64_t deadline_ms;        /* WRITING: reclaimed at this time */
    kvidx_obj *hnext;            /* hash chain */
    kvidx_link lru;              /* SEALED: disk LRU of the class; WRITING: allocation list */
    kvidx_link dlru;             /* SEALED and RESIDENT: DRAM LRU of the class */
    kvidx_obj *qnext;            /* DELETING: disk-delete queue */
};

typedef struct kvidx_config {
    uint64_t ttl_ms[KVKEY_CLASS_COUNT]; /* time to live after the last hit; 0 = never expires */
    uint64_t disk_capacity;             /* disk tier bound (object bytes) */
    uint64_t alloc_timeout_ms;          /* uncommitted allocations are reclaimed after this */
    uint64_t lease_max_ms;              /* longest lease granted */
    uint32_t max_leases;                /* live + recently expired lease records */
    uint32_t max_objects;               /* objects in every state together */
    uint64_t hash_seed;                 /* seeds the key hash (random per process) */
} kvidx_config;

/* A granted lease. */
typedef struct kvidx_lease_info {
    uint64_t lease_id;   /* pass to kvidx_release */
    kvidx_obj *obj;      /* the leased object (pinned) */
    uint64_t expires_ms; /* lease end (store clock) */
    int need_load;       /* 1: the store must read the disk copy into the slot, then call
                            kvidx_load_done */
} kvidx_lease_info;

/* What kvidx_inspect reports about one (class, key). */
typedef struct kvidx_info {
    int present;         /* 1 when SEALED and not expired */
    int resident;        /* 1 when a verified DRAM copy exists */
    uint64_t bytes;      /* object size */
    uint64_t expires_ms; /* expiry (store clock); UINT64_MAX when the TTL is 0 */
    uint32_t pins;       /* leases and I/O pins */
} kvidx_info;

typedef struct kvidx_class_stats {
    uint64_t objects;      /* SEALED objects */
    uint64_t bytes;        /* their bytes */
    uint64_t dram_objects; /* of those, resident in DRAM */
    uint64_t dram_bytes;   /* their bytes */
    uint64_t writing;      /* allocations in WRITING or COMMITTING */
} kvidx_class_stats;

typedef struct kvidx_stats {
    kvidx_class_stats cls[KVKEY_CLASS_COUNT];
    uint64_t disk_used;         /* bytes of SEALED + in-flight objects (capacity accounting) */
    uint64_t disk_capacity;     /* bound (bytes) */
    uint64_t disk_deleting;     /* bytes waiting for their disk delete */
    uint64_t lease_hits;        /* leases granted */
    uint64_t lease_misses;      /* leases refused: not present */
    uint64_t lookup_blocks;     /* block keys asked in lookups */
    uint64_t lookup_hits;       /* of those, inside the hit prefix */
    uint64_t dram_evictions;    /* DRAM copies dropped for room */
    uint64_t disk_evictions;    /* objects removed for disk capacity or by admin evict */
    uint64_t expirations;       /* objects removed by TTL */
    uint64_t corrupt_dropped;   /* disk copies that failed verification, and DRAM copies
                                   found corrupt after a reader reported them */
    uint64_t deletes;           /* kvidx_delete */
    uint64_t commits;           /* objects sealed */
    uint64_t commit_failures;   /* commits that failed */
    uint64_t alloc_reclaimed;   /* allocations reclaimed after the timeout */
    uint64_t promotions;        /* disk -> DRAM loads started */
    uint64_t leases_active;     /* leases currently held */
    uint64_t leases_timed_out;  /* leases that ended by timeout */
} kvidx_stats;

/* What one kvidx_sweep did. */
typedef struct kvidx_sweep_report {
    uint32_t allocs_reclaimed;
    uint32_t leases_timed_out;
    uint32_t expired;
    uint32_t dram_evicted;
    uint32_t disk_evicted;
} kvidx_sweep_report;

typedef struct kvidx kvidx;

/* DI_OK, DI_EINVAL (zero bounds, lease_max_ms 0), DI_ENOMEM. The index uses slab for DRAM
 * slots; slab must outlive it. */
di_status kvidx_create(const kvidx_config *cfg, kvslab *slab, kvidx **out, di_error *err);
/* Frees every object and lease. NULL-safe; returns NULL. */
kvidx *kvidx_free(kvidx *idx);

/* ---- write path ---- */

/* Reserves a DRAM slot and disk bytes for a new object (evicting as needed) and returns its
 * allocation id. Returns:
 *   DI_OK      *alloc_id and *obj written; the object is WRITING.
 *   DI_EEXIST  the object is already SEALED (its TTL is refreshed); nothing reserved.
 *   DI_EBUSY   the key is being written by another allocation or being deleted.
 *   DI_EINVAL  bytes is 0 or larger than the class's slot.
 *   DI_EFULL   no DRAM slot can be freed (all pinned or in flight) or max_objects reached.
 *   DI_ENOSPC  the disk capacity cannot be met (the rest is pinned or in flight).
 * On failure nothing changes except evictions already made for room. */
di_status kvidx_alloc(kvidx *idx, int cls, const kvkey *key, uint64_t bytes, uint64_t now,
                      uint64_t *alloc_id, kvidx_obj **obj, di_error *err);
/* Drops a WRITING allocation. DI_OK, DI_ENOENT (unknown or reclaimed), DI_ESTATE (already
 * committing). */
di_status kvidx_abort(kvidx *idx, uint64_t alloc_id, di_error *err);
/* WRITING -> COMMITTING. DI_OK (*obj written), DI_ENOENT (unknown id), DI_ETIMEDOUT (past its
 * deadline: reclaimed now), DI_ESTATE (a commit of it is already running). */
di_status kvidx_commit_begin(kvidx *idx, uint64_t alloc_id, uint64_t now, kvidx_obj **obj,
                             di_error *err);
/* Ends a commit: ok -> SEALED and visible (resident in its slot); failure -> freed, or
 * DELETING when wrote_disk says the disk may hold part of it. */
void kvidx_commit_end(kvidx *idx, kvidx_obj *obj, int ok, int wrote_disk, uint64_t now);

/* ---- read path ---- */

/* Grants a lease of lease_ms (clamped to lease_max_ms, at least 1) on a SEALED object and
 * refreshes its TTL. When the object is not in DRAM a slot is reserved (evicting) and
 * info->need_load is set. Returns DI_OK (*info written), DI_ENOENT (absent, expired,
 * DELETING), DI_EBUSY (another lease is loading it: wait and retry), DI_EFULL (no DRAM slot or
 * lease record free). */
di_status kvidx_lease(kvidx *idx, int cls, const kvkey *key, uint64_t lease_ms, uint64_t now,
                      kvidx_lease_info *info, di_error *err);
/* How a load from disk ended. */
typedef enum kvidx_load {
    KVIDX_LOAD_OK = 0,      /* verified: the object is RESIDENT */
    KVIDX_LOAD_CORRUPT = 1, /* missing or corrupt on disk: the object is dropped (DELETING) */
    KVIDX_LOAD_RETRY = 2,   /* transient read error: the slot is freed, the object stays */
} kvidx_load;

/* Ends a load started by kvidx_lease. The lease stays until released. */
void kvidx_load_done(kvidx *idx, kvidx_obj *obj, kvidx_load result, uint64_t now);
/* A corrupt DRAM copy (reported by a reader, verified again by the store):
 * kvidx_pin_resident pins the live object's verified DRAM copy (NULL when there is none);
 * after checking it outside the lock the store calls kvidx_dram_corrupt if it is bad (the copy
 * leaves DRAM, counted in corrupt_dropped; the object stays on disk, so the next lease loads
 * it again; while older leases still hold the slot, new leases get DI_ENOENT), then
 * kvidx_unpin. kvidx_dram_corrupt returns 0 when the copy had already gone meanwhile. */
kvidx_obj *kvidx_pin_resident(kvidx *idx, int cls, const kvkey *key, uint64_t now);
int kvidx_dram_corrupt(kvidx *idx, kvidx_obj *obj);
/* Ends a lease. DI_OK; DI_ETIMEDOUT when it had already timed out (the slot may have been
 * reused: data read under it must be discarded); DI_ENOENT for an unknown id. */
di_status kvidx_release(kvidx *idx, uint64_t lease_id, uint64_t now, di_error *err);
/* Pins around store I/O. kvidx_unpin may free the slot or queue a disk delete. */
void kvidx_pin(kvidx *idx, kvidx_obj *obj);
void kvidx_unpin(kvidx *idx, kvidx_obj *obj, uint64_t now);

/* Longest cached prefix: *blocks_hit = number of leading block keys that are SEALED; windows
 * receives, in increasing order, each k in [1, *blocks_hit] for which the window state keyed by
 * keys[k-1] is SEALED (at most max_windows). Hits refresh TTLs. */
void kvidx_lookup(kvidx *idx, const kvkey *keys, size_t n, uint64_t now, uint32_t *blocks_hit,
                  uint32_t *windows, size_t max_windows, size_t *n_windows);
/* Reports on an object without refreshing it. */
void kvidx_inspect(kvidx *idx, int cls, const kvkey *key, uint64_t now, kvidx_info *info);
/* Deletes a SEALED object (DELETING; readers holding leases keep their copy until release).
 * DI_OK, DI_ENOENT. */
di_status kvidx_delete(kvidx *idx, int cls, const kvkey *key, uint64_t now, di_error *err);

/* Admin eviction of every unpinned object of the classes in class_mask (bit 1 << cls). With
 * dram_only the DRAM copies are dropped and the objects stay on disk; otherwise the objects are
 * removed. Writes the count in *evicted and the pinned objects left alone in *skipped. */
void kvidx_evict(kvidx *idx, unsigned class_mask, int dram_only, uint64_t now, uint64_t *evicted,
                 uint64_t *skipped);

/* Admin eviction of one object: its DRAM copy (dram_only) or the whole object. DI_OK,
 * DI_ENOENT (not stored, or not in DRAM for dram_only), DI_EBUSY (leased). */
di_status kvidx_evict_key(kvidx *idx, int cls, const kvkey *key, int dram_only, uint64_t now,
                          di_error *err);

/* Periodic work: reclaims timed-out allocations and leases, expires objects, evicts down to the
 * capacities. report may be NULL. */
void kvidx_sweep(kvidx *idx, uint64_t now, kvidx_sweep_report *report);

/* Hands the store up to max objects whose disk copy must be deleted; each must come back
 * through kvidx_disk_deleted. Returns the count. */
size_t kvidx_take_disk_deletes(kvidx *idx, kvidx_obj **out, size_t max);
/* ok: the object is freed. Failure: queued again for a later attempt. */
void kvidx_disk_deleted(kvidx *idx, kvidx_obj *obj, int ok);

/* An object found on disk at start. */
typedef struct kvidx_restore_item {
    int cls;                 /* kvkey_class */
    kvkey key;               /* object key */
    uint64_t bytes;          /* object size */
    uint64_t last_access_ms; /* persisted last hit (store clock) */
} kvidx_restore_item;

/* Adds objects found on disk as SEALED, not resident (items are sorted by last access here).
 * DI_OK; DI_EINVAL (bad class or size) or DI_EFULL (max_objects) with the item's index; DI_EEXIST
 * for a duplicate. On failure the items before the bad one stay restored. */
di_status kvidx_restore(kvidx *idx, kvidx_restore_item *items, size_t n, di_error *err);

/* ---- settings and stats ---- */
di_status kvidx_set_ttl(kvidx *idx, int cls, uint64_t ttl_ms, di_error *err);
uint64_t kvidx_ttl(const kvidx *idx, int cls);
/* Takes effect at the next sweep (evicting down to it). DI_EINVAL for 0. */
di_status kvidx_set_disk_capacity(kvidx *idx, uint64_t bytes, di_error *err);
uint64_t kvidx_expiry(const kvidx *idx, const kvidx_obj *obj);
void kvidx_get_stats(const kvidx *idx, kvidx_stats *out);

/* Checks every invariant (list membership, counts, slot and byte accounting) with assert(). */
void kvidx_check(const kvidx *idx);

#endif
