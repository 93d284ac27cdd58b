/* sampler.h: the host-side sampler. Logits in, one token (or a verified run of drafts) out.
 *
 * Per row, in this order (DESIGN.md §6):
 *   1. logits in fp32 (NaN or +inf is a per-row DI_ERANGE; -inf means "blocked");
 *   2. blacklist: listed tokens are blocked;
 *   3. EOS ban: EOS is blocked while the row makes one of the request's first
 *      first_n_no_eos outputs (output_index < first_n_no_eos);
 *   4. grammar mask: tokens whose bit is clear are blocked;
 *   5. force top-k: only the force_top_k largest logits stay, ties to the lower token id
 *      (a radix selection over the vocabulary, not a sort);
 *   6. temperature: weight w_i = exp((l_i - l_max) / T), T = 1e-5 when the request asks for 0
 *      (the engine still draws);
 *   7. integer mass (below);
 *   8. order: tokens by mass descending, ties to the lower token id ("draw order");
 *      top-k keeps the first k, then top-p keeps the smallest prefix of those whose mass
 *      reaches top_p of their total;
 *   9. logprobs of the processed distribution (the kept tokens, renormalised);
 *  10. draw with the row's keyed uniform.
 * If steps 2-4 (with the model's own -inf logits) leave no token, the row fails with DI_ERANGE
 * and a message; other rows are never affected.
 *
 * Probability mass as integers. Each kept token i gets the integer mass
 *     m_i = floor(w_i * 2^31),  w_i = exp((l_i - l_max) / T) in (0, 1],
 * so the top token has exactly 2^31 and every other token 0 .. 2^31. A token with m_i = 0
 * (weight below 2^-31 of the top token's) has probability 0. The processed distribution is
 * p_i = m_i / M with M = sum of the kept m_i (a uint64_t, at most n * 2^31 < 2^48). Nothing after
 * the exponential is a floating-point sum: M, the top-p cut and the draw are integer
 * arithmetic, so the order in which masses are added (thread, chunk, batch) cannot change a
 * result. (Weights relative to the top token rather than to the float sum Z = sum w_i keep even
 * Z out of the result: m_i = floor(p_i * Z * 2^31), the same distribution up to the floor.)
 *   - top-p cut: writing top_p = f / 2^s exactly (integers f < 2^24 and s, as every float in
 *     (0, 1) can be), the kept prefix is the shortest whose cumulative mass C satisfies
 *     C >= ceil(f * M / 2^s) (128-bit product); at least one token is always kept and top_p = 1
 *     keeps everything.
 *   - draw: u = x * 2^-53 (x a 53-bit integer), threshold = floor(x * M / 2^53) < M; the token
 *     is the first in draw order whose cumulative mass exceeds the threshold.
 *
 * Randomness. Every draw is a pure function of (seed, stream):
 *     u = di_philox_uniform(seed, stream, 0),
 *     stream = 3 * (P + j * 10,000,019) + case,
 * where P is the position of the token made by the request's FIRST row in this step, j the
 * row's index within the request in this step (the explainer: "row j uses position P + j *
 * 10,000,019"), and case is 0 for a fresh sample, 1 for the resample after a rejection, 2 for
 * the accept coin. Rows of the draft model's Markov head (MODEL.md §2.11) draw with the seed
 * seed + 1,000,000,007; by convention the head's i-th draft of a step is row i with P = the
 * position of the first draft token. The batch row is never part of the key, so a request's
 * tokens do not depend on its companions.
 *
 * Speculative verification (sampler_verify): for draft i, t = target logprob (processed) of
 * the draft token (-inf outside the kept set), d = the draft's logprob of it; accept if
 * u < exp(min(t - d, 0)) with u from case 2 of row i. At the first rejection, row i resamples
 * (case 1) from the residual r_j = max(p_target_j - p_draft_j * e^(-5e-5), 0) turned into
 * integer mass like above (floor(r_j * 2^31)); if every draft passes, row k draws fresh
 * (case 0). The e^(-5e-5) factor keeps the residual from rounding to all zeros; the output
 * distribution is the target's to within a factor 1 + 5e-5.
 *
 * Threads: no global state. A workspace is scratch for one thread at a time; calls on
 * disjoint rows with one workspace per thread are safe and give the same results as one
 * thread.
 */
