#include "kvstore/slab.h"

#include <assert.h>
#include <stdlib.h>
#include <string.h>

/* One class's region of the arena. */
typedef struct slab_class {
    uint64_t offset;     /* region start, from the arena base (bytes) */
    uint64_t slot_bytes; /* object size rounded up to KVSLAB_ALIGN */
    double share;        /* fraction of the arena and of the capacity */
    uint32_t slots;      /* slots in the region */
    uint32_t limit;      /* slots allowed under the capacity */
    uint32_t used;       /* slots handed out */
    uint32_t *free;      /* stack of free slot numbers, top at free[n_free - 1] */
    uint32_t n_free;     /* entries on the stack */
    uint8_t *in_use;     /* per slot: 1 while handed out (catches double release) */
} slab_class;

struct kvslab {
    uint8_t *base;                         /* arena start */
    uint64_t arena_bytes;                  /* arena length */
    uint64_t capacity;                     /* current tier capacity (bytes) */
    slab_class cls[KVKEY_CLASS_COUNT];     /* per-class regions */
};

static uint64_t round_up(uint64_t v, uint64_t a)
{
    return (v + a - 1) / a * a;
}

static uint32_t limit_for(const slab_class *c, uint64_t capacity)
{
    uint64_t n = (uint64_t)((double)capacity * c->share) / c->slot_bytes;
    return n < c->slots ? (uint32_t)n : c->slots;
}

static di_status check_config(const kvslab_config *cfg, di_error *err)
{
    if (!cfg || !cfg->base)
        return di_fail(err, DI_EINVAL, "slab config or arena base is NULL");
    if ((uintptr_t)cfg->base % KVSLAB_ALIGN != 0)
        return di_fail(err, DI_EINVAL, "arena base is not %u-byte aligned", KVSLAB_ALIGN);
    double sum = 0;
    for (int c = 0; c < (int)KVKEY_CLASS_COUNT; c++) {
        if (!(cfg->share[c] > 0 && cfg->share[c] <= 1))
            return di_fail(err, DI_EINVAL, "DRAM share of class %s is %g, must be in (0, 1]",
                           kvkey_class_name(c), cfg->share[c]);
        if (cfg->object_bytes[c] == 0)
            return di_fail(err, DI_EINVAL, "object size of class %s is 0", kvkey_class_name(c));
        sum += cfg->share[c];
    }
    if (sum > 1.0 + 1e-9)
        return di_fail(err, DI_EINVAL, "DRAM shares sum to %g, must be at most 1", sum);
    return DI_OK;
}

di_status kvslab_create(const kvslab_config *cfg, kvslab **out, di_error *err)
{
    di_status st = check_config(cfg, err);
    if (st != DI_OK)
        return st;
    if (!out)
        return di_fail(err, DI_EINVAL, "kvslab_create: out is NULL");
    kvslab *s = calloc(1, sizeof(*s));
    if (!s)
        return di_fail(err, DI_ENOMEM, "cannot allocate the slab allocator");
    s->base = cfg->base;
    s->arena_bytes = cfg->arena_bytes;
    s->capacity = cfg->arena_bytes;
    uint64_t off = 0;
    for (int c = 0; c < (int)KVKEY_CLASS_COUNT; c++) {
        slab_class *k = &s->cls[c];
        k->slot_bytes = round_up(cfg->object_bytes[c], KVSLAB_ALIGN);
        k->share = cfg->share[c];
        k->offset = off;
        uint64_t region = (uint64_t)((double)cfg->arena_bytes * k->share);
        uint64_t n = region / k->slot_bytes;
        if (n > UINT32_MAX)
            n = UINT32_MAX;
        if (off + n * k->slot_bytes > cfg->arena_bytes)
            n = (cfg->arena_bytes - off) / k->slot_bytes;
        if (n == 0) {
            di_fail(err, DI_EINVAL,
                    "DRAM arena of %llu bytes gives class %s (share %g) no slot of %llu bytes: "
                    "raise the DRAM size or the share",
                    (unsigned long long)cfg->arena_bytes, kvkey_class_name(c), k->share,
                    (unsigned long long)k->slot_bytes);
            kvslab_free(s);
            return DI_EINVAL;
        }
        k->slots = (uint32_t)n;
        k->limit = limit_for(k, s->capacity);
        off += n * k->slot_bytes;
        k->free = malloc((size_t)n * sizeof(uint32_t));
        k->in_use = calloc((size_t)n, 1);
        if (!k->free || !k->in_use) {
            kvslab_free(s);
            return di_fail(err, DI_ENOMEM, "cannot allocate %llu slot records",
                           (unsigned long long)n);
        }
        /* Lowest slot on top of the stack. */
        for (uint32_t i = 0; i < k->slots; i++)
            k->free[i] = k->slots - 1 - i;
        k->n_free = k->slots;
    }
    *out = s;
    return DI_OK;
}

