/* harness.h: starting and stopping real di-kvstore processes for integration tests.
 *
 * The store runs with --listen 127.0.0.1:0 and reports its port through --ready-fd, so tests
 * never collide on ports. Each child gets PR_SET_PDEATHSIG(SIGKILL): if a test fails or crashes,
 * its stores die with it, so no process outlives a test. Logs go to DIR.log next to the data
 * directory. */
#ifndef DI_TESTS_KVSTORE_HARNESS_H
#define DI_TESTS_KVSTORE_HARNESS_H

#include <stdint.h>
#include <sys/types.h>

#include "common/net/kv_client.h"

typedef struct th_store {
    pid_t pid;           /* store process; 0 when not running */
    int port;            /* bound gRPC port */
    char target[64];     /* "127.0.0.1:port" */
    char dir[256];       /* data directory */
    char log[300];       /* stderr of the store */
    const char *args[48]; /* extra arguments (kept for restarts) */
    int n_args;
} th_store;

/* Starts di-kvstore on dir with the extra arguments (NULL-terminated list, may be NULL).
 * Asserts (Criterion) that it comes up within 30 s, printing its log otherwise. */
void th_store_start(th_store *s, const char *dir, const char *const *args);
/* Starts it again with the same directory, arguments and port. */
void th_store_restart(th_store *s);
/* Sends SIGTERM and asserts a clean exit (status 0). */
void th_store_stop(th_store *s);
/* Sends SIGKILL and reaps the process. */
void th_store_kill(th_store *s);
/* Prints the store's log to stderr (for failure messages). */
void th_store_dump_log(const th_store *s);
/* Returns 1 when the log contains `needle`. */
int th_store_log_has(const th_store *s, const char *needle);
/* Number of log lines containing `needle`. */
int th_store_log_count(const th_store *s, const char *needle);

/* A client with default options for the store (token may be NULL). */
kvc_client *th_client(const th_store *s, const char *token);
/* The same with another per-call deadline. */
kvc_client *th_client_deadline(const th_store *s, const char *token, uint32_t deadline_ms);

#endif
