/* bench_forward: CPU prefill and decode throughput of the forward pass on the shipped small
 * configs, next to this machine's memory bandwidth measured in the same run (a large memcpy).
 *
 * For each config: random weights; a 2,048-token prompt prefilled in one step (tokens/s), then
 * 256 decode steps of one row with the logits of that row (tokens/s, ms/step). The decode step
 * reads every dense weight, top-k routed experts per layer, one embedding row, the head, the
 * draft-ring weights, and KV (window ring entries, the picked compressed entries, every index
 * key the indexers score); bytes per step / step time, as a fraction of the memcpy bandwidth,
 * says how close the decode step is to the memory limit. Weights that fit the last-level cache
 * can exceed DRAM bandwidth; the report prints the weight bytes next to the figure.
 *
 * Usage: bench_forward [--threads N] [--prompt N] [--decode N] [CONFIG ...] (default tiny small)
 */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/model/forward.h"
#include "common/model/runner.h"
#include "common/util/clock.h"
#include "common/util/philox.h"
#include "kernels/cpu/backend.h"

typedef struct copy_job {
    uint8_t *dst;
    const uint8_t *src;
    size_t n;
} copy_job;

static void *copy_thread(void *arg)
{
    copy_job *j = arg;
    memcpy(j->dst, j->src, j->n);
    return NULL;
}

/* memcpy bandwidth (bytes read + written per second) with `threads` threads over 512 MiB. */
static double memcpy_bandwidth(uint32_t threads)
{
    size_t n = (size_t)512 << 20;
    uint8_t *a = malloc(n), *b = malloc(n);
    if (!a || !b)
        return 0;
    memset(a, 1, n);
    memset(b, 2, n);
    double best = 0;
    for (int rep = 0; rep < 4; rep++) {
        pthread_t th[16];
        copy_job jobs[16];
        uint32_t t = threads > 16 ? 16 : threads;
        uint64_t t0 = di_mono_ns();
        for (uint32_t i = 0; i < t; i++) {
            jobs[i] = (copy_job){b + i * (n / t), a + i * (n / t), n / t};
            pthread_create(&th[i], NULL, copy_thread, &jobs[i]);
        }
        for (uint32_t i = 0; i < t; i++)
            pthread_join(th[i], NULL);
        double s = (double)(di_mono_ns() - t0) / 1e9;
        double bw = 2.0 * (double)n / s;
        best = bw > best ? bw : best;
    }
    free(a);
    free(b);
    return best;
}

static uint64_t tensor_bytes(const model_tensor *t)
{
    return t->fmt == MODEL_WFMT_NONE ? 0 : model_tensor_data_bytes(t) + model_tensor_scale_bytes(t);
}

static uint64_t expert_bytes(const model_expert_weights *e)
{
    return tensor_bytes(&e->w1) + tensor_bytes(&e->w2) + tensor_bytes(&e->w3);
}

/* Weight bytes one decode row reads in a block (dense parts + top_k experts). */
static uint64_t layer_bytes(const model_layer_weights *L, uint32_t top_k)
{
    const model_tensor *dense[] = {
        &L->attn_norm, &L->ffn_norm, &L->hc_attn.fn, &L->hc_attn.base, &L->hc_attn.scale,
        &L->hc_ffn.fn, &L->hc_ffn.base, &L->hc_ffn.scale, &L->attn.wq_a, &L->attn.q_norm,
        &L->attn.wq_b, &L->attn.wkv, &L->attn.kv_norm, &L->attn.wo_a, &L->attn.wo_b,
        &L->attn.attn_sink, &L->compressor.wkv, &L->compressor.wgate, &L->compressor.norm,
        &L->indexer.wq_b, &L->indexer.weights_proj, &L->indexer.wk, &L->indexer.k_norm,
        &L->ffn.gate, &L->ffn.gate_bias,
    };
    uint64_t b = 0;
    for (size_t i = 0; i < sizeof(dense) / sizeof(dense[0]); i++)
        b += tensor_bytes(dense[i]);
    b += expert_bytes(&L->ffn.shared);
    if (L->ffn.n_experts)
        b += (uint64_t)top_k * expert_bytes(&L->ffn.experts[0]);
    if (L->engram)
        b += tensor_bytes(&L->engram->wkv) + tensor_bytes(&L->engram->q_weight) +
             tensor_bytes(&L->engram->k_weight);
    return b;
}

