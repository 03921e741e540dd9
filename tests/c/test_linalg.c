/*
 * test_linalg.c - asteria/linalg.h against matrices with known spectra and against plain
 * restatements of every formula in the header (soap_rotate and gram_ema against plain triple
 * loops).
 *
 * The restatements are float64 and use other LAPACK drivers than the code under test where one
 * exists (?syev, the QR algorithm, for the eigen-formula; row-major LAPACKE for the QR), so a
 * shared mistake in layout or ordering does not cancel out.
 *
 * Tolerances have the form C * n * u * kappa. A backward-stable O(n^3) kernel returns the exact
 * answer for an input perturbed by a small multiple of n u ||A|| (u = unit roundoff: 2^-24 for
 * float32, 2^-53 for float64); the quantity compared amplifies that by at most its condition
 * number kappa (1 for residuals and orthogonality, cond(A) for a smooth function of A such as
 * an inverse root or a QR factor). C = 10 absorbs the constant in front of n u without letting
 * an O(1) bug (wrong order, wrong transpose, wrong sign convention) through.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>

#include "asteria/errors.h"
#include "asteria/linalg.h"

#include "ref_gram_ema.h"
#include "ref_rotate.h"
#include "test_helpers.h"

#include <cblas.h>
#include <lapacke.h>
#include <float.h>
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define U32 0x1p-24
#define U64 0x1p-53
#define TOL_C 10.0
#define SENTINEL 0xA5

#define assert_le(x, bound)                                                                    \
    do {                                                                                       \
        double x_ = (x), b_ = (bound);                                                         \
        if (!(x_ <= b_))                                                                       \
            fail_msg("%s = %.3e exceeds %.3e (line %d)", #x, x_, b_, __LINE__);                 \
    } while (0)

static const ast_dtype dtypes[] = {AST_F64, AST_F32};

static double uround(ast_dtype dt) { return dt == AST_F32 ? U32 : U64; }
static double tol_for(ast_dtype dt, int n, double kappa) { return TOL_C * n * uround(dt) * kappa; }

/* ---- buffers ------------------------------------------------------------------------------ */

static void *xalloc(size_t bytes)
{
    void *p = aligned_alloc(64, (bytes + 63) & ~(size_t)63);
    assert_non_null(p);
    return p;
}

static double *dalloc(size_t count) { return xalloc(count * sizeof(double)); }

/* Frees the buffers listed up to the terminating NULL (xalloc's are never NULL). */
static void free_all(void *p, ...) __attribute__((sentinel));
static void free_all(void *p, ...)
{
    va_list ap;
    va_start(ap, p);
    for (; p; p = va_arg(ap, void *))
        free(p);
    va_end(ap);
}

/* Save the element of dtype dt at p into saved (8 bytes) and overwrite it with v. */
static void poison_elem(char *p, ast_dtype dt, double v, char saved[8])
{
    memcpy(saved, p, ast_dtype_size(dt));
    if (dt == AST_F32)
        *(float *)p = (float)v;
    else
        *(double *)p = v;
}

/* A copy of src in dtype dt (float64 values rounded for float32). */
static void *to_dt(ast_dtype dt, size_t count, const double *src)
{
    void *p = xalloc(count * ast_dtype_size(dt));
    for (size_t i = 0; i < count; i++) {
        if (dt == AST_F32)
            ((float *)p)[i] = (float)src[i];
        else
            ((double *)p)[i] = src[i];
    }
    return p;
}

static void from_dt(ast_dtype dt, size_t count, const void *src, double *dst)
{
    for (size_t i = 0; i < count; i++)
        dst[i] = dt == AST_F32 ? ((const float *)src)[i] : ((const double *)src)[i];
}

/* Rounds to dt and back: the input a float32 call actually sees. */
static void round_to(ast_dtype dt, size_t count, double *v)
{
    if (dt == AST_F32)
        for (size_t i = 0; i < count; i++)
            v[i] = (float)v[i];
}

static void fill_sentinel(void *p, size_t bytes) { memset(p, SENTINEL, bytes); }

static int sentinel_intact(const void *p, size_t bytes)
{
    const unsigned char *c = p;
    for (size_t i = 0; i < bytes; i++)
        if (c[i] != SENTINEL)
            return 0;
    return 1;
}

/* ---- float64 row-major matrix helpers (n x n) ---------------------------------------------- */

static void mm(int n, const double *a, const double *b, double *c)
{
    cblas_dgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, n, n, n, 1, a, n, b, n, 0, c, n);
}

static void mtm(int n, const double *a, const double *b, double *c)
{
    cblas_dgemm(CblasRowMajor, CblasTrans, CblasNoTrans, n, n, n, 1, a, n, b, n, 0, c, n);
}

static void eye(int n, double *a, double c)
{
    memset(a, 0, (size_t)n * n * sizeof *a);
    for (int i = 0; i < n; i++)
        a[(size_t)i * n + i] = c;
}

static double fro(size_t count, const double *a)
{
    double s = 0;
    for (size_t i = 0; i < count; i++)
        s += a[i] * a[i];
    return sqrt(s);
}

static double fro_diff(size_t count, const double *a, const double *b)
{
    double s = 0;
    for (size_t i = 0; i < count; i++)
        s += (a[i] - b[i]) * (a[i] - b[i]);
    return sqrt(s);
}

static double rel_diff(size_t count, const double *a, const double *ref)
{
    return fro_diff(count, a, ref) / fro(count, ref);
}

/* ||A - c I||_F */
static double dist_eye(int n, const double *a, double c)
{
    double s = 0;
    for (int i = 0; i < n; i++)
        for (int j = 0; j < n; j++) {
            double d = a[(size_t)i * n + j] - (i == j ? c : 0);
            s += d * d;
        }
    return sqrt(s);
}

/* Q factor of a Householder QR, row-major, through LAPACKE's row-major interface. */
static void qr_q_ref(int n, double *g)
{
    double *tau = dalloc((size_t)n);
    assert_int_equal(LAPACKE_dgeqrf(LAPACK_ROW_MAJOR, n, n, g, n, tau), 0);
    assert_int_equal(LAPACKE_dorgqr(LAPACK_ROW_MAJOR, n, n, n, g, n, tau), 0);
    free(tau);
}

static void rand_orthogonal(int n, double *u)
{
    for (size_t i = 0; i < (size_t)n * n; i++)
        u[i] = nrand();
    qr_q_ref(n, u);
}

/* a = U diag(lam) U^T, made exactly symmetric (the kernels read one triangle). */
static void from_spectrum(int n, const double *lam, const double *u, double *a)
{
    double *b = dalloc((size_t)n * n);
    for (int i = 0; i < n; i++)
        for (int j = 0; j < n; j++)
            b[(size_t)i * n + j] = u[(size_t)i * n + j] * lam[j];
    cblas_dgemm(CblasRowMajor, CblasNoTrans, CblasTrans, n, n, n, 1, b, n, u, n, 0, a, n);
    for (int i = 0; i < n; i++)
        for (int j = i + 1; j < n; j++)
            a[(size_t)i * n + j] = a[(size_t)j * n + i] =
                0.5 * (a[(size_t)i * n + j] + a[(size_t)j * n + i]);
    free(b);
}

/* A random symmetric matrix with spectrum lam; U receives the eigenbasis when non-NULL. */
static double *rand_with_spectrum(int n, const double *lam, double *u_out)
{
    double *u = u_out ? u_out : dalloc((size_t)n * n), *a = dalloc((size_t)n * n);
    rand_orthogonal(n, u);
    from_spectrum(n, lam, u, a);
    if (!u_out)
        free(u);
    return a;
}

static void sort_desc(int n, double *v)
{
    for (int i = 1; i < n; i++)
        for (int j = i; j > 0 && v[j - 1] < v[j]; j--) {
            double t = v[j];
            v[j] = v[j - 1];
            v[j - 1] = t;
        }
}

static double max_abs(int n, const double *v)
{
    double m = 0;
    for (int i = 0; i < n; i++)
        m = fmax(m, fabs(v[i]));
    return m;
}

/* ---- restatements ------------------------------------------------------------------------- */

/* X = Q diag((max(l, n DBL_EPSILON l_max)+eps)^(-1/p)) Q^T with Q, l from dsyev. */
static void inv_root_ref(int n, const double *a, double p, double eps, double *x)
{
    double *z = dalloc((size_t)n * n), *w = dalloc((size_t)n), *b = dalloc((size_t)n * n);
    memcpy(z, a, (size_t)n * n * sizeof *z);
    assert_int_equal(LAPACKE_dsyev(LAPACK_ROW_MAJOR, 'V', 'U', n, z, n, w), 0);
    double lmax = 0;
    for (int j = 0; j < n; j++)
        lmax = fmax(lmax, w[j]);
    const double floor = n * DBL_EPSILON * lmax;
    for (int i = 0; i < n; i++)
        for (int j = 0; j < n; j++)
            b[(size_t)i * n + j] = z[(size_t)i * n + j] * pow(fmax(w[j], floor) + eps, -1 / p);
    cblas_dgemm(CblasRowMajor, CblasNoTrans, CblasTrans, n, n, n, 1, b, n, z, n, 0, x, n);
    free_all(z, w, b, NULL);
}

/* ||X^p (A + eps I) - I||_F */
static double root_residual(int n, const double *x, int p, const double *a, double eps)
{
    const size_t nn = (size_t)n * n;
    double *acc = dalloc(nn), *t = dalloc(nn), *ap = dalloc(nn);
    memcpy(ap, a, nn * sizeof *ap);
    for (int i = 0; i < n; i++)
        ap[(size_t)i * n + i] += eps;
    memcpy(acc, ap, nn * sizeof *acc);
    for (int k = 0; k < p; k++) {
        mm(n, x, acc, t);
        memcpy(acc, t, nn * sizeof *acc);
    }
    double r = dist_eye(n, acc, 1);
    free_all(acc, t, ap, NULL);
    return r;
}

/* e = diag(Q^T F Q); s = stable argsort descending; Q_new = qr(F Q[:, s]).Q */
static void soap_ref(int n, const double *f, const double *q, double *q_new, int64_t *perm)
{
    const size_t nn = (size_t)n * n;
    double *fq = dalloc(nn), *c = dalloc(nn), *e = dalloc((size_t)n), *qs = dalloc(nn);
    mm(n, f, q, fq);
    mtm(n, q, fq, c);
    for (int j = 0; j < n; j++) {
        e[j] = c[(size_t)j * n + j];
        perm[j] = j;
    }
    for (int i = 1; i < n; i++)
        for (int j = i; j > 0 && e[perm[j - 1]] < e[perm[j]]; j--) {
            int64_t t = perm[j];
            perm[j] = perm[j - 1];
            perm[j - 1] = t;
        }
    for (int i = 0; i < n; i++)
        for (int j = 0; j < n; j++)
            qs[(size_t)i * n + j] = q[(size_t)i * n + perm[j]];
    mm(n, f, qs, q_new);
    qr_q_ref(n, q_new);
    free_all(fq, c, e, qs, NULL);
}

static void kl_ref(int n, const double *f, const double *q, double *q_new)
{
    mm(n, f, q, q_new);
    qr_q_ref(n, q_new);
}

/* ---- calls through a dtype (float64 in, float64 out) --------------------------------------- */

static int call_eigh(ast_dtype dt, int n, const double *a, double *w, double *q)
{
    const size_t nn = (size_t)n * n, es = ast_dtype_size(dt);
    void *ad = to_dt(dt, nn, a), *wd = xalloc(n * es), *qd = xalloc(nn * es);
    void *acopy = xalloc(nn * es);
    memcpy(acopy, ad, nn * es);
    int rc = ast_linalg_eigh(dt, n, ad, w ? wd : NULL, q ? qd : NULL);
    assert_memory_equal(acopy, ad, nn * es); /* the input is only read */
    if (rc == 0 && w)
        from_dt(dt, (size_t)n, wd, w);
    if (rc == 0 && q)
        from_dt(dt, nn, qd, q);
    free_all(ad, wd, qd, acopy, NULL);
    return rc;
}

