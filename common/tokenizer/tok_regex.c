/* tok_regex.c: tokenizer.json patterns on PCRE2.
 *
 * HF tokenizers runs Split patterns with Oniguruma (Ruby syntax, UTF-8, Unicode 16.0 tables).
 * PCRE2 with UTF and UCP reads them the same way except for a few escapes, which are rewritten
 * before compiling:
 *
 *   escape  Oniguruma meaning              PCRE2 text written
 *   \s      White_Space: 9-13, 85, Z       [\t-\r\x{85}\p{Z}]  (PCRE2 adds U+180E)
 *   \w      letters, marks, Nd, Pc         [\p{L}\p{M}\p{Nd}\p{Pc}]
 *   \h      hexadecimal digit              [0-9A-Fa-f]         (PCRE2: horizontal space)
 *   \uHHHH  code point                     \x{HHHH}
 *   \p{X}   general category X             [\p{X}...] plus the code points Unicode 15.0-16.0
 *                                          gave category X (TOK_UCD_PATCH): PCRE2 10.42 has
 *                                          Unicode 14.0 tables
 *
 * and their negations \S, \W, \H, \P{X} outside brackets. Inside a bracket the positive forms
 * are inlined; a negated one there (when it needs rewriting), a nested bracket, `&&` and
 * \Q...\E have no PCRE2 twin and are refused. \b and \B keep PCRE2's word definition (letters,
 * digits, underscore); \p{C} and \p{Cn} keep PCRE2's Unicode 14.0 view.
 */
#include <stdio.h>
#include <string.h>

#include "common/tokenizer/tok_internal.h"

typedef struct tok_escape_row {
    char letter;           /* the escape letter after the backslash */
    bool negated;          /* the row is a complement (\S, \W, \H) */
    const char *literal;   /* bracket text besides the properties */
    const char *props[4];  /* general categories it includes, NULL-terminated */
} tok_escape_row;

static const tok_escape_row ESCAPES[] = {
    {'s', false, "\\t-\\r\\x{85}", {"Z", NULL}},
    {'S', true, "\\t-\\r\\x{85}", {"Z", NULL}},
    {'w', false, "", {"L", "M", "Nd", "Pc"}},
    {'W', true, "", {"L", "M", "Nd", "Pc"}},
    {'h', false, "0-9A-Fa-f", {NULL}},
    {'H', true, "0-9A-Fa-f", {NULL}},
};

static const tok_escape_row *escape_row(char c)
{
    for (size_t i = 0; i < sizeof ESCAPES / sizeof ESCAPES[0]; i++)
        if (ESCAPES[i].letter == c)
            return &ESCAPES[i];
    return NULL;
}

static bool is_hex(char c)
{
    return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f') || (c >= 'A' && c <= 'F');
}

/* True when the patch range's category belongs to the general category `name` ("L", "So"). */
static bool gc_matches(const char *gc, const char *name, size_t n)
{
    return gc[0] == name[0] && (n == 1 || gc[1] == name[1]);
}

/* The number of patch ranges a property name takes in; 0 for names that are not patched
 * (scripts, C and its subcategories, anything unknown). */
static size_t patch_count(const char *name, size_t n)
{
    if (n < 1 || n > 2 || !strchr("LMNPSZ", name[0]) || (n == 2 && (name[1] < 'a' || name[1] > 'z')))
        return 0;
    size_t k = 0;
    for (size_t i = 0; i < TOK_UCD_PATCH_N; i++)
        k += gc_matches(TOK_UCD_PATCH[i].gc, name, n);
    return k;
}

/* Bracket text for one general category: \p{X} and its patch ranges. */
static di_status put_prop(tok_buf *out, const char *name, size_t n, di_error *err)
{
    char tmp[48];
    snprintf(tmp, sizeof tmp, "\\p{%.*s}", (int)n, name);
    di_status st = tok_buf_appends(out, tmp, err);
    for (size_t i = 0; i < TOK_UCD_PATCH_N && !st; i++) {
        const tok_ucd_range *r = &TOK_UCD_PATCH[i];
        if (!gc_matches(r->gc, name, n))
            continue;
        if (r->lo == r->hi)
            snprintf(tmp, sizeof tmp, "\\x{%X}", (unsigned)r->lo);
        else
            snprintf(tmp, sizeof tmp, "\\x{%X}-\\x{%X}", (unsigned)r->lo, (unsigned)r->hi);
        st = tok_buf_appends(out, tmp, err);
    }
    return st;
}

