/* ep.c: di-generate as a group of expert-parallel ranks: --ep-ranks starts them, --rank/--world
 * runs one (common/ep does the work: the group, the exchange, placement, EPLB). */
#include <errno.h>
#include <jansson.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <sys/wait.h>
#include <unistd.h>

#include "common/ep/group.h"
#include "common/ep/moe.h"
#include "common/serve/backend.h"
#include "tools/generate/gen.h"
#ifdef DI_HAVE_EP_NCCL
#include "common/ep/nccl_xport.h"
#endif

/* ---- the launcher ---- */

/* Options that give prompts: the launcher passes every prompt explicitly instead (stdin is
 * read once, here). */
static bool prompt_option(const char *s)
{
    return !strcmp(s, "--ids") || !strcmp(s, "--ids-file") || !strcmp(s, "--prompt");
}

/* The command line of rank r: this one without --ep-ranks and the prompt options, then
 * --rank/--world/--ep-addr (and rank 0's socket), then the prompts in order. */
static char **rank_argv(const gen_args *a, uint32_t r, const char *addr, int lfd, char **ids)
{
    size_t cap = (size_t)a->argc + 12 + 2 * (size_t)a->n_prompts;
    char **v = calloc(cap, sizeof(char *));
    if (!v)
        return NULL;
    size_t n = 0;
    static char rank_s[16], world_s[16], fd_s[16];
    v[n++] = a->argv[0];
    for (int i = 1; i < a->argc; i++) {
        if (!strcmp(a->argv[i], "--ep-ranks") || prompt_option(a->argv[i])) {
            i++; /* and its value */
            continue;
        }
        v[n++] = a->argv[i];
    }
    snprintf(rank_s, sizeof rank_s, "%u", r);
    snprintf(world_s, sizeof world_s, "%u", a->ep_ranks);
    v[n++] = "--rank";
    v[n++] = rank_s;
    v[n++] = "--world";
    v[n++] = world_s;
    v[n++] = "--ep-addr";
    v[n++] = (char *)addr;
    if (r == 0) {
        snprintf(fd_s, sizeof fd_s, "%d", lfd);
        v[n++] = "--ep-listen-fd";
        v[n++] = fd_s;
    }
    for (uint32_t i = 0; i < a->n_prompts; i++) {
        v[n++] = a->prompts[i].text ? "--prompt" : "--ids";
        v[n++] = a->prompts[i].text ? (char *)a->prompts[i].text : ids[i];
    }
    return v;
}

/* Prompt i's ids as "1,2,3" (malloc'd). */
static char *ids_text(const gen_ids *p)
{
    if (p->text)
        return NULL;
    size_t cap = (size_t)p->n * 12 + 1, len = 0;
    char *s = malloc(cap);
    for (uint32_t k = 0; s && k < p->n; k++)
        len += (size_t)snprintf(s + len, cap - len, k ? ",%d" : "%d", p->ids[k]);
    return s;
}

