/* The forward on a backend with device memory (kern_backend.device_memory), checked on the host:
 * the CPU backend's ops behind a table that says device_memory = 1, so the forward places every
 * weight through alloc/from_host and must read nothing else. The checkpoint mapping is made
 * unreadable (PROT_NONE) while that model runs, so a weight read from the host view crashes the
 * test; the logits, draft outputs and caches must equal, bit for bit, those of the plain CPU
 * backend on the same scenario (tests/forward/fwd_scenario.h; the CUDA backend runs the same
 * scenario in tests/gpu/check_forward.c). Allocation failures at every point of model, run and
 * KV creation and inside a step give DI_ENOMEM with a message and leak nothing. The executor
 * (runner_exec) on the same backend, with a fork done by the plan's copies, matches too. */
#include <criterion/criterion.h>
#include <sys/mman.h>
#include <unistd.h>

#include "common/model/forward.h"
#include "common/model/runner.h"
#include "common/model/runner_exec.h"
#include "common/model/safetensors.h"
#include "common/sampling/sampler_backend.h"
#include "kernels/cpu/backend.h"
#include "tests/forward/fwd_scenario.h"

/* Read access to every shard mapping of the checkpoint on or off. */
static void protect_weights(const model_weights *w, int readable)
{
    long page = sysconf(_SC_PAGESIZE);
    for (uint32_t i = 0; i < w->index->n_shards; i++) {
        const st_file *f = w->shards[i];
        size_t len = (f->file_bytes + (size_t)page - 1) / (size_t)page * (size_t)page;
        cr_assert_eq(mprotect((void *)f->map, len, readable ? PROT_READ : PROT_NONE), 0);
    }
}

typedef struct dev_env {
    kern_backend cpu, dev;
    trk_state trk;
    runner_model rm;
} dev_env;

static void env_open(dev_env *v, const char *config, uint64_t seed)
{
    di_error e;
    memset(v, 0, sizeof(*v));
    cr_assert_eq(kern_cpu_create(2, &v->cpu, &e), DI_OK, "%s", e.msg);
    trk_wrap(&v->trk, &v->cpu, 1, &v->dev);
    cr_assert_eq(runner_model_random(config, seed, NULL, NULL, &v->rm, &e), DI_OK, "%s", e.msg);
}

static void env_close(dev_env *v)
{
    runner_model_free(&v->rm);
    kern_cpu_destroy(&v->cpu);
}

static fwd_options opts(const dev_env *v, const scn_params *p)
{
    fwd_options o = {.nextn = p->nextn, .max_rows = SCN_CHUNK, .yoco = p->yoco,
                     .keep_tokens = p->keep_tokens, .token_map = v->rm.token_map,
                     .token_map_pad = v->rm.token_map_pad};
    return o;
}

/* The scenario on backend be; the model, run and KV are freed before returning. With
 * protect, the weights are unreadable from model creation's end until the run is over. */
static void run_on(dev_env *v, const kern_backend *be, const scn_params *p, int protect,
                   scn_out *out)
{
    di_error e;
    fwd_options o = opts(v, p);
    fwd_model *m = NULL;
    fwd_run *run = NULL;
    fwd_kv *kv = NULL;
    cr_assert_eq(fwd_model_create(v->rm.w, be, &o, &m, &e), DI_OK, "%s", e.msg);
    cr_assert_eq(fwd_run_create(m, &run, &e), DI_OK, "%s", e.msg);
    cr_assert_eq(fwd_kv_create(fwd_model_geometry(m), be, SCN_BLOCKS, SCN_SLOTS, &kv, &e), DI_OK,
                 "%s", e.msg);
    if (protect)
        protect_weights(v->rm.w, 0);
    di_status st = scn_run(run, kv, m, p, out, &e);
    if (protect)
        protect_weights(v->rm.w, 1);
    cr_assert_eq(st, DI_OK, "%s", e.msg);
    fwd_kv_free(kv);
    fwd_run_free(run);
    fwd_model_free(m);
}

