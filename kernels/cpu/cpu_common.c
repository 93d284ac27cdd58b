/* Shared helpers of the CPU ops and the backend's construction. */
#include <stdlib.h>
#include <unistd.h>

#include "kernels/cpu/backend.h"
#include "kernels/cpu/cpu_internal.h"
#include "kernels/cpu/simd.h"

void *cpu_xmalloc(size_t bytes)
{
    void *p = NULL;
    if (posix_memalign(&p, 64, bytes ? bytes : 64) != 0)
        return NULL;
    return p;
}

/* Products of two floats are exact in double, so these sums carry no fp32 rounding: the caller
 * rounds the result once, as the reference's "computed in double, rounded once" rule wants.
 * Lane j of 8 accumulates the elements i with i % 8 == j in order; the tail goes to its lane;
 * the lanes fold in a fixed order. */
static inline __attribute__((always_inline)) double fold_tail_d(v8d acc, const float *a,
                                                                const float *b, size_t n8,
                                                                size_t n)
{
    if (n8 == n)
        return v8d_fold(acc);
    double l[8];
    memcpy(l, &acc, sizeof(l));
    for (size_t i = n8; i < n; i++)
        l[i % 8] += (double)a[i] * (double)b[i];
    v8d v;
    memcpy(&v, l, sizeof(v));
    return v8d_fold(v);
}

CPU_SIMD double cpu_dot(const float *a, const float *b, size_t n)
{
    v8d acc = v8d_zero();
    size_t n8 = n & ~(size_t)7;
    for (size_t i = 0; i < n8; i += 8)
        acc += v8d_lo(a + i) * v8d_lo(b + i);
    return fold_tail_d(acc, a, b, n8, n);
}

CPU_SIMD void cpu_dot4(const float *a, const float *b0, const float *b1, const float *b2,
                       const float *b3, size_t n, double out[4])
{
    v8d c0 = v8d_zero(), c1 = v8d_zero(), c2 = v8d_zero(), c3 = v8d_zero();
    size_t n8 = n & ~(size_t)7;
    for (size_t i = 0; i < n8; i += 8) {
        v8d x = v8d_lo(a + i);
        c0 += x * v8d_lo(b0 + i);
        c1 += x * v8d_lo(b1 + i);
        c2 += x * v8d_lo(b2 + i);
        c3 += x * v8d_lo(b3 + i);
    }
    out[0] = fold_tail_d(c0, a, b0, n8, n);
    out[1] = fold_tail_d(c1, a, b1, n8, n);
    out[2] = fold_tail_d(c2, a, b2, n8, n);
    out[3] = fold_tail_d(c3, a, b3, n8, n);
}

#if defined(__GNUC__) && !defined(__clang__)
#define CONTRACT __attribute__((optimize("fp-contract=fast")))
#else
#define CONTRACT
#endif

static inline __attribute__((always_inline)) v8d ld8(const double *p)
{
    v8d v;
    memcpy(&v, p, sizeof(v));
    return v;
}

CPU_SIMD void cpu_widen(const float *x, double *out, size_t n)
{
    for (size_t i = 0; i < n; i++)
        out[i] = x[i];
}

/* The double-operand kernels: operands are widened floats, so every product is exact and a
 * fused multiply-add (CONTRACT) sums exactly what a multiply then an add would. */
CPU_SIMD CONTRACT double cpu_dotd(const double *a, const double *b, size_t n)
{
    v8d acc = v8d_zero();
    size_t n8 = n & ~(size_t)7;
    for (size_t i = 0; i < n8; i += 8)
        acc += ld8(a + i) * ld8(b + i);
    double l[8];
    memcpy(l, &acc, sizeof(l));
    for (size_t i = n8; i < n; i++)
        l[i % 8] += a[i] * b[i];
    memcpy(&acc, l, sizeof(acc));
    return v8d_fold(acc);
}

