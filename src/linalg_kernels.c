/*
 * linalg_kernels.c - the host REFRESH kernels (linalg_kernels.h): one block of each op, eigh,
 * the inverse p-th roots (eigen and coupled Newton), SOAP's and KL-Shampoo's QR power-iteration
 * refreshes, SOAP's re-expression of its first moment in a new basis (soap_rotate) and its
 * factors' EMA update (gram_ema).
 *
 * Owns: the algorithms, written once over the typed primitives (ast__kern); each kernel only
 * computes. Its checks, shapes and in_place are its op's row (op_table.c); validation, the
 * input NaN/Inf check, the float32 -> float64 retry and batching are the dispatch's (op_run.c).
 * Nothing outlives a call: every kernel allocates its own workspace (one block) and frees it
 * before returning, so any number of threads may call in concurrently with no locks.
 *
 * May call: the typed primitives (linalg_prim.h: through them LAPACKE and CBLAS) and the
 * canonical bases (linalg_basis.h).
 *
 * Layout: the public API is row-major. The kernels hand LAPACK column-major buffers; for
 * symmetric inputs the two layouts coincide, and the one transposition that remains (of an
 * eigenvector or Q matrix) is fused with the copy into the caller's output.
 *
 * Semantics:
 *  - eigh and soap_qr give the null space of a rank-deficient factor a canonical basis
 *    (linalg_basis.c), so their result is a function of the factor (and of the previous basis)
 *    and not of LAPACK's rounding; full-rank factors are untouched.
 *  - Newton stops early with AST_ENOCONV once the iteration stalls (no new best ||M - I||_inf
 *    for NEWTON_STALL steps) or diverges (error above twice the best), rather than burning the
 *    remaining iterations at the rounding floor. Both tests apply only once the best error is
 *    below 1: before that the inf-norm may grow for a few steps while the exact iteration still
 *    converges (the 2-norm of M - I shrinks monotonically, the inf-norm need not).
 */
#include "linalg_kernels.h"

#include "asteria/errors.h"
#include "linalg_basis.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#define NEWTON_STALL 5

