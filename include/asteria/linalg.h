/*
 * asteria/linalg.h - host linear algebra for preconditioner refreshes (LAPACKE/OpenBLAS).
 *
 * Owns: the O(n^3) REFRESH kernels of Shampoo, SOAP and KL-Shampoo (and SOAP's re-expression
 * of its first moment at install, and its factors' EMA update), in float32 and float64,
 * single-block and batched (many same-shape blocks laid out contiguously).
 *
 * Public API: a program that runs refreshes on threads of its own, or on ast_pool workers
 * without a runtime (examples/pool_stream.c), calls these directly; the runtime's pool jobs
 * (ast_runtime_submit) run the same ops the same way. Each op (ast_op, asteria/runtime.h) has
 * ast_linalg_<op> (one block) and ast_linalg_<op>_batched; three keep former names too
 * (ast_linalg_newton_inv_root, ast_linalg_soap_refresh*, ast_linalg_qr_refresh*), the same
 * calls.
 *
 * Conventions
 *  - Matrices are dense, ROW-MAJOR (torch's layout), no padding; square n x n except the
 *    n x n1 operand and result of ast_linalg_soap_rotate and the n x n1 G (and n1 x n1 R) of
 *    ast_linalg_gram_ema.
 *  - "Eigenvectors as columns": Q[i*n + j] is component i of eigenvector j.
 *  - Outputs are written only on success. On any failure (non-convergence, NaN/Inf in the
 *    input or the result, bad argument) the output buffers are left exactly as they were, so
 *    the caller keeps its previous preconditioner.
 *  - float32 calls that fail numerically are retried once in float64; the result is rounded
 *    back to float32. ast_linalg_last_retried() says whether that happened in this thread.
 *  - Batched entry points process `batch` blocks (batch 0: nothing, success); they stop at the
 *    first failing block and return its code. failed_index may be NULL; otherwise
 *    *failed_index is -1 on success, the failing block on a failure (blocks before it are
 *    written, blocks from it on are untouched), and 0 when the arguments are rejected (nothing
 *    was written).
 *  - The LAPACK-backed calls (eigh, the roots, the refreshes) take 1 <= n <= 32766 (their
 *    32-bit workspace sizes bound n); soap_rotate and gram_ema call no LAPACK routine and take
 *    any n, n1 >= 1 whose buffers' byte sizes fit a size_t.
 *  - The codes every kernel may return, besides 0 for success: AST_EINVAL for a bad argument
 *    (an unknown dtype, n or batch out of range, a NULL pointer that is not optional, the
 *    function's own cases below); AST_ENOMEM when the workspace cannot be allocated;
 *    AST_ENOCONV when LAPACK (or the Newton iteration) does not converge; AST_ENONFINITE for
 *    NaN/Inf in the input or the result. Each RETURN VALUE below names the ones it can give.
 *
 * Threading: no shared mutable state; each call allocates its own workspace. Callers run many
 * calls concurrently from pool workers; OpenBLAS is kept at one thread per call
 * (ast_linalg_init sets that once, before workers start; every call also runs it).
 */
#ifndef ASTERIA_LINALG_H
#define ASTERIA_LINALG_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef enum ast_dtype { AST_F32 = 0, AST_F64 = 1 } ast_dtype;

/* The size of one element of dtype.
 * RETURN VALUE: 4 (AST_F32) or 8 (AST_F64); 0 for an unknown dtype. */
size_t ast_dtype_size(ast_dtype dt);

/* Pins OpenBLAS to one thread per call. Idempotent; call before concurrent use.
 * RETURN VALUE: none. */
void ast_linalg_init(void);

/* Whether the most recent ast_linalg_* call on this thread (any block of a batched call) used
 * the float64 retry; every call resets it.
 * RETURN VALUE: 1 if it did, else 0. */
int ast_linalg_last_retried(void);

/* Symmetric eigendecomposition via ?syevd. A is n x n symmetric (only its values are read, A is
 * not modified). w: n eigenvalues in DESCENDING order; q: eigenvectors as columns in the same
 * order. Either w or q may be NULL when not wanted (not both). The null space of a
 * rank-deficient A gets a canonical basis (a function of A, not of LAPACK's rounding).
 * RETURN VALUE (both variants): 0; AST_EINVAL (unknown dt, n out of range, batch < 0, a NULL,
 * w and q both NULL); AST_ENOMEM; AST_ENOCONV (?syevd did not converge); AST_ENONFINITE
 * (NaN/Inf in A or in the result). */
