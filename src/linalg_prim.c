/*
 * linalg_prim.c - the typed primitives of the host REFRESH kernels (linalg_prim.h): the float and
 * double instances of ast__kern, the workspace allocation, the Householder QR.
 *
 * Owns: two constant tables (one per dtype), written once by AST__LINALG_TYPED so the kernels
 * and the canonical bases are written once over ast__kern and never name a type; with them the
 * public ast_dtype_size, and ast_linalg_init (asteria/linalg.h), which pins OpenBLAS to one
 * thread once (a pthread_once flag, the only state). Otherwise each call allocates its own
 * workspace and frees it before returning, so any thread may call in concurrently with no lock.
 *
 * May call: LAPACKE (?syevd, ?geqrf, ?orgqr, ?lange), CBLAS (?gemm, ?syrk, ?dot, ?scal) and
 * OpenBLAS's thread count only: the one file of libasteria that names them.
 * Column-major ("cm") buffers are the ones handed to LAPACK.
 */
#include "linalg_prim.h"

#include "asteria/errors.h"

#include <float.h>
#include <math.h>
#include <pthread.h>
#include <stdlib.h>

#define WS_ALIGN 64
#define TRANSPOSE_TILE 32
#define FINITE_CHUNK 1024

/* The float32 dot accumulates in double (dsdot) so the ordering of SOAP's e is not decided by
 * float32 cancellation. */
