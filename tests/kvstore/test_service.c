/* Integration tests: a real di-kvstore on loopback (RocksDB in a temp dir), bytes moved with UCX
 * by the client library. Each test starts its own store; the harness kills stores with their
 * test process, so none outlives a failing test. */
#include <criterion/criterion.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "common/model/config.h"
#include "common/net/kvstore.pb-c.h"
#include "common/net/rpc.h"
#include "common/util/clock.h"
#include "kvstore/disk.h"
#include "tests/kvstore/harness.h"
#include "tests/kvstore/helpers.h"

#define BLOCK 4224
#define WINDOW 8320
#define HANDOFF 16512

static const char *const small_args[] = {
    "--block-bytes", "4224", "--window-bytes", "8320", "--handoff-max-bytes", "16512",
    "--dram-bytes", "8MiB", "--memtable-bytes", "2MiB", NULL};

static kv_geometry v41(void)
{
    kv_geometry g;
    kv_geometry_v41_flash(5, &g);
    return g;
}

static uint8_t *object(int cls, const kvkey *k, size_t bytes, uint64_t salt)
{
    uint8_t *p = malloc(bytes);
    kv_geometry g = v41();
    th_fill_object(p, bytes, cls == KVKEY_WINDOW ? KV_WINDOW_MAGIC : KV_BLOCK_MAGIC, &g, k, salt);
    return p;
}

static void put_one(kvc_client *c, int cls, const kvkey *k, size_t bytes, uint64_t salt)
{
    uint8_t *p = object(cls, k, bytes, salt);
    di_error e;
    di_status st = kvc_put1(c, cls, k, p, bytes, &e);
    cr_assert(st == DI_OK || st == DI_EEXIST, "put: %s", e.msg);
    free(p);
}

/* Gets and compares with the expected bytes. */
static di_status get_check(kvc_client *c, int cls, const kvkey *k, size_t bytes, uint64_t salt,
                           di_error *e)
{
    uint8_t *got = malloc(bytes), *want = object(cls, k, bytes, salt);
    uint64_t n = 0;
    di_status st = kvc_get1(c, cls, k, got, bytes, &n, e);
    if (st == DI_OK) {
        cr_assert_eq(n, bytes);
        cr_assert_eq(memcmp(got, want, bytes), 0, "bytes differ");
    }
    free(got);
    free(want);
    return st;
}

static void stats(kvc_client *c, Di__Kvstore__StatsReply **out)
{
    Di__Kvstore__StatsRequest req = DI__KVSTORE__STATS_REQUEST__INIT;
    uint8_t buf[16];
    size_t n = di__kvstore__stats_request__pack(&req, buf);
    uint8_t *rep;
    size_t len;
    di_error e;
    cr_assert_eq(kvc_call(c, "Stats", buf, n, &rep, &len, &e), DI_OK, "%s", e.msg);
    *out = di__kvstore__stats_reply__unpack(NULL, len, rep);
    free(rep);
    cr_assert_not_null(*out);
}

/* V4.1-Flash blocks and a window state through the client, either through the store's memory
 * mapped here (same host) or with ucp_get/ucp_put (the path to stores on other hosts). */
static void v41_round_trip(int ucx_rma) /* 0 mapped, 1 ucp_get/put, 2 (TCP): not mapped */
{
    char dir[256];
    th_tmpdir(dir);
    th_store s;
    const char *args[] = {"--dram-bytes", "96MiB", NULL};
    th_store_start(&s, dir, args);
    kvc_options o;
    kvc_options_default(&o);
    o.target = s.target;
    o.ucx_rma = ucx_rma == 1;
    kvc_client *c;
    di_error e0;
    cr_assert_eq(kvc_open(&o, &c, &e0), DI_OK, "%s", e0.msg);
    kvc_store_info info;
    di_error e;
    cr_assert_eq(kvc_info(c, &info, &e), DI_OK, "%s", e.msg);
    cr_assert_eq(info.object_bytes[KVKEY_BLOCK], 114048);
    cr_assert_eq(info.object_bytes[KVKEY_WINDOW], 1501184);
    cr_assert_eq(info.geometry.model_id, v41().model_id);
    cr_assert_str_eq(info.durability, "wal");
    cr_assert_eq(info.mapped, ucx_rma == 0, "same host: mapped unless RMA is forced or TCP");

    enum { N = 48 };
    int32_t *tokens = malloc(N * 128 * sizeof(int32_t));
    for (int i = 0; i < N * 128; i++)
        tokens[i] = (i * 7919) % 128000;
    kvkey keys[N];
    size_t nk;
    cr_assert_eq(kvkey_chain(info.geometry.model_id, 128, tokens, N * 128, keys, N, &nk, &e),
                 DI_OK);
    kvc_item items[N];
    for (int i = 0; i < N; i++)
        items[i] = (kvc_item){.cls = KVKEY_BLOCK, .key = keys[i],
                              .buf = object(KVKEY_BLOCK, &keys[i], 114048, 0), .cap = 114048};
    cr_assert_eq(kvc_put(c, items, N, &e), DI_OK, "%s", e.msg);
    for (int i = 0; i < N; i++)
        cr_assert_eq(items[i].status, DI_OK, "item %d: %s", i, items[i].error.msg);
    put_one(c, KVKEY_WINDOW, &keys[15], 1501184, 0); /* window at 16 * 128 */
    uint32_t hit, win[8];
    size_t nw;
    cr_assert_eq(kvc_lookup(c, keys, N, &hit, win, 8, &nw, &e), DI_OK, "%s", e.msg);
    cr_assert_eq(hit, N);
    cr_assert_eq(nw, 1);
    cr_assert_eq(win[0], 16);

    /* Read everything back into fresh buffers, in one batch. */
    kvc_item got[N];
    for (int i = 0; i < N; i++)
        got[i] = (kvc_item){.cls = KVKEY_BLOCK, .key = keys[i], .buf = calloc(1, 114048),
                            .cap = 114048};
    cr_assert_eq(kvc_get(c, got, N, &e), DI_OK, "%s", e.msg);
    for (int i = 0; i < N; i++) {
        cr_assert_eq(got[i].status, DI_OK, "item %d: %s", i, got[i].error.msg);
        cr_assert_eq(memcmp(got[i].buf, items[i].buf, 114048), 0, "block %d differs", i);
    }
    cr_assert_eq(get_check(c, KVKEY_WINDOW, &keys[15], 1501184, 0, &e), DI_OK, "%s", e.msg);
    cr_assert_eq(kvc_delete1(c, KVKEY_BLOCK, &keys[3], &e), DI_OK, "%s", e.msg);
    cr_assert_eq(kvc_lookup(c, keys, N, &hit, win, 8, &nw, &e), DI_OK);
    cr_assert_eq(hit, 3, "the chain breaks at the deleted block");
    Di__Kvstore__StatsReply *st;
    stats(c, &st);
    cr_assert_eq(st->classes[KVKEY_BLOCK]->objects, N - 1);
    cr_assert_eq(st->classes[KVKEY_WINDOW]->objects, 1);
    cr_assert_eq(st->commits, N + 1);
    cr_assert_geq(st->get_bytes, (uint64_t)N * 114048);
    di__kvstore__stats_reply__free_unpacked(st, NULL);
    for (int i = 0; i < N; i++) {
        free(items[i].buf);
        free(got[i].buf);
    }
    free(tokens);
    kvc_close(c);
    th_store_stop(&s);
    th_rmtree(dir);
}

