/* tmpdir.h: a scratch directory per test (Criterion runs each test in its own process). */
#ifndef DI_TESTS_MODEL_TMPDIR_H
#define DI_TESTS_MODEL_TMPDIR_H

#include <criterion/criterion.h>
#include <stdio.h>
#include <stdlib.h>

/* Creates /tmp/di_<tag>_XXXXXX into dir (cap bytes). */
static inline void tmpdir_make(char *dir, size_t cap, const char *tag)
{
    snprintf(dir, cap, "/tmp/di_%s_XXXXXX", tag);
    cr_assert_not_null(mkdtemp(dir));
}

/* Removes it and everything inside. */
static inline void tmpdir_remove(const char *dir)
{
    char cmd[600];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
    cr_assert_eq(system(cmd), 0);
}

#endif
