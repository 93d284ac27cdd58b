/* pool.h: a fixed set of worker threads that run independent tasks of one op.
 *
 * kpool_run(pool, n, fn, arg) calls fn(arg, task, worker) once for every task in [0, n) and
 * returns when all have finished. Tasks are handed out in index order to whichever worker is
 * free; an op must make each task write its own outputs only, so results never depend on the
 * number of workers or on which worker ran a task. `worker` (0 .. n_workers-1) indexes
 * per-worker scratch. The calling thread is worker 0. Not reentrant: one run at a time.
 */
#ifndef DI_KERNELS_CPU_POOL_H
#define DI_KERNELS_CPU_POOL_H

#include <stdint.h>

#include "common/util/status.h"

typedef struct kpool kpool;

typedef void (*kpool_fn)(void *arg, uint32_t task, uint32_t worker);

/* Starts n_workers - 1 threads (n_workers >= 1). DI_ENOMEM or DI_EINTERNAL when a thread
 * cannot start; *out is left untouched then. */
di_status kpool_create(uint32_t n_workers, kpool **out, di_error *err);
/* Stops and joins the workers. NULL-safe. */
void kpool_destroy(kpool *pool);
uint32_t kpool_workers(const kpool *pool);
/* Runs the tasks; returns after the last one. n == 0 returns at once. */
void kpool_run(kpool *pool, uint32_t n, kpool_fn fn, void *arg);

#endif
