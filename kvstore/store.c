#include "kvstore/store.h"

#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/util/clock.h"
#include "kvstore/slab.h"

#define RATE_SAMPLES 11 /* one per second: rates over the last 10 s */
#define DRAIN_BATCH 256

/* One point of the transfer-rate history. */
typedef struct rate_sample {
    uint64_t t_ms;      /* store clock */
    uint64_t get_bytes; /* counters at that time */
    uint64_t put_bytes;
} rate_sample;

struct kvs_store {
    kvs_config cfg;              /* copy; disk.dir and disk.log_dir point at dir and log_dir */
    char *dir;                   /* RocksDB directory (copy) */
    char *log_dir;               /* RocksDB LOG directory (copy) or NULL */
    kvslab *slab;                /* DRAM slots */
    kvidx *idx;                  /* object index */
    kvdisk *disk;                /* RocksDB tier */
    pthread_mutex_t mu;          /* guards slab, idx, counters and samples */
    pthread_cond_t loaded;       /* broadcast when a disk load ends */
    pthread_cond_t wake;         /* wakes the sweeper (shutdown) */
    pthread_t sweeper;           /* sweeper thread */
    int sweeper_running;         /* 1 once started */
    int stop;                    /* asks the sweeper to end */
    uint64_t wall0_ms;           /* wall clock at open */
    uint64_t mono0_ns;           /* monotonic clock at open */
    uint64_t next_recover_ms;    /* sweeper: next attempt to reopen a failed disk tier */
    uint64_t get_bytes;          /* bytes leased since open */
    uint64_t put_bytes;          /* bytes committed since open */
    uint64_t meta_bad;           /* meta records that failed their checksum at open */
    rate_sample samples[RATE_SAMPLES]; /* ring of rate samples */
    unsigned n_samples;          /* filled entries */
    unsigned next_sample;        /* ring position */
};

static uint64_t now_locked(const kvs_store *s)
{
    return s->wall0_ms + (di_mono_ns() - s->mono0_ns) / 1000000ull;
}

uint64_t kvs_now_ms(kvs_store *s)
{
    return now_locked(s);
}

kvdisk *kvs_disk(kvs_store *s)
{
    return s->disk;
}

/* ---------------------------------------------------------------- disk deletes */

/* Performs the disk deletes the index queued, outside the lock. While the disk tier refuses
 * writes they wait for its recovery. */
static void drain_deletes(kvs_store *s)
{
    kvidx_obj *objs[DRAIN_BATCH];
    kvdisk_item items[DRAIN_BATCH];
    while (!kvdisk_failed(s->disk)) {
        pthread_mutex_lock(&s->mu);
        size_t n = kvidx_take_disk_deletes(s->idx, objs, DRAIN_BATCH);
        for (size_t i = 0; i < n; i++)
            items[i] = (kvdisk_item){.cls = objs[i]->cls, .key = objs[i]->key};
        pthread_mutex_unlock(&s->mu);
        if (n == 0)
            return;
        di_error e;
        di_status st = kvdisk_delete(s->disk, items, n, &e);
        if (st != DI_OK)
            di_log(s->cfg.log, DI_LOG_WARN, "deleting %zu objects from disk: %s; retrying later",
                   n, e.msg);
        pthread_mutex_lock(&s->mu);
        for (size_t i = 0; i < n; i++)
            kvidx_disk_deleted(s->idx, objs[i], st == DI_OK);
        pthread_mutex_unlock(&s->mu);
        if (st != DI_OK)
            return;
    }
}

/* ---------------------------------------------------------------- sweeper */

static void sample_rates(kvs_store *s, uint64_t now)
{
    if (s->n_samples > 0) {
        unsigned last = (s->next_sample + RATE_SAMPLES - 1) % RATE_SAMPLES;
        if (now < s->samples[last].t_ms + 1000)
            return;
    }
    s->samples[s->next_sample] =
        (rate_sample){.t_ms = now, .get_bytes = s->get_bytes, .put_bytes = s->put_bytes};
    s->next_sample = (s->next_sample + 1) % RATE_SAMPLES;
    if (s->n_samples < RATE_SAMPLES)
        s->n_samples++;
}

