/* The options table parser (common/service/options.h): every kind, bounds, units, HOST:PORT,
 * files, secrets from a file or the environment, defaults, --help generated from the rows,
 * and one clear error for each bad input. */
#include <criterion/criterion.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/service/options.h"

typedef struct opts {
    const char *name;
    uint64_t bytes, ms, count;
    int64_t delta;
    double ratio;
    int verbose;
    const char *listen, *backend, *model, *out;
    char *token;
} opts;

static const svc_opt rows[] = {
    {"name", SVC_OPT_STRING, offsetof(opts, name), "demo", 0, 0, "NAME", "a name", NULL},
    {"bytes", SVC_OPT_SIZE, offsetof(opts, bytes), "64KiB", 4096, 1099511627776.0, "SIZE",
     "a size", NULL},
    {"wait", SVC_OPT_DURATION, offsetof(opts, ms), "2s", 1, 604800000, "DURATION", "a wait",
     NULL},
    {"count", SVC_OPT_UINT, offsetof(opts, count), "3", 1, 64, "N", "a count", NULL},
    {"delta", SVC_OPT_INT, offsetof(opts, delta), "-1", -1, 100, "N", "a signed count", NULL},
    {"ratio", SVC_OPT_DOUBLE, offsetof(opts, ratio), "0.5", 0, 1, "F", "a ratio", NULL},
    {"verbose", SVC_OPT_FLAG, offsetof(opts, verbose), NULL, 0, 0, NULL, "say more", NULL},
    {"listen", SVC_OPT_HOSTPORT, offsetof(opts, listen), "127.0.0.1:0", 0, 0, "HOST:PORT",
     "where to listen", NULL},
    {"backend", SVC_OPT_CHOICE, offsetof(opts, backend), "cpu", 0, 0, "NAME", "backend",
     "cpu|cuda"},
    {"model", SVC_OPT_FILE, offsetof(opts, model), NULL, 0, 0, "FILE", "a model file", NULL},
    {"out", SVC_OPT_OUTFILE, offsetof(opts, out), NULL, 0, 0, "FILE", "an output file", NULL},
    {"token-file", SVC_OPT_SECRET, offsetof(opts, token), NULL, 0, 0, "FILE", "the token",
     "DI_TEST_OPTIONS_TOKEN"},
};
#define N_ROWS (sizeof(rows) / sizeof(rows[0]))

/* Parses a NULL-terminated list of arguments after the program name. */
static di_status parse(opts *o, di_error *e, ...)
{
    char *argv[32] = {"prog"};
    int argc = 1;
    va_list ap;
    va_start(ap, e);
    for (char *a; (a = va_arg(ap, char *)) != NULL;)
        argv[argc++] = a;
    va_end(ap);
    memset(o, 0, sizeof(*o));
    di_status st = svc_opts_defaults(rows, N_ROWS, o, e);
    cr_assert_eq(st, DI_OK, "%s", e->msg);
    int next = 0, help = 0;
    st = svc_opts_parse(rows, N_ROWS, argc, argv, 1, o, &next, &help, e);
    if (st == DI_OK) {
        cr_assert_eq(next, argc);
        st = svc_opts_load_secrets(rows, N_ROWS, o, e);
    }
    return st;
}

/* Expects a failure whose message contains `want`. */
static void refuse(const char *want, ...)
{
    char *argv[32] = {"prog"};
    int argc = 1;
    va_list ap;
    va_start(ap, want);
    for (char *a; (a = va_arg(ap, char *)) != NULL;)
        argv[argc++] = a;
    va_end(ap);
    opts o;
    memset(&o, 0, sizeof(o));
    di_error e;
    svc_opts_defaults(rows, N_ROWS, &o, &e);
    int next, help;
    di_status st = svc_opts_parse(rows, N_ROWS, argc, argv, 1, &o, &next, &help, &e);
    cr_assert_neq(st, DI_OK, "accepted %s %s", argv[1], argc > 2 ? argv[2] : "");
    cr_assert(strstr(e.msg, want), "message \"%s\" lacks \"%s\"", e.msg, want);
    cr_assert_null(strchr(e.msg, '\n'));
    svc_opts_free(rows, N_ROWS, &o);
}

Test(options, defaults)
{
    opts o;
    di_error e;
    cr_assert_eq(parse(&o, &e, NULL), DI_OK, "%s", e.msg);
    cr_assert_str_eq(o.name, "demo");
    cr_assert_eq(o.bytes, 65536);
    cr_assert_eq(o.ms, 2000);
    cr_assert_eq(o.count, 3);
    cr_assert_eq(o.delta, -1);
    cr_assert_float_eq(o.ratio, 0.5, 1e-12);
    cr_assert_eq(o.verbose, 0);
    cr_assert_str_eq(o.listen, "127.0.0.1:0");
    cr_assert_str_eq(o.backend, "cpu");
    cr_assert_null(o.model);
    cr_assert_null(o.token);
}

