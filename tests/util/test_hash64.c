/* The payload checksum: the copying variant agrees with the plain one, and the copy it leaves
 * is exactly what it hashed, even while the source keeps changing. */
#include <criterion/criterion.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <string.h>

#include "common/util/clock.h"
#include "common/util/hash64.h"

Test(hash64, copy_agrees_with_the_hash_at_every_length_and_alignment)
{
    unsigned char src[300], dst[320];
    for (int i = 0; i < 300; i++)
        src[i] = (unsigned char)(i * 37 + 11);
    for (size_t off = 0; off < 8; off++) {
        const unsigned char *from = src + (8 - off) % 8; /* source and copy misaligned apart */
        for (size_t len = 0; len + 8 <= 300; len++) {
            memset(dst, 0xee, sizeof dst);
            uint64_t h = di_hash64_copy(dst + off, from, len, 5);
            cr_assert_eq(h, di_hash64(from, len, 5), "len %zu off %zu", len, off);
            cr_assert_eq(memcmp(dst + off, from, len), 0);
            cr_assert_eq(dst[off + len], 0xee, "wrote past the end");
        }
    }
}

/* A writer keeps flipping the source (a remote put landing during a read). Whatever the copy
 * holds must be what was hashed: the check of the copy is then meaningful. The tail (the
 * bytes after the last 32-byte stripe) counts too. */
typedef struct flipper {
    unsigned char *buf;
    size_t len;
    atomic_bool stop;
} flipper;

static void *flip(void *arg)
{
    flipper *f = arg;
    for (unsigned v = 0; !atomic_load_explicit(&f->stop, memory_order_relaxed); v++)
        for (size_t i = 0; i < f->len; i++)
            __atomic_store_n(&f->buf[i], (unsigned char)(v + i), __ATOMIC_RELAXED);
    return NULL;
}

Test(hash64, the_copy_is_what_was_hashed_while_the_source_changes, .timeout = 30)
{
    static unsigned char src[64 + 31], dst[64 + 31];
    flipper f = {.buf = src, .len = sizeof src};
    atomic_init(&f.stop, false);
    pthread_t th;
    cr_assert_eq(pthread_create(&th, NULL, flip, &f), 0);
    uint64_t bad = 0, runs = 0, t0 = di_mono_ns();
    while (di_mono_ns() - t0 < 1500000000ull && bad == 0) {
        uint64_t h = di_hash64_copy(dst, src, sizeof src, 7);
        bad += h != di_hash64(dst, sizeof dst, 7);
        runs++;
    }
    atomic_store(&f.stop, true);
    pthread_join(th, NULL);
    cr_assert_eq(bad, 0, "after %llu copies the copy differs from what was hashed",
                 (unsigned long long)runs);
}
