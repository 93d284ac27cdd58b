/* The object index and the DRAM slab allocator (kvstore/index.h, kvstore/slab.h), driven with a
 * fake clock: TTL, eviction order, leases across expiry and pressure, allocation timeouts,
 * duplicates, corrupt loads, restore, and a random-operation run checked against invariants. */
#include <criterion/criterion.h>
#include <stdlib.h>
#include <string.h>

#include "common/util/philox.h"
#include "kvstore/index.h"

#define BLK KVKEY_BLOCK
#define WIN KVKEY_WINDOW
#define HND KVKEY_HANDOFF

typedef struct fixture {
    void *arena;
    kvslab *slab;
    kvidx *idx;
} fixture;

/* Block slots of 1,024 bytes (32 of them), window slots of 2,048 (8), handoff 3,008 (5). */
static void setup(fixture *f, uint64_t disk_capacity, uint64_t ttl_block)
{
    f->arena = aligned_alloc(4096, 65536);
    kvslab_config sc = {.base = f->arena, .arena_bytes = 65536,
                        .object_bytes = {1000, 2000, 3000}, .share = {0.5, 0.25, 0.25}};
    di_error e;
    cr_assert_eq(kvslab_create(&sc, &f->slab, &e), DI_OK, "%s", e.msg);
    kvidx_config ic = {.ttl_ms = {ttl_block, ttl_block, 60000},
                       .disk_capacity = disk_capacity,
                       .alloc_timeout_ms = 5000,
                       .lease_max_ms = 30000,
                       .max_leases = 16,
                       .max_objects = 1000,
                       .hash_seed = 12345};
    cr_assert_eq(kvidx_create(&ic, f->slab, &f->idx, &e), DI_OK, "%s", e.msg);
}

static void teardown(fixture *f)
{
    kvidx_check(f->idx);
    f->idx = kvidx_free(f->idx);
    f->slab = kvslab_free(f->slab);
    free(f->arena);
}

static kvkey key_of(unsigned i)
{
    kvkey k;
    memset(&k, 0, sizeof(k));
    memcpy(k.b, &i, sizeof(i));
    k.b[31] = 0xa5;
    return k;
}

/* alloc + commit; returns the object. */
static kvidx_obj *put(fixture *f, int cls, unsigned i, uint64_t bytes, uint64_t now)
{
    kvkey k = key_of(i);
    uint64_t id;
    kvidx_obj *o;
    di_error e;
    cr_assert_eq(kvidx_alloc(f->idx, cls, &k, bytes, now, &id, &o, &e), DI_OK, "%s", e.msg);
    kvidx_obj *c;
    cr_assert_eq(kvidx_commit_begin(f->idx, id, now, &c, &e), DI_OK, "%s", e.msg);
    cr_assert_eq(c, o);
    kvidx_commit_end(f->idx, c, 1, 1, now);
    kvidx_check(f->idx);
    return o;
}

static int present(fixture *f, int cls, unsigned i, uint64_t now, int *resident)
{
    kvkey k = key_of(i);
    kvidx_info info;
    kvidx_inspect(f->idx, cls, &k, now, &info);
    if (resident)
        *resident = info.resident;
    return info.present;
}

/* Performs every queued disk delete; returns how many. */
static size_t drain_deletes(fixture *f)
{
    kvidx_obj *out[64];
    size_t total = 0, n;
    while ((n = kvidx_take_disk_deletes(f->idx, out, 64)) > 0) {
        for (size_t i = 0; i < n; i++)
            kvidx_disk_deleted(f->idx, out[i], 1);
        total += n;
    }
    return total;
}

/* ------------------------------------------------------------------ slab */

Test(slab, regions_follow_the_shares_and_limits_follow_the_capacity)
{
    void *arena = aligned_alloc(4096, 65536);
    kvslab_config sc = {.base = arena, .arena_bytes = 65536, .object_bytes = {1000, 2000, 3000},
                        .share = {0.5, 0.25, 0.25}};
    kvslab *s;
    di_error e;
    cr_assert_eq(kvslab_create(&sc, &s, &e), DI_OK, "%s", e.msg);
    kvslab_class_stats st;
    kvslab_stats(s, BLK, &st);
    cr_assert_eq(st.slot_bytes, 1024);
    cr_assert_eq(st.slots, 32, "32768 / 1024");
    kvslab_stats(s, WIN, &st);
    cr_assert_eq(st.slots, 8);
    kvslab_stats(s, HND, &st);
    cr_assert_eq(st.slot_bytes, 3008);
    cr_assert_eq(st.slots, 5, "16384 / 3008");
    /* Slots never overlap: block region, then window region, then handoff. */
    cr_assert_eq(kvslab_offset(s, BLK, 31) + 1024, kvslab_offset(s, WIN, 0));
    cr_assert_eq(kvslab_offset(s, WIN, 7) + 2048, kvslab_offset(s, HND, 0));
    cr_assert_leq(kvslab_offset(s, HND, 4) + 3008, 65536);

    uint32_t slot, seen = 0;
    for (int i = 0; i < 8; i++) {
        cr_assert_eq(kvslab_alloc(s, WIN, &slot), DI_OK);
        cr_assert_lt(slot, 8);
        cr_assert_eq(seen & (1u << slot), 0, "slot %u handed out twice", slot);
        seen |= 1u << slot;
    }
    cr_assert_eq(kvslab_alloc(s, WIN, &slot), DI_EFULL);
    kvslab_release(s, WIN, 3);
    cr_assert_eq(kvslab_alloc(s, WIN, &slot), DI_OK);
    cr_assert_eq(slot, 3);

    /* Half the capacity: 4 window slots allowed, 8 in use. */
    cr_assert_eq(kvslab_set_capacity(s, 32768, &e), DI_OK, "%s", e.msg);
    cr_assert(kvslab_over_limit(s, WIN));
    cr_assert_not(kvslab_over_limit(s, BLK));
    for (uint32_t i = 0; i < 4; i++)
        kvslab_release(s, WIN, i);
    cr_assert_not(kvslab_over_limit(s, WIN));
    cr_assert_eq(kvslab_alloc(s, WIN, &slot), DI_EFULL, "at the lowered limit");
    cr_assert_eq(kvslab_set_capacity(s, 65537, &e), DI_ERANGE);
    cr_assert(strstr(e.msg, "--dram-bytes"), "%s", e.msg);
    cr_assert_eq(kvslab_set_capacity(s, 4000, &e), DI_ERANGE, "no handoff slot left");
    kvslab_free(s);
    free(arena);
}

