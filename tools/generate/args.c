/* args.c: di-generate's command line as a table of options. */
#include <errno.h>
#include <float.h>
#include <limits.h>
#include <stdlib.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "common/ep/group.h"
#include "common/serve/backend.h"
#include "common/util/hostport.h"
#include "tools/generate/gen.h"

typedef di_status (*opt_fn)(gen_args *a, const char *val, di_error *err);

/* One option: its flag, whether it takes a value, what it does, its --help line. */
typedef struct gen_opt {
    const char *flag;
    const char *metavar;         /* NULL: no value */
    opt_fn set;
    const char *help;
} gen_opt;

static di_status parse_u64(const char *flag, const char *v, uint64_t lo, uint64_t hi,
                           uint64_t *out, di_error *err)
{
    char *end;
    errno = 0;
    unsigned long long x = strtoull(v, &end, 10);
    if (errno || end == v || *end || v[0] == '-' || x < lo || x > hi)
        return di_fail(err, DI_EINVAL, "%s: '%s' is not an integer in [%llu, %llu]", flag, v,
                       (unsigned long long)lo, (unsigned long long)hi);
    *out = x;
    return DI_OK;
}

static di_status o_model(gen_args *a, const char *v, di_error *err)
{
    a->model_dir = v;
    return DI_OK;
}

static di_status o_trust(gen_args *a, const char *v, di_error *err)
{
    (void)v, (void)err;
    a->trust_weights = true;
    return DI_OK;
}

static di_status o_config(gen_args *a, const char *v, di_error *err)
{
    a->config = v;
    return DI_OK;
}

static di_status o_wseed(gen_args *a, const char *v, di_error *err)
{
    return parse_u64("--weights-seed", v, 0, UINT64_MAX, &a->weights_seed, err);
}

static di_status add_prompt(gen_args *a, gen_ids *ids, di_error *err)
{
    gen_ids *n = realloc(a->prompts, (a->n_prompts + 1) * sizeof(gen_ids));
    if (!n) {
        free(ids->ids);
        return di_fail(err, DI_ENOMEM, "prompts");
    }
    a->prompts = n;
    a->prompts[a->n_prompts++] = *ids;
    return DI_OK;
}

static di_status o_ids(gen_args *a, const char *v, di_error *err)
{
    gen_ids ids;
    di_status st = gen_parse_ids(v, &ids, err);
    if (st != DI_OK) {
        di_error_prefix(err, "--ids: ");
        return st;
    }
    return add_prompt(a, &ids, err);
}

static di_status o_prompt(gen_args *a, const char *v, di_error *err)
{
#ifdef DI_HAVE_TOKENIZER
    gen_ids p = {.text = v};
    return add_prompt(a, &p, err);
#else
    return di_fail(err, DI_EUNSUPPORTED, "--prompt needs a build with the tokenizer module "
                   "(PCRE2, utf8proc): give token ids with --ids");
#endif
}

static di_status o_tokenizer(gen_args *a, const char *v, di_error *err)
{
    a->tokenizer = v;
    return DI_OK;
}

static di_status o_no_bos(gen_args *a, const char *v, di_error *err)
{
    a->no_bos = true;
    return DI_OK;
}

static di_status o_ids_file(gen_args *a, const char *v, di_error *err)
{
    return gen_read_prompts(v, a, err);
}

static di_status o_teacher(gen_args *a, const char *v, di_error *err)
{
    free(a->forced.ids);
    di_status st = gen_parse_ids(v, &a->forced, err);
    if (st != DI_OK)
        di_error_prefix(err, "--teacher-force: ");
    a->has_forced = st == DI_OK;
    return st;
}

static di_status o_dump(gen_args *a, const char *v, di_error *err)
{
    a->dump_logits = v;
    return DI_OK;
}

static di_status o_seed(gen_args *a, const char *v, di_error *err)
{
    return parse_u64("--seed", v, 0, UINT64_MAX, &a->params.seed, err);
}

static di_status o_max_tokens(gen_args *a, const char *v, di_error *err)
{
    uint64_t x;
    di_status st = parse_u64("--max-tokens", v, 1, 1u << 24, &x, err);
    a->max_tokens = (uint32_t)x;
    a->max_tokens_set = true;
    return st;
}

static di_status o_ignore_eos(gen_args *a, const char *v, di_error *err)
{
    a->ignore_eos = true;
    return DI_OK;
}

static di_status o_nextn(gen_args *a, const char *v, di_error *err)
{
    uint64_t x;
    di_status st = parse_u64("--nextn", v, 0, 15, &x, err);
    a->nextn = (int32_t)x;
    return st;
}

