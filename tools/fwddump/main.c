/* di-fwddump: runs the prefill of one prompt on a checkpoint (CPU backend) and writes every
 * named intermediate of the forward pass (fwd_dump) as a .npy file, for dumpdiff.py.
 *
 *   di-fwddump --model DIR --ids 3,17,42 --out OUTDIR [--threads N]
 *
 * OUTDIR receives L{l}.{name}.npy for backbone layer l, D{s}.{name}.npy for draft stage s,
 * {name}.npy for the rest (bf16 tensors widened to float32), logits.npy [T, vocab] (every
 * prompt row) and order.txt (the file stems in the order the forward produced them).
 */
#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "common/model/forward.h"
#include "common/model/runner.h"
#include "kernels/cpu/backend.h"
#include "kernels/cpu/numfmt.h"

#define MAX_IDS 65536

typedef struct dumper {
    const char *dir;
    uint32_t n_layers;
    FILE *order;
    di_status st;            /* first write failure */
    di_error err;
} dumper;

static const char *usage =
    "usage: di-fwddump --model DIR --ids LIST --out OUTDIR [--threads N]\n"
    "Runs the prefill of the prompt LIST (comma-separated token ids) on the checkpoint in DIR\n"
    "with the CPU backend and writes each named intermediate of the forward pass to OUTDIR as\n"
    ".npy (L{layer}.{name}, D{stage}.{name} for draft stages, bf16 widened to float32), the\n"
    "logits of every row (logits.npy) and the production order (order.txt).\n"
    "  --model DIR    checkpoint directory (config.json, safetensors, engram_token_map.json)\n"
    "  --ids LIST     prompt token ids, 1 to 65536 of them\n"
    "  --out OUTDIR   output directory (created if missing)\n"
    "  --threads N    CPU threads (default 2, 1..256)\n"
    "  --help         this text\n";

/* Writes a .npy (format 1.0) of dtype descr ("<f4", "<i4", "<i8", "|u1") and shape. */
static di_status write_npy(const char *path, const char *descr, const uint64_t *dims,
                           uint32_t ndim, const void *data, size_t bytes, di_error *err)
{
    char shape[96] = "", hdr[192];
    size_t at = 0;
    for (uint32_t i = 0; i < ndim; i++)
        at += (size_t)snprintf(shape + at, sizeof(shape) - at, "%" PRIu64 ",%s", dims[i],
                               i + 1 < ndim ? " " : "");
    if (ndim > 1)
        shape[at - 1] = '\0'; /* (a, b) without the trailing comma */
    int n = snprintf(hdr, sizeof(hdr), "{'descr': '%s', 'fortran_order': False, 'shape': (%s), }",
                     descr, shape);
    size_t total = 10 + (size_t)n + 1, pad = (64 - total % 64) % 64;
    FILE *f = fopen(path, "wb");
    if (!f)
        return di_fail(err, DI_EIO, "%s: %s", path, strerror(errno));
    uint16_t hlen = (uint16_t)(n + pad + 1);
    fwrite("\x93NUMPY\x01\x00", 1, 8, f);
    fputc(hlen & 0xff, f);
    fputc(hlen >> 8, f);
    fwrite(hdr, 1, (size_t)n, f);
    for (size_t i = 0; i < pad; i++)
        fputc(' ', f);
    fputc('\n', f);
    fwrite(data, 1, bytes, f);
    if (fclose(f) != 0)
        return di_fail(err, DI_EIO, "%s: write failed", path);
    return DI_OK;
}

static void on_tensor(void *ud, const fwd_tensor *t)
{
    dumper *d = ud;
    if (d->st != DI_OK)
        return;
    char stem[160], path[4096];
    if (t->layer < 0)
        snprintf(stem, sizeof(stem), "%s", t->name);
    else if ((uint32_t)t->layer < d->n_layers)
        snprintf(stem, sizeof(stem), "L%d.%s", t->layer, t->name);
    else
        snprintf(stem, sizeof(stem), "D%u.%s", (uint32_t)t->layer - d->n_layers, t->name);
    snprintf(path, sizeof(path), "%s/%s.npy", d->dir, stem);
    size_t n = 1;
    for (uint32_t i = 0; i < t->ndim; i++)
        n *= t->dims[i];
    static const char *descr[] = {"<f4", "<f4", "<i4", "<i8", "|u1"};
    static const size_t width[] = {2, 4, 4, 8, 1};
    if (t->dtype == FWD_BF16) {
        float *f = malloc((n ? n : 1) * sizeof(float));
        if (!f) {
            d->st = di_fail(&d->err, DI_ENOMEM, "out of memory");
            return;
        }
        for (size_t i = 0; i < n; i++)
            f[i] = di_bf16_to_f32(((const uint16_t *)t->data)[i]);
        d->st = write_npy(path, descr[t->dtype], t->dims, t->ndim, f, n * 4, &d->err);
        free(f);
    } else {
        d->st = write_npy(path, descr[t->dtype], t->dims, t->ndim, t->data,
                          n * width[t->dtype], &d->err);
    }
    fprintf(d->order, "%s\n", stem);
}

static di_status parse_ids(const char *s, int32_t *ids, uint32_t *n, di_error *err)
{
    *n = 0;
    while (*s) {
        char *end;
        errno = 0;
        long v = strtol(s, &end, 10);
        if (errno || end == s || v < 0 || v > INT32_MAX || (*end && *end != ','))
            return di_fail(err, DI_EINVAL, "--ids: '%s' is not a list of token ids", s);
        if (*n == MAX_IDS)
            return di_fail(err, DI_EINVAL, "--ids: more than %d ids", MAX_IDS);
        ids[(*n)++] = (int32_t)v;
        s = *end ? end + 1 : end;
    }
    if (*n == 0)
        return di_fail(err, DI_EINVAL, "--ids: no token ids");
    return DI_OK;
}