Test(slab, bad_configs_are_refused)
{
    void *arena = aligned_alloc(4096, 8192);
    kvslab_config sc = {.base = arena, .arena_bytes = 8192, .object_bytes = {1000, 2000, 3000},
                        .share = {0.5, 0.4, 0.2}};
    kvslab *s = NULL;
    di_error e;
    cr_assert_eq(kvslab_create(&sc, &s, &e), DI_EINVAL);
    cr_assert(strstr(e.msg, "sum"), "%s", e.msg);
    sc.share[1] = 0.25;
    sc.share[2] = 0.25;
    cr_assert_eq(kvslab_create(&sc, &s, &e), DI_EINVAL, "2048 bytes hold no 3008-byte slot");
    cr_assert(strstr(e.msg, "handoff"), "%s", e.msg);
    sc.base = (char *)arena + 8;
    cr_assert_eq(kvslab_create(&sc, &s, &e), DI_EINVAL);
    cr_assert_null(s);
    cr_assert_null(kvslab_free(NULL));
    free(arena);
}

/* ------------------------------------------------------------------ lifecycle */

Test(index, allocation_is_invisible_until_commit)
{
    fixture f;
    setup(&f, 1 << 20, 1000);
    kvkey k = key_of(1);
    uint64_t id;
    kvidx_obj *o;
    di_error e;
    cr_assert_eq(kvidx_alloc(f.idx, BLK, &k, 1000, 0, &id, &o, &e), DI_OK);
    uint32_t hit, win[4];
    size_t nw;
    kvidx_lookup(f.idx, &k, 1, 1, &hit, win, 4, &nw);
    cr_assert_eq(hit, 0, "a WRITING object is not a hit");
    kvidx_lease_info li;
    cr_assert_eq(kvidx_lease(f.idx, BLK, &k, 100, 1, &li, &e), DI_ENOENT);
    uint64_t id2;
    kvidx_obj *o2;
    cr_assert_eq(kvidx_alloc(f.idx, BLK, &k, 1000, 1, &id2, &o2, &e), DI_EBUSY);
    cr_assert(strstr(e.msg, "being written"), "%s", e.msg);
    kvidx_obj *c;
    cr_assert_eq(kvidx_commit_begin(f.idx, id, 2, &c, &e), DI_OK);
    cr_assert_eq(kvidx_commit_begin(f.idx, id, 2, &c, &e), DI_ESTATE, "second commit");
    kvidx_commit_end(f.idx, c, 1, 1, 3);
    kvidx_lookup(f.idx, &k, 1, 4, &hit, win, 4, &nw);
    cr_assert_eq(hit, 1);
    cr_assert_eq(kvidx_alloc(f.idx, BLK, &k, 1000, 5, &id2, &o2, &e), DI_EEXIST);
    cr_assert_eq(kvidx_commit_begin(f.idx, id, 5, &c, &e), DI_ENOENT, "id is spent");
    kvidx_stats st;
    kvidx_get_stats(f.idx, &st);
    cr_assert_eq(st.cls[BLK].objects, 1);
    cr_assert_eq(st.cls[BLK].dram_objects, 1, "a committed object stays resident");
    cr_assert_eq(st.disk_used, 1000);
    teardown(&f);
}

