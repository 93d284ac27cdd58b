/* process.c: one row's logits -> its processed distribution (steps 1-9 of sampler.h), the
 * integer draw, the residual of a rejected draft, and the workspace behind them.
 *
 * Cost per row of V logits with force top-k K: a key floor from every 128th logit (a radix
 * selection on V/128 keys), one blocked pass over the logits that keeps only tokens at or above
 * the floor (about 2 K of them), an exact radix selection of K among those, K exponentials
 * and a stable radix sort of K pairs. No comparison sort, no allocation. When the floor was
 * too high (fewer than K allowed tokens reach it: structured logits, a tight grammar mask), the
 * pass runs again with no floor, so the result never depends on the estimate.
 */
#include <assert.h>
#include <float.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/sampling/sampler_internal.h"

#define KEY_NEG_INF 0xFF800000u /* bits of -inf */
#define KEY_NEG_ZERO 0x80000000u
/* exp(z) * 2^31 < 1 for z < -31 ln 2 = -21.487: such weights have mass 0. */
#define MASS_ZERO_BELOW (-21.5)

/* ---- workspace ------------------------------------------------------------------------------ */

enum { WS_U32_ARRAYS = 4 + SAMPLER_ALL_SLOTS, WS_I32_ARRAYS = 3 + SAMPLER_ALL_SLOTS };

di_status sampler_workspace_new(uint32_t capacity, sampler_workspace **out, di_error *err)
{
    if (!out)
        return di_fail(err, DI_EINVAL, "sampler workspace: no output pointer");
    if (capacity == 0 || capacity > (1u << 30))
        return di_fail(err, DI_EINVAL, "sampler workspace capacity %u outside [1, 2^30]",
                       capacity);
    sampler_workspace *ws = calloc(1, sizeof(*ws));
    size_t n = capacity;
    void *mem = calloc((size_t)(WS_U32_ARRAYS + WS_I32_ARRAYS) * n, sizeof(uint32_t));
    if (!ws || !mem) {
        free(ws);
        free(mem);
        return di_fail(err, DI_ENOMEM, "out of memory for a sampler workspace of %u tokens",
                       capacity);
    }
    uint32_t *u = mem;
    ws->capacity = capacity;
    ws->mem = mem;
    ws->a_key = u, u += n;
    ws->b_key = u, u += n;
    ws->c_key = u, u += n;
    ws->dense = u, u += n;
    for (int s = 0; s < SAMPLER_ALL_SLOTS; s++)
        ws->slot[s].mass = u, u += n;
    int32_t *i = (int32_t *)u;
    ws->a_id = i, i += n;
    ws->b_id = i, i += n;
    ws->c_id = i, i += n;
    for (int s = 0; s < SAMPLER_ALL_SLOTS; s++)
        ws->slot[s].ids = i, i += n;
    *out = ws;
    return DI_OK;
}

void sampler_workspace_free(sampler_workspace *ws)
{
    if (!ws)
        return;
    free(ws->mem);
    free(ws);
}

/* ---- ordered keys --------------------------------------------------------------------------- */

static inline uint32_t f32_bits(float x)
{
    union {
        float f;
        uint32_t u;
    } v = {.f = x}; /* a union, not memcpy: GCC vectorises loops through it */
    return v.u;
}

static inline float bits_f32(uint32_t b)
{
    float x;
    memcpy(&x, &b, sizeof x);
    return x;
}

/* 1 for NaN (either sign) and +inf: logits no row may carry. */
static inline uint32_t bits_bad(uint32_t b)
{
    return ((b & 0x7FFFFFFFu) > 0x7F800000u) | (b == 0x7F800000u);
}

/* A key whose unsigned order is the float order of the logit: -0 and +0 share a key, -inf is 0
 * ("blocked") and every finite logit maps to >= 0x00800000. Written as selects (no && / &
 * of comparisons) so that GCC vectorises loops over it at -O2. */
static inline uint32_t logit_key(uint32_t b)
{
    uint32_t k = b ^ ((uint32_t)((int32_t)b >> 31) | 0x80000000u);
    k = (b & 0x7FFFFFFFu) == 0 ? 0x80000000u : k;
    return b == KEY_NEG_INF ? 0 : k;
}

