/*
 * testing.c - asteria._C_testing: the test-only entry points of libasteria (src/testing.h) for
 * the Python tests. Not API, and not part of asteria._C's namespace: a second module whose init
 * function lives in the same shared object as asteria._C, so it drives the one libasteria the
 * process has (runtimes made by _C) and ships in the wheel the tests run against, while the
 * package never loads it. Tests load it by name from asteria._C's file (tests/python/
 * job_delay.py); nothing imports it as asteria._C_testing.
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

static PyMethodDef testing_methods[] = {
    {"set_job_delay", set_job_delay, METH_VARARGS,
     PyDoc_STR("set_job_delay(runtime, delay_ms)\n--\n\nEvery job submitted to runtime (an "
               "asteria._C.Runtime) afterwards sleeps delay_ms (0..600000) on its worker before "
               "computing: a slow rank, a job kept running across a fork or a signal.")},
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
