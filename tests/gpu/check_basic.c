/* check_basic: the CUDA backend's fakequant, rmsnorm, embed and rope against their C twins
 * (kern_cpu_create's table) on adversarial and random inputs, with each op's tolerance from
 * kernels/kernels.h: fakequant and embed bit for bit, rmsnorm and rope within one bf16 ulp.
 * Outputs and row padding are poisoned before each run (every element must be written, none
 * past the rows). Also the refused inputs and the capability query. With --bench, bandwidth of
 * each op next to the device copy bandwidth measured in the same run.
 * Exit 0: all match; 1: a mismatch (parameters and first mismatches printed); 2: setup error.
 * --bench times the ops even after a mismatch (under a banner), so one run brings numbers back. */
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/cpu/numfmt.h"
#include "kernels/cuda/backend_cuda.h"
#include "tests/gpu/check_util.h"
#include "tests/gpu/gpu_common.h"

static const char usage[] =
    "usage: check_basic [--bench] [--seed N]\n"
    "  CUDA fakequant, rmsnorm, embed, rope against the C twins; --bench adds bandwidths\n";

static const char *const qfmt_name[3] = {"fp8_b32(A)", "fp4_b32(B)", "fp4_b16(C)"};

/* ---- fakequant: in place on [rows, stride], padding poisoned; exact ---- */

static void check_fakequant(chk_env *env, kern_qfmt fmt, uint32_t rows, uint32_t n, uint32_t pad,
                            int mode)
{
    di_rng rng;
    uint64_t seed = chk_case_rng(env, &rng);
    size_t stride = (size_t)n + pad, total = rows * stride, bytes = total * 2;
    uint16_t *x = chk_malloc(bytes), *out = chk_malloc(bytes);
    chk_fill_u16(x, total, CHK_POISON_BF16);
    for (uint32_t r = 0; r < rows; r++)
        chk_fill_bf16(x + r * stride, n, mode, &rng);
    char what[256];
    snprintf(what, sizeof(what), "fakequant %s rows=%u n=%u stride=%zu mode=%s seed=%" PRIu64,
             qfmt_name[fmt], rows, n, stride, chk_mode_name[mode], seed);

    uint16_t *d = chk_dev_alloc(env, bytes);
    chk_put(env, d, x, bytes);
    kern_fakequant pg = {rows, n, d, stride, fmt};
    size_t bad = chk_gpu_status(env, env->gpu.ops.fakequant(env->gpu.ctx, &pg), what);
    chk_get(env, out, d, bytes);
    kern_fakequant pc = {rows, n, x, stride, fmt};
    chk_cpu_status(env->cpu.ops.fakequant(env->cpu.ctx, &pc), what);
    if (!bad)
        bad = chk_cmp_bf16_exact(what, x, out, total);
    chk_count(env, bad);
    chk_dev_free(env, d);
    free(x);
    free(out);
}

/* ---- rmsnorm: y separate (poisoned, padded) or in place; bf16 1ulp, padding exact ---- */

