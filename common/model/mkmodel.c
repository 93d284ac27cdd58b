/* mkmodel.c: random-weight checkpoints in the released format (see mkmodel.h). */
#include "common/model/mkmodel.h"

#include <assert.h>
#include <dirent.h>
#include <errno.h>
#include <inttypes.h>
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/model/safetensors.h"
#include "common/model/weights.h"
#include "common/util/hash64.h"
#include "common/util/philox.h"
#include "kernels/cpu/numfmt.h"

#define BAND_ROWS 32u

void mkmodel_options_default(mkmodel_options *opt)
{
    memset(opt, 0, sizeof *opt);
    opt->shard_bytes = 2ull << 30;
    opt->max_bytes = 64000000000ull;
    opt->engram = MKMODEL_ENGRAM_AUTO;
    opt->engram_auto_limit = 1ull << 30;
}

/* ---- one tensor's generator --------------------------------------------------------------- */

/* Produces the bytes of one stored tensor (the values, or the `.scale` sibling) band by band
 * (32 logical rows at a time). */
typedef struct gen_tensor {
    model_tensor_spec spec;       /* name owned (name_buf) */
    char name_buf[160];
    char part_name[200];          /* the stored tensor's name (name or its .scale) */
    model_disk_layout disk;
    bool scale_part;              /* this stored tensor is the scale sibling */
    uint64_t key;                 /* model_tensor_key(seed, name) */
    double bias_std;              /* MODEL_INIT_GATE_BIAS */
    uint64_t engram_seed;         /* MODEL_INIT_ENGRAM */
    uint64_t band_stride;         /* bytes of a full band of this part */
    uint64_t cached;              /* band index in buf, UINT64_MAX when none */
    uint8_t *buf;                 /* band_stride bytes */
    float *vals;                  /* BAND_ROWS * cols values */
} gen_tensor;

static uint64_t part_row_bytes(const gen_tensor *g)
{
    const model_tensor_spec *s = &g->spec;
    if (!g->scale_part) /* the disk row: cols/2 bytes for packed FP4 */
        return st_dtype_bytes(g->disk.dtype, s->ndim == 2 ? g->disk.shape[1] : 1);
    return g->disk.scale_shape[1]; /* one scale row per logical row (1x32) */
}

static uint64_t band_bytes(const gen_tensor *g)
{
    if (g->scale_part && g->spec.fmt == MODEL_WFMT_FP8_32X32)
        return g->disk.scale_shape[1]; /* one scale row per 32 logical rows */
    return BAND_ROWS * part_row_bytes(g);
}

/* FP8 with a UE8M0 scale per 32x32 block: one band of `n` rows. */
static void quant_band_fp8_32x32(const gen_tensor *g, const float *v, uint64_t n, uint8_t *out)
{
    uint64_t cols = g->spec.cols, nb = g->disk.scale_shape[1];
    for (uint64_t b = 0; b < nb; b++) {
        uint64_t c0 = b * 32, c1 = c0 + 32 < cols ? c0 + 32 : cols;
        float amax = 0.0f;
        for (uint64_t r = 0; r < n; r++)
            for (uint64_t c = c0; c < c1; c++)
                amax = fmaxf(amax, fabsf(v[r * cols + c]));
        uint8_t se = di_ue8m0_ceil(fmaxf(amax, 1e-30f) / 448.0f);
        if (g->scale_part) {
            out[b] = se;
            continue;
        }
        float inv = 1.0f / di_ue8m0_decode(se);
        for (uint64_t r = 0; r < n; r++)
            for (uint64_t c = c0; c < c1; c++)
                out[r * cols + c] =
                    di_e4m3_encode(fminf(fmaxf(v[r * cols + c] * inv, -448.0f), 448.0f));
    }
}

