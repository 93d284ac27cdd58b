/* runner_exec_internal.h: the executor's state, shared by runner_exec.c (plans, sampling,
 * the one-step-ahead fix-up) and runner_exec_overlap.c (issue and collect, the overlap). */
#ifndef DI_MODEL_RUNNER_EXEC_INTERNAL_H
#define DI_MODEL_RUNNER_EXEC_INTERNAL_H

#include "common/model/runner_exec.h"
#include "kernels/cpu/step_ahead.h"

#define RX_MAX_ROWS (SEQ_MAX_NEXTN + 1)

/* What the executor keeps of one request. */
typedef struct rx_req {
    uint64_t id;
    int32_t *toks;              /* [cap] token at each position (plan rows are authoritative) */
    uint32_t cap;
    uint32_t prompt_len;
    sampling_params params;
    int32_t *forced;            /* [n_forced] teacher-forced continuation, or NULL */
    uint32_t n_forced;
    uint32_t n_out;             /* tokens produced so far */
    float *draft_logits;        /* [nextn, V] the draft head's logits of the pending drafts */
    int32_t drafts[SEQ_MAX_NEXTN];
    uint32_t n_drafts;
    runner_token last[RX_MAX_ROWS]; /* tokens of the latest step */
    uint32_t n_last;
    /* the outcome of the latest step that sampled it, for the step_ahead op */
    uint64_t ah_step;           /* that step's number (runner_exec_stats.steps after it) */
    int64_t ah_base;            /* its first position */
    uint32_t ah_q;              /* its rows */
    sched_seq_result ah_res;    /* its result (n_tokens 0: failed) */
    uint32_t uncommitted;       /* tokens of issued steps not yet collected (overlap) */
    char err[sizeof(((di_error *)0)->msg)];
} rx_req;

/* A step issued and not yet collected. */
typedef struct rx_flight {
    const sched_plan *plan;     /* NULL: the slot is free */
    uint64_t number;            /* its number (runner_exec_stats.steps after its issue) */
    int placeholder;            /* nothing ran */
    int ran;                    /* it ran whole at issue: res holds its results */
    int overlapped;             /* issued before the previous step was collected: the op wrote
                                 * its continuing rows on the device (checked at collect) */
    int host_sampled;           /* sres filled at issue (a host backend's sampling) */
    int outs_on_dev;            /* outs_dev holds each sampled row's token for the next step */
    sched_seq_result *res;      /* [E] results of a step run whole */
    int32_t *lbase;             /* [E] first logits row of each entry, -1 none */
    uint32_t n_logit;           /* sampled rows */
    sampler_result *sres;       /* [T] outcomes of the sampled rows */
    kern_sample_out *outs_dev;  /* [T] mapped memory: the sampled rows' outcomes */
    kern_sample_out *outs_host; /* its host address */
    void *ah_dev, *ah_host;     /* the op's arrays of an overlapped issue (rx_ahead_view),
                                 * mapped memory at its two addresses */
    uint64_t mark;              /* the backend's mark after the step's work */
    uint8_t *ah_check;          /* [E] 1: entry's rows written by the op */
} rx_flight;

struct runner_exec {
    const runner_model *rm;
    const kern_backend *be;
    runner_exec_options opt;
    fwd_model *m;
    fwd_run *run;
    fwd_kv *kv;
    sampler_workspace *ws;
    uint32_t V;
    uint32_t nextn;             /* drafts proposed per step (0 without draft stages) */
    rx_req **reqs;
    uint32_t n_reqs, cap_reqs;
    /* step scratch */
    fwd_seq *fseqs;             /* [max entries] */
    int32_t *lrows;             /* [max_rows] */
    int32_t *lbase;             /* [max entries] first logits row of each entry, -1 none */
    float *logits;              /* [max_rows, V] */
    float *dlogits;             /* [max entries, nextn, V] */
    int32_t *dtok;              /* [max entries, nextn] */
    float *dconf, *dcum;        /* [max entries, nextn] */
    fwd_draft_req *dreq;        /* [max entries] */
    uint32_t *dentry;           /* [max entries] plan entry of each draft request */
    rx_req **drec;              /* [max entries] request of each draft request */
    uint32_t max_entries;
    /* the step_ahead op's arrays (runner_exec_options.ahead): one block laid out by
     * ahead_view, in backend memory (ah_dev) with its host mirror (ah_host) */
    void *ah_dev, *ah_host;
    size_t ah_bytes;
    int32_t *ah_rows;           /* [max_rows] the op's row tokens the step runs on */
    /* steps issued and not yet collected (runner_exec_issue): at most two, one issued
     * before the other is collected (runner_exec_options.overlap) */
    rx_flight fl[2];
    int32_t *gather;            /* [max entries] rows of the previous step's outcomes */
    runner_exec_stats stats;
};

#define RX_AH_STRIDE (SEQ_MAX_NEXTN + 1) /* accepted tokens per sequence (out_stride) */

/* The op's arrays of E sequences over T rows at `base` (NULL: sizes only); returns the bytes
 * they take. Each array starts 64-byte aligned. */
size_t rx_ahead_view(uint8_t *base, uint32_t E, uint32_t T, kern_step_ahead *v);

rx_req *rx_find(const runner_exec *ex, uint64_t id);
/* The plan's fork copies on the backend. */
di_status rx_do_copies(runner_exec *ex, const sched_plan *plan, di_error *err);
/* The forward's step from the plan (ex->fseqs, lrows, lbase); records the rows' tokens. */
di_status rx_build_step(runner_exec *ex, const sched_plan *plan, fwd_step *st, di_error *err);
sampler_row rx_target_row(const runner_exec *ex, const rx_req *r, const float *logits,
                          uint64_t position, uint32_t row, uint32_t out_index);
/* Entry i's result cleared to OK; its request with no error yet. */
rx_req *rx_result_open(runner_exec *ex, const sched_plan *plan, uint32_t i,
                       sched_seq_result *res);
/* One fresh draw of a request into its state and its entry's result (failed: the error). */
void rx_take_draw(rx_req *r, const sampler_result *o, sched_seq_result *res);
/* Keeps each sampled entry's outcome for the next step's op (lbase: the step's rows). */
void rx_ahead_record(runner_exec *ex, const sched_plan *plan, const sched_seq_result *res,
                     const int32_t *lbase, uint64_t number);
/* 1 when every sampled entry of the plan can be drawn by the backend's sample entry. */
int rx_device_sampling(const runner_exec *ex, const sched_plan *plan);
/* The rest of a prepared step, whole: the forward, the draws into the requests' state and
 * results, the drafts (the synchronous executor). */
di_status rx_step_finish(runner_exec *ex, const sched_plan *plan, const fwd_step *st,
                         sched_seq_result *results, di_error *err);
/* The plan's copies, step, one-step-ahead fix-up and KV loads, before the forward runs. */
di_status rx_step_prepare(runner_exec *ex, const sched_plan *plan, fwd_step *st,
                          di_error *err);

/* runner_exec_overlap.c: the flights' buffers (options.overlap) */
di_status rx_flights_create(runner_exec *ex, di_error *err);
void rx_flights_free(runner_exec *ex);

#endif
