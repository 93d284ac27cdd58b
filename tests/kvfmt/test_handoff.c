/* The handoff object (kv_handoff.h): written and read back section by section, and refused
 * with DI_ECORRUPT when any byte, the key, the model or the size is wrong. */
#include <criterion/criterion.h>
#include <stdlib.h>
#include <string.h>

#include "common/kvfmt/kv_handoff.h"

/* A small geometry of its own: this test links the formats module alone. */
static kv_geometry geom(void)
{
    kv_geometry g = {.block_tokens = 128, .head_dim = 64, .index_head_dim = 32, .window = 16,
                     .ring_positions = 20, .n_layers = 3, .n_draft_stages = 1, .n_owners = 2,
                     .owner_layer = {0, 2}, .owner_ratio = {4, 1}, .yoco_boundary = 2,
                     .model_id = 0x1234abcdull};
    di_error err;
    cr_assert_eq(kv_geometry_validate(&g, &err), DI_OK, "%s", err.msg);
    return g;
}

typedef struct fixture {
    kv_geometry g;
    int32_t tokens[400];
    int32_t drafts[3];
    uint8_t keys[3][32];
    uint8_t *partial, *slot, exec[13];
    kv_handoff h;
    uint8_t key[32];
} fixture;

static void fill(uint8_t *p, size_t n, uint32_t seed)
{
    for (size_t i = 0; i < n; i++)
        p[i] = (uint8_t)(seed * 131 + i * 7 + (i >> 8));
}

/* 300 prompt tokens and 1 output: 2 full blocks in the store, 44 positions inline. */
static fixture *make(void)
{
    fixture *f = calloc(1, sizeof(*f));
    f->g = geom();
    for (int i = 0; i < 400; i++)
        f->tokens[i] = 1000 + i;
    f->drafts[0] = 7;
    f->drafts[1] = 8;
    fill(&f->keys[0][0], sizeof f->keys, 3);
    f->partial = malloc(kv_block_payload_bytes(&f->g));
    f->slot = malloc(kv_state_slot_bytes(&f->g));
    fill(f->partial, kv_block_payload_bytes(&f->g), 5);
    fill(f->slot, kv_state_slot_bytes(&f->g), 9);
    fill(f->exec, sizeof f->exec, 11);
    fill(f->key, 32, 13);
    f->h = (kv_handoff){.prompt_len = 300, .n_output = 1, .kv_positions = 300, .n_drafts = 2,
                        .exec_bytes = sizeof f->exec, .tokens = f->tokens, .drafts = f->drafts,
                        .block_keys = &f->keys[0][0], .partial = f->partial, .slot = f->slot,
                        .exec = f->exec};
    return f;
}

static void done(fixture *f)
{
    free(f->partial);
    free(f->slot);
    free(f);
}

static uint8_t *write_obj(fixture *f, size_t *bytes)
{
    *bytes = kv_handoff_bytes(&f->g, &f->h);
    cr_assert_gt(*bytes, 0);
    uint8_t *obj = malloc(*bytes);
    di_error err;
    cr_assert_eq(kv_handoff_write(&f->g, &f->h, f->key, obj, *bytes, &err), DI_OK, "%s",
                 err.msg);
    return obj;
}

Test(kv_handoff, round_trip_gives_every_section_back)
{
    fixture *f = make();
    size_t n;
    uint8_t *obj = write_obj(f, &n);
    size_t want = 128 + 64 + 301 * 4 + 4 /* pad */ + 8 + 2 * 32 + kv_block_payload_bytes(&f->g) +
                  kv_state_slot_bytes(&f->g) + 16;
    cr_assert_eq(n, want, "%zu bytes, want %zu", n, want);
    kv_handoff r;
    di_error err;
    cr_assert_eq(kv_handoff_read(&f->g, obj, n, f->key, &r, &err), DI_OK, "%s", err.msg);
    cr_assert_eq(r.prompt_len, 300);
    cr_assert_eq(r.n_output, 1);
    cr_assert_eq(r.kv_positions, 300);
    cr_assert_eq(memcmp(r.tokens, f->tokens, 301 * 4), 0);
    cr_assert_eq(r.n_drafts, 2);
    cr_assert_eq(memcmp(r.drafts, f->drafts, 8), 0);
    cr_assert_eq(memcmp(r.block_keys, f->keys, 64), 0);
    cr_assert_eq(memcmp(r.partial, f->partial, kv_block_payload_bytes(&f->g)), 0);
    cr_assert_eq(memcmp(r.slot, f->slot, kv_state_slot_bytes(&f->g)), 0);
    cr_assert_eq(r.exec_bytes, 13);
    cr_assert_eq(memcmp(r.exec, f->exec, 13), 0);
    /* the same inputs give the same bytes (padding is zero) */
    size_t n2;
    uint8_t *again = write_obj(f, &n2);
    cr_assert_eq(memcmp(obj, again, n), 0);
    free(again);
    free(obj);
    done(f);
}

