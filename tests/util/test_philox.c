#include <criterion/criterion.h>
#include <math.h>

#include "common/util/philox.h"

/* Known-answer vectors of Philox-4x32-10 published with Random123 (kat_vectors). */
Test(philox, known_answer_vectors)
{
    struct {
        uint32_t ctr[4], key[2], out[4];
    } kat[] = {
        {{0, 0, 0, 0}, {0, 0}, {0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8}},
        {{0xffffffff, 0xffffffff, 0xffffffff, 0xffffffff},
         {0xffffffff, 0xffffffff},
         {0x408f276d, 0x41c83b0e, 0xa20bc7c6, 0x6d5451fd}},
        {{0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344},
         {0xa4093822, 0x299f31d0},
         {0xd16cfe09, 0x94fdcceb, 0x5001e420, 0x24126ea1}},
    };
    for (size_t i = 0; i < sizeof(kat) / sizeof(kat[0]); i++) {
        uint32_t out[4];
        philox4x32_10(kat[i].ctr, kat[i].key, out);
        for (int j = 0; j < 4; j++)
            cr_assert_eq(out[j], kat[i].out[j], "vector %zu word %d: %08x != %08x", i, j,
                         out[j], kat[i].out[j]);
    }
}

Test(philox, keyed_uniform_is_pure_and_in_range)
{
    double a = di_philox_uniform(1, 49167, 0);
    double b = di_philox_uniform(1, 49167, 0);
    cr_assert_eq(a, b);
    cr_assert_neq(a, di_philox_uniform(2, 49167, 0));
    cr_assert_neq(a, di_philox_uniform(1, 49168, 0));
    cr_assert_neq(a, di_philox_uniform(1, 49167, 1));
    double sum = 0;
    for (uint64_t s = 0; s < 100000; s++) {
        double u = di_philox_uniform(42, s, 0);
        cr_assert(u >= 0.0 && u < 1.0);
        sum += u;
    }
    cr_assert(fabs(sum / 100000 - 0.5) < 0.01, "mean %f", sum / 100000);
}

Test(philox, sequential_rng_reproducible_and_unbiased)
{
    di_rng r1, r2;
    di_rng_init(&r1, 7);
    di_rng_init(&r2, 7);
    for (int i = 0; i < 1000; i++)
        cr_assert_eq(di_rng_u32(&r1), di_rng_u32(&r2));
    int counts[7] = {0};
    for (int i = 0; i < 70000; i++)
        counts[di_rng_below(&r1, 7)]++;
    for (int i = 0; i < 7; i++)
        cr_assert(counts[i] > 9400 && counts[i] < 10600, "bucket %d has %d", i, counts[i]);
    double m = 0, v = 0;
    for (int i = 0; i < 50000; i++) {
        double x = di_rng_normal(&r1);
        m += x;
        v += x * x;
    }
    m /= 50000;
    v = v / 50000 - m * m;
    cr_assert(fabs(m) < 0.03 && fabs(v - 1) < 0.05, "mean %f var %f", m, v);
}
