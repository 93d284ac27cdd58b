/* embed.cu: input embedding expanded to the hyper-connection copies (kern_embed; C twin:
 * kernels/cpu/ops_basic.c, cpu_embed): out[t, c, :] = table[ids[t], :]. Exact (a copy).
 * Ids from the host are checked there; ids already in device memory (ids_dev, one step ahead)
 * are checked by the kernel: an id outside the vocabulary gives a zero row and raises the
 * backend's error flag (reported at the next synchronisation). */
#include <cuda_runtime.h>
#include <stdint.h>

#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/cuda_internal.h"

/* ---- kernel: block (t, c) copies one table row into copy c of row t ---- */

__global__ void embed_kernel(const int32_t *ids, const uint16_t *table, uint16_t *out,
                             uint32_t dim, uint32_t n_copies, uint32_t vocab, int *error)
{
    const int32_t id = ids[blockIdx.x];
    uint16_t *dst = out + ((size_t)blockIdx.x * n_copies + blockIdx.y) * dim;
    if (id < 0 || (uint32_t)id >= vocab) { /* only ids_dev can get here */
        if (threadIdx.x == 0 && error)
            atomicOr(error, CUDA_ERR_DEV_ID);
        for (uint32_t i = threadIdx.x; i < dim; i += blockDim.x)
            dst[i] = 0;
        return;
    }
    const uint16_t *src = table + (size_t)id * dim;
    for (uint32_t i = threadIdx.x; i < dim; i += blockDim.x)
        dst[i] = src[i];
}

/* ---- launcher: ids checked on the host and uploaded to dev_ids, or ids_dev ---- */

static di_status launch_embed(cuda_ctx *c, const kern_embed *p, const int32_t *dev_ids,
                              cudaStream_t stream)
{
    dim3 grid(p->n_rows, p->n_copies);
    cuda_launch(c, "embed_kernel", embed_kernel, grid, CUDA_THREADS, 0, stream, dev_ids, p->table,
                p->out, p->dim, p->n_copies, p->vocab, c->err_flag_dev);
    return cuda_launched(c, "embed_kernel");
}

/* ---- table entry ---- */

di_status cuda_op_embed(void *ctx, const kern_embed *p)
{
    cuda_ctx *c = (cuda_ctx *)ctx;
    di_status st = cuda_op_begin(c, p, "embed");
    if (st != DI_OK)
        return st;
    if (p->n_rows == 0 || p->n_copies == 0 || p->dim == 0)
        return DI_OK;
    if ((!p->ids && !p->ids_dev) || !p->table || !p->out)
        return cuda_fail(c, DI_EINVAL, "embed: ids, table or out is NULL");
    if (p->n_rows > 0x7fffffffu || p->n_copies > 65535)
        return cuda_fail(c, DI_EINVAL, "embed: %u rows x %u copies is too many for one launch",
                         p->n_rows, p->n_copies);
    if (p->ids_dev)
        return launch_embed(c, p, p->ids_dev, c->stream);
    for (uint32_t t = 0; t < p->n_rows; t++)
        if (p->ids[t] < 0 || (uint32_t)p->ids[t] >= p->vocab)
            return cuda_fail(c, DI_EINVAL, "embed: ids[%u] = %d outside [0, %u)", t, p->ids[t],
                             p->vocab);
    uint8_t *scratch;
    size_t bytes = (size_t)p->n_rows * sizeof(int32_t);
    st = cuda_scratch(c, bytes, &scratch);
    if (st == DI_OK)
        st = cuda_upload(c, scratch, p->ids, bytes);
    if (st != DI_OK)
        return st;
    return launch_embed(c, p, (const int32_t *)scratch, c->stream);
}
