/* api.c: the routes and the generation session behind them (see api.h). */
#include "router/api.h"

#include <jansson.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "common/util/clock.h"
#include "router/metrics.h"

/* The metric families, vLLM's names where vLLM has one (rows index met_* calls). */
enum {
    M_TTFT, M_TPOT, M_ITL, M_E2E, M_RUNNING, M_WAITING, M_PROMPT, M_GEN, M_CACHE_Q,
    M_CACHE_HIT, M_SUCCESS, M_FAILED, M_CANCELLED, M_COUNT
};
static const double LAT_BUCKETS[] = {0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25,
                                     0.5,   0.75,  1.0,  2.5,  5.0,  7.5,  10.0, 20.0, 40.0,
                                     80.0,  160.0, 640.0};
static const double TOK_BUCKETS[] = {0.001, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05,
                                     0.075, 0.1,   0.15, 0.2,   0.3,  0.4,   0.5,  0.75, 1.0,
                                     2.5,   5.0,   7.5,  10.0,  20.0, 40.0,  80.0};
#define NB(b) (sizeof(b) / sizeof((b)[0]))
static const met_def METRICS[M_COUNT] = {
    {"vllm:time_to_first_token_seconds", MET_HISTOGRAM,
     "Histogram of time to first token in seconds.", LAT_BUCKETS, NB(LAT_BUCKETS)},
    {"vllm:time_per_output_token_seconds", MET_HISTOGRAM,
     "Histogram of time per output token in seconds.", TOK_BUCKETS, NB(TOK_BUCKETS)},
    {"vllm:inter_token_latency_seconds", MET_HISTOGRAM,
     "Histogram of inter-token latency in seconds.", TOK_BUCKETS, NB(TOK_BUCKETS)},
    {"vllm:e2e_request_latency_seconds", MET_HISTOGRAM,
     "Histogram of end to end request latency in seconds.", LAT_BUCKETS, NB(LAT_BUCKETS)},
    {"vllm:num_requests_running", MET_GAUGE, "Number of requests generating tokens.", NULL, 0},
    {"vllm:num_requests_waiting", MET_GAUGE, "Number of requests waiting for a first token.",
     NULL, 0},
    {"vllm:prompt_tokens_total", MET_COUNTER, "Number of prefill tokens processed.", NULL, 0},
    {"vllm:generation_tokens_total", MET_COUNTER, "Number of generation tokens processed.",
     NULL, 0},
    {"vllm:prefix_cache_queries_total", MET_COUNTER,
     "Prompt tokens looked up in the KV store.", NULL, 0},
    {"vllm:prefix_cache_hits_total", MET_COUNTER,
     "Prompt tokens served from the KV store (cached_tokens).", NULL, 0},
    {"vllm:request_success_total", MET_COUNTER, "Count of successfully processed requests.",
     NULL, 0},
    {"di_router:request_failures_total", MET_COUNTER,
     "Requests that failed inside the cluster.", NULL, 0},
    {"di_router:request_cancellations_total", MET_COUNTER,
     "Requests whose client went away before the end.", NULL, 0},
};

struct api_ctx {
    api_config cfg;
    atomic_uint_fast64_t next_id; /* request ids */
    pthread_mutex_t mu;           /* guards counts */
    api_counts counts;
    met_registry *met;            /* the /metrics families */
};

/* One token kept for logprobs. */
typedef struct gen_tok {
    rt_gen_token t;
    char *text;                 /* its own text (malloc'd) */
    char *top_text[RT_MAX_TOP]; /* the alternatives' texts */
} gen_tok;

/* A generation in flight. Two references: the backend's (dropped in on_finish) and the HTTP
 * side's (dropped when the reply or stream is done). States: running -> finished (on_finish
 * ran); `stopped` (a stop string matched), `gone` (the client left) and `timed_out` (past the
 * request deadline) only ask for an abort,
 * which is sent once (`abort_sent`). */
