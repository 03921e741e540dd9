/*
 * linalg.c - the host REFRESH kernels and their direct API (asteria/linalg.h): eigh, inverse
 * p-th roots (eigen and coupled Newton), SOAP's and KL-Shampoo's QR power-iteration refreshes,
 * SOAP's re-expression of its first moment in a new basis (soap_rotate) and its factors' EMA
 * update (gram_ema); and run(), the dispatch every entry point goes through.
 *
 * Owns: per op, the kernel of one block and the direct API's argument checks (linalg_ops). The
 * op's name, shapes and in_place are its entry in the op table (op_table.c), whose run functions
 * call the batched entry points here. Beyond that, nothing outlives a call. Every call allocates
 * its own workspace (one block) and frees it before returning; the only state outside a call is
 * a pthread_once flag and a thread-local "retried" flag, so any number of threads may call in
 * concurrently with no locks.
 *
 * May call: the typed primitives (linalg_prim.h: through them LAPACKE and CBLAS), the canonical
 * bases (linalg_basis.h) and the op table's shapes (op_table.h); OpenBLAS's thread count.
 * OpenBLAS is pinned to one thread (ast_linalg_init, also run lazily by every entry point):
 * parallelism comes from running many blocks on pool workers, and a multithreaded OpenBLAS
 * inside each worker would oversubscribe the cores.
 *
 * Layout: the public API is row-major. The kernels hand LAPACK column-major buffers; for
 * symmetric inputs the two layouts coincide, and the one transposition that remains (of an
 * eigenvector or Q matrix) is fused with the copy into the caller's output.
 *
 * The algorithms are written once over a table of typed primitives (ast__kern); run() owns
 * validation, the input NaN/Inf check, the float32 -> float64 retry and batching, so each kernel
 * only computes.
 *
 * In-place ops (gram_ema: L and R are both read and written) cannot be retried, since the
 * kernel has overwritten what a retry would read, and need none: once the inputs are finite they
 * cannot fail. For them run() checks every block's inputs before it runs any block, so a
 * failure leaves every block as it was.
 *
 * Semantics this file adds to the header:
 *  - eigh and soap_refresh give the null space of a rank-deficient factor a canonical basis
 *    (linalg_basis.c), so their result is a function of the factor (and of the previous basis)
 *    and not of LAPACK's rounding; full-rank factors are untouched.
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
#include "linalg_basis.h"
#include "linalg_prim.h"
#include "op_table.h"

#include <float.h>
#include <math.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

/* Largest n whose ?syevd workspace (1 + 6n + 2n^2) fits a 32-bit lapack_int. */
#define LINALG_NMAX 32766
#define NEWTON_STALL 5

static pthread_once_t init_once = PTHREAD_ONCE_INIT;
static _Thread_local int tl_retried;

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

static int k_eigh(const ast__kern *K, const op_args *o)
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
    if (rc == 0 && o->mat)
        rc = ast__eigh_vectors(K, n, buf[0], buf[1], o->mat);
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
static int k_inv_root(const ast__kern *K, const op_args *o)
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
            memcpy(o->mat, buf[2], nn * es); /* symmetric: column- and row-major agree */
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
static int k_newton(const ast__kern *K, const op_args *o)
{
    const int n = o->n, p = o->ip;
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
    memcpy(o->mat, x, nn * es);
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
static int k_soap(const ast__kern *K, const op_args *o)
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
        rc = ast__qr_refresh_q(K, n, c, g, r, o->in1, rd, o->mat);
    }
    if (rc == 0)
        for (int j = 0; j < n; j++)
            o->perm[j] = r[j].i;
    free(base);
    return rc;
}

static int k_qr_refresh(const ast__kern *K, const op_args *o)
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
        rc = ast__qr_refresh_q(K, n, buf[0], buf[1], r, o->in1, buf[3], o->mat);
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
static int k_rotate(const ast__kern *K, const op_args *o)
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
static int k_gram_ema(const ast__kern *K, const op_args *o)
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

/* ---- dispatch: validation, input checks, float64 retry, batching ----------------------------- */

/* Element counts of one block's buffers (0 for a buffer the call does not have). */
typedef struct op_counts {
    size_t in0, in1, in2, mat, mat1, vec, perm;
} op_counts;

/* From the entry's shapes; out1 is whichever of mat1, vec, perm the call has. */
static op_counts counts_for(ast_op kind, const op_args *o)
{
    const unsigned char *sh = ast__op_get(kind)->shape;
    const size_t n = (size_t)o->n, n1 = o->n1 > 0 ? (size_t)o->n1 : 0;
    const size_t out1 = ast__shape_elems(sh[AST__ARG_OUT1], n, n1);
    op_counts c = {ast__shape_elems(sh[AST__ARG_IN0], n, n1),
                   o->in1 ? ast__shape_elems(sh[AST__ARG_IN1], n, n1) : 0,
                   o->in2 ? ast__shape_elems(sh[AST__ARG_IN2], n, n1) : 0,
                   o->mat ? ast__shape_elems(sh[AST__ARG_OUT0], n, n1) : 0,
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
static int validate_rotate(const op_args *o, int batch, const ast__kern *K)
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
    if (ast__overlaps(o->mat, out, o->in0, b * c.in0 * es) ||
        (o->in1 && ast__overlaps(o->mat, out, o->in1, b * c.in1 * es)) ||
        (o->in2 && ast__overlaps(o->mat, out, o->in2, b * c.in2 * es)))
        return AST_EINVAL;
    return 0;
}

/* gram_ema: as soap_rotate, no bound on n or n1 but addressable spans; L and R are updated in
 * place, so neither may overlap G or the other; beta and alpha finite in the type. */
static int validate_gram_ema(const op_args *o, int batch, const ast__kern *K)
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
    if ((o->mat && ast__overlaps(o->mat, l, o->in0, g)) ||
        (o->mat1 && ast__overlaps(o->mat1, r, o->in0, g)) ||
        (o->mat && o->mat1 && ast__overlaps(o->mat, l, o->mat1, r)))
        return AST_EINVAL;
    return 0;
}

