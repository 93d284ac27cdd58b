/* tok_bpe.c: byte-pair merges of one pre-token, and the word cache.
 *
 * A word starts as one symbol per byte (the id of that byte's token). Every adjacent pair
 * with a merge goes into a min-heap ordered by (merge rank, position); the top entry is
 * applied unless it went stale (one of its symbols was merged away or changed), and the new
 * symbol's pairs with its neighbours are pushed. This is the order HF tokenizers applies:
 * lowest rank first, leftmost among equal ranks.
 */
#include <stdlib.h>
#include <string.h>

#include "common/tokenizer/tok_internal.h"
#include "common/util/hash64.h"

int32_t tok_merge_find(const tok_tokenizer *t, int32_t left, int32_t right, int32_t *merged)
{
    uint64_t key = ((uint64_t)(uint32_t)left << 32) | (uint32_t)right;
    size_t i = (size_t)((key * 0x9E3779B97F4A7C15ull) >> 20) & t->merge_mask;
    for (;;) {
        const tok_merge_slot *s = &t->merges[i];
        if (s->key == key) {
            *merged = s->merged;
            return s->rank;
        }
        if (s->key == UINT64_MAX)
            return -1;
        i = (i + 1) & t->merge_mask;
    }
}

/* ---- heap of candidate merges ------------------------------------------------------------ */

typedef struct bpe_cand {
    int32_t rank; /* merge rank: lower first */
    int32_t pos;  /* left symbol's index: lower first among equal ranks */
} bpe_cand;

static bool cand_less(bpe_cand a, bpe_cand b)
{
    return a.rank < b.rank || (a.rank == b.rank && a.pos < b.pos);
}

static void heap_push(bpe_cand *h, size_t *n, bpe_cand c)
{
    size_t i = (*n)++;
    while (i > 0) {
        size_t p = (i - 1) / 2;
        if (!cand_less(c, h[p]))
            break;
        h[i] = h[p];
        i = p;
    }
    h[i] = c;
}

static bpe_cand heap_pop(bpe_cand *h, size_t *n)
{
    bpe_cand top = h[0], last = h[--(*n)];
    size_t i = 0;
    for (;;) {
        size_t l = 2 * i + 1;
        if (l >= *n)
            break;
        size_t m = (l + 1 < *n && cand_less(h[l + 1], h[l])) ? l + 1 : l;
        if (!cand_less(h[m], last))
            break;
        h[i] = h[m];
        i = m;
    }
    h[i] = last;
    return top;
}

/* ---- merging ------------------------------------------------------------------------------ */

/* Scratch for one word: symbols as a linked list plus the heap. */
typedef struct bpe_work {
    int32_t *id;   /* [n] symbol ids; -1 once merged into its left neighbour */
    int32_t *prev; /* [n] previous live symbol, -1 at the start */
    int32_t *next; /* [n] next live symbol, -1 at the end */
    bpe_cand *heap; /* [3n] candidates */
    size_t nheap;   /* candidates in the heap */
} bpe_work;

static void push_pair(const tok_tokenizer *t, bpe_work *w, int32_t pos)
{
    int32_t nx = w->next[pos], merged = -1;
    if (nx < 0)
        return;
    int32_t rank = tok_merge_find(t, w->id[pos], w->id[nx], &merged);
    if (rank >= 0)
        heap_push(w->heap, &w->nheap, (bpe_cand){rank, pos});
}

static void bpe_run(const tok_tokenizer *t, bpe_work *w, int32_t n)
{
    for (int32_t i = 0; i + 1 < n; i++)
        push_pair(t, w, i);
    while (w->nheap) {
        bpe_cand c = heap_pop(w->heap, &w->nheap);
        int32_t nx = w->next[c.pos], merged = -1;
        if (w->id[c.pos] < 0 || nx < 0)
            continue;
        if (tok_merge_find(t, w->id[c.pos], w->id[nx], &merged) != c.rank)
            continue; /* stale: the pair changed since it was pushed */
        w->id[c.pos] = merged;
        w->id[nx] = -1;
        w->next[c.pos] = w->next[nx];
        if (w->next[nx] >= 0)
            w->prev[w->next[nx]] = c.pos;
        if (w->prev[c.pos] >= 0)
            push_pair(t, w, w->prev[c.pos]);
        push_pair(t, w, c.pos);
    }
}

