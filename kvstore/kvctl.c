/* di-kvctl: administration of a running di-kvstore (stats, TTL, capacity, inspect, evict,
 * compact). One table row per subcommand; human-readable tables by default, --json for
 * scripts. Talks to the store over gRPC with the admin token. */
#include <ctype.h>
#include <errno.h>
#include <jansson.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/net/kv_client.h"
#include "common/net/kvstore.pb-c.h"
#include "common/net/rpc.h"
#include "common/service/options.h"
#include "common/util/hostport.h"
#include "common/util/outclose.h"
#include "kvstore/cli.h"
#ifdef DI_KVCTL_TOKENIZER
#include "common/tokenizer/tokenizer.h"
#endif

/* Global options (before the subcommand). */
typedef struct gopts {
    const char *target;      /* store address */
    char *token;             /* admin token (from its file or $DI_KVSTORE_ADMIN_TOKEN) */
    const char *tls_ca;      /* CA file for TLS */
    const char *tls_name;    /* certificate name override */
    const char *tls_cert;    /* client certificate (mutual TLS) */
    const char *tls_key;     /* its key */
    int json;                /* machine-readable output */
    uint64_t deadline_ms;    /* per call */
    const char *data_path;   /* auto | ucx | grpc */
} gopts;

/* Subcommand options (each subcommand reads the ones it uses). */
typedef struct sopts {
    const char *ids;         /* inspect: comma-separated token ids */
    const char *text;        /* inspect: a UTF-8 text prompt file ("-": stdin) */
    const char *tokenizer;   /* inspect --text: tokenizer.json (default: the project's) */
    int bos;                 /* inspect --text: prepend the BOS token */
    const char *cls;         /* evict: class list "block,window" */
    int dram_only;           /* evict: DRAM copies only */
    int all;                 /* evict: every object of the classes */
} sopts;

/* A subcommand's arguments, checked before the store is called (bad ones exit 2 without a
 * connection). */
typedef struct args {
    int set;                 /* ttl, capacity: "set" rather than "get" */
    int cls;                 /* ttl set: the class */
    int tier;                /* capacity set: DI__KVSTORE__TIER__DRAM or __DISK */
    uint64_t value;          /* ttl set: ms; capacity set: bytes */
    unsigned mask;           /* evict: classes */
    kvkey *keys;             /* evict: the keys given (malloc'd) */
    int32_t *ids;            /* inspect: the prompt's token ids (malloc'd) */
    size_t n_ids;
} args;

/* What a subcommand gets. */
typedef struct ctl {
    gopts g;
    sopts s;
    args a;
    kvc_client *c;
    int argc;                /* positional arguments after the subcommand */
    char **argv;
} ctl;

#define G(f) offsetof(gopts, f)
static const svc_opt global_rows[] = {
    {"target", SVC_OPT_HOSTPORT, G(target), "127.0.0.1:9470", 1, 0, "HOST:PORT",
     "the store (or $DI_KVSTORE_TARGET)", NULL},
    {"admin-token-file", SVC_OPT_SECRET, G(token), NULL, 0, 0, "FILE", "admin token",
     "DI_KVSTORE_ADMIN_TOKEN"},
    {"tls-ca", SVC_OPT_FILE, G(tls_ca), NULL, 0, 0, "FILE", "CA of the store's certificate",
     NULL},
    {"tls-name", SVC_OPT_STRING, G(tls_name), NULL, 0, 0, "NAME",
     "name on the store's certificate", NULL},
    {"tls-cert", SVC_OPT_FILE, G(tls_cert), NULL, 0, 0, "FILE",
     "client certificate (PEM) for a store started with --tls-client-ca", NULL},
    {"tls-key", SVC_OPT_FILE, G(tls_key), NULL, 0, 0, "FILE",
     "the client certificate's key (PEM)", NULL},
    {"json", SVC_OPT_FLAG, G(json), NULL, 0, 0, NULL, "print JSON instead of tables", NULL},
    {"deadline", SVC_OPT_DURATION, G(deadline_ms), "10s", 1, 86400000, "DUR",
     "deadline of each call (at most 1d)", NULL},
    {"data-path", SVC_OPT_CHOICE, G(data_path), "auto", 0, 0, "PATH",
     "how KV bytes move: auto (UCX to a store on this host, else gRPC), ucx, grpc",
     "auto|ucx|grpc"},
};
#define N_GLOBAL (sizeof(global_rows) / sizeof(global_rows[0]))
#define S(f) offsetof(sopts, f)
static const svc_opt sub_rows[] = {
    {"ids", SVC_OPT_STRING, S(ids), NULL, 0, 0, "LIST", "inspect: token ids 1,2,3 (no file)",
     NULL},
    {"text", SVC_OPT_STRING, S(text), NULL, 0, 0, "FILE",
     "inspect: a text prompt (UTF-8; - for stdin), tokenized here", NULL},
    {"tokenizer", SVC_OPT_FILE, S(tokenizer), NULL, 0, 0, "FILE",
     "inspect --text: tokenizer.json [$DI_TOKENIZER or the project's DeepSeek V3]", NULL},
    {"bos", SVC_OPT_FLAG, S(bos), NULL, 0, 0, NULL, "inspect --text: prepend the BOS token",
     NULL},
    {"class", SVC_OPT_STRING, S(cls), NULL, 0, 0, "LIST", "evict: block,window,handoff [block]",
     NULL},
    {"dram-only", SVC_OPT_FLAG, S(dram_only), NULL, 0, 0, NULL,
     "evict: drop DRAM copies only (keep disk)", NULL},
    {"all", SVC_OPT_FLAG, S(all), NULL, 0, 0, NULL, "evict: every unleased object of the classes",
     NULL},
};
#define N_SUB_ROWS (sizeof(sub_rows) / sizeof(sub_rows[0]))

