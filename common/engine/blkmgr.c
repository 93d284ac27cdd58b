#include "common/engine/blkmgr.h"

#include <assert.h>

di_status blkmgr_create(uint32_t n_blocks, const di_alloc *a, blkmgr **out, di_error *err)
{
    if (n_blocks < 2 || n_blocks > (1u << 31))
        return di_fail(err, DI_EINVAL, "block count %u outside [2, 2^31] (block 0 is reserved)",
                       n_blocks);
    blkmgr *bm = di_alloc_zero(a, 1, sizeof(*bm));
    if (!bm)
        return di_fail(err, DI_ENOMEM, "out of memory for the block manager");
    bm->alloc = a;
    bm->n_blocks = n_blocks;
    bm->refcount = di_alloc_zero(a, n_blocks, sizeof(uint32_t));
    bm->ring = di_alloc_zero(a, n_blocks - 1, sizeof(uint32_t));
    bm->scratch = di_alloc_zero(a, n_blocks, sizeof(uint32_t));
    if (!bm->refcount || !bm->ring || !bm->scratch) {
        blkmgr_destroy(bm);
        return di_fail(err, DI_ENOMEM, "out of memory for %u block counters", n_blocks);
    }
    for (uint32_t i = 0; i < n_blocks - 1; i++)
        bm->ring[i] = i + 1;
    bm->n_free = n_blocks - 1;
    *out = bm;
    return DI_OK;
}

void blkmgr_destroy(blkmgr *bm)
{
    if (!bm)
        return;
    const di_alloc *a = bm->alloc;
    di_alloc_release(a, bm->refcount);
    di_alloc_release(a, bm->ring);
    di_alloc_release(a, bm->scratch);
    di_alloc_release(a, bm);
}

di_status blkmgr_alloc(blkmgr *bm, uint32_t n, uint32_t *out, di_error *err)
{
    if (n > bm->n_free)
        return di_fail(err, DI_EFULL, "%u blocks wanted, %u free", n, bm->n_free);
    uint32_t cap = bm->n_blocks - 1;
    for (uint32_t i = 0; i < n; i++) {
        uint32_t b = bm->ring[bm->head];
        bm->head = bm->head + 1 == cap ? 0 : bm->head + 1;
        assert(b != 0 && bm->refcount[b] == 0);
        bm->refcount[b] = 1;
        out[i] = b;
    }
    bm->n_free -= n;
    return DI_OK;
}

void blkmgr_free(blkmgr *bm, const uint32_t *blocks, uint32_t n)
{
    uint32_t cap = bm->n_blocks - 1;
    for (uint32_t i = 0; i < n; i++) {
        uint32_t b = blocks[i];
        assert(b != 0 && b < bm->n_blocks && bm->refcount[b] > 0);
        if (--bm->refcount[b] != 0)
            continue;
        uint32_t tail = bm->head + bm->n_free;
        if (tail >= cap)
            tail -= cap;
        bm->ring[tail] = b;
        bm->n_free++;
    }
}

void blkmgr_share(blkmgr *bm, const uint32_t *blocks, uint32_t n)
{
    for (uint32_t i = 0; i < n; i++) {
        assert(blocks[i] != 0 && blocks[i] < bm->n_blocks && bm->refcount[blocks[i]] > 0);
        bm->refcount[blocks[i]]++;
    }
}

di_status blkmgr_fork(blkmgr *bm, const uint32_t *src, uint32_t num_tokens, uint32_t *dst,
                      blkmgr_copy *copy, di_error *err)
{
    uint32_t full = num_tokens / BLKMGR_BLOCK_TOKENS;
    bool partial = num_tokens % BLKMGR_BLOCK_TOKENS != 0;
    blkmgr_copy c = {0, 0};
    if (partial) {
        uint32_t fresh;
        di_status st = blkmgr_alloc(bm, 1, &fresh, err);
        if (st != DI_OK) {
            di_error_prefix(err, "fork: copy of the partial block %u: ", full);
            return st;
        }
        c = (blkmgr_copy){src[full], fresh};
        dst[full] = fresh;
    }
    blkmgr_share(bm, src, full);
    memcpy(dst, src, (size_t)full * sizeof(uint32_t));
    *copy = c;
    return DI_OK;
}

void blkmgr_check_begin(blkmgr *bm)
{
    memset(bm->scratch, 0, (size_t)bm->n_blocks * sizeof(uint32_t));
    bm->check_bad = 0;
}

void blkmgr_check_owner(blkmgr *bm, const uint32_t *blocks, uint32_t n)
{
    for (uint32_t i = 0; i < n; i++) {
        uint32_t b = blocks[i];
        if (b == 0 || b >= bm->n_blocks) {
            if (!bm->check_bad)
                bm->check_bad = b + 1;
            continue;
        }
        bm->scratch[b]++;
    }
}

di_status blkmgr_check_end(blkmgr *bm, di_error *err)
{
    if (bm->check_bad)
        return di_fail(err, DI_EINTERNAL, "a block table names block %u (pool of %u, 0 reserved)",
                       bm->check_bad - 1, bm->n_blocks);
    if (bm->refcount[0] != 0)
        return di_fail(err, DI_EINTERNAL, "block 0 has %u owners", bm->refcount[0]);
    uint32_t cap = bm->n_blocks - 1;
    if (bm->n_free > cap || bm->head >= cap)
        return di_fail(err, DI_EINTERNAL, "free list: %u free, head %u, pool %u", bm->n_free,
                       bm->head, cap);
    /* mark free blocks in scratch's top bit; owners must not name them */
    const uint32_t mark = 1u << 31;
    for (uint32_t i = 0, r = bm->head; i < bm->n_free; i++, r = r + 1 == cap ? 0 : r + 1) {
        uint32_t b = bm->ring[r];
        if (b == 0 || b >= bm->n_blocks)
            return di_fail(err, DI_EINTERNAL, "free list entry %u is block %u", i, b);
        if (bm->scratch[b] & mark)
            return di_fail(err, DI_EINTERNAL, "block %u is twice on the free list", b);
        if (bm->refcount[b] != 0 || bm->scratch[b] != 0)
            return di_fail(err, DI_EINTERNAL, "free block %u has count %u and %u owners", b,
                           bm->refcount[b], bm->scratch[b]);
        bm->scratch[b] |= mark;
    }
    uint32_t referenced = 0;
    for (uint32_t b = 1; b < bm->n_blocks; b++) {
        if (bm->scratch[b] & mark)
            continue;
        if (bm->scratch[b] == 0)
            return di_fail(err, DI_EINTERNAL, "block %u (count %u) is neither free nor owned "
                           "(leaked)", b, bm->refcount[b]);
        if (bm->refcount[b] != bm->scratch[b])
            return di_fail(err, DI_EINTERNAL, "block %u has count %u but %u owners", b,
                           bm->refcount[b], bm->scratch[b]);
        referenced++;
    }
    if (referenced + bm->n_free != cap)
        return di_fail(err, DI_EINTERNAL, "%u referenced + %u free != %u blocks", referenced,
                       bm->n_free, cap);
    return DI_OK;
}