/* Once a second while the disk tier refuses writes (after a full disk or an I/O error), try to
 * reopen it; puts work again as soon as there is room. */
static void recover_disk(kvs_store *s, uint64_t now)
{
    if (!kvdisk_failed(s->disk) || now < s->next_recover_ms)
        return;
    s->next_recover_ms = now + 1000;
    di_error e;
    if (kvdisk_recover(s->disk, &e) == DI_OK)
        di_log(s->cfg.log, DI_LOG_INFO, "disk tier accepts writes again");
    else
        di_log(s->cfg.log, DI_LOG_DEBUG, "disk tier still refuses writes: %s; retrying", e.msg);
}

static void *sweeper_main(void *arg)
{
    kvs_store *s = arg;
    uint32_t period = s->cfg.sweep_interval_ms ? s->cfg.sweep_interval_ms : 200;
    pthread_mutex_lock(&s->mu);
    while (!s->stop) {
        struct timespec until;
        clock_gettime(CLOCK_REALTIME, &until);
        uint64_t ns = (uint64_t)until.tv_nsec + (uint64_t)period * 1000000ull;
        until.tv_sec += (time_t)(ns / 1000000000ull);
        until.tv_nsec = (long)(ns % 1000000000ull);
        pthread_cond_timedwait(&s->wake, &s->mu, &until);
        if (s->stop)
            break;
        uint64_t now = now_locked(s);
        kvidx_sweep_report r;
        kvidx_sweep(s->idx, now, &r);
        sample_rates(s, now);
        pthread_mutex_unlock(&s->mu);
        if (r.allocs_reclaimed || r.leases_timed_out)
            di_log(s->cfg.log, DI_LOG_DEBUG,
                   "sweep: %u allocations reclaimed, %u leases timed out, %u expired, %u+%u "
                   "evicted",
                   r.allocs_reclaimed, r.leases_timed_out, r.expired, r.dram_evicted,
                   r.disk_evicted);
        drain_deletes(s);
        recover_disk(s, now);
        pthread_mutex_lock(&s->mu);
    }
    pthread_mutex_unlock(&s->mu);
    return NULL;
}

/* ---------------------------------------------------------------- open / close */

/* Collects scanned objects, sorting out those the current config cannot hold. */
typedef struct restore_acc {
    kvs_store *s;
    kvidx_restore_item *items;
    size_t n, cap;
    kvdisk_item *bad;
    size_t n_bad, cap_bad;
    int oom;
} restore_acc;

static int size_fits(const kvs_config *cfg, int cls, uint64_t bytes)
{
    return cls == KVKEY_HANDOFF ? bytes <= cfg->object_bytes[cls]
                                : bytes == cfg->object_bytes[cls];
}

static int grow(void **p, size_t *cap, size_t need, size_t elem)
{
    if (need <= *cap)
        return 1;
    size_t nc = *cap ? *cap * 2 : 1024;
    void *np = realloc(*p, nc * elem);
    if (!np)
        return 0;
    *p = np;
    *cap = nc;
    return 1;
}

static int collect_item(void *ud, const kvdisk_item *it)
{
    restore_acc *a = ud;
    if (!size_fits(&a->s->cfg, it->cls, it->bytes)) {
        if (!grow((void **)&a->bad, &a->cap_bad, a->n_bad + 1, sizeof(*a->bad)))
            return a->oom = 1;
        a->bad[a->n_bad++] = *it;
        return 0;
    }
    if (!grow((void **)&a->items, &a->cap, a->n + 1, sizeof(*a->items)))
        return a->oom = 1;
    a->items[a->n++] = (kvidx_restore_item){.cls = it->cls, .key = it->key, .bytes = it->bytes,
                                            .last_access_ms = it->last_access_ms};
    return 0;
}

