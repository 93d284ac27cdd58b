/* The OpenAI layer: every bad input class gets its 4xx, type and param; good inputs parse to
 * the values given; builders write OpenAI's shapes with round-trip float logprobs. */
#include <criterion/criterion.h>
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "router/openai.h"

static const oai_limits LIM = {
    .max_body_bytes = 4096,
    .max_depth = 8,
    .max_prompt_tokens = 16,
    .max_output_tokens = 1024,
    .vocab_size = 1000,
    .model = "dsv4",
};

typedef struct bad_case {
    oai_kind kind;
    const char *body; /* NULL: built by the test (see below) */
    int status;
    const char *param; /* "" for JSON null */
} bad_case;

static const bad_case BAD[] = {
    /* not JSON, not an object */
    {OAI_COMPLETION, "", 400, ""},
    {OAI_COMPLETION, "{\"prompt\": ", 400, ""},
    {OAI_COMPLETION, "[1,2]", 400, ""},
    {OAI_COMPLETION, "\"hi\"", 400, ""},
    {OAI_COMPLETION, "{\"prompt\":\"a\",\"prompt\":\"b\"}", 400, ""},
    /* invalid UTF-8: a lone continuation, an overlong, a surrogate, a truncated sequence */
    {OAI_COMPLETION, "{\"prompt\":\"\x80\"}", 400, ""},
    {OAI_COMPLETION, "{\"prompt\":\"\xC0\xAF\"}", 400, ""},
    {OAI_COMPLETION, "{\"prompt\":\"\xED\xA0\x80\"}", 400, ""},
    {OAI_COMPLETION, "{\"prompt\":\"\xE2\x82\"}", 400, ""},
    /* too deep */
    {OAI_COMPLETION, "{\"prompt\":\"a\",\"x\":[[[[[[[[[1]]]]]]]]]}", 400, ""},
    /* prompt */
    {OAI_COMPLETION, "{}", 400, "prompt"},
    {OAI_COMPLETION, "{\"prompt\":\"\"}", 400, "prompt"},
    {OAI_COMPLETION, "{\"prompt\":5}", 400, "prompt"},
    {OAI_COMPLETION, "{\"prompt\":[]}", 400, "prompt"},
    {OAI_COMPLETION, "{\"prompt\":[\"a\",\"b\"]}", 400, "prompt"},
    {OAI_COMPLETION, "{\"prompt\":[1,2.5]}", 400, "prompt"},
    {OAI_COMPLETION, "{\"prompt\":[1,-1]}", 400, "prompt"},
    {OAI_COMPLETION, "{\"prompt\":[1,1000]}", 400, "prompt"},
    {OAI_COMPLETION, "{\"prompt\":[1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16,17]}", 400, "prompt"},
    /* wrong types */
    {OAI_COMPLETION, "{\"prompt\":\"a\",\"max_tokens\":\"5\"}", 400, "max_tokens"},
    {OAI_COMPLETION, "{\"prompt\":\"a\",\"temperature\":\"hot\"}", 400, "temperature"},
    {OAI_COMPLETION, "{\"prompt\":\"a\",\"stream\":1}", 400, "stream"},
    {OAI_COMPLETION, "{\"prompt\":\"a\",\"seed\":1.5}", 400, "seed"},
    {OAI_COMPLETION, "{\"prompt\":\"a\",\"stop\":3}", 400, "stop"},
    {OAI_COMPLETION, "{\"prompt\":\"a\",\"stop\":[\"x\",3]}", 400, "stop"},
    {OAI_COMPLETION, "{\"prompt\":\"a\",\"ignore_eos\":\"yes\"}", 400, "ignore_eos"},
    {OAI_COMPLETION, "{\"prompt\":\"a\",\"model\":7}", 400, "model"},
    /* out of range */
    {OAI_COMPLETION, "{\"prompt\":\"a\",\"max_tokens\":0}", 400, "max_tokens"},
    {OAI_COMPLETION, "{\"prompt\":\"a\",\"max_tokens\":1025}", 400, "max_tokens"},
    {OAI_COMPLETION, "{\"prompt\":\"a\",\"temperature\":-0.1}", 400, "temperature"},
    {OAI_COMPLETION, "{\"prompt\":\"a\",\"temperature\":2.5}", 400, "temperature"},
    {OAI_COMPLETION, "{\"prompt\":\"a\",\"top_p\":0}", 400, "top_p"},
    {OAI_COMPLETION, "{\"prompt\":\"a\",\"top_p\":1.01}", 400, "top_p"},
    {OAI_COMPLETION, "{\"prompt\":\"a\",\"top_k\":-2}", 400, "top_k"},
    {OAI_COMPLETION, "{\"prompt\":\"a\",\"top_k\":1001}", 400, "top_k"},
    {OAI_COMPLETION, "{\"prompt\":\"a\",\"seed\":-1}", 400, "seed"},
    {OAI_COMPLETION, "{\"prompt\":\"a\",\"logprobs\":21}", 400, "logprobs"},
    {OAI_COMPLETION, "{\"prompt\":\"a\",\"stop\":[\"a\",\"b\",\"c\",\"d\",\"e\"]}", 400, "stop"},
    {OAI_COMPLETION, "{\"prompt\":\"a\",\"stop\":\"\"}", 400, "stop"},
    /* unsupported */
    {OAI_COMPLETION, "{\"prompt\":\"a\",\"n\":2}", 400, "n"},
    {OAI_COMPLETION, "{\"prompt\":\"a\",\"n\":\"1\"}", 400, "n"},
    {OAI_COMPLETION, "{\"prompt\":\"a\",\"best_of\":3}", 400, "best_of"},
    {OAI_COMPLETION, "{\"prompt\":\"a\",\"echo\":true}", 400, "echo"},
    {OAI_COMPLETION, "{\"prompt\":\"a\",\"presence_penalty\":0.5}", 400, "presence_penalty"},
    {OAI_COMPLETION, "{\"prompt\":\"a\",\"logit_bias\":{\"1\":5}}", 400, "logit_bias"},
    /* stream options without streaming, of the wrong type */
    {OAI_COMPLETION, "{\"prompt\":\"a\",\"stream_options\":{\"include_usage\":true}}", 400,
     "stream_options"},
    {OAI_COMPLETION, "{\"prompt\":\"a\",\"stream\":true,\"stream_options\":[]}", 400,
     "stream_options"},
    {OAI_COMPLETION,
     "{\"prompt\":\"a\",\"stream\":true,\"stream_options\":{\"include_usage\":1}}", 400,
     "stream_options.include_usage"},
    /* another model */
    {OAI_COMPLETION, "{\"prompt\":\"a\",\"model\":\"gpt-4\"}", 404, "model"},
    /* chat */
    {OAI_CHAT, "{}", 400, "messages"},
    {OAI_CHAT, "{\"messages\":{}}", 400, "messages"},
    {OAI_CHAT, "{\"messages\":[]}", 400, "messages"},
    {OAI_CHAT, "{\"messages\":[3]}", 400, "messages"},
    {OAI_CHAT, "{\"messages\":[{\"content\":\"hi\"}]}", 400, "messages"},
    {OAI_CHAT, "{\"messages\":[{\"role\":\"wizard\",\"content\":\"hi\"}]}", 400, "messages"},
    {OAI_CHAT, "{\"messages\":[{\"role\":\"user\",\"content\":5}]}", 400, "messages"},
    {OAI_CHAT, "{\"messages\":[{\"role\":\"user\",\"content\":\"a\"}],\"logprobs\":3}", 400,
     "logprobs"},
    {OAI_CHAT, "{\"messages\":[{\"role\":\"user\",\"content\":\"a\"}],\"top_logprobs\":3}", 400,
     "top_logprobs"},
    {OAI_CHAT,
     "{\"messages\":[{\"role\":\"user\",\"content\":\"a\"}],\"logprobs\":true,"
     "\"top_logprobs\":21}",
     400, "top_logprobs"},
    {OAI_CHAT,
     "{\"messages\":[{\"role\":\"user\",\"content\":\"a\"}],\"max_completion_tokens\":0}", 400,
     "max_completion_tokens"},
    {OAI_CHAT, "{\"messages\":[{\"role\":\"user\",\"content\":\"a\"}],\"tools\":[]}", 400,
     "tools"},
};

