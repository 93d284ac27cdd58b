/* cli.h: how di-kvstore and di-kvctl print sizes and durations for people. Their options are
 * parsed by the project's one option table (common/service/options.h). */
#ifndef DI_KVSTORE_CLI_H
#define DI_KVSTORE_CLI_H

#include <stddef.h>
#include <stdint.h>

/* "1.50 GiB", "114048 B": a short human-readable size. */
void kvcli_format_size(uint64_t bytes, char *buf, size_t n);
/* "2d 23h", "59s", "350ms", "never" (for UINT64_MAX). */
void kvcli_format_duration(uint64_t ms, char *buf, size_t n);

#endif