di_status gen_ep_launch(const gen_args *a, di_error *err)
{
    uint32_t N = a->ep_ranks;
    if (a->n_prompts == 0)
        return di_fail(err, DI_EINVAL, "no prompt: give --ids, --ids-file or ids on stdin");
    int lfd;
    uint16_t port;
    di_status st = ep_group_listen("127.0.0.1:0", false, &lfd, &port, err);
    if (st != DI_OK)
        return st;
    char addr[32], token[65];
    snprintf(addr, sizeof addr, "127.0.0.1:%u", port);
    uint8_t raw[32];
    if (getrandom(raw, sizeof raw, 0) != (ssize_t)sizeof raw) {
        close(lfd);
        return di_fail(err, DI_EIO, "group token: getrandom: %s", strerror(errno));
    }
    for (int i = 0; i < 32; i++)
        snprintf(token + 2 * i, 3, "%02x", raw[i]);
    char **ids = calloc(a->n_prompts ? a->n_prompts : 1, sizeof(char *));
    pid_t *pids = calloc(N, sizeof(pid_t));
    for (uint32_t i = 0; ids && i < a->n_prompts; i++)
        if (!a->prompts[i].text && !(ids[i] = ids_text(&a->prompts[i])))
            st = di_fail(err, DI_ENOMEM, "prompts");
    if (!ids || !pids)
        st = di_fail(err, DI_ENOMEM, "rank processes");
    fflush(stdout);
    fflush(stderr);
    uint32_t started = 0;
    for (uint32_t r = 0; st == DI_OK && r < N; r++) {
        char **argv = rank_argv(a, r, addr, lfd, ids);
        if (!argv) {
            st = di_fail(err, DI_ENOMEM, "rank processes");
            break;
        }
        pid_t pid = fork();
        if (pid == 0) {
            if (r != 0)
                close(lfd);
            setenv("DI_EP_TOKEN", token, 1);
            execv("/proc/self/exe", argv);
            fprintf(stderr, "di-generate: rank %u: exec: %s\n", r, strerror(errno));
            _exit(127);
        }
        free(argv);
        if (pid < 0) {
            st = di_fail(err, DI_EIO, "starting rank %u: fork: %s", r, strerror(errno));
            break;
        }
        pids[r] = pid;
        started++;
    }
    close(lfd);
    /* wait for every rank; the first failure stops the others */
    uint32_t failed_rank = UINT32_MAX;
    int failed_status = 0;
    for (uint32_t left = started; left > 0;) {
        int ws;
        pid_t pid = waitpid(-1, &ws, 0);
        if (pid < 0) {
            if (errno == EINTR)
                continue;
            break;
        }
        uint32_t r = 0;
        while (r < started && pids[r] != pid)
            r++;
        if (r == started)
            continue; /* not a rank */
        pids[r] = 0;
        left--;
        int code = WIFEXITED(ws) ? WEXITSTATUS(ws) : 128 + WTERMSIG(ws);
        if (code != 0 && failed_rank == UINT32_MAX) {
            failed_rank = r;
            failed_status = code;
            for (uint32_t k = 0; k < started; k++)
                if (pids[k] > 0)
                    kill(pids[k], SIGTERM);
        }
    }
    if (st == DI_OK && started < N)
        st = di_fail(err, DI_EIO, "only %u of %u ranks started", started, N);
    if (st == DI_OK && failed_rank != UINT32_MAX)
        st = di_fail(err, DI_EIO, "rank %u of %u failed (exit status %d; its error is above)",
                     failed_rank, N, failed_status);
    for (uint32_t i = 0; ids && i < a->n_prompts; i++)
        free(ids[i]);
    free(ids);
    free(pids);
    return st;
}

/* ---- one rank ---- */

/* One step of one rank, for --bench: kind, ns, exchange ns, then the pairs its slots served
 * per layer. */
enum { REC_KIND, REC_NS, REC_XCHG, REC_PAIRS };

struct gen_ep {
    ep_group *g;
    ep_moe *moe;
    struct ep_nccl *nccl;        /* the NCCL communicator (--ep-transport nccl), or NULL */
    ep_dev_xport dx;
    bool bench;                  /* record every step */
    uint64_t *rec;               /* [n_rec][REC_PAIRS + layers] */
    uint32_t n_rec, cap_rec;
    uint64_t last_xchg;          /* the exchange's ns at the previous record */
    uint32_t seqs, context, max_tokens, eplb_interval; /* the workload, for the figures */
    uint64_t checkpoint_expert_bytes; /* routed expert bytes the checkpoint load kept */
    vote v;                      /* the scheduler's vote over g */
    uint32_t rank, world;
};

void gen_ep_filter(const gen_args *a, ep_expert_filter *f, model_load_options *lo)
{
    if (!a->world)
        return;
    *f = (ep_expert_filter){.rank = a->rank, .world = a->world,
                            .min_redundant = a->ep_redundant};
    lo->keep_expert = ep_moe_keep_expert;
    lo->keep_expert_userdata = f;
}

