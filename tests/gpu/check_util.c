/* check_util.c: helpers shared by the CUDA-vs-C op checks (see check_util.h). */
#include "tests/gpu/check_util.h"

#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/util/clock.h"
#include "kernels/cpu/backend.h"
#include "kernels/cpu/numfmt.h"
#include "kernels/cuda/backend_cuda.h"
#include "tests/gpu/gpu_common.h"

#define SHOW_MISMATCHES 5

const char *const chk_mode_name[CHK_MODES] = {
    "zeros", "ones", "arange", "normal", "tiny", "large", "edges", "specials",
};

int chk_init(chk_env *env, int argc, char **argv, const char *usage)
{
    memset(env, 0, sizeof(*env));
    setvbuf(stdout, NULL, _IOLBF, 0); /* keep stdout and stderr in order in one log */
    env->seed = di_wall_ms() ^ (di_mono_ns() << 20);
    int bench = 0;
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--help") == 0) {
            printf("%s", usage);
            exit(0);
        } else if (strcmp(argv[i], "--bench") == 0) {
            bench = 1;
        } else if (strcmp(argv[i], "--seed") == 0 && i + 1 < argc) {
            char *end = NULL;
            env->seed = strtoull(argv[++i], &end, 0);
            if (!end || *end) {
                fprintf(stderr, "bad --seed value '%s'\n", argv[i]);
                exit(2);
            }
        } else {
            fprintf(stderr, "unknown argument '%s'\n%s", argv[i], usage);
            exit(2);
        }
    }
    di_error e;
    if (kern_cpu_create(0, &env->cpu, &e) != DI_OK) {
        fprintf(stderr, "CPU backend: %s\n", e.msg);
        exit(2);
    }
    if (kern_cuda_create(NULL, &env->gpu, &e) != DI_OK) {
        fprintf(stderr, "CUDA backend: %s\n", e.msg);
        exit(2);
    }
    printf("seed %" PRIu64 " (rerun with --seed %" PRIu64 ")\n", env->seed, env->seed);
    return bench;
}

void chk_fini(chk_env *env)
{
    kern_cuda_destroy(&env->gpu);
    kern_cpu_destroy(&env->cpu);
}

uint64_t chk_case_rng(chk_env *env, di_rng *rng)
{
    uint64_t s = env->seed + env->cases++;
    di_rng_init(rng, s);
    return s;
}

void *chk_malloc(size_t bytes)
{
    void *p = malloc(bytes ? bytes : 1);
    if (!p) {
        fprintf(stderr, "host allocation of %zu bytes failed\n", bytes);
        exit(2);
    }
    return p;
}

void chk_sync(chk_env *env)
{
    di_error e;
    if (kern_cuda_sync(&env->gpu, &e) != DI_OK) {
        fprintf(stderr, "CUDA backend: %s\n", e.msg);
        exit(2);
    }
}

void *chk_dev_alloc(chk_env *env, size_t bytes)
{
    void *p = env->gpu.ops.alloc(env->gpu.ctx, bytes);
    if (!p) {
        fprintf(stderr, "device allocation of %zu bytes: %s\n", bytes,
                kern_cuda_last_error(&env->gpu));
        exit(2);
    }
    return p;
}

void chk_dev_free(chk_env *env, void *p)
{
    env->gpu.ops.free(env->gpu.ctx, p);
    chk_sync(env);
}

void chk_put(chk_env *env, void *dev, const void *host, size_t bytes)
{
    env->gpu.ops.from_host(env->gpu.ctx, dev, host, bytes);
    chk_sync(env);
}

void chk_get(chk_env *env, void *host, const void *dev, size_t bytes)
{
    env->gpu.ops.to_host(env->gpu.ctx, host, dev, bytes);
    chk_sync(env);
}

/* ---- inputs ---- */

/* values a block's numbers are made of in CHK_EDGES, before the block's power of two */
static const float edge_values[] = {
    448.0f,                    /* (A) block maximum exactly on a scale step */
    448.0f * 1.0078125f,       /* just past it: the next scale */
    447.0f,                    /* just below */
    1.0625f,                   /* E4M3 tie between 1 and 1.125 */
    0.25f, 0.75f, 1.25f, 1.75f, 2.5f, 3.5f, 5.0f, /* E2M1 midpoints (ties) */
    6.0f,                      /* (B) block maximum on a scale step */
    6.0f * 1.0078125f,         /* just past it */
    0.001953125f,              /* 2^-9: smallest E4M3 subnormal */
    0.0029296875f,             /* 3 * 2^-10: tie between two E4M3 subnormals */
    -0.0f,
};

