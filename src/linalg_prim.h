/*
 * linalg_prim.h - the typed primitives the host REFRESH kernels are written over: one table of
 * LAPACKE / CBLAS calls and element loops per dtype (ast__kern), the one-allocation workspace,
 * and the Householder QR that the kernels and the canonical bases share. Internal (ast__ prefix;
 * not installed, not in asteria.map).
 *
 * Implemented by linalg_prim.c; used by linalg_kernels.c (the kernels), linalg_basis.c (the
 * canonical bases of null spaces), op_run.c (the kernels' dispatch) and op_table.c (the checks
 * of a call). Everything here is constant or allocates per call: any thread may call it, with
 * no lock.
 */
#ifndef ASTERIA_LINALG_PRIM_H
#define ASTERIA_LINALG_PRIM_H

#include "asteria/linalg.h"

#include <cblas.h>
#include <lapacke.h>
#include <stddef.h>
#include <stdint.h>

#ifdef BLAS_SYMBOL_PREFIX
/* An OpenBLAS whose symbols carry a prefix (scipy-openblas32 from PyPI, which the glibc 2.28
 * wheel links: docs/install.md; its pkg-config Cflags define BLAS_SYMBOL_PREFIX and its headers
 * declare the prefixed names). Every BLAS / LAPACKE name libasteria calls (linalg_prim.c and
 * quant.c, the files that call them, both through this header): */
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

/* All matrices are n x n. "cm" marks column-major buffers handed to LAPACK. */
typedef struct ast__kern {
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
} ast__kern;

/* The primitives of dt; NULL for an unknown dtype. */
const ast__kern *ast__kern_for(ast_dtype dt);

/* One allocation for all of a call's buffers (count of them, sizes[i] bytes each, 0 counted as
 * 1), each 64-byte aligned, their addresses in out[]. Returns the block to free, or NULL (out of
 * memory, or the total overflows a size_t). */
void *ast__ws_alloc(int count, const size_t *sizes, void **out);

/* The lwork to pass after a workspace query whose answer LAPACK wrote to query (one element of
 * K's type): its value rounded up, never below minimum, at most INT32_MAX. */
lapack_int ast__ws_lwork(const ast__kern *K, const void *query, lapack_int minimum);

/* Householder QR of the n x m column-major a (m <= n; geqrf + orgqr, torch.linalg.qr's
 * convention): a is replaced by Q's m columns; rdiag (may be NULL) receives R's diagonal.
 * Returns 0; AST_ENOMEM; AST_EINVAL when LAPACK rejects an argument; AST_ENONFINITE for NaN/Inf
 * in Q. */
int ast__qr_cols(const ast__kern *K, int n, int m, void *a, double *rdiag);

#endif
