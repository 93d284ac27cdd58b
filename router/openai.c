/* openai.c: parsing, validation and response builders of the OpenAI layer (see openai.h). */
#include "router/openai.h"

#include <jansson.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* Logprobs are floats: 9 significant digits read back to the same float. */
#define OAI_JSON_FLAGS (JSON_COMPACT | JSON_REAL_PRECISION(9))

const char *oai_error_type(int status)
{
    switch (status) {
    case 401: return "authentication_error";
    case 403: return "permission_error";
    case 429: return "rate_limit_error";
    default: return status >= 500 ? "server_error" : "invalid_request_error";
    }
}

static di_status status_of_http(int status)
{
    switch (status) {
    case 401: return DI_EAUTH;
    case 403: return DI_EPERM;
    case 404: return DI_ENOENT;
    case 413: return DI_ERANGE;
    case 429: return DI_EFULL;
    case 503: return DI_EUNAVAIL;
    default: return status >= 500 ? DI_EINTERNAL : DI_EINVAL;
    }
}

di_status oai_fail(oai_error *err, int status, const char *code, const char *param,
                   const char *fmt, ...)
{
    if (err) {
        err->status = status;
        err->type = oai_error_type(status);
        err->code = code;
        snprintf(err->param, sizeof err->param, "%s", param ? param : "");
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(err->message, sizeof err->message, fmt, ap);
        va_end(ap);
        for (char *p = err->message; *p; p++)
            if (*p == '\r' || *p == '\n')
                *p = ' ';
    }
    return status_of_http(status);
}

int oai_utf8_valid(const char *s, size_t len, size_t *bad_offset)
{
    const unsigned char *u = (const unsigned char *)s;
    size_t i = 0;
    while (i < len) {
        unsigned c = u[i];
        size_t n;
        unsigned cp, min;
        if (c < 0x80) {
            i++;
            continue;
        } else if ((c & 0xE0) == 0xC0) {
            n = 2, cp = c & 0x1F, min = 0x80;
        } else if ((c & 0xF0) == 0xE0) {
            n = 3, cp = c & 0x0F, min = 0x800;
        } else if ((c & 0xF8) == 0xF0) {
            n = 4, cp = c & 0x07, min = 0x10000;
        } else {
            goto bad;
        }
        if (len - i < n)
            goto bad;
        for (size_t k = 1; k < n; k++) {
            if ((u[i + k] & 0xC0) != 0x80)
                goto bad;
            cp = (cp << 6) | (u[i + k] & 0x3F);
        }
        if (cp < min || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF))
            goto bad;
        i += n;
    }
    return 1;
bad:
    if (bad_offset)
        *bad_offset = i;
    return 0;
}

/* Deepest nesting of arrays and objects, strings skipped; stops counting past limit. */
static int json_depth_exceeds(const char *s, size_t len, int limit)
{
    int depth = 0;
    bool in_str = false;
    for (size_t i = 0; i < len; i++) {
        char c = s[i];
        if (in_str) {
            if (c == '\\')
                i++;
            else if (c == '"')
                in_str = false;
        } else if (c == '"') {
            in_str = true;
        } else if (c == '[' || c == '{') {
            if (++depth > limit)
                return 1;
        } else if (c == ']' || c == '}') {
            depth--;
        }
    }
    return 0;
}

/* ---- typed field readers: each returns 1 when the field is present and valid, 0 when
 * absent (or JSON null), -1 after filling err. ------------------------------------------- */

static int get_bool(json_t *root, const char *key, bool *out, oai_error *err)
{
    json_t *v = json_object_get(root, key);
    if (!v || json_is_null(v))
        return 0;
    if (!json_is_boolean(v)) {
        oai_fail(err, 400, "invalid_type", key, "'%s' must be a boolean", key);
        return -1;
    }
    *out = json_is_true(v);
    return 1;
}

static int get_int(json_t *root, const char *key, int64_t lo, int64_t hi, int64_t *out,
                   oai_error *err)
{
    json_t *v = json_object_get(root, key);
    if (!v || json_is_null(v))
        return 0;
    if (!json_is_integer(v)) {
        oai_fail(err, 400, "invalid_type", key, "'%s' must be an integer", key);
        return -1;
    }
    int64_t x = json_integer_value(v);
    if (x < lo || x > hi) {
        oai_fail(err, 400, "invalid_value", key, "'%s' is %lld; it must be in %lld..%lld", key,
                 (long long)x, (long long)lo, (long long)hi);
        return -1;
    }
    *out = x;
    return 1;
}