#ifndef DI_SAMPLING_SAMPLER_H
#define DI_SAMPLING_SAMPLER_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/util/status.h"

#define SAMPLER_MAX_LOGPROBS 20                 /* top logprobs a request may ask for */
#define SAMPLER_MAX_DRAFTS 16                   /* drafts one verification may check */
#define SAMPLER_DEFAULT_FORCE_TOP_K 4096        /* force top-k unless a request sets it */
#define SAMPLER_MIN_TEMPERATURE 1e-5f           /* what temperature 0 becomes */
#define SAMPLER_ROW_POSITION_STRIDE 10000019ull /* row j adds j * this to the position */
#define SAMPLER_DRAFT_SEED_OFFSET 1000000007ull /* draft seed = seed + this */
#define SAMPLER_RESIDUAL_LOG_SCALE (-5e-5)      /* residual subtracts p_draft * e^this */
#define SAMPLER_MASS_ONE 2147483648u            /* 2^31: the top token's integer mass */

/* The case part of a stream number. */
typedef enum sampler_case {
    SAMPLER_CASE_FRESH = 0,    /* a fresh sample (plain row, bonus row, draft head) */
    SAMPLER_CASE_RESAMPLE = 1, /* the resample of a row whose draft was rejected */
    SAMPLER_CASE_ACCEPT = 2,   /* the accept-or-reject coin of a draft */
} sampler_case;

/* ---- parameters ------------------------------------------------------------------------- */

/* One request's sampling parameters, written by the router/engine when the request is
 * admitted and read-only afterwards. sampling_params_default() gives the defaults listed. */
typedef struct sampling_params {
    float temperature;       /* >= 0, finite; 0 means 1e-5 (still drawn). Default 1 */
    float top_p;             /* in (0, 1]; 1 = off. Default 1 */
    int32_t top_k;           /* -1 = off, else >= 1 tokens. Default -1 */
    uint32_t force_top_k;    /* logits kept before temperature; 0 = off. Default 4,096 */
    uint32_t first_n_no_eos; /* the first this many outputs cannot be EOS. Default 0 */
    int32_t eos_id;          /* end-of-sequence token, -1 = none. Default -1 */
    const int32_t *blacklist; /* [n_blacklist] tokens never sampled; borrowed, may be NULL
                                 when n_blacklist is 0. Default none */
    uint32_t n_blacklist;    /* entries in blacklist, at most the vocabulary size */
    uint32_t n_logprobs;     /* top logprobs to report per token, 0..20. Default 0 */
    uint64_t seed;           /* key of every draw of the request. Default 0 */
} sampling_params;

/* One row of the option table: behaviour of a scalar parameter as data. The router parses
 * request JSON and the CLI parses flags from these rows; validation is generated from them. */
typedef enum sampling_field_type {
    SAMPLING_FIELD_F32, /* float */
    SAMPLING_FIELD_I32, /* int32_t */
    SAMPLING_FIELD_U32, /* uint32_t */
} sampling_field_type;

typedef struct sampling_param_spec {
    const char *name;         /* request/flag name ("top_p") */
    sampling_field_type type; /* C type of the field */
    size_t offset;            /* offsetof(sampling_params, field) */
    double def;               /* default value */
    double lo, hi;            /* allowed range of an "on" value */
    bool lo_open;             /* lo itself is excluded */
    bool has_off;             /* off_value is also allowed and means "off" */
    double off_value;         /* the "off" value when has_off */
    const char *help;         /* one line for --help */
} sampling_param_spec;

/* The table (temperature, top_p, top_k, force_top_k, first_n_no_eos, logprobs) and its size.
 * seed, eos_id and blacklist are checked by sampling_params_validate, not by the table. */
extern const sampling_param_spec sampling_param_specs[];
extern const size_t sampling_param_spec_count;

/* The defaults above. */
sampling_params sampling_params_default(void);

/* Checks p against the table and the vocabulary (eos_id and every blacklist entry in
 * [0, n_vocab), n_blacklist <= n_vocab). Returns DI_OK, or DI_EINVAL with one line naming the field and the bound
 * ("top_p 1.5 outside (0, 1]"). Reads only. */
