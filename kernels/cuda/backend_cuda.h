/* backend_cuda.h: the CUDA backend of kernels/kernels.h (a kern_backend named "cuda").
 *
 * Tensors live in device memory: alloc is cudaMalloc (256-byte aligned) zeroed on the backend's
 * stream, free is cudaFree, to_host and from_host are copies on the stream that have finished
 * when they return (cudaMemcpyDefault, so either side may also be device memory). Every op is
 * queued on the backend's one stream, in call order; step metadata (ids, positions) is copied
 * from the caller's host arrays before the op returns, so the caller may reuse them at once.
 *
 * The backend fills every entry of the table (kern_cuda_supports() reads the table, so it says
 * which entries a build fills). It never computes an approximation in place of a missing case:
 * an input it cannot take is refused (DI_EINVAL, DI_EUNSUPPORTED). Each op matches its CPU twin
 * (kernels/cpu) within the tolerance kernels.h states for it; tests/gpu/check_*.c compare them
 * op by op and check_forward.c the whole model.
 *
 * Step metadata the ops read on the host (sequence tables, row lists, positions, Engram ids and
 * constants) is copied into device memory with each op. moe_experts buckets its pairs by
 * expert on the device up to the grouped path's row threshold (64 by default), so a decode
 * step has no host wait; above it, and engram_lookup with a generated table (the hash ids, to
 * generate the rows on the host), read a device result back and wait for it.
 *
 * Linear layers: the input rows are fake-quantised by procedure (A) into a bf16 scratch (FP8
 * and FP4 weights), the weight is dequantised into a bf16 scratch (E4M3 x UE8M0 and E2M1 x UE8M0
 * values are exact in bf16), then one cuBLASLt BF16 GEMM with fp32 accumulation computes
 * y = x @ W^T. Dequantising per call costs an extra pass over the weight (read 1 byte, write
 * and re-read 2 per value); a fused FP8/FP4 GEMM is the next step (docs/cuda.md).
 *
 * Errors: every op returns DI_OK; DI_EINVAL for invalid parameters (the message names the
 * failed condition; nothing was queued); DI_ENOMEM when its device scratch cannot grow;
 * DI_EUNSUPPORTED or DI_EINTERNAL for a CUDA or cuBLASLt failure (translated in one place,
 * cuda_check.h); or the failure of an earlier transfer not yet reported (to_host, from_host and
 * free return nothing). After a failure the op's outputs are undefined (kernels.h), nothing is
 * leaked and the backend stays usable, unless the device itself faulted (CUDA then fails every
 * later call). The message of the last failure is kept by the backend (kern_cuda_last_error).
 *
 * A backend is used by one thread at a time (its stream orders its work).
 */
#ifndef DI_KERNELS_CUDA_BACKEND_CUDA_H
#define DI_KERNELS_CUDA_BACKEND_CUDA_H

#include <stddef.h>
#include <stdint.h>

#include "common/util/status.h"
#include "kernels/kernels.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The wide MoE kernel's block shapes and FP4 decodings (kern_cuda_config.moe_wide_tile,
 * kernels/cuda/moe_wide.cu); every one gives the same bits. */
enum {
    KERN_CUDA_WIDE_DEFAULT = 0, /* blocks of 128 rows x 128 outputs, 8 warps of 64 x 32, the
                                 * E2M1 pairs by byte permutes in registers */
    KERN_CUDA_WIDE_FIRST = 1,   /* the same warps, the pairs from a byte table in shared memory
                                 * (the first version) */
    KERN_CUDA_WIDE_W64 = 2,     /* 4 warps of 64 x 64, byte permutes */
    KERN_CUDA_WIDE_SHAPES = 3
};

