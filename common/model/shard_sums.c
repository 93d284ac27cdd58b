/* shard_sums.c: chunked SHA-256 of a checkpoint's weight files, its manifest and the weights
 * fingerprint (see shard_sums.h). */
#include "common/model/shard_sums.h"

#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <jansson.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#define MAX_THREADS 64u

/* One covered file: its name, size and chunk digests. */
typedef struct sum_file {
    char *name;                      /* plain file name inside the checkpoint */
    uint64_t bytes;                  /* size */
    uint64_t n_chunks;               /* ceil(bytes / SHARD_SUMS_CHUNK_BYTES) */
    uint8_t (*chunk)[DI_SHA256_BYTES]; /* [n_chunks] digests */
    const uint8_t *map;              /* while hashing: the mapped file */
} sum_file;

/* A list of covered files, sorted by name. */
typedef struct sum_set {
    uint32_t n;
    sum_file *f;
} sum_set;

static void set_free(sum_set *s)
{
    for (uint32_t i = 0; i < s->n; i++) {
        free(s->f[i].name);
        free(s->f[i].chunk);
        if (s->f[i].map)
            munmap((void *)s->f[i].map, s->f[i].bytes);
    }
    free(s->f);
    s->n = 0;
    s->f = NULL;
}

static int cmp_file(const void *a, const void *b)
{
    return strcmp(((const sum_file *)a)->name, ((const sum_file *)b)->name);
}

static uint64_t chunks_for(uint64_t bytes)
{
    return (bytes + SHARD_SUMS_CHUNK_BYTES - 1) / SHARD_SUMS_CHUNK_BYTES;
}

static di_status set_add(sum_set *s, const char *name, uint64_t bytes, di_error *err)
{
    sum_file *f = realloc(s->f, (s->n + 1) * sizeof *f);
    if (!f)
        return di_fail(err, DI_ENOMEM, "out of memory");
    s->f = f;
    sum_file *x = &s->f[s->n];
    memset(x, 0, sizeof *x);
    x->name = strdup(name);
    x->bytes = bytes;
    x->n_chunks = chunks_for(bytes);
    x->chunk = x->n_chunks ? calloc(x->n_chunks, DI_SHA256_BYTES) : NULL;
    s->n++;
    if (!x->name || (x->n_chunks && !x->chunk))
        return di_fail(err, DI_ENOMEM, "out of memory");
    return DI_OK;
}

static bool file_exists(const char *dir, const char *name)
{
    char path[4200];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    return access(path, F_OK) == 0;
}

/* The covered files of dir: every shard of idx, and the token map and tokenizer when present
 * (sizes 0 until they are mapped). */
static di_status covered_set(const char *dir, const st_index *idx, sum_set *s, di_error *err)
{
    di_status st = DI_OK;
    for (uint32_t i = 0; i < idx->n_shards && st == DI_OK; i++)
        st = set_add(s, idx->shards[i], 0, err);
    static const char *const optional[] = {SHARD_SUMS_TOKEN_MAP, SHARD_SUMS_TOKENIZER};
    for (size_t i = 0; i < sizeof optional / sizeof optional[0] && st == DI_OK; i++)
        if (file_exists(dir, optional[i]))
            st = set_add(s, optional[i], 0, err);
    if (st == DI_OK)
        qsort(s->f, s->n, sizeof *s->f, cmp_file);
    return st;
}

/* Maps every file of s read-only and sets its size and chunk count. */
static di_status map_files(const char *dir, sum_set *s, di_error *err)
{
    for (uint32_t i = 0; i < s->n; i++) {
        sum_file *f = &s->f[i];
        char path[4200];
        snprintf(path, sizeof path, "%s/%s", dir, f->name);
        int fd = open(path, O_RDONLY | O_CLOEXEC);
        struct stat sb;
        if (fd < 0 || fstat(fd, &sb) != 0) {
            int e = errno;
            if (fd >= 0)
                close(fd);
            return di_fail(err, e == ENOENT ? DI_ENOENT : DI_EIO, "%s: %s", path, strerror(e));
        }
        f->bytes = (uint64_t)sb.st_size;
        f->n_chunks = chunks_for(f->bytes);
        free(f->chunk);
        f->chunk = f->n_chunks ? calloc(f->n_chunks, DI_SHA256_BYTES) : NULL;
        void *m = f->bytes ? mmap(NULL, f->bytes, PROT_READ, MAP_PRIVATE, fd, 0) : NULL;
        int e = errno;
        close(fd);
        if (f->n_chunks && !f->chunk)
            return di_fail(err, DI_ENOMEM, "out of memory");
        if (m == MAP_FAILED)
            return di_fail(err, DI_EIO, "%s: mmap: %s", path, strerror(e));
        if (m)
            madvise(m, f->bytes, MADV_SEQUENTIAL | MADV_WILLNEED);
        f->map = m;
    }
    return DI_OK;
}

