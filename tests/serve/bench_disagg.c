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
#include "tests/serve/rig.h"

TestSuite(disagg_bench, .init = rig_setup, .fini = rig_teardown, .timeout = 900);

/* The machine's load average, printed with the figures (a shared machine's other work
 * shows in them). */
static void print_load(void)
{
    char buf[128] = "?";
    FILE *f = fopen("/proc/loadavg", "r");
    if (f) {
        if (!fgets(buf, sizeof buf, f))
            snprintf(buf, sizeof buf, "?\n");
        fclose(f);
    }
    printf("load average (1, 5, 15 min): %s", buf);
}

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
    th_store store = {0};
    flash_store_start(&store, "store");
    kvc_client *ucx = client_on(&store, KVC_PATH_UCX);
    kvc_store_info info;
    di_error err;
    cr_assert_eq(kvc_info(ucx, &info, &err), DI_OK, "%s", err.msg);
    const kv_geometry *g = &info.geometry;
    enum { NB = FLASH_16K_BLOCKS };
    size_t bb = kv_block_bytes(g), wb = kv_window_state_bytes(g), total = flash_16k_bytes(g);
    kvc_item items[NB + 1];
    uint8_t *src = aligned_alloc(64, (total + 63) / 64 * 64);
    uint8_t *dst = aligned_alloc(64, (total + 63) / 64 * 64);
    cr_assert(src && dst);
    flash_16k_items(g, items, src);
    cr_assert_eq(kvc_put(ucx, items, NB + 1, &err), DI_OK, "%s", err.msg);
    for (uint32_t i = 0; i <= NB; i++)
        cr_assert_eq(items[i].status, DI_OK, "put %u: %s", i, items[i].error.msg);
    print_load();
    const char *names[2] = {"UCX active messages", "gRPC messages"};
    for (int p = 0; p < 2; p++) {
        double pull, copy;
        kvc_client *c = p == 0 ? ucx : client_on(&store, KVC_PATH_GRPC);
        pull_vs_memcpy(c, items, NB + 1, dst, src, bb, total, &pull, &copy);
        if (p)
            kvc_close(c);
        printf("KV pull, 16,384-token V4.1-Flash prompt (%d blocks of %zu B + window state of "
               "%zu B = %.1f MB), verified kvc_get from di-kvstore on this host over %s: best "
               "of 7 %.2f ms = %.2f GB/s; memcpy of the same bytes, same run: %.2f ms = %.2f "
               "GB/s; pull / memcpy = %.2f\n", NB, bb, wb, total / 1e6, names[p], pull * 1e3,
               total / pull / 1e9, copy * 1e3, total / copy / 1e9, copy / pull);
    }
    free(src);
    free(dst);
    kvc_close(ucx);
    th_store_stop(&store); /* a clean stop after the 16.2 MB gRPC replies (exit 0) */
}

/* One prompt, local and disaggregated, best of REPS runs of each. */
enum { REPS = 3 };

typedef struct ttft_row {
    double local_ttft, local_tpot; /* ms */
    double ttft, tpot;             /* disaggregated, ms */
    double pull_ms, pulled_bytes;  /* decode's KV pull */
} ttft_row;

static void ttft_runs(const rig *r, const char *path, ttft_row *row)
{
    *row = (ttft_row){0};
    for (int rep = 0; rep < REPS; rep++) {
        gen_res loc, rem;
        gen(&loc, "--config tiny --weights-seed " SEED " --chunk " CHUNK " --threads 1 --nextn "
            "5 --ids-file %s --max-tokens 32 --ignore-eos", path);
        gen(&rem, "--prefill %s --decode %s --ids-file %s --max-tokens 32 --ignore-eos",
            r->prefill.target, r->decode.target, path);
        cr_assert(loc.rc == 0 && rem.rc == 0, "%s %s", loc.err, rem.err);
        json_t *ls = json_object_get(loc.json, "stats"), *rs = json_object_get(rem.json, "stats");
        row->local_ttft = best_of(row->local_ttft,
                                  json_real_value(json_object_get(ls, "prefill_s")) * 1e3);
        row->local_tpot = best_of(row->local_tpot,
                                  json_real_value(json_object_get(ls, "decode_s")) * 1e3 /
                                  (double)json_integer_value(json_object_get(ls, "decode_tokens")));
        row->ttft = best_of(row->ttft, json_real_value(json_object_get(rs, "ttft_ms_mean")));
        row->tpot = best_of(row->tpot, json_real_value(json_object_get(rs, "tpot_ms_mean")));
        row->pull_ms = best_of(row->pull_ms,
                               json_real_value(json_object_get(rs, "kv_pull_ms_mean")));
        row->pulled_bytes = json_real_value(json_object_get(rs, "kv_pulled_bytes_mean"));
        json_decref(loc.json);
        json_decref(rem.json);
    }
}

