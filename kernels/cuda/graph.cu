/* graph.cu: CUDA graphs of the backend's ops (kern_cuda_graphs in backend_cuda.h). While graphs
 * are on, the device work of the ops between two synchronisation points (kernel launches,
 * copies, uploads, GEMMs) is written into a host log instead of the stream: one segment. At the
 * next such point (cuda_graph_break: a transfer, a read-back, buffer growth, alloc, free, a
 * sync, or every `split` ops) the segment's key, a hash of every logged action (kernel, launch
 * shape, argument bytes; copy addresses and sizes; an upload's size and destination, not its
 * bytes), selects a slot:
 *   - a slot of that key: its instantiated graph is launched as it is, once the uploads' bytes
 *     are written into the slot's pinned arena, which the graph's copy nodes read (the host
 *     waits for the slot's previous launch before writing it);
 *   - none: the log is issued to the stream under capture (uploads from the slot's arena), the
 *     graph instantiated into the least recently used slot and launched.
 * Either way the device runs the kernels the eager path would have run, with the same
 * arguments, in the same order: the same bits. While logging, the stream is itself captured
 * (a guard): device work that bypassed the log would land there and is reported instead of
 * running out of order. */
#include <cuda_runtime.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "kernels/cuda/cuda_internal.h"

#define PIN_MIN ((size_t)64 << 10)
#define ARG_ALIGN 16

static uint64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static uint64_t mix(uint64_t h, uint64_t v)
{
    h ^= v + 0x9e3779b97f4a7c15ull + (h << 6) + (h >> 2);
    return h * 0xff51afd7ed558ccdull;
}

static uint64_t mix_bytes(uint64_t h, const void *p, size_t n)
{
    const uint8_t *b = (const uint8_t *)p;
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
        uint64_t v;
        memcpy(&v, b + i, 8);
        h = mix(h, v);
    }
    uint64_t t = 0;
    if (i < n) {
        memcpy(&t, b + i, n - i);
        h = mix(h, t ^ ((uint64_t)(n - i) << 56));
    }
    return h;
}

static uint64_t mix_str(uint64_t h, const char *s)
{
    return mix_bytes(h, s, strlen(s));
}

/* Grows *buf (elements of `size` bytes) to hold `need`. */
static int reserve(void **buf, size_t *cap, size_t need, size_t size)
{
    if (need <= *cap)
        return 1;
    size_t n = *cap ? *cap : 64;
    while (n < need)
        n *= 2;
    void *p = realloc(*buf, n * size);
    if (!p)
        return 0;
    *buf = p;
    *cap = n;
    return 1;
}

/* ---- the log ---- */

/* Opens a segment: the log is emptied and the guard capture started. */
static di_status seg_open(cuda_ctx *c)
{
    cuda_graph_state *g = &c->graph;
    if (!g->on || g->open || c->prof)
        return DI_OK;
    di_status st = cuda_check(c, cudaStreamBeginCapture(c->stream, cudaStreamCaptureModeRelaxed),
                              "graph: cudaStreamBeginCapture (guard)");
    if (st != DI_OK)
        return st;
    g->open = 1;
    g->key = 0x6a09e667f3bcc909ull;
    g->shape = 0xbb67ae8584caa73bull;
    g->ops = 0;
    g->n_acts = 0;
    g->args_len = 0;
    g->up_len = 0;
    return DI_OK;
}

/* Appends an action (kind and op filled in); NULL when the host is out of memory. */
static cuda_act *act_new(cuda_ctx *c, int kind)
{
    cuda_graph_state *g = &c->graph;
    if (g->n_acts == g->acts_cap) { /* the three arrays grow together */
        size_t n = g->acts_cap ? (size_t)g->acts_cap * 2 : 256;
        cuda_act *a = (cuda_act *)realloc(g->acts, n * sizeof(cuda_act));
        if (a)
            g->acts = a;
        uint64_t *k = a ? (uint64_t *)realloc(g->act_key, n * sizeof(uint64_t)) : NULL;
        if (k)
            g->act_key = k;
        uint64_t *o = k ? (uint64_t *)realloc(g->act_shape, n * sizeof(uint64_t)) : NULL;
        if (o)
            g->act_shape = o;
        if (!o) {
            cuda_fail(c, DI_ENOMEM, "graph: log of %zu actions", n);
            return NULL;
        }
        g->acts_cap = (uint32_t)n;
    }
    cuda_act *a = &g->acts[g->n_acts];
    *a = cuda_act{};
    a->kind = kind;
    a->op = g->op ? g->op : "?";
    return a;
}

