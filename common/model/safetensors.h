/* safetensors.h: read (mmap, no copy) and write safetensors files, and read the
 * model.safetensors.index.json that maps tensor names to shards.
 *
 * File format: an 8-byte little-endian header length N, N bytes of JSON
 *   {"__metadata__": {str: str}, NAME: {"dtype": "F32", "shape": [..], "data_offsets": [b, e]}}
 * then the data; offsets are relative to the first data byte. The reader checks every entry:
 * known dtype, shape product times element size equal to e - b, [b, e) inside the data, no two
 * tensors overlapping. Gaps between tensors are tolerated. Tensor data is NOT aligned in
 * general (a foreign file may place an F32 tensor at an odd offset): read it with memcpy or
 * through byte-wise loads. Files written here are contiguous, sorted by element size
 * (largest first) then name, with the header padded to 8 bytes, so every tensor of them is
 * aligned to its element size.
 */
#ifndef DI_MODEL_SAFETENSORS_H
#define DI_MODEL_SAFETENSORS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/util/status.h"

#define ST_MAX_DIMS 8u
#define ST_MAX_HEADER_BYTES (100u << 20) /* largest accepted JSON header */

/* Element types, by their safetensors names. F4 (E2M1) is listed for completeness; the
 * released checkpoint stores FP4 as I8 (two codes a byte). */
#define ST_DTYPE_MAP(XX)          \
    XX(BOOL, "BOOL", 8)           \
    XX(U8, "U8", 8)               \
    XX(I8, "I8", 8)               \
    XX(F8_E5M2, "F8_E5M2", 8)     \
    XX(F8_E4M3, "F8_E4M3", 8)     \
    XX(F8_E8M0, "F8_E8M0", 8)     \
    XX(I16, "I16", 16)            \
    XX(U16, "U16", 16)            \
    XX(F16, "F16", 16)            \
    XX(BF16, "BF16", 16)          \
    XX(I32, "I32", 32)            \
    XX(U32, "U32", 32)            \
    XX(F32, "F32", 32)            \
    XX(F64, "F64", 64)            \
    XX(I64, "I64", 64)            \
    XX(U64, "U64", 64)            \
    XX(F4, "F4", 4)

typedef enum st_dtype {
    ST_DTYPE_INVALID = 0,
#define ST_DTYPE_ENUM_(id, name, bits) ST_##id,
    ST_DTYPE_MAP(ST_DTYPE_ENUM_)
#undef ST_DTYPE_ENUM_
    ST_DTYPE_COUNT
} st_dtype;

/* "F32" for ST_F32; "?" for an invalid value. */
const char *st_dtype_name(st_dtype t);
/* ST_DTYPE_INVALID for an unknown name. */
st_dtype st_dtype_parse(const char *name);
/* Bits per element (4 for F4). */
uint32_t st_dtype_bits(st_dtype t);
/* Bytes for n elements (F4: n must be even). */
uint64_t st_dtype_bytes(st_dtype t, uint64_t n);

/* One tensor of an open file. */
typedef struct st_tensor {
    const char *name;            /* tensor name; owned by the file */
    st_dtype dtype;              /* element type */
    uint32_t ndim;               /* number of dimensions (0 = scalar) */
    uint64_t shape[ST_MAX_DIMS]; /* dimensions; unused entries 0 */
    uint64_t n_elements;         /* product of the shape (1 for a scalar) */
    uint64_t offset;             /* first byte, from the start of the file */
    uint64_t bytes;              /* data bytes */
    const uint8_t *data;         /* into the mapping (NULL for 0 bytes); unaligned in general */
} st_tensor;

/* An open, mapped, validated file. Read-only; any number of threads may read it. */
typedef struct st_file {
    char *path;                  /* as given to st_open */
    const uint8_t *map;          /* the whole file, mapped read-only */
    uint64_t file_bytes;         /* file size */
    uint64_t header_bytes;       /* N: JSON header length */
    uint64_t data_offset;        /* 8 + N: first data byte */
    uint32_t n_tensors;          /* entries in tensors */
    st_tensor *tensors;          /* sorted by name */
    uint32_t n_metadata;         /* __metadata__ entries */
    char **metadata_keys;        /* [n_metadata] */
    char **metadata_values;      /* [n_metadata] */
    char *names;                 /* storage of every name string */
} st_file;

