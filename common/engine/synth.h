/* synth.h: a synthetic model runner. It turns a step plan into step results without a model:
 * random tokens, each draft accepted with its chance until the first rejection (the prefix
 * rule of rejection sampling), the end token with probability eos_rate, a per-request failure
 * with probability fail_rate. It drives the real scheduler in tests, in the benchmark and in
 * di-sim. Every draw comes from a di_rng seeded by the caller, so a run repeats exactly.
 *
 * A draft's chance is accept_rate, or with accept_spread > 0 a value spread around it that is a
 * pure function of the draft token (so it survives the async fixup that copies tokens):
 * clamp(accept_rate + accept_spread * (2h - 1), 0, 1) with h uniform in [0, 1) hashed from the
 * token. With confidences on, each result also reports the draft model's view of its new
 * drafts, as a confidence head would: the cumulative chance of draft i is the product of the
 * reported chances of drafts 0..i, each the true chance plus conf_bias plus uniform noise in
 * [-conf_noise, conf_noise], clamped to [0, 1]. With bias and noise 0 the confidences are exact
 * (a^(i+1) for a flat rate a: draft 0 passes with a, drafts 0 and 1 with a^2, ...).
 *
 * Accepted drafts are the tokens of the plan's draft rows, so a run under async scheduling
 * must apply sched_plan_fixup first, as the device would.
 */
#ifndef DI_ENGINE_SYNTH_H
#define DI_ENGINE_SYNTH_H

#include <stdint.h>

#include "common/engine/engine.h"
#include "common/engine/scheduler.h"
#include "common/util/alloc.h"
#include "common/util/philox.h"
#include "common/util/status.h"

typedef struct synth_config {
    uint64_t seed;          /* di_rng seed */
    uint32_t nextn;         /* drafts proposed per result (<= SEQ_MAX_NEXTN) */
    uint32_t vocab_size;    /* tokens are drawn from [1, vocab_size); >= 2 */
    int32_t eos_token;      /* end token, -1 for none (never drawn otherwise) */
    int32_t pad_token;      /* the scheduler's pad token: a draft row holding it is no real
                               draft (none proposed yet) and is always rejected; tokens are
                               drawn from [1, vocab), so pad 0 never collides */
    double accept_rate;     /* probability each draft passes, in [0, 1] */
    double eos_rate;        /* probability a sampled token is eos_token, in [0, 1] */
    double fail_rate;       /* probability a sampled entry fails (SCHED_RESULT_FAILED) */
    double accept_spread;   /* spread of each draft's chance around accept_rate, in [0, 1] */
    bool confidences;       /* report cumulative draft confidences with the drafts */
    double conf_bias;       /* added to each reported chance (miscalibration), in [-1, 1] */
    double conf_noise;      /* uniform noise on each reported chance, amplitude in [0, 1] */
} synth_config;

typedef struct synth {
    synth_config cfg;         /* copy */
    di_rng rng;               /* the only source of randomness */
    sched_seq_result *results; /* [cap] results of the last plan */
    uint32_t cap;             /* entries per plan at most */
    const di_alloc *alloc;
    uint64_t drafts_checked;  /* real (non-pad) draft rows verified */
    uint64_t drafts_accepted; /* of those, accepted */
} synth;

/* Creates a runner for plans of at most max_entries entries.
 * DI_OK; DI_EINVAL (a rate, the spread or the noise outside [0, 1], the bias outside [-1, 1],
 * vocab below 2, nextn too big); DI_ENOMEM. */
di_status synth_create(const synth_config *cfg, uint32_t max_entries, const di_alloc *a,
                       synth **out, di_error *err);
/* NULL-safe. */
void synth_destroy(synth *y);
/* Results for every entry of plan (valid until the next call). */
const sched_seq_result *synth_run(synth *y, const sched_plan *plan);
/* The synthetic runner as an engine executor (engine.h): step copies synth_run's results; no
 * per-request state (add and remove are NULL). y must outlive the engine. */
engine_executor synth_executor(synth *y);
/* The chance that draft token t passes (see the top). */
double synth_draft_chance(const synth *y, int32_t t);

#endif