di_status gen_ep_open(const gen_args *a, const kern_backend *be, const model_weights *w,
                      gen_ep **out, di_error *err)
{
    gen_ep *ep = calloc(1, sizeof *ep);
    if (!ep)
        return di_fail(err, DI_ENOMEM, "rank group");
    ep->world = a->world ? a->world : 1;
    ep->rank = a->rank;
    ep_group_options go = {.addr = a->ep_addr, .listen_fd = a->ep_listen_fd, .rank = ep->rank,
                           .world = ep->world,
                           .token = a->ep_token ? a->ep_token : "a group of one rank only",
                           .timeout_ms = a->ep_timeout_ms, .allow_remote = a->ep_remote};
    ep->checkpoint_expert_bytes = w->expert_bytes;
    ep->bench = a->bench;
    ep->seqs = a->n_prompts;
    ep->context = a->n_prompts ? a->prompts[0].n : 0;
    ep->max_tokens = a->max_tokens;
    ep->eplb_interval = a->eplb_interval;
    kern_ep_ops xo;
    di_status st = serve_backend_ep_ops(be, &xo, err);
    if (st == DI_OK)
        st = ep_group_join(&go, &ep->g, err);
    if (st == DI_OK && a->ep_nccl) {
#ifdef DI_HAVE_EP_NCCL
        st = ep_nccl_open(ep->g, a->device, a->ep_timeout_ms, &ep->nccl, err);
        if (st == DI_OK)
            ep_nccl_dev_xport(ep->nccl, &ep->dx);
#else
        st = di_fail(err, DI_EINVAL, "--ep-transport nccl: this build has no NCCL (build with "
                     "-Dcuda where the CUDA toolkit has NCCL)");
#endif
    }
    if (st == DI_OK) {
        ep_moe_options mo = {.group = ep->g, .be = be, .dev_ops = &xo, .w = w,
                             .min_redundant = a->ep_redundant,
                             .eplb_interval = a->eplb_interval,
                             .dx = ep->dx.alltoallv ? &ep->dx : NULL};
        st = ep_moe_create(&mo, &ep->moe, err);
    }
    if (st != DI_OK) {
        di_error_prefix(err, "rank %u of %u: ", ep->rank, ep->world);
        gen_ep_close(ep);
        return st;
    }
    ep->v = ep_group_vote(ep->g);
    *out = ep;
    return DI_OK;
}

void gen_ep_close(gen_ep *ep)
{
    if (!ep)
        return;
    ep_moe_free(ep->moe);
#ifdef DI_HAVE_EP_NCCL
    ep_nccl_close(ep->nccl);
#endif
    ep_group_close(ep->g);
    free(ep->rec);
    free(ep);
}

void gen_ep_wire(gen_ep *ep, sched_config *sc, fwd_options *fo)
{
    sc->vote = &ep->v;
    /* an offline group admits prompts as soon as any rank has one: the ALL point would wait
     * for a rank with no prompt left forever (every step of a group looks at the ANY point) */
    sc->prefill_attempt_interval = 1u << 24;
    sc->prefill_any_attempt_interval = 1;
    fo->moe_fn = ep_moe_layer;
    fo->moe_userdata = ep->moe;
}

bool gen_ep_mine(const gen_ep *ep, uint32_t i) { return i % ep->world == ep->rank; }

di_status gen_ep_step_end(gen_ep *ep, di_error *err)
{
    di_status st = ep_moe_step_end(ep->moe, err);
    if (st != DI_OK)
        di_error_prefix(err, "rank %u of %u: ", ep->rank, ep->world);
    return st;
}

di_status gen_ep_note_step(gen_ep *ep, int kind, uint64_t ns, di_error *err)
{
    if (!ep->bench)
        return DI_OK;
    uint32_t L = ep_moe_layers(ep->moe), w = REC_PAIRS + L;
    if (ep->n_rec == ep->cap_rec) {
        uint32_t c = ep->cap_rec ? 2 * ep->cap_rec : 64;
        uint64_t *n = realloc(ep->rec, (size_t)c * w * sizeof(uint64_t));
        if (!n)
            return di_fail(err, DI_ENOMEM, "benchmark records");
        ep->rec = n;
        ep->cap_rec = c;
    }
    uint64_t *r = ep->rec + (size_t)ep->n_rec++ * w;
    uint64_t x = ep_moe_get_stats(ep->moe)->xchg_ns;
    r[REC_KIND] = (uint64_t)kind;
    r[REC_NS] = ns;
    r[REC_XCHG] = x - ep->last_xchg;
    ep->last_xchg = x;
    memcpy(r + REC_PAIRS, ep_moe_last_step_pairs(ep->moe), (size_t)L * sizeof(uint64_t));
    return DI_OK;
}

di_status gen_ep_any_work(gen_ep *ep, sched *s, bool *out, di_error *err)
{
    di_status st = sched_group_has_work(s, out, err);
    if (st != DI_OK)
        di_error_prefix(err, "rank %u of %u: ", ep->rank, ep->world);
    return st;
}

/* ---- outputs to rank 0 ----
 * Per request: u32 index, u32 finish, u32 tokens, u32 error bytes, then the tokens (i32), their
 * logprobs (f32) and the error text. */