static void expect_bad(const bad_case *c, size_t len, size_t idx)
{
    oai_request r;
    oai_error e = {0};
    di_status st = oai_parse(c->kind, c->body, len, &LIM, &r, &e);
    cr_assert(st != DI_OK, "case %zu (%s) was accepted", idx, c->body);
    cr_expect_eq(e.status, c->status, "case %zu (%s): status %d, want %d (%s)", idx, c->body,
                 e.status, c->status, e.message);
    cr_expect_str_eq(e.param, c->param, "case %zu (%s): param '%s', want '%s' (%s)", idx,
                     c->body, e.param, c->param, e.message);
    cr_expect_str_eq(e.type, "invalid_request_error", "case %zu", idx);
    cr_expect(e.message[0] != '\0', "case %zu has no message", idx);
    cr_expect(!strchr(e.message, '\n'), "case %zu: message has a newline", idx);
    cr_expect(r.prompt_text == NULL && r.n_stop == 0 && r.prompt_ids.v == NULL,
              "case %zu: output written on failure", idx);

    /* The error JSON is OpenAI's shape. */
    char *js = oai_error_json(&e);
    cr_assert_not_null(js);
    json_t *o = json_loads(js, 0, NULL);
    cr_assert_not_null(o, "error JSON does not parse: %s", js);
    json_t *eo = json_object_get(o, "error");
    cr_expect(json_is_string(json_object_get(eo, "message")));
    cr_expect(json_is_string(json_object_get(eo, "type")));
    cr_expect(json_object_get(eo, "param") && json_object_get(eo, "code"));
    if (c->param[0])
        cr_expect_str_eq(json_string_value(json_object_get(eo, "param")), c->param);
    else
        cr_expect(json_is_null(json_object_get(eo, "param")));
    json_decref(o);
    free(js);
}

