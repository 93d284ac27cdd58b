/* backend_cuda.cu: construction of the CUDA backend, its memory entries (alloc, free, to_host,
 * from_host), the device scratch, error recording and the capability query. The numeric ops
 * live one family per file (embed.cu, rmsnorm.cu, rope.cu, fakequant.cu, linear.cu, gemm.cu). */
#include <cuda_runtime.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "kernels/cpu/step_ahead.h"
#include "kernels/cuda/backend_cuda.h"
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/cuda_internal.h"

#ifndef DI_CUDA_ARCH
#define DI_CUDA_ARCH "?"
#endif

#define DEFAULT_WORKSPACE_BYTES ((size_t)32 << 20)
#define SCRATCH_ROUND ((size_t)1 << 20)

/* ---- the table's entries by name (the capability query reads the table through these) ---- */

#define KERN_OPS_FIELDS(XX)                                                                  \
    XX(alloc) XX(free) XX(to_host) XX(from_host) XX(embed) XX(rmsnorm) XX(rope) XX(hc_mixes) \
    XX(hc_collapse) XX(hc_expand) XX(linear_fp8) XX(linear_fp4) XX(linear_bf16) XX(head)     \
    XX(fakequant) XX(ring_store) XX(compress_pool) XX(compressed_store) XX(sparse_attn)      \
    XX(index_scores) XX(index_candidates) XX(index_topk) XX(moe_gate) XX(swiglu)             \
    XX(moe_experts) XX(engram_hash) XX(engram_lookup) XX(engram_gate) XX(copy_rows) XX(sample) \
    XX(step_ahead) XX(alloc_mapped) XX(free_mapped) XX(mark) XX(wait_mark)

typedef struct op_row {
    const char *name;           /* kern_ops field name */
    size_t offset;              /* offsetof(kern_ops, field) */
} op_row;

static const op_row op_rows[] = {
#define OP_ROW(f) {#f, offsetof(kern_ops, f)},
    KERN_OPS_FIELDS(OP_ROW)
#undef OP_ROW
};

typedef void (*any_fn)(void);
/* Every kern_ops field is a function pointer and every one has a row above. */
static_assert(sizeof(kern_ops) == sizeof(op_rows) / sizeof(op_rows[0]) * sizeof(any_fn),
              "op_rows must list every kern_ops field");

/* ---- device attributes ---- */

/* A device attribute, queried once into *cache (0 = not yet); fallback when the query fails. */
int cuda_device_attr(cuda_ctx *c, cudaDeviceAttr attr, int *cache, int fallback)
{
    if (*cache > 0)
        return *cache;
    int v = 0;
    if (cudaDeviceGetAttribute(&v, attr, c->device) != cudaSuccess || v <= 0) {
        cudaGetLastError();
        return fallback;
    }
    *cache = v;
    return v;
}

/* ---- errors ---- */

di_status cuda_fail(cuda_ctx *c, di_status code, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    di_status st = di_vfail(&c->last, code, fmt, ap);
    va_end(ap);
    return st;
}

di_status cuda_check(cuda_ctx *c, cudaError_t e, const char *what)
{
    return di_cuda_status(e, what, &c->last);
}

di_status cuda_launched(cuda_ctx *c, const char *kernel)
{
    return di_cuda_launch_status(kernel, &c->last);
}

di_status cuda_op_begin(cuda_ctx *c, const void *params, const char *op)
{
    if (c->pending != DI_OK) {
        di_status st = c->pending; /* its message is already in c->last */
        c->pending = DI_OK;
        return st;
    }
    if (!params)
        return cuda_fail(c, DI_EINVAL, "%s: params are NULL", op);
    di_status st = cuda_check(c, cudaSetDevice(c->device), "cudaSetDevice");
    if (st == DI_OK && c->prof)
        st = cuda_prof_mark(c, op);
    return st;
}

/* ---- memory ---- */