Test(index, failed_commit_and_abort_release_everything)
{
    fixture f;
    setup(&f, 1 << 20, 1000);
    kvkey k = key_of(2);
    uint64_t id;
    kvidx_obj *o, *c;
    cr_assert_eq(kvidx_alloc(f.idx, BLK, &k, 1000, 0, &id, &o, NULL), DI_OK);
    cr_assert_eq(kvidx_commit_begin(f.idx, id, 1, &c, NULL), DI_OK);
    kvidx_commit_end(f.idx, c, 0, 0, 1); /* e.g. checksum mismatch: never reached the disk */
    kvidx_check(f.idx);
    kvidx_stats st;
    kvidx_get_stats(f.idx, &st);
    cr_assert_eq(st.disk_used, 0);
    cr_assert_eq(st.commit_failures, 1);
    /* A failed disk write leaves a delete to do before the key can be reused. */
    cr_assert_eq(kvidx_alloc(f.idx, BLK, &k, 1000, 2, &id, &o, NULL), DI_OK);
    cr_assert_eq(kvidx_commit_begin(f.idx, id, 2, &c, NULL), DI_OK);
    kvidx_commit_end(f.idx, c, 0, 1, 2);
    di_error e;
    cr_assert_eq(kvidx_alloc(f.idx, BLK, &k, 1000, 3, &id, &o, &e), DI_EBUSY);
    cr_assert(strstr(e.msg, "being removed"), "%s", e.msg);
    cr_assert_eq(drain_deletes(&f), 1);
    cr_assert_eq(kvidx_alloc(f.idx, BLK, &k, 1000, 4, &id, &o, NULL), DI_OK);
    cr_assert_eq(kvidx_abort(f.idx, id, NULL), DI_OK);
    cr_assert_eq(kvidx_abort(f.idx, id, &e), DI_ENOENT);
    kvidx_get_stats(f.idx, &st);
    cr_assert_eq(st.disk_used + st.disk_deleting, 0);
    kvslab_class_stats ss;
    kvslab_stats(f.slab, BLK, &ss);
    cr_assert_eq(ss.used, 0, "no slot leaked");
    teardown(&f);
}

Test(index, wrong_sizes_are_refused)
{
    fixture f;
    setup(&f, 1 << 20, 1000);
    kvkey k = key_of(3);
    uint64_t id;
    kvidx_obj *o;
    di_error e;
    cr_assert_eq(kvidx_alloc(f.idx, BLK, &k, 0, 0, &id, &o, &e), DI_EINVAL);
    cr_assert_eq(kvidx_alloc(f.idx, BLK, &k, 1025, 0, &id, &o, &e), DI_EINVAL);
    cr_assert(strstr(e.msg, "1025 bytes"), "%s", e.msg);
    cr_assert_eq(kvidx_alloc(f.idx, 7, &k, 10, 0, &id, &o, &e), DI_EINVAL);
    teardown(&f);
}

Test(index, allocations_time_out_and_are_reclaimed)
{
    fixture f;
    setup(&f, 1 << 20, 0);
    kvkey a = key_of(10), b = key_of(11);
    uint64_t ida, idb;
    kvidx_obj *o;
    cr_assert_eq(kvidx_alloc(f.idx, BLK, &a, 1000, 0, &ida, &o, NULL), DI_OK);
    cr_assert_eq(kvidx_alloc(f.idx, BLK, &b, 1000, 100, &idb, &o, NULL), DI_OK);
    kvidx_sweep_report r;
    kvidx_sweep(f.idx, 4999, &r);
    cr_assert_eq(r.allocs_reclaimed, 0);
    kvidx_sweep(f.idx, 5000, &r);
    cr_assert_eq(r.allocs_reclaimed, 1, "a's deadline is 5000");
    di_error e;
    kvidx_obj *c;
    cr_assert_eq(kvidx_commit_begin(f.idx, ida, 5001, &c, &e), DI_ENOENT);
    cr_assert(strstr(e.msg, "reclaimed"), "%s", e.msg);
    /* b is past its deadline at commit time even though no sweep ran. */
    cr_assert_eq(kvidx_commit_begin(f.idx, idb, 5100, &c, &e), DI_ETIMEDOUT);
    kvidx_stats st;
    kvidx_get_stats(f.idx, &st);
    cr_assert_eq(st.alloc_reclaimed, 2);
    cr_assert_eq(st.disk_used, 0);
    teardown(&f);
}

/* ------------------------------------------------------------------ lookup */

Test(index, lookup_returns_the_longest_prefix_and_its_windows)
{
    fixture f;
    setup(&f, 1 << 20, 0);
    for (unsigned i = 0; i < 5; i++)
        put(&f, BLK, i, 1000, 10);
    put(&f, WIN, 1, 2000, 10); /* window at 256 (keyed by h_1) */
    put(&f, WIN, 3, 2000, 10); /* window at 512 (keyed by h_3) */
    put(&f, WIN, 4, 2000, 10); /* at 640: beyond the hit below */
    kvkey keys[6];
    for (unsigned i = 0; i < 6; i++)
        keys[i] = key_of(i);
    keys[4] = key_of(99); /* the chain breaks at block 4 */
    uint32_t hit, win[8];
    size_t nw;
    kvidx_lookup(f.idx, keys, 6, 20, &hit, win, 8, &nw);
    cr_assert_eq(hit, 4);
    cr_assert_eq(nw, 2);
    cr_assert_eq(win[0], 2, "window at 2 blocks");
    cr_assert_eq(win[1], 4, "window at 4 blocks");
    kvidx_lookup(f.idx, keys, 6, 20, &hit, win, 1, &nw);
    cr_assert_eq(nw, 1, "max_windows bounds the output");
    kvidx_stats st;
    kvidx_get_stats(f.idx, &st);
    cr_assert_eq(st.lookup_blocks, 12);
    cr_assert_eq(st.lookup_hits, 8);
    teardown(&f);
}

/* ------------------------------------------------------------------ TTL */

