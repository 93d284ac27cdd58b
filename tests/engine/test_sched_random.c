/* Random workloads against the real scheduler: random arrivals, prompt and output lengths,
 * prefix hits, holds, aborts, forks, acceptance counts, end tokens, per-request failures,
 * preemption in both modes, async on and off, MTP varlen on and off (with noisy draft
 * confidences), one rank and a group of three. sched_check runs
 * after every schedule and every process; at the end every request has had exactly one final
 * output, its token count adds up, and every block and slot is back.
 *
 * Ranks run as threads, so failures are recorded (first one per rank) and asserted on the main
 * thread; a failing rank cancels the vote group so the others stop. */
#include <criterion/criterion.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>

#include "common/engine/prefix.h"
#include "common/engine/scheduler.h"
#include "common/engine/synth.h"

enum { R_IDS = 6000, R_STEPS = 2500, R_MAX_RANKS = 3 };

typedef struct rcase {
    sched_engine_type type;
    bool async;
    sched_preempt_mode mode;
    uint32_t ranks;
    uint64_t seed;
    bool varlen;
} rcase;

typedef struct rrank {
    const rcase *c;
    uint32_t rank;
    vote_group *group;           /* NULL for one rank */
    sched *s;
    synth *y;
    di_rng rng;
    uint64_t base;               /* request ids are base + k */
    uint32_t n_ids;              /* ids handed out */
    uint8_t finals[R_IDS];       /* final outputs per id */
    uint8_t added[R_IDS];        /* the id was accepted by the scheduler */
    uint32_t got[R_IDS];         /* tokens received */
    uint32_t pre[R_IDS];         /* tokens generated before it was added */
    uint32_t held_since[R_IDS];  /* PROMPT: step its handoff arrived, + 1 */
    uint32_t hold_until[R_IDS];  /* added with hold: step it becomes schedulable */
    uint64_t steps, outputs;
    uint64_t aborted, forked;    /* aborts that ended a request, forks made */
    uint32_t blocks0, slots0;
    uint64_t digest;             /* hash of every plan's entries (request, rows, position) */
    uint64_t varlen_rows;        /* decode rows varlen saved: (1 + nextn) per entry - rows */
    int failed;
    char msg[400];
    sched_seq_result keep[64];   /* results of the plan in flight (async) */
} rrank;

#define RFAIL(rk, ...)                                                                       \
    do {                                                                                     \
        rfail(rk, __FILE__, __LINE__, __VA_ARGS__);                                          \
        return -1;                                                                           \
    } while (0)

static void rfail(rrank *rk, const char *file, int line, const char *fmt, ...)
{
    if (rk->failed)
        return;
    rk->failed = 1;
    int n = snprintf(rk->msg, sizeof(rk->msg), "rank %u step %llu (%s:%d): ", rk->rank,
                     (unsigned long long)rk->steps, file, line);
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(rk->msg + n, sizeof(rk->msg) - (size_t)n, fmt, ap);
    va_end(ap);
    if (rk->group)
        vote_group_cancel(rk->group);
}

static int rcheck(rrank *rk)
{
    di_error e;
    if (sched_check(rk->s, &e) != DI_OK)
        RFAIL(rk, "invariant: %s", e.msg);
    return 0;
}

static int rtake(rrank *rk, const sched_output *o, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        uint64_t k = o[i].request_id - rk->base;
        if (k >= rk->n_ids || !rk->added[k])
            RFAIL(rk, "output for unknown request %llu", (unsigned long long)o[i].request_id);
        if (rk->finals[k])
            RFAIL(rk, "request %llu: output after its final one", (unsigned long long)k);
        rk->got[k] += o[i].n_tokens;
        rk->outputs++;
        if (o[i].finish == SCHED_FINISH_NONE)
            continue;
        rk->finals[k]++;
        if (o[i].n_generated != rk->pre[k] + rk->got[k])
            RFAIL(rk, "request %llu: n_generated %u, received %u + %u before", (unsigned long long)k,
                  o[i].n_generated, rk->got[k], rk->pre[k]);
        if (o[i].finish == SCHED_FINISH_HANDOFF)
            rk->held_since[k] = (uint32_t)rk->steps + 1;
    }
    return 0;
}

static uint32_t rnd(rrank *rk, uint32_t n) { return (uint32_t)di_rng_below(&rk->rng, n); }
static bool chance(rrank *rk, double p) { return di_rng_uniform(&rk->rng) < p; }

