/* The store core in-process (kvstore/store.h): commit verification, durability of committed
 * objects across a reopen, promotion from disk, a corrupt RocksDB value dropped as a miss,
 * injected disk faults, capacities and TTL changes at run time. The DRAM arena is plain
 * memory here; the UCX path is covered by the service tests. */
#include <criterion/criterion.h>
#include <dirent.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "kvstore/store.h"
#include "tests/kvstore/helpers.h"

#define BLOCK 4224
#define WINDOW 8320
#define HANDOFF 16512

typedef struct fx {
    char dir[256];
    void *arena;
    kvs_config cfg;
    kvs_store *s;
    kv_geometry g;
} fx;

static void open_store(fx *f)
{
    di_error e;
    cr_assert_eq(kvs_open(&f->cfg, &f->s, &e), DI_OK, "%s", e.msg);
}

static void setup(fx *f, int durability)
{
    memset(f, 0, sizeof(*f));
    th_tmpdir(f->dir);
    f->arena = aligned_alloc(4096, 1 << 20);
    kv_geometry_v41_flash(5, &f->g);
    f->cfg = (kvs_config){.arena = f->arena, .arena_bytes = 1 << 20,
                          .dram_share = {0.5, 0.3, 0.2}, .geometry = f->g,
                          .object_bytes = {BLOCK, WINDOW, HANDOFF},
                          .disk = {.dir = f->dir, .durability = durability},
                          .disk_capacity = 64 << 20, .ttl_ms = {0, 0, 60000},
                          .alloc_timeout_ms = 10000, .lease_max_ms = 10000, .max_leases = 64,
                          .max_objects = 10000, .sweep_interval_ms = 50};
    open_store(f);
}

static void teardown(fx *f)
{
    kvs_close(f->s);
    free(f->arena);
    th_rmtree(f->dir);
}

static uint8_t *slot(fx *f, uint64_t offset)
{
    return (uint8_t *)f->arena + offset;
}

/* Allocates and fills a slot; returns the allocation id (and the slot's offset). */
static uint64_t stage(fx *f, int cls, const kvkey *k, size_t bytes, uint64_t salt,
                      uint64_t *offset)
{
    uint64_t id, off;
    di_error e;
    cr_assert_eq(kvs_alloc(f->s, cls, k, bytes, &id, &off, &e), DI_OK, "%s", e.msg);
    th_fill_object(slot(f, off), bytes, cls == KVKEY_WINDOW ? KV_WINDOW_MAGIC : KV_BLOCK_MAGIC,
                   &f->g, k, salt);
    if (offset)
        *offset = off;
    return id;
}

static void put(fx *f, int cls, const kvkey *k, size_t bytes, uint64_t salt)
{
    uint64_t id = stage(f, cls, k, bytes, salt, NULL);
    di_status st;
    di_error e;
    kvs_commit(f->s, &id, 1, &st, &e);
    cr_assert_eq(st, DI_OK, "%s", e.msg);
}

/* Leases, compares with the expected content, releases. */
static di_status check(fx *f, int cls, const kvkey *k, size_t bytes, uint64_t salt, di_error *e)
{
    kvs_lease_info li;
    di_status st = kvs_lease(f->s, cls, k, 1000, UINT64_MAX, &li, e);
    if (st != DI_OK)
        return st;
    uint8_t *want = malloc(bytes);
    th_fill_object(want, bytes, cls == KVKEY_WINDOW ? KV_WINDOW_MAGIC : KV_BLOCK_MAGIC, &f->g, k,
                   salt);
    cr_assert_eq(li.bytes, bytes);
    cr_assert_eq(memcmp(slot(f, li.offset), want, bytes), 0, "leased bytes differ");
    free(want);
    return kvs_release(f->s, li.lease_id, e);
}

