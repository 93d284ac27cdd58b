/* di-kvstore: the shared KV store service (DESIGN.md §5, §7). See --help and docs/kvstore.md. */
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <arpa/inet.h>
#include <dirent.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <netinet/in.h>
#include <sys/mman.h>
#include <sys/random.h>
#include <unistd.h>

#include "common/model/config.h"
#include "common/model/shard_sums.h"
#include "common/net/kv_client.h"
#include "common/net/rpc.h"
#include "common/util/clock.h"
#include "common/net/ucx_xport.h"
#include "common/util/hostport.h"
#include "common/util/machine.h"
#include "common/util/outclose.h"
#include "kvstore/cli.h"
#include "kvstore/service.h"
#include "kvstore/store.h"

/* Everything the command line sets. */
typedef struct options {
    const char *listen;          /* gRPC address */
    const char *dir;             /* RocksDB directory */
    const char *durability;      /* none | wal | fsync */
    uint64_t dram_bytes;         /* DRAM tier arena and initial capacity */
    uint64_t disk_bytes;         /* disk tier capacity (object bytes) */
    double window_share;         /* DRAM fraction for window states */
    double handoff_share;        /* DRAM fraction for handoffs */
    const char *geometry;        /* named geometry */
    const char *model_config;    /* model config file (not in this build) */
    const char *model_dir;       /* checkpoint: config.json and checksum manifest */
    const char *yoco;            /* YOCO mode of the engines (part of the KV id) */
    uint64_t nextn;              /* drafts per step: sets the ring size of window states */
    uint64_t block_bytes;        /* override; 0 = from the geometry */
    uint64_t window_bytes;       /* override; 0 = from the geometry */
    uint64_t handoff_max_bytes;  /* 0 = block + window */
    uint64_t ttl_block_ms;
    uint64_t ttl_window_ms;
    uint64_t ttl_handoff_ms;
    uint64_t lease_ms;           /* default lease */
    uint64_t lease_max_ms;
    uint64_t alloc_timeout_ms;
    uint64_t max_leases;
    uint64_t max_objects;
    const char *token_file;
    const char *admin_token_file;
    const char *tls_cert;
    const char *tls_key;
    const char *tls_client_ca;
    uint64_t threads;
    const char *port_file;
    int64_t ready_fd;
    const char *log_level;
    const char *rocksdb_log_dir;
    uint64_t memtable_bytes;
    const char *data_path;       /* both | ucx | grpc */
} options;

