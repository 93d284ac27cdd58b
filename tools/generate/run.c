/* run.c: di-generate's engine loop: model, scheduler, executor, outputs. */
#include <ctype.h>
#include <errno.h>
#include <jansson.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/engine/engine.h"
#include "common/model/runner.h"
#include "common/model/runner_exec.h"
#include "common/util/clock.h"
#include "common/serve/backend.h"
#include "common/serve/model_open.h"
#include "tools/generate/gen.h"
#include "tools/generate/kvcache.h"
#ifdef DI_HAVE_TOKENIZER
#include "common/tokenizer/tokenizer.h"
#endif

/* ---- prompts ---- */

di_status gen_parse_ids(const char *text, gen_ids *out, di_error *err)
{
    gen_ids r = {0};
    uint32_t cap = 0;
    const char *p = text;
    for (;;) {
        while (*p == ',' || isspace((unsigned char)*p))
            p++;
        if (!*p)
            break;
        char *end;
        errno = 0;
        long long v = strtoll(p, &end, 10);
        if (end == p || errno || v < 0 || v > INT32_MAX ||
            (*end && *end != ',' && !isspace((unsigned char)*end))) {
            free(r.ids);
            int len = 0;
            while (p[len] && p[len] != ',' && !isspace((unsigned char)p[len]) && len < 24)
                len++;
            return di_fail(err, DI_EINVAL, "token id '%.*s' is not a non-negative integer", len,
                           p);
        }
        if (r.n == cap) {
            cap = cap ? 2 * cap : 64;
            int32_t *n = realloc(r.ids, cap * sizeof(int32_t));
            if (!n) {
                free(r.ids);
                return di_fail(err, DI_ENOMEM, "token ids");
            }
            r.ids = n;
        }
        r.ids[r.n++] = (int32_t)v;
        p = end;
    }
    if (r.n == 0)
        return di_fail(err, DI_EINVAL, "empty prompt: no token ids");
    *out = r;
    return DI_OK;
}

di_status gen_read_prompts(const char *path, gen_args *a, di_error *err)
{
    FILE *f = strcmp(path, "-") ? fopen(path, "r") : stdin;
    if (!f)
        return di_fail(err, DI_ENOENT, "%s: %s", path, strerror(errno));
    char *line = NULL;
    size_t cap = 0;
    ssize_t len;
    uint32_t lineno = 0;
    di_status st = DI_OK;
    while (st == DI_OK && (len = getline(&line, &cap, f)) >= 0) {
        lineno++;
        const char *q = line;
        while (*q && isspace((unsigned char)*q))
            q++;
        if (!*q)
            continue;
        gen_ids ids;
        st = gen_parse_ids(line, &ids, err);
        if (st != DI_OK) {
            di_error_prefix(err, "%s line %u: ", path, lineno);
            break;
        }
        gen_ids *n = realloc(a->prompts, (a->n_prompts + 1) * sizeof(gen_ids));
        if (!n) {
            free(ids.ids);
            st = di_fail(err, DI_ENOMEM, "prompts");
            break;
        }
        a->prompts = n;
        a->prompts[a->n_prompts++] = ids;
    }
    free(line);
    if (f != stdin)
        fclose(f);
    return st;
}

/* ---- outputs ---- */

typedef struct gen_ctx {
    const gen_args *a;
    di_logger log;               /* store warnings and lines */
    void *tok;                   /* tok_tokenizer when loaded, else NULL */
    FILE *dump;
    uint32_t vocab;
    gen_out *outs;               /* [n_prompts] */
    uint64_t dumped;
} gen_ctx;

static void dump_row(void *ud, uint64_t id, int64_t position, const float *logits, uint32_t V)
{
    gen_ctx *g = ud;
    if (!g->dump)
        return;
    fprintf(g->dump, "{\"request\":%llu,\"position\":%lld,\"logits\":[", (unsigned long long)id,
            (long long)position);
    for (uint32_t v = 0; v < V; v++) {
        if (isfinite(logits[v]))
            fprintf(g->dump, v ? ",%.9g" : "%.9g", (double)logits[v]);
        else
            fputs(v ? ",null" : "null", g->dump);
    }
    fputs("]}\n", g->dump);
    g->dumped++;
}