static int call_inv_root(ast_dtype dt, int n, const double *a, double p, double eps, double *x)
{
    const size_t nn = (size_t)n * n;
    void *ad = to_dt(dt, nn, a), *xd = xalloc(nn * ast_dtype_size(dt));
    int rc = ast_linalg_inv_root(dt, n, ad, p, eps, xd);
    if (rc == 0)
        from_dt(dt, nn, xd, x);
    free(ad);
    free(xd);
    return rc;
}

static int call_newton(ast_dtype dt, int n, const double *a, int p, double eps, int max_iter,
                       double tol, double *x)
{
    const size_t nn = (size_t)n * n;
    void *ad = to_dt(dt, nn, a), *xd = xalloc(nn * ast_dtype_size(dt));
    int rc = ast_linalg_newton_inv_root(dt, n, ad, p, eps, max_iter, tol, xd);
    if (rc == 0)
        from_dt(dt, nn, xd, x);
    free(ad);
    free(xd);
    return rc;
}

static int call_refresh(ast_dtype dt, int n, const double *f, const double *q, double *q_new,
                        int64_t *perm)
{
    const size_t nn = (size_t)n * n;
    void *fd = to_dt(dt, nn, f), *qd = to_dt(dt, nn, q), *od = xalloc(nn * ast_dtype_size(dt));
    int rc = perm ? ast_linalg_soap_refresh(dt, n, fd, qd, od, perm)
                  : ast_linalg_qr_refresh(dt, n, fd, qd, od);
    if (rc == 0)
        from_dt(dt, nn, od, q_new);
    free_all(fd, qd, od, NULL);
    return rc;
}

/* ---- checks -------------------------------------------------------------------------------- */

/* w descending; ||A Q - Q diag(w)||_F <= tol ||A||_F; ||Q^T Q - I||_F <= tol. */
static void check_eigh(int n, const double *a, const double *w, const double *q, double tol)
{
    const size_t nn = (size_t)n * n;
    double *aq = dalloc(nn), *qtq = dalloc(nn);
    for (int j = 1; j < n; j++)
        if (!(w[j - 1] >= w[j]))
            fail_msg("eigenvalues not descending at %d: %g < %g", j, w[j - 1], w[j]);
    mm(n, a, q, aq);
    for (int i = 0; i < n; i++)
        for (int j = 0; j < n; j++)
            aq[(size_t)i * n + j] -= q[(size_t)i * n + j] * w[j];
    assert_le(fro(nn, aq), tol * fmax(fro(nn, a), 1e-300));
    mtm(n, q, q, qtq);
    assert_le(dist_eye(n, qtq, 1), tol);
    free(aq);
    free(qtq);
}

static void check_orthonormal(int n, const double *q, double tol)
{
    double *qtq = dalloc((size_t)n * n);
    mtm(n, q, q, qtq);
    assert_le(dist_eye(n, qtq, 1), tol);
    free(qtq);
}

/* ---- eigh ------------------------------------------------------------------------------------ */

static void test_dtype_size(void **state)
{
    (void)state;
    assert_int_equal(ast_dtype_size(AST_F32), 4);
    assert_int_equal(ast_dtype_size(AST_F64), 8);
    assert_int_equal(ast_dtype_size((ast_dtype)7), 0);
}

static void test_eigh_identity(void **state)
{
    (void)state;
    static const int sizes[] = {1, 5, 64};
    for (size_t d = 0; d < 2; d++)
        for (size_t s = 0; s < 3; s++) {
            const int n = sizes[s];
            double *a = dalloc((size_t)n * n), *w = dalloc((size_t)n), *q = dalloc((size_t)n * n);
            eye(n, a, 1);
            assert_int_equal(call_eigh(dtypes[d], n, a, w, q), 0);
            for (int j = 0; j < n; j++)
                assert_le(fabs(w[j] - 1), tol_for(dtypes[d], n, 1));
            check_eigh(n, a, w, q, tol_for(dtypes[d], n, 1));
            free_all(a, w, q, NULL);
        }
}

/* A diagonal matrix's eigenvectors are unit vectors: checks the ordering and the
 * "eigenvectors as columns" layout exactly. */
static void test_eigh_diagonal(void **state)
{
    (void)state;
    static const double lam[] = {-3, 0.5, 7, 2, -1, 4.25, 0, 9, 1.5};
    const int n = 9;
    for (size_t d = 0; d < 2; d++) {
        double *a = dalloc(81), *w = dalloc(9), *q = dalloc(81), sorted[9];
        memset(a, 0, 81 * sizeof *a);
        for (int i = 0; i < n; i++)
            a[i * n + i] = lam[i];
        memcpy(sorted, lam, sizeof sorted);
        sort_desc(n, sorted);
        assert_int_equal(call_eigh(dtypes[d], n, a, w, q), 0);
        for (int j = 0; j < n; j++) {
            assert_le(fabs(w[j] - sorted[j]), tol_for(dtypes[d], n, 1) * 9);
            for (int i = 0; i < n; i++)
                assert_le(fabs(fabs(q[i * n + j]) - (lam[i] == sorted[j])),
                          tol_for(dtypes[d], n, 1));
        }
        free_all(a, w, q, NULL);
    }
}

/* A rank-deficient factor (python/asteria/refresh/basis.py has the rule, and
 * tests/python/test_soap_basis.py checks it against the torch executor): the null space keeps the
 * previous basis's columns where they span it (SOAP and KL refreshes), a zero factor keeps the
 * whole basis, and eigh's null columns are orthonormal eigenvectors of eigenvalue 0. */
static void test_rank_deficient_bases(void **state)
{
    (void)state;
    static const double lam[] = {3, 2, 1, 0, 0, 0, 0, 0, 0};
    const int n = 9, r = 3;
    const size_t nn = (size_t)n * n;
    for (size_t d = 0; d < 2; d++) {
        const double tol = tol_for(dtypes[d], n, 10);
        double *u = dalloc(nn), *f = dalloc(nn), *q = dalloc(nn), *w = dalloc((size_t)n);
        int64_t perm[9];
        rand_orthogonal(n, u);
        from_spectrum(n, lam, u, f);
        for (int kind = 0; kind < 2; kind++) {
            assert_int_equal(call_refresh(dtypes[d], n, f, u, q, kind ? perm : NULL), 0);
            check_orthonormal(n, q, tol);
            for (int j = r; j < n; j++) { /* e is rounding noise there: any order */
                const int64_t k = kind ? perm[j] : j;
                for (int i = 0; i < n; i++)
                    assert_le(fabs(q[(size_t)i * n + j] - u[(size_t)i * n + k]), tol);
            }
        }
        memset(f, 0, nn * sizeof *f);
        assert_int_equal(call_refresh(dtypes[d], n, f, u, q, perm), 0);
        for (int j = 0; j < n; j++) /* e all 0: the stable order */
            assert_int_equal(perm[j], j);
        for (size_t i = 0; i < nn; i++)
            assert_le(fabs(q[i] - u[i]), tol);
        from_spectrum(n, lam, u, f);
        assert_int_equal(call_eigh(dtypes[d], n, f, w, q), 0);
        check_eigh(n, f, w, q, tol);
        free_all(u, f, q, w, NULL);
    }
}

/* n = 1: every kernel reduces to scalar arithmetic. */
static void test_one_by_one(void **state)
{
    (void)state;
    const double a = 4, q = -1;
    double w, v, x;
    int64_t perm = 7;
    for (size_t d = 0; d < 2; d++) {
        const ast_dtype dt = dtypes[d];
        assert_int_equal(call_eigh(dt, 1, &a, &w, &v), 0);
        assert_true(w == 4 && fabs(v) == 1);
        assert_int_equal(call_inv_root(dt, 1, &a, 2, 0, &x), 0);
        assert_le(fabs(x - 0.5), 2 * uround(dt));
        assert_int_equal(call_newton(dt, 1, &a, 2, 0, 50, 1e-6, &x), 0);
        assert_le(fabs(x - 0.5), 1e-6);
        assert_int_equal(call_refresh(dt, 1, &a, &q, &x, &perm), 0);
        assert_true(fabs(x) == 1 && perm == 0);
        assert_int_equal(call_refresh(dt, 1, &a, &q, &x, NULL), 0);
        assert_true(fabs(x) == 1);
    }
}

typedef enum spectrum { SP_RANDOM, SP_RANK_DEFICIENT, SP_ILL, SP_CLUSTERED } spectrum;

/* float64 cond 1e8; float32 cond 1e6 (its 1/u is 1.7e7, so 1e8 would be rank-deficient). */
static void make_spectrum(spectrum sp, ast_dtype dt, int n, double *lam)
{
    for (int i = 0; i < n; i++) {
        switch (sp) {
        case SP_RANDOM:
            lam[i] = 10 * urand() - 5;
            break;
        case SP_RANK_DEFICIENT:
            lam[i] = i < n / 3 ? 1 + urand() : 0;
            break;
        case SP_ILL:
            lam[i] = pow(10, -(dt == AST_F32 ? 6.0 : 8.0) * i / (n - 1));
            break;
        case SP_CLUSTERED:
            lam[i] = (double)(i % 4);
            break;
        }
    }
}

static void test_eigh_spectra(void **state)
{
    (void)state;
    static const int sizes[] = {2, 37, 100};
    rng_seed(1);
    for (int sp = SP_RANDOM; sp <= SP_CLUSTERED; sp++)
        for (size_t d = 0; d < 2; d++)
            for (size_t s = 0; s < 3; s++) {
                const int n = sizes[s];
                const ast_dtype dt = dtypes[d];
                double *lam = dalloc((size_t)n), *w = dalloc((size_t)n);
                double *q = dalloc((size_t)n * n);
                make_spectrum((spectrum)sp, dt, n, lam);
                double *a = rand_with_spectrum(n, lam, NULL);
                round_to(dt, (size_t)n * n, a);
                assert_int_equal(call_eigh(dt, n, a, w, q), 0);
                check_eigh(n, a, w, q, tol_for(dt, n, 1));
                /* Weyl: each eigenvalue moves by at most the backward error's 2-norm. */
                sort_desc(n, lam);
                for (int j = 0; j < n; j++)
                    assert_le(fabs(w[j] - lam[j]), tol_for(dt, n, 1) * max_abs(n, lam));
                free_all(lam, w, q, a, NULL);
            }
}

static void test_eigh_partial_outputs(void **state)
{
    (void)state;
    const int n = 20;
    double lam[20], w[20], w2[20], q[400], q2[400];
    rng_seed(2);
    make_spectrum(SP_RANDOM, AST_F64, n, lam);
    double *a = rand_with_spectrum(n, lam, NULL);
    assert_int_equal(call_eigh(AST_F64, n, a, w, q), 0);
    assert_int_equal(call_eigh(AST_F64, n, a, w2, NULL), 0);
    assert_int_equal(call_eigh(AST_F64, n, a, NULL, q2), 0);
    assert_memory_equal(w, w2, sizeof w);
    assert_memory_equal(q, q2, sizeof q);
    free(a);
}

/* ---- non-finite input and bad arguments ---------------------------------------------------- */

/* Every entry point rejects NaN/Inf in any input (either triangle of a symmetric one) with
 * AST_ENONFINITE, leaves its outputs untouched, and does not retry: a bad input is not a
 * numerical failure. */
