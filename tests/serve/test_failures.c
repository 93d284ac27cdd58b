/* Failures of the disaggregated services on loopback (a real di-kvstore, di-prefill and
 * di-decode, tiny model, CPU): a handoff that expires by the store's TTL before decode asks
 * for it; the store killed while a transfer is in flight (decode pulling, prefill putting);
 * cancels at chosen moments (waiting, between prefill chunks, around the handoff, decode
 * loading its KV, between decode tokens), DI_DISAGG_CANCELS of them (200 by default). Each
 * test ends with nothing leaked: both ranks' free blocks and slots back at their start, no
 * request left, no lease and no handoff in the store; and a request after the failure is
 * served. */
#include <criterion/criterion.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/util/clock.h"
#include "tests/serve/rig.h"

TestSuite(failures, .init = rig_setup, .fini = rig_teardown, .timeout = 600);

/* Decodes a prefilled request to its end; its status. */
static di_status decode_all(rpc_client *dc, const char *rid, const uint32_t *ids, uint32_t n,
                            const Di__Prefill__PrefillReply *pr, uint32_t max_tokens,
                            uint32_t *tokens, di_error *err)
{
    rpc_stream *s = decode_open(dc, rid, ids, n, pr, max_tokens);
    int ended;
    di_status st;
    *tokens = stream_read(s, 100000, &ended, &st, err);
    rpc_stream_close(s);
    return st;
}

/* A request that is served to its end after a failure. */
static void one_request_works(rig *r, const char *rid, uint32_t n)
{
    flight f;
    flight_start(&f, r, rid, n, 6, 1);
    di_error err;
    di_status st = flight_end(&f, &err);
    cr_assert_eq(st, DI_OK, "%s after the failure: %s: %s", rid, di_status_name(st), err.msg);
}

static json_int_t stats_int(const rig *r, const char *key)
{
    json_t *j = kvctl_stats(r);
    json_int_t v = json_integer_value(json_object_get(j, key));
    json_decref(j);
    return v;
}

/* ---- a handoff expired by the store's TTL ---- */

/* The store keeps handoffs 3 s: a decode that asks for one 5 s after prefill stored it gets
 * NOT_FOUND naming the expiry (and the decode rank logs it once); one that asks at once is
 * served. The store counts the expiration and holds no handoff; neither rank holds anything. */
Test(failures, a_handoff_expired_by_ttl_is_refused_naming_the_expiry)
{
    static const char *const ttl[] = {"--ttl-handoff", "3s", NULL};
    rig r = {.store_extra = ttl};
    rig_start(&r, "5");
    rpc_client *pc = client(&r.prefill), *dc = client(&r.decode);
    uint32_t ids[300], got;
    prompt_ids(ids, 300, 7);
    di_status st;
    di_error err;
    json_int_t exp0 = stats_int(&r, "expirations");
    Di__Prefill__PrefillReply *pr = prefill(pc, "ttl-late", ids, 300, 8, 30000, &st, &err);
    cr_assert_not_null(pr, "%s", err.msg);
    cr_assert(pr->handoff->handoff_expires_ms > 0 && pr->handoff->store_id,
              "the manifest names the store and the handoff's expiry");
    sleep(5);
    st = decode_all(dc, "ttl-late", ids, 300, pr, 8, &got, &err);
    cr_assert_eq(st, DI_ENOENT, "%s: %s", di_status_name(st), err.msg);
    cr_assert_eq(got, 0);
    cr_assert(strstr(err.msg, "expired in the store"), "the error names the expiry: %s",
              err.msg);
    di__prefill__prefill_reply__free_unpacked(pr, NULL);
    cr_assert_geq(stats_int(&r, "expirations"), exp0 + 1, "the store expired the handoff");
    assert_clean(&r);
    /* within the TTL the same path serves the request */
    pr = prefill(pc, "ttl-soon", ids, 300, 8, 30000, &st, &err);
    cr_assert_not_null(pr, "%s", err.msg);
    st = decode_all(dc, "ttl-soon", ids, 300, pr, 8, &got, &err);
    cr_assert(st == DI_OK && got == 7, "%s: %s (%u tokens)", di_status_name(st), err.msg, got);
    di__prefill__prefill_reply__free_unpacked(pr, NULL);
    /* GetLoad's rates measured the work just done (tests/serve/test_loadrate.c: the window) */
    Di__Engine__Load lp = get_load(&r.prefill, "prefill.Prefill");
    Di__Engine__Load ld = get_load(&r.decode, "decode.Decode");
    cr_assert(lp.prefill_tokens_per_s > 0 && ld.decode_step_ms > 0, "rates %.1f tokens/s, %.2f ms",
              lp.prefill_tokens_per_s, ld.decode_step_ms);
    rpc_client_close(pc);
    rpc_client_close(dc);
    assert_clean(&r);
    rig_stop(&r);
    char cmd[600];
    snprintf(cmd, sizeof cmd, "test $(grep -c 'ttl-late.*expired in the store' %s) -eq 1",
             r.decode.log);
    cr_assert_eq(system(cmd), 0, "decode logs the expiry once (%s)", r.decode.log);
}

