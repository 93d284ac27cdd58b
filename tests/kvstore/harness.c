#include "tests/kvstore/harness.h"

#include <criterion/criterion.h>
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

void th_store_dump_log(const th_store *s)
{
    FILE *f = fopen(s->log, "r");
    if (!f)
        return;
    char line[512];
    while (fgets(line, sizeof(line), f))
        fprintf(stderr, "store log: %s", line);
    fclose(f);
}

static void spawn(th_store *s)
{
    const char *root = getenv("DI_BUILD_ROOT");
    cr_assert_not_null(root, "DI_BUILD_ROOT is not set (run through meson test)");
    char exe[512];
    snprintf(exe, sizeof(exe), "%s/kvstore/di-kvstore", root);
    int ready[2];
    cr_assert_eq(pipe(ready), 0);
    char fd_arg[16];
    snprintf(fd_arg, sizeof(fd_arg), "%d", ready[1]);
    const char *argv[64];
    int n = 0;
    argv[n++] = exe;
    char listen[64];
    snprintf(listen, sizeof(listen), "127.0.0.1:%d", s->port); /* 0 at first, then the same */
    argv[n++] = "--listen";
    argv[n++] = listen;
    argv[n++] = "--dir";
    argv[n++] = s->dir;
    argv[n++] = "--ready-fd";
    argv[n++] = fd_arg;
    for (int i = 0; i < s->n_args; i++)
        argv[n++] = s->args[i];
    argv[n] = NULL;
    pid_t parent = getpid();
    pid_t pid = fork();
    cr_assert_geq(pid, 0, "fork failed");
    if (pid == 0) {
        prctl(PR_SET_PDEATHSIG, SIGKILL);
        if (getppid() != parent)
            _exit(127);
        close(ready[0]);
        int lf = open(s->log, O_WRONLY | O_CREAT | O_APPEND, 0644);
        if (lf >= 0) {
            dup2(lf, 2);
            close(lf);
        }
        execv(exe, (char *const *)argv);
        _exit(127);
    }
    close(ready[1]);
    s->pid = pid;
    char buf[32] = {0};
    size_t got = 0;
    struct pollfd p = {.fd = ready[0], .events = POLLIN};
    while (got < sizeof(buf) - 1 && !memchr(buf, '\n', got)) {
        int r = poll(&p, 1, 30000);
        if (r <= 0)
            break;
        ssize_t k = read(ready[0], buf + got, sizeof(buf) - 1 - got);
        if (k <= 0)
            break;
        got += (size_t)k;
    }
    close(ready[0]);
    int port = atoi(buf);
    if (port <= 0 || (s->port && port != s->port)) {
        th_store_dump_log(s);
        kill(pid, SIGKILL);
        waitpid(pid, NULL, 0);
        s->pid = 0;
        cr_assert_fail("di-kvstore did not come up (log above)");
    }
    s->port = port;
    snprintf(s->target, sizeof(s->target), "127.0.0.1:%d", s->port);
}

void th_store_start(th_store *s, const char *dir, const char *const *args)
{
    memset(s, 0, sizeof(*s));
    snprintf(s->dir, sizeof(s->dir), "%s", dir);
    snprintf(s->log, sizeof(s->log), "%s.log", dir);
    for (int i = 0; args && args[i] && i < 47; i++)
        s->args[s->n_args++] = args[i];
    spawn(s);
}

void th_store_restart(th_store *s)
{
    cr_assert_eq(s->pid, 0, "store still running");
    spawn(s);
}

void th_store_stop(th_store *s)
{
    if (s->pid <= 0)
        return;
    kill(s->pid, SIGTERM);
    int status = 0;
    pid_t r = waitpid(s->pid, &status, 0);
    s->pid = 0;
    if (r < 0 || !WIFEXITED(status) || WEXITSTATUS(status) != 0)
        th_store_dump_log(s);
    cr_assert(WIFEXITED(status) && WEXITSTATUS(status) == 0,
              "di-kvstore did not stop cleanly (status 0x%x)", status);
}

void th_store_kill(th_store *s)
{
    if (s->pid <= 0)
        return;
    kill(s->pid, SIGKILL);
    waitpid(s->pid, NULL, 0);
    s->pid = 0;
}

int th_store_log_count(const th_store *s, const char *needle)
{
    FILE *f = fopen(s->log, "r");
    if (!f)
        return 0;
    char line[1024];
    int n = 0;
    while (fgets(line, sizeof(line), f))
        n += strstr(line, needle) != NULL;
    fclose(f);
    return n;
}

int th_store_log_has(const th_store *s, const char *needle)
{
    return th_store_log_count(s, needle) > 0;
}

kvc_client *th_client(const th_store *s, const char *token)
{
    return th_client_deadline(s, token, 10000);
}

kvc_client *th_client_deadline(const th_store *s, const char *token, uint32_t deadline_ms)
{
    kvc_options o;
    kvc_options_default(&o);
    o.deadline_ms = deadline_ms;
    o.target = s->target;
    o.token = token;
    kvc_client *c = NULL;
    di_error e;
    cr_assert_eq(kvc_open(&o, &c, &e), DI_OK, "%s", e.msg);
    return c;
}
