/*
 * module.c - asteria._C: the CPython binding of libasteria's runtime (runtime.h, errors.h, trace
 * events through the runtime), block store (store.h), shadow copy engine (shadow.h),
 * coherence registry (coherence.h) and quantized-basis kernels (quant.h, csrc/quant.c).
 *
 * Owns: the Runtime, Config, Store, BlockBuffer, Shadow and Coherence heap types, the Result
 * struct-sequence type, the AsteriaError and BusyError exceptions and the one mapping from AST_E*
 * codes to Python exceptions (raise_ast_error). Types and exceptions live in module state
 * (multi-phase init), so the module may be instantiated more than once in a process.
 * May call: the public libasteria API and the Python C API. Nothing else.
 *
 * GIL and locking
 *  - The GIL is released around every libasteria call that computes, blocks, does I/O, copies
 *    or takes a library lock that another thread may hold for long: for Runtime create, submit,
 *    poll, wait, cancel, register, unregister, trace_write, destroy; for Store and Shadow every
 *    call that takes the store's or the shadow's mutex (a store move holds it across its whole
 *    batched I/O). Inside those regions only C locals are touched; their memory is on the stack
 *    or from malloc; strings are copied out of Python objects first. Coherence calls keep
 *    the GIL: the registry's lock is held only for a short, non-blocking table update. The
 *    calls on an open handle go through handle.c (handle_call, handle_try, handle_run), which
 *    also reads a failure's message before the GIL is taken back; Runtime.wait (its signal
 *    checks need the thread state), creates and destroys release it themselves.
 *  - A handle's destroy must not race with other calls on it. Each object has a `guard`: a
 *    call that runs with the GIL released is counted in guard.inflight (pthread mutex `lock`,
 *    condition `idle`); the count is raised while the GIL is held, after checking `closed`.
 *    close() sets `closed` with the GIL held, then (GIL released) waits for inflight == 0 and
 *    destroys. Calls that keep the GIL only check `closed`: a closer cannot be past that point
 *    while they hold the GIL.
 *  - Waits that can last (Runtime.wait: a job's whole computation) wake every SIGNAL_SLICE_NS
 *    (100 ms), take the GIL, run PyErr_CheckSignals() and release it again; an exception from a
 *    handler (KeyboardInterrupt) ends the wait with nothing of the job touched. The check runs
 *    with no library lock held (ast_runtime_wait_check) and inside the guard, like the wait.
 *  - Fork: the guards' atfork handlers (see guard_init) zero every guard's inflight count in a
 *    forked child, whose threads in those calls do not exist; so a child can close a handle
 *    another thread of the parent was using at the fork.
 *  - guard.lock is only ever held for a counter update or inside pthread_cond_wait, so taking
 *    it with the GIL held cannot deadlock. Library mutexes are never held by a thread that
 *    waits for the GIL (library code never calls back into Python).
 *  - Store block pins (exports, busy), Shadow tickets and Shadow view counts are plain C
 *    tables and counters touched only with the GIL held (a view's deleter takes it first);
 *    that is what makes "check, then release the GIL and act" safe against other Python
 *    threads (see StoreObject).
 */
#include "common.h"

/* ---- module functions ------------------------------------------------------------------------- */

static int arg_code(PyObject *arg, int *code)
{
    long v = PyLong_AsLong(arg);
    if (v == -1 && PyErr_Occurred())
        return -1;
    *code = v < INT32_MIN || v > INT32_MAX ? AST__ERR_MIN - 1 : (int)v;
    return 0;
}

static PyObject *mod_strerror(PyObject *m, PyObject *arg)
{
    int code;
    if (arg_code(arg, &code) < 0)
        return NULL;
    return PyUnicode_FromString(ast_strerror(code));
}

static PyObject *mod_err_name(PyObject *m, PyObject *arg)
{
    int code;
    if (arg_code(arg, &code) < 0)
        return NULL;
    return PyUnicode_FromString(ast_err_name(code));
}

static PyObject *mod_config_keys(PyObject *m, PyObject *unused)
{
    /* ast_config_keys() is "a, b, c". */
    PyObject *s = PyUnicode_FromString(ast_config_keys());
    if (!s)
        return NULL;
    PyObject *parts = PyUnicode_Split(s, NULL, -1);
    Py_DECREF(s);
    if (!parts)
        return NULL;
    PyObject *out = PyTuple_New(PyList_Size(parts));
    for (Py_ssize_t i = 0; out && i < PyList_Size(parts); i++) {
        PyObject *k = PyObject_CallMethod(PyList_GetItem(parts, i), "rstrip", "s", ",");
        if (!k)
            Py_CLEAR(out);
        else
            PyTuple_SetItem(out, i, k);
    }
    Py_DECREF(parts);
    return out;
}

