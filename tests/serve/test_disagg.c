/* Disaggregated serving on loopback: a real di-kvstore, one di-prefill and one di-decode
 * (tiny model, CPU backend), driven by di-generate --prefill/--decode. Tokens and logprobs
 * equal a local di-generate run's bit for bit (prompt lengths around multiples of 128 and over
 * one chunk; temperature 0 and 0.8 with several seeds; drafts on and off). After every test
 * both ranks' free blocks and slots are back at their starting values (GetLoad) and the store
 * holds no lease and no handoff (di-kvctl stats --json). Failures: a handoff that is not in
 * the store, a decode killed mid-stream, the store killed and brought back, cancels at random
 * moments, a drain with work in flight. */
#include <criterion/criterion.h>
#include <pthread.h>
#include <signal.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/util/clock.h"
#include "tests/kvstore/helpers.h"
#include "tests/serve/rig.h"

/* ---- prompts and di-generate ---- */

static const uint32_t k_lens[] = {1, 5, 127, 128, 129, 255, 256, 257, 300, 383, 384, 385, 600};
#define N_LENS (sizeof k_lens / sizeof k_lens[0])
#define write_prompts(path, salt) rig_write_prompts(path, k_lens, N_LENS, salt)
#define same_outputs(a, b, what) rig_same_outputs(a, b, k_lens, N_LENS, what)

static void compare_runs(const rig *r, const char *sampling, uint32_t salt)
{
    char prompts[300], what[200];
    snprintf(prompts, sizeof prompts, "%s/prompts-%u.txt", g_dir, salt);
    write_prompts(prompts, salt);
    gen_res local, remote;
    gen(&local, "--config %s --weights-seed " SEED " --chunk " CHUNK " --threads 1 --nextn %s "
        "--ids-file %s --max-tokens 10 --ignore-eos %s", r->config ? r->config : "tiny",
        r->nextn, prompts, sampling);
    cr_assert_eq(local.rc, 0, "local run: %s", local.err);
    gen(&remote, "--prefill %s --decode %s --ids-file %s --max-tokens 10 --ignore-eos %s",
        r->prefill.target, r->decode.target, prompts, sampling);
    cr_assert_eq(remote.rc, 0, "remote run: %s", remote.err);
    snprintf(what, sizeof what, "nextn %s, %s", r->nextn, sampling);
    same_outputs(&remote, &local, what);
    json_t *st = json_object_get(remote.json, "stats");
    cr_assert(json_real_value(json_object_get(st, "ttft_ms_mean")) > 0, "remote timings");
    cr_assert(json_real_value(json_object_get(st, "kv_pulled_bytes_mean")) > 0, "KV pulled");
    json_decref(local.json);
    json_decref(remote.json);
}

TestSuite(disagg, .init = rig_setup, .fini = rig_teardown, .timeout = 600);

Test(disagg, drafts_on_equal_local_runs)
{
    rig r = {0};
    rig_start(&r, "5");
    compare_runs(&r, "--temperature 0 --seed 1", 1);
    assert_clean(&r);
    compare_runs(&r, "--temperature 0.8 --seed 7 --logprobs 3", 2);
    compare_runs(&r, "--temperature 0.8 --seed 12345", 3);
    assert_clean(&r);
    rig_stop(&r);
}

Test(disagg, drafts_off_equal_local_runs)
{
    rig r = {0};
    rig_start(&r, "0");
    compare_runs(&r, "--temperature 0 --seed 1", 4);
    compare_runs(&r, "--temperature 0.8 --seed 99", 5);
    assert_clean(&r);
    rig_stop(&r);
}

/* The same on the `small` config (wider, more layers and experts than tiny). */
Test(disagg, small_model_equals_local_runs)
{
    rig r = {.config = "small"};
    rig_start(&r, "5");
    compare_runs(&r, "--temperature 0.8 --seed 21 --logprobs 2", 6);
    assert_clean(&r);
    rig_stop(&r);
}