/* Opens and maps path, parses and checks the header. Returns DI_OK; DI_ENOENT (missing file),
 * DI_EIO (unreadable), DI_ECORRUPT with what is wrong and which tensor ("x.weight: data_offsets
 * [0, 512] end past the 100 data bytes: file truncated?", "header length 9999 past the end of
 * the 120-byte file", "header JSON line 1 column 7: ...", "y: unknown dtype 'F12'"). *out is
 * set only on success. */
di_status st_open(const char *path, st_file **out, di_error *err);
/* Unmaps and frees. NULL-safe. */
void st_close(st_file *f);
/* The tensor named `name`, or NULL. Binary search. */
const st_tensor *st_find(const st_file *f, const char *name);
/* A metadata value, or NULL. */
const char *st_metadata(const st_file *f, const char *key);

/* ---- writing ---- */

/* A tensor to write: the caller supplies the bytes (or a fill callback for large tensors). */
typedef struct st_write_tensor {
    const char *name;            /* tensor name (must be unique) */
    st_dtype dtype;
    uint32_t ndim;
    uint64_t shape[ST_MAX_DIMS];
    const void *data;            /* the bytes, or NULL when fill is set */
    /* Produces the tensor's bytes in order, chunk by chunk: writes `len` bytes for byte range
     * [off, off + len) into buf. Returns DI_OK or an error that aborts the write. */
    di_status (*fill)(void *userdata, uint64_t off, void *buf, size_t len, di_error *err);
    void *userdata;              /* for fill */
} st_write_tensor;

/* Writes n tensors to path (through a temporary file renamed into place, so a failed write
 * leaves no partial file). metadata: NULL or n_meta key/value pairs for __metadata__.
 * progress (may be NULL) is called after each tensor with the bytes written so far.
 * Returns DI_OK; DI_EINVAL (duplicate name, invalid dtype, too many dimensions); DI_EIO with
 * errno text; or the error of a fill callback. */
di_status st_write(const char *path, const st_write_tensor *tensors, size_t n,
                   const char *const *meta_keys, const char *const *meta_values, size_t n_meta,
                   void (*progress)(void *userdata, uint64_t bytes_done), void *progress_ud,
                   di_error *err);

/* Bytes a file with these tensors takes (header included), for shard planning. */
uint64_t st_file_bytes_for(const st_write_tensor *tensors, size_t n, const char *const *meta_keys,
                           const char *const *meta_values, size_t n_meta);

/* ---- the shard index (model.safetensors.index.json) ---- */

typedef struct st_index {
    uint32_t n_shards;           /* distinct shard files */
    char **shards;               /* [n_shards] file names, sorted */
    uint32_t n_entries;          /* weight_map entries */
    char **names;                /* [n_entries] tensor names, sorted */
    uint32_t *shard_of;          /* [n_entries] index into shards */
    uint64_t total_size;         /* metadata.total_size (0 when absent) */
} st_index;

/* Reads dir/model.safetensors.index.json. When it is missing but dir/model.safetensors
 * exists, builds a one-shard index from that file. Shard names must be plain file names (no
 * '/' or ".."). Returns DI_OK, DI_ENOENT (neither file), DI_ECORRUPT (bad JSON, weight_map
 * not an object of strings, bad shard name). */
di_status st_index_load(const char *dir, st_index **out, di_error *err);
/* The shard index of tensor name, or -1. */
int32_t st_index_find(const st_index *idx, const char *name);
/* The entry index of tensor name (into names/shard_of), or -1. */
int32_t st_index_entry(const st_index *idx, const char *name);
void st_index_free(st_index *idx);

#endif
