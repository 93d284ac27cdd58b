/* slab.h: the DRAM tier's arena, cut into fixed-size slots per object class.
 *
 * The arena is one contiguous region (UCX-mapped in the store, plain memory in tests). It is
 * split at creation into one region per class, sized by the class's share of the arena; each
 * region is an array of equal slots of the class's slot size (the object size rounded up to
 * 64 bytes), so objects never fragment and a slot's address is base + region offset +
 * slot * slot size. Handoff objects are variable-size and take a slot of the handoff maximum.
 *
 * The tier's capacity (bytes, settable at run time up to the arena size) is split by the same
 * shares: a class may hold floor(capacity * share / slot_bytes) slots at most. Lowering the
 * capacity below what is in use makes kvslab_over_limit() true until objects are evicted.
 *
 * Pure logic: no locking (the store's mutex covers it), no I/O, no logging.
 */
#ifndef DI_KVSTORE_SLAB_H
#define DI_KVSTORE_SLAB_H

#include <stddef.h>
#include <stdint.h>

#include "common/kvfmt/kv_keys.h"
#include "common/util/status.h"

#define KVSLAB_ALIGN 64u

typedef struct kvslab kvslab;

/* What kvslab_create needs. */
typedef struct kvslab_config {
    void *base;                                /* arena start; KVSLAB_ALIGN-aligned */
    uint64_t arena_bytes;                      /* arena length (bytes) */
    uint64_t object_bytes[KVKEY_CLASS_COUNT];  /* largest object of each class (bytes) */
    double share[KVKEY_CLASS_COUNT];           /* fraction of the arena per class; sum <= 1 */
} kvslab_config;

/* Usage of one class. */
typedef struct kvslab_class_stats {
    uint64_t slot_bytes; /* bytes per slot */
    uint32_t slots;      /* slots in the class's region */
    uint32_t limit;      /* slots allowed under the current capacity (<= slots) */
    uint32_t used;       /* slots handed out */
} kvslab_class_stats;

/* Creates the allocator. DI_EINVAL when the config is unusable (misaligned base, shares
 * outside [0, 1] or summing above 1, a class whose share holds no slot) with the reason;
 * DI_ENOMEM. *out is written only on success. */
di_status kvslab_create(const kvslab_config *cfg, kvslab **out, di_error *err);
/* NULL-safe. Returns NULL. */
kvslab *kvslab_free(kvslab *s);

/* Takes a free slot of class cls. DI_OK (*slot written), DI_EFULL when the class is at its
 * limit (the caller evicts and retries). */
di_status kvslab_alloc(kvslab *s, int cls, uint32_t *slot);
/* Returns a slot taken by kvslab_alloc (asserts it was in use). */
void kvslab_release(kvslab *s, int cls, uint32_t slot);

/* Address and arena offset of a slot. */
void *kvslab_addr(const kvslab *s, int cls, uint32_t slot);
uint64_t kvslab_offset(const kvslab *s, int cls, uint32_t slot);
uint64_t kvslab_slot_bytes(const kvslab *s, int cls);

/* Sets the tier capacity (bytes). DI_ERANGE when above the arena size or when it would leave
 * a class without a slot. Limits change at once; objects above them are left for eviction. */
di_status kvslab_set_capacity(kvslab *s, uint64_t bytes, di_error *err);
uint64_t kvslab_capacity(const kvslab *s);
uint64_t kvslab_arena_bytes(const kvslab *s);
/* True when class cls uses more slots than its limit allows. */
int kvslab_over_limit(const kvslab *s, int cls);
void kvslab_stats(const kvslab *s, int cls, kvslab_class_stats *out);

#endif