typedef struct gen {
    pthread_mutex_t mu;
    pthread_cond_t cv; /* signalled on output and on finish */
    int refs;
    api_ctx *api;
    oai_request req;
    uint64_t handle;
    tok_stream *ts;
    char id[48];
    int64_t created;
    char *text;         /* all text so far */
    size_t text_len, text_cap;
    size_t emitted;     /* bytes of text released to the client */
    gen_tok *toks;      /* n_toks tokens, when logprobs are wanted */
    size_t n_toks, toks_sent;
    char *out;          /* SSE bytes not yet read */
    size_t out_len, out_cap, out_pos;
    bool any_chunk;     /* a chunk was queued (the HTTP status is 200 from then on) */
    bool stopped, abort_sent, finished, gone;
    bool timed_out;     /* the request outlived cfg.request_timeout_ms: aborted */
    const char *finish; /* "stop", "length", "abort" once finished */
    uint32_t n_gen, cached;
    uint64_t t0_ns, t_first_ns, t_last_ns; /* accepted, first token, last token (mono) */
    di_status st;       /* DI_OK unless the backend failed */
    char msg[320];
} gen;

static void gen_release(gen *g)
{
    pthread_mutex_lock(&g->mu);
    int left = --g->refs;
    pthread_mutex_unlock(&g->mu);
    if (left > 0)
        return;
    for (size_t i = 0; i < g->n_toks; i++) {
        free(g->toks[i].text);
        for (uint32_t k = 0; k < g->toks[i].t.n_top; k++)
            free(g->toks[i].top_text[k]);
    }
    free(g->toks);
    free(g->text);
    free(g->out);
    tok_stream_free(g->ts);
    oai_request_free(&g->req);
    pthread_cond_destroy(&g->cv);
    pthread_mutex_destroy(&g->mu);
    free(g);
}

static int grow(char **buf, size_t *cap, size_t need)
{
    if (need <= *cap)
        return 1;
    size_t c = *cap ? *cap : 256;
    while (c < need)
        c *= 2;
    char *b = realloc(*buf, c);
    if (!b)
        return 0;
    *buf = b;
    *cap = c;
    return 1;
}

static void out_append(gen *g, char *s)
{
    if (!s)
        return;
    size_t n = strlen(s);
    if (grow(&g->out, &g->out_cap, g->out_len + n + 1)) {
        memcpy(g->out + g->out_len, s, n);
        g->out_len += n;
        g->any_chunk = true;
    }
    free(s);
}

static char *token_text(const tok_tokenizer *tok, int32_t id)
{
    char *s = NULL;
    size_t n;
    if (tok_decode(tok, &id, 1, 0, &s, &n, NULL) != DI_OK)
        return strdup("");
    return s;
}

/* Where the text may be released up to: a stop string's start (sets stopped), else the end
 * less the longest tail that could begin a stop string. */
static size_t releasable(gen *g)
{
    const oai_request *r = &g->req;
    size_t best = g->text_len;
    for (size_t i = 0; i < r->n_stop; i++) {
        size_t sl = strlen(r->stop[i]);
        size_t from = g->emitted > sl ? g->emitted - sl : 0;
        char *hit = memmem(g->text + from, g->text_len - from, r->stop[i], sl);
        if (hit && (size_t)(hit - g->text) < best) {
            best = (size_t)(hit - g->text);
            g->stopped = true;
        }
    }
    if (g->stopped)
        return best;
    size_t hold = 0;
    for (size_t i = 0; i < r->n_stop; i++) {
        size_t sl = strlen(r->stop[i]);
        for (size_t k = sl - 1; k > hold; k--)
            if (k <= g->text_len - g->emitted &&
                memcmp(g->text + g->text_len - k, r->stop[i], k) == 0) {
                hold = k;
                break;
            }
    }
    return g->text_len - hold;
}

/* Appends text, then queues a chunk with what may be released and the tokens not yet sent. */
static void advance(gen *g, const char *delta, size_t dlen, const char *finish)
{
    if (dlen && grow(&g->text, &g->text_cap, g->text_len + dlen + 1)) {
        memcpy(g->text + g->text_len, delta, dlen);
        g->text_len += dlen;
        g->text[g->text_len] = '\0';
    }
    size_t upto = releasable(g);
    if (g->stopped)
        finish = "stop";
    else if (finish)
        upto = g->text_len; /* at the end nothing is held back */
    if (g->req.stream && (upto > g->emitted || finish || g->toks_sent < g->n_toks)) {
        char save = g->text[upto];
        g->text[upto] = '\0';
        oai_token ot[8];
        size_t n = 0;
        /* Tokens go out with the chunk made when they arrived (at most one per call). */
        for (; g->toks_sent < g->n_toks && n < 8; g->toks_sent++, n++) {
            gen_tok *t = &g->toks[g->toks_sent];
            ot[n] = (oai_token){t->t.id, t->text, t->t.logprob, NULL, t->t.n_top};
        }
        oai_top tops[8][RT_MAX_TOP];
        for (size_t i = 0; i < n; i++) {
            gen_tok *t = &g->toks[g->toks_sent - n + i];
            for (uint32_t k = 0; k < t->t.n_top; k++)
                tops[i][k] = (oai_top){t->t.top_ids[k], t->top_text[k], t->t.top_lps[k]};
            ot[i].top = tops[i];
        }
        out_append(g, oai_chunk_sse(&g->req, g->id, g->created, !g->any_chunk,
                                    g->text + g->emitted, ot, n, finish));
        g->text[upto] = save;
    }
    if (upto > g->emitted)
        g->emitted = upto;
}

