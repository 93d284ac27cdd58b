/* di-router as a process: --help, usage errors with exit 2 and one line, and a real start with
 * the test backend that answers on loopback and exits 0 on SIGTERM. */
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

static const char *bin(void)
{
    static char path[1024];
    const char *b = getenv("DI_BUILD_ROOT");
    cr_assert_not_null(b, "DI_BUILD_ROOT is not set");
    snprintf(path, sizeof path, "%s/router/di-router", b);
    return path;
}

/* Runs the router with args; returns its exit code and its stderr in err. */
static int run(char *const *args, char *err, size_t errlen)
{
    int p[2];
    cr_assert_eq(pipe(p), 0);
    pid_t pid = fork();
    if (pid == 0) {
        dup2(p[1], 2);
        dup2(p[1], 1);
        close(p[0]);
        execv(bin(), args);
        _exit(127);
    }
    close(p[1]);
    size_t n = 0;
    ssize_t k;
    while (n + 1 < errlen && (k = read(p[0], err + n, errlen - n - 1)) > 0)
        n += (size_t)k;
    err[n] = '\0';
    close(p[0]);
    int st;
    waitpid(pid, &st, 0);
    return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

Test(cli, help_and_usage_errors, .timeout = 60)
{
    char out[16384];
    char *help[] = {"di-router", "--help", NULL};
    cr_expect_eq(run(help, out, sizeof out), 0);
    cr_expect(strstr(out, "--test-backend") && strstr(out, "--prefill HOST:PORT") &&
              strstr(out, "not built yet"), "%s", out);
    char *no_backend[] = {"di-router", "--listen-http", "127.0.0.1:0", NULL};
    cr_expect_eq(run(no_backend, out, sizeof out), 2, "%s", out);
    cr_expect(strstr(out, "--test-backend") != NULL, "%s", out);
    char *open_http[] = {"di-router", "--test-backend", "--listen-http", "0.0.0.0:0", NULL};
    cr_expect_eq(run(open_http, out, sizeof out), 2, "%s", out);
    cr_expect(strstr(out, "--api-key-file") != NULL, "%s", out);
    char *bad_rank[] = {"di-router", "--test-backend", "--prefill", "host:99999", NULL};
    cr_expect_eq(run(bad_rank, out, sizeof out), 2, "%s", out);
    cr_expect(strstr(out, "--prefill") != NULL, "%s", out);
    char *no_rank[] = {"di-router", "--decode", NULL};
    cr_expect_eq(run(no_rank, out, sizeof out), 2, "%s", out);
    char *bad_limit[] = {"di-router", "--test-backend", "--max-body", "1TiB", NULL};
    cr_expect_eq(run(bad_limit, out, sizeof out), 2, "%s", out);
    char *bad_policy[] = {"di-router", "--test-backend", "--policy", "random", NULL};
    cr_expect_eq(run(bad_policy, out, sizeof out), 2, "%s", out);
}

static int http_get_status(int port, const char *req)
{
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    cr_assert_eq(connect(fd, (struct sockaddr *)&a, sizeof a), 0);
    cr_assert_eq(write(fd, req, strlen(req)), (ssize_t)strlen(req));
    char buf[4096];
    size_t n = 0;
    ssize_t k;
    while (n + 1 < sizeof buf && (k = read(fd, buf + n, sizeof buf - n - 1)) > 0)
        n += (size_t)k;
    buf[n] = '\0';
    close(fd);
    int status = 0;
    sscanf(buf, "HTTP/1.%*d %d", &status);
    return status;
}

Test(cli, serves_with_the_test_backend_and_drains, .timeout = 90)
{
    int ready[2];
    cr_assert_eq(pipe(ready), 0);
    char fdarg[16];
    snprintf(fdarg, sizeof fdarg, "%d", ready[1]);
    pid_t pid = fork();
    if (pid == 0) {
        close(ready[0]);
        char *args[] = {"di-router", "--test-backend", "--listen-http", "127.0.0.1:0",
                        "--ready-fd", fdarg, "--prefill", "127.0.0.1:7001", "--decode",
                        "127.0.0.1:7002", "--log-level", "warn", NULL};
        execv(bin(), args);
        _exit(127);
    }
    close(ready[1]);
    char line[32] = "";
    ssize_t k = read(ready[0], line, sizeof line - 1);
    close(ready[0]);
    cr_assert_gt(k, 0, "the router did not announce its port");
    line[k] = '\0';
    int port = atoi(line);
    cr_assert_gt(port, 0);
    cr_expect_eq(http_get_status(port, "GET /health HTTP/1.1\r\nHost: x\r\nConnection: close"
                                       "\r\n\r\n"), 200);
    const char *body = "{\"prompt\":\"Hello\",\"max_tokens\":4}";
    char req[512];
    snprintf(req, sizeof req,
             "POST /v1/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Type: "
             "application/json\r\nContent-Length: %zu\r\n\r\n%s", strlen(body), body);
    cr_expect_eq(http_get_status(port, req), 200);
    cr_expect_eq(http_get_status(port, "GET /v1/nothing HTTP/1.1\r\nHost: x\r\nConnection: "
                                       "close\r\n\r\n"), 404);
    kill(pid, SIGTERM);
    int st;
    waitpid(pid, &st, 0);
    cr_expect(WIFEXITED(st) && WEXITSTATUS(st) == 0, "exit status %d", st);
}
