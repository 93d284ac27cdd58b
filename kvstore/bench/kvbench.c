/* kvbench: stores and reads N KV blocks (114,048 bytes each by default) through di-kvstore and
 * through Redis in the same run, next to a plain memcpy of the same bytes. Started by
 * bench.sh, which runs both servers on loopback. Prints one table: throughput (GB/s, batched)
 * and latency (p50/p99 of single operations) of put and get for each. */
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
#include "kvstore/cli.h"
#include "kvstore/synth.h"

typedef struct bopts {
    const char *store;      /* di-kvstore host:port */
    const char *redis;      /* redis host:port (NULL: skip) */
    uint64_t blocks;        /* objects per run */
    uint64_t bytes;         /* object size */
    uint64_t batch;         /* objects per batch / pipeline depth */
    uint64_t latency_ops;   /* single operations timed for p50/p99 */
    uint64_t threads;       /* client threads for the multi-threaded get row */
} bopts;

#define B(f) offsetof(bopts, f)
static const kvcli_opt rows[] = {
    {"store", KVCLI_STRING, B(store), "127.0.0.1:9470", 0, 0, "HOST:PORT", "di-kvstore"},
    {"redis", KVCLI_STRING, B(redis), NULL, 0, 0, "HOST:PORT", "redis-server (none: skip)"},
    {"blocks", KVCLI_UINT, B(blocks), "10000", 1, 1e7, "N", "objects written and read"},
    {"bytes", KVCLI_SIZE, B(bytes), "114048", 256, 1 << 24, "SIZE", "object size"},
    {"batch", KVCLI_UINT, B(batch), "256", 1, 1024, "N", "objects per batch / pipeline"},
    {"latency-ops", KVCLI_UINT, B(latency_ops), "1000", 10, 1e6, "N", "single ops timed"},
    {"threads", KVCLI_UINT, B(threads), "2", 1, 8, "N",
     "threads of the multi-threaded get and memcpy rows"},
};

/* One line of the result table. */
typedef struct result {
    int threads;                              /* client threads */
    double put_gbs, get_gbs;                  /* batched throughput */
    double put_p50, put_p99, get_p50, get_p99; /* single-op latency (us) */
} result;

