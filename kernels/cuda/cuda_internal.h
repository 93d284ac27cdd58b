/* cuda_internal.h: the state of the CUDA backend and the pieces its op files share (not a
 * public header; .cu files only). */
#ifndef DI_KERNELS_CUDA_INTERNAL_H
#define DI_KERNELS_CUDA_INTERNAL_H

#include <cublasLt.h>
#include <cuda_runtime.h>
#include <stddef.h>
#include <stdint.h>

#include <type_traits>

#include "common/util/status.h"
#include "kernels/cuda/backend_cuda.h"
#include "kernels/kernels.h"

/* Threads per block of the element-wise kernels. */
#define CUDA_THREADS 256
/* cuBLASLt plans kept (descriptors + chosen algorithm per shape); replaced round robin. */
#define CUDA_PLAN_SLOTS 64
/* Sub-allocations of the scratch start on this boundary (bytes). */
#define CUDA_SCRATCH_ALIGN 256

/* What selects a cuBLASLt plan: the GEMM's shape, strides and output type, and the alignment
 * (bytes, a power of two <= 256) its pointers are known to have. Compared with memcmp: build
 * it zeroed. */
typedef struct cuda_plan_key {
    uint32_t m, n, k, batch;    /* y[m, n] = x[m, k] @ w[n, k]^T, batch times */
    uint32_t out_f32;           /* 1: y fp32, 0: y bf16 */
    uint32_t align_x, align_w, align_y;
    uint64_t ldx, ldw, ldy;     /* row strides (elements) */
    uint64_t x_batch, w_batch, y_batch; /* offsets between batches (elements) */
} cuda_plan_key;

/* One cached cuBLASLt plan. Written by cuda_gemm_run (gemm.cu), released by
 * cuda_gemm_release. */
typedef struct cuda_plan {
    int used;                   /* slot holds a plan */
    cuda_plan_key key;
    cublasLtMatmulDesc_t desc;  /* fp32 compute and scale, op(A) = W^T */
    cublasLtMatrixLayout_t lw;  /* A: W as column-major [k, n] */
    cublasLtMatrixLayout_t lx;  /* B: x as column-major [k, m] */
    cublasLtMatrixLayout_t ly;  /* C and D: y as column-major [n, m] */
    int have_algo;              /* 0: cuBLASLt offered none (or refused it at run time);
                                 * the plain kernel runs */
    cublasLtMatmulAlgo_t algo;  /* the heuristic's first choice */
} cuda_plan;

/* The backend state, handed to every op as ctx. Written by backend_cuda.cu except where a
 * field says otherwise. */
/* profile.cu: events at each op start while profiling (kern_cuda_profile). */
#define CUDA_PROF_EVENTS 1024
#define CUDA_PROF_OPS 48
typedef struct cuda_prof {
    cudaEvent_t ev[CUDA_PROF_EVENTS];
    const char *name[CUDA_PROF_EVENTS]; /* the op started at each event (NULL: a read) */
    uint32_t n_ev;
    kern_cuda_op_time ops[CUDA_PROF_OPS]; /* charged so far */
    uint32_t n_ops;
} cuda_prof;

/* A routed-expert table (kern_moe_experts.experts) copied to the device once: the device
 * bucketing writes each group's weight pointers from it (moe.cu). */
#define CUDA_EXPERT_TABLES 64
#define CUDA_MARKS 8 /* kern_ops.mark events kept (a wait on an older mark syncs the stream) */
typedef struct cuda_expert_table {
    const kern_expert *host;    /* the caller's array it was copied from (NULL: slot unused) */
    uint32_t n;                 /* experts */
    kern_expert *copy;          /* [n] host copy, compared with the caller's on every call */
    kern_expert *dev;           /* [n] device copy */
    int complete;               /* every expert has all six weight pointers */
    int aligned, aligned16;     /* every w1, w3, w2 is 4-byte / 16-byte aligned */
} cuda_expert_table;

/* graph.cu: the ops between two synchronisation points logged as one segment and launched as
 * a graph (kern_cuda_graphs). While graphs are on, the ops' device work (kernel launches,
 * copies, uploads, GEMMs) goes into a host log instead of the stream; the segment's key hashes
 * every logged action (kernel, launch shape, argument bytes, copy addresses and sizes; an
 * upload's size and place, not its bytes). A key seen before is launched as it is, its uploads'
 * bytes written into the pinned arena its graph copies from; a new key is captured from the
 * log and instantiated. */
