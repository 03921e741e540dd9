/*
 * _C.c - asteria._C: the CPython binding of libasteria's runtime (runtime.h, errors.h).
 *
 * Owns: the Runtime heap type (one ast_runtime each), the Result struct-sequence type, the
 * AsteriaError exception and the one mapping from AST_E* codes to Python exceptions
 * (raise_ast_error). Types and exceptions live in module state (multi-phase init), so the module
 * may be instantiated more than once in a process.
 * May call: the public libasteria API and the Python C API. Nothing else.
 *
 * GIL and locking
 *  - The GIL is released around every libasteria call that computes, blocks or takes a runtime
 *    lock that workers contend for: create, submit, poll, wait, cancel, register, unregister,
 *    destroy. Inside those regions only C locals are touched; their memory is on the stack.
 *  - ast_runtime_destroy must not race with other calls on the runtime. A call that runs with
 *    the GIL released is counted in RuntimeObject.inflight (pthread mutex `lock`, condition
 *    `idle`); the count is raised while the GIL is held, after checking `closed`. close() sets
 *    `closed` with the GIL held, then (GIL released) waits for inflight == 0 and destroys.
 *    Calls that keep the GIL (stats, note_*, config, last_error) only check `closed`: a closer
 *    cannot be past that point while they hold the GIL.
 *  - `lock` is only ever held for a counter update or inside pthread_cond_wait, so taking it
 *    with the GIL held cannot deadlock.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "asteria/build_config.h"
#include "asteria/errors.h"
#include "asteria/runtime.h"

#include <errno.h>
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <string.h>

#define ERRBUF_LEN 1024
#define POLL_CHUNK 64

typedef struct {
    PyTypeObject *runtime_type;
    PyTypeObject *result_type;
    PyObject *asteria_error;
} mod_state;

typedef struct {
    PyObject_HEAD
    ast_runtime *rt;
    int closed;
    unsigned inflight;
    pthread_mutex_t lock;
    pthread_cond_t idle;
} RuntimeObject;

static const struct {
    const char *name;
    ast_op op;
} op_table[] = {
    {"eigh", AST_OP_EIGH},           {"inv_root", AST_OP_INV_ROOT},
    {"newton_root", AST_OP_NEWTON_ROOT}, {"soap_qr", AST_OP_SOAP_QR},
    {"kl_qr", AST_OP_KL_QR},
};
#define N_OPS (sizeof op_table / sizeof op_table[0])

static inline mod_state *type_state(PyTypeObject *tp) { return PyType_GetModuleState(tp); }

/* ---- errors --------------------------------------------------------------------------------- */

/* The runtime's last_error is shared per runtime and not reset on success, and some failures do
 * not set it; it describes this failure only if it carries this code's name as its prefix. */
static const char *detail_for(int code, const char *detail)
{
    if (!detail || !detail[0])
        return NULL;
    const char *name = ast_err_name(code);
    size_t n = strlen(name);
    if (!strncmp(detail, name, n) && detail[n] == ':') {
        detail += n + 1;
        while (*detail == ' ')
            detail++;
        return *detail ? detail : NULL;
    }
    return detail;
}

/* The one mapping from an AST_E* code to a Python exception. The message is
 * "<detail> (<AST_ENAME>: <strerror>)"; every exception carries .code and .name. Returns NULL. */
static PyObject *raise_ast_error(mod_state *st, int code, const char *detail)
{
    const char *name = ast_err_name(code), *what = ast_strerror(code);
    PyObject *msg;
    if (detail && detail[0]) {
        PyObject *d = PyUnicode_DecodeUTF8(detail, (Py_ssize_t)strlen(detail), "replace");
        if (!d)
            return NULL;
        msg = PyUnicode_FromFormat("%U (%s: %s)", d, name, what);
        Py_DECREF(d);
    } else {
        msg = PyUnicode_FromFormat("%s: %s", name, what);
    }
    if (!msg)
        return NULL;

    PyObject *type = st->asteria_error;
    int os_errno = 0;
    switch (code) {
    case AST_EINVAL:
        type = PyExc_ValueError;
        break;
    case AST_ENOMEM:
        type = PyExc_MemoryError;
        break;
    case AST_ETIMEDOUT: /* OSError(ETIMEDOUT, ...) is a TimeoutError */
        os_errno = ETIMEDOUT;
        break;
    case AST_ENOSPC:
        os_errno = ENOSPC;
        break;
    case AST_EIO:
        os_errno = EIO;
        break;
    case AST_EACCES: /* PermissionError */
        os_errno = EACCES;
        break;
    case AST_ENOENT: /* FileNotFoundError */
        os_errno = ENOENT;
        break;
    default:
        break;
    }
    PyObject *exc;
    if (os_errno)
        exc = PyObject_CallFunction(PyExc_OSError, "iO", os_errno, msg);
    else
        exc = PyObject_CallOneArg(type, msg);
    Py_DECREF(msg);
    if (!exc)
        return NULL;
    PyObject *c = PyLong_FromLong(code);
    PyObject *nm = PyUnicode_FromString(name);
    if (!c || !nm || PyObject_SetAttrString(exc, "code", c) < 0 ||
        PyObject_SetAttrString(exc, "name", nm) < 0) {
        Py_XDECREF(c);
        Py_XDECREF(nm);
        Py_DECREF(exc);
        return NULL;
    }
    Py_DECREF(c);
    Py_DECREF(nm);
    PyErr_SetObject((PyObject *)Py_TYPE(exc), exc);
    Py_DECREF(exc);
    return NULL;
}

