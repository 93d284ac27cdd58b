/* tok_smap.c: string -> int32 hash map (vocabularies, Engram keys) and the added-token trie. */
#include <stdlib.h>
#include <string.h>

#include "common/tokenizer/tok_internal.h"
#include "common/util/hash64.h"

#define SMAP_SEED 0x746F6B2D736D6170ull

static size_t slots_for(size_t entries)
{
    size_t s = 16;
    while (s < entries * 2)
        s *= 2;
    return s;
}

static di_status smap_alloc_slots(tok_smap *m, size_t slots, di_error *err)
{
    int32_t *slot = malloc(slots * sizeof *slot);
    if (!slot)
        return di_fail(err, DI_ENOMEM, "out of memory for a map of %zu slots", slots);
    memset(slot, 0xFF, slots * sizeof *slot);
    free(m->slot);
    m->slot = slot;
    m->mask = slots - 1;
    return DI_OK;
}

di_status tok_smap_init(tok_smap *m, size_t expect, di_error *err)
{
    memset(m, 0, sizeof *m);
    return smap_alloc_slots(m, slots_for(expect), err);
}

static size_t smap_find(const tok_smap *m, const void *key, size_t len, uint64_t h)
{
    size_t i = (size_t)h & m->mask;
    for (;;) {
        int32_t e = m->slot[i];
        if (e < 0)
            return i;
        if (m->hash[e] == h && m->key_len[e] == len &&
            memcmp(m->pool.p + m->key_off[e], key, len) == 0)
            return i;
        i = (i + 1) & m->mask;
    }
}

int32_t tok_smap_get(const tok_smap *m, const void *key, size_t len)
{
    if (!m->slot)
        return -1;
    uint64_t h = di_hash64(key, len, SMAP_SEED);
    int32_t e = m->slot[smap_find(m, key, len, h)];
    return e < 0 ? -1 : m->val[e];
}

static di_status smap_grow_entries(tok_smap *m, di_error *err)
{
    size_t cap = m->cap ? m->cap * 2 : 64;
    uint32_t *off = realloc(m->key_off, cap * sizeof *off);
    if (off)
        m->key_off = off;
    uint32_t *len = off ? realloc(m->key_len, cap * sizeof *len) : NULL;
    if (len)
        m->key_len = len;
    int32_t *val = len ? realloc(m->val, cap * sizeof *val) : NULL;
    if (val)
        m->val = val;
    uint64_t *hash = val ? realloc(m->hash, cap * sizeof *hash) : NULL;
    if (!hash)
        return di_fail(err, DI_ENOMEM, "out of memory growing a map to %zu entries", cap);
    m->hash = hash;
    m->cap = cap;
    return DI_OK;
}

static di_status smap_rehash(tok_smap *m, di_error *err)
{
    di_status st = smap_alloc_slots(m, (m->mask + 1) * 2, err);
    if (st)
        return st;
    for (size_t e = 0; e < m->count; e++) {
        size_t i = (size_t)m->hash[e] & m->mask;
        while (m->slot[i] >= 0)
            i = (i + 1) & m->mask;
        m->slot[i] = (int32_t)e;
    }
    return DI_OK;
}

di_status tok_smap_put(tok_smap *m, const void *key, size_t len, int32_t val, int32_t *found,
                       di_error *err)
{
    uint64_t h = di_hash64(key, len, SMAP_SEED);
    size_t i = smap_find(m, key, len, h);
    if (m->slot[i] >= 0) {
        *found = m->val[m->slot[i]];
        return DI_OK;
    }
    *found = -1;
    if (m->count >= INT32_MAX - 1 || m->pool.n + len + 1 > UINT32_MAX)
        return di_fail(err, DI_ENOMEM, "map is full (%zu entries)", m->count);
    di_status st = DI_OK;
    if (m->count == m->cap)
        st = smap_grow_entries(m, err);
    size_t off = m->pool.n;
    if (!st)
        st = tok_buf_append(&m->pool, key, len, err);
    if (!st)
        st = tok_buf_append(&m->pool, "", 1, err); /* keys stay NUL-terminated */
    if (st)
        return st;
    size_t e = m->count++;
    m->key_off[e] = (uint32_t)off;
    m->key_len[e] = (uint32_t)len;
    m->val[e] = val;
    m->hash[e] = h;
    m->slot[i] = (int32_t)e;
    if (m->count * 2 > m->mask + 1)
        return smap_rehash(m, err);
    return DI_OK;
}

void tok_smap_free(tok_smap *m)
{
    if (!m)
        return;
    free(m->slot);
    free(m->key_off);
    free(m->key_len);
    free(m->val);
    free(m->hash);
    tok_buf_free(&m->pool);
    memset(m, 0, sizeof *m);
}

/* ---- trie --------------------------------------------------------------------------------- */

static di_status trie_new_node(tok_trie *t, uint8_t byte, int32_t *out, di_error *err)
{
    if (t->count == t->cap) {
        size_t cap = t->cap ? t->cap * 2 : 64;
        tok_trie_node *n = realloc(t->node, cap * sizeof *n);
        if (!n)
            return di_fail(err, DI_ENOMEM, "out of memory growing the added-token trie");
        t->node = n;
        t->cap = cap;
    }
    int32_t k = (int32_t)t->count++;
    t->node[k] = (tok_trie_node){.first = -1, .next = -1, .token = -1, .byte = byte};
    *out = k;
    return DI_OK;
}

static int32_t trie_child(const tok_trie *t, int32_t node, uint8_t byte)
{
    for (int32_t c = t->node[node].first; c >= 0; c = t->node[c].next)
        if (t->node[c].byte == byte)
            return c;
    return -1;
}

di_status tok_trie_add(tok_trie *t, const uint8_t *s, size_t n, int32_t id, di_error *err)
{
    if (n == 0)
        return di_fail(err, DI_EINVAL, "added token %d has empty content", (int)id);
    di_status st;
    if (t->count == 0) {
        int32_t root;
        if ((st = trie_new_node(t, 0, &root, err)))
            return st;
        for (int b = 0; b < 256; b++)
            t->root[b] = -1;
    }
    int32_t cur = t->root[s[0]];
    if (cur < 0) {
        if ((st = trie_new_node(t, s[0], &cur, err)))
            return st;
        t->root[s[0]] = cur;
    }
    for (size_t i = 1; i < n; i++) {
        int32_t c = trie_child(t, cur, s[i]);
        if (c < 0) {
            if ((st = trie_new_node(t, s[i], &c, err)))
                return st;
            t->node[c].next = t->node[cur].first;
            t->node[cur].first = c;
        }
        cur = c;
    }
    if (t->node[cur].token < 0)
        t->node[cur].token = id; /* the first added token with this content wins */
    return DI_OK;
}

int32_t tok_trie_longest(const tok_trie *t, const uint8_t *s, size_t n, size_t *len)
{
    if (t->count == 0 || n == 0)
        return -1;
    int32_t cur = t->root[s[0]], best = -1;
    size_t i = 1;
    while (cur >= 0) {
        if (t->node[cur].token >= 0) {
            best = t->node[cur].token;
            *len = i;
        }
        if (i == n)
            break;
        cur = trie_child(t, cur, s[i++]);
    }
    return best;
}

void tok_trie_free(tok_trie *t)
{
    if (!t)
        return;
    free(t->node);
    memset(t, 0, sizeof *t);
}