/* A bad request gets one clear line; a handoff that is not in the store is ENOENT. */
Test(disagg, bad_requests_and_a_missing_handoff_are_refused_clearly)
{
    rig r = {0};
    rig_start(&r, "5");
    rpc_client *pc = client(&r.prefill), *dc = client(&r.decode);
    uint32_t ids[8] = {5, 6, 7, 4095, 4096};
    di_status st;
    di_error err;
    cr_assert_null(prefill(pc, "bad-1", ids, 5, 4, 10000, &st, &err));
    cr_assert_eq(st, DI_EINVAL);
    cr_assert(strstr(err.msg, "prompt[4]: 4096 is outside the vocabulary"), "%s", err.msg);
    cr_assert_null(prefill(pc, "bad id", ids, 3, 4, 10000, &st, &err));
    cr_assert(st == DI_EINVAL && strstr(err.msg, "request_id"), "%s", err.msg);
    cr_assert_null(prefill(pc, "bad-2", ids, 3, 0x7fffffff, 10000, &st, &err));
    cr_assert(st == DI_EINVAL && strstr(err.msg, "max_tokens"), "%s", err.msg);
    /* a manifest naming a handoff the store does not hold */
    Di__Engine__Token first = DI__ENGINE__TOKEN__INIT;
    first.id = 9;
    uint8_t key[32] = {1, 2, 3};
    Di__Prefill__HandoffManifest man = DI__PREFILL__HANDOFF_MANIFEST__INIT;
    man.model_id = model_id_of(&r.decode);
    man.handoff_key = (ProtobufCBinaryData){32, key};
    man.handoff_bytes = 1 << 20;
    Di__Prefill__PrefillReply fake = DI__PREFILL__PREFILL_REPLY__INIT;
    fake.first = &first;
    fake.handoff = &man;
    int ended;
    rpc_stream *s = decode_open(dc, "nohandoff", ids, 3, &fake, 8);
    cr_assert_eq(stream_read(s, 100, &ended, &st, &err), 0);
    cr_assert(ended && st == DI_ENOENT && strstr(err.msg, "not in the store"), "%s: %s",
              di_status_name(st), err.msg);
    rpc_stream_close(s);
    man.model_id ^= 1; /* another model's handoff */
    s = decode_open(dc, "othermodel", ids, 3, &fake, 8);
    stream_read(s, 100, &ended, &st, &err);
    cr_assert(st == DI_EINVAL && strstr(err.msg, "model_id"), "%s", err.msg);
    rpc_stream_close(s);
    /* a real handoff decoded for another prompt is refused, and then nobody takes it */
    Di__Prefill__PrefillReply *pr = prefill(pc, "real-1", ids, 3, 8, 30000, &st, &err);
    cr_assert_not_null(pr, "%s", err.msg);
    ids[0] = 6;
    s = decode_open(dc, "real-1", ids, 3, pr, 8);
    stream_read(s, 100, &ended, &st, &err);
    cr_assert(st == DI_EINVAL && strstr(err.msg, "not this request's"), "%s", err.msg);
    rpc_stream_close(s);
    ids[0] = 5;
    s = decode_open(dc, "real-1", ids, 3, pr, 8);
    cr_assert_eq(stream_read(s, 100, &ended, &st, &err), 7, "%s", err.msg);
    cr_assert(ended && st == DI_OK, "%s", err.msg);
    rpc_stream_close(s);
    di__prefill__prefill_reply__free_unpacked(pr, NULL);
    rpc_client_close(pc);
    rpc_client_close(dc);
    assert_clean(&r);
    rig_stop(&r);
}

/* Decode killed mid-stream: the caller's stream ends with an error; prefill and the store
 * keep nothing. */