/* Work shared by the hashing threads: chunk j of the whole set is taken once. */
typedef struct hash_work {
    sum_set *s;
    uint64_t *first;          /* [s->n + 1]: global index of each file's first chunk */
    uint64_t total;           /* chunks in all */
    atomic_uint_fast64_t next;
    atomic_bool failed;       /* OpenSSL could not allocate */
} hash_work;

static void *hash_thread(void *arg)
{
    hash_work *w = arg;
    uint32_t file = 0;
    for (;;) {
        uint64_t j = atomic_fetch_add(&w->next, 1);
        if (j >= w->total)
            break;
        while (w->first[file + 1] <= j)
            file++;
        sum_file *f = &w->s->f[file];
        uint64_t c = j - w->first[file];
        uint64_t off = c * SHARD_SUMS_CHUNK_BYTES;
        uint64_t len = f->bytes - off < SHARD_SUMS_CHUNK_BYTES ? f->bytes - off
                                                               : SHARD_SUMS_CHUNK_BYTES;
        di_sha256 h;
        if (!di_sha256_init(&h)) {
            atomic_store(&w->failed, true);
            break;
        }
        di_sha256_update(&h, f->map + off, (size_t)len);
        di_sha256_final(&h, f->chunk[c]);
    }
    return NULL;
}

static uint32_t thread_count(uint32_t threads, uint64_t chunks)
{
    if (threads == 0) {
        long n = sysconf(_SC_NPROCESSORS_ONLN);
        threads = n > 0 ? (uint32_t)n : 1;
    }
    if (threads > MAX_THREADS)
        threads = MAX_THREADS;
    if (threads > chunks)
        threads = chunks ? (uint32_t)chunks : 1;
    return threads;
}

/* Maps and hashes every file of s; *bytes receives the bytes hashed. */
static di_status hash_files(const char *dir, sum_set *s, uint32_t threads, uint64_t *bytes,
                            di_error *err)
{
    di_status st = map_files(dir, s, err);
    if (st != DI_OK)
        return st;
    hash_work w = {.s = s};
    w.first = malloc((s->n + 1) * sizeof *w.first);
    if (!w.first)
        return di_fail(err, DI_ENOMEM, "out of memory");
    *bytes = 0;
    for (uint32_t i = 0; i < s->n; i++) {
        w.first[i] = w.total;
        w.total += s->f[i].n_chunks;
        *bytes += s->f[i].bytes;
    }
    w.first[s->n] = w.total;
    atomic_init(&w.next, 0);
    atomic_init(&w.failed, false);
    uint32_t n = thread_count(threads, w.total);
    pthread_t tid[MAX_THREADS];
    uint32_t started = 0;
    for (uint32_t t = 1; t < n; t++, started++)
        if (pthread_create(&tid[started], NULL, hash_thread, &w) != 0)
            break; /* fewer helpers: the caller's thread still takes every chunk left */
    hash_thread(&w);
    for (uint32_t t = 0; t < started; t++)
        pthread_join(tid[t], NULL);
    free(w.first);
    for (uint32_t i = 0; i < s->n; i++) {
        if (s->f[i].map)
            munmap((void *)s->f[i].map, s->f[i].bytes);
        s->f[i].map = NULL;
    }
    if (atomic_load(&w.failed))
        return di_fail(err, DI_ENOMEM, "out of memory for a SHA-256 context");
    return DI_OK;
}

static void put_le64(uint8_t out[8], uint64_t x)
{
    for (int i = 0; i < 8; i++)
        out[i] = (uint8_t)(x >> (8 * i));
}

