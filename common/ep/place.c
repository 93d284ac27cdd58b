/* place.c: logical -> physical expert maps (place.h). */
#include "common/ep/place.h"

#include <stdlib.h>
#include <string.h>

di_status ep_placement_build(const eplb_layout *l, uint32_t n_experts, ep_placement *out,
                             di_error *err)
{
    di_status st = eplb_layout_check(l, n_experts, false, true, err);
    if (st != DI_OK)
        return st;
    size_t P = (size_t)l->num_gpus * l->slots_per_gpu;
    ep_placement p = {.n_ranks = l->num_gpus, .slots_per_rank = l->slots_per_gpu,
                      .n_experts = n_experts};
    p.slot_expert = malloc(P * sizeof(int32_t));
    p.copy_start = calloc((size_t)n_experts + 1, sizeof(uint32_t));
    p.copies = malloc(P * sizeof(uint32_t));
    uint32_t *fill = calloc(n_experts, sizeof(uint32_t));
    if (!p.slot_expert || !p.copy_start || !p.copies || !fill) {
        free(fill);
        ep_placement_free(&p);
        return di_fail(err, DI_ENOMEM, "expert placement of %zu slots", P);
    }
    memcpy(p.slot_expert, l->slot_expert, P * sizeof(int32_t));
    for (size_t s = 0; s < P; s++)
        p.copy_start[l->slot_expert[s] + 1]++;
    for (uint32_t e = 0; e < n_experts; e++)
        p.copy_start[e + 1] += p.copy_start[e];
    for (size_t s = 0; s < P; s++) {
        uint32_t e = (uint32_t)l->slot_expert[s];
        p.copies[p.copy_start[e] + fill[e]++] = (uint32_t)s;
    }
    free(fill);
    *out = p;
    return DI_OK;
}

void ep_placement_free(ep_placement *p)
{
    if (!p)
        return;
    free(p->slot_expert);
    free(p->copy_start);
    free(p->copies);
    memset(p, 0, sizeof *p);
}