static di_status o_threads(gen_args *a, const char *v, di_error *err)
{
    uint64_t x;
    di_status st = parse_u64("--threads", v, 1, 256, &x, err);
    a->threads = (uint32_t)x;
    return st;
}

static di_status o_backend(gen_args *a, const char *v, di_error *err)
{
    di_status st = serve_backend_check(v, err);
    if (st == DI_EINVAL)
        di_error_prefix(err, "--backend: ");
    else if (st != DI_OK)
        di_error_prefix(err, "--backend %s: ", v);
    else
        a->backend = v;
    return st;
}

static di_status o_batch_invariant(gen_args *a, const char *v, di_error *err)
{
    a->batch_invariant = true;
    return DI_OK;
}

static di_status o_device(gen_args *a, const char *v, di_error *err)
{
    uint64_t x;
    di_status st = parse_u64("--device", v, 0, 63, &x, err);
    a->device = (int)x;
    a->device_set = true;
    return st;
}

static di_status o_chunk(gen_args *a, const char *v, di_error *err)
{
    uint64_t x;
    di_status st = parse_u64("--chunk", v, 1, 1u << 20, &x, err);
    a->chunk = (uint32_t)x;
    return st;
}

static di_status o_max_len(gen_args *a, const char *v, di_error *err)
{
    return parse_u64("--max-model-len", v, 2, 1ull << 32, &a->max_model_len, err);
}

static di_status o_yoco(gen_args *a, const char *v, di_error *err)
{
    static const char *names[] = {"off", "compact", "mask"};
    for (int i = 0; i < 3; i++)
        if (!strcmp(v, names[i])) {
            a->yoco = (fwd_yoco)i;
            a->yoco_set = true;
            return DI_OK;
        }
    return di_fail(err, DI_EINVAL, "--yoco: '%s' is not off, compact or mask", v);
}

static di_status o_kvstore(gen_args *a, const char *v, di_error *err)
{
    di_status st = di_hostport_parse(v, false, NULL, err);
    if (st != DI_OK) {
        di_error_prefix(err, "--kvstore: ");
        return st;
    }
    a->kvstore = v;
    return DI_OK;
}

static di_status o_kv_token(gen_args *a, const char *v, di_error *err)
{
    a->kvstore_token_file = v;
    return DI_OK;
}

static di_status o_kv_path(gen_args *a, const char *v, di_error *err)
{
    if (strcmp(v, "auto") && strcmp(v, "ucx") && strcmp(v, "grpc"))
        return di_fail(err, DI_EINVAL, "--kvstore-data-path \"%s\": auto, ucx or grpc", v);
    a->kvstore_data_path = v;
    return DI_OK;
}

/* "250ms", "2s" or milliseconds. */
static di_status o_kv_deadline(gen_args *a, const char *v, di_error *err)
{
    char *end;
    errno = 0;
    double x = strtod(v, &end);
    double ms = !strcmp(end, "s") ? x * 1000 : (!*end || !strcmp(end, "ms")) ? x : -1;
    if (errno || end == v || !(ms >= 1 && ms <= 600000))
        return di_fail(err, DI_EINVAL, "--kvstore-deadline: '%s' is not a duration between 1ms "
                       "and 600s (e.g. 500ms, 2s)", v);
    a->kvstore_deadline_ms = (uint32_t)ms;
    return DI_OK;
}

static di_status o_prefill(gen_args *a, const char *v, di_error *err)
{
    if (!*v || !strchr(v, ':'))
        return di_fail(err, DI_EINVAL, "--prefill: '%s' is not HOST:PORT", v);
    a->prefill = v;
    return DI_OK;
}

static di_status o_decode(gen_args *a, const char *v, di_error *err)
{
    if (!*v || !strchr(v, ':'))
        return di_fail(err, DI_EINVAL, "--decode: '%s' is not HOST:PORT", v);
    a->decode = v;
    return DI_OK;
}

static di_status o_engine_token(gen_args *a, const char *v, di_error *err)
{
    a->engine_token_file = v;
    return DI_OK;
}

static di_status o_kv_replay(gen_args *a, const char *v, di_error *err)
{
    a->kvstore_replay = true;
    return DI_OK;
}

static di_status o_kv_every(gen_args *a, const char *v, di_error *err)
{
    uint64_t x;
    di_status st = parse_u64("--kvstore-window-every", v, 0, 1u << 20, &x, err);
    a->kvstore_window_every = (uint32_t)x;
    return st;
}