/* ---- argument converters (PyArg "O&") --------------------------------------------------------- */

static int conv_u64(PyObject *o, void *out)
{
    unsigned long long v = PyLong_AsUnsignedLongLong(o);
    if (v == (unsigned long long)-1 && PyErr_Occurred())
        return 0;
    *(uint64_t *)out = (uint64_t)v;
    return 1;
}

static int conv_ptr(PyObject *o, void *out)
{
    uint64_t v;
    if (!conv_u64(o, &v))
        return 0;
    if (v > (uint64_t)UINTPTR_MAX) {
        PyErr_SetString(PyExc_OverflowError, "pointer does not fit in uintptr_t");
        return 0;
    }
    *(void **)out = (void *)(uintptr_t)v;
    return 1;
}

static int conv_optptr(PyObject *o, void *out)
{
    if (o == Py_None) {
        *(void **)out = NULL;
        return 1;
    }
    return conv_ptr(o, out);
}

static int conv_size(PyObject *o, void *out)
{
    size_t v = PyLong_AsSize_t(o);
    if (v == (size_t)-1 && PyErr_Occurred())
        return 0;
    *(size_t *)out = v;
    return 1;
}

static const char *utf8_no_nul(PyObject *s, const char *what)
{
    Py_ssize_t n;
    const char *p = PyUnicode_AsUTF8AndSize(s, &n);
    if (p && (size_t)n != strlen(p)) {
        PyErr_Format(PyExc_ValueError, "%s contains an embedded null character", what);
        return NULL;
    }
    return p;
}

static int parse_op(mod_state *st, PyObject *o, ast_op *out)
{
    if (PyLong_Check(o)) {
        long v = PyLong_AsLong(o);
        if (v == -1 && PyErr_Occurred())
            return -1;
        for (size_t i = 0; i < N_OPS; i++)
            if ((long)op_table[i].op == v) {
                *out = op_table[i].op;
                return 0;
            }
    } else if (PyUnicode_Check(o)) {
        const char *s = utf8_no_nul(o, "op");
        if (!s)
            return -1;
        for (size_t i = 0; i < N_OPS; i++)
            if (!strcmp(op_table[i].name, s)) {
                *out = op_table[i].op;
                return 0;
            }
    } else {
        PyErr_Format(PyExc_TypeError, "op must be an int or a str, not %.100s",
                     Py_TYPE(o)->tp_name);
        return -1;
    }
    PyErr_Format(PyExc_ValueError,
                 "unknown op %R; allowed: eigh (1), inv_root (2), newton_root (3), soap_qr (4), "
                 "kl_qr (5)",
                 o);
    return -1;
}

static int parse_dtype(PyObject *o, ast_dtype *out)
{
    if (PyUnicode_Check(o)) {
        if (!PyUnicode_CompareWithASCIIString(o, "float32")) {
            *out = AST_F32;
            return 0;
        }
        if (!PyUnicode_CompareWithASCIIString(o, "float64")) {
            *out = AST_F64;
            return 0;
        }
    } else if (PyLong_Check(o)) {
        long v = PyLong_AsLong(o);
        if (v == -1 && PyErr_Occurred())
            return -1;
        if (v == AST_F32 || v == AST_F64) {
            *out = (ast_dtype)v;
            return 0;
        }
    }
    PyErr_Format(PyExc_ValueError, "unknown dtype %R; allowed: 'float32', 'float64'", o);
    return -1;
}

/* ---- config -------------------------------------------------------------------------------------- */

/* The string form ast_config_set takes: bools "1"/"0"; a dict (placement) "k=v,k=v"; else str(). */
static PyObject *config_value_str(PyObject *v)
{
    if (PyBool_Check(v))
        return PyUnicode_FromString(v == Py_True ? "1" : "0");
    if (!PyDict_Check(v))
        return PyObject_Str(v);
    PyObject *parts = PyList_New(0), *items = PyDict_Items(v), *out = NULL;
    if (!parts || !items)
        goto done;
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(items); i++) {
        PyObject *kv = PyList_GET_ITEM(items, i);
        PyObject *part = PyUnicode_FromFormat("%S=%S", PyTuple_GET_ITEM(kv, 0),
                                              PyTuple_GET_ITEM(kv, 1));
        if (!part || PyList_Append(parts, part) < 0) {
            Py_XDECREF(part);
            goto done;
        }
        Py_DECREF(part);
    }
    PyObject *sep = PyUnicode_FromString(",");
    if (sep) {
        out = PyUnicode_Join(sep, parts);
        Py_DECREF(sep);
    }
