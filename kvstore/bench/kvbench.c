/* kvbench: di-kvstore against Redis, like for like, next to memcpy, in one run.
 *
 * Every row moves the same objects (114,048-byte KV blocks by default) with 1, 4 and 16
 * client threads, each with its own store client or its own Redis connection: puts and gets
 * of one object per call (store put vs Redis SET, store get vs Redis GET), then batched gets
 * (the store's kvc_get of 64 objects vs Redis GET pipelines of 64). The store rows run once per
 * data path (--paths: UCX with tickets, and the bytes inside gRPC messages). Each put row writes its
 * own fresh keys. Gets are checked against the written bytes. memcpy of the same bytes with
 * the same thread counts is the hardware reference. Started by bench.sh, which runs both
 * servers on loopback with comparable persistence and says which.
 *
 * Redis is spoken to with a small RESP client here (no hiredis), over TCP loopback with
 * TCP_NODELAY; bulk replies are read straight into the destination buffer.
 */
#include <errno.h>
#include <pthread.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>
#include <arpa/inet.h>

#include "common/net/kv_client.h"
#include "common/model/config.h"
#include "common/util/clock.h"
#include "common/util/hostport.h"
#include "common/util/machine.h"
#include "common/util/outclose.h"
#include "common/service/options.h"
#include "kvstore/store.h"
#include "kvstore/synth.h"

#define N_CONC 3
#define MAX_THREADS 16
#define MAX_BATCH 256
static const int conc[N_CONC] = {1, 4, 16};

typedef struct bopts {
    const char *store;      /* di-kvstore host:port */
    const char *redis;      /* redis host:port (NULL: skip) */
    const char *redis_conf; /* how bench.sh configured Redis (printed) */
    const char *store_conf; /* how bench.sh configured the store (printed) */
    uint64_t objects;       /* objects per row */
    uint64_t bytes;         /* object size */
    uint64_t batch;         /* objects per batched get / pipeline depth */
    uint64_t repeat;        /* get rows: best of this many passes */
    const char *core_dir;   /* store core in process (no RPC) in this directory; NULL: skip */
    const char *core_durability; /* its durability */
    const char *paths;      /* "ucx,grpc": the store's data paths to measure */
    kvc_data_path path;     /* the one being measured (not an option) */
    kv_geometry geometry;   /* V4.1-Flash (not an option) */
    kvs_store *core;        /* opened by main when core_dir is set (not an option) */
    uint8_t *arena;         /* its DRAM arena */
} bopts;

#define B(f) offsetof(bopts, f)
static const svc_opt rows[] = {
    {"store", SVC_OPT_STRING, B(store), "127.0.0.1:9470", 0, 0, "HOST:PORT",
     "di-kvstore (none: skip)", NULL},
    {"redis", SVC_OPT_STRING, B(redis), NULL, 0, 0, "HOST:PORT", "redis-server (none: skip)",
     NULL},
    {"redis-conf", SVC_OPT_STRING, B(redis_conf), "unknown", 0, 0, "TEXT",
     "Redis persistence settings, for the report", NULL},
    {"store-conf", SVC_OPT_STRING, B(store_conf), "unknown", 0, 0, "TEXT",
     "store settings, for the report", NULL},
    {"objects", SVC_OPT_UINT, B(objects), "2000", 16, 1e6, "N", "objects per row", NULL},
    {"bytes", SVC_OPT_SIZE, B(bytes), "114048", 256, 1 << 24, "SIZE", "object size", NULL},
    {"batch", SVC_OPT_UINT, B(batch), "64", 2, MAX_BATCH, "N", "objects per batched get", NULL},
    {"repeat", SVC_OPT_UINT, B(repeat), "3", 1, 20, "N", "get rows: best of N passes", NULL},
    {"core-dir", SVC_OPT_STRING, B(core_dir), NULL, 0, 0, "DIR",
     "also time the store core in this process (no gRPC, no UCX), RocksDB in DIR", NULL},
    {"core-durability", SVC_OPT_CHOICE, B(core_durability), "wal", 0, 0, "LEVEL",
     "durability of the in-process store core", "none|wal|fsync"},
    {"paths", SVC_OPT_STRING, B(paths), "ucx,grpc", 0, 0, "LIST",
     "store data paths to measure: ucx, grpc or ucx,grpc", NULL},
};