/* Closes the action just filled in: its hash (shape: of its launch shape or size alone) joins
 * the key. */
static void act_done(cuda_graph_state *g, uint64_t shape, uint64_t h)
{
    g->act_key[g->n_acts] = h;
    g->act_shape[g->n_acts] = shape;
    g->n_acts++;
    g->key = mix(g->key, h);
}

/* Copies bytes into a growable byte buffer at an aligned offset. */
static di_status buf_put(cuda_ctx *c, uint8_t **buf, size_t *len, size_t *cap, const void *src,
                         size_t bytes, size_t *off)
{
    size_t at = (*len + ARG_ALIGN - 1) / ARG_ALIGN * ARG_ALIGN;
    if (!reserve((void **)buf, cap, at + bytes, 1))
        return cuda_fail(c, DI_ENOMEM, "graph: log buffer of %zu bytes", at + bytes);
    memset(*buf + *len, 0, at - *len);
    memcpy(*buf + at, src, bytes);
    *len = at + bytes;
    *off = at;
    return DI_OK;
}

static di_status issue(cuda_ctx *c, const cuda_act *a, const uint8_t *arena);

/* A launch now: plain, or with a cluster of `cluster` blocks along x (cudaLaunchKernelExC). */
static cudaError_t launch_now(const void *func, dim3 grid, dim3 block, size_t smem,
                              cudaStream_t stream, unsigned cluster, void **args)
{
    if (cluster <= 1)
        return cudaLaunchKernel(func, grid, block, args, smem, stream);
    cudaLaunchConfig_t cfg = {};
    cudaLaunchAttribute attr[1];
    cfg.gridDim = grid;
    cfg.blockDim = block;
    cfg.dynamicSmemBytes = smem;
    cfg.stream = stream;
    attr[0].id = cudaLaunchAttributeClusterDimension;
    attr[0].val.clusterDim.x = cluster, attr[0].val.clusterDim.y = 1, attr[0].val.clusterDim.z = 1;
    cfg.attrs = attr, cfg.numAttrs = 1;
    return cudaLaunchKernelExC(&cfg, func, args);
}

di_status cuda_launch_argv(cuda_ctx *c, const char *kernel, const void *func, dim3 grid,
                           dim3 block, size_t smem, cudaStream_t stream, void **args,
                           const size_t *sizes, unsigned n)
{
    return cuda_launch_argv_cluster(c, kernel, func, grid, block, smem, stream, 1, args, sizes,
                                    n);
}

di_status cuda_launch_argv_cluster(cuda_ctx *c, const char *kernel, const void *func, dim3 grid,
                                   dim3 block, size_t smem, cudaStream_t stream, unsigned cluster,
                                   void **args, const size_t *sizes, unsigned n)
{
    if (!cuda_graph_logging(c)) {
        di_status st = cuda_check(c, launch_now(func, grid, block, smem, stream, cluster, args),
                                  kernel);
        return st == DI_OK ? cuda_launched(c, kernel) : st;
    }
    if (stream != c->stream)
        return c->pending = cuda_fail(c, DI_EINTERNAL, "graph: %s launched on another stream "
                                      "while a segment is logged", kernel);
    cuda_graph_state *g = &c->graph;
    cuda_act *a = act_new(c, CUDA_ACT_KERNEL);
    if (!a)
        return c->pending = DI_ENOMEM;
    a->func = func;
    a->grid = grid;
    a->block = block;
    a->smem = smem;
    a->cluster = cluster;
    a->n_args = n;
    a->name = kernel;
    uint64_t h = mix(mix((uint64_t)CUDA_ACT_KERNEL, (uint64_t)(uintptr_t)func),
                     ((uint64_t)grid.x << 32) ^ ((uint64_t)grid.y << 16) ^ grid.z);
    h = mix(mix(h, ((uint64_t)block.x << 32) ^ ((uint64_t)block.y << 16) ^ block.z), smem);
    h = mix(h, cluster);
    const uint64_t shape = h;
    size_t off = 0;
    /* the sizes first, then each argument 16-byte aligned */
    di_status st = buf_put(c, &g->args, &g->args_len, &g->args_cap, sizes, n * sizeof(size_t),
                           &a->args_off);
    for (unsigned i = 0; st == DI_OK && i < n; i++) {
        st = buf_put(c, &g->args, &g->args_len, &g->args_cap, args[i], sizes[i], &off);
        h = mix_bytes(mix(h, sizes[i]), args[i], sizes[i]);
    }
    if (st != DI_OK) {
        c->pending = st; /* call sites may check only cuda_launched: the next op reports it */
        return st;
    }
    act_done(g, shape, h);
    return DI_OK;
}