#define BPE_STACK_WORD 64

static di_status bpe_merge(const tok_tokenizer *t, const uint8_t *s, size_t n, tok_ids *out,
                           di_error *err)
{
    int32_t id_s[BPE_STACK_WORD], prev_s[BPE_STACK_WORD], next_s[BPE_STACK_WORD];
    bpe_cand heap_s[3 * BPE_STACK_WORD];
    bpe_work w = {id_s, prev_s, next_s, heap_s, 0};
    void *blk = NULL;
    if (n > BPE_STACK_WORD) {
        blk = malloc(n * (3 * sizeof(int32_t) + 3 * sizeof(bpe_cand)));
        if (!blk)
            return di_fail(err, DI_ENOMEM, "out of memory merging a word of %zu bytes", n);
        w.id = blk;
        w.prev = w.id + n;
        w.next = w.prev + n;
        w.heap = (bpe_cand *)(w.next + n);
    }
    di_status st = DI_OK;
    for (size_t i = 0; i < n && !st; i++) {
        w.id[i] = t->byte_id[s[i]];
        w.prev[i] = (int32_t)i - 1;
        w.next[i] = i + 1 < n ? (int32_t)i + 1 : -1;
        if (w.id[i] < 0)
            st = di_fail(err, DI_EUNSUPPORTED, "byte 0x%02X has no token in the vocabulary",
                         s[i]);
    }
    if (!st)
        bpe_run(t, &w, (int32_t)n);
    for (int32_t i = 0; !st && i >= 0; i = w.next[i])
        st = tok_ids_push(out, w.id[i], err);
    free(blk);
    return st;
}

/* The byte-level string of a word, looked up whole (ignore_merges). */
static int32_t whole_word_id(const tok_tokenizer *t, const uint8_t *s, size_t n, di_error *err,
                             di_status *st)
{
    tok_buf b = {0};
    int32_t id = -1;
    *st = tok_buf_reserve(&b, 2 * n, err);
    for (size_t i = 0; i < n && !*st; i++) {
        uint8_t u[4];
        *st = tok_buf_append(&b, u, tok_utf8_encode(t->byte_cp[s[i]], u), err);
    }
    if (!*st)
        id = tok_smap_get(&t->vocab, b.p, b.n);
    tok_buf_free(&b);
    return id;
}

/* ---- word cache --------------------------------------------------------------------------- */

#define CACHE_SLOTS 4096
#define CACHE_BYTES (256 * 1024)

void tok_cache_init(tok_tokenizer *t)
{
    /* shard memory comes with the first word stored in it */
    for (int k = 0; k < TOK_CACHE_SHARDS; k++) {
        memset(&t->cache[k], 0, sizeof t->cache[k]);
        pthread_mutex_init(&t->cache[k].lock, NULL);
    }
    t->cache_ready = true;
}

void tok_cache_free(tok_tokenizer *t)
{
    if (!t->cache_ready)
        return;
    for (int k = 0; k < TOK_CACHE_SHARDS; k++) {
        free(t->cache[k].hash);
        free(t->cache[k].off);
        free(t->cache[k].data);
        pthread_mutex_destroy(&t->cache[k].lock);
    }
    t->cache_ready = false;
}

/* Gives an empty shard its memory (under its lock); false when there is none to be had: the
 * word is then simply not cached. */
static bool shard_alloc(tok_cache_shard *c)
{
    if (c->hash)
        return true;
    c->hash = calloc(CACHE_SLOTS, sizeof *c->hash);
    c->off = calloc(CACHE_SLOTS, sizeof *c->off);
    c->data = malloc(CACHE_BYTES);
    if (!c->hash || !c->off || !c->data) {
        free(c->hash);
        free(c->off);
        free(c->data);
        c->hash = NULL;
        c->off = NULL;
        c->data = NULL;
        return false;
    }
    c->slots = CACHE_SLOTS;
    c->data_cap = CACHE_BYTES;
    return true;
}