Test(store, commit_verifies_the_slot_and_rejects_torn_puts)
{
    fx f;
    setup(&f, KVDISK_WAL);
    kvkey a = th_key(1), b = th_key(2), c = th_key(3);
    uint64_t ids[3], ob, oc;
    ids[0] = stage(&f, KVKEY_BLOCK, &a, BLOCK, 0, NULL);
    ids[1] = stage(&f, KVKEY_BLOCK, &b, BLOCK, 0, &ob);
    ids[2] = stage(&f, KVKEY_BLOCK, &c, BLOCK, 0, &oc);
    kvs_lease_info li;
    cr_assert_eq(kvs_lease(f.s, KVKEY_BLOCK, &b, 100, UINT64_MAX, &li, NULL), DI_ENOENT,
                 "not visible before commit");
    kvidx_info info;
    kvs_inspect(f.s, KVKEY_BLOCK, &b, &info, NULL);
    cr_assert_not(info.present);
    /* b loses a payload bit in transit; c arrives with another key's header. */
    slot(&f, ob)[KV_HEADER_BYTES + 77] ^= 0x10;
    kv_header h;
    memcpy(&h, slot(&f, oc), sizeof(h));
    memcpy(h.key, a.b, 32);
    memcpy(slot(&f, oc), &h, sizeof(h));
    di_status st[3];
    di_error e[3];
    kvs_commit(f.s, ids, 3, st, e);
    cr_assert_eq(st[0], DI_OK, "%s", e[0].msg);
    cr_assert_eq(st[1], DI_ECORRUPT);
    cr_assert(strstr(e[1].msg, "checksum") && strstr(e[1].msg, "put it again"), "%s", e[1].msg);
    cr_assert_eq(st[2], DI_ECORRUPT);
    cr_assert(strstr(e[2].msg, "another key"), "%s", e[2].msg);
    di_error ee;
    cr_assert_eq(check(&f, KVKEY_BLOCK, &a, BLOCK, 0, &ee), DI_OK, "%s", ee.msg);
    cr_assert_eq(check(&f, KVKEY_BLOCK, &b, BLOCK, 0, &ee), DI_ENOENT);
    /* The failed keys can be put again. */
    put(&f, KVKEY_BLOCK, &b, BLOCK, 0);
    cr_assert_eq(check(&f, KVKEY_BLOCK, &b, BLOCK, 0, &ee), DI_OK, "%s", ee.msg);
    kvs_stats s;
    kvs_get_stats(f.s, &s);
    cr_assert_eq(s.idx.commits, 2);
    cr_assert_eq(s.idx.commit_failures, 2);
    cr_assert_eq(s.slab[KVKEY_BLOCK].used, 2, "failed commits gave their slots back");
    teardown(&f);
}

Test(store, wrong_sizes_and_duplicates)
{
    fx f;
    setup(&f, KVDISK_NONE);
    kvkey k = th_key(9);
    uint64_t id, off;
    di_error e;
    cr_assert_eq(kvs_alloc(f.s, KVKEY_BLOCK, &k, BLOCK - 1, &id, &off, &e), DI_EINVAL);
    cr_assert(strstr(e.msg, "block objects are 4224 bytes, got 4223"), "%s", e.msg);
    cr_assert_eq(kvs_alloc(f.s, KVKEY_WINDOW, &k, BLOCK, &id, &off, &e), DI_EINVAL);
    cr_assert_eq(kvs_alloc(f.s, KVKEY_HANDOFF, &k, HANDOFF + 1, &id, &off, &e), DI_EINVAL);
    cr_assert(strstr(e.msg, "at most 16512"), "%s", e.msg);
    cr_assert_eq(kvs_alloc(f.s, 3, &k, BLOCK, &id, &off, &e), DI_EINVAL);
    put(&f, KVKEY_HANDOFF, &k, 5000, 1); /* handoffs are variable-size */
    cr_assert_eq(kvs_alloc(f.s, KVKEY_HANDOFF, &k, 5000, &id, &off, &e), DI_EEXIST);
    cr_assert_eq(check(&f, KVKEY_HANDOFF, &k, 5000, 1, &e), DI_OK, "%s", e.msg);
    cr_assert_eq(kvs_delete(f.s, KVKEY_HANDOFF, &k, &e), DI_OK);
    cr_assert_eq(kvs_delete(f.s, KVKEY_HANDOFF, &k, &e), DI_ENOENT);
    teardown(&f);
}

