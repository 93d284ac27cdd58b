/* Weights: checkpoints written by the generator load and pass the checks; damaged ones give
 * errors that name the tensor; stored values decode back to the generated ones. */
#include <criterion/criterion.h>
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/model/mkmodel.h"
#include "common/model/safetensors.h"
#include "tests/model/tmpdir.h"
#include "common/model/weights.h"

static char g_dir[256];

static void make_dir(void)
{
    tmpdir_make(g_dir, sizeof g_dir, "weights");
}

static void remove_dir(void)
{
    tmpdir_remove(g_dir);
}

TestSuite(weights, .init = make_dir, .fini = remove_dir, .timeout = 120);

static void sub(char *out, size_t cap, const char *name)
{
    snprintf(out, cap, "%s/%s", g_dir, name);
}

static model_config *builtin(const char *name)
{
    model_config *c = malloc(sizeof *c);
    di_error e;
    cr_assert_eq(model_config_builtin(name, c, &e), DI_OK, "%s", e.msg);
    return c;
}

/* Writes config `name` with seed into g_dir/out (1 MiB shards so several exist). */
static void generate(const char *name, const char *out, uint64_t seed, mkmodel_engram_mode mode,
                     mkmodel_plan *plan)
{
    model_config *c = builtin(name);
    mkmodel_options o;
    mkmodel_options_default(&o);
    o.seed = seed;
    o.shard_bytes = 1 << 20;
    o.engram = mode;
    char dir[512];
    sub(dir, sizeof dir, out);
    di_error e = {0};
    cr_assert_eq(mkmodel_write(c, dir, &o, plan, &e), DI_OK, "%s", e.msg);
    free(c);
}

static di_status load(const char *out, uint32_t flags, model_weights **w, di_error *e)
{
    char dir[512];
    sub(dir, sizeof dir, out);
    model_load_options o = {.flags = flags};
    return model_weights_load(dir, &o, w, e);
}

typedef struct progress_log {
    uint64_t calls, last_tensors, last_bytes, bytes_total, tensors_total;
    bool monotonic;
} progress_log;

static void on_progress(void *ud, const model_load_progress *p)
{
    progress_log *l = ud;
    if (l->calls && (p->tensors_done <= l->last_tensors || p->bytes_done < l->last_bytes))
        l->monotonic = false;
    l->calls++;
    l->last_tensors = p->tensors_done;
    l->last_bytes = p->bytes_done;
    l->bytes_total = p->bytes_total;
    l->tensors_total = p->tensors_total;
}

/* ---- loading what the generator writes ---------------------------------------------------- */

static void check_structure(const model_weights *w)
{
    const model_config *c = &w->config;
    for (uint32_t l = 0; l < c->n_layers; l++) {
        const model_layer_weights *lw = &w->layers[l];
        const model_layer_role *r = model_config_role(c, l);
        cr_assert_eq(lw->attn.wq_b.rows, (uint64_t)c->n_heads * c->head_dim);
        cr_assert_eq(lw->attn.wq_b.fmt, MODEL_WFMT_FP8_32X32);
        cr_assert_eq(lw->attn.wo_a.fmt, MODEL_WFMT_FP8_32X32, "wo_a stays FP8 by default");
        cr_assert_eq(lw->has_compressor, r->owns_compressor);
        cr_assert_eq(lw->compressor.wgate.fmt != MODEL_WFMT_NONE,
                     r->owns_compressor && r->ratio > 1, "layer %u wgate", l);
        cr_assert_eq(lw->indexer.wq_b.fmt != MODEL_WFMT_NONE, r->owns_indexer);
        cr_assert_eq(lw->indexer.wk.fmt != MODEL_WFMT_NONE, r->owns_index_keys);
        cr_assert_eq(lw->ffn.n_experts, c->n_routed_experts);
        cr_assert_eq(lw->ffn.experts[c->n_routed_experts - 1].w2.fmt, MODEL_WFMT_FP4_1X32);
        cr_assert_eq(lw->ffn.experts[0].w2.cols, c->moe_inter_dim);
        cr_assert_eq(lw->ffn.shared.w1.fmt, MODEL_WFMT_FP8_32X32);
        cr_assert_eq(lw->ffn.gate_bias_vl.fmt, MODEL_WFMT_F32, "bias_vl written like the release");
        cr_assert_eq(lw->engram != NULL, r->engram >= 0);
        char want[64];
        snprintf(want, sizeof want, "layers.%u.attn.wkv.weight", l);
        cr_assert_str_eq(lw->attn.wkv.name, want);
    }
    for (uint32_t s = 0; s < c->n_mtp; s++) {
        const model_draft_weights *d = &w->drafts[s];
        cr_assert_eq(d->block.ffn.n_experts, c->dspark_n_routed_experts);
        cr_assert_eq(d->main_proj.fmt != MODEL_WFMT_NONE, s == 0);
        cr_assert_eq(d->confidence_proj.fmt != MODEL_WFMT_NONE, s + 1 == c->n_mtp);
        cr_assert_eq(d->block.has_compressor, false);
    }
    cr_assert_eq(w->drafts[0].main_proj.cols, (uint64_t)c->n_dspark_targets * c->dim);
    cr_assert_eq(w->drafts[c->n_mtp - 1].confidence_proj.cols,
                 (uint64_t)c->dim + c->dspark_markov_rank);
    cr_assert_eq(w->embed.rows, c->vocab_size);
    cr_assert_eq(w->head.fmt, MODEL_WFMT_BF16);
}

