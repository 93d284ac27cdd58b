/* kvcache_none.c: di-generate built without the services has no KV store client. */
#include "tools/generate/kvcache.h"

bool gen_kv_supported(void)
{
    return false;
}

di_status gen_kv_open(const gen_kv_options *o, const kv_geometry *g, gen_kv **out,
                      di_error *err)
{
    return di_fail(err, DI_EUNSUPPORTED, "--kvstore needs a build with the services (gRPC, UCX, "
                   "RocksDB): this di-generate was built without them");
}

void gen_kv_close(gen_kv *k)
{
}

di_status gen_kv_admit(gen_kv *k, uint64_t id, const int32_t *prompt, uint32_t len,
                       di_error *err)
{
    return di_fail(err, DI_EUNSUPPORTED, "no KV store client in this build");
}

di_status gen_kv_collect(gen_kv *k, di_error *err)
{
    return DI_OK;
}

void gen_kv_hit(const gen_kv *k, sched_request *sr)
{
}

void gen_kv_drain(gen_kv *k)
{
}

di_status gen_kv_load(void *userdata, fwd_kv *kv, const sched_seq_plan *entry, di_error *err)
{
    return di_fail(err, DI_EUNSUPPORTED, "no KV store client in this build");
}

di_status gen_kv_after_step(gen_kv *k, fwd_kv *kv, const sched_plan *plan,
                            const sched_seq_result *results, di_error *err)
{
    return DI_OK;
}

void gen_kv_finished(gen_kv *k, uint64_t id, sched_finish f)
{
}

gen_kv_stats gen_kv_get_stats(const gen_kv *k)
{
    gen_kv_stats z = {0};
    return z;
}
