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

#include "common/kvfmt/kv_handoff.h"
#include "common/model/config.h"
#include "common/model/shard_sums.h"
#include "common/net/kv_client.h"
#include "common/net/rpc.h"
#include "common/net/ucx_xport.h"
#include "common/util/hostport.h"
#include "common/util/machine.h"
#include "common/service/service.h"
#include "common/util/clock.h"
#include "kvstore/cli.h"
#include "kvstore/service.h"
#include "kvstore/store.h"

/* Everything the command line sets. */
typedef struct options {
    svc_base_opts base;          /* --listen, --port-file, --ready-fd, --log-level, --drain */
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
    char *engine_token;          /* --token-file or $DI_KVSTORE_TOKEN (owned by the table) */
    char *admin_token;           /* --admin-token-file or $DI_KVSTORE_ADMIN_TOKEN */
    const char *tls_cert;
    const char *tls_key;
    const char *tls_client_ca;
    uint64_t threads;
    const char *rocksdb_log_dir;
    uint64_t memtable_bytes;
    const char *data_path;       /* both | ucx | grpc */
} options;

#define O(f) offsetof(options, f)
/* name, kind, offset, default, min, max, metavar, help, choices or environment variable */
static const svc_opt option_rows[] = {
    SVC_BASE_ROWS(options, base, "127.0.0.1:9470", "5s"),
    {"dir", SVC_OPT_STRING, O(dir), "./kvstore-data", 0, 0, "PATH", "RocksDB directory", NULL},
    {"durability", SVC_OPT_CHOICE, O(durability), "wal", 0, 0, "LEVEL",
     "when a commit is acknowledged (below)", "none|wal|fsync"},
    {"dram-bytes", SVC_OPT_SIZE, O(dram_bytes), "1GiB", 1 << 20, 0, "SIZE",
     "DRAM tier: the store's private arena, also its capacity (capacity set can lower it); "
     "at most the physical memory, with the memtables and the index", NULL},
    {"disk-bytes", SVC_OPT_SIZE, O(disk_bytes), "64GiB", 4096, 0, "SIZE",
     "disk tier capacity in object bytes (a warning when above the free space of --dir)", NULL},
    {"dram-window-share", SVC_OPT_DOUBLE, O(window_share), "0.25", 0.001, 0.9, "F",
     "fraction of the DRAM tier for window states", NULL},
    {"dram-handoff-share", SVC_OPT_DOUBLE, O(handoff_share), "0.05", 0.001, 0.9, "F",
     "fraction of the DRAM tier for handoffs (blocks get the rest)", NULL},
    {"geometry", SVC_OPT_STRING, O(geometry), "v41-flash", 0, 0, "NAME",
     "KV geometry and model id of a shipped model config (v41-flash, tiny, ...)", NULL},
    {"model-config", SVC_OPT_STRING, O(model_config), NULL, 0, 0, "FILE",
     "take the KV geometry and a config-only model id from this config.json (or its directory)",
     NULL},
    {"model", SVC_OPT_STRING, O(model_dir), NULL, 0, 0, "DIR",
     "the checkpoint the engines load: KV geometry and model id (config and weights) from its "
     "config.json and checksum manifest (no shard is read); engines connect only to a store "
     "started this way, as --geometry and --model-config ids cover no weights", NULL},
    {"yoco", SVC_OPT_STRING, O(yoco), "compact", 0, 0, "MODE",
     "YOCO mode of the engines, part of the KV id: compact (every engine's default) or mask", NULL},
    {"nextn", SVC_OPT_UINT, O(nextn), "5", 0, 16, "N",
     "drafts per step (ring size of windows)", NULL},
    {"block-bytes", SVC_OPT_SIZE, O(block_bytes), NULL, 0, 0, "N",
     "override the block object size (small test configs)", NULL},
    {"window-bytes", SVC_OPT_SIZE, O(window_bytes), NULL, 0, 0, "N",
     "override the window-state object size", NULL},
    {"handoff-max-bytes", SVC_OPT_SIZE, O(handoff_max_bytes), NULL, 0, 0, "N",
     "largest handoff object [what an engine of the model writes: its longest prompt, the "
     "state slot, the drafts and the executor state]", NULL},
    {"ttl-block", SVC_OPT_DURATION, O(ttl_block_ms), "3d", 0, 0, "DUR",
     "cache TTL of blocks, refreshed on every hit (0 = never)", NULL},
    {"ttl-window", SVC_OPT_DURATION, O(ttl_window_ms), "3d", 0, 0, "DUR",
     "cache TTL of window states", NULL},
    {"ttl-handoff", SVC_OPT_DURATION, O(ttl_handoff_ms), "60s", 0, 0, "DUR",
     "TTL of handoffs", NULL},
    {"lease", SVC_OPT_DURATION, O(lease_ms), "10s", 1, 86400000, "DUR",
     "lease given when a client asks for none (at most 1d)", NULL},
    {"lease-max", SVC_OPT_DURATION, O(lease_max_ms), "60s", 1, 86400000, "DUR",
     "longest lease (at most 1d); a lease whose client died ends after it", NULL},
    {"alloc-timeout", SVC_OPT_DURATION, O(alloc_timeout_ms), "30s", 1, 0, "DUR",
     "an allocation not committed by then is reclaimed", NULL},
    {"max-leases", SVC_OPT_UINT, O(max_leases), "65536", 16, 16777216, "N", "lease records", NULL},
    {"max-objects", SVC_OPT_UINT, O(max_objects), "4000000", 16, 4e9, "N",
     "objects in the index (about 200 bytes of memory each)", NULL},
    {"token-file", SVC_OPT_SECRET, O(engine_token), NULL, 0, 0, "FILE",
     "engine token; without one: loopback only", "DI_KVSTORE_TOKEN"},
    {"admin-token-file", SVC_OPT_SECRET, O(admin_token), NULL, 0, 0, "FILE",
     "admin token for di-kvctl", "DI_KVSTORE_ADMIN_TOKEN"},
    {"tls-cert", SVC_OPT_STRING, O(tls_cert), NULL, 0, 0, "FILE",
     "TLS certificate chain (PEM)", NULL},
    {"tls-key", SVC_OPT_STRING, O(tls_key), NULL, 0, 0, "FILE", "TLS private key (PEM)", NULL},
    {"tls-client-ca", SVC_OPT_STRING, O(tls_client_ca), NULL, 0, 0, "FILE",
     "require client certificates signed by this CA", NULL},
    {"threads", SVC_OPT_UINT, O(threads), "4", 1, 64, "N", "gRPC worker threads", NULL},
    {"rocksdb-log-dir", SVC_OPT_STRING, O(rocksdb_log_dir), NULL, 0, 0, "DIR",
     "RocksDB's own LOG at info level (keep it off the data disk)", NULL},
    {"memtable-bytes", SVC_OPT_SIZE, O(memtable_bytes), "64MiB", 1 << 20, 0, "SIZE",
     "RocksDB write buffer per object class", NULL},
    {"data-path", SVC_OPT_CHOICE, O(data_path), "both", 0, 0, "PATHS",
     "how KV bytes may move: UCX with tickets, inside gRPC messages, or both", "both|ucx|grpc"},
};
#define N_OPTIONS (sizeof(option_rows) / sizeof(option_rows[0]))

