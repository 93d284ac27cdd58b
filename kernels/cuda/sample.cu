/* sample.cu: the sampler on the device (kern_sample; reference: common/sampling, sampler.h).
 *
 * One block per row. Everything after the exponentials is integer arithmetic, and every
 * choice is a selection by a unique 64-bit key, so the result is the CPU sampler's whatever
 * order the threads add in:
 *   - a token's logit key (the sampler's ordered key of the fp32 bits, 0 = blocked) gives the
 *     force-top-k key ((~key) << 32 | id): ascending = logit descending, ties to the lower id;
 *   - a candidate's integer mass m = floor(exp(z) * 2^31) (z = (l - l_max) / T in double, as
 *     the sampler computes it) gives its draw-order key ((2^31 - m) << 32 | id): ascending =
 *     mass descending, ties to the lower id, the sampler's draw order.
 * A prefix of an order is then "keys <= X". Force top-k, top-k and the top logprobs are
 * count selections (the smallest X with n keys <= X), top-p and the draw are mass selections
 * (the smallest X whose keys <= X weigh at least a target), all by an MSB-first radix
 * selection over 8-bit digits: each pass histograms the keys that share the prefix chosen so
 * far (counts, and masses as 64-bit integers), one warp finds the bin where the target falls.
 * A pass stops early once the bin it picked holds exactly what is needed.
 *
 * Scratch: 12 bytes per candidate slot, rows x min(force top-k, vocabulary) slots (64 rows of
 * 4,096: 3 MB; with force top-k off, 64 rows of 129,280: 99 MB).
 *
 * Passes per row: one over the vocabulary (bad logits, allowed count, largest key), the
 * force-top-k selection over the vocabulary (usually 4-5 passes), one that writes the
 * candidates (key, mass) to a scratch list, then a few over that list (top-k, top-p, the draw,
 * the top logprobs). The draw's uniform is Philox-4x32-10 keyed by (seed, stream), the same
 * 53 bits as di_philox_uniform. Logprobs are log(m) - log(M) in double, rounded to fp32 (the
 * device log and glibc's may differ by an ulp in double; after the fp32 rounding they agree
 * but at a tie).
 */
#include <cuda_runtime.h>
#include <stdint.h>
#include <string.h>

#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/cuda_internal.h"

#define SMP_THREADS 1024
#define SMP_WARPS (SMP_THREADS / 32)
#define SMP_BINS 256
#define SMP_MASS_ONE 2147483648u
#define SMP_KEY_NEG_INF 0xFF800000u
#define SMP_NONE 0xFFFFFFFFFFFFFFFFull

/* A row as the kernel reads it (device copy of kern_sample_row). */
typedef struct smp_row {
    float temperature, top_p;
    int32_t top_k;
    uint32_t force_top_k, n_logprobs, pad;
    uint64_t seed, stream;
    int64_t allowed;            /* word offset of its bitmap in the call's bitmaps; -1: none */
} smp_row;

typedef struct smp_args {
    const float *logits;
    size_t stride;
    uint32_t n_vocab;
    uint32_t cap;               /* candidate slots per row */
    const smp_row *rows;
    const uint32_t *bitmaps;
    uint64_t *cand_key;         /* [rows, cap] */
    uint32_t *cand_mass;        /* [rows, cap] */
    kern_sample_out *out;       /* device [rows] */
} smp_args;

typedef struct smp_shared {
    uint32_t cnt[SMP_BINS];
    unsigned long long wsum[SMP_BINS];
    unsigned long long u64a, u64b;
    uint32_t u32a, u32b;
    uint32_t bin;
    uint32_t bin_cnt;
    unsigned long long before;
    int32_t top_tok[KERN_SAMPLE_MAX_TOP];
    uint64_t top_key[KERN_SAMPLE_MAX_TOP];
} smp_shared;

/* ---- the sampler's numbers ---- */

__device__ __forceinline__ uint32_t smp_logit_key(uint32_t b)
{
    uint32_t k = b ^ ((uint32_t)((int32_t)b >> 31) | 0x80000000u);
    k = (b & 0x7FFFFFFFu) == 0 ? 0x80000000u : k;
    return b == SMP_KEY_NEG_INF ? 0 : k;
}

__device__ __forceinline__ float smp_key_logit(uint32_t k)
{
    return __uint_as_float((k & 0x80000000u) ? k ^ 0x80000000u : ~k);
}