di_status cuda_copy_2d(cuda_ctx *c, void *dst, size_t dpitch, const void *src, size_t spitch,
                       size_t width, size_t height, const char *what)
{
    if (width == 0 || height == 0)
        return DI_OK;
    if (!cuda_graph_logging(c))
        return cuda_check(c, cudaMemcpy2DAsync(dst, dpitch, src, spitch, width, height,
                                               cudaMemcpyDeviceToDevice, c->stream),
                          what);
    cuda_act *a = act_new(c, CUDA_ACT_COPY);
    if (!a)
        return DI_ENOMEM;
    a->dst = dst, a->dpitch = dpitch, a->src = src, a->spitch = spitch;
    a->width = width, a->height = height;
    a->name = what;
    uint64_t shape = mix(mix((uint64_t)CUDA_ACT_COPY, width), height);
    uint64_t h = mix(mix(shape, (uint64_t)(uintptr_t)dst), (uintptr_t)src);
    act_done(&c->graph, shape, mix(mix(h, dpitch), spitch));
    return DI_OK;
}

di_status cuda_memset(cuda_ctx *c, void *dst, int value, size_t bytes, const char *what)
{
    if (bytes == 0)
        return DI_OK;
    if (!cuda_graph_logging(c))
        return cuda_check(c, cudaMemsetAsync(dst, value, bytes, c->stream), what);
    cuda_act *a = act_new(c, CUDA_ACT_MEMSET);
    if (!a)
        return DI_ENOMEM;
    a->dst = dst, a->value = value, a->width = bytes;
    a->name = what;
    uint64_t shape = mix((uint64_t)CUDA_ACT_MEMSET, bytes);
    act_done(&c->graph, shape, mix(mix(shape, (uint64_t)(uintptr_t)dst), (uint64_t)value));
    return DI_OK;
}

di_status cuda_upload(cuda_ctx *c, void *dst, const void *src, size_t bytes)
{
    if (bytes == 0)
        return DI_OK;
    if (!cuda_graph_logging(c)) {
        /* the staging buffer is pageable: the copy has taken the bytes when the call returns,
         * so the caller's array and the staging buffer are free again at once */
        if (bytes > c->stage_bytes) {
            uint8_t *s = (uint8_t *)realloc(c->stage, bytes);
            if (!s)
                return cuda_fail(c, DI_ENOMEM, "host staging of %zu bytes", bytes);
            c->stage = s;
            c->stage_bytes = bytes;
        }
        memcpy(c->stage, src, bytes);
        return cuda_check(c, cudaMemcpyAsync(dst, c->stage, bytes, cudaMemcpyHostToDevice,
                                             c->stream),
                          "upload: cudaMemcpyAsync");
    }
    cuda_graph_state *g = &c->graph;
    cuda_act *a = act_new(c, CUDA_ACT_UPLOAD);
    if (!a)
        return DI_ENOMEM;
    a->dst = dst, a->width = bytes;
    di_status st = buf_put(c, &g->up, &g->up_len, &g->up_cap, src, bytes, &a->up_off);
    if (st != DI_OK)
        return st;
    a->name = "upload";
    uint64_t shape = mix(mix((uint64_t)CUDA_ACT_UPLOAD, bytes), a->up_off);
    act_done(g, shape, mix(shape, (uint64_t)(uintptr_t)dst));
    return DI_OK;
}

