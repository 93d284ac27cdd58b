/* backend.h: the kernel backends by name, chosen at run time ("cpu", and "cuda" in a build with
 * CUDA). One table here, so no caller carries backend #ifdefs. */
#ifndef DI_SERVE_BACKEND_H
#define DI_SERVE_BACKEND_H

#include <stdint.h>

#include "common/util/status.h"
#include "kernels/kern_ep.h"
#include "kernels/kernels.h"

typedef struct serve_backend_options {
    uint32_t threads; /* cpu: worker threads (>= 1) */
    int device;       /* cuda: device ordinal */
    int batch_invariant; /* cuda: batch-invariant mode (the CPU backend always is) */
} serve_backend_options;

/* DI_OK when this build has a backend called name; DI_EUNSUPPORTED for a known backend this
 * build lacks (how to get it in the message); DI_EINVAL for an unknown name (the known ones in
 * the message). */
di_status serve_backend_check(const char *name, di_error *err);

/* Opens backend `name` into *be. serve_backend_check's codes, or the backend's own. *be stays
 * zeroed on failure. */
di_status serve_backend_open(const char *name, const serve_backend_options *opt,
                             kern_backend *be, di_error *err);

/* Closes what serve_backend_open made (by be->name) and zeroes *be. NULL-safe, and safe on a
 * zeroed struct. */
void serve_backend_close(kern_backend *be);

/* The expert-parallel exchange ops of an open backend (kernels/kern_ep.h): the C twins on a
 * host-memory backend, the backend's own on a device. DI_EINVAL for a backend this build cannot
 * serve them for. */
di_status serve_backend_ep_ops(const kern_backend *be, kern_ep_ops *out, di_error *err);

#endif