static void check_rmsnorm(chk_env *env, uint32_t rows, uint32_t dim, uint32_t pad, int in_place,
                          int weighted, float eps, int mode)
{
    di_rng rng;
    uint64_t seed = chk_case_rng(env, &rng);
    size_t stride = (size_t)dim + pad, total = rows * stride, bytes = total * 2;
    uint16_t *x = chk_malloc(bytes), *y = chk_malloc(bytes), *w = chk_malloc((size_t)dim * 2);
    uint16_t *gx = chk_malloc(bytes), *gy = chk_malloc(bytes);
    uint8_t *mask = chk_malloc(total);
    chk_fill_u16(x, total, CHK_POISON_BF16);
    chk_fill_u16(y, total, CHK_POISON_BF16);
    for (uint32_t r = 0; r < rows; r++)
        chk_fill_bf16(x + r * stride, dim, mode, &rng);
    chk_fill_bf16(w, dim, CHK_NORMAL, &rng);
    for (size_t i = 0; i < total; i++)
        mask[i] = i % stride < dim;
    char what[256];
    snprintf(what, sizeof(what),
             "rmsnorm rows=%u dim=%u stride=%zu in_place=%d weight=%d eps=%g mode=%s seed=%" PRIu64,
             rows, dim, stride, in_place, weighted, (double)eps, chk_mode_name[mode], seed);

    uint16_t *dx = chk_dev_alloc(env, bytes), *dy = chk_dev_alloc(env, bytes);
    uint16_t *dw = chk_dev_alloc(env, (size_t)dim * 2);
    chk_put(env, dx, x, bytes);
    chk_put(env, dy, y, bytes);
    chk_put(env, dw, w, (size_t)dim * 2);
    kern_rmsnorm pg = {rows, dim, dx, stride, weighted ? dw : NULL, in_place ? dx : dy, stride,
                       eps};
    size_t bad = chk_gpu_status(env, env->gpu.ops.rmsnorm(env->gpu.ctx, &pg), what);
    chk_get(env, gx, dx, bytes);
    chk_get(env, gy, dy, bytes);
    uint16_t *cx = chk_malloc(bytes);
    memcpy(cx, x, bytes);
    kern_rmsnorm pc = {rows, dim, cx, stride, weighted ? w : NULL, in_place ? cx : y, stride, eps};
    chk_cpu_status(env->cpu.ops.rmsnorm(env->cpu.ctx, &pc), what);
    if (!bad && in_place) {
        bad = chk_cmp_bf16_ulp(what, cx, gx, mask, total, 1);
    } else if (!bad) {
        bad = chk_cmp_bf16_ulp(what, y, gy, mask, total, 1);
        bad += chk_cmp_bf16_exact("rmsnorm input left unchanged", x, gx, total);
    }
    chk_count(env, bad);
    chk_dev_free(env, dx);
    chk_dev_free(env, dy);
    chk_dev_free(env, dw);
    free(x), free(y), free(w), free(gx), free(gy), free(cx), free(mask);
}

/* ---- embed: out poisoned; exact ---- */

static void check_embed(chk_env *env, uint32_t rows, uint32_t dim, uint32_t copies, uint32_t vocab)
{
    di_rng rng;
    uint64_t seed = chk_case_rng(env, &rng);
    size_t tbytes = (size_t)vocab * dim * 2, obytes = (size_t)rows * copies * dim * 2;
    uint16_t *table = chk_malloc(tbytes), *out = chk_malloc(obytes), *gout = chk_malloc(obytes);
    int32_t *ids = chk_malloc((size_t)rows * 4);
    chk_fill_bf16_fast(table, (size_t)vocab * dim, 1.0f, &rng);
    for (uint32_t t = 0; t < rows; t++)
        ids[t] = (int32_t)di_rng_below(&rng, vocab);
    ids[0] = 0;
    ids[rows - 1] = (int32_t)vocab - 1;
    chk_fill_u16(out, obytes / 2, CHK_POISON_BF16);
    char what[192];
    snprintf(what, sizeof(what), "embed rows=%u dim=%u copies=%u vocab=%u seed=%" PRIu64, rows,
             dim, copies, vocab, seed);

    uint16_t *dt = chk_dev_alloc(env, tbytes), *dout = chk_dev_alloc(env, obytes);
    chk_put(env, dt, table, tbytes);
    chk_put(env, dout, out, obytes);
    kern_embed pg = {rows, dim, copies, vocab, ids, dt, dout, NULL};
    size_t bad = chk_gpu_status(env, env->gpu.ops.embed(env->gpu.ctx, &pg), what);
    chk_get(env, gout, dout, obytes);
    kern_embed pc = {rows, dim, copies, vocab, ids, table, out, NULL};
    chk_cpu_status(env->cpu.ops.embed(env->cpu.ctx, &pc), what);
    if (!bad)
        bad = chk_cmp_bf16_exact(what, out, gout, obytes / 2);
    chk_count(env, bad);
    /* the ids already in device memory (one step ahead): the same rows; an id outside the
     * vocabulary gives a zero row and fails the next synchronisation */
    int32_t *dids = chk_dev_copy(env, ids, (size_t)rows * 4);
    chk_fill_u16(gout, obytes / 2, CHK_POISON_BF16);
    chk_put(env, dout, gout, obytes);
    kern_embed pd = {rows, dim, copies, vocab, NULL, dt, dout, dids};
    snprintf(what + strlen(what), sizeof(what) - strlen(what), " ids_dev");
    bad = chk_gpu_status(env, env->gpu.ops.embed(env->gpu.ctx, &pd), what);
    chk_get(env, gout, dout, obytes);
    if (!bad)
        bad = chk_cmp_bf16_exact(what, out, gout, obytes / 2);
    chk_count(env, bad);
    if (rows > 1) {
        int32_t over = (int32_t)vocab;
        chk_put(env, dids + 1, &over, 4);
        di_error e;
        bad = chk_gpu_status(env, env->gpu.ops.embed(env->gpu.ctx, &pd), what);
        bad += chk_expect(env, kern_cuda_sync(&env->gpu, &e), DI_EINVAL,
                          "embed ids_dev: an id past the vocabulary fails the sync");
        chk_get(env, gout, dout, obytes);
        for (size_t i = 0; i < (size_t)copies * dim && !bad; i++)
            if (gout[(size_t)copies * dim + i] != 0) {
                printf("FAIL %s: row 1 of a bad id is not zero\n", what);
                bad++;
            }
        chk_count(env, bad);
    }
    chk_dev_free(env, dids);
    chk_dev_free(env, dt);
    chk_dev_free(env, dout);
    free(table), free(out), free(gout), free(ids);
}

