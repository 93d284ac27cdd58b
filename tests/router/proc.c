/* proc.c: see proc.h. */
#include "proc.h"

#include <arpa/inet.h>
#include <criterion/criterion.h>
#include <netinet/in.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
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
    return proc_start_router_backend(true, extra, port);
}

pid_t proc_start_ready(const char *bin, char **args, int fd_arg, int *port)
{
    int ready[2];
    cr_assert_eq(pipe(ready), 0);
    char fdarg[16];
    snprintf(fdarg, sizeof fdarg, "%d", ready[1]);
    args[fd_arg] = fdarg;
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
    cr_assert_gt(k, 0, "%s did not announce its port", args[0]);
    line[k] = '\0';
    *port = atoi(line);
    cr_assert_gt(*port, 0);
    return pid;
}

pid_t proc_start_router_backend(bool test_backend, char *const *extra, int *port)
{
    char *args[24] = {"di-router", "--listen-http", "127.0.0.1:0", "--ready-fd", NULL,
                      "--log-level", "warn"};
    int n = 7;
    if (test_backend)
        args[n++] = "--test-backend";
    for (int i = 0; extra && extra[i] && n < 23; i++)
        args[n++] = extra[i];
    args[n] = NULL;
    return proc_start_ready(proc_bin("router/di-router"), args, 4, port);
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

int proc_http(int port, const char *req, char *out, size_t cap)
{
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    cr_assert_eq(connect(fd, (struct sockaddr *)&a, sizeof a), 0);
    cr_assert_eq(write(fd, req, strlen(req)), (ssize_t)strlen(req));
    size_t n = 0;
    ssize_t k;
    while (n + 1 < cap && (k = read(fd, out + n, cap - n - 1)) > 0)
        n += (size_t)k;
    out[n] = '\0';
    close(fd);
    int status = 0;
    sscanf(out, "HTTP/1.%*d %d", &status);
    return status;
}
