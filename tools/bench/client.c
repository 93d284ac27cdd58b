/* client.c: a small HTTP/1.1 + server-sent-events client (see client.h). */
#include "tools/bench/client.h"

#include <jansson.h>
#include <netdb.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include "common/util/clock.h"

typedef struct buf {
    char *p;
    size_t len, cap;
} buf;

static int buf_add(buf *b, const char *s, size_t n)
{
    if (b->len + n + 1 > b->cap) {
        size_t c = b->cap ? b->cap * 2 : 8192;
        while (c < b->len + n + 1)
            c *= 2;
        char *q = realloc(b->p, c);
        if (!q)
            return -1;
        b->p = q;
        b->cap = c;
    }
    memcpy(b->p + b->len, s, n);
    b->len += n;
    b->p[b->len] = '\0';
    return 0;
}

typedef struct sse_state {
    bcl_result *r;
    uint64_t t0, last;
    uint32_t events;
    size_t gap_cap;
    int done, error;
} sse_state;

static void on_event(sse_state *s, const char *data, size_t n)
{
    if (n >= 6 && strncmp(data, "[DONE]", 6) == 0) {
        s->done = 1;
        return;
    }
    json_t *o = json_loadb(data, n, 0, NULL);
    if (!o)
        return;
    json_t *e = json_object_get(o, "error");
    if (e) {
        s->error = 1;
        snprintf(s->r->err, sizeof s->r->err, "error event: %s",
                 json_string_value(json_object_get(e, "message")));
    }
    json_t *c = json_array_get(json_object_get(o, "choices"), 0);
    json_t *t = json_object_get(c, "text");
    if (!t)
        t = json_object_get(json_object_get(c, "delta"), "content");
    if (json_is_string(t) && json_string_length(t) > 0) {
        uint64_t now = di_mono_ns();
        if (s->events == 0) {
            s->r->ttft_s = (double)(now - s->t0) * 1e-9;
        } else {
            if (s->r->n_gaps == s->gap_cap) {
                s->gap_cap = s->gap_cap ? s->gap_cap * 2 : 64;
                double *g = realloc(s->r->gaps, s->gap_cap * sizeof *g);
                if (g)
                    s->r->gaps = g;
                else
                    s->gap_cap = s->r->n_gaps;
            }
            if (s->r->n_gaps < s->gap_cap)
                s->r->gaps[s->r->n_gaps++] = (double)(now - s->last) * 1e-9;
        }
        s->last = now;
        s->events++;
    }
    json_t *u = json_object_get(o, "usage");
    if (json_is_object(u)) {
        s->r->out_tok = (uint32_t)json_integer_value(json_object_get(u, "completion_tokens"));
        s->r->in_tok = (uint32_t)json_integer_value(json_object_get(u, "prompt_tokens"));
        s->r->cached_tok = (uint32_t)json_integer_value(
            json_object_get(json_object_get(u, "prompt_tokens_details"), "cached_tokens"));
    }
    json_decref(o);
}

/* Takes every complete "data: ...\n\n" event off the front of b. */
static void drain_events(sse_state *s, buf *b, size_t *pos)
{
    char *end;
    while ((end = strstr(b->p + *pos, "\n\n")) != NULL) {
        char *ev = b->p + *pos;
        if (strncmp(ev, "data: ", 6) == 0)
            on_event(s, ev + 6, (size_t)(end - ev - 6));
        *pos = (size_t)(end - b->p) + 2;
    }
}

static int dial(const char *host, int port, double timeout_s)
{
    char ps[16];
    snprintf(ps, sizeof ps, "%d", port);
    struct addrinfo hints = {.ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM}, *ai = NULL;
    if (getaddrinfo(host, ps, &hints, &ai) != 0)
        return -1;
    int fd = socket(ai->ai_family, SOCK_STREAM, 0);
    if (fd >= 0 && connect(fd, ai->ai_addr, ai->ai_addrlen) != 0) {
        close(fd);
        fd = -1;
    }
    freeaddrinfo(ai);
    if (fd >= 0) {
        struct timeval tv = {(time_t)timeout_s, (suseconds_t)((timeout_s - (time_t)timeout_s) * 1e6)};
        setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    }
    return fd;
}

void bcl_run(const char *host, int port, const char *path, const char *token, const char *body,
             double timeout_s, bcl_result *out)
{
    memset(out, 0, sizeof *out);
    sse_state s = {.r = out, .t0 = di_mono_ns()};
    int fd = dial(host, port, timeout_s);
    if (fd < 0) {
        snprintf(out->err, sizeof out->err, "cannot connect to %s:%d", host, port);
        return;
    }
    char head[1024];
    int hn = snprintf(head, sizeof head,
                      "POST %s HTTP/1.1\r\nHost: %s\r\nConnection: close\r\nContent-Type: "
                      "application/json\r\nAccept: text/event-stream\r\n%s%s%sContent-Length: "
                      "%zu\r\n\r\n",
                      path, host, token ? "Authorization: Bearer " : "", token ? token : "",
                      token ? "\r\n" : "", strlen(body));
    if (write(fd, head, (size_t)hn) != hn ||
        write(fd, body, strlen(body)) != (ssize_t)strlen(body)) {
        snprintf(out->err, sizeof out->err, "send failed");
        close(fd);
        return;
    }
    buf raw = {0}, sse = {0};
    size_t raw_pos = 0, sse_pos = 0;
    int head_done = 0, chunked = 0, finished = 0;
    char tmp[16384];
    ssize_t k;
    while (!finished && (k = read(fd, tmp, sizeof tmp)) > 0) {
        if (buf_add(&raw, tmp, (size_t)k) != 0)
            break;
        if (!head_done) {
            char *eoh = strstr(raw.p, "\r\n\r\n");
            if (!eoh)
                continue;
            head_done = 1;
            sscanf(raw.p, "HTTP/1.%*d %d", &out->status);
            *eoh = '\0';
            chunked = strcasestr(raw.p, "Transfer-Encoding: chunked") != NULL;
            raw_pos = (size_t)(eoh - raw.p) + 4;
        }
        if (!chunked) {
            buf_add(&sse, raw.p + raw_pos, raw.len - raw_pos);
            raw_pos = raw.len;
        } else {
            for (;;) {
                char *crlf = strstr(raw.p + raw_pos, "\r\n");
                if (!crlf)
                    break;
                size_t n = strtoul(raw.p + raw_pos, NULL, 16);
                size_t data = (size_t)(crlf - raw.p) + 2;
                if (n == 0) {
                    finished = 1;
                    break;
                }
                if (raw.len < data + n + 2)
                    break;
                buf_add(&sse, raw.p + data, n);
                raw_pos = data + n + 2;
            }
        }
        if (sse.p)
            drain_events(&s, &sse, &sse_pos);
        if (s.done)
            finished = 1;
    }
    close(fd);
    out->e2e_s = (double)(di_mono_ns() - s.t0) * 1e-9;
    if (!out->out_tok)
        out->out_tok = s.events;
    if (s.events == 0) /* no text came (e.g. one token of no text): the first token is the end */
        out->ttft_s = out->e2e_s;
    if (out->status != 200 && !out->err[0])
        snprintf(out->err, sizeof out->err, "HTTP %d: %.100s", out->status,
                 sse.p ? sse.p : "");
    else if (!s.done && !out->err[0])
        snprintf(out->err, sizeof out->err, "the stream ended without [DONE]");
    out->ok = out->status == 200 && s.done && !s.error;
    free(raw.p);
    free(sse.p);
}
