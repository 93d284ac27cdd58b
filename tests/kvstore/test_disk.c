/* The RocksDB tier (kvstore/disk.h): round trips, the format stamp, scans with corrupt meta,
 * deletes, injected write faults and a real full disk (a small tmpfs). */
#include <criterion/criterion.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvstore/disk.h"
#include "tests/kvstore/helpers.h"

static kvdisk_config config(const char *dir, int durability)
{
    kv_geometry g;
    kv_geometry_v41_flash(5, &g);
    kvdisk_config c = {.dir = dir, .durability = durability, .write_buffer_bytes = 4 << 20,
                       .stamp = {.model_id = g.model_id, .block_bytes = kv_block_bytes(&g),
                                 .window_bytes = kv_window_state_bytes(&g),
                                 .ring_positions = g.ring_positions}};
    return c;
}

typedef struct scan_acc {
    int n;
    kvdisk_item items[16];
} scan_acc;

static int collect(void *ud, const kvdisk_item *it)
{
    scan_acc *a = ud;
    if (a->n < 16)
        a->items[a->n] = *it;
    a->n++;
    return 0;
}

Test(disk, objects_round_trip_and_survive_reopen)
{
    char dir[256];
    th_tmpdir(dir);
    kv_geometry g;
    kv_geometry_v41_flash(5, &g);
    size_t bytes = kv_block_bytes(&g);
    uint8_t *a = malloc(bytes), *b = malloc(bytes);
    kvkey k = th_key(1);
    th_fill_object(a, bytes, KV_BLOCK_MAGIC, &g, &k, 0);
    for (int durability = KVDISK_NONE; durability <= KVDISK_FSYNC; durability++) {
        kvdisk_config c = config(dir, durability);
        kvdisk *d = NULL;
        di_error e;
        cr_assert_eq(kvdisk_open(&c, &d, &e), DI_OK, "%s", e.msg);
        kvdisk_item it = {.cls = KVKEY_BLOCK, .key = k, .data = a, .bytes = bytes,
                          .last_access_ms = 1234 + durability};
        cr_assert_eq(kvdisk_put(d, &it, 1, &e), DI_OK, "%s", e.msg);
        uint64_t got = 0;
        memset(b, 0, bytes);
        cr_assert_eq(kvdisk_get(d, KVKEY_BLOCK, &k, b, bytes, &got, &e), DI_OK, "%s", e.msg);
        cr_assert_eq(got, bytes);
        cr_assert_eq(memcmp(a, b, bytes), 0);
        cr_assert_eq(kvdisk_get(d, KVKEY_WINDOW, &k, b, bytes, &got, &e), DI_ENOENT,
                     "same key, other class");
        cr_assert_eq(kvdisk_get(d, KVKEY_BLOCK, &k, b, bytes - 1, &got, &e), DI_ERANGE);
        kvdisk_close(d);
        /* Reopen (a clean close flushes memtables, so even "none" persists here). */
        cr_assert_eq(kvdisk_open(&c, &d, &e), DI_OK, "%s", e.msg);
        scan_acc acc = {0};
        uint64_t bad = 9;
        cr_assert_eq(kvdisk_scan(d, collect, &acc, &bad, &e), DI_OK, "%s", e.msg);
        cr_assert_eq(acc.n, 1);
        cr_assert_eq(bad, 0);
        cr_assert_eq(acc.items[0].bytes, bytes);
        cr_assert_eq(acc.items[0].last_access_ms, (uint64_t)(1234 + durability));
        cr_assert_eq(memcmp(&acc.items[0].key, &k, sizeof(k)), 0);
        kvdisk_close(d);
    }
    th_rmtree(dir);
    free(a);
    free(b);
}

Test(disk, a_directory_refuses_another_geometry)
{
    char dir[256];
    th_tmpdir(dir);
    kvdisk_config c = config(dir, KVDISK_WAL);
    kvdisk *d = NULL;
    di_error e;
    cr_assert_eq(kvdisk_open(&c, &d, &e), DI_OK, "%s", e.msg);
    kvdisk_close(d);
    c.stamp.block_bytes = 4224;
    d = NULL;
    cr_assert_eq(kvdisk_open(&c, &d, &e), DI_EINVAL);
    cr_assert_null(d);
    cr_assert(strstr(e.msg, "block=114048") && strstr(e.msg, "block=4224"), "%s", e.msg);
    cr_assert(strstr(e.msg, "--dir"), "%s", e.msg);
    th_rmtree(dir);
}

Test(disk, touch_delete_and_corrupt_meta)
{
    char dir[256];
    th_tmpdir(dir);
    kvdisk_config c = config(dir, KVDISK_WAL);
    kvdisk *d = NULL;
    di_error e;
    cr_assert_eq(kvdisk_open(&c, &d, &e), DI_OK, "%s", e.msg);
    uint8_t data[300];
    memset(data, 7, sizeof(data));
    kvdisk_item it[3];
    for (int i = 0; i < 3; i++)
        it[i] = (kvdisk_item){.cls = i, .key = th_key(10 + i), .data = data, .bytes = 300,
                              .last_access_ms = 5};
    cr_assert_eq(kvdisk_put(d, it, 3, &e), DI_OK, "%s", e.msg);
    it[1].last_access_ms = 99;
    cr_assert_eq(kvdisk_touch(d, &it[1], 1, &e), DI_OK, "%s", e.msg);
    cr_assert_eq(kvdisk_delete(d, &it[2], 1, &e), DI_OK, "%s", e.msg);
    scan_acc acc = {0};
    cr_assert_eq(kvdisk_scan(d, collect, &acc, NULL, &e), DI_OK);
    cr_assert_eq(acc.n, 2);
    cr_assert_eq(acc.items[1].cls, KVKEY_WINDOW);
    cr_assert_eq(acc.items[1].last_access_ms, 99);
    uint64_t got;
    cr_assert_eq(kvdisk_get(d, KVKEY_HANDOFF, &it[2].key, data, 300, &got, &e), DI_ENOENT);
    cr_assert_eq(kvdisk_put(d, it, 0, &e), DI_OK, "empty batch");
    it[0].cls = 5;
    cr_assert_eq(kvdisk_put(d, it, 1, &e), DI_EINVAL);
    kvdisk_close(d);
    th_rmtree(dir);
}