/* ---------------------------------------------------------------- output helpers */

static void print_json(json_t *j)
{
    char *s = json_dumps(j, JSON_INDENT(2) | JSON_SORT_KEYS);
    if (s)
        puts(s);
    free(s);
    json_decref(j);
}

static const char *size_str(uint64_t b, char *buf)
{
    kvcli_format_size(b, buf, 32);
    return buf;
}

/* 1234567 -> "1,234,567" */
static const char *count_str(uint64_t v, char *buf)
{
    char tmp[32];
    int n = snprintf(tmp, sizeof(tmp), "%llu", (unsigned long long)v);
    int o = 0;
    for (int i = 0; i < n; i++) {
        buf[o++] = tmp[i];
        if ((n - i - 1) % 3 == 0 && i < n - 1)
            buf[o++] = ',';
    }
    buf[o] = '\0';
    return buf;
}

static double pct(uint64_t a, uint64_t b)
{
    return b ? 100.0 * (double)a / (double)b : 0.0;
}

static int fail(const char *what, const di_error *e)
{
    fprintf(stderr, "di-kvctl: %s: %s\n", what, e->msg);
    return 1;
}

/* One admin RPC: packs req, unpacks the reply as desc. */
static di_status call(ctl *x, const char *method, const ProtobufCMessage *req,
                      const ProtobufCMessageDescriptor *desc, ProtobufCMessage **out, di_error *e)
{
    size_t n = protobuf_c_message_get_packed_size(req);
    uint8_t *buf = malloc(n ? n : 1);
    if (!buf)
        return di_fail(e, DI_ENOMEM, "out of memory");
    protobuf_c_message_pack(req, buf);
    uint8_t *rep = NULL;
    size_t len = 0;
    di_status st = kvc_call(x->c, method, buf, n, &rep, &len, e);
    free(buf);
    if (st != DI_OK)
        return st;
    *out = protobuf_c_message_unpack(desc, NULL, len, rep);
    free(rep);
    return *out ? DI_OK : di_fail(e, DI_EPROTO, "malformed %s from the store", desc->short_name);
}

/* ---------------------------------------------------------------- stats */

static json_t *stats_json(const Di__Kvstore__StatsReply *r)
{
    json_t *classes = json_object();
    for (size_t i = 0; i < r->n_classes; i++) {
        const Di__Kvstore__ClassStats *c = r->classes[i];
        json_object_set_new(
            classes, kvkey_class_name(c->cls),
            json_pack("{sI sI sI sI sI sI sI sI sI sI}", "objects", (json_int_t)c->objects,
                      "bytes", (json_int_t)c->bytes, "dram_objects", (json_int_t)c->dram_objects,
                      "dram_bytes", (json_int_t)c->dram_bytes, "dram_slots",
                      (json_int_t)c->dram_slots, "dram_slot_limit", (json_int_t)c->dram_slot_limit,
                      "dram_slots_used", (json_int_t)c->dram_slots_used, "slot_bytes",
                      (json_int_t)c->slot_bytes, "writing", (json_int_t)c->writing, "ttl_ms",
                      (json_int_t)c->ttl_ms));
    }
    json_t *j = json_pack(
        "{so sI sI sI sI sI sI sI}", "classes", classes, "dram_capacity",
        (json_int_t)r->dram_capacity, "dram_arena_bytes", (json_int_t)r->dram_arena_bytes,
        "disk_capacity", (json_int_t)r->disk_capacity, "disk_used", (json_int_t)r->disk_used,
        "disk_deleting", (json_int_t)r->disk_deleting, "disk_sst_bytes",
        (json_int_t)r->disk_sst_bytes, "disk_memtable_bytes", (json_int_t)r->disk_memtable_bytes);
    json_t *more = json_pack(
        "{sI sI sI sI sf sf sI sI sI sI sI sI sI sI sI sI sI sI}", "lease_hits",
        (json_int_t)r->lease_hits, "lease_misses", (json_int_t)r->lease_misses, "lookup_blocks",
        (json_int_t)r->lookup_blocks, "lookup_hits", (json_int_t)r->lookup_hits, "lease_hit_rate",
        pct(r->lease_hits, r->lease_hits + r->lease_misses) / 100.0, "lookup_hit_rate",
        pct(r->lookup_hits, r->lookup_blocks) / 100.0, "dram_evictions",
        (json_int_t)r->dram_evictions, "disk_evictions", (json_int_t)r->disk_evictions,
        "expirations", (json_int_t)r->expirations, "corrupt_dropped",
        (json_int_t)r->corrupt_dropped, "deletes", (json_int_t)r->deletes, "commits",
        (json_int_t)r->commits, "commit_failures", (json_int_t)r->commit_failures,
        "alloc_reclaimed", (json_int_t)r->alloc_reclaimed, "promotions",
        (json_int_t)r->promotions, "leases_active", (json_int_t)r->leases_active,
        "leases_timed_out", (json_int_t)r->leases_timed_out, "uptime_ms",
        (json_int_t)r->uptime_ms);
    json_object_update(j, more);
    json_decref(more);
    char id[24];
    snprintf(id, sizeof(id), "%016llx", (unsigned long long)r->store_id);
    char mid[24];
    snprintf(mid, sizeof(mid), "%016llx", (unsigned long long)r->model_id);
    json_t *rest = json_pack("{sI sI sf sf ss ss ss}", "get_bytes", (json_int_t)r->get_bytes,
                             "put_bytes", (json_int_t)r->put_bytes, "get_bytes_per_s",
                             r->get_bytes_per_s, "put_bytes_per_s", r->put_bytes_per_s,
                             "durability", r->durability, "store_id", id, "model_id", mid);
    json_object_update(j, rest);
    json_decref(rest);
    json_object_set_new(j, "disk_files_lost", json_integer((json_int_t)r->disk_files_lost));
    json_object_set_new(j, "disk_meta_bad", json_integer((json_int_t)r->disk_meta_bad));
    return j;
}