void chk_fill_bf16(uint16_t *x, size_t n, int mode, di_rng *rng)
{
    const size_t ne = sizeof(edge_values) / sizeof(edge_values[0]);
    float block_scale = 1.0f;
    for (size_t i = 0; i < n; i++) {
        float v = 0.0f;
        switch (mode) {
        case CHK_ZEROS: v = 0.0f; break;
        case CHK_ONES: v = 1.0f; break;
        case CHK_ARANGE: v = (float)((int)(i % 64) - 32) / 8.0f; break;
        case CHK_NORMAL: v = (float)di_rng_normal(rng); break;
        case CHK_TINY: v = (float)(di_rng_normal(rng) * 1e-6); break;
        case CHK_LARGE: v = (float)(di_rng_normal(rng) * 3e3); break;
        case CHK_EDGES:
            if (i % 16 == 0) /* a power of two per 16 numbers: every 16- and 32-block gets some */
                block_scale = ldexpf(1.0f, (int)di_rng_below(rng, 25) - 12);
            v = edge_values[di_rng_below(rng, ne)] * block_scale;
            if (di_rng_below(rng, 2))
                v = -v;
            break;
        default: /* CHK_SPECIALS */
            v = (float)di_rng_normal(rng);
            if (i % 37 == 5)
                v = di_rng_below(rng, 2) ? NAN : -NAN;
            else if (i % 41 == 7)
                v = INFINITY;
            else if (i % 43 == 11)
                v = -INFINITY;
            break;
        }
        x[i] = di_f32_to_bf16(v);
    }
}

void chk_fill_bf16_fast(uint16_t *x, size_t n, float scale, di_rng *rng)
{
    uint64_t bits = 0;
    for (size_t i = 0; i < n; i++) {
        if (i % 4 == 0)
            bits = di_rng_u64(rng);
        uint32_t r = (uint32_t)(bits >> (16 * (i % 4))) & 0xffffu;
        /* sign, exponent 120..127, 7 mantissa bits: magnitudes in [2^-7, 2) */
        uint32_t u = ((r & 0x8000u) << 16) | ((120u + ((r >> 7) & 7u)) << 23) | ((r & 0x7fu) << 16);
        float f;
        memcpy(&f, &u, 4);
        x[i] = di_f32_to_bf16(f * scale);
    }
}

void chk_fill_u16(uint16_t *x, size_t n, uint16_t v)
{
    for (size_t i = 0; i < n; i++)
        x[i] = v;
}

/* ---- comparisons ---- */

static int bf16_isnan(uint16_t h)
{
    return (h & 0x7fffu) > 0x7f80u;
}

/* Position on a line where consecutive bf16 values are one apart (+0 and -0 coincide). */
static int32_t bf16_order(uint16_t h)
{
    int32_t mag = h & 0x7fff;
    return (h & 0x8000) ? -mag : mag;
}

static void show(const char *what, size_t i, uint16_t c, uint16_t g)
{
    fprintf(stderr, "MISMATCH %s at [%zu]: cpu 0x%04x (%g) gpu 0x%04x (%g)\n", what, i, c,
            (double)di_bf16_to_f32(c), g, (double)di_bf16_to_f32(g));
}

size_t chk_cmp_bf16_exact(const char *what, const uint16_t *cpu, const uint16_t *gpu, size_t n)
{
    size_t bad = 0;
    for (size_t i = 0; i < n; i++) {
        if (cpu[i] == gpu[i] || (bf16_isnan(cpu[i]) && bf16_isnan(gpu[i])))
            continue;
        if (bad++ < SHOW_MISMATCHES)
            show(what, i, cpu[i], gpu[i]);
    }
    return bad;
}

size_t chk_cmp_bf16_ulp(const char *what, const uint16_t *cpu, const uint16_t *gpu,
                        const uint8_t *mask, size_t n, unsigned ulp)
{
    size_t bad = 0;
    for (size_t i = 0; i < n; i++) {
        uint16_t c = cpu[i], g = gpu[i];
        int ok;
        if (bf16_isnan(c) || bf16_isnan(g))
            ok = bf16_isnan(c) && bf16_isnan(g);
        else if (mask && !mask[i])
            ok = c == g;
        else
            ok = abs(bf16_order(c) - bf16_order(g)) <= (int)ulp;
        if (!ok && bad++ < SHOW_MISMATCHES)
            show(what, i, c, g);
    }
    return bad;
}

