#include "common/service/options.h"

#include <ctype.h>
#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/util/hostport.h"

/* ------------------------------------------------------------------ values */

/* A number followed by one of the unit suffixes, scaled. */
typedef struct unit_row {
    const char *suffix;
    double scale;
} unit_row;

static const unit_row byte_units[] = {
    {"", 1.0},         {"B", 1.0},         {"K", 0x1p10}, {"KB", 0x1p10}, {"KiB", 0x1p10},
    {"M", 0x1p20},     {"MB", 0x1p20},     {"MiB", 0x1p20}, {"G", 0x1p30}, {"GB", 0x1p30},
    {"GiB", 0x1p30},   {"T", 0x1p40},      {"TB", 0x1p40}, {"TiB", 0x1p40},
};

static const unit_row ms_units[] = {
    {"", 1.0}, {"ms", 1.0}, {"s", 1e3}, {"m", 6e4}, {"min", 6e4}, {"h", 3.6e6}, {"d", 8.64e7},
};

static di_status scaled(const char *s, const unit_row *units, size_t n_units, const char *what,
                        uint64_t *out, di_error *err)
{
    if (!s || !*s)
        return di_fail(err, DI_EINVAL, "an empty %s", what);
    if (!isdigit((unsigned char)s[0]) && s[0] != '.')
        return di_fail(err, DI_EINVAL, "\"%s\" is not a %s", s, what);
    errno = 0;
    char *end = NULL;
    double v = strtod(s, &end);
    if (end == s || errno != 0 || !isfinite(v))
        return di_fail(err, DI_EINVAL, "\"%s\" is not a %s", s, what);
    for (size_t i = 0; i < n_units; i++) {
        if (strcmp(end, units[i].suffix) != 0)
            continue;
        double x = v * units[i].scale;
        if (x > 0x1p63)
            return di_fail(err, DI_ERANGE, "%s \"%s\" is too large", what, s);
        *out = (uint64_t)llround(x);
        return DI_OK;
    }
    return di_fail(err, DI_EINVAL, "\"%s\" is not a %s (unknown unit \"%s\")", s, what, end);
}

di_status svc_parse_size(const char *s, uint64_t *bytes, di_error *err)
{
    return scaled(s, byte_units, sizeof(byte_units) / sizeof(byte_units[0]), "size", bytes, err);
}

di_status svc_parse_duration(const char *s, uint64_t *ms, di_error *err)
{
    return scaled(s, ms_units, sizeof(ms_units) / sizeof(ms_units[0]), "duration", ms, err);
}

di_status svc_parse_hostport(const char *s, char *host, size_t host_len, int *port,
                             di_error *err)
{
    di_hostport hp;
    di_status st = di_hostport_parse(s, true, &hp, err);
    if (st != DI_OK)
        return st;
    /* The host without the brackets of an IPv6 address. */
    const char *h = hp.host;
    size_t hn = strlen(h);
    if (h[0] == '[') {
        h++;
        hn -= 2;
    }
    if (host) {
        if (hn + 1 > host_len)
            return di_fail(err, DI_ERANGE, "\"%s\": the host is too long", s);
        memcpy(host, h, hn);
        host[hn] = '\0';
    }
    if (port)
        *port = hp.port;
    return DI_OK;
}

int svc_hostport_is_loopback(const char *s)
{
    di_hostport hp;
    return di_hostport_parse(s, true, &hp, NULL) == DI_OK && di_hostport_is_loopback(&hp);
}

/* ------------------------------------------------------------------ secrets */

static void wipe_free(char *p)
{
    if (!p)
        return;
    volatile char *v = p;
    while (*v)
        *v++ = 0;
    free(p);
}

/* The secret in `text` (its first line, surrounding blanks removed), malloc'd. */
static di_status secret_from_text(const char *text, const char *where, char **out,
                                  di_error *err)
{
    while (*text == ' ' || *text == '\t')
        text++;
    size_t n = strcspn(text, "\r\n");
    while (n > 0 && isspace((unsigned char)text[n - 1]))
        n--;
    if (n == 0)
        return di_fail(err, DI_EINVAL, "%s holds an empty secret", where);
    char *p = malloc(n + 1);
    if (!p)
        return di_fail(err, DI_ENOMEM, "cannot copy the secret of %s", where);
    memcpy(p, text, n);
    p[n] = '\0';
    *out = p;
    return DI_OK;
}

static di_status secret_from_file(const char *path, char **out, di_error *err)
{
    FILE *f = fopen(path, "r");
    if (!f)
        return di_fail(err, DI_ENOENT, "cannot read %s: %s", path, strerror(errno));
    char buf[1024];
    size_t n = fread(buf, 1, sizeof(buf) - 1, f);
    int bad = ferror(f);
    fclose(f);
    if (bad)
        return di_fail(err, DI_EIO, "cannot read %s", path);
    buf[n] = '\0';
    di_status st = secret_from_text(buf, path, out, err);
    memset(buf, 0, sizeof(buf));
    return st;
}

/* ------------------------------------------------------------------ rows */

static void *field(const svc_opt *o, void *opts)
{
    return (char *)opts + o->offset;
}