#define O(f) offsetof(options, f)
/* name, kind, offset, default, min, max, metavar, help */
static const kvcli_opt option_rows[] = {
    {"listen", KVCLI_LISTEN, O(listen), "127.0.0.1:9470", 0, 0, "HOST:PORT",
     "gRPC address, port 1..65535 (0 picks a free one; see --port-file)"},
    {"dir", KVCLI_STRING, O(dir), "./kvstore-data", 0, 0, "PATH", "RocksDB directory"},
    {"durability", KVCLI_STRING, O(durability), "wal", 0, 0, "LEVEL",
     "none | wal | fsync: when a commit is acknowledged (below)"},
    {"dram-bytes", KVCLI_SIZE, O(dram_bytes), "1GiB", 1 << 20, 0, "SIZE",
     "DRAM tier: the store's private arena, also its capacity (capacity set can lower it); "
     "at most the physical memory, with the memtables and the index"},
    {"disk-bytes", KVCLI_SIZE, O(disk_bytes), "64GiB", 4096, 0, "SIZE",
     "disk tier capacity in object bytes (a warning when above the free space of --dir)"},
    {"dram-window-share", KVCLI_DOUBLE, O(window_share), "0.25", 0.001, 0.9, "F",
     "fraction of the DRAM tier for window states"},
    {"dram-handoff-share", KVCLI_DOUBLE, O(handoff_share), "0.05", 0.001, 0.9, "F",
     "fraction of the DRAM tier for handoffs (blocks get the rest)"},
    {"geometry", KVCLI_STRING, O(geometry), "v41-flash", 0, 0, "NAME",
     "KV geometry and model id of a shipped model config (v41-flash, tiny, ...)"},
    {"model-config", KVCLI_STRING, O(model_config), NULL, 0, 0, "FILE",
     "take the KV geometry and a config-only model id from this config.json (or its directory)"},
    {"model", KVCLI_STRING, O(model_dir), NULL, 0, 0, "DIR",
     "the checkpoint the engines load: KV geometry and model id (config and weights) from its "
     "config.json and checksum manifest (no shard is read); engines connect only to a store "
     "started this way, as --geometry and --model-config ids cover no weights"},
    {"yoco", KVCLI_STRING, O(yoco), "compact", 0, 0, "MODE",
     "YOCO mode of the engines, part of the KV id: compact (every engine's default) or mask"},
    {"nextn", KVCLI_UINT, O(nextn), "5", 0, 16, "N", "drafts per step (ring size of windows)"},
    {"block-bytes", KVCLI_SIZE, O(block_bytes), NULL, 0, 0, "N",
     "override the block object size (small test configs)"},
    {"window-bytes", KVCLI_SIZE, O(window_bytes), NULL, 0, 0, "N",
     "override the window-state object size"},
    {"handoff-max-bytes", KVCLI_SIZE, O(handoff_max_bytes), NULL, 0, 0, "N",
     "largest handoff object [block + window]"},
    {"ttl-block", KVCLI_DURATION, O(ttl_block_ms), "3d", 0, 0, "DUR",
     "cache TTL of blocks, refreshed on every hit (0 = never)"},
    {"ttl-window", KVCLI_DURATION, O(ttl_window_ms), "3d", 0, 0, "DUR",
     "cache TTL of window states"},
    {"ttl-handoff", KVCLI_DURATION, O(ttl_handoff_ms), "60s", 0, 0, "DUR", "TTL of handoffs"},
    {"lease", KVCLI_DURATION, O(lease_ms), "10s", 1, 86400000, "DUR",
     "lease given when a client asks for none (at most 1d)"},
    {"lease-max", KVCLI_DURATION, O(lease_max_ms), "60s", 1, 86400000, "DUR",
     "longest lease (at most 1d); a lease whose client died ends after it"},
    {"alloc-timeout", KVCLI_DURATION, O(alloc_timeout_ms), "30s", 1, 0, "DUR",
     "an allocation not committed by then is reclaimed"},
    {"max-leases", KVCLI_UINT, O(max_leases), "65536", 16, 16777216, "N", "lease records"},
    {"max-objects", KVCLI_UINT, O(max_objects), "4000000", 16, 4e9, "N",
     "objects in the index (about 200 bytes of memory each)"},
    {"token-file", KVCLI_STRING, O(token_file), NULL, 0, 0, "FILE",
     "engine token (or $DI_KVSTORE_TOKEN); without one: loopback only"},
    {"admin-token-file", KVCLI_STRING, O(admin_token_file), NULL, 0, 0, "FILE",
     "admin token for di-kvctl (or $DI_KVSTORE_ADMIN_TOKEN)"},
    {"tls-cert", KVCLI_STRING, O(tls_cert), NULL, 0, 0, "FILE", "TLS certificate chain (PEM)"},
    {"tls-key", KVCLI_STRING, O(tls_key), NULL, 0, 0, "FILE", "TLS private key (PEM)"},
    {"tls-client-ca", KVCLI_STRING, O(tls_client_ca), NULL, 0, 0, "FILE",
     "require client certificates signed by this CA"},
    {"threads", KVCLI_UINT, O(threads), "4", 1, 64, "N", "gRPC worker threads"},
    {"port-file", KVCLI_STRING, O(port_file), NULL, 0, 0, "FILE",
     "write the bound port here once serving"},
    {"ready-fd", KVCLI_INT, O(ready_fd), "-1", -1, 1 << 20, "FD",
     "write the bound port and a newline to this fd once serving"},
    {"log-level", KVCLI_STRING, O(log_level), "info", 0, 0, "LEVEL",
     "error | warn | info | debug"},
    {"rocksdb-log-dir", KVCLI_STRING, O(rocksdb_log_dir), NULL, 0, 0, "DIR",
     "RocksDB's own LOG at info level (keep it off the data disk)"},
    {"memtable-bytes", KVCLI_SIZE, O(memtable_bytes), "64MiB", 1 << 20, 0, "SIZE",
     "RocksDB write buffer per object class"},
    {"data-path", KVCLI_STRING, O(data_path), "both", 0, 0, "PATHS",
     "both | ucx | grpc: how KV bytes may move (UCX with tickets, or inside gRPC messages)"},
};
#define N_OPTIONS (sizeof(option_rows) / sizeof(option_rows[0]))

