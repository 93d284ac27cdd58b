/* di-mkmodel: writes a random-weight checkpoint in the released format for a config.
 *
 *   di-mkmodel [options] CONFIG OUTDIR
 *   di-mkmodel [options] --config CONFIG --out OUTDIR
 *   di-mkmodel --manifest DIR          (the checksum manifest of an existing checkpoint)
 *
 * CONFIG is a shipped name (v41-flash, tiny, small, demo), a config.json, or a directory holding one.
 */
#include <errno.h>
#include <getopt.h>
#include <stddef.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/model/mkmodel.h"
#include "common/model/shard_sums.h"
#include "common/util/clock.h"
#include "common/util/machine.h"
#include "common/util/outclose.h"

typedef struct cli {
    mkmodel_options opt;
    const char *config;   /* --config or the first positional argument */
    const char *out;      /* --out or the second positional argument */
    const char *manifest; /* --manifest DIR: only write DIR's checksum manifest */
    bool dry_run;
    bool quiet;
    bool tty;
    uint64_t last_ns;     /* last progress line */
} cli;

/* ---- options, one row each ---------------------------------------------------------------- */

typedef di_status (*opt_fn)(cli *c, const char *arg, di_error *err);

typedef struct opt_row {
    const char *name;     /* long option */
    const char *arg;      /* argument placeholder, NULL for a flag */
    opt_fn fn;            /* parses the argument; NULL: a flag or string stored at `field` */
    size_t field;         /* offsetof the bool (flag) or const char * (string) in cli */
    const char *help;
} opt_row;

#define NO_OPT_FIELD SIZE_MAX

static di_status parse_u64(const char *arg, const char *what, uint64_t lo, uint64_t hi,
                           uint64_t *out, di_error *err)
{
    /* decimal, or hexadecimal with 0x; never octal (a seed of 010 is ten) */
    int base = arg[0] == '0' && (arg[1] == 'x' || arg[1] == 'X') ? 16 : 10;
    char *end;
    errno = 0;
    unsigned long long v = strtoull(arg, &end, base);
    if (errno || end == arg || *end || arg[0] == '-' || v < lo || v > hi)
        return di_fail(err, DI_EINVAL, "%s '%s': expected an integer in [%" PRIu64 ", %" PRIu64
                       "]", what, arg, lo, hi);
    *out = v;
    return DI_OK;
}

static di_status o_seed(cli *c, const char *a, di_error *e)
{
    return parse_u64(a, "--seed", 0, UINT64_MAX, &c->opt.seed, e);
}

static di_status o_shard(cli *c, const char *a, di_error *e)
{
    uint64_t mb;
    di_status st = parse_u64(a, "--shard-mb", 1, 1 << 24, &mb, e);
    c->opt.shard_bytes = mb << 20;
    return st;
}

static di_status o_max(cli *c, const char *a, di_error *e)
{
    uint64_t gb;
    di_status st = parse_u64(a, "--max-gb", 0, 1 << 20, &gb, e);
    c->opt.max_bytes = gb * 1000000000ull;
    return st;
}

static di_status o_bias(cli *c, const char *a, di_error *e)
{
    char *end;
    double v = strtod(a, &end);
    if (end == a || *end || !(v >= 0 && v <= 10))
        return di_fail(e, DI_EINVAL, "--gate-bias-std '%s': expected a number in [0, 10]", a);
    c->opt.gate_bias_std = v;
    return DI_OK;
}

static di_status o_engram(cli *c, const char *a, di_error *e)
{
    static const char *const modes[] = {"auto", "write", "seed"};
    for (int i = 0; i < 3; i++) {
        if (strcmp(a, modes[i]) == 0) {
            c->opt.engram = (mkmodel_engram_mode)i;
            return DI_OK;
        }
    }
    return di_fail(e, DI_EINVAL, "--engram-tables '%s': expected auto, write or seed", a);
}

