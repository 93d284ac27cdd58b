/* di-decode --overlap and --ahead on loopback (tests/serve/rig.h: a real di-kvstore,
 * di-prefill, and di-decode ranks on the tiny model, CPU backend, nextn 0): the same requests
 * through the synchronous rank, the --overlap rank and the --ahead rank give the same streams
 * (tokens, logprobs, top logprobs, finish reasons, counts) and leave the same KV in the store
 * (same keys, same bytes). The requests: greedy, seeded sampling, a stop token, a short
 * max_tokens, a client's cancel and an Abort mid-stream, all streaming at once, their
 * responses crossing multiples of 128. GetLoad counts steps issued ahead on the --overlap rank
 * only; every rank gets its blocks and slots back (also after a lone cancel and a deadline)
 * and drains on SIGTERM, the --overlap rank with a stream in flight. The flags are refused by a rank group, with drafts,
 * and by di-prefill. */
#include <criterion/criterion.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "common/kvfmt/kv_keys.h"
#include "common/net/kv_client.h"
#include "common/util/clock.h"
#include "tests/serve/rig.h"

#define MAX_PROMPT 400u
#define MAX_OUT 512u
#define OBJ_CAP (16u << 20)

/* One request of the workload. */
typedef struct spec {
    const char *name;
    uint32_t salt, len;          /* prompt_ids(len, salt) */
    float temperature;
    uint64_t seed;
    uint32_t n_logprobs;
    uint32_t max_tokens;
    int32_t stop;                /* a stop id, -1 none */
    uint32_t cancel_after;       /* cancel the stream after this many messages; 0: read all */
    bool by_abort;               /* the cancel is an Abort call (the rest of the stream is read
                                    but not compared: when the abort lands varies) */
    uint32_t deadline_ms;        /* of the Decode call, which ends there (its messages are not
                                    compared); 0: 60 s */
} spec;

/* What a request saw: a transcript of its first token and every stream message (floats as
 * %a: exact), and its tokens for the store's keys. */
typedef struct seen {
    char text[64 * MAX_OUT];
    size_t len;
    int32_t tokens[MAX_PROMPT + MAX_OUT];
    uint32_t n_tokens;
    bool aborted;
} seen;

