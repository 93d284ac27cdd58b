#include "common/serve/handoff.h"

#include <stdlib.h>
#include <string.h>

#include "common/engine/seq.h"
#include "common/kvfmt/kv_keys.h"
#include "common/model/kv_io.h"

static const kv_geometry *geom(const runner_exec *ex)
{
    return fwd_model_geometry(runner_exec_model(ex));
}

size_t handoff_max_bytes(const runner_exec *ex, uint32_t tokens)
{
    const kv_geometry *g = geom(ex);
    uint32_t kvp = tokens > 1 ? tokens - 1 : 1;
    kv_handoff h = {.prompt_len = kvp, .n_output = 1, .kv_positions = kvp,
                    .n_drafts = KV_HANDOFF_MAX_DRAFTS,
                    .exec_bytes = (uint32_t)runner_exec_state_bytes(ex)};
    /* with the partial block counted whether or not kvp leaves one */
    return kv_handoff_bytes(g, &h) + kv_block_payload_bytes(g);
}

/* The handed-off request's sequence: finished with a handoff, holding its blocks and slot. */
static di_status handed_off(engine *e, uint64_t id, const seq **out, di_error *err)
{
    const seq *q = sched_find(engine_sched(e), id);
    if (!q)
        return di_fail(err, DI_ENOENT, "handoff: request %llu is not live",
                       (unsigned long long)id);
    if (q->status != SEQ_FINISHED_HANDOFF || q->state_slot < 0)
        return di_fail(err, DI_ESTATE, "handoff: request %llu did not finish with a handoff",
                       (unsigned long long)id);
    *out = q;
    return DI_OK;
}

di_status handoff_export(engine *e, runner_exec *ex, uint64_t id, const uint8_t key[32],
                         void *dst, size_t cap, size_t *bytes, uint32_t *n_full, di_error *err)
{
    const seq *q;
    di_status st = handed_off(e, id, &q, err);
    if (st != DI_OK)
        return st;
    const kv_geometry *g = geom(ex);
    const fwd_kv *kv = runner_exec_kv(ex);
    uint32_t kvp = q->len - 1, full = kvp / g->block_tokens;
    uint32_t nd;
    const int32_t *drafts = runner_exec_drafts(ex, id, &nd);
    size_t xb = runner_exec_state_bytes(ex), pb = kv_block_payload_bytes(g);
    uint8_t *keys = malloc((size_t)full * 32 + 1), *slot = malloc(kv->slot_bytes);
    uint8_t *exec = malloc(xb), *partial = kvp % g->block_tokens ? malloc(pb) : NULL;
    size_t n_keys = 0, xn = 0;
    if (!keys || !slot || !exec || (kvp % g->block_tokens && !partial))
        st = di_fail(err, DI_ENOMEM, "handoff of request %llu", (unsigned long long)id);
    if (st == DI_OK)
        st = kvkey_chain(g->model_id, g->block_tokens, q->tokens, kvp, (kvkey *)keys, full,
                         &n_keys, err);
    if (st == DI_OK)
        st = runner_exec_export_state(ex, id, exec, xb, &xn, err);
    if (st == DI_OK) {
        const kern_backend *be = kv->be;
        be->ops.to_host(be->ctx, slot, fwd_kv_slot(kv, (uint32_t)q->state_slot),
                        kv->slot_bytes);
        if (partial)
            be->ops.to_host(be->ctx, partial, fwd_kv_block(kv, q->blocks[full]) + KV_HEADER_BYTES,
                            pb);
        kv_handoff h = {.prompt_len = q->prompt_len, .n_output = q->len - q->prompt_len,
                        .kv_positions = kvp, .n_drafts = nd, .exec_bytes = (uint32_t)xn,
                        .tokens = q->tokens, .drafts = drafts, .block_keys = keys,
                        .partial = partial, .slot = slot, .exec = exec};
        size_t need = kv_handoff_bytes(g, &h);
        st = kv_handoff_write(g, &h, key, dst, cap, err);
        if (st == DI_OK) {
            *bytes = need;
            if (n_full)
                *n_full = full;
        }
    }
    free(keys);
    free(slot);
    free(exec);
    free(partial);
    return st;
}

di_status handoff_block(engine *e, runner_exec *ex, uint64_t id, const kv_handoff *h,
                        uint32_t i, void *dst, size_t cap, di_error *err)
{
    const seq *q;
    di_status st = handed_off(e, id, &q, err);
    if (st != DI_OK)
        return st;
    const kv_geometry *g = geom(ex);
    uint32_t full = h->kv_positions / g->block_tokens;
    if (i >= full || i >= q->n_blocks)
        return di_fail(err, DI_EINVAL, "handoff: block %u beyond the %u full blocks", i, full);
    return kvio_block_export(runner_exec_kv(ex), q->blocks[i], h->block_keys + (size_t)i * 32,
                             (uint64_t)i * g->block_tokens, dst, cap, err);
}

void handoff_requests(const kv_handoff *h, uint64_t id, sched_request *sr, runner_request *rq)
{
    *sr = (sched_request){.id = id, .prompt = h->tokens, .prompt_len = h->prompt_len,
                          .output = h->tokens + h->prompt_len, .output_len = h->n_output,
                          .kv_cached = h->kv_positions, .window_cached = true, .hold = true,
                          .drafts = h->drafts, .n_drafts = h->n_drafts};
    *rq = (runner_request){.id = id, .prompt = h->tokens, .prompt_len = h->prompt_len,
                           .state = h->exec, .state_bytes = h->exec_bytes};
}

di_status handoff_load(fwd_kv *kv, const sched_seq_plan *p, const kv_handoff *h,
                       const void *const *blocks, const size_t *bytes, di_error *err)
{
    const kv_geometry *g = &kv->geom;
    uint32_t full = h->kv_positions / g->block_tokens;
    bool partial = h->kv_positions % g->block_tokens != 0;
    if (p->n_load != h->kv_positions || !p->load_window || p->state_slot < 0 ||
        (uint32_t)p->state_slot >= kv->n_slots || p->n_blocks < full + partial)
        return di_fail(err, DI_EINVAL, "handoff load: the plan entry loads %u positions into %u "
                       "blocks, the handoff has %u", p->n_load, p->n_blocks, h->kv_positions);
    for (uint32_t i = 0; i < full; i++) {
        di_status st = kvio_block_import(kv, p->block_table[i], blocks[i], bytes[i],
                                         h->block_keys + (size_t)i * 32,
                                         (uint64_t)i * g->block_tokens, err);
        if (st != DI_OK) {
            di_error_prefix(err, "handoff block %u: ", i);
            return st;
        }
    }
    const kern_backend *be = kv->be;
    if (partial)
        be->ops.from_host(be->ctx, fwd_kv_block(kv, p->block_table[full]) + KV_HEADER_BYTES,
                          h->partial, kv_block_payload_bytes(g));
    be->ops.from_host(be->ctx, fwd_kv_slot(kv, (uint32_t)p->state_slot), h->slot,
                      kv->slot_bytes);
    return DI_OK;
}
