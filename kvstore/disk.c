#include "kvstore/disk.h"

#include <pthread.h>
#include <rocksdb/c.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <dirent.h>
#include <sys/statvfs.h>

#include "common/util/hash64.h"

#define N_CF (1 + KVKEY_CLASS_COUNT) /* default + one per class */
#define KEY_LEN (1 + KVKEY_BYTES)
#define META_LEN 40
#define META_MAGIC 0x4d4b4944u /* "DIKM" */
#define META_VERSION 1
#define STAMP_KEY "di-kvstore/format"

struct kvdisk {
    rocksdb_t *db;                          /* the database */
    rocksdb_options_t *opts;                /* DB and family options (kept until close) */
    rocksdb_column_family_handle_t *cf[N_CF]; /* [0] default, [1 + cls] class families */
    rocksdb_writeoptions_t *wo_put;         /* per durability */
    rocksdb_writeoptions_t *wo_nowal;       /* touches */
    rocksdb_writeoptions_t *wo_delete;      /* deletes: WAL, no sync */
    rocksdb_readoptions_t *ro;              /* reads: checksums verified */
    rocksdb_readoptions_t *ro_scan;         /* scans: no block-cache fill */
    int durability;                         /* kvdisk_durability */
    char *dir;                              /* directory (copy, for reopening) */
    pthread_rwlock_t lock;                  /* every call reads; kvdisk_recover writes */
    atomic_int failed;                      /* di_status of a hard write error; 0 = none */
    int read_only;                          /* reopened read-only after a failed recovery */
    uint64_t min_free;                      /* free bytes needed before a reopen is tried */
    atomic_uint fail_countdown;             /* test hook; 0 = off */
    uint64_t files_lost;                    /* files set aside as unreadable by repairs */
    char repair_note[256];                  /* why the last repair ran ("" if none) */
};

static const char *const cf_names[N_CF] = {"default", "block", "window", "handoff"};
static const char *const durability_names[] = {"none", "wal", "fsync"};

const char *kvdisk_durability_name(int d)
{
    return d >= 0 && d <= KVDISK_FSYNC ? durability_names[d] : "?";
}

int kvdisk_durability_parse(const char *s)
{
    for (int i = 0; s && i <= KVDISK_FSYNC; i++)
        if (strcmp(s, durability_names[i]) == 0)
            return i;
    return -1;
}

/* Translates and frees a RocksDB error string. */
static di_status rocks_fail(di_error *err, char *errptr, const char *what)
{
    di_status code = DI_EIO;
    if (strstr(errptr, "No space") || strstr(errptr, "NoSpace") || strstr(errptr, "ENOSPC"))
        code = DI_ENOSPC;
    else if (strstr(errptr, "Corruption"))
        code = DI_ECORRUPT;
    else if (strstr(errptr, "Invalid argument"))
        code = DI_EINVAL;
    di_fail(err, code, "%s: %s%s", what, errptr,
            code == DI_ENOSPC ? " (disk full: free space or lower the disk capacity)" : "");
    rocksdb_free(errptr);
    return code;
}

static void make_key(uint8_t out[KEY_LEN], char kind, const kvkey *key)
{
    out[0] = (uint8_t)kind;
    memcpy(out + 1, key->b, KVKEY_BYTES);
}

static void put_le(uint8_t *p, uint64_t v, int n)
{
    for (int i = 0; i < n; i++)
        p[i] = (uint8_t)(v >> (8 * i));
}

static uint64_t get_le(const uint8_t *p, int n)
{
    uint64_t v = 0;
    for (int i = 0; i < n; i++)
        v |= (uint64_t)p[i] << (8 * i);
    return v;
}

/* meta: magic u32, version u16, class u8, pad u8, bytes u64, last_access u64, reserved u64,
 * check u64 = di_hash64 of the first 32 bytes. */