done:
    Py_XDECREF(parts);
    Py_XDECREF(items);
    return out;
}

/* Applies a mapping of key -> value through ast_config_set; None values keep the default. */
static int apply_config(mod_state *st, ast_config *cfg, PyObject *config)
{
    if (config == Py_None)
        return 0;
    if (!PyDict_Check(config) && !PyObject_HasAttrString(config, "items")) {
        PyErr_Format(PyExc_TypeError, "config must be a dict, not %.100s",
                     Py_TYPE(config)->tp_name);
        return -1;
    }
    /* A copy of the items: str() of a value may run code that mutates the mapping. */
    PyObject *items = PyMapping_Items(config);
    if (!items)
        return -1;
    int ret = -1;
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(items); i++) {
        PyObject *kv = PyList_GET_ITEM(items, i);
        if (!PyTuple_Check(kv) || PyTuple_GET_SIZE(kv) != 2) {
            PyErr_SetString(PyExc_TypeError, "config items must be (key, value) pairs");
            goto done;
        }
        PyObject *k = PyTuple_GET_ITEM(kv, 0), *v = PyTuple_GET_ITEM(kv, 1);
        if (!PyUnicode_Check(k)) {
            PyErr_Format(PyExc_TypeError, "config keys must be str, got %R", k);
            goto done;
        }
        if (v == Py_None)
            continue;
        PyObject *vs = config_value_str(v);
        if (!vs)
            goto done;
        const char *key = utf8_no_nul(k, "config key");
        const char *val = key ? utf8_no_nul(vs, "config value") : NULL;
        if (!val) {
            Py_DECREF(vs);
            goto done;
        }
        char err[ERRBUF_LEN] = "";
        int rc = ast_config_set(cfg, key, val, err, sizeof err);
        Py_DECREF(vs);
        if (rc < 0) {
            raise_ast_error(st, rc, err);
            goto done;
        }
    }
    ret = 0;
done:
    Py_DECREF(items);
    return ret;
}

static int dict_set_steal(PyObject *d, const char *key, PyObject *v)
{
    if (!v)
        return -1;
    int rc = PyDict_SetItemString(d, key, v);
    Py_DECREF(v);
    return rc;
}

/* A fixed-size C string field as str, or None when empty. */
static PyObject *str_or_none(const char *s, size_t cap)
{
    size_t n = strnlen(s, cap);
    if (!n)
        Py_RETURN_NONE;
    return PyUnicode_DecodeUTF8(s, (Py_ssize_t)n, "surrogateescape");
}

static PyObject *bytes_or_none(int64_t v)
{
    if (v < 0)
        Py_RETURN_NONE;
    return PyLong_FromLongLong(v);
}

/* The dict form of a config; feeding it back to Runtime() gives the same config. */
static PyObject *config_to_dict(const ast_config *c)
{
    PyObject *d = PyDict_New();
    if (!d)
        return NULL;
    if (dict_set_steal(d, "mode", PyUnicode_FromString(c->mode == AST_MODE_SYNC ? "sync" : "async")) ||
        dict_set_steal(d, "staleness", PyLong_FromLong(c->staleness)) ||
        dict_set_steal(d, "install",
                       PyUnicode_FromString(c->install == AST_INSTALL_EAGER ? "eager"
                                                                            : "deterministic")) ||
        dict_set_steal(d, "workers", c->workers > 0 ? PyLong_FromLong(c->workers) : Py_NewRef(Py_None)) ||
        dict_set_steal(d, "cpuset", str_or_none(c->cpuset, sizeof c->cpuset)) ||
        dict_set_steal(d, "pin", PyBool_FromLong(c->pin)) ||
        dict_set_steal(d, "placement", str_or_none(c->placement, sizeof c->placement)) ||
        dict_set_steal(d, "device_budget_bytes", bytes_or_none(c->device_budget_bytes)) ||
        dict_set_steal(d, "host_budget_bytes", bytes_or_none(c->host_budget_bytes)) ||
        dict_set_steal(d, "nvme_dir", str_or_none(c->nvme_dir, sizeof c->nvme_dir)) ||
        dict_set_steal(d, "trace", str_or_none(c->trace, sizeof c->trace)) ||
        dict_set_steal(d, "max_failures", PyLong_FromLong(c->max_failures))) {
        Py_DECREF(d);
        return NULL;
    }
    return d;
}

/* ---- Result ------------------------------------------------------------------------------------- */

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

static PyStructSequence_Desc result_desc = {
    "asteria._C.Result",
    "Result(ticket, block, version, snapshot_step, status, retried_f64, failed_index, queued_ns,\n"
    "started_ns, done_ns, worker): the completion of one REFRESH job.",
    result_fields,
    11,
};

