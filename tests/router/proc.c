/* proc.c: see proc.h. */
#include "proc.h"

#include <criterion/criterion.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

const char *proc_bin(const char *rel)
{
    static char path[1024];
    const char *b = getenv("DI_BUILD_ROOT");
    cr_assert_not_null(b, "DI_BUILD_ROOT is not set");
    snprintf(path, sizeof path, "%s/%s", b, rel);
    return path;
}

pid_t proc_start_router(char *const *extra, int *port)
{
    int ready[2];
    cr_assert_eq(pipe(ready), 0);
    char fdarg[16];
    snprintf(fdarg, sizeof fdarg, "%d", ready[1]);
    char *args[24] = {"di-router", "--test-backend", "--listen-http", "127.0.0.1:0",
                      "--ready-fd", fdarg, "--log-level", "warn"};
    int n = 8;
    for (int i = 0; extra && extra[i] && n < 23; i++)
        args[n++] = extra[i];
    args[n] = NULL;
    const char *bin = proc_bin("router/di-router");
    pid_t pid = fork();
    if (pid == 0) {
        close(ready[0]);
        execv(bin, args);
        _exit(127);
    }
    close(ready[1]);
    char line[32] = "";
    ssize_t k = read(ready[0], line, sizeof line - 1);
    close(ready[0]);
    cr_assert_gt(k, 0, "the router did not announce its port");
    line[k] = '\0';
    *port = atoi(line);
    cr_assert_gt(*port, 0);
    return pid;
}

int proc_stop(pid_t pid)
{
    kill(pid, SIGTERM);
    int st;
    waitpid(pid, &st, 0);
    return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

int proc_run(const char *path, char *const *args, char *out, size_t outlen)
{
    int p[2];
    cr_assert_eq(pipe(p), 0);
    pid_t pid = fork();
    if (pid == 0) {
        dup2(p[1], 2);
        dup2(p[1], 1);
        close(p[0]);
        execv(path, args);
        _exit(127);
    }
    close(p[1]);
    size_t n = 0;
    ssize_t k;
    char sink[4096];
    while ((k = read(p[0], n + 1 < outlen ? out + n : sink,
                     n + 1 < outlen ? outlen - n - 1 : sizeof sink)) > 0)
        if (n + 1 < outlen)
            n += (size_t)k;
    out[n] = '\0';
    close(p[0]);
    int st;
    waitpid(pid, &st, 0);
    return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}