int ast_linalg_eigh(ast_dtype dt, int n, const void *a, void *w, void *q);
int ast_linalg_eigh_batched(ast_dtype dt, int batch, int n, const void *a, void *w, void *q,
                            int *failed_index);

/* Inverse p-th root X = (A + eps I)^(-1/p), computed from the eigendecomposition of A with its
 * eigenvalues raised to the floor n eps_m l_max (eps_m the type's machine epsilon) before eps is
 * added: X = Q diag((max(l, n eps_m l_max)+eps)^(-1/p)) Q^T. Eigenvalues below the floor are
 * rounding noise on which LAPACKs disagree; raised to it, a rank-deficient A's null space gets
 * one root value, independent of the eigenvectors picked there.
 * RETURN VALUE (both variants): 0; AST_EINVAL (unknown dt, n out of range, batch < 0, a or x
 * NULL, p not a finite value > 0, eps not a finite value >= 0); AST_ENOMEM; AST_ENOCONV;
 * AST_ENONFINITE (NaN/Inf in A, a root beyond the type's range, or an all-zero A with
 * eps == 0). */
int ast_linalg_inv_root(ast_dtype dt, int n, const void *a, double p, double eps, void *x);
int ast_linalg_inv_root_batched(ast_dtype dt, int batch, int n, const void *a, double p,
                                double eps, void *x, int *failed_index);

/* Coupled-Newton inverse p-th root of (A + eps I) (Higham / Guo-Higham iteration), p a positive
 * integer, A symmetric positive (semi)definite. Stops when ||M - I||_inf < tol, or earlier with
 * AST_ENOCONV once the iteration stalls or diverges, or after max_iter iterations.
 * RETURN VALUE (both variants): 0 on convergence; AST_EINVAL (unknown dt, n out of range,
 * batch < 0, a or x NULL, p < 1, eps not a finite value >= 0, max_iter < 0, tol not a finite
 * value > 0); AST_ENOMEM; AST_ENOCONV (max_iter reached, a stall or a divergence; an indefinite
 * A ends here or in AST_ENONFINITE); AST_ENONFINITE (NaN/Inf in A or an iterate,
 * A + eps I == 0). */
int ast_linalg_newton_root(ast_dtype dt, int n, const void *a, int p, double eps, int max_iter,
                           double tol, void *x);
int ast_linalg_newton_root_batched(ast_dtype dt, int batch, int n, const void *a, int p,
                                   double eps, int max_iter, double tol, void *x,
                                   int *failed_index);
/* The former name of ast_linalg_newton_root, the same call.
 * RETURN VALUE: as ast_linalg_newton_root's. */
int ast_linalg_newton_inv_root(ast_dtype dt, int n, const void *a, int p, double eps,
                               int max_iter, double tol, void *x);

/* SOAP's refresh of one factor F with its current basis Q (one QR power-iteration step):
 *   e = diag(Q^T F Q); s = argsort(e, descending); Q_new = qr(F Q[:, s]).Q
 * perm receives s (n int64 entries) so the caller can permute its second moment. Ties in e keep
 * their original order (stable sort). Where F Q[:, s] has dependent columns, Q_new's columns
 * there are a canonical completion from Q's.
 * RETURN VALUE (both variants): 0; AST_EINVAL (unknown dt, n out of range, batch < 0, f, q,
 * q_new or perm NULL, q_new overlapping f or q); AST_ENOMEM; AST_ENOCONV; AST_ENONFINITE
 * (NaN/Inf in F, Q or the result). */
int ast_linalg_soap_qr(ast_dtype dt, int n, const void *f, const void *q, void *q_new,
                       int64_t *perm);
int ast_linalg_soap_qr_batched(ast_dtype dt, int batch, int n, const void *f, const void *q,
                               void *q_new, int64_t *perm, int *failed_index);
/* The former names of ast_linalg_soap_qr and ast_linalg_soap_qr_batched, the same calls.
 * RETURN VALUE: as theirs. */
int ast_linalg_soap_refresh(ast_dtype dt, int n, const void *f, const void *q, void *q_new,
                            int64_t *perm);
int ast_linalg_soap_refresh_batched(ast_dtype dt, int batch, int n, const void *f, const void *q,
                                    void *q_new, int64_t *perm, int *failed_index);

