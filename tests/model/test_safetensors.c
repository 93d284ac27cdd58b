/* Safetensors reading, writing and the shard index, including malformed files. */
#include <criterion/criterion.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/model/safetensors.h"
#include "tests/model/tmpdir.h"
#include "common/util/philox.h"

static char g_dir[256];

static void make_dir(void)
{
    tmpdir_make(g_dir, sizeof g_dir, "st");
}

static void remove_dir(void)
{
    tmpdir_remove(g_dir);
}

TestSuite(safetensors, .init = make_dir, .fini = remove_dir);

static void path_in_dir(char *out, size_t cap, const char *name)
{
    snprintf(out, cap, "%s/%s", g_dir, name);
}

/* Writes an 8-byte length, the header text and `data_len` bytes of data. */
static void write_raw(const char *path, const char *header, uint64_t claimed_len,
                      const void *data, size_t data_len)
{
    FILE *f = fopen(path, "wb");
    cr_assert_not_null(f);
    uint8_t le[8];
    for (int i = 0; i < 8; i++)
        le[i] = (uint8_t)(claimed_len >> (8 * i));
    fwrite(le, 1, 8, f);
    fwrite(header, 1, strlen(header), f);
    if (data_len)
        fwrite(data, 1, data_len, f);
    fclose(f);
}

static void write_header_file(const char *name, const char *header, size_t data_len)
{
    char path[512];
    path_in_dir(path, sizeof path, name);
    uint8_t *data = calloc(1, data_len + 1);
    write_raw(path, header, strlen(header), data, data_len);
    free(data);
}

static di_status open_named(const char *name, st_file **f, di_error *e)
{
    char path[512];
    path_in_dir(path, sizeof path, name);
    return st_open(path, f, e);
}

static void expect_corrupt(const char *name, const char *needle)
{
    st_file *f = NULL;
    di_error e = {0};
    di_status st = open_named(name, &f, &e);
    cr_assert_eq(st, DI_ECORRUPT, "%s: status %d (%s)", name, st, e.msg);
    cr_assert_null(f);
    cr_assert(strstr(e.msg, needle), "%s: message '%s' lacks '%s'", name, e.msg, needle);
    cr_assert(strstr(e.msg, name), "message names the file: %s", e.msg);
}

Test(safetensors, dtype_names_round_trip)
{
    for (int t = 1; t < ST_DTYPE_COUNT; t++) {
        cr_assert_eq(st_dtype_parse(st_dtype_name((st_dtype)t)), t);
        cr_assert(st_dtype_bits((st_dtype)t) > 0);
    }
    cr_assert_eq(st_dtype_parse("F12"), ST_DTYPE_INVALID);
    cr_assert_eq(st_dtype_parse("f32"), ST_DTYPE_INVALID, "names are case sensitive");
    cr_assert_eq(st_dtype_bytes(ST_BF16, 3), 6);
    cr_assert_eq(st_dtype_bytes(ST_F4, 6), 3);
    cr_assert_eq(st_dtype_bytes(ST_F8_E8M0, 5), 5);
    cr_assert_eq(st_dtype_bytes(ST_F64, 2), 16);
}

/* fill callback: byte i of the tensor is (i * 7 + salt) & 0xff */
static di_status fill_pattern(void *ud, uint64_t off, void *buf, size_t len, di_error *err)
{
    uint8_t salt = (uint8_t)(uintptr_t)ud;
    for (size_t i = 0; i < len; i++)
        ((uint8_t *)buf)[i] = (uint8_t)((off + i) * 7 + salt);
    return DI_OK;
}