Test(weights, generated_small_configs_load_and_pass_the_checks)
{
    const char *names[] = {"tiny", "small"};
    for (int i = 0; i < 2; i++) {
        mkmodel_plan *plan = malloc(sizeof *plan);
        generate(names[i], names[i], 5, MKMODEL_ENGRAM_AUTO, plan);
        cr_assert(plan->n_shards > 1, "%s: several shards", names[i]);
        cr_assert(!plan->engram_seeded);
        progress_log pl = {.monotonic = true};
        char dir[512];
        sub(dir, sizeof dir, names[i]);
        model_load_options o = {.flags = MODEL_LOAD_PREFAULT, .progress = on_progress,
                                .progress_userdata = &pl};
        model_weights *w = NULL;
        di_error e = {0};
        cr_assert_eq(model_weights_load(dir, &o, &w, &e), DI_OK, "%s: %s", names[i], e.msg);
        model_manifest_totals t;
        model_manifest_count(&w->config, &t);
        cr_assert_eq(w->n_tensors, t.tensors);
        cr_assert_eq(w->n_tensors, plan->tensors);
        cr_assert_eq(w->n_params, t.params);
        cr_assert_eq(w->bytes, t.bytes);
        cr_assert(pl.calls > 0 && pl.monotonic);
        cr_assert_eq(pl.last_tensors, t.tensors, "progress ends at every tensor");
        cr_assert_eq(pl.last_bytes, t.bytes, "progress ends at every byte");
        cr_assert_eq(pl.bytes_total, t.bytes);
        cr_assert_eq(pl.tensors_total, t.tensors);
        cr_assert_eq(w->config.model_id, plan->config.model_id);
        check_structure(w);
        model_weights_free(w);
        free(plan);
    }
    model_weights_free(NULL);
}

Test(weights, v41_manifest_matches_the_released_inventory)
{
    model_config *c = builtin("v41-flash");
    model_manifest_totals t;
    model_manifest_count(c, &t);
    /* MODEL.md §7.2: 96,085 tensors less 263 vision and 3 image specials */
    cr_assert_eq(t.tensors, 96085 - 263 - 3);
    /* MODEL.md §4: grand total, text model and draft */
    cr_assert_eq(t.params, 762720031570ull);
    cr_assert_eq(t.engram_table_tensors, 4);
    /* 768,022,850 rows x (256 + 8) bytes */
    cr_assert_eq(t.engram_table_bytes, 768022850ull * 264);
    free(c);
}

/* A few rows of MODEL.md §7.2, checked on the specs the manifest emits. */
typedef struct inv_row {
    const char *name;
    st_dtype dtype;
    uint64_t shape[2], scale[2];
} inv_row;

static const inv_row k_inventory[] = {
    {"layers.0.attn.wq_a.weight", ST_F8_E4M3, {1280, 5120}, {40, 160}},
    {"layers.0.attn.wq_b.weight", ST_F8_E4M3, {32768, 1280}, {1024, 40}},
    {"layers.0.attn.wo_a.weight", ST_F8_E4M3, {8192, 4096}, {256, 128}},
    {"layers.0.attn.wo_b.weight", ST_F8_E4M3, {5120, 8192}, {160, 256}},
    {"layers.20.attn.indexer.wq_b.weight", ST_F8_E4M3, {4096, 1280}, {128, 40}},
    {"layers.20.attn.indexer.wk.weight", ST_BF16, {128, 512}, {0, 0}},
    {"layers.3.ffn.experts.383.w1.weight", ST_I8, {2304, 2560}, {2304, 160}},
    {"layers.3.ffn.experts.0.w2.weight", ST_I8, {5120, 1152}, {5120, 72}},
    {"layers.3.ffn.shared_experts.w2.weight", ST_F8_E4M3, {5120, 2304}, {160, 72}},
    {"layers.14.engram.wkv.weight", ST_F8_E4M3, {25600, 6144}, {800, 192}},
    {"layers.14.engram.embed.weight", ST_F8_E4M3, {384016682, 256}, {384016682, 8}},
    {"layers.1.hc_attn_fn", ST_F32, {24, 20480}, {0, 0}},
    {"mtp.0.main_proj.weight", ST_F8_E4M3, {5120, 15360}, {160, 480}},
    {"mtp.2.markov_head.head.weight", ST_BF16, {129280, 256}, {0, 0}},
    {"mtp.2.confidence_head.proj.weight", ST_BF16, {1, 5376}, {0, 0}},
    {"mtp.1.ffn.gate.weight", ST_BF16, {128, 5120}, {0, 0}},
    {"embed.weight", ST_BF16, {129280, 5120}, {0, 0}},
};
#define N_INV (sizeof k_inventory / sizeof k_inventory[0])

