/* cli.h: command-line helpers shared by di-kvstore and di-kvctl: a table-driven option parser
 * (one row per option: name, kind, default, where it goes, help), sizes with units, durations
 * with units, and token files. --help is generated from the rows. */
#ifndef DI_KVSTORE_CLI_H
#define DI_KVSTORE_CLI_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "common/util/status.h"

typedef enum kvcli_kind {
    KVCLI_STRING = 0,   /* const char * */
    KVCLI_SIZE = 1,     /* uint64_t bytes: 4096, 64KiB, 1.5GiB, 2G (powers of 1024) */
    KVCLI_DURATION = 2, /* uint64_t ms: 500ms, 60s, 10m, 2h, 3d; a bare number is ms */
    KVCLI_UINT = 3,     /* uint64_t */
    KVCLI_DOUBLE = 4,   /* double */
    KVCLI_FLAG = 5,     /* int, set to 1; takes no value */
    KVCLI_INT = 6,      /* int64_t (may be negative) */
    KVCLI_ADDR = 7,     /* const char *, checked HOST:PORT with a port in 1..65535 */
    KVCLI_LISTEN = 8,   /* const char *, checked HOST:PORT with a port in 0..65535 (0: any) */
} kvcli_kind;

/* One option row. */
typedef struct kvcli_opt {
    const char *name;     /* "dram-bytes" (given as --dram-bytes VALUE or --dram-bytes=VALUE) */
    kvcli_kind kind;      /* how the value parses */
    size_t offset;        /* offsetof the field in the options struct */
    const char *def;      /* default, parsed like a value; NULL: none (0 / NULL) */
    double min, max;      /* bounds for numbers (inclusive); max 0 = unbounded */
    const char *metavar;  /* "SIZE" */
    const char *help;     /* one line */
} kvcli_opt;

/* Applies the defaults of every row to opts. DI_EINVAL if a default fails to parse. */
di_status kvcli_defaults(const kvcli_opt *rows, size_t n, void *opts, di_error *err);
/* Parses argv[first..argc) as options into opts. Stops at the first argument that is not an
 * option and stores its index in *next (argc when all were options). DI_EINVAL with the
 * option and the reason ("--dram-bytes: \"12XB\" is not a size") on bad input; *help set to 1
 * on --help or -h. */
di_status kvcli_parse(const kvcli_opt *rows, size_t n, int argc, char **argv, int first,
                      void *opts, int *next, int *help, di_error *err);
/* Prints one line per row: name, metavar, help and default. */
void kvcli_print_options(FILE *f, const kvcli_opt *rows, size_t n);

di_status kvcli_parse_size(const char *s, uint64_t *out, di_error *err);
di_status kvcli_parse_duration(const char *s, uint64_t *out_ms, di_error *err);
/* "1.50 GiB", "114048 B": a short human-readable size. */
void kvcli_format_size(uint64_t bytes, char *buf, size_t n);
/* "2d 23h", "59s", "350ms", "never" (for UINT64_MAX). */
void kvcli_format_duration(uint64_t ms, char *buf, size_t n);

/* A token: the first line of a file (trailing whitespace removed), else the environment
 * variable env, else NULL. DI_ENOENT/DI_EIO for an unreadable file, DI_EINVAL for an empty
 * token. *out is malloc'd. */
di_status kvcli_token(const char *file, const char *env, char **out, di_error *err);

#endif
