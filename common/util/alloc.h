/* alloc.h: an allocator handed to library code, so a test can make the Nth allocation fail.
 *
 * A module that allocates takes a `const di_alloc *` (NULL means the C library's malloc/free)
 * and calls di_alloc_mem / di_alloc_zero / di_alloc_release instead of malloc and free. A
 * fault-injection test passes an allocator whose alloc returns NULL on its Nth call and checks
 * that the caller returns DI_ENOMEM with nothing leaked (sqlite's do_faultsim_test idea).
 */
#ifndef DI_UTIL_ALLOC_H
#define DI_UTIL_ALLOC_H

#include <stdlib.h>
#include <string.h>

typedef struct di_alloc {
    void *(*alloc)(void *userdata, size_t size); /* size > 0; NULL on failure */
    void (*free)(void *userdata, void *ptr);     /* ptr never NULL */
    void *userdata;                              /* passed to both */
} di_alloc;

/* size bytes, uninitialised; NULL on failure or when size is 0. */
static inline void *di_alloc_mem(const di_alloc *a, size_t size)
{
    if (size == 0)
        return NULL;
    return a ? a->alloc(a->userdata, size) : malloc(size);
}

/* n * size bytes set to zero; NULL on failure, overflow or a zero size. */
static inline void *di_alloc_zero(const di_alloc *a, size_t n, size_t size)
{
    if (size != 0 && n > (size_t)-1 / size)
        return NULL;
    void *p = di_alloc_mem(a, n * size);
    if (p)
        memset(p, 0, n * size);
    return p;
}

/* Frees what di_alloc_mem / di_alloc_zero returned with the same allocator. NULL-safe. */
static inline void di_alloc_release(const di_alloc *a, void *ptr)
{
    if (!ptr)
        return;
    if (a)
        a->free(a->userdata, ptr);
    else
        free(ptr);
}

#endif
