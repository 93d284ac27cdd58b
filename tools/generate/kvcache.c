/* kvcache.c: di-generate's use of the KV store (see kvcache.h). */
#include "tools/generate/kvcache.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/engine/prefix.h"
#include "common/model/kv_io.h"
#include "common/net/kv_client.h"

#define PUT_BATCH 256u /* objects per put: bounds the host copies of a long prompt */

/* One store object held in host memory. */
typedef struct kv_obj {
    int cls;                /* KVKEY_BLOCK or KVKEY_WINDOW */
    kvkey key;
    uint8_t *buf;           /* the whole object, header included */
    uint64_t bytes;
    uint64_t position;      /* block: first position; window state: its position */
} kv_obj;

/* What the store side knows of one request. */
typedef struct kv_req {
    bool live;              /* admitted and not finished */
    uint32_t prompt_len;
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
    kv_obj *pending;        /* copied objects waiting for the next put */
    uint32_t n_pending, cap_pending;
    int32_t last_window;    /* pending index of the response's newest window state, -1 none */
} kv_req;

struct gen_kv {
    gen_kv_options o;
    char target[256];       /* o.target copied */
    kv_geometry g;
    size_t block_bytes, window_bytes;
    kvc_client *c;
    bool off;               /* given up: no more store calls */
    kv_req *reqs;           /* [n_requests], request id - 1 */
    gen_kv_stats st;
};

/* ---- small helpers ---- */

static void obj_free(kv_obj *o, uint32_t n)
{
    for (uint32_t i = 0; o && i < n; i++)
        free(o[i].buf);
}

static void req_clear(kv_req *r)
{
    free(r->toks);
    free(r->keys);
    free(r->stored_window);
    obj_free(r->load, r->n_load);
    free(r->load);
    obj_free(r->pending, r->n_pending);
    free(r->pending);
    memset(r, 0, sizeof(*r));
    r->last_window = -1;
}

static kv_req *find(gen_kv *k, uint64_t id)
{
    if (!k || id == 0 || id > k->o.n_requests || !k->reqs[id - 1].live)
        return NULL;
    return &k->reqs[id - 1];
}

/* The first failed call ends the store's part in the run, with one line. */
static void give_up(gen_kv *k, const char *doing, const di_error *e)
{
    di_log(k->o.log, DI_LOG_WARN, "KV store at %s: %s failed (%s): ignoring the KV store for "
           "the rest of this run", k->target, doing, e->msg);
    k->off = true;
    k->st.disabled = true;
    k->st.errors++;
}

/* Key of full block j, extending the chain from the tokens recorded so far. */
static di_status block_key(gen_kv *k, kv_req *r, uint32_t j, di_error *err)
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

/* ---- open / close ---- */

bool gen_kv_supported(void)
{
    return true;
}

/* The store must keep objects of exactly our formats. */
static bool same_formats(gen_kv *k, const kvc_store_info *in, di_error *e)
{
    const kv_geometry *s = &in->geometry;
    if (in->object_bytes[KVKEY_BLOCK] != k->block_bytes ||
        in->object_bytes[KVKEY_WINDOW] != k->window_bytes ||
        s->ring_positions != k->g.ring_positions) {
        di_fail(e, DI_EINVAL, "it keeps blocks of %llu bytes and window states of %llu bytes "
                "with %u ring positions; this model writes %zu, %zu and %u (same config and "
                "--nextn as the store's?)", (unsigned long long)in->object_bytes[KVKEY_BLOCK],
                (unsigned long long)in->object_bytes[KVKEY_WINDOW], s->ring_positions,
                k->block_bytes, k->window_bytes, k->g.ring_positions);
        return false;
    }
    return true;
}