size_t chk_cmp_f32_abs(const char *what, const float *cpu, const float *gpu, size_t n, double tol,
                       double *worst)
{
    size_t bad = 0;
    for (size_t i = 0; i < n; i++) {
        double c = cpu[i], g = gpu[i];
        int ok;
        if (isnan(c) || isnan(g))
            ok = isnan(c) && isnan(g);
        else if (isinf(c) || isinf(g))
            ok = c == g;
        else {
            ok = fabs(g - c) <= tol;
            if (worst && fabs(g - c) > *worst)
                *worst = fabs(g - c);
        }
        if (!ok && bad++ < SHOW_MISMATCHES)
            fprintf(stderr, "MISMATCH %s at [%zu]: cpu %.9g gpu %.9g (|diff| %.3g, tolerance %.3g)\n",
                    what, i, c, g, fabs(g - c), tol);
    }
    return bad;
}

size_t chk_cmp_bytes(const char *what, const void *cpu, const void *gpu, size_t n)
{
    const uint8_t *c = cpu, *g = gpu;
    size_t bad = 0;
    for (size_t i = 0; i < n; i++)
        if (c[i] != g[i] && bad++ < SHOW_MISMATCHES)
            fprintf(stderr, "MISMATCH %s at byte [%zu]: cpu 0x%02x gpu 0x%02x\n", what, i, c[i], g[i]);
    return bad;
}

/* n integers of `size` bytes (4 or 8), signed */
static size_t cmp_ints(const char *what, const void *cpu, const void *gpu, size_t n, size_t size)
{
    size_t bad = 0;
    for (size_t i = 0; i < n; i++) {
        int64_t c, g;
        if (size == 4) {
            c = ((const int32_t *)cpu)[i];
            g = ((const int32_t *)gpu)[i];
        } else {
            c = ((const int64_t *)cpu)[i];
            g = ((const int64_t *)gpu)[i];
        }
        if (c != g && bad++ < SHOW_MISMATCHES)
            fprintf(stderr, "MISMATCH %s at [%zu]: cpu %" PRId64 " gpu %" PRId64 "\n", what, i, c, g);
    }
    return bad;
}

size_t chk_cmp_i32(const char *what, const int32_t *cpu, const int32_t *gpu, size_t n)
{
    return cmp_ints(what, cpu, gpu, n, 4);
}

size_t chk_cmp_i64(const char *what, const int64_t *cpu, const int64_t *gpu, size_t n)
{
    return cmp_ints(what, cpu, gpu, n, 8);
}

int chk_finish(chk_env *env, const char *name, int want_bench, void (*bench)(chk_env *env))
{
    printf("%s: %d CUDA-vs-C cases, %d with mismatches\n", name, env->checks, env->failures);
    int rc = env->failures ? 1 : 0;
    if (want_bench && bench) {
        if (rc)
            printf("\nTIMINGS OF OPS THAT FAILED THEIR CHECKS: read them as the cost only\n");
        bench(env);
    }
    chk_fini(env);
    return rc;
}

size_t chk_gpu_status(chk_env *env, di_status st, const char *what)
{
    if (st == DI_OK)
        return 0;
    fprintf(stderr, "FAIL %s: CUDA op returned %s: %s\n", what, di_status_name(st),
            kern_cuda_last_error(&env->gpu));
    return 1;
}

void chk_cpu_status(di_status st, const char *what)
{
    if (st != DI_OK) {
        fprintf(stderr, "%s: CPU op returned %s\n", what, di_status_name(st));
        exit(2);
    }
}

size_t chk_expect(chk_env *env, di_status got, di_status want, const char *what)
{
    if (got == want)
        return 0;
    fprintf(stderr, "FAIL %s: returned %s, expected %s (%s)\n", what, di_status_name(got),
            di_status_name(want), kern_cuda_last_error(&env->gpu));
    return 1;
}

void chk_fill_f32(float *x, size_t n, double scale, di_rng *rng)
{
    for (size_t i = 0; i < n; i++)
        x[i] = (float)(di_rng_normal(rng) * scale);
}

void chk_poison(void *x, size_t n)
{
    memset(x, 0x5a, n);
}

void *chk_dev_copy(chk_env *env, const void *host, size_t bytes)
{
    void *d = chk_dev_alloc(env, bytes);
    chk_put(env, d, host, bytes);
    return d;
}

void chk_count(chk_env *env, size_t mismatches)
{
    env->checks++;
    if (mismatches)
        env->failures++;
}

/* ---- timing ---- */

double chk_time_ms(chk_env *env, chk_timed_fn fn, void *arg, int warmup, int reps)
{
    return chk_time_ms_on(env, &env->gpu, fn, arg, warmup, reps);
}

