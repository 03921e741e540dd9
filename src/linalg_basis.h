/*
 * linalg_basis.h - canonical bases of null spaces, for the host REFRESH kernels
 * (linalg_kernels.c): eigh's eigenvectors and a QR refresh's Q_new where the factor is
 * rank-deficient. Internal (ast__ prefix; not installed, not in asteria.map). Implemented by
 * linalg_basis.c.
 */
#ifndef ASTERIA_LINALG_BASIS_H
#define ASTERIA_LINALG_BASIS_H

#include "linalg_prim.h"

/* One column of a QR refresh: its rank key e (diag(Q^T F Q) for SOAP) and its index in F Q. */
typedef struct ast__ranked {
    double e;
    int64_t i;
} ast__ranked;

/* The eigenvectors z_cm (columns in ascending order of w) into the row-major out (n x n) in
 * descending order, the null space (|w| <= n eps_m max |w|) given the identity's columns at its
 * positions as candidates. Returns 0, AST_ENOMEM or AST_ENOCONV. */
int ast__eigh_vectors(const ast__kern *K, int n, const void *z_cm, const void *w, void *out);

/* Q_new of a QR refresh into the row-major out: the QR of g_cm = C = (F Q)[:, s] (overwritten),
 * canonical where C has dependent columns (qr_canonical: c_cm = F Q, s = r[j].i, q the previous
 * basis); rd: n doubles of workspace. Returns 0 or ast__qr_cols's codes. */
int ast__qr_refresh_q(const ast__kern *K, int n, const char *c_cm, void *g_cm,
                      const ast__ranked *r, const void *q, double *rd, void *out);

#endif