static void test_nonfinite_input(void **state)
{
    (void)state;
    const int n = 6;
    const size_t nn = 36;
    static const size_t where[] = {2 * 6 + 3, 3 * 6 + 2, 0};
    const double bad[] = {NAN, INFINITY, -INFINITY};
    for (size_t d = 0; d < 2; d++)
        for (size_t k = 0; k < 3; k++) {
            const ast_dtype dt = dtypes[d];
            const size_t es = ast_dtype_size(dt);
            double base[36], id[36];
            rng_seed(3);
            for (size_t i = 0; i < nn; i++)
                base[i] = urand();
            eye(n, id, 1);
            base[where[k]] = bad[k];
            void *a = to_dt(dt, nn, base), *good = to_dt(dt, nn, id);
            void *o1 = xalloc(nn * es), *o2 = xalloc(nn * es);
            int64_t perm[6];
            fill_sentinel(o1, nn * es);
            fill_sentinel(o2, nn * es);
            fill_sentinel(perm, sizeof perm);
            assert_int_equal(ast_linalg_eigh(dt, n, a, o1, o2), AST_ENONFINITE);
            assert_int_equal(ast_linalg_inv_root(dt, n, a, 2, 1e-6, o1), AST_ENONFINITE);
            assert_int_equal(ast_linalg_newton_inv_root(dt, n, a, 2, 1e-6, 50, 1e-4, o1),
                             AST_ENONFINITE);
            assert_int_equal(ast_linalg_soap_refresh(dt, n, a, good, o1, perm), AST_ENONFINITE);
            assert_int_equal(ast_linalg_soap_refresh(dt, n, good, a, o1, perm), AST_ENONFINITE);
            assert_int_equal(ast_linalg_qr_refresh(dt, n, a, good, o1), AST_ENONFINITE);
            assert_int_equal(ast_linalg_qr_refresh(dt, n, good, a, o1), AST_ENONFINITE);
            assert_int_equal(ast_linalg_last_retried(), 0);
            assert_true(sentinel_intact(o1, nn * es));
            assert_true(sentinel_intact(o2, nn * es));
            assert_true(sentinel_intact(perm, sizeof perm));
            free_all(a, good, o1, o2, NULL);
        }
}

static void test_bad_args(void **state)
{
    (void)state;
    const int n = 4;
    double a[16], q[16], o[16], w[4];
    int64_t perm[4];
    int fi = 99;
    eye(n, a, 2);
    eye(n, q, 1);
    fill_sentinel(o, sizeof o);
    fill_sentinel(w, sizeof w);
    fill_sentinel(perm, sizeof perm);
    const ast_dtype bad_dt = (ast_dtype)5;

    assert_int_equal(ast_linalg_eigh(bad_dt, n, a, w, o), AST_EINVAL);
    assert_int_equal(ast_linalg_eigh(AST_F64, 0, a, w, o), AST_EINVAL);
    assert_int_equal(ast_linalg_eigh(AST_F64, -1, a, w, o), AST_EINVAL);
    assert_int_equal(ast_linalg_eigh(AST_F64, 40000, a, w, o), AST_EINVAL);
    assert_int_equal(ast_linalg_eigh(AST_F64, n, NULL, w, o), AST_EINVAL);
    assert_int_equal(ast_linalg_eigh(AST_F64, n, a, NULL, NULL), AST_EINVAL);
    assert_int_equal(ast_linalg_inv_root(AST_F64, n, a, 0, 1e-6, o), AST_EINVAL);
    assert_int_equal(ast_linalg_inv_root(AST_F64, n, a, -2, 1e-6, o), AST_EINVAL);
    assert_int_equal(ast_linalg_inv_root(AST_F64, n, a, NAN, 1e-6, o), AST_EINVAL);
    assert_int_equal(ast_linalg_inv_root(AST_F64, n, a, INFINITY, 1e-6, o), AST_EINVAL);
    assert_int_equal(ast_linalg_inv_root(AST_F64, n, a, 2, -1e-6, o), AST_EINVAL);
    assert_int_equal(ast_linalg_inv_root(AST_F64, n, a, 2, NAN, o), AST_EINVAL);
    assert_int_equal(ast_linalg_inv_root(AST_F64, n, a, 2, 1e-6, NULL), AST_EINVAL);
    assert_int_equal(ast_linalg_newton_inv_root(AST_F64, n, a, 0, 1e-6, 50, 1e-6, o), AST_EINVAL);
    assert_int_equal(ast_linalg_newton_inv_root(AST_F64, n, a, 2, -1, 50, 1e-6, o), AST_EINVAL);
    assert_int_equal(ast_linalg_newton_inv_root(AST_F64, n, a, 2, 0, -1, 1e-6, o), AST_EINVAL);
    assert_int_equal(ast_linalg_newton_inv_root(AST_F64, n, a, 2, 0, 50, 0, o), AST_EINVAL);
    assert_int_equal(ast_linalg_newton_inv_root(AST_F64, n, a, 2, 0, 50, NAN, o), AST_EINVAL);
    assert_int_equal(ast_linalg_soap_refresh(AST_F64, n, a, q, o, NULL), AST_EINVAL);
    assert_int_equal(ast_linalg_soap_refresh(AST_F64, n, a, NULL, o, perm), AST_EINVAL);
    assert_int_equal(ast_linalg_soap_refresh(AST_F64, n, a, q, NULL, perm), AST_EINVAL);
    assert_int_equal(ast_linalg_qr_refresh(AST_F64, n, a, NULL, o), AST_EINVAL);
    assert_true(sentinel_intact(o, sizeof o));
    assert_true(sentinel_intact(w, sizeof w));
    assert_true(sentinel_intact(perm, sizeof perm));

    /* q_new may not alias q or f, also partially. */
    double qc[16], fc[16], big[32];
    memcpy(qc, q, sizeof qc);
    memcpy(fc, a, sizeof fc);
    assert_int_equal(ast_linalg_soap_refresh(AST_F64, n, fc, qc, qc, perm), AST_EINVAL);
    assert_int_equal(ast_linalg_soap_refresh(AST_F64, n, fc, qc, fc, perm), AST_EINVAL);
    assert_int_equal(ast_linalg_qr_refresh(AST_F64, n, fc, qc, qc), AST_EINVAL);
    memcpy(big, q, sizeof qc);
    assert_int_equal(ast_linalg_qr_refresh(AST_F64, n, fc, big, big + 8), AST_EINVAL);
    assert_memory_equal(qc, q, sizeof qc);
    assert_memory_equal(fc, a, sizeof fc);
    assert_true(sentinel_intact(perm, sizeof perm));

    /* Rejected batched arguments: nothing written, failed_index 0. */
    assert_int_equal(ast_linalg_eigh_batched(AST_F64, -1, n, a, w, o, &fi), AST_EINVAL);
    assert_int_equal(fi, 0);
    fi = 99;
    assert_int_equal(ast_linalg_inv_root_batched(AST_F64, 1, n, a, 0, 0, o, &fi), AST_EINVAL);
    assert_int_equal(fi, 0);
    assert_true(sentinel_intact(o, sizeof o));
}

/* ---- inverse roots ------------------------------------------------------------------------- */

/* Against both the construction (U diag((l+eps)^(-1/p)) U^T from the known U, l) and the
 * eigen-formula through dsyev; and X^p (A + eps I) = I. Spectrum in [1, 100] (kappa 100). */
static void test_inv_root_restatement(void **state)
{
    (void)state;
    static const double ps[] = {1, 2, 4, 2.5};
    static const double epss[] = {0, 1e-3};
    const int n = 48;
    const size_t nn = (size_t)n * n;
    rng_seed(4);
    for (size_t d = 0; d < 2; d++)
        for (size_t pi = 0; pi < 4; pi++)
            for (size_t ei = 0; ei < 2; ei++) {
                const ast_dtype dt = dtypes[d];
                const double p = ps[pi], eps = epss[ei];
                double *lam = dalloc((size_t)n), *u = dalloc(nn), *lr = dalloc((size_t)n);
                double *x = dalloc(nn), *xc = dalloc(nn), *xe = dalloc(nn);
                for (int i = 0; i < n; i++)
                    lam[i] = pow(10, 2 * urand());
                double *a = rand_with_spectrum(n, lam, u);
                round_to(dt, nn, a);
                assert_int_equal(call_inv_root(dt, n, a, p, eps, x), 0);
                for (int i = 0; i < n; i++)
                    lr[i] = pow(lam[i] + eps, -1 / p);
                from_spectrum(n, lr, u, xc);
                inv_root_ref(n, a, p, eps, xe);
                const double tol = tol_for(dt, n, 100);
                /* The float32 input was rounded: X moves by up to kappa * u32 from that alone. */
                assert_le(rel_diff(nn, x, xc), tol + (dt == AST_F32 ? 100 * U32 : 0));
                assert_le(rel_diff(nn, x, xe), tol);
                if (p == floor(p))
                    assert_le(root_residual(n, x, (int)p, a, eps) / sqrt(n), tol * p);
                free_all(lam, u, lr, x, xc, xe, a, NULL);
            }
}

/* Rank-deficient and indefinite spectra: eigenvalues are clamped at 0 before eps is added. */
static void test_inv_root_clamp(void **state)
{
    (void)state;
    const int n = 30;
    const size_t nn = (size_t)n * n;
    const double eps = 1e-2;
    rng_seed(5);
    for (size_t d = 0; d < 2; d++)
        for (int kind = 0; kind < 2; kind++) {
            const ast_dtype dt = dtypes[d];
            double *lam = dalloc((size_t)n), *u = dalloc(nn), *lr = dalloc((size_t)n);
            double *x = dalloc(nn), *xc = dalloc(nn), *xe = dalloc(nn);
            for (int i = 0; i < n; i++)
                lam[i] = i < n / 2 ? 1 + 9 * urand() : (kind == 0 ? 0 : -5 * urand());
            double *a = rand_with_spectrum(n, lam, u);
            round_to(dt, nn, a);
            assert_int_equal(call_inv_root(dt, n, a, 2, eps, x), 0);
            for (int i = 0; i < n; i++)
                lr[i] = pow(fmax(lam[i], 0) + eps, -0.5);
            from_spectrum(n, lr, u, xc);
            inv_root_ref(n, a, 2, eps, xe);
            /* kappa of the clamped, regularised spectrum: 10 / eps. The clamp turns the
             * eigensolver's O(u ||A||) noise on zero eigenvalues into O(u ||A|| / eps). */
            const double tol = tol_for(dt, n, 10 / eps);
            assert_le(rel_diff(nn, x, xc), tol);
            assert_le(rel_diff(nn, x, xe), tol);
            free_all(lam, u, lr, x, xc, xe, a, NULL);
        }
}

/* cond 1e8 in float64: X^2 A = I to C n u kappa (the residual of an eigen-based root grows with
 * kappa, not kappa^2, because the error is aligned with the eigenbasis). float32 at cond 1e6
 * can only be asked for a regularised root: eps = 1e-3 caps kappa at 1e3. */
static void test_inv_root_ill_conditioned(void **state)
{
    (void)state;
    const int n = 40;
    const size_t nn = (size_t)n * n;
    double *lam = dalloc((size_t)n), *u = dalloc(nn), *x = dalloc(nn), *xe = dalloc(nn);
    rng_seed(6);
    make_spectrum(SP_ILL, AST_F64, n, lam);
    double *a = rand_with_spectrum(n, lam, u);
    assert_int_equal(call_inv_root(AST_F64, n, a, 2, 0, x), 0);
    assert_le(root_residual(n, x, 2, a, 0) / sqrt(n), tol_for(AST_F64, n, 1e8));
    inv_root_ref(n, a, 2, 0, xe);
    assert_le(rel_diff(nn, x, xe), tol_for(AST_F64, n, 1e8));
    free(a);

    make_spectrum(SP_ILL, AST_F32, n, lam);
    a = rand_with_spectrum(n, lam, u);
    round_to(AST_F32, nn, a);
    assert_int_equal(call_inv_root(AST_F32, n, a, 2, 1e-3, x), 0);
    inv_root_ref(n, a, 2, 1e-3, xe);
    assert_le(rel_diff(nn, x, xe), tol_for(AST_F32, n, 1e3));
    assert_le(root_residual(n, x, 2, a, 1e-3) / sqrt(n), tol_for(AST_F32, n, 1e3));
    free_all(a, lam, u, x, xe, NULL);
}

