#include <criterion/criterion.h>
#include <pthread.h>

#include "common/engine/vote.h"

Test(vote, local_answers_with_the_flag)
{
    vote v = vote_local();
    bool out = false;
    cr_assert_eq(v.all(v.userdata, true, &out, NULL), DI_OK);
    cr_assert(out);
    cr_assert_eq(v.any(v.userdata, false, &out, NULL), DI_OK);
    cr_assert(!out);
    cr_assert_eq(v.any_work(v.userdata, true, &out, NULL), DI_OK);
    cr_assert(out);
    cr_assert_eq(v.n_ranks, 1);
}

enum { RANKS = 4, ROUNDS = 300 };

typedef struct rank_run {
    vote_group *g;
    uint32_t rank;
    bool all[ROUNDS], any[ROUNDS], work[ROUNDS];
    uint64_t max[ROUNDS], sum[ROUNDS];
    di_status st;
    di_error err;
} rank_run;

/* Each rank's flag in round i is a fixed function of (rank, i), so the expected answers can be
 * computed independently on the main thread. */
static bool flag_of(uint32_t rank, int i) { return ((i * 7 + rank * 3) % 5) != 0; }

static void *rank_main(void *arg)
{
    rank_run *r = arg;
    vote v = vote_group_rank(r->g, r->rank);
    for (int i = 0; i < ROUNDS && r->st == DI_OK; i++) {
        bool f = flag_of(r->rank, i);
        r->st = v.all(v.userdata, f, &r->all[i], &r->err);
        if (r->st == DI_OK)
            r->st = v.any(v.userdata, f && i % 3 == 0, &r->any[i], &r->err);
        if (r->st == DI_OK)
            r->st = v.any_work(v.userdata, r->rank == (uint32_t)(i % RANKS), &r->work[i],
                               &r->err);
        if (r->st == DI_OK)
            r->st = vote_group_reduce(r->g, r->rank, VOTE_REDUCE_MAX, r->rank * 10 + i,
                                      &r->max[i], &r->err);
        if (r->st == DI_OK)
            r->st = vote_group_reduce(r->g, r->rank, VOTE_REDUCE_SUM, r->rank + 1, &r->sum[i],
                                      &r->err);
    }
    if (r->st != DI_OK)
        vote_group_cancel(r->g);
    return NULL;
}

Test(vote, group_of_threads_reduces_like_an_all_reduce, .timeout = 30)
{
    vote_group *g = NULL;
    di_error e;
    cr_assert_eq(vote_group_create(RANKS, 10000, NULL, &g, &e), DI_OK, "%s", e.msg);
    static rank_run runs[RANKS];
    pthread_t th[RANKS];
    for (uint32_t r = 0; r < RANKS; r++) {
        runs[r] = (rank_run){.g = g, .rank = r};
        pthread_create(&th[r], NULL, rank_main, &runs[r]);
    }
    for (uint32_t r = 0; r < RANKS; r++)
        pthread_join(th[r], NULL);
    for (uint32_t r = 0; r < RANKS; r++)
        cr_assert_eq(runs[r].st, DI_OK, "rank %u: %s", r, runs[r].err.msg);
    for (int i = 0; i < ROUNDS; i++) {
        bool all = true, any = false;
        for (uint32_t r = 0; r < RANKS; r++) {
            all = all && flag_of(r, i);
            any = any || (flag_of(r, i) && i % 3 == 0);
        }
        for (uint32_t r = 0; r < RANKS; r++) {
            cr_assert_eq(runs[r].all[i], all, "round %d rank %u", i, r);
            cr_assert_eq(runs[r].any[i], any, "round %d rank %u", i, r);
            cr_assert(runs[r].work[i], "one rank has work each round");
            cr_assert_eq(runs[r].max[i], (RANKS - 1) * 10 + (uint64_t)i);
            cr_assert_eq(runs[r].sum[i], RANKS * (RANKS + 1) / 2);
        }
    }
    cr_assert_eq(vote_group_rounds(g), (uint64_t)ROUNDS * 5);
    vote_group_destroy(g);
}

typedef struct mixed_run {
    vote_group *g;
    uint32_t rank;
    di_status st;
    di_error err;
} mixed_run;

static void *mixed_main(void *arg)
{
    mixed_run *r = arg;
    vote v = vote_group_rank(r->g, r->rank);
    bool out;
    /* rank 0 asks all(), the others any(): lockstep is lost */
    r->st = r->rank == 0 ? v.all(v.userdata, true, &out, &r->err)
                         : v.any(v.userdata, true, &out, &r->err);
    return NULL;
}

Test(vote, ranks_calling_different_collectives_fail, .timeout = 30)
{
    vote_group *g = NULL;
    cr_assert_eq(vote_group_create(3, 10000, NULL, &g, NULL), DI_OK);
    mixed_run runs[3];
    pthread_t th[3];
    for (uint32_t r = 0; r < 3; r++) {
        runs[r] = (mixed_run){.g = g, .rank = r};
        pthread_create(&th[r], NULL, mixed_main, &runs[r]);
    }
    for (uint32_t r = 0; r < 3; r++)
        pthread_join(th[r], NULL);
    int internal = 0, cancelled = 0;
    for (uint32_t r = 0; r < 3; r++) {
        internal += runs[r].st == DI_EINTERNAL;
        cancelled += runs[r].st == DI_ECANCELED;
        if (runs[r].st == DI_EINTERNAL)
            cr_assert(strstr(runs[r].err.msg, "lockstep"), "%s", runs[r].err.msg);
    }
    cr_assert_eq(internal, 1, "the rank that found the mismatch");
    cr_assert_eq(internal + cancelled, 3, "nobody waits forever");
    bool out;
    vote v = vote_group_rank(g, 0);
    cr_assert_eq(v.any(v.userdata, true, &out, NULL), DI_ECANCELED, "the group stays failed");
    vote_group_destroy(g);
}

Test(vote, a_missing_rank_times_out, .timeout = 30)
{
    vote_group *g = NULL;
    cr_assert_eq(vote_group_create(2, 50, NULL, &g, NULL), DI_OK);
    vote v = vote_group_rank(g, 0);
    bool out = true;
    di_error e;
    cr_assert_eq(v.all(v.userdata, true, &out, &e), DI_ETIMEDOUT);
    cr_assert(strstr(e.msg, "1 of 2 ranks"), "%s", e.msg);
    cr_assert_eq(v.all(v.userdata, true, &out, &e), DI_ECANCELED);
    vote_group_destroy(g);
}

Test(vote, single_rank_group_and_bad_arguments)
{
    vote_group *g = NULL;
    di_error e;
    cr_assert_eq(vote_group_create(0, 0, NULL, &g, &e), DI_EINVAL);
    cr_assert_null(g);
    cr_assert_eq(vote_group_create(1, 0, NULL, &g, &e), DI_OK);
    uint64_t out;
    cr_assert_eq(vote_group_reduce(g, 0, VOTE_REDUCE_MAX, 42, &out, &e), DI_OK);
    cr_assert_eq(out, 42);
    cr_assert_eq(vote_group_reduce(g, 1, VOTE_REDUCE_MAX, 42, &out, &e), DI_EINVAL);
    vote_group_destroy(g);
    vote_group_destroy(NULL);
}