Test(openai, every_bad_input_class_gets_its_4xx)
{
    for (size_t i = 0; i < sizeof BAD / sizeof BAD[0]; i++)
        expect_bad(&BAD[i], strlen(BAD[i].body), i);
}

Test(openai, oversized_body_is_413)
{
    size_t n = LIM.max_body_bytes + 1;
    char *b = malloc(n + 1);
    memset(b, ' ', n);
    memcpy(b, "{\"prompt\":\"a\"}", 14);
    b[n] = '\0';
    oai_request r;
    oai_error e = {0};
    cr_assert_eq(oai_parse(OAI_COMPLETION, b, n, &LIM, &r, &e), DI_ERANGE);
    cr_expect_eq(e.status, 413);
    /* One byte less is accepted: the limit is inclusive. */
    cr_assert_eq(oai_parse(OAI_COMPLETION, b, n - 1, &LIM, &r, &e), DI_OK, "%s", e.message);
    oai_request_free(&r);
    free(b);
}

Test(openai, nul_inside_the_body_is_400)
{
    const char raw[] = {'{', '"', 'p', '"', ':', '"', 'a', '\0', '"', '}'};
    oai_request r;
    oai_error e = {0};
    cr_expect_neq(oai_parse(OAI_COMPLETION, raw, sizeof raw, &LIM, &r, &e), DI_OK);
    cr_expect_eq(e.status, 400);
    const char esc[] = "{\"prompt\":\"a\\u0000\"}";
    cr_expect_neq(oai_parse(OAI_COMPLETION, esc, strlen(esc), &LIM, &r, &e), DI_OK);
    cr_expect_eq(e.status, 400);
}

