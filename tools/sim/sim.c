#include "tools/sim/sim.h"

#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/engine/engine.h"
#include "common/engine/graphs.h"
#include "common/engine/synth.h"
#include "common/engine/vote.h"
#include "common/util/clock.h"
#include "common/util/philox.h"

/* ---- distributions ---- */

static di_status sim_num(const char *s, double *out)
{
    char *end;
    double v = strtod(s, &end);
    if (end == s || (*end && *end != ':') || !isfinite(v))
        return DI_EINVAL;
    *out = v;
    return DI_OK;
}

di_status sim_dist_parse(const char *text, sim_dist *out, di_error *err)
{
    sim_dist d = {0};
    const char *colon;
    if (strncmp(text, "uniform:", 8) == 0 && (colon = strchr(text + 8, ':'))) {
        d.kind = SIM_UNIFORM;
        if (sim_num(text + 8, &d.a) || sim_num(colon + 1, &d.b) || strchr(colon + 1, ':'))
            return di_fail(err, DI_EINVAL, "'%s': want uniform:MIN:MAX", text);
    } else if (strncmp(text, "exp:", 4) == 0) {
        d.kind = SIM_EXP;
        if (sim_num(text + 4, &d.a) || strchr(text + 4, ':'))
            return di_fail(err, DI_EINVAL, "'%s': want exp:MEAN", text);
    } else {
        d.kind = SIM_FIXED;
        if (sim_num(text, &d.a) || strchr(text, ':'))
            return di_fail(err, DI_EINVAL, "'%s': want N, uniform:MIN:MAX or exp:MEAN", text);
    }
    if (d.a < 1 || d.a > 1e7 || (d.kind == SIM_UNIFORM && (d.b < d.a || d.b > 1e7)))
        return di_fail(err, DI_EINVAL, "'%s': lengths must be in [1, 10^7], MIN <= MAX", text);
    *out = d;
    return DI_OK;
}

static uint32_t sim_draw(const sim_dist *d, di_rng *rng)
{
    double v = d->a;
    if (d->kind == SIM_UNIFORM)
        v = d->a + (double)di_rng_below(rng, (uint64_t)(d->b - d->a) + 1);
    else if (d->kind == SIM_EXP)
        v = -d->a * log(1.0 - di_rng_uniform(rng));
    v = floor(v + 0.5);
    return v < 1 ? 1 : v > 1e7 ? 10000000u : (uint32_t)v;
}

/* ---- shared state ---- */

typedef struct sim_req {
    uint64_t arrival_ns;    /* workload */
    uint32_t prompt_len;
    uint32_t output_len;    /* tokens to generate in total (COMPLETION: the first is given) */
    uint64_t first_ns;      /* written by the owning rank */
    uint64_t last_ns;
    uint32_t tokens;        /* received */
    sched_finish finish;
    bool done, rejected;
} sim_req;

enum { SIM_SAMPLES = 65536 };

typedef struct sim_rank sim_rank;

typedef struct sim_shared {
    const sim_config *cfg;
    sched_config engine;        /* cfg->engine with the varlen table */
    varlen_graph_time *table;   /* varlen: the step-time table (NULL when off) */
    sim_req *reqs;              /* [requests] */
    vote_group *group;          /* NULL for one rank */
    atomic_uint done;           /* requests with a final output */
    sim_rank *ranks;            /* [ranks] */
} sim_shared;

struct sim_rank {
    sim_shared *sh;
    uint32_t rank;
    engine *e;                  /* the engine loop over the scheduler and the runner below */
    synth *y;
    uint32_t next;              /* next of this rank's requests to add: rank + k * ranks */
    uint64_t now;               /* simulated ns, equal on every rank */
    uint64_t steps;
    int32_t *tok;               /* [max_model_len + 1] prompt buffer */
    double usage_sum, usage_max;
    uint64_t empty_prompt, empty_decode, real_decode, rows, padding, entries;
    uint64_t cpu_n;             /* scheduler steps timed */
    uint64_t *samples;          /* [SIM_SAMPLES] reservoir of per-step ns */
    di_rng res_rng;
    di_status st;
    di_error err;
};