static void stats_table(const Di__Kvstore__StatsReply *r)
{
    char a[32], b[32], c[32], d[32], e[32];
    kvcli_format_duration(r->uptime_ms, a, sizeof(a));
    printf("store %016llx   model %016llx   up %s   durability %s\n\n",
           (unsigned long long)r->store_id, (unsigned long long)r->model_id, a, r->durability);
    printf("%-9s %12s %12s %10s %12s %15s %9s\n", "class", "objects", "bytes", "in DRAM",
           "DRAM bytes", "DRAM slots", "TTL");
    uint64_t dram_used = 0;
    for (size_t i = 0; i < r->n_classes; i++) {
        const Di__Kvstore__ClassStats *k = r->classes[i];
        char slots[40], ttl[32];
        snprintf(slots, sizeof(slots), "%llu/%llu", (unsigned long long)k->dram_slots_used,
                 (unsigned long long)k->dram_slot_limit);
        if (k->ttl_ms)
            kvcli_format_duration(k->ttl_ms, ttl, sizeof(ttl));
        else
            snprintf(ttl, sizeof(ttl), "never");
        printf("%-9s %12s %12s %10s %12s %15s %9s\n", kvkey_class_name(k->cls),
               count_str(k->objects, a), size_str(k->bytes, b), count_str(k->dram_objects, c),
               size_str(k->dram_bytes, d), slots, ttl);
        dram_used += k->dram_slots_used * k->slot_bytes;
    }
    printf("\nDRAM tier    %s of %s capacity in slots (arena %s)\n", size_str(dram_used, a),
           size_str(r->dram_capacity, b), size_str(r->dram_arena_bytes, c));
    printf("disk tier    %s of %s capacity; RocksDB files %s, memtables %s, %s being deleted\n",
           size_str(r->disk_used, a), size_str(r->disk_capacity, b),
           size_str(r->disk_sst_bytes, c), size_str(r->disk_memtable_bytes, d),
           size_str(r->disk_deleting, e));
    printf("hit rate     leases %.1f%% (%s of %s)   lookups %.1f%% of blocks (%s of %s)\n",
           pct(r->lease_hits, r->lease_hits + r->lease_misses), count_str(r->lease_hits, a),
           count_str(r->lease_hits + r->lease_misses, b), pct(r->lookup_hits, r->lookup_blocks),
           count_str(r->lookup_hits, c), count_str(r->lookup_blocks, d));
    printf("removals     DRAM evictions %s   disk evictions %s   expirations %s   corrupt "
           "dropped %s   deletes %s\n",
           count_str(r->dram_evictions, a), count_str(r->disk_evictions, b),
           count_str(r->expirations, c), count_str(r->corrupt_dropped, d),
           count_str(r->deletes, e));
    if (r->disk_files_lost || r->disk_meta_bad)
        printf("unreadable   RocksDB files set aside at start %s (in the data directory's lost/)"
               "   meta records dropped %s\n",
               count_str(r->disk_files_lost, a), count_str(r->disk_meta_bad, b));
    printf("writes       commits %s   failed %s   allocations reclaimed %s   disk reads %s\n",
           count_str(r->commits, a), count_str(r->commit_failures, b),
           count_str(r->alloc_reclaimed, c), count_str(r->promotions, d));
    printf("leases       active %s   timed out %s\n", count_str(r->leases_active, a),
           count_str(r->leases_timed_out, b));
    printf("transfer     get %s/s   put %s/s (last 10 s)   since start: get %s, put %s\n",
           size_str((uint64_t)r->get_bytes_per_s, a), size_str((uint64_t)r->put_bytes_per_s, b),
           size_str(r->get_bytes, c), size_str(r->put_bytes, d));
}

static int cmd_stats(ctl *x)
{
    Di__Kvstore__StatsRequest req = DI__KVSTORE__STATS_REQUEST__INIT;
    Di__Kvstore__StatsReply *r;
    di_error e;
    if (call(x, "Stats", &req.base, &di__kvstore__stats_reply__descriptor,
             (ProtobufCMessage **)&r, &e) != DI_OK)
        return fail("stats", &e);
    if (x->g.json)
        print_json(stats_json(r));
    else
        stats_table(r);
    di__kvstore__stats_reply__free_unpacked(r, NULL);
    return 0;
}