static void on_token(void *ud, const rt_gen_token *t)
{
    gen *g = ud;
    const tok_tokenizer *tok = g->api->cfg.tok;
    pthread_mutex_lock(&g->mu);
    if (g->stopped || g->finished) {
        pthread_mutex_unlock(&g->mu);
        return;
    }
    uint64_t now = di_mono_ns();
    if (g->n_gen == 0) {
        g->t_first_ns = now;
        met_add(g->api->met, M_WAITING, NULL, -1);
        met_add(g->api->met, M_RUNNING, NULL, 1);
    } else {
        met_observe(g->api->met, M_ITL, NULL, (double)(now - g->t_last_ns) * 1e-9);
    }
    g->t_last_ns = now;
    g->n_gen++;
    if (g->req.logprobs) {
        gen_tok *nt = realloc(g->toks, (g->n_toks + 1) * sizeof *nt);
        if (nt) {
            g->toks = nt;
            gen_tok *k = &g->toks[g->n_toks++];
            memset(k, 0, sizeof *k);
            k->t = *t;
            if (k->t.n_top > g->req.top_logprobs)
                k->t.n_top = g->req.top_logprobs;
            k->text = token_text(tok, t->id);
            for (uint32_t j = 0; j < k->t.n_top; j++)
                k->top_text[j] = token_text(tok, t->top_ids[j]);
        }
    }
    const char *d = "";
    size_t dn = 0;
    if (tok_stream_push(g->ts, t->id, &d, &dn, NULL) != DI_OK)
        d = "", dn = 0; /* an id the tokenizer lacks adds no text */
    advance(g, d, dn, NULL);
    pthread_cond_broadcast(&g->cv);
    pthread_mutex_unlock(&g->mu);
}

/* The request continues on another decode rank: a stream gets an event saying so. */
static void on_continue(void *ud, const char *from, const char *to, uint32_t n_done)
{
    gen *g = ud;
    pthread_mutex_lock(&g->mu);
    if (g->req.stream && !g->stopped && !g->finished) {
        out_append(g, oai_continued_sse(&g->req, g->id, g->created, from, to, n_done));
        pthread_cond_broadcast(&g->cv);
    }
    pthread_mutex_unlock(&g->mu);
}

/* Observes a finished request in the metrics (instance: the rank, or NULL). */
static void record(gen *g, const char *instance)
{
    met_registry *m = g->api->met;
    if (g->n_gen == 0)
        met_add(m, M_WAITING, NULL, -1);
    else
        met_add(m, M_RUNNING, NULL, -1);
    met_add(m, M_PROMPT, instance, (double)g->req.prompt_ids.n);
    met_add(m, M_GEN, instance, g->n_gen);
    met_add(m, M_CACHE_Q, instance, (double)g->req.prompt_ids.n);
    met_add(m, M_CACHE_HIT, instance, g->cached);
    if (g->st != DI_OK) {
        met_add(m, M_FAILED, instance, 1);
        return;
    }
    if (g->gone) {
        met_add(m, M_CANCELLED, instance, 1);
        return;
    }
    met_add(m, M_SUCCESS, instance, 1);
    met_observe(m, M_E2E, instance, (double)(di_mono_ns() - g->t0_ns) * 1e-9);
    if (g->n_gen > 0)
        met_observe(m, M_TTFT, instance, (double)(g->t_first_ns - g->t0_ns) * 1e-9);
    if (g->n_gen > 1)
        met_observe(m, M_TPOT, instance,
                    (double)(g->t_last_ns - g->t_first_ns) * 1e-9 / (g->n_gen - 1));
}

