#include "common/engine/graphs.h"

#include <stdlib.h>

di_status graph_sizes_init(graph_sizes *out, uint32_t max_num_seqs, uint32_t nextn,
                           uint32_t interval, di_error *err)
{
    if (max_num_seqs == 0)
        return di_fail(err, DI_EINVAL, "max_num_seqs must be at least 1");
    if (interval == 0)
        return di_fail(err, DI_EINVAL, "graph interval must be at least 1");
    uint64_t max_rows = (uint64_t)max_num_seqs * (1ull + nextn);
    if (max_rows > (1u << 24))
        return di_fail(err, DI_EINVAL, "max_num_seqs * (1 + nextn) = %llu rows is too large",
                       (unsigned long long)max_rows);
    size_t cap = 64 + (size_t)(max_rows / interval) + 1;
    uint32_t *s = malloc(cap * sizeof(*s));
    if (!s)
        return di_fail(err, DI_ENOMEM, "out of memory for graph sizes");
    size_t n = 0;
    for (uint64_t p = 1; p <= interval && p < max_rows; p *= 2)
        s[n++] = (uint32_t)p;
    uint64_t next = ((n ? s[n - 1] : 0) / interval + 1) * interval;
    for (uint64_t m = next; m < max_rows; m += interval)
        s[n++] = (uint32_t)m;
    s[n++] = (uint32_t)max_rows;
    out->sizes = s;
    out->count = n;
    out->max_rows = (uint32_t)max_rows;
    return DI_OK;
}

void graph_sizes_free(graph_sizes *g)
{
    if (!g)
        return;
    free(g->sizes);
    g->sizes = NULL;
    g->count = 0;
}

uint32_t graph_sizes_select(const graph_sizes *g, uint32_t rows)
{
    if (rows > g->max_rows)
        return 0;
    size_t lo = 0, hi = g->count; /* first size >= rows */
    while (lo < hi) {
        size_t mid = (lo + hi) / 2;
        if (g->sizes[mid] < rows)
            lo = mid + 1;
        else
            hi = mid;
    }
    return g->sizes[lo];
}
