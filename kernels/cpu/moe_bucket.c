/* moe_bucket.c: the C twin of the device bucketing of moe_experts' pairs (moe_bucket.h). */
#include "kernels/cpu/moe_bucket.h"

#include <string.h>

di_status kern_moe_bucket(const int32_t *ids, uint32_t n_rows, uint32_t top_k, uint32_t n_experts,
                          uint32_t cap, kern_moe_buckets *out, di_error *err)
{
    if (cap == 0 || top_k == 0)
        return di_fail(err, DI_EINVAL, "moe bucket: cap %u, top_k %u (both must be positive)",
                       cap, top_k);
    uint32_t P = n_rows * top_k;
    for (uint32_t i = 0; i < P; i++)
        if (ids[i] < 0 || (uint32_t)ids[i] >= n_experts)
            return di_fail(err, DI_EINVAL, "moe bucket: ids[%u] = %d outside [0, %u)", i, ids[i],
                           n_experts);
    memset(out->count, 0, (size_t)n_experts * sizeof(uint32_t));
    for (uint32_t i = 0; i < P; i++)
        out->count[ids[i]]++;
    out->start[0] = 0;
    for (uint32_t e = 0; e < n_experts; e++)
        out->start[e + 1] = out->start[e] + out->count[e];
    /* pairs ascending inside a bucket: a pair's place is the pairs of its expert before it */
    for (uint32_t i = 0; i < P; i++) {
        uint32_t rank = 0;
        for (uint32_t j = 0; j < i; j++)
            rank += ids[j] == ids[i];
        out->pair[out->start[ids[i]] + rank] = (int32_t)i;
    }
    /* a row's outputs in bucket order: walk the buckets and append to the row */
    for (uint32_t t = 0; t < n_rows; t++) {
        uint32_t seen = 0;
        for (uint32_t q = 0; q < P; q++)
            if ((uint32_t)out->pair[q] / top_k == t)
                out->pos[(size_t)t * top_k + seen++] = (int32_t)q;
    }
    out->n_groups = 0;
    for (uint32_t e = 0; e < n_experts; e++)
        for (uint32_t at = 0; at < out->count[e]; at += cap) {
            uint32_t g = out->n_groups++, left = out->count[e] - at;
            out->group_expert[g] = e;
            out->group_start[g] = out->start[e] + at;
            out->group_rows[g] = left < cap ? left : cap;
        }
    return DI_OK;
}