static void encode_meta(uint8_t m[META_LEN], const kvdisk_item *it)
{
    memset(m, 0, META_LEN);
    put_le(m, META_MAGIC, 4);
    put_le(m + 4, META_VERSION, 2);
    m[6] = (uint8_t)it->cls;
    put_le(m + 8, it->bytes, 8);
    put_le(m + 16, it->last_access_ms, 8);
    put_le(m + 32, di_hash64(m, 32, META_MAGIC), 8);
}

static int decode_meta(const uint8_t *m, size_t len, int cls, kvdisk_item *it)
{
    if (len != META_LEN || get_le(m, 4) != META_MAGIC || get_le(m + 4, 2) != META_VERSION ||
        m[6] != cls || get_le(m + 32, 8) != di_hash64(m, 32, META_MAGIC))
        return 0;
    it->cls = cls;
    it->bytes = get_le(m + 8, 8);
    it->last_access_ms = get_le(m + 16, 8);
    return it->bytes > 0;
}

static void format_stamp(char *buf, size_t n, const kvdisk_stamp *s)
{
    snprintf(buf, n, "v1 model=%016llx block=%llu window=%llu ring=%u",
             (unsigned long long)s->model_id, (unsigned long long)s->block_bytes,
             (unsigned long long)s->window_bytes, s->ring_positions);
}

static di_status check_stamp(kvdisk *d, const kvdisk_config *cfg, di_error *err)
{
    char want[160];
    format_stamp(want, sizeof(want), &cfg->stamp);
    char *errptr = NULL;
    size_t len = 0;
    char *have = rocksdb_get_cf(d->db, d->ro, d->cf[0], STAMP_KEY, strlen(STAMP_KEY), &len,
                                &errptr);
    if (errptr)
        return rocks_fail(err, errptr, "reading the store's format stamp");
    if (have) {
        int same = len == strlen(want) && memcmp(have, want, len) == 0;
        di_status st = DI_OK;
        if (!same)
            st = di_fail(err, DI_EINVAL,
                         "%s holds KV written with \"%.*s\", this store is configured for "
                         "\"%s\": use another --dir or the matching geometry",
                         cfg->dir, (int)(len < 120 ? len : 120), have, want);
        rocksdb_free(have);
        return st;
    }
    rocksdb_writeoptions_t *wo = rocksdb_writeoptions_create();
    rocksdb_writeoptions_set_sync(wo, 1);
    rocksdb_put_cf(d->db, wo, d->cf[0], STAMP_KEY, strlen(STAMP_KEY), want, strlen(want),
                   &errptr);
    rocksdb_writeoptions_destroy(wo);
    if (errptr)
        return rocks_fail(err, errptr, "writing the store's format stamp");
    /* Flushed at once: an unflushed family pins every WAL file written after it. */
    rocksdb_flushoptions_t *fo = rocksdb_flushoptions_create();
    rocksdb_flushoptions_set_wait(fo, 1);
    rocksdb_flush_cf(d->db, fo, d->cf[0], &errptr);
    rocksdb_flushoptions_destroy(fo);
    if (errptr)
        return rocks_fail(err, errptr, "flushing the store's format stamp");
    return DI_OK;
}

