#include "kvstore/index.h"

#include <assert.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>

#include "common/util/hash64.h"

#define NO_LEASE UINT32_MAX

enum { LEASE_FREE = 0, LEASE_ACTIVE = 1, LEASE_EXPIRED = 2 };

/* One lease record. Freed and timed-out records wait in a FIFO before reuse, so a late release
 * of a timed-out lease can still be told "expired" rather than "unknown". */
typedef struct lease_rec {
    uint32_t gen;        /* bumped on every grant; part of the lease id */
    uint8_t state;       /* LEASE_* */
    kvidx_obj *obj;      /* ACTIVE: the pinned object */
    uint64_t expires_ms; /* ACTIVE: lease end */
    uint32_t prev, next; /* ACTIVE: active list links (indices) */
    uint32_t fnext;      /* FREE/EXPIRED: reuse FIFO link */
} lease_rec;

/* A doubly linked list head (which link fields it uses depends on the list). */
typedef struct obj_list {
    kvidx_obj *head; /* most recent */
    kvidx_obj *tail; /* least recent */
    uint64_t n;      /* members */
} obj_list;

struct kvidx {
    kvidx_config cfg;                     /* bounds and TTLs (ttl_ms changes at run time) */
    kvslab *slab;                         /* DRAM slots (not owned) */
    kvidx_obj **buckets;                  /* hash table, chained through hnext */
    size_t n_buckets;                     /* power of two */
    size_t n_objects;                     /* objects in every state */
    kvidx_obj **owner[KVKEY_CLASS_COUNT]; /* slot -> object holding it, per class */
    uint32_t n_slots[KVKEY_CLASS_COUNT];  /* slots per class (size of owner[]) */
    obj_list disk_lru[KVKEY_CLASS_COUNT]; /* SEALED objects (links: lru) */
    obj_list dram_lru[KVKEY_CLASS_COUNT]; /* SEALED and RESIDENT (links: dlru) */
    obj_list allocs;                      /* WRITING objects by deadline (links: lru) */
    kvidx_obj *q_head, *q_tail;           /* DELETING objects waiting for a disk delete */
    uint32_t next_gen;                    /* allocation generations */
    lease_rec *leases;                    /* max_leases records */
    uint32_t active_head;                 /* active lease list */
    uint32_t free_head, free_tail;        /* reuse FIFO */
    kvidx_stats st;                       /* counters (class sizes kept live) */
};

/* ---------------------------------------------------------------- lists */

#define LRU offsetof(kvidx_obj, lru)
#define DLRU offsetof(kvidx_obj, dlru)

static kvidx_link *link_of(kvidx_obj *o, size_t off)
{
    return (kvidx_link *)((char *)o + off);
}

/* Removes o from list l whose links sit at offset off in the object. */
static void list_remove(obj_list *l, kvidx_obj *o, size_t off)
{
    kvidx_link *k = link_of(o, off);
    if (k->prev)
        link_of(k->prev, off)->next = k->next;
    else
        l->head = k->next;
    if (k->next)
        link_of(k->next, off)->prev = k->prev;
    else
        l->tail = k->prev;
    k->prev = k->next = NULL;
    l->n--;
}

static void list_push_head(obj_list *l, kvidx_obj *o, size_t off)
{
    kvidx_link *k = link_of(o, off);
    k->prev = NULL;
    k->next = l->head;
    if (l->head)
        link_of(l->head, off)->prev = o;
    else
        l->tail = o;
    l->head = o;
    l->n++;
}

static void list_push_tail(obj_list *l, kvidx_obj *o, size_t off)
{
    kvidx_link *k = link_of(o, off);
    k->next = NULL;
    k->prev = l->tail;
    if (l->tail)
        link_of(l->tail, off)->next = o;
    else
        l->head = o;
    l->tail = o;
    l->n++;
}

/* ---------------------------------------------------------------- hash table */

static size_t bucket_of(const kvidx *idx, int cls, const kvkey *key)
{
    return (size_t)di_hash64(key->b, KVKEY_BYTES, idx->cfg.hash_seed ^ (uint64_t)cls) &
           (idx->n_buckets - 1);
}

static kvidx_obj *find(const kvidx *idx, int cls, const kvkey *key)
{
    for (kvidx_obj *o = idx->buckets[bucket_of(idx, cls, key)]; o; o = o->hnext)
        if (o->cls == cls && memcmp(o->key.b, key->b, KVKEY_BYTES) == 0)
            return o;
    return NULL;
}

static void grow_table(kvidx *idx)
{
    size_t nb = idx->n_buckets * 2;
    kvidx_obj **b = calloc(nb, sizeof(*b));
    if (!b)
        return; /* keep the current table: longer chains, still correct */
    kvidx_obj **old = idx->buckets;
    size_t old_n = idx->n_buckets;
    idx->buckets = b;
    idx->n_buckets = nb;
    for (size_t i = 0; i < old_n; i++) {
        kvidx_obj *o = old[i];
        while (o) {
            kvidx_obj *next = o->hnext;
            size_t k = bucket_of(idx, o->cls, &o->key);
            o->hnext = b[k];
            b[k] = o;
            o = next;
        }
    }
    free(old);
}

static void table_insert(kvidx *idx, kvidx_obj *o)
{
    if (idx->n_objects >= idx->n_buckets)
        grow_table(idx);
    size_t k = bucket_of(idx, o->cls, &o->key);
    o->hnext = idx->buckets[k];
    idx->buckets[k] = o;
    idx->n_objects++;
}

static void table_remove(kvidx *idx, kvidx_obj *o)
{
    kvidx_obj **pp = &idx->buckets[bucket_of(idx, o->cls, &o->key)];
    while (*pp != o) {
        assert(*pp);
        pp = &(*pp)->hnext;
    }
    *pp = o->hnext;
    idx->n_objects--;
}

/* ---------------------------------------------------------------- helpers */

