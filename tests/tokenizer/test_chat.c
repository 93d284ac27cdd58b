/* The DeepSeek chat format against the npm package's apply_chat_template (chat_vectors.json,
 * written by gen_vectors.js), and the messages it refuses. */
#include <criterion/criterion.h>
#include <stdlib.h>
#include <string.h>

#include "tests/tokenizer/tok_test_util.h"

Test(chat, renders_like_the_reference_template)
{
    json_t *root = tt_load_json("tests/tokenizer/chat_vectors.json");
    json_t *convs = json_object_get(root, "conversations");
    tok_tokenizer *t = tt_deepseek();
    cr_assert_geq(json_array_size(convs), 20);
    di_error e;
    for (size_t i = 0; i < json_array_size(convs); i++) {
        json_t *c = json_array_get(convs, i);
        json_t *msgs = json_object_get(c, "messages");
        bool gen = json_is_true(json_object_get(c, "add_generation_prompt"));
        const char *want = json_string_value(json_object_get(c, "text"));
        char *text = NULL;
        size_t len = 0;
        cr_assert_eq(tok_chat_render_json(msgs, gen, &text, &len, &e), DI_OK,
                     "conversation %zu: %s", i, e.msg);
        cr_assert_str_eq(text, want, "conversation %zu", i);
        cr_assert_eq(strlen(text), len);
        free(text);
        tok_ids got = {0}, ids = {0};
        tt_json_ids(json_object_get(c, "ids"), &ids);
        cr_assert_eq(tok_chat_encode_json(t, msgs, gen, &got, &e), DI_OK, "%s", e.msg);
        cr_assert_eq(got.n, ids.n, "conversation %zu: %zu ids, expected %zu", i, got.n, ids.n);
        cr_assert_eq(memcmp(got.v, ids.v, ids.n * sizeof *ids.v), 0, "conversation %zu", i);
        cr_assert_eq(got.v[0], tok_bos_id(t), "the prompt starts with BOS");
        tok_ids_free(&got);
        tok_ids_free(&ids);
    }
    tok_free(t);
    json_decref(root);
}

Test(chat, struct_messages_render)
{
    tok_tool_call call = {"function", "f", "{\"x\": 1}"};
    tok_chat_msg msgs[] = {
        {"system", "Be brief.", NULL, 0},
        {"user", "Call f.", NULL, 0},
        {"assistant", NULL, &call, 1},
        {"tool", "42", NULL, 0},
    };
    char *text = NULL;
    size_t len = 0;
    di_error e;
    cr_assert_eq(tok_chat_render(msgs, 4, true, &text, &len, &e), DI_OK, "%s", e.msg);
    cr_assert_str_eq(text, "<｜begin▁of▁sentence｜>Be brief.<｜User｜>Call f."
                           "<｜Assistant｜><｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function"
                           "<｜tool▁sep｜>f\n```json\n{\"x\": 1}\n```<｜tool▁call▁end｜>"
                           "<｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>42<｜tool▁output▁end｜>"
                           "<｜tool▁outputs▁end｜>");
    free(text);
    cr_assert_eq(tok_chat_render(NULL, 0, true, &text, &len, &e), DI_OK);
    cr_assert_str_eq(text, "<｜begin▁of▁sentence｜><｜Assistant｜>");
    free(text);
}

/* One refused conversation per row (JSON), with a part of the message. */
Test(chat, refusals_name_the_message)
{
    static const struct {
        const char *json;
        const char *msg;
    } ROWS[] = {
        {"{\"role\": \"user\"}", "messages: expected an array"},
        {"[{\"role\": \"narrator\", \"content\": \"x\"}]", "message 0: unknown role 'narrator'"},
        {"[{\"content\": \"x\"}]", "message 0: unknown role '(null)'"},
        {"[{\"role\": \"user\", \"content\": \"a\"}, {\"role\": \"user\"}]",
         "message 1: 'user' message without content"},
        {"[{\"role\": \"user\", \"content\": [\"parts\"]}]", "key 'content': expected a string"},
        {"[{\"role\": \"assistant\", \"content\": null}]", "'assistant' message without content"},
        {"[{\"role\": \"user\", \"content\": \"x\", \"tool_calls\": [{\"function\": {\"name\": "
         "\"f\", \"arguments\": \"{}\"}}]}]",
         "tool_calls on a 'user' message"},
        {"[{\"role\": \"assistant\", \"content\": \"x\", \"tool_calls\": [{\"function\": "
         "{\"name\": \"f\", \"arguments\": \"{}\"}}]}]",
         "both content and tool_calls"},
        {"[{\"role\": \"assistant\", \"content\": null, \"tool_calls\": [{\"type\": "
         "\"function\"}]}]",
         "needs a \"function\" object"},
        {"[{\"role\": \"assistant\", \"content\": null, \"tool_calls\": [{\"function\": "
         "{\"name\": \"f\"}}]}]",
         "needs type, name and arguments"},
        {"[{\"role\": \"assistant\", \"content\": null, \"tool_calls\": {}}]",
         "key 'tool_calls': expected an array"},
        {"[{\"role\": \"user\", \"content\": \"a\\u0000b\"}]", "NUL character"},
        {"[7]", "message 0: expected an object"},
    };
    tok_tokenizer *t = tt_deepseek();
    for (size_t r = 0; r < sizeof ROWS / sizeof ROWS[0]; r++) {
        json_error_t je;
        json_t *j = json_loads(ROWS[r].json, JSON_ALLOW_NUL, &je);
        cr_assert_not_null(j, "row %zu: %s", r, je.text);
        char *text = (char *)"untouched";
        size_t len = 9;
        di_error e;
        cr_assert_eq(tok_chat_render_json(j, true, &text, &len, &e), DI_EINVAL, "row %zu", r);
        cr_assert(strstr(e.msg, ROWS[r].msg) != NULL, "row %zu: '%s' lacks '%s'", r, e.msg,
                  ROWS[r].msg);
        cr_assert_str_eq(text, "untouched");
        tok_ids ids = {0};
        cr_assert_eq(tok_chat_encode_json(t, j, true, &ids, &e), DI_EINVAL);
        cr_assert_eq(ids.n, 0);
        json_decref(j);
    }
    tok_free(t);
}
