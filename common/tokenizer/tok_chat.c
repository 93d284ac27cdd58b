/* tok_chat.c: DeepSeek V3's chat format, written out from the chat_template of its
 * tokenizer_config.json.
 *
 * The template, step by step (quirks kept, since they are what the model saw):
 *   - every system message, wherever it stands, joins the system prompt (two newlines between
 *     them); the output starts with BOS text and that prompt;
 *   - user: "<｜User｜>" + content;
 *   - assistant with content: "<｜Assistant｜>" + content + EOS, or, right after tool outputs,
 *     "<｜tool▁outputs▁end｜>" + content + EOS;
 *   - assistant with tool calls (content null): the first call of the conversation opens with
 *     "<｜Assistant｜><｜tool▁calls▁begin｜>", each later one starts on a new line and is
 *     followed by "<｜tool▁calls▁end｜>" + EOS (the template's own placement);
 *   - tool: the first tool output of the conversation opens "<｜tool▁outputs▁begin｜>", later
 *     ones start on a new line; each is wrapped in "<｜tool▁output▁begin｜>...▁end｜>";
 *   - at the end, open tool outputs are closed with "<｜tool▁outputs▁end｜>"; otherwise, with
 *     add_generation_prompt, "<｜Assistant｜>" follows.
 * Where the template would silently drop something (an assistant message with both content
 * and tool calls, an unknown role), we refuse instead.
 */
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>

#include "common/tokenizer/tok_internal.h"
#include "common/util/json_read.h"

#define DS_BOS "<｜begin▁of▁sentence｜>"
#define DS_EOS "<｜end▁of▁sentence｜>"
#define DS_USER "<｜User｜>"
#define DS_ASSISTANT "<｜Assistant｜>"
#define DS_CALLS_BEGIN "<｜tool▁calls▁begin｜>"
#define DS_CALLS_END "<｜tool▁calls▁end｜>"
#define DS_CALL_BEGIN "<｜tool▁call▁begin｜>"
#define DS_CALL_END "<｜tool▁call▁end｜>"
#define DS_SEP "<｜tool▁sep｜>"
#define DS_OUTPUTS_BEGIN "<｜tool▁outputs▁begin｜>"
#define DS_OUTPUTS_END "<｜tool▁outputs▁end｜>"
#define DS_OUTPUT_BEGIN "<｜tool▁output▁begin｜>"
#define DS_OUTPUT_END "<｜tool▁output▁end｜>"

/* The template's namespace variables. */
typedef struct chat_state {
    bool calls_started;  /* ns.is_first: a tool call was rendered before */
    bool in_tool;        /* ns.is_tool: the last turn was a tool output */
    bool outputs_opened; /* !ns.is_output_first: a tool output was rendered before */
    tok_buf out;         /* rendered text */
} chat_state;

/* Appends a NULL-terminated list of strings. */
static di_status put(chat_state *c, di_error *err, const char *first, ...)
{
    va_list ap;
    va_start(ap, first);
    di_status st = DI_OK;
    for (const char *s = first; s && !st; s = va_arg(ap, const char *))
        st = tok_buf_appends(&c->out, s, err);
    va_end(ap);
    return st;
}

static di_status render_user(chat_state *c, const tok_chat_msg *m, di_error *err)
{
    c->in_tool = false;
    return put(c, err, DS_USER, m->content, NULL);
}

static di_status render_tool_calls(chat_state *c, const tok_chat_msg *m, di_error *err)
{
    di_status st = DI_OK;
    c->in_tool = false;
    for (size_t i = 0; i < m->n_tool_calls && !st; i++) {
        const tok_tool_call *tc = &m->tool_calls[i];
        if (!c->calls_started)
            st = put(c, err, DS_ASSISTANT DS_CALLS_BEGIN DS_CALL_BEGIN, NULL);
        else
            st = put(c, err, "\n" DS_CALL_BEGIN, NULL);
        if (!st)
            st = put(c, err, tc->type, DS_SEP, tc->name, "\n```json\n", tc->arguments,
                     "\n```" DS_CALL_END, NULL);
        if (!st && c->calls_started)
            st = put(c, err, DS_CALLS_END DS_EOS, NULL);
        c->calls_started = true;
    }
    return st;
}

