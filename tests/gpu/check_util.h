/* check_util.h: what the CUDA-vs-C op checks share (check_basic.c, check_linear.c): the two
 * backends, device buffers through the CUDA backend's table, input fills, comparisons with an
 * op's tolerance, event timing. Setup failures exit 2; comparisons count mismatches and print
 * the first few. */
#ifndef DI_TESTS_GPU_CHECK_UTIL_H
#define DI_TESTS_GPU_CHECK_UTIL_H

#include <stddef.h>
#include <stdint.h>

#include "common/util/philox.h"
#include "kernels/kernels.h"

/* Poison written into outputs before a run: a finite bf16 (about 1.5e16) that no check input
 * produces, so an element the op failed to write shows up as a mismatch. */
#define CHK_POISON_BF16 ((uint16_t)0x5a5a)
#define CHK_POISON_F32_BITS 0x5a5a5a5au

/* What a check program carries between cases. */
typedef struct chk_env {
    kern_backend cpu;           /* the C twins */
    kern_backend gpu;           /* the CUDA backend */
    uint64_t seed;              /* base seed: case i draws from seed + i */
    uint64_t cases;             /* cases drawn so far */
    int failures;               /* cases with a mismatch */
    int checks;                 /* cases compared */
} chk_env;

/* Parses --seed N, --bench and --help; creates both backends (exit 2 on failure). Returns 1
 * when --bench was given. */
int chk_init(chk_env *env, int argc, char **argv, const char *usage);
void chk_fini(chk_env *env);
/* A fresh generator for the next case; its seed is returned for the failure message. */
uint64_t chk_case_rng(chk_env *env, di_rng *rng);

/* Device memory through the CUDA backend's alloc (exit 2 on failure), copies both ways with
 * the backend's to_host/from_host followed by kern_cuda_sync. */
void *chk_dev_alloc(chk_env *env, size_t bytes);
void chk_dev_free(chk_env *env, void *p);
void chk_put(chk_env *env, void *dev, const void *host, size_t bytes);
void chk_get(chk_env *env, void *host, const void *dev, size_t bytes);
/* Waits for the CUDA backend; exit 2 with its message on failure. */
void chk_sync(chk_env *env);
/* Host allocation (exit 2 on failure). */
void *chk_malloc(size_t bytes);

/* ---- inputs ---- */

/* Input modes: adversarial first (zeros, ones, arange), then random. */
enum {
    CHK_ZEROS = 0,
    CHK_ONES,
    CHK_ARANGE,     /* (i % 64 - 32) / 8: small integers and halves */
    CHK_NORMAL,     /* N(0, 1) */
    CHK_TINY,       /* N(0, 1) * 1e-6: below the (A) floor of 1e-4 */
    CHK_LARGE,      /* N(0, 1) * 3e3: block maxima past 448 */
    CHK_EDGES,      /* block maxima on and next to 448 * 2^e, E4M3 and E2M1 rounding ties,
                     * E4M3 subnormals, signed zeros */
    CHK_SPECIALS,   /* N(0, 1) with NaN and +-Inf sprinkled in */
    CHK_MODES
};
extern const char *const chk_mode_name[CHK_MODES];

/* n bf16 values of a mode. */
void chk_fill_bf16(uint16_t *x, size_t n, int mode, di_rng *rng);
/* n bf16 values, uniform magnitudes in [2^-7, 2) * scale with random signs: a fast fill for
 * large weights. */
void chk_fill_bf16_fast(uint16_t *x, size_t n, float scale, di_rng *rng);
void chk_fill_u16(uint16_t *x, size_t n, uint16_t v);

/* ---- comparisons: each returns the number of mismatches and prints the first few with
 * `what` (the case's parameters) ---- */

/* bf16 arrays bit for bit; two NaNs compare equal (their payloads may differ). */
size_t chk_cmp_bf16_exact(const char *what, const uint16_t *cpu, const uint16_t *gpu, size_t n);
/* bf16 arrays within `ulp` units in the last place (0: exact) where mask[i] is 1, exact where
 * it is 0 (mask NULL: ulp everywhere). NaN only matches NaN. */
size_t chk_cmp_bf16_ulp(const char *what, const uint16_t *cpu, const uint16_t *gpu,
                        const uint8_t *mask, size_t n, unsigned ulp);

/* f32 arrays within an absolute tolerance; NaN only matches NaN, infinities match themselves.
 * worst (may be NULL) keeps the largest finite |gpu - cpu| seen. */
size_t chk_cmp_f32_abs(const char *what, const float *cpu, const float *gpu, size_t n, double tol,
                       double *worst);
/* Byte arrays, int32 and int64 arrays: exact. */
size_t chk_cmp_bytes(const char *what, const void *cpu, const void *gpu, size_t n);
size_t chk_cmp_i32(const char *what, const int32_t *cpu, const int32_t *gpu, size_t n);
size_t chk_cmp_i64(const char *what, const int64_t *cpu, const int64_t *gpu, size_t n);

