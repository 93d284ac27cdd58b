/* ranks.c: placement under a lock, a channel per rank, the heartbeat poller and the watcher
 * of the channels that are down (ranks.h). */
#include "router/ranks.h"

#include <assert.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "common/util/clock.h"
#include "engine.pb-c.h"

/* How long the watcher waits on the channels that are down at a time, and sleeps between
 * looks when none is. */
#define WATCH_MS 100u

struct rk_table {
    rk_config cfg;
    pthread_mutex_t mu;                 /* guards pl, clients, stop, polls, reconnected */
    pthread_cond_t cv;                  /* wakes the poller: stop, or a channel reconnected */
    pthread_cond_t watch_cv;            /* wakes the watcher to stop */
    pl_table pl;
    rpc_client *clients[PL_MAX_RANKS];  /* one channel per rank, index as pl.ranks */
    bool reconnected[PL_MAX_RANKS];     /* the channel came back: poll the rank now */
    bool any_reconnected;
    bool stop;
    uint64_t polls;
    pthread_t poller, watcher;
    bool watcher_started;
};

/* GetLoad of one rank: DI_OK with *load and *draining. */
static di_status get_load(rpc_client *c, pl_role role, uint32_t timeout_ms, pl_load *load,
                          bool *draining, di_error *err)
{
    Di__Engine__LoadRequest rq = DI__ENGINE__LOAD_REQUEST__INIT;
    uint8_t buf[16];
    size_t n = di__engine__load_request__pack(&rq, buf);
    uint8_t *rep = NULL;
    size_t rn = 0;
    di_status st = rpc_client_call(c, role == PL_PREFILL ? "/di.prefill.Prefill/GetLoad"
                                                         : "/di.decode.Decode/GetLoad",
                                   buf, n, timeout_ms, &rep, &rn, err);
    if (st != DI_OK)
        return st;
    Di__Engine__Load *l = di__engine__load__unpack(NULL, rn, rep);
    free(rep);
    if (!l)
        return di_fail(err, DI_EPROTO, "GetLoad reply does not parse");
    load->queued_tokens = l->queued_prompt_tokens;
    load->running = l->running;
    load->free_blocks = l->free_blocks;
    load->prefill_rate = l->prefill_tokens_per_s > 0 ? l->prefill_tokens_per_s : 0;
    *draining = l->draining;
    di__engine__load__free_unpacked(l, NULL);
    return DI_OK;
}

/* One round: every rank's GetLoad, then missed heartbeats applied; or (only_reconnected)
 * the GetLoad of the ranks whose channel the watcher saw come back, out of the rhythm. */
static void poll_ranks(rk_table *t, uint32_t timeout_ms, bool only_reconnected)
{
    pthread_mutex_lock(&t->mu);
    size_t n = t->pl.n;
    pthread_mutex_unlock(&t->mu);
    for (size_t i = 0; i < n; i++) {
        pthread_mutex_lock(&t->mu);
        rpc_client *c = t->clients[i];
        pl_role role = t->pl.ranks[i].role;
        bool stop = t->stop, skip = only_reconnected && !t->reconnected[i];
        t->reconnected[i] = false;
        pthread_mutex_unlock(&t->mu);
        if (stop)
            return;
        if (skip)
            continue;
        pl_load load;
        bool draining = false;
        di_error e = {0};
        di_status st = get_load(c, role, timeout_ms, &load, &draining, &e);
        pthread_mutex_lock(&t->mu);
        if (st == DI_OK && !draining) {
            pl_heartbeat(&t->pl, i, di_mono_ns(), &load);
        } else if (st == DI_OK) {
            pl_call_result(&t->pl, i, false);
        } else if (t->cfg.log && di_log_enabled(t->cfg.log, DI_LOG_DEBUG)) {
            di_log(t->cfg.log, DI_LOG_DEBUG, "rank %s: GetLoad: %s", t->pl.ranks[i].addr, e.msg);
        }
        pthread_mutex_unlock(&t->mu);
    }
    if (only_reconnected)
        return;
    pthread_mutex_lock(&t->mu);
    pl_tick(&t->pl, di_mono_ns());
    t->polls++;
    pthread_mutex_unlock(&t->mu);
}

static void poll_round(rk_table *t, uint32_t timeout_ms) { poll_ranks(t, timeout_ms, false); }