static di_status run(const char *model, const int32_t *ids, uint32_t n, const char *out,
                     uint32_t threads, di_error *err)
{
    if (mkdir(out, 0755) != 0 && errno != EEXIST)
        return di_fail(err, DI_EIO, "--out %s: %s", out, strerror(errno));
    char path[4096];
    snprintf(path, sizeof(path), "%s/order.txt", out);
    dumper d = {.dir = out, .st = DI_OK};
    runner_model rm = {0};
    kern_backend be = {0};
    fwd_model *m = NULL;
    fwd_run *r = NULL;
    fwd_kv *kv = NULL;
    float *logits = NULL;
    di_status st = runner_model_load(model, NULL, &rm, err);
    if (st != DI_OK)
        return st;
    if ((st = kern_cpu_create(threads, &be, err)) != DI_OK) {
        runner_model_free(&rm);
        return st;
    }
    const model_config *c = &rm.w->config;
    uint32_t n_blocks = (n + 127) / 128 + 1;
    fwd_options o = {.nextn = c->n_mtp ? c->dspark_block_size : 0, .max_rows = n, .yoco = FWD_YOCO_OFF,
                     .token_map = rm.token_map, .token_map_pad = rm.token_map_pad,
                     .dump = on_tensor, .dump_userdata = &d};
    d.n_layers = c->n_layers;
    if (!(d.order = fopen(path, "w")))
        st = di_fail(err, DI_EIO, "%s: %s", path, strerror(errno));
    if (st == DI_OK)
        st = fwd_model_create(rm.w, &be, &o, &m, err);
    if (st == DI_OK)
        st = fwd_run_create(m, &r, err);
    if (st == DI_OK)
        st = fwd_kv_create(fwd_model_geometry(m), &be, n_blocks, 1, &kv, err);
    uint32_t *blocks = calloc(n_blocks, sizeof(uint32_t));
    int32_t *rows = malloc((size_t)n * sizeof(int32_t));
    logits = malloc((size_t)n * c->vocab_size * sizeof(float));
    if (st == DI_OK && (!blocks || !rows || !logits))
        st = di_fail(err, DI_ENOMEM, "out of memory");
    if (st == DI_OK) {
        for (uint32_t i = 0; i < n_blocks; i++)
            blocks[i] = i;
        for (uint32_t i = 0; i < n; i++)
            rows[i] = (int32_t)i;
        fwd_seq q = {.n_rows = n, .pos0 = 0, .tokens = ids, .blocks = blocks,
                     .n_blocks = n_blocks, .slot = 0, .prompt_len = n};
        fwd_step step = {.n_seqs = 1, .seqs = &q, .n_logit_rows = n, .logit_rows = rows};
        st = fwd_step_run(r, kv, &step, logits, err);
    }
    if (st == DI_OK && d.st != DI_OK) {
        st = d.st;
        *err = d.err;
    }
    if (st == DI_OK) {
        uint64_t dims[2] = {n, c->vocab_size};
        snprintf(path, sizeof(path), "%s/logits.npy", out);
        st = write_npy(path, "<f4", dims, 2, logits, (size_t)n * c->vocab_size * 4, err);
        fprintf(d.order, "logits\n");
    }
    if (d.order && fclose(d.order) != 0 && st == DI_OK)
        st = di_fail(err, DI_EIO, "%s/order.txt: write failed", out);
    free(blocks);
    free(rows);
    free(logits);
    fwd_kv_free(kv);
    fwd_run_free(r);
    fwd_model_free(m);
    kern_cpu_destroy(&be);
    runner_model_free(&rm);
    return st;
}

int main(int argc, char **argv)
{
    const char *model = NULL, *ids_arg = NULL, *out = NULL;
    uint32_t threads = 2;
    di_error err = {0};
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
            fputs(usage, stdout);
            return 0;
        }
        if (i + 1 >= argc || (strcmp(a, "--model") && strcmp(a, "--ids") && strcmp(a, "--out") &&
                              strcmp(a, "--threads"))) {
            fprintf(stderr, "di-fwddump: unknown option or missing value: %s (see --help)\n", a);
            return 2;
        }
        const char *v = argv[++i];
        if (!strcmp(a, "--model"))
            model = v;
        else if (!strcmp(a, "--ids"))
            ids_arg = v;
        else if (!strcmp(a, "--out"))
            out = v;
        else {
            char *end;
            errno = 0;
            unsigned long t = strtoul(v, &end, 10);
            if (errno || *end || end == v || t < 1 || t > 256) {
                fprintf(stderr, "di-fwddump: --threads '%s': expected an integer in [1, 256]\n", v);
                return 2;
            }
            threads = (uint32_t)t;
        }
    }
    if (!model || !ids_arg || !out) {
        fprintf(stderr, "di-fwddump: --model, --ids and --out are required (see --help)\n");
        return 2;
    }
    int32_t *ids = malloc(MAX_IDS * sizeof(int32_t));
    uint32_t n = 0;
    di_status st = ids ? parse_ids(ids_arg, ids, &n, &err) : di_fail(&err, DI_ENOMEM, "out of memory");
    if (st == DI_OK)
        st = run(model, ids, n, out, threads, &err);
    free(ids);
    if (st != DI_OK) {
        fprintf(stderr, "di-fwddump: %s\n", err.msg);
        return st == DI_EINVAL ? 2 : 1;
    }
    return 0;
}
