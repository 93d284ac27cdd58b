/* Config parsing, validation, derived roles, KV geometry and Engram tables. */
#include <criterion/criterion.h>
#include <jansson.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/model/config.h"
#include "common/util/philox.h"

static model_config *load_builtin(const char *name)
{
    model_config *c = calloc(1, sizeof *c);
    di_error e = {0};
    di_status st = model_config_builtin(name, c, &e);
    cr_assert_eq(st, DI_OK, "%s: %s", name, e.msg);
    return c;
}

Test(config, every_shipped_config_parses_and_validates)
{
    const char *const *names = model_config_builtin_names();
    int n = 0;
    for (; names[n]; n++) {
        model_config *c = load_builtin(names[n]);
        cr_assert_str_eq(c->name, names[n]);
        cr_assert_eq(c->hc_mult, 4);
        cr_assert(c->n_engram_layers > 0 && c->n_mtp == 3, "%s keeps Engram and the draft",
                  names[n]);
        cr_assert(c->candidate_source_layer >= 0);
        di_error e = {0};
        cr_assert_eq(model_config_validate(c, &e), DI_OK, "revalidate %s: %s", names[n], e.msg);
        /* the files on disk are the same text as the compiled-in copies */
        char path[1024];
        snprintf(path, sizeof path, "%s/common/model/configs/%s.json",
                 getenv("DI_SOURCE_ROOT"), names[n]);
        model_config *f = calloc(1, sizeof *f);
        cr_assert_eq(model_config_load(path, f, &e), DI_OK, "%s", e.msg);
        cr_assert_eq(f->model_id, c->model_id);
        free(f);
        free(c);
    }
    cr_assert_eq(n, 4, "v41-flash, tiny, small, demo");
    model_config c;
    di_error e = {0};
    cr_assert_eq(model_config_builtin("v42", &c, &e), DI_ENOENT);
    cr_assert(strstr(e.msg, "v42") && strstr(e.msg, "tiny") && strstr(e.msg, "demo"), "%s",
              e.msg);
}

/* demo is tiny's geometry with the DeepSeek vocabulary, so the shipped tokenizer's ids fit. */
Test(config, demo_is_tiny_with_the_full_vocabulary)
{
    model_config *d = load_builtin("demo");
    model_config *t = load_builtin("tiny");
    model_config *v = load_builtin("v41-flash");
    cr_assert_eq(d->vocab_size, v->vocab_size);
    cr_assert_eq(d->dspark_noise_token_id, v->dspark_noise_token_id);
    cr_assert_eq(d->dim, t->dim);
    cr_assert_eq(d->n_layers, t->n_layers);
    cr_assert_neq(d->model_id, t->model_id);
    free(d);
    free(t);
    free(v);
}

Test(config, v41_flash_values_of_model_md_section_0)
{
    model_config *c = load_builtin("v41-flash");
    cr_assert_eq(c->vocab_size, 129280);
    cr_assert_eq(c->dim, 5120);
    cr_assert_eq(c->n_layers, 40);
    cr_assert_eq(c->n_mtp, 3);
    cr_assert_eq(c->n_heads, 64);
    cr_assert_eq(c->head_dim, 512);
    cr_assert_eq(c->rope_head_dim, 64);
    cr_assert_eq(c->q_lora_rank, 1280);
    cr_assert_eq(c->o_groups, 8);
    cr_assert_eq(c->o_lora_rank, 1024);
    cr_assert_eq(c->window, 128);
    cr_assert_eq(c->n_compress_ratios, 43);
    cr_assert_eq(c->index_n_heads, 32);
    cr_assert_eq(c->index_head_dim, 128);
    cr_assert_eq(c->index_topk, 512);
    cr_assert_eq(c->candidate_topk_blocks, 2048);
    cr_assert_eq(c->candidate_block_size, 8);
    cr_assert_float_eq(c->compress_rope_theta, 160000.0, 0);
    cr_assert_float_eq(c->rope_factor, 16.0, 0);
    cr_assert_eq(c->original_seq_len, 65536);
    cr_assert_float_eq(c->norm_eps, 1e-20, 0);
    cr_assert_eq(c->n_routed_experts, 384);
    cr_assert_eq(c->n_activated_experts, 6);
    cr_assert_eq(c->moe_inter_dim, 2304);
    cr_assert_float_eq(c->route_scale, 1.5, 0);
    cr_assert_float_eq(c->gate_temp, 1.0, 0, "gate_temp is absent: default 1.0");
    cr_assert_float_eq(c->swiglu_limit, 10.0, 0);
    cr_assert_eq(c->hc_sinkhorn_iters, 20);
    cr_assert_eq(c->engram_head_dim, 256);
    cr_assert_eq(c->engram_cols, 24);
    cr_assert_eq(c->dspark_noise_token_id, 128799);
    cr_assert_eq(c->dspark_markov_rank, 256);
    cr_assert_eq(c->dspark_n_routed_experts, 128);
    cr_assert_eq(c->dspark_n_activated_experts, 3);
    cr_assert_eq(c->image_token_id, 129264);
    cr_assert_eq(c->pad_token_id, 2);
    cr_assert_eq(c->quant.weight_block_rows, 32);
    cr_assert_eq(c->quant.expert, MODEL_EXPERT_FP4);
    cr_assert_eq(c->yoco_boundary, 20);
    free(c);
}