static inline float key_logit(uint32_t k)
{
    return bits_f32((k & 0x80000000u) ? k ^ 0x80000000u : ~k);
}

/* The gather pass works on blocks of 32 tokens, one grammar-mask word each. */
#define BLOCK 32
static const uint32_t lane_bit[BLOCK] = {
    1u << 0,  1u << 1,  1u << 2,  1u << 3,  1u << 4,  1u << 5,  1u << 6,  1u << 7,
    1u << 8,  1u << 9,  1u << 10, 1u << 11, 1u << 12, 1u << 13, 1u << 14, 1u << 15,
    1u << 16, 1u << 17, 1u << 18, 1u << 19, 1u << 20, 1u << 21, 1u << 22, 1u << 23,
    1u << 24, 1u << 25, 1u << 26, 1u << 27, 1u << 28, 1u << 29, 1u << 30, 1u << 31};

/* Lanes of the BLOCK logits at x that reach the float threshold thr, as bits; ORs "a lane is
 * NaN or +inf" into *bad. Shaped for the vectoriser: selects and an OR reduction. */
static inline uint32_t block_reach(const float *x, float thr, uint32_t *bad)
{
    uint32_t bits = 0, b_acc = 0;
    for (int j = 0; j < BLOCK; j++) {
        float v = x[j];
        bits |= v >= thr ? lane_bit[j] : 0;
        b_acc |= (v != v) | (v == INFINITY);
    }
    *bad |= b_acc;
    return bits;
}

/* The float whose key is floor_key (>= 1): every finite logit >= -FLT_MAX has a key >=
 * 0x00800000, so floors at or below that are "any finite logit". */
static float floor_logit(uint32_t floor_key)
{
    return floor_key <= 0x00800000u ? -FLT_MAX : key_logit(floor_key);
}

/* Steps 1 and 4 with a filter: appends (key, id) of every allowed token whose key is >=
 * floor_key (>= 1; -inf never passes), in id order; returns the count. *bad is nonzero when a
 * logit is NaN or +inf. */
static uint32_t gather(const sampler_row *row, uint32_t floor_key, uint32_t *ck, int32_t *ci,
                       uint32_t *bad)
{
    const float *x = row->logits;
    const uint32_t *mask = row->grammar_mask;
    uint32_t n = row->n_vocab, m = 0;
    float thr = floor_logit(floor_key);
    *bad = 0;
    for (uint32_t i = 0; i < n; i += BLOCK) {
        uint32_t bits;
        if (n - i >= BLOCK) {
            bits = block_reach(x + i, thr, bad);
        } else {
            float tail[BLOCK];
            for (uint32_t j = 0; j < BLOCK; j++)
                tail[j] = i + j < n ? x[i + j] : -INFINITY;
            bits = block_reach(tail, thr, bad);
        }
        if (mask)
            bits &= mask[i / BLOCK];
        while (bits) {
            uint32_t j = (uint32_t)__builtin_ctz(bits);
            uint32_t key = logit_key(f32_bits(x[i + j]));
            bits &= bits - 1;
            if (key < floor_key)
                continue; /* thr rounds floors below 0x00800000 down; keys decide */
            ck[m] = key;
            ci[m++] = (int32_t)(i + j);
        }
    }
    return m;
}

static inline uint32_t mask_bit(const uint32_t *mask, uint32_t i)
{
    return mask ? (mask[i >> 5] >> (i & 31)) & 1u : 1u;
}

static uint32_t first_bad(const float *logits, uint32_t n)
{
    for (uint32_t i = 0; i < n; i++)
        if (bits_bad(f32_bits(logits[i])))
            return i;
    return n;
}

/* ---- radix selection ---------------------------------------------------------------------- */

/* The bin (walking down from the top) where the count reaches need; *above = entries in the
 * bins above it. need >= 1 and the histogram holds at least need entries. */
static uint32_t digit_pick(const uint32_t *hist, uint32_t bins, uint32_t need, uint32_t *above)
{
    uint32_t cum = 0;
    for (uint32_t b = bins; b-- > 0;) {
        if (cum + hist[b] >= need) {
            *above = cum;
            return b;
        }
        cum += hist[b];
    }
    assert(!"histogram holds fewer entries than needed");
    *above = cum;
    return 0;
}