__device__ __forceinline__ bool smp_bad(uint32_t b)
{
    return (b & 0x7FFFFFFFu) > 0x7F800000u || b == 0x7F800000u;
}

/* Philox-4x32-10 (common/util/philox.c): counter (stream, 0, magic), key seed; the 53-bit
 * integer x behind di_philox_uniform's u = x * 2^-53. */
__device__ uint64_t smp_philox53(uint64_t seed, uint64_t stream)
{
    uint32_t c0 = (uint32_t)stream, c1 = (uint32_t)(stream >> 32), c2 = 0, c3 = 0x5a4d504cu;
    uint32_t k0 = (uint32_t)seed, k1 = (uint32_t)(seed >> 32);
    for (int r = 0; r < 10; r++) {
        uint32_t hi0 = __umulhi(0xD2511F53u, c0), lo0 = 0xD2511F53u * c0;
        uint32_t hi1 = __umulhi(0xCD9E8D57u, c2), lo1 = 0xCD9E8D57u * c2;
        uint32_t n0 = hi1 ^ c1 ^ k0, n2 = hi0 ^ c3 ^ k1;
        c0 = n0, c1 = lo1, c2 = n2, c3 = lo0;
        k0 += 0x9E3779B9u;
        k1 += 0xBB67AE85u;
    }
    uint64_t x = ((uint64_t)c0 << 21) ^ ((uint64_t)c1 >> 11);
    return x & ((1ull << 53) - 1);
}

/* ---- block reductions (integers: the order of the adds does not matter) ---- */