#define CUDA_GRAPH_SLOTS 128
enum {
    CUDA_ACT_KERNEL = 1,        /* a kernel launch */
    CUDA_ACT_COPY,              /* cudaMemcpy2DAsync between device addresses */
    CUDA_ACT_UPLOAD,            /* host bytes of the log's upload buffer to a device address */
    CUDA_ACT_MEMSET,            /* cudaMemsetAsync */
    CUDA_ACT_GEMM               /* a GEMM (gemm.cu issues it) */
};
typedef struct cuda_act {
    int kind;                   /* CUDA_ACT_* */
    const char *op;             /* the op entry it came from (diagnostics) */
    const char *name;           /* the kernel, or the transfer (diagnostics) */
    const void *func;           /* kernel: its host stub */
    dim3 grid, block;           /* kernel launch shape */
    size_t smem;                /* kernel dynamic shared memory (bytes) */
    unsigned cluster;           /* kernel: blocks of a thread-block cluster along x (1: none) */
    uint32_t n_args;            /* kernel: arguments, their bytes at args_off in the log's
                                 * argument buffer, each 16-byte aligned, sizes in arg_size */
    size_t args_off;
    void *dst;                  /* copy, upload, memset: destination */
    const void *src;            /* copy: source */
    size_t dpitch, spitch, width, height; /* copy: cudaMemcpy2DAsync's shape (bytes) */
    size_t up_off;              /* upload: offset of its bytes in the upload buffer */
    int value;                  /* memset: byte value; width = bytes */
    size_t gemm_off;            /* gemm: offset of its cuda_gemm in the argument buffer */
} cuda_act;

typedef struct cuda_graph_slot {
    uint64_t key;               /* hash of the segment's actions (0: unused) */
    uint64_t shape;             /* hash of its op names and row counts only (diagnostics) */
    cudaGraphExec_t exec;       /* instantiated graph */
    uint64_t used;              /* tick of its last launch (LRU) */
    uint8_t *arena;             /* pinned copy of the uploads' bytes the graph's copies read */
    size_t arena_cap;
    size_t up_len;              /* bytes of it the segment uses */
    cudaEvent_t done;           /* recorded after its last launch: the arena is free after it */
    int done_set;
    uint64_t *act_key;          /* [n_acts] hash of each action (diagnostics of a miss) */
    uint64_t *act_shape;        /* [n_acts] hash of its launch shape or size alone */
    uint32_t n_acts;
    size_t nodes;               /* nodes of its graph */
} cuda_graph_slot;

typedef struct cuda_graph_state {
    int on;                     /* log segments (kern_cuda_graphs) */
    int open;                   /* a segment is being logged */
    int issuing;                /* the log is being issued to the stream: actions go there */
    int in_op;                  /* an op entry is running (a break inside it resumes logging) */
    const char *op;             /* the op entry running */
    uint64_t op_rows;           /* its row count */
    uint64_t key;               /* running hash of the segment's actions */
    uint64_t shape;             /* running hash of its op names and row counts */
    uint32_t ops;               /* ops in it */
    uint32_t split;             /* > 0: a segment ends before its split-th op, so the device
                                 * runs it while the host logs the next (kern_cuda_graph_split) */
    cuda_act *acts;             /* [n_acts] the segment's log */
    uint32_t n_acts, acts_cap;
    uint64_t *act_key;          /* [n_acts] each action's own hash */
    uint64_t *act_shape;        /* [n_acts] the hash of its launch shape or size alone */
    uint8_t *args;              /* kernel arguments and GEMM descriptors of the log */
    size_t args_len, args_cap;
    uint8_t *up;                /* bytes of the log's uploads (host, pageable) */
    size_t up_len, up_cap;
    cuda_graph_slot slots[CUDA_GRAPH_SLOTS];
    uint64_t tick;
    int last;                   /* slot launched last (kern_cuda_graph_relaunch); -1: none */
} cuda_graph_state;

