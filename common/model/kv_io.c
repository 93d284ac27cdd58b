#include "common/model/kv_io.h"

#include <assert.h>
#include <string.h>

/* Backend memory is written from this (immutable) page when a slot is zeroed. */
static const uint8_t k_zeros[65536];

static void backend_zero(const kern_backend *be, uint8_t *dst, size_t n)
{
    while (n) {
        size_t k = n < sizeof k_zeros ? n : sizeof k_zeros;
        be->ops.from_host(be->ctx, dst, k_zeros, k);
        dst += k;
        n -= k;
    }
}

/* The slot region of the window state: rings of layers [0, boundary) at offset 0, then the
 * compressor pending state after every ring (state.h). */
static size_t stored_ring_bytes(const kv_geometry *g)
{
    return (size_t)g->yoco_boundary * kv_ring_bytes(g);
}

static size_t compressor_offset(const kv_geometry *g)
{
    return (size_t)(g->n_layers + g->n_draft_stages) * kv_ring_bytes(g);
}

/* ---- blocks ---- */

di_status kvio_block_export(const fwd_kv *kv, uint32_t block, const uint8_t key[32],
                            uint64_t first_position, void *dst, size_t cap, di_error *err)
{
    if (!kv || !key || !dst)
        return di_fail(err, DI_EINVAL, "block export: storage, key and buffer are required");
    const kv_geometry *g = &kv->geom;
    if (block >= kv->n_blocks)
        return di_fail(err, DI_EINVAL, "block export: block %u outside the pool of %u", block,
                       kv->n_blocks);
    if (cap < kv->block_bytes)
        return di_fail(err, DI_EINVAL, "block export: buffer of %zu bytes, the object has %zu",
                       cap, kv->block_bytes);
    if (first_position % g->block_tokens != 0)
        return di_fail(err, DI_EINVAL, "block export: first position %llu is not a multiple "
                       "of %u", (unsigned long long)first_position, g->block_tokens);
    uint8_t *out = dst;
    size_t payload = kv->block_bytes - KV_HEADER_BYTES;
    kv->be->ops.to_host(kv->be->ctx, out + KV_HEADER_BYTES,
                        fwd_kv_block(kv, block) + KV_HEADER_BYTES, payload);
    kv_header h;
    kv_header_fill(&h, KV_BLOCK_MAGIC, g, key, g->block_tokens, first_position,
                   out + KV_HEADER_BYTES, payload);
    memcpy(out, &h, sizeof h);
    return DI_OK;
}

di_status kvio_block_import(fwd_kv *kv, uint32_t block, const void *obj, size_t bytes,
                            const uint8_t key[32], uint64_t first_position, di_error *err)
{
    if (!kv)
        return di_fail(err, DI_EINVAL, "block import: storage is required");
    if (block >= kv->n_blocks)
        return di_fail(err, DI_EINVAL, "block import: block %u outside the pool of %u", block,
                       kv->n_blocks);
    di_status st = kvio_block_check(&kv->geom, obj, bytes, key, first_position, err);
    if (st != DI_OK)
        return st;
    kv->be->ops.from_host(kv->be->ctx, fwd_kv_block(kv, block) + KV_HEADER_BYTES,
                          (const uint8_t *)obj + KV_HEADER_BYTES, bytes - KV_HEADER_BYTES);
    return DI_OK;
}

/* ---- window states ---- */

/* Zeroes the ring entries of the stored layers that hold no position of [lo, p), lo =
 * max(0, p - window); p - lo <= window < ring_positions, so those positions have distinct
 * ring slots. */
static void keep_window_entries(const kv_geometry *g, uint8_t *rings, uint64_t p)
{
    uint64_t lo = p > g->window ? p - g->window : 0;
    uint32_t R = g->ring_positions, base = (uint32_t)(lo % R);
    size_t eb = kv_ring_entry_bytes(g), rb = kv_ring_bytes(g);
    for (uint32_t s = 0; s < R; s++) {
        uint32_t d = (s + R - base) % R; /* position lo + d would sit in slot s */
        if (d < p - lo)
            continue;
        for (uint32_t l = 0; l < g->yoco_boundary; l++)
            memset(rings + (size_t)l * rb + (size_t)s * eb, 0, eb);
    }
}

di_status kvio_window_export(const fwd_kv *kv, uint32_t slot, uint64_t position,
                             const uint8_t key[32], void *dst, size_t cap, di_error *err)
{
    if (!kv || !key || !dst)
        return di_fail(err, DI_EINVAL, "window export: storage, key and buffer are required");
    const kv_geometry *g = &kv->geom;
    size_t bytes = kv_window_state_bytes(g);
    if (slot >= kv->n_slots)
        return di_fail(err, DI_EINVAL, "window export: slot %u outside the pool of %u", slot,
                       kv->n_slots);
    if (cap < bytes)
        return di_fail(err, DI_EINVAL, "window export: buffer of %zu bytes, the object has %zu",
                       cap, bytes);
    if (position == 0 || position > UINT32_MAX)
        return di_fail(err, DI_EINVAL, "window export: position %llu outside [1, 2^32)",
                       (unsigned long long)position);
    uint8_t *out = dst, *pay = out + KV_HEADER_BYTES;
    const uint8_t *src = fwd_kv_slot(kv, slot);
    size_t rings = stored_ring_bytes(g), comp = kv_compressor_state_bytes(g);
    kv->be->ops.to_host(kv->be->ctx, pay, src, rings);
    if (comp)
        kv->be->ops.to_host(kv->be->ctx, pay + rings, src + compressor_offset(g), comp);
    keep_window_entries(g, pay, position);
    if (position % g->block_tokens == 0)
        memset(pay + rings, 0, comp); /* no group straddles the point: nothing pending */
    kv_header h;
    kv_header_fill(&h, KV_WINDOW_MAGIC, g, key, (uint32_t)position, position, pay,
                   rings + comp);
    memcpy(out, &h, sizeof h);
    return DI_OK;
}

di_status kvio_window_import(fwd_kv *kv, uint32_t slot, const void *obj, size_t bytes,
                             const uint8_t key[32], uint64_t position, di_error *err)
{
    if (!kv)
        return di_fail(err, DI_EINVAL, "window import: storage is required");
    if (slot >= kv->n_slots)
        return di_fail(err, DI_EINVAL, "window import: slot %u outside the pool of %u", slot,
                       kv->n_slots);
    const kv_geometry *g = &kv->geom;
    di_status st = kvio_window_check(g, obj, bytes, key, position, err);
    if (st != DI_OK)
        return st;
    const uint8_t *pay = (const uint8_t *)obj + KV_HEADER_BYTES;
    uint8_t *dst = fwd_kv_slot(kv, slot);
    size_t rings = stored_ring_bytes(g), comp = kv_compressor_state_bytes(g);
    kvio_slot_clear(kv, slot);
    kv->be->ops.from_host(kv->be->ctx, dst, pay, rings);
    if (comp)
        kv->be->ops.from_host(kv->be->ctx, dst + compressor_offset(g), pay + rings, comp);
    return DI_OK;
}

void kvio_slot_clear(fwd_kv *kv, uint32_t slot)
{
    assert(kv && slot < kv->n_slots);
    backend_zero(kv->be, fwd_kv_slot(kv, slot), kv->slot_bytes);
}
