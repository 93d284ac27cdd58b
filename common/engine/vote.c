#include "common/engine/vote.h"

#include <assert.h>
#include <errno.h>
#include <pthread.h>
#include <time.h>

static di_status vote_local_same(void *ud, bool flag, bool *out, di_error *err)
{
    (void)ud;
    (void)err;
    *out = flag;
    return DI_OK;
}

vote vote_local(void)
{
    return (vote){vote_local_same, vote_local_same, vote_local_same, NULL, 0, 1};
}

typedef struct vote_member {
    vote_group *g;
    uint32_t rank;
} vote_member;

struct vote_group {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    uint32_t n;            /* ranks */
    uint32_t timeout_ms;   /* per wait, 0 = none */
    uint32_t arrived;      /* ranks in the current round */
    vote_reduce round_op;  /* op of the current round (valid while arrived > 0) */
    uint64_t acc;          /* running reduction of the current round */
    uint64_t result;       /* result of the last completed round */
    uint64_t gen;          /* completed rounds */
    bool cancelled;        /* the group failed */
    vote_member *members;  /* [n] userdata of each rank's vote struct */
    const di_alloc *alloc;
};

static const char *const vote_reduce_names[VOTE_REDUCE_COUNT] = {"all", "any", "max", "sum",
                                                                  "any_work"};

static uint64_t vote_combine(vote_reduce op, uint64_t acc, uint64_t v)
{
    switch (op) {
    case VOTE_REDUCE_AND:
        return acc && v;
    case VOTE_REDUCE_MAX:
        return v > acc ? v : acc;
    case VOTE_REDUCE_SUM:
        return acc + v;
    default:
        return acc || v;
    }
}

static uint64_t vote_identity(vote_reduce op)
{
    return op == VOTE_REDUCE_AND ? 1 : 0;
}

di_status vote_group_create(uint32_t n_ranks, uint32_t timeout_ms, const di_alloc *a,
                            vote_group **out, di_error *err)
{
    if (n_ranks == 0 || n_ranks > 4096)
        return di_fail(err, DI_EINVAL, "vote group of %u ranks outside [1, 4096]", n_ranks);
    vote_group *g = di_alloc_zero(a, 1, sizeof(*g));
    vote_member *m = di_alloc_zero(a, n_ranks, sizeof(*m));
    if (!g || !m) {
        di_alloc_release(a, g);
        di_alloc_release(a, m);
        return di_fail(err, DI_ENOMEM, "out of memory for a vote group of %u ranks", n_ranks);
    }
    if (pthread_mutex_init(&g->mu, NULL) != 0) {
        di_alloc_release(a, g);
        di_alloc_release(a, m);
        return di_fail(err, DI_EINTERNAL, "cannot create the vote group's mutex");
    }
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    int rc = pthread_cond_init(&g->cv, &ca);
    pthread_condattr_destroy(&ca);
    if (rc != 0) {
        pthread_mutex_destroy(&g->mu);
        di_alloc_release(a, g);
        di_alloc_release(a, m);
        return di_fail(err, DI_EINTERNAL, "cannot create the vote group's condition variable");
    }
    g->n = n_ranks;
    g->timeout_ms = timeout_ms;
    g->members = m;
    g->alloc = a;
    for (uint32_t r = 0; r < n_ranks; r++)
        m[r] = (vote_member){g, r};
    *out = g;
    return DI_OK;
}

void vote_group_destroy(vote_group *g)
{
    if (!g)
        return;
    pthread_cond_destroy(&g->cv);
    pthread_mutex_destroy(&g->mu);
    const di_alloc *a = g->alloc;
    di_alloc_release(a, g->members);
    di_alloc_release(a, g);
}

void vote_group_cancel(vote_group *g)
{
    pthread_mutex_lock(&g->mu);
    g->cancelled = true;
    pthread_cond_broadcast(&g->cv);
    pthread_mutex_unlock(&g->mu);
}

uint64_t vote_group_rounds(vote_group *g)
{
    pthread_mutex_lock(&g->mu);
    uint64_t r = g->gen;
    pthread_mutex_unlock(&g->mu);
    return r;
}

