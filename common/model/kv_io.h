/* kv_io.h: moving KV between a request's state (its paged blocks and its state slot in an
 * fwd_kv) and store objects (the formats of kv_layout.h). Pure: no network, no clock; the store
 * client (common/net/kv_client.h) moves the objects, these functions make and check them.
 *
 * BLOCK object for positions f .. f+127 (f a multiple of block_tokens): a kv_header
 * (KV_BLOCK_MAGIC, token_count = block_tokens, first_position = f, key, model id, checksum of
 * header and payload) followed by the block's payload exactly as the forward wrote it in the
 * pool (each pool block keeps a header-sized gap in front of its payload).
 *
 * WINDOW STATE object at position p: a kv_header (KV_WINDOW_MAGIC, token_count = first_position
 * = p, key, ring size) followed by the rings of layers [0, yoco_boundary), then the compressor
 * pending state, as they sit in the slot (state.h). What a request resuming at p reads of them:
 *  - ring entries of positions [p - window + 1, p): the window of the rows from p on;
 *  - pending compressor tokens of the group p falls in: none when p is a multiple of
 *    block_tokens (every ratio divides it, so no group straddles the point).
 * The export keeps ring entries of positions [max(0, p - window), p) and zeroes the others
 * (positions of the slot's history, or written after p), and zeroes the pending state at a
 * multiple of block_tokens, so the object is a function of the KV it stands for only: two
 * writers of the same prefix produce the same bytes. The export is valid once the slot has
 * processed every position below p and none at or beyond p + (ring_positions - window): the
 * spare ring slots are what lets a decode step overshoot a boundary by up to nextn positions.
 *
 * The layers at and above the YOCO boundary are not in the object. A reader that resumes at p
 * runs them only on prompt rows whose windows never reach below p: prefill with YOCO truncation
 * (compact or mask) keeps their windows inside the last keep_tokens rows, and a prefix hit is
 * capped at prompt_len - max(ring_positions, keep_tokens) (prefix.h), so every row those layers
 * read is computed again after the hit. That is the explainer's "bounded replay" of the decoder
 * half, and why the stored region suffices for an exact resume.
 *
 * Imports check before they write anything: kv_object_verify (magic, version, sizes, model id,
 * ring size, checksum of header and payload) and what the caller expects (key, first position,
 * token count), so a sound object stored under another key or for another position is refused
 * with DI_ECORRUPT naming the field. A window import also zeroes the rest of the slot (rings
 * at and above the boundary, draft rings): nothing of the slot's previous owner survives.
 */
#ifndef DI_MODEL_KV_IO_H
#define DI_MODEL_KV_IO_H

#include <stddef.h>
#include <stdint.h>

#include "common/kvfmt/kv_layout.h"
#include "common/kvfmt/kv_object.h"
#include "common/model/state.h"
#include "common/util/status.h"

/* Writes block `block` of kv as the store object for positions first_position .. +127 into dst
 * (cap >= kv_block_bytes). key: the chain hash it is stored under.
 * DI_OK (dst written); DI_EINVAL (block out of range, cap too small, first_position not a
 * multiple of block_tokens, NULL pointers); nothing written on failure. */
di_status kvio_block_export(const fwd_kv *kv, uint32_t block, const uint8_t key[32],
                            uint64_t first_position, void *dst, size_t cap, di_error *err);


/* kvio_block_check, then copies the payload into block `block` of kv. DI_OK; DI_ECORRUPT and
 * DI_EINVAL as above (and block out of range) with the block untouched. */
di_status kvio_block_import(fwd_kv *kv, uint32_t block, const void *obj, size_t bytes,
                            const uint8_t key[32], uint64_t first_position, di_error *err);

/* Writes the window state at `position` of state slot `slot` into dst (cap >=
 * kv_window_state_bytes). DI_OK (dst written); DI_EINVAL (slot out of range, cap too small,
 * position 0, NULL pointers); nothing written on failure. */
di_status kvio_window_export(const fwd_kv *kv, uint32_t slot, uint64_t position,
                             const uint8_t key[32], void *dst, size_t cap, di_error *err);


/* kvio_window_check, then sets state slot `slot`: the stored rings and pending state from the
 * object, every other byte zero. DI_OK; DI_ECORRUPT, DI_EINVAL with the slot untouched. */
di_status kvio_window_import(fwd_kv *kv, uint32_t slot, const void *obj, size_t bytes,
                             const uint8_t key[32], uint64_t position, di_error *err);

/* Zeroes state slot `slot` (a bounded replay starts from no window state). slot < n_slots
 * (asserted). */
void kvio_slot_clear(fwd_kv *kv, uint32_t slot);

#endif
