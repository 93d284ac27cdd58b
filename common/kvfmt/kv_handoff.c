/* kv_handoff.c: the handoff object (kv_handoff.h). */
#include "common/kvfmt/kv_handoff.h"

#include <stdbool.h>
#include <string.h>

#include "common/util/hash64.h"

/* The fixed part of the payload (64 bytes). */
typedef struct kv_handoff_info {
    uint32_t prompt_len;
    uint32_t n_output;
    uint32_t kv_positions;
    uint32_t n_drafts;
    uint32_t exec_bytes;
    uint8_t reserved[44]; /* zero */
} kv_handoff_info;

_Static_assert(sizeof(kv_handoff_info) == 64, "kv_handoff_info must be 64 bytes");

/* Byte offsets of the sections inside the payload. */
typedef struct layout {
    size_t tokens, drafts, keys, partial, slot, exec, end;
} layout;

static size_t pad8(size_t n)
{
    return (n + 7) & ~(size_t)7;
}

/* Checks the counts; fills the section offsets. */
static di_status plan(const kv_geometry *g, const kv_handoff *h, layout *l, di_status code,
                      di_error *err)
{
    uint64_t n_tok = (uint64_t)h->prompt_len + h->n_output;
    if (h->prompt_len == 0 || n_tok > KV_HANDOFF_MAX_TOKENS)
        return di_fail(err, code, "handoff of %u prompt and %u output tokens: need 1 .. %u in all,"
                       " a prompt of at least 1", h->prompt_len, h->n_output,
                       KV_HANDOFF_MAX_TOKENS);
    if (h->kv_positions == 0 || h->kv_positions > n_tok)
        return di_fail(err, code, "handoff KV of %u positions outside [1, %llu]",
                       h->kv_positions, (unsigned long long)n_tok);
    if (h->n_drafts > KV_HANDOFF_MAX_DRAFTS || h->exec_bytes > KV_HANDOFF_MAX_EXEC)
        return di_fail(err, code, "handoff with %u drafts (at most %u) and %u executor bytes "
                       "(at most %u)", h->n_drafts, KV_HANDOFF_MAX_DRAFTS, h->exec_bytes,
                       KV_HANDOFF_MAX_EXEC);
    size_t full = h->kv_positions / g->block_tokens;
    bool partial = h->kv_positions % g->block_tokens != 0;
    l->tokens = sizeof(kv_handoff_info);
    l->drafts = l->tokens + pad8(n_tok * sizeof(int32_t));
    l->keys = l->drafts + pad8(h->n_drafts * sizeof(int32_t));
    l->partial = l->keys + full * 32;
    l->slot = l->partial + (partial ? kv_block_payload_bytes(g) : 0);
    l->exec = l->slot + kv_state_slot_bytes(g);
    l->end = l->exec + pad8(h->exec_bytes);
    if (l->end > UINT32_MAX - KV_HEADER_BYTES)
        return di_fail(err, code, "handoff payload of %zu bytes exceeds the format", l->end);
    return DI_OK;
}

size_t kv_handoff_bytes(const kv_geometry *g, const kv_handoff *h)
{
    layout l;
    if (!g || !h || plan(g, h, &l, DI_EINVAL, NULL) != DI_OK)
        return 0;
    return KV_HEADER_BYTES + l.end;
}