static di_status restore(kvs_store *s, di_error *err)
{
    restore_acc a = {.s = s};
    uint64_t bad_meta = 0;
    di_status st = kvdisk_scan(s->disk, collect_item, &a, &bad_meta, err);
    if (st == DI_ECORRUPT) {
        /* An unreadable file found while scanning: set it aside and scan what is left. */
        a.n = a.n_bad = 0;
        st = kvdisk_repair(s->disk, err ? err->msg : "scanning RocksDB: corruption", err);
        if (st == DI_OK)
            st = kvdisk_scan(s->disk, collect_item, &a, &bad_meta, err);
    }
    s->meta_bad = bad_meta;
    kvdisk_usage u;
    kvdisk_get_usage(s->disk, &u);
    if (st == DI_OK && u.files_lost > 0)
        di_log(s->cfg.log, DI_LOG_WARN,
               "%llu unreadable RocksDB files set aside in %s/lost; their objects are gone "
               "(%s)",
               (unsigned long long)u.files_lost, s->dir, u.repair_note);
    if (st == DI_ECANCELED && a.oom)
        st = di_fail(err, DI_ENOMEM, "out of memory while scanning the disk tier");
    if (st == DI_OK && a.n_bad > 0) {
        di_log(s->cfg.log, DI_LOG_WARN,
               "dropping %zu objects on disk whose size does not fit this configuration", a.n_bad);
        st = kvdisk_delete(s->disk, a.bad, a.n_bad, err);
    }
    if (st == DI_OK)
        st = kvidx_restore(s->idx, a.items, a.n, err);
    if (st == DI_OK && (a.n > 0 || bad_meta > 0))
        di_log(s->cfg.log, DI_LOG_INFO,
               "restored %zu objects from disk (%llu unreadable meta records dropped)", a.n,
               (unsigned long long)bad_meta);
    free(a.items);
    free(a.bad);
    return st;
}

static di_status check_config(const kvs_config *cfg, di_error *err)
{
    if (!cfg || !cfg->arena || cfg->arena_bytes == 0)
        return di_fail(err, DI_EINVAL, "store config needs a DRAM arena");
    di_status st = kv_geometry_validate(&cfg->geometry, err);
    if (st != DI_OK)
        return st;
    for (int c = 0; c < (int)KVKEY_CLASS_COUNT; c++)
        if (cfg->object_bytes[c] <= KV_HEADER_BYTES)
            return di_fail(err, DI_EINVAL, "%s objects of %llu bytes leave no payload after the "
                                           "%u-byte header",
                           kvkey_class_name(c), (unsigned long long)cfg->object_bytes[c],
                           KV_HEADER_BYTES);
    if (cfg->dram_capacity > cfg->arena_bytes)
        return di_fail(err, DI_EINVAL, "DRAM capacity %llu exceeds the arena of %llu bytes",
                       (unsigned long long)cfg->dram_capacity,
                       (unsigned long long)cfg->arena_bytes);
    return DI_OK;
}

static di_status open_tiers(kvs_store *s, di_error *err)
{
    const kvs_config *cfg = &s->cfg;
    kvslab_config sc = {.base = cfg->arena, .arena_bytes = cfg->arena_bytes};
    for (int c = 0; c < (int)KVKEY_CLASS_COUNT; c++) {
        sc.object_bytes[c] = cfg->object_bytes[c];
        sc.share[c] = cfg->dram_share[c];
    }
    di_status st = kvslab_create(&sc, &s->slab, err);
    if (st == DI_OK && cfg->dram_capacity)
        st = kvslab_set_capacity(s->slab, cfg->dram_capacity, err);
    if (st != DI_OK)
        return st;
    kvidx_config ic = {.disk_capacity = cfg->disk_capacity,
                       .alloc_timeout_ms = cfg->alloc_timeout_ms,
                       .lease_max_ms = cfg->lease_max_ms,
                       .max_leases = cfg->max_leases,
                       .max_objects = cfg->max_objects,
                       .hash_seed = di_mono_ns() ^ (uint64_t)(uintptr_t)s};
    memcpy(ic.ttl_ms, cfg->ttl_ms, sizeof(ic.ttl_ms));
    st = kvidx_create(&ic, s->slab, &s->idx, err);
    if (st != DI_OK)
        return st;
    kvdisk_config dc = cfg->disk;
    dc.stamp = (kvdisk_stamp){.model_id = cfg->geometry.model_id,
                              .block_bytes = cfg->object_bytes[KVKEY_BLOCK],
                              .window_bytes = cfg->object_bytes[KVKEY_WINDOW],
                              .ring_positions = cfg->geometry.ring_positions};
    st = kvdisk_open(&dc, &s->disk, err);
    if (st != DI_OK)
        return st;
    return restore(s, err);
}

