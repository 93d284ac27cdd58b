#include "common/kvfmt/kv_layout.h"

#include <string.h>

#include "common/util/hash64.h"

#include <assert.h>

const char *kv_yoco_name(uint32_t yoco)
{
    static const char *const names[] = {"off", "compact", "mask"};
    return yoco < 3 ? names[yoco] : "?";
}

uint64_t kv_model_id(uint64_t model_id, uint32_t yoco)
{
    uint8_t in[16];
    for (int i = 0; i < 8; i++)
        in[i] = (uint8_t)(model_id >> (8 * i));
    for (int i = 0; i < 4; i++) {
        in[8 + i] = (uint8_t)(yoco >> (8 * i));
        in[12 + i] = (uint8_t)(KV_FORMAT_VERSION >> (8 * i));
    }
    return di_hash64(in, sizeof in, 0x64696b766b657931ull /* "dikvkey1" */);
}

uint32_t kv_ring_positions_for(uint32_t window, uint32_t nextn, uint32_t backtracking)
{
    uint32_t spare = nextn + 1;
    if (backtracking > spare)
        spare = backtracking;
    return window + spare;
}

di_status kv_geometry_validate(const kv_geometry *g, di_error *err)
{
    if (!g)
        return di_fail(err, DI_EINVAL, "kv geometry is NULL");
    if (g->block_tokens == 0 || g->block_tokens % 32 != 0)
        return di_fail(err, DI_EINVAL, "block_tokens %u must be a positive multiple of 32",
                       g->block_tokens);
    if (g->head_dim == 0 || g->head_dim % 32 != 0)
        return di_fail(err, DI_EINVAL, "head_dim %u must be a positive multiple of 32",
                       g->head_dim);
    if (g->index_head_dim == 0 || g->index_head_dim % 32 != 0)
        return di_fail(err, DI_EINVAL, "index_head_dim %u must be a positive multiple of 32",
                       g->index_head_dim);
    if (g->window == 0)
        return di_fail(err, DI_EINVAL, "window must be positive");
    if (g->ring_positions <= g->window)
        return di_fail(err, DI_EINVAL,
                       "ring_positions %u must exceed the window %u (spare slots for drafts)",
                       g->ring_positions, g->window);
    if (g->n_layers == 0)
        return di_fail(err, DI_EINVAL, "n_layers must be positive");
    if (g->n_owners > KV_MAX_OWNERS)
        return di_fail(err, DI_EINVAL, "%u KV owners, at most %u supported", g->n_owners,
                       KV_MAX_OWNERS);
    for (uint32_t k = 0; k < g->n_owners; k++) {
        uint32_t r = g->owner_ratio[k];
        if (r == 0 || g->block_tokens % r != 0)
            return di_fail(err, DI_EINVAL,
                           "owner layer %u: ratio %u must be positive and divide %u",
                           g->owner_layer[k], r, g->block_tokens);
        if (g->owner_layer[k] >= g->n_layers)
            return di_fail(err, DI_EINVAL, "owner layer %u is not below n_layers %u",
                           g->owner_layer[k], g->n_layers);
        if (k > 0 && g->owner_layer[k] <= g->owner_layer[k - 1])
            return di_fail(err, DI_EINVAL, "owner layers must be strictly ascending");
    }
    if (g->yoco_boundary > g->n_layers)
        return di_fail(err, DI_EINVAL, "yoco_boundary %u exceeds n_layers %u", g->yoco_boundary,
                       g->n_layers);
    return DI_OK;
}

size_t kv_main_entry_bytes(const kv_geometry *g)
{
    return g->head_dim / 2 + g->head_dim / 16;
}

size_t kv_index_entry_bytes(const kv_geometry *g)
{
    return g->index_head_dim / 2 + g->index_head_dim / 32;
}

size_t kv_ring_entry_bytes(const kv_geometry *g)
{
    return g->head_dim + g->head_dim / 32;
}

uint32_t kv_owner_entries_per_block(const kv_geometry *g, uint32_t owner)
{
    return g->block_tokens / g->owner_ratio[owner];
}

static size_t owner_region_bytes(const kv_geometry *g, uint32_t owner)
{
    return (size_t)kv_owner_entries_per_block(g, owner) *
           (kv_main_entry_bytes(g) + kv_index_entry_bytes(g));
}

size_t kv_block_payload_bytes(const kv_geometry *g)
{
    size_t total = 0;
    for (uint32_t k = 0; k < g->n_owners; k++)
        total += owner_region_bytes(g, k);
    return total;
}

size_t kv_block_bytes(const kv_geometry *g)
{
    return KV_HEADER_BYTES + kv_block_payload_bytes(g);
}

static size_t owner_region_offset(const kv_geometry *g, uint32_t owner)
{
    size_t off = KV_HEADER_BYTES;
    for (uint32_t k = 0; k < owner; k++)
        off += owner_region_bytes(g, k);
    return off;
}

size_t kv_owner_main_offset(const kv_geometry *g, uint32_t owner, uint32_t entry)
{
    return owner_region_offset(g, owner) + (size_t)entry * kv_main_entry_bytes(g);
}

size_t kv_owner_index_offset(const kv_geometry *g, uint32_t owner, uint32_t entry)
{
    return owner_region_offset(g, owner) +
           (size_t)kv_owner_entries_per_block(g, owner) * kv_main_entry_bytes(g) +
           (size_t)entry * kv_index_entry_bytes(g);
}

