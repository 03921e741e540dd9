/*
 * tests/c/ref_rotate.h - the test reference of SOAP's m re-expression (op soap_rotate), in
 * plain triple loops and float64, shared by test_linalg.c and test_runtime.c.
 *
 * ref_soap_rotate: out = A_new^T (A_old X B_old^T) B_new for X (n x n1) row-major, pairs
 * (2, n, n) = (old, new) and (2, n1, n1); a NULL pair is the identity side. No state, no locks.
 */
#ifndef ASTERIA_TESTS_REF_ROTATE_H
#define ASTERIA_TESTS_REF_ROTATE_H

#include <stdlib.h>
#include <string.h>

/* out (r x c) = op(a) op(b), op(a) r x k, op(b) k x c; a is stored r x k (ta = 0) or k x r
 * (ta = 1), b is stored k x c (tb = 0) or c x k (tb = 1). out must not alias a or b. */
static void ref_mm(int r, int c, int k, const double *a, int ta, const double *b, int tb,
                   double *out)
{
    for (int i = 0; i < r; i++)
        for (int j = 0; j < c; j++) {
            double s = 0;
            for (int l = 0; l < k; l++)
                s += (ta ? a[(size_t)l * r + i] : a[(size_t)i * k + l]) *
                     (tb ? b[(size_t)j * k + l] : b[(size_t)l * c + j]);
            out[(size_t)i * c + j] = s;
        }
}

static void ref_soap_rotate(int n, int n1, const double *x, const double *ap, const double *bp,
                            double *out)
{
    const size_t nx = (size_t)n * n1;
    double *t = malloc(nx * sizeof *t), *u = malloc(nx * sizeof *u);
    if (!t || !u)
        abort();
    memcpy(u, x, nx * sizeof *u);
    if (ap) {
        ref_mm(n, n1, n, ap, 0, u, 0, t);                   /* t = A_old u */
        ref_mm(n, n1, n, ap + (size_t)n * n, 1, t, 0, u);   /* u = A_new^T t */
    }
    if (bp) {
        ref_mm(n, n1, n1, u, 0, bp, 1, t);                  /* t = u B_old^T */
        ref_mm(n, n1, n1, t, 0, bp + (size_t)n1 * n1, 0, u); /* u = t B_new */
    }
    memcpy(out, u, nx * sizeof *out);
    free(t);
    free(u);
}

#endif
