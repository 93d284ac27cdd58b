/* transfer.h: KV loads and stores on a thread of their own, so that no store call runs inside
 * an engine step.
 *
 * The engine thread submits jobs (a load of a request's cached prefix, a store of what a step
 * computed) and polls for the finished ones between steps; one transfer thread runs them, in
 * submission order, through the store's blocking call. With the engine loop (engine.h):
 *
 *   load:  engine_add(hold = true, kv_cached = the hit) -> xfer_submit(LOAD) -> ... steps go
 *          on ... -> xfer_poll: DI_OK -> engine_set_ready (the request runs, its KV in place);
 *          a failure -> that request alone fails (or is added again without the hit);
 *   store: xfer_submit(STORE) after the step that computed the KV; the step does not wait.
 *
 * Failures touch only the job's request. A failed call is retried after a back-off (first
 * backoff_ns, doubled up to max_backoff_ns; no store call at all while it lasts, so a store
 * that is down costs one call per back-off, not one per job); after max_attempts calls the job
 * completes with the store's error. A success ends the back-off. The store is never given up:
 * the next job after a back-off tries it again.
 *
 * Job lifecycle (each completes exactly once, through xfer_poll):
 *   QUEUED -> RUNNING (transfer thread) -> DONE (status of the last call)
 *   QUEUED -> DONE (DI_ECANCELED) by xfer_cancel of its request or by xfer_destroy
 *   QUEUED -> DONE (DI_EUNAVAIL) for a no_wait job while a back-off lasts
 * A RUNNING job is not interrupted: it completes with its call's outcome.
 *
 * Thread safety: xfer_submit, xfer_poll, xfer_cancel, xfer_wait and xfer_get_stats from one
 * engine thread; the store's call runs on the transfer thread only.
 */
#ifndef DI_SERVE_TRANSFER_H
#define DI_SERVE_TRANSFER_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/util/status.h"

typedef struct xfer xfer;

typedef enum xfer_kind {
    XFER_LOAD = 0, /* store -> the request's host buffers (imported into its blocks later) */
    XFER_STORE,    /* host copies of computed KV -> store */
} xfer_kind;

/* The store as the transfer thread calls it: one blocking call per attempt of a job. */
typedef struct xfer_store {
    void *ctx;
    /* Runs job `job` (the caller's object) of request `request_id`. DI_OK, or the failure that
     * makes this attempt fail (retried after a back-off while attempts remain). Its deadline
     * is the store client's. */
    di_status (*call)(void *ctx, xfer_kind kind, uint64_t request_id, void *job, di_error *err);
} xfer_store;

typedef struct xfer_config {
    xfer_store store;          /* call is required */
    uint32_t max_jobs;         /* queued + running + finished but not polled; >= 1 */
    uint32_t max_attempts;     /* calls per job before it fails; >= 1 */
    uint64_t backoff_ns;       /* first back-off after a failed call; > 0 */
    uint64_t max_backoff_ns;   /* the longest back-off; >= backoff_ns */
    void (*on_done)(void *ud); /* optional: called by the transfer thread (no lock held) after
                                  a job finished, so that the engine thread need not poll on a
                                  timer; it must not call into the xfer */
    void *on_done_ud;
} xfer_config;

/* A finished job. */
typedef struct xfer_done {
    uint64_t request_id;
    xfer_kind kind;
    void *job;                 /* as submitted */
    di_status status;          /* DI_OK, the store's last failure, or DI_ECANCELED */
    uint32_t attempts;         /* store calls made for it */
    di_error err;              /* the failure's message */
} xfer_done;

typedef struct xfer_stats {
    uint64_t submitted;        /* jobs accepted */
    uint64_t done_ok;          /* completed with DI_OK */
    uint64_t failed;           /* completed with the store's failure */
    uint64_t canceled;         /* completed with DI_ECANCELED */
    uint64_t calls;            /* store calls */
    uint64_t retries;          /* calls after a failed one of the same job */
    uint64_t backoffs;         /* back-offs started */
    uint64_t skipped;          /* no_wait jobs completed with DI_EUNAVAIL during a back-off */
    uint32_t pending;          /* jobs not yet polled */
} xfer_stats;

/* Starts the transfer thread. DI_OK; DI_EINVAL (config, naming the field); DI_ENOMEM;
 * DI_EINTERNAL (thread creation). *out untouched on failure. */
di_status xfer_create(const xfer_config *cfg, xfer **out, di_error *err);

/* Cancels the queued jobs, waits for a running one, stops the thread and frees everything.
 * Jobs not polled are dropped: poll first (xfer_wait, xfer_poll) to see them. NULL-safe. */
void xfer_destroy(xfer *x);

/* Queues a job. DI_OK; DI_EFULL (max_jobs jobs not yet polled); DI_EINVAL (job NULL). */
di_status xfer_submit(xfer *x, xfer_kind kind, uint64_t request_id, void *job, di_error *err);

/* What one job may cost the store, when it differs from the config. */
typedef struct xfer_job_opts {
    uint32_t max_attempts;     /* calls before it fails; 0 = the config's */
    bool no_wait;              /* during a back-off, and while the call that tries the store
                                  again after one is in flight, it completes at once with
                                  DI_EUNAVAIL instead of waiting (a prefix load: the request
                                  goes on without its hit rather than wait for the store) */
} xfer_job_opts;

/* xfer_submit with per-job options (o NULL: the config's). Same codes. */
di_status xfer_submit_opts(xfer *x, xfer_kind kind, uint64_t request_id, void *job,
                           const xfer_job_opts *o, di_error *err);

/* Copies up to max finished jobs into out (oldest first) and forgets them; never blocks.
 * Returns how many. */
size_t xfer_poll(xfer *x, xfer_done *out, size_t max);

/* Completes the queued jobs of request_id with DI_ECANCELED (an aborted request); a running
 * one completes with its call's outcome. Returns the number canceled. */
uint32_t xfer_cancel(xfer *x, uint64_t request_id);

/* Waits until every job submitted so far has finished (polled or not), or timeout_ns passes.
 * DI_OK; DI_ETIMEDOUT. */
di_status xfer_wait(xfer *x, uint64_t timeout_ns, di_error *err);

xfer_stats xfer_get_stats(xfer *x);

#endif