/* lo_open: the bound lo itself is refused. */
static int get_num(json_t *root, const char *key, double lo, bool lo_open, double hi,
                   double *out, oai_error *err)
{
    json_t *v = json_object_get(root, key);
    if (!v || json_is_null(v))
        return 0;
    if (!json_is_number(v)) {
        oai_fail(err, 400, "invalid_type", key, "'%s' must be a number", key);
        return -1;
    }
    double x = json_number_value(v);
    if (!(lo_open ? x > lo : x >= lo) || !(x <= hi)) {
        oai_fail(err, 400, "invalid_value", key, "'%s' is %g; it must be in %s%g, %g]", key, x,
                 lo_open ? "(" : "[", lo, hi);
        return -1;
    }
    *out = x;
    return 1;
}

static char *dup_str(const char *s, size_t n)
{
    char *d = malloc(n + 1);
    if (d) {
        memcpy(d, s, n);
        d[n] = '\0';
    }
    return d;
}

static di_status parse_stop(json_t *root, oai_request *r, oai_error *err)
{
    json_t *v = json_object_get(root, "stop");
    if (!v || json_is_null(v))
        return DI_OK;
    json_t *one[1] = {v};
    json_t **items = one;
    size_t n = 1;
    json_t *arr = NULL;
    if (json_is_array(v)) {
        arr = v;
        n = json_array_size(v);
        if (n > OAI_MAX_STOP)
            return oai_fail(err, 400, "invalid_value", "stop",
                            "'stop' has %zu strings; at most %d are allowed", n, OAI_MAX_STOP);
    } else if (!json_is_string(v)) {
        return oai_fail(err, 400, "invalid_type", "stop",
                        "'stop' must be a string or a list of strings");
    }
    for (size_t i = 0; i < n; i++) {
        json_t *s = arr ? json_array_get(arr, i) : items[0];
        if (!json_is_string(s))
            return oai_fail(err, 400, "invalid_type", "stop",
                            "'stop' must be a string or a list of strings");
        size_t len = json_string_length(s);
        if (len == 0 || len > OAI_MAX_STOP_BYTES)
            return oai_fail(err, 400, "invalid_value", "stop",
                            "each stop string must have 1..%d bytes", OAI_MAX_STOP_BYTES);
        if (!(r->stop[r->n_stop] = dup_str(json_string_value(s), len)))
            return oai_fail(err, 503, NULL, NULL, "out of memory");
        r->n_stop++;
    }
    return DI_OK;
}

static di_status parse_prompt(json_t *root, const oai_limits *lim, oai_request *r,
                              oai_error *err)
{
    json_t *v = json_object_get(root, "prompt");
    if (!v || json_is_null(v))
        return oai_fail(err, 400, "missing_required_parameter", "prompt",
                        "'prompt' is required");
    if (json_is_string(v)) {
        if (json_string_length(v) == 0)
            return oai_fail(err, 400, "invalid_value", "prompt", "'prompt' is empty");
        if (!(r->prompt_text = dup_str(json_string_value(v), json_string_length(v))))
            return oai_fail(err, 503, NULL, NULL, "out of memory");
        return DI_OK;
    }
    if (!json_is_array(v))
        return oai_fail(err, 400, "invalid_type", "prompt",
                        "'prompt' must be a string or a list of token ids");
    size_t n = json_array_size(v);
    if (n == 0)
        return oai_fail(err, 400, "invalid_value", "prompt", "'prompt' is an empty list");
    if (json_is_string(json_array_get(v, 0)) || json_is_array(json_array_get(v, 0)))
        return oai_fail(err, 400, "invalid_value", "prompt",
                        "batched prompts are not supported; send one prompt per request");
    if (n > lim->max_prompt_tokens)
        return oai_fail(err, 400, "context_length_exceeded", "prompt",
                        "the prompt has %zu tokens; at most %u are allowed", n,
                        lim->max_prompt_tokens);
    r->prompt_is_ids = true;
    for (size_t i = 0; i < n; i++) {
        json_t *t = json_array_get(v, i);
        if (!json_is_integer(t))
            return oai_fail(err, 400, "invalid_type", "prompt",
                            "prompt[%zu] is not an integer token id", i);
        json_int_t id = json_integer_value(t);
        if (id < 0 || id >= lim->vocab_size)
            return oai_fail(err, 400, "invalid_value", "prompt",
                            "prompt[%zu] = %lld is not a token id (0..%d)", i, (long long)id,
                            lim->vocab_size - 1);
        if (tok_ids_push(&r->prompt_ids, (int32_t)id, NULL) != DI_OK)
            return oai_fail(err, 503, NULL, NULL, "out of memory");
    }
    return DI_OK;
}