static void hist_keys(uint32_t *hist, uint32_t bins, const uint32_t *key, uint32_t n,
                      unsigned shift)
{
    memset(hist, 0, bins * sizeof(*hist));
    for (uint32_t i = 0; i < n; i++)
        hist[(key[i] >> shift) & (bins - 1)]++;
}

/* The k-th largest T of key[0 .. n) (1 <= k <= n) by radix selection, and in *eq_take how many
 * keys equal to T are among the k largest. Each round histograms the 11 bits below the keys'
 * common prefix (so even a narrow range of keys spreads over the bins), keeps the bin that
 * holds the k-th largest and repeats on it; at most three rounds. tmp: n keys. */
static uint32_t kth_largest(const uint32_t *key, uint32_t n, uint32_t k, uint32_t *tmp,
                            uint32_t *hist, uint32_t *eq_take)
{
    const uint32_t *src = key;
    uint32_t need = k;
    for (;;) {
        uint32_t lo = UINT32_MAX, hi = 0;
        for (uint32_t i = 0; i < n; i++) {
            lo = src[i] < lo ? src[i] : lo;
            hi = src[i] > hi ? src[i] : hi;
        }
        if (lo == hi) {
            *eq_take = need;
            return lo;
        }
        unsigned top = 31u - (unsigned)__builtin_clz(lo ^ hi);
        unsigned shift = top >= 10 ? top - 10 : 0;
        hist_keys(hist, SAMPLER_HIST_BINS, src, n, shift);
        uint32_t above, d = digit_pick(hist, SAMPLER_HIST_BINS, need, &above);
        need -= above;
        uint32_t m = 0;
        for (uint32_t i = 0; i < n; i++)
            if (((src[i] >> shift) & (SAMPLER_HIST_BINS - 1)) == d)
                tmp[m++] = src[i];
        assert(m >= need && m < n);
        src = tmp;
        n = m;
    }
}

/* Step 5 on a list in id order: keeps the k largest keys, ties to the lower id, in id order. */
static uint32_t keep_top(uint32_t *ck, int32_t *ci, uint32_t m, uint32_t k, uint32_t *tmp,
                         uint32_t *hist)
{
    if (k >= m)
        return m;
    uint32_t eq;
    uint32_t t = kth_largest(ck, m, k, tmp, hist, &eq);
    uint32_t out = 0;
    for (uint32_t i = 0; i < m; i++) {
        if (ck[i] > t || (ck[i] == t && eq > 0)) {
            eq -= ck[i] == t;
            ck[out] = ck[i];
            ci[out++] = ci[i];
        }
    }
    assert(out == k);
    return out;
}

/* A key floor that at least k allowed tokens likely reach: the key of rank 1.5 k / S + 16 in a
 * sample of every S-th token (S = 128 floats, every eighth cache line, so the sample does not
 * read the whole row). For k = 4,096 of 129,280 the floor lets about 2 k tokens through;
 * falling short of k needs 64 sample hits in the top k where 32 +- 5.6 are expected, a miss of
 * over five standard deviations unless the logits have structure at the stride. 1 (keep every
 * allowed token) when k is off or not much smaller than the vocabulary. Only a hint: the
 * caller checks the count it gets. */
#define SAMPLE_STRIDE 128u
static uint32_t floor_estimate(const sampler_row *row, uint32_t k, uint32_t *sample,
                               uint32_t *tmp, uint32_t *hist)
{
    uint32_t n = row->n_vocab;
    if (k == 0 || (uint64_t)k * 8 > n)
        return 1;
    uint32_t ns = 0;
    for (uint32_t i = 0; i < n; i += SAMPLE_STRIDE) {
        uint32_t key = mask_bit(row->grammar_mask, i) ? logit_key(f32_bits(row->logits[i])) : 0;
        if (key)
            sample[ns++] = key;
    }
    uint32_t rank = (uint32_t)((uint64_t)k * 3 / (2 * SAMPLE_STRIDE)) + 16, eq;
    if (ns < rank)
        return 1;
    uint32_t t = kth_largest(sample, ns, rank, tmp, hist, &eq);
    return t ? t : 1;
}

