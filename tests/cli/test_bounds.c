/* Operator input at every binary's edge, run as an operator runs them (the built binaries):
 * sizes beyond this machine, HOST:PORT outside 1..65535 or junk, lengths past a limit, and
 * output that cannot be written (stdout on /dev/full) each end in a one-line error and a
 * non-zero status: 2 for bad usage, 1 for a failure. Nothing is written or allocated first. */
#include <criterion/criterion.h>
#include <dirent.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <spawn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#ifdef DI_HAVE_SERVICES
#include "tests/kvstore/harness.h"
#include "tests/kvstore/helpers.h"
#endif

extern char **environ;

typedef struct cli_run {
    int rc;          /* exit status; -1 when killed */
    char out[8192];  /* stdout (empty when it went to /dev/full) */
    char err[4096];  /* stderr */
} cli_run;

static void slurp_fd(int fd, char *buf, size_t cap)
{
    ssize_t n = pread(fd, buf, cap - 1, 0);
    buf[n > 0 ? n : 0] = '\0';
    close(fd);
}

static int temp_fd(void)
{
    char path[] = "/tmp/di-cli-test-XXXXXX";
    int fd = mkstemp(path);
    cr_assert_geq(fd, 0);
    unlink(path);
    return fd;
}

/* Runs BUILD_ROOT/bin with the space-separated args; stdout to `out_path` when not NULL;
 * `env` adds NAME=VALUE entries (NULL-terminated, may be NULL). */
static cli_run run_env(const char *bin, const char *args, const char *out_path,
                       const char *const *env)
{
    const char *root = getenv("DI_BUILD_ROOT");
    cr_assert_not_null(root, "DI_BUILD_ROOT is not set (run through meson test)");
    char exe[512], buf[2048];
    snprintf(exe, sizeof(exe), "%s/%s", root, bin);
    snprintf(buf, sizeof(buf), "%s", args);
    char *argv[64];
    int n = 0;
    argv[n++] = exe;
    for (char *save = NULL, *t = strtok_r(buf, " ", &save); t && n < 63;
         t = strtok_r(NULL, " ", &save))
        argv[n++] = t;
    argv[n] = NULL;
    char *envp[512];
    int m = 0;
    for (int i = 0; env && env[i]; i++)
        envp[m++] = (char *)env[i];
    for (char **e = environ; *e && m < 511; e++)
        envp[m++] = *e;
    envp[m] = NULL;
    int ofd = temp_fd(), efd = temp_fd();
    posix_spawn_file_actions_t fa;
    posix_spawn_file_actions_init(&fa);
    posix_spawn_file_actions_addopen(&fa, 0, "/dev/null", O_RDONLY, 0);
    if (out_path)
        posix_spawn_file_actions_addopen(&fa, 1, out_path, O_WRONLY, 0);
    else
        posix_spawn_file_actions_adddup2(&fa, ofd, 1);
    posix_spawn_file_actions_adddup2(&fa, efd, 2);
    pid_t pid;
    cr_assert_eq(posix_spawn(&pid, exe, &fa, NULL, argv, envp), 0, "cannot run %s", exe);
    posix_spawn_file_actions_destroy(&fa);
    int status;
    cr_assert_eq(waitpid(pid, &status, 0), pid);
    cli_run r = {.rc = WIFEXITED(status) ? WEXITSTATUS(status) : -1};
    slurp_fd(ofd, r.out, sizeof(r.out));
    slurp_fd(efd, r.err, sizeof(r.err));
    return r;
}

static cli_run run(const char *bin, const char *args, const char *out_path)
{
    return run_env(bin, args, out_path, NULL);
}

/* Exit status rc and exactly one line on stderr, starting with the binary's name and holding
 * `needle`. */
static void one_line(const cli_run *r, int rc, const char *name, const char *needle,
                     const char *what)
{
    cr_assert_eq(r->rc, rc, "%s: exit %d, not %d: %s", what, r->rc, rc, r->err);
    size_t len = strlen(r->err);
    cr_assert(len > 0 && r->err[len - 1] == '\n' && !memchr(r->err, '\n', len - 1),
              "%s: stderr is not one line: '%s'", what, r->err);
    cr_assert(strncmp(r->err, name, strlen(name)) == 0, "%s: %s", what, r->err);
    cr_assert(strstr(r->err, needle), "%s: '%s' lacks '%s'", what, r->err, needle);
}

