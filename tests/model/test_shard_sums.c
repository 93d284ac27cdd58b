/* The checksum manifest and the weights fingerprint: SHA-256 against the FIPS 180-4 examples,
 * the loader refusing a shard with 4 KiB flipped, naming it, a flipped weight byte changing
 * model_id, and YOCO modes changing the KV id. */
#include <criterion/criterion.h>
#include <fcntl.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/model/mkmodel.h"
#include "common/model/shard_sums.h"
#include "common/model/weights.h"
#include "tests/model/tmpdir.h"

static char g_dir[256];

static void make_dir(void)
{
    tmpdir_make(g_dir, sizeof g_dir, "shard_sums");
}

static void remove_dir(void)
{
    tmpdir_remove(g_dir);
}

TestSuite(shard_sums, .init = make_dir, .fini = remove_dir, .timeout = 120);

static void hex_of(const void *data, size_t len, char out[65])
{
    uint8_t d[32];
    cr_assert(di_sha256_of(data, len, d));
    di_sha256_hex(d, out);
}

Test(shard_sums, sha256_matches_the_fips_examples_on_both_paths)
{
    static const struct {
        const char *in, *hex;
    } v[] = {
        {"", "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"},
        {"abc", "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"},
        {"abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq",
         "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1"},
    };
    for (size_t i = 0; i < sizeof v / sizeof v[0]; i++) {
        char hex[65];
        uint8_t d[32];
        hex_of(v[i].in, strlen(v[i].in), hex);
        cr_assert_str_eq(hex, v[i].hex, "input '%s'", v[i].in);
        di_sha256_portable(v[i].in, strlen(v[i].in), d);
        di_sha256_hex(d, hex);
        cr_assert_str_eq(hex, v[i].hex, "portable, input '%s'", v[i].in);
    }
    /* a million 'a': the third FIPS example, fed in uneven pieces */
    char *a = malloc(1000000);
    memset(a, 'a', 1000000);
    di_sha256 s;
    cr_assert(di_sha256_init(&s));
    for (size_t off = 0, step = 1; off < 1000000; off += step, step = step * 3 % 997 + 1)
        di_sha256_update(&s, a + off, off + step > 1000000 ? 1000000 - off : step);
    uint8_t d[32];
    char hex[65];
    di_sha256_final(&s, d);
    di_sha256_hex(d, hex);
    cr_assert_str_eq(hex, "cdc76e5c9914fb9281a1c7e284d73e67f1809a48a497200e046d39ccc7112cd0");
    free(a);
    /* every length across the padding boundaries: the two paths agree */
    uint8_t buf[300];
    for (size_t i = 0; i < sizeof buf; i++)
        buf[i] = (uint8_t)(i * 131 + 7);
    for (size_t n = 0; n <= sizeof buf; n++) {
        uint8_t x[32], y[32];
        cr_assert(di_sha256_of(buf, n, x));
        di_sha256_portable(buf, n, y);
        cr_assert_arr_eq(x, y, 32, "length %zu", n);
    }
    cr_assert(!di_sha256_parse_hex("xyz", d));
    cr_assert(di_sha256_parse_hex("E3B0C44298FC1C149AFBF4C8996FB92427AE41E4649B934CA495991B7852B855",
                                  d));
    cr_assert_eq(d[0], 0xe3);
}

static void path_of(char *out, size_t cap, const char *a, const char *b)
{
    snprintf(out, cap, "%s/%s%s%s", g_dir, a, b ? "/" : "", b ? b : "");
}

/* A tiny checkpoint in g_dir/name with two shards (so one can be damaged alone). */
static void make_tiny(const char *name, mkmodel_plan *plan)
{
    char dir[512];
    path_of(dir, sizeof dir, name, NULL);
    model_config c;
    di_error e;
    cr_assert_eq(model_config_builtin("tiny", &c, &e), DI_OK, "%s", e.msg);
    mkmodel_options o;
    mkmodel_options_default(&o);
    o.shard_bytes = 4u << 20;
    cr_assert_eq(mkmodel_write(&c, dir, &o, plan, &e), DI_OK, "%s", e.msg);
    cr_assert_gt(plan->n_shards, 1);
}