static PyObject *mod_default_config(PyObject *m, PyObject *unused)
{
    ast_config cfg;
    ast_config_init(&cfg);
    return config_to_dict(&cfg);
}

/* The one check of the C keys (ast_config_set per key): a Config that Runtime() takes as is. */
static PyObject *mod_validate_config(PyObject *m, PyObject *config)
{
    return config_validate(PyModule_GetState(m), config);
}

static PyObject *mod_coherence_dim_cost(PyObject *m, PyObject *arg)
{
    uint64_t n;
    if (!conv_u64(arg, &n))
        return NULL;
    return PyLong_FromUnsignedLongLong(ast_coherence_dim_cost(n));
}

static PyObject *mod_raise_error(PyObject *m, PyObject *args)
{
    int code;
    const char *detail = NULL;
    if (!PyArg_ParseTuple(args, "i|z:raise_error", &code, &detail))
        return NULL;
    return raise_ast_error(PyModule_GetState(m), code, detail);
}

static const char *const SHAPE_NAMES[] = {NULL,  "nn",   "n",       "perm",
                                           "nn1", "n1n1", "pair_nn", "pair_n1n1"};
static const char *const ARG_NAMES[AST_OP_ARGS] = {"in0", "in1", "in2", "out0", "out1"};
static const char *const NEED_NAMES[] = {NULL, "optional", "required"};

/* {name: {"code", "takes_basis", "in_place", "operands": {slot: (need, shape)}}} from
 * libasteria's op table (ast_op_info_get): the one source of asteria.refresh.ops' fields. */
static PyObject *mod_ops(PyObject *m, PyObject *unused)
{
    (void)m, (void)unused;
    PyObject *out = PyDict_New();
    for (int op = 1; out && op <= ast_op_count(); op++) {
        ast_op_info info;
        if (ast_op_info_get(op, &info))
            continue;
        PyObject *operands = PyDict_New();
        for (int i = 0; operands && i < AST_OP_ARGS; i++) {
            if (info.need[i] == AST_ARG_NONE)
                continue;
            PyObject *v = Py_BuildValue("(ss)", NEED_NAMES[info.need[i]],
                                        SHAPE_NAMES[info.shape[i]]);
            if (dict_set_steal(operands, ARG_NAMES[i], v) < 0)
                Py_CLEAR(operands);
        }
        PyObject *entry = operands ? Py_BuildValue("{s:i,s:O,s:O,s:N}", "code", op, "takes_basis",
                                                   info.takes_basis ? Py_True : Py_False,
                                                   "in_place", info.in_place ? Py_True : Py_False,
                                                   "operands", operands)
                                   : NULL;
        if (dict_set_steal(out, info.name, entry) < 0)
            Py_CLEAR(out);
    }
    return out;
}

/* libasteria's tier names (ast_tier_listed, ast_tier_name), in the order tiers are listed to
 * users: the one source of asteria.config.TIERS. */
static PyObject *mod_tiers(PyObject *m, PyObject *unused)
{
    (void)m, (void)unused;
    PyObject *out = PyTuple_New(AST_TIER_COUNT);
    for (int i = 0; out && i < AST_TIER_COUNT; i++) {
        PyObject *name = PyUnicode_FromString(ast_tier_name(ast_tier_listed(i)));
        if (!name || PyTuple_SetItem(out, i, name) < 0) /* steals name, even on failure */
            Py_CLEAR(out);
    }
    return out;
}

