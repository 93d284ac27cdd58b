#include "kvstore/cli.h"

#include <stdio.h>

#include "common/util/machine.h"

void kvcli_format_size(uint64_t b, char *buf, size_t n)
{
    di_machine_format_bytes(b, buf, n);
}

void kvcli_format_duration(uint64_t ms, char *buf, size_t n)
{
    if (ms == UINT64_MAX)
        snprintf(buf, n, "never");
    else if (ms < 1000)
        snprintf(buf, n, "%llums", (unsigned long long)ms);
    else if (ms < 60000)
        snprintf(buf, n, "%llus", (unsigned long long)(ms / 1000));
    else if (ms < 3600000)
        snprintf(buf, n, "%llum %llus", (unsigned long long)(ms / 60000),
                 (unsigned long long)(ms / 1000 % 60));
    else if (ms < 86400000)
        snprintf(buf, n, "%lluh %llum", (unsigned long long)(ms / 3600000),
                 (unsigned long long)(ms / 60000 % 60));
    else
        snprintf(buf, n, "%llud %lluh", (unsigned long long)(ms / 86400000),
                 (unsigned long long)(ms / 3600000 % 24));
}
