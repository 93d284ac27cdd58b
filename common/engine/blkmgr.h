/* blkmgr.h: the KV block pool of one rank.
 *
 * Blocks are 128 token positions (DESIGN.md §5). The manager is a free list plus a reference
 * count per block (explainer Pass 2, "The 129 blocks"):
 *   - block 0 is never handed out: 0 in a block table means "empty" (placeholder rows use it);
 *   - allocation takes blocks from the head of the free list and sets their count to 1;
 *   - freeing takes 1 off each count and puts the block on the tail only when it reaches 0;
 *   - a fork shares the parent's full blocks (count + 1) and gives the child a fresh copy of
 *     the last, partial one: the caller copies the KV bytes of (src -> dst).
 * The free list is a ring of block ids, so every operation is O(blocks touched).
 *
 * Block refcount states (blkmgr_check asserts them):
 *   FREE (count 0, on the free list) --blkmgr_alloc--> OWNED (count 1)
 *   OWNED (count n) --blkmgr_share / blkmgr_fork--> OWNED (count n + 1)
 *   OWNED (count n > 1) --blkmgr_free--> OWNED (count n - 1)
 *   OWNED (count 1) --blkmgr_free--> FREE (appended at the tail)
 */
#ifndef DI_ENGINE_BLKMGR_H
#define DI_ENGINE_BLKMGR_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/util/alloc.h"
#include "common/util/status.h"

#define BLKMGR_BLOCK_TOKENS 128u

typedef struct blkmgr {
    uint32_t n_blocks;     /* pool size, block 0 included (blocks) */
    uint32_t *refcount;    /* [n_blocks] owners of each block; refcount[0] is always 0 */
    uint32_t *ring;        /* [n_blocks - 1] free block ids, FIFO */
    uint32_t head;         /* ring index of the next block handed out */
    uint32_t n_free;       /* blocks on the free list */
    uint32_t *scratch;     /* [n_blocks] owner counts, used by the check only */
    uint32_t check_bad;    /* check: first out-of-range block named by an owner, + 1; 0 none */
    const di_alloc *alloc; /* allocator the arrays came from (NULL = libc) */
} blkmgr;

/* A block copy a fork needs: the caller copies block src's KV bytes into block dst before the
 * child's first step. src == dst == 0 means there is nothing to copy. */
typedef struct blkmgr_copy {
    uint32_t src;
    uint32_t dst;
} blkmgr_copy;

/* Creates a pool of n_blocks blocks (2 .. 2^31): blocks 1 .. n_blocks - 1 free, in order.
 * DI_OK with *out set; DI_EINVAL; DI_ENOMEM. On failure *out is untouched. */
di_status blkmgr_create(uint32_t n_blocks, const di_alloc *a, blkmgr **out, di_error *err);
/* Frees the pool. NULL-safe. */
void blkmgr_destroy(blkmgr *bm);

static inline uint32_t blkmgr_free_count(const blkmgr *bm) { return bm->n_free; }
/* Blocks that can ever be handed out: n_blocks - 1. */
static inline uint32_t blkmgr_usable(const blkmgr *bm) { return bm->n_blocks - 1; }
static inline uint32_t blkmgr_used(const blkmgr *bm) { return bm->n_blocks - 1 - bm->n_free; }
static inline uint32_t blkmgr_refcount(const blkmgr *bm, uint32_t block)
{
    return block < bm->n_blocks ? bm->refcount[block] : 0;
}

/* Hands out n blocks from the head of the free list into out[0..n), each with count 1.
 * All or nothing: DI_EFULL when fewer than n are free (nothing changes). n == 0 is DI_OK. */
di_status blkmgr_alloc(blkmgr *bm, uint32_t n, uint32_t *out, di_error *err);
/* Drops one reference to each of blocks[0..n); a block reaching 0 goes to the tail. Every
 * block must be owned (asserted). */
void blkmgr_free(blkmgr *bm, const uint32_t *blocks, uint32_t n);
/* Adds one reference to each of blocks[0..n) (all owned, asserted). */
void blkmgr_share(blkmgr *bm, const uint32_t *blocks, uint32_t n);

/* Forks a block table whose first num_tokens positions hold KV: the child gets
 * num_tokens / 128 shared full blocks and, when num_tokens % 128 != 0, one fresh block that
 * the caller fills by copying *copy. Writes seq_blocks_for(num_tokens) ids to dst and the copy
 * pair (0, 0 when none). src must hold at least that many blocks.
 * DI_OK; DI_EFULL when the partial block cannot be allocated (nothing changes). */
di_status blkmgr_fork(blkmgr *bm, const uint32_t *src, uint32_t num_tokens, uint32_t *dst,
                      blkmgr_copy *copy, di_error *err);

/* The invariant check, in three calls so an owner can be walked without building a list:
 * begin, then owner() once per block table, then end. end returns DI_OK when the free list
 * plus the referenced blocks make up the whole pool, block 0 is neither free nor owned, every
 * free block has count 0 and appears once, and every count equals the number of tables naming
 * the block; DI_EINTERNAL naming the first broken rule otherwise. Debug use: O(pool). */
void blkmgr_check_begin(blkmgr *bm);
void blkmgr_check_owner(blkmgr *bm, const uint32_t *blocks, uint32_t n);
di_status blkmgr_check_end(blkmgr *bm, di_error *err);

#endif