static double now_s(void)
{
    return (double)di_mono_ns() / 1e9;
}

static void die(const char *what, const char *msg)
{
    fprintf(stderr, "kvbench: %s: %s\n", what, msg);
    exit(1);
}

/* ---------------------------------------------------------------- Redis (RESP) */

typedef struct resp {
    int fd;
    uint8_t *buf; /* read buffer */
    size_t len, pos, cap;
} resp;

static void resp_connect(resp *r, const char *hostport)
{
    char host[128];
    snprintf(host, sizeof(host), "%s", hostport);
    char *colon = strrchr(host, ':');
    if (!colon)
        die("redis", "address must be host:port");
    *colon = '\0';
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)atoi(colon + 1))};
    inet_pton(AF_INET, host, &a.sin_addr);
    r->fd = socket(AF_INET, SOCK_STREAM, 0);
    int one = 1;
    setsockopt(r->fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
    if (connect(r->fd, (struct sockaddr *)&a, sizeof(a)) != 0)
        die("redis connect", strerror(errno));
    r->cap = 1 << 22;
    r->buf = malloc(r->cap);
    r->len = r->pos = 0;
}

static void write_all(int fd, struct iovec *iov, int n)
{
    while (n > 0) {
        ssize_t w = writev(fd, iov, n > 1024 ? 1024 : n);
        if (w < 0)
            die("redis write", strerror(errno));
        while (n > 0 && (size_t)w >= iov->iov_len) {
            w -= (ssize_t)iov->iov_len;
            iov++;
            n--;
        }
        if (n > 0) {
            iov->iov_base = (char *)iov->iov_base + w;
            iov->iov_len -= (size_t)w;
        }
    }
}

/* Makes at least `need` unread bytes available (or the whole buffer). */
static void fill(resp *r, size_t need)
{
    if (r->pos > 0 && r->len - r->pos < need) {
        memmove(r->buf, r->buf + r->pos, r->len - r->pos);
        r->len -= r->pos;
        r->pos = 0;
    }
    while (r->len - r->pos < need && r->len < r->cap) {
        ssize_t n = read(r->fd, r->buf + r->len, r->cap - r->len);
        if (n <= 0)
            die("redis read", n ? strerror(errno) : "connection closed");
        r->len += (size_t)n;
    }
}

/* Reads one reply line "+OK" or "$<n>"; returns n for bulk replies, -1 for +OK. */
static long read_line(resp *r)
{
    for (;;) {
        uint8_t *nl = memchr(r->buf + r->pos, '\n', r->len - r->pos);
        if (nl) {
            char c = (char)r->buf[r->pos];
            long v = c == '$' ? strtol((char *)r->buf + r->pos + 1, NULL, 10) : -1;
            if (c == '-')
                die("redis", "error reply");
            r->pos = (size_t)(nl - r->buf) + 1;
            return v;
        }
        fill(r, r->len - r->pos + 1);
    }
}

/* Copies a bulk reply of n bytes (+CRLF) into dst: what is buffered, then the rest straight
 * from the socket (no second copy, to be fair to Redis). */
static void read_bulk(resp *r, uint8_t *dst, long n)
{
    size_t left = (size_t)n;
    size_t take = r->len - r->pos < left ? r->len - r->pos : left;
    memcpy(dst, r->buf + r->pos, take);
    dst += take;
    r->pos += take;
    left -= take;
    while (left > 0) {
        ssize_t k = read(r->fd, dst, left);
        if (k <= 0)
            die("redis read", k ? strerror(errno) : "connection closed");
        dst += k;
        left -= (size_t)k;
    }
    fill(r, 2);
    r->pos += 2;
}


