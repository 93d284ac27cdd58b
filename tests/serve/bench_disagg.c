/* Benchmarks of the disaggregated services (meson test --benchmark --suite serve):
 *
 * - the KV pull of a 16,384-token V4.1-Flash-geometry prompt (128 full blocks + the partial
 *   129th, which decode pulls too, + the window state) from a real di-kvstore on this host,
 *   verified kvc_get over each data path (UCX active messages, and the bytes inside gRPC
 *   messages), next to memcpy of the same bytes in the same run;
 * - TTFT and time per output token disaggregated (di-prefill -> store -> di-decode, one prompt
 *   at a time) next to the local engine running each prompt alone (tiny model, CPU, same
 *   prompts), with decode's KV pull next to the disaggregated TTFT (the pull comes after
 *   the first token: it delays the second). */
#include <criterion/criterion.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/util/clock.h"
#include "tests/kvstore/helpers.h"
#include "tests/serve/rig.h"

TestSuite(disagg_bench, .init = rig_setup, .fini = rig_teardown, .timeout = 900);

static double best_of(double a, double b)
{
    return a == 0 || b < a ? b : a;
}

static kvc_client *client_on(const th_store *s, kvc_data_path path)
{
    kvc_options o;
    kvc_options_default(&o);
    o.target = s->target;
    o.data_path = path;
    o.deadline_ms = 60000;
    kvc_client *c = NULL;
    di_error e;
    cr_assert_eq(kvc_open(&o, &c, &e), DI_OK, "%s", e.msg);
    return c;
}

/* Best of 7 verified gets of items into dst, each next to a memcpy of the same bytes; the
 * times in seconds. */
static void pull_vs_memcpy(kvc_client *c, kvc_item *items, uint32_t n, uint8_t *dst,
                           const uint8_t *src, size_t bb, size_t total, double *pull,
                           double *copy)
{
    di_error err;
    *pull = *copy = 0;
    for (int rep = 0; rep < 7; rep++) {
        memset(dst, 0, total);
        for (uint32_t i = 0; i < n; i++)
            items[i].buf = dst + (size_t)i * bb;
        uint64_t t0 = di_mono_ns();
        cr_assert_eq(kvc_get(c, items, n, &err), DI_OK, "%s", err.msg);
        double t = (double)(di_mono_ns() - t0) / 1e9;
        for (uint32_t i = 0; i < n; i++)
            cr_assert_eq(items[i].status, DI_OK, "get %u: %s", i, items[i].error.msg);
        cr_assert(memcmp(dst, src, total) == 0, "the pulled bytes differ");
        *pull = best_of(*pull, t);
        t0 = di_mono_ns();
        memcpy(dst, src, total);
        __asm__ volatile("" : : "r"(dst) : "memory");
        *copy = best_of(*copy, (double)(di_mono_ns() - t0) / 1e9);
    }
}

