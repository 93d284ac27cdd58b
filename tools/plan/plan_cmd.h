/* plan_cmd.h: the subcommands of di-plan, as a table, and the JSON helpers they share.
 *
 * Each subcommand is one row of plan_commands (commands.c): its name, a one-line help, its
 * input keys, its output keys, an example input and its handler. main.c generates --help,
 * rejects unknown and missing keys from the row, then calls the handler with the parsed
 * input. A new subcommand is one row plus its handler.
 */
#ifndef DI_TOOLS_PLAN_CMD_H
#define DI_TOOLS_PLAN_CMD_H

#include <jansson.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/util/status.h"

/* One input key of a subcommand. */
typedef struct plan_key {
    const char *name; /* JSON key; NULL ends a list */
    bool required;    /* missing (or null) is an error */
    const char *help; /* one line: meaning, unit, default */
} plan_key;

/* Reads the input object (keys already checked against the row) and builds the output
 * object. Returns DI_OK with *out set (caller owns it), or a di_status with a one-line
 * message in err that names the offending key; *out is untouched on failure. */
typedef di_status (*plan_handler)(const json_t *in, json_t **out, di_error *err);

/* One subcommand. */
typedef struct plan_command {
    const char *name;       /* argv[1] */
    const char *help;       /* one line */
    const plan_key *inputs; /* input keys, ending with a {NULL} row */
    const char *outputs;    /* output keys, one line */
    const char *example;    /* an example input (one JSON line) */
    plan_handler run;       /* the handler */
} plan_command;

/* The table and its length (commands.c). */
extern const plan_command plan_commands[];
extern const size_t plan_num_commands;

/* Handlers (cmd_*.c). */
di_status plan_cmd_eplb(const json_t *in, json_t **out, di_error *err);
di_status plan_cmd_varlen(const json_t *in, json_t **out, di_error *err);
di_status plan_cmd_graphs(const json_t *in, json_t **out, di_error *err);
di_status plan_cmd_store(const json_t *in, json_t **out, di_error *err);
di_status plan_cmd_kv(const json_t *in, json_t **out, di_error *err);

/* ---- JSON helpers (plan_json.c) ---------------------------------------------------------- */

/* obj must be an object whose keys all appear in keys and which has every required key.
 * what names obj in messages ("input", "server", "retention[1]"). DI_EINVAL otherwise. */
di_status plan_check_keys(const json_t *obj, const plan_key *keys, const char *what,
                          di_error *err);

/* A JSON array of arrays of numbers, each row possibly of a different length, flattened:
 * *vals holds every number row after row, (*row_len)[i] the length of row i, *rows the row
 * count. Each number must lie in [lo, hi]. With equal_rows, every row must have the length of
 * row 0 and rows must not be empty. Messages name the key and indices ("key 'load'[1][2]:
 * ..."). The caller frees *vals and *row_len; nothing is written on failure. */
typedef struct plan_matrix {
    double *vals;     /* all numbers, row after row; owned */
    size_t *row_len;  /* [rows] length of each row; owned */
    size_t rows;      /* number of rows */
    size_t total;     /* number of numbers */
} plan_matrix;

di_status plan_read_matrix(const json_t *obj, const char *key, double lo, double hi,
                           bool equal_rows, plan_matrix *out, di_error *err);
void plan_matrix_free(plan_matrix *m);

/* A number that must be an integer in [lo, hi] (messages name key[i][j]). */
di_status plan_matrix_int_check(const plan_matrix *m, const char *key, double lo, double hi,
                                di_error *err);

/* Sets obj[key] = value, taking value (NULL counts as out of memory). DI_ENOMEM on failure,
 * with value released. */
di_status plan_set(json_t *obj, const char *key, json_t *value, di_error *err);

/* Appends value to array, taking value (NULL counts as out of memory). DI_ENOMEM on failure. */
di_status plan_set_append(json_t *array, json_t *value, di_error *err);

/* A new JSON array of n integers, or NULL when out of memory. */
json_t *plan_u32_array(const uint32_t *v, size_t n);

#endif