/* ---------------------------------------------------------------- ttl, capacity */

static void print_ttls(const ctl *x, const Di__Kvstore__TtlReply *r)
{
    if (x->g.json) {
        json_t *j = json_object();
        for (size_t i = 0; i < r->n_ttl_ms; i++)
            json_object_set_new(j, kvkey_class_name((int)i), json_integer((json_int_t)r->ttl_ms[i]));
        print_json(j);
        return;
    }
    for (size_t i = 0; i < r->n_ttl_ms; i++) {
        char d[32];
        kvcli_format_duration(r->ttl_ms[i] ? r->ttl_ms[i] : UINT64_MAX, d, sizeof(d));
        printf("%-8s %s (%llu ms)\n", kvkey_class_name((int)i), d,
               (unsigned long long)r->ttl_ms[i]);
    }
}

/* A usage error: one line, exit status 2. */
static int usage_error(const char *what, const char *msg)
{
    fprintf(stderr, "di-kvctl: %s: %s\n", what, msg);
    return 2;
}

static int check_ttl(ctl *x)
{
    x->a.set = x->argc >= 1 && strcmp(x->argv[0], "set") == 0;
    if (x->argc < 1 || (!x->a.set && strcmp(x->argv[0], "get") != 0) ||
        (x->a.set && x->argc != 3) || (!x->a.set && x->argc != 1))
        return usage_error("usage", "ttl get | ttl set CLASS DURATION (e.g. ttl set handoff "
                                    "90s; 0 = never)");
    if (!x->a.set)
        return 0;
    x->a.cls = kvkey_class_parse(x->argv[1]);
    if (x->a.cls < 0) {
        fprintf(stderr, "di-kvctl: ttl set: unknown class \"%s\" (block, window, handoff)\n",
                x->argv[1]);
        return 2;
    }
    di_error e;
    if (svc_parse_duration(x->argv[2], &x->a.value, &e) != DI_OK)
        return usage_error("ttl set", e.msg);
    return 0;
}

static int cmd_ttl(ctl *x)
{
    Di__Kvstore__TtlRequest req = DI__KVSTORE__TTL_REQUEST__INIT;
    di_error e;
    if (x->a.set) {
        req.set = 1;
        req.cls = (Di__Kvstore__ObjClass)x->a.cls;
        req.ttl_ms = x->a.value;
    }
    Di__Kvstore__TtlReply *r;
    if (call(x, "Ttl", &req.base, &di__kvstore__ttl_reply__descriptor, (ProtobufCMessage **)&r,
             &e) != DI_OK)
        return fail("ttl", &e);
    print_ttls(x, r);
    di__kvstore__ttl_reply__free_unpacked(r, NULL);
    return 0;
}

static int check_capacity(ctl *x)
{
    int set = x->argc >= 1 && strcmp(x->argv[0], "set") == 0;
    if (x->argc < 1 || (!set && strcmp(x->argv[0], "get") != 0) || (set && x->argc != 3) ||
        (!set && x->argc != 1) || (set && strcmp(x->argv[1], "dram") != 0 &&
                                   strcmp(x->argv[1], "disk") != 0))
        return usage_error("usage", "capacity get | capacity set dram|disk SIZE (e.g. "
                                    "capacity set dram 512MiB)");
    x->a.set = set;
    if (!set)
        return 0;
    di_error e;
    if (svc_parse_size(x->argv[2], &x->a.value, &e) != DI_OK)
        return usage_error("capacity set", e.msg);
    x->a.tier = strcmp(x->argv[1], "dram") == 0 ? DI__KVSTORE__TIER__DRAM
                                                : DI__KVSTORE__TIER__DISK;
    return 0;
}

static int cmd_capacity(ctl *x)
{
    Di__Kvstore__CapacityRequest req = DI__KVSTORE__CAPACITY_REQUEST__INIT;
    di_error e;
    if (x->a.set) {
        req.set = 1;
        req.bytes = x->a.value;
        req.tier = (Di__Kvstore__Tier)x->a.tier;
    }
    Di__Kvstore__CapacityReply *r;
    if (call(x, "Capacity", &req.base, &di__kvstore__capacity_reply__descriptor,
             (ProtobufCMessage **)&r, &e) != DI_OK)
        return fail("capacity", &e);
    char a[32], b[32], c[32];
    if (x->g.json)
        print_json(json_pack("{sI sI sI}", "dram_bytes", (json_int_t)r->dram_bytes,
                             "dram_arena_bytes", (json_int_t)r->dram_arena_bytes, "disk_bytes",
                             (json_int_t)r->disk_bytes));
    else
        printf("dram  %s (arena %s, the most it can be raised to)\ndisk  %s\n",
               size_str(r->dram_bytes, a), size_str(r->dram_arena_bytes, b),
               size_str(r->disk_bytes, c));
    di__kvstore__capacity_reply__free_unpacked(r, NULL);
    return 0;
}

/* ---------------------------------------------------------------- inspect */

