#include <criterion/criterion.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>

#include "common/kvfmt/kv_layout.h"
#include "common/model/config.h"
#include "common/util/hash64.h"

Test(kv_layout, v41_flash_sizes_match_the_explainer)
{
    kv_geometry g;
    kv_geometry_v41_flash(5, &g);
    di_error e;
    cr_assert_eq(kv_geometry_validate(&g, &e), DI_OK, "%s", e.msg);
    cr_assert_eq(kv_main_entry_bytes(&g), 288);
    cr_assert_eq(kv_index_entry_bytes(&g), 68);
    cr_assert_eq(kv_ring_entry_bytes(&g), 528);
    cr_assert_eq(kv_block_payload_bytes(&g), 113920);
    cr_assert_eq(kv_block_bytes(&g), 114048);
    cr_assert_eq(kv_block_bytes(&g) / 128, 891, "891 bytes per token");
    cr_assert_eq(g.ring_positions, 134);
    cr_assert_eq(kv_ring_bytes(&g) * 20, 1415040, "the explainer's stored region");
    /* 129 blocks for 16,389 tokens; position 16,389 in ring slot 41 */
    cr_assert_eq(kv_blocks_for_tokens(&g, 16389), 129);
    cr_assert_eq(kv_ring_slot(&g, 16389), 41);
    cr_assert_eq(kv_blocks_for_tokens(&g, 50000), 391);
    /* the whole state slot is "about 3.1 MB" */
    size_t slot = kv_state_slot_bytes(&g);
    cr_assert(slot > 3000000 && slot < 3200000, "state slot %zu bytes", slot);
}

Test(kv_layout, owner_regions_tile_the_block_without_overlap)
{
    kv_geometry g;
    kv_geometry_v41_flash(5, &g);
    size_t expect = KV_HEADER_BYTES;
    for (uint32_t k = 0; k < g.n_owners; k++) {
        uint32_t n = kv_owner_entries_per_block(&g, k);
        cr_assert_eq(n, g.owner_ratio[k] == 2 ? 64u : 128u);
        cr_assert_eq(kv_owner_main_offset(&g, k, 0), expect);
        expect += (size_t)n * 288;
        cr_assert_eq(kv_owner_index_offset(&g, k, 0), expect);
        expect += (size_t)n * 68;
    }
    cr_assert_eq(expect, kv_block_bytes(&g));
    /* entry 8,194 of layer 2 lands in block 128 at offset 2 (explainer Pass 2) */
    cr_assert_eq(8194 / kv_owner_entries_per_block(&g, 0), 128);
    cr_assert_eq(8194 % kv_owner_entries_per_block(&g, 0), 2);
}

Test(kv_layout, ring_size_rule)
{
    cr_assert_eq(kv_ring_positions_for(128, 5, 0), 134);
    cr_assert_eq(kv_ring_positions_for(128, 5, 1), 134, "backtracking clamps up to nextn+1");
    cr_assert_eq(kv_ring_positions_for(128, 3, 10), 138);
    cr_assert_eq(kv_ring_positions_for(8, 0, 0), 9);
}

Test(kv_layout, validate_rejects_bad_geometry)
{
    kv_geometry g;
    di_error e;
    kv_geometry_v41_flash(5, &g);
    g.owner_ratio[1] = 3;
    cr_assert_eq(kv_geometry_validate(&g, &e), DI_EINVAL);
    cr_assert(strstr(e.msg, "ratio 3") != NULL, "%s", e.msg);
    kv_geometry_v41_flash(5, &g);
    g.ring_positions = 128;
    cr_assert_eq(kv_geometry_validate(&g, &e), DI_EINVAL);
    kv_geometry_v41_flash(5, &g);
    g.owner_layer[2] = 2;
    cr_assert_eq(kv_geometry_validate(&g, &e), DI_EINVAL);
    kv_geometry_v41_flash(5, &g);
    g.head_dim = 500;
    cr_assert_eq(kv_geometry_validate(&g, &e), DI_EINVAL);
}

Test(kv_layout, header_roundtrip_and_corruption_detected)
{
    kv_geometry g;
    kv_geometry_v41_flash(5, &g);
    size_t n = kv_block_bytes(&g);
    unsigned char *obj = malloc(n);
    for (size_t i = 0; i < n; i++)
        obj[i] = (unsigned char)(i * 131 + 7);
    uint8_t key[32];
    memset(key, 0xab, sizeof(key));
    kv_header hdr;
    kv_header_fill(&hdr, KV_BLOCK_MAGIC, &g, key, 128, 256, obj + KV_HEADER_BYTES,
                   n - KV_HEADER_BYTES);
    memcpy(obj, &hdr, sizeof(hdr));
    di_error e;
    cr_assert_eq(kv_object_verify(obj, n, KV_BLOCK_MAGIC, &g, &e), DI_OK, "%s", e.msg);
    cr_assert_eq(kv_object_verify(obj, n, KV_WINDOW_MAGIC, &g, &e), DI_ECORRUPT);
    cr_assert_eq(kv_object_verify(obj, n - 1, KV_BLOCK_MAGIC, &g, &e), DI_ECORRUPT);
    obj[n / 2] ^= 0x10; /* one flipped bit */
    cr_assert_eq(kv_object_verify(obj, n, KV_BLOCK_MAGIC, &g, &e), DI_ECORRUPT);
    cr_assert(strstr(e.msg, "checksum") != NULL, "%s", e.msg);
    obj[n / 2] ^= 0x10;
    /* the checksum covers the header too: a flipped token count, position or key byte fails */
    size_t fields[] = {offsetof(kv_header, token_count), offsetof(kv_header, first_position),
                       offsetof(kv_header, key) + 17, offsetof(kv_header, reserved) + 3};
    for (size_t i = 0; i < sizeof(fields) / sizeof(fields[0]); i++) {
        obj[fields[i]] ^= 0x01;
        cr_assert_eq(kv_object_verify(obj, n, KV_BLOCK_MAGIC, &g, &e), DI_ECORRUPT,
                     "header byte %zu", fields[i]);
        obj[fields[i]] ^= 0x01;
    }
    cr_assert_eq(kv_object_verify(obj, n, KV_BLOCK_MAGIC, &g, &e), DI_OK, "%s", e.msg);
    kv_geometry other = g;
    other.model_id ^= 1;
    cr_assert_eq(kv_object_verify(obj, n, KV_BLOCK_MAGIC, &other, &e), DI_ECORRUPT);
    cr_assert(strstr(e.msg, "model") != NULL, "%s", e.msg);
    free(obj);
}

Test(kv_layout, hash64_sensitive_to_every_byte_and_length)
{
    unsigned char buf[300];
    for (int i = 0; i < 300; i++)
        buf[i] = (unsigned char)i;
    uint64_t base = di_hash64(buf, sizeof(buf), 1);
    for (int i = 0; i < 300; i++) {
        buf[i] ^= 1;
        cr_assert_neq(di_hash64(buf, sizeof(buf), 1), base, "byte %d", i);
        buf[i] ^= 1;
    }
    cr_assert_neq(di_hash64(buf, 299, 1), base);
    cr_assert_neq(di_hash64(buf, 300, 2), base);
    cr_assert_eq(di_hash64(buf, 300, 1), base);
}
