#include <criterion/criterion.h>

#include "common/engine/prefix.h"

static prefix_hit hit(uint32_t L, uint32_t ring, uint32_t blocks, const bool *w, size_t nw)
{
    prefix_hit h;
    di_error e;
    cr_assert_eq(prefix_hit_compute(L, ring, blocks, w, nw, &h, &e), DI_OK, "%s", e.msg);
    cr_assert_eq(h.replay_tokens, h.kv_tokens - h.compute_from);
    cr_assert_eq(h.prefill_tokens, L - h.compute_from);
    return h;
}

/* Explainer Pass 3: L = 10,000, ring 134. Cap 9,866; whole blocks 77 x 128 = 9,856. */
Test(prefix, ten_thousand_tokens_with_window)
{
    bool w[100] = {false};
    w[77] = true; /* window state at 9,856 */
    prefix_hit h = hit(10000, 134, 100, w, 100);
    cr_assert_eq(h.kv_tokens, 9856);
    cr_assert_eq(h.compute_from, 9856);
    cr_assert_eq(h.prefill_tokens, 144);
    cr_assert(h.load_window);
}

Test(prefix, ten_thousand_tokens_missing_window_replays_128)
{
    bool w[100] = {false};
    prefix_hit h = hit(10000, 134, 100, w, 100);
    cr_assert_eq(h.kv_tokens, 9856, "block KV is still loaded up to the hit");
    cr_assert_eq(h.compute_from, 9728);
    cr_assert_eq(h.replay_tokens, 128);
    cr_assert_eq(h.prefill_tokens, 272);
    cr_assert(!h.load_window);
}

/* Our refinement: with the window at 9,728 present, resume there exactly for the same 272. */
Test(prefix, window_one_block_back_resumes_exactly)
{
    bool w[100] = {false};
    w[76] = true;
    prefix_hit h = hit(10000, 134, 100, w, 100);
    cr_assert_eq(h.kv_tokens, 9728);
    cr_assert_eq(h.compute_from, 9728);
    cr_assert_eq(h.replay_tokens, 0);
    cr_assert_eq(h.prefill_tokens, 272);
    cr_assert(h.load_window);
}

Test(prefix, the_store_has_fewer_blocks)
{
    bool w[100] = {false};
    w[40] = true;
    prefix_hit h = hit(10000, 134, 40, w, 100);
    cr_assert_eq(h.kv_tokens, 40 * 128);
    cr_assert_eq(h.prefill_tokens, 10000 - 5120);
    h = hit(10000, 134, 0, w, 100);
    cr_assert_eq(h.kv_tokens, 0);
    cr_assert_eq(h.prefill_tokens, 10000);
}

Test(prefix, the_cap_keeps_the_last_ring_of_positions)
{
    bool w[4] = {true, true, true, true};
    /* L = 134 + 256 = 390: the hit may reach 256 exactly */
    prefix_hit h = hit(390, 134, 4, w, 4);
    cr_assert_eq(h.kv_tokens, 256);
    /* one token less: 255 is the cap, so one block */
    h = hit(389, 134, 4, w, 4);
    cr_assert_eq(h.kv_tokens, 128);
    /* shorter than the ring: nothing */
    h = hit(100, 134, 4, w, 4);
    cr_assert_eq(h.kv_tokens, 0);
    cr_assert_eq(h.prefill_tokens, 100);
}

Test(prefix, one_block_without_window_is_no_hit)
{
    bool w[2] = {false, false};
    prefix_hit h = hit(300, 134, 2, w, 2);
    cr_assert_eq(h.kv_tokens, 0, "a replay from 0 is a plain prefill");
    cr_assert_eq(h.prefill_tokens, 300);
    h = hit(300, 134, 2, NULL, 0);
    cr_assert_eq(h.kv_tokens, 0);
}

Test(prefix, bad_arguments)
{
    prefix_hit h = {.kv_tokens = 77};
    di_error e;
    cr_assert_eq(prefix_hit_compute(0, 134, 1, NULL, 0, &h, &e), DI_EINVAL);
    cr_assert_eq(prefix_hit_compute(10, 0, 1, NULL, 0, &h, &e), DI_EINVAL);
    cr_assert_eq(prefix_hit_compute(10, 134, 1, NULL, 3, &h, &e), DI_EINVAL);
    cr_assert_eq(h.kv_tokens, 77, "untouched on failure");
}