Test(safetensors, round_trip_of_every_dtype)
{
    st_write_tensor w[ST_DTYPE_COUNT + 2];
    uint8_t *bufs[ST_DTYPE_COUNT + 2] = {0};
    size_t n = 0;
    di_rng rng;
    di_rng_init(&rng, 42);
    for (int t = 1; t < ST_DTYPE_COUNT; t++, n++) {
        char *name = malloc(32);
        snprintf(name, 32, "t.%s", st_dtype_name((st_dtype)t));
        uint64_t rows = 3 + (uint64_t)t % 4, cols = 6;
        uint64_t bytes = st_dtype_bytes((st_dtype)t, rows * cols);
        bufs[n] = malloc(bytes);
        for (uint64_t i = 0; i < bytes; i++)
            bufs[n][i] = (uint8_t)di_rng_u32(&rng);
        w[n] = (st_write_tensor){.name = name, .dtype = (st_dtype)t, .ndim = 2,
                                 .shape = {rows, cols}, .data = bufs[n]};
    }
    w[n++] = (st_write_tensor){.name = "scalar", .dtype = ST_F32, .ndim = 0, .data = "\1\2\3\4"};
    w[n++] = (st_write_tensor){.name = "empty", .dtype = ST_I32, .ndim = 2, .shape = {0, 5}};
    const char *mk[] = {"format", "note"};
    const char *mv[] = {"pt", "written by the test"};
    char path[512];
    path_in_dir(path, sizeof path, "all.safetensors");
    di_error e = {0};
    cr_assert_eq(st_write(path, w, n, mk, mv, 2, NULL, NULL, &e), DI_OK, "%s", e.msg);
    struct stat sb;
    cr_assert_eq(stat(path, &sb), 0);
    cr_assert_eq((uint64_t)sb.st_size, st_file_bytes_for(w, n, mk, mv, 2));

    st_file *f = NULL;
    cr_assert_eq(st_open(path, &f, &e), DI_OK, "%s", e.msg);
    cr_assert_eq(f->n_tensors, n);
    cr_assert_eq(f->header_bytes % 8, 0, "header padded to 8 bytes");
    cr_assert_str_eq(st_metadata(f, "note"), "written by the test");
    cr_assert_null(st_metadata(f, "absent"));
    for (size_t i = 0; i < n; i++) {
        const st_tensor *t = st_find(f, w[i].name);
        cr_assert_not_null(t, "%s", w[i].name);
        cr_assert_eq(t->dtype, w[i].dtype);
        cr_assert_eq(t->ndim, w[i].ndim);
        for (uint32_t d = 0; d < t->ndim; d++)
            cr_assert_eq(t->shape[d], w[i].shape[d]);
        uint64_t bytes = st_dtype_bytes(w[i].dtype, t->n_elements);
        cr_assert_eq(t->bytes, bytes);
        if (bytes) {
            cr_assert_eq(memcmp(t->data, w[i].data, bytes), 0, "%s bytes", w[i].name);
            uint32_t align = st_dtype_bits(t->dtype) >= 8 ? st_dtype_bits(t->dtype) / 8 : 1;
            cr_assert_eq((uintptr_t)t->data % align, 0, "%s aligned", w[i].name);
        } else {
            cr_assert_null(t->data);
        }
    }
    cr_assert_eq(st_find(f, "scalar")->n_elements, 1);
    cr_assert_null(st_find(f, "t.F33"));
    st_close(f);
    for (size_t i = 0; i < ST_DTYPE_COUNT - 1; i++) {
        free((char *)w[i].name);
        free(bufs[i]);
    }
}

Test(safetensors, fill_callback_writes_the_same_bytes_as_data)
{
    enum { N = 3 * 1024 * 1024 + 5 }; /* more than one write chunk */
    uint8_t *data = malloc(N);
    fill_pattern((void *)(uintptr_t)9, 0, data, N, NULL);
    st_write_tensor a = {.name = "big", .dtype = ST_U8, .ndim = 1, .shape = {N}, .data = data};
    st_write_tensor b = {.name = "big", .dtype = ST_U8, .ndim = 1, .shape = {N},
                         .fill = fill_pattern, .userdata = (void *)(uintptr_t)9};
    char pa[512], pb[512];
    path_in_dir(pa, sizeof pa, "a.safetensors");
    path_in_dir(pb, sizeof pb, "b.safetensors");
    di_error e;
    cr_assert_eq(st_write(pa, &a, 1, NULL, NULL, 0, NULL, NULL, &e), DI_OK, "%s", e.msg);
    cr_assert_eq(st_write(pb, &b, 1, NULL, NULL, 0, NULL, NULL, &e), DI_OK, "%s", e.msg);
    st_file *fa, *fb;
    cr_assert_eq(st_open(pa, &fa, &e), DI_OK);
    cr_assert_eq(st_open(pb, &fb, &e), DI_OK);
    cr_assert_eq(fa->file_bytes, fb->file_bytes);
    cr_assert_eq(memcmp(fa->map, fb->map, fa->file_bytes), 0);
    st_close(fa);
    st_close(fb);
    free(data);
}

