#include "tests/net/loopback.h"

#include <criterion/criterion.h>
#include <stdio.h>
#include <stdlib.h>

rpc_client *loopback_client(int port, const char *token)
{
    char target[64];
    snprintf(target, sizeof(target), "127.0.0.1:%d", port);
    rpc_client_config cc = {.target = target, .token = token};
    rpc_client *c = NULL;
    di_error e;
    cr_assert_eq(rpc_client_open(&cc, &c, &e), DI_OK, "%s", e.msg);
    return c;
}

di_status loopback_read_rest(rpc_stream *st, uint32_t *count, di_error *e)
{
    for (;;) {
        uint8_t *m = NULL;
        size_t len = 0;
        int done = 0;
        di_status r = rpc_stream_read(st, &m, &len, &done, e);
        free(m);
        if (done)
            return r;
        (*count)++;
    }
}
