#include "common/engine/slots.h"

#include <assert.h>

#include "common/kvfmt/kv_layout.h"

uint32_t slots_ring_positions(uint32_t window, uint32_t nextn, uint32_t backtracking)
{
    return kv_ring_positions_for(window, nextn, backtracking);
}

di_status slots_create(uint32_t n, const di_alloc *a, slots **out, di_error *err)
{
    if (n == 0 || n > (1u << 24))
        return di_fail(err, DI_EINVAL, "state slot count %u outside [1, 2^24]", n);
    slots *p = di_alloc_zero(a, 1, sizeof(*p));
    if (!p)
        return di_fail(err, DI_ENOMEM, "out of memory for the state-slot pool");
    p->alloc = a;
    p->n = n;
    p->stack = di_alloc_zero(a, n, sizeof(uint32_t));
    p->owner = di_alloc_zero(a, n, sizeof(uint64_t));
    p->in_use = di_alloc_zero(a, n, 1);
    p->claims = di_alloc_zero(a, n, sizeof(uint32_t));
    if (!p->stack || !p->owner || !p->in_use || !p->claims) {
        slots_destroy(p);
        return di_fail(err, DI_ENOMEM, "out of memory for %u state slots", n);
    }
    for (uint32_t i = 0; i < n; i++)
        p->stack[i] = n - 1 - i; /* slot 0 on top */
    p->n_free = n;
    *out = p;
    return DI_OK;
}

void slots_destroy(slots *p)
{
    if (!p)
        return;
    const di_alloc *a = p->alloc;
    di_alloc_release(a, p->stack);
    di_alloc_release(a, p->owner);
    di_alloc_release(a, p->in_use);
    di_alloc_release(a, p->claims);
    di_alloc_release(a, p);
}

di_status slots_acquire(slots *p, uint64_t owner, int32_t *slot, di_error *err)
{
    if (p->n_free == 0)
        return di_fail(err, DI_EFULL, "all %u state slots are in use", p->n);
    uint32_t s = p->stack[--p->n_free];
    assert(!p->in_use[s]);
    p->in_use[s] = 1;
    p->owner[s] = owner;
    *slot = (int32_t)s;
    return DI_OK;
}

void slots_release(slots *p, int32_t slot)
{
    assert(slot >= 0 && (uint32_t)slot < p->n && p->in_use[slot] && p->n_free < p->n);
    p->in_use[slot] = 0;
    p->stack[p->n_free++] = (uint32_t)slot;
}

void slots_check_begin(slots *p)
{
    memset(p->claims, 0, (size_t)p->n * sizeof(uint32_t));
    p->check_bad = false;
}

void slots_check_claim(slots *p, int32_t slot, uint64_t owner)
{
    if (slot < 0 || (uint32_t)slot >= p->n) {
        if (!p->check_bad)
            p->check_bad_id = slot;
        p->check_bad = true;
        return;
    }
    /* a claim by someone other than the recorded owner counts as a second claim */
    p->claims[slot] += p->in_use[slot] && p->owner[slot] == owner ? 1 : 2;
}

di_status slots_check_end(slots *p, di_error *err)
{
    if (p->check_bad)
        return di_fail(err, DI_EINTERNAL, "a sequence claims slot %d of %u", p->check_bad_id,
                       p->n);
    if (p->n_free > p->n)
        return di_fail(err, DI_EINTERNAL, "%u free slots in a pool of %u", p->n_free, p->n);
    const uint32_t mark = 1u << 31;
    for (uint32_t i = 0; i < p->n_free; i++) {
        uint32_t s = p->stack[i];
        if (s >= p->n || p->in_use[s] || (p->claims[s] & mark))
            return di_fail(err, DI_EINTERNAL, "free stack entry %u is slot %u (in use, out of "
                           "range or listed twice)", i, s);
        p->claims[s] |= mark;
    }
    for (uint32_t s = 0; s < p->n; s++) {
        uint32_t claims = p->claims[s] & ~mark;
        if (!p->in_use[s]) {
            if (!(p->claims[s] & mark))
                return di_fail(err, DI_EINTERNAL, "slot %u is neither owned nor free (leaked)",
                               s);
            if (claims)
                return di_fail(err, DI_EINTERNAL, "free slot %u is held by a sequence", s);
            continue;
        }
        if (claims != 1)
            return di_fail(err, DI_EINTERNAL, "slot %u (owner %llu) held by %s", s,
                           (unsigned long long)p->owner[s],
                           claims == 0 ? "no sequence (leaked)" : "another or a second sequence");
    }
    return DI_OK;
}
