#include "kvstore/synth.h"

#include <string.h>

void kvsynth_object(void *obj, size_t bytes, uint32_t magic, const kv_geometry *g,
                    const kvkey *key, uint64_t salt, uint32_t token_count,
                    uint64_t first_position)
{
    uint8_t *p = (uint8_t *)obj + KV_HEADER_BYTES;
    size_t n = bytes - KV_HEADER_BYTES;
    uint64_t x;
    memcpy(&x, key->b, sizeof(x));
    x ^= salt * 0x9E3779B97F4A7C15ull;
    for (size_t i = 0; i < n; i += 8) {
        uint64_t z = (x += 0x9E3779B97F4A7C15ull);
        z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
        z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
        z ^= z >> 31;
        memcpy(p + i, &z, n - i < 8 ? n - i : 8);
    }
    kv_header h;
    kv_header_fill(&h, magic, g, key->b, token_count, first_position, p, n);
    memcpy(obj, &h, sizeof(h));
}
