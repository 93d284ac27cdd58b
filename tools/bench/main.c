/* di-bench: a load generator for di-router, like `vllm bench serve`. Sends streamed requests
 * with Poisson or fixed-rate arrivals under a concurrency cap, from random token prompts (with
 * an optional shared prefix) or a JSONL dataset, and reports TTFT, TPOT, ITL and E2E
 * percentiles, throughput and goodput as a table and JSON. --sweep runs several rates and
 * draws latency against rate with gnuplot. Progress goes to stderr. */
#include <jansson.h>
#include <math.h>
#include <pthread.h>
#include <semaphore.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <spawn.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "common/service/options.h"
#include "common/util/clock.h"
#include "common/util/philox.h"
#include "tools/bench/client.h"
#include "tools/bench/stats.h"

extern char **environ;

typedef struct bench_opts {
    const char *host;
    const char *endpoint;
    uint64_t num_prompts;
    double rate;
    const char *arrival;
    uint64_t max_concurrency;
    uint64_t input_len, output_len;
    double range_ratio;
    const char *dataset;
    uint64_t shared_prefix;
    uint64_t seed;
    char *api_key;
    uint64_t slo_ttft_ms, slo_tpot_ms, slo_e2e_ms;
    const char *json_out;
    const char *sweep;
    const char *plot;
    uint64_t timeout_ms;
} bench_opts;

static const svc_opt rows[] = {
    {"host", SVC_OPT_HOSTPORT, offsetof(bench_opts, host), "127.0.0.1:8000", 0, 0, "HOST:PORT",
     "the router's HTTP address", NULL},
    {"endpoint", SVC_OPT_CHOICE, offsetof(bench_opts, endpoint), "/v1/completions", 0, 0, "PATH",
     "the route to load", "/v1/completions"},
    {"num-prompts", SVC_OPT_UINT, offsetof(bench_opts, num_prompts), "100", 1, 1000000, "N",
     "requests to send (per rate)", NULL},
    {"request-rate", SVC_OPT_DOUBLE, offsetof(bench_opts, rate), "0", 0, 1e6, "R",
     "requests per second; 0 sends all at once", NULL},
    {"arrival", SVC_OPT_CHOICE, offsetof(bench_opts, arrival), "poisson", 0, 0, "KIND",
     "gaps between requests: exponential or equal", "poisson|fixed"},
    {"max-concurrency", SVC_OPT_UINT, offsetof(bench_opts, max_concurrency), "0", 0, 100000, "N",
     "requests in flight at most; 0 = no cap", NULL},
    {"input-len", SVC_OPT_UINT, offsetof(bench_opts, input_len), "256", 1, 1048576, "N",
     "random prompts: tokens per prompt", NULL},
    {"output-len", SVC_OPT_UINT, offsetof(bench_opts, output_len), "64", 1, 1048576, "N",
     "random prompts: max_tokens (with ignore_eos)", NULL},
    {"range-ratio", SVC_OPT_DOUBLE, offsetof(bench_opts, range_ratio), "0", 0, 0.99, "R",
     "random lengths uniform in len * [1 - R, 1 + R]", NULL},
    {"dataset", SVC_OPT_FILE, offsetof(bench_opts, dataset), NULL, 0, 0, "FILE",
     "JSONL of {\"prompt\": text or ids, \"max_tokens\": n}; replaces random prompts", NULL},
    {"shared-prefix-len", SVC_OPT_UINT, offsetof(bench_opts, shared_prefix), "0", 0, 1048576,
     "N", "random prompts start with the same N tokens", NULL},
    {"seed", SVC_OPT_UINT, offsetof(bench_opts, seed), "0", 0, 0, "N",
     "prompts and arrivals are a function of it (rate i of --sweep, from 0: seed + i)", NULL},
    {"api-key-file", SVC_OPT_SECRET, offsetof(bench_opts, api_key), NULL, 0, 0, "FILE",
     "bearer token (the file's first line)", "DI_BENCH_API_KEY"},
    {"goodput-ttft", SVC_OPT_DURATION, offsetof(bench_opts, slo_ttft_ms), "0", 0, 0, "DURATION",
     "SLO on TTFT for goodput; 0 = none", NULL},
    {"goodput-tpot", SVC_OPT_DURATION, offsetof(bench_opts, slo_tpot_ms), "0", 0, 0, "DURATION",
     "SLO on TPOT for goodput; 0 = none", NULL},
    {"goodput-e2e", SVC_OPT_DURATION, offsetof(bench_opts, slo_e2e_ms), "0", 0, 0, "DURATION",
     "SLO on end-to-end latency for goodput; 0 = none", NULL},
    {"json", SVC_OPT_OUTFILE, offsetof(bench_opts, json_out), NULL, 0, 0, "FILE",
     "write the results as JSON lines (one per rate)", NULL},
    {"sweep", SVC_OPT_STRING, offsetof(bench_opts, sweep), NULL, 0, 0, "R1,R2,...",
     "run at each request rate in turn", NULL},
    {"plot", SVC_OPT_OUTFILE, offsetof(bench_opts, plot), NULL, 0, 0, "FILE.png",
     "with --sweep: latency against rate, drawn by gnuplot (Debian: gnuplot-nox)", NULL},
    {"timeout", SVC_OPT_DURATION, offsetof(bench_opts, timeout_ms), "600s", 100, 86400000,
     "DURATION", "give up on one request after this", NULL},
};
#define N_ROWS (sizeof rows / sizeof rows[0])