void sampler_sort_pairs(uint32_t *key, int32_t *id, uint32_t n, uint32_t *tmp_key,
                        int32_t *tmp_id, uint32_t *hist)
{
    enum { BINS = SAMPLER_HIST_BINS };
    static const unsigned shift[3] = {0, 11, 22};
    uint32_t *h[3] = {hist, hist + BINS, hist + 2 * BINS};
    if (n < 2)
        return;
    memset(hist, 0, 3 * BINS * sizeof(*hist)); /* all three digits' counts in one read */
    for (uint32_t i = 0; i < n; i++) {
        h[0][key[i] & (BINS - 1)]++;
        h[1][(key[i] >> 11) & (BINS - 1)]++;
        h[2][key[i] >> 22]++;
    }
    uint32_t *sk = key, *dk = tmp_key;
    int32_t *si = id, *di = tmp_id;
    for (int pass = 0; pass < 3; pass++) {
        uint32_t *hp = h[pass];
        if (hp[(sk[0] >> shift[pass]) & (BINS - 1)] == n)
            continue; /* every key has this digit: the pass would not move anything */
        uint32_t sum = 0;
        for (uint32_t b = 0; b < BINS; b++) {
            uint32_t c = hp[b];
            hp[b] = sum;
            sum += c;
        }
        for (uint32_t i = 0; i < n; i++) {
            uint32_t pos = hp[(sk[i] >> shift[pass]) & (BINS - 1)]++;
            dk[pos] = sk[i];
            di[pos] = si[i];
        }
        uint32_t *tk = sk;
        sk = dk, dk = tk;
        int32_t *ti = si;
        si = di, di = ti;
    }
    if (sk != key) {
        memcpy(key, sk, n * sizeof(*key));
        memcpy(id, si, n * sizeof(*id));
    }
}

/* ---- steps 6-8 -------------------------------------------------------------------------------- */

/* Steps 6-7: w = exp((l - l_max) * (1 / T)) (the kernel scales by 1 / T), integer masses of
 * the candidates (c, id order) as sort keys 2^31 - m in a; zero
 * masses dropped. Returns how many remain (>= 1: the top token has mass 2^31). */
static uint32_t weigh(sampler_workspace *ws, uint32_t nc, double temperature)
{
    uint32_t kmax = 0;
    for (uint32_t i = 0; i < nc; i++)
        kmax = ws->c_key[i] > kmax ? ws->c_key[i] : kmax;
    double lmax = key_logit(kmax), inv_t = 1.0 / temperature;
    uint32_t n = 0;
    for (uint32_t i = 0; i < nc; i++) {
        double z = ((double)key_logit(ws->c_key[i]) - lmax) * inv_t;
        if (z < MASS_ZERO_BELOW)
            continue;
        uint32_t m = (uint32_t)(exp(z) * (double)SAMPLER_MASS_ONE);
        if (m == 0)
            continue;
        ws->a_key[n] = SAMPLER_MASS_ONE - m;
        ws->a_id[n++] = ws->c_id[i];
    }
    assert(n >= 1);
    return n;
}

static uint64_t mass_sum(const uint32_t *mass, uint32_t n)
{
    uint64_t s = 0;
    for (uint32_t i = 0; i < n; i++)
        s += mass[i];
    return s;
}

/* Step 8's top-p: the shortest prefix whose mass C satisfies C >= ceil(f * total / 2^24),
 * top_p = f * 2^-24 exactly. */
static uint32_t top_p_cut(const uint32_t *mass, uint32_t n, uint64_t total, float top_p)
{
    if (top_p >= 1.0f)
        return n;
    int e;
    float frac = frexpf(top_p, &e); /* top_p = frac * 2^e, frac in [0.5, 1) */
    uint64_t f = (uint64_t)ldexpf(frac, 24);
    int shift = 24 - e;             /* >= 24 since top_p < 1 */
    unsigned __int128 prod = (unsigned __int128)f * total;
    uint64_t need;
    if (shift >= 100)
        need = 1; /* prod < 2^72: the quotient is 0, its ceiling at most 1 */
    else
        need = (uint64_t)((prod + (((unsigned __int128)1 << shift) - 1)) >> shift);
    need = need ? need : 1;
    uint64_t cum = 0;
    for (uint32_t i = 0; i < n; i++) {
        cum += mass[i];
        if (cum >= need)
            return i + 1;
    }
    return n;
}

