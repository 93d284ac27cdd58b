/* The C twin of the one-step-ahead fix-up (kernels/cpu/step_ahead.h): a worked example with an
 * accepted draft, a rejection, a finished sequence, and the refusals. */
#include <criterion/criterion.h>
#include <string.h>

#include "kernels/cpu/step_ahead.h"

Test(step_ahead, worked_example)
{
    /* nextn 2: step N checked [t, d1, d2] per sequence; out_stride 3 */
    const int64_t base[] = {100, 50, 7};
    const int32_t acc[] = {3, 1, 0};                /* all accepted; none; finished */
    const int32_t toks[] = {11, 12, 13, 21, 0, 0, 0, 0, 0};
    const int32_t drafts[] = {14, 15, 22, 23, 99, 99};
    const uint32_t row0[] = {0, 3, 6};
    int64_t seqlen[3], pos[9];
    int32_t ids[9];
    uint8_t live[9];
    memset(ids, 0x55, sizeof(ids));
    kern_step_ahead p = {.n_seqs = 3, .nextn = 2, .n_rows = 9, .base_len = base, .accepted = acc,
                         .tokens = toks, .out_stride = 3, .drafts = drafts, .row0 = row0,
                         .seqlen_k = seqlen, .ids = ids, .positions = pos, .live = live};
    di_error err;
    cr_assert_eq(kern_step_ahead_run(&p, &err), DI_OK, "%s", err.msg);
    const int32_t want_ids[] = {13, 14, 15, 21, 22, 23, 0, 0, 0};
    const int64_t want_pos[] = {102, 103, 104, 50, 51, 52, 7, 7, 7};
    const int64_t want_len[] = {105, 53, 7};
    const uint8_t want_live[] = {1, 1, 1, 1, 1, 1, 0, 0, 0};
    cr_assert_arr_eq(ids, want_ids, sizeof(ids));
    cr_assert_arr_eq(pos, want_pos, sizeof(pos));
    cr_assert_arr_eq(seqlen, want_len, sizeof(seqlen));
    cr_assert_arr_eq(live, want_live, sizeof(live));
}

Test(step_ahead, refusals_write_nothing)
{
    const int64_t base[] = {10};
    int32_t acc[] = {4};
    const int32_t toks[] = {1, 2, 3};
    const int32_t drafts[] = {4, 5};
    uint32_t row0[] = {0};
    int64_t seqlen[1] = {-1}, pos[3];
    int32_t ids[3] = {-7, -7, -7};
    uint8_t live[3];
    kern_step_ahead p = {.n_seqs = 1, .nextn = 2, .n_rows = 3, .base_len = base, .accepted = acc,
                         .tokens = toks, .out_stride = 3, .drafts = drafts, .row0 = row0,
                         .seqlen_k = seqlen, .ids = ids, .positions = pos, .live = live};
    di_error err;
    cr_assert_eq(kern_step_ahead_run(&p, &err), DI_EINVAL);
    cr_assert(strstr(err.msg, "accepted 4") != NULL, "%s", err.msg);
    cr_assert_eq(ids[0], -7);
    cr_assert_eq(seqlen[0], -1);
    acc[0] = -1;
    cr_assert_eq(kern_step_ahead_run(&p, &err), DI_EINVAL);
    acc[0] = 1, row0[0] = 1;
    cr_assert_eq(kern_step_ahead_run(&p, &err), DI_EINVAL, "rows 1..3 past 3 rows");
    row0[0] = 0;
    cr_assert_eq(kern_step_ahead_run(&p, &err), DI_OK);
    cr_assert_eq(ids[0], 1);
    cr_assert_eq(seqlen[0], 13);
}