int cuda_graph_log_gemm(cuda_ctx *c, const cuda_gemm *gm)
{
    if (!cuda_graph_logging(c))
        return 0;
    cuda_graph_state *g = &c->graph;
    cuda_act *a = act_new(c, CUDA_ACT_GEMM);
    if (!a || buf_put(c, &g->args, &g->args_len, &g->args_cap, gm, sizeof(*gm), &a->gemm_off) !=
                  DI_OK) {
        c->pending = DI_ENOMEM; /* reported by the next op */
        return 1;
    }
    /* its fields, not the struct's padding */
    a->name = "gemm";
    uint64_t h = mix((uint64_t)CUDA_ACT_GEMM, ((uint64_t)gm->m << 32) ^ gm->n);
    h = mix(h, ((uint64_t)gm->k << 32) ^ gm->batch);
    const uint64_t shape = h;
    h = mix(h, (uintptr_t)gm->x);
    h = mix(mix(mix(h, gm->ldx), gm->x_batch), (uintptr_t)gm->w);
    h = mix(mix(mix(h, gm->ldw), gm->w_batch), (uintptr_t)gm->y);
    h = mix(mix(mix(h, gm->ldy), gm->y_batch), ((uint64_t)gm->out_f32 << 1) ^ gm->accumulate);
    act_done(g, shape, h);
    return 1;
}

/* Issues one logged action to the stream; uploads read the arena. */
static di_status issue(cuda_ctx *c, const cuda_act *a, const uint8_t *arena)
{
    cuda_graph_state *g = &c->graph;
    switch (a->kind) {
    case CUDA_ACT_KERNEL: {
        void *argv[64];
        if (a->n_args > 64)
            return cuda_fail(c, DI_EINTERNAL, "graph: a kernel of %u arguments", a->n_args);
        const size_t *sizes = (const size_t *)(g->args + a->args_off);
        size_t at = a->args_off + a->n_args * sizeof(size_t);
        for (uint32_t i = 0; i < a->n_args; i++) {
            at = (at + ARG_ALIGN - 1) / ARG_ALIGN * ARG_ALIGN;
            argv[i] = g->args + at;
            at += sizes[i];
        }
        di_status st = cuda_check(c, launch_now(a->func, a->grid, a->block, a->smem, c->stream,
                                                a->cluster, argv),
                                  "graph: cudaLaunchKernel");
        return st == DI_OK ? cuda_launched(c, a->name) : st;
    }
    case CUDA_ACT_COPY:
        return cuda_check(c, cudaMemcpy2DAsync(a->dst, a->dpitch, a->src, a->spitch, a->width,
                                               a->height, cudaMemcpyDeviceToDevice, c->stream),
                          "graph: cudaMemcpy2DAsync");
    case CUDA_ACT_UPLOAD:
        return cuda_check(c, cudaMemcpyAsync(a->dst, arena + a->up_off, a->width,
                                             cudaMemcpyHostToDevice, c->stream),
                          "graph: upload cudaMemcpyAsync");
    case CUDA_ACT_MEMSET:
        return cuda_check(c, cudaMemsetAsync(a->dst, a->value, a->width, c->stream),
                          "graph: cudaMemsetAsync");
    case CUDA_ACT_GEMM: {
        cuda_gemm gm;
        memcpy(&gm, g->args + a->gemm_off, sizeof(gm));
        return cuda_gemm_issue(c, &gm);
    }
    }
    return cuda_fail(c, DI_EINTERNAL, "graph: an action of kind %d", a->kind);
}

/* ---- slots ---- */

/* The slot of key, else -1. */
static int slot_find(cuda_graph_state *g, uint64_t key)
{
    for (int i = 0; i < CUDA_GRAPH_SLOTS; i++)
        if (g->slots[i].exec && g->slots[i].key == key)
            return i;
    return -1;
}

/* Waits for the slot's last launch (its arena is read until then). */
static di_status slot_wait(cuda_ctx *c, cuda_graph_slot *s)
{
    if (!s->done_set)
        return DI_OK;
    s->done_set = 0;
    return cuda_check(c, cudaEventSynchronize(s->done), "graph: cudaEventSynchronize");
}

