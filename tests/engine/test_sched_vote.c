/* The vote between two ranks in lockstep (explainer Pass 2, "Continuous batching, and the
 * fifth prompt"): the ALL point fails when one rank has nothing to prefill, the ANY point
 * passes; a rank that picked nothing runs an empty prompt step alongside one that did; when
 * every rank wants prefill but none can schedule it, the group decodes. Each rank is a thread
 * with its own scheduler; the script below decides what arrives when, from the rank's
 * decode_step, which is the same on both ranks. */
#include <criterion/criterion.h>
#include <pthread.h>
#include <stdio.h>

#include "common/engine/scheduler.h"

enum { STEPS = 330 };

typedef struct vrank {
    vote_group *g;
    uint32_t rank;
    uint32_t ds[STEPS];       /* decode_step before the schedule */
    bool prompt[STEPS], placeholder[STEPS];
    uint64_t first[STEPS];    /* first entry's request id */
    uint32_t phase;           /* script position */
    char err[400];
} vrank;

static bool vadd(sched *s, uint64_t id)
{
    static const int32_t tok[8] = {5, 6, 7, 8, 9, 10, 11, 12};
    sched_request r = {.id = id, .prompt = tok, .prompt_len = 8, .max_tokens = 5000,
                       .ignore_eos = true};
    return sched_add_request(s, &r, NULL) == DI_OK;
}

/* The script: (phase, rank, decode step) -> request to add. Phases advance on prompt steps. */
static void vscript(vrank *v, sched *s, uint32_t ds)
{
    if (v->phase == 1 && ds == 20 && v->rank == 0)
        vadd(s, 2);                      /* X: only rank 0 wants prefill */
    if (v->phase == 2 && ds == 10)
        vadd(s, v->rank == 0 ? 3 : 4);   /* Z on rank 0 (full), Y on rank 1 (has room) */
    if (v->phase == 3 && ds == 10 && v->rank == 1)
        vadd(s, 5);                      /* W on rank 1, now full too */
}

static void *vmain(void *arg)
{
    vrank *v = arg;
    sched_config c;
    sched_config_default(&c);
    c.nextn = 0;
    c.max_num_seqs = 2;
    c.num_slots = 4;
    vote vt = vote_group_rank(v->g, v->rank);
    c.vote = &vt;
    sched *s = NULL;
    di_error e = {0};
    if (sched_create(&c, &s, &e) != DI_OK || !vadd(s, 1)) {
        snprintf(v->err, sizeof(v->err), "setup: %s", e.msg);
        vote_group_cancel(v->g);
        return NULL;
    }
    static __thread sched_seq_result res[4];
    for (int i = 0; i < STEPS; i++) {
        vscript(v, s, sched_decode_step(s));
        v->ds[i] = sched_decode_step(s);
        sched_plan *p;
        if (sched_schedule(s, &p, &e) != DI_OK || sched_check(s, &e) != DI_OK) {
            snprintf(v->err, sizeof(v->err), "step %d: %s", i, e.msg);
            vote_group_cancel(v->g);
            break;
        }
        v->prompt[i] = p->prompt_run;
        v->placeholder[i] = p->placeholder;
        v->first[i] = p->seqs[0].request_id;
        if (p->prompt_run)
            v->phase++;
        for (uint32_t k = 0; k < p->n_seqs && k < 4; k++)
            res[k] = (sched_seq_result){.n_tokens = 1, .tokens = {7}};
        const sched_output *o;
        size_t n;
        if (sched_process_outputs(s, p, res, p->placeholder ? 0 : p->n_seqs, &o, &n, &e)) {
            snprintf(v->err, sizeof(v->err), "process %d: %s", i, e.msg);
            vote_group_cancel(v->g);
            break;
        }
    }
    sched_destroy(s);
    return NULL;
}

/* First step >= from where rank r's plan is a prompt step, or -1. */
static int next_prompt(const vrank *v, int from)
{
    for (int i = from; i < STEPS; i++)
        if (v->prompt[i])
            return i;
    return -1;
}

Test(sched_vote, two_ranks_and_the_second_vote, .timeout = 60)
{
    vote_group *g = NULL;
    cr_assert_eq(vote_group_create(2, 20000, NULL, &g, NULL), DI_OK);
    static vrank v[2];
    pthread_t th[2];
    for (uint32_t r = 0; r < 2; r++) {
        memset(&v[r], 0, sizeof(v[r]));
        v[r].g = g;
        v[r].rank = r;
        pthread_create(&th[r], NULL, vmain, &v[r]);
    }
    for (int r = 0; r < 2; r++)
        pthread_join(th[r], NULL);
    vote_group_destroy(g);
    for (int r = 0; r < 2; r++)
        cr_assert_eq(v[r].err[0], 0, "rank %d: %s", r, v[r].err);
    for (int i = 0; i < STEPS; i++)
        cr_assert_eq(v[0].prompt[i], v[1].prompt[i], "step %d: both ranks run one step type", i);

    /* step 0: both want (ALL passes), both prefill their first request */
    cr_assert(v[0].prompt[0] && !v[0].placeholder[0] && !v[1].placeholder[0]);
    /* X arrives on rank 0 at decode step 20: the ALL point at 70 fails (rank 1 has nothing),
       the ANY point at 100 passes; rank 1 runs an empty prompt step alongside */
    int x = next_prompt(&v[0], 1);
    cr_assert_eq(v[0].ds[x], 100, "X waits for the ANY point, not the ALL at 70");
    cr_assert_eq(v[0].first[x], 2);
    cr_assert(v[1].placeholder[x], "rank 1's empty prompt step");
    cr_assert_eq(v[1].first[x], SCHED_PLACEHOLDER_ID);
    /* Z (rank 0, full) and Y (rank 1) at decode step 10: at the ALL point 70 both want; only
       rank 1 can schedule, so rank 0 runs an empty prompt step */
    int y = next_prompt(&v[0], x + 1);
    cr_assert_eq(v[0].ds[y], 70);
    cr_assert(v[0].placeholder[y], "rank 0 wanted but could not schedule");
    cr_assert_eq(v[1].first[y], 4, "rank 1 prefills Y");
    /* W on rank 1 at 10: both full, both want; at 70 the second vote finds no rank scheduled
       anything, so the group decodes and the count goes on */
    int i70 = -1;
    for (int i = y + 1; i < STEPS && i70 < 0; i++)
        if (v[0].ds[i] == 70)
            i70 = i;
    cr_assert(i70 > 0 && i70 + 1 < STEPS);
    cr_assert(!v[0].prompt[i70] && !v[1].prompt[i70], "no rank scheduled prefill: decode");
    cr_assert_eq(v[0].ds[i70 + 1], 71);
    cr_assert_eq(next_prompt(&v[0], i70), -1, "and no prompt step later in the run");
}
