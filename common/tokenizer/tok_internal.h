/* tok_internal.h: the tokenizer's private structures, shared by the files of this module only.
 *
 * Files: tok_load.c (tokenizer.json -> tok_tokenizer), tok_regex.c (Oniguruma -> PCRE2 pattern
 * rewriting, splitting), tok_bpe.c (merges and the word cache), tok_encode.c (the encode
 * pipeline), tok_decode.c (decode and streams), tok_utf8.c (validation, lossy repair),
 * tok_smap.c (string -> id hash map, added-token trie), tok_chat.c, tok_engram.c, and the
 * generated tok_ucd_patch.c (Unicode 15.0-16.0 categories for the regex translator).
 */
#ifndef DI_TOKENIZER_TOK_INTERNAL_H
#define DI_TOKENIZER_TOK_INTERNAL_H

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>
#include <pthread.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/tokenizer/tokenizer.h"

/* ---- byte buffer ------------------------------------------------------------------------ */

/* A growable byte string, always NUL-terminated once anything was appended. */
typedef struct tok_buf {
    char *p;    /* bytes; owned */
    size_t n;   /* bytes in use (excluding the NUL) */
    size_t cap; /* bytes allocated */
} tok_buf;

di_status tok_buf_reserve(tok_buf *b, size_t extra, di_error *err);
di_status tok_buf_append(tok_buf *b, const void *data, size_t len, di_error *err);
di_status tok_buf_appends(tok_buf *b, const char *s, di_error *err);
void tok_buf_free(tok_buf *b);

/* ---- UTF-8 ------------------------------------------------------------------------------- */

/* Length of the valid UTF-8 prefix of s (strict: no overlongs, surrogates or values above
 * U+10FFFF). Equals n when all of s is valid. */
size_t tok_utf8_valid_prefix(const uint8_t *s, size_t n);

/* Appends the lossy UTF-8 form of s[0, n) to out: each maximal invalid subsequence becomes
 * U+FFFD. When final is false, a trailing incomplete character (a valid prefix of one) is not
 * consumed. *used receives the bytes consumed. */
di_status tok_utf8_lossy(const uint8_t *s, size_t n, bool final, tok_buf *out, size_t *used,
                         di_error *err);

/* Decodes one code point of valid UTF-8 at s (n > 0 bytes available); returns its length. */
size_t tok_utf8_decode(const uint8_t *s, size_t n, uint32_t *cp);

/* Encodes cp into out (4 bytes room); returns the length. */
size_t tok_utf8_encode(uint32_t cp, uint8_t *out);

/* ---- string -> int32 map ----------------------------------------------------------------- */

/* Open addressing over copies of the keys. */
typedef struct tok_smap {
    int32_t *slot;     /* [mask + 1] entry index or -1; owned */
    size_t mask;       /* slots - 1 (a power of two minus one) */
    uint32_t *key_off; /* [count] offset of each key in pool; owned */
    uint32_t *key_len; /* [count] key length in bytes; owned */
    int32_t *val;      /* [count] value of each key; owned */
    uint64_t *hash;    /* [count] hash of each key; owned */
    size_t count;      /* entries */
    size_t cap;        /* entries allocated */
    tok_buf pool;      /* key bytes */
} tok_smap;

di_status tok_smap_init(tok_smap *m, size_t expect, di_error *err);
/* Value of key, or -1. */
int32_t tok_smap_get(const tok_smap *m, const void *key, size_t len);
/* Inserts key -> val unless the key exists. *found receives the existing value or -1. */
di_status tok_smap_put(tok_smap *m, const void *key, size_t len, int32_t val, int32_t *found,
                       di_error *err);
void tok_smap_free(tok_smap *m);

/* ---- added tokens ------------------------------------------------------------------------ */

/* A byte trie over added-token contents for leftmost-longest matching. */
typedef struct tok_trie_node {
    int32_t first; /* first child, -1 when none */
    int32_t next;  /* next sibling, -1 when none */
    int32_t token; /* token id ending here, -1 when none */
    uint8_t byte;  /* the byte leading from the parent here */
} tok_trie_node;