typedef struct job {
    char *body;
    bst_req res;
    double *gaps;
    size_t n_gaps;
} job;

typedef struct run_ctx {
    const bench_opts *o;
    char host[256];
    int port;
    job *jobs;
    size_t n;
    sem_t slots;
    pthread_mutex_t mu;
    size_t done, failed;
} run_ctx;

typedef struct worker_arg {
    run_ctx *rc;
    size_t i;
} worker_arg;

static void *worker(void *arg)
{
    worker_arg *w = arg;
    run_ctx *rc = w->rc;
    job *j = &rc->jobs[w->i];
    bcl_result r;
    bcl_run(rc->host, rc->port, rc->o->endpoint, rc->o->api_key, j->body,
            (double)rc->o->timeout_ms / 1e3, &r);
    j->res = (bst_req){r.ok, r.ttft_s, r.e2e_s, r.in_tok, r.out_tok, r.cached_tok};
    j->gaps = r.gaps;
    j->n_gaps = r.n_gaps;
    pthread_mutex_lock(&rc->mu);
    rc->done++;
    if (!r.ok) {
        if (rc->failed++ == 0)
            fprintf(stderr, "di-bench: request %zu failed: %s\n", w->i, r.err);
    }
    size_t step = rc->n >= 10 ? rc->n / 10 : 1;
    if (rc->done % step == 0 || rc->done == rc->n)
        fprintf(stderr, "di-bench: %zu/%zu done, %zu failed\n", rc->done, rc->n, rc->failed);
    pthread_mutex_unlock(&rc->mu);
    if (rc->o->max_concurrency)
        sem_post(&rc->slots);
    free(w);
    return NULL;
}

static uint32_t vary(uint64_t len, double ratio, di_rng *rng)
{
    double lo = (double)len * (1 - ratio), hi = (double)len * (1 + ratio);
    uint32_t v = (uint32_t)(lo + (hi - lo) * di_rng_uniform(rng));
    return v ? v : 1;
}