static int expired(const kvidx *idx, const kvidx_obj *o, uint64_t now)
{
    uint64_t ttl = idx->cfg.ttl_ms[o->cls];
    return ttl > 0 && now >= o->last_access_ms + ttl;
}

uint64_t kvidx_expiry(const kvidx *idx, const kvidx_obj *obj)
{
    uint64_t ttl = idx->cfg.ttl_ms[obj->cls];
    return ttl ? obj->last_access_ms + ttl : UINT64_MAX;
}

static void release_slot(kvidx *idx, kvidx_obj *o)
{
    if (!o->has_slot)
        return;
    assert(idx->owner[o->cls][o->slot] == o);
    idx->owner[o->cls][o->slot] = NULL;
    kvslab_release(idx->slab, o->cls, o->slot);
    o->has_slot = 0;
}

static void take_slot(kvidx *idx, kvidx_obj *o, uint32_t slot)
{
    assert(idx->owner[o->cls][slot] == NULL);
    idx->owner[o->cls][slot] = o;
    o->slot = slot;
    o->has_slot = 1;
}

/* Removes an object from the table and frees it (its slot too). */
static void destroy(kvidx *idx, kvidx_obj *o)
{
    assert(o->pins == 0);
    release_slot(idx, o);
    table_remove(idx, o);
    free(o);
}

/* A resident SEALED object leaves DRAM. */
static void drop_dram(kvidx *idx, kvidx_obj *o)
{
    assert(o->state == KVIDX_SEALED && o->dram == KVIDX_DRAM_RESIDENT && o->pins == 0);
    list_remove(&idx->dram_lru[o->cls], o, DLRU);
    idx->st.cls[o->cls].dram_objects--;
    idx->st.cls[o->cls].dram_bytes -= o->bytes;
    o->dram = KVIDX_DRAM_NONE;
    release_slot(idx, o);
}

static void queue_disk_delete(kvidx *idx, kvidx_obj *o)
{
    assert(o->state == KVIDX_DELETING && o->pins == 0 && o->disk_queue == 0);
    release_slot(idx, o);
    o->dram_bad = 0;
    o->dram = KVIDX_DRAM_NONE;
    o->qnext = NULL;
    if (idx->q_tail)
        idx->q_tail->qnext = o;
    else
        idx->q_head = o;
    idx->q_tail = o;
    o->disk_queue = 1;
}

static void count_gone(kvidx *idx, kvidx_reason why)
{
    switch (why) {
    case KVIDX_GONE_DELETED:
        idx->st.deletes++;
        break;
    case KVIDX_GONE_EXPIRED:
        idx->st.expirations++;
        break;
    case KVIDX_GONE_EVICTED:
        idx->st.disk_evictions++;
        break;
    case KVIDX_GONE_CORRUPT:
        idx->st.corrupt_dropped++;
        break;
    case KVIDX_GONE_FAILED:
        idx->st.commit_failures++;
        break;
    }
}

/* SEALED -> DELETING. The disk delete is queued once nothing pins the object. */
static void doom(kvidx *idx, kvidx_obj *o, kvidx_reason why)
{
    assert(o->state == KVIDX_SEALED);
    list_remove(&idx->disk_lru[o->cls], o, LRU);
    idx->st.cls[o->cls].objects--;
    idx->st.cls[o->cls].bytes -= o->bytes;
    if (o->dram == KVIDX_DRAM_RESIDENT) {
        /* The slot stays with the object until the last pin goes (lease holders read it). */
        list_remove(&idx->dram_lru[o->cls], o, DLRU);
        idx->st.cls[o->cls].dram_objects--;
        idx->st.cls[o->cls].dram_bytes -= o->bytes;
        o->dram = KVIDX_DRAM_NONE;
    }
    idx->st.disk_used -= o->bytes;
    idx->st.disk_deleting += o->bytes;
    o->state = KVIDX_DELETING;
    o->reason = (uint8_t)why;
    count_gone(idx, why);
    if (o->pins == 0)
        queue_disk_delete(idx, o);
}

/* The access time of an object about to become the head of its class's LRU: never below the
 * current head's, so the list stays sorted even if callers' clocks disagree slightly. */
static uint64_t head_stamp(const kvidx *idx, int cls, uint64_t now)
{
    const kvidx_obj *h = idx->disk_lru[cls].head;
    return h && h->last_access_ms > now ? h->last_access_ms : now;
}

static void touch(kvidx *idx, kvidx_obj *o, uint64_t now)
{
    assert(o->state == KVIDX_SEALED);
    o->last_access_ms = head_stamp(idx, o->cls, now);
    list_remove(&idx->disk_lru[o->cls], o, LRU);
    list_push_head(&idx->disk_lru[o->cls], o, LRU);
    if (o->dram == KVIDX_DRAM_RESIDENT) {
        list_remove(&idx->dram_lru[o->cls], o, DLRU);
        list_push_head(&idx->dram_lru[o->cls], o, DLRU);
    }
}

/* Returns o when it is SEALED and within its TTL. An expired object is a miss: it is removed
 * at once when unpinned, and when leased it stays readable to the lease holders only and goes
 * with the last pin. */
static kvidx_obj *live(kvidx *idx, kvidx_obj *o, uint64_t now)
{
    if (!o || o->state != KVIDX_SEALED)
        return NULL;
    if (expired(idx, o, now)) {
        if (o->pins == 0)
            doom(idx, o, KVIDX_GONE_EXPIRED);
        return NULL;
    }
    return o;
}

/* ---------------------------------------------------------------- eviction */

/* Frees one DRAM slot of class cls: the least recently used unpinned resident object leaves
 * DRAM (removed entirely if it has expired). Returns 1 when a slot was freed. */
static int dram_evict_one(kvidx *idx, int cls, uint64_t now)
{
    for (kvidx_obj *o = idx->dram_lru[cls].tail; o; o = o->dlru.prev) {
        if (o->pins)
            continue;
        if (expired(idx, o, now))
            doom(idx, o, KVIDX_GONE_EXPIRED);
        else {
            drop_dram(idx, o);
            idx->st.dram_evictions++;
        }
        return 1;
    }
    return 0;
}

