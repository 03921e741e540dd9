/*
 * linalg.c - the host REFRESH kernels (asteria/linalg.h): eigh, inverse p-th roots (eigen and
 * coupled Newton), SOAP's and KL-Shampoo's QR power-iteration refreshes, SOAP's
 * re-expression of its first moment in a new basis (soap_rotate) and its factors' EMA update
 * (gram_ema); and the REFRESH op table (op_table.h) that the runtime validates and runs
 * requests with.
 *
 * Owns: the op table, one constant entry per ast_op (runtime.h): its name (ast_op_name), which
 * of a request's pointers it takes, the check of its own arguments and buffer sizes, the run
 * function a pool worker calls, and the kernel of one block. A new op is its kernel and its entry
 * here plus its ast_op value; src/runtime.c and the extension read the table and do not change.
 * Beyond that, nothing outlives a call. Every call allocates its own workspace (one block) and
 * frees it before returning; the only state outside a call is a pthread_once flag and a
 * thread-local "retried" flag, so any number of threads may call in concurrently with no locks.
 *
 * May call: LAPACKE (?syevd, ?geqrf, ?orgqr, ?lange) and CBLAS (?gemm, ?syrk, ?dot, ?scal) only
 * (the op table's run functions call this file's own entry points; its checks format their
 * messages with util.h).
 * OpenBLAS is pinned to one thread (ast_linalg_init, also run lazily by every entry point):
 * parallelism comes from running many blocks on pool workers, and a multithreaded OpenBLAS
 * inside each worker would oversubscribe the cores.
 *
 * Layout: the public API is row-major. The kernels hand LAPACK column-major buffers; for
 * symmetric inputs the two layouts coincide, and the one transposition that remains (of an
 * eigenvector or Q matrix) is fused with the copy into the caller's output.
 *
 * The algorithms are written once over a table of typed primitives (`kern`), instantiated for
 * float and double by AST__LINALG_TYPED; run() owns validation, the input NaN/Inf check, the
 * float32 -> float64 retry and batching, so each kernel only computes.
 *
 * In-place ops (gram_ema: L and R are both read and written) cannot be retried, since the
 * kernel has overwritten what a retry would read, and need none: once the inputs are finite they
 * cannot fail. For them run() checks every block's inputs before it runs any block, so a
 * failure leaves every block as it was.
 *
 * Semantics this file adds to the header:
 *  - eigh and soap_refresh give the null space of a rank-deficient factor a canonical basis
 *    (the "canonical bases" section below), so their result is a function of the factor (and of
 *    the previous basis) and not of LAPACK's rounding; full-rank factors are untouched.
 *  - n must be in [1, LINALG_NMAX] (LAPACK's 32-bit workspace sizes bound n). soap_rotate and
 *    gram_ema call no LAPACK routine: any n, n1 >= 1 whose buffers' byte sizes fit a size_t.
 *  - ast_linalg_last_retried() reports the most recent ast_linalg_* call of the thread (any
 *    block of a batched call); every call resets it.
 *  - Batched calls set *failed_index (may be NULL) to -1 on success, to the failing block
 *    otherwise, and to 0 when the arguments themselves are rejected (nothing was written).
 *    gram_ema fails only on a non-finite G, found before anything is written.
 *  - Newton stops early with AST_ENOCONV once the iteration stalls (no new best ||M - I||_inf
 *    for NEWTON_STALL steps) or diverges (error above twice the best), rather than burning the
 *    remaining iterations at the rounding floor. Both tests apply only once the best error is
 *    below 1: before that the inf-norm may grow for a few steps while the exact iteration still
 *    converges (the 2-norm of M - I shrinks monotonically, the inf-norm need not).
 */
#include "asteria/linalg.h"

#include "asteria/errors.h"
#include "asteria/runtime.h"
#include "op_table.h"
#include "util.h"

#include <cblas.h>
#include <float.h>
#include <lapacke.h>
#include <limits.h>
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#ifdef BLAS_SYMBOL_PREFIX
/* An OpenBLAS whose symbols carry a prefix (scipy-openblas32 from PyPI, which the glibc 2.28
 * wheel links: docs/install.md; its pkg-config Cflags define BLAS_SYMBOL_PREFIX and its headers
 * declare the prefixed names). Every BLAS / LAPACKE name this file calls: */
#define AST__BLAS_CAT(p, n) p##n
#define AST__BLAS_PASTE(p, n) AST__BLAS_CAT(p, n)
#define AST__BLAS_NAME(n) AST__BLAS_PASTE(BLAS_SYMBOL_PREFIX, n)
#define LAPACKE_ssyevd_work AST__BLAS_NAME(LAPACKE_ssyevd_work)
#define LAPACKE_dsyevd_work AST__BLAS_NAME(LAPACKE_dsyevd_work)
#define LAPACKE_sgeqrf_work AST__BLAS_NAME(LAPACKE_sgeqrf_work)
#define LAPACKE_dgeqrf_work AST__BLAS_NAME(LAPACKE_dgeqrf_work)
#define LAPACKE_sorgqr_work AST__BLAS_NAME(LAPACKE_sorgqr_work)
#define LAPACKE_dorgqr_work AST__BLAS_NAME(LAPACKE_dorgqr_work)
#define LAPACKE_slange_work AST__BLAS_NAME(LAPACKE_slange_work)
#define LAPACKE_dlange_work AST__BLAS_NAME(LAPACKE_dlange_work)
#define cblas_sgemm AST__BLAS_NAME(cblas_sgemm)
#define cblas_dgemm AST__BLAS_NAME(cblas_dgemm)
#define cblas_ssyrk AST__BLAS_NAME(cblas_ssyrk)
#define cblas_dsyrk AST__BLAS_NAME(cblas_dsyrk)
#define cblas_sscal AST__BLAS_NAME(cblas_sscal)
#define cblas_dscal AST__BLAS_NAME(cblas_dscal)
#define cblas_dsdot AST__BLAS_NAME(cblas_dsdot)
#define cblas_ddot AST__BLAS_NAME(cblas_ddot)
#define openblas_set_num_threads AST__BLAS_NAME(openblas_set_num_threads)
#endif

/* Largest n whose ?syevd workspace (1 + 6n + 2n^2) fits a 32-bit lapack_int. */
#define LINALG_NMAX 32766
#define WS_ALIGN 64
#define TRANSPOSE_TILE 32
#define FINITE_CHUNK 1024
#define NEWTON_STALL 5

static pthread_once_t init_once = PTHREAD_ONCE_INIT;
static _Thread_local int tl_retried;

/* ---- typed primitives ------------------------------------------------------------------------ */

/* All matrices are n x n. "cm" marks column-major buffers handed to LAPACK. */
typedef struct kern {
    size_t es;     /* element size */
    double maxval; /* largest finite value of the type */
    double epsm;   /* machine epsilon of the type */
    lapack_int (*syevd)(lapack_int n, void *a_cm, void *w, void *work, lapack_int lwork,
                        lapack_int *iwork, lapack_int liwork);
    /* QR of an n x m column-major A (lda n, m <= n): Householder vectors, then Q's m columns */
    lapack_int (*geqrf)(lapack_int n, lapack_int m, void *a_cm, void *tau, void *work,
                        lapack_int lwork);
    lapack_int (*orgqr)(lapack_int n, lapack_int m, void *a_cm, const void *tau, void *work,
                        lapack_int lwork);
    double (*lange)(char norm, int n, const void *a_cm);
    void (*gemm)(CBLAS_ORDER order, CBLAS_TRANSPOSE ta, CBLAS_TRANSPOSE tb, int n, const void *a,
                 const void *b, void *c);
    /* column-major C (m x n, ldc) = alpha op(A) op(B) + beta C, op(A) m x k, op(B) k x n */
    void (*gemm_cm)(CBLAS_TRANSPOSE ta, CBLAS_TRANSPOSE tb, int m, int n, int k, double alpha,
                    const void *a, int lda, const void *b, int ldb, double beta, void *c, int ldc);
    /* row-major C (m x n, ldc) = op(A) op(B), op(A) m x k, op(B) k x n */
    void (*gemm_rm)(CBLAS_TRANSPOSE ta, CBLAS_TRANSPOSE tb, int m, int n, int k, const void *a,
                    int lda, const void *b, int ldb, void *c, int ldc);
    void (*syrk)(int n, const void *a_cm, void *c_cm); /* lower triangle of A A^T */
    /* row-major C (n x n) = alpha op(A) op(A)^T + beta C on C's upper triangle (the
     * column-major lower one, which mirror_lower copies across); op(A) n x k */
    void (*syrk_rm)(CBLAS_TRANSPOSE ta, int n, int k, double alpha, const void *a, int lda,
                    double beta, void *c);
    double (*dot)(int n, const void *x, int incx, const void *y, int incy);
    void (*scal)(int count, double alpha, void *x);
    double (*get)(const void *v, size_t i);
    void (*set)(void *v, size_t i, double x);
    int (*finite)(size_t count, const void *v);
    /* dst[i*n + j] = src_cm[i + jj*n], jj = n-1-j if reverse else j */
    void (*transpose)(int n, const void *src_cm, void *dst, int reverse);
    void (*mirror_lower)(int n, void *a_cm);
    void (*shift_diag)(int n, void *a, double c);
    double (*dist_identity_inf)(int n, const void *a); /* ||A - I||_inf */
    void (*symmetrize)(int n, void *a);
} kern;

