/* kvcache.c: di-generate's use of the KV store (see kvcache.h): an adapter over the engine's
 * KV cache of common/serve/kvcache.h. */
#include "tools/generate/kvcache.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/net/kv_client.h"
#include "common/serve/kvcache.h"

/* What admission gave one prompt. */
typedef struct gen_hit {
    bool done;
    uint32_t kv_cached, replay;
    bool window_cached;
} gen_hit;

struct gen_kv {
    gen_kv_options o;
    char target[256];       /* o.target copied */
    kvc_client *c;
    kvcache *kc;
    gen_hit *hits;          /* [n_requests], request id - 1 (di-generate numbers its prompts) */
    uint64_t wait_ns;       /* the longest a store job may take, back-offs included */
};

bool gen_kv_supported(void)
{
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
    k->hits = calloc(o->n_requests, sizeof(gen_hit));
    if (!k->hits) {
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
    kvcache_options ko = {.client = k->c, .target = k->target, .allow_replay = o->allow_replay,
                          .window_every = o->window_every, .always_compute = o->always_compute,
                          .store_prompt = true, .store_response = true, .log = o->log};
    if (st == DI_OK)
        st = kvcache_create(&ko, g, &k->kc, err);
    if (st != DI_OK) {
        gen_kv_close(k);
        return st;
    }
    /* each attempt of a job: its deadline; between attempts: back-offs up to 2 s */
    uint64_t attempts = 3, deadline = (o->deadline_ms ? o->deadline_ms : 10000) * 1000000ull;
    k->wait_ns = attempts * (deadline + 2000000000ull) + 1000000000ull;
    di_error e;
    st = kvcache_check(k->kc, &e);
    if (st == DI_OK)
        di_log(o->log, DI_LOG_INFO, "KV store at %s: model %016llx, blocks of %zu bytes, window "
               "states of %zu bytes", k->target, (unsigned long long)g->model_id,
               kv_block_bytes(g), kv_window_state_bytes(g));
    else if (kvcache_get_stats(k->kc).refused)
        di_log(o->log, DI_LOG_WARN, "KV store at %s: %s: not using it for this run", k->target,
               e.msg);
    *out = k;
    return DI_OK;
}

/* Takes the finished events: admissions into hits, the rest is the cache's bookkeeping. */
static void poll(gen_kv *k)
{
    kvcache_event ev[64];
    size_t n;
    while ((n = kvcache_poll(k->kc, ev, 64)) > 0)
        for (size_t i = 0; i < n; i++)
            if (ev[i].kind == KVCACHE_ADMIT && ev[i].id >= 1 && ev[i].id <= k->o.n_requests)
                k->hits[ev[i].id - 1] = (gen_hit){.done = true, .kv_cached = ev[i].kv_cached,
                                                  .replay = ev[i].replay,
                                                  .window_cached = ev[i].window_cached};
}

void gen_kv_drain(gen_kv *k)
{
    if (!k || !k->kc)
        return;
    di_error e;
    poll(k);
    if (kvcache_wait(k->kc, k->wait_ns, &e) != DI_OK)
        di_log(k->o.log, DI_LOG_WARN, "KV store at %s: %s: leaving the rest unstored", k->target,
               e.msg);
    poll(k);
}

void gen_kv_close(gen_kv *k)
{
    if (!k)
        return;
    gen_kv_drain(k);
    kvcache_destroy(k->kc);
    kvc_close(k->c);
    free(k->hits);
    free(k);
}

gen_kv_stats gen_kv_get_stats(const gen_kv *k)
{
    gen_kv_stats z = {0};
    if (!k)
        return z;
    kvcache_stats s = kvcache_get_stats(k->kc);
    return (gen_kv_stats){.hit_tokens = s.hit_tokens, .replay_tokens = s.replay_tokens,
                          .blocks_loaded = s.blocks_loaded, .windows_loaded = s.windows_loaded,
                          .blocks_stored = s.blocks_stored, .windows_stored = s.windows_stored,
                          .errors = s.errors, .load_failures = s.load_failures,
                          .store_failures = s.store_failures, .retries = s.retries,
                          .refused = s.refused};
}

di_status gen_kv_admit(gen_kv *k, uint64_t id, const int32_t *prompt, uint32_t len,
                       di_error *err)
{
    if (!k || !prompt || len == 0 || id == 0 || id > k->o.n_requests)
        return di_fail(err, DI_EINVAL, "KV store: request %llu unknown", (unsigned long long)id);
    return kvcache_admit(k->kc, id, prompt, len, k->o.max_tokens, NULL, err);
}

di_status gen_kv_collect(gen_kv *k, di_error *err)
{
    di_status st = kvcache_wait(k->kc, k->wait_ns, err);
    poll(k);
    return st;
}

void gen_kv_hit(const gen_kv *k, sched_request *sr)
{
    const gen_hit *h = k && sr->id >= 1 && sr->id <= k->o.n_requests ? &k->hits[sr->id - 1]
                                                                      : NULL;
    if (!h || !h->done)
        return;
    sr->kv_cached = h->kv_cached;
    sr->replay = h->replay;
    sr->window_cached = h->window_cached;
}

di_status gen_kv_load(void *userdata, fwd_kv *kv, const sched_seq_plan *e, di_error *err)
{
    gen_kv *k = userdata;
    return kvcache_load(k ? k->kc : NULL, kv, e, err);
}

di_status gen_kv_after_step(gen_kv *k, fwd_kv *kv, const sched_plan *plan,
                            const sched_seq_result *results, di_error *err)
{
    if (!k)
        return DI_OK;
    di_status st = kvcache_after_step(k->kc, kv, plan, results, err);
    poll(k);
    return st;
}

void gen_kv_finished(gen_kv *k, uint64_t id, sched_finish f)
{
    if (k)
        kvcache_finished(k->kc, id, f);
}
