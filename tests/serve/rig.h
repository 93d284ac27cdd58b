/* rig.h: the services on loopback for tests: a real di-kvstore, one di-prefill and one
 * di-decode (tiny model, CPU backend) started as processes, direct gRPC calls to them,
 * di-generate runs, and the check that nothing leaked (free blocks and slots back on both
 * ranks, no lease and no handoff in the store). Criterion asserts inside: for tests only. */
#ifndef DI_TESTS_SERVE_RIG_H
#define DI_TESTS_SERVE_RIG_H

#include <jansson.h>
#include <stdint.h>
#include <sys/types.h>

#include "common/net/decode.pb-c.h"
#include "common/net/engine.pb-c.h"
#include "common/net/prefill.pb-c.h"
#include "common/net/rpc.h"
#include "tests/kvstore/harness.h"

#define CHUNK "256"
#define SEED "0" /* di-mkmodel's seed: the store is started on that checkpoint */

/* The test's scratch directory (rig_setup makes it, rig_teardown removes it). */
extern char g_dir[256];

const char *build_root(void);
void rig_setup(void);
void rig_teardown(void);

/* ---- processes ---- */

typedef struct proc {
    pid_t pid;       /* 0 when not running */
    int port;        /* the port it announced */
    char target[64]; /* "127.0.0.1:port" */
    char log[300];   /* its stderr */
    int ready_fd;    /* between proc_spawn and proc_ready: the read end of --ready-fd */
} proc;

/* Starts build/<rel> with args (NULL-terminated) plus --listen 127.0.0.1:0 --ready-fd. */
void proc_start(proc *p, const char *rel, const char *name, const char *const *args);
/* proc_start in two halves, for processes that only become ready together (the ranks of a
 * group): spawn, then wait for the port it announces. */
void proc_spawn(proc *p, const char *rel, const char *name, const char *const *args);
void proc_ready(proc *p, const char *name);
/* SIGTERM (drain) and the exit status. */
int proc_stop(proc *p);
/* SIGKILL and reap. */
void proc_kill(proc *p);

/* ---- the deployment ---- */

typedef struct rig {
    th_store store;
    proc prefill, decode;
    const char *nextn;
    const char *config;             /* the model config of the store and both ranks; NULL: tiny */
    const char *drain;              /* --drain of both ranks; NULL: 20s */
    const char *blocks;             /* --blocks of both ranks; NULL: 256 */
    const char *kv_deadline;        /* --kvstore-deadline of both ranks; NULL: 2s */
    const char *const *store_extra; /* more di-kvstore arguments (NULL-terminated); NULL: none */
    Di__Engine__Load load0[2];      /* GetLoad of prefill, decode at start */
} rig;

void rig_start(rig *r, const char *nextn);
/* (Re)starts one rank of r: exe "prefill/di-prefill" or "decode/di-decode". */
void engine_start(proc *p, const char *exe, const char *name, const rig *r);
/* engine_start's spawn half with more arguments (NULL-terminated; NULL: none). */
void engine_spawn(proc *p, const char *exe, const char *name, const rig *r,
                  const char *const *extra);
/* Nothing leaked: blocks and slots back on both ranks, no lease and no handoff in the store.
 * A rank may still be finishing a cancelled request: waits up to 10 s for it. */
void assert_clean(const rig *r);
void rig_stop(rig *r);

/* One unary call to p (no token); the reply bytes (free them), or NULL with *st set. */
uint8_t *unary(const proc *p, const char *method, const void *req, size_t len, size_t *rlen,
               di_status *st, di_error *err);
/* svc: "prefill.Prefill" or "decode.Decode". */
Di__Engine__Load get_load(const proc *p, const char *svc);
/* di-kvctl --json stats of r's store (json_decref it). */
json_t *kvctl_stats(const rig *r);
/* Handoff objects in the store now; rig_wait_no_handoffs: fails unless there are none within
 * ms (decode deletes a handoff on its store thread after the pull, not before its tokens). */
long long rig_handoffs(const rig *r);
void rig_wait_no_handoffs(const rig *r, uint32_t ms);

/* ---- di-generate ---- */

typedef struct gen_res {
    int rc;         /* exit status */
    json_t *json;   /* its --json output, or NULL */
    char err[4096]; /* its stderr */
} gen_res;