static di_status parse_messages(json_t *root, oai_request *r, oai_error *err)
{
    json_t *v = json_object_get(root, "messages");
    if (!v || json_is_null(v))
        return oai_fail(err, 400, "missing_required_parameter", "messages",
                        "'messages' is required");
    if (!json_is_array(v))
        return oai_fail(err, 400, "invalid_type", "messages", "'messages' must be a list");
    size_t n = json_array_size(v);
    if (n == 0 || n > OAI_MAX_MESSAGES)
        return oai_fail(err, 400, "invalid_value", "messages",
                        "'messages' has %zu entries; it must have 1..%d", n, OAI_MAX_MESSAGES);
    for (size_t i = 0; i < n; i++) {
        json_t *m = json_array_get(v, i);
        json_t *c = json_is_object(m) ? json_object_get(m, "content") : NULL;
        if (!json_is_object(m) || !json_is_string(json_object_get(m, "role")))
            return oai_fail(err, 400, "invalid_type", "messages",
                            "messages[%zu] must be an object with a string 'role'", i);
        if (c && !json_is_string(c) && !json_is_null(c))
            return oai_fail(err, 400, "invalid_type", "messages",
                            "messages[%zu].content must be a string", i);
    }
    di_error de = {0};
    size_t len = 0;
    if (tok_chat_render_json(v, true, &r->prompt_text, &len, &de) != DI_OK)
        return oai_fail(err, de.code == DI_ENOMEM ? 503 : 400, "invalid_value", "messages",
                        "%s", de.msg);
    return DI_OK;
}

/* Fields that would change the output and that the router does not implement. */
static di_status refuse_unsupported(json_t *root, oai_error *err)
{
    int64_t x = 1;
    int rc;
    if ((rc = get_int(root, "n", 1, 1, &x, err)) < 0)
        return oai_fail(err, 400, "invalid_value", "n", "only n = 1 is supported");
    if ((rc = get_int(root, "best_of", 1, 1, &x, err)) < 0)
        return oai_fail(err, 400, "invalid_value", "best_of", "only best_of = 1 is supported");
    bool b = false;
    if (get_bool(root, "echo", &b, err) < 0)
        return DI_EINVAL;
    if (b)
        return oai_fail(err, 400, "invalid_value", "echo", "echo is not supported");
    static const char *const zero_nums[] = {"presence_penalty", "frequency_penalty"};
    for (size_t i = 0; i < 2; i++) {
        double d = 0;
        if (get_num(root, zero_nums[i], -2, false, 2, &d, err) < 0)
            return DI_EINVAL;
        if (d != 0)
            return oai_fail(err, 400, "invalid_value", zero_nums[i], "'%s' must be 0",
                            zero_nums[i]);
    }
    static const char *const absent[] = {"suffix", "logit_bias", "tools", "response_format"};
    for (size_t i = 0; i < 4; i++) {
        json_t *v = json_object_get(root, absent[i]);
        if (v && !json_is_null(v))
            return oai_fail(err, 400, "invalid_value", absent[i], "'%s' is not supported",
                            absent[i]);
    }
    return DI_OK;
}