static void test_inv_root_identity_and_singular(void **state)
{
    (void)state;
    const int n = 3;
    double a[9], x[9];
    eye(n, a, 1);
    for (size_t d = 0; d < 2; d++) {
        assert_int_equal(call_inv_root(dtypes[d], n, a, 4, 0.5, x), 0);
        assert_le(dist_eye(n, x, pow(1.5, -0.25)), tol_for(dtypes[d], n, 1));
    }
    /* An exact zero eigenvalue is raised to the floor n eps_m l_max, so with eps == 0 a singular
     * factor still has an inverse root there (its null-space value). */
    const double diag[9] = {3, 0, 0, 0, 0, 0, 0, 0, 1};
    for (size_t d = 0; d < 2; d++) {
        assert_int_equal(call_inv_root(dtypes[d], n, diag, 2, 0, x), 0);
        const double floor = n * (dtypes[d] == AST_F32 ? FLT_EPSILON : DBL_EPSILON) * 3;
        assert_le(fabs(x[0] - pow(3, -0.5)), 1e-6);
        assert_le(fabs(x[4] / pow(floor, -0.5) - 1), 1e-3);
        assert_le(fabs(x[8] - 1), 1e-6);
    }
    /* Only an all-zero factor with eps == 0 has no inverse root. float32 retries in float64,
     * which fails the same way; the outputs stay untouched either way. */
    const double zero[9] = {0};
    for (size_t d = 0; d < 2; d++) {
        const ast_dtype dt = dtypes[d];
        void *ad = to_dt(dt, 9, zero), *xd = xalloc(9 * ast_dtype_size(dt));
        fill_sentinel(xd, 9 * ast_dtype_size(dt));
        assert_int_equal(ast_linalg_inv_root(dt, n, ad, 2, 0, xd), AST_ENONFINITE);
        assert_int_equal(ast_linalg_last_retried(), dt == AST_F32);
        assert_true(sentinel_intact(xd, 9 * ast_dtype_size(dt)));
        free(ad);
        free(xd);
    }
}

/* Newton against the eigen root. Converged means ||X^p A' - I||_inf < tol, so X is within about
 * tol/p (relative) of the exact root, plus the rounding of the eigen root it is compared with. */
static void test_newton_vs_eigen(void **state)
{
    (void)state;
    static const int ps[] = {1, 2, 4, 3};
    const int n = 48;
    const size_t nn = (size_t)n * n;
    rng_seed(7);
    for (size_t d = 0; d < 2; d++)
        for (size_t pi = 0; pi < 4; pi++) {
            const ast_dtype dt = dtypes[d];
            const double tol = dt == AST_F64 ? 1e-10 : 1e-3, eps = 1e-6;
            double *lam = dalloc((size_t)n), *x = dalloc(nn), *xe = dalloc(nn);
            for (int i = 0; i < n; i++)
                lam[i] = pow(10, 2 * urand());
            double *a = rand_with_spectrum(n, lam, NULL);
            round_to(dt, nn, a);
            assert_int_equal(call_newton(dt, n, a, ps[pi], eps, 100, tol, x), 0);
            assert_int_equal(ast_linalg_last_retried(), 0);
            inv_root_ref(n, a, ps[pi], eps, xe);
            assert_le(rel_diff(nn, x, xe), tol + tol_for(dt, n, 100));
            free_all(lam, x, xe, a, NULL);
        }
}

static void test_newton_failures(void **state)
{
    (void)state;
    const int n = 16;
    const size_t nn = 256;
    double lam[16];
    rng_seed(8);
    for (int i = 0; i < n; i++)
        lam[i] = pow(10, 3 * urand());
    double *a = rand_with_spectrum(n, lam, NULL), *x = dalloc(nn), *xe = dalloc(nn);
    void *xd = xalloc(nn * 8);

    /* Not converged within max_iter: AST_ENOCONV, output untouched. */
    fill_sentinel(xd, nn * 8);
    assert_int_equal(ast_linalg_newton_inv_root(AST_F64, n, a, 2, 0, 2, 1e-10, xd), AST_ENOCONV);
    assert_true(sentinel_intact(xd, nn * 8));
    /* A zero matrix with eps = 0 is singular. */
    memset(x, 0, nn * sizeof *x);
    assert_int_equal(ast_linalg_newton_inv_root(AST_F64, n, x, 2, 0, 50, 1e-10, xd),
                     AST_ENONFINITE);
    assert_true(sentinel_intact(xd, nn * 8));
    /* max_iter 0 accepts only the starting point, which is never I (z maps lambda_max to
     * (p+1)/2); a multiple of I needs a handful of the quadratic steps. */
    eye(n, x, 4);
    assert_int_equal(ast_linalg_newton_inv_root(AST_F64, n, x, 2, 0, 0, 1e-12, xd), AST_ENOCONV);
    assert_true(sentinel_intact(xd, nn * 8));
    assert_int_equal(call_newton(AST_F64, n, x, 2, 0, 8, 1e-12, xe), 0);
    assert_le(dist_eye(n, xe, 0.5), tol_for(AST_F64, n, 1));

    /* float32 cannot reach 1e-9 (its rounding floor is ~n u32): the float32 iteration stalls,
     * the float64 retry converges and is rounded back. */
    assert_int_equal(call_newton(AST_F32, n, a, 2, 0, 100, 1e-9, x), 0);
    assert_int_equal(ast_linalg_last_retried(), 1);
    round_to(AST_F32, nn, a);
    inv_root_ref(n, a, 2, 0, xe);
    assert_le(rel_diff(nn, x, xe), 10 * U32);
    free_all(a, x, xe, xd, NULL);
}

/* ---- SOAP and KL refreshes ----------------------------------------------------------------- */

/* A basis near F's eigenbasis but scrambled: SOAP's situation between refreshes, and it keeps
 * e's gaps (>= 9/(n-1)) far above float32 rounding so the permutation is decided exactly. */
static void near_eigenbasis(int n, const double *u, double *q)
{
    for (int j = 0; j < n; j++) {
        int src = (j * 7 + 3) % n;
        for (int i = 0; i < n; i++)
            q[(size_t)i * n + j] = u[(size_t)i * n + src] + 0.02 * nrand();
    }
    qr_q_ref(n, q);
}

static void test_soap_refresh_restatement(void **state)
{
    (void)state;
    const int n = 40; /* coprime with 7, so near_eigenbasis permutes */
    const size_t nn = (size_t)n * n;
    rng_seed(9);
    for (size_t d = 0; d < 2; d++) {
        const ast_dtype dt = dtypes[d];
        double *lam = dalloc((size_t)n), *u = dalloc(nn), *q = dalloc(nn);
        double *qn = dalloc(nn), *qr = dalloc(nn);
        int64_t perm[40], pr[40];
        for (int i = 0; i < n; i++)
            lam[i] = 1 + 9.0 * i / (n - 1);
        double *f = rand_with_spectrum(n, lam, u);
        near_eigenbasis(n, u, q);
        round_to(dt, nn, f);
        round_to(dt, nn, q);
        assert_int_equal(call_refresh(dt, n, f, q, qn, perm), 0);
        soap_ref(n, f, q, qr, pr);
        assert_memory_equal(perm, pr, sizeof perm);
        /* kappa: cond(F Q[:, s]) = cond(F) = 10. */
        assert_le(fro_diff(nn, qn, qr), tol_for(dt, n, 10) * sqrt(n));
        check_orthonormal(n, qn, tol_for(dt, n, 1));
        free_all(lam, u, q, qn, qr, f, NULL);
    }
}

/* Ties in e keep their original order; exact with Q = I and a diagonal F. */
static void test_soap_refresh_ties(void **state)
{
    (void)state;
    static const double diag[] = {1, 3, 3, 2, 3};
    static const int64_t expect[] = {1, 2, 4, 3, 0};
    const int n = 5;
    double f[25], q[25], qn[25], qr[25];
    int64_t perm[5], pr[5];
    memset(f, 0, sizeof f);
    for (int i = 0; i < n; i++)
        f[i * n + i] = diag[i];
    eye(n, q, 1);
    for (size_t d = 0; d < 2; d++) {
        assert_int_equal(call_refresh(dtypes[d], n, f, q, qn, perm), 0);
        assert_memory_equal(perm, expect, sizeof perm);
        soap_ref(n, f, q, qr, pr);
        assert_memory_equal(pr, expect, sizeof pr);
        assert_le(fro_diff(25, qn, qr), tol_for(dtypes[d], n, 1));
    }
}

/* Repeated refreshes are power iteration: Q converges to F's eigenbasis with the eigenvalues in
 * descending order, at rate (l_{i+1}/l_i)^k = (7/8)^300 ~ 4e-18 here. */
static void test_soap_refresh_converges(void **state)
{
    (void)state;
    const int n = 8;
    double lam[8], f[64], q[64], qn[64], c[64], fq[64];
    int64_t perm[8];
    rng_seed(10);
    for (int i = 0; i < n; i++)
        lam[i] = 1 + i;
    double *g = rand_with_spectrum(n, lam, NULL);
    memcpy(f, g, sizeof f);
    free(g);
    rand_orthogonal(n, q);
    for (int k = 0; k < 300; k++) {
        assert_int_equal(ast_linalg_soap_refresh(AST_F64, n, f, q, qn, perm), 0);
        memcpy(q, qn, sizeof q);
    }
    for (int j = 0; j < n; j++)
        assert_int_equal(perm[j], j);
    mm(n, f, q, fq);
    mtm(n, q, fq, c);
    for (int i = 0; i < n; i++)
        for (int j = 0; j < n; j++)
            assert_le(fabs(c[i * n + j] - (i == j ? lam[n - 1 - i] : 0)), 1e-10);
}

static void test_qr_refresh_restatement(void **state)
{
    (void)state;
    const int n = 40;
    const size_t nn = (size_t)n * n;
    rng_seed(11);
    for (size_t d = 0; d < 2; d++) {
        const ast_dtype dt = dtypes[d];
        double *lam = dalloc((size_t)n), *q = dalloc(nn), *qn = dalloc(nn), *qr = dalloc(nn);
        for (int i = 0; i < n; i++)
            lam[i] = 1 + 9 * urand();
        double *f = rand_with_spectrum(n, lam, NULL);
        rand_orthogonal(n, q);
        round_to(dt, nn, f);
        round_to(dt, nn, q);
        assert_int_equal(call_refresh(dt, n, f, q, qn, NULL), 0);
        kl_ref(n, f, q, qr);
        assert_le(fro_diff(nn, qn, qr), tol_for(dt, n, 10) * sqrt(n));
        check_orthonormal(n, qn, tol_for(dt, n, 1));
        free_all(lam, q, qn, qr, f, NULL);
    }
}

/* ---- batched --------------------------------------------------------------------------------- */

typedef enum bop { B_EIGH, B_ROOT, B_SOAP, B_QR, B_NEWTON } bop;

/* vec: w for eigh, perm for SOAP. */
static int call_single(bop op, ast_dtype dt, int n, const void *a, const void *q, void *m,
                       void *vec)
{
    switch (op) {
    case B_EIGH:
        return ast_linalg_eigh(dt, n, a, vec, m);
    case B_ROOT:
        return ast_linalg_inv_root(dt, n, a, 2, 1e-4, m);
    case B_SOAP:
        return ast_linalg_soap_qr(dt, n, a, q, m, vec);
    case B_QR:
        return ast_linalg_kl_qr(dt, n, a, q, m);
    case B_NEWTON:
        return ast_linalg_newton_root(dt, n, a, 2, 1e-4, 50, 1e-5, m);
    }
    return -100;
}