static void usage(FILE *f)
{
    fprintf(f,
            "usage: di-kvstore [options]\n\n"
            "The shared KV store: 128-token KV blocks, window states and prefill->decode\n"
            "handoffs keyed by hash chain, in a DRAM tier private to this process over a RocksDB\n"
            "tier on disk. Control API over gRPC (di.kvstore.KvStore); KV bytes move over UCX\n"
            "active messages, each against a one-time ticket from an authenticated Alloc or\n"
            "Lease (shared memory on this host, verbs devices of the --listen interface\n"
            "to other hosts; never TCP), or inside the gRPC messages of Get and Put (any\n"
            "network, with gRPC's TLS; --data-path picks). Administration with di-kvctl. Stops cleanly on SIGTERM\n"
            "or SIGINT (also SIGHUP and SIGQUIT). Exit status: 0 stopped cleanly, 1 failed, 2 bad\n"
            "usage or a size this machine cannot hold.\n\noptions:\n");
    kvcli_print_options(f, option_rows, N_OPTIONS);
    fprintf(f,
            "\ndurability (when a put is acknowledged, and what survives):\n"
            "  none   acknowledged once in RocksDB's memtable, WAL off. A kill -9 or a power\n"
            "         loss loses every object not yet flushed to an SST file (up to\n"
            "         --memtable-bytes per class). A clean stop keeps everything.\n"
            "  wal    acknowledged once written to RocksDB's write-ahead log (in the OS page\n"
            "         cache). Survives kill -9 of the store; a power loss or kernel crash may\n"
            "         lose the last acknowledged objects (the rest stays consistent).\n"
            "  fsync  acknowledged once the WAL is written and fdatasync'ed. Survives kill -9\n"
            "         and power loss, as far as the disk honours flushes.\n"
            "  In every mode an object is either complete and verified or absent after a\n"
            "  crash: a half-written put is never visible. The DRAM tier starts empty after a\n"
            "  restart and objects are read back from disk on first use.\n"
            "\nauth: engines send the --token-file token, di-kvctl the --admin-token-file token\n"
            "(\"authorization: Bearer ...\"). Without tokens the store refuses to listen on a\n"
            "non-loopback address. TLS when --tls-cert and --tls-key are given (gRPC only: see\n"
            "docs/kvstore.md for what the UCX data path does and does not protect).\n");
}

/* Process-wide state of the binary (main.c only). */
typedef struct app {
    options o;
    di_logger log;
    char *engine_token, *admin_token;
    char *tls_cert, *tls_key, *tls_ca;
    kv_geometry geometry;
    uint64_t object_bytes[KVKEY_CLASS_COUNT];
    ucxt_ctx *ucx;
    uint8_t *arena;          /* private anonymous mapping of the DRAM tier */
    kvs_store *store;
    kvsvc *svc;
    rpc_server *server;
    void *worker_addr;
    size_t worker_addr_len;
    unsigned data_paths;     /* KVC_PATHS_* from --data-path */
    char rdma_devices[512];  /* verbs ports of the --listen interface ("" = this host only) */
    di_log_limit rpc_warn, rpc_error; /* failed calls: 5 lines per 10 s at each level */
} app;

static int loopback(const char *listen)
{
    di_hostport hp;
    return di_hostport_parse(listen, true, &hp, NULL) == DI_OK && di_hostport_is_loopback(&hp);
}

/* Bytes of memory the options commit: the arena, a memtable per class, and the index
 * (about 200 bytes per object). */
static uint64_t memory_needed(const options *o)
{
    return o->dram_bytes + KVKEY_CLASS_COUNT * o->memtable_bytes + o->max_objects * 200;
}