/* KV bytes one decode row at position p reads. */
static uint64_t kv_bytes(const model_config *c, const kv_geometry *g, int64_t p)
{
    uint64_t b = 0;
    for (uint32_t l = 0; l < c->n_layers; l++) {
        const model_layer_role *r = &c->roles[l];
        uint64_t win = (uint64_t)(p + 1 < (int64_t)c->window ? p + 1 : c->window);
        b += win * kv_ring_entry_bytes(g);
        if (!r->ratio)
            continue;
        uint64_t vis = (uint64_t)(p + 1) / r->ratio;
        b += (vis < c->index_topk ? vis : c->index_topk) * kv_main_entry_bytes(g);
        if (r->owns_indexer) {
            uint64_t rk = c->roles[r->index_key_source].ratio;
            b += (uint64_t)(p + 1) / rk * kv_index_entry_bytes(g);
        }
    }
    return b;
}

static int bench(const char *config, uint32_t threads, uint32_t n_prompt, uint32_t n_decode,
                 double bw)
{
    di_error e;
    kern_backend be;
    runner_model rm;
    if (kern_cpu_create(threads, &be, &e) != DI_OK ||
        runner_model_random(config, 1, NULL, NULL, &rm, &e) != DI_OK) {
        fprintf(stderr, "bench_forward: %s: %s\n", config, e.msg);
        return 1;
    }
    const model_config *c = &rm.w->config;
    fwd_options o = {.nextn = c->n_mtp ? c->dspark_block_size : 0, .max_rows = n_prompt,
                     .token_map = rm.token_map, .token_map_pad = rm.token_map_pad};
    fwd_model *m = NULL;
    fwd_run *run = NULL;
    fwd_kv *kv = NULL;
    uint32_t total = n_prompt + n_decode;
    uint32_t nb = (total + 127) / 128;
    if (fwd_model_create(rm.w, &be, &o, &m, &e) != DI_OK || fwd_run_create(m, &run, &e) != DI_OK ||
        fwd_kv_create(fwd_model_geometry(m), &be, nb, 1, &kv, &e) != DI_OK) {
        fprintf(stderr, "bench_forward: %s: %s\n", config, e.msg);
        return 1;
    }
    int32_t *toks = malloc(total * sizeof(int32_t));
    uint32_t *blocks = malloc(nb * sizeof(uint32_t));
    float *logits = malloc((size_t)c->vocab_size * sizeof(float));
    di_rng r;
    di_rng_init(&r, 5);
    for (uint32_t i = 0; i < total; i++)
        toks[i] = 3 + (int32_t)di_rng_below(&r, c->vocab_size - 3);
    for (uint32_t i = 0; i < nb; i++)
        blocks[i] = i;
    uint32_t lb = c->n_engram_layers ? c->engram_max_ngram_size - 1 : 0;
    int32_t last = (int32_t)n_prompt - 1;
    fwd_seq q = {.n_rows = n_prompt, .pos0 = 0, .tokens = toks, .blocks = blocks,
                 .n_blocks = nb, .slot = 0};
    fwd_step st = {.n_seqs = 1, .seqs = &q, .n_logit_rows = 1, .logit_rows = &last};
    uint64_t t0 = di_mono_ns();
    if (fwd_step_run(run, kv, &st, logits, &e) != DI_OK) {
        fprintf(stderr, "bench_forward: %s prefill: %s\n", config, e.msg);
        return 1;
    }
    double prefill_s = (double)(di_mono_ns() - t0) / 1e9;
    int32_t zero = 0;
    uint64_t t1 = di_mono_ns();
    double kv_total = 0;
    for (uint32_t i = 0; i < n_decode; i++) {
        int64_t p = n_prompt + i;
        q = (fwd_seq){.n_rows = 1, .pos0 = p, .tokens = toks + p, .history = toks + p - lb,
                      .n_history = lb, .blocks = blocks, .n_blocks = nb, .slot = 0};
        st = (fwd_step){.n_seqs = 1, .seqs = &q, .n_logit_rows = 1, .logit_rows = &zero};
        if (fwd_step_run(run, kv, &st, logits, &e) != DI_OK) {
            fprintf(stderr, "bench_forward: %s decode: %s\n", config, e.msg);
            return 1;
        }
        kv_total += (double)kv_bytes(c, fwd_model_geometry(m), p);
    }
    double decode_s = (double)(di_mono_ns() - t1) / 1e9;
    uint64_t wbytes = tensor_bytes(&rm.w->head) + tensor_bytes(&rm.w->norm) +
                      (uint64_t)c->dim * 2; /* one embedding row */
    for (uint32_t l = 0; l < c->n_layers; l++)
        wbytes += layer_bytes(&rm.w->layers[l], c->n_activated_experts);
    for (uint32_t s = 0; s < c->n_mtp; s++) /* every step writes the draft rings */
        wbytes += tensor_bytes(&rm.w->drafts[s].block.attn.wkv) +
                  tensor_bytes(&rm.w->drafts[s].block.attn.kv_norm);
    if (c->n_mtp)
        wbytes += tensor_bytes(&rm.w->drafts[0].main_proj) + tensor_bytes(&rm.w->drafts[0].main_norm);
    double step_s = decode_s / n_decode;
    double bytes_step = (double)wbytes + kv_total / n_decode;
    double rate = bytes_step / step_s;
    printf("%-6s threads %u: prefill %u tokens in %.2f s = %.0f tokens/s; decode %u tokens in "
           "%.2f s = %.1f tokens/s (%.2f ms/step); total %.1f s\n",
           config, threads, n_prompt, prefill_s, n_prompt / prefill_s, n_decode, decode_s,
           n_decode / decode_s, step_s * 1e3, prefill_s + decode_s);
    printf("%-6s decode reads %.2f MB/step (weights %.2f MB, KV %.2f MB) = %.2f GB/s = %.1f%% "
           "of the measured memcpy bandwidth %.2f GB/s\n",
           config, bytes_step / 1e6, wbytes / 1e6, kv_total / n_decode / 1e6, rate / 1e9,
           100.0 * rate / bw, bw / 1e9);
    free(toks);
    free(blocks);
    free(logits);
    fwd_kv_free(kv);
    fwd_run_free(run);
    fwd_model_free(m);
    runner_model_free(&rm);
    kern_cpu_destroy(&be);
    return 0;
}

