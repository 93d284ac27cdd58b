/* remote.c: di-generate --prefill HOST:PORT --decode HOST:PORT: each prompt goes through
 * di-prefill (first token, handoff in the store), then di-decode (the rest, streamed). The
 * output is the JSON (or plain lines) of a local run; stats carry the remote timings. */
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/engine/scheduler.h"
#include "common/net/decode.pb-c.h"
#include "common/net/engine.pb-c.h"
#include "common/net/prefill.pb-c.h"
#include "common/net/rpc.h"
#include "common/util/clock.h"
#include "tools/generate/gen.h"

#define PREFILL_TIMEOUT_MS 120000u
#define DECODE_TIMEOUT_MS 600000u

/* One request's outcome. */
typedef struct remote_out {
    json_t *tokens, *logprobs, *tops; /* tops NULL without --top-logprobs */
    const char *finish;
    char error[320];
    double ttft_ms;               /* Prefill sent -> its reply */
    double decode_ms;             /* Decode sent -> the stream's end */
    uint32_t n_decoded;           /* tokens the stream carried */
    uint64_t kv_bytes;            /* handoff + full blocks decode pulled */
    double kv_pull_ms;            /* the time decode took to pull them */
    uint32_t cached;              /* prompt tokens prefill loaded from the store */
} remote_out;

static const char *finish_name(Di__Engine__Finish f)
{
    switch (f) {
    case DI__ENGINE__FINISH__FINISH_STOP: return sched_finish_name(SCHED_FINISH_STOP);
    case DI__ENGINE__FINISH__FINISH_LENGTH: return sched_finish_name(SCHED_FINISH_LENGTH);
    case DI__ENGINE__FINISH__FINISH_ABORTED: return sched_finish_name(SCHED_FINISH_ABORT);
    case DI__ENGINE__FINISH__FINISH_PREEMPTED: return sched_finish_name(SCHED_FINISH_PREEMPTED);
    case DI__ENGINE__FINISH__FINISH_NONE: return "none";
    default: return sched_finish_name(SCHED_FINISH_FAILED);
    }
}

static void add_token(remote_out *o, const Di__Engine__Token *t, uint32_t n_logprobs)
{
    json_array_append_new(o->tokens, json_integer(t->id));
    json_array_append_new(o->logprobs, json_real(t->logprob));
    if (!n_logprobs)
        return;
    if (!o->tops)
        o->tops = json_array();
    json_t *m = json_object();
    for (size_t i = 0; i < t->n_top; i++) {
        char key[16];
        snprintf(key, sizeof key, "%u", t->top[i]->id);
        json_object_set_new(m, key, json_real(t->top[i]->logprob));
    }
    json_array_append_new(o->tops, m);
}

static void sampling_of(const gen_args *a, Di__Engine__SamplingParams *sp)
{
    di__engine__sampling_params__init(sp);
    sp->temperature = a->params.temperature;
    sp->has_temperature = 1;
    sp->top_p = a->params.top_p;
    sp->top_k = a->params.top_k;
    sp->force_top_k = a->params.force_top_k;
    sp->first_n_no_eos = a->params.first_n_no_eos;
    sp->n_logprobs = a->params.n_logprobs;
    sp->seed = a->params.seed;
    sp->max_tokens = a->max_tokens;
    if (a->ignore_eos) { /* no end token: the model's EOS does not stop it */
        sp->eos_id = -1;
        sp->has_eos_id = 1;
    }
}

