/* tokenizer.h: HF byte-level BPE tokenizers loaded from tokenizer.json, the DeepSeek chat
 * format, streaming detokenisation and Engram's compressed-token map. Prefix: tok_.
 *
 * What a tokenizer.json may declare (anything else is refused at load with a message naming
 * it, e.g. "unsupported pre_tokenizer type 'Metaspace'"):
 *   model          BPE with a vocab and merges ("a b" strings or ["a", "b"] pairs), optional
 *                  ignore_merges and unk_token (stands for a byte with no token); no dropout,
 *                  byte_fallback, fuse_unk, continuing_subword_prefix or end_of_word_suffix.
 *   normalizer     null, or a Sequence of NFC / NFD / NFKC / NFKD (utf8proc).
 *   pre_tokenizer  Split and ByteLevel steps, alone or in a Sequence, ending with exactly one
 *                  ByteLevel (the bytes of each piece are what BPE merges). Split takes a
 *                  Regex or a String pattern with behavior Isolated or Removed and any invert;
 *                  ByteLevel takes add_prefix_space and use_regex (the GPT-2 pattern).
 *                  Regexes follow Oniguruma's meaning, as HF tokenizers runs them: \s, \S, \w,
 *                  \W, \h, \H, \uHHHH and \p{..} general categories are rewritten for PCRE2
 *                  (UTF, UCP, JIT) before compiling; see tok_regex.c.
 *   added_tokens   matched before splitting, leftmost-longest, first those with
 *                  normalized=false on the raw text, then those with normalized=true on the
 *                  normalized text (as HF does); special marks them for TOK_DECODE_SKIP_SPECIAL.
 *                  lstrip, rstrip and single_word must be false.
 *   post_processor null or ByteLevel (no template: no token is ever added by encode).
 *   decoder        ByteLevel (required).
 *
 * Encoding never adds BOS: tok_bos_id() gives the id to prepend where the caller wants one.
 * A tokenizer is immutable once loaded except for its word cache, which has its own locks:
 * any number of threads may encode, decode and stream with one tokenizer at once.
 */
#ifndef DI_TOKENIZER_TOKENIZER_H
#define DI_TOKENIZER_TOKENIZER_H

#include <jansson.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/util/status.h"

/* The largest input tok_encode accepts, in bytes (a prompt is far below it). */
#define TOK_MAX_INPUT_BYTES ((size_t)1 << 30)

typedef struct tok_tokenizer tok_tokenizer; /* opaque; built by tok_load_* */

/* A growable list of token ids. Zero-initialise it ({0}) before first use. */
typedef struct tok_ids {
    int32_t *v; /* ids; owned, freed by tok_ids_free */
    size_t n;   /* ids in use */
    size_t cap; /* ids allocated */
} tok_ids;

/* Releases the ids and resets the list to empty. NULL-safe. */
void tok_ids_free(tok_ids *ids);

/* Appends one id. Returns DI_OK or DI_ENOMEM (list unchanged). */
di_status tok_ids_push(tok_ids *ids, int32_t id, di_error *err);

/* ---- loading -------------------------------------------------------------------------- */

/* Loads tokenizer.json from `path`. When a tokenizer_config.json sits in the same folder, its
 * bos_token, eos_token and pad_token (strings or {"content": ...} objects) name the ids that
 * tok_bos_id() and friends return; without it those are -1.
 * Returns DI_OK (*out owns a tokenizer, free with tok_free), DI_ENOENT (no such file),
 * DI_EIO (unreadable), DI_ERANGE (larger than 1 GiB), DI_EINVAL (malformed JSON, a missing
 * or mistyped field, an unknown token in a merge, a bad tokenizer_config.json), DI_EUNSUPPORTED
 * (a type or option named in the message is not supported), DI_ENOMEM.
 * On failure *out is untouched and nothing is leaked. */
di_status tok_load_file(const char *path, tok_tokenizer **out, di_error *err);

/* Loads a tokenizer.json already in memory (`len` bytes, need not be NUL-terminated); no
 * tokenizer_config.json is read. Same return codes as tok_load_file, less DI_ENOENT. */
di_status tok_load_json(const char *text, size_t len, tok_tokenizer **out, di_error *err);

/* Frees a tokenizer. NULL-safe. */
void tok_free(tok_tokenizer *t);

/* The tokenizer binaries use when none is named: $DI_TOKENIZER when set, else
 * TOK_DEFAULT_FILE (the DeepSeek V3 tokenizer that deploy/local/install-deps.sh fetches under
 * the source tree) when it is readable, else NULL. */