static void redis_cmd(resp *r, int get, const kvkey *keys, uint8_t *buf, uint64_t first,
                      uint64_t n, uint64_t bytes)
{
    char heads[MAX_BATCH][160];
    struct iovec iov[3 * MAX_BATCH];
    int k = 0;
    for (uint64_t j = 0; j < n; j++) {
        char hex[65];
        kvkey_hex(&keys[first + j], hex);
        if (get) {
            int len = snprintf(heads[j], sizeof(heads[j]), "*2\r\n$3\r\nGET\r\n$64\r\n%s\r\n", hex);
            iov[k++] = (struct iovec){heads[j], (size_t)len};
        } else {
            int len = snprintf(heads[j], sizeof(heads[j]),
                               "*3\r\n$3\r\nSET\r\n$64\r\n%s\r\n$%llu\r\n", hex,
                               (unsigned long long)bytes);
            iov[k++] = (struct iovec){heads[j], (size_t)len};
            iov[k++] = (struct iovec){buf + (first + j) * bytes, bytes};
            iov[k++] = (struct iovec){(char *)"\r\n", 2};
        }
    }
    write_all(r->fd, iov, k);
    for (uint64_t j = 0; j < n; j++) {
        long len = read_line(r);
        if (get) {
            if (len != (long)bytes)
                die("redis get", "unexpected reply length");
            read_bulk(r, buf + (first + j) * bytes, len);
        }
    }
}

/* ---------------------------------------------------------------- rows */

typedef enum op_kind { OP_PUT, OP_GET } op_kind;
typedef enum target { T_STORE, T_REDIS, T_MEMCPY, T_CORE } target;

/* What one thread of a row does: objects [first, first + n) of keys/src, `per_call` at a
 * time, through its own client or connection. */
typedef struct worker {
    const bopts *o;
    target tgt;
    op_kind op;
    uint64_t per_call;
    const kvkey *keys;
    uint8_t *src, *dst;
    uint64_t first, n;
    kvc_client *client;      /* T_STORE */
    resp conn;               /* T_REDIS */
    kvs_store *core;         /* T_CORE: the in-process store */
    uint8_t *arena;          /* T_CORE: its DRAM arena */
    pthread_barrier_t *go;   /* all threads start together */
} worker;

/* The store core without the network: alloc, copy into the slot, commit; lease, copy with
 * verification, release. What a put or get costs the store itself. */
static void core_call(worker *w, op_kind op, uint64_t i)
{
    uint64_t bytes = w->o->bytes;
    const kvkey *k = &w->keys[i];
    di_error e;
    if (op == OP_PUT) {
        uint64_t id, off;
        if (kvs_alloc(w->core, KVKEY_BLOCK, k, bytes, &id, &off, &e) != DI_OK)
            die("core alloc", e.msg);
        memcpy(w->arena + off, w->src + i * bytes, bytes);
        di_status st;
        kvs_commit(w->core, &id, 1, &st, &e);
        if (st != DI_OK)
            die("core commit", e.msg);
        return;
    }
    kvs_lease_info li;
    if (kvs_lease(w->core, KVKEY_BLOCK, k, 10000, UINT64_MAX, &li, &e) != DI_OK)
        die("core lease", e.msg);
    if (kvkey_object_copy_verify(KVKEY_BLOCK, k, w->dst + i * bytes, w->arena + li.offset, bytes,
                                 &w->o->geometry, &e) != DI_OK)
        die("core get", e.msg);
    if (kvs_release(w->core, li.lease_id, &e) != DI_OK)
        die("core release", e.msg);
}

static kvc_client *store_client(const bopts *o)
{
    kvc_options co;
    kvc_options_default(&co);
    co.target = o->store;
    co.verify_threads = 0; /* one thread per client: the thread copies and verifies */
    co.deadline_ms = 60000;
    co.data_path = o->path;
    kvc_client *c;
    di_error e;
    if (kvc_open(&co, &c, &e) != DI_OK)
        die("store", e.msg);
    kvc_store_info info;
    if (kvc_info(c, &info, &e) != DI_OK)
        die("store", e.msg);
    if (info.path != o->path)
        die("store", "the client did not take the data path asked for");
    return c;
}

static void store_call(kvc_client *c, op_kind op, const kvkey *keys, uint8_t *buf,
                       uint64_t first, uint64_t n, uint64_t bytes)
{
    kvc_item items[MAX_BATCH];
    for (uint64_t j = 0; j < n; j++)
        items[j] = (kvc_item){.cls = KVKEY_BLOCK, .key = keys[first + j],
                              .buf = buf + (first + j) * bytes, .cap = bytes};
    di_error e;
    di_status st = op == OP_GET ? kvc_get(c, items, n, &e) : kvc_put(c, items, n, &e);
    if (st != DI_OK)
        die(op == OP_GET ? "store get" : "store put", e.msg);
    for (uint64_t j = 0; j < n; j++)
        if (items[j].status != DI_OK)
            die(op == OP_GET ? "store get item" : "store put item", items[j].error.msg);
}