/* MODEL.md §0.1, one row per layer range, written out from the document. */
typedef struct role_row {
    uint32_t first, last;        /* layer range */
    uint32_t ratio;
    int32_t kv_source;           /* long-range KV read from */
    int32_t index_source;        /* top-k indices from */
    int32_t index_keys;          /* index keys from (-1: "-" or none) */
    bool compressor, indexer, keys, publishes, candidates;
} role_row;

static const role_row k_v41_roles[] = {
    {0, 1, 0, -1, -1, -1, false, false, false, false, false},
    {2, 2, 2, 2, 2, 2, true, true, true, false, false},
    {3, 7, 2, 2, 2, -1, false, false, false, false, false},
    {8, 8, 2, 8, 8, 8, true, true, true, false, false},
    {9, 13, 2, 8, 8, -1, false, false, false, false, false},
    {14, 14, 2, 14, 14, 14, true, true, true, false, false},
    {15, 19, 2, 14, 14, -1, false, false, false, false, false},
    {20, 20, 1, 20, 20, 20, true, true, true, true, false},
    {21, 23, 1, 20, 20, -1, false, false, false, false, false},
    {24, 24, 1, 20, 24, 20, false, true, false, false, true},
    {25, 27, 1, 20, 24, -1, false, false, false, false, false},
    {28, 28, 1, 20, 28, 20, false, true, false, false, true},
    {29, 31, 1, 20, 28, -1, false, false, false, false, false},
    {32, 32, 1, 20, 32, 20, false, true, false, false, true},
    {33, 35, 1, 20, 32, -1, false, false, false, false, false},
    {36, 36, 1, 20, 36, 20, false, true, false, false, true},
    {37, 39, 1, 20, 36, -1, false, false, false, false, false},
};

Test(config, v41_flash_roles_equal_model_md_table)
{
    model_config *c = load_builtin("v41-flash");
    uint32_t covered = 0;
    for (size_t i = 0; i < sizeof k_v41_roles / sizeof k_v41_roles[0]; i++) {
        const role_row *w = &k_v41_roles[i];
        for (uint32_t l = w->first; l <= w->last; l++, covered++) {
            const model_layer_role *r = model_config_role(c, l);
            cr_assert_eq(r->ratio, w->ratio, "layer %u ratio", l);
            cr_assert_eq(r->kv_source, w->kv_source, "layer %u KV source", l);
            cr_assert_eq(r->index_source, w->index_source, "layer %u index source", l);
            cr_assert_eq(r->index_key_source, w->index_keys, "layer %u index keys", l);
            cr_assert_eq(r->owns_compressor, w->compressor, "layer %u compressor", l);
            cr_assert_eq(r->owns_indexer, w->indexer, "layer %u indexer", l);
            cr_assert_eq(r->owns_index_keys, w->keys, "layer %u wk", l);
            cr_assert_eq(r->publishes_candidates, w->publishes, "layer %u publishes", l);
            cr_assert_eq(r->uses_candidates, w->candidates, "layer %u candidates", l);
            cr_assert_eq(r->yarn, w->ratio != 0, "layer %u RoPE table", l);
            cr_assert_eq(r->engram, l == 1 ? 0 : l == 14 ? 1 : -1, "layer %u Engram", l);
            cr_assert_eq(r->draft_tap, l >= 37 ? (int32_t)l - 37 : -1, "layer %u draft tap", l);
        }
    }
    cr_assert_eq(covered, 40);
    for (uint32_t s = 0; s < 3; s++) {
        const model_layer_role *r = model_config_stage_role(c, s);
        cr_assert_eq(r->ratio, 0);
        cr_assert_eq(r->kv_source, -1);
        cr_assert_eq(r->index_source, -1);
        cr_assert(!r->yarn && !r->owns_compressor && !r->owns_indexer);
    }
    free(c);
}