Test(disagg, decode_killed_mid_stream_ends_the_callers_stream)
{
    rig r = {0};
    rig_start(&r, "5");
    flight f;
    flight_start(&f, &r, "killed-1", 300, 3000, 5);
    /* killed once it has taken the handoff: its delete runs on the store thread after the pull
     * (a decode killed between the two leaves the handoff to the store's TTL) */
    rig_wait_no_handoffs(&r, 10000);
    proc_kill(&r.decode);
    di_error err;
    di_status st = flight_end(&f, &err);
    cr_assert_neq(st, DI_OK, "the stream must end with an error");
    engine_start(&r.decode, "decode/di-decode", "decode2", &r);
    assert_clean(&r);
    rig_stop(&r);
}

/* The store killed: the request fails with one clear line and leaks nothing on the ranks;
 * once the store is back the next request is served and equals the local run. */
Test(disagg, store_killed_then_back)
{
    rig r = {0};
    rig_start(&r, "5");
    th_store_kill(&r.store);
    gen_res g;
    gen(&g, "--prefill %s --decode %s --ids 5,6,7 --max-tokens 4", r.prefill.target,
        r.decode.target);
    cr_assert_neq(g.rc, 0);
    cr_assert(strstr(g.err, "handoff to the store"), "%s", g.err);
    json_decref(g.json);
    Di__Engine__Load l = get_load(&r.prefill, "prefill.Prefill");
    cr_assert_eq(l.free_blocks, r.load0[0].free_blocks);
    cr_assert_eq(l.free_slots, r.load0[0].free_slots);
    th_store_restart(&r.store);
    compare_runs(&r, "--temperature 0.8 --seed 3", 10);
    assert_clean(&r);
    rig_stop(&r);
}

/* Aborts at random moments (queued, between chunks, handing off, loading, decoding) and
 * streams cancelled mid-way leak nothing. DI_DISAGG_CANCELS sets how many (default 200). */
Test(disagg, random_cancels_leak_nothing)
{
    rig r = {0};
    rig_start(&r, "5");
    uint32_t n = rig_cancels();
    rpc_client *pc = client(&r.prefill), *dc = client(&r.decode);
    uint32_t ids[700], seed = 12345, served = 0, aborted = 0;
    for (uint32_t i = 0; i < n; i++) {
        seed = seed * 1103515245u + 12345u;
        uint32_t len = 1 + (seed >> 8) % 600, max_tokens = 2 + (seed >> 4) % 40;
        prompt_ids(ids, len, i);
        char rid[32];
        snprintf(rid, sizeof rid, "c-%u", i);
        aborter ab = {.p = &r.prefill, .method = "/di.prefill.Prefill/Abort",
                      .delay_us = (seed >> 12) % 40000};
        snprintf(ab.rid, sizeof ab.rid, "%s", rid);
        pthread_t t;
        bool abort_prefill = i % 2 == 0;
        if (abort_prefill)
            pthread_create(&t, NULL, abort_later, &ab);
        di_status st;
        di_error err;
        Di__Prefill__PrefillReply *pr = prefill(pc, rid, ids, len, max_tokens, 30000, &st,
                                                &err);
        if (abort_prefill)
            pthread_join(t, NULL);
        if (!pr) {
            cr_assert_eq(st, DI_ECANCELED, "prefill %u: %s", i, err.msg);
            aborted++;
            continue;
        }
        rpc_stream *s = decode_open(dc, rid, ids, len, pr, max_tokens);
        int ended;
        uint32_t want = (seed >> 16) % 8;
        ab = (aborter){.p = &r.decode, .method = "/di.decode.Decode/Abort",
                       .delay_us = (seed >> 3) % 20000};
        snprintf(ab.rid, sizeof ab.rid, "%s", rid);
        if (i % 3 == 0) { /* an Abort at a random moment, maybe while loading */
            pthread_create(&t, NULL, abort_later, &ab);
            stream_read(s, 100000, &ended, &st, &err);
            pthread_join(t, NULL);
        } else { /* the client goes away after a few tokens */
            stream_read(s, want + 1, &ended, &st, &err);
            if (!ended)
                rpc_stream_cancel(s);
        }
        cr_assert(st == DI_OK || st == DI_ECANCELED, "decode %u: %s: %s", i,
                  di_status_name(st), err.msg);
        served += st == DI_OK && ended;
        rpc_stream_close(s);
        di__prefill__prefill_reply__free_unpacked(pr, NULL);
    }
    rpc_client_close(pc);
    rpc_client_close(dc);
    cr_log_info("%u requests: %u aborted in prefill, %u decoded to the end", n, aborted, served);
    assert_clean(&r);
    rig_stop(&r);
}

