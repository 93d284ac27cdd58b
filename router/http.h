/* http.h: the router's HTTP server on libmicrohttpd. Prefix: http_.
 *
 * Behaviour is a table (H2): one http_route row per path with its method, handler, the
 * content type a body must have and the key scope it needs. For every request, in order:
 *   unknown path                          404
 *   method not the route's                405 (Allow header names the route's)
 *   POST without the route's content type 415
 *   no or malformed Authorization: Bearer 401 (only when keys are configured)
 *   a key without the route's scope       403
 *   a key at its concurrency limit        429
 *   Content-Length or body over the limit 413
 * then the handler runs on the connection's own thread with the whole body. Errors are
 * OpenAI's JSON shape. A handler answers with a buffer, or with a stream: a read function the
 * server calls from the connection's thread until it ends, and a free function called exactly
 * once when the response is done, also when the client went away (the stream's owner cancels
 * its work there). A client that closes its socket is noticed within HTTP_POLL_MS.
 */
#ifndef DI_ROUTER_HTTP_H
#define DI_ROUTER_HTTP_H

#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#include "common/util/status.h"

#define HTTP_POLL_MS 50 /* how often a waiting stream looks for a closed client */

typedef enum http_scope {
    HTTP_SCOPE_NONE = 0,     /* no key needed (health) */
    HTTP_SCOPE_READ = 1,     /* models, metrics: any valid key */
    HTTP_SCOPE_GENERATE = 2, /* completions: a key with the generate scope */
} http_scope;

typedef struct http_request {
    const char *method;   /* "GET", "POST" */
    const char *path;     /* "/v1/completions" */
    const char *body;     /* NUL-terminated (the NUL not counted), or "" */
    size_t body_len;      /* bytes */
    const char *key_name; /* the key's name from the key file, or NULL without keys */
    void *conn;           /* the connection, for http_client_gone */
} http_request;

/* Reads the next bytes of a stream into buf (at most max). Returns the bytes written (> 0),
 * 0 when nothing is ready yet (wait at most about HTTP_POLL_MS before returning 0), -1 at the
 * clean end, -2 when the stream failed. */
typedef ssize_t (*http_stream_read_fn)(void *stream, char *buf, size_t max);

typedef struct http_reply {
    int status;               /* HTTP status */
    const char *content_type; /* static */
    char *body;               /* malloc'd, taken by the server; NULL for a stream */
    size_t body_len;
    http_stream_read_fn read; /* non-NULL: a server-sent-event stream */
    void (*stream_free)(void *stream); /* called once when the stream response is done */
    void *stream;
} http_reply;

typedef void (*http_handler_fn)(void *app, const http_request *rq, http_reply *out);

typedef struct http_route {
    const char *method;       /* "GET" or "POST" */
    const char *path;         /* exact path */
    http_handler_fn handler;
    const char *content_type; /* a POST body's required media type, or NULL */
    http_scope scope;         /* the key scope needed */
} http_route;

typedef struct http_config {
    const char *listen;         /* HOST:PORT; port 0 picks one */
    const http_route *routes;   /* the table, n_routes rows */
    size_t n_routes;
    void *app;                  /* passed to handlers */
    size_t max_body_bytes;      /* larger bodies are 413 */
    uint32_t per_key_limit;     /* requests in flight per key (0 = no limit) */
    uint32_t max_connections;   /* open connections at most */
    uint32_t idle_timeout_s;    /* an idle connection is closed after this */
    const char *api_key_file;   /* NULL: no auth. Lines "NAME TOKEN [SCOPE]", SCOPE "read"
                                   or "generate" (default); '#' starts a comment */
} http_config;

typedef struct http_server http_server;

/* Reads the keys, binds and starts serving on threads of its own. *port receives the bound
 * port. Returns DI_OK, DI_EINVAL (bad listen address, a malformed key file line: the message
 * names the line), DI_ENOENT/DI_EIO (key file), DI_EUNAVAIL (cannot bind), DI_ENOMEM. */
di_status http_start(const http_config *cfg, http_server **out, int *port, di_error *err);

/* Stops accepting, ends every stream (their free functions run) and joins the threads.
 * NULL-safe. */
void http_stop(http_server *s);

/* 1 when the client of a request has closed its connection (or the server is stopping). */
int http_client_gone(const http_request *rq);

/* Fills a reply with OpenAI's error JSON. */
void http_reply_error(http_reply *out, int status, const char *code, const char *param,
                      const char *fmt, ...) __attribute__((format(printf, 5, 6)));

/* Fills a reply with a malloc'd JSON text (taken; NULL means out of memory: a 503). */
void http_reply_json(http_reply *out, int status, char *json);

/* Parses one key file into a count of keys (for tests and --help checks). */
di_status http_keys_check(const char *path, size_t *n_keys, di_error *err);

#endif