static di_status sim_reduce(sim_rank *r, vote_reduce op, uint64_t v, uint64_t *out)
{
    if (!r->sh->group) {
        *out = v;
        return DI_OK;
    }
    return vote_group_reduce(r->sh->group, r->rank, op, v, out, &r->err);
}

static di_status sim_fail(sim_rank *r, di_status st, const char *what)
{
    if (r->st == DI_OK) {
        r->st = st;
        di_error_prefix(&r->err, "rank %u, step %llu, %s: ", r->rank,
                        (unsigned long long)r->steps, what);
    }
    if (r->sh->group)
        vote_group_cancel(r->sh->group);
    return st;
}

/* ---- requests in, outputs out ---- */

static void sim_request_of(sim_rank *r, uint32_t id, sched_request *q)
{
    const sim_req *w = &r->sh->reqs[id];
    const sched_config *e = &r->sh->cfg->engine;
    uint32_t n = w->prompt_len + 1;
    for (uint32_t i = 0; i < n; i++)
        r->tok[i] = 3 + (int32_t)((id * 7919u + i * 31u) % 30000u);
    *q = (sched_request){.id = id, .prompt = r->tok, .prompt_len = w->prompt_len,
                         .max_tokens = w->output_len, .ignore_eos = true,
                         .arrival_ns = w->arrival_ns};
    if (e->type == SCHED_COMPLETION) {
        q->output = r->tok + w->prompt_len;
        q->output_len = 1;
        q->kv_cached = w->prompt_len;
        q->window_cached = true;
    }
}

/* Adds this rank's requests that have arrived; a full queue holds them back (the router). */
static di_status sim_arrivals(sim_rank *r)
{
    const sim_config *c = r->sh->cfg;
    while (r->next < c->requests && r->sh->reqs[r->next].arrival_ns <= r->now) {
        sched_request q;
        sim_request_of(r, r->next, &q);
        di_status st = engine_add(r->e, &q, NULL, NULL, &r->err);
        if (st == DI_EFULL)
            break;
        if (st == DI_EINVAL) { /* e.g. longer than this rank's cache */
            r->sh->reqs[r->next].rejected = true;
            atomic_fetch_add(&r->sh->done, 1);
        } else if (st != DI_OK) {
            return sim_fail(r, st, "adding a request");
        }
        r->next += c->ranks;
    }
    return DI_OK;
}

/* Every output, stamped with the simulated time: the end of the step that made it (under
 * async, outputs of step N come before N+1 runs, while r->now is still N's end). */
static void sim_output(void *ud, const engine_output *o)
{
    sim_rank *r = ud;
    sim_req *w = &r->sh->reqs[o->request_id];
    if (o->n_tokens) {
        if (!w->tokens)
            w->first_ns = r->now;
        w->last_ns = r->now;
        w->tokens += o->n_tokens;
    }
    if (o->finish == SCHED_FINISH_NONE)
        return;
    w->finish = o->finish;
    w->done = true;
    atomic_fetch_add(&r->sh->done, 1);
    if (o->finish == SCHED_FINISH_HANDOFF) /* saved to the store at once */
        engine_release(r->e, o->request_id, NULL);
}

static void sim_sample(sim_rank *r, uint64_t ns)
{
    if (r->cpu_n < SIM_SAMPLES) {
        r->samples[r->cpu_n] = ns;
    } else {
        uint64_t k = di_rng_below(&r->res_rng, r->cpu_n + 1);
        if (k < SIM_SAMPLES)
            r->samples[k] = ns;
    }
    r->cpu_n++;
}

/* ---- one lockstep step ---- */

static uint64_t sim_step_ns(const sim_config *c, const sched_plan *p)
{
    double ms = p->prompt_run ? c->prefill_ms + c->prefill_ms_per_token * p->n_rows
                              : c->decode_ms + c->decode_ms_per_row * p->graph_rows;
    return (uint64_t)(ms * 1e6 + 0.5);
}

static void sim_count(sim_rank *r, const sched_plan *p)
{
    if (p->placeholder) {
        if (p->prompt_run)
            r->empty_prompt++;
        else
            r->empty_decode++;
    } else if (!p->prompt_run) {
        r->real_decode++;
        r->rows += p->n_rows;
        r->padding += p->padding_rows;
        r->entries += p->n_seqs;
    }
}

