/* helpers.h: shared pieces of the KV store tests: temporary directories, small tmpfs mounts
 * for disk-full cases, KV objects with valid headers. */
#ifndef DI_TESTS_KVSTORE_HELPERS_H
#define DI_TESTS_KVSTORE_HELPERS_H

#include <stddef.h>
#include <stdint.h>

#include "common/kvfmt/kv_layout.h"
#include "common/model/config.h"
#include "common/kvfmt/kv_keys.h"

/* Creates /tmp/di-kvtest-XXXXXX and writes its path into dir (capacity 256). */
void th_tmpdir(char *dir);
/* Removes a directory tree (unmounting it first when it is a mount point). */
void th_rmtree(const char *dir);
/* Mounts a tmpfs of `bytes` at dir (the tests run as root). Returns 0 on success. */
int th_mount_tmpfs(const char *dir, uint64_t bytes);

/* A deterministic test key: SHA-256 chain of `seed`. */
kvkey th_key(uint64_t seed);
/* Fills an object of `bytes` (header + payload) whose payload is a pure function of (key, salt)
 * with a valid kv_header for geometry g and the given magic. */
void th_fill_object(void *obj, size_t bytes, uint32_t magic, const kv_geometry *g,
                    const kvkey *key, uint64_t salt);

#endif
