/* Placement: the two formulas, round-robin, health transitions, retry on another rank, and a
 * skewed-load simulation in which the estimated-time policy beats round-robin. */
#include <criterion/criterion.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "router/placement.h"

#define S 1000000000ull

static pl_table T;

static void setup(pl_policy p, int n_prefill, int n_decode)
{
    pl_config c = pl_config_default();
    cr_assert_eq(pl_init(&T, &c, p, NULL, NULL), DI_OK);
    char a[32];
    size_t idx;
    for (int i = 0; i < n_prefill; i++) {
        snprintf(a, sizeof a, "10.0.0.%d:7001", i + 1);
        cr_assert_eq(pl_add(&T, PL_PREFILL, a, false, 0, &idx, NULL), DI_OK);
    }
    for (int i = 0; i < n_decode; i++) {
        snprintf(a, sizeof a, "10.0.1.%d:7002", i + 1);
        cr_assert_eq(pl_add(&T, PL_DECODE, a, false, 0, &idx, NULL), DI_OK);
    }
}

Test(placement, config_and_address_checks)
{
    pl_config c = pl_config_default();
    c.out_after = c.suspect_after;
    di_error e = {0};
    cr_expect_eq(pl_init(&T, &c, PL_POLICY_ESTIMATE, NULL, &e), DI_EINVAL);
    cr_expect(strstr(e.msg, "suspect_after") != NULL, "%s", e.msg);
    c = pl_config_default();
    c.default_prefill_rate = 0;
    cr_expect_eq(pl_init(&T, &c, PL_POLICY_ESTIMATE, NULL, &e), DI_EINVAL);
    setup(PL_POLICY_ESTIMATE, 0, 0);
    size_t idx;
    cr_expect_eq(pl_add(&T, PL_PREFILL, "", false, 0, &idx, &e), DI_EINVAL);
    cr_expect_eq(pl_add(&T, PL_PREFILL, "a:1", false, 0, &idx, &e), DI_OK);
    size_t again;
    cr_expect_eq(pl_add(&T, PL_PREFILL, "a:1", true, 5, &again, &e), DI_OK);
    cr_expect_eq(again, idx, "a re-registration makes a second record");
    cr_expect(T.ranks[idx].registered);
    cr_expect_eq(pl_pick_prefill(&T, 10, 0, SIZE_MAX, 0, NULL), (long)idx);
    cr_expect_eq(pl_pick_decode(&T, 1, SIZE_MAX), -1, "no decode rank");
}

Test(placement, prefill_formula_counts_queue_rate_and_cache)
{
    setup(PL_POLICY_ESTIMATE, 3, 0);
    /* rank 0: 1,000 tok/s, empty; rank 1: 8,000 tok/s with 16,000 queued; rank 2: 4,000 tok/s
     * with 2,000 queued. */
    pl_observe_prefill(&T, 0, 1000, 1.0);
    pl_observe_prefill(&T, 1, 8000, 1.0);
    pl_observe_prefill(&T, 2, 4000, 1.0);
    pl_heartbeat(&T, 1, 0, &(pl_load){.queued_tokens = 16000});
    pl_heartbeat(&T, 2, 0, &(pl_load){.queued_tokens = 2000});
    double est;
    /* 1,000-token prompt: 1.0 s, 2.125 s, 0.75 s -> rank 2. */
    cr_expect_eq(pl_pick_prefill(&T, 1000, 0, SIZE_MAX, 0, &est), 2);
    cr_expect_float_eq(est, 0.75, 1e-12);
    cr_expect_eq(T.ranks[2].load.queued_tokens, 3000);
    /* Same prompt, 900 of it in the store: rank 0 computes 100 tokens in 0.1 s. */
    cr_expect_eq(pl_pick_prefill(&T, 1000, 900, SIZE_MAX, 0, &est), 0);
    cr_expect_float_eq(est, 0.1, 1e-12);
    cr_expect_eq(T.ranks[0].load.queued_tokens, 100);
    pl_prefill_done(&T, 0, 100);
    cr_expect_eq(T.ranks[0].load.queued_tokens, 0);
    /* The average moves toward new measurements by the weight. */
    pl_observe_prefill(&T, 0, 2000, 1.0);
    cr_expect_float_eq(T.ranks[0].rate, 0.7 * 1000 + 0.3 * 2000, 1e-9);
}

Test(placement, decode_formula_running_then_free_blocks)
{
    setup(PL_POLICY_ESTIMATE, 0, 3);
    pl_heartbeat(&T, 0, 0, &(pl_load){.running = 4, .free_blocks = 900});
    pl_heartbeat(&T, 1, 0, &(pl_load){.running = 2, .free_blocks = 100});
    pl_heartbeat(&T, 2, 0, &(pl_load){.running = 2, .free_blocks = 500});
    cr_expect_eq(pl_pick_decode(&T, 10, SIZE_MAX), 2); /* tie on running: more free blocks */
    cr_expect_eq(T.ranks[2].load.running, 3);
    cr_expect_eq(T.ranks[2].load.free_blocks, 490);
    cr_expect_eq(pl_pick_decode(&T, 10, SIZE_MAX), 1);
    cr_expect_eq(pl_pick_decode(&T, 600, SIZE_MAX), 0, "only rank 0 has 600 blocks");
    cr_expect_eq(pl_pick_decode(&T, 5000, SIZE_MAX), -1);
    pl_decode_done(&T, 0, 600);
    cr_expect_eq(T.ranks[0].load.free_blocks, 900);
    cr_expect_eq(T.ranks[0].load.running, 4);
}

