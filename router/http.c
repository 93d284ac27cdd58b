/* http.c: the HTTP server on libmicrohttpd (see http.h). One thread per connection, so a
 * handler may wait for its generation and a stream's read may block briefly. */
#include "router/http.h"

#include <errno.h>
#include <microhttpd.h>
#include <netdb.h>
#include <poll.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>

#include "common/service/options.h"
#include "router/openai.h"

#define HTTP_MAX_KEYS 1024
#define HTTP_KEY_MAX 256

typedef struct http_key {
    char name[64];           /* shown in logs and metrics */
    char token[HTTP_KEY_MAX];
    size_t token_len;
    http_scope scope;        /* the most this key may do */
    uint32_t in_flight;      /* requests now, under the server's mutex */
} http_key;

struct http_server {
    http_config cfg;
    struct MHD_Daemon *d;
    http_key *keys; /* NULL without a key file */
    size_t n_keys;
    pthread_mutex_t mu; /* guards keys[].in_flight */
    atomic_int stopping;
};

/* Per request, from the first call of the access handler to the completed notice. */
typedef struct http_conn_ctx {
    const http_route *route;
    http_key *key;     /* holds one in_flight slot of it, or NULL */
    char *body;
    size_t len, cap;
    int too_large;     /* the body went past the limit */
    struct MHD_Connection *conn;
    http_server *srv;
} http_conn_ctx;

/* A stream response's state for the content reader. */
typedef struct http_stream_ctx {
    http_reply r;
    struct MHD_Connection *conn;
    http_server *srv;
} http_stream_ctx;

/* ---- keys ---------------------------------------------------------------------------------- */

static di_status load_keys(const char *path, http_key **out, size_t *n_out, di_error *err)
{
    FILE *f = fopen(path, "r");
    if (!f)
        return di_fail(err, errno == ENOENT ? DI_ENOENT : DI_EIO, "--api-key-file %s: %s", path,
                       strerror(errno));
    http_key *keys = calloc(HTTP_MAX_KEYS, sizeof *keys);
    if (!keys) {
        fclose(f);
        return di_fail(err, DI_ENOMEM, "out of memory reading keys");
    }
    char line[1024];
    size_t n = 0, lineno = 0;
    di_status st = DI_OK;
    while (fgets(line, sizeof line, f)) {
        lineno++;
        char *hash = strchr(line, '#');
        if (hash)
            *hash = '\0';
        char name[128], token[512], scope[32];
        int got = sscanf(line, "%127s %511s %31s", name, token, scope);
        if (got <= 0)
            continue;
        if (got < 2 || strlen(name) >= sizeof keys[0].name || strlen(token) < 16 ||
            strlen(token) >= HTTP_KEY_MAX) {
            st = di_fail(err, DI_EINVAL,
                         "--api-key-file %s line %zu: want NAME TOKEN [read|generate], a name "
                         "under 64 bytes and a token of 16..255 bytes", path, lineno);
            break;
        }
        http_scope sc = HTTP_SCOPE_GENERATE;
        if (got == 3 && strcmp(scope, "read") == 0)
            sc = HTTP_SCOPE_READ;
        else if (got == 3 && strcmp(scope, "generate") != 0) {
            st = di_fail(err, DI_EINVAL, "--api-key-file %s line %zu: scope '%s' is not read or "
                         "generate", path, lineno, scope);
            break;
        }
        if (n == HTTP_MAX_KEYS) {
            st = di_fail(err, DI_ERANGE, "--api-key-file %s: more than %d keys", path,
                         HTTP_MAX_KEYS);
            break;
        }
        snprintf(keys[n].name, sizeof keys[n].name, "%s", name);
        keys[n].token_len = strlen(token);
        memcpy(keys[n].token, token, keys[n].token_len);
        keys[n].scope = sc;
        n++;
    }
    fclose(f);
    if (st == DI_OK && n == 0)
        st = di_fail(err, DI_EINVAL, "--api-key-file %s holds no key", path);
    if (st != DI_OK) {
        memset(keys, 0, HTTP_MAX_KEYS * sizeof *keys);
        free(keys);
        return st;
    }
    *out = keys;
    *n_out = n;
    return DI_OK;
}

di_status http_keys_check(const char *path, size_t *n_keys, di_error *err)
{
    http_key *k = NULL;
    size_t n = 0;
    di_status st = load_keys(path, &k, &n, err);
    if (st == DI_OK)
        *n_keys = n;
    free(k);
    return st;
}

/* Compares in time that depends on the lengths only. */
static int token_eq(const http_key *k, const char *t, size_t n)
{
    if (n != k->token_len)
        return 0;
    unsigned char d = 0;
    for (size_t i = 0; i < n; i++)
        d |= (unsigned char)(k->token[i] ^ t[i]);
    return d == 0;
}