static di_status fill_fails(void *ud, uint64_t off, void *buf, size_t len, di_error *err)
{
    return di_fail(err, DI_EIO, "source gone at %lu", (unsigned long)off);
}

Test(safetensors, write_errors_leave_no_file)
{
    char path[512];
    path_in_dir(path, sizeof path, "x.safetensors");
    di_error e = {0};
    st_write_tensor dup[2] = {
        {.name = "w", .dtype = ST_F32, .ndim = 1, .shape = {1}, .data = "abcd"},
        {.name = "w", .dtype = ST_U8, .ndim = 1, .shape = {1}, .data = "a"},
    };
    cr_assert_eq(st_write(path, dup, 2, NULL, NULL, 0, NULL, NULL, &e), DI_EINVAL);
    cr_assert(strstr(e.msg, "duplicate tensor name 'w'"), "%s", e.msg);
    st_write_tensor bad = {.name = "w", .dtype = (st_dtype)99, .ndim = 1, .shape = {1},
                           .data = "a"};
    cr_assert_eq(st_write(path, &bad, 1, NULL, NULL, 0, NULL, NULL, &e), DI_EINVAL);
    st_write_tensor failing = {.name = "w", .dtype = ST_U8, .ndim = 1, .shape = {10},
                               .fill = fill_fails};
    cr_assert_eq(st_write(path, &failing, 1, NULL, NULL, 0, NULL, NULL, &e), DI_EIO);
    cr_assert(strstr(e.msg, "source gone"), "%s", e.msg);
    cr_assert_neq(access(path, F_OK), 0, "no partial file");
    char cmd[600];
    snprintf(cmd, sizeof cmd, "test -z \"$(ls -A '%s')\"", g_dir);
    cr_assert_eq(system(cmd), 0, "no temporary left behind");
}

/* A small valid file with three tensors. */
static void write_valid(const char *name)
{
    float a[6] = {1, 2, 3, 4, 5, 6};
    uint16_t b[4] = {0x3f80, 0x4000, 0x4040, 0x4080};
    uint8_t c[5] = {1, 2, 3, 4, 5};
    st_write_tensor w[3] = {
        {.name = "a", .dtype = ST_F32, .ndim = 2, .shape = {2, 3}, .data = a},
        {.name = "b", .dtype = ST_BF16, .ndim = 1, .shape = {4}, .data = b},
        {.name = "c", .dtype = ST_I8, .ndim = 1, .shape = {5}, .data = c},
    };
    char path[512];
    path_in_dir(path, sizeof path, name);
    di_error e;
    cr_assert_eq(st_write(path, w, 3, NULL, NULL, 0, NULL, NULL, &e), DI_OK, "%s", e.msg);
}

Test(safetensors, truncated_and_short_files)
{
    write_valid("t.safetensors");
    char path[512];
    path_in_dir(path, sizeof path, "t.safetensors");
    struct stat sb;
    stat(path, &sb);
    cr_assert_eq(truncate(path, sb.st_size - 1), 0);
    expect_corrupt("t.safetensors", "file truncated?");
    cr_assert_eq(truncate(path, 5), 0);
    expect_corrupt("t.safetensors", "shorter than the 8-byte header length");
    cr_assert_eq(truncate(path, 0), 0);
    expect_corrupt("t.safetensors", "shorter than the 8-byte header length");
    st_file *f;
    di_error e;
    cr_assert_eq(open_named("missing.safetensors", &f, &e), DI_ENOENT);
    cr_assert_eq(st_open(g_dir, &f, &e), DI_EIO, "a directory");
    cr_assert(strstr(e.msg, "not a regular file"), "%s", e.msg);
}

Test(safetensors, header_length_past_the_end)
{
    char path[512];
    path_in_dir(path, sizeof path, "h.safetensors");
    write_raw(path, "{}", 9999, NULL, 0);
    expect_corrupt("h.safetensors", "header length 9999 past the end of the 10-byte file");
    write_raw(path, "{}", UINT64_MAX, NULL, 0);
    expect_corrupt("h.safetensors", "past the end");
}