typedef struct inv_state {
    bool seen[N_INV];
    uint64_t count;
    bool names_unique;
} inv_state;

static di_status check_inventory(void *ud, const model_tensor_spec *s, di_error *err)
{
    inv_state *st = ud;
    st->count++;
    for (size_t i = 0; i < N_INV; i++) {
        if (strcmp(s->name, k_inventory[i].name) != 0)
            continue;
        model_disk_layout d;
        model_spec_disk(s, &d);
        cr_assert_eq(d.dtype, k_inventory[i].dtype, "%s dtype", s->name);
        cr_assert_eq(d.shape[0], k_inventory[i].shape[0], "%s rows", s->name);
        cr_assert_eq(d.shape[1], k_inventory[i].shape[1], "%s cols", s->name);
        cr_assert_eq(d.scale_shape[0], k_inventory[i].scale[0], "%s scale rows", s->name);
        cr_assert_eq(d.scale_shape[1], k_inventory[i].scale[1], "%s scale cols", s->name);
        st->seen[i] = true;
    }
    cr_assert(strcmp(s->name, "layers.24.attn.indexer.wk.weight") != 0, "no wk on layer 24");
    cr_assert(strcmp(s->name, "layers.20.attn.compressor.wgate.weight") != 0, "no gate at r=1");
    return DI_OK;
}

Test(weights, v41_shapes_match_model_md_section_7)
{
    model_config *c = builtin("v41-flash");
    inv_state st = {0};
    di_error e;
    cr_assert_eq(model_weights_manifest(c, check_inventory, &st, &e), DI_OK);
    for (size_t i = 0; i < N_INV; i++)
        cr_assert(st.seen[i], "%s emitted", k_inventory[i].name);
    free(c);
}

/* ---- damaged checkpoints ------------------------------------------------------------------ */

/* The shard of `tensor` in checkpoint `out` (path into buf). */
static void shard_of(const char *out, const char *tensor, char *buf, size_t cap)
{
    char dir[512];
    sub(dir, sizeof dir, out);
    st_index *idx;
    di_error e;
    cr_assert_eq(st_index_load(dir, &idx, &e), DI_OK, "%s", e.msg);
    int32_t s = st_index_find(idx, tensor);
    cr_assert(s >= 0, "%s in the index", tensor);
    snprintf(buf, cap, "%s/%s", dir, idx->shards[s]);
    st_index_free(idx);
}

typedef void (*tensor_edit)(st_write_tensor *t);

/* Rewrites the shard holding `tensor`: edit() changes its entry, a NULL edit drops it (keep
 * false) or keeps it unchanged (keep true); the n_extra tensors of `extra` are added. */
static void rewrite_shard(const char *out, const char *tensor, tensor_edit edit, bool keep,
                          const st_write_tensor *extra, size_t n_extra)
{
    char path[1024];
    shard_of(out, tensor, path, sizeof path);
    st_file *f;
    di_error e;
    cr_assert_eq(st_open(path, &f, &e), DI_OK, "%s", e.msg);
    st_write_tensor *w = calloc(f->n_tensors + n_extra, sizeof *w);
    size_t n = 0;
    for (uint32_t i = 0; i < f->n_tensors; i++) {
        const st_tensor *t = &f->tensors[i];
        w[n] = (st_write_tensor){.name = t->name, .dtype = t->dtype, .ndim = t->ndim,
                                 .data = t->data};
        memcpy(w[n].shape, t->shape, sizeof t->shape);
        if (strcmp(t->name, tensor) == 0) {
            if (!edit && !keep)
                continue;
            if (edit)
                edit(&w[n]);
        }
        n++;
    }
    if (n_extra)
        memcpy(w + n, extra, n_extra * sizeof *extra);
    n += n_extra;
    char tmp[1100];
    snprintf(tmp, sizeof tmp, "%s.new", path);
    cr_assert_eq(st_write(tmp, w, n, NULL, NULL, 0, NULL, NULL, &e), DI_OK, "%s", e.msg);
    st_close(f);
    free(w);
    cr_assert_eq(rename(tmp, path), 0);
}