static http_key *find_key(http_server *s, const char *auth)
{
    if (!auth || strncmp(auth, "Bearer ", 7) != 0)
        return NULL;
    const char *t = auth + 7;
    size_t n = strlen(t);
    http_key *found = NULL;
    for (size_t i = 0; i < s->n_keys; i++) /* no early exit: time does not tell which key */
        if (token_eq(&s->keys[i], t, n))
            found = &s->keys[i];
    return found;
}

/* ---- replies ----------------------------------------------------------------------------- */

void http_reply_json(http_reply *out, int status, char *json)
{
    memset(out, 0, sizeof *out);
    if (!json) {
        static const char oom[] = "{\"error\":{\"message\":\"out of memory\",\"type\":"
                                  "\"server_error\",\"param\":null,\"code\":null}}";
        json = strdup(oom);
        status = 503;
    }
    out->status = status;
    out->content_type = "application/json";
    out->body = json;
    out->body_len = json ? strlen(json) : 0;
}

void http_reply_error(http_reply *out, int status, const char *code, const char *param,
                      const char *fmt, ...)
{
    oai_error e = {0};
    char msg[sizeof e.message];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    oai_fail(&e, status, code, param, "%s", msg);
    http_reply_json(out, status, oai_error_json(&e));
}

static enum MHD_Result queue_buffer(struct MHD_Connection *c, http_reply *r, const char *allow)
{
    struct MHD_Response *resp =
        MHD_create_response_from_buffer(r->body_len, r->body ? r->body : (void *)"",
                                         r->body ? MHD_RESPMEM_MUST_FREE : MHD_RESPMEM_PERSISTENT);
    if (!resp) {
        free(r->body);
        return MHD_NO;
    }
    MHD_add_response_header(resp, "Content-Type", r->content_type ? r->content_type
                                                                   : "application/json");
    if (allow)
        MHD_add_response_header(resp, "Allow", allow);
    if (r->status == 401)
        MHD_add_response_header(resp, "WWW-Authenticate", "Bearer");
    enum MHD_Result ok = MHD_queue_response(c, (unsigned)r->status, resp);
    MHD_destroy_response(resp);
    return ok;
}

static enum MHD_Result queue_error(struct MHD_Connection *c, int status, const char *code,
                                   const char *allow, const char *fmt, ...)
    __attribute__((format(printf, 5, 6)));
static enum MHD_Result queue_error(struct MHD_Connection *c, int status, const char *code,
                                   const char *allow, const char *fmt, ...)
{
    char msg[320];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    http_reply r;
    http_reply_error(&r, status, code, NULL, "%s", msg);
    return queue_buffer(c, &r, allow);
}

/* ---- streams ----------------------------------------------------------------------------- */

static int conn_gone(http_server *s, struct MHD_Connection *c)
{
    if (atomic_load(&s->stopping))
        return 1;
    const union MHD_ConnectionInfo *ci =
        MHD_get_connection_info(c, MHD_CONNECTION_INFO_CONNECTION_FD);
    if (!ci)
        return 1;
    struct pollfd p = {.fd = ci->connect_fd, .events = POLLIN | POLLRDHUP};
    if (poll(&p, 1, 0) <= 0)
        return 0;
    if (p.revents & (POLLRDHUP | POLLHUP | POLLERR))
        return 1;
    char b;
    ssize_t n = recv(ci->connect_fd, &b, 1, MSG_PEEK | MSG_DONTWAIT);
    return n == 0;
}

int http_client_gone(const http_request *rq)
{
    http_conn_ctx *cx = rq->conn;
    return conn_gone(cx->srv, cx->conn);
}

static ssize_t stream_reader(void *cls, uint64_t pos, char *buf, size_t max)
{
    http_stream_ctx *sc = cls;
    (void)pos;
    for (;;) {
        ssize_t n = sc->r.read(sc->r.stream, buf, max);
        if (n > 0)
            return n;
        if (n == -1)
            return MHD_CONTENT_READER_END_OF_STREAM;
        if (n < -1 || conn_gone(sc->srv, sc->conn))
            return MHD_CONTENT_READER_END_WITH_ERROR;
    }
}

static void stream_done(void *cls)
{
    http_stream_ctx *sc = cls;
    sc->r.stream_free(sc->r.stream);
    free(sc);
}

