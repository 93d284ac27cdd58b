#include "common/util/hostport.h"

#include <string.h>

/* Characters of a host name or an IPv4 address (RFC 1123 labels, plus '_' seen in practice). */
static bool name_char(char c)
{
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
           c == '-' || c == '.' || c == '_';
}

static bool v6_char(char c)
{
    return (c >= 'a' && c <= 'f') || (c >= 'A' && c <= 'F') || (c >= '0' && c <= '9') ||
           c == ':' || c == '.' || c == '%';
}

di_status di_hostport_parse(const char *s, bool allow_zero, di_hostport *out, di_error *err)
{
    if (!s || !*s)
        return di_fail(err, DI_EINVAL, "empty address: expected HOST:PORT");
    const char *colon = strrchr(s, ':');
    if (!colon)
        return di_fail(err, DI_EINVAL, "\"%.80s\" has no port: expected HOST:PORT", s);
    size_t hlen = (size_t)(colon - s);
    if (hlen == 0)
        return di_fail(err, DI_EINVAL, "\"%.80s\" has no host: expected HOST:PORT", s);
    if (hlen > DI_HOST_MAX + 2)
        return di_fail(err, DI_EINVAL, "host of %zu characters, at most %d", hlen, DI_HOST_MAX);
    if (s[0] == '[') {
        if (hlen < 3 || s[hlen - 1] != ']')
            return di_fail(err, DI_EINVAL, "\"%.80s\": an IPv6 host is written [ADDR]:PORT", s);
        for (size_t i = 1; i + 1 < hlen; i++)
            if (!v6_char(s[i]))
                return di_fail(err, DI_EINVAL, "\"%.80s\": bad character in the IPv6 host", s);
    } else {
        for (size_t i = 0; i < hlen; i++)
            if (!name_char(s[i]))
                return di_fail(err, DI_EINVAL,
                               "\"%.80s\": bad character '%c' in the host (IPv6 goes in "
                               "brackets: [::1]:PORT)",
                               s, s[i] == ':' ? ':' : s[i] >= 32 && s[i] < 127 ? s[i] : '?');
        if (s[0] == '-' || s[0] == '.')
            return di_fail(err, DI_EINVAL, "\"%.80s\": a host cannot start with '%c'", s, s[0]);
    }
    const char *p = colon + 1;
    size_t plen = strlen(p);
    if (plen == 0)
        return di_fail(err, DI_EINVAL, "\"%.80s\" has no port: expected HOST:PORT", s);
    unsigned long port = 0;
    for (size_t i = 0; i < plen; i++) {
        if (p[i] < '0' || p[i] > '9')
            return di_fail(err, DI_EINVAL, "\"%.80s\": port \"%.20s\" is not a number", s, p);
        if (port <= 65535)
            port = port * 10 + (unsigned long)(p[i] - '0');
    }
    if (port > 65535 || (port == 0 && !allow_zero))
        return di_fail(err, DI_EINVAL, "\"%.80s\": port %.20s outside %d..65535", s, p,
                       allow_zero ? 0 : 1);
    if (out) {
        memcpy(out->host, s, hlen);
        out->host[hlen] = '\0';
        out->port = (uint16_t)port;
    }
    return DI_OK;
}

bool di_hostport_is_loopback(const di_hostport *hp)
{
    return strcmp(hp->host, "localhost") == 0 || strncmp(hp->host, "127.", 4) == 0 ||
           strcmp(hp->host, "[::1]") == 0;
}