/* A prefix hit for a prompt of len tokens from a random store (NORMAL and PROMPT). */
static void rhit(rrank *rk, sched_request *r, uint32_t len)
{
    bool w[8];
    for (int i = 0; i < 8; i++)
        w[i] = chance(rk, 0.5);
    prefix_hit h;
    if (prefix_hit_compute(len, 134, rnd(rk, 6), w, 8, &h, NULL) != DI_OK)
        return;
    r->kv_cached = h.kv_tokens;
    r->replay = h.replay_tokens;
    r->window_cached = h.load_window;
}

static int radd(rrank *rk)
{
    static __thread int32_t tok[900];
    if (rk->n_ids >= R_IDS)
        return 0;
    uint32_t k = rk->n_ids++;
    uint32_t len = 1 + rnd(rk, chance(rk, 0.1) ? 800 : 300);
    for (uint32_t i = 0; i < len + 1; i++)
        tok[i] = 1 + (int32_t)rnd(rk, 500);
    sched_request r = {.id = rk->base + k, .prompt = tok, .prompt_len = len,
                       .max_tokens = 1 + rnd(rk, 250), .ignore_eos = chance(rk, 0.3),
                       .has_grammar = chance(rk, 0.1), .hold = chance(rk, 0.05)};
    if (chance(rk, 0.2)) {
        r.stop_ids = tok + len;
        r.n_stop_ids = 1;
    }
    if (rk->c->type == SCHED_COMPLETION) {
        r.prompt_len = len;
        r.output = tok + len;
        r.output_len = 1;
        r.max_tokens += 1;
        r.kv_cached = len;
        r.window_cached = true;
        r.stop_ids = NULL;
        r.n_stop_ids = 0;
    } else if (len >= 300 && chance(rk, 0.3)) {
        rhit(rk, &r, len);
    }
    di_error e;
    di_status st = sched_add_request(rk->s, &r, &e);
    if (st == DI_EFULL)
        return 0;
    if (st != DI_OK)
        RFAIL(rk, "add: %s", e.msg);
    rk->added[k] = 1;
    rk->pre[k] = r.output_len;
    if (r.hold)
        rk->hold_until[k] = (uint32_t)rk->steps + 1 + rnd(rk, 30);
    return 0;
}

/* A random live id, or UINT64_MAX. */
static uint64_t rpick(rrank *rk)
{
    for (int tries = 0; tries < 8 && rk->n_ids; tries++) {
        uint32_t k = rnd(rk, rk->n_ids);
        if (rk->added[k] && !rk->finals[k])
            return k;
    }
    return UINT64_MAX;
}

static int rabort(rrank *rk, uint64_t k)
{
    sched_output out;
    di_error e;
    di_status st = sched_abort(rk->s, rk->base + k, &out, &e);
    if (st == DI_ENOENT)
        return 0; /* ended and released already */
    if (st != DI_OK)
        RFAIL(rk, "abort: %s", e.msg);
    if (out.finish == SCHED_FINISH_NONE)
        return 0;
    rk->aborted++;
    return rtake(rk, &out, 1);
}

static int rfork(rrank *rk, uint64_t k)
{
    const seq *q = sched_find(rk->s, rk->base + k);
    if (!q || q->where != SEQ_IN_RUNNING || rk->n_ids >= R_IDS)
        return 0;
    uint32_t c = rk->n_ids++;
    sched_request r = {.id = rk->base + c, .max_tokens = 1 + rnd(rk, 60)};
    di_error e;
    di_status st = sched_fork(rk->s, rk->base + k, &r, &e);
    if (st == DI_EFULL || st == DI_EINVAL)
        return 0; /* no block for the copy, queue full, or too long */
    if (st != DI_OK)
        RFAIL(rk, "fork: %s", e.msg);
    rk->added[c] = 1;
    rk->forked++;
    return 0;
}

