/* state.h: where the forward keeps KV between steps: the paged block pool and the state slots
 * (byte formats in kv_layout.h), and the layout inside one state slot.
 *
 * A state slot holds, in this order:
 *   rings of layers 0 .. n_layers-1      each ring_positions entries of kv_ring_entry_bytes
 *   rings of draft stages 0 .. n_mtp-1   same
 *   pending tokens of each ratio>1 owner  (ratio - 1 + spare) tokens of fp32 a[head_dim] then
 *                                         g[head_dim]; token at position p in slot
 *                                         p mod (ratio - 1 + spare), spare = ring - window
 * so the window state the store keeps (rings of layers below yoco_boundary, then the pending
 * tokens) is two contiguous pieces of the slot. Position p of a layer lives in ring entry
 * p mod ring_positions; entry j of an owner with ratio r lives in block table entry
 * j / (128 / r) at offset j % (128 / r) (kv_owner_main_offset / kv_owner_index_offset).
 *
 * The pool is plain memory owned by fwd_kv; the engine hands out block ids and slot ids
 * (block 0 is a valid block here: the engine never hands it out, the forward does not care).
 */
#ifndef DI_MODEL_STATE_H
#define DI_MODEL_STATE_H

#include <stddef.h>
#include <stdint.h>

#include "common/kvfmt/kv_layout.h"
#include "common/util/status.h"
#include "kernels/kernels.h"

/* ---- slot layout ---- */

/* Byte offset of layer l's ring (l < n_layers) inside a state slot. */
size_t state_ring_offset(const kv_geometry *g, uint32_t layer);
/* Byte offset of draft stage s's ring. */
size_t state_draft_ring_offset(const kv_geometry *g, uint32_t stage);
/* Byte offset of the pending tokens of owner k (its ratio must be > 1). */
size_t state_compressor_offset(const kv_geometry *g, uint32_t owner);
/* Pending-token capacity of owner k: ratio - 1 + (ring_positions - window). */
uint32_t state_compressor_tokens(const kv_geometry *g, uint32_t owner);

/* Block-table entry and offset of compressed entry j of owner k. */
static inline uint32_t state_entry_block(const kv_geometry *g, uint32_t owner, uint64_t j)
{
    return (uint32_t)(j / kv_owner_entries_per_block(g, owner));
}
static inline uint32_t state_entry_offset(const kv_geometry *g, uint32_t owner, uint64_t j)
{
    return (uint32_t)(j % kv_owner_entries_per_block(g, owner));
}

/* ---- storage ---- */

/* The KV storage of one model instance. Written by the forward's ops; blocks and slots are
 * addressed by the ids of the engine's step plan. */
typedef struct fwd_kv {
    kv_geometry geom;           /* the formats (copied from the model) */
    const kern_backend *be;     /* whose memory holds the pool */
    uint8_t *blocks;            /* [n_blocks, block_bytes], backend memory */
    uint32_t n_blocks;
    size_t block_bytes;         /* kv_block_bytes */
    uint8_t *slots;             /* [n_slots, slot_bytes], backend memory */
    uint32_t n_slots;
    size_t slot_bytes;          /* kv_state_slot_bytes */
} fwd_kv;

/* Allocates n_blocks blocks and n_slots state slots, zeroed. DI_EINVAL (zero counts, sizes
 * beyond 2^40 bytes), DI_ENOMEM. *out set only on success. */
di_status fwd_kv_create(const kv_geometry *g, const kern_backend *be, uint32_t n_blocks,
                        uint32_t n_slots, fwd_kv **out, di_error *err);
void fwd_kv_free(fwd_kv *kv); /* NULL-safe */

/* Address of block b / slot s. b < n_blocks, s < n_slots (asserted). */
uint8_t *fwd_kv_block(const fwd_kv *kv, uint32_t b);
uint8_t *fwd_kv_slot(const fwd_kv *kv, uint32_t s);

#endif
