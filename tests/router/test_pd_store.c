/* The prefill/decode backend's cached-prefix lookup against a real di-kvstore: the prompt's
 * chain keys are computed with the store's model id and block size, and the blocks the store
 * holds count as cached tokens; a store that goes away counts 0 and the request still runs. */
#include <criterion/criterion.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/kvfmt/kv_keys.h"
#include "common/kvfmt/kv_layout.h"
#include "router/pd_backend.h"
#include "tests/kvstore/harness.h"
#include "tests/kvstore/helpers.h"

static const char *const small_args[] = {
    "--block-bytes", "4224", "--window-bytes", "8320", "--handoff-max-bytes", "16512",
    "--dram-bytes", "8MiB", "--memtable-bytes", "2MiB", NULL};

typedef struct done {
    int finishes;
    rt_finish reason;
} done;

static void on_token(void *ud, const rt_gen_token *t)
{
    (void)ud, (void)t;
}

static void on_finish(void *ud, rt_finish reason, uint32_t cached, const char *instance,
                      di_status st, const char *msg)
{
    done *d = ud;
    (void)cached, (void)instance, (void)st, (void)msg;
    d->reason = reason;
    __atomic_store_n(&d->finishes, 1, __ATOMIC_SEQ_CST);
}

/* One request for tokens[0..n) through b; waits for its end. */
static void run(pd_backend *b, const int32_t *tokens, size_t n)
{
    done d = {0};
    rt_gen_req r = {.prompt = tokens, .n_prompt = n, .max_tokens = 4, .temperature = 1,
                    .top_p = 1, .top_k = -1};
    rt_gen_cb cb = {on_token, on_finish, &d, NULL};
    uint64_t h;
    di_error e = {0};
    cr_assert_eq(pd_backend_iface(b).generate(b, &r, &cb, &h, &e), DI_OK, "%s", e.msg);
    for (int i = 0; i < 2000 && !__atomic_load_n(&d.finishes, __ATOMIC_SEQ_CST); i++)
        usleep(5000);
    cr_assert_eq(d.finishes, 1);
}

Test(pd_store, cached_tokens_come_from_the_store_lookup, .timeout = 120)
{
    char dir[256];
    th_tmpdir(dir);
    th_store s;
    th_store_start(&s, dir, small_args);
    kvc_client *c = th_client(&s, NULL);
    kvc_store_info info;
    di_error e = {0};
    cr_assert_eq(kvc_info(c, &info, &e), DI_OK, "%s", e.msg);
    uint32_t bt = info.geometry.block_tokens;
    enum { BLOCKS = 4 };
    size_t n = BLOCKS * bt + 17;
    int32_t *tokens = malloc(n * sizeof *tokens);
    for (size_t i = 0; i < n; i++)
        tokens[i] = (int32_t)((i * 7919) % 100000);
    kvkey keys[BLOCKS];
    size_t nk;
    cr_assert_eq(kvkey_chain(info.geometry.model_id, bt, tokens, n, keys, BLOCKS, &nk, &e),
                 DI_OK);
    for (int i = 0; i < 2; i++) { /* the first two blocks are stored */
        uint8_t *obj = malloc(4224);
        th_fill_object(obj, 4224, KV_BLOCK_MAGIC, &info.geometry, &keys[i], 0);
        cr_assert_eq(kvc_put1(c, KVKEY_BLOCK, &keys[i], obj, 4224, &e), DI_OK, "%s", e.msg);
        free(obj);
    }
    /* Ranks that cannot be reached: each request fails at prefill, after the lookup that is
     * tested here. */
    rk_config rc = {.placement = pl_config_default(), .policy = PL_POLICY_ESTIMATE};
    rk_table *t = NULL;
    cr_assert_eq(rk_new(&rc, &t, &e), DI_OK, "%s", e.msg);
    cr_assert_eq(rk_add(t, PL_PREFILL, "127.0.0.1:1", false, NULL, &e), DI_OK);
    cr_assert_eq(rk_add(t, PL_DECODE, "127.0.0.1:2", false, NULL, &e), DI_OK);
    kvc_client *store = th_client(&s, NULL);
    pd_config pc = {.ranks = t, .store = store, .prefill_timeout_ms = 2000,
                    .decode_timeout_ms = 2000, .block_tokens = 128};
    pd_backend *b = NULL;
    cr_assert_eq(pd_new(&pc, &b, &e), DI_OK, "%s", e.msg);
    run(b, tokens, n);
    cr_assert_eq(pd_store_hits(b), 2 * (uint64_t)bt, "cached tokens %llu, want %u",
                 (unsigned long long)pd_store_hits(b), 2 * bt);
    /* Another prompt (the first token differs): nothing cached. */
    tokens[0] ^= 1;
    run(b, tokens, n);
    cr_assert_eq(pd_store_hits(b), 2 * (uint64_t)bt);
    /* The store gone: 0 cached, and the request still ends. */
    tokens[0] ^= 1;
    th_store_stop(&s);
    run(b, tokens, n);
    cr_assert_eq(pd_store_hits(b), 2 * (uint64_t)bt);
    pd_free(b);
    rk_free(t);
    kvc_close(store);
    kvc_close(c);
    free(tokens);
}