static di_status load(const char *name, uint32_t flags, model_weights **w, di_error *e)
{
    char dir[512];
    path_of(dir, sizeof dir, name, NULL);
    model_load_options o = {.flags = flags, .hash_threads = 2};
    return model_weights_load(dir, &o, w, e);
}

/* XORs `len` bytes at `off` of file name/file with 0xff. */
static void flip(const char *name, const char *file, long off, size_t len)
{
    char p[512];
    path_of(p, sizeof p, name, file);
    FILE *f = fopen(p, "r+b");
    cr_assert(f, "%s", p);
    uint8_t *b = malloc(len);
    cr_assert_eq(fseek(f, off, SEEK_SET), 0);
    cr_assert_eq(fread(b, 1, len, f), len);
    for (size_t i = 0; i < len; i++)
        b[i] ^= 0xff;
    cr_assert_eq(fseek(f, off, SEEK_SET), 0);
    cr_assert_eq(fwrite(b, 1, len, f), len);
    cr_assert_eq(fclose(f), 0);
    free(b);
}

static long file_size(const char *name, const char *file)
{
    char p[512];
    path_of(p, sizeof p, name, file);
    FILE *f = fopen(p, "rb");
    cr_assert(f, "%s", p);
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fclose(f);
    return n;
}

Test(shard_sums, a_written_checkpoint_verifies_and_its_id_covers_the_weights)
{
    mkmodel_plan plan;
    make_tiny("a", &plan);
    char p[512];
    path_of(p, sizeof p, "a", SHARD_SUMS_FILE);
    cr_assert_eq(access(p, F_OK), 0, "di-mkmodel writes the manifest");
    model_weights *w;
    di_error e;
    cr_assert_eq(load("a", 0, &w, &e), DI_OK, "%s", e.msg);
    cr_assert(w->sums.had_manifest && w->sums.verified);
    cr_assert_eq(w->sums.n_files, plan.n_shards + 1, "the shards and the token map");
    cr_assert_gt(w->sums.bytes_hashed, plan.bytes);
    cr_assert_eq(w->config.model_id, plan.config.model_id, "the writer and the loader agree");
    cr_assert_neq(w->config.model_id, model_config_fingerprint(&w->config),
                  "the id is not the config's alone");
    uint8_t fp[32];
    cr_assert_eq(shard_sums_read_fingerprint(g_dir, fp, &e), DI_ENOENT, "no manifest there");
    path_of(p, sizeof p, "a", NULL);
    cr_assert_eq(shard_sums_read_fingerprint(p, fp, &e), DI_OK, "%s", e.msg);
    cr_assert_arr_eq(fp, w->sums.fingerprint, 32, "the manifest's fingerprint is the loader's");
    model_weights_free(w);

    /* trusted: no byte hashed, same fingerprint */
    cr_assert_eq(load("a", MODEL_LOAD_TRUST_SUMS, &w, &e), DI_OK, "%s", e.msg);
    cr_assert(w->sums.had_manifest && !w->sums.verified);
    cr_assert_eq(w->sums.bytes_hashed, 0);
    cr_assert_eq(w->config.model_id, plan.config.model_id);
    model_weights_free(w);

    /* without the manifest: hashed, same fingerprint */
    path_of(p, sizeof p, "a", SHARD_SUMS_FILE);
    cr_assert_eq(unlink(p), 0);
    cr_assert_eq(load("a", 0, &w, &e), DI_OK, "%s", e.msg);
    cr_assert(!w->sums.had_manifest && !w->sums.verified);
    cr_assert_eq(w->config.model_id, plan.config.model_id, "one id with or without a manifest");
    model_weights_free(w);
}