Test(openai, completion_parameters_round_trip)
{
    const char *b = "{\"model\":\"dsv4\",\"prompt\":[5,0,999],\"max_tokens\":7,"
                    "\"temperature\":0.25,\"top_p\":0.5,\"top_k\":40,\"seed\":123456789012,"
                    "\"stop\":[\"\\n\\n\",\"END\"],\"logprobs\":3,\"ignore_eos\":true,"
                    "\"stream\":true,\"stream_options\":{\"include_usage\":true},\"n\":1,"
                    "\"user\":\"ignored\"}";
    oai_request r;
    oai_error e = {0};
    cr_assert_eq(oai_parse(OAI_COMPLETION, b, strlen(b), &LIM, &r, &e), DI_OK, "%s",
                 e.message);
    cr_expect_str_eq(r.model, "dsv4");
    cr_expect(r.prompt_is_ids && r.prompt_text == NULL);
    cr_assert_eq(r.prompt_ids.n, 3);
    cr_expect(r.prompt_ids.v[0] == 5 && r.prompt_ids.v[1] == 0 && r.prompt_ids.v[2] == 999);
    cr_expect_eq(r.max_tokens, 7);
    cr_expect_float_eq(r.temperature, 0.25f, 0);
    cr_expect_float_eq(r.top_p, 0.5f, 0);
    cr_expect_eq(r.top_k, 40);
    cr_expect(r.has_seed && r.seed == 123456789012ull);
    cr_assert_eq(r.n_stop, 2);
    cr_expect_str_eq(r.stop[0], "\n\n");
    cr_expect_str_eq(r.stop[1], "END");
    cr_expect(r.logprobs && r.top_logprobs == 3);
    cr_expect(r.ignore_eos && r.stream && r.include_usage);
    oai_request_free(&r);
    oai_request_free(&r); /* a freed request frees again as a no-op */
}

Test(openai, defaults)
{
    const char *b = "{\"prompt\":\"hello\",\"stop\":\"x\",\"top_k\":0,\"max_tokens\":null}";
    oai_request r;
    oai_error e = {0};
    cr_assert_eq(oai_parse(OAI_COMPLETION, b, strlen(b), &LIM, &r, &e), DI_OK, "%s",
                 e.message);
    cr_expect_str_eq(r.prompt_text, "hello");
    cr_expect_null(r.model);
    cr_expect_eq(r.max_tokens, LIM.max_output_tokens);
    cr_expect_float_eq(r.temperature, 1.0f, 0);
    cr_expect_float_eq(r.top_p, 1.0f, 0);
    cr_expect_eq(r.top_k, -1);
    cr_expect(!r.has_seed && !r.logprobs && !r.stream && !r.ignore_eos);
    cr_assert_eq(r.n_stop, 1);
    cr_expect_str_eq(r.stop[0], "x");
    oai_request_free(&r);
}

Test(openai, chat_renders_deepseek_format_and_takes_new_max_name)
{
    const char *b = "{\"messages\":[{\"role\":\"system\",\"content\":\"Be brief.\"},"
                    "{\"role\":\"user\",\"content\":\"Hi\"}],\"max_tokens\":9,"
                    "\"max_completion_tokens\":5,\"logprobs\":true,\"top_logprobs\":2}";
    oai_request r;
    oai_error e = {0};
    cr_assert_eq(oai_parse(OAI_CHAT, b, strlen(b), &LIM, &r, &e), DI_OK, "%s", e.message);
    cr_expect_eq(r.max_tokens, 5);
    cr_expect(r.logprobs && r.top_logprobs == 2);
    cr_assert_not_null(r.prompt_text);
    cr_expect(strstr(r.prompt_text, "Be brief.<｜User｜>Hi<｜Assistant｜>") != NULL, "%s",
              r.prompt_text);
    oai_request_free(&r);
}