#define F(member) offsetof(cli, member)
static const opt_row k_opts[] = {
    {"config", "CONFIG", NULL, F(config), "the config (instead of the first argument)"},
    {"out", "OUTDIR", NULL, F(out), "the output directory (instead of the second argument)"},
    {"seed", "N", o_seed, NO_OPT_FIELD,
     "generator seed (default 0); the same seed writes the same bytes"},
    {"shard-mb", "N", o_shard, NO_OPT_FIELD,
     "largest shard in MiB (default 2048); a bigger tensor gets its own"},
    {"max-gb", "N", o_max, NO_OPT_FIELD,
     "refuse a checkpoint above N GB (default 64; 0 = no limit)"},
    {"force", NULL, NULL, F(opt.force), "write above --max-gb, or into a non-empty directory"},
    {"gate-bias-std", "X", o_bias, NO_OPT_FIELD,
     "router biases N(0, X^2) instead of zeros (default 0)"},
    {"engram-tables", "MODE", o_engram, NO_OPT_FIELD,
     "auto (write tables up to 1 GiB, else the engram_table_seed key), write, or seed"},
    {"manifest", "DIR", NULL, F(manifest), "write the checksum manifest (" SHARD_SUMS_FILE ") of "
     "the checkpoint in DIR, e.g. a released one, and stop; the loader verifies it"},
    {"dry-run", NULL, NULL, F(dry_run), "print the plan (tensors, parameters, bytes, shards)"
     " and stop"},
    {"quiet", NULL, NULL, F(quiet), "no progress on stderr"},
    {"help", NULL, NULL, NO_OPT_FIELD, "this text"},
};
#undef F
#define N_OPTS (sizeof k_opts / sizeof k_opts[0])

static void usage(FILE *f)
{
    fprintf(f, "usage: di-mkmodel [options] CONFIG OUTDIR\n"
               "       di-mkmodel [options] --config CONFIG --out OUTDIR\n"
               "       di-mkmodel --manifest DIR\n\n"
               "Writes a random-weight checkpoint in the released DeepSeek-V4.1 format: nested\n"
               "config.json, model.safetensors.index.json, bounded shards, every tensor with its\n"
               "dtype, shape and .scale sibling (MODEL.md section 7), and the checksum manifest\n"
               "" SHARD_SUMS_FILE " (SHA-256 of every 64 MiB of every shard) that loaders\n"
               "verify. The model id printed covers the config and the weights.\n\n"
               "CONFIG: a shipped config (");
    for (const char *const *n = model_config_builtin_names(); *n; n++)
        fprintf(f, "%s%s", *n, n[1] ? ", " : "");
    fprintf(f, "), a config.json, or a directory holding one.\n\noptions:\n");
    for (size_t i = 0; i < N_OPTS; i++) {
        char left[40];
        snprintf(left, sizeof left, "--%s%s%s", k_opts[i].name, k_opts[i].arg ? " " : "",
                 k_opts[i].arg ? k_opts[i].arg : "");
        fprintf(f, "  %-24s %s\n", left, k_opts[i].help);
    }
}

/* ---- progress ----------------------------------------------------------------------------- */

static void on_progress(void *ud, const mkmodel_progress *p)
{
    cli *c = ud;
    uint64_t now = di_mono_ns();
    bool last = p->tensors_done == p->tensors_total;
    if (c->quiet || (!last && now - c->last_ns < (c->tty ? 200000000ull : 5000000000ull)))
        return;
    c->last_ns = now;
    fprintf(stderr, "%sdi-mkmodel: shard %u/%u, %" PRIu64 "/%" PRIu64 " tensors, %.1f/%.1f MB "
            "(%.0f%%)%s", c->tty ? "\r" : "", p->shard, p->n_shards, p->tensors_done,
            p->tensors_total, p->bytes_done / 1e6, p->bytes_total / 1e6,
            p->bytes_total ? 100.0 * p->bytes_done / p->bytes_total : 100.0,
            c->tty && !last ? "" : "\n");
}

static void print_plan(const char *config, const mkmodel_plan *p, bool written)
{
    /* a plan has no weights yet: its id is the config's alone */
    printf("config %s: %" PRIu64 " tensors, %" PRIu64 " parameters, %" PRIu64 " bytes in %u "
           "shard(s); Engram tables %s; %s %016" PRIx64 "\n", config, p->tensors,
           p->params, p->bytes, p->n_shards,
           p->config.n_engram_layers == 0 ? "none" : p->engram_seeded ? "seeded" : "written",
           written ? "model id" : "config id", p->config.model_id);
}

/* ---- main --------------------------------------------------------------------------------- */