Test(store, committed_objects_come_back_after_reopen_and_are_promoted)
{
    fx f;
    setup(&f, KVDISK_FSYNC);
    for (uint64_t i = 0; i < 20; i++) {
        kvkey k = th_key(100 + i);
        put(&f, KVKEY_BLOCK, &k, BLOCK, i);
    }
    kvkey w = th_key(500);
    put(&f, KVKEY_WINDOW, &w, WINDOW, 7);
    kvs_close(f.s);
    memset(f.arena, 0xee, 1 << 20); /* the DRAM tier is gone */
    open_store(&f);
    kvs_stats s;
    kvs_get_stats(f.s, &s);
    cr_assert_eq(s.idx.cls[KVKEY_BLOCK].objects, 20);
    cr_assert_eq(s.idx.cls[KVKEY_BLOCK].dram_objects, 0);
    di_error e;
    for (uint64_t i = 0; i < 20; i++) {
        kvkey k = th_key(100 + i);
        cr_assert_eq(check(&f, KVKEY_BLOCK, &k, BLOCK, i, &e), DI_OK, "%s", e.msg);
    }
    cr_assert_eq(check(&f, KVKEY_WINDOW, &w, WINDOW, 7, &e), DI_OK, "%s", e.msg);
    kvs_get_stats(f.s, &s);
    cr_assert_eq(s.idx.promotions, 21);
    cr_assert_eq(s.idx.cls[KVKEY_BLOCK].dram_objects, 20);
    kvkey keys[3] = {th_key(100), th_key(101), th_key(999)};
    uint32_t hit, win[4];
    size_t nw;
    kvs_lookup(f.s, keys, 3, &hit, win, 4, &nw);
    cr_assert_eq(hit, 2);
    teardown(&f);
}

Test(store, a_corrupt_disk_value_is_dropped_and_reported_as_a_miss)
{
    fx f;
    setup(&f, KVDISK_WAL);
    kvkey a = th_key(1), b = th_key(2);
    put(&f, KVKEY_BLOCK, &a, BLOCK, 0);
    put(&f, KVKEY_BLOCK, &b, BLOCK, 0);
    kvs_close(f.s);
    /* Rewrite a's value with one flipped payload bit, straight into RocksDB. */
    kvdisk_config dc = {.dir = f.dir, .durability = KVDISK_WAL,
                        .stamp = {.model_id = f.g.model_id, .block_bytes = BLOCK,
                                  .window_bytes = WINDOW, .ring_positions = f.g.ring_positions}};
    kvdisk *d;
    di_error e;
    cr_assert_eq(kvdisk_open(&dc, &d, &e), DI_OK, "%s", e.msg);
    uint8_t *buf = malloc(BLOCK);
    th_fill_object(buf, BLOCK, KV_BLOCK_MAGIC, &f.g, &a, 0);
    buf[KV_HEADER_BYTES + 1000] ^= 1;
    kvdisk_item it = {.cls = KVKEY_BLOCK, .key = a, .data = buf, .bytes = BLOCK};
    cr_assert_eq(kvdisk_put(d, &it, 1, &e), DI_OK);
    kvdisk_close(d);
    free(buf);
    open_store(&f);
    cr_assert_eq(check(&f, KVKEY_BLOCK, &a, BLOCK, 0, &e), DI_ENOENT);
    cr_assert(strstr(e.msg, "dropped") && strstr(e.msg, "corrupt") && strstr(e.msg, "checksum"),
              "%s", e.msg);
    cr_assert_eq(check(&f, KVKEY_BLOCK, &a, BLOCK, 0, &e), DI_ENOENT, "gone for good");
    cr_assert_eq(check(&f, KVKEY_BLOCK, &b, BLOCK, 0, &e), DI_OK, "the rest is served: %s",
                 e.msg);
    kvs_stats s;
    kvs_get_stats(f.s, &s);
    cr_assert_eq(s.idx.corrupt_dropped, 1);
    kvs_close(f.s);
    open_store(&f); /* and it was deleted from disk */
    kvs_get_stats(f.s, &s);
    cr_assert_eq(s.idx.cls[KVKEY_BLOCK].objects, 1);
    teardown(&f);
}