Test(config, kv_geometry_of_v41_flash_matches_the_layout_module)
{
    model_config *c = load_builtin("v41-flash");
    kv_geometry a, b;
    model_config_kv_geometry(c, 5, &a);
    kv_geometry_v41_flash(5, &b);
    cr_assert_eq(a.block_tokens, b.block_tokens);
    cr_assert_eq(a.head_dim, b.head_dim);
    cr_assert_eq(a.index_head_dim, b.index_head_dim);
    cr_assert_eq(a.window, b.window);
    cr_assert_eq(a.ring_positions, b.ring_positions);
    cr_assert_eq(a.n_layers, b.n_layers);
    cr_assert_eq(a.n_draft_stages, b.n_draft_stages);
    cr_assert_eq(a.n_owners, b.n_owners);
    for (uint32_t k = 0; k < a.n_owners; k++) {
        cr_assert_eq(a.owner_layer[k], b.owner_layer[k]);
        cr_assert_eq(a.owner_ratio[k], b.owner_ratio[k]);
    }
    cr_assert_eq(a.yoco_boundary, b.yoco_boundary);
    cr_assert_eq(a.model_id, kv_model_id(c->model_id, KV_YOCO_DEFAULT));
    cr_assert_eq(b.model_id, a.model_id, "both paths stamp blocks with one model id");
    cr_assert_eq(kv_block_bytes(&a), 114048);
    di_error e;
    cr_assert_eq(kv_geometry_validate(&a, &e), DI_OK, "%s", e.msg);
    /* the small configs give valid geometries too; block sizes by hand: tiny owners 2 (r 2)
     * and 4 (r 1), entries 64/2+64/16 + 32/2+32/32 = 53 B: (64 + 128) * 53 + 128 = 10,304;
     * small owners 2, 4 (r 2) and 6 (r 1), entries 128/2+128/16 + 64/2+64/32 = 106 B:
     * (64 + 64 + 128) * 106 + 128 = 27,264 */
    const char *small[] = {"tiny", "small"};
    const size_t block[] = {10304, 27264};
    for (int i = 0; i < 2; i++) {
        model_config *s = load_builtin(small[i]);
        model_config_kv_geometry(s, s->dspark_block_size, &a);
        cr_assert_eq(kv_geometry_validate(&a, &e), DI_OK, "%s: %s", small[i], e.msg);
        cr_assert_eq(a.n_owners, s->n_kv_sources);
        cr_assert_eq(a.ring_positions, 134);
        cr_assert_eq(kv_block_bytes(&a), block[i], "%s block", small[i]);
        free(s);
    }
    free(c);
}

