/* forward.h: the V4.1 forward pass (MODEL.md §1) written once against the kernel table.
 *
 * Three objects (STYLE.md H6: config, weights and run state stay apart):
 *  - fwd_model: a validated config, its loaded weights (model_weights, not owned), a backend
 *    table and what the forward derives once (aligned weight views, BF16 wo_a, Engram tables,
 *    the KV geometry for the chosen nextn);
 *  - fwd_kv (state.h): the paged blocks and state slots the engine's step plan addresses;
 *  - fwd_run: the scratch of one step of at most max_rows rows.
 *
 * A step (fwd_step) is a batch of sequences, each with consecutive rows at consecutive
 * positions: a prefill chunk, one decode row, or 1 + nextn rows of a speculative decode. Every
 * row writes its window ring entry, compressor state and compressed entries; the writes of a
 * row are visible to the later rows of the same step (MODEL.md §2.12), and a row's logits do
 * not depend on the other rows of the step (batch invariance). Logits are computed only for
 * the rows the caller asks for (the sampled rows).
 *
 * When the model has draft stages, every step also writes each row's draft-stage ring entry
 * (from the taps of the target layers, MODEL.md §2.11 "prefill"), so that fwd_draft can
 * propose from any position the step reached. Rows of rejected drafts write positions that
 * the next step overwrites before anything reads them (the ring's spare slots).
 *
 * YOCO truncation (explainer, "When prefill takes a shortcut"), for prompt rows only:
 *  - off: every layer runs every row;
 *  - compact: layers >= yoco_boundary run only the last keep_tokens rows of each prompt (the
 *    boundary layer's compressed KV still covers every row) and their windows never reach
 *    below the keep window; prompt logits of dropped rows are unavailable;
 *  - mask: every row runs, but the windows of layers >= yoco_boundary are clipped exactly as
 *    in compact, so compact == mask on the kept rows, bit for bit.
 * keep_tokens must be at least ring_positions (window + nextn + 1).
 */
#ifndef DI_MODEL_FORWARD_H
#define DI_MODEL_FORWARD_H

#include <stdint.h>

#include "common/model/config.h"
#include "common/model/state.h"
#include "common/model/weights.h"
#include "common/util/log.h"
#include "common/util/status.h"
#include "kernels/kernels.h"

typedef enum fwd_yoco {
    FWD_YOCO_OFF = KV_YOCO_OFF,
    FWD_YOCO_COMPACT = KV_YOCO_COMPACT,
    FWD_YOCO_MASK = KV_YOCO_MASK,
} fwd_yoco;
/* The mode every engine runs unless told otherwise (kv_layout.h says why). */
#define FWD_YOCO_DEFAULT ((fwd_yoco)KV_YOCO_DEFAULT)

/* Element types of dumped tensors. */
typedef enum fwd_dtype {
    FWD_BF16 = 0,
    FWD_F32 = 1,
    FWD_I32 = 2,
    FWD_I64 = 3,
    FWD_U8 = 4,
} fwd_dtype;

/* A named intermediate handed to the dump hook (host copy, valid during the call). */
typedef struct fwd_tensor {
    const char *name;        /* "attn.q", "ffn_out", ... (without the layer) */
    int32_t layer;           /* backbone layer; n_layers + s for draft stage s; -1 for none */
    fwd_dtype dtype;
    uint32_t ndim;           /* 1..3 */
    uint64_t dims[3];        /* outermost first; dims[0] is the row count */
    const void *data;        /* host memory */
} fwd_tensor;

typedef void (*fwd_dump_fn)(void *userdata, const fwd_tensor *t);