typedef struct tok_trie {
    tok_trie_node *node; /* [count] node 0 is the root; owned */
    size_t count;        /* nodes in use */
    size_t cap;          /* nodes allocated */
    int32_t root[256];   /* child of the root for each first byte, -1 when none */
} tok_trie;

di_status tok_trie_add(tok_trie *t, const uint8_t *s, size_t n, int32_t id, di_error *err);
/* Longest token starting at s[0]: its id and byte length, or -1. */
int32_t tok_trie_longest(const tok_trie *t, const uint8_t *s, size_t n, size_t *len);
void tok_trie_free(tok_trie *t);

/* ---- pre-tokenizer steps ----------------------------------------------------------------- */

typedef enum tok_step_kind {
    TOK_STEP_SPLIT,     /* split by a pattern */
    TOK_STEP_BYTELEVEL, /* optional prefix space and GPT-2 split; bytes become symbols later */
} tok_step_kind;

typedef struct tok_step {
    tok_step_kind kind;    /* set by the loader */
    pcre2_code *re;        /* SPLIT's pattern, or ByteLevel's GPT-2 pattern; NULL when none */
    bool removed;          /* SPLIT: behavior Removed (matches dropped) instead of Isolated */
    bool invert;           /* SPLIT: the pieces between matches are the "matches" */
    bool add_prefix_space; /* BYTELEVEL: prepend ' ' to a piece not starting with one */
} tok_step;

/* A range of code points assigned after Unicode 14.0 (PCRE2 10.42's tables) and up to 16.0,
 * with their general category: the regex translator adds them to \p{..} classes. */
typedef struct tok_ucd_range {
    uint32_t lo;  /* first code point */
    uint32_t hi;  /* last code point */
    char gc[3];   /* general category, two letters ("So") */
} tok_ucd_range;

extern const tok_ucd_range TOK_UCD_PATCH[]; /* tok_ucd_patch.c, generated */
extern const size_t TOK_UCD_PATCH_N;

/* Compiles a tokenizer.json pattern. is_regex false: a literal string. Returns DI_OK,
 * DI_EINVAL (PCRE2 rejected it: its message and offset), DI_EUNSUPPORTED (an Oniguruma
 * construct with no PCRE2 equivalent), DI_ENOMEM. */
di_status tok_regex_compile(const char *pattern, size_t len, bool is_regex, pcre2_code **out,
                            di_error *err);

/* Rewrites an Oniguruma pattern for PCRE2 (exposed for tests). *out is a tok_buf the caller
 * frees. */
di_status tok_regex_translate(const char *pattern, size_t len, tok_buf *out, di_error *err);

/* Per-call matching scratch (one per tok_encode call). */
typedef struct tok_matcher {
    pcre2_match_data *md;        /* one ovector pair */
    pcre2_match_context *mctx;   /* with jit_stack once a match ran out of JIT stack */
    pcre2_jit_stack *jit_stack;  /* NULL until needed */
} tok_matcher;

di_status tok_matcher_init(tok_matcher *m, di_error *err);
void tok_matcher_free(tok_matcher *m);

/* Finds the next non-empty match of re in s[0, n) at or after off: DI_OK with start and end
 * set, or DI_ENOENT when there is none. */
di_status tok_regex_next(tok_matcher *m, const pcre2_code *re, const char *s, size_t n,
                         size_t off, size_t *start, size_t *end, di_error *err);

/* ---- the tokenizer ----------------------------------------------------------------------- */

enum {
    TOK_ID_PRESENT = 1u << 0, /* the id has a token */
    TOK_ID_ADDED = 1u << 1,   /* an added token (content matched before splitting) */
    TOK_ID_SPECIAL = 1u << 2, /* an added token flagged special */
};

/* One BPE merge, found by the pair of ids it joins. */
typedef struct tok_merge_slot {
    uint64_t key;   /* (left id << 32) | right id; UINT64_MAX when the slot is empty */
    int32_t rank;   /* position in the merges list: lower merges first */
    int32_t merged; /* id of the joined token */
} tok_merge_slot;

/* Word cache: sharded so that threads encoding at once rarely share a lock. */
#define TOK_CACHE_SHARDS 16
#define TOK_CACHE_MAX_WORD 48 /* words longer than this (bytes) are not cached */

