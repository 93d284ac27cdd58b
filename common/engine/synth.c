#include "common/engine/synth.h"

#include <string.h>

di_status synth_create(const synth_config *cfg, uint32_t max_entries, const di_alloc *a,
                       synth **out, di_error *err)
{
    if (cfg->vocab_size < 2)
        return di_fail(err, DI_EINVAL, "synthetic vocabulary of %u tokens, want at least 2",
                       cfg->vocab_size);
    if (cfg->nextn > SEQ_MAX_NEXTN)
        return di_fail(err, DI_EINVAL, "nextn %u above %u", cfg->nextn, SEQ_MAX_NEXTN);
    const double rates[5] = {cfg->accept_rate, cfg->eos_rate, cfg->fail_rate,
                             cfg->accept_spread, cfg->conf_noise};
    static const char *const names[5] = {"acceptance rate", "eos rate", "failure rate",
                                         "acceptance spread", "confidence noise"};
    for (int i = 0; i < 5; i++)
        if (!(rates[i] >= 0.0 && rates[i] <= 1.0))
            return di_fail(err, DI_EINVAL, "%s %g outside [0, 1]", names[i], rates[i]);
    if (!(cfg->conf_bias >= -1.0 && cfg->conf_bias <= 1.0))
        return di_fail(err, DI_EINVAL, "confidence bias %g outside [-1, 1]", cfg->conf_bias);
    if (max_entries == 0)
        max_entries = 1;
    synth *y = di_alloc_zero(a, 1, sizeof(*y));
    sched_seq_result *r = di_alloc_zero(a, max_entries, sizeof(*r));
    if (!y || !r) {
        di_alloc_release(a, y);
        di_alloc_release(a, r);
        return di_fail(err, DI_ENOMEM, "out of memory for %u synthetic results", max_entries);
    }
    y->cfg = *cfg;
    y->results = r;
    y->cap = max_entries;
    y->alloc = a;
    di_rng_init(&y->rng, cfg->seed);
    *out = y;
    return DI_OK;
}

void synth_destroy(synth *y)
{
    if (!y)
        return;
    di_alloc_release(y->alloc, y->results);
    di_alloc_release(y->alloc, y);
}

/* A token in [1, vocab) that is not the end token. */
static int32_t synth_token(synth *y)
{
    for (;;) {
        int32_t t = 1 + (int32_t)di_rng_below(&y->rng, y->cfg.vocab_size - 1);
        if (t != y->cfg.eos_token || y->cfg.vocab_size == 2)
            return t;
    }
}

static int32_t synth_sample(synth *y)
{
    if (y->cfg.eos_token >= 0 && y->cfg.eos_rate > 0 && di_rng_uniform(&y->rng) < y->cfg.eos_rate)
        return y->cfg.eos_token;
    return synth_token(y);
}

static double synth_clamp01(double v)
{
    return v < 0.0 ? 0.0 : v > 1.0 ? 1.0 : v;
}

double synth_draft_chance(const synth *y, int32_t t)
{
    if (y->cfg.accept_spread == 0.0)
        return y->cfg.accept_rate;
    double h = di_philox_uniform(0x5eedc0de, (uint64_t)(uint32_t)t, 0);
    return synth_clamp01(y->cfg.accept_rate + y->cfg.accept_spread * (2.0 * h - 1.0));
}

/* The confidence head's view of the new drafts: cumulative products of the reported chances. */
static void synth_confidences(synth *y, sched_seq_result *r)
{
    double run = 1.0;
    for (uint32_t k = 0; k < r->n_drafts; k++) {
        double c = synth_draft_chance(y, r->drafts[k]) + y->cfg.conf_bias;
        if (y->cfg.conf_noise > 0.0)
            c += y->cfg.conf_noise * (2.0 * di_rng_uniform(&y->rng) - 1.0);
        run *= synth_clamp01(c);
        r->draft_conf[k] = (float)run; /* rounding is monotone: the floats never increase */
    }
    r->n_conf = r->n_drafts;
}

static void synth_one(synth *y, const sched_plan *plan, const sched_seq_plan *e,
                      sched_seq_result *r)
{
    *r = (sched_seq_result){.status = SCHED_RESULT_OK, .n_tokens = 1};
    if (e->sample && y->cfg.fail_rate > 0 && di_rng_uniform(&y->rng) < y->cfg.fail_rate) {
        r->status = SCHED_RESULT_FAILED;
        r->n_tokens = 0;
        return;
    }
    uint32_t accepted = 0;
    if (!plan->prompt_run) {
        /* real drafts come first; a pad row (no draft proposed) ends them */
        uint32_t drafts = 0;
        while (drafts + 1 < e->seqlen_q && e->tokens[1 + drafts] != y->cfg.pad_token)
            drafts++;
        while (accepted < drafts &&
               di_rng_uniform(&y->rng) < synth_draft_chance(y, e->tokens[1 + accepted]))
            accepted++;
        y->drafts_checked += drafts;
        y->drafts_accepted += accepted;
        for (uint32_t k = 0; k < accepted; k++)
            r->tokens[k] = e->tokens[1 + k];
    }
    r->tokens[accepted] = synth_sample(y);
    r->n_tokens = accepted + 1;
    r->n_drafts = y->cfg.nextn;
    for (uint32_t k = 0; k < y->cfg.nextn; k++)
        r->drafts[k] = synth_token(y);
    if (y->cfg.confidences)
        synth_confidences(y, r);
}

const sched_seq_result *synth_run(synth *y, const sched_plan *plan)
{
    uint32_t n = plan->n_seqs < y->cap ? plan->n_seqs : y->cap;
    for (uint32_t i = 0; i < n; i++)
        synth_one(y, plan, &plan->seqs[i], &y->results[i]);
    return y->results;
}

static di_status synth_exec_step(void *ctx, const sched_plan *plan, sched_seq_result *results,
                                 di_error *err)
{
    synth *y = ctx;
    if (plan->n_seqs > y->cap && !plan->placeholder)
        return di_fail(err, DI_EINVAL, "synthetic runner: plan of %u entries, made for %u",
                       plan->n_seqs, y->cap);
    const sched_seq_result *r = synth_run(y, plan);
    uint32_t n = plan->n_seqs < y->cap ? plan->n_seqs : y->cap;
    memcpy(results, r, sizeof(*r) * n);
    return DI_OK;
}

engine_executor synth_executor(synth *y)
{
    return (engine_executor){.ctx = y, .step = synth_exec_step};
}
