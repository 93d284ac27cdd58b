/* CPU ops: Engram n-gram hashing, table lookup and the gated residual update. */
#include <stdlib.h>

#include "kernels/cpu/cpu_internal.h"

/* ---- hashing ---- */

#define ENGRAM_MAX_NGRAM 8

/* Token id at position pos of sequence q, from the step's rows or the sequence history. */
static int32_t token_at(const kern_engram_hash *p, const kern_seq *q, int64_t pos)
{
    if (pos >= q->pos0)
        return (p->ids_dev ? p->ids_dev : p->ids)[q->row0 + (pos - q->pos0)];
    int64_t h = pos - (q->pos0 - (int64_t)q->n_history);
    assert(h >= 0 && q->history);
    return q->history[h];
}

static di_status cpu_engram_hash(void *ctx, const kern_engram_hash *p)
{
    assert(p->max_ngram >= 2 && p->max_ngram <= ENGRAM_MAX_NGRAM);
    uint32_t cols = (p->max_ngram - 1) * p->n_heads;
    for (uint32_t t = 0; t < p->n_rows; t++) {
        const kern_seq *q = &p->seqs[p->row_seq[t]];
        int64_t pos = q->pos0 + (t - q->row0);
        uint64_t tok[ENGRAM_MAX_NGRAM];
        int blocked = 0;
        for (uint32_t i = 0; i < p->max_ngram; i++) {
            if (pos - (int64_t)i < 0)
                blocked = 1; /* sticky: this and every further lookback is padding */
            if (blocked) {
                tok[i] = (uint64_t)p->pad_id;
            } else {
                int32_t id = token_at(p, q, pos - i);
                if (id < 0 || (uint32_t)id >= p->vocab) /* host ids were checked; these not */
                    return DI_EINVAL;
                tok[i] = (uint64_t)p->token_map[id];
            }
        }
        for (uint32_t l = 0; l < p->n_layers; l++) {
            const uint64_t *m = p->multipliers + (size_t)l * p->max_ngram;
            const uint64_t *pr = p->primes + (size_t)l * cols;
            const uint64_t *off = p->offsets + (size_t)l * cols;
            int64_t *out = p->out + ((size_t)t * p->n_layers + l) * cols;
            uint64_t r = tok[0] * m[0];
            for (uint32_t n = 1; n < p->max_ngram; n++) {
                r ^= tok[n] * m[n];
                for (uint32_t k = 0; k < p->n_heads; k++) {
                    uint32_t col = (n - 1) * p->n_heads + k;
                    out[col] = (int64_t)(r % pr[col] + off[col]);
                }
            }
        }
    }
    return DI_OK;
}

/* ---- lookup ---- */

typedef struct lookup_job {
    const cpu_ctx *c;
    const kern_engram_lookup *p;
} lookup_job;

static void lookup_rows(void *arg, uint32_t r0, uint32_t r1, uint32_t worker)
{
    lookup_job *j = arg;
    const kern_engram_lookup *p = j->p;
    uint32_t hd = p->head_dim;
    uint8_t codes[4096], scales[128];
    assert(hd <= 4096);
    for (uint32_t t = r0; t < r1; t++) {
        for (uint32_t col = 0; col < p->n_cols; col++) {
            int64_t row = p->hash[(size_t)t * p->hash_stride + col];
            assert(row >= 0 && (uint64_t)row < p->table_rows);
            const uint8_t *cd, *sc;
            if (p->table) {
                cd = p->table + (size_t)row * hd;
                sc = p->table_scale + (size_t)row * (hd / 32);
            } else {
                p->row_fn(p->row_userdata, (uint64_t)row, codes, scales);
                cd = codes;
                sc = scales;
            }
            uint16_t *out = p->out + ((size_t)t * p->n_cols + col) * hd;
            for (uint32_t i = 0; i < hd; i++)
                out[i] = to_bf(j->c->e4m3[cd[i]] * j->c->ue8m0[sc[i / 32]]);
        }
    }
}

static di_status cpu_engram_lookup(void *ctx, const kern_engram_lookup *p)
{
    assert(p->head_dim % 32 == 0 && (p->table || p->row_fn));
    lookup_job j = {ctx, p};
    cpu_for(ctx, p->n_rows, 32, lookup_rows, &j);
    return DI_OK;
}

/* ---- gate ---- */

typedef struct gate_job {
    const kern_engram_gate *p;
} gate_job;

static void gate_rows(void *arg, uint32_t r0, uint32_t r1, uint32_t worker)
{
    const kern_engram_gate *p = ((gate_job *)arg)->p;
    uint32_t D = p->dim, hc = p->n_copies;
    float *hf = cpu_xmalloc((size_t)D * sizeof(float));
    float *kf = cpu_xmalloc((size_t)D * sizeof(float));
    float *hw = cpu_xmalloc((size_t)D * sizeof(float));
    assert(hf && kf && hw);
    for (uint32_t t = r0; t < r1; t++) {
        const uint16_t *kv = p->kv + (size_t)t * (hc + 1) * D;
        const uint16_t *value = kv + (size_t)hc * D;
        for (uint32_t c = 0; c < hc; c++) {
            uint16_t *h = p->h + ((size_t)t * hc + c) * D;
            cpu_bf16_to_f32(h, hf, D);
            cpu_bf16_to_f32(kv + (size_t)c * D, kf, D);
            /* w = fp32(q * k) (exact); rstd per copy in double; dot = fp32(fp32(fp32(sum) *
             * fp32(r_h * r_k)) / fp32(sqrt(D))); gate in double */
            for (uint32_t d = 0; d < D; d++)
                hw[d] = hf[d] * (bf(p->q_weight[(size_t)c * D + d]) * bf(p->k_weight[(size_t)c * D + d]));
            double rh = 1.0 / sqrt((double)(float)(cpu_sumsq(hf, D) / D) + p->eps);
            double rk = 1.0 / sqrt((double)(float)(cpu_sumsq(kf, D) / D) + p->eps);
            float dot = ((float)cpu_dot(hw, kf, D) * (float)(rh * rk)) / (float)sqrt((double)D);
            double mag = fabs((double)dot) > p->clamp ? fabs((double)dot) : p->clamp;
            double sgn = dot > 0.0f ? 1.0 : (dot < 0.0f ? -1.0 : 0.0);
            double gate = (float)sigmoid_d(sgn * sqrt(mag));
            for (uint32_t d = 0; d < D; d++)
                h[d] = to_bf((float)((double)hf[d] + gate * (double)bf(value[d])));
        }
    }
    free(hf);
    free(kf);
    free(hw);
}

static di_status cpu_engram_gate(void *ctx, const kern_engram_gate *p)
{
    gate_job j = {p};
    cpu_for(ctx, p->n_rows, 16, gate_rows, &j);
    return DI_OK;
}

void cpu_ops_engram(kern_ops *ops)
{
    ops->engram_hash = cpu_engram_hash;
    ops->engram_lookup = cpu_engram_lookup;
    ops->engram_gate = cpu_engram_gate;
}