/* Edits the index: removes `drop` (may be NULL), adds `add` -> shard of `like`. */
static void edit_index(const char *out, const char *drop, const char *add, const char *like)
{
    char path[600];
    snprintf(path, sizeof path, "%s/%s/model.safetensors.index.json", g_dir, out);
    json_t *root = json_load_file(path, 0, NULL);
    json_t *map = json_object_get(root, "weight_map");
    if (drop)
        cr_assert_eq(json_object_del(map, drop), 0, "%s in the index", drop);
    if (add)
        json_object_set(map, add, json_object_get(map, like));
    cr_assert_eq(json_dump_file(root, path, 0), 0);
    json_decref(root);
}

static void expect_load_error(const char *out, di_status code, const char *needle)
{
    model_weights *w = NULL;
    di_error e = {0};
    di_status st = load(out, 0, &w, &e);
    cr_assert_eq(st, code, "status %d: %s", st, e.msg);
    cr_assert_null(w);
    cr_assert(strstr(e.msg, needle), "message '%s' lacks '%s'", e.msg, needle);
}

static void halve_rows(st_write_tensor *t)
{
    t->shape[1] /= 2; /* the data pointer still covers the smaller size */
}

static void as_bf16(st_write_tensor *t)
{
    t->dtype = ST_BF16;
    t->shape[0] *= 2; /* same bytes, so only the dtype is wrong... and the shape */
}

static void f32_as_i32(st_write_tensor *t)
{
    t->dtype = ST_I32;
}

Test(weights, missing_tensor_is_named)
{
    generate("tiny", "m", 1, MKMODEL_ENGRAM_AUTO, NULL);
    edit_index("m", "layers.3.attn.wkv.weight", NULL, NULL);
    expect_load_error("m", DI_ECORRUPT, "missing tensor layers.3.attn.wkv.weight (F8_E4M3 [64, 128])");
    /* a missing scale sibling is named too */
    generate("tiny", "s", 1, MKMODEL_ENGRAM_AUTO, NULL);
    edit_index("s", "layers.2.ffn.experts.5.w2.scale", NULL, NULL);
    expect_load_error("s", DI_ECORRUPT, "missing tensor layers.2.ffn.experts.5.w2.scale");
}

Test(weights, wrong_shape_and_dtype_are_named)
{
    generate("tiny", "shape", 1, MKMODEL_ENGRAM_AUTO, NULL);
    rewrite_shard("shape", "layers.3.attn.wkv.weight", halve_rows, true, NULL, 0);
    expect_load_error("shape", DI_ECORRUPT,
                      "layers.3.attn.wkv.weight: shape [64, 64], expected [64, 128]");
    generate("tiny", "dtype", 1, MKMODEL_ENGRAM_AUTO, NULL);
    rewrite_shard("dtype", "layers.0.attn.attn_sink", f32_as_i32, true, NULL, 0);
    expect_load_error("dtype", DI_ECORRUPT, "layers.0.attn.attn_sink: dtype I32, expected F32");
    generate("tiny", "dtype2", 1, MKMODEL_ENGRAM_AUTO, NULL);
    rewrite_shard("dtype2", "layers.1.ffn.experts.2.w3.weight", as_bf16, true, NULL, 0);
    expect_load_error("dtype2", DI_ECORRUPT,
                      "layers.1.ffn.experts.2.w3.weight: dtype BF16, expected I8");
}

Test(weights, truncated_shard_is_named)
{
    generate("tiny", "t", 1, MKMODEL_ENGRAM_AUTO, NULL);
    char path[1024];
    shard_of("t", "head.weight", path, sizeof path);
    struct stat sb;
    cr_assert_eq(stat(path, &sb), 0);
    cr_assert_eq(truncate(path, sb.st_size - 100), 0);
    expect_load_error("t", DI_ECORRUPT, "file truncated?");
    model_weights *w;
    di_error e;
    load("t", 0, &w, &e);
    cr_assert(strstr(e.msg, strrchr(path, '/') + 1), "names the shard: %s", e.msg);
    /* a shard the index lists but the directory lacks */
    unlink(path);
    expect_load_error("t", DI_ENOENT, strrchr(path, '/') + 1);
}

