/* kv_handoff.h: the HANDOFF object, what a prefill (PROMPT) engine leaves for the decode
 * (COMPLETION) engine that continues a request (DESIGN.md §3; key: kvkey_handoff).
 *
 * The full blocks of the prompt are in the store under their chain keys already; the handoff
 * names them and carries what is not there: the tokens so far, the KV of the partial last
 * block, the request's whole state slot (every window ring, draft rings, compressor pending
 * state: a decode engine does no replay), the pending drafts and an opaque executor state
 * (sampler stream, draft logits), so that decode continues exactly where prefill stopped.
 *
 * Layout: a kv_header (KV_HANDOFF_MAGIC; token_count = prompt_len + n_output; first_position =
 * kv_positions; key; ring size; checksum of header and payload), then, each section padded to
 * 8 bytes:
 *   kv_handoff_info (64 bytes: the counts below, little-endian)
 *   int32 tokens[prompt_len + n_output]     the prompt, then the tokens generated so far
 *   int32 drafts[n_drafts]                  drafts the first decode step checks
 *   uint8 block_keys[kv_positions / 128][32] chain keys of the full blocks (kv_keys.h)
 *   uint8 partial[kv_block_payload_bytes]   positions [128 * n_full, kv_positions), present
 *                                           only when kv_positions % 128 != 0
 *   uint8 slot[kv_state_slot_bytes]         the request's state slot as the forward left it
 *   uint8 exec[exec_bytes]                  the executor's state
 * The object is a function of its inputs only: padding and reserved bytes are zero.
 */
#ifndef DI_KVFMT_KV_HANDOFF_H
#define DI_KVFMT_KV_HANDOFF_H

#include <stddef.h>
#include <stdint.h>

#include "common/kvfmt/kv_layout.h"
#include "common/util/status.h"

#define KV_HANDOFF_MAX_TOKENS (1u << 24)
#define KV_HANDOFF_MAX_DRAFTS 16u
#define KV_HANDOFF_MAX_EXEC (1u << 26)

/* A handoff's contents. For kv_handoff_write the pointers are the caller's; kv_handoff_read
 * sets them into the object it read. */
typedef struct kv_handoff {
    uint32_t prompt_len;       /* prompt tokens; >= 1 */
    uint32_t n_output;         /* tokens generated so far (the first token: 1) */
    uint32_t kv_positions;     /* positions whose KV exists: [1, prompt_len + n_output] */
    uint32_t n_drafts;         /* <= KV_HANDOFF_MAX_DRAFTS */
    uint32_t exec_bytes;       /* <= KV_HANDOFF_MAX_EXEC */
    const int32_t *tokens;     /* [prompt_len + n_output] */
    const int32_t *drafts;     /* [n_drafts] */
    const uint8_t *block_keys; /* [kv_positions / block_tokens][32] */
    const uint8_t *partial;    /* [kv_block_payload_bytes] when kv_positions % block_tokens,
                                  else NULL */
    const uint8_t *slot;       /* [kv_state_slot_bytes] */
    const uint8_t *exec;       /* [exec_bytes]; may be NULL when 0 */
} kv_handoff;

/* Bytes of the object for h's counts, header included; 0 when a count is out of range. */
size_t kv_handoff_bytes(const kv_geometry *g, const kv_handoff *h);

/* Writes the object into dst (cap >= kv_handoff_bytes). DI_OK; DI_EINVAL (a count out of
 * range, a required pointer NULL, cap too small: the message names it); nothing written on
 * failure. */
di_status kv_handoff_write(const kv_geometry *g, const kv_handoff *h, const uint8_t key[32],
                           void *dst, size_t cap, di_error *err);

/* Verifies obj (bytes long, 8-byte aligned) as the handoff stored under key for this
 * geometry (magic, version, sizes, model id, ring size, checksum, key, counts against the size)
 * and points *out into it. DI_OK; DI_ECORRUPT naming what failed; DI_EINVAL (NULL arguments,
 * an unaligned object). *out written only on success. */
di_status kv_handoff_read(const kv_geometry *g, const void *obj, size_t bytes,
                          const uint8_t key[32], kv_handoff *out, di_error *err);

#endif
