/* Unary gRPC helpers (common/net/rpc.h): a small service table on loopback exercising status
 * propagation, tokens and roles, size limits, deadlines, cancellation, an unreachable server,
 * waiting on several channels at once, and TLS with a certificate made by the openssl
 * command. */
#include <criterion/criterion.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/net/rpc.h"
#include "common/util/clock.h"
#include "tests/kvstore/helpers.h"

static di_status h_echo(void *svc, const rpc_request *req, rpc_reply *reply, di_error *err)
{
    (void)svc;
    (void)err;
    reply->data = malloc(req->len + 1);
    memcpy(reply->data, req->data, req->len);
    reply->data[req->len] = (uint8_t)req->role;
    reply->len = req->len + 1;
    return DI_OK;
}

static di_status h_full(void *svc, const rpc_request *req, rpc_reply *reply, di_error *err)
{
    (void)svc;
    (void)req;
    (void)reply;
    return di_fail(err, DI_ENOSPC, "disk tier full: 12 of 12 bytes");
}

static int slow_started, slow_finished;

static di_status h_slow(void *svc, const rpc_request *req, rpc_reply *reply, di_error *err)
{
    (void)svc;
    (void)req;
    (void)reply;
    (void)err;
    __atomic_add_fetch(&slow_started, 1, __ATOMIC_SEQ_CST);
    usleep(600 * 1000);
    __atomic_add_fetch(&slow_finished, 1, __ATOMIC_SEQ_CST);
    return DI_OK;
}

static const rpc_method methods[] = {
    {"/t.T/Echo", h_echo, 5000, 1, 1024, RPC_ROLE_ENGINE},
    {"/t.T/Full", h_full, 5000, 0, 1024, RPC_ROLE_ENGINE},
    {"/t.T/Slow", h_slow, 5000, 1, 1024, RPC_ROLE_ENGINE},
    {"/t.T/Admin", h_echo, 5000, 1, 1024, RPC_ROLE_ADMIN},
};

static int errors_seen;

static void count_error(void *ud, const char *method, const char *peer, di_status st,
                        const char *msg)
{
    (void)ud;
    (void)method;
    (void)peer;
    (void)st;
    (void)msg;
    __atomic_add_fetch(&errors_seen, 1, __ATOMIC_SEQ_CST);
}

static rpc_server *start(const char *eng, const char *adm, const char *cert, const char *key,
                         int *port)
{
    rpc_server_config sc = {.listen = "127.0.0.1:0", .methods = methods, .n_methods = 4,
                            .threads = 2, .engine_token = eng, .admin_token = adm,
                            .tls_cert_pem = cert, .tls_key_pem = key, .on_error = count_error};
    rpc_server *s = NULL;
    di_error e;
    cr_assert_eq(rpc_server_start(&sc, &s, port, &e), DI_OK, "%s", e.msg);
    cr_assert_gt(*port, 0);
    return s;
}

static rpc_client *client(int port, const char *token)
{
    char target[64];
    snprintf(target, sizeof(target), "127.0.0.1:%d", port);
    rpc_client_config cc = {.target = target, .token = token};
    rpc_client *c = NULL;
    di_error e;
    cr_assert_eq(rpc_client_open(&cc, &c, &e), DI_OK, "%s", e.msg);
    return c;
}

static di_status call(rpc_client *c, const char *m, const char *msg, uint32_t ms, char *out,
                      di_error *e)
{
    uint8_t *r = NULL;
    size_t n = 0;
    di_status st = rpc_client_call(c, m, msg, strlen(msg), ms, &r, &n, e);
    if (st == DI_OK && out) {
        memcpy(out, r, n);
        out[n] = '\0';
    }
    free(r);
    return st;
}

Test(rpc, status_codes_and_messages_cross_the_wire)
{
    int port;
    rpc_server *s = start(NULL, NULL, NULL, NULL, &port);
    rpc_client *c = client(port, NULL);
    char out[64];
    di_error e;
    cr_assert_eq(call(c, "/t.T/Echo", "hello", 5000, out, &e), DI_OK, "%s", e.msg);
    cr_assert_eq(strncmp(out, "hello", 5), 0);
    cr_assert_eq(out[5], RPC_ROLE_ADMIN, "no tokens configured: everyone is admin");
    cr_assert_eq(call(c, "/t.T/Full", "x", 5000, NULL, &e), DI_ENOSPC);
    cr_assert(strstr(e.msg, "Full: disk tier full"), "%s", e.msg);
    cr_assert_eq(call(c, "/t.T/Nope", "x", 5000, NULL, &e), DI_EUNSUPPORTED, "%s", e.msg);
    cr_assert(strstr(e.msg, "unknown method /t.T/Nope"), "%s", e.msg);
    cr_assert_eq(errors_seen, 2, "each failed call reported once");
    char big[2000];
    memset(big, 'a', sizeof(big) - 1);
    big[sizeof(big) - 1] = '\0';
    /* Refused by gRPC's receive limit (the largest request of the table) before any
     * handler. */
    cr_assert_eq(call(c, "/t.T/Echo", big, 5000, NULL, &e), DI_EFULL);
    cr_assert(strstr(e.msg, "larger than max"), "%s", e.msg);
    cr_assert_eq(call(c, "/t.T/Echo", "", 5000, out, &e), DI_OK, "empty message: %s", e.msg);
    rpc_client_close(c);
    rpc_server_stop(s, 1000);
}