Test(config, small_configs_keep_every_structural_feature)
{
    const char *names[] = {"tiny", "small"};
    for (int i = 0; i < 2; i++) {
        model_config *c = load_builtin(names[i]);
        bool window_only = false, c2_owner = false, c2_reuse = false, c1_owner_pub = false,
             reindex = false, c1_reuse = false;
        for (uint32_t l = 0; l < c->n_layers; l++) {
            const model_layer_role *r = model_config_role(c, l);
            window_only |= r->ratio == 0;
            c2_owner |= r->ratio == 2 && r->owns_compressor;
            c2_reuse |= r->ratio == 2 && !r->owns_compressor && !r->owns_indexer;
            c1_owner_pub |= r->ratio == 1 && r->owns_compressor && r->publishes_candidates &&
                            l == c->yoco_boundary;
            reindex |= r->ratio == 1 && r->owns_indexer && r->uses_candidates;
            c1_reuse |= r->ratio == 1 && !r->owns_compressor && !r->owns_indexer;
        }
        cr_assert(window_only && c2_owner && c2_reuse && c1_owner_pub && reindex && c1_reuse,
                  "%s: %d %d %d %d %d %d", names[i], window_only, c2_owner, c2_reuse,
                  c1_owner_pub, reindex, c1_reuse);
        cr_assert_eq(c->n_shared_experts, 1);
        cr_assert(c->dim >= 64 && c->dim % 32 == 0 && c->head_dim >= 32);
        cr_assert(c->n_routed_experts > c->n_activated_experts);
        free(c);
    }
}

/* ---- validation errors ---------------------------------------------------------------------- */

/* Parses tiny.json after `edit` changed it; returns the status and the message. */
static di_status parse_edited(void (*edit)(json_t *), di_error *e)
{
    json_t *root = json_loads(model_config_builtin_json("tiny"), 0, NULL);
    cr_assert_not_null(root);
    edit(root);
    model_config *c = calloc(1, sizeof *c);
    memset(c, 0x5a, sizeof *c);
    model_config before = *c;
    di_status st = model_config_from_json(root, "edited", c, e);
    if (st != DI_OK)
        cr_assert_eq(memcmp(&before, c, sizeof before), 0, "output untouched on failure");
    free(c);
    json_decref(root);
    return st;
}

static void expect_error(void (*edit)(json_t *), di_status code, const char *needle)
{
    di_error e = {0};
    di_status st = parse_edited(edit, &e);
    cr_assert_eq(st, code, "status %d, message: %s", st, e.msg);
    cr_assert(strstr(e.msg, needle), "message '%s' lacks '%s'", e.msg, needle);
}

static void set_ratios(json_t *root, const int *r, size_t n)
{
    json_t *a = json_array();
    for (size_t i = 0; i < n; i++)
        json_array_append_new(a, json_integer(r[i]));
    json_object_set_new(root, "compress_ratios", a);
}

static void set_list(json_t *root, const char *key, const int *v, size_t n)
{
    json_t *a = json_array();
    for (size_t i = 0; i < n; i++)
        json_array_append_new(a, json_integer(v[i]));
    json_object_set_new(root, key, a);
}

static void drop_hidden(json_t *r) { json_object_del(r, "hidden_size"); }
static void string_head_dim(json_t *r) { json_object_set_new(r, "head_dim", json_string("64")); }
static void real_layers(json_t *r) { json_object_set_new(r, "num_hidden_layers", json_real(8.5)); }
static void zero_layers(json_t *r) { json_object_set_new(r, "num_hidden_layers", json_integer(0)); }
static void ratio0_owner(json_t *r)
{
    const int kv[] = {1, 4};
    set_list(r, "kv_source_layer_ids", kv, 2);
}
static void no_source(json_t *r)
{
    const int kv[] = {4};
    const int ix[] = {4, 6};
    set_list(r, "kv_source_layer_ids", kv, 1);
    set_list(r, "index_source_layer_ids", ix, 2);
}
static void crosses_yoco(json_t *r)
{
    const int kv[] = {2};
    const int ix[] = {2};
    set_list(r, "kv_source_layer_ids", kv, 1);
    set_list(r, "index_source_layer_ids", ix, 1);
    json_object_del(r, "candidate_source_layer_id");
}
static void dim_not_32(json_t *r) { json_object_set_new(r, "hidden_size", json_integer(144)); }
static void lora_not_32(json_t *r) { json_object_set_new(r, "q_lora_rank", json_integer(48)); }
static void short_ratios(json_t *r)
{
    const int ratios[] = {0, 0, 2, 2, 1, 1, 1, 1}; /* the "older fixture" mistake: no drafts */
    set_ratios(r, ratios, 8);
}
static void draft_ratio(json_t *r)
{
    const int ratios[] = {0, 0, 2, 2, 1, 1, 1, 1, 0, 2, 0};
    set_ratios(r, ratios, 11);
}
static void few_candidates(json_t *r)
{
    json_object_set_new(r, "candidate_topk_blocks", json_integer(4)); /* 4 * 8 < 64 */
}
static void hc_three(json_t *r) { json_object_set_new(r, "hc_mult", json_integer(3)); }
static void wrong_rows(json_t *r)
{
    const int rows[] = {4061};
    set_list(r, "engram_num_embeddings", rows, 1);
}
static void softmax_gate(json_t *r)
{
    json_object_set_new(r, "scoring_func", json_string("softmax"));
}
static void fp8_experts(json_t *r)
{
    json_object_set_new(json_object_get(r, "quantization_config"), "expert_dtype",
                        json_string("fp8"));
}
static void no_engram_dim(json_t *r) { json_object_del(r, "engram_head_dim"); }
static void ratio_mismatch(json_t *r)
{
    const int ratios[] = {0, 0, 2, 2, 1, 2, 1, 1, 0, 0, 0};
    set_ratios(r, ratios, 11);
}
static void orphan_reindexer(json_t *r)
{
    const int ix[] = {2, 3, 4, 6};
    set_list(r, "index_source_layer_ids", ix, 4);
}
static void ratios_list_of_strings(json_t *r)
{
    json_array_set_new(json_object_get(r, "compress_ratios"), 3, json_string("2"));
}

