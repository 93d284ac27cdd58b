/* weights_load.c: model_weights_load: map the shards, check every expected tensor against the
 * config, point the weight views into the mappings (see weights.h). */
#include <assert.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/model/weights_priv.h"
#include "kernels/cpu/numfmt.h"

typedef struct loader {
    model_weights *w;
    const model_load_options *opt;
    bool *used;                   /* [index->n_entries]: claimed by the manifest */
    model_load_progress prog;
    volatile uint8_t sink;        /* prefault reads land here */
} loader;

/* Namespaces of the release that a text engine skips. */
static const char *const k_ignored[] = {"vision.", "aligner.", "image_start", "image_end",
                                        "image_newline", NULL};
/* Namespaces whose every tensor the manifest must explain. */
static const char *const k_known[] = {"layers.", "mtp.", "embed.", "head.", "norm.", NULL};

static bool has_prefix_in(const char *name, const char *const *list)
{
    for (int i = 0; list[i]; i++)
        if (strncmp(name, list[i], strlen(list[i])) == 0)
            return true;
    return false;
}

static void shape_text(char *out, size_t cap, uint32_t ndim, const uint64_t *shape)
{
    size_t n = (size_t)snprintf(out, cap, "[");
    for (uint32_t d = 0; d < ndim && n < cap; d++)
        n += (size_t)snprintf(out + n, cap - n, "%s%" PRIu64, d ? ", " : "", shape[d]);
    if (n < cap)
        snprintf(out + n, cap - n, "]");
}

/* The tensor `name` of the checkpoint checked against (dtype, ndim, shape). NULL result with
 * DI_OK when absent (the caller decides whether that is an error). */
static di_status find_checked(loader *ld, const char *name, st_dtype dtype, uint32_t ndim,
                              const uint64_t *shape, const st_tensor **out, di_error *err)
{
    *out = NULL;
    int32_t e = st_index_entry(ld->w->index, name);
    if (e < 0)
        return DI_OK;
    const st_file *f = ld->w->shards[ld->w->index->shard_of[e]];
    const st_tensor *t = st_find(f, name);
    if (!t)
        return di_fail(err, DI_ECORRUPT, "%s: the index maps it to %s, which does not hold it",
                       name, ld->w->index->shards[ld->w->index->shard_of[e]]);
    if (t->dtype != dtype)
        return di_fail(err, DI_ECORRUPT, "%s: dtype %s, expected %s", name,
                       st_dtype_name(t->dtype), st_dtype_name(dtype));
    bool same = t->ndim == ndim;
    for (uint32_t d = 0; same && d < ndim; d++)
        same = t->shape[d] == shape[d];
    if (!same) {
        char got[96], want[96];
        shape_text(got, sizeof got, t->ndim, t->shape);
        shape_text(want, sizeof want, ndim, shape);
        return di_fail(err, DI_ECORRUPT, "%s: shape %s, expected %s", name, got, want);
    }
    ld->used[e] = true;
    *out = t;
    return DI_OK;
}

static void prefault(loader *ld, const st_tensor *t)
{
    if (!t || !(ld->opt->flags & MODEL_LOAD_PREFAULT))
        return;
    uint8_t acc = 0;
    for (uint64_t off = 0; off < t->bytes; off += 4096)
        acc ^= t->data[off];
    ld->sink ^= acc;
}

static void report(loader *ld, const char *name, uint32_t tensors, uint64_t bytes)
{
    ld->prog.tensors_done += tensors;
    ld->prog.bytes_done += bytes;
    ld->prog.current = name;
    if (ld->opt->progress)
        ld->opt->progress(ld->opt->progress_userdata, &ld->prog);
}

