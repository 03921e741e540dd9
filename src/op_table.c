/*
 * op_table.c - the REFRESH op table (op_table.h): one constant row per ast_op (runtime.h), all
 * of the op: its name, which of a request's pointers it takes and the shape each spans,
 * takes_basis and in_place, the checks of a request's own arguments (check_*, with the reason
 * in words) and of every call's (validate_*), and its kernel (linalg_kernels.h). Also the
 * request-wide checks (ast__op_check), the call a request asks for (ast__op_args_of) and the
 * ops' public description (ast_op_info_get, ast_op_name, ast_op_count).
 *
 * Owns: the table, constant, so any thread may read it with no lock; nothing else.
 * May call: nothing at run time but the element size of a dtype (linalg_prim.h) and util.h's
 * message formatter; the rows hold the kernels' addresses, which only the dispatch (op_run.c)
 * calls. Read by runtime.c (validate a request), by op_run.c (run a row) and by linalg.c (the
 * row of each direct entry point).
 */
#include "op_table.h"

#include "asteria/errors.h"
#include "linalg_kernels.h"
#include "util.h"

#include <float.h>
#include <limits.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>

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

/* Returns 1 if the byte spans [a, a + alen) and [b, b + blen) share a byte, else 0. */
static int overlaps(const void *a, size_t alen, const void *b, size_t blen)
{
    uintptr_t x = (uintptr_t)a, y = (uintptr_t)b;
    return x < y + blen && y < x + alen;
}

/* The size of one element of a buffer of shape sh in a call of dtype size es. */
static size_t elem_size(int sh, size_t es) { return sh == AST_SHAPE_PERM ? sizeof(int64_t) : es; }