/* Sizes against this machine, before anything is allocated: the DRAM tier and what goes with
 * it must fit in physical memory (a store past it is killed by the kernel mid-run); a disk tier
 * above the free space of --dir works until the disk is full, so it is only a warning. */
static di_status check_machine(app *a, di_error *err)
{
    di_status st = di_machine_check_memory("--dram-bytes", a->o.dram_bytes, err);
    if (st == DI_OK)
        st = di_machine_check_memory("--memtable-bytes", a->o.memtable_bytes, err);
    if (st == DI_OK) /* each term is bounded now: the sum cannot overflow */
        st = di_machine_check_memory("--dram-bytes with the memtables (--memtable-bytes) and "
                                     "the index (--max-objects)",
                                     memory_needed(&a->o), err);
    if (st != DI_OK)
        return st;
    uint64_t free_bytes;
    di_error e;
    if (di_machine_free_bytes(a->o.dir, &free_bytes, &e) == DI_OK &&
        free_bytes < a->o.disk_bytes) {
        char want[32], have[32];
        di_machine_format_bytes(a->o.disk_bytes, want, sizeof(want));
        di_machine_format_bytes(free_bytes, have, sizeof(have));
        di_log(&a->log, DI_LOG_WARN,
               "--disk-bytes %s is above the %s free on %s: writes will fail once the disk is "
               "full (ignoring)",
               want, have, a->o.dir);
    }
    return DI_OK;
}

static di_status load_geometry(app *a, di_error *err)
{
    /* A checkpoint wins over a config file, which wins over a shipped name; all go through the
     * config parser. Only a checkpoint's manifest gives the model id the engines compute (it
     * covers the weights); the other two give a config-only id, for benchmarks. */
    uint32_t yoco = KV_YOCO_DEFAULT;
    while (yoco <= KV_YOCO_MASK && strcmp(kv_yoco_name(yoco), a->o.yoco) != 0)
        yoco++;
    if (yoco == KV_YOCO_OFF || yoco > KV_YOCO_MASK)
        return di_fail(err, DI_EINVAL, "--yoco '%s': expected compact or mask (a store hit is "
                       "exact only with a truncated prefill)", a->o.yoco);
    if (a->o.model_dir && a->o.model_config)
        return di_fail(err, DI_EINVAL, "--model and --model-config exclude each other");
    const char *src = a->o.model_dir      ? a->o.model_dir
                      : a->o.model_config ? a->o.model_config
                                          : a->o.geometry;
    const char *what = a->o.model_dir ? "--model" : a->o.model_config ? "--model-config"
                                                                      : "--geometry";
    model_config cfg;
    uint8_t weights[DI_SHA256_BYTES];
    di_status st = model_config_resolve(src, &cfg, err);
    if (st == DI_OK && a->o.model_dir) {
        st = shard_sums_read_fingerprint(a->o.model_dir, weights, err);
        if (st == DI_ENOENT)
            di_error_prefix(err, "no checksum manifest (write one with di-mkmodel --manifest "
                            "DIR): ");
        if (st == DI_OK)
            cfg.model_id = model_config_id_with_weights(&cfg, weights);
    }
    if (st != DI_OK) {
        di_error_prefix(err, "%s %s: ", what, src);
        return st;
    }
    model_config_kv_geometry_yoco(&cfg, (uint32_t)a->o.nextn, yoco, &a->geometry);
    a->object_bytes[KVKEY_BLOCK] =
        a->o.block_bytes ? a->o.block_bytes : kv_block_bytes(&a->geometry);
    a->object_bytes[KVKEY_WINDOW] =
        a->o.window_bytes ? a->o.window_bytes : kv_window_state_bytes(&a->geometry);
    a->object_bytes[KVKEY_HANDOFF] =
        a->o.handoff_max_bytes ? a->o.handoff_max_bytes
                               : a->object_bytes[KVKEY_BLOCK] + a->object_bytes[KVKEY_WINDOW];
    for (int c = 0; c < (int)KVKEY_CLASS_COUNT; c++)
        if (a->object_bytes[c] <= KV_HEADER_BYTES || a->object_bytes[c] > (1ull << 31))
            return di_fail(err, DI_EINVAL, "%s objects of %llu bytes: must be %u..2^31 bytes",
                           kvkey_class_name(c), (unsigned long long)a->object_bytes[c],
                           KV_HEADER_BYTES + 1);
    return DI_OK;
}