/* The least recently used slot, emptied, with an arena of at least `bytes`. */
static di_status slot_take(cuda_ctx *c, size_t bytes, int *out)
{
    cuda_graph_state *g = &c->graph;
    int lru = 0;
    for (int i = 0; i < CUDA_GRAPH_SLOTS; i++) {
        if (!g->slots[i].exec) {
            lru = i;
            break;
        }
        if (g->slots[i].used < g->slots[lru].used)
            lru = i;
    }
    cuda_graph_slot *s = &g->slots[lru];
    di_status st = slot_wait(c, s);
    if (st != DI_OK)
        return st;
    if (s->exec)
        cudaGraphExecDestroy(s->exec);
    s->exec = NULL;
    s->key = 0;
    if (g->last == lru)
        g->last = -1;
    if (bytes > s->arena_cap) {
        if (s->arena)
            cudaFreeHost(s->arena);
        s->arena = NULL;
        s->arena_cap = 0;
        size_t cap = bytes > PIN_MIN ? bytes + bytes / 2 : PIN_MIN;
        cudaError_t e = cudaHostAlloc((void **)&s->arena, cap, cudaHostAllocDefault);
        if (e != cudaSuccess) {
            cudaGetLastError();
            s->arena = NULL;
            return cuda_fail(c, DI_ENOMEM, "graph: pinned upload arena of %zu bytes", cap);
        }
        s->arena_cap = cap;
    }
    if (!s->done) {
        st = cuda_check(c, cudaEventCreateWithFlags(&s->done, cudaEventDisableTiming),
                        "graph: cudaEventCreate");
        if (st != DI_OK)
            return st;
    }
    size_t n = g->n_acts ? g->n_acts : 1;
    uint64_t *k = (uint64_t *)realloc(s->act_key, n * sizeof(uint64_t));
    if (k)
        s->act_key = k;
    uint64_t *o = k ? (uint64_t *)realloc(s->act_shape, n * sizeof(uint64_t)) : NULL;
    if (o)
        s->act_shape = o;
    s->n_acts = 0;
    if (!k || !o)
        return cuda_fail(c, DI_ENOMEM, "graph: keys of %u actions", g->n_acts);
    *out = lru;
    return DI_OK;
}

/* Counts, for a miss whose op names and rows match a kept slot, the first action that differs
 * (kern_cuda_stats.graph_misses). */
static void note_miss(cuda_ctx *c)
{
    cuda_graph_state *g = &c->graph;
    for (int i = 0; i < CUDA_GRAPH_SLOTS; i++) {
        const cuda_graph_slot *s = &g->slots[i];
        if (!s->exec || s->shape != g->shape)
            continue;
        uint32_t j = 0;
        while (j < s->n_acts && j < g->n_acts && s->act_key[j] == g->act_key[j])
            j++;
        char what[56];
        if (j < g->n_acts && j < s->n_acts)
            snprintf(what, sizeof what, "%s: %s: %s", g->acts[j].op, g->acts[j].name,
                     s->act_shape[j] == g->act_shape[j] ? "arguments" : "shape");
        else
            snprintf(what, sizeof what, "%s: more or fewer actions",
                     j < g->n_acts ? g->acts[j].op : "end");
        c->stats.graph_shape_misses++;
        for (int k = 0; k < 8; k++) {
            if (c->stats.graph_misses[k].n && strcmp(c->stats.graph_misses[k].what, what) != 0)
                continue;
            memcpy(c->stats.graph_misses[k].what, what, sizeof what);
            c->stats.graph_misses[k].n++;
            break;
        }
        return;
    }
}

/* Captures the log into slot si's graph and instantiates it. */
static di_status slot_capture(cuda_ctx *c, int si)
{
    cuda_graph_state *g = &c->graph;
    cuda_graph_slot *s = &g->slots[si];
    memcpy(s->arena, g->up, g->up_len);
    di_status st = cuda_check(c, cudaStreamBeginCapture(c->stream, cudaStreamCaptureModeRelaxed),
                              "graph: cudaStreamBeginCapture");
    if (st != DI_OK)
        return st;
    g->issuing = 1;
    for (uint32_t i = 0; st == DI_OK && i < g->n_acts; i++)
        st = issue(c, &g->acts[i], s->arena);
    g->issuing = 0;
    cudaGraph_t graph = NULL;
    di_status es = cuda_check(c, cudaStreamEndCapture(c->stream, &graph),
                              "graph: cudaStreamEndCapture");
    if (st == DI_OK)
        st = es;
    if (st == DI_OK)
        st = cuda_check(c, cudaGraphGetNodes(graph, NULL, &s->nodes), "graph: cudaGraphGetNodes");
    if (st == DI_OK)
        st = cuda_check(c, cudaGraphInstantiate(&s->exec, graph, 0),
                        "graph: cudaGraphInstantiate");
    if (graph)
        cudaGraphDestroy(graph);
    if (st != DI_OK) {
        s->exec = NULL;
        return st;
    }
    s->key = g->key;
    s->shape = g->shape;
    s->up_len = g->up_len;
    memcpy(s->act_key, g->act_key, g->n_acts * sizeof(uint64_t));
    memcpy(s->act_shape, g->act_shape, g->n_acts * sizeof(uint64_t));
    s->n_acts = g->n_acts;
    c->stats.graph_instantiations++;
    return DI_OK;
}