/* The rank's executor: the synthetic runner, then the step-time collective (every rank's step
 * takes as long as the slowest). */
static di_status sim_exec_step(void *ctx, const sched_plan *p, sched_seq_result *res,
                               di_error *err)
{
    sim_rank *r = ctx;
    sim_count(r, p);
    engine_executor sx = synth_executor(r->y);
    di_status st = sx.step(sx.ctx, p, res, err);
    if (st != DI_OK)
        return sim_fail(r, st, "the runner");
    uint64_t group_ns;
    if ((st = sim_reduce(r, VOTE_REDUCE_MAX, sim_step_ns(r->sh->cfg, p), &group_ns)) != DI_OK)
        return sim_fail(r, st, "the step-time collective");
    r->now += group_ns;
    r->steps++;
    return DI_OK;
}

static di_status sim_step(sim_rank *r)
{
    di_status st = engine_step(r->e, NULL, &r->err);
    if (st != DI_OK)
        return sim_fail(r, st, "stepping");
    sim_sample(r, engine_get_stats(r->e)->last_sched_ns);
    double u = sched_cache_usage(engine_sched(r->e));
    r->usage_sum += u;
    if (u > r->usage_max)
        r->usage_max = u;
    return DI_OK;
}

/* No rank has work: finish the plan in flight, then jump to the next arrival or stop.
 * *stop is set when every request has arrived. */
static di_status sim_idle(sim_rank *r, bool *stop)
{
    const sim_config *c = r->sh->cfg;
    di_status st = engine_flush(r->e, &r->err);
    if (st != DI_OK)
        return sim_fail(r, st, "processing");
    uint64_t mine = r->next < c->requests ? r->sh->reqs[r->next].arrival_ns : UINT64_MAX;
    uint64_t neg;
    st = sim_reduce(r, VOTE_REDUCE_MAX, UINT64_MAX - mine, &neg);
    if (st != DI_OK)
        return sim_fail(r, st, "the next-arrival collective");
    uint64_t next = UINT64_MAX - neg;
    *stop = next == UINT64_MAX;
    if (!*stop && next > r->now)
        r->now = next;
    return DI_OK;
}

static di_status sim_loop(sim_rank *r)
{
    const sim_config *c = r->sh->cfg;
    for (;;) {
        if (sim_arrivals(r))
            return r->st;
        uint64_t work;
        di_status st = sim_reduce(r, VOTE_REDUCE_WORK, engine_has_work(r->e), &work);
        if (st != DI_OK)
            return sim_fail(r, st, "the work collective");
        if (!work) {
            bool stop;
            if (sim_idle(r, &stop) || stop)
                return r->st;
            continue;
        }
        if (r->steps >= c->max_steps) {
            di_fail(&r->err, DI_EINTERNAL, "stopped after %llu steps with %u of %u requests "
                    "unfinished (raise --max-steps, or give the ranks more blocks)",
                    (unsigned long long)r->steps, c->requests - atomic_load(&r->sh->done),
                    c->requests);
            return sim_fail(r, DI_EINTERNAL, "step cap");
        }
        if (sim_step(r))
            return r->st;
        if (r->rank == 0 && c->progress)
            c->progress(c->progress_userdata, (double)r->now / 1e9, atomic_load(&r->sh->done),
                        c->requests, r->steps);
    }
}

