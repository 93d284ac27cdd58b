/* safetensors.c: mapped, checked reading and deterministic writing of safetensors files and
 * the shard index (see safetensors.h). */
#include "common/model/safetensors.h"

#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

/* ---- dtypes ------------------------------------------------------------------------------- */

typedef struct dtype_row {
    const char *name;
    uint32_t bits;
} dtype_row;

static const dtype_row k_dtypes[ST_DTYPE_COUNT] = {
    [ST_DTYPE_INVALID] = {"?", 0},
#define ST_DTYPE_ROW_(id, nm, b) [ST_##id] = {nm, b},
    ST_DTYPE_MAP(ST_DTYPE_ROW_)
#undef ST_DTYPE_ROW_
};

const char *st_dtype_name(st_dtype t)
{
    return (unsigned)t < ST_DTYPE_COUNT ? k_dtypes[t].name : "?";
}

st_dtype st_dtype_parse(const char *name)
{
    for (int t = 1; name && t < ST_DTYPE_COUNT; t++)
        if (strcmp(name, k_dtypes[t].name) == 0)
            return (st_dtype)t;
    return ST_DTYPE_INVALID;
}

uint32_t st_dtype_bits(st_dtype t)
{
    return (unsigned)t < ST_DTYPE_COUNT ? k_dtypes[t].bits : 0;
}

uint64_t st_dtype_bytes(st_dtype t, uint64_t n)
{
    return (n * st_dtype_bits(t) + 7) / 8;
}

/* ---- reading ------------------------------------------------------------------------------ */

static void free_file(st_file *f)
{
    if (!f)
        return;
    if (f->map && f->file_bytes)
        munmap((void *)f->map, f->file_bytes);
    for (uint32_t i = 0; i < f->n_metadata; i++) {
        free(f->metadata_keys[i]);
        free(f->metadata_values[i]);
    }
    free(f->metadata_keys);
    free(f->metadata_values);
    free(f->tensors);
    free(f->names);
    free(f->path);
    free(f);
}

void st_close(st_file *f)
{
    free_file(f);
}

/* Reads a non-negative integer that fits in 63 bits. */
static bool get_u64(const json_t *v, uint64_t *out)
{
    if (!json_is_integer(v) || json_integer_value(v) < 0)
        return false;
    *out = (uint64_t)json_integer_value(v);
    return true;
}

static di_status parse_shape(const char *name, const json_t *shape, st_tensor *t, di_error *err)
{
    if (!json_is_array(shape))
        return di_fail(err, DI_ECORRUPT, "%s: 'shape' is not an array", name);
    size_t nd = json_array_size(shape);
    if (nd > ST_MAX_DIMS)
        return di_fail(err, DI_ECORRUPT, "%s: %zu dimensions, at most %u supported", name, nd,
                       ST_MAX_DIMS);
    t->ndim = (uint32_t)nd;
    t->n_elements = 1;
    for (size_t d = 0; d < nd; d++) {
        uint64_t x;
        if (!get_u64(json_array_get(shape, d), &x))
            return di_fail(err, DI_ECORRUPT, "%s: shape[%zu] is not a non-negative integer",
                           name, d);
        if (x != 0 && t->n_elements > (UINT64_MAX >> 8) / x)
            return di_fail(err, DI_ECORRUPT, "%s: shape overflows 64 bits", name);
        t->shape[d] = x;
        t->n_elements *= x;
    }
    return DI_OK;
}

