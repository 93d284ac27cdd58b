/* model_open.c: model, tokenizer and Engram map in one call (model_open.h). */
#include "common/serve/model_open.h"

#include <stdio.h>
#include <string.h>

#ifdef DI_HAVE_TOKENIZER
#include "common/tokenizer/tokenizer.h"

/* Loads the tokenizer and builds the Engram map from it when the directory ships one. */
static di_status open_tokenizer(const serve_model_options *o, serve_model *m, di_error *err)
{
    char path[4096];
    const char *file = o->tokenizer;
    if (!file && o->model_dir && m->rm.has_tokenizer) {
        snprintf(path, sizeof path, "%s/tokenizer.json", o->model_dir);
        file = path;
    }
    if (!file && o->need_tokenizer)
        file = tok_default_path();
    if (!file)
        return DI_OK;
    di_status st = tok_load_file(file, &m->tok, err);
    if (st != DI_OK) {
        di_error_prefix(err, "tokenizer %s: ", file);
        return st;
    }
    const model_config *c = &m->rm.w->config;
    if ((uint32_t)tok_vocab_size(m->tok) > c->vocab_size && o->need_tokenizer)
        return di_fail(err, DI_EINVAL,
                       "tokenizer %s has %d ids but the model's vocabulary is %u: use a model "
                       "made for this tokenizer (for random weights, --config demo)",
                       file, tok_vocab_size(m->tok), c->vocab_size);
    if (!m->rm.has_tokenizer || !c->n_engram_layers)
        return DI_OK;
    tok_engram_map *map = NULL;
    if ((st = tok_engram_map_build(m->tok, (int32_t)c->vocab_size, (int32_t)c->engram_pad_id,
                                   &map, err)) == DI_OK)
        st = runner_model_set_token_map(&m->rm, map->map, (uint32_t)map->vocab_size,
                                        map->pad_token_id, err);
    tok_engram_map_free(map);
    if (st != DI_OK)
        di_error_prefix(err, "Engram token map from %s: ", file);
    return st;
}
#else
static di_status open_tokenizer(const serve_model_options *o, serve_model *m, di_error *err)
{
    (void)m;
    if (o->need_tokenizer)
        return di_fail(err, DI_EUNSUPPORTED, "text prompts need the tokenizer module");
    return DI_OK;
}
#endif

di_status serve_model_open(const serve_model_options *opt, serve_model *out, di_error *err)
{
    if (!opt || !out)
        return di_fail(err, DI_EINVAL, "model open: options and result are required");
    serve_model m = {0};
    di_status st = opt->model_dir
                       ? runner_model_load(opt->model_dir, opt->load, &m.rm, err)
                       : runner_model_random(opt->config ? opt->config : "small",
                                             opt->weights_seed, NULL, opt->load, &m.rm, err);
    if (st == DI_OK && (st = open_tokenizer(opt, &m, err)) == DI_OK)
        st = runner_model_check_token_map(&m.rm, opt->model_dir, err);
    if (st != DI_OK) {
        serve_model_close(&m);
        return st;
    }
    *out = m;
    return DI_OK;
}

void serve_model_close(serve_model *m)
{
    if (!m)
        return;
#ifdef DI_HAVE_TOKENIZER
    tok_free(m->tok);
#endif
    m->tok = NULL;
    runner_model_free(&m->rm);
}
