/* engine.c: the engine loop (engine.h). */
#include "common/engine/engine.h"

#include <string.h>

/* One live request. States: ACTIVE (in the scheduler, or held after a handoff) ->
 * RETIRING (ended; executor state kept until every plan that may carry it is processed) ->
 * freed, with exec.remove called (engine_retire_due). */
typedef struct engine_req {
    uint64_t id;               /* request id, the key */
    void *user;                /* engine_add's argument */
    bool handoff;              /* ended with FINISHED_HANDOFF: held until release or abort */
    bool retiring;             /* ended; waiting for retire_after */
    uint64_t retire_after;     /* retiring: plans that must be processed before exec.remove */
    struct engine_req *next;   /* hash chain */
    struct engine_req *rnext;  /* retiring list */
} engine_req;

struct engine {
    engine_config cfg;         /* copy */
    sched *s;                  /* the scheduler */
    const di_alloc *alloc;     /* cfg.sched.alloc */
    engine_req **buckets;      /* [n_buckets] hash chains of records by id */
    uint32_t n_buckets;        /* power of two */
    engine_req *retiring;      /* records waiting for their last plan */
    sched_seq_result *results; /* [2][cap]: results of the two latest plans (async keeps one) */
    uint32_t cap;              /* entries per plan the results hold */
    uint32_t cur;              /* which half the next plan's results go to */
    sched_plan *prev;          /* async: the plan run but not yet processed */
    sched_seq_result *prev_res; /* its results */
    uint64_t scheduled;        /* plans scheduled */
    uint64_t processed;        /* plans processed */
    bool broken;               /* a step failed: only destroy is allowed */
    engine_stats stats;
};

static uint32_t bucket_of(const engine *e, uint64_t id)
{
    uint64_t h = id * 0x9e3779b97f4a7c15ull;
    return (uint32_t)(h >> 32) & (e->n_buckets - 1);
}

static engine_req *find(const engine *e, uint64_t id)
{
    for (engine_req *r = e->buckets[bucket_of(e, id)]; r; r = r->next)
        if (r->id == id)
            return r;
    return NULL;
}

static void unlink_req(engine *e, engine_req *q)
{
    engine_req **pp = &e->buckets[bucket_of(e, q->id)];
    while (*pp != q)
        pp = &(*pp)->next;
    *pp = q->next;
}

/* Doubles the bucket array when chains grow past two on average; a failed growth keeps the
 * old array (longer chains, still correct). */
static void maybe_grow(engine *e)
{
    if (e->stats.live < 2 * e->n_buckets || e->n_buckets >= (1u << 30))
        return;
    uint32_t nb = e->n_buckets * 2;
    engine_req **b = di_alloc_zero(e->alloc, nb, sizeof(*b));
    if (!b)
        return;
    engine_req **old = e->buckets;
    uint32_t on = e->n_buckets;
    e->buckets = b;
    e->n_buckets = nb;
    for (uint32_t i = 0; i < on; i++)
        for (engine_req *r = old[i], *n; r; r = n) {
            n = r->next;
            uint32_t k = bucket_of(e, r->id);
            r->next = b[k];
            b[k] = r;
        }
    di_alloc_release(e->alloc, old);
}

static void free_req(engine *e, engine_req *q)
{
    unlink_req(e, q);
    if (e->cfg.exec.remove)
        e->cfg.exec.remove(e->cfg.exec.ctx, q->id);
    e->stats.exec_removed++;
    e->stats.live--;
    di_alloc_release(e->alloc, q);
}

/* Ends a record: its executor state goes once every plan scheduled so far is processed. */
static void retire(engine *e, engine_req *q)
{
    q->handoff = false;
    q->retiring = true;
    q->retire_after = e->scheduled;
    q->rnext = e->retiring;
    e->retiring = q;
}

static void retire_due(engine *e)
{
    for (engine_req **pp = &e->retiring; *pp;) {
        engine_req *q = *pp;
        if (q->retire_after <= e->processed) {
            *pp = q->rnext;
            free_req(e, q);
        } else {
            pp = &q->rnext;
        }
    }
}

static di_status reserve_results(engine *e, uint32_t n, di_error *err);

