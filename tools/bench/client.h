/* client.h: one streamed OpenAI request over HTTP/1.1 (chunked or not) with the times di-bench
 * measures. Prefix: bcl_. */
#ifndef DI_BENCH_CLIENT_H
#define DI_BENCH_CLIENT_H

#include <stddef.h>
#include <stdint.h>

typedef struct bcl_result {
    int ok;             /* 1: status 200, no error event, [DONE] seen */
    int status;         /* HTTP status, 0 when none came */
    double ttft_s;      /* send -> first non-empty text event (the end when none came) */
    double e2e_s;       /* send -> end */
    uint32_t out_tok;   /* usage.completion_tokens, else the text events */
    uint32_t in_tok;    /* usage.prompt_tokens */
    uint32_t cached_tok; /* usage.prompt_tokens_details.cached_tokens (0 when absent) */
    double *gaps;       /* seconds between text events (malloc'd), n_gaps of them */
    size_t n_gaps;
    char err[160];      /* why it failed */
} bcl_result;

/* Sends `body` to http://host:port/path with the bearer token (may be NULL) and reads the
 * event stream to its end, giving up after timeout_s. Fills *out (free out->gaps). */
void bcl_run(const char *host, int port, const char *path, const char *token, const char *body,
             double timeout_s, bcl_result *out);

#endif
