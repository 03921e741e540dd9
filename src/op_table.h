/*
 * op_table.h - the REFRESH op table: one row per ast_op holding all of the op, its name, its
 * properties (does it take the previous basis, does it update its outputs in place, which
 * pointers it takes and the shape each spans), the checks of its arguments and its kernel; and
 * the arguments every kernel takes (ast__op_args). Internal (the ast__ prefix; not installed,
 * not in asteria.map); ast_op_info_get (runtime.h) hands the properties out, so the extension
 * and the Python executors read them from here.
 *
 * Implemented by op_table.c. runtime.c reads it to validate a request (ast_runtime_submit); the
 * dispatch (op_run.h) runs a row, for a pool worker and for the direct API (asteria/linalg.h,
 * linalg.c) alike. Every span is derived from the row's shapes, and code that depends on a
 * property reads the field, never the op's code. A new op is a kernel, a row and a wrapper: its
 * ast_op value in include/asteria/runtime.h; its kernel in src/linalg_kernels.c; its row (with
 * its checks) in src/op_table.c; its direct entry points in src/linalg.c (declared in
 * include/asteria/linalg.h, listed in src/asteria.map); its Python entry (reference, FLOPs) in
 * python/asteria/refresh/ops.py. runtime.c, op_run.c and the extension do not change.
 *
 * The table is constant: any thread may read it, with no lock.
 */
#ifndef ASTERIA_OP_TABLE_H
#define ASTERIA_OP_TABLE_H

#include "asteria/runtime.h"

#include <stddef.h>

/* A request's pointers, in the order ast_runtime_submit checks them (ast_op_info's order). */
enum { AST__ARG_IN0, AST__ARG_IN1, AST__ARG_IN2, AST__ARG_OUT0, AST__ARG_OUT1, AST__ARG_COUNT };
_Static_assert(AST__ARG_COUNT == AST_OP_ARGS, "ast_op_info's arrays are one per pointer");

/* What an op lets one pointer of a request be (ast_arg_need). */
enum { AST__ARG_NONE = AST_ARG_NONE, AST__ARG_OPTIONAL = AST_ARG_OPTIONAL,
       AST__ARG_REQUIRED = AST_ARG_REQUIRED };

/* One call of an op: a request's pointers and scalars (ast_refresh, runtime.h, gives their
 * meaning per op), for the whole batch or, handed to a kernel, for one block. */
typedef struct ast__op_args {
    int n;
    int n1;            /* soap_rotate: columns of X; gram_ema: columns of G */
    const void *in0;   /* F; X (soap_rotate); G (gram_ema) */
    const void *in1;   /* Q (refreshes); A pair (soap_rotate, may be NULL) */
    const void *in2;   /* B pair (soap_rotate, may be NULL) */
    void *out0;        /* Q (eigh, may be NULL), X (roots), Q_new (refreshes), L (gram_ema, may
                        * be NULL), out (soap_rotate) */
    void *out1;        /* w (eigh, may be NULL), perm (soap_qr, int64), R (gram_ema, may be
                        * NULL) */
    double p, eps;     /* roots: p (newton_root: an integer), eps; gram_ema: beta, alpha */
    int max_iter;      /* newton_root: its iteration limits */
    double tol;
} ast__op_args;

/* The typed primitives of one dtype (linalg_prim.h). */
typedef struct ast__kern ast__kern;

typedef struct ast__op {
    const char *name;                    /* ast_op_name's answer */
    unsigned char args[AST__ARG_COUNT];  /* per pointer: AST__ARG_NONE (must be NULL), _OPTIONAL,
                                          * _REQUIRED */
    unsigned char shape[AST__ARG_COUNT]; /* per pointer: ast_shape, what it spans per batch entry */
    unsigned char takes_basis;           /* in1 is the previous basis, of F's shape */
    unsigned char in_place;              /* out0 / out1 are read and updated in place: every
                                          * block's inputs are checked before any block runs, and
                                          * there is no float64 retry (op_run.c) */
    /* Checks a request's own arguments (p, n1, which pairs), with the reason in words; bytes[]
     * holds each pointer's span, derived from shape[] (NULL: the op has no such checks).
     * Called by ast__op_check only, after the request-wide checks. Returns 0; AST_EINVAL with
     * the reason in msg (len bytes, truncated). */
    int (*check)(const ast_refresh *req, size_t bytes[AST__ARG_COUNT], char *msg, size_t len);
    /* Checks a call's arguments before it runs (every call, a pool job's and a direct one's),
     * after the dispatch's common checks (dtype, n >= 1, batch >= 0, in0, each span addressable);
     * count[] holds each given pointer's elements per block (0 for a NULL one). Returns 0 or
     * AST_EINVAL. */
    int (*validate)(const ast__op_args *o, const size_t count[AST__ARG_COUNT], int batch,
                    const ast__kern *K);
    /* Computes one block (linalg_kernels.h). */
    int (*kernel)(const ast__kern *K, const ast__op_args *o);
} ast__op;

/* Returns op's row, or NULL for a code that names no op. */
const ast__op *ast__op_get(int op);

/* Checks everything about req but where its pointers point: dtype, n, batch, that the buffer
 * sizes fit a size_t, the op, then the op's own check. Returns 0 with *op set to the row and
 * bytes[] to each pointer's span (0: the op takes no such pointer); AST_EINVAL with the reason
 * in msg (len bytes, truncated; ast_runtime_submit prefixes "submit: "). */
int ast__op_check(const ast_refresh *req, const ast__op **op, size_t bytes[AST__ARG_COUNT],
                  char *msg, size_t len);

/* Returns the call req asks of op (req->op's row): its pointers (but an in1 or in2 the kernel
 * does not read: only a basis-taking op reads in1, only a rectangular one, whose in0 is n x n1,
 * its side operands in1 and in2), its scalars and the iteration limits of a pool job
 * (newton_root's). */
ast__op_args ast__op_args_of(const ast__op *op, const ast_refresh *req);

/* Sets count[i] to the elements per batch entry of each pointer op takes (from its shape, for
 * sizes n and n1; 0 for the others). Returns 0 if batch entries of each span a size_t at most
 * (elements of es bytes, int64 ones for AST_SHAPE_PERM); -1 otherwise. */
int ast__op_counts(const ast__op *op, size_t batch, size_t n, size_t n1, size_t es,
                   size_t count[AST__ARG_COUNT]);

/* Writes "name (code), ..." into buf (len bytes, truncated) for every op (arg < 0) or for the ops
 * that take pointer arg (AST__ARG_*). Returns how many ops were listed. */
int ast__op_list(char *buf, size_t len, int arg);

#endif