di_status gen_kv_open(const gen_kv_options *o, const kv_geometry *g, gen_kv **out, di_error *err)
{
    if (!o || !g || !out || !o->target || !*o->target)
        return di_fail(err, DI_EINVAL, "--kvstore needs HOST:PORT");
    if (strlen(o->target) >= sizeof(((gen_kv *)0)->target))
        return di_fail(err, DI_EINVAL, "--kvstore: address of %zu characters is too long",
                       strlen(o->target));
    if (o->n_requests == 0 || o->always_compute == 0)
        return di_fail(err, DI_EINVAL, "KV store: no requests or no tail to compute");
    gen_kv *k = calloc(1, sizeof(*k));
    if (!k)
        return di_fail(err, DI_ENOMEM, "KV store client");
    k->o = *o;
    snprintf(k->target, sizeof k->target, "%s", o->target);
    k->g = *g;
    k->block_bytes = kv_block_bytes(g);
    k->window_bytes = kv_window_state_bytes(g);
    k->reqs = calloc(o->n_requests, sizeof(kv_req));
    if (!k->reqs) {
        gen_kv_close(k);
        return di_fail(err, DI_ENOMEM, "KV store: %u requests", o->n_requests);
    }
    kvc_options co;
    kvc_options_default(&co);
    co.target = k->target;
    co.token = o->token;
    co.deadline_ms = o->deadline_ms;
    co.model_id = g->model_id;
    di_status st = o->data_path ? kvc_data_path_parse(o->data_path, &co.data_path, err) : DI_OK;
    if (st == DI_OK)
        st = kvc_open(&co, &k->c, err);
    if (st != DI_OK) {
        gen_kv_close(k);
        return st;
    }
    kvc_store_info info;
    di_error e;
    if (kvc_info(k->c, &info, &e) != DI_OK)
        give_up(k, "connecting", &e);
    else if (!same_formats(k, &info, &e))
        give_up(k, "checking its formats", &e);
    else
        di_log(o->log, DI_LOG_INFO, "KV store at %s: model %016llx, blocks of %zu bytes, window "
               "states of %zu bytes", k->target, (unsigned long long)g->model_id,
               k->block_bytes, k->window_bytes);
    *out = k;
    return DI_OK;
}

void gen_kv_close(gen_kv *k)
{
    if (!k)
        return;
    for (uint32_t i = 0; k->reqs && i < k->o.n_requests; i++)
        req_clear(&k->reqs[i]);
    free(k->reqs);
    kvc_close(k->c);
    free(k);
}

gen_kv_stats gen_kv_get_stats(const gen_kv *k)
{
    gen_kv_stats z = {0};
    return k ? k->st : z;
}

/* ---- admission: decide, fetch ---- */

/* The prefix rule; without --kvstore-replay a replay becomes an exact resume at the newest
 * window state at or below the block hit (or no hit). */
static prefix_hit decide(const gen_kv *k, uint32_t len, uint32_t blocks, const bool *has_window,
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
    uint32_t n_bad;         /* objects found unusable */
    char first_bad[400];    /* what the first of them was */
} fetch;

static void fetch_free(fetch *f)
{
    for (uint32_t i = 0; i < f->n; i++)
        free(f->blk ? f->blk[i] : NULL);
    for (uint32_t i = 0; f->win && i <= f->n; i++)
        free(f->win[i]);
    free(f->blk);
    free(f->win);
    free(f->has_window);
}

static void fetch_bad(fetch *f, const char *what, uint32_t index, const di_error *e)
{
    if (f->n_bad++ == 0)
        snprintf(f->first_bad, sizeof f->first_bad, "%s %u: %s", what, index, e->msg);
}

/* A sound object that is not what its key names (another position, another key) is wrong for
 * every reader: delete it, so that the correct one can be stored again. */
static void delete_wrong(gen_kv *k, const kvc_item *it)
{
    di_error e;
    di_status st = kvc_delete1(k->c, it->cls, &it->key, &e);
    if (st == DI_EUNAVAIL || st == DI_ETIMEDOUT)
        give_up(k, "deleting a wrong object", &e);
}

/* Gets the objects decision h needs that are not fetched yet; an unusable one lowers what is
 * believed usable. *done: every object of h is in hand. */
