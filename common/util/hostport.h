/* hostport.h: the one parser of HOST:PORT operator input (listen addresses and targets of
 * every binary). A host is a name or IPv4 address ("localhost", "10.0.0.7") or an IPv6
 * address in brackets ("[::1]"); the port is decimal digits in 1..65535, or 0 where the
 * caller allows "pick a free one" (listen addresses). Anything else is refused with a
 * one-line reason: no port, an empty host, a port of 99999, "80x", spaces, a scheme. */
#ifndef DI_UTIL_HOSTPORT_H
#define DI_UTIL_HOSTPORT_H

#include <stdbool.h>
#include <stdint.h>

#include "common/util/status.h"

#define DI_HOST_MAX 253 /* longest DNS name */

/* A parsed address. */
typedef struct di_hostport {
    char host[DI_HOST_MAX + 3]; /* as given, brackets of an IPv6 address kept */
    uint16_t port;              /* 0 only when the caller allowed it */
} di_hostport;

/* Parses s ("HOST:PORT"). allow_zero: port 0 is accepted (the kernel picks one). Returns
 * DI_OK, or DI_EINVAL with the reason ("port 99999 outside 1..65535"); *out is written only
 * on success and may be NULL to only check. */
di_status di_hostport_parse(const char *s, bool allow_zero, di_hostport *out, di_error *err);

/* True for a loopback host: "localhost", 127.x.y.z, "[::1]". */
bool di_hostport_is_loopback(const di_hostport *hp);

#endif