static void store_row(const gen_tensor *g, const float *v, uint8_t *out)
{
    uint64_t cols = g->spec.cols;
    switch (g->spec.fmt) {
    case MODEL_WFMT_F32: memcpy(out, v, 4 * cols); break; /* little-endian hosts */
    case MODEL_WFMT_BF16:
        for (uint64_t c = 0; c < cols; c++) {
            uint16_t h = di_f32_to_bf16(v[c]);
            memcpy(out + 2 * c, &h, 2);
        }
        break;
    case MODEL_WFMT_FP4_1X32: /* block by block: any width */
        for (uint64_t b = 0; b < cols / 32; b++) {
            uint8_t packed[16], scale;
            di_quant_fp4_b32(v + 32 * b, 32, packed, &scale);
            if (g->scale_part)
                out[b] = scale;
            else
                memcpy(out + 16 * b, packed, 16);
        }
        break;
    default: assert(0);
    }
}

static void fill_band(gen_tensor *g, uint64_t band)
{
    const model_tensor_spec *s = &g->spec;
    uint64_t r0 = band * BAND_ROWS, n = s->rows - r0 < BAND_ROWS ? s->rows - r0 : BAND_ROWS;
    if (s->init == MODEL_INIT_ENGRAM) {
        uint8_t codes[4096], scales[128];
        for (uint64_t r = 0; r < n; r++) {
            model_engram_seeded_row(g->engram_seed, s->engram_layer, r0 + r, (uint32_t)s->cols,
                                    codes, scales);
            uint64_t rb = part_row_bytes(g);
            memcpy(g->buf + r * rb, g->scale_part ? scales : codes, rb);
        }
        g->cached = band;
        return;
    }
    if (s->init == MODEL_INIT_NORMAL || (s->init == MODEL_INIT_GATE_BIAS && g->bias_std > 0))
        model_random_normals(g->key, r0 * s->cols, n * s->cols,
                             s->init == MODEL_INIT_NORMAL ? s->std : g->bias_std, g->vals);
    else
        for (uint64_t i = 0; i < n * s->cols; i++)
            g->vals[i] = s->init == MODEL_INIT_ONES ? 1.0f : 0.0f;
    if (s->fmt == MODEL_WFMT_FP8_32X32)
        quant_band_fp8_32x32(g, g->vals, n, g->buf);
    else
        for (uint64_t r = 0; r < n; r++)
            store_row(g, g->vals + r * s->cols, g->buf + r * part_row_bytes(g));
    g->cached = band;
}

static di_status gen_fill(void *ud, uint64_t off, void *out, size_t len, di_error *err)
{
    gen_tensor *g = ud;
    uint8_t *dst = out;
    while (len > 0) {
        uint64_t band = off / g->band_stride, in = off % g->band_stride;
        if (g->cached != band)
            fill_band(g, band);
        size_t n = g->band_stride - in < len ? (size_t)(g->band_stride - in) : len;
        memcpy(dst, g->buf + in, n);
        dst += n;
        off += n;
        len -= n;
    }
    return DI_OK;
}

/* ---- planning ----------------------------------------------------------------------------- */

/* Every stored tensor of the checkpoint, in manifest order. */
typedef struct gen_list {
    gen_tensor *items;
    size_t n, cap;
    uint64_t seed;
    double bias_std;
    uint64_t engram_seed;
    bool skip_tables;
} gen_list;

static di_status push_part(gen_list *L, const model_tensor_spec *s, bool scale, di_error *err)
{
    if (L->n == L->cap) {
        size_t cap = L->cap ? 2 * L->cap : 1024;
        gen_tensor *p = realloc(L->items, cap * sizeof *p);
        if (!p)
            return di_fail(err, DI_ENOMEM, "out of memory");
        L->items = p;
        L->cap = cap;
    }
    gen_tensor *g = &L->items[L->n++];
    memset(g, 0, sizeof *g);
    g->spec = *s;
    snprintf(g->name_buf, sizeof g->name_buf, "%s", s->name);
    g->spec.name = NULL; /* items move on realloc: use name_buf */
    g->spec.dst = NULL;
    model_spec_disk(s, &g->disk);
    g->scale_part = scale;
    if (scale)
        model_scale_name(s->name, g->part_name, sizeof g->part_name);
    else
        snprintf(g->part_name, sizeof g->part_name, "%s", s->name);
    g->key = model_tensor_key(L->seed, s->name);
    g->bias_std = L->bias_std;
    g->engram_seed = L->engram_seed;
    g->cached = UINT64_MAX;
    return DI_OK;
}

