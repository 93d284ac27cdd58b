/* sha256.h: SHA-256 (FIPS 180-4) for weight manifests and fingerprints.
 *
 * Uses OpenSSL's libcrypto when the build found it (SHA extensions where the CPU has them, about
 * 1.7 GB/s per core on the development VM) and a portable C version otherwise (same digests,
 * several times slower), so a build without OpenSSL still computes the same model ids.
 */
#ifndef DI_UTIL_SHA256_H
#define DI_UTIL_SHA256_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#define DI_SHA256_BYTES 32u

/* Incremental state. Opaque fields; use the functions. */
typedef struct di_sha256 {
    void *evp;          /* OpenSSL context, or NULL for the portable path */
    uint32_t h[8];      /* portable: chaining value */
    uint8_t buf[64];    /* portable: partial block */
    uint64_t total;     /* portable: bytes absorbed */
} di_sha256;

/* Starts a digest. Returns false only when OpenSSL cannot allocate its context. */
bool di_sha256_init(di_sha256 *s);
void di_sha256_update(di_sha256 *s, const void *data, size_t len);
/* Writes the digest and releases the state (init again to reuse it). */
void di_sha256_final(di_sha256 *s, uint8_t out[DI_SHA256_BYTES]);
/* One-shot digest; false as di_sha256_init. */
bool di_sha256_of(const void *data, size_t len, uint8_t out[DI_SHA256_BYTES]);

/* The portable implementation alone (tests compare it with the default path). */
void di_sha256_portable(const void *data, size_t len, uint8_t out[DI_SHA256_BYTES]);
/* Whether the default path is OpenSSL's. */
bool di_sha256_is_openssl(void);

/* Lower-case hex of a digest into out[65]. */
void di_sha256_hex(const uint8_t d[DI_SHA256_BYTES], char out[2 * DI_SHA256_BYTES + 1]);
/* Parses 64 hex digits; false on anything else. */
bool di_sha256_parse_hex(const char *hex, uint8_t out[DI_SHA256_BYTES]);

#endif