Test(shard_sums, a_4k_flip_inside_a_shard_is_refused_and_named)
{
    mkmodel_plan plan;
    make_tiny("b", &plan);
    const char *shard = "model-00002-of-00002.safetensors";
    if (plan.n_shards != 2) {
        static char name[64];
        snprintf(name, sizeof name, "model-00002-of-%05u.safetensors", plan.n_shards);
        shard = name;
    }
    long size = file_size("b", shard);
    flip("b", shard, size / 2 & ~4095L, 4096);
    model_weights *w = NULL;
    di_error e = {0};
    cr_assert_eq(load("b", 0, &w, &e), DI_ECORRUPT, "a damaged shard must not load");
    cr_assert_null(w);
    cr_assert(strstr(e.msg, shard), "the error names the shard: %s", e.msg);
    cr_assert(strstr(e.msg, "checksum manifest"), "%s", e.msg);
    cr_assert(strstr(e.msg, "bytes 0.."), "and the byte range: %s", e.msg);

    /* trusted, it loads with the manifest's id: that is what skipping costs */
    cr_assert_eq(load("b", MODEL_LOAD_TRUST_SUMS, &w, &e), DI_OK, "%s", e.msg);
    cr_assert_eq(w->config.model_id, plan.config.model_id);
    model_weights_free(w);

    /* a size change (bytes appended past the last tensor) is named before any hashing */
    char p[512];
    path_of(p, sizeof p, "b", shard);
    cr_assert_eq(truncate(p, size + 1), 0);
    cr_assert_eq(load("b", 0, &w, &e), DI_ECORRUPT);
    cr_assert(strstr(e.msg, shard) && strstr(e.msg, "bytes, the checksum manifest says"), "%s",
              e.msg);
}

Test(shard_sums, one_flipped_weight_byte_changes_the_model_id_and_every_kv_key)
{
    mkmodel_plan plan;
    make_tiny("c", &plan);
    model_weights *w;
    di_error e;
    cr_assert_eq(load("c", 0, &w, &e), DI_OK, "%s", e.msg);
    uint64_t before = w->config.model_id;
    /* one byte inside the embedding table: the first tensor's data, well past the header */
    const st_tensor *t = st_find(w->shards[w->index->shard_of[st_index_entry(w->index,
                                                                             "embed.weight")]],
                                 "embed.weight");
    cr_assert(t);
    char shard[256];
    snprintf(shard, sizeof shard, "%s", w->index->shards[w->index->shard_of[st_index_entry(
                                            w->index, "embed.weight")]]);
    long off = (long)(t->offset + t->bytes / 2);
    model_weights_free(w);
    flip("c", shard, off, 1);
    char dir[512];
    path_of(dir, sizeof dir, "c", NULL);
    uint64_t rewritten;
    cr_assert_eq(mkmodel_write_sums(dir, 1, &rewritten, &e), DI_OK, "%s", e.msg);
    cr_assert_eq(load("c", 0, &w, &e), DI_OK, "the rewritten manifest verifies: %s", e.msg);
    cr_assert_neq(w->config.model_id, before, "a fine-tune of one byte is another model");
    cr_assert_eq(w->config.model_id, rewritten);
    kv_geometry ga, gb;
    model_config_kv_geometry(&plan.config, 5, &ga);
    model_config_kv_geometry(&w->config, 5, &gb);
    cr_assert_neq(ga.model_id, gb.model_id, "so is its KV id");
    model_weights_free(w);
    /* flipped back, the id returns */
    flip("c", shard, off, 1);
    cr_assert_eq(mkmodel_write_sums(dir, 3, &rewritten, &e), DI_OK, "%s", e.msg);
    cr_assert_eq(rewritten, before, "the id is a function of the bytes, whatever the threads");
}