/* The float32 dot accumulates in double (dsdot) so the ordering of SOAP's e is not decided by
 * float32 cancellation. */
#define AST__LINALG_TYPED(T, P, DOT, MAXV, EPSM)                                                       \
    static lapack_int P##_syevd(lapack_int n, void *a, void *w, void *work, lapack_int lwork,     \
                                lapack_int *iwork, lapack_int liwork)                             \
    {                                                                                             \
        return LAPACKE_##P##syevd_work(LAPACK_COL_MAJOR, 'V', 'L', n, a, n, w, work, lwork,      \
                                       iwork, liwork);                                            \
    }                                                                                             \
    static lapack_int P##_geqrf(lapack_int n, lapack_int m, void *a, void *tau, void *work,       \
                                lapack_int lwork)                                                 \
    {                                                                                             \
        return LAPACKE_##P##geqrf_work(LAPACK_COL_MAJOR, n, m, a, n, tau, work, lwork);          \
    }                                                                                             \
    static lapack_int P##_orgqr(lapack_int n, lapack_int m, void *a, const void *tau,             \
                                void *work, lapack_int lwork)                                     \
    {                                                                                             \
        return LAPACKE_##P##orgqr_work(LAPACK_COL_MAJOR, n, m, m, a, n, tau, work, lwork);       \
    }                                                                                             \
    static double P##_lange(char norm, int n, const void *a)                                      \
    {                                                                                             \
        return LAPACKE_##P##lange_work(LAPACK_COL_MAJOR, norm, n, n, a, n, NULL);                \
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
        /* x - x is 0 for a finite x and NaN for NaN / +-inf; a chunk's sum of them has no      \
         * branch per element (the early exit is per chunk) and cannot overflow */               \
        const T *x = v;                                                                           \
        for (size_t i0 = 0; i0 < count; i0 += FINITE_CHUNK) {                                     \
            const size_t end = count - i0 < FINITE_CHUNK ? count : i0 + FINITE_CHUNK;            \
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
        /* in tiles, as the transpose: a column-at-a-time copy misses the cache on every write  \
         * once a row is larger than a few cache lines */                                       \
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
    static const kern P##_kern = {                                                                \
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

static const kern *kern_for(ast_dtype dt)
{
    switch (dt) {
    case AST_F32:
        return &s_kern;
    case AST_F64:
        return &d_kern;
    }
    return NULL;
}

/* ---- workspace ------------------------------------------------------------------------------- */

static size_t ws_round(size_t x) { return (x + WS_ALIGN - 1) & ~(size_t)(WS_ALIGN - 1); }

/* One allocation for all of a call's buffers, each WS_ALIGN-aligned. Returns the block to free,
 * or NULL (out of memory). */
static void *ws_alloc(int count, const size_t *sizes, void **out)
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
static lapack_int ws_lwork(const kern *K, const void *query, lapack_int minimum)
{
    double q = ceil(K->get(query, 0));
    if (!(q < (double)INT32_MAX))
        return INT32_MAX;
    return (lapack_int)q > minimum ? (lapack_int)q : minimum;
}

/* ---- kernels ----------------------------------------------------------------------------------
 * Each writes its outputs only after every check has passed. Inputs are known finite. */

typedef struct op_args {
    int n;
    int n1;            /* soap_rotate: columns of X; gram_ema: columns of G */
    const void *in0;   /* A or F; X (soap_rotate); G (gram_ema) */
    const void *in1;   /* Q (refreshes); A pair (soap_rotate, may be NULL) */
    const void *in2;   /* B pair (soap_rotate, may be NULL) */
    void *mat;         /* q (eigh), x (roots), q_new (refreshes); L (gram_ema); may be NULL for
                        * eigh and gram_ema */
    void *mat1;        /* R (gram_ema, may be NULL) */
    void *vec;         /* w (eigh) */
    int64_t *perm;     /* SOAP */
    double p, eps, tol; /* gram_ema: p = beta, eps = alpha */
    int ip, max_iter;
} op_args;

/* Eigendecomposition of the symmetric a into z_cm (eigenvectors as columns) and w, ascending. */
static int eig_core(const kern *K, int n, const void *a, void *z_cm, void *w)
{
    const size_t nn = (size_t)n * n;
    double wq = 0;
    lapack_int iq = 0;

    memcpy(z_cm, a, nn * K->es);
    if (K->syevd(n, z_cm, w, &wq, -1, &iq, -1) != 0)
        return AST_EINVAL;
    lapack_int lwork = ws_lwork(K, &wq, 1 + 6 * n + 2 * n * n);
    lapack_int liwork = iq > 3 + 5 * n ? iq : 3 + 5 * n;
    size_t sz[2] = {(size_t)lwork * K->es, (size_t)liwork * sizeof(lapack_int)};
    void *buf[2];
    void *base = ws_alloc(2, sz, buf);
    if (!base)
        return AST_ENOMEM;
    lapack_int info = K->syevd(n, z_cm, w, buf[0], lwork, buf[1], liwork);
    free(base);
    if (info > 0)
        return AST_ENOCONV;
    if (info < 0)
        return AST_EINVAL;
    if (!K->finite((size_t)n, w) || !K->finite(nn, z_cm))
        return AST_ENONFINITE;
    return 0;
}

static int eigh_vectors(const kern *K, int n, const void *z_cm, const void *w, void *out);

static int k_eigh(const kern *K, const op_args *o)
{
    const int n = o->n;
    const size_t es = K->es;
    size_t sz[2] = {(size_t)n * n * es, (size_t)n * es};
    void *buf[2];
    void *base = ws_alloc(2, sz, buf);
    if (!base)
        return AST_ENOMEM;
    int rc = eig_core(K, n, o->in0, buf[0], buf[1]);
    /* LAPACK returns ascending order; the contract is descending. */
    if (rc == 0 && o->mat)
        rc = eigh_vectors(K, n, buf[0], buf[1], o->mat);
    if (rc == 0 && o->vec)
        for (int j = 0; j < n; j++)
            memcpy((char *)o->vec + (size_t)j * es, (char *)buf[1] + (size_t)(n - 1 - j) * es,
                   es);
    free(base);
    return rc;
}

/* X = Q D Q^T with D = diag((max(l, n eps_m l_max) + eps)^(-1/p)), formed as B B^T with
 * B = Q D^(1/2): syrk does half the flops of a gemm and yields an exactly symmetric X.
 * Eigenvalues below n eps_m l_max (eps_m the type's machine epsilon) are rounding noise of the
 * decomposition, and LAPACKs disagree on them; raising them all to that floor gives the null
 * space of a rank-deficient factor one root value, so X there is that value times the
 * projector on the null space, which is unique whatever eigenvectors were picked. */
static int k_inv_root(const kern *K, const op_args *o)
{
    const int n = o->n;
    const size_t es = K->es, nn = (size_t)n * n;
    size_t sz[3] = {nn * es, (size_t)n * es, nn * es};
    void *buf[3];
    void *base = ws_alloc(3, sz, buf);
    if (!base)
        return AST_ENOMEM;
    char *z = buf[0];
    int rc = eig_core(K, n, o->in0, z, buf[1]);
    double lmax = 0.0;
    for (int j = 0; rc == 0 && j < n; j++)
        lmax = fmax(lmax, K->get(buf[1], (size_t)j));
    const double floor = (double)n * K->epsm * lmax;
    for (int j = 0; rc == 0 && j < n; j++) {
        double l = fmax(K->get(buf[1], (size_t)j), floor) + o->eps;
        double d = pow(l, -0.5 / o->p);
        if (l == 0 || !(d <= K->maxval))
            rc = AST_ENONFINITE;
        else
            K->scal(n, d, z + (size_t)j * n * es);
    }
    if (rc == 0) {
        K->syrk(n, z, buf[2]);
        K->mirror_lower(n, buf[2]);
        if (!K->finite(nn, buf[2]))
            rc = AST_ENONFINITE;
        else
            memcpy(o->mat, buf[2], nn * es); /* symmetric: column- and row-major agree */
    }
    free(base);
    return rc;
}

/* buf[0] <- buf[0]^p by repeated squaring, buf[1] and buf[2] scratch. The three pointers are
 * permuted so that buf[0] holds the power on return and the other two are free. */
static void mat_pow(const kern *K, int n, int p, void *buf[3])
{
    void *b = buf[0], *r = NULL, *f1 = buf[1], *f2 = buf[2], *t;
    for (;;) {
        if (p & 1) {
            if (!r && p == 1) {
                r = b;
                break;
            }
            if (!r) {
                memcpy(f1, b, (size_t)n * n * K->es);
                r = f1;
                f1 = f2;
                f2 = NULL;
            } else {
                K->gemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, n, r, b, f1);
                t = r, r = f1, f1 = t;
            }
        }
        p >>= 1;
        if (!p)
            break;
        K->gemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, n, b, b, f1);
        t = b, b = f1, f1 = t;
    }
    buf[0] = r;
    if (r == b) {
        buf[1] = f1;
        buf[2] = f2;
    } else {
        buf[1] = b;
        buf[2] = f1;
    }
}