/* Reads a Decode stream to its end: the finish of its last message, the tokens it carried. */
static Di__Engine__Finish stream_finish(rpc_stream *s, uint32_t *tokens, di_status *st)
{
    Di__Engine__Finish f = DI__ENGINE__FINISH__FINISH_NONE;
    *tokens = 0;
    Di__Decode__DecodeToken *t;
    while ((t = stream_next(s, st))) {
        *tokens += t->token != NULL;
        f = t->finish;
        di__decode__decode_token__free_unpacked(t, NULL);
    }
    return f;
}

/* A decode rank out of KV blocks stops a request (preemption mode STOP): its stream's last
 * message says FINISH_PREEMPTED; the other request runs to its length; nothing leaks. */
Test(disagg, preemption_in_decode_ends_the_victim_with_preempted)
{
    rig r = {.blocks = "16"}; /* 15 usable blocks: 1,920 positions */
    rig_start(&r, "5");
    flight a, b;
    flight_start(&a, &r, "big-a", 300, 1500, 1);
    flight_start(&b, &r, "big-b", 299, 1500, 1);
    uint32_t na, nb;
    di_status sa, sb;
    Di__Engine__Finish fa = stream_finish(a.s, &na, &sa), fb = stream_finish(b.s, &nb, &sb);
    cr_assert(sa == DI_OK && sb == DI_OK, "%s %s", di_status_name(sa), di_status_name(sb));
    bool a_pre = fa == DI__ENGINE__FINISH__FINISH_PREEMPTED;
    bool b_pre = fb == DI__ENGINE__FINISH__FINISH_PREEMPTED;
    cr_assert(a_pre != b_pre, "exactly one victim (finishes %d and %d)", fa, fb);
    cr_assert_eq(a_pre ? fb : fa, DI__ENGINE__FINISH__FINISH_LENGTH);
    cr_assert_lt(a_pre ? na : nb, 1499, "the victim stopped early");
    di_error err;
    flight_end(&a, &err);
    flight_end(&b, &err);
    assert_clean(&r);
    rig_stop(&r);
}

/* SIGTERM with a stream in flight and a short --drain: the stream ends with UNAVAILABLE, the
 * rank exits 0, and nothing is left in the store. */
Test(disagg, drain_fails_what_it_cannot_finish_and_exits_0)
{
    rig r = {.drain = "300ms"};
    rig_start(&r, "5");
    flight f;
    flight_start(&f, &r, "drain-1", 40, 4000, 3);
    cr_assert_eq(proc_stop(&r.decode), 0, "di-decode drains and exits 0");
    di_error err;
    di_status st = flight_end(&f, &err);
    cr_assert_eq(st, DI_EUNAVAIL, "%s: %s", di_status_name(st), err.msg);
    engine_start(&r.decode, "decode/di-decode", "decode2", &r);
    assert_clean(&r);
    rig_stop(&r);
}

/* ---- prefix hits: what the store gives prefill, what decode leaves for the next turn ---- */

/* One prompt of n ids in a file of its own, for di-generate --ids-file. */
static void ids_file(char *path, size_t cap, const char *name, const uint32_t *ids, uint32_t n)
{
    snprintf(path, cap, "%s/%s.txt", g_dir, name);
    FILE *f = fopen(path, "w");
    cr_assert(f);
    for (uint32_t k = 0; k < n; k++)
        fprintf(f, k ? ",%u" : "%u", ids[k]);
    fputc('\n', f);
    cr_assert_eq(fclose(f), 0);
}