static int call_batched(bop op, ast_dtype dt, int batch, int n, const void *a, const void *q,
                        void *m, void *vec, int *fi)
{
    switch (op) {
    case B_EIGH:
        return ast_linalg_eigh_batched(dt, batch, n, a, vec, m, fi);
    case B_ROOT:
        return ast_linalg_inv_root_batched(dt, batch, n, a, 2, 1e-4, m, fi);
    case B_SOAP:
        return ast_linalg_soap_qr_batched(dt, batch, n, a, q, m, vec, fi);
    case B_QR:
        return ast_linalg_kl_qr_batched(dt, batch, n, a, q, m, fi);
    case B_NEWTON:
        return ast_linalg_newton_root_batched(dt, batch, n, a, 2, 1e-4, 50, 1e-5, m, fi);
    }
    return -100;
}

/* Each block of a batched call equals the single call bitwise; at the first failing block the
 * call stops: blocks before it written, from it on untouched, failed_index set. */
static void test_batched(void **state)
{
    (void)state;
    enum { B = 4, N = 12 };
    const size_t nn = N * N;
    rng_seed(12);
    for (size_t d = 0; d < 2; d++)
        for (int op = B_EIGH; op <= B_NEWTON; op++) {
            const ast_dtype dt = dtypes[d];
            const size_t es = ast_dtype_size(dt);
            const size_t vb = op == B_SOAP ? N * sizeof(int64_t) : N * es;
            double *a64 = dalloc(B * nn), *q64 = dalloc(B * nn), lam[N];
            for (int b = 0; b < B; b++) {
                for (int i = 0; i < N; i++)
                    lam[i] = 1 + 9 * urand();
                double *f = rand_with_spectrum(N, lam, NULL);
                memcpy(a64 + b * nn, f, nn * sizeof *f);
                free(f);
                rand_orthogonal(N, q64 + b * nn);
            }
            char *a = to_dt(dt, B * nn, a64), *q = to_dt(dt, B * nn, q64);
            char *m = xalloc(B * nn * es), *v = xalloc(B * vb);
            char *m1 = xalloc(nn * es), *v1 = xalloc(vb);
            int fi = 99;

            fill_sentinel(m, B * nn * es);
            fill_sentinel(v, B * vb);
            assert_int_equal(call_batched((bop)op, dt, B, N, a, q, m, v, &fi), 0);
            assert_int_equal(fi, -1);
            for (int b = 0; b < B; b++) {
                assert_int_equal(call_single((bop)op, dt, N, a + b * nn * es, q + b * nn * es,
                                             m1, v1),
                                 0);
                assert_memory_equal(m1, m + b * nn * es, nn * es);
                if (op == B_EIGH || op == B_SOAP)
                    assert_memory_equal(v1, v + b * vb, vb);
            }

            /* Poison block 2 (its F for refreshes too, so every op sees it). */
            for (int fail_at = 0; fail_at < B; fail_at += 2) {
                char *poison = a + (size_t)fail_at * nn * es + 5 * es;
                char saved[8];
                poison_elem(poison, dt, NAN, saved);
                fill_sentinel(m, B * nn * es);
                fill_sentinel(v, B * vb);
                fi = 99;
                assert_int_equal(call_batched((bop)op, dt, B, N, a, q, m, v, &fi),
                                 AST_ENONFINITE);
                assert_int_equal(fi, fail_at);
                for (int b = 0; b < fail_at; b++) {
                    assert_int_equal(call_single((bop)op, dt, N, a + b * nn * es,
                                                 q + b * nn * es, m1, v1),
                                     0);
                    assert_memory_equal(m1, m + b * nn * es, nn * es);
                }
                assert_true(sentinel_intact(m + (size_t)fail_at * nn * es,
                                            (size_t)(B - fail_at) * nn * es));
                assert_true(sentinel_intact(v + (size_t)fail_at * vb, (size_t)(B - fail_at) * vb));
                memcpy(poison, saved, es);
            }

            /* An empty batch succeeds and writes nothing. */
            fi = 99;
            fill_sentinel(m, nn * es);
            assert_int_equal(call_batched((bop)op, dt, 0, N, a, q, m, v, &fi), 0);
            assert_int_equal(fi, -1);
            assert_true(sentinel_intact(m, nn * es));
            free_all(a64, q64, a, q, m, v, m1, v1, NULL);
        }
}

/* The former names (ast_linalg_soap_refresh*, ast_linalg_qr_refresh*,
 * ast_linalg_newton_inv_root) are the op-named calls: the same results bitwise, the same
 * refusals. */
static void test_former_names(void **state)
{
    (void)state;
    enum { N = 9 };
    const size_t nn = N * N;
    rng_seed(21);
    double lam[N], q[N * N];
    for (int i = 0; i < N; i++)
        lam[i] = 1 + 4 * urand();
    double *f = rand_with_spectrum(N, lam, NULL);
    rand_orthogonal(N, q);
    double *m0 = dalloc(nn), *m1 = dalloc(nn);
    int64_t p0[N], p1[N];
    int fi0 = 99, fi1 = 99;

    assert_int_equal(ast_linalg_soap_refresh(AST_F64, N, f, q, m0, p0), 0);
    assert_int_equal(ast_linalg_soap_qr(AST_F64, N, f, q, m1, p1), 0);
    assert_memory_equal(m0, m1, nn * sizeof *m0);
    assert_memory_equal(p0, p1, sizeof p0);
    assert_int_equal(ast_linalg_soap_refresh_batched(AST_F64, 1, N, f, q, m0, p0, &fi0), 0);
    assert_int_equal(ast_linalg_soap_qr_batched(AST_F64, 1, N, f, q, m1, p1, &fi1), 0);
    assert_memory_equal(m0, m1, nn * sizeof *m0);
    assert_int_equal(fi0, fi1);

    assert_int_equal(ast_linalg_qr_refresh(AST_F64, N, f, q, m0), 0);
    assert_int_equal(ast_linalg_kl_qr(AST_F64, N, f, q, m1), 0);
    assert_memory_equal(m0, m1, nn * sizeof *m0);
    assert_int_equal(ast_linalg_qr_refresh_batched(AST_F64, 1, N, f, q, m0, &fi0), 0);
    assert_int_equal(ast_linalg_kl_qr_batched(AST_F64, 1, N, f, q, m1, &fi1), 0);
    assert_memory_equal(m0, m1, nn * sizeof *m0);

    assert_int_equal(ast_linalg_newton_inv_root(AST_F64, N, f, 4, 1e-6, 50, 1e-8, m0), 0);
    assert_int_equal(ast_linalg_newton_root(AST_F64, N, f, 4, 1e-6, 50, 1e-8, m1), 0);
    assert_memory_equal(m0, m1, nn * sizeof *m0);

    assert_int_equal(ast_linalg_soap_refresh(AST_F64, N, f, q, f, p0), AST_EINVAL);
    assert_int_equal(ast_linalg_qr_refresh(AST_F64, N, f, NULL, m0), AST_EINVAL);
    assert_int_equal(ast_linalg_newton_inv_root(AST_F64, N, f, 0, 1e-6, 50, 1e-8, m0),
                     AST_EINVAL);
    assert_int_equal(ast_linalg_newton_root_batched(AST_F64, -1, N, f, 2, 0, 50, 1e-8, m0, &fi0),
                     AST_EINVAL);
    assert_int_equal(fi0, 0);
    free_all(f, m0, m1, NULL);
}

/* ---- SOAP's m re-expression (soap_rotate) -------------------------------------------------- */

/* A pair (2, n, n): two random orthogonal matrices, or two Gaussian ones. */
static void rand_pair(int n, int orthogonal, double *pair)
{
    const size_t nn = (size_t)n * n;
    for (int s = 0; s < 2; s++) {
        if (orthogonal)
            rand_orthogonal(n, pair + s * nn);
        else
            for (size_t i = 0; i < nn; i++)
                pair[s * nn + i] = nrand();
    }
}

enum { SIDE_BOTH, SIDE_LEFT, SIDE_RIGHT };

/* Against the restatement for every side, square, tall and wide X (the shapes that take the
 * in-sequence and the formed association of each side), 1-row and 1-column X, orthogonal and
 * Gaussian bases, batch 3; each block of a batched call equals the single call bitwise, and
 * nothing past the output is written. Tolerance: four products of inner dimension at most
 * max(n, n1); kappa 1 for orthogonal bases, 10 for Gaussian ones (relative Frobenius error). */
static void test_soap_rotate_restatement(void **state)
{
    (void)state;
    static const int shapes[][2] = {{6, 6}, {3, 11}, {11, 3}, {1, 7}, {7, 1}, {9, 16}};
    enum { B = 3 };
    rng_seed(21);
    for (size_t d = 0; d < 2; d++)
        for (size_t sh = 0; sh < sizeof shapes / sizeof shapes[0]; sh++)
            for (int side = SIDE_BOTH; side <= SIDE_RIGHT; side++)
                for (int orth = 1; orth >= 0; orth--) {
                    const ast_dtype dt = dtypes[d];
                    const size_t es = ast_dtype_size(dt);
                    const int n = shapes[sh][0], n1 = shapes[sh][1];
                    const size_t nx = (size_t)n * n1, na = 2 * (size_t)n * n,
                                 nb = 2 * (size_t)n1 * n1;
                    const int has_a = side != SIDE_RIGHT, has_b = side != SIDE_LEFT;
                    double *x = dalloc(B * nx), *ap = dalloc(B * na), *bp = dalloc(B * nb);
                    double *ref = dalloc(nx), *got = dalloc(B * nx);
                    for (size_t i = 0; i < B * nx; i++)
                        x[i] = nrand();
                    for (int b = 0; b < B; b++) {
                        rand_pair(n, orth, ap + b * na);
                        rand_pair(n1, orth, bp + b * nb);
                    }
                    round_to(dt, B * nx, x);
                    round_to(dt, B * na, ap);
                    round_to(dt, B * nb, bp);
                    char *xd = to_dt(dt, B * nx, x), *ad = to_dt(dt, B * na, ap),
                         *bd = to_dt(dt, B * nb, bp);
                    const char *a_arg = has_a ? ad : NULL, *b_arg = has_b ? bd : NULL;
                    char *out = xalloc((B * nx + 8) * es), *one = xalloc(nx * es);
                    fill_sentinel(out, (B * nx + 8) * es);
                    int fi = 99;
                    assert_int_equal(ast_linalg_soap_rotate_batched(dt, B, n, n1, xd, a_arg,
                                                                    b_arg, out, &fi),
                                     0);
                    assert_int_equal(fi, -1);
                    assert_int_equal(ast_linalg_last_retried(), 0);
                    assert_true(sentinel_intact(out + B * nx * es, 8 * es));
                    from_dt(dt, B * nx, out, got);
                    const double tol = tol_for(dt, n > n1 ? n : n1, orth ? 4 : 40);
                    for (int b = 0; b < B; b++) {
                        ref_soap_rotate(n, n1, x + b * nx, has_a ? ap + b * na : NULL,
                                   has_b ? bp + b * nb : NULL, ref);
                        double err = rel_diff(nx, got + b * nx, ref);
                        if (!(err <= tol))
                            fail_msg("dtype %d n %d n1 %d side %d orth %d block %d: rel err "
                                     "%.3e > %.3e",
                                     (int)dt, n, n1, side, orth, b, err, tol);
                        assert_int_equal(ast_linalg_soap_rotate(
                                             dt, n, n1, xd + b * nx * es,
                                             has_a ? ad + b * na * es : NULL,
                                             has_b ? bd + b * nb * es : NULL, one),
                                         0);
                        assert_memory_equal(one, out + b * nx * es, nx * es);
                    }
                    free_all(x, ap, bp, ref, got, xd, ad, bd, out, one, NULL);
                }
}

/* Orthogonal A_new = A_old, B_new = B_old make the rotation the identity map. */
static void test_soap_rotate_same_basis_is_identity(void **state)
{
    (void)state;
    const int n = 10, n1 = 4;
    const size_t nx = (size_t)n * n1;
    double x[40], ap[200], bp[32], out[40];
    rng_seed(22);
    for (size_t i = 0; i < nx; i++)
        x[i] = nrand();
    rand_orthogonal(n, ap);
    memcpy(ap + n * n, ap, (size_t)n * n * sizeof *ap);
    rand_orthogonal(n1, bp);
    memcpy(bp + n1 * n1, bp, (size_t)n1 * n1 * sizeof *bp);
    assert_int_equal(ast_linalg_soap_rotate(AST_F64, n, n1, x, ap, bp, out), 0);
    assert_le(rel_diff(nx, out, x), tol_for(AST_F64, n, 4));
}

