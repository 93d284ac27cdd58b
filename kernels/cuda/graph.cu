/* graph.cu: CUDA graphs of the backend's ops (kern_cuda_graphs in backend_cuda.h). The ops
 * between two synchronisation points are captured from the stream as one segment; at the next
 * such point (cuda_graph_break: a transfer, a read-back, buffer growth, alloc, free, a sync)
 * the segment is launched as a graph. A segment's key mixes its ops and their row counts: the
 * first segment of a key is instantiated, later ones update that instantiation in place, and
 * one whose update is refused (a kernel or a cuBLASLt algorithm changed with the shapes) is
 * instantiated afresh. The uploads of a captured segment are copied from a pinned host arena
 * (a graph's copy node reads its source when the graph runs): CUDA_GRAPH_ARENAS arenas taken in
 * turn by segment, one written again only after the event recorded behind the last graph
 * reading it. */
#include <cuda_runtime.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "kernels/cuda/cuda_internal.h"

#define PIN_MIN ((size_t)1 << 20)

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

static uint64_t mix_str(uint64_t h, const char *s)
{
    while (*s)
        h = mix(h, (uint8_t)*s++);
    return h;
}

/* Starts capturing a segment into the current arena, once the graph that read it last is done. */
static di_status graph_begin(cuda_ctx *c)
{
    cuda_graph_state *g = &c->graph;
    if (!g->on || g->capturing || c->prof)
        return DI_OK;
    di_status st = DI_OK;
    if (g->done_set[g->cur]) {
        st = cuda_check(c, cudaEventSynchronize(g->done[g->cur]), "graph: cudaEventSynchronize");
        g->done_set[g->cur] = 0;
    }
    if (st == DI_OK)
        st = cuda_check(c, cudaStreamBeginCapture(c->stream, cudaStreamCaptureModeRelaxed),
                        "graph: cudaStreamBeginCapture");
    if (st != DI_OK)
        return st;
    g->capturing = 1;
    g->key = 0x6a09e667f3bcc909ull;
    g->ops = 0;
    g->pin_len = 0;
    return DI_OK;
}

di_status cuda_graph_op_enter(cuda_ctx *c, const char *op, uint64_t rows)
{
    cuda_graph_state *g = &c->graph;
    g->in_op++;
    if (!g->on)
        return DI_OK;
    di_status st = DI_OK;
    if (g->capturing && g->split && g->ops >= g->split)
        st = cuda_graph_break(c); /* launched: the device starts on it */
    if (st == DI_OK)
        st = graph_begin(c);
    if (st == DI_OK && g->capturing) {
        g->key = mix(mix_str(g->key, op), rows);
        g->ops++;
    }
    return st;
}

void cuda_graph_op_leave(cuda_ctx *c, di_status st)
{
    cuda_graph_state *g = &c->graph;
    g->in_op--;
    if (st == DI_OK || !g->capturing)
        return;
    di_error keep = c->last; /* the op's message stays the one reported */
    di_status bs = cuda_graph_break(c);
    if (bs != DI_OK)
        c->pending = bs;
    c->last = keep;
}

di_status cuda_graph_resume(cuda_ctx *c)
{
    return c->graph.in_op ? graph_begin(c) : DI_OK;
}

/* The key's slot, else the least recently used one (its instantiation destroyed). */
static cuda_graph_slot *graph_slot(cuda_graph_state *g, uint64_t key, int *found)
{
    cuda_graph_slot *lru = &g->slots[0];
    for (int i = 0; i < CUDA_GRAPH_SLOTS; i++) {
        cuda_graph_slot *s = &g->slots[i];
        if (s->key == key && s->exec) {
            *found = 1;
            return s;
        }
        if (s->used < lru->used)
            lru = s;
    }
    *found = 0;
    if (lru->exec) {
        if (g->last == lru->exec)
            g->last = NULL;
        cudaGraphExecDestroy(lru->exec);
    }
    lru->exec = NULL;
    lru->key = key;
    return lru;
}