/* How to build the backend. A zeroed struct (or NULL) gives the defaults. */
typedef struct kern_cuda_config {
    int device;                 /* CUDA device ordinal (0 = first) */
    size_t workspace_bytes;     /* cuBLASLt workspace in bytes; 0 = 32 MiB */
    int simple_gemm;            /* 1: every GEMM runs the plain CUDA-core kernel instead of
                                 * cuBLASLt (how the checks exercise that path) */
    int moe_grouped_rows;       /* moe_experts' grouped path (docs/cuda.md) runs when the
                                 * call has at most this many rows (its pairs then bucketed on
                                 * the device, no read-back) or its largest expert group has:
                                 * 0 = the default (64), negative = never (cuBLASLt path
                                 * only); groups of at most 8 (device) or 16 (host) rows */
    int moe_cuda_cores;         /* 1: the grouped path runs its CUDA-core kernel instead of the
                                 * tensor-core one (the previous version, for comparison) */
    int moe_unstaged;           /* 1: the tensor-core kernel reads the weights straight from
                                 * global memory instead of staging them through shared memory
                                 * (the previous version, for comparison) */
    int batch_invariant;        /* 1: batch-invariant mode (kern_cuda_set_batch_invariant) */
    int moe_host_plan;          /* 1: moe_experts buckets its pairs on the host (reading the ids
                                 * back) at every row count, as before the device bucketing */
    int moe_per_expert;         /* 1: buckets past the grouped path run expert by expert on
                                 * the linear path (cuBLASLt) instead of the wide kernel (the
                                 * previous version, for comparison) */
    int graphs;                 /* 1: start with graphs on (kern_cuda_graphs) */
    uint32_t graph_split;       /* kern_cuda_graph_split's ops per segment (0: whole) */
    int stream_splits;          /* 1: the weight-streaming kernel (grouped MoE path, FP8/FP4
                                 * linears of few rows) without split-k over blocks (the
                                 * previous version, for comparison); 0: the split per shape */
    int linear_stream_rows;     /* most rows of a linear_fp8 / linear_fp4 call on that kernel:
                                 * 0 = the default (16), at most 64, negative = never */
    int attn_old;               /* 1: sparse_attn runs every row on attn.cu's kernel of one
                                 * CTA per (row, 16 heads), as before the tile kernel (for
                                 * check_attn's comparison in the same run) */
    int index_group_rows;       /* index_scores scores up to this many consecutive rows of one
                                 * sequence in one CTA, their keys decoded once (at most 8);
                                 * 0 = 1: each row alone, the faster on the H200 (docs/cuda.md) */
    int index_block_rows;       /* index_scores scores a sequence of at least this many rows of
                                 * a call by blocks of 8 of its rows on the block kernel (each
                                 * decoded key tile feeds 8 rows x 32 heads); 0 = the default
                                 * (16), negative = never (every row on the per-row kernel) */
    int moe_wide_tile;          /* the wide MoE kernel's shape: KERN_CUDA_WIDE_* (above; 0 =
                                 * the default, 1 = the previous version, for comparison) */
} kern_cuda_config;

/* Counters of the GEMM paths taken, written by the backend; for checks and benchmarks. */
typedef struct kern_cuda_stats {
    uint64_t gemm_cublaslt;     /* GEMMs run by cuBLASLt */
    uint64_t gemm_simple;       /* GEMMs run by the plain kernel: simple_gemm set, or cuBLASLt
                                 * had no algorithm for the shape and alignment */
    uint64_t plans_built;       /* cuBLASLt plans built (descriptors + heuristic query) */
    uint64_t moe_grouped;       /* moe_experts calls whose routed experts took the grouped
                                 * path */
    uint64_t moe_gemm;          /* moe_experts calls whose routed experts took the per-expert
                                 * cuBLASLt path */
    uint64_t moe_wide;          /* of the moe_gemm calls, those whose routed experts took the
                                 * wide tensor-core kernel (moe_wide.cu) */
    uint64_t stream_split;      /* weight-streaming launches split over several blocks per
                                 * output tile (split-k, one thread-block cluster) */
    uint64_t linear_stream;     /* linear_fp8 / linear_fp4 calls of at most 16 rows (64 when
                                 * configured) run by the weight-streaming tensor-core kernel
                                 * (not cuBLASLt) */
    size_t scratch_bytes;       /* current size of the device scratch */
    uint64_t gemm_invariant;    /* GEMM chunks run in batch-invariant mode (fixed 64-row plan) */
    uint64_t moe_device_plan;   /* moe_experts calls bucketed on the device (no read-back) */
    uint64_t syncs;             /* host waits on the stream (transfers, read-backs, buffer
                                 * growth, kern_cuda_sync) */
    uint64_t graph_launches;    /* segments launched as graphs (kern_cuda_graphs) */
    uint64_t graph_instantiations; /* of them, captured from the log and instantiated (a key
                                 * not kept) */
    uint64_t graph_replays;     /* of them, a kept graph launched as it is (no capture) */
    uint64_t graph_shape_misses; /* instantiations whose ops and row counts matched a kept
                                 * graph's (an argument or a size differed) */
    struct {
        char what[56];          /* "op: kernel or transfer: shape" (launch shape or size) or
                                 * "...: arguments": the first action that differed */
        uint64_t n;             /* misses charged to it */
    } graph_misses[8];          /* of those, by the first differing action (the first 8 kinds) */
    uint64_t graph_nodes;       /* nodes of the segment launched last */
    uint64_t op_host_ns;        /* host time spent inside op entries (issuing or logging work) */
    uint64_t graph_host_ns;     /* host time spent ending segments: finding, capturing,
                                 * instantiating and launching their graphs */
} kern_cuda_stats;