static enum MHD_Result queue_stream(http_server *s, struct MHD_Connection *c, http_reply *r)
{
    http_stream_ctx *sc = malloc(sizeof *sc);
    if (!sc) {
        r->stream_free(r->stream);
        return MHD_NO;
    }
    sc->r = *r;
    sc->conn = c;
    sc->srv = s;
    struct MHD_Response *resp =
        MHD_create_response_from_callback(MHD_SIZE_UNKNOWN, 16384, stream_reader, sc,
                                          stream_done);
    if (!resp) {
        stream_done(sc);
        return MHD_NO;
    }
    MHD_add_response_header(resp, "Content-Type", r->content_type);
    MHD_add_response_header(resp, "Cache-Control", "no-cache");
    enum MHD_Result ok = MHD_queue_response(c, (unsigned)r->status, resp);
    MHD_destroy_response(resp);
    return ok;
}

/* ---- the access handler ------------------------------------------------------------------- */

/* The media type of a Content-Type value, without parameters, compared without case. */
static int media_type_is(const char *value, const char *want)
{
    if (!value)
        return 0;
    size_t n = strcspn(value, ";");
    while (n > 0 && (value[n - 1] == ' ' || value[n - 1] == '\t'))
        n--;
    return n == strlen(want) && strncasecmp(value, want, n) == 0;
}

/* The checks made before any body is read; returns MHD_YES after queueing an error, or
 * sets *ok to 1 when the request may go on. */
static enum MHD_Result admit(http_server *s, http_conn_ctx *cx, struct MHD_Connection *c,
                             const char *url, const char *method, int *ok)
{
    *ok = 0;
    const http_route *path_match = NULL;
    char allow[64] = "";
    for (size_t i = 0; i < s->cfg.n_routes; i++) {
        const http_route *r = &s->cfg.routes[i];
        if (strcmp(r->path, url) != 0)
            continue;
        path_match = r;
        if (strcmp(r->method, method) == 0)
            cx->route = r;
        size_t used = strlen(allow);
        snprintf(allow + used, sizeof allow - used, "%s%s", used ? ", " : "", r->method);
    }
    if (!path_match)
        return queue_error(c, 404, "not_found", NULL, "no route %.200s", url);
    if (!cx->route)
        return queue_error(c, 405, "method_not_allowed", allow, "method not allowed here; use %s",
                           allow);
    const http_route *r = cx->route;
    if (r->content_type &&
        !media_type_is(MHD_lookup_connection_value(c, MHD_HEADER_KIND, "Content-Type"),
                       r->content_type))
        return queue_error(c, 415, "unsupported_media_type", NULL,
                           "the body must be %s", r->content_type);
    if (s->keys && r->scope != HTTP_SCOPE_NONE) {
        http_key *k = find_key(s, MHD_lookup_connection_value(c, MHD_HEADER_KIND,
                                                              "Authorization"));
        if (!k)
            return queue_error(c, 401, "invalid_api_key", NULL,
                               "a valid 'Authorization: Bearer KEY' header is required");
        if (k->scope < r->scope)
            return queue_error(c, 403, "insufficient_scope", NULL,
                               "key '%s' may not call this route", k->name);
        pthread_mutex_lock(&s->mu);
        int full = s->cfg.per_key_limit && k->in_flight >= s->cfg.per_key_limit;
        if (!full)
            k->in_flight++;
        pthread_mutex_unlock(&s->mu);
        if (full)
            return queue_error(c, 429, "rate_limit_exceeded", NULL,
                               "key '%s' has its limit of requests in flight; retry later",
                               k->name);
        cx->key = k;
    }
    const char *cl = MHD_lookup_connection_value(c, MHD_HEADER_KIND, "Content-Length");
    if (cl && strtoull(cl, NULL, 10) > s->cfg.max_body_bytes)
        return queue_error(c, 413, "request_too_large", NULL, "the body is over %zu bytes",
                           s->cfg.max_body_bytes);
    *ok = 1;
    return MHD_YES;
}

