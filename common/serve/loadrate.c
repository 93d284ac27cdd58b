/* loadrate.c: see loadrate.h. */
#include "common/serve/loadrate.h"

#include <string.h>

/* The second of now_ns, shifted by one so that 0 marks an empty bucket. */
static uint64_t second_of(uint64_t now_ns)
{
    return now_ns / 1000000000ull + 1;
}

void loadrate_init(loadrate *r)
{
    memset(r, 0, sizeof *r);
}

void loadrate_add(loadrate *r, uint64_t now_ns, double amount, uint64_t busy_ns)
{
    if (!busy_ns)
        return;
    uint64_t sec = second_of(now_ns);
    loadrate_bucket *b = &r->b[sec % LOADRATE_WINDOW_S];
    if (b->second != sec)
        *b = (loadrate_bucket){.second = sec};
    b->amount += amount;
    b->busy_ns += busy_ns;
}

double loadrate_per_s(loadrate *r, uint64_t now_ns)
{
    uint64_t sec = second_of(now_ns), busy = 0;
    double amount = 0;
    for (uint32_t i = 0; i < LOADRATE_WINDOW_S; i++) {
        const loadrate_bucket *b = &r->b[i];
        if (b->second && b->second <= sec && sec - b->second < LOADRATE_WINDOW_S) {
            amount += b->amount;
            busy += b->busy_ns;
        }
    }
    if (busy)
        r->last = amount / ((double)busy / 1e9);
    return r->last;
}
