#include "tests/kvstore/helpers.h"

#include "kvstore/synth.h"

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
    char log[300];
    snprintf(log, sizeof(log), "%s.log", dir); /* a store's log, kept next to its directory */
    remove(log);
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
    kvsynth_object(obj, bytes, magic, g, key, salt, magic == KV_WINDOW_MAGIC ? 0 : KV_BLOCK_TOKENS,
                   0);
}