/* The least recently used unpinned SEALED object of a class. */
static kvidx_obj *disk_candidate(kvidx *idx, int cls)
{
    for (kvidx_obj *o = idx->disk_lru[cls].tail; o; o = o->lru.prev)
        if (o->pins == 0)
            return o;
    return NULL;
}

/* Removes one object for disk room: an expired one if any class has one (earliest expiry
 * first), otherwise the least recently used across classes. Returns 1 on success. */
static int disk_evict_one(kvidx *idx, uint64_t now)
{
    kvidx_obj *best = NULL;
    int best_expired = 0;
    for (int c = 0; c < (int)KVKEY_CLASS_COUNT; c++) {
        kvidx_obj *o = disk_candidate(idx, c);
        if (!o)
            continue;
        int ex = expired(idx, o, now);
        if (!best || (ex && !best_expired) ||
            (ex == best_expired &&
             (ex ? kvidx_expiry(idx, o) < kvidx_expiry(idx, best)
                 : o->last_access_ms < best->last_access_ms))) {
            best = o;
            best_expired = ex;
        }
    }
    if (!best)
        return 0;
    doom(idx, best, best_expired ? KVIDX_GONE_EXPIRED : KVIDX_GONE_EVICTED);
    return 1;
}

static di_status get_slot(kvidx *idx, int cls, uint64_t now, uint32_t *slot, di_error *err)
{
    while (kvslab_alloc(idx->slab, cls, slot) != DI_OK)
        if (!dram_evict_one(idx, cls, now)) {
            kvslab_class_stats s;
            kvslab_stats(idx->slab, cls, &s);
            return di_fail(err, DI_EFULL,
                           "DRAM tier full: all %u %s slots are leased, loading or being written",
                           s.used, kvkey_class_name(cls));
        }
    return DI_OK;
}

/* ---------------------------------------------------------------- create / free */

di_status kvidx_create(const kvidx_config *cfg, kvslab *slab, kvidx **out, di_error *err)
{
    if (!cfg || !slab || !out)
        return di_fail(err, DI_EINVAL, "kvidx_create: NULL argument");
    if (cfg->disk_capacity == 0 || cfg->alloc_timeout_ms == 0 || cfg->lease_max_ms == 0 ||
        cfg->max_leases == 0 || cfg->max_objects == 0)
        return di_fail(err, DI_EINVAL,
                       "index bounds must be positive (disk capacity, allocation timeout, "
                       "lease maximum, lease and object counts)");
    if (cfg->max_leases >= NO_LEASE)
        return di_fail(err, DI_EINVAL, "max_leases %u too large", cfg->max_leases);
    kvidx *idx = calloc(1, sizeof(*idx));
    if (!idx)
        return di_fail(err, DI_ENOMEM, "cannot allocate the index");
    idx->cfg = *cfg;
    idx->slab = slab;
    idx->n_buckets = 1024;
    idx->buckets = calloc(idx->n_buckets, sizeof(*idx->buckets));
    idx->leases = calloc(cfg->max_leases, sizeof(*idx->leases));
    int ok = idx->buckets && idx->leases;
    for (int c = 0; ok && c < (int)KVKEY_CLASS_COUNT; c++) {
        kvslab_class_stats s;
        kvslab_stats(slab, c, &s);
        if (s.slots >= (1u << 30))
            ok = 0;
        idx->n_slots[c] = s.slots;
        idx->owner[c] = calloc(s.slots, sizeof(kvidx_obj *));
        ok = idx->owner[c] != NULL;
    }
    if (!ok) {
        kvidx_free(idx);
        return di_fail(err, DI_ENOMEM, "cannot allocate the index tables");
    }
    for (uint32_t i = 0; i < cfg->max_leases; i++)
        idx->leases[i].fnext = i + 1 < cfg->max_leases ? i + 1 : NO_LEASE;
    idx->free_head = 0;
    idx->free_tail = cfg->max_leases - 1;
    idx->active_head = NO_LEASE;
    idx->next_gen = 1;
    idx->st.disk_capacity = cfg->disk_capacity;
    *out = idx;
    return DI_OK;
}

kvidx *kvidx_free(kvidx *idx)
{
    if (!idx)
        return NULL;
    for (size_t i = 0; idx->buckets && i < idx->n_buckets; i++) {
        kvidx_obj *o = idx->buckets[i];
        while (o) {
            kvidx_obj *next = o->hnext;
            if (o->has_slot)
                kvslab_release(idx->slab, o->cls, o->slot);
            free(o);
            o = next;
        }
    }
    free(idx->buckets);
    free(idx->leases);
    for (int c = 0; c < (int)KVKEY_CLASS_COUNT; c++)
        free(idx->owner[c]);
    free(idx);
    return NULL;
}

/* ---------------------------------------------------------------- write path */

static uint64_t make_alloc_id(const kvidx_obj *o)
{
    return ((uint64_t)o->gen << 32) | ((uint64_t)o->cls << 30) | o->slot;
}

static kvidx_obj *alloc_owner(const kvidx *idx, uint64_t alloc_id)
{
    uint32_t gen = (uint32_t)(alloc_id >> 32);
    int cls = (int)((alloc_id >> 30) & 3);
    uint32_t slot = (uint32_t)(alloc_id & 0x3fffffffu);
    if (gen == 0 || cls >= (int)KVKEY_CLASS_COUNT || slot >= idx->n_slots[cls])
        return NULL;
    kvidx_obj *o = idx->owner[cls][slot];
    if (!o || o->gen != gen || (o->state != KVIDX_WRITING && o->state != KVIDX_COMMITTING))
        return NULL;
    return o;
}