Test(config, each_validation_error_names_its_cause)
{
    expect_error(drop_hidden, DI_EINVAL, "missing key 'hidden_size'");
    expect_error(string_head_dim, DI_EINVAL, "key 'head_dim': expected an integer, got string");
    expect_error(real_layers, DI_EINVAL, "key 'num_hidden_layers': expected an integer, got real");
    expect_error(zero_layers, DI_EINVAL, "key 'num_hidden_layers': 0 outside [1, 128]");
    expect_error(ratios_list_of_strings, DI_EINVAL, "key 'compress_ratios'[3]: expected an integer");
    expect_error(ratio0_owner, DI_EINVAL, "layer 1 has compress ratio 0 (window only)");
    expect_error(no_source, DI_EINVAL, "layer 2 has compress ratio 2 but no KV source at or below");
    expect_error(crosses_yoco, DI_EINVAL, "across the YOCO boundary at layer 4");
    expect_error(dim_not_32, DI_EINVAL, "hidden_size 144 must be a multiple of 32");
    expect_error(lora_not_32, DI_EINVAL, "q_lora_rank 48 must be a multiple of 32");
    expect_error(short_ratios, DI_EINVAL, "compress_ratios has 8 entries, expected 11");
    expect_error(draft_ratio, DI_EINVAL, "compress_ratios[9] (draft stage 1) is 2, expected 0");
    expect_error(few_candidates, DI_EINVAL, "= 32 is below index_topk 64");
    expect_error(hc_three, DI_EINVAL, "key 'hc_mult': 3 outside [4, 4]");
    expect_error(wrong_rows, DI_EINVAL, "engram_num_embeddings[0] is 4061, but the prime search");
    expect_error(softmax_gate, DI_EUNSUPPORTED, "'softmax' not supported");
    expect_error(fp8_experts, DI_EUNSUPPORTED, "key 'quantization_config.expert_dtype'");
    expect_error(no_engram_dim, DI_EINVAL,
                 "missing key 'engram_head_dim' (required when engram_layer_ids is not empty)");
    expect_error(ratio_mismatch, DI_EINVAL, "layer 5 has compress ratio 2 but reads KV source layer 4 of ratio 1");
    expect_error(orphan_reindexer, DI_EINVAL, "index source layer 3 is not a KV source");
}

Test(config, bad_text_reports_line_and_column)
{
    model_config c;
    di_error e = {0};
    const char text[] = "{\n  \"hidden_size\": 128,\n  oops\n}";
    cr_assert_eq(model_config_parse(text, sizeof text - 1, "bad", &c, &e), DI_EINVAL);
    cr_assert(strstr(e.msg, "line 3"), "%s", e.msg);
    cr_assert_eq(model_config_parse("[1, 2]", 6, "arr", &c, &e), DI_EINVAL);
    cr_assert(strstr(e.msg, "expected a JSON object"), "%s", e.msg);
    cr_assert_eq(model_config_load("/nonexistent/config.json", &c, &e), DI_ENOENT);
}

