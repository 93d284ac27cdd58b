/* The store's data path under attack (docs/kvstore.md, "Security"): a real di-kvstore with
 * tokens; an engine-token holder tries to read or write what its leases and allocations do not
 * cover, through the client API and through raw UCX messages; a process of another uid tries to
 * read the arena; nothing of the store listens beyond --listen; mutual TLS admits a client with
 * a certificate and refuses one without. */
#include <criterion/criterion.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/uio.h>
#include <sys/wait.h>
#include <unistd.h>

#include "common/net/kvstore.pb-c.h"
#include "common/net/rpc.h"
#include "common/net/ucx_xport.h"
#include "common/util/clock.h"
#include "harness.h"
#include "helpers.h"

#define BLOCK 4224

static const char *const engine = "engine-secret", *const admin = "admin-secret";

static void write_file(const char *path, const char *text)
{
    FILE *f = fopen(path, "w");
    cr_assert_not_null(f);
    fputs(text, f);
    fclose(f);
}

static uint8_t *object(const kvkey *k, uint64_t salt)
{
    uint8_t *p = malloc(BLOCK);
    kv_geometry g;
    kv_geometry_v41_flash(5, &g);
    th_fill_object(p, BLOCK, KV_BLOCK_MAGIC, &g, k, salt);
    return p;
}

/* The object under k holds exactly the bytes of (k, salt). */
static void check_object(kvc_client *c, const kvkey *k, uint64_t salt)
{
    uint8_t *got = calloc(1, BLOCK), *want = object(k, salt);
    di_error e;
    cr_assert_eq(kvc_get1(c, KVKEY_BLOCK, k, got, BLOCK, NULL, &e), DI_OK, "%s", e.msg);
    cr_assert_eq(memcmp(got, want, BLOCK), 0, "the object changed");
    free(got);
    free(want);
}

/* A store with engine and admin tokens; dir receives the data directory's parent. */
static void start_store(th_store *s, char *dir)
{
    static char tok[300], adm[300], data[300];
    th_tmpdir(dir);
    snprintf(tok, sizeof(tok), "%s/engine.token", dir);
    snprintf(adm, sizeof(adm), "%s/admin.token", dir);
    snprintf(data, sizeof(data), "%s/data", dir);
    write_file(tok, "engine-secret\n");
    write_file(adm, "admin-secret\n");
    const char *args[] = {"--block-bytes", "4224", "--window-bytes", "8320", "--dram-bytes",
                          "8MiB", "--token-file", tok, "--admin-token-file", adm, NULL};
    th_store_start(s, data, args);
}

/* The admin token still works and the engine token is still no admin. */
static void admin_intact(const th_store *s)
{
    Di__Kvstore__StatsRequest req = DI__KVSTORE__STATS_REQUEST__INIT;
    uint8_t buf[16], *rep = NULL;
    size_t n = di__kvstore__stats_request__pack(&req, buf), len = 0;
    di_error e;
    kvc_client *a = th_client(s, admin), *x = th_client(s, engine);
    cr_assert_eq(kvc_call(a, "Stats", buf, n, &rep, &len, &e), DI_OK, "admin: %s", e.msg);
    free(rep);
    rep = NULL;
    cr_assert_eq(kvc_call(x, "Stats", buf, n, &rep, &len, &e), DI_EPERM, "engine as admin");
    free(rep);
    kvc_close(a);
    kvc_close(x);
}

/* The store's UCX worker address, from an authenticated Connect. */
static void worker_address(kvc_client *c, uint8_t *addr, size_t *len)
{
    Di__Kvstore__ConnectRequest req = DI__KVSTORE__CONNECT_REQUEST__INIT;
    uint8_t buf[64], *rep = NULL;
    size_t n = di__kvstore__connect_request__pack(&req, buf), rlen = 0;
    di_error e;
    cr_assert_eq(kvc_call(c, "Connect", buf, n, &rep, &rlen, &e), DI_OK, "%s", e.msg);
    Di__Kvstore__ConnectReply *r = di__kvstore__connect_reply__unpack(NULL, rlen, rep);
    cr_assert_not_null(r);
    cr_assert_leq(r->worker_address.len, 4096);
    memcpy(addr, r->worker_address.data, r->worker_address.len);
    *len = r->worker_address.len;
    di__kvstore__connect_reply__free_unpacked(r, NULL);
    free(rep);
}

/* An allocation made with a raw Alloc call: its id and ticket, nothing sent yet. */
static void raw_alloc(kvc_client *c, const kvkey *k, uint64_t *id, ucxt_ticket *t)
{
    Di__Kvstore__AllocItem it = DI__KVSTORE__ALLOC_ITEM__INIT, *p = &it;
    it.cls = DI__KVSTORE__OBJ_CLASS__BLOCK;
    it.key = (ProtobufCBinaryData){KVKEY_BYTES, (uint8_t *)k->b};
    it.bytes = BLOCK;
    Di__Kvstore__AllocRequest req = DI__KVSTORE__ALLOC_REQUEST__INIT;
    req.n_items = 1;
    req.items = &p;
    uint8_t buf[256], *rep = NULL;
    size_t n = di__kvstore__alloc_request__pack(&req, buf), len = 0;
    di_error e;
    cr_assert_eq(kvc_call(c, "Alloc", buf, n, &rep, &len, &e), DI_OK, "%s", e.msg);
    Di__Kvstore__AllocReply *r = di__kvstore__alloc_reply__unpack(NULL, len, rep);
    cr_assert(r && r->n_results == 1 && r->results[0]->status == DI_OK);
    cr_assert_eq(r->results[0]->ticket.len, sizeof(t->b));
    *id = r->results[0]->alloc_id;
    memcpy(t->b, r->results[0]->ticket.data, sizeof(t->b));
    di__kvstore__alloc_reply__free_unpacked(r, NULL);
    free(rep);
}

