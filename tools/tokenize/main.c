/* di-tokenize: text <-> token ids with a HF tokenizer.json, the DeepSeek chat format, and
 * Engram's compressed-token map.
 *
 *   di-tokenize [--tokenizer FILE] [--bos]          UTF-8 text on stdin -> JSON ids on stdout
 *   di-tokenize --decode [--skip-special]           JSON ids on stdin -> text on stdout
 *   di-tokenize --chat                              JSON messages on stdin -> prompt ids
 *   di-tokenize --engram-map FILE [--vocab-size N] [--pad-id N]
 *
 * The tokenizer: --tokenizer, else $DI_TOKENIZER, else data/tokenizer/deepseek-v3/
 * tokenizer.json under the source tree (deploy/local/install-deps.sh puts it there).
 */
#include <errno.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/util/outclose.h"
#include "common/tokenizer/tokenizer.h"
#include "common/util/json_read.h"

#define DEFAULT_TOKENIZER TOK_DEFAULT_FILE
#define MAX_VOCAB (1 << 24) /* --vocab-size at most (the map is 4 bytes an id) */

/* What the command line asked for. */
typedef struct cli_opts {
    const char *tokenizer;  /* tokenizer.json path, NULL: the default */
    const char *engram_map; /* output path of the Engram map ("-": stdout), NULL: not asked */
    bool decode;            /* ids -> text */
    bool chat;              /* messages -> prompt ids */
    bool bos;               /* prepend BOS when encoding */
    bool skip_special;      /* drop special tokens when decoding */
    bool help;              /* print usage */
    int64_t vocab_size;     /* --vocab-size, 0: the tokenizer's */
    int64_t pad_id;         /* --pad-id (MODEL.md: engram_pad_token_id 2) */
} cli_opts;

typedef enum opt_kind { OPT_FLAG, OPT_STRING, OPT_INT } opt_kind;

typedef struct cli_opt_row {
    const char *name;  /* long option */
    opt_kind kind;     /* whether and what argument it takes */
    size_t offset;     /* field of cli_opts it sets */
    const char *arg;   /* argument name for --help */
    const char *help;  /* one line */
} cli_opt_row;

#define FIELD(f) offsetof(cli_opts, f)

static const cli_opt_row OPTIONS[] = {
    {"--tokenizer", OPT_STRING, FIELD(tokenizer), "FILE",
     "tokenizer.json (default $DI_TOKENIZER, else " DEFAULT_TOKENIZER ")"},
    {"--decode", OPT_FLAG, FIELD(decode), NULL, "read a JSON array of ids, write the text"},
    {"--chat", OPT_FLAG, FIELD(chat), NULL,
     "read a JSON list of {\"role\", \"content\"} messages, write the ids of the DeepSeek "
     "prompt for generation (it starts with BOS)"},
    {"--bos", OPT_FLAG, FIELD(bos), NULL,
     "prepend the BOS id (tokenizer_config.json's bos_token) to the encoded text"},
    {"--skip-special", OPT_FLAG, FIELD(skip_special), NULL, "with --decode: drop special tokens"},
    {"--engram-map", OPT_STRING, FIELD(engram_map), "FILE",
     "write Engram's compressed-token map as JSON to FILE ('-': stdout); reads no input"},
    {"--vocab-size", OPT_INT, FIELD(vocab_size), "N",
     "with --engram-map: the model's vocabulary size (default: the tokenizer's); ids beyond "
     "the tokenizer map to the pad token's compressed id"},
    {"--pad-id", OPT_INT, FIELD(pad_id), "N", "with --engram-map: the pad token id (default 2)"},
    {"--help", OPT_FLAG, FIELD(help), NULL, "show this help"},
};

#define N_OPTIONS (sizeof OPTIONS / sizeof OPTIONS[0])

static void usage(FILE *f)
{
    fprintf(f, "usage: di-tokenize [options] < input > output\n"
               "UTF-8 text on stdin -> JSON array of token ids on stdout (no BOS unless --bos).\n"
               "options:\n");
    for (size_t i = 0; i < N_OPTIONS; i++) {
        char head[48];
        snprintf(head, sizeof head, "%s%s%s", OPTIONS[i].name, OPTIONS[i].arg ? " " : "",
                 OPTIONS[i].arg ? OPTIONS[i].arg : "");
        fprintf(f, "  %-22s %s\n", head, OPTIONS[i].help);
    }
}