static double now_s(void)
{
    return (double)di_mono_ns() / 1e9;
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static void percentiles(double *us, size_t n, double *p50, double *p99)
{
    qsort(us, n, sizeof(double), cmp_double);
    *p50 = us[n / 2];
    *p99 = us[(size_t)((double)n * 0.99)];
}

static void die(const char *what, const char *msg)
{
    fprintf(stderr, "kvbench: %s: %s\n", what, msg);
    exit(1);
}

/* ---------------------------------------------------------------- memcpy */

/* One thread's share of the memcpy baseline. */
typedef struct copy_part {
    uint8_t *dst;
    const uint8_t *src;
    uint64_t first, n, bytes;
} copy_part;

static void *copy_main(void *arg)
{
    copy_part *c = arg;
    for (uint64_t i = c->first; i < c->first + c->n; i++)
        memcpy(c->dst + i * c->bytes, c->src + i * c->bytes, c->bytes);
    return NULL;
}

/* Best of three: the same objects copied buffer to buffer by `threads` threads. */
static double memcpy_gbs(uint8_t *dst, const uint8_t *src, const bopts *o, int threads)
{
    double best = 0;
    for (int r = 0; r < 3; r++) {
        pthread_t t[8];
        copy_part parts[8];
        double t0 = now_s();
        for (int k = 0; k < threads; k++) {
            uint64_t per = o->blocks / (uint64_t)threads;
            parts[k] = (copy_part){dst, src, per * (uint64_t)k,
                                   k == threads - 1 ? o->blocks - per * (uint64_t)k : per, o->bytes};
            pthread_create(&t[k], NULL, copy_main, &parts[k]);
        }
        for (int k = 0; k < threads; k++)
            pthread_join(t[k], NULL);
        double gbs = (double)(o->blocks * o->bytes) / (now_s() - t0) / 1e9;
        if (gbs > best)
            best = gbs;
    }
    return best;
}

/* ---------------------------------------------------------------- di-kvstore */

static void store_batch(kvc_client *c, int get, kvkey *keys, uint8_t *buf, uint64_t first,
                        uint64_t n, const bopts *o)
{
    kvc_item items[1024];
    for (uint64_t j = 0; j < n; j++)
        items[j] = (kvc_item){.cls = KVKEY_BLOCK, .key = keys[first + j],
                              .buf = buf + (first + j) * o->bytes, .cap = o->bytes};
    di_error e;
    di_status st = get ? kvc_get(c, items, n, &e) : kvc_put(c, items, n, &e);
    if (st != DI_OK)
        die(get ? "store get" : "store put", e.msg);
    for (uint64_t j = 0; j < n; j++)
        if (items[j].status != DI_OK && !(items[j].status == DI_EEXIST && !get))
            die(get ? "store get item" : "store put item", items[j].error.msg);
}

static kvc_client *store_client(const bopts *o, int threads)
{
    kvc_options co;
    kvc_options_default(&co);
    co.target = o->store;
    co.verify_threads = threads - 1;
    co.deadline_ms = 60000;
    kvc_client *c;
    di_error e;
    if (kvc_open(&co, &c, &e) != DI_OK)
        die("store", e.msg);
    kvc_store_info info;
    if (kvc_info(c, &info, &e) != DI_OK)
        die("store", e.msg);
    return c;
}

/* Writes every object (batched, then single puts for latency) with `threads` threads. */
static void store_puts(const bopts *o, kvkey *keys, uint8_t *src, result *r)
{
    kvc_client *c = store_client(o, r->threads);
    uint64_t lat = o->latency_ops < o->blocks ? o->latency_ops : o->blocks;
    double t = now_s();
    for (uint64_t i = lat; i < o->blocks; i += o->batch)
        store_batch(c, 0, keys, src, i, o->blocks - i < o->batch ? o->blocks - i : o->batch, o);
    r->put_gbs = (double)((o->blocks - lat) * o->bytes) / (now_s() - t) / 1e9;
    double *us = malloc(lat * sizeof(double));
    for (uint64_t i = 0; i < lat; i++) {
        t = now_s();
        store_batch(c, 0, keys, src, i, 1, o);
        us[i] = (now_s() - t) * 1e6;
    }
    percentiles(us, lat, &r->put_p50, &r->put_p99);
    free(us);
    kvc_close(c);
}

/* After the puts RocksDB flushes and compacts in the background; on two cores that would
 * share the CPU with the timed reads. A compaction through the admin API finishes that work
 * first (the store runs without tokens here). */
static void settle(const bopts *o)
{
    kvc_client *c = store_client(o, 1);
    uint8_t *rep = NULL;
    size_t len = 0;
    di_error e;
    fprintf(stderr, "kvbench: compacting the store before the reads...\n");
    if (kvc_call(c, "Compact", NULL, 0, &rep, &len, &e) != DI_OK)
        die("store compact", e.msg);
    free(rep);
    kvc_close(c);
}

/* Reads every object back (batched, checked against src), then single gets for latency. */
static void store_gets(const bopts *o, kvkey *keys, const uint8_t *src, uint8_t *dst, result *r)
{
    kvc_client *c = store_client(o, r->threads);
    uint64_t lat = o->latency_ops < o->blocks ? o->latency_ops : o->blocks;
    /* An untimed pass first: a new client maps the store's arena and takes one page fault per
     * page on its first read, once per process lifetime. */
    for (uint64_t i = 0; i < o->blocks; i += o->batch)
        store_batch(c, 1, keys, dst, i, o->blocks - i < o->batch ? o->blocks - i : o->batch, o);
    memset(dst, 0, o->blocks * o->bytes);
    double t = now_s();
    for (uint64_t i = 0; i < o->blocks; i += o->batch)
        store_batch(c, 1, keys, dst, i, o->blocks - i < o->batch ? o->blocks - i : o->batch, o);
    r->get_gbs = (double)(o->blocks * o->bytes) / (now_s() - t) / 1e9;
    if (memcmp(src, dst, o->blocks * o->bytes) != 0)
        die("store", "bytes read back differ from the bytes written");
    double *us = malloc(lat * sizeof(double));
    for (uint64_t i = 0; i < lat; i++) {
        uint64_t k = (i * 7919) % o->blocks;
        t = now_s();
        store_batch(c, 1, keys, dst, k, 1, o);
        us[i] = (now_s() - t) * 1e6;
    }
    percentiles(us, lat, &r->get_p50, &r->get_p99);
    free(us);
    kvc_close(c);
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

static void redis_batch(resp *r, int get, const kvkey *keys, uint8_t *buf, uint64_t first,
                        uint64_t n, const bopts *o)
{
    static char heads[1024][160];
    static struct iovec iov[3072];
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
                               (unsigned long long)o->bytes);
            iov[k++] = (struct iovec){heads[j], (size_t)len};
            iov[k++] = (struct iovec){buf + (first + j) * o->bytes, o->bytes};
            iov[k++] = (struct iovec){(char *)"\r\n", 2};
        }
    }
    write_all(r->fd, iov, k);
    for (uint64_t j = 0; j < n; j++) {
        long len = read_line(r);
        if (get) {
            if (len != (long)o->bytes)
                die("redis get", "unexpected reply length");
            read_bulk(r, buf + (first + j) * o->bytes, len);
        }
    }
}

