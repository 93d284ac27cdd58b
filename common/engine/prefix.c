#include "common/engine/prefix.h"

#define PREFIX_BLOCK 128u

di_status prefix_hit_compute(uint32_t prompt_len, uint32_t ring, uint32_t store_blocks,
                             const bool *has_window, size_t n_window, prefix_hit *out,
                             di_error *err)
{
    if (prompt_len == 0)
        return di_fail(err, DI_EINVAL, "prefix hit of an empty prompt");
    if (ring == 0)
        return di_fail(err, DI_EINVAL, "ring size must be at least 1");
    if (n_window && !has_window)
        return di_fail(err, DI_EINVAL, "n_window %zu without a window table", n_window);
    uint32_t cap = prompt_len > ring ? prompt_len - ring : 0;
    uint32_t blocks = cap / PREFIX_BLOCK;
    if (store_blocks < blocks)
        blocks = store_blocks;
    prefix_hit h = {0};
    uint32_t hit = blocks * PREFIX_BLOCK;
    bool window = blocks < n_window && has_window[blocks];
    if (blocks > 0 && window) {
        h.kv_tokens = hit;
        h.compute_from = hit;
        h.load_window = true;
    } else if (blocks > 1 && blocks - 1 < n_window && has_window[blocks - 1]) {
        /* the window one block back exists: resume there exactly, at the replay's cost */
        h.kv_tokens = hit - PREFIX_BLOCK;
        h.compute_from = hit - PREFIX_BLOCK;
        h.load_window = true;
    } else if (blocks > 1) {
        h.kv_tokens = hit;
        h.compute_from = hit - PREFIX_BLOCK;
        h.replay_tokens = PREFIX_BLOCK;
    }
    h.prefill_tokens = prompt_len - h.compute_from;
    *out = h;
    return DI_OK;
}