static di_status fingerprint_of(const sum_set *s, uint8_t out[DI_SHA256_BYTES], di_error *err)
{
    di_sha256 h;
    if (!di_sha256_init(&h))
        return di_fail(err, DI_ENOMEM, "out of memory for a SHA-256 context");
    di_sha256_update(&h, SHARD_SUMS_FORMAT, strlen(SHARD_SUMS_FORMAT));
    for (uint32_t i = 0; i < s->n; i++) {
        uint8_t le[8];
        put_le64(le, s->f[i].bytes);
        di_sha256_update(&h, s->f[i].name, strlen(s->f[i].name) + 1);
        di_sha256_update(&h, le, sizeof le);
        di_sha256_update(&h, s->f[i].chunk, s->f[i].n_chunks * DI_SHA256_BYTES);
    }
    di_sha256_final(&h, out);
    return DI_OK;
}

/* ---- the manifest file ---- */

static json_t *manifest_json(const sum_set *s, const uint8_t fp[DI_SHA256_BYTES])
{
    char hex[2 * DI_SHA256_BYTES + 1];
    json_t *files = json_array();
    for (uint32_t i = 0; files && i < s->n; i++) {
        json_t *sums = json_array();
        for (uint64_t c = 0; sums && c < s->f[i].n_chunks; c++) {
            di_sha256_hex(s->f[i].chunk[c], hex);
            json_array_append_new(sums, json_string(hex));
        }
        json_array_append_new(files, json_pack("{s:s,s:I,s:o}", "name", s->f[i].name, "bytes",
                                               (json_int_t)s->f[i].bytes, "sha256", sums));
    }
    di_sha256_hex(fp, hex);
    return json_pack("{s:s,s:s,s:I,s:s,s:o}", "format", SHARD_SUMS_FORMAT, "hash", "sha256",
                     "chunk_bytes", (json_int_t)SHARD_SUMS_CHUNK_BYTES, "fingerprint", hex,
                     "files", files);
}

static di_status write_text(const char *path, const char *text, di_error *err)
{
    char tmp[4300];
    snprintf(tmp, sizeof tmp, "%s.tmp", path);
    int fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    size_t len = strlen(text), done = 0;
    while (fd >= 0 && done < len) {
        ssize_t n = write(fd, text + done, len - done);
        if (n < 0 && errno == EINTR)
            continue;
        if (n <= 0)
            break;
        done += (size_t)n;
    }
    bool ok = fd >= 0 && done == len && fsync(fd) == 0;
    int e = errno;
    if (fd >= 0 && close(fd) != 0 && ok) {
        ok = false;
        e = errno;
    }
    if (ok && rename(tmp, path) == 0)
        return DI_OK;
    if (ok)
        e = errno;
    unlink(tmp);
    return di_fail(err, e == ENOSPC ? DI_ENOSPC : DI_EIO, "%s: %s", path, strerror(e));
}

di_status shard_sums_write(const char *dir, const st_index *idx, uint32_t threads,
                           uint8_t fingerprint[DI_SHA256_BYTES], di_error *err)
{
    if (!dir || !idx)
        return di_fail(err, DI_EINVAL, "directory and index must not be NULL");
    sum_set s = {0};
    uint8_t fp[DI_SHA256_BYTES];
    uint64_t bytes;
    di_status st = covered_set(dir, idx, &s, err);
    if (st == DI_OK)
        st = hash_files(dir, &s, threads, &bytes, err);
    if (st == DI_OK)
        st = fingerprint_of(&s, fp, err);
    char *text = NULL;
    if (st == DI_OK) {
        json_t *root = manifest_json(&s, fp);
        text = root ? json_dumps(root, JSON_INDENT(1)) : NULL;
        json_decref(root);
        if (!text)
            st = di_fail(err, DI_ENOMEM, "out of memory");
    }
    if (st == DI_OK) {
        size_t n = strlen(text);
        char *nl = realloc(text, n + 2);
        if (nl) {
            text = nl;
            memcpy(text + n, "\n", 2);
        }
        char path[4200];
        snprintf(path, sizeof path, "%s/%s", dir, SHARD_SUMS_FILE);
        st = write_text(path, text, err);
    }
    free(text);
    set_free(&s);
    if (st == DI_OK && fingerprint)
        memcpy(fingerprint, fp, sizeof fp);
    return st;
}