static void run_redis(const bopts *o, const kvkey *keys, uint8_t *src, uint8_t *dst, result *r)
{
    resp rc;
    resp_connect(&rc, o->redis);
    uint64_t lat = o->latency_ops < o->blocks ? o->latency_ops : o->blocks;
    double t = now_s();
    for (uint64_t i = lat; i < o->blocks; i += o->batch)
        redis_batch(&rc, 0, keys, src, i, o->blocks - i < o->batch ? o->blocks - i : o->batch, o);
    r->put_gbs = (double)((o->blocks - lat) * o->bytes) / (now_s() - t) / 1e9;
    double *us = malloc(lat * sizeof(double));
    for (uint64_t i = 0; i < lat; i++) {
        t = now_s();
        redis_batch(&rc, 0, keys, src, i, 1, o);
        us[i] = (now_s() - t) * 1e6;
    }
    percentiles(us, lat, &r->put_p50, &r->put_p99);
    memset(dst, 0, o->blocks * o->bytes);
    t = now_s();
    for (uint64_t i = 0; i < o->blocks; i += o->batch)
        redis_batch(&rc, 1, keys, dst, i, o->blocks - i < o->batch ? o->blocks - i : o->batch, o);
    r->get_gbs = (double)(o->blocks * o->bytes) / (now_s() - t) / 1e9;
    if (memcmp(src, dst, o->blocks * o->bytes) != 0)
        die("redis", "bytes read back differ from the bytes written");
    for (uint64_t i = 0; i < lat; i++) {
        uint64_t k = (i * 7919) % o->blocks;
        t = now_s();
        redis_batch(&rc, 1, keys, dst, k, 1, o);
        us[i] = (now_s() - t) * 1e6;
    }
    percentiles(us, lat, &r->get_p50, &r->get_p99);
    free(us);
    free(rc.buf);
    close(rc.fd);
}

/* ---------------------------------------------------------------- main */

static void row(const char *name, const result *r, int with_put)
{
    if (with_put)
        printf("%-30s %7d %8.2f %8.2f %9.0f %9.0f %9.0f %9.0f\n", name, r->threads, r->put_gbs,
               r->get_gbs, r->put_p50, r->put_p99, r->get_p50, r->get_p99);
    else
        printf("%-30s %7d %8s %8.2f %9s %9s %9.0f %9.0f\n", name, r->threads, "", r->get_gbs, "",
               "", r->get_p50, r->get_p99);
}