#define AST__LINALG_TYPED(T, P, DOT, MAXV, EPSM)                                                  \
    static lapack_int P##_syevd(lapack_int n, void *a, void *w, void *work, lapack_int lwork,     \
                                lapack_int *iwork, lapack_int liwork)                             \
    {                                                                                             \
        return LAPACKE_##P##syevd_work(LAPACK_COL_MAJOR, 'V', 'L', n, a, n, w, work, lwork,       \
                                       iwork, liwork);                                            \
    }                                                                                             \
    static lapack_int P##_geqrf(lapack_int n, lapack_int m, void *a, void *tau, void *work,       \
                                lapack_int lwork)                                                 \
    {                                                                                             \
        return LAPACKE_##P##geqrf_work(LAPACK_COL_MAJOR, n, m, a, n, tau, work, lwork);           \
    }                                                                                             \
    static lapack_int P##_orgqr(lapack_int n, lapack_int m, void *a, const void *tau,             \
                                void *work, lapack_int lwork)                                     \
    {                                                                                             \
        return LAPACKE_##P##orgqr_work(LAPACK_COL_MAJOR, n, m, m, a, n, tau, work, lwork);        \
    }                                                                                             \
    static double P##_lange(char norm, int n, const void *a)                                      \
    {                                                                                             \
        return LAPACKE_##P##lange_work(LAPACK_COL_MAJOR, norm, n, n, a, n, NULL);                 \
    }                                                                                             \
    static void P##_gemm(CBLAS_ORDER order, CBLAS_TRANSPOSE ta, CBLAS_TRANSPOSE tb, int n,        \
                         const void *a, const void *b, void *c)                                   \
    {                                                                                             \
        cblas_##P##gemm(order, ta, tb, n, n, n, 1, a, n, b, n, 0, c, n);                          \
    }                                                                                             \
    static void P##_gemm_cm(CBLAS_TRANSPOSE ta, CBLAS_TRANSPOSE tb, int m, int n, int k,          \
                            double alpha, const void *a, int lda, const void *b, int ldb,         \
                            double beta, void *c, int ldc)                                        \
    {                                                                                             \
        cblas_##P##gemm(CblasColMajor, ta, tb, m, n, k, (T)alpha, a, lda, b, ldb, (T)beta, c,     \
                        ldc);                                                                     \
    }                                                                                             \
    static void P##_gemm_rm(CBLAS_TRANSPOSE ta, CBLAS_TRANSPOSE tb, int m, int n, int k,          \
                            const void *a, int lda, const void *b, int ldb, void *c, int ldc)     \
    {                                                                                             \
        cblas_##P##gemm(CblasRowMajor, ta, tb, m, n, k, 1, a, lda, b, ldb, 0, c, ldc);            \
    }                                                                                             \
    static void P##_syrk(int n, const void *a, void *c)                                           \
    {                                                                                             \
        cblas_##P##syrk(CblasColMajor, CblasLower, CblasNoTrans, n, n, 1, a, n, 0, c, n);         \
    }                                                                                             \
    static void P##_syrk_rm(CBLAS_TRANSPOSE ta, int n, int k, double alpha, const void *a,        \
                            int lda, double beta, void *c)                                        \
    {                                                                                             \
        cblas_##P##syrk(CblasRowMajor, CblasUpper, ta, n, k, (T)alpha, a, lda, (T)beta, c, n);    \
    }                                                                                             \
    static double P##_dot(int n, const void *x, int incx, const void *y, int incy)                \
    {                                                                                             \
        return DOT(n, x, incx, y, incy);                                                          \
    }                                                                                             \
    static void P##_scal(int count, double alpha, void *x)                                        \
    {                                                                                             \
        cblas_##P##scal(count, (T)alpha, x, 1);                                                   \
    }                                                                                             \
    static double P##_get(const void *v, size_t i) { return ((const T *)v)[i]; }                  \
    static void P##_set(void *v, size_t i, double x) { ((T *)v)[i] = (T)x; }                      \
    static int P##_finite(size_t count, const void *v)                                            \
    {                                                                                             \
        /* x - x is 0 for a finite x and NaN for NaN / +-inf; a chunk's sum of them has no        \
         * branch per element (the early exit is per chunk) and cannot overflow */                \
        const T *x = v;                                                                           \
        for (size_t i0 = 0; i0 < count; i0 += FINITE_CHUNK) {                                     \
            const size_t end = count - i0 < FINITE_CHUNK ? count : i0 + FINITE_CHUNK;             \
            T s0 = 0, s1 = 0, s2 = 0, s3 = 0;                                                     \
            size_t i = i0;                                                                        \
            for (; i + 4 <= end; i += 4) {                                                        \
                s0 += x[i] - x[i];                                                                \
                s1 += x[i + 1] - x[i + 1];                                                        \
                s2 += x[i + 2] - x[i + 2];                                                        \
                s3 += x[i + 3] - x[i + 3];                                                        \
            }                                                                                     \
            for (; i < end; i++)                                                                  \
                s0 += x[i] - x[i];                                                                \
            if (s0 + s1 + s2 + s3 != 0)                                                           \
                return 0;                                                                         \
        }                                                                                         \
        return 1;                                                                                 \
    }                                                                                             \
    static void P##_transpose(int n, const void *src, void *dst, int reverse)                     \
    {                                                                                             \
        const T *s = src;                                                                         \
        T *d = dst;                                                                               \
        for (int i0 = 0; i0 < n; i0 += TRANSPOSE_TILE)                                            \
            for (int j0 = 0; j0 < n; j0 += TRANSPOSE_TILE)                                        \
                for (int j = j0; j < n && j < j0 + TRANSPOSE_TILE; j++) {                         \
                    const T *col = s + (size_t)(reverse ? n - 1 - j : j) * n;                     \
                    for (int i = i0; i < n && i < i0 + TRANSPOSE_TILE; i++)                       \
                        d[(size_t)i * n + j] = col[i];                                            \
                }                                                                                 \
    }                                                                                             \
    static void P##_mirror_lower(int n, void *a)                                                  \
    {                                                                                             \
        /* in tiles, as the transpose: a column-at-a-time copy misses the cache on every write    \
         * once a row is larger than a few cache lines */                                         \
        T *x = a;                                                                                 \
        for (int i0 = 0; i0 < n; i0 += TRANSPOSE_TILE)                                            \
            for (int j0 = 0; j0 <= i0; j0 += TRANSPOSE_TILE)                                      \
                for (int i = i0; i < n && i < i0 + TRANSPOSE_TILE; i++)                           \
                    for (int j = j0; j < i && j < j0 + TRANSPOSE_TILE; j++)                       \
                        x[(size_t)i * n + j] = x[(size_t)j * n + i];                              \
    }                                                                                             \
    static void P##_shift_diag(int n, void *a, double c)                                          \
    {                                                                                             \
        T *x = a;                                                                                 \
        for (int i = 0; i < n; i++)                                                               \
            x[(size_t)i * n + i] += (T)c;                                                         \
    }                                                                                             \
    static double P##_dist_identity_inf(int n, const void *a)                                     \
    {                                                                                             \
        const T *x = a;                                                                           \
        double worst = 0;                                                                         \
        for (int i = 0; i < n; i++) {                                                             \
            double row = 0;                                                                       \
            for (int j = 0; j < n; j++)                                                           \
                row += fabs((double)x[(size_t)i * n + j] - (i == j));                             \
            if (!(row <= worst))                                                                  \
                worst = row;                                                                      \
        }                                                                                         \
        return worst;                                                                             \
    }                                                                                             \
    static void P##_symmetrize(int n, void *a)                                                    \
    {                                                                                             \
        T *x = a;                                                                                 \
        for (int i = 0; i < n; i++)                                                               \
            for (int j = i + 1; j < n; j++) {                                                     \
                T v = (T)0.5 * (x[(size_t)i * n + j] + x[(size_t)j * n + i]);                     \
                x[(size_t)i * n + j] = x[(size_t)j * n + i] = v;                                  \
            }                                                                                     \
    }                                                                                             \
    static const ast__kern P##_kern = {                                                           \
        .es = sizeof(T),                                                                          \
        .maxval = MAXV,                                                                           \
        .epsm = EPSM,                                                                             \
        .syevd = P##_syevd,                                                                       \
        .geqrf = P##_geqrf,                                                                       \
        .orgqr = P##_orgqr,                                                                       \
        .lange = P##_lange,                                                                       \
        .gemm = P##_gemm,                                                                         \
        .gemm_cm = P##_gemm_cm,                                                                   \
        .gemm_rm = P##_gemm_rm,                                                                   \
        .syrk = P##_syrk,                                                                         \
        .syrk_rm = P##_syrk_rm,                                                                   \
        .dot = P##_dot,                                                                           \
        .scal = P##_scal,                                                                         \
        .get = P##_get,                                                                           \
        .set = P##_set,                                                                           \
        .finite = P##_finite,                                                                     \
        .transpose = P##_transpose,                                                               \
        .mirror_lower = P##_mirror_lower,                                                         \
        .shift_diag = P##_shift_diag,                                                             \
        .dist_identity_inf = P##_dist_identity_inf,                                               \
        .symmetrize = P##_symmetrize,                                                             \
    };

