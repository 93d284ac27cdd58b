/* transfer.c: the transfer thread (transfer.h). */
#include "common/serve/transfer.h"

#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "common/util/clock.h"

typedef struct xfer_job {
    xfer_done d;               /* what xfer_poll returns; attempts and status updated */
    uint32_t max_attempts;     /* calls before it fails */
    bool no_wait;              /* completes with DI_EUNAVAIL during a back-off */
    struct xfer_job *next;     /* in the queue, the done list or the free list */
} xfer_job;

/* A FIFO of jobs. */
typedef struct job_list {
    xfer_job *head, *tail;
} job_list;

struct xfer {
    xfer_config cfg;           /* copy */
    pthread_t thread;
    pthread_mutex_t mu;        /* guards everything below */
    pthread_cond_t work;       /* the thread: a job queued, a cancel, stop */
    pthread_cond_t idle;       /* xfer_wait: a job finished */
    xfer_job *pool;            /* [max_jobs] */
    xfer_job *free;            /* unused nodes */
    job_list queue;            /* waiting to run, oldest first (a retry goes back in front) */
    job_list done;             /* finished, not yet polled */
    xfer_job *running;         /* the job whose call is in progress, or NULL */
    uint64_t backoff_until;    /* no call before this (di_mono_ns) */
    uint64_t backoff_cur;      /* the current back-off (ns); 0 when the last call succeeded */
    bool stop;                 /* xfer_destroy asked the thread to end */
    xfer_stats stats;
};

static void push_back(job_list *l, xfer_job *j)
{
    j->next = NULL;
    if (l->tail)
        l->tail->next = j;
    else
        l->head = j;
    l->tail = j;
}

static void push_front(job_list *l, xfer_job *j)
{
    j->next = l->head;
    l->head = j;
    if (!l->tail)
        l->tail = j;
}

static xfer_job *pop_front(job_list *l)
{
    xfer_job *j = l->head;
    if (j) {
        l->head = j->next;
        if (!l->head)
            l->tail = NULL;
    }
    return j;
}

static struct timespec abs_time(uint64_t mono_ns)
{
    return (struct timespec){.tv_sec = (time_t)(mono_ns / 1000000000u),
                             .tv_nsec = (long)(mono_ns % 1000000000u)};
}

/* The job failed its latest call: back off, then retry it first or let it fail. */
static void after_failure(xfer *x, xfer_job *j)
{
    uint64_t b = x->backoff_cur ? x->backoff_cur * 2 : x->cfg.backoff_ns;
    if (b > x->cfg.max_backoff_ns || b < x->backoff_cur)
        b = x->cfg.max_backoff_ns;
    x->backoff_cur = b;
    x->backoff_until = di_mono_ns() + b;
    x->stats.backoffs++;
    if (j->d.attempts < j->max_attempts) {
        push_front(&x->queue, j);
        return;
    }
    x->stats.failed++;
    push_back(&x->done, j);
}

/* A back-off started or lasts: the no_wait jobs complete at once. */
static void skip_no_wait(xfer *x)
{
    job_list keep = {0};
    bool any = false;
    for (xfer_job *j; (j = pop_front(&x->queue));) {
        if (!j->no_wait) {
            push_back(&keep, j);
            continue;
        }
        if (j->d.attempts == 0) { /* else: its last call's failure */
            j->d.status = DI_EUNAVAIL;
            di_fail(&j->d.err, DI_EUNAVAIL, "the store is backing off after a failed call");
            x->stats.skipped++;
        } else {
            x->stats.failed++;
        }
        push_back(&x->done, j);
        any = true;
    }
    x->queue = keep;
    if (any)
        pthread_cond_broadcast(&x->idle);
    if (any && x->cfg.on_done) {
        pthread_mutex_unlock(&x->mu);
        x->cfg.on_done(x->cfg.on_done_ud);
        pthread_mutex_lock(&x->mu);
    }
}

