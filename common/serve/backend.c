/* backend.c: the backend table (backend.h). */
#include "common/serve/backend.h"

#include <string.h>

#include "kernels/cpu/backend.h"
#ifdef DI_HAVE_CUDA
#include "kernels/cuda/backend_cuda.h"
#endif

static di_status open_cpu(const serve_backend_options *o, kern_backend *be, di_error *err)
{
    return kern_cpu_create(o->threads, be, err);
}

#ifdef DI_HAVE_CUDA
static di_status open_cuda(const serve_backend_options *o, kern_backend *be, di_error *err)
{
    kern_cuda_config c = {.device = o->device, .batch_invariant = o->batch_invariant};
    return kern_cuda_create(&c, be, err);
}
#endif

/* One row per backend; open NULL: known, not in this build. */
static const struct {
    const char *name;
    di_status (*open)(const serve_backend_options *o, kern_backend *be, di_error *err);
    void (*close)(kern_backend *be);
    const char *label;   /* for messages */
    const char *missing; /* how to get it when it is not in this build */
} backends[] = {
    {"cpu", open_cpu, kern_cpu_destroy, "CPU", NULL},
#ifdef DI_HAVE_CUDA
    {"cuda", open_cuda, kern_cuda_destroy, "CUDA", NULL},
#else
    {"cuda", NULL, NULL, "CUDA", "(meson setup -Dcuda=enabled on a machine with nvcc)"},
#endif
};
#define N_BACKENDS (sizeof backends / sizeof backends[0])

static int row_of(const char *name)
{
    for (size_t i = 0; name && i < N_BACKENDS; i++)
        if (strcmp(backends[i].name, name) == 0)
            return (int)i;
    return -1;
}

di_status serve_backend_check(const char *name, di_error *err)
{
    int i = row_of(name);
    if (i < 0)
        return di_fail(err, DI_EINVAL, "'%s' is not cpu or cuda", name ? name : "");
    if (!backends[i].open)
        return di_fail(err, DI_EUNSUPPORTED, "this build has no %s backend %s",
                       backends[i].label, backends[i].missing);
    return DI_OK;
}

di_status serve_backend_open(const char *name, const serve_backend_options *opt,
                             kern_backend *be, di_error *err)
{
    di_status st = serve_backend_check(name, err);
    if (st != DI_OK)
        return st;
    memset(be, 0, sizeof(*be));
    serve_backend_options o = opt ? *opt : (serve_backend_options){.threads = 1};
    return backends[row_of(name)].open(&o, be, err);
}

void serve_backend_close(kern_backend *be)
{
    if (!be || !be->name)
        return;
    int i = row_of(be->name);
    if (i >= 0 && backends[i].close)
        backends[i].close(be);
}

di_status serve_backend_ep_ops(const kern_backend *be, kern_ep_ops *out, di_error *err)
{
    if (!be || !out)
        return di_fail(err, DI_EINVAL, "backend and output must not be NULL");
    if (!be->device_memory) {
        kern_ep_ops_host(out);
        return DI_OK;
    }
#ifdef DI_HAVE_CUDA
    return kern_ep_ops_cuda(be, out, err);
#else
    return di_fail(err, DI_EINVAL, "backend %s: no expert-parallel exchange in this build",
                   be->name ? be->name : "?");
#endif
}
