/* di-plan: planning calculations for operators. JSON in on stdin, JSON out on stdout.
 *
 *   di-plan COMMAND [--pretty] < input.json
 *
 * Exit status: 0 on success; 1 on bad input or a failed calculation, with one line
 * "di-plan COMMAND: error: ..." on stderr; 2 on a usage error (unknown command or option).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/util/outclose.h"
#include "common/util/json_read.h"
#include "tools/plan/plan_cmd.h"

#define PLAN_MAX_INPUT (256u << 20) /* bytes of JSON read from stdin */

enum { EXIT_BAD_INPUT = 1, EXIT_USAGE = 2 };

static void print_usage(FILE *f)
{
    fprintf(f, "usage: di-plan COMMAND [--pretty] < input.json > output.json\n"
               "       di-plan [COMMAND] --help\n\n"
               "Planning calculations for deepinfer-c: reads one JSON object on stdin, writes\n"
               "one JSON object on stdout. Bad input prints one line on stderr and exits 1;\n"
               "an unknown command or option exits 2.\n\ncommands:\n");
    for (size_t i = 0; i < plan_num_commands; i++)
        fprintf(f, "  %-8s %s\n", plan_commands[i].name, plan_commands[i].help);
    fprintf(f, "\nRun 'di-plan COMMAND --help' for its input and output keys.\n");
}

static void print_command_help(const plan_command *c)
{
    printf("usage: di-plan %s [--pretty] < input.json\n\n%s\n\ninput keys:\n", c->name,
           c->help);
    for (const plan_key *k = c->inputs; k->name; k++)
        printf("  %-20s %s%s\n", k->name, k->required ? "" : "(optional) ", k->help);
    printf("\noutput keys: %s\n\nexample:\n  echo '%s' | di-plan %s\n", c->outputs, c->example,
           c->name);
}

static const plan_command *find_command(const char *name)
{
    for (size_t i = 0; i < plan_num_commands; i++)
        if (strcmp(plan_commands[i].name, name) == 0)
            return &plan_commands[i];
    return NULL;
}

/* Reads all of stdin into a malloc'd buffer. */
static di_status read_stdin(char **out, size_t *len, di_error *err)
{
    size_t cap = 1 << 16, n = 0;
    char *buf = malloc(cap);
    if (!buf)
        return di_fail(err, DI_ENOMEM, "out of memory reading stdin");
    for (;;) {
        if (n == cap) {
            if (cap >= PLAN_MAX_INPUT) {
                free(buf);
                return di_fail(err, DI_EINVAL, "input larger than %u bytes", PLAN_MAX_INPUT);
            }
            char *nb = realloc(buf, cap * 2);
            if (!nb) {
                free(buf);
                return di_fail(err, DI_ENOMEM, "out of memory reading stdin");
            }
            buf = nb;
            cap *= 2;
        }
        size_t got = fread(buf + n, 1, cap - n, stdin);
        n += got;
        if (got == 0)
            break;
    }
    if (ferror(stdin)) {
        free(buf);
        return di_fail(err, DI_EIO, "reading stdin failed");
    }
    *out = buf;
    *len = n;
    return DI_OK;
}

/* Parses stdin, checks its keys against the row and runs the handler. */
static di_status run_command(const plan_command *c, json_t **out, di_error *err)
{
    char *text = NULL;
    size_t len = 0;
    json_t *in = NULL;
    di_status st = read_stdin(&text, &len, err);
    if (st != DI_OK)
        return st;
    if ((st = di_json_parse(text, len, "input", &in, err)) == DI_OK &&
        (st = plan_check_keys(in, c->inputs, "input", err)) == DI_OK)
        st = c->run(in, out, err);
    json_decref(in);
    free(text);
    return st;
}

int main(int argc, char **argv)
{
    if (argc < 2) {
        print_usage(stderr);
        return EXIT_USAGE;
    }
    if (strcmp(argv[1], "--help") == 0 || strcmp(argv[1], "-h") == 0) {
        print_usage(stdout);
        return di_close_stdout("di-plan", 0);
    }
    const plan_command *c = find_command(argv[1]);
    if (!c) {
        fprintf(stderr, "di-plan: unknown command '%s' (try di-plan --help)\n", argv[1]);
        return EXIT_USAGE;
    }
    size_t flags = JSON_REAL_PRECISION(12);
    for (int i = 2; i < argc; i++) {
        if (strcmp(argv[i], "--help") == 0 || strcmp(argv[i], "-h") == 0) {
            print_command_help(c);
            return di_close_stdout("di-plan", 0);
        } else if (strcmp(argv[i], "--pretty") == 0) {
            flags |= JSON_INDENT(2);
        } else {
            fprintf(stderr, "di-plan %s: unknown option '%s' (try di-plan %s --help)\n",
                    c->name, argv[i], c->name);
            return EXIT_USAGE;
        }
    }
    json_t *out = NULL;
    di_error err = {0};
    if (run_command(c, &out, &err) != DI_OK) {
        fprintf(stderr, "di-plan %s: error: %s\n", c->name, err.msg);
        return EXIT_BAD_INPUT;
    }
    json_dumpf(out, stdout, flags);
    json_decref(out);
    fputc('\n', stdout);
    char who[64];
    snprintf(who, sizeof(who), "di-plan %s", c->name);
    return di_close_stdout(who, 0);
}