/* ---- the store killed with a transfer in flight ---- */

/* Bytes received by the store's gRPC port and not read yet (/proc/net/tcp and tcp6; gRPC's
 * sockets are dual-stack): with the store stopped, what was sent to it since. */
static unsigned long store_unread(const rig *r)
{
    const char *files[2] = {"/proc/net/tcp", "/proc/net/tcp6"};
    unsigned long unread = 0;
    for (int i = 0; i < 2; i++) {
        FILE *f = fopen(files[i], "r");
        if (!f)
            continue;
        char line[512];
        while (fgets(line, sizeof line, f)) {
            unsigned port, state;
            unsigned long rxq;
            if (sscanf(line, " %*u: %*[0-9A-Fa-f]:%x %*[0-9A-Fa-f]:%*x %x %*x:%lx", &port,
                       &state, &rxq) == 3 &&
                (int)port == r->store.port && state == 1 /* ESTABLISHED */)
                unread += rxq;
        }
        fclose(f);
    }
    return unread;
}

/* Stops the store (SIGSTOP); *unread0: the bytes waiting on its port then. */
static void stop_store(rig *r, unsigned long *unread0)
{
    cr_assert_eq(kill(r->store.pid, SIGSTOP), 0);
    usleep(20000);
    *unread0 = store_unread(r);
}

/* Once a call has reached the stopped store (at least 40 more unread bytes on its port: more
 * than an HTTP/2 ping, less than any call's frames), kills it. Returns the time of the kill. */
static uint64_t kill_store_with_a_call_in_flight(rig *r, unsigned long unread0)
{
    uint64_t until = di_mono_ns() + 60000000000ull;
    while (store_unread(r) < unread0 + 40 && di_mono_ns() < until)
        usleep(5000);
    cr_assert_geq(store_unread(r), unread0 + 40, "no call reached the stopped store");
    usleep(100000);
    uint64_t t = di_mono_ns();
    th_store_kill(&r->store);
    return t;
}

/* A Prefill on a thread of its own. */
typedef struct pcall {
    rpc_client *c;
    const char *rid;
    const uint32_t *ids;
    uint32_t n;
    di_status st;
    di_error err;
    Di__Prefill__PrefillReply *pr;
    uint64_t t_end; /* when it returned */
} pcall;

static void *pcall_run(void *arg)
{
    pcall *p = arg;
    p->pr = prefill(p->c, p->rid, p->ids, p->n, 8, 60000, &p->st, &p->err);
    p->t_end = di_mono_ns();
    return NULL;
}

/* The error of a store call cut by the kill: a clear status naming the store, within bound_ms
 * of the kill (a call ends by the ranks' store deadline, 3 s here: the client retries a lease
 * or get that found the store gone until then, so a store back within it costs no request). */
static void assert_store_cut(di_status st, const char *msg, uint64_t t_kill, uint64_t t_end,
                             const char *what, double bound_ms)
{
    double dt = (double)(t_end - t_kill) / 1e6;
    cr_assert(st == DI_EUNAVAIL || st == DI_ETIMEDOUT, "%s: %s: %s", what, di_status_name(st),
              msg);
    cr_assert(strstr(msg, "store"), "%s: the error names the store: %s", what, msg);
    cr_assert_lt(dt, bound_ms, "%s: the error came %.0f ms after the kill (store deadline 3 s, "
                 "bound %.0f ms)", what, dt, bound_ms);
    cr_log_info("%s: %s %.0f ms after the kill: %s", what, di_status_name(st), dt, msg);
}

/* Decode's pull and prefill's put each caught in flight: the store is stopped (SIGSTOP), the
 * call reaches it (unread bytes on its port), then it is killed (SIGKILL). The caller gets a
 * clear error within the store deadline; both ranks free everything; once the store is back
 * the same decode is refused naming the restart, and the next request is served. */