Test(disk, injected_write_faults_fail_cleanly)
{
    char dir[256];
    th_tmpdir(dir);
    kvdisk_config c = config(dir, KVDISK_FSYNC);
    kvdisk *d = NULL;
    di_error e;
    cr_assert_eq(kvdisk_open(&c, &d, &e), DI_OK, "%s", e.msg);
    uint8_t data[64] = {1};
    kvdisk_item it = {.cls = KVKEY_BLOCK, .key = th_key(1), .data = data, .bytes = 64};
    kvdisk_fail_write_after(d, 2);
    cr_assert_eq(kvdisk_put(d, &it, 1, &e), DI_OK, "first write passes");
    it.key = th_key(2);
    cr_assert_eq(kvdisk_put(d, &it, 1, &e), DI_EIO);
    cr_assert(strstr(e.msg, "injected"), "%s", e.msg);
    uint64_t got;
    cr_assert_eq(kvdisk_get(d, KVKEY_BLOCK, &it.key, data, 64, &got, &e), DI_ENOENT,
                 "the failed batch wrote nothing");
    cr_assert_eq(kvdisk_put(d, &it, 1, &e), DI_OK, "the hook fires once");
    kvdisk_close(d);
    th_rmtree(dir);
}

Test(disk, a_full_disk_fails_writes_and_keeps_reads, .timeout = 60)
{
    char dir[256];
    th_tmpdir(dir);
    cr_assert_eq(th_mount_tmpfs(dir, 8 << 20), 0, "mounting a tmpfs needs root");
    kvdisk_config c = config(dir, KVDISK_WAL);
    c.write_buffer_bytes = 1 << 20;
    kvdisk *d = NULL;
    di_error e;
    cr_assert_eq(kvdisk_open(&c, &d, &e), DI_OK, "%s", e.msg);
    /* A filler file takes 2 MiB, to be freed later. */
    char filler[300];
    snprintf(filler, sizeof(filler), "%s/filler", dir);
    FILE *ff = fopen(filler, "w");
    static char zeros[1 << 20];
    fwrite(zeros, 1, sizeof(zeros), ff);
    fwrite(zeros, 1, sizeof(zeros), ff);
    fclose(ff);
    size_t bytes = 114048;
    uint8_t *buf = malloc(bytes);
    memset(buf, 0x3c, bytes);
    kvdisk_item first = {.cls = KVKEY_BLOCK, .key = th_key(0), .data = buf, .bytes = bytes};
    cr_assert_eq(kvdisk_put(d, &first, 1, &e), DI_OK, "%s", e.msg);
    di_status st = DI_OK;
    int i;
    for (i = 1; i < 400 && st == DI_OK; i++) {
        kvdisk_item it = {.cls = KVKEY_BLOCK, .key = th_key((uint64_t)i), .data = buf,
                          .bytes = bytes};
        st = kvdisk_put(d, &it, 1, &e);
    }
    cr_assert_eq(st, DI_ENOSPC, "after %d puts: %s (%s)", i, di_status_name(st), e.msg);
    cr_assert(strstr(e.msg, "disk full"), "%s", e.msg);
    uint64_t got = 0;
    memset(buf, 0, bytes);
    cr_assert_eq(kvdisk_get(d, KVKEY_BLOCK, &first.key, buf, bytes, &got, &e), DI_OK, "%s",
                 e.msg);
    cr_assert_eq(buf[1000], 0x3c, "reads still served");
    /* RocksDB now refuses writes until reopened; with no room a reopen is not even tried. */
    cr_assert(kvdisk_failed(d));
    kvdisk_item again = {.cls = KVKEY_BLOCK, .key = th_key(999), .data = buf, .bytes = bytes};
    cr_assert_neq(kvdisk_put(d, &again, 1, &e), DI_OK);
    cr_assert_eq(kvdisk_recover(d, &e), DI_ENOSPC, "%s", e.msg);
    cr_assert(strstr(e.msg, "waiting for"), "%s", e.msg);
    cr_assert_eq(remove(filler), 0);
    cr_assert_eq(kvdisk_recover(d, &e), DI_OK, "%s", e.msg);
    cr_assert_not(kvdisk_failed(d));
    cr_assert_eq(kvdisk_put(d, &again, 1, &e), DI_OK, "writes resume: %s", e.msg);
    cr_assert_eq(kvdisk_get(d, KVKEY_BLOCK, &first.key, buf, bytes, &got, &e), DI_OK, "%s",
                 e.msg);
    kvdisk_close(d);
    free(buf);
    th_rmtree(dir);
}