/* Entry layout in data: word length (1 byte), word, id count (1 byte), ids (int32 each). */
static size_t cache_probe(const tok_cache_shard *c, uint64_t h, const uint8_t *w, size_t n)
{
    size_t i = (size_t)(h >> 20) & (c->slots - 1);
    while (c->hash[i]) {
        const uint8_t *e = c->data + c->off[i];
        if (c->hash[i] == h && e[0] == n && memcmp(e + 1, w, n) == 0)
            return i;
        i = (i + 1) & (c->slots - 1);
    }
    return i;
}

static bool cache_get(tok_tokenizer *tm, uint64_t h, const uint8_t *w, size_t n, tok_ids *out,
                      di_error *err, di_status *st)
{
    tok_cache_shard *c = &tm->cache[h % TOK_CACHE_SHARDS];
    bool hit = false;
    pthread_mutex_lock(&c->lock);
    size_t i = c->hash ? cache_probe(c, h, w, n) : 0;
    if (c->hash && c->hash[i]) {
        const uint8_t *e = c->data + c->off[i] + 1 + n;
        size_t k = e[0];
        hit = true;
        *st = DI_OK;
        for (size_t j = 0; j < k && !*st; j++) {
            int32_t id;
            memcpy(&id, e + 1 + 4 * j, 4);
            *st = tok_ids_push(out, id, err);
        }
    }
    pthread_mutex_unlock(&c->lock);
    return hit;
}

static void cache_put(tok_tokenizer *tm, uint64_t h, const uint8_t *w, size_t n,
                      const int32_t *ids, size_t k)
{
    tok_cache_shard *c = &tm->cache[h % TOK_CACHE_SHARDS];
    size_t need = 2 + n + 4 * k;
    pthread_mutex_lock(&c->lock);
    if (!shard_alloc(c)) {
        pthread_mutex_unlock(&c->lock);
        return;
    }
    if (c->used * 2 >= c->slots || c->data_n + need > c->data_cap) {
        memset(c->hash, 0, c->slots * sizeof *c->hash); /* full: start over */
        c->used = 0;
        c->data_n = 0;
    }
    size_t i = cache_probe(c, h, w, n);
    if (!c->hash[i]) {
        uint8_t *e = c->data + c->data_n;
        e[0] = (uint8_t)n;
        memcpy(e + 1, w, n);
        e[1 + n] = (uint8_t)k;
        memcpy(e + 2 + n, ids, 4 * k);
        c->hash[i] = h;
        c->off[i] = (uint32_t)c->data_n;
        c->data_n += need;
        c->used++;
    }
    pthread_mutex_unlock(&c->lock);
}

di_status tok_bpe_word(const tok_tokenizer *t, const uint8_t *w, size_t n, tok_ids *out,
                       di_error *err)
{
    /* The cache is the one mutable part of a tokenizer; its shards carry their own locks. */
    tok_tokenizer *tm = (tok_tokenizer *)t;
    bool cacheable = t->cache_ready && n <= TOK_CACHE_MAX_WORD;
    uint64_t h = 0;
    di_status st = DI_OK;
    if (n == 1 && t->byte_id[w[0]] >= 0)
        return tok_ids_push(out, t->byte_id[w[0]], err);
    if (cacheable) {
        h = di_hash64(w, n, 0x776F7264ull) | 1; /* 0 marks an empty slot */
        if (cache_get(tm, h, w, n, out, err, &st))
            return st;
    }
    size_t first = out->n;
    if (t->ignore_merges) {
        int32_t id = whole_word_id(t, w, n, err, &st);
        if (st)
            return st;
        if (id >= 0)
            st = tok_ids_push(out, id, err);
        else
            st = bpe_merge(t, w, n, out, err);
    } else {
        st = bpe_merge(t, w, n, out, err);
    }
    if (st) {
        out->n = first;
        return st;
    }
    if (cacheable)
        cache_put(tm, h, w, n, out->v + first, out->n - first);
    return DI_OK;
}