di_status sampling_params_validate(const sampling_params *p, uint32_t n_vocab, di_error *err);

/* The temperature actually used: 1e-5 for 0, else p->temperature. */
float sampling_params_temperature(const sampling_params *p);

/* ---- random key --------------------------------------------------------------------------- */

/* Position of the token a prefill row makes: seqlen_k (tokens of the sequence so far, the
 * index of the next one). r1's first token: seqlen_k 16,389 -> 16,389. */
uint64_t sampler_prefill_position(uint64_t seqlen_k);
/* Position of the token a decode step's first row makes: seqlen_k - seqlen_q + 1 (seqlen_k
 * counts this step's seqlen_q rows). 16,395 and 6 -> 16,390. Requires seqlen_q >= 1 and
 * seqlen_q <= seqlen_k (asserted). */
uint64_t sampler_decode_position(uint64_t seqlen_k, uint64_t seqlen_q);
/* stream = 3 * (position + row * 10,000,019) + kase: prefill row of r1 -> 3 * 16,389 = 49,167. */
uint64_t sampler_stream(uint64_t position, uint32_t row, sampler_case kase);
/* The seed the draft model's rows draw with: seed + 1,000,000,007 (mod 2^64). */
uint64_t sampler_draft_seed(uint64_t seed);
/* The draw itself: di_philox_uniform(seed, stream, 0), in [0, 1). */
double sampler_uniform(uint64_t seed, uint64_t stream);

/* ---- rows, results, workspace ------------------------------------------------------------- */

/* One row to sample, filled by the model runner per step. Read only here. */
typedef struct sampler_row {
    const float *logits;           /* [n_vocab] fp32 scores; -inf = blocked by the model */
    uint32_t n_vocab;              /* logits length; at most the workspace's capacity */
    const sampling_params *params; /* the request's parameters (validated here again) */
    const uint32_t *grammar_mask;  /* [(n_vocab + 31) / 32] bit (t % 32) of word t / 32 set =
                                      token t allowed; NULL = no grammar */
    uint32_t output_index;         /* 0-based index, among the request's outputs, of the token
                                      this row makes; EOS banned while < first_n_no_eos */
    uint64_t position;             /* P: position of the token made by the request's first row
                                      in this step (sampler_prefill/decode_position) */
    uint32_t row;                  /* j: this row's index within the request in this step */
    bool draft;                    /* a row of the draft model's Markov head: draws with
                                      sampler_draft_seed(params->seed) */
} sampler_row;

/* The outcome of one sampled row (or one output token of a verification). */
typedef struct sampler_result {
    di_error err;                               /* DI_OK, or why this row failed */
    int32_t token;                              /* the token; -1 when the row failed */
    float logprob;                              /* log p(token), processed distribution */
    uint32_t n_top;                             /* entries in top_*: min(n_logprobs, kept) */
    int32_t top_tokens[SAMPLER_MAX_LOGPROBS];   /* most likely tokens in draw order */
    float top_logprobs[SAMPLER_MAX_LOGPROBS];   /* their logprobs */
} sampler_result;

/* Scratch for rows of up to `capacity` tokens: about 56 bytes per token (7 MB for 129,280),
 * allocated once; no allocation per row. One thread at a time. */
typedef struct sampler_workspace sampler_workspace;

/* DI_EINVAL for capacity 0 or above 2^30, DI_ENOMEM; *out untouched on failure. */
di_status sampler_workspace_new(uint32_t capacity, sampler_workspace **out, di_error *err);
/* NULL-safe. */
void sampler_workspace_free(sampler_workspace *ws);

/* ---- the processed distribution ---------------------------------------------------------- */

/* A processed distribution: the tokens of non-zero probability in draw order. Storage is one
 * of the workspace's slots and stays valid until the next call that writes that slot
 * (sampler_process with the same slot; sampler_sample, sampler_sample_batch and sampler_verify
 * write every slot). */
typedef struct sampler_dist {
    uint32_t n;           /* tokens with non-zero mass, >= 1 */
    const int32_t *ids;   /* [n] token ids, mass descending, ties to the lower id */
    const uint32_t *mass; /* [n] integer masses, 1 .. 2^31 */
    uint64_t total;       /* M = sum of mass[0 .. n) */
} sampler_dist;

