/* fake_rank: a process that answers GetLoad as a prefill or decode rank, for the rank table's
 * tests that kill and restart a rank (tests/router/test_ranks.c).
 *
 *     fake_rank prefill|decode PORT READY_FD TOKEN
 *
 * Listens on 127.0.0.1:PORT (0 picks one), writes the port and a newline to READY_FD, and
 * serves until it is killed. Each GetLoad reply reports the GetLoads served so far as
 * `running`, so a caller sees every heartbeat's load change. */
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/net/rpc.h"
#include "engine.pb-c.h"

static di_status get_load(void *svc, const rpc_request *rq, rpc_reply *reply, di_error *err)
{
    (void)rq;
    atomic_uint *served = svc;
    Di__Engine__Load l = DI__ENGINE__LOAD__INIT;
    l.running = atomic_fetch_add(served, 1) + 1;
    l.free_blocks = 1000;
    l.total_blocks = 1000;
    reply->len = di__engine__load__get_packed_size(&l);
    reply->data = malloc(reply->len + 1);
    if (!reply->data)
        return di_fail(err, DI_ENOMEM, "GetLoad reply");
    di__engine__load__pack(&l, reply->data);
    return DI_OK;
}

int main(int argc, char **argv)
{
    if (argc != 5 || (strcmp(argv[1], "prefill") != 0 && strcmp(argv[1], "decode") != 0)) {
        fprintf(stderr, "usage: fake_rank prefill|decode PORT READY_FD TOKEN\n");
        return 2;
    }
    const char *method = argv[1][0] == 'p' ? "/di.prefill.Prefill/GetLoad"
                                           : "/di.decode.Decode/GetLoad";
    char listen[32];
    snprintf(listen, sizeof listen, "127.0.0.1:%d", atoi(argv[2]));
    int ready = atoi(argv[3]);
    atomic_uint served = 0;
    rpc_method m[] = {{method, get_load, 1000, 1, 4096, RPC_ROLE_ENGINE}};
    rpc_server_config sc = {.listen = listen, .methods = m, .n_methods = 1, .svc = &served,
                            .threads = 1, .engine_token = argv[4]};
    rpc_server *srv = NULL;
    int port = 0;
    di_error e = {0};
    di_status st = DI_EUNAVAIL;
    for (int i = 0; i < 250 && st != DI_OK; i++) { /* a restart may wait for the port */
        st = rpc_server_start(&sc, &srv, &port, &e);
        if (st != DI_OK)
            usleep(20000);
    }
    if (st != DI_OK) {
        fprintf(stderr, "fake_rank: %s\n", e.msg);
        return 1;
    }
    dprintf(ready, "%d\n", port);
    close(ready);
    for (;;)
        pause(); /* until killed */
}