/* Commit (or Abort) of one allocation; returns the item's status. */
static di_status settle(kvc_client *c, const char *method, uint64_t id)
{
    Di__Kvstore__CommitRequest req = DI__KVSTORE__COMMIT_REQUEST__INIT;
    req.n_alloc_ids = 1;
    req.alloc_ids = &id;
    if (strcmp(method, "Abort") == 0)
        req.base.descriptor = &di__kvstore__abort_request__descriptor;
    uint8_t buf[64], *rep = NULL;
    size_t n = protobuf_c_message_pack(&req.base, buf), len = 0;
    di_error e;
    cr_assert_eq(kvc_call(c, method, buf, n, &rep, &len, &e), DI_OK, "%s", e.msg);
    Di__Kvstore__CommitReply *r = di__kvstore__commit_reply__unpack(NULL, len, rep);
    cr_assert(r && r->n_results == 1);
    di_status st = r->results[0]->status;
    di__kvstore__commit_reply__free_unpacked(r, NULL);
    free(rep);
    return st;
}

/* A raw request that must be refused: no byte arrives, no byte of buf changes. */
static void refused(ucxt_peer *p, int is_put, const ucxt_ticket *t, uint64_t len, di_status want,
                    const char *what)
{
    uint8_t hdr[24] = {0};
    memcpy(hdr + 8, t->b, sizeof(t->b));
    uint8_t *buf = malloc(len ? len : 1), *data = malloc(len ? len : 1);
    memset(buf, 0x5a, len ? len : 1);
    memset(data, 0xee, len ? len : 1);
    di_status st = DI_OK;
    uint64_t got = 0;
    di_error e;
    cr_assert_eq(ucxt_raw_request(p, is_put, hdr, sizeof(hdr), data, is_put ? len : 0, buf,
                                  is_put ? 0 : len, &st, &got, di_mono_ns() + 5000000000ull, &e),
                 DI_OK, "%s: %s", what, e.msg);
    cr_assert_eq(st, want, "%s: %s, not %s", what, di_status_name(st), di_status_name(want));
    cr_assert_eq(got, 0, "%s: %llu bytes arrived", what, (unsigned long long)got);
    for (uint64_t i = 0; !is_put && i < len; i++)
        cr_assert_eq(buf[i], 0x5a, "%s: byte %llu written", what, (unsigned long long)i);
    free(buf);
    free(data);
}

