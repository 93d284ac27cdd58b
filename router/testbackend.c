/* testbackend.c: the deterministic in-process backend (see testbackend.h). */
#include "router/testbackend.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>


/* One request in flight: lives on the backend's list until its thread ends. */
typedef struct tb_req {
    struct tb_req *next;
    uint64_t handle;
    atomic_int aborted;
    rt_gen_req req;
    int32_t *prompt; /* owned copy */
    rt_gen_cb cb;
    tb_backend *b;
    pthread_t thread;
} tb_req;

struct tb_backend {
    tb_config cfg;
    pthread_mutex_t mu;
    pthread_cond_t idle; /* signalled when running drops */
    tb_req *reqs;        /* in flight */
    uint64_t next_handle, started, aborted, running;
};

int32_t tb_token(const tb_config *cfg, uint64_t seed, const int32_t *prompt, size_t n, uint32_t i)
{
    uint64_t h = seed * 0x9E3779B97F4A7C15ull + i;
    for (size_t k = 0; k < n; k++)
        h = (h ^ (uint64_t)(uint32_t)prompt[k]) * 0x100000001B3ull;
    h ^= h >> 29;
    h *= 0xBF58476D1CE4E5B9ull;
    h ^= h >> 32;
    return cfg->first_id + (int32_t)(h % (uint64_t)cfg->span);
}

/* Sleeps ms, waking early when the request is aborted. */
static void nap(tb_req *r, uint32_t ms)
{
    for (uint32_t t = 0; t < ms && !atomic_load(&r->aborted); t += 5) {
        struct timespec ts = {0, 5 * 1000000L};
        nanosleep(&ts, NULL);
    }
}

static void *run(void *arg)
{
    tb_req *r = arg;
    tb_backend *b = r->b;
    const tb_config *c = &b->cfg;
    rt_finish reason = RT_FINISH_LENGTH;
    di_status st = DI_OK;
    const char *msg = "";
    for (uint32_t i = 0; i < r->req.max_tokens; i++) {
        nap(r, c->delay_ms);
        if (atomic_load(&r->aborted)) {
            reason = RT_FINISH_ABORT;
            break;
        }
        if (c->fail_at >= 0 && (int64_t)i == c->fail_at) {
            reason = RT_FINISH_ERROR, st = DI_EUNAVAIL, msg = "decode rank 0 stopped answering";
            break;
        }
        if (c->eos_at >= 0 && (int64_t)i == c->eos_at && !r->req.ignore_eos) {
            reason = RT_FINISH_EOS;
            break;
        }
        rt_gen_token t = {.id = tb_token(c, r->req.seed, r->prompt, r->req.n_prompt, i),
                          .logprob = -(float)(i + 1) / 1024.0f,
                          .n_top = r->req.top_logprobs};
        for (uint32_t k = 0; k < t.n_top; k++) {
            t.top_ids[k] = t.id + (int32_t)k + 1;
            t.top_lps[k] = -(float)(i + k + 2) / 1024.0f;
        }
        r->cb.on_token(r->cb.ud, &t);
    }
    uint32_t cached = c->cached_tokens < r->req.n_prompt ? c->cached_tokens
                                                         : (uint32_t)r->req.n_prompt;
    r->cb.on_finish(r->cb.ud, reason, cached, "test:0", st, msg);
    pthread_mutex_lock(&b->mu);
    for (tb_req **p = &b->reqs; *p; p = &(*p)->next)
        if (*p == r) {
            *p = r->next;
            break;
        }
    if (atomic_load(&r->aborted))
        b->aborted++;
    b->running--;
    pthread_cond_broadcast(&b->idle);
    pthread_mutex_unlock(&b->mu);
    free(r->prompt);
    free(r);
    return NULL;
}

static di_status tb_generate(void *self, const rt_gen_req *req, const rt_gen_cb *cb,
                             uint64_t *handle, di_error *err)
{
    tb_backend *b = self;
    if (b->cfg.refuse)
        return di_fail(err, DI_EUNAVAIL, "no prefill rank is in rotation");
    tb_req *r = calloc(1, sizeof *r);
    int32_t *p = malloc((req->n_prompt ? req->n_prompt : 1) * sizeof *p);
    if (!r || !p) {
        free(r);
        free(p);
        return di_fail(err, DI_ENOMEM, "out of memory starting a request");
    }
    memcpy(p, req->prompt, req->n_prompt * sizeof *p);
    r->req = *req;
    r->req.prompt = p;
    r->prompt = p;
    r->cb = *cb;
    r->b = b;
    pthread_mutex_lock(&b->mu);
    r->handle = ++b->next_handle;
    r->next = b->reqs;
    b->reqs = r;
    b->started++;
    b->running++;
    uint64_t h = r->handle;
    pthread_attr_t at;
    pthread_attr_init(&at);
    pthread_attr_setdetachstate(&at, PTHREAD_CREATE_DETACHED);
    int rc = pthread_create(&r->thread, &at, run, r);
    pthread_attr_destroy(&at);
    if (rc != 0) {
        b->reqs = r->next;
        b->started--;
        b->running--;
        pthread_mutex_unlock(&b->mu);
        free(p);
        free(r);
        return di_fail(err, DI_ENOMEM, "cannot start a request thread");
    }
    pthread_mutex_unlock(&b->mu);
    *handle = h;
    return DI_OK;
}

static void tb_abort(void *self, uint64_t handle)
{
    tb_backend *b = self;
    pthread_mutex_lock(&b->mu);
    for (tb_req *r = b->reqs; r; r = r->next)
        if (r->handle == handle)
            atomic_store(&r->aborted, 1);
    pthread_mutex_unlock(&b->mu);
}

di_status tb_new(const tb_config *cfg, tb_backend **out, di_error *err)
{
    if (cfg->span < 1 || cfg->first_id < 0)
        return di_fail(err, DI_EINVAL, "test backend: span %d must be >= 1", cfg->span);
    tb_backend *b = calloc(1, sizeof *b);
    if (!b)
        return di_fail(err, DI_ENOMEM, "out of memory");
    b->cfg = *cfg;
    pthread_mutex_init(&b->mu, NULL);
    pthread_cond_init(&b->idle, NULL);
    *out = b;
    return DI_OK;
}

void tb_free(tb_backend *b)
{
    if (!b)
        return;
    pthread_mutex_lock(&b->mu);
    for (tb_req *r = b->reqs; r; r = r->next)
        atomic_store(&r->aborted, 1);
    while (b->running > 0)
        pthread_cond_wait(&b->idle, &b->mu);
    pthread_mutex_unlock(&b->mu);
    pthread_cond_destroy(&b->idle);
    pthread_mutex_destroy(&b->mu);
    free(b);
}

rt_backend tb_backend_iface(tb_backend *b)
{
    return (rt_backend){.generate = tb_generate, .abort = tb_abort, .self = b};
}

void tb_counts(tb_backend *b, uint64_t *started, uint64_t *aborted, uint64_t *running)
{
    pthread_mutex_lock(&b->mu);
    *started = b->started;
    *aborted = b->aborted;
    *running = b->running;
    pthread_mutex_unlock(&b->mu);
}