/* ---- errors ------------------------------------------------------------------------------------ */

static di_status check_row(const sampler_row *row, const sampler_workspace *ws, di_error *err)
{
    if (!row || !ws)
        return di_fail(err, DI_EINVAL, "sampler: row and workspace are required");
    if (!row->logits || !row->params)
        return di_fail(err, DI_EINVAL, "sampler row %u: logits and params are required",
                       row->row);
    if (row->n_vocab == 0 || row->n_vocab > ws->capacity)
        return di_fail(err, DI_EINVAL, "sampler row: n_vocab %u outside [1, %u] (workspace)",
                       row->n_vocab, ws->capacity);
    return sampling_params_validate(row->params, row->n_vocab, err);
}

static bool eos_banned(const sampler_row *row)
{
    const sampling_params *p = row->params;
    return p->eos_id >= 0 && row->output_index < p->first_n_no_eos;
}

static uint32_t popcount_prefix(const uint32_t *mask, uint32_t n)
{
    uint32_t c = 0;
    for (uint32_t w = 0; w < n / 32; w++)
        c += (uint32_t)__builtin_popcount(mask[w]);
    if (n % 32)
        c += (uint32_t)__builtin_popcount(mask[n / 32] & ((1u << (n % 32)) - 1));
    return c;
}

/* The every-token-blocked failure, with the count each rule blocked. */
static di_status fail_all_blocked(const sampler_row *row, di_error *err)
{
    uint32_t n = row->n_vocab, neg_inf = 0;
    for (uint32_t i = 0; i < n; i++)
        neg_inf += f32_bits(row->logits[i]) == KEY_NEG_INF;
    char grammar[64] = "no grammar mask";
    if (row->grammar_mask)
        snprintf(grammar, sizeof grammar, "the grammar mask allows %u",
                 popcount_prefix(row->grammar_mask, n));
    return di_fail(err, DI_ERANGE,
                   "every token of %u is blocked (%s, blacklist %u, EOS %s, -inf logits %u): "
                   "no token can be sampled; the request fails",
                   n, grammar, row->params->n_blacklist, eos_banned(row) ? "banned" : "allowed",
                   neg_inf);
}

/* ---- steps 1-9 ---------------------------------------------------------------------------------- */

/* Marks token t blocked (key 0) if it is in the id-ordered list. */
static void block_token(uint32_t *ck, const int32_t *ci, uint32_t m, int32_t t)
{
    uint32_t lo = 0, hi = m;
    while (lo < hi) {
        uint32_t mid = lo + (hi - lo) / 2;
        if (ci[mid] < t)
            lo = mid + 1;
        else
            hi = mid;
    }
    if (lo < m && ci[lo] == t)
        ck[lo] = 0;
}

/* Steps 2-3 on a gathered list: drops blacklisted tokens and a banned EOS; returns the count. */
static uint32_t drop_listed(const sampler_row *row, uint32_t *ck, int32_t *ci, uint32_t m)
{
    const sampling_params *p = row->params;
    for (uint32_t i = 0; i < p->n_blacklist; i++)
        block_token(ck, ci, m, p->blacklist[i]);
    if (eos_banned(row))
        block_token(ck, ci, m, p->eos_id);
    uint32_t out = 0;
    for (uint32_t i = 0; i < m; i++) {
        if (ck[i]) {
            ck[out] = ck[i];
            ci[out++] = ci[i];
        }
    }
    return out;
}

/* Steps 1-5: the allowed tokens that force top-k keeps, as (key, id) in id order in ws->c_*.
 * A sampled key floor keeps the gather to a few thousand tokens; when fewer than force_top_k
 * allowed tokens reach it, the gather runs again with no floor, so the result is exact. */