static di_status slot_launch(cuda_ctx *c, int si)
{
    cuda_graph_state *g = &c->graph;
    cuda_graph_slot *s = &g->slots[si];
    di_status st = cuda_check(c, cudaGraphLaunch(s->exec, c->stream), "graph: cudaGraphLaunch");
    if (st == DI_OK)
        st = cuda_check(c, cudaEventRecord(s->done, c->stream), "graph: cudaEventRecord");
    if (st != DI_OK)
        return st;
    s->done_set = 1;
    s->used = ++g->tick;
    g->last = si;
    c->stats.graph_launches++;
    c->stats.graph_nodes = s->nodes;
    return DI_OK;
}

/* Ends the guard capture: DI_EINTERNAL when device work bypassed the log. */
static di_status guard_end(cuda_ctx *c)
{
    cudaGraph_t guard = NULL;
    di_status st = cuda_check(c, cudaStreamEndCapture(c->stream, &guard),
                              "graph: cudaStreamEndCapture (guard)");
    size_t stray = 0;
    if (st == DI_OK && guard)
        st = cuda_check(c, cudaGraphGetNodes(guard, NULL, &stray), "graph: cudaGraphGetNodes");
    if (guard)
        cudaGraphDestroy(guard);
    if (st == DI_OK && stray)
        st = cuda_fail(c, DI_EINTERNAL,
                       "graph: %zu device actions of a segment bypassed its log (a launch not "
                       "made through cuda_launch)", stray);
    return st;
}

di_status cuda_graph_break(cuda_ctx *c)
{
    cuda_graph_state *g = &c->graph;
    if (!g->open)
        return DI_OK;
    uint64_t t0 = now_ns();
    g->open = 0;
    di_status st = guard_end(c);
    if (st == DI_OK && g->n_acts > 0) {
        int si = slot_find(g, g->key);
        if (si >= 0) {
            cuda_graph_slot *s = &g->slots[si];
            st = slot_wait(c, s);
            if (st == DI_OK) {
                memcpy(s->arena, g->up, g->up_len);
                c->stats.graph_replays++;
            }
        } else {
            note_miss(c);
            st = slot_take(c, g->up_len, &si);
            if (st == DI_OK)
                st = slot_capture(c, si);
        }
        if (st == DI_OK)
            st = slot_launch(c, si);
    }
    g->n_acts = 0;
    c->stats.graph_host_ns += now_ns() - t0;
    return st;
}

di_status cuda_graph_resume(cuda_ctx *c)
{
    cuda_graph_state *g = &c->graph;
    if (!g->in_op)
        return DI_OK;
    di_status st = seg_open(c);
    if (st == DI_OK && g->open && g->ops == 0) { /* the op that broke the segment opens it */
        g->shape = mix(mix_str(g->shape, g->op ? g->op : "?"), g->op_rows);
        g->ops = 1;
    }
    return st;
}

di_status cuda_graph_op_enter(cuda_ctx *c, const char *op, uint64_t rows)
{
    cuda_graph_state *g = &c->graph;
    g->in_op++;
    g->op = op;
    g->op_rows = rows;
    if (!g->on)
        return DI_OK;
    di_status st = DI_OK;
    if (g->open && g->split && g->ops >= g->split)
        st = cuda_graph_break(c); /* launched: the device starts on it */
    if (st == DI_OK)
        st = seg_open(c);
    if (st == DI_OK && g->open) {
        g->shape = mix(mix_str(g->shape, op), rows);
        g->ops++;
    }
    return st;
}