static di_status parse_sampling(json_t *root, const oai_limits *lim, oai_request *r,
                                oai_error *err)
{
    double d;
    int64_t x;
    int rc;
    if ((rc = get_num(root, "temperature", 0, false, 2, &d, err)) < 0)
        return DI_EINVAL;
    r->temperature = rc ? (float)d : 1.0f;
    if ((rc = get_num(root, "top_p", 0, true, 1, &d, err)) < 0)
        return DI_EINVAL;
    r->top_p = rc ? (float)d : 1.0f;
    if ((rc = get_int(root, "top_k", -1, lim->vocab_size, &x, err)) < 0)
        return DI_EINVAL;
    r->top_k = (rc && x > 0) ? (int32_t)x : -1;
    if ((rc = get_int(root, "seed", 0, INT64_MAX, &x, err)) < 0)
        return DI_EINVAL;
    r->has_seed = rc == 1;
    r->seed = rc ? (uint64_t)x : 0;
    /* max_completion_tokens (chat's newer name) wins over max_tokens when both are given. */
    r->max_tokens = lim->max_output_tokens;
    if ((rc = get_int(root, "max_tokens", 1, lim->max_output_tokens, &x, err)) < 0)
        return DI_EINVAL;
    if (rc)
        r->max_tokens = (uint32_t)x;
    if (r->kind == OAI_CHAT) {
        if ((rc = get_int(root, "max_completion_tokens", 1, lim->max_output_tokens, &x, err)) <
            0)
            return DI_EINVAL;
        if (rc)
            r->max_tokens = (uint32_t)x;
    }
    if (get_bool(root, "ignore_eos", &r->ignore_eos, err) < 0)
        return DI_EINVAL;
    if (get_bool(root, "return_tokens_as_token_ids", &r->tokens_as_ids, err) < 0)
        return DI_EINVAL;
    return parse_stop(root, r, err);
}

static di_status parse_logprobs(json_t *root, oai_request *r, oai_error *err)
{
    int64_t x;
    int rc;
    if (r->kind == OAI_COMPLETION) {
        /* Completions: logprobs is the number of alternatives (0 = the chosen token only). */
        if ((rc = get_int(root, "logprobs", 0, OAI_MAX_TOP_LOGPROBS, &x, err)) < 0)
            return DI_EINVAL;
        r->logprobs = rc == 1;
        r->top_logprobs = rc ? (uint32_t)x : 0;
        return DI_OK;
    }
    if (get_bool(root, "logprobs", &r->logprobs, err) < 0)
        return DI_EINVAL;
    if ((rc = get_int(root, "top_logprobs", 0, OAI_MAX_TOP_LOGPROBS, &x, err)) < 0)
        return DI_EINVAL;
    if (rc && !r->logprobs && x > 0)
        return oai_fail(err, 400, "invalid_value", "top_logprobs",
                        "'top_logprobs' needs 'logprobs': true");
    r->top_logprobs = rc ? (uint32_t)x : 0;
    return DI_OK;
}

static di_status parse_stream(json_t *root, oai_request *r, oai_error *err)
{
    if (get_bool(root, "stream", &r->stream, err) < 0)
        return DI_EINVAL;
    json_t *so = json_object_get(root, "stream_options");
    if (!so || json_is_null(so))
        return DI_OK;
    if (!json_is_object(so))
        return oai_fail(err, 400, "invalid_type", "stream_options",
                        "'stream_options' must be an object");
    if (!r->stream)
        return oai_fail(err, 400, "invalid_value", "stream_options",
                        "'stream_options' is allowed only with 'stream': true");
    if (get_bool(so, "include_usage", &r->include_usage, err) < 0)
        return oai_fail(err, 400, "invalid_type", "stream_options.include_usage",
                        "'stream_options.include_usage' must be a boolean");
    return DI_OK;
}

static di_status parse_model(json_t *root, const oai_limits *lim, oai_request *r,
                             oai_error *err)
{
    json_t *v = json_object_get(root, "model");
    if (!v || json_is_null(v))
        return DI_OK;
    if (!json_is_string(v))
        return oai_fail(err, 400, "invalid_type", "model", "'model' must be a string");
    if (lim->model && strcmp(json_string_value(v), lim->model) != 0)
        return oai_fail(err, 404, "model_not_found", "model",
                        "the model '%.100s' does not exist; this server serves '%.100s'",
                        json_string_value(v), lim->model);
    if (!(r->model = dup_str(json_string_value(v), json_string_length(v))))
        return oai_fail(err, 503, NULL, NULL, "out of memory");
    return DI_OK;
}