typedef struct tok_cache_shard {
    pthread_mutex_t lock; /* guards everything below */
    uint64_t *hash;       /* [slots] hash of the cached word, 0 when empty */
    uint32_t *off;        /* [slots] offset of the entry in data */
    size_t slots;         /* a power of two */
    size_t used;          /* slots in use */
    uint8_t *data;        /* entries: word length, word bytes, id count, ids (int32) */
    size_t data_n;        /* bytes in use */
    size_t data_cap;      /* bytes allocated; the shard is emptied when full */
} tok_cache_shard;

typedef enum tok_norm_form {
    TOK_NORM_NFC,
    TOK_NORM_NFD,
    TOK_NORM_NFKC,
    TOK_NORM_NFKD,
} tok_norm_form;

#define TOK_MAX_STEPS 8
#define TOK_MAX_NORMS 8

struct tok_tokenizer {
    int32_t n_ids;           /* ids run over [0, n_ids) */
    uint8_t *id_flags;       /* [n_ids] TOK_ID_* */
    uint32_t *str_off;       /* [n_ids] stored form (vocab string / content) offset in pool */
    uint32_t *str_len;       /* [n_ids] its length */
    uint32_t *bytes_off;     /* [n_ids] decoded bytes offset in pool */
    uint32_t *bytes_len;     /* [n_ids] decoded bytes length */
    tok_buf pool;            /* all strings and bytes, each NUL-terminated */
    tok_smap vocab;          /* model vocab string -> id */
    tok_smap added_by_text;  /* added token content -> id */

    tok_merge_slot *merges;  /* open-addressed merge table; owned */
    size_t merge_mask;       /* slots - 1 */
    int32_t n_merges;        /* merges loaded */
    int32_t byte_id[256];    /* id of each byte's single-byte token, -1 when missing */
    uint32_t byte_cp[256];   /* GPT-2 code point standing for each byte */
    bool ignore_merges;      /* a word that is itself in the vocab is one token */
    int32_t unk_id;          /* model.unk_token's id, stands for bytes with no token; or -1 */

    tok_trie added_raw;      /* added tokens with normalized=false */
    tok_trie added_norm;     /* added tokens with normalized=true */
    size_t n_added;          /* added tokens */

    tok_norm_form norm[TOK_MAX_NORMS]; /* normalizer sequence */
    size_t n_norm;                     /* 0: no normalizer */

    tok_step step[TOK_MAX_STEPS]; /* pre-tokenizer sequence; the last is ByteLevel */
    size_t n_steps;               /* at least 1 */

    int32_t bos_id, eos_id, pad_id; /* from tokenizer_config.json, -1 when unknown */

    tok_cache_shard cache[TOK_CACHE_SHARDS]; /* word -> ids */
    bool cache_ready;                        /* shards initialised */
};

/* BPE of one pre-token (raw bytes), appending ids to out. Uses and fills the word cache. */
di_status tok_bpe_word(const tok_tokenizer *t, const uint8_t *w, size_t n, tok_ids *out,
                       di_error *err);

/* Looks a merge up: rank or -1, and the merged id in *merged. */
int32_t tok_merge_find(const tok_tokenizer *t, int32_t left, int32_t right, int32_t *merged);

void tok_cache_init(tok_tokenizer *t);
void tok_cache_free(tok_tokenizer *t);

/* One Unicode normalisation form of s (valid UTF-8, may hold NUL) through utf8proc: a
 * malloc'd, NUL-terminated result in *out / *out_len. DI_EINTERNAL when utf8proc refuses. */
di_status tok_unicode_form(const char *s, size_t n, tok_norm_form form, char **out,
                           size_t *out_len, di_error *err);

/* GPT-2 byte <-> code point map of the ByteLevel pre-tokenizer and decoder: every code point
 * of the map is below TOK_BYTE_MAP_CPS; cp_to_byte is -1 for the others. */
#define TOK_BYTE_MAP_CPS 324
void tok_byte_map(uint32_t byte_to_cp[256], int16_t cp_to_byte[TOK_BYTE_MAP_CPS]);

#endif