Test(safetensors, malformed_headers)
{
    write_header_file("json.safetensors", "{\"a\": {\"dtype\": \"F32\",", 0);
    expect_corrupt("json.safetensors", "header JSON line 1");
    write_header_file("arr.safetensors", "[1, 2, 3]", 0);
    expect_corrupt("arr.safetensors", "header is not a JSON object");
    write_header_file("dtype.safetensors",
                      "{\"w\": {\"dtype\": \"F12\", \"shape\": [2], \"data_offsets\": [0, 8]}}", 8);
    expect_corrupt("dtype.safetensors", "w: unknown dtype 'F12'");
    write_header_file("nodtype.safetensors",
                      "{\"w\": {\"shape\": [2], \"data_offsets\": [0, 8]}}", 8);
    expect_corrupt("nodtype.safetensors", "w: 'dtype' missing");
    write_header_file("size.safetensors",
                      "{\"w\": {\"dtype\": \"F32\", \"shape\": [3], \"data_offsets\": [0, 8]}}", 12);
    expect_corrupt("size.safetensors", "hold 8 bytes, dtype F32 with 3 elements needs 12");
    write_header_file("range.safetensors",
                      "{\"w\": {\"dtype\": \"U8\", \"shape\": [8], \"data_offsets\": [8, 16]}}", 12);
    expect_corrupt("range.safetensors", "w: data_offsets [8, 16] end past the 12 data bytes");
    write_header_file("neg.safetensors",
                      "{\"w\": {\"dtype\": \"U8\", \"shape\": [-1], \"data_offsets\": [0, 1]}}", 4);
    expect_corrupt("neg.safetensors", "shape[0] is not a non-negative integer");
    write_header_file("rev.safetensors",
                      "{\"w\": {\"dtype\": \"U8\", \"shape\": [0], \"data_offsets\": [4, 2]}}", 4);
    expect_corrupt("rev.safetensors", "end before begin");
    write_header_file("overlap.safetensors",
                      "{\"a\": {\"dtype\": \"U8\", \"shape\": [8], \"data_offsets\": [0, 8]},"
                      " \"b\": {\"dtype\": \"F32\", \"shape\": [2], \"data_offsets\": [4, 12]}}",
                      12);
    expect_corrupt("overlap.safetensors", "tensors a and b overlap");
    write_header_file("meta.safetensors", "{\"__metadata__\": {\"k\": 3}}", 0);
    expect_corrupt("meta.safetensors", "__metadata__ 'k' is not a string");
    write_header_file("dup.safetensors",
                      "{\"w\": {\"dtype\": \"U8\", \"shape\": [1], \"data_offsets\": [0, 1]},"
                      " \"w\": {\"dtype\": \"U8\", \"shape\": [1], \"data_offsets\": [1, 2]}}", 2);
    expect_corrupt("dup.safetensors", "header JSON");
    write_header_file("huge.safetensors",
                      "{\"w\": {\"dtype\": \"F64\", \"shape\": [4294967296, 4294967296], "
                      "\"data_offsets\": [0, 8]}}", 8);
    expect_corrupt("huge.safetensors", "overflows");
    /* gaps are tolerated, and a valid hand-written file opens */
    write_header_file("gap.safetensors",
                      "{\"a\": {\"dtype\": \"U8\", \"shape\": [2], \"data_offsets\": [0, 2]},"
                      " \"b\": {\"dtype\": \"U8\", \"shape\": [2], \"data_offsets\": [6, 8]}}", 8);
    st_file *f = NULL;
    di_error e;
    cr_assert_eq(open_named("gap.safetensors", &f, &e), DI_OK, "%s", e.msg);
    cr_assert_eq(st_find(f, "b")->offset, 8 + f->header_bytes + 6);
    st_close(f);
}