static void same_outputs(const scn_out *a, const scn_out *b)
{
    cr_assert_eq(a->n_rows, b->n_rows);
    cr_assert_gt(a->n_rows, 0);
    cr_assert_eq(memcmp(a->row_pos, b->row_pos, a->n_rows * sizeof(int64_t)), 0);
    for (uint32_t r = 0; r < a->n_rows; r++)
        cr_assert_eq(memcmp(a->logits + (size_t)r * a->vocab, b->logits + (size_t)r * b->vocab,
                            a->vocab * sizeof(float)), 0,
                     "logits of sequence %d position %lld differ", a->row_seq[r],
                     (long long)a->row_pos[r]);
    cr_assert_eq(a->n_drafts, b->n_drafts);
    cr_assert_eq(memcmp(a->draft_logits, b->draft_logits,
                        (size_t)a->n_drafts * a->vocab * sizeof(float)), 0);
    cr_assert_eq(memcmp(a->draft_conf, b->draft_conf, a->n_drafts * sizeof(float)), 0);
    cr_assert_eq(a->blocks_bytes, b->blocks_bytes);
    cr_assert_eq(memcmp(a->blocks, b->blocks, a->blocks_bytes), 0, "KV blocks differ");
    cr_assert_eq(a->slots_bytes, b->slots_bytes);
    cr_assert_eq(memcmp(a->slots, b->slots, a->slots_bytes), 0, "state slots differ");
}

static void placed_equals_host(const char *config, fwd_yoco yoco)
{
    dev_env v;
    env_open(&v, config, 11);
    scn_params p = {.config = config, .nextn = 3, .yoco = yoco, .keep_tokens = 160, .seed = 5};
    scn_out a, b;
    run_on(&v, &v.cpu, &p, 0, &a);
    run_on(&v, &v.dev, &p, 1, &b);
    cr_assert_gt(v.trk.n_allocs, 0, "the device path allocated nothing");
    cr_assert_eq(v.trk.live, 0, "%lld backend allocations leaked", (long long)v.trk.live);
    cr_assert_gt(b.n_drafts, 0);
    same_outputs(&a, &b);
    scn_out_free(&a);
    scn_out_free(&b);
    env_close(&v);
}

Test(device, placed_weights_give_the_host_results_bit_for_bit, .timeout = 120)
{
    placed_equals_host("tiny", FWD_YOCO_OFF);
}

Test(device, placed_weights_with_yoco_compact_and_mask, .timeout = 120)
{
    placed_equals_host("tiny", FWD_YOCO_COMPACT);
    placed_equals_host("tiny", FWD_YOCO_MASK);
}

/* Model, run and KV creation with allocation k refused, for every k until creation succeeds:
 * DI_ENOMEM with a message, nothing left allocated. */
Test(device, refused_allocations_at_creation_fail_cleanly, .timeout = 120)
{
    dev_env v;
    env_open(&v, "tiny", 3);
    scn_params p = {.nextn = 3, .yoco = FWD_YOCO_OFF};
    fwd_options o = opts(&v, &p);
    di_error e;
    uint64_t k = 0;
    cr_assert_eq(scn_refuse_creation(&v.trk, v.rm.w, &v.dev, &o, &k, &e), DI_OK, "%s", e.msg);
    /* 37 run buffers, the blocks and the slots, at least one weight chunk */
    cr_assert_geq(k, 40, "only %llu allocations at creation", (unsigned long long)k);
    env_close(&v);
}

/* A step whose own allocation (the logits buffer, the indexer scores) is refused fails with
 * DI_ENOMEM and leaks nothing; the same step then runs. */
Test(device, refused_allocation_inside_a_step_fails_cleanly, .timeout = 60)
{
    dev_env v;
    env_open(&v, "tiny", 4);
    scn_params p = {.nextn = 3, .yoco = FWD_YOCO_OFF};
    fwd_options o = opts(&v, &p);
    di_error e;
    fwd_model *m = NULL;
    fwd_run *run = NULL;
    fwd_kv *kv = NULL;
    cr_assert_eq(fwd_model_create(v.rm.w, &v.dev, &o, &m, &e), DI_OK, "%s", e.msg);
    cr_assert_eq(fwd_run_create(m, &run, &e), DI_OK, "%s", e.msg);
    cr_assert_eq(fwd_kv_create(fwd_model_geometry(m), &v.dev, SCN_BLOCKS, SCN_SLOTS, &kv, &e),
                 DI_OK, "%s", e.msg);
    uint64_t refused = 0;
    cr_assert_eq(scn_refuse_in_step(&v.trk, run, kv, fwd_model_config(m)->vocab_size, &refused,
                                    &e), DI_OK, "%s", e.msg);
    cr_assert_gt(refused, 0);
    fwd_kv_free(kv);
    fwd_run_free(run);
    fwd_model_free(m);
    cr_assert_eq(v.trk.live, 0, "%lld allocations leaked", (long long)v.trk.live);
    env_close(&v);
}