void cuda_graph_op_leave(cuda_ctx *c, di_status st)
{
    cuda_graph_state *g = &c->graph;
    g->in_op--;
    if (!g->in_op)
        g->op = NULL;
    if (st == DI_OK || !g->open)
        return;
    di_error keep = c->last; /* the op's message stays the one reported */
    di_status bs = cuda_graph_break(c);
    if (bs != DI_OK)
        c->pending = bs;
    c->last = keep;
}

void cuda_sync_check(cuda_ctx *c)
{
    c->stats.syncs++;
    volatile int *flag = c->err_flag;
    if (!flag || !*flag)
        return;
    int bits = *flag;
    *flag = 0;
    c->pending = cuda_fail(c, DI_EINVAL, "%s",
                           bits & CUDA_ERR_MOE_ID
                               ? "moe_experts: an expert id outside [0, n_experts) (found by the "
                                 "device bucketing)"
                           : bits & CUDA_ERR_DEV_ID
                               ? "embed or engram_hash: a token id in device memory outside the "
                                 "vocabulary (found on the device)"
                               : "step ahead: an accepted count outside [0, out_stride] or rows "
                                 "past the step (found on the device)");
}

di_status cuda_graph_init(cuda_ctx *c)
{
    c->graph.last = -1;
    return DI_OK;
}

void cuda_graph_release(cuda_ctx *c)
{
    cuda_graph_state *g = &c->graph;
    if (g->open) {
        cudaGraph_t graph = NULL;
        g->open = 0;
        if (cudaStreamEndCapture(c->stream, &graph) == cudaSuccess && graph)
            cudaGraphDestroy(graph);
        cudaGetLastError();
    }
    if (c->stream)
        cudaStreamSynchronize(c->stream);
    for (int i = 0; i < CUDA_GRAPH_SLOTS; i++) {
        cuda_graph_slot *s = &g->slots[i];
        if (s->exec)
            cudaGraphExecDestroy(s->exec);
        if (s->arena)
            cudaFreeHost(s->arena);
        if (s->done)
            cudaEventDestroy(s->done);
        free(s->act_key);
        free(s->act_shape);
    }
    free(g->acts);
    free(g->act_key);
    free(g->act_shape);
    free(g->args);
    free(g->up);
    memset(g, 0, sizeof(*g));
    g->last = -1;
}

/* ---- public entries ---- */

extern "C" di_status kern_cuda_graphs(kern_backend *be, int on, di_error *err)
{
    if (!be || !be->ctx || !be->name || strcmp(be->name, "cuda") != 0)
        return di_fail(err, DI_EINVAL, "graphs: not a CUDA backend");
    cuda_ctx *c = (cuda_ctx *)be->ctx;
    di_status st = on ? DI_OK : cuda_graph_break(c);
    c->graph.on = on != 0;
    be->graphs = c->graph.on; /* the executor pads decode steps while they are on */
    if (st != DI_OK && err)
        *err = c->last;
    return st;
}

extern "C" di_status kern_cuda_graph_split(kern_backend *be, uint32_t ops, di_error *err)
{
    if (!be || !be->ctx || !be->name || strcmp(be->name, "cuda") != 0)
        return di_fail(err, DI_EINVAL, "graph split: not a CUDA backend");
    ((cuda_ctx *)be->ctx)->graph.split = ops;
    return DI_OK;
}

extern "C" di_status kern_cuda_graph_relaunch(kern_backend *be, di_error *err)
{
    if (!be || !be->ctx || !be->name || strcmp(be->name, "cuda") != 0)
        return di_fail(err, DI_EINVAL, "graph relaunch: not a CUDA backend");
    cuda_ctx *c = (cuda_ctx *)be->ctx;
    cuda_graph_state *g = &c->graph;
    if (g->last < 0 || g->open)
        return di_fail(err, DI_EINVAL, "graph relaunch: no graph launched last%s",
                       g->open ? " (a segment is being logged)" : "");
    uint64_t t0 = now_ns();
    cuda_graph_slot *s = &g->slots[g->last];
    di_status st = cuda_check(c, cudaGraphLaunch(s->exec, c->stream), "graph: cudaGraphLaunch");
    if (st == DI_OK)
        st = cuda_check(c, cudaEventRecord(s->done, c->stream), "graph: cudaEventRecord");
    if (st == DI_OK)
        s->done_set = 1;
    c->stats.graph_host_ns += now_ns() - t0;
    if (st != DI_OK && err)
        *err = c->last;
    return st;
}