di_status engine_create(const engine_config *cfg, engine **out, di_error *err)
{
    if (!cfg || !out)
        return di_fail(err, DI_EINVAL, "engine: config and result are required");
    if (!cfg->exec.step)
        return di_fail(err, DI_EINVAL, "engine: the executor has no step function");
    if (!cfg->exec.issue != !cfg->exec.collect)
        return di_fail(err, DI_EINVAL, "engine: the executor has issue without collect or "
                                       "collect without issue");
    const di_alloc *a = cfg->sched.alloc;
    engine *e = di_alloc_zero(a, 1, sizeof(*e));
    if (!e)
        return di_fail(err, DI_ENOMEM, "engine");
    e->cfg = *cfg;
    e->alloc = a;
    e->n_buckets = 64;
    e->buckets = di_alloc_zero(a, e->n_buckets, sizeof(*e->buckets));
    di_status st = e->buckets ? DI_OK : di_fail(err, DI_ENOMEM, "engine request map");
    if (st == DI_OK)
        st = sched_create(&cfg->sched, &e->s, err);
    if (st != DI_OK) {
        di_alloc_release(a, e->buckets);
        di_alloc_release(a, e);
        return st;
    }
    e->cfg.sched = *sched_get_config(e->s); /* the scheduler's copy (tables it owns) */
    /* a plan has at most max_num_seqs entries (one placeholder otherwise): steps never
     * allocate */
    if ((st = reserve_results(e, cfg->sched.max_num_seqs, err)) != DI_OK) {
        engine_destroy(e);
        return st;
    }
    *out = e;
    return DI_OK;
}

void engine_destroy(engine *e)
{
    if (!e)
        return;
    for (uint32_t i = 0; i < e->n_buckets; i++)
        while (e->buckets[i])
            free_req(e, e->buckets[i]);
    sched_destroy(e->s);
    di_alloc_release(e->alloc, e->results);
    di_alloc_release(e->alloc, e->buckets);
    di_alloc_release(e->alloc, e);
}

di_status engine_add(engine *e, const sched_request *req, const void *exec_args, void *user,
                     di_error *err)
{
    if (!e || !req)
        return di_fail(err, DI_EINVAL, "engine add: engine and request are required");
    if (e->broken)
        return di_fail(err, DI_ESTATE, "engine add: a step failed; the engine is stopped");
    if (find(e, req->id))
        return di_fail(err, DI_EEXIST, "request %llu is live", (unsigned long long)req->id);
    engine_req *q = di_alloc_zero(e->alloc, 1, sizeof(*q));
    if (!q)
        return di_fail(err, DI_ENOMEM, "request %llu", (unsigned long long)req->id);
    q->id = req->id;
    q->user = user;
    di_status st = e->cfg.exec.add ? e->cfg.exec.add(e->cfg.exec.ctx, req, exec_args, err) : DI_OK;
    if (st != DI_OK) {
        di_alloc_release(e->alloc, q);
        return st;
    }
    if ((st = sched_add_request(e->s, req, err)) != DI_OK) {
        if (e->cfg.exec.remove)
            e->cfg.exec.remove(e->cfg.exec.ctx, req->id);
        di_alloc_release(e->alloc, q);
        return st;
    }
    uint32_t k = bucket_of(e, q->id);
    q->next = e->buckets[k];
    e->buckets[k] = q;
    e->stats.exec_added++;
    e->stats.live++;
    maybe_grow(e);
    return DI_OK;
}

static void emit(engine *e, const engine_output *o)
{
    if (e->cfg.on_output)
        e->cfg.on_output(e->cfg.userdata, o);
}

di_status engine_abort(engine *e, uint64_t id, di_error *err)
{
    if (!e)
        return di_fail(err, DI_EINVAL, "engine abort: engine is required");
    engine_req *q = find(e, id);
    if (!q || q->retiring)
        return di_fail(err, DI_ENOENT, "no live request %llu", (unsigned long long)id);
    sched_output o;
    di_status st = sched_abort(e->s, id, &o, err);
    if (st != DI_OK)
        return st;
    bool was_handoff = q->handoff;
    retire(e, q);
    if (!was_handoff)
        emit(e, &(engine_output){.request_id = id, .user = q->user, .tokens = o.tokens,
                                 .n_tokens = o.n_tokens, .finish = o.finish,
                                 .n_generated = o.n_generated, .entry = -1});
    retire_due(e);
    return DI_OK;
}