static di_status reserve_disk(kvidx *idx, uint64_t bytes, uint64_t now, di_error *err)
{
    while (idx->st.disk_used + bytes > idx->cfg.disk_capacity)
        if (!disk_evict_one(idx, now))
            return di_fail(err, DI_ENOSPC,
                           "disk tier capacity %llu bytes reached (%llu in use) and nothing "
                           "unleased is left to evict",
                           (unsigned long long)idx->cfg.disk_capacity,
                           (unsigned long long)idx->st.disk_used);
    return DI_OK;
}

static di_status existing_alloc(kvidx *idx, kvidx_obj *o, uint64_t now, di_error *err)
{
    char hex[65];
    kvkey_hex(&o->key, hex);
    if (live(idx, o, now)) {
        touch(idx, o, now);
        return di_fail(err, DI_EEXIST, "%s %.16s is already stored", kvkey_class_name(o->cls),
                       hex);
    }
    if (o->state == KVIDX_WRITING || o->state == KVIDX_COMMITTING)
        return di_fail(err, DI_EBUSY, "%s %.16s is being written by another client",
                       kvkey_class_name(o->cls), hex);
    return di_fail(err, DI_EBUSY, "%s %.16s is being removed; retry shortly",
                   kvkey_class_name(o->cls), hex);
}

di_status kvidx_alloc(kvidx *idx, int cls, const kvkey *key, uint64_t bytes, uint64_t now,
                      uint64_t *alloc_id, kvidx_obj **obj, di_error *err)
{
    if (cls < 0 || cls >= (int)KVKEY_CLASS_COUNT || !key || !alloc_id || !obj)
        return di_fail(err, DI_EINVAL, "kvidx_alloc: bad class or NULL argument");
    uint64_t max = kvslab_slot_bytes(idx->slab, cls);
    if (bytes == 0 || bytes > max)
        return di_fail(err, DI_EINVAL, "%s object of %llu bytes: must be 1..%llu",
                       kvkey_class_name(cls), (unsigned long long)bytes,
                       (unsigned long long)max);
    kvidx_obj *o = find(idx, cls, key);
    if (o)
        return existing_alloc(idx, o, now, err);
    if (idx->n_objects >= idx->cfg.max_objects)
        return di_fail(err, DI_EFULL, "index holds its maximum of %u objects",
                       idx->cfg.max_objects);
    di_status st = reserve_disk(idx, bytes, now, err);
    if (st != DI_OK)
        return st;
    uint32_t slot;
    st = get_slot(idx, cls, now, &slot, err);
    if (st != DI_OK)
        return st;
    o = calloc(1, sizeof(*o));
    if (!o) {
        kvslab_release(idx->slab, cls, slot);
        return di_fail(err, DI_ENOMEM, "cannot allocate an index entry");
    }
    o->key = *key;
    o->cls = (uint8_t)cls;
    o->state = KVIDX_WRITING;
    o->bytes = bytes;
    o->gen = idx->next_gen++;
    if (idx->next_gen == 0)
        idx->next_gen = 1;
    o->deadline_ms = now + idx->cfg.alloc_timeout_ms;
    take_slot(idx, o, slot);
    table_insert(idx, o);
    list_push_tail(&idx->allocs, o, LRU);
    idx->st.disk_used += bytes;
    idx->st.cls[cls].writing++;
    *alloc_id = make_alloc_id(o);
    *obj = o;
    return DI_OK;
}

/* Frees a WRITING allocation (abort or timeout). */
static void drop_alloc(kvidx *idx, kvidx_obj *o)
{
    assert(o->state == KVIDX_WRITING);
    list_remove(&idx->allocs, o, LRU);
    idx->st.disk_used -= o->bytes;
    idx->st.cls[o->cls].writing--;
    destroy(idx, o);
}

di_status kvidx_abort(kvidx *idx, uint64_t alloc_id, di_error *err)
{
    kvidx_obj *o = alloc_owner(idx, alloc_id);
    if (!o)
        return di_fail(err, DI_ENOENT, "allocation %llx is unknown or was reclaimed",
                       (unsigned long long)alloc_id);
    if (o->state != KVIDX_WRITING)
        return di_fail(err, DI_ESTATE, "allocation %llx is being committed",
                       (unsigned long long)alloc_id);
    drop_alloc(idx, o);
    return DI_OK;
}

di_status kvidx_commit_begin(kvidx *idx, uint64_t alloc_id, uint64_t now, kvidx_obj **obj,
                             di_error *err)
{
    kvidx_obj *o = alloc_owner(idx, alloc_id);
    if (!o)
        return di_fail(err, DI_ENOENT,
                       "allocation %llx is unknown or was reclaimed after its timeout; put the "
                       "object again",
                       (unsigned long long)alloc_id);
    if (o->state != KVIDX_WRITING)
        return di_fail(err, DI_ESTATE, "allocation %llx is already being committed",
                       (unsigned long long)alloc_id);
    if (now >= o->deadline_ms) {
        drop_alloc(idx, o);
        idx->st.alloc_reclaimed++;
        return di_fail(err, DI_ETIMEDOUT,
                       "allocation %llx expired before its commit (timeout %llu ms); put the "
                       "object again",
                       (unsigned long long)alloc_id,
                       (unsigned long long)idx->cfg.alloc_timeout_ms);
    }
    list_remove(&idx->allocs, o, LRU);
    o->state = KVIDX_COMMITTING;
    *obj = o;
    return DI_OK;
}