/* Writes a row of ESCAPES: inlined in a bracket, or as a bracket of its own. */
static di_status put_row(tok_buf *out, const tok_escape_row *row, bool in_class, size_t at,
                         di_error *err)
{
    if (in_class && row->negated)
        return di_fail(err, DI_EUNSUPPORTED, "unsupported regex: \\%c inside a bracket at offset %zu",
                       row->letter, at);
    di_status st = in_class ? DI_OK : tok_buf_appends(out, row->negated ? "[^" : "[", err);
    if (!st)
        st = tok_buf_appends(out, row->literal, err);
    for (size_t k = 0; k < 4 && row->props[k] && !st; k++)
        st = put_prop(out, row->props[k], strlen(row->props[k]), err);
    if (!st && !in_class)
        st = tok_buf_appends(out, "]", err);
    return st;
}

/* \p{X}, \P{X}, \p{^X}, \pX at p[i]: patched when X is a general category with additions. */
static di_status translate_prop(const char *p, size_t n, size_t i, bool in_class, tok_buf *out,
                                size_t *adv, di_error *err)
{
    bool neg = p[i + 1] == 'P';
    const char *name = p + i + 2;
    size_t len = 1;
    *adv = 3;
    if (i + 2 < n && p[i + 2] == '{') {
        const char *close = memchr(p + i + 3, '}', n - i - 3);
        if (!close) { /* unterminated: PCRE2 will say so */
            *adv = n - i;
            return tok_buf_append(out, p + i, n - i, err);
        }
        name = p + i + 3;
        len = (size_t)(close - name);
        *adv = (size_t)(close - (p + i)) + 1;
        if (len && name[0] == '^') {
            neg = !neg;
            name++;
            len--;
        }
    } else if (i + 2 >= n) {
        return di_fail(err, DI_EINVAL, "pattern ends inside \\%c", p[i + 1]);
    }
    if (patch_count(name, len) == 0)
        return tok_buf_append(out, p + i, *adv, err);
    if (in_class && neg)
        return di_fail(err, DI_EUNSUPPORTED,
                       "unsupported regex: negated property inside a bracket at offset %zu", i);
    di_status st = in_class ? DI_OK : tok_buf_appends(out, neg ? "[^" : "[", err);
    if (!st)
        st = put_prop(out, name, len, err);
    if (!st && !in_class)
        st = tok_buf_appends(out, "]", err);
    return st;
}

/* Writes the PCRE2 form of the escape at p[i] == '\\'; *adv receives the pattern bytes used. */
static di_status translate_escape(const char *p, size_t n, size_t i, bool in_class,
                                  tok_buf *out, size_t *adv, di_error *err)
{
    if (i + 1 >= n)
        return di_fail(err, DI_EINVAL, "pattern ends with a lone backslash");
    char c = p[i + 1];
    const tok_escape_row *row = escape_row(c);
    *adv = 2;
    if (row)
        return put_row(out, row, in_class, i, err);
    if (c == 'p' || c == 'P')
        return translate_prop(p, n, i, in_class, out, adv, err);
    if (c == 'u' && i + 5 < n && is_hex(p[i + 2]) && is_hex(p[i + 3]) && is_hex(p[i + 4]) &&
        is_hex(p[i + 5])) {
        char tmp[16];
        snprintf(tmp, sizeof tmp, "\\x{%.4s}", p + i + 2);
        *adv = 6;
        return tok_buf_appends(out, tmp, err);
    }
    if (c == 'Q')
        return di_fail(err, DI_EUNSUPPORTED, "unsupported regex: \\Q at offset %zu", i);
    return tok_buf_append(out, p + i, 2, err);
}

/* Copies a POSIX bracket "[:name:]" starting at p[i]; *adv receives its length. */
static di_status copy_posix(const char *p, size_t n, size_t i, tok_buf *out, size_t *adv,
                            di_error *err)
{
    for (size_t j = i + 2; j + 1 < n; j++) {
        if (p[j] == ':' && p[j + 1] == ']') {
            *adv = j + 2 - i;
            return tok_buf_append(out, p + i, *adv, err);
        }
        if (p[j] == ']')
            break;
    }
    return di_fail(err, DI_EUNSUPPORTED, "unsupported regex: nested bracket at offset %zu", i);
}

di_status tok_regex_translate(const char *p, size_t n, tok_buf *out, di_error *err)
{
    bool in_class = false;
    size_t class_start = 0; /* offset just after "[" or "[^" */
    di_status st = tok_buf_reserve(out, n + 16, err);
    size_t i = 0;
    while (!st && i < n) {
        char c = p[i];
        size_t adv = 1;
        if (c == '\\') {
            st = translate_escape(p, n, i, in_class, out, &adv, err);
        } else if (in_class && c == '[') {
            if (i + 1 < n && p[i + 1] == ':')
                st = copy_posix(p, n, i, out, &adv, err);
            else
                st = di_fail(err, DI_EUNSUPPORTED,
                             "unsupported regex: nested bracket at offset %zu", i);
        } else if (in_class && c == '&' && i + 1 < n && p[i + 1] == '&') {
            st = di_fail(err, DI_EUNSUPPORTED,
                         "unsupported regex: bracket intersection && at offset %zu", i);
        } else {
            if (!in_class && c == '[') {
                in_class = true;
                class_start = i + 1 + (i + 1 < n && p[i + 1] == '^');
                adv = class_start - i;
            } else if (in_class && c == ']' && i != class_start) {
                in_class = false;
            }
            st = tok_buf_append(out, p + i, adv, err);
        }
        i += adv;
    }
    return st;
}