/* The prompt through both services (remote) or a local run, temperature 0, end token off. */
static void run_one(gen_res *g, const rig *r, bool remote, const uint32_t *ids, uint32_t n,
                    uint32_t max_tokens, const char *name)
{
    char path[300];
    ids_file(path, sizeof path, name, ids, n);
    if (remote)
        gen(g, "--prefill %s --decode %s --ids-file %s --max-tokens %u --ignore-eos "
            "--temperature 0", r->prefill.target, r->decode.target, path, max_tokens);
    else
        gen(g, "--config tiny --weights-seed " SEED " --chunk " CHUNK " --threads 1 --nextn %s "
            "--ids-file %s --max-tokens %u --ignore-eos --temperature 0", r->nextn, path,
            max_tokens);
    cr_assert_eq(g->rc, 0, "%s run of %s: %s", remote ? "remote" : "local", name, g->err);
}

static json_int_t req_int(const gen_res *g, const char *key)
{
    json_t *q = json_array_get(json_object_get(g->json, "requests"), 0);
    return json_integer_value(json_object_get(q, key));
}

static json_int_t store_stat(const rig *r, const char *cls, const char *key)
{
    json_t *j = kvctl_stats(r);
    json_t *v = cls ? json_object_get(json_object_get(json_object_get(j, "classes"), cls), key)
                    : json_object_get(j, key);
    json_int_t x = json_integer_value(v);
    json_decref(j);
    return x;
}

/* Store jobs run after the reply: wait (10 s at most) until the store holds this many. */
static void wait_objects(const rig *r, json_int_t blocks, json_int_t windows)
{
    uint64_t until = di_mono_ns() + 10000000000ull;
    json_int_t b, w;
    do {
        b = store_stat(r, "block", "objects");
        w = store_stat(r, "window", "objects");
        if (b >= blocks && w >= windows)
            return;
        usleep(50000);
    } while (di_mono_ns() < until);
    cr_assert_fail("the store holds %lld blocks and %lld window states, want %lld and %lld",
                   (long long)b, (long long)w, (long long)blocks, (long long)windows);
}

/* Waits (30 s at most) until the log of p has a line with `what`. */
static void wait_log(const proc *p, const char *what)
{
    uint64_t until = di_mono_ns() + 30000000000ull;
    char buf[65536];
    do {
        FILE *f = fopen(p->log, "r");
        size_t n = f ? fread(buf, 1, sizeof buf - 1, f) : 0;
        if (f)
            fclose(f);
        buf[n] = 0;
        if (strstr(buf, what))
            return;
        usleep(20000);
    } while (di_mono_ns() < until);
    cr_assert_fail("%s: no line with \"%s\" in %s", p->log, what, buf);
}

/* Two prompts: a of 700 ids, b of 720 sharing a's first 640 (5 blocks). */
static void shared_prompts(uint32_t *a, uint32_t *b)
{
    prompt_ids(a, 700, 41);
    memcpy(b, a, 640 * sizeof(uint32_t));
    for (uint32_t k = 640; k < 720; k++)
        b[k] = 2 + (k * 131u + 17u) % 4000u;
}

/* The second prompt sharing a long prefix with the first is served from the store: prefill
 * computes only the rest (the reply's cached_tokens and GetLoad's counts), the store counted
 * the hit, and the output equals a local run's bit for bit. b = 720 tokens: the hit is capped at
 * (720 - 140) / 128 = 4 blocks, where a left its window state (a rerun of a resumes there). */