Test(placement, round_robin_cycles_over_ranks_in_rotation)
{
    setup(PL_POLICY_ROUND_ROBIN, 3, 2);
    long seq[6];
    for (int i = 0; i < 6; i++)
        seq[i] = pl_pick_prefill(&T, 100, 0, SIZE_MAX, 0, NULL);
    long want[6] = {0, 1, 2, 0, 1, 2};
    cr_expect_arr_eq(seq, want, sizeof seq);
    cr_expect_eq(pl_pick_decode(&T, 0, SIZE_MAX), 3);
    cr_expect_eq(pl_pick_decode(&T, 0, SIZE_MAX), 4);
    cr_expect_eq(pl_pick_decode(&T, 0, SIZE_MAX), 3);
}

Test(placement, health_state_machine)
{
    setup(PL_POLICY_ESTIMATE, 2, 0);
    pl_rank *r0 = &T.ranks[0], *r1 = &T.ranks[1];
    /* Rank 1 beats; rank 0 falls silent. */
    for (uint64_t t = 1; t <= 5; t++) {
        pl_heartbeat(&T, 1, t * S, NULL);
        pl_tick(&T, t * S);
        if (t < 2)
            cr_expect_eq(r0->health, PL_HEALTHY, "t=%llu", (unsigned long long)t);
        else if (t < 5)
            cr_expect_eq(r0->health, PL_SUSPECT, "t=%llu", (unsigned long long)t);
    }
    cr_expect_eq(r0->health, PL_OUT);
    cr_expect_eq(pl_pick_prefill(&T, 10, 0, SIZE_MAX, 0, NULL), 1);
    /* It comes back after healthy_after (2) heartbeats, not one. */
    pl_heartbeat(&T, 0, 6 * S, NULL);
    pl_tick(&T, 6 * S);
    cr_expect_eq(r0->health, PL_OUT);
    pl_heartbeat(&T, 0, 6 * S + 1, NULL);
    cr_expect_eq(r0->health, PL_HEALTHY);
    /* Failed calls: suspect at once, out after 3 in a row; a success in between resets. */
    pl_call_result(&T, 1, false);
    cr_expect_eq(r1->health, PL_SUSPECT);
    pl_call_result(&T, 1, true);
    pl_call_result(&T, 1, true);
    cr_expect_eq(r1->health, PL_HEALTHY);
    pl_call_result(&T, 1, false);
    pl_call_result(&T, 1, false);
    pl_call_result(&T, 1, false);
    cr_expect_eq(r1->health, PL_OUT);
    /* With one rank suspect and none healthy, the suspect one still serves; out never does. */
    pl_call_result(&T, 0, false);
    cr_expect_eq(r0->health, PL_SUSPECT);
    cr_expect_eq(pl_pick_prefill(&T, 10, 0, SIZE_MAX, 0, NULL), 0);
    pl_call_result(&T, 0, false);
    pl_call_result(&T, 0, false);
    cr_expect_eq(pl_pick_prefill(&T, 10, 0, SIZE_MAX, 0, NULL), -1);
}

Test(placement, retry_goes_to_another_rank)
{
    setup(PL_POLICY_ESTIMATE, 2, 0);
    long first = pl_pick_prefill(&T, 500, 0, SIZE_MAX, 0, NULL);
    cr_assert_geq(first, 0);
    pl_call_result(&T, (size_t)first, false);
    pl_prefill_done(&T, (size_t)first, 500);
    long second = pl_pick_prefill(&T, 500, 0, (size_t)first, 0, NULL);
    cr_expect(second >= 0 && second != first);
    /* With one rank only, there is no other rank to retry on. */
    setup(PL_POLICY_ESTIMATE, 1, 0);
    cr_expect_eq(pl_pick_prefill(&T, 500, 0, 0, 0, NULL), -1);
}

/* A slow rank not measured yet (it has not finished a prefill, and its heartbeats report no
 * rate) next to a fast measured one: while its first prefill is out, the time that prefill
 * has taken bounds its rate, so requests placed meanwhile go to the fast rank. Its first
 * pick is at the median of the measured ranks, and once it reports a rate, that rate counts. */