static int parse_args(int argc, char **argv, cli *c, const char **config, const char **out)
{
    struct option lopts[N_OPTS + 1];
    for (size_t i = 0; i < N_OPTS; i++)
        lopts[i] = (struct option){k_opts[i].name, k_opts[i].arg ? required_argument : no_argument,
                                   NULL, (int)i + 256};
    memset(&lopts[N_OPTS], 0, sizeof lopts[N_OPTS]);
    int ch;
    opterr = 0;
    while ((ch = getopt_long(argc, argv, "h", lopts, NULL)) != -1) {
        if (ch == 'h' || (ch >= 256 && strcmp(k_opts[ch - 256].name, "help") == 0)) {
            usage(stdout);
            return 0;
        }
        if (ch < 256) {
            fprintf(stderr, "di-mkmodel: unknown or incomplete option '%s' (see --help)\n",
                    argv[optind - 1]);
            return 2;
        }
        const opt_row *row = &k_opts[ch - 256];
        di_error e = {0};
        if (!row->fn) {
            if (row->arg)
                *(const char **)((char *)c + row->field) = optarg;
            else
                *(bool *)((char *)c + row->field) = true;
            continue;
        }
        if (row->fn(c, optarg, &e) != DI_OK) {
            fprintf(stderr, "di-mkmodel: %s\n", e.msg);
            return 2;
        }
    }
    for (int i = optind; i < argc; i++) {
        const char **slot = !c->config ? &c->config : !c->out ? &c->out : NULL;
        if (!slot) {
            fprintf(stderr, "di-mkmodel: unexpected argument '%s' (see --help)\n", argv[i]);
            return 2;
        }
        *slot = argv[i];
    }
    if (c->manifest) {
        if (c->config || c->out || c->dry_run) {
            fprintf(stderr, "di-mkmodel: --manifest DIR takes no config, output or --dry-run "
                    "(see --help)\n");
            return 2;
        }
        return -1;
    }
    if (!c->config || (!c->out && !c->dry_run)) {
        fprintf(stderr, "di-mkmodel: expected CONFIG and OUTDIR (see --help)\n");
        return 2;
    }
    *config = c->config;
    *out = c->out;
    return -1;
}

int main(int argc, char **argv)
{
    cli c;
    memset(&c, 0, sizeof c);
    mkmodel_options_default(&c.opt);
    c.tty = isatty(STDERR_FILENO);
    const char *config = NULL, *out = NULL;
    int rc = parse_args(argc, argv, &c, &config, &out);
    if (rc >= 0)
        return rc == 0 ? di_close_stdout("di-mkmodel", 0) : rc;
    if (c.manifest) {
        di_error e = {0};
        uint64_t id = 0;
        uint64_t t0 = di_mono_ns();
        if (mkmodel_write_sums(c.manifest, 0, &id, &e) != DI_OK) {
            fprintf(stderr, "di-mkmodel: %s: %s\n", c.manifest, e.msg);
            return 1;
        }
        printf("%s/%s written in %.2f s; model id %016" PRIx64 "\n", c.manifest, SHARD_SUMS_FILE,
               (di_mono_ns() - t0) / 1e9, id);
        return di_close_stdout("di-mkmodel", 0);
    }
    c.opt.progress = on_progress;
    c.opt.progress_userdata = &c;
    model_config *cfg = malloc(sizeof *cfg);
    mkmodel_plan *plan = malloc(sizeof *plan);
    di_error e = {0};
    di_status st = cfg && plan ? model_config_resolve(config, cfg, &e)
                               : di_fail(&e, DI_ENOMEM, "out of memory");
    bool over = false;
    if (st == DI_OK && c.dry_run) {
        bool force = c.opt.force;
        c.opt.force = true; /* a plan is printed whatever its size */
        st = mkmodel_plan_for(cfg, &c.opt, plan, &e);
        over = st == DI_OK && !force && c.opt.max_bytes && plan->bytes > c.opt.max_bytes;
    }
    else if (st == DI_OK) {
        /* Refuse before writing: the checkpoint must fit the free space where it goes. */
        st = mkmodel_plan_for(cfg, &c.opt, plan, &e);
        if (st == DI_OK)
            st = di_machine_check_disk("the checkpoint", out, plan->bytes, &e);
        if (st == DI_OK)
            st = mkmodel_write(cfg, out, &c.opt, plan, &e);
    }
    if (st == DI_OK)
        print_plan(config, plan, !c.dry_run);
    if (over)
        printf("(above --max-gb %.0f: writing it needs --force)\n", c.opt.max_bytes / 1e9);
    if (st != DI_OK)
        fprintf(stderr, "di-mkmodel: %s\n", e.msg);
    free(cfg);
    free(plan);
    return di_close_stdout("di-mkmodel", st == DI_OK ? 0 : 1);
}
