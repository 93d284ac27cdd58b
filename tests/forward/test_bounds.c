/* Sizes checked against this machine before anything is allocated or written: the forward's
 * host scratch and the executor's logits for steps of max_rows rows, and the checkpoint of
 * random weights generated on the fly (di-mkmodel's 64 GB limit, then free space). */
#include <criterion/criterion.h>
#include <dirent.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/model/forward.h"
#include "common/model/runner.h"
#include "common/model/runner_exec.h"
#include "common/util/machine.h"
#include "kernels/cpu/backend.h"

#define HUGE_ROWS (1u << 24) /* 16,777,216 rows: above any test machine's memory for tiny */

Test(bounds, host_scratch_and_logits_beyond_memory_are_refused_before_allocating,
     .timeout = 120)
{
    kern_backend be;
    runner_model rm;
    di_error e;
    cr_assert_eq(kern_cpu_create(1, &be, &e), DI_OK);
    cr_assert_eq(runner_model_random("tiny", 1, NULL, NULL, &rm, &e), DI_OK, "%s", e.msg);
    /* tiny: 4,096 logits a row, 256 GiB for the rows alone */
    if (di_machine_memory_bytes() > (uint64_t)HUGE_ROWS * rm.w->config.vocab_size * 4)
        cr_skip_test("this machine holds the logits of %u rows", HUGE_ROWS);

    fwd_options o = {.nextn = 5, .max_rows = HUGE_ROWS, .token_map_pad = -1};
    fwd_model *m = NULL;
    cr_assert_eq(fwd_model_create(rm.w, &be, &o, &m, &e), DI_OK, "%s", e.msg);
    fwd_run *r = (fwd_run *)&e; /* must stay untouched */
    cr_assert_eq(fwd_run_create(m, &r, &e), DI_ERANGE);
    cr_assert(strstr(e.msg, "scratch of steps of 16777216 rows") &&
              strstr(e.msg, "physical memory"), "%s", e.msg);
    cr_assert_eq(r, (fwd_run *)&e, "no output on failure");
    o.max_rows = 64; /* a sane size still works */
    fwd_model_free(m);
    cr_assert_eq(fwd_model_create(rm.w, &be, &o, &m, &e), DI_OK, "%s", e.msg);
    cr_assert_eq(fwd_run_create(m, &r, &e), DI_OK, "%s", e.msg);
    fwd_run_free(r);
    fwd_model_free(m);

    runner_exec_options xo = {.fwd = {.nextn = 5, .max_rows = HUGE_ROWS, .token_map_pad = -1},
                              .n_blocks = 16, .n_slots = 4};
    runner_exec *ex = NULL;
    cr_assert_eq(runner_exec_create(&rm, &be, &xo, &ex, &e), DI_ERANGE);
    cr_assert(strstr(e.msg, "logits of steps of 16777216 rows: 256.00 GiB exceeds"), "%s",
              e.msg);
    cr_assert_null(ex);
    runner_model_free(&rm);
    kern_cpu_destroy(&be);
}

Test(bounds, random_weights_above_the_checkpoint_limit_write_nothing, .timeout = 60)
{
    char tmp[] = "/tmp/di-fwd-bounds-XXXXXX";
    cr_assert_not_null(mkdtemp(tmp));
    runner_model rm = {0};
    di_error e;
    cr_assert_eq(runner_model_random("v41-flash", 0, tmp, NULL, &rm, &e), DI_ENOSPC);
    cr_assert(strstr(e.msg, "random weights for v41-flash need a 306.6 GB checkpoint, above "
                            "the 64.0 GB limit"),
              "%s", e.msg);
    cr_assert_null(rm.w);
    DIR *d = opendir(tmp);
    int entries = 0;
    for (struct dirent *x; (x = readdir(d)) != NULL;)
        entries += x->d_name[0] != '.';
    closedir(d);
    cr_assert_eq(entries, 0, "nothing written under the temporary root");
    rmdir(tmp);
    /* Where the temporary root cannot be examined (a file on the path), nothing starts either. */
    char file[] = "/tmp/di-fwd-bounds-file-XXXXXX", below[64];
    close(mkstemp(file));
    snprintf(below, sizeof(below), "%s/not-a-dir", file);
    cr_assert_eq(runner_model_random("tiny", 0, below, NULL, &rm, &e), DI_EIO);
    cr_assert(strstr(e.msg, "free space"), "%s", e.msg);
    unlink(file);
}
