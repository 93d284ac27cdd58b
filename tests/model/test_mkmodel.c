/* di-mkmodel and its library: determinism, sharding, limits, the written files, the CLI. */
#include <criterion/criterion.h>
#include <dirent.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "common/model/mkmodel.h"
#include "common/model/safetensors.h"
#include "tests/model/tmpdir.h"
#include "common/model/weights.h"

static char g_dir[256];

static void make_dir(void)
{
    tmpdir_make(g_dir, sizeof g_dir, "mkmodel");
}

static void remove_dir(void)
{
    tmpdir_remove(g_dir);
}

TestSuite(mkmodel, .init = make_dir, .fini = remove_dir, .timeout = 120);

static void write_ckpt(const char *name, const char *out, uint64_t seed, uint64_t shard_bytes)
{
    model_config *c = malloc(sizeof *c);
    di_error e = {0};
    cr_assert_eq(model_config_builtin(name, c, &e), DI_OK);
    mkmodel_options o;
    mkmodel_options_default(&o);
    o.seed = seed;
    o.shard_bytes = shard_bytes;
    char dir[512];
    snprintf(dir, sizeof dir, "%s/%s", g_dir, out);
    cr_assert_eq(mkmodel_write(c, dir, &o, NULL, &e), DI_OK, "%s", e.msg);
    free(c);
}

/* Reads a whole file (malloc'd, *len). */
static uint8_t *slurp(const char *path, size_t *len)
{
    FILE *f = fopen(path, "rb");
    cr_assert_not_null(f, "%s", path);
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    uint8_t *b = malloc((size_t)n + 1);
    cr_assert_eq(fread(b, 1, (size_t)n, f), (size_t)n);
    fclose(f);
    *len = (size_t)n;
    return b;
}

/* Sorted file names of a directory (NULL-terminated, malloc'd). */
static char **list_dir(const char *dir, size_t *n)
{
    DIR *d = opendir(dir);
    cr_assert_not_null(d);
    char **names = calloc(256, sizeof *names);
    *n = 0;
    for (struct dirent *e; (e = readdir(d));)
        if (e->d_name[0] != '.')
            names[(*n)++] = strdup(e->d_name);
    closedir(d);
    for (size_t i = 0; i < *n; i++)
        for (size_t j = i + 1; j < *n; j++)
            if (strcmp(names[j], names[i]) < 0) {
                char *t = names[i];
                names[i] = names[j];
                names[j] = t;
            }
    return names;
}

static void free_list(char **names, size_t n)
{
    for (size_t i = 0; i < n; i++)
        free(names[i]);
    free(names);
}

/* Compares the files of two checkpoints: returns how many differ; asserts the same names. */
static size_t differing_files(const char *a, const char *b, bool shards_only)
{
    char da[512], db[512];
    snprintf(da, sizeof da, "%s/%s", g_dir, a);
    snprintf(db, sizeof db, "%s/%s", g_dir, b);
    size_t na, nb, diff = 0;
    char **la = list_dir(da, &na), **lb = list_dir(db, &nb);
    cr_assert_eq(na, nb);
    for (size_t i = 0; i < na; i++) {
        cr_assert_str_eq(la[i], lb[i]);
        if (shards_only && !strstr(la[i], ".safetensors"))
            continue;
        char pa[1024], pb[1024];
        snprintf(pa, sizeof pa, "%s/%s", da, la[i]);
        snprintf(pb, sizeof pb, "%s/%s", db, lb[i]);
        size_t ka, kb;
        uint8_t *x = slurp(pa, &ka), *y = slurp(pb, &kb);
        diff += ka != kb || memcmp(x, y, ka) != 0;
        free(x);
        free(y);
    }
    free_list(la, na);
    free_list(lb, nb);
    return diff;
}

Test(mkmodel, same_seed_same_bytes_other_seed_other_bytes)
{
    write_ckpt("tiny", "a", 77, 1 << 20);
    write_ckpt("tiny", "b", 77, 1 << 20);
    write_ckpt("tiny", "c", 78, 1 << 20);
    cr_assert_eq(differing_files("a", "b", false), 0, "same seed: byte-identical checkpoint");
    char da[512];
    snprintf(da, sizeof da, "%s/a", g_dir);
    size_t n;
    char **names = list_dir(da, &n);
    size_t shards = 0;
    for (size_t i = 0; i < n; i++)
        shards += strstr(names[i], ".safetensors") && !strstr(names[i], "index");
    free_list(names, n);
    cr_assert(shards > 1);
    cr_assert_eq(differing_files("a", "c", true), shards, "another seed changes every shard");
    /* config and index do not depend on the seed */
    cr_assert_eq(differing_files("a", "c", false), shards + 1, "shards and the token map");
}