di_status oai_parse(oai_kind kind, const char *body, size_t len, const oai_limits *limits,
                    oai_request *out, oai_error *err)
{
    memset(out, 0, sizeof *out);
    if (len > limits->max_body_bytes)
        return oai_fail(err, 413, "request_too_large", NULL,
                        "the body has %zu bytes; at most %zu are allowed", len,
                        limits->max_body_bytes);
    size_t bad = 0;
    if (!oai_utf8_valid(body, len, &bad))
        return oai_fail(err, 400, "invalid_encoding", NULL,
                        "the body is not valid UTF-8 (byte %zu)", bad);
    if (json_depth_exceeds(body, len, limits->max_depth))
        return oai_fail(err, 400, "invalid_json", NULL,
                        "the body nests deeper than %d levels", limits->max_depth);
    json_error_t je;
    json_t *root = json_loadb(body, len, JSON_REJECT_DUPLICATES, &je);
    if (!root)
        return oai_fail(err, 400, "invalid_json", NULL, "the body is not valid JSON: %s",
                        je.text);
    oai_request r = {.kind = kind};
    di_status st = DI_EINVAL;
    if (!json_is_object(root)) {
        oai_fail(err, 400, "invalid_json", NULL, "the body must be a JSON object");
        goto done;
    }
    if ((st = parse_model(root, limits, &r, err)) != DI_OK ||
        (st = refuse_unsupported(root, err)) != DI_OK ||
        (st = parse_sampling(root, limits, &r, err)) != DI_OK ||
        (st = parse_logprobs(root, &r, err)) != DI_OK ||
        (st = parse_stream(root, &r, err)) != DI_OK)
        goto done;
    st = kind == OAI_CHAT ? parse_messages(root, &r, err) : parse_prompt(root, limits, &r, err);
done:
    json_decref(root);
    if (st != DI_OK) {
        oai_request_free(&r);
        return st;
    }
    *out = r;
    return DI_OK;
}

di_status oai_tokenize(oai_request *req, const tok_tokenizer *tok, bool add_bos,
                       const oai_limits *limits, oai_error *err)
{
    if (!req->prompt_is_ids) {
        tok_ids ids = {0};
        di_error de = {0};
        int32_t bos = tok_bos_id(tok);
        di_status st = DI_OK;
        if (req->kind == OAI_COMPLETION && add_bos && bos >= 0)
            st = tok_ids_push(&ids, bos, &de);
        if (st == DI_OK)
            st = tok_encode(tok, req->prompt_text, strlen(req->prompt_text), &ids, &de);
        if (st != DI_OK) {
            tok_ids_free(&ids);
            return oai_fail(err, st == DI_ENOMEM ? 503 : 400, "invalid_value",
                            req->kind == OAI_CHAT ? "messages" : "prompt", "%s", de.msg);
        }
        tok_ids_free(&req->prompt_ids);
        req->prompt_ids = ids;
    }
    if (req->prompt_ids.n == 0)
        return oai_fail(err, 400, "invalid_value", "prompt", "the prompt has no tokens");
    if (req->prompt_ids.n > limits->max_prompt_tokens)
        return oai_fail(err, 400, "context_length_exceeded",
                        req->kind == OAI_CHAT ? "messages" : "prompt",
                        "the prompt has %zu tokens; at most %u are allowed",
                        req->prompt_ids.n, limits->max_prompt_tokens);
    return DI_OK;
}

void oai_request_free(oai_request *req)
{
    if (!req)
        return;
    free(req->model);
    free(req->prompt_text);
    tok_ids_free(&req->prompt_ids);
    for (size_t i = 0; i < req->n_stop; i++)
        free(req->stop[i]);
    memset(req, 0, sizeof *req);
}

/* ---- builders ---------------------------------------------------------------------------- */

/* A finite logprob for JSON (which has no -inf): OpenAI reports -9999 for impossible tokens. */
static json_t *lp_real(float lp)
{
    return json_real(isfinite(lp) ? (double)lp : -9999.0);
}

static json_t *bytes_array(const char *text)
{
    json_t *a = json_array();
    for (const unsigned char *p = (const unsigned char *)text; a && *p; p++)
        json_array_append_new(a, json_integer(*p));
    return a;
}

/* How a token is named in logprobs: its text, or "token_id:ID" with return_tokens_as_token_ids
 * (vLLM's extension). buf holds the latter. */
