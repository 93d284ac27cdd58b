/* Engram's compressed-token map (MODEL.md §2.9 step 1) against the same normalisation done in
 * node (engram_map.json, written by gen_vectors.js with String.prototype.normalize, and checked
 * there against HF tokenizers' own normalizers) over the whole DeepSeek V3 vocabulary, plus
 * hand-checked keys and the API's refusals. */
#include <criterion/criterion.h>
#include <stdlib.h>
#include <string.h>

#include "tests/tokenizer/tok_test_util.h"

static tok_engram_map *build_ok(const tok_tokenizer *t, int32_t vocab, int32_t pad)
{
    tok_engram_map *m = NULL;
    di_error e;
    cr_assert_eq(tok_engram_map_build(t, vocab, pad, &m, &e), DI_OK, "%s", e.msg);
    return m;
}

Test(engram, map_matches_node_for_every_id)
{
    tok_tokenizer *t = tt_deepseek();
    json_t *ref = tt_load_json("tests/tokenizer/engram_map.json");
    int32_t n = (int32_t)json_integer_value(json_object_get(ref, "tokenizer_vocab_size"));
    int32_t nc = (int32_t)json_integer_value(json_object_get(ref, "compressed_vocab_size"));
    cr_assert_eq(n, tok_vocab_size(t));
    /* rebuild the reference map: ids not listed in dups take the next new compressed id */
    int32_t *want = malloc((size_t)n * sizeof *want);
    json_t *dups = json_object_get(ref, "dups");
    size_t d = 0;
    int32_t next = 0;
    for (int32_t id = 0; id < n; id++) {
        json_t *p = json_array_get(dups, d);
        if (p && json_integer_value(json_array_get(p, 0)) == id) {
            want[id] = (int32_t)json_integer_value(json_array_get(p, 1));
            d++;
        } else {
            want[id] = next++;
        }
    }
    cr_assert_eq(next, nc);
    /* the generator also ran HF's own normalizers (the reference Engram code's): same map */
    cr_assert_eq(json_array_size(json_object_get(ref, "hf_differ")), 0);
    tok_engram_map *m = build_ok(t, 0, 2);
    cr_assert_eq(m->vocab_size, n);
    cr_assert_eq(m->compressed_vocab_size, nc, "%d compressed ids, node has %d",
                 m->compressed_vocab_size, nc);
    size_t bad = 0;
    for (int32_t id = 0; id < n; id++) {
        if (m->map[id] == want[id])
            continue;
        if (bad++ < 10) {
            size_t len = 0;
            const char *s = tok_token_str(t, id, &len);
            cr_log_error("id %d '%.*s': compressed %d, node %d", id, (int)len, s, m->map[id],
                         want[id]);
        }
    }
    cr_assert_eq(bad, 0, "%zu ids differ from node", bad);
    cr_log_info("Engram map: %d ids -> %d compressed ids, same as node", n, nc);
    tok_engram_map_free(m);
    free(want);
    json_decref(ref);
    tok_free(t);
}

/* Keys worked out by hand from the normalisation steps. */
Test(engram, hand_checked_keys)
{
    tok_tokenizer *t = tt_deepseek();
    tok_engram_map *m = build_ok(t, 0, 2);
    static const struct {
        const char *a, *b; /* two stored forms expected to share (or not) a compressed id */
        bool same;
    } ROWS[] = {
        {"ĠThe", "the", true},  /* lowercase, leading space stripped */
        {"ĠThe", "ĠTHE", true}, /* lowercase */
        {"ĠÃ©", "e", true},     /* " é": NFD, the accent (Mn) dropped, stripped */
        {"ï¬ģ", "fi", true},    /* U+FB01 LATIN SMALL LIGATURE FI: NFKC */
        {"Ġ", "ĠĠ", true},      /* " " kept as " "; "  " collapses to " " */
        {"Ġ", "Ċ", true},       /* "\n" collapses to " " */
        {"ĉ", "ĊĊ", true},      /* "\t" and "\n\n" too */
        {"the", "then", false},
    };
    for (size_t r = 0; r < sizeof ROWS / sizeof ROWS[0]; r++) {
        int32_t a = tok_token_id(t, ROWS[r].a, strlen(ROWS[r].a));
        int32_t b = tok_token_id(t, ROWS[r].b, strlen(ROWS[r].b));
        cr_assert(a >= 0 && b >= 0, "row %zu: tokens exist", r);
        cr_assert_eq(m->map[a] == m->map[b], ROWS[r].same, "row %zu: '%s' %d vs '%s' %d", r,
                     ROWS[r].a, m->map[a], ROWS[r].b, m->map[b]);
    }
    cr_assert_eq(m->map[0], 0);
    cr_assert_eq(m->map[1], 1);
    cr_assert_eq(m->map[2], 2, "the pad id maps to itself");
    tok_engram_map_free(m);
    tok_free(t);
}

Test(engram, model_vocab_beyond_tokenizer_maps_to_pad)
{
    tok_tokenizer *t = tt_deepseek();
    tok_engram_map *m = build_ok(t, 129280, 2);
    cr_assert_eq(m->vocab_size, 129280);
    cr_assert_eq(m->tokenizer_vocab_size, 128815);
    for (int32_t id = 128815; id < 129280; id++)
        cr_assert_eq(m->map[id], m->map[2], "id %d", id);
    json_t *j = NULL;
    di_error e;
    cr_assert_eq(tok_engram_map_to_json(m, &j, &e), DI_OK);
    cr_assert_eq(json_integer_value(json_object_get(j, "vocab_size")), 129280);
    cr_assert_eq(json_integer_value(json_object_get(j, "compressed_vocab_size")),
                 m->compressed_vocab_size);
    cr_assert_eq(json_integer_value(json_object_get(j, "pad_token_id")), 2);
    cr_assert_eq(json_array_size(json_object_get(j, "map")), 129280);
    json_decref(j);
    tok_engram_map_free(m);
    tok_free(t);
}

Test(engram, refusals)
{
    tok_tokenizer *t = tt_deepseek();
    tok_engram_map *m = (tok_engram_map *)0x1;
    di_error e;
    cr_assert_eq(tok_engram_map_build(t, 100, 2, &m, &e), DI_EINVAL);
    cr_assert(strstr(e.msg, "vocab_size 100") != NULL, "%s", e.msg);
    cr_assert_eq(tok_engram_map_build(t, 0, -1, &m, &e), DI_EINVAL);
    cr_assert_eq(tok_engram_map_build(t, 0, 128815, &m, &e), DI_EINVAL);
    cr_assert(strstr(e.msg, "pad_token_id 128815") != NULL, "%s", e.msg);
    cr_assert_eq(tok_engram_map_build(NULL, 0, 2, &m, &e), DI_EINVAL);
    cr_assert_eq(m, (tok_engram_map *)0x1, "output untouched");
    tok_engram_map_free(NULL);
    tok_free(t);
}