Test(service, v41_blocks_and_windows_round_trip_through_mapped_memory, .timeout = 120)
{
    v41_round_trip(0);
}

Test(service, v41_blocks_and_windows_round_trip_with_ucp_get_and_put, .timeout = 120)
{
    v41_round_trip(1);
}

/* UCX restricted to TCP (store and client inherit UCX_TLS): nothing is mapped, the client
 * reconnects with peer-failure handling, and gets and puts are emulated over TCP with the
 * store's progress thread serving them: the path to a store on another host. */
Test(service, v41_blocks_and_windows_round_trip_over_ucx_tcp, .timeout = 180)
{
    setenv("UCX_TLS", "tcp,self", 1);
    v41_round_trip(2);
}

Test(service, a_lease_outlives_expiry_and_pressure_then_the_object_goes, .timeout = 60)
{
    char dir[256];
    th_tmpdir(dir);
    th_store s;
    /* 1 MiB of DRAM: 0.7 MiB of 4288-byte block slots (171); disk bound 200 blocks. */
    const char *args[] = {"--block-bytes", "4224", "--window-bytes", "8320",
                          "--handoff-max-bytes", "16512", "--dram-bytes", "1MiB",
                          "--disk-bytes", "844800", "--ttl-handoff", "300ms", NULL};
    th_store_start(&s, dir, args);
    kvc_client *c = th_client(&s, NULL), *other = th_client(&s, NULL);
    di_error e;
    kvkey h = th_key(1);
    put_one(c, KVKEY_HANDOFF, &h, 9000, 5);
    kvc_lease l;
    cr_assert_eq(kvc_acquire(c, KVKEY_HANDOFF, &h, 30000, &l, &e), DI_OK, "%s", e.msg);
    usleep(700 * 1000); /* the handoff TTL (300 ms) passes while leased */
    uint8_t *buf = malloc(HANDOFF), *want = object(KVKEY_HANDOFF, &h, 9000, 5);
    cr_assert_eq(kvc_read(c, KVKEY_HANDOFF, &h, &l, buf, HANDOFF, &e), DI_OK, "%s", e.msg);
    cr_assert_eq(memcmp(buf, want, 9000), 0, "readable under the lease");
    cr_assert_eq(get_check(other, KVKEY_HANDOFF, &h, 9000, 5, &e), DI_ENOENT,
                 "expired for new readers");
    cr_assert_eq(kvc_release(c, &l, &e), DI_OK, "%s", e.msg);
    cr_assert_eq(get_check(c, KVKEY_HANDOFF, &h, 9000, 5, &e), DI_ENOENT, "gone once released");

    /* Capacity pressure: lease block 0, then write 400 blocks through 171 slots and a
     * 200-block disk bound. */
    kvkey b0 = th_key(1000);
    put_one(c, KVKEY_BLOCK, &b0, BLOCK, 0);
    cr_assert_eq(kvc_acquire(c, KVKEY_BLOCK, &b0, 30000, &l, &e), DI_OK, "%s", e.msg);
    for (uint64_t i = 1; i <= 400; i++) {
        kvkey k = th_key(1000 + i);
        put_one(c, KVKEY_BLOCK, &k, BLOCK, 0);
    }
    Di__Kvstore__StatsReply *st;
    stats(c, &st);
    cr_assert_gt(st->disk_evictions, 150);
    cr_assert_gt(st->dram_evictions + st->disk_evictions, 200);
    di__kvstore__stats_reply__free_unpacked(st, NULL);
    free(want);
    want = object(KVKEY_BLOCK, &b0, BLOCK, 0);
    memset(buf, 0, BLOCK);
    cr_assert_eq(kvc_read(c, KVKEY_BLOCK, &b0, &l, buf, BLOCK, &e), DI_OK, "%s", e.msg);
    cr_assert_eq(memcmp(buf, want, BLOCK), 0, "leased block intact under pressure");
    cr_assert_eq(kvc_release(c, &l, &e), DI_OK, "%s", e.msg);
    kvkey more = th_key(5000);
    put_one(c, KVKEY_BLOCK, &more, BLOCK, 0); /* the next pressure takes the released LRU */
    cr_assert_eq(get_check(c, KVKEY_BLOCK, &b0, BLOCK, 0, &e), DI_ENOENT, "%s", e.msg);
    free(buf);
    free(want);
    kvc_close(c);
    kvc_close(other);
    th_store_stop(&s);
    th_rmtree(dir);
}