static di_status render_assistant(chat_state *c, const tok_chat_msg *m, di_error *err)
{
    if (!m->content)
        return render_tool_calls(c, m, err);
    bool after_tool = c->in_tool;
    c->in_tool = false;
    return put(c, err, after_tool ? DS_OUTPUTS_END : DS_ASSISTANT, m->content, DS_EOS, NULL);
}

static di_status render_tool(chat_state *c, const tok_chat_msg *m, di_error *err)
{
    c->in_tool = true;
    bool first = !c->outputs_opened;
    c->outputs_opened = true;
    return put(c, err, first ? DS_OUTPUTS_BEGIN DS_OUTPUT_BEGIN : "\n" DS_OUTPUT_BEGIN,
               m->content, DS_OUTPUT_END, NULL);
}

static di_status render_system(chat_state *c, const tok_chat_msg *m, di_error *err)
{
    (void)c, (void)m, (void)err; /* gathered into the system prompt up front */
    return DI_OK;
}

typedef struct chat_role_row {
    const char *role;        /* "role" value */
    bool content_required;   /* content may not be NULL */
    bool tool_calls_allowed; /* tool_calls may be given */
    di_status (*render)(chat_state *c, const tok_chat_msg *m, di_error *err);
} chat_role_row;

static const chat_role_row ROLES[] = {
    {"system", true, false, render_system},
    {"user", true, false, render_user},
    {"assistant", false, true, render_assistant},
    {"tool", true, false, render_tool},
};

static const chat_role_row *role_row(const char *role)
{
    for (size_t i = 0; role && i < sizeof ROLES / sizeof ROLES[0]; i++)
        if (strcmp(ROLES[i].role, role) == 0)
            return &ROLES[i];
    return NULL;
}

static di_status check_msg(const tok_chat_msg *m, size_t i, di_error *err)
{
    const chat_role_row *r = role_row(m->role);
    if (!r)
        return di_fail(err, DI_EINVAL,
                       "message %zu: unknown role '%s' (system, user, assistant or tool)", i,
                       m->role ? m->role : "(null)");
    if (m->n_tool_calls && !r->tool_calls_allowed)
        return di_fail(err, DI_EINVAL, "message %zu: tool_calls on a '%s' message", i, m->role);
    if (m->n_tool_calls && m->content)
        return di_fail(err, DI_EINVAL,
                       "message %zu: assistant message with both content and tool_calls "
                       "(the DeepSeek V3 format renders only one)", i);
    if (!m->content && (r->content_required || !m->n_tool_calls))
        return di_fail(err, DI_EINVAL, "message %zu: '%s' message without content", i, m->role);
    for (size_t k = 0; k < m->n_tool_calls; k++) {
        const tok_tool_call *tc = &m->tool_calls[k];
        if (!m->tool_calls || !tc->type || !tc->name || !tc->arguments)
            return di_fail(err, DI_EINVAL,
                           "message %zu: tool call %zu needs type, name and arguments", i, k);
    }
    return DI_OK;
}

di_status tok_chat_render(const tok_chat_msg *msgs, size_t n, bool add_generation_prompt,
                          char **out, size_t *out_len, di_error *err)
{
    if ((!msgs && n) || !out || !out_len)
        return di_fail(err, DI_EINVAL, "tok_chat_render: messages and outputs must not be NULL");
    for (size_t i = 0; i < n; i++) {
        di_status st = check_msg(&msgs[i], i, err);
        if (st)
            return st;
    }
    chat_state c = {0};
    di_status st = put(&c, err, DS_BOS, NULL);
    bool first_system = true;
    for (size_t i = 0; i < n && !st; i++) {
        if (strcmp(msgs[i].role, "system") != 0)
            continue;
        st = put(&c, err, first_system ? "" : "\n\n", msgs[i].content, NULL);
        first_system = false;
    }
    for (size_t i = 0; i < n && !st; i++)
        st = role_row(msgs[i].role)->render(&c, &msgs[i], err);
    if (!st && c.in_tool)
        st = put(&c, err, DS_OUTPUTS_END, NULL);
    else if (!st && add_generation_prompt)
        st = put(&c, err, DS_ASSISTANT, NULL);
    if (st) {
        tok_buf_free(&c.out);
        return st;
    }
    *out = c.out.p;
    *out_len = c.out.n;
    return DI_OK;
}