Test(mkmodel, sharding_moves_tensors_but_not_their_bytes)
{
    write_ckpt("tiny", "one", 5, 1ull << 30);
    write_ckpt("tiny", "many", 5, 1 << 19);
    char d1[512], d2[512];
    snprintf(d1, sizeof d1, "%s/one", g_dir);
    snprintf(d2, sizeof d2, "%s/many", g_dir);
    st_index *i1, *i2;
    di_error e;
    cr_assert_eq(st_index_load(d1, &i1, &e), DI_OK);
    cr_assert_eq(st_index_load(d2, &i2, &e), DI_OK);
    cr_assert_eq(i1->n_shards, 1);
    cr_assert(i2->n_shards > 8);
    cr_assert_eq(i1->n_entries, i2->n_entries);
    cr_assert_eq(i1->total_size, i2->total_size);
    st_file *f1;
    char p[1024];
    snprintf(p, sizeof p, "%s/%s", d1, i1->shards[0]);
    cr_assert_eq(st_open(p, &f1, &e), DI_OK);
    uint64_t sum = 0;
    for (uint32_t s = 0; s < i2->n_shards; s++) {
        st_file *f2;
        snprintf(p, sizeof p, "%s/%s", d2, i2->shards[s]);
        cr_assert_eq(st_open(p, &f2, &e), DI_OK, "%s", e.msg);
        uint64_t data = 0;
        for (uint32_t k = 0; k < f2->n_tensors; k++) {
            const st_tensor *t2 = &f2->tensors[k], *t1 = st_find(f1, t2->name);
            cr_assert_not_null(t1);
            cr_assert_eq(st_index_find(i2, t2->name), (int32_t)s, "index agrees with the shard");
            cr_assert_eq(t1->bytes, t2->bytes);
            cr_assert_eq(memcmp(t1->data, t2->data, t1->bytes), 0, "%s", t2->name);
            data += t2->bytes;
        }
        /* bounded: at most the limit, unless one tensor (with its scale) fills the shard */
        cr_assert(data <= (1u << 19) || f2->n_tensors <= 2, "shard %u: %lu bytes in %u tensors",
                  s, (unsigned long)data, f2->n_tensors);
        sum += data;
        st_close(f2);
    }
    cr_assert_eq(sum, i2->total_size, "index total_size is the tensor bytes");
    cr_assert_eq(f1->n_tensors, i1->n_entries, "every tensor indexed, none orphaned");
    st_close(f1);
    st_index_free(i1);
    st_index_free(i2);
}

Test(mkmodel, written_config_is_the_nested_release_layout)
{
    write_ckpt("small", "s", 1, 1ull << 30);
    char path[600];
    snprintf(path, sizeof path, "%s/s/config.json", g_dir);
    json_t *root = json_load_file(path, 0, NULL);
    cr_assert_not_null(root);
    cr_assert_str_eq(json_string_value(json_array_get(json_object_get(root, "architectures"), 0)),
                     "DeepseekV41ForCausalLM");
    json_t *text = json_object_get(root, "text_config");
    cr_assert(json_is_object(text));
    cr_assert_eq(json_integer_value(json_object_get(text, "hidden_size")), 256);
    cr_assert_null(json_object_get(root, "hidden_size"), "model keys live in text_config");
    cr_assert(json_is_object(json_object_get(root, "quantization_config")));
    cr_assert_eq(json_integer_value(json_object_get(root, "eos_token_id")), 1);
    cr_assert_null(json_object_get(text, "engram_table_seed"), "small tables are written");
    model_config a, b;
    di_error e;
    cr_assert_eq(model_config_builtin("small", &a, &e), DI_OK);
    cr_assert_eq(model_config_from_json(root, "small", &b, &e), DI_OK, "%s", e.msg);
    cr_assert_eq(a.model_id, b.model_id);
    json_decref(root);
}