Test(security, an_engine_token_reaches_only_what_its_leases_and_allocations_cover,
     .timeout = 120)
{
    char dir[256];
    th_store s;
    start_store(&s, dir);
    kvc_client *victim = th_client(&s, engine), *mallory = th_client(&s, engine);
    di_error e;
    kvkey a = th_key(1), b = th_key(2), v = th_key(3);
    uint8_t *pa = object(&a, 1), *pb = object(&b, 2);
    cr_assert_eq(kvc_put1(victim, KVKEY_BLOCK, &a, pa, BLOCK, &e), DI_OK, "%s", e.msg);
    cr_assert_eq(kvc_put1(victim, KVKEY_BLOCK, &b, pb, BLOCK, &e), DI_OK, "%s", e.msg);

    /* Raw UCX to the store's worker, with the address an engine token gets. */
    uint8_t addr[4096];
    size_t addr_len = 0;
    worker_address(mallory, addr, &addr_len);
    ucxt_ctx *ux;
    ucxt_peer *p;
    cr_assert_eq(ucxt_create(0, NULL, &ux, &e), DI_OK, "%s", e.msg);
    cr_assert_eq(ucxt_peer_connect(ux, addr, addr_len, 0, &p, &e), DI_OK, "%s", e.msg);

    /* (a) No address or key of the store's memory exists to aim at: forged and zero tickets,
     * tickets naming ids that were never issued, get and put alike. */
    ucxt_ticket t;
    memset(&t, 0, sizeof(t));
    refused(p, 0, &t, BLOCK, DI_EAUTH, "zero ticket get");
    refused(p, 1, &t, BLOCK, DI_EAUTH, "zero ticket put");
    for (int i = 0; i < 16; i++) {
        for (int k = 0; k < UCXT_TICKET_BYTES; k++)
            t.b[k] = (uint8_t)(rand() >> 3);
        refused(p, i & 1, &t, BLOCK, DI_EAUTH, "random ticket");
    }

    /* (b) An object held under the victim's lease: its lease id with a guessed secret. */
    kvc_lease vl;
    cr_assert_eq(kvc_acquire(victim, KVKEY_BLOCK, &a, 30000, &vl, &e), DI_OK, "%s", e.msg);
    memcpy(t.b, vl.ticket, 8); /* the id half is not secret */
    for (int k = 8; k < UCXT_TICKET_BYTES; k++)
        t.b[k] = (uint8_t)(vl.ticket[k] ^ 0x01);
    refused(p, 0, &t, BLOCK, DI_EAUTH, "victim's lease with a wrong secret");
    /* A get ticket is no put ticket: the victim's own ticket cannot write. */
    memcpy(t.b, vl.ticket, sizeof(t.b));
    refused(p, 1, &t, BLOCK, DI_EAUTH, "get ticket used for a put");
    uint8_t *buf = malloc(BLOCK);
    cr_assert_eq(kvc_read(victim, KVKEY_BLOCK, &a, &vl, buf, BLOCK, &e), DI_OK, "%s", e.msg);
    cr_assert_eq(memcmp(buf, pa, BLOCK), 0);
    /* Once used, the ticket is spent, for the victim and for anyone who copied it. */
    refused(p, 0, &t, BLOCK, DI_EAUTH, "reused get ticket");
    cr_assert_eq(kvc_read(victim, KVKEY_BLOCK, &a, &vl, buf, BLOCK, &e), DI_EAUTH,
                 "a second read with one ticket");
    cr_assert_eq(kvc_release(victim, &vl, &e), DI_OK, "%s", e.msg);
    /* A released lease's ticket is gone too. */
    kvc_lease rl;
    cr_assert_eq(kvc_acquire(mallory, KVKEY_BLOCK, &b, 30000, &rl, &e), DI_OK, "%s", e.msg);
    cr_assert_eq(kvc_release(mallory, &rl, &e), DI_OK, "%s", e.msg);
    memcpy(t.b, rl.ticket, sizeof(t.b));
    refused(p, 0, &t, BLOCK, DI_EAUTH, "ticket of a released lease");

    /* (c) After the lease expired. */
    kvc_lease ml;
    cr_assert_eq(kvc_acquire(mallory, KVKEY_BLOCK, &b, 100, &ml, &e), DI_OK, "%s", e.msg);
    usleep(400 * 1000);
    memcpy(t.b, ml.ticket, sizeof(t.b));
    refused(p, 0, &t, BLOCK, DI_ETIMEDOUT, "expired lease");
    refused(p, 0, &t, BLOCK, DI_EAUTH, "expired lease, again");

    /* (d) The victim's allocation in flight: allocated, bytes not yet sent. */
    uint64_t vid, mid;
    ucxt_ticket vt, mt;
    raw_alloc(victim, &v, &vid, &vt);
    memcpy(t.b, vt.b, 8);
    memset(t.b + 8, 0, 8);
    refused(p, 1, &t, BLOCK, DI_EAUTH, "victim's allocation with a wrong secret");
    memcpy(t.b, vt.b, sizeof(t.b));
    refused(p, 0, &t, BLOCK, DI_EAUTH, "put ticket used for a get");
    /* Mallory's own allocation: not one byte more than it covers, nor fewer. */
    kvkey m = th_key(4);
    raw_alloc(mallory, &m, &mid, &mt);
    refused(p, 1, &mt, BLOCK + 64, DI_EINVAL, "put longer than the allocation");
    refused(p, 1, &mt, BLOCK - 64, DI_EINVAL, "put shorter than the allocation");
    /* Its commit without bytes fails, and drops the allocation. */
    cr_assert_eq(settle(mallory, "Commit", mid), DI_ESTATE);
    /* The victim's bytes go in with its ticket and commit; a second put with it is refused. */
    uint8_t *pv = object(&v, 3);
    ucxt_xfer x = {.ticket = vt, .buf = pv, .len = BLOCK};
    cr_assert_eq(ucxt_send(p, &x, 1, 1, di_mono_ns() + 5000000000ull, &e), DI_OK, "%s", e.msg);
    cr_assert_eq(x.status, DI_OK, "%s", di_status_name(x.status));
    refused(p, 1, &vt, BLOCK, DI_EAUTH, "reused put ticket");
    cr_assert_eq(settle(victim, "Commit", vid), DI_OK);

    /* Raw AM ids and malformed headers: ignored, the store keeps serving. */
    di_status st;
    uint64_t got;
    cr_assert_eq(ucxt_raw_request(p, 0, "short", 5, NULL, 0, buf, BLOCK, &st, &got,
                                  di_mono_ns() + 300000000ull, &e),
                 DI_ETIMEDOUT, "a malformed GET gets no reply");
    p = ucxt_peer_close(p);
    ux = ucxt_destroy(ux);

    /* Nothing changed: the objects, the admin token's power, the store's service. */
    check_object(mallory, &a, 1);
    check_object(mallory, &b, 2);
    check_object(mallory, &v, 3);
    kvc_item mi = {.cls = KVKEY_BLOCK, .key = m, .buf = buf, .cap = BLOCK};
    cr_assert_eq(kvc_get(mallory, &mi, 1, &e), DI_OK, "%s", e.msg);
    cr_assert_eq(mi.status, DI_ENOENT, "the uncommitted allocation is not an object");
    admin_intact(&s);
    free(pa);
    free(pb);
    free(pv);
    free(buf);
    kvc_close(victim);
    kvc_close(mallory);
    th_store_stop(&s);
    th_rmtree(dir);
}

/* The arena: the largest anonymous private mapping of the store (its size is --dram-bytes). */
static int find_arena(pid_t pid, uint64_t bytes, uint64_t *start)
{
    char path[64], line[512];
    snprintf(path, sizeof(path), "/proc/%d/maps", (int)pid);
    FILE *f = fopen(path, "r");
    if (!f)
        return 0;
    int found = 0;
    while (fgets(line, sizeof(line), f)) {
        unsigned long lo, hi;
        char perms[8];
        unsigned long off;
        char dev[16];
        unsigned long inode;
        char name[300] = "";
        if (sscanf(line, "%lx-%lx %7s %lx %15s %lu %299s", &lo, &hi, perms, &off, dev, &inode,
                   name) < 6)
            continue;
        if (hi - lo == bytes && inode == 0 && name[0] == 0 && perms[3] == 'p') {
            *start = lo;
            found = 1;
        }
        cr_assert(!strstr(name, "/dev/shm") || strstr(line, "(deleted)"),
                  "a named shared-memory file stays mapped: %s", line);
    }
    fclose(f);
    return found;
}