typedef struct out_rec {
    uint32_t index, finish, n, err_len;
} out_rec;

static di_status pack_outputs(const gen_ep *ep, const gen_out *outs, uint32_t n, uint8_t **buf,
                              size_t *len, di_error *err)
{
    size_t total = 0;
    for (uint32_t i = 0; i < n; i++)
        if (gen_ep_mine(ep, i))
            total += sizeof(out_rec) + (size_t)outs[i].n * 8 + strlen(outs[i].error);
    uint8_t *b = malloc(total ? total : 1);
    if (!b)
        return di_fail(err, DI_ENOMEM, "outputs of rank %u", ep->rank);
    size_t off = 0;
    for (uint32_t i = 0; i < n; i++) {
        if (!gen_ep_mine(ep, i))
            continue;
        const gen_out *o = &outs[i];
        out_rec r = {i, (uint32_t)o->finish, o->n, (uint32_t)strlen(o->error)};
        memcpy(b + off, &r, sizeof r);
        off += sizeof r;
        memcpy(b + off, o->tokens, (size_t)o->n * 4);
        off += (size_t)o->n * 4;
        memcpy(b + off, o->logprobs, (size_t)o->n * 4);
        off += (size_t)o->n * 4;
        memcpy(b + off, o->error, r.err_len);
        off += r.err_len;
    }
    *buf = b;
    *len = total;
    return DI_OK;
}

static di_status unpack_outputs(const ep_buf *in, uint32_t src, gen_out *outs, uint32_t n,
                                uint32_t world, di_error *err)
{
    const uint8_t *p = in->data;
    size_t off = 0;
    while (off < in->len) {
        out_rec r;
        if (in->len - off < sizeof r)
            return di_fail(err, DI_EPROTO, "rank %u sent truncated outputs", src);
        memcpy(&r, p + off, sizeof r);
        off += sizeof r;
        if (r.index >= n || r.index % world != src || r.err_len >= sizeof outs->error ||
            in->len - off < (size_t)r.n * 8 + r.err_len || r.finish > SCHED_FINISH_HANDOFF)
            return di_fail(err, DI_EPROTO, "rank %u sent a malformed output record", src);
        gen_out *o = &outs[r.index];
        for (uint32_t k = 0; k < r.n; k++) {
            int32_t tok;
            float lp;
            memcpy(&tok, p + off + (size_t)k * 4, 4);
            memcpy(&lp, p + off + (size_t)r.n * 4 + (size_t)k * 4, 4);
            di_status st = gen_out_push(o, tok, lp, err);
            if (st != DI_OK)
                return st;
        }
        off += (size_t)r.n * 8;
        memcpy(o->error, p + off, r.err_len);
        o->error[r.err_len] = 0;
        off += r.err_len;
        o->finish = (sched_finish)r.finish;
    }
    return DI_OK;
}

/* The per-rank counters gathered into the "ep" stats. */
enum { C_PLACEHOLDER, C_STEPS, C_ROUNDS, C_SERVE, C_SENT, C_SERVED, C_MOVED, C_BYTES, C_SLOT,
       C_CKPT, C_XCHG, C_DEV, C_DECTOK, C_COUNT };
static const char *const counter_names[C_COUNT] = {
    "placeholder_steps", "steps", "exchange_rounds", "serve_rounds", "pairs_sent",
    "pairs_served", "experts_received", "expert_bytes_received", "expert_slot_bytes",
    "checkpoint_expert_bytes", "exchange_ns", "device_bytes_sent", "decode_tokens"};

static int cmp_double(const void *x, const void *y)
{
    double a = *(const double *)x, b = *(const double *)y;
    return a < b ? -1 : a > b;
}

/* The q-quantile of v[0..n) (sorted here), nearest rank; 0 when n is 0. */
static double quantile(double *v, uint32_t n, double q)
{
    if (!n)
        return 0;
    qsort(v, n, sizeof *v, cmp_double);
    uint32_t k = (uint32_t)(q * n + 0.999999);
    return v[k ? k - 1 : 0];
}

/* The decode steps' figures from every rank's records (all[W][N][REC_PAIRS + L]): a step is
 * a decode step when no rank prefilled in it and one decoded; its time is the slowest rank's
 * (the ranks are in lockstep); the exchange's share is the ranks' mean time in the exchange
 * over it; moe_lb is the sum over layers of the busiest rank's pairs over the sum of the
 * mean's (each layer waits for its busiest rank). */