Test(rpc, tokens_and_roles)
{
    int port;
    rpc_server *s = start("engine-secret", "admin-secret", NULL, NULL, &port);
    rpc_client *none = client(port, NULL);
    rpc_client *wrong = client(port, "engine-secreT");
    rpc_client *eng = client(port, "engine-secret");
    rpc_client *adm = client(port, "admin-secret");
    char out[64];
    di_error e;
    cr_assert_eq(call(none, "/t.T/Echo", "a", 5000, NULL, &e), DI_EAUTH);
    cr_assert_eq(call(wrong, "/t.T/Echo", "a", 5000, NULL, &e), DI_EAUTH);
    cr_assert_eq(call(eng, "/t.T/Echo", "a", 5000, out, &e), DI_OK, "%s", e.msg);
    cr_assert_eq(out[1], RPC_ROLE_ENGINE);
    cr_assert_eq(call(eng, "/t.T/Admin", "a", 5000, NULL, &e), DI_EPERM);
    cr_assert(strstr(e.msg, "admin token"), "%s", e.msg);
    cr_assert_eq(call(adm, "/t.T/Admin", "a", 5000, out, &e), DI_OK, "%s", e.msg);
    cr_assert_eq(call(adm, "/t.T/Echo", "a", 5000, out, &e), DI_OK, "admin may call engine "
                                                                      "methods");
    rpc_client_close(none);
    rpc_client_close(wrong);
    rpc_client_close(eng);
    rpc_client_close(adm);
    rpc_server_stop(s, 1000);
}

static void *cancel_soon(void *arg)
{
    usleep(100 * 1000);
    rpc_client_cancel(arg);
    return NULL;
}

Test(rpc, deadlines_cancellation_and_a_dead_server, .timeout = 30)
{
    int port;
    rpc_server *s = start(NULL, NULL, NULL, NULL, &port);
    rpc_client *c = client(port, NULL);
    di_error e;
    cr_assert_eq(call(c, "/t.T/Slow", "a", 200, NULL, &e), DI_ETIMEDOUT, "%s", e.msg);
    pthread_t t;
    pthread_create(&t, NULL, cancel_soon, c);
    cr_assert_eq(call(c, "/t.T/Slow", "a", 5000, NULL, &e), DI_ECANCELED, "%s", e.msg);
    pthread_join(t, NULL);
    rpc_server_stop(s, 2000);
    cr_assert_geq(slow_started, 1, "the cancelled call reached its handler");
    cr_assert_eq(slow_finished, slow_started, "stop waited for the handlers still running");
    cr_assert_eq(call(c, "/t.T/Echo", "a", 2000, NULL, &e), DI_EUNAVAIL, "%s", e.msg);
    char want[64];
    snprintf(want, sizeof(want), "127.0.0.1:%d unavailable", port);
    cr_assert(strstr(e.msg, want), "%s", e.msg);
    rpc_client_close(c);
}