/* One header entry -> t (name already set). Checks dtype, shape, size and range. */
static di_status parse_entry(const json_t *v, uint64_t data_bytes, uint64_t data_offset,
                             st_tensor *t, di_error *err)
{
    const char *name = t->name;
    if (!json_is_object(v))
        return di_fail(err, DI_ECORRUPT, "%s: header entry is not an object", name);
    const json_t *dt = json_object_get(v, "dtype");
    if (!json_is_string(dt))
        return di_fail(err, DI_ECORRUPT, "%s: 'dtype' missing or not a string", name);
    t->dtype = st_dtype_parse(json_string_value(dt));
    if (t->dtype == ST_DTYPE_INVALID)
        return di_fail(err, DI_ECORRUPT, "%s: unknown dtype '%s'", name, json_string_value(dt));
    di_status st = parse_shape(name, json_object_get(v, "shape"), t, err);
    if (st != DI_OK)
        return st;
    if (t->dtype == ST_F4 && t->n_elements % 2)
        return di_fail(err, DI_ECORRUPT, "%s: odd element count %" PRIu64 " for F4", name,
                       t->n_elements);
    const json_t *off = json_object_get(v, "data_offsets");
    uint64_t b, e;
    if (!json_is_array(off) || json_array_size(off) != 2 || !get_u64(json_array_get(off, 0), &b) ||
        !get_u64(json_array_get(off, 1), &e))
        return di_fail(err, DI_ECORRUPT, "%s: 'data_offsets' is not [begin, end] of integers",
                       name);
    if (e < b)
        return di_fail(err, DI_ECORRUPT, "%s: data_offsets [%" PRIu64 ", %" PRIu64 "] end before "
                       "begin", name, b, e);
    uint64_t need = st_dtype_bytes(t->dtype, t->n_elements);
    if (e - b != need)
        return di_fail(err, DI_ECORRUPT,
                       "%s: data_offsets [%" PRIu64 ", %" PRIu64 "] hold %" PRIu64 " bytes, dtype "
                       "%s with %" PRIu64 " elements needs %" PRIu64, name, b, e, e - b,
                       st_dtype_name(t->dtype), t->n_elements, need);
    if (e > data_bytes)
        return di_fail(err, DI_ECORRUPT,
                       "%s: data_offsets [%" PRIu64 ", %" PRIu64 "] end past the %" PRIu64
                       " data bytes: file truncated?", name, b, e, data_bytes);
    t->offset = data_offset + b;
    t->bytes = need;
    return DI_OK;
}

static int cmp_by_offset(const void *a, const void *b)
{
    const st_tensor *x = *(const st_tensor *const *)a, *y = *(const st_tensor *const *)b;
    return x->offset < y->offset ? -1 : x->offset > y->offset;
}

static int cmp_by_name(const void *a, const void *b)
{
    return strcmp(((const st_tensor *)a)->name, ((const st_tensor *)b)->name);
}

static di_status check_overlaps(st_file *f, di_error *err)
{
    if (f->n_tensors < 2)
        return DI_OK;
    const st_tensor **order = malloc(f->n_tensors * sizeof *order);
    if (!order)
        return di_fail(err, DI_ENOMEM, "%s: out of memory", f->path);
    for (uint32_t i = 0; i < f->n_tensors; i++)
        order[i] = &f->tensors[i];
    qsort(order, f->n_tensors, sizeof *order, cmp_by_offset);
    di_status st = DI_OK;
    const st_tensor *prev = NULL;
    for (uint32_t i = 0; i < f->n_tensors && st == DI_OK; i++) {
        const st_tensor *t = order[i];
        if (t->bytes == 0)
            continue;
        if (prev && t->offset < prev->offset + prev->bytes)
            st = di_fail(err, DI_ECORRUPT, "tensors %s and %s overlap (bytes %" PRIu64 "..%" PRIu64
                         " and %" PRIu64 "..%" PRIu64 " of the data)", prev->name, t->name,
                         prev->offset - f->data_offset, prev->offset + prev->bytes - f->data_offset,
                         t->offset - f->data_offset, t->offset + t->bytes - f->data_offset);
        prev = t;
    }
    free(order);
    return st;
}

