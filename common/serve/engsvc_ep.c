/* engsvc_ep.c: an engine service as one rank of an expert-parallel group (engsvc.h, "Expert
 * parallelism"; docs/ep.md): the group joined at create, the rank's MoE hooked into the
 * forward, the vote of every engine loop iteration, the end of every group step, and the way
 * out on stop. */
#include <stdlib.h>
#include <string.h>

#include "common/ep/group.h"
#include "common/ep/moe.h"
#include "common/serve/backend.h"
#include "common/serve/engsvc_internal.h"
#include "common/util/clock.h"

/* Every group failure names this rank; the group's message names the rank that failed. */
static di_status named(const engsvc *s, di_status st, di_error *err)
{
    if (st != DI_OK)
        di_error_prefix(err, "rank group (rank %u of %u): ", s->cfg.rank, s->cfg.world);
    return st;
}

di_status engsvc_ep_open(engsvc *s, fwd_options *fo, di_error *err)
{
    if (!s->cfg.ep)
        return DI_OK;
    s->ep = *s->cfg.ep;
    const engsvc_ep *e = &s->ep;
    if (s->cfg.world < 2 || s->cfg.rank >= s->cfg.world)
        return di_fail(err, DI_EINVAL, "rank group: rank %u of world %u (a group has 2 ranks "
                       "or more)", s->cfg.rank, s->cfg.world);
    if (!e->addr || !e->token)
        return di_fail(err, DI_EINVAL, "rank group: address and token required");
    if (e->idle_ms < 1 || e->timeout_ms < 2 || e->idle_ms > e->timeout_ms / 2)
        return di_fail(err, DI_EINVAL, "rank group: idle interval %u ms, want 1 .. half the "
                       "deadline (%u ms)", e->idle_ms, e->timeout_ms);
    ep_group_options go = {.addr = e->addr, .listen_fd = e->listen_fd, .rank = s->cfg.rank,
                           .world = s->cfg.world, .token = e->token,
                           .timeout_ms = e->timeout_ms, .allow_remote = e->allow_remote};
    if (!(s->ep_flags = calloc(s->cfg.world, sizeof(uint64_t))))
        return di_fail(err, DI_ENOMEM, "rank group");
    kern_ep_ops xo;
    di_status st = serve_backend_ep_ops(s->cfg.be, &xo, err);
    if (st == DI_OK)
        st = ep_group_join(&go, &s->grp, err);
    if (st == DI_OK) {
        ep_moe_options mo = {.group = s->grp, .be = s->cfg.be, .dev_ops = &xo, .w = s->cfg.rm->w,
                             .min_redundant = e->redundant, .eplb_interval = e->eplb_interval};
        st = ep_moe_create(&mo, &s->moe, err);
    }
    if (st != DI_OK)
        return named(s, st, err);
    fo->moe_fn = ep_moe_layer;
    fo->moe_userdata = s->moe;
    return DI_OK;
}

void engsvc_ep_close(engsvc *s)
{
    ep_moe_free(s->moe);
    s->moe = NULL;
    ep_group_close(s->grp);
    s->grp = NULL;
    free(s->ep_flags);
    s->ep_flags = NULL;
}

/* A rank's flags in the vote: each rank fills its own entry, the others are 0, and the MAX
 * all-reduce gives every rank every rank's flags. */
enum { FLAG_WORK = 1, FLAG_LEAVING = 2 };

di_status engsvc_ep_vote(engsvc *s, bool mine, bool leaving, bool *any, uint32_t *leaver,
                         di_error *err)
{
    uint32_t W = s->cfg.world;
    memset(s->ep_flags, 0, W * sizeof(uint64_t));
    s->ep_flags[s->cfg.rank] = (mine ? FLAG_WORK : 0u) | (leaving ? FLAG_LEAVING : 0u);
    di_status st = ep_group_allreduce(s->grp, EP_REDUCE_MAX, s->ep_flags, W, err);
    *any = false;
    *leaver = UINT32_MAX;
    for (uint32_t r = 0; st == DI_OK && r < W; r++) {
        *any |= (s->ep_flags[r] & FLAG_WORK) != 0;
        if ((s->ep_flags[r] & FLAG_LEAVING) && *leaver == UINT32_MAX && r != s->cfg.rank)
            *leaver = r;
    }
    return named(s, st, err);
}

di_status engsvc_ep_step_end(engsvc *s, di_error *err)
{
    return named(s, ep_moe_step_end(s->moe, err), err);
}

void engsvc_ep_leave(engsvc *s)
{
    if (!s->grp)
        return;
    pthread_mutex_lock(&s->mu);
    bool broken = s->broken;
    pthread_mutex_unlock(&s->mu);
    uint64_t until = di_mono_ns() + (uint64_t)s->ep.timeout_ms * 1000000u;
    di_error err;
    bool any = true;
    uint32_t leaver;
    while (!broken && di_mono_ns() < until) {
        if (engsvc_ep_vote(s, false, true, &any, &leaver, &err) != DI_OK || !any ||
            engsvc_ep_step_end(s, &err) != DI_OK)
            break;
    }
    if (any && !broken && s->cfg.log)
        di_log(s->cfg.log, DI_LOG_WARN, "leaving the rank group while it has work: the "
               "other ranks' requests in flight fail");
    const ep_moe_stats *m = ep_moe_get_stats(s->moe);
    if (s->cfg.log)
        di_log(s->cfg.log, DI_LOG_INFO, "rank group: %llu steps, %llu exchange rounds (%llu "
               "serving only), %llu pairs sent, %llu pairs served, %llu re-plans (%llu "
               "layers reverted)",
               (unsigned long long)m->steps, (unsigned long long)m->rounds,
               (unsigned long long)m->serve_rounds, (unsigned long long)m->pairs_sent,
               (unsigned long long)m->pairs_served, (unsigned long long)m->replans,
               (unsigned long long)m->replans_reverted);
}
