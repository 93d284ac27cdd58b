/* The client's reading of Get replies on the gRPC data path (common/net/kv_client.c reads them
 * without protobuf-c, straight into the callers' buffers): a fake store on loopback answers
 * Connect and then Get with crafted bytes, well-formed and not. Malformed replies fail the call
 * with DI_EPROTO; an object larger than its buffer fails its item with DI_ERANGE and leaves the
 * buffer alone; per-item failures keep their status and message. */
#include <criterion/criterion.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/net/kv_client.h"
#include "common/net/kvstore.pb-c.h"
#include "common/net/rpc.h"

#define STORE_ID 0x5eed

/* What the fake Get answers: these bytes. */
typedef struct fake {
    uint8_t reply[512];
    size_t len;
} fake;

static di_status h_connect(void *svc, const rpc_request *req, rpc_reply *r, di_error *err)
{
    (void)svc;
    (void)req;
    (void)err;
    Di__Kvstore__Geometry g = DI__KVSTORE__GEOMETRY__INIT;
    Di__Kvstore__ConnectReply rep = DI__KVSTORE__CONNECT_REPLY__INIT;
    rep.store_id = STORE_ID;
    rep.geometry = &g;
    rep.block_bytes = 64;
    rep.data_paths = KVC_PATHS_GRPC;
    r->len = di__kvstore__connect_reply__get_packed_size(&rep);
    r->data = malloc(r->len);
    di__kvstore__connect_reply__pack(&rep, r->data);
    return DI_OK;
}

static di_status h_get(void *svc, const rpc_request *req, rpc_reply *r, di_error *err)
{
    (void)req;
    (void)err;
    const fake *f = svc;
    r->data = malloc(f->len ? f->len : 1);
    memcpy(r->data, f->reply, f->len);
    r->len = f->len;
    return DI_OK;
}

static const rpc_method methods[] = {
    {KVC_SERVICE "Connect", h_connect, 5000, 1, 4096, RPC_ROLE_ENGINE},
    {KVC_SERVICE "Get", h_get, 5000, 1, 4096, RPC_ROLE_ENGINE},
};

/* Packs a GetReply of n results: status st[i], data of len[i] bytes of value 0x40 + i. */
static void make_reply(fake *f, size_t n, const int *st, const size_t *len)
{
    static uint8_t data[4][128];
    Di__Kvstore__GetResult res[4], *ptrs[4];
    for (size_t i = 0; i < n; i++) {
        di__kvstore__get_result__init(&res[i]);
        res[i].status = st[i];
        res[i].error = st[i] ? (char *)"not stored here" : (char *)"";
        memset(data[i], 0x40 + (int)i, sizeof(data[i]));
        res[i].data = (ProtobufCBinaryData){len[i], data[i]};
        ptrs[i] = &res[i];
    }
    Di__Kvstore__GetReply rep = DI__KVSTORE__GET_REPLY__INIT;
    rep.store_id = STORE_ID;
    rep.n_results = n;
    rep.results = ptrs;
    f->len = di__kvstore__get_reply__get_packed_size(&rep);
    cr_assert_leq(f->len, sizeof(f->reply));
    di__kvstore__get_reply__pack(&rep, f->reply);
}

static rpc_server *srv;
static kvc_client *client;
static fake fk;

static void setup(void)
{
    char target[64];
    int port = 0;
    di_error e;
    rpc_server_config sc = {.listen = "127.0.0.1:0", .methods = methods, .n_methods = 2,
                            .svc = &fk, .threads = 1};
    cr_assert_eq(rpc_server_start(&sc, &srv, &port, &e), DI_OK, "%s", e.msg);
    snprintf(target, sizeof(target), "127.0.0.1:%d", port);
    kvc_options o;
    kvc_options_default(&o);
    o.target = target;
    o.verify = 0; /* the fake's objects are not KV objects */
    o.deadline_ms = 5000;
    cr_assert_eq(kvc_open(&o, &client, &e), DI_OK, "%s", e.msg);
    kvc_store_info info;
    cr_assert_eq(kvc_info(client, &info, &e), DI_OK, "%s", e.msg);
    cr_assert_eq(info.path, KVC_PATH_GRPC, "auto takes gRPC when the store offers only that");
}

static void teardown(void)
{
    client = kvc_close(client);
    srv = rpc_server_stop(srv, 1000);
}