Test(placement, a_rank_busy_with_its_first_prefill_does_not_draw_the_requests)
{
    setup(PL_POLICY_ESTIMATE, 2, 0);
    const uint64_t ms = 1000000ull;
    /* rank 0: measured by its heartbeat at 500 tok/s, with 24 tokens queued */
    pl_heartbeat(&T, 0, 0, &(pl_load){.queued_tokens = 24, .prefill_rate = 500});
    /* rank 1 unmeasured: the median of the measured (500), so the empty rank 1 wins */
    cr_expect_float_eq(pl_prefill_rate(&T, 1, 0), 500, 1e-9);
    double est;
    const uint64_t t0 = 1000 * ms;
    cr_expect_eq(pl_pick_prefill(&T, 24, 0, SIZE_MAX, t0, &est), 1);
    cr_expect_float_eq(est, 24 / 500.0, 1e-12);
    /* Requests every 250 ms while rank 1's first prefill (24 tokens) is out, and rank 0
     * finishes each of its own before the next: rank 1 is at most 24 / 0.25 s = 96 tok/s,
     * then slower still, so every one goes to rank 0. */
    for (int k = 1; k <= 8; k++) {
        uint64_t now = t0 + (uint64_t)k * 250 * ms;
        cr_expect_leq(pl_prefill_rate(&T, 1, now), 24 / (k * 0.25) + 1e-9);
        long r = pl_pick_prefill(&T, 24, 0, SIZE_MAX, now, NULL);
        cr_expect_eq(r, 0, "request %d at %d ms went to the slow rank", k, k * 250);
        pl_prefill_done(&T, 0, 24);
    }
    /* Its first prefill ends after 2.1 s: the router's measurement (24 / 2.1 s) takes over. */
    pl_prefill_done(&T, 1, 24);
    pl_observe_prefill(&T, 1, 24, 2.1);
    cr_expect_float_eq(pl_prefill_rate(&T, 1, 3000 * ms), 24 / 2.1, 1e-9);
    /* A reported rate wins over the router's own measurement. */
    pl_heartbeat(&T, 1, 3000 * ms, &(pl_load){.prefill_rate = 2000});
    cr_expect_float_eq(pl_prefill_rate(&T, 1, 3000 * ms), 2000, 1e-9);
    cr_expect_eq(pl_pick_prefill(&T, 24, 0, SIZE_MAX, 3000 * ms, NULL), 1);
    /* With no rank measured, an unmeasured rank is at the configured default. */
    setup(PL_POLICY_ESTIMATE, 3, 0);
    cr_expect_float_eq(pl_prefill_rate(&T, 2, 0), pl_config_default().default_prefill_rate, 1e-9);
    /* The median of three measured ranks. */
    setup(PL_POLICY_ESTIMATE, 4, 0);
    pl_heartbeat(&T, 0, 0, &(pl_load){.prefill_rate = 100});
    pl_heartbeat(&T, 1, 0, &(pl_load){.prefill_rate = 9000});
    pl_observe_prefill(&T, 2, 300, 1.0);
    cr_expect_float_eq(pl_prefill_rate(&T, 3, 0), 300, 1e-9);
}

/* Skewed load: one fast and two slow prefill ranks, prompts of mixed sizes arriving every
 * 50 ms, and half the prompts mostly in the store. Each rank drains its queue at its rate;
 * a request's time to start is its rank's queue (with it) over the rate. */
static double simulate(pl_policy p, double *max_wait)
{
    setup(p, 3, 0);
    const double rates[3] = {20000, 2500, 2500};
    for (int i = 0; i < 3; i++)
        pl_observe_prefill(&T, (size_t)i, (uint64_t)rates[i], 1.0);
    double queue[3] = {0}, total = 0, worst = 0;
    uint64_t x = 12345;
    const int n = 400;
    for (int k = 0; k < n; k++) {
        for (int i = 0; i < 3; i++) { /* 50 ms of prefill */
            queue[i] -= rates[i] * 0.05;
            if (queue[i] < 0)
                queue[i] = 0;
            pl_heartbeat(&T, (size_t)i, 0, &(pl_load){.queued_tokens = (uint64_t)queue[i]});
        }
        x = x * 6364136223846793005ull + 1442695040888963407ull;
        uint64_t prompt = 200 + (x >> 33) % 1800;
        uint64_t cached = (k % 2) ? prompt * 9 / 10 : 0;
        long r = pl_pick_prefill(&T, prompt, cached, SIZE_MAX, 0, NULL);
        cr_assert_geq(r, 0);
        queue[r] += (double)(prompt - cached);
        double wait = queue[r] / rates[r];
        total += wait;
        if (wait > worst)
            worst = wait;
    }
    *max_wait = worst;
    return total / n;
}

Test(placement, estimate_beats_round_robin_under_skewed_load)
{
    double worst_e, worst_rr;
    double mean_e = simulate(PL_POLICY_ESTIMATE, &worst_e);
    double mean_rr = simulate(PL_POLICY_ROUND_ROBIN, &worst_rr);
    cr_log_info("mean time to start: estimate %.4f s, round-robin %.4f s (worst %.4f vs %.4f)",
                mean_e, mean_rr, worst_e, worst_rr);
    cr_expect_lt(mean_e * 2, mean_rr, "estimate %.4f s is not half of round-robin %.4f s",
                 mean_e, mean_rr);
    cr_expect_lt(worst_e, worst_rr);
}
