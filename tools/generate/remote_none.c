/* remote_none.c: di-generate built without the services cannot reach di-prefill/di-decode. */
#include "tools/generate/gen.h"

di_status gen_remote_run(const gen_args *a, di_error *err)
{
    (void)a;
    return di_fail(err, DI_EUNSUPPORTED, "--prefill/--decode need a build with the services "
                   "(gRPC, UCX, RocksDB): this di-generate was built without them");
}