/* Fills *out with the CUDA backend on cfg->device: a stream, a cuBLASLt handle with its
 * workspace, an empty scratch. Returns DI_OK; DI_EINVAL (out NULL, bad device ordinal);
 * DI_EUNAVAIL (no device or driver too old); DI_EUNSUPPORTED (this build has no code for the
 * device's architecture: see -Dgpu_arch); DI_ENOMEM; DI_EINTERNAL (other CUDA or cuBLASLt
 * failure). *out is untouched on failure and nothing is left allocated. */
di_status kern_cuda_create(const kern_cuda_config *cfg, kern_backend *out, di_error *err);

/* Waits for the stream, releases everything kern_cuda_create made and zeroes *be. NULL-safe,
 * and safe on a zeroed struct. Device memory from alloc must be freed before. */
void kern_cuda_destroy(kern_backend *be);

/* 1 when the backend fills the table entry named op ("rope", "linear_fp8", "alloc", ...: the
 * field names of kern_ops), 0 when that entry is NULL or no entry has that name. Read from
 * the table itself, so it cannot disagree with it. be NULL: 0. */
int kern_cuda_supports(const kern_backend *be, const char *op);

/* The kern_ops field names, for listing: index < kern_cuda_op_count(); NULL past the end. */
size_t kern_cuda_op_count(void);
const char *kern_cuda_op_name(size_t index);

/* The message of the backend's last failure ("" when none). Valid until the next op. */
const char *kern_cuda_last_error(const kern_backend *be);

/* The backend's cudaStream_t, for events around its ops. While graphs are on, work queued on
 * it after an op and before the next synchronisation point is refused (kern_cuda_graphs). */
void *kern_cuda_stream(const kern_backend *be);

/* Waits until every queued op has finished. DI_OK; the failure of an earlier transfer not yet
 * reported; or the CUDA error of a failed op (a device fault surfaces here); message in err. */
di_status kern_cuda_sync(kern_backend *be, di_error *err);

/* Batch-invariant mode (on = 1): every op computes a row the same way whatever the other rows
 * of the call, so a request's logits do not depend on its batch, bit for bit (docs/cuda.md).
 * What changes: every GEMM (linear_bf16, head, and the FP8/FP4 linear layers after their exact
 * dequantisation) runs in chunks of 64 rows through one cuBLASLt plan per (n, k), the rows
 * copied into a zero-padded 64-row buffer, so cuBLASLt's per-m choice of algorithm (tiles,
 * split-k) and the weight-streaming kernel of up to 16 rows no longer depend on the row count;
 * hc_mixes splits every row into blocks of 1,024 inputs; moe_experts keeps the routed experts
 * on the grouped path at any group size (the cuBLASLt per-expert path when the grouped path is
 * off) and the shared expert always on the linear path. Off (0) restores the defaults. DI_OK;
 * DI_EINVAL when be is not a CUDA backend. Takes effect at the next op. */
di_status kern_cuda_set_batch_invariant(kern_backend *be, int on);

/* The weight-streaming kernel's settings on a live backend, as kern_cuda_config's
 * stream_splits and linear_stream_rows give them at creation (0, 0: the defaults); for
 * benchmarks comparing them on one loaded model. DI_OK; DI_EINVAL when be is not a CUDA
 * backend. Takes effect at the next op. */