static const char *tok_name(bool as_ids, int32_t id, const char *text, char buf[24])
{
    if (!as_ids)
        return text;
    snprintf(buf, 24, "token_id:%d", (int)id);
    return buf;
}

/* Chat's logprobs: {"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}]}. */
static json_t *chat_logprobs(const oai_token *toks, size_t n, bool as_ids)
{
    json_t *content = json_array();
    char nb[24];
    for (size_t i = 0; content && i < n; i++) {
        json_t *tops = json_array();
        for (size_t k = 0; tops && k < toks[i].n_top; k++)
            json_array_append_new(tops, json_pack("{s:s,s:o,s:o}", "token",
                                                  tok_name(as_ids, toks[i].top[k].id,
                                                           toks[i].top[k].text, nb),
                                                  "logprob", lp_real(toks[i].top[k].logprob),
                                                  "bytes", bytes_array(toks[i].top[k].text)));
        json_array_append_new(content,
                              json_pack("{s:s,s:o,s:o,s:o}", "token",
                                        tok_name(as_ids, toks[i].id, toks[i].text, nb),
                                        "logprob", lp_real(toks[i].logprob), "bytes",
                                        bytes_array(toks[i].text), "top_logprobs", tops));
    }
    return json_pack("{s:o}", "content", content);
}

/* Completions' legacy logprobs: tokens, token_logprobs, top_logprobs (maps), text_offset. */
static json_t *completion_logprobs(const oai_token *toks, size_t n, size_t offset0, bool as_ids)
{
    json_t *tokens = json_array(), *lps = json_array(), *tops = json_array(),
           *offs = json_array();
    size_t off = offset0;
    char nb[24];
    for (size_t i = 0; i < n; i++) {
        json_array_append_new(tokens, json_string(tok_name(as_ids, toks[i].id, toks[i].text, nb)));
        json_array_append_new(lps, lp_real(toks[i].logprob));
        json_t *m = json_object();
        for (size_t k = 0; k < toks[i].n_top; k++)
            json_object_set_new(m, tok_name(as_ids, toks[i].top[k].id, toks[i].top[k].text, nb),
                                lp_real(toks[i].top[k].logprob));
        json_array_append_new(tops, m);
        json_array_append_new(offs, json_integer((json_int_t)off));
        off += strlen(toks[i].text);
    }
    return json_pack("{s:o,s:o,s:o,s:o}", "tokens", tokens, "token_logprobs", lps,
                     "top_logprobs", tops, "text_offset", offs);
}

static json_t *usage_obj(const oai_usage *u)
{
    return json_pack("{s:I,s:I,s:I,s:{s:I}}", "prompt_tokens", (json_int_t)u->prompt_tokens,
                     "completion_tokens", (json_int_t)u->completion_tokens, "total_tokens",
                     (json_int_t)u->prompt_tokens + u->completion_tokens,
                     "prompt_tokens_details", "cached_tokens", (json_int_t)u->cached_tokens);
}

static json_t *envelope(const oai_request *req, const char *id, int64_t created,
                        const char *object)
{
    return json_pack("{s:s,s:s,s:I,s:s}", "id", id, "object", object, "created",
                     (json_int_t)created, "model", req->model ? req->model : "");
}

static char *dump_and_free(json_t *o, bool sse)
{
    if (!o)
        return NULL;
    char *s = json_dumps(o, OAI_JSON_FLAGS);
    json_decref(o);
    if (!s || !sse)
        return s;
    size_t n = strlen(s);
    char *e = malloc(n + 9);
    if (e) {
        memcpy(e, "data: ", 6);
        memcpy(e + 6, s, n);
        memcpy(e + 6 + n, "\n\n", 3);
    }
    free(s);
    return e;
}

static json_t *finish_value(const char *finish)
{
    return finish ? json_string(finish) : json_null();
}