di_status gen_out_push(gen_out *o, int32_t tok, float logprob, di_error *err)
{
    if (o->n == o->cap) {
        uint32_t cap = o->cap ? 2 * o->cap : 32;
        int32_t *t = realloc(o->tokens, cap * sizeof(int32_t));
        if (t)
            o->tokens = t;
        float *l = realloc(o->logprobs, cap * sizeof(float));
        if (l)
            o->logprobs = l;
        if (!t || !l)
            return di_fail(err, DI_ENOMEM, "outputs");
        o->cap = cap;
    }
    o->tokens[o->n] = tok;
    o->logprobs[o->n] = logprob;
    o->n++;
    return DI_OK;
}

static di_status out_append(gen_out *o, int32_t tok, const sampler_result *res,
                            uint32_t n_logprobs, di_error *err)
{
    di_status st = gen_out_push(o, tok, res ? res->logprob : NAN, err);
    if (st != DI_OK)
        return st;
    if (n_logprobs && res) {
        if (!o->tops)
            o->tops = json_array();
        json_t *obj = json_object();
        for (uint32_t i = 0; i < res->n_top; i++) {
            char key[16];
            snprintf(key, sizeof key, "%d", res->top_tokens[i]);
            json_object_set_new(obj, key, json_real(res->top_logprobs[i]));
        }
        json_array_append_new(o->tops, obj);
    }
    return DI_OK;
}

/* The output tokens as text ("" without a tokenizer); malloc'd. */
static char *output_text(const gen_ctx *g, const gen_out *o)
{
#ifdef DI_HAVE_TOKENIZER
    if (g->tok) {
        char *text = NULL;
        size_t len;
        if (tok_decode(g->tok, o->tokens, o->n, TOK_DECODE_SKIP_SPECIAL, &text, &len, NULL) ==
            DI_OK)
            return text;
    }
#endif
    return NULL;
}

static void print_plain(const gen_ctx *g, FILE *f)
{
    for (uint32_t i = 0; i < g->a->n_prompts; i++) {
        const gen_out *o = &g->outs[i];
        fprintf(f, "request %u (%s):", i + 1, sched_finish_name(o->finish));
        for (uint32_t k = 0; k < o->n; k++)
            fprintf(f, " %d", o->tokens[k]);
        if (o->error[0])
            fprintf(f, " [error: %s]", o->error);
        fputc('\n', f);
        char *text = output_text(g, o);
        if (text)
            fprintf(f, "text %u: %s\n", i + 1, text);
        free(text);
    }
}

static void print_json(const gen_ctx *g, const json_t *stats, FILE *f)
{
    json_t *root = json_object(), *reqs = json_array();
    for (uint32_t i = 0; i < g->a->n_prompts; i++) {
        const gen_out *o = &g->outs[i];
        json_t *r = json_object(), *toks = json_array(), *lps = json_array();
        for (uint32_t k = 0; k < o->n; k++) {
            json_array_append_new(toks, json_integer(o->tokens[k]));
            json_array_append_new(lps, isfinite(o->logprobs[k]) ? json_real(o->logprobs[k])
                                                                : json_null());
        }
        json_object_set_new(r, "id", json_integer(i + 1));
        json_object_set_new(r, "prompt_tokens", json_integer(g->a->prompts[i].n));
        json_object_set_new(r, "tokens", toks);
        json_object_set_new(r, "logprobs", lps);
        if (o->tops)
            json_object_set(r, "top_logprobs", o->tops);
        json_object_set_new(r, "finish", json_string(sched_finish_name(o->finish)));
        char *text = output_text(g, o);
        if (text)
            json_object_set_new(r, "text", json_string(text));
        free(text);
        if (o->error[0])
            json_object_set_new(r, "error", json_string(o->error));
        json_array_append_new(reqs, r);
    }
    json_object_set_new(root, "requests", reqs);
    json_object_set(root, "stats", (json_t *)stats);
    json_dumpf(root, f, JSON_INDENT(1) | JSON_REAL_PRECISION(9));
    fputc('\n', f);
    json_decref(root);
}

/* ---- loading ---- */

static void load_progress(void *ud, const model_load_progress *p)
{
    const gen_args *a = ud;
    if (a->quiet)
        return;
    bool last = p->tensors_done == p->tensors_total;
    if (!isatty(STDERR_FILENO) && !last)
        return; /* a log file gets the final line only */
    if (p->tensors_done % 64 == 0 || last)
        fprintf(stderr, "\rdi-generate: loading: %llu/%llu tensors, %.1f/%.1f MB",
                (unsigned long long)p->tensors_done, (unsigned long long)p->tensors_total,
                p->bytes_done / 1e6, p->bytes_total / 1e6);
    if (p->tensors_done == p->tensors_total)
        fputc('\n', stderr);
}

