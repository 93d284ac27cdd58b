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

/* Records the outcome of one case. */
void chk_count(chk_env *env, size_t mismatches);

/* ---- timing ---- */

/* Median time in milliseconds of reps calls of fn(arg, i) on the CUDA backend's stream, each
 * timed by its own pair of events, after `warmup` untimed calls. When a call fails (fn returns
 * its di_status) the message is printed and the result is -1. */
typedef di_status (*chk_timed_fn)(void *arg, int i);
double chk_time_ms(chk_env *env, chk_timed_fn fn, void *arg, int warmup, int reps);

#endif