di_status kvs_open(const kvs_config *cfg, kvs_store **out, di_error *err)
{
    di_status st = check_config(cfg, err);
    if (st != DI_OK)
        return st;
    if (!out)
        return di_fail(err, DI_EINVAL, "kvs_open: out is NULL");
    kvs_store *s = calloc(1, sizeof(*s));
    if (!s)
        return di_fail(err, DI_ENOMEM, "cannot allocate the store");
    s->cfg = *cfg;
    s->dir = cfg->disk.dir ? strdup(cfg->disk.dir) : NULL;
    s->log_dir = cfg->disk.log_dir ? strdup(cfg->disk.log_dir) : NULL;
    s->cfg.disk.dir = s->dir;
    s->cfg.disk.log_dir = s->log_dir;
    s->wall0_ms = di_wall_ms();
    s->mono0_ns = di_mono_ns();
    pthread_mutex_init(&s->mu, NULL);
    pthread_cond_init(&s->loaded, NULL);
    pthread_cond_init(&s->wake, NULL);
    if (!s->dir || (cfg->disk.log_dir && !s->log_dir))
        st = di_fail(err, cfg->disk.dir ? DI_ENOMEM : DI_EINVAL, "store needs a directory");
    if (st == DI_OK)
        st = open_tiers(s, err);
    if (st == DI_OK) {
        pthread_mutex_lock(&s->mu);
        kvidx_sweep(s->idx, now_locked(s), NULL);
        pthread_mutex_unlock(&s->mu);
        drain_deletes(s);
        if (pthread_create(&s->sweeper, NULL, sweeper_main, s) != 0)
            st = di_fail(err, DI_ENOMEM, "cannot start the sweeper thread");
        else
            s->sweeper_running = 1;
    }
    if (st != DI_OK) {
        kvs_close(s);
        return st;
    }
    *out = s;
    return DI_OK;
}

kvs_store *kvs_close(kvs_store *s)
{
    if (!s)
        return NULL;
    if (s->sweeper_running) {
        pthread_mutex_lock(&s->mu);
        s->stop = 1;
        pthread_cond_broadcast(&s->wake);
        pthread_mutex_unlock(&s->mu);
        pthread_join(s->sweeper, NULL);
    }
    if (s->disk && s->idx)
        drain_deletes(s);
    s->disk = kvdisk_close(s->disk);
    s->idx = kvidx_free(s->idx);
    s->slab = kvslab_free(s->slab);
    pthread_mutex_destroy(&s->mu);
    pthread_cond_destroy(&s->loaded);
    pthread_cond_destroy(&s->wake);
    free(s->dir);
    free(s->log_dir);
    free(s);
    return NULL;
}

/* ---------------------------------------------------------------- lookups */

void kvs_lookup(kvs_store *s, const kvkey *keys, size_t n, uint32_t *blocks_hit,
                uint32_t *windows, size_t max_windows, size_t *n_windows)
{
    pthread_mutex_lock(&s->mu);
    kvidx_lookup(s->idx, keys, n, now_locked(s), blocks_hit, windows, max_windows, n_windows);
    pthread_mutex_unlock(&s->mu);
    drain_deletes(s); /* lookups may have expired objects */
}

/* ---------------------------------------------------------------- writes */

di_status kvs_alloc(kvs_store *s, int cls, const kvkey *key, uint64_t bytes, uint64_t *alloc_id,
                    uint64_t *offset, di_error *err)
{
    if (cls < 0 || cls >= (int)KVKEY_CLASS_COUNT || !key || !alloc_id || !offset)
        return di_fail(err, DI_EINVAL, "alloc: unknown class %d or NULL argument", cls);
    if (!size_fits(&s->cfg, cls, bytes))
        return di_fail(err, DI_EINVAL, "%s objects are %s%llu bytes, got %llu",
                       kvkey_class_name(cls), cls == KVKEY_HANDOFF ? "at most " : "",
                       (unsigned long long)s->cfg.object_bytes[cls], (unsigned long long)bytes);
    di_status st = DI_OK;
    for (int attempt = 0; attempt < 2; attempt++) {
        kvidx_obj *o;
        pthread_mutex_lock(&s->mu);
        st = kvidx_alloc(s->idx, cls, key, bytes, now_locked(s), alloc_id, &o, err);
        if (st == DI_OK)
            *offset = kvslab_offset(s->slab, cls, o->slot);
        pthread_mutex_unlock(&s->mu);
        drain_deletes(s); /* evictions for room; a key being removed is freed for the retry */
        if (st != DI_EBUSY)
            break;
    }
    return st;
}