/* Model, tokenizer and Engram map in one call: the checkpoint of --model or random weights of
 * --config; the tokenizer of --tokenizer or the model directory's, or the default one when a
 * prompt is text. */
static di_status open_model(const gen_args *a, serve_model *m, di_error *err)
{
    bool texts = false;
    for (uint32_t i = 0; i < a->n_prompts; i++)
        texts |= a->prompts[i].text != NULL;
    model_load_options lo = {.flags = MODEL_LOAD_WO_A_BF16 |
                                      (a->trust_weights ? MODEL_LOAD_TRUST_SUMS : 0),
                             .progress = load_progress, .progress_userdata = (void *)a};
    ep_expert_filter f;
    gen_ep_filter(a, &f, &lo); /* a rank of a group: only its own experts */
    serve_model_options o = {.model_dir = a->model_dir, .config = a->config,
                             .weights_seed = a->weights_seed, .tokenizer = a->tokenizer,
                             .need_tokenizer = texts, .load = &lo};
    if (!a->model_dir && !a->quiet)
        fprintf(stderr, "di-generate: building random weights for config %s (seed %llu)\n",
                a->config ? a->config : "small", (unsigned long long)a->weights_seed);
    return serve_model_open(&o, m, err);
}

/* The start-up line: which model (config and weights) and which YOCO mode, the two things a
 * KV store hit depends on. */
static void print_identity(const gen_args *a, const model_weights *w)
{
    if (a->quiet)
        return;
    const shard_sums_result *s = &w->sums;
    fprintf(stderr, "di-generate: model id %016llx (config and weights: %s); YOCO %s%s; KV id "
            "%016llx\n", (unsigned long long)w->config.model_id,
            s->verified ? "checksum manifest verified"
            : s->had_manifest ? "checksum manifest trusted, not verified"
                              : "no checksum manifest, shards hashed",
            kv_yoco_name((uint32_t)a->yoco),
            a->yoco == FWD_YOCO_DEFAULT ? " (the default)" : " (not the default: no KV sharing "
            "with engines that run the default)",
            (unsigned long long)kv_model_id(w->config.model_id, (uint32_t)a->yoco));
}

/* ---- tokenizer ---- */

/* Encodes the text prompts with the model's tokenizer (BOS first unless --no-bos). */
static di_status encode_prompts(gen_args *a, gen_ctx *g, di_error *err)
{
    for (uint32_t i = 0; i < a->n_prompts; i++) {
        gen_ids *p = &a->prompts[i];
        if (!p->text)
            continue;
#ifdef DI_HAVE_TOKENIZER
        if (!g->tok)
            return di_fail(err, DI_EINVAL, "prompt %u is text but there is no tokenizer: give "
                           "--tokenizer FILE, a --model directory with tokenizer.json, set "
                           "DI_TOKENIZER, or run deploy/local/install-deps.sh", i + 1);
        tok_ids ids = {0};
        int32_t bos = tok_bos_id(g->tok);
        di_status st;
        if (!a->no_bos && bos >= 0 && (st = tok_ids_push(&ids, bos, err)) != DI_OK)
            return st;
        if ((st = tok_encode(g->tok, p->text, strlen(p->text), &ids, err)) != DI_OK) {
            tok_ids_free(&ids);
            di_error_prefix(err, "prompt %u: ", i + 1);
            return st;
        }
        p->ids = ids.v; /* owned by the prompt list now */
        p->n = (uint32_t)ids.n;
        if (p->n == 0)
            return di_fail(err, DI_EINVAL, "prompt %u: empty prompt (no tokens)", i + 1);
#else
        (void)g;
        return di_fail(err, DI_EUNSUPPORTED, "text prompts need the tokenizer module");
#endif
    }
    return DI_OK;
}

/* ---- the run ---- */