static void say(seen *v, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void say(seen *v, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(v->text + v->len, sizeof v->text - v->len, fmt, ap);
    va_end(ap);
    cr_assert(n >= 0 && (size_t)n < sizeof v->text - v->len, "transcript too long");
    v->len += (size_t)n;
}

static void say_token(seen *v, const Di__Engine__Token *t)
{
    say(v, "%u@%u:%a", t->id, t->index, (double)t->logprob);
    for (size_t i = 0; i < t->n_top; i++)
        say(v, ",%u:%a", t->top[i]->id, (double)t->top[i]->logprob);
    cr_assert_lt(v->n_tokens, MAX_PROMPT + MAX_OUT);
    v->tokens[v->n_tokens++] = (int32_t)t->id;
}

static Di__Engine__SamplingParams sampling_of(const spec *q, uint32_t *stop)
{
    Di__Engine__SamplingParams sp = no_eos(q->max_tokens);
    sp.temperature = q->temperature;
    sp.has_temperature = 1;
    sp.seed = q->seed;
    sp.n_logprobs = q->n_logprobs;
    if (q->stop >= 0) {
        *stop = (uint32_t)q->stop;
        sp.stop_ids = stop;
        sp.n_stop_ids = 1;
    }
    return sp;
}

typedef struct live {
    uint32_t ids[MAX_PROMPT];
    uint32_t stop;
    Di__Engine__SamplingParams sp;
    Di__Prefill__PrefillReply *pr;
    rpc_stream *s;
} live;

/* Reads up to max messages of q's stream into v (NULL: read, not kept); true when the stream
 * ended. */
static bool read_stream(live *l, seen *v, uint32_t max, di_status *st)
{
    for (uint32_t k = 0; k < max; k++) {
        Di__Decode__DecodeToken *t = stream_next(l->s, st);
        if (!t)
            return true;
        if (v && t->token)
            say_token(v, t->token);
        if (v)
            say(v, " f%d n%u\n", (int)t->finish, t->output_tokens);
        di__decode__decode_token__free_unpacked(t, NULL);
    }
    return false;
}

/* Runs the n requests through r's prefill and the decode rank dec, all streams open at once
 * (the cancels read first); tag makes the request ids of this run. */
static void run_all(rig *r, const proc *dec, const char *tag, const spec *qs, size_t n,
                    seen *out)
{
    rpc_client *pc = client(&r->prefill), *dc = client(dec);
    live *ls = calloc(n, sizeof *ls);
    cr_assert(ls);
    for (size_t i = 0; i < n; i++) { /* one after another: the store's prefix hits are those
                                        of every run */
        char rid[64];
        snprintf(rid, sizeof rid, "%s-%s", tag, qs[i].name);
        prompt_ids(ls[i].ids, qs[i].len, qs[i].salt);
        ls[i].sp = sampling_of(&qs[i], &ls[i].stop);
        memset(&out[i], 0, sizeof out[i]);
        for (uint32_t k = 0; k < qs[i].len; k++)
            out[i].tokens[out[i].n_tokens++] = (int32_t)ls[i].ids[k];
        di_status st;
        di_error err;
        ls[i].pr = prefill_with(pc, rid, ls[i].ids, qs[i].len, &ls[i].sp, 60000, &st, &err);
        cr_assert_not_null(ls[i].pr, "prefill %s: %s", rid, err.msg);
        say(&out[i], "first ");
        say_token(&out[i], ls[i].pr->first);
        say(&out[i], " f%d\n", (int)ls[i].pr->finish);
    }
    for (size_t i = 0; i < n; i++) {
        char rid[64];
        snprintf(rid, sizeof rid, "%s-%s", tag, qs[i].name);
        ls[i].s = decode_open_with(dc, rid, ls[i].ids, qs[i].len, ls[i].pr, &ls[i].sp,
                                   qs[i].deadline_ms ? qs[i].deadline_ms : 60000);
    }
    for (size_t i = 0; i < n; i++) {
        if (!qs[i].cancel_after)
            continue;
        di_status st;
        cr_assert(!read_stream(&ls[i], &out[i], qs[i].cancel_after, &st),
                  "%s ended before its cancel", qs[i].name);
        out[i].aborted = true;
        if (!qs[i].by_abort) {
            rpc_stream_cancel(ls[i].s);
            continue;
        }
        aborter ab = {.p = dec, .method = "/di.decode.Decode/Abort"};
        snprintf(ab.rid, sizeof ab.rid, "%s-%s", tag, qs[i].name);
        abort_later(&ab);
        cr_assert(read_stream(&ls[i], NULL, MAX_OUT + 1, &st), "%s: too long", qs[i].name);
        cr_assert_eq(st, DI_ECANCELED, "%s/%s after Abort: %s", tag, qs[i].name,
                     di_status_name(st));
    }
    for (size_t i = 0; i < n; i++) {
        di_status st = DI_OK;
        if (!qs[i].cancel_after) {
            cr_assert(read_stream(&ls[i], qs[i].deadline_ms ? NULL : &out[i],
                                  qs[i].deadline_ms ? 100000 : MAX_OUT + 1, &st),
                      "%s: too long", qs[i].name);
            di_status want = qs[i].deadline_ms ? DI_ETIMEDOUT : DI_OK;
            cr_assert_eq(st, want, "%s/%s: %s", tag, qs[i].name, di_status_name(st));
        }
        rpc_stream_close(ls[i].s);
        di__prefill__prefill_reply__free_unpacked(ls[i].pr, NULL);
    }
    free(ls);
    rpc_client_close(pc);
    rpc_client_close(dc);
}

/* ---- the store's objects under the requests' keys ---- */

typedef struct obj {
    kvkey key;
    int cls;
    di_status st;                /* DI_OK or DI_ENOENT */
    uint64_t bytes;
    uint8_t *data;
} obj;

typedef struct objset {
    obj *o;
    size_t n;
} objset;

/* Every block and window object under the chain keys of the requests' tokens (prompt, first
 * token, response); with wipe they are deleted afterwards. */
static objset read_objects(const rig *r, uint64_t model_id, const seen *v, size_t n, bool wipe)
{
    kvc_client *c = th_client(&r->store, NULL);
    objset os = {0};
    os.o = calloc(n * (MAX_PROMPT + MAX_OUT) / 128 * 2 + 2, sizeof(obj));
    cr_assert(os.o);
    uint8_t *buf = malloc(OBJ_CAP);
    cr_assert(buf);
    for (size_t i = 0; i < n; i++) {
        kvkey keys[(MAX_PROMPT + MAX_OUT) / 128];
        size_t nk = 0;
        di_error err;
        cr_assert_eq(kvkey_chain(model_id, 128, v[i].tokens, v[i].n_tokens, keys,
                                 sizeof keys / sizeof keys[0], &nk, &err), DI_OK, "%s", err.msg);
        for (size_t k = 0; k < nk; k++)
            for (int cls = KVKEY_BLOCK; cls <= KVKEY_WINDOW; cls++) {
                obj *o = &os.o[os.n++];
                o->key = keys[k];
                o->cls = cls;
                o->st = kvc_get1(c, cls, &keys[k], buf, OBJ_CAP, &o->bytes, &err);
                cr_assert(o->st == DI_OK || o->st == DI_ENOENT, "get: %s", err.msg);
                if (o->st == DI_OK) {
                    o->data = malloc(o->bytes);
                    cr_assert(o->data);
                    memcpy(o->data, buf, o->bytes);
                }
            }
    }
    for (size_t k = 0; wipe && k < os.n; k++) {
        di_error err;
        if (os.o[k].st == DI_OK) {
            di_status st = kvc_delete1(c, os.o[k].cls, &os.o[k].key, &err);
            cr_assert(st == DI_OK || st == DI_ENOENT, "delete: %s", err.msg);
        }
    }
    free(buf);
    kvc_close(c);
    return os;
}

static void objset_free(objset *os)
{
    for (size_t k = 0; k < os->n; k++)
        free(os->o[k].data);
    free(os->o);
}

static size_t objset_count(const objset *os, int cls)
{
    size_t n = 0;
    for (size_t k = 0; k < os->n; k++)
        n += os->o[k].st == DI_OK && os->o[k].cls == cls;
    return n;
}

static bool same_presence(const objset *a, const objset *b)
{
    bool same = a->n == b->n;
    for (size_t k = 0; same && k < a->n; k++)
        same = a->o[k].st == b->o[k].st;
    return same;
}

/* decode stores a response after its stream ended: waits (30 s at most) until the objects
 * under the requests' keys are those of like, or without like until they stop changing (2 s
 * without a change). */
static objset settled_objects(const rig *r, uint64_t model_id, const seen *v, size_t n,
                              const objset *like)
{
    objset prev = read_objects(r, model_id, v, n, false);
    uint64_t until = di_mono_ns() + 30000000000ull, stable_since = di_mono_ns();
    while (di_mono_ns() < until && !(like && same_presence(&prev, like)) &&
           (like || di_mono_ns() - stable_since < 2000000000ull)) {
        usleep(200000);
        objset cur = read_objects(r, model_id, v, n, false);
        if (!same_presence(&cur, &prev))
            stable_since = di_mono_ns();
        objset_free(&prev);
        prev = cur;
    }
    return prev;
}

/* ---- the decode ranks ---- */

/* Waits (10 s at most) until p has every block and slot back and no request. */
static Di__Engine__Load idle_load(const proc *p, const Di__Engine__Load *at_start)
{
    Di__Engine__Load l;
    uint64_t until = di_mono_ns() + 10000000000ull;
    do {
        l = get_load(p, "decode.Decode");
        if (l.free_blocks == at_start->free_blocks && l.free_slots == at_start->free_slots &&
            !l.running && !l.waiting)
            return l;
        usleep(50000);
    } while (di_mono_ns() < until);
    cr_assert_fail("decode at %s: %u free blocks (%u at start), %u free slots (%u), %u running, "
                   "%u waiting", p->target, l.free_blocks, at_start->free_blocks, l.free_slots,
                   at_start->free_slots, l.running, l.waiting);
    return l;
}

/* b (the run with flag) saw what a saw, and left the objects a left. */
static void same_as(const spec *qs, size_t n, const seen *a, const seen *b, const objset *oa,
                    const objset *ob, const char *flag)
{
    for (size_t i = 0; i < n; i++) {
        cr_assert_str_eq(b[i].text, a[i].text, "%s: the %s stream (right) differs", qs[i].name,
                         flag);
        cr_assert_eq(b[i].n_tokens, a[i].n_tokens);
    }
    cr_assert_eq(oa->n, ob->n);
    for (size_t k = 0; k < oa->n; k++) {
        char hex[2 * KVKEY_BYTES + 1];
        kvkey_hex(&oa->o[k].key, hex);
        cr_assert_eq(ob->o[k].st, oa->o[k].st, "%s %s: %s after the synchronous rank, %s after "
                     "%s", kvkey_class_name(oa->o[k].cls), hex, di_status_name(oa->o[k].st),
                     di_status_name(ob->o[k].st), flag);
        if (oa->o[k].st != DI_OK)
            continue;
        cr_assert_eq(ob->o[k].bytes, oa->o[k].bytes);
        cr_assert(!memcmp(ob->o[k].data, oa->o[k].data, oa->o[k].bytes), "%s %s: other bytes "
                  "after %s", kvkey_class_name(oa->o[k].cls), hex, flag);
    }
}

TestSuite(overlap, .init = rig_setup, .fini = rig_teardown, .timeout = 600);

Test(overlap, the_overlap_gives_the_synchronous_streams_and_stored_kv)
{
    rig r = {0};
    rig_start(&r, "0");
    proc ov = {0};
    const char *const extra[] = {"--overlap", NULL};
    r.drain = "300ms"; /* its drain with a stream in flight, at the end */
    engine_spawn(&ov, "decode/di-decode", "decode-overlap", &r, extra);
    r.drain = NULL;
    proc_ready(&ov, "decode-overlap");
    Di__Engine__Load ov0 = get_load(&ov, "decode.Decode");
    uint64_t model_id = model_id_of(&r.decode);

    /* the stop token: the first of a greedy probe of the greedy request's prompt, from its
     * fourth on, that did not come before it */
    spec probe = {.name = "probe", .salt = 11, .len = 300, .max_tokens = 40, .stop = -1};
    seen *pv = calloc(1, sizeof *pv);
    cr_assert(pv);
    run_all(&r, &r.decode, "probe", &probe, 1, pv);
    cr_assert_eq(pv->n_tokens, 300 + 40);
    uint32_t stop_at = 3;
    for (; stop_at < 40; stop_at++) {
        bool before = false;
        for (uint32_t k = 0; k < stop_at; k++)
            before |= pv->tokens[300 + k] == pv->tokens[300 + stop_at];
        if (!before)
            break;
    }
    cr_assert_lt(stop_at, 40, "the probe repeats its first tokens");
    int32_t stop = pv->tokens[300 + stop_at];
    idle_load(&r.decode, &r.load0[1]);
    objset po = settled_objects(&r, model_id, pv, 1, NULL);
    objset_free(&po);
    po = read_objects(&r, model_id, pv, 1, true); /* both runs start from an empty store */
    objset_free(&po);

    const spec qs[] = {
        /* greedy, 300 + 200: response block 2 */
        {.name = "greedy", .salt = 11, .len = 300, .n_logprobs = 2, .max_tokens = 200,
         .stop = -1},
        /* 129 + 150: block 1 */
        {.name = "seeded", .salt = 12, .len = 129, .temperature = 0.8f, .seed = 7,
         .n_logprobs = 3, .max_tokens = 150, .stop = -1},
        /* stops where the probe has the stop id */
        {.name = "stop", .salt = 11, .len = 300, .n_logprobs = 1, .max_tokens = 200,
         .stop = stop},
        {.name = "length", .salt = 13, .len = 60, .temperature = 1.0f, .seed = 3,
         .max_tokens = 7, .stop = -1},
        {.name = "cancel", .salt = 14, .len = 200, .temperature = 0.7f, .seed = 5,
         .n_logprobs = 1, .max_tokens = 400, .stop = -1, .cancel_after = 4},
        {.name = "abort", .salt = 17, .len = 180, .max_tokens = 400, .stop = -1,
         .cancel_after = 5, .by_abort = true},
        /* 250 + 140: blocks 1 and 2 */
        {.name = "seeded2", .salt = 15, .len = 250, .temperature = 0.9f, .seed = 99,
         .max_tokens = 140, .stop = -1},
    };
    size_t n = sizeof qs / sizeof qs[0];
    seen *a = calloc(n, sizeof *a), *b = calloc(n, sizeof *b);
    cr_assert(a && b);

    run_all(&r, &r.decode, "sync", qs, n, a);
    Di__Engine__Load la = idle_load(&r.decode, &r.load0[1]);
    rig_wait_no_handoffs(&r, 10000);
    objset oa = settled_objects(&r, model_id, a, n, NULL);
    objset wa = read_objects(&r, model_id, a, n, true);
    objset_free(&wa);

    run_all(&r, &ov, "overlap", qs, n, b);
    Di__Engine__Load lb = idle_load(&ov, &ov0);
    rig_wait_no_handoffs(&r, 10000);
    objset ob = settled_objects(&r, model_id, b, n, &oa);

    same_as(qs, n, a, b, &oa, &ob, "--overlap");
    cr_assert_eq(a[2].n_tokens, 300 + stop_at + 1, "the stop token ended the request");
    cr_assert(strstr(a[2].text, " f1 "), "finish STOP: %s", a[2].text);
    cr_assert_eq(a[3].n_tokens, 60 + 7, "max_tokens");
    cr_assert_eq(a[4].n_tokens, 200 + 1 + 4, "the cancelled stream's first messages");
    /* the prompts' 5 blocks from prefill, and the response blocks decode stored (greedy's
     * block 2, seeded's block 1, seeded2's blocks 1 and 2) with their window states: the same
     * keys and bytes from both ranks */
    cr_assert_geq(objset_count(&oa, KVKEY_BLOCK), 9, "blocks stored: %zu",
                  objset_count(&oa, KVKEY_BLOCK));
    cr_assert_geq(objset_count(&oa, KVKEY_WINDOW), 3, "window states stored: %zu",
                  objset_count(&oa, KVKEY_WINDOW));
    /* the counters: steps issued ahead on the --overlap rank only */
    cr_assert_gt(la.decode_steps, 0);
    cr_assert_eq(la.steps_issued_ahead, 0, "the synchronous rank issues nothing ahead");
    cr_assert_gt(lb.decode_steps, 0);
    cr_assert_gt(lb.steps_issued_ahead, lb.decode_steps / 2, "%llu of %llu steps issued ahead",
                 (unsigned long long)lb.steps_issued_ahead,
                 (unsigned long long)lb.decode_steps);
    cr_assert_lt(lb.steps_issued_ahead, lb.decode_steps);
    cr_log_info("--overlap: %llu of %llu decode steps issued ahead; %zu blocks and %zu window "
                "states compared", (unsigned long long)lb.steps_issued_ahead,
                (unsigned long long)lb.decode_steps, objset_count(&oa, KVKEY_BLOCK),
                objset_count(&oa, KVKEY_WINDOW));
    cr_assert_eq(lb.store_failures, 0);

    /* a lone stream cancelled: with its step in flight and nothing else to do, the rank still
     * gives its blocks and slot back */
    const spec lone = {.name = "lone", .salt = 16, .len = 140, .max_tokens = 300, .stop = -1,
                       .cancel_after = 3};
    run_all(&r, &ov, "overlap", &lone, 1, b);
    idle_load(&ov, &ov0);
    /* and one that passes its deadline */
    const spec late = {.name = "late", .salt = 18, .len = 100, .max_tokens = 4000, .stop = -1,
                       .deadline_ms = 300};
    run_all(&r, &ov, "overlap", &late, 1, b);
    idle_load(&ov, &ov0);

    /* --ahead alone: the same, and nothing issued ahead */
    objset_free(&ob);
    ob = read_objects(&r, model_id, b, n, true);
    proc ah = {0};
    const char *const extra_ahead[] = {"--ahead", NULL};
    engine_spawn(&ah, "decode/di-decode", "decode-ahead", &r, extra_ahead);
    proc_ready(&ah, "decode-ahead");
    Di__Engine__Load ah0 = get_load(&ah, "decode.Decode");
    run_all(&r, &ah, "ahead", qs, n, b);
    Di__Engine__Load lc = idle_load(&ah, &ah0);
    rig_wait_no_handoffs(&r, 10000);
    objset_free(&ob);
    ob = settled_objects(&r, model_id, b, n, &oa);
    same_as(qs, n, a, b, &oa, &ob, "--ahead");
    cr_assert_gt(lc.decode_steps, 0);
    cr_assert_eq(lc.steps_issued_ahead, 0, "--ahead alone issues nothing ahead");
    cr_assert_eq(proc_stop(&ah), 0, "di-decode --ahead drains and exits 0");

    /* SIGTERM with a stream in flight on the --overlap rank (--drain 300ms): the stream ends
     * with UNAVAILABLE and the rank exits 0 */
    flight f;
    flight_start_at(&f, &r, &ov, "drain-overlap", 40, 4000, 3);
    cr_assert_eq(proc_stop(&ov), 0, "di-decode --overlap drains and exits 0");
    di_error err;
    di_status st = flight_end(&f, &err);
    cr_assert_eq(st, DI_EUNAVAIL, "%s: %s", di_status_name(st), err.msg);

    objset_free(&oa);
    objset_free(&ob);
    free(a);
    free(b);
    free(pv);
    assert_clean(&r);
    rig_stop(&r);
}

/* Runs build/<exe> with args (and a store address nothing listens on); its exit status and
 * stderr. */
static int refused(const char *exe, const char *args, char *err, size_t cap)
{
    char cmd[2048], path[300];
    snprintf(path, sizeof path, "%s/refused.txt", g_dir);
    snprintf(cmd, sizeof cmd, "%s/%s --config tiny --kvstore 127.0.0.1:1 --listen "
             "127.0.0.1:0 %s 2> %s > /dev/null", build_root(), exe, args, path);
    int rc = system(cmd);
    FILE *f = fopen(path, "r");
    size_t n = f ? fread(err, 1, cap - 1, f) : 0;
    if (f)
        fclose(f);
    err[n] = 0;
    return WIFEXITED(rc) ? WEXITSTATUS(rc) : -1;
}

Test(overlap, a_rank_group_drafts_and_prefill_refuse_the_flags)
{
    char err[4096], tok[300], args[600];
    snprintf(tok, sizeof tok, "%s/ep-token", g_dir);
    FILE *f = fopen(tok, "w");
    cr_assert(f);
    fputs("0123456789abcdef0123456789abcdef", f);
    cr_assert_eq(fclose(f), 0);
    snprintf(args, sizeof args, "--nextn 0 --overlap --ep-addr 127.0.0.1:1 --world 2 --rank 0 "
             "--ep-token-file %s", tok);
    cr_assert_eq(refused("decode/di-decode", args, err, sizeof err), 2, "%s", err);
    cr_assert(strstr(err, "--overlap: not with --ep-addr"), "%s", err);
    snprintf(args, sizeof args, "--nextn 0 --ahead --ep-addr 127.0.0.1:1 --world 2 --rank 1 "
             "--ep-token-file %s", tok);
    cr_assert_eq(refused("decode/di-decode", args, err, sizeof err), 2, "%s", err);
    cr_assert(strstr(err, "--ahead: not with --ep-addr"), "%s", err);
    cr_assert_eq(refused("decode/di-decode", "--nextn 3 --overlap", err, sizeof err), 2, "%s",
                 err);
    cr_assert(strstr(err, "--overlap: needs --nextn 0"), "%s", err);
    cr_assert_eq(refused("decode/di-decode", "--overlap", err, sizeof err), 2, "%s", err);
    cr_assert(strstr(err, "--overlap: needs --nextn 0"), "the model's drafts by default: %s",
              err);
    cr_assert_eq(refused("prefill/di-prefill", "--overlap", err, sizeof err), 2, "%s", err);
    cr_assert(strstr(err, "di-prefill: --overlap: prompt steps drain the pipeline"), "%s", err);
    cr_assert_eq(refused("prefill/di-prefill", "--nextn 0 --ahead", err, sizeof err), 2, "%s",
                 err);
    cr_assert(strstr(err, "di-prefill: --ahead:"), "%s", err);
}
