#include "common/service/engine_opts.h"

#include <string.h>

#include "common/util/hostport.h"

di_status svc_engine_check(const svc_engine_opts *o, di_error *err)
{
    if (!o->model_dir == !o->config)
        return di_fail(err, DI_EINVAL, "give either --model DIR or --config NAME|FILE%s",
                       o->model_dir ? ", not both" : "");
    if (o->model_dir && o->weights_seed != 0)
        return di_fail(err, DI_EINVAL, "--weights-seed goes with --config (random weights), "
                                       "not with --model");
    if (o->rank >= o->world)
        return di_fail(err, DI_EINVAL, "--rank %llu is not below --world %llu",
                       (unsigned long long)o->rank, (unsigned long long)o->world);
    if (o->kvstore_token && !o->kvstore)
        return di_fail(err, DI_EINVAL, "a store token (--kvstore-token-file or "
                                       "$DI_KVSTORE_TOKEN) without --kvstore");
    if (o->kvstore) { /* a listen address may say port 0, the store's address may not */
        di_status st = di_hostport_parse(o->kvstore, false, NULL, err);
        if (st != DI_OK) {
            di_error_prefix(err, "--kvstore: ");
            return st;
        }
    }
    return DI_OK;
}
