/* loopback.h: helpers of the tests that talk gRPC on loopback. */
#ifndef DI_TESTS_NET_LOOPBACK_H
#define DI_TESTS_NET_LOOPBACK_H

#include "common/net/rpc.h"

/* A client of 127.0.0.1:port with the token (or none); fails the test on error. */
rpc_client *loopback_client(int port, const char *token);
/* Reads a stream to its end, adding the messages to *count; returns the final status. */
di_status loopback_read_rest(rpc_stream *st, uint32_t *count, di_error *e);

#endif