/* NaN/Inf in X or either pair: AST_ENONFINITE, output untouched, no retry; in a batch the
 * call stops at the poisoned block (blocks before it written, from it on untouched). Bad
 * arguments: AST_EINVAL, nothing written, failed_index 0. */
static void test_soap_rotate_failures(void **state)
{
    (void)state;
    enum { B = 3, N = 5, N1 = 3 };
    const size_t nx = N * N1, na = 2 * N * N, nb = 2 * N1 * N1;
    rng_seed(23);
    for (size_t d = 0; d < 2; d++) {
        const ast_dtype dt = dtypes[d];
        const size_t es = ast_dtype_size(dt);
        double x[B * nx], ap[B * na], bp[B * nb];
        for (size_t i = 0; i < B * nx; i++)
            x[i] = nrand();
        for (int b = 0; b < B; b++) {
            rand_pair(N, 1, ap + b * na);
            rand_pair(N1, 1, bp + b * nb);
        }
        char *xd = to_dt(dt, B * nx, x), *ad = to_dt(dt, B * na, ap), *bd = to_dt(dt, B * nb, bp);
        char *out = xalloc(B * nx * es), *one = xalloc(nx * es);
        char *bufs[3] = {xd, ad, bd};
        const size_t per[3] = {nx, na, nb};
        const double bad[] = {NAN, INFINITY, -INFINITY};
        for (int which = 0; which < 3; which++)
            for (int fail_at = 0; fail_at < B; fail_at++) {
                char *poison = bufs[which] + ((size_t)fail_at * per[which] + 2) * es;
                char saved[8];
                poison_elem(poison, dt, bad[fail_at], saved);
                fill_sentinel(out, B * nx * es);
                fill_sentinel(one, nx * es);
                int fi = 99;
                assert_int_equal(ast_linalg_soap_rotate_batched(dt, B, N, N1, xd, ad, bd, out,
                                                                &fi),
                                 AST_ENONFINITE);
                assert_int_equal(fi, fail_at);
                assert_int_equal(ast_linalg_last_retried(), 0);
                for (int b = 0; b < fail_at; b++) {
                    assert_int_equal(ast_linalg_soap_rotate(dt, N, N1, xd + b * nx * es,
                                                            ad + b * na * es, bd + b * nb * es,
                                                            one),
                                     0);
                    assert_memory_equal(one, out + b * nx * es, nx * es);
                }
                assert_true(sentinel_intact(out + (size_t)fail_at * nx * es,
                                            (size_t)(B - fail_at) * nx * es));
                /* Single call on the poisoned block; also with the poisoned side's pair in. */
                fill_sentinel(one, nx * es);
                assert_int_equal(ast_linalg_soap_rotate(dt, N, N1, xd + fail_at * nx * es,
                                                        ad + fail_at * na * es,
                                                        bd + fail_at * nb * es, one),
                                 AST_ENONFINITE);
                assert_true(sentinel_intact(one, nx * es));
                memcpy(poison, saved, es);
            }

        /* Bad arguments. */
        int fi = 99;
        fill_sentinel(out, B * nx * es);
        assert_int_equal(ast_linalg_soap_rotate(dt, N, 0, xd, ad, bd, out), AST_EINVAL);
        assert_int_equal(ast_linalg_soap_rotate(dt, 0, N1, xd, ad, bd, out), AST_EINVAL);
        assert_int_equal(ast_linalg_soap_rotate(dt, N, -1, xd, ad, bd, out), AST_EINVAL);
        assert_int_equal(ast_linalg_soap_rotate(dt, N, N1, xd, NULL, NULL, out), AST_EINVAL);
        assert_int_equal(ast_linalg_soap_rotate(dt, N, N1, NULL, ad, bd, out), AST_EINVAL);
        assert_int_equal(ast_linalg_soap_rotate(dt, N, N1, xd, ad, bd, NULL), AST_EINVAL);
        assert_int_equal(ast_linalg_soap_rotate((ast_dtype)5, N, N1, xd, ad, bd, out),
                         AST_EINVAL);
        assert_int_equal(ast_linalg_soap_rotate_batched(dt, -1, N, N1, xd, ad, bd, out, &fi),
                         AST_EINVAL);
        assert_int_equal(fi, 0);
        assert_true(sentinel_intact(out, B * nx * es));
        /* The output may not overlap an input, also partially (in place over X; over the last
         * element of the A pair; inside the B pair). */
        char *xcopy = xalloc(B * nx * es);
        memcpy(xcopy, xd, B * nx * es);
        assert_int_equal(ast_linalg_soap_rotate_batched(dt, B, N, N1, xd, ad, bd, xd, &fi),
                         AST_EINVAL);
        assert_memory_equal(xcopy, xd, B * nx * es);
        char *acopy = xalloc(B * na * es);
        memcpy(acopy, ad, B * na * es);
        assert_int_equal(ast_linalg_soap_rotate(dt, N, N1, xd, ad, NULL, ad + na * es - es),
                         AST_EINVAL);
        assert_int_equal(ast_linalg_soap_rotate(dt, N1, N, xd, NULL, bd, bd + 4 * es),
                         AST_EINVAL);
        assert_memory_equal(acopy, ad, B * na * es);
        /* An empty batch succeeds and writes nothing. */
        fi = 99;
        assert_int_equal(ast_linalg_soap_rotate_batched(dt, 0, N, N1, xd, ad, bd, out, &fi), 0);
        assert_int_equal(fi, -1);
        assert_true(sentinel_intact(out, B * nx * es));
        free_all(xcopy, acopy, xd, ad, bd, out, one, NULL);
    }
}

/* X = 3e38 in float32 with A_old = A_new a 45-degree rotation: A_old X overflows float32 (the
 * exact result, X itself, does not), so the float32 call is retried in float64 and returns the
 * float64 answer rounded. */
static void test_soap_rotate_retry_f64(void **state)
{
    (void)state;
    const float big = 3e38f, r = (float)(1 / sqrt(2.0));
    const float x32[4] = {big, big, big, big};
    const float a32[8] = {r, -r, r, r, r, -r, r, r};
    const double x64[4] = {big, big, big, big};
    const double a64[8] = {r, -r, r, r, r, -r, r, r};
    float o32[4];
    double o64[4];
    assert_int_equal(ast_linalg_soap_rotate(AST_F32, 2, 2, x32, a32, NULL, o32), 0);
    assert_int_equal(ast_linalg_last_retried(), 1);
    assert_int_equal(ast_linalg_soap_rotate(AST_F64, 2, 2, x64, a64, NULL, o64), 0);
    assert_int_equal(ast_linalg_last_retried(), 0);
    for (int i = 0; i < 4; i++) {
        assert_true(o32[i] == (float)o64[i]);
        assert_le(fabs(o64[i] - big) / big, 1e-6);
    }
    /* A result beyond float32's range fails even after the retry, output untouched. */
    const float two[8] = {2, 0, 0, 2, 2, 0, 0, 2};
    fill_sentinel(o32, sizeof o32);
    assert_int_equal(ast_linalg_soap_rotate(AST_F32, 2, 2, x32, two, NULL, o32), AST_ENONFINITE);
    assert_int_equal(ast_linalg_last_retried(), 1);
    assert_true(sentinel_intact(o32, sizeof o32));
}

/* ---- SOAP's factor EMAs (gram_ema) --------------------------------------------------------- */

/* A random symmetric m x m matrix (Gaussian entries, mirrored). */
static void rand_sym(int m, double *a)
{
    for (int i = 0; i < m; i++)
        for (int j = i; j < m; j++)
            a[(size_t)i * m + j] = a[(size_t)j * m + i] = nrand();
}

/* A copy of src in dtype dt followed by 8 sentinel elements. */
static char *to_dt_padded(ast_dtype dt, size_t count, const double *src)
{
    const size_t es = ast_dtype_size(dt);
    char *p = xalloc((count + 8) * es), *t = to_dt(dt, count, src);
    memcpy(p, t, count * es);
    fill_sentinel(p + count * es, 8 * es);
    free(t);
    return p;
}

static double *abs_copy(size_t count, const double *v)
{
    double *a = dalloc(count);
    for (size_t i = 0; i < count; i++)
        a[i] = fabs(v[i]);
    return a;
}

/* got (m x m, a call's output in float64) against the restatement ref, element by element within
 * C (k + 2) u bound, bound being the restatement on absolute values: the componentwise error of a
 * k-term dot product (Higham, Accuracy and Stability, 3.1) plus the rounding of the scaling and
 * the sum; and exactly symmetric. */
static void expect_gram(ast_dtype dt, int m, int k, const double *got, const double *ref,
                        const double *bound, const char *what, int block)
{
    const double c = TOL_C * (k + 2) * uround(dt);
    for (int i = 0; i < m; i++)
        for (int j = 0; j < m; j++) {
            const size_t ij = (size_t)i * m + j, ji = (size_t)j * m + i;
            if (!(fabs(got[ij] - ref[ij]) <= c * bound[ij]))
                fail_msg("dtype %d %s (%d x %d, k %d) block %d (%d, %d): %.17g, restatement "
                         "%.17g, bound %.3e",
                         (int)dt, what, m, m, k, block, i, j, got[ij], ref[ij], c * bound[ij]);
            if (got[ij] != got[ji])
                fail_msg("dtype %d %s block %d not symmetric at (%d, %d): %.17g vs %.17g",
                         (int)dt, what, block, i, j, got[ij], got[ji]);
        }
}

enum { GRAM_BOTH, GRAM_L, GRAM_R };

/* Against the restatement for square, tall and wide G, a single row, a single column and 1 x 1,
 * both factors and each alone, three (beta, alpha) pairs (SOAP's, a negative beta, beta 0),
 * batch 3: within the componentwise bound, exactly symmetric, each block of the batched call
 * bitwise the single call's, nothing past L or R written and nothing retried. */
