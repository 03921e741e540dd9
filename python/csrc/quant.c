/*
 * quant.c - asteria._C's functions over libasteria's quantized bases (asteria/quant.h):
 * quant_layout, quant_quantize, quant_dequantize, quant_rectify, and the constants
 * QUANT_BLOCK_DEFAULT, QUANT_BLOCK_MAX, QUANT_MAX_STEPS. Module functions, no type: the kernels
 * keep no state.
 *
 * Buffers come through the buffer protocol (a CPU tensor's .numpy(), a bytearray, a
 * memoryview), C-contiguous; their byte lengths give the counts, which libasteria checks
 * against the format (a wrong size is ValueError naming the argument). A float32 (bfloat16)
 * buffer must be 4- (2-) byte aligned. The GIL is released around each kernel; the buffers
 * stay exported (held) meanwhile, and the failure's message is read on the same thread
 * (ast_quant_last_error is per thread).
 * May call: asteria/quant.h, the Python C API, common.h (the error mapping).
 */
#include "common.h"

#include "asteria/quant.h"

#include <limits.h>

static int parse_qtype(PyObject *o, ast_qtype *out)
{
    const char *s = PyUnicode_Check(o) ? utf8_no_nul(o, "qtype") : NULL;
    if (!s) {
        if (!PyErr_Occurred())
            raise_wrong_type("qtype must be a str ('int8' or 'int4')", o);
        return -1;
    }
    if (ast_qtype_parse(s, out) != 0 || *out == AST_QTYPE_NONE) {
        PyErr_Format(PyExc_ValueError, "unknown qtype %R; allowed: 'int8', 'int4'", o);
        return -1;
    }
    return 0;
}

static PyObject *raise_quant(PyObject *m, int rc)
{
    char msg[256];
    ast_quant_last_error(msg, sizeof msg);
    return raise_ast_error(PyModule_GetState(m), rc, msg);
}

/* len bytes of values of size es at buf: 0 with *count, or -1 with ValueError naming what. */
static int values_of(const Py_buffer *b, size_t es, const char *what, size_t *count)
{
    if ((size_t)b->len % es) {
        PyErr_Format(PyExc_ValueError, "%s: %zd bytes is not a whole number of %zu-byte values",
                     what, b->len, es);
        return -1;
    }
    if ((uintptr_t)b->buf % es) {
        PyErr_Format(PyExc_ValueError, "%s is not %zu-byte aligned", what, es);
        return -1;
    }
    *count = (size_t)b->len / es;
    return 0;
}

static size_t as_block(PyObject *o, int *bad)
{
    size_t v = o ? PyLong_AsSize_t(o) : AST_QUANT_BLOCK_DEFAULT;
    *bad = v == (size_t)-1 && PyErr_Occurred();
    return v;
}

/* The kernels convert runs: in's bytes into out's, count values of the format (t, block). */
typedef int (*convert_fn)(ast_qtype t, size_t count, size_t block, const Py_buffer *in,
                          const Py_buffer *out);

static int do_quantize(ast_qtype t, size_t count, size_t block, const Py_buffer *in,
                       const Py_buffer *out)
{
    return ast_quant_quantize(t, count, block, in->buf, out->buf, (size_t)out->len);
}

static int do_dequantize(ast_qtype t, size_t count, size_t block, const Py_buffer *in,
                         const Py_buffer *out)
{
    return ast_quant_dequantize(t, count, block, in->buf, (size_t)in->len, out->buf);
}

static int do_dequantize_bf16(ast_qtype t, size_t count, size_t block, const Py_buffer *in,
                              const Py_buffer *out)
{
    return ast_quant_dequantize_bf16(t, count, block, in->buf, (size_t)in->len, out->buf);
}

/* The body of quant_quantize and quant_dequantize once their arguments are parsed: the block
 * (bo, or the default) and the qtype (qo) checked, the count taken from counted (values of es
 * bytes, named what in an error), then fn with the GIL released. Releases in and out (counted
 * is one of them); None, or NULL with the exception raised. */