static json_t *bench_figures(const gen_ep *ep, const uint64_t *all, uint32_t N, uint32_t L,
                             uint64_t decode_tokens)
{
    uint32_t W = ep->world, w = REC_PAIRS + L, n = 0, nlb = 0;
    double *ms = calloc(N ? N : 1, sizeof(double)), *lb = calloc(N ? N : 1, sizeof(double));
    double step_s = 0, xchg = 0, lb_sum = 0;
    for (uint32_t i = 0; ms && lb && i < N; i++) {
        bool dec = false, pre = false;
        uint64_t t = 0, x = 0;
        for (uint32_t r = 0; r < W; r++) {
            const uint64_t *q = all + ((size_t)r * N + i) * w;
            dec |= q[REC_KIND] == GEN_STEP_DECODE;
            pre |= q[REC_KIND] == GEN_STEP_PREFILL;
            t = q[REC_NS] > t ? q[REC_NS] : t;
            x += q[REC_XCHG];
        }
        if (!dec || pre || !t)
            continue;
        ms[n++] = (double)t / 1e6;
        step_s += (double)t / 1e9;
        xchg += (double)x / W / (double)t;
        double hi = 0, mean = 0;
        for (uint32_t l = 0; l < L; l++) {
            uint64_t mx = 0, sum = 0;
            for (uint32_t r = 0; r < W; r++) {
                uint64_t v = all[((size_t)r * N + i) * w + REC_PAIRS + l];
                mx = v > mx ? v : mx;
                sum += v;
            }
            hi += (double)mx;
            mean += (double)sum / W;
        }
        if (mean > 0) {
            lb[nlb++] = hi / mean;
            lb_sum += hi / mean;
        }
    }
    json_t *o = NULL;
    if (ms && lb)
        o = json_pack("{s:i, s:i, s:i, s:i, s:i, s:s, s:i, s:f, s:f, s:f, s:f, s:f, s:f, s:f}",
                      "ranks", (int)W, "seqs", (int)ep->seqs, "context", (int)ep->context,
                      "max_tokens", (int)ep->max_tokens, "eplb_interval",
                      (int)ep->eplb_interval, "transport", ep->nccl ? "nccl" : "cpu",
                      "decode_steps", (int)n, "step_ms_median", quantile(ms, n, 0.5),
                      "step_ms_p90", quantile(ms, n, 0.9), "tokens_per_s",
                      step_s > 0 ? (double)decode_tokens / step_s : 0.0, "exchange_share",
                      n ? xchg / n : 0.0, "moe_lb_median", quantile(lb, nlb, 0.5),
                      "moe_lb_p90", quantile(lb, nlb, 0.9), "moe_lb_mean",
                      nlb ? lb_sum / nlb : 0.0);
    free(ms);
    free(lb);
    return o;
}

/* --bench: every rank's step records to rank 0, and the figures into stats "bench". */
static di_status gather_bench(gen_ep *ep, uint64_t decode_tokens, json_t *stats, di_error *err)
{
    uint32_t W = ep->world, L = ep_moe_layers(ep->moe), w = REC_PAIRS + L;
    uint64_t N = ep->n_rec;
    di_status st = ep_group_allreduce(ep->g, EP_REDUCE_MAX, &N, 1, err);
    if (st != DI_OK)
        return st;
    if (N * W * w > UINT32_MAX)
        return di_fail(err, DI_ERANGE, "%llu benchmark steps are too many to gather",
                       (unsigned long long)N);
    uint64_t *all = calloc((size_t)(N * W * w) + 1, sizeof(uint64_t));
    if (!all)
        return di_fail(err, DI_ENOMEM, "benchmark records");
    if (ep->n_rec)
        memcpy(all + (size_t)ep->rank * N * w, ep->rec, (size_t)ep->n_rec * w * 8);
    st = ep_group_allreduce(ep->g, EP_REDUCE_SUM, all, (uint32_t)(N * W * w), err);
    if (st == DI_OK && ep->rank == 0 && stats) {
        json_t *b = bench_figures(ep, all, (uint32_t)N, L, decode_tokens);
        if (!b)
            st = di_fail(err, DI_ENOMEM, "benchmark figures");
        else {
            fprintf(stderr, "di-generate: bench decode, %u rank%s (%s), EPLB %s: step %.3f ms "
                    "median, %.3f p90; %.1f tokens/s; exchange %.1f%% of the step; moe_lb "
                    "%.3f median, %.3f p90\n", W, W > 1 ? "s" : "",
                    json_string_value(json_object_get(b, "transport")),
                    ep->eplb_interval ? "on" : "off",
                    json_real_value(json_object_get(b, "step_ms_median")),
                    json_real_value(json_object_get(b, "step_ms_p90")),
                    json_real_value(json_object_get(b, "tokens_per_s")),
                    100 * json_real_value(json_object_get(b, "exchange_share")),
                    json_real_value(json_object_get(b, "moe_lb_median")),
                    json_real_value(json_object_get(b, "moe_lb_p90")));
            json_object_set_new(stats, "bench", b);
        }
    }
    free(all);
    return st;
}

