/* proc.h: start and stop the build's binaries for the router's process tests. */
#ifndef DI_TESTS_ROUTER_PROC_H
#define DI_TESTS_ROUTER_PROC_H

#include <stdbool.h>
#include <stddef.h>
#include <sys/types.h>

/* $DI_BUILD_ROOT/rel (static buffer). */
const char *proc_bin(const char *rel);

/* Starts di-router with the given extra arguments (NULL-terminated, at most 16) plus
 * --ready-fd; waits for its port. Asserts on failure. */
pid_t proc_start_router(char *const *extra, int *port);
/* The same, with --test-backend only when test_backend is true. */
pid_t proc_start_router_backend(bool test_backend, char *const *extra, int *port);

/* Starts bin with args (args[0] its name), args[fd_arg] replaced by the number of a pipe's
 * writing end, on which the process announces its port (a line); waits for the port. Asserts
 * on failure. */
pid_t proc_start_ready(const char *bin, char **args, int fd_arg, int *port);

/* SIGTERM and wait; returns the exit code (-1 when killed by a signal). */
int proc_stop(pid_t pid);

/* Sends one raw HTTP request to 127.0.0.1:port and reads the answer into out (NUL-terminated,
 * at most cap - 1 bytes). Returns the status code (0 when none). */
int proc_http(int port, const char *req, char *out, size_t cap);

/* Runs a binary to its end; stdout+stderr into out. Returns the exit code. */
int proc_run(const char *path, char *const *args, char *out, size_t outlen);

#endif