TestSuite(grpc_reply, .init = setup, .fini = teardown, .timeout = 60);

/* Gets two objects into 64-byte buffers filled with 0x5a; returns the call's status. */
static di_status get_two(kvc_item it[2], uint8_t buf[2][64], di_error *e)
{
    memset(buf, 0x5a, 2 * 64);
    for (int i = 0; i < 2; i++)
        it[i] = (kvc_item){.cls = KVKEY_BLOCK, .buf = buf[i], .cap = 64};
    return kvc_get(client, it, 2, e);
}

Test(grpc_reply, objects_land_in_their_buffers_and_item_failures_keep_their_message)
{
    int st[2] = {0, DI_ENOENT};
    size_t len[2] = {48, 0};
    make_reply(&fk, 2, st, len);
    kvc_item it[2];
    uint8_t buf[2][64];
    di_error e;
    cr_assert_eq(get_two(it, buf, &e), DI_OK, "%s", e.msg);
    cr_assert_eq(it[0].status, DI_OK, "%s", it[0].error.msg);
    cr_assert_eq(it[0].bytes, 48);
    for (int k = 0; k < 64; k++)
        cr_assert_eq(buf[0][k], k < 48 ? 0x40 : 0x5a, "byte %d", k);
    cr_assert_eq(it[1].status, DI_ENOENT);
    cr_assert(strstr(it[1].error.msg, "not stored here"), "%s", it[1].error.msg);
}

Test(grpc_reply, an_object_larger_than_its_buffer_is_refused_and_not_written)
{
    int st[2] = {0, 0};
    size_t len[2] = {64, 65};
    make_reply(&fk, 2, st, len);
    kvc_item it[2];
    uint8_t buf[2][64];
    di_error e;
    cr_assert_eq(get_two(it, buf, &e), DI_OK, "%s", e.msg);
    cr_assert_eq(it[0].status, DI_OK);
    cr_assert_eq(it[1].status, DI_ERANGE, "%s", di_status_name(it[1].status));
    for (int k = 0; k < 64; k++)
        cr_assert_eq(buf[1][k], 0x5a, "byte %d of a refused object was written", k);
}

Test(grpc_reply, malformed_replies_fail_the_call)
{
    int st[3] = {0, 0, 0};
    size_t len[3] = {8, 8, 8};
    kvc_item it[2];
    uint8_t buf[2][64];
    di_error e;
    /* One result for two items, three for two. */
    make_reply(&fk, 1, st, len);
    cr_assert_eq(get_two(it, buf, &e), DI_EPROTO, "too few results: %s", e.msg);
    cr_assert_neq(it[0].status, DI_OK, "an item of a failed call looks done");
    make_reply(&fk, 3, st, len);
    cr_assert_eq(get_two(it, buf, &e), DI_EPROTO, "too many results: %s", e.msg);
    /* Cut short inside the last result, and inside the first. */
    make_reply(&fk, 2, st, len);
    size_t whole = fk.len;
    fk.len = whole - 1;
    cr_assert_eq(get_two(it, buf, &e), DI_EPROTO, "truncated: %s", e.msg);
    fk.len = 14;
    cr_assert_eq(get_two(it, buf, &e), DI_EPROTO, "truncated early: %s", e.msg);
    /* A length that runs past the end, and a wire type that does not exist. */
    make_reply(&fk, 2, st, len);
    fk.reply[fk.len] = 0x12; /* field 2, length-delimited */
    fk.reply[fk.len + 1] = 0x7f;
    fk.len += 2;
    cr_assert_eq(get_two(it, buf, &e), DI_EPROTO, "overlong length: %s", e.msg);
    make_reply(&fk, 2, st, len);
    fk.reply[fk.len++] = 0x0f; /* field 1, wire type 7 */
    cr_assert_eq(get_two(it, buf, &e), DI_EPROTO, "bad wire type: %s", e.msg);
    /* Unknown fields are skipped: the well-formed reply with one more varint field reads. */
    make_reply(&fk, 2, st, len);
    fk.reply[fk.len++] = 0x48; /* field 9, varint */
    fk.reply[fk.len++] = 0x01;
    cr_assert_eq(get_two(it, buf, &e), DI_OK, "an unknown field: %s", e.msg);
    cr_assert_eq(it[1].status, DI_OK);
    cr_assert_eq(buf[1][0], 0x41);
}