static void *thread_main(void *arg)
{
    xfer *x = arg;
    pthread_mutex_lock(&x->mu);
    while (!x->stop) {
        if (!x->queue.head) {
            pthread_cond_wait(&x->work, &x->mu);
            continue;
        }
        uint64_t now = di_mono_ns();
        if (now < x->backoff_until) {
            skip_no_wait(x);
            if (!x->queue.head)
                continue;
            struct timespec ts = abs_time(x->backoff_until);
            pthread_cond_timedwait(&x->work, &x->mu, &ts);
            continue;
        }
        xfer_job *j = pop_front(&x->queue);
        x->running = j;
        if (j->d.attempts)
            x->stats.retries++;
        x->stats.calls++;
        pthread_mutex_unlock(&x->mu);
        di_error e = {0};
        di_status st = x->cfg.store.call(x->cfg.store.ctx, j->d.kind, j->d.request_id, j->d.job,
                                         &e);
        pthread_mutex_lock(&x->mu);
        x->running = NULL;
        j->d.attempts++;
        j->d.status = st;
        j->d.err = e;
        if (st == DI_OK) {
            x->backoff_cur = 0;
            x->stats.done_ok++;
            push_back(&x->done, j);
        } else {
            after_failure(x, j);
        }
        pthread_cond_broadcast(&x->idle);
        if (x->cfg.on_done && st != DI_OK && j->d.attempts < j->max_attempts)
            continue; /* queued again: nothing finished */
        if (x->cfg.on_done) {
            pthread_mutex_unlock(&x->mu);
            x->cfg.on_done(x->cfg.on_done_ud);
            pthread_mutex_lock(&x->mu);
        }
    }
    pthread_mutex_unlock(&x->mu);
    return NULL;
}

static di_status check_config(const xfer_config *c, di_error *err)
{
    if (!c || !c->store.call)
        return di_fail(err, DI_EINVAL, "transfer: the store's call is required");
    if (c->max_jobs == 0 || c->max_jobs > (1u << 24))
        return di_fail(err, DI_EINVAL, "transfer: max_jobs %u outside [1, 2^24]", c->max_jobs);
    if (c->max_attempts == 0)
        return di_fail(err, DI_EINVAL, "transfer: max_attempts must be at least 1");
    if (c->backoff_ns == 0 || c->max_backoff_ns < c->backoff_ns)
        return di_fail(err, DI_EINVAL, "transfer: back-off %llu ns and its maximum %llu ns "
                       "must satisfy 0 < backoff <= max",
                       (unsigned long long)c->backoff_ns, (unsigned long long)c->max_backoff_ns);
    return DI_OK;
}

di_status xfer_create(const xfer_config *cfg, xfer **out, di_error *err)
{
    di_status st = check_config(cfg, err);
    if (st != DI_OK)
        return st;
    if (!out)
        return di_fail(err, DI_EINVAL, "transfer: result is required");
    xfer *x = calloc(1, sizeof(*x));
    xfer_job *pool = calloc(cfg->max_jobs, sizeof(*pool));
    if (!x || !pool) {
        free(x);
        free(pool);
        return di_fail(err, DI_ENOMEM, "transfer queue of %u jobs", cfg->max_jobs);
    }
    x->cfg = *cfg;
    x->pool = pool;
    for (uint32_t i = cfg->max_jobs; i-- > 0;) {
        pool[i].next = x->free;
        x->free = &pool[i];
    }
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_mutex_init(&x->mu, NULL);
    pthread_cond_init(&x->work, &ca);
    pthread_cond_init(&x->idle, &ca);
    pthread_condattr_destroy(&ca);
    if (pthread_create(&x->thread, NULL, thread_main, x) != 0) {
        pthread_cond_destroy(&x->work);
        pthread_cond_destroy(&x->idle);
        pthread_mutex_destroy(&x->mu);
        free(pool);
        free(x);
        return di_fail(err, DI_EINTERNAL, "transfer: cannot start its thread");
    }
    *out = x;
    return DI_OK;
}

void xfer_destroy(xfer *x)
{
    if (!x)
        return;
    pthread_mutex_lock(&x->mu);
    x->stop = true;
    pthread_cond_broadcast(&x->work);
    pthread_mutex_unlock(&x->mu);
    pthread_join(x->thread, NULL);
    pthread_cond_destroy(&x->work);
    pthread_cond_destroy(&x->idle);
    pthread_mutex_destroy(&x->mu);
    free(x->pool);
    free(x);
}