/* A config path that is not a regular file (a pipe nobody writes, a device) is refused at
 * once rather than read from: a FIFO would block the caller forever. */
Test(config, special_files_are_refused, .timeout = 10)
{
    model_config c;
    di_error e = {0};
    char dir[] = "/tmp/di_config_fifo_XXXXXX", fifo[64];
    cr_assert_not_null(mkdtemp(dir));
    snprintf(fifo, sizeof fifo, "%s/config.json", dir);
    cr_assert_eq(mkfifo(fifo, 0600), 0);
    cr_assert_eq(model_config_load(fifo, &c, &e), DI_EINVAL);
    cr_assert(strstr(e.msg, "not a regular file"), "%s", e.msg);
    cr_assert_eq(model_config_load(dir, &c, &e), DI_EINVAL, "a directory whose config.json is "
                 "a FIFO");
    cr_assert_eq(model_config_load("/dev/null", &c, &e), DI_EINVAL);
    unlink(fifo);
    rmdir(dir);
}

/* ---- layouts: nested, flat, reference names ------------------------------------------------- */

Test(config, nested_flat_and_reference_names_give_the_same_config)
{
    const char *names[] = {"v41-flash", "tiny", "small"};
    for (int i = 0; i < 3; i++) {
        model_config *a = load_builtin(names[i]);
        /* written in the released nested layout and read back */
        json_t *nested = model_config_to_json(a);
        cr_assert_not_null(nested);
        cr_assert(json_is_object(json_object_get(nested, "text_config")));
        cr_assert(json_is_object(json_object_get(nested, "quantization_config")));
        cr_assert(json_object_get(nested, "bos_token_id"));
        model_config *b = calloc(1, sizeof *b);
        di_error e = {0};
        cr_assert_eq(model_config_from_json(nested, names[i], b, &e), DI_OK, "%s", e.msg);
        cr_assert_eq(memcmp(a, b, sizeof *a), 0, "%s round trip", names[i]);
        /* flattened: text_config merged into the top level */
        json_t *flat = json_deep_copy(nested);
        json_object_update(flat, json_object_get(nested, "text_config"));
        json_object_del(flat, "text_config");
        memset(b, 0, sizeof *b);
        cr_assert_eq(model_config_from_json(flat, names[i], b, &e), DI_OK, "%s", e.msg);
        cr_assert_eq(memcmp(a, b, sizeof *a), 0, "%s flat", names[i]);
        json_decref(flat);
        json_decref(nested);
        free(a);
        free(b);
    }
    /* the reference's ModelArgs names */
    json_t *root = json_loads(model_config_builtin_json("tiny"), 0, NULL);
    json_t *v = json_incref(json_object_get(root, "hidden_size"));
    json_object_del(root, "hidden_size");
    json_object_set_new(root, "dim", v);
    v = json_incref(json_object_get(root, "num_hidden_layers"));
    json_object_del(root, "num_hidden_layers");
    json_object_set_new(root, "n_layers", v);
    model_config *c = calloc(1, sizeof *c);
    di_error e = {0};
    cr_assert_eq(model_config_from_json(root, "ref", c, &e), DI_OK, "%s", e.msg);
    cr_assert_eq(c->dim, 128);
    cr_assert_eq(c->n_layers, 8);
    json_decref(root);
    free(c);
}

Test(config, vision_keys_are_ignored)
{
    json_t *root = json_loads(model_config_builtin_json("v41-flash"), 0, NULL);
    json_t *vision = json_object_get(root, "vision_config");
    cr_assert_not_null(vision, "the shipped file carries a vision_config");
    json_object_set_new(vision, "hidden_size", json_string("not a number"));
    json_object_set_new(vision, "num_hidden_layers", json_integer(7));
    model_config *c = calloc(1, sizeof *c);
    di_error e = {0};
    cr_assert_eq(model_config_from_json(root, "v", c, &e), DI_OK, "%s", e.msg);
    cr_assert_eq(c->n_layers, 40);
    cr_assert_eq(c->dim, 5120);
    json_decref(root);
    free(c);
}