int ast__op_counts(const ast__op *op, size_t batch, size_t n, size_t n1, size_t es,
                   size_t count[AST__ARG_COUNT])
{
    for (int i = 0; i < AST__ARG_COUNT; i++) {
        /* the factors of each count, so bytes_of can see an overflow of the product */
        size_t a = 0, b = 1, span;
        switch (op->shape[i]) {
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
        if (bytes_of(&count[i], a, b, 1, 1) ||
            bytes_of(&span, batch, count[i], elem_size(op->shape[i], es), 1))
            return -1;
    }
    return 0;
}

/* Sets bytes[i] to the span of each pointer op takes, from its shape, for r's batch, n, n1 and
 * dtype (0 for the others). Returns -1 if a span overflows a size_t. */
static int op_spans(const ast__op *op, const ast_refresh *r, size_t bytes[AST__ARG_COUNT])
{
    const size_t batch = (size_t)r->batch, es = ast_dtype_size(r->dtype);
    size_t count[AST__ARG_COUNT];
    if (ast__op_counts(op, batch, (size_t)r->n, r->n1 > 0 ? (size_t)r->n1 : 0, es, count))
        return -1;
    for (int i = 0; i < AST__ARG_COUNT; i++)
        bytes[i] = batch * count[i] * elem_size(op->shape[i], es);
    return 0;
}

/* ---- the checks of a request (check) and of every call (validate), per op --------------- */

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
    if (rc == 0 && (r->p > INT_MAX || r->p != (double)(int)r->p))
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
    const double maxval = r->dtype == AST_F32 ? FLT_MAX : DBL_MAX;
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

/* The square ops run LAPACK, whose 32-bit workspace sizes bound n. */
static int validate_eigh(const ast__op_args *o, const size_t count[AST__ARG_COUNT], int batch,
                         const ast__kern *K)
{
    (void)count, (void)batch, (void)K;
    return o->n <= AST__LINALG_NMAX && (o->out0 || o->out1) ? 0 : AST_EINVAL;
}

static int validate_inv_root(const ast__op_args *o, const size_t count[AST__ARG_COUNT],
                             int batch, const ast__kern *K)
{
    (void)count, (void)batch, (void)K;
    return o->n <= AST__LINALG_NMAX && o->out0 && o->p > 0 && o->p <= DBL_MAX && o->eps >= 0 &&
                   o->eps <= DBL_MAX
               ? 0
               : AST_EINVAL;
}

/* p is an integer: the direct call takes an int, a request's is checked by check_newton. */
static int validate_newton(const ast__op_args *o, const size_t count[AST__ARG_COUNT], int batch,
                           const ast__kern *K)
{
    (void)count, (void)batch, (void)K;
    return o->n <= AST__LINALG_NMAX && o->out0 && o->p >= 1 && o->p <= INT_MAX && o->eps >= 0 &&
                   o->eps <= DBL_MAX && o->max_iter >= 0 && o->tol > 0 && o->tol <= DBL_MAX
               ? 0
               : AST_EINVAL;
}

/* The refreshes write Q_new from F and Q: it may overlap neither. */
static int validate_kl_qr(const ast__op_args *o, const size_t count[AST__ARG_COUNT], int batch,
                          const ast__kern *K)
{
    const size_t span = (size_t)batch * count[AST__ARG_IN0] * K->es;
    if (o->n > AST__LINALG_NMAX || !o->in1 || !o->out0 || overlaps(o->out0, span, o->in0, span) ||
        overlaps(o->out0, span, o->in1, span))
        return AST_EINVAL;
    return 0;
}

static int validate_soap_qr(const ast__op_args *o, const size_t count[AST__ARG_COUNT], int batch,
                            const ast__kern *K)
{
    return o->out1 ? validate_kl_qr(o, count, batch, K) : AST_EINVAL;
}

/* soap_rotate calls no LAPACK routine: any n, n1 (the dispatch has checked that every span is
 * addressable); the output may not overlap any input. */
static int validate_rotate(const ast__op_args *o, const size_t count[AST__ARG_COUNT], int batch,
                           const ast__kern *K)
{
    if (o->n1 < 1 || !o->out0 || (!o->in1 && !o->in2))
        return AST_EINVAL;
    const size_t b = (size_t)batch, es = K->es, out = b * count[AST__ARG_OUT0] * es;
    if (overlaps(o->out0, out, o->in0, b * count[AST__ARG_IN0] * es) ||
        (o->in1 && overlaps(o->out0, out, o->in1, b * count[AST__ARG_IN1] * es)) ||
        (o->in2 && overlaps(o->out0, out, o->in2, b * count[AST__ARG_IN2] * es)))
        return AST_EINVAL;
    return 0;
}

/* gram_ema: as soap_rotate, any n, n1; L and R are updated in place, so neither may overlap G
 * or the other; beta and alpha finite in the type. */
static int validate_gram_ema(const ast__op_args *o, const size_t count[AST__ARG_COUNT], int batch,
                             const ast__kern *K)
{
    if (o->n1 < 1 || (!o->out0 && !o->out1) || !(fabs(o->p) <= K->maxval) ||
        !(fabs(o->eps) <= K->maxval))
        return AST_EINVAL;
    const size_t b = (size_t)batch, es = K->es, g = b * count[AST__ARG_IN0] * es;
    const size_t l = b * count[AST__ARG_OUT0] * es, r = b * count[AST__ARG_OUT1] * es;
    if ((o->out0 && overlaps(o->out0, l, o->in0, g)) ||
        (o->out1 && overlaps(o->out1, r, o->in0, g)) ||
        (o->out0 && o->out1 && overlaps(o->out0, l, o->out1, r)))
        return AST_EINVAL;
    return 0;
}

/* ---- the table ------------------------------------------------------------------------------ */

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

/* Per op: its name; args and shape: in0, in1, in2, out0, out1; takes_basis, in_place; the checks
 * of a request and of every call; the kernel. The eigen ops have always accepted an in1 of the
 * factor's size (range-checked, not read); it stays accepted so no caller breaks. */
static const ast__op op_table[] = {
    [AST_OP_EIGH] = {"eigh", {REQ, OPT, NONE, REQ, OPT}, {S_NN, S_NN, 0, S_NN, S_N}, 0, 0, NULL,
                     validate_eigh, ast__k_eigh},
    [AST_OP_INV_ROOT] = {"inv_root", {REQ, OPT, NONE, REQ, NONE}, {S_NN, S_NN, 0, S_NN, 0}, 0, 0,
                         check_root, validate_inv_root, ast__k_inv_root},
    [AST_OP_NEWTON_ROOT] = {"newton_root", {REQ, OPT, NONE, REQ, NONE}, {S_NN, S_NN, 0, S_NN, 0},
                            0, 0, check_newton, validate_newton, ast__k_newton_root},
    [AST_OP_SOAP_QR] = {"soap_qr", {REQ, REQ, NONE, REQ, REQ}, {S_NN, S_NN, 0, S_NN, S_PERM}, 1,
                        0, NULL, validate_soap_qr, ast__k_soap_qr},
    [AST_OP_KL_QR] = {"kl_qr", {REQ, REQ, NONE, REQ, NONE}, {S_NN, S_NN, 0, S_NN, 0}, 1, 0, NULL,
                      validate_kl_qr, ast__k_kl_qr},
    [AST_OP_SOAP_ROTATE] = {"soap_rotate", {REQ, OPT, OPT, REQ, NONE},
                            {S_NN1, S_PAIR_NN, S_PAIR_N1N1, S_NN1, 0}, 0, 0, check_rotate,
                            validate_rotate, ast__k_soap_rotate},
    [AST_OP_GRAM_EMA] = {"gram_ema", {REQ, NONE, NONE, OPT, OPT}, {S_NN1, 0, 0, S_NN, S_N1N1}, 0,
                         1, check_gram_ema, validate_gram_ema, ast__k_gram_ema},
};
/* Codes run from 1; slot 0 is no op. */
#define OP_SLOTS ((int)(sizeof op_table / sizeof op_table[0]))

const ast__op *ast__op_get(int op)
{
    return op >= 1 && op < OP_SLOTS && op_table[op].name ? &op_table[op] : NULL;
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

ast__op_args ast__op_args_of(const ast__op *op, const ast_refresh *req)
{
    /* an eigen op's in1 is accepted, not read (op_table[]); Python's Op.reads says the same */
    const int reads = op->takes_basis || op->shape[AST__ARG_IN0] == AST_SHAPE_NN1;
    ast__op_args o = {.n = req->n, .n1 = req->n1, .in0 = req->in0,
                      .in1 = reads ? req->in1 : NULL, .in2 = reads ? req->in2 : NULL,
                      .out0 = req->out0, .out1 = req->out1, .p = req->p, .eps = req->eps,
                      .max_iter = NEWTON_MAX_ITER, .tol = NEWTON_TOL};
    return o;
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

const char *ast_op_name(int op)
{
    const ast__op *o = ast__op_get(op);
    return o ? o->name : NULL;
}

int ast_op_count(void) { return OP_SLOTS - 1; }