/* Updates the key's instantiation with graph, or instantiates it. */
static di_status graph_exec(cuda_ctx *c, cudaGraph_t graph, cudaGraphExec_t *out)
{
    cuda_graph_state *g = &c->graph;
    int found = 0;
    cuda_graph_slot *s = graph_slot(g, g->key ? g->key : 1, &found);
    if (found) {
        cudaGraphExecUpdateResultInfo info;
        if (cudaGraphExecUpdate(s->exec, graph, &info) == cudaSuccess) {
            c->stats.graph_updates++;
            *out = s->exec;
            return DI_OK;
        }
        cudaGetLastError(); /* refused: the shapes changed */
        if (g->last == s->exec)
            g->last = NULL;
        cudaGraphExecDestroy(s->exec);
        s->exec = NULL;
    }
    di_status st = cuda_check(c, cudaGraphInstantiate(&s->exec, graph, 0),
                              "graph: cudaGraphInstantiate");
    if (st != DI_OK) {
        s->exec = NULL;
        s->key = 0;
        return st;
    }
    c->stats.graph_instantiations++;
    *out = s->exec;
    return DI_OK;
}

di_status cuda_graph_break(cuda_ctx *c)
{
    cuda_graph_state *g = &c->graph;
    if (!g->capturing)
        return DI_OK;
    uint64_t t0 = now_ns();
    g->capturing = 0;
    cudaGraph_t graph = NULL;
    di_status st = cuda_check(c, cudaStreamEndCapture(c->stream, &graph),
                              "graph: cudaStreamEndCapture");
    size_t nodes = 0;
    if (st == DI_OK)
        st = cuda_check(c, cudaGraphGetNodes(graph, NULL, &nodes), "graph: cudaGraphGetNodes");
    cudaGraphExec_t exec = NULL;
    if (st == DI_OK && nodes > 0)
        st = graph_exec(c, graph, &exec);
    if (st == DI_OK && exec)
        st = cuda_check(c, cudaGraphLaunch(exec, c->stream), "graph: cudaGraphLaunch");
    if (st == DI_OK && exec)
        st = cuda_check(c, cudaEventRecord(g->done[g->cur], c->stream), "graph: cudaEventRecord");
    if (st == DI_OK && exec) {
        for (int i = 0; i < CUDA_GRAPH_SLOTS; i++)
            if (g->slots[i].exec == exec)
                g->slots[i].used = ++g->tick;
        g->done_set[g->cur] = 1;
        g->last = exec;
        g->last_arena = g->cur;
        g->cur = (g->cur + 1) % CUDA_GRAPH_ARENAS;
        c->stats.graph_launches++;
        c->stats.graph_nodes = nodes;
    }
    if (graph)
        cudaGraphDestroy(graph);
    c->stats.graph_host_ns += now_ns() - t0;
    return st;
}

/* Makes the current arena at least `bytes` long: the segment is launched first (its copies
 * read the arena), then the arena is replaced once that graph is done and capture resumes. */
static di_status pin_grow(cuda_ctx *c, size_t bytes)
{
    cuda_graph_state *g = &c->graph;
    di_status st = cuda_graph_break(c);
    int a = g->cur;
    if (st == DI_OK && g->done_set[a])
        st = cuda_check(c, cudaEventSynchronize(g->done[a]), "graph: cudaEventSynchronize");
    if (st != DI_OK)
        return st;
    g->done_set[a] = 0;
    size_t cap = g->pin_cap[a] * 2 > bytes ? g->pin_cap[a] * 2 : bytes;
    cap = cap > PIN_MIN ? cap : PIN_MIN;
    if (g->pin[a])
        cudaFreeHost(g->pin[a]);
    g->pin[a] = NULL;
    g->pin_cap[a] = 0;
    cudaError_t e = cudaHostAlloc((void **)&g->pin[a], cap, cudaHostAllocDefault);
    if (e != cudaSuccess) {
        cudaGetLastError();
        g->pin[a] = NULL;
        return cuda_fail(c, DI_ENOMEM, "graph: pinned upload arena of %zu bytes", cap);
    }
    g->pin_cap[a] = cap;
    return cuda_graph_resume(c);
}

