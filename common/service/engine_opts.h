/* engine_opts.h: the options the engine services (di-prefill, di-decode) share, as rows of
 * the options table (options.h), and the checks that span rows. Embed an svc_engine_opts in
 * the program's options struct and put SVC_ENGINE_ROWS(that struct, the member) in its table,
 * after SVC_BASE_ROWS; name "token-file" as the skeleton's guard. */
#ifndef DI_SERVICE_ENGINE_OPTS_H
#define DI_SERVICE_ENGINE_OPTS_H

#include <stddef.h>
#include <stdint.h>

#include "common/service/options.h"
#include "common/util/status.h"

typedef struct svc_engine_opts {
    const char *model_dir;   /* --model DIR: checkpoint directory; NULL: --config */
    const char *config;      /* --config NAME|FILE: shipped config or config.json, random weights */
    uint64_t weights_seed;   /* --weights-seed N: seed of the random weights (with --config) */
    const char *backend;     /* --backend cpu|cuda: where the forward runs */
    uint64_t threads;        /* --threads N: CPU threads of the forward, 1..256 */
    const char *kvstore;     /* --kvstore HOST:PORT of di-kvstore; NULL: no store */
    char *kvstore_token;     /* --kvstore-token-file or $DI_KVSTORE_TOKEN (secret) */
    char *token;             /* --token-file or $DI_ENGINE_TOKEN: what clients must present */
    uint64_t rank;           /* --rank N: this instance, 0..world-1 */
    uint64_t world;          /* --world N: instances of this kind, 1..1024 */
} svc_engine_opts;

#define SVC_ENGINE_ROWS(T, m)                                                                 \
    {"model", SVC_OPT_DIR, offsetof(T, m.model_dir), NULL, 0, 0, "DIR",                        \
     "checkpoint directory (config.json, index, shards); or --config", NULL},                 \
    {"config", SVC_OPT_STRING, offsetof(T, m.config), NULL, 0, 0, "NAME|FILE",                 \
     "random weights for a shipped config (tiny, small, demo, v41-flash) or a config file",   \
     NULL},                                                                                    \
    {"weights-seed", SVC_OPT_UINT, offsetof(T, m.weights_seed), "0", 0, 0, "N",               \
     "seed of the random weights with --config (as di-mkmodel)", NULL},                       \
    {"backend", SVC_OPT_CHOICE, offsetof(T, m.backend), "cpu", 0, 0, "NAME",                  \
     "where the forward runs", "cpu|cuda"},                                                    \
    {"threads", SVC_OPT_UINT, offsetof(T, m.threads), "2", 1, 256, "N",                       \
     "CPU threads of the forward", NULL},                                                      \
    {"kvstore", SVC_OPT_HOSTPORT, offsetof(T, m.kvstore), NULL, 0, 0, "HOST:PORT",            \
     "di-kvstore for cached prefixes and handoffs; none: no store", NULL},                    \
    {"kvstore-token-file", SVC_OPT_SECRET, offsetof(T, m.kvstore_token), NULL, 0, 0, "FILE",  \
     "engine token of the store", "DI_KVSTORE_TOKEN"},                                        \
    {"token-file", SVC_OPT_SECRET, offsetof(T, m.token), NULL, 0, 0, "FILE",                  \
     "token clients must present; without one: loopback only", "DI_ENGINE_TOKEN"},           \
    {"rank", SVC_OPT_UINT, offsetof(T, m.rank), "0", 0, 1023, "N",                            \
     "this instance's rank, below --world ('hostname': the number the host name ends in)",   \
     NULL},                                             \
    {"world", SVC_OPT_UINT, offsetof(T, m.world), "1", 1, 1024, "N",                          \
     "instances of this kind", NULL}

/* The rules across rows: exactly one of --model and --config; --weights-seed only with
 * --config; --rank below --world; a store token only with --kvstore; the port of --kvstore
 * not 0. DI_OK or DI_EINVAL with one line naming the options. */
di_status svc_engine_check(const svc_engine_opts *o, di_error *err);

#endif