static enum MHD_Result on_request(void *cls, struct MHD_Connection *c, const char *url,
                                  const char *method, const char *version,
                                  const char *upload, size_t *upload_size, void **con_cls)
{
    http_server *s = cls;
    (void)version;
    http_conn_ctx *cx = *con_cls;
    if (!cx) {
        if (!(cx = calloc(1, sizeof *cx)))
            return MHD_NO;
        cx->conn = c;
        cx->srv = s;
        *con_cls = cx;
        int ok;
        enum MHD_Result res = admit(s, cx, c, url, method, &ok);
        if (!ok)
            cx->route = NULL;
        return res;
    }
    if (!cx->route) /* an error is already queued; drop what else comes */
        return MHD_YES;
    if (*upload_size > 0) {
        size_t n = *upload_size;
        *upload_size = 0;
        if (cx->too_large || cx->len + n > s->cfg.max_body_bytes) {
            cx->too_large = 1;
            return MHD_YES;
        }
        if (cx->len + n + 1 > cx->cap) {
            size_t cap = (cx->len + n + 1) * 2;
            if (cap > s->cfg.max_body_bytes + 1)
                cap = s->cfg.max_body_bytes + 1;
            char *b = realloc(cx->body, cap);
            if (!b)
                return MHD_NO;
            cx->body = b;
            cx->cap = cap;
        }
        memcpy(cx->body + cx->len, upload, n);
        cx->len += n;
        cx->body[cx->len] = '\0';
        return MHD_YES;
    }
    if (cx->too_large)
        return queue_error(c, 413, "request_too_large", NULL, "the body is over %zu bytes",
                           s->cfg.max_body_bytes);
    http_request rq = {.method = method,
                       .path = url,
                       .body = cx->body ? cx->body : "",
                       .body_len = cx->len,
                       .key_name = cx->key ? cx->key->name : NULL,
                       .conn = cx};
    http_reply r = {0};
    cx->route->handler(s->cfg.app, &rq, &r);
    return r.read ? queue_stream(s, c, &r) : queue_buffer(c, &r, NULL);
}

static void on_completed(void *cls, struct MHD_Connection *c, void **con_cls,
                         enum MHD_RequestTerminationCode toe)
{
    http_server *s = cls;
    http_conn_ctx *cx = *con_cls;
    (void)c, (void)toe;
    if (!cx)
        return;
    if (cx->key) {
        pthread_mutex_lock(&s->mu);
        cx->key->in_flight--;
        pthread_mutex_unlock(&s->mu);
    }
    free(cx->body);
    free(cx);
    *con_cls = NULL;
}

/* ---- start and stop ---------------------------------------------------------------------- */

di_status http_start(const http_config *cfg, http_server **out, int *port, di_error *err)
{
    char host[256];
    int p = 0;
    di_status st = svc_parse_hostport(cfg->listen, host, sizeof host, &p, err);
    if (st != DI_OK)
        return st;
    char ps[16];
    snprintf(ps, sizeof ps, "%d", p);
    struct addrinfo hints = {.ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM,
                             .ai_flags = AI_NUMERICSERV | AI_PASSIVE},
                    *ai = NULL;
    int gai = getaddrinfo(host, ps, &hints, &ai);
    if (gai != 0)
        return di_fail(err, DI_EINVAL, "--listen-http %s: %s", cfg->listen, gai_strerror(gai));
    http_server *s = calloc(1, sizeof *s);
    if (!s) {
        freeaddrinfo(ai);
        return di_fail(err, DI_ENOMEM, "out of memory");
    }
    s->cfg = *cfg;
    pthread_mutex_init(&s->mu, NULL);
    if (cfg->api_key_file && (st = load_keys(cfg->api_key_file, &s->keys, &s->n_keys, err)) !=
                                 DI_OK) {
        freeaddrinfo(ai);
        http_stop(s);
        return st;
    }
    unsigned flags = MHD_USE_THREAD_PER_CONNECTION | MHD_USE_INTERNAL_POLLING_THREAD;
    if (ai->ai_family == AF_INET6)
        flags |= MHD_USE_IPv6;
    s->d = MHD_start_daemon(flags, 0, NULL, NULL, on_request, s, MHD_OPTION_SOCK_ADDR,
                            ai->ai_addr, MHD_OPTION_NOTIFY_COMPLETED, on_completed, s,
                            MHD_OPTION_CONNECTION_LIMIT,
                            (unsigned)(cfg->max_connections ? cfg->max_connections : 256),
                            MHD_OPTION_CONNECTION_TIMEOUT,
                            (unsigned)(cfg->idle_timeout_s ? cfg->idle_timeout_s : 60),
                            MHD_OPTION_END);
    freeaddrinfo(ai);
    if (!s->d) {
        http_stop(s);
        return di_fail(err, DI_EUNAVAIL, "--listen-http %s: cannot bind (in use, or not an "
                       "address of this host)", cfg->listen);
    }
    const union MHD_DaemonInfo *di = MHD_get_daemon_info(s->d, MHD_DAEMON_INFO_BIND_PORT);
    *port = di ? di->port : p;
    *out = s;
    return DI_OK;
}

void http_stop(http_server *s)
{
    if (!s)
        return;
    atomic_store(&s->stopping, 1);
    if (s->d)
        MHD_stop_daemon(s->d);
    if (s->keys) {
        memset(s->keys, 0, s->n_keys * sizeof *s->keys);
        free(s->keys);
    }
    pthread_mutex_destroy(&s->mu);
    free(s);
}
