/* outclose.h: a binary's exit status once its output is written. Output that could not be
 * written (a full disk, /dev/full, a closed pipe with SIGPIPE ignored) is a failure: the
 * binary exits non-zero with one line on stderr instead of 0 with the output lost. */
#ifndef DI_UTIL_OUTCLOSE_H
#define DI_UTIL_OUTCLOSE_H

/* Flushes and closes stdout. Returns rc when stdout was written in full; otherwise prints
 * "PROG: cannot write the output: REASON" on stderr and returns rc, or 1 when rc is 0. Call
 * once, last thing in main: `return di_close_stdout("di-plan", rc);`. */
int di_close_stdout(const char *prog, int rc);

#endif