static void on_finish(void *ud, rt_finish reason, uint32_t cached, const char *instance,
                      di_status st, const char *msg)
{
    gen *g = ud;
    pthread_mutex_lock(&g->mu);
    g->cached = cached;
    if (reason == RT_FINISH_ERROR) {
        g->st = st;
        snprintf(g->msg, sizeof g->msg, "%s", msg ? msg : "");
        if (g->req.stream && g->any_chunk) {
            oai_error e;
            oai_fail(&e, di_status_http(st), "backend_error", NULL, "%s", g->msg);
            out_append(g, oai_error_sse(&e));
            out_append(g, strdup(OAI_SSE_DONE));
        }
    } else if (!g->stopped) {
        const char *tail = "";
        size_t tn = 0;
        tok_stream_finish(g->ts, &tail, &tn, NULL);
        g->finish = reason == RT_FINISH_ABORT ? "abort"
                    : reason == RT_FINISH_EOS ? "stop"
                                              : "length";
        advance(g, tail, tn, g->finish);
        if (g->stopped)
            g->finish = "stop";
    } else {
        g->finish = "stop";
    }
    if (g->st == DI_OK && g->req.stream) {
        if (g->req.include_usage) {
            oai_usage u = {(uint32_t)g->req.prompt_ids.n, g->n_gen, g->cached};
            out_append(g, oai_usage_sse(&g->req, g->id, g->created, &u));
        }
        out_append(g, strdup(OAI_SSE_DONE));
    }
    g->finished = true;
    record(g, instance);
    pthread_cond_broadcast(&g->cv);
    pthread_mutex_unlock(&g->mu);
    api_ctx *a = g->api;
    pthread_mutex_lock(&a->mu);
    a->counts.running--;
    if (g->st != DI_OK)
        a->counts.failed++;
    else if (g->gone)
        a->counts.cancelled++;
    else
        a->counts.ok++;
    pthread_mutex_unlock(&a->mu);
    gen_release(g);
}

/* Sends the abort once when a stop string matched or the client left. Called unlocked. */
static void maybe_abort(gen *g)
{
    pthread_mutex_lock(&g->mu);
    uint64_t limit = g->api->cfg.request_timeout_ms;
    if (limit && !g->finished && di_mono_ns() - g->t0_ns > limit * 1000000ull)
        g->timed_out = true;
    bool send = (g->stopped || g->gone || g->timed_out) && !g->abort_sent && !g->finished;
    if (send)
        g->abort_sent = true;
    pthread_mutex_unlock(&g->mu);
    if (send)
        g->api->cfg.backend.abort(g->api->cfg.backend.self, g->handle);
}

static void wait_a_little(gen *g)
{
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    ts.tv_nsec += HTTP_POLL_MS * 1000000L;
    if (ts.tv_nsec >= 1000000000L) {
        ts.tv_sec++;
        ts.tv_nsec -= 1000000000L;
    }
    pthread_cond_timedwait(&g->cv, &g->mu, &ts);
}

static ssize_t stream_read(void *stream, char *buf, size_t max)
{
    gen *g = stream;
    maybe_abort(g);
    pthread_mutex_lock(&g->mu);
    if (g->out_pos == g->out_len && !g->finished)
        wait_a_little(g);
    ssize_t n = 0;
    if (g->out_pos < g->out_len) {
        size_t k = g->out_len - g->out_pos;
        if (k > max)
            k = max;
        memcpy(buf, g->out + g->out_pos, k);
        g->out_pos += k;
        n = (ssize_t)k;
    } else if (g->finished) {
        n = -1;
    }
    pthread_mutex_unlock(&g->mu);
    return n;
}

static void stream_free(void *stream)
{
    gen *g = stream;
    pthread_mutex_lock(&g->mu);
    g->gone = !g->finished;
    pthread_mutex_unlock(&g->mu);
    maybe_abort(g);
    gen_release(g);
}

/* ---- handlers ---------------------------------------------------------------------------- */

static void reply_backend_error(http_reply *out, gen *g)
{
    int status = di_status_http(g->st);
    if (status < 500 && status != 429)
        status = 502;
    http_reply_error(out, status, "backend_error", NULL, "%s", g->msg);
}