Test(security, the_arena_is_private_and_nothing_listens_beyond_listen, .timeout = 60)
{
    char dir[256];
    th_store s;
    start_store(&s, dir);
    kvc_client *c = th_client(&s, engine);
    kvkey k = th_key(9);
    uint8_t *obj = object(&k, 9);
    di_error e;
    cr_assert_eq(kvc_put1(c, KVKEY_BLOCK, &k, obj, BLOCK, &e), DI_OK, "%s", e.msg);
    uint64_t arena = 0;
    cr_assert(find_arena(s.pid, 8u << 20, &arena), "no anonymous private 8 MiB arena in maps");

    /* Every listening TCP socket of the store is the gRPC port on 127.0.0.1. */
    char path[300], link[300];
    snprintf(path, sizeof(path), "/proc/%d/fd", (int)s.pid);
    DIR *d = opendir(path);
    cr_assert_not_null(d);
    unsigned long inodes[256];
    int ni = 0;
    for (struct dirent *de; (de = readdir(d)) != NULL && ni < 256;) {
        char fd[600];
        snprintf(fd, sizeof(fd), "%s/%s", path, de->d_name);
        ssize_t n = readlink(fd, link, sizeof(link) - 1);
        if (n <= 0)
            continue;
        link[n] = 0;
        unsigned long ino;
        if (sscanf(link, "socket:[%lu]", &ino) == 1)
            inodes[ni++] = ino;
    }
    closedir(d);
    int listening = 0;
    const char *tables[] = {"/proc/net/tcp", "/proc/net/tcp6"};
    for (int t = 0; t < 2; t++) {
        FILE *f = fopen(tables[t], "r");
        if (!f)
            continue;
        char line[512];
        while (fgets(line, sizeof(line), f)) {
            char local[64], remote[64];
            unsigned st;
            unsigned long ino;
            if (sscanf(line, " %*d: %63s %63s %x %*s %*s %*s %*s %*s %lu", local, remote, &st,
                       &ino) != 4 || st != 0x0A)
                continue;
            for (int i = 0; i < ni; i++) {
                if (inodes[i] != ino)
                    continue;
                char v4[32], mapped[64]; /* 127.0.0.1, plain or as ::ffff:127.0.0.1 */
                snprintf(v4, sizeof(v4), "0100007F:%04X", s.port);
                snprintf(mapped, sizeof(mapped), "0000000000000000FFFF00000100007F:%04X", s.port);
                cr_assert(strcmp(local, v4) == 0 || strcmp(local, mapped) == 0,
                          "the store listens on %s (%s)", local, tables[t]);
                listening++;
            }
        }
        fclose(f);
    }
    cr_assert_eq(listening, 1, "one listening socket: gRPC on --listen");

    /* A process of another uid cannot read the arena: not through /proc/PID/mem, not with
     * process_vm_readv, not through any file in /dev/shm. */
    if (geteuid() != 0) {
        kvc_close(c);
        th_store_stop(&s);
        th_rmtree(dir);
        cr_skip_test("not root: cannot drop to another uid here");
    }
    pid_t pid = fork();
    if (pid == 0) {
        if (setgroups(0, NULL) != 0 || setresgid(65534, 65534, 65534) != 0 ||
            setresuid(65534, 65534, 65534) != 0)
            _exit(10);
        char memp[64];
        snprintf(memp, sizeof(memp), "/proc/%d/mem", (int)s.pid);
        if (open(memp, O_RDONLY) >= 0)
            _exit(11);
        uint8_t b[64];
        struct iovec l = {b, sizeof(b)}, r = {(void *)(uintptr_t)arena, sizeof(b)};
        if (process_vm_readv(s.pid, &l, 1, &r, 1, 0) >= 0)
            _exit(12);
        DIR *sh = opendir("/dev/shm");
        for (struct dirent *de; sh && (de = readdir(sh)) != NULL;) {
            char f[600];
            snprintf(f, sizeof(f), "/dev/shm/%s", de->d_name);
            if (de->d_name[0] != '.' && open(f, O_RDONLY) >= 0 && strstr(f, "ucx"))
                _exit(13);
        }
        _exit(0);
    }
    int status = 0;
    waitpid(pid, &status, 0);
    cr_assert(WIFEXITED(status), "the unprivileged child crashed");
    cr_assert_neq(WEXITSTATUS(status), 10, "could not drop to uid 65534");
    cr_assert_neq(WEXITSTATUS(status), 11, "uid 65534 opened the store's memory");
    cr_assert_neq(WEXITSTATUS(status), 12, "uid 65534 read the arena with process_vm_readv");
    cr_assert_neq(WEXITSTATUS(status), 13, "uid 65534 opened a UCX shared-memory file");
    cr_assert_eq(WEXITSTATUS(status), 0);
    free(obj);
    kvc_close(c);
    th_store_stop(&s);
    th_rmtree(dir);
}

/* openssl into dir: a CA, a server certificate for 127.0.0.1 and a client certificate, both
 * signed by the CA, and a client certificate signed by nobody the store trusts. */
static void make_pki(const char *dir)
{
    char cmd[4096];
    snprintf(cmd, sizeof(cmd),
             "cd %s && K='-newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes' && "
             "openssl req -x509 $K -keyout ca.key -out ca.pem -days 1 -subj /CN=ca && "
             "openssl req $K -keyout srv.key -out srv.csr -subj /CN=localhost && "
             "printf 'subjectAltName=IP:127.0.0.1,DNS:localhost' > san && "
             "openssl x509 -req -in srv.csr -CA ca.pem -CAkey ca.key -CAcreateserial "
             "-out srv.pem -days 1 -extfile san && "
             "openssl req $K -keyout cli.key -out cli.csr -subj /CN=engine && "
             "openssl x509 -req -in cli.csr -CA ca.pem -CAkey ca.key -CAcreateserial "
             "-out cli.pem -days 1 && "
             "openssl req -x509 $K -keyout rogue.key -out rogue.pem -days 1 -subj /CN=rogue",
             dir);
    cr_assert_eq(system(cmd), 0, "openssl could not make the certificates");
}

static char *load(const char *dir, const char *name)
{
    char path[400];
    snprintf(path, sizeof(path), "%s/%s", dir, name);
    char *pem = NULL;
    cr_assert_eq(rpc_load_file(path, &pem, NULL), DI_OK, "%s", path);
    return pem;
}