static di_status check_prompts(const gen_args *a, const model_config *c, uint64_t max_len,
                               di_error *err)
{
    if (a->n_prompts == 0)
        return di_fail(err, DI_EINVAL, "no prompt: give --ids, --ids-file or ids on stdin");
    for (uint32_t i = 0; i < a->n_prompts; i++) {
        const gen_ids *p = &a->prompts[i];
        for (uint32_t k = 0; k < p->n; k++)
            if ((uint32_t)p->ids[k] >= c->vocab_size)
                return di_fail(err, DI_EINVAL, "prompt %u: token id %d at position %u is "
                               "outside the vocabulary [0, %u)", i + 1, p->ids[k], k,
                               c->vocab_size);
        if (p->n >= max_len)
            return di_fail(err, DI_EINVAL, "prompt %u of %u tokens exceeds the context limit "
                           "of %llu positions", i + 1, p->n, (unsigned long long)max_len);
    }
    for (uint32_t k = 0; k < a->forced.n; k++)
        if ((uint32_t)a->forced.ids[k] >= c->vocab_size)
            return di_fail(err, DI_EINVAL, "teacher-forced token id %d is outside the "
                           "vocabulary [0, %u)", a->forced.ids[k], c->vocab_size);
    return DI_OK;
}

typedef struct run_state {
    engine *e;                   /* the engine loop over the scheduler and the executor */
    runner_exec *ex;             /* the model runner */
    engine_executor rx;          /* ex as an executor (run_step wraps its step) */
    gen_kv *kv;                  /* --kvstore client, or NULL */
    gen_ep *ep;                  /* this rank of an expert-parallel group, or NULL */
    gen_ctx *g;                  /* where outputs go */
    di_status out_st;            /* the first failure while taking outputs */
    di_error out_err;
    uint64_t prefill_tokens, decode_steps, decode_tokens;
    double prefill_s, decode_s;
    /* --ahead (the executor's issue and collect): host time issuing decode steps, time in
     * their collects (the waits), wall time of the engine steps that issued one */
    double issue_s, collect_s, decode_wall_s;
    bool issued_decode;          /* the current engine step issued a decode plan */
} run_state;

/* The executor: the model runner's step, then the store writes of what it computed, timed. */
static di_status run_step(void *ctx, const sched_plan *plan, sched_seq_result *results,
                          di_error *err)
{
    run_state *rs = ctx;
    uint64_t t0 = di_mono_ns();
    di_status st;
    if ((st = runner_exec_step(rs->ex, plan, results, err)) != DI_OK ||
        (st = gen_kv_after_step(rs->kv, runner_exec_kv(rs->ex), plan, results, err)) != DI_OK ||
        (rs->ep && (st = gen_ep_step_end(rs->ep, err)) != DI_OK))
        return st;
    uint64_t ns = di_mono_ns() - t0;
    if (rs->ep &&
        (st = gen_ep_note_step(rs->ep, plan->placeholder ? GEN_STEP_NONE
                                       : plan->prompt_run ? GEN_STEP_PREFILL : GEN_STEP_DECODE,
                               ns, err)) != DI_OK)
        return st;
    if (plan->placeholder)
        return DI_OK; /* a rank with nothing to do that joined the group's exchanges */
    double dt = (double)ns / 1e9;
    if (plan->prompt_run) {
        rs->prefill_tokens += plan->n_rows;
        rs->prefill_s += dt;
    } else {
        rs->decode_steps++;
        rs->decode_s += dt;
    }
    return DI_OK;
}

/* --ahead: the model runner's step in two (engine_executor.issue, .collect), timed. */
static di_status run_issue(void *ctx, const sched_plan *plan, bool ahead, bool *issued,
                           di_error *err)
{
    run_state *rs = ctx;
    uint64_t t0 = di_mono_ns();
    di_status st = runner_exec_issue(rs->ex, plan, ahead, issued, err);
    double dt = (double)(di_mono_ns() - t0) / 1e9;
    if (plan->prompt_run) {
        rs->prefill_s += dt;
    } else if (!plan->placeholder) {
        rs->decode_s += dt;
        rs->issue_s += dt;
        rs->issued_decode |= st == DI_OK && *issued;
    }
    return st;
}

static di_status run_collect(void *ctx, const sched_plan *plan, sched_seq_result *results,
                             di_error *err)
{
    run_state *rs = ctx;
    uint64_t t0 = di_mono_ns();
    di_status st = runner_exec_collect(rs->ex, plan, results, err);
    if (st == DI_OK)
        st = gen_kv_after_step(rs->kv, runner_exec_kv(rs->ex), plan, results, err);
    double dt = (double)(di_mono_ns() - t0) / 1e9;
    if (plan->prompt_run) {
        rs->prefill_tokens += plan->n_rows;
        rs->prefill_s += dt;
    } else if (!plan->placeholder) {
        rs->decode_steps++;
        rs->decode_s += dt;
        rs->collect_s += dt;
    }
    return st;
}