/* The request bodies: random token prompts drawn from seed, or the dataset's lines (cycled). */
static int make_bodies(const bench_opts *o, uint64_t seed, job *jobs, size_t n)
{
    di_rng rng;
    di_rng_init(&rng, seed);
    json_t *lines = json_array();
    if (o->dataset) {
        FILE *f = fopen(o->dataset, "r");
        char *line = NULL;
        size_t cap = 0;
        size_t lineno = 0;
        while (f && getline(&line, &cap, f) > 0) {
            lineno++;
            if (line[strspn(line, " \t\r\n")] == '\0')
                continue;
            json_t *v = json_loads(line, 0, NULL);
            if (!json_is_object(v) || !json_object_get(v, "prompt")) {
                fprintf(stderr, "di-bench: --dataset %s line %zu: want {\"prompt\": ...}\n",
                        o->dataset, lineno);
                json_decref(v);
                free(line);
                fclose(f);
                json_decref(lines);
                return -1;
            }
            json_array_append_new(lines, v);
        }
        free(line);
        if (f)
            fclose(f);
        if (json_array_size(lines) == 0) {
            fprintf(stderr, "di-bench: --dataset %s has no request\n", o->dataset);
            json_decref(lines);
            return -1;
        }
    }
    json_t *prefix = json_array();
    for (uint64_t k = 0; k < o->shared_prefix; k++)
        json_array_append_new(prefix, json_integer(1000 + (json_int_t)di_rng_below(&rng, 20000)));
    for (size_t i = 0; i < n; i++) {
        json_t *b;
        if (o->dataset) {
            b = json_deep_copy(json_array_get(lines, i % json_array_size(lines)));
        } else {
            uint32_t in = vary(o->input_len, o->range_ratio, &rng);
            json_t *p = json_deep_copy(prefix);
            for (uint32_t k = 0; k < in; k++)
                json_array_append_new(p, json_integer(1000 + (json_int_t)di_rng_below(&rng, 20000)));
            b = json_pack("{s:o,s:i,s:b,s:f}", "prompt", p, "max_tokens",
                          (int)vary(o->output_len, o->range_ratio, &rng), "ignore_eos", 1,
                          "temperature", 0.0);
        }
        json_object_set_new(b, "stream", json_true());
        json_object_set_new(b, "stream_options", json_pack("{s:b}", "include_usage", 1));
        jobs[i].body = json_dumps(b, JSON_COMPACT);
        json_decref(b);
    }
    json_decref(prefix);
    json_decref(lines);
    return 0;
}

static void sleep_until(uint64_t t_ns)
{
    uint64_t now = di_mono_ns();
    if (t_ns <= now)
        return;
    struct timespec ts = {(time_t)((t_ns - now) / 1000000000ull), (long)((t_ns - now) % 1000000000ull)};
    nanosleep(&ts, NULL);
}

/* One run at one rate, prompts and arrivals drawn from seed; fills rep. Returns 0 or -1. */
static int run_once(const bench_opts *o, double rate, uint64_t seed, bst_report *rep)
{
    run_ctx rc = {.o = o, .n = o->num_prompts};
    di_error e = {0};
    if (svc_parse_hostport(o->host, rc.host, sizeof rc.host, &rc.port, &e) != DI_OK)
        return -1;
    rc.jobs = calloc(rc.n, sizeof *rc.jobs);
    pthread_t *th = calloc(rc.n, sizeof *th);
    if (!rc.jobs || !th || make_bodies(o, seed, rc.jobs, rc.n) != 0) {
        free(rc.jobs);
        free(th);
        return -1;
    }
    pthread_mutex_init(&rc.mu, NULL);
    if (o->max_concurrency)
        sem_init(&rc.slots, 0, (unsigned)o->max_concurrency);
    di_rng rng;
    di_rng_init(&rng, seed ^ 0x5eed);
    fprintf(stderr, "di-bench: %zu requests to %s%s at %g req/s (%s), concurrency %llu\n", rc.n,
            o->host, o->endpoint, rate, rate > 0 ? o->arrival : "all at once",
            (unsigned long long)o->max_concurrency);
    uint64_t t0 = di_mono_ns(), next = t0;
    for (size_t i = 0; i < rc.n; i++) {
        if (rate > 0) {
            double gap = strcmp(o->arrival, "fixed") == 0
                             ? 1.0 / rate
                             : -log(1.0 - di_rng_uniform(&rng)) / rate;
            if (i > 0)
                next += (uint64_t)(gap * 1e9);
            sleep_until(next);
        }
        if (o->max_concurrency)
            sem_wait(&rc.slots);
        worker_arg *w = malloc(sizeof *w);
        *w = (worker_arg){&rc, i};
        if (pthread_create(&th[i], NULL, worker, w) != 0) {
            fprintf(stderr, "di-bench: cannot start a thread for request %zu\n", i);
            free(w);
            rc.n = i;
            break;
        }
    }
    for (size_t i = 0; i < rc.n; i++)
        pthread_join(th[i], NULL);
    double dur = (double)(di_mono_ns() - t0) * 1e-9;
    size_t n_gaps = 0;
    for (size_t i = 0; i < rc.n; i++)
        n_gaps += rc.jobs[i].n_gaps;
    bst_req *reqs = calloc(rc.n ? rc.n : 1, sizeof *reqs);
    double *gaps = calloc(n_gaps ? n_gaps : 1, sizeof *gaps);
    size_t g = 0;
    for (size_t i = 0; i < rc.n; i++) {
        reqs[i] = rc.jobs[i].res;
        if (rc.jobs[i].n_gaps)
            memcpy(gaps + g, rc.jobs[i].gaps, rc.jobs[i].n_gaps * sizeof *gaps);
        g += rc.jobs[i].n_gaps;
        free(rc.jobs[i].gaps);
        free(rc.jobs[i].body);
    }
    bst_slo slo = {o->slo_ttft_ms / 1e3, o->slo_tpot_ms / 1e3, o->slo_e2e_ms / 1e3};
    int rcode = bst_report_of(reqs, rc.n, gaps, n_gaps, dur, &slo, rep);
    free(reqs);
    free(gaps);
    free(rc.jobs);
    free(th);
    if (o->max_concurrency)
        sem_destroy(&rc.slots);
    pthread_mutex_destroy(&rc.mu);
    return rcode;
}