Test(weights, unexpected_and_misplaced_tensors)
{
    /* the index lists a tensor in a shard that does not hold it */
    generate("tiny", "y", 1, MKMODEL_ENGRAM_AUTO, NULL);
    rewrite_shard("y", "layers.3.attn.wkv.weight", NULL, false, NULL, 0);
    expect_load_error("y", DI_ECORRUPT, "layers.3.attn.wkv.weight: the index maps it to model-");

    /* extra tensors: a vision one is skipped, one of a known namespace is reported */
    generate("tiny", "e", 1, MKMODEL_ENGRAM_AUTO, NULL);
    static const uint16_t junk[64 * 128];
    static const uint8_t vis[16];
    const st_write_tensor extra[2] = {
        {.name = "layers.3.attn.compressor.wkv.weight", .dtype = ST_BF16, .ndim = 2,
         .shape = {64, 128}, .data = junk},
        {.name = "vision.blocks.0.w", .dtype = ST_U8, .ndim = 1, .shape = {16}, .data = vis},
    };
    rewrite_shard("e", "head.weight", NULL, true, extra, 2);
    model_weights *w = NULL;
    di_error e = {0};
    expect_load_error("e", DI_ECORRUPT, "the checksum manifest says");
    char dir[600];
    snprintf(dir, sizeof dir, "%s/e", g_dir);
    cr_assert_eq(mkmodel_write_sums(dir, 1, NULL, &e), DI_OK, "an intended change: %s", e.msg);
    cr_assert_eq(load("e", 0, &w, &e), DI_OK, "tensors missing from the index are unread: %s",
                 e.msg);
    model_weights_free(w);
    edit_index("e", NULL, "vision.blocks.0.w", "head.weight");
    cr_assert_eq(load("e", 0, &w, &e), DI_OK, "vision tensors are skipped: %s", e.msg);
    model_weights_free(w);
    edit_index("e", NULL, "layers.3.attn.compressor.wkv.weight", "head.weight");
    expect_load_error("e", DI_ECORRUPT, "unexpected tensor layers.3.attn.compressor.wkv.weight");
    cr_assert_eq(load("e", MODEL_LOAD_ALLOW_EXTRA, &w, &e), DI_OK, "%s", e.msg);
    model_weights_free(w);
}

Test(weights, wrong_config_is_caught)
{
    generate("tiny", "c", 1, MKMODEL_ENGRAM_AUTO, NULL);
    model_config *small = builtin("small");
    char dir[512];
    sub(dir, sizeof dir, "c");
    model_load_options o = {.config = small};
    model_weights *w = NULL;
    di_error e = {0};
    cr_assert_eq(model_weights_load(dir, &o, &w, &e), DI_ECORRUPT);
    cr_assert(strstr(e.msg, "embed.weight: shape [4096, 128], expected [8192, 256]"), "%s",
              e.msg);
    free(small);
    /* a broken config.json */
    char path[600];
    snprintf(path, sizeof path, "%s/config.json", dir);
    FILE *f = fopen(path, "w");
    fputs("{\"text_config\": {\"hidden_size\": 128}}", f);
    fclose(f);
    cr_assert_eq(load("c", 0, &w, &e), DI_EINVAL);
    cr_assert(strstr(e.msg, "missing key"), "%s", e.msg);
    cr_assert_eq(load("nonexistent", 0, &w, &e), DI_ENOENT);
}

/* ---- values -------------------------------------------------------------------------------- */

static const float k_e2m1[8] = {0, 0.5f, 1, 1.5f, 2, 3, 4, 6};

/* The generator's value of element (r, c) of a NORMAL tensor with this std. */
static double generated(uint64_t seed, const char *name, uint64_t cols, double std, uint64_t r,
                        uint64_t c)
{
    return std * model_random_normal(model_tensor_key(seed, name), r * cols + c);
}

Test(weights, fp4_packing_and_scales_decode_back_to_the_generated_values)
{
    generate("tiny", "v", 11, MKMODEL_ENGRAM_AUTO, NULL);
    model_weights *w;
    di_error e;
    cr_assert_eq(load("v", 0, &w, &e), DI_OK, "%s", e.msg);
    const model_tensor *t = &w->layers[3].ffn.experts[6].w2; /* [dim, inter] = [128, 64] */
    cr_assert_eq(t->rows, 128);
    cr_assert_eq(t->cols, 64);
    double std = 1.0 / sqrt(64.0);
    const uint8_t *bytes = t->data;
    for (uint64_t r = 0; r < t->rows; r++) {
        for (uint64_t b = 0; b < t->cols / 32; b++) {
            double amax = 0;
            for (uint64_t c = b * 32; c < b * 32 + 32; c++)
                amax = fmax(amax, fabs(generated(11, t->name, t->cols, std, r, c)));
            int want_exp = (int)ceil(log2(amax / 6.0));
            uint8_t sbyte = t->scale[r * t->scale_cols + b];
            cr_assert_eq((int)sbyte - 127, want_exp, "row %lu block %lu scale", r, b);
            double s = ldexp(1.0, want_exp);
            for (uint64_t c = b * 32; c < b * 32 + 32; c++) {
                uint8_t byte = bytes[r * (t->cols / 2) + c / 2];
                uint8_t code = c % 2 ? byte >> 4 : byte & 15; /* element 2i in the low nibble */
                double q = (code & 8 ? -1 : 1) * k_e2m1[code & 7];
                double v = generated(11, t->name, t->cols, std, r, c) / s;
                for (int g = 0; g < 8; g++)
                    for (int sign = -1; sign <= 1; sign += 2)
                        cr_assert(fabs(v - q) <= fabs(v - sign * k_e2m1[g]) + 1e-12,
                                  "row %lu col %lu: %g stored as %g, nearer %g", r, c, v, q,
                                  sign * k_e2m1[g]);
                cr_assert_float_eq(model_tensor_get(t, r, c), q * s, 0);
            }
        }
    }
    model_weights_free(w);
}