/* Grows one of the device buffers (scratch or work) to at least `bytes`. */
static di_status grow(cuda_ctx *c, uint8_t **buf, size_t *have, size_t bytes, const char *what)
{
    if (bytes <= *have && *buf)
        return DI_OK;
    size_t want = (bytes + SCRATCH_ROUND - 1) / SCRATCH_ROUND * SCRATCH_ROUND;
    /* queued ops may still use the old buffer */
    di_status st = cuda_graph_break(c);
    if (st == DI_OK)
        st = cuda_check(c, cudaStreamSynchronize(c->stream), "device buffer: cudaStreamSynchronize");
    if (st != DI_OK)
        return st;
    cuda_sync_check(c);
    if (*buf)
        cudaFree(*buf);
    *buf = NULL;
    *have = 0;
    void *p = NULL;
    cudaError_t e = cudaMalloc(&p, want);
    if (e != cudaSuccess) {
        cudaGetLastError(); /* not sticky: clear it */
        return cuda_fail(c, DI_ENOMEM, "device %s of %zu bytes: %s", what, want,
                         cudaGetErrorString(e));
    }
    *buf = (uint8_t *)p;
    *have = want;
    return cuda_graph_resume(c);
}

di_status cuda_scratch(cuda_ctx *c, size_t bytes, uint8_t **out)
{
    di_status st = grow(c, &c->scratch, &c->scratch_bytes, bytes, "scratch");
    c->stats.scratch_bytes = c->scratch_bytes;
    if (st == DI_OK)
        *out = c->scratch;
    return st;
}

di_status cuda_work(cuda_ctx *c, size_t bytes, uint8_t **out)
{
    di_status st = grow(c, &c->work, &c->work_bytes, bytes, "work buffer");
    if (st == DI_OK)
        *out = c->work;
    return st;
}

di_status cuda_download(cuda_ctx *c, void *dst, const void *src, size_t bytes)
{
    if (bytes == 0)
        return DI_OK;
    di_status st = cuda_graph_break(c);
    if (st == DI_OK)
        st = cuda_check(c, cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, c->stream),
                        "download: cudaMemcpyAsync");
    if (st == DI_OK)
        st = cuda_check(c, cudaStreamSynchronize(c->stream), "download: cudaStreamSynchronize");
    if (st == DI_OK)
        cuda_sync_check(c);
    if (st == DI_OK)
        st = cuda_graph_resume(c);
    return st;
}

/* ---- step metadata ---- */

void cuda_meta_reset(cuda_ctx *c)
{
    c->meta_len = 0;
}

di_status cuda_meta_push(cuda_ctx *c, const void *src, size_t bytes, size_t *off)
{
    size_t at = cuda_align_up(c->meta_len), end = at + bytes;
    if (end > c->meta_cap) {
        size_t cap = c->meta_cap ? c->meta_cap : 4096;
        while (cap < end)
            cap *= 2;
        uint8_t *m = (uint8_t *)realloc(c->meta, cap);
        if (!m)
            return cuda_fail(c, DI_ENOMEM, "host metadata of %zu bytes", cap);
        c->meta = m;
        c->meta_cap = cap;
    }
    memset(c->meta + c->meta_len, 0, at - c->meta_len);
    if (src)
        memcpy(c->meta + at, src, bytes);
    else
        memset(c->meta + at, 0, bytes);
    c->meta_len = end;
    *off = at;
    return DI_OK;
}

void *cuda_meta_at(cuda_ctx *c, size_t off)
{
    return c->meta + off;
}

di_status cuda_meta_upload(cuda_ctx *c, int to_work, size_t extra, uint8_t **dev,
                           uint8_t **extra_dev)
{
    size_t len = cuda_align_up(c->meta_len);
    uint8_t *base = NULL;
    di_status st = to_work ? cuda_work(c, len + extra, &base) : cuda_scratch(c, len + extra, &base);
    if (st != DI_OK)
        return st;
    st = cuda_upload(c, base, c->meta, c->meta_len); /* logged with the segment's uploads
                                                        * while graphs are on (graph.cu) */
    if (st != DI_OK)
        return st;
    *dev = base;
    if (extra_dev)
        *extra_dev = base + len;
    return DI_OK;
}

