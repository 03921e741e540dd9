/*
 * op_run.h - the dispatch of the REFRESH ops: a row of the op table (op_table.h) run on a
 * batch. Internal (ast__ prefix; not installed, not in asteria.map).
 *
 * Implemented by op_run.c. The one path of every computation: a pool worker runs a request's
 * row (runtime.c), each direct entry point (asteria/linalg.h, linalg.c) its op's row. Any
 * number of threads may call in concurrently, with no lock.
 */
#ifndef ASTERIA_OP_RUN_H
#define ASTERIA_OP_RUN_H

#include "asteria/linalg.h"
#include "op_table.h"

/* Runs op on o's batch (batch blocks laid out contiguously, each pointer's block from op's
 * shapes) on the calling thread: checks the arguments (dtype, n >= 1, batch >= 0, in0, each
 * span addressable, then the row's validate), pins OpenBLAS (ast_linalg_init), then per block
 * checks the inputs finite and runs the kernel, a float32 block that fails numerically once more
 * in float64 (ast_linalg_last_retried). An in-place op has every block's inputs checked before
 * any block runs, and no retry. Returns 0 or the first failing block's AST_E* code (the codes
 * of asteria/linalg.h); *failed_index (may be NULL) is -1 on success, the failing block, or 0
 * when the arguments are rejected (nothing was written). */
int ast__op_run(const ast__op *op, ast_dtype dt, const ast__op_args *o, int batch,
                int *failed_index);

#endif