static di_status collect_spec(void *ud, const model_tensor_spec *s, di_error *err)
{
    gen_list *L = ud;
    if (s->init == MODEL_INIT_ENGRAM && L->skip_tables)
        return DI_OK;
    di_status st = push_part(L, s, false, err);
    model_disk_layout d;
    model_spec_disk(s, &d);
    if (st == DI_OK && d.scale_ndim)
        st = push_part(L, s, true, err);
    return st;
}

static uint64_t part_bytes(const gen_tensor *g)
{
    if (g->scale_part)
        return g->disk.scale_shape[0] * g->disk.scale_shape[1];
    uint64_t n = g->disk.shape[0] * (g->disk.ndim == 2 ? g->disk.shape[1] : 1);
    return st_dtype_bytes(g->disk.dtype, n);
}

static di_status check_options(const mkmodel_options *o, di_error *err)
{
    if (o->shard_bytes == 0)
        return di_fail(err, DI_EINVAL, "shard size must be positive");
    if (!(o->gate_bias_std >= 0 && o->gate_bias_std <= 10))
        return di_fail(err, DI_EINVAL, "gate bias std %g outside [0, 10]", o->gate_bias_std);
    if ((unsigned)o->engram > MKMODEL_ENGRAM_SEED)
        return di_fail(err, DI_EINVAL, "unknown Engram table mode %d", (int)o->engram);
    return DI_OK;
}

/* The seed of the Engram tables: the config's own when it has one, else one derived from the
 * generator seed (below 2^53 so that every JSON reader keeps it exact). */
static uint64_t engram_seed_for(const model_config *cfg, const mkmodel_options *o)
{
    if (cfg->has_engram_table_seed)
        return cfg->engram_table_seed;
    return di_hash64("engram_table", 12, o->seed) & ((1ull << 53) - 1);
}

/* Decides the Engram mode and fills the config to write. */
static di_status plan_config(const model_config *cfg, const mkmodel_options *o, mkmodel_plan *p,
                             di_error *err)
{
    memset(p, 0, sizeof *p);
    p->config = *cfg;
    model_manifest_totals t;
    model_manifest_count(cfg, &t);
    bool seeded = false;
    if (cfg->n_engram_layers > 0)
        seeded = o->engram == MKMODEL_ENGRAM_SEED ||
                 (o->engram == MKMODEL_ENGRAM_AUTO && t.engram_table_bytes > o->engram_auto_limit);
    p->config.has_engram_table_seed = seeded;
    p->config.engram_table_seed = seeded ? engram_seed_for(cfg, o) : 0;
    di_status st = model_config_validate(&p->config, err);
    if (st != DI_OK)
        return st;
    p->engram_seeded = seeded;
    p->params = t.params;
    p->tensors = t.tensors - (seeded ? t.engram_table_tensors : 0);
    p->bytes = t.bytes - (seeded ? t.engram_table_bytes : 0);
    if (o->max_bytes && p->bytes > o->max_bytes && !o->force)
        return di_fail(err, DI_ENOSPC, "checkpoint of %.1f GB exceeds the %.1f GB limit (raise "
                       "the limit or force)", p->bytes / 1e9, o->max_bytes / 1e9);
    return DI_OK;
}

/* Assigns shard numbers (0-based) to the parts, in order; a tensor and its scale stay
 * together. Returns the shard count. */
static uint32_t assign_shards(const gen_list *L, uint64_t shard_bytes, uint32_t *shard_of)
{
    uint32_t shard = 0;
    uint64_t fill = 0;
    for (size_t i = 0; i < L->n; i++) {
        uint64_t b = part_bytes(&L->items[i]);
        if (L->items[i].scale_part == false && i + 1 < L->n && L->items[i + 1].scale_part)
            b += part_bytes(&L->items[i + 1]);
        if (!L->items[i].scale_part && fill > 0 && fill + b > shard_bytes) {
            shard++;
            fill = 0;
        }
        if (!L->items[i].scale_part)
            fill += b;
        shard_of[i] = shard;
    }
    return L->n ? shard + 1 : 0;
}