/* What --help says before and after the option rows. */
static const char summary[] =
    "The shared KV store: 128-token KV blocks, window states and prefill->decode\n"
    "handoffs keyed by hash chain, in a DRAM tier private to this process over a RocksDB\n"
    "tier on disk. Control API over gRPC (di.kvstore.KvStore); KV bytes move over UCX\n"
    "active messages, each against a one-time ticket from an authenticated Alloc or\n"
    "Lease (shared memory on this host, verbs devices of the --listen interface\n"
    "to other hosts; never TCP), or inside the gRPC messages of Get and Put (any\n"
    "network, with gRPC's TLS; --data-path picks). Administration with di-kvctl. Stops\n"
    "cleanly on SIGTERM\n"
    "or SIGINT (also SIGHUP and SIGQUIT). Exit status: 0 stopped cleanly, 1 failed, 2 bad\n"
    "usage or a size this machine cannot hold.";

static const char epilog[] =
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
    "docs/kvstore.md for what the UCX data path does and does not protect).\n";

/* Process-wide state of the binary (main.c only). */
typedef struct app {
    options o;
    di_logger log;
    int durability;              /* kvdisk durability of --durability */
    char *tls_cert, *tls_key, *tls_ca;
    kv_geometry geometry;
    uint64_t object_bytes[KVKEY_CLASS_COUNT];
    ucxt_ctx *ucx;
    uint8_t *arena;              /* private anonymous mapping of the DRAM tier */
    kvs_store *store;
    kvsvc *svc;
    rpc_server *server;
    void *worker_addr;
    size_t worker_addr_len;
    unsigned data_paths;         /* KVC_PATHS_* from --data-path */
    char rdma_devices[512];      /* verbs ports of the --listen interface ("" = this host only) */
    di_log_limit rpc_warn, rpc_error; /* failed calls: 5 lines per 10 s at each level */
} app;

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