Test(store, an_injected_disk_fault_fails_the_commit_and_leaks_nothing)
{
    fx f;
    setup(&f, KVDISK_FSYNC);
    kvkey k[4] = {th_key(1), th_key(2), th_key(3), th_key(4)};
    uint64_t ids[4];
    for (int i = 0; i < 4; i++)
        ids[i] = stage(&f, KVKEY_BLOCK, &k[i], BLOCK, 0, NULL);
    kvdisk_fail_write_after(kvs_disk(f.s), 1);
    di_status st[4];
    di_error e[4];
    kvs_commit(f.s, ids, 4, st, e);
    for (int i = 0; i < 4; i++) {
        cr_assert_eq(st[i], DI_EIO, "item %d: %s", i, e[i].msg);
        cr_assert(strstr(e[i].msg, "injected"), "%s", e[i].msg);
    }
    di_error ee;
    cr_assert_eq(check(&f, KVKEY_BLOCK, &k[0], BLOCK, 0, &ee), DI_ENOENT);
    kvs_stats s;
    kvs_get_stats(f.s, &s);
    cr_assert_eq(s.slab[KVKEY_BLOCK].used, 0);
    cr_assert_eq(s.idx.disk_used + s.idx.disk_deleting, 0, "disk deletes done");
    put(&f, KVKEY_BLOCK, &k[0], BLOCK, 0);
    cr_assert_eq(check(&f, KVKEY_BLOCK, &k[0], BLOCK, 0, &ee), DI_OK, "%s", ee.msg);
    teardown(&f);
}

Test(store, capacities_and_ttl_change_at_run_time)
{
    fx f;
    setup(&f, KVDISK_NONE);
    for (uint64_t i = 0; i < 40; i++) {
        kvkey k = th_key(i);
        put(&f, KVKEY_BLOCK, &k, BLOCK, 0);
    }
    kvs_stats s;
    kvs_get_stats(f.s, &s);
    uint32_t slots = s.slab[KVKEY_BLOCK].limit;
    cr_assert_eq(s.idx.cls[KVKEY_BLOCK].dram_objects, 40 < slots ? 40 : slots);
    di_error e;
    cr_assert_eq(kvs_set_capacity(f.s, 0, 1 << 18, &e), DI_OK, "%s", e.msg);
    cr_assert_eq(kvs_set_capacity(f.s, 0, 2 << 20, &e), DI_ERANGE);
    cr_assert_eq(kvs_set_capacity(f.s, 1, 10 * BLOCK, &e), DI_OK, "%s", e.msg);
    kvs_get_stats(f.s, &s);
    cr_assert_eq(s.idx.cls[KVKEY_BLOCK].objects, 10);
    cr_assert_leq(s.slab[KVKEY_BLOCK].used, s.slab[KVKEY_BLOCK].limit);
    cr_assert_eq(s.dram_capacity, 1 << 18);
    kvkey newest = th_key(39), oldest = th_key(0);
    cr_assert_eq(check(&f, KVKEY_BLOCK, &newest, BLOCK, 0, &e), DI_OK, "%s", e.msg);
    cr_assert_eq(check(&f, KVKEY_BLOCK, &oldest, BLOCK, 0, &e), DI_ENOENT);
    cr_assert_eq(kvs_set_ttl(f.s, KVKEY_BLOCK, 1, &e), DI_OK);
    usleep(5000);
    cr_assert_eq(check(&f, KVKEY_BLOCK, &newest, BLOCK, 0, &e), DI_ENOENT, "expired");
    teardown(&f);
}

/* H10: the n-th disk write fails, for n = 1, 2, ... until a run completes without a fault.
 * Each run writes, reads, deletes and re-writes objects; every step must end in success or a
 * documented error, and at the end the slot and byte accounting must match what is stored. */
