/* numfmt_probe.c: applies one of kernels/cpu/numfmt.h's conversions to a file of fp32 values,
 * so that test_ref_numfmt_c.py can compare the C formats with the NumPy reference's.
 *
 *   numfmt_probe MODE IN OUT     IN, OUT: little-endian fp32 arrays of the same length
 *
 * MODE (one row of the table below): bf16, e4m3, e2m1 round each value; fq8 (procedure A),
 * fq4 (B) and fq4c (C) fake-quantise the whole array (length a multiple of the block).
 * Exit status 0 on success, 1 with a one-line message on bad input.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/cpu/numfmt.h"

static void map_bf16(float *x, size_t n)
{
    for (size_t i = 0; i < n; i++)
        x[i] = di_bf16_round(x[i]);
}

static void map_e4m3(float *x, size_t n)
{
    for (size_t i = 0; i < n; i++)
        x[i] = di_e4m3_round(x[i]);
}

static void map_e2m1(float *x, size_t n)
{
    for (size_t i = 0; i < n; i++)
        x[i] = di_e2m1_decode(di_e2m1_encode(x[i]));
}

typedef struct probe_mode {
    const char *name;                 /* MODE argument */
    size_t block;                     /* the array length must be a multiple of this */
    void (*apply)(float *x, size_t n); /* in-place conversion */
} probe_mode;

static const probe_mode probe_modes[] = {
    {"bf16", 1, map_bf16},
    {"e4m3", 1, map_e4m3},
    {"e2m1", 1, map_e2m1},
    {"fq8", 32, di_fakequant_fp8_b32},
    {"fq4", 32, di_fakequant_fp4_b32},
    {"fq4c", 16, di_fakequant_fp4_b16},
};

static float *read_all(const char *path, size_t *n)
{
    FILE *f = fopen(path, "rb");
    if (!f)
        return NULL;
    float *buf = NULL;
    size_t cap = 0, len = 0;
    for (;;) {
        if (len == cap) {
            size_t ncap = cap ? cap * 2 : 4096;
            float *nb = realloc(buf, ncap * sizeof *buf);
            if (!nb) {
                free(buf);
                fclose(f);
                return NULL;
            }
            buf = nb;
            cap = ncap;
        }
        size_t got = fread(buf + len, sizeof *buf, cap - len, f);
        len += got;
        if (got == 0)
            break;
    }
    fclose(f);
    *n = len;
    return buf;
}

int main(int argc, char **argv)
{
    if (argc != 4) {
        fprintf(stderr, "usage: numfmt_probe MODE IN OUT (MODE: bf16 e4m3 e2m1 fq8 fq4 fq4c)\n");
        return 1;
    }
    const probe_mode *mode = NULL;
    for (size_t i = 0; i < sizeof probe_modes / sizeof probe_modes[0]; i++)
        if (strcmp(argv[1], probe_modes[i].name) == 0)
            mode = &probe_modes[i];
    if (!mode) {
        fprintf(stderr, "numfmt_probe: unknown mode '%s'\n", argv[1]);
        return 1;
    }
    size_t n = 0;
    float *x = read_all(argv[2], &n);
    if (!x) {
        fprintf(stderr, "numfmt_probe: cannot read %s\n", argv[2]);
        return 1;
    }
    if (n % mode->block) {
        fprintf(stderr, "numfmt_probe: %zu values is not a multiple of %zu\n", n, mode->block);
        free(x);
        return 1;
    }
    mode->apply(x, n);
    FILE *f = fopen(argv[3], "wb");
    int ok = f && fwrite(x, sizeof *x, n, f) == n;
    if (f && fclose(f) != 0)
        ok = 0;
    free(x);
    if (!ok) {
        fprintf(stderr, "numfmt_probe: cannot write %s\n", argv[3]);
        return 1;
    }
    return 0;
}