static PyObject *convert(PyObject *m, PyObject *qo, PyObject *bo, Py_buffer *in, Py_buffer *out,
                         const Py_buffer *counted, size_t es, const char *what, convert_fn fn)
{
    PyObject *res = NULL;
    ast_qtype t;
    size_t count;
    int bad, rc;
    size_t block = as_block(bo, &bad);
    if (bad || parse_qtype(qo, &t) < 0 || values_of(counted, es, what, &count) < 0)
        goto done;
    Py_BEGIN_ALLOW_THREADS
    rc = fn(t, count, block, in, out);
    Py_END_ALLOW_THREADS
    res = rc ? raise_quant(m, rc) : Py_NewRef(Py_None);
done:
    PyBuffer_Release(in);
    PyBuffer_Release(out);
    return res;
}

PyDoc_STRVAR(quant_layout_doc,
             "quant_layout(qtype, count, block=64)\n--\n\nThe quantized form of count float32 "
             "values in blocks of block: {'count', 'block', 'nblocks', 'value_bytes', "
             "'scales_offset', 'nbytes'} (asteria/quant.h: the codes, zeros up to "
             "scales_offset, then nblocks float32 scales).");

static PyObject *quant_layout(PyObject *m, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"qtype", "count", "block", NULL};
    PyObject *qo, *bo = NULL;
    size_t count;
    ast_qtype t;
    int bad;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OO&|O:quant_layout", kwlist, &qo, conv_size,
                                     &count, &bo) ||
        parse_qtype(qo, &t) < 0)
        return NULL;
    size_t block = as_block(bo, &bad);
    if (bad)
        return NULL;
    ast_quant_layout l;
    int rc = ast_quant_layout_get(t, count, block, &l);
    if (rc)
        return raise_quant(m, rc);
    return Py_BuildValue("{s:n,s:n,s:n,s:n,s:n,s:n}", "count", (Py_ssize_t)l.count, "block",
                         (Py_ssize_t)l.block, "nblocks", (Py_ssize_t)l.nblocks, "value_bytes",
                         (Py_ssize_t)l.value_bytes, "scales_offset", (Py_ssize_t)l.scales_offset,
                         "nbytes", (Py_ssize_t)l.nbytes);
}

PyDoc_STRVAR(quant_quantize_doc,
             "quant_quantize(qtype, x, out, block=64)\n--\n\nQuantize the float32 values of x "
             "(a C-contiguous buffer) into out (writable, exactly quant_layout(...)['nbytes'] "
             "bytes). ValueError for a bad argument, AsteriaError (AST_ENONFINITE) for NaN or "
             "Inf in x (out untouched).");

static PyObject *quant_quantize(PyObject *m, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"qtype", "x", "out", "block", NULL};
    PyObject *qo, *bo = NULL;
    Py_buffer x, out;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "Oy*w*|O:quant_quantize", kwlist, &qo, &x, &out,
                                     &bo))
        return NULL;
    return convert(m, qo, bo, &x, &out, &x, 4, "x", do_quantize);
}

PyDoc_STRVAR(quant_dequantize_doc,
             "quant_dequantize(qtype, q, out, block=64, bfloat16=False)\n--\n\nWiden the "
             "quantized form q into out: float32 values, or bfloat16 ones (2 bytes each, e.g. "
             "tensor.view(torch.int16).numpy()) with bfloat16=True; out's size gives the count, "
             "q must be exactly that count's form. ValueError for a bad argument (a scale "
             "negative or not finite included: out untouched).");

static PyObject *quant_dequantize(PyObject *m, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"qtype", "q", "out", "block", "bfloat16", NULL};
    PyObject *qo, *bo = NULL;
    Py_buffer q, out;
    int bf16 = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "Oy*w*|Op:quant_dequantize", kwlist, &qo, &q,
                                     &out, &bo, &bf16))
        return NULL;
    return convert(m, qo, bo, &q, &out, &out, bf16 ? 2 : 4, "out",
                   bf16 ? do_dequantize_bf16 : do_dequantize);
}

