/* machine.h: what this machine can hold, for checking operator-given sizes before anything
 * is allocated or written: physical memory (sysconf) and the free space of a filesystem
 * (statvfs). The checks fail with a one-line message that names the option, the size asked
 * for and the limit ("--dram-bytes 1.00 TiB exceeds the 23.4 GiB of physical memory"). */
#ifndef DI_UTIL_MACHINE_H
#define DI_UTIL_MACHINE_H

#include <stddef.h>
#include <stdint.h>

#include "common/util/status.h"

/* Physical memory in bytes; 0 when the system does not say. */
uint64_t di_machine_memory_bytes(void);

/* Bytes an unprivileged writer may still write on the filesystem holding path (or, when path
 * does not exist yet, holding its nearest existing parent). DI_OK, or DI_EIO when neither can
 * be examined; *out written only on success. */
di_status di_machine_free_bytes(const char *path, uint64_t *out, di_error *err);

/* DI_OK when bytes fit in physical memory (or the memory is unknown); else DI_ERANGE naming
 * `what` and both sizes. */
di_status di_machine_check_memory(const char *what, uint64_t bytes, di_error *err);

/* DI_OK when bytes fit in the free space where path is (or will be) written; DI_ENOSPC naming
 * `what`, both sizes and the place; DI_EIO when the place cannot be examined. */
di_status di_machine_check_disk(const char *what, const char *path, uint64_t bytes,
                                di_error *err);

/* "1.50 GiB", "512 B": bytes for a message. */
void di_machine_format_bytes(uint64_t bytes, char *buf, size_t n);

#endif
