/* harness.h: helpers shared by the scheduler tests: make a scheduler, add requests, run one
 * step with given or synthetic results, record every output per request, and check the
 * invariants after each step. */
#ifndef DI_TESTS_ENGINE_HARNESS_H
#define DI_TESTS_ENGINE_HARNESS_H

#include <stdint.h>

#include "common/engine/scheduler.h"
#include "common/engine/synth.h"

#define H_MAX_IDS 4096

/* Every output seen for each request id (< H_MAX_IDS). */
typedef struct h_log {
    uint32_t outputs[H_MAX_IDS];    /* outputs received */
    uint32_t finals[H_MAX_IDS];     /* outputs with a finish reason */
    uint32_t tokens[H_MAX_IDS];     /* tokens received */
    sched_finish finish[H_MAX_IDS]; /* last finish reason */
} h_log;

/* The test defaults: one NORMAL rank, nextn 5, 4,097 blocks, 64 sequences, a vote point at
 * every decode step (so prompts do not wait 70 steps unless a test asks for it). */
void h_config(sched_config *c);
sched *h_make(const sched_config *c);
/* Adds request id with a prompt of len tokens (token i is 1 + (id * 31 + i) % 1000). */
void h_add(sched *s, uint64_t id, uint32_t len, uint32_t max_tokens);
void h_add_req(sched *s, const sched_request *r);
/* Asserts sched_check. */
void h_check(sched *s);
sched_plan *h_schedule(sched *s);
/* Processes plan with results (NULL: every entry gets one sampled token 7 and nextn drafts
 * 9, no draft accepted), logs the outputs, checks invariants; returns the outputs. */
const sched_output *h_process(sched *s, sched_plan *plan, const sched_seq_result *results,
                              size_t *n, h_log *log);
/* schedule + process with default results. */
sched_plan *h_step(sched *s, h_log *log);
/* Records outputs in log (may be NULL). */
void h_log_outputs(h_log *log, const sched_output *outs, size_t n);
/* Aborts id, asserts one final output with finish "abort", logs it and checks. */
void h_abort(sched *s, uint64_t id, h_log *log);
/* Index of the entry for request id in plan, or -1. */
int h_entry(const sched_plan *plan, uint64_t id);

#endif