static di_status load_secrets(app *a, di_error *err)
{
    di_status st = kvcli_token(a->o.token_file, "DI_KVSTORE_TOKEN", &a->engine_token, err);
    if (st == DI_OK)
        st = kvcli_token(a->o.admin_token_file, "DI_KVSTORE_ADMIN_TOKEN", &a->admin_token, err);
    if (st != DI_OK)
        return st;
    if (!a->engine_token && !loopback(a->o.listen))
        return di_fail(err, DI_EINVAL,
                       "refusing to listen on %s without --token-file: without a token the "
                       "store serves loopback only",
                       a->o.listen);
    if (!a->o.tls_cert != !a->o.tls_key)
        return di_fail(err, DI_EINVAL, "--tls-cert and --tls-key go together");
    if (a->o.tls_cert && (st = rpc_load_file(a->o.tls_cert, &a->tls_cert, err)) != DI_OK)
        return st;
    if (a->o.tls_key && (st = rpc_load_file(a->o.tls_key, &a->tls_key, err)) != DI_OK)
        return st;
    if (a->o.tls_client_ca && (st = rpc_load_file(a->o.tls_client_ca, &a->tls_ca, err)) != DI_OK)
        return st;
    return DI_OK;
}

/* The host part of --listen ("[::1]:9470" -> "::1"). */
static void listen_host(const char *listen, char *host, size_t cap)
{
    const char *start = listen, *end = strrchr(listen, ':');
    if (*start == '[') {
        start++;
        end = strchr(start, ']');
    }
    size_t n = end && end > start ? (size_t)(end - start) : strlen(start);
    if (n >= cap)
        n = cap - 1;
    memcpy(host, start, n);
    host[n] = 0;
}

/* Appends the verbs ports of network interface ifname ("mlx5_0:1,") found in sysfs. */
static void rdma_ports_of(const char *ifname, char *out, size_t cap)
{
    char path[300];
    snprintf(path, sizeof(path), "/sys/class/net/%s/device/infiniband", ifname);
    DIR *d = opendir(path);
    if (!d)
        return;
    for (struct dirent *e; (e = readdir(d)) != NULL;) {
        if (e->d_name[0] == '.')
            continue;
        size_t used = strlen(out);
        snprintf(out + used, cap - used, "%s%s:1", used ? "," : "", e->d_name);
    }
    closedir(d);
}

static int same_addr(const struct sockaddr *sa, const char *host)
{
    char buf[INET6_ADDRSTRLEN];
    const void *p = sa->sa_family == AF_INET
                        ? (const void *)&((const struct sockaddr_in *)sa)->sin_addr
                        : (const void *)&((const struct sockaddr_in6 *)sa)->sin6_addr;
    return inet_ntop(sa->sa_family, p, buf, sizeof(buf)) && strcmp(buf, host) == 0;
}

/* The RDMA ports UCX may use: those of the interface that owns the --listen address. Loopback
 * and unknown addresses get none (the data path then serves this host only); a wildcard
 * address gets every interface's. */
static void find_rdma_devices(app *a)
{
    char host[256];
    listen_host(a->o.listen, host, sizeof(host));
    a->rdma_devices[0] = 0;
    if (loopback(a->o.listen))
        return;
    int any = strcmp(host, "0.0.0.0") == 0 || strcmp(host, "::") == 0;
    struct ifaddrs *ifs = NULL;
    if (getifaddrs(&ifs) != 0)
        return;
    for (struct ifaddrs *i = ifs; i; i = i->ifa_next) {
        if (!i->ifa_addr || (i->ifa_addr->sa_family != AF_INET && i->ifa_addr->sa_family != AF_INET6))
            continue;
        if ((i->ifa_flags & IFF_LOOPBACK) || !(any || same_addr(i->ifa_addr, host)))
            continue;
        if (!strstr(a->rdma_devices, i->ifa_name)) /* one pass per interface */
            rdma_ports_of(i->ifa_name, a->rdma_devices, sizeof(a->rdma_devices));
    }
    freeifaddrs(ifs);
}