/* Random events of one step: arrivals, holds lifted, aborts, forks, handoffs released. */
static int revents(rrank *rk, bool arrivals)
{
    if (arrivals && chance(rk, 0.35))
        for (uint32_t n = 1 + rnd(rk, 3); n; n--)
            if (radd(rk))
                return -1;
    uint64_t k;
    for (uint32_t i = 0; i < rk->n_ids; i++)
        if (rk->hold_until[i] && (!arrivals || rk->steps >= rk->hold_until[i])) {
            sched_set_schedulable(rk->s, rk->base + i, NULL); /* ENOENT once aborted */
            rk->hold_until[i] = 0;
        }
    if (arrivals && chance(rk, 0.04) && (k = rpick(rk)) != UINT64_MAX && rabort(rk, k))
        return -1;
    if (arrivals && chance(rk, 0.06) && (k = rpick(rk)) != UINT64_MAX && rfork(rk, k))
        return -1;
    for (uint32_t i = 0; i < rk->n_ids; i++)
        if (rk->held_since[i] && (!arrivals || rk->steps + 1 - rk->held_since[i] > 3)) {
            if (sched_release(rk->s, rk->base + i, NULL) != DI_OK)
                RFAIL(rk, "release of handoff %u", i);
            rk->held_since[i] = 0;
        }
    return rcheck(rk);
}

static int rprocess(rrank *rk, sched_plan *p, const sched_seq_result *r)
{
    const sched_output *o;
    size_t n;
    di_error e;
    if (sched_process_outputs(rk->s, p, r, p->placeholder ? 0 : p->n_seqs, &o, &n, &e) != DI_OK)
        RFAIL(rk, "process: %s", e.msg);
    if (rtake(rk, o, n))
        return -1;
    return rcheck(rk);
}

static uint64_t rmix(uint64_t h, uint64_t v)
{
    h ^= v + 0x9E3779B97F4A7C15ull + (h << 6) + (h >> 2);
    return h * 0xff51afd7ed558ccdull;
}

/* Folds the plan into the run's digest (after the fixup: the rows the runner sees). */
static void rdigest(rrank *rk, const sched_plan *p)
{
    uint64_t h = rmix(rk->digest, p->graph_rows);
    uint32_t full = 1 + sched_get_config(rk->s)->nextn;
    for (uint32_t i = 0; i < p->n_seqs; i++) {
        const sched_seq_plan *e = &p->seqs[i];
        h = rmix(h, e->request_id);
        h = rmix(h, ((uint64_t)e->seqlen_q << 32) | e->first_position);
        if (!p->prompt_run && !p->placeholder && e->seqlen_q < full)
            rk->varlen_rows += full - e->seqlen_q;
    }
    rk->digest = h;
}

/* One step of the driver loop; *prev holds the plan in flight under async. */
static int rstep(rrank *rk, sched_plan **prev)
{
    sched_plan *p;
    di_error e;
    if (sched_schedule(rk->s, &p, &e) != DI_OK)
        RFAIL(rk, "schedule: %s", e.msg);
    if (rcheck(rk))
        return -1;
    rk->steps++;
    if (p->placeholder && (p->n_seqs != 1 || p->seqs[0].block_table[0] != 0))
        RFAIL(rk, "a placeholder is one row in block 0");
    if (!p->prompt_run && (p->graph_rows < p->n_rows || p->padding_rows != p->graph_rows -
                                                                           p->n_rows))
        RFAIL(rk, "graph %u for %u rows", p->graph_rows, p->n_rows);
    if (*prev) {
        if (rprocess(rk, *prev, rk->keep))
            return -1;
        sched_plan_fixup(p, *prev, rk->keep);
        *prev = NULL;
    }
    const sched_seq_result *r = synth_run(rk->y, p);
    rdigest(rk, p);
    if (!rk->c->async || p->process_now)
        return rprocess(rk, p, r);
    memcpy(rk->keep, r, sizeof(sched_seq_result) * p->n_seqs);
    *prev = p;
    return 0;
}

