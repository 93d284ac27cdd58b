#include <criterion/criterion.h>

#include "common/engine/slots.h"
#include "common/kvfmt/kv_layout.h"

/* The slot pool's ring size is the KV layout's (the state slot bytes depend on it). */
Test(slots, ring_rule_agrees_with_kv_layout)
{
    for (uint32_t window = 1; window <= 256; window += 17)
        for (uint32_t nextn = 0; nextn <= 15; nextn++)
            for (uint32_t bt = 0; bt <= 20; bt += 3)
                cr_assert_eq(slots_ring_positions(window, nextn, bt),
                             kv_ring_positions_for(window, nextn, bt), "w %u n %u b %u", window,
                             nextn, bt);
    cr_assert_eq(slots_ring_positions(128, 5, 0), 134, "128 + 6 with nextn 5");
    cr_assert_eq(slots_ring_positions(128, 5, 1), 134, "backtracking 1 is clamped to nextn + 1");
    cr_assert_eq(slots_ring_positions(128, 5, 10), 138);
}

/* Explainer Pass 2: 16,389 = 122 x 134 + 41; Pass 3: position 2,004 writes slot 128. */
Test(slots, ring_index_examples)
{
    cr_assert_eq(slots_ring_index(16389, 134), 41);
    cr_assert_eq(slots_ring_index(2004, 134), 128);
    cr_assert_eq(slots_ring_index(2004, 128), 84);
    /* with 134, the oldest entry position 2,004 overwrites (1,870) is outside the window of
       the next query at 2,002 (1,875..2,002); with 128 it would overwrite 1,876, inside it */
    cr_assert_eq(slots_ring_index(1870, 134), slots_ring_index(2004, 134));
    cr_assert(1870 < 2002 - 127);
    cr_assert_eq(slots_ring_index(1876, 128), slots_ring_index(2004, 128));
    cr_assert(1876 >= 2002 - 127);
}

Test(slots, acquire_release_and_exhaustion)
{
    slots *p = NULL;
    di_error e;
    cr_assert_eq(slots_create(3, NULL, &p, &e), DI_OK, "%s", e.msg);
    int32_t a, b, c, d = -7;
    cr_assert_eq(slots_acquire(p, 10, &a, NULL), DI_OK);
    cr_assert_eq(slots_acquire(p, 11, &b, NULL), DI_OK);
    cr_assert_eq(slots_acquire(p, 12, &c, NULL), DI_OK);
    cr_assert(a != b && b != c && a != c);
    cr_assert_eq(slots_acquire(p, 13, &d, &e), DI_EFULL);
    cr_assert_eq(d, -7, "untouched on failure");
    cr_assert(strstr(e.msg, "3 state slots"), "%s", e.msg);
    slots_release(p, b);
    cr_assert_eq(slots_free_count(p), 1);
    cr_assert_eq(slots_acquire(p, 13, &d, NULL), DI_OK);
    cr_assert_eq(d, b, "the freed slot is reused");
    slots_destroy(p);
    slots_destroy(NULL);
}

Test(slots, check_each_slot_held_once)
{
    slots *p = NULL;
    cr_assert_eq(slots_create(4, NULL, &p, NULL), DI_OK);
    int32_t a, b;
    cr_assert_eq(slots_acquire(p, 1, &a, NULL), DI_OK);
    cr_assert_eq(slots_acquire(p, 2, &b, NULL), DI_OK);
    di_error e;

    slots_check_begin(p);
    slots_check_claim(p, a, 1);
    slots_check_claim(p, b, 2);
    cr_assert_eq(slots_check_end(p, &e), DI_OK, "%s", e.msg);

    slots_check_begin(p); /* b unclaimed: leaked */
    slots_check_claim(p, a, 1);
    cr_assert_eq(slots_check_end(p, &e), DI_EINTERNAL);
    cr_assert(strstr(e.msg, "leaked"), "%s", e.msg);

    slots_check_begin(p); /* a claimed twice */
    slots_check_claim(p, a, 1);
    slots_check_claim(p, a, 1);
    slots_check_claim(p, b, 2);
    cr_assert_eq(slots_check_end(p, &e), DI_EINTERNAL);

    slots_check_begin(p); /* b claimed by a sequence that is not its owner */
    slots_check_claim(p, a, 1);
    slots_check_claim(p, b, 99);
    cr_assert_eq(slots_check_end(p, &e), DI_EINTERNAL);
    cr_assert(strstr(e.msg, "owner 2"), "%s", e.msg);

    slots_check_begin(p); /* slot -1 ("none") claimed besides the real ones */
    slots_check_claim(p, a, 1);
    slots_check_claim(p, b, 2);
    slots_check_claim(p, -1, 3);
    cr_assert_eq(slots_check_end(p, &e), DI_EINTERNAL, "slot -1 went unnoticed");
    cr_assert(strstr(e.msg, "slot -1"), "%s", e.msg);

    slots_check_begin(p); /* a free slot claimed */
    slots_check_claim(p, a, 1);
    slots_check_claim(p, b, 2);
    slots_check_claim(p, (int32_t)p->stack[0], 3);
    cr_assert_eq(slots_check_end(p, &e), DI_EINTERNAL);
    cr_assert(strstr(e.msg, "free slot"), "%s", e.msg);

    p->stack[1] = p->stack[0]; /* a slot twice on the free stack */
    slots_check_begin(p);
    slots_check_claim(p, a, 1);
    slots_check_claim(p, b, 2);
    cr_assert_eq(slots_check_end(p, &e), DI_EINTERNAL);
    slots_destroy(p);
}

Test(slots, create_rejects_bad_sizes)
{
    slots *p = (slots *)0x1;
    di_error e;
    cr_assert_eq(slots_create(0, NULL, &p, &e), DI_EINVAL);
    cr_assert_eq(p, (slots *)0x1);
}