/* The largest handoff an engine of this model writes (kv_handoff.h): a prompt as long as the
 * model takes, a partial last block, the whole state slot, nextn pending drafts and the
 * executor state (16 bytes, the drafts and their draft-head logits, nextn x vocabulary fp32). */
static uint64_t handoff_max_bytes(const model_config *cfg, const app *a)
{
    uint64_t len = cfg->max_position_embeddings;
    if (len > KV_HANDOFF_MAX_TOKENS)
        len = KV_HANDOFF_MAX_TOKENS;
    if (len < 2)
        len = 2;
    uint32_t nextn = (uint32_t)a->o.nextn;
    uint64_t exec = 16 + (uint64_t)nextn * 4 + (uint64_t)nextn * cfg->vocab_size * 4;
    uint64_t most = 0;
    for (uint32_t back = 1; back <= 2; back++) { /* with and without a partial last block */
        kv_handoff h = {.prompt_len = (uint32_t)len - 1, .n_output = 1,
                        .kv_positions = (uint32_t)(len - back),
                        .n_drafts = nextn < KV_HANDOFF_MAX_DRAFTS ? nextn : KV_HANDOFF_MAX_DRAFTS,
                        .exec_bytes = exec < KV_HANDOFF_MAX_EXEC ? (uint32_t)exec
                                                                 : KV_HANDOFF_MAX_EXEC};
        size_t b = kv_handoff_bytes(&a->geometry, &h);
        if (b > most)
            most = b;
    }
    return most;
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
        a->o.handoff_max_bytes ? a->o.handoff_max_bytes : handoff_max_bytes(&cfg, a);
    /* The default must not stop a small store from starting: it is capped at one slot of the
     * handoff share, and the start-up line says what that costs. */
    uint64_t share = (uint64_t)((double)a->o.dram_bytes * a->o.handoff_share) & ~4095ull;
    if (!a->o.handoff_max_bytes && share > KV_HEADER_BYTES &&
        a->object_bytes[KVKEY_HANDOFF] > share) {
        di_log(&a->log, DI_LOG_WARN,
               "handoffs capped at %llu bytes (--dram-bytes x --dram-handoff-share), below the "
               "%llu bytes of the model's longest handoff: a request whose handoff is larger "
               "fails at prefill (raise --dram-bytes or --dram-handoff-share)",
               (unsigned long long)share, (unsigned long long)a->object_bytes[KVKEY_HANDOFF]);
        a->object_bytes[KVKEY_HANDOFF] = share;
    }
    for (int c = 0; c < (int)KVKEY_CLASS_COUNT; c++)
        if (a->object_bytes[c] <= KV_HEADER_BYTES || a->object_bytes[c] > (1ull << 31))
            return di_fail(err, DI_EINVAL, "%s objects of %llu bytes: must be %u..2^31 bytes",
                           kvkey_class_name(c), (unsigned long long)a->object_bytes[c],
                           KV_HEADER_BYTES + 1);
    return DI_OK;
}

