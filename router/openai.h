/* openai.h: the OpenAI-compatible request layer of di-router as pure functions. Prefix: oai_.
 *
 * Parsing turns a POST /v1/completions or /v1/chat/completions body into one oai_request,
 * checking every parameter against its bounds; a failure fills an oai_error with the HTTP
 * status, OpenAI's error type, the offending parameter and a one-line message, so that the
 * HTTP layer only has to send oai_error_json(). Builders turn generated tokens into the
 * response object, server-sent-event chunks and usage. No function here does I/O or logs, and
 * none keeps state between calls: any number of threads may call them at once.
 *
 * Checks made by oai_parse, in order (the first failure is reported):
 *   body larger than limits->max_body_bytes         413 invalid_request_error
 *   body not valid UTF-8 (the byte offset given)     400 invalid_request_error
 *   arrays/objects nested deeper than max_depth      400 invalid_request_error
 *   not JSON, or not a JSON object                   400 invalid_request_error
 *   a parameter of the wrong type or out of range    400 invalid_request_error, param = its name
 *   a model other than limits->model                 404 invalid_request_error, model_not_found
 *   a token id outside [0, limits->vocab_size)       400, param "prompt"
 *   more prompt ids than max_prompt_tokens           400, param "prompt"
 * Unknown fields are ignored (as OpenAI does); fields that would change the result and are
 * not supported (n != 1, best_of != 1, echo, suffix, non-zero penalties, logit_bias) are 400.
 */
#ifndef DI_ROUTER_OPENAI_H
#define DI_ROUTER_OPENAI_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/tokenizer/tokenizer.h"
#include "router/backend.h"
#include "common/util/status.h"

#define OAI_MAX_STOP 4             /* stop strings a request may give (OpenAI's limit) */
#define OAI_MAX_STOP_BYTES 256     /* bytes of one stop string */
#define OAI_MAX_TOP_LOGPROBS 20    /* top_logprobs / logprobs bound */
#define OAI_MAX_MESSAGES 4096      /* chat messages in one request */
#define OAI_SSE_DONE "data: [DONE]\n\n"

typedef enum oai_kind {
    OAI_COMPLETION = 0, /* POST /v1/completions */
    OAI_CHAT = 1,       /* POST /v1/chat/completions */
} oai_kind;

/* Bounds the router applies to every request (from its options). */
typedef struct oai_limits {
    size_t max_body_bytes;      /* request body bytes; larger is 413 */
    int max_depth;              /* JSON nesting depth (objects and arrays), >= 1 */
    uint32_t max_prompt_tokens; /* prompt ids after tokenisation */
    uint32_t max_output_tokens; /* max_tokens bound; also the default when none is given */
    int32_t vocab_size;         /* token ids must be in [0, vocab_size) */
    const char *model;          /* the served model name; a request naming another is 404 */
} oai_limits;

/* One request, either kind. Owned strings are freed by oai_request_free. */
typedef struct oai_request {
    oai_kind kind;
    char *model;              /* as given (owned); NULL when the request gave none */
    char *prompt_text;        /* completion text prompt, or the rendered chat (owned); NULL
                                 when the prompt was given as ids */
    bool prompt_is_ids;       /* prompt given as a list of token ids */
    tok_ids prompt_ids;       /* ids given, or filled by oai_tokenize */
    uint32_t max_tokens;      /* output tokens at most, 1..limits.max_output_tokens */
    float temperature;        /* 0..2, default 1 */
    float top_p;              /* (0, 1], default 1 */
    int32_t top_k;            /* -1 (off) or 1..vocab_size; 0 is taken as off */
    bool has_seed;            /* a seed was given */
    uint64_t seed;            /* 0..2^63-1 */
    char *stop[OAI_MAX_STOP]; /* stop strings (owned), n_stop of them */
    size_t n_stop;
    bool logprobs;            /* report the chosen token's logprob */
    uint32_t top_logprobs;    /* alternatives per token, 0..20 */
    bool ignore_eos;          /* keep going past EOS up to max_tokens */
    bool tokens_as_ids;       /* return_tokens_as_token_ids (vLLM): logprobs name tokens
                                 "token_id:ID" instead of their text */
    bool stream;              /* answer as server-sent events */
    bool include_usage;       /* stream_options.include_usage: a final usage chunk */
} oai_request;

/* The generation a checked request asks the backend for (its prompt ids borrowed from r). */
rt_gen_req oai_gen_req(const oai_request *r);

/* A request failure in OpenAI's shape. */
typedef struct oai_error {
    int status;         /* HTTP status: 400, 401, 403, 404, 405, 413, 415, 429, 500, 503 */
    const char *type;   /* "invalid_request_error", "authentication_error", ... (static) */
    const char *code;   /* static, or NULL (JSON null) */
    char param[64];     /* the offending parameter, or "" (JSON null) */
    char message[320];  /* one line, no CR/LF */
} oai_error;