/* One "files" entry of a manifest into s. */
static di_status parse_entry(const json_t *e, size_t i, sum_set *s, di_error *err)
{
    const char *name = json_string_value(json_object_get(e, "name"));
    const json_t *bytes = json_object_get(e, "bytes");
    const json_t *sums = json_object_get(e, "sha256");
    if (!name || !*name || strchr(name, '/') || strcmp(name, "..") == 0 || strcmp(name, ".") == 0)
        return di_fail(err, DI_ECORRUPT, "files[%zu]: 'name' missing or not a plain file name", i);
    if (!json_is_integer(bytes) || json_integer_value(bytes) < 0)
        return di_fail(err, DI_ECORRUPT, "%s: 'bytes' missing or negative", name);
    di_status st = set_add(s, name, (uint64_t)json_integer_value(bytes), err);
    if (st != DI_OK)
        return st;
    sum_file *f = &s->f[s->n - 1];
    if (!json_is_array(sums) || json_array_size(sums) != f->n_chunks)
        return di_fail(err, DI_ECORRUPT, "%s: 'sha256' must list %" PRIu64 " chunk digests for "
                       "%" PRIu64 " bytes", name, f->n_chunks, f->bytes);
    for (uint64_t c = 0; c < f->n_chunks; c++)
        if (!di_sha256_parse_hex(json_string_value(json_array_get(sums, c)), f->chunk[c]))
            return di_fail(err, DI_ECORRUPT, "%s: sha256[%" PRIu64 "] is not 64 hex digits",
                           name, c);
    return DI_OK;
}

/* Reads and checks dir's manifest into s (sorted); DI_ENOENT when there is none. */
static di_status read_manifest(const char *dir, sum_set *s, uint8_t fp[DI_SHA256_BYTES],
                               di_error *err)
{
    char path[4200];
    snprintf(path, sizeof path, "%s/%s", dir, SHARD_SUMS_FILE);
    if (access(path, F_OK) != 0)
        return di_fail(err, DI_ENOENT, "%s: no such file", path);
    json_error_t je;
    json_t *root = json_load_file(path, JSON_REJECT_DUPLICATES, &je);
    if (!root)
        return di_fail(err, DI_ECORRUPT, "%s: line %d: %s", path, je.line, je.text);
    di_status st = DI_OK;
    const char *format = json_string_value(json_object_get(root, "format"));
    const char *hash = json_string_value(json_object_get(root, "hash"));
    const json_t *chunk = json_object_get(root, "chunk_bytes");
    const json_t *files = json_object_get(root, "files");
    uint8_t want[DI_SHA256_BYTES];
    if (!format || strcmp(format, SHARD_SUMS_FORMAT) != 0)
        st = di_fail(err, DI_ECORRUPT, "'format' is not \"%s\"", SHARD_SUMS_FORMAT);
    else if (!hash || strcmp(hash, "sha256") != 0)
        st = di_fail(err, DI_ECORRUPT, "'hash' is not \"sha256\"");
    else if (!json_is_integer(chunk) || json_integer_value(chunk) != (json_int_t)SHARD_SUMS_CHUNK_BYTES)
        st = di_fail(err, DI_ECORRUPT, "'chunk_bytes' is not %llu",
                     (unsigned long long)SHARD_SUMS_CHUNK_BYTES);
    else if (!di_sha256_parse_hex(json_string_value(json_object_get(root, "fingerprint")), want))
        st = di_fail(err, DI_ECORRUPT, "'fingerprint' is not 64 hex digits");
    else if (!json_is_array(files))
        st = di_fail(err, DI_ECORRUPT, "'files' is not an array");
    for (size_t i = 0; st == DI_OK && i < json_array_size(files); i++)
        st = parse_entry(json_array_get(files, i), i, s, err);
    json_decref(root);
    if (st == DI_OK) {
        qsort(s->f, s->n, sizeof *s->f, cmp_file);
        for (uint32_t i = 1; st == DI_OK && i < s->n; i++)
            if (strcmp(s->f[i - 1].name, s->f[i].name) == 0)
                st = di_fail(err, DI_ECORRUPT, "%s is listed twice", s->f[i].name);
    }
    if (st == DI_OK)
        st = fingerprint_of(s, fp, err);
    if (st == DI_OK && memcmp(fp, want, sizeof want) != 0)
        st = di_fail(err, DI_ECORRUPT, "'fingerprint' does not match the listed digests "
                     "(edited by hand?)");
    if (st != DI_OK)
        di_error_prefix(err, "%s: ", path);
    return st;
}