Test(index, ttl_expires_and_hits_refresh_it)
{
    fixture f;
    setup(&f, 1 << 20, 1000);
    put(&f, BLK, 1, 1000, 0);
    put(&f, BLK, 2, 1000, 0);
    kvkey k1 = key_of(1);
    uint32_t hit, win[1];
    size_t nw;
    kvidx_lookup(f.idx, &k1, 1, 900, &hit, win, 1, &nw); /* refresh block 1 at 900 */
    cr_assert_eq(hit, 1);
    cr_assert(present(&f, BLK, 2, 999, NULL));
    cr_assert_not(present(&f, BLK, 2, 1000, NULL), "block 2 expires at 0 + 1000");
    cr_assert(present(&f, BLK, 1, 1899, NULL), "block 1 lives until 900 + 1000");
    kvidx_sweep_report r;
    kvidx_sweep(f.idx, 1000, &r);
    cr_assert_eq(r.expired, 1);
    cr_assert_eq(drain_deletes(&f), 1);
    /* A TTL change applies at once to every object of the class. */
    cr_assert_eq(kvidx_set_ttl(f.idx, BLK, 5000, NULL), DI_OK);
    cr_assert(present(&f, BLK, 1, 5899, NULL));
    cr_assert_eq(kvidx_set_ttl(f.idx, BLK, 100, NULL), DI_OK);
    cr_assert_not(present(&f, BLK, 1, 1000, NULL));
    /* TTL 0: never expires. */
    cr_assert_eq(kvidx_set_ttl(f.idx, BLK, 0, NULL), DI_OK);
    cr_assert(present(&f, BLK, 1, UINT64_MAX / 2, NULL));
    kvidx_stats st;
    kvidx_get_stats(f.idx, &st);
    cr_assert_eq(st.expirations, 1);
    teardown(&f);
}

Test(index, handoff_class_has_its_own_ttl)
{
    fixture f;
    setup(&f, 1 << 20, 3 * 86400000ull);
    put(&f, HND, 1, 2500, 0);
    put(&f, BLK, 1, 1000, 0);
    cr_assert(present(&f, HND, 1, 59999, NULL));
    cr_assert_not(present(&f, HND, 1, 60000, NULL), "handoff TTL 60 s");
    cr_assert(present(&f, BLK, 1, 60000, NULL), "same key bytes, block class: 3 days");
    teardown(&f);
}

/* ------------------------------------------------------------------ eviction */

Test(index, dram_eviction_drops_the_lru_copy_and_keeps_it_on_disk)
{
    fixture f;
    setup(&f, 1 << 20, 0);
    for (unsigned i = 0; i < 8; i++)
        put(&f, WIN, i, 2000, i); /* fills the 8 window slots */
    kvkey k0 = key_of(0);
    kvidx_lease_info li;
    /* Hit window 0 so that window 1 becomes the least recently used. */
    cr_assert_eq(kvidx_lease(f.idx, WIN, &k0, 10, 100, &li, NULL), DI_OK);
    cr_assert_eq(kvidx_release(f.idx, li.lease_id, 101, NULL), DI_OK);
    put(&f, WIN, 8, 2000, 200);
    int res;
    cr_assert(present(&f, WIN, 1, 300, &res));
    cr_assert_not(res, "window 1 left DRAM but stays on disk");
    cr_assert(present(&f, WIN, 0, 300, &res));
    cr_assert(res, "window 0 was hit");
    /* Reading window 1 again loads it into a slot, evicting the next LRU (window 2). */
    kvkey k1 = key_of(1);
    cr_assert_eq(kvidx_lease(f.idx, WIN, &k1, 10, 300, &li, NULL), DI_OK);
    cr_assert(li.need_load);
    kvidx_load_done(f.idx, li.obj, KVIDX_LOAD_OK, 301);
    cr_assert_eq(kvidx_release(f.idx, li.lease_id, 302, NULL), DI_OK);
    cr_assert(present(&f, WIN, 2, 400, &res));
    cr_assert_not(res);
    kvidx_stats st;
    kvidx_get_stats(f.idx, &st);
    cr_assert_eq(st.dram_evictions, 2);
    cr_assert_eq(st.promotions, 1);
    cr_assert_eq(st.cls[WIN].objects, 9);
    cr_assert_eq(st.cls[WIN].dram_objects, 8);
    teardown(&f);
}

Test(index, disk_eviction_prefers_expired_then_lru_across_classes)
{
    fixture f;
    setup(&f, 5000, 10000); /* room for 5 blocks of 1000 */
    put(&f, BLK, 1, 1000, 0);
    put(&f, BLK, 2, 1000, 100);
    put(&f, HND, 3, 2000, 200); /* handoff TTL is 60000 */
    put(&f, BLK, 4, 1000, 300);
    kvidx_set_ttl(f.idx, HND, 500, NULL); /* handoff 3 expires at 700 */
    /* At 800, 6000 > 5000 bytes: handoff 3 goes first although blocks 1 and 2 are older. */
    put(&f, BLK, 5, 1000, 800);
    kvidx_stats st;
    kvidx_get_stats(f.idx, &st);
    cr_assert_eq(st.expirations, 1);
    cr_assert_eq(st.cls[HND].objects, 0);
    cr_assert(present(&f, BLK, 1, 800, NULL));
    put(&f, BLK, 6, 1000, 900); /* 5000: fits */
    put(&f, BLK, 7, 1000, 1000); /* 6000 > 5000: evicts block 1, the least recently used */
    cr_assert_not(present(&f, BLK, 1, 1000, NULL));
    cr_assert(present(&f, BLK, 2, 1000, NULL));
    kvidx_get_stats(f.idx, &st);
    cr_assert_eq(st.expirations, 1);
    cr_assert_eq(st.disk_evictions, 1);
    cr_assert_eq(st.disk_used, 5000);
    cr_assert_eq(drain_deletes(&f), 2);
    teardown(&f);
}