Test(rpc, several_channels_are_waited_on_at_once, .timeout = 30)
{
    int up_port, down_port;
    rpc_server *up = start(NULL, NULL, NULL, NULL, &up_port);
    rpc_server *down = start(NULL, NULL, NULL, NULL, &down_port);
    rpc_client *cs[2] = {client(up_port, NULL), client(down_port, NULL)};
    int connected[2] = {0, 0};
    /* Both servers up: both channels connect (from idle), long before the timeout. */
    uint64_t t0 = di_mono_ns();
    cr_assert_eq(rpc_clients_wait_connected(cs, 2, 10000, connected), 2);
    cr_assert(connected[0] && connected[1]);
    cr_assert_lt(di_mono_ns() - t0, 5000000000ull);
    /* One server gone: the wait lasts its timeout and reports the other channel alone. */
    down = rpc_server_stop(down, 0);
    t0 = di_mono_ns();
    cr_assert_eq(rpc_clients_wait_connected(cs, 2, 300, connected), 1);
    cr_assert(connected[0] && !connected[1]);
    cr_assert_geq(di_mono_ns() - t0, 250000000ull);
    cr_assert_eq(rpc_clients_wait_connected(cs, 2, 300, connected), 1);
    /* Back on its port: the channel connects again within the wait. */
    char listen[32];
    snprintf(listen, sizeof listen, "127.0.0.1:%d", down_port);
    rpc_server_config sc = {.listen = listen, .methods = methods, .n_methods = 4, .threads = 1};
    di_error e;
    int port = 0;
    di_status st = DI_EUNAVAIL;
    for (int i = 0; i < 100 && st != DI_OK; i++) /* the port may take a moment to free */
        if ((st = rpc_server_start(&sc, &down, &port, &e)) != DI_OK)
            usleep(20000);
    cr_assert_eq(st, DI_OK, "%s", e.msg);
    cr_assert_eq(rpc_clients_wait_connected(cs, 2, 10000, connected), 2);
    cr_assert(connected[0] && connected[1]);
    char out[16];
    cr_assert_eq(call(cs[1], "/t.T/Echo", "back", 5000, out, &e), DI_OK, "%s", e.msg);
    rpc_client_close(cs[0]);
    rpc_client_close(cs[1]);
    rpc_server_stop(up, 1000);
    rpc_server_stop(down, 1000);
}

Test(rpc, tls_with_a_self_signed_certificate, .timeout = 30)
{
    char dir[256], cmd[1024], path[300];
    th_tmpdir(dir);
    snprintf(cmd, sizeof(cmd),
             "openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes "
             "-keyout %s/key.pem -out %s/cert.pem -days 1 -subj /CN=localhost "
             "-addext subjectAltName=DNS:localhost,IP:127.0.0.1 2>/dev/null",
             dir, dir);
    cr_assert_eq(system(cmd), 0, "openssl could not make a certificate");
    char *cert, *key;
    snprintf(path, sizeof(path), "%s/cert.pem", dir);
    cr_assert_eq(rpc_load_file(path, &cert, NULL), DI_OK);
    snprintf(path, sizeof(path), "%s/key.pem", dir);
    cr_assert_eq(rpc_load_file(path, &key, NULL), DI_OK);
    int port;
    rpc_server *s = start(NULL, NULL, cert, key, &port);
    char target[64];
    snprintf(target, sizeof(target), "localhost:%d", port);
    rpc_client_config cc = {.target = target, .tls_ca_pem = cert};
    rpc_client *c;
    di_error e;
    cr_assert_eq(rpc_client_open(&cc, &c, &e), DI_OK, "%s", e.msg);
    char out[16];
    cr_assert_eq(call(c, "/t.T/Echo", "tls", 5000, out, &e), DI_OK, "%s", e.msg);
    rpc_client_close(c);
    /* A plaintext client cannot talk to the TLS port. */
    rpc_client *plain = client(port, NULL);
    cr_assert_eq(call(plain, "/t.T/Echo", "x", 2000, NULL, &e), DI_EUNAVAIL, "%s", e.msg);
    rpc_client_close(plain);
    rpc_server_stop(s, 1000);
    free(cert);
    free(key);
    th_rmtree(dir);
}

Test(rpc, bad_configs_are_refused)
{
    rpc_server *s = NULL;
    di_error e;
    rpc_server_config sc = {.listen = "127.0.0.1:0", .methods = methods, .n_methods = 4,
                            .threads = 1, .tls_cert_pem = "x"};
    cr_assert_eq(rpc_server_start(&sc, &s, NULL, &e), DI_EINVAL);
    cr_assert(strstr(e.msg, "certificate and its key"), "%s", e.msg);
    rpc_method bad = {"NoSlash", h_echo, 1000, 1, 10, RPC_ROLE_ENGINE};
    rpc_server_config sc2 = {.listen = "127.0.0.1:0", .methods = &bad, .n_methods = 1,
                             .threads = 1};
    cr_assert_eq(rpc_server_start(&sc2, &s, NULL, &e), DI_EINVAL);
    sc2.methods = methods;
    sc2.listen = "203.0.113.1:1"; /* not a local address */
    int port;
    cr_assert_eq(rpc_server_start(&sc2, &s, &port, &e), DI_EUNAVAIL);
    cr_assert_null(s);
    cr_assert_null(rpc_server_stop(NULL, 0));
    cr_assert_null(rpc_client_close(NULL));
}
