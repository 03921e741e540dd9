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

/* out = beta in + alpha V V^T for the dim x inner matrix V whose (i, k) is g[i * rs + k * cs]:
 * V = G (rs = n1, cs = 1) gives L, V = G^T (rs = 1, cs = n1) gives R. */
static void ref_ema_side(int dim, int inner, const double *g, size_t rs, size_t cs, double beta,
                         double alpha, const double *in, double *out)
{
    for (int i = 0; i < dim; i++)
        for (int j = 0; j < dim; j++) {
            double s = 0;
            for (int k = 0; k < inner; k++)
                s += g[(size_t)i * rs + (size_t)k * cs] * g[(size_t)j * rs + (size_t)k * cs];
            out[(size_t)i * dim + j] = beta * in[(size_t)i * dim + j] + alpha * s;
        }
}

static void ref_gram_ema(int n, int n1, const double *g, double beta, double alpha,
                         const double *l, const double *r, double *l_new, double *r_new)
{
    if (l_new)
        ref_ema_side(n, n1, g, (size_t)n1, 1, beta, alpha, l, l_new);
    if (r_new)
        ref_ema_side(n1, n, g, 1, (size_t)n1, beta, alpha, r, r_new);
}

#endif