static di_status o_keep(gen_args *a, const char *v, di_error *err)
{
    uint64_t x;
    di_status st = parse_u64("--keep-tokens", v, 1, 1u << 30, &x, err);
    a->keep_tokens = (uint32_t)x;
    return st;
}

static di_status o_varlen(gen_args *a, const char *v, di_error *err)
{
    a->varlen = true;
    return DI_OK;
}

static di_status o_ahead(gen_args *a, const char *v, di_error *err)
{
    a->ahead = true;
    return DI_OK;
}

static di_status o_overlap(gen_args *a, const char *v, di_error *err)
{
    a->ahead = true;
    a->overlap = true;
    return DI_OK;
}

static di_status o_step_ms(gen_args *a, const char *v, di_error *err)
{
    free(a->step_ms);
    a->step_ms = NULL;
    di_status st = gen_parse_step_ms(v, &a->step_ms, &a->n_step_ms, err);
    if (st != DI_OK)
        di_error_prefix(err, "--step-ms: ");
    return st;
}

static di_status o_sampler_ms(gen_args *a, const char *v, di_error *err)
{
    char *end;
    errno = 0;
    double x = strtod(v, &end);
    if (errno || end == v || *end || !(x >= 0 && x <= VARLEN_MAX_MS))
        return di_fail(err, DI_EINVAL, "--sampler-ms: '%s' is not a time in [0, %g] ms", v,
                       VARLEN_MAX_MS);
    a->sampler_ms = x;
    a->sampler_ms_set = true;
    return DI_OK;
}

static di_status o_json(gen_args *a, const char *v, di_error *err)
{
    a->json = true;
    return DI_OK;
}

static di_status o_quiet(gen_args *a, const char *v, di_error *err)
{
    a->quiet = true;
    return DI_OK;
}

/* parse_u64 into a uint32_t field, written only on success. */
static di_status set_u32(const char *flag, const char *v, uint64_t lo, uint64_t hi, uint32_t *out,
                         di_error *err)
{
    uint64_t x;
    di_status st = parse_u64(flag, v, lo, hi, &x, err);
    if (st == DI_OK)
        *out = (uint32_t)x;
    return st;
}

static di_status o_ep_ranks(gen_args *a, const char *v, di_error *err)
{
    return set_u32("--ep-ranks", v, 1, 64, &a->ep_ranks, err);
}

static di_status o_rank(gen_args *a, const char *v, di_error *err)
{
    if (strcmp(v, "hostname"))
        return set_u32("--rank", v, 0, 255, &a->rank, err);
    char host[256] = "";
    gethostname(host, sizeof host - 1);
    di_status st = ep_rank_from_hostname(host, &a->rank, err);
    if (st != DI_OK)
        di_error_prefix(err, "--rank hostname: ");
    return st;
}

static di_status o_world(gen_args *a, const char *v, di_error *err)
{
    return set_u32("--world", v, 1, 256, &a->world, err);
}

static di_status o_ep_addr(gen_args *a, const char *v, di_error *err)
{
    di_status st = di_hostport_parse(v, false, NULL, err);
    if (st != DI_OK)
        di_error_prefix(err, "--ep-addr: ");
    a->ep_addr = v;
    return st;
}

static di_status o_ep_fd(gen_args *a, const char *v, di_error *err)
{
    uint64_t x;
    di_status st = parse_u64("--ep-listen-fd", v, 3, 65535, &x, err);
    a->ep_listen_fd = (int)x;
    return st;
}

static di_status o_ep_remote(gen_args *a, const char *v, di_error *err)
{
    a->ep_remote = true;
    return DI_OK;
}

static di_status o_ep_token(gen_args *a, const char *v, di_error *err)
{
    a->ep_token_file = v;
    return DI_OK;
}

static di_status o_ep_timeout(gen_args *a, const char *v, di_error *err)
{
    return set_u32("--ep-timeout", v, 1, 3600000, &a->ep_timeout_ms, err);
}

static di_status o_ep_redundant(gen_args *a, const char *v, di_error *err)
{
    return set_u32("--ep-redundant", v, 0, 65536, &a->ep_redundant, err);
}

static di_status o_eplb_interval(gen_args *a, const char *v, di_error *err)
{
    return set_u32("--eplb-interval", v, 1, 1u << 20, &a->eplb_interval, err);
}