Test(weights, fp8_blocks_and_plain_tensors_decode_back)
{
    generate("tiny", "f", 12, MKMODEL_ENGRAM_AUTO, NULL);
    model_weights *w;
    di_error e;
    cr_assert_eq(load("f", 0, &w, &e), DI_OK, "%s", e.msg);
    const model_tensor *t = &w->layers[2].attn.wq_b; /* [256, 64], 32x32 blocks */
    double std = 1.0 / sqrt((double)t->cols);
    for (uint64_t br = 0; br < t->rows / 32; br++) {
        for (uint64_t bc = 0; bc < t->cols / 32; bc++) {
            double amax = 0;
            for (uint64_t r = br * 32; r < br * 32 + 32; r++)
                for (uint64_t c = bc * 32; c < bc * 32 + 32; c++)
                    amax = fmax(amax, fabs(generated(12, t->name, t->cols, std, r, c)));
            int want_exp = (int)ceil(log2(amax / 448.0));
            cr_assert_eq((int)t->scale[br * t->scale_cols + bc] - 127, want_exp);
            double s = ldexp(1.0, want_exp);
            for (uint64_t r = br * 32; r < br * 32 + 32; r++) {
                for (uint64_t c = bc * 32; c < bc * 32 + 32; c++) {
                    double v = generated(12, t->name, t->cols, std, r, c);
                    double got = model_tensor_get(t, r, c);
                    /* E4M3 keeps 3 mantissa bits: within half an ulp, 2^-4 relative, or half
                     * the subnormal step 2^-9 */
                    cr_assert(fabs(got - v) <= fmax(fabs(v) * 0x1p-4, s * 0x1p-10),
                              "(%lu, %lu): %g stored as %g", r, c, v, got);
                }
            }
        }
    }
    /* BF16: embeddings N(0, 1) rounded to nearest */
    for (uint64_t r = 0; r < 4; r++)
        for (uint64_t c = 0; c < w->embed.cols; c++) {
            double v = generated(12, "embed.weight", w->embed.cols, 1.0, r, c);
            cr_assert(fabs(model_tensor_get(&w->embed, r, c) - v) <= fabs(v) * 0x1p-8 + 1e-30,
                      "BF16 rounds to within half an ulp");
        }
    /* the fixed initial values of MODEL.md §5 */
    const model_layer_weights *l1 = &w->layers[1];
    for (uint64_t i = 0; i < w->config.dim; i++) {
        cr_assert_eq(model_tensor_get(&l1->attn_norm, i, 0), 1.0f);
        cr_assert_eq(model_tensor_get(&l1->engram->q_weight, 3, i), 1.0f);
        cr_assert_eq(model_tensor_get(&l1->engram->k_weight, 0, i), 1.0f);
    }
    for (uint64_t i = 0; i < 24; i++)
        cr_assert_eq(model_tensor_get(&l1->hc_ffn.base, i, 0), 0.0f);
    for (uint64_t i = 0; i < 3; i++)
        cr_assert_eq(model_tensor_get(&l1->hc_ffn.scale, i, 0), 1.0f);
    for (uint64_t i = 0; i < w->config.n_heads; i++)
        cr_assert_eq(model_tensor_get(&l1->attn.attn_sink, i, 0), 0.0f);
    for (uint64_t i = 0; i < w->config.n_routed_experts; i++)
        cr_assert_eq(model_tensor_get(&l1->ffn.gate_bias, i, 0), 0.0f);
    double sum2 = 0;
    uint64_t n = l1->hc_attn.fn.rows * l1->hc_attn.fn.cols;
    for (uint64_t r = 0; r < l1->hc_attn.fn.rows; r++)
        for (uint64_t c = 0; c < l1->hc_attn.fn.cols; c++)
            sum2 += pow(model_tensor_get(&l1->hc_attn.fn, r, c), 2);
    double sd = sqrt(sum2 / n);
    cr_assert(sd > 0.9e-4 && sd < 1.1e-4, "hc fn std %g", sd);
    model_weights_free(w);
}