/* Token ids from "1,2 3\n4" or a JSON array. *out malloc'd. */
static di_status parse_ids(const char *text, int32_t **out, size_t *n, di_error *e)
{
    const char *p = text;
    while (isspace((unsigned char)*p))
        p++;
    size_t cap = 1024, k = 0;
    int32_t *ids = malloc(cap * sizeof(*ids));
    if (!ids)
        return di_fail(e, DI_ENOMEM, "out of memory");
    int json = *p == '[';
    if (json)
        p++;
    for (;;) {
        while (isspace((unsigned char)*p) || *p == ',')
            p++;
        if (!*p || (json && *p == ']'))
            break;
        char *end;
        errno = 0;
        long long v = strtoll(p, &end, 10);
        if (end == p || errno || v < 0 || v > INT32_MAX) {
            free(ids);
            return di_fail(e, DI_EINVAL, "token id %zu: \"%.12s\" is not an id in [0, 2^31)", k,
                           p);
        }
        if (k == cap) {
            int32_t *more = realloc(ids, 2 * cap * sizeof(*ids));
            if (!more) {
                free(ids);
                return di_fail(e, DI_ENOMEM, "out of memory");
            }
            ids = more;
            cap *= 2;
        }
        ids[k++] = (int32_t)v;
        p = end;
    }
    if (json && *p != ']') {
        free(ids);
        return di_fail(e, DI_EINVAL, "the JSON array of token ids is not closed");
    }
    *out = ids;
    *n = k;
    return DI_OK;
}

/* Reads all of stdin into a NUL-terminated malloc'd string. */
static di_status read_stdin(char **out, size_t *len, di_error *e)
{
    size_t cap = 1 << 16, n = 0;
    char *buf = malloc(cap + 1);
    for (size_t k; buf && (k = fread(buf + n, 1, cap - n, stdin)) > 0;) {
        n += k;
        if (n == cap) {
            char *more = realloc(buf, 2 * cap + 1);
            if (!more) {
                free(buf);
                buf = NULL;
                break;
            }
            buf = more;
            cap *= 2;
        }
    }
    if (!buf)
        return di_fail(e, DI_ENOMEM, "out of memory reading stdin");
    buf[n] = '\0';
    *out = buf;
    *len = n;
    return DI_OK;
}

#ifdef DI_KVCTL_TOKENIZER
static di_status tokenize(const ctl *x, int32_t **ids, size_t *n, di_error *e)
{
    const char *path = x->s.tokenizer ? x->s.tokenizer : tok_default_path();
    if (!path)
        return di_fail(e, DI_ENOENT, "no tokenizer: give --tokenizer FILE or set $DI_TOKENIZER");
    char *text = NULL;
    size_t len = 0;
    di_status st = strcmp(x->s.text, "-") == 0 ? read_stdin(&text, &len, e)
                                                : rpc_load_file(x->s.text, &text, e);
    if (st == DI_OK && strcmp(x->s.text, "-") != 0)
        len = strlen(text);
    tok_tokenizer *t = NULL;
    if (st == DI_OK)
        st = tok_load_file(path, &t, e);
    tok_ids out = {0};
    if (st == DI_OK && x->s.bos) {
        if (tok_bos_id(t) < 0)
            st = di_fail(e, DI_EINVAL, "--bos: the tokenizer names no BOS token");
        else
            st = tok_ids_push(&out, tok_bos_id(t), e);
    }
    if (st == DI_OK)
        st = tok_encode(t, text, len, &out, e);
    if (st == DI_OK) {
        *ids = out.v; /* handed over: freed with free() like parse_ids' array */
        *n = out.n;
    } else
        tok_ids_free(&out);
    tok_free(t);
    free(text);
    return st;
}
#else
static di_status tokenize(const ctl *x, int32_t **ids, size_t *n, di_error *e)
{
    (void)x;
    (void)ids;
    (void)n;
    return di_fail(e, DI_EUNSUPPORTED,
                   "--text needs the tokenizer, not in this build (PCRE2 or utf8proc missing); "
                   "give token ids instead");
}
#endif

static di_status read_tokens(const ctl *x, int32_t **ids, size_t *n, di_error *e)
{
    if (x->s.text)
        return tokenize(x, ids, n, e);
    if (x->s.ids)
        return parse_ids(x->s.ids, ids, n, e);
    if (x->argc != 1)
        return di_fail(e, DI_EINVAL, "give a file of token ids or --ids 1,2,3");
    char *text;
    di_status st = rpc_load_file(x->argv[0], &text, e);
    if (st != DI_OK)
        return st;
    st = parse_ids(text, ids, n, e);
    free(text);
    if (st != DI_OK)
        di_error_prefix(e, "%s: ", x->argv[0]);
    return st;
}

static const char *where(const Di__Kvstore__InspectEntry *en, char *buf, size_t n)
{
    if (!en->present) {
        snprintf(buf, n, "-");
        return buf;
    }
    char d[32];
    kvcli_format_duration(en->expires_in_ms < 0 ? UINT64_MAX : (uint64_t)en->expires_in_ms, d,
                          sizeof(d));
    snprintf(buf, n, "%s, expires in %s%s", en->in_dram ? "DRAM+disk" : "disk", d,
             en->leases ? ", leased" : "");
    return buf;
}