/* The DRAM tier: anonymous private memory, in no file, segment or UCX registration; kept out
 * of core dumps and of forked children. */
static di_status map_arena(app *a, di_error *err)
{
    void *p = mmap(NULL, a->o.dram_bytes, PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED)
        return di_fail(err, DI_ENOMEM, "cannot map %llu bytes of DRAM tier: %s",
                       (unsigned long long)a->o.dram_bytes, strerror(errno));
    madvise(p, a->o.dram_bytes, MADV_DONTDUMP);
    madvise(p, a->o.dram_bytes, MADV_DONTFORK);
    a->arena = p;
    return DI_OK;
}

static di_status open_store(app *a, int durability, di_error *err)
{
    di_status st = DI_OK;
    if (a->data_paths & KVC_PATHS_UCX) {
        find_rdma_devices(a);
        st = ucxt_create(1, a->rdma_devices, &a->ucx, err);
    }
    if (st == DI_OK)
        st = map_arena(a, err);
    if (st != DI_OK)
        return st;
    kvs_config sc = {.arena = a->arena, .arena_bytes = a->o.dram_bytes,
                     .dram_share = {1.0 - a->o.window_share - a->o.handoff_share,
                                    a->o.window_share, a->o.handoff_share},
                     .geometry = a->geometry,
                     .disk = {.dir = a->o.dir, .durability = durability,
                              .write_buffer_bytes = a->o.memtable_bytes,
                              .log_dir = a->o.rocksdb_log_dir},
                     .disk_capacity = a->o.disk_bytes,
                     .ttl_ms = {a->o.ttl_block_ms, a->o.ttl_window_ms, a->o.ttl_handoff_ms},
                     .alloc_timeout_ms = a->o.alloc_timeout_ms,
                     .lease_max_ms = a->o.lease_max_ms,
                     .max_leases = (uint32_t)a->o.max_leases,
                     .max_objects = (uint32_t)a->o.max_objects,
                     .log = &a->log};
    memcpy(sc.object_bytes, a->object_bytes, sizeof(sc.object_bytes));
    if (sc.dram_share[0] < 0.05)
        return di_fail(err, DI_EINVAL, "window and handoff shares leave blocks under 5%% of DRAM");
    st = kvs_open(&sc, &a->store, err);
    if (st == DI_OK && a->ucx)
        st = ucxt_worker_address(a->ucx, &a->worker_addr, &a->worker_addr_len, err);
    return st;
}

static void log_rpc_error(void *ud, const char *method, const char *peer, di_status st,
                          const char *msg)
{
    app *a = ud;
    if (st == DI_ENOENT || st == DI_EEXIST) {
        di_log(&a->log, DI_LOG_DEBUG, "%s from %s failed: %s (%s)", method, peer, msg,
               di_status_name(st));
        return;
    }
    di_log_limit *l =
        st == DI_EINTERNAL || st == DI_EIO || st == DI_ENOMEM ? &a->rpc_error : &a->rpc_warn;
    di_log_limited(&a->log, l, di_mono_ns(), "%s from %s failed: %s (%s)", method, peer, msg,
                   di_status_name(st));
}

static di_status start_service(app *a, int durability, uint64_t store_id, int *port,
                               di_error *err)
{
    kvsvc_config vc = {.store = a->store, .geometry = a->geometry,
                       .worker_addr = a->worker_addr, .worker_addr_len = a->worker_addr_len,
                       .arena = a->arena, .arena_bytes = a->o.dram_bytes,
                       .alloc_timeout_ms = a->o.alloc_timeout_ms, .store_id = store_id,
                       .durability = durability, .lease_default_ms = (uint32_t)a->o.lease_ms,
                       .lease_max_ms = (uint32_t)a->o.lease_max_ms, .log = &a->log,
                       .data_paths = a->data_paths};
    memcpy(vc.object_bytes, a->object_bytes, sizeof(vc.object_bytes));
    di_status st = kvsvc_create(&vc, &a->svc, err);
    if (st != DI_OK)
        return st;
    ucxt_server_ops ops;
    kvsvc_data_path(a->svc, &ops);
    if (a->ucx && (st = ucxt_serve(a->ucx, &ops, err)) != DI_OK)
        return st;
    size_t n;
    const rpc_method *methods = kvsvc_methods(&n);
    rpc_server_config rc = {.listen = a->o.listen, .methods = methods, .n_methods = n,
                            .svc = a->svc, .threads = (unsigned)a->o.threads,
                            .engine_token = a->engine_token, .admin_token = a->admin_token,
                            .tls_cert_pem = a->tls_cert, .tls_key_pem = a->tls_key,
                            .tls_client_ca_pem = a->tls_ca, .on_error = log_rpc_error,
                            .on_error_ud = a};
    st = rpc_server_start(&rc, &a->server, port, err);
    if (st == DI_OK && a->ucx)
        st = ucxt_progress_start(a->ucx, err);
    return st;
}