static di_status o_ep_transport(gen_args *a, const char *v, di_error *err)
{
    if (strcmp(v, "cpu") && strcmp(v, "nccl"))
        return di_fail(err, DI_EINVAL, "--ep-transport: '%s' is neither cpu nor nccl", v);
    a->ep_nccl = !strcmp(v, "nccl");
    return DI_OK;
}

static di_status o_bench(gen_args *a, const char *v, di_error *err)
{
    if (strcmp(v, "decode"))
        return di_fail(err, DI_EINVAL, "--bench: '%s' is not a benchmark (decode)", v);
    a->bench = true;
    return DI_OK;
}

static di_status o_bench_seqs(gen_args *a, const char *v, di_error *err)
{
    return set_u32("--bench-seqs", v, 1, 4096, &a->bench_seqs, err);
}

static di_status o_bench_context(gen_args *a, const char *v, di_error *err)
{
    return set_u32("--bench-context", v, 1, 1u << 20, &a->bench_context, err);
}

static const gen_opt options[] = {
    {"--model", "DIR", o_model, "checkpoint directory (config.json, index, shards)"},
    {"--trust-weights", NULL, o_trust, "do not verify the checkpoint's checksum manifest "
     "(model.safetensors.sha256.json): the weights fingerprint is read from it, no shard is "
     "hashed, and a damaged shard goes unnoticed"},
    {"--config", "NAME|FILE", o_config,
     "random weights for a shipped config (tiny, small, demo, v41-flash) or a config file; default small"},
    {"--weights-seed", "N", o_wseed, "seed of the random weights (default 0, as di-mkmodel)"},
    {"--ids", "LIST", o_ids, "a prompt as token ids, e.g. 3,17,42 (repeat for more prompts)"},
    {"--ids-file", "FILE", o_ids_file, "one prompt of token ids per line; - reads stdin"},
    {"--prompt", "TEXT", o_prompt, "a prompt as text (needs a tokenizer; repeat for more)"},
    {"--tokenizer", "FILE", o_tokenizer,
     "tokenizer.json for text prompts and output (default: the model directory's, else $DI_TOKENIZER, else the one deploy/local/install-deps.sh fetches)"},
    {"--no-bos", NULL, o_no_bos, "do not prepend the BOS token to text prompts"},
    {"--teacher-force", "LIST", o_teacher,
     "feed these ids as the continuation instead of sampling (default --max-tokens: count + 1)"},
    {"--dump-logits", "FILE", o_dump,
     "JSON lines {\"request\", \"position\", \"logits\"}: raw fp32 logits of every row that "
     "made a token"},
    {"--seed", "N", o_seed, "sampling seed (default 0)"},
    {"--max-tokens", "N", o_max_tokens, "output tokens per prompt (default 16)"},
    {"--ignore-eos", NULL, o_ignore_eos, "do not stop at the end token"},
    {"--nextn", "N", o_nextn, "drafts per decode step (default: the draft block size, 0 without "
     "draft stages)"},
    {"--threads", "N", o_threads, "CPU threads (default 2)"},
    {"--backend", "NAME", o_backend, "where the forward runs: cpu (default) or cuda (a build with "
     "-Dcuda; weights and KV in device memory)"},
    {"--device", "N", o_device, "CUDA device ordinal for --backend cuda (default 0)"},
    {"--batch-invariant", NULL, o_batch_invariant, "--backend cuda: a request's numbers do not "
     "depend on its batch (bit for bit; slower GEMMs); the CPU backend always is"},
    {"--chunk", "N", o_chunk, "prefill tokens per step (default 2048)"},
    {"--max-model-len", "N", o_max_len, "context limit in positions (default: the config's)"},
    {"--yoco", "MODE", o_yoco, "prefill truncation of layers >= the YOCO boundary: off, compact, "
     "mask (default compact, every engine's: a KV store hit is exact only with it; off runs the "
     "full prefill). Part of the KV key; printed at start-up"},
    {"--keep-tokens", "N", o_keep, "YOCO keep window (default 140; at least window + nextn + 1)"},
    {"--kvstore", "HOST:PORT", o_kvstore,
     "reuse cached prompt prefixes from di-kvstore and store the KV computed here"},
    {"--kvstore-token-file", "FILE", o_kv_token, "engine token of the store (default "
     "$DI_KVSTORE_TOKEN)"},
    {"--kvstore-deadline", "DUR", o_kv_deadline, "deadline of each store call (default 2s)"},
    {"--kvstore-data-path", "PATH", o_kv_path, "how KV bytes move: auto (default: UCX to a store "
     "on this host, else inside gRPC), ucx, grpc"},
    {"--kvstore-replay", NULL, o_kv_replay, "when the window state at the hit is missing, replay "
     "128 tokens with clipped windows (faster, but the logits then differ from a full prefill) "
     "instead of resuming at an older window state"},
    {"--kvstore-window-every", "N", o_kv_every, "also store the window state at every Nth "
     "multiple of 128 (default 0: only where a request can resume)"},
    {"--prefill", "HOST:PORT", o_prefill, "send each prompt to this di-prefill, then its "
     "handoff to --decode (no local model)"},
    {"--decode", "HOST:PORT", o_decode, "the di-decode that continues what --prefill computed"},
    {"--engine-token-file", "FILE", o_engine_token, "token for --prefill and --decode (default "
     "$DI_ENGINE_TOKEN)"},
    {"--varlen", NULL, o_varlen, "MTP varlen: each decode step checks only the drafts worth "
     "their rows, from the draft model's confidences and a step-time table"},
    {"--ahead", NULL, o_ahead, "one step ahead: step N+1 is planned before step N's outcome "
     "is processed, and the backend's step_ahead op writes its rows from that outcome "
     "(the synchronous run's outputs; with drafts and sampling the last draws may differ)"},
    {"--overlap", NULL, o_overlap, "--ahead, and a decode step without drafts is issued "
     "before the previous step's outcome is read (the host plans step N+1 while the backend "
     "runs step N; the same outputs)"},
    {"--step-ms", "LIST", o_step_ms, "varlen's step-time table, ROWS:MS,... at the recorded "
     "graph sizes (1, 2, 4, 8, then multiples of 8, up to prompts x (1 + nextn), prompts at "
     "most 64); default: measured at start-up on the run's backend"},
    {"--sampler-ms", "X", o_sampler_ms, "varlen: sampler time per step added to every size "
     "(default 0)"},
    {"--ep-ranks", "N", o_ep_ranks, "expert parallelism: N rank processes on this machine, "
     "prompts spread over them, experts placed across them; prints what one rank prints"},
    {"--rank", "R", o_rank, "run as rank R of a group of --world (rank 0 listens on --ep-addr); "
     "'hostname': the number the host name ends in (a StatefulSet pod behind a headless "
     "Service, whose rank 0 is NAME-0.SERVICE)"},
    {"--world", "N", o_world, "ranks of the group this process joins"},
    {"--ep-addr", "HOST:PORT", o_ep_addr, "where rank 0 of the group listens (loopback unless "
     "--ep-allow-remote)"},
    {"--ep-listen-fd", "FD", o_ep_fd, "rank 0: an inherited socket already listening on "
     "--ep-addr (--ep-ranks passes it)"},
    {"--ep-allow-remote", NULL, o_ep_remote, "let the group meet on a non-loopback address"},
    {"--ep-token-file", "FILE", o_ep_token, "the group token, 16..512 bytes (default "
     "$DI_EP_TOKEN; --ep-ranks makes one)"},
    {"--ep-timeout", "MS", o_ep_timeout, "deadline of the rendezvous and of every exchange "
     "(default 60000)"},
    {"--ep-redundant", "N", o_ep_redundant, "redundant expert slots at least (rounded up so "
     "every rank has as many slots; default 0)"},
    {"--eplb-interval", "N", o_eplb_interval, "re-plan expert placement every N steps from the "
     "measured per-slot counts; a plan that is not better is not applied (default: never)"},
    {"--ep-transport", "cpu|nccl", o_ep_transport, "how the MoE rows and outputs cross: the "
     "group's sockets through host memory (cpu, default) or GPU to GPU with NCCL (nccl: "
     "--backend cuda, one GPU a rank, --device defaults to the rank)"},
    {"--bench", "decode", o_bench, "the decode benchmark: --bench-seqs prompts of "
     "--bench-context tokens, --max-tokens (default 32) each, no end token; prints the decode "
     "step time (median, p90), tokens/s, the exchange's share and moe_lb"},
    {"--bench-seqs", "S", o_bench_seqs, "--bench: sequences (default 8)"},
    {"--bench-context", "C", o_bench_context, "--bench: prompt tokens a sequence (default 64)"},
    {"--json", NULL, o_json, "print the results as one JSON object"},
    {"--quiet", NULL, o_quiet, "no progress on stderr"},
};
#define N_OPTIONS (sizeof(options) / sizeof(options[0]))