static di_status run_add(void *ctx, const sched_request *req, const void *args, di_error *err)
{
    run_state *rs = ctx;
    return rs->rx.add(rs->rx.ctx, req, args, err);
}

static void run_remove(void *ctx, uint64_t id)
{
    run_state *rs = ctx;
    rs->rx.remove(rs->rx.ctx, id);
}

/* Each output: its tokens with their logprobs, the finish reason, a failed request's error. */
static void take_output(void *ud, const engine_output *o)
{
    run_state *rs = ud;
    gen_ctx *g = rs->g;
    gen_out *go = &g->outs[o->request_id - 1];
    if (o->result && o->result->status == SCHED_RESULT_FAILED)
        snprintf(go->error, sizeof go->error, "%s", runner_exec_error(rs->ex, o->request_id));
    uint32_t nr;
    const runner_token *rt = runner_exec_tokens(rs->ex, o->request_id, &nr);
    for (uint32_t t = 0; t < o->n_tokens && rs->out_st == DI_OK; t++) {
        const sampler_result *res = t < nr && rt[t].token == o->tokens[t] ? &rt[t].res : NULL;
        rs->out_st = out_append(go, o->tokens[t], res, g->a->params.n_logprobs, &rs->out_err);
    }
    if (o->plan && !o->plan->prompt_run)
        rs->decode_tokens += o->n_tokens;
    if (o->finish != SCHED_FINISH_NONE) {
        go->finish = o->finish;
        gen_kv_finished(rs->kv, o->request_id, o->finish);
    }
}

static di_status step_once(run_state *rs, di_error *err)
{
    bool ran = false;
    uint64_t t0 = di_mono_ns();
    rs->issued_decode = false;
    di_status st = engine_step(rs->e, &ran, err);
    if (rs->issued_decode)
        rs->decode_wall_s += (double)(di_mono_ns() - t0) / 1e9;
    /* a rank of a group ends every step, also one that ran no plan (the others wait for it) */
    if (st == DI_OK && rs->ep && !ran && (st = gen_ep_step_end(rs->ep, err)) == DI_OK)
        st = gen_ep_note_step(rs->ep, GEN_STEP_NONE, 0, err);
    if (st == DI_OK && rs->out_st != DI_OK) {
        *err = rs->out_err;
        st = rs->out_st;
    }
    return st;
}

/* Warnings and per-prompt store lines on stderr ("di-generate: ..."). */
static void log_line(void *ud, di_log_level level, const char *line)
{
    fprintf(stderr, "di-generate: %s%s\n", level <= DI_LOG_WARN ? "warning: " : "", line);
}

/* The store client for this model's KV geometry (--kvstore); prompts are then cut at every
 * multiple of 128 so that the window state there can be copied. */
static di_status open_kvstore(const gen_args *a, const model_config *c, uint32_t nextn,
                              uint32_t max_tokens, const di_logger *log, sched_config *sc,
                              run_state *rs, di_error *err)
{
    if (!a->kvstore)
        return DI_OK;
    kv_geometry geo;
    model_config_kv_geometry_yoco(c, nextn, (uint32_t)a->yoco, &geo);
    gen_kv_options ko = {.target = a->kvstore, .token = a->kvstore_token,
                         .data_path = a->kvstore_data_path,
                         .deadline_ms = a->kvstore_deadline_ms, .allow_replay = a->kvstore_replay,
                         .window_every = a->kvstore_window_every,
                         .always_compute = a->keep_tokens > geo.ring_positions
                                               ? a->keep_tokens : geo.ring_positions,
                         .n_requests = a->n_prompts, .max_tokens = max_tokens, .log = log};
    sc->max_chunk_tokens = geo.block_tokens;
    return gen_kv_open(&ko, &geo, &rs->kv, err);
}

