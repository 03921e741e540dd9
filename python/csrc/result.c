/*
 * result.c - asteria._C.Result, the struct sequence of one job's completion (ast_result), which
 * Runtime.poll and Runtime.wait return.
 * May call: the Python C API and common.h. Holds no state: the type lives in module state.
 */
#include "common.h"

static PyStructSequence_Field result_fields[] = {
    {"ticket", "job ticket"},
    {"block", "caller's block key"},
    {"version", "block version"},
    {"snapshot_step", "step whose end state the inputs are"},
    {"status", "0 or a negative AST_E* code"},
    {"retried_f64", "the float32 job was retried in float64"},
    {"failed_index", "first failing block of the batch, -1 if none"},
    {"queued_ns", "CLOCK_MONOTONIC time the job was queued"},
    {"started_ns", "time it started (0 if it never ran)"},
    {"done_ns", "time it completed"},
    {"worker", "index of the worker that ran it, -1 if none"},
    {NULL, NULL},
};

PyStructSequence_Desc result_desc = {
    "asteria._C.Result",
    "Result(ticket, block, version, snapshot_step, status, retried_f64, failed_index, queued_ns,\n"
    "started_ns, done_ns, worker): the completion of one REFRESH job.",
    result_fields,
    11,
};

PyObject *make_result(mod_state *st, const ast_result *r)
{
    PyObject *t = PyStructSequence_New(st->result_type);
    if (!t)
        return NULL;
    PyObject *v[11] = {
        PyLong_FromUnsignedLongLong(r->ticket),  PyLong_FromUnsignedLongLong(r->block),
        PyLong_FromUnsignedLongLong(r->version), PyLong_FromLongLong(r->snapshot_step),
        PyLong_FromLong(r->status),              PyBool_FromLong(r->retried_f64),
        PyLong_FromLong(r->failed_index),        PyLong_FromUnsignedLongLong(r->queued_ns),
        PyLong_FromUnsignedLongLong(r->started_ns), PyLong_FromUnsignedLongLong(r->done_ns),
        PyLong_FromLong(r->worker),
    };
    int ok = 1;
    for (int i = 0; i < 11; i++) {
        if (!v[i])
            ok = 0;
        else
            PyStructSequence_SetItem(t, i, v[i]);
    }
    if (!ok) {
        Py_DECREF(t);
        return NULL;
    }
    return t;
}