di_status kvs_abort(kvs_store *s, uint64_t alloc_id, di_error *err)
{
    pthread_mutex_lock(&s->mu);
    di_status st = kvidx_abort(s->idx, alloc_id, err);
    pthread_mutex_unlock(&s->mu);
    return st;
}

/* Verifies the bytes a client put into an object's slot. */
static di_status verify_slot(kvs_store *s, const kvidx_obj *o, di_error *err)
{
    const void *p = kvslab_addr(s->slab, o->cls, o->slot);
    di_status st = kvkey_object_verify(o->cls, &o->key, p, o->bytes, &s->cfg.geometry, err);
    if (st != DI_OK && err) {
        char hex[65], msg[sizeof(err->msg)];
        kvkey_hex(&o->key, hex);
        snprintf(msg, sizeof(msg), "%s", err->msg);
        di_fail(err, st, "%s %.16s rejected at commit: %s%s", kvkey_class_name(o->cls), hex, msg,
                strstr(msg, "checksum") ? " (the bytes were torn or changed in transit: put it "
                                          "again)"
                                        : "");
    }
    return st;
}

void kvs_commit(kvs_store *s, const uint64_t *ids, size_t n, di_status *st, di_error *errs)
{
    if (n == 0)
        return;
    kvidx_obj **objs = calloc(n, sizeof(*objs));
    kvdisk_item *items = calloc(n, sizeof(*items));
    size_t *which = calloc(n, sizeof(*which));
    if (!objs || !items || !which) {
        for (size_t i = 0; i < n; i++)
            st[i] = di_fail(errs ? &errs[i] : NULL, DI_ENOMEM, "commit: out of memory");
        free(objs);
        free(items);
        free(which);
        return;
    }
    pthread_mutex_lock(&s->mu);
    uint64_t now = now_locked(s);
    for (size_t i = 0; i < n; i++)
        st[i] = kvidx_commit_begin(s->idx, ids[i], now, &objs[i], errs ? &errs[i] : NULL);
    pthread_mutex_unlock(&s->mu);
    /* Verify outside the lock: COMMITTING objects are never reclaimed. */
    size_t m = 0;
    for (size_t i = 0; i < n; i++) {
        if (st[i] != DI_OK)
            continue;
        st[i] = verify_slot(s, objs[i], errs ? &errs[i] : NULL);
        if (st[i] != DI_OK)
            continue;
        items[m] = (kvdisk_item){.cls = objs[i]->cls, .key = objs[i]->key,
                                 .data = kvslab_addr(s->slab, objs[i]->cls, objs[i]->slot),
                                 .bytes = objs[i]->bytes, .last_access_ms = now};
        which[m++] = i;
    }
    di_error derr;
    di_status dst = m ? kvdisk_put(s->disk, items, m, &derr) : DI_OK;
    pthread_mutex_lock(&s->mu);
    now = now_locked(s);
    size_t k = 0;
    for (size_t i = 0; i < n; i++) {
        int written = k < m && which[k] == i;
        k += (size_t)written;
        if (!objs[i])
            continue;
        if (written && dst != DI_OK) {
            st[i] = dst;
            if (errs)
                errs[i] = derr;
        }
        kvidx_commit_end(s->idx, objs[i], st[i] == DI_OK, written, now);
        if (st[i] == DI_OK)
            s->put_bytes += objs[i]->bytes;
    }
    pthread_mutex_unlock(&s->mu);
    free(objs);
    free(items);
    free(which);
    drain_deletes(s);
}

/* ---------------------------------------------------------------- reads */