uint64_t kv_blocks_for_tokens(const kv_geometry *g, uint64_t tokens)
{
    return (tokens + g->block_tokens - 1) / g->block_tokens;
}

size_t kv_ring_bytes(const kv_geometry *g)
{
    return (size_t)g->ring_positions * kv_ring_entry_bytes(g);
}

size_t kv_compressor_state_bytes(const kv_geometry *g)
{
    /* A ratio-r compressor holds up to r-1 pending tokens; drafts that are later rejected may
     * have pushed up to (ring_positions - window) more, so the state is a ring of
     * r - 1 + spare token slots, each fp32 a[head_dim] and g[head_dim]. */
    uint32_t spare = g->ring_positions - g->window;
    size_t per_token = (size_t)2 * g->head_dim * sizeof(float);
    size_t total = 0;
    for (uint32_t k = 0; k < g->n_owners; k++)
        if (g->owner_ratio[k] > 1)
            total += (size_t)(g->owner_ratio[k] - 1 + spare) * per_token;
    return total;
}

size_t kv_state_slot_bytes(const kv_geometry *g)
{
    return (size_t)(g->n_layers + g->n_draft_stages) * kv_ring_bytes(g) +
           kv_compressor_state_bytes(g);
}

size_t kv_window_state_payload_bytes(const kv_geometry *g)
{
    return (size_t)g->yoco_boundary * kv_ring_bytes(g) + kv_compressor_state_bytes(g);
}

size_t kv_window_state_bytes(const kv_geometry *g)
{
    return KV_HEADER_BYTES + kv_window_state_payload_bytes(g);
}

uint64_t kv_checksum_combine(const kv_header *hdr, uint64_t payload_sum)
{
    kv_header h = *hdr;
    h.checksum = 0;
    uint64_t pair[2] = {di_hash64(&h, sizeof(h), h.model_id), payload_sum};
    return di_hash64(pair, sizeof(pair), 0x6b76686472636b73ull /* "kvhdrcks" */);
}

void kv_header_fill(kv_header *hdr, uint32_t magic, const kv_geometry *g, const uint8_t key[32],
                    uint32_t token_count, uint64_t first_position, const void *payload,
                    size_t payload_bytes)
{
    memset(hdr, 0, sizeof(*hdr));
    hdr->magic = magic;
    hdr->version = KV_FORMAT_VERSION;
    hdr->header_bytes = KV_HEADER_BYTES;
    hdr->payload_bytes = (uint32_t)payload_bytes;
    hdr->token_count = token_count;
    hdr->model_id = g->model_id;
    hdr->first_position = first_position;
    if (key)
        memcpy(hdr->key, key, 32);
    hdr->ring_positions = g->ring_positions;
    hdr->checksum = kv_checksum_combine(hdr, di_hash64(payload, payload_bytes, g->model_id));
}

di_status kv_header_check(const void *object, size_t bytes, uint32_t magic, const kv_geometry *g,
                          di_error *err)
{
    if (bytes < KV_HEADER_BYTES)
        return di_fail(err, DI_ECORRUPT, "object of %zu bytes is shorter than its header",
                       bytes);
    kv_header hdr;
    memcpy(&hdr, object, sizeof(hdr));
    if (hdr.magic != magic)
        return di_fail(err, DI_ECORRUPT, "bad magic 0x%08x (expected 0x%08x)", hdr.magic, magic);
    if (hdr.version != KV_FORMAT_VERSION)
        return di_fail(err, DI_ECORRUPT,
                       "format version %u, this build reads %u: rewrite the cache or upgrade",
                       hdr.version, KV_FORMAT_VERSION);
    if (hdr.header_bytes != KV_HEADER_BYTES || (size_t)hdr.payload_bytes + KV_HEADER_BYTES != bytes)
        return di_fail(err, DI_ECORRUPT, "size mismatch: header says %u + %u bytes, object has %zu",
                       hdr.header_bytes, hdr.payload_bytes, bytes);
    if (hdr.model_id != g->model_id)
        return di_fail(err, DI_ECORRUPT, "written by model 0x%016llx, expected 0x%016llx",
                       (unsigned long long)hdr.model_id, (unsigned long long)g->model_id);
    if ((magic == KV_WINDOW_MAGIC || magic == KV_HANDOFF_MAGIC) &&
        hdr.ring_positions != g->ring_positions)
        return di_fail(err, DI_ECORRUPT, "window state has %u ring positions, expected %u",
                       hdr.ring_positions, g->ring_positions);
    return DI_OK;
}

di_status kv_checksum_check(const void *object, uint64_t payload_sum, di_error *err)
{
    kv_header hdr;
    memcpy(&hdr, object, sizeof(hdr));
    uint64_t sum = kv_checksum_combine(&hdr, payload_sum);
    if (sum != hdr.checksum)
        return di_fail(err, DI_ECORRUPT, "checksum mismatch (stored %016llx, computed %016llx)",
                       (unsigned long long)hdr.checksum, (unsigned long long)sum);
    return DI_OK;
}

di_status kv_object_verify(const void *object, size_t bytes, uint32_t magic, const kv_geometry *g,
                           di_error *err)
{
    di_status st = kv_header_check(object, bytes, magic, g, err);
    if (st != DI_OK)
        return st;
    uint64_t sum = di_hash64((const unsigned char *)object + KV_HEADER_BYTES,
                             bytes - KV_HEADER_BYTES, g->model_id);
    return kv_checksum_check(object, sum, err);
}