/* Raw call with bytes that are not a protobuf message. */
static di_status raw(kvc_client *c, const char *method, const void *bytes, size_t n,
                     di_error *e)
{
    uint8_t *rep = NULL;
    size_t len = 0;
    di_status st = kvc_call(c, method, bytes, n, &rep, &len, e);
    free(rep);
    return st;
}

Test(service, bad_input_gets_clear_errors_and_the_store_keeps_serving, .timeout = 60)
{
    char dir[256];
    th_tmpdir(dir);
    th_store s;
    th_store_start(&s, dir, small_args);
    kvc_client *c = th_client(&s, NULL);
    di_error e;
    kvkey k = th_key(7);
    /* Wrong object size. */
    uint8_t *small = object(KVKEY_BLOCK, &k, 4000, 0);
    cr_assert_eq(kvc_put1(c, KVKEY_BLOCK, &k, small, 4000, &e), DI_EINVAL);
    cr_assert(strstr(e.msg, "block objects are 4224 bytes, got 4000"), "%s", e.msg);
    free(small);
    /* A buffer too small for the object. */
    put_one(c, KVKEY_BLOCK, &k, BLOCK, 0);
    uint8_t buf[100];
    cr_assert_eq(kvc_get1(c, KVKEY_BLOCK, &k, buf, sizeof(buf), NULL, &e), DI_ERANGE);
    cr_assert(strstr(e.msg, "100-byte buffer"), "%s", e.msg);
    /* Unknown key. */
    kvkey unknown = th_key(99);
    cr_assert_eq(get_check(c, KVKEY_BLOCK, &unknown, BLOCK, 0, &e), DI_ENOENT);
    cr_assert(strstr(e.msg, "not stored"), "%s", e.msg);
    /* Malformed protobuf, a short key, an unknown class, too many items. */
    const uint8_t junk[] = {0xff, 0xff, 0xff, 0xff, 0x0f, 0x12};
    cr_assert_eq(raw(c, "Lease", junk, sizeof(junk), &e), DI_EPROTO);
    cr_assert(strstr(e.msg, "malformed Di__Kvstore__LeaseRequest"), "%s", e.msg);
    cr_assert_eq(raw(c, "Alloc", junk, sizeof(junk), &e), DI_EPROTO);
    Di__Kvstore__ObjRef ref = DI__KVSTORE__OBJ_REF__INIT, *pref = &ref;
    uint8_t five[5] = {1, 2, 3, 4, 5};
    ref.key = (ProtobufCBinaryData){5, five};
    Di__Kvstore__DeleteRequest del = DI__KVSTORE__DELETE_REQUEST__INIT;
    del.n_items = 1;
    del.items = &pref;
    uint8_t pb[256];
    size_t n = di__kvstore__delete_request__pack(&del, pb);
    uint8_t *rep;
    size_t len;
    cr_assert_eq(kvc_call(c, "Delete", pb, n, &rep, &len, &e), DI_OK, "%s", e.msg);
    Di__Kvstore__DeleteReply *dr = di__kvstore__delete_reply__unpack(NULL, len, rep);
    free(rep);
    cr_assert_eq(dr->results[0]->status, DI_EINVAL);
    cr_assert(strstr(dr->results[0]->error, "key of 5 bytes"), "%s", dr->results[0]->error);
    di__kvstore__delete_reply__free_unpacked(dr, NULL);
    cr_assert_eq(raw(c, "NoSuchMethod", NULL, 0, &e), DI_EUNSUPPORTED, "%s", e.msg);
    /* An expired lease. */
    kvc_lease l;
    cr_assert_eq(kvc_acquire(c, KVKEY_BLOCK, &k, 50, &l, &e), DI_OK, "%s", e.msg);
    usleep(400 * 1000);
    cr_assert_eq(kvc_release(c, &l, &e), DI_ETIMEDOUT);
    cr_assert(strstr(e.msg, "timed out before its release"), "%s", e.msg);
    cr_assert_eq(kvc_release(c, &l, &e), DI_ENOENT, "a second release: unknown");
    /* Everything else still works. */
    cr_assert_eq(get_check(c, KVKEY_BLOCK, &k, BLOCK, 0, &e), DI_OK, "%s", e.msg);
    kvkey k2 = th_key(8);
    put_one(c, KVKEY_BLOCK, &k2, BLOCK, 1);
    cr_assert_eq(get_check(c, KVKEY_BLOCK, &k2, BLOCK, 1, &e), DI_OK, "%s", e.msg);
    kvc_close(c);
    th_store_stop(&s);
    cr_assert(th_store_log_has(&s, "malformed"), "malformed requests are logged");
    th_rmtree(dir);
}