int main(int argc, char **argv)
{
    uint32_t threads = 2, n_prompt = 2048, n_decode = 256;
    const char *configs[8];
    int n_cfg = 0;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--threads") && i + 1 < argc)
            threads = (uint32_t)atoi(argv[++i]);
        else if (!strcmp(argv[i], "--prompt") && i + 1 < argc)
            n_prompt = (uint32_t)atoi(argv[++i]);
        else if (!strcmp(argv[i], "--decode") && i + 1 < argc)
            n_decode = (uint32_t)atoi(argv[++i]);
        else if (!strcmp(argv[i], "--help")) {
            printf("usage: bench_forward [--threads N] [--prompt N] [--decode N] [CONFIG ...]\n");
            return 0;
        } else if (argv[i][0] != '-' && n_cfg < 8)
            configs[n_cfg++] = argv[i];
        else {
            fprintf(stderr, "bench_forward: unknown option %s\n", argv[i]);
            return 2;
        }
    }
    if (threads == 0 || n_prompt == 0 || n_decode == 0) {
        fprintf(stderr, "bench_forward: threads, prompt and decode must be positive\n");
        return 2;
    }
    if (n_cfg == 0) {
        configs[n_cfg++] = "tiny";
        configs[n_cfg++] = "small";
    }
    double bw = memcpy_bandwidth(threads);
    printf("memcpy bandwidth (%u threads, 512 MiB, read + write): %.2f GB/s\n", threads, bw / 1e9);
    int rc = 0;
    for (int i = 0; i < n_cfg; i++)
        rc |= bench(configs[i], threads, n_prompt, n_decode, bw);
    return rc;
}