/* --varlen: the scheduler's varlen settings with the table (given or measured now). */
static di_status setup_varlen(const gen_args *a, runner_exec *ex, uint32_t seqs,
                              sched_config *sc, di_error *err)
{
    if (!a->varlen)
        return DI_OK;
    varlen_graph_time *t;
    di_status st = gen_step_table(a, ex, seqs, sc->nextn, sc->graph_interval, &t,
                                  &sc->n_step_ms, err);
    if (st != DI_OK)
        return st;
    sc->varlen = true;
    sc->step_ms = t; /* freed once the scheduler has its copy */
    sc->sampler_ms = a->sampler_ms;
    return DI_OK;
}

static di_status setup(const gen_args *a, const runner_model *rm, const kern_backend *be,
                       gen_ctx *g, run_state *rs, di_error *err)
{
    const model_config *c = &rm->w->config;
    uint64_t max_len = a->max_model_len ? a->max_model_len : c->max_position_embeddings;
    if (max_len > UINT32_MAX)
        max_len = UINT32_MAX;
    di_status st = check_prompts(a, c, max_len, err);
    if (st != DI_OK)
        return st;
    uint32_t nextn = a->nextn >= 0 ? (uint32_t)a->nextn : (c->n_mtp ? c->dspark_block_size : 0);
    if (nextn && !c->n_mtp)
        return di_fail(err, DI_EINVAL, "--nextn %u needs a model with draft stages", nextn);
    if (c->n_mtp && nextn > c->dspark_block_size)
        return di_fail(err, DI_EINVAL, "--nextn %u exceeds the draft block size %u", nextn,
                       c->dspark_block_size);
    uint32_t max_tokens = a->max_tokens_set ? a->max_tokens
                          : a->has_forced ? a->forced.n + 1 : a->max_tokens;
    uint32_t seqs = a->n_prompts < 64 ? a->n_prompts : 64;
    uint64_t blocks = 1;
    for (uint32_t i = 0; i < a->n_prompts; i++)
        blocks += (a->prompts[i].n + (uint64_t)max_tokens + nextn + 2 + 127) / 128;
    if (blocks > (1u << 24))
        return di_fail(err, DI_EINVAL, "%llu KV blocks needed: too many or too long prompts",
                       (unsigned long long)blocks);
    sched_config sc;
    sched_config_default(&sc);
    sc.type = SCHED_NORMAL;
    /* one offline rank has no group to wait for: every decode step may admit prompts */
    sc.prefill_attempt_interval = 1;
    sc.max_num_batched_tokens = a->chunk;
    sc.max_num_seqs = seqs;
    sc.max_model_len = (uint32_t)max_len;
    sc.nextn = nextn;
    sc.num_blocks = (uint32_t)blocks;
    sc.num_slots = seqs + 1;
    sc.max_waiting = a->n_prompts > 4096 ? a->n_prompts : 4096;
    sc.eos_token = (int32_t)c->eos_token_id;
    sc.pad_token = (int32_t)c->pad_token_id;
    sc.vocab_size = c->vocab_size;
    sc.async = a->ahead;
    uint32_t rows = a->chunk > seqs * (1 + nextn) ? a->chunk : seqs * (1 + nextn);
    if (nextn && rows < seqs * c->dspark_block_size)
        rows = seqs * c->dspark_block_size;
    if ((st = open_kvstore(a, c, nextn, max_tokens, &g->log, &sc, rs, err)) != DI_OK)
        return st;
    runner_exec_options eo = {.fwd = {.nextn = nextn, .max_rows = rows, .yoco = a->yoco,
                                      .keep_tokens = a->yoco ? a->keep_tokens : 0},
                              .n_blocks = sc.num_blocks, .n_slots = sc.num_slots,
                              .on_logits = a->dump_logits ? dump_row : NULL,
                              .logits_userdata = g,
                              .on_load = gen_kv_load, .load_userdata = rs->kv,
                              .ahead = a->ahead, .overlap = a->overlap};
    if (rs->ep)
        gen_ep_wire(rs->ep, &sc, &eo.fwd);
    if ((st = runner_exec_create(rm, be, &eo, &rs->ex, err)) != DI_OK ||
        (st = setup_varlen(a, rs->ex, seqs, &sc, err)) != DI_OK)
        return st;
    rs->rx = runner_exec_executor(rs->ex);
    engine_config ec = {.sched = sc, .exec = {.ctx = rs, .add = run_add, .remove = run_remove,
                                              .step = run_step,
                                              .issue = a->ahead ? run_issue : NULL,
                                              .collect = a->ahead ? run_collect : NULL},
                        .on_output = take_output, .userdata = rs};
    rs->g = g;
    st = engine_create(&ec, &rs->e, err);
    free((void *)sc.step_ms);
    if (st != DI_OK) {
        if (a->step_ms && strncmp(err->msg, "step_ms", 7) == 0)
            di_error_prefix(err, "--step-ms: ");
        return st;
    }
    for (uint32_t i = 0; rs->kv && i < a->n_prompts; i++)
        if ((st = gen_kv_admit(rs->kv, i + 1, a->prompts[i].ids, a->prompts[i].n, err)) !=
            DI_OK) {
            di_error_prefix(err, "prompt %u: ", i + 1);
            return st;
        }
    if (rs->kv && (st = gen_kv_collect(rs->kv, err)) != DI_OK)
        return st;
    for (uint32_t i = 0; i < a->n_prompts; i++) {
        if (rs->ep && !gen_ep_mine(rs->ep, i))
            continue; /* another rank's */
        runner_request rq = {.id = i + 1, .prompt = a->prompts[i].ids,
                             .prompt_len = a->prompts[i].n, .max_tokens = max_tokens,
                             .params = a->params, .forced = a->forced.ids,
                             .n_forced = a->forced.n};
        rq.params.eos_id = (int32_t)c->eos_token_id;
        sched_request sr = {.id = i + 1, .prompt = a->prompts[i].ids,
                            .prompt_len = a->prompts[i].n, .max_tokens = max_tokens,
                            .ignore_eos = a->ignore_eos};
        gen_kv_hit(rs->kv, &sr);
        if ((st = engine_add(rs->e, &sr, &rq, NULL, err)) != DI_OK) {
            di_error_prefix(err, "prompt %u: ", i + 1);
            return st;
        }
    }
    return DI_OK;
}