static void test_gram_ema_restatement(void **state)
{
    (void)state;
    /* 70 and 33 span several of the mirror's 32 x 32 tiles, with partial ones at the edge */
    static const int shapes[][2] = {{6, 6},  {3, 11},  {11, 3}, {1, 7},
                                    {7, 1},  {1, 1},   {9, 16}, {70, 33},
                                    {33, 70}};
    static const double coef[][2] = {{0.95, 0.05}, {-0.5, 2.0}, {0.0, 1.0}};
    enum { B = 3 };
    rng_seed(31);
    for (size_t d = 0; d < 2; d++)
        for (size_t sh = 0; sh < sizeof shapes / sizeof shapes[0]; sh++)
            for (int side = GRAM_BOTH; side <= GRAM_R; side++)
                for (size_t cf = 0; cf < sizeof coef / sizeof coef[0]; cf++) {
                    const ast_dtype dt = dtypes[d];
                    const size_t es = ast_dtype_size(dt);
                    const int n = shapes[sh][0], n1 = shapes[sh][1];
                    const size_t ng = (size_t)n * n1, nl = (size_t)n * n, nr = (size_t)n1 * n1;
                    const double beta = coef[cf][0], alpha = coef[cf][1];
                    const int has_l = side != GRAM_R, has_r = side != GRAM_L;
                    double *g = dalloc(B * ng), *l = dalloc(B * nl), *r = dalloc(B * nr);
                    for (size_t i = 0; i < B * ng; i++)
                        g[i] = nrand();
                    for (int b = 0; b < B; b++) {
                        rand_sym(n, l + b * nl);
                        rand_sym(n1, r + b * nr);
                    }
                    round_to(dt, B * ng, g);
                    round_to(dt, B * nl, l);
                    round_to(dt, B * nr, r);
                    char *gd = to_dt(dt, B * ng, g), *ld = to_dt_padded(dt, B * nl, l),
                         *rd = to_dt_padded(dt, B * nr, r);
                    char *l0 = to_dt(dt, B * nl, l), *r0 = to_dt(dt, B * nr, r);
                    int fi = 99;
                    assert_int_equal(ast_linalg_gram_ema_batched(dt, B, n, n1, gd, beta, alpha,
                                                                 has_l ? ld : NULL,
                                                                 has_r ? rd : NULL, &fi),
                                     0);
                    assert_int_equal(fi, -1);
                    assert_int_equal(ast_linalg_last_retried(), 0);
                    assert_true(sentinel_intact(ld + B * nl * es, 8 * es));
                    assert_true(sentinel_intact(rd + B * nr * es, 8 * es));
                    if (!has_l)
                        assert_memory_equal(ld, l0, B * nl * es);
                    if (!has_r)
                        assert_memory_equal(rd, r0, B * nr * es);
                    double *got_l = dalloc(nl), *got_r = dalloc(nr), *ref_l = dalloc(nl),
                           *ref_r = dalloc(nr), *bnd_l = dalloc(nl), *bnd_r = dalloc(nr);
                    double *ga = abs_copy(B * ng, g), *la = abs_copy(B * nl, l),
                           *ra = abs_copy(B * nr, r);
                    char *one_l = xalloc(nl * es), *one_r = xalloc(nr * es);
                    for (int b = 0; b < B; b++) {
                        ref_gram_ema(n, n1, g + b * ng, beta, alpha, l + b * nl, r + b * nr,
                                     has_l ? ref_l : NULL, has_r ? ref_r : NULL);
                        ref_gram_ema(n, n1, ga + b * ng, fabs(beta), fabs(alpha), la + b * nl,
                                     ra + b * nr, has_l ? bnd_l : NULL, has_r ? bnd_r : NULL);
                        memcpy(one_l, l0 + b * nl * es, nl * es);
                        memcpy(one_r, r0 + b * nr * es, nr * es);
                        assert_int_equal(ast_linalg_gram_ema(dt, n, n1, gd + b * ng * es, beta,
                                                             alpha, has_l ? one_l : NULL,
                                                             has_r ? one_r : NULL),
                                         0);
                        if (has_l) {
                            from_dt(dt, nl, ld + b * nl * es, got_l);
                            expect_gram(dt, n, n1, got_l, ref_l, bnd_l, "L", b);
                            assert_memory_equal(one_l, ld + b * nl * es, nl * es);
                        }
                        if (has_r) {
                            from_dt(dt, nr, rd + b * nr * es, got_r);
                            expect_gram(dt, n1, n, got_r, ref_r, bnd_r, "R", b);
                            assert_memory_equal(one_r, rd + b * nr * es, nr * es);
                        }
                    }
                    free_all(g, l, r, gd, ld, rd, l0, r0, got_l, got_r, ref_l, ref_r, bnd_l, bnd_r,
                             ga, la, ra, one_l, one_r, NULL);
                }
}

/* L and R are taken as symmetric: what their strict lower triangles hold does not matter. */
static void test_gram_ema_reads_upper_triangle(void **state)
{
    (void)state;
    enum { N = 5, N1 = 3 };
    double g[N * N1], l[N * N], r[N1 * N1], l2[N * N], r2[N1 * N1];
    rng_seed(32);
    for (int i = 0; i < N * N1; i++)
        g[i] = nrand();
    rand_sym(N, l);
    rand_sym(N1, r);
    memcpy(l2, l, sizeof l);
    memcpy(r2, r, sizeof r);
    for (int i = 0; i < N; i++)
        for (int j = 0; j < i; j++)
            l2[i * N + j] = 1e3;
    for (int i = 0; i < N1; i++)
        for (int j = 0; j < i; j++)
            r2[i * N1 + j] = -1e3;
    assert_int_equal(ast_linalg_gram_ema(AST_F64, N, N1, g, 0.9, 0.1, l, r), 0);
    assert_int_equal(ast_linalg_gram_ema(AST_F64, N, N1, g, 0.9, 0.1, l2, r2), 0);
    assert_memory_equal(l, l2, sizeof l);
    assert_memory_equal(r, r2, sizeof r);
}

/* The finiteness check of G looks at every element: one NaN / +-inf anywhere (first, last, at
 * and around the check's chunk edges, in the tail of a count that is no multiple of 4) is
 * AST_ENONFINITE with L and R untouched, while the largest finite values pass. */
static void test_gram_ema_finite_check_positions(void **state)
{
    (void)state;
    enum { N = 33, N1 = 65 }; /* 2,145 elements: two whole chunks of 1,024 and a tail of 97 */
    const size_t ng = (size_t)N * N1, nl = (size_t)N * N, nr = (size_t)N1 * N1;
    const size_t at[] = {0, 1, 2, 3, 1022, 1023, 1024, 1025, 2047, 2048, 2049, 2143, 2144};
    const double bad[] = {NAN, INFINITY, -INFINITY};
    for (size_t d = 0; d < 2; d++) {
        const ast_dtype dt = dtypes[d];
        const size_t es = ast_dtype_size(dt);
        double *g = dalloc(ng), *l = dalloc(nl), *r = dalloc(nr);
        for (size_t i = 0; i < ng; i++)
            g[i] = 1e-3 * (double)(i % 17);
        rand_sym(N, l);
        rand_sym(N1, r);
        char *gd = to_dt(dt, ng, g), *ld = to_dt(dt, nl, l), *rd = to_dt(dt, nr, r);
        char *l0 = to_dt(dt, nl, l), *r0 = to_dt(dt, nr, r);
        for (size_t k = 0; k < sizeof at / sizeof at[0]; k++) {
            char saved[8];
            poison_elem(gd + at[k] * es, dt, bad[k % 3], saved);
            assert_int_equal(ast_linalg_gram_ema(dt, N, N1, gd, 0.9, 0.1, ld, rd),
                             AST_ENONFINITE);
            assert_memory_equal(ld, l0, nl * es);
            assert_memory_equal(rd, r0, nr * es);
            memcpy(gd + at[k] * es, saved, es);
        }
        /* huge but finite: no false alarm (x - x is 0 for any finite x) */
        const double big = dt == AST_F32 ? FLT_MAX : DBL_MAX;
        poison_elem(gd + 5 * es, dt, big, (char[8]){0});
        poison_elem(gd + (ng - 1) * es, dt, -big, (char[8]){0});
        assert_int_equal(ast_linalg_gram_ema(dt, N, N1, gd, 0.0, 0.0, ld, NULL), 0);
        void *bufs[] = {g, l, r, gd, ld, rd, l0, r0};
        for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++)
            free(bufs[i]);
    }
}

/* NaN/Inf in any block's G: AST_ENONFINITE at the first poisoned block, no retry, and L and R of
 * EVERY block as they were (all of G is checked before anything is written), for each side.
 * Bad arguments (shape, NULLs, dtype, batch, non-finite or out-of-range beta / alpha, L or R
 * overlapping G or each other): AST_EINVAL, failed_index 0, nothing written. */
static void test_gram_ema_failures(void **state)
{
    (void)state;
    enum { B = 3, N = 5, N1 = 3 };
    const size_t ng = N * N1, nl = N * N, nr = N1 * N1;
    rng_seed(33);
    for (size_t d = 0; d < 2; d++) {
        const ast_dtype dt = dtypes[d];
        const size_t es = ast_dtype_size(dt);
        double g[B * ng], l[B * nl], r[B * nr];
        for (size_t i = 0; i < B * ng; i++)
            g[i] = nrand();
        for (int b = 0; b < B; b++) {
            rand_sym(N, l + b * nl);
            rand_sym(N1, r + b * nr);
        }
        char *gd = to_dt(dt, B * ng, g), *ld = to_dt(dt, B * nl, l), *rd = to_dt(dt, B * nr, r);
        char *g0 = to_dt(dt, B * ng, g), *l0 = to_dt(dt, B * nl, l), *r0 = to_dt(dt, B * nr, r);
        const double bad[] = {NAN, INFINITY, -INFINITY};
        for (int side = GRAM_BOTH; side <= GRAM_R; side++) {
            char *la = side != GRAM_R ? ld : NULL, *ra = side != GRAM_L ? rd : NULL;
            for (int fail_at = 0; fail_at < B; fail_at++) {
                char *poison = gd + ((size_t)fail_at * ng + 2 + side) * es, saved[8];
                char *later = gd + ((size_t)(B - 1) * ng + ng - 1) * es, saved_later[8];
                poison_elem(poison, dt, bad[fail_at], saved);
                if (fail_at < B - 1) /* a second poisoned block after it changes nothing */
                    poison_elem(later, dt, NAN, saved_later);
                int fi = 99;
                assert_int_equal(ast_linalg_gram_ema_batched(dt, B, N, N1, gd, 0.95, 0.05, la,
                                                             ra, &fi),
                                 AST_ENONFINITE);
                assert_int_equal(fi, fail_at);
                assert_int_equal(ast_linalg_last_retried(), 0);
                assert_memory_equal(ld, l0, B * nl * es);
                assert_memory_equal(rd, r0, B * nr * es);
                assert_int_equal(ast_linalg_gram_ema(dt, N, N1, gd + fail_at * ng * es, 0.95,
                                                     0.05, la ? la + fail_at * nl * es : NULL,
                                                     ra ? ra + fail_at * nr * es : NULL),
                                 AST_ENONFINITE);
                assert_memory_equal(ld, l0, B * nl * es);
                assert_memory_equal(rd, r0, B * nr * es);
                memcpy(poison, saved, es);
                if (fail_at < B - 1)
                    memcpy(later, saved_later, es);
            }
        }

        /* Bad arguments. */
        int fi = 99;
        assert_int_equal(ast_linalg_gram_ema(dt, N, 0, gd, 0.9, 0.1, ld, rd), AST_EINVAL);
        assert_int_equal(ast_linalg_gram_ema(dt, N, -1, gd, 0.9, 0.1, ld, rd), AST_EINVAL);
        assert_int_equal(ast_linalg_gram_ema(dt, 0, N1, gd, 0.9, 0.1, ld, rd), AST_EINVAL);
        assert_int_equal(ast_linalg_gram_ema(dt, N, N1, gd, 0.9, 0.1, NULL, NULL), AST_EINVAL);
        assert_int_equal(ast_linalg_gram_ema(dt, N, N1, NULL, 0.9, 0.1, ld, rd), AST_EINVAL);
        assert_int_equal(ast_linalg_gram_ema((ast_dtype)5, N, N1, gd, 0.9, 0.1, ld, rd),
                         AST_EINVAL);
        assert_int_equal(ast_linalg_gram_ema(dt, N, N1, gd, NAN, 0.1, ld, rd), AST_EINVAL);
        assert_int_equal(ast_linalg_gram_ema(dt, N, N1, gd, 0.9, INFINITY, ld, rd), AST_EINVAL);
        assert_int_equal(ast_linalg_gram_ema(dt, N, N1, gd, -INFINITY, 0.1, ld, NULL),
                         AST_EINVAL);
        if (dt == AST_F32) /* finite in float64, not in float32 */
            assert_int_equal(ast_linalg_gram_ema(dt, N, N1, gd, 1e39, 0.1, ld, rd), AST_EINVAL);
        assert_int_equal(ast_linalg_gram_ema_batched(dt, -1, N, N1, gd, 0.9, 0.1, ld, rd, &fi),
                         AST_EINVAL);
        assert_int_equal(fi, 0);
        /* L over G (in place), R over G's last element, L and R overlapping each other. */
        fi = 99;
        assert_int_equal(ast_linalg_gram_ema_batched(dt, B, N, N1, gd, 0.9, 0.1, gd, NULL, &fi),
                         AST_EINVAL);
        assert_int_equal(fi, 0);
        assert_int_equal(ast_linalg_gram_ema_batched(dt, B, N, N1, gd, 0.9, 0.1, NULL,
                                                     gd + (B * ng - 1) * es, &fi),
                         AST_EINVAL);
        assert_int_equal(ast_linalg_gram_ema_batched(dt, B, N, N1, gd, 0.9, 0.1, ld,
                                                     ld + (B * nl - 1) * es, &fi),
                         AST_EINVAL);
        assert_int_equal(ast_linalg_gram_ema(dt, N, N1, gd, 0.9, 0.1, rd, rd), AST_EINVAL);
        assert_memory_equal(gd, g0, B * ng * es);
        assert_memory_equal(ld, l0, B * nl * es);
        assert_memory_equal(rd, r0, B * nr * es);
        /* An empty batch succeeds and writes nothing. */
        fi = 99;
        assert_int_equal(ast_linalg_gram_ema_batched(dt, 0, N, N1, gd, 0.9, 0.1, ld, rd, &fi), 0);
        assert_int_equal(fi, -1);
        assert_memory_equal(ld, l0, B * nl * es);
        assert_memory_equal(rd, r0, B * nr * es);
        free_all(gd, ld, rd, g0, l0, r0, NULL);
    }
}

