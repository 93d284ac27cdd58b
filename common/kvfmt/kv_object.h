/* kv_object.h: checks that a store object (a block or a window state, kv_layout.h) is the one
 * a reader asked for: sound (kv_object_verify: magic, version, sizes, model id, ring size,
 * checksum of header and payload) and naming the expected key, first position and token
 * count. A sound object stored under another key or for another position is refused with
 * DI_ECORRUPT naming the field. Part of the KV formats leaf module (common/kvfmt): no model,
 * no storage; common/model/kv_io.h moves checked objects into a forward's KV.
 */
#ifndef DI_KVFMT_KV_OBJECT_H
#define DI_KVFMT_KV_OBJECT_H

#include <stddef.h>
#include <stdint.h>

#include "common/kvfmt/kv_layout.h"
#include "common/util/status.h"

/* Checks that obj (bytes long) is a sound block object for this geometry holding positions
 * first_position .. +127 under key. DI_OK; DI_ECORRUPT naming what failed; DI_EINVAL (NULL). */
di_status kvio_block_check(const kv_geometry *g, const void *obj, size_t bytes,
                           const uint8_t key[32], uint64_t first_position, di_error *err);

/* Checks that obj is a sound window state of this geometry at `position` under key. DI_OK;
 * DI_ECORRUPT naming what failed; DI_EINVAL (NULL). */
di_status kvio_window_check(const kv_geometry *g, const void *obj, size_t bytes,
                            const uint8_t key[32], uint64_t position, di_error *err);

#endif
