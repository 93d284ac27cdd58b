/* The engine services' shared options (common/service/engine_opts.h): the rows parse through
 * the options table with the base rows, and the rules across rows refuse bad combinations
 * with one line each. */
#include <criterion/criterion.h>
#include <stdlib.h>
#include <string.h>

#include "common/service/engine_opts.h"
#include "common/service/service.h"

typedef struct eng_opts {
    svc_base_opts base;
    svc_engine_opts eng;
} eng_opts;

static const svc_opt rows[] = {
    SVC_BASE_ROWS(eng_opts, base, "127.0.0.1:0", "30s"),
    SVC_ENGINE_ROWS(eng_opts, eng),
};
#define N_ROWS (sizeof(rows) / sizeof(rows[0]))

/* Parses argv (NULL-terminated, after the program name), loads secrets, runs the check. */
static di_status run(eng_opts *o, di_error *e, const char *const *args)
{
    char *argv[32] = {"di-test"};
    int argc = 1;
    for (; *args; args++)
        argv[argc++] = (char *)*args;
    memset(o, 0, sizeof(*o));
    di_status st = svc_opts_defaults(rows, N_ROWS, o, e);
    cr_assert_eq(st, DI_OK, "%s", e->msg);
    int next = 0, help = 0;
    st = svc_opts_parse(rows, N_ROWS, argc, argv, 1, o, &next, &help, e);
    if (st == DI_OK)
        st = svc_opts_load_secrets(rows, N_ROWS, o, e);
    if (st == DI_OK)
        st = svc_engine_check(&o->eng, e);
    return st;
}

static void refused(const char *want, const char *const *args)
{
    eng_opts o;
    di_error e;
    di_status st = run(&o, &e, args);
    cr_assert(st == DI_EINVAL || st == DI_ERANGE, "%s %s: %s", args[0] ? args[0] : "(none)",
              di_status_name(st), e.msg);
    cr_assert(strstr(e.msg, want), "\"%s\" lacks \"%s\"", e.msg, want);
    svc_opts_free(rows, N_ROWS, &o);
}

Test(engine_opts, a_full_command_line)
{
    unsetenv("DI_KVSTORE_TOKEN");
    unsetenv("DI_ENGINE_TOKEN");
    eng_opts o;
    di_error e;
    const char *args[] = {"--config", "demo", "--weights-seed", "7", "--backend", "cuda",
                          "--threads", "4", "--kvstore", "127.0.0.1:9470", "--rank", "2",
                          "--world", "4", "--listen", "127.0.0.1:0", NULL};
    cr_assert_eq(run(&o, &e, args), DI_OK, "%s", e.msg);
    cr_assert_str_eq(o.eng.config, "demo");
    cr_assert_eq(o.eng.weights_seed, 7);
    cr_assert_str_eq(o.eng.backend, "cuda");
    cr_assert_eq(o.eng.threads, 4);
    cr_assert_str_eq(o.eng.kvstore, "127.0.0.1:9470");
    cr_assert_eq(o.eng.rank, 2);
    cr_assert_eq(o.eng.world, 4);
    cr_assert_null(o.eng.token);
    const char *model[] = {"--model", "/tmp", NULL};
    cr_assert_eq(run(&o, &e, model), DI_OK, "%s", e.msg);
    cr_assert_str_eq(o.eng.model_dir, "/tmp");
    cr_assert_str_eq(o.eng.backend, "cpu");
    cr_assert_eq(o.eng.world, 1);
}

Test(engine_opts, bad_combinations_each_get_one_line)
{
    unsetenv("DI_KVSTORE_TOKEN");
    refused("give either --model DIR or --config NAME|FILE", (const char *[]){NULL});
    refused("not both", (const char *[]){"--model", "/tmp", "--config", "demo", NULL});
    refused("--weights-seed goes with --config",
            (const char *[]){"--model", "/tmp", "--weights-seed", "3", NULL});
    refused("--rank 4 is not below --world 4",
            (const char *[]){"--config", "demo", "--rank", "4", "--world", "4", NULL});
    refused("--world: 0 is outside [1, 1024]", (const char *[]){"--config", "demo", "--world",
                                                                "0", NULL});
    refused("--kvstore: \"127.0.0.1:0\": port 0 outside 1..65535",
            (const char *[]){"--config", "demo", "--kvstore", "127.0.0.1:0", NULL});
    refused("--kvstore: \"nohost\" has no port",
            (const char *[]){"--config", "demo", "--kvstore", "nohost", NULL});
    refused("--backend: \"tpu\" is not one of cpu|cuda",
            (const char *[]){"--config", "demo", "--backend", "tpu", NULL});
    refused("--model: /etc/hostname is not a directory",
            (const char *[]){"--model", "/etc/hostname", NULL});
    refused("--threads: 0 is outside [1, 256]",
            (const char *[]){"--config", "demo", "--threads", "0", NULL});
    setenv("DI_KVSTORE_TOKEN", "abc", 1);
    refused("without --kvstore", (const char *[]){"--config", "demo", NULL});
    unsetenv("DI_KVSTORE_TOKEN");
}

Test(engine_opts, tokens_from_the_environment)
{
    setenv("DI_KVSTORE_TOKEN", "store-token", 1);
    setenv("DI_ENGINE_TOKEN", "client-token\n", 1);
    eng_opts o;
    di_error e;
    const char *args[] = {"--config", "tiny", "--kvstore", "[::1]:9470", NULL};
    cr_assert_eq(run(&o, &e, args), DI_OK, "%s", e.msg);
    cr_assert_str_eq(o.eng.kvstore_token, "store-token");
    cr_assert_str_eq(o.eng.token, "client-token");
    svc_opts_free(rows, N_ROWS, &o);
    cr_assert_null(o.eng.token);
}