Test(index, lowering_capacities_evicts_at_the_next_sweep)
{
    fixture f;
    setup(&f, 1 << 20, 0);
    for (unsigned i = 0; i < 20; i++)
        put(&f, BLK, i, 1000, i);
    di_error e;
    cr_assert_eq(kvslab_set_capacity(f.slab, 16384, &e), DI_OK, "%s", e.msg); /* 8 blocks */
    cr_assert_eq(kvidx_set_disk_capacity(f.idx, 12000, &e), DI_OK);
    kvidx_sweep_report r;
    kvidx_sweep(f.idx, 100, &r);
    cr_assert_eq(r.disk_evicted, 8, "20 blocks down to 12");
    kvidx_stats st;
    kvidx_get_stats(f.idx, &st);
    cr_assert_eq(st.cls[BLK].objects, 12);
    cr_assert_eq(st.cls[BLK].dram_objects, 8);
    cr_assert_not(present(&f, BLK, 7, 100, NULL), "oldest 8 removed");
    cr_assert(present(&f, BLK, 8, 100, NULL));
    cr_assert_eq(kvidx_set_disk_capacity(f.idx, 0, &e), DI_EINVAL);
    teardown(&f);
}

/* ------------------------------------------------------------------ leases */

Test(index, lease_held_across_expiry_keeps_the_object_until_release)
{
    fixture f;
    setup(&f, 1 << 20, 1000);
    kvidx_obj *o = put(&f, BLK, 1, 1000, 0);
    kvkey k = key_of(1);
    kvidx_lease_info li;
    cr_assert_eq(kvidx_lease(f.idx, BLK, &k, 20000, 500, &li, NULL), DI_OK);
    cr_assert_eq(li.obj, o);
    cr_assert_not(li.need_load);
    uint32_t slot = o->slot;
    kvidx_sweep(f.idx, 5000, NULL); /* long past the expiry at 1500 */
    cr_assert_eq(o->state, KVIDX_SEALED, "pinned: not expired");
    cr_assert(o->has_slot && o->slot == slot, "its slot is not reused");
    /* New readers miss it; the holder keeps reading. */
    kvidx_lease_info li2;
    cr_assert_eq(kvidx_lease(f.idx, BLK, &k, 100, 5000, &li2, NULL), DI_ENOENT);
    cr_assert_eq(kvidx_release(f.idx, li.lease_id, 5001, NULL), DI_OK);
    cr_assert_eq(drain_deletes(&f), 1, "released: the object goes");
    cr_assert_not(present(&f, BLK, 1, 5001, NULL));
    kvidx_stats st;
    kvidx_get_stats(f.idx, &st);
    cr_assert_eq(st.expirations, 1);
    cr_assert_eq(st.leases_active, 0);
    teardown(&f);
}

Test(index, lease_held_across_capacity_pressure_keeps_the_object)
{
    fixture f;
    setup(&f, 32000, 0); /* 32 block slots, 32 blocks of disk */
    kvidx_obj *o = put(&f, BLK, 0, 1000, 0);
    kvkey k = key_of(0);
    kvidx_lease_info li;
    cr_assert_eq(kvidx_lease(f.idx, BLK, &k, 20000, 1, &li, NULL), DI_OK);
    /* Block 0 is now the most recent; age it below everything else. */
    for (unsigned i = 1; i < 200; i++)
        put(&f, BLK, i, 1000, 10 + i);
    cr_assert_eq(o->state, KVIDX_SEALED);
    cr_assert_eq(o->dram, KVIDX_DRAM_RESIDENT, "never evicted from DRAM while leased");
    cr_assert(present(&f, BLK, 0, 300, NULL));
    cr_assert_eq(kvidx_release(f.idx, li.lease_id, 300, NULL), DI_OK);
    put(&f, BLK, 500, 1000, 400); /* the next pressure takes block 0, the LRU */
    cr_assert_not(present(&f, BLK, 0, 400, NULL));
    teardown(&f);
}

Test(index, leases_time_out_and_late_releases_are_told_so)
{
    fixture f;
    setup(&f, 1 << 20, 0);
    put(&f, BLK, 1, 1000, 0);
    kvkey k = key_of(1);
    kvidx_lease_info a, b;
    cr_assert_eq(kvidx_lease(f.idx, BLK, &k, 100, 0, &a, NULL), DI_OK);
    cr_assert_eq(a.expires_ms, 100);
    cr_assert_eq(kvidx_lease(f.idx, BLK, &k, 999999, 0, &b, NULL), DI_OK);
    cr_assert_eq(b.expires_ms, 30000, "clamped to lease_max_ms");
    kvidx_sweep_report r;
    kvidx_sweep(f.idx, 101, &r);
    cr_assert_eq(r.leases_timed_out, 1);
    di_error e;
    cr_assert_eq(kvidx_release(f.idx, a.lease_id, 102, &e), DI_ETIMEDOUT);
    cr_assert(strstr(e.msg, "timed out"), "%s", e.msg);
    cr_assert_eq(kvidx_release(f.idx, a.lease_id, 103, &e), DI_ENOENT, "only reported once");
    /* Expired but not yet swept: the release itself notices. */
    cr_assert_eq(kvidx_release(f.idx, b.lease_id, 30001, &e), DI_ETIMEDOUT);
    cr_assert_eq(kvidx_release(f.idx, 12345, 0, &e), DI_ENOENT);
    kvidx_stats st;
    kvidx_get_stats(f.idx, &st);
    cr_assert_eq(st.leases_active, 0);
    cr_assert_eq(st.leases_timed_out, 2);
    teardown(&f);
}

