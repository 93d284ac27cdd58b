/* gen.h: the pieces of di-generate (an offline NORMAL engine in one process). */
#ifndef DI_TOOLS_GENERATE_GEN_H
#define DI_TOOLS_GENERATE_GEN_H

#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>

#include "common/engine/scheduler.h"
#include "common/engine/varlen.h"
#include "common/ep/moe.h"
#include "common/model/forward.h"
#include "common/model/runner_exec.h"
#include "common/sampling/sampler.h"
#include "common/util/status.h"

/* A prompt: token ids, or text to encode once the tokenizer is loaded (ids NULL). */
typedef struct gen_ids {
    int32_t *ids;
    uint32_t n;
    const char *text;            /* --prompt TEXT (borrowed from argv), or NULL */
} gen_ids;

/* Everything the command line sets (defaults in gen_args_default). */
typedef struct gen_args {
    const char *model_dir;       /* --model: a checkpoint directory */
    const char *config;          /* --config: shipped name or file, random weights */
    uint64_t weights_seed;       /* --weights-seed: the random weights' seed */
    gen_ids *prompts;            /* --ids / --ids-file prompts, in order */
    uint32_t n_prompts;
    gen_ids forced;              /* --teacher-force */
    bool has_forced;
    const char *dump_logits;     /* --dump-logits FILE */
    sampling_params params;      /* the sampler's flags, --seed */
    uint32_t max_tokens;         /* --max-tokens */
    bool max_tokens_set;
    bool ignore_eos;             /* --ignore-eos */
    int32_t nextn;               /* --nextn; -1 = the model's draft block size */
    uint32_t threads;            /* --threads */
    const char *backend;         /* --backend: "cpu" or "cuda" (serve_backend_open); borrowed */
    int device;                  /* --device: the CUDA device ordinal */
    bool device_set;             /* --device was given */
    bool batch_invariant;        /* --batch-invariant: a device backend's batch-invariant mode */
    uint32_t chunk;              /* --chunk: prefill tokens per step */
    uint64_t max_model_len;      /* --max-model-len; 0 = the config's limit */
    fwd_yoco yoco;               /* --yoco; FWD_YOCO_DEFAULT */
    bool trust_weights;          /* --trust-weights: the checksum manifest is not verified */
    uint32_t keep_tokens;        /* --keep-tokens */
    bool json;                   /* --json */
    bool quiet;                  /* --quiet */
    const char *tokenizer;       /* --tokenizer FILE; default: the model directory's */
    bool no_bos;                 /* --no-bos: do not prepend BOS to text prompts */
    bool yoco_set;               /* --yoco was given */
    const char *kvstore;         /* --kvstore HOST:PORT, or NULL */
    const char *kvstore_token_file; /* --kvstore-token-file */
    char *kvstore_token;         /* the engine token (from the file or $DI_KVSTORE_TOKEN); owned */
    uint32_t kvstore_deadline_ms; /* --kvstore-deadline */
    const char *kvstore_data_path; /* --kvstore-data-path: auto, ucx, grpc; NULL: auto */
    bool kvstore_replay;         /* --kvstore-replay */
    uint32_t kvstore_window_every; /* --kvstore-window-every */
    bool varlen;                 /* --varlen: MTP varlen in the scheduler */
    bool ahead;                  /* --ahead: one step ahead (sched async, executor ahead) */
    bool overlap;                /* --overlap: --ahead with step N+1 issued before step N is
                                    collected (runner_exec_options.overlap) */
    varlen_graph_time *step_ms;  /* --step-ms: varlen's table (owned); NULL: measured */
    uint32_t n_step_ms;
    double sampler_ms;           /* --sampler-ms: varlen's sampler time per step (ms) */
    bool sampler_ms_set;
    const char *prefill;         /* --prefill HOST:PORT of di-prefill (with --decode), or NULL */
    const char *decode;          /* --decode HOST:PORT of di-decode */
    const char *engine_token_file; /* --engine-token-file */
    char *engine_token;          /* the services' client token (file or $DI_ENGINE_TOKEN); owned */
    uint32_t ep_ranks;           /* --ep-ranks: start this many rank processes here; 0 = none */
    uint32_t rank;               /* --rank: this process's rank in a group of --world */
    uint32_t world;              /* --world: ranks of the group; 0 = not a rank of a group */
    const char *ep_addr;         /* --ep-addr HOST:PORT of rank 0 */
    int ep_listen_fd;            /* --ep-listen-fd: rank 0's inherited listening socket; -1 */
    bool ep_remote;              /* --ep-allow-remote: the group may meet off loopback */
    const char *ep_token_file;   /* --ep-token-file */
    char *ep_token;              /* the group token (file or $DI_EP_TOKEN); owned */
    uint32_t ep_timeout_ms;      /* --ep-timeout: deadline of the rendezvous and each exchange */
    uint32_t ep_redundant;       /* --ep-redundant: redundant expert slots at least */
    uint32_t eplb_interval;      /* --eplb-interval: steps between re-plans; 0 = never */
    bool ep_nccl;                /* --ep-transport nccl: rows and outputs GPU to GPU */
    bool bench;                  /* --bench decode: the fixed decode workload, timed per step */
    uint32_t bench_seqs;         /* --bench-seqs: sequences of the workload */
    uint32_t bench_context;      /* --bench-context: prompt tokens of each */
    int argc;                    /* the command line, for the rank processes (borrowed) */
    char **argv;
} gen_args;

