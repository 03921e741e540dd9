/*
 * op_run.c - the dispatch of the REFRESH ops (op_run.h): one row of the op table run on a batch,
 * with the checks, the input NaN/Inf check, the float32 -> float64 retry and the batching that
 * every op shares; and the thread's "retried" flag (ast_linalg_last_retried).
 *
 * Owns: nothing that outlives a call but a thread-local "retried" flag, so any number of
 * threads may call in concurrently with no locks. Knows no op: a block's buffers, their element
 * counts, in_place, the checks and the kernel all come from the row.
 *
 * May call: the op table (op_table.h: a row's spans; through the row, its checks and kernel)
 * and the typed primitives (linalg_prim.h: the dtype's table, the NaN/Inf scan, OpenBLAS's
 * thread count through ast_linalg_init).
 *
 * In-place ops (gram_ema: L and R are both read and written) cannot be retried, since the
 * kernel has overwritten what a retry would read, and need none: once the inputs are finite they
 * cannot fail. For them every block's inputs are checked before any block runs, so a failure
 * leaves every block as it was.
 */
#include "op_run.h"

#include "asteria/errors.h"
#include "linalg_prim.h"

#include <float.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

static _Thread_local int tl_retried;

int ast_linalg_last_retried(void) { return tl_retried; }

/* The size of one element of pointer i of op in a call of dtype size es. */
static size_t elem_size(const ast__op *op, int i, size_t es)
{
    return op->shape[i] == AST_SHAPE_PERM ? sizeof(int64_t) : es;
}

/* A call's pointers, in the order of the row's args and shape (in0, in1, in2, out0, out1). */
static void ptrs_of(const ast__op_args *o, void *p[AST__ARG_COUNT])
{
    p[AST__ARG_IN0] = (void *)o->in0;
    p[AST__ARG_IN1] = (void *)o->in1;
    p[AST__ARG_IN2] = (void *)o->in2;
    p[AST__ARG_OUT0] = o->out0;
    p[AST__ARG_OUT1] = o->out1;
}

/* o with its pointers replaced by p's. */
static ast__op_args with_ptrs(const ast__op_args *o, void *const p[AST__ARG_COUNT])
{
    ast__op_args r = *o;
    r.in0 = p[AST__ARG_IN0];
    r.in1 = p[AST__ARG_IN1];
    r.in2 = p[AST__ARG_IN2];
    r.out0 = p[AST__ARG_OUT0];
    r.out1 = p[AST__ARG_OUT1];
    return r;
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

/* One float32 block again in float64: its inputs widened, its outputs (a permutation as it is)
 * in float64 workspace, rounded back once all fit. Never for an in-place op (run_block), whose
 * outputs are also inputs. */
static int retry_f64(const ast__op *op, const ast__op_args *o, const size_t count[AST__ARG_COUNT])
{
    void *p[AST__ARG_COUNT], *d[AST__ARG_COUNT] = {NULL};
    ptrs_of(o, p);
    int rc = 0;
    for (int i = 0; i < AST__ARG_COUNT && !rc; i++) {
        if (!p[i])
            continue;
        if (i < AST__ARG_OUT0)
            d[i] = to_f64(count[i], p[i]);
        else
            d[i] = malloc(count[i] * elem_size(op, i, sizeof(double)));
        if (!d[i])
            rc = AST_ENOMEM;
    }
    if (rc == 0) {
        const ast__op_args w = with_ptrs(o, d);
        rc = op->kernel(ast__kern_for(AST_F64), &w);
    }
    /* Check everything before writing anything, so a failure leaves every output untouched. */
    for (int i = AST__ARG_OUT0; i < AST__ARG_COUNT && rc == 0; i++)
        if (d[i] && op->shape[i] != AST_SHAPE_PERM && !fits_f32(count[i], d[i]))
            rc = AST_ENONFINITE;
    for (int i = AST__ARG_OUT0; i < AST__ARG_COUNT && rc == 0; i++) {
        if (!d[i])
            continue;
        if (op->shape[i] == AST_SHAPE_PERM)
            memcpy(p[i], d[i], count[i] * sizeof(int64_t));
        else
            to_f32(count[i], d[i], p[i]);
    }
    for (int i = 0; i < AST__ARG_COUNT; i++)
        free(d[i]);
    return rc;
}

static int inputs_finite(const ast__kern *K, const ast__op_args *o,
                         const size_t count[AST__ARG_COUNT])
{
    return K->finite(count[AST__ARG_IN0], o->in0) &&
           (!o->in1 || K->finite(count[AST__ARG_IN1], o->in1)) &&
           (!o->in2 || K->finite(count[AST__ARG_IN2], o->in2));
}

/* One block. An in-place op's inputs were all checked by ast__op_run already, and it has no
 * retry. */
static int run_block(const ast__op *op, const ast__kern *K, ast_dtype dt, const ast__op_args *o,
                     const size_t count[AST__ARG_COUNT])
{
    if (op->in_place)
        return op->kernel(K, o);
    if (!inputs_finite(K, o, count))
        return AST_ENONFINITE; /* bad input: a float64 retry could not help */
    int rc = op->kernel(K, o);
    if (dt == AST_F32 && (rc == AST_ENOCONV || rc == AST_ENONFINITE)) {
        tl_retried = 1;
        rc = retry_f64(op, o, count);
    }
    return rc;
}

/* Block b of a batched call's arguments. */
static ast__op_args block_of(const ast__op *op, const ast__op_args *o,
                             const size_t count[AST__ARG_COUNT], size_t es, int b)
{
    void *p[AST__ARG_COUNT];
    ptrs_of(o, p);
    for (int i = 0; i < AST__ARG_COUNT; i++)
        if (p[i])
            p[i] = (char *)p[i] + (size_t)b * count[i] * elem_size(op, i, es);
    return with_ptrs(o, p);
}

/* The common checks, and count[] (elements per block of each given pointer, 0 for a NULL one)
 * for the row's. Returns 0 or AST_EINVAL. */
static int check_call(const ast__op *op, const ast__kern *K, const ast__op_args *o, int batch,
                      size_t count[AST__ARG_COUNT])
{
    if (!op || !K || o->n < 1 || batch < 0 || !o->in0)
        return AST_EINVAL;
    if (ast__op_counts(op, (size_t)batch, (size_t)o->n, o->n1 > 0 ? (size_t)o->n1 : 0, K->es,
                       count))
        return AST_EINVAL;
    void *p[AST__ARG_COUNT];
    ptrs_of(o, p);
    for (int i = 0; i < AST__ARG_COUNT; i++)
        if (!p[i])
            count[i] = 0;
    return op->validate(o, count, batch, K);
}

int ast__op_run(const ast__op *op, ast_dtype dt, const ast__op_args *o, int batch,
                int *failed_index)
{
    const ast__kern *K = ast__kern_for(dt);
    size_t count[AST__ARG_COUNT];
    tl_retried = 0;
    if (failed_index)
        *failed_index = 0;
    int rc = check_call(op, K, o, batch, count);
    if (rc != 0)
        return rc;
    ast_linalg_init();

    for (int b = 0; op->in_place && b < batch; b++) {
        const ast__op_args blk = block_of(op, o, count, K->es, b);
        if (!inputs_finite(K, &blk, count)) {
            if (failed_index)
                *failed_index = b;
            return AST_ENONFINITE;
        }
    }
    for (int b = 0; b < batch; b++) {
        const ast__op_args blk = block_of(op, o, count, K->es, b);
        rc = run_block(op, K, dt, &blk, count);
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