static json_t *entry_json(const Di__Kvstore__InspectEntry *en)
{
    if (!en->present)
        return json_null();
    return json_pack("{sb sI sI sI}", "in_dram", en->in_dram, "bytes", (json_int_t)en->bytes,
                     "expires_in_ms", (json_int_t)en->expires_in_ms, "leases",
                     (json_int_t)en->leases);
}

static void inspect_print(const ctl *x, const Di__Kvstore__InspectReply *r, const kvkey *keys,
                          size_t n_tokens, size_t m)
{
    size_t hit = 0;
    while (hit < m && r->blocks[hit]->present)
        hit++;
    if (x->g.json) {
        json_t *blocks = json_array();
        for (size_t i = 0; i < m; i++) {
            char hex[65];
            kvkey_hex(&keys[i], hex);
            json_array_append_new(blocks, json_pack("{sI ss so so}", "block", (json_int_t)i, "key",
                                                    hex, "block_state", entry_json(r->blocks[i]),
                                                    "window_state", entry_json(r->windows[i])));
        }
        print_json(json_pack("{sI sI sI so}", "tokens", (json_int_t)n_tokens, "full_blocks",
                             (json_int_t)m, "cached_prefix_blocks", (json_int_t)hit, "blocks",
                             blocks));
        return;
    }
    printf("prompt: %zu tokens, %zu full blocks of 128 (%zu tokens in the partial last block "
           "are never cached)\n\n",
           n_tokens, m, n_tokens - m * 128);
    printf("%-6s %-13s %-18s %-40s %s\n", "block", "tokens", "key", "block",
           "window state at its end");
    for (size_t i = 0; i < m; i++) {
        char hex[65], span[32], b[64], w[64];
        kvkey_hex(&keys[i], hex);
        hex[16] = '\0';
        snprintf(span, sizeof(span), "%zu-%zu", i * 128, i * 128 + 127);
        printf("%-6zu %-13s %-18s %-40s %s\n", i, span, hex,
               where(r->blocks[i], b, sizeof(b)), where(r->windows[i], w, sizeof(w)));
    }
    size_t resume = 0;
    for (size_t k = hit; k > 0 && !resume; k--)
        if (r->windows[k - 1]->present)
            resume = k;
    printf("\ncached prefix: %zu blocks (%zu tokens); ", hit, hit * 128);
    if (resume)
        printf("resumable with its window state at token %zu\n", resume * 128);
    else
        printf("no window state inside it (a hit needs replay from the start)\n");
}

static int check_inspect(ctl *x)
{
    di_error e;
    if (read_tokens(x, &x->a.ids, &x->a.n_ids, &e) != DI_OK)
        return usage_error("inspect", e.msg);
    return 0;
}

static int cmd_inspect(ctl *x)
{
    di_error e;
    const int32_t *ids = x->a.ids;
    size_t n = x->a.n_ids;
    kvc_store_info info;
    if (kvc_info(x->c, &info, &e) != DI_OK)
        return fail("inspect", &e);
    size_t max = n / 128 + 1, m = 0;
    kvkey *keys = malloc(max * sizeof(*keys));
    ProtobufCBinaryData *b = malloc(max * sizeof(*b));
    di_status st = keys && b ? kvkey_chain(info.geometry.model_id, info.geometry.block_tokens,
                                           ids, n, keys, max, &m, &e)
                             : di_fail(&e, DI_ENOMEM, "out of memory");
    Di__Kvstore__InspectReply *r = NULL;
    if (st == DI_OK && m > KVC_MAX_LOOKUP)
        st = di_fail(&e, DI_EINVAL, "%zu blocks, at most %u", m, KVC_MAX_LOOKUP);
    if (st == DI_OK) {
        for (size_t i = 0; i < m; i++)
            b[i] = (ProtobufCBinaryData){KVKEY_BYTES, keys[i].b};
        Di__Kvstore__InspectRequest req = DI__KVSTORE__INSPECT_REQUEST__INIT;
        req.n_block_keys = m;
        req.block_keys = b;
        st = call(x, "Inspect", &req.base, &di__kvstore__inspect_reply__descriptor,
                  (ProtobufCMessage **)&r, &e);
    }
    if (st == DI_OK && (r->n_blocks != m || r->n_windows != m))
        st = di_fail(&e, DI_EPROTO, "the store answered for another number of blocks");
    if (st == DI_OK)
        inspect_print(x, r, keys, n, m);
    if (r)
        di__kvstore__inspect_reply__free_unpacked(r, NULL);
    free(keys);
    free(b);
    return st == DI_OK ? 0 : fail("inspect", &e);
}

/* ---------------------------------------------------------------- evict, compact */

static int parse_classes(const char *list, unsigned *mask)
{
    *mask = 0;
    if (!list) {
        *mask = 1u << KVKEY_BLOCK;
        return 0;
    }
    char buf[128];
    snprintf(buf, sizeof(buf), "%s", list);
    for (char *save = NULL, *t = strtok_r(buf, ",", &save); t; t = strtok_r(NULL, ",", &save)) {
        int c = kvkey_class_parse(t);
        if (c < 0)
            return -1;
        *mask |= 1u << c;
    }
    return *mask ? 0 : -1;
}