di_status gen_run(gen_args *a, di_error *err)
{
    sampling_params check = a->params;
    di_status st = sampling_params_validate(&check, UINT32_MAX, err);
    if (st == DI_OK && a->prefill)
        return gen_remote_run(a, err);
    if (st == DI_OK && a->ep_ranks > 1)
        return gen_ep_launch(a, err);
    if (st == DI_OK && a->kvstore && !gen_kv_supported())
        st = gen_kv_open(NULL, NULL, NULL, err); /* says why */
    if (st != DI_OK)
        return st; /* before loading anything */
    kern_backend be = {0};
    serve_model sm = {0};
    const runner_model *rm = &sm.rm;
    gen_ctx g = {.a = a, .log = {.fn = log_line, .level = a->quiet ? DI_LOG_WARN : DI_LOG_INFO}};
    run_state rs = {0};
    json_t *stats = NULL;
    serve_backend_options bo = {.threads = a->threads, .device = a->device,
                                .batch_invariant = a->batch_invariant};
    if ((st = serve_backend_open(a->backend, &bo, &be, err)) != DI_OK) {
        di_error_prefix(err, "--backend %s: ", a->backend);
        return st;
    }
    uint64_t t0 = di_mono_ns();
    if ((st = open_model(a, &sm, err)) != DI_OK)
        goto done;
    double load_s = (double)(di_mono_ns() - t0) / 1e9;
    print_identity(a, rm->w);
    g.vocab = rm->w->config.vocab_size;
    g.tok = sm.tok;
    if ((st = encode_prompts(a, &g, err)) != DI_OK)
        goto done;
    g.outs = calloc(a->n_prompts ? a->n_prompts : 1, sizeof(gen_out));
    if (!g.outs) {
        st = di_fail(err, DI_ENOMEM, "outputs");
        goto done;
    }
    if (a->dump_logits && !(g.dump = fopen(a->dump_logits, "w"))) {
        st = di_fail(err, DI_EIO, "%s: %s", a->dump_logits, strerror(errno));
        goto done;
    }
    if ((a->world || a->ep_ranks) && (st = gen_ep_open(a, &be, rm->w, &rs.ep, err)) != DI_OK)
        goto done;
    if ((st = setup(a, rm, &be, &g, &rs, err)) != DI_OK)
        goto done;
    for (bool more = true; st == DI_OK;) {
        if (rs.ep)
            st = gen_ep_any_work(rs.ep, engine_sched(rs.e), &more, err);
        else
            more = engine_has_work(rs.e);
        if (st != DI_OK || !more)
            break;
        st = step_once(&rs, err);
    }
    if (st == DI_OK && (st = engine_flush(rs.e, err)) == DI_OK && rs.out_st != DI_OK) {
        *err = rs.out_err; /* the outputs of the step still in flight (--ahead) */
        st = rs.out_st;
    }
    if (st != DI_OK)
        goto done;
    gen_kv_drain(rs.kv);
    stats = json_pack("{s:f, s:I, s:f, s:I, s:I, s:f, s:I, s:b, s:I, s:I}", "load_s", load_s,
                      "prefill_tokens", (json_int_t)rs.prefill_tokens, "prefill_s", rs.prefill_s,
                      "decode_steps", (json_int_t)rs.decode_steps, "decode_tokens",
                      (json_int_t)rs.decode_tokens, "decode_s", rs.decode_s,
                      "logit_rows_dumped", (json_int_t)g.dumped, "varlen", a->varlen,
                      "ahead_entries",
                      (json_int_t)runner_exec_get_stats(rs.ex)->ahead_entries,
                      "decode_rows", (json_int_t)sched_get_stats(engine_sched(rs.e))->decode_rows);
    if (stats && a->ahead)
        json_object_update_new(stats, json_pack(
            "{s:I, s:f, s:f, s:f}", "overlap_steps",
            (json_int_t)runner_exec_get_stats(rs.ex)->overlap_steps, "decode_issue_s",
            rs.issue_s, "decode_collect_s", rs.collect_s, "decode_wall_s", rs.decode_wall_s));
    if (rs.kv) {
        gen_kv_stats ks = gen_kv_get_stats(rs.kv);
        json_object_set_new(stats, "kvstore", json_pack(
            "{s:I, s:I, s:I, s:I, s:I, s:I, s:I, s:I, s:I, s:I, s:b}", "hit_tokens",
            (json_int_t)ks.hit_tokens, "replay_tokens", (json_int_t)ks.replay_tokens,
            "blocks_loaded", (json_int_t)ks.blocks_loaded, "windows_loaded",
            (json_int_t)ks.windows_loaded, "blocks_stored", (json_int_t)ks.blocks_stored,
            "windows_stored", (json_int_t)ks.windows_stored, "errors", (json_int_t)ks.errors,
            "load_failures", (json_int_t)ks.load_failures, "store_failures",
            (json_int_t)ks.store_failures, "retries", (json_int_t)ks.retries, "refused",
            ks.refused));
        if (!a->quiet)
            fprintf(stderr, "di-generate: KV store: %llu prompt tokens loaded; stored: %llu "
                    "blocks, %llu window states\n", (unsigned long long)ks.hit_tokens,
                    (unsigned long long)ks.blocks_stored, (unsigned long long)ks.windows_stored);
    }
    bool print = true;
    if (rs.ep && (st = gen_ep_gather(rs.ep, g.outs, a->n_prompts,
                                     sched_get_stats(engine_sched(rs.e)), rs.decode_tokens,
                                     stats, &print, err)) != DI_OK)
        goto done;
    if (print && a->json)
        print_json(&g, stats, stdout);
    else if (print)
        print_plain(&g, stdout);
    if (!a->quiet)
        fprintf(stderr, "di-generate: prefill %llu tokens in %.2f s (%.0f tokens/s), decode %llu "
                "tokens in %llu steps, %.2f s (%.1f tokens/s)\n",
                (unsigned long long)rs.prefill_tokens, rs.prefill_s,
                rs.prefill_s > 0 ? rs.prefill_tokens / rs.prefill_s : 0.0,
                (unsigned long long)rs.decode_tokens, (unsigned long long)rs.decode_steps,
                rs.decode_s, rs.decode_s > 0 ? rs.decode_tokens / rs.decode_s : 0.0);
done:
    json_decref(stats);
    if (g.dump && fclose(g.dump) != 0 && st == DI_OK)
        st = di_fail(err, DI_EIO, "%s: write failed", a->dump_logits);
    for (uint32_t i = 0; g.outs && i < a->n_prompts; i++) {
        free(g.outs[i].tokens);
        free(g.outs[i].logprobs);
        json_decref(g.outs[i].tops);
    }
    free(g.outs);
    engine_destroy(rs.e);
    runner_exec_free(rs.ex);
    gen_kv_close(rs.kv);
    gen_ep_close(rs.ep);
    serve_model_close(&sm);
    serve_backend_close(&be);
    return st;
}