/* The entry of s named name, or NULL. */
static const sum_file *find_file(const sum_set *s, const char *name)
{
    sum_file key = {.name = (char *)name};
    return bsearch(&key, s->f, s->n, sizeof *s->f, cmp_file);
}

/* Compares the hashed files with the manifest: sets, sizes, then every chunk. */
static di_status compare(const char *dir, const sum_set *got, const sum_set *man, di_error *err)
{
    for (uint32_t i = 0; i < man->n; i++)
        if (!find_file(got, man->f[i].name))
            return di_fail(err, DI_ECORRUPT, "%s/%s lists %s, which the checkpoint does not have",
                           dir, SHARD_SUMS_FILE, man->f[i].name);
    for (uint32_t i = 0; i < got->n; i++) {
        const sum_file *g = &got->f[i], *m = find_file(man, g->name);
        if (!m)
            return di_fail(err, DI_ECORRUPT, "%s/%s is not in the checksum manifest %s", dir,
                           g->name, SHARD_SUMS_FILE);
        if (m->bytes != g->bytes)
            return di_fail(err, DI_ECORRUPT, "%s/%s has %" PRIu64 " bytes, the checksum manifest "
                           "says %" PRIu64 ": truncated or replaced", dir, g->name, g->bytes,
                           m->bytes);
    }
    for (uint32_t i = 0; i < got->n; i++) {
        const sum_file *g = &got->f[i], *m = find_file(man, g->name);
        for (uint64_t c = 0; c < g->n_chunks; c++)
            if (memcmp(g->chunk[c], m->chunk[c], DI_SHA256_BYTES) != 0) {
                uint64_t lo = c * SHARD_SUMS_CHUNK_BYTES;
                uint64_t hi = lo + SHARD_SUMS_CHUNK_BYTES < g->bytes ? lo + SHARD_SUMS_CHUNK_BYTES
                                                                     : g->bytes;
                return di_fail(err, DI_ECORRUPT, "%s/%s: bytes %" PRIu64 "..%" PRIu64 " do not "
                               "match the checksum manifest %s (SHA-256): the file is damaged "
                               "or was changed after the manifest was written", dir, g->name,
                               lo, hi, SHARD_SUMS_FILE);
            }
    }
    return DI_OK;
}

di_status shard_sums_fingerprint(const char *dir, const st_index *idx, uint32_t threads,
                                 bool trust, shard_sums_result *out, di_error *err)
{
    if (!dir || !idx || !out)
        return di_fail(err, DI_EINVAL, "directory, index and output must not be NULL");
    shard_sums_result r;
    memset(&r, 0, sizeof r);
    sum_set man = {0}, got = {0};
    uint8_t man_fp[DI_SHA256_BYTES];
    di_status st = read_manifest(dir, &man, man_fp, err);
    r.had_manifest = st == DI_OK;
    if (st == DI_ENOENT)
        st = DI_OK;
    if (st == DI_OK)
        st = covered_set(dir, idx, &got, err);
    if (st == DI_OK && r.had_manifest && trust) {
        memcpy(r.fingerprint, man_fp, sizeof man_fp);
        r.n_files = man.n;
    }
    else if (st == DI_OK) {
        st = hash_files(dir, &got, threads, &r.bytes_hashed, err);
        if (st == DI_OK && r.had_manifest)
            st = compare(dir, &got, &man, err);
        if (st == DI_OK)
            st = fingerprint_of(&got, r.fingerprint, err);
        r.verified = st == DI_OK && r.had_manifest;
        r.n_files = got.n;
    }
    set_free(&man);
    set_free(&got);
    if (st == DI_OK)
        *out = r;
    return st;
}

di_status shard_sums_read_fingerprint(const char *dir, uint8_t fingerprint[DI_SHA256_BYTES],
                                      di_error *err)
{
    if (!dir || !fingerprint)
        return di_fail(err, DI_EINVAL, "directory and output must not be NULL");
    sum_set man = {0};
    uint8_t fp[DI_SHA256_BYTES];
    di_status st = read_manifest(dir, &man, fp, err);
    set_free(&man);
    if (st == DI_OK)
        memcpy(fingerprint, fp, sizeof fp);
    return st;
}
