/* The C twin of moe_experts' device bucketing (kernels/cpu/moe_bucket.h): a worked example,
 * the invariants on random routings, the group bound, and the refusals. */
#include <criterion/criterion.h>
#include <stdlib.h>
#include <string.h>

#include "common/util/philox.h"
#include "kernels/cpu/moe_bucket.h"

typedef struct arrays {
    uint32_t count[64], start[65], ge[4096], gs[4096], gr[4096];
    int32_t pair[4096], pos[4096];
    kern_moe_buckets b;
} arrays;

static void arrays_init(arrays *a)
{
    memset(a, 0xab, sizeof(*a));
    a->b = (kern_moe_buckets){a->count, a->start, a->pair, a->pos, a->ge, a->gs, a->gr, 0};
}

Test(moe_bucket, worked_example)
{
    /* rows: {2, 0}, {0, 1}, {2, 1}; cap 1 */
    const int32_t ids[] = {2, 0, 0, 1, 2, 1};
    arrays a;
    arrays_init(&a);
    di_error err;
    cr_assert_eq(kern_moe_bucket(ids, 3, 2, 3, 1, &a.b, &err), DI_OK, "%s", err.msg);
    const uint32_t count[] = {2, 2, 2}, start[] = {0, 2, 4, 6};
    const int32_t pair[] = {1, 2, 3, 5, 0, 4}; /* expert 0: pairs 1, 2; 1: 3, 5; 2: 0, 4 */
    const int32_t pos[] = {0, 4, 1, 2, 3, 5};  /* row 0: expert 0 (q 0), expert 2 (q 4) ... */
    cr_assert_arr_eq(a.count, count, sizeof(count));
    cr_assert_arr_eq(a.start, start, sizeof(start));
    cr_assert_arr_eq(a.pair, pair, sizeof(pair));
    cr_assert_arr_eq(a.pos, pos, sizeof(pos));
    cr_assert_eq(a.b.n_groups, 6);
    for (uint32_t g = 0; g < 6; g++) {
        cr_assert_eq(a.ge[g], g / 2);
        cr_assert_eq(a.gs[g], g);
        cr_assert_eq(a.gr[g], 1);
    }
    /* cap 2: one group per expert */
    arrays_init(&a);
    cr_assert_eq(kern_moe_bucket(ids, 3, 2, 3, 2, &a.b, &err), DI_OK);
    cr_assert_eq(a.b.n_groups, 3);
    cr_assert_eq(a.gr[0], 2);
    cr_assert_eq(a.gs[2], 4);
}

Test(moe_bucket, invariants_on_random_routings)
{
    di_rng rng;
    di_rng_init(&rng, 7);
    for (int it = 0; it < 200; it++) {
        uint32_t T = 1 + (uint32_t)di_rng_below(&rng, 64), K = 1 + (uint32_t)di_rng_below(&rng, 8);
        uint32_t E = 1 + (uint32_t)di_rng_below(&rng, 64), cap = 1 + (uint32_t)di_rng_below(&rng, 16);
        uint32_t P = T * K;
        int32_t ids[512];
        for (uint32_t i = 0; i < P; i++)
            ids[i] = (int32_t)di_rng_below(&rng, E);
        arrays a;
        arrays_init(&a);
        di_error err;
        cr_assert_eq(kern_moe_bucket(ids, T, K, E, cap, &a.b, &err), DI_OK, "%s", err.msg);
        cr_assert_eq(a.start[E], P);
        uint8_t seen[512] = {0};
        for (uint32_t q = 0; q < P; q++) {
            int32_t i = a.pair[q];
            cr_assert(i >= 0 && (uint32_t)i < P && !seen[i]);
            seen[i] = 1;
            uint32_t e = (uint32_t)ids[i];
            cr_assert(q >= a.start[e] && q < a.start[e + 1], "pair %d outside its bucket", i);
            if (q > a.start[e])
                cr_assert(a.pair[q - 1] < i, "pairs ascend inside a bucket");
        }
        for (uint32_t t = 0; t < T; t++)
            for (uint32_t j = 0; j < K; j++) {
                int32_t q = a.pos[t * K + j];
                cr_assert((uint32_t)a.pair[q] / K == t, "pos names another row's output");
                if (j)
                    cr_assert(a.pos[t * K + j - 1] < q, "a row's outputs ascend");
            }
        uint32_t covered = 0;
        for (uint32_t g = 0; g < a.b.n_groups; g++) {
            cr_assert(a.gr[g] >= 1 && a.gr[g] <= cap);
            cr_assert_eq(a.gs[g], covered, "groups tile the bucket order");
            cr_assert(a.gs[g] >= a.start[a.ge[g]] && a.gs[g] + a.gr[g] <= a.start[a.ge[g] + 1]);
            covered += a.gr[g];
        }
        cr_assert_eq(covered, P);
        cr_assert(a.b.n_groups <= kern_moe_max_groups(P, E, cap), "%u groups past the bound %u",
                  a.b.n_groups, kern_moe_max_groups(P, E, cap));
    }
}

Test(moe_bucket, bound_is_reached)
{
    /* one row of top-6 over 384 experts: 6 groups; 384 pairs: one group per expert at most; one
     * expert: the pairs in pieces of 8 */
    cr_assert_eq(kern_moe_max_groups(6, 384, 8), 6);
    cr_assert_eq(kern_moe_max_groups(384, 384, 8), 384);
    cr_assert_eq(kern_moe_max_groups(384, 1, 8), 48);
    cr_assert_eq(kern_moe_max_groups(5, 5, 0), 0);
}

Test(moe_bucket, refusals)
{
    const int32_t ids[] = {0, 3};
    arrays a;
    arrays_init(&a);
    di_error err;
    cr_assert_eq(kern_moe_bucket(ids, 1, 2, 3, 1, &a.b, &err), DI_EINVAL);
    cr_assert(strstr(err.msg, "ids[1] = 3") != NULL, "%s", err.msg);
    const int32_t neg[] = {-1};
    cr_assert_eq(kern_moe_bucket(neg, 1, 1, 3, 1, &a.b, &err), DI_EINVAL);
    cr_assert_eq(kern_moe_bucket(ids, 1, 2, 4, 0, &a.b, &err), DI_EINVAL);
}
