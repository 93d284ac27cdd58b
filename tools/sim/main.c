/* di-sim: drives the real scheduler with a synthetic workload on simulated time and reports
 * latency, preemptions, cache use, empty steps and the scheduler's own CPU time.
 * Options are one table (below): --help, defaults and validation all come from it. */
#include <errno.h>
#include <jansson.h>
#include <math.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/util/clock.h"
#include "common/util/outclose.h"
#include "tools/sim/sim.h"

typedef struct cli {
    sim_config sim;
    bool json;      /* print JSON instead of text */
    bool quiet;     /* no progress on stderr */
    uint64_t wall0; /* start, for progress */
    uint64_t last;  /* last progress line */
} cli;

typedef enum opt_kind {
    OPT_U32,     /* uint32_t within [min, max] */
    OPT_U64,     /* uint64_t within [min, max] */
    OPT_DOUBLE,  /* double within [min, max] */
    OPT_DIST,    /* sim_dist */
    OPT_ENGINE,  /* sched_engine_type */
    OPT_PREEMPT, /* sched_preempt_mode */
    OPT_TRUE,    /* bool set to true, no value */
    OPT_FALSE,   /* bool set to false, no value */
} opt_kind;

typedef struct opt {
    const char *name;     /* without the leading "--" */
    opt_kind kind;
    size_t offset;        /* of the field in struct cli */
    double min, max;      /* numeric bounds */
    const char *def;      /* default, parsed like a command-line value; NULL for switches */
    const char *help;
} opt;