static int rsetup(rrank *rk)
{
    sched_config cfg;
    sched_config_default(&cfg);
    cfg.type = rk->c->type;
    cfg.async = rk->c->async;
    cfg.preempt_mode = rk->c->mode;
    cfg.max_num_seqs = 12;
    cfg.num_slots = 24;
    cfg.num_blocks = 32;
    cfg.max_num_batched_tokens = 256;
    cfg.max_model_len = 1200;
    cfg.max_waiting = 40;
    cfg.prefill_attempt_interval = 7;
    cfg.prefill_any_attempt_interval = 10;
    cfg.eos_token = 2;
    cfg.vocab_size = 600;
    /* varlen: a step-time model with a heavy per-row term, so the scan drops drafts often;
     * every recorded size (1, 2, 4, 8, 16, ..., 72) measured */
    static const uint32_t sizes[] = {1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64, 72};
    varlen_graph_time times[12];
    for (int i = 0; i < 12; i++)
        times[i] = (varlen_graph_time){sizes[i], 8.8 + 0.08 * sizes[i]};
    cfg.varlen = rk->c->varlen;
    cfg.step_ms = times;
    cfg.n_step_ms = 12;
    cfg.sampler_ms = 0.3;
    vote v;
    if (rk->group) {
        v = vote_group_rank(rk->group, rk->rank);
        cfg.vote = &v;
    }
    di_error e;
    if (sched_create(&cfg, &rk->s, &e) != DI_OK)
        RFAIL(rk, "create: %s", e.msg);
    synth_config sc = {.seed = rk->c->seed * 977 + rk->rank, .nextn = cfg.nextn,
                       .vocab_size = 600, .eos_token = 2, .accept_rate = 0.6,
                       .eos_rate = 0.02, .fail_rate = 0.003};
    if (rk->c->varlen) {
        sc.confidences = true;
        sc.accept_spread = 0.35;
        sc.conf_noise = 0.1;
    }
    if (synth_create(&sc, cfg.max_num_seqs, NULL, &rk->y, &e) != DI_OK)
        RFAIL(rk, "synth: %s", e.msg);
    di_rng_init(&rk->rng, rk->c->seed * 131 + rk->rank);
    rk->base = (uint64_t)rk->rank * 1000000;
    rk->blocks0 = sched_free_blocks(rk->s);
    rk->slots0 = sched_free_slots(rk->s);
    return 0;
}

/* Every request ended once, its tokens add up, every block and slot is back. */
static int rfinal(rrank *rk)
{
    if (sched_num_live(rk->s) || sched_num_in_flight(rk->s))
        RFAIL(rk, "%u live, %u in flight at the end", sched_num_live(rk->s),
              sched_num_in_flight(rk->s));
    if (sched_free_blocks(rk->s) != rk->blocks0 || sched_free_slots(rk->s) != rk->slots0)
        RFAIL(rk, "free blocks %u (start %u), slots %u (start %u)", sched_free_blocks(rk->s),
              rk->blocks0, sched_free_slots(rk->s), rk->slots0);
    for (uint32_t k = 0; k < rk->n_ids; k++)
        if (rk->added[k] && rk->finals[k] != 1)
            RFAIL(rk, "request %u: %u final outputs", k, rk->finals[k]);
    return 0;
}

/* The lockstep loop of one rank: random events for R_STEPS steps, then no arrivals until the
 * group has no work; then the plan in flight is processed and everything checked. */
static int rrun(rrank *rk)
{
    if (rsetup(rk))
        return -1;
    sched_plan *prev = NULL;
    for (;;) {
        bool arrivals = rk->steps < R_STEPS;
        if (revents(rk, arrivals))
            return -1;
        bool more;
        di_error e;
        if (sched_group_has_work(rk->s, &more, &e) != DI_OK)
            RFAIL(rk, "has_work: %s", e.msg);
        if (!more && !arrivals)
            break;
        if (rk->steps > 20 * R_STEPS)
            RFAIL(rk, "no progress");
        if (rstep(rk, &prev))
            return -1;
    }
    if (prev && rprocess(rk, prev, rk->keep))
        return -1;
    if (revents(rk, false))
        return -1;
    return rfinal(rk);
}

static void *rthread(void *arg)
{
    rrun(arg);
    return NULL;
}

static void rcase_run(const rcase *c)
{
    static rrank ranks[R_MAX_RANKS];
    vote_group *g = NULL;
    if (c->ranks > 1)
        cr_assert_eq(vote_group_create(c->ranks, 20000, NULL, &g, NULL), DI_OK);
    pthread_t th[R_MAX_RANKS];
    for (uint32_t r = 0; r < c->ranks; r++) {
        memset(&ranks[r], 0, sizeof(ranks[r]));
        ranks[r].c = c;
        ranks[r].rank = r;
        ranks[r].group = g;
        if (g)
            pthread_create(&th[r], NULL, rthread, &ranks[r]);
        else
            rrun(&ranks[r]);
    }
    for (uint32_t r = 0; g && r < c->ranks; r++)
        pthread_join(th[r], NULL);
    uint64_t steps = ranks[0].steps;
    for (uint32_t r = 0; r < c->ranks; r++) {
        rrank *rk = &ranks[r];
        cr_assert(!rk->failed, "%s engine, async %d, %s, varlen %d, %u ranks, seed %llu: %s",
                  sched_engine_type_name(c->type), c->async, sched_preempt_mode_name(c->mode),
                  c->varlen, c->ranks, (unsigned long long)c->seed, rk->msg);
        if (c->varlen && c->type != SCHED_PROMPT)
            cr_assert_gt(rk->varlen_rows, 100, "varlen dropped drafts (%llu rows)",
                         (unsigned long long)rk->varlen_rows);
        cr_assert_eq(rk->steps, steps, "ranks run the same number of steps");
        cr_assert_gt(rk->outputs, 200, "the workload ran (%llu outputs)",
                     (unsigned long long)rk->outputs);
        sched_destroy(rk->s);
        synth_destroy(rk->y);
    }
    vote_group_destroy(g);
}

