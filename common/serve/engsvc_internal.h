/* engsvc_internal.h: what the engine service's two halves share: the request record, the
 * service struct and the helpers of engsvc.c (engine thread) used by engsvc_rpc.c (the gRPC
 * methods). Not part of the API (engsvc.h). */
#ifndef DI_SERVE_ENGSVC_INTERNAL_H
#define DI_SERVE_ENGSVC_INTERNAL_H

#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>

#include "common/engine/engine.h"
#include "common/kvfmt/kv_handoff.h"
#include "common/kvfmt/kv_keys.h"
#include "common/model/runner_exec.h"
#include "common/net/engine.pb-c.h"
#include "common/serve/engsvc.h"
#include "common/serve/kvcache.h"
#include "common/serve/loadrate.h"

#define RID_MAX 128u
#define MAX_REQUEST_BYTES (64u << 20)
#define HANDOFF_GET_MAX ((uint64_t)KV_HANDOFF_MAX_EXEC + (256u << 20))

/* One request, from its gRPC start to the call's end. Written by the gRPC worker that
 * starts it, then by the engine thread only (cancelled and cancel_why by the cancel function). */
typedef struct sreq {
    struct sreq *next;          /* inbox or live list */
    rpc_call *call;
    atomic_int cancelled;       /* set by the cancel function */
    atomic_int cancel_why;
    uint64_t id;                /* engine id (engine thread) */
    char rid[RID_MAX + 1];
    int32_t *prompt;            /* [prompt_len] */
    uint32_t prompt_len;
    sampling_params sp;
    int32_t *blacklist;
    int32_t stop_ids[16];
    uint32_t n_stop;
    uint32_t max_tokens;        /* output tokens in all, the first included */
    bool ignore_eos;            /* the model's end token does not stop it (eos_id -1, or
                                   another end token, which is then a stop id) */
    uint64_t t_arrive;
    uint64_t t_start;           /* first step that carried it */
    bool in_engine;
    bool done;                  /* final output seen (engine thread) */
    sched_finish finish;
    di_status fail;             /* with finish FAILED: the status to end with */
    char fail_msg[200];
    /* prefill */
    bool handed;                /* finished with a handoff: export after the step */
    runner_token first;
    uint32_t cached;            /* prompt tokens loaded from the store (replay excluded) */
    bool loading;               /* its prefix admission is out (kvcache_admit) */
    bool job_out;               /* a store call of it is out (handoff put, pull): it ends when
                                   the call completes, even when cancelled */
    /* decode */
    int32_t first_tok;
    uint8_t hkey[KVKEY_BYTES];  /* the handoff's key and size, from the manifest */
    uint64_t hbytes;
    uint64_t hexpires_ms;       /* the manifest's latest expiry of the handoff (wall clock,
                                   ms since the epoch); 0 = not given */
    uint64_t hstore;            /* the manifest's store_id; 0 = not given */
    void *hobj;                 /* the handoff object */
    kv_handoff h;
    void **blocks;              /* [n_full] full blocks */
    size_t *bsz;
    uint32_t n_full;
    uint32_t n_out;             /* tokens produced so far, the first included */
    uint64_t pulled_bytes;      /* handoff and blocks read from the store */
    uint64_t pull_ns;           /* the time those reads took */
    bool reported;              /* the pull went out with the first message */
} sreq;

