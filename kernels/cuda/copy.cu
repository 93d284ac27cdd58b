/* copy.cu: byte copies. The row gather of the table (kern_copy_rows; C twin:
 * kernels/cpu/ops_basic.c, cpu_copy_rows) and the copy lists of other ops (cuda_copy_list:
 * ring commits, compressor state). Exact (bytes).
 *
 * A gather whose destination overlaps its source (the in-place compaction the forward does at
 * the YOCO boundary) goes through the scratch: rows in parallel could otherwise overwrite a row
 * another thread has not read yet, which the twin avoids by copying in ascending order. */
#include <cuda_runtime.h>
#include <stdint.h>

#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/cuda_internal.h"

/* Items per block of the copy kernel (blockIdx.x covers items, threads cover bytes). */
#define COPY_ITEMS_Y 4

/* ---- device helpers ---- */

template <int W> struct vec_of;
template <> struct vec_of<16> { typedef uint4 type; };
template <> struct vec_of<8> { typedef uint2 type; };
template <> struct vec_of<4> { typedef uint32_t type; };
template <> struct vec_of<2> { typedef uint16_t type; };
template <> struct vec_of<1> { typedef uint8_t type; };

/* ---- kernel: item blockIdx.x * COPY_ITEMS_Y + threadIdx.y, W bytes per access ---- */

template <int W>
__global__ void copy_list_kernel(const cuda_copy_item *items, uint32_t n, size_t bytes)
{
    typedef typename vec_of<W>::type V;
    uint32_t it = blockIdx.x * COPY_ITEMS_Y + threadIdx.y;
    if (it >= n)
        return;
    const V *src = reinterpret_cast<const V *>(items[it].src);
    V *dst = reinterpret_cast<V *>(items[it].dst);
    for (size_t i = threadIdx.x; i < bytes / W; i += blockDim.x)
        dst[i] = src[i];
}

/* ---- launcher ---- */

static di_status launch_copy_list(cuda_ctx *c, const cuda_copy_item *items, uint32_t n,
                                  size_t bytes, uint32_t align, cudaStream_t stream)
{
    dim3 block(CUDA_THREADS / COPY_ITEMS_Y, COPY_ITEMS_Y);
    unsigned grid = (n + COPY_ITEMS_Y - 1) / COPY_ITEMS_Y;
    void (*k)(const cuda_copy_item *, uint32_t, size_t) =
        align == 16 ? copy_list_kernel<16>
        : align == 8 ? copy_list_kernel<8>
        : align == 4 ? copy_list_kernel<4>
        : align == 2 ? copy_list_kernel<2>
                     : copy_list_kernel<1>;
    cuda_launch(c, "copy_list_kernel", k, grid, block, 0, stream, items, n, bytes);
    return cuda_launched(c, "copy_list_kernel");
}

di_status cuda_copy_list(cuda_ctx *c, const cuda_copy_item *items, uint32_t n, size_t bytes,
                         uint32_t align)
{
    if (n == 0 || bytes == 0)
        return DI_OK;
    if (align == 0 || align > 16 || (align & (align - 1)) || bytes % align)
        return cuda_fail(c, DI_EINVAL, "copy list: alignment %u does not divide %zu bytes", align,
                         bytes);
    return launch_copy_list(c, items, n, bytes, align, c->stream);
}

/* ---- table entry ---- */

/* The copy items of the gather from src to dst (host array in the metadata); the alignment of
 * every address and of row_bytes is OR-ed into *bits. */
static di_status gather_items(cuda_ctx *c, uint32_t n, uintptr_t src, size_t src_stride,
                              const int32_t *rows, uintptr_t dst, size_t dst_stride, size_t *off,
                              uint64_t *bits)
{
    di_status st = cuda_meta_push(c, NULL, (size_t)n * sizeof(cuda_copy_item), off);
    if (st != DI_OK)
        return st;
    cuda_copy_item *it = (cuda_copy_item *)cuda_meta_at(c, *off);
    for (uint32_t i = 0; i < n; i++) {
        uintptr_t s = src + (rows ? (size_t)rows[i] : i) * src_stride;
        uintptr_t d = dst + (size_t)i * dst_stride;
        it[i].src = (const uint8_t *)s;
        it[i].dst = (uint8_t *)d;
        *bits |= (uint64_t)s | (uint64_t)d;
    }
    return DI_OK;
}

