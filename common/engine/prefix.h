/* prefix.h: how much of a prompt a store hit lets prefill skip (DESIGN.md §5, explainer Pass 3
 * "A prefix hit with a missing window").
 *
 * The store holds whole 128-token blocks keyed by hash chain, and window state only at some
 * multiples of 128. For a prompt of L tokens, ring size R (134 with nextn 5):
 *   1. cap: the hit is at most L - R, so prefill always computes the last R positions;
 *   2. whole blocks: hit = 128 * min(blocks the store has, floor((L - R) / 128));
 *   3. window: the window state at `hit` must exist. If it does, prefill loads blocks and window
 *      and computes from `hit`. If not, it backs off one block: it still loads the block KV up
 *      to `hit`, but computes from hit - 128, so those 128 tokens rerun only to rebuild the
 *      window (queries limited to keys from hit - 128 on). When the window state one block
 *      back exists, prefill resumes there exactly instead (same 128 extra tokens, no clipped
 *      windows).
 * Example, L = 10,000, R = 134: cap 9,866, 77 blocks, hit 9,856; with the window, prefill
 * computes 144 tokens; without, it computes from 9,728, 272 tokens (a 128-token replay).
 * A 128-token hit without its window is no hit: a replay from 0 is a plain prefill.
 */
#ifndef DI_ENGINE_PREFIX_H
#define DI_ENGINE_PREFIX_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/util/status.h"

typedef struct prefix_hit {
    uint32_t kv_tokens;      /* leading positions whose block KV is loaded (multiple of 128) */
    uint32_t compute_from;   /* first position prefill computes (== kv_tokens, or minus 128) */
    uint32_t replay_tokens;  /* kv_tokens - compute_from: positions rerun to rebuild the window */
    uint32_t prefill_tokens; /* L - compute_from: positions prefill computes */
    bool load_window;        /* load the window state at compute_from (false on a replay) */
} prefix_hit;

/* Applies the rules above. prompt_len L >= 1; ring >= 1; store_blocks: how many leading blocks
 * of the prompt the store holds; has_window[k] (k < n_window) says whether window state
 * exists at position 128 k (entries past n_window count as missing).
 * DI_OK with *out set; DI_EINVAL when L or ring is 0 or has_window is NULL with n_window > 0. */
di_status prefix_hit_compute(uint32_t prompt_len, uint32_t ring, uint32_t store_blocks,
                             const bool *has_window, size_t n_window, prefix_hit *out,
                             di_error *err);

#endif
