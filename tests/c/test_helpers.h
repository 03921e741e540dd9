/*
 * test_helpers.h - fixtures the C tests share: the scratch directory root, reading a file whole,
 * and deterministic random numbers. Header-only (static inline), included by the test programs
 * after cmocka.h; its one state is the random generator's, one per test program.
 */
#ifndef ASTERIA_TEST_HELPERS_H
#define ASTERIA_TEST_HELPERS_H

#include <math.h>
#include <stdint.h>
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

/* ---- deterministic random numbers (xorshift64*) ----------------------------------------- */

static inline uint64_t *rng_state(void)
{
    static uint64_t state;
    return &state;
}

static inline void rng_seed(uint64_t s) { *rng_state() = s * 0x9e3779b97f4a7c15ULL + 1; }

/* Uniform on [0, 1), 53 bits. */
static inline double urand(void)
{
    uint64_t *x = rng_state();
    *x ^= *x >> 12;
    *x ^= *x << 25;
    *x ^= *x >> 27;
    return (double)((*x * 2685821657736338717ULL) >> 11) * 0x1p-53;
}

/* Standard normal (Box-Muller). */
static inline double nrand(void)
{
    double u1 = urand(), u2 = urand();
    return sqrt(-2 * log(u1 + 0x1p-60)) * cos(2 * 3.14159265358979323846 * u2);
}

#endif