/* ---- the executor ---- */

static void exec_run(dev_env *v, const kern_backend *be, int protect, scn_exec *x)
{
    di_error e;
    cr_assert_eq(scn_exec_open(x, &v->rm, be, &e), DI_OK, "%s", e.msg);
    if (protect)
        protect_weights(v->rm.w, 0);
    di_status st = scn_exec_steps(x, &e);
    if (protect)
        protect_weights(v->rm.w, 1);
    cr_assert_eq(st, DI_OK, "%s", e.msg);
    cr_assert_eq(scn_exec_close(x, &e), DI_OK, "%s", e.msg);
}

Test(device, executor_with_forks_on_placed_weights_matches_the_host, .timeout = 120)
{
    dev_env v;
    env_open(&v, "tiny", 21);
    scn_exec a, b;
    exec_run(&v, &v.cpu, 0, &a);
    exec_run(&v, &v.dev, 1, &b);
    uint32_t V = a.log.vocab;
    /* the fork: request 2's first decode row saw request 1's KV through the copies */
    int i1 = scn_exec_find(&a, 1, 150), i2 = scn_exec_find(&a, 2, 150);
    cr_assert(i1 >= 0 && i2 >= 0, "no logits of position 150 for both requests");
    cr_assert_eq(memcmp(a.log.rows + (size_t)i1 * V, a.log.rows + (size_t)i2 * V, V * 4), 0,
                 "the forked request's logits differ from its parent's");
    /* the device path equals the host path */
    cr_assert_eq(a.log.n, b.log.n);
    cr_assert_eq(memcmp(a.log.rows, b.log.rows, (size_t)a.log.n * V * 4), 0);
    cr_assert_eq(memcmp(a.res, b.res, sizeof(a.res)), 0);
    cr_assert_eq(memcmp(a.blocks, b.blocks, a.blocks_bytes), 0);
    cr_assert_eq(memcmp(a.slots, b.slots, a.slots_bytes), 0);
    scn_exec_free(&a);
    scn_exec_free(&b);
    cr_assert_eq(v.trk.live, 0, "%lld allocations leaked", (long long)v.trk.live);
    env_close(&v);
}

/* ---- sampling on the backend ---- */

static sampler_workspace *g_sample_ws;
static uint64_t g_sample_calls;

static di_status dev_sample(void *ctx, const kern_sample *p)
{
    (void)ctx;
    g_sample_calls++;
    return sampler_host_sample(g_sample_ws, p);
}

typedef struct sampled_run {
    sched_seq_result res[6][2];
    runner_token toks[2][6];
} sampled_run;

/* The token (with its logprobs) each request made in step k. */
static void keep_tokens(const runner_exec *ex, sampled_run *out, uint32_t k)
{
    for (int r = 0; r < 2; r++) {
        uint32_t n = 0;
        const runner_token *t = runner_exec_tokens(ex, (uint64_t)r + 1, &n);
        cr_assert_eq(n, 1, "request %d made %u tokens in step %u", r + 1, n, k);
        out->toks[r][k] = t[0];
    }
}

/* Two requests (sampled with top-p and logprobs; greedy with a blacklist and an EOS ban): one
 * prompt step of both, then five decode steps of one row each. */
