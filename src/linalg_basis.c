/*
 * linalg_basis.c - canonical bases of null spaces (linalg_basis.h). A rank-deficient factor's
 * null space gets a basis that depends on the factor's range and on the caller's candidate
 * vectors only, not on the rounding noise LAPACK turned into unit vectors there; so eigh's and
 * the QR refreshes' results are a function of the factor (and of the previous basis). A
 * full-rank factor takes the plain path and is untouched. python/asteria/refresh/basis.py
 * states the rule and is its torch side; the two must agree to rounding
 * (tests/python/test_soap_basis.py).
 *
 * Owns: nothing that outlives a call; each call allocates its own workspace (linalg_prim.h) and
 * frees it before returning, so any thread may call in concurrently with no lock.
 * May call: the typed primitives of linalg_prim.h only (through them LAPACK and CBLAS). Called by
 * the kernels in linalg_kernels.c, on inputs already known finite.
 */
#include "linalg_basis.h"

#include "asteria/errors.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

/* n eps_m scale: what is rounding noise next to scale in a factor of size n (the floor of
 * k_inv_root; eigh's null space). */
static double null_tol(const ast__kern *K, int n, double scale)
{
    return (double)n * K->epsm * scale;
}

/* A refresh's dependent columns: the residual of a truly dependent column of F Q carries the
 * rounding of F's accumulation (its EMA over steps) as well as the QR's own, measured at up to
 * 42 eps_m max|R| for n = 24 in float64, so the QR's threshold is this many times null_tol. */
#define QR_TOL_SAFETY 8.0

/* y (n x m) -= U (U^T y), twice (orthogonal to rounding); U n x r; both column-major with
 * leading dimension n; ws holds r x m. */
static void project_off(const ast__kern *K, int n, int r, const void *u, int m, void *y, void *ws)
{
    for (int t = 0; r > 0 && t < 2; t++) {
        K->gemm_cm(CblasTrans, CblasNoTrans, r, m, n, 1.0, u, n, y, n, 0.0, ws, r);
        K->gemm_cm(CblasNoTrans, CblasNoTrans, n, m, r, -1.0, u, n, ws, r, 1.0, y, n);
    }
}

/* Columns r..n-1 of basis (n x n column-major, columns 0..r-1 orthonormal) <- an orthonormal
 * basis of the complement of the first r: Gram-Schmidt of the c candidates cand (n x c
 * column-major), then of the identity's columns, each accepted when its residual exceeds
 * 1 / (2 sqrt(n)); Gram-Schmidt's signs. When all candidates are accepted that is one QR of them
 * projected, which is tried first. */
static int complete(const ast__kern *K, int n, int r, void *basis, const void *cand, int c)
{
    const int need = n - r;
    const size_t es = K->es;
    if (need == 0)
        return 0;
    const double delta = 0.5 / sqrt((double)n);
    char *b = basis, *dst = b + (size_t)r * n * es;
    size_t sz[2] = {(size_t)n * n * es, (size_t)n * sizeof(double)};
    void *buf[2];
    void *base = ast__ws_alloc(2, sz, buf);
    if (!base)
        return AST_ENOMEM;
    double *rd = buf[1];
    int rc = 0, fast = 0;
    if (c == need) {
        memcpy(dst, cand, (size_t)n * need * es);
        project_off(K, n, r, b, need, dst, buf[0]);
        rc = ast__qr_cols(K, n, need, dst, rd);
        fast = rc == 0;
        for (int j = 0; fast && j < need; j++)
            fast = fabs(rd[j]) > delta;
        for (int j = 0; fast && j < need; j++)
            if (rd[j] < 0)
                K->scal(n, -1.0, dst + (size_t)j * n * es);
    }
    if (rc == 0 && !fast) {
        int have = 0;
        for (int i = 0; i < c + n && have < need; i++) {
            char *y = dst + (size_t)have * n * es;
            if (i < c) {
                memcpy(y, (const char *)cand + (size_t)i * n * es, (size_t)n * es);
            } else {
                memset(y, 0, (size_t)n * es);
                K->set(y, (size_t)(i - c), 1.0);
            }
            project_off(K, n, r + have, b, 1, y, buf[0]);
            double nrm = sqrt(K->dot(n, y, 1, y, 1));
            if (nrm > delta) {
                K->scal(n, 1.0 / nrm, y);
                have++;
            }
        }
        if (have < need) /* cannot happen: the identity alone fills the space (basis.py) */
            rc = AST_ENOCONV;
    }
    free(base);
    return rc;
}

