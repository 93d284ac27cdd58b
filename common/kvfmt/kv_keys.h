/* kv_keys.h: the keys of KV objects in the store (DESIGN.md §5).
 *
 * Block i of a prompt is keyed by the hash chain
 *
 *     h_i = SHA-256( h_{i-1} || model_id as u64 little-endian || the block's token ids as int32
 *                    little-endian ),            h_{-1} = 32 zero bytes,
 *
 * so a key names the whole prefix up to the end of its block, for one model. The window state
 * at position 128·k (k >= 1) is keyed by the chain hash of the k blocks before it, h_{k-1}: the
 * same bytes as the key of block k-1, stored in a different object class. Handoff objects use
 * keys chosen by the writer (kvkey_handoff derives one from a request id).
 *
 * The router, the engines, the store and di-kvctl all compute keys with these functions.
 */
#ifndef DI_KVFMT_KV_KEYS_H
#define DI_KVFMT_KV_KEYS_H

#include <stddef.h>
#include <stdint.h>

#include "common/kvfmt/kv_layout.h"
#include "common/util/status.h"

#define KVKEY_BYTES 32u

/* The object classes of the store. A key names an object only together with its class: the
 * window state at 128·k shares its key bytes with block k-1. */
typedef enum kvkey_class {
    KVKEY_BLOCK = 0,   /* 128-token block of KV (kv_block_bytes) */
    KVKEY_WINDOW = 1,  /* window state at a multiple of 128 (kv_window_state_bytes) */
    KVKEY_HANDOFF = 2, /* prefill -> decode handoff, variable size, short-lived */
} kvkey_class;
#define KVKEY_CLASS_COUNT 3

/* "block", "window", "handoff"; "?" for other values. */
const char *kvkey_class_name(int cls);
/* Parses a class name; -1 when unknown. */
int kvkey_class_parse(const char *s);

/* One object key: a SHA-256 digest. */
typedef struct kvkey {
    uint8_t b[KVKEY_BYTES]; /* digest bytes, in SHA-256 output order */
} kvkey;

/* Key of one block: SHA-256(prev || model_id || tokens). prev NULL means h_{-1} (zeros).
 * n_tokens is the block's token count (the store's block_tokens, 128).
 * Returns DI_OK (out written), DI_EINVAL (tokens NULL or n_tokens 0), DI_EINTERNAL (OpenSSL
 * failure; out untouched). */
di_status kvkey_block(const kvkey *prev, uint64_t model_id, const int32_t *tokens,
                      uint32_t n_tokens, kvkey *out, di_error *err);

/* Keys of every full block of a prompt: h_0 .. h_{m-1} with m = n_tokens / block_tokens (a
 * partial last block has no key). Writes min(m, max_keys) keys and the number written in
 * *n_keys. Returns DI_OK, DI_EINVAL (block_tokens 0, NULL pointers with a non-zero count),
 * DI_EINTERNAL (OpenSSL). On failure keys and *n_keys are untouched. */
di_status kvkey_chain(uint64_t model_id, uint32_t block_tokens, const int32_t *tokens,
                      size_t n_tokens, kvkey *keys, size_t max_keys, size_t *n_keys,
                      di_error *err);

/* Key of a handoff object: SHA-256("di-handoff" || model_id || request id bytes).
 * Returns DI_OK, DI_EINVAL (id NULL or empty), DI_EINTERNAL. */
di_status kvkey_handoff(uint64_t model_id, const char *request_id, kvkey *out, di_error *err);

/* Verifies a stored object: its kv_header (magic of the class, version, size, model id,
 * checksum of the payload: kv_object_verify) and that the header names `key`. Blocks carry the
 * block magic, window states the window magic; a handoff its own (kv_handoff.h) or either.
 * DI_OK, or DI_ECORRUPT with what failed. */
di_status kvkey_object_verify(int cls, const kvkey *key, const void *obj, size_t bytes,
                              const kv_geometry *g, di_error *err);

/* The same while copying the object from src to dst in one pass (di_hash64_copy): on return
 * dst holds the bytes that were verified, whatever happens to src meanwhile. dst is written
 * even on failure (its content is then unspecified). */
di_status kvkey_object_copy_verify(int cls, const kvkey *key, void *dst, const void *src,
                                   size_t bytes, const kv_geometry *g, di_error *err);

/* Lower-case hex, 64 characters and a NUL. */
void kvkey_hex(const kvkey *k, char out[2 * KVKEY_BYTES + 1]);

/* Parses 64 hex digits (either case). DI_EINVAL with the offending position otherwise. */
di_status kvkey_parse_hex(const char *s, kvkey *out, di_error *err);

#endif