/* Records the outcome of one case. */
void chk_count(chk_env *env, size_t mismatches);

/* The end of a check program's main: prints "NAME: N CUDA-vs-C cases, M with mismatches", runs
 * bench(env) when --bench was given (after a banner if a case failed: timings are still worth
 * having), releases the backends and returns the exit code (0 or 1). */
int chk_finish(chk_env *env, const char *name, int want_bench, void (*bench)(chk_env *env));

/* A status of a CUDA op: 0 for DI_OK, else 1 with the op's message printed (a mismatch). */
size_t chk_gpu_status(chk_env *env, di_status st, const char *what);
/* A status of a C twin: exit 2 unless DI_OK (a broken reference is a setup error). */
void chk_cpu_status(di_status st, const char *what);
/* 0 when got == want, else 1 with both printed (refused-input checks). */
size_t chk_expect(chk_env *env, di_status got, di_status want, const char *what);

/* n floats N(0, 1) * scale. */
void chk_fill_f32(float *x, size_t n, double scale, di_rng *rng);
/* n bytes of the poison pattern 0x5a. */
void chk_poison(void *x, size_t n);
/* A device copy of host bytes (chk_dev_alloc + chk_put). */
void *chk_dev_copy(chk_env *env, const void *host, size_t bytes);

/* ---- KV pools and sequences ---- */

/* A paged block pool and state slots, the same bytes in host memory (for the C twins) and in
 * device memory (for the CUDA ops), and sequences addressing them. Block tables are host
 * memory for both (kernels.h). */
typedef struct chk_kv {
    kern_kv_pool pool_h;        /* geometry with blocks = blocks_h */
    kern_kv_pool pool_d;        /* the same with blocks = blocks_d */
    uint8_t *blocks_h, *blocks_d;
    uint32_t n_blocks;
    uint8_t *slots_h, *slots_d;
    size_t slot_bytes;
    uint32_t n_seqs;
    kern_seq *seqs_h, *seqs_d;  /* identical but for the slot pointers */
    uint32_t *tables;           /* every sequence's block table, one after another */
} chk_kv;

/* Geometry of a pool: entries per block, widths (numbers) and entry sizes follow the rules of
 * kv_layout.h; `skew` bytes shift both regions off alignment. */
typedef struct chk_kv_shape {
    uint32_t entries_per_block;
    uint32_t dim;               /* main entry width: dim/2 + dim/16 bytes */
    uint32_t index_dim;         /* index key width: index_dim/2 + index_dim/32 bytes */
    uint32_t skew;
    int raw;                    /* 1: random bytes only, no valid entries (benchmarks) */
} chk_kv_shape;

/* One sequence of a chk_kv. */
typedef struct chk_seq_shape {
    uint32_t n_rows;
    int64_t pos0;
    uint32_t n_entries;         /* compressed entries its block table must reach */
    int has_slot;
} chk_seq_shape;

/* Builds a pool with every sequence's blocks distinct (a random permutation, with spare
 * blocks between them), rows consecutive from row 0, and slot_bytes per sequence. Blocks get
 * valid compressed entries (procedures (C) and (B) of N(0,1) numbers) and random bytes
 * elsewhere; slots random bytes (chk_kv_fill_rings makes valid ring entries). */
void chk_kv_make(chk_env *env, chk_kv *kv, const chk_kv_shape *shape, uint32_t n_seqs,
                 const chk_seq_shape *seqs, size_t slot_bytes, di_rng *rng);
/* Valid (A) ring entries of `dim` numbers in every slot: ring_positions entries at
 * ring_offset, N(0,1) numbers times scale. Copied to the device. */
void chk_kv_fill_rings(chk_env *env, chk_kv *kv, size_t ring_offset, uint32_t ring_positions,
                       uint32_t dim, float scale, di_rng *rng);
/* The device copies back into the given host buffers (blocks, slots). */
void chk_kv_get(chk_env *env, const chk_kv *kv, uint8_t *blocks, uint8_t *slots);
void chk_kv_free(chk_env *env, chk_kv *kv);
size_t chk_kv_block_bytes(const chk_kv *kv);

/* ---- timing ---- */

/* Median time in milliseconds of reps calls of fn(arg, i) on the CUDA backend's stream, each
 * timed by its own pair of events, after `warmup` untimed calls. When a call fails (fn returns
 * its di_status) the message is printed and the result is -1. */
typedef di_status (*chk_timed_fn)(void *arg, int i);
double chk_time_ms(chk_env *env, chk_timed_fn fn, void *arg, int warmup, int reps);
/* The same on another CUDA backend's stream (its own ops timed). */
double chk_time_ms_on(chk_env *env, kern_backend *be, chk_timed_fn fn, void *arg, int warmup,
                      int reps);

/* The matrix-rate ceiling of the run: an 8192^3 BF16 GEMM (bf16 out, the backend's linear_bf16
 * on cuBLASLt) on random data, TFLOP/s (median of 20 after 3 warm-ups). Exit 2 on failure. */
double chk_gemm_ceiling(chk_env *env);

#endif