static di_status sim_rank_init(sim_rank *r)
{
    const sim_config *c = r->sh->cfg;
    sched_config e = r->sh->engine;
    vote v;
    if (r->sh->group) {
        v = vote_group_rank(r->sh->group, r->rank);
        e.vote = &v;
    }
    synth_config sc = {.seed = c->seed * 1000003 + r->rank, .nextn = e.nextn,
                       .vocab_size = 32000, .eos_token = -1, .pad_token = e.pad_token,
                       .accept_rate = c->accept_rate, .accept_spread = c->accept_spread,
                       .confidences = e.varlen, .conf_bias = c->conf_bias,
                       .conf_noise = c->conf_noise};
    di_status st = synth_create(&sc, e.max_num_seqs, NULL, &r->y, &r->err);
    if (st != DI_OK)
        return sim_fail(r, st, "creating the runner");
    engine_config ec = {.sched = e, .exec = {.ctx = r, .step = sim_exec_step},
                        .on_output = sim_output, .userdata = r, .clock_ns = di_thread_cpu_ns};
    if ((st = engine_create(&ec, &r->e, &r->err)) != DI_OK)
        return sim_fail(r, st, "creating the scheduler");
    r->samples = calloc(SIM_SAMPLES, sizeof(uint64_t));
    r->tok = calloc((size_t)e.max_model_len + 1, sizeof(int32_t));
    if (!r->samples || !r->tok)
        return sim_fail(r, di_fail(&r->err, DI_ENOMEM, "out of memory"), "samples");
    di_rng_init(&r->res_rng, c->seed + 17 * r->rank);
    r->next = r->rank;
    return DI_OK;
}

static void *sim_thread(void *arg)
{
    sim_rank *r = arg;
    if (sim_rank_init(r) == DI_OK)
        sim_loop(r);
    return NULL;
}

/* ---- workload and results ---- */

/* A length to budget memory with: the longest a bounded distribution draws; for the
 * exponential, whose longest draw is unbounded, four times its mean (many live sequences are
 * summed, so their mean is what counts). At most cap. */
static double sim_dist_max(const sim_dist *d, double cap)
{
    double m = d->kind == SIM_UNIFORM ? d->b : d->kind == SIM_FIXED ? d->a : 4.0 * d->a;
    return m < cap ? m : cap;
}

/* Bytes the run takes at most, about: per rank the block pool (3 counters a block), the
 * scheduler's queues and id map per live request, the prompt buffer, and the live sequences
 * themselves (tokens and block table); plus the workload. */
static double sim_memory_bytes(const sim_config *c)
{
    const sched_config *e = &c->engine;
    double live = (double)e->max_waiting + 4.0 * e->max_num_seqs + e->num_slots;
    double per_rank_reqs = ceil((double)c->requests / c->ranks);
    double seqs = per_rank_reqs < live ? per_rank_reqs : live;
    double len = sim_dist_max(&c->prompt_len, e->max_model_len) +
                 sim_dist_max(&c->output_len, e->max_model_len);
    if (len > e->max_model_len)
        len = e->max_model_len;
    double table = (double)e->max_model_len / 128.0 + 2.0;
    double per_rank = 12.0 * e->num_blocks + 64.0 * live + 4.0 * e->max_model_len +
                      seqs * (256.0 + 4.0 * (len + table));
    return c->ranks * per_rank + 64.0 * c->requests;
}

/* varlen: the step-time model's figures at every recorded graph size. */
static di_status sim_varlen_table(const sim_config *c, varlen_graph_time **out, uint32_t *n,
                                  di_error *err)
{
    const sched_config *e = &c->engine;
    graph_sizes g;
    di_status st = graph_sizes_init(&g, e->max_num_seqs, e->nextn, e->graph_interval, err);
    if (st != DI_OK)
        return st;
    double fixed = c->varlen_decode_ms >= 0 ? c->varlen_decode_ms : c->decode_ms;
    double per_row = c->varlen_ms_per_row >= 0 ? c->varlen_ms_per_row : c->decode_ms_per_row;
    varlen_graph_time *t = malloc(g.count * sizeof(*t));
    if (!t) {
        graph_sizes_free(&g);
        return di_fail(err, DI_ENOMEM, "out of memory for the varlen table");
    }
    for (size_t i = 0; i < g.count; i++)
        t[i] = (varlen_graph_time){g.sizes[i], fixed + per_row * g.sizes[i]};
    *n = (uint32_t)g.count;
    *out = t;
    graph_sizes_free(&g);
    if (!(t[0].step_ms >= VARLEN_MIN_MS)) {
        free(t);
        *out = NULL;
        return di_fail(err, DI_EINVAL, "--varlen needs a step time above 0 at every graph "
                       "size (the table's fixed part and per-row figure are both 0)");
    }
    return DI_OK;
}

