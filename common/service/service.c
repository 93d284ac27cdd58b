#include "common/service/service.h"

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "common/util/clock.h"
#include "common/util/outclose.h"

/* After the drain deadline, how long stop may take to cancel what is left before the process
 * gives up on it, ms. */
#define DRAIN_MARGIN_MS 2000

di_status svc_write_port_file(const char *path, int port, di_error *err)
{
    char tmp[4200];
    int n = snprintf(tmp, sizeof(tmp), "%s.tmp.%ld", path, (long)getpid());
    if (n < 0 || (size_t)n >= sizeof(tmp))
        return di_fail(err, DI_EIO, "port file path %s is too long", path);
    FILE *f = fopen(tmp, "w");
    if (!f)
        return di_fail(err, DI_EIO, "cannot create %s: %s", tmp, strerror(errno));
    int bad = fprintf(f, "%d\n", port) < 0;
    bad |= fflush(f) != 0 || fsync(fileno(f)) != 0;
    bad |= fclose(f) != 0;
    if (bad || rename(tmp, path) != 0) {
        di_status st = di_fail(err, DI_EIO, "cannot write the port file %s: %s", path,
                               strerror(errno));
        unlink(tmp);
        return st;
    }
    return DI_OK;
}

static di_status announce(const svc_base_opts *b, int port, di_error *err)
{
    if (b->port_file) {
        di_status st = svc_write_port_file(b->port_file, port, err);
        if (st != DI_OK)
            return st;
    }
    if (b->ready_fd >= 0) {
        char line[16];
        int n = snprintf(line, sizeof(line), "%d\n", port);
        ssize_t w;
        do
            w = write((int)b->ready_fd, line, (size_t)n);
        while (w < 0 && errno == EINTR);
        close((int)b->ready_fd);
        if (w != n)
            return di_fail(err, DI_EIO, "cannot write the port to --ready-fd %lld: %s",
                           (long long)b->ready_fd, w < 0 ? strerror(errno) : "short write");
    }
    return DI_OK;
}

/* The drain, on its own thread so that the deadline holds; it wakes main when done. */
typedef struct drain_job {
    const svc_spec *spec;
    const svc_ctx *ctx;
    uint64_t deadline_ns;
    pthread_t main_thread;
    atomic_int done;        /* set before SIGUSR1 is sent: a stray SIGUSR1 is not "done" */
} drain_job;

static void *drain_main(void *arg)
{
    drain_job *j = arg;
    if (j->spec->drain)
        j->spec->drain(j->spec->app, j->ctx, j->deadline_ns);
    atomic_store(&j->done, 1);
    pthread_kill(j->main_thread, SIGUSR1);
    return NULL;
}

/* Waits for a stop signal, running the tick meanwhile; returns the signal. */
static int wait_stop(const svc_spec *sp, const svc_ctx *ctx, const sigset_t *stop_sigs)
{
    if (!sp->tick || sp->tick_ms == 0) {
        int sig = 0;
        sigwait(stop_sigs, &sig);
        return sig;
    }
    const struct timespec every = {.tv_sec = sp->tick_ms / 1000,
                                   .tv_nsec = (long)(sp->tick_ms % 1000) * 1000000L};
    for (;;) {
        int sig = sigtimedwait(stop_sigs, NULL, &every);
        if (sig > 0)
            return sig;
        sp->tick(sp->app, ctx);
    }
}

/* Waits for the drain, a second signal or the deadline (plus the margin). Returns 0 when the
 * drain finished in time. */
static int wait_drain(const svc_ctx *ctx, const sigset_t *sigs, drain_job *job)
{
    uint64_t deadline_ns = job->deadline_ns;
    for (;;) {
        uint64_t now = di_mono_ns(), until = deadline_ns + DRAIN_MARGIN_MS * 1000000ull;
        if (now >= until) {
            di_log(&ctx->log, DI_LOG_ERROR,
                   "the drain missed its deadline (--drain %llums): exiting with work in flight",
                   (unsigned long long)ctx->base->drain_ms);
            return 1;
        }
        uint64_t left = until - now;
        struct timespec ts = {.tv_sec = (time_t)(left / 1000000000ull),
                              .tv_nsec = (long)(left % 1000000000ull)};
        int sig = sigtimedwait(sigs, NULL, &ts);
        if (sig == SIGUSR1 && atomic_load(&job->done))
            return 0;
        if (sig > 0 && sig != SIGUSR1) {
            di_log(&ctx->log, DI_LOG_ERROR,
                   "second signal %d while draining: exiting with work in flight", sig);
            return 1;
        }
    }
}

static int usage_error(const svc_spec *sp, const char *msg)
{
    fprintf(stderr, "%s: %s\n", sp->name, msg);
    svc_opts_free(sp->rows, sp->n_rows, sp->opts);
    return 2;
}

static void print_usage(const svc_spec *sp)
{
    printf("usage: %s [options]\n\n%s\n\noptions:\n", sp->name, sp->summary ? sp->summary : "");
    svc_opts_print(stdout, sp->rows, sp->n_rows);
    printf("  %-30s %s\n", "--help", "print this help and exit");
    if (sp->epilog)
        fputs(sp->epilog, stdout);
    printf("\nSecrets come from files or the environment, never from the command line. Without "
           "one, only a loopback --listen is allowed.\nSIGTERM, SIGINT, SIGHUP or SIGQUIT "
           "drains (up to --drain) and exits 0. Exit codes: 0 ok, 1 failure, 2 usage error.\n");
}