static di_status read_metadata(st_file *f, const json_t *meta, di_error *err)
{
    if (!json_is_object(meta))
        return di_fail(err, DI_ECORRUPT, "'__metadata__' is not an object");
    size_t n = json_object_size(meta);
    f->metadata_keys = calloc(n ? n : 1, sizeof(char *));
    f->metadata_values = calloc(n ? n : 1, sizeof(char *));
    if (!f->metadata_keys || !f->metadata_values)
        return di_fail(err, DI_ENOMEM, "out of memory");
    const char *k;
    const json_t *v;
    json_object_foreach((json_t *)meta, k, v) {
        if (!json_is_string(v))
            return di_fail(err, DI_ECORRUPT, "__metadata__ '%s' is not a string", k);
        f->metadata_keys[f->n_metadata] = strdup(k);
        f->metadata_values[f->n_metadata] = strdup(json_string_value(v));
        f->n_metadata++;
        if (!f->metadata_keys[f->n_metadata - 1] || !f->metadata_values[f->n_metadata - 1])
            return di_fail(err, DI_ENOMEM, "out of memory");
    }
    return DI_OK;
}

static di_status parse_header(st_file *f, const json_t *root, di_error *err)
{
    if (!json_is_object(root))
        return di_fail(err, DI_ECORRUPT, "header is not a JSON object");
    size_t n = json_object_size(root), name_bytes = 0;
    const char *k;
    const json_t *v;
    json_object_foreach((json_t *)root, k, v)
        name_bytes += strlen(k) + 1;
    f->tensors = calloc(n ? n : 1, sizeof *f->tensors);
    f->names = malloc(name_bytes ? name_bytes : 1);
    if (!f->tensors || !f->names)
        return di_fail(err, DI_ENOMEM, "out of memory");
    uint64_t data_bytes = f->file_bytes - f->data_offset;
    char *np = f->names;
    json_object_foreach((json_t *)root, k, v) {
        if (strcmp(k, "__metadata__") == 0) {
            di_status st = read_metadata(f, v, err);
            if (st != DI_OK)
                return st;
            continue;
        }
        st_tensor *t = &f->tensors[f->n_tensors];
        size_t len = strlen(k) + 1;
        memcpy(np, k, len);
        t->name = np;
        np += len;
        di_status st = parse_entry(v, data_bytes, f->data_offset, t, err);
        if (st != DI_OK)
            return st;
        t->data = t->bytes ? f->map + t->offset : NULL;
        f->n_tensors++;
    }
    qsort(f->tensors, f->n_tensors, sizeof *f->tensors, cmp_by_name);
    return check_overlaps(f, err);
}