Test(index, lease_records_are_bounded)
{
    fixture f;
    setup(&f, 1 << 20, 0);
    put(&f, BLK, 1, 1000, 0);
    kvkey k = key_of(1);
    kvidx_lease_info li[17];
    for (int i = 0; i < 16; i++)
        cr_assert_eq(kvidx_lease(f.idx, BLK, &k, 100, 0, &li[i], NULL), DI_OK);
    di_error e;
    cr_assert_eq(kvidx_lease(f.idx, BLK, &k, 100, 0, &li[16], &e), DI_EFULL);
    for (int i = 0; i < 16; i++)
        cr_assert_eq(kvidx_release(f.idx, li[i].lease_id, 1, NULL), DI_OK);
    teardown(&f);
}

Test(index, dram_full_of_leases_refuses_new_work_clearly)
{
    fixture f;
    setup(&f, 1 << 20, 0);
    kvidx_lease_info li[5];
    for (unsigned i = 0; i < 5; i++) {
        put(&f, HND, i, 3000, 10 * i);
        kvkey k = key_of(i);
        cr_assert_eq(kvidx_lease(f.idx, HND, &k, 1000, 10 * i + 1, &li[i], NULL), DI_OK);
    }
    kvkey k = key_of(9);
    uint64_t id;
    kvidx_obj *o;
    di_error e;
    cr_assert_eq(kvidx_alloc(f.idx, HND, &k, 3000, 60, &id, &o, &e), DI_EFULL);
    cr_assert(strstr(e.msg, "handoff slots are leased"), "%s", e.msg);
    cr_assert_eq(kvidx_release(f.idx, li[2].lease_id, 70, NULL), DI_OK);
    cr_assert_eq(kvidx_alloc(f.idx, HND, &k, 3000, 80, &id, &o, &e), DI_OK, "%s", e.msg);
    for (unsigned i = 0; i < 5; i++)
        if (i != 2)
            kvidx_release(f.idx, li[i].lease_id, 90, NULL);
    teardown(&f);
}

/* ------------------------------------------------------------------ corrupt, delete */

Test(index, a_corrupt_disk_copy_is_dropped_and_reported_as_a_miss)
{
    fixture f;
    setup(&f, 1 << 20, 0);
    kvidx_restore_item it = {.cls = BLK, .key = key_of(5), .bytes = 1000, .last_access_ms = 0};
    cr_assert_eq(kvidx_restore(f.idx, &it, 1, NULL), DI_OK);
    kvkey k = key_of(5);
    kvidx_lease_info li, li2;
    cr_assert_eq(kvidx_lease(f.idx, BLK, &k, 100, 1, &li, NULL), DI_OK);
    cr_assert(li.need_load);
    cr_assert_eq(kvidx_lease(f.idx, BLK, &k, 100, 1, &li2, NULL), DI_EBUSY, "still loading");
    kvidx_load_done(f.idx, li.obj, KVIDX_LOAD_CORRUPT, 2);
    cr_assert_eq(kvidx_release(f.idx, li.lease_id, 3, NULL), DI_OK);
    cr_assert_eq(kvidx_lease(f.idx, BLK, &k, 100, 4, &li2, NULL), DI_ENOENT);
    cr_assert_eq(drain_deletes(&f), 1);
    kvidx_stats st;
    kvidx_get_stats(f.idx, &st);
    cr_assert_eq(st.corrupt_dropped, 1);
    cr_assert_eq(st.cls[BLK].objects, 0);
    teardown(&f);
}

Test(index, delete_waits_for_leases_and_blocks_reuse_until_done)
{
    fixture f;
    setup(&f, 1 << 20, 0);
    put(&f, HND, 1, 2500, 0);
    kvkey k = key_of(1);
    kvidx_lease_info li;
    cr_assert_eq(kvidx_lease(f.idx, HND, &k, 1000, 1, &li, NULL), DI_OK);
    cr_assert_eq(kvidx_delete(f.idx, HND, &k, 2, NULL), DI_OK);
    di_error e;
    cr_assert_eq(kvidx_delete(f.idx, HND, &k, 2, &e), DI_ENOENT);
    cr_assert_eq(drain_deletes(&f), 0, "leased: the disk delete waits");
    cr_assert(li.obj->has_slot, "the reader's slot is kept");
    uint64_t id;
    kvidx_obj *o;
    cr_assert_eq(kvidx_alloc(f.idx, HND, &k, 2500, 3, &id, &o, &e), DI_EBUSY);
    cr_assert_eq(kvidx_release(f.idx, li.lease_id, 4, NULL), DI_OK);
    kvidx_obj *q[4];
    cr_assert_eq(kvidx_take_disk_deletes(f.idx, q, 4), 1);
    kvidx_disk_deleted(f.idx, q[0], 0); /* failed (disk full): queued again */
    cr_assert_eq(kvidx_take_disk_deletes(f.idx, q, 4), 1);
    kvidx_disk_deleted(f.idx, q[0], 1);
    cr_assert_eq(kvidx_alloc(f.idx, HND, &k, 2500, 5, &id, &o, &e), DI_OK, "%s", e.msg);
    kvidx_abort(f.idx, id, NULL);
    teardown(&f);
}

