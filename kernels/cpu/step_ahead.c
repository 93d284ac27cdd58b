/* step_ahead.c: the C twin of the one-step-ahead fix-up (step_ahead.h). */
#include "kernels/cpu/step_ahead.h"

di_status kern_step_ahead_run(const kern_step_ahead *p, di_error *err)
{
    if (!p || p->out_stride == 0)
        return di_fail(err, DI_EINVAL, "step ahead: params NULL or out_stride 0");
    for (uint32_t s = 0; s < p->n_seqs; s++) {
        if (p->accepted[s] < 0 || (uint32_t)p->accepted[s] > p->out_stride)
            return di_fail(err, DI_EINVAL, "step ahead: sequence %u accepted %d of at most %u",
                           s, p->accepted[s], p->out_stride);
        if ((uint64_t)p->row0[s] + p->nextn >= p->n_rows)
            return di_fail(err, DI_EINVAL, "step ahead: sequence %u rows %u..%u past %u rows", s,
                           p->row0[s], p->row0[s] + p->nextn, p->n_rows);
    }
    for (uint32_t s = 0; s < p->n_seqs; s++) {
        const int32_t a = p->accepted[s];
        const int64_t len = p->base_len[s] + a;
        p->seqlen_k[s] = a ? len + p->nextn : p->base_len[s];
        for (uint32_t j = 0; j <= p->nextn; j++) {
            const uint32_t r = p->row0[s] + j;
            if (!a) {
                p->ids[r] = 0, p->positions[r] = p->base_len[s], p->live[r] = 0;
                continue;
            }
            p->ids[r] = j == 0 ? p->tokens[(size_t)s * p->out_stride + (uint32_t)a - 1]
                               : p->drafts[(size_t)s * p->nextn + j - 1];
            p->positions[r] = len - 1 + j;
            p->live[r] = 1;
        }
    }
    return DI_OK;
}
