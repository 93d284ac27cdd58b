#include "common/model/state.h"

#include <assert.h>
#include <stdlib.h>

size_t state_ring_offset(const kv_geometry *g, uint32_t layer)
{
    assert(layer < g->n_layers);
    return (size_t)layer * kv_ring_bytes(g);
}

size_t state_draft_ring_offset(const kv_geometry *g, uint32_t stage)
{
    assert(stage < g->n_draft_stages);
    return (size_t)(g->n_layers + stage) * kv_ring_bytes(g);
}

uint32_t state_compressor_tokens(const kv_geometry *g, uint32_t owner)
{
    assert(owner < g->n_owners && g->owner_ratio[owner] > 1);
    return g->owner_ratio[owner] - 1 + (g->ring_positions - g->window);
}

size_t state_compressor_offset(const kv_geometry *g, uint32_t owner)
{
    size_t off = (size_t)(g->n_layers + g->n_draft_stages) * kv_ring_bytes(g);
    for (uint32_t k = 0; k < owner; k++)
        if (g->owner_ratio[k] > 1)
            off += (size_t)state_compressor_tokens(g, k) * 2 * g->head_dim * sizeof(float);
    return off;
}

di_status fwd_kv_create(const kv_geometry *g, const kern_backend *be, uint32_t n_blocks,
                        uint32_t n_slots, fwd_kv **out, di_error *err)
{
    if (!g || !be || !out)
        return di_fail(err, DI_EINVAL, "KV storage: geometry, backend and output are required");
    if (n_blocks == 0 || n_slots == 0)
        return di_fail(err, DI_EINVAL, "KV storage needs at least one block and one slot "
                       "(got %u blocks, %u slots)", n_blocks, n_slots);
    size_t bb = kv_block_bytes(g), sb = kv_state_slot_bytes(g);
    if ((double)bb * n_blocks + (double)sb * n_slots > 1099511627776.0)
        return di_fail(err, DI_EINVAL, "KV storage of %u blocks and %u slots exceeds 1 TiB",
                       n_blocks, n_slots);
    fwd_kv *kv = calloc(1, sizeof(*kv));
    if (!kv)
        return di_fail(err, DI_ENOMEM, "KV storage");
    kv->geom = *g;
    kv->be = be;
    kv->n_blocks = n_blocks;
    kv->n_slots = n_slots;
    kv->block_bytes = bb;
    kv->slot_bytes = sb;
    kv->blocks = be->ops.alloc(be->ctx, bb * n_blocks);
    kv->slots = be->ops.alloc(be->ctx, sb * n_slots);
    if (!kv->blocks || !kv->slots) {
        fwd_kv_free(kv);
        return di_fail(err, DI_ENOMEM, "KV storage: %u blocks of %zu bytes and %u slots of "
                       "%zu bytes", n_blocks, bb, n_slots, sb);
    }
    *out = kv;
    return DI_OK;
}

void fwd_kv_free(fwd_kv *kv)
{
    if (!kv)
        return;
    if (kv->blocks)
        kv->be->ops.free(kv->be->ctx, kv->blocks);
    if (kv->slots)
        kv->be->ops.free(kv->be->ctx, kv->slots);
    free(kv);
}

uint8_t *fwd_kv_block(const fwd_kv *kv, uint32_t b)
{
    assert(b < kv->n_blocks);
    return kv->blocks + (size_t)b * kv->block_bytes;
}

uint8_t *fwd_kv_slot(const fwd_kv *kv, uint32_t s)
{
    assert(s < kv->n_slots);
    return kv->slots + (size_t)s * kv->slot_bytes;
}
