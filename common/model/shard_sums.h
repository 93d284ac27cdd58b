/* shard_sums.h: the checksum manifest of a checkpoint's weight files, and the weights
 * fingerprint that goes into model_id.
 *
 * The manifest, dir/model.safetensors.sha256.json, lists every covered file (each shard the
 * index names, and engram_token_map.json and tokenizer.json when present: the Engram map comes
 * from them, so they change what the model computes) with its size and the SHA-256 of each
 * 64 MiB chunk:
 *
 *   {"format": "di-shard-sums/1", "hash": "sha256", "chunk_bytes": 67108864,
 *    "fingerprint": "<hex>",
 *    "files": [{"name": "model-00001-of-00002.safetensors", "bytes": 123456,
 *               "sha256": ["<hex of bytes 0..64Mi>", ...]}, ...]}
 *
 * Chunks rather than one digest per file so that every core hashes, however the checkpoint is
 * sharded (one 100 GB shard included), and so that a mismatch names the damaged byte range.
 * SHA-256 because it is strong (a weight change can never be missed by accident), runs at about
 * 1.7 GB/s per core with the SHA extensions, and can be checked by hand (the digest of a file
 * smaller than one chunk is what `sha256sum` prints).
 *
 * The fingerprint is SHA-256 over "di-shard-sums/1", then for each file in name order its name,
 * a zero byte, its size as u64 little-endian and its chunk digests. It is the same whether it
 * is read from a verified manifest, from a trusted one (no file read) or computed from the files
 * themselves, so a checkpoint has one fingerprint with or without its manifest.
 */
#ifndef DI_MODEL_SHARD_SUMS_H
#define DI_MODEL_SHARD_SUMS_H

#include <stdbool.h>
#include <stdint.h>

#include "common/model/safetensors.h"
#include "common/util/sha256.h"
#include "common/util/status.h"

#define SHARD_SUMS_FILE "model.safetensors.sha256.json"
#define SHARD_SUMS_FORMAT "di-shard-sums/1"
#define SHARD_SUMS_CHUNK_BYTES (64ull << 20)
#define SHARD_SUMS_TOKEN_MAP "engram_token_map.json" /* covered when present */
#define SHARD_SUMS_TOKENIZER "tokenizer.json"        /* covered when present */

/* What a fingerprint computation found and did. */
typedef struct shard_sums_result {
    uint8_t fingerprint[DI_SHA256_BYTES]; /* the weights fingerprint */
    bool had_manifest;                    /* dir held a manifest */
    bool verified;                        /* every covered byte was hashed and matched it */
    uint32_t n_files;                     /* files covered */
    uint64_t bytes_hashed;                /* bytes read and hashed (0 when trusted) */
} shard_sums_result;

/* Hashes every covered file of dir (the shards of idx, plus the token map and the tokenizer when
 * present) with
 * `threads` threads (0: one per online CPU) and writes the manifest through a temporary file
 * renamed into place. fingerprint (may be NULL) receives the fingerprint. Returns DI_OK;
 * DI_ENOENT or DI_EIO naming the file; DI_ENOMEM. */
di_status shard_sums_write(const char *dir, const st_index *idx, uint32_t threads,
                           uint8_t fingerprint[DI_SHA256_BYTES], di_error *err);

/* The weights fingerprint of dir for the loader. With a manifest: unless trust is set, hashes
 * every covered file and compares it with the manifest (DI_ECORRUPT naming the file and the
 * byte range that differ, a size that differs, a covered file the manifest does not list or a
 * listed file the checkpoint lacks); with trust, takes the fingerprint from the manifest
 * without reading a file. Without a manifest: hashes the covered files. DI_ECORRUPT also for a
 * malformed manifest (naming what is wrong). out is written only on success. */
di_status shard_sums_fingerprint(const char *dir, const st_index *idx, uint32_t threads,
                                 bool trust, shard_sums_result *out, di_error *err);

/* The fingerprint recorded in dir's manifest, checked for consistency with its entries but
 * reading no weight file (a KV store that knows the checkpoint by its config and manifest).
 * DI_ENOENT without a manifest; DI_ECORRUPT for a malformed one. */
di_status shard_sums_read_fingerprint(const char *dir, uint8_t fingerprint[DI_SHA256_BYTES],
                                      di_error *err);

#endif