Test(service, a_full_disk_fails_puts_clearly_reads_go_on_and_writes_resume, .timeout = 120)
{
    char dir[256];
    th_tmpdir(dir);
    cr_assert_eq(th_mount_tmpfs(dir, 16 << 20), 0, "mounting a tmpfs needs root");
    char filler[300];
    snprintf(filler, sizeof(filler), "%s/filler", dir); /* 6 MiB to free later */
    FILE *ff = fopen(filler, "w");
    static char zeros[1 << 20];
    for (int k = 0; k < 6; k++)
        fwrite(zeros, 1, sizeof(zeros), ff);
    fclose(ff);
    th_store s;
    const char *args[] = {"--block-bytes", "114048", "--dram-bytes", "64MiB",
                          "--memtable-bytes", "1MiB", NULL};
    th_store_start(&s, dir, args);
    kvc_client *c = th_client(&s, NULL);
    di_error e;
    di_status st = DI_OK;
    uint64_t i;
    for (i = 0; i < 300 && st == DI_OK; i++) {
        kvkey k = th_key(i);
        uint8_t *p = object(KVKEY_BLOCK, &k, 114048, 0);
        st = kvc_put1(c, KVKEY_BLOCK, &k, p, 114048, &e);
        free(p);
    }
    cr_assert_eq(st, DI_ENOSPC, "after %llu puts: %s (%s)", (unsigned long long)i,
                 di_status_name(st), e.msg);
    cr_assert(strstr(e.msg, "disk full"), "%s", e.msg);
    cr_assert_gt(i, 5);
    /* Every further put fails the same way; the log keeps to a few lines and a count. */
    for (uint64_t j = 0; j < 40; j++) {
        kvkey k = th_key(50000 + j);
        uint8_t *p = object(KVKEY_BLOCK, &k, 114048, 0);
        cr_assert_eq(kvc_put1(c, KVKEY_BLOCK, &k, p, 114048, &e), DI_ENOSPC, "%s", e.msg);
        free(p);
    }
    /* Acknowledged blocks are still served, and so are lookups and stats. */
    for (uint64_t j = 0; j + 1 < i; j += 7) {
        kvkey k = th_key(j);
        cr_assert_eq(get_check(c, KVKEY_BLOCK, &k, 114048, 0, &e), DI_OK, "block %llu: %s",
                     (unsigned long long)j, e.msg);
    }
    kvkey k0 = th_key(0);
    uint32_t hit, w[1];
    size_t nw;
    cr_assert_eq(kvc_lookup(c, &k0, 1, &hit, w, 1, &nw, &e), DI_OK, "%s", e.msg);
    cr_assert_eq(hit, 1);
    Di__Kvstore__StatsReply *sr;
    stats(c, &sr);
    cr_assert_geq(sr->commit_failures, 1);
    di__kvstore__stats_reply__free_unpacked(sr, NULL);
    /* Room comes back: the store reopens RocksDB by itself and puts work again. */
    cr_assert_eq(remove(filler), 0);
    kvkey k2 = th_key(10000);
    uint8_t *p2 = object(KVKEY_BLOCK, &k2, 114048, 0);
    kvc_client *quick = th_client_deadline(&s, NULL, 2000);
    uint64_t until = di_mono_ns() + 30000000000ull; /* the store retries its reopen each second */
    do {
        st = kvc_put1(quick, KVKEY_BLOCK, &k2, p2, 114048, &e);
        if (st != DI_OK)
            usleep(100 * 1000);
    } while (st != DI_OK && di_mono_ns() < until);
    kvc_close(quick);
    free(p2);
    if (st != DI_OK)
        th_store_dump_log(&s);
    cr_assert_eq(st, DI_OK, "writes did not resume: %s", e.msg);
    cr_assert_eq(get_check(c, KVKEY_BLOCK, &k2, 114048, 0, &e), DI_OK, "%s", e.msg);
    kvkey k0b = th_key(0);
    cr_assert_eq(get_check(c, KVKEY_BLOCK, &k0b, 114048, 0, &e), DI_OK, "%s", e.msg);
    kvc_close(c);
    th_store_stop(&s);
    /* 40+ failed commits: at most 5 lines per 10 s, then the count of the rest. */
    int lines = th_store_log_count(&s, "Commit item");
    cr_assert(lines >= 1 && lines <= 15, "%d commit-failure lines", lines);
    cr_assert(th_store_log_has(&s, "more item failures in the last"), "no count line");
    th_rmtree(dir);
}

Test(service, a_corrupt_rocksdb_value_is_dropped_and_the_rest_served, .timeout = 60)
{
    char dir[256];
    th_tmpdir(dir);
    th_store s;
    th_store_start(&s, dir, small_args);
    kvc_client *c = th_client(&s, NULL);
    for (uint64_t i = 0; i < 10; i++) {
        kvkey k = th_key(i);
        put_one(c, KVKEY_BLOCK, &k, BLOCK, 0);
    }
    th_store_stop(&s);
    kv_geometry g = v41();
    kvdisk_config dc = {.dir = dir, .durability = KVDISK_WAL,
                        .stamp = {.model_id = g.model_id, .block_bytes = BLOCK,
                                  .window_bytes = WINDOW, .ring_positions = g.ring_positions}};
    kvdisk *d;
    di_error e;
    cr_assert_eq(kvdisk_open(&dc, &d, &e), DI_OK, "%s", e.msg);
    kvkey bad = th_key(4);
    uint8_t *p = object(KVKEY_BLOCK, &bad, BLOCK, 0);
    p[BLOCK - 1] ^= 0x80;
    kvdisk_item it = {.cls = KVKEY_BLOCK, .key = bad, .data = p, .bytes = BLOCK,
                      .last_access_ms = di_wall_ms()};
    cr_assert_eq(kvdisk_put(d, &it, 1, &e), DI_OK, "%s", e.msg);
    kvdisk_close(d);
    free(p);
    th_store_restart(&s);
    cr_assert_eq(get_check(c, KVKEY_BLOCK, &bad, BLOCK, 0, &e), DI_ENOENT);
    cr_assert(strstr(e.msg, "corrupt"), "%s", e.msg);
    for (uint64_t i = 0; i < 10; i++) {
        if (i == 4)
            continue;
        kvkey k = th_key(i);
        cr_assert_eq(get_check(c, KVKEY_BLOCK, &k, BLOCK, 0, &e), DI_OK, "block %llu: %s",
                     (unsigned long long)i, e.msg);
    }
    kvc_close(c);
    th_store_stop(&s);
    cr_assert(th_store_log_has(&s, "dropped block"), "the drop is logged");
    th_rmtree(dir);
}

