/* engsvc_main.h: the whole program of di-prefill and di-decode on the service skeleton
 * (common/service): options (the shared ones, the engine's, --nextn, --chunk, --max-seqs,
 * --blocks, --max-waiting, --rpc-threads, --kvstore-deadline, the test-only --step-delay-ms),
 * backend, model and store opened in start, the gRPC server with engsvc's methods,
 * engsvc_drain on SIGTERM. */
#ifndef DI_SERVE_ENGSVC_MAIN_H
#define DI_SERVE_ENGSVC_MAIN_H

#include "common/serve/engsvc.h"

/* Runs the service; returns the exit code (service.h: 0, 1 or 2). */
int engsvc_program(engsvc_kind kind, int argc, char **argv);

#endif