di_status xfer_submit(xfer *x, xfer_kind kind, uint64_t request_id, void *job, di_error *err)
{
    return xfer_submit_opts(x, kind, request_id, job, NULL, err);
}

di_status xfer_submit_opts(xfer *x, xfer_kind kind, uint64_t request_id, void *job,
                           const xfer_job_opts *o, di_error *err)
{
    if (!x || !job)
        return di_fail(err, DI_EINVAL, "transfer submit: transfer and job are required");
    pthread_mutex_lock(&x->mu);
    xfer_job *j = x->free;
    if (!j) {
        pthread_mutex_unlock(&x->mu);
        return di_fail(err, DI_EFULL, "transfer queue full (%u jobs not yet polled)",
                       x->cfg.max_jobs);
    }
    x->free = j->next;
    *j = (xfer_job){.d = {.request_id = request_id, .kind = kind, .job = job},
                    .max_attempts = o && o->max_attempts ? o->max_attempts
                                                         : x->cfg.max_attempts,
                    .no_wait = o && o->no_wait};
    x->stats.submitted++;
    /* the last call failed and the back-off lasts, or the call that tries the store again is
     * in flight: a no_wait job does not queue behind it */
    if (j->no_wait && x->backoff_cur && (di_mono_ns() < x->backoff_until || x->running)) {
        j->d.status = DI_EUNAVAIL;
        di_fail(&j->d.err, DI_EUNAVAIL, "the store is backing off after a failed call");
        x->stats.skipped++;
        push_back(&x->done, j);
        pthread_mutex_unlock(&x->mu);
        return DI_OK;
    }
    push_back(&x->queue, j);
    pthread_cond_signal(&x->work);
    pthread_mutex_unlock(&x->mu);
    return DI_OK;
}

size_t xfer_poll(xfer *x, xfer_done *out, size_t max)
{
    size_t n = 0;
    pthread_mutex_lock(&x->mu);
    while (n < max && x->done.head) {
        xfer_job *j = pop_front(&x->done);
        out[n++] = j->d;
        j->next = x->free;
        x->free = j;
    }
    pthread_mutex_unlock(&x->mu);
    return n;
}

uint32_t xfer_cancel(xfer *x, uint64_t request_id)
{
    uint32_t n = 0;
    pthread_mutex_lock(&x->mu);
    job_list keep = {0};
    for (xfer_job *j; (j = pop_front(&x->queue));) {
        if (j->d.request_id != request_id) {
            push_back(&keep, j);
            continue;
        }
        j->d.status = DI_ECANCELED;
        di_fail(&j->d.err, DI_ECANCELED, "request %llu canceled", (unsigned long long)request_id);
        x->stats.canceled++;
        push_back(&x->done, j);
        n++;
    }
    x->queue = keep;
    pthread_cond_broadcast(&x->idle);
    pthread_mutex_unlock(&x->mu);
    return n;
}

di_status xfer_wait(xfer *x, uint64_t timeout_ns, di_error *err)
{
    struct timespec ts = abs_time(di_mono_ns() + timeout_ns);
    di_status st = DI_OK;
    pthread_mutex_lock(&x->mu);
    while ((x->queue.head || x->running) && st == DI_OK)
        if (pthread_cond_timedwait(&x->idle, &x->mu, &ts) != 0 && (x->queue.head || x->running))
            st = di_fail(err, DI_ETIMEDOUT, "transfer: jobs still running after %llu ms",
                         (unsigned long long)(timeout_ns / 1000000u));
    pthread_mutex_unlock(&x->mu);
    return st;
}

xfer_stats xfer_get_stats(xfer *x)
{
    pthread_mutex_lock(&x->mu);
    xfer_stats s = x->stats;
    uint32_t used = x->cfg.max_jobs;
    for (xfer_job *j = x->free; j; j = j->next)
        used--;
    s.pending = used;
    pthread_mutex_unlock(&x->mu);
    return s;
}