Test(openai, utf8_checker)
{
    size_t off = 99;
    cr_expect(oai_utf8_valid("a\xC3\xA9\xE2\x82\xAC\xF0\x9F\x98\x80", 10, &off));
    cr_expect(!oai_utf8_valid("ab\xF4\x90\x80\x80", 6, &off)); /* past U+10FFFF */
    cr_expect_eq(off, 2);
    cr_expect(!oai_utf8_valid("abc\xE0\x80\x80", 6, &off)); /* overlong */
    cr_expect_eq(off, 3);
    cr_expect(!oai_utf8_valid("\xFF", 1, &off));
    cr_expect_eq(off, 0);
}

/* Reads the float of a JSON number the way a client does (strtod, then to float). */
static float json_float(json_t *v)
{
    return (float)json_real_value(v);
}

Test(openai, responses_carry_logprobs_at_full_precision)
{
    const char *b = "{\"prompt\":[1,2],\"logprobs\":1}";
    oai_request r;
    oai_error e = {0};
    cr_assert_eq(oai_parse(OAI_COMPLETION, b, strlen(b), &LIM, &r, &e), DI_OK);
    /* Floats that need all 9 digits to read back. */
    const float lp0 = -0.123456791f, lp1 = -1.00000012f, alt = -7.77777767f;
    oai_top top0[1] = {{11, "x", alt}};
    oai_token toks[2] = {{10, "He", lp0, top0, 1}, {12, "llo", lp1, NULL, 0}};
    oai_usage u = {2, 2, 1};
    char *js = oai_response_json(&r, "cmpl-1", 1700000000, "Hello", toks, 2, "length", &u);
    cr_assert_not_null(js);
    json_t *o = json_loads(js, 0, NULL);
    cr_assert_not_null(o, "%s", js);
    cr_expect_str_eq(json_string_value(json_object_get(o, "object")), "text_completion");
    json_t *c0 = json_array_get(json_object_get(o, "choices"), 0);
    cr_expect_str_eq(json_string_value(json_object_get(c0, "text")), "Hello");
    cr_expect_str_eq(json_string_value(json_object_get(c0, "finish_reason")), "length");
    json_t *lp = json_object_get(c0, "logprobs");
    json_t *tlp = json_object_get(lp, "token_logprobs");
    cr_expect(json_float(json_array_get(tlp, 0)) == lp0, "%s", js);
    cr_expect(json_float(json_array_get(tlp, 1)) == lp1, "%s", js);
    json_t *tops = json_array_get(json_object_get(lp, "top_logprobs"), 0);
    cr_expect(json_float(json_object_get(tops, "x")) == alt, "%s", js);
    cr_expect_eq(json_integer_value(json_array_get(json_object_get(lp, "text_offset"), 1)), 2);
    json_t *us = json_object_get(o, "usage");
    cr_expect_eq(json_integer_value(json_object_get(us, "prompt_tokens")), 2);
    cr_expect_eq(json_integer_value(json_object_get(us, "total_tokens")), 4);
    cr_expect_eq(json_integer_value(
                     json_object_get(json_object_get(us, "prompt_tokens_details"), "cached_tokens")),
                 1);
    json_decref(o);
    free(js);
    oai_request_free(&r);
}