/* For a view inside a backbone layer's routed expert: its layer and expert. */
static bool backbone_expert(const model_weights *w, const void *dst, uint32_t *layer,
                            uint32_t *expert)
{
    const model_config *c = &w->config;
    const uint8_t *b = (const uint8_t *)w->expert_pool, *p = dst;
    size_t n = (size_t)c->n_layers * c->n_routed_experts;
    if (!dst || !b || p < b || p >= b + n * sizeof(model_expert_weights))
        return false;
    size_t i = (size_t)(p - b) / sizeof(model_expert_weights);
    *layer = (uint32_t)(i / c->n_routed_experts);
    *expert = (uint32_t)(i % c->n_routed_experts);
    return true;
}

/* Manifest callback: checks one expected tensor (and its scale) and fills the view. */
static di_status check_spec(void *ud, const model_tensor_spec *s, di_error *err)
{
    loader *ld = ud;
    model_disk_layout d;
    model_spec_disk(s, &d);
    const st_tensor *t = NULL, *sc = NULL;
    di_status st = find_checked(ld, s->name, d.dtype, d.ndim, d.shape, &t, err);
    if (st != DI_OK)
        return st;
    if (!t) {
        if (s->flags & (MODEL_SPEC_OPTIONAL | MODEL_SPEC_SEEDABLE))
            return DI_OK; /* the view stays NONE */
        char want[96];
        shape_text(want, sizeof want, d.ndim, d.shape);
        return di_fail(err, DI_ECORRUPT, "missing tensor %s (%s %s)", s->name,
                       st_dtype_name(d.dtype), want);
    }
    if (d.scale_ndim) {
        char sname[200];
        model_scale_name(s->name, sname, sizeof sname);
        st = find_checked(ld, sname, ST_F8_E8M0, d.scale_ndim, d.scale_shape, &sc, err);
        if (st != DI_OK)
            return st;
        if (!sc)
            return di_fail(err, DI_ECORRUPT, "missing tensor %s (the scale of %s)", sname,
                           s->name);
    }
    uint32_t el, ee;
    bool routed = backbone_expert(ld->w, s->dst, &el, &ee);
    if (routed && ld->opt->keep_expert &&
        !ld->opt->keep_expert(ld->opt->keep_expert_userdata, &ld->w->config, el, ee)) {
        /* checked: counted as the model's, though this process does not hold it */
        ld->w->n_params += s->rows * s->cols;
        ld->w->bytes += t->bytes + (sc ? sc->bytes : 0);
        report(ld, s->name, sc ? 2 : 1, t->bytes + (sc ? sc->bytes : 0));
        return DI_OK; /* checked; the view stays NONE */
    }
    model_tensor v = {
        .name = t->name, .fmt = s->fmt, .ndim = s->ndim, .rows = s->rows, .cols = s->cols,
        .data = t->data, .scale = sc ? sc->data : NULL,
        .scale_rows = sc ? d.scale_shape[0] : 0, .scale_cols = sc ? d.scale_shape[1] : 0,
    };
    assert(s->dst);
    *s->dst = v;
    if (!(s->flags & MODEL_SPEC_OPTIONAL))
        ld->w->n_params += s->rows * s->cols;
    uint64_t bytes = t->bytes + (sc ? sc->bytes : 0);
    ld->w->bytes += bytes;
    if (routed) {
        ld->w->expert_bytes += bytes;
        ld->w->experts_kept += s->dst == &ld->w->layers[el].ffn.experts[ee].w1;
    }
    prefault(ld, t);
    prefault(ld, sc);
    report(ld, s->name, sc ? 2 : 1, bytes);
    return DI_OK;
}

static di_status check_extra(loader *ld, di_error *err)
{
    const st_index *idx = ld->w->index;
    uint32_t extra = 0, first = 0;
    for (uint32_t i = 0; i < idx->n_entries; i++) {
        const char *name = idx->names[i];
        if (ld->used[i] || has_prefix_in(name, k_ignored))
            continue;
        if (!has_prefix_in(name, k_known)) {
            di_log(ld->opt->log, DI_LOG_DEBUG, "ignoring tensor %s of an unknown namespace",
                   name);
            continue;
        }
        if (extra++ == 0)
            first = i;
        if (ld->opt->flags & MODEL_LOAD_ALLOW_EXTRA)
            di_log(ld->opt->log, DI_LOG_WARN, "ignoring unexpected tensor %s", name);
    }
    if (extra == 0 || (ld->opt->flags & MODEL_LOAD_ALLOW_EXTRA))
        return DI_OK;
    return di_fail(err, DI_ECORRUPT,
                   "unexpected tensor %s: the config does not explain it (%u unexpected in all; "
                   "wrong config?)", idx->names[first], extra);
}