CPU_SIMD CONTRACT void cpu_dotd_2x4(const double *x0, const double *x1, const double *w,
                                    size_t k, double out[2][4])
{
    assert(k % 8 == 0);
    v8d a0 = v8d_zero(), a1 = v8d_zero(), a2 = v8d_zero(), a3 = v8d_zero();
    v8d b0 = v8d_zero(), b1 = v8d_zero(), b2 = v8d_zero(), b3 = v8d_zero();
    const double *w0 = w, *w1 = w + k, *w2 = w + 2 * k, *w3 = w + 3 * k;
    if (x1) {
        for (size_t i = 0; i < k; i += 8) {
            v8d u = ld8(x0 + i), v = ld8(x1 + i);
            v8d c0 = ld8(w0 + i), c1 = ld8(w1 + i), c2 = ld8(w2 + i), c3 = ld8(w3 + i);
            a0 += u * c0, a1 += u * c1, a2 += u * c2, a3 += u * c3;
            b0 += v * c0, b1 += v * c1, b2 += v * c2, b3 += v * c3;
        }
    } else {
        for (size_t i = 0; i < k; i += 8) {
            v8d u = ld8(x0 + i);
            a0 += u * ld8(w0 + i), a1 += u * ld8(w1 + i);
            a2 += u * ld8(w2 + i), a3 += u * ld8(w3 + i);
        }
    }
    out[0][0] = v8d_fold(a0), out[0][1] = v8d_fold(a1);
    out[0][2] = v8d_fold(a2), out[0][3] = v8d_fold(a3);
    out[1][0] = v8d_fold(b0), out[1][1] = v8d_fold(b1);
    out[1][2] = v8d_fold(b2), out[1][3] = v8d_fold(b3);
}

CPU_SIMD CONTRACT void cpu_axpyd(double *o, const double *x, double a, size_t n)
{
    size_t i = 0;
    v8d av = v8d_zero() + a;
    for (; i + 8 <= n; i += 8) {
        v8d acc = ld8(o + i) + av * ld8(x + i);
        memcpy(o + i, &acc, sizeof(acc));
    }
    for (; i < n; i++)
        o[i] += a * x[i];
}

double cpu_sumsq(const float *a, size_t n)
{
    return cpu_dot(a, a, n);
}

/* 1 / sqrt(mean + eps) of a sum of squares, with the reference's roundings: the mean rounded
 * to fp32, eps added in fp32, the reciprocal square root in double rounded to fp32. */
float cpu_rms_scale(double sumsq, uint32_t n, float eps)
{
    float ms = (float)(sumsq / (double)n);
    return (float)(1.0 / sqrt((double)(ms + eps)));
}

void cpu_bf16_to_f32(const uint16_t *x, float *out, size_t n)
{
    for (size_t i = 0; i < n; i++)
        out[i] = bf(x[i]);
}

float cpu_e4m3_round(float v)
{
    float a = fabsf(v);
    if (a < 0.015625f) /* subnormal range: multiples of 2^-9, ties to even */
        return rintf(v * 512.0f) * (1.0f / 512.0f);
    uint32_t u;
    memcpy(&u, &v, 4);
    u += 0x7ffffu + ((u >> 20) & 1u); /* round the mantissa to 3 bits, ties to even */
    u &= 0xfff00000u;
    float r;
    memcpy(&r, &u, 4);
    return r;
}

/* The (A) scale exponent of a block, exactly as numfmt computes it. */
static uint8_t fp8_block_scale(const float *x)
{
    float a = 0.0f;
    for (int i = 0; i < 32; i++) {
        float v = fabsf(x[i]);
        if (v > a)
            a = v;
    }
    if (a < 1e-4f)
        a = 1e-4f;
    return di_ue8m0_ceil(a * (1.0f / 448.0f));
}

static inline float clamp448(float v)
{
    return v < -448.0f ? -448.0f : (v > 448.0f ? 448.0f : v);
}

void cpu_act_quant_fp8(const cpu_ctx *c, const uint16_t *x, float *out, size_t n)
{
    assert(n % 32 == 0);
    cpu_bf16_to_f32(x, out, n);
    for (size_t b = 0; b < n; b += 32) {
        uint8_t se = fp8_block_scale(out + b);
        float s = c->ue8m0[se], inv = 1.0f / s; /* powers of two: exact */
        for (int i = 0; i < 32; i++)
            out[b + i] = cpu_e4m3_round(clamp448(out[b + i] * inv)) * s;
    }
}

void cpu_quant_fp8(const float *x, size_t n, uint8_t *codes, uint8_t *scales)
{
    for (size_t b = 0; b < n; b += 32) {
        uint8_t se = fp8_block_scale(x + b);
        float inv = 1.0f / di_ue8m0_decode(se);
        for (int i = 0; i < 32; i++)
            codes[b + i] = di_e4m3_encode(clamp448(x[b + i] * inv));
        scales[b / 32] = se;
    }
}