static void write_file(const char *path, const char *text)
{
    FILE *f = fopen(path, "w");
    cr_assert_not_null(f);
    fputs(text, f);
    fclose(f);
}

/* Flips one byte of an object's DRAM copy inside the running store (through /proc/PID/mem, as
 * a memory fault would), at the address its lease names. */
static void rot_dram_copy(const th_store *s, kvc_client *c, const kvkey *k)
{
    kvc_lease l;
    di_error e;
    cr_assert_eq(kvc_acquire(c, KVKEY_BLOCK, k, 1000, &l, &e), DI_OK, "%s", e.msg);
    cr_assert_eq(kvc_release(c, &l, &e), DI_OK, "%s", e.msg);
    char path[64];
    snprintf(path, sizeof(path), "/proc/%d/mem", (int)s->pid);
    FILE *f = fopen(path, "r+b");
    cr_assert(f, "cannot open %s", path);
    uint8_t b;
    off_t at = (off_t)(l.remote_addr + KV_HEADER_BYTES + 321);
    cr_assert_eq(pread(fileno(f), &b, 1, at), 1);
    b ^= 0x21;
    cr_assert_eq(pwrite(fileno(f), &b, 1, at), 1);
    fclose(f);
}

Test(service, a_corrupt_dram_copy_is_reported_dropped_and_served_from_disk, .timeout = 60)
{
    char dir[256];
    th_tmpdir(dir);
    th_store s;
    th_store_start(&s, dir, small_args);
    kvc_client *c = th_client(&s, NULL);
    kvkey a = th_key(1), b = th_key(2);
    put_one(c, KVKEY_BLOCK, &a, BLOCK, 0);
    put_one(c, KVKEY_BLOCK, &b, BLOCK, 0);
    rot_dram_copy(&s, c, &a);
    /* The low-level read sees the bad copy and says so; the store drops it afterwards. */
    kvc_lease l;
    di_error e;
    uint8_t *buf = malloc(BLOCK);
    cr_assert_eq(kvc_acquire(c, KVKEY_BLOCK, &a, 1000, &l, &e), DI_OK, "%s", e.msg);
    cr_assert_eq(kvc_read(c, KVKEY_BLOCK, &a, &l, buf, BLOCK, &e), DI_ECORRUPT);
    cr_assert_eq(kvc_release(c, &l, &e), DI_OK, "%s", e.msg);
    free(buf);
    /* A get now returns the verified disk copy; so do later ones. */
    for (int r = 0; r < 3; r++)
        cr_assert_eq(get_check(c, KVKEY_BLOCK, &a, BLOCK, 0, &e), DI_OK, "read %d: %s", r, e.msg);
    cr_assert_eq(get_check(c, KVKEY_BLOCK, &b, BLOCK, 0, &e), DI_OK, "%s", e.msg);
    Di__Kvstore__StatsReply *sr;
    stats(c, &sr);
    cr_assert_eq(sr->corrupt_dropped, 1);
    cr_assert_eq(sr->promotions, 1, "one load from disk");
    di__kvstore__stats_reply__free_unpacked(sr, NULL);
    /* The same through a plain get: the client reports, the store drops, the retry reads
     * the disk copy; the caller never sees the bad bytes. */
    rot_dram_copy(&s, c, &b);
    cr_assert_eq(get_check(c, KVKEY_BLOCK, &b, BLOCK, 0, &e), DI_OK, "%s", e.msg);
    stats(c, &sr);
    cr_assert_eq(sr->corrupt_dropped, 2);
    di__kvstore__stats_reply__free_unpacked(sr, NULL);
    /* A report about a sound copy changes nothing. */
    Di__Kvstore__ObjRef ref = DI__KVSTORE__OBJ_REF__INIT, *refs[1] = {&ref};
    ref.cls = DI__KVSTORE__OBJ_CLASS__BLOCK;
    ref.key = (ProtobufCBinaryData){32, b.b};
    Di__Kvstore__ReportCorruptRequest req = DI__KVSTORE__REPORT_CORRUPT_REQUEST__INIT;
    req.n_items = 1;
    req.items = refs;
    uint8_t packed[128], *rep;
    size_t len, n = di__kvstore__report_corrupt_request__pack(&req, packed);
    cr_assert_eq(kvc_call(c, "ReportCorrupt", packed, n, &rep, &len, &e), DI_OK, "%s", e.msg);
    Di__Kvstore__ReportCorruptReply *rr = di__kvstore__report_corrupt_reply__unpack(NULL, len, rep);
    cr_assert(rr && rr->n_results == 1 && rr->results[0]->status == DI_EEXIST);
    di__kvstore__report_corrupt_reply__free_unpacked(rr, NULL);
    free(rep);
    stats(c, &sr);
    cr_assert_eq(sr->corrupt_dropped, 2);
    di__kvstore__stats_reply__free_unpacked(sr, NULL);
    kvc_close(c);
    th_store_stop(&s);
    cr_assert(th_store_log_has(&s, "corrupt copy reported"), "the drop is logged");
    th_rmtree(dir);
}