Test(mkmodel, limits_and_directories)
{
    model_config *c = malloc(sizeof *c);
    di_error e = {0};
    cr_assert_eq(model_config_builtin("v41-flash", c, &e), DI_OK);
    mkmodel_options o;
    mkmodel_options_default(&o);
    mkmodel_plan *p = malloc(sizeof *p);
    cr_assert_eq(mkmodel_plan_for(c, &o, p, &e), DI_ENOSPC);
    cr_assert(strstr(e.msg, "checkpoint of 306.6 GB exceeds the 64.0 GB limit"), "%s", e.msg);
    o.force = true;
    cr_assert_eq(mkmodel_plan_for(c, &o, p, &e), DI_OK, "%s", e.msg);
    cr_assert(p->engram_seeded, "189 GiB of tables become the seed key");
    cr_assert(p->config.has_engram_table_seed);
    cr_assert_eq(p->params, 762720031570ull);
    /* tables written: 202.76 GB more */
    o.engram = MKMODEL_ENGRAM_WRITE;
    mkmodel_plan *q = malloc(sizeof *q);
    cr_assert_eq(mkmodel_plan_for(c, &o, q, &e), DI_OK);
    cr_assert_eq(q->bytes - p->bytes, 768022850ull * 264);
    char dir[512];
    snprintf(dir, sizeof dir, "%s/big", g_dir);
    o.force = false;
    cr_assert_eq(mkmodel_write(c, dir, &o, NULL, &e), DI_ENOSPC);
    cr_assert_neq(access(dir, F_OK), 0, "nothing created when refused");
    o.shard_bytes = 0;
    cr_assert_eq(mkmodel_plan_for(c, &o, p, &e), DI_EINVAL);
    free(p);
    free(q);

    cr_assert_eq(model_config_builtin("tiny", c, &e), DI_OK);
    mkmodel_options_default(&o);
    snprintf(dir, sizeof dir, "%s/busy", g_dir);
    mkdir(dir, 0755);
    char f[600];
    snprintf(f, sizeof f, "%s/notes.txt", dir);
    FILE *fp = fopen(f, "w");
    fputs("keep", fp);
    fclose(fp);
    cr_assert_eq(mkmodel_write(c, dir, &o, NULL, &e), DI_EEXIST);
    cr_assert(strstr(e.msg, "not empty"), "%s", e.msg);
    o.force = true;
    cr_assert_eq(mkmodel_write(c, dir, &o, NULL, &e), DI_OK, "%s", e.msg);
    snprintf(dir, sizeof dir, "%s/busy/notes.txt/sub", g_dir);
    cr_assert_neq(mkmodel_write(c, dir, &o, NULL, &e), DI_OK);
    free(c);
}

/* ---- the binary --------------------------------------------------------------------------- */

static int run(const char *args, char *out, size_t cap)
{
    char cmd[2048];
    snprintf(cmd, sizeof cmd, "'%s/tools/mkmodel/di-mkmodel' %s 2>&1", getenv("DI_BUILD_ROOT"),
             args);
    FILE *p = popen(cmd, "r");
    cr_assert_not_null(p);
    size_t n = fread(out, 1, cap - 1, p);
    out[n] = '\0';
    int st = pclose(p);
    return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

Test(mkmodel, command_line)
{
    char out[8192], args[1024];
    cr_assert_eq(run("--help", out, sizeof out), 0);
    cr_assert(strstr(out, "usage: di-mkmodel") && strstr(out, "--shard-mb"), "%s", out);
    cr_assert_eq(run("", out, sizeof out), 2);
    cr_assert(strstr(out, "expected CONFIG and OUTDIR"), "%s", out);
    cr_assert_eq(run("--shard-mb 0 tiny x", out, sizeof out), 2);
    cr_assert(strstr(out, "--shard-mb '0'"), "%s", out);
    cr_assert_eq(run("--engram-tables maybe tiny x", out, sizeof out), 2);
    cr_assert_eq(run("--dry-run v41-flash", out, sizeof out), 0);
    cr_assert(strstr(out, "762720031570 parameters") && strstr(out, "needs --force"), "%s", out);
    snprintf(args, sizeof args, "v41-flash '%s/v41'", g_dir);
    cr_assert_eq(run(args, out, sizeof out), 1);
    cr_assert(strstr(out, "exceeds the 64.0 GB limit"), "%s", out);
    snprintf(args, sizeof args, "nonexistent-config '%s/n'", g_dir);
    cr_assert_eq(run(args, out, sizeof out), 1);
    cr_assert(strstr(out, "neither a shipped config"), "%s", out);
    cr_assert_eq(run("tiny a b", out, sizeof out), 2);
    cr_assert(strstr(out, "unexpected argument 'b'"), "%s", out);
    /* the option spelling writes the same checkpoint as the positional one */
    snprintf(args, sizeof args, "--quiet --seed 9 --shard-mb 1 --config tiny --out '%s/opt'", g_dir);
    cr_assert_eq(run(args, out, sizeof out), 0, "%s", out);
    /* a config file path works like a name, and the output loads */
    snprintf(args, sizeof args, "--seed 9 --shard-mb 1 '%s/common/model/configs/tiny.json' '%s/t'",
             getenv("DI_SOURCE_ROOT"), g_dir);
    cr_assert_eq(run(args, out, sizeof out), 0, "%s", out);
    cr_assert(strstr(out, "820/820 tensors"), "progress reaches the end: %s", out);
    write_ckpt("tiny", "lib", 9, 1 << 20);
    cr_assert_eq(differing_files("t", "lib", false), 0, "binary and library write the same");
    cr_assert_eq(differing_files("opt", "lib", false), 0);
    char dir[512];
    snprintf(dir, sizeof dir, "%s/t", g_dir);
    model_weights *w;
    di_error e;
    cr_assert_eq(model_weights_load(dir, NULL, &w, &e), DI_OK, "%s", e.msg);
    model_weights_free(w);
}