/* ---- rope: in place on [rows, heads*head_dim + pad]; bf16 1ulp on the rotated numbers, the
 * rest (the head's first numbers, row padding) exact ---- */

typedef struct rope_case {
    uint32_t rows, heads, head_dim, rope_dim, pad;
    int yarn, inverse;
    int64_t pos_max;            /* positions drawn in [0, pos_max); consecutive when < 0 */
    int mode;
} rope_case;

static void check_rope(chk_env *env, const rope_case *rc)
{
    di_rng rng;
    uint64_t seed = chk_case_rng(env, &rng);
    size_t row_stride = (size_t)rc->heads * rc->head_dim + rc->pad;
    size_t total = rc->rows * row_stride, bytes = total * 2;
    uint16_t *x = chk_malloc(bytes), *gx = chk_malloc(bytes);
    uint8_t *mask = chk_malloc(total);
    int64_t *pos = chk_malloc((size_t)rc->rows * 8);
    uint32_t offset = rc->head_dim - rc->rope_dim;
    chk_fill_u16(x, total, CHK_POISON_BF16);
    for (uint32_t r = 0; r < rc->rows; r++)
        chk_fill_bf16(x + r * row_stride, (size_t)rc->heads * rc->head_dim, rc->mode, &rng);
    for (size_t i = 0; i < total; i++) {
        size_t in_row = i % row_stride, in_head = in_row % rc->head_dim;
        mask[i] = in_row < (size_t)rc->heads * rc->head_dim && in_head >= offset;
    }
    int64_t start = (int64_t)di_rng_below(&rng, 100000);
    for (uint32_t r = 0; r < rc->rows; r++)
        pos[r] = rc->pos_max < 0 ? start + r : (int64_t)di_rng_below(&rng, (uint64_t)rc->pos_max);
    char what[256];
    snprintf(what, sizeof(what),
             "rope rows=%u heads=%u head_dim=%u rope_dim=%u pad=%u yarn=%d inverse=%d "
             "pos_max=%" PRId64 " mode=%s seed=%" PRIu64,
             rc->rows, rc->heads, rc->head_dim, rc->rope_dim, rc->pad, rc->yarn, rc->inverse,
             rc->pos_max, chk_mode_name[rc->mode], seed);
    kern_rope p = {.n_rows = rc->rows, .n_heads = rc->heads, .row_stride = row_stride,
                   .head_stride = rc->head_dim, .offset = offset, .rope_dim = rc->rope_dim,
                   .positions = pos, .inverse = rc->inverse,
                   .base = rc->yarn ? 160000.0f : 10000.0f, .yarn = rc->yarn,
                   .yarn_factor = 16.0f, .yarn_orig_len = 65536.0f, .yarn_beta_fast = 32.0f,
                   .yarn_beta_slow = 1.0f};

    uint16_t *d = chk_dev_alloc(env, bytes);
    chk_put(env, d, x, bytes);
    p.x = d;
    size_t bad = chk_gpu_status(env, env->gpu.ops.rope(env->gpu.ctx, &p), what);
    chk_get(env, gx, d, bytes);
    p.x = x;
    chk_cpu_status(env->cpu.ops.rope(env->cpu.ctx, &p), what);
    if (!bad)
        bad = chk_cmp_bf16_ulp(what, x, gx, mask, total, 1);
    chk_count(env, bad);
    chk_dev_free(env, d);
    free(x), free(gx), free(mask), free(pos);
}