/* One row: a binary, its arguments, where stdout goes, the status and the error it must give. */
typedef struct bad_row {
    const char *bin;      /* relative to the build root */
    const char *args;
    const char *out;      /* stdout: NULL (captured) or "/dev/full" */
    int rc;
    const char *needle;   /* in the one stderr line */
} bad_row;

static void run_rows(const bad_row *rows, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        const bad_row *b = &rows[i];
        const char *name = strrchr(b->bin, '/') + 1;
        cli_run r = run(b->bin, b->args, b->out);
        char what[600];
        snprintf(what, sizeof(what), "%s %s%s", name, b->args, b->out ? " > /dev/full" : "");
        one_line(&r, b->rc, name, b->needle, what);
        if (!b->out)
            cr_assert_str_empty(r.out, "%s: stdout not empty: %s", what, r.out);
    }
}

#define FULL "/dev/full"
#define LOST "cannot write the output"

/* ---- output that cannot be written ---- */

Test(bounds, lost_output_fails_every_tool, .timeout = 120)
{
    static const bad_row rows[] = {
        {"tools/generate/di-generate", "--help", FULL, 1, LOST},
        {"tools/generate/di-generate", "--config tiny --ids 5,6,7 --max-tokens 1 --quiet", FULL,
         1, LOST},
        {"tools/sim/di-sim", "--help", FULL, 1, LOST},
        {"tools/sim/di-sim", "--requests 2 --quiet", FULL, 1, LOST},
        {"tools/mkmodel/di-mkmodel", "--help", FULL, 1, LOST},
        {"tools/mkmodel/di-mkmodel", "--dry-run tiny", FULL, 1, LOST},
        {"tools/plan/di-plan", "--help", FULL, 1, LOST},
        {"tools/plan/di-plan", "graphs --help", FULL, 1, LOST},
#ifdef DI_HAVE_TOKENIZER
        {"tools/tokenize/di-tokenize", "--help", FULL, 1, LOST},
#endif
#ifdef DI_HAVE_SERVICES
        {"kvstore/di-kvstore", "--help", FULL, 1, LOST},
        {"kvstore/di-kvctl", "--help", FULL, 1, LOST},
        {"kvstore/di-kvctl", "ttl --help", FULL, 1, LOST},
        {"kvstore/kvdemo", "--help", FULL, 1, LOST},
        {"kvstore/kvbench", "--help", FULL, 1, LOST},
#endif
    };
    run_rows(rows, sizeof(rows) / sizeof(rows[0]));
    /* The same runs with a writable stdout succeed: the failure above is the output's. */
    cli_run r = run("tools/sim/di-sim", "--requests 2 --quiet", NULL);
    cr_assert_eq(r.rc, 0, "%s", r.err);
    cr_assert(strstr(r.out, "requests"), "%s", r.out);
    r = run("tools/generate/di-generate", "--config tiny --ids 5,6,7 --max-tokens 1 --quiet",
            NULL);
    cr_assert_eq(r.rc, 0, "%s", r.err);
    cr_assert(strlen(r.out) > 0);
}

/* ---- sizes and lengths ---- */

Test(bounds, a_random_checkpoint_above_the_limit_is_refused_before_a_byte_is_written,
     .timeout = 60)
{
    char tmp[] = "/tmp/di-cli-tmpdir-XXXXXX";
    cr_assert_not_null(mkdtemp(tmp));
    char env_tmp[64];
    snprintf(env_tmp, sizeof(env_tmp), "TMPDIR=%s", tmp);
    const char *env[] = {env_tmp, NULL};
    cli_run r = run_env("tools/generate/di-generate", "--config v41-flash --ids 5 --quiet",
                        NULL, env);
    one_line(&r, 1, "di-generate", "above the 64.0 GB limit", "v41-flash random weights");
    cr_assert(strstr(r.err, "306.6 GB"), "the size it would need: %s", r.err);
    DIR *d = opendir(tmp);
    cr_assert_not_null(d);
    int entries = 0;
    for (struct dirent *e; (e = readdir(d)) != NULL;)
        entries += strcmp(e->d_name, ".") != 0 && strcmp(e->d_name, "..") != 0;
    closedir(d);
    cr_assert_eq(entries, 0, "nothing written under TMPDIR");
    rmdir(tmp);
}