/* A finite G whose product overflows the type is no failure and is not retried: the call returns
 * 0 with the arithmetic's Inf in L, as torch.baddbmm would give (linalg.h). */
static void test_gram_ema_overflow_is_arithmetic(void **state)
{
    (void)state;
    const float g[2] = {3e38f, 3e38f};
    float l[1] = {1.0f}, r[4] = {1, 0, 0, 1};
    assert_int_equal(ast_linalg_gram_ema(AST_F32, 1, 2, g, 0.5, 0.5, l, r), 0);
    assert_int_equal(ast_linalg_last_retried(), 0);
    assert_true(isinf(l[0]));
    for (int i = 0; i < 4; i++)
        assert_true(isinf(r[i]));
}

/* ---- the float32 -> float64 retry ------------------------------------------------------------ */

/* F = 3e38 * ones(2) is finite in float32, but F Q with Q a 45-degree rotation has entries
 * 3e38 * sqrt(2) > FLT_MAX: the float32 product overflows, the float64 retry does not, and its
 * orthonormal result rounds back to float32 without loss of range. The float32 answer must be
 * exactly the float64 answer (on the same inputs) rounded. */
static void test_retry_f64(void **state)
{
    (void)state;
    const float big = 3e38f, r = (float)(1 / sqrt(2.0));
    const float f32[4] = {big, big, big, big}, q32[4] = {r, -r, r, r};
    const double f64[4] = {big, big, big, big}, q64[4] = {r, -r, r, r};
    float o32[4], w32[2];
    double o64[4], w64[2];
    int64_t p32[2], p64[2];

    assert_int_equal(ast_linalg_soap_refresh(AST_F32, 2, f32, q32, o32, p32), 0);
    assert_int_equal(ast_linalg_last_retried(), 1);
    assert_int_equal(ast_linalg_soap_refresh(AST_F64, 2, f64, q64, o64, p64), 0);
    assert_int_equal(ast_linalg_last_retried(), 0);
    assert_memory_equal(p32, p64, sizeof p32);
    for (int i = 0; i < 4; i++)
        assert_true(o32[i] == (float)o64[i]);

    assert_int_equal(ast_linalg_qr_refresh(AST_F32, 2, f32, q32, o32), 0);
    assert_int_equal(ast_linalg_last_retried(), 1);
    assert_int_equal(ast_linalg_qr_refresh(AST_F64, 2, f64, q64, o64), 0);
    for (int i = 0; i < 4; i++)
        assert_true(o32[i] == (float)o64[i]);

    /* Its largest eigenvalue, 6e38, overflows float32: the float32 inverse root fails, the
     * float64 one succeeds (the eigenvalue only enters as 6e38^(-1/2)). */
    assert_int_equal(ast_linalg_inv_root(AST_F32, 2, f32, 2, 1, o32), 0);
    assert_int_equal(ast_linalg_last_retried(), 1);
    assert_int_equal(ast_linalg_inv_root(AST_F64, 2, f64, 2, 1, o64), 0);
    for (int i = 0; i < 4; i++)
        assert_true(o32[i] == (float)o64[i]);

    /* eigh must return 6e38 itself, which float32 cannot hold even after the retry. */
    fill_sentinel(w32, sizeof w32);
    fill_sentinel(o32, sizeof o32);
    assert_int_equal(ast_linalg_eigh(AST_F32, 2, f32, w32, o32), AST_ENONFINITE);
    assert_int_equal(ast_linalg_last_retried(), 1);
    assert_true(sentinel_intact(w32, sizeof w32));
    assert_true(sentinel_intact(o32, sizeof o32));
    assert_int_equal(ast_linalg_eigh(AST_F64, 2, f64, w64, o64), 0);
    assert_le(fabs(w64[0] - 6e38) / 6e38, 1e-7);

    /* Clean float32 input: no retry, and the flag is reset by the next call. */
    const float id[4] = {1, 0, 0, 1};
    assert_int_equal(ast_linalg_eigh(AST_F32, 2, id, w32, o32), 0);
    assert_int_equal(ast_linalg_last_retried(), 0);
}

/* ---- concurrency ---------------------------------------------------------------------------- */

enum { TN = 48, TTHREADS = 4, TREPS = 3 };

typedef struct thread_case {
    const float *a32;
    const double *a64, *q64;
    const float *ref_w32, *ref_x32;
    const double *ref_q64, *ref_x64, *ref_s64;
    const int64_t *ref_perm;
    int ok, retried_at_start;
} thread_case;

static void *thread_main(void *arg)
{
    thread_case *c = arg;
    float w32[TN], x32[TN * TN], q32[TN * TN];
    double q64[TN * TN], x64[TN * TN], s64[TN * TN];
    int64_t perm[TN];
    c->retried_at_start = ast_linalg_last_retried();
    ast_linalg_init();
    c->ok = 1;
    for (int r = 0; r < TREPS && c->ok; r++) {
        c->ok &= ast_linalg_eigh(AST_F32, TN, c->a32, w32, q32) == 0 &&
                 memcmp(w32, c->ref_w32, sizeof w32) == 0;
        c->ok &= ast_linalg_inv_root(AST_F32, TN, c->a32, 4, 1e-6, x32) == 0 &&
                 memcmp(x32, c->ref_x32, sizeof x32) == 0;
        c->ok &= ast_linalg_eigh(AST_F64, TN, c->a64, NULL, q64) == 0 &&
                 memcmp(q64, c->ref_q64, sizeof q64) == 0;
        c->ok &= ast_linalg_newton_inv_root(AST_F64, TN, c->a64, 2, 1e-6, 100, 1e-10, x64) == 0 &&
                 memcmp(x64, c->ref_x64, sizeof x64) == 0;
        c->ok &= ast_linalg_soap_refresh(AST_F64, TN, c->a64, c->q64, s64, perm) == 0 &&
                 memcmp(s64, c->ref_s64, sizeof s64) == 0 &&
                 memcmp(perm, c->ref_perm, sizeof perm) == 0;
    }
    return NULL;
}

/* Concurrent calls from several threads give bitwise the single-threaded results (no shared
 * workspace, OpenBLAS on one thread per call), and the retry flag is per thread. Under TSan this
 * is the race check for the module. */
static void test_concurrent(void **state)
{
    (void)state;
    const size_t nn = TN * TN;
    double lam[TN];
    rng_seed(13);
    for (int i = 0; i < TN; i++)
        lam[i] = pow(10, 2 * urand());
    double *a64 = rand_with_spectrum(TN, lam, NULL), *q64 = dalloc(nn);
    rand_orthogonal(TN, q64);
    float *a32 = to_dt(AST_F32, nn, a64);
    float *w32 = xalloc(TN * 4), *x32 = xalloc(nn * 4), *q32 = xalloc(nn * 4);
    double *rq = dalloc(nn), *rx = dalloc(nn), *rs = dalloc(nn);
    int64_t perm[TN];
    assert_int_equal(ast_linalg_eigh(AST_F32, TN, a32, w32, q32), 0);
    assert_int_equal(ast_linalg_inv_root(AST_F32, TN, a32, 4, 1e-6, x32), 0);
    assert_int_equal(ast_linalg_eigh(AST_F64, TN, a64, NULL, rq), 0);
    assert_int_equal(ast_linalg_newton_inv_root(AST_F64, TN, a64, 2, 1e-6, 100, 1e-10, rx), 0);
    assert_int_equal(ast_linalg_soap_refresh(AST_F64, TN, a64, q64, rs, perm), 0);

    /* Leave this thread's flag set: other threads must not see it. */
    const float big[4] = {3e38f, 3e38f, 3e38f, 3e38f}, rot[4] = {0.6f, -0.8f, 0.8f, 0.6f};
    float qn[4];
    int64_t p2[2];
    assert_int_equal(ast_linalg_soap_refresh(AST_F32, 2, big, rot, qn, p2), 0);
    assert_int_equal(ast_linalg_last_retried(), 1);

    pthread_t th[TTHREADS];
    thread_case cs[TTHREADS];
    for (int t = 0; t < TTHREADS; t++) {
        cs[t] = (thread_case){.a32 = a32, .a64 = a64, .q64 = q64, .ref_w32 = w32,
                              .ref_x32 = x32, .ref_q64 = rq, .ref_x64 = rx, .ref_s64 = rs,
                              .ref_perm = perm};
        assert_int_equal(pthread_create(&th[t], NULL, thread_main, &cs[t]), 0);
    }
    for (int t = 0; t < TTHREADS; t++) {
        assert_int_equal(pthread_join(th[t], NULL), 0);
        assert_true(cs[t].ok);
        assert_int_equal(cs[t].retried_at_start, 0);
    }
    assert_int_equal(ast_linalg_last_retried(), 1);
    free_all(a64, q64, a32, w32, x32, q32, rq, rx, rs, NULL);
}

int main(void)
{
    ast_linalg_init();
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_dtype_size),
        cmocka_unit_test(test_eigh_identity),
        cmocka_unit_test(test_eigh_diagonal),
        cmocka_unit_test(test_rank_deficient_bases),
        cmocka_unit_test(test_one_by_one),
        cmocka_unit_test(test_eigh_spectra),
        cmocka_unit_test(test_eigh_partial_outputs),
        cmocka_unit_test(test_nonfinite_input),
        cmocka_unit_test(test_bad_args),
        cmocka_unit_test(test_inv_root_restatement),
        cmocka_unit_test(test_inv_root_clamp),
        cmocka_unit_test(test_inv_root_ill_conditioned),
        cmocka_unit_test(test_inv_root_identity_and_singular),
        cmocka_unit_test(test_newton_vs_eigen),
        cmocka_unit_test(test_newton_failures),
        cmocka_unit_test(test_soap_refresh_restatement),
        cmocka_unit_test(test_soap_refresh_ties),
        cmocka_unit_test(test_soap_refresh_converges),
        cmocka_unit_test(test_qr_refresh_restatement),
        cmocka_unit_test(test_batched),
        cmocka_unit_test(test_former_names),
        cmocka_unit_test(test_retry_f64),
        cmocka_unit_test(test_soap_rotate_restatement),
        cmocka_unit_test(test_soap_rotate_same_basis_is_identity),
        cmocka_unit_test(test_soap_rotate_failures),
        cmocka_unit_test(test_soap_rotate_retry_f64),
        cmocka_unit_test(test_gram_ema_restatement),
        cmocka_unit_test(test_gram_ema_reads_upper_triangle),
        cmocka_unit_test(test_gram_ema_failures),
        cmocka_unit_test(test_gram_ema_finite_check_positions),
        cmocka_unit_test(test_gram_ema_overflow_is_arithmetic),
        cmocka_unit_test(test_concurrent),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
