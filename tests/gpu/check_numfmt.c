/* check_numfmt: CUDA quantisation procedures against their C twins, byte for byte, on
 * adversarial and random inputs; with --bench, bandwidth next to the device copy bandwidth. */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "common/util/philox.h"
#include "kernels/cpu/numfmt.h"
#include "kernels/cuda/numfmt_cuda.h"
#include "tests/gpu/gpu_common.h"

static const char *proc_name[3] = {"fp8_b32 (A)", "fp4_b32 (B)", "fp4_b16 (C)"};

static void cpu_quant(int proc, const float *x, size_t n, uint8_t *codes, uint8_t *scales)
{
    if (proc == NUMFMT_FP8_B32)
        di_quant_fp8_b32(x, n, codes, scales);
    else if (proc == NUMFMT_FP4_B32)
        di_quant_fp4_b32(x, n, codes, scales);
    else
        di_quant_fp4_b16(x, n, codes, scales);
}

static void cpu_fakequant(int proc, float *x, size_t n)
{
    if (proc == NUMFMT_FP8_B32)
        di_fakequant_fp8_b32(x, n);
    else if (proc == NUMFMT_FP4_B32)
        di_fakequant_fp4_b32(x, n);
    else
        di_fakequant_fp4_b16(x, n);
}

static void fill(float *x, size_t n, int mode, di_rng *rng)
{
    for (size_t i = 0; i < n; i++) {
        switch (mode) {
        case 0: x[i] = 0.0f; break;
        case 1: x[i] = 1.0f; break;
        case 2: x[i] = (float)i - (float)(n / 2); break;                 /* arange */
        case 3: x[i] = (float)(di_rng_normal(rng)); break;
        case 4: x[i] = (float)(di_rng_normal(rng) * 1e-6); break;       /* near the floors */
        case 5: x[i] = (float)(di_rng_normal(rng) * 3e3); break;        /* near 448 * s limits */
        case 6: x[i] = (i % 7 == 0) ? 448.0f : (float)di_rng_normal(rng) * 6.0f; break;
        case 7: x[i] = (float)(0.25 * (double)(int)(di_rng_below(rng, 48)) - 6.0); break; /* ties */
        default: x[i] = (i % 97 == 0) ? NAN : (float)di_rng_normal(rng); break;
        }
    }
}

static int check_one(int proc, size_t n, int mode, di_rng *rng)
{
    size_t ncodes = proc == NUMFMT_FP8_B32 ? n : n / 2;
    size_t nscales = n / (proc == NUMFMT_FP4_B16 ? 16 : 32);
    float *x = malloc(n * sizeof(float)), *fq = malloc(n * sizeof(float)),
          *fq_gpu = malloc(n * sizeof(float));
    uint8_t *c = malloc(ncodes), *s = malloc(nscales), *cg = malloc(ncodes), *sg = malloc(nscales);
    fill(x, n, mode, rng);
    cpu_quant(proc, x, n, c, s);
    memcpy(fq, x, n * sizeof(float));
    cpu_fakequant(proc, fq, n);

    float *dx;
    uint8_t *dc, *ds;
    GPU_OK(cudaMalloc((void **)&dx, n * sizeof(float)));
    GPU_OK(cudaMalloc((void **)&dc, ncodes));
    GPU_OK(cudaMalloc((void **)&ds, nscales));
    GPU_OK(cudaMemset(dc, 0xa5, ncodes)); /* poison: every byte must be written */
    GPU_OK(cudaMemset(ds, 0xa5, nscales));
    GPU_OK(cudaMemcpy(dx, x, n * sizeof(float), cudaMemcpyHostToDevice));
    di_error e;
    numfmt_quant_params p = {dx, n, (numfmt_procedure)proc, dc, ds, NULL};
    if (numfmt_cuda_quant(&p, &e) != DI_OK) {
        fprintf(stderr, "numfmt_cuda_quant: %s\n", e.msg);
        exit(2);
    }
    if (numfmt_cuda_fakequant(dx, n, (numfmt_procedure)proc, NULL, &e) != DI_OK) {
        fprintf(stderr, "numfmt_cuda_fakequant: %s\n", e.msg);
        exit(2);
    }
    GPU_OK(cudaDeviceSynchronize());
    GPU_OK(cudaMemcpy(cg, dc, ncodes, cudaMemcpyDeviceToHost));
    GPU_OK(cudaMemcpy(sg, ds, nscales, cudaMemcpyDeviceToHost));
    GPU_OK(cudaMemcpy(fq_gpu, dx, n * sizeof(float), cudaMemcpyDeviceToHost));
    int bad = 0;
    for (size_t i = 0; i < ncodes && bad < 5; i++)
        if (c[i] != cg[i]) {
            fprintf(stderr, "MISMATCH %s n=%zu mode=%d code[%zu]: cpu 0x%02x gpu 0x%02x (x=%g)\n",
                    proc_name[proc], n, mode, i, c[i], cg[i], x[proc == 0 ? i : 2 * i]);
            bad++;
        }
    for (size_t i = 0; i < nscales && bad < 5; i++)
        if (s[i] != sg[i]) {
            fprintf(stderr, "MISMATCH %s n=%zu mode=%d scale[%zu]: cpu 0x%02x gpu 0x%02x\n",
                    proc_name[proc], n, mode, i, s[i], sg[i]);
            bad++;
        }
    for (size_t i = 0; i < n && bad < 5; i++)
        if (memcmp(&fq[i], &fq_gpu[i], 4) != 0 && !(isnan(fq[i]) && isnan(fq_gpu[i]))) {
            fprintf(stderr, "MISMATCH %s n=%zu mode=%d fakequant[%zu]: cpu %g gpu %g (x=%g)\n",
                    proc_name[proc], n, mode, i, fq[i], fq_gpu[i], x[i]);
            bad++;
        }
    cudaFree(dx);
    cudaFree(dc);
    cudaFree(ds);
    free(x); free(fq); free(fq_gpu); free(c); free(s); free(cg); free(sg);
    return bad;
}

