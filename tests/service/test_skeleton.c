/* The service skeleton (common/service/service.h) run as a real process: di-svcdemo from the
 * build tree is started with a --ready-fd pipe and a --port-file, called over gRPC, sent
 * SIGTERM while idle, while a stream is in flight (drained to its end, or failed with a clear
 * status when it outlives --drain), and with a stream that ignores cancellation (exit 1 at
 * the drain deadline). Usage errors exit 2 with one line; tokens come from the environment. */
#include <criterion/criterion.h>
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "common/net/rpc.h"
#include "tests/net/loopback.h"
#include "common/util/clock.h"

typedef struct proc {
    pid_t pid;
    int ready_rd;       /* read end of the --ready-fd pipe, or -1 */
    char out[64];       /* the child's stdout and stderr */
} proc;

/* Starts di-svcdemo with args (NULL-terminated); with ready, adds --ready-fd. env_token, when
 * set, goes into DI_DEMO_TOKEN of the child only. */
static proc spawn(int ready, const char *env_token, const char *const *args)
{
    const char *root = getenv("DI_BUILD_ROOT");
    char exe[1024];
    snprintf(exe, sizeof(exe), "%s/tests/service/di-svcdemo", root ? root : ".");
    proc p = {.ready_rd = -1};
    snprintf(p.out, sizeof(p.out), "/tmp/di-svcdemo-XXXXXX");
    int out = mkstemp(p.out);
    cr_assert_geq(out, 0);
    int fds[2] = {-1, -1};
    if (ready)
        cr_assert_eq(pipe(fds), 0);
    char fdarg[16];
    snprintf(fdarg, sizeof(fdarg), "%d", fds[1]);
    const char *argv[32] = {exe};
    int n = 1;
    if (ready) {
        argv[n++] = "--ready-fd";
        argv[n++] = fdarg;
    }
    for (; *args; args++)
        argv[n++] = *args;
    argv[n] = NULL;
    p.pid = fork();
    cr_assert_geq(p.pid, 0);
    if (p.pid == 0) {
        prctl(PR_SET_PDEATHSIG, SIGKILL); /* a failed test leaves no service behind */
        dup2(out, 1);
        dup2(out, 2);
        if (ready)
            close(fds[0]);
        if (env_token)
            setenv("DI_DEMO_TOKEN", env_token, 1);
        else
            unsetenv("DI_DEMO_TOKEN");
        execv(exe, (char *const *)argv);
        _exit(127);
    }
    close(out);
    if (ready) {
        close(fds[1]);
        p.ready_rd = fds[0];
    }
    return p;
}

/* The port the child wrote on its --ready-fd (waits up to 20 s). */
static int read_port(proc *p)
{
    struct pollfd pfd = {.fd = p->ready_rd, .events = POLLIN};
    cr_assert_eq(poll(&pfd, 1, 20000), 1, "no port on --ready-fd within 20 s");
    char buf[32] = {0};
    ssize_t n = read(p->ready_rd, buf, sizeof(buf) - 1);
    cr_assert_gt(n, 1);
    cr_assert_eq(buf[n - 1], '\n');
    int port = atoi(buf);
    cr_assert_gt(port, 0);
    /* Then the child closes it. */
    cr_assert_eq(read(p->ready_rd, buf, sizeof(buf)), 0);
    return port;
}

/* The child's exit code (waits up to ms; kills it and fails after that). */
static int wait_exit(proc *p, uint32_t ms)
{
    uint64_t until = di_mono_ns() + (uint64_t)ms * 1000000ull;
    int st = 0;
    for (;;) {
        pid_t r = waitpid(p->pid, &st, WNOHANG);
        if (r == p->pid)
            break;
        if (di_mono_ns() > until) {
            kill(p->pid, SIGKILL);
            waitpid(p->pid, &st, 0);
            cr_assert_fail("di-svcdemo did not exit within %u ms", ms);
        }
        usleep(5000);
    }
    if (p->ready_rd >= 0)
        close(p->ready_rd);
    cr_assert(WIFEXITED(st), "di-svcdemo died of signal %d", WTERMSIG(st));
    return WEXITSTATUS(st);
}

/* The child's output (malloc'd); removes the file. */
static char *output(proc *p)
{
    FILE *f = fopen(p->out, "r");
    cr_assert(f);
    char *buf = calloc(1, 65536);
    fread(buf, 1, 65535, f);
    fclose(f);
    unlink(p->out);
    return buf;
}

/* 1 when the file contains needle. */
static int file_has(const char *path, const char *needle)
{
    FILE *f = fopen(path, "r");
    if (!f)
        return 0;
    char line[512];
    int found = 0;
    while (!found && fgets(line, sizeof(line), f))
        found = strstr(line, needle) != NULL;
    fclose(f);
    return found;
}

static rpc_stream *count_stream(rpc_client *c, uint32_t n, uint32_t delay_us)
{
    uint8_t req[8];
    memcpy(req, &n, 4);
    memcpy(req + 4, &delay_us, 4);
    rpc_stream *st = NULL;
    di_error e;
    cr_assert_eq(rpc_stream_open(c, "/demo.Demo/Count", req, 8, 60000, &st, &e), DI_OK);
    uint8_t *m = NULL;
    size_t len = 0;
    int done = 0;
    cr_assert_eq(rpc_stream_read(st, &m, &len, &done, &e), DI_OK, "%s", e.msg);
    cr_assert_eq(done, 0);
    free(m);
    return st;
}