di_status kv_handoff_write(const kv_geometry *g, const kv_handoff *h, const uint8_t key[32],
                           void *dst, size_t cap, di_error *err)
{
    if (!g || !h || !key || !dst)
        return di_fail(err, DI_EINVAL, "handoff write: geometry, contents, key and buffer are "
                       "required");
    layout l;
    di_status st = plan(g, h, &l, DI_EINVAL, err);
    if (st != DI_OK)
        return st;
    bool partial = h->kv_positions % g->block_tokens != 0;
    if (!h->tokens || !h->slot || (h->n_drafts && !h->drafts) || (h->exec_bytes && !h->exec) ||
        (h->kv_positions >= g->block_tokens && !h->block_keys) || (partial && !h->partial))
        return di_fail(err, DI_EINVAL, "handoff write: a section's data is missing");
    if (cap < KV_HEADER_BYTES + l.end)
        return di_fail(err, DI_EINVAL, "handoff write: buffer of %zu bytes, the object has %zu",
                       cap, KV_HEADER_BYTES + l.end);
    uint8_t *pay = (uint8_t *)dst + KV_HEADER_BYTES;
    memset(pay, 0, l.end);
    kv_handoff_info info = {.prompt_len = h->prompt_len, .n_output = h->n_output,
                            .kv_positions = h->kv_positions, .n_drafts = h->n_drafts,
                            .exec_bytes = h->exec_bytes};
    memcpy(pay, &info, sizeof info);
    memcpy(pay + l.tokens, h->tokens, ((size_t)h->prompt_len + h->n_output) * sizeof(int32_t));
    if (h->n_drafts)
        memcpy(pay + l.drafts, h->drafts, h->n_drafts * sizeof(int32_t));
    if (l.partial > l.keys)
        memcpy(pay + l.keys, h->block_keys, l.partial - l.keys);
    if (partial)
        memcpy(pay + l.partial, h->partial, kv_block_payload_bytes(g));
    memcpy(pay + l.slot, h->slot, kv_state_slot_bytes(g));
    if (h->exec_bytes)
        memcpy(pay + l.exec, h->exec, h->exec_bytes);
    kv_header hdr;
    kv_header_fill(&hdr, KV_HANDOFF_MAGIC, g, key, h->prompt_len + h->n_output, h->kv_positions,
                   pay, l.end);
    memcpy(dst, &hdr, sizeof hdr);
    return DI_OK;
}

di_status kv_handoff_read(const kv_geometry *g, const void *obj, size_t bytes,
                          const uint8_t key[32], kv_handoff *out, di_error *err)
{
    if (!g || !obj || !key || !out)
        return di_fail(err, DI_EINVAL, "handoff read: geometry, object, key and result are "
                       "required");
    if ((uintptr_t)obj % 8 != 0)
        return di_fail(err, DI_EINVAL, "handoff read: the object must be 8-byte aligned");
    di_status st = kv_object_verify(obj, bytes, KV_HANDOFF_MAGIC, g, err);
    if (st != DI_OK)
        return st;
    kv_header hdr;
    memcpy(&hdr, obj, sizeof hdr);
    if (memcmp(hdr.key, key, 32) != 0)
        return di_fail(err, DI_ECORRUPT, "the handoff names another key than the one asked for");
    const uint8_t *pay = (const uint8_t *)obj + KV_HEADER_BYTES;
    if (hdr.payload_bytes < sizeof(kv_handoff_info))
        return di_fail(err, DI_ECORRUPT, "handoff payload of %u bytes is shorter than its counts",
                       hdr.payload_bytes);
    kv_handoff_info info;
    memcpy(&info, pay, sizeof info);
    kv_handoff h = {.prompt_len = info.prompt_len, .n_output = info.n_output,
                    .kv_positions = info.kv_positions, .n_drafts = info.n_drafts,
                    .exec_bytes = info.exec_bytes};
    layout l;
    if ((st = plan(g, &h, &l, DI_ECORRUPT, err)) != DI_OK)
        return st;
    if (l.end != hdr.payload_bytes)
        return di_fail(err, DI_ECORRUPT, "handoff counts need %zu payload bytes, it has %u",
                       l.end, hdr.payload_bytes);
    if (hdr.token_count != h.prompt_len + h.n_output || hdr.first_position != h.kv_positions)
        return di_fail(err, DI_ECORRUPT, "handoff header (%u tokens, KV to %llu) disagrees with "
                       "its counts (%u, %u)", hdr.token_count,
                       (unsigned long long)hdr.first_position, h.prompt_len + h.n_output,
                       h.kv_positions);
    h.tokens = (const int32_t *)(pay + l.tokens);
    h.drafts = h.n_drafts ? (const int32_t *)(pay + l.drafts) : NULL;
    h.block_keys = l.partial > l.keys ? pay + l.keys : NULL;
    h.partial = l.slot > l.partial ? pay + l.partial : NULL;
    h.slot = pay + l.slot;
    h.exec = h.exec_bytes ? pay + l.exec : NULL;
    *out = h;
    return DI_OK;
}
