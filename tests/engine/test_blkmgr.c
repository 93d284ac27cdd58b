#include <criterion/criterion.h>
#include <signal.h>

#include "common/engine/blkmgr.h"

static blkmgr *make(uint32_t n)
{
    blkmgr *bm = NULL;
    di_error e;
    cr_assert_eq(blkmgr_create(n, NULL, &bm, &e), DI_OK, "%s", e.msg);
    return bm;
}

static void check_owners(blkmgr *bm, const uint32_t *const *tables, const uint32_t *lens,
                         size_t n)
{
    di_error e;
    blkmgr_check_begin(bm);
    for (size_t i = 0; i < n; i++)
        blkmgr_check_owner(bm, tables[i], lens[i]);
    cr_assert_eq(blkmgr_check_end(bm, &e), DI_OK, "%s", e.msg);
}

Test(blkmgr, block_zero_never_handed_out)
{
    blkmgr *bm = make(9);
    cr_assert_eq(blkmgr_usable(bm), 8);
    uint32_t got[8];
    cr_assert_eq(blkmgr_alloc(bm, 8, got, NULL), DI_OK);
    for (uint32_t i = 0; i < 8; i++) {
        cr_assert_eq(got[i], i + 1, "allocation takes the head of the free list in order");
        cr_assert_eq(blkmgr_refcount(bm, got[i]), 1);
    }
    cr_assert_eq(blkmgr_free_count(bm), 0);
    di_error e;
    uint32_t one;
    cr_assert_eq(blkmgr_alloc(bm, 1, &one, &e), DI_EFULL);
    cr_assert(strstr(e.msg, "0 free"), "%s", e.msg);
    cr_assert_eq(blkmgr_refcount(bm, 0), 0);
    blkmgr_destroy(bm);
    blkmgr_destroy(NULL);
}

/* Explainer Pass 1: the free list says drawers 7 and 2 are free, so A's table becomes [7, 2]:
 * freed blocks go to the tail and come back in the order they were freed. */
Test(blkmgr, freed_blocks_return_at_the_tail)
{
    blkmgr *bm = make(9);
    uint32_t all[8];
    cr_assert_eq(blkmgr_alloc(bm, 8, all, NULL), DI_OK);
    uint32_t b7 = 7, b2 = 2;
    blkmgr_free(bm, &b7, 1);
    blkmgr_free(bm, &b2, 1);
    uint32_t a[2];
    cr_assert_eq(blkmgr_alloc(bm, 2, a, NULL), DI_OK);
    cr_assert_eq(a[0], 7);
    cr_assert_eq(a[1], 2);
    blkmgr_destroy(bm);
}

Test(blkmgr, all_or_nothing_allocation)
{
    blkmgr *bm = make(5);
    uint32_t got[4] = {0};
    cr_assert_eq(blkmgr_alloc(bm, 5, got, NULL), DI_EFULL);
    cr_assert_eq(blkmgr_free_count(bm), 4, "a failed allocation takes nothing");
    cr_assert_eq(got[0], 0, "output untouched");
    cr_assert_eq(blkmgr_alloc(bm, 0, got, NULL), DI_OK);
    blkmgr_destroy(bm);
}

Test(blkmgr, shared_block_freed_only_at_zero)
{
    blkmgr *bm = make(5);
    uint32_t b;
    cr_assert_eq(blkmgr_alloc(bm, 1, &b, NULL), DI_OK);
    blkmgr_share(bm, &b, 1);
    cr_assert_eq(blkmgr_refcount(bm, b), 2);
    blkmgr_free(bm, &b, 1);
    cr_assert_eq(blkmgr_free_count(bm), 3, "still owned once");
    cr_assert_eq(blkmgr_refcount(bm, b), 1);
    blkmgr_free(bm, &b, 1);
    cr_assert_eq(blkmgr_free_count(bm), 4);
    blkmgr_destroy(bm);
}

/* A parent with 300 positions of KV: blocks 0, 1 full (shared), block 2 partial (copied). */
Test(blkmgr, fork_shares_full_blocks_copies_the_partial)
{
    blkmgr *bm = make(16);
    uint32_t parent[3];
    cr_assert_eq(blkmgr_alloc(bm, 3, parent, NULL), DI_OK);
    uint32_t child[3] = {0};
    blkmgr_copy cp;
    cr_assert_eq(blkmgr_fork(bm, parent, 300, child, &cp, NULL), DI_OK);
    cr_assert_eq(child[0], parent[0]);
    cr_assert_eq(child[1], parent[1]);
    cr_assert_neq(child[2], parent[2]);
    cr_assert_eq(cp.src, parent[2]);
    cr_assert_eq(cp.dst, child[2]);
    cr_assert_eq(blkmgr_refcount(bm, parent[0]), 2);
    cr_assert_eq(blkmgr_refcount(bm, parent[2]), 1);
    cr_assert_eq(blkmgr_refcount(bm, child[2]), 1);
    const uint32_t *tables[2] = {parent, child};
    const uint32_t lens[2] = {3, 3};
    check_owners(bm, tables, lens, 2);
    blkmgr_free(bm, parent, 3);
    blkmgr_free(bm, child, 3);
    cr_assert_eq(blkmgr_free_count(bm), 15);
    check_owners(bm, NULL, NULL, 0);
    blkmgr_destroy(bm);
}