#define SAMPLER_DIST_SLOTS 2 /* distributions a caller can hold at once in one workspace */

/* Steps 1-9 for one row into slot (0 or 1) of ws. DI_OK and *out set; DI_EINVAL for bad
 * arguments or parameters; DI_ERANGE when a logit is NaN or +inf or when every token is
 * blocked (the message says which rules blocked how many). *out untouched on failure. */
di_status sampler_process(const sampler_row *row, sampler_workspace *ws, unsigned slot,
                          sampler_dist *out, di_error *err);

/* log(m / M) of token (log(0) = -inf when token is not in d). */
double sampler_dist_logprob(const sampler_dist *d, int32_t token);

/* Step 10 with a given u in [0, 1): the first token in draw order whose cumulative mass exceeds
 * floor(u * 2^53) * M / 2^53. DI_EINVAL for u outside [0, 1) or an empty d; *token untouched
 * on failure. */
di_status sampler_dist_pick(const sampler_dist *d, double u, int32_t *token, di_error *err);

/* ---- sampling ------------------------------------------------------------------------------ */

/* One row, all ten steps, with its keyed draw (case 0). DI_OK and *out written; on DI_EINVAL
 * or DI_ERANGE (see sampler_process) *out is untouched and err says why. */
di_status sampler_sample(const sampler_row *row, sampler_workspace *ws, sampler_result *out,
                         di_error *err);

/* n rows, each exactly as sampler_sample would do it alone (no state between rows, so a
 * row's result is independent of the others and of their order). results[i] is always
 * written: its err holds the row's own status. Returns DI_EINVAL (nothing written) when rows,
 * results or ws is NULL with n > 0, else DI_OK; *n_failed (optional) gets the count of rows
 * whose err is not DI_OK. */
di_status sampler_sample_batch(const sampler_row *rows, size_t n, sampler_workspace *ws,
                               sampler_result *results, size_t *n_failed, di_error *err);

/* ---- speculative verification ----------------------------------------------------------- */

/* The accept test: true when u < exp(min(t - d, 0)); t = -inf never passes. */
bool sampler_accept(double t, double d, double u);

/* One request's verification step with k drafts. */
typedef struct sampler_verify_in {
    const sampler_row *target;   /* [k + 1] the target model's rows; target[i] has row = i and
                                    the same position and params as target[0]; row i checks
                                    draft i, row k is the bonus row */
    const sampler_row *draft;    /* [k] the draft head's rows (logits and params) that
                                    produced draft i; NULL allowed when k is 0 */
    const int32_t *draft_tokens; /* [k] the draft tokens */
    uint32_t k;                  /* number of drafts, 0 .. SAMPLER_MAX_DRAFTS */
} sampler_verify_in;

/* Accepts drafts in order and stops at the first rejection. On DI_OK, *n_accepted = a
 * (0 .. k) and results[0 .. a] hold the a accepted drafts then the sampled token (the
 * resample of row a, or the bonus row's draw when a = k); every logprob is the target's
 * processed one. Rows after a rejection are not looked at. DI_EINVAL for bad inputs (row
 * numbering, a draft token that its own distribution gives probability 0), DI_ERANGE when a
 * target row that has to be sampled or checked is fully blocked or has NaN logits; on
 * failure nothing is written. */
di_status sampler_verify(const sampler_verify_in *in, sampler_workspace *ws,
                         sampler_result *results, uint32_t *n_accepted, di_error *err);

/* The residual draw with a given u, for tests and the CUDA twin's comparison: builds
 * max(p_t - p_d * e^(-5e-5), 0) as integer mass from two distributions (dense per token via
 * the workspace), orders it like any distribution and picks with u. When the residual is all
 * zero (possible only through rounding) it picks from target instead. DI_EINVAL for u outside
 * [0, 1); *token untouched on failure. target and draft must not live in ws's residual slot
 * (those from sampler_process never do). */
di_status sampler_residual_pick(const sampler_dist *target, const sampler_dist *draft,
                                uint32_t n_vocab, sampler_workspace *ws, double u,
                                int32_t *token, di_error *err);

#endif