static void bench(void)
{
    const size_t n = (size_t)64 << 20; /* 64 Mi values = 256 MiB */
    float *dx;
    uint8_t *dc, *ds;
    GPU_OK(cudaMalloc((void **)&dx, n * sizeof(float)));
    GPU_OK(cudaMalloc((void **)&dc, n));
    GPU_OK(cudaMalloc((void **)&ds, n / 16));
    float *h = malloc(n * sizeof(float));
    di_rng rng;
    di_rng_init(&rng, 5);
    for (size_t i = 0; i < n; i++)
        h[i] = (float)di_rng_normal(&rng);
    GPU_OK(cudaMemcpy(dx, h, n * sizeof(float), cudaMemcpyHostToDevice));
    free(h);
    double copy = gpu_copy_gbs(n * sizeof(float), 20);
    printf("%-28s %10s %10s %8s\n", "kernel (64 Mi fp32 values)", "GB/s", "copy GB/s", "of copy");
    cudaEvent_t t0, t1;
    GPU_OK(cudaEventCreate(&t0));
    GPU_OK(cudaEventCreate(&t1));
    di_error e;
    for (int proc = 0; proc < 3; proc++) {
        numfmt_quant_params p = {dx, n, (numfmt_procedure)proc, dc, ds, NULL};
        float ms[20];
        numfmt_cuda_quant(&p, &e);
        for (int r = 0; r < 20; r++) {
            GPU_OK(cudaEventRecord(t0, 0));
            numfmt_cuda_quant(&p, &e);
            GPU_OK(cudaEventRecord(t1, 0));
            GPU_OK(cudaEventSynchronize(t1));
            GPU_OK(cudaEventElapsedTime(&ms[r], t0, t1));
        }
        size_t out = (proc == 0 ? n : n / 2) + n / (proc == 2 ? 16 : 32);
        double gbs = (double)(n * 4 + out) / (gpu_median(ms, 20) * 1e-3) / 1e9;
        char name[64];
        snprintf(name, sizeof(name), "quant %s", proc_name[proc]);
        printf("%-28s %10.0f %10.0f %7.0f%%\n", name, gbs, copy, 100.0 * gbs / copy);
    }
}

int main(int argc, char **argv)
{
    int want_bench = argc > 1 && strcmp(argv[1], "--bench") == 0;
    if (argc > 1 && strcmp(argv[1], "--help") == 0) {
        printf("usage: check_numfmt [--bench]\n");
        return 0;
    }
    di_rng rng;
    di_rng_init(&rng, 1234);
    const size_t sizes[] = {32, 64, 96, 32 * 127, 16 * 63, 1 << 20};
    int bad = 0, runs = 0;
    for (int proc = 0; proc < 3; proc++)
        for (size_t si = 0; si < sizeof(sizes) / sizeof(sizes[0]); si++) {
            size_t n = sizes[si];
            if (proc != NUMFMT_FP4_B16 && n % 32)
                continue;
            for (int mode = 0; mode < 9; mode++) {
                bad += check_one(proc, n, mode, &rng);
                runs++;
            }
        }
    printf("numfmt: %d CUDA-vs-C comparisons, %s\n", runs, bad ? "MISMATCHES" : "all bit-identical");
    if (bad)
        return 1;
    if (want_bench)
        bench();
    return 0;
}