/* Whether gnuplot is an executable file on $PATH. */
static int have_gnuplot(void)
{
    const char *path = getenv("PATH");
    if (!path || !*path)
        return 0;
    char dir[4096];
    while (*path) {
        size_t n = strcspn(path, ":");
        if (n > 0 && n < sizeof dir - 16) {
            snprintf(dir, sizeof dir, "%.*s/gnuplot", (int)n, path);
            if (access(dir, X_OK) == 0)
                return 1;
        }
        path += n;
        if (*path == ':')
            path++;
    }
    return 0;
}

/* Draws the sweep: FILE.png.dat (the figures), FILE.png.gp (the script) and FILE.png, by
 * gnuplot run without a shell. */
static int plot(const bench_opts *o, const double *rates, const bst_report *reps, size_t n)
{
    char dat[4096], gp[4096];
    snprintf(dat, sizeof dat, "%s.dat", o->plot);
    snprintf(gp, sizeof gp, "%s.gp", o->plot);
    FILE *f = fopen(dat, "w");
    if (!f) {
        fprintf(stderr, "di-bench: --plot: cannot write %s\n", dat);
        return -1;
    }
    fprintf(f, "# rate median_ttft_ms p99_ttft_ms median_tpot_ms p99_tpot_ms median_e2e_ms "
               "hit_rate\n");
    for (size_t i = 0; i < n; i++)
        fprintf(f, "%g %g %g %g %g %g %g\n", rates[i], reps[i].ttft.median * 1e3,
                reps[i].ttft.p99 * 1e3, reps[i].tpot.median * 1e3, reps[i].tpot.p99 * 1e3,
                reps[i].e2e.median * 1e3, reps[i].hit_rate);
    if (fclose(f) != 0 || !(f = fopen(gp, "w"))) {
        fprintf(stderr, "di-bench: --plot: cannot write %s\n", gp);
        return -1;
    }
    fprintf(f, "set terminal pngcairo size 900,600\nset output '%s'\n"
               "set xlabel 'request rate (req/s)'\nset ylabel 'latency (ms)'\nset logscale y\n"
               "set key top left\nset grid\n"
               "plot '%s' u 1:2 w lp t 'median TTFT', '' u 1:3 w lp t 'p99 TTFT', "
               "'' u 1:4 w lp t 'median TPOT', '' u 1:5 w lp t 'p99 TPOT'\n",
            o->plot, dat);
    if (fclose(f) != 0) {
        fprintf(stderr, "di-bench: --plot: cannot write %s\n", gp);
        return -1;
    }
    char *argv[] = {"gnuplot", gp, NULL};
    pid_t pid;
    int status = 0;
    if (posix_spawnp(&pid, "gnuplot", NULL, NULL, argv, environ) != 0 ||
        waitpid(pid, &status, 0) != pid || !WIFEXITED(status) || WEXITSTATUS(status) != 0) {
        fprintf(stderr, "di-bench: --plot: gnuplot %s failed; the data is in %s\n", gp, dat);
        return -1;
    }
    fprintf(stderr, "di-bench: plot written to %s (data %s)\n", o->plot, dat);
    return 0;
}