Test(options, values_with_units_and_both_spellings)
{
    opts o;
    di_error e;
    cr_assert_eq(parse(&o, &e, "--bytes", "1.5GiB", "--wait=10m", "--count", "64", "--delta",
                       "100", "--ratio=1", "--verbose", "--listen", "[::1]:65535",
                       "--backend=cuda", "--name", "x", NULL),
                 DI_OK, "%s", e.msg);
    cr_assert_eq(o.bytes, 1610612736ull);
    cr_assert_eq(o.ms, 600000);
    cr_assert_eq(o.count, 64);
    cr_assert_eq(o.delta, 100);
    cr_assert_eq(o.verbose, 1);
    cr_assert_str_eq(o.listen, "[::1]:65535");
    cr_assert_str_eq(o.backend, "cuda");
    cr_assert_eq(parse(&o, &e, "--bytes", "4096", "--wait", "1", NULL), DI_OK);
    cr_assert_eq(o.bytes, 4096);
    cr_assert_eq(o.ms, 1);
    cr_assert_eq(parse(&o, &e, "--wait", "3d", "--bytes", "2G", NULL), DI_OK);
    cr_assert_eq(o.ms, 259200000ull);
    cr_assert_eq(o.bytes, 2147483648ull);
}

Test(options, bad_values_each_get_one_clear_line)
{
    refuse("unknown option --nope", "--nope", "1", NULL);
    refuse("--count needs a value (N)", "--count", NULL);
    refuse("--verbose takes no value", "--verbose=1", NULL);
    refuse("--count: 65 is outside [1, 64]", "--count", "65", NULL);
    refuse("--count: 0 is outside [1, 64]", "--count", "0", NULL);
    refuse("--count: \"-3\" is not a non-negative integer", "--count", "-3", NULL);
    refuse("--count: \"3x\" is not a non-negative integer", "--count", "3x", NULL);
    refuse("--delta: -2 is outside [-1, 100]", "--delta", "-2", NULL);
    refuse("--delta: \"1.5\" is not an integer", "--delta", "1.5", NULL);
    refuse("--ratio: \"nan\" is not a number", "--ratio", "nan", NULL);
    refuse("--ratio: 1.5 is outside [0, 1]", "--ratio", "1.5", NULL);
    refuse("--bytes: \"12XB\" is not a size (unknown unit \"XB\")", "--bytes", "12XB", NULL);
    refuse("--bytes: \"-1\" is not a size", "--bytes", "-1", NULL);
    refuse("--bytes: 1024 bytes is outside [4096, ", "--bytes", "1KiB", NULL);
    refuse("--bytes: size \"1e30\" is too large", "--bytes", "1e30", NULL);
    refuse("--wait: \"soon\" is not a duration", "--wait", "soon", NULL);
    refuse("--wait: 0 ms is outside [1, 604800000]", "--wait", "0s", NULL);
    refuse("--backend: \"tpu\" is not one of cpu|cuda", "--backend", "tpu", NULL);
    refuse("--listen: \"127.0.0.1:65536\": port 65536 outside 0..65535", "--listen",
           "127.0.0.1:65536", NULL);
    refuse("--listen: \"localhost\" has no port", "--listen", "localhost", NULL);
    refuse("--listen: \":80\" has no host", "--listen", ":80", NULL);
    refuse("--listen: \"h:-1\": port \"-1\" is not a number", "--listen", "h:-1", NULL);
    refuse("--listen: \"h:\" has no port", "--listen", "h:", NULL);
    refuse("--listen: \"::1:80\": bad character ':' in the host", "--listen", "::1:80", NULL);
    refuse("--listen: \"[::1]80\": an IPv6 host is written [ADDR]:PORT", "--listen",
           "[::1]80", NULL);
    refuse("--listen: \"a b:1\": bad character ' ' in the host", "--listen", "a b:1", NULL);
    refuse("--listen: \"h:999999999999\": port 999999999999 outside 0..65535", "--listen",
           "h:999999999999", NULL);
    refuse("--model: cannot read /nonexistent/m.json", "--model", "/nonexistent/m.json", NULL);
    refuse("--model: /tmp is a directory", "--model", "/tmp", NULL);
    refuse("--out: cannot write in /nonexistent", "--out", "/nonexistent/port", NULL);
    refuse("--token-file: cannot read /nonexistent/token", "--token-file", "/nonexistent/token",
           NULL);
}

Test(options, stops_at_the_first_argument_and_sees_help)
{
    char *argv[] = {"prog", "--count", "2", "-h", "stats", "--count", "9"};
    opts o;
    memset(&o, 0, sizeof(o));
    di_error e;
    int next = 0, help = 0;
    cr_assert_eq(svc_opts_parse(rows, N_ROWS, 7, argv, 1, &o, &next, &help, &e), DI_OK);
    cr_assert_eq(next, 4);
    cr_assert_eq(help, 1);
    cr_assert_eq(o.count, 2);
}