Test(weights, gate_bias_std_and_bf16_wo_a)
{
    model_config *c = builtin("tiny");
    mkmodel_options o;
    mkmodel_options_default(&o);
    o.seed = 4;
    o.gate_bias_std = 0.5;
    char dir[512];
    sub(dir, sizeof dir, "b");
    di_error e;
    cr_assert_eq(mkmodel_write(c, dir, &o, NULL, &e), DI_OK, "%s", e.msg);
    model_weights *w, *wb;
    cr_assert_eq(load("b", 0, &w, &e), DI_OK, "%s", e.msg);
    cr_assert_eq(load("b", MODEL_LOAD_WO_A_BF16, &wb, &e), DI_OK, "%s", e.msg);
    double sum2 = 0;
    uint32_t n = 0;
    for (uint32_t l = 0; l < c->n_layers; l++)
        for (uint32_t x = 0; x < c->n_routed_experts; x++, n++)
            sum2 += pow(model_tensor_get(&w->layers[l].ffn.gate_bias, x, 0), 2);
    double sd = sqrt(sum2 / n);
    cr_assert(sd > 0.35 && sd < 0.65, "bias std %g over %u draws", sd, n);
    /* wo_a as BF16 holds exactly the FP8 x scale values */
    for (uint32_t l = 0; l < c->n_layers + c->n_mtp; l++) {
        const model_tensor *a = l < c->n_layers ? &w->layers[l].attn.wo_a
                                                : &w->drafts[l - c->n_layers].block.attn.wo_a;
        const model_tensor *b = l < c->n_layers ? &wb->layers[l].attn.wo_a
                                                : &wb->drafts[l - c->n_layers].block.attn.wo_a;
        cr_assert_eq(b->fmt, MODEL_WFMT_BF16);
        cr_assert_null(b->scale);
        for (uint64_t r = 0; r < a->rows; r += 7)
            for (uint64_t k = 0; k < a->cols; k++)
                cr_assert_eq(model_tensor_get(a, r, k), model_tensor_get(b, r, k));
    }
    cr_assert_eq(wb->owned_bytes, (size_t)(c->n_layers + c->n_mtp) * w->layers[0].attn.wo_a.rows *
                                      w->layers[0].attn.wo_a.cols * 2);
    model_weights_free(w);
    model_weights_free(wb);
    free(c);
}

Test(weights, seeded_engram_rows_equal_the_written_table)
{
    mkmodel_plan *pa = malloc(sizeof *pa), *pb = malloc(sizeof *pb);
    generate("small", "write", 21, MKMODEL_ENGRAM_WRITE, pa);
    generate("small", "seed", 21, MKMODEL_ENGRAM_SEED, pb);
    cr_assert(!pa->engram_seeded && pb->engram_seeded);
    cr_assert(pb->config.has_engram_table_seed && !pa->config.has_engram_table_seed);
    cr_assert_eq(model_config_fingerprint(&pa->config), model_config_fingerprint(&pb->config),
                 "the seed is not geometry");
    cr_assert_neq(pa->config.model_id, pb->config.model_id,
                  "but the model id covers the weight files, which differ");
    cr_assert(pb->bytes < pa->bytes);
    model_weights *a, *b;
    di_error e;
    cr_assert_eq(load("write", 0, &a, &e), DI_OK, "%s", e.msg);
    cr_assert_eq(load("seed", 0, &b, &e), DI_OK, "%s", e.msg);
    cr_assert_eq(a->n_params, b->n_params, "seeded rows count as parameters");
    for (uint32_t k = 0; k < a->config.n_engram_layers; k++) {
        const model_engram_weights *ga = &a->engrams[k], *gb = &b->engrams[k];
        cr_assert(!ga->seeded && gb->seeded);
        cr_assert_null(gb->table.data);
        cr_assert_eq(ga->rows, gb->rows);
        uint64_t rows[] = {0, 1, 4000, ga->rows - 1};
        float ra[64], rb[64];
        for (int i = 0; i < 4; i++) {
            model_engram_row(ga, rows[i], ra);
            model_engram_row(gb, rows[i], rb);
            cr_assert_eq(memcmp(ra, rb, sizeof ra), 0, "layer slot %u row %lu", k, rows[i]);
            double s2 = 0;
            for (int j = 0; j < 64; j++)
                s2 += ra[j] * ra[j];
            cr_assert(s2 > 10 && s2 < 200, "N(0, 1) rows: sum of squares %g", s2);
        }
        cr_assert_eq(model_engram_row_checked(gb, gb->rows, ra, &e), DI_ERANGE);
        cr_assert_eq(model_engram_row_checked(ga, 7, rb, &e), DI_OK);
    }
    model_weights_free(a);
    model_weights_free(b);
    /* without the seed key the missing tables are an error */
    char path[600];
    snprintf(path, sizeof path, "%s/seed/config.json", g_dir);
    json_t *root = json_load_file(path, 0, NULL);
    cr_assert_eq(json_object_del(json_object_get(root, "text_config"), "engram_table_seed"), 0);
    json_dump_file(root, path, 0);
    json_decref(root);
    expect_load_error("seed", DI_ECORRUPT, "missing tensor layers.1.engram.embed.weight");
    free(pa);
    free(pb);
}