/* 1 when the guard row (the client token) holds a secret. */
static int guard_set(const svc_spec *sp)
{
    for (size_t i = 0; sp->guard && i < sp->n_rows; i++)
        if (sp->rows[i].kind == SVC_OPT_SECRET && strcmp(sp->rows[i].name, sp->guard) == 0)
            return *(char *const *)((const char *)sp->opts + sp->rows[i].offset) != NULL;
    return 0;
}

/* Parses and checks the options; returns -1 to go on, else the exit code. */
static int parse_options(const svc_spec *sp, int argc, char **argv)
{
    svc_base_opts *b = (svc_base_opts *)((char *)sp->opts + sp->base_offset);
    di_error e;
    int next = argc, help = 0;
    if (svc_opts_defaults(sp->rows, sp->n_rows, sp->opts, &e) != DI_OK ||
        svc_opts_parse(sp->rows, sp->n_rows, argc, argv, 1, sp->opts, &next, &help, &e) !=
            DI_OK)
        return usage_error(sp, e.msg);
    if (help) {
        print_usage(sp);
        svc_opts_free(sp->rows, sp->n_rows, sp->opts);
        return di_close_stdout(sp->name, 0); /* 1 when the help could not be written */
    }
    if (next < argc) {
        di_fail(&e, DI_EINVAL, "unexpected argument \"%s\" (see --help)", argv[next]);
        return usage_error(sp, e.msg);
    }
    if (b->ready_fd >= 0 && fcntl((int)b->ready_fd, F_GETFD) < 0) {
        di_fail(&e, DI_EINVAL, "--ready-fd %lld is not an open descriptor",
                (long long)b->ready_fd);
        return usage_error(sp, e.msg);
    }
    if (svc_opts_load_secrets(sp->rows, sp->n_rows, sp->opts, &e) != DI_OK)
        return usage_error(sp, e.msg);
    if (!guard_set(sp) && !svc_hostport_is_loopback(b->listen)) {
        di_fail(&e, DI_EINVAL,
                "--listen %s is not a loopback address: without --%s only 127.0.0.1, ::1 or "
                "localhost may be served",
                b->listen, sp->guard ? sp->guard : "a client token");
        return usage_error(sp, e.msg);
    }
    return -1;
}

int svc_main(const svc_spec *sp, int argc, char **argv)
{
    sigset_t sigs;
    sigemptyset(&sigs);
    sigaddset(&sigs, SIGINT);
    sigaddset(&sigs, SIGTERM);
    sigaddset(&sigs, SIGHUP);
    sigaddset(&sigs, SIGQUIT);
    sigaddset(&sigs, SIGUSR1);
    pthread_sigmask(SIG_BLOCK, &sigs, NULL);
    signal(SIGPIPE, SIG_IGN);

    int code = parse_options(sp, argc, argv);
    if (code >= 0)
        return code;
    const svc_base_opts *b = (const svc_base_opts *)((const char *)sp->opts + sp->base_offset);
    svc_ctx ctx = {.name = sp->name,
                   .log = di_logger_stderr((di_log_level)di_log_level_parse(b->log_level),
                                           sp->name),
                   .base = b};
    di_error e;
    di_error_clear(&e);
    int port = 0;
    di_status st = sp->start ? sp->start(sp->app, &ctx, &port, &e) : DI_OK;
    if (st == DI_OK && (st = announce(b, port, &e)) != DI_OK)
        di_error_prefix(&e, "announcing the port: ");
    if (st != DI_OK) {
        fprintf(stderr, "%s: %s\n", sp->name, e.msg);
        if (sp->stop)
            sp->stop(sp->app, &ctx);
        if (b->port_file)
            unlink(b->port_file);
        svc_opts_free(sp->rows, sp->n_rows, sp->opts);
        return st == DI_EINVAL || st == DI_ERANGE ? 2 : 1;
    }
    di_log(&ctx.log, DI_LOG_INFO, "serving on %s (port %d)", b->listen, port);

    sigset_t stop_sigs = sigs;
    sigdelset(&stop_sigs, SIGUSR1);
    int sig = wait_stop(sp, &ctx, &stop_sigs);
    uint64_t deadline = di_mono_ns() + b->drain_ms * 1000000ull;
    di_log(&ctx.log, DI_LOG_INFO, "signal %d: draining (up to %llums)", sig,
           (unsigned long long)b->drain_ms);
    drain_job job = {.spec = sp, .ctx = &ctx, .deadline_ns = deadline,
                     .main_thread = pthread_self()};
    pthread_t t;
    if (pthread_create(&t, NULL, drain_main, &job) != 0) {
        if (sp->drain)
            sp->drain(sp->app, &ctx, deadline);
    } else if (wait_drain(&ctx, &sigs, &job) != 0)
        return 1; /* the drain thread still runs: leave its state alone */
    else
        pthread_join(t, NULL);
    if (sp->stop)
        sp->stop(sp->app, &ctx);
    if (b->port_file)
        unlink(b->port_file);
    svc_opts_free(sp->rows, sp->n_rows, sp->opts);
    di_log(&ctx.log, DI_LOG_INFO, "stopped");
    return 0;
}