static void make_options(kvdisk *d, const kvdisk_config *cfg)
{
    d->opts = rocksdb_options_create();
    rocksdb_options_set_create_if_missing(d->opts, 1);
    rocksdb_options_set_create_missing_column_families(d->opts, 1);
    rocksdb_options_increase_parallelism(d->opts, 2);
    rocksdb_options_set_max_background_jobs(d->opts, 2);
    /* KV payloads are FP4/FP8 numbers: compression gains nothing and costs CPU. */
    rocksdb_options_set_compression(d->opts, rocksdb_no_compression);
    rocksdb_options_set_write_buffer_size(
        d->opts, cfg->write_buffer_bytes ? cfg->write_buffer_bytes : 64ull << 20);
    rocksdb_options_set_max_total_wal_size(d->opts, 512ull << 20);
    /* No blob files for the large values: RocksDB 7.8's repairer (kvdisk_repair) drops them,
     * so one unreadable SST would cost every object stored in a blob file. */
    rocksdb_options_set_paranoid_checks(d->opts, 1);
    rocksdb_options_set_wal_recovery_mode(d->opts, 2 /* point in time */);
    rocksdb_options_set_keep_log_file_num(d->opts, 4);
    if (cfg->log_dir) {
        rocksdb_options_set_db_log_dir(d->opts, cfg->log_dir);
        rocksdb_options_set_info_log_level(d->opts, 1 /* info */);
    } else
        rocksdb_options_set_info_log_level(d->opts, 5 /* header only */);
    d->wo_put = rocksdb_writeoptions_create();
    if (cfg->durability == KVDISK_NONE)
        rocksdb_writeoptions_disable_WAL(d->wo_put, 1);
    rocksdb_writeoptions_set_sync(d->wo_put, cfg->durability == KVDISK_FSYNC);
    d->wo_nowal = rocksdb_writeoptions_create();
    rocksdb_writeoptions_disable_WAL(d->wo_nowal, 1);
    d->wo_delete = rocksdb_writeoptions_create();
    if (cfg->durability == KVDISK_NONE)
        rocksdb_writeoptions_disable_WAL(d->wo_delete, 1);
    d->ro = rocksdb_readoptions_create();
    rocksdb_readoptions_set_verify_checksums(d->ro, 1);
    d->ro_scan = rocksdb_readoptions_create();
    rocksdb_readoptions_set_fill_cache(d->ro_scan, 0);
}

/* Opens the database with d's options into d->db and d->cf (read-only: for serving reads
 * while writes cannot be recovered). */
static di_status open_db(kvdisk *d, int read_only, di_error *err)
{
    const rocksdb_options_t *cf_opts[N_CF];
    for (int i = 0; i < N_CF; i++)
        cf_opts[i] = d->opts;
    char *errptr = NULL;
    if (read_only)
        d->db = rocksdb_open_for_read_only_column_families(d->opts, d->dir, N_CF, cf_names,
                                                           cf_opts, d->cf, 0, &errptr);
    else
        d->db = rocksdb_open_column_families(d->opts, d->dir, N_CF, cf_names, cf_opts, d->cf,
                                             &errptr);
    if (errptr) {
        char what[300];
        snprintf(what, sizeof(what), "opening RocksDB in %s", d->dir);
        d->db = NULL;
        memset(d->cf, 0, sizeof(d->cf));
        return rocks_fail(err, errptr, what);
    }
    return DI_OK;
}

static void close_db(kvdisk *d)
{
    for (int i = 0; i < N_CF; i++)
        if (d->cf[i])
            rocksdb_column_family_handle_destroy(d->cf[i]);
    memset(d->cf, 0, sizeof(d->cf));
    if (d->db)
        rocksdb_close(d->db);
    d->db = NULL;
}

di_status kvdisk_open(const kvdisk_config *cfg, kvdisk **out, di_error *err)
{
    if (!cfg || !cfg->dir || !*cfg->dir || !out)
        return di_fail(err, DI_EINVAL, "kvdisk_open: a directory is required");
    if (cfg->durability < KVDISK_NONE || cfg->durability > KVDISK_FSYNC)
        return di_fail(err, DI_EINVAL, "durability %d is not none, wal or fsync",
                       cfg->durability);
    kvdisk *d = calloc(1, sizeof(*d));
    if (!d || !(d->dir = strdup(cfg->dir))) {
        free(d);
        return di_fail(err, DI_ENOMEM, "cannot allocate the disk tier");
    }
    pthread_rwlock_init(&d->lock, NULL);
    d->durability = cfg->durability;
    make_options(d, cfg);
    d->min_free = 2 * (cfg->write_buffer_bytes ? cfg->write_buffer_bytes : 64ull << 20);
    di_status st = open_db(d, 0, err);
    if (st == DI_ECORRUPT)
        st = kvdisk_repair(d, err ? err->msg : "opening RocksDB: corruption", err);
    if (st == DI_OK)
        st = check_stamp(d, cfg, err);
    if (st != DI_OK) {
        kvdisk_close(d);
        return st;
    }
    *out = d;
    return DI_OK;
}

