/* kv_layout.h: the byte formats of KV state shared by the engine, the store and transfers
 * (DESIGN.md §5, MODEL.md §3.3). Part of common/kvfmt, the KV formats leaf module: it depends
 * on common/util only.
 *
 * Three objects:
 *
 *  - A BLOCK holds 128 token positions of long-range KV for the whole model: for every KV
 *    source ("owner") layer, its compressed main-KV entries then its index-key entries, after a
 *    128-byte header. An owner with compression ratio r has 128 / r entries per block.
 *      main entry  = head_dim/2 bytes of packed E2M1 + head_dim/16 E4M3 scales   (288 for 512)
 *      index entry = index_head_dim/2 bytes of E2M1 + index_head_dim/32 UE8M0    (68 for 128)
 *    V4.1-Flash: 3 owners at r=2 and 1 at r=1 -> 3*64*356 + 128*356 = 113,920 bytes of
 *    payload, 114,048 with the header, 891 bytes per token.
 *
 *  - A STATE SLOT is a running sequence's fixed state: one window ring per layer and per draft
 *    stage (ring_positions entries of head_dim E4M3 + head_dim/32 UE8M0 = 528 bytes), and the
 *    pending-token state of every ratio>1 compressor (fp32 a[head_dim], g[head_dim] per pending
 *    token, ratio-1 tokens at most). Position p lives in ring slot p mod ring_positions.
 *
 *  - A WINDOW STATE is what the store keeps at a position p (p % 128 == 0, or any p for a
 *    prefill->decode handoff): the header, the rings of layers [0, yoco_boundary) (the "stored
 *    region"; the later layers are rebuilt by bounded replay of 128 tokens), then the
 *    compressor pending state. At multiples of 128 the pending state is empty (groups never
 *    straddle a block) and stored as zeros.
 *
 * Layout inside a ring entry and a main-KV entry: values first, then scales. Everything is
 * little-endian. The header carries a checksum of itself and the payload, verified on every
 * read.
 */
#ifndef DI_KVFMT_KV_LAYOUT_H
#define DI_KVFMT_KV_LAYOUT_H

#include <stddef.h>
#include <stdint.h>

#include "common/util/status.h"

#define KV_BLOCK_TOKENS 128u
#define KV_HEADER_BYTES 128u
#define KV_MAX_OWNERS 16u
#define KV_FORMAT_VERSION 2u /* 2: the checksum covers the header too */
#define KV_BLOCK_MAGIC 0x424b4944u  /* "DIKB" little-endian */
#define KV_WINDOW_MAGIC 0x574b4944u /* "DIKW" */
#define KV_HANDOFF_MAGIC 0x484b4944u /* "DIKH": kv_handoff.h */

/* YOCO modes of the prefill (MODEL.md; fwd_yoco has the same values). The mode changes the KV
 * bytes of the layers above the YOCO boundary, so it is part of the KV id. Every engine uses
 * KV_YOCO_DEFAULT unless told otherwise: compact, the mode a store hit needs for an exact
 * resume (the window state holds only the layers below the boundary). */
#define KV_YOCO_OFF 0u
#define KV_YOCO_COMPACT 1u
#define KV_YOCO_MASK 2u
#define KV_YOCO_DEFAULT KV_YOCO_COMPACT

/* "off", "compact", "mask", or "?". */
const char *kv_yoco_name(uint32_t yoco);
/* The id KV headers, checksums and keys carry: the model id (config and weights) mixed with
 * everything else that changes the KV bytes, the YOCO mode and KV_FORMAT_VERSION. */
uint64_t kv_model_id(uint64_t model_id, uint32_t yoco);

/* What the KV formats need to know about a model. Filled from a model config
 * (model_config_kv_geometry, or kv_geometry_v41_flash for the shipped v41-flash config, both in
 * common/model/config.h): this module knows no model. */
typedef struct kv_geometry {
    uint32_t block_tokens;                 /* token positions per block; 128 */
    uint32_t head_dim;                     /* main KV width (numbers); 512; multiple of 32 */
    uint32_t index_head_dim;               /* index key width (numbers); 128; multiple of 32 */
    uint32_t window;                       /* sliding window (positions); 128 */
    uint32_t ring_positions;               /* window + max(backtracking, nextn + 1); 134 */
    uint32_t n_layers;                     /* main-model layers; 40 */
    uint32_t n_draft_stages;               /* draft (DSpark) stages with their own rings; 3 */
    uint32_t n_owners;                     /* KV source layers; 4 */
    uint32_t owner_layer[KV_MAX_OWNERS];   /* their layer ids, ascending; 2, 8, 14, 20 */
    uint32_t owner_ratio[KV_MAX_OWNERS];   /* their compression ratios; 2, 2, 2, 1 */
    uint32_t yoco_boundary;                /* rings of layers below this are persisted; 20 */
    uint64_t model_id;                     /* kv_model_id of the model and YOCO mode that
                                              write the KV */
} kv_geometry;