Test(openai, tokens_as_ids_name_tokens_and_alternatives_by_id)
{
    const char *b = "{\"prompt\":[1,2],\"logprobs\":1,\"return_tokens_as_token_ids\":true}";
    oai_request r;
    oai_error e = {0};
    cr_assert_eq(oai_parse(OAI_COMPLETION, b, strlen(b), &LIM, &r, &e), DI_OK, "%s", e.message);
    cr_assert(r.tokens_as_ids);
    oai_top top0[1] = {{11, "x", -2.5f}};
    oai_token toks[2] = {{10, "He", -0.25f, top0, 1}, {12, "llo", -1.0f, NULL, 0}};
    oai_usage u = {2, 2, 0};
    char *js = oai_response_json(&r, "cmpl-1", 1, "Hello", toks, 2, "length", &u);
    json_t *o = json_loads(js, 0, NULL);
    cr_assert_not_null(o, "%s", js);
    json_t *lp = json_object_get(json_array_get(json_object_get(o, "choices"), 0), "logprobs");
    cr_expect_str_eq(json_string_value(json_array_get(json_object_get(lp, "tokens"), 0)),
                     "token_id:10");
    cr_expect_str_eq(json_string_value(json_array_get(json_object_get(lp, "tokens"), 1)),
                     "token_id:12");
    json_t *tops = json_array_get(json_object_get(lp, "top_logprobs"), 0);
    cr_expect(json_float(json_object_get(tops, "token_id:11")) == -2.5f, "%s", js);
    /* the text offsets still count the text */
    cr_expect_eq(json_integer_value(json_array_get(json_object_get(lp, "text_offset"), 1)), 2);
    json_decref(o);
    free(js);
    oai_request_free(&r);
    const char *bad = "{\"prompt\":[1],\"return_tokens_as_token_ids\":1}";
    cr_expect_eq(oai_parse(OAI_COMPLETION, bad, strlen(bad), &LIM, &r, &e), DI_EINVAL);
    cr_expect_str_eq(e.param, "return_tokens_as_token_ids");
}

Test(openai, the_continued_event_names_both_ranks)
{
    const char *b = "{\"prompt\":[1,2],\"stream\":true}";
    oai_request r;
    oai_error e = {0};
    cr_assert_eq(oai_parse(OAI_COMPLETION, b, strlen(b), &LIM, &r, &e), DI_OK, "%s", e.message);
    char *c = oai_continued_sse(&r, "cmpl-1", 5, "127.0.0.1:1", "127.0.0.1:2", 9);
    cr_assert_not_null(c);
    cr_assert(strncmp(c, "data: ", 6) == 0 && strcmp(c + strlen(c) - 2, "\n\n") == 0, "%s", c);
    json_t *o = json_loads(c + 6, JSON_DISABLE_EOF_CHECK, NULL);
    cr_assert_not_null(o, "%s", c);
    cr_expect_str_eq(json_string_value(json_object_get(o, "object")), "text_completion");
    cr_expect_eq(json_array_size(json_object_get(o, "choices")), 0);
    json_t *k = json_object_get(o, "continued");
    cr_expect_str_eq(json_string_value(json_object_get(k, "from")), "127.0.0.1:1");
    cr_expect_str_eq(json_string_value(json_object_get(k, "to")), "127.0.0.1:2");
    cr_expect_eq(json_integer_value(json_object_get(k, "after_tokens")), 9);
    json_decref(o);
    free(c);
    oai_request_free(&r);
}