static void fetch_round(gen_kv *k, kv_req *r, fetch *f, const prefix_hit *h, bool *done)
{
    uint32_t bt = k->g.block_tokens, nb = h->kv_tokens / bt;
    uint32_t wk = h->load_window ? h->compute_from / bt : 0;
    kvc_item items[PUT_BATCH];
    uint32_t idx[PUT_BATCH], n = 0;
    for (uint32_t j = 0; j < nb && n < PUT_BATCH; j++)
        if (!f->blk[j]) {
            items[n] = (kvc_item){.cls = KVKEY_BLOCK, .key = r->keys[j], .cap = k->block_bytes};
            idx[n++] = j;
        }
    if (wk && !f->win[wk] && n < PUT_BATCH) {
        items[n] = (kvc_item){.cls = KVKEY_WINDOW, .key = r->keys[wk - 1], .cap = k->window_bytes};
        idx[n++] = wk;
    }
    *done = n == 0;
    if (n == 0)
        return;
    for (uint32_t i = 0; i < n; i++)
        items[i].buf = malloc(items[i].cap);
    di_error e;
    di_status st = DI_OK;
    for (uint32_t i = 0; i < n && st == DI_OK; i++)
        if (!items[i].buf)
            st = di_fail(&e, DI_ENOMEM, "%llu bytes", (unsigned long long)items[i].cap);
    if (st == DI_OK)
        st = kvc_get(k->c, items, n, &e);
    if (st != DI_OK) {
        char doing[96];
        snprintf(doing, sizeof doing, "reading the cached prefix of prompt %u",
                 (unsigned)(r - k->reqs) + 1);
        give_up(k, doing, &e);
        for (uint32_t i = 0; i < n; i++)
            free(items[i].buf);
        return;
    }
    for (uint32_t i = 0; i < n; i++) {
        kvc_item *it = &items[i];
        bool block = it->cls == KVKEY_BLOCK;
        if (it->status == DI_OK) {
            it->status = block ? kvio_block_check(&k->g, it->buf, it->bytes, it->key.b,
                                                  (uint64_t)idx[i] * bt, &it->error)
                               : kvio_window_check(&k->g, it->buf, it->bytes, it->key.b,
                                                   (uint64_t)idx[i] * bt, &it->error);
            if (it->status != DI_OK)
                delete_wrong(k, it);
        }
        if (it->status == DI_OK) {
            (block ? f->blk : f->win)[idx[i]] = it->buf;
            continue;
        }
        free(it->buf);
        fetch_bad(f, block ? "block" : "window state at block", idx[i], &it->error);
        if (block && idx[i] < f->avail)
            f->avail = f->stored = idx[i]; /* it will be computed and stored again */
        if (!block)
            f->has_window[idx[i]] = false;
    }
}