static PyObject *make_result(mod_state *st, const ast_result *r)
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
            PyStructSequence_SET_ITEM(t, i, v[i]);
    }
    if (!ok) {
        Py_DECREF(t);
        return NULL;
    }
    return t;
}

/* ---- Runtime ------------------------------------------------------------------------------------ */

/* Marks one call that will use the runtime with the GIL released. */
static int rt_enter(RuntimeObject *self, mod_state *st)
{
    if (self->closed || !self->rt) {
        raise_ast_error(st, AST_ESHUTDOWN, "the runtime is closed");
        return -1;
    }
    pthread_mutex_lock(&self->lock);
    self->inflight++;
    pthread_mutex_unlock(&self->lock);
    return 0;
}

static void rt_leave(RuntimeObject *self)
{
    pthread_mutex_lock(&self->lock);
    if (--self->inflight == 0)
        pthread_cond_broadcast(&self->idle);
    pthread_mutex_unlock(&self->lock);
}

/* For calls that keep the GIL: the runtime, or NULL with AST_ESHUTDOWN raised. */
static ast_runtime *rt_open(RuntimeObject *self, mod_state *st)
{
    if (self->closed || !self->rt) {
        raise_ast_error(st, AST_ESHUTDOWN, "the runtime is closed");
        return NULL;
    }
    return self->rt;
}

static PyObject *runtime_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"config", NULL};
    PyObject *config = Py_None;
    mod_state *st = type_state(type);
    if (!st || !PyArg_ParseTupleAndKeywords(args, kwds, "|O:Runtime", kwlist, &config))
        return NULL;
    ast_config cfg;
    ast_config_init(&cfg);
    if (apply_config(st, &cfg, config) < 0)
        return NULL;
    char err[ERRBUF_LEN] = "";
    int rc = ast_config_validate(&cfg, err, sizeof err);
    if (rc < 0)
        return raise_ast_error(st, rc, err);

    RuntimeObject *self = (RuntimeObject *)type->tp_alloc(type, 0);
    if (!self)
        return NULL;
    pthread_mutex_init(&self->lock, NULL);
    pthread_cond_init(&self->idle, NULL);
    ast_runtime *rt = NULL;
    Py_BEGIN_ALLOW_THREADS
    rc = ast_runtime_create_msg(&cfg, &rt, err, sizeof err);
    Py_END_ALLOW_THREADS
    if (rc < 0) {
        Py_DECREF(self);
        return raise_ast_error(st, rc, err);
    }
    self->rt = rt;
    return (PyObject *)self;
}

static void runtime_close_impl(RuntimeObject *self)
{
    if (self->closed)
        return;
    self->closed = 1;
    ast_runtime *rt = self->rt;
    if (!rt)
        return;
    /* Destroy finishes running jobs (they may be long): never with the GIL held. */
    Py_BEGIN_ALLOW_THREADS
    pthread_mutex_lock(&self->lock);
    while (self->inflight)
        pthread_cond_wait(&self->idle, &self->lock);
    pthread_mutex_unlock(&self->lock);
    ast_runtime_destroy(rt);
    Py_END_ALLOW_THREADS
    self->rt = NULL;
}

static int runtime_traverse(RuntimeObject *self, visitproc visit, void *arg)
{
    Py_VISIT(Py_TYPE(self));
    return 0;
}

static void runtime_dealloc(RuntimeObject *self)
{
    PyTypeObject *tp = Py_TYPE(self);
    PyObject_GC_UnTrack(self);
    runtime_close_impl(self);
    pthread_cond_destroy(&self->idle);
    pthread_mutex_destroy(&self->lock);
    tp->tp_free((PyObject *)self);
    Py_DECREF(tp);
}

PyDoc_STRVAR(runtime_close_doc,
             "close()\n--\n\nCancel nothing, wait (GIL released) for running jobs, drop queued ones "
             "and free the runtime. Idempotent; also done on deallocation.");

static PyObject *runtime_close(RuntimeObject *self, PyObject *unused)
{
    runtime_close_impl(self);
    Py_RETURN_NONE;
}

static PyObject *runtime_enter(RuntimeObject *self, PyObject *unused)
{
    return Py_NewRef(self);
}

static PyObject *runtime_exit(RuntimeObject *self, PyObject *args)
{
    runtime_close_impl(self);
    Py_RETURN_FALSE;
}

PyDoc_STRVAR(runtime_register_doc,
             "register(ptr, nbytes)\n--\n\nDeclare host memory [ptr, ptr+nbytes) that jobs may "
             "read or write. Returns a handle for unregister().");

static PyObject *runtime_register(RuntimeObject *self, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"ptr", "nbytes", NULL};
    mod_state *st = type_state(Py_TYPE(self));
    void *ptr;
    size_t nbytes;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O&O&:register", kwlist, conv_ptr, &ptr,
                                     conv_size, &nbytes))
        return NULL;
    if (rt_enter(self, st) < 0)
        return NULL;
    ast_runtime *rt = self->rt;
    uint64_t handle = 0;
    char err[ERRBUF_LEN] = "";
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = ast_runtime_register(rt, ptr, nbytes, &handle);
    if (rc < 0)
        ast_runtime_last_error(rt, err, sizeof err);
    Py_END_ALLOW_THREADS
    rt_leave(self);
    if (rc < 0)
        return raise_ast_error(st, rc, detail_for(rc, err));
    return PyLong_FromUnsignedLongLong(handle);
}