Test(disagg, a_prompt_sharing_a_long_prefix_is_served_from_the_store)
{
    rig r = {0};
    rig_start(&r, "5");
    uint32_t a[700], b[720];
    shared_prompts(a, b);
    gen_res g1, g2, local;
    run_one(&g1, &r, true, a, 700, 4, "a");
    cr_assert_eq(req_int(&g1, "cached_tokens"), 0, "the store was empty");
    Di__Engine__Load l0 = get_load(&r.prefill, "prefill.Prefill");
    json_int_t hits0 = store_stat(&r, NULL, "lookup_hits");
    run_one(&g2, &r, true, b, 720, 8, "b");
    cr_assert_eq(req_int(&g2, "cached_tokens"), 512);
    Di__Engine__Load l1 = get_load(&r.prefill, "prefill.Prefill");
    cr_assert_eq(l1.prompt_tokens_cached - l0.prompt_tokens_cached, 512);
    cr_assert_eq(l1.prompt_tokens_computed - l0.prompt_tokens_computed, 720 - 512,
                 "prefill computed %llu tokens",
                 (unsigned long long)(l1.prompt_tokens_computed - l0.prompt_tokens_computed));
    cr_assert_geq(store_stat(&r, NULL, "lookup_hits") - hits0, 5, "a's 5 blocks were hit");
    cr_assert_eq(l1.store_failures, 0);
    run_one(&local, &r, false, b, 720, 8, "b-local");
    same_outputs(&g2, &local, "b from the store");
    json_decref(g1.json);
    json_decref(g2.json);
    json_decref(local.json);
    assert_clean(&r);
    rig_stop(&r);
}

/* The next turn of a conversation (the prompt, the response, more) hits the block decode
 * stored as the response filled it, and the window state decode stored at its last multiple
 * of 128: 300 prompt tokens + 200 generated = 499 positions of KV, blocks 0-1 from prefill and
 * block 2 with the window state at 384 from decode; the 600-token next turn resumes at 384
 * (prefill alone would have left 256). */
Test(disagg, the_next_turn_hits_the_blocks_decode_stored)
{
    rig r = {0};
    rig_start(&r, "5");
    uint32_t p[300], q[600];
    prompt_ids(p, 300, 43);
    gen_res g1, g2, local;
    run_one(&g1, &r, true, p, 300, 200, "turn1");
    json_t *toks = json_object_get(json_array_get(json_object_get(g1.json, "requests"), 0),
                                   "tokens");
    cr_assert_eq(json_array_size(toks), 200);
    memcpy(q, p, sizeof p);
    for (uint32_t k = 0; k < 200; k++)
        q[300 + k] = (uint32_t)json_integer_value(json_array_get(toks, k));
    for (uint32_t k = 500; k < 600; k++)
        q[k] = 2 + (k * 61u + 5u) % 4000u;
    wait_objects(&r, 3, 3); /* decode's put runs after its stream ended */
    run_one(&g2, &r, true, q, 600, 8, "turn2");
    cr_assert_eq(req_int(&g2, "cached_tokens"), 384, "decode's block 2 and window at 384");
    run_one(&local, &r, false, q, 600, 8, "turn2-local");
    same_outputs(&g2, &local, "the next turn from the store");
    json_decref(g1.json);
    json_decref(g2.json);
    json_decref(local.json);
    assert_clean(&r);
    rig_stop(&r);
}

typedef struct thaw {
    const proc *p;
    const char *line;
    pid_t store;
} thaw;

/* Continues the stopped store once the rank's log has the line. */
static void *thaw_when(void *arg)
{
    thaw *t = arg;
    wait_log(t->p, t->line);
    kill(t->store, SIGCONT);
    return NULL;
}

/* The store frozen while prefill looks a prompt up: the lookup fails at its deadline, the
 * prompt is computed (same output as a local run) and its handoff stored once the store is
 * back; the next prompt hits again (the store is never given up). Then the store frozen while
 * decode stores a response: the stream is served whole, the put is dropped after its attempts
 * (GetLoad counts it), and once the store is back decode stores the next responses and the
 * next turn hits them. */