/* The square ops run LAPACK, whose 32-bit workspace sizes bound n. */
static int validate_eigh(const op_args *o, int batch, const ast__kern *K)
{
    (void)batch, (void)K;
    return o->n <= LINALG_NMAX && (o->vec || o->mat) ? 0 : AST_EINVAL;
}

static int validate_inv_root(const op_args *o, int batch, const ast__kern *K)
{
    (void)batch, (void)K;
    return o->n <= LINALG_NMAX && o->mat && o->p > 0 && o->p <= DBL_MAX && o->eps >= 0 &&
                   o->eps <= DBL_MAX
               ? 0
               : AST_EINVAL;
}

static int validate_newton(const op_args *o, int batch, const ast__kern *K)
{
    (void)batch, (void)K;
    return o->n <= LINALG_NMAX && o->mat && o->ip >= 1 && o->eps >= 0 && o->eps <= DBL_MAX &&
                   o->max_iter >= 0 && o->tol > 0 && o->tol <= DBL_MAX
               ? 0
               : AST_EINVAL;
}

/* The refreshes write Q_new from F and Q: it may overlap neither. */
static int validate_kl_qr(const op_args *o, int batch, const ast__kern *K)
{
    const size_t span = (size_t)batch * o->n * o->n * K->es;
    if (o->n > LINALG_NMAX || !o->in1 || !o->mat || ast__overlaps(o->mat, span, o->in0, span) ||
        ast__overlaps(o->mat, span, o->in1, span))
        return AST_EINVAL;
    return 0;
}

static int validate_soap_qr(const op_args *o, int batch, const ast__kern *K)
{
    return o->perm ? validate_kl_qr(o, batch, K) : AST_EINVAL;
}

typedef int (*kernel_fn)(const ast__kern *K, const op_args *o);
/* The direct API's checks of its own arguments of one op, after validate()'s common ones.
 * Returns 0 or AST_EINVAL. */
typedef int (*validate_fn)(const op_args *o, int batch, const ast__kern *K);

/* Per op code: the kernel of one block (for run() and the float64 retry) and the argument checks.
 * The op's shapes and in_place are its op-table entry's (op_table.c). */
static const struct linalg_op {
    kernel_fn kernel;
    validate_fn validate;
} linalg_ops[] = {
    [AST_OP_EIGH] = {k_eigh, validate_eigh},
    [AST_OP_INV_ROOT] = {k_inv_root, validate_inv_root},
    [AST_OP_NEWTON_ROOT] = {k_newton, validate_newton},
    [AST_OP_SOAP_QR] = {k_soap, validate_soap_qr},
    [AST_OP_KL_QR] = {k_qr_refresh, validate_kl_qr},
    [AST_OP_SOAP_ROTATE] = {k_rotate, validate_rotate},
    [AST_OP_GRAM_EMA] = {k_gram_ema, validate_gram_ema},
};

static int validate(ast_op kind, const op_args *o, int batch, const ast__kern *K)
{
    if (o->n < 1 || batch < 0 || !o->in0)
        return AST_EINVAL;
    return linalg_ops[kind].validate(o, batch, K);
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
    rc = linalg_ops[kind].kernel(ast__kern_for(AST_F64), &d);
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

static int inputs_finite(const ast__kern *K, ast_op kind, const op_args *o)
{
    const op_counts c = counts_for(kind, o);
    return K->finite(c.in0, o->in0) && (!o->in1 || K->finite(c.in1, o->in1)) &&
           (!o->in2 || K->finite(c.in2, o->in2));
}

/* One block. An in-place op's inputs were all checked by run() already, and it has no retry. */
static int run_block(const ast__kern *K, ast_dtype dt, ast_op kind, const op_args *o)
{
    const kernel_fn kernel = linalg_ops[kind].kernel;
    if (ast__op_get(kind)->in_place)
        return kernel(K, o);
    if (!inputs_finite(K, kind, o))
        return AST_ENONFINITE; /* bad input: a float64 retry could not help */
    int rc = kernel(K, o);
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
    const ast__kern *K = ast__kern_for(dt);
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
    for (int b = 0; ast__op_get(kind)->in_place && b < batch; b++) {
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
    const ast__kern *K = ast__kern_for(dt);
    return K ? K->es : 0;
}

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