Test(openai, chat_chunks_and_usage_event)
{
    const char *b = "{\"messages\":[{\"role\":\"user\",\"content\":\"a\"}],\"stream\":true,"
                    "\"stream_options\":{\"include_usage\":true},\"logprobs\":true}";
    oai_request r;
    oai_error e = {0};
    cr_assert_eq(oai_parse(OAI_CHAT, b, strlen(b), &LIM, &r, &e), DI_OK, "%s", e.message);
    oai_token t = {7, "Hi", -0.5f, NULL, 0};
    char *c1 = oai_chunk_sse(&r, "chatcmpl-1", 5, true, "Hi", &t, 1, NULL);
    cr_assert_not_null(c1);
    cr_assert(strncmp(c1, "data: ", 6) == 0 && strcmp(c1 + strlen(c1) - 2, "\n\n") == 0);
    json_t *o = json_loads(c1 + 6, JSON_DISABLE_EOF_CHECK, NULL);
    cr_assert_not_null(o, "%s", c1);
    cr_expect_str_eq(json_string_value(json_object_get(o, "object")), "chat.completion.chunk");
    json_t *ch = json_array_get(json_object_get(o, "choices"), 0);
    json_t *d = json_object_get(ch, "delta");
    cr_expect_str_eq(json_string_value(json_object_get(d, "role")), "assistant");
    cr_expect_str_eq(json_string_value(json_object_get(d, "content")), "Hi");
    cr_expect(json_is_null(json_object_get(ch, "finish_reason")));
    cr_expect(json_is_null(json_object_get(o, "usage")) && json_object_get(o, "usage"));
    json_t *lc = json_array_get(json_object_get(json_object_get(ch, "logprobs"), "content"), 0);
    cr_expect_str_eq(json_string_value(json_object_get(lc, "token")), "Hi");
    cr_expect_eq(json_array_size(json_object_get(lc, "bytes")), 2);
    json_decref(o);

    char *c2 = oai_chunk_sse(&r, "chatcmpl-1", 5, false, "", NULL, 0, "stop");
    o = json_loads(c2 + 6, JSON_DISABLE_EOF_CHECK, NULL);
    ch = json_array_get(json_object_get(o, "choices"), 0);
    cr_expect_null(json_object_get(json_object_get(ch, "delta"), "role"));
    cr_expect_str_eq(json_string_value(json_object_get(ch, "finish_reason")), "stop");
    json_decref(o);

    oai_usage u = {3, 1, 2};
    char *c3 = oai_usage_sse(&r, "chatcmpl-1", 5, &u);
    o = json_loads(c3 + 6, JSON_DISABLE_EOF_CHECK, NULL);
    cr_expect_eq(json_array_size(json_object_get(o, "choices")), 0);
    cr_expect_eq(json_integer_value(json_object_get(json_object_get(json_object_get(
                     o, "usage"), "prompt_tokens_details"), "cached_tokens")),
                 2);
    json_decref(o);
    free(c1);
    free(c2);
    free(c3);
    oai_request_free(&r);
}

Test(openai, error_text_is_one_line)
{
    oai_error e;
    cr_expect_eq(oai_fail(&e, 429, "rate_limit_exceeded", NULL, "too\r\nmany"), DI_EFULL);
    cr_expect_str_eq(e.message, "too  many");
    cr_expect_str_eq(e.type, "rate_limit_error");
    cr_expect_eq(oai_fail(&e, 401, NULL, NULL, "x"), DI_EAUTH);
    cr_expect_str_eq(oai_error_type(503), "server_error");
    char *sse = oai_error_sse(&e);
    cr_expect(strncmp(sse, "data: {\"error\":", 15) == 0, "%s", sse);
    free(sse);
}

Test(openai, tokenize_checks_prompt_length)
{
    const char *path = tok_default_path();
    if (!path)
        cr_skip_test("no tokenizer file");
    tok_tokenizer *tok = NULL;
    di_error de = {0};
    cr_assert_eq(tok_load_file(path, &tok, &de), DI_OK, "%s", de.msg);
    oai_limits lim = LIM;
    lim.vocab_size = tok_vocab_size(tok);
    const char *b = "{\"prompt\":\"Hello world\"}";
    oai_request r;
    oai_error e = {0};
    cr_assert_eq(oai_parse(OAI_COMPLETION, b, strlen(b), &lim, &r, &e), DI_OK);
    cr_assert_eq(oai_tokenize(&r, tok, true, &lim, &e), DI_OK, "%s", e.message);
    cr_expect_eq(r.prompt_ids.v[0], tok_bos_id(tok));
    cr_expect_geq(r.prompt_ids.n, 3);
    oai_request_free(&r);

    lim.max_prompt_tokens = 2;
    cr_assert_eq(oai_parse(OAI_COMPLETION, b, strlen(b), &lim, &r, &e), DI_OK);
    cr_expect_eq(oai_tokenize(&r, tok, true, &lim, &e), DI_EINVAL);
    cr_expect_eq(e.status, 400);
    cr_expect_str_eq(e.param, "prompt");
    cr_expect_str_eq(e.code, "context_length_exceeded");
    oai_request_free(&r);
    tok_free(tok);
}
