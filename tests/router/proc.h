/* proc.h: start and stop the build's binaries for the router's process tests. */
#ifndef DI_TESTS_ROUTER_PROC_H
#define DI_TESTS_ROUTER_PROC_H

#include <sys/types.h>

/* $DI_BUILD_ROOT/rel (static buffer). */
const char *proc_bin(const char *rel);

/* Starts di-router with the given extra arguments (NULL-terminated, at most 16) plus
 * --ready-fd; waits for its port. Asserts on failure. */
pid_t proc_start_router(char *const *extra, int *port);

/* SIGTERM and wait; returns the exit code (-1 when killed by a signal). */
int proc_stop(pid_t pid);

/* Runs a binary to its end; stdout+stderr into out. Returns the exit code. */
int proc_run(const char *path, char *const *args, char *out, size_t outlen);

#endif