TestSuite(skeleton, .timeout = 90);

Test(skeleton, help_to_a_full_device_exits_1)
{
    if (access("/dev/full", W_OK) != 0)
        cr_skip_test("no /dev/full");
    /* stdout on /dev/full: the help is lost, and the exit code says so. */
    pid_t pid = fork();
    cr_assert_geq(pid, 0);
    if (pid == 0) {
        int full = open("/dev/full", O_WRONLY);
        int null = open("/dev/null", O_WRONLY);
        dup2(full, 1);
        dup2(null, 2);
        const char *root = getenv("DI_BUILD_ROOT");
        char exe[1024];
        snprintf(exe, sizeof(exe), "%s/tests/service/di-svcdemo", root ? root : ".");
        execl(exe, exe, "--help", (char *)NULL);
        _exit(127);
    }
    int st = 0;
    waitpid(pid, &st, 0);
    cr_assert(WIFEXITED(st));
    cr_assert_eq(WEXITSTATUS(st), 1, "help lost on a full device must not exit 0");
}

Test(skeleton, help_lists_every_option_and_exits_0)
{
    const char *args[] = {"--help", NULL};
    proc p = spawn(0, NULL, args);
    cr_assert_eq(wait_exit(&p, 20000), 0);
    char *out = output(&p);
    const char *want[] = {"usage: di-svcdemo", "--listen HOST:PORT", "--port-file FILE",
                          "--ready-fd FD", "--log-level LEVEL", "--drain DURATION",
                          "--token-file FILE", "(else $DI_DEMO_TOKEN)", "--threads N",
                          "--max-request SIZE", "--ignore-cancel", "--help", "[30s]"};
    for (size_t i = 0; i < sizeof(want) / sizeof(want[0]); i++)
        cr_assert(strstr(out, want[i]), "--help lacks \"%s\":\n%s", want[i], out);
    free(out);
}

static void usage_error(const char *want, const char *const *args)
{
    proc p = spawn(0, NULL, args);
    cr_assert_eq(wait_exit(&p, 20000), 2, "%s: not a usage error", args[0]);
    char *out = output(&p);
    cr_assert(strncmp(out, "di-svcdemo: ", 12) == 0, "%s", out);
    cr_assert(strstr(out, want), "\"%s\" lacks \"%s\"", out, want);
    char *nl = strchr(out, '\n');
    cr_assert(nl && nl[1] == '\0', "more than one line: %s", out);
    free(out);
}

Test(skeleton, usage_errors_exit_2_with_one_line)
{
    usage_error("port 70000 outside 0..65535",
                (const char *[]){"--listen", "127.0.0.1:70000", NULL});
    usage_error("unknown option --bogus", (const char *[]){"--bogus", NULL});
    usage_error("--ready-fd 987 is not an open descriptor",
                (const char *[]){"--ready-fd", "987", NULL});
    usage_error("--listen 0.0.0.0:0 is not a loopback address",
                (const char *[]){"--listen", "0.0.0.0:0", NULL});
    usage_error("unexpected argument \"serve\"", (const char *[]){"serve", NULL});
    usage_error("--threads: 0 is outside [1, 64]", (const char *[]){"--threads", "0", NULL});
    usage_error("--drain: \"later\" is not a duration", (const char *[]){"--drain", "later",
                                                                          NULL});
    usage_error("--token-file: cannot read /nonexistent/token",
                (const char *[]){"--token-file", "/nonexistent/token", NULL});
    usage_error("--port-file: cannot write in /nonexistent",
                (const char *[]){"--port-file", "/nonexistent/port", NULL});
}

Test(skeleton, a_port_in_use_fails_to_start_with_exit_1)
{
    const char *a1[] = {NULL};
    proc first = spawn(1, NULL, a1);
    int port = read_port(&first);
    char listen[64];
    snprintf(listen, sizeof(listen), "127.0.0.1:%d", port);
    const char *a2[] = {"--listen", listen, NULL};
    proc second = spawn(0, NULL, a2);
    cr_assert_eq(wait_exit(&second, 20000), 1);
    char *out = output(&second);
    cr_assert(strstr(out, "cannot listen on"), "%s", out);
    free(out);
    kill(first.pid, SIGINT);
    cr_assert_eq(wait_exit(&first, 20000), 0);
    free(output(&first));
}