#define F(field) offsetof(cli, field)
static const opt opts[] = {
    {"requests", OPT_U32, F(sim.requests), 1, 1e7, "1000", "requests in the workload"},
    {"rate", OPT_DOUBLE, F(sim.rate), 0, 1e9, "20",
     "arrivals per second, Poisson (0: all at time 0)"},
    {"prompt-len", OPT_DIST, F(sim.prompt_len), 0, 0, "uniform:128:4096",
     "prompt tokens: N, uniform:MIN:MAX or exp:MEAN; at most --max-model-len - 4 (an exp "
     "draw above it is cut to it, with a warning)"},
    {"output-len", OPT_DIST, F(sim.output_len), 0, 0, "uniform:32:512",
     "output tokens per request (runs to this length, ignoring the end token; cut, with a "
     "warning, where prompt + output would pass --max-model-len - 2)"},
    {"ranks", OPT_U32, F(sim.ranks), 1, 256, "1",
     "DP ranks in lockstep (threads with the CPU vote collective)"},
    {"engine", OPT_ENGINE, F(sim.engine.type), 0, 0, "normal", "normal, prompt or completion"},
    {"blocks", OPT_U32, F(sim.engine.num_blocks), 2, 2147483648.0, "16384",
     "KV blocks of 128 tokens per rank (block 0 included)"},
    {"slots", OPT_U32, F(sim.engine.num_slots), 0, 1048576, "0",
     "state slots per rank (0: 2 x max-num-seqs)"},
    {"max-num-seqs", OPT_U32, F(sim.engine.max_num_seqs), 1, 4096, "64",
     "sequences holding a slot per rank"},
    {"max-batched-tokens", OPT_U32, F(sim.engine.max_num_batched_tokens), 1, 16777216,
     "32768", "prefill token budget per step"},
    {"max-model-len", OPT_U32, F(sim.engine.max_model_len), 8, 67108864, "131072",
     "positions per request"},
    {"max-waiting", OPT_U32, F(sim.engine.max_waiting), 1, 4194304, "4096",
     "waiting requests per rank before the router holds arrivals back"},
    {"nextn", OPT_U32, F(sim.engine.nextn), 0, 15, "5", "drafts per decode step"},
    {"accept", OPT_DOUBLE, F(sim.accept_rate), 0, 1, "0.7",
     "probability each draft passes (stops at the first rejection)"},
    {"accept-spread", OPT_DOUBLE, F(sim.accept_spread), 0, 1, "0",
     "each draft's chance is --accept +- this, a function of the draft token"},
    {"varlen", OPT_TRUE, F(sim.engine.varlen), 0, 0, NULL,
     "MTP varlen: each decode step picks how many drafts each request checks from the draft "
     "confidences and the step-time table (the step-time model at every graph size)"},
    {"conf-bias", OPT_DOUBLE, F(sim.conf_bias), -1, 1, "0",
     "varlen: added to each reported per-draft chance (below 0: under-confident)"},
    {"conf-noise", OPT_DOUBLE, F(sim.conf_noise), 0, 1, "0",
     "varlen: uniform noise of this amplitude on each reported per-draft chance"},
    {"varlen-decode-ms", OPT_DOUBLE, F(sim.varlen_decode_ms), -1, 1e6, "-1",
     "varlen table: the fixed part it assumes (ms); -1: --decode-ms"},
    {"varlen-ms-per-row", OPT_DOUBLE, F(sim.varlen_ms_per_row), -1, 1e6, "-1",
     "varlen table: the per-row figure it assumes (ms); -1: --decode-ms-per-row"},
    {"preempt", OPT_PREEMPT, F(sim.engine.preempt_mode), 0, 0, "stop", "stop or recompute"},
    {"async", OPT_TRUE, F(sim.engine.async), 0, 0, NULL, "one-step-ahead scheduling"},
    {"no-chunked-prefill", OPT_FALSE, F(sim.engine.chunked_prefill), 0, 0, NULL,
     "run prompts whole (a prompt over the budget is rejected)"},
    {"prefill-interval", OPT_U32, F(sim.engine.prefill_attempt_interval), 1, 16777216, "70",
     "decode steps between ALL votes on prefill (NORMAL)"},
    {"prefill-any-interval", OPT_U32, F(sim.engine.prefill_any_attempt_interval), 1, 16777216,
     "100", "decode steps between ANY votes on prefill (NORMAL)"},
    {"cache-threshold", OPT_DOUBLE, F(sim.engine.cache_usage_threshold), 1e-9, 1, "0.9",
     "cache usage above which no prefill or admission starts"},
    {"graph-interval", OPT_U32, F(sim.engine.graph_interval), 1, 4096, "8",
     "recorded graph sizes: powers of 2 up to it, then its multiples"},
    {"decode-ms", OPT_DOUBLE, F(sim.decode_ms), 0, 1e6, "8.8",
     "decode step time: fixed part (ms); 8.8 + 0.0168/row is the explainer's fit"},
    {"decode-ms-per-row", OPT_DOUBLE, F(sim.decode_ms_per_row), 0, 1e6, "0.0168",
     "decode step time per graph row, padding included (ms)"},
    {"prefill-ms", OPT_DOUBLE, F(sim.prefill_ms), 0, 1e6, "24",
     "prompt step time: fixed part (ms); 24 + 0.0107/token fits 68 ms at 4,096 and 376 ms "
     "at 32,768 tokens"},
    {"prefill-ms-per-token", OPT_DOUBLE, F(sim.prefill_ms_per_token), 0, 1e6, "0.0107",
     "prompt step time per token (ms)"},
    {"seed", OPT_U64, F(sim.seed), 0, 1.8446744073709552e19, "1", "seed of every random draw"},
    {"max-steps", OPT_U64, F(sim.max_steps), 1, 1e12, "50000000",
     "stop with an error after this many steps"},
    {"json", OPT_TRUE, F(json), 0, 0, NULL, "print the report as JSON"},
    {"quiet", OPT_TRUE, F(quiet), 0, 0, NULL, "no progress lines on stderr"},
};
#undef F
enum { N_OPTS = sizeof(opts) / sizeof(opts[0]) };