/* ---- refused inputs and the capability query ---- */

static void check_refusals(chk_env *env)
{
    kern_ops *o = &env->gpu.ops;
    void *c = env->gpu.ctx;
    uint16_t *d = chk_dev_alloc(env, 4096);
    size_t bad = 0;
    int32_t ids[2] = {0, 7};
    int64_t pos[1] = {3};
    kern_fakequant fq = {1, 48, d, 48, KERN_Q_FP8_B32};
    bad += chk_expect(env, o->fakequant(c, NULL), DI_EINVAL, "fakequant(NULL)");
    bad += chk_expect(env, o->fakequant(c, &fq), DI_EINVAL, "fakequant n=48 with (A)");
    fq.n = 32;
    fq.stride = 16;
    bad += chk_expect(env, o->fakequant(c, &fq), DI_EINVAL, "fakequant stride 16 < n 32");
    fq.stride = 32;
    fq.fmt = (kern_qfmt)7;
    bad += chk_expect(env, o->fakequant(c, &fq), DI_EINVAL, "fakequant format 7");
    kern_rmsnorm rn = {1, 64, NULL, 64, NULL, d, 64, 1e-6f};
    bad += chk_expect(env, o->rmsnorm(c, &rn), DI_EINVAL, "rmsnorm x NULL");
    kern_embed em = {2, 8, 1, 7, ids, d, d + 512, NULL};
    bad += chk_expect(env, o->embed(c, &em), DI_EINVAL, "embed id 7 with vocab 7");
    ids[1] = -1;
    bad += chk_expect(env, o->embed(c, &em), DI_EINVAL, "embed id -1");
    kern_rope rp = {.n_rows = 1, .n_heads = 1, .x = d, .row_stride = 64, .head_stride = 64,
                    .rope_dim = 63, .positions = pos, .base = 10000.0f};
    bad += chk_expect(env, o->rope(c, &rp), DI_EINVAL, "rope rope_dim 63");
    rp.rope_dim = 514;
    bad += chk_expect(env, o->rope(c, &rp), DI_EINVAL, "rope rope_dim 514");
    /* the backend still works after refusals */
    fq.fmt = KERN_Q_FP8_B32;
    bad += chk_expect(env, o->fakequant(c, &fq), DI_OK, "fakequant after refusals");
    chk_sync(env);

    /* the backend fills the whole table: supports() says so for every field, and no more */
    for (size_t i = 0; i < kern_cuda_op_count(); i++)
        if (!kern_cuda_supports(&env->gpu, kern_cuda_op_name(i))) {
            fprintf(stderr, "FAIL supports(%s) is 0: the table has a hole\n", kern_cuda_op_name(i));
            bad++;
        }
    if (kern_cuda_supports(&env->gpu, "no_such_op") || kern_cuda_supports(NULL, "rope")) {
        fprintf(stderr, "FAIL supports() claims an op that does not exist\n");
        bad++;
    }
    printf("cuda backend fills:");
    for (size_t i = 0; i < kern_cuda_op_count(); i++)
        if (kern_cuda_supports(&env->gpu, kern_cuda_op_name(i)))
            printf(" %s", kern_cuda_op_name(i));
    printf("\ncuda backend leaves NULL:");
    for (size_t i = 0; i < kern_cuda_op_count(); i++)
        if (!kern_cuda_supports(&env->gpu, kern_cuda_op_name(i)))
            printf(" %s", kern_cuda_op_name(i));
    printf("\n");
    chk_count(env, bad);
    chk_dev_free(env, d);
}

/* ---- the sweeps ---- */

