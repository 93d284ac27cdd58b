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

#include "proc.h"

static int run(char *const *args, char *out, size_t outlen)
{
    return proc_run(proc_bin("router/di-router"), args, out, outlen);
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
    char *extra[] = {"--prefill", "127.0.0.1:7001", "--decode", "127.0.0.1:7002", NULL};
    int port;
    pid_t pid = proc_start_router(extra, &port);
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
    cr_expect_eq(proc_stop(pid), 0);
}