static void usage(FILE *f)
{
    fprintf(f, "usage: di-sim [options]\n"
               "Runs the real scheduler on a synthetic workload in simulated time and reports\n"
               "TTFT/TPOT percentiles, preemptions, cache use, empty steps and the scheduler's\n"
               "CPU time per step. Runs repeat exactly for a given --seed.\n\noptions:\n");
    for (int i = 0; i < N_OPTS; i++) {
        char head[64];
        snprintf(head, sizeof(head), "--%s%s", opts[i].name, opts[i].def ? " V" : "");
        fprintf(f, "  %-24s %s", head, opts[i].help);
        if (opts[i].def)
            fprintf(f, " [%s]", opts[i].def);
        fputc('\n', f);
    }
    fprintf(f, "  %-24s %s\n", "--help", "this text");
}

static int bad(const char *fmt, const char *a, const char *b)
{
    fprintf(stderr, "di-sim: ");
    fprintf(stderr, fmt, a, b);
    fprintf(stderr, " (see --help)\n");
    return -1;
}

/* The whole number v says: exact for plain decimal digits (up to 2^64 - 1), else the value of
 * an integral number below 2^53 ("1e6"). False when it is not one. */
static bool whole_number(const char *v, double d, uint64_t *out)
{
    if (v[0] && v[strspn(v, "0123456789")] == '\0') {
        errno = 0;
        unsigned long long x = strtoull(v, NULL, 10);
        *out = x;
        return errno == 0;
    }
    if (strchr(v, '-') || !(d >= 0 && d == floor(d) && d <= 9007199254740992.0))
        return false;
    *out = (uint64_t)d;
    return true;
}

static int parse_number(const opt *o, const char *v, void *field)
{
    char *end;
    errno = 0;
    double d = strtod(v, &end);
    if (end == v || *end || errno || isnan(d))
        return bad("--%s: '%s' is not a number", o->name, v);
    if (d < o->min || d > o->max) {
        char range[96];
        snprintf(range, sizeof(range), "%s outside [%g, %g]", v, o->min, o->max);
        return bad("--%s: %s", o->name, range);
    }
    if (o->kind == OPT_DOUBLE) {
        *(double *)field = d;
        return 0;
    }
    uint64_t u;
    if (!whole_number(v, d, &u) || (double)u < o->min || (double)u > o->max)
        return bad("--%s: '%s' is not a whole number in range", o->name, v);
    if (o->kind == OPT_U32)
        *(uint32_t *)field = (uint32_t)u;
    else
        *(uint64_t *)field = u;
    return 0;
}

/* Stores value v of option o in c; prints a one-line error and returns -1 when it is bad. */
static int parse_value(const opt *o, const char *v, cli *c)
{
    void *field = (char *)c + o->offset;
    di_error e;
    int k;
    switch (o->kind) {
    case OPT_DIST:
        if (sim_dist_parse(v, field, &e) != DI_OK)
            return bad("--%s: %s", o->name, e.msg);
        return 0;
    case OPT_ENGINE:
        if ((k = sched_engine_type_parse(v)) < 0)
            return bad("--%s: '%s' is not normal, prompt or completion", o->name, v);
        *(sched_engine_type *)field = (sched_engine_type)k;
        return 0;
    case OPT_PREEMPT:
        if ((k = sched_preempt_mode_parse(v)) < 0)
            return bad("--%s: '%s' is not stop or recompute", o->name, v);
        *(sched_preempt_mode *)field = (sched_preempt_mode)k;
        return 0;
    case OPT_TRUE:
    case OPT_FALSE:
        *(bool *)field = o->kind == OPT_TRUE;
        return 0;
    default:
        return parse_number(o, v, field);
    }
}

static const opt *find_opt(const char *name, size_t len)
{
    for (int i = 0; i < N_OPTS; i++)
        if (strlen(opts[i].name) == len && strncmp(opts[i].name, name, len) == 0)
            return &opts[i];
    return NULL;
}

/* The largest length d draws; 0 for exp (unbounded). */
static double dist_max(const sim_dist *d)
{
    return d->kind == SIM_FIXED ? d->a : d->kind == SIM_UNIFORM ? d->b : 0;
}

/* Lengths against --max-model-len: a prompt that cannot fit is an error naming the limit; the
 * documented cuts (the tail of an exp prompt length, outputs past the limit) get a warning. */