di_status engine_release(engine *e, uint64_t id, di_error *err)
{
    if (!e)
        return di_fail(err, DI_EINVAL, "engine release: engine is required");
    engine_req *q = find(e, id);
    if (!q || q->retiring)
        return di_fail(err, DI_ENOENT, "no live request %llu", (unsigned long long)id);
    if (!q->handoff)
        return di_fail(err, DI_ESTATE, "request %llu has not finished with a handoff",
                       (unsigned long long)id);
    di_status st = sched_release(e->s, id, err);
    if (st != DI_OK)
        return st;
    retire(e, q);
    retire_due(e);
    return DI_OK;
}

di_status engine_set_ready(engine *e, uint64_t id, di_error *err)
{
    if (!e)
        return di_fail(err, DI_EINVAL, "engine: engine is required");
    return sched_set_schedulable(e->s, id, err);
}

static uint64_t now_ns(const engine *e)
{
    return e->cfg.clock_ns ? e->cfg.clock_ns() : 0;
}

/* Room for plans of n entries in both halves of the results. */
static di_status reserve_results(engine *e, uint32_t n, di_error *err)
{
    if (n <= e->cap)
        return DI_OK;
    uint32_t cap = e->cap ? e->cap : 64;
    while (cap < n)
        cap *= 2;
    sched_seq_result *r = di_alloc_zero(e->alloc, 2 * (size_t)cap, sizeof(*r));
    if (!r)
        return di_fail(err, DI_ENOMEM, "results of a plan of %u entries", n);
    if (e->prev_res) { /* keep the results of the plan in flight */
        memcpy(r, e->prev_res, sizeof(*r) * e->prev->n_seqs);
        e->prev_res = r;
        e->cur = 1;
    } else {
        e->cur = 0;
    }
    di_alloc_release(e->alloc, e->results);
    e->results = r;
    e->cap = cap;
    return DI_OK;
}

/* Index of request id's entry in plan, searching from *hint (outputs come in entry order). */
static int32_t entry_of(const sched_plan *plan, uint64_t id, uint32_t *hint)
{
    if (plan->placeholder)
        return -1;
    for (uint32_t k = 0; k < plan->n_seqs; k++) {
        uint32_t i = (*hint + k) % plan->n_seqs;
        if (plan->seqs[i].request_id == id) {
            *hint = i + 1;
            return (int32_t)i;
        }
    }
    return -1;
}

static di_status process(engine *e, const sched_plan *plan, const sched_seq_result *res,
                         di_error *err)
{
    const sched_output *outs;
    size_t n;
    uint64_t t0 = now_ns(e);
    di_status st = sched_process_outputs(e->s, plan, res, plan->placeholder ? 0 : plan->n_seqs,
                                         &outs, &n, err);
    e->stats.last_sched_ns += now_ns(e) - t0;
    if (st != DI_OK)
        return st;
    e->processed++;
    uint32_t hint = 0;
    for (size_t k = 0; k < n; k++) {
        const sched_output *o = &outs[k];
        engine_req *q = find(e, o->request_id);
        int32_t i = entry_of(plan, o->request_id, &hint);
        engine_output eo = {.request_id = o->request_id, .user = q ? q->user : NULL,
                            .tokens = o->tokens, .n_tokens = o->n_tokens, .finish = o->finish,
                            .n_generated = o->n_generated, .plan = plan, .entry = i,
                            .result = i >= 0 ? &res[i] : NULL};
        if (q && o->finish == SCHED_FINISH_HANDOFF)
            q->handoff = true;
        else if (q && o->finish != SCHED_FINISH_NONE)
            retire(e, q);
        emit(e, &eo);
    }
    retire_due(e);
    return DI_OK;
}

static di_status fail(engine *e, di_status st)
{
    e->broken = true;
    return st;
}