Test(failures, the_store_killed_mid_transfer_fails_the_request_and_leaks_nothing)
{
    rig r = {.kv_deadline = "3s"};
    rig_start(&r, "5");
    one_request_works(&r, "warm", 5); /* both ranks connected to the store */
    rpc_client *pc = client(&r.prefill), *dc = client(&r.decode);
    static uint32_t ids[2048];
    prompt_ids(ids, 2048, 3);
    di_status st;
    di_error err;
    /* decode pulling the KV of a 2,048-token prompt */
    Di__Prefill__PrefillReply *pr = prefill(pc, "kill-pull", ids, 2048, 8, 60000, &st, &err);
    cr_assert_not_null(pr, "%s", err.msg);
    unsigned long unread0;
    stop_store(&r, &unread0);
    rpc_stream *s = decode_open(dc, "kill-pull", ids, 2048, pr, 8);
    uint64_t t_kill = kill_store_with_a_call_in_flight(&r, unread0);
    int ended;
    cr_assert_eq(stream_read(s, 100, &ended, &st, &err), 0);
    cr_assert(ended);
    assert_store_cut(st, err.msg, t_kill, di_mono_ns(), "decode's pull", 9000);
    rpc_stream_close(s);
    /* asked again once the store is back: the handoff went with the store, and decode says so */
    th_store_restart(&r.store);
    s = decode_open(dc, "kill-pull", ids, 2048, pr, 8);
    cr_assert_eq(stream_read(s, 100, &ended, &st, &err), 0);
    cr_assert(ended && st == DI_ENOENT && strstr(err.msg, "the store restarted after prefill"),
              "%s: %s", di_status_name(st), err.msg);
    rpc_stream_close(s);
    di__prefill__prefill_reply__free_unpacked(pr, NULL);
    one_request_works(&r, "after-pull-kill", 300);
    /* prefill putting a 1,500-token prompt's blocks and handoff */
    stop_store(&r, &unread0);
    pcall pcl = {.c = pc, .rid = "kill-put", .ids = ids, .n = 1500};
    pthread_t th;
    cr_assert_eq(pthread_create(&th, NULL, pcall_run, &pcl), 0);
    t_kill = kill_store_with_a_call_in_flight(&r, unread0);
    pthread_join(th, NULL);
    cr_assert_null(pcl.pr, "the prefill must fail");
    cr_assert(strstr(pcl.err.msg, "handoff to the store"), "%s", pcl.err.msg);
    /* the prompt's block puts come first, each job with its 3 attempts (two back-offs, 0.1 and
     * 0.2 s), then the handoff's one attempt: 4 store deadlines, and 6 s of margin */
    assert_store_cut(pcl.st, pcl.err.msg, t_kill, pcl.t_end, "prefill's put", 4 * 3000 + 300 + 6000);
    /* back: the next request is served, nothing is held anywhere */
    th_store_restart(&r.store);
    one_request_works(&r, "after-put-kill", 700);
    rpc_client_close(pc);
    rpc_client_close(dc);
    assert_clean(&r);
    rig_stop(&r);
}

/* ---- cancels at chosen moments ---- */

#define PLEN 512u  /* prompt of the chunk and handoff moments: 2 chunks */
#define BGLEN 768u /* the long prompt a short one waits behind: 3 chunks */

enum { AT_WAITING, AT_CHUNKS, AT_HANDOFF, AT_LOADING, AT_DECODING, N_MOMENTS };
static const char *const k_moment[N_MOMENTS] = {
    "waiting behind another prompt", "between prefill chunks", "around the handoff",
    "decode loading its KV", "between decode tokens"};

/* Outcomes per moment: ended cancelled, served anyway (the cancel came too late). */
typedef struct tally {
    uint32_t cancelled[N_MOMENTS], served[N_MOMENTS];
    double ms[N_MOMENTS]; /* wall time spent on each kind, ms */
} tally;

/* A prefill reply whose caller no longer wants it: decode takes its handoff and the stream is
 * cancelled after one token (what a router does when its client left). */
static void drop_reply(rpc_client *dc, const char *rid, const uint32_t *ids, uint32_t n,
                       Di__Prefill__PrefillReply *pr)
{
    rpc_stream *s = decode_open(dc, rid, ids, n, pr, 8);
    int ended;
    di_status st;
    di_error err;
    stream_read(s, 1, &ended, &st, &err);
    if (!ended)
        rpc_stream_cancel(s);
    rpc_stream_close(s);
    di__prefill__prefill_reply__free_unpacked(pr, NULL);
}

