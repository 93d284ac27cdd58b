/* step_ahead.h: one-step-ahead scheduling on the device (DESIGN.md §3): the host plans step
 * N+1 before it has read step N's outcome, assuming every draft is accepted; once step N's
 * sampler has run, this op fixes each sequence's key length and writes the sampled token and
 * the new drafts into step N+1's rows, on the device, so the host never waits for step N.
 * The C twin of kern_cuda_step_ahead (kernels/cuda/step_ahead.cu); tests/gpu/check_step.c
 * compares the two. */
#ifndef DI_KERNELS_CPU_STEP_AHEAD_H
#define DI_KERNELS_CPU_STEP_AHEAD_H

#include <stdint.h>

#include "common/util/status.h"

/* One fix-up. Sequence s owns rows row0[s] .. row0[s] + nextn of step N+1 (1 + nextn rows:
 * the token to feed, then the drafts to check). All arrays are of the op's memory (device
 * memory for the CUDA op). */
typedef struct kern_step_ahead {
    uint32_t n_seqs;
    uint32_t nextn;             /* drafts per sequence in step N+1 */
    uint32_t n_rows;            /* rows of step N+1 (every row0[s] + nextn below it) */
    const int64_t *base_len;    /* [n_seqs] tokens in the sequence's cache before step N */
    const int32_t *accepted;    /* [n_seqs] tokens step N accepted, 1 .. 1 + max_out (the
                                 * verified drafts and the token sampled after them); 0: the
                                 * sequence finished, its rows ride as placeholders */
    const int32_t *tokens;      /* [n_seqs, out_stride] step N's accepted tokens, in order */
    uint32_t out_stride;        /* >= 1 + nextn of step N (max_out = out_stride - 1) */
    const int32_t *drafts;      /* [n_seqs, nextn] the drafts proposed for step N+1 */
    const uint32_t *row0;       /* [n_seqs] first row of each sequence in step N+1 */
    int64_t *seqlen_k;          /* [n_seqs] out: keys visible to the sequence's last row of
                                 * step N+1: base_len + accepted + nextn (base_len for a
                                 * finished one) */
    int32_t *ids;               /* [n_rows] out: row0 gets the last accepted token, the next
                                 * nextn rows the drafts; placeholders get 0 */
    int64_t *positions;         /* [n_rows] out: base_len + accepted - 1 + j for row row0 + j;
                                 * placeholders base_len */
    uint8_t *live;              /* [n_rows] out: 1 for a sequence's rows, 0 for placeholders
                                 * (rows that must write nothing) */
} kern_step_ahead;

/* The fix-up on the host. Rows of no sequence are left alone. DI_OK; DI_EINVAL (an accepted
 * count past 1 + max_out or negative, a sequence's rows past n_rows; nothing written). */
di_status kern_step_ahead_run(const kern_step_ahead *p, di_error *err);

#endif
