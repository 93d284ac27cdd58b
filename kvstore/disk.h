/* disk.h: the store's RocksDB tier (C API).
 *
 * One column family per object class ("block", "window", "handoff"); the default family holds
 * the store's format stamp (model id and object sizes), checked at every open so that a
 * directory is never read with another model's geometry. Inside a class family:
 *
 *     'd' + key (33 bytes)  ->  the object exactly as stored in DRAM (kv_header + payload)
 *     'm' + key (33 bytes)  ->  a 40-byte meta record (class, size, last access, created,
 *                               checksum of the record)
 *
 * Data and meta of an object are written in one WriteBatch, so after any crash both or
 * neither exist. Calls are thread-safe. The object's own kv_header checksum is verified by the store on every read
 * from disk; a corrupt value is dropped, never served.
 *
 * Durability of kvdisk_put (the store acknowledges a commit only after it returns):
 *   KVDISK_NONE   memtable only (WAL off): lost on a crash of the process until RocksDB flushes.
 *   KVDISK_WAL    written to the WAL (OS page cache) before return: survives kill -9 of the
 *                 store, not a power loss or kernel crash.
 *   KVDISK_FSYNC  WAL written and fdatasync'ed before return: survives power loss (if the
 *                 disk honours flushes).
 *
 * RocksDB's malloc'd error strings are translated to di_status here and freed: "No space" ->
 * DI_ENOSPC, "Corruption" -> DI_ECORRUPT, other I/O errors -> DI_EIO.
 */
#ifndef DI_KVSTORE_DISK_H
#define DI_KVSTORE_DISK_H

#include <stddef.h>
#include <stdint.h>

#include "common/kvfmt/kv_keys.h"
#include "common/util/status.h"

typedef enum kvdisk_durability {
    KVDISK_NONE = 0,
    KVDISK_WAL = 1,
    KVDISK_FSYNC = 2,
} kvdisk_durability;

/* "none", "wal", "fsync"; NULL-safe parse returns -1 for anything else. */
const char *kvdisk_durability_name(int d);
int kvdisk_durability_parse(const char *s);

typedef struct kvdisk kvdisk;

/* The geometry stamp a directory is bound to. */
typedef struct kvdisk_stamp {
    uint64_t model_id;       /* kv_geometry.model_id */
    uint64_t block_bytes;    /* block object size */
    uint64_t window_bytes;   /* window-state object size */
    uint32_t ring_positions; /* ring size of window states */
} kvdisk_stamp;

typedef struct kvdisk_config {
    const char *dir;             /* RocksDB directory (created if missing) */
    int durability;              /* kvdisk_durability of kvdisk_put */
    uint64_t write_buffer_bytes; /* memtable size per class (bytes); 0 = 64 MiB */
    const char *log_dir;         /* RocksDB's own LOG at info level goes here; NULL: only its
                                    header is written (in dir). Keep it off the data disk: with
                                    the LOG on a full disk, Debian's RocksDB build aborts on an
                                    internal assertion when it logs the write error. */
    kvdisk_stamp stamp;          /* must match a stamp already in dir */
} kvdisk_config;

/* Opens or creates the store directory. When RocksDB finds a file it cannot read (a flipped
 * byte in an SST's footer, index or meta block), the directory is repaired (kvdisk_repair)
 * and opened again: the store starts with what is readable. Returns DI_OK, DI_EINVAL (bad
 * config; stamp mismatch, with both stamps in the message), DI_EIO/DI_ECORRUPT/DI_ENOSPC from
 * RocksDB (with its text). *out is written only on success. */
di_status kvdisk_open(const kvdisk_config *cfg, kvdisk **out, di_error *err);
/* Repairs the directory with RocksDB's repairer, which sets every file it cannot read aside in
 * DIR/lost (whole files: their objects are gone, never served) and rebuilds the manifest from
 * the rest, then reopens it. why (copied) is reported in kvdisk_usage.repair_note. Only while
 * no other call runs (at open). DI_OK or the repair's or reopen's error. */