Test(bounds, lengths_and_counts_past_the_limit_are_errors_or_warned_cuts, .timeout = 60)
{
    static const bad_row rows[] = {
        {"tools/sim/di-sim", "--prompt-len 200000", NULL, 2, "at most 131068"},
        {"tools/sim/di-sim", "--prompt-len uniform:128:131069", NULL, 2, "at most 131068"},
        {"tools/sim/di-sim", "--max-model-len 4096 --prompt-len 4093", NULL, 2,
         "at most 4092 (--max-model-len 4096 less 4"},
#ifdef DI_HAVE_TOKENIZER
        {"tools/tokenize/di-tokenize", "--engram-map - --vocab-size 2000000000", NULL, 2,
         "above the largest vocabulary handled, 16777216"},
#endif
    };
    run_rows(rows, sizeof(rows) / sizeof(rows[0]));
    /* At the limit it runs, and the outputs it must cut are announced. */
    cli_run r = run("tools/sim/di-sim", "--prompt-len 131068 --requests 2 --quiet --json", NULL);
    one_line(&r, 0, "di-sim: warning:", "such outputs are cut to fit", "prompt at the limit");
    cr_assert(strstr(r.out, "\"prompt_tokens\": 262136"), "both prompts whole: %s", r.out);
    r = run("tools/sim/di-sim", "--prompt-len exp:30000 --requests 2 --quiet", NULL);
    one_line(&r, 0, "di-sim: warning:", "of prompts are cut to 131068 tokens", "exp prompts");
    r = run("tools/sim/di-sim", "--requests 2 --quiet", NULL);
    cr_assert_eq(r.rc, 0);
    cr_assert_str_empty(r.err, "no warning for lengths that fit: %s", r.err);
}

#ifdef DI_HAVE_SERVICES

Test(bounds, store_sizes_beyond_the_machine_are_refused_at_once, .timeout = 60)
{
    static const bad_row rows[] = {
        {"kvstore/di-kvstore", "--dram-bytes 1TiB --dir /nonexistent/x", NULL, 2,
         "--dram-bytes 1.00 TiB exceeds the"},
        {"kvstore/di-kvstore", "--memtable-bytes 2TiB --dir /nonexistent/x", NULL, 2,
         "--memtable-bytes 2.00 TiB exceeds the"},
        {"kvstore/kvbench", "--objects 1000000 --bytes 16MiB", NULL, 2, "physical memory"},
        {"kvstore/kvdemo", "--tokens 100 --shared 200", NULL, 2, "--shared 200 is more than"},
        /* bad flag combinations found after parsing are usage errors too */
        {"kvstore/di-kvstore", "--listen 0.0.0.0:0 --dir /nonexistent/x", NULL, 2,
         "without --token-file"},
        {"kvstore/di-kvstore", "--tls-cert x.pem --dir /nonexistent/x", NULL, 2,
         "--tls-cert and --tls-key go together"},
        {"kvstore/di-kvstore", "--lease-max 50d", NULL, 2,
         "--lease-max: 4320000000 ms is outside [1, 86400000]"},
        {"kvstore/di-kvstore", "--dram-bytes 1KiB", NULL, 2,
         "--dram-bytes: 1024 bytes is below the least, 1048576 bytes"},
    };
    run_rows(rows, sizeof(rows) / sizeof(rows[0]));
    cli_run r = run("kvstore/di-kvstore", "--dram-bytes 1TiB", NULL);
    cr_assert(strstr(r.err, "physical memory"), "%s", r.err);
}