static di_status map_file(st_file *f, di_error *err)
{
    int fd = open(f->path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return di_fail(err, errno == ENOENT ? DI_ENOENT : DI_EIO, "%s", strerror(errno));
    struct stat sb;
    if (fstat(fd, &sb) != 0) {
        int e = errno;
        close(fd);
        return di_fail(err, DI_EIO, "%s", strerror(e));
    }
    if (!S_ISREG(sb.st_mode)) {
        close(fd);
        return di_fail(err, DI_EIO, "not a regular file");
    }
    f->file_bytes = (uint64_t)sb.st_size;
    if (f->file_bytes < 8) {
        close(fd);
        return di_fail(err, DI_ECORRUPT, "file of %" PRIu64 " bytes is shorter than the 8-byte "
                       "header length: truncated?", f->file_bytes);
    }
    void *m = mmap(NULL, f->file_bytes, PROT_READ, MAP_PRIVATE, fd, 0);
    int e = errno;
    close(fd);
    if (m == MAP_FAILED) {
        f->file_bytes = 0;
        return di_fail(err, DI_EIO, "mmap: %s", strerror(e));
    }
    f->map = m;
    return DI_OK;
}

di_status st_open(const char *path, st_file **out, di_error *err)
{
    if (!path || !out)
        return di_fail(err, DI_EINVAL, "path and output must not be NULL");
    st_file *f = calloc(1, sizeof *f);
    if (!f || !(f->path = strdup(path))) {
        free(f);
        return di_fail(err, DI_ENOMEM, "%s: out of memory", path);
    }
    di_status st = map_file(f, err);
    if (st == DI_OK) {
        uint64_t n = 0;
        for (int i = 7; i >= 0; i--)
            n = (n << 8) | f->map[i];
        f->header_bytes = n;
        f->data_offset = 8 + n;
        if (n > f->file_bytes - 8)
            st = di_fail(err, DI_ECORRUPT, "header length %" PRIu64 " past the end of the %" PRIu64
                         "-byte file: truncated or not a safetensors file", n, f->file_bytes);
        else if (n > ST_MAX_HEADER_BYTES)
            st = di_fail(err, DI_ECORRUPT, "header length %" PRIu64 " above the %u-byte limit", n,
                         ST_MAX_HEADER_BYTES);
    }
    if (st == DI_OK) {
        json_error_t je;
        json_t *root = json_loadb((const char *)f->map + 8, f->header_bytes,
                                  JSON_REJECT_DUPLICATES, &je);
        if (!root)
            st = di_fail(err, DI_ECORRUPT, "header JSON line %d column %d: %s", je.line,
                         je.column, je.text);
        else
            st = parse_header(f, root, err);
        json_decref(root);
    }
    if (st != DI_OK) {
        di_error_prefix(err, "%s: ", path);
        free_file(f);
        return st;
    }
    *out = f;
    return DI_OK;
}

const st_tensor *st_find(const st_file *f, const char *name)
{
    if (!f || !name)
        return NULL;
    size_t lo = 0, hi = f->n_tensors;
    while (lo < hi) {
        size_t mid = (lo + hi) / 2;
        int c = strcmp(name, f->tensors[mid].name);
        if (c == 0)
            return &f->tensors[mid];
        if (c < 0)
            hi = mid;
        else
            lo = mid + 1;
    }
    return NULL;
}

const char *st_metadata(const st_file *f, const char *key)
{
    for (uint32_t i = 0; f && key && i < f->n_metadata; i++)
        if (strcmp(f->metadata_keys[i], key) == 0)
            return f->metadata_values[i];
    return NULL;
}

/* ---- writing ------------------------------------------------------------------------------ */

static int cmp_str(const void *a, const void *b)
{
    return strcmp(*(char *const *)a, *(char *const *)b);
}

/* Write order: element size descending, then name (keeps every tensor aligned). */
static int cmp_write(const void *a, const void *b)
{
    const st_write_tensor *x = *(const st_write_tensor *const *)a;
    const st_write_tensor *y = *(const st_write_tensor *const *)b;
    uint32_t bx = st_dtype_bits(x->dtype), by = st_dtype_bits(y->dtype);
    if (bx != by)
        return bx > by ? -1 : 1;
    return strcmp(x->name, y->name);
}

static uint64_t write_elements(const st_write_tensor *t)
{
    uint64_t n = 1;
    for (uint32_t d = 0; d < t->ndim; d++)
        n *= t->shape[d];
    return n;
}

static di_status check_write_tensors(const st_write_tensor *const *order, size_t n, di_error *err)
{
    for (size_t i = 0; i < n; i++) {
        const st_write_tensor *t = order[i];
        if (!t->name || !*t->name || strcmp(t->name, "__metadata__") == 0)
            return di_fail(err, DI_EINVAL, "tensor %zu: empty or reserved name", i);
        if (t->dtype <= ST_DTYPE_INVALID || t->dtype >= ST_DTYPE_COUNT)
            return di_fail(err, DI_EINVAL, "%s: invalid dtype %d", t->name, (int)t->dtype);
        if (t->ndim > ST_MAX_DIMS)
            return di_fail(err, DI_EINVAL, "%s: %u dimensions, at most %u", t->name, t->ndim,
                           ST_MAX_DIMS);
        if (t->dtype == ST_F4 && write_elements(t) % 2)
            return di_fail(err, DI_EINVAL, "%s: odd element count for F4", t->name);
        if (!t->data && !t->fill && write_elements(t) > 0)
            return di_fail(err, DI_EINVAL, "%s: neither data nor fill given", t->name);
    }
    const char **names = malloc((n ? n : 1) * sizeof *names);
    if (!names)
        return di_fail(err, DI_ENOMEM, "out of memory");
    for (size_t i = 0; i < n; i++)
        names[i] = order[i]->name;
    qsort(names, n, sizeof *names, cmp_str);
    di_status st = DI_OK;
    for (size_t i = 1; i < n && st == DI_OK; i++)
        if (strcmp(names[i - 1], names[i]) == 0)
            st = di_fail(err, DI_EINVAL, "duplicate tensor name '%s'", names[i]);
    free(names);
    return st;
}

/* The header text (padded with spaces to a multiple of 8), for tensors in write order. */
static char *build_header(const st_write_tensor *const *order, size_t n,
                          const char *const *mk, const char *const *mv, size_t n_meta,
                          size_t *len_out)
{
    json_t *root = json_object();
    json_t *meta = n_meta ? json_object() : NULL;
    for (size_t i = 0; meta && i < n_meta; i++)
        json_object_set_new(meta, mk[i], json_string(mv[i]));
    if (meta)
        json_object_set_new(root, "__metadata__", meta);
    uint64_t off = 0;
    for (size_t i = 0; root && i < n; i++) {
        const st_write_tensor *t = order[i];
        json_t *shape = json_array();
        for (uint32_t d = 0; d < t->ndim; d++)
            json_array_append_new(shape, json_integer((json_int_t)t->shape[d]));
        uint64_t bytes = st_dtype_bytes(t->dtype, write_elements(t));
        json_t *e = json_pack("{s:s,s:o,s:[I,I]}", "dtype", st_dtype_name(t->dtype), "shape",
                              shape, "data_offsets", (json_int_t)off, (json_int_t)(off + bytes));
        if (!e || json_object_set_new(root, t->name, e) != 0) {
            json_decref(root);
            return NULL;
        }
        off += bytes;
    }
    char *text = root ? json_dumps(root, JSON_COMPACT) : NULL;
    json_decref(root);
    if (!text)
        return NULL;
    size_t len = strlen(text), padded = (len + 7) & ~(size_t)7;
    char *out = realloc(text, padded + 1);
    if (!out) {
        free(text);
        return NULL;
    }
    memset(out + len, ' ', padded - len);
    out[padded] = '\0';
    *len_out = padded;
    return out;
}

static const st_write_tensor **sorted_order(const st_write_tensor *tensors, size_t n)
{
    const st_write_tensor **order = malloc((n ? n : 1) * sizeof *order);
    if (!order)
        return NULL;
    for (size_t i = 0; i < n; i++)
        order[i] = &tensors[i];
    qsort(order, n, sizeof *order, cmp_write);
    return order;
}

uint64_t st_file_bytes_for(const st_write_tensor *tensors, size_t n, const char *const *mk,
                           const char *const *mv, size_t n_meta)
{
    const st_write_tensor **order = sorted_order(tensors, n);
    size_t hlen = 0;
    char *h = order ? build_header(order, n, mk, mv, n_meta, &hlen) : NULL;
    uint64_t total = 8 + hlen;
    for (size_t i = 0; i < n; i++)
        total += st_dtype_bytes(tensors[i].dtype, write_elements(&tensors[i]));
    free(h);
    free(order);
    return h ? total : 0;
}

#define WRITE_CHUNK (1u << 20)

static di_status write_all(FILE *fp, const void *p, size_t len, di_error *err)
{
    if (len && fwrite(p, 1, len, fp) != len)
        return di_fail(err, DI_EIO, "write: %s", strerror(errno));
    return DI_OK;
}

static di_status write_tensor_bytes(FILE *fp, const st_write_tensor *t, uint8_t *chunk,
                                    di_error *err)
{
    uint64_t bytes = st_dtype_bytes(t->dtype, write_elements(t));
    if (t->data)
        return write_all(fp, t->data, bytes, err);
    for (uint64_t off = 0; off < bytes; off += WRITE_CHUNK) {
        size_t len = bytes - off < WRITE_CHUNK ? (size_t)(bytes - off) : WRITE_CHUNK;
        di_status st = t->fill(t->userdata, off, chunk, len, err);
        if (st == DI_OK)
            st = write_all(fp, chunk, len, err);
        if (st != DI_OK)
            return st;
    }
    return DI_OK;
}

static di_status write_body(FILE *fp, const st_write_tensor *const *order, size_t n,
                            const char *header, size_t hlen,
                            void (*progress)(void *, uint64_t), void *pud, di_error *err)
{
    uint8_t le[8];
    for (int i = 0; i < 8; i++)
        le[i] = (uint8_t)((uint64_t)hlen >> (8 * i));
    di_status st = write_all(fp, le, 8, err);
    if (st == DI_OK)
        st = write_all(fp, header, hlen, err);
    uint8_t *chunk = malloc(WRITE_CHUNK);
    if (!chunk)
        return di_fail(err, DI_ENOMEM, "out of memory");
    uint64_t done = 8 + hlen;
    for (size_t i = 0; i < n && st == DI_OK; i++) {
        st = write_tensor_bytes(fp, order[i], chunk, err);
        done += st_dtype_bytes(order[i]->dtype, write_elements(order[i]));
        if (st == DI_OK && progress)
            progress(pud, done);
    }
    free(chunk);
    return st;
}

di_status st_write(const char *path, const st_write_tensor *tensors, size_t n,
                   const char *const *mk, const char *const *mv, size_t n_meta,
                   void (*progress)(void *, uint64_t), void *pud, di_error *err)
{
    if (!path || (n && !tensors) || (n_meta && (!mk || !mv)))
        return di_fail(err, DI_EINVAL, "path, tensors and metadata must not be NULL");
    const st_write_tensor **order = sorted_order(tensors, n);
    if (!order)
        return di_fail(err, DI_ENOMEM, "out of memory");
    di_status st = check_write_tensors(order, n, err);
    size_t hlen = 0;
    char *header = NULL;
    if (st == DI_OK && !(header = build_header(order, n, mk, mv, n_meta, &hlen)))
        st = di_fail(err, DI_ENOMEM, "%s: building the header failed", path);
    char tmp[4096];
    snprintf(tmp, sizeof tmp, "%s.tmp.%ld", path, (long)getpid());
    FILE *fp = NULL;
    if (st == DI_OK && !(fp = fopen(tmp, "wb")))
        st = di_fail(err, DI_EIO, "%s: %s", tmp, strerror(errno));
    if (st == DI_OK)
        st = write_body(fp, order, n, header, hlen, progress, pud, err);
    if (fp && fclose(fp) != 0 && st == DI_OK)
        st = di_fail(err, DI_EIO, "%s: close: %s", tmp, strerror(errno));
    if (st == DI_OK && rename(tmp, path) != 0)
        st = di_fail(err, DI_EIO, "rename %s -> %s: %s", tmp, path, strerror(errno));
    if (st != DI_OK && fp)
        unlink(tmp);
    free(header);
    free(order);
    return st;
}

/* ---- the shard index ---------------------------------------------------------------------- */

void st_index_free(st_index *idx)
{
    if (!idx)
        return;
    for (uint32_t i = 0; i < idx->n_shards; i++)
        free(idx->shards[i]);
    for (uint32_t i = 0; i < idx->n_entries; i++)
        free(idx->names[i]);
    free(idx->shards);
    free(idx->names);
    free(idx->shard_of);
    free(idx);
}

static int32_t find_sorted(char *const *list, uint32_t n, const char *key)
{
    char *const *hit = bsearch(&key, list, n, sizeof *list, cmp_str);
    return hit ? (int32_t)(hit - list) : -1;
}

static bool plain_file_name(const char *s)
{
    return *s && !strchr(s, '/') && strcmp(s, ".") != 0 && strcmp(s, "..") != 0;
}

/* Fills idx from (name -> shard) pairs; names must be unique. */
static di_status index_fill(st_index *idx, const json_t *map, di_error *err)
{
    size_t n = json_object_size(map);
    idx->names = calloc(n ? n : 1, sizeof(char *));
    idx->shards = calloc(n ? n : 1, sizeof(char *));
    idx->shard_of = calloc(n ? n : 1, sizeof(uint32_t));
    if (!idx->names || !idx->shards || !idx->shard_of)
        return di_fail(err, DI_ENOMEM, "out of memory");
    const char *k;
    const json_t *v;
    json_object_foreach((json_t *)map, k, v) {
        if (!json_is_string(v) || !plain_file_name(json_string_value(v)))
            return di_fail(err, DI_ECORRUPT, "weight_map['%s'] is not a plain shard file name",
                           k);
        if (find_sorted(idx->shards, idx->n_shards, json_string_value(v)) < 0) {
            if (!(idx->shards[idx->n_shards] = strdup(json_string_value(v))))
                return di_fail(err, DI_ENOMEM, "out of memory");
            idx->n_shards++;
            qsort(idx->shards, idx->n_shards, sizeof(char *), cmp_str);
        }
        if (!(idx->names[idx->n_entries++] = strdup(k)))
            return di_fail(err, DI_ENOMEM, "out of memory");
    }
    qsort(idx->names, idx->n_entries, sizeof(char *), cmp_str);
    for (uint32_t i = 0; i < idx->n_entries; i++) {
        const char *shard = json_string_value(json_object_get(map, idx->names[i]));
        idx->shard_of[i] = (uint32_t)find_sorted(idx->shards, idx->n_shards, shard);
    }
    return DI_OK;
}

static di_status index_from_json(st_index *idx, const json_t *root, di_error *err)
{
    if (!json_is_object(root))
        return di_fail(err, DI_ECORRUPT, "not a JSON object");
    const json_t *map = json_object_get(root, "weight_map");
    if (!json_is_object(map))
        return di_fail(err, DI_ECORRUPT, "'weight_map' missing or not an object");
    const json_t *meta = json_object_get(root, "metadata");
    const json_t *ts = json_is_object(meta) ? json_object_get(meta, "total_size") : NULL;
    if (ts && !get_u64(ts, &idx->total_size))
        return di_fail(err, DI_ECORRUPT, "'metadata.total_size' is not a non-negative integer");
    return index_fill(idx, map, err);
}

/* A one-shard index listing every tensor of dir/model.safetensors. */
static di_status index_single_file(st_index *idx, const char *path, di_error *err)
{
    st_file *f = NULL;
    di_status st = st_open(path, &f, err);
    if (st != DI_OK)
        return st;
    json_t *map = json_object();
    for (uint32_t i = 0; map && i < f->n_tensors; i++)
        json_object_set_new(map, f->tensors[i].name, json_string("model.safetensors"));
    st = map ? index_fill(idx, map, err) : di_fail(err, DI_ENOMEM, "out of memory");
    json_decref(map);
    st_close(f);
    return st;
}

di_status st_index_load(const char *dir, st_index **out, di_error *err)
{
    if (!dir || !out)
        return di_fail(err, DI_EINVAL, "directory and output must not be NULL");
    char path[4096];
    snprintf(path, sizeof path, "%s/model.safetensors.index.json", dir);
    st_index *idx = calloc(1, sizeof *idx);
    if (!idx)
        return di_fail(err, DI_ENOMEM, "out of memory");
    di_status st;
    if (access(path, F_OK) == 0) {
        json_error_t je;
        json_t *root = json_load_file(path, JSON_REJECT_DUPLICATES, &je);
        if (!root)
            st = di_fail(err, DI_ECORRUPT, "line %d column %d: %s", je.line, je.column, je.text);
        else
            st = index_from_json(idx, root, err);
        json_decref(root);
        if (st != DI_OK)
            di_error_prefix(err, "%s: ", path);
    } else {
        char single[4096];
        snprintf(single, sizeof single, "%s/model.safetensors", dir);
        if (access(single, F_OK) != 0) {
            st_index_free(idx);
            return di_fail(err, DI_ENOENT, "%s: neither model.safetensors.index.json nor "
                           "model.safetensors found", dir);
        }
        st = index_single_file(idx, single, err);
    }
    if (st != DI_OK) {
        st_index_free(idx);
        return st;
    }
    *out = idx;
    return DI_OK;
}

int32_t st_index_entry(const st_index *idx, const char *name)
{
    if (!idx || !name)
        return -1;
    return find_sorted(idx->names, idx->n_entries, name);
}

int32_t st_index_find(const st_index *idx, const char *name)
{
    int32_t i = st_index_entry(idx, name);
    return i < 0 ? -1 : (int32_t)idx->shard_of[i];
}