void kvidx_commit_end(kvidx *idx, kvidx_obj *o, int ok, int wrote_disk, uint64_t now)
{
    assert(o->state == KVIDX_COMMITTING);
    idx->st.cls[o->cls].writing--;
    if (!ok) {
        idx->st.commit_failures++;
        if (!wrote_disk) {
            idx->st.disk_used -= o->bytes;
            destroy(idx, o);
            return;
        }
        /* The disk may hold the object: delete it there before the key is reused. */
        idx->st.disk_used -= o->bytes;
        idx->st.disk_deleting += o->bytes;
        o->state = KVIDX_DELETING;
        o->reason = KVIDX_GONE_FAILED;
        o->on_disk = 1;
        if (o->pins == 0)
            queue_disk_delete(idx, o);
        return;
    }
    o->state = KVIDX_SEALED;
    o->on_disk = 1;
    o->dram = KVIDX_DRAM_RESIDENT;
    o->last_access_ms = head_stamp(idx, o->cls, now);
    o->persisted_access_ms = o->last_access_ms;
    list_push_head(&idx->disk_lru[o->cls], o, LRU);
    list_push_head(&idx->dram_lru[o->cls], o, DLRU);
    idx->st.cls[o->cls].objects++;
    idx->st.cls[o->cls].bytes += o->bytes;
    idx->st.cls[o->cls].dram_objects++;
    idx->st.cls[o->cls].dram_bytes += o->bytes;
    idx->st.commits++;
}

/* ---------------------------------------------------------------- leases */

static uint32_t lease_take(kvidx *idx)
{
    uint32_t i = idx->free_head;
    if (i == NO_LEASE)
        return NO_LEASE;
    idx->free_head = idx->leases[i].fnext;
    if (idx->free_head == NO_LEASE)
        idx->free_tail = NO_LEASE;
    return i;
}

static void lease_to_fifo(kvidx *idx, uint32_t i)
{
    idx->leases[i].fnext = NO_LEASE;
    if (idx->free_tail == NO_LEASE)
        idx->free_head = i;
    else
        idx->leases[idx->free_tail].fnext = i;
    idx->free_tail = i;
}

static void active_remove(kvidx *idx, uint32_t i)
{
    lease_rec *r = &idx->leases[i];
    if (r->prev != NO_LEASE)
        idx->leases[r->prev].next = r->next;
    else
        idx->active_head = r->next;
    if (r->next != NO_LEASE)
        idx->leases[r->next].prev = r->prev;
}

static void active_push(kvidx *idx, uint32_t i)
{
    lease_rec *r = &idx->leases[i];
    r->prev = NO_LEASE;
    r->next = idx->active_head;
    if (idx->active_head != NO_LEASE)
        idx->leases[idx->active_head].prev = i;
    idx->active_head = i;
}

/* Ends an active lease: unpins its object and parks the record (as a tombstone when it timed
 * out). */
static void lease_end(kvidx *idx, uint32_t i, int timed_out, uint64_t now)
{
    lease_rec *r = &idx->leases[i];
    assert(r->state == LEASE_ACTIVE);
    active_remove(idx, i);
    kvidx_obj *o = r->obj;
    r->obj = NULL;
    r->state = timed_out ? LEASE_EXPIRED : LEASE_FREE;
    lease_to_fifo(idx, i);
    idx->st.leases_active--;
    if (timed_out)
        idx->st.leases_timed_out++;
    kvidx_unpin(idx, o, now);
}

di_status kvidx_lease(kvidx *idx, int cls, const kvkey *key, uint64_t lease_ms, uint64_t now,
                      kvidx_lease_info *info, di_error *err)
{
    if (cls < 0 || cls >= (int)KVKEY_CLASS_COUNT || !key || !info)
        return di_fail(err, DI_EINVAL, "kvidx_lease: bad class or NULL argument");
    kvidx_obj *o = live(idx, find(idx, cls, key), now);
    if (!o) {
        idx->st.lease_misses++;
        char hex[65];
        kvkey_hex(key, hex);
        return di_fail(err, DI_ENOENT, "%s %.16s is not stored", kvkey_class_name(cls), hex);
    }
    if (o->dram == KVIDX_DRAM_LOADING)
        return di_fail(err, DI_EBUSY, "object is being loaded from disk; retry");
    if (o->dram_bad) {
        idx->st.lease_misses++;
        char hex[65];
        kvkey_hex(key, hex);
        return di_fail(err, DI_ENOENT,
                       "%s %.16s: its DRAM copy was corrupt and is dropped once its readers "
                       "finish; read again shortly for the disk copy",
                       kvkey_class_name(cls), hex);
    }
    uint32_t li = idx->free_head;
    if (li == NO_LEASE)
        return di_fail(err, DI_EFULL, "all %u lease records are in use", idx->cfg.max_leases);
    int need_load = 0;
    if (o->dram == KVIDX_DRAM_NONE) {
        uint32_t slot;
        di_status st = get_slot(idx, cls, now, &slot, err);
        if (st != DI_OK)
            return st;
        take_slot(idx, o, slot);
        o->dram = KVIDX_DRAM_LOADING;
        need_load = 1;
        idx->st.promotions++;
    }
    li = lease_take(idx);
    lease_rec *r = &idx->leases[li];
    r->gen++;
    if (r->gen == 0)
        r->gen = 1;
    r->state = LEASE_ACTIVE;
    r->obj = o;
    if (lease_ms == 0)
        lease_ms = 1;
    if (lease_ms > idx->cfg.lease_max_ms)
        lease_ms = idx->cfg.lease_max_ms;
    r->expires_ms = now + lease_ms;
    active_push(idx, li);
    o->pins++;
    idx->st.leases_active++;
    idx->st.lease_hits++;
    touch(idx, o, now);
    info->lease_id = ((uint64_t)r->gen << 32) | li;
    info->obj = o;
    info->expires_ms = r->expires_ms;
    info->need_load = need_load;
    return DI_OK;
}