/* Table and blob files in DIR/lost, where RocksDB's repair moves what it cannot read. */
static uint64_t count_lost(const char *dir)
{
    char path[4096];
    snprintf(path, sizeof(path), "%s/lost", dir);
    DIR *dp = opendir(path);
    if (!dp)
        return 0;
    uint64_t n = 0;
    for (struct dirent *e; (e = readdir(dp));) {
        /* Old manifests go there too; only data files count. */
        size_t len = strlen(e->d_name);
        n += (len > 4 && strcmp(e->d_name + len - 4, ".sst") == 0) ||
             (len > 5 && strcmp(e->d_name + len - 5, ".blob") == 0);
    }
    closedir(dp);
    return n;
}

/* The repairer knows only the default family when it replays WAL files, so records of the
 * class families still in the WAL would be lost: open without the checks that refuse an
 * unreadable table (the WAL is replayed), flush every family into tables, close. Best
 * effort: when this open fails too, the repair goes ahead. */
static void flush_wal_to_tables(kvdisk *d, rocksdb_options_t *opts)
{
    rocksdb_options_set_paranoid_checks(opts, 0);
    rocksdb_options_t *saved = d->opts;
    d->opts = opts;
    if (open_db(d, 0, NULL) == DI_OK) {
        rocksdb_flushoptions_t *fo = rocksdb_flushoptions_create();
        rocksdb_flushoptions_set_wait(fo, 1);
        for (int i = 0; i < N_CF; i++) {
            char *errptr = NULL;
            rocksdb_flush_cf(d->db, fo, d->cf[i], &errptr);
            if (errptr)
                rocksdb_free(errptr);
        }
        rocksdb_flushoptions_destroy(fo);
        close_db(d);
    }
    d->opts = saved;
}

di_status kvdisk_repair(kvdisk *d, const char *why, di_error *err)
{
    snprintf(d->repair_note, sizeof(d->repair_note), "%s", why ? why : "");
    uint64_t before = count_lost(d->dir);
    pthread_rwlock_wrlock(&d->lock);
    close_db(d);
    /* The repairer turns every WAL file into a table, including records some family already
     * flushed; its tables then overlap older ones in sequence numbers, which RocksDB's
     * consistency check refuses (the newer copy wins on reads, so nothing is lost). */
    char *errptr = NULL;
    rocksdb_options_t *ro = rocksdb_options_create();
    rocksdb_get_options_from_string(d->opts, "force_consistency_checks=false", ro, &errptr);
    if (!errptr)
        flush_wal_to_tables(d, ro);
    if (!errptr)
        rocksdb_repair_db(ro, d->dir, &errptr);
    rocksdb_options_destroy(ro);
    di_status st = errptr ? rocks_fail(err, errptr, "repairing RocksDB") : open_db(d, 0, err);
    pthread_rwlock_unlock(&d->lock);
    uint64_t after = count_lost(d->dir);
    d->files_lost += after > before ? after - before : 0;
    return st;
}

int kvdisk_failed(kvdisk *d)
{
    return atomic_load(&d->failed);
}

di_status kvdisk_recover(kvdisk *d, di_error *err)
{
    if (!atomic_load(&d->failed))
        return DI_OK;
    struct statvfs vfs;
    if (statvfs(d->dir, &vfs) == 0 && (uint64_t)vfs.f_bavail * vfs.f_frsize < d->min_free)
        return di_fail(err, DI_ENOSPC, "%s has %llu bytes free, waiting for %llu", d->dir,
                       (unsigned long long)vfs.f_bavail * vfs.f_frsize,
                       (unsigned long long)d->min_free);
    pthread_rwlock_wrlock(&d->lock);
    close_db(d);
    di_status st = open_db(d, 0, err);
    d->read_only = 0;
    if (st == DI_OK)
        atomic_store(&d->failed, 0);
    else /* keep serving reads; writes are tried again later */
        d->read_only = open_db(d, 1, NULL) == DI_OK;
    pthread_rwlock_unlock(&d->lock);
    return st;
}

