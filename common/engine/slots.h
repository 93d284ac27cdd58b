/* slots.h: the state-slot pool of one rank.
 *
 * A state slot is a running sequence's fixed-size state: one window ring per layer (and per
 * draft stage) plus the compressors' pending tokens (common/kvfmt/kv_layout.h gives the bytes).
 * Blocks grow with a request; a slot does not, which is why the engine keeps two pools
 * (explainer Pass 2, "The state slot"). Every sequence that runs or holds a prefill
 * reservation owns exactly one slot; slots_check asserts it.
 *
 * The ring has window + max(backtracking, nextn + 1) positions (128 + 6 = 134 with nextn 5):
 * a decode step writes up to nextn + 1 positions ahead, and a rejected draft's entry must not
 * overwrite a position the next query's window still reads (explainer Pass 3, "Why the ring
 * needs 6 spare slots"). Position p lives in ring entry p mod ring.
 *
 * Slot states: FREE (on the stack) --slots_acquire--> OWNED (by one request id)
 *              OWNED --slots_release--> FREE
 */
#ifndef DI_ENGINE_SLOTS_H
#define DI_ENGINE_SLOTS_H

#include <stdbool.h>
#include <stdint.h>

#include "common/util/alloc.h"
#include "common/util/status.h"

typedef struct slots {
    uint32_t n;            /* slots in the pool */
    uint32_t *stack;       /* [n] free slot ids; the top is handed out next (warm first) */
    uint32_t n_free;       /* free slots */
    uint64_t *owner;       /* [n] request id of the owner (valid while in_use) */
    uint8_t *in_use;       /* [n] 1 while owned */
    uint32_t *claims;      /* [n] check: owners naming each slot */
    bool check_bad;        /* check: a sequence named an out-of-range slot */
    int32_t check_bad_id;  /* check: the first such slot */
    const di_alloc *alloc; /* allocator (NULL = libc) */
} slots;

/* Ring positions for a window: window + max(backtracking, nextn + 1), the KV layout's rule
 * (kv_ring_positions_for in common/kvfmt/kv_layout.h). */
uint32_t slots_ring_positions(uint32_t window, uint32_t nextn, uint32_t backtracking);
/* Ring entry of position p. ring > 0. */
static inline uint32_t slots_ring_index(uint64_t position, uint32_t ring)
{
    return (uint32_t)(position % ring);
}

/* Creates a pool of n slots (1 .. 2^24). DI_OK; DI_EINVAL; DI_ENOMEM (*out untouched). */
di_status slots_create(uint32_t n, const di_alloc *a, slots **out, di_error *err);
/* NULL-safe. */
void slots_destroy(slots *p);

static inline uint32_t slots_free_count(const slots *p) { return p->n_free; }

/* Gives a free slot to request `owner`. DI_OK with *slot set; DI_EFULL when none is free
 * (nothing changes). */
di_status slots_acquire(slots *p, uint64_t owner, int32_t *slot, di_error *err);
/* Returns an owned slot to the pool (asserted owned). */
void slots_release(slots *p, int32_t slot);

/* The invariant check: begin, then claim() once per sequence that holds a slot, then end.
 * end returns DI_OK when every owned slot is claimed exactly once by the request recorded as
 * its owner, no free slot is claimed, and the free stack lists each free slot once;
 * DI_EINTERNAL naming the first broken rule otherwise. */
void slots_check_begin(slots *p);
void slots_check_claim(slots *p, int32_t slot, uint64_t owner);
di_status slots_check_end(slots *p, di_error *err);

#endif
