/* placement.c: rank choice and rank health (see placement.h for the formulas and states). */
#include "router/placement.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

pl_config pl_config_default(void)
{
    return (pl_config){.heartbeat_ns = 1000000000ull,
                       .suspect_after = 2,
                       .out_after = 5,
                       .out_after_failures = 3,
                       .healthy_after = 2,
                       .default_prefill_rate = 1000.0,
                       .rate_weight = 0.3};
}

const char *pl_health_name(pl_health h)
{
    return h == PL_HEALTHY ? "healthy" : h == PL_SUSPECT ? "suspect" : "out";
}

di_status pl_init(pl_table *t, const pl_config *cfg, pl_policy policy, const di_logger *log,
                  di_error *err)
{
    if (cfg->heartbeat_ns == 0)
        return di_fail(err, DI_EINVAL, "placement: heartbeat interval must be > 0");
    if (cfg->suspect_after < 1 || cfg->out_after <= cfg->suspect_after)
        return di_fail(err, DI_EINVAL, "placement: need 1 <= suspect_after (%u) < out_after (%u)",
                       cfg->suspect_after, cfg->out_after);
    if (cfg->out_after_failures < 1 || cfg->healthy_after < 1)
        return di_fail(err, DI_EINVAL, "placement: out_after_failures and healthy_after must be "
                       ">= 1");
    if (!(cfg->default_prefill_rate > 0) || !(cfg->rate_weight > 0 && cfg->rate_weight <= 1))
        return di_fail(err, DI_EINVAL, "placement: default rate must be > 0 and the weight in "
                       "(0, 1]");
    memset(t, 0, sizeof *t);
    t->cfg = *cfg;
    t->policy = policy;
    t->log = log;
    return DI_OK;
}

di_status pl_add(pl_table *t, pl_role role, const char *addr, bool registered, uint64_t now_ns,
                 size_t *idx, di_error *err)
{
    size_t len = addr ? strlen(addr) : 0;
    if (len == 0 || len >= PL_ADDR_MAX)
        return di_fail(err, DI_EINVAL, "rank address must have 1..%d bytes", PL_ADDR_MAX - 1);
    for (size_t i = 0; i < t->n; i++)
        if (t->ranks[i].role == role && strcmp(t->ranks[i].addr, addr) == 0) {
            t->ranks[i].registered = t->ranks[i].registered || registered;
            t->ranks[i].last_beat_ns = now_ns;
            *idx = i;
            return DI_OK;
        }
    if (t->n == PL_MAX_RANKS)
        return di_fail(err, DI_ENOSPC, "more than %d ranks", PL_MAX_RANKS);
    pl_rank *r = &t->ranks[t->n];
    memset(r, 0, sizeof *r);
    memcpy(r->addr, addr, len + 1);
    r->role = role;
    r->registered = registered;
    r->health = PL_HEALTHY;
    r->last_beat_ns = now_ns;
    *idx = t->n++;
    return DI_OK;
}

static void set_health(pl_table *t, pl_rank *r, pl_health h, const char *why)
{
    if (r->health == h)
        return;
    if (di_log_enabled(t->log, DI_LOG_DEBUG))
        di_log(t->log, DI_LOG_DEBUG, "rank %s: %s -> %s (%s)", r->addr, pl_health_name(r->health),
               pl_health_name(h), why);
    r->health = h;
    r->goods = 0;
    if (h == PL_HEALTHY)
        r->fails = 0;
}

/* A good sign (heartbeat or call): counts toward coming back. */
static void good(pl_table *t, pl_rank *r, const char *why)
{
    if (r->health == PL_HEALTHY)
        return;
    if (++r->goods >= t->cfg.healthy_after)
        set_health(t, r, PL_HEALTHY, why);
}

void pl_heartbeat(pl_table *t, size_t idx, uint64_t now_ns, const pl_load *load)
{
    if (idx >= t->n)
        return;
    pl_rank *r = &t->ranks[idx];
    r->last_beat_ns = now_ns;
    if (load)
        r->load = *load;
    good(t, r, "heartbeats again");
}

