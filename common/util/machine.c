#include "common/util/machine.h"

#include <errno.h>
#include <stdio.h>
#include <string.h>
#include <sys/statvfs.h>
#include <unistd.h>

uint64_t di_machine_memory_bytes(void)
{
    long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGE_SIZE);
    if (pages <= 0 || page <= 0)
        return 0;
    return (uint64_t)pages * (uint64_t)page;
}

void di_machine_format_bytes(uint64_t b, char *buf, size_t n)
{
    static const char *const names[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"};
    double v = (double)b;
    int u = 0;
    while (v >= 1024.0 && u < 6) {
        v /= 1024.0;
        u++;
    }
    if (u == 0)
        snprintf(buf, n, "%llu B", (unsigned long long)b);
    else
        snprintf(buf, n, "%.2f %s", v, names[u]);
}

di_status di_machine_free_bytes(const char *path, uint64_t *out, di_error *err)
{
    char dir[4096];
    if (!path || !*path || strlen(path) >= sizeof(dir))
        return di_fail(err, DI_EINVAL, "no path to examine for free space");
    snprintf(dir, sizeof(dir), "%s", path);
    struct statvfs v;
    /* Walk up to the nearest existing directory: a file or directory about to be created. */
    while (statvfs(dir, &v) != 0) {
        int e = errno;
        char *slash = strrchr(dir, '/');
        if (e != ENOENT || (!slash && strcmp(dir, ".") == 0))
            return di_fail(err, DI_EIO, "cannot examine the free space of %s: %s", path,
                           strerror(e));
        if (!slash)
            snprintf(dir, sizeof(dir), ".");
        else if (slash == dir)
            slash[1] = '\0';
        else
            *slash = '\0';
    }
    *out = (uint64_t)v.f_bavail * (uint64_t)v.f_frsize;
    return DI_OK;
}

di_status di_machine_check_memory(const char *what, uint64_t bytes, di_error *err)
{
    uint64_t have = di_machine_memory_bytes();
    if (have == 0 || bytes <= have)
        return DI_OK;
    char a[32], b[32];
    di_machine_format_bytes(bytes, a, sizeof(a));
    di_machine_format_bytes(have, b, sizeof(b));
    return di_fail(err, DI_ERANGE, "%s %s exceeds the %s of physical memory of this machine",
                   what, a, b);
}

di_status di_machine_check_disk(const char *what, const char *path, uint64_t bytes,
                                di_error *err)
{
    uint64_t have;
    di_status st = di_machine_free_bytes(path, &have, err);
    if (st != DI_OK || bytes <= have)
        return st;
    char a[32], b[32];
    di_machine_format_bytes(bytes, a, sizeof(a));
    di_machine_format_bytes(have, b, sizeof(b));
    return di_fail(err, DI_ENOSPC, "%s (%s) exceeds the %s free where %s is written", what, a,
                   b, path);
}