static void sweep(chk_env *env)
{
    static const uint32_t fq_rows[] = {1, 3, 63, 127};
    static const uint32_t fq_n[] = {16, 32, 96, 512, 5120};
    for (int fmt = 0; fmt < 3; fmt++)
        for (size_t r = 0; r < 4; r++)
            for (size_t ni = 0; ni < 5; ni++) {
                uint32_t n = fq_n[ni];
                if (n % (fmt == KERN_Q_FP4_B16 ? 16 : 32))
                    continue;
                for (int mode = 0; mode < CHK_MODES; mode++)
                    check_fakequant(env, (kern_qfmt)fmt, fq_rows[r], n, (r & 1) ? 5 : 0, mode);
            }
    int c0 = env->checks;
    printf("fakequant: %d cases\n", env->checks);

    static const uint32_t rn_rows[] = {1, 3, 63, 127};
    static const uint32_t rn_dim[] = {64, 512, 5120, 20480};
    for (size_t r = 0; r < 4; r++)
        for (size_t di = 0; di < 4; di++)
            for (int mode = 0; mode < CHK_MODES; mode++)
                check_rmsnorm(env, rn_rows[r], rn_dim[di], (di & 1) ? 3 : 0, (mode + r) % 2,
                              (mode + di) % 3 != 0, mode % 2 ? 1e-20f : 1e-6f, mode);
    printf("rmsnorm: %d cases\n", env->checks - c0);
    c0 = env->checks;

    static const uint32_t em_rows[] = {1, 3, 63, 127};
    for (size_t r = 0; r < 4; r++) {
        check_embed(env, em_rows[r], 64, 1, 1000);
        check_embed(env, em_rows[r], 5120, 4, 3000);
        check_embed(env, em_rows[r], 72, 3, 50);
    }
    printf("embed: %d cases\n", env->checks - c0);
    c0 = env->checks;

    static const rope_case rc[] = {
        {1, 64, 512, 64, 0, 0, 0, -1, CHK_NORMAL},
        {3, 64, 512, 64, 8, 1, 0, -1, CHK_NORMAL},
        {63, 8, 512, 64, 0, 1, 1, 1 << 20, CHK_NORMAL},
        {127, 1, 512, 64, 3, 0, 1, 1 << 20, CHK_ARANGE},
        {127, 32, 128, 64, 0, 1, 0, 1 << 20, CHK_NORMAL},
        {5, 4, 64, 64, 0, 0, 0, -1, CHK_ONES},
        {9, 2, 96, 32, 2, 1, 0, 1000000000, CHK_LARGE},
        {4, 3, 512, 512, 0, 1, 1, 1 << 20, CHK_NORMAL},
        {2, 2, 64, 16, 0, 0, 0, -1, CHK_ZEROS},
        {7, 5, 128, 64, 1, 1, 0, 1 << 16, CHK_SPECIALS},
        {63, 64, 512, 64, 0, 0, 0, 1 << 20, CHK_EDGES},
    };
    for (size_t i = 0; i < sizeof(rc) / sizeof(rc[0]); i++)
        check_rope(env, &rc[i]);
    printf("rope: %d cases\n", env->checks - c0);
    check_refusals(env);
}

/* ---- benchmark: bytes each op must move over its time, next to the copy bandwidth ---- */

#define BENCH_SETS 8 /* 8 x 40 MB inputs: well past the 60 MB L2 */

typedef struct bench_arg {
    chk_env *env;
    int op;                     /* 0 rmsnorm, 1 fakequant, 2 rope, 3 embed */
    uint16_t *x[BENCH_SETS];    /* [rows, dim] inputs */
    uint16_t *y[BENCH_SETS];    /* outputs */
    uint16_t *w;                /* rmsnorm weight; embed table */
    int32_t *ids;
    int64_t *pos;
    uint32_t rows, dim;
} bench_arg;

/* each op's tensors fit the 40 MiB sets: [4096, 5120], rope [640, 64 x 512], embed
 * [1024, 4 x 5120] */
enum {
    ROWS = 4096, DIM = 5120, HEADS = 64, HEAD_DIM = 512, ROPE = 64, ROPE_ROWS = 640,
    COPIES = 4, EMBED_ROWS = 1024, VOCAB = 129280
};

