/* backend.h: the CPU backend, the C reference of every op in kernels/kernels.h.
 *
 * Readable first, reasonably fast second: blocked loops with fixed-order fp32 reductions
 * (16 lanes, then a fixed tree), a small thread pool that splits work by output rows or
 * columns only, so every value is computed the same way whatever the batch or thread count.
 */
#ifndef DI_KERNELS_CPU_BACKEND_H
#define DI_KERNELS_CPU_BACKEND_H

#include <stdint.h>

#include "common/util/status.h"
#include "kernels/kernels.h"

/* Fills *out with the CPU backend running n_threads workers (>= 1; 0 picks the number of
 * online processors). DI_EINVAL, DI_ENOMEM or DI_EINTERNAL; *out untouched on failure. */
di_status kern_cpu_create(uint32_t n_threads, kern_backend *out, di_error *err);
/* Releases what kern_cpu_create made and zeroes *be. NULL-safe, and safe on a zeroed struct. */
void kern_cpu_destroy(kern_backend *be);

#endif
