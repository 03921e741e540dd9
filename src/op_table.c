/*
 * op_table.c - the REFRESH op table (op_table.h): one constant entry per ast_op (runtime.h), its
 * name, which of a request's pointers it takes and the shape each spans, takes_basis and
 * in_place, the check of its own arguments and the run function a pool worker calls; and the
 * request-wide checks (ast__op_check) and the ops' public description (ast_op_info_get,
 * ast_op_name, ast_op_count).
 *
 * Owns: the table, constant, so any thread may read it with no lock; nothing else.
 * May call: the batched entry points of asteria/linalg.h (each run function is one call, or one
 * per block) and util.h's message formatter. Read by runtime.c (validate and run a request)
 * and by linalg.c, whose per-block kernels take their buffer shapes and in_place from here.
 */
#include "op_table.h"

#include "asteria/errors.h"
#include "asteria/linalg.h"
#include "util.h"

#include <float.h>
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

int ast__overlaps(const void *a, size_t alen, const void *b, size_t blen)
{
    uintptr_t x = (uintptr_t)a, y = (uintptr_t)b;
    return x < y + blen && y < x + alen;
}

size_t ast__shape_elems(int shape, size_t n, size_t n1)
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
    const double maxval = r->dtype == AST_F32 ? FLT_MAX : DBL_MAX;
    if (!(fabs(r->p) <= maxval) || !(fabs(r->eps) <= maxval))
        return ast__errorf(msg, len, AST_EINVAL,
                           "gram_ema p=%g eps=%g; allowed: finite values in the dtype's range "
                           "(p = beta, eps = alpha)",
                           r->p, r->eps);
    const size_t g = bytes[AST__ARG_IN0], lb = bytes[AST__ARG_OUT0], rb = bytes[AST__ARG_OUT1];
    const char *clash = NULL;
    if (r->out0 && r->in0 && ast__overlaps(r->out0, lb, r->in0, g))
        clash = "out0 (L) overlaps in0 (G)";
    else if (r->out1 && r->in0 && ast__overlaps(r->out1, rb, r->in0, g))
        clash = "out1 (R) overlaps in0 (G)";
    else if (r->out0 && r->out1 && ast__overlaps(r->out0, lb, r->out1, rb))
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
static const ast__op op_table[] = {
    [AST_OP_EIGH] = {"eigh", {REQ, OPT, NONE, REQ, OPT}, {S_NN, S_NN, 0, S_NN, S_N}, 0, 0, NULL,
                     run_eigh},
    [AST_OP_INV_ROOT] = {"inv_root", {REQ, OPT, NONE, REQ, NONE}, {S_NN, S_NN, 0, S_NN, 0}, 0, 0,
                         check_root, run_inv_root},
    [AST_OP_NEWTON_ROOT] = {"newton_root", {REQ, OPT, NONE, REQ, NONE}, {S_NN, S_NN, 0, S_NN, 0},
                            0, 0, check_newton, run_newton},
    [AST_OP_SOAP_QR] = {"soap_qr", {REQ, REQ, NONE, REQ, REQ}, {S_NN, S_NN, 0, S_NN, S_PERM}, 1,
                        0, NULL, run_soap_qr},
    [AST_OP_KL_QR] = {"kl_qr", {REQ, REQ, NONE, REQ, NONE}, {S_NN, S_NN, 0, S_NN, 0}, 1, 0, NULL,
                      run_kl_qr},
    [AST_OP_SOAP_ROTATE] = {"soap_rotate", {REQ, OPT, OPT, REQ, NONE},
                            {S_NN1, S_PAIR_NN, S_PAIR_N1N1, S_NN1, 0}, 0, 0, check_rotate,
                            run_rotate},
    [AST_OP_GRAM_EMA] = {"gram_ema", {REQ, NONE, NONE, OPT, OPT}, {S_NN1, 0, 0, S_NN, S_N1N1}, 0,
                         1, check_gram_ema, run_gram_ema},
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