Test(disagg_bench, kv_pull_of_a_16k_prompt_next_to_memcpy)
{
    char dir[300];
    snprintf(dir, sizeof dir, "%s/store", g_dir);
    const char *args[] = {"--geometry", "v41-flash", "--nextn", "5", "--dram-bytes", "1GiB",
                          "--durability", "none", NULL};
    th_store store = {0};
    th_store_start(&store, dir, args);
    kvc_client *ucx = client_on(&store, KVC_PATH_UCX), *grpc = client_on(&store, KVC_PATH_GRPC);
    kvc_store_info info;
    di_error err;
    cr_assert_eq(kvc_info(ucx, &info, &err), DI_OK, "%s", err.msg);
    const kv_geometry *g = &info.geometry;
    enum { NB = 129 };
    size_t bb = kv_block_bytes(g), wb = kv_window_state_bytes(g), total = NB * bb + wb;
    kvc_item items[NB + 1];
    uint8_t *src = aligned_alloc(64, (total + 63) / 64 * 64);
    uint8_t *dst = aligned_alloc(64, (total + 63) / 64 * 64);
    cr_assert(src && dst);
    for (uint32_t i = 0; i <= NB; i++) {
        bool win = i == NB;
        items[i] = (kvc_item){.cls = win ? KVKEY_WINDOW : KVKEY_BLOCK, .key = th_key(1000 + i),
                              .buf = src + (size_t)i * bb, .cap = win ? wb : bb};
        th_fill_object(items[i].buf, items[i].cap, win ? KV_WINDOW_MAGIC : KV_BLOCK_MAGIC, g,
                       &items[i].key, i);
    }
    cr_assert_eq(kvc_put(ucx, items, NB + 1, &err), DI_OK, "%s", err.msg);
    for (uint32_t i = 0; i <= NB; i++)
        cr_assert_eq(items[i].status, DI_OK, "put %u: %s", i, items[i].error.msg);
    const char *names[2] = {"UCX active messages", "gRPC messages"};
    kvc_client *cs[2] = {ucx, grpc};
    for (int p = 0; p < 2; p++) {
        double pull, copy;
        pull_vs_memcpy(cs[p], items, NB + 1, dst, src, bb, total, &pull, &copy);
        printf("KV pull, 16,384-token V4.1-Flash prompt (%d blocks of %zu B + window state of "
               "%zu B = %.1f MB), verified kvc_get from di-kvstore on this host over %s: best "
               "of 7 %.2f ms = %.2f GB/s; memcpy of the same bytes, same run: %.2f ms = %.2f "
               "GB/s; pull / memcpy = %.2f\n", NB, bb, wb, total / 1e6, names[p], pull * 1e3,
               total / pull / 1e9, copy * 1e3, total / copy / 1e9, copy / pull);
    }
    free(src);
    free(dst);
    kvc_close(ucx);
    kvc_close(grpc);
    th_store_stop(&store);
}

Test(disagg_bench, ttft_and_tpot_disaggregated_vs_local)
{
    rig r = {0};
    rig_start(&r, "5");
    const uint32_t lens[] = {128, 512, 1000, 2000, 4096};
    printf("tiny model, CPU, 1 thread per rank, chunk " CHUNK ", 32 output tokens, nextn 5\n");
    for (size_t i = 0; i < sizeof lens / sizeof lens[0]; i++) {
        char path[300];
        snprintf(path, sizeof path, "%s/b%zu.txt", g_dir, i);
        FILE *f = fopen(path, "w");
        cr_assert(f);
        for (uint32_t k = 0; k < lens[i]; k++)
            fprintf(f, k ? ",%u" : "%u", 2 + (k * 7919u + (uint32_t)i * 31u) % 4000u);
        fputc('\n', f);
        fclose(f);
        gen_res loc, rem;
        gen(&loc, "--config tiny --weights-seed " SEED " --chunk " CHUNK " --threads 1 --nextn "
            "5 --ids-file %s --max-tokens 32 --ignore-eos", path);
        gen(&rem, "--prefill %s --decode %s --ids-file %s --max-tokens 32 --ignore-eos",
            r.prefill.target, r.decode.target, path);
        cr_assert(loc.rc == 0 && rem.rc == 0, "%s %s", loc.err, rem.err);
        json_t *ls = json_object_get(loc.json, "stats"), *rs = json_object_get(rem.json, "stats");
        double lt = json_real_value(json_object_get(ls, "prefill_s")) * 1e3;
        double ld = json_real_value(json_object_get(ls, "decode_s")) * 1e3 /
                    (double)json_integer_value(json_object_get(ls, "decode_tokens"));
        double rt = json_real_value(json_object_get(rs, "ttft_ms_mean"));
        double pull = json_real_value(json_object_get(rs, "kv_pull_ms_mean"));
        printf("prompt %5u tokens: TTFT local %.1f ms, disaggregated %.1f ms; per output token "
               "local %.2f ms, disaggregated %.2f ms; decode pulled %.0f B in %.2f ms (%.1f%% of "
               "the disaggregated TTFT; it delays the second token)\n", lens[i], lt, rt, ld,
               json_real_value(json_object_get(rs, "tpot_ms_mean")),
               json_real_value(json_object_get(rs, "kv_pulled_bytes_mean")), pull,
               rt > 0 ? 100 * pull / rt : 0);
        json_decref(loc.json);
        json_decref(rem.json);
    }
    rig_stop(&r);
}