void kvidx_load_done(kvidx *idx, kvidx_obj *o, kvidx_load result, uint64_t now)
{
    (void)now;
    assert(o->dram == KVIDX_DRAM_LOADING && o->pins > 0);
    if (o->state != KVIDX_SEALED) {
        /* Deleted while loading: the slot goes with the last pin. */
        o->dram = KVIDX_DRAM_NONE;
        return;
    }
    if (result == KVIDX_LOAD_RETRY) {
        /* No reader has the slot's address yet: it can go at once. */
        o->dram = KVIDX_DRAM_NONE;
        release_slot(idx, o);
        return;
    }
    if (result == KVIDX_LOAD_OK) {
        o->dram = KVIDX_DRAM_RESIDENT;
        list_push_head(&idx->dram_lru[o->cls], o, DLRU);
        idx->st.cls[o->cls].dram_objects++;
        idx->st.cls[o->cls].dram_bytes += o->bytes;
        return;
    }
    o->dram = KVIDX_DRAM_NONE;
    doom(idx, o, KVIDX_GONE_CORRUPT);
}

di_status kvidx_release(kvidx *idx, uint64_t lease_id, uint64_t now, di_error *err)
{
    uint32_t i = (uint32_t)(lease_id & 0xffffffffu);
    uint32_t gen = (uint32_t)(lease_id >> 32);
    if (i >= idx->cfg.max_leases || gen == 0 || idx->leases[i].gen != gen ||
        idx->leases[i].state == LEASE_FREE)
        return di_fail(err, DI_ENOENT, "lease %llx is unknown (never granted or long gone)",
                       (unsigned long long)lease_id);
    lease_rec *r = &idx->leases[i];
    if (r->state == LEASE_EXPIRED) {
        r->state = LEASE_FREE; /* already in the reuse FIFO */
        return di_fail(err, DI_ETIMEDOUT,
                       "lease %llx timed out before its release: data read under it may be "
                       "stale; read again",
                       (unsigned long long)lease_id);
    }
    if (now > r->expires_ms) {
        lease_end(idx, i, 1, now);
        idx->leases[i].state = LEASE_FREE;
        return di_fail(err, DI_ETIMEDOUT,
                       "lease %llx timed out before its release: data read under it may be "
                       "stale; read again",
                       (unsigned long long)lease_id);
    }
    lease_end(idx, i, 0, now);
    return DI_OK;
}

void kvidx_pin(kvidx *idx, kvidx_obj *o)
{
    (void)idx;
    o->pins++;
}

void kvidx_unpin(kvidx *idx, kvidx_obj *o, uint64_t now)
{
    assert(o->pins > 0);
    if (--o->pins > 0)
        return;
    if (o->dram_bad && o->state != KVIDX_DELETING) {
        release_slot(idx, o);
        o->dram_bad = 0;
    }
    if (o->state == KVIDX_DELETING) {
        assert(o->on_disk);
        if (o->disk_queue == 0)
            queue_disk_delete(idx, o);
        return;
    }
    if (o->state == KVIDX_SEALED && expired(idx, o, now))
        doom(idx, o, KVIDX_GONE_EXPIRED);
}

kvidx_obj *kvidx_pin_resident(kvidx *idx, int cls, const kvkey *key, uint64_t now)
{
    if (cls < 0 || cls >= (int)KVKEY_CLASS_COUNT || !key)
        return NULL;
    kvidx_obj *o = live(idx, find(idx, cls, key), now);
    if (!o || o->dram != KVIDX_DRAM_RESIDENT)
        return NULL;
    o->pins++;
    return o;
}

int kvidx_dram_corrupt(kvidx *idx, kvidx_obj *o)
{
    assert(o->pins > 0);
    if (o->state != KVIDX_SEALED || o->dram != KVIDX_DRAM_RESIDENT)
        return 0;
    /* Out of DRAM at once (no new lease sees it); the slot stays until the last pin goes. */
    list_remove(&idx->dram_lru[o->cls], o, DLRU);
    idx->st.cls[o->cls].dram_objects--;
    idx->st.cls[o->cls].dram_bytes -= o->bytes;
    o->dram = KVIDX_DRAM_NONE;
    o->dram_bad = 1;
    idx->st.corrupt_dropped++;
    return 1;
}

/* ---------------------------------------------------------------- queries */

void kvidx_lookup(kvidx *idx, const kvkey *keys, size_t n, uint64_t now, uint32_t *blocks_hit,
                  uint32_t *windows, size_t max_windows, size_t *n_windows)
{
    uint32_t hit = 0;
    while (hit < n) {
        kvidx_obj *o = live(idx, find(idx, KVKEY_BLOCK, &keys[hit]), now);
        if (!o)
            break;
        touch(idx, o, now);
        hit++;
    }
    size_t nw = 0;
    for (uint32_t k = 1; k <= hit && nw < max_windows; k++) {
        kvidx_obj *w = live(idx, find(idx, KVKEY_WINDOW, &keys[k - 1]), now);
        if (!w)
            continue;
        touch(idx, w, now);
        windows[nw++] = k;
    }
    idx->st.lookup_blocks += n;
    idx->st.lookup_hits += hit;
    *blocks_hit = hit;
    *n_windows = nw;
}

void kvidx_inspect(kvidx *idx, int cls, const kvkey *key, uint64_t now, kvidx_info *info)
{
    memset(info, 0, sizeof(*info));
    kvidx_obj *o = cls >= 0 && cls < (int)KVKEY_CLASS_COUNT ? find(idx, cls, key) : NULL;
    if (!o || o->state != KVIDX_SEALED || expired(idx, o, now))
        return;
    info->present = 1;
    info->resident = o->dram == KVIDX_DRAM_RESIDENT;
    info->bytes = o->bytes;
    info->expires_ms = kvidx_expiry(idx, o);
    info->pins = o->pins;
}

di_status kvidx_delete(kvidx *idx, int cls, const kvkey *key, uint64_t now, di_error *err)
{
    if (cls < 0 || cls >= (int)KVKEY_CLASS_COUNT || !key)
        return di_fail(err, DI_EINVAL, "kvidx_delete: bad class or NULL key");
    kvidx_obj *o = live(idx, find(idx, cls, key), now);
    if (!o) {
        char hex[65];
        kvkey_hex(key, hex);
        return di_fail(err, DI_ENOENT, "%s %.16s is not stored", kvkey_class_name(cls), hex);
    }
    doom(idx, o, KVIDX_GONE_DELETED);
    return DI_OK;
}