Test(store, every_disk_write_failing_in_turn_leaks_nothing, .timeout = 120)
{
    for (uint32_t nth = 1;; nth++) {
        fx f;
        setup(&f, KVDISK_WAL);
        kvdisk_fail_write_after(kvs_disk(f.s), nth);
        int stored[12] = {0};
        for (uint64_t round = 0; round < 3; round++)
            for (uint64_t i = 0; i < 12; i++) {
                kvkey k = th_key(i);
                di_error e;
                if ((i + round) % 3 == 2) {
                    di_status st = kvs_delete(f.s, KVKEY_BLOCK, &k, &e);
                    cr_assert(st == DI_OK || st == DI_ENOENT, "delete: %s", e.msg);
                    stored[i] = 0;
                    continue;
                }
                uint64_t id, off;
                di_status st = kvs_alloc(f.s, KVKEY_BLOCK, &k, BLOCK, &id, &off, &e);
                cr_assert(st == DI_OK || st == DI_EEXIST || st == DI_EBUSY, "alloc: %s", e.msg);
                if (st != DI_OK)
                    continue;
                th_fill_object(slot(&f, off), BLOCK, KV_BLOCK_MAGIC, &f.g, &k, i);
                kvs_commit(f.s, &id, 1, &st, &e);
                cr_assert(st == DI_OK || st == DI_EIO, "commit: %s", e.msg);
                if (st == DI_OK)
                    stored[i] = 1;
            }
        int want = 0;
        for (int i = 0; i < 12; i++) {
            kvkey k = th_key((uint64_t)i);
            di_error e;
            di_status st = check(&f, KVKEY_BLOCK, &k, BLOCK, (uint64_t)i, &e);
            cr_assert_eq(st, stored[i] ? DI_OK : DI_ENOENT, "fault at write %u, key %d: %s", nth,
                         i, e.msg);
            want += stored[i];
        }
        kvs_stats s;
        kvs_get_stats(f.s, &s);
        cr_assert_eq(s.idx.cls[KVKEY_BLOCK].objects, (uint64_t)want, "fault at write %u", nth);
        cr_assert_eq(s.slab[KVKEY_BLOCK].used, s.idx.cls[KVKEY_BLOCK].dram_objects,
                     "fault at write %u: slots leaked", nth);
        cr_assert_eq(s.idx.disk_used, (uint64_t)want * BLOCK, "fault at write %u", nth);
        cr_assert_eq(s.idx.leases_active, 0);
        int fired = kvdisk_fault_countdown(kvs_disk(f.s)) == 0;
        teardown(&f);
        if (!fired && nth > 1)
            break; /* the fault came after the last write: every position was covered */
        cr_assert_lt(nth, 200, "runaway fault loop");
    }
}

/* ---------------------------------------------------------------- corrupt DRAM copies */

Test(store, a_reported_corrupt_dram_copy_is_dropped_and_the_disk_copy_served)
{
    fx f;
    setup(&f, KVDISK_WAL);
    kvkey a = th_key(1), b = th_key(2);
    put(&f, KVKEY_BLOCK, &a, BLOCK, 0);
    put(&f, KVKEY_BLOCK, &b, BLOCK, 0);
    di_error e;
    /* A report about a copy that verifies changes nothing. */
    cr_assert_eq(kvs_report_corrupt(f.s, KVKEY_BLOCK, &a, &e), DI_EEXIST, "%s", e.msg);
    kvs_lease_info li;
    cr_assert_eq(kvs_lease(f.s, KVKEY_BLOCK, &a, 1000, UINT64_MAX, &li, &e), DI_OK, "%s", e.msg);
    cr_assert_eq(kvs_release(f.s, li.lease_id, &e), DI_OK);
    slot(&f, li.offset)[KV_HEADER_BYTES + 99] ^= 0x40; /* the DRAM copy rots */
    cr_assert_eq(kvs_report_corrupt(f.s, KVKEY_BLOCK, &a, &e), DI_OK, "%s", e.msg);
    cr_assert(strstr(e.msg, "dropped") && strstr(e.msg, "checksum"), "%s", e.msg);
    kvs_stats s;
    kvs_get_stats(f.s, &s);
    cr_assert_eq(s.idx.corrupt_dropped, 1);
    cr_assert_eq(s.idx.cls[KVKEY_BLOCK].dram_objects, 1, "only b is left in DRAM");
    cr_assert_eq(s.idx.cls[KVKEY_BLOCK].objects, 2, "a is still on disk");
    kvidx_info info;
    kvs_inspect(f.s, KVKEY_BLOCK, &a, &info, NULL);
    cr_assert(info.present && !info.resident);
    /* The next read loads and verifies the disk copy. */
    cr_assert_eq(check(&f, KVKEY_BLOCK, &a, BLOCK, 0, &e), DI_OK, "%s", e.msg);
    cr_assert_eq(check(&f, KVKEY_BLOCK, &b, BLOCK, 0, &e), DI_OK, "%s", e.msg);
    cr_assert_eq(kvs_report_corrupt(f.s, KVKEY_BLOCK, &a, &e), DI_EEXIST, "fine again");
    kvkey none = th_key(99);
    cr_assert_eq(kvs_report_corrupt(f.s, KVKEY_BLOCK, &none, &e), DI_ENOENT);
    cr_assert_eq(kvs_report_corrupt(f.s, 7, &a, &e), DI_EINVAL);
    kvs_get_stats(f.s, &s);
    cr_assert_eq(s.idx.corrupt_dropped, 1, "false reports are not counted");
    teardown(&f);
}