/* ---- writing ------------------------------------------------------------------------------ */

typedef struct write_state {
    const mkmodel_options *opt;
    mkmodel_progress prog;
    uint64_t shard_done;          /* bytes of finished shards */
    uint64_t shard_header;        /* header bytes of the current shard (not tensor data) */
    size_t tensors_before;        /* tensors of finished shards */
    size_t tensors_in_shard;
} write_state;

static void on_progress(void *ud, uint64_t file_bytes)
{
    write_state *ws = ud;
    /* file_bytes counts the header; st_write reports after each tensor */
    ws->tensors_in_shard++;
    ws->prog.tensors_done = ws->tensors_before + ws->tensors_in_shard;
    ws->prog.bytes_done = ws->shard_done + (file_bytes - ws->shard_header);
    if (ws->opt->progress)
        ws->opt->progress(ws->opt->progress_userdata, &ws->prog);
}

/* Writes root as text plus a newline, through a temporary file renamed into place. */
static di_status write_json(const char *path, const json_t *root, size_t flags, di_error *err)
{
    char *text = root ? json_dumps(root, flags) : NULL;
    if (!text)
        return di_fail(err, DI_ENOMEM, "%s: out of memory", path);
    char tmp[4200];
    snprintf(tmp, sizeof tmp, "%s.tmp", path);
    FILE *f = fopen(tmp, "wb");
    bool ok = f && fputs(text, f) >= 0 && fputc('\n', f) != EOF;
    if (f && fclose(f) != 0)
        ok = false;
    free(text);
    if (!ok || rename(tmp, path) != 0) {
        di_status st = di_fail(err, DI_EIO, "%s: %s", path, strerror(errno));
        unlink(tmp);
        return st;
    }
    return DI_OK;
}

static di_status write_shard(const char *dir, gen_list *L, const uint32_t *shard_of,
                             uint32_t shard, write_state *ws, json_t *weight_map, di_error *err)
{
    char name[64], path[4200];
    snprintf(name, sizeof name, "model-%05u-of-%05u.safetensors", shard + 1, ws->prog.n_shards);
    snprintf(path, sizeof path, "%s/%s", dir, name);
    size_t n = 0;
    for (size_t i = 0; i < L->n; i++)
        n += shard_of[i] == shard;
    st_write_tensor *w = calloc(n ? n : 1, sizeof *w);
    if (!w)
        return di_fail(err, DI_ENOMEM, "out of memory");
    di_status st = DI_OK;
    size_t k = 0;
    uint64_t data = 0;
    for (size_t i = 0; i < L->n && st == DI_OK; i++) {
        if (shard_of[i] != shard)
            continue;
        gen_tensor *g = &L->items[i];
        g->band_stride = band_bytes(g);
        g->buf = malloc(g->band_stride);
        g->vals = malloc(BAND_ROWS * g->spec.cols * sizeof(float));
        if (!g->buf || !g->vals)
            st = di_fail(err, DI_ENOMEM, "out of memory");
        w[k].name = g->part_name;
        w[k].dtype = g->scale_part ? ST_F8_E8M0 : g->disk.dtype;
        w[k].ndim = g->scale_part ? g->disk.scale_ndim : g->disk.ndim;
        for (uint32_t d = 0; d < w[k].ndim; d++)
            w[k].shape[d] = g->scale_part ? g->disk.scale_shape[d] : g->disk.shape[d];
        w[k].fill = gen_fill;
        w[k].userdata = g;
        data += part_bytes(g);
        json_object_set_new(weight_map, g->part_name, json_string(name));
        k++;
    }
    static const char *const mk[] = {"format"}, *const mv[] = {"pt"};
    if (st == DI_OK) {
        ws->prog.shard = shard + 1;
        ws->tensors_in_shard = 0;
        ws->shard_header = st_file_bytes_for(w, n, mk, mv, 1) - data;
        st = st_write(path, w, n, mk, mv, 1, on_progress, ws, err);
    }
    ws->shard_done += data;
    ws->tensors_before += n;
    for (size_t i = 0; i < L->n; i++) {
        if (shard_of[i] != shard)
            continue;
        free(L->items[i].buf);
        free(L->items[i].vals);
        L->items[i].buf = NULL;
        L->items[i].vals = NULL;
    }
    free(w);
    return st;
}