Test(security, mutual_tls_admits_a_signed_client_certificate_only, .timeout = 60)
{
    char dir[256], data[300], cert[300], key[300], ca[300];
    th_tmpdir(dir);
    make_pki(dir);
    snprintf(data, sizeof(data), "%s/data", dir);
    snprintf(cert, sizeof(cert), "%s/srv.pem", dir);
    snprintf(key, sizeof(key), "%s/srv.key", dir);
    snprintf(ca, sizeof(ca), "%s/ca.pem", dir);
    th_store s;
    const char *args[] = {"--block-bytes", "4224", "--window-bytes", "8320", "--dram-bytes",
                          "8MiB", "--tls-cert", cert, "--tls-key", key, "--tls-client-ca", ca,
                          NULL};
    th_store_start(&s, data, args);
    char *ca_pem = load(dir, "ca.pem"), *cli = load(dir, "cli.pem"), *cli_key = load(dir, "cli.key");
    char *rogue = load(dir, "rogue.pem"), *rogue_key = load(dir, "rogue.key");
    kvc_options o;
    kvc_options_default(&o);
    o.target = s.target;
    o.tls_ca_pem = ca_pem;
    o.deadline_ms = 2000;
    di_error e;
    kvkey k = th_key(5);
    uint8_t *obj = object(&k, 5), *buf = malloc(BLOCK);

    /* With the signed certificate: puts and gets work. */
    kvc_client *good;
    o.tls_cert_pem = cli;
    o.tls_key_pem = cli_key;
    cr_assert_eq(kvc_open(&o, &good, &e), DI_OK, "%s", e.msg);
    cr_assert_eq(kvc_put1(good, KVKEY_BLOCK, &k, obj, BLOCK, &e), DI_OK, "%s", e.msg);
    cr_assert_eq(kvc_get1(good, KVKEY_BLOCK, &k, buf, BLOCK, NULL, &e), DI_OK, "%s", e.msg);
    cr_assert_eq(memcmp(buf, obj, BLOCK), 0);
    kvc_close(good);

    /* Without a certificate, or with one the CA did not sign: refused. */
    kvc_client *bare, *bad;
    o.tls_cert_pem = o.tls_key_pem = NULL;
    cr_assert_eq(kvc_open(&o, &bare, &e), DI_OK, "%s", e.msg);
    cr_assert_neq(kvc_get1(bare, KVKEY_BLOCK, &k, buf, BLOCK, NULL, &e), DI_OK,
                  "a client without a certificate was served");
    kvc_close(bare);
    o.tls_cert_pem = rogue;
    o.tls_key_pem = rogue_key;
    cr_assert_eq(kvc_open(&o, &bad, &e), DI_OK, "%s", e.msg);
    cr_assert_neq(kvc_get1(bad, KVKEY_BLOCK, &k, buf, BLOCK, NULL, &e), DI_OK,
                  "a client with a certificate of another CA was served");
    kvc_close(bad);

    /* A certificate without its key is a usage error. */
    o.tls_key_pem = NULL;
    cr_assert_eq(kvc_open(&o, &bad, &e), DI_EINVAL);

    /* di-kvctl: --tls-cert/--tls-key get in, without them not. */
    char cmd[2048];
    snprintf(cmd, sizeof(cmd),
             "%s/kvstore/di-kvctl --target %s --tls-ca %s --tls-cert %s/cli.pem --tls-key "
             "%s/cli.key --deadline 5s stats >/dev/null 2>&1",
             getenv("DI_BUILD_ROOT"), s.target, ca, dir, dir);
    cr_assert_eq(system(cmd), 0, "di-kvctl with a client certificate");
    snprintf(cmd, sizeof(cmd),
             "%s/kvstore/di-kvctl --target %s --tls-ca %s --deadline 2s stats >/dev/null 2>&1",
             getenv("DI_BUILD_ROOT"), s.target, ca);
    cr_assert_neq(system(cmd), 0, "di-kvctl without a client certificate got in");
    free(ca_pem);
    free(cli);
    free(cli_key);
    free(rogue);
    free(rogue_key);
    free(obj);
    free(buf);
    th_store_stop(&s);
    th_rmtree(dir);
}

/* ---------------------------------------------------------------- the gRPC data path */

/* A raw Put of one object (cls, key, bytes) by c; the call's status, and the item's in *item. */
static di_status raw_put(kvc_client *c, int cls, const kvkey *k, const uint8_t *data,
                         size_t len, di_status *item)
{
    Di__Kvstore__PutItem it = DI__KVSTORE__PUT_ITEM__INIT, *p = &it;
    it.cls = (Di__Kvstore__ObjClass)cls;
    it.key = (ProtobufCBinaryData){KVKEY_BYTES, (uint8_t *)k->b};
    it.data = (ProtobufCBinaryData){len, (uint8_t *)data};
    Di__Kvstore__PutRequest req = DI__KVSTORE__PUT_REQUEST__INIT;
    req.n_items = 1;
    req.items = &p;
    size_t n = di__kvstore__put_request__get_packed_size(&req), rlen = 0;
    uint8_t *buf = malloc(n), *rep = NULL;
    cr_assert_not_null(buf);
    di__kvstore__put_request__pack(&req, buf);
    di_error e;
    di_status st = kvc_call(c, "Put", buf, n, &rep, &rlen, &e);
    free(buf);
    if (st != DI_OK)
        return st;
    Di__Kvstore__PutReply *r = di__kvstore__put_reply__unpack(NULL, rlen, rep);
    cr_assert(r && r->n_results == 1, "a PutReply with one result");
    *item = r->results[0]->status;
    di__kvstore__put_reply__free_unpacked(r, NULL);
    free(rep);
    return DI_OK;
}

/* A raw Get of n copies of one key by c; the call's status, the first item's status in *item
 * and its bytes in out (cap bytes at most) with their count in *got. */
