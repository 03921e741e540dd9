/*
 * op_table.h - the REFRESH op table: per ast_op its name, its properties (does it take the
 * previous basis, does it update its outputs in place, which pointers it takes and the shape
 * each spans), the checks of a request's own arguments and the function that runs it.
 * Internal (the ast__ prefix; not installed, not in asteria.map); ast_op_info_get (runtime.h)
 * hands the properties out, so the extension and the Python executors read them from here.
 *
 * Implemented by op_table.c. runtime.c reads it to validate a request (ast_runtime_submit) and
 * to run it (pool workers); linalg.c reads each op's shapes and in_place to split a batched call
 * into blocks. Every span is derived from the entry's shapes, and code that depends on a
 * property reads the field, never the op's code. A new op: its ast_op value in
 * include/asteria/runtime.h; its kernel, argument checks and direct entry points in src/linalg.c
 * (declared in include/asteria/linalg.h, listed in src/asteria.map); its entry in src/op_table.c;
 * its Python entry (reference, FLOPs) in python/asteria/refresh/ops.py. runtime.c and the
 * extension do not change.
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

typedef struct ast__op {
    const char *name;                    /* ast_op_name's answer */
    unsigned char args[AST__ARG_COUNT];  /* per pointer: AST__ARG_NONE (must be NULL), _OPTIONAL,
                                          * _REQUIRED */
    unsigned char shape[AST__ARG_COUNT]; /* per pointer: ast_shape, what it spans per batch entry */
    unsigned char takes_basis;           /* in1 is the previous basis, of F's shape */
    unsigned char in_place;              /* out0 / out1 are read and updated in place: every
                                          * block's inputs are checked before any block runs, and
                                          * there is no float64 retry (linalg.c) */
    /* Checks the op's own arguments of req (p, n1, which pairs); bytes[] holds each pointer's
     * span, derived from shape[] (NULL: the op has no checks of its own). Called by
     * ast__op_check only, after the request-wide checks. Returns 0; AST_EINVAL with the reason
     * in msg (len bytes, truncated). */
    int (*check)(const ast_refresh *req, size_t bytes[AST__ARG_COUNT], char *msg, size_t len);
    /* Runs a checked request's batch on the calling thread. Returns 0 or the kernel's AST_E*
     * code; *failed_index is -1 on success, else the failing block. */
    int (*run)(const ast_refresh *req, int *failed_index);
} ast__op;

/* Returns op's entry, or NULL for a code that names no op. */
const ast__op *ast__op_get(int op);

/* Checks everything about req but where its pointers point: dtype, n, batch, that the buffer
 * sizes fit a size_t, the op, then the op's own check. Returns 0 with *op set to the entry and
 * bytes[] to each pointer's span (0: the op takes no such pointer); AST_EINVAL with the reason
 * in msg (len bytes, truncated; ast_runtime_submit prefixes "submit: "). */
int ast__op_check(const ast_refresh *req, const ast__op **op, size_t bytes[AST__ARG_COUNT],
                  char *msg, size_t len);

/* Writes "name (code), ..." into buf (len bytes, truncated) for every op (arg < 0) or for the ops
 * that take pointer arg (AST__ARG_*). Returns how many ops were listed. */
int ast__op_list(char *buf, size_t len, int arg);

/* Returns the elements of one batch entry of a buffer of shape (ast_shape) for sizes n, n1;
 * 0 for AST_SHAPE_NONE. */
size_t ast__shape_elems(int shape, size_t n, size_t n1);

/* Returns 1 if the byte spans [a, a + alen) and [b, b + blen) share a byte, else 0. */
int ast__overlaps(const void *a, size_t alen, const void *b, size_t blen);

#endif