kvdisk *kvdisk_close(kvdisk *d)
{
    if (!d)
        return NULL;
    close_db(d);
    if (d->opts)
        rocksdb_options_destroy(d->opts);
    if (d->wo_put)
        rocksdb_writeoptions_destroy(d->wo_put);
    if (d->wo_nowal)
        rocksdb_writeoptions_destroy(d->wo_nowal);
    if (d->wo_delete)
        rocksdb_writeoptions_destroy(d->wo_delete);
    if (d->ro)
        rocksdb_readoptions_destroy(d->ro);
    if (d->ro_scan)
        rocksdb_readoptions_destroy(d->ro_scan);
    pthread_rwlock_destroy(&d->lock);
    free(d->dir);
    free(d);
    return NULL;
}

void kvdisk_fail_write_after(kvdisk *d, uint32_t n)
{
    atomic_store(&d->fail_countdown, n);
}

uint32_t kvdisk_fault_countdown(kvdisk *d)
{
    return atomic_load(&d->fail_countdown);
}

/* The test hook: true when this write must fail. */
static int injected_fault(kvdisk *d)
{
    unsigned n = atomic_load(&d->fail_countdown);
    while (n > 0) {
        if (atomic_compare_exchange_weak(&d->fail_countdown, &n, n - 1))
            return n == 1;
    }
    return 0;
}

static di_status check_items(const kvdisk_item *items, size_t n, di_error *err)
{
    if (n > 0 && !items)
        return di_fail(err, DI_EINVAL, "disk batch: items is NULL");
    for (size_t i = 0; i < n; i++)
        if (items[i].cls < 0 || items[i].cls >= (int)KVKEY_CLASS_COUNT)
            return di_fail(err, DI_EINVAL, "disk batch item %zu: class %d", i, items[i].cls);
    return DI_OK;
}

typedef enum batch_kind { BATCH_PUT, BATCH_TOUCH, BATCH_DELETE } batch_kind;

static di_status write_batch(kvdisk *d, const kvdisk_item *items, size_t n, batch_kind kind,
                             di_error *err)
{
    di_status st = check_items(items, n, err);
    if (st != DI_OK || n == 0)
        return st;
    if (injected_fault(d))
        return di_fail(err, DI_EIO, "writing to RocksDB: injected fault");
    /* The lock is held while the batch names the column families: a reopen replaces them. */
    pthread_rwlock_rdlock(&d->lock);
    if (!d->db || d->read_only) {
        pthread_rwlock_unlock(&d->lock);
        di_status why = atomic_load(&d->failed) == DI_ENOSPC ? DI_ENOSPC : DI_EIO;
        return di_fail(err, why,
                       "the disk tier refuses writes since an earlier %s; it reopens by itself "
                       "once there is room",
                       why == DI_ENOSPC ? "disk-full error" : "write error");
    }
    rocksdb_writebatch_t *b = rocksdb_writebatch_create();
    for (size_t i = 0; i < n; i++) {
        rocksdb_column_family_handle_t *cf = d->cf[1 + items[i].cls];
        uint8_t dk[KEY_LEN], mk[KEY_LEN], meta[META_LEN];
        make_key(dk, 'd', &items[i].key);
        make_key(mk, 'm', &items[i].key);
        if (kind == BATCH_DELETE) {
            rocksdb_writebatch_delete_cf(b, cf, (const char *)dk, KEY_LEN);
            rocksdb_writebatch_delete_cf(b, cf, (const char *)mk, KEY_LEN);
            continue;
        }
        if (kind == BATCH_PUT)
            rocksdb_writebatch_put_cf(b, cf, (const char *)dk, KEY_LEN, items[i].data,
                                      items[i].bytes);
        encode_meta(meta, &items[i]);
        rocksdb_writebatch_put_cf(b, cf, (const char *)mk, KEY_LEN, (const char *)meta,
                                  META_LEN);
    }
    const rocksdb_writeoptions_t *wo = kind == BATCH_PUT     ? d->wo_put
                                       : kind == BATCH_TOUCH ? d->wo_nowal
                                                             : d->wo_delete;
    char *errptr = NULL;
    rocksdb_write(d->db, wo, b, &errptr);
    pthread_rwlock_unlock(&d->lock);
    rocksdb_writebatch_destroy(b);
    if (!errptr)
        return DI_OK;
    st = rocks_fail(err, errptr,
                    kind == BATCH_PUT     ? "writing objects to RocksDB"
                    : kind == BATCH_TOUCH ? "updating object access times in RocksDB"
                                          : "deleting objects from RocksDB");
    /* After a failed write RocksDB refuses every later one until it is reopened. */
    if (st == DI_ENOSPC || st == DI_EIO)
        atomic_store(&d->failed, (int)st); /* non-zero: the code of the failure */
    return st;
}