Test(config, model_id_is_a_fingerprint_of_the_math)
{
    model_config *a = load_builtin("tiny");
    model_config *b = load_builtin("tiny");
    cr_assert_eq(a->model_id, b->model_id, "same config, same id");
    cr_assert_neq(a->model_id, 0);
    model_config *s = load_builtin("small");
    model_config *v = load_builtin("v41-flash");
    cr_assert_neq(a->model_id, s->model_id);
    cr_assert_neq(a->model_id, v->model_id);
    /* a math key changes it; a token id or the name does not */
    b->index_topk = 32;
    cr_assert_neq(model_config_fingerprint(b), a->model_id);
    *b = *a;
    b->compress_ratios[3] = 1;
    cr_assert_neq(model_config_fingerprint(b), a->model_id);
    *b = *a;
    b->bos_token_id = 7;
    snprintf(b->name, sizeof b->name, "other");
    memset(b->roles, 0xee, sizeof b->roles); /* derived fields do not enter it */
    cr_assert_eq(model_config_fingerprint(b), a->model_id);
    free(a);
    free(b);
    free(s);
    free(v);
}

/* ---- Engram tables -------------------------------------------------------------------------- */

/* MODEL.md §2.9, the published primes of the released model. */
static const uint64_t k_v41_primes[2][24] = {
    {16000057, 16000079, 16000081, 16000097, 16000121, 16000129, 16000133, 16000183,
     16000189, 16000207, 16000211, 16000253, 16000277, 16000289, 16000307, 16000321,
     16000339, 16000381, 16000393, 16000399, 16000403, 16000409, 16000447, 16000463},
    {16000477, 16000487, 16000499, 16000507, 16000511, 16000573, 16000609, 16000627,
     16000667, 16000669, 16000693, 16000697, 16000711, 16000729, 16000759, 16000769,
     16000781, 16000799, 16000813, 16000819, 16000841, 16000877, 16000879, 16000889},
};

Test(config, v41_prime_search_reproduces_the_published_tables)
{
    model_config *c = load_builtin("v41-flash");
    uint64_t sums[2] = {0, 0};
    for (int k = 0; k < 2; k++) {
        for (int j = 0; j < 24; j++) {
            cr_assert_eq(c->engram_primes[k][j], k_v41_primes[k][j], "layer slot %d col %d", k,
                         j);
            cr_assert_eq(c->engram_offsets[k][j], sums[k]);
            sums[k] += k_v41_primes[k][j];
        }
    }
    cr_assert_eq(sums[0], 384006168ull);
    cr_assert_eq(sums[1], 384016682ull);
    free(c);
}

Test(config, v41_hash_multipliers_match_the_published_values)
{
    static const uint64_t want[2][4] = {
        {76632096046245ull, 4839876093313ull, 35959672319349ull, 73987337458391ull},
        {67716810739261ull, 51510806800915ull, 30921347202721ull, 82619226485591ull},
    };
    model_config *c = load_builtin("v41-flash");
    for (int k = 0; k < 2; k++)
        for (int s = 0; s < 4; s++)
            cr_assert_eq(c->engram_multipliers[k][s], want[k][s], "layer slot %d s %d: %lu", k,
                         s, (unsigned long)c->engram_multipliers[k][s]);
    /* bound of MODEL.md §2.9: products of a compressed id and a multiplier stay below 2^63 */
    for (int k = 0; k < 2; k++)
        for (int s = 0; s < 4; s++)
            cr_assert(c->engram_multipliers[k][s] < (uint64_t)INT64_MAX / 99092);
    free(c);
}

Test(config, small_engram_tables_follow_the_search_rule)
{
    /* tiny: engram_vocab_size 1000, 2 heads, orders 2 and 3: primes above 999, each order
     * restarting at 999 and skipping used ones (checked by hand) */
    model_config *c = load_builtin("tiny");
    const uint64_t want[4] = {1009, 1013, 1019, 1021};
    for (int j = 0; j < 4; j++)
        cr_assert_eq(c->engram_primes[0][j], want[j]);
    cr_assert_eq(c->engram_cols, 4);
    cr_assert_eq(c->engram_num_embeddings[0], 4062);
    for (int s = 0; s < 3; s++)
        cr_assert(c->engram_multipliers[0][s] & 1, "multipliers are odd");
    free(c);
}