static int check_lengths(const cli *c)
{
    const sim_config *s = &c->sim;
    double limit = (double)s->engine.max_model_len - 4; /* a prompt leaves room for 2 outputs */
    double pmax = dist_max(&s->prompt_len), omax = dist_max(&s->output_len);
    if (pmax > limit) {
        fprintf(stderr, "di-sim: --prompt-len: prompts up to %.0f tokens do not fit: at most "
                "%.0f (--max-model-len %u less 4; raise --max-model-len)\n", pmax, limit,
                s->engine.max_model_len);
        return -1;
    }
    if (s->prompt_len.kind == SIM_EXP && exp(-limit / s->prompt_len.a) >= 1e-6)
        fprintf(stderr, "di-sim: warning: --prompt-len exp:%g: about %.2g%% of prompts are cut "
                "to %.0f tokens (--max-model-len %u less 4)\n", s->prompt_len.a,
                100 * exp(-limit / s->prompt_len.a), limit, s->engine.max_model_len);
    if (pmax > 0 && omax > 0 && pmax + omax > limit + 2)
        fprintf(stderr, "di-sim: warning: prompts up to %.0f and outputs up to %.0f tokens pass "
                "--max-model-len %u less 2: such outputs are cut to fit\n", pmax, omax,
                s->engine.max_model_len);
    return 0;
}

/* 0: run; 1: --help printed; -1: bad command line (error printed). */
static int parse_args(int argc, char **argv, cli *c)
{
    sched_config_default(&c->sim.engine);
    for (int i = 0; i < N_OPTS; i++)
        if (opts[i].def && parse_value(&opts[i], opts[i].def, c))
            return -1;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (strcmp(a, "--help") == 0 || strcmp(a, "-h") == 0) {
            usage(stdout);
            return 1;
        }
        if (strncmp(a, "--", 2) != 0)
            return bad("unexpected argument '%s'%s", a, "");
        const char *eq = strchr(a + 2, '=');
        size_t len = eq ? (size_t)(eq - a - 2) : strlen(a + 2);
        const opt *o = find_opt(a + 2, len);
        if (!o)
            return bad("unknown option '%s'%s", a, "");
        bool takes = o->kind != OPT_TRUE && o->kind != OPT_FALSE;
        const char *v = eq ? eq + 1 : NULL;
        if (takes && !v) {
            if (i + 1 >= argc)
                return bad("--%s needs a value%s", o->name, "");
            v = argv[++i];
        }
        if (!takes && v)
            return bad("--%s takes no value%s", o->name, "");
        if (parse_value(o, v ? v : "", c))
            return -1;
    }
    if (c->sim.engine.num_slots == 0)
        c->sim.engine.num_slots = 2 * c->sim.engine.max_num_seqs;
    if (c->sim.engine.preempt_mode == SCHED_PREEMPT_RECOMPUTE &&
        c->sim.engine.type != SCHED_NORMAL)
        return bad("--preempt recompute needs --engine normal%s%s", "", "");
    return check_lengths(c);
}

static void progress(void *ud, double sim_s, uint32_t done, uint32_t total, uint64_t steps)
{
    cli *c = ud;
    uint64_t now = di_mono_ns();
    if (c->quiet || now - c->last < 1000000000ull)
        return;
    c->last = now;
    fprintf(stderr, "di-sim: %.1f s simulated, %u/%u requests done, %llu steps\n", sim_s, done,
            total, (unsigned long long)steps);
}

/* ---- report ---- */

static json_t *pct_json(const sim_pct *p)
{
    return json_pack("{s:f,s:f,s:f,s:f,s:f}", "mean", p->mean, "p50", p->p50, "p90", p->p90,
                     "p99", p->p99, "max", p->max);
}