Test(safetensors, random_mutations_never_crash)
{
    write_valid("m.safetensors");
    char path[512], mpath[512];
    path_in_dir(path, sizeof path, "m.safetensors");
    path_in_dir(mpath, sizeof mpath, "mut.safetensors");
    FILE *fp = fopen(path, "rb");
    uint8_t orig[4096];
    size_t n = fread(orig, 1, sizeof orig, fp);
    fclose(fp);
    di_rng rng;
    di_rng_init(&rng, 7);
    int ok = 0, corrupt = 0;
    for (int iter = 0; iter < 400; iter++) {
        uint8_t buf[4096];
        memcpy(buf, orig, n);
        size_t len = n;
        int edits = 1 + (int)di_rng_below(&rng, 4);
        for (int k = 0; k < edits; k++) {
            size_t at = (size_t)di_rng_below(&rng, len);
            switch (di_rng_below(&rng, 3)) {
            case 0: buf[at] = (uint8_t)di_rng_u32(&rng); break;          /* random byte */
            case 1: buf[at] = "0123456789[]{}\",:-"[di_rng_below(&rng, 18)]; break;
            default: len = at; break;                                    /* truncate */
            }
        }
        FILE *out = fopen(mpath, "wb");
        fwrite(buf, 1, len, out);
        fclose(out);
        st_file *f = NULL;
        di_error e = {0};
        di_status st = st_open(mpath, &f, &e);
        cr_assert(st == DI_OK || st == DI_ECORRUPT, "iteration %d: status %d %s", iter, st,
                  e.msg);
        if (st == DI_OK) {
            ok++;
            for (uint32_t i = 0; i < f->n_tensors; i++) {
                const st_tensor *t = &f->tensors[i];
                cr_assert(t->offset + t->bytes <= f->file_bytes, "in bounds");
                if (t->bytes) {
                    volatile uint8_t last = t->data[t->bytes - 1];
                    (void)last;
                }
            }
            st_close(f);
        } else {
            corrupt++;
            cr_assert(strlen(e.msg) > 0);
        }
    }
    cr_assert(corrupt > 100, "most mutations are caught (%d ok, %d corrupt)", ok, corrupt);
}

Test(safetensors, shard_index)
{
    write_valid("model-00001-of-00002.safetensors");
    char path[512];
    path_in_dir(path, sizeof path, "model.safetensors.index.json");
    FILE *fp = fopen(path, "w");
    fprintf(fp, "{\"metadata\": {\"total_size\": 42}, \"weight_map\": {"
                "\"z\": \"model-00002-of-00002.safetensors\","
                "\"a\": \"model-00001-of-00002.safetensors\","
                "\"b\": \"model-00001-of-00002.safetensors\"}}");
    fclose(fp);
    st_index *idx = NULL;
    di_error e = {0};
    cr_assert_eq(st_index_load(g_dir, &idx, &e), DI_OK, "%s", e.msg);
    cr_assert_eq(idx->n_shards, 2);
    cr_assert_eq(idx->n_entries, 3);
    cr_assert_eq(idx->total_size, 42);
    cr_assert_str_eq(idx->shards[st_index_find(idx, "z")], "model-00002-of-00002.safetensors");
    cr_assert_str_eq(idx->shards[st_index_find(idx, "a")], "model-00001-of-00002.safetensors");
    cr_assert_eq(st_index_find(idx, "nope"), -1);
    st_index_free(idx);

    fp = fopen(path, "w");
    fprintf(fp, "{\"weight_map\": {\"a\": \"../../etc/passwd\"}}");
    fclose(fp);
    cr_assert_eq(st_index_load(g_dir, &idx, &e), DI_ECORRUPT);
    cr_assert(strstr(e.msg, "not a plain shard file name"), "%s", e.msg);
    fp = fopen(path, "w");
    fprintf(fp, "{\"weight_map\": [1]}");
    fclose(fp);
    cr_assert_eq(st_index_load(g_dir, &idx, &e), DI_ECORRUPT);
    cr_assert(strstr(e.msg, "'weight_map' missing or not an object"), "%s", e.msg);

    /* no index: a single model.safetensors is indexed from its header */
    unlink(path);
    cr_assert_eq(st_index_load(g_dir, &idx, &e), DI_ENOENT);
    write_valid("model.safetensors");
    cr_assert_eq(st_index_load(g_dir, &idx, &e), DI_OK, "%s", e.msg);
    cr_assert_eq(idx->n_shards, 1);
    cr_assert_eq(idx->n_entries, 3);
    cr_assert_eq(st_index_find(idx, "c"), 0);
    st_index_free(idx);
    st_index_free(NULL);
    st_close(NULL);
}