void pl_tick(pl_table *t, uint64_t now_ns)
{
    for (size_t i = 0; i < t->n; i++) {
        pl_rank *r = &t->ranks[i];
        uint64_t missed = now_ns > r->last_beat_ns
                              ? (now_ns - r->last_beat_ns) / t->cfg.heartbeat_ns
                              : 0;
        if (missed >= t->cfg.out_after)
            set_health(t, r, PL_OUT, "missed heartbeats");
        else if (missed >= t->cfg.suspect_after && r->health == PL_HEALTHY)
            set_health(t, r, PL_SUSPECT, "missed heartbeats");
    }
}

void pl_call_result(pl_table *t, size_t idx, bool ok)
{
    if (idx >= t->n)
        return;
    pl_rank *r = &t->ranks[idx];
    if (ok) {
        r->fails = 0;
        good(t, r, "calls succeed");
        return;
    }
    r->goods = 0;
    r->fails++;
    if (r->fails >= t->cfg.out_after_failures)
        set_health(t, r, PL_OUT, "failed calls");
    else if (r->health == PL_HEALTHY)
        set_health(t, r, PL_SUSPECT, "a failed call");
}

void pl_observe_prefill(pl_table *t, size_t idx, uint64_t tokens, double seconds)
{
    if (idx >= t->n || !(seconds > 0) || tokens == 0)
        return;
    pl_rank *r = &t->ranks[idx];
    double rate = (double)tokens / seconds;
    r->rate = r->rate_measured ? (1 - t->cfg.rate_weight) * r->rate + t->cfg.rate_weight * rate
                               : rate;
    r->rate_measured = true;
}