Test(bounds, every_host_port_is_checked_by_one_rule, .timeout = 60)
{
    static const bad_row rows[] = {
        {"kvstore/di-kvstore", "--listen 127.0.0.1:99999", NULL, 2, "outside 0..65535"},
        {"kvstore/di-kvstore", "--listen 127.0.0.1", NULL, 2, "has no port"},
        {"kvstore/di-kvstore", "--listen 127.0.0.1:80x", NULL, 2, "is not a number"},
        {"kvstore/di-kvctl", "--target 127.0.0.1:99999 stats", NULL, 2, "outside 1..65535"},
        {"kvstore/di-kvctl", "--target 127.0.0.1:0 stats", NULL, 2, "outside 1..65535"},
        {"kvstore/di-kvctl", "--target ::1:9470 stats", NULL, 2, "brackets"},
        {"kvstore/kvdemo", "--store 127.0.0.1:65536", NULL, 2, "outside 1..65535"},
        {"kvstore/kvbench", "--redis localhost", NULL, 2, "has no port"},
        {"tools/generate/di-generate", "--config tiny --ids 1 --kvstore 127.0.0.1:99999", NULL,
         2, "outside 1..65535"},
    };
    run_rows(rows, sizeof(rows) / sizeof(rows[0]));
    const char *env[] = {"DI_KVSTORE_TARGET=store:lots", NULL};
    cli_run r = run_env("kvstore/di-kvctl", "stats", NULL, env);
    one_line(&r, 2, "di-kvctl", "$DI_KVSTORE_TARGET", "a bad target in the environment");
    cli_run h = run("kvstore/di-kvstore", "--help", NULL);
    cr_assert(strstr(h.out, "0 picks a free one"), "--help says what port 0 means: %s", h.out);
}

/* Usage errors exit 2 before any connection (the target has nothing listening). */
Test(bounds, kvctl_usage_errors_exit_2_without_a_store, .timeout = 60)
{
    static const bad_row rows[] = {
        {"kvstore/di-kvctl", "--target 127.0.0.1:1 ttl set block forever", NULL, 2,
         "\"forever\" is not a duration"},
        {"kvstore/di-kvctl", "--target 127.0.0.1:1 capacity set dram -5", NULL, 2,
         "\"-5\" is not a size"},
        {"kvstore/di-kvctl", "--target 127.0.0.1:1 evict zzzz", NULL, 2, "64 hex digits"},
        {"kvstore/di-kvctl", "--target 127.0.0.1:1 ttl set lemon 5s", NULL, 2, "unknown class"},
        {"kvstore/di-kvctl", "--target 127.0.0.1:1 capacity set ram 5", NULL, 2, "usage"},
        {"kvstore/di-kvctl", "--target 127.0.0.1:1 inspect --ids 1,x", NULL, 2, "not an id"},
        {"kvstore/di-kvctl", "--target 127.0.0.1:1 evict --all --class nope", NULL, 2, "usage"},
        /* files and choices are checked by the option table, before any connection */
        {"kvstore/di-kvctl", "--target 127.0.0.1:1 --tls-ca /nonexistent/ca.pem stats", NULL, 2,
         "--tls-ca: cannot read /nonexistent/ca.pem"},
        {"kvstore/di-kvctl", "--target 127.0.0.1:1 --admin-token-file /nonexistent/t stats",
         NULL, 2, "--admin-token-file: cannot read /nonexistent/t"},
        {"kvstore/di-kvctl", "--target 127.0.0.1:1 --data-path rdma stats", NULL, 2,
         "--data-path: \"rdma\" is not one of auto|ucx|grpc"},
        {"kvstore/kvbench", "--core-durability sometimes", NULL, 2,
         "--core-durability: \"sometimes\" is not one of none|wal|fsync"},
        {"kvstore/kvdemo", "--ids-dir /nonexistent/ids", NULL, 2, "--ids-dir: cannot read"},
        {"kvstore/di-kvctl", "--deadline 60d stats", NULL, 2, "--deadline: 5184000000 ms is outside [1, 86400000]"},
    };
    run_rows(rows, sizeof(rows) / sizeof(rows[0]));
    /* A good command against nothing is a failure (1), not a usage error. */
    cli_run r = run("kvstore/di-kvctl", "--target 127.0.0.1:1 --deadline 2s ttl get", NULL);
    one_line(&r, 1, "di-kvctl", "unavailable", "nothing listening");
}