Test(service, tokens_roles_and_tls, .timeout = 60)
{
    char dir[256], tok[300], adm[300], cert[300], key[300], cmd[1024];
    th_tmpdir(dir);
    snprintf(tok, sizeof(tok), "%s/engine.token", dir);
    snprintf(adm, sizeof(adm), "%s/admin.token", dir);
    snprintf(cert, sizeof(cert), "%s/cert.pem", dir);
    snprintf(key, sizeof(key), "%s/key.pem", dir);
    write_file(tok, "engine-secret\n");
    write_file(adm, "admin-secret\n");
    snprintf(cmd, sizeof(cmd),
             "openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes "
             "-keyout %s -out %s -days 1 -subj /CN=localhost "
             "-addext subjectAltName=DNS:localhost,IP:127.0.0.1 2>/dev/null",
             key, cert);
    cr_assert_eq(system(cmd), 0, "openssl could not make a certificate");
    char data[300];
    snprintf(data, sizeof(data), "%s/data", dir);
    th_store s;
    const char *args[] = {"--block-bytes", "4224", "--window-bytes", "8320", "--dram-bytes",
                          "8MiB", "--token-file", tok, "--admin-token-file", adm,
                          "--tls-cert", cert, "--tls-key", key, NULL};
    th_store_start(&s, data, args);
    char *ca;
    cr_assert_eq(rpc_load_file(cert, &ca, NULL), DI_OK);
    kvc_options o;
    kvc_options_default(&o);
    o.target = s.target;
    o.tls_ca_pem = ca;
    kvc_client *anon, *eng, *admin, *plain;
    di_error e;
    cr_assert_eq(kvc_open(&o, &anon, &e), DI_OK);
    o.token = "engine-secret";
    cr_assert_eq(kvc_open(&o, &eng, &e), DI_OK);
    o.token = "admin-secret";
    cr_assert_eq(kvc_open(&o, &admin, &e), DI_OK);
    o.tls_ca_pem = NULL;
    o.deadline_ms = 500; /* it can only fail: do not wait for the default deadline */
    cr_assert_eq(kvc_open(&o, &plain, &e), DI_OK);
    kvkey k = th_key(1);
    uint8_t *p = object(KVKEY_BLOCK, &k, BLOCK, 0);
    cr_assert_eq(kvc_put1(anon, KVKEY_BLOCK, &k, p, BLOCK, &e), DI_EAUTH, "%s", e.msg);
    cr_assert_eq(kvc_put1(plain, KVKEY_BLOCK, &k, p, BLOCK, &e), DI_EUNAVAIL,
                 "plaintext to a TLS port: %s", e.msg);
    cr_assert_eq(kvc_put1(eng, KVKEY_BLOCK, &k, p, BLOCK, &e), DI_OK, "%s", e.msg);
    cr_assert_eq(get_check(eng, KVKEY_BLOCK, &k, BLOCK, 0, &e), DI_OK, "%s", e.msg);
    uint8_t *rep;
    size_t len;
    cr_assert_eq(kvc_call(eng, "Stats", NULL, 0, &rep, &len, &e), DI_EPERM);
    cr_assert(strstr(e.msg, "admin token"), "%s", e.msg);
    cr_assert_eq(kvc_call(admin, "Stats", NULL, 0, &rep, &len, &e), DI_OK, "%s", e.msg);
    free(rep);
    free(p);
    free(ca);
    kvc_close(anon);
    kvc_close(eng);
    kvc_close(admin);
    kvc_close(plain);
    th_store_stop(&s);
    th_rmtree(dir);
}

Test(service, clients_follow_a_restart_and_acknowledged_objects_survive, .timeout = 60)
{
    char dir[256];
    th_tmpdir(dir);
    th_store s;
    th_store_start(&s, dir, small_args);
    kvc_client *c = th_client(&s, NULL);
    di_error e;
    for (uint64_t i = 0; i < 30; i++) {
        kvkey k = th_key(i);
        put_one(c, KVKEY_BLOCK, &k, BLOCK, 3);
    }
    kvc_store_info before, after;
    cr_assert_eq(kvc_info(c, &before, &e), DI_OK);
    th_store_kill(&s);
    kvkey k0 = th_key(0);
    kvc_client *quick = th_client_deadline(&s, NULL, 500);
    cr_assert_eq(get_check(quick, KVKEY_BLOCK, &k0, BLOCK, 3, &e), DI_EUNAVAIL, "%s", e.msg);
    cr_assert(strstr(e.msg, s.target) && strstr(e.msg, "unavailable"), "%s", e.msg);
    kvc_close(quick);
    th_store_restart(&s);
    /* The same client: it retries while its channel reconnects, then reconnects UCX. */
    cr_assert_eq(get_check(c, KVKEY_BLOCK, &k0, BLOCK, 3, &e), DI_OK, "%s", e.msg);
    cr_assert_eq(kvc_info(c, &after, &e), DI_OK);
    cr_assert_neq(before.store_id, after.store_id, "a new store instance");
    for (uint64_t i = 1; i < 30; i++) {
        kvkey k = th_key(i);
        cr_assert_eq(get_check(c, KVKEY_BLOCK, &k, BLOCK, 3, &e), DI_OK, "%s", e.msg);
    }
    kvc_close(c);
    th_store_stop(&s);
    th_rmtree(dir);
}