Test(weights, engram_token_map_keeps_the_pad)
{
    generate("tiny", "tm", 2, MKMODEL_ENGRAM_AUTO, NULL);
    char path[600];
    snprintf(path, sizeof path, "%s/tm/engram_token_map.json", g_dir);
    json_t *root = json_load_file(path, 0, NULL);
    cr_assert_not_null(root);
    json_t *map = json_object_get(root, "map");
    cr_assert_eq(json_array_size(map), 4096);
    cr_assert_eq(json_integer_value(json_object_get(root, "compressed_vocab_size")), 3000);
    uint32_t pads = 0;
    for (size_t t = 0; t < json_array_size(map); t++) {
        json_int_t id = json_integer_value(json_array_get(map, t));
        cr_assert(id >= 0 && id < 3000);
        pads += id == 2;
    }
    cr_assert_eq(json_integer_value(json_array_get(map, 2)), 2, "pad token -> pad id");
    cr_assert_eq(pads, 1, "only the pad token maps to the pad id");
    json_decref(root);
}

/* keep_expert: odd experts of every backbone layer dropped */
static bool keep_even(void *ud, const model_config *c, uint32_t layer, uint32_t e)
{
    (void)c;
    (*(uint32_t *)ud)++;
    return e % 2 == 0 && layer < UINT32_MAX;
}

Test(weights, expert_filter_keeps_only_the_chosen_experts)
{
    generate("tiny", "filter", 3, MKMODEL_ENGRAM_AUTO, NULL);
    char dir[512];
    sub(dir, sizeof dir, "filter");
    di_error e = {0};
    model_weights *all = NULL, *w = NULL;
    cr_assert_eq(model_weights_load(dir, NULL, &all, &e), DI_OK, "%s", e.msg);
    uint32_t calls = 0;
    model_load_options o = {.flags = MODEL_LOAD_PREFAULT, .keep_expert = keep_even,
                            .keep_expert_userdata = &calls};
    cr_assert_eq(model_weights_load(dir, &o, &w, &e), DI_OK, "%s", e.msg);
    const model_config *c = &w->config;
    uint32_t E = c->n_routed_experts;
    cr_assert(E >= 2);
    /* six tensors (three weights, three scales) an expert, each asked about once a weight */
    cr_assert_eq(calls, 3 * c->n_layers * E);
    uint64_t one = 0;
    const model_expert_weights *x0 = &all->layers[0].ffn.experts[0];
    const model_tensor *parts[3] = {&x0->w1, &x0->w2, &x0->w3};
    for (int k = 0; k < 3; k++)
        one += model_tensor_data_bytes(parts[k]) + model_tensor_scale_bytes(parts[k]);
    cr_assert_eq(all->experts_kept, c->n_layers * E);
    cr_assert_eq(all->expert_bytes, (uint64_t)c->n_layers * E * one);
    cr_assert_eq(w->experts_kept, c->n_layers * ((E + 1) / 2));
    cr_assert_eq(w->expert_bytes, (uint64_t)w->experts_kept * one);
    /* the model's totals do not change; the dropped views are NONE, the kept ones the same */
    cr_assert_eq(w->n_params, all->n_params);
    cr_assert_eq(w->bytes, all->bytes);
    for (uint32_t l = 0; l < c->n_layers; l++)
        for (uint32_t x = 0; x < E; x++) {
            const model_expert_weights *a = &all->layers[l].ffn.experts[x];
            const model_expert_weights *b = &w->layers[l].ffn.experts[x];
            if (x % 2) {
                cr_assert_eq(b->w1.fmt, MODEL_WFMT_NONE);
                cr_assert_eq(b->w2.fmt, MODEL_WFMT_NONE);
                cr_assert_null(b->w3.data);
            } else {
                cr_assert_eq(b->w2.fmt, MODEL_WFMT_FP4_1X32);
                cr_assert_eq(memcmp(a->w2.data, b->w2.data, model_tensor_data_bytes(&a->w2)), 0);
                cr_assert_eq(memcmp(a->w3.scale, b->w3.scale, model_tensor_scale_bytes(&a->w3)),
                             0);
            }
        }
    /* the draft stages keep every expert */
    for (uint32_t s = 0; s < c->n_mtp; s++)
        for (uint32_t x = 0; x < c->dspark_n_routed_experts; x++)
            cr_assert_eq(w->drafts[s].block.ffn.experts[x].w1.fmt, MODEL_WFMT_FP4_1X32);
    model_weights_free(w);
    model_weights_free(all);
}