/* engram_token_map.json: token id -> compressed id; the pad token maps to the Engram pad id,
 * every other token to a fixed random id other than it. */
static di_status write_token_map(const char *dir, const model_config *c, uint64_t seed,
                                 di_error *err)
{
    json_t *map = json_array();
    uint64_t key = model_tensor_key(seed, "engram_token_map");
    uint32_t cv = c->engram_compressed_vocab_size;
    for (uint32_t t = 0; map && t < c->vocab_size; t++) {
        uint32_t id = c->engram_pad_id;
        if (t != c->pad_token_id && cv > 1) {
            id = (uint32_t)(di_philox_uniform(key, t, 0) * (cv - 1));
            id += id >= c->engram_pad_id;
        }
        json_array_append_new(map, json_integer(id));
    }
    json_t *root = json_pack("{s:I,s:I,s:I,s:o}", "vocab_size", (json_int_t)c->vocab_size,
                             "compressed_vocab_size", (json_int_t)cv, "pad_token_id",
                             (json_int_t)c->pad_token_id, "map", map);
    char path[4200];
    snprintf(path, sizeof path, "%s/engram_token_map.json", dir);
    di_status st = write_json(path, root, JSON_COMPACT, err);
    json_decref(root);
    return st;
}

static di_status prepare_dir(const char *dir, bool force, di_error *err)
{
    struct stat sb;
    if (stat(dir, &sb) != 0) {
        if (mkdir(dir, 0755) != 0)
            return di_fail(err, DI_EIO, "mkdir %s: %s", dir, strerror(errno));
        return DI_OK;
    }
    if (!S_ISDIR(sb.st_mode))
        return di_fail(err, DI_EEXIST, "%s exists and is not a directory", dir);
    DIR *d = opendir(dir);
    if (!d)
        return di_fail(err, DI_EIO, "%s: %s", dir, strerror(errno));
    bool empty = true;
    for (struct dirent *e; (e = readdir(d));)
        if (strcmp(e->d_name, ".") != 0 && strcmp(e->d_name, "..") != 0)
            empty = false;
    closedir(d);
    if (!empty && !force)
        return di_fail(err, DI_EEXIST, "output directory %s is not empty (force to overwrite)",
                       dir);
    /* Rewriting in place: an old config.json would make a half-written directory load with
     * a mix of new and old shards. It goes first; the new one is written last. */
    char path[4200];
    snprintf(path, sizeof path, "%s/config.json", dir);
    if (!empty && unlink(path) != 0 && errno != ENOENT)
        return di_fail(err, DI_EIO, "%s: %s", path, strerror(errno));
    return DI_OK;
}

di_status mkmodel_plan_for(const model_config *cfg, const mkmodel_options *opt,
                           mkmodel_plan *out, di_error *err)
{
    if (!cfg || !opt || !out)
        return di_fail(err, DI_EINVAL, "config, options and output must not be NULL");
    di_status st = check_options(opt, err);
    if (st != DI_OK)
        return st;
    mkmodel_plan *p = malloc(sizeof *p);
    if (!p)
        return di_fail(err, DI_ENOMEM, "out of memory");
    st = plan_config(cfg, opt, p, err);
    if (st == DI_OK) {
        gen_list L = {.seed = opt->seed, .skip_tables = p->engram_seeded};
        st = model_weights_manifest(&p->config, collect_spec, &L, err);
        uint32_t *shard_of = st == DI_OK ? calloc(L.n ? L.n : 1, sizeof *shard_of) : NULL;
        if (shard_of)
            p->n_shards = assign_shards(&L, opt->shard_bytes, shard_of);
        else if (st == DI_OK)
            st = di_fail(err, DI_ENOMEM, "out of memory");
        free(shard_of);
        free(L.items);
    }
    if (st == DI_OK)
        *out = *p;
    free(p);
    return st;
}