/* Fills err with status, the type that belongs to it, code (may be NULL), param (may be NULL)
 * and a printf message. Returns the di_status that matches status (DI_EINVAL for 400, ...). */
di_status oai_fail(oai_error *err, int status, const char *code, const char *param,
                   const char *fmt, ...) __attribute__((format(printf, 5, 6)));

/* OpenAI's error type for an HTTP status ("invalid_request_error" for 400/404/405/413/415,
 * "authentication_error" 401, "permission_error" 403, "rate_limit_error" 429,
 * "server_error" 5xx). */
const char *oai_error_type(int status);

/* Parses a request body of `len` bytes (need not be NUL-terminated). Returns DI_OK with *out
 * filled (release with oai_request_free), or the failure's di_status with err filled and
 * *out zeroed. See the table at the top for what is checked. */
di_status oai_parse(oai_kind kind, const char *body, size_t len, const oai_limits *limits,
                    oai_request *out, oai_error *err);

/* Tokenises a text prompt into req->prompt_ids (chat text starts with the BOS token's text;
 * a completion prompt gets the BOS id prepended when add_bos and the tokenizer has one) and
 * checks the count against limits->max_prompt_tokens. For ids given in the request it only
 * checks the count. Errors: 400 param "prompt" (too long, empty, or not encodable). */
di_status oai_tokenize(oai_request *req, const tok_tokenizer *tok, bool add_bos,
                       const oai_limits *limits, oai_error *err);

/* Frees the owned parts and zeroes *req. NULL-safe. */
void oai_request_free(oai_request *req);

/* 1 when `len` bytes are valid UTF-8 (no overlongs, surrogates or code points past U+10FFFF);
 * otherwise 0 and *bad_offset (when not NULL) receives the offset of the first bad byte. */
int oai_utf8_valid(const char *s, size_t len, size_t *bad_offset);

/* ---- responses --------------------------------------------------------------------------- */

/* One alternative of a token's top logprobs. */
typedef struct oai_top {
    int32_t id;       /* token id */
    const char *text; /* its text (decoded bytes, may be partial UTF-8 repaired) */
    float logprob;    /* natural log probability */
} oai_top;

/* One generated token as the builders report it. */
typedef struct oai_token {
    int32_t id;         /* token id */
    const char *text;   /* its text alone */
    float logprob;      /* logprob of the chosen token */
    const oai_top *top; /* n_top alternatives, most likely first */
    size_t n_top;
} oai_token;

typedef struct oai_usage {
    uint32_t prompt_tokens;     /* prompt ids */
    uint32_t completion_tokens; /* generated ids */
    uint32_t cached_tokens;     /* prompt ids served from the KV store */
} oai_usage;

/* The full (non-streaming) response. text is the whole output; toks the generated tokens
 * (used only when req->logprobs); finish "stop", "length" or "abort". Logprobs are written with
 * 9 significant digits (round-trip for float). Returns a malloc'd NUL-terminated JSON text, or
 * NULL when out of memory. */
char *oai_response_json(const oai_request *req, const char *id, int64_t created,
                        const char *text, const oai_token *toks, size_t n_toks,
                        const char *finish, const oai_usage *usage);

/* One server-sent event "data: {...}\n\n" carrying a text delta, its tokens (for logprobs)
 * and, on the last chunk, finish (NULL before). For chat, the first chunk (first = true)
 * carries the assistant role. Chunks carry "usage": null when include_usage is set. malloc'd,
 * NULL when out of memory. */
char *oai_chunk_sse(const oai_request *req, const char *id, int64_t created, bool first,
                    const char *delta, const oai_token *toks, size_t n_toks,
                    const char *finish);

/* The final usage event (choices [] and usage) sent before [DONE] when include_usage is set.
 * malloc'd, NULL when out of memory. */
char *oai_usage_sse(const oai_request *req, const char *id, int64_t created,
                    const oai_usage *usage);

/* The event that says the request continues on another decode rank: choices [] and
 * "continued": {"from", "to" ("HOST:PORT"), "after_tokens" (tokens sent before)}. malloc'd,
 * NULL when out of memory. */
char *oai_continued_sse(const oai_request *req, const char *id, int64_t created,
                        const char *from, const char *to, uint32_t after_tokens);

/* {"error": {"message", "type", "param", "code"}}, malloc'd; NULL when out of memory. */
char *oai_error_json(const oai_error *err);

/* The same error as one server-sent event, for a stream that fails after it started. */
char *oai_error_sse(const oai_error *err);

#endif