/* Waits on the loaded condition until deadline_ns (di_mono_ns clock). 0 on timeout. */
static int wait_loaded(kvs_store *s, uint64_t deadline_ns)
{
    uint64_t now = di_mono_ns();
    if (now >= deadline_ns)
        return 0;
    struct timespec until;
    clock_gettime(CLOCK_REALTIME, &until);
    uint64_t ns = (uint64_t)until.tv_nsec + (deadline_ns - now);
    until.tv_sec += (time_t)(ns / 1000000000ull);
    until.tv_nsec = (long)(ns % 1000000000ull);
    return pthread_cond_timedwait(&s->loaded, &s->mu, &until) != ETIMEDOUT;
}

/* Reads an object from disk into its reserved slot and verifies it (outside the lock). */
static kvidx_load load_slot(kvs_store *s, kvidx_obj *o, di_error *err)
{
    void *dst = kvslab_addr(s->slab, o->cls, o->slot);
    uint64_t got = 0;
    di_status st = kvdisk_get(s->disk, o->cls, &o->key, dst, kvslab_slot_bytes(s->slab, o->cls),
                              &got, err);
    if (st == DI_OK && got != o->bytes)
        st = di_fail(err, DI_ECORRUPT, "disk copy has %llu bytes, expected %llu",
                     (unsigned long long)got, (unsigned long long)o->bytes);
    if (st == DI_OK)
        st = kvkey_object_verify(o->cls, &o->key, dst, o->bytes, &s->cfg.geometry, err);
    if (st == DI_OK)
        return KVIDX_LOAD_OK;
    return st == DI_ECORRUPT || st == DI_ENOENT || st == DI_ERANGE ? KVIDX_LOAD_CORRUPT
                                                                    : KVIDX_LOAD_RETRY;
}

/* Writes refreshed access times to disk now and then (not on every hit). */
static void persist_access(kvs_store *s, kvidx_obj *o)
{
    uint64_t ttl = kvidx_ttl(s->idx, o->cls);
    if (ttl == 0 || o->last_access_ms < o->persisted_access_ms + ttl / 8)
        return;
    kvdisk_item it = {.cls = o->cls, .key = o->key, .bytes = o->bytes,
                      .last_access_ms = o->last_access_ms};
    kvidx_pin(s->idx, o);
    pthread_mutex_unlock(&s->mu);
    di_error e;
    di_status st = kvdisk_touch(s->disk, &it, 1, &e);
    pthread_mutex_lock(&s->mu);
    if (st == DI_OK)
        o->persisted_access_ms = it.last_access_ms;
    kvidx_unpin(s->idx, o, now_locked(s));
}

static di_status lease_locked(kvs_store *s, int cls, const kvkey *key, uint64_t lease_ms,
                              uint64_t deadline_ns, kvidx_lease_info *li, di_error *err)
{
    for (;;) {
        di_status st = kvidx_lease(s->idx, cls, key, lease_ms, now_locked(s), li, err);
        if (st != DI_EBUSY)
            return st;
        if (!wait_loaded(s, deadline_ns))
            return di_fail(err, DI_ETIMEDOUT, "deadline passed waiting for a disk read");
    }
}