di_status cuda_meta_seqs(cuda_ctx *c, const char *what, const kern_seq *seqs, uint32_t n,
                         uint32_t rows, size_t *seq_off, size_t *table_off, size_t *row_seq_off)
{
    if (n && !seqs)
        return cuda_fail(c, DI_EINVAL, "%s: %u sequences but seqs is NULL", what, n);
    uint64_t tables = 0;
    for (uint32_t s = 0; s < n; s++) {
        if (seqs[s].n_blocks && !seqs[s].blocks)
            return cuda_fail(c, DI_EINVAL, "%s: sequence %u has %u blocks but no block table",
                             what, s, seqs[s].n_blocks);
        tables += seqs[s].n_blocks;
    }
    if (tables > 0xffffffffu)
        return cuda_fail(c, DI_EINVAL, "%s: %llu block-table entries", what,
                         (unsigned long long)tables);
    /* the table array padded to a power of two (at least 64 entries): a step whose sequences
     * grew by a block has the same metadata layout, so its graph is launched as it is */
    uint64_t table_cap = 64;
    while (table_cap < tables)
        table_cap *= 2;
    di_status st = cuda_meta_push(c, NULL, (size_t)n * sizeof(cuda_seq), seq_off);
    if (st == DI_OK)
        st = cuda_meta_push(c, NULL, (size_t)table_cap * sizeof(uint32_t), table_off);
    if (st == DI_OK && rows)
        st = cuda_meta_push(c, NULL, (size_t)rows * sizeof(int32_t), row_seq_off);
    if (st != DI_OK)
        return st;
    uint32_t t0 = 0;
    for (uint32_t s = 0; s < n; s++) {
        const kern_seq *k = &seqs[s];
        cuda_seq d;
        memset(&d, 0, sizeof(d));
        d.slot = k->slot;
        d.pos0 = k->pos0;
        d.window_lo = k->window_lo;
        d.row0 = k->row0;
        d.n_rows = k->n_rows;
        d.ring_hi = k->ring_hi;
        d.n_blocks = k->n_blocks;
        d.table0 = t0;
        memcpy((cuda_seq *)cuda_meta_at(c, *seq_off) + s, &d, sizeof(d));
        if (k->n_blocks)
            memcpy((uint32_t *)cuda_meta_at(c, *table_off) + t0, k->blocks,
                   (size_t)k->n_blocks * sizeof(uint32_t));
        t0 += k->n_blocks;
    }
    if (!rows)
        return DI_OK;
    int32_t *rs = (int32_t *)cuda_meta_at(c, *row_seq_off);
    for (uint32_t r = 0; r < rows; r++)
        rs[r] = -1;
    for (uint32_t s = 0; s < n; s++) {
        const kern_seq *k = &seqs[s];
        if ((uint64_t)k->row0 + k->n_rows > rows)
            return cuda_fail(c, DI_EINVAL, "%s: sequence %u has rows %u..%llu outside the %u rows",
                             what, s, k->row0, (unsigned long long)k->row0 + k->n_rows, rows);
        for (uint32_t r = k->row0; r < k->row0 + k->n_rows; r++) {
            if (rs[r] >= 0)
                return cuda_fail(c, DI_EINVAL, "%s: row %u belongs to sequences %d and %u", what,
                                 r, rs[r], s);
            rs[r] = (int32_t)s;
        }
    }
    for (uint32_t r = 0; r < rows; r++)
        if (rs[r] < 0)
            return cuda_fail(c, DI_EINVAL, "%s: row %u belongs to no sequence", what, r);
    return DI_OK;
}

static void *cuda_alloc(void *ctx, size_t bytes)
{
    cuda_ctx *c = (cuda_ctx *)ctx;
    if (cuda_check(c, cudaSetDevice(c->device), "alloc: cudaSetDevice") != DI_OK)
        return NULL;
    di_status gs = cuda_graph_break(c);
    if (gs != DI_OK) {
        c->pending = gs;
        return NULL;
    }
    size_t b = bytes ? bytes : 64;
    void *p = NULL;
    cudaError_t e = cudaMalloc(&p, b);
    if (e != cudaSuccess) {
        cudaGetLastError();
        cuda_fail(c, DI_ENOMEM, "alloc of %zu bytes: %s", b, cudaGetErrorString(e));
        return NULL;
    }
    if (cuda_check(c, cudaMemsetAsync(p, 0, b, c->stream), "alloc: cudaMemsetAsync") != DI_OK) {
        cudaFree(p);
        return NULL;
    }
    return p;
}