PyDoc_STRVAR(runtime_unregister_doc,
             "unregister(handle)\n--\n\nForget a registered buffer (AST_EBUSY while a job uses it).");

static PyObject *runtime_unregister(RuntimeObject *self, PyObject *arg)
{
    mod_state *st = type_state(Py_TYPE(self));
    uint64_t handle;
    if (!conv_u64(arg, &handle))
        return NULL;
    if (rt_enter(self, st) < 0)
        return NULL;
    ast_runtime *rt = self->rt;
    char err[ERRBUF_LEN] = "";
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = ast_runtime_unregister(rt, handle);
    if (rc < 0)
        ast_runtime_last_error(rt, err, sizeof err);
    Py_END_ALLOW_THREADS
    rt_leave(self);
    if (rc < 0)
        return raise_ast_error(st, rc, detail_for(rc, err));
    Py_RETURN_NONE;
}

PyDoc_STRVAR(runtime_submit_doc,
             "submit(op, dtype, n, batch, in0, in1, out0, out1, p=0.0, eps=0.0, block=0, "
             "version=0, deadline=0, snapshot_step=0)\n--\n\n"
             "Queue one REFRESH job. op: an AST_OP_* code or its name ('eigh', 'inv_root',\n"
             "'newton_root', 'soap_qr', 'kl_qr'); dtype: 'float32' or 'float64'; in0/in1/out0/out1:\n"
             "addresses (int, or None for in1/out1) inside registered buffers. Returns the ticket.");

static PyObject *runtime_submit(RuntimeObject *self, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"op",  "dtype", "n",     "batch",   "in0",      "in1",
                             "out0", "out1", "p",     "eps",     "block",    "version",
                             "deadline", "snapshot_step", NULL};
    mod_state *st = type_state(Py_TYPE(self));
    PyObject *op_o, *dtype_o;
    ast_refresh req;
    memset(&req, 0, sizeof req);
    long long deadline = 0, snapshot_step = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OOiiO&O&O&O&|ddO&O&LL:submit", kwlist, &op_o,
                                     &dtype_o, &req.n, &req.batch, conv_ptr, &req.in0,
                                     conv_optptr, &req.in1, conv_ptr, &req.out0, conv_optptr,
                                     &req.out1, &req.p, &req.eps, conv_u64, &req.block, conv_u64,
                                     &req.version, &deadline, &snapshot_step))
        return NULL;
    if (parse_op(st, op_o, &req.op) < 0 || parse_dtype(dtype_o, &req.dtype) < 0)
        return NULL;
    req.deadline = deadline;
    req.snapshot_step = snapshot_step;
    if (rt_enter(self, st) < 0)
        return NULL;
    ast_runtime *rt = self->rt;
    uint64_t ticket = 0;
    char err[ERRBUF_LEN] = "";
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = ast_runtime_submit(rt, &req, &ticket);
    if (rc < 0)
        ast_runtime_last_error(rt, err, sizeof err);
    Py_END_ALLOW_THREADS
    rt_leave(self);
    if (rc < 0)
        return raise_ast_error(st, rc, detail_for(rc, err));
    return PyLong_FromUnsignedLongLong(ticket);
}

PyDoc_STRVAR(runtime_cancel_doc,
             "cancel(ticket)\n--\n\nTrue if the job was still queued and is now cancelled (its "
             "result, status AST_ECANCELED, is still collected by poll/wait); False if it runs or "
             "finished.");

static PyObject *runtime_cancel(RuntimeObject *self, PyObject *arg)
{
    mod_state *st = type_state(Py_TYPE(self));
    uint64_t ticket;
    if (!conv_u64(arg, &ticket))
        return NULL;
    if (rt_enter(self, st) < 0)
        return NULL;
    ast_runtime *rt = self->rt;
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = ast_runtime_cancel(rt, ticket);
    Py_END_ALLOW_THREADS
    rt_leave(self);
    if (rc == 0)
        Py_RETURN_TRUE;
    if (rc == AST_EBUSY || rc == AST_ENOENT)
        Py_RETURN_FALSE;
    return raise_ast_error(st, rc, NULL);
}

PyDoc_STRVAR(runtime_poll_doc,
             "poll()\n--\n\nCollect every completed job without blocking: a list of Result.");

