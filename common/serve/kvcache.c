/* kvcache.c: an engine's KV cache in the store (kvcache.h). */
#include "common/serve/kvcache.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/engine/prefix.h"
#include "common/model/kv_io.h"
#include "common/util/clock.h"

#define PUT_BATCH 256u  /* objects per put call: bounds one message */
#define N_BUCKETS 256u  /* request records by id */
#define POLL_BATCH 64u

/* One store object held in host memory. */
typedef struct kv_obj {
    int cls;                /* KVKEY_BLOCK or KVKEY_WINDOW */
    kvkey key;
    uint8_t *buf;           /* the whole object, header included */
    uint64_t bytes;
    uint64_t position;      /* block: first position; window state: its position */
} kv_obj;

/* What the cache knows of one request. Written by the engine thread, except while its
 * admission job runs (loading): then by the transfer thread only (hit, load, stored_*). */
typedef struct kv_req {
    struct kv_req *next;    /* bucket chain */
    uint64_t id;
    void *user;             /* kvcache_admit's */
    bool live;              /* not finished nor forgotten */
    bool loading;           /* its admission job is out */
    uint32_t jobs;          /* jobs of it not yet polled (the record lives until 0) */
    uint32_t prompt_len;    /* the prompt (tracked: tokens known at the handoff) */
    int32_t *toks;          /* [cap] tokens by position: the prompt, then the response as its KV
                               is computed (keys of the blocks the response fills) */
    uint32_t cap;
    kvkey *keys;            /* [cap / 128 + 1] chain keys of the full blocks known so far */
    uint32_t n_keys;
    prefix_hit hit;         /* what admission decided */
    kv_obj *load;           /* fetched: blocks 0 .. hit.kv_tokens/128 - 1, then the window */
    uint32_t n_load;
    bool tainted;           /* a replay: what it computes is not exact, nothing is stored */
    uint32_t stored_blocks; /* leading blocks the store already holds (not put again) */
    bool *stored_window;    /* [n_stored_window] window state at 128 k already stored */
    uint32_t n_stored_window;
    kv_obj *pending;        /* copied objects waiting for the next store job */
    uint32_t n_pending, cap_pending;
    int32_t last_window;    /* pending index of the response's newest window state, -1 none */
} kv_req;

typedef enum job_type { JOB_ADMIT, JOB_PUT, JOB_CALL } job_type;

/* One transfer job. Its fields are written by the transfer thread while it runs, read by the
 * engine thread once polled. */
typedef struct kjob {
    job_type type;
    kvcache *k;
    kv_req *r;              /* ADMIT, PUT: the record (held by r->jobs) */
    uint64_t id;
    kv_obj *objs;           /* PUT: owned */
    uint32_t n_objs;
    uint32_t done_objs;     /* PUT: objects acknowledged by earlier attempts */
    uint32_t blocks_stored, windows_stored, bad; /* PUT outcome */
    char first_bad[200];
    uint32_t n_bad;         /* ADMIT: unusable objects */
    kvc_client *c;          /* the client of the thread that runs it */
    kvcache_call_fn fn;     /* CALL */
    void *ctx, *user;
    struct kjob *prev, *next; /* every job out (engine thread), for kvcache_destroy */
} kjob;

struct kvcache {
    kvcache_options o;
    char target[256];
    kv_geometry g;
    size_t block_bytes, window_bytes;
    xfer *x[2];             /* [0] stores (and loads without a load client), [1] loads */
    kvc_client *cl[2];      /* the client each thread calls */
    bool refused;           /* another model or format: never used */
    kv_req *buckets[N_BUCKETS];
    uint32_t n_records;
    kvcache_event *ev;      /* ready events, [ev_head, ev_n) */
    size_t ev_head, ev_n, ev_cap;
    size_t owed;            /* events promised (admissions and calls out): room is kept */
    kjob *jobs;             /* jobs submitted and not yet polled */
    uint64_t last_warn_ns;  /* rate limit of warning lines */
    uint32_t warns_left_out;
    kvcache_stats st;
};

/* ---- small helpers ---- */

static void obj_free(kv_obj *o, uint32_t n)
{
    for (uint32_t i = 0; o && i < n; i++)
        free(o[i].buf);
}