int main(int argc, char **argv)
{
    bopts o;
    memset(&o, 0, sizeof(o));
    di_error e;
    int next, help;
    if (kvcli_defaults(rows, sizeof(rows) / sizeof(rows[0]), &o, &e) ||
        kvcli_parse(rows, sizeof(rows) / sizeof(rows[0]), argc, argv, 1, &o, &next, &help, &e)) {
        fprintf(stderr, "kvbench: %s\n", e.msg);
        return 2;
    }
    if (help || next < argc) {
        printf("usage: kvbench [options] (normally started by kvstore/bench/bench.sh)\n");
        kvcli_print_options(stdout, rows, sizeof(rows) / sizeof(rows[0]));
        return help ? 0 : 2;
    }
    kv_geometry g;
    kv_geometry_v41_flash(5, &g);
    size_t total = o.blocks * o.bytes;
    uint8_t *src = malloc(total), *dst = malloc(total);
    kvkey *keys = malloc(o.blocks * sizeof(*keys));
    if (!src || !dst || !keys)
        die("setup", "out of memory");
    fprintf(stderr, "kvbench: making %llu objects of %llu bytes (%.2f GB)...\n",
            (unsigned long long)o.blocks, (unsigned long long)o.bytes, (double)total / 1e9);
    for (uint64_t i = 0; i < o.blocks; i++) {
        int32_t t[2] = {(int32_t)i, (int32_t)(i >> 31)};
        kvkey_block(NULL, g.model_id, t, 2, &keys[i], NULL);
        kvsynth_object(src + i * o.bytes, o.bytes, KV_BLOCK_MAGIC, &g, &keys[i], i, 128, i * 128);
    }
    memset(dst, 1, total); /* fault the pages in before timing */
    int nt = (int)o.threads;
    double mc1 = memcpy_gbs(dst, src, &o, 1), mcn = memcpy_gbs(dst, src, &o, nt);
    fprintf(stderr, "kvbench: memcpy %.2f GB/s (1 thread), %.2f GB/s (%d); di-kvstore...\n", mc1,
            mcn, nt);
    result s1 = {.threads = 1}, sn = {.threads = nt}, rr = {.threads = 1};
    store_puts(&o, keys, src, &s1);
    settle(&o);
    store_gets(&o, keys, src, dst, &s1);
    store_gets(&o, keys, src, dst, &sn);
    if (o.redis) {
        fprintf(stderr, "kvbench: Redis...\n");
        run_redis(&o, keys, src, dst, &rr);
    }
    printf("\n%llu objects of %llu bytes (%.2f GB); throughput in batches of %llu (Redis: "
           "pipelines of %llu); latency of %llu single operations (us)\n\n",
           (unsigned long long)o.blocks, (unsigned long long)o.bytes, (double)total / 1e9,
           (unsigned long long)o.batch, (unsigned long long)o.batch,
           (unsigned long long)o.latency_ops);
    printf("%-30s %7s %8s %8s %9s %9s %9s %9s\n", "", "threads", "put GB/s", "get GB/s",
           "put p50", "put p99", "get p50", "get p99");
    row("di-kvstore, DRAM tier", &s1, 1);
    row("di-kvstore, DRAM tier", &sn, 0);
    if (o.redis)
        row("redis-server, TCP loopback", &rr, 1);
    printf("%-30s %7d %8s %8.2f\n", "memcpy of the same bytes", 1, "", mc1);
    printf("%-30s %7d %8s %8.2f\n", "memcpy of the same bytes", nt, "", mcn);
    printf("\nget, 1 thread: di-kvstore / Redis = %.2fx (target >= 2x); memcpy / di-kvstore = "
           "%.2fx (target <= 2x)\n",
           o.redis && rr.get_gbs > 0 ? s1.get_gbs / rr.get_gbs : 0.0, mc1 / s1.get_gbs);
    printf("get, %d threads: memcpy / di-kvstore = %.2fx\n", nt, mcn / sn.get_gbs);
    free(src);
    free(dst);
    free(keys);
    return 0;
}