kvslab *kvslab_free(kvslab *s)
{
    if (!s)
        return NULL;
    for (int c = 0; c < (int)KVKEY_CLASS_COUNT; c++) {
        free(s->cls[c].free);
        free(s->cls[c].in_use);
    }
    free(s);
    return NULL;
}

di_status kvslab_alloc(kvslab *s, int cls, uint32_t *slot)
{
    assert(cls >= 0 && cls < (int)KVKEY_CLASS_COUNT);
    slab_class *k = &s->cls[cls];
    if (k->used >= k->limit || k->n_free == 0)
        return DI_EFULL;
    uint32_t i = k->free[--k->n_free];
    assert(!k->in_use[i]);
    k->in_use[i] = 1;
    k->used++;
    *slot = i;
    return DI_OK;
}

void kvslab_release(kvslab *s, int cls, uint32_t slot)
{
    slab_class *k = &s->cls[cls];
    assert(slot < k->slots && k->in_use[slot]);
    k->in_use[slot] = 0;
    k->free[k->n_free++] = slot;
    k->used--;
}

void *kvslab_addr(const kvslab *s, int cls, uint32_t slot)
{
    return s->base + kvslab_offset(s, cls, slot);
}

uint64_t kvslab_offset(const kvslab *s, int cls, uint32_t slot)
{
    const slab_class *k = &s->cls[cls];
    assert(slot < k->slots);
    return k->offset + (uint64_t)slot * k->slot_bytes;
}

uint64_t kvslab_slot_bytes(const kvslab *s, int cls)
{
    return s->cls[cls].slot_bytes;
}

di_status kvslab_set_capacity(kvslab *s, uint64_t bytes, di_error *err)
{
    if (bytes > s->arena_bytes)
        return di_fail(err, DI_ERANGE,
                       "DRAM capacity %llu bytes exceeds the arena of %llu bytes mapped at "
                       "start (restart with a larger --dram-bytes)",
                       (unsigned long long)bytes, (unsigned long long)s->arena_bytes);
    for (int c = 0; c < (int)KVKEY_CLASS_COUNT; c++)
        if (limit_for(&s->cls[c], bytes) == 0)
            return di_fail(err, DI_ERANGE,
                           "DRAM capacity %llu bytes leaves class %s without a slot of %llu "
                           "bytes",
                           (unsigned long long)bytes, kvkey_class_name(c),
                           (unsigned long long)s->cls[c].slot_bytes);
    s->capacity = bytes;
    for (int c = 0; c < (int)KVKEY_CLASS_COUNT; c++)
        s->cls[c].limit = limit_for(&s->cls[c], bytes);
    return DI_OK;
}

uint64_t kvslab_capacity(const kvslab *s)
{
    return s->capacity;
}

uint64_t kvslab_arena_bytes(const kvslab *s)
{
    return s->arena_bytes;
}

int kvslab_over_limit(const kvslab *s, int cls)
{
    return s->cls[cls].used > s->cls[cls].limit;
}

void kvslab_stats(const kvslab *s, int cls, kvslab_class_stats *out)
{
    const slab_class *k = &s->cls[cls];
    out->slot_bytes = k->slot_bytes;
    out->slots = k->slots;
    out->limit = k->limit;
    out->used = k->used;
}