Test(disagg_bench, ttft_and_tpot_disaggregated_vs_local)
{
    rig r = {0};
    rig_start(&r, "5");
    const uint32_t lens[] = {128, 512, 1000, 2000, 4096};
    print_load();
    printf("tiny model, CPU, 1 thread per rank, chunk " CHUNK ", 32 output tokens, nextn 5, "
           "best of %d runs each\n", REPS);
    for (size_t i = 0; i < sizeof lens / sizeof lens[0]; i++) {
        char path[300];
        snprintf(path, sizeof path, "%s/b%zu.txt", g_dir, i);
        FILE *f = fopen(path, "w");
        cr_assert(f);
        for (uint32_t k = 0; k < lens[i]; k++)
            fprintf(f, k ? ",%u" : "%u", 2 + (k * 7919u + (uint32_t)i * 31u) % 4000u);
        fputc('\n', f);
        fclose(f);
        ttft_row w;
        ttft_runs(&r, path, &w);
        printf("prompt %5u tokens: TTFT local %.1f ms, disaggregated %.1f ms; per output token "
               "local %.2f ms, disaggregated %.2f ms; decode pulled %.0f B in %.2f ms (%.1f%% of "
               "the disaggregated TTFT; it delays the second token)\n", lens[i], w.local_ttft,
               w.ttft, w.local_tpot, w.tpot, w.pulled_bytes, w.pull_ms,
               w.ttft > 0 ? 100 * w.pull_ms / w.ttft : 0);
    }
    rig_stop(&r);
}
/* A prompt whose prefix is in the store, against the same prompt's cold TTFT and against the
 * floor of its warm TTFT: di-generate --kvstore on the same prompt and store, one process, its
 * prefill time (the same hit loaded, the same tail computed over the same context). B shares
 * all of A but its last 64 tokens; the hit is capped at L - 140. */
Test(disagg_bench, ttft_of_a_prefix_hit_vs_cold_and_the_compute_floor)
{
    rig r = {0};
    rig_start(&r, "5");
    const uint32_t lens[] = {1000, 2000, 4000};
    printf("tiny model, CPU, 1 thread per rank, chunk " CHUNK ", 8 output tokens, nextn 5\n");
    for (size_t i = 0; i < sizeof lens / sizeof lens[0]; i++) {
        uint32_t L = lens[i];
        char pa[300], pb[300];
        snprintf(pa, sizeof pa, "%s/ha%zu.txt", g_dir, i);
        snprintf(pb, sizeof pb, "%s/hb%zu.txt", g_dir, i);
        FILE *fa = fopen(pa, "w"), *fb = fopen(pb, "w");
        for (uint32_t k = 0; k < L; k++) {
            uint32_t t = 2 + (k * 7919u + (uint32_t)i * 131u + 7u) % 4000u;
            fprintf(fa, k ? ",%u" : "%u", t);
            fprintf(fb, k ? ",%u" : "%u", k < L - 64 ? t : 2 + (k * 37u + 11u) % 4000u);
        }
        fputc('\n', fa);
        fputc('\n', fb);
        fclose(fa);
        fclose(fb);
        gen_res cold, warm, floor_run;
        gen(&cold, "--prefill %s --decode %s --ids-file %s --max-tokens 8 --ignore-eos",
            r.prefill.target, r.decode.target, pa);
        gen(&warm, "--prefill %s --decode %s --ids-file %s --max-tokens 8 --ignore-eos",
            r.prefill.target, r.decode.target, pb);
        cr_assert(cold.rc == 0 && warm.rc == 0, "%s %s", cold.err, warm.err);
        json_int_t cached = json_integer_value(json_object_get(
            json_array_get(json_object_get(warm.json, "requests"), 0), "cached_tokens"));
        uint32_t tail = L - (uint32_t)cached;
        gen(&floor_run, "--config tiny --weights-seed " SEED " --chunk " CHUNK " --threads 1 "
            "--nextn 5 --ids-file %s --max-tokens 8 --ignore-eos --kvstore %s", pb,
            r.store.target);
        cr_assert_eq(floor_run.rc, 0, "%s", floor_run.err);
        cr_assert_eq(json_integer_value(json_object_get(json_object_get(json_object_get(
                         floor_run.json, "stats"), "kvstore"), "hit_tokens")), cached,
                     "the same hit");
        double ct = json_real_value(json_object_get(json_object_get(cold.json, "stats"),
                                                    "ttft_ms_mean"));
        double wt = json_real_value(json_object_get(json_object_get(warm.json, "stats"),
                                                    "ttft_ms_mean"));
        double ft_ms = json_real_value(json_object_get(json_object_get(floor_run.json, "stats"),
                                                       "prefill_s")) * 1e3;
        printf("prompt %5u tokens: TTFT cold %.1f ms; warm %.1f ms with %lld tokens from the "
               "store, %u computed; floor (di-generate --kvstore, the same hit, prefill) %.1f "
               "ms\n", L, ct, wt, (long long)cached, tail, ft_ms);
        json_decref(cold.json);
        json_decref(warm.json);
        json_decref(floor_run.json);
    }
    rig_stop(&r);
}