static int fail(const char *fmt, const char *detail)
{
    fprintf(stderr, "di-tokenize: ");
    fprintf(stderr, fmt, detail);
    fprintf(stderr, "\n");
    return 1;
}

static int parse_args(int argc, char **argv, cli_opts *o)
{
    for (int i = 1; i < argc; i++) {
        const cli_opt_row *row = NULL;
        for (size_t k = 0; k < N_OPTIONS && !row; k++)
            if (strcmp(argv[i], OPTIONS[k].name) == 0)
                row = &OPTIONS[k];
        if (!row)
            return fail("unknown option '%s' (see --help)", argv[i]);
        char *field = (char *)o + row->offset;
        if (row->kind == OPT_FLAG) {
            *(bool *)field = true;
            continue;
        }
        if (i + 1 >= argc)
            return fail("option %s needs an argument", row->name);
        const char *arg = argv[++i];
        if (row->kind == OPT_STRING) {
            *(const char **)field = arg;
            continue;
        }
        char *end;
        errno = 0;
        long long v = strtoll(arg, &end, 10);
        if (errno || *end || end == arg || v < 0 || v > INT32_MAX)
            return fail("'%s' is not an integer in [0, 2147483647]", arg);
        *(int64_t *)field = v;
    }
    if (o->vocab_size > MAX_VOCAB) {
        char v[32];
        snprintf(v, sizeof v, "%lld", (long long)o->vocab_size);
        return fail("--vocab-size %s is above the largest vocabulary handled, 16777216", v);
    }
    if (o->decode + o->chat + (o->engram_map != NULL) > 1)
        return fail("%s", "--decode, --chat and --engram-map exclude each other");
    if (o->bos && (o->decode || o->chat))
        return fail("%s", "--bos applies to plain encoding only (the chat format starts with BOS)");
    return 0;
}

static int read_stdin(char **data, size_t *len)
{
    size_t cap = 1 << 16, n = 0;
    char *p = malloc(cap);
    while (p) {
        size_t k = fread(p + n, 1, cap - n - 1, stdin);
        n += k;
        if (k == 0)
            break;
        if (n + 1 == cap) {
            if (cap > TOK_MAX_INPUT_BYTES) {
                free(p);
                return fail("%s", "input exceeds the 1 GiB limit");
            }
            char *q = realloc(p, cap * 2);
            if (!q)
                free(p);
            p = q;
            cap *= 2;
        }
    }
    if (!p)
        return fail("%s", "out of memory reading stdin");
    if (ferror(stdin)) {
        free(p);
        return fail("reading stdin: %s", strerror(errno));
    }
    p[n] = '\0';
    *data = p;
    *len = n;
    return 0;
}

static int write_ids(const tok_ids *ids)
{
    putchar('[');
    for (size_t i = 0; i < ids->n; i++)
        printf(i ? ",%d" : "%d", ids->v[i]);
    printf("]\n");
    return 0;
}

static int run_encode(const tok_tokenizer *t, const cli_opts *o, const char *in, size_t n)
{
    tok_ids ids = {0};
    di_error e;
    int32_t bos = tok_bos_id(t);
    if (o->bos && bos < 0)
        return fail("%s", "--bos: no BOS token known (tokenizer_config.json with a bos_token "
                          "must sit next to tokenizer.json)");
    di_status st = o->bos ? tok_ids_push(&ids, bos, &e) : DI_OK;
    if (!st)
        st = tok_encode(t, in, n, &ids, &e);
    int rc = st ? fail("stdin: %s", e.msg) : write_ids(&ids);
    tok_ids_free(&ids);
    return rc;
}

static int run_chat(const tok_tokenizer *t, const char *in, size_t n)
{
    json_t *msgs = NULL;
    tok_ids ids = {0};
    di_error e;
    di_status st = di_json_parse(in, n, "stdin", &msgs, &e);
    if (!st)
        st = tok_chat_encode_json(t, msgs, true, &ids, &e);
    int rc = st ? fail("%s", e.msg) : write_ids(&ids);
    json_decref(msgs);
    tok_ids_free(&ids);
    return rc;
}