static di_status candidates(const sampler_row *row, sampler_workspace *ws, uint32_t *count,
                            di_error *err)
{
    uint32_t force = row->params->force_top_k, bad;
    uint32_t floor_key = floor_estimate(row, force, ws->a_key, ws->b_key, ws->hist);
    uint32_t m = gather(row, floor_key, ws->c_key, ws->c_id, &bad);
    if (!bad) {
        m = drop_listed(row, ws->c_key, ws->c_id, m);
        if (floor_key > 1 && m < force) {
            m = gather(row, 1, ws->c_key, ws->c_id, &bad);
            m = drop_listed(row, ws->c_key, ws->c_id, m);
        }
    }
    if (bad) {
        uint32_t i = first_bad(row->logits, row->n_vocab);
        return di_fail(err, DI_ERANGE, "logit of token %u is %g: logits must be finite or -inf",
                       i, (double)row->logits[i]);
    }
    if (m == 0)
        return fail_all_blocked(row, err);
    *count = keep_top(ws->c_key, ws->c_id, m, force && force < m ? force : m, ws->b_key,
                      ws->hist);
    return DI_OK;
}

di_status sampler_process_slot(const sampler_row *row, sampler_workspace *ws, unsigned slot,
                               sampler_dist *out, di_error *err)
{
    di_status st = check_row(row, ws, err);
    if (st != DI_OK)
        return st;
    assert(slot < SAMPLER_ALL_SLOTS);
    const sampling_params *p = row->params;
    uint32_t k = 0;
    st = candidates(row, ws, &k, err);
    if (st != DI_OK)
        return st;
    uint32_t m = weigh(ws, k, (double)sampling_params_temperature(p));
    sampler_sort_pairs(ws->a_key, ws->a_id, m, ws->b_key, ws->b_id, ws->hist);
    sampler_slot *s = &ws->slot[slot];
    if (p->top_k > 0 && (uint32_t)p->top_k < m)
        m = (uint32_t)p->top_k;
    for (uint32_t i = 0; i < m; i++) {
        s->ids[i] = ws->a_id[i];
        s->mass[i] = SAMPLER_MASS_ONE - ws->a_key[i];
    }
    m = top_p_cut(s->mass, m, mass_sum(s->mass, m), p->top_p);
    out->n = m;
    out->ids = s->ids;
    out->mass = s->mass;
    out->total = mass_sum(s->mass, m);
    return DI_OK;
}

di_status sampler_process(const sampler_row *row, sampler_workspace *ws, unsigned slot,
                          sampler_dist *out, di_error *err)
{
    if (!out)
        return di_fail(err, DI_EINVAL, "sampler_process: no output distribution");
    if (slot >= SAMPLER_DIST_SLOTS)
        return di_fail(err, DI_EINVAL, "distribution slot %u outside [0, %d]", slot,
                       SAMPLER_DIST_SLOTS - 1);
    return sampler_process_slot(row, ws, slot, out, err);
}

/* ---- lookups and draws ---------------------------------------------------------------------- */

double sampler_dist_logprob(const sampler_dist *d, int32_t token)
{
    for (uint32_t i = 0; i < d->n; i++)
        if (d->ids[i] == token)
            return log((double)d->mass[i]) - log((double)d->total);
    return -INFINITY;
}

uint32_t sampler_pick_index(const uint32_t *mass, uint32_t n, uint64_t total, double u)
{
    assert(n >= 1 && total >= 1 && u >= 0.0 && u < 1.0);
    uint64_t x = (uint64_t)(u * 9007199254740992.0); /* floor(u * 2^53) < 2^53 */
    uint64_t threshold = (uint64_t)(((unsigned __int128)x * total) >> 53);
    uint64_t cum = 0;
    for (uint32_t i = 0; i < n; i++) {
        cum += mass[i];
        if (cum > threshold)
            return i;
    }
    assert(!"threshold below the total");
    return n - 1;
}

static di_status check_dist(const sampler_dist *d, const char *what, uint32_t capacity,
                            di_error *err)
{
    if (!d || d->n == 0 || !d->ids || !d->mass || d->total == 0)
        return di_fail(err, DI_EINVAL, "%s distribution is missing or empty", what);
    uint64_t total = 0;
    for (uint32_t i = 0; i < d->n; i++) {
        if (d->ids[i] < 0 || (uint32_t)d->ids[i] >= capacity)
            return di_fail(err, DI_EINVAL, "%s distribution: token %d outside [0, %u)", what,
                           d->ids[i], capacity);
        total += d->mass[i];
    }
    if (total != d->total)
        return di_fail(err, DI_EINVAL, "%s distribution: masses sum to %llu, total says %llu",
                       what, (unsigned long long)total, (unsigned long long)d->total);
    return DI_OK;
}