di_status kvdisk_repair(kvdisk *d, const char *why, di_error *err);
/* Closes the database (flushing nothing beyond what RocksDB does on close). NULL-safe. */
kvdisk *kvdisk_close(kvdisk *d);

/* One object to write. */
typedef struct kvdisk_item {
    int cls;                 /* kvkey_class */
    kvkey key;               /* object key */
    const void *data;        /* kvdisk_put: object bytes; unused elsewhere */
    uint64_t bytes;          /* object size */
    uint64_t last_access_ms; /* meta: last hit (store clock) */
} kvdisk_item;

/* Writes objects with their meta in one batch at the configured durability. DI_OK when the
 * batch is durable at that level; DI_ENOSPC (disk full), DI_EIO (other write errors, the batch
 * may or may not be on disk), DI_EINVAL (bad class). */
di_status kvdisk_put(kvdisk *d, const kvdisk_item *items, size_t n, di_error *err);
/* Rewrites the meta records of objects (last access) without the WAL: cheap, may be lost on a
 * crash. Same codes as kvdisk_put. */
di_status kvdisk_touch(kvdisk *d, const kvdisk_item *items, size_t n, di_error *err);
/* Deletes objects (data and meta) in one batch, through the WAL (no sync). */
di_status kvdisk_delete(kvdisk *d, const kvdisk_item *items, size_t n, di_error *err);

/* Reads an object's bytes into dst (capacity cap). DI_OK (*bytes written), DI_ENOENT (no data),
 * DI_ERANGE (larger than cap), DI_EIO/DI_ECORRUPT (RocksDB read error). The content is not
 * verified here. */
di_status kvdisk_get(kvdisk *d, int cls, const kvkey *key, void *dst, uint64_t cap,
                     uint64_t *bytes, di_error *err);

/* Calls fn for every object with a valid meta record, class by class. Records that fail their
 * checksum are deleted (data too) and counted in *n_bad. fn returning non-zero stops the scan
 * with DI_ECANCELED. */
typedef int (*kvdisk_scan_fn)(void *ud, const kvdisk_item *item);
di_status kvdisk_scan(kvdisk *d, kvdisk_scan_fn fn, void *ud, uint64_t *n_bad, di_error *err);

/* After a write fails with a hard error (disk full, I/O error) RocksDB refuses every later
 * write until the database is reopened. kvdisk_failed says so; kvdisk_recover reopens it
 * (waiting for calls in flight) and clears the flag: DI_OK, or the open error (still failed,
 * e.g. while the disk is still full; reads keep working only if the reopen succeeded). */
int kvdisk_failed(kvdisk *d);
di_status kvdisk_recover(kvdisk *d, di_error *err);

/* Compacts every class family (drops deleted data from the files). */
di_status kvdisk_compact(kvdisk *d, di_error *err);

/* RocksDB's own figures. */
typedef struct kvdisk_usage {
    uint64_t sst_bytes;      /* rocksdb.total-sst-files-size, all families */
    uint64_t live_bytes;     /* rocksdb.estimate-live-data-size */
    uint64_t memtable_bytes; /* rocksdb.cur-size-all-mem-tables */
    uint64_t files_lost;     /* files set aside as unreadable by repairs since open */
    const char *repair_note; /* why the last repair ran; "" when none (owned by the tier) */
} kvdisk_usage;
void kvdisk_get_usage(kvdisk *d, kvdisk_usage *out);

/* Test hook: the n-th write call from now (put, touch or delete; 1 = the next) fails with
 * DI_EIO "injected fault" without touching the database; 0 disables. */
void kvdisk_fail_write_after(kvdisk *d, uint32_t n);
/* Writes left before the armed fault fires; 0 once it fired (or when none is armed). */
uint32_t kvdisk_fault_countdown(kvdisk *d);

#endif