/* One prompt: Prefill, then Decode when the first token did not end it. */
static di_status run_one(const gen_args *a, rpc_client *pc, rpc_client *dc, uint32_t i,
                         remote_out *o, di_error *err)
{
    const gen_ids *p = &a->prompts[i];
    char rid[48];
    snprintf(rid, sizeof rid, "gen-%llu-%u", (unsigned long long)di_mono_ns(), i + 1);
    Di__Engine__SamplingParams sp;
    sampling_of(a, &sp);
    Di__Prefill__PrefillRequest pr = DI__PREFILL__PREFILL_REQUEST__INIT;
    pr.request_id = rid;
    pr.n_prompt = p->n;
    pr.prompt = (uint32_t *)p->ids; /* ids are checked non-negative when parsed */
    pr.sampling = &sp;
    size_t n = di__prefill__prefill_request__get_packed_size(&pr);
    uint8_t *buf = malloc(n ? n : 1), *reply = NULL;
    if (!buf)
        return di_fail(err, DI_ENOMEM, "request");
    di__prefill__prefill_request__pack(&pr, buf);
    size_t rlen = 0;
    uint64_t t0 = di_mono_ns();
    di_status st = rpc_client_call(pc, "/di.prefill.Prefill/Prefill", buf, n, PREFILL_TIMEOUT_MS,
                                   &reply, &rlen, err);
    free(buf);
    o->ttft_ms = (double)(di_mono_ns() - t0) / 1e6;
    if (st != DI_OK) {
        di_error_prefix(err, "prefill: ");
        return st;
    }
    Di__Prefill__PrefillReply *rep = di__prefill__prefill_reply__unpack(NULL, rlen, reply);
    free(reply);
    if (!rep || !rep->first) {
        if (rep)
            di__prefill__prefill_reply__free_unpacked(rep, NULL);
        return di_fail(err, DI_ECORRUPT, "prefill: the reply is not a PrefillReply");
    }
    add_token(o, rep->first, a->params.n_logprobs);
    o->finish = finish_name(rep->finish);
    o->cached = rep->cached_tokens;
    if (rep->finish != DI__ENGINE__FINISH__FINISH_NONE || !rep->handoff) {
        di__prefill__prefill_reply__free_unpacked(rep, NULL);
        return DI_OK;
    }
    Di__Decode__DecodeRequest dr = DI__DECODE__DECODE_REQUEST__INIT;
    dr.request_id = rid;
    dr.handoff = rep->handoff;
    dr.n_prompt = p->n;
    dr.prompt = (uint32_t *)p->ids;
    dr.first = rep->first;
    dr.sampling = &sp;
    n = di__decode__decode_request__get_packed_size(&dr);
    buf = malloc(n ? n : 1);
    if (!buf) {
        di__prefill__prefill_reply__free_unpacked(rep, NULL);
        return di_fail(err, DI_ENOMEM, "request");
    }
    di__decode__decode_request__pack(&dr, buf);
    di__prefill__prefill_reply__free_unpacked(rep, NULL);
    rpc_stream *s = NULL;
    t0 = di_mono_ns();
    st = rpc_stream_open(dc, "/di.decode.Decode/Decode", buf, n, DECODE_TIMEOUT_MS, &s, err);
    free(buf);
    int done = 0;
    while (st == DI_OK && !done) {
        uint8_t *msg = NULL;
        size_t len = 0;
        st = rpc_stream_read(s, &msg, &len, &done, err);
        if (st != DI_OK || done) {
            free(msg);
            break;
        }
        Di__Decode__DecodeToken *t = di__decode__decode_token__unpack(NULL, len, msg);
        free(msg);
        if (!t) {
            st = di_fail(err, DI_ECORRUPT, "decode: a stream message is not a DecodeToken");
            break;
        }
        if (t->kv_bytes_pulled) {
            o->kv_bytes = t->kv_bytes_pulled;
            o->kv_pull_ms = (double)t->kv_pull_us / 1e3;
        }
        if (t->token) {
            add_token(o, t->token, a->params.n_logprobs);
            o->n_decoded++;
        }
        o->finish = finish_name(t->finish);
        di__decode__decode_token__free_unpacked(t, NULL);
    }
    o->decode_ms = (double)(di_mono_ns() - t0) / 1e6;
    rpc_stream_close(s);
    if (st != DI_OK)
        di_error_prefix(err, "decode: ");
    return st;
}

static json_t *request_json(const gen_args *a, uint32_t i, remote_out *o)
{
    json_t *r = json_object();
    json_object_set_new(r, "id", json_integer(i + 1));
    json_object_set_new(r, "prompt_tokens", json_integer(a->prompts[i].n));
    json_object_set_new(r, "cached_tokens", json_integer(o->cached));
    json_object_set(r, "tokens", o->tokens);
    json_object_set(r, "logprobs", o->logprobs);
    if (o->tops)
        json_object_set(r, "top_logprobs", o->tops);
    json_object_set_new(r, "finish", json_string(o->finish ? o->finish : "failed"));
    if (o->error[0])
        json_object_set_new(r, "error", json_string(o->error));
    return r;
}

