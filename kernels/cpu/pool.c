#include "kernels/cpu/pool.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdlib.h>

#include "common/util/clock.h"

/* How long a thread polls before it sleeps on the condition variable: a decode step runs
 * hundreds of short ops, and a sleep/wake pair per op costs more than the op. Short, so an
 * idle pool, or one sharing its cores with other processes, does not burn a core. */
#define POOL_SPIN_NS 20000

struct kpool {
    uint32_t n_workers;         /* threads including the caller */
    pthread_t *threads;         /* [n_workers - 1] */
    pthread_mutex_t mu;
    pthread_cond_t wake;        /* signalled when a new run starts or on shutdown */
    pthread_cond_t done;        /* signalled when the last worker leaves a run */
    atomic_uint_fast64_t generation; /* run counter; written under mu with release order */
    atomic_int stop;            /* shutdown requested */
    atomic_uint busy;           /* helper threads still inside the current run */
    kpool_fn fn;                /* current run, published by the generation increment */
    void *arg;
    uint32_t n_tasks;
    atomic_uint next;           /* next task index to hand out */
};

typedef struct worker_arg {
    kpool *pool;
    uint32_t index;
} worker_arg;

static inline void cpu_relax(void)
{
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}

static void drain(kpool *p, uint32_t worker)
{
    for (;;) {
        uint32_t t = atomic_fetch_add(&p->next, 1);
        if (t >= p->n_tasks)
            return;
        p->fn(p->arg, t, worker);
    }
}

/* Polls `done(p, ctx)` for up to POOL_SPIN_NS; true when it became true. */
static bool spin_until(bool (*done)(kpool *, uint64_t), kpool *p, uint64_t ctx)
{
    uint64_t start = di_mono_ns();
    for (uint32_t i = 0;; i++) {
        if (done(p, ctx))
            return true;
        cpu_relax();
        if ((i & 63) == 63 && di_mono_ns() - start > POOL_SPIN_NS)
            return false;
    }
}

static bool new_run(kpool *p, uint64_t seen)
{
    return atomic_load_explicit(&p->generation, memory_order_acquire) != seen ||
           atomic_load(&p->stop);
}

static bool helpers_done(kpool *p, uint64_t unused)
{
    (void)unused;
    return atomic_load(&p->busy) == 0;
}

/* Waits for a generation other than `seen` (or shutdown): polls, then sleeps. */
static uint64_t await_run(kpool *p, uint64_t seen)
{
    if (spin_until(new_run, p, seen))
        return atomic_load_explicit(&p->generation, memory_order_acquire);
    pthread_mutex_lock(&p->mu);
    uint64_t g;
    while ((g = atomic_load_explicit(&p->generation, memory_order_acquire)) == seen &&
           !atomic_load(&p->stop))
        pthread_cond_wait(&p->wake, &p->mu);
    pthread_mutex_unlock(&p->mu);
    return g;
}

static void *worker_main(void *varg)
{
    worker_arg *wa = varg;
    kpool *p = wa->pool;
    uint32_t index = wa->index;
    free(wa);
    uint64_t seen = 0;
    for (;;) {
        seen = await_run(p, seen);
        if (atomic_load(&p->stop))
            break;
        drain(p, index);
        if (atomic_fetch_sub(&p->busy, 1) == 1) {
            pthread_mutex_lock(&p->mu);
            pthread_cond_signal(&p->done);
            pthread_mutex_unlock(&p->mu);
        }
    }
    return NULL;
}

di_status kpool_create(uint32_t n_workers, kpool **out, di_error *err)
{
    if (n_workers == 0)
        return di_fail(err, DI_EINVAL, "thread count must be at least 1");
    kpool *p = calloc(1, sizeof(*p));
    if (!p)
        return di_fail(err, DI_ENOMEM, "thread pool");
    p->n_workers = n_workers;
    pthread_mutex_init(&p->mu, NULL);
    pthread_cond_init(&p->wake, NULL);
    pthread_cond_init(&p->done, NULL);
    atomic_init(&p->generation, 0);
    atomic_init(&p->stop, 0);
    atomic_init(&p->busy, 0);
    atomic_init(&p->next, 0);
    if (n_workers > 1) {
        p->threads = calloc(n_workers - 1, sizeof(pthread_t));
        if (!p->threads) {
            kpool_destroy(p);
            return di_fail(err, DI_ENOMEM, "thread pool");
        }
    }
    for (uint32_t i = 1; i < n_workers; i++) {
        worker_arg *wa = malloc(sizeof(*wa));
        if (!wa) {
            p->n_workers = i;
            kpool_destroy(p);
            return di_fail(err, DI_ENOMEM, "thread pool");
        }
        wa->pool = p;
        wa->index = i;
        if (pthread_create(&p->threads[i - 1], NULL, worker_main, wa) != 0) {
            free(wa);
            p->n_workers = i;
            kpool_destroy(p);
            return di_fail(err, DI_EINTERNAL, "cannot start worker thread %u", i);
        }
    }
    *out = p;
    return DI_OK;
}

void kpool_destroy(kpool *p)
{
    if (!p)
        return;
    pthread_mutex_lock(&p->mu);
    atomic_store(&p->stop, 1);
    pthread_cond_broadcast(&p->wake);
    pthread_mutex_unlock(&p->mu);
    for (uint32_t i = 1; i < p->n_workers; i++)
        pthread_join(p->threads[i - 1], NULL);
    free(p->threads);
    pthread_mutex_destroy(&p->mu);
    pthread_cond_destroy(&p->wake);
    pthread_cond_destroy(&p->done);
    free(p);
}

uint32_t kpool_workers(const kpool *p)
{
    return p->n_workers;
}

void kpool_run(kpool *p, uint32_t n, kpool_fn fn, void *arg)
{
    if (n == 0)
        return;
    if (p->n_workers == 1 || n == 1) {
        for (uint32_t t = 0; t < n; t++)
            fn(arg, t, 0);
        return;
    }
    pthread_mutex_lock(&p->mu);
    p->fn = fn;
    p->arg = arg;
    p->n_tasks = n;
    atomic_store(&p->next, 0);
    atomic_store(&p->busy, p->n_workers - 1);
    atomic_fetch_add_explicit(&p->generation, 1, memory_order_release);
    pthread_cond_broadcast(&p->wake);
    pthread_mutex_unlock(&p->mu);
    drain(p, 0);
    if (!spin_until(helpers_done, p, 0)) {
        pthread_mutex_lock(&p->mu);
        while (atomic_load(&p->busy) > 0)
            pthread_cond_wait(&p->done, &p->mu);
        pthread_mutex_unlock(&p->mu);
    }
}