Test(store, a_corrupt_copy_still_leased_is_never_leased_again)
{
    fx f;
    setup(&f, KVDISK_WAL);
    kvkey a = th_key(1);
    put(&f, KVKEY_BLOCK, &a, BLOCK, 0);
    di_error e;
    kvs_lease_info held, li;
    cr_assert_eq(kvs_lease(f.s, KVKEY_BLOCK, &a, 5000, UINT64_MAX, &held, &e), DI_OK);
    slot(&f, held.offset)[KV_HEADER_BYTES + 5] ^= 1;
    cr_assert_eq(kvs_report_corrupt(f.s, KVKEY_BLOCK, &a, &e), DI_OK, "%s", e.msg);
    /* Another reader still holds the slot: new readers get a miss, not the bad bytes. */
    cr_assert_eq(kvs_lease(f.s, KVKEY_BLOCK, &a, 1000, UINT64_MAX, &li, &e), DI_ENOENT);
    cr_assert(strstr(e.msg, "corrupt"), "%s", e.msg);
    cr_assert_eq(kvs_report_corrupt(f.s, KVKEY_BLOCK, &a, &e), DI_ENOENT, "not counted twice");
    cr_assert_eq(kvs_release(f.s, held.lease_id, &e), DI_OK);
    /* With the last reader gone the slot is free and the disk copy comes back. */
    cr_assert_eq(check(&f, KVKEY_BLOCK, &a, BLOCK, 0, &e), DI_OK, "%s", e.msg);
    kvs_stats s;
    kvs_get_stats(f.s, &s);
    cr_assert_eq(s.idx.corrupt_dropped, 1);
    cr_assert_eq(s.slab[KVKEY_BLOCK].used, 1, "one slot, no leak");
    teardown(&f);
}

/* ---------------------------------------------------------------- corrupt RocksDB files */

/* The .sst file in dir whose bytes contain needle (NULL-terminated path in out). */
static int find_sst_with(const char *dir, const void *needle, size_t n, char *out, size_t cap)
{
    DIR *dp = opendir(dir);
    cr_assert(dp);
    int found = 0;
    for (struct dirent *de; !found && (de = readdir(dp));) {
        size_t len = strlen(de->d_name);
        if (len < 4 || strcmp(de->d_name + len - 4, ".sst") != 0)
            continue;
        snprintf(out, cap, "%s/%s", dir, de->d_name);
        FILE *fp = fopen(out, "rb");
        cr_assert(fp);
        fseek(fp, 0, SEEK_END);
        long size = ftell(fp);
        uint8_t *buf = malloc((size_t)size);
        fseek(fp, 0, SEEK_SET);
        cr_assert_eq(fread(buf, 1, (size_t)size, fp), (size_t)size);
        fclose(fp);
        found = memmem(buf, (size_t)size, needle, n) != NULL;
        free(buf);
    }
    closedir(dp);
    return found;
}

static uint64_t varint(const uint8_t **p)
{
    uint64_t v = 0;
    for (int shift = 0; shift < 64; shift += 7) {
        uint8_t b = *(*p)++;
        v |= (uint64_t)(b & 0x7f) << shift;
        if (!(b & 0x80))
            break;
    }
    return v;
}

/* Flips one byte in the middle of an SST's index block, found through its footer (format
 * version >= 1: checksum type, metaindex handle, index handle, padding to 41 bytes,
 * format version, magic: 53 bytes). */
static void flip_index_block(const char *path)
{
    int fd = open(path, O_RDWR);
    cr_assert(fd >= 0);
    off_t size = lseek(fd, 0, SEEK_END);
    uint8_t foot[53];
    cr_assert_eq(pread(fd, foot, sizeof(foot), size - 53), 53);
    const uint8_t *p = foot + 1;
    uint64_t meta_off = varint(&p), meta_size = varint(&p);
    uint64_t index_off = varint(&p), index_size = varint(&p);
    cr_assert(meta_size > 0 && index_size > 0 && index_off + index_size <= (uint64_t)size,
              "footer of %s: metaindex %llu+%llu, index %llu+%llu", path,
              (unsigned long long)meta_off, (unsigned long long)meta_size,
              (unsigned long long)index_off, (unsigned long long)index_size);
    uint8_t b;
    off_t at = (off_t)(index_off + index_size / 2);
    cr_assert_eq(pread(fd, &b, 1, at), 1);
    b ^= 0x5a;
    cr_assert_eq(pwrite(fd, &b, 1, at), 1);
    close(fd);
}

