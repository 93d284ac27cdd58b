#include "harness.h"

#include <criterion/criterion.h>

void h_config(sched_config *c)
{
    sched_config_default(c);
    c->num_blocks = 4097;
    c->num_slots = 128;
    c->max_num_seqs = 64;
    c->prefill_attempt_interval = 1;
    c->prefill_any_attempt_interval = 1;
    c->eos_token = 2;
}

sched *h_make(const sched_config *c)
{
    sched *s = NULL;
    di_error e;
    cr_assert_eq(sched_create(c, &s, &e), DI_OK, "%s", e.msg);
    h_check(s);
    return s;
}

void h_add_req(sched *s, const sched_request *r)
{
    di_error e;
    cr_assert_eq(sched_add_request(s, r, &e), DI_OK, "request %llu: %s",
                 (unsigned long long)r->id, e.msg);
    h_check(s);
}

void h_add(sched *s, uint64_t id, uint32_t len, uint32_t max_tokens)
{
    static int32_t tok[1 << 17];
    cr_assert(len <= sizeof(tok) / sizeof(tok[0]));
    for (uint32_t i = 0; i < len; i++)
        tok[i] = 1 + (int32_t)((id * 31 + i) % 1000);
    sched_request r = {.id = id, .prompt = tok, .prompt_len = len, .max_tokens = max_tokens};
    h_add_req(s, &r);
}

void h_check(sched *s)
{
    di_error e;
    cr_assert_eq(sched_check(s, &e), DI_OK, "invariant broken: %s", e.msg);
}

sched_plan *h_schedule(sched *s)
{
    sched_plan *p = NULL;
    di_error e;
    cr_assert_eq(sched_schedule(s, &p, &e), DI_OK, "%s", e.msg);
    h_check(s);
    return p;
}

void h_log_outputs(h_log *log, const sched_output *outs, size_t n)
{
    if (!log)
        return;
    for (size_t i = 0; i < n; i++) {
        uint64_t id = outs[i].request_id;
        cr_assert(id < H_MAX_IDS);
        cr_assert_eq(log->finals[id], 0, "request %llu: output after its final one",
                     (unsigned long long)id);
        log->outputs[id]++;
        log->tokens[id] += outs[i].n_tokens;
        if (outs[i].finish != SCHED_FINISH_NONE) {
            log->finals[id]++;
            log->finish[id] = outs[i].finish;
        }
    }
}

const sched_output *h_process(sched *s, sched_plan *plan, const sched_seq_result *results,
                              size_t *n, h_log *log)
{
    static sched_seq_result def[1 << 16];
    uint32_t nextn = sched_get_config(s)->nextn;
    if (!results && !plan->placeholder) {
        for (uint32_t i = 0; i < plan->n_seqs; i++) {
            def[i] = (sched_seq_result){.n_tokens = 1, .tokens = {7}, .n_drafts = nextn};
            for (uint32_t k = 0; k < nextn; k++)
                def[i].drafts[k] = 9;
        }
        results = def;
    }
    const sched_output *outs = NULL;
    size_t nn = 0;
    di_error e;
    cr_assert_eq(sched_process_outputs(s, plan, results, plan->placeholder ? 0 : plan->n_seqs,
                                       &outs, &nn, &e),
                 DI_OK, "%s", e.msg);
    h_check(s);
    h_log_outputs(log, outs, nn);
    if (n)
        *n = nn;
    return outs;
}

sched_plan *h_step(sched *s, h_log *log)
{
    sched_plan *p = h_schedule(s);
    h_process(s, p, NULL, NULL, log);
    return p;
}

int h_entry(const sched_plan *plan, uint64_t id)
{
    for (uint32_t i = 0; i < plan->n_seqs; i++)
        if (plan->seqs[i].request_id == id)
            return (int)i;
    return -1;
}

void h_abort(sched *s, uint64_t id, h_log *log)
{
    sched_output out;
    di_error e;
    cr_assert_eq(sched_abort(s, id, &out, &e), DI_OK, "%s", e.msg);
    cr_assert_eq(out.request_id, id);
    cr_assert_eq(out.finish, SCHED_FINISH_ABORT);
    cr_assert_eq(out.n_tokens, 0);
    h_log_outputs(log, &out, 1);
    h_check(s);
}
