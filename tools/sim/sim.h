/* sim.h: the di-sim simulation: the real scheduler driven by a synthetic workload on simulated
 * time.
 *
 * Requests arrive as a Poisson process, with prompt and output lengths drawn from the given
 * distributions, and are dealt round-robin to the ranks (a router splitting evenly). Each rank
 * is a thread with its own scheduler and synthetic runner (synth.h); the ranks step in
 * lockstep through a vote group, as an expert-parallel group does. A step's simulated length
 * comes from the step-time model, and the group's step lasts as long as its slowest rank (the
 * MoE exchange waits for everyone); the clock jumps over idle gaps to the next arrival. Every
 * draw comes from di_rng seeded by `seed`, so a run repeats exactly.
 *
 * MTP varlen (engine.varlen): the scheduler's step-time table is the step-time model at every
 * recorded graph size, varlen_decode_ms + varlen_ms_per_row * rows (by default the model's own
 * figures; other figures stand for a table measured under other conditions than the run), and
 * the runner reports draft confidences from its acceptance model (synth.h): exact products of
 * each draft's chance (a^(i+1) for a flat rate a), or biased and noisy with conf_bias and
 * conf_noise.
 */
#ifndef DI_TOOLS_SIM_H
#define DI_TOOLS_SIM_H

#include <stdbool.h>
#include <stdint.h>

#include "common/engine/scheduler.h"
#include "common/util/status.h"

typedef enum sim_dist_kind { SIM_FIXED = 0, SIM_UNIFORM, SIM_EXP } sim_dist_kind;

/* A length distribution: "N", "uniform:A:B", "exp:MEAN" (rounded, at least 1). */
typedef struct sim_dist {
    sim_dist_kind kind;
    double a, b;            /* FIXED: a; UNIFORM: [a, b]; EXP: mean a */
} sim_dist;

/* Parses a distribution. DI_OK; DI_EINVAL with the reason. */
di_status sim_dist_parse(const char *text, sim_dist *out, di_error *err);

typedef struct sim_config {
    uint32_t requests;          /* requests in the workload */
    double rate;                /* arrivals per second (Poisson); 0 = all at time 0 */
    sim_dist prompt_len;        /* prompt tokens */
    sim_dist output_len;        /* output tokens (each request runs to it, ignore_eos) */
    uint32_t ranks;             /* lockstep ranks (threads) */
    sched_config engine;        /* per-rank scheduler settings (vote and alloc are set here) */
    double accept_rate;         /* each draft accepted with this probability, prefix rule */
    double accept_spread;       /* each draft's chance: accept_rate +- this, by draft token */
    double conf_bias;           /* varlen: added to each reported per-draft chance, [-1, 1] */
    double conf_noise;          /* varlen: uniform noise on each reported chance, [0, 1] */
    double varlen_decode_ms;    /* varlen table: fixed part (ms); negative: decode_ms */
    double varlen_ms_per_row;   /* varlen table: per graph row (ms); negative: the model's */
    double decode_ms;           /* step-time model: decode step = decode_ms + */
    double decode_ms_per_row;   /*   decode_ms_per_row * graph rows (padding included) */
    double prefill_ms;          /* prompt step = prefill_ms + */
    double prefill_ms_per_token; /*  prefill_ms_per_token * prompt tokens */
    uint64_t seed;              /* di_rng seed of the workload and every rank */
    uint64_t max_steps;         /* safety cap on group steps */
    /* Progress: called by rank 0 after every step; NULL for none. */
    void (*progress)(void *userdata, double sim_s, uint32_t done, uint32_t total,
                     uint64_t steps);
    void *progress_userdata;
} sim_config;

typedef struct sim_pct {
    double mean, p50, p90, p99, max;
} sim_pct;

typedef struct sim_result {
    uint32_t requests;              /* in the workload */
    uint32_t finished;              /* with a final output */
    uint32_t rejected;              /* refused by the scheduler (too long for the cache) */
    uint32_t by_finish[SCHED_FINISH_COUNT]; /* final outputs per finish reason */
    uint64_t prompt_tokens;         /* of all requests */
    uint64_t output_tokens;         /* received in outputs */
    uint64_t output_tokens_expected; /* sum of the output lengths to generate */
    double sim_seconds;             /* simulated time at the end */
    sim_pct ttft_ms;                /* first output token - arrival */
    sim_pct tpot_ms;                /* (last - first) / (tokens - 1), requests with >= 2 */
    uint32_t tpot_count;            /* requests in tpot */
    uint64_t group_steps;           /* lockstep steps */
    uint64_t prompt_steps;          /* summed over ranks */
    uint64_t decode_steps;
    uint64_t empty_prompt_steps;    /* a rank's placeholder in a prompt step */
    uint64_t empty_decode_steps;    /* a rank's placeholder in a decode step */
    uint64_t preempted_stop;
    uint64_t preempted_recompute;
    double cache_usage_mean;        /* block usage after each step, averaged over ranks */
    double cache_usage_max;
    double draft_acceptance;        /* accepted / checked real drafts */
    double rows_per_decode_step;    /* real rows per non-empty decode step, per rank */
    double draft_rows_per_request;  /* draft rows per request per decode step (rows - 1) */
    uint64_t varlen_no_conf;        /* varlen: request-steps planned without confidences */
    double padding_rows_per_decode_step;
    sim_pct sched_ns_per_step;      /* thread CPU of schedule + process per rank step */
    double wall_seconds;            /* wall-clock time of the run */
} sim_result;

/* Runs the simulation. DI_OK with *out filled; DI_EINVAL (config, or one whose bookkeeping
 * would take more than half of the machine's memory); DI_ENOMEM; DI_EINTERNAL
 * (a scheduler call failed, or max_steps reached: the message says which). */
di_status sim_run(const sim_config *cfg, sim_result *out, di_error *err);

#endif
