/* service.h: the skeleton every service binary runs (di-kvstore, di-prefill, di-decode).
 *
 * svc_main does, in order: block SIGINT, SIGTERM, SIGHUP and SIGQUIT in every thread (they
 * are taken by sigwait, and each starts the drain), ignore SIGPIPE; parse the options table
 * (common/service/options.h) with the rows every service shares (SVC_BASE_ROWS) and the
 * program's own; print --help generated from the rows; read secrets from files or the
 * environment (never argv); refuse a non-loopback --listen when the client token (the spec's
 * guard row) is not configured; build the stderr logger; call the program's start; announce
 * the bound port (--port-file written atomically, --ready-fd written and closed); wait for a
 * stop signal; call the program's drain with a deadline (--drain), in a thread so that the
 * deadline holds; call stop; remove the port file.
 *
 * Exit codes (returned by svc_main; main returns them): 0 after a clean drain, 1 for a
 * failure while starting or a drain that missed its deadline (or a second signal during it),
 * 2 for a usage error (bad option or value, or a start that fails with DI_EINVAL/DI_ERANGE). Every failure prints one line
 * "NAME: what: why" on stderr.
 */
#ifndef DI_SERVICE_SERVICE_H
#define DI_SERVICE_SERVICE_H

#include <stddef.h>
#include <stdint.h>

#include "common/service/options.h"
#include "common/util/log.h"
#include "common/util/status.h"

/* The options every service has; embed one in the program's options struct and put
 * SVC_BASE_ROWS(that struct, the member, default listen address, default drain) in its table. */
typedef struct svc_base_opts {
    const char *listen;    /* HOST:PORT to serve on; port 0 picks a free one */
    const char *port_file; /* NULL, or a file that receives "PORT\n" once serving */
    int64_t ready_fd;      /* -1, or a descriptor that receives "PORT\n" and is closed */
    const char *log_level; /* error, warn, info or debug */
    uint64_t drain_ms;     /* after SIGTERM, time allowed to finish work in flight, ms */
} svc_base_opts;

#define SVC_BASE_ROWS(T, m, listen_def, drain_def)                                            \
    {"listen", SVC_OPT_HOSTPORT, offsetof(T, m.listen), listen_def, 0, 0, "HOST:PORT",         \
     "address to serve on; port 0 picks a free one", NULL},                                   \
    {"port-file", SVC_OPT_OUTFILE, offsetof(T, m.port_file), NULL, 0, 0, "FILE",              \
     "write the bound port here (atomically) once serving; removed at exit", NULL},           \
    {"ready-fd", SVC_OPT_INT, offsetof(T, m.ready_fd), "-1", -1, 1048576, "FD",               \
     "write the bound port to this open descriptor once serving, then close it", NULL},       \
    {"log-level", SVC_OPT_CHOICE, offsetof(T, m.log_level), "info", 0, 0, "LEVEL",            \
     "least severe log lines written to stderr", "error|warn|info|debug"},                    \
    {"drain", SVC_OPT_DURATION, offsetof(T, m.drain_ms), drain_def, 0, 3600000, "DURATION",   \
     "on SIGTERM (or INT, HUP, QUIT), time to finish or fail the work in flight", NULL}

/* What the program's callbacks receive. */
typedef struct svc_ctx {
    const char *name;          /* the program's name ("di-prefill") */
    di_logger log;             /* the stderr logger at --log-level */
    const svc_base_opts *base; /* the shared options */
} svc_ctx;

typedef struct svc_spec {
    const char *name;       /* "di-prefill": message prefix and log prefix */
    const char *summary;    /* what the program does, for --help (may span lines) */
    const char *epilog;     /* printed after the options in --help; may be NULL */
    const char *guard;      /* name of the SECRET row (the client token) without which only a
                               loopback --listen is allowed; NULL: loopback only */
    const svc_opt *rows;    /* the program's table, SVC_BASE_ROWS included */
    size_t n_rows;
    void *opts;             /* the struct the rows fill */
    size_t base_offset;     /* offsetof the svc_base_opts member in it */
    void *app;              /* handed to the callbacks */
    /* Checks options beyond the table, opens resources and starts serving; *port receives the
     * bound port. DI_EINVAL and DI_ERANGE (a bad value, or a size this machine cannot hold)
     * are usage errors (exit 2), anything else exit 1. The
     * message is printed once by svc_main; start must not print it. May be NULL. */
    di_status (*start)(void *app, const svc_ctx *ctx, int *port, di_error *err);
    /* Periodic work while serving (load reports, counts of rate-limited logs), every tick_ms on
     * the main thread; not during the drain. May be NULL. */
    void (*tick)(void *app, const svc_ctx *ctx);
    uint32_t tick_ms;       /* 0: no tick */
    /* Stops taking work, finishes or fails the work in flight with a clear status by
     * deadline_ns (di_mono_ns time), and returns. Runs on its own thread. May be NULL. */
    void (*drain)(void *app, const svc_ctx *ctx, uint64_t deadline_ns);
    /* Frees everything start made, including after a failed start (half-built state). Not
     * called when the drain missed its deadline (the process exits with work in flight). May
     * be NULL. */
    void (*stop)(void *app, const svc_ctx *ctx);
} svc_spec;

/* Runs the service; returns the exit code (0, 1 or 2; see above). */
int svc_main(const svc_spec *spec, int argc, char **argv);

/* Writes "PORT\n" to path through a temporary file in the same directory and a rename, so a
 * reader never sees a partial file. DI_OK, DI_EIO. */
di_status svc_write_port_file(const char *path, int port, di_error *err);

#endif