static void full_response(gen *g, http_reply *out)
{
    oai_token *ot = calloc(g->n_toks ? g->n_toks : 1, sizeof *ot);
    oai_top *tops = calloc((g->n_toks ? g->n_toks : 1) * RT_MAX_TOP, sizeof *tops);
    char *js = NULL;
    if (ot && tops) {
        for (size_t i = 0; i < g->n_toks; i++) {
            gen_tok *t = &g->toks[i];
            for (uint32_t k = 0; k < t->t.n_top; k++)
                tops[i * RT_MAX_TOP + k] =
                    (oai_top){t->t.top_ids[k], t->top_text[k], t->t.top_lps[k]};
            ot[i] = (oai_token){t->t.id, t->text, t->t.logprob, tops + i * RT_MAX_TOP,
                                t->t.n_top};
        }
        g->text[g->emitted] = '\0';
        oai_usage u = {(uint32_t)g->req.prompt_ids.n, g->n_gen, g->cached};
        js = oai_response_json(&g->req, g->id, g->created, g->text, ot, g->n_toks, g->finish,
                               &u);
    }
    free(ot);
    free(tops);
    http_reply_json(out, 200, js);
}

static void generate(api_ctx *a, oai_kind kind, const http_request *rq, http_reply *out)
{
    oai_error e = {0};
    gen *g = calloc(1, sizeof *g);
    if (!g) {
        http_reply_error(out, 503, NULL, NULL, "out of memory");
        return;
    }
    pthread_mutex_init(&g->mu, NULL);
    pthread_cond_init(&g->cv, NULL);
    g->refs = 1;
    g->api = a;
    if (oai_parse(kind, rq->body, rq->body_len, &a->cfg.limits, &g->req, &e) != DI_OK ||
        oai_tokenize(&g->req, a->cfg.tok, a->cfg.add_bos, &a->cfg.limits, &e) != DI_OK) {
        http_reply_json(out, e.status, oai_error_json(&e));
        gen_release(g);
        return;
    }
    if (!g->req.model && (g->req.model = strdup(a->cfg.limits.model)) == NULL) {
        gen_release(g);
        http_reply_error(out, 503, NULL, NULL, "out of memory");
        return;
    }
    if (tok_stream_new(a->cfg.tok, TOK_DECODE_SKIP_SPECIAL, &g->ts, NULL) != DI_OK ||
        !grow(&g->text, &g->text_cap, 64)) {
        gen_release(g);
        http_reply_error(out, 503, NULL, NULL, "out of memory");
        return;
    }
    g->text[0] = '\0';
    g->created = (int64_t)time(NULL);
    g->t0_ns = di_mono_ns();
    snprintf(g->id, sizeof g->id, "%s-%016llx", kind == OAI_CHAT ? "chatcmpl" : "cmpl",
             (unsigned long long)atomic_fetch_add(&a->next_id, 1));
    rt_gen_req br = oai_gen_req(&g->req);
    rt_gen_cb cb = {on_token, on_finish, g, on_continue};
    di_error de = {0};
    g->refs = 2;
    pthread_mutex_lock(&a->mu);
    a->counts.running++;
    pthread_mutex_unlock(&a->mu);
    met_add(a->met, M_WAITING, NULL, 1);
    if (a->cfg.backend.generate(a->cfg.backend.self, &br, &cb, &g->handle, &de) != DI_OK) {
        pthread_mutex_lock(&a->mu);
        a->counts.running--;
        a->counts.failed++;
        pthread_mutex_unlock(&a->mu);
        met_add(a->met, M_WAITING, NULL, -1);
        met_add(a->met, M_FAILED, NULL, 1);
        g->refs = 1;
        g->st = de.code;
        snprintf(g->msg, sizeof g->msg, "%s", de.msg);
        reply_backend_error(out, g);
        gen_release(g);
        return;
    }
    /* Wait for the first chunk (stream) or the end (whole reply), watching the client. */
    pthread_mutex_lock(&g->mu);
    while (!g->finished && !(g->req.stream && g->any_chunk) && !g->gone) {
        if ((g->stopped || g->timed_out) && !g->abort_sent) {
            pthread_mutex_unlock(&g->mu);
            maybe_abort(g);
            pthread_mutex_lock(&g->mu);
            continue;
        }
        wait_a_little(g);
        if (!g->finished && http_client_gone(rq))
            g->gone = true;
        uint64_t limit = a->cfg.request_timeout_ms;
        if (limit && !g->finished && di_mono_ns() - g->t0_ns > limit * 1000000ull)
            g->timed_out = true;
    }
    bool stream_now = g->req.stream && g->any_chunk;
    bool failed = g->finished && g->st != DI_OK && !g->any_chunk;
    pthread_mutex_unlock(&g->mu);
    if (stream_now) {
        *out = (http_reply){.status = 200, .content_type = "text/event-stream",
                            .read = stream_read, .stream_free = stream_free, .stream = g};
        return;
    }
    maybe_abort(g); /* client gone, or a stop string: the backend stops now */
    pthread_mutex_lock(&g->mu);
    while (!g->finished)
        wait_a_little(g);
    pthread_mutex_unlock(&g->mu);
    if (failed || g->st != DI_OK)
        reply_backend_error(out, g);
    else if (g->timed_out)
        http_reply_error(out, 504, "timeout", NULL,
                         "the request ran past the router's limit of %llu ms",
                         (unsigned long long)a->cfg.request_timeout_ms);
    else if (g->req.stream) /* finished before any chunk: can only be an empty stream */
        http_reply_error(out, 500, NULL, NULL, "the stream ended without output");
    else
        full_response(g, out);
    gen_release(g);
}