di_status kvdisk_put(kvdisk *d, const kvdisk_item *items, size_t n, di_error *err)
{
    for (size_t i = 0; i < n; i++)
        if (items && (!items[i].data || items[i].bytes == 0))
            return di_fail(err, DI_EINVAL, "disk put item %zu has no data", i);
    return write_batch(d, items, n, BATCH_PUT, err);
}

di_status kvdisk_touch(kvdisk *d, const kvdisk_item *items, size_t n, di_error *err)
{
    return write_batch(d, items, n, BATCH_TOUCH, err);
}

di_status kvdisk_delete(kvdisk *d, const kvdisk_item *items, size_t n, di_error *err)
{
    return write_batch(d, items, n, BATCH_DELETE, err);
}

di_status kvdisk_get(kvdisk *d, int cls, const kvkey *key, void *dst, uint64_t cap,
                     uint64_t *bytes, di_error *err)
{
    if (cls < 0 || cls >= (int)KVKEY_CLASS_COUNT || !key || !dst || !bytes)
        return di_fail(err, DI_EINVAL, "kvdisk_get: bad class or NULL argument");
    uint8_t dk[KEY_LEN];
    make_key(dk, 'd', key);
    char *errptr = NULL;
    di_status st = DI_OK;
    pthread_rwlock_rdlock(&d->lock);
    rocksdb_pinnableslice_t *v =
        d->db ? rocksdb_get_pinned_cf(d->db, d->ro, d->cf[1 + cls], (const char *)dk, KEY_LEN,
                                      &errptr)
              : NULL;
    if (!d->db)
        st = di_fail(err, DI_EIO, "RocksDB could not be reopened after a write error");
    else if (errptr)
        st = rocks_fail(err, errptr, "reading an object from RocksDB");
    else if (!v)
        st = di_fail(err, DI_ENOENT, "%s object missing from RocksDB", kvkey_class_name(cls));
    else {
        size_t len = 0;
        const char *p = rocksdb_pinnableslice_value(v, &len);
        if (len > cap)
            st = di_fail(err, DI_ERANGE, "%s object on disk has %zu bytes, more than %llu",
                         kvkey_class_name(cls), len, (unsigned long long)cap);
        else {
            memcpy(dst, p, len);
            *bytes = len;
        }
    }
    if (v)
        rocksdb_pinnableslice_destroy(v);
    pthread_rwlock_unlock(&d->lock);
    return st;
}