int ast__eigh_vectors(const ast__kern *K, int n, const void *z_cm, const void *w, void *out)
{
    const size_t es = K->es, nn = (size_t)n * n, col = (size_t)n * es;
    const double tol =
        null_tol(K, n, fmax(fabs(K->get(w, 0)), fabs(K->get(w, (size_t)n - 1))));
    int d = 0;
    for (int j = 0; j < n; j++)
        d += fabs(K->get(w, (size_t)j)) <= tol;
    if (d == 0) {
        K->transpose(n, z_cm, out, 1);
        return 0;
    }
    const int r = n - d;
    size_t sz[3] = {nn * es, (size_t)d * col, nn * es};
    void *buf[3];
    void *base = ast__ws_alloc(3, sz, buf);
    if (!base)
        return AST_ENOMEM;
    char *basis = buf[0], *cand = buf[1], *final = buf[2];
    memset(cand, 0, (size_t)d * col);
    /* descending position j is ascending column n - 1 - j */
    for (int j = 0, ui = 0, ni = 0; j < n; j++) {
        if (fabs(K->get(w, (size_t)(n - 1 - j))) <= tol)
            K->set(cand, (size_t)ni++ * n + (size_t)j, 1.0);
        else
            memcpy(basis + (size_t)ui++ * col, (const char *)z_cm + (size_t)(n - 1 - j) * col,
                   col);
    }
    int rc = complete(K, n, r, basis, cand, d);
    if (rc == 0) {
        for (int j = 0, ui = 0, ni = r; j < n; j++) {
            int null = fabs(K->get(w, (size_t)(n - 1 - j))) <= tol;
            memcpy(final + (size_t)j * col, basis + (size_t)(null ? ni++ : ui++) * col, col);
        }
        K->transpose(n, final, out, 0);
    }
    free(base);
    return rc;
}

/* The QR refresh where C = F Q[:, s] (c_cm holds F Q, columns unsorted; s = r[j].i) has
 * dependent columns (R's diagonal rd at most tol): the QR of the independent columns alone (any
 * found dependent there too is added to them, until none is) at their positions, the completion
 * from the previous basis's columns (q, row-major) at the dependent ones. Writes Q_new row-major
 * to out. */
static int qr_canonical(const ast__kern *K, int n, const char *c_cm, const ast__ranked *r,
                        const void *q, const double *rd, double tol, void *out)
{
    const size_t es = K->es, nn = (size_t)n * n, col = (size_t)n * es;
    size_t sz[5] = {nn * es, nn * es, nn * es, (size_t)n * sizeof(int), (size_t)n * sizeof(double)};
    void *buf[5];
    void *base = ast__ws_alloc(5, sz, buf);
    if (!base)
        return AST_ENOMEM;
    char *a = buf[0], *basis = buf[1], *cand = buf[2];
    int *dep = buf[3];
    double *rd2 = buf[4];
    int rc = 0, m = 0, d = 0;
    for (int j = 0; j < n; j++)
        dep[j] = fabs(rd[j]) <= tol;
    for (;;) {
        m = 0;
        for (int j = 0; j < n; j++)
            if (!dep[j])
                memcpy(a + (size_t)m++ * col, c_cm + (size_t)r[j].i * col, col);
        if (m == 0 || (rc = ast__qr_cols(K, n, m, a, rd2)) != 0)
            break;
        int bad = 0;
        for (int j = 0, i = 0; j < n; j++)
            if (!dep[j] && fabs(rd2[i++]) <= tol)
                dep[j] = bad = 1;
        if (!bad)
            break;
    }
    if (rc == 0) {
        memcpy(basis, a, (size_t)m * col);
        for (int j = 0; j < n; j++)
            if (dep[j]) {
                for (int i = 0; i < n; i++)
                    K->set(cand, (size_t)d * n + i, K->get(q, (size_t)i * n + (size_t)r[j].i));
                d++;
            }
        rc = complete(K, n, m, basis, cand, d);
    }
    if (rc == 0) {
        for (int j = 0, ui = 0, ni = m; j < n; j++)
            memcpy(a + (size_t)j * col, basis + (size_t)(dep[j] ? ni++ : ui++) * col, col);
        K->transpose(n, a, out, 0);
    }
    free(base);
    return rc;
}