typedef struct cuda_ctx {
    int device;                 /* CUDA device ordinal */
    cudaStream_t stream;        /* every op and transfer runs on it */
    cublasLtHandle_t lt;        /* cuBLASLt handle */
    void *workspace;            /* cuBLASLt workspace, device */
    size_t workspace_bytes;
    uint8_t *scratch;           /* growable device scratch (quantised inputs, dequantised
                                 * weights, step metadata); contents live for one op */
    size_t scratch_bytes;
    uint8_t *stage;             /* pageable host staging of step metadata before its upload */
    size_t stage_bytes;
    uint8_t *work;              /* growable device buffer of the composite ops (moe_experts,
                                 * engram_lookup from a row generator) that call other ops,
                                 * which use the scratch; contents live for one op */
    size_t work_bytes;
    uint8_t *meta;              /* host assembly of one op's metadata (cuda_meta_*) */
    size_t meta_len, meta_cap;
    int simple_gemm;            /* 1: GEMMs bypass cuBLASLt (kern_cuda_config) */
    int moe_grouped_rows;       /* largest expert group of moe_experts' grouped path; 0 =
                                 * never (kern_cuda_config.moe_grouped_rows resolved) */
    struct cuda_prof *prof;     /* per-op times while kern_cuda_profile is on; else NULL */
    int moe_cuda_cores;         /* 1: the grouped path on the CUDA-core kernel (kern_cuda_config) */
    int moe_unstaged;           /* 1: the tensor-core kernel without the staging (kern_cuda_config) */
    int stream_nosplit;         /* 1: the weight-streaming kernel without split-k (kern_cuda_config) */
    int linear_stream_rows;     /* most rows of a linear on that kernel (resolved; 0 = never) */
    int smem_optin;             /* the device's opt-in shared memory per block (bytes); 0
                                 * until first queried (cuda_device_attr) */
    int sm_count;               /* the device's SMs; 0 until first queried (cuda_device_attr) */
    int batch_invariant;        /* 1: batch-invariant mode (kern_cuda_set_batch_invariant) */
    int attn_old;               /* 1: sparse_attn on attn.cu's kernel, not the tile kernel
                                 * (kern_cuda_config) */
    int index_group_rows;       /* index_scores' rows per CTA at most, >= 1 (kern_cuda_config) */
    uint32_t index_block_rows;  /* index_scores' block kernel from this many rows of a sequence
                                 * (kern_cuda_config resolved; UINT32_MAX = never) */
    uint8_t *bi;                /* staging of the batch-invariant GEMM chunks (gemm.cu) */
    size_t bi_bytes;
    cuda_plan plans[CUDA_PLAN_SLOTS]; /* written by gemm.cu */
    uint32_t plan_next;         /* slot the next new plan replaces */
    kern_cuda_stats stats;      /* counters; gemm.cu writes the GEMM ones */
    int moe_host_plan;          /* 1: moe_experts always buckets on the host (kern_cuda_config) */
    int moe_per_expert;         /* 1: no wide kernel for large buckets (kern_cuda_config) */
    int moe_wide_tile;          /* the wide kernel's block shape: CUDA_MOE_WIDE_* (kern_cuda_config) */
    cuda_expert_table experts[CUDA_EXPERT_TABLES]; /* written by moe.cu */
    uint32_t experts_next;      /* slot the next new table replaces */
    int *err_flag;              /* mapped pinned word the kernels set on a bad input found on
                                 * the device (an expert id out of range); read after each
                                 * synchronisation (cuda_sync_check) */
    int *err_flag_dev;          /* its device address */
    int32_t *tmap_dev;          /* engram_hash with ids_dev: device copy of the token map */
    int32_t *tmap_host;         /* the host map it copies (compared on every call) */
    uint32_t tmap_vocab;
    cudaEvent_t marks[CUDA_MARKS]; /* kern_ops.mark's events, a ring */
    uint64_t mark_next;         /* the next mark's number */
    cuda_graph_state graph;     /* written by graph.cu */
    di_error last;              /* message of the last failure */
    di_status pending;          /* failure of a transfer, returned by the next op */
} cuda_ctx;

/* Records the start of op (profile.cu); called by cuda_op_begin while profiling. */
di_status cuda_prof_mark(cuda_ctx *c, const char *op);
void cuda_prof_free(cuda_ctx *c);

/* A device attribute, queried once into *cache (0 = not yet); fallback when the query fails
 * (backend_cuda.cu). */
int cuda_device_attr(cuda_ctx *c, cudaDeviceAttr attr, int *cache, int fallback);

/* ---- errors (backend_cuda.cu) ---- */