/* Runs di-generate --quiet --json with the printf-formatted arguments. */
void gen(gen_res *g, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
/* A prompt file for di-generate --ids-file: line i holds lens[i] ids drawn from i and salt. */
void rig_write_prompts(const char *path, const uint32_t *lens, size_t n, uint32_t salt);
/* Tokens, logprobs and finish of every request of a and b equal (logprobs as printed: %.9g of
 * a float is exact); lens[i] (i < n_lens) names request i's prompt length in a failure. */
void rig_same_outputs(const gen_res *a, const gen_res *b, const uint32_t *lens, size_t n_lens,
                      const char *what);

/* ---- direct calls ---- */

rpc_client *client(const proc *p);
/* n prompt ids from salt, all inside the tiny model's vocabulary. */
void prompt_ids(uint32_t *ids, uint32_t n, uint32_t salt);
/* Default sampling (temperature 1), max_tokens, the end token off. */
Di__Engine__SamplingParams no_eos(uint32_t max_tokens);
/* Prefill of n ids; the reply (free it) or NULL with *st and err set. */
Di__Prefill__PrefillReply *prefill(rpc_client *c, const char *rid, const uint32_t *ids,
                                   uint32_t n, uint32_t max_tokens, uint32_t timeout_ms,
                                   di_status *st, di_error *err);
/* The same with the request's sampling. */
Di__Prefill__PrefillReply *prefill_with(rpc_client *c, const char *rid, const uint32_t *ids,
                                        uint32_t n, const Di__Engine__SamplingParams *sp,
                                        uint32_t timeout_ms, di_status *st, di_error *err);
/* Opens the Decode stream of a prefill's reply (deadline 60 s). */
rpc_stream *decode_open(rpc_client *c, const char *rid, const uint32_t *ids, uint32_t n,
                        const Di__Prefill__PrefillReply *pr, uint32_t max_tokens);
/* The same with the request's sampling and deadline. */
rpc_stream *decode_open_with(rpc_client *c, const char *rid, const uint32_t *ids, uint32_t n,
                             const Di__Prefill__PrefillReply *pr,
                             const Di__Engine__SamplingParams *sp, uint32_t deadline_ms);
/* Reads up to max messages; returns how many, *st the final status when the stream ended
 * (*ended 1). */
uint32_t stream_read(rpc_stream *s, uint32_t max, int *ended, di_status *st, di_error *err);
/* The next message of a Decode stream (free it with di__decode__decode_token__free_unpacked),
 * or NULL when the stream ended, with *st its final status. */
Di__Decode__DecodeToken *stream_next(rpc_stream *s, di_status *st);
/* The model id decode's Health reports. */
uint64_t model_id_of(const proc *p);

/* A request prefilled and decoding: `reads` tokens already read from its stream. */
typedef struct flight {
    rpc_client *pc, *dc;
    uint32_t ids[4096];
    Di__Prefill__PrefillReply *pr;
    rpc_stream *s;
} flight;

/* n <= 4096 prompt tokens. */
void flight_start(flight *f, rig *r, const char *rid, uint32_t n, uint32_t max_tokens,
                  uint32_t reads);
/* flight_start with the decode of another rank. */
void flight_start_at(flight *f, rig *r, const proc *decode, const char *rid, uint32_t n,
                     uint32_t max_tokens, uint32_t reads);
/* Reads the rest of the stream; its final status. */
di_status flight_end(flight *f, di_error *err);

/* An Abort of request rid sent to p after delay_us (a thread's body: abort_later(&a)). */
typedef struct aborter {
    const proc *p;
    const char *method; /* "/di.prefill.Prefill/Abort" or "/di.decode.Decode/Abort" */
    char rid[32];
    uint32_t delay_us;
} aborter;

void *abort_later(void *arg);
/* ---- the KV of a 16,384-token V4.1-Flash prompt ---- */

/* What decode pulls for it: 128 full blocks, the partial 129th, and the window state. */
#define FLASH_16K_BLOCKS 129u

/* Starts a di-kvstore of V4.1-Flash geometry (1 GiB of DRAM, durability none) in g_dir/name. */
void flash_store_start(th_store *s, const char *name);
/* The bytes of those objects. */
size_t flash_16k_bytes(const kv_geometry *g);
/* items[0..FLASH_16K_BLOCKS]: the blocks and then the window state, each written (a valid
 * object under its own key) into buf of flash_16k_bytes(g) bytes, one after the other. */
void flash_16k_items(const kv_geometry *g, kvc_item *items, uint8_t *buf);

/* How many cancels a cancel test makes: DI_DISAGG_CANCELS, 200 by default. */
uint32_t rig_cancels(void);

#endif
