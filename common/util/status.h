/* status.h: the one error vocabulary of the project.
 *
 * Every public function that can fail returns a di_status and, when the caller passes a
 * di_error, writes a one-line message that says what was wrong and what to do. Outputs are
 * written only on success. DI_STATUS_MAP lists each code once with its default message, the
 * gRPC status code and the HTTP status it maps to; the enum, di_status_str(),
 * di_status_grpc() and di_status_http() all expand from it.
 *
 * Codes are negative (0 is success), so `if (st < 0)` reads as "failed".
 */
#ifndef DI_UTIL_STATUS_H
#define DI_UTIL_STATUS_H

#include <stdarg.h>
#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#endif

/* XX(name, value, message, grpc_code, http_status) */
#define DI_STATUS_MAP(XX)                                                                   \
    XX(OK, 0, "ok", 0, 200)                                                                 \
    XX(EINVAL, -1, "invalid argument", 3, 400)                                              \
    XX(ENOMEM, -2, "out of memory", 8, 503)                                                 \
    XX(ENOENT, -3, "not found", 5, 404)                                                     \
    XX(EEXIST, -4, "already exists", 6, 409)                                                \
    XX(ENOSPC, -5, "no space left (capacity or disk full)", 8, 507)                         \
    XX(EFULL, -6, "resource exhausted (queue, blocks or slots)", 8, 429)                    \
    XX(EIO, -7, "input/output error", 13, 500)                                              \
    XX(ECORRUPT, -8, "data corrupted (checksum or format mismatch)", 15, 500)               \
    XX(ETIMEDOUT, -9, "deadline exceeded", 4, 504)                                          \
    XX(ECANCELED, -10, "canceled", 1, 499)                                                  \
    XX(EUNAVAIL, -11, "service unavailable", 14, 503)                                       \
    XX(EAUTH, -12, "unauthenticated (missing or wrong token)", 16, 401)                     \
    XX(EPERM, -13, "permission denied", 7, 403)                                             \
    XX(EBUSY, -14, "busy (object in use or requests in flight)", 9, 409)                    \
    XX(EPROTO, -15, "malformed message", 3, 400)                                            \
    XX(ERANGE, -16, "value out of range", 11, 400)                                          \
    XX(EUNSUPPORTED, -17, "not supported", 12, 501)                                         \
    XX(ESTATE, -18, "operation not valid in the current state", 9, 409)                    \
    XX(EINTERNAL, -19, "internal error", 13, 500)

typedef enum di_status {
#define DI_STATUS_ENUM_(name, value, msg, grpc, http) DI_##name = value,
    DI_STATUS_MAP(DI_STATUS_ENUM_)
#undef DI_STATUS_ENUM_
} di_status;

/* A failure's code and its one-line message. Callers own it (usually on the stack). */
typedef struct di_error {
    di_status code; /* DI_OK until a failure is recorded */
    char msg[320];  /* NUL-terminated, no newline; empty when code is DI_OK */
} di_error;

/* The default message of a code ("invalid argument"); "unknown status" for other values. */
const char *di_status_str(di_status st);
/* The symbolic name ("EINVAL"), for logs and JSON. */
const char *di_status_name(di_status st);
/* gRPC status code (grpc_status_code value) and HTTP status for a code. */
int di_status_grpc(di_status st);
int di_status_http(di_status st);

/* Records a failure in err (when err is not NULL) and returns code, so a function can
 * `return di_fail(err, DI_EINVAL, "top_p %g outside (0, 1]", p);`. The message is formatted
 * with vsnprintf and truncated to fit; CR and LF are replaced by spaces so the text can go
 * into gRPC trailers and SSE events unchanged. */
di_status di_fail(di_error *err, di_status code, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
di_status di_vfail(di_error *err, di_status code, const char *fmt, va_list ap);

/* Prefixes an existing message with context ("loading layer 3: " + old message). */
void di_error_prefix(di_error *err, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

/* Resets err to DI_OK with an empty message. NULL-safe. */
void di_error_clear(di_error *err);

#ifdef __cplusplus
}
#endif

#endif
