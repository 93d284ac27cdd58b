/* hash64.h: a fast non-cryptographic 64-bit checksum for KV objects and other payloads.
 *
 * Four independent multiply-rotate lanes over 32-byte stripes, folded and finished with a
 * 64-bit avalanche. It detects corruption (bit flips, torn or truncated writes); it is not a
 * cryptographic hash (keys use SHA-256). Runs at memory speed on one core.
 */
#ifndef DI_UTIL_HASH64_H
#define DI_UTIL_HASH64_H

#include <stddef.h>
#include <stdint.h>

uint64_t di_hash64(const void *data, size_t len, uint64_t seed);

/* Copies len bytes from src to dst (which must not overlap) and returns di_hash64(src, len,
 * seed), in one pass: a verified copy costs about what a memcpy costs. */
uint64_t di_hash64_copy(void *dst, const void *src, size_t len, uint64_t seed);

#endif
