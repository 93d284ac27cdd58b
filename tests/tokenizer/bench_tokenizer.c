/* bench_tokenizer: encode throughput of the C tokenizer on one text file, one thread.
 *
 *   bench_tokenizer TOKENIZER_JSON TEXT_FILE [PASSES]
 *
 * Prints one line per measurement: the first pass with an empty word cache ("cold") and the
 * best of PASSES later ones ("warm"), as MB/s (10^6 bytes) and tokens/s, and the ids' count
 * and checksum so that the script can compare them with the reference encoders'. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/tokenizer/tokenizer.h"
#include "common/util/clock.h"
#include "tests/tokenizer/tok_test_util.h"

static void report(const char *what, size_t bytes, const tok_ids *ids, uint64_t ns)
{
    double s = (double)ns / 1e9;
    printf("%-46s %8.2f MB/s %11.0f tokens/s  %zu tokens\n", what, (double)bytes / 1e6 / s,
           (double)ids->n / s, ids->n);
}

int main(int argc, char **argv)
{
    if (argc < 3 || argc > 4) {
        fprintf(stderr, "usage: bench_tokenizer TOKENIZER_JSON TEXT_FILE [PASSES]\n");
        return 2;
    }
    int passes = argc == 4 ? atoi(argv[3]) : 5;
    size_t len = 0;
    char *text = tt_read_file(argv[2], &len);
    if (!text || passes < 1) {
        fprintf(stderr, "bench_tokenizer: cannot read %s\n", argv[2]);
        return 1;
    }
    tok_tokenizer *t = NULL;
    di_error e;
    uint64_t t0 = di_mono_ns();
    if (tok_load_file(argv[1], &t, &e)) {
        fprintf(stderr, "bench_tokenizer: %s\n", e.msg);
        return 1;
    }
    fprintf(stderr, "bench_tokenizer: loaded in %.0f ms, %zu bytes of text\n",
            (double)(di_mono_ns() - t0) / 1e6, len);
    tok_ids ids = {0};
    uint64_t best = UINT64_MAX;
    for (int p = 0; p <= passes; p++) {
        ids.n = 0;
        t0 = di_mono_ns();
        if (tok_encode(t, text, len, &ids, &e)) {
            fprintf(stderr, "bench_tokenizer: %s\n", e.msg);
            return 1;
        }
        uint64_t ns = di_mono_ns() - t0;
        if (p == 0)
            report("C tokenizer, cold word cache", len, &ids, ns);
        else if (ns < best)
            best = ns;
    }
    report("C tokenizer, warm word cache", len, &ids, best);
    uint64_t sum = 0;
    for (size_t i = 0; i < ids.n; i++)
        sum = sum * 1000003u + (uint64_t)ids.v[i];
    printf("ids %zu checksum %llu\n", ids.n, (unsigned long long)sum);
    tok_ids_free(&ids);
    tok_free(t);
    free(text);
    return 0;
}