static void warn(kvcache *k, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void warn(kvcache *k, const char *fmt, ...)
{
    uint64_t now = di_mono_ns();
    if (k->last_warn_ns && now - k->last_warn_ns < k->o.warn_interval_ns) {
        k->warns_left_out++;
        return;
    }
    if (!di_log_enabled(k->o.log, DI_LOG_WARN))
        return;
    char line[900];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(line, sizeof line, fmt, ap);
    va_end(ap);
    k->last_warn_ns = now;
    if (k->warns_left_out)
        di_log(k->o.log, DI_LOG_WARN, "%s (%u similar lines left out)", line, k->warns_left_out);
    else
        di_log(k->o.log, DI_LOG_WARN, "%s", line);
    k->warns_left_out = 0;
}

static kv_req *find(const kvcache *k, uint64_t id)
{
    for (kv_req *r = k ? k->buckets[id % N_BUCKETS] : NULL; r; r = r->next)
        if (r->id == id)
            return r;
    return NULL;
}

static kv_req *find_live(const kvcache *k, uint64_t id)
{
    kv_req *r = find(k, id);
    return r && r->live && !r->loading ? r : NULL;
}

static void req_free(kv_req *r)
{
    if (!r)
        return;
    free(r->toks);
    free(r->keys);
    free(r->stored_window);
    obj_free(r->load, r->n_load);
    free(r->load);
    obj_free(r->pending, r->n_pending);
    free(r->pending);
    free(r);
}

/* Frees the record once it is neither live nor waited for by a job. */
static void req_maybe_free(kvcache *k, kv_req *r)
{
    if (r->live || r->jobs)
        return;
    for (kv_req **p = &k->buckets[r->id % N_BUCKETS]; *p; p = &(*p)->next)
        if (*p == r) {
            *p = r->next;
            break;
        }
    k->n_records--;
    req_free(r);
}

static di_status req_new(kvcache *k, uint64_t id, const int32_t *toks, uint32_t len,
                         uint32_t max_tokens, kv_req **out, di_error *err)
{
    if (!k || id == 0 || !toks || len == 0)
        return di_fail(err, DI_EINVAL, "KV cache: request id and tokens are required");
    if (find(k, id))
        return di_fail(err, DI_EEXIST, "KV cache: request %llu is already known",
                       (unsigned long long)id);
    uint32_t bt = k->g.block_tokens;
    uint64_t cap = (uint64_t)len + max_tokens + 2 * bt;
    if (cap > UINT32_MAX / sizeof(int32_t))
        return di_fail(err, DI_EINVAL, "KV cache: request %llu too long", (unsigned long long)id);
    kv_req *r = calloc(1, sizeof(*r));
    if (r) {
        r->toks = malloc(cap * sizeof(int32_t));
        r->keys = malloc((cap / bt + 1) * sizeof(kvkey));
    }
    if (!r || !r->toks || !r->keys) {
        req_free(r);
        return di_fail(err, DI_ENOMEM, "KV cache: request %llu", (unsigned long long)id);
    }
    memcpy(r->toks, toks, len * sizeof(int32_t));
    r->id = id;
    r->cap = (uint32_t)cap;
    r->prompt_len = len;
    r->live = true;
    r->last_window = -1;
    r->hit = (prefix_hit){.prefill_tokens = len};
    r->next = k->buckets[id % N_BUCKETS];
    k->buckets[id % N_BUCKETS] = r;
    k->n_records++;
    *out = r;
    return DI_OK;
}

/* Key of full block j, extending the chain from the tokens recorded so far. */
static di_status block_key(const kvcache *k, kv_req *r, uint32_t j, di_error *err)
{
    uint32_t bt = k->g.block_tokens;
    while (r->n_keys <= j) {
        uint32_t b = r->n_keys;
        di_status st = kvkey_block(b ? &r->keys[b - 1] : NULL, k->g.model_id, r->toks + b * bt,
                                   bt, &r->keys[b], err);
        if (st != DI_OK)
            return st;
        r->n_keys++;
    }
    return DI_OK;
}

/* Keeps room for one more promised event, so that delivering it cannot fail. */
static di_status reserve_event(kvcache *k, di_error *err)
{
    if (k->ev_head > 0) {
        memmove(k->ev, k->ev + k->ev_head, (k->ev_n - k->ev_head) * sizeof(*k->ev));
        k->ev_n -= k->ev_head;
        k->ev_head = 0;
    }
    if (k->ev_n + k->owed + 1 > k->ev_cap) {
        size_t cap = k->ev_cap ? 2 * k->ev_cap : 64;
        while (cap < k->ev_n + k->owed + 1)
            cap *= 2;
        kvcache_event *n = realloc(k->ev, cap * sizeof(*n));
        if (!n)
            return di_fail(err, DI_ENOMEM, "KV cache: events");
        k->ev = n;
        k->ev_cap = cap;
    }
    k->owed++;
    return DI_OK;
}

/* Delivers a promised event (room was reserved). */
static void push_event(kvcache *k, const kvcache_event *e)
{
    k->owed--;
    k->ev[k->ev_n++] = *e;
}

/* ---- create / destroy ---- */

static di_status run_job(void *ctx, xfer_kind kind, uint64_t id, void *job, di_error *err);

di_status kvcache_create(const kvcache_options *o, const kv_geometry *g, kvcache **out,
                         di_error *err)
{
    if (!o || !g || !out || !o->client)
        return di_fail(err, DI_EINVAL, "KV cache: options, geometry and client are required");
    if (o->always_compute == 0 || g->block_tokens == 0)
        return di_fail(err, DI_EINVAL, "KV cache: always_compute and block_tokens must be >= 1");
    if (o->target && strlen(o->target) >= sizeof(((kvcache *)0)->target))
        return di_fail(err, DI_EINVAL, "KV cache: address of %zu characters is too long",
                       strlen(o->target));
    kvcache *k = calloc(1, sizeof(*k));
    if (!k)
        return di_fail(err, DI_ENOMEM, "KV cache");
    k->o = *o;
    snprintf(k->target, sizeof k->target, "%s", o->target ? o->target : "(store)");
    k->o.target = k->target;
    kvcache_options *ko = &k->o;
    ko->max_jobs = ko->max_jobs ? ko->max_jobs : 4096;
    ko->max_attempts = ko->max_attempts ? ko->max_attempts : 3;
    ko->backoff_ns = ko->backoff_ns ? ko->backoff_ns : 100000000ull;
    ko->max_backoff_ns = ko->max_backoff_ns ? ko->max_backoff_ns : 2000000000ull;
    if (ko->max_backoff_ns < ko->backoff_ns)
        ko->max_backoff_ns = ko->backoff_ns;
    ko->warn_interval_ns = ko->warn_interval_ns ? ko->warn_interval_ns : 10000000000ull;
    k->g = *g;
    k->block_bytes = kv_block_bytes(g);
    k->window_bytes = kv_window_state_bytes(g);
    xfer_config xc = {.store = {.ctx = k, .call = run_job}, .max_jobs = ko->max_jobs,
                      .max_attempts = ko->max_attempts, .backoff_ns = ko->backoff_ns,
                      .max_backoff_ns = ko->max_backoff_ns, .on_done = ko->notify,
                      .on_done_ud = ko->notify_ud};
    k->cl[0] = ko->client;
    k->cl[1] = ko->load_client;
    di_status st = xfer_create(&xc, &k->x[0], err);
    if (st == DI_OK && ko->load_client)
        st = xfer_create(&xc, &k->x[1], err);
    if (st != DI_OK) {
        xfer_destroy(k->x[0]);
        free(k);
        return st;
    }
    *out = k;
    return DI_OK;
}

static void job_free(kjob *j)
{
    if (!j)
        return;
    obj_free(j->objs, j->n_objs);
    free(j->objs);
    free(j);
}

void kvcache_destroy(kvcache *k)
{
    if (!k)
        return;
    xfer_destroy(k->x[0]); /* their threads have ended: the jobs out are ours */
    xfer_destroy(k->x[1]);
    for (kjob *j = k->jobs, *n; j; j = n) {
        n = j->next;
        job_free(j);
    }
    for (uint32_t b = 0; b < N_BUCKETS; b++)
        for (kv_req *r = k->buckets[b], *n; r; r = n) {
            n = r->next;
            req_free(r);
        }
    free(k->ev);
    free(k);
}

/* The store must keep objects of exactly our formats. */
di_status kvcache_check(kvcache *k, di_error *err)
{
    kvc_store_info in;
    di_status st = kvc_info(k->o.client, &in, err);
    if (st == DI_EINVAL) {
        k->refused = k->st.refused = true;
        return st;
    }
    if (st != DI_OK) {
        warn(k, "KV store at %s: connecting failed (%s): going on without it; it is tried again "
             "after a back-off", k->target, err->msg);
        return st;
    }
    const kv_geometry *s = &in.geometry;
    if (in.object_bytes[KVKEY_BLOCK] != k->block_bytes ||
        in.object_bytes[KVKEY_WINDOW] != k->window_bytes ||
        s->ring_positions != k->g.ring_positions) {
        k->refused = k->st.refused = true;
        return di_fail(err, DI_EINVAL, "it keeps blocks of %llu bytes and window states of %llu "
                       "bytes with %u ring positions; this model writes %zu, %zu and %u (same "
                       "config and --nextn as the store's?)",
                       (unsigned long long)in.object_bytes[KVKEY_BLOCK],
                       (unsigned long long)in.object_bytes[KVKEY_WINDOW], s->ring_positions,
                       k->block_bytes, k->window_bytes, k->g.ring_positions);
    }
    return DI_OK;
}

/* ---- admission (transfer thread): lookup, decide, fetch ---- */

/* The prefix rule; without allow_replay a replay becomes an exact resume at the newest window
 * state at or below the block hit (or no hit). */
static prefix_hit decide(const kvcache *k, uint32_t len, uint32_t blocks, const bool *has_window,
                         uint32_t n_window)
{
    prefix_hit h;
    di_status st = prefix_hit_compute(len, k->o.always_compute, blocks, has_window, n_window, &h,
                                      NULL);
    if (st == DI_OK && h.replay_tokens && !k->o.allow_replay) {
        uint32_t b = h.kv_tokens / k->g.block_tokens;
        while (b > 0 && !(b < n_window && has_window[b]))
            b--;
        st = prefix_hit_compute(len, k->o.always_compute, b, has_window, n_window, &h, NULL);
    }
    if (st != DI_OK)
        h = (prefix_hit){.prefill_tokens = len};
    return h;
}

/* Scratch of one admission: the lookup's answer and what has been fetched. */
typedef struct fetch {
    uint32_t n;             /* full blocks of the prompt looked up */
    uint32_t stored;        /* leading blocks the store holds */
    uint32_t avail;         /* of those, below the cap and still believed usable */
    bool *has_window;       /* [n + 1] window state at 128 k still believed usable */
    uint8_t **blk;          /* [n] fetched block objects */
    uint8_t **win;          /* [n + 1] fetched window states */
} fetch;

static void fetch_free(fetch *f)
{
    for (uint32_t i = 0; f->blk && i < f->n; i++)
        free(f->blk[i]);
    for (uint32_t i = 0; f->win && i <= f->n; i++)
        free(f->win[i]);
    free(f->blk);
    free(f->win);
    free(f->has_window);
}

static void fetch_bad(kjob *j, const char *what, uint32_t index, const di_error *e)
{
    if (j->n_bad++ == 0)
        snprintf(j->first_bad, sizeof j->first_bad, "%s %u: %s", what, index, e->msg);
}

/* Gets the objects decision h needs that are not fetched yet; an unusable one lowers what is
 * believed usable; a sound object under the wrong key is deleted (it is wrong for every
 * reader), so that the correct one can be stored again. *done: every object of h is in hand.
 * Returns the get call's failure. */
static di_status fetch_round(kjob *j, fetch *f, const prefix_hit *h, bool *done, di_error *err)
{
    kvcache *k = j->k;
    kv_req *r = j->r;
    uint32_t bt = k->g.block_tokens, nb = h->kv_tokens / bt;
    uint32_t wk = h->load_window ? h->compute_from / bt : 0;
    kvc_item items[PUT_BATCH];
    uint32_t idx[PUT_BATCH], n = 0;
    for (uint32_t b = 0; b < nb && n < PUT_BATCH; b++)
        if (!f->blk[b]) {
            items[n] = (kvc_item){.cls = KVKEY_BLOCK, .key = r->keys[b], .cap = k->block_bytes};
            idx[n++] = b;
        }
    if (wk && !f->win[wk] && n < PUT_BATCH) {
        items[n] = (kvc_item){.cls = KVKEY_WINDOW, .key = r->keys[wk - 1], .cap = k->window_bytes};
        idx[n++] = wk;
    }
    *done = n == 0;
    if (n == 0)
        return DI_OK;
    di_status st = DI_OK;
    for (uint32_t i = 0; i < n; i++)
        if (!(items[i].buf = malloc(items[i].cap)) && st == DI_OK)
            st = di_fail(err, DI_ENOMEM, "%llu bytes", (unsigned long long)items[i].cap);
    if (st == DI_OK)
        st = kvc_get(j->c, items, n, err);
    if (st != DI_OK) {
        for (uint32_t i = 0; i < n; i++)
            free(items[i].buf);
        return st;
    }
    for (uint32_t i = 0; i < n; i++) {
        kvc_item *it = &items[i];
        bool block = it->cls == KVKEY_BLOCK;
        if (it->status == DI_OK) {
            it->status = block ? kvio_block_check(&k->g, it->buf, it->bytes, it->key.b,
                                                  (uint64_t)idx[i] * bt, &it->error)
                               : kvio_window_check(&k->g, it->buf, it->bytes, it->key.b,
                                                   (uint64_t)idx[i] * bt, &it->error);
            di_error e;
            if (it->status != DI_OK)
                (void)kvc_delete1(j->c, it->cls, &it->key, &e);
        }
        if (it->status == DI_OK) {
            (block ? f->blk : f->win)[idx[i]] = it->buf;
            continue;
        }
        free(it->buf);
        fetch_bad(j, block ? "block" : "window state at block", idx[i], &it->error);
        if (block && idx[i] < f->avail)
            f->avail = f->stored = idx[i]; /* it will be computed and stored again */
        if (!block)
            f->has_window[idx[i]] = false;
    }
    return DI_OK;
}

/* Moves the objects decision r->hit uses into r->load; the rest of f is freed by the caller. */
static di_status keep_loads(kvcache *k, kv_req *r, fetch *f, di_error *err)
{
    uint32_t bt = k->g.block_tokens, nb = r->hit.kv_tokens / bt;
    uint32_t n = nb + (r->hit.load_window ? 1 : 0);
    if (n == 0)
        return DI_OK;
    r->load = calloc(n, sizeof(kv_obj));
    if (!r->load)
        return di_fail(err, DI_ENOMEM, "KV cache: %u objects", n);
    for (uint32_t b = 0; b < nb; b++) {
        r->load[b] = (kv_obj){.cls = KVKEY_BLOCK, .key = r->keys[b], .buf = f->blk[b],
                              .bytes = k->block_bytes, .position = (uint64_t)b * bt};
        f->blk[b] = NULL;
    }
    if (r->hit.load_window) {
        uint32_t wk = r->hit.compute_from / bt;
        r->load[nb] = (kv_obj){.cls = KVKEY_WINDOW, .key = r->keys[wk - 1], .buf = f->win[wk],
                               .bytes = k->window_bytes, .position = r->hit.compute_from};
        f->win[wk] = NULL;
    }
    r->n_load = n;
    return DI_OK;
}

/* The admission job: lookup of every full block (what the store holds is not put again),
 * then fetches until every object of the decision is in hand. On failure r keeps no hit. */
static di_status admit_job(kjob *j, di_error *err)
{
    kvcache *k = j->k;
    kv_req *r = j->r;
    uint32_t bt = k->g.block_tokens, len = r->prompt_len;
    uint32_t cap = len > k->o.always_compute ? (len - k->o.always_compute) / bt : 0;
    uint32_t n = len / bt < KVC_MAX_LOOKUP ? len / bt : KVC_MAX_LOOKUP;
    r->hit = (prefix_hit){.prefill_tokens = len};
    j->n_bad = 0;
    fetch f = {.n = n};
    f.has_window = calloc(n + 1, sizeof(bool));
    f.blk = calloc(n, sizeof(uint8_t *));
    f.win = calloc(n + 1, sizeof(uint8_t *));
    uint32_t *wins = calloc(n + 1, sizeof(uint32_t));
    di_status st = DI_OK;
    if (!f.has_window || !f.blk || !f.win || !wins)
        st = di_fail(err, DI_ENOMEM, "KV cache lookup of %u blocks", n);
    size_t nw = 0;
    if (st == DI_OK)
        st = kvc_lookup(j->c, r->keys, n, &f.stored, wins, n + 1, &nw, err);
    if (st != DI_OK)
        di_error_prefix(err, "looking up request %llu: ", (unsigned long long)r->id);
    for (size_t i = 0; st == DI_OK && i < nw; i++)
        if (wins[i] >= 1 && wins[i] <= n)
            f.has_window[wins[i]] = true;
    free(wins);
    f.avail = f.stored < cap ? f.stored : cap;
    bool done = false;
    while (st == DI_OK && !done) {
        r->hit = decide(k, len, f.avail, f.has_window, n + 1);
        st = fetch_round(j, &f, &r->hit, &done, err);
        if (st != DI_OK)
            di_error_prefix(err, "reading the cached prefix of request %llu: ",
                            (unsigned long long)r->id);
    }
    if (st == DI_OK)
        st = keep_loads(k, r, &f, err);
    if (st == DI_OK) {
        r->stored_blocks = f.stored;
        r->stored_window = f.has_window;
        r->n_stored_window = n + 1;
        f.has_window = NULL;
    } else {
        r->hit = (prefix_hit){.prefill_tokens = len};
    }
    fetch_free(&f);
    return st;
}

/* ---- store jobs (transfer thread) ---- */

static di_status put_job(kjob *j, di_error *err)
{
    while (j->done_objs < j->n_objs) {
        uint32_t i0 = j->done_objs;
        uint32_t m = j->n_objs - i0 < PUT_BATCH ? j->n_objs - i0 : PUT_BATCH;
        kvc_item items[PUT_BATCH];
        for (uint32_t i = 0; i < m; i++)
            items[i] = (kvc_item){.cls = j->objs[i0 + i].cls, .key = j->objs[i0 + i].key,
                                  .buf = j->objs[i0 + i].buf, .cap = j->objs[i0 + i].bytes};
        di_status st = kvc_put(j->c, items, m, err);
        if (st != DI_OK) {
            di_error_prefix(err, "storing the KV of request %llu: ", (unsigned long long)j->id);
            return st;
        }
        for (uint32_t i = 0; i < m; i++) {
            if (items[i].status == DI_OK || items[i].status == DI_EEXIST) {
                if (items[i].cls == KVKEY_BLOCK)
                    j->blocks_stored++;
                else
                    j->windows_stored++;
            } else if (j->bad++ == 0) {
                snprintf(j->first_bad, sizeof j->first_bad, "%s", items[i].error.msg);
            }
        }
        j->done_objs += m;
    }
    return DI_OK;
}

static di_status run_job(void *ctx, xfer_kind kind, uint64_t id, void *job, di_error *err)
{
    (void)ctx;
    (void)kind;
    (void)id;
    kjob *j = job;
    switch (j->type) {
    case JOB_ADMIT: return admit_job(j, err);
    case JOB_PUT: return put_job(j, err);
    default: return j->fn(j->ctx, j->c, err);
    }
}

static di_status submit(kvcache *k, kjob *j, xfer_kind kind, const xfer_job_opts *o,
                        di_error *err)
{
    int lane = kind == XFER_LOAD && k->x[1] ? 1 : 0;
    j->c = k->cl[lane];
    di_status st = xfer_submit_opts(k->x[lane], kind, j->id, j, o, err);
    if (st != DI_OK)
        return st;
    if (j->r)
        j->r->jobs++;
    j->next = k->jobs;
    if (k->jobs)
        k->jobs->prev = j;
    k->jobs = j;
    return DI_OK;
}

static void unlist(kvcache *k, kjob *j)
{
    if (j->prev)
        j->prev->next = j->next;
    else
        k->jobs = j->next;
    if (j->next)
        j->next->prev = j->prev;
}

/* Hands r's pending copies to a store job (dropped with one warning when the queue is full). */
static void put_pending(kvcache *k, kv_req *r)
{
    if (r->n_pending == 0)
        return;
    kjob *j = calloc(1, sizeof(*j));
    di_error e;
    di_status st = j ? DI_OK : di_fail(&e, DI_ENOMEM, "store job");
    if (st == DI_OK) {
        *j = (kjob){.type = JOB_PUT, .k = k, .r = r, .id = r->id, .objs = r->pending,
                    .n_objs = r->n_pending};
        r->pending = NULL;
        r->n_pending = r->cap_pending = 0;
        st = submit(k, j, XFER_STORE, NULL, &e);
    }
    if (st != DI_OK) {
        k->st.errors++;
        k->st.store_failures++;
        warn(k, "KV store at %s: storing the KV of request %llu failed (%s): not stored",
             k->target, (unsigned long long)r->id, e.msg);
        if (j)
            job_free(j);
        obj_free(r->pending, r->n_pending);
        free(r->pending);
        r->pending = NULL;
        r->n_pending = r->cap_pending = 0;
    }
    r->last_window = -1;
}

/* ---- admission (engine thread) ---- */

static void admit_line(kvcache *k, const kv_req *r)
{
    const prefix_hit *h = &r->hit;
    uint32_t bt = k->g.block_tokens;
    if (!di_log_enabled(k->o.log, DI_LOG_INFO))
        return;
    if (h->kv_tokens == 0) {
        di_log(k->o.log, DI_LOG_INFO, "prompt %llu: %u tokens, no cached prefix; prefill computes "
               "%u", (unsigned long long)r->id, r->prompt_len, h->prefill_tokens);
        return;
    }
    char how[64];
    if (h->load_window)
        snprintf(how, sizeof how, "the window state at %u", h->compute_from);
    else
        snprintf(how, sizeof how, "no window state: replay from %u", h->compute_from);
    di_log(k->o.log, DI_LOG_INFO, "prompt %llu: %u of %u tokens from the KV store (%u blocks, %s); "
           "prefill computes %u", (unsigned long long)r->id, h->kv_tokens - h->replay_tokens,
           r->prompt_len, h->kv_tokens / bt, how, h->prefill_tokens);
}

/* The admission of r is complete (with r->hit as obtained): its event. */
static void admitted(kvcache *k, kv_req *r)
{
    r->tainted = r->hit.replay_tokens > 0;
    k->st.admitted++;
    k->st.hit_tokens += r->hit.kv_tokens - r->hit.replay_tokens;
    k->st.replay_tokens += r->hit.replay_tokens;
    if (!k->refused)
        admit_line(k, r);
    kvcache_event e = {.kind = KVCACHE_ADMIT, .id = r->id, .user = r->user, .status = DI_OK,
                       .kv_cached = r->hit.kv_tokens, .replay = r->hit.replay_tokens,
                       .window_cached = r->hit.load_window};
    push_event(k, &e);
}

di_status kvcache_admit(kvcache *k, uint64_t id, const int32_t *prompt, uint32_t len,
                        uint32_t max_tokens, void *user, di_error *err)
{
    kv_req *r;
    di_status st = req_new(k, id, prompt, len, max_tokens, &r, err);
    if (st == DI_OK && (st = reserve_event(k, err)) != DI_OK) {
        r->live = false;
        req_maybe_free(k, r);
    }
    if (st != DI_OK)
        return st;
    r->user = user;
    uint32_t bt = k->g.block_tokens;
    di_error e;
    bool ask = !k->refused && len / bt > 0;
    if (len >= bt && block_key(k, r, len / bt - 1, &e) != DI_OK)
        ask = false;
    if (!ask) { /* nothing the store could give */
        admitted(k, r);
        return DI_OK;
    }
    kjob *j = calloc(1, sizeof(*j));
    if (!j) { /* no job: no hit */
        admitted(k, r);
        return DI_OK;
    }
    *j = (kjob){.type = JOB_ADMIT, .k = k, .r = r, .id = id};
    r->loading = true;
    xfer_job_opts o = {.max_attempts = 1, .no_wait = true};
    if (submit(k, j, XFER_LOAD, &o, &e) != DI_OK) { /* queue full: no hit */
        free(j);
        r->loading = false;
        admitted(k, r);
    }
    return DI_OK;
}

di_status kvcache_track(kvcache *k, uint64_t id, const int32_t *tokens, uint32_t n,
                        uint32_t max_tokens, di_error *err)
{
    kv_req *r;
    di_status st = req_new(k, id, tokens, n, max_tokens, &r, err);
    if (st != DI_OK)
        return st;
    /* n - 1 positions have KV; their full blocks were stored by the engine it came from */
    r->prompt_len = n - 1;
    r->stored_blocks = (n - 1) / k->g.block_tokens;
    return DI_OK;
}

bool kvcache_has_load(const kvcache *k, uint64_t id)
{
    const kv_req *r = find_live(k, id);
    return r && r->n_load > 0;
}

/* ---- load ---- */

di_status kvcache_load(void *userdata, fwd_kv *kv, const sched_seq_plan *e, di_error *err)
{
    kvcache *k = userdata;
    kv_req *r = find_live(k, e->request_id);
    if (!r || e->n_load != r->hit.kv_tokens || e->load_window != r->hit.load_window ||
        r->n_load != r->hit.kv_tokens / k->g.block_tokens + (r->hit.load_window ? 1 : 0))
        return di_fail(err, DI_EINTERNAL, "request %llu: the plan loads %u positions%s, %u were "
                       "fetched", (unsigned long long)e->request_id, e->n_load,
                       e->load_window ? " and the window state" : "",
                       r ? r->hit.kv_tokens : 0);
    di_status st = DI_OK;
    for (uint32_t i = 0; i < r->n_load && st == DI_OK; i++) {
        const kv_obj *o = &r->load[i];
        if (o->cls == KVKEY_BLOCK)
            st = kvio_block_import(kv, e->block_table[o->position / k->g.block_tokens], o->buf,
                                   o->bytes, o->key.b, o->position, err);
        else
            st = kvio_window_import(kv, (uint32_t)e->state_slot, o->buf, o->bytes, o->key.b,
                                    o->position, err);
    }
    if (st == DI_OK && !r->hit.load_window)
        kvio_slot_clear(kv, (uint32_t)e->state_slot); /* replay: rows read no window below it */
    if (st == DI_OK) {
        k->st.blocks_loaded += r->hit.kv_tokens / k->g.block_tokens;
        k->st.windows_loaded += r->hit.load_window;
    }
    obj_free(r->load, r->n_load);
    free(r->load);
    r->load = NULL;
    r->n_load = 0;
    return st;
}

/* ---- after a step: copies and store jobs ---- */

static di_status pending_push(kv_req *r, kv_obj o, di_error *err)
{
    if (r->n_pending == r->cap_pending) {
        uint32_t cap = r->cap_pending ? 2 * r->cap_pending : 8;
        kv_obj *n = realloc(r->pending, cap * sizeof(kv_obj));
        if (!n) {
            free(o.buf);
            return di_fail(err, DI_ENOMEM, "KV copies");
        }
        r->pending = n;
        r->cap_pending = cap;
    }
    r->pending[r->n_pending++] = o;
    return DI_OK;
}

/* Copies block j (positions 128 j ..) of the entry into host memory. */
static di_status copy_block(kvcache *k, kv_req *r, fwd_kv *kv, const sched_seq_plan *e, uint32_t j,
                            kv_obj *out, di_error *err)
{
    di_status st = block_key(k, r, j, err);
    if (st != DI_OK)
        return st;
    uint8_t *buf = malloc(k->block_bytes);
    if (!buf)
        return di_fail(err, DI_ENOMEM, "KV block copy");
    uint64_t pos = (uint64_t)j * k->g.block_tokens;
    st = kvio_block_export(kv, e->block_table[j], r->keys[j].b, pos, buf, k->block_bytes, err);
    if (st != DI_OK) {
        free(buf);
        return st;
    }
    *out = (kv_obj){.cls = KVKEY_BLOCK, .key = r->keys[j], .buf = buf, .bytes = k->block_bytes,
                    .position = pos};
    return DI_OK;
}

static di_status copy_window(kvcache *k, kv_req *r, fwd_kv *kv, const sched_seq_plan *e,
                             uint64_t b, kv_obj *out, di_error *err)
{
    uint32_t j = (uint32_t)(b / k->g.block_tokens) - 1;
    di_status st = block_key(k, r, j, err);
    if (st != DI_OK)
        return st;
    uint8_t *buf = malloc(k->window_bytes);
    if (!buf)
        return di_fail(err, DI_ENOMEM, "KV window state copy");
    st = kvio_window_export(kv, (uint32_t)e->state_slot, b, r->keys[j].b, buf, k->window_bytes,
                            err);
    if (st != DI_OK) {
        free(buf);
        return st;
    }
    *out = (kv_obj){.cls = KVKEY_WINDOW, .key = r->keys[j], .buf = buf, .bytes = k->window_bytes,
                    .position = b};
    return DI_OK;
}

/* The prompt's last chunk ran: its new full blocks (still held by the request) and the window
 * states copied on the way, as one store job. */
static di_status store_prompt(kvcache *k, kv_req *r, fwd_kv *kv, const sched_seq_plan *e,
                              di_error *err)
{
    uint32_t bt = k->g.block_tokens;
    uint32_t j = r->hit.kv_tokens / bt, end = r->prompt_len / bt;
    if (j < r->stored_blocks)
        j = r->stored_blocks;
    for (; j < end; j++) {
        kv_obj o;
        di_status st = copy_block(k, r, kv, e, j, &o, err);
        if (st == DI_OK)
            st = pending_push(r, o, err);
        if (st != DI_OK)
            return st;
    }
    put_pending(k, r);
    return DI_OK;
}

/* Is the window state at b (a multiple of 128 the request just reached) one to keep? */
static bool want_window(const kvcache *k, const kv_req *r, uint64_t b, bool prompt)
{
    uint32_t bt = k->g.block_tokens, L = r->prompt_len;
    if (b / bt < r->n_stored_window && r->stored_window[b / bt])
        return false;
    if (!(prompt ? k->o.store_prompt : k->o.store_response))
        return false;
    if (k->o.window_every && (b / bt) % k->o.window_every == 0)
        return true;
    if (!prompt)
        return true; /* the newest one of the response (replaces the previous) */
    uint64_t self = L > k->o.always_compute ? (L - k->o.always_compute) / bt * bt : 0;
    return b == self || b == (uint64_t)L / bt * bt;
}

/* Copies what entry e completed: blocks of the response as they fill, window states at the
 * multiples of 128 it reached while the ring still holds them. */
static di_status after_entry(kvcache *k, kv_req *r, fwd_kv *kv, const sched_seq_plan *e,
                             uint64_t valid_end, bool prompt, di_error *err)
{
    uint32_t bt = k->g.block_tokens, spare = k->g.ring_positions - k->g.window;
    uint64_t written_end = (uint64_t)e->first_position + e->seqlen_q;
    uint64_t prompt_blocks_end = (uint64_t)r->prompt_len / bt * bt;
    for (uint64_t b = ((uint64_t)e->first_position / bt + 1) * bt; b <= valid_end; b += bt) {
        kv_obj o;
        di_status st;
        if (!prompt && k->o.store_response && b > prompt_blocks_end &&
            b / bt > r->stored_blocks) {
            if ((st = copy_block(k, r, kv, e, (uint32_t)(b / bt) - 1, &o, err)) != DI_OK ||
                (st = pending_push(r, o, err)) != DI_OK)
                return st;
        }
        if (written_end - b > spare || !want_window(k, r, b, prompt))
            continue;
        if ((st = copy_window(k, r, kv, e, b, &o, err)) != DI_OK)
            return st;
        bool replaces = !prompt && r->last_window >= 0 &&
                        !(k->o.window_every && (r->pending[r->last_window].position / bt) %
                                                   k->o.window_every == 0);
        if (replaces) {
            free(r->pending[r->last_window].buf);
            r->pending[r->last_window] = o;
        } else if ((st = pending_push(r, o, err)) != DI_OK) {
            return st;
        }
        if (!prompt)
            r->last_window = replaces ? r->last_window : (int32_t)r->n_pending - 1;
    }
    return DI_OK;
}

di_status kvcache_after_step(kvcache *k, fwd_kv *kv, const sched_plan *plan,
                             const sched_seq_result *results, di_error *err)
{
    if (!k || k->refused || plan->placeholder)
        return DI_OK;
    for (uint32_t i = 0; i < plan->n_seqs; i++) {
        const sched_seq_plan *e = &plan->seqs[i];
        kv_req *r = find_live(k, e->request_id);
        if (!r || r->tainted || results[i].status != SCHED_RESULT_OK)
            continue;
        uint64_t f = e->first_position;
        uint64_t valid_end = plan->prompt_run ? f + e->seqlen_q : f + results[i].n_tokens;
        if (valid_end > r->cap)
            return di_fail(err, DI_EINTERNAL, "request %llu: position %llu beyond its record",
                           (unsigned long long)e->request_id, (unsigned long long)valid_end);
        if (!plan->prompt_run)
            memcpy(r->toks + f, e->tokens, (valid_end - f) * sizeof(int32_t));
        di_status st = after_entry(k, r, kv, e, valid_end, plan->prompt_run, err);
        if (st == DI_OK && plan->prompt_run && e->sample && k->o.store_prompt)
            st = store_prompt(k, r, kv, e, err);
        if (st != DI_OK)
            return st;
    }
    return DI_OK;
}

void kvcache_finished(kvcache *k, uint64_t id, sched_finish f)
{
    kv_req *r = find_live(k, id);
    if (!r)
        return;
    if (!r->tainted && !k->refused && f != SCHED_FINISH_FAILED && f != SCHED_FINISH_ABORT)
        put_pending(k, r);
    r->live = false;
    req_maybe_free(k, r);
}

void kvcache_forget(kvcache *k, uint64_t id)
{
    kv_req *r = find(k, id);
    if (!k || !r || !r->live)
        return;
    r->live = false;
    for (int lane = 0; lane < 2; lane++) /* completes queued jobs with DI_ECANCELED */
        if (k->x[lane])
            (void)xfer_cancel(k->x[lane], id);
    size_t w = k->ev_head;
    for (size_t i = k->ev_head; i < k->ev_n; i++) /* its admission event not yet taken */
        if (!(k->ev[i].kind == KVCACHE_ADMIT && k->ev[i].id == id))
            k->ev[w++] = k->ev[i];
    k->ev_n = w;
    if (!r->loading) {
        obj_free(r->pending, r->n_pending);
        r->n_pending = 0;
    }
    req_maybe_free(k, r);
}

di_status kvcache_call(kvcache *k, xfer_kind kind, uint64_t id, kvcache_call_fn fn, void *ctx,
                       void *user, const xfer_job_opts *o, di_error *err)
{
    if (!k || !fn)
        return di_fail(err, DI_EINVAL, "KV cache call: cache and function are required");
    kjob *j = calloc(1, sizeof(*j));
    if (!j)
        return di_fail(err, DI_ENOMEM, "KV cache call");
    *j = (kjob){.type = JOB_CALL, .k = k, .id = id, .fn = fn, .ctx = ctx, .user = user};
    di_status st = reserve_event(k, err);
    if (st == DI_OK && (st = submit(k, j, kind, o, err)) != DI_OK)
        k->owed--;
    if (st != DI_OK)
        free(j);
    return st;
}

/* ---- completions ---- */

static void on_done(kvcache *k, const xfer_done *d)
{
    kjob *j = d->job;
    kv_req *r = j->r;
    unlist(k, j);
    k->st.retries += d->attempts > 1 ? d->attempts - 1 : 0;
    if (r)
        r->jobs--;
    if (j->type == JOB_CALL) {
        kvcache_event e = {.kind = KVCACHE_CALL, .id = j->id, .user = j->user,
                           .status = d->status, .err = d->err};
        push_event(k, &e);
    } else if (j->type == JOB_ADMIT) {
        r->loading = false;
        k->st.errors += j->n_bad;
        if (j->n_bad)
            warn(k, "prompt %llu: %u object%s from the KV store unusable (%s): ignoring %s, "
                 "computing from position %u", (unsigned long long)r->id, j->n_bad,
                 j->n_bad > 1 ? "s" : "", j->first_bad, j->n_bad > 1 ? "them" : "it",
                 r->hit.compute_from);
        if (d->status != DI_OK) {
            obj_free(r->load, r->n_load);
            free(r->load);
            r->load = NULL;
            r->n_load = 0;
            r->hit = (prefix_hit){.prefill_tokens = r->prompt_len};
            if (d->status != DI_ECANCELED) {
                k->st.errors++;
                k->st.load_failures++;
                warn(k, "KV store at %s: %s: computing the prompt without it; the store is "
                     "tried again after a back-off", k->target, d->err.msg);
            }
        }
        if (r->live)
            admitted(k, r);
        else
            k->owed--; /* forgotten: no event */
    } else {
        k->st.blocks_stored += j->blocks_stored;
        k->st.windows_stored += j->windows_stored;
        if (j->bad) {
            k->st.errors += j->bad;
            warn(k, "request %llu: %u of %u KV objects were not stored (%s): ignoring them",
                 (unsigned long long)j->id, j->bad, j->n_objs, j->first_bad);
        }
        if (d->status != DI_OK && d->status != DI_ECANCELED) {
            k->st.errors++;
            k->st.store_failures++;
            warn(k, "KV store at %s: %s (%u attempts): not stored; the store is tried again "
                 "after a back-off", k->target, d->err.msg, d->attempts);
        }
    }
    j->r = NULL;
    job_free(j);
    if (r)
        req_maybe_free(k, r);
}

size_t kvcache_poll(kvcache *k, kvcache_event *out, size_t max)
{
    xfer_done d[POLL_BATCH];
    size_t n;
    for (int lane = 0; lane < 2; lane++)
        while (k->x[lane] && (n = xfer_poll(k->x[lane], d, POLL_BATCH)) > 0)
            for (size_t i = 0; i < n; i++)
                on_done(k, &d[i]);
    size_t m = 0;
    while (m < max && k->ev_head < k->ev_n)
        out[m++] = k->ev[k->ev_head++];
    return m;
}

di_status kvcache_wait(kvcache *k, uint64_t timeout_ns, di_error *err)
{
    uint64_t until = di_mono_ns() + timeout_ns;
    di_status st = xfer_wait(k->x[0], timeout_ns, err);
    if (st == DI_OK && k->x[1]) {
        uint64_t now = di_mono_ns();
        st = xfer_wait(k->x[1], now < until ? until - now : 0, err);
    }
    return st;
}

uint32_t kvcache_pending(const kvcache *k)
{
    if (!k)
        return 0;
    return xfer_get_stats(k->x[0]).pending + (k->x[1] ? xfer_get_stats(k->x[1]).pending : 0);
}

uint32_t kvcache_records(const kvcache *k)
{
    return k ? k->n_records : 0;
}

kvcache_stats kvcache_get_stats(const kvcache *k)
{
    kvcache_stats z = {0};
    return k ? k->st : z;
}
