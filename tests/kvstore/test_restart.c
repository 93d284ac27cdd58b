/* A store stopped and started again, as seen by its clients:
 * - after a gRPC-path Get reply of 11.4 MB (100 V4.1-Flash blocks, more than a socket's send
 *   buffer), SIGTERM drains within its deadline and exits 0 (it exited 1 after 7 s: the release
 *   of the last gRPC reference joined gRPC's executor, where the backup poller of that large
 *   write waits up to 10 s), and a restart on the same directory serves the same bytes;
 * - a client that saw the store down (its channel failing to reconnect) works again within a
 *   second or two of the store being back, killed or stopped (it took 6.7 to 9 s: between its
 *   retries nothing polled the channel's reconnection attempts but gRPC's backup poll, every
 *   5 s). */
#include <criterion/criterion.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/kvfmt/kv_layout.h"
#include "common/net/kv_client.h"
#include "common/util/clock.h"
#include "tests/kvstore/harness.h"
#include "tests/kvstore/helpers.h"

static kvc_client *client_on(const th_store *s, kvc_data_path path, uint32_t deadline_ms)
{
    kvc_options o;
    kvc_options_default(&o);
    o.target = s->target;
    o.data_path = path;
    o.deadline_ms = deadline_ms;
    kvc_client *c = NULL;
    di_error e;
    cr_assert_eq(kvc_open(&o, &c, &e), DI_OK, "%s", e.msg);
    return c;
}

/* n blocks of bb bytes with headers of geometry g, keys from seed, bytes a function of key and
 * index. */
static uint8_t *fill_blocks(const kv_geometry *g, size_t bb, kvc_item *items, uint32_t n,
                            uint64_t seed)
{
    uint8_t *src = malloc(bb * n);
    cr_assert_not_null(src);
    for (uint32_t i = 0; i < n; i++) {
        items[i] = (kvc_item){.cls = KVKEY_BLOCK, .key = th_key(seed + i), .buf = src + i * bb,
                              .cap = bb};
        th_fill_object(items[i].buf, bb, KV_BLOCK_MAGIC, g, &items[i].key, i);
    }
    return src;
}

/* Gets the items into a fresh buffer and compares them with src. */
static void get_and_compare(kvc_client *c, kvc_item *items, uint32_t n, const uint8_t *src)
{
    size_t bb = items[0].cap;
    uint8_t *dst = calloc(n, bb);
    cr_assert_not_null(dst);
    for (uint32_t i = 0; i < n; i++)
        items[i].buf = dst + i * bb;
    di_error e;
    cr_assert_eq(kvc_get(c, items, n, &e), DI_OK, "%s", e.msg);
    for (uint32_t i = 0; i < n; i++)
        cr_assert_eq(items[i].status, DI_OK, "get %u: %s", i, items[i].error.msg);
    cr_assert(memcmp(dst, src, n * bb) == 0, "the bytes read differ from those written");
    free(dst);
}

/* Starts a store on a new directory, opens a client on it and puts n blocks (bb bytes each; 0:
 * the store's block size). Returns the client; *src holds the bytes written. */
static kvc_client *store_with_blocks(th_store *s, char *dir, const char *const *args,
                                     kvc_data_path path, uint32_t deadline_ms, kvc_item *items,
                                     uint32_t n, size_t bb, uint64_t seed, uint8_t **src)
{
    th_tmpdir(dir);
    th_store_start(s, dir, args);
    kvc_client *c = client_on(s, path, deadline_ms);
    kvc_store_info info;
    di_error e;
    cr_assert_eq(kvc_info(c, &info, &e), DI_OK, "%s", e.msg);
    *src = fill_blocks(&info.geometry, bb ? bb : kv_block_bytes(&info.geometry), items, n, seed);
    cr_assert_eq(kvc_put(c, items, n, &e), DI_OK, "%s", e.msg);
    for (uint32_t i = 0; i < n; i++)
        cr_assert_eq(items[i].status, DI_OK, "put %u: %s", i, items[i].error.msg);
    return c;
}

static const char *const flash_args[] = {"--geometry", "v41-flash", "--nextn", "5",
                                         "--dram-bytes", "256MiB", "--drain", "3s", NULL};

Test(restart, a_large_grpc_get_then_sigterm_exits_0_in_its_drain_and_the_data_survives,
     .timeout = 120)
{
    enum { NB = 100 }; /* 100 x 114,048 B = 11.4 MB in one Get reply */
    char dir[256];
    th_store s;
    static kvc_item items[NB];
    uint8_t *src;
    kvc_client *c = store_with_blocks(&s, dir, flash_args, KVC_PATH_GRPC, 30000, items, NB, 0,
                                      7000, &src);
    get_and_compare(c, items, NB, src);
    kvc_close(c);
    uint64_t t0 = di_mono_ns();
    th_store_stop(&s); /* asserts exit status 0 */
    double ms = (double)(di_mono_ns() - t0) / 1e6;
    cr_log_info("SIGTERM after an %.1f MB Get reply: stopped in %.0f ms (--drain 3s)",
                NB * (double)items[0].cap / 1e6, ms);
    cr_assert_lt(ms, 3000, "the stop took %.0f ms, past its 3 s drain", ms);
    cr_assert_eq(th_store_log_count(&s, "missed its deadline"), 0);
    th_store_restart(&s);
    c = client_on(&s, KVC_PATH_GRPC, 30000);
    get_and_compare(c, items, NB, src);
    kvc_close(c);
    th_store_stop(&s);
    free(src);
    th_rmtree(dir);
}

static const char *const small_args[] = {"--block-bytes", "4224", "--window-bytes", "8320",
                                         "--dram-bytes", "8MiB", "--memtable-bytes", "2MiB",
                                         NULL};

Test(restart, a_client_that_saw_the_store_down_works_again_within_a_second_or_two,
     .timeout = 120)
{
    enum { N = 4 };
    char dir[256];
    th_store s;
    kvc_item items[N];
    uint8_t *src;
    kvc_client *c = store_with_blocks(&s, dir, small_args, KVC_PATH_AUTO, 1500, items, N, 4224,
                                      9000, &src);
    di_error e;
    uint8_t *scratch = malloc(N * items[0].cap);
    cr_assert_not_null(scratch);
    for (int round = 0; round < 2; round++) {
        if (round == 0)
            th_store_kill(&s);
        else
            th_store_stop(&s);
        /* a call while the store is down: the channel fails to reconnect, then backs off */
        di_status st = kvc_get(c, items, N, &e);
        cr_assert_eq(st, DI_EUNAVAIL, "while down: %s: %s", di_status_name(st), e.msg);
        th_store_restart(&s);
        for (uint32_t i = 0; i < N; i++)
            items[i].buf = scratch + i * items[i].cap;
        uint64_t t0 = di_mono_ns();
        int failed = 0;
        while ((st = kvc_get(c, items, N, &e)) != DI_OK && di_mono_ns() - t0 < 20000000000ull) {
            failed++;
            usleep(50000);
        }
        double ms = (double)(di_mono_ns() - t0) / 1e6;
        cr_log_info("store %s and restarted: the client worked again %.0f ms after it was back "
                    "(%d calls failed first)", round == 0 ? "killed" : "stopped", ms, failed);
        cr_assert_eq(st, DI_OK, "%s", e.msg);
        cr_assert_lt(ms, 3000, "the client worked again only %.0f ms after the restart", ms);
        get_and_compare(c, items, N, src);
    }
    kvc_close(c);
    th_store_stop(&s);
    free(scratch);
    free(src);
    th_rmtree(dir);
}