/* The sampler's own parameter rows become flags too: top_p -> --top-p. */
static void flag_of(const sampling_param_spec *s, char *out, size_t cap)
{
    snprintf(out, cap, "--%s", s->name);
    for (char *p = out; *p; p++)
        if (*p == '_')
            *p = '-';
}

static di_status set_sampling(gen_args *a, const sampling_param_spec *s, const char *flag,
                              const char *v, di_error *err)
{
    char *end;
    errno = 0;
    double x = strtod(v, &end);
    if (errno || end == v || *end)
        return di_fail(err, DI_EINVAL, "%s: '%s' is not a number", flag, v);
    char *base = (char *)&a->params + s->offset;
    if (s->type == SAMPLING_FIELD_F32) {
        *(float *)base = (float)x;
    } else {
        if (x != (double)(int64_t)x || x < INT32_MIN || x > UINT32_MAX)
            return di_fail(err, DI_EINVAL, "%s: '%s' is not an integer", flag, v);
        if (s->type == SAMPLING_FIELD_I32)
            *(int32_t *)base = (int32_t)x;
        else if (x < 0)
            return di_fail(err, DI_EINVAL, "%s: %s must not be negative", flag, v);
        else
            *(uint32_t *)base = (uint32_t)x;
    }
    return DI_OK;
}