static void cuda_free_mem(void *ctx, void *p)
{
    cuda_ctx *c = (cuda_ctx *)ctx;
    if (!p)
        return;
    di_status st = cuda_check(c, cudaSetDevice(c->device), "free: cudaSetDevice");
    if (st == DI_OK)
        st = cuda_graph_break(c);
    if (st == DI_OK)
        st = cuda_check(c, cudaFree(p), "free: cudaFree");
    if (st != DI_OK)
        c->pending = st;
}

/* A copy on the stream, finished on return; cudaMemcpyDefault lets either side be host or
 * device memory. */
static void cuda_copy(cuda_ctx *c, void *dst, const void *src, size_t bytes, const char *what)
{
    if (bytes == 0)
        return;
    di_status st = cuda_check(c, cudaSetDevice(c->device), what);
    if (st == DI_OK)
        st = cuda_graph_break(c);
    if (st == DI_OK)
        st = cuda_check(c, cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, c->stream), what);
    if (st == DI_OK)
        st = cuda_check(c, cudaStreamSynchronize(c->stream), what);
    if (st != DI_OK)
        c->pending = st;
    else
        cuda_sync_check(c);
}

/* ---- mapped memory and marks (one step ahead) ---- */

static void *cuda_alloc_mapped(void *ctx, size_t bytes, void **host)
{
    cuda_ctx *c = (cuda_ctx *)ctx;
    void *h = NULL, *d = NULL;
    *host = NULL;
    if (cudaSetDevice(c->device) != cudaSuccess ||
        cudaHostAlloc(&h, bytes ? bytes : 1, cudaHostAllocMapped) != cudaSuccess) {
        cudaGetLastError();
        return NULL;
    }
    if (cudaHostGetDevicePointer(&d, h, 0) != cudaSuccess || d != h) { /* UVA: one address */
        cudaGetLastError();
        cudaFreeHost(h);
        return NULL;
    }
    memset(h, 0, bytes);
    *host = h;
    return d;
}

static void cuda_free_mapped(void *ctx, void *p)
{
    (void)ctx;
    if (p)
        cudaFreeHost(p);
}

/* A mark is an event recorded on the stream; the ring keeps the latest CUDA_MARKS. */
static di_status cuda_mark(void *ctx, uint64_t *mark)
{
    cuda_ctx *c = (cuda_ctx *)ctx;
    cudaEvent_t *ev = &c->marks[c->mark_next % CUDA_MARKS];
    di_status st = cuda_check(c, cudaSetDevice(c->device), "mark");
    if (st == DI_OK && !*ev)
        st = cuda_check(c, cudaEventCreateWithFlags(ev, cudaEventDisableTiming), "mark: event");
    if (st == DI_OK)
        st = cuda_graph_break(c); /* logged work is launched first */
    if (st == DI_OK)
        st = cuda_check(c, cudaEventRecord(*ev, c->stream), "mark: cudaEventRecord");
    if (st == DI_OK)
        st = cuda_graph_resume(c);
    if (st == DI_OK)
        *mark = c->mark_next++;
    return st;
}

static di_status cuda_wait_mark(void *ctx, uint64_t mark)
{
    cuda_ctx *c = (cuda_ctx *)ctx;
    di_status st = cuda_check(c, cudaSetDevice(c->device), "wait");
    if (st == DI_OK && (mark >= c->mark_next || mark + CUDA_MARKS < c->mark_next))
        st = cuda_check(c, cudaStreamSynchronize(c->stream), "wait: cudaStreamSynchronize");
    else if (st == DI_OK)
        st = cuda_check(c, cudaEventSynchronize(c->marks[mark % CUDA_MARKS]),
                        "wait: cudaEventSynchronize");
    if (st != DI_OK)
        return st;
    cuda_sync_check(c);
    st = c->pending;
    c->pending = DI_OK;
    return st;
}

