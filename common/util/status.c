#include "common/util/status.h"

#include <stdio.h>
#include <string.h>

const char *di_status_str(di_status st)
{
    switch (st) {
#define DI_STATUS_STR_(name, value, msg, grpc, http) \
    case DI_##name:                                  \
        return msg;
        DI_STATUS_MAP(DI_STATUS_STR_)
#undef DI_STATUS_STR_
    }
    return "unknown status";
}

const char *di_status_name(di_status st)
{
    switch (st) {
#define DI_STATUS_NAME_(name, value, msg, grpc, http) \
    case DI_##name:                                   \
        return #name;
        DI_STATUS_MAP(DI_STATUS_NAME_)
#undef DI_STATUS_NAME_
    }
    return "EUNKNOWN";
}

int di_status_grpc(di_status st)
{
    switch (st) {
#define DI_STATUS_GRPC_(name, value, msg, grpc, http) \
    case DI_##name:                                   \
        return grpc;
        DI_STATUS_MAP(DI_STATUS_GRPC_)
#undef DI_STATUS_GRPC_
    }
    return 2; /* UNKNOWN */
}

int di_status_http(di_status st)
{
    switch (st) {
#define DI_STATUS_HTTP_(name, value, msg, grpc, http) \
    case DI_##name:                                   \
        return http;
        DI_STATUS_MAP(DI_STATUS_HTTP_)
#undef DI_STATUS_HTTP_
    }
    return 500;
}

static void sanitize_line(char *s)
{
    for (; *s; s++)
        if (*s == '\n' || *s == '\r')
            *s = ' ';
}

di_status di_vfail(di_error *err, di_status code, const char *fmt, va_list ap)
{
    if (err) {
        err->code = code;
        vsnprintf(err->msg, sizeof(err->msg), fmt, ap);
        sanitize_line(err->msg);
    }
    return code;
}

di_status di_fail(di_error *err, di_status code, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    di_vfail(err, code, fmt, ap);
    va_end(ap);
    return code;
}

void di_error_prefix(di_error *err, const char *fmt, ...)
{
    if (!err)
        return;
    char head[sizeof(err->msg)];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(head, sizeof(head), fmt, ap);
    va_end(ap);
    /* head, then as much of the old message as still fits (truncation is intended) */
    char joined[sizeof(err->msg)];
    size_t h = strlen(head), cap = sizeof(joined) - 1;
    size_t old = strnlen(err->msg, sizeof(err->msg) - 1);
    if (h > cap)
        h = cap;
    memcpy(joined, head, h);
    size_t rest = old < cap - h ? old : cap - h;
    memcpy(joined + h, err->msg, rest);
    joined[h + rest] = '\0';
    memcpy(err->msg, joined, sizeof(err->msg));
    sanitize_line(err->msg);
}

void di_error_clear(di_error *err)
{
    if (!err)
        return;
    err->code = DI_OK;
    err->msg[0] = '\0';
}