static char *write_temp(const char *text)
{
    char *path = strdup("/tmp/di-options-XXXXXX");
    int fd = mkstemp(path);
    cr_assert_geq(fd, 0);
    cr_assert_eq(write(fd, text, strlen(text)), (ssize_t)strlen(text));
    close(fd);
    return path;
}

Test(options, secrets_from_a_file_or_the_environment_never_argv)
{
    char *f = write_temp("  s3cret-token \nsecond line\n");
    char *empty = write_temp("\n\n");
    opts o;
    di_error e;
    unsetenv("DI_TEST_OPTIONS_TOKEN");
    cr_assert_eq(parse(&o, &e, "--token-file", f, NULL), DI_OK, "%s", e.msg);
    cr_assert_str_eq(o.token, "s3cret-token");
    svc_opts_free(rows, N_ROWS, &o);
    cr_assert_null(o.token);
    /* The environment when no file is given; the file wins over it. */
    setenv("DI_TEST_OPTIONS_TOKEN", "from-env\n", 1);
    cr_assert_eq(parse(&o, &e, NULL), DI_OK);
    cr_assert_str_eq(o.token, "from-env");
    svc_opts_free(rows, N_ROWS, &o);
    cr_assert_eq(parse(&o, &e, "--token-file", f, NULL), DI_OK);
    cr_assert_str_eq(o.token, "s3cret-token");
    svc_opts_free(rows, N_ROWS, &o);
    /* Empty secrets are refused; none at all is allowed. */
    setenv("DI_TEST_OPTIONS_TOKEN", "  ", 1);
    cr_assert_eq(parse(&o, &e, NULL), DI_EINVAL);
    cr_assert(strstr(e.msg, "DI_TEST_OPTIONS_TOKEN holds an empty secret"), "%s", e.msg);
    unsetenv("DI_TEST_OPTIONS_TOKEN");
    cr_assert_eq(parse(&o, &e, "--token-file", empty, NULL), DI_EINVAL);
    cr_assert(strstr(e.msg, "holds an empty secret"), "%s", e.msg);
    svc_opts_free(rows, N_ROWS, &o);
    cr_assert_eq(parse(&o, &e, NULL), DI_OK);
    cr_assert_null(o.token);
    /* There is no option that takes the secret itself. */
    refuse("unknown option --token", "--token", "s3cret-token", NULL);
    unlink(f);
    unlink(empty);
    free(f);
    free(empty);
}

Test(options, files_must_exist_and_output_directories_too)
{
    char *f = write_temp("{}");
    opts o;
    di_error e;
    cr_assert_eq(parse(&o, &e, "--model", f, "--out", "/tmp/di-options-port", NULL), DI_OK,
                 "%s", e.msg);
    cr_assert_str_eq(o.model, f);
    cr_assert_eq(parse(&o, &e, "--out", "relative-port-file", NULL), DI_OK, "%s", e.msg);
    unlink(f);
    free(f);
}

Test(options, help_lists_every_row_with_default_and_bounds)
{
    char *buf = NULL;
    size_t len = 0;
    FILE *f = open_memstream(&buf, &len);
    svc_opts_print(f, rows, N_ROWS);
    fclose(f);
    for (size_t i = 0; i < N_ROWS; i++) {
        char want[64];
        snprintf(want, sizeof(want), "--%s", rows[i].name);
        cr_assert(strstr(buf, want), "--help lacks %s", want);
    }
    cr_assert(strstr(buf, "--bytes SIZE"));
    cr_assert(strstr(buf, "[64KiB]"));
    cr_assert(strstr(buf, "(1..64)"));
    cr_assert(strstr(buf, "(cpu|cuda)"));
    cr_assert(strstr(buf, "(else $DI_TEST_OPTIONS_TOKEN)"));
    free(buf);
}

Test(options, hostport_helpers)
{
    char host[64];
    int port = -1;
    di_error e;
    cr_assert_eq(svc_parse_hostport("[::1]:0", host, sizeof(host), &port, &e), DI_OK);
    cr_assert_str_eq(host, "::1");
    cr_assert_eq(port, 0);
    cr_assert_eq(svc_parse_hostport("node-3.example:7001", host, sizeof(host), &port, &e),
                 DI_OK);
    cr_assert_str_eq(host, "node-3.example");
    cr_assert_eq(port, 7001);
    cr_assert_eq(svc_parse_hostport("averyveryverylonghostname:1", host, 8, &port, &e),
                 DI_ERANGE);
    cr_assert_eq(port, 7001, "outputs untouched on failure");
    cr_assert(svc_hostport_is_loopback("127.0.0.1:0"));
    cr_assert(svc_hostport_is_loopback("127.3.2.1:80"));
    cr_assert(svc_hostport_is_loopback("[::1]:80"));
    cr_assert(svc_hostport_is_loopback("localhost:80"));
    cr_assert(!svc_hostport_is_loopback("0.0.0.0:80"));
    cr_assert(!svc_hostport_is_loopback("[::]:80"));
    cr_assert(!svc_hostport_is_loopback("10.0.0.1:80"));
    cr_assert(!svc_hostport_is_loopback("127.0.0.1"));
}