static void cuda_to_host(void *ctx, void *dst, const void *src, size_t bytes)
{
    cuda_copy((cuda_ctx *)ctx, dst, src, bytes, "to_host");
}

static void cuda_from_host(void *ctx, void *dst, const void *src, size_t bytes)
{
    cuda_copy((cuda_ctx *)ctx, dst, src, bytes, "from_host");
}

/* ---- the table's op entries: each op between the graph hooks (graph.cu), its host time
 * counted ---- */

static uint64_t host_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

#define OP_ENTRY(op, type, rows)                                                     \
    static di_status entry_##op(void *ctx, const type *p)                            \
    {                                                                                \
        cuda_ctx *c = (cuda_ctx *)ctx;                                               \
        uint64_t t0 = host_ns();                                                     \
        di_status st = cuda_graph_op_enter(c, #op, p ? (uint64_t)p->rows : 0);       \
        if (st == DI_OK)                                                             \
            st = cuda_op_##op(ctx, p);                                               \
        cuda_graph_op_leave(c, st);                                                  \
        c->stats.op_host_ns += host_ns() - t0;                                       \
        return st;                                                                   \
    }
OP_ENTRY(embed, kern_embed, n_rows)
OP_ENTRY(rmsnorm, kern_rmsnorm, n_rows)
OP_ENTRY(rope, kern_rope, n_rows)
OP_ENTRY(fakequant, kern_fakequant, n_rows)
OP_ENTRY(linear_fp8, kern_linear, m)
OP_ENTRY(linear_fp4, kern_linear, m)
OP_ENTRY(linear_bf16, kern_linear, m)
OP_ENTRY(head, kern_linear, m)
OP_ENTRY(hc_mixes, kern_hc_mixes, n_rows)
OP_ENTRY(hc_collapse, kern_hc_collapse, n_rows)
OP_ENTRY(hc_expand, kern_hc_expand, n_rows)
OP_ENTRY(copy_rows, kern_copy_rows, n_rows)
OP_ENTRY(sample, kern_sample, n_rows)
OP_ENTRY(ring_store, kern_ring_store, n_rows)
OP_ENTRY(compress_pool, kern_compress_pool, n_rows)
OP_ENTRY(compressed_store, kern_compressed_store, n_entries)
OP_ENTRY(sparse_attn, kern_sparse_attn, n_rows)
OP_ENTRY(index_scores, kern_index_scores, n_rows)
OP_ENTRY(index_candidates, kern_index_candidates, n_rows)
OP_ENTRY(index_topk, kern_index_topk, n_rows)
OP_ENTRY(moe_gate, kern_moe_gate, n_rows)
OP_ENTRY(swiglu, kern_swiglu, n_rows)
OP_ENTRY(moe_experts, kern_moe_experts, n_rows)
OP_ENTRY(engram_hash, kern_engram_hash, n_rows)
OP_ENTRY(engram_lookup, kern_engram_lookup, n_rows)
OP_ENTRY(engram_gate, kern_engram_gate, n_rows)
#undef OP_ENTRY

/* kern_cuda_step_ahead brings its own graph hooks; the failure message is in c->last. */
static di_status entry_step_ahead(void *ctx, const kern_step_ahead *p)
{
    cuda_ctx *c = (cuda_ctx *)ctx;
    uint64_t t0 = host_ns();
    kern_backend be = {};
    be.ctx = ctx;
    di_status st = kern_cuda_step_ahead(&be, p, NULL);
    c->stats.op_host_ns += host_ns() - t0;
    return st;
}

/* ---- construction ---- */

/* A kernel that does nothing: asking for its attributes tells whether this build carries code
 * for the device. */
__global__ void cuda_probe_kernel(void)
{
}

static void ctx_release(cuda_ctx *c)
{
    if (!c)
        return;
    cudaSetDevice(c->device);
    cuda_graph_release(c);
    if (c->stream)
        cudaStreamSynchronize(c->stream);
    for (int i = 0; i < CUDA_EXPERT_TABLES; i++) {
        if (c->experts[i].dev)
            cudaFree(c->experts[i].dev);
        free(c->experts[i].copy);
    }
    if (c->err_flag)
        cudaFreeHost(c->err_flag);
    if (c->tmap_dev)
        cudaFree(c->tmap_dev);
    for (int i = 0; i < CUDA_MARKS; i++)
        if (c->marks[i])
            cudaEventDestroy(c->marks[i]);
    free(c->tmap_host);
    cuda_prof_free(c);
    cuda_gemm_release(c);
    if (c->scratch)
        cudaFree(c->scratch);
    if (c->work)
        cudaFree(c->work);
    if (c->workspace)
        cudaFree(c->workspace);
    if (c->lt)
        cublasLtDestroy(c->lt);
    if (c->stream)
        cudaStreamDestroy(c->stream);
    free(c->stage);
    free(c->meta);
    free(c);
}

static di_status check_device(int device, di_error *err)
{
    cudaFuncAttributes attr;
    cudaError_t e = cudaFuncGetAttributes(&attr, cuda_probe_kernel);
    if (e == cudaSuccess)
        return DI_OK;
    cudaGetLastError();
    cudaDeviceProp prop;
    int major = 0, minor = 0;
    if (cudaGetDeviceProperties(&prop, device) == cudaSuccess) {
        major = prop.major;
        minor = prop.minor;
    }
    if (e == cudaErrorNoKernelImageForDevice || e == cudaErrorInvalidDeviceFunction)
        return di_fail(err, DI_EUNSUPPORTED,
                       "device %d has compute capability %d.%d but this build carries code for "
                       "sm_%s only (meson option gpu_arch)",
                       device, major, minor, DI_CUDA_ARCH);
    return di_cuda_status(e, "probe kernel attributes", err);
}

static di_status ctx_init(cuda_ctx *c, di_error *err)
{
    di_status st = di_cuda_status(cudaSetDevice(c->device), "cudaSetDevice", err);
    if (st == DI_OK)
        st = check_device(c->device, err);
    if (st == DI_OK)
        st = di_cuda_status(cudaStreamCreate(&c->stream), "cudaStreamCreate", err);
    if (st == DI_OK)
        st = di_cublas_status(cublasLtCreate(&c->lt), "cublasLtCreate", err);
    if (st == DI_OK) {
        cudaError_t e = cudaMalloc(&c->workspace, c->workspace_bytes);
        if (e != cudaSuccess) {
            cudaGetLastError();
            c->workspace = NULL;
            st = di_fail(err, DI_ENOMEM, "cuBLASLt workspace of %zu bytes: %s",
                         c->workspace_bytes, cudaGetErrorString(e));
        }
    }
    if (st == DI_OK) {
        cudaError_t e = cudaHostAlloc((void **)&c->err_flag, sizeof(int), cudaHostAllocMapped);
        if (e == cudaSuccess)
            e = cudaHostGetDevicePointer((void **)&c->err_flag_dev, c->err_flag, 0);
        if (e == cudaSuccess)
            *c->err_flag = 0;
        st = di_cuda_status(e, "device error flag", err);
    }
    if (st == DI_OK && cuda_graph_init(c) != DI_OK)
        st = di_fail(err, DI_EINTERNAL, "%s", c->last.msg);
    return st;
}

extern "C" di_status kern_cuda_create(const kern_cuda_config *cfg, kern_backend *out,
                                      di_error *err)
{
    if (!out)
        return di_fail(err, DI_EINVAL, "backend output is NULL");
    kern_cuda_config def;
    memset(&def, 0, sizeof(def));
    if (!cfg)
        cfg = &def;
    if (cfg->device < 0)
        return di_fail(err, DI_EINVAL, "device %d is negative", cfg->device);
    int count = 0;
    cudaError_t e = cudaGetDeviceCount(&count);
    if (e != cudaSuccess) {
        cudaGetLastError();
        return di_cuda_status(e, "cudaGetDeviceCount", err);
    }
    if (count == 0)
        return di_fail(err, DI_EUNAVAIL, "no CUDA device");
    if (cfg->device >= count)
        return di_fail(err, DI_EINVAL, "device %d requested, %d present", cfg->device, count);
    cuda_ctx *c = (cuda_ctx *)calloc(1, sizeof(*c));
    if (!c)
        return di_fail(err, DI_ENOMEM, "CUDA backend state");
    c->device = cfg->device;
    c->simple_gemm = cfg->simple_gemm != 0;
    c->moe_grouped_rows = cfg->moe_grouped_rows < 0 ? 0 : (cfg->moe_grouped_rows == 0
                                                               ? CUDA_MOE_GROUPED_ROWS
                                                               : cfg->moe_grouped_rows);
    c->moe_cuda_cores = cfg->moe_cuda_cores != 0;
    c->moe_unstaged = cfg->moe_unstaged != 0;
    cuda_stream_config(c, cfg->stream_splits, cfg->linear_stream_rows);
    c->batch_invariant = cfg->batch_invariant != 0;
    c->moe_host_plan = cfg->moe_host_plan != 0;
    c->moe_per_expert = cfg->moe_per_expert != 0;
    c->moe_wide_tile = cfg->moe_wide_tile > 0 && cfg->moe_wide_tile < KERN_CUDA_WIDE_SHAPES
                           ? cfg->moe_wide_tile
                           : KERN_CUDA_WIDE_DEFAULT;
    c->attn_old = cfg->attn_old != 0;
    c->index_group_rows = cfg->index_group_rows > 1 ? cfg->index_group_rows : 1;
    c->index_block_rows = cfg->index_block_rows < 0 ? UINT32_MAX
                          : cfg->index_block_rows == 0 ? CUDA_INDEX_BLOCK_ROWS
                                                       : (uint32_t)cfg->index_block_rows;
    c->graph.on = cfg->graphs != 0;
    c->graph.split = cfg->graph_split;
    c->workspace_bytes = cfg->workspace_bytes ? cfg->workspace_bytes : DEFAULT_WORKSPACE_BYTES;
    di_status st = ctx_init(c, err);
    if (st != DI_OK) {
        ctx_release(c);
        return st;
    }
    kern_backend be;
    memset(&be, 0, sizeof(be));
    be.name = "cuda";
    be.ctx = c;
    be.device_memory = 1;
    be.graphs = c->graph.on;
    be.ops.alloc = cuda_alloc;
    be.ops.free = cuda_free_mem;
    be.ops.to_host = cuda_to_host;
    be.ops.from_host = cuda_from_host;
    be.ops.alloc_mapped = cuda_alloc_mapped;
    be.ops.free_mapped = cuda_free_mapped;
    be.ops.mark = cuda_mark;
    be.ops.wait_mark = cuda_wait_mark;
    be.ops.embed = entry_embed;
    be.ops.rmsnorm = entry_rmsnorm;
    be.ops.rope = entry_rope;
    be.ops.fakequant = entry_fakequant;
    be.ops.linear_fp8 = entry_linear_fp8;
    be.ops.linear_fp4 = entry_linear_fp4;
    be.ops.linear_bf16 = entry_linear_bf16;
    be.ops.head = entry_head;
    be.ops.hc_mixes = entry_hc_mixes;
    be.ops.hc_collapse = entry_hc_collapse;
    be.ops.hc_expand = entry_hc_expand;
    be.ops.copy_rows = entry_copy_rows;
    be.ops.sample = entry_sample;
    be.ops.step_ahead = entry_step_ahead;
    be.ops.ring_store = entry_ring_store;
    be.ops.compress_pool = entry_compress_pool;
    be.ops.compressed_store = entry_compressed_store;
    be.ops.sparse_attn = entry_sparse_attn;
    be.ops.index_scores = entry_index_scores;
    be.ops.index_candidates = entry_index_candidates;
    be.ops.index_topk = entry_index_topk;
    be.ops.moe_gate = entry_moe_gate;
    be.ops.swiglu = entry_swiglu;
    be.ops.moe_experts = entry_moe_experts;
    be.ops.engram_hash = entry_engram_hash;
    be.ops.engram_lookup = entry_engram_lookup;
    be.ops.engram_gate = entry_engram_gate;
    *out = be;
    return DI_OK;
}

extern "C" void kern_cuda_destroy(kern_backend *be)
{
    if (!be || !be->ctx)
        return;
    ctx_release((cuda_ctx *)be->ctx);
    memset(be, 0, sizeof(*be));
}

/* ---- queries ---- */

extern "C" size_t kern_cuda_op_count(void)
{
    return sizeof(op_rows) / sizeof(op_rows[0]);
}

extern "C" const char *kern_cuda_op_name(size_t index)
{
    return index < kern_cuda_op_count() ? op_rows[index].name : NULL;
}

extern "C" int kern_cuda_supports(const kern_backend *be, const char *op)
{
    if (!be || !be->ctx || !op)
        return 0;
    for (size_t i = 0; i < kern_cuda_op_count(); i++) {
        if (strcmp(op_rows[i].name, op) != 0)
            continue;
        any_fn fn;
        memcpy(&fn, (const char *)&be->ops + op_rows[i].offset, sizeof(fn));
        return fn != NULL;
    }
    return 0;
}

extern "C" const char *kern_cuda_last_error(const kern_backend *be)
{
    if (!be || !be->ctx)
        return "";
    return ((const cuda_ctx *)be->ctx)->last.msg;
}

extern "C" void *kern_cuda_stream(const kern_backend *be)
{
    if (!be || !be->ctx)
        return NULL;
    return (void *)((const cuda_ctx *)be->ctx)->stream;
}

extern "C" di_status kern_cuda_sync(kern_backend *be, di_error *err)
{
    if (!be || !be->ctx)
        return di_fail(err, DI_EINVAL, "backend is NULL");
    cuda_ctx *c = (cuda_ctx *)be->ctx;
    di_status st = cuda_graph_break(c);
    if (st == DI_OK)
        st = cuda_check(c, cudaStreamSynchronize(c->stream), "cudaStreamSynchronize");
    if (st == DI_OK)
        cuda_sync_check(c);
    if (st == DI_OK)
        st = c->pending;
    c->pending = DI_OK;
    if (st != DI_OK && err)
        *err = c->last;
    return st;
}

extern "C" void kern_cuda_get_stats(const kern_backend *be, kern_cuda_stats *out)
{
    if (!out)
        return;
    memset(out, 0, sizeof(*out));
    if (be && be->ctx)
        *out = ((const cuda_ctx *)be->ctx)->stats;
}

extern "C" di_status kern_cuda_moe_bucket(kern_backend *be, const int32_t *ids, uint32_t n_rows,
                                          uint32_t top_k, uint32_t n_experts, uint32_t cap,
                                          const kern_cuda_buckets *out, di_error *err)
{
    if (!be || !be->ctx || !ids || !out || !out->pair || !out->pos || !out->n_groups)
        return di_fail(err, DI_EINVAL, "moe bucket: backend, ids, pair, pos or n_groups is NULL");
    cuda_ctx *c = (cuda_ctx *)be->ctx;
    cuda_moe_bucket b;
    memset(&b, 0, sizeof(b));
    b.ids = ids, b.n_rows = n_rows, b.top_k = top_k, b.n_experts = n_experts, b.cap = cap;
    b.count = out->count, b.start = out->start, b.pair = out->pair, b.pos = out->pos;
    b.group_expert = out->group_expert, b.group_start = out->group_start;
    b.group_rows = out->group_rows, b.n_groups = out->n_groups, b.error = c->err_flag_dev;
    di_status st = cuda_check(c, cudaSetDevice(c->device), "cudaSetDevice");
    if (st == DI_OK && (uint64_t)n_rows * top_k > 0x7fffffffu)
        st = cuda_fail(c, DI_EINVAL, "moe bucket: %u rows x top-%u", n_rows, top_k);
    if (st == DI_OK)
        st = cuda_moe_bucket_run(c, &b);
    if (st != DI_OK && err)
        *err = c->last;
    return st;
}
