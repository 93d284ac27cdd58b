/* kvdemo: writes the KV objects of prompts into a running di-kvstore the way a prefill engine
 * would (every full block, the window state at the last multiple of 128; payloads are random
 * bytes with valid headers), then reads them back as a decode engine would. For trying a store
 * out and for the examples in docs/kvstore.md.
 *
 *   kvdemo --store HOST:PORT [--token T] --tokens N [--prompts P] [--shared S] [--ids-dir D]
 *
 * Prompt p has N tokens; its first S tokens are shared by all prompts (a common system prompt),
 * the rest differ per prompt. Token ids are i * 7 + 1 for the shared part. With --ids-dir,
 * prompt p's ids are also written to D/promptP.ids (one JSON array), for di-kvctl inspect. */
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/net/kv_client.h"
#include "common/util/outclose.h"
#include "common/service/options.h"
#include "kvstore/synth.h"

typedef struct dopts {
    const char *store;
    const char *token;
    uint64_t tokens;   /* per prompt */
    uint64_t prompts;  /* how many */
    uint64_t shared;   /* common prefix */
    const char *ids_dir; /* where to write promptP.ids; NULL: nowhere */
} dopts;

#define D(f) offsetof(dopts, f)
static const svc_opt rows[] = {
    {"store", SVC_OPT_HOSTPORT, D(store), "127.0.0.1:9470", 1, 0, "HOST:PORT", "di-kvstore",
     NULL},
    {"token", SVC_OPT_STRING, D(token), NULL, 0, 0, "TOKEN",
     "engine token (default: $DI_KVSTORE_TOKEN; none when unset)", NULL},
    {"tokens", SVC_OPT_UINT, D(tokens), "1000", 1, 1 << 21, "N", "tokens per prompt", NULL},
    {"prompts", SVC_OPT_UINT, D(prompts), "3", 1, 1000, "P", "prompts", NULL},
    {"shared", SVC_OPT_UINT, D(shared), "512", 0, 1 << 21, "S", "tokens shared by all prompts",
     NULL},
    {"ids-dir", SVC_OPT_DIR, D(ids_dir), NULL, 0, 0, "DIR", "also write promptP.ids here",
     NULL},
};
#define N_ROWS (sizeof(rows) / sizeof(rows[0]))

/* Writes ids as one JSON array to dir/promptP.ids. */
static int write_ids(const char *dir, uint64_t p, const int32_t *ids, uint64_t n)
{
    char path[4096];
    snprintf(path, sizeof path, "%s/prompt%llu.ids", dir, (unsigned long long)p);
    FILE *f = fopen(path, "w");
    if (!f) {
        fprintf(stderr, "kvdemo: cannot write %s\n", path);
        return 1;
    }
    fputc('[', f);
    for (uint64_t i = 0; i < n; i++)
        fprintf(f, i ? ",%d" : "%d", ids[i]);
    fputs("]\n", f);
    if (fclose(f) != 0) {
        fprintf(stderr, "kvdemo: write of %s failed\n", path);
        return 1;
    }
    return 0;
}

static int put(kvc_client *c, int cls, const kvkey *k, uint8_t *buf, size_t bytes)
{
    di_error e;
    di_status st = kvc_put1(c, cls, k, buf, bytes, &e);
    if (st != DI_OK && st != DI_EEXIST) {
        fprintf(stderr, "kvdemo: put %s: %s\n", kvkey_class_name(cls), e.msg);
        return 1;
    }
    return 0;
}