static di_status open_shards(model_weights *w, const char *dir, loader *ld, di_error *err)
{
    w->shards = calloc(w->index->n_shards ? w->index->n_shards : 1, sizeof *w->shards);
    if (!w->shards)
        return di_fail(err, DI_ENOMEM, "out of memory");
    for (uint32_t i = 0; i < w->index->n_shards; i++) {
        char path[4096];
        snprintf(path, sizeof path, "%s/%s", dir, w->index->shards[i]);
        di_status st = st_open(path, &w->shards[i], err);
        if (st != DI_OK)
            return st;
        ld->prog.bytes_total += w->shards[i]->file_bytes - w->shards[i]->data_offset;
    }
    ld->prog.tensors_total = w->index->n_entries;
    return DI_OK;
}

static di_status alloc_views(model_weights *w, di_error *err)
{
    const model_config *c = &w->config;
    uint64_t n_experts = (uint64_t)c->n_layers * c->n_routed_experts +
                         (uint64_t)c->n_mtp * c->dspark_n_routed_experts;
    w->layers = calloc(c->n_layers, sizeof *w->layers);
    w->drafts = calloc(c->n_mtp ? c->n_mtp : 1, sizeof *w->drafts);
    w->engrams = calloc(c->n_engram_layers ? c->n_engram_layers : 1, sizeof *w->engrams);
    w->expert_pool = calloc(n_experts ? n_experts : 1, sizeof *w->expert_pool);
    if (!w->layers || !w->drafts || !w->engrams || !w->expert_pool)
        return di_fail(err, DI_ENOMEM, "out of memory for %" PRIu64 " expert views", n_experts);
    model_expert_weights *next = w->expert_pool;
    for (uint32_t l = 0; l < c->n_layers; l++) {
        const model_layer_role *r = model_config_role(c, l);
        model_layer_weights *lw = &w->layers[l];
        lw->ffn.n_experts = c->n_routed_experts;
        lw->ffn.experts = next;
        next += c->n_routed_experts;
        lw->has_compressor = r->owns_compressor;
        lw->has_indexer = r->owns_indexer;
        if (r->engram >= 0) {
            model_engram_weights *g = &w->engrams[r->engram];
            lw->engram = g;
            g->layer = l;
            g->slot = (uint32_t)r->engram;
            g->rows = c->engram_num_embeddings[r->engram];
            g->width = c->engram_head_dim;
        }
    }
    for (uint32_t s = 0; s < c->n_mtp; s++) {
        w->drafts[s].block.ffn.n_experts = c->dspark_n_routed_experts;
        w->drafts[s].block.ffn.experts = next;
        next += c->dspark_n_routed_experts;
    }
    return DI_OK;
}

/* Seeded Engram tables: the checkpoint has no table tensor and the config has the seed. */
static void finish_engrams(model_weights *w)
{
    const model_config *c = &w->config;
    for (uint32_t k = 0; k < c->n_engram_layers; k++) {
        model_engram_weights *g = &w->engrams[k];
        if (g->table.fmt != MODEL_WFMT_NONE)
            continue;
        assert(c->has_engram_table_seed);
        g->seeded = true;
        g->seed = c->engram_table_seed;
        g->table.fmt = MODEL_WFMT_NONE;
        w->n_params += g->rows * g->width;
    }
}

