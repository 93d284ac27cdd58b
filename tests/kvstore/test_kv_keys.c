/* Chain keys (common/kvfmt/kv_keys.h). Expected digests were computed independently with
 * Python's hashlib:
 *   h = b'\0' * 32
 *   h = sha256(h + struct.pack('<Q', model_id) + struct.pack('<128i', *tokens)).digest()
 * with model_id 0x7634312d666c7368 (v41-flash), block 0 = 0..127 and block 1 = 1000 + 7*i
 * with token 5 of block 1 set to -5; and sha256(b'di-handoff' + pack('<Q', mid) + b'req-42'). */
#include <criterion/criterion.h>
#include <string.h>

#include "common/kvfmt/kv_keys.h"
#include "common/model/config.h"
#include "common/util/hash64.h"

#define MID 0x7634312d666c7368ull

static void two_blocks(int32_t *t)
{
    for (int i = 0; i < 128; i++) {
        t[i] = i;
        t[128 + i] = 1000 + 7 * i;
    }
    t[128 + 5] = -5;
}

static void assert_hex(const kvkey *k, const char *want)
{
    char hex[65];
    kvkey_hex(k, hex);
    cr_assert_str_eq(hex, want);
}

Test(kv_keys, chain_matches_independent_sha256)
{
    int32_t t[256 + 50];
    two_blocks(t);
    for (int i = 0; i < 50; i++)
        t[256 + i] = 9;
    kvkey keys[4];
    size_t n = 99;
    di_error e;
    cr_assert_eq(kvkey_chain(MID, 128, t, 306, keys, 4, &n, &e), DI_OK, "%s", e.msg);
    cr_assert_eq(n, 2, "the partial last block of 50 tokens has no key");
    assert_hex(&keys[0], "87237c42f245038debfc8a3b5450fc42ead9b0c81c0af1cdcf4a8937a1c7d6c3");
    assert_hex(&keys[1], "099236ac8f1ffec66a9b16b2a1dd66bcd74e3044ac949ec7228973c31a0c1c14");

    kvkey one;
    cr_assert_eq(kvkey_block(&keys[0], MID, t + 128, 128, &one, &e), DI_OK);
    cr_assert_eq(memcmp(&one, &keys[1], 32), 0, "block step equals the chain");
}

Test(kv_keys, model_id_and_single_token_change_the_key)
{
    int32_t t[128];
    for (int i = 0; i < 128; i++)
        t[i] = 7;
    kvkey a, b;
    cr_assert_eq(kvkey_block(NULL, 1, t, 128, &a, NULL), DI_OK);
    assert_hex(&a, "4f8837e61708590ad15c6e4d1c4027cb37768df9fa7b4463144bc4c46455c7d4");
    cr_assert_eq(kvkey_block(NULL, 2, t, 128, &b, NULL), DI_OK);
    cr_assert_neq(memcmp(&a, &b, 32), 0);
    t[127] = 8;
    cr_assert_eq(kvkey_block(NULL, 1, t, 128, &b, NULL), DI_OK);
    cr_assert_neq(memcmp(&a, &b, 32), 0);
}

Test(kv_keys, max_keys_truncates_and_short_prompts_have_none)
{
    int32_t t[256];
    two_blocks(t);
    kvkey keys[2];
    memset(keys, 0xee, sizeof(keys));
    size_t n = 5;
    cr_assert_eq(kvkey_chain(MID, 128, t, 256, keys, 1, &n, NULL), DI_OK);
    cr_assert_eq(n, 1);
    assert_hex(&keys[0], "87237c42f245038debfc8a3b5450fc42ead9b0c81c0af1cdcf4a8937a1c7d6c3");
    cr_assert_eq(keys[1].b[0], 0xee, "nothing written past max_keys");
    cr_assert_eq(kvkey_chain(MID, 128, t, 127, keys, 2, &n, NULL), DI_OK);
    cr_assert_eq(n, 0);
}

Test(kv_keys, handoff_key_and_hex_round_trip)
{
    kvkey k, back;
    cr_assert_eq(kvkey_handoff(MID, "req-42", &k, NULL), DI_OK);
    assert_hex(&k, "96b326cccfd41d75fc94bb075e323b71585b5c56de40a0028d16c3b645920a26");
    cr_assert_eq(kvkey_parse_hex("96B326CCCFD41D75FC94BB075E323B71585B5C56DE40A0028D16C3B645920A26",
                                 &back, NULL),
                 DI_OK);
    cr_assert_eq(memcmp(&k, &back, 32), 0);
}