static void *worker_main(void *arg)
{
    worker *w = arg;
    uint64_t bytes = w->o->bytes;
    pthread_barrier_wait(w->go);
    for (uint64_t i = w->first; i < w->first + w->n; i += w->per_call) {
        uint64_t k = w->first + w->n - i < w->per_call ? w->first + w->n - i : w->per_call;
        uint8_t *buf = w->op == OP_PUT ? w->src : w->dst;
        if (w->tgt == T_STORE)
            store_call(w->client, w->op, w->keys, buf, i, k, bytes);
        else if (w->tgt == T_REDIS)
            redis_cmd(&w->conn, w->op == OP_GET, w->keys, buf, i, k, bytes);
        else if (w->tgt == T_CORE)
            core_call(w, w->op, i);
        else
            memcpy(w->dst + i * bytes, w->src + i * bytes, k * bytes);
    }
    return NULL;
}

/* Runs one row at `threads` threads; returns GB/s (wall time from the common start to the
 * last thread's end). Clients and connections are opened before the clock starts. */
static double run_row(const bopts *o, target tgt, op_kind op, int threads, uint64_t per_call,
                      const kvkey *keys, uint8_t *src, uint8_t *dst)
{
    worker w[MAX_THREADS];
    pthread_t t[MAX_THREADS];
    pthread_barrier_t go;
    pthread_barrier_init(&go, NULL, (unsigned)threads + 1);
    uint64_t per = o->objects / (uint64_t)threads;
    for (int k = 0; k < threads; k++) {
        w[k] = (worker){.o = o, .tgt = tgt, .op = op, .per_call = per_call, .keys = keys,
                        .src = src, .dst = dst, .first = per * (uint64_t)k,
                        .n = k == threads - 1 ? o->objects - per * (uint64_t)k : per, .go = &go,
                        .core = o->core, .arena = o->arena};
        if (tgt == T_STORE)
            w[k].client = store_client(o);
        else if (tgt == T_REDIS)
            resp_connect(&w[k].conn, o->redis);
        pthread_create(&t[k], NULL, worker_main, &w[k]);
    }
    pthread_barrier_wait(&go);
    double t0 = now_s();
    for (int k = 0; k < threads; k++)
        pthread_join(t[k], NULL);
    double secs = now_s() - t0;
    for (int k = 0; k < threads; k++) {
        if (tgt == T_STORE)
            kvc_close(w[k].client);
        else if (tgt == T_REDIS) {
            free(w[k].conn.buf);
            close(w[k].conn.fd);
        }
    }
    pthread_barrier_destroy(&go);
    return (double)(o->objects * o->bytes) / secs / 1e9;
}

/* Best of o->repeat passes of a get row, each checked against src. */
static double get_row(const bopts *o, target tgt, int threads, uint64_t per_call,
                      const kvkey *keys, const uint8_t *src, uint8_t *dst)
{
    double best = 0;
    for (uint64_t r = 0; r < o->repeat; r++) {
        memset(dst, 0, o->objects * o->bytes);
        double g = run_row(o, tgt, OP_GET, threads, per_call, keys, (uint8_t *)src, dst);
        if (tgt != T_MEMCPY && memcmp(src, dst, o->objects * o->bytes) != 0)
            die(tgt == T_REDIS ? "redis" : "store", "bytes read back differ from those written");
        best = g > best ? g : best;
    }
    return best;
}

/* ---------------------------------------------------------------- main */

enum { R_REDIS_SET, R_REDIS_GET, R_REDIS_PIPE, R_MEMCPY, R_CORE_PUT, R_CORE_GET, N_ROWS };
/* The store rows per data path: put, get, batched get. */
enum { S_PUT, S_GET, S_BATCH, N_SROWS };
#define N_PATHS 2
static const kvc_data_path path_of[N_PATHS] = {KVC_PATH_UCX, KVC_PATH_GRPC};
static const char *const path_label[N_PATHS] = {"UCX", "gRPC"};