AST__LINALG_TYPED(float, s, cblas_dsdot, FLT_MAX, FLT_EPSILON)
AST__LINALG_TYPED(double, d, cblas_ddot, DBL_MAX, DBL_EPSILON)


const ast__kern *ast__kern_for(ast_dtype dt)
{
    switch (dt) {
    case AST_F32:
        return &s_kern;
    case AST_F64:
        return &d_kern;
    }
    return NULL;
}

size_t ast_dtype_size(ast_dtype dt)
{
    const ast__kern *K = ast__kern_for(dt);
    return K ? K->es : 0;
}

static pthread_once_t init_once = PTHREAD_ONCE_INIT;

static void init_once_fn(void) { openblas_set_num_threads(1); }

void ast_linalg_init(void) { pthread_once(&init_once, init_once_fn); }

/* ---- workspace ------------------------------------------------------------------------------- */

static size_t ws_round(size_t x) { return (x + WS_ALIGN - 1) & ~(size_t)(WS_ALIGN - 1); }

void *ast__ws_alloc(int count, const size_t *sizes, void **out)
{
    size_t total = 0;
    for (int i = 0; i < count; i++) {
        size_t s = ws_round(sizes[i] ? sizes[i] : 1);
        if (s < sizes[i] || total > SIZE_MAX - s)
            return NULL;
        total += s;
    }
    char *base = aligned_alloc(WS_ALIGN, total);
    if (!base)
        return NULL;
    size_t off = 0;
    for (int i = 0; i < count; i++) {
        out[i] = base + off;
        off += ws_round(sizes[i] ? sizes[i] : 1);
    }
    return base;
}

/* LAPACK reports workspace sizes as floating-point values in the work array's type; a float
 * may round a large size down, so never go below the documented minimum. */
lapack_int ast__ws_lwork(const ast__kern *K, const void *query, lapack_int minimum)
{
    double q = ceil(K->get(query, 0));
    if (!(q < (double)INT32_MAX))
        return INT32_MAX;
    return (lapack_int)q > minimum ? (lapack_int)q : minimum;
}

/* ---- QR -------------------------------------------------------------------------------------- */

int ast__qr_cols(const ast__kern *K, int n, int m, void *a, double *rdiag)
{
    double q1 = 0, q2 = 0;
    if (K->geqrf(n, m, a, NULL, &q1, -1) != 0 || K->orgqr(n, m, a, NULL, &q2, -1) != 0)
        return AST_EINVAL;
    lapack_int l1 = ast__ws_lwork(K, &q1, m), l2 = ast__ws_lwork(K, &q2, m);
    lapack_int lwork = l1 > l2 ? l1 : l2;
    size_t sz[2] = {(size_t)m * K->es, (size_t)lwork * K->es};
    void *buf[2];
    void *base = ast__ws_alloc(2, sz, buf);
    if (!base)
        return AST_ENOMEM;
    int rc = 0;
    if (K->geqrf(n, m, a, buf[0], buf[1], lwork) != 0)
        rc = AST_EINVAL;
    for (int j = 0; rc == 0 && rdiag && j < m; j++)
        rdiag[j] = K->get(a, (size_t)j * n + j);
    if (rc == 0 && K->orgqr(n, m, a, buf[0], buf[1], lwork) != 0)
        rc = AST_EINVAL;
    if (rc == 0 && !K->finite((size_t)n * m, a))
        rc = AST_ENONFINITE;
    free(base);
    return rc;
}