/* Replaces every FP8 wo_a view by a BF16 copy in one owned allocation. */
static di_status wo_a_to_bf16(model_weights *w, di_error *err)
{
    const model_config *c = &w->config;
    uint32_t n = c->n_layers + c->n_mtp;
    model_tensor *views[MODEL_MAX_ENTRIES];
    for (uint32_t i = 0; i < n; i++)
        views[i] = i < c->n_layers ? &w->layers[i].attn.wo_a
                                   : &w->drafts[i - c->n_layers].block.attn.wo_a;
    size_t each = (size_t)views[0]->rows * views[0]->cols;
    w->owned_bytes = each * 2 * n;
    w->owned = malloc(w->owned_bytes);
    if (!w->owned)
        return di_fail(err, DI_ENOMEM, "out of memory for %zu bytes of BF16 wo_a",
                       w->owned_bytes);
    for (uint32_t i = 0; i < n; i++) {
        model_tensor *t = views[i];
        uint16_t *dst = (uint16_t *)w->owned + each * i;
        for (uint64_t r = 0; r < t->rows; r++)
            for (uint64_t k = 0; k < t->cols; k++)
                dst[r * t->cols + k] = di_f32_to_bf16(model_tensor_get(t, r, k));
        t->fmt = MODEL_WFMT_BF16;
        t->data = dst;
        t->scale = NULL;
        t->scale_rows = t->scale_cols = 0;
    }
    return DI_OK;
}

static di_status load_into(model_weights *w, const char *dir, const model_load_options *opt,
                           di_error *err)
{
    di_status st = opt->config ? DI_OK : model_config_load(dir, &w->config, err);
    if (opt->config)
        w->config = *opt->config;
    if (st == DI_OK)
        st = st_index_load(dir, &w->index, err);
    if (st != DI_OK)
        return st;
    loader ld = {.w = w, .opt = opt};
    w->n_tensors = w->index->n_entries;
    ld.used = calloc(w->index->n_entries ? w->index->n_entries : 1, sizeof *ld.used);
    if (!ld.used)
        return di_fail(err, DI_ENOMEM, "out of memory");
    st = open_shards(w, dir, &ld, err);
    if (st == DI_OK)
        st = alloc_views(w, err);
    if (st == DI_OK)
        st = model_manifest_into(&w->config, w, check_spec, &ld, err);
    if (st == DI_OK)
        st = check_extra(&ld, err);
    /* after the structural checks, which name the tensor; then every byte, once */
    if (st == DI_OK)
        st = shard_sums_fingerprint(dir, w->index, opt->hash_threads,
                                    (opt->flags & MODEL_LOAD_TRUST_SUMS) != 0, &w->sums, err);
    if (st == DI_OK)
        w->config.model_id = model_config_id_with_weights(&w->config, w->sums.fingerprint);
    free(ld.used);
    if (st != DI_OK)
        return st;
    finish_engrams(w);
    if (opt->flags & MODEL_LOAD_WO_A_BF16)
        st = wo_a_to_bf16(w, err);
    return st;
}

di_status model_weights_load(const char *dir, const model_load_options *opt, model_weights **out,
                             di_error *err)
{
    if (!dir || !out)
        return di_fail(err, DI_EINVAL, "directory and output must not be NULL");
    static const model_load_options defaults;
    model_weights *w = calloc(1, sizeof *w);
    if (!w)
        return di_fail(err, DI_ENOMEM, "out of memory");
    di_status st = load_into(w, dir, opt ? opt : &defaults, err);
    if (st != DI_OK) {
        di_error_prefix(err, "loading %s: ", dir);
        model_weights_free(w);
        return st;
    }
    *out = w;
    return DI_OK;
}

void model_weights_free(model_weights *w)
{
    if (!w)
        return;
    for (uint32_t i = 0; w->index && w->shards && i < w->index->n_shards; i++)
        st_close(w->shards[i]);
    free(w->shards);
    st_index_free(w->index);
    free(w->layers);
    free(w->drafts);
    free(w->engrams);
    free(w->expert_pool);
    free(w->owned);
    free(w);
}