static int run_decode(const tok_tokenizer *t, const cli_opts *o, const char *in, size_t n)
{
    json_t *arr = NULL;
    di_error e;
    if (di_json_parse(in, n, "stdin", &arr, &e))
        return fail("%s", e.msg);
    size_t k = json_array_size(arr);
    int32_t *ids = malloc((k ? k : 1) * sizeof *ids);
    int rc = ids ? 0 : fail("%s", "out of memory");
    if (!json_is_array(arr))
        rc = fail("%s", "stdin: expected a JSON array of token ids");
    for (size_t i = 0; i < k && !rc; i++) {
        const json_t *v = json_array_get(arr, i);
        char where[32];
        snprintf(where, sizeof where, "%zu", i);
        if (!json_is_integer(v) || json_integer_value(v) < INT32_MIN ||
            json_integer_value(v) > INT32_MAX)
            rc = fail("stdin: element %s is not a 32-bit integer", where);
        else
            ids[i] = (int32_t)json_integer_value(v);
    }
    char *text = NULL;
    size_t len = 0;
    unsigned flags = o->skip_special ? TOK_DECODE_SKIP_SPECIAL : 0;
    if (!rc && tok_decode(t, ids, k, flags, &text, &len, &e))
        rc = fail("stdin: %s", e.msg);
    if (!rc && fwrite(text, 1, len, stdout) != len)
        rc = fail("%s", "writing stdout failed");
    free(text);
    free(ids);
    json_decref(arr);
    return rc;
}

static int run_engram_map(const tok_tokenizer *t, const cli_opts *o)
{
    tok_engram_map *m = NULL;
    json_t *j = NULL;
    di_error e;
    if (tok_engram_map_build(t, (int32_t)o->vocab_size, (int32_t)o->pad_id, &m, &e) ||
        tok_engram_map_to_json(m, &j, &e)) {
        tok_engram_map_free(m);
        return fail("%s", e.msg);
    }
    bool to_stdout = strcmp(o->engram_map, "-") == 0;
    FILE *f = to_stdout ? stdout : fopen(o->engram_map, "w");
    int rc = 0;
    if (!f)
        rc = fail("cannot write %s", o->engram_map);
    if (!rc && (json_dumpf(j, f, JSON_COMPACT) || fputc('\n', f) == EOF))
        rc = fail("writing %s failed", o->engram_map);
    if (f && !to_stdout && fclose(f) && !rc)
        rc = fail("writing %s failed", o->engram_map);
    if (!rc)
        fprintf(stderr, "di-tokenize: %d ids -> %d compressed ids (pad %d -> %d)\n",
                m->vocab_size, m->compressed_vocab_size, m->pad_token_id,
                m->map[m->pad_token_id]);
    json_decref(j);
    tok_engram_map_free(m);
    return rc;
}

static const char *tokenizer_path(const cli_opts *o)
{
    if (o->tokenizer)
        return o->tokenizer;
    return tok_default_path();
}

int main(int argc, char **argv)
{
    cli_opts o = {.pad_id = 2};
    if (parse_args(argc, argv, &o))
        return 2;
    if (o.help) {
        usage(stdout);
        return di_close_stdout("di-tokenize", 0);
    }
    const char *path = tokenizer_path(&o);
    if (!path)
        return fail("no tokenizer: pass --tokenizer FILE, set DI_TOKENIZER, or run "
                    "deploy/local/install-deps.sh to fetch %s",
                    DEFAULT_TOKENIZER);
    tok_tokenizer *t = NULL;
    di_error e;
    if (tok_load_file(path, &t, &e))
        return fail("%s", e.msg);
    char *in = NULL;
    size_t n = 0;
    int rc;
    if (o.engram_map)
        rc = run_engram_map(t, &o);
    else if ((rc = read_stdin(&in, &n)) == 0)
        rc = o.decode ? run_decode(t, &o, in, n)
             : o.chat ? run_chat(t, in, n)
                      : run_encode(t, &o, in, n);
    free(in);
    tok_free(t);
    return di_close_stdout("di-tokenize", rc);
}