static di_status sim_check(const sim_config *c, di_error *err)
{
    if (c->requests == 0 || c->requests > 10000000)
        return di_fail(err, DI_EINVAL, "requests %u outside [1, 10^7]", c->requests);
    if (c->ranks == 0 || c->ranks > 256)
        return di_fail(err, DI_EINVAL, "ranks %u outside [1, 256]", c->ranks);
    if (!(c->rate >= 0 && c->rate < 1e9))
        return di_fail(err, DI_EINVAL, "rate %g outside [0, 10^9)", c->rate);
    if (!(c->accept_rate >= 0 && c->accept_rate <= 1))
        return di_fail(err, DI_EINVAL, "acceptance rate %g outside [0, 1]", c->accept_rate);
    if (!(c->accept_spread >= 0 && c->accept_spread <= 1) ||
        !(c->conf_noise >= 0 && c->conf_noise <= 1) ||
        !(c->conf_bias >= -1 && c->conf_bias <= 1))
        return di_fail(err, DI_EINVAL, "acceptance spread %g and confidence noise %g must be "
                       "in [0, 1], confidence bias %g in [-1, 1]", c->accept_spread,
                       c->conf_noise, c->conf_bias);
    if (!(c->varlen_decode_ms <= 1e6) || !(c->varlen_ms_per_row <= 1e6))
        return di_fail(err, DI_EINVAL, "varlen table figures %g, %g above 10^6 ms",
                       c->varlen_decode_ms, c->varlen_ms_per_row);
    const double t[4] = {c->decode_ms, c->decode_ms_per_row, c->prefill_ms,
                         c->prefill_ms_per_token};
    for (int i = 0; i < 4; i++)
        if (!(t[i] >= 0 && t[i] <= 1e6))
            return di_fail(err, DI_EINVAL, "step-time parameter %g outside [0, 10^6] ms", t[i]);
    if (c->engine.max_model_len < 8)
        return di_fail(err, DI_EINVAL, "max_model_len %u below 8", c->engine.max_model_len);
    if (c->engine.max_num_seqs > 4096)
        return di_fail(err, DI_EINVAL, "max_num_seqs %u above di-sim's 4096",
                       c->engine.max_num_seqs);
    return DI_OK;
}

/* The engine config the ranks use: the caller's, with the varlen table when varlen is on. */
static di_status sim_engine(sim_shared *sh, di_error *err)
{
    const sim_config *c = sh->cfg;
    sh->engine = c->engine;
    sh->engine.vote = NULL;
    sh->engine.alloc = NULL;
    if (c->engine.varlen) {
        di_status st = sim_varlen_table(c, &sh->table, &sh->engine.n_step_ms, err);
        if (st != DI_OK)
            return st;
        sh->engine.step_ms = sh->table;
    }
    di_status st = sched_config_validate(&sh->engine, err);
    if (st != DI_OK)
        return st;
    double need = sim_memory_bytes(c);
    double have = (double)sysconf(_SC_PHYS_PAGES) * (double)sysconf(_SC_PAGE_SIZE);
    if (have > 0 && need > have / 2)
        return di_fail(err, DI_EINVAL, "%u ranks with %u blocks, %u waiting and these lengths "
                       "need about %.1f GB of memory, more than half of this machine's %.1f GB",
                       c->ranks, c->engine.num_blocks, c->engine.max_waiting, need / 1e9,
                       have / 1e9);
    return DI_OK;
}

static void sim_workload(const sim_config *c, sim_req *reqs)
{
    di_rng rng;
    di_rng_init(&rng, c->seed);
    double t = 0;
    uint32_t room = c->engine.max_model_len - 2;
    for (uint32_t i = 0; i < c->requests; i++) {
        if (c->rate > 0)
            t += -log(1.0 - di_rng_uniform(&rng)) / c->rate;
        sim_req *w = &reqs[i];
        w->arrival_ns = (uint64_t)(t * 1e9);
        /* the request must fit max_model_len: clamp the prompt, then the output */
        w->prompt_len = sim_draw(&c->prompt_len, &rng);
        w->output_len = sim_draw(&c->output_len, &rng);
        if (w->prompt_len > room - 2)
            w->prompt_len = room - 2;
        if (w->output_len > room - w->prompt_len)
            w->output_len = room - w->prompt_len;
        if (c->engine.type == SCHED_COMPLETION && w->output_len < 2)
            w->output_len = 2; /* the first token comes with the request */
    }
}