static PyMethodDef mod_methods[] = {
    {"ops", mod_ops, METH_NOARGS,
     PyDoc_STR("ops()\n--\n\nlibasteria's REFRESH op table: {name: {'code', 'takes_basis', "
               "'in_place', 'operands': {slot: (need, shape)}}}, slot one of in0, in1, in2, "
               "out0, out1 (the ones the op takes), need 'optional' or 'required', shape one of "
               "nn, n, perm, nn1, n1n1, pair_nn, pair_n1n1 (per batch entry).")},
    {"tiers", mod_tiers, METH_NOARGS,
     PyDoc_STR("tiers()\n--\n\nlibasteria's memory tiers (Store's), as a tuple of names in the "
               "order they are listed to users, the device first.")},
    {"strerror", mod_strerror, METH_O,
     PyDoc_STR("strerror(code)\n--\n\nThe message of an AST_E* code.")},
    {"err_name", mod_err_name, METH_O,
     PyDoc_STR("err_name(code)\n--\n\nThe symbolic name of an AST_E* code ('AST_ENOSPC').")},
    {"config_keys", mod_config_keys, METH_NOARGS,
     PyDoc_STR("config_keys()\n--\n\nEvery key Runtime() accepts, as a tuple of str.")},
    {"default_config", mod_default_config, METH_NOARGS,
     PyDoc_STR("default_config()\n--\n\nThe default config, in the form of Runtime.config.")},
    {"validate_config", mod_validate_config, METH_O,
     PyDoc_STR("validate_config(config)\n--\n\nCheck a dict of the keys in config_keys() with "
               "libasteria's validator (ValueError naming the key and the allowed values); return "
               "it as a Config, which Runtime() takes without checking it again.")},
    {"coherence_dim_cost", mod_coherence_dim_cost, METH_O,
     PyDoc_STR("coherence_dim_cost(n)\n--\n\nThe refresh cost of one n x n factor, n^3 "
               "(saturating at 2^64 - 1).")},
    {"raise_error", mod_raise_error, METH_VARARGS,
     PyDoc_STR("raise_error(code, detail=None)\n--\n\nRaise the exception the binding maps code "
               "to (for callers that hold a failed Result's status).")},
    {NULL, NULL, 0, NULL},
};

/* ---- module ------------------------------------------------------------------------------------ */

static int add_int(PyObject *m, const char *name, long v)
{
    return PyModule_AddIntConstant(m, name, v);
}

