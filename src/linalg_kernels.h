/*
 * linalg_kernels.h - the host REFRESH kernels: per op, the computation of one block over the
 * typed primitives (linalg_prim.h). Internal (ast__ prefix; not installed, not in asteria.map).
 *
 * Implemented by linalg_kernels.c. Each kernel is named after its op and is the `kernel` of
 * that op's row in the op table (op_table.c); the dispatch (op_run.c) calls it once per block,
 * with the block's own pointers (ast__op_args, op_table.h), its dtype's primitives K, after the
 * row's checks and with every input known finite. A kernel writes its outputs only once it has
 * succeeded, allocates its own workspace and frees it before returning: any thread may call
 * one, with no lock.
 *
 * Each returns 0; AST_ENOMEM (no workspace); AST_ENOCONV (LAPACK or the iteration did not
 * converge); AST_ENONFINITE (NaN/Inf in the result); AST_EINVAL (LAPACK rejected an argument).
 */
#ifndef ASTERIA_LINALG_KERNELS_H
#define ASTERIA_LINALG_KERNELS_H

#include "linalg_prim.h"
#include "op_table.h"

/* Largest n whose ?syevd workspace (1 + 6n + 2n^2) fits a 32-bit lapack_int: the bound of every
 * LAPACK-backed op (the checks of its row). */
#define AST__LINALG_NMAX 32766

/* eigh: out0 (may be NULL) the eigenvectors of in0 as columns, out1 (may be NULL) the
 * eigenvalues, both in descending order; a rank-deficient in0's null space gets a canonical
 * basis (linalg_basis.h). */
int ast__k_eigh(const ast__kern *K, const ast__op_args *o);
/* inv_root: out0 = (in0 + eps I)^(-1/p) from the eigendecomposition, eigenvalues raised to
 * n eps_m l_max first. */
int ast__k_inv_root(const ast__kern *K, const ast__op_args *o);
/* newton_root: out0 = (in0 + eps I)^(-1/p), p an integer, by the coupled Newton iteration, at
 * most max_iter steps, to ||M - I||_inf < tol. */
int ast__k_newton_root(const ast__kern *K, const ast__op_args *o);
/* soap_qr: out0 = qr(F Q[:, s]).Q with s = argsort(diag(Q^T F Q), descending), in out1
 * (int64); F = in0, Q = in1. */
int ast__k_soap_qr(const ast__kern *K, const ast__op_args *o);
/* kl_qr: out0 = qr(F Q).Q; F = in0, Q = in1. */
int ast__k_kl_qr(const ast__kern *K, const ast__op_args *o);
/* soap_rotate: out0 = A_new^T A_old X B_old^T B_new; X = in0 (n x n1), the A pair in1, the B
 * pair in2, either pair NULL (the identity side). */
int ast__k_soap_rotate(const ast__kern *K, const ast__op_args *o);
/* gram_ema, in place: out0 = p out0 + eps G G^T, out1 = p out1 + eps G^T G, G = in0 (n x n1),
 * either output NULL (not updated). Cannot fail. */
int ast__k_gram_ema(const ast__kern *K, const ast__op_args *o);

#endif