static json_t *config_json(const cli *c)
{
    const sim_config *s = &c->sim;
    const sched_config *e = &s->engine;
    json_t *o = json_pack("{s:I,s:f,s:I,s:s,s:I,s:I,s:I,s:I,s:I,s:I,s:f,s:s,s:b,s:b,s:f,s:f,s:f,s:f,"
                     "s:I}",
                     "requests", (json_int_t)s->requests, "rate", s->rate, "ranks",
                     (json_int_t)s->ranks, "engine", sched_engine_type_name(e->type), "blocks",
                     (json_int_t)e->num_blocks, "slots", (json_int_t)e->num_slots,
                     "max_num_seqs", (json_int_t)e->max_num_seqs, "max_batched_tokens",
                     (json_int_t)e->max_num_batched_tokens, "max_model_len",
                     (json_int_t)e->max_model_len, "nextn", (json_int_t)e->nextn, "accept",
                     s->accept_rate, "preempt", sched_preempt_mode_name(e->preempt_mode),
                     "async", e->async, "chunked_prefill", e->chunked_prefill, "decode_ms",
                     s->decode_ms, "decode_ms_per_row", s->decode_ms_per_row, "prefill_ms",
                     s->prefill_ms, "prefill_ms_per_token", s->prefill_ms_per_token, "seed",
                     (json_int_t)s->seed);
    if (o)
        json_object_update_new(o, json_pack("{s:b,s:f,s:f,s:f,s:f,s:f}", "varlen", e->varlen,
                                            "accept_spread", s->accept_spread, "conf_bias",
                                            s->conf_bias, "conf_noise", s->conf_noise,
                                            "varlen_decode_ms", s->varlen_decode_ms,
                                            "varlen_ms_per_row", s->varlen_ms_per_row));
    return o;
}

static int print_json(const cli *c, const sim_result *r)
{
    json_t *fin = json_object();
    for (int f = 1; f < SCHED_FINISH_COUNT; f++)
        json_object_set_new(fin, sched_finish_name((sched_finish)f),
                            json_integer(r->by_finish[f]));
    json_t *o = json_pack(
        "{s:o,s:I,s:I,s:I,s:o,s:I,s:I,s:I,s:f,s:f,s:f,s:o,s:o,s:I,s:{s:I,s:I,s:I,s:I,s:I},"
        "s:{s:I,s:I},s:{s:f,s:f},s:f,s:f,s:f,s:o}",
        "config", config_json(c), "requests", (json_int_t)r->requests, "finished",
        (json_int_t)r->finished, "rejected", (json_int_t)r->rejected, "finish", fin,
        "prompt_tokens", (json_int_t)r->prompt_tokens, "output_tokens",
        (json_int_t)r->output_tokens, "output_tokens_expected",
        (json_int_t)r->output_tokens_expected, "sim_seconds", r->sim_seconds,
        "output_tokens_per_second", r->sim_seconds > 0 ? r->output_tokens / r->sim_seconds : 0.0,
        "wall_seconds", r->wall_seconds, "ttft_ms", pct_json(&r->ttft_ms), "tpot_ms",
        pct_json(&r->tpot_ms), "tpot_requests", (json_int_t)r->tpot_count, "steps", "group",
        (json_int_t)r->group_steps, "prompt", (json_int_t)r->prompt_steps, "decode",
        (json_int_t)r->decode_steps, "empty_prompt", (json_int_t)r->empty_prompt_steps,
        "empty_decode", (json_int_t)r->empty_decode_steps, "preemptions", "stop",
        (json_int_t)r->preempted_stop, "recompute", (json_int_t)r->preempted_recompute,
        "cache_usage", "mean", r->cache_usage_mean, "max", r->cache_usage_max,
        "draft_acceptance", r->draft_acceptance, "rows_per_decode_step",
        r->rows_per_decode_step, "padding_rows_per_decode_step",
        r->padding_rows_per_decode_step, "sched_cpu_ns_per_step", pct_json(&r->sched_ns_per_step));
    if (o)
        json_object_update_new(o, json_pack("{s:f,s:I}", "draft_rows_per_request",
                                            r->draft_rows_per_request, "varlen_no_conf",
                                            (json_int_t)r->varlen_no_conf));
    if (!o)
        return fprintf(stderr, "di-sim: cannot build the JSON report\n"), 1;
    char *text = json_dumps(o, JSON_INDENT(2) | JSON_PRESERVE_ORDER);
    json_decref(o);
    if (!text)
        return fprintf(stderr, "di-sim: cannot format the JSON report\n"), 1;
    puts(text);
    free(text);
    return 0;
}