char *oai_response_json(const oai_request *req, const char *id, int64_t created,
                        const char *text, const oai_token *toks, size_t n_toks,
                        const char *finish, const oai_usage *usage)
{
    bool chat = req->kind == OAI_CHAT;
    json_t *o = envelope(req, id, created, chat ? "chat.completion" : "text_completion");
    json_t *lp = !req->logprobs ? json_null()
                 : chat         ? chat_logprobs(toks, n_toks, req->tokens_as_ids)
                                : completion_logprobs(toks, n_toks, 0, req->tokens_as_ids);
    json_t *choice = chat ? json_pack("{s:i,s:{s:s,s:s},s:o,s:o}", "index", 0, "message", "role",
                                      "assistant", "content", text, "logprobs", lp,
                                      "finish_reason", finish_value(finish))
                          : json_pack("{s:i,s:s,s:o,s:o}", "index", 0, "text", text,
                                      "logprobs", lp, "finish_reason", finish_value(finish));
    if (o) {
        json_object_set_new(o, "choices", json_pack("[o]", choice));
        json_object_set_new(o, "usage", usage_obj(usage));
    } else {
        json_decref(choice);
    }
    return dump_and_free(o, false);
}

char *oai_chunk_sse(const oai_request *req, const char *id, int64_t created, bool first,
                    const char *delta, const oai_token *toks, size_t n_toks,
                    const char *finish)
{
    bool chat = req->kind == OAI_CHAT;
    json_t *o = envelope(req, id, created, chat ? "chat.completion.chunk" : "text_completion");
    json_t *lp = !req->logprobs ? json_null()
                 : chat         ? chat_logprobs(toks, n_toks, req->tokens_as_ids)
                                : completion_logprobs(toks, n_toks, 0, req->tokens_as_ids);
    json_t *choice;
    if (chat) {
        json_t *d = first ? json_pack("{s:s,s:s}", "role", "assistant", "content", delta)
                          : json_pack("{s:s}", "content", delta);
        choice = json_pack("{s:i,s:o,s:o,s:o}", "index", 0, "delta", d, "logprobs", lp,
                           "finish_reason", finish_value(finish));
    } else {
        choice = json_pack("{s:i,s:s,s:o,s:o}", "index", 0, "text", delta, "logprobs", lp,
                           "finish_reason", finish_value(finish));
    }
    if (o) {
        json_object_set_new(o, "choices", json_pack("[o]", choice));
        if (req->include_usage)
            json_object_set_new(o, "usage", json_null());
    } else {
        json_decref(choice);
    }
    return dump_and_free(o, true);
}

char *oai_usage_sse(const oai_request *req, const char *id, int64_t created,
                    const oai_usage *usage)
{
    json_t *o = envelope(req, id, created,
                         req->kind == OAI_CHAT ? "chat.completion.chunk" : "text_completion");
    if (o) {
        json_object_set_new(o, "choices", json_array());
        json_object_set_new(o, "usage", usage_obj(usage));
    }
    return dump_and_free(o, true);
}

char *oai_continued_sse(const oai_request *req, const char *id, int64_t created,
                        const char *from, const char *to, uint32_t after_tokens)
{
    json_t *o = envelope(req, id, created,
                         req->kind == OAI_CHAT ? "chat.completion.chunk" : "text_completion");
    if (o) {
        json_object_set_new(o, "choices", json_array());
        json_object_set_new(o, "continued",
                            json_pack("{s:s,s:s,s:I}", "from", from ? from : "", "to",
                                      to ? to : "", "after_tokens", (json_int_t)after_tokens));
    }
    return dump_and_free(o, true);
}

static json_t *error_obj(const oai_error *err)
{
    return json_pack("{s:{s:s,s:s,s:o,s:o}}", "error", "message", err->message, "type",
                     err->type ? err->type : oai_error_type(err->status), "param",
                     err->param[0] ? json_string(err->param) : json_null(), "code",
                     err->code ? json_string(err->code) : json_null());
}

char *oai_error_json(const oai_error *err)
{
    return dump_and_free(error_obj(err), false);
}

char *oai_error_sse(const oai_error *err)
{
    return dump_and_free(error_obj(err), true);
}

rt_gen_req oai_gen_req(const oai_request *r)
{
    return (rt_gen_req){.prompt = r->prompt_ids.v,
                        .n_prompt = r->prompt_ids.n,
                        .max_tokens = r->max_tokens,
                        .temperature = r->temperature,
                        .top_p = r->top_p,
                        .top_k = r->top_k,
                        .seed = r->seed,
                        .top_logprobs = r->logprobs ? r->top_logprobs : 0,
                        .ignore_eos = r->ignore_eos};
}