Test(config, primality_and_search_bounds)
{
    cr_assert(!model_is_prime_u64(0) && !model_is_prime_u64(1));
    cr_assert(model_is_prime_u64(2) && model_is_prime_u64(16000057));
    cr_assert(!model_is_prime_u64(16000057ull * 16000079ull));
    cr_assert(model_is_prime_u64(18446744073709551557ull), "largest 64-bit prime");
    cr_assert(!model_is_prime_u64(3215031751ull), "strong pseudoprime to 2, 3, 5, 7");
    uint64_t p[MODEL_MAX_ENGRAM_LAYERS][MODEL_MAX_ENGRAM_COLS];
    di_error e;
    cr_assert_eq(model_engram_primes(5, 3, 8, 1000, p, &e), DI_EINVAL);
    cr_assert_eq(model_engram_primes(1, 3, 8, 1, p, &e), DI_EINVAL);
}

/* ---- hostile input -------------------------------------------------------------------------- */

Test(config, random_mutations_never_crash)
{
    const char *orig = model_config_builtin_json("tiny");
    size_t n = strlen(orig);
    char *buf = malloc(n + 1);
    di_rng rng;
    di_rng_init(&rng, 99);
    model_config *c = malloc(sizeof *c);
    int ok = 0, failed = 0;
    for (int iter = 0; iter < 600; iter++) {
        memcpy(buf, orig, n + 1);
        size_t len = n;
        for (int k = 0, edits = 1 + (int)di_rng_below(&rng, 3); k < edits; k++) {
            size_t at = (size_t)di_rng_below(&rng, len);
            switch (di_rng_below(&rng, 3)) {
            case 0: buf[at] = "0123456789-.e"[di_rng_below(&rng, 13)]; break; /* numbers */
            case 1: buf[at] = (char)(32 + di_rng_below(&rng, 95)); break;
            default: len = at; break;
            }
        }
        di_error e = {0};
        di_status st = model_config_parse(buf, len, "mutant", c, &e);
        cr_assert(st == DI_OK || st == DI_EINVAL || st == DI_EUNSUPPORTED, "%d: %s", st, e.msg);
        if (st == DI_OK) {
            ok++;
            kv_geometry g;
            model_config_kv_geometry(c, 5, &g);
            cr_assert_eq(kv_geometry_validate(&g, &e), DI_OK, "%s", e.msg);
        } else {
            failed++;
            cr_assert(strlen(e.msg) > 0);
        }
    }
    cr_assert(failed > 100 && ok > 10, "%d accepted, %d refused", ok, failed);
    free(buf);
    free(c);
}

Test(config, extreme_values_are_refused_or_handled)
{
    static const struct {
        const char *key;
        json_int_t value;
    } cases[] = {
        {"hidden_size", 1 << 20}, {"hidden_size", (json_int_t)1 << 40}, {"head_dim", 65536},
        {"num_attention_heads", 4096}, {"index_topk", 1 << 24}, {"vocab_size", 0},
        {"engram_vocab_size", (json_int_t)1 << 40}, {"engram_head_dim", 8192},
        {"engram_compressed_vocab_size", 1 << 29}, {"sliding_window", 1 << 20},
        {"num_nextn_predict_layers", 9}, {"candidate_block_size", -5},
    };
    model_config *c = malloc(sizeof *c);
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        json_t *root = json_loads(model_config_builtin_json("tiny"), 0, NULL);
        json_object_set_new(root, cases[i].key, json_integer(cases[i].value));
        di_error e = {0};
        di_status st = model_config_from_json(root, "x", c, &e);
        cr_assert(st == DI_OK || st == DI_EINVAL, "%s = %lld: %d %s", cases[i].key,
                  (long long)cases[i].value, st, e.msg);
        if (st != DI_OK)
            cr_assert(strstr(e.msg, cases[i].key) || strstr(e.msg, "engram") ||
                          strstr(e.msg, "compress_ratios"),
                      "%s: message names the cause: %s", cases[i].key, e.msg);
        json_decref(root);
    }
    free(c);
}
