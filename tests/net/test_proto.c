/* The services' messages (common/net/proto): every field carries a comment with its unit or
 * bounds, and the generated code round-trips a prefill request, a handoff manifest and a
 * decode token, and refuses truncated bytes. */
#include <criterion/criterion.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "decode.pb-c.h"
#include "engine.pb-c.h"
#include "prefill.pb-c.h"

/* Counts field lines ("type name = N;") without a trailing comment. */
static int undocumented_fields(const char *file)
{
    char path[1024];
    const char *root = getenv("DI_SOURCE_ROOT");
    snprintf(path, sizeof(path), "%s/common/net/proto/%s", root ? root : ".", file);
    FILE *f = fopen(path, "r");
    cr_assert(f, "cannot open %s", path);
    char line[512];
    int bad = 0, fields = 0;
    while (fgets(line, sizeof(line), f)) {
        const char *eq = strstr(line, " = ");
        const char *semi = strchr(line, ';');
        if (!eq || !semi || semi < eq || strncmp(line, "  ", 2) != 0 || strstr(line, "syntax"))
            continue;
        fields++;
        if (!strstr(semi, "//")) {
            fprintf(stderr, "%s: no comment: %s", file, line);
            bad++;
        }
    }
    fclose(f);
    cr_assert_gt(fields, 3, "%s: no fields found", file);
    return bad;
}

Test(proto, every_field_has_its_unit_or_bounds)
{
    cr_assert_eq(undocumented_fields("engine.proto"), 0);
    cr_assert_eq(undocumented_fields("prefill.proto"), 0);
    cr_assert_eq(undocumented_fields("decode.proto"), 0);
}

Test(proto, prefill_request_and_manifest_round_trip)
{
    uint32_t prompt[3] = {0, 19923, 128804};
    Di__Engine__SamplingParams sp = DI__ENGINE__SAMPLING_PARAMS__INIT;
    sp.temperature = 0.7f;
    sp.has_temperature = 1;
    sp.top_k = -1;
    sp.seed = 0xfeedfacecafebeefull;
    sp.n_logprobs = 5;
    Di__Prefill__PrefillRequest rq = DI__PREFILL__PREFILL_REQUEST__INIT;
    rq.request_id = "req-1";
    rq.n_prompt = 3;
    rq.prompt = prompt;
    rq.sampling = &sp;
    size_t n = di__prefill__prefill_request__get_packed_size(&rq);
    uint8_t *buf = malloc(n);
    cr_assert_eq(di__prefill__prefill_request__pack(&rq, buf), n);
    Di__Prefill__PrefillRequest *back = di__prefill__prefill_request__unpack(NULL, n, buf);
    cr_assert(back);
    cr_assert_str_eq(back->request_id, "req-1");
    cr_assert_eq(back->n_prompt, 3);
    cr_assert_eq(back->prompt[2], 128804);
    cr_assert_eq(back->sampling->top_k, -1);
    cr_assert_eq(back->sampling->seed, 0xfeedfacecafebeefull);
    cr_assert_eq(back->sampling->n_logprobs, 5);
    di__prefill__prefill_request__free_unpacked(back, NULL);
    /* A truncated message fails to unpack instead of yielding half a request. */
    cr_assert_null(di__prefill__prefill_request__unpack(NULL, n - 3, buf));
    free(buf);

    uint8_t key[32];
    memset(key, 0xab, sizeof(key));
    ProtobufCBinaryData keys[2] = {{32, key}, {32, key}};
    Di__Prefill__HandoffManifest hm = DI__PREFILL__HANDOFF_MANIFEST__INIT;
    hm.model_id = 0x2d06ae6a9d954fcdull;
    hm.prompt_tokens = 300;
    hm.block_tokens = 128;
    hm.n_block_keys = 2;
    hm.block_keys = keys;
    hm.handoff_key = (ProtobufCBinaryData){32, key};
    n = di__prefill__handoff_manifest__get_packed_size(&hm);
    buf = malloc(n);
    di__prefill__handoff_manifest__pack(&hm, buf);
    Di__Prefill__HandoffManifest *h2 = di__prefill__handoff_manifest__unpack(NULL, n, buf);
    cr_assert(h2);
    cr_assert_eq(h2->model_id, 0x2d06ae6a9d954fcdull);
    cr_assert_eq(h2->n_block_keys, 2);
    cr_assert_eq(h2->block_keys[1].len, 32);
    cr_assert_eq(memcmp(h2->handoff_key.data, key, 32), 0);
    di__prefill__handoff_manifest__free_unpacked(h2, NULL);
    free(buf);
}

Test(proto, decode_token_round_trip)
{
    Di__Engine__TokenLogprob top[2] = {DI__ENGINE__TOKEN_LOGPROB__INIT,
                                       DI__ENGINE__TOKEN_LOGPROB__INIT};
    Di__Engine__TokenLogprob *ptop[2] = {&top[0], &top[1]};
    top[0].id = 1;
    top[0].logprob = -0.25f;
    top[1].id = 7;
    top[1].logprob = -1.5f;
    Di__Engine__Token tok = DI__ENGINE__TOKEN__INIT;
    tok.id = 1;
    tok.logprob = -0.25f;
    tok.n_top = 2;
    tok.top = ptop;
    tok.index = 41;
    Di__Decode__DecodeToken dt = DI__DECODE__DECODE_TOKEN__INIT;
    dt.token = &tok;
    dt.finish = DI__ENGINE__FINISH__FINISH_STOP;
    dt.output_tokens = 42;
    size_t n = di__decode__decode_token__get_packed_size(&dt);
    uint8_t buf[256];
    cr_assert_leq(n, sizeof(buf));
    di__decode__decode_token__pack(&dt, buf);
    Di__Decode__DecodeToken *back = di__decode__decode_token__unpack(NULL, n, buf);
    cr_assert(back);
    cr_assert_eq(back->finish, DI__ENGINE__FINISH__FINISH_STOP);
    cr_assert_eq(back->output_tokens, 42);
    cr_assert_eq(back->token->index, 41);
    cr_assert_eq(back->token->n_top, 2);
    cr_assert_eq(back->token->top[1]->id, 7);
    cr_assert_float_eq(back->token->top[0]->logprob, -0.25f, 1e-7);
    di__decode__decode_token__free_unpacked(back, NULL);
}