static di_status load_tls(app *a, di_error *err)
{
    di_status st = DI_OK;
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

static int loopback(const char *listen)
{
    di_hostport hp;
    return di_hostport_parse(listen, true, &hp, NULL) == DI_OK && di_hostport_is_loopback(&hp);
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
    listen_host(a->o.base.listen, host, sizeof(host));
    a->rdma_devices[0] = 0;
    if (loopback(a->o.base.listen))
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
    rpc_server_config rc = {.listen = a->o.base.listen, .methods = methods, .n_methods = n,
                            .svc = a->svc, .threads = (unsigned)a->o.threads,
                            .engine_token = a->o.engine_token, .admin_token = a->o.admin_token,
                            .tls_cert_pem = a->tls_cert, .tls_key_pem = a->tls_key,
                            .tls_client_ca_pem = a->tls_ca, .on_error = log_rpc_error,
                            .on_error_ud = a};
    st = rpc_server_start(&rc, &a->server, port, err);
    if (st == DI_OK && a->ucx)
        st = ucxt_progress_start(a->ucx, err);
    return st;
}

static void shutdown_app(app *a)
{
    /* The UCX worker goes before the service and the store: its last callbacks end tickets and
     * release leases in them. */
    a->server = rpc_server_stop(a->server, 0);
    ucxt_progress_stop(a->ucx);
    a->ucx = ucxt_destroy(a->ucx);
    a->svc = kvsvc_free(a->svc);
    a->store = kvs_close(a->store);
    if (a->arena)
        munmap(a->arena, a->o.dram_bytes);
    a->arena = NULL;
    free(a->worker_addr);
    free(a->tls_cert);
    free(a->tls_key);
    free(a->tls_ca);
}

/* Opens the store and starts serving (svc_main's start). */
static di_status kv_start(void *ud, const svc_ctx *ctx, int *port, di_error *err)
{
    app *a = ud;
    a->log = ctx->log;
    a->durability = kvdisk_durability_parse(a->o.durability);
    a->data_paths = strcmp(a->o.data_path, "ucx") == 0    ? KVC_PATHS_UCX
                    : strcmp(a->o.data_path, "grpc") == 0 ? KVC_PATHS_GRPC
                                                          : KVC_PATHS_UCX | KVC_PATHS_GRPC;
    di_log_limit_init(&a->rpc_warn, "calls failed", DI_LOG_WARN, 5, 10000);
    di_log_limit_init(&a->rpc_error, "calls failed", DI_LOG_ERROR, 5, 10000);
    di_status st = check_machine(a, err); /* ERANGE: a size this machine cannot hold (exit 2) */
    if (st != DI_OK)
        return st;
    st = load_geometry(a, err);
    if (st != DI_OK) {
        di_error_prefix(err, "geometry: ");
        return st;
    }
    if ((st = load_tls(a, err)) != DI_OK) {
        di_error_prefix(err, "auth: ");
        return st;
    }
    if ((st = open_store(a, a->durability, err)) != DI_OK) {
        di_error_prefix(err, "opening the store: ");
        return st;
    }
    uint64_t store_id = 0;
    if (getrandom(&store_id, sizeof(store_id), 0) != (ssize_t)sizeof(store_id))
        store_id = (uint64_t)getpid() ^ kvs_now_ms(a->store);
    if ((st = start_service(a, a->durability, store_id, port, err)) != DI_OK) {
        di_error_prefix(err, "starting the service: ");
        return st;
    }
    char dram[32], disk[32];
    kvcli_format_size(a->o.dram_bytes, dram, sizeof(dram));
    kvcli_format_size(a->o.disk_bytes, disk, sizeof(disk));
    di_log(&a->log, DI_LOG_INFO,
           "serving on %s (port %d): dir %s, durability %s, DRAM %s, disk %s, block %llu B, "
           "window %llu B, handoff up to %llu B, auth %s, TLS %s, KV data paths: %s%s%s",
           a->o.base.listen, *port, a->o.dir, a->o.durability, dram, disk,
           (unsigned long long)a->object_bytes[KVKEY_BLOCK],
           (unsigned long long)a->object_bytes[KVKEY_WINDOW],
           (unsigned long long)a->object_bytes[KVKEY_HANDOFF],
           a->o.engine_token || a->o.admin_token ? "tokens" : "none", a->tls_cert ? "on" : "off",
           a->data_paths & KVC_PATHS_GRPC ? "gRPC messages; " : "",
           !(a->data_paths & KVC_PATHS_UCX) ? "no UCX"
           : a->rdma_devices[0]             ? "UCX on this host and RDMA on "
                                            : "UCX on this host only",
           a->rdma_devices);
    return DI_OK;
}

/* SIGTERM: calls in flight finish until the deadline, the rest are cancelled. */
static void kv_drain(void *ud, const svc_ctx *ctx, uint64_t deadline_ns)
{
    (void)ctx;
    app *a = ud;
    uint64_t now = di_mono_ns();
    uint64_t grace_ms = deadline_ns > now ? (deadline_ns - now) / 1000000ull : 0;
    a->server = rpc_server_stop(a->server, (uint32_t)grace_ms);
}

/* Once a second while serving: counts of rate-limited log lines. */
static void kv_tick(void *ud, const svc_ctx *ctx)
{
    (void)ctx;
    app *a = ud;
    kvsvc_tick(a->svc);
    di_log_limit_flush(&a->log, &a->rpc_warn, di_mono_ns(), 0);
    di_log_limit_flush(&a->log, &a->rpc_error, di_mono_ns(), 0);
}

static void kv_stop(void *ud, const svc_ctx *ctx)
{
    (void)ctx;
    app *a = ud;
    shutdown_app(a);
    di_log_limit_flush(&a->log, &a->rpc_warn, di_mono_ns(), 1);
    di_log_limit_flush(&a->log, &a->rpc_error, di_mono_ns(), 1);
}

int main(int argc, char **argv)
{
    app a;
    memset(&a, 0, sizeof(a));
    svc_spec spec = {.name = "di-kvstore", .summary = summary, .epilog = epilog,
                     .guard = "token-file", .rows = option_rows, .n_rows = N_OPTIONS,
                     .opts = &a.o, .base_offset = offsetof(options, base), .app = &a,
                     .start = kv_start, .drain = kv_drain, .stop = kv_stop,
                     .tick = kv_tick, .tick_ms = 1000};
    return svc_main(&spec, argc, argv);
}