/* A prefill with an Abort after delay_us; its reply or NULL (*st says why). */
static Di__Prefill__PrefillReply *prefill_aborted(rig *r, rpc_client *pc, const char *rid,
                                                  const uint32_t *ids, uint32_t n,
                                                  uint32_t delay_us, di_status *st,
                                                  di_error *err)
{
    aborter ab = {.p = &r->prefill, .method = "/di.prefill.Prefill/Abort", .delay_us = delay_us};
    snprintf(ab.rid, sizeof ab.rid, "%s", rid);
    pthread_t t;
    cr_assert_eq(pthread_create(&t, NULL, abort_later, &ab), 0);
    Di__Prefill__PrefillReply *pr = prefill(pc, rid, ids, n, 8, 60000, st, err);
    pthread_join(t, NULL);
    cr_assert(pr || *st == DI_ECANCELED, "%s: %s: %s", rid, di_status_name(*st), err->msg);
    return pr;
}

/* Counts a prefill's outcome and drops a reply that came anyway. */
static void count_prefill(tally *t, int at, rpc_client *dc, const char *rid,
                          const uint32_t *ids, uint32_t n, Di__Prefill__PrefillReply *pr)
{
    if (!pr) {
        t->cancelled[at]++;
        return;
    }
    t->served[at]++;
    drop_reply(dc, rid, ids, n, pr);
}

/* Cancels at five moments in turn: a short prompt aborted while it waits behind a long one
 * (which is then aborted in its chunks); a PLEN-token prompt (2 chunks of 256) aborted a
 * random 0.5 to 1.5 chunk-times in; one aborted at 0.8 to 1.2 of its prefill time (before,
 * during or after its handoff); decode aborted while its KV pull waits on the store (stopped
 * with SIGSTOP until the Abort is in); decode aborted or its stream cancelled after 1 to 8
 * tokens. Chunk and prefill times are measured first on this machine, then followed. Every
 * call ends served or cancelled, never otherwise; a cancel while loading always ends the stream
 * cancelled; at the end nothing is held anywhere and a request is served. */