static di_status raw_get(kvc_client *c, const kvkey *k, size_t n, di_status *item, uint8_t *out,
                         size_t cap, size_t *got)
{
    Di__Kvstore__ObjRef ref = DI__KVSTORE__OBJ_REF__INIT;
    ref.cls = DI__KVSTORE__OBJ_CLASS__BLOCK;
    ref.key = (ProtobufCBinaryData){KVKEY_BYTES, (uint8_t *)k->b};
    Di__Kvstore__ObjRef **ptrs = calloc(n, sizeof(*ptrs));
    for (size_t i = 0; i < n; i++)
        ptrs[i] = &ref;
    Di__Kvstore__GetRequest req = DI__KVSTORE__GET_REQUEST__INIT;
    req.n_items = n;
    req.items = ptrs;
    size_t len = di__kvstore__get_request__get_packed_size(&req), rlen = 0;
    uint8_t *buf = malloc(len), *rep = NULL;
    di__kvstore__get_request__pack(&req, buf);
    di_error e;
    di_status st = kvc_call(c, "Get", buf, len, &rep, &rlen, &e);
    free(buf);
    free(ptrs);
    if (st != DI_OK)
        return st;
    Di__Kvstore__GetReply *r = di__kvstore__get_reply__unpack(NULL, rlen, rep);
    cr_assert(r && r->n_results == n, "a GetReply with a result per item");
    *item = r->results[0]->status;
    *got = r->results[0]->data.len;
    if (*item != DI_OK)
        cr_assert_eq(*got, 0, "a failed item carries bytes");
    memcpy(out, r->results[0]->data.data, *got < cap ? *got : cap);
    di__kvstore__get_reply__free_unpacked(r, NULL);
    free(rep);
    return DI_OK;
}

/* The store's count of active leases (Stats, admin token). */
static uint64_t leases_active(const th_store *s)
{
    Di__Kvstore__StatsRequest req = DI__KVSTORE__STATS_REQUEST__INIT;
    uint8_t buf[16], *rep = NULL;
    size_t n = di__kvstore__stats_request__pack(&req, buf), len = 0;
    di_error e;
    kvc_client *a = th_client(s, admin);
    cr_assert_eq(kvc_call(a, "Stats", buf, n, &rep, &len, &e), DI_OK, "%s", e.msg);
    Di__Kvstore__StatsReply *r = di__kvstore__stats_reply__unpack(NULL, len, rep);
    cr_assert_not_null(r);
    uint64_t v = r->leases_active;
    di__kvstore__stats_reply__free_unpacked(r, NULL);
    free(rep);
    kvc_close(a);
    return v;
}

/* The object under k is absent (a raw Get by c says ENOENT with no bytes). */
static void absent(kvc_client *c, const kvkey *k, const char *what)
{
    uint8_t buf[64];
    size_t got = 1;
    di_status item = DI_OK;
    cr_assert_eq(raw_get(c, k, 1, &item, buf, sizeof(buf), &got), DI_OK, "%s", what);
    cr_assert_eq(item, DI_ENOENT, "%s: %s, not ENOENT", what, di_status_name(item));
}