static void print_pct(const char *name, const sim_pct *p, double scale, const char *unit)
{
    printf("  %-9s p50 %9.2f  p90 %9.2f  p99 %9.2f  mean %9.2f  max %9.2f %s\n", name,
           p->p50 * scale, p->p90 * scale, p->p99 * scale, p->mean * scale, p->max * scale, unit);
}

static int print_text(const cli *c, const sim_result *r)
{
    const sched_config *e = &c->sim.engine;
    printf("di-sim: %u requests, %u rank%s, %s engine, nextn %u, accept %.2f, async %s, "
           "varlen %s, preempt %s\n",
           r->requests, c->sim.ranks, c->sim.ranks > 1 ? "s" : "",
           sched_engine_type_name(e->type), e->nextn, c->sim.accept_rate, e->async ? "on" : "off",
           e->varlen ? "on" : "off", sched_preempt_mode_name(e->preempt_mode));
    printf("  simulated %.2f s in %.2f s of wall time; %u finished, %u rejected\n",
           r->sim_seconds, r->wall_seconds, r->finished, r->rejected);
    printf("  finish:");
    for (int f = 1; f < SCHED_FINISH_COUNT; f++)
        if (r->by_finish[f])
            printf(" %s %u", sched_finish_name((sched_finish)f), r->by_finish[f]);
    printf("\n  tokens: %llu prompt, %llu output (expected %llu), %.1f output tokens/s\n",
           (unsigned long long)r->prompt_tokens, (unsigned long long)r->output_tokens,
           (unsigned long long)r->output_tokens_expected,
           r->sim_seconds > 0 ? r->output_tokens / r->sim_seconds : 0.0);
    print_pct("TTFT", &r->ttft_ms, 1, "ms");
    if (r->tpot_count)
        print_pct("TPOT", &r->tpot_ms, 1, "ms");
    else
        printf("  TPOT      n/a (no request produced two tokens here)\n");
    printf("  steps: %llu in lockstep; per rank summed: %llu prompt, %llu decode, %llu empty "
           "prompt, %llu empty decode\n",
           (unsigned long long)r->group_steps, (unsigned long long)r->prompt_steps,
           (unsigned long long)r->decode_steps, (unsigned long long)r->empty_prompt_steps,
           (unsigned long long)r->empty_decode_steps);
    printf("  preemptions: %llu stop, %llu recompute; cache use mean %.1f%%, max %.1f%%\n",
           (unsigned long long)r->preempted_stop, (unsigned long long)r->preempted_recompute,
           100 * r->cache_usage_mean, 100 * r->cache_usage_max);
    printf("  drafts: %.3f of draft rows accepted; %.1f rows per decode step, %.1f padding "
           "rows; %.2f draft rows per request per step\n",
           r->draft_acceptance, r->rows_per_decode_step, r->padding_rows_per_decode_step,
           r->draft_rows_per_request);
    print_pct("sched CPU", &r->sched_ns_per_step, 1e-3, "us per rank step");
    return 0;
}

int main(int argc, char **argv)
{
    static cli c;
    int rc = parse_args(argc, argv, &c);
    if (rc)
        return rc > 0 ? di_close_stdout("di-sim", 0) : 2;
    c.wall0 = c.last = di_mono_ns();
    c.sim.progress = progress;
    c.sim.progress_userdata = &c;
    sim_result r;
    di_error e;
    di_status st = sim_run(&c.sim, &r, &e);
    if (st != DI_OK) {
        fprintf(stderr, "di-sim: %s\n", e.msg);
        return st == DI_EINVAL ? 2 : 1;
    }
    rc = c.json ? print_json(&c, &r) : print_text(&c, &r);
    return di_close_stdout("di-sim", rc);
}