/* The CLOCK_REALTIME time ns from now, for pthread_cond_timedwait. */
static struct timespec realtime_after(uint64_t ns)
{
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    uint64_t abs_ns = (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec + ns;
    ts.tv_sec = (time_t)(abs_ns / 1000000000ull);
    ts.tv_nsec = (long)(abs_ns % 1000000000ull);
    return ts;
}

static void *poller(void *arg)
{
    rk_table *t = arg;
    uint64_t every = t->cfg.placement.heartbeat_ns;
    uint32_t timeout_ms = (uint32_t)(every / 1000000);
    if (timeout_ms < 1)
        timeout_ms = 1;
    uint64_t next = di_mono_ns(); /* the first round at once: decode needs a report */
    pthread_mutex_lock(&t->mu);
    while (!t->stop) {
        uint64_t now = di_mono_ns();
        uint64_t wait = next > now ? next - now : 0;
        struct timespec ts = realtime_after(wait);
        if (wait > 0 && t->any_reconnected) {
            t->any_reconnected = false;
            pthread_mutex_unlock(&t->mu);
            poll_ranks(t, timeout_ms, true);
            pthread_mutex_lock(&t->mu);
            continue;
        }
        if (wait > 0) {
            pthread_cond_timedwait(&t->cv, &t->mu, &ts);
            continue;
        }
        pthread_mutex_unlock(&t->mu);
        poll_round(t, timeout_ms);
        next += every;
        now = di_mono_ns();
        if (next < now) /* a slow round: keep the rhythm from now */
            next = now + every;
        pthread_mutex_lock(&t->mu);
    }
    pthread_mutex_unlock(&t->mu);
    return NULL;
}

/* Waits on the channels that are not connected, all at once, so that they make progress (a
 * channel reconnects only while some thread waits on it: the poller's fail-fast calls and its
 * sleep between rounds do not) and a rank back after a restart is polled at once, not after
 * gRPC's own background poll. The poller's rounds over the other ranks never wait for it. */
static void *watcher(void *arg)
{
    rk_table *t = arg;
    static_assert(PL_MAX_RANKS <= 1024, "the watcher keeps its lists on the stack");
    rpc_client *down[PL_MAX_RANKS];
    size_t idx[PL_MAX_RANKS];
    int up[PL_MAX_RANKS];
    pthread_mutex_lock(&t->mu);
    while (!t->stop) {
        size_t k = 0;
        for (size_t i = 0; i < t->pl.n; i++)
            if (!rpc_client_connected(t->clients[i])) {
                down[k] = t->clients[i];
                idx[k++] = i;
            }
        if (k == 0) {
            struct timespec ts = realtime_after(WATCH_MS * 1000000ull);
            pthread_cond_timedwait(&t->watch_cv, &t->mu, &ts);
            continue;
        }
        pthread_mutex_unlock(&t->mu);
        size_t n_up = rpc_clients_wait_connected(down, k, WATCH_MS, up);
        pthread_mutex_lock(&t->mu);
        for (size_t j = 0; n_up > 0 && j < k; j++)
            if (up[j]) {
                t->reconnected[idx[j]] = true;
                t->any_reconnected = true;
            }
        if (n_up > 0)
            pthread_cond_broadcast(&t->cv);
    }
    pthread_mutex_unlock(&t->mu);
    return NULL;
}

di_status rk_new(const rk_config *cfg, rk_table **out, di_error *err)
{
    rk_table *t = calloc(1, sizeof *t);
    if (!t)
        return di_fail(err, DI_ENOMEM, "cannot allocate the rank table");
    t->cfg = *cfg;
    di_status st = pl_init(&t->pl, &cfg->placement, cfg->policy, cfg->log, err);
    if (st != DI_OK) {
        free(t);
        return st;
    }
    pthread_mutex_init(&t->mu, NULL);
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_cond_init(&t->cv, &ca);
    pthread_cond_init(&t->watch_cv, &ca);
    pthread_condattr_destroy(&ca);
    if (pthread_create(&t->poller, NULL, poller, t) != 0) {
        pthread_cond_destroy(&t->cv);
        pthread_cond_destroy(&t->watch_cv);
        pthread_mutex_destroy(&t->mu);
        free(t);
        return di_fail(err, DI_ENOMEM, "cannot start the heartbeat poller");
    }
    if (pthread_create(&t->watcher, NULL, watcher, t) != 0) {
        rk_free(t);
        return di_fail(err, DI_ENOMEM, "cannot start the watcher of the ranks' channels");
    }
    t->watcher_started = true;
    *out = t;
    return DI_OK;
}

void rk_free(rk_table *t)
{
    if (!t)
        return;
    pthread_mutex_lock(&t->mu);
    t->stop = true;
    pthread_cond_broadcast(&t->cv);
    pthread_cond_broadcast(&t->watch_cv);
    pthread_mutex_unlock(&t->mu);
    pthread_join(t->poller, NULL);
    if (t->watcher_started)
        pthread_join(t->watcher, NULL);
    for (size_t i = 0; i < t->pl.n; i++)
        rpc_client_close(t->clients[i]);
    pthread_cond_destroy(&t->cv);
    pthread_cond_destroy(&t->watch_cv);
    pthread_mutex_destroy(&t->mu);
    free(t);
}

di_status rk_add(rk_table *t, pl_role role, const char *addr, bool registered, uint32_t *n_role,
                 di_error *err)
{
    pthread_mutex_lock(&t->mu);
    size_t before = t->pl.n, idx;
    di_status st = pl_add(&t->pl, role, addr, registered, di_mono_ns(), &idx, err);
    if (st == DI_OK && t->pl.n > before) {
        rpc_client_config cc = {.target = addr, .token = t->cfg.engine_token,
                                .tls_ca_pem = t->cfg.tls_ca_pem};
        st = rpc_client_open(&cc, &t->clients[idx], err);
        if (st != DI_OK)
            t->pl.n = before; /* the rank was the last one added: forget it */
    }
    if (st == DI_OK && n_role) {
        uint32_t k = 0;
        for (size_t i = 0; i < t->pl.n; i++)
            k += t->pl.ranks[i].role == role;
        *n_role = k;
    }
    if (st == DI_OK && t->pl.n > before && t->cfg.log)
        di_log(t->cfg.log, DI_LOG_INFO, "%s rank %s added%s", role == PL_PREFILL ? "prefill"
               : "decode", addr, registered ? " (registered)" : "");
    pthread_mutex_unlock(&t->mu);
    return st;
}

static rk_pick picked(rk_table *t, long idx)
{
    rk_pick p = {.idx = idx};
    if (idx >= 0) {
        memcpy(p.addr, t->pl.ranks[idx].addr, sizeof p.addr);
        p.client = t->clients[idx];
    }
    return p;
}

rk_pick rk_pick_prefill(rk_table *t, uint64_t prompt, uint64_t cached, size_t exclude)
{
    pthread_mutex_lock(&t->mu);
    rk_pick p = picked(t, pl_pick_prefill(&t->pl, prompt, cached, exclude, di_mono_ns(), NULL));
    pthread_mutex_unlock(&t->mu);
    return p;
}

rk_pick rk_pick_decode(rk_table *t, uint32_t blocks, size_t exclude)
{
    pthread_mutex_lock(&t->mu);
    rk_pick p = picked(t, pl_pick_decode(&t->pl, blocks, exclude));
    pthread_mutex_unlock(&t->mu);
    return p;
}

void rk_prefill_done(rk_table *t, size_t idx, uint64_t computed, double seconds, bool ok)
{
    pthread_mutex_lock(&t->mu);
    pl_prefill_done(&t->pl, idx, computed);
    pl_call_result(&t->pl, idx, ok);
    if (ok && computed > 0 && seconds > 0)
        pl_observe_prefill(&t->pl, idx, computed, seconds);
    pthread_mutex_unlock(&t->mu);
}

void rk_decode_done(rk_table *t, size_t idx, uint32_t blocks, bool ok)
{
    pthread_mutex_lock(&t->mu);
    pl_decode_done(&t->pl, idx, blocks);
    pl_call_result(&t->pl, idx, ok);
    pthread_mutex_unlock(&t->mu);
}

size_t rk_usable(rk_table *t, pl_role role)
{
    pthread_mutex_lock(&t->mu);
    size_t k = 0;
    for (size_t i = 0; i < t->pl.n; i++)
        k += t->pl.ranks[i].role == role && t->pl.ranks[i].health != PL_OUT;
    pthread_mutex_unlock(&t->mu);
    return k;
}

pl_health rk_health(rk_table *t, size_t idx)
{
    pthread_mutex_lock(&t->mu);
    pl_health h = idx < t->pl.n ? t->pl.ranks[idx].health : PL_OUT;
    pthread_mutex_unlock(&t->mu);
    return h;
}

bool rk_rank(rk_table *t, size_t idx, pl_rank *out)
{
    pthread_mutex_lock(&t->mu);
    bool ok = idx < t->pl.n;
    if (ok)
        *out = t->pl.ranks[idx];
    pthread_mutex_unlock(&t->mu);
    return ok;
}

void rk_poll_once(rk_table *t)
{
    uint64_t ms = t->cfg.placement.heartbeat_ns / 1000000;
    poll_round(t, ms < 1 ? 1 : (uint32_t)ms);
}

uint64_t rk_polls(rk_table *t)
{
    pthread_mutex_lock(&t->mu);
    uint64_t n = t->polls;
    pthread_mutex_unlock(&t->mu);
    return n;
}