/* Opens the store core in process with room for every object of a row in DRAM. */
static void open_core(bopts *o, const kv_geometry *g)
{
    uint64_t slot = (o->bytes + 63) / 64 * 64;
    uint64_t arena_bytes = (o->objects + 64) * slot * 100 / 96 + (64 << 20);
    o->arena = aligned_alloc(4096, arena_bytes);
    int dur = kvdisk_durability_parse(o->core_durability);
    if (!o->arena || dur < 0)
        die("core", !o->arena ? "out of memory" : "--core-durability must be none, wal or fsync");
    kvs_config cfg = {.arena = o->arena, .arena_bytes = arena_bytes,
                      .dram_share = {0.96, 0.02, 0.02}, .geometry = *g,
                      .object_bytes = {o->bytes, 1501184, 1501184 + o->bytes},
                      .disk = {.dir = o->core_dir, .durability = dur},
                      .disk_capacity = 1ull << 40, .ttl_ms = {0, 0, 60000},
                      .alloc_timeout_ms = 60000, .lease_max_ms = 60000, .max_leases = 4096,
                      .max_objects = 1u << 22};
    di_error e;
    if (kvs_open(&cfg, &o->core, &e) != DI_OK)
        die("core open", e.msg);
}

static void print_row(const char *name, const double *v)
{
    printf("%-36s", name);
    for (int c = 0; c < N_CONC; c++)
        printf(" %10.2f", v[c]);
    printf("\n");
}

static double max3(const double *v)
{
    double m = v[0];
    for (int c = 1; c < N_CONC; c++)
        m = v[c] > m ? v[c] : m;
    return m;
}

static int verdict(const char *what, double got, double want)
{
    int ok = got >= want;
    printf("  %-62s %8.2f vs %8.2f GB/s  %s\n", what, got, want, ok ? "met" : "MISSED");
    return ok;
}

/* Prints the targets of one data path (its store rows sv against Redis and memcpy in v);
 * returns how many were met and adds how many there are to *all. */
static int path_targets(const char *label, double sv[N_SROWS][N_CONC], double v[N_ROWS][N_CONC],
                        double redis_best, int *all)
{
    int met = 0;
    char what[96];
    printf("\ntargets, %s data path\n", label);
    for (int c = 0; c < N_CONC; c++) {
        const char *pl = conc[c] > 1 ? "s" : "";
        snprintf(what, sizeof(what), "put >= Redis SET, %d thread%s", conc[c], pl);
        met += verdict(what, sv[S_PUT][c], v[R_REDIS_SET][c]);
        snprintf(what, sizeof(what), "get >= Redis GET, %d thread%s", conc[c], pl);
        met += verdict(what, sv[S_GET][c], v[R_REDIS_GET][c]);
    }
    met += verdict("best batched get >= 2x Redis's best get", max3(sv[S_BATCH]), 2 * redis_best);
    int at = 0;
    for (int c = 1; c < N_CONC; c++)
        if (sv[S_BATCH][c] / v[R_MEMCPY][c] > sv[S_BATCH][at] / v[R_MEMCPY][at])
            at = c;
    snprintf(what, sizeof(what), "batched get >= 50%% of memcpy, %d thread%s", conc[at],
             conc[at] > 1 ? "s" : "");
    met += verdict(what, sv[S_BATCH][at], 0.5 * v[R_MEMCPY][at]);
    *all += 2 * N_CONC + 2;
    return met;
}