int main(int argc, char **argv)
{
    dopts o;
    memset(&o, 0, sizeof(o)); /* options without a default (--token, --ids-dir) stay NULL */
    di_error e;
    int next, help;
    if (svc_opts_defaults(rows, N_ROWS, &o, &e) ||
        svc_opts_parse(rows, N_ROWS, argc, argv, 1, &o, &next, &help, &e)) {
        fprintf(stderr, "kvdemo: %s\n", e.msg);
        return 2;
    }
    if (help || next < argc) {
        FILE *f = help ? stdout : stderr;
        fprintf(f, "usage: kvdemo [options]\n");
        svc_opts_print(f, rows, N_ROWS);
        return help ? di_close_stdout("kvdemo", 0) : 2;
    }
    if (o.shared > o.tokens) {
        fprintf(stderr, "kvdemo: --shared %llu is more than --tokens %llu\n",
                (unsigned long long)o.shared, (unsigned long long)o.tokens);
        return 2;
    }
    if (!o.token)
        o.token = getenv("DI_KVSTORE_TOKEN");
    kvc_options co;
    kvc_options_default(&co);
    co.target = o.store;
    co.token = o.token;
    kvc_client *c;
    kvc_store_info info;
    if (kvc_open(&co, &c, &e) || kvc_info(c, &info, &e)) {
        fprintf(stderr, "kvdemo: %s\n", e.msg);
        return 1;
    }
    const kv_geometry *g = &info.geometry;
    size_t bb = info.object_bytes[KVKEY_BLOCK], wb = info.object_bytes[KVKEY_WINDOW];
    uint8_t *buf = malloc(bb > wb ? bb : wb);
    int32_t *ids = malloc(o.tokens * sizeof(int32_t));
    size_t max = o.tokens / 128 + 1, nk = 0;
    kvkey *keys = malloc(max * sizeof(kvkey));
    int rc = 0;
    for (uint64_t p = 0; p < o.prompts && rc == 0; p++) {
        for (uint64_t i = 0; i < o.tokens; i++)
            ids[i] = (int32_t)(i < o.shared ? i * 7 + 1 : 50000 + p * 10007 + i);
        if (o.ids_dir)
            rc = write_ids(o.ids_dir, p, ids, o.tokens);
        kvkey_chain(g->model_id, g->block_tokens, ids, o.tokens, keys, max, &nk, NULL);
        for (size_t b = 0; b < nk && rc == 0; b++) {
            kvsynth_object(buf, bb, KV_BLOCK_MAGIC, g, &keys[b], 0, 128, b * 128);
            rc = put(c, KVKEY_BLOCK, &keys[b], buf, bb);
        }
        if (nk > 0 && rc == 0) {
            kvsynth_object(buf, wb, KV_WINDOW_MAGIC, g, &keys[nk - 1], 0, (uint32_t)(nk * 128),
                           nk * 128);
            rc = put(c, KVKEY_WINDOW, &keys[nk - 1], buf, wb);
        }
        printf("prompt %llu: %llu tokens, %zu blocks and the window state at %zu stored\n",
               (unsigned long long)p, (unsigned long long)o.tokens, nk, nk * 128);
    }
    /* Read prompt 0 back the way decode would: lookup, then every hit block. */
    for (uint64_t i = 0; i < o.tokens && rc == 0; i++)
        ids[i] = (int32_t)(i < o.shared ? i * 7 + 1 : 50000 + i);
    kvkey_chain(g->model_id, g->block_tokens, ids, o.tokens, keys, max, &nk, NULL);
    uint32_t hit = 0, win[64];
    size_t nw = 0;
    if (rc == 0 && kvc_lookup(c, keys, nk, &hit, win, 64, &nw, &e) != DI_OK) {
        fprintf(stderr, "kvdemo: lookup: %s\n", e.msg);
        rc = 1;
    }
    for (uint32_t b = 0; b < hit && rc == 0; b++)
        if (kvc_get1(c, KVKEY_BLOCK, &keys[b], buf, bb, NULL, &e) != DI_OK) {
            fprintf(stderr, "kvdemo: get block %u: %s\n", b, e.msg);
            rc = 1;
        }
    if (rc == 0)
        printf("prompt 0 read back: %u blocks hit, %zu window states, all verified\n", hit, nw);
    free(buf);
    free(ids);
    free(keys);
    kvc_close(c);
    return di_close_stdout("kvdemo", rc);
}