static void rcases(uint32_t ranks)
{
    static const struct {
        sched_engine_type type;
        sched_preempt_mode mode;
    } kinds[] = {
        {SCHED_NORMAL, SCHED_PREEMPT_STOP},
        {SCHED_NORMAL, SCHED_PREEMPT_RECOMPUTE},
        {SCHED_PROMPT, SCHED_PREEMPT_STOP},
        {SCHED_COMPLETION, SCHED_PREEMPT_STOP},
    };
    /* DI_SOAK_SEEDS=n runs n seeds per case (a longer soak); the suite runs one.
     * DI_SOAK_FIRST=f starts at seed round f (to rerun a failure a soak reported). */
    const char *env = getenv("DI_SOAK_SEEDS"), *first = getenv("DI_SOAK_FIRST");
    uint64_t seeds = env ? strtoull(env, NULL, 10) : 1;
    uint64_t seed0 = first ? strtoull(first, NULL, 10) : 0;
    for (uint64_t seed = seed0; seed < seed0 + (seeds ? seeds : 1); seed++)
        for (size_t k = 0; k < sizeof(kinds) / sizeof(kinds[0]); k++)
            for (int async = 0; async <= 1; async++)
                for (int varlen = 0; varlen <= 1; varlen++) {
                    rcase c = {kinds[k].type, async != 0, kinds[k].mode, ranks,
                               1 + k * 2 + (uint64_t)async + 100 * seed, varlen != 0};
                    rcase_run(&c);
                }
}

/* No per-test timeout: a soak (DI_SOAK_SEEDS) runs as long as its seeds take; the suite's
 * run is bounded by the meson timeout of the binary. */
Test(sched_random, one_rank)
{
    rcases(1);
}

Test(sched_random, three_ranks_in_lockstep)
{
    rcases(3);
}

/* The random mix must actually reach the rare paths. */
Test(sched_random, the_workload_reaches_preemption_and_aborts, .timeout = 60)
{
    static rrank rk;
    rcase c = {SCHED_NORMAL, true, SCHED_PREEMPT_RECOMPUTE, 1, 91, false};
    memset(&rk, 0, sizeof(rk));
    rk.c = &c;
    cr_assert_eq(rrun(&rk), 0, "%s", rk.msg);
    const sched_stats *st = sched_get_stats(rk.s);
    cr_assert_gt(st->preempted_recompute + st->preempted_stop, 5, "preemptions");
    cr_assert_gt(st->prompt_steps, 50);
    cr_assert_gt(rk.aborted, 5);
    cr_assert_geq(rk.forked, 3, "forks: %llu", (unsigned long long)rk.forked);
    sched_destroy(rk.s);
    synth_destroy(rk.y);
}

/* Same inputs, same plans: a varlen run repeats exactly (every plan's entries, rows and
 * positions), sync and async; a run without varlen gives other plans (the digest can tell
 * runs apart). */
Test(sched_random, varlen_plans_are_deterministic, .timeout = 60)
{
    static rrank a, b;
    for (int async = 0; async <= 1; async++) {
        uint64_t digests[3];
        for (int k = 0; k < 3; k++) {
            rrank *rk = k == 1 ? &b : &a;
            rcase c = {SCHED_NORMAL, async != 0, SCHED_PREEMPT_RECOMPUTE, 1, 55, k < 2};
            memset(rk, 0, sizeof(*rk));
            rk->c = &c;
            cr_assert_eq(rrun(rk), 0, "%s", rk->msg);
            digests[k] = rk->digest;
            sched_destroy(rk->s);
            synth_destroy(rk->y);
        }
        cr_assert_eq(digests[0], digests[1], "async %d: two varlen runs differ", async);
        cr_assert_neq(digests[0], digests[2], "async %d: the digest cannot tell runs apart", async);
    }
}