di_status gen_ep_gather(gen_ep *ep, gen_out *outs, uint32_t n, const sched_stats *ss,
                        uint64_t decode_tokens, void *stats_json, bool *print, di_error *err)
{
    uint32_t W = ep->world;
    uint8_t *blob = NULL;
    size_t len = 0;
    di_status st = pack_outputs(ep, outs, n, &blob, &len, err);
    ep_buf *send = calloc(W, sizeof(ep_buf)), *recv = calloc(W, sizeof(ep_buf));
    uint64_t *c = calloc((size_t)W * C_COUNT, sizeof(uint64_t));
    if (st == DI_OK && (!send || !recv || !c))
        st = di_fail(err, DI_ENOMEM, "outputs");
    if (st == DI_OK) {
        if (ep->rank != 0)
            send[0] = (ep_buf){blob, len};
        st = ep_group_alltoallv(ep->g, send, recv, err);
    }
    for (uint32_t s = 1; st == DI_OK && ep->rank == 0 && s < W; s++)
        st = unpack_outputs(&recv[s], s, outs, n, W, err);
    const ep_moe_stats *ms = ep_moe_get_stats(ep->moe);
    if (st == DI_OK) {
        uint64_t *mine = c + (size_t)ep->rank * C_COUNT;
        mine[C_PLACEHOLDER] = ss->placeholder_steps;
        mine[C_STEPS] = ms->steps;
        mine[C_ROUNDS] = ms->rounds;
        mine[C_SERVE] = ms->serve_rounds;
        mine[C_SENT] = ms->pairs_sent;
        mine[C_SERVED] = ms->pairs_served;
        mine[C_MOVED] = ms->experts_moved;
        mine[C_BYTES] = ms->bytes_moved;
        mine[C_SLOT] = ms->slot_bytes;
        mine[C_CKPT] = ep->checkpoint_expert_bytes;
        mine[C_XCHG] = ms->xchg_ns;
        mine[C_DEV] = ms->dev_bytes_sent;
        mine[C_DECTOK] = decode_tokens;
        st = ep_group_allreduce(ep->g, EP_REDUCE_SUM, c, W * C_COUNT, err);
    }
    uint64_t group_tokens = 0;
    for (uint32_t r = 0; st == DI_OK && r < W; r++)
        group_tokens += c[(size_t)r * C_COUNT + C_DECTOK];
    if (st == DI_OK && ep->bench)
        st = gather_bench(ep, group_tokens, ep->rank == 0 ? stats_json : NULL, err);
    if (st == DI_OK && ep->rank == 0 && stats_json) {
        json_t *o = json_pack("{s:i, s:i, s:i, s:I, s:I, s:I, s:I}", "ranks", (int)W,
                              "slots_per_rank", (int)ms->slots_per_rank, "redundant_slots",
                              (int)ms->redundant, "replans", (json_int_t)ms->replans,
                              "layers_replanned", (json_int_t)ms->layers_replanned,
                              "layers_kept", (json_int_t)ms->layers_kept, "replans_reverted",
                              (json_int_t)ms->replans_reverted);
        for (int k = 0; o && k < C_COUNT; k++) {
            json_t *arr = json_array();
            for (uint32_t r = 0; r < W; r++)
                json_array_append_new(arr, json_integer((json_int_t)c[(size_t)r * C_COUNT + k]));
            json_object_set_new(o, counter_names[k], arr);
        }
        json_object_set_new(stats_json, "ep", o);
    }
    if (st != DI_OK)
        di_error_prefix(err, "rank %u of %u: gathering the outputs: ", ep->rank, W);
    free(blob);
    free(send);
    free(recv);
    free(c);
    *print = ep->rank == 0;
    return st;
}