static PyObject *runtime_poll(RuntimeObject *self, PyObject *unused)
{
    mod_state *st = type_state(Py_TYPE(self));
    PyObject *list = PyList_New(0);
    if (!list)
        return NULL;
    ast_result buf[POLL_CHUNK];
    size_t n;
    do {
        if (rt_enter(self, st) < 0)
            goto fail;
        ast_runtime *rt = self->rt;
        char err[ERRBUF_LEN] = "";
        int rc;
        n = 0;
        Py_BEGIN_ALLOW_THREADS
        rc = ast_runtime_poll(rt, buf, POLL_CHUNK, &n);
        if (rc < 0)
            ast_runtime_last_error(rt, err, sizeof err);
        Py_END_ALLOW_THREADS
        rt_leave(self);
        if (rc < 0) {
            raise_ast_error(st, rc, detail_for(rc, err));
            goto fail;
        }
        for (size_t i = 0; i < n; i++) {
            PyObject *r = make_result(st, &buf[i]);
            if (!r || PyList_Append(list, r) < 0) {
                Py_XDECREF(r);
                goto fail;
            }
            Py_DECREF(r);
        }
    } while (n == POLL_CHUNK);
    return list;
fail:
    Py_DECREF(list);
    return NULL;
}

PyDoc_STRVAR(runtime_wait_doc,
             "wait(ticket, timeout=None)\n--\n\nBounded barrier: block, GIL released, until the job "
             "is done and return its Result. timeout in seconds (None: forever); on expiry "
             "TimeoutError and the job stays pending.");

static PyObject *runtime_wait(RuntimeObject *self, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"ticket", "timeout", NULL};
    mod_state *st = type_state(Py_TYPE(self));
    uint64_t ticket;
    PyObject *timeout_o = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O&|O:wait", kwlist, conv_u64, &ticket,
                                     &timeout_o))
        return NULL;
    int64_t timeout_ns = -1;
    if (timeout_o != Py_None) {
        double t = PyFloat_AsDouble(timeout_o);
        if (t == -1.0 && PyErr_Occurred())
            return NULL;
        if (!(t >= 0.0)) {
            PyErr_Format(PyExc_ValueError, "timeout must be None or >= 0 seconds, got %R",
                         timeout_o);
            return NULL;
        }
        timeout_ns = t * 1e9 >= 9.2e18 ? INT64_MAX : (int64_t)(t * 1e9);
    }
    if (rt_enter(self, st) < 0)
        return NULL;
    ast_runtime *rt = self->rt;
    ast_result res;
    memset(&res, 0, sizeof res);
    char err[ERRBUF_LEN] = "";
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = ast_runtime_wait(rt, ticket, timeout_ns, &res);
    if (rc < 0)
        ast_runtime_last_error(rt, err, sizeof err);
    Py_END_ALLOW_THREADS
    rt_leave(self);
    if (rc == AST_ENOENT)
        return raise_ast_error(st, rc, "wait: unknown ticket, or its result was already collected");
    if (rc < 0)
        return raise_ast_error(st, rc, detail_for(rc, err));
    return make_result(st, &res);
}

PyDoc_STRVAR(runtime_note_install_doc,
             "note_install(snapshot_step, install_step)\n--\n\nReport that a result snapshotted at "
             "snapshot_step was installed at install_step (feeds installs / max_install_lag).");

static PyObject *runtime_note_install(RuntimeObject *self, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"snapshot_step", "install_step", NULL};
    long long snap, inst;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "LL:note_install", kwlist, &snap, &inst))
        return NULL;
    ast_runtime *rt = rt_open(self, type_state(Py_TYPE(self)));
    if (!rt)
        return NULL;
    ast_runtime_note_install(rt, snap, inst);
    Py_RETURN_NONE;
}

PyDoc_STRVAR(runtime_note_nonfinite_doc,
             "note_nonfinite()\n--\n\nCount a REFRESH skipped for non-finite inputs.");

static PyObject *runtime_note_nonfinite(RuntimeObject *self, PyObject *unused)
{
    ast_runtime *rt = rt_open(self, type_state(Py_TYPE(self)));
    if (!rt)
        return NULL;
    ast_runtime_note_nonfinite(rt);
    Py_RETURN_NONE;
}

PyDoc_STRVAR(runtime_stats_doc, "stats()\n--\n\nEvery ast_stats counter, as a dict.");

static PyObject *runtime_stats(RuntimeObject *self, PyObject *unused)
{
    mod_state *st = type_state(Py_TYPE(self));
    ast_runtime *rt = rt_open(self, st);
    if (!rt)
        return NULL;
    ast_stats s;
    int rc = ast_runtime_stats_get(rt, &s);
    if (rc < 0)
        return raise_ast_error(st, rc, NULL);
    PyObject *d = PyDict_New();
    if (!d)
        return NULL;
#define U64(f) dict_set_steal(d, #f, PyLong_FromUnsignedLongLong(s.f))
#define I64(f) dict_set_steal(d, #f, PyLong_FromLongLong(s.f))
    if (U64(jobs_submitted) || U64(jobs_queued) || U64(jobs_running) || U64(jobs_done) ||
        U64(jobs_failed) || U64(jobs_superseded) || U64(jobs_cancelled) ||
        U64(jobs_retried_f64) || U64(nonfinite_skipped) || U64(installs) ||
        I64(max_install_lag) || I64(last_installed_version_step) || U64(barrier_waits) ||
        U64(barrier_wait_ns) || U64(worker_busy_ns) || U64(bytes_registered) ||
        dict_set_steal(d, "workers", PyLong_FromLong(s.workers))) {
        Py_DECREF(d);
        return NULL;
    }
#undef U64
#undef I64
    return d;
}