static di_status bench_call(void *varg, int i)
{
    bench_arg *a = varg;
    kern_backend *g = &a->env->gpu;
    int s = i % BENCH_SETS;
    if (a->op == 0) {
        kern_rmsnorm p = {ROWS, DIM, a->x[s], DIM, a->w, a->y[s], DIM, 1e-20f};
        return g->ops.rmsnorm(g->ctx, &p);
    }
    if (a->op == 1) {
        kern_fakequant p = {ROWS, DIM, a->x[s], DIM, KERN_Q_FP8_B32};
        return g->ops.fakequant(g->ctx, &p);
    }
    if (a->op == 2) {
        kern_rope p = {.n_rows = ROPE_ROWS, .n_heads = HEADS, .x = a->x[s],
                       .row_stride = (size_t)HEADS * HEAD_DIM, .head_stride = HEAD_DIM,
                       .offset = HEAD_DIM - ROPE, .rope_dim = ROPE, .positions = a->pos,
                       .base = 160000.0f, .yarn = 1, .yarn_factor = 16.0f,
                       .yarn_orig_len = 65536.0f, .yarn_beta_fast = 32.0f, .yarn_beta_slow = 1.0f};
        return g->ops.rope(g->ctx, &p);
    }
    kern_embed p = {EMBED_ROWS, DIM, COPIES, VOCAB, a->ids, a->w, a->y[s], NULL};
    return g->ops.embed(g->ctx, &p);
}

static void bench(chk_env *env)
{
    size_t xbytes = (size_t)ROWS * DIM * 2; /* 40 MiB */
    double copy = gpu_copy_gbs((size_t)1 << 30, 20);
    bench_arg a = {.env = env};
    uint16_t *h = chk_malloc(xbytes);
    di_rng rng;
    chk_case_rng(env, &rng);
    chk_fill_bf16_fast(h, xbytes / 2, 1.0f, &rng);
    for (int s = 0; s < BENCH_SETS; s++) {
        a.x[s] = chk_dev_alloc(env, xbytes);
        a.y[s] = chk_dev_alloc(env, xbytes);
        chk_put(env, a.x[s], h, xbytes);
    }
    size_t tbytes = (size_t)VOCAB * DIM * 2;
    a.w = chk_dev_alloc(env, tbytes);
    uint16_t *t = chk_malloc(tbytes);
    chk_fill_bf16_fast(t, tbytes / 2, 1.0f, &rng);
    chk_put(env, a.w, t, tbytes);
    free(t);
    int32_t ids[EMBED_ROWS];
    int64_t pos[ROPE_ROWS];
    for (int i = 0; i < EMBED_ROWS; i++)
        ids[i] = (int32_t)di_rng_below(&rng, VOCAB);
    for (int i = 0; i < ROPE_ROWS; i++)
        pos[i] = 100000 + i;
    a.ids = ids;
    a.pos = pos;
    free(h);

    /* bytes each op must read and write once */
    const struct {
        const char *name;
        double bytes;
    } ops[4] = {
        {"rmsnorm [4096, 5120]", 2.0 * xbytes + DIM * 2},
        {"fakequant (A) [4096, 5120]", 2.0 * xbytes},
        {"rope yarn [640, 64 x 64 of 512]", 2.0 * ROPE_ROWS * HEADS * ROPE * 2},
        {"embed [1024] x 4 copies of 5120", EMBED_ROWS * (1.0 + COPIES) * DIM * 2},
    };
    printf("\n%-34s %9s %9s %10s %8s\n", "op (bf16)", "us", "GB/s", "copy GB/s", "of copy");
    for (int op = 0; op < 4; op++) {
        a.op = op;
        double ms = chk_time_ms(env, bench_call, &a, 3, 30);
        if (ms <= 0) {
            printf("%-34s failed (message above)\n", ops[op].name);
            continue;
        }
        double gbs = ops[op].bytes / (ms * 1e-3) / 1e9;
        printf("%-34s %9.1f %9.0f %10.0f %7.0f%%\n", ops[op].name, ms * 1e3, gbs, copy,
               100.0 * gbs / copy);
    }
    printf("(inputs rotate over %d sets of 40 MiB; GB/s = bytes read and written once / time)\n",
           BENCH_SETS);
    for (int s = 0; s < BENCH_SETS; s++) {
        chk_dev_free(env, a.x[s]);
        chk_dev_free(env, a.y[s]);
    }
    chk_dev_free(env, a.w);
}

int main(int argc, char **argv)
{
    chk_env env;
    int want_bench = chk_init(&env, argc, argv, usage);
    sweep(&env);
    return chk_finish(&env, "check_basic", want_bench, bench);
}