Test(failures, cancels_at_chosen_moments_leak_nothing, .timeout = 1800)
{
    rig r = {0};
    rig_start(&r, "5");
    uint32_t n = rig_cancels();
    rpc_client *pc = client(&r.prefill), *dc = client(&r.decode);
    static uint32_t ids[PLEN], bg_ids[BGLEN];
    di_status st;
    di_error err;
    /* the time of a PLEN-token prefill here */
    prompt_ids(ids, PLEN, 1);
    Di__Prefill__PrefillReply *pr = prefill(pc, "calib", ids, PLEN, 8, 60000, &st, &err);
    cr_assert_not_null(pr, "%s", err.msg);
    uint32_t prefill_us = (uint32_t)(pr->compute_ms ? pr->compute_ms : 1) * 1000;
    drop_reply(dc, "calib", ids, PLEN, pr);
    tally t = {0};
    uint32_t seed = 777;
    for (uint32_t i = 0; i < n; i++) {
        seed = seed * 1103515245u + 12345u;
        int at = (int)(i % N_MOMENTS);
        uint64_t t0 = di_mono_ns();
        char rid[32];
        snprintf(rid, sizeof rid, "m%d-%u", at, i);
        if (at == AT_WAITING) {
            char bg[32];
            snprintf(bg, sizeof bg, "bg-%u", i);
            prompt_ids(bg_ids, BGLEN, i + 5000);
            pcall long_one = {.c = client(&r.prefill), .rid = bg, .ids = bg_ids, .n = BGLEN};
            pthread_t th;
            cr_assert_eq(pthread_create(&th, NULL, pcall_run, &long_one), 0);
            usleep(20000 + (seed >> 8) % 20000); /* it is in its first chunks */
            uint32_t len = 1 + (seed >> 12) % 200;
            prompt_ids(ids, len, i);
            pr = prefill_aborted(&r, pc, rid, ids, len, 2000 + (seed >> 4) % 8000, &st, &err);
            count_prefill(&t, at, dc, rid, ids, len, pr);
            aborter ab = {.p = &r.prefill, .method = "/di.prefill.Prefill/Abort"};
            snprintf(ab.rid, sizeof ab.rid, "%s", bg);
            abort_later(&ab);
            pthread_join(th, NULL);
            rpc_client_close(long_one.c);
            cr_assert(long_one.pr || long_one.st == DI_ECANCELED, "%s: %s", bg,
                      long_one.err.msg);
            count_prefill(&t, AT_CHUNKS, dc, bg, bg_ids, BGLEN, long_one.pr);
        } else if (at == AT_CHUNKS || at == AT_HANDOFF) {
            prompt_ids(ids, PLEN, i);
            uint32_t delay = at == AT_CHUNKS ? prefill_us / 2 * (50 + (seed >> 8) % 100) / 100
                                             : prefill_us * (80 + (seed >> 8) % 40) / 100;
            pr = prefill_aborted(&r, pc, rid, ids, PLEN, delay, &st, &err);
            /* the machine's speed drifts: an abort that came after the reply moves the estimate
             * of the prefill time down, one that came before moves it up, so the handoff
             * moment stays near the end of the prefill */
            if (at == AT_HANDOFF)
                prefill_us = pr ? prefill_us / 20 * 19 : prefill_us / 20 * 21;
            count_prefill(&t, at, dc, rid, ids, PLEN, pr);
        } else if (at == AT_LOADING) {
            uint32_t len = 1 + (seed >> 8) % 300;
            prompt_ids(ids, len, i);
            pr = prefill(pc, rid, ids, len, 8, 60000, &st, &err);
            cr_assert_not_null(pr, "%s: %s", rid, err.msg);
            unsigned long unread0;
            stop_store(&r, &unread0);
            rpc_stream *s = decode_open(dc, rid, ids, len, pr, 8);
            uint64_t until = di_mono_ns() + 60000000000ull;
            while (store_unread(&r) < unread0 + 40 && di_mono_ns() < until)
                usleep(2000);
            aborter ab = {.p = &r.decode, .method = "/di.decode.Decode/Abort"};
            snprintf(ab.rid, sizeof ab.rid, "%s", rid);
            abort_later(&ab);
            kill(r.store.pid, SIGCONT);
            int ended;
            cr_assert_eq(stream_read(s, 100, &ended, &st, &err), 0, "%s: tokens after a cancel "
                         "while loading", rid);
            cr_assert(ended && st == DI_ECANCELED, "%s: %s: %s", rid, di_status_name(st),
                      err.msg);
            t.cancelled[at]++;
            rpc_stream_close(s);
            di__prefill__prefill_reply__free_unpacked(pr, NULL);
        } else {
            uint32_t len = 1 + (seed >> 8) % 300, want = 1 + (seed >> 16) % 8;
            prompt_ids(ids, len, i);
            pr = prefill(pc, rid, ids, len, 40, 60000, &st, &err);
            cr_assert_not_null(pr, "%s: %s", rid, err.msg);
            rpc_stream *s = decode_open(dc, rid, ids, len, pr, 40);
            int ended;
            stream_read(s, want, &ended, &st, &err);
            if (!ended && i % 2) {
                rpc_stream_cancel(s);
            } else if (!ended) {
                aborter ab = {.p = &r.decode, .method = "/di.decode.Decode/Abort"};
                snprintf(ab.rid, sizeof ab.rid, "%s", rid);
                abort_later(&ab);
                stream_read(s, 100000, &ended, &st, &err);
                cr_assert(st == DI_OK || st == DI_ECANCELED, "%s: %s: %s", rid,
                          di_status_name(st), err.msg);
            }
            if (st == DI_ECANCELED || !ended)
                t.cancelled[at]++;
            else
                t.served[at]++;
            rpc_stream_close(s);
            di__prefill__prefill_reply__free_unpacked(pr, NULL);
        }
        t.ms[at] += (double)(di_mono_ns() - t0) / 1e6;
    }
    cr_log_info("prefill of %u tokens: %u ms at the end", PLEN, prefill_us / 1000);
    for (int m = 0; m < N_MOMENTS; m++)
        cr_log_info("%-30s %4u cancelled, %4u served (the cancel came late), %.0f ms",
                    k_moment[m], t.cancelled[m], t.served[m], t.ms[m]);
    cr_assert_gt(t.cancelled[AT_WAITING], 0);
    cr_assert_gt(t.cancelled[AT_CHUNKS], 0);
    rpc_client_close(pc);
    rpc_client_close(dc);
    assert_clean(&r);
    one_request_works(&r, "after-cancels", 300);
    assert_clean(&r);
    rig_stop(&r);
}