di_status gen_remote_run(const gen_args *a, di_error *err)
{
    if (a->n_prompts == 0)
        return di_fail(err, DI_EINVAL, "no prompt: give --ids, --ids-file or ids on stdin");
    for (uint32_t i = 0; i < a->n_prompts; i++)
        if (a->prompts[i].text)
            return di_fail(err, DI_EINVAL, "prompt %u: --prefill/--decode take token ids "
                           "(--ids, --ids-file), not text", i + 1);
    rpc_client *pc = NULL, *dc = NULL;
    rpc_client_config pcfg = {.target = a->prefill, .token = a->engine_token};
    rpc_client_config dcfg = {.target = a->decode, .token = a->engine_token};
    di_status st = rpc_client_open(&pcfg, &pc, err);
    if (st == DI_OK)
        st = rpc_client_open(&dcfg, &dc, err);
    remote_out *outs = calloc(a->n_prompts, sizeof(remote_out));
    if (st == DI_OK && !outs)
        st = di_fail(err, DI_ENOMEM, "outputs");
    double ttft = 0, tpot = 0, kvb = 0, kvms = 0;
    uint32_t n_tpot = 0, failed = 0;
    for (uint32_t i = 0; st == DI_OK && i < a->n_prompts; i++) {
        remote_out *o = &outs[i];
        o->tokens = json_array();
        o->logprobs = json_array();
        di_error e;
        if (run_one(a, pc, dc, i, o, &e) != DI_OK) {
            snprintf(o->error, sizeof o->error, "%s", e.msg);
            o->finish = sched_finish_name(SCHED_FINISH_FAILED);
            failed++;
            if (!a->quiet)
                fprintf(stderr, "di-generate: prompt %u: %s\n", i + 1, e.msg);
        }
        ttft += o->ttft_ms;
        kvb += (double)o->kv_bytes;
        kvms += o->kv_pull_ms;
        if (o->n_decoded) {
            tpot += o->decode_ms / o->n_decoded;
            n_tpot++;
        }
    }
    if (st == DI_OK) {
        json_t *root = json_object(), *reqs = json_array();
        for (uint32_t i = 0; i < a->n_prompts; i++)
            json_array_append_new(reqs, request_json(a, i, &outs[i]));
        json_object_set_new(root, "requests", reqs);
        json_object_set_new(root, "stats", json_pack(
            "{s:b, s:f, s:f, s:f, s:f, s:I}", "remote", 1, "ttft_ms_mean", ttft / a->n_prompts,
            "tpot_ms_mean", n_tpot ? tpot / n_tpot : 0.0, "kv_pulled_bytes_mean",
            kvb / a->n_prompts, "kv_pull_ms_mean", kvms / a->n_prompts, "failed",
            (json_int_t)failed));
        if (a->json) {
            json_dumpf(root, stdout, JSON_INDENT(1) | JSON_REAL_PRECISION(9));
            fputc('\n', stdout);
        } else {
            for (uint32_t i = 0; i < a->n_prompts; i++) {
                printf("request %u (%s):", i + 1, outs[i].finish ? outs[i].finish : "failed");
                for (size_t k = 0; k < json_array_size(outs[i].tokens); k++)
                    printf(" %lld", (long long)json_integer_value(json_array_get(outs[i].tokens,
                                                                                 k)));
                if (outs[i].error[0])
                    printf(" [error: %s]", outs[i].error);
                putchar('\n');
            }
        }
        json_decref(root);
        for (uint32_t i = 0; failed && i < a->n_prompts; i++)
            if (outs[i].error[0]) {
                st = di_fail(err, DI_EIO, "%u of %u prompts failed; prompt %u: %s", failed,
                             a->n_prompts, i + 1, outs[i].error);
                break;
            }
    }
    for (uint32_t i = 0; outs && i < a->n_prompts; i++) {
        json_decref(outs[i].tokens);
        json_decref(outs[i].logprobs);
        json_decref(outs[i].tops);
    }
    free(outs);
    rpc_client_close(pc);
    rpc_client_close(dc);
    return st;
}