Test(shard_sums, the_yoco_mode_and_the_kv_format_change_the_kv_id)
{
    model_config c;
    di_error e;
    cr_assert_eq(model_config_builtin("v41-flash", &c, &e), DI_OK, "%s", e.msg);
    kv_geometry off, compact, mask, dflt;
    model_config_kv_geometry_yoco(&c, 5, KV_YOCO_OFF, &off);
    model_config_kv_geometry_yoco(&c, 5, KV_YOCO_COMPACT, &compact);
    model_config_kv_geometry_yoco(&c, 5, KV_YOCO_MASK, &mask);
    model_config_kv_geometry(&c, 5, &dflt);
    cr_assert_neq(off.model_id, compact.model_id);
    cr_assert_neq(off.model_id, mask.model_id);
    cr_assert_neq(compact.model_id, mask.model_id);
    cr_assert_eq(dflt.model_id, compact.model_id, "the default is compact");
    cr_assert_eq(KV_YOCO_DEFAULT, KV_YOCO_COMPACT);
    cr_assert_eq(compact.model_id, kv_model_id(c.model_id, KV_YOCO_COMPACT));
    cr_assert_neq(compact.model_id, c.model_id, "the KV id is not the bare model id");
    /* a changed model id changes every mode's KV id */
    cr_assert_neq(kv_model_id(c.model_id ^ 1, KV_YOCO_COMPACT), compact.model_id);
    cr_assert_str_eq(kv_yoco_name(KV_YOCO_MASK), "mask");
    cr_assert_str_eq(kv_yoco_name(7), "?");
}

/* A checkpoint of one 64 MiB + 5 byte file (under an index that names it): two chunks, the
 * first one's digest is the plain SHA-256 of its bytes, a flip in the second is named by its
 * range, and bad manifests are refused with what is wrong. */
