/* params.c: sampling parameters (the option table, defaults, validation) and the random key. */
#include <assert.h>
#include <float.h>
#include <math.h>
#include <stddef.h>
#include <stdio.h>

#include "common/sampling/sampler_internal.h"
#include "common/util/philox.h"

/* name, type, offset, default, lo, hi, lo_open, has_off, off_value, help */
const sampling_param_spec sampling_param_specs[] = {
    {"temperature", SAMPLING_FIELD_F32, offsetof(sampling_params, temperature), 1.0, 0.0,
     FLT_MAX, false, false, 0, "softmax temperature; 0 becomes 1e-5 and is still drawn"},
    {"top_p", SAMPLING_FIELD_F32, offsetof(sampling_params, top_p), 1.0, 0.0, 1.0, true, false,
     0, "keep the smallest most-likely prefix whose mass reaches top_p"},
    {"top_k", SAMPLING_FIELD_I32, offsetof(sampling_params, top_k), -1, 1, INT32_MAX, false,
     true, -1, "keep the k most likely tokens; -1 = off"},
    {"force_top_k", SAMPLING_FIELD_U32, offsetof(sampling_params, force_top_k),
     SAMPLER_DEFAULT_FORCE_TOP_K, 1, UINT32_MAX, false, true, 0,
     "keep only this many largest logits before temperature; 0 = off"},
    {"first_n_no_eos", SAMPLING_FIELD_U32, offsetof(sampling_params, first_n_no_eos), 0, 0,
     UINT32_MAX, false, false, 0, "the first this many outputs cannot be EOS"},
    {"logprobs", SAMPLING_FIELD_U32, offsetof(sampling_params, n_logprobs), 0, 0,
     SAMPLER_MAX_LOGPROBS, false, false, 0, "top logprobs reported per token (0..20)"},
};
const size_t sampling_param_spec_count = sizeof(sampling_param_specs) / sizeof(sampling_param_specs[0]);

static double spec_get(const sampling_param_spec *s, const sampling_params *p)
{
    const char *base = (const char *)p + s->offset;
    switch (s->type) {
    case SAMPLING_FIELD_F32:
        return *(const float *)base;
    case SAMPLING_FIELD_I32:
        return *(const int32_t *)base;
    case SAMPLING_FIELD_U32:
        return *(const uint32_t *)base;
    }
    assert(!"unknown field type");
    return 0;
}

static void spec_set(const sampling_param_spec *s, sampling_params *p, double v)
{
    char *base = (char *)p + s->offset;
    switch (s->type) {
    case SAMPLING_FIELD_F32:
        *(float *)base = (float)v;
        return;
    case SAMPLING_FIELD_I32:
        *(int32_t *)base = (int32_t)v;
        return;
    case SAMPLING_FIELD_U32:
        *(uint32_t *)base = (uint32_t)v;
        return;
    }
    assert(!"unknown field type");
}

sampling_params sampling_params_default(void)
{
    sampling_params p = {0};
    for (size_t i = 0; i < sampling_param_spec_count; i++)
        spec_set(&sampling_param_specs[i], &p, sampling_param_specs[i].def);
    p.eos_id = -1;
    p.blacklist = NULL;
    p.n_blacklist = 0;
    p.seed = 0;
    return p;
}

static bool spec_ok(const sampling_param_spec *s, double v)
{
    if (isnan(v))
        return false;
    if (s->has_off && v == s->off_value)
        return true;
    if (s->lo_open ? !(v > s->lo) : !(v >= s->lo))
        return false;
    return v <= s->hi;
}

static di_status spec_fail(const sampling_param_spec *s, double v, di_error *err)
{
    char off[48] = "", hi[32] = "inf)";
    if (s->has_off)
        snprintf(off, sizeof off, " (or %g = off)", s->off_value);
    if (s->hi < FLT_MAX)
        snprintf(hi, sizeof hi, "%.10g]", s->hi); /* integers print in full */
    char val[32];
    snprintf(val, sizeof val, s->type == SAMPLING_FIELD_F32 ? "%g" : "%.10g", v);
    return di_fail(err, DI_EINVAL, "%s %s outside %c%g, %s%s", s->name, val,
                   s->lo_open ? '(' : '[', s->lo, hi, off);
}

di_status sampling_params_validate(const sampling_params *p, uint32_t n_vocab, di_error *err)
{
    if (!p)
        return di_fail(err, DI_EINVAL, "sampling parameters missing");
    if (n_vocab == 0)
        return di_fail(err, DI_EINVAL, "vocabulary size must be at least 1");
    for (size_t i = 0; i < sampling_param_spec_count; i++) {
        const sampling_param_spec *s = &sampling_param_specs[i];
        double v = spec_get(s, p);
        if (!spec_ok(s, v))
            return spec_fail(s, v, err);
    }
    if (p->eos_id < -1 || (p->eos_id >= 0 && (uint32_t)p->eos_id >= n_vocab))
        return di_fail(err, DI_EINVAL, "eos_id %d outside [0, %u) (or -1 = none)", p->eos_id,
                       n_vocab);
    if (p->n_blacklist > n_vocab)
        return di_fail(err, DI_EINVAL, "blacklist has %u entries, more than the vocabulary (%u)",
                       p->n_blacklist, n_vocab);
    if (p->n_blacklist > 0 && !p->blacklist)
        return di_fail(err, DI_EINVAL, "blacklist has %u entries but no array", p->n_blacklist);
    for (uint32_t i = 0; i < p->n_blacklist; i++) {
        int32_t t = p->blacklist[i];
        if (t < 0 || (uint32_t)t >= n_vocab)
            return di_fail(err, DI_EINVAL, "blacklist[%u] = %d outside the vocabulary [0, %u)",
                           i, t, n_vocab);
    }
    return DI_OK;
}

float sampling_params_temperature(const sampling_params *p)
{
    return p->temperature == 0.0f ? SAMPLER_MIN_TEMPERATURE : p->temperature;
}

/* ---- random key --------------------------------------------------------------------------- */

uint64_t sampler_prefill_position(uint64_t seqlen_k)
{
    return seqlen_k;
}

uint64_t sampler_decode_position(uint64_t seqlen_k, uint64_t seqlen_q)
{
    assert(seqlen_q >= 1 && seqlen_q <= seqlen_k);
    return seqlen_k - seqlen_q + 1;
}

uint64_t sampler_stream(uint64_t position, uint32_t row, sampler_case kase)
{
    return 3 * (position + (uint64_t)row * SAMPLER_ROW_POSITION_STRIDE) + (uint64_t)kase;
}

uint64_t sampler_draft_seed(uint64_t seed)
{
    return seed + SAMPLER_DRAFT_SEED_OFFSET;
}

double sampler_uniform(uint64_t seed, uint64_t stream)
{
    return di_philox_uniform(seed, stream, 0);
}

uint64_t sampler_row_seed(const sampler_row *row)
{
    return row->draft ? sampler_draft_seed(row->params->seed) : row->params->seed;
}