static di_status write_all_shards(const char *dir, gen_list *L, const mkmodel_plan *p,
                                  const mkmodel_options *opt, json_t *weight_map, di_error *err)
{
    uint32_t *shard_of = calloc(L->n ? L->n : 1, sizeof *shard_of);
    if (!shard_of)
        return di_fail(err, DI_ENOMEM, "out of memory");
    write_state ws = {.opt = opt};
    ws.prog.n_shards = assign_shards(L, opt->shard_bytes, shard_of);
    ws.prog.tensors_total = p->tensors;
    ws.prog.bytes_total = p->bytes;
    di_status st = DI_OK;
    for (uint32_t s = 0; s < ws.prog.n_shards && st == DI_OK; s++)
        st = write_shard(dir, L, shard_of, s, &ws, weight_map, err);
    free(shard_of);
    return st;
}

di_status mkmodel_write_sums(const char *dir, uint32_t threads, uint64_t *model_id,
                             di_error *err)
{
    if (!dir)
        return di_fail(err, DI_EINVAL, "directory must not be NULL");
    model_config *cfg = malloc(sizeof *cfg);
    st_index *idx = NULL;
    uint8_t fp[DI_SHA256_BYTES];
    di_status st = cfg ? model_config_load(dir, cfg, err) : di_fail(err, DI_ENOMEM, "out of memory");
    if (st == DI_OK)
        st = st_index_load(dir, &idx, err);
    if (st == DI_OK)
        st = shard_sums_write(dir, idx, threads, fp, err);
    if (st == DI_OK && model_id)
        *model_id = model_config_id_with_weights(cfg, fp);
    st_index_free(idx);
    free(cfg);
    return st;
}

di_status mkmodel_write(const model_config *cfg, const char *dir, const mkmodel_options *opt,
                        mkmodel_plan *plan, di_error *err)
{
    if (!cfg || !dir || !opt)
        return di_fail(err, DI_EINVAL, "config, output directory and options must not be NULL");
    mkmodel_plan *p = malloc(sizeof *p);
    if (!p)
        return di_fail(err, DI_ENOMEM, "out of memory");
    di_status st = mkmodel_plan_for(cfg, opt, p, err);
    if (st == DI_OK)
        st = prepare_dir(dir, opt->force, err);
    gen_list L = {.seed = opt->seed, .bias_std = opt->gate_bias_std,
                  .skip_tables = p->engram_seeded};
    if (st == DI_OK)
        L.engram_seed = engram_seed_for(cfg, opt);
    json_t *weight_map = json_object();
    if (st == DI_OK)
        st = model_weights_manifest(&p->config, collect_spec, &L, err);
    if (st == DI_OK)
        st = write_all_shards(dir, &L, p, opt, weight_map, err);
    if (st == DI_OK && p->config.n_engram_layers > 0)
        st = write_token_map(dir, &p->config, opt->seed, err);
    char path[4200];
    if (st == DI_OK) {
        json_t *index = json_pack("{s:{s:I},s:O}", "metadata", "total_size",
                                  (json_int_t)p->bytes, "weight_map", weight_map);
        snprintf(path, sizeof path, "%s/model.safetensors.index.json", dir);
        st = write_json(path, index, JSON_INDENT(2) | JSON_SORT_KEYS, err);
        json_decref(index);
    }
    if (st == DI_OK) {
        json_t *config = model_config_to_json(&p->config);
        snprintf(path, sizeof path, "%s/config.json", dir);
        st = write_json(path, config, JSON_INDENT(2), err);
        json_decref(config);
    }
    if (st == DI_OK)
        st = mkmodel_write_sums(dir, 0, &p->config.model_id, err);
    json_decref(weight_map);
    free(L.items);
    if (st == DI_OK && plan)
        *plan = *p;
    free(p);
    return st;
}