/* ---- JSON messages ---------------------------------------------------------------------------- */

/* A string member, NULL when absent or null; an error for another type. */
static di_status member_str(const json_t *o, const char *key, size_t i, const char **out,
                            di_error *err)
{
    const json_t *v = json_object_get(o, key);
    *out = NULL;
    if (!v || json_is_null(v))
        return DI_OK;
    if (!json_is_string(v))
        return di_fail(err, DI_EINVAL, "message %zu: key '%s': expected a string, got %s", i,
                       key, di_json_type_name(v));
    if (strlen(json_string_value(v)) != json_string_length(v))
        return di_fail(err, DI_EINVAL, "message %zu: key '%s' holds a NUL character", i, key);
    *out = json_string_value(v);
    return DI_OK;
}

static di_status parse_tool_calls(const json_t *arr, size_t i, tok_tool_call *calls,
                                  di_error *err)
{
    for (size_t k = 0; k < json_array_size(arr); k++) {
        const json_t *tc = json_array_get(arr, k);
        const json_t *fn = json_object_get(tc, "function");
        if (!json_is_object(tc) || !json_is_object(fn))
            return di_fail(err, DI_EINVAL,
                           "message %zu: tool_calls[%zu] needs a \"function\" object", i, k);
        di_status st = member_str(tc, "type", i, &calls[k].type, err);
        if (!st)
            st = member_str(fn, "name", i, &calls[k].name, err);
        if (!st)
            st = member_str(fn, "arguments", i, &calls[k].arguments, err);
        if (st)
            return st;
        if (!calls[k].type)
            calls[k].type = "function";
    }
    return DI_OK;
}

di_status tok_chat_render_json(const json_t *messages, bool add_generation_prompt, char **out,
                               size_t *out_len, di_error *err)
{
    if (!json_is_array(messages))
        return di_fail(err, DI_EINVAL, "messages: expected an array of {\"role\", \"content\"}");
    size_t n = json_array_size(messages), ncalls = 0;
    for (size_t i = 0; i < n; i++) {
        const json_t *tc = json_object_get(json_array_get(messages, i), "tool_calls");
        if (tc && !json_is_null(tc) && !json_is_array(tc))
            return di_fail(err, DI_EINVAL, "message %zu: key 'tool_calls': expected an array", i);
        ncalls += json_array_size(tc);
    }
    tok_chat_msg *msgs = calloc(n ? n : 1, sizeof *msgs);
    tok_tool_call *calls = calloc(ncalls ? ncalls : 1, sizeof *calls);
    di_status st = (msgs && calls) ? DI_OK : di_fail(err, DI_ENOMEM, "out of memory for messages");
    size_t used = 0;
    for (size_t i = 0; i < n && !st; i++) {
        const json_t *m = json_array_get(messages, i);
        if (!json_is_object(m)) {
            st = di_fail(err, DI_EINVAL, "message %zu: expected an object", i);
            break;
        }
        st = member_str(m, "role", i, &msgs[i].role, err);
        if (!st)
            st = member_str(m, "content", i, &msgs[i].content, err);
        const json_t *tc = json_object_get(m, "tool_calls");
        msgs[i].tool_calls = calls + used;
        msgs[i].n_tool_calls = json_array_size(tc);
        if (!st)
            st = parse_tool_calls(tc, i, calls + used, err);
        used += msgs[i].n_tool_calls;
    }
    if (!st)
        st = tok_chat_render(msgs, n, add_generation_prompt, out, out_len, err);
    free(msgs);
    free(calls);
    return st;
}

di_status tok_chat_encode_json(const tok_tokenizer *t, const json_t *messages,
                               bool add_generation_prompt, tok_ids *out, di_error *err)
{
    if (!t || !out)
        return di_fail(err, DI_EINVAL, "tok_chat_encode_json: tokenizer and out must not be NULL");
    char *text = NULL;
    size_t len = 0;
    di_status st = tok_chat_render_json(messages, add_generation_prompt, &text, &len, err);
    if (!st)
        st = tok_encode(t, text, len, out, err);
    free(text);
    return st;
}