static di_status check_u(double u, di_error *err)
{
    if (!(u >= 0.0 && u < 1.0))
        return di_fail(err, DI_EINVAL, "uniform %g outside [0, 1)", u);
    return DI_OK;
}

di_status sampler_dist_pick(const sampler_dist *d, double u, int32_t *token, di_error *err)
{
    di_status st = check_dist(d, "sampled", UINT32_MAX, err);
    if (st == DI_OK)
        st = check_u(u, err);
    if (st == DI_OK && !token)
        st = di_fail(err, DI_EINVAL, "sampler_dist_pick: no output token");
    if (st != DI_OK)
        return st;
    *token = d->ids[sampler_pick_index(d->mass, d->n, d->total, u)];
    return DI_OK;
}

/* The residual max(p_t - p_d e^(-5e-5), 0) as integer mass in draw order, in the residual
 * slot. The draft's masses pass through ws->dense, which is zero again on return. */
static sampler_dist residual_build(const sampler_dist *t, const sampler_dist *d,
                                   sampler_workspace *ws)
{
    for (uint32_t i = 0; i < d->n; i++)
        ws->dense[d->ids[i]] = d->mass[i];
    double scale = exp(SAMPLER_RESIDUAL_LOG_SCALE);
    double tt = (double)t->total, dt = (double)d->total;
    uint32_t n = 0;
    for (uint32_t i = 0; i < t->n; i++) {
        double r = (double)t->mass[i] / tt - (double)ws->dense[t->ids[i]] / dt * scale;
        if (!(r > 0.0))
            continue;
        uint32_t m = (uint32_t)(r * (double)SAMPLER_MASS_ONE);
        if (m == 0)
            continue;
        /* (id, 2^31 - mass) first, to sort by id; then (2^31 - mass, id) by mass. */
        ws->a_key[n] = (uint32_t)t->ids[i];
        ws->a_id[n++] = (int32_t)(SAMPLER_MASS_ONE - m);
    }
    for (uint32_t i = 0; i < d->n; i++)
        ws->dense[d->ids[i]] = 0;
    sampler_sort_pairs(ws->a_key, ws->a_id, n, ws->b_key, ws->b_id, ws->hist);
    for (uint32_t i = 0; i < n; i++) {
        uint32_t id = ws->a_key[i];
        ws->a_key[i] = (uint32_t)ws->a_id[i];
        ws->a_id[i] = (int32_t)id;
    }
    sampler_sort_pairs(ws->a_key, ws->a_id, n, ws->b_key, ws->b_id, ws->hist);
    sampler_slot *s = &ws->slot[SAMPLER_RESIDUAL_SLOT];
    for (uint32_t i = 0; i < n; i++) {
        s->ids[i] = ws->a_id[i];
        s->mass[i] = SAMPLER_MASS_ONE - ws->a_key[i];
    }
    return (sampler_dist){.n = n, .ids = s->ids, .mass = s->mass, .total = mass_sum(s->mass, n)};
}

di_status sampler_residual_pick(const sampler_dist *target, const sampler_dist *draft,
                                uint32_t n_vocab, sampler_workspace *ws, double u,
                                int32_t *token, di_error *err)
{
    if (!ws || !token)
        return di_fail(err, DI_EINVAL, "sampler_residual_pick: workspace and token required");
    if (n_vocab == 0 || n_vocab > ws->capacity)
        return di_fail(err, DI_EINVAL, "n_vocab %u outside [1, %u] (workspace)", n_vocab,
                       ws->capacity);
    di_status st = check_dist(target, "target", n_vocab, err);
    if (st == DI_OK)
        st = check_dist(draft, "draft", n_vocab, err);
    if (st == DI_OK)
        st = check_u(u, err);
    if (st != DI_OK)
        return st;
    sampler_dist r = residual_build(target, draft, ws);
    const sampler_dist *from = r.n ? &r : target;
    *token = from->ids[sampler_pick_index(from->mass, from->n, from->total, u)];
    return DI_OK;
}