di_status cuda_op_copy_rows(void *ctx, const kern_copy_rows *p)
{
    cuda_ctx *c = (cuda_ctx *)ctx;
    di_status st = cuda_op_begin(c, p, "copy_rows");
    if (st != DI_OK)
        return st;
    if (p->n_rows == 0 || p->row_bytes == 0)
        return DI_OK;
    if (!p->src || !p->dst)
        return cuda_fail(c, DI_EINVAL, "copy_rows: src or dst is NULL");
    if (p->src_stride < p->row_bytes || p->dst_stride < p->row_bytes)
        return cuda_fail(c, DI_EINVAL, "copy_rows: strides %zu, %zu below row_bytes %zu",
                         p->src_stride, p->dst_stride, p->row_bytes);
    size_t max_row = p->rows ? 0 : p->n_rows - 1;
    for (uint32_t i = 0; p->rows && i < p->n_rows; i++) {
        if (p->rows[i] < 0)
            return cuda_fail(c, DI_EINVAL, "copy_rows: rows[%u] = %d is negative", i, p->rows[i]);
        max_row = (size_t)p->rows[i] > max_row ? (size_t)p->rows[i] : max_row;
    }
    /* do the source rows read and the destination rows written share bytes? */
    const uint8_t *s0 = (const uint8_t *)p->src, *d0 = (const uint8_t *)p->dst;
    const uint8_t *s1 = s0 + max_row * p->src_stride + p->row_bytes;
    const uint8_t *d1 = d0 + (size_t)(p->n_rows - 1) * p->dst_stride + p->row_bytes;
    int overlap = s0 < d1 && d0 < s1;
    size_t stage_bytes = overlap ? (size_t)p->n_rows * p->row_bytes : 0;

    cuda_meta_reset(c);
    size_t off1 = 0, off2 = 0;
    uint64_t bits = p->row_bytes | p->src_stride | p->dst_stride;
    /* the staging address is only known once the scratch is sized: its items are made
     * relative to 0 here and moved below (the stage is CUDA_SCRATCH_ALIGN-aligned) */
    if (!overlap) {
        st = gather_items(c, p->n_rows, (uintptr_t)s0, p->src_stride, p->rows,
                          (uintptr_t)p->dst, p->dst_stride, &off1, &bits);
    } else {
        st = gather_items(c, p->n_rows, (uintptr_t)s0, p->src_stride, p->rows, 0, p->row_bytes,
                          &off1, &bits);
        if (st == DI_OK)
            st = gather_items(c, p->n_rows, 0, p->row_bytes, NULL, (uintptr_t)p->dst,
                              p->dst_stride, &off2, &bits);
    }
    if (st != DI_OK)
        return st;
    uint8_t *dev = NULL, *stage = NULL;
    if (overlap) {
        /* reserve the stage first so that its address can go into the items */
        size_t meta_len = cuda_align_up(c->meta_len);
        uint8_t *base = NULL;
        if ((st = cuda_scratch(c, meta_len + stage_bytes, &base)) != DI_OK)
            return st;
        stage = base + meta_len;
        cuda_copy_item *a = (cuda_copy_item *)cuda_meta_at(c, off1);
        cuda_copy_item *b = (cuda_copy_item *)cuda_meta_at(c, off2);
        for (uint32_t i = 0; i < p->n_rows; i++) {
            a[i].dst = (uint8_t *)((uintptr_t)stage + (uintptr_t)a[i].dst);
            b[i].src = (const uint8_t *)((uintptr_t)stage + (uintptr_t)b[i].src);
        }
    }
    if ((st = cuda_meta_upload(c, 0, stage_bytes, &dev, NULL)) != DI_OK)
        return st;
    uint32_t align = cuda_align_of(bits);
    st = cuda_copy_list(c, (const cuda_copy_item *)(dev + off1), p->n_rows, p->row_bytes, align);
    if (st == DI_OK && overlap)
        st = cuda_copy_list(c, (const cuda_copy_item *)(dev + off2), p->n_rows, p->row_bytes,
                            align);
    return st;
}
