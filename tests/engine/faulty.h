/* faulty.h: an allocator that fails its Nth call (sqlite's do_faultsim_test), for the engine
 * tests: give `(di_alloc){faulty_alloc, faulty_free, &f}` to the code under test. */
#ifndef DI_TESTS_ENGINE_FAULTY_H
#define DI_TESTS_ENGINE_FAULTY_H

#include <stdint.h>
#include <stdlib.h>

typedef struct faulty {
    uint64_t calls;     /* allocations asked for */
    uint64_t fail_at;   /* the call that fails (1-based), 0 = never */
    uint64_t failed;    /* faults injected */
    int64_t live;       /* allocations not yet freed */
} faulty;

static inline void *faulty_alloc(void *ud, size_t n)
{
    faulty *f = ud;
    if (++f->calls == f->fail_at) {
        f->failed++;
        return NULL;
    }
    void *p = malloc(n);
    if (p)
        f->live++;
    return p;
}

static inline void faulty_free(void *ud, void *p)
{
    faulty *f = ud;
    f->live--;
    free(p);
}

#endif