static void usage(void)
{
    printf("usage: di-generate [--model DIR | --config NAME|FILE] --ids LIST [options]\n\n"
           "Generates tokens with the V4.1 forward pass on the CPU: an offline NORMAL engine\n"
           "(scheduler, chunked prefill, speculative decode with the draft model, sampler) in one\n"
           "process. Without --model it runs the small config with random weights from seed 0.\n"
           "Prompts are token ids; without --ids or --ids-file they are read from stdin.\n\n");
    for (size_t i = 0; i < N_OPTIONS; i++) {
        char left[64];
        snprintf(left, sizeof left, "%s%s%s", options[i].flag, options[i].metavar ? " " : "",
                 options[i].metavar ? options[i].metavar : "");
        printf("  %-26s %s\n", left, options[i].help);
    }
    for (size_t i = 0; i < sampling_param_spec_count; i++) {
        char flag[64], left[80];
        flag_of(&sampling_param_specs[i], flag, sizeof flag);
        snprintf(left, sizeof left, "%s X", flag);
        printf("  %-26s %s (default %g)\n", left, sampling_param_specs[i].help,
               sampling_param_specs[i].def);
    }
    printf("  %-26s this text\n", "--help");
}

void gen_args_default(gen_args *a)
{
    memset(a, 0, sizeof(*a));
    a->params = sampling_params_default();
    a->max_tokens = 16;
    a->nextn = -1;
    a->threads = 2;
    a->backend = "cpu";
    a->chunk = 2048;
    a->keep_tokens = 140;
    a->yoco = FWD_YOCO_DEFAULT;
    a->kvstore_deadline_ms = 2000;
    a->ep_listen_fd = -1;
    a->ep_timeout_ms = 60000;
}

void gen_args_free(gen_args *a)
{
    for (uint32_t i = 0; i < a->n_prompts; i++)
        free(a->prompts[i].ids);
    free(a->prompts);
    free(a->forced.ids);
    free(a->kvstore_token);
    a->kvstore_token = NULL;
    free(a->engine_token);
    a->engine_token = NULL;
    free(a->ep_token);
    a->ep_token = NULL;
    free(a->step_ms);
    a->prompts = NULL;
    a->n_prompts = 0;
    a->forced.ids = NULL;
    a->step_ms = NULL;
}

/* The store's window state holds the layers below the YOCO boundary only: a cached prefix is
 * exact when prefill truncates the layers above it (kv_io.h), so --kvstore refuses --yoco off
 * (the default, compact, is what the store needs). The token comes from its file or the
 * environment. */
static di_status kvstore_args(gen_args *a, di_error *err)
{
    if (a->yoco_set && a->yoco == FWD_YOCO_OFF)
        return di_fail(err, DI_EINVAL, "--kvstore needs --yoco compact or mask: the stored window "
                       "state holds the layers below the YOCO boundary only, so a cached prefix "
                       "is exact only when prefill truncates the layers above it");
    if (a->chunk < 128)
        return di_fail(err, DI_EINVAL, "--kvstore needs --chunk 128 or more: prompts are cut at "
                       "every multiple of 128, where the window state is copied");
    const char *env = getenv("DI_KVSTORE_TOKEN");
    if (!a->kvstore_token_file) {
        a->kvstore_token = env && *env ? strdup(env) : NULL;
        return env && *env && !a->kvstore_token ? di_fail(err, DI_ENOMEM, "token") : DI_OK;
    }
    FILE *f = fopen(a->kvstore_token_file, "r");
    if (!f)
        return di_fail(err, DI_EINVAL, "--kvstore-token-file %s: %s", a->kvstore_token_file,
                       strerror(errno));
    char line[512] = "";
    bool got = fgets(line, sizeof line, f) != NULL;
    fclose(f);
    line[strcspn(line, "\r\n")] = 0;
    if (!got || !line[0])
        return di_fail(err, DI_EINVAL, "--kvstore-token-file %s: no token on its first line",
                       a->kvstore_token_file);
    a->kvstore_token = strdup(line);
    return a->kvstore_token ? DI_OK : di_fail(err, DI_ENOMEM, "token");
}

