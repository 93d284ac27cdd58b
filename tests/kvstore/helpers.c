#include "tests/kvstore/helpers.h"

#include <criterion/criterion.h>
#include <ftw.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mount.h>
#include <unistd.h>


void th_tmpdir(char *dir)
{
    snprintf(dir, 256, "/tmp/di-kvtest-XXXXXX");
    cr_assert_not_null(mkdtemp(dir), "mkdtemp failed");
}

static int rm_entry(const char *path, const struct stat *sb, int flag, struct FTW *ftw)
{
    (void)sb;
    (void)flag;
    (void)ftw;
    return remove(path);
}

void th_rmtree(const char *dir)
{
    if (!dir || !*dir)
        return;
    umount2(dir, MNT_DETACH); /* fails harmlessly when not a mount point */
    nftw(dir, rm_entry, 16, FTW_DEPTH | FTW_PHYS);
}

int th_mount_tmpfs(const char *dir, uint64_t bytes)
{
    char opts[64];
    snprintf(opts, sizeof(opts), "size=%llu", (unsigned long long)bytes);
    return mount("tmpfs", dir, "tmpfs", 0, opts);
}

kvkey th_key(uint64_t seed)
{
    int32_t tokens[8];
    for (int i = 0; i < 8; i++)
        tokens[i] = (int32_t)(seed * 8 + (uint64_t)i);
    kvkey k;
    cr_assert_eq(kvkey_block(NULL, seed, tokens, 8, &k, NULL), DI_OK);
    return k;
}

void th_fill_object(void *obj, size_t bytes, uint32_t magic, const kv_geometry *g,
                    const kvkey *key, uint64_t salt)
{
    uint8_t *p = (uint8_t *)obj + KV_HEADER_BYTES;
    size_t n = bytes - KV_HEADER_BYTES;
    uint64_t x;
    memcpy(&x, key->b, sizeof(x));
    x ^= salt * 0x9E3779B97F4A7C15ull;
    /* splitmix64: payload bytes are a pure function of (key, salt). */
    for (size_t i = 0; i < n; i += 8) {
        uint64_t z = (x += 0x9E3779B97F4A7C15ull);
        z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
        z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
        z ^= z >> 31;
        size_t take = n - i < 8 ? n - i : 8;
        memcpy(p + i, &z, take);
    }
    kv_header h;
    kv_header_fill(&h, magic, g, key->b, magic == KV_WINDOW_MAGIC ? 0 : KV_BLOCK_TOKENS, 0, p, n);
    memcpy(obj, &h, sizeof(h));
}