int main(int argc, char **argv)
{
    bench_opts o;
    di_error e = {0};
    int next = 0, help = 0;
    if (svc_opts_defaults(rows, N_ROWS, &o, &e) != DI_OK ||
        svc_opts_parse(rows, N_ROWS, argc, argv, 1, &o, &next, &help, &e) != DI_OK ||
        svc_opts_load_secrets(rows, N_ROWS, &o, &e) != DI_OK) {
        fprintf(stderr, "di-bench: %s\n", e.msg);
        svc_opts_free(rows, N_ROWS, &o);
        return 2;
    }
    if (help) {
        printf("di-bench: load generator for di-router's OpenAI API (streamed requests).\n\n");
        svc_opts_print(stdout, rows, N_ROWS);
        svc_opts_free(rows, N_ROWS, &o);
        return 0;
    }
    if (next < argc) {
        fprintf(stderr, "di-bench: unexpected argument '%s'\n", argv[next]);
        svc_opts_free(rows, N_ROWS, &o);
        return 2;
    }
    double rates[64];
    size_t n_rates = 0;
    if (o.sweep) {
        const char *p = o.sweep;
        while (*p && n_rates < 64) {
            char *end;
            double r = strtod(p, &end);
            if (end == p || !(r > 0) || !isfinite(r) || (*end && *end != ',')) {
                fprintf(stderr, "di-bench: --sweep: want positive rates like 1,2,4\n");
                svc_opts_free(rows, N_ROWS, &o);
                return 2;
            }
            rates[n_rates++] = r;
            p = *end ? end + 1 : end;
        }
    } else {
        if (o.plot) {
            fprintf(stderr, "di-bench: --plot needs --sweep\n");
            svc_opts_free(rows, N_ROWS, &o);
            return 2;
        }
        rates[n_rates++] = o.rate;
    }
    if (o.plot) { /* before any request: a sweep is long to lose at the end */
        if (strpbrk(o.plot, "'\n")) {
            fprintf(stderr, "di-bench: --plot: a path with a quote or a newline is not "
                            "taken\n");
            svc_opts_free(rows, N_ROWS, &o);
            return 2;
        }
        if (!have_gnuplot()) {
            fprintf(stderr, "di-bench: --plot needs gnuplot, which is not on PATH (Debian: "
                            "apt-get install gnuplot-nox)\n");
            svc_opts_free(rows, N_ROWS, &o);
            return 1;
        }
    }
    FILE *js = o.json_out ? fopen(o.json_out, "w") : NULL;
    if (o.json_out && !js) {
        fprintf(stderr, "di-bench: --json %s: cannot write\n", o.json_out);
        svc_opts_free(rows, N_ROWS, &o);
        return 1;
    }
    bst_report reps[64];
    int rc = 0;
    for (size_t i = 0; i < n_rates; i++) {
        /* Each rate its own prompts: a later rate must not find an earlier one's in a cache. */
        if (run_once(&o, rates[i], o.seed + i, &reps[i]) != 0) {
            fprintf(stderr, "di-bench: the run at %g req/s could not be made\n", rates[i]);
            rc = 1;
            break;
        }
        char title[64];
        snprintf(title, sizeof title, "Serving Benchmark Result (%g req/s)", rates[i]);
        bst_print_table(stdout, &reps[i], title);
        if (js)
            bst_print_json(js, &reps[i], rates[i]);
        if (reps[i].completed == 0)
            rc = 1;
    }
    if (js)
        fclose(js);
    if (rc == 0 && o.plot && plot(&o, rates, reps, n_rates) != 0)
        rc = 1;
    svc_opts_free(rows, N_ROWS, &o);
    return rc;
}