di_status kern_cuda_set_stream(kern_backend *be, int stream_splits, int linear_stream_rows);
/* CUDA graphs (graph.cu). With graphs on, the device work of the ops between two
 * synchronisation points (a transfer, a read-back, buffer growth, alloc, free, kern_cuda_sync)
 * is logged on the host as one segment instead of being queued; at the next such point the
 * segment is launched as a graph. Its key hashes every logged action (kernels with their launch
 * shapes and argument bytes, copies, the size and destination of each upload): the graph of a
 * key seen before is launched as it is, the uploads' bytes written into the pinned arena its
 * copies read; a new key is captured from the log and instantiated. CUDA_GRAPH_SLOTS (128) keys
 * are kept, least recently used replaced. The numbers are the eager path's, bit for bit (the
 * same kernels with the same arguments in the same order). A failed op ends the segment: what
 * was logged before it runs. on = 0 launches the segment being logged and stops logging. DI_OK;
 * DI_EINVAL (not a CUDA backend); a CUDA failure; DI_EINTERNAL when device work bypassed the
 * log. */
di_status kern_cuda_graphs(kern_backend *be, int on, di_error *err);

/* With graphs on, a segment also ends before its ops-th op (0: only at synchronisation
 * points), so that the device runs a step's first segments while the host logs the
 * following ones. DI_OK; DI_EINVAL (not a CUDA backend). */
di_status kern_cuda_graph_split(kern_backend *be, uint32_t ops, di_error *err);

/* Launches again the segment launched last (the same arguments and uploads): a step replayed
 * without any host work, for timing. DI_EINVAL when there is none. */
di_status kern_cuda_graph_relaunch(kern_backend *be, di_error *err);

/* The device bucketing of moe_experts on its own (kernels/cpu/moe_bucket.h's arrays in device
 * memory, written as the twin writes them; NULL arrays are skipped), for its check. A bad id
 * surfaces as the pending failure after the next synchronisation. DI_OK; DI_EINVAL. */
typedef struct kern_cuda_buckets {
    uint32_t *count, *start;    /* [n_experts], [n_experts + 1] */
    int32_t *pair, *pos;        /* [n_rows * top_k] */
    uint32_t *group_expert, *group_start, *group_rows; /* [kern_moe_max_groups()] */
    uint32_t *n_groups;         /* [1] */
} kern_cuda_buckets;
di_status kern_cuda_moe_bucket(kern_backend *be, const int32_t *ids, uint32_t n_rows,
                               uint32_t top_k, uint32_t n_experts, uint32_t cap,
                               const kern_cuda_buckets *out, di_error *err);

/* The one-step-ahead fix-up of kernels/cpu/step_ahead.h on the device, queued on the stream
 * (captured with the step when graphs are on): every array device memory. A bad accepted
 * count writes nothing for its sequence and surfaces as the pending failure after the next
 * synchronisation. DI_OK; DI_EINVAL (params). */
struct kern_step_ahead;
di_status kern_cuda_step_ahead(kern_backend *be, const struct kern_step_ahead *p, di_error *err);

/* Copies the counters into *out. */
void kern_cuda_get_stats(const kern_backend *be, kern_cuda_stats *out);

/* Per-op device time (profile.cu): on = 1 starts charging each op the stream time from its
 * start to the next op's start (anything charged before is dropped); 0 stops. DI_OK;
 * DI_EINVAL (not a CUDA backend); DI_ENOMEM; a CUDA failure. */
typedef struct kern_cuda_op_time {
    const char *op;             /* kern_ops field name */
    double ms;                  /* total over the calls */
    uint32_t calls;
} kern_cuda_op_time;
di_status kern_cuda_profile(kern_backend *be, int on, di_error *err);

/* Waits for the queue, then fills out[0, *n_out) (at most cap) with the ops charged since
 * profiling started or since the last read, longest first, and starts counting afresh.
 * DI_EINVAL when profiling is off. */
di_status kern_cuda_profile_read(kern_backend *be, kern_cuda_op_time *out, size_t cap,
                                 size_t *n_out, di_error *err);

#ifdef __cplusplus
}
#endif

#endif