int main(int argc, char **argv)
{
    bopts o;
    memset(&o, 0, sizeof(o));
    di_error e;
    int next, help;
    if (svc_opts_defaults(rows, sizeof(rows) / sizeof(rows[0]), &o, &e) ||
        svc_opts_parse(rows, sizeof(rows) / sizeof(rows[0]), argc, argv, 1, &o, &next, &help, &e)) {
        fprintf(stderr, "kvbench: %s\n", e.msg);
        return 2;
    }
    if (o.store && strcmp(o.store, "none") == 0)
        o.store = NULL;
    if (o.redis && strcmp(o.redis, "none") == 0)
        o.redis = NULL;
    const char *addrs[2][2] = {{"--store", o.store}, {"--redis", o.redis}};
    for (int i = 0; i < 2; i++) {
        di_hostport hp;
        if (addrs[i][1] && di_hostport_parse(addrs[i][1], false, &hp, &e) != DI_OK) {
            fprintf(stderr, "kvbench: %s: %s\n", addrs[i][0], e.msg);
            return 2;
        }
    }
    if (help || next < argc) {
        FILE *f = help ? stdout : stderr;
        fprintf(f, "usage: kvbench [options] (normally started by kvstore/bench/bench.sh)\n");
        svc_opts_print(f, rows, sizeof(rows) / sizeof(rows[0]));
        return help ? di_close_stdout("kvbench", 0) : 2;
    }
    /* Two copies of every object (source and destination) are held in memory. */
    if (di_machine_check_memory("--objects x --bytes x 2", 2 * o.objects * o.bytes, &e) != DI_OK) {
        fprintf(stderr, "kvbench: %s\n", e.msg);
        return 2;
    }
    kv_geometry_v41_flash(5, &o.geometry);
    const kv_geometry g = o.geometry;
    size_t total = o.objects * o.bytes;
    uint8_t *src = malloc(total), *dst = malloc(total);
    /* One key set per put row (each writes fresh keys); gets read the last one. */
    kvkey *keys = malloc(N_CONC * o.objects * sizeof(*keys));
    if (!src || !dst || !keys)
        die("setup", "out of memory");
    fprintf(stderr, "kvbench: making %llu objects of %llu bytes (%.2f GB)...\n",
            (unsigned long long)o.objects, (unsigned long long)o.bytes, (double)total / 1e9);
    for (uint64_t s = 0; s < N_CONC; s++)
        for (uint64_t i = 0; i < o.objects; i++) {
            int32_t t[3] = {(int32_t)i, (int32_t)s, 0x6b76};
            kvkey_block(NULL, g.model_id, t, 3, &keys[s * o.objects + i], NULL);
        }
    memset(dst, 1, total); /* fault the pages in before timing */
    if (o.core_dir)
        open_core(&o, &g);
    int use[N_PATHS] = {strstr(o.paths, "ucx") != NULL, strstr(o.paths, "grpc") != NULL};
    if (!use[0] && !use[1]) {
        fprintf(stderr, "kvbench: --paths: ucx, grpc or ucx,grpc\n");
        return 2;
    }
    double v[N_ROWS][N_CONC] = {{0}}, sv[N_PATHS][N_SROWS][N_CONC] = {{{0}}};
    for (int c = 0; c < N_CONC; c++) {
        const kvkey *ks = keys + (size_t)c * o.objects;
        /* The payload depends on the key, so each key set has its own bytes. */
        for (uint64_t i = 0; i < o.objects; i++)
            kvsynth_object(src + i * o.bytes, o.bytes, KV_BLOCK_MAGIC, &g, &ks[i], i, 128,
                           i * 128);
        fprintf(stderr, "kvbench: puts, %d threads...\n", conc[c]);
        /* Each path writes half of the key set (fresh keys for both). */
        for (int p = 0; o.store && p < N_PATHS; p++)
            if (use[p]) {
                uint64_t half = o.objects / 2, first = p * half, n = p ? o.objects - half : half;
                bopts op = o;
                op.path = path_of[p];
                op.objects = use[!p] ? n : o.objects;
                uint64_t at = use[!p] ? first : 0;
                sv[p][S_PUT][c] = run_row(&op, T_STORE, OP_PUT, conc[c], 1, ks + at,
                                          src + at * o.bytes, dst + at * o.bytes);
            }
        if (o.redis)
            v[R_REDIS_SET][c] = run_row(&o, T_REDIS, OP_PUT, conc[c], 1, ks, src, dst);
        if (o.core)
            v[R_CORE_PUT][c] = run_row(&o, T_CORE, OP_PUT, conc[c], 1, ks, src, dst);
    }
    const kvkey *ks = keys + (size_t)(N_CONC - 1) * o.objects; /* src holds this set now */
    /* One untimed pass: a new process maps the store's arena and takes its page faults once. */
    bopts po[N_PATHS] = {o, o};
    for (int p = 0; p < N_PATHS; p++)
        po[p].path = path_of[p];
    for (int p = 0; o.store && p < N_PATHS; p++)
        if (use[p])
            get_row(&po[p], T_STORE, 1, o.batch, ks, src, dst);
    for (int c = 0; c < N_CONC; c++) {
        fprintf(stderr, "kvbench: gets, %d threads...\n", conc[c]);
        for (int p = 0; o.store && p < N_PATHS; p++)
            if (use[p]) {
                sv[p][S_GET][c] = get_row(&po[p], T_STORE, conc[c], 1, ks, src, dst);
                sv[p][S_BATCH][c] = get_row(&po[p], T_STORE, conc[c], o.batch, ks, src, dst);
            }
        if (o.redis) {
            v[R_REDIS_GET][c] = get_row(&o, T_REDIS, conc[c], 1, ks, src, dst);
            v[R_REDIS_PIPE][c] = get_row(&o, T_REDIS, conc[c], o.batch, ks, src, dst);
        }
        v[R_MEMCPY][c] = get_row(&o, T_MEMCPY, conc[c], o.objects, ks, src, dst);
        if (o.core)
            v[R_CORE_GET][c] = get_row(&o, T_CORE, conc[c], 1, ks, src, dst);
    }
    long cores = sysconf(_SC_NPROCESSORS_ONLN);
    printf("\n%llu objects of %llu bytes per row (%.2f GB); one store client or Redis connection "
           "per thread; %ld CPU cores\n",
           (unsigned long long)o.objects, (unsigned long long)o.bytes, (double)total / 1e9,
           cores);
    printf("store: %s\nRedis: %s\n", o.store_conf, o.redis ? o.redis_conf : "not run");
    printf("Redis client: RESP written in kvbench over TCP loopback (no hiredis, no "
           "redis-benchmark); gets: best of %llu passes, every pass checked byte for byte\n\n",
           (unsigned long long)o.repeat);
    printf("%-36s %10s %10s %10s\n", "GB/s", "1 thread", "4 threads", "16 threads");
    char name[64];
    for (int p = 0; p < N_PATHS; p++)
        if (use[p]) {
            snprintf(name, sizeof(name), "store put (%s), 1 object per call", path_label[p]);
            print_row(name, sv[p][S_PUT]);
        }
    print_row("Redis SET, 1 per call", v[R_REDIS_SET]);
    for (int p = 0; p < N_PATHS; p++)
        if (use[p]) {
            snprintf(name, sizeof(name), "store get (%s), 1 object per call", path_label[p]);
            print_row(name, sv[p][S_GET]);
        }
    print_row("Redis GET, 1 per call", v[R_REDIS_GET]);
    for (int p = 0; p < N_PATHS; p++)
        if (use[p]) {
            snprintf(name, sizeof(name), "store get (%s), %llu per call", path_label[p],
                     (unsigned long long)o.batch);
            print_row(name, sv[p][S_BATCH]);
        }
    snprintf(name, sizeof(name), "Redis GET, pipelines of %llu", (unsigned long long)o.batch);
    print_row(name, v[R_REDIS_PIPE]);
    print_row("memcpy of the same bytes", v[R_MEMCPY]);
    if (o.core) {
        printf("store core in this process (no gRPC, no UCX; --durability %s):\n",
               o.core_durability);
        print_row("  put: alloc, copy, verify, RocksDB", v[R_CORE_PUT]);
        print_row("  get: lease, copy and verify, release", v[R_CORE_GET]);
    }
    if (!o.redis || !o.store) {
        printf("\n(targets need the store and Redis)\n");
    } else {
        double redis_best = max3(v[R_REDIS_GET]) > max3(v[R_REDIS_PIPE]) ? max3(v[R_REDIS_GET])
                                                                        : max3(v[R_REDIS_PIPE]);
        int met = 0, all = 0;
        for (int p = 0; p < N_PATHS; p++)
            if (use[p])
                met += path_targets(path_label[p], sv[p], v, redis_best, &all);
        printf("%d of %d targets met\n", met, all);
    }
    kvs_close(o.core);
    free(o.arena);
    free(src);
    free(dst);
    free(keys);
    return di_close_stdout("kvbench", 0);
}