Test(shard_sums, chunks_ranges_and_malformed_manifests)
{
    char dir[512], p[600];
    path_of(dir, sizeof dir, "d", NULL);
    cr_assert_eq(mkdir(dir, 0755), 0);
    snprintf(p, sizeof p, "%s/model.safetensors.index.json", dir);
    FILE *f = fopen(p, "w");
    fputs("{\"weight_map\": {\"x\": \"big.safetensors\"}}\n", f);
    fclose(f);
    size_t n = (size_t)SHARD_SUMS_CHUNK_BYTES + 5;
    uint8_t *b = malloc(n);
    for (size_t i = 0; i < n; i++)
        b[i] = (uint8_t)((i * 2654435761u) >> 13);
    snprintf(p, sizeof p, "%s/big.safetensors", dir);
    f = fopen(p, "wb");
    cr_assert_eq(fwrite(b, 1, n, f), n);
    fclose(f);
    st_index *idx;
    di_error e;
    cr_assert_eq(st_index_load(dir, &idx, &e), DI_OK, "%s", e.msg);
    uint8_t fp1[32], fp4[32];
    cr_assert_eq(shard_sums_write(dir, idx, 1, fp1, &e), DI_OK, "%s", e.msg);
    cr_assert_eq(shard_sums_write(dir, idx, 4, fp4, &e), DI_OK, "%s", e.msg);
    cr_assert_arr_eq(fp1, fp4, 32);
    snprintf(p, sizeof p, "%s/" SHARD_SUMS_FILE, dir);
    json_error_t je;
    json_t *m = json_load_file(p, 0, &je);
    cr_assert(m);
    json_t *sums = json_object_get(json_array_get(json_object_get(m, "files"), 0), "sha256");
    cr_assert_eq(json_array_size(sums), 2);
    char hex[65];
    hex_of(b, (size_t)SHARD_SUMS_CHUNK_BYTES, hex);
    cr_assert_str_eq(json_string_value(json_array_get(sums, 0)), hex);
    hex_of(b + SHARD_SUMS_CHUNK_BYTES, 5, hex);
    cr_assert_str_eq(json_string_value(json_array_get(sums, 1)), hex);
    shard_sums_result r;
    cr_assert_eq(shard_sums_fingerprint(dir, idx, 2, false, &r, &e), DI_OK, "%s", e.msg);
    cr_assert(r.verified);
    cr_assert_arr_eq(r.fingerprint, fp1, 32);

    flip("d", "big.safetensors", (long)SHARD_SUMS_CHUNK_BYTES + 2, 1);
    cr_assert_eq(shard_sums_fingerprint(dir, idx, 2, false, &r, &e), DI_ECORRUPT);
    cr_assert(strstr(e.msg, "bytes 67108864..67108869"), "%s", e.msg);
    flip("d", "big.safetensors", (long)SHARD_SUMS_CHUNK_BYTES + 2, 1);

    /* malformed manifests: each edit is named */
    static const struct {
        const char *key;
        json_t *(*value)(void);
        const char *want;
    } edits[] = {
        {"format", NULL, "'format'"},
        {"chunk_bytes", NULL, "'chunk_bytes'"},
        {"fingerprint", NULL, "'fingerprint'"},
    };
    for (size_t i = 0; i < sizeof edits / sizeof edits[0]; i++) {
        json_t *c = json_deep_copy(m);
        json_object_set_new(c, edits[i].key, json_string("0000"));
        cr_assert_eq(json_dump_file(c, p, 0), 0);
        json_decref(c);
        cr_assert_eq(shard_sums_fingerprint(dir, idx, 2, false, &r, &e), DI_ECORRUPT);
        cr_assert(strstr(e.msg, edits[i].want), "%s: %s", edits[i].key, e.msg);
        cr_assert_eq(shard_sums_fingerprint(dir, idx, 2, true, &r, &e), DI_ECORRUPT,
                     "trusting a malformed manifest is refused too");
    }
    /* a digest edited by hand no longer matches the recorded fingerprint */
    json_t *c = json_deep_copy(m);
    json_t *s = json_object_get(json_array_get(json_object_get(c, "files"), 0), "sha256");
    json_array_set_new(s, 1, json_string("00000000000000000000000000000000"
                                         "00000000000000000000000000000000"));
    cr_assert_eq(json_dump_file(c, p, 0), 0);
    json_decref(c);
    cr_assert_eq(shard_sums_fingerprint(dir, idx, 2, true, &r, &e), DI_ECORRUPT);
    cr_assert(strstr(e.msg, "does not match the listed digests"), "%s", e.msg);
    /* a listed file the checkpoint lacks: the manifest of a two-shard index, read against the
     * one-shard index */
    char p2[600];
    snprintf(p2, sizeof p2, "%s/model.safetensors.index.json", dir);
    f = fopen(p2, "w");
    fputs("{\"weight_map\": {\"x\": \"big.safetensors\", \"y\": \"gone.safetensors\"}}\n", f);
    fclose(f);
    snprintf(p2, sizeof p2, "%s/gone.safetensors", dir);
    f = fopen(p2, "w");
    fputs("gone", f);
    fclose(f);
    st_index *two;
    cr_assert_eq(st_index_load(dir, &two, &e), DI_OK, "%s", e.msg);
    cr_assert_eq(shard_sums_write(dir, two, 2, NULL, &e), DI_OK, "%s", e.msg);
    st_index_free(two);
    cr_assert_eq(unlink(p2), 0);
    cr_assert_eq(shard_sums_fingerprint(dir, idx, 2, false, &r, &e), DI_ECORRUPT);
    cr_assert(strstr(e.msg, "lists gone.safetensors, which the checkpoint does not have"), "%s",
              e.msg);
    /* and a covered file the manifest does not list */
    cr_assert_eq(shard_sums_write(dir, idx, 2, NULL, &e), DI_OK, "%s", e.msg);
    cr_assert_eq(symlink("big.safetensors", p2), 0);
    cr_assert_eq(st_index_load(dir, &two, &e), DI_OK, "%s", e.msg);
    cr_assert_eq(shard_sums_fingerprint(dir, two, 2, false, &r, &e), DI_ECORRUPT);
    cr_assert(strstr(e.msg, "gone.safetensors is not in the checksum manifest"), "%s", e.msg);
    st_index_free(two);
    json_decref(m);
    st_index_free(idx);
    free(b);
}