/* Scans one class family; bad meta keys are collected in *bad (realloc'd). */
static di_status scan_class(kvdisk *d, int cls, kvdisk_scan_fn fn, void *ud, kvkey **bad,
                            size_t *n_bad, di_error *err)
{
    rocksdb_iterator_t *it = rocksdb_create_iterator_cf(d->db, d->ro_scan, d->cf[1 + cls]);
    di_status st = DI_OK;
    for (rocksdb_iter_seek(it, "m", 1); rocksdb_iter_valid(it); rocksdb_iter_next(it)) {
        size_t kl = 0, vl = 0;
        const char *k = rocksdb_iter_key(it, &kl);
        if (kl < 1 || k[0] != 'm')
            break;
        const char *v = rocksdb_iter_value(it, &vl);
        kvdisk_item item = {0};
        if (kl == KEY_LEN)
            memcpy(item.key.b, k + 1, KVKEY_BYTES);
        if (kl != KEY_LEN || !decode_meta((const uint8_t *)v, vl, cls, &item)) {
            kvkey *nb = realloc(*bad, (*n_bad + 1) * sizeof(kvkey));
            if (!nb) {
                st = di_fail(err, DI_ENOMEM, "scan: out of memory");
                break;
            }
            *bad = nb;
            (*bad)[(*n_bad)++] = item.key;
            continue;
        }
        if (fn(ud, &item)) {
            st = di_fail(err, DI_ECANCELED, "scan stopped by its callback");
            break;
        }
    }
    char *errptr = NULL;
    rocksdb_iter_get_error(it, &errptr);
    rocksdb_iter_destroy(it);
    if (errptr && st == DI_OK)
        return rocks_fail(err, errptr, "scanning RocksDB");
    if (errptr)
        rocksdb_free(errptr);
    return st;
}

di_status kvdisk_scan(kvdisk *d, kvdisk_scan_fn fn, void *ud, uint64_t *n_bad, di_error *err)
{
    /* Runs at open, before any other caller: no lock needed. */
    if (!fn)
        return di_fail(err, DI_EINVAL, "kvdisk_scan: no callback");
    uint64_t total_bad = 0;
    for (int c = 0; c < (int)KVKEY_CLASS_COUNT; c++) {
        kvkey *bad = NULL;
        size_t nb = 0;
        di_status st = scan_class(d, c, fn, ud, &bad, &nb, err);
        if (st == DI_OK && nb > 0) {
            kvdisk_item *del = calloc(nb, sizeof(*del));
            if (!del)
                st = di_fail(err, DI_ENOMEM, "scan: out of memory");
            for (size_t i = 0; del && i < nb; i++) {
                del[i].cls = c;
                del[i].key = bad[i];
            }
            if (del)
                st = kvdisk_delete(d, del, nb, err);
            free(del);
        }
        free(bad);
        total_bad += nb;
        if (st != DI_OK)
            return st;
    }
    if (n_bad)
        *n_bad = total_bad;
    return DI_OK;
}

di_status kvdisk_compact(kvdisk *d, di_error *err)
{
    pthread_rwlock_rdlock(&d->lock);
    for (int i = 1; d->db && i < N_CF; i++)
        rocksdb_compact_range_cf(d->db, d->cf[i], NULL, 0, NULL, 0);
    pthread_rwlock_unlock(&d->lock);
    (void)err;
    return DI_OK;
}

void kvdisk_get_usage(kvdisk *d, kvdisk_usage *out)
{
    memset(out, 0, sizeof(*out));
    pthread_rwlock_rdlock(&d->lock);
    for (int i = 0; d->db && i < N_CF; i++) {
        uint64_t v = 0;
        if (rocksdb_property_int_cf(d->db, d->cf[i], "rocksdb.total-sst-files-size", &v) == 0)
            out->sst_bytes += v;
        if (rocksdb_property_int_cf(d->db, d->cf[i], "rocksdb.estimate-live-data-size", &v) == 0)
            out->live_bytes += v;
        if (rocksdb_property_int_cf(d->db, d->cf[i], "rocksdb.cur-size-all-mem-tables", &v) == 0)
            out->memtable_bytes += v;
    }
    out->files_lost = d->files_lost;
    out->repair_note = d->repair_note;
    pthread_rwlock_unlock(&d->lock);
}