di_status kvs_lease(kvs_store *s, int cls, const kvkey *key, uint64_t lease_ms,
                    uint64_t deadline_ns, kvs_lease_info *info, di_error *err)
{
    if (cls < 0 || cls >= (int)KVKEY_CLASS_COUNT || !key || !info)
        return di_fail(err, DI_EINVAL, "lease: unknown class %d or NULL argument", cls);
    kvidx_lease_info li;
    pthread_mutex_lock(&s->mu);
    di_status st = lease_locked(s, cls, key, lease_ms, deadline_ns, &li, err);
    if (st == DI_OK && li.need_load) {
        pthread_mutex_unlock(&s->mu);
        di_error le;
        kvidx_load r = load_slot(s, li.obj, &le);
        pthread_mutex_lock(&s->mu);
        kvidx_load_done(s->idx, li.obj, r, now_locked(s));
        pthread_cond_broadcast(&s->loaded);
        if (r != KVIDX_LOAD_OK) {
            kvidx_release(s->idx, li.lease_id, now_locked(s), NULL);
            char hex[65];
            kvkey_hex(key, hex);
            if (r == KVIDX_LOAD_CORRUPT) {
                di_log(s->cfg.log, DI_LOG_WARN, "dropped %s %s: disk copy unusable: %s",
                       kvkey_class_name(cls), hex, le.msg);
                st = di_fail(err, DI_ENOENT, "%s %.16s was dropped: its disk copy is corrupt (%s)",
                             kvkey_class_name(cls), hex, le.msg);
            } else
                st = di_fail(err, le.code, "%s %.16s: reading the disk copy: %s",
                             kvkey_class_name(cls), hex, le.msg);
        }
    }
    if (st == DI_OK) {
        persist_access(s, li.obj);
        s->get_bytes += li.obj->bytes;
        uint64_t now = now_locked(s);
        *info = (kvs_lease_info){.lease_id = li.lease_id,
                                 .offset = kvslab_offset(s->slab, cls, li.obj->slot),
                                 .bytes = li.obj->bytes,
                                 .expires_in_ms = li.expires_ms > now ? li.expires_ms - now : 0};
    }
    pthread_mutex_unlock(&s->mu);
    drain_deletes(s);
    return st;
}

di_status kvs_release(kvs_store *s, uint64_t lease_id, di_error *err)
{
    pthread_mutex_lock(&s->mu);
    di_status st = kvidx_release(s->idx, lease_id, now_locked(s), err);
    pthread_mutex_unlock(&s->mu);
    drain_deletes(s);
    return st;
}

di_status kvs_report_corrupt(kvs_store *s, int cls, const kvkey *key, di_error *err)
{
    if (cls < 0 || cls >= (int)KVKEY_CLASS_COUNT || !key)
        return di_fail(err, DI_EINVAL, "report: unknown class %d or NULL key", cls);
    char hex[65];
    kvkey_hex(key, hex);
    pthread_mutex_lock(&s->mu);
    kvidx_obj *o = kvidx_pin_resident(s->idx, cls, key, now_locked(s));
    pthread_mutex_unlock(&s->mu);
    if (!o)
        return di_fail(err, DI_ENOENT, "%s %.16s has no DRAM copy", kvkey_class_name(cls), hex);
    /* The pin keeps the slot; nobody writes a RESIDENT slot, so it is checked outside the lock. */
    di_error ve;
    di_status vst = kvkey_object_verify(o->cls, &o->key, kvslab_addr(s->slab, o->cls, o->slot),
                                        o->bytes, &s->cfg.geometry, &ve);
    pthread_mutex_lock(&s->mu);
    int dropped = vst != DI_OK && kvidx_dram_corrupt(s->idx, o);
    kvidx_unpin(s->idx, o, now_locked(s));
    pthread_mutex_unlock(&s->mu);
    drain_deletes(s);
    if (dropped)
        return di_fail(err, DI_OK, "%s %.16s: DRAM copy dropped: %s", kvkey_class_name(cls),
                       hex, ve.msg);
    if (vst != DI_OK)
        return di_fail(err, DI_ENOENT, "%s %.16s left DRAM meanwhile", kvkey_class_name(cls),
                       hex);
    return di_fail(err, DI_EEXIST, "%s %.16s: its DRAM copy verifies", kvkey_class_name(cls),
                   hex);
}

di_status kvs_delete(kvs_store *s, int cls, const kvkey *key, di_error *err)
{
    pthread_mutex_lock(&s->mu);
    di_status st = kvidx_delete(s->idx, cls, key, now_locked(s), err);
    pthread_mutex_unlock(&s->mu);
    drain_deletes(s);
    return st;
}

/* ---------------------------------------------------------------- admin */

static void rates(const kvs_store *s, double *get, double *put)
{
    *get = *put = 0;
    if (s->n_samples < 2)
        return;
    unsigned newest = (s->next_sample + RATE_SAMPLES - 1) % RATE_SAMPLES;
    unsigned oldest = s->n_samples < RATE_SAMPLES ? 0 : s->next_sample;
    const rate_sample *a = &s->samples[oldest], *b = &s->samples[newest];
    double dt = (double)(b->t_ms - a->t_ms) / 1000.0;
    if (dt <= 0)
        return;
    *get = (double)(b->get_bytes - a->get_bytes) / dt;
    *put = (double)(b->put_bytes - a->put_bytes) / dt;
}