void kvidx_evict(kvidx *idx, unsigned class_mask, int dram_only, uint64_t now, uint64_t *evicted,
                 uint64_t *skipped)
{
    uint64_t n = 0, pinned = 0;
    for (int c = 0; c < (int)KVKEY_CLASS_COUNT; c++) {
        if (!(class_mask & (1u << c)))
            continue;
        if (dram_only) {
            kvidx_obj *o = idx->dram_lru[c].tail;
            while (o) {
                kvidx_obj *prev = o->dlru.prev;
                if (o->pins)
                    pinned++;
                else {
                    drop_dram(idx, o);
                    idx->st.dram_evictions++;
                    n++;
                }
                o = prev;
            }
            continue;
        }
        kvidx_obj *o = idx->disk_lru[c].tail;
        while (o) {
            kvidx_obj *prev = o->lru.prev;
            if (o->pins)
                pinned++;
            else {
                doom(idx, o, expired(idx, o, now) ? KVIDX_GONE_EXPIRED : KVIDX_GONE_EVICTED);
                n++;
            }
            o = prev;
        }
    }
    *evicted = n;
    *skipped = pinned;
}

di_status kvidx_evict_key(kvidx *idx, int cls, const kvkey *key, int dram_only, uint64_t now,
                          di_error *err)
{
    if (cls < 0 || cls >= (int)KVKEY_CLASS_COUNT || !key)
        return di_fail(err, DI_EINVAL, "kvidx_evict_key: bad class or NULL key");
    kvidx_obj *o = live(idx, find(idx, cls, key), now);
    char hex[65];
    kvkey_hex(key, hex);
    if (!o || (dram_only && o->dram != KVIDX_DRAM_RESIDENT))
        return di_fail(err, DI_ENOENT, "%s %.16s is not stored%s", kvkey_class_name(cls), hex,
                       o ? " in DRAM" : "");
    if (o->pins)
        return di_fail(err, DI_EBUSY, "%s %.16s is leased; retry after the lease ends",
                       kvkey_class_name(cls), hex);
    if (dram_only) {
        drop_dram(idx, o);
        idx->st.dram_evictions++;
    } else
        doom(idx, o, KVIDX_GONE_EVICTED);
    return DI_OK;
}

/* ---------------------------------------------------------------- sweep */

static uint32_t sweep_allocs(kvidx *idx, uint64_t now)
{
    uint32_t n = 0;
    while (idx->allocs.head && idx->allocs.head->deadline_ms <= now) {
        drop_alloc(idx, idx->allocs.head);
        idx->st.alloc_reclaimed++;
        n++;
    }
    return n;
}

static uint32_t sweep_leases(kvidx *idx, uint64_t now)
{
    uint32_t n = 0;
    uint32_t i = idx->active_head;
    while (i != NO_LEASE) {
        uint32_t next = idx->leases[i].next;
        if (idx->leases[i].expires_ms < now) {
            lease_end(idx, i, 1, now);
            n++;
        }
        i = next;
    }
    return n;
}

static uint32_t sweep_expired(kvidx *idx, uint64_t now)
{
    uint32_t n = 0;
    for (int c = 0; c < (int)KVKEY_CLASS_COUNT; c++) {
        kvidx_obj *o = idx->disk_lru[c].tail;
        while (o && expired(idx, o, now)) {
            kvidx_obj *prev = o->lru.prev;
            if (o->pins == 0) {
                doom(idx, o, KVIDX_GONE_EXPIRED);
                n++;
            }
            o = prev;
        }
    }
    return n;
}

void kvidx_sweep(kvidx *idx, uint64_t now, kvidx_sweep_report *report)
{
    kvidx_sweep_report r = {0};
    r.allocs_reclaimed = sweep_allocs(idx, now);
    r.leases_timed_out = sweep_leases(idx, now);
    r.expired = sweep_expired(idx, now);
    for (int c = 0; c < (int)KVKEY_CLASS_COUNT; c++)
        while (kvslab_over_limit(idx->slab, c) && dram_evict_one(idx, c, now))
            r.dram_evicted++;
    while (idx->st.disk_used > idx->cfg.disk_capacity && disk_evict_one(idx, now))
        r.disk_evicted++;
    if (report)
        *report = r;
}

/* ---------------------------------------------------------------- disk deletes */

size_t kvidx_take_disk_deletes(kvidx *idx, kvidx_obj **out, size_t max)
{
    size_t n = 0;
    while (n < max && idx->q_head) {
        kvidx_obj *o = idx->q_head;
        idx->q_head = o->qnext;
        if (!idx->q_head)
            idx->q_tail = NULL;
        o->qnext = NULL;
        o->disk_queue = 2;
        out[n++] = o;
    }
    return n;
}

void kvidx_disk_deleted(kvidx *idx, kvidx_obj *o, int ok)
{
    assert(o->state == KVIDX_DELETING && o->disk_queue == 2 && o->pins == 0);
    if (!ok) {
        o->disk_queue = 0;
        queue_disk_delete(idx, o);
        return;
    }
    idx->st.disk_deleting -= o->bytes;
    destroy(idx, o);
}

/* ---------------------------------------------------------------- restore */

static int by_access(const void *a, const void *b)
{
    const kvidx_restore_item *x = a, *y = b;
    return (x->last_access_ms > y->last_access_ms) - (x->last_access_ms < y->last_access_ms);
}