/* A measured rate of r (reported, else observed); 0 when it has none. */
static double measured_rate(const pl_rank *r)
{
    if (r->load.prefill_rate > 0)
        return r->load.prefill_rate;
    return r->rate_measured ? r->rate : 0;
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

/* The rate of a rank not measured yet, before its first prefill's bound: the median of the
 * measured prefill ranks in rotation or suspect, else the configured default. */
static double unmeasured_rate(const pl_table *t)
{
    double rates[PL_MAX_RANKS];
    size_t n = 0;
    for (size_t i = 0; i < t->n; i++)
        if (t->ranks[i].role == PL_PREFILL && t->ranks[i].health != PL_OUT &&
            measured_rate(&t->ranks[i]) > 0)
            rates[n++] = measured_rate(&t->ranks[i]);
    if (n == 0)
        return t->cfg.default_prefill_rate;
    qsort(rates, n, sizeof rates[0], cmp_double);
    return n % 2 ? rates[n / 2] : (rates[n / 2 - 1] + rates[n / 2]) / 2;
}

/* r's rate given the rate of an unmeasured rank (unmeasured_rate). */
static double rate_of(const pl_rank *r, double unmeasured, uint64_t now_ns)
{
    double rate = measured_rate(r);
    if (rate > 0)
        return rate;
    rate = unmeasured;
    if (r->first_sent_ns && now_ns > r->first_sent_ns) {
        double bound = (double)r->first_tokens / ((double)(now_ns - r->first_sent_ns) / 1e9);
        if (bound < rate)
            rate = bound;
    }
    return rate > 1e-3 ? rate : 1e-3;
}

double pl_prefill_rate(const pl_table *t, size_t idx, uint64_t now_ns)
{
    return rate_of(&t->ranks[idx], unmeasured_rate(t), now_ns);
}

/* The health level picks may use for a role: HEALTHY when any is, else SUSPECT, else none. */
static int usable_level(const pl_table *t, pl_role role, size_t exclude)
{
    int best = -1;
    for (size_t i = 0; i < t->n; i++)
        if (t->ranks[i].role == role && i != exclude && t->ranks[i].health != PL_OUT &&
            (best < 0 || (int)t->ranks[i].health < best))
            best = (int)t->ranks[i].health;
    return best;
}

static long pick_rr(pl_table *t, pl_role role, size_t exclude, int level)
{
    for (size_t k = 0; k < t->n; k++) {
        size_t i = (t->rr_next[role] + k) % t->n;
        if (t->ranks[i].role == role && i != exclude && (int)t->ranks[i].health == level) {
            t->rr_next[role] = i + 1;
            return (long)i;
        }
    }
    return -1;
}

long pl_pick_prefill(pl_table *t, uint64_t prompt, uint64_t cached, size_t exclude,
                     uint64_t now_ns, double *est_s)
{
    int level = usable_level(t, PL_PREFILL, exclude);
    if (level < 0)
        return -1;
    uint64_t compute = prompt > cached ? prompt - cached : 0;
    double unmeasured = unmeasured_rate(t);
    long best = -1;
    double best_t = 0;
    if (t->policy == PL_POLICY_ROUND_ROBIN) {
        best = pick_rr(t, PL_PREFILL, exclude, level);
        best_t = (double)(t->ranks[best].load.queued_tokens + compute) /
                 rate_of(&t->ranks[best], unmeasured, now_ns);
    } else {
        for (size_t i = 0; i < t->n; i++) {
            const pl_rank *r = &t->ranks[i];
            if (r->role != PL_PREFILL || i == exclude || (int)r->health != level)
                continue;
            double rate = rate_of(r, unmeasured, now_ns);
            double est = (double)(r->load.queued_tokens + compute) / rate;
            if (di_log_enabled(t->log, DI_LOG_DEBUG))
                di_log(t->log, DI_LOG_DEBUG,
                       "prefill candidate %s: (queued %llu + prompt %llu - cached %llu) / %.0f "
                       "tok/s = %.4f s", r->addr, (unsigned long long)r->load.queued_tokens,
                       (unsigned long long)prompt, (unsigned long long)(prompt - compute),
                       rate, est);
            if (best < 0 || est < best_t) {
                best = (long)i;
                best_t = est;
            }
        }
    }
    pl_rank *b = &t->ranks[best];
    b->load.queued_tokens += compute;
    if (measured_rate(b) == 0 && b->first_sent_ns == 0 && compute > 0) {
        b->first_sent_ns = now_ns ? now_ns : 1;
        b->first_tokens = compute;
    }
    if (di_log_enabled(t->log, DI_LOG_DEBUG))
        di_log(t->log, DI_LOG_DEBUG, "prefill -> %s (%s, estimated start %.4f s)",
               t->ranks[best].addr, t->policy == PL_POLICY_ROUND_ROBIN ? "round-robin" : "estimate",
               best_t);
    if (est_s)
        *est_s = best_t;
    return best;
}

void pl_prefill_done(pl_table *t, size_t idx, uint64_t computed_tokens)
{
    if (idx >= t->n)
        return;
    pl_load *l = &t->ranks[idx].load;
    l->queued_tokens = l->queued_tokens > computed_tokens ? l->queued_tokens - computed_tokens : 0;
    t->ranks[idx].first_sent_ns = 0;
}

long pl_pick_decode(pl_table *t, uint32_t blocks, size_t exclude)
{
    int level = usable_level(t, PL_DECODE, exclude);
    if (level < 0)
        return -1;
    long best = -1;
    if (t->policy == PL_POLICY_ROUND_ROBIN) {
        best = pick_rr(t, PL_DECODE, exclude, level);
    } else {
        for (size_t i = 0; i < t->n; i++) {
            const pl_rank *r = &t->ranks[i];
            if (r->role != PL_DECODE || i == exclude || (int)r->health != level ||
                r->load.free_blocks < blocks)
                continue;
            const pl_rank *b = best >= 0 ? &t->ranks[best] : NULL;
            if (!b || r->load.running < b->load.running ||
                (r->load.running == b->load.running && r->load.free_blocks > b->load.free_blocks))
                best = (long)i;
        }
    }
    if (best < 0)
        return -1;
    pl_rank *r = &t->ranks[best];
    if (di_log_enabled(t->log, DI_LOG_DEBUG))
        di_log(t->log, DI_LOG_DEBUG, "decode -> %s (running %u, free blocks %u, needs %u)",
               r->addr, r->load.running, r->load.free_blocks, blocks);
    r->load.running++;
    r->load.free_blocks = r->load.free_blocks > blocks ? r->load.free_blocks - blocks : 0;
    return best;
}

void pl_decode_done(pl_table *t, size_t idx, uint32_t blocks)
{
    if (idx >= t->n)
        return;
    pl_load *l = &t->ranks[idx].load;
    if (l->running > 0)
        l->running--;
    l->free_blocks += blocks;
}