/*
 * Coupled Newton iteration for (A + eps I)^(-1/p), the inverse Newton iteration in its coupled
 * form (Guo & Higham, SIAM J. Matrix Anal. Appl. 28, 2006), as Distributed Shampoo uses it:
 *     X_0 = z^(1/p) I,  M_0 = z (A + eps I)
 *     T_k = ((p+1) I - M_k) / p,  X_{k+1} = X_k T_k,  M_{k+1} = T_k^p M_k
 * M_k -> I and X_k -> (A + eps I)^(-1/p). All iterates are polynomials in A, so it acts on each
 * eigenvalue by the scalar map x -> x ((p+1-x)/p)^p, which sends (0, p+1) into (0, 1] and then
 * increases monotonically to its fixed point 1: any z with z lambda_max < p+1 converges for SPD
 * input. z = (p+1) / (2 lambda_max) keeps the spectrum a factor 2 inside that interval, and
 * lambda_max is replaced by min(||A||_F, ||A||_1), rigorous upper bounds for symmetric A,
 * rather than a power-iteration estimate that could fall short of it. The coupled form is
 * numerically stable (Iannazzo 2006), the uncoupled Newton iteration is not. Indefinite input
 * is outside the domain and ends in AST_ENOCONV or AST_ENONFINITE; the eigen path
 * (ast_linalg_inv_root) clamps instead.
 */
static int k_newton(const kern *K, const op_args *o)
{
    const int n = o->n, p = o->ip;
    const size_t es = K->es, nn = (size_t)n * n;
    size_t sz[5] = {nn * es, nn * es, nn * es, nn * es, nn * es};
    void *buf[5];
    void *base = ws_alloc(5, sz, buf);
    if (!base)
        return AST_ENOMEM;
    void *m = buf[0], *x = buf[1], *s[3] = {buf[2], buf[3], buf[4]}, *t;
    int rc;

    memcpy(m, o->in0, nn * es);
    K->shift_diag(n, m, o->eps);
    double bound = fmin(K->lange('F', n, m), K->lange('1', n, m));
    double z = (p + 1.0) / (2 * bound), x0 = pow(z, 1.0 / p);
    if (!(bound > 0) || !(bound <= K->maxval) || !(x0 <= K->maxval) || !(z <= K->maxval)) {
        rc = AST_ENONFINITE; /* singular (A + eps I == 0) or a norm beyond the type's range */
        goto out;
    }
    K->scal((int)nn, z, m);
    memset(x, 0, nn * es);
    K->shift_diag(n, x, x0);

    double err = K->dist_identity_inf(n, m), best = err;
    int stall = 0;
    for (int it = 0;; it++) {
        if (!isfinite(err)) {
            rc = AST_ENONFINITE;
            goto out;
        }
        if (err < o->tol)
            break;
        if (it == o->max_iter || (best < 1 && (err > 2 * best || stall >= NEWTON_STALL))) {
            rc = AST_ENOCONV;
            goto out;
        }
        memcpy(s[0], m, nn * es);
        K->scal((int)nn, -1.0 / p, s[0]);
        K->shift_diag(n, s[0], (p + 1.0) / p);
        K->gemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, n, x, s[0], s[1]);
        t = x, x = s[1], s[1] = t;
        mat_pow(K, n, p, s);
        K->gemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, n, s[0], m, s[1]);
        t = m, m = s[1], s[1] = t;
        err = K->dist_identity_inf(n, m);
        if (err < best) {
            best = err;
            stall = 0;
        } else {
            stall++;
        }
    }
    /* X is a polynomial in A, symmetric in exact arithmetic; rounding in the products is not. */
    K->symmetrize(n, x);
    if (!K->finite(nn, x)) {
        rc = AST_ENONFINITE;
        goto out;
    }
    memcpy(o->mat, x, nn * es);
    rc = 0;
out:
    free(base);
    return rc;
}

/* c_cm = F Q in column-major. The row-major buffers read as column-major are F^T and Q^T, so
 * transposing both operands yields F Q. */
static int fq_product(const kern *K, int n, const void *f, const void *q, void *c_cm)
{
    K->gemm(CblasColMajor, CblasTrans, CblasTrans, n, f, q, c_cm);
    return K->finite((size_t)n * n, c_cm) ? 0 : AST_ENONFINITE;
}

/* Householder QR of the n x m column-major a (m <= n; geqrf + orgqr, torch.linalg.qr's
 * convention): a is replaced by Q's m columns; rdiag (may be NULL) receives R's diagonal. */
