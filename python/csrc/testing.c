/*
 * testing.c - asteria._C_testing: the test-only entry points of libasteria (src/testing.h) for
 * the Python tests. Not API, and not part of asteria._C's namespace: a second module whose init
 * function lives in the same shared object as asteria._C, so it drives the one libasteria the
 * process has (runtimes made by _C) and ships in the wheel the tests run against, while the
 * package never loads it. Tests load it by name from asteria._C's file (tests/python/
 * job_delay.py, which benchmarks/common.py loads for the job stretch); nothing imports it as
 * asteria._C_testing.
 * May call: src/testing.h, the Python C API, and common.h (the Runtime object, _C's module
 * state for the error mapping).
 */
#include "common.h"
#include "testing.h"

/* obj's runtime, for an asteria._C.Runtime of this shared object; NULL with TypeError raised
 * for anything else, AST_ESHUTDOWN for a closed one. *st receives that _C instance's state. */
static ast_runtime *runtime_of(PyObject *obj, mod_state **st)
{
    PyTypeObject *tp = Py_TYPE(obj);
    PyObject *owner = NULL;
    if (PyType_HasFeature(tp, Py_TPFLAGS_HEAPTYPE)) {
        owner = PyType_GetModule(tp);
        if (!owner)
            PyErr_Clear();
    }
    *st = owner && PyModule_GetDef(owner) == &asteria_module_def ? PyModule_GetState(owner)
                                                                  : NULL;
    if (!*st || (*st)->runtime_type != tp) {
        raise_wrong_type("runtime must be an asteria._C.Runtime", obj);
        return NULL;
    }
    RuntimeObject *self = (RuntimeObject *)obj;
    if (guard_open(&self->g, self->rt != NULL, *st, "runtime") < 0)
        return NULL;
    return self->rt;
}

static PyObject *set_job_delay(PyObject *m, PyObject *args)
{
    PyObject *obj;
    int delay_ms;
    mod_state *st;
    if (!PyArg_ParseTuple(args, "Oi:set_job_delay", &obj, &delay_ms))
        return NULL;
    ast_runtime *rt = runtime_of(obj, &st);
    if (!rt)
        return NULL;
    int rc = ast__runtime_set_job_delay(rt, delay_ms);
    if (rc < 0) {
        char msg[96];
        snprintf(msg, sizeof msg, "set_job_delay: delay_ms %d; allowed: 0..%d", delay_ms,
                 AST__JOB_DELAY_MAX_MS);
        return raise_ast_error(st, rc, msg);
    }
    Py_RETURN_NONE;
}

/* The op mask of ops: None or an empty sequence -> 0 (every op); a sequence of op names ->
 * their 1 << code bits. -1 with ValueError / TypeError naming the allowed names. */
static long long op_mask(PyObject *ops)
{
    if (ops == Py_None)
        return 0;
    Py_ssize_t len = PyUnicode_Check(ops) ? -1 : PySequence_Size(ops);
    if (len < 0) {
        PyErr_Clear();
        PyErr_SetString(PyExc_TypeError, "set_job_stretch: ops must be None or a sequence of "
                                         "op names");
        return -1;
    }
    long long mask = 0;
    for (Py_ssize_t i = 0; i < len; i++) {
        PyObject *item = PySequence_GetItem(ops, i);
        if (!item)
            return -1;
        const char *name = PyUnicode_Check(item) ? PyUnicode_AsUTF8AndSize(item, NULL) : NULL;
        int code = 0;
        for (int op = 1; name && op <= ast_op_count() && !code; op++)
            if (strcmp(name, ast_op_name(op)) == 0)
                code = op;
        if (!code) {
            char allowed[256] = "";
            for (int op = 1; op <= ast_op_count(); op++)
                snprintf(allowed + strlen(allowed), sizeof allowed - strlen(allowed), "%s%s",
                         op > 1 ? ", " : "", ast_op_name(op));
            PyErr_Clear();
            PyErr_Format(PyExc_ValueError, "set_job_stretch: ops[%zd] is %R; allowed: op names "
                         "(%s)", i, item, allowed);
            Py_DECREF(item);
            return -1;
        }
        Py_DECREF(item);
        mask |= 1ll << code;
    }
    return mask;
}

static PyObject *set_job_stretch(PyObject *m, PyObject *args)
{
    PyObject *obj, *ops = Py_None;
    double factor;
    mod_state *st;
    if (!PyArg_ParseTuple(args, "Od|O:set_job_stretch", &obj, &factor, &ops))
        return NULL;
    ast_runtime *rt = runtime_of(obj, &st);
    if (!rt)
        return NULL;
    long long mask = op_mask(ops);
    if (mask < 0)
        return NULL;
    int rc = ast__runtime_set_job_stretch(rt, factor, (unsigned)mask);
    if (rc < 0) {
        char msg[128];
        snprintf(msg, sizeof msg, "set_job_stretch: factor %g; allowed: a finite number in "
                 "1..%g", factor, AST__JOB_STRETCH_MAX);
        return raise_ast_error(st, rc, msg);
    }
    Py_RETURN_NONE;
}

static PyObject *job_stretch_totals(PyObject *m, PyObject *args)
{
    PyObject *obj;
    mod_state *st;
    if (!PyArg_ParseTuple(args, "O:job_stretch_totals", &obj))
        return NULL;
    ast_runtime *rt = runtime_of(obj, &st);
    if (!rt)
        return NULL;
    uint64_t compute_ns, slept_ns;
    ast__runtime_job_stretch_totals(rt, &compute_ns, &slept_ns);
    return Py_BuildValue("(KK)", (unsigned long long)compute_ns, (unsigned long long)slept_ns);
}

static PyMethodDef testing_methods[] = {
    {"set_job_delay", set_job_delay, METH_VARARGS,
     PyDoc_STR("set_job_delay(runtime, delay_ms)\n--\n\nEvery job submitted to runtime (an "
               "asteria._C.Runtime) afterwards sleeps delay_ms (0..600000) on its worker before "
               "computing: a slow rank, a job kept running across a fork or a signal.")},
    {"set_job_stretch", set_job_stretch, METH_VARARGS,
     PyDoc_STR("set_job_stretch(runtime, factor, ops=None)\n--\n\nEvery job of an op named in "
               "ops (None: every op) submitted to runtime (an asteria._C.Runtime) afterwards "
               "holds its worker factor (1..1000) times as long as it computed, sleeping "
               "(factor - 1) x its compute before it is done: a host 1/factor as fast. 1: no "
               "stretch.")},
    {"job_stretch_totals", job_stretch_totals, METH_VARARGS,
     PyDoc_STR("job_stretch_totals(runtime)\n--\n\n(compute_ns, slept_ns): the stretched jobs' "
               "computes and the sleeps that stretched them, summed since runtime was made.")},
    {NULL, NULL, 0, NULL},
};

static PyModuleDef_Slot testing_slots[] = {
#if PY_VERSION_HEX >= 0x030C0000
    {Py_mod_multiple_interpreters, Py_MOD_PER_INTERPRETER_GIL_SUPPORTED},
#endif
    {0, NULL},
};

static struct PyModuleDef testing_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "asteria._C_testing",
    .m_doc = "TEST ONLY, not API: libasteria's test hooks (src/testing.h) for asteria._C's "
             "objects.",
    .m_size = 0,
    .m_methods = testing_methods,
    .m_slots = testing_slots,
};

PyMODINIT_FUNC PyInit__C_testing(void);

PyMODINIT_FUNC PyInit__C_testing(void) { return PyModuleDef_Init(&testing_module); }
