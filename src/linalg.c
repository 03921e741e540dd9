/*
 * linalg.c - the direct API of the host REFRESH ops (asteria/linalg.h): per op, ast_linalg_<op>
 * and ast_linalg_<op>_batched, each a thin wrapper that puts its arguments in an ast__op_args
 * and runs the op's row of the op table (op_table.h) through the dispatch (op_run.h), the path
 * a pool worker's job takes too; and the former names of three of them, kept for their callers.
 *
 * Owns: nothing; no state. May call: the op table (a row by its code) and the dispatch.
 *
 * Semantics this file adds to the header:
 *  - n must be in [1, 32766] for the LAPACK-backed ops (AST__LINALG_NMAX, the rows' checks).
 *    soap_rotate and gram_ema call no LAPACK routine: any n, n1 >= 1 whose buffers' byte sizes
 *    fit a size_t.
 *  - ast_linalg_last_retried() reports the most recent ast_linalg_* call of the thread (any
 *    block of a batched call); every call resets it.
 *  - Batched calls set *failed_index (may be NULL) to -1 on success, to the failing block
 *    otherwise, and to 0 when the arguments themselves are rejected (nothing was written).
 *    gram_ema fails only on a non-finite G, found before anything is written.
 */
#include "asteria/linalg.h"

#include "op_run.h"
#include "op_table.h"

static int run(ast_op op, ast_dtype dt, int batch, const ast__op_args *o, int *failed_index)
{
    return ast__op_run(ast__op_get(op), dt, o, batch, failed_index);
}

int ast_linalg_eigh(ast_dtype dt, int n, const void *a, void *w, void *q)
{
    return ast_linalg_eigh_batched(dt, 1, n, a, w, q, NULL);
}

int ast_linalg_eigh_batched(ast_dtype dt, int batch, int n, const void *a, void *w, void *q,
                            int *failed_index)
{
    ast__op_args o = {.n = n, .in0 = a, .out0 = q, .out1 = w};
    return run(AST_OP_EIGH, dt, batch, &o, failed_index);
}

int ast_linalg_inv_root(ast_dtype dt, int n, const void *a, double p, double eps, void *x)
{
    return ast_linalg_inv_root_batched(dt, 1, n, a, p, eps, x, NULL);
}

int ast_linalg_inv_root_batched(ast_dtype dt, int batch, int n, const void *a, double p,
                                double eps, void *x, int *failed_index)
{
    ast__op_args o = {.n = n, .in0 = a, .out0 = x, .p = p, .eps = eps};
    return run(AST_OP_INV_ROOT, dt, batch, &o, failed_index);
}

int ast_linalg_newton_root(ast_dtype dt, int n, const void *a, int p, double eps, int max_iter,
                           double tol, void *x)
{
    return ast_linalg_newton_root_batched(dt, 1, n, a, p, eps, max_iter, tol, x, NULL);
}

int ast_linalg_newton_root_batched(ast_dtype dt, int batch, int n, const void *a, int p,
                                   double eps, int max_iter, double tol, void *x,
                                   int *failed_index)
{
    ast__op_args o = {.n = n, .in0 = a, .out0 = x, .p = p, .eps = eps, .max_iter = max_iter,
                      .tol = tol};
    return run(AST_OP_NEWTON_ROOT, dt, batch, &o, failed_index);
}

int ast_linalg_soap_qr(ast_dtype dt, int n, const void *f, const void *q, void *q_new,
                       int64_t *perm)
{
    return ast_linalg_soap_qr_batched(dt, 1, n, f, q, q_new, perm, NULL);
}

int ast_linalg_soap_qr_batched(ast_dtype dt, int batch, int n, const void *f, const void *q,
                               void *q_new, int64_t *perm, int *failed_index)
{
    ast__op_args o = {.n = n, .in0 = f, .in1 = q, .out0 = q_new, .out1 = perm};
    return run(AST_OP_SOAP_QR, dt, batch, &o, failed_index);
}

int ast_linalg_kl_qr(ast_dtype dt, int n, const void *f, const void *q, void *q_new)
{
    return ast_linalg_kl_qr_batched(dt, 1, n, f, q, q_new, NULL);
}

int ast_linalg_kl_qr_batched(ast_dtype dt, int batch, int n, const void *f, const void *q,
                             void *q_new, int *failed_index)
{
    ast__op_args o = {.n = n, .in0 = f, .in1 = q, .out0 = q_new};
    return run(AST_OP_KL_QR, dt, batch, &o, failed_index);
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
    ast__op_args o = {.n = n, .n1 = n1, .in0 = x, .in1 = a_pair, .in2 = b_pair, .out0 = out};
    return run(AST_OP_SOAP_ROTATE, dt, batch, &o, failed_index);
}

int ast_linalg_gram_ema(ast_dtype dt, int n, int n1, const void *g, double beta, double alpha,
                        void *l, void *r)
{
    return ast_linalg_gram_ema_batched(dt, 1, n, n1, g, beta, alpha, l, r, NULL);
}

int ast_linalg_gram_ema_batched(ast_dtype dt, int batch, int n, int n1, const void *g,
                                double beta, double alpha, void *l, void *r, int *failed_index)
{
    ast__op_args o = {.n = n, .n1 = n1, .in0 = g, .out0 = l, .out1 = r, .p = beta, .eps = alpha};
    return run(AST_OP_GRAM_EMA, dt, batch, &o, failed_index);
}

/* ---- former names --------------------------------------------------------------------------- */

int ast_linalg_newton_inv_root(ast_dtype dt, int n, const void *a, int p, double eps,
                               int max_iter, double tol, void *x)
{
    return ast_linalg_newton_root(dt, n, a, p, eps, max_iter, tol, x);
}

int ast_linalg_soap_refresh(ast_dtype dt, int n, const void *f, const void *q, void *q_new,
                            int64_t *perm)
{
    return ast_linalg_soap_qr(dt, n, f, q, q_new, perm);
}

int ast_linalg_soap_refresh_batched(ast_dtype dt, int batch, int n, const void *f, const void *q,
                                    void *q_new, int64_t *perm, int *failed_index)
{
    return ast_linalg_soap_qr_batched(dt, batch, n, f, q, q_new, perm, failed_index);
}

int ast_linalg_qr_refresh(ast_dtype dt, int n, const void *f, const void *q, void *q_new)
{
    return ast_linalg_kl_qr(dt, n, f, q, q_new);
}

int ast_linalg_qr_refresh_batched(ast_dtype dt, int batch, int n, const void *f, const void *q,
                                  void *q_new, int *failed_index)
{
    return ast_linalg_kl_qr_batched(dt, batch, n, f, q, q_new, failed_index);
}
