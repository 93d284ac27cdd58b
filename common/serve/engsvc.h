/* engsvc.h: the request handling di-prefill and di-decode share: one engine thread that owns
 * the engine loop and the model runner, one transfer thread that makes every store call (the
 * engine's KV cache in the store, kvcache.h); the gRPC methods of both services (rpc.h rows)
 * that hand requests to it; load, health, abort and drain.
 *
 * PREFILL (PROMPT engine): Prefill(request) queues the prompt; its cached prefix is looked up
 * and read (a transfer job; the request waits outside the engine meanwhile), then the engine
 * loads it and prefills the rest in chunks of up to 128 tokens and samples the first token;
 * the prompt's new full blocks and window states go to the store; the engine thread then
 * exports the handoff (common/serve/handoff.h) into host memory, releases the request's blocks
 * and slot, puts the full blocks and the handoff object (a transfer job) and, once stored,
 * replies with the first token, its logprobs, the tokens loaded from the store and the handoff
 * manifest. A first token that ends the request (EOS, max_tokens 1) is replied without a
 * handoff.
 *
 * DECODE (COMPLETION engine): Decode(handoff, sampling) pulls the handoff object and the full
 * blocks it names from the store (a transfer job), checks them against the request (prompt and
 * first token), adds the request held, imports the KV at its first plan, deletes the handoff
 * object, and streams one DecodeToken per output token; the last one carries the finish.
 * Preemption ends a request with FINISH_PREEMPTED. The blocks the response fills and its last
 * window state go to the store when it ends.
 *
 * Threads: gRPC workers parse and check requests and queue them (engsvc_*_start); a cancel
 * (client, deadline, server stop) only marks the request; the engine thread does everything
 * else: engine calls, KV copies, store jobs submitted and their outcomes taken between steps,
 * writes and finishing calls. A request's record is freed by the engine thread after
 * rpc_call_finish, when no cancel function can run and no store call of it is out.
 *
 * Drain: engsvc_drain refuses new requests (DI_EUNAVAIL "draining"), lets the work in flight
 * finish until the deadline, then ends what is left with DI_EUNAVAIL and FINISH_ABORTED.
 *
 * One step ahead and the overlap (DECODE, cfg.ahead / cfg.overlap): the engine runs async and
 * the executor in two halves (issue, collect); the service's work after a step (the response's
 * KV copied for the store) is done at the collect of that step, in step order, so a request sees
 * what it would without them: the same tokens, logprobs, finishes and stored KV. GetLoad counts
 * the decode steps and those issued ahead.
 *
 * Expert parallelism (cfg.ep, docs/ep.md): the service is one rank of a group; each rank serves
 * its own requests (its own gRPC port) and its MoE layers go through the group's exchange
 * (common/ep/moe.h). Every engine loop iteration of a rank first votes over the group whether
 * any rank has work; if one has, every rank steps (a rank without work ends a placeholder step
 * at once and serves the others' exchange rounds). An idle group votes every ep->idle_ms, so
 * it sleeps between votes and a request on any rank starts within idle_ms plus one vote. A
 * group failure (a rank died or hung past the deadline, a lockstep error) fails every request
 * of this rank with the group's message (naming the rank), turns Health to NOT_SERVING and
 * refuses new requests with DI_EUNAVAIL. On stop, a rank keeps serving the group's exchange
 * until no rank has work (at most ep->timeout_ms), then leaves.
 */
#ifndef DI_SERVE_ENGSVC_H
#define DI_SERVE_ENGSVC_H

#include <stdbool.h>
#include <stdint.h>

#include "common/model/runner.h"
#include "common/net/kv_client.h"
#include "common/net/rpc.h"
#include "common/util/log.h"
#include "common/util/status.h"
#include "kernels/kernels.h"

typedef enum engsvc_kind {
    ENGSVC_PREFILL = 0, /* PROMPT engine, service di.prefill.Prefill */
    ENGSVC_DECODE,      /* COMPLETION engine, service di.decode.Decode */
} engsvc_kind;

