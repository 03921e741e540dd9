/*
 * op_table.h - the REFRESH op table: per ast_op its name, the checks of a request's arguments
 * and the function that runs it. Internal (the ast__ prefix; not installed, not in asteria.map).
 *
 * Owned by linalg.c, which keeps each op's entry next to its kernel. runtime.c reads it to
 * validate a request (ast_runtime_submit) and to run it (pool workers); ast_op_name and
 * ast_op_count (runtime.h) give its names to the extension. So a new op is its ast_op value in
 * include/asteria/runtime.h, its kernel and entry in src/linalg.c, and its Python entry in
 * python/asteria/refresh/ops.py; runtime.c and the extension do not change.
 *
 * The table is constant: any thread may read it, with no lock.
 */
#ifndef ASTERIA_OP_TABLE_H
#define ASTERIA_OP_TABLE_H

#include "asteria/runtime.h"

#include <stddef.h>

/* A request's pointers, in the order ast_runtime_submit checks them. */
enum { AST__ARG_IN0, AST__ARG_IN1, AST__ARG_IN2, AST__ARG_OUT0, AST__ARG_OUT1, AST__ARG_COUNT };

/* What an op lets one pointer of a request be. */
enum { AST__ARG_NONE, AST__ARG_OPTIONAL, AST__ARG_REQUIRED };

typedef struct ast__op {
    const char *name;                   /* ast_op_name's answer */
    unsigned char args[AST__ARG_COUNT]; /* per pointer: AST__ARG_NONE (must be NULL), _OPTIONAL,
                                         * _REQUIRED */
    /* Checks the op's own arguments of req (p, n1, which pairs) and sets bytes[i] to the span of
     * each pointer the op takes (the others stay 0). Called by ast__op_check only, after the
     * request-wide checks. Returns 0; AST_EINVAL with the reason in msg (len bytes, truncated). */
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

#endif