Test(kv_keys, bad_arguments_are_rejected_with_reasons)
{
    di_error e;
    kvkey k;
    memset(&k, 0x5a, sizeof(k));
    kvkey before = k;
    cr_assert_eq(kvkey_parse_hex("abc", &k, &e), DI_EINVAL);
    cr_assert(strstr(e.msg, "too short"), "%s", e.msg);
    cr_assert_eq(kvkey_parse_hex("zz6b326cccfd41d75fc94bb075e323b71585b5c56de40a0028d16c3b645920a26",
                                 &k, &e),
                 DI_EINVAL);
    cr_assert(strstr(e.msg, "character 0"), "%s", e.msg);
    cr_assert_eq(
        kvkey_parse_hex("96b326cccfd41d75fc94bb075e323b71585b5c56de40a0028d16c3b645920a2600", &k, &e),
        DI_EINVAL);
    cr_assert_eq(memcmp(&k, &before, 32), 0, "out untouched on failure");
    cr_assert_eq(kvkey_block(NULL, 1, NULL, 128, &k, &e), DI_EINVAL);
    size_t n;
    cr_assert_eq(kvkey_chain(1, 0, NULL, 0, NULL, 0, &n, &e), DI_EINVAL);
    cr_assert(strstr(e.msg, "block_tokens"), "%s", e.msg);
    cr_assert_eq(kvkey_handoff(1, "", &k, &e), DI_EINVAL);
}

Test(kv_keys, hash_while_copying_equals_hash_of_the_bytes)
{
    uint8_t src[400], dst[400];
    for (int i = 0; i < 400; i++)
        src[i] = (uint8_t)(i * 37 + 11);
    for (size_t len = 0; len <= 300; len++)
        for (size_t off = 0; off < 3; off++) {
            memset(dst, 0xcc, sizeof(dst));
            uint64_t h = di_hash64_copy(dst + off, src + off, len, 99 + len);
            cr_assert_eq(h, di_hash64(src + off, len, 99 + len), "len %zu off %zu", len, off);
            cr_assert_eq(memcmp(dst + off, src + off, len), 0, "len %zu off %zu", len, off);
            cr_assert_eq(dst[off + len], 0xcc, "nothing written past len");
        }
}

Test(kv_keys, copy_verify_checks_what_it_copied)
{
    kv_geometry g;
    kv_geometry_v41_flash(5, &g);
    enum { N = KV_HEADER_BYTES + 1000 };
    uint8_t src[N], dst[N];
    for (int i = KV_HEADER_BYTES; i < N; i++)
        src[i] = (uint8_t)i;
    kvkey k, other;
    memset(&k, 7, sizeof(k));
    memset(&other, 8, sizeof(other));
    kv_header h;
    kv_header_fill(&h, KV_BLOCK_MAGIC, &g, k.b, 128, 0, src + KV_HEADER_BYTES, N - KV_HEADER_BYTES);
    memcpy(src, &h, sizeof(h));
    di_error e;
    cr_assert_eq(kvkey_object_copy_verify(KVKEY_BLOCK, &k, dst, src, N, &g, &e), DI_OK, "%s",
                 e.msg);
    cr_assert_eq(memcmp(dst, src, N), 0);
    cr_assert_eq(kvkey_object_verify(KVKEY_BLOCK, &k, dst, N, &g, &e), DI_OK);
    cr_assert_eq(kvkey_object_copy_verify(KVKEY_BLOCK, &other, dst, src, N, &g, &e), DI_ECORRUPT);
    cr_assert(strstr(e.msg, "another key"), "%s", e.msg);
    cr_assert_eq(kvkey_object_copy_verify(KVKEY_WINDOW, &k, dst, src, N, &g, &e), DI_ECORRUPT);
    cr_assert(strstr(e.msg, "magic"), "%s", e.msg);
    src[KV_HEADER_BYTES + 500] ^= 4;
    cr_assert_eq(kvkey_object_copy_verify(KVKEY_BLOCK, &k, dst, src, N, &g, &e), DI_ECORRUPT);
    cr_assert(strstr(e.msg, "checksum"), "%s", e.msg);
    cr_assert_eq(kvkey_object_verify(KVKEY_BLOCK, &k, src, N, &g, &e), DI_ECORRUPT);
    cr_assert_eq(kvkey_object_copy_verify(KVKEY_BLOCK, &k, dst, src, 100, &g, &e), DI_ECORRUPT);
}