static di_status announce(app *a, int port, di_error *err)
{
    if (a->o.port_file) {
        char tmp[4096];
        snprintf(tmp, sizeof(tmp), "%s.tmp", a->o.port_file);
        FILE *f = fopen(tmp, "w");
        if (!f || fprintf(f, "%d\n", port) < 0 || fclose(f) != 0 || rename(tmp, a->o.port_file))
            return di_fail(err, DI_EIO, "cannot write --port-file %s: %s", a->o.port_file,
                           strerror(errno));
    }
    if (a->o.ready_fd >= 0) {
        char line[32];
        int n = snprintf(line, sizeof(line), "%d\n", port);
        if (write((int)a->o.ready_fd, line, (size_t)n) != n)
            return di_fail(err, DI_EIO, "cannot write to --ready-fd %lld",
                           (long long)a->o.ready_fd);
        close((int)a->o.ready_fd);
    }
    return DI_OK;
}

static void shutdown_app(app *a)
{
    /* The UCX worker goes before the service and the store: its last callbacks end tickets and
     * release leases in them. */
    a->server = rpc_server_stop(a->server, 5000);
    ucxt_progress_stop(a->ucx);
    a->ucx = ucxt_destroy(a->ucx);
    a->svc = kvsvc_free(a->svc);
    a->store = kvs_close(a->store);
    if (a->arena)
        munmap(a->arena, a->o.dram_bytes);
    a->arena = NULL;
    free(a->worker_addr);
    free(a->engine_token);
    free(a->admin_token);
    free(a->tls_cert);
    free(a->tls_key);
    free(a->tls_ca);
}

/* Every exit after the options are read goes through here: one line, then the shutdown of
 * whatever was started. Status 2 for bad flags (DI_EINVAL), 1 for the rest. */
static int fail(app *a, const char *what, di_status st, const di_error *e)
{
    fprintf(stderr, "di-kvstore: %s: %s\n", what, e->msg);
    shutdown_app(a);
    return st == DI_EINVAL ? 2 : 1;
}