const char *tok_default_path(void);
#ifndef DI_SOURCE_ROOT
#define DI_SOURCE_ROOT "."
#endif
#define TOK_DEFAULT_FILE DI_SOURCE_ROOT "/data/tokenizer/deepseek-v3/tokenizer.json"

/* Ids run over [0, tok_vocab_size): the model vocabulary and the added tokens together
 * (128,815 for DeepSeek V3). Some ids in that range may have no token (a sparse vocab). */
int32_t tok_vocab_size(const tok_tokenizer *t);

/* The id of a token given in its stored form (a vocab string such as "Ġthe", or an added
 * token's content), or -1 when there is none. */
int32_t tok_token_id(const tok_tokenizer *t, const char *token, size_t len);

/* The stored form of an id (vocab string or added-token content), NUL-terminated and valid
 * while t lives, with its length in *len when len is not NULL; NULL for an id with no token. */
const char *tok_token_str(const tok_tokenizer *t, int32_t id, size_t *len);

/* True when id is an added token flagged special. */
bool tok_is_special(const tok_tokenizer *t, int32_t id);

/* Ids named by tokenizer_config.json (see tok_load_file), or -1. */
int32_t tok_bos_id(const tok_tokenizer *t);
int32_t tok_eos_id(const tok_tokenizer *t);
int32_t tok_pad_id(const tok_tokenizer *t);

/* ---- encoding and decoding ------------------------------------------------------------ */

/* Encodes `len` bytes of UTF-8 text and appends the ids to *out (no BOS is added). Thread-safe.
 * Returns DI_OK, DI_EINVAL (text is not valid UTF-8: the message gives the byte offset; or a
 * NULL argument), DI_ERANGE (len > TOK_MAX_INPUT_BYTES), DI_EUNSUPPORTED (a byte with no token
 * in a vocabulary that lacks it), DI_EINTERNAL (the regex engine failed, message from PCRE2),
 * DI_ENOMEM. On failure out->n is what it was on entry. */
di_status tok_encode(const tok_tokenizer *t, const char *text, size_t len, tok_ids *out,
                     di_error *err);

/* Flags of tok_decode and tok_stream_new. */
enum {
    TOK_DECODE_SKIP_SPECIAL = 1u << 0, /* drop added tokens flagged special */
};

/* Decodes ids into text: each token's bytes (byte-level tokens through the GPT-2 byte map,
 * added tokens as their content), concatenated, then made valid UTF-8 by replacing each
 * maximal invalid subsequence with U+FFFD (as Rust's from_utf8_lossy). *out is malloc'd and
 * NUL-terminated, *out_len excludes the NUL; the caller frees it.
 * Returns DI_OK, DI_ERANGE (an id outside [0, tok_vocab_size) or with no token: the message
 * names it and its position), DI_EINVAL (NULL argument), DI_ENOMEM. Outputs untouched on
 * failure. */
di_status tok_decode(const tok_tokenizer *t, const int32_t *ids, size_t n, unsigned flags,
                     char **out, size_t *out_len, di_error *err);

/* The raw bytes of one token (no UTF-8 repair), valid while t lives; NULL for an id with no
 * token or out of range. */
const uint8_t *tok_token_bytes(const tok_tokenizer *t, int32_t id, size_t *len);

/* ---- streaming detokenisation ---------------------------------------------------------- */

/* Feeds ids one at a time and yields the text that is complete so far: never part of a
 * UTF-8 character (incomplete trailing bytes are held back, at most 3), never invalid UTF-8
 * (invalid bytes become U+FFFD exactly as tok_decode does). The concatenation of every push
 * and the final tok_stream_finish equals tok_decode of the same ids. One stream per
 * sequence; a stream is not shared between threads. */
typedef struct tok_stream tok_stream;

/* Returns DI_OK (*out owns a stream), DI_EINVAL (t NULL or unknown flags), DI_ENOMEM. */
di_status tok_stream_new(const tok_tokenizer *t, unsigned flags, tok_stream **out,
                         di_error *err);

/* Adds one id. *text / *len receive the newly complete text (possibly empty), valid until the
 * next call on this stream. Returns DI_OK, DI_ERANGE (bad id: nothing consumed, the stream is
 * unchanged and still usable), DI_ENOMEM. */
di_status tok_stream_push(tok_stream *s, int32_t id, const char **text, size_t *len,
                          di_error *err);

/* Ends the stream: held-back bytes (an incomplete character) become U+FFFD. The stream is
 * then empty and can be reused for a new sequence. Returns DI_OK or DI_ENOMEM. */
di_status tok_stream_finish(tok_stream *s, const char **text, size_t *len, di_error *err);

/* Bytes held back so far (0 to 3). */
size_t tok_stream_pending(const tok_stream *s);