/* Keeps the last warning the store logged. */
static void keep_warning(void *ud, di_log_level level, const char *line)
{
    if (level <= DI_LOG_WARN)
        snprintf(ud, 512, "%s", line);
}

Test(store, a_flipped_byte_in_an_sst_index_block_loses_that_file_only, .timeout = 60)
{
    fx f;
    setup(&f, KVDISK_WAL);
    char warning[512] = "";
    di_logger lg = {.fn = keep_warning, .userdata = warning, .level = DI_LOG_WARN};
    f.cfg.log = &lg;
    /* Blocks 1-8 end up in one SST of the block family; windows 1-3 in another family's SST;
     * blocks 11-14 only in the WAL when the store stops. */
    for (uint64_t i = 1; i <= 8; i++) {
        kvkey k = th_key(i);
        put(&f, KVKEY_BLOCK, &k, BLOCK, 0);
    }
    for (uint64_t i = 1; i <= 3; i++) {
        kvkey k = th_key(100 + i);
        put(&f, KVKEY_WINDOW, &k, WINDOW, 0);
    }
    uint64_t expired, before, after;
    kvs_compact(f.s, &expired, &before, &after);
    cr_assert_gt(after, 0, "compaction wrote SST files");
    for (uint64_t i = 11; i <= 14; i++) {
        kvkey k = th_key(i);
        put(&f, KVKEY_BLOCK, &k, BLOCK, 0);
    }
    kvs_close(f.s);
    f.s = NULL;
    kvkey k1 = th_key(1);
    char sst[600];
    /* The SST of the block family: the one holding block 1's bytes. */
    cr_assert(find_sst_with(f.dir, k1.b, sizeof(k1.b), sst, sizeof(sst)), "no SST holds block 1");
    flip_index_block(sst);
    open_store(&f); /* starts */
    di_error e;
    kvs_stats s;
    kvs_get_stats(f.s, &s);
    cr_assert_eq(s.disk.files_lost, 1, "one file set aside, not %llu (%s)",
                 (unsigned long long)s.disk.files_lost, s.disk.repair_note);
    cr_assert(strstr(s.disk.repair_note, "orruption"), "%s", s.disk.repair_note);
    cr_assert(strstr(warning, "1 unreadable RocksDB files set aside") && strstr(warning, ".sst"),
              "log: %s", warning);
    for (uint64_t i = 1; i <= 8; i++) {
        kvkey k = th_key(i);
        cr_assert_eq(check(&f, KVKEY_BLOCK, &k, BLOCK, 0, &e), DI_ENOENT, "block %llu",
                     (unsigned long long)i);
    }
    for (uint64_t i = 11; i <= 14; i++) {
        kvkey k = th_key(i);
        cr_assert_eq(check(&f, KVKEY_BLOCK, &k, BLOCK, 0, &e), DI_OK, "block %llu: %s",
                     (unsigned long long)i, e.msg);
    }
    for (uint64_t i = 1; i <= 3; i++) {
        kvkey k = th_key(100 + i);
        cr_assert_eq(check(&f, KVKEY_WINDOW, &k, WINDOW, 0, &e), DI_OK, "window %llu: %s",
                     (unsigned long long)i, e.msg);
    }
    cr_assert_eq(s.idx.cls[KVKEY_BLOCK].objects, 4);
    /* Writes work after the repair, and a restart is clean. */
    kvkey n = th_key(50);
    put(&f, KVKEY_BLOCK, &n, BLOCK, 0);
    kvs_close(f.s);
    open_store(&f);
    kvs_get_stats(f.s, &s);
    cr_assert_eq(s.disk.files_lost, 0);
    cr_assert_eq(s.idx.cls[KVKEY_BLOCK].objects, 5);
    cr_assert_eq(check(&f, KVKEY_BLOCK, &n, BLOCK, 0, &e), DI_OK, "%s", e.msg);
    teardown(&f);
}
