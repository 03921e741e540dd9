/*
 * test_helpers.h - fixtures the C tests share: the scratch directory root and reading a file
 * whole. Header-only (static inline), included by the test programs after cmocka.h; no state.
 */
#ifndef ASTERIA_TEST_HELPERS_H
#define ASTERIA_TEST_HELPERS_H

#include <stdio.h>
#include <stdlib.h>
#include <sys/stat.h>

/* The root for a test's scratch files: $ASTERIA_TEST_TMPDIR (ctest sets it to a folder of the
 * build tree), else /tmp; created if missing. */
static inline const char *test_tmp_root(void)
{
    const char *root = getenv("ASTERIA_TEST_TMPDIR");
    if (!root || !root[0])
        root = "/tmp";
    mkdir(root, 0777);
    return root;
}

/* The whole file at path as a NUL-terminated string (free it), or NULL if it cannot be read. */
static inline char *slurp(const char *path)
{
    FILE *f = fopen(path, "rb");
    if (!f)
        return NULL;
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *s = n < 0 ? NULL : malloc((size_t)n + 1);
    if (s)
        s[fread(s, 1, (size_t)n, f)] = '\0';
    fclose(f);
    return s;
}

#endif