static int check_evict(ctl *x)
{
    if (parse_classes(x->s.cls, &x->a.mask) != 0 || (x->s.all == (x->argc > 0)))
        return usage_error("usage", "evict [--class block,window,handoff] [--dram-only] "
                                    "(--all | KEY...)  (KEY: 64 hex digits)");
    size_t n = (size_t)x->argc;
    x->a.keys = calloc(n ? n : 1, sizeof(*x->a.keys));
    if (!x->a.keys)
        return usage_error("evict", "out of memory");
    di_error e;
    for (size_t i = 0; i < n; i++)
        if (kvkey_parse_hex(x->argv[i], &x->a.keys[i], &e) != DI_OK)
            return usage_error("evict", e.msg);
    return 0;
}

static int cmd_evict(ctl *x)
{
    unsigned mask = x->a.mask;
    Di__Kvstore__EvictRequest req = DI__KVSTORE__EVICT_REQUEST__INIT;
    req.class_mask = mask;
    req.dram_only = x->s.dram_only;
    size_t n = (size_t)x->argc;
    Di__Kvstore__ObjRef *refs = calloc(n ? n : 1, sizeof(*refs));
    Di__Kvstore__ObjRef **ptrs = calloc(n ? n : 1, sizeof(*ptrs));
    kvkey *keys = x->a.keys;
    di_error e;
    di_status st = refs && ptrs ? DI_OK : di_fail(&e, DI_ENOMEM, "out of memory");
    int cls = 0;
    while (!(mask & (1u << cls)))
        cls++;
    for (size_t i = 0; st == DI_OK && i < n; i++) {
        di__kvstore__obj_ref__init(&refs[i]);
        refs[i].cls = (Di__Kvstore__ObjClass)cls;
        refs[i].key = (ProtobufCBinaryData){KVKEY_BYTES, keys[i].b};
        ptrs[i] = &refs[i];
    }
    req.n_items = n;
    req.items = ptrs;
    Di__Kvstore__EvictReply *r = NULL;
    if (st == DI_OK)
        st = call(x, "Evict", &req.base, &di__kvstore__evict_reply__descriptor,
                  (ProtobufCMessage **)&r, &e);
    if (st == DI_OK) {
        if (x->g.json)
            print_json(json_pack("{sI sI}", "evicted", (json_int_t)r->evicted, "skipped_leased",
                                 (json_int_t)r->skipped_leased));
        else
            printf("evicted %llu objects%s; %llu leased objects left alone\n",
                   (unsigned long long)r->evicted, x->s.dram_only ? " from DRAM" : "",
                   (unsigned long long)r->skipped_leased);
        di__kvstore__evict_reply__free_unpacked(r, NULL);
    }
    free(refs);
    free(ptrs);
    return st == DI_OK ? 0 : fail("evict", &e);
}

static int cmd_compact(ctl *x)
{
    Di__Kvstore__CompactRequest req = DI__KVSTORE__COMPACT_REQUEST__INIT;
    Di__Kvstore__CompactReply *r;
    di_error e;
    fprintf(stderr, "di-kvctl: compacting (removing expired objects, then RocksDB files)...\n");
    if (call(x, "Compact", &req.base, &di__kvstore__compact_reply__descriptor,
             (ProtobufCMessage **)&r, &e) != DI_OK)
        return fail("compact", &e);
    char a[32], b[32];
    if (x->g.json)
        print_json(json_pack("{sI sI sI}", "expired", (json_int_t)r->expired, "sst_bytes_before",
                             (json_int_t)r->sst_bytes_before, "sst_bytes_after",
                             (json_int_t)r->sst_bytes_after));
    else
        printf("expired objects removed: %llu; RocksDB files %s -> %s\n",
               (unsigned long long)r->expired, size_str(r->sst_bytes_before, a),
               size_str(r->sst_bytes_after, b));
    di__kvstore__compact_reply__free_unpacked(r, NULL);
    return 0;
}

/* ---------------------------------------------------------------- the table */

typedef struct subcommand {
    const char *name;        /* as typed */
    int (*check)(ctl *x);    /* arguments into x->a before connecting: 0, or 2 (printed);
                                NULL: takes none */
    int (*run)(ctl *x);      /* exit status */
    const char *usage;       /* arguments */
    const char *help;        /* one line */
} subcommand;

static const subcommand subcommands[] = {
    {"stats", NULL, cmd_stats, "",
     "objects, bytes and capacity per tier, hit rate, evictions, expirations, transfer rates"},
    {"ttl", check_ttl, cmd_ttl, "get | set CLASS DUR", "show or change a class's TTL (applies at once)"},
    {"capacity", check_capacity, cmd_capacity, "get | set dram|disk SIZE",
     "show or change a tier's capacity (lowering evicts)"},
    {"inspect", check_inspect, cmd_inspect, "FILE | --ids 1,2,3 | --text FILE",
     "which blocks and window states of a prompt are cached, and when they expire"},
    {"evict", check_evict, cmd_evict, "[--class LIST] [--dram-only] (--all | KEY...)",
     "remove unleased objects (or only their DRAM copies)"},
    {"compact", NULL, cmd_compact, "", "remove expired objects now and compact RocksDB"},
};
#define N_SUB (sizeof(subcommands) / sizeof(subcommands[0]))