struct engsvc {
    engsvc_config cfg;
    runner_exec *ex;
    engine *e;
    kv_geometry g;
    pthread_t thr;
    bool thr_started;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    sreq *inbox, *inbox_tail;   /* (mu) */
    uint32_t n_inbox;           /* (mu) */
    uint32_t live;              /* (mu) requests accepted, not yet ended */
    bool draining, stopping;    /* (mu) */
    bool abort_all;             /* (mu) drain deadline passed */
    sreq *reqs;                 /* engine thread: requests in the engine or being admitted */
    uint64_t next_id;
    uint64_t t0;
    /* load snapshot (mu) */
    uint64_t queued_prompt_tokens;
    uint32_t running, waiting, free_blocks, total_blocks, free_slots, total_slots;
    double prefill_tps, decode_ms;
    uint64_t cached_prompt_tokens, computed_prompt_tokens, store_failures;
    uint64_t decode_steps, steps_issued_ahead;
    /* counted by the engine thread */
    uint64_t prefill_tokens;     /* prompt tokens prefilled since start */
    uint64_t call_failures;     /* the service's own store calls that failed for good */
    kvcache *kc;                /* the KV cache in the store and the transfer thread */
    engine_executor rx;         /* the runner as an executor (wrapped for the cache's copies) */
    bool kv_note;               /* (mu) a transfer job finished: take the events */
    /* measured by the engine thread over the last LOADRATE_WINDOW_S seconds */
    loadrate prefill_rate;      /* prompt tokens per second of prefill steps */
    loadrate decode_rate;       /* decode steps per second of decode steps */
    /* expert parallelism (engsvc_ep.c); NULL without a group */
    engsvc_ep ep;               /* cfg.ep's copy */
    struct ep_group *grp;
    struct ep_moe *moe;
    uint64_t *ep_flags;         /* [world] the vote's buffer */
    bool group_busy;            /* engine thread: the last vote found work on some rank */
    bool broken;                /* (mu) the engine or the group failed: no more steps */
    char broken_msg[256];       /* (mu) why */
};

/* Frees a request record (NULL-safe). */
void engsvc_req_free(sreq *r);
/* The cancel function of every call: marks the request; the engine thread ends it. */
void engsvc_on_cancel(void *ud, di_status why);
/* The Finish of a scheduler finish. */
Di__Engine__Finish engsvc_finish_pb(sched_finish f);
/* Fills a Token message (tops/ptrs: SAMPLER_MAX_LOGPROBS entries of storage). */
void engsvc_token_pb(Di__Engine__Token *t, Di__Engine__TokenLogprob *tops,
                     Di__Engine__TokenLogprob **ptrs, int32_t tok, const sampler_result *res,
                     uint32_t idx);
/* Ends r's call with st (reply or message), frees r, counts it out of live (no lock held). */
void engsvc_end_req(engsvc *s, sreq *r, di_status st, const void *reply, size_t len,
                    const char *msg);
/* Removes r from the request list (engine thread). */
void engsvc_unlink(engsvc *s, sreq *r);
/* Deletes r's handoff from the store (engine thread; a transfer job, not waited for). */
void engsvc_drop_handoff(engsvc *s, const sreq *r);

/* engsvc_store.c (engine thread): the put of a PREFILL request's handoff (it has finished with
 * a handoff: exported, released, then put; the reply goes when the put is done) and the pull
 * of a DECODE request's handoff (it enters the engine when the pull is done: DI_OK, or the
 * submit's failure); engsvc_take_events handles whatever finished (admissions, puts, pulls). */
void engsvc_handoff_submit(engsvc *s, sreq *r);
di_status engsvc_pull_submit(engsvc *s, sreq *r, di_error *err);
void engsvc_take_events(engsvc *s);

/* engsvc_ep.c: the service as a rank of an expert-parallel group (engine thread after create).
 * engsvc_ep_open joins the group and creates the rank's MoE, hooking it into fo; a no-op
 * without cfg.ep. */
di_status engsvc_ep_open(engsvc *s, fwd_options *fo, di_error *err);
void engsvc_ep_close(engsvc *s);
/* The group's vote: *any = some rank has work (mine: this rank has); *leaver = the lowest other
 * rank that is leaving the group (stopping), UINT32_MAX if none. A rank leaves after a vote
 * in which no rank has work: the others then end their group too. */
di_status engsvc_ep_vote(engsvc *s, bool mine, bool leaving, bool *any, uint32_t *leaver,
                         di_error *err);
/* Ends this rank's group step (serves the others' exchange rounds until every rank is done). */
di_status engsvc_ep_step_end(engsvc *s, di_error *err);
/* Stopping: serves the group's steps until no rank has work (bounded by the group's deadline),
 * so that a rank leaving does not fail the others' requests in flight. */
void engsvc_ep_leave(engsvc *s);

#endif