/* The on-disk/on-wire header of blocks and window states (exactly 128 bytes). */
typedef struct kv_header {
    uint32_t magic;          /* KV_BLOCK_MAGIC or KV_WINDOW_MAGIC */
    uint16_t version;        /* KV_FORMAT_VERSION */
    uint16_t header_bytes;   /* KV_HEADER_BYTES */
    uint32_t payload_bytes;  /* bytes after the header */
    uint32_t token_count;    /* block: valid positions (1..128); window: position p */
    uint64_t model_id;       /* kv_geometry.model_id of the writer */
    uint64_t first_position; /* block: absolute position of its first token; window: p */
    uint8_t key[32];         /* the chain hash the object is stored under */
    uint64_t checksum;       /* kv_checksum_combine(header with this field 0, di_hash64 of the
                              * payload seeded with model_id): every header field and every
                              * payload byte */
    uint32_t ring_positions; /* window: ring size of the writer (reader must match) */
    uint8_t reserved[52];    /* zero */
} kv_header;

_Static_assert(sizeof(kv_header) == KV_HEADER_BYTES, "kv_header must be 128 bytes");

/* Ring size for a window, nextn and optional extra backtracking (0 = none):
 * window + max(backtracking, nextn + 1). */
uint32_t kv_ring_positions_for(uint32_t window, uint32_t nextn, uint32_t backtracking);

/* Checks widths, ratios (each divides block_tokens), owner order and boundary.
 * DI_EINVAL with the failed condition. */
di_status kv_geometry_validate(const kv_geometry *g, di_error *err);

/* ---- entry sizes (bytes) ---- */
size_t kv_main_entry_bytes(const kv_geometry *g);  /* 288 */
size_t kv_index_entry_bytes(const kv_geometry *g); /* 68 */
size_t kv_ring_entry_bytes(const kv_geometry *g);  /* 528 */

/* ---- blocks ---- */
size_t kv_block_payload_bytes(const kv_geometry *g); /* 113,920 */
size_t kv_block_bytes(const kv_geometry *g);         /* 114,048 */
uint32_t kv_owner_entries_per_block(const kv_geometry *g, uint32_t owner);
/* Byte offset (from the block start, header included) of owner's main-KV / index-key entry e. */
size_t kv_owner_main_offset(const kv_geometry *g, uint32_t owner, uint32_t entry);
size_t kv_owner_index_offset(const kv_geometry *g, uint32_t owner, uint32_t entry);
/* ceil(tokens / block_tokens). */
uint64_t kv_blocks_for_tokens(const kv_geometry *g, uint64_t tokens);

/* ---- state slots and window states ---- */
size_t kv_ring_bytes(const kv_geometry *g);              /* one layer: 134 * 528 = 70,752 */
size_t kv_compressor_state_bytes(const kv_geometry *g);  /* all ratio>1 owners' pending tokens */
size_t kv_state_slot_bytes(const kv_geometry *g);        /* every ring + compressor state */
size_t kv_window_state_payload_bytes(const kv_geometry *g);
size_t kv_window_state_bytes(const kv_geometry *g);      /* header + stored rings + compressor */
/* Slot index of position p in a ring. */
static inline uint32_t kv_ring_slot(const kv_geometry *g, uint64_t position)
{
    return (uint32_t)(position % g->ring_positions);
}

/* ---- headers ---- */
/* Fills hdr for an object whose payload is `payload` (payload_bytes long) and computes its
 * checksum. key may be NULL (zeros). */
void kv_header_fill(kv_header *hdr, uint32_t magic, const kv_geometry *g, const uint8_t key[32],
                    uint32_t token_count, uint64_t first_position, const void *payload,
                    size_t payload_bytes);
/* Verifies an object of `bytes` bytes (header then payload): magic, version, sizes, model id
 * and checksum. DI_ECORRUPT (with what failed) on any mismatch. */
di_status kv_object_verify(const void *object, size_t bytes, uint32_t magic, const kv_geometry *g,
                           di_error *err);
/* kv_object_verify in two steps, for readers that checksum the payload while copying it
 * (di_hash64_copy, seeded with g->model_id): kv_header_check does every check but the
 * checksum; kv_checksum_check compares the header's checksum with the one computed. Same
 * codes and messages as kv_object_verify. */
di_status kv_header_check(const void *object, size_t bytes, uint32_t magic, const kv_geometry *g,
                          di_error *err);
di_status kv_checksum_check(const void *object, uint64_t payload_sum, di_error *err);
/* The stored checksum for a header (its checksum field ignored) and a payload checksum
 * (di_hash64 of the payload seeded with model_id): a flipped header field fails it too. */
uint64_t kv_checksum_combine(const kv_header *hdr, uint64_t payload_sum);

#endif