Test(skeleton, ready_fd_port_file_and_clean_exit_on_sigterm)
{
    char dir[] = "/tmp/di-svcdemo-dir-XXXXXX";
    cr_assert(mkdtemp(dir));
    char port_file[128];
    snprintf(port_file, sizeof(port_file), "%s/port", dir);
    const char *args[] = {"--port-file", port_file, "--log-level", "debug", NULL};
    proc p = spawn(1, NULL, args);
    int port = read_port(&p);
    /* The port file is already complete when the ready line arrives. */
    FILE *f = fopen(port_file, "r");
    cr_assert(f, "no port file");
    int from_file = -1;
    cr_assert_eq(fscanf(f, "%d\n", &from_file), 1);
    fclose(f);
    cr_assert_eq(from_file, port);
    rpc_client *c = loopback_client(port, NULL);
    uint8_t *reply = NULL;
    size_t len = 0;
    di_error e;
    cr_assert_eq(rpc_client_call(c, "/demo.Demo/Ping", "hi", 2, 5000, &reply, &len, &e), DI_OK,
                 "%s", e.msg);
    cr_assert_eq(len, 2);
    free(reply);
    /* The tick runs while serving (every 50 ms, logged at debug level). */
    uint64_t until = di_mono_ns() + 10000000000ull;
    while (!file_has(p.out, "tick 2:") && di_mono_ns() < until)
        usleep(10000);
    cr_assert(file_has(p.out, "tick 2:"), "no tick while serving");
    kill(p.pid, SIGTERM);
    cr_assert_eq(wait_exit(&p, 20000), 0);
    cr_assert_neq(access(port_file, F_OK), 0, "the port file outlived the service");
    char *out = output(&p);
    cr_assert(strstr(out, "serving on 127.0.0.1:0"), "%s", out);
    cr_assert(strstr(out, "draining"), "%s", out);
    cr_assert(strstr(out, "stopped"), "%s", out);
    free(out);
    rpc_client_close(c);
    rmdir(dir);
}

Test(skeleton, sigterm_lets_a_stream_in_flight_finish)
{
    const char *args[] = {"--drain", "20s", NULL};
    proc p = spawn(1, NULL, args);
    rpc_client *c = loopback_client(read_port(&p), NULL);
    rpc_stream *st = count_stream(c, 20, 20000); /* about 400 ms */
    kill(p.pid, SIGTERM);
    uint32_t count = 1;
    di_error e;
    cr_assert_eq(loopback_read_rest(st, &count, &e), DI_OK, "%s", e.msg);
    cr_assert_eq(count, 20);
    cr_assert_eq(wait_exit(&p, 20000), 0);
    rpc_stream_close(st);
    rpc_client_close(c);
    free(output(&p));
}

Test(skeleton, sigterm_fails_a_stream_past_the_drain_with_a_clear_status)
{
    const char *args[] = {"--drain", "300ms", NULL};
    proc p = spawn(1, NULL, args);
    rpc_client *c = loopback_client(read_port(&p), NULL);
    rpc_stream *st = count_stream(c, 100000, 1000); /* about 100 s */
    uint64_t t0 = di_mono_ns();
    kill(p.pid, SIGTERM);
    uint32_t count = 1;
    di_error e;
    di_status fin = loopback_read_rest(st, &count, &e);
    cr_assert(fin == DI_EUNAVAIL || fin == DI_ECANCELED, "got %s: %s", di_status_name(fin),
              e.msg);
    cr_assert_lt(count, 100000);
    cr_assert_eq(wait_exit(&p, 20000), 0);
    cr_assert_lt(di_mono_ns() - t0, 15000000000ull, "the drain took too long");
    rpc_stream_close(st);
    rpc_client_close(c);
    free(output(&p));
}

Test(skeleton, a_drain_that_misses_its_deadline_exits_1)
{
    const char *args[] = {"--drain", "200ms", "--ignore-cancel", NULL};
    proc p = spawn(1, NULL, args);
    rpc_client *c = loopback_client(read_port(&p), NULL);
    rpc_stream *st = count_stream(c, 100000, 1000);
    kill(p.pid, SIGTERM);
    cr_assert_eq(wait_exit(&p, 30000), 1);
    char *out = output(&p);
    cr_assert(strstr(out, "missed its deadline"), "%s", out);
    free(out);
    rpc_stream_close(st);
    rpc_client_close(c);
}

Test(skeleton, token_from_the_environment_guards_every_call)
{
    const char *args[] = {"--listen", "0.0.0.0:0", NULL};
    proc p = spawn(1, "env-token-1", args);
    int port = read_port(&p);
    uint8_t *reply = NULL;
    size_t len = 0;
    di_error e;
    rpc_client *anon = loopback_client(port, NULL);
    cr_assert_eq(rpc_client_call(anon, "/demo.Demo/Ping", "x", 1, 5000, &reply, &len, &e),
                 DI_EAUTH);
    rpc_client *wrong = loopback_client(port, "env-token-2");
    cr_assert_eq(rpc_client_call(wrong, "/demo.Demo/Ping", "x", 1, 5000, &reply, &len, &e),
                 DI_EAUTH);
    rpc_client *good = loopback_client(port, "env-token-1");
    cr_assert_eq(rpc_client_call(good, "/demo.Demo/Ping", "x", 1, 5000, &reply, &len, &e), DI_OK,
                 "%s", e.msg);
    free(reply);
    kill(p.pid, SIGHUP);
    cr_assert_eq(wait_exit(&p, 20000), 0);
    rpc_client_close(anon);
    rpc_client_close(wrong);
    rpc_client_close(good);
    free(output(&p));
}