static int qr_cols(const kern *K, int n, int m, void *a, double *rdiag)
{
    double q1 = 0, q2 = 0;
    if (K->geqrf(n, m, a, NULL, &q1, -1) != 0 || K->orgqr(n, m, a, NULL, &q2, -1) != 0)
        return AST_EINVAL;
    lapack_int l1 = ws_lwork(K, &q1, m), l2 = ws_lwork(K, &q2, m);
    lapack_int lwork = l1 > l2 ? l1 : l2;
    size_t sz[2] = {(size_t)m * K->es, (size_t)lwork * K->es};
    void *buf[2];
    void *base = ws_alloc(2, sz, buf);
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

/* ---- canonical bases of null spaces -----------------------------------------------------------
 * A rank-deficient factor's null space gets a basis that depends on the factor's range and on
 * the caller's candidate vectors only, not on the rounding noise LAPACK turned into unit vectors
 * there. python/asteria/refresh/basis.py states the rule and is its torch side; the two must
 * agree to rounding (tests/python/test_soap_basis.py). A full-rank factor never gets here. */

/* n eps_m scale: what is rounding noise next to scale in a factor of size n (the floor of
 * k_inv_root; eigh's null space). */
static double null_tol(const kern *K, int n, double scale) { return (double)n * K->epsm * scale; }

/* A refresh's dependent columns: the residual of a truly dependent column of F Q carries the
 * rounding of F's accumulation (its EMA over steps) as well as the QR's own, measured at up to
 * 42 eps_m max|R| for n = 24 in float64, so the QR's threshold is this many times null_tol. */
#define QR_TOL_SAFETY 8.0

/* y (n x m) -= U (U^T y), twice (orthogonal to rounding); U n x r; both column-major with
 * leading dimension n; ws holds r x m. */
static void project_off(const kern *K, int n, int r, const void *u, int m, void *y, void *ws)
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
static int complete(const kern *K, int n, int r, void *basis, const void *cand, int c)
{
    const int need = n - r;
    const size_t es = K->es;
    if (need == 0)
        return 0;
    const double delta = 0.5 / sqrt((double)n);
    char *b = basis, *dst = b + (size_t)r * n * es;
    size_t sz[2] = {(size_t)n * n * es, (size_t)n * sizeof(double)};
    void *buf[2];
    void *base = ws_alloc(2, sz, buf);
    if (!base)
        return AST_ENOMEM;
    double *rd = buf[1];
    int rc = 0, fast = 0;
    if (c == need) {
        memcpy(dst, cand, (size_t)n * need * es);
        project_off(K, n, r, b, need, dst, buf[0]);
        rc = qr_cols(K, n, need, dst, rd);
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

/* The eigenvectors z_cm (columns in ascending order of w) into the row-major out in descending
 * order, the null space (|w| <= n eps_m max |w|) given the identity's columns at its positions as
 * candidates. */
static int eigh_vectors(const kern *K, int n, const void *z_cm, const void *w, void *out)
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
    void *base = ws_alloc(3, sz, buf);
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

typedef struct ranked {
    double e;
    int64_t i;
} ranked;

/* Descending e; the index breaks ties, which makes qsort's order that of a stable sort. */
static int ranked_cmp(const void *pa, const void *pb)
{
    const ranked *a = pa, *b = pb;
    if (a->e != b->e)
        return a->e > b->e ? -1 : 1;
    return (a->i > b->i) - (a->i < b->i);
}

/* The QR refresh where C = F Q[:, s] (c_cm holds F Q, columns unsorted; s = r[j].i) has
 * dependent columns (R's diagonal rd at most tol): the QR of the independent columns alone (any
 * found dependent there too is added to them, until none is) at their positions, the completion
 * from the previous basis's columns (q, row-major) at the dependent ones. Writes Q_new row-major
 * to out. */
static int qr_canonical(const kern *K, int n, const char *c_cm, const ranked *r, const void *q,
                          const double *rd, double tol, void *out)
{
    const size_t es = K->es, nn = (size_t)n * n, col = (size_t)n * es;
    size_t sz[5] = {nn * es, nn * es, nn * es, (size_t)n * sizeof(int), (size_t)n * sizeof(double)};
    void *buf[5];
    void *base = ws_alloc(5, sz, buf);
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
        if (m == 0 || (rc = qr_cols(K, n, m, a, rd2)) != 0)
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
static int complete_trailing(const kern *K, int n, int m, void *g_cm, const ranked *r, const void *q)
{
    const int d = n - m;
    const size_t es = K->es, col = (size_t)n * es;
    size_t sz[4] = {(size_t)d * col, (size_t)d * d * es, (size_t)d * col, (size_t)d * sizeof(double)};
    void *buf[4];
    void *base = ws_alloc(4, sz, buf);
    if (!base)
        return AST_ENOMEM;
    char *cand = buf[0], *w = (char *)g_cm + (size_t)m * col, *mm = buf[1];
    double *rd = buf[3];
    for (int j = 0; j < d; j++)
        for (int i = 0; i < n; i++)
            K->set(cand, (size_t)j * n + i, K->get(q, (size_t)i * n + (size_t)r[m + j].i));
    K->gemm_cm(CblasTrans, CblasNoTrans, d, d, n, 1.0, w, n, cand, n, 0.0, mm, d);
    int rc = qr_cols(K, d, d, mm, rd);
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

/* Q_new of a QR refresh into the row-major out: the QR of g_cm = C = (F Q)[:, s] (overwritten),
 * canonical where C has dependent columns (qr_canonical: c_cm = F Q, s = r[j].i, q the previous
 * basis); rd: n doubles of workspace. */
static int qr_refresh_q(const kern *K, int n, const char *c_cm, void *g_cm, const ranked *r,
                        const void *q, double *rd, void *out)
{
    int rc = qr_cols(K, n, n, g_cm, rd);
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

/* F Q[:, s] = (F Q)[:, s]: permuting the product's columns equals the product with permuted
 * columns, and in column-major each column moves as one memcpy. */
static int k_soap(const kern *K, const op_args *o)
{
    const int n = o->n;
    const size_t es = K->es, nn = (size_t)n * n;
    size_t sz[4] = {nn * es, nn * es, (size_t)n * sizeof(ranked), (size_t)n * sizeof(double)};
    void *buf[4];
    void *base = ws_alloc(4, sz, buf);
    if (!base)
        return AST_ENOMEM;
    char *c = buf[0], *g = buf[1];
    ranked *r = buf[2];
    double *rd = buf[3];
    int rc = fq_product(K, n, o->in0, o->in1, c);
    for (int j = 0; rc == 0 && j < n; j++) {
        r[j].e = K->dot(n, (const char *)o->in1 + (size_t)j * es, n, c + (size_t)j * n * es, 1);
        r[j].i = j;
        if (!isfinite(r[j].e))
            rc = AST_ENONFINITE;
    }
    if (rc == 0) {
        qsort(r, (size_t)n, sizeof *r, ranked_cmp);
        for (int j = 0; j < n; j++)
            memcpy(g + (size_t)j * n * es, c + (size_t)r[j].i * n * es, (size_t)n * es);
        rc = qr_refresh_q(K, n, c, g, r, o->in1, rd, o->mat);
    }
    if (rc == 0)
        for (int j = 0; j < n; j++)
            o->perm[j] = r[j].i;
    free(base);
    return rc;
}

static int k_qr_refresh(const kern *K, const op_args *o)
{
    const int n = o->n;
    const size_t nn = (size_t)n * n;
    size_t sz[4] = {nn * K->es, nn * K->es, (size_t)n * sizeof(ranked), (size_t)n * sizeof(double)};
    void *buf[4];
    void *base = ws_alloc(4, sz, buf);
    if (!base)
        return AST_ENOMEM;
    ranked *r = buf[2];
    int rc = fq_product(K, n, o->in0, o->in1, buf[0]);
    if (rc == 0) {
        for (int j = 0; j < n; j++)
            r[j].i = j;
        memcpy(buf[1], buf[0], nn * K->es);
        rc = qr_refresh_q(K, n, buf[0], buf[1], r, o->in1, buf[3], o->mat);
    }
    free(base);
    return rc;
}

/*
 * SOAP's re-expression of m: out = A_new^T (A_old X B_old^T) B_new, X n x n1, either side
 * absent (identity). Every product is one ?gemm on row-major operands (op(.) = transposition
 * flag, no copies). Each side is applied in whichever of two orders costs fewer flops; the two
 * sides' costs add up independently (every intermediate stays n x n1), so the sides are simply
 * done left, then right:
 *   left, in sequence:  A_new^T (A_old X)       2 n^2 n1
 *   left, formed:       (A_new^T A_old) X       n^3 + n^2 n1   (cheaper iff n < n1)
 *   right, in sequence: (X B_old^T) B_new       2 n n1^2
 *   right, formed:      X (B_old^T B_new)       n1^3 + n n1^2  (cheaper iff n1 < n)
 * So for square X both sides go in sequence; for a tall or wide X the short side's n x n
 * (n1 x n1) product is formed first. Workspace: two n x n1 intermediates and at most one
 * formed square, which is smaller than n x n1 whenever it is used.
 */
static int k_rotate(const kern *K, const op_args *o)
{
    const int n = o->n, n1 = o->n1;
    const size_t es = K->es, nx = (size_t)n * n1;
    const int form_a = o->in1 && n < n1, form_b = o->in2 && n1 < n;
    const size_t sq = form_a ? (size_t)n * n : form_b ? (size_t)n1 * n1 : 0;
    size_t sz[3] = {nx * es, nx * es, sq * es};
    void *buf[3];
    void *base = ws_alloc(3, sz, buf);
    if (!base)
        return AST_ENOMEM;
    void *const sqm = buf[2];
    const void *cur = o->in0; /* the product so far; buf[k] is the next free intermediate */
    int k = 0;
    if (o->in1) {
        const char *a_old = o->in1, *a_new = a_old + (size_t)n * n * es;
        if (form_a) {
            K->gemm_rm(CblasTrans, CblasNoTrans, n, n, n, a_new, n, a_old, n, sqm, n);
        } else {
            K->gemm_rm(CblasNoTrans, CblasNoTrans, n, n1, n, a_old, n, cur, n1, buf[k], n1);
            cur = buf[k];
            k ^= 1;
        }
        K->gemm_rm(form_a ? CblasNoTrans : CblasTrans, CblasNoTrans, n, n1, n,
                   form_a ? sqm : (const void *)a_new, n, cur, n1, buf[k], n1);
        cur = buf[k];
        k ^= 1;
    }
    if (o->in2) {
        const char *b_old = o->in2, *b_new = b_old + (size_t)n1 * n1 * es;
        if (form_b) {
            K->gemm_rm(CblasTrans, CblasNoTrans, n1, n1, n1, b_old, n1, b_new, n1, sqm, n1);
        } else {
            K->gemm_rm(CblasNoTrans, CblasTrans, n, n1, n1, cur, n1, b_old, n1, buf[k], n1);
            cur = buf[k];
            k ^= 1;
        }
        K->gemm_rm(CblasNoTrans, CblasNoTrans, n, n1, n1, cur, n1,
                   form_b ? sqm : (const void *)b_new, n1, buf[k], n1);
        cur = buf[k];
    }
    /* validate() guarantees a side, so cur is a workspace buffer here. */
    int rc = K->finite(nx, cur) ? 0 : AST_ENONFINITE;
    if (rc == 0)
        memcpy(o->mat, cur, nx * es);
    free(base);
    return rc;
}

/*
 * SOAP's factor EMAs, in place: L = p L + eps G G^T, R = p R + eps G^T G with G n x n1. Each is
 * one ?syrk on the row-major G as it lies (G G^T: no transposition, G^T G: the transposed
 * product, both with leading dimension n1) into the upper triangle of the factor itself, which
 * is then mirrored: exactly symmetric, half the flops of a ?gemm, no workspace. Inputs are
 * known finite (run() checked every block's G first), so nothing here can fail.
 */
static int k_gram_ema(const kern *K, const op_args *o)
{
    const int n = o->n, n1 = o->n1;
    if (o->mat) {
        K->syrk_rm(CblasNoTrans, n, n1, o->eps, o->in0, n1, o->p, o->mat);
        K->mirror_lower(n, o->mat);
    }
    if (o->mat1) {
        K->syrk_rm(CblasTrans, n1, n, o->eps, o->in0, n1, o->p, o->mat1);
        K->mirror_lower(n1, o->mat1);
    }
    return 0;
}

/* ---- the REFRESH op table (op_table.h) -------------------------------------------------------
 * One entry per ast_op: its name, what ast_runtime_submit accepts, how a pool worker runs it
 * (through the public batched call) and the kernel that computes one block. */

/* The coupled-Newton limits of a pool job (python/asteria/refresh/ops.py mirrors them). */
#define NEWTON_MAX_ITER 100
#define NEWTON_TOL 1e-6

/* *out = a * b * c * d; 0 if the product fits a size_t, else -1. */
static int bytes_of(size_t *out, size_t a, size_t b, size_t c, size_t d)
{
    const size_t f[4] = {a, b, c, d};
    size_t p = 1;
    for (int i = 0; i < 4; i++) {
        if (f[i] && p > SIZE_MAX / f[i])
            return -1;
        p *= f[i];
    }
    *out = p;
    return 0;
}

static int overlaps(const void *a, size_t alen, const void *b, size_t blen)
{
    uintptr_t x = (uintptr_t)a, y = (uintptr_t)b;
    return x < y + blen && y < x + alen;
}

/* Elements of one batch entry of a buffer of shape (ast_shape) for sizes n, n1. */
static size_t shape_elems(int shape, size_t n, size_t n1)
{
    switch (shape) {
    case AST_SHAPE_NN:
        return n * n;
    case AST_SHAPE_N:
    case AST_SHAPE_PERM:
        return n;
    case AST_SHAPE_NN1:
        return n * n1;
    case AST_SHAPE_N1N1:
        return n1 * n1;
    case AST_SHAPE_PAIR_NN:
        return 2 * n * n;
    case AST_SHAPE_PAIR_N1N1:
        return 2 * n1 * n1;
    default:
        return 0;
    }
}

/* Sets bytes[i] to the span of each pointer op takes, from its shape, for r's batch, n, n1 and
 * dtype (0 for the others). Returns -1 if a span overflows a size_t. */
static int op_spans(const ast__op *op, const ast_refresh *r, size_t bytes[AST__ARG_COUNT])
{
    const size_t batch = (size_t)r->batch, n = (size_t)r->n;
    const size_t n1 = r->n1 > 0 ? (size_t)r->n1 : 0;
    for (int i = 0; i < AST__ARG_COUNT; i++) {
        const int sh = op->shape[i];
        const size_t es = sh == AST_SHAPE_PERM ? sizeof(int64_t) : ast_dtype_size(r->dtype);
        /* the factors of each span, so bytes_of can see an overflow of the product */
        size_t a = 1, b = 1;
        switch (sh) {
        case AST_SHAPE_NONE:
            bytes[i] = 0;
            continue;
        case AST_SHAPE_NN:
            a = n, b = n;
            break;
        case AST_SHAPE_N:
        case AST_SHAPE_PERM:
            a = n;
            break;
        case AST_SHAPE_NN1:
            a = n, b = n1;
            break;
        case AST_SHAPE_N1N1:
            a = n1, b = n1;
            break;
        case AST_SHAPE_PAIR_NN:
            a = 2 * n, b = n;
            break;
        case AST_SHAPE_PAIR_N1N1:
            a = 2 * n1, b = n1;
            break;
        }
        if (bytes_of(&bytes[i], batch, a, b, es))
            return -1;
    }
    return 0;
}

static int check_root(const ast_refresh *r, size_t bytes[AST__ARG_COUNT], char *msg, size_t len)
{
    (void)bytes;
    if (!(r->p > 0))
        return ast__errorf(msg, len, AST_EINVAL, "root p=%g; allowed: p > 0", r->p);
    return 0;
}

static int check_newton(const ast_refresh *r, size_t bytes[AST__ARG_COUNT], char *msg,
                        size_t len)
{
    int rc = check_root(r, bytes, msg, len);
    if (rc == 0 && r->p != (double)(int)r->p)
        return ast__errorf(msg, len, AST_EINVAL, "newton_root needs an integer p, got %g", r->p);
    return rc;
}

static int check_rotate(const ast_refresh *r, size_t bytes[AST__ARG_COUNT], char *msg,
                        size_t len)
{
    (void)bytes;
    if (r->n1 <= 0)
        return ast__errorf(msg, len, AST_EINVAL,
                           "soap_rotate n1=%d; allowed: n1 >= 1 (X is n x n1)", r->n1);
    if (!r->in1 && !r->in2)
        return ast__errorf(msg, len, AST_EINVAL,
                           "soap_rotate got neither in1 (A pair) nor in2 (B pair); allowed: "
                           "either or both (a NULL pair is the identity side)");
    return 0;
}

/* L and R are written in place from G: a byte shared with G or with each other would be read
 * after it was written, so they must lie apart. */
static int check_gram_ema(const ast_refresh *r, size_t bytes[AST__ARG_COUNT], char *msg,
                          size_t len)
{
    if (r->n1 <= 0)
        return ast__errorf(msg, len, AST_EINVAL,
                           "gram_ema n1=%d; allowed: n1 >= 1 (G is n x n1)", r->n1);
    if (!r->out0 && !r->out1)
        return ast__errorf(msg, len, AST_EINVAL,
                           "gram_ema got neither out0 (L) nor out1 (R); allowed: either or both");
    const double maxval = kern_for(r->dtype)->maxval;
    if (!(fabs(r->p) <= maxval) || !(fabs(r->eps) <= maxval))
        return ast__errorf(msg, len, AST_EINVAL,
                           "gram_ema p=%g eps=%g; allowed: finite values in the dtype's range "
                           "(p = beta, eps = alpha)",
                           r->p, r->eps);
    const size_t g = bytes[AST__ARG_IN0], lb = bytes[AST__ARG_OUT0], rb = bytes[AST__ARG_OUT1];
    const char *clash = NULL;
    if (r->out0 && r->in0 && overlaps(r->out0, lb, r->in0, g))
        clash = "out0 (L) overlaps in0 (G)";
    else if (r->out1 && r->in0 && overlaps(r->out1, rb, r->in0, g))
        clash = "out1 (R) overlaps in0 (G)";
    else if (r->out0 && r->out1 && overlaps(r->out0, lb, r->out1, rb))
        clash = "out0 (L) overlaps out1 (R)";
    if (clash)
        return ast__errorf(msg, len, AST_EINVAL,
                           "gram_ema %s; allowed: L, R and G in separate memory (L and R are "
                           "updated in place)",
                           clash);
    return 0;
}

static int run_eigh(const ast_refresh *r, int *failed_index)
{
    return ast_linalg_eigh_batched(r->dtype, r->batch, r->n, r->in0, r->out1, r->out0,
                                   failed_index);
}

static int run_inv_root(const ast_refresh *r, int *failed_index)
{
    return ast_linalg_inv_root_batched(r->dtype, r->batch, r->n, r->in0, r->p, r->eps, r->out0,
                                       failed_index);
}

/* The Newton root has no batched entry point: one call per block. */
static int run_newton(const ast_refresh *r, int *failed_index)
{
    const size_t stride = (size_t)r->n * (size_t)r->n * ast_dtype_size(r->dtype);
    int rc = 0;
    *failed_index = -1;
    for (int b = 0; b < r->batch && !rc; b++) {
        rc = ast_linalg_newton_inv_root(r->dtype, r->n, (const char *)r->in0 + b * stride,
                                        (int)r->p, r->eps, NEWTON_MAX_ITER, NEWTON_TOL,
                                        (char *)r->out0 + b * stride);
        if (rc)
            *failed_index = b;
    }
    return rc;
}

static int run_soap_qr(const ast_refresh *r, int *failed_index)
{
    return ast_linalg_soap_refresh_batched(r->dtype, r->batch, r->n, r->in0, r->in1, r->out0,
                                           (int64_t *)r->out1, failed_index);
}

static int run_kl_qr(const ast_refresh *r, int *failed_index)
{
    return ast_linalg_qr_refresh_batched(r->dtype, r->batch, r->n, r->in0, r->in1, r->out0,
                                         failed_index);
}

static int run_rotate(const ast_refresh *r, int *failed_index)
{
    return ast_linalg_soap_rotate_batched(r->dtype, r->batch, r->n, r->n1, r->in0, r->in1,
                                          r->in2, r->out0, failed_index);
}

static int run_gram_ema(const ast_refresh *r, int *failed_index)
{
    return ast_linalg_gram_ema_batched(r->dtype, r->batch, r->n, r->n1, r->in0, r->p, r->eps,
                                       r->out0, r->out1, failed_index);
}

typedef int (*kernel_fn)(const kern *K, const op_args *o);
/* The direct API's (ast_linalg_*) checks of its own arguments of one op, after run()'s common
 * ones. Returns 0 or AST_EINVAL. */
typedef int (*validate_fn)(const op_args *o, int batch, const kern *K);

typedef struct op_entry {
    ast__op op;           /* what runtime.c reads */
    kernel_fn kernel;     /* one block, for run() and the float64 retry */
    validate_fn validate; /* the direct API's argument checks */
} op_entry;

static int validate_eigh(const op_args *o, int batch, const kern *K);
static int validate_inv_root(const op_args *o, int batch, const kern *K);
static int validate_newton(const op_args *o, int batch, const kern *K);
static int validate_soap_qr(const op_args *o, int batch, const kern *K);
static int validate_kl_qr(const op_args *o, int batch, const kern *K);
static int validate_rotate(const op_args *o, int batch, const kern *K);
static int validate_gram_ema(const op_args *o, int batch, const kern *K);

enum { NONE = AST__ARG_NONE, OPT = AST__ARG_OPTIONAL, REQ = AST__ARG_REQUIRED };
enum {
    S_NN = AST_SHAPE_NN,
    S_N = AST_SHAPE_N,
    S_PERM = AST_SHAPE_PERM,
    S_NN1 = AST_SHAPE_NN1,
    S_N1N1 = AST_SHAPE_N1N1,
    S_PAIR_NN = AST_SHAPE_PAIR_NN,
    S_PAIR_N1N1 = AST_SHAPE_PAIR_N1N1
};

/* args and shape: in0, in1, in2, out0, out1; then takes_basis, in_place. The eigen ops have
 * always accepted an in1 of the factor's size (range-checked, not read); it stays accepted so no
 * caller breaks. */
static const op_entry op_table[] = {
    [AST_OP_EIGH] = {{"eigh", {REQ, OPT, NONE, REQ, OPT}, {S_NN, S_NN, 0, S_NN, S_N}, 0, 0, NULL,
                      run_eigh},
                     k_eigh, validate_eigh},
    [AST_OP_INV_ROOT] = {{"inv_root", {REQ, OPT, NONE, REQ, NONE}, {S_NN, S_NN, 0, S_NN, 0}, 0,
                          0, check_root, run_inv_root},
                         k_inv_root, validate_inv_root},
    [AST_OP_NEWTON_ROOT] = {{"newton_root", {REQ, OPT, NONE, REQ, NONE},
                             {S_NN, S_NN, 0, S_NN, 0}, 0, 0, check_newton, run_newton},
                            k_newton, validate_newton},
    [AST_OP_SOAP_QR] = {{"soap_qr", {REQ, REQ, NONE, REQ, REQ}, {S_NN, S_NN, 0, S_NN, S_PERM},
                         1, 0, NULL, run_soap_qr},
                        k_soap, validate_soap_qr},
    [AST_OP_KL_QR] = {{"kl_qr", {REQ, REQ, NONE, REQ, NONE}, {S_NN, S_NN, 0, S_NN, 0}, 1, 0,
                       NULL, run_kl_qr},
                      k_qr_refresh, validate_kl_qr},
    [AST_OP_SOAP_ROTATE] = {{"soap_rotate", {REQ, OPT, OPT, REQ, NONE},
                             {S_NN1, S_PAIR_NN, S_PAIR_N1N1, S_NN1, 0}, 0, 0, check_rotate,
                             run_rotate},
                            k_rotate, validate_rotate},
    [AST_OP_GRAM_EMA] = {{"gram_ema", {REQ, NONE, NONE, OPT, OPT}, {S_NN1, 0, 0, S_NN, S_N1N1},
                          0, 1, check_gram_ema, run_gram_ema},
                         k_gram_ema, validate_gram_ema},
};
/* Codes run from 1; slot 0 is no op. */
#define OP_SLOTS ((int)(sizeof op_table / sizeof op_table[0]))

const ast__op *ast__op_get(int op)
{
    return op >= 1 && op < OP_SLOTS && op_table[op].op.name ? &op_table[op].op : NULL;
}

int ast__op_list(char *buf, size_t len, int arg)
{
    size_t used = 0;
    int listed = 0;
    if (len)
        buf[0] = '\0';
    for (int c = 1; c < OP_SLOTS; c++) {
        const ast__op *op = ast__op_get(c);
        if (!op || (arg >= 0 && op->args[arg] == AST__ARG_NONE))
            continue;
        if (used < len) {
            int w = snprintf(buf + used, len - used, "%s%s (%d)", listed ? ", " : "", op->name,
                             c);
            used = w < 0 ? len : used + (size_t)w;
        }
        listed++;
    }
    return listed;
}

int ast__op_check(const ast_refresh *req, const ast__op **op, size_t bytes[AST__ARG_COUNT],
                  char *msg, size_t len)
{
    *op = NULL;
    for (int i = 0; i < AST__ARG_COUNT; i++)
        bytes[i] = 0;
    const size_t es = ast_dtype_size(req->dtype);
    if (!es)
        return ast__errorf(msg, len, AST_EINVAL, "dtype %d; allowed: float32 (0), float64 (1)",
                           (int)req->dtype);
    if (req->n <= 0 || req->batch <= 0)
        return ast__errorf(msg, len, AST_EINVAL, "n=%d batch=%d; allowed: both >= 1", req->n,
                           req->batch);
    /* Every op's spans are built from these three; the checks below may multiply freely. */
    const size_t batch = (size_t)req->batch, n = (size_t)req->n;
    size_t mat, vec, idx;
    if (bytes_of(&mat, batch, n, n, es) || bytes_of(&vec, batch, n, 1, es) ||
        bytes_of(&idx, batch, n, 1, sizeof(int64_t)))
        return ast__errorf(msg, len, AST_EINVAL, "n=%d batch=%d; the buffer sizes overflow size_t",
                           req->n, req->batch);
    const ast__op *o = ast__op_get((int)req->op);
    if (!o) {
        char allowed[256];
        ast__op_list(allowed, sizeof allowed, -1);
        return ast__errorf(msg, len, AST_EINVAL, "op %d; allowed: %s", (int)req->op, allowed);
    }
    if (op_spans(o, req, bytes))
        return ast__errorf(msg, len, AST_EINVAL,
                           "%s n=%d n1=%d batch=%d; the buffer sizes overflow size_t", o->name,
                           req->n, req->n1, req->batch);
    int rc = o->check ? o->check(req, bytes, msg, len) : 0;
    if (rc == 0)
        *op = o;
    return rc;
}

int ast_op_info_get(int op, ast_op_info *out)
{
    const ast__op *o = ast__op_get(op);
    if (!o || !out)
        return AST_EINVAL;
    out->name = o->name;
    out->takes_basis = o->takes_basis;
    out->in_place = o->in_place;
    for (int i = 0; i < AST__ARG_COUNT; i++) {
        out->need[i] = o->args[i];
        out->shape[i] = o->shape[i];
    }
    return 0;
}

/* ---- dispatch: validation, input checks, float64 retry, batching ----------------------------- */

/* Element counts of one block's buffers (0 for a buffer the call does not have). */
typedef struct op_counts {
    size_t in0, in1, in2, mat, mat1, vec, perm;
} op_counts;

/* From the entry's shapes; out1 is whichever of mat1, vec, perm the call has. */
static op_counts counts_for(ast_op kind, const op_args *o)
{
    const unsigned char *sh = op_table[kind].op.shape;
    const size_t n = (size_t)o->n, n1 = o->n1 > 0 ? (size_t)o->n1 : 0;
    const size_t out1 = shape_elems(sh[AST__ARG_OUT1], n, n1);
    op_counts c = {shape_elems(sh[AST__ARG_IN0], n, n1),
                   o->in1 ? shape_elems(sh[AST__ARG_IN1], n, n1) : 0,
                   o->in2 ? shape_elems(sh[AST__ARG_IN2], n, n1) : 0,
                   o->mat ? shape_elems(sh[AST__ARG_OUT0], n, n1) : 0,
                   o->mat1 ? out1 : 0,
                   o->vec ? out1 : 0,
                   o->perm ? out1 : 0};
    return c;
}

/* batch * count * es fits a size_t. */
static int span_fits(int batch, size_t count, size_t es)
{
    return count <= SIZE_MAX / es / (size_t)(batch > 0 ? batch : 1);
}

/* soap_rotate: no LAPACK workspace bounds n or n1 (see the file comment), but every span must
 * be addressable; the output may not overlap any input. */
static int validate_rotate(const op_args *o, int batch, const kern *K)
{
    const size_t es = K->es;
    if (o->n1 < 1 || !o->mat || (!o->in1 && !o->in2))
        return AST_EINVAL;
    const size_t n = (size_t)o->n, n1 = (size_t)o->n1;
    if (n1 > SIZE_MAX / n || n > SIZE_MAX / 2 / n || n1 > SIZE_MAX / 2 / n1)
        return AST_EINVAL;
    op_counts c = counts_for(AST_OP_SOAP_ROTATE, o);
    if (!span_fits(batch, c.in0, es) || !span_fits(batch, c.in1, es) ||
        !span_fits(batch, c.in2, es))
        return AST_EINVAL;
    const size_t b = (size_t)batch, out = b * c.mat * es;
    if (overlaps(o->mat, out, o->in0, b * c.in0 * es) ||
        (o->in1 && overlaps(o->mat, out, o->in1, b * c.in1 * es)) ||
        (o->in2 && overlaps(o->mat, out, o->in2, b * c.in2 * es)))
        return AST_EINVAL;
    return 0;
}

/* gram_ema: as soap_rotate, no bound on n or n1 but addressable spans; L and R are updated in
 * place, so neither may overlap G or the other; beta and alpha finite in the type. */
static int validate_gram_ema(const op_args *o, int batch, const kern *K)
{
    if (o->n1 < 1 || (!o->mat && !o->mat1) || !(fabs(o->p) <= K->maxval) ||
        !(fabs(o->eps) <= K->maxval))
        return AST_EINVAL;
    const size_t n = (size_t)o->n, n1 = (size_t)o->n1, es = K->es;
    if (n1 > SIZE_MAX / n || n > SIZE_MAX / n || n1 > SIZE_MAX / n1)
        return AST_EINVAL;
    op_counts c = counts_for(AST_OP_GRAM_EMA, o);
    if (!span_fits(batch, c.in0, es) || !span_fits(batch, c.mat, es) ||
        !span_fits(batch, c.mat1, es))
        return AST_EINVAL;
    const size_t b = (size_t)batch, g = b * c.in0 * es, l = b * c.mat * es, r = b * c.mat1 * es;
    if ((o->mat && overlaps(o->mat, l, o->in0, g)) ||
        (o->mat1 && overlaps(o->mat1, r, o->in0, g)) ||
        (o->mat && o->mat1 && overlaps(o->mat, l, o->mat1, r)))
        return AST_EINVAL;
    return 0;
}

/* The square ops run LAPACK, whose 32-bit workspace sizes bound n. */
static int validate_eigh(const op_args *o, int batch, const kern *K)
{
    (void)batch, (void)K;
    return o->n <= LINALG_NMAX && (o->vec || o->mat) ? 0 : AST_EINVAL;
}

static int validate_inv_root(const op_args *o, int batch, const kern *K)
{
    (void)batch, (void)K;
    return o->n <= LINALG_NMAX && o->mat && o->p > 0 && o->p <= DBL_MAX && o->eps >= 0 &&
                   o->eps <= DBL_MAX
               ? 0
               : AST_EINVAL;
}

static int validate_newton(const op_args *o, int batch, const kern *K)
{
    (void)batch, (void)K;
    return o->n <= LINALG_NMAX && o->mat && o->ip >= 1 && o->eps >= 0 && o->eps <= DBL_MAX &&
                   o->max_iter >= 0 && o->tol > 0 && o->tol <= DBL_MAX
               ? 0
               : AST_EINVAL;
}

/* The refreshes write Q_new from F and Q: it may overlap neither. */
static int validate_kl_qr(const op_args *o, int batch, const kern *K)
{
    const size_t span = (size_t)batch * o->n * o->n * K->es;
    if (o->n > LINALG_NMAX || !o->in1 || !o->mat || overlaps(o->mat, span, o->in0, span) ||
        overlaps(o->mat, span, o->in1, span))
        return AST_EINVAL;
    return 0;
}

static int validate_soap_qr(const op_args *o, int batch, const kern *K)
{
    return o->perm ? validate_kl_qr(o, batch, K) : AST_EINVAL;
}

static int validate(ast_op kind, const op_args *o, int batch, const kern *K)
{
    if (o->n < 1 || batch < 0 || !o->in0)
        return AST_EINVAL;
    return op_table[kind].validate(o, batch, K);
}

static double *to_f64(size_t count, const void *src)
{
    double *d = malloc(count * sizeof *d);
    const float *s = src;
    if (d)
        for (size_t i = 0; i < count; i++)
            d[i] = s[i];
    return d;
}

/* A float64 success whose result overflows float32 is still a failure. */
static int fits_f32(size_t count, const double *v)
{
    for (size_t i = 0; i < count; i++)
        if (!(fabs(v[i]) <= FLT_MAX))
            return 0;
    return 1;
}

static void to_f32(size_t count, const double *src, void *dst)
{
    float *f = dst;
    for (size_t i = 0; i < count; i++)
        f[i] = (float)src[i];
}

/* One float32 block again in float64. Never for an in-place op (run_block), so it has no R
 * (mat1) to carry. */
static int retry_f64(ast_op kind, const op_args *o)
{
    const op_counts c = counts_for(kind, o);
    op_args d = *o;
    double *in0 = to_f64(c.in0, o->in0);
    double *in1 = o->in1 ? to_f64(c.in1, o->in1) : NULL;
    double *in2 = o->in2 ? to_f64(c.in2, o->in2) : NULL;
    double *mat = o->mat ? malloc(c.mat * sizeof *mat) : NULL;
    double *vec = o->vec ? malloc(c.vec * sizeof *vec) : NULL;
    int64_t *perm = o->perm ? malloc(c.perm * sizeof *perm) : NULL;
    int rc;

    if (!in0 || (o->in1 && !in1) || (o->in2 && !in2) || (o->mat && !mat) || (o->vec && !vec) ||
        (o->perm && !perm)) {
        rc = AST_ENOMEM;
        goto out;
    }
    d.in0 = in0, d.in1 = in1, d.in2 = in2, d.mat = mat, d.vec = vec, d.perm = perm;
    rc = op_table[kind].kernel(&d_kern, &d);
    if (rc != 0)
        goto out;
    /* Check everything before writing anything, so a failure leaves every output untouched. */
    if ((mat && !fits_f32(c.mat, mat)) || (vec && !fits_f32(c.vec, vec))) {
        rc = AST_ENONFINITE;
        goto out;
    }
    if (mat)
        to_f32(c.mat, mat, o->mat);
    if (vec)
        to_f32(c.vec, vec, o->vec);
    if (perm)
        memcpy(o->perm, perm, c.perm * sizeof *perm);
out:
    free(in0);
    free(in1);
    free(in2);
    free(mat);
    free(vec);
    free(perm);
    return rc;
}

static int inputs_finite(const kern *K, ast_op kind, const op_args *o)
{
    const op_counts c = counts_for(kind, o);
    return K->finite(c.in0, o->in0) && (!o->in1 || K->finite(c.in1, o->in1)) &&
           (!o->in2 || K->finite(c.in2, o->in2));
}

/* One block. An in-place op's inputs were all checked by run() already, and it has no retry. */
static int run_block(const kern *K, ast_dtype dt, ast_op kind, const op_args *o)
{
    const op_entry *e = &op_table[kind];
    if (e->op.in_place)
        return e->kernel(K, o);
    if (!inputs_finite(K, kind, o))
        return AST_ENONFINITE; /* bad input: a float64 retry could not help */
    int rc = e->kernel(K, o);
    if (dt == AST_F32 && (rc == AST_ENOCONV || rc == AST_ENONFINITE)) {
        tl_retried = 1;
        rc = retry_f64(kind, o);
    }
    return rc;
}

/* Block b of a batched call's arguments. */
static op_args block_of(const op_args *o, const op_counts *c, size_t es, int b)
{
    const size_t ub = (size_t)b;
    op_args blk = *o;
    blk.in0 = (const char *)o->in0 + ub * c->in0 * es;
    if (o->in1)
        blk.in1 = (const char *)o->in1 + ub * c->in1 * es;
    if (o->in2)
        blk.in2 = (const char *)o->in2 + ub * c->in2 * es;
    if (o->mat)
        blk.mat = (char *)o->mat + ub * c->mat * es;
    if (o->mat1)
        blk.mat1 = (char *)o->mat1 + ub * c->mat1 * es;
    if (o->vec)
        blk.vec = (char *)o->vec + ub * c->vec * es;
    if (o->perm)
        blk.perm = o->perm + ub * c->perm;
    return blk;
}

static int run(ast_dtype dt, ast_op kind, const op_args *o, int batch, int *failed_index)
{
    const kern *K = kern_for(dt);
    tl_retried = 0;
    if (failed_index)
        *failed_index = 0;
    if (!K)
        return AST_EINVAL;
    int rc = validate(kind, o, batch, K);
    if (rc != 0)
        return rc;
    ast_linalg_init();

    const op_counts c = counts_for(kind, o);
    const size_t es = K->es;
    for (int b = 0; op_table[kind].op.in_place && b < batch; b++) {
        const op_args blk = block_of(o, &c, es, b);
        if (!inputs_finite(K, kind, &blk)) {
            if (failed_index)
                *failed_index = b;
            return AST_ENONFINITE;
        }
    }
    for (int b = 0; b < batch; b++) {
        const op_args blk = block_of(o, &c, es, b);
        rc = run_block(K, dt, kind, &blk);
        if (rc != 0) {
            if (failed_index)
                *failed_index = b;
            return rc;
        }
    }
    if (failed_index)
        *failed_index = -1;
    return 0;
}

/* ---- public API ------------------------------------------------------------------------------ */

size_t ast_dtype_size(ast_dtype dt)
{
    const kern *K = kern_for(dt);
    return K ? K->es : 0;
}

const char *ast_op_name(int op)
{
    const ast__op *o = ast__op_get(op);
    return o ? o->name : NULL;
}

int ast_op_count(void) { return OP_SLOTS - 1; }

static void init_once_fn(void) { openblas_set_num_threads(1); }

void ast_linalg_init(void) { pthread_once(&init_once, init_once_fn); }

int ast_linalg_last_retried(void) { return tl_retried; }

int ast_linalg_eigh(ast_dtype dt, int n, const void *a, void *w, void *q)
{
    return ast_linalg_eigh_batched(dt, 1, n, a, w, q, NULL);
}

int ast_linalg_eigh_batched(ast_dtype dt, int batch, int n, const void *a, void *w, void *q,
                            int *failed_index)
{
    op_args o = {.n = n, .in0 = a, .mat = q, .vec = w};
    return run(dt, AST_OP_EIGH, &o, batch, failed_index);
}

int ast_linalg_inv_root(ast_dtype dt, int n, const void *a, double p, double eps, void *x)
{
    return ast_linalg_inv_root_batched(dt, 1, n, a, p, eps, x, NULL);
}

int ast_linalg_inv_root_batched(ast_dtype dt, int batch, int n, const void *a, double p,
                                double eps, void *x, int *failed_index)
{
    op_args o = {.n = n, .in0 = a, .mat = x, .p = p, .eps = eps};
    return run(dt, AST_OP_INV_ROOT, &o, batch, failed_index);
}

int ast_linalg_newton_inv_root(ast_dtype dt, int n, const void *a, int p, double eps,
                               int max_iter, double tol, void *x)
{
    op_args o = {.n = n, .in0 = a, .mat = x, .ip = p, .eps = eps, .max_iter = max_iter,
                 .tol = tol};
    return run(dt, AST_OP_NEWTON_ROOT, &o, 1, NULL);
}

int ast_linalg_soap_refresh(ast_dtype dt, int n, const void *f, const void *q, void *q_new,
                            int64_t *perm)
{
    return ast_linalg_soap_refresh_batched(dt, 1, n, f, q, q_new, perm, NULL);
}

int ast_linalg_soap_refresh_batched(ast_dtype dt, int batch, int n, const void *f, const void *q,
                                    void *q_new, int64_t *perm, int *failed_index)
{
    op_args o = {.n = n, .in0 = f, .in1 = q, .mat = q_new, .perm = perm};
    return run(dt, AST_OP_SOAP_QR, &o, batch, failed_index);
}

int ast_linalg_qr_refresh(ast_dtype dt, int n, const void *f, const void *q, void *q_new)
{
    return ast_linalg_qr_refresh_batched(dt, 1, n, f, q, q_new, NULL);
}

int ast_linalg_qr_refresh_batched(ast_dtype dt, int batch, int n, const void *f, const void *q,
                                  void *q_new, int *failed_index)
{
    op_args o = {.n = n, .in0 = f, .in1 = q, .mat = q_new};
    return run(dt, AST_OP_KL_QR, &o, batch, failed_index);
}

int ast_linalg_soap_rotate(ast_dtype dt, int n, int n1, const void *x, const void *a_pair,
                           const void *b_pair, void *out)
{
    return ast_linalg_soap_rotate_batched(dt, 1, n, n1, x, a_pair, b_pair, out, NULL);
}

int ast_linalg_soap_rotate_batched(ast_dtype dt, int batch, int n, int n1, const void *x,
                                   const void *a_pair, const void *b_pair, void *out,
                                   int *failed_index)
{
    op_args o = {.n = n, .n1 = n1, .in0 = x, .in1 = a_pair, .in2 = b_pair, .mat = out};
    return run(dt, AST_OP_SOAP_ROTATE, &o, batch, failed_index);
}

int ast_linalg_gram_ema(ast_dtype dt, int n, int n1, const void *g, double beta, double alpha,
                        void *l, void *r)
{
    return ast_linalg_gram_ema_batched(dt, 1, n, n1, g, beta, alpha, l, r, NULL);
}

int ast_linalg_gram_ema_batched(ast_dtype dt, int batch, int n, int n1, const void *g,
                                double beta, double alpha, void *l, void *r, int *failed_index)
{
    op_args o = {.n = n, .n1 = n1, .in0 = g, .mat = l, .mat1 = r, .p = beta, .eps = alpha};
    return run(dt, AST_OP_GRAM_EMA, &o, batch, failed_index);
}