/* Waits, with g->mu held, until round `gen` completes or the group fails. */
static di_status vote_wait(vote_group *g, uint64_t gen, uint32_t rank, di_error *err)
{
    struct timespec deadline;
    if (g->timeout_ms) {
        clock_gettime(CLOCK_MONOTONIC, &deadline);
        deadline.tv_sec += g->timeout_ms / 1000;
        deadline.tv_nsec += (long)(g->timeout_ms % 1000) * 1000000L;
        if (deadline.tv_nsec >= 1000000000L) {
            deadline.tv_sec++;
            deadline.tv_nsec -= 1000000000L;
        }
    }
    while (g->gen == gen && !g->cancelled) {
        int rc = g->timeout_ms ? pthread_cond_timedwait(&g->cv, &g->mu, &deadline)
                               : pthread_cond_wait(&g->cv, &g->mu);
        if (rc == ETIMEDOUT && g->gen == gen) {
            g->cancelled = true;
            pthread_cond_broadcast(&g->cv);
            return di_fail(err, DI_ETIMEDOUT, "rank %u waited %u ms for %u of %u ranks", rank,
                           g->timeout_ms, g->n - g->arrived, g->n);
        }
    }
    if (g->gen == gen)
        return di_fail(err, DI_ECANCELED, "rank %u: the vote group was cancelled", rank);
    return DI_OK;
}

di_status vote_group_reduce(vote_group *g, uint32_t rank, vote_reduce op, uint64_t value,
                            uint64_t *out, di_error *err)
{
    if (rank >= g->n || (unsigned)op >= VOTE_REDUCE_COUNT)
        return di_fail(err, DI_EINVAL, "rank %u of %u, op %d", rank, g->n, (int)op);
    pthread_mutex_lock(&g->mu);
    if (g->cancelled) {
        pthread_mutex_unlock(&g->mu);
        return di_fail(err, DI_ECANCELED, "rank %u: the vote group was cancelled", rank);
    }
    if (g->arrived == 0) {
        g->round_op = op;
        g->acc = vote_identity(op);
    } else if (g->round_op != op) {
        vote_reduce other = g->round_op;
        g->cancelled = true;
        pthread_cond_broadcast(&g->cv);
        pthread_mutex_unlock(&g->mu);
        return di_fail(err, DI_EINTERNAL, "rank %u called %s() while other ranks called %s(): "
                       "the ranks lost lockstep", rank, vote_reduce_names[op],
                       vote_reduce_names[other]);
    }
    g->acc = vote_combine(op, g->acc, value);
    uint64_t gen = g->gen;
    di_status st = DI_OK;
    if (++g->arrived == g->n) {
        g->result = g->acc;
        g->arrived = 0;
        g->gen++;
        pthread_cond_broadcast(&g->cv);
    } else {
        st = vote_wait(g, gen, rank, err);
    }
    if (st == DI_OK)
        *out = g->result;
    pthread_mutex_unlock(&g->mu);
    return st;
}

static di_status vote_member_call(void *ud, vote_reduce op, bool flag, bool *out,
                                  di_error *err)
{
    vote_member *m = ud;
    uint64_t r;
    di_status st = vote_group_reduce(m->g, m->rank, op, flag ? 1 : 0, &r, err);
    if (st == DI_OK)
        *out = r != 0;
    return st;
}

static di_status vote_member_all(void *ud, bool flag, bool *out, di_error *err)
{
    return vote_member_call(ud, VOTE_REDUCE_AND, flag, out, err);
}

static di_status vote_member_any(void *ud, bool flag, bool *out, di_error *err)
{
    return vote_member_call(ud, VOTE_REDUCE_OR, flag, out, err);
}

static di_status vote_member_work(void *ud, bool flag, bool *out, di_error *err)
{
    return vote_member_call(ud, VOTE_REDUCE_WORK, flag, out, err);
}

vote vote_group_rank(vote_group *g, uint32_t rank)
{
    assert(rank < g->n);
    return (vote){vote_member_all, vote_member_any, vote_member_work, &g->members[rank], rank,
                  g->n};
}