/* Frees a stream. NULL-safe. */
void tok_stream_free(tok_stream *s);

/* ---- DeepSeek chat format -------------------------------------------------------------- */

/* One tool call of an assistant message. */
typedef struct tok_tool_call {
    const char *type;      /* "function" */
    const char *name;      /* function name */
    const char *arguments; /* the arguments as JSON text */
} tok_tool_call;

/* One message of a conversation. Roles: "system", "user", "assistant", "tool". */
typedef struct tok_chat_msg {
    const char *role;                /* required */
    const char *content;             /* required except for an assistant with tool calls */
    const tok_tool_call *tool_calls; /* assistant only, used when content is NULL */
    size_t n_tool_calls;             /* entries in tool_calls */
} tok_chat_msg;

/* Renders a conversation in DeepSeek V3's chat format (the chat_template of its
 * tokenizer_config.json, written out as code): BOS text, all system contents joined by two
 * newlines, then "<｜User｜>" + content for users, "<｜Assistant｜>" + content +
 * "<｜end▁of▁sentence｜>" for assistants, tool outputs and tool calls with their markers, and
 * "<｜Assistant｜>" at the end when add_generation_prompt is set (and the last turn is not a
 * tool output). *out is malloc'd, NUL-terminated; the caller frees it.
 * Returns DI_OK, DI_EINVAL (unknown role, missing content, tool calls outside an assistant
 * message: the message names the message index), DI_ENOMEM. Outputs untouched on failure. */
di_status tok_chat_render(const tok_chat_msg *msgs, size_t n, bool add_generation_prompt,
                          char **out, size_t *out_len, di_error *err);

/* The same from a JSON array of {"role", "content"[, "tool_calls": [{"type", "function":
 * {"name", "arguments"}}]]} objects (the OpenAI message shape). Same return codes. */
di_status tok_chat_render_json(const json_t *messages, bool add_generation_prompt, char **out,
                               size_t *out_len, di_error *err);

/* Renders and encodes, appending the ids to *out. The rendered text starts with the BOS
 * token's text, so the ids start with BOS. Return codes of tok_chat_render_json and
 * tok_encode; out->n unchanged on failure. */
di_status tok_chat_encode_json(const tok_tokenizer *t, const json_t *messages,
                               bool add_generation_prompt, tok_ids *out, di_error *err);

/* ---- Engram's compressed-token map (MODEL.md §2.9 step 1) ------------------------------ */

/* Every token id's compressed id. Each id's text (its single-token decode) is normalised:
 * NFKC, NFD, marks (categories Mn, Mc, Me) removed, lowercase, runs of [ \t\r\n] collapsed to
 * one space, then White_Space stripped from both ends unless the text is exactly " ", and
 * U+E000 turned into a space; an empty result keeps the text unnormalised. A token whose
 * decode is not valid UTF-8 or contains U+FFFD (part of a character) is keyed by its stored
 * form instead. Keys get compressed ids in order of first appearance over ids 0, 1, 2, ...
 * Ids with no token key as empty text. Ids of the model's vocabulary beyond the tokenizer's
 * (vocab_size > tok_vocab_size) map to the compressed id of the pad token. */
typedef struct tok_engram_map {
    int32_t vocab_size;            /* ids covered by map (the model's vocabulary) */
    int32_t tokenizer_vocab_size;  /* tok_vocab_size of the tokenizer it came from */
    int32_t compressed_vocab_size; /* distinct keys: compressed ids run over [0, this) */
    int32_t pad_token_id;          /* the pad token id (MODEL.md: 2) */
    int32_t *map;                  /* [vocab_size] compressed id of each token id; owned */
} tok_engram_map;

/* Builds the map. vocab_size 0 means tok_vocab_size(t); otherwise it must be at least that.
 * pad_token_id must be an id of the tokenizer. Returns DI_OK (*out owns the map, free with
 * tok_engram_map_free), DI_EINVAL (vocab_size or pad_token_id out of range), DI_ENOMEM,
 * DI_EINTERNAL (utf8proc refused a token's text). Outputs untouched on failure. */
di_status tok_engram_map_build(const tok_tokenizer *t, int32_t vocab_size, int32_t pad_token_id,
                               tok_engram_map **out, di_error *err);

/* The map as the JSON object of engram_token_map.json: {"vocab_size", "compressed_vocab_size",
 * "pad_token_id", "map": [...]}. Returns DI_OK (*out owns a new reference) or DI_ENOMEM. */
di_status tok_engram_map_to_json(const tok_engram_map *m, json_t **out, di_error *err);

/* Frees a map. NULL-safe. */
void tok_engram_map_free(tok_engram_map *m);

#endif