/* The rank group of an expert-parallel service (common/ep/group.h). */
typedef struct engsvc_ep {
    const char *addr;        /* HOST:PORT rank 0 listens on, the others connect to */
    int listen_fd;           /* rank 0: an inherited socket listening there; -1: bind addr */
    const char *token;       /* the group token (EP_TOKEN_MIN .. EP_TOKEN_MAX bytes) */
    uint32_t timeout_ms;     /* deadline of the rendezvous and of every group call; >= 1 */
    bool allow_remote;       /* addr may be a non-loopback address */
    uint32_t redundant;      /* redundant expert slots at least */
    uint32_t eplb_interval;  /* group steps between re-plans; 0 = never */
    uint32_t idle_ms;        /* an idle group votes this often; 1 .. timeout_ms / 2 */
} engsvc_ep;

typedef struct engsvc_config {
    engsvc_kind kind;
    const runner_model *rm;     /* borrowed; outlives the service */
    const kern_backend *be;     /* borrowed */
    const char *model_name;     /* for Health ("tiny") */
    kvc_client *kv;             /* the store (required); borrowed; used by the transfer thread */
    kvc_client *kv_load;        /* optional, borrowed: a second client for loads (prefix hits,
                                   handoff pulls) on a thread of their own; NULL: one thread */
    const char *kv_target;      /* its HOST:PORT for log lines; may be NULL */
    uint64_t kv_backoff_ns;     /* first back-off after a failed store call; 0 = 100 ms */
    uint64_t kv_max_backoff_ns; /* longest back-off; 0 = 2 s */
    uint32_t nextn;             /* drafts per decode step; UINT32_MAX = the model's block size */
    uint32_t chunk;             /* prefill step budget in tokens, multiple of 128; 0 = 512 */
    uint32_t max_seqs;          /* sequences at once; 0 = 16 */
    uint32_t num_blocks;        /* KV blocks of 128 positions; 0 = 1024 */
    uint32_t max_waiting;       /* queued requests at most; 0 = 256 */
    uint32_t rank, world;       /* for GetLoad; with ep: this rank of the group and its size */
    const engsvc_ep *ep;        /* NULL: a single rank; else the group (world >= 2; copied at
                                   create, the strings must outlive the service) */
    bool ahead;                 /* DECODE: one step ahead (sched_config.async, the runner's
                                   `ahead`): step N+1 is scheduled before step N's outcome is
                                   processed. Needs nextn 0 and no rank group (DI_EINVAL) */
    bool overlap;               /* DECODE (implies ahead): a decode step is issued before the
                                   previous one is collected (runner_exec_issue), so the host
                                   collects, processes and writes step N while the backend runs
                                   N+1 (a step with drafts is not issued ahead) */
    uint32_t step_delay_ms;     /* TESTING ONLY: sleep this long in every engine step (a slow
                                   rank on purpose); counted in the step's time; 0 = none */
    const di_logger *log;       /* one line per failed request; may be NULL */
} engsvc_config;

typedef struct engsvc engsvc;

/* Creates the engine and its runner (with ep: after joining the group, which blocks until every
 * rank has joined or ep->timeout_ms passed) and starts the engine thread. DI_OK; DI_EINVAL
 * (config); DI_ENOMEM; the runner's codes; the group's (DI_EAUTH, DI_ETIMEDOUT, DI_EIO). */
di_status engsvc_create(const engsvc_config *cfg, engsvc **out, di_error *err);
/* Stops the engine thread (requests still live end with DI_EUNAVAIL) and frees everything.
 * Call after the gRPC server has stopped. NULL-safe. */
void engsvc_destroy(engsvc *s);

/* Refuses new requests from now on; waits until the work in flight has ended or deadline_ns
 * (di_mono_ns time) has passed, then ends the rest with DI_EUNAVAIL and waits for that.
 * Returns the number of requests ended early. */
uint32_t engsvc_drain(engsvc *s, uint64_t deadline_ns);

/* Requests live (queued, in the engine, or being handed off). */
uint32_t engsvc_live(engsvc *s);

/* The service's method tables (svc = the engsvc): Prefill or Decode (asynchronous), and
 * GetLoad, Health, Abort. */
const rpc_method *engsvc_methods(engsvc_kind kind, size_t *n);
const rpc_async_method *engsvc_async_methods(engsvc_kind kind, size_t *n);

#endif