Test(security, the_grpc_data_path_checks_what_the_tickets_check, .timeout = 120)
{
    char dir[256];
    th_store s;
    start_store(&s, dir);
    kvc_options o;
    kvc_options_default(&o);
    o.target = s.target;
    o.token = engine;
    o.data_path = KVC_PATH_GRPC;
    o.deadline_ms = 10000;
    kvc_client *victim, *mallory, *nobody, *forger;
    di_error e;
    cr_assert_eq(kvc_open(&o, &victim, &e), DI_OK, "%s", e.msg);
    cr_assert_eq(kvc_open(&o, &mallory, &e), DI_OK, "%s", e.msg);
    o.token = NULL;
    cr_assert_eq(kvc_open(&o, &nobody, &e), DI_OK, "%s", e.msg);
    o.token = "engine-secreT";
    cr_assert_eq(kvc_open(&o, &forger, &e), DI_OK, "%s", e.msg);
    kvc_store_info info;
    cr_assert_eq(kvc_info(victim, &info, &e), DI_OK, "%s", e.msg);
    cr_assert_eq(info.path, KVC_PATH_GRPC);
    cr_assert_eq(info.data_paths, KVC_PATHS_UCX | KVC_PATHS_GRPC, "the store offers both");

    kvkey a = th_key(11), v = th_key(12), w = th_key(13);
    uint8_t *pa = object(&a, 11), *pv = object(&v, 12), *pw = object(&w, 13);
    uint8_t *buf = malloc(BLOCK + 128);
    cr_assert_eq(kvc_put1(victim, KVKEY_BLOCK, &a, pa, BLOCK, &e), DI_OK, "%s", e.msg);
    check_object(victim, &a, 11);
    di_status item = DI_OK;
    size_t got = 0;

    /* (a) No token or a wrong one: neither bytes out nor bytes in. */
    cr_assert_eq(raw_get(nobody, &a, 1, &item, buf, BLOCK, &got), DI_EAUTH, "Get without a token");
    cr_assert_eq(raw_get(forger, &a, 1, &item, buf, BLOCK, &got), DI_EAUTH, "Get, wrong token");
    cr_assert_eq(raw_put(nobody, KVKEY_BLOCK, &w, pw, BLOCK, &item), DI_EAUTH, "Put, no token");
    cr_assert_eq(raw_put(forger, KVKEY_BLOCK, &w, pw, BLOCK, &item), DI_EAUTH, "Put, wrong token");
    cr_assert_eq(kvc_get1(nobody, KVKEY_BLOCK, &a, buf, BLOCK, NULL, &e), DI_EAUTH);
    absent(mallory, &w, "a refused Put stored something");

    /* (b) Another client's objects: a stored one cannot be overwritten, one whose allocation
     * is in flight (the victim's, on the ticket path) can be neither read nor taken over. */
    uint8_t *evil = object(&a, 99);
    cr_assert_eq(raw_put(mallory, KVKEY_BLOCK, &a, evil, BLOCK, &item), DI_OK);
    cr_assert_eq(item, DI_EEXIST, "a Put over a stored object: %s", di_status_name(item));
    free(evil);
    uint64_t vid;
    ucxt_ticket vt;
    raw_alloc(victim, &v, &vid, &vt);
    absent(mallory, &v, "the victim's uncommitted allocation was served");
    evil = object(&v, 98);
    cr_assert_eq(raw_put(mallory, KVKEY_BLOCK, &v, evil, BLOCK, &item), DI_OK);
    cr_assert_eq(item, DI_EBUSY, "a Put over another client's allocation: %s",
                 di_status_name(item));
    free(evil);
    absent(mallory, &v, "an uncommitted object was served after a Put attempt");
    cr_assert_eq(settle(victim, "Abort", vid), DI_OK);
    absent(mallory, &v, "an aborted allocation was served");

    /* (c) The allocation length is exact: longer and shorter blocks are refused. */
    memcpy(buf, pv, BLOCK);
    memset(buf + BLOCK, 0, 128);
    cr_assert_eq(raw_put(mallory, KVKEY_BLOCK, &v, buf, BLOCK + 64, &item), DI_OK);
    cr_assert_eq(item, DI_EINVAL, "a block 64 bytes long: %s", di_status_name(item));
    cr_assert_eq(raw_put(mallory, KVKEY_BLOCK, &v, buf, BLOCK - 64, &item), DI_OK);
    cr_assert_eq(item, DI_EINVAL, "a block 64 bytes short: %s", di_status_name(item));
    cr_assert_eq(raw_put(mallory, KVKEY_BLOCK, &v, buf, 0, &item), DI_OK);
    cr_assert_neq(item, DI_OK, "an empty block was stored");
    absent(mallory, &v, "a block of the wrong length was stored");

    /* (d) Bytes that fail verification (one payload byte flipped, or another key's object) are
     * never committed, so never served. */
    buf[BLOCK - 1] ^= 0x40;
    cr_assert_eq(raw_put(mallory, KVKEY_BLOCK, &v, buf, BLOCK, &item), DI_OK);
    cr_assert_eq(item, DI_ECORRUPT, "a corrupt block: %s", di_status_name(item));
    cr_assert_eq(raw_put(mallory, KVKEY_BLOCK, &v, pw, BLOCK, &item), DI_OK);
    cr_assert_eq(item, DI_ECORRUPT, "another key's block: %s", di_status_name(item));
    absent(mallory, &v, "a corrupt block was stored");

    /* (e) Oversized messages: a Put over the message limit is refused before any handler;
     * more items than a batch takes are refused too. */
    size_t huge = KVC_GRPC_MAX_MESSAGE + 4096;
    uint8_t *big = calloc(1, huge);
    cr_assert_not_null(big);
    cr_assert_neq(raw_put(mallory, KVKEY_HANDOFF, &w, big, huge, &item), DI_OK,
                  "a Put over the message limit was taken");
    free(big);
    cr_assert_eq(raw_get(mallory, &a, KVC_MAX_BATCH + 1, &item, buf, BLOCK, &got), DI_EINVAL,
                 "a Get of more items than a batch");
    kvc_item hi = {.cls = KVKEY_HANDOFF, .key = w, .buf = pw, .cap = KVC_GRPC_MAX_DATA + 1};
    cr_assert_eq(kvc_put(mallory, &hi, 1, &e), DI_OK, "%s", e.msg);
    cr_assert_eq(hi.status, DI_ERANGE, "an object over a message's bytes: %s",
                 di_status_name(hi.status));

    /* (f) What a Get returns is the committed object, byte for byte; a batch with a miss in
     * it gets the others. */
    cr_assert_eq(raw_get(mallory, &a, 3, &item, buf, BLOCK, &got), DI_OK);
    cr_assert_eq(item, DI_OK);
    cr_assert_eq(got, BLOCK);
    cr_assert_eq(memcmp(buf, pa, BLOCK), 0, "a Get returned other bytes");
    kvc_item two[2] = {{.cls = KVKEY_BLOCK, .key = v, .buf = buf, .cap = BLOCK},
                       {.cls = KVKEY_BLOCK, .key = a, .buf = buf + 64, .cap = BLOCK + 64}};
    cr_assert_eq(kvc_get(mallory, two, 2, &e), DI_OK, "%s", e.msg);
    cr_assert_eq(two[0].status, DI_ENOENT);
    cr_assert_eq(two[1].status, DI_OK, "%s", two[1].error.msg);
    cr_assert_eq(two[1].bytes, BLOCK);
    cr_assert_eq(memcmp(buf + 64, pa, BLOCK), 0);
    /* A buffer too small for the object is refused, not overrun. */
    memset(buf, 0x5a, 64);
    cr_assert_eq(kvc_get1(mallory, KVKEY_BLOCK, &a, buf, 64, NULL, &e), DI_ERANGE);

    /* (g) Explicit leases work on this path too: the lease pins, the read uses Get. */
    kvc_lease l;
    cr_assert_eq(kvc_acquire(victim, KVKEY_BLOCK, &a, 30000, &l, &e), DI_OK, "%s", e.msg);
    cr_assert_eq(kvc_read(victim, KVKEY_BLOCK, &a, &l, buf, BLOCK, &e), DI_OK, "%s", e.msg);
    cr_assert_eq(memcmp(buf, pa, BLOCK), 0);
    cr_assert_eq(kvc_release(victim, &l, &e), DI_OK, "%s", e.msg);

    check_object(mallory, &a, 11);
    cr_assert_eq(leases_active(&s), 0, "leases left behind by Get");
    admin_intact(&s);
    free(pa);
    free(pv);
    free(pw);
    free(buf);
    kvc_close(victim);
    kvc_close(mallory);
    kvc_close(nobody);
    kvc_close(forger);
    th_store_stop(&s);
    th_rmtree(dir);
}

