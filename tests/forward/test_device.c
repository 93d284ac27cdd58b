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
#include "common/model/safetensors.h"
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