/* Records a failure in c->last and returns code. */
di_status cuda_fail(cuda_ctx *c, di_status code, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
/* DI_OK for cudaSuccess; else records "what: CUDA error" and returns its di_status. */
di_status cuda_check(cuda_ctx *c, cudaError_t e, const char *what);
/* Checks the launch that just happened (configuration errors show at once). */
di_status cuda_launched(cuda_ctx *c, const char *kernel);
/* Start of every op: returns (and clears) a pending transfer failure; DI_EINVAL when the op's
 * params are NULL. */
di_status cuda_op_begin(cuda_ctx *c, const void *params, const char *op);

/* ---- graphs (graph.cu) ---- */

/* Before an op: opens a segment when graphs are on (and no profile runs); mixes the op and
 * its row count into the segment's shape. */
di_status cuda_graph_op_enter(cuda_ctx *c, const char *op, uint64_t rows);
/* After an op: a failed op ends the segment (what was logged before it runs, as it would have). */
void cuda_graph_op_leave(cuda_ctx *c, di_status st);
/* Ends the segment being logged, if any, and launches it (the graph of its key, else one
 * captured from the log); called before anything that synchronises or allocates. Inside an op,
 * logging resumes after it (cuda_graph_resume). */
di_status cuda_graph_break(cuda_ctx *c);
di_status cuda_graph_resume(cuda_ctx *c);
/* 1 while device work goes into the segment's log rather than the stream. */
static inline int cuda_graph_logging(const cuda_ctx *c)
{
    return c->graph.open && !c->graph.issuing;
}
/* A launch bound taken from the step's contents (the most entries a row sees), for an op whose
 * rows do not depend on it (the bound sizes the grid and loops; a row's numbers are its own):
 * n itself eagerly; while logging, the next power of two >= max(n, 64) when it is <= cap, so
 * that the next steps of a growing context keep their graph. */
static inline uint32_t cuda_graph_bound(const cuda_ctx *c, uint32_t n, uint64_t cap)
{
    if (!cuda_graph_logging(c))
        return n;
    uint64_t b = 64;
    while (b < n)
        b *= 2;
    return b <= cap ? (uint32_t)b : n;
}
di_status cuda_graph_init(cuda_ctx *c);
void cuda_graph_release(cuda_ctx *c);

/* The device work of every op goes through these (they log it while a segment is open). */
/* A kernel launch on stream (c->stream while logging): args[n] point to the arguments,
 * sizes[n] their bytes. A failure to log also becomes the pending failure (call sites check
 * the launch with cuda_launched). */
di_status cuda_launch_argv(cuda_ctx *c, const char *kernel, const void *func, dim3 grid,
                           dim3 block, size_t smem, cudaStream_t stream, void **args,
                           const size_t *sizes, unsigned n);
/* The same with thread-block clusters of `cluster` blocks along x (1: a plain launch). */
di_status cuda_launch_argv_cluster(cuda_ctx *c, const char *kernel, const void *func, dim3 grid,
                                   dim3 block, size_t smem, cudaStream_t stream, unsigned cluster,
                                   void **args, const size_t *sizes, unsigned n);
/* cudaMemcpy2DAsync between device addresses (height 1: a plain copy). */
di_status cuda_copy_2d(cuda_ctx *c, void *dst, size_t dpitch, const void *src, size_t spitch,
                       size_t width, size_t height, const char *what);
/* cudaMemsetAsync. */
di_status cuda_memset(cuda_ctx *c, void *dst, int value, size_t bytes, const char *what);
/* Host bytes to device memory; src may be reused at once. */
di_status cuda_upload(cuda_ctx *c, void *dst, const void *src, size_t bytes);
/* gemm.cu: whether a GEMM goes into the log (1, *g copied there) or runs now (0). */
int cuda_graph_log_gemm(cuda_ctx *c, const struct cuda_gemm *g);
/* gemm.cu: issues a logged GEMM. */
di_status cuda_gemm_issue(cuda_ctx *c, const struct cuda_gemm *g);

template <typename... P>
static inline di_status cuda_launch_pack(cuda_ctx *c, const char *kernel, const void *func,
                                         dim3 grid, dim3 block, size_t smem, cudaStream_t stream,
                                         unsigned cluster, P... v)
{
    void *args[sizeof...(P) + 1] = {(void *)&v...};
    size_t sizes[sizeof...(P) + 1] = {sizeof(P)...};
    return cuda_launch_argv_cluster(c, kernel, func, grid, block, smem, stream, cluster, args,
                                    sizes, (unsigned)sizeof...(P));
}

/* func<<<grid, block, smem, stream>>>(a...) through the log (above): every kernel launch of
 * the backend goes through it (tests/kernels/launch_sites.sh checks that none bypasses it). */
template <typename... P, typename... A>
static inline di_status cuda_launch(cuda_ctx *c, const char *kernel, void (*func)(P...),
                                    dim3 grid, dim3 block, size_t smem, cudaStream_t stream,
                                    A &&...a)
{
    static_assert(sizeof...(P) == sizeof...(A), "cuda_launch: argument count");
    return cuda_launch_pack<typename std::remove_cv<P>::type...>(
        c, kernel, (const void *)func, grid, block, smem, stream, 1u,
        static_cast<typename std::remove_cv<P>::type>(a)...);
}

/* cuda_launch with thread-block clusters of `cluster` blocks along x (1: a plain launch). */
template <typename... P, typename... A>
static inline di_status cuda_launch_cluster(cuda_ctx *c, const char *kernel, void (*func)(P...),
                                            dim3 grid, dim3 block, size_t smem,
                                            cudaStream_t stream, unsigned cluster, A &&...a)
{
    static_assert(sizeof...(P) == sizeof...(A), "cuda_launch_cluster: argument count");
    return cuda_launch_pack<typename std::remove_cv<P>::type...>(
        c, kernel, (const void *)func, grid, block, smem, stream, cluster,
        static_cast<typename std::remove_cv<P>::type>(a)...);
}

/* Bits of cuda_ctx.err_flag: the bad input a kernel met. */
#define CUDA_ERR_MOE_ID 1       /* moe_experts: an expert id outside [0, n_experts) */
#define CUDA_ERR_STEP_AHEAD 2   /* kern_cuda_step_ahead: an accepted count out of range */
#define CUDA_ERR_DEV_ID 4       /* embed, engram_hash: an id of ids_dev outside the vocabulary */
/* After a synchronisation: a device-side input error becomes the pending failure. */
void cuda_sync_check(cuda_ctx *c);

/* ---- memory (backend_cuda.cu) ---- */

/* Rounds up to the scratch alignment. */
static inline size_t cuda_align_up(size_t bytes)
{
    return (bytes + CUDA_SCRATCH_ALIGN - 1) / CUDA_SCRATCH_ALIGN * CUDA_SCRATCH_ALIGN;
}

/* Makes the scratch at least `bytes` long (waiting for queued work before replacing it) and
 * returns its start. DI_ENOMEM with the size in the message. */
di_status cuda_scratch(cuda_ctx *c, size_t bytes, uint8_t **out);
/* The work buffer (cuda_ctx.work): at least `bytes` long, same rules as cuda_scratch. */
di_status cuda_work(cuda_ctx *c, size_t bytes, uint8_t **out);
/* Copies device (or host) memory to host memory and waits for it: the few ops that need a
 * device result on the host (moe_experts' expert counts) call it. */
di_status cuda_download(cuda_ctx *c, void *dst, const void *src, size_t bytes);

/* ---- step metadata (backend_cuda.cu) ----
 * An op assembles the host arrays its kernels need (sequence descriptors, block tables, row
 * lists) in one host buffer, then uploads them with one copy: cuda_meta_reset, cuda_meta_push
 * per array (offsets are CUDA_SCRATCH_ALIGN-aligned), cuda_meta_upload. Offsets stay valid;
 * host pointers from cuda_meta_at only until the next push. */
void cuda_meta_reset(cuda_ctx *c);
/* Appends `bytes` (src NULL: zeros) and gives its offset. DI_ENOMEM. */
di_status cuda_meta_push(cuda_ctx *c, const void *src, size_t bytes, size_t *off);
void *cuda_meta_at(cuda_ctx *c, size_t off);
/* Uploads the assembled metadata into the scratch (to_work 0) or the work buffer (1), followed
 * by `extra` bytes for the op's own use: *dev is the metadata's device base, *extra_dev (may be
 * NULL) the extra bytes (CUDA_SCRATCH_ALIGN-aligned). */
di_status cuda_meta_upload(cuda_ctx *c, int to_work, size_t extra, uint8_t **dev,
                           uint8_t **extra_dev);

/* A sequence of the step as the kernels read it: kern_seq with its block table moved into the
 * step's uploaded table array. */
typedef struct cuda_seq {
    uint8_t *slot;              /* its state slot (device), or NULL */
    int64_t pos0;               /* position of its first row */
    int64_t window_lo;          /* kern_seq.window_lo */
    uint32_t row0;              /* first row in the step */
    uint32_t n_rows;            /* rows */
    int32_t ring_hi;            /* kern_seq.ring_hi */
    uint32_t n_blocks;          /* block-table entries */
    uint32_t table0;            /* index of its first block id in the step's table array */
    uint32_t pad;
} cuda_seq;

/* Pushes the sequences (cuda_seq[n]), their block tables (uint32 array) and, when rows > 0,
 * the sequence of every row (int32[rows]; every row must belong to exactly one sequence).
 * `what` names the op in messages. DI_EINVAL (rows outside [0, rows), a row covered twice or
 * not at all), DI_ENOMEM. */
di_status cuda_meta_seqs(cuda_ctx *c, const char *what, const kern_seq *seqs, uint32_t n,
                         uint32_t rows, size_t *seq_off, size_t *table_off, size_t *row_seq_off);

/* Address of compressed entry j of a sequence in a paged pool (main or index region), or NULL
 * when its block-table entry is missing. */
__device__ __forceinline__ const uint8_t *cuda_entry_addr(const uint8_t *blocks, size_t block_bytes,
                                                          uint32_t per_block, size_t offset,
                                                          size_t entry_bytes, const cuda_seq *s,
                                                          const uint32_t *tables, int64_t j)
{
    uint64_t b = (uint64_t)j / per_block;
    if (j < 0 || b >= s->n_blocks)
        return NULL;
    return blocks + (size_t)tables[s->table0 + b] * block_bytes + offset +
           (size_t)((uint64_t)j % per_block) * entry_bytes;
}

/* ---- byte copies (copy.cu) ---- */

/* One copy of a list: `bytes` from src to dst (device addresses). */
typedef struct cuda_copy_item {
    const uint8_t *src;
    uint8_t *dst;
} cuda_copy_item;
/* Queues the copies of items[n] (a device array), each `bytes` long; align is a power of two
 * that divides every address and `bytes` (the vector width used). Copies must not overlap. */
di_status cuda_copy_list(cuda_ctx *c, const cuda_copy_item *items, uint32_t n, size_t bytes,
                         uint32_t align);
/* The largest power of two <= 16 dividing v. */
static inline uint32_t cuda_align_of(uint64_t v)
{
    uint32_t a = 16;
    while (a > 1 && v % a)
        a /= 2;
    return a;
}

/* ---- shared launchers ---- */

/* fakequant.cu: rows [n_rows, n] bf16 of src (row stride src_stride) quantised and dequantised
 * by fmt into dst (row stride dst_stride); dst may be src. n a multiple of the format's block. */
di_status cuda_fakequant_rows(cuda_ctx *c, kern_qfmt fmt, const uint16_t *src, size_t src_stride,
                              uint16_t *dst, size_t dst_stride, uint32_t n_rows, uint32_t n);

/* gemm.cu: y = x @ w^T in bf16 operands with fp32 accumulation, row-major tensors. */
typedef struct cuda_gemm {
    uint32_t m, n, k;           /* y [m, n], x [m, k], w [n, k] per batch */
    uint32_t batch;             /* >= 1: strided batch (the groups of linear_bf16) */
    const uint16_t *x;          /* bf16, row stride ldx, batch b at x + b * x_batch */
    size_t ldx, x_batch;
    const uint16_t *w;          /* bf16, row stride ldw, batch b at w + b * w_batch */
    size_t ldw, w_batch;
    void *y;                    /* bf16 or f32, row stride ldy, batch b at y + b * y_batch */
    size_t ldy, y_batch;
    int out_f32;                /* 1: y f32 */
    int accumulate;             /* f32 only: y += x @ w^T */
} cuda_gemm;
di_status cuda_gemm_run(cuda_ctx *c, const cuda_gemm *g);
/* Rows of one batch-invariant GEMM chunk: every GEMM of that mode runs with m = this. */
#define CUDA_BI_ROWS 64
/* Destroys every cached plan and the batch-invariant staging. */
void cuda_gemm_release(cuda_ctx *c);

/* linear.cu: a linear layer for ops built on linear layers (moe_experts): the checks and the
 * path of the linear_* entries without the entry's bookkeeping. */
di_status cuda_linear_run(cuda_ctx *c, const kern_linear *p, kern_wfmt fmt);

/* moe_grouped.cu: moe_experts' routed experts for decode-sized batches, one launch for W1 and
 * W3 (with SwiGLU and the routing weight) over every (expert, rows) group and one for W2 (see
 * the file's comment). */

/* Default of kern_cuda_config.moe_grouped_rows: the grouped path runs when the largest expert
 * group has at most this many rows. */
#define CUDA_MOE_GROUPED_ROWS 64
/* Rows of one group in a launch (a larger expert group is split into several). */
#define CUDA_MOE_GROUP_ROWS 16

/* index_scores: the block kernel from this many rows of one sequence in a call (index.cu). */
#define CUDA_INDEX_BLOCK_ROWS 16

/* One group: rows [start, start + n) of the call's bucket order, all routed to one expert
 * (or rows of x for the shared expert). */
typedef struct cuda_moe_group {
    const uint8_t *w1, *s1;     /* [inter, dim/2] packed E2M1 and [inter, dim/32] UE8M0 (FP8:
                                 * [inter, dim] E4M3 and [ceil(inter/32), dim/32]) */
    const uint8_t *w3, *s3;     /* the same for W3 */
    const uint8_t *w2, *s2;     /* [dim, inter/2] and [dim, inter/32] (FP8: [dim, inter] and
                                 * [dim/32, inter/32]) */
    uint32_t start;             /* first pair of the group in bucket order */
    uint32_t n;                 /* rows, 1..CUDA_MOE_GROUP_ROWS */
} cuda_moe_group;

/* One call of the grouped path; every pointer is device memory. */
typedef struct cuda_moe_grouped {
    uint32_t n_groups;          /* groups (with n_groups_dev: the most there can be, the grid) */
    const uint32_t *n_groups_dev; /* NULL, or the groups written on the device: the blocks of
                                 * groups past it return at once */
    const cuda_moe_group *groups; /* [n_groups]; NULL: the one group `one` */
    cuda_moe_group one;         /* the group when groups is NULL (a linear layer's rows) */
    uint32_t max_rows;          /* largest n of the groups */
    int fp8;                    /* 0: routed FP4 weights; 1: the shared expert's FP8 weights */
    int aligned;                /* every w1, w3, w2 is 4-byte (FP8: 8-byte) aligned */
    int aligned16;              /* every w1, w3, w2 is 16-byte aligned: the tensor-core
                                 * kernel streams the weights through shared memory */
    uint32_t dim, inter, top_k;
    uint32_t n_pairs;           /* rows of h and og */
    const uint16_t *xq;         /* [n_rows, dim] x quantised by (A) */
    const int32_t *pair;        /* [n_pairs] row * top_k + slot, bucket order; NULL: row i of
                                 * h and og is row i of x, with no routing weight */
    const float *weights;       /* [n_rows, top_k] routing weights (with pair) */
    float limit;                /* swiglu_limit */
    uint16_t *h;                /* [n_pairs, inter] hidden activations (written, then
                                 * quantised by (A) in place) */
    uint16_t *og;               /* [n_pairs, dim] expert outputs, bucket order */
    size_t og_ld;               /* og's row stride; 0 = dim */
    size_t x_ld;                /* xq's row stride; 0 = dim */
    void *xc;                   /* tensor-core kernel: [n_rows, dim] x's E4M3 codes as FP16 */
    float *xcs;                 /* [n_rows, dim/32] and their scales (moe_mma.cu) */
    void *hc;                   /* [n_pairs, inter] h's codes and */
    float *hcs;                 /* [n_pairs, inter/32] their scales */
} cuda_moe_grouped;

/* 1 when groups of `rows` rows at these widths fit the device's shared memory per block. */
int cuda_moe_grouped_fits(cuda_ctx *c, uint32_t rows, uint32_t dim, uint32_t inter);

/* Queues the up launch, the (A) quantisation of h and the down launch. DI_OK; DI_EINVAL (a
 * launch too large); a CUDA failure. */
di_status cuda_moe_grouped_run(cuda_ctx *c, const cuda_moe_grouped *g);

/* moe.cu: y[t] = bf16(fp32(sum in double of og[pos[t][0..top_k)], then os[t] when not NULL))
 * on `stream`, one thread per element (the combine of moe_experts and of the expert-parallel
 * exchange, ep.cu). pos is device memory. */
di_status cuda_moe_combine(cuda_ctx *c, const uint16_t *og, const int32_t *pos, uint32_t top_k,
                           const uint16_t *os, uint32_t dim, uint32_t n_rows, uint16_t *y,
                           cudaStream_t stream);

/* moe_bucket.cu: the pairs bucketed on the device (kernels/cpu/moe_bucket.h's arrays, device
 * memory; NULL count, start or group_* arrays are not written). */
#define CUDA_BUCKET_SMEM (96 * 1024) /* 4,096 experts and 12,000 pairs */
typedef struct cuda_moe_bucket {
    const int32_t *ids;         /* [n_rows, top_k] */
    uint32_t n_rows, top_k, n_experts;
    uint32_t cap;               /* most pairs of a group */
    uint32_t *count;            /* [n_experts] */
    uint32_t *start;            /* [n_experts + 1] */
    int32_t *pair, *pos;        /* [n_rows * top_k] each */
    uint32_t *group_expert, *group_start, *group_rows; /* [kern_moe_max_groups()] */
    uint32_t *n_groups;         /* [1] */
    const kern_expert *experts; /* [n_experts] device copy, with groups */
    cuda_moe_group *groups;     /* [kern_moe_max_groups()] or NULL */
    int *error;                 /* CUDA_ERR_MOE_ID set on an id out of range; may be NULL */
} cuda_moe_bucket;
/* Shared memory the kernel needs (bytes); the call is refused past CUDA_BUCKET_SMEM. */
size_t cuda_moe_bucket_smem(uint32_t n_experts, uint32_t n_pairs);
di_status cuda_moe_bucket_run(cuda_ctx *c, const cuda_moe_bucket *a);

/* moe_mma.cu: the same on the tensor cores (FP16 mma.sync), which cuda_moe_grouped_run calls
 * unless cuda_ctx.moe_cuda_cores: x's and h's codes, the up launch, the down launch. */
di_status cuda_moe_mma_run(cuda_ctx *c, const cuda_moe_grouped *g);

/* Most rows of a linear_fp8 / linear_fp4 call that the tensor-core kernel above can run (the
 * weight streamed once, kern_cuda_stats.linear_stream), and the default
 * (kern_cuda_config.linear_stream_rows); more rows go to cuBLASLt. Past 16 rows the kernel
 * loses to cuBLASLt (docs/cuda.md), hence the default. */
#define CUDA_LINEAR_STREAM_ROWS 64
#define CUDA_LINEAR_STREAM_DEFAULT 16

/* linear_fp8 (fp8 = 1) or linear_fp4 on that kernel: p->m <= CUDA_LINEAR_STREAM_ROWS, bf16
 * output without accumulate, p->w 16-byte aligned (the caller checks; moe_mma.cu). */
di_status cuda_linear_stream(cuda_ctx *c, const kern_linear *p, int fp8);

/* Sets c->stream_nosplit and c->linear_stream_rows from kern_cuda_config's stream_splits and
 * linear_stream_rows (moe_mma.cu). */
void cuda_stream_config(cuda_ctx *c, int stream_splits, int linear_stream_rows);

/* ---- table entries (one op file each) ---- */

di_status cuda_op_embed(void *ctx, const kern_embed *p);
di_status cuda_op_rmsnorm(void *ctx, const kern_rmsnorm *p);
di_status cuda_op_rope(void *ctx, const kern_rope *p);
di_status cuda_op_fakequant(void *ctx, const kern_fakequant *p);
di_status cuda_op_linear_fp8(void *ctx, const kern_linear *p);
di_status cuda_op_linear_fp4(void *ctx, const kern_linear *p);
di_status cuda_op_linear_bf16(void *ctx, const kern_linear *p);
di_status cuda_op_head(void *ctx, const kern_linear *p);
di_status cuda_op_hc_mixes(void *ctx, const kern_hc_mixes *p);
di_status cuda_op_hc_collapse(void *ctx, const kern_hc_collapse *p);
di_status cuda_op_hc_expand(void *ctx, const kern_hc_expand *p);
di_status cuda_op_copy_rows(void *ctx, const kern_copy_rows *p);
di_status cuda_op_ring_store(void *ctx, const kern_ring_store *p);
di_status cuda_op_compress_pool(void *ctx, const kern_compress_pool *p);
di_status cuda_op_compressed_store(void *ctx, const kern_compressed_store *p);
di_status cuda_op_sparse_attn(void *ctx, const kern_sparse_attn *p);

/* ---- sparse attention (attn.cu, attn_decode.cu) ---- */

/* Everything the attention kernels read: the op's params with the step metadata in device
 * memory (cuda_meta_seqs). */
typedef struct cuda_attn_args {
    const uint16_t *q;          /* [T, H, hd] */
    const uint8_t *local;       /* [T, ring entry] */
    uint16_t *out;              /* [T, H, hd] */
    const float *sink;          /* [H] */
    const int32_t *topk;        /* [T, topk_n] or NULL */
    uint32_t topk_n;
    const cuda_seq *seqs;
    const uint32_t *tables;
    const int32_t *row_seq;     /* [T] */
    const uint8_t *blocks;      /* the compressed pool */
    size_t block_bytes, main_offset, main_entry_bytes;
    uint32_t per_block;
    size_t ring_offset;
    uint32_t ring_positions, window;
    uint32_t n_heads, head_dim;
    float scale;
    const int32_t *rows;        /* the launch's rows (one per CTA column), or NULL: every row */
    uint32_t chunk, n_split;    /* key slots per split, splits per row */
    float *part;                /* [launch rows, n_split, H, hd] partial numerators, or NULL */
    float *ml;                  /* [launch rows, n_split, H, 2]: running max and denominator */
    uint32_t ne_pad;            /* attn.cu's kernel: entry capacity of its shared buffers */
} cuda_attn_args;

/* Rows of a sequence of more than this many rows are prefill rows: in batch-invariant mode
 * they take one split, the others CUDA_ATTN_BI_CHUNK slots a split. */
#define CUDA_ATTN_DECODE_ROWS 16
/* Key slots per split of decode rows in batch-invariant mode (a multiple of 16). */
#define CUDA_ATTN_BI_CHUNK 128
/* Queues sparse_attn on the tile kernel of attn_decode.cu for every row of the call (p checked
 * by cuda_op_sparse_attn). DI_EUNSUPPORTED where its shared memory does not fit the device. */
di_status cuda_attn_tiles(cuda_ctx *c, const kern_sparse_attn *p);
/* Fills the fields of a shared by both kernels from p and the uploaded metadata. */
void cuda_attn_args_init(cuda_attn_args *a, const kern_sparse_attn *p, const uint8_t *dev,
                         size_t seq_off, size_t table_off, size_t row_seq_off);
di_status cuda_op_index_scores(void *ctx, const kern_index_scores *p);
di_status cuda_op_index_candidates(void *ctx, const kern_index_candidates *p);
di_status cuda_op_index_topk(void *ctx, const kern_index_topk *p);
di_status cuda_op_moe_gate(void *ctx, const kern_moe_gate *p);
di_status cuda_op_swiglu(void *ctx, const kern_swiglu *p);
di_status cuda_op_moe_experts(void *ctx, const kern_moe_experts *p);
di_status cuda_op_engram_hash(void *ctx, const kern_engram_hash *p);
di_status cuda_op_engram_lookup(void *ctx, const kern_engram_lookup *p);
di_status cuda_op_engram_gate(void *ctx, const kern_engram_gate *p);
di_status cuda_op_sample(void *ctx, const kern_sample *p);

#endif