double chk_time_ms_on(chk_env *env, kern_backend *be, chk_timed_fn fn, void *arg, int warmup,
                      int reps)
{
    cudaStream_t s = (cudaStream_t)kern_cuda_stream(be);
    cudaEvent_t t0, t1;
    GPU_OK(cudaEventCreate(&t0));
    GPU_OK(cudaEventCreate(&t1));
    float *ms = chk_malloc((size_t)reps * sizeof(float));
    di_status st = DI_OK;
    for (int i = 0; i < warmup && st == DI_OK; i++)
        st = fn(arg, i);
    for (int i = 0; i < reps && st == DI_OK; i++) {
        GPU_OK(cudaEventRecord(t0, s));
        st = fn(arg, warmup + i);
        GPU_OK(cudaEventRecord(t1, s));
        GPU_OK(cudaEventSynchronize(t1));
        GPU_OK(cudaEventElapsedTime(&ms[i], t0, t1));
    }
    chk_sync(env);
    GPU_OK(cudaStreamSynchronize(s));
    double med = -1.0;
    if (st != DI_OK)
        fprintf(stderr, "benchmark call failed (%s): %s\n", di_status_name(st),
                kern_cuda_last_error(be));
    else
        med = gpu_median(ms, reps);
    free(ms);
    GPU_OK(cudaEventDestroy(t0));
    GPU_OK(cudaEventDestroy(t1));
    return med;
}

/* ---- KV pools ---- */

size_t chk_kv_block_bytes(const chk_kv *kv)
{
    return kv->pool_h.block_bytes;
}

/* A valid compressed entry: (C) main entry or (B) index key of N(0,1) numbers. */
static void make_entry(uint8_t *dst, uint32_t n, int index, di_rng *rng)
{
    float x[4096];
    for (uint32_t i = 0; i < n; i++)
        x[i] = (float)di_rng_normal(rng);
    if (index)
        di_quant_fp4_b32(x, n, dst, dst + n / 2);
    else
        di_quant_fp4_b16(x, n, dst, dst + n / 2);
}

void chk_kv_make(chk_env *env, chk_kv *kv, const chk_kv_shape *shape, uint32_t n_seqs,
                 const chk_seq_shape *seqs, size_t slot_bytes, di_rng *rng)
{
    memset(kv, 0, sizeof(*kv));
    uint32_t epb = shape->entries_per_block, total = 0;
    size_t mb = shape->dim / 2 + shape->dim / 16, ib = shape->index_dim / 2 + shape->index_dim / 32;
    kern_kv_pool pool = {.entries_per_block = epb, .main_entry_bytes = mb,
                         .index_entry_bytes = ib};
    pool.main_offset = 128 + shape->skew;
    pool.index_offset = pool.main_offset + (size_t)epb * mb + shape->skew;
    pool.block_bytes = pool.index_offset + (size_t)epb * ib + 5;
    for (uint32_t s = 0; s < n_seqs; s++)
        total += (seqs[s].n_entries + epb - 1) / epb;
    kv->n_blocks = total + total / 2 + 2; /* spare blocks no sequence owns */
    kv->tables = chk_malloc((size_t)(total ? total : 1) * 4);
    uint32_t *perm = chk_malloc((size_t)kv->n_blocks * 4);
    for (uint32_t i = 0; i < kv->n_blocks; i++)
        perm[i] = i;
    for (uint32_t i = kv->n_blocks - 1; i > 0; i--) {
        uint32_t j = (uint32_t)di_rng_below(rng, i + 1), t = perm[i];
        perm[i] = perm[j];
        perm[j] = t;
    }
    memcpy(kv->tables, perm, (size_t)total * 4);
    free(perm);
    size_t bb = pool.block_bytes * kv->n_blocks;
    kv->blocks_h = chk_malloc(bb);
    for (size_t i = 0; i + 8 <= bb; i += 8) {
        uint64_t r = di_rng_u64(rng);
        memcpy(kv->blocks_h + i, &r, 8);
    }
    for (size_t i = bb & ~(size_t)7; i < bb; i++)
        kv->blocks_h[i] = (uint8_t)di_rng_u32(rng);
    for (uint32_t b = 0; !shape->raw && b < kv->n_blocks; b++)
        for (uint32_t e = 0; e < epb; e++) {
            uint8_t *blk = kv->blocks_h + (size_t)b * pool.block_bytes;
            make_entry(blk + pool.main_offset + e * mb, shape->dim, 0, rng);
            if (shape->index_dim)
                make_entry(blk + pool.index_offset + e * ib, shape->index_dim, 1, rng);
        }
    kv->slot_bytes = slot_bytes;
    kv->slots_h = chk_malloc(slot_bytes * n_seqs + 1);
    for (size_t i = 0; i < slot_bytes * n_seqs; i++)
        kv->slots_h[i] = (uint8_t)di_rng_u32(rng);
    kv->blocks_d = chk_dev_copy(env, kv->blocks_h, bb);
    kv->slots_d = chk_dev_copy(env, kv->slots_h, slot_bytes * n_seqs + 1);
    kv->pool_h = pool;
    kv->pool_h.blocks = kv->blocks_h;
    kv->pool_d = pool;
    kv->pool_d.blocks = kv->blocks_d;
    kv->n_seqs = n_seqs;
    kv->seqs_h = chk_malloc((size_t)(n_seqs ? n_seqs : 1) * sizeof(kern_seq));
    kv->seqs_d = chk_malloc((size_t)(n_seqs ? n_seqs : 1) * sizeof(kern_seq));
    uint32_t row = 0, t0 = 0;
    for (uint32_t s = 0; s < n_seqs; s++) {
        kern_seq q = {.row0 = row, .n_rows = seqs[s].n_rows, .pos0 = seqs[s].pos0,
                      .blocks = kv->tables + t0, .n_blocks = (seqs[s].n_entries + epb - 1) / epb,
                      .ring_hi = -1};
        t0 += q.n_blocks;
        row += q.n_rows;
        kv->seqs_h[s] = q;
        kv->seqs_d[s] = q;
        if (seqs[s].has_slot) {
            kv->seqs_h[s].slot = kv->slots_h + s * slot_bytes;
            kv->seqs_d[s].slot = kv->slots_d + s * slot_bytes;
        }
    }
}