__device__ __forceinline__ unsigned long long smp_warp_sum(unsigned long long v)
{
    for (int o = 16; o > 0; o /= 2)
        v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ unsigned long long smp_warp_max(unsigned long long v)
{
    for (int o = 16; o > 0; o /= 2) {
        unsigned long long w = __shfl_xor_sync(0xffffffffu, v, o);
        v = w > v ? w : v;
    }
    return v;
}

/* ---- sources of keys: the vocabulary row and the candidate list ---- */

/* The vocabulary: token i's force-top-k key when it is allowed and not -inf. */
struct smp_vocab {
    const float *x;
    const uint32_t *allowed;    /* NULL: every token */
    uint32_t n;
    __device__ __forceinline__ uint32_t lkey(uint32_t i) const
    {
        if (allowed && !((allowed[i >> 5] >> (i & 31)) & 1u))
            return 0;
        return smp_logit_key(__float_as_uint(x[i]));
    }
    __device__ __forceinline__ bool get(uint32_t i, uint64_t *key, uint32_t *w) const
    {
        uint32_t k = lkey(i);
        *key = ((uint64_t)~k << 32) | i;
        *w = 1;
        return k != 0;
    }
};

/* The candidates: draw-order keys and masses. */
struct smp_list {
    const uint64_t *key;
    const uint32_t *mass;
    uint32_t n;
    __device__ __forceinline__ bool get(uint32_t i, uint64_t *k, uint32_t *w) const
    {
        *k = key[i];
        *w = mass[i];
        return true;
    }
};

/* The smallest X such that the keys <= min(X, lim) weigh at least need (weights: 1 each when
 * !WEIGHTED); the keys <= lim must weigh at least need. Every thread gets X. */
template <bool WEIGHTED, class SRC>
__device__ uint64_t smp_select(const SRC &src, uint64_t lim, unsigned long long need,
                               smp_shared *sh)
{
    const uint32_t tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    uint64_t prefix = 0;
    for (int shift = 56; shift >= 0; shift -= 8) {
        for (uint32_t b = tid; b < SMP_BINS; b += SMP_THREADS) {
            sh->cnt[b] = 0;
            sh->wsum[b] = 0;
        }
        __syncthreads();
        for (uint32_t base = warp * 32; base < src.n; base += SMP_THREADS) {
            uint32_t i = base + lane, w = 0, bin = SMP_BINS;
            uint64_t key;
            if (i < src.n && src.get(i, &key, &w) && key <= lim &&
                (shift == 56 || (key >> (shift + 8)) == (prefix >> (shift + 8))))
                bin = (uint32_t)(key >> shift) & (SMP_BINS - 1);
            if (WEIGHTED) {
                /* a warp whose keys share one bin adds once (the usual case in the first
                 * passes, where most keys share the top digits) */
                const uint32_t b0 = __shfl_sync(0xffffffffu, bin, 0);
                if (__all_sync(0xffffffffu, bin == b0)) {
                    uint32_t lo = __reduce_add_sync(0xffffffffu, w & 0xffffu);
                    uint32_t hi = __reduce_add_sync(0xffffffffu, w >> 16);
                    if (lane == 0 && b0 < SMP_BINS) {
                        atomicAdd(&sh->cnt[b0], 32u);
                        atomicAdd(&sh->wsum[b0], ((unsigned long long)hi << 16) + lo);
                    }
                } else if (bin < SMP_BINS) {
                    atomicAdd(&sh->cnt[bin], 1u);
                    atomicAdd(&sh->wsum[bin], (unsigned long long)w);
                }
            } else {
                uint32_t peers = __match_any_sync(0xffffffffu, bin);
                if (bin < SMP_BINS && lane == (uint32_t)(__ffs(peers) - 1))
                    atomicAdd(&sh->cnt[bin], (uint32_t)__popc(peers));
            }
        }
        __syncthreads();
        if (warp == 0) {
            /* lane l owns bins 8l .. 8l+7: its total, an inclusive scan over the lanes, then
             * the first lane reaching need walks its bins */
            unsigned long long own = 0;
            for (int j = 0; j < 8; j++)
                own += WEIGHTED ? sh->wsum[lane * 8 + j] : sh->cnt[lane * 8 + j];
            unsigned long long inc = own;
            for (int o = 1; o < 32; o *= 2) {
                unsigned long long v = __shfl_up_sync(0xffffffffu, inc, o);
                if (lane >= (uint32_t)o)
                    inc += v;
            }
            uint32_t hit = __ballot_sync(0xffffffffu, inc >= need);
            uint32_t first = hit ? (uint32_t)(__ffs(hit) - 1) : 31;
            if (lane == first) {
                unsigned long long cum = inc - own;
                uint32_t b = lane * 8 + 7;
                for (uint32_t j = 0; j < 8; j++) {
                    unsigned long long v = WEIGHTED ? sh->wsum[lane * 8 + j]
                                                    : sh->cnt[lane * 8 + j];
                    if (cum + v >= need) {
                        b = lane * 8 + j;
                        break;
                    }
                    cum += v;
                }
                sh->bin = b;
                sh->before = cum;
                sh->bin_cnt = sh->cnt[b];
            }
        }
        __syncthreads();
        uint32_t b = sh->bin, bc = sh->bin_cnt;
        need -= sh->before;
        prefix |= (uint64_t)b << shift;
        bool done = WEIGHTED ? bc <= 1 : need >= bc;
        __syncthreads();
        if (done)
            return shift ? prefix | ((1ull << shift) - 1) : prefix;
    }
    return prefix;
}

/* Count (keys <= lim) and their mass, to every thread. */
__device__ void smp_sum(const smp_list &l, uint64_t lim, smp_shared *sh, uint32_t *count,
                        unsigned long long *mass)
{
    const uint32_t tid = threadIdx.x, lane = tid & 31;
    if (tid == 0) {
        sh->u32a = 0;
        sh->u64a = 0;
    }
    __syncthreads();
    unsigned long long m = 0, c = 0;
    for (uint32_t i = tid; i < l.n; i += SMP_THREADS)
        if (l.key[i] <= lim) {
            m += l.mass[i];
            c++;
        }
    m = smp_warp_sum(m);
    c = smp_warp_sum(c);
    if (lane == 0) {
        atomicAdd(&sh->u64a, m);
        atomicAdd(&sh->u32a, (uint32_t)c);
    }
    __syncthreads();
    *count = sh->u32a;
    *mass = sh->u64a;
    __syncthreads();
}

/* The largest key <= lim, to every thread. */
__device__ uint64_t smp_max_below(const smp_list &l, uint64_t lim, smp_shared *sh)
{
    const uint32_t tid = threadIdx.x, lane = tid & 31;
    if (tid == 0)
        sh->u64b = 0;
    __syncthreads();
    unsigned long long best = 0;
    for (uint32_t i = tid; i < l.n; i += SMP_THREADS)
        if (l.key[i] <= lim && l.key[i] > best)
            best = l.key[i];
    best = smp_warp_max(best);
    if (lane == 0)
        atomicMax(&sh->u64b, best);
    __syncthreads();
    uint64_t r = sh->u64b;
    __syncthreads();
    return r;
}

/* ceil(top_p * total) the sampler's way: top_p = f * 2^-shift exactly, f < 2^24. */
__device__ unsigned long long smp_top_p_need(float top_p, unsigned long long total)
{
    int e;
    float frac = frexpf(top_p, &e);
    unsigned long long f = (unsigned long long)ldexpf(frac, 24);
    int shift = 24 - e;
    if (shift >= 100)
        return 1;
    unsigned __int128 prod = (unsigned __int128)f * total;
    unsigned __int128 one = 1;
    unsigned long long need =
        (unsigned long long)((prod + ((one << shift) - 1)) >> shift);
    return need ? need : 1;
}

__device__ __forceinline__ float smp_logprob(uint32_t mass, unsigned long long total)
{
    return __double2float_rn(__dsub_rn(log((double)mass), log((double)total)));
}

__global__ void __launch_bounds__(SMP_THREADS) sample_kernel(smp_args a)
{
    __shared__ smp_shared sh;
    const uint32_t row = blockIdx.x, tid = threadIdx.x, lane = tid & 31;
    const smp_row p = a.rows[row];
    smp_vocab voc;
    voc.x = a.logits + (size_t)row * a.stride;
    voc.allowed = p.allowed >= 0 ? a.bitmaps + p.allowed : NULL;
    voc.n = a.n_vocab;
    kern_sample_out *out = a.out + row;

    /* pass 1: bad logits, allowed tokens, the largest key */
    if (tid == 0) {
        sh.u32a = 0;
        sh.u32b = 0;
        sh.u64a = 0;
    }
    __syncthreads();
    uint32_t bad = 0, allowed = 0, kmax = 0;
    for (uint32_t i = tid; i < voc.n; i += SMP_THREADS) {
        bad |= smp_bad(__float_as_uint(voc.x[i]));
        uint32_t k = voc.lkey(i);
        allowed += k != 0;
        kmax = k > kmax ? k : kmax;
    }
    bad = __reduce_or_sync(0xffffffffu, bad);
    allowed = __reduce_add_sync(0xffffffffu, allowed);
    kmax = __reduce_max_sync(0xffffffffu, kmax);
    if (lane == 0) {
        atomicOr(&sh.u32a, bad);
        atomicAdd(&sh.u32b, allowed);
        atomicMax(&sh.u64a, (unsigned long long)kmax);
    }
    __syncthreads();
    bad = sh.u32a, allowed = sh.u32b, kmax = (uint32_t)sh.u64a;
    __syncthreads();
    if (bad || allowed == 0) {
        if (tid == 0) {
            out->status = bad ? KERN_SAMPLE_BAD_LOGIT : KERN_SAMPLE_ALL_BLOCKED;
            out->token = 0; /* a later op may read it as an id (kern_sample_out) */
        }
        return;
    }

    /* force top-k: the candidates are the allowed tokens with keys <= xf */
    uint64_t xf = SMP_NONE;
    if (p.force_top_k && p.force_top_k < allowed)
        xf = smp_select<false>(voc, SMP_NONE, p.force_top_k, &sh);

    /* pass 2: candidates with non-zero mass into the list */
    if (tid == 0) {
        sh.u32a = 0;
        sh.u64a = 0;
    }
    __syncthreads();
    uint64_t *ckey = a.cand_key + (size_t)row * a.cap;
    uint32_t *cmass = a.cand_mass + (size_t)row * a.cap;
    const double lmax = (double)smp_key_logit(kmax), inv_t = 1.0 / (double)p.temperature;
    for (uint32_t base = (tid & ~31u); base < voc.n; base += SMP_THREADS) {
        uint32_t i = base + lane, m = 0;
        uint64_t key;
        uint32_t w;
        if (i < voc.n && voc.get(i, &key, &w) && key <= xf) {
            double z = __dmul_rn(__dsub_rn((double)smp_key_logit(~(uint32_t)(key >> 32)), lmax),
                                 inv_t);
            if (!(z < -21.5))
                m = (uint32_t)__dmul_rn(exp(z), (double)SMP_MASS_ONE);
        }
        uint32_t take = __ballot_sync(0xffffffffu, m != 0);
        uint32_t at = 0;
        if (lane == 0 && take)
            at = atomicAdd(&sh.u32a, (uint32_t)__popc(take));
        at = __shfl_sync(0xffffffffu, at, 0);
        if (m) {
            uint32_t j = at + (uint32_t)__popc(take & ((1u << lane) - 1));
            ckey[j] = ((uint64_t)(SMP_MASS_ONE - m) << 32) | i;
            cmass[j] = m;
        }
    }
    __syncthreads();
    smp_list l;
    l.key = ckey, l.mass = cmass, l.n = sh.u32a;
    __syncthreads(); /* the list is written (global memory, visible to the block after this) */

    /* top-k, top-p */
    uint64_t x2 = SMP_NONE;
    if (p.top_k > 0 && (uint32_t)p.top_k < l.n)
        x2 = smp_select<false>(l, SMP_NONE, (unsigned long long)p.top_k, &sh);
    uint32_t n_kept;
    unsigned long long total;
    smp_sum(l, x2, &sh, &n_kept, &total);
    if (p.top_p < 1.0f) {
        uint64_t xp = smp_select<true>(l, x2, smp_top_p_need(p.top_p, total), &sh);
        x2 = xp < x2 ? xp : x2;
        smp_sum(l, x2, &sh, &n_kept, &total);
    }

    /* the draw: the first token in draw order whose cumulative mass exceeds threshold */
    const uint64_t x53 = smp_philox53(p.seed, p.stream);
    const unsigned long long threshold =
        (unsigned long long)(((unsigned __int128)x53 * total) >> 53);
    uint64_t xd = smp_select<true>(l, x2, threshold + 1, &sh);
    uint64_t pick = smp_max_below(l, xd < x2 ? xd : x2, &sh);

    /* the top logprobs: the first n_top keys */
    uint32_t n_top = p.n_logprobs < n_kept ? p.n_logprobs : n_kept;
    if (n_top) {
        uint64_t xt = smp_select<false>(l, x2, n_top, &sh);
        xt = xt < x2 ? xt : x2;
        if (tid == 0)
            sh.u32b = 0;
        __syncthreads();
        for (uint32_t i = tid; i < l.n; i += SMP_THREADS)
            if (l.key[i] <= xt) {
                uint32_t j = atomicAdd(&sh.u32b, 1u);
                if (j < KERN_SAMPLE_MAX_TOP)
                    sh.top_key[j] = l.key[i];
            }
        __syncthreads();
    }
    if (tid == 0) {
        uint32_t mass = SMP_MASS_ONE - (uint32_t)(pick >> 32);
        out->status = KERN_SAMPLE_OK;
        out->token = (int32_t)(uint32_t)pick;
        out->logprob = smp_logprob(mass, total);
        out->n_top = n_top;
        out->total = total;
        out->n_kept = n_kept;
        for (uint32_t i = 1; i < n_top; i++) /* insertion sort of at most 20 keys */
            for (uint32_t j = i; j > 0 && sh.top_key[j - 1] > sh.top_key[j]; j--) {
                uint64_t t = sh.top_key[j];
                sh.top_key[j] = sh.top_key[j - 1];
                sh.top_key[j - 1] = t;
            }
        for (uint32_t i = 0; i < n_top; i++) {
            out->top_tokens[i] = (int32_t)(uint32_t)sh.top_key[i];
            out->top_logprobs[i] = smp_logprob(SMP_MASS_ONE - (uint32_t)(sh.top_key[i] >> 32),
                                               total);
        }
    }
}

/* ---- table entry ---- */

static di_status check_row(cuda_ctx *c, const kern_sample_row *r, uint32_t i)
{
    if (!(r->temperature > 0.0f) || r->temperature > 3.4e38f)
        return cuda_fail(c, DI_EINVAL, "sample row %u: temperature %g is not positive and "
                                       "finite", i, (double)r->temperature);
    if (!(r->top_p > 0.0f && r->top_p <= 1.0f))
        return cuda_fail(c, DI_EINVAL, "sample row %u: top_p %g outside (0, 1]", i,
                         (double)r->top_p);
    if (r->n_logprobs > KERN_SAMPLE_MAX_TOP)
        return cuda_fail(c, DI_EINVAL, "sample row %u: %u logprobs above %d", i, r->n_logprobs,
                         KERN_SAMPLE_MAX_TOP);
    return DI_OK;
}

di_status cuda_op_sample(void *ctx, const kern_sample *p)
{
    cuda_ctx *c = (cuda_ctx *)ctx;
    di_status st = cuda_op_begin(c, p, "sample");
    if (st != DI_OK || p->n_rows == 0)
        return st;
    if (!p->logits || !p->rows || (!p->out && !p->out_dev))
        return cuda_fail(c, DI_EINVAL, "sample: logits, rows or out is NULL");
    if (p->n_vocab == 0 || p->n_vocab > (1u << 30) || p->logits_stride < p->n_vocab)
        return cuda_fail(c, DI_EINVAL, "sample: n_vocab %u outside [1, 2^30] or stride %zu "
                                       "below it", p->n_vocab, p->logits_stride);
    if (p->n_rows > 0x7fffffffu)
        return cuda_fail(c, DI_EINVAL, "sample: %u rows in one launch", p->n_rows);
    const size_t words = ((size_t)p->n_vocab + 31) / 32;
    uint32_t cap = 1, with_map = 0;
    for (uint32_t i = 0; i < p->n_rows; i++) {
        const kern_sample_row *r = &p->rows[i];
        if ((st = check_row(c, r, i)) != DI_OK)
            return st;
        uint32_t want = r->force_top_k && r->force_top_k < p->n_vocab ? r->force_top_k
                                                                       : p->n_vocab;
        cap = want > cap ? want : cap;
        with_map += r->allowed != NULL;
    }
    cuda_meta_reset(c);
    size_t rows_off = 0, maps_off = 0, out_off = 0;
    st = cuda_meta_push(c, NULL, (size_t)p->n_rows * sizeof(smp_row), &rows_off);
    if (st == DI_OK && with_map)
        st = cuda_meta_push(c, NULL, (size_t)with_map * words * sizeof(uint32_t), &maps_off);
    if (st == DI_OK)
        st = cuda_meta_push(c, NULL, (size_t)p->n_rows * sizeof(kern_sample_out), &out_off);
    if (st != DI_OK)
        return st;
    uint32_t map = 0;
    for (uint32_t i = 0; i < p->n_rows; i++) {
        const kern_sample_row *r = &p->rows[i];
        smp_row d;
        memset(&d, 0, sizeof(d));
        d.temperature = r->temperature, d.top_p = r->top_p, d.top_k = r->top_k;
        d.force_top_k = r->force_top_k, d.n_logprobs = r->n_logprobs;
        d.seed = r->seed, d.stream = r->stream;
        d.allowed = -1;
        if (r->allowed) {
            memcpy((uint32_t *)cuda_meta_at(c, maps_off) + (size_t)map * words, r->allowed,
                   words * sizeof(uint32_t));
            d.allowed = (int64_t)((size_t)map * words);
            map++;
        }
        memcpy((smp_row *)cuda_meta_at(c, rows_off) + i, &d, sizeof(d));
    }
    const size_t key_bytes = cuda_align_up((size_t)p->n_rows * cap * sizeof(uint64_t));
    uint8_t *dev = NULL, *extra = NULL;
    st = cuda_meta_upload(c, 0, key_bytes + (size_t)p->n_rows * cap * sizeof(uint32_t), &dev,
                          &extra);
    if (st != DI_OK)
        return st;
    smp_args a;
    a.logits = p->logits, a.stride = p->logits_stride, a.n_vocab = p->n_vocab, a.cap = cap;
    a.rows = (const smp_row *)(dev + rows_off);
    a.bitmaps = with_map ? (const uint32_t *)(dev + maps_off) : NULL;
    a.cand_key = (uint64_t *)extra;
    a.cand_mass = (uint32_t *)(extra + key_bytes);
    a.out = p->out_dev ? p->out_dev : (kern_sample_out *)(dev + out_off);
    cuda_launch(c, "sample_kernel", sample_kernel, p->n_rows, SMP_THREADS, 0, c->stream, a);
    st = cuda_launched(c, "sample_kernel");
    if (st == DI_OK && !p->out_dev) /* out_dev: the caller reads them back later */
        st = cuda_download(c, p->out, a.out, (size_t)p->n_rows * sizeof(kern_sample_out));
    return st;
}