/* The common case of qr_canonical: the dependent columns are the trailing n - m, so the QR of
 * the independent ones is the first m columns of the full QR's Q (g_cm), and its other columns W
 * are an orthonormal basis of their complement. The completion from the previous basis's columns
 * cand (q's columns r[j].i, j >= m) is then W qr(W^T cand) with Gram-Schmidt's signs, written
 * over W. AST_ENOCONV when a candidate falls short of complete()'s threshold (the caller takes
 * the general path). */
static int complete_trailing(const ast__kern *K, int n, int m, void *g_cm, const ast__ranked *r,
                             const void *q)
{
    const int d = n - m;
    const size_t es = K->es, col = (size_t)n * es;
    size_t sz[4] = {(size_t)d * col, (size_t)d * d * es, (size_t)d * col,
                    (size_t)d * sizeof(double)};
    void *buf[4];
    void *base = ast__ws_alloc(4, sz, buf);
    if (!base)
        return AST_ENOMEM;
    char *cand = buf[0], *w = (char *)g_cm + (size_t)m * col, *mm = buf[1];
    double *rd = buf[3];
    for (int j = 0; j < d; j++)
        for (int i = 0; i < n; i++)
            K->set(cand, (size_t)j * n + i, K->get(q, (size_t)i * n + (size_t)r[m + j].i));
    K->gemm_cm(CblasTrans, CblasNoTrans, d, d, n, 1.0, w, n, cand, n, 0.0, mm, d);
    int rc = ast__qr_cols(K, d, d, mm, rd);
    const double delta = 0.5 / sqrt((double)n);
    for (int j = 0; rc == 0 && j < d; j++)
        if (!(fabs(rd[j]) > delta))
            rc = AST_ENOCONV;
    if (rc == 0) {
        for (int j = 0; j < d; j++)
            if (rd[j] < 0)
                K->scal(d, -1.0, mm + (size_t)j * d * es);
        K->gemm_cm(CblasNoTrans, CblasNoTrans, n, d, d, 1.0, w, n, mm, d, 0.0, buf[2], n);
        memcpy(w, buf[2], (size_t)d * col);
    }
    free(base);
    return rc;
}

int ast__qr_refresh_q(const ast__kern *K, int n, const char *c_cm, void *g_cm,
                      const ast__ranked *r, const void *q, double *rd, void *out)
{
    int rc = ast__qr_cols(K, n, n, g_cm, rd);
    if (rc != 0)
        return rc;
    double rmax = 0;
    for (int j = 0; j < n; j++)
        rmax = fmax(rmax, fabs(rd[j]));
    const double tol = QR_TOL_SAFETY * null_tol(K, n, rmax);
    int m = 0, trailing = 1;
    while (m < n && fabs(rd[m]) > tol)
        m++;
    for (int j = m; j < n; j++)
        trailing &= fabs(rd[j]) <= tol;
    if (m == n) {
        K->transpose(n, g_cm, out, 0);
        return 0;
    }
    if (m > 0 && trailing) {
        rc = complete_trailing(K, n, m, g_cm, r, q);
        if (rc == 0) {
            K->transpose(n, g_cm, out, 0);
            return 0;
        }
        if (rc != AST_ENOCONV)
            return rc;
    }
    return qr_canonical(K, n, c_cm, r, q, rd, tol, out);
}