PyDoc_STRVAR(quant_rectify_doc,
             "quant_rectify(v, n, steps)\n--\n\nsteps Bjorck steps V <- 1.5 V - 0.5 V (V^T V) "
             "in place on each n x n float32 matrix of v (a writable C-contiguous buffer of a "
             "whole number of them). Returns ||V^T V - I||_F of each matrix before each step and "
             "after the last: a list of batch lists of steps + 1 floats (steps 0: measure only). "
             "ValueError for a bad argument, AsteriaError (AST_ENONFINITE) for NaN or Inf in a "
             "matrix or a step's result (that matrix and those after it untouched).");

static PyObject *quant_rectify(PyObject *m, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"v", "n", "steps", NULL};
    PyObject *res = NULL;
    Py_buffer v;
    int n, steps, rc;
    size_t count;
    double *err = NULL;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "w*ii:quant_rectify", kwlist, &v, &n, &steps))
        return NULL;
    if (values_of(&v, 4, "v", &count) < 0)
        goto done;
    if (n < 1 || count % ((size_t)n * (size_t)n) || count / ((size_t)n * n) > INT_MAX) {
        PyErr_Format(PyExc_ValueError, "v: %zu float32 values are not a whole number of %d x %d "
                     "matrices", count, n, n);
        goto done;
    }
    if (steps < 0 || steps > AST_QUANT_MAX_STEPS) {
        PyErr_Format(PyExc_ValueError, "steps %d; allowed: 0..%d", steps, AST_QUANT_MAX_STEPS);
        goto done;
    }
    int batch = (int)(count / ((size_t)n * n));
    err = malloc(((size_t)batch * (size_t)(steps + 1) + 1) * sizeof *err);
    if (!err) {
        PyErr_NoMemory();
        goto done;
    }
    Py_BEGIN_ALLOW_THREADS
    rc = ast_quant_rectify(batch, n, v.buf, steps, err);
    Py_END_ALLOW_THREADS
    if (rc) {
        raise_quant(m, rc);
        goto done;
    }
    res = PyList_New(batch);
    for (int i = 0; res && i < batch; i++) {
        PyObject *row = PyList_New(steps + 1);
        for (int k = 0; row && k <= steps; k++) {
            PyObject *f = PyFloat_FromDouble(err[(size_t)i * (size_t)(steps + 1) + (size_t)k]);
            if (!f || PyList_SetItem(row, k, f) < 0)
                Py_CLEAR(row);
        }
        if (!row || PyList_SetItem(res, i, row) < 0)
            Py_CLEAR(res);
    }
done:
    free(err);
    PyBuffer_Release(&v);
    return res;
}

static PyMethodDef quant_methods[] = {
    {"quant_layout", (PyCFunction)(void (*)(void))quant_layout, METH_VARARGS | METH_KEYWORDS,
     quant_layout_doc},
    {"quant_quantize", (PyCFunction)(void (*)(void))quant_quantize, METH_VARARGS | METH_KEYWORDS,
     quant_quantize_doc},
    {"quant_dequantize", (PyCFunction)(void (*)(void))quant_dequantize,
     METH_VARARGS | METH_KEYWORDS, quant_dequantize_doc},
    {"quant_rectify", (PyCFunction)(void (*)(void))quant_rectify, METH_VARARGS | METH_KEYWORDS,
     quant_rectify_doc},
    {NULL, NULL, 0, NULL},
};

int quant_module_add(PyObject *m)
{
    if (PyModule_AddFunctions(m, quant_methods) < 0 ||
        PyModule_AddIntConstant(m, "QUANT_BLOCK_DEFAULT", AST_QUANT_BLOCK_DEFAULT) < 0 ||
        PyModule_AddIntConstant(m, "QUANT_BLOCK_MAX", AST_QUANT_BLOCK_MAX) < 0 ||
        PyModule_AddIntConstant(m, "QUANT_MAX_STEPS", AST_QUANT_MAX_STEPS) < 0)
        return -1;
    return 0;
}