Test(index, admin_evict_skips_leased_objects)
{
    fixture f;
    setup(&f, 1 << 20, 0);
    for (unsigned i = 0; i < 4; i++)
        put(&f, BLK, i, 1000, i);
    put(&f, WIN, 0, 2000, 5);
    kvkey k = key_of(2);
    kvidx_lease_info li;
    cr_assert_eq(kvidx_lease(f.idx, BLK, &k, 1000, 10, &li, NULL), DI_OK);
    uint64_t n, skipped;
    kvidx_evict(f.idx, 1u << BLK, 1, 11, &n, &skipped);
    cr_assert_eq(n, 3);
    cr_assert_eq(skipped, 1);
    int res;
    cr_assert(present(&f, BLK, 0, 12, &res));
    cr_assert_not(res);
    kvidx_evict(f.idx, (1u << BLK) | (1u << WIN), 0, 12, &n, &skipped);
    cr_assert_eq(n, 4);
    cr_assert_eq(skipped, 1);
    cr_assert(present(&f, BLK, 2, 13, NULL));
    cr_assert_eq(kvidx_release(f.idx, li.lease_id, 14, NULL), DI_OK);
    cr_assert_eq(drain_deletes(&f), 4);
    teardown(&f);
}

/* ------------------------------------------------------------------ restore */

Test(index, restore_orders_by_last_access_and_expires_old_objects)
{
    fixture f;
    setup(&f, 1 << 20, 1000);
    kvidx_restore_item it[3] = {
        {.cls = BLK, .key = key_of(1), .bytes = 1000, .last_access_ms = 5000},
        {.cls = BLK, .key = key_of(2), .bytes = 1000, .last_access_ms = 100},
        {.cls = WIN, .key = key_of(1), .bytes = 2000, .last_access_ms = 4500},
    };
    di_error e;
    cr_assert_eq(kvidx_restore(f.idx, it, 3, &e), DI_OK, "%s", e.msg);
    kvidx_check(f.idx);
    kvidx_sweep_report r;
    kvidx_sweep(f.idx, 5400, &r);
    cr_assert_eq(r.expired, 1, "only block 2 (last access 100) has expired at 5400");
    cr_assert(present(&f, BLK, 1, 5400, NULL));
    cr_assert_not(present(&f, WIN, 1, 5500, NULL));
    kvidx_restore_item dup = {.cls = BLK, .key = key_of(1), .bytes = 1000};
    cr_assert_eq(kvidx_restore(f.idx, &dup, 1, &e), DI_EEXIST);
    kvidx_restore_item bad = {.cls = BLK, .key = key_of(7), .bytes = 5000};
    cr_assert_eq(kvidx_restore(f.idx, &bad, 1, &e), DI_EINVAL);
    teardown(&f);
}

/* ------------------------------------------------------------------ random operations */

/* Random puts, leases, releases, deletes, sweeps, aborts and disk deletes with a moving clock,
 * checking every invariant after each step; at the end everything is released and deleted and
 * the slot and byte accounting must return to zero. */