/* The value in the unit of the field (the form every binary's range errors take). */
static di_status in_bounds(const svc_opt *o, double v, di_error *err)
{
    if (v >= o->min && (o->max == 0 || v <= o->max))
        return DI_OK;
    const char *unit = o->kind == SVC_OPT_DURATION ? " ms" : o->kind == SVC_OPT_SIZE ? " bytes"
                                                                                      : "";
    if (o->max == 0)
        return di_fail(err, DI_ERANGE, "--%s: %.15g%s is below the least, %.15g%s", o->name, v,
                       unit, o->min, unit);
    return di_fail(err, DI_ERANGE, "--%s: %.15g%s is outside [%.15g, %.15g]", o->name, v, unit,
                   o->min, o->max);
}

static int choice_ok(const char *choices, const char *v)
{
    size_t n = strlen(v);
    for (const char *c = choices; c && *c;) {
        size_t len = strcspn(c, "|");
        if (len == n && strncmp(c, v, n) == 0)
            return 1;
        c += len + (c[len] == '|');
    }
    return 0;
}

static di_status check_path(const svc_opt *o, const char *v, di_error *err)
{
    if (!*v)
        return di_fail(err, DI_EINVAL, "--%s: an empty path", o->name);
    if (o->kind == SVC_OPT_FILE || o->kind == SVC_OPT_DIR) {
        struct stat sb;
        if (stat(v, &sb) != 0 || access(v, R_OK) != 0)
            return di_fail(err, DI_EINVAL, "--%s: cannot read %s: %s", o->name, v,
                           strerror(errno));
        if (o->kind == SVC_OPT_FILE && S_ISDIR(sb.st_mode))
            return di_fail(err, DI_EINVAL, "--%s: %s is a directory", o->name, v);
        if (o->kind == SVC_OPT_DIR && !S_ISDIR(sb.st_mode))
            return di_fail(err, DI_EINVAL, "--%s: %s is not a directory", o->name, v);
        return DI_OK;
    }
    /* OUTFILE: its directory must exist and be writable. */
    char dir[4096];
    const char *slash = strrchr(v, '/');
    if (!slash)
        snprintf(dir, sizeof(dir), ".");
    else if (slash == v)
        snprintf(dir, sizeof(dir), "/");
    else
        snprintf(dir, sizeof(dir), "%.*s", (int)(slash - v), v);
    if (access(dir, W_OK) != 0)
        return di_fail(err, DI_EINVAL, "--%s: cannot write in %s: %s", o->name, dir,
                       strerror(errno));
    return DI_OK;
}

static di_status unsigned_value(const svc_opt *o, const char *v, uint64_t *u, di_error *err)
{
    di_status st;
    if (o->kind == SVC_OPT_SIZE)
        st = svc_parse_size(v, u, err);
    else if (o->kind == SVC_OPT_DURATION)
        st = svc_parse_duration(v, u, err);
    else {
        errno = 0;
        char *end;
        unsigned long long x = strtoull(v, &end, 10);
        if (!isdigit((unsigned char)v[0]) || *end || errno)
            st = di_fail(err, DI_EINVAL, "\"%s\" is not a non-negative integer", v);
        else {
            *u = x;
            st = DI_OK;
        }
    }
    if (st != DI_OK)
        di_error_prefix(err, "--%s: ", o->name);
    return st;
}

static di_status set_value(const svc_opt *o, const char *v, void *opts, di_error *err)
{
    void *f = field(o, opts);
    switch (o->kind) {
    case SVC_OPT_FLAG:
        *(int *)f = 1;
        return DI_OK;
    case SVC_OPT_STRING:
        *(const char **)f = v;
        return DI_OK;
    case SVC_OPT_HOSTPORT: {
        /* min >= 1: an address to connect to, where port 0 means nothing */
        di_status st = di_hostport_parse(v, o->min < 1, NULL, err);
        if (st != DI_OK) {
            di_error_prefix(err, "--%s: ", o->name);
            return st;
        }
        *(const char **)f = v;
        return DI_OK;
    }
    case SVC_OPT_CHOICE:
        if (!choice_ok(o->extra, v))
            return di_fail(err, DI_EINVAL, "--%s: \"%s\" is not one of %s", o->name, v, o->extra);
        *(const char **)f = v;
        return DI_OK;
    case SVC_OPT_FILE:
    case SVC_OPT_DIR:
    case SVC_OPT_OUTFILE: {
        di_status st = check_path(o, v, err);
        if (st == DI_OK)
            *(const char **)f = v;
        return st;
    }
    case SVC_OPT_SECRET: {
        char *secret = NULL;
        di_status st = secret_from_file(v, &secret, err);
        if (st != DI_OK) {
            di_error_prefix(err, "--%s: ", o->name);
            return st;
        }
        wipe_free(*(char **)f);
        *(char **)f = secret;
        return DI_OK;
    }
    case SVC_OPT_INT: {
        errno = 0;
        char *end;
        long long x = strtoll(v, &end, 10);
        if (!*v || *end || errno)
            return di_fail(err, DI_EINVAL, "--%s: \"%s\" is not an integer", o->name, v);
        di_status st = in_bounds(o, (double)x, err);
        if (st == DI_OK)
            *(int64_t *)f = x;
        return st;
    }
    case SVC_OPT_DOUBLE: {
        errno = 0;
        char *end;
        double x = strtod(v, &end);
        if (!*v || *end || errno || !isfinite(x))
            return di_fail(err, DI_EINVAL, "--%s: \"%s\" is not a number", o->name, v);
        di_status st = in_bounds(o, x, err);
        if (st == DI_OK)
            *(double *)f = x;
        return st;
    }
    case SVC_OPT_SIZE:
    case SVC_OPT_DURATION:
    case SVC_OPT_UINT: {
        uint64_t u = 0;
        di_status st = unsigned_value(o, v, &u, err);
        if (st == DI_OK)
            st = in_bounds(o, (double)u, err);
        if (st == DI_OK)
            *(uint64_t *)f = u;
        return st;
    }
    }
    return di_fail(err, DI_EINVAL, "--%s: unknown option kind %d", o->name, (int)o->kind);
}