void kvs_get_stats(kvs_store *s, kvs_stats *out)
{
    memset(out, 0, sizeof(*out));
    pthread_mutex_lock(&s->mu);
    kvidx_get_stats(s->idx, &out->idx);
    for (int c = 0; c < (int)KVKEY_CLASS_COUNT; c++) {
        kvslab_stats(s->slab, c, &out->slab[c]);
        out->ttl_ms[c] = kvidx_ttl(s->idx, c);
    }
    out->dram_capacity = kvslab_capacity(s->slab);
    out->dram_arena_bytes = kvslab_arena_bytes(s->slab);
    out->get_bytes = s->get_bytes;
    out->put_bytes = s->put_bytes;
    rates(s, &out->get_bytes_per_s, &out->put_bytes_per_s);
    out->uptime_ms = (di_mono_ns() - s->mono0_ns) / 1000000ull;
    out->disk_meta_bad = s->meta_bad;
    pthread_mutex_unlock(&s->mu);
    kvdisk_get_usage(s->disk, &out->disk);
}

di_status kvs_set_ttl(kvs_store *s, int cls, uint64_t ttl_ms, di_error *err)
{
    pthread_mutex_lock(&s->mu);
    di_status st = kvidx_set_ttl(s->idx, cls, ttl_ms, err);
    if (st == DI_OK)
        kvidx_sweep(s->idx, now_locked(s), NULL);
    pthread_mutex_unlock(&s->mu);
    drain_deletes(s);
    return st;
}

di_status kvs_set_capacity(kvs_store *s, int tier, uint64_t bytes, di_error *err)
{
    if (tier != 0 && tier != 1)
        return di_fail(err, DI_EINVAL, "tier %d is neither DRAM (0) nor disk (1)", tier);
    pthread_mutex_lock(&s->mu);
    di_status st = tier == 0 ? kvslab_set_capacity(s->slab, bytes, err)
                             : kvidx_set_disk_capacity(s->idx, bytes, err);
    if (st == DI_OK)
        kvidx_sweep(s->idx, now_locked(s), NULL);
    pthread_mutex_unlock(&s->mu);
    drain_deletes(s);
    return st;
}

void kvs_inspect(kvs_store *s, int cls, const kvkey *key, kvidx_info *info, uint64_t *now_ms)
{
    pthread_mutex_lock(&s->mu);
    uint64_t now = now_locked(s);
    kvidx_inspect(s->idx, cls, key, now, info);
    pthread_mutex_unlock(&s->mu);
    if (now_ms)
        *now_ms = now;
}

void kvs_evict(kvs_store *s, unsigned class_mask, int dram_only, uint64_t *evicted,
               uint64_t *skipped)
{
    pthread_mutex_lock(&s->mu);
    kvidx_evict(s->idx, class_mask, dram_only, now_locked(s), evicted, skipped);
    pthread_mutex_unlock(&s->mu);
    drain_deletes(s);
}

di_status kvs_evict_key(kvs_store *s, int cls, const kvkey *key, int dram_only, di_error *err)
{
    pthread_mutex_lock(&s->mu);
    di_status st = kvidx_evict_key(s->idx, cls, key, dram_only, now_locked(s), err);
    pthread_mutex_unlock(&s->mu);
    drain_deletes(s);
    return st;
}

void kvs_compact(kvs_store *s, uint64_t *expired, uint64_t *sst_before, uint64_t *sst_after)
{
    kvidx_sweep_report r;
    pthread_mutex_lock(&s->mu);
    kvidx_sweep(s->idx, now_locked(s), &r);
    pthread_mutex_unlock(&s->mu);
    drain_deletes(s);
    kvdisk_usage u;
    kvdisk_get_usage(s->disk, &u);
    *sst_before = u.sst_bytes;
    kvdisk_compact(s->disk, NULL);
    kvdisk_get_usage(s->disk, &u);
    *sst_after = u.sst_bytes;
    *expired = r.expired;
}