static void run_sampled(dev_env *v, const kern_backend *be, int host_sampling, sampled_run *out)
{
    di_error e;
    runner_exec *ex = NULL;
    runner_exec_options o = {.fwd = {.nextn = 0, .max_rows = 256, .token_map_pad = -1},
                             .n_blocks = 5, .n_slots = 2, .host_sampling = host_sampling};
    cr_assert_eq(runner_exec_create(&v->rm, be, &o, &ex, &e), DI_OK, "%s", e.msg);
    uint32_t V = v->rm.w->config.vocab_size;
    int32_t prompt[2][100];
    static const int32_t bl[2] = {7, 11};
    for (int r = 0; r < 2; r++) {
        for (int i = 0; i < 100; i++)
            prompt[r][i] = 3 + (i * (31 + 6 * r)) % (int32_t)(V - 3);
        runner_request q = {.id = (uint64_t)r + 1, .prompt = prompt[r], .prompt_len = 100,
                            .max_tokens = 8, .params = sampling_params_default()};
        if (r == 0) {
            q.params.temperature = 0.8f;
            q.params.top_p = 0.9f;
            q.params.n_logprobs = 5;
            q.params.seed = 3;
        } else {
            q.params.temperature = 0.0f;
            q.params.blacklist = bl;
            q.params.n_blacklist = 2;
            q.params.eos_id = 1;
            q.params.first_n_no_eos = 3;
        }
        cr_assert_eq(runner_exec_add(ex, &q, &e), DI_OK, "%s", e.msg);
    }
    const uint32_t tables[2][2] = {{1, 2}, {3, 4}};
    sched_seq_plan s[2];
    for (int r = 0; r < 2; r++)
        s[r] = (sched_seq_plan){.request_id = (uint64_t)r + 1, .seqlen_q = 100, .seqlen_k = 100,
                                .tokens = prompt[r], .block_table = tables[r], .n_blocks = 2,
                                .state_slot = r, .sample = true};
    sched_plan p = {.prompt_run = true, .n_seqs = 2, .seqs = s, .n_rows = 200};
    cr_assert_eq(runner_exec_step(ex, &p, out->res[0], &e), DI_OK, "%s", e.msg);
    keep_tokens(ex, out, 0);
    for (uint32_t k = 1; k < 6; k++) {
        int32_t tok[2];
        for (int r = 0; r < 2; r++) {
            cr_assert_eq(out->res[k - 1][r].status, SCHED_RESULT_OK);
            cr_assert_eq(out->res[k - 1][r].n_tokens, 1);
            tok[r] = out->res[k - 1][r].tokens[0];
            s[r].seqlen_q = 1;
            s[r].seqlen_k = 100 + k;
            s[r].first_position = 99 + k;
            s[r].tokens = &tok[r];
        }
        sched_plan d = {.step = k, .n_seqs = 2, .seqs = s, .n_rows = 2};
        cr_assert_eq(runner_exec_step(ex, &d, out->res[k], &e), DI_OK, "%s", e.msg);
        keep_tokens(ex, out, k);
    }
    runner_exec_free(ex);
}

Test(device, executor_samples_on_the_backend_with_the_host_results, .timeout = 120)
{
    dev_env v;
    env_open(&v, "tiny", 31);
    g_sample_ws = NULL;
    di_error e;
    cr_assert_eq(sampler_workspace_new(v.rm.w->config.vocab_size, &g_sample_ws, &e), DI_OK);
    v.dev.ops.sample = dev_sample;
    sampled_run *a = calloc(3, sizeof(*a));
    cr_assert_not_null(a);
    run_sampled(&v, &v.cpu, 0, &a[0]); /* no sample entry: the host */
    g_sample_calls = 0;
    run_sampled(&v, &v.dev, 0, &a[1]);
    cr_assert_eq(g_sample_calls, 6, "every step sampled on the backend (%llu calls)",
                 (unsigned long long)g_sample_calls);
    run_sampled(&v, &v.dev, 1, &a[2]);
    cr_assert_eq(g_sample_calls, 6, "host_sampling keeps the logits on the host");
    for (int k = 1; k < 3; k++) {
        cr_assert_eq(memcmp(a[0].res, a[k].res, sizeof(a[0].res)), 0, "run %d: results differ", k);
        for (int r = 0; r < 2; r++)
            for (int i = 0; i < 6; i++) {
                const runner_token *x = &a[0].toks[r][i], *y = &a[k].toks[r][i];
                cr_assert_eq(x->token, y->token);
                cr_assert_eq(memcmp(&x->res.logprob, &y->res.logprob, 4), 0);
                cr_assert_eq(x->res.n_top, y->res.n_top);
                cr_assert_eq(memcmp(x->res.top_tokens, y->res.top_tokens, x->res.n_top * 4), 0);
                cr_assert_eq(memcmp(x->res.top_logprobs, y->res.top_logprobs, x->res.n_top * 4),
                             0);
            }
    }
    cr_assert_eq(a[0].toks[0][0].res.n_top, 5);
    free(a);
    sampler_workspace_free(g_sample_ws);
    cr_assert_eq(v.trk.live, 0, "%lld allocations leaked", (long long)v.trk.live);
    env_close(&v);
}