/* 16 E4M3 codes as floats: the 7 low bits shifted into an fp32's exponent and mantissa give
 * value * 2^-120 (subnormal codes land on fp32 subnormals), so one exact multiply by 2^120
 * restores every code, subnormals included. */
static inline __attribute__((always_inline)) v16f e4m3x16(const uint8_t *q)
{
    v16b b;
    memcpy(&b, q, sizeof(b));
    v16u u = __builtin_convertvector(b, v16u);
    v16u bits = ((u & 0x80u) << 24) | ((u & 0x7fu) << 20);
    return (v16f)bits * 0x1p120f;
}

/* 32 E2M1 values of 16 packed bytes (element 2i in the low nibble). */
static inline __attribute__((always_inline)) void e2m1x32(const cpu_ctx *c, const uint8_t *q,
                                                         v16f *a, v16f *b)
{
    v16b by;
    memcpy(&by, q, sizeof(by));
    v16i w = __builtin_convertvector(by, v16i);
    v16f lut = v16_load(c->e2m1);
    v16f lo = __builtin_shuffle(lut, w & 15), hi = __builtin_shuffle(lut, (w >> 4) & 15);
    const v16i m0 = {0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23};
    const v16i m1 = {8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
    *a = __builtin_shuffle(lo, hi, m0);
    *b = __builtin_shuffle(lo, hi, m1);
}

static inline __attribute__((always_inline)) v16f bf16x16(const uint16_t *h)
{
    v16h x;
    memcpy(&x, h, sizeof(x));
    return (v16f)(__builtin_convertvector(x, v16u) << 16);
}

CPU_SIMD void cpu_dequant_rows(const cpu_ctx *c, kern_wfmt fmt, const void *w,
                               const uint8_t *scale, uint32_t k, uint32_t r0, uint32_t nr,
                               float *out)
{
    uint32_t kb = k / 32;
    for (uint32_t r = 0; r < nr; r++) {
        uint32_t row = r0 + r;
        float *o = out + (size_t)r * k;
        if (fmt == KERN_W_FP8) {
            const uint8_t *q = (const uint8_t *)w + (size_t)row * k;
            const uint8_t *s = scale + (size_t)(row / 32) * kb;
            for (uint32_t b = 0; b < kb; b++) {
                float sv = c->ue8m0[s[b]];
                v16_store(o + b * 32, e4m3x16(q + b * 32) * sv);
                v16_store(o + b * 32 + 16, e4m3x16(q + b * 32 + 16) * sv);
            }
        } else if (fmt == KERN_W_FP4) {
            const uint8_t *q = (const uint8_t *)w + (size_t)row * (k / 2);
            const uint8_t *s = scale + (size_t)row * kb;
            for (uint32_t b = 0; b < kb; b++) {
                float sv = c->ue8m0[s[b]];
                v16f lo, hi;
                e2m1x32(c, q + b * 16, &lo, &hi);
                v16_store(o + b * 32, lo * sv);
                v16_store(o + b * 32 + 16, hi * sv);
            }
        } else {
            const uint16_t *h = (const uint16_t *)w + (size_t)row * k;
            for (uint32_t i = 0; i < k; i += 16)
                v16_store(o + i, bf16x16(h + i));
        }
    }
}

CPU_SIMD void cpu_decode_ring_entry(const cpu_ctx *c, const uint8_t *e, uint32_t dim, float *out)
{
    const uint8_t *sc = e + dim;
    for (uint32_t i = 0; i < dim; i += 32) {
        float sv = c->ue8m0[sc[i / 32]];
        v16_store(out + i, e4m3x16(e + i) * sv);
        v16_store(out + i + 16, e4m3x16(e + i + 16) * sv);
    }
}

/* Packed E2M1 values then one scale byte per `block` values, decoded through `lut`. */
static void decode_fp4_entry(const cpu_ctx *c, const uint8_t *e, uint32_t dim, uint32_t block,
                             const float *lut, float *out)
{
    const uint8_t *sc = e + dim / 2;
    for (uint32_t i = 0; i < dim; i += 2) {
        uint8_t byte = e[i / 2];
        float s = lut[sc[i / block]];
        out[i] = c->e2m1[byte & 0x0f] * s;
        out[i + 1] = c->e2m1[byte >> 4] * s;
    }
}

void cpu_decode_main_entry(const cpu_ctx *c, const uint8_t *e, uint32_t dim, float *out)
{
    decode_fp4_entry(c, e, dim, 16, c->e4m3, out);
}

void cpu_decode_index_entry(const cpu_ctx *c, const uint8_t *e, uint32_t dim, float *out)
{
    decode_fp4_entry(c, e, dim, 32, c->ue8m0, out);
}

/* ---- memory ---- */

static void *cpu_alloc(void *ctx, size_t bytes)
{
    void *p = cpu_xmalloc(bytes);
    if (p)
        memset(p, 0, bytes);
    return p;
}

static void cpu_free(void *ctx, void *p)
{
    free(p);
}

/* Mapped memory and marks: host memory, and every op has finished when it returns. */
static void *cpu_alloc_mapped(void *ctx, size_t bytes, void **host)
{
    (void)ctx;
    void *p = calloc(1, bytes ? bytes : 1);
    *host = p;
    return p;
}

static void cpu_free_mapped(void *ctx, void *p)
{
    (void)ctx;
    free(p);
}

static di_status cpu_mark(void *ctx, uint64_t *mark)
{
    (void)ctx;
    *mark = 0;
    return DI_OK;
}

static di_status cpu_wait_mark(void *ctx, uint64_t mark)
{
    (void)ctx, (void)mark;
    return DI_OK;
}

static void cpu_copy(void *ctx, void *dst, const void *src, size_t bytes)
{
    if (bytes)
        memcpy(dst, src, bytes);
}

di_status kern_cpu_create(uint32_t n_threads, kern_backend *out, di_error *err)
{
    if (!out)
        return di_fail(err, DI_EINVAL, "backend output is NULL");
    if (n_threads == 0) {
        long n = sysconf(_SC_NPROCESSORS_ONLN);
        n_threads = n > 0 ? (uint32_t)n : 1;
    }
    if (n_threads > 256)
        return di_fail(err, DI_EINVAL, "%u threads requested, at most 256", n_threads);
    cpu_ctx *c = calloc(1, sizeof(*c));
    if (!c)
        return di_fail(err, DI_ENOMEM, "CPU backend state");
    di_status st = kpool_create(n_threads, &c->pool, err);
    if (st != DI_OK) {
        free(c);
        return st;
    }
    for (int i = 0; i < 256; i++) {
        c->e4m3[i] = di_e4m3_decode((uint8_t)i);
        c->ue8m0[i] = di_ue8m0_decode((uint8_t)i);
    }
    for (int i = 0; i < 16; i++)
        c->e2m1[i] = di_e2m1_decode((uint8_t)i);
    kern_backend be = {.name = "cpu", .ctx = c};
    be.ops.alloc = cpu_alloc;
    be.ops.free = cpu_free;
    be.ops.to_host = cpu_copy;
    be.ops.from_host = cpu_copy;
    be.ops.alloc_mapped = cpu_alloc_mapped;
    be.ops.free_mapped = cpu_free_mapped;
    be.ops.mark = cpu_mark;
    be.ops.wait_mark = cpu_wait_mark;
    cpu_ops_basic(&be.ops);
    cpu_ops_linear(&be.ops);
    cpu_ops_cache(&be.ops);
    cpu_ops_attn(&be.ops);
    cpu_ops_index(&be.ops);
    cpu_ops_moe(&be.ops);
    cpu_ops_engram(&be.ops);
    *out = be;
    return DI_OK;
}

void kern_cpu_destroy(kern_backend *be)
{
    if (!be || !be->ctx)
        return;
    cpu_ctx *c = be->ctx;
    kpool_destroy(c->pool);
    free(c);
    memset(be, 0, sizeof(*be));
}

typedef struct range_job {
    cpu_range_fn fn;
    void *arg;
    uint32_t n, chunk;
} range_job;

static void range_task(void *varg, uint32_t task, uint32_t worker)
{
    range_job *j = varg;
    uint32_t r0 = task * j->chunk;
    uint32_t r1 = r0 + j->chunk < j->n ? r0 + j->chunk : j->n;
    j->fn(j->arg, r0, r1, worker);
}

void cpu_for(const cpu_ctx *c, uint32_t n, uint32_t min_chunk, cpu_range_fn fn, void *arg)
{
    if (n == 0)
        return;
    uint32_t workers = kpool_workers(c->pool);
    uint32_t chunk = (n + 4 * workers - 1) / (4 * workers);
    if (chunk < min_chunk)
        chunk = min_chunk;
    if (chunk == 0)
        chunk = 1;
    range_job j = {.fn = fn, .arg = arg, .n = n, .chunk = chunk};
    kpool_run(c->pool, (n + chunk - 1) / chunk, range_task, &j);
}