Test(index, random_operations_keep_every_invariant)
{
    fixture f;
    setup(&f, 40000, 3000);
    uint64_t leases[16];
    int n_leases = 0;
    uint64_t allocs[16];
    int n_allocs = 0;
    uint64_t now = 0;
    for (uint32_t step = 0; step < 20000; step++) {
        float u = di_philox_uniform(7, step, 0);
        unsigned key = (unsigned)(di_philox_uniform(7, step, 1) * 60);
        int cls = (int)(di_philox_uniform(7, step, 2) * 3);
        uint64_t bytes = cls == BLK ? 1000 : cls == WIN ? 2000 : 100 + key * 40;
        kvkey k = key_of(key);
        now += (uint64_t)(di_philox_uniform(7, step, 3) * 40);
        kvidx_obj *o;
        if (u < 0.25 && n_allocs < 16) {
            uint64_t id;
            if (kvidx_alloc(f.idx, cls, &k, bytes, now, &id, &o, NULL) == DI_OK)
                allocs[n_allocs++] = id;
        } else if (u < 0.45 && n_allocs > 0) {
            uint64_t id = allocs[--n_allocs];
            if (kvidx_commit_begin(f.idx, id, now, &o, NULL) == DI_OK)
                kvidx_commit_end(f.idx, o, step % 13 != 0, step % 26 == 0, now);
        } else if (u < 0.5 && n_allocs > 0) {
            kvidx_abort(f.idx, allocs[--n_allocs], NULL);
        } else if (u < 0.65 && n_leases < 16) {
            kvidx_lease_info li;
            if (kvidx_lease(f.idx, cls, &k, 200, now, &li, NULL) == DI_OK) {
                if (li.need_load)
                    kvidx_load_done(f.idx, li.obj, (kvidx_load)(step % 17 == 0 ? 1 : step % 19 == 0 ? 2 : 0),
                                now);
                leases[n_leases++] = li.lease_id;
            }
        } else if (u < 0.8 && n_leases > 0) {
            kvidx_release(f.idx, leases[--n_leases], now, NULL);
        } else if (u < 0.85) {
            kvidx_delete(f.idx, cls, &k, now, NULL);
        } else if (u < 0.93) {
            kvidx_sweep(f.idx, now, NULL);
        } else {
            kvidx_obj *q[8];
            size_t n = kvidx_take_disk_deletes(f.idx, q, 8);
            for (size_t i = 0; i < n; i++)
                kvidx_disk_deleted(f.idx, q[i], step % 5 != 0);
        }
        kvidx_check(f.idx);
    }
    while (n_leases > 0)
        kvidx_release(f.idx, leases[--n_leases], now, NULL);
    while (n_allocs > 0)
        kvidx_abort(f.idx, allocs[--n_allocs], NULL);
    uint64_t ev, sk;
    kvidx_evict(f.idx, 7, 0, now, &ev, &sk);
    cr_assert_eq(sk, 0, "nothing pinned at the end");
    drain_deletes(&f);
    kvidx_stats st;
    kvidx_get_stats(f.idx, &st);
    cr_assert_eq(st.disk_used, 0);
    cr_assert_eq(st.disk_deleting, 0);
    for (int c = 0; c < 3; c++) {
        kvslab_class_stats ss;
        kvslab_stats(f.slab, c, &ss);
        cr_assert_eq(ss.used, 0, "class %d leaked %u slots", c, ss.used);
    }
    cr_assert_gt(st.commits, 100);
    cr_assert_gt(st.expirations + st.disk_evictions, 10);
    teardown(&f);
}

Test(index, a_corrupt_dram_copy_leaves_dram_with_its_last_reader_and_is_loaded_again)
{
    fixture f;
    setup(&f, 1 << 20, 0);
    put(&f, BLK, 1, 1000, 10);
    kvkey k = key_of(1);
    kvkey absent = key_of(2);
    cr_assert_null(kvidx_pin_resident(f.idx, BLK, &absent, 11));
    kvidx_lease_info held, li;
    di_error e;
    cr_assert_eq(kvidx_lease(f.idx, BLK, &k, 1000, 11, &held, &e), DI_OK, "%s", e.msg);
    cr_assert_not(held.need_load, "resident after its commit");
    kvidx_obj *o = kvidx_pin_resident(f.idx, BLK, &k, 12);
    cr_assert_eq(o, held.obj);
    cr_assert_eq(kvidx_dram_corrupt(f.idx, o), 1);
    kvidx_unpin(f.idx, o, 12);
    kvidx_check(f.idx);
    kvidx_stats st;
    kvidx_get_stats(f.idx, &st);
    cr_assert_eq(st.corrupt_dropped, 1);
    cr_assert_eq(st.cls[BLK].dram_objects, 0);
    cr_assert_eq(st.cls[BLK].objects, 1, "still on disk");
    int resident = 1;
    cr_assert(present(&f, BLK, 1, 12, &resident));
    cr_assert_not(resident);
    /* The holder still has the slot: new leases miss, a second report finds nothing. */
    kvslab_class_stats ss;
    kvslab_stats(f.slab, BLK, &ss);
    cr_assert_eq(ss.used, 1);
    cr_assert_eq(kvidx_lease(f.idx, BLK, &k, 1000, 13, &li, &e), DI_ENOENT);
    cr_assert_null(kvidx_pin_resident(f.idx, BLK, &k, 13));
    cr_assert_eq(kvidx_release(f.idx, held.lease_id, 14, &e), DI_OK, "%s", e.msg);
    kvidx_check(f.idx);
    kvslab_stats(f.slab, BLK, &ss);
    cr_assert_eq(ss.used, 0, "the slot went with the last reader");
    /* The next lease loads the disk copy into a fresh slot. */
    cr_assert_eq(kvidx_lease(f.idx, BLK, &k, 1000, 15, &li, &e), DI_OK, "%s", e.msg);
    cr_assert(li.need_load);
    kvidx_load_done(f.idx, li.obj, KVIDX_LOAD_OK, 15);
    cr_assert_eq(kvidx_release(f.idx, li.lease_id, 16, &e), DI_OK);
    kvidx_check(f.idx);
    /* Deleted while a reader holds the bad copy: the delete path frees the slot. */
    cr_assert_eq(kvidx_lease(f.idx, BLK, &k, 1000, 17, &held, &e), DI_OK);
    o = kvidx_pin_resident(f.idx, BLK, &k, 17);
    cr_assert_eq(kvidx_dram_corrupt(f.idx, o), 1);
    kvidx_unpin(f.idx, o, 17);
    cr_assert_eq(kvidx_delete(f.idx, BLK, &k, 18, &e), DI_OK);
    cr_assert_eq(kvidx_release(f.idx, held.lease_id, 19, &e), DI_OK);
    cr_assert_eq(drain_deletes(&f), 1);
    kvslab_stats(f.slab, BLK, &ss);
    cr_assert_eq(ss.used, 0);
    teardown(&f);
}