Test(service, abandoned_allocations_and_leases_are_reclaimed, .timeout = 60)
{
    char dir[256];
    th_tmpdir(dir);
    th_store s;
    const char *args[] = {"--block-bytes", "4224", "--window-bytes", "8320", "--dram-bytes",
                          "8MiB", "--alloc-timeout", "300ms", "--lease-max", "400ms", NULL};
    th_store_start(&s, dir, args);
    kvc_client *dying = th_client(&s, NULL);
    kvkey a = th_key(1), b = th_key(2);
    put_one(dying, KVKEY_BLOCK, &b, BLOCK, 0);
    /* An allocation whose writer never commits. */
    Di__Kvstore__AllocItem it = DI__KVSTORE__ALLOC_ITEM__INIT, *pit = &it;
    it.cls = DI__KVSTORE__OBJ_CLASS__BLOCK;
    it.key = (ProtobufCBinaryData){32, a.b};
    it.bytes = BLOCK;
    Di__Kvstore__AllocRequest ar = DI__KVSTORE__ALLOC_REQUEST__INIT;
    ar.n_items = 1;
    ar.items = &pit;
    uint8_t pb[256], *rep;
    size_t len;
    di_error e;
    size_t n = di__kvstore__alloc_request__pack(&ar, pb);
    cr_assert_eq(kvc_call(dying, "Alloc", pb, n, &rep, &len, &e), DI_OK, "%s", e.msg);
    free(rep);
    /* A lease (asking for a minute: clamped to --lease-max) whose holder goes away. */
    kvc_lease l;
    cr_assert_eq(kvc_acquire(dying, KVKEY_BLOCK, &b, 60000, &l, &e), DI_OK, "%s", e.msg);
    cr_assert_leq(l.expires_in_ms, 400);
    kvc_close(dying);
    kvc_client *c = th_client(&s, NULL);
    Di__Kvstore__StatsReply *st = NULL;
    for (int tries = 0; tries < 40; tries++) {
        usleep(100 * 1000); /* the sweeper runs every 200 ms */
        if (st)
            di__kvstore__stats_reply__free_unpacked(st, NULL);
        stats(c, &st);
        if (st->alloc_reclaimed >= 1 && st->leases_timed_out >= 1)
            break;
    }
    cr_assert_eq(st->alloc_reclaimed, 1);
    cr_assert_eq(st->leases_timed_out, 1);
    cr_assert_eq(st->leases_active, 0);
    cr_assert_eq(st->classes[KVKEY_BLOCK]->writing, 0);
    cr_assert_eq(st->classes[KVKEY_BLOCK]->dram_slots_used, 1, "only block b holds a slot");
    di__kvstore__stats_reply__free_unpacked(st, NULL);
    put_one(c, KVKEY_BLOCK, &a, BLOCK, 0); /* the key is free again */
    cr_assert_eq(get_check(c, KVKEY_BLOCK, &a, BLOCK, 0, &e), DI_OK, "%s", e.msg);
    kvc_close(c);
    th_store_stop(&s);
    th_rmtree(dir);
}

Test(service, geometry_from_a_shipped_name_or_a_config_file, .timeout = 60)
{
    char dir[256], cfgpath[300];
    th_tmpdir(dir);
    snprintf(cfgpath, sizeof(cfgpath), "%s.config.json", dir);
    FILE *f = fopen(cfgpath, "w");
    fputs(model_config_builtin_json("small"), f);
    fclose(f);
    const char *names[2] = {"tiny", "small"};
    for (int i = 0; i < 2; i++) {
        model_config mc;
        di_error e;
        cr_assert_eq(model_config_builtin(names[i], &mc, &e), DI_OK, "%s", e.msg);
        kv_geometry g;
        model_config_kv_geometry(&mc, 5, &g);
        th_store s;
        const char *by_name[] = {"--geometry", names[i], "--dram-bytes", "8MiB", NULL};
        const char *by_file[] = {"--model-config", cfgpath, "--dram-bytes", "8MiB", NULL};
        char sub[300];
        snprintf(sub, sizeof(sub), "%s/%d", dir, i);
        th_store_start(&s, sub, i == 0 ? by_name : by_file);
        kvc_client *c = th_client(&s, NULL);
        kvc_store_info info;
        cr_assert_eq(kvc_info(c, &info, &e), DI_OK, "%s", e.msg);
        cr_assert_eq(info.geometry.model_id, g.model_id, "%s", names[i]);
        cr_assert_eq(info.object_bytes[KVKEY_BLOCK], kv_block_bytes(&g));
        cr_assert_eq(info.object_bytes[KVKEY_WINDOW], kv_window_state_bytes(&g));
        /* A block of that model round-trips; a V4.1-Flash block is refused by size or model. */
        kvkey k = th_key(1);
        size_t bytes = kv_block_bytes(&g);
        uint8_t *p = malloc(bytes), *q = malloc(bytes);
        th_fill_object(p, bytes, KV_BLOCK_MAGIC, &g, &k, 0);
        cr_assert_eq(kvc_put1(c, KVKEY_BLOCK, &k, p, bytes, &e), DI_OK, "%s", e.msg);
        cr_assert_eq(kvc_get1(c, KVKEY_BLOCK, &k, q, bytes, NULL, &e), DI_OK, "%s", e.msg);
        cr_assert_eq(memcmp(p, q, bytes), 0);
        kv_geometry v = v41();
        kvkey k2 = th_key(2);
        th_fill_object(p, bytes, KV_BLOCK_MAGIC, &v, &k2, 0); /* right size, other model */
        cr_assert_eq(kvc_put1(c, KVKEY_BLOCK, &k2, p, bytes, &e), DI_ECORRUPT);
        cr_assert(strstr(e.msg, "written by model"), "%s", e.msg);
        free(p);
        free(q);
        kvc_close(c);
        th_store_stop(&s);
    }
    char cmd[600];
    snprintf(cmd, sizeof(cmd), "%s/kvstore/di-kvstore --geometry huge --dir %s/x 2>&1",
             getenv("DI_BUILD_ROOT"), dir);
    FILE *p = popen(cmd, "r");
    char out[1024] = {0};
    size_t n = fread(out, 1, sizeof(out) - 1, p);
    out[n] = '\0';
    int status = pclose(p);
    cr_assert(WIFEXITED(status) && WEXITSTATUS(status) != 0, "bad geometry must fail");
    cr_assert(strstr(out, "--geometry huge") && strstr(out, "v41-flash"), "%s", out);
    remove(cfgpath);
    th_rmtree(dir);
}