/* The first line of a token file, malloc'd into *out. */
static di_status read_token_file(const char *flag, const char *path, char **out, di_error *err)
{
    FILE *f = fopen(path, "r");
    if (!f)
        return di_fail(err, DI_EINVAL, "%s %s: %s", flag, path, strerror(errno));
    char line[512] = "";
    bool got = fgets(line, sizeof line, f) != NULL;
    fclose(f);
    line[strcspn(line, "\r\n")] = 0;
    if (!got || !line[0])
        return di_fail(err, DI_EINVAL, "%s %s: no token on its first line", flag, path);
    *out = strdup(line);
    return *out ? DI_OK : di_fail(err, DI_ENOMEM, "token");
}

/* --prefill and --decode go together; what runs on the services cannot be set here. */
static di_status remote_args(gen_args *a, di_error *err)
{
    if (!a->prefill || !a->decode)
        return di_fail(err, DI_EINVAL, "--prefill and --decode go together");
    if (a->kvstore || a->dump_logits || a->has_forced || a->varlen || a->nextn >= 0 ||
        a->model_dir || a->config || a->yoco_set)
        return di_fail(err, DI_EINVAL, "with --prefill/--decode the model, --nextn, --yoco, "
                       "--kvstore, --varlen, --teacher-force and --dump-logits are the "
                       "services' settings, not di-generate's");
    if (a->engine_token_file)
        return read_token_file("--engine-token-file", a->engine_token_file, &a->engine_token,
                               err);
    const char *env = getenv("DI_ENGINE_TOKEN");
    a->engine_token = env && *env ? strdup(env) : NULL;
    return env && *env && !a->engine_token ? di_fail(err, DI_ENOMEM, "token") : DI_OK;
}

/* --bench decode: the workload's prompts (ids in [3, 1003), the same on every rank, so that
 * the launcher passes them on like any), no end token, 32 tokens unless --max-tokens. A rank
 * started by --ep-ranks gets the prompts as --ids and --bench again: they are not made twice. */
static di_status bench_args(gen_args *a, di_error *err)
{
    if (!a->bench)
        return di_fail(err, DI_EINVAL, "--bench-seqs and --bench-context go with --bench decode");
    if (!a->ep_ranks && !a->world)
        return di_fail(err, DI_EINVAL, "--bench decode runs as an expert-parallel group: give "
                       "--ep-ranks N (1 for one rank)");
    if (a->prefill || a->has_forced)
        return di_fail(err, DI_EINVAL, "--bench decode runs without --prefill and "
                       "--teacher-force");
    a->ignore_eos = true;
    if (!a->max_tokens_set)
        a->max_tokens = 32;
    if (a->world)
        return DI_OK; /* a rank: the launcher passed the prompts */
    if (a->n_prompts)
        return di_fail(err, DI_EINVAL, "--bench decode makes its own prompts: give no --ids, "
                       "--ids-file or --prompt");
    uint32_t S = a->bench_seqs ? a->bench_seqs : 8, C = a->bench_context ? a->bench_context : 64;
    uint64_t x = 0x9e3779b97f4a7c15ull;
    for (uint32_t i = 0; i < S; i++) {
        gen_ids ids = {.ids = malloc((size_t)C * sizeof(int32_t)), .n = C};
        if (!ids.ids)
            return di_fail(err, DI_ENOMEM, "benchmark prompts");
        for (uint32_t k = 0; k < C; k++) {
            x ^= x << 13, x ^= x >> 7, x ^= x << 17;
            ids.ids[k] = (int32_t)(3 + x % 1000);
        }
        di_status st = add_prompt(a, &ids, err);
        if (st != DI_OK)
            return st;
    }
    return DI_OK;
}

