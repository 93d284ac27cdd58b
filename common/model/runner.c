#include "common/model/runner.h"

#include <dirent.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/model/mkmodel.h"
#include "common/util/json_read.h"
#include "common/util/machine.h"

static int file_exists(const char *dir, const char *name)
{
    char path[4096];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    struct stat st;
    return stat(path, &st) == 0;
}

/* engram_token_map.json into a malloc'd map checked against the config. */
static di_status load_token_map(const char *dir, const model_config *c, int32_t **map,
                                int32_t *pad, di_error *err)
{
    char path[4096];
    snprintf(path, sizeof path, "%s/engram_token_map.json", dir);
    json_t *doc = NULL;
    di_status st = di_json_load_file(path, &doc, err);
    if (st != DI_OK)
        return st;
    int64_t vocab = c->vocab_size, cvocab = c->engram_compressed_vocab_size,
            padv = c->engram_pad_id;
    json_t *arr = NULL;
    if ((st = di_json_int_opt(doc, "vocab_size", &vocab, err)) == DI_OK &&
        (st = di_json_int_opt(doc, "compressed_vocab_size", &cvocab, err)) == DI_OK &&
        (st = di_json_int_opt(doc, "pad_token_id", &padv, err)) == DI_OK)
        st = di_json_array(doc, "map", &arr, err);
    if (st == DI_OK && (vocab != c->vocab_size || (int64_t)json_array_size(arr) != vocab))
        st = di_fail(err, DI_ECORRUPT, "%s: map has %zu entries, the config's vocabulary %u",
                     path, json_array_size(arr), c->vocab_size);
    if (st == DI_OK && cvocab != c->engram_compressed_vocab_size)
        st = di_fail(err, DI_ECORRUPT, "%s: compressed_vocab_size %lld, the config says %u", path,
                     (long long)cvocab, c->engram_compressed_vocab_size);
    if (st == DI_OK && (padv < 0 || padv >= vocab))
        st = di_fail(err, DI_ECORRUPT, "%s: pad_token_id %lld outside the vocabulary", path,
                     (long long)padv);
    int32_t *m = NULL;
    if (st == DI_OK && !(m = malloc((size_t)c->vocab_size * sizeof(int32_t))))
        st = di_fail(err, DI_ENOMEM, "token map");
    for (size_t i = 0; st == DI_OK && i < c->vocab_size; i++) {
        json_t *v = json_array_get(arr, i);
        json_int_t x = json_is_integer(v) ? json_integer_value(v) : -1;
        if (x < 0 || x >= cvocab)
            st = di_fail(err, DI_ECORRUPT, "%s: entry %zu is not an id in [0, %lld)", path, i,
                         (long long)cvocab);
        else
            m[i] = (int32_t)x;
    }
    json_decref(doc);
    if (st != DI_OK) {
        free(m);
        return st;
    }
    *map = m;
    *pad = (int32_t)padv;
    return DI_OK;
}

di_status runner_model_load(const char *dir, const model_load_options *opt, runner_model *out,
                            di_error *err)
{
    if (!dir || !out)
        return di_fail(err, DI_EINVAL, "model directory and output are required");
    runner_model m = {.token_map_pad = -1};
    di_status st = model_weights_load(dir, opt, &m.w, err);
    if (st != DI_OK)
        return st;
    m.has_tokenizer = file_exists(dir, "tokenizer.json");
    if (m.w->config.n_engram_layers && file_exists(dir, "engram_token_map.json"))
        st = load_token_map(dir, &m.w->config, &m.token_map, &m.token_map_pad, err);
    if (st != DI_OK) {
        runner_model_free(&m);
        return st;
    }
    *out = m;
    return DI_OK;
}

/* Removes the files of a directory we wrote (one level) and the directory. */
static void remove_dir(const char *dir)
{
    DIR *d = opendir(dir);
    if (d) {
        struct dirent *e;
        while ((e = readdir(d)) != NULL) {
            if (!strcmp(e->d_name, ".") || !strcmp(e->d_name, ".."))
                continue;
            char path[4096 + 260];
            snprintf(path, sizeof path, "%s/%s", dir, e->d_name);
            unlink(path);
        }
        closedir(d);
    }
    rmdir(dir);
}

/* Bytes of the checkpoint cfg needs under o, whatever its limit. */
static double plan_bytes_of(const model_config *cfg, const mkmodel_options *o)
{
    mkmodel_options all = *o;
    all.force = true;
    mkmodel_plan p;
    return mkmodel_plan_for(cfg, &all, &p, NULL) == DI_OK ? (double)p.bytes : 0.0;
}