static void h_completions(void *app, const http_request *rq, http_reply *out)
{
    generate(app, OAI_COMPLETION, rq, out);
}

static void h_chat(void *app, const http_request *rq, http_reply *out)
{
    generate(app, OAI_CHAT, rq, out);
}

static void h_models(void *app, const http_request *rq, http_reply *out)
{
    api_ctx *a = app;
    (void)rq;
    json_t *o = json_pack("{s:s,s:[{s:s,s:s,s:I,s:s,s:I}]}", "object", "list", "data", "id",
                          a->cfg.limits.model, "object", "model", "created", (json_int_t)0,
                          "owned_by", "deepinfer",
                          "max_model_len",
                          (json_int_t)a->cfg.limits.max_prompt_tokens +
                              a->cfg.limits.max_output_tokens);
    char *s = o ? json_dumps(o, JSON_COMPACT) : NULL;
    json_decref(o);
    http_reply_json(out, 200, s);
}

static void h_health(void *app, const http_request *rq, http_reply *out)
{
    (void)app, (void)rq;
    http_reply_json(out, 200, strdup("{\"status\":\"ok\"}"));
}

static void h_metrics(void *app, const http_request *rq, http_reply *out)
{
    api_ctx *a = app;
    (void)rq;
    char *text = met_render(a->met);
    http_reply_json(out, 200, text);
    if (text)
        out->content_type = "text/plain; version=0.0.4; charset=utf-8";
}

static const http_route ROUTES[] = {
    {"POST", "/v1/completions", h_completions, "application/json", HTTP_SCOPE_GENERATE},
    {"POST", "/v1/chat/completions", h_chat, "application/json", HTTP_SCOPE_GENERATE},
    {"GET", "/v1/models", h_models, NULL, HTTP_SCOPE_READ},
    {"GET", "/health", h_health, NULL, HTTP_SCOPE_NONE},
    {"GET", "/metrics", h_metrics, NULL, HTTP_SCOPE_READ},
};

const http_route *api_routes(size_t *n)
{
    *n = sizeof ROUTES / sizeof ROUTES[0];
    return ROUTES;
}

di_status api_new(const api_config *cfg, api_ctx **out, di_error *err)
{
    if (!cfg->tok || !cfg->limits.model || !cfg->backend.generate)
        return di_fail(err, DI_EINVAL, "the api needs a tokenizer, a model name and a backend");
    api_ctx *a = calloc(1, sizeof *a);
    if (!a)
        return di_fail(err, DI_ENOMEM, "out of memory");
    a->cfg = *cfg;
    di_status st = met_new(METRICS, M_COUNT, cfg->limits.model, &a->met, err);
    if (st != DI_OK) {
        free(a);
        return st;
    }
    pthread_mutex_init(&a->mu, NULL);
    atomic_init(&a->next_id, 1);
    *out = a;
    return DI_OK;
}

void api_free(api_ctx *a)
{
    if (!a)
        return;
    pthread_mutex_destroy(&a->mu);
    met_free(a->met);
    free(a);
}

void api_get_counts(api_ctx *a, api_counts *c)
{
    pthread_mutex_lock(&a->mu);
    *c = a->counts;
    pthread_mutex_unlock(&a->mu);
}
