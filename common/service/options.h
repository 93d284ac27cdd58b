/* options.h: the command-line options of a service as a table (H2). One row per option: name,
 * kind, where the value goes (offsetof into the program's options struct), default, bounds,
 * metavar, help. Parsing, validation, defaults and --help are all generated from the rows.
 *
 * Values: sizes take units (4096, 64KiB, 1.5GiB, 2G: powers of 1024), durations take units
 * (500ms, 60s, 10m, 2h, 3d; a bare number is ms), HOST:PORT is checked by the project's one
 * parser (common/util/hostport.h: a host, or [v6] in brackets, and a port 0..65535), input files must be readable when parsed, directories must
 * exist, output files must have an existing directory. Secrets never come from argv: a SECRET
 * row's value is the path of a file whose first line is the secret; without the option, the
 * row's environment variable is read. String values point into argv (they live as long as
 * it does); secrets are malloc'd and released by svc_opts_free.
 */
#ifndef DI_SERVICE_OPTIONS_H
#define DI_SERVICE_OPTIONS_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "common/util/status.h"

typedef enum svc_opt_kind {
    SVC_OPT_STRING = 0,   /* const char * */
    SVC_OPT_SIZE = 1,     /* uint64_t bytes */
    SVC_OPT_DURATION = 2, /* uint64_t ms */
    SVC_OPT_UINT = 3,     /* uint64_t */
    SVC_OPT_INT = 4,      /* int64_t */
    SVC_OPT_DOUBLE = 5,   /* double */
    SVC_OPT_FLAG = 6,     /* int set to 1; takes no value */
    SVC_OPT_HOSTPORT = 7, /* const char * "host:port", port 0..65535 (1..65535 with min 1) */
    SVC_OPT_CHOICE = 8,   /* const char *, one of the row's `extra` ("cpu|cuda") */
    SVC_OPT_FILE = 9,     /* const char * path of a readable file */
    SVC_OPT_OUTFILE = 10, /* const char * path whose directory exists (written later) */
    SVC_OPT_SECRET = 11,  /* char * (malloc'd): first line of the file given, else of env */
    SVC_OPT_DIR = 12,     /* const char * path of an existing directory */
} svc_opt_kind;

/* One option row. */
typedef struct svc_opt {
    const char *name;    /* "dram-bytes": given as --dram-bytes VALUE or --dram-bytes=VALUE */
    svc_opt_kind kind;   /* how the value parses and what type the field has */
    size_t offset;       /* offsetof the field in the options struct */
    const char *def;     /* default, parsed like a value; NULL: 0 / NULL (SECRET: none) */
    double min, max;     /* bounds of numbers, inclusive (sizes in bytes, durations in ms);
                            max 0 = no upper bound */
    const char *metavar; /* "SIZE" in --help */
    const char *help;    /* one line */
    const char *extra;   /* CHOICE: "a|b|c"; SECRET: the environment variable; else NULL */
} svc_opt;

/* Sets every row's default. DI_EINVAL when a default does not parse (a bug in the table). */
di_status svc_opts_defaults(const svc_opt *rows, size_t n, void *opts, di_error *err);

/* Parses argv[first..argc) into opts. Stops at the first argument that is not an option and
 * stores its index in *next (argc when all were options). *help is 1 on --help or -h.
 * Errors (DI_EINVAL or DI_ERANGE) name the option and the reason in one line ("--listen:
 * port 70000 is outside 0..65535"). A SECRET option's file is read here. opts may be partly
 * written on failure; call svc_opts_free either way. */
di_status svc_opts_parse(const svc_opt *rows, size_t n, int argc, char **argv, int first,
                         void *opts, int *next, int *help, di_error *err);

/* Fills every SECRET row not given on the command line from its environment variable (none:
 * NULL). DI_EINVAL for an empty secret. */
di_status svc_opts_load_secrets(const svc_opt *rows, size_t n, void *opts, di_error *err);

/* Frees the secrets (wiping them first) and sets them to NULL. */
void svc_opts_free(const svc_opt *rows, size_t n, void *opts);

/* Prints one block per row: "--name METAVAR  help [default] (bounds, choices, env)". */
void svc_opts_print(FILE *f, const svc_opt *rows, size_t n);

/* Value parsers, also for programs' own checks. Outputs written only on success. */
di_status svc_parse_size(const char *s, uint64_t *bytes, di_error *err);
di_status svc_parse_duration(const char *s, uint64_t *ms, di_error *err);
/* "127.0.0.1:8000", "localhost:0", "[::1]:9000", checked by the project's one HOST:PORT parser
 * (common/util/hostport.h, port 0 allowed). host receives the host without brackets. */
di_status svc_parse_hostport(const char *s, char *host, size_t host_len, int *port,
                             di_error *err);
/* 1 when a HOST:PORT names a loopback host (127.0.0.0/8, ::1, localhost). */
int svc_hostport_is_loopback(const char *s);

#endif