static void usage(FILE *f)
{
    fprintf(f, "usage: di-kvctl [global options] COMMAND [args]\n\n"
               "Administers a running di-kvstore with its admin token. Tables by default,\n"
               "--json for scripts. Exit status: 0 ok, 1 the store refused or failed, 2 bad "
               "usage.\n\ncommands:\n");
    for (size_t i = 0; i < N_SUB; i++)
        fprintf(f, "  %-9s %-44s %s\n", subcommands[i].name, subcommands[i].usage,
                subcommands[i].help);
    fprintf(f, "\nglobal options:\n");
    svc_opts_print(f, global_rows, N_GLOBAL);
    fprintf(f, "\ncommand options:\n");
    svc_opts_print(f, sub_rows, N_SUB_ROWS);
    fprintf(f, "\ninspect reads token ids as a JSON array or separated by spaces, commas or "
               "newlines;\n--text tokenizes a prompt with the same tokenizer as the router.\n");
}

/* The PEM files of TLS: pem[0] CA, pem[1] client certificate, pem[2] its key. */
static int open_client(ctl *x, char **pem)
{
    di_error e;
    if (!x->g.tls_cert != !x->g.tls_key) {
        di_fail(&e, DI_EINVAL, "--tls-cert and --tls-key go together");
        return fail("auth", &e);
    }
    if ((x->g.tls_ca && rpc_load_file(x->g.tls_ca, &pem[0], &e) != DI_OK) ||
        (x->g.tls_cert && rpc_load_file(x->g.tls_cert, &pem[1], &e) != DI_OK) ||
        (x->g.tls_key && rpc_load_file(x->g.tls_key, &pem[2], &e) != DI_OK))
        return fail("auth", &e);
    kvc_options o;
    kvc_options_default(&o);
    o.target = x->g.target;
    o.token = x->g.token;
    o.tls_ca_pem = pem[0];
    o.tls_cert_pem = pem[1];
    o.tls_key_pem = pem[2];
    o.tls_target_name = x->g.tls_name;
    o.deadline_ms = (uint32_t)x->g.deadline_ms;
    o.verify_threads = 0;
    if (kvc_data_path_parse(x->g.data_path, &o.data_path, &e) != DI_OK) {
        fprintf(stderr, "di-kvctl: --data-path: %s\n", e.msg);
        return 2;
    }
    if (kvc_open(&o, &x->c, &e) != DI_OK)
        return fail("connecting", &e);
    return 0;
}

int main(int argc, char **argv)
{
    ctl x;
    memset(&x, 0, sizeof(x));
    di_error e;
    int next = 1, help = 0;
    const char *env_target = getenv("DI_KVSTORE_TARGET");
    if (svc_opts_defaults(global_rows, N_GLOBAL, &x.g, &e) ||
        svc_opts_parse(global_rows, N_GLOBAL, argc, argv, 1, &x.g, &next, &help, &e) ||
        svc_opts_load_secrets(global_rows, N_GLOBAL, &x.g, &e)) {
        fprintf(stderr, "di-kvctl: %s\n", e.msg);
        svc_opts_free(global_rows, N_GLOBAL, &x.g);
        return 2;
    }
    if (help || next >= argc) {
        svc_opts_free(global_rows, N_GLOBAL, &x.g);
        usage(help ? stdout : stderr);
        return help ? di_close_stdout("di-kvctl", 0) : 2;
    }
    const subcommand *sub = NULL;
    char **pos = NULL, *pem[3] = {NULL, NULL, NULL};
    int rc = 2;
    if (env_target && strcmp(x.g.target, "127.0.0.1:9470") == 0) {
        if (di_hostport_parse(env_target, false, NULL, &e) != DI_OK) {
            fprintf(stderr, "di-kvctl: $DI_KVSTORE_TARGET: %s\n", e.msg);
            goto done;
        }
        x.g.target = env_target;
    }
    for (size_t i = 0; i < N_SUB; i++)
        if (strcmp(argv[next], subcommands[i].name) == 0)
            sub = &subcommands[i];
    if (!sub) {
        fprintf(stderr, "di-kvctl: unknown command \"%s\" (see --help)\n", argv[next]);
        goto done;
    }
    /* Subcommand options may come anywhere after the command. */
    pos = calloc((size_t)argc, sizeof(char *));
    int np = 0;
    for (int i = next + 1; i < argc;) {
        int stop = i, h = 0;
        if (svc_opts_parse(sub_rows, N_SUB_ROWS, argc, argv, i, &x.s, &stop, &h, &e) != DI_OK) {
            fprintf(stderr, "di-kvctl: %s %s\n", sub->name, e.msg);
            goto done;
        }
        help |= h;
        if (stop < argc)
            pos[np++] = argv[stop++];
        i = stop;
    }
    if (help) {
        printf("usage: di-kvctl %s %s\n  %s\n", sub->name, sub->usage, sub->help);
        rc = di_close_stdout("di-kvctl", 0);
        goto done;
    }
    x.argc = np;
    x.argv = pos;
    rc = sub->check ? sub->check(&x) : 0;
    if (rc == 0)
        rc = open_client(&x, pem);
    if (rc == 0)
        rc = sub->run(&x);
    kvc_close(x.c);
    rc = di_close_stdout("di-kvctl", rc);
done:
    svc_opts_free(global_rows, N_GLOBAL, &x.g);
    free(x.a.keys);
    free(x.a.ids);
    for (int i = 0; i < 3; i++)
        free(pem[i]);
    free(pos);
    return rc;
}
