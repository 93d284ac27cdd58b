/* synth.h: synthetic KV objects with valid headers, for tests, the benchmark and kvdemo.
 * The payload is a pure function of (key, salt), so a reader can rebuild what it expects. */
#ifndef DI_KVSTORE_SYNTH_H
#define DI_KVSTORE_SYNTH_H

#include <stddef.h>
#include <stdint.h>

#include "common/kvfmt/kv_layout.h"
#include "common/kvfmt/kv_keys.h"

/* Fills obj (bytes long, header included): splitmix64 payload seeded by the key's first 8
 * bytes and salt, then a kv_header (magic, g's model id, the key, token_count,
 * first_position, checksum). bytes must exceed KV_HEADER_BYTES. */
void kvsynth_object(void *obj, size_t bytes, uint32_t magic, const kv_geometry *g,
                    const kvkey *key, uint64_t salt, uint32_t token_count,
                    uint64_t first_position);

#endif