di_status cuda_graph_host(cuda_ctx *c, size_t bytes, uint8_t **out)
{
    cuda_graph_state *g = &c->graph;
    if (g->capturing) {
        size_t at = cuda_align_up(g->pin_len);
        if (at + bytes > g->pin_cap[g->cur]) {
            di_status st = pin_grow(c, bytes);
            if (st != DI_OK)
                return st;
            at = 0;
        }
        if (g->capturing) { /* still (or again) capturing: the arena */
            g->pin_len = at + bytes;
            *out = g->pin[g->cur] + at;
            return DI_OK;
        }
    }
    if (bytes > c->stage_bytes) {
        uint8_t *s = (uint8_t *)realloc(c->stage, bytes);
        if (!s)
            return cuda_fail(c, DI_ENOMEM, "host staging of %zu bytes", bytes);
        c->stage = s;
        c->stage_bytes = bytes;
    }
    *out = c->stage;
    return DI_OK;
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
                               : "step ahead: an accepted count outside [0, out_stride] or rows "
                                 "past the step (found on the device)");
}

di_status cuda_graph_init(cuda_ctx *c)
{
    cuda_graph_state *g = &c->graph;
    for (int a = 0; a < CUDA_GRAPH_ARENAS; a++) {
        di_status st = cuda_check(c, cudaEventCreateWithFlags(&g->done[a], cudaEventDisableTiming),
                                  "graph: cudaEventCreate");
        if (st != DI_OK)
            return st;
    }
    return DI_OK;
}

void cuda_graph_release(cuda_ctx *c)
{
    cuda_graph_state *g = &c->graph;
    if (g->capturing) {
        cudaGraph_t graph = NULL;
        g->capturing = 0;
        if (cudaStreamEndCapture(c->stream, &graph) == cudaSuccess && graph)
            cudaGraphDestroy(graph);
        cudaGetLastError();
    }
    if (c->stream)
        cudaStreamSynchronize(c->stream);
    for (int i = 0; i < CUDA_GRAPH_SLOTS; i++)
        if (g->slots[i].exec)
            cudaGraphExecDestroy(g->slots[i].exec);
    for (int a = 0; a < CUDA_GRAPH_ARENAS; a++) {
        if (g->pin[a])
            cudaFreeHost(g->pin[a]);
        if (g->done[a])
            cudaEventDestroy(g->done[a]);
    }
    memset(g, 0, sizeof(*g));
}

/* ---- public entries ---- */

extern "C" di_status kern_cuda_graphs(kern_backend *be, int on, di_error *err)
{
    if (!be || !be->ctx || !be->name || strcmp(be->name, "cuda") != 0)
        return di_fail(err, DI_EINVAL, "graphs: not a CUDA backend");
    cuda_ctx *c = (cuda_ctx *)be->ctx;
    di_status st = on ? DI_OK : cuda_graph_break(c);
    c->graph.on = on != 0;
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
    if (!g->last || g->capturing)
        return di_fail(err, DI_EINVAL, "graph relaunch: no graph launched last%s",
                       g->capturing ? " (a segment is being captured)" : "");
    uint64_t t0 = now_ns();
    di_status st = cuda_check(c, cudaGraphLaunch(g->last, c->stream), "graph: cudaGraphLaunch");
    if (st == DI_OK)
        st = cuda_check(c, cudaEventRecord(g->done[g->last_arena], c->stream),
                        "graph: cudaEventRecord");
    if (st == DI_OK)
        g->done_set[g->last_arena] = 1;
    c->stats.graph_host_ns += now_ns() - t0;
    if (st != DI_OK && err)
        *err = c->last;
    return st;
}