di_status engine_flush(engine *e, di_error *err)
{
    if (!e)
        return di_fail(err, DI_EINVAL, "engine flush: engine is required");
    if (e->broken)
        return di_fail(err, DI_ESTATE, "engine flush: a step failed; the engine is stopped");
    e->stats.last_sched_ns = 0;
    if (!e->prev)
        return DI_OK;
    sched_plan *p = e->prev;
    e->prev = NULL;
    const engine_executor *x = &e->cfg.exec;
    di_status st = x->collect ? x->collect(x->ctx, p, e->prev_res, err) : DI_OK;
    if (st == DI_OK)
        st = process(e, p, e->prev_res, err);
    e->prev_res = NULL;
    e->stats.sched_ns += e->stats.last_sched_ns;
    return st == DI_OK ? DI_OK : fail(e, st);
}

di_status engine_step(engine *e, bool *ran, di_error *err)
{
    if (ran)
        *ran = false;
    if (!e)
        return di_fail(err, DI_EINVAL, "engine step: engine is required");
    if (e->broken)
        return di_fail(err, DI_ESTATE, "engine step: a step failed; the engine is stopped");
    e->stats.last_sched_ns = 0;
    sched_plan *p;
    uint64_t t0 = now_ns(e);
    di_status st = sched_schedule(e->s, &p, err);
    e->stats.last_sched_ns += now_ns(e) - t0;
    if (st != DI_OK)
        return fail(e, st);
    e->scheduled++;
    if ((st = reserve_results(e, p->n_seqs, err)) != DI_OK)
        return fail(e, st);
    const engine_executor *x = &e->cfg.exec;
    bool split = x->issue != NULL, issued = false;
    if (e->prev) { /* async: step N is processed while N+1 is about to run (or runs) */
        sched_plan *prev = e->prev;
        e->prev = NULL;
        if (split && (st = x->issue(x->ctx, p, true, &issued, err)) != DI_OK)
            return fail(e, st);
        if (split && (st = x->collect(x->ctx, prev, e->prev_res, err)) != DI_OK)
            return fail(e, st);
        if ((st = process(e, prev, e->prev_res, err)) != DI_OK)
            return fail(e, st);
        t0 = now_ns(e);
        sched_plan_fixup(p, prev, e->prev_res);
        e->stats.last_sched_ns += now_ns(e) - t0;
        e->prev_res = NULL;
        e->stats.issued_ahead += issued;
    }
    sched_seq_result *res = e->results + (size_t)e->cur * e->cap;
    memset(res, 0, sizeof(*res) * p->n_seqs);
    if (!split)
        st = x->step(x->ctx, p, res, err);
    else if (!issued)
        st = x->issue(x->ctx, p, false, &issued, err);
    if (st == DI_OK && split && !issued)
        st = di_fail(err, DI_EINTERNAL, "engine: the executor did not issue a plan");
    if (st != DI_OK)
        return fail(e, st);
    e->stats.steps++;
    if (ran)
        *ran = true;
    if (!e->cfg.sched.async || p->process_now) {
        if (split && (st = x->collect(x->ctx, p, res, err)) != DI_OK)
            return fail(e, st);
        if ((st = process(e, p, res, err)) != DI_OK)
            return fail(e, st);
    } else {
        e->prev = p;
        e->prev_res = res;
        e->cur ^= 1;
    }
    e->stats.sched_ns += e->stats.last_sched_ns;
    return DI_OK;
}

bool engine_has_work(const engine *e)
{
    return sched_has_work(e->s);
}

di_status engine_run(engine *e, uint64_t max_steps, di_error *err)
{
    if (!e)
        return di_fail(err, DI_EINVAL, "engine run: engine is required");
    uint64_t steps = 0;
    while (engine_has_work(e)) {
        if (max_steps && steps >= max_steps)
            return di_fail(err, DI_EINTERNAL, "stopped after %llu steps with %u requests "
                           "unfinished", (unsigned long long)steps, sched_num_live(e->s));
        di_status st = engine_step(e, NULL, err);
        if (st != DI_OK)
            return st;
        steps++;
    }
    return engine_flush(e, err);
}

sched *engine_sched(const engine *e)
{
    return e->s;
}

const engine_stats *engine_get_stats(const engine *e)
{
    return &e->stats;
}