void chk_kv_fill_rings(chk_env *env, chk_kv *kv, size_t ring_offset, uint32_t ring_positions,
                       uint32_t dim, float scale, di_rng *rng)
{
    size_t eb = (size_t)dim + dim / 32;
    float x[4096];
    for (uint32_t s = 0; s < kv->n_seqs; s++)
        for (uint32_t r = 0; r < ring_positions; r++) {
            for (uint32_t i = 0; i < dim; i++)
                x[i] = (float)di_rng_normal(rng) * scale;
            uint8_t *e = kv->slots_h + s * kv->slot_bytes + ring_offset + r * eb;
            di_quant_fp8_b32(x, dim, e, e + dim);
        }
    chk_put(env, kv->slots_d, kv->slots_h, kv->slot_bytes * kv->n_seqs + 1);
}

void chk_kv_get(chk_env *env, const chk_kv *kv, uint8_t *blocks, uint8_t *slots)
{
    if (blocks)
        chk_get(env, blocks, kv->blocks_d, kv->pool_h.block_bytes * kv->n_blocks);
    if (slots)
        chk_get(env, slots, kv->slots_d, kv->slot_bytes * kv->n_seqs + 1);
}

void chk_kv_free(chk_env *env, chk_kv *kv)
{
    chk_dev_free(env, kv->blocks_d);
    chk_dev_free(env, kv->slots_d);
    free(kv->blocks_h), free(kv->slots_h), free(kv->seqs_h), free(kv->seqs_d), free(kv->tables);
    memset(kv, 0, sizeof(*kv));
}

/* ---- the matrix-rate ceiling ---- */

static di_status ceiling_call(void *arg, int i)
{
    chk_env *env = ((void **)arg)[0];
    const kern_linear *p = ((void **)arg)[1];
    return env->gpu.ops.linear_bf16(env->gpu.ctx, p);
}

double chk_gemm_ceiling(chk_env *env)
{
    const uint32_t N = 8192;
    size_t bytes = (size_t)N * N * 2;
    di_rng rng;
    chk_case_rng(env, &rng);
    uint16_t *h = chk_malloc(bytes);
    chk_fill_bf16_fast(h, (size_t)N * N, 1.0f, &rng);
    void *x = chk_dev_copy(env, h, bytes);
    chk_fill_bf16_fast(h, (size_t)N * N, 0.05f, &rng);
    void *w = chk_dev_copy(env, h, bytes), *y = chk_dev_alloc(env, bytes);
    free(h);
    kern_linear p = {N, N, N, 1, x, N, w, NULL, 0, 0, y, N};
    void *arg[2] = {env, &p};
    double ms = chk_time_ms(env, ceiling_call, arg, 3, 20);
    chk_dev_free(env, x);
    chk_dev_free(env, w);
    chk_dev_free(env, y);
    if (ms <= 0) {
        fprintf(stderr, "the 8192^3 BF16 GEMM ceiling failed\n");
        exit(2);
    }
    return 2.0 * N * N * (double)N / (ms * 1e-3) / 1e12;
}
