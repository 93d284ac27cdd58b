#include "common/util/outclose.h"

#include <errno.h>
#include <stdio.h>
#include <string.h>

int di_close_stdout(const char *prog, int rc)
{
    int earlier = ferror(stdout);
    errno = 0;
    int closed = fclose(stdout);
    if (!earlier && closed == 0)
        return rc;
    /* An error seen by an earlier write left no errno behind; fclose's own failure did. */
    int e = closed != 0 ? errno : 0;
    fprintf(stderr, "%s: cannot write the output%s%s\n", prog, e ? ": " : " (write error)",
            e ? strerror(e) : "");
    return rc ? rc : 1;
}