di_status svc_opts_defaults(const svc_opt *rows, size_t n, void *opts, di_error *err)
{
    for (size_t i = 0; i < n; i++) {
        if (!rows[i].def || rows[i].kind == SVC_OPT_FLAG || rows[i].kind == SVC_OPT_SECRET)
            continue;
        di_status st = set_value(&rows[i], rows[i].def, opts, err);
        if (st != DI_OK) {
            di_error_prefix(err, "default of ");
            return st;
        }
    }
    return DI_OK;
}

static const svc_opt *find_row(const svc_opt *rows, size_t n, const char *name, size_t len)
{
    for (size_t i = 0; i < n; i++)
        if (strlen(rows[i].name) == len && memcmp(rows[i].name, name, len) == 0)
            return &rows[i];
    return NULL;
}

di_status svc_opts_parse(const svc_opt *rows, size_t n, int argc, char **argv, int first,
                         void *opts, int *next, int *help, di_error *err)
{
    *help = 0;
    int i = first;
    for (; i < argc; i++) {
        const char *a = argv[i];
        if (strcmp(a, "--help") == 0 || strcmp(a, "-h") == 0) {
            *help = 1;
            continue;
        }
        if (strncmp(a, "--", 2) != 0 || a[2] == '\0')
            break;
        const char *name = a + 2, *eq = strchr(name, '=');
        size_t len = eq ? (size_t)(eq - name) : strlen(name);
        const svc_opt *o = find_row(rows, n, name, len);
        if (!o)
            return di_fail(err, DI_EINVAL, "unknown option --%.*s (see --help)", (int)len, name);
        const char *v = NULL;
        if (o->kind == SVC_OPT_FLAG) {
            if (eq)
                return di_fail(err, DI_EINVAL, "--%s takes no value", o->name);
        } else if (eq)
            v = eq + 1;
        else if (i + 1 < argc)
            v = argv[++i];
        else
            return di_fail(err, DI_EINVAL, "--%s needs a value (%s)", o->name,
                           o->metavar ? o->metavar : "VALUE");
        di_status st = set_value(o, v, opts, err);
        if (st != DI_OK)
            return st;
    }
    *next = i;
    return DI_OK;
}

di_status svc_opts_load_secrets(const svc_opt *rows, size_t n, void *opts, di_error *err)
{
    for (size_t i = 0; i < n; i++) {
        const svc_opt *o = &rows[i];
        if (o->kind != SVC_OPT_SECRET || *(char **)field(o, opts) || !o->extra)
            continue;
        const char *v = getenv(o->extra);
        if (!v)
            continue;
        char where[128];
        snprintf(where, sizeof(where), "the environment variable %s", o->extra);
        char *secret = NULL;
        di_status st = secret_from_text(v, where, &secret, err);
        if (st != DI_OK)
            return st;
        *(char **)field(o, opts) = secret;
    }
    return DI_OK;
}

void svc_opts_free(const svc_opt *rows, size_t n, void *opts)
{
    for (size_t i = 0; i < n; i++)
        if (rows[i].kind == SVC_OPT_SECRET) {
            wipe_free(*(char **)field(&rows[i], opts));
            *(char **)field(&rows[i], opts) = NULL;
        }
}

void svc_opts_print(FILE *f, const svc_opt *rows, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        const svc_opt *o = &rows[i];
        char head[96];
        snprintf(head, sizeof(head), "--%s%s%s", o->name, o->metavar ? " " : "",
                 o->metavar ? o->metavar : "");
        fprintf(f, "  %-30s %s", head, o->help);
        if (o->def)
            fprintf(f, " [%s]", o->def);
        if (o->kind == SVC_OPT_CHOICE)
            fprintf(f, " (%s)", o->extra);
        else if (o->kind == SVC_OPT_SECRET && o->extra)
            fprintf(f, " (else $%s)", o->extra);
        else if (o->max > 0)
            fprintf(f, " (%.15g..%.15g)", o->min, o->max);
        fputc('\n', f);
    }
}