/* Eigendecomposition of the symmetric a into z_cm (eigenvectors as columns) and w, ascending. */
static int eig_core(const ast__kern *K, int n, const void *a, void *z_cm, void *w)
{
    const size_t nn = (size_t)n * n;
    double wq = 0;
    lapack_int iq = 0;

    memcpy(z_cm, a, nn * K->es);
    if (K->syevd(n, z_cm, w, &wq, -1, &iq, -1) != 0)
        return AST_EINVAL;
    lapack_int lwork = ast__ws_lwork(K, &wq, 1 + 6 * n + 2 * n * n);
    lapack_int liwork = iq > 3 + 5 * n ? iq : 3 + 5 * n;
    size_t sz[2] = {(size_t)lwork * K->es, (size_t)liwork * sizeof(lapack_int)};
    void *buf[2];
    void *base = ast__ws_alloc(2, sz, buf);
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

int ast__k_eigh(const ast__kern *K, const ast__op_args *o)
{
    const int n = o->n;
    const size_t es = K->es;
    size_t sz[2] = {(size_t)n * n * es, (size_t)n * es};
    void *buf[2];
    void *base = ast__ws_alloc(2, sz, buf);
    if (!base)
        return AST_ENOMEM;
    int rc = eig_core(K, n, o->in0, buf[0], buf[1]);
    /* LAPACK returns ascending order; the contract is descending. */
    if (rc == 0 && o->out0)
        rc = ast__eigh_vectors(K, n, buf[0], buf[1], o->out0);
    if (rc == 0 && o->out1)
        for (int j = 0; j < n; j++)
            memcpy((char *)o->out1 + (size_t)j * es, (char *)buf[1] + (size_t)(n - 1 - j) * es,
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
int ast__k_inv_root(const ast__kern *K, const ast__op_args *o)
{
    const int n = o->n;
    const size_t es = K->es, nn = (size_t)n * n;
    size_t sz[3] = {nn * es, (size_t)n * es, nn * es};
    void *buf[3];
    void *base = ast__ws_alloc(3, sz, buf);
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
            memcpy(o->out0, buf[2], nn * es); /* symmetric: column- and row-major agree */
    }
    free(base);
    return rc;
}

/* buf[0] <- buf[0]^p by repeated squaring, buf[1] and buf[2] scratch. The three pointers are
 * permuted so that buf[0] holds the power on return and the other two are free. */
static void mat_pow(const ast__kern *K, int n, int p, void *buf[3])
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
int ast__k_newton_root(const ast__kern *K, const ast__op_args *o)
{
    const int n = o->n, p = (int)o->p;
    const size_t es = K->es, nn = (size_t)n * n;
    size_t sz[5] = {nn * es, nn * es, nn * es, nn * es, nn * es};
    void *buf[5];
    void *base = ast__ws_alloc(5, sz, buf);
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
    memcpy(o->out0, x, nn * es);
    rc = 0;
out:
    free(base);
    return rc;
}

/* c_cm = F Q in column-major. The row-major buffers read as column-major are F^T and Q^T, so
 * transposing both operands yields F Q. */
static int fq_product(const ast__kern *K, int n, const void *f, const void *q, void *c_cm)
{
    K->gemm(CblasColMajor, CblasTrans, CblasTrans, n, f, q, c_cm);
    return K->finite((size_t)n * n, c_cm) ? 0 : AST_ENONFINITE;
}

/* Descending e; the index breaks ties, which makes qsort's order that of a stable sort. */
static int ranked_cmp(const void *pa, const void *pb)
{
    const ast__ranked *a = pa, *b = pb;
    if (a->e != b->e)
        return a->e > b->e ? -1 : 1;
    return (a->i > b->i) - (a->i < b->i);
}


/* F Q[:, s] = (F Q)[:, s]: permuting the product's columns equals the product with permuted
 * columns, and in column-major each column moves as one memcpy. */
int ast__k_soap_qr(const ast__kern *K, const ast__op_args *o)
{
    const int n = o->n;
    const size_t es = K->es, nn = (size_t)n * n;
    size_t sz[4] = {nn * es, nn * es, (size_t)n * sizeof(ast__ranked), (size_t)n * sizeof(double)};
    void *buf[4];
    void *base = ast__ws_alloc(4, sz, buf);
    if (!base)
        return AST_ENOMEM;
    char *c = buf[0], *g = buf[1];
    ast__ranked *r = buf[2];
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
        rc = ast__qr_refresh_q(K, n, c, g, r, o->in1, rd, o->out0);
    }
    if (rc == 0) {
        int64_t *perm = o->out1;
        for (int j = 0; j < n; j++)
            perm[j] = r[j].i;
    }
    free(base);
    return rc;
}

int ast__k_kl_qr(const ast__kern *K, const ast__op_args *o)
{
    const int n = o->n;
    const size_t nn = (size_t)n * n;
    size_t sz[4] = {nn * K->es, nn * K->es, (size_t)n * sizeof(ast__ranked),
                    (size_t)n * sizeof(double)};
    void *buf[4];
    void *base = ast__ws_alloc(4, sz, buf);
    if (!base)
        return AST_ENOMEM;
    ast__ranked *r = buf[2];
    int rc = fq_product(K, n, o->in0, o->in1, buf[0]);
    if (rc == 0) {
        for (int j = 0; j < n; j++)
            r[j].i = j;
        memcpy(buf[1], buf[0], nn * K->es);
        rc = ast__qr_refresh_q(K, n, buf[0], buf[1], r, o->in1, buf[3], o->out0);
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
int ast__k_soap_rotate(const ast__kern *K, const ast__op_args *o)
{
    const int n = o->n, n1 = o->n1;
    const size_t es = K->es, nx = (size_t)n * n1;
    const int form_a = o->in1 && n < n1, form_b = o->in2 && n1 < n;
    const size_t sq = form_a ? (size_t)n * n : form_b ? (size_t)n1 * n1 : 0;
    size_t sz[3] = {nx * es, nx * es, sq * es};
    void *buf[3];
    void *base = ast__ws_alloc(3, sz, buf);
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
    /* The op's checks (op_table.c) guarantee a side, so cur is a workspace buffer here. */
    int rc = K->finite(nx, cur) ? 0 : AST_ENONFINITE;
    if (rc == 0)
        memcpy(o->out0, cur, nx * es);
    free(base);
    return rc;
}

/*
 * SOAP's factor EMAs, in place: L = p L + eps G G^T, R = p R + eps G^T G with G n x n1. Each is
 * one ?syrk on the row-major G as it lies (G G^T: no transposition, G^T G: the transposed
 * product, both with leading dimension n1) into the upper triangle of the factor itself, which
 * is then mirrored: exactly symmetric, half the flops of a ?gemm, no workspace. Inputs are
 * known finite (the dispatch, op_run.c, checked every block's G first), so nothing here can fail.
 */
int ast__k_gram_ema(const ast__kern *K, const ast__op_args *o)
{
    const int n = o->n, n1 = o->n1;
    if (o->out0) {
        K->syrk_rm(CblasNoTrans, n, n1, o->eps, o->in0, n1, o->p, o->out0);
        K->mirror_lower(n, o->out0);
    }
    if (o->out1) {
        K->syrk_rm(CblasTrans, n1, n, o->eps, o->in0, n1, o->p, o->out1);
        K->mirror_lower(n1, o->out1);
    }
    return 0;
}