/* ---- the store killed while KV bytes move ---- */

typedef struct puller {
    kvc_client *c;
    kvc_item *items;
    uint32_t n;
    di_status st;
    di_error err;
    uint64_t t_start, t_end; /* of the get the kill cut */
    atomic_uint done;        /* gets completed before it */
} puller;

/* Gets the items again and again until one fails. */
static void *pull_loop(void *arg)
{
    puller *p = arg;
    for (;;) {
        p->t_start = di_mono_ns();
        p->st = kvc_get(p->c, p->items, p->n, &p->err);
        for (uint32_t i = 0; p->st == DI_OK && i < p->n; i++)
            if (p->items[i].status != DI_OK) {
                p->st = p->items[i].status;
                p->err = p->items[i].error;
            }
        p->t_end = di_mono_ns();
        if (p->st != DI_OK)
            return NULL;
        p->done++;
    }
}

/* The 16,384-token V4.1-Flash pull (16.2 MB) running back to back over UCX while the store is
 * killed at a random moment, most of the time while the bytes move (a pull takes about 10 ms
 * here, its lease a fraction of that): the get that was cut ends by the client's deadline (3 s;
 * shared memory does not report a dead peer), and after a restart the same client puts and
 * pulls again within 20 s. Five kills. */
Test(failures, the_store_killed_while_kv_bytes_move_fails_the_pull_in_its_deadline)
{
    th_store store = {0};
    flash_store_start(&store, "flash");
    kvc_client *c = th_client_deadline(&store, NULL, 3000);
    kvc_store_info info;
    di_error err;
    cr_assert_eq(kvc_info(c, &info, &err), DI_OK, "%s", err.msg);
    static kvc_item items[FLASH_16K_BLOCKS + 1];
    uint8_t *buf = malloc(flash_16k_bytes(&info.geometry));
    cr_assert(buf);
    uint32_t seed = 99;
    for (int kill_no = 0; kill_no < 5; kill_no++) {
        flash_16k_items(&info.geometry, items, buf);
        /* the same client after a restart: its first puts may fail while the store comes
         * back (they saw Connect refused for up to about 6 s while the client slept between
         * retries instead of waiting on its channel), and without a new UCX worker it did not
         * work again within 20 s */
        uint64_t t_put = di_mono_ns(), t_until = t_put + 20000000000ull;
        di_status pst;
        while (((pst = kvc_put(c, items, FLASH_16K_BLOCKS + 1, &err)) == DI_EUNAVAIL || pst == DI_ETIMEDOUT) &&
               di_mono_ns() < t_until) {
            cr_log_info("put %.0f ms after the restart: %s", (double)(di_mono_ns() - t_put) / 1e6,
                        err.msg);
            usleep(100000);
        }
        cr_assert_eq(pst, DI_OK, "%s", err.msg);
        if (kill_no)
            cr_log_info("the client worked again %.0f ms after the restart",
                        (double)(di_mono_ns() - t_put) / 1e6);
        puller p = {.c = c, .items = items, .n = FLASH_16K_BLOCKS + 1};
        pthread_t th;
        cr_assert_eq(pthread_create(&th, NULL, pull_loop, &p), 0);
        uint64_t until = di_mono_ns() + 30000000000ull;
        while (atomic_load(&p.done) < 2 && di_mono_ns() < until)
            usleep(1000);
        seed = seed * 1103515245u + 12345u;
        usleep((seed >> 8) % 15000);
        uint64_t t_kill = di_mono_ns();
        th_store_kill(&store);
        pthread_join(th, NULL);
        double ms = (double)(p.t_end - t_kill) / 1e6;
        cr_log_info("kill %d: %u pulls before; the cut one began %.1f ms before the kill and "
                    "ended %.0f ms after it: %s: %s", kill_no, atomic_load(&p.done),
                    (double)(t_kill - p.t_start) / 1e6, ms, di_status_name(p.st), p.err.msg);
        cr_assert_geq(atomic_load(&p.done), 2, "pulls did not run before the kill");
        cr_assert(p.st == DI_EUNAVAIL || p.st == DI_ETIMEDOUT, "%s: %s", di_status_name(p.st),
                  p.err.msg);
        cr_assert_lt(ms, 3000 + 6000, "the pull ended %.0f ms after the kill (deadline 3 s)",
                     ms);
        th_store_restart(&store);
    }
    free(buf);
    kvc_close(c);
    th_store_stop(&store);
}