typedef struct fwd_options {
    uint32_t nextn;          /* drafts per decode step (ring = window + nextn + 1); 0 allowed */
    uint32_t max_rows;       /* rows per step at most (scratch sizing); >= 1 */
    fwd_yoco yoco;           /* truncation mode of prompt rows */
    uint32_t keep_tokens;    /* YOCO keep window (tokens); >= ring positions unless off */
    const int32_t *token_map;/* Engram compressed-token map [vocab_size] (copied), values in
                                [0, engram_compressed_vocab_size); NULL: token id modulo the
                                compressed vocabulary */
    int32_t token_map_pad;   /* Engram pad token id (its map entry is the compressed pad);
                                -1: the config's engram_pad_token_id */
    fwd_dump_fn dump;        /* called for every named intermediate; NULL = none */
    void *dump_userdata;
    const di_logger *log;    /* debug lines; may be NULL */
    /* The routed and shared experts of the backbone layers run through this hook instead of
     * the backend's moe_experts (expert parallelism, common/ep/moe.h): it gets the layer's
     * call after the gate and writes p->y (its experts table is NULL: the backbone layers'
     * routed experts are neither read nor placed in backend memory, so a checkpoint loaded
     * with only some of them will do). NULL: the backend runs them. Draft stages always run
     * on the backend. */
    di_status (*moe_fn)(void *userdata, uint32_t layer, const kern_moe_experts *p,
                        di_error *err);
    void *moe_userdata;
} fwd_options;

typedef struct fwd_model fwd_model;
typedef struct fwd_run fwd_run;

/* Prepares a model: validates options against the config (nextn, keep_tokens >= ring
 * positions, token map range, weights present for every role), makes aligned copies of
 * weights that are not naturally aligned and a BF16 wo_a when the checkpoint stores it FP8.
 * w and be must outlive the model. DI_EINVAL (with the rule), DI_ENOMEM. */
di_status fwd_model_create(const model_weights *w, const kern_backend *be,
                           const fwd_options *opt, fwd_model **out, di_error *err);
void fwd_model_free(fwd_model *m); /* NULL-safe */
/* The KV geometry (ring size from nextn) every fwd_kv of this model must use. */
const kv_geometry *fwd_model_geometry(const fwd_model *m);
const model_config *fwd_model_config(const fwd_model *m);

/* Scratch for steps of at most max_rows rows (the model's max_rows). DI_ERANGE when host scratch
 * would exceed physical memory (checked before allocating), DI_ENOMEM. */
di_status fwd_run_create(fwd_model *m, fwd_run **out, di_error *err);
void fwd_run_free(fwd_run *r); /* NULL-safe */

/* One sequence of a step (from the engine's step plan). */
typedef struct fwd_seq {
    uint32_t n_rows;         /* seqlen_q: rows of this sequence in the step (>= 1) */
    int64_t pos0;            /* position of its first row (seqlen_k - seqlen_q) */
    const int32_t *tokens;   /* [n_rows] token ids at positions pos0 .. pos0+n_rows-1 */
    const int32_t *history;  /* ids at positions pos0-n_history .. pos0-1 (Engram lookback) */
    uint32_t n_history;      /* min(pos0, engram_max_ngram_size - 1) when the model has
                                Engram, else ignored */
    const uint32_t *blocks;  /* block table: blocks[i] holds positions 128i .. 128i+127 */
    uint32_t n_blocks;       /* >= ceil((pos0 + n_rows) / 128) */
    uint32_t slot;           /* state slot id */
    int64_t prompt_len;      /* prompt rows: the whole prompt's length (YOCO keep window);
                                0 for decode rows */
    int64_t window_start;    /* rows at or after this position read no window key below it in
                                any layer (bounded replay after a prefix hit whose window state
                                is missing); 0 = no clip */
    int placeholder;         /* nonzero: n_rows placeholder rows (below); every other field is
                                ignored */
} fwd_seq;

/* Placeholder rows pad a step to a recorded graph size (common/engine/graphs.h). They run
 * through every op like the rows of an empty sequence (token 0 at positions 0, 1, ..., no state
 * slot, no blocks), so a step of the padded size computes the same shapes, but they write
 * nothing that outlives the step: no window ring, compressor state, compressed entry or draft
 * ring entry; they see no compressed entry; their experts are not run (the MoE gate's picks of
 * them are dropped, so expert-parallel loads never count them); their logits cannot be asked
 * for. The rows of the other sequences are bit for bit those of the same step without them.
 * Placeholder sequences follow every other sequence of the step. */