PyDoc_STRVAR(runtime_last_error_doc,
             "last_error()\n--\n\nThe runtime's last error message ('' if none).");

static PyObject *runtime_last_error(RuntimeObject *self, PyObject *unused)
{
    ast_runtime *rt = rt_open(self, type_state(Py_TYPE(self)));
    if (!rt)
        return NULL;
    char buf[ERRBUF_LEN] = "";
    ast_runtime_last_error(rt, buf, sizeof buf);
    return PyUnicode_DecodeUTF8(buf, (Py_ssize_t)strlen(buf), "replace");
}

static PyObject *runtime_get_config(RuntimeObject *self, void *closure)
{
    ast_runtime *rt = rt_open(self, type_state(Py_TYPE(self)));
    if (!rt)
        return NULL;
    return config_to_dict(ast_runtime_config(rt));
}

static PyObject *runtime_get_closed(RuntimeObject *self, void *closure)
{
    return PyBool_FromLong(self->closed);
}

static PyObject *runtime_repr(RuntimeObject *self)
{
    if (self->closed || !self->rt)
        return PyUnicode_FromFormat("<%s closed>", Py_TYPE(self)->tp_name);
    const ast_config *c = ast_runtime_config(self->rt);
    return PyUnicode_FromFormat("<%s mode=%s staleness=%d workers=%d>", Py_TYPE(self)->tp_name,
                                c->mode == AST_MODE_SYNC ? "sync" : "async", c->staleness,
                                c->workers);
}