static int sim_cmp(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

/* Percentiles by nearest rank; sorts v. */
static sim_pct sim_pcts(double *v, size_t n)
{
    sim_pct p = {0};
    if (!n)
        return p;
    qsort(v, n, sizeof(double), sim_cmp);
    double sum = 0;
    for (size_t i = 0; i < n; i++)
        sum += v[i];
    p.mean = sum / (double)n;
    p.p50 = v[(size_t)ceil(0.50 * (double)n) - 1];
    p.p90 = v[(size_t)ceil(0.90 * (double)n) - 1];
    p.p99 = v[(size_t)ceil(0.99 * (double)n) - 1];
    p.max = v[n - 1];
    return p;
}

static uint32_t sim_expected(const sim_config *c, const sim_req *w)
{
    if (c->engine.type == SCHED_PROMPT)
        return 1;
    return c->engine.type == SCHED_COMPLETION ? w->output_len - 1 : w->output_len;
}

static di_status sim_latency(const sim_config *c, const sim_req *reqs, sim_result *out)
{
    double *ttft = malloc(sizeof(double) * c->requests);
    double *tpot = malloc(sizeof(double) * c->requests);
    if (!ttft || !tpot) {
        free(ttft);
        free(tpot);
        return DI_ENOMEM;
    }
    size_t nf = 0, np = 0;
    for (uint32_t i = 0; i < c->requests; i++) {
        const sim_req *w = &reqs[i];
        out->prompt_tokens += w->prompt_len;
        if (w->rejected) {
            out->rejected++;
            continue;
        }
        out->output_tokens_expected += sim_expected(c, w);
        out->output_tokens += w->tokens;
        if (w->done) {
            out->finished++;
            out->by_finish[w->finish]++;
        }
        if (w->tokens)
            ttft[nf++] = (double)(w->first_ns - w->arrival_ns) / 1e6;
        if (w->tokens >= 2)
            tpot[np++] = (double)(w->last_ns - w->first_ns) / 1e6 / (w->tokens - 1);
    }
    out->ttft_ms = sim_pcts(ttft, nf);
    out->tpot_ms = sim_pcts(tpot, np);
    out->tpot_count = (uint32_t)np;
    free(ttft);
    free(tpot);
    return DI_OK;
}

static di_status sim_gather(const sim_shared *sh, sim_result *out)
{
    const sim_config *c = sh->cfg;
    uint64_t samples_n = 0, real_decode = 0, rows = 0, padding = 0, entries = 0;
    double usage = 0, checked = 0, accepted = 0;
    for (uint32_t k = 0; k < c->ranks; k++) {
        const sim_rank *r = &sh->ranks[k];
        const sched_stats *st = sched_get_stats(engine_sched(r->e));
        out->prompt_steps += st->prompt_steps;
        out->decode_steps += st->decode_steps;
        out->preempted_stop += st->preempted_stop;
        out->preempted_recompute += st->preempted_recompute;
        out->empty_prompt_steps += r->empty_prompt;
        out->empty_decode_steps += r->empty_decode;
        usage += r->steps ? r->usage_sum / (double)r->steps : 0;
        if (r->usage_max > out->cache_usage_max)
            out->cache_usage_max = r->usage_max;
        checked += (double)r->y->drafts_checked;
        accepted += (double)r->y->drafts_accepted;
        real_decode += r->real_decode;
        rows += r->rows;
        padding += r->padding;
        entries += r->entries;
        out->varlen_no_conf += st->varlen_no_conf;
        samples_n += r->cpu_n < SIM_SAMPLES ? r->cpu_n : SIM_SAMPLES;
        if (r->now > out->sim_seconds * 1e9)
            out->sim_seconds = (double)r->now / 1e9;
    }
    out->group_steps = sh->ranks[0].steps;
    out->cache_usage_mean = usage / c->ranks;
    out->draft_acceptance = checked > 0 ? accepted / checked : 0;
    out->rows_per_decode_step = real_decode ? (double)rows / (double)real_decode : 0;
    out->padding_rows_per_decode_step = real_decode ? (double)padding / (double)real_decode : 0;
    out->draft_rows_per_request = entries ? (double)(rows - entries) / (double)entries : 0;
    double *v = malloc(sizeof(double) * (samples_n ? samples_n : 1));
    if (!v)
        return DI_ENOMEM;
    size_t n = 0;
    for (uint32_t k = 0; k < c->ranks; k++) {
        const sim_rank *r = &sh->ranks[k];
        uint64_t m = r->cpu_n < SIM_SAMPLES ? r->cpu_n : SIM_SAMPLES;
        for (uint64_t i = 0; i < m; i++)
            v[n++] = (double)r->samples[i];
    }
    out->sched_ns_per_step = sim_pcts(v, n);
    free(v);
    return sim_latency(c, sh->reqs, out);
}

static di_status sim_first_error(const sim_shared *sh, di_error *err)
{
    /* a rank's own failure first; the others were only cancelled */
    for (int pass = 0; pass < 2; pass++)
        for (uint32_t k = 0; k < sh->cfg->ranks; k++) {
            const sim_rank *r = &sh->ranks[k];
            if (r->st != DI_OK && (pass || r->st != DI_ECANCELED)) {
                if (err)
                    *err = r->err;
                return r->st;
            }
        }
    return DI_OK;
}

static void sim_free(sim_shared *sh)
{
    for (uint32_t k = 0; sh->ranks && k < sh->cfg->ranks; k++) {
        engine_destroy(sh->ranks[k].e);
        synth_destroy(sh->ranks[k].y);
        free(sh->ranks[k].samples);
        free(sh->ranks[k].tok);
    }
    free(sh->ranks);
    free(sh->reqs);
    free(sh->table);
    vote_group_destroy(sh->group);
}

di_status sim_run(const sim_config *cfg, sim_result *out, di_error *err)
{
    di_status st = sim_check(cfg, err);
    if (st != DI_OK)
        return st;
    uint64_t wall0 = di_mono_ns();
    sim_shared sh = {.cfg = cfg};
    atomic_init(&sh.done, 0);
    if ((st = sim_engine(&sh, err)) != DI_OK) {
        sim_free(&sh);
        return st;
    }
    sh.reqs = calloc(cfg->requests, sizeof(sim_req));
    sh.ranks = calloc(cfg->ranks, sizeof(sim_rank));
    if (!sh.reqs || !sh.ranks) {
        sim_free(&sh);
        return di_fail(err, DI_ENOMEM, "out of memory for %u requests", cfg->requests);
    }
    if (cfg->ranks > 1 && (st = vote_group_create(cfg->ranks, 0, NULL, &sh.group, err))) {
        sim_free(&sh);
        return st;
    }
    sim_workload(cfg, sh.reqs);
    pthread_t *th = calloc(cfg->ranks, sizeof(pthread_t));
    if (!th) {
        sim_free(&sh);
        return di_fail(err, DI_ENOMEM, "out of memory for threads");
    }
    uint32_t started = 0;
    for (uint32_t k = 0; k < cfg->ranks; k++) {
        sh.ranks[k].sh = &sh;
        sh.ranks[k].rank = k;
    }
    for (; started < cfg->ranks; started++)
        if (pthread_create(&th[started], NULL, sim_thread, &sh.ranks[started]) != 0) {
            sim_fail(&sh.ranks[started], di_fail(&sh.ranks[started].err, DI_EINTERNAL,
                                                 "cannot start a thread"), "start");
            break;
        }
    for (uint32_t k = 0; k < started; k++)
        pthread_join(th[k], NULL);
    free(th);
    st = sim_first_error(&sh, err);
    if (st == DI_OK) {
        sim_result r = {.requests = cfg->requests};
        st = sim_gather(&sh, &r);
        r.wall_seconds = (double)(di_mono_ns() - wall0) / 1e9;
        if (st == DI_OK)
            *out = r;
        else
            di_fail(err, st, "out of memory for the statistics");
    }
    sim_free(&sh);
    return st;
}