void gen_args_default(gen_args *a);
void gen_args_free(gen_args *a);

/* Parses argv into *a. DI_OK; DI_ECANCELED after printing --help; DI_EINVAL with the offending
 * option in err. */
di_status gen_args_parse(int argc, char **argv, gen_args *a, di_error *err);

/* "3,17,42" (commas and/or blanks) into ids. DI_EINVAL naming the bad entry; an empty list is
 * an error ("empty prompt"). */
di_status gen_parse_ids(const char *text, gen_ids *out, di_error *err);
/* One prompt per non-empty line of a file ("-" = stdin). */
di_status gen_read_prompts(const char *path, gen_args *a, di_error *err);

/* "ROWS:MS,ROWS:MS,..." into a malloc'd table. DI_EINVAL naming the bad entry. */
di_status gen_parse_step_ms(const char *text, varlen_graph_time **out, uint32_t *n,
                            di_error *err);

/* MTP varlen's step-time table for `seqs` sequences with `nextn` drafts on graphs of
 * `interval` (graphs.h): a copy of --step-ms, or measured now on the executor's forward and
 * backend at every recorded graph size (fastest of 3 runs; progress and the table on stderr
 * unless --quiet). DI_OK with *out malloc'd; DI_EINVAL (no drafts to choose); the executor's
 * codes. */
di_status gen_step_table(const gen_args *a, runner_exec *ex, uint32_t seqs, uint32_t nextn,
                         uint32_t interval, varlen_graph_time **out, uint32_t *n,
                         di_error *err);

/* --prefill/--decode: sends each prompt through di-prefill -> store -> di-decode and prints
 * what gen_run prints, with remote timings in stats (remote.c). */
di_status gen_remote_run(const gen_args *a, di_error *err);

/* One request's outputs. */
typedef struct gen_out {
    int32_t *tokens;
    float *logprobs;
    void *tops;                  /* json_t array of {token: logprob} objects, or NULL */
    uint32_t n, cap;
    sched_finish finish;
    char error[320];
} gen_out;

/* Appends one token and its logprob (NAN when unknown). DI_ENOMEM. */
di_status gen_out_push(gen_out *o, int32_t tok, float logprob, di_error *err);

/* ---- expert parallelism (ep.c) ---- */

/* --ep-ranks N: starts N rank processes of this command on this machine (rank 0's socket is
 * bound here, the group token is made here and passed in the environment); rank 0 prints what
 * a one-rank run prints. DI_OK when every rank succeeded; otherwise the first failed rank's
 * exit is reported and the other ranks are stopped. */
di_status gen_ep_launch(const gen_args *a, di_error *err);

typedef struct gen_ep gen_ep;

/* Joins the group of --rank/--world (or a group of one for --ep-ranks 1) and places this
 * rank's experts. DI_OK; the group's and the MoE's codes. */
/* The checkpoint filter of a rank of --world: only the experts of its start-up slots are
 * loaded (lo untouched otherwise). */
void gen_ep_filter(const gen_args *a, ep_expert_filter *f, model_load_options *lo);
di_status gen_ep_open(const gen_args *a, const kern_backend *be, const model_weights *w,
                      gen_ep **out, di_error *err);
void gen_ep_close(gen_ep *ep); /* NULL-safe */
/* The scheduler's vote over the group and the forward's MoE hook. */
void gen_ep_wire(gen_ep *ep, sched_config *sc, fwd_options *fo);
/* Whether prompt i (0-based) runs on this rank. */
bool gen_ep_mine(const gen_ep *ep, uint32_t i);
/* After every step of this rank (placeholders included). */
di_status gen_ep_step_end(gen_ep *ep, di_error *err);
/* After gen_ep_step_end, with --bench: what the step was on this rank (GEN_STEP_*) and how
 * long it took, for the per-step figures. DI_ENOMEM. */
enum { GEN_STEP_NONE, GEN_STEP_DECODE, GEN_STEP_PREFILL };
di_status gen_ep_note_step(gen_ep *ep, int kind, uint64_t ns, di_error *err);
/* Whether any rank has work left (every rank calls it in lockstep). */
di_status gen_ep_any_work(gen_ep *ep, sched *s, bool *out, di_error *err);
/* Brings every rank's outputs to rank 0 (outs has n entries on every rank, filled for this
 * rank's prompts) and sums the group's counters into *stats (a JSON object "ep" on rank 0;
 * with --bench also "bench": the decode steps' figures, and a table line on stderr).
 * *print is set on rank 0 only. */
di_status gen_ep_gather(gen_ep *ep, gen_out *outs, uint32_t n, const sched_stats *ss,
                        uint64_t decode_tokens, void *stats, bool *print, di_error *err);

/* Runs the engine over every prompt and prints the outputs (text prompts are encoded into
 * their ids here, so a is written). */
di_status gen_run(gen_args *a, di_error *err);

#endif