static PyMethodDef runtime_methods[] = {
    {"register", (PyCFunction)(void (*)(void))runtime_register, METH_VARARGS | METH_KEYWORDS,
     runtime_register_doc},
    {"unregister", (PyCFunction)runtime_unregister, METH_O, runtime_unregister_doc},
    {"submit", (PyCFunction)(void (*)(void))runtime_submit, METH_VARARGS | METH_KEYWORDS,
     runtime_submit_doc},
    {"cancel", (PyCFunction)runtime_cancel, METH_O, runtime_cancel_doc},
    {"poll", (PyCFunction)runtime_poll, METH_NOARGS, runtime_poll_doc},
    {"wait", (PyCFunction)(void (*)(void))runtime_wait, METH_VARARGS | METH_KEYWORDS,
     runtime_wait_doc},
    {"note_install", (PyCFunction)(void (*)(void))runtime_note_install,
     METH_VARARGS | METH_KEYWORDS, runtime_note_install_doc},
    {"note_nonfinite", (PyCFunction)runtime_note_nonfinite, METH_NOARGS,
     runtime_note_nonfinite_doc},
    {"stats", (PyCFunction)runtime_stats, METH_NOARGS, runtime_stats_doc},
    {"last_error", (PyCFunction)runtime_last_error, METH_NOARGS, runtime_last_error_doc},
    {"close", (PyCFunction)runtime_close, METH_NOARGS, runtime_close_doc},
    {"__enter__", (PyCFunction)runtime_enter, METH_NOARGS, NULL},
    {"__exit__", (PyCFunction)runtime_exit, METH_VARARGS, NULL},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef runtime_getset[] = {
    {"config", (getter)runtime_get_config, NULL, "The effective config, as a dict.", NULL},
    {"closed", (getter)runtime_get_closed, NULL, "True after close().", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

PyDoc_STRVAR(runtime_doc,
             "Runtime(config=None)\n--\n\n"
             "One libasteria runtime: a worker pool running REFRESH jobs on registered host "
             "buffers.\nconfig: a dict of the keys in config_keys(); values are passed as str() "
             "(bools as 1/0,\na placement dict as 'kind=tier,...'); None keeps the default. A bad "
             "key or value\nraises ValueError naming the key and the allowed values.");

static PyType_Slot runtime_slots[] = {
    {Py_tp_new, runtime_new},
    {Py_tp_dealloc, runtime_dealloc},
    {Py_tp_traverse, runtime_traverse},
    {Py_tp_repr, runtime_repr},
    {Py_tp_methods, runtime_methods},
    {Py_tp_getset, runtime_getset},
    {Py_tp_doc, (void *)runtime_doc},
    {0, NULL},
};

static PyType_Spec runtime_spec = {
    .name = "asteria._C.Runtime",
    .basicsize = sizeof(RuntimeObject),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_IMMUTABLETYPE,
    .slots = runtime_slots,
};

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
    PyObject *out = PyTuple_New(PyList_GET_SIZE(parts));
    for (Py_ssize_t i = 0; out && i < PyList_GET_SIZE(parts); i++) {
        PyObject *k = PyObject_CallMethod(PyList_GET_ITEM(parts, i), "rstrip", "s", ",");
        if (!k)
            Py_CLEAR(out);
        else
            PyTuple_SET_ITEM(out, i, k);
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

/* The whole config path of Runtime() without creating one: ast_config_set per key, then
 * ast_config_validate. */
static PyObject *mod_validate_config(PyObject *m, PyObject *config)
{
    mod_state *st = PyModule_GetState(m);
    ast_config cfg;
    ast_config_init(&cfg);
    if (apply_config(st, &cfg, config) < 0)
        return NULL;
    char err[ERRBUF_LEN] = "";
    int rc = ast_config_validate(&cfg, err, sizeof err);
    if (rc < 0)
        return raise_ast_error(st, rc, err);
    return config_to_dict(&cfg);
}

static PyObject *mod_raise_error(PyObject *m, PyObject *args)
{
    int code;
    const char *detail = NULL;
    if (!PyArg_ParseTuple(args, "i|z:raise_error", &code, &detail))
        return NULL;
    return raise_ast_error(PyModule_GetState(m), code, detail);
}

static PyMethodDef mod_methods[] = {
    {"strerror", mod_strerror, METH_O,
     PyDoc_STR("strerror(code)\n--\n\nThe message of an AST_E* code.")},
    {"err_name", mod_err_name, METH_O,
     PyDoc_STR("err_name(code)\n--\n\nThe symbolic name of an AST_E* code ('AST_ENOSPC').")},
    {"config_keys", mod_config_keys, METH_NOARGS,
     PyDoc_STR("config_keys()\n--\n\nEvery key Runtime() accepts, as a tuple of str.")},
    {"default_config", mod_default_config, METH_NOARGS,
     PyDoc_STR("default_config()\n--\n\nThe default config, in the form of Runtime.config.")},
    {"validate_config", mod_validate_config, METH_O,
     PyDoc_STR("validate_config(config)\n--\n\nCheck a config dict exactly as Runtime() does "
               "(ValueError naming the key and the allowed values); return the effective config.")},
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

    st->runtime_type = (PyTypeObject *)PyType_FromModuleAndSpec(m, &runtime_spec, NULL);
    if (!st->runtime_type || PyModule_AddType(m, st->runtime_type) < 0)
        return -1;
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
    for (size_t i = 0; !bad && i < N_OPS; i++) {
        char cname[32];
        snprintf(cname, sizeof cname, "AST_OP_%s", op_table[i].name);
        for (char *c = cname; *c; c++)
            *c = (char)(*c >= 'a' && *c <= 'z' ? *c - 'a' + 'A' : *c);
        bad = dict_set_steal(ops, op_table[i].name, PyLong_FromLong(op_table[i].op)) < 0 ||
              add_int(m, cname, op_table[i].op) < 0;
    }
    Py_DECREF(ops);
    if (bad)
        return -1;

    if (add_int(m, "AST_F32", AST_F32) || add_int(m, "AST_F64", AST_F64) ||
        add_int(m, "AST_MODE_SYNC", AST_MODE_SYNC) || add_int(m, "AST_MODE_ASYNC", AST_MODE_ASYNC) ||
        add_int(m, "HAVE_CUDA", ASTERIA_HAVE_CUDA) || add_int(m, "HAVE_NCCL", ASTERIA_HAVE_NCCL) ||
        add_int(m, "HAVE_URING", ASTERIA_HAVE_URING) ||
        add_int(m, "HAVE_HWLOC", ASTERIA_HAVE_HWLOC) ||
        PyModule_AddStringConstant(m, "__version__", ASTERIA_VERSION_STRING) < 0)
        return -1;
    return 0;
}

static int mod_traverse(PyObject *m, visitproc visit, void *arg)
{
    mod_state *st = PyModule_GetState(m);
    if (!st)
        return 0;
    Py_VISIT(st->runtime_type);
    Py_VISIT(st->result_type);
    Py_VISIT(st->asteria_error);
    return 0;
}

static int mod_clear(PyObject *m)
{
    mod_state *st = PyModule_GetState(m);
    if (!st)
        return 0;
    Py_CLEAR(st->runtime_type);
    Py_CLEAR(st->result_type);
    Py_CLEAR(st->asteria_error);
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

static struct PyModuleDef asteria_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "asteria._C",
    .m_doc = "Binding of libasteria: the REFRESH runtime (Runtime, Result), its error codes and "
             "their mapping to Python exceptions.",
    .m_size = sizeof(mod_state),
    .m_methods = mod_methods,
    .m_slots = mod_slots,
    .m_traverse = mod_traverse,
    .m_clear = mod_clear,
    .m_free = mod_free,
};

PyMODINIT_FUNC PyInit__C(void);

PyMODINIT_FUNC PyInit__C(void) { return PyModuleDef_Init(&asteria_module); }