/* Moves the objects decision h uses into r->load; the rest of f is freed by the caller. */
static di_status keep_loads(gen_kv *k, kv_req *r, fetch *f, di_error *err)
{
    uint32_t bt = k->g.block_tokens, nb = r->hit.kv_tokens / bt;
    uint32_t n = nb + (r->hit.load_window ? 1 : 0);
    if (n == 0)
        return DI_OK;
    r->load = calloc(n, sizeof(kv_obj));
    if (!r->load)
        return di_fail(err, DI_ENOMEM, "KV store: %u objects", n);
    for (uint32_t j = 0; j < nb; j++) {
        r->load[j] = (kv_obj){.cls = KVKEY_BLOCK, .key = r->keys[j], .buf = f->blk[j],
                              .bytes = k->block_bytes, .position = (uint64_t)j * bt};
        f->blk[j] = NULL;
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

/* Lookup of every full block (what the store holds is not put again), then fetches until every
 * object of the decision is in hand. */
static di_status find_prefix(gen_kv *k, kv_req *r, uint32_t len, di_error *err)
{
    uint32_t bt = k->g.block_tokens;
    uint32_t cap = len > k->o.always_compute ? (len - k->o.always_compute) / bt : 0;
    uint32_t n = len / bt < KVC_MAX_LOOKUP ? len / bt : KVC_MAX_LOOKUP;
    r->hit = (prefix_hit){.prefill_tokens = len};
    if (n == 0 || k->off)
        return DI_OK;
    fetch f = {.n = n};
    f.has_window = calloc(n + 1, sizeof(bool));
    f.blk = calloc(n, sizeof(uint8_t *));
    f.win = calloc(n + 1, sizeof(uint8_t *));
    uint32_t *wins = calloc(n + 1, sizeof(uint32_t));
    di_status st = DI_OK;
    if (!f.has_window || !f.blk || !f.win || !wins)
        st = di_fail(err, DI_ENOMEM, "KV store lookup of %u blocks", n);
    size_t nw = 0;
    di_error e;
    char doing[80];
    snprintf(doing, sizeof doing, "looking up prompt %u", (unsigned)(r - k->reqs) + 1);
    if (st == DI_OK && kvc_lookup(k->c, r->keys, n, &f.stored, wins, n + 1, &nw, &e) != DI_OK)
        give_up(k, doing, &e);
    for (size_t i = 0; i < nw; i++)
        if (wins[i] >= 1 && wins[i] <= n)
            f.has_window[wins[i]] = true;
    free(wins);
    f.avail = f.stored < cap ? f.stored : cap;
    bool done = false;
    while (st == DI_OK && !k->off && !done) {
        r->hit = decide(k, len, f.avail, f.has_window, n + 1);
        fetch_round(k, r, &f, &r->hit, &done);
    }
    if (!done)
        r->hit = (prefix_hit){.prefill_tokens = len}; /* the store gave out on the way */
    if (f.n_bad)
        di_log(k->o.log, DI_LOG_WARN, "prompt %u: %u object%s from the KV store unusable (%s): "
               "ignoring %s, computing from position %u", (unsigned)(r - k->reqs) + 1, f.n_bad,
               f.n_bad > 1 ? "s" : "", f.first_bad, f.n_bad > 1 ? "them" : "it",
               r->hit.compute_from);
    k->st.errors += f.n_bad;
    if (st == DI_OK)
        st = keep_loads(k, r, &f, err);
    if (st == DI_OK && !k->off) {
        r->stored_blocks = f.stored;
        r->stored_window = f.has_window;
        r->n_stored_window = n + 1;
        f.has_window = NULL;
    }
    fetch_free(&f);
    return st;
}

static void admit_line(gen_kv *k, uint64_t id, const kv_req *r)
{
    const prefix_hit *h = &r->hit;
    uint32_t bt = k->g.block_tokens;
    if (h->kv_tokens == 0) {
        di_log(k->o.log, DI_LOG_INFO, "prompt %llu: %u tokens, no cached prefix; prefill computes "
               "%u", (unsigned long long)id, r->prompt_len, h->prefill_tokens);
        return;
    }
    char how[64];
    if (h->load_window)
        snprintf(how, sizeof how, "the window state at %u", h->compute_from);
    else
        snprintf(how, sizeof how, "no window state: replay from %u", h->compute_from);
    di_log(k->o.log, DI_LOG_INFO, "prompt %llu: %u of %u tokens from the KV store (%u blocks, %s); "
           "prefill computes %u", (unsigned long long)id, h->kv_tokens - h->replay_tokens,
           r->prompt_len, h->kv_tokens / bt, how, h->prefill_tokens);
}

di_status gen_kv_admit(gen_kv *k, uint64_t id, const int32_t *prompt, uint32_t len,
                       sched_request *sr, di_error *err)
{
    if (!k || !prompt || len == 0 || !sr || id == 0 || id > k->o.n_requests ||
        k->reqs[id - 1].live)
        return di_fail(err, DI_EINVAL, "KV store: request %llu unknown or admitted twice",
                       (unsigned long long)id);
    kv_req *r = &k->reqs[id - 1];
    req_clear(r);
    uint32_t bt = k->g.block_tokens;
    uint64_t cap = (uint64_t)len + k->o.max_tokens + 2 * bt;
    if (cap > UINT32_MAX)
        return di_fail(err, DI_EINVAL, "KV store: request %llu too long",
                       (unsigned long long)id);
    r->cap = (uint32_t)cap;
    r->toks = malloc(cap * sizeof(int32_t));
    r->keys = malloc((cap / bt + 1) * sizeof(kvkey));
    if (!r->toks || !r->keys) {
        req_clear(r);
        return di_fail(err, DI_ENOMEM, "KV store: request %llu", (unsigned long long)id);
    }
    memcpy(r->toks, prompt, len * sizeof(int32_t));
    r->prompt_len = len;
    r->live = true;
    di_error e;
    if (!k->off && len >= bt && block_key(k, r, len / bt - 1, &e) != DI_OK)
        give_up(k, "computing block keys", &e);
    di_status st = find_prefix(k, r, len, err);
    if (st != DI_OK)
        return st;
    r->tainted = r->hit.replay_tokens > 0;
    sr->kv_cached = r->hit.kv_tokens;
    sr->replay = r->hit.replay_tokens;
    sr->window_cached = r->hit.load_window;
    k->st.hit_tokens += r->hit.kv_tokens - r->hit.replay_tokens;
    k->st.replay_tokens += r->hit.replay_tokens;
    if (!k->off)
        admit_line(k, id, r);
    return DI_OK;
}

/* ---- load ---- */

di_status gen_kv_load(void *userdata, fwd_kv *kv, const sched_seq_plan *e, di_error *err)
{
    gen_kv *k = userdata;
    kv_req *r = find(k, e->request_id);
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

/* ---- after a step: copies and puts ---- */

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
static di_status copy_block(gen_kv *k, kv_req *r, fwd_kv *kv, const sched_seq_plan *e, uint32_t j,
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

static di_status copy_window(gen_kv *k, kv_req *r, fwd_kv *kv, const sched_seq_plan *e,
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

/* One put of objects; per-object failures are one line, a failed call gives the store up. */
static void put_objects(gen_kv *k, uint64_t id, kv_obj *objs, uint32_t n)
{
    for (uint32_t i0 = 0; i0 < n && !k->off; i0 += PUT_BATCH) {
        uint32_t m = n - i0 < PUT_BATCH ? n - i0 : PUT_BATCH;
        kvc_item items[PUT_BATCH];
        for (uint32_t i = 0; i < m; i++)
            items[i] = (kvc_item){.cls = objs[i0 + i].cls, .key = objs[i0 + i].key,
                                  .buf = objs[i0 + i].buf, .cap = objs[i0 + i].bytes};
        di_error e;
        if (kvc_put(k->c, items, m, &e) != DI_OK) {
            char doing[80];
            snprintf(doing, sizeof doing, "storing the KV of prompt %llu", (unsigned long long)id);
            give_up(k, doing, &e);
            return;
        }
        uint32_t bad = 0;
        const char *first = NULL;
        for (uint32_t i = 0; i < m; i++) {
            if (items[i].status == DI_OK || items[i].status == DI_EEXIST) {
                if (items[i].cls == KVKEY_BLOCK)
                    k->st.blocks_stored++;
                else
                    k->st.windows_stored++;
            } else if (bad++ == 0) {
                first = items[i].error.msg;
            }
        }
        if (bad) {
            di_log(k->o.log, DI_LOG_WARN, "prompt %llu: %u of %u KV objects were not stored (%s): "
                   "ignoring them", (unsigned long long)id, bad, m, first);
            k->st.errors += bad;
        }
    }
}

static void put_pending(gen_kv *k, uint64_t id, kv_req *r)
{
    if (!k->off && r->n_pending)
        put_objects(k, id, r->pending, r->n_pending);
    obj_free(r->pending, r->n_pending);
    r->n_pending = 0;
    r->last_window = -1;
}

/* The prompt's last chunk ran: its new full blocks (still held by the request) and the window
 * states copied on the way, in puts of at most PUT_BATCH objects. */
static di_status store_prompt(gen_kv *k, uint64_t id, kv_req *r, fwd_kv *kv,
                              const sched_seq_plan *e, di_error *err)
{
    uint32_t bt = k->g.block_tokens;
    uint32_t j = r->hit.kv_tokens / bt, end = r->prompt_len / bt;
    if (j < r->stored_blocks)
        j = r->stored_blocks;
    while (j < end && !k->off) {
        kv_obj objs[PUT_BATCH];
        uint32_t n = 0;
        di_status st = DI_OK;
        for (; j < end && n < PUT_BATCH && st == DI_OK; j++)
            if ((st = copy_block(k, r, kv, e, j, &objs[n], err)) == DI_OK)
                n++;
        if (st == DI_OK)
            put_objects(k, id, objs, n);
        obj_free(objs, n);
        if (st != DI_OK)
            return st;
    }
    put_pending(k, id, r);
    return DI_OK;
}

/* Is the window state at b (a multiple of 128 the request just reached) one to keep? */
static bool want_window(const gen_kv *k, const kv_req *r, uint64_t b, bool prompt)
{
    uint32_t bt = k->g.block_tokens, L = r->prompt_len;
    if (b / bt < r->n_stored_window && r->stored_window[b / bt])
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
static di_status after_entry(gen_kv *k, kv_req *r, fwd_kv *kv, const sched_seq_plan *e,
                             uint64_t valid_end, bool prompt, di_error *err)
{
    uint32_t bt = k->g.block_tokens, spare = k->g.ring_positions - k->g.window;
    uint64_t written_end = (uint64_t)e->first_position + e->seqlen_q;
    uint64_t prompt_blocks_end = (uint64_t)r->prompt_len / bt * bt;
    for (uint64_t b = ((uint64_t)e->first_position / bt + 1) * bt; b <= valid_end; b += bt) {
        kv_obj o;
        di_status st;
        if (b > prompt_blocks_end && b / bt > r->stored_blocks) {
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

di_status gen_kv_after_step(gen_kv *k, fwd_kv *kv, const sched_plan *plan,
                            const sched_seq_result *results, di_error *err)
{
    if (!k || k->off || plan->placeholder)
        return DI_OK;
    for (uint32_t i = 0; i < plan->n_seqs; i++) {
        const sched_seq_plan *e = &plan->seqs[i];
        kv_req *r = find(k, e->request_id);
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
        if (st == DI_OK && plan->prompt_run && e->sample)
            st = store_prompt(k, e->request_id, r, kv, e, err);
        if (st != DI_OK)
            return st;
        if (k->off)
            break;
    }
    return DI_OK;
}

void gen_kv_finished(gen_kv *k, uint64_t id, sched_finish f)
{
    kv_req *r = find(k, id);
    if (!r)
        return;
    if (!r->tainted && f != SCHED_FINISH_FAILED)
        put_pending(k, id, r);
    req_clear(r);
}