typedef struct fwd_step {
    uint32_t n_seqs;
    const fwd_seq *seqs;
    uint32_t n_logit_rows;   /* rows whose logits are wanted */
    const int32_t *logit_rows; /* [n_logit_rows] row indices in step order (sequence 0's rows
                                first); distinct; never a placeholder row */
    const int32_t *ids_dev;  /* [rows] the rows' token ids in backend memory (one step ahead:
                                written there by a device op): the embedding and the Engram
                                hashes of the step's rows read them instead of the seqs'
                                tokens, which are still checked but otherwise unused (a
                                placeholder row's id must be 0). An id outside the vocabulary
                                fails the step or the next synchronisation. NULL: the seqs'
                                tokens */
} fwd_step;

/* Runs one step. logits (host, [n_logit_rows, vocab_size] fp32) receives the raw model
 * logits of the requested rows, in logit_rows order. Returns DI_OK; DI_EINVAL naming the
 * sequence and the rule (token outside the vocabulary, positions beyond
 * max_position_embeddings, block table too short or a block id out of range, slot out of range
 * or used twice, history count wrong, too many rows, logit row out of range or a placeholder
 * row, a sequence after placeholder rows);
 * DI_EUNSUPPORTED for the logits of a prompt row dropped by YOCO compact truncation (prompt
 * logprobs are unavailable in compact mode); DI_ENOMEM. On failure the caches may hold
 * partial writes of this step's positions (which a retry overwrites) and logits is
 * unspecified. */
di_status fwd_step_run(fwd_run *r, fwd_kv *kv, const fwd_step *step, float *logits,
                       di_error *err);

/* The same step with the logits left in backend memory: *logits gets the run's
 * [n_logit_rows, vocab_size] f32 buffer (NULL when no row asked for logits), valid until the
 * next step of this run, for an on-device consumer such as the backend's sampler
 * (sampler_sample_backend), so the host copy of fwd_step_run is not made. Same checks and
 * failures; DI_EINVAL for a NULL logits pointer. */
di_status fwd_step_run_keep(fwd_run *r, fwd_kv *kv, const fwd_step *step, const float **logits,
                            di_error *err);

/* ---- draft model (DSpark, MODEL.md §2.11) ---- */

/* Picks the draft token for slot i of request `req` from its Markov-corrected logits (the
 * caller's sampler with the draft stream). Returns DI_OK or a failure that aborts the call. */
typedef di_status (*fwd_draft_sample_fn)(void *userdata, uint32_t req, uint32_t i,
                                         const float *logits, uint32_t vocab, int32_t *token);

/* One proposal request: the main model has processed position `pos` (its draft ring entry is
 * written) and sampled `next` for position pos + 1. */
typedef struct fwd_draft_req {
    uint32_t slot;           /* state slot of the sequence */
    int64_t pos;             /* P: the last position with a draft ring entry */
    int32_t next;            /* n1: the token at P + 1 */
} fwd_draft_req;

/* Per request: nextn drafts for positions P+2 .. P+1+nextn, the draft's logits for each, and
 * its confidences. */
typedef struct fwd_draft_out {
    int32_t *tokens;         /* [n_reqs, nextn] */
    float *logits;           /* [n_reqs, nextn, vocab] Markov-corrected logits; may be NULL */
    float *confidence;       /* [n_reqs, nextn] sigmoid of the confidence head, in (0, 1) */
    float *cumulative;       /* [n_reqs, nextn] running products: prefix acceptance */
} fwd_draft_out;

/* Runs the draft stages on [next, noise, ...] (dspark_block_size rows per request) and the
 * Markov correction (sequential sampling through `sample`). nextn <= dspark_block_size; the
 * model must have draft stages and n_reqs * dspark_block_size <= max_rows. DI_EINVAL,
 * DI_EUNSUPPORTED (no draft stages), DI_ENOMEM, or the sampler's failure. */
di_status fwd_draft(fwd_run *r, fwd_kv *kv, uint32_t n_reqs, const fwd_draft_req *reqs,
                    uint32_t nextn, fwd_draft_sample_fn sample, void *sample_userdata,
                    fwd_draft_out *out, di_error *err);

#endif