di_status kvidx_restore(kvidx *idx, kvidx_restore_item *items, size_t n, di_error *err)
{
    if (n > 0 && !items)
        return di_fail(err, DI_EINVAL, "kvidx_restore: items is NULL");
    qsort(items, n, sizeof(*items), by_access);
    for (size_t i = 0; i < n; i++) {
        const kvidx_restore_item *it = &items[i];
        if (it->cls < 0 || it->cls >= (int)KVKEY_CLASS_COUNT || it->bytes == 0 ||
            it->bytes > kvslab_slot_bytes(idx->slab, it->cls))
            return di_fail(err, DI_EINVAL, "restored object %zu: class %d or size %llu invalid",
                           i, it->cls, (unsigned long long)it->bytes);
        if (idx->n_objects >= idx->cfg.max_objects)
            return di_fail(err, DI_EFULL,
                           "the disk holds more than the index maximum of %u objects",
                           idx->cfg.max_objects);
        if (find(idx, it->cls, &it->key))
            return di_fail(err, DI_EEXIST, "restored object %zu is a duplicate", i);
        kvidx_obj *o = calloc(1, sizeof(*o));
        if (!o)
            return di_fail(err, DI_ENOMEM, "cannot allocate an index entry");
        o->key = it->key;
        o->cls = (uint8_t)it->cls;
        o->state = KVIDX_SEALED;
        o->on_disk = 1;
        o->bytes = it->bytes;
        o->last_access_ms = it->last_access_ms;
        o->persisted_access_ms = it->last_access_ms;
        table_insert(idx, o);
        list_push_head(&idx->disk_lru[o->cls], o, LRU);
        idx->st.cls[o->cls].objects++;
        idx->st.cls[o->cls].bytes += o->bytes;
        idx->st.disk_used += o->bytes;
    }
    return DI_OK;
}

/* ---------------------------------------------------------------- settings, stats */

di_status kvidx_set_ttl(kvidx *idx, int cls, uint64_t ttl_ms, di_error *err)
{
    if (cls < 0 || cls >= (int)KVKEY_CLASS_COUNT)
        return di_fail(err, DI_EINVAL, "unknown object class %d", cls);
    idx->cfg.ttl_ms[cls] = ttl_ms;
    return DI_OK;
}

uint64_t kvidx_ttl(const kvidx *idx, int cls)
{
    return idx->cfg.ttl_ms[cls];
}

di_status kvidx_set_disk_capacity(kvidx *idx, uint64_t bytes, di_error *err)
{
    if (bytes == 0)
        return di_fail(err, DI_EINVAL, "disk capacity must be positive");
    idx->cfg.disk_capacity = bytes;
    idx->st.disk_capacity = bytes;
    return DI_OK;
}

void kvidx_get_stats(const kvidx *idx, kvidx_stats *out)
{
    *out = idx->st;
}

/* ---------------------------------------------------------------- invariants */

static void check_lists(const kvidx *idx, uint64_t *sealed, uint64_t *resident)
{
    for (int c = 0; c < (int)KVKEY_CLASS_COUNT; c++) {
        uint64_t n = 0, nd = 0, bytes = 0, dbytes = 0;
        const kvidx_obj *prev = NULL;
        for (const kvidx_obj *o = idx->disk_lru[c].head; o; o = o->lru.next) {
            assert(o->state == KVIDX_SEALED && o->cls == c && o->lru.prev == prev);
            assert(!prev || prev->last_access_ms >= o->last_access_ms);
            prev = o;
            n++;
            bytes += o->bytes;
        }
        assert(idx->disk_lru[c].tail == prev && idx->disk_lru[c].n == n);
        prev = NULL;
        for (const kvidx_obj *o = idx->dram_lru[c].head; o; o = o->dlru.next) {
            assert(o->state == KVIDX_SEALED && o->dram == KVIDX_DRAM_RESIDENT && o->has_slot);
            assert(o->dlru.prev == prev);
            prev = o;
            nd++;
            dbytes += o->bytes;
        }
        assert(idx->dram_lru[c].tail == prev && idx->dram_lru[c].n == nd);
        assert(idx->st.cls[c].objects == n && idx->st.cls[c].bytes == bytes);
        assert(idx->st.cls[c].dram_objects == nd && idx->st.cls[c].dram_bytes == dbytes);
        *sealed += n;
        *resident += nd;
    }
}

void kvidx_check(const kvidx *idx)
{
    uint64_t sealed = 0, resident = 0;
    check_lists(idx, &sealed, &resident);
    uint64_t count = 0, used = 0, deleting = 0, pins = 0;
    uint32_t slots[KVKEY_CLASS_COUNT] = {0};
    for (size_t b = 0; b < idx->n_buckets; b++)
        for (const kvidx_obj *o = idx->buckets[b]; o; o = o->hnext) {
            count++;
            pins += o->pins;
            if (o->has_slot) {
                slots[o->cls]++;
                assert(idx->owner[o->cls][o->slot] == o);
            }
            if (o->state == KVIDX_DELETING) {
                deleting += o->bytes;
                assert(o->dram != KVIDX_DRAM_RESIDENT);
                assert(o->on_disk && (o->pins > 0 || o->disk_queue != 0));
            } else
                used += o->bytes;
            if (o->state == KVIDX_WRITING || o->state == KVIDX_COMMITTING)
                assert(o->has_slot && o->dram == KVIDX_DRAM_NONE);
            if (o->dram != KVIDX_DRAM_NONE)
                assert(o->has_slot);
            if (o->dram_bad)
                assert(o->has_slot && o->dram == KVIDX_DRAM_NONE && o->pins > 0);
        }
    assert(count == idx->n_objects);
    assert(used == idx->st.disk_used);
    assert(deleting == idx->st.disk_deleting);
    for (int c = 0; c < (int)KVKEY_CLASS_COUNT; c++) {
        kvslab_class_stats s;
        kvslab_stats(idx->slab, c, &s);
        assert(s.used == slots[c]);
    }
    uint64_t active = 0;
    for (uint32_t i = idx->active_head; i != NO_LEASE; i = idx->leases[i].next) {
        assert(idx->leases[i].state == LEASE_ACTIVE && idx->leases[i].obj);
        active++;
    }
    assert(active == idx->st.leases_active);
    assert(pins >= active);
    (void)sealed;
    (void)resident;
}