Test(blkmgr, fork_at_a_block_boundary_copies_nothing)
{
    blkmgr *bm = make(8);
    uint32_t parent[2], child[2];
    cr_assert_eq(blkmgr_alloc(bm, 2, parent, NULL), DI_OK);
    blkmgr_copy cp = {9, 9};
    cr_assert_eq(blkmgr_fork(bm, parent, 256, child, &cp, NULL), DI_OK);
    cr_assert_eq(cp.src, 0);
    cr_assert_eq(cp.dst, 0);
    cr_assert_eq(blkmgr_free_count(bm), 5, "no block taken");
    cr_assert_eq(blkmgr_refcount(bm, parent[1]), 2);
    blkmgr_destroy(bm);
}

Test(blkmgr, fork_without_a_free_block_changes_nothing)
{
    blkmgr *bm = make(3);
    uint32_t parent[2];
    cr_assert_eq(blkmgr_alloc(bm, 2, parent, NULL), DI_OK);
    uint32_t child[2] = {0, 0};
    blkmgr_copy cp = {5, 5};
    di_error e;
    cr_assert_eq(blkmgr_fork(bm, parent, 200, child, &cp, &e), DI_EFULL);
    cr_assert(strstr(e.msg, "fork"), "%s", e.msg);
    cr_assert_eq(blkmgr_refcount(bm, parent[0]), 1, "no share on failure");
    cr_assert_eq(cp.src, 5, "outputs untouched");
    cr_assert_eq(child[0], 0);
    blkmgr_destroy(bm);
}

Test(blkmgr, check_finds_leaks_and_miscounts)
{
    blkmgr *bm = make(6);
    uint32_t t[2];
    cr_assert_eq(blkmgr_alloc(bm, 2, t, NULL), DI_OK);
    di_error e;

    blkmgr_check_begin(bm); /* nobody claims the 2 blocks: leaked */
    cr_assert_eq(blkmgr_check_end(bm, &e), DI_EINTERNAL);
    cr_assert(strstr(e.msg, "leaked"), "%s", e.msg);

    blkmgr_check_begin(bm); /* two tables name t[0], its count is 1 */
    blkmgr_check_owner(bm, t, 2);
    blkmgr_check_owner(bm, t, 1);
    cr_assert_eq(blkmgr_check_end(bm, &e), DI_EINTERNAL);
    cr_assert(strstr(e.msg, "count 1 but 2 owners"), "%s", e.msg);

    uint32_t zero = 0;
    blkmgr_check_begin(bm); /* a table naming block 0 */
    blkmgr_check_owner(bm, t, 2);
    blkmgr_check_owner(bm, &zero, 1);
    cr_assert_eq(blkmgr_check_end(bm, &e), DI_EINTERNAL);
    cr_assert(strstr(e.msg, "block 0"), "%s", e.msg);

    uint32_t free_one = bm->ring[bm->head];
    blkmgr_check_begin(bm); /* a table naming a free block */
    blkmgr_check_owner(bm, t, 2);
    blkmgr_check_owner(bm, &free_one, 1);
    cr_assert_eq(blkmgr_check_end(bm, &e), DI_EINTERNAL);
    cr_assert(strstr(e.msg, "free block"), "%s", e.msg);

    bm->ring[(bm->head + 1) % 5] = bm->ring[bm->head]; /* a block twice on the free list */
    blkmgr_check_begin(bm);
    blkmgr_check_owner(bm, t, 2);
    cr_assert_eq(blkmgr_check_end(bm, &e), DI_EINTERNAL);
    cr_assert(strstr(e.msg, "twice"), "%s", e.msg);
    blkmgr_destroy(bm);
}

Test(blkmgr, double_free_aborts, .signal = SIGABRT)
{
    blkmgr *bm = make(4);
    uint32_t b;
    cr_assert_eq(blkmgr_alloc(bm, 1, &b, NULL), DI_OK);
    blkmgr_free(bm, &b, 1);
    blkmgr_free(bm, &b, 1);
}

Test(blkmgr, create_rejects_bad_sizes)
{
    blkmgr *bm = (blkmgr *)0x1;
    di_error e;
    cr_assert_eq(blkmgr_create(1, NULL, &bm, &e), DI_EINVAL);
    cr_assert(strstr(e.msg, "block 0 is reserved"), "%s", e.msg);
    cr_assert_eq(bm, (blkmgr *)0x1);
}

/* A long random mix of alloc, share and free keeps the pool whole. */
Test(blkmgr, random_churn_keeps_the_pool_whole)
{
    enum { N = 64, T = 16, CAP = 8 };
    blkmgr *bm = make(N);
    uint32_t tables[T][CAP];
    uint32_t lens[T] = {0};
    uint64_t x = 12345;
    for (int it = 0; it < 20000; it++) {
        x = x * 6364136223846793005ull + 1442695040888963407ull;
        uint32_t t = (uint32_t)(x >> 33) % T, op = (uint32_t)(x >> 40) % 3;
        if (op == 0 && lens[t] < CAP) {
            if (blkmgr_alloc(bm, 1, &tables[t][lens[t]], NULL) == DI_OK)
                lens[t]++;
        } else if (op == 1 && lens[t] == 0) {
            uint32_t src = (t + 1) % T;
            if (lens[src] && blkmgr_fork(bm, tables[src], lens[src] * 128 - 5, tables[t],
                                         &(blkmgr_copy){0}, NULL) == DI_OK)
                lens[t] = lens[src];
        } else if (lens[t]) {
            blkmgr_free(bm, tables[t], lens[t]);
            lens[t] = 0;
        }
        const uint32_t *tp[T];
        for (int i = 0; i < T; i++)
            tp[i] = tables[i];
        check_owners(bm, tp, lens, T);
    }
    for (int i = 0; i < T; i++)
        blkmgr_free(bm, tables[i], lens[i]);
    cr_assert_eq(blkmgr_free_count(bm), N - 1);
    blkmgr_destroy(bm);
}