Test(disagg, the_store_frozen_during_a_load_or_a_store_costs_only_the_hit)
{
    rig r = {0};
    rig_start(&r, "5");
    uint32_t a[700], b[720];
    shared_prompts(a, b);
    gen_res g1, g2, g3, local;
    run_one(&g1, &r, true, a, 700, 4, "a");
    /* the load */
    cr_assert_eq(kill(r.store.pid, SIGSTOP), 0);
    thaw t = {.p = &r.prefill, .line = "computing the prompt without it", .store = r.store.pid};
    pthread_t th;
    cr_assert_eq(pthread_create(&th, NULL, thaw_when, &t), 0);
    run_one(&g2, &r, true, b, 720, 8, "b");
    pthread_join(th, NULL);
    cr_assert_eq(req_int(&g2, "cached_tokens"), 0, "the lookup failed: no hit");
    run_one(&local, &r, false, b, 720, 8, "b-local");
    same_outputs(&g2, &local, "b without the store");
    Di__Engine__Load l = get_load(&r.prefill, "prefill.Prefill");
    cr_assert_geq(l.store_failures, 1);
    run_one(&g3, &r, true, b, 720, 8, "b-again");
    cr_assert_eq(req_int(&g3, "cached_tokens"), 512, "the store is used again");
    same_outputs(&g3, &local, "b from the store again");
    json_decref(g1.json);
    json_decref(g2.json);
    json_decref(g3.json);
    json_decref(local.json);
    /* the store of a response */
    rpc_client *pc = client(&r.prefill), *dc = client(&r.decode);
    uint32_t p[300];
    prompt_ids(p, 300, 47);
    di_status st;
    di_error err;
    Di__Prefill__PrefillReply *pr = prefill(pc, "frozen-store", p, 300, 200, 60000, &st, &err);
    cr_assert_eq(st, DI_OK, "%s", err.msg);
    json_int_t blocks0 = store_stat(&r, "block", "objects");
    rpc_stream *s = decode_open(dc, "frozen-store", p, 300, pr, 200);
    int ended;
    cr_assert_eq(stream_read(s, 1, &ended, &st, &err), 1, "%s", err.msg);
    uint64_t until = di_mono_ns() + 10000000000ull; /* decode deleted the handoff it pulled */
    while (store_stat(&r, "handoff", "objects") && di_mono_ns() < until)
        usleep(20000);
    cr_assert_eq(kill(r.store.pid, SIGSTOP), 0);
    uint32_t got = 1 + stream_read(s, 1000, &ended, &st, &err);
    cr_assert(ended && st == DI_OK, "the stream is served whole: %s", err.msg);
    cr_assert_eq(got, 199, "every token of the response");
    wait_log(&r.decode, "not stored; the store is tried again");
    cr_assert_eq(kill(r.store.pid, SIGCONT), 0);
    rpc_stream_close(s);
    di__prefill__prefill_reply__free_unpacked(pr, NULL);
    rpc_client_close(pc);
    rpc_client_close(dc);
    l = get_load(&r.decode, "decode.Decode");
    cr_assert_geq(l.store_failures, 1, "the dropped put is counted");
    cr_assert_eq(store_stat(&r, "block", "objects"), blocks0, "the response was not stored");
    /* back: the next turn of another conversation hits what decode stores now */
    uint32_t q[600];
    prompt_ids(q, 300, 53);
    gen_res t1, t2;
    run_one(&t1, &r, true, q, 300, 200, "turn1");
    json_t *toks = json_object_get(json_array_get(json_object_get(t1.json, "requests"), 0),
                                   "tokens");
    for (uint32_t k = 0; k < 200; k++)
        q[300 + k] = (uint32_t)json_integer_value(json_array_get(toks, k));
    for (uint32_t k = 500; k < 600; k++)
        q[k] = 2 + (k * 67u + 3u) % 4000u;
    wait_objects(&r, blocks0 + 3, 0);
    run_one(&t2, &r, true, q, 600, 8, "turn2");
    cr_assert_eq(req_int(&t2, "cached_tokens"), 384, "decode stores again");
    json_decref(t1.json);
    json_decref(t2.json);
    assert_clean(&r);
    rig_stop(&r);
}