int main(int argc, char **argv)
{
    /* Signals are taken by sigwait in main; every thread inherits the blocked mask. */
    sigset_t sigs;
    sigemptyset(&sigs);
    sigaddset(&sigs, SIGINT);
    sigaddset(&sigs, SIGTERM);
    sigaddset(&sigs, SIGHUP);
    sigaddset(&sigs, SIGQUIT);
    pthread_sigmask(SIG_BLOCK, &sigs, NULL);
    signal(SIGPIPE, SIG_IGN);

    app a;
    memset(&a, 0, sizeof(a));
    di_error e;
    int next, help;
    if (kvcli_defaults(option_rows, N_OPTIONS, &a.o, &e) != DI_OK ||
        kvcli_parse(option_rows, N_OPTIONS, argc, argv, 1, &a.o, &next, &help, &e) != DI_OK) {
        fprintf(stderr, "di-kvstore: %s\n", e.msg);
        return 2;
    }
    if (help) {
        usage(stdout);
        return di_close_stdout("di-kvstore", 0);
    }
    if (next < argc) {
        fprintf(stderr, "di-kvstore: unexpected argument \"%s\" (see --help)\n", argv[next]);
        return 2;
    }
    a.data_paths = strcmp(a.o.data_path, "both") == 0 ? KVC_PATHS_UCX | KVC_PATHS_GRPC
                   : strcmp(a.o.data_path, "ucx") == 0  ? KVC_PATHS_UCX
                   : strcmp(a.o.data_path, "grpc") == 0 ? KVC_PATHS_GRPC
                                                        : 0;
    if (!a.data_paths) {
        fprintf(stderr, "di-kvstore: --data-path must be both, ucx or grpc, not \"%s\"\n",
                a.o.data_path);
        return 2;
    }
    int level = di_log_level_parse(a.o.log_level);
    int durability = kvdisk_durability_parse(a.o.durability);
    if (level < 0 || durability < 0) {
        fprintf(stderr, "di-kvstore: %s\n",
                level < 0 ? "--log-level must be error, warn, info or debug"
                          : "--durability must be none, wal or fsync");
        return 2;
    }
    a.log = di_logger_stderr((di_log_level)level, "kvstore");
    di_log_limit_init(&a.rpc_warn, "calls failed", DI_LOG_WARN, 5, 10000);
    di_log_limit_init(&a.rpc_error, "calls failed", DI_LOG_ERROR, 5, 10000);
    if (check_machine(&a, &e) != DI_OK) {
        fprintf(stderr, "di-kvstore: %s\n", e.msg);
        return 2;
    }
    di_status st;
    if ((st = load_geometry(&a, &e)) != DI_OK)
        return fail(&a, "geometry", st, &e);
    if ((st = load_secrets(&a, &e)) != DI_OK)
        return fail(&a, "auth", st, &e);
    if ((st = open_store(&a, durability, &e)) != DI_OK)
        return fail(&a, "opening the store", st, &e);
    uint64_t store_id = 0;
    if (getrandom(&store_id, sizeof(store_id), 0) != (ssize_t)sizeof(store_id))
        store_id = (uint64_t)getpid() ^ kvs_now_ms(a.store);
    int port = 0;
    if ((st = start_service(&a, durability, store_id, &port, &e)) != DI_OK)
        return fail(&a, "starting the service", st, &e);
    if ((st = announce(&a, port, &e)) != DI_OK)
        return fail(&a, "announcing the port", st, &e);
    char dram[32], disk[32];
    kvcli_format_size(a.o.dram_bytes, dram, sizeof(dram));
    kvcli_format_size(a.o.disk_bytes, disk, sizeof(disk));
    di_log(&a.log, DI_LOG_INFO,
           "serving on %s (port %d): dir %s, durability %s, DRAM %s, disk %s, block %llu B, "
           "window %llu B, auth %s, TLS %s, KV data paths: %s%s%s",
           a.o.listen, port, a.o.dir, a.o.durability, dram, disk,
           (unsigned long long)a.object_bytes[KVKEY_BLOCK],
           (unsigned long long)a.object_bytes[KVKEY_WINDOW],
           a.engine_token || a.admin_token ? "tokens" : "none", a.tls_cert ? "on" : "off",
           a.data_paths & KVC_PATHS_GRPC ? "gRPC messages; " : "",
           !(a.data_paths & KVC_PATHS_UCX) ? "no UCX"
           : a.rdma_devices[0]             ? "UCX on this host and RDMA on "
                                           : "UCX on this host only",
           a.rdma_devices);
    int sig = -1;
    const struct timespec second = {.tv_sec = 1};
    while (sig < 0) { /* once a second: counts of rate-limited log lines */
        sig = sigtimedwait(&sigs, NULL, &second);
        kvsvc_tick(a.svc);
        di_log_limit_flush(&a.log, &a.rpc_warn, di_mono_ns(), 0);
        di_log_limit_flush(&a.log, &a.rpc_error, di_mono_ns(), 0);
    }
    di_log(&a.log, DI_LOG_INFO, "signal %d: stopping (finishing calls in flight)", sig);
    shutdown_app(&a);
    di_log_limit_flush(&a.log, &a.rpc_warn, di_mono_ns(), 1);
    di_log_limit_flush(&a.log, &a.rpc_error, di_mono_ns(), 1);
    di_log(&a.log, DI_LOG_INFO, "stopped");
    return 0;
}