static int listening_port(int *fd)
{
    *fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    socklen_t len = sizeof(a);
    cr_assert_eq(bind(*fd, (struct sockaddr *)&a, sizeof(a)), 0);
    cr_assert_eq(listen(*fd, 1), 0);
    cr_assert_eq(getsockname(*fd, (struct sockaddr *)&a, &len), 0);
    return ntohs(a.sin_port);
}

/* A start that fails after the store is open (its port is taken) goes through the same
 * shutdown as a clean stop: one line, status 1, no port announced, no shared-memory file left
 * in UCX's directory; SIGHUP and SIGQUIT stop a running store cleanly (status 0). */
Test(bounds, a_failed_start_and_other_signals_clean_up, .timeout = 90)
{
    char dir[256], shm[300], port_file[300], args[1200];
    th_tmpdir(dir);
    snprintf(shm, sizeof(shm), "%s.shm", dir);
    snprintf(port_file, sizeof(port_file), "%s.port", dir);
    cr_assert_eq(mkdir(shm, 0700), 0);
    int fd;
    int port = listening_port(&fd);
    snprintf(args, sizeof(args), "--listen 127.0.0.1:%d --dir %s/db --geometry tiny --dram-bytes 8MiB "
             "--port-file %s", port, dir, port_file);
    char env_shm[400];
    snprintf(env_shm, sizeof(env_shm), "UCX_POSIX_DIR=%s", shm);
    const char *env[] = {env_shm, NULL};
    cli_run r = run_env("kvstore/di-kvstore", args, NULL, env);
    close(fd);
    cr_assert_eq(r.rc, 1, "port taken: %s", r.err);
    cr_assert(strstr(r.err, "di-kvstore: starting the service: cannot listen"), "%s", r.err);
    cr_assert_neq(access(port_file, F_OK), 0, "no port announced");
    DIR *d = opendir(shm);
    int left = 0;
    for (struct dirent *e; (e = readdir(d)) != NULL;)
        left += e->d_name[0] != '.';
    closedir(d);
    cr_assert_eq(left, 0, "shared memory left behind in %s", shm);
    rmdir(shm);

    const int sigs[] = {SIGHUP, SIGQUIT};
    for (int i = 0; i < 2; i++) {
        th_store s;
        char sub[300];
        snprintf(sub, sizeof(sub), "%s/s%d", dir, i);
        const char *a[] = {"--geometry", "tiny", "--dram-bytes", "8MiB", NULL};
        th_store_start(&s, sub, a);
        cr_assert_eq(kill(s.pid, sigs[i]), 0);
        int status;
        cr_assert_eq(waitpid(s.pid, &status, 0), s.pid);
        s.pid = 0;
        cr_assert(WIFEXITED(status) && WEXITSTATUS(status) == 0, "signal %d: status %d",
                  sigs[i], status);
        cr_assert(th_store_log_has(&s, "stopped"), "a clean stop");
    }
    th_rmtree(dir);
}

/* kvdemo without --token sends none (the store with an engine token refuses it by name);
 * $DI_KVSTORE_TOKEN is the token when set. */
Test(bounds, kvdemo_sends_no_token_unless_given_one, .timeout = 90)
{
    char dir[256], tok[300];
    th_tmpdir(dir);
    snprintf(tok, sizeof(tok), "%s.token", dir);
    FILE *f = fopen(tok, "w");
    fputs("engine-secret\n", f);
    fclose(f);
    th_store s;
    const char *a[] = {"--geometry", "tiny", "--dram-bytes", "8MiB", "--token-file", tok, NULL};
    th_store_start(&s, dir, a);
    char args[200];
    snprintf(args, sizeof(args), "--store %s --tokens 300 --prompts 1 --shared 0", s.target);
    cli_run r = run("kvstore/kvdemo", args, NULL);
    cr_assert_eq(r.rc, 1, "%s", r.err);
    cr_assert(strstr(r.err, "token"), "the refusal names the token: %s", r.err);
    const char *env[] = {"DI_KVSTORE_TOKEN=engine-secret", NULL};
    r = run_env("kvstore/kvdemo", args, NULL, env);
    cr_assert_eq(r.rc, 0, "%s", r.err);
    cr_assert(strstr(r.out, "prompt 0 read back: 2 blocks hit"), "%s", r.out);
    th_store_stop(&s);
    remove(tok);
    th_rmtree(dir);
}

#endif