/* Several clients at once on overlapping keys: puts, batched gets, deletes. Every outcome must
 * be a documented one, every byte read must be the right one, and when they stop no lease,
 * allocation or slot may be left behind. */
typedef struct worker_arg {
    const th_store *s;
    int id;
    int errors;         /* unexpected outcomes */
    int reads_ok;       /* verified reads */
    char last_error[400];
} worker_arg;

static void *worker_main(void *p)
{
    worker_arg *w = p;
    kvc_client *c = th_client(w->s, NULL);
    uint8_t *obj = malloc(BLOCK), *want = malloc(BLOCK);
    kvc_item items[8];
    uint8_t *bufs = malloc(8 * BLOCK);
    for (int round = 0; round < 60; round++) {
        uint64_t k = (uint64_t)((round * 7 + w->id * 3) % 24);
        kvkey key = th_key(k);
        di_error e;
        di_status st;
        if (round % 5 == 4) {
            st = kvc_delete1(c, KVKEY_BLOCK, &key, &e);
            if (st != DI_OK && st != DI_ENOENT) {
                w->errors++;
                snprintf(w->last_error, sizeof(w->last_error), "delete: %s", e.msg);
            }
            continue;
        }
        kv_geometry g = v41();
        th_fill_object(obj, BLOCK, KV_BLOCK_MAGIC, &g, &key, 0);
        st = kvc_put1(c, KVKEY_BLOCK, &key, obj, BLOCK, &e);
        /* EFULL: every DRAM slot leased by the other workers' batches at that moment. */
        if (st != DI_OK && st != DI_EEXIST && st != DI_EBUSY && st != DI_EFULL) {
            w->errors++;
            snprintf(w->last_error, sizeof(w->last_error), "put: %s", e.msg);
        }
        for (int i = 0; i < 8; i++)
            items[i] = (kvc_item){.cls = KVKEY_BLOCK, .key = th_key((k + (uint64_t)i) % 24),
                                  .buf = bufs + i * BLOCK, .cap = BLOCK};
        if (kvc_get(c, items, 8, &e) != DI_OK) {
            w->errors++;
            snprintf(w->last_error, sizeof(w->last_error), "get batch: %s", e.msg);
            continue;
        }
        for (int i = 0; i < 8; i++) {
            if (items[i].status == DI_ENOENT || items[i].status == DI_EFULL)
                continue;
            if (items[i].status != DI_OK) {
                w->errors++;
                snprintf(w->last_error, sizeof(w->last_error), "get: %s", items[i].error.msg);
                continue;
            }
            th_fill_object(want, BLOCK, KV_BLOCK_MAGIC, &g, &items[i].key, 0);
            if (memcmp(want, items[i].buf, BLOCK) != 0) {
                w->errors++;
                snprintf(w->last_error, sizeof(w->last_error), "get: wrong bytes");
            } else
                w->reads_ok++;
        }
    }
    free(obj);
    free(want);
    free(bufs);
    kvc_close(c);
    return NULL;
}

Test(service, concurrent_clients_on_overlapping_keys, .timeout = 120)
{
    char dir[256];
    th_tmpdir(dir);
    th_store s;
    /* 12 block slots in DRAM and room for 15 blocks on disk, for 24 keys: evictions from both
     * tiers and reloads from disk happen all along. */
    const char *args[] = {"--block-bytes", "4224", "--window-bytes", "8320", "--dram-bytes",
                          "1MiB", "--dram-window-share", "0.6", "--dram-handoff-share", "0.35",
                          "--disk-bytes", "64KiB", NULL};
    th_store_start(&s, dir, args);
    enum { W = 4 };
    pthread_t t[W];
    worker_arg w[W];
    for (int i = 0; i < W; i++) {
        w[i] = (worker_arg){.s = &s, .id = i};
        pthread_create(&t[i], NULL, worker_main, &w[i]);
    }
    int reads = 0;
    for (int i = 0; i < W; i++) {
        pthread_join(t[i], NULL);
        cr_expect_eq(w[i].errors, 0, "worker %d: %s", i, w[i].last_error);
        reads += w[i].reads_ok;
    }
    cr_assert_gt(reads, 100, "the workers read back verified objects");
    kvc_client *c = th_client(&s, NULL);
    Di__Kvstore__StatsReply *st;
    stats(c, &st);
    cr_assert_eq(st->leases_active, 0);
    cr_assert_eq(st->classes[KVKEY_BLOCK]->writing, 0);
    cr_assert_eq(st->classes[KVKEY_BLOCK]->dram_slots_used, st->classes[KVKEY_BLOCK]->dram_objects);
    cr_assert_leq(st->disk_used, 65536);
    cr_assert_gt(st->dram_evictions, 0);
    cr_assert_gt(st->disk_evictions, 0);
    cr_assert_gt(st->promotions, 0, "objects were read back from disk");
    di__kvstore__stats_reply__free_unpacked(st, NULL);
    kvc_close(c);
    th_store_stop(&s);
    th_rmtree(dir);
}