Test(security, the_grpc_data_path_round_trips_under_tls_and_the_store_picks_its_paths,
     .timeout = 90)
{
    char dir[256], data[300], cert[300], key[300];
    th_tmpdir(dir);
    make_pki(dir);
    snprintf(data, sizeof(data), "%s/data", dir);
    snprintf(cert, sizeof(cert), "%s/srv.pem", dir);
    snprintf(key, sizeof(key), "%s/srv.key", dir);
    th_store s;
    const char *args[] = {"--block-bytes", "4224", "--window-bytes", "8320", "--dram-bytes",
                          "8MiB", "--tls-cert", cert, "--tls-key", key, "--data-path", "grpc",
                          NULL};
    th_store_start(&s, data, args);
    char *ca_pem = load(dir, "ca.pem");
    kvc_options o;
    kvc_options_default(&o);
    o.target = s.target;
    o.tls_ca_pem = ca_pem;
    di_error e;

    /* A loopback target would take UCX, but this store offers gRPC only: auto takes gRPC, and
     * a client that insists on UCX gets a clear refusal. */
    kvc_client *c, *u;
    cr_assert_eq(kvc_open(&o, &c, &e), DI_OK, "%s", e.msg);
    kvc_store_info info;
    cr_assert_eq(kvc_info(c, &info, &e), DI_OK, "%s", e.msg);
    cr_assert_eq(info.data_paths, KVC_PATHS_GRPC);
    cr_assert_eq(info.path, KVC_PATH_GRPC);
    o.data_path = KVC_PATH_UCX;
    cr_assert_eq(kvc_open(&o, &u, &e), DI_OK, "%s", e.msg);
    cr_assert_eq(kvc_info(u, &info, &e), DI_EUNAVAIL, "a UCX client of a gRPC-only store");
    cr_assert(strstr(e.msg, "--data-path"), "%s", e.msg);
    kvc_close(u);
    /* ... and the ticket path's Alloc is refused. */
    uint8_t ab[256], *rep = NULL;
    kvkey k0 = th_key(40);
    Di__Kvstore__AllocItem ai = DI__KVSTORE__ALLOC_ITEM__INIT, *ap = &ai;
    ai.key = (ProtobufCBinaryData){KVKEY_BYTES, k0.b};
    ai.bytes = BLOCK;
    Di__Kvstore__AllocRequest areq = DI__KVSTORE__ALLOC_REQUEST__INIT;
    areq.n_items = 1;
    areq.items = &ap;
    size_t an = di__kvstore__alloc_request__pack(&areq, ab), alen = 0;
    cr_assert_eq(kvc_call(c, "Alloc", ab, an, &rep, &alen, &e), DI_EPERM, "Alloc on gRPC only");

    /* A batch of 100 objects over TLS, then read back as one batch, byte for byte. */
    enum { N = 100 };
    kvc_item items[N];
    uint8_t *objs = malloc((size_t)N * BLOCK), *back = calloc(N, BLOCK);
    for (int i = 0; i < N; i++) {
        kvkey k = th_key(100 + i);
        uint8_t *p = object(&k, (uint64_t)i);
        memcpy(objs + (size_t)i * BLOCK, p, BLOCK);
        free(p);
        items[i] = (kvc_item){.cls = KVKEY_BLOCK, .key = k, .buf = objs + (size_t)i * BLOCK,
                              .cap = BLOCK};
    }
    cr_assert_eq(kvc_put(c, items, N, &e), DI_OK, "%s", e.msg);
    for (int i = 0; i < N; i++) {
        cr_assert_eq(items[i].status, DI_OK, "put %d: %s", i, items[i].error.msg);
        items[i].buf = back + (size_t)i * BLOCK;
    }
    cr_assert_eq(kvc_get(c, items, N, &e), DI_OK, "%s", e.msg);
    for (int i = 0; i < N; i++)
        cr_assert_eq(items[i].status, DI_OK, "get %d: %s", i, items[i].error.msg);
    cr_assert_eq(memcmp(objs, back, (size_t)N * BLOCK), 0, "bytes read back differ");
    /* A plaintext client gets nothing from a TLS store. */
    kvc_client *plain;
    o.tls_ca_pem = NULL;
    o.data_path = KVC_PATH_GRPC;
    o.deadline_ms = 2000;
    cr_assert_eq(kvc_open(&o, &plain, &e), DI_OK, "%s", e.msg);
    cr_assert_neq(kvc_get(plain, items, 1, &e), DI_OK, "a plaintext client was served");
    kvc_close(plain);
    kvc_close(c);
    th_store_stop(&s);

    /* A store with UCX only refuses Get and Put, and a gRPC client is told so. */
    const char *uargs[] = {"--block-bytes", "4224", "--window-bytes", "8320", "--dram-bytes",
                           "8MiB", "--data-path", "ucx", NULL};
    th_store_start(&s, data, uargs);
    o.target = s.target;
    cr_assert_eq(kvc_open(&o, &c, &e), DI_OK, "%s", e.msg);
    cr_assert_eq(kvc_get(c, items, 1, &e), DI_EUNAVAIL, "a gRPC client of a UCX-only store");
    kvc_close(c);
    di_status item = DI_OK;
    o.data_path = KVC_PATH_AUTO;
    cr_assert_eq(kvc_open(&o, &c, &e), DI_OK, "%s", e.msg);
    cr_assert_eq(raw_put(c, KVKEY_BLOCK, &k0, objs, BLOCK, &item), DI_EPERM, "Put on UCX only");
    /* auto on loopback takes UCX there: the objects written over gRPC are still there. */
    cr_assert_eq(kvc_get1(c, KVKEY_BLOCK, &items[7].key, back, BLOCK, NULL, &e), DI_OK, "%s",
                 e.msg);
    cr_assert_eq(memcmp(back, objs + 7 * BLOCK, BLOCK), 0);
    cr_assert_eq(kvc_info(c, &info, &e), DI_OK, "%s", e.msg);
    cr_assert_eq(info.path, KVC_PATH_UCX);
    kvc_close(c);
    th_store_stop(&s);
    free(objs);
    free(back);
    free(ca_pem);
    th_rmtree(dir);
}