/* --ep-ranks launches, --rank/--world joins; what the ranks cannot do yet is refused. */
static di_status ep_args(gen_args *a, di_error *err)
{
    if (a->ep_ranks && a->world)
        return di_fail(err, DI_EINVAL, "--ep-ranks starts the ranks itself: give it without "
                       "--rank/--world");
    if (a->world && a->rank >= a->world)
        return di_fail(err, DI_EINVAL, "--rank %u is not below --world %u", a->rank, a->world);
    if (a->world > 1 && !a->ep_addr)
        return di_fail(err, DI_EINVAL, "--world %u needs --ep-addr HOST:PORT of rank 0",
                       a->world);
    if (a->ep_listen_fd >= 0 && (a->rank != 0 || !a->world))
        return di_fail(err, DI_EINVAL, "--ep-listen-fd is rank 0's");
    if (a->kvstore || a->prefill || a->dump_logits || a->varlen || a->params.n_logprobs)
        return di_fail(err, DI_EINVAL, "expert parallelism runs without --kvstore, --prefill, "
                       "--dump-logits, --varlen and --logprobs");
    if (a->ep_nccl && strcmp(a->backend, "cuda"))
        return di_fail(err, DI_EINVAL, "--ep-transport nccl needs --backend cuda");
    if (a->ep_nccl && a->world && !a->device_set)
        a->device = (int)a->rank; /* one GPU a rank */
    if (a->world <= 1)
        return DI_OK;
    if (a->ep_token_file)
        return read_token_file("--ep-token-file", a->ep_token_file, &a->ep_token, err);
    const char *env = getenv("DI_EP_TOKEN");
    if (!env || !*env)
        return di_fail(err, DI_EINVAL, "a rank of a group needs the group token: "
                       "--ep-token-file FILE or $DI_EP_TOKEN");
    a->ep_token = strdup(env);
    return a->ep_token ? DI_OK : di_fail(err, DI_ENOMEM, "token");
}

di_status gen_args_parse(int argc, char **argv, gen_args *a, di_error *err)
{
    a->argc = argc;
    a->argv = argv;
    for (int i = 1; i < argc; i++) {
        const char *arg = argv[i];
        if (!strcmp(arg, "--help") || !strcmp(arg, "-h")) {
            usage();
            return DI_ECANCELED;
        }
        const gen_opt *o = NULL;
        for (size_t k = 0; k < N_OPTIONS && !o; k++)
            if (!strcmp(arg, options[k].flag))
                o = &options[k];
        const sampling_param_spec *sp = NULL;
        char flag[64];
        for (size_t k = 0; k < sampling_param_spec_count && !o && !sp; k++) {
            flag_of(&sampling_param_specs[k], flag, sizeof flag);
            if (!strcmp(arg, flag))
                sp = &sampling_param_specs[k];
        }
        if (!o && !sp)
            return di_fail(err, DI_EINVAL, "unknown option '%s' (see --help)", arg);
        const char *val = NULL;
        if (sp || o->metavar) {
            if (i + 1 >= argc)
                return di_fail(err, DI_EINVAL, "%s needs a value", arg);
            val = argv[++i];
        }
        di_status st = sp ? set_sampling(a, sp, arg, val, err) : o->set(a, val, err);
        if (st != DI_OK)
            return st;
    }
    if (a->model_dir && a->config)
        return di_fail(err, DI_EINVAL, "--model and --config exclude each other");
    if (a->yoco != FWD_YOCO_OFF && a->keep_tokens == 0)
        return di_fail(err, DI_EINVAL, "--keep-tokens must be positive");
    if (a->ahead && (a->prefill || a->kvstore || a->ep_ranks || a->world > 1))
        return di_fail(err, DI_EINVAL, "--ahead runs without --prefill, --kvstore and "
                       "expert parallelism");
    if (!a->varlen && (a->step_ms || a->sampler_ms_set))
        return di_fail(err, DI_EINVAL, "--step-ms and --sampler-ms need --varlen");
    if (a->prefill || a->decode) {
        di_status st = remote_args(a, err);
        if (st != DI_OK)
            return st;
    }
    if (a->ep_nccl && !a->ep_ranks && !a->world)
        return di_fail(err, DI_EINVAL, "--ep-transport needs --ep-ranks or --rank/--world");
    if (a->ep_ranks || a->world) {
        di_status st = ep_args(a, err);
        if (st != DI_OK)
            return st;
    }
    if (a->bench || a->bench_seqs || a->bench_context) {
        di_status st = bench_args(a, err);
        if (st != DI_OK)
            return st;
    }
    return a->kvstore ? kvstore_args(a, err) : DI_OK;
}
