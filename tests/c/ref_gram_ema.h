/*
 * tests/c/ref_gram_ema.h - the test reference of SOAP's factor EMAs (op gram_ema), in plain
 * triple loops and float64, shared by test_linalg.c and test_runtime.c.
 *
 * ref_gram_ema: for G (n x n1) row-major, L_new = beta L + alpha G G^T (n x n) and
 * R_new = beta R + alpha G^T G (n1 x n1), written to l_new / r_new (either may be NULL: that
 * side is skipped). Every element of L and R is read as given (no symmetry assumed). No state,
 * no locks.
 */
#ifndef ASTERIA_TESTS_REF_GRAM_EMA_H
#define ASTERIA_TESTS_REF_GRAM_EMA_H

#include <stddef.h>

static void ref_gram_ema(int n, int n1, const double *g, double beta, double alpha,
                         const double *l, const double *r, double *l_new, double *r_new)
{
    if (l_new)
        for (int i = 0; i < n; i++)
            for (int j = 0; j < n; j++) {
                double s = 0;
                for (int k = 0; k < n1; k++)
                    s += g[(size_t)i * n1 + k] * g[(size_t)j * n1 + k];
                l_new[(size_t)i * n + j] = beta * l[(size_t)i * n + j] + alpha * s;
            }
    if (r_new)
        for (int i = 0; i < n1; i++)
            for (int j = 0; j < n1; j++) {
                double s = 0;
                for (int k = 0; k < n; k++)
                    s += g[(size_t)k * n1 + i] * g[(size_t)k * n1 + j];
                r_new[(size_t)i * n1 + j] = beta * r[(size_t)i * n1 + j] + alpha * s;
            }
}

#endif