/* KL-Shampoo's refresh: Q_new = qr(F Q).Q (no sorting; dependent columns as in
 * ast_linalg_soap_qr).
 * RETURN VALUE (both variants): 0; AST_EINVAL (unknown dt, n out of range, batch < 0, f, q or
 * q_new NULL, q_new overlapping f or q); AST_ENOMEM; AST_ENOCONV; AST_ENONFINITE (NaN/Inf in
 * F, Q or the result). */
int ast_linalg_kl_qr(ast_dtype dt, int n, const void *f, const void *q, void *q_new);
int ast_linalg_kl_qr_batched(ast_dtype dt, int batch, int n, const void *f, const void *q,
                             void *q_new, int *failed_index);
/* The former names of ast_linalg_kl_qr and ast_linalg_kl_qr_batched, the same calls.
 * RETURN VALUE: as theirs. */
int ast_linalg_qr_refresh(ast_dtype dt, int n, const void *f, const void *q, void *q_new);
int ast_linalg_qr_refresh_batched(ast_dtype dt, int batch, int n, const void *f, const void *q,
                                  void *q_new, int *failed_index);

/* SOAP's re-expression of its first moment in a new eigenbasis:
 *   out = A_new^T (A_old X B_old^T) B_new
 * X and out are n x n1. a_pair is (2, n, n): A_old then A_new, contiguous; b_pair is
 * (2, n1, n1): B_old then B_new. Either pair may be NULL, meaning that side is the identity
 * (a_pair NULL: out = X B_old^T B_new; b_pair NULL: out = A_new^T A_old X), not both.
 * Every product is a ?gemm; each side is evaluated in the association with fewer flops for the
 * shape of X ((A_new^T A_old) X when n < n1, A_new^T (A_old X) otherwise; the right side
 * likewise), so results agree with other evaluation orders to rounding, not bitwise. A and B
 * need not be orthogonal.
 * Batched: x and out are batch x n x n1, a_pair batch x 2 x n x n, b_pair batch x 2 x n1 x n1;
 * block i uses the i-th of each.
 * RETURN VALUE (both variants): 0; AST_EINVAL (unknown dt, n or n1 < 1, batch < 0, x or out
 * NULL, both pairs NULL, a span beyond a size_t, out overlapping x, a_pair or b_pair);
 * AST_ENOMEM; AST_ENONFINITE (NaN/Inf in an input or the result). */
int ast_linalg_soap_rotate(ast_dtype dt, int n, int n1, const void *x, const void *a_pair,
                           const void *b_pair, void *out);
int ast_linalg_soap_rotate_batched(ast_dtype dt, int batch, int n, int n1, const void *x,
                                   const void *a_pair, const void *b_pair, void *out,
                                   int *failed_index);

/* SOAP's factor EMAs, IN PLACE: for G (n x n1),
 *   L = beta L + alpha G G^T   (l: n x n, or NULL: L not updated)
 *   R = beta R + alpha G^T G   (r: n1 x n1, or NULL: R not updated), not both NULL.
 * Each product is one ?syrk (half the flops of a ?gemm) on one triangle, then mirrored, so L
 * and R come out exactly symmetric; they are taken as symmetric on input (only the upper
 * triangle, row-major, is read). Only G is checked: NaN/Inf already in L or R, or a product
 * beyond the type's range, is written as the arithmetic gives it (as torch.baddbmm would). The
 * call cannot fail once its arguments and G pass, so there is no float64 retry.
 * Batched: g is batch x n x n1, l batch x n x n, r batch x n1 x n1; block i uses the i-th of
 * each. Unlike the other batched calls, every block's G is checked before any block is
 * written: on AST_ENONFINITE (*failed_index = the first poisoned block) no block's L or R has
 * changed.
 * RETURN VALUE (both variants): 0; AST_EINVAL (unknown dt, n or n1 < 1, batch < 0, g NULL, l
 * and r both NULL, beta or alpha not finite in the type's range, a span beyond a size_t, l or r
 * overlapping g or each other); AST_ENONFINITE (NaN/Inf in G). */
int ast_linalg_gram_ema(ast_dtype dt, int n, int n1, const void *g, double beta, double alpha,
                        void *l, void *r);
int ast_linalg_gram_ema_batched(ast_dtype dt, int batch, int n, int n1, const void *g,
                                double beta, double alpha, void *l, void *r, int *failed_index);

#ifdef __cplusplus
}
#endif
#endif