di_status runner_model_random(const char *config, uint64_t seed, const char *tmp_root,
                              const model_load_options *opt, runner_model *out, di_error *err)
{
    if (!config || !out)
        return di_fail(err, DI_EINVAL, "config and output are required");
    model_config cfg;
    di_status st = model_config_resolve(config, &cfg, err);
    if (st != DI_OK)
        return st;
    const char *root = tmp_root ? tmp_root : getenv("TMPDIR");
    if (!root || !*root)
        root = "/tmp";
    mkmodel_options mo;
    mkmodel_options_default(&mo);
    mo.seed = seed;
    /* The size guard of di-mkmodel (the checkpoint limit), then the free space where it goes:
     * both before a byte is written. */
    mkmodel_plan plan;
    st = mkmodel_plan_for(&cfg, &mo, &plan, err);
    if (st == DI_ENOSPC)
        return di_fail(err, DI_ENOSPC, "random weights for %s need a %.1f GB checkpoint, above "
                       "the %.1f GB limit of weights generated on the fly (write them once "
                       "with di-mkmodel --force and load the directory)",
                       config, plan_bytes_of(&cfg, &mo) / 1e9, mo.max_bytes / 1e9);
    if (st == DI_OK) {
        char what[300];
        snprintf(what, sizeof what, "the checkpoint of random weights for %s", config);
        st = di_machine_check_disk(what, root, plan.bytes, err);
    }
    if (st != DI_OK)
        return st;
    char dir[4096];
    snprintf(dir, sizeof dir, "%s/di-model-XXXXXX", root);
    if (!mkdtemp(dir))
        return di_fail(err, DI_EIO, "cannot create a temporary directory under %s: %s", root,
                       strerror(errno));
    mo.force = true; /* the directory exists (empty); the size was checked above */
    st = mkmodel_write(&cfg, dir, &mo, NULL, err);
    model_load_options lo = opt ? *opt : (model_load_options){0};
    lo.config = NULL; /* read what was written (it may carry engram_table_seed) */
    lo.flags |= MODEL_LOAD_TRUST_SUMS; /* its manifest was hashed from these bytes just now */
    if (st == DI_OK)
        st = runner_model_load(dir, &lo, out, err);
    remove_dir(dir);
    return st;
}

di_status runner_model_set_token_map(runner_model *m, const int32_t *map, uint32_t vocab_size,
                                     int32_t pad_token, di_error *err)
{
    const model_config *c = &m->w->config;
    if (vocab_size != c->vocab_size)
        return di_fail(err, DI_EINVAL, "token map of %u ids, the model's vocabulary has %u",
                       vocab_size, c->vocab_size);
    if (pad_token < 0 || (uint32_t)pad_token >= vocab_size)
        return di_fail(err, DI_EINVAL, "token map pad token %d outside the vocabulary",
                       pad_token);
    for (uint32_t i = 0; i < vocab_size; i++)
        if (map[i] < 0 || (uint32_t)map[i] >= c->engram_compressed_vocab_size)
            return di_fail(err, DI_EINVAL, "token map: token %u maps to %d, outside [0, %u) "
                           "(engram_compressed_vocab_size)", i, map[i],
                           c->engram_compressed_vocab_size);
    int32_t *copy = malloc((size_t)vocab_size * sizeof(int32_t));
    if (!copy)
        return di_fail(err, DI_ENOMEM, "token map");
    memcpy(copy, map, (size_t)vocab_size * sizeof(int32_t));
    free(m->token_map);
    m->token_map = copy;
    m->token_map_pad = pad_token;
    m->has_tokenizer = false; /* satisfied */
    return DI_OK;
}

di_status runner_model_check_token_map(const runner_model *m, const char *dir, di_error *err)
{
    if (m->w->config.n_engram_layers && m->has_tokenizer && !m->token_map)
        return di_fail(err, DI_EUNSUPPORTED, "%s has tokenizer.json and no "
                       "engram_token_map.json: the Engram token map must be built from the "
                       "tokenizer, which needs a build with the tokenizer module",
                       dir ? dir : "the model directory");
    return DI_OK;
}

void runner_model_free(runner_model *m)
{
    if (!m)
        return;
    model_weights_free(m->w);
    free(m->token_map);
    m->w = NULL;
    m->token_map = NULL;
}