Test(kv_handoff, a_prompt_on_a_block_boundary_has_no_partial_block)
{
    fixture *f = make();
    f->h.prompt_len = 256;
    f->h.kv_positions = 256;
    f->h.partial = NULL;
    f->h.n_drafts = 0;
    f->h.exec_bytes = 0;
    size_t n;
    uint8_t *obj = write_obj(f, &n);
    kv_handoff r;
    di_error err;
    cr_assert_eq(kv_handoff_read(&f->g, obj, n, f->key, &r, &err), DI_OK, "%s", err.msg);
    cr_assert_null(r.partial);
    cr_assert_null(r.drafts);
    cr_assert_null(r.exec);
    cr_assert_not_null(r.block_keys);
    free(obj);
    done(f);
}

Test(kv_handoff, every_flipped_byte_is_caught)
{
    fixture *f = make();
    f->h.exec_bytes = 0;
    f->h.prompt_len = 100; /* no full block: a smaller object, every byte tried */
    f->h.kv_positions = 100;
    size_t n;
    uint8_t *obj = write_obj(f, &n);
    kv_handoff r;
    di_error err;
    for (size_t i = 0; i < n; i += 1 + i / 512) {
        obj[i] ^= 0x20;
        cr_assert_eq(kv_handoff_read(&f->g, obj, n, f->key, &r, &err), DI_ECORRUPT,
                     "byte %zu flipped and accepted", i);
        obj[i] ^= 0x20;
    }
    cr_assert_eq(kv_handoff_read(&f->g, obj, n, f->key, &r, &err), DI_OK, "%s", err.msg);
    free(obj);
    done(f);
}

Test(kv_handoff, wrong_key_model_size_or_ring_are_refused)
{
    fixture *f = make();
    size_t n;
    uint8_t *obj = write_obj(f, &n);
    kv_handoff r;
    di_error err;
    uint8_t other[32];
    memcpy(other, f->key, 32);
    other[5] ^= 1;
    cr_assert_eq(kv_handoff_read(&f->g, obj, n, other, &r, &err), DI_ECORRUPT);
    cr_assert(strstr(err.msg, "another key"), "%s", err.msg);
    kv_geometry g2 = f->g;
    g2.model_id ^= 1;
    cr_assert_eq(kv_handoff_read(&g2, obj, n, f->key, &r, &err), DI_ECORRUPT);
    cr_assert(strstr(err.msg, "model"), "%s", err.msg);
    g2 = f->g;
    g2.ring_positions = 24;
    cr_assert_eq(kv_handoff_read(&g2, obj, n, f->key, &r, &err), DI_ECORRUPT);
    cr_assert_eq(kv_handoff_read(&f->g, obj, n - 8, f->key, &r, &err), DI_ECORRUPT);
    cr_assert_eq(kv_handoff_read(&f->g, obj, 100, f->key, &r, &err), DI_ECORRUPT);
    cr_assert_eq(kv_handoff_read(&f->g, obj + 4, n - 8, f->key, &r, &err), DI_EINVAL,
                 "unaligned");
    free(obj);
    done(f);
}

Test(kv_handoff, bad_counts_and_small_buffers_are_refused_on_write)
{
    fixture *f = make();
    uint8_t buf[256];
    di_error err;
    kv_handoff h = f->h;
    h.kv_positions = 302;
    cr_assert_eq(kv_handoff_write(&f->g, &h, f->key, buf, sizeof buf, &err), DI_EINVAL);
    cr_assert_eq(kv_handoff_bytes(&f->g, &h), 0);
    h = f->h;
    h.prompt_len = 0;
    cr_assert_eq(kv_handoff_write(&f->g, &h, f->key, buf, sizeof buf, &err), DI_EINVAL);
    h = f->h;
    h.n_drafts = KV_HANDOFF_MAX_DRAFTS + 1;
    cr_assert_eq(kv_handoff_write(&f->g, &h, f->key, buf, sizeof buf, &err), DI_EINVAL);
    h = f->h;
    h.partial = NULL;
    cr_assert_eq(kv_handoff_write(&f->g, &h, f->key, buf, sizeof buf, &err), DI_EINVAL);
    cr_assert(strstr(err.msg, "missing"), "%s", err.msg);
    memset(buf, 0x77, sizeof buf);
    cr_assert_eq(kv_handoff_write(&f->g, &f->h, f->key, buf, sizeof buf, &err), DI_EINVAL);
    cr_assert(strstr(err.msg, "buffer of 256 bytes"), "%s", err.msg);
    cr_assert_eq(buf[0], 0x77, "nothing written on failure");
    done(f);
}