static int mod_exec(PyObject *m)
{
    mod_state *st = PyModule_GetState(m);

    /* The bound heap types, each made from its file's spec, in module state and in the module. */
    const struct {
        PyTypeObject **type;
        PyType_Spec *spec;
    } types[] = {
        {&st->runtime_type, &runtime_spec}, {&st->config_type, &config_spec},
        {&st->store_type, &store_spec},     {&st->blockbuf_type, &blockbuf_spec},
        {&st->shadow_type, &shadow_spec},   {&st->coherence_type, &coherence_spec},
    };
    for (size_t i = 0; i < sizeof types / sizeof types[0]; i++) {
        *types[i].type = (PyTypeObject *)PyType_FromModuleAndSpec(m, types[i].spec, NULL);
        if (!*types[i].type || PyModule_AddType(m, *types[i].type) < 0)
            return -1;
    }
    st->result_type = PyStructSequence_NewType(&result_desc);
    if (!st->result_type || PyModule_AddType(m, st->result_type) < 0)
        return -1;
    st->asteria_error = PyErr_NewExceptionWithDoc(
        "asteria._C.AsteriaError",
        "A libasteria error with no closer builtin exception. .code is the AST_E* code, .name its "
        "symbolic name.",
        PyExc_RuntimeError, NULL);
    if (!st->asteria_error || PyModule_AddObjectRef(m, "AsteriaError", st->asteria_error) < 0)
        return -1;
    st->busy_error = PyErr_NewExceptionWithDoc(
        "asteria._C.BusyError",
        "AST_EBUSY from a Store (a block with live buffers, or one another thread is moving) or "
        "a Shadow (a full staging ring: release slots and retry). A subclass of AsteriaError.",
        st->asteria_error, NULL);
    if (!st->busy_error || PyModule_AddObjectRef(m, "BusyError", st->busy_error) < 0)
        return -1;

    PyObject *errorcode = PyDict_New();
    if (!errorcode)
        return -1;
    if (PyModule_AddObjectRef(m, "errorcode", errorcode) < 0 || add_int(m, "AST_OK", AST_OK)) {
        Py_DECREF(errorcode);
        return -1;
    }
#define ADD_ERR(name, val, msg)                                                                 \
    do {                                                                                      \
        PyObject *k_ = PyLong_FromLong(AST_##name), *v_ = PyUnicode_FromString("AST_" #name); \
        int bad_ = !k_ || !v_ || PyDict_SetItem(errorcode, k_, v_) < 0 ||                     \
                   add_int(m, "AST_" #name, AST_##name) < 0;                                  \
        Py_XDECREF(k_);                                                                       \
        Py_XDECREF(v_);                                                                       \
        if (bad_) {                                                                           \
            Py_DECREF(errorcode);                                                             \
            return -1;                                                                        \
        }                                                                                     \
    } while (0);
    AST_ERRNO_MAP(ADD_ERR)
#undef ADD_ERR
    Py_DECREF(errorcode);

    PyObject *ops = PyDict_New();
    if (!ops)
        return -1;
    int bad = PyModule_AddObjectRef(m, "OPS", ops) < 0;
    /* libasteria's op table, so the Python one (asteria.refresh.ops) is checked against C's. */
    for (int op = 1; !bad && op <= ast_op_count(); op++) {
        const char *name = ast_op_name(op);
        if (!name)
            continue;
        char cname[64];
        snprintf(cname, sizeof cname, "AST_OP_%s", name);
        for (char *c = cname; *c; c++)
            *c = (char)(*c >= 'a' && *c <= 'z' ? *c - 'a' + 'A' : *c);
        bad = dict_set_steal(ops, name, PyLong_FromLong(op)) < 0 || add_int(m, cname, op) < 0;
    }
    Py_DECREF(ops);
    if (bad)
        return -1;

    if (add_int(m, "AST_F32", AST_F32) || add_int(m, "AST_F64", AST_F64) ||
        add_int(m, "HAVE_CUDA", ASTERIA_HAVE_CUDA) ||
        add_int(m, "HAVE_URING", ASTERIA_HAVE_URING) ||
        add_int(m, "HAVE_HWLOC", ASTERIA_HAVE_HWLOC) ||
        add_int(m, "COH_XCHG_STRIDE", AST_COH_XCHG_STRIDE) ||
        PyModule_AddStringConstant(m, "__version__", ASTERIA_VERSION_STRING) < 0)
        return -1;
    return quant_module_add(m);
}

/* mod_state holds references only: this many. */
enum { STATE_REFS = sizeof(mod_state) / sizeof(PyObject *) };

/* Every reference in st, what traverse visits and clear drops. */
static void state_refs(const mod_state *st, PyObject *refs[STATE_REFS])
{
    PyObject *all[] = {
        (PyObject *)st->runtime_type,  (PyObject *)st->config_type,
        (PyObject *)st->result_type,   (PyObject *)st->store_type,
        (PyObject *)st->blockbuf_type, (PyObject *)st->shadow_type,
        (PyObject *)st->coherence_type, st->asteria_error,
        st->busy_error,
    };
    _Static_assert(sizeof all == sizeof(mod_state), "state_refs lists every field of mod_state");
    memcpy(refs, all, sizeof all);
}

static int mod_traverse(PyObject *m, visitproc visit, void *arg)
{
    mod_state *st = PyModule_GetState(m);
    if (!st)
        return 0;
    PyObject *refs[STATE_REFS];
    state_refs(st, refs);
    for (size_t i = 0; i < STATE_REFS; i++)
        Py_VISIT(refs[i]);
    return 0;
}

static int mod_clear(PyObject *m)
{
    mod_state *st = PyModule_GetState(m);
    if (!st)
        return 0;
    /* Emptied before anything is dropped, as Py_CLEAR does one field at a time. */
    PyObject *refs[STATE_REFS];
    state_refs(st, refs);
    memset(st, 0, sizeof *st);
    for (size_t i = 0; i < STATE_REFS; i++)
        Py_XDECREF(refs[i]);
    return 0;
}

static void mod_free(void *m) { mod_clear((PyObject *)m); }

static PyModuleDef_Slot mod_slots[] = {
    {Py_mod_exec, mod_exec},
#if PY_VERSION_HEX >= 0x030C0000
    {Py_mod_multiple_interpreters, Py_MOD_PER_INTERPRETER_GIL_SUPPORTED},
#endif
    {0, NULL},
};

struct PyModuleDef asteria_module_def = {
    PyModuleDef_HEAD_INIT,
    .m_name = "asteria._C",
    .m_doc = "Binding of libasteria: the REFRESH runtime (Runtime, Result) and its trace, the "
             "tiered block store (Store, BlockBuffer), the shadow copy engine (Shadow), the "
             "coherence registry (Coherence), the error codes and their mapping to Python "
             "exceptions (AsteriaError, BusyError).",
    .m_size = sizeof(mod_state),
    .m_methods = mod_methods,
    .m_slots = mod_slots,
    .m_traverse = mod_traverse,
    .m_clear = mod_clear,
    .m_free = mod_free,
};

PyMODINIT_FUNC PyInit__C(void);

PyMODINIT_FUNC PyInit__C(void) { return PyModuleDef_Init(&asteria_module_def); }