di_status tok_regex_compile(const char *pattern, size_t len, bool is_regex, pcre2_code **out,
                            di_error *err)
{
    tok_buf text = {0};
    uint32_t opts = PCRE2_UTF | PCRE2_LITERAL;
    di_status st = DI_OK;
    if (is_regex) {
        opts = PCRE2_UTF | PCRE2_UCP;
        st = tok_regex_translate(pattern, len, &text, err);
        if (!st)
            st = tok_buf_append(&text, "", 0, err); /* NUL-terminate even when empty */
    } else {
        st = tok_buf_append(&text, pattern, len, err);
    }
    if (st) {
        tok_buf_free(&text);
        return st;
    }
    int code = 0;
    PCRE2_SIZE at = 0;
    pcre2_code *re = pcre2_compile((PCRE2_SPTR)text.p, text.n, opts, &code, &at, NULL);
    tok_buf_free(&text);
    if (!re) {
        PCRE2_UCHAR msg[160];
        pcre2_get_error_message(code, msg, sizeof msg);
        return di_fail(err, code == PCRE2_ERROR_NOMEMORY ? DI_ENOMEM : DI_EINVAL,
                       "regex rejected by PCRE2 at offset %zu: %s", (size_t)at, (char *)msg);
    }
    (void)pcre2_jit_compile(re, PCRE2_JIT_COMPLETE); /* without JIT, pcre2_match interprets */
    *out = re;
    return DI_OK;
}

di_status tok_matcher_init(tok_matcher *m, di_error *err)
{
    memset(m, 0, sizeof *m);
    m->md = pcre2_match_data_create(1, NULL);
    if (!m->md)
        return di_fail(err, DI_ENOMEM, "out of memory for regex match data");
    return DI_OK;
}

void tok_matcher_free(tok_matcher *m)
{
    if (!m)
        return;
    pcre2_match_data_free(m->md);
    pcre2_match_context_free(m->mctx);
    pcre2_jit_stack_free(m->jit_stack);
    memset(m, 0, sizeof *m);
}

/* Gives the matcher a large JIT stack after the default one ran out. */
static di_status matcher_grow_stack(tok_matcher *m, di_error *err)
{
    m->jit_stack = pcre2_jit_stack_create(64 * 1024, 64 * 1024 * 1024, NULL);
    m->mctx = m->jit_stack ? pcre2_match_context_create(NULL) : NULL;
    if (!m->mctx)
        return di_fail(err, DI_ENOMEM, "out of memory for a regex JIT stack");
    pcre2_jit_stack_assign(m->mctx, NULL, m->jit_stack);
    return DI_OK;
}

di_status tok_regex_next(tok_matcher *m, const pcre2_code *re, const char *s, size_t n,
                         size_t off, size_t *start, size_t *end, di_error *err)
{
    while (off <= n) {
        int rc = pcre2_match(re, (PCRE2_SPTR)s, n, off, PCRE2_NO_UTF_CHECK, m->md, m->mctx);
        if (rc == PCRE2_ERROR_NOMATCH)
            return DI_ENOENT;
        if (rc == PCRE2_ERROR_JIT_STACKLIMIT && !m->jit_stack) {
            di_status st = matcher_grow_stack(m, err);
            if (st)
                return st;
            continue;
        }
        if (rc < 0) {
            PCRE2_UCHAR msg[160];
            pcre2_get_error_message(rc, msg, sizeof msg);
            return di_fail(err, rc == PCRE2_ERROR_NOMEMORY ? DI_ENOMEM : DI_EINTERNAL,
                           "regex match failed at byte %zu: %s", off, (char *)msg);
        }
        const PCRE2_SIZE *ov = pcre2_get_ovector_pointer(m->md);
        if (ov[1] > ov[0]) {
            *start = ov[0];
            *end = ov[1];
            return DI_OK;
        }
        /* An empty match yields no piece: search again one character further on. */
        off = ov[1] > off ? ov[1] : off;
        if (off >= n)
            return DI_ENOENT;
        do
            off++;
        while (off < n && ((uint8_t)s[off] & 0xC0) == 0x80);
    }
    return DI_ENOENT;
}
