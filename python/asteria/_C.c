/*
 * _C.c - asteria._C: the CPython binding of libasteria's runtime (runtime.h, errors.h, trace
 * events through the runtime), block store (store.h), shadow copy engine (shadow.h) and
 * coherence registry (coherence.h).
 *
 * Owns: the Runtime, Store, BlockBuffer, Shadow and Coherence heap types, the Result
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
 *    or from PyMem_Raw*; strings are copied out of Python objects first. Coherence calls keep
 *    the GIL: the registry's lock is held only for a short, non-blocking table update.
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
 *  - Store block pins (exports, busy) and Shadow tickets are plain C tables touched only with
 *    the GIL held; that is what makes "check, then release the GIL and act" safe against other
 *    Python threads (see StoreObject).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "asteria/build_config.h"
#include "asteria/coherence.h"
#include "asteria/errors.h"
#include "asteria/runtime.h"
#include "asteria/shadow.h"
#include "asteria/store.h"
#include "asteria/trace.h"

#include <errno.h>
#include <inttypes.h>
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <string.h>

#define ERRBUF_LEN 1024
#define POLL_CHUNK 64
/* A blocking wait wakes this often to run Python's signal handlers (Ctrl-C). */
#define SIGNAL_SLICE_NS (100 * 1000 * 1000LL)

typedef struct {
    PyTypeObject *runtime_type;
    PyTypeObject *result_type;
    PyTypeObject *store_type;
    PyTypeObject *blockbuf_type;
    PyTypeObject *shadow_type;
    PyTypeObject *coherence_type;
    PyObject *asteria_error;
    PyObject *busy_error;
} mod_state;

/* Keeps a handle alive while calls that released the GIL use it (see the header comment). */
typedef struct guard {
    int closed;
    unsigned inflight;
    pthread_mutex_t lock;
    pthread_cond_t idle;
    struct guard *prev, *next; /* every live guard of the process (fork handlers) */
} guard;

typedef struct {
    PyObject_HEAD
    ast_runtime *rt;
    guard g;
} RuntimeObject;

static const struct {
    const char *name;
    ast_op op;
} op_table[] = {
    {"eigh", AST_OP_EIGH},           {"inv_root", AST_OP_INV_ROOT},
    {"newton_root", AST_OP_NEWTON_ROOT}, {"soap_qr", AST_OP_SOAP_QR},
    {"kl_qr", AST_OP_KL_QR},         {"soap_rotate", AST_OP_SOAP_ROTATE},
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

/* The one mapping from an AST_E* code to a Python exception, as a new exception object. The
 * message is "<detail> (<AST_ENAME>: <strerror>)"; every exception carries .code and .name.
 * type NULL: the table below; else that class (a subclass of the table's, e.g. BusyError). */
static PyObject *new_ast_error(mod_state *st, PyObject *type, int code, const char *detail)
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

    int os_errno = 0;
    if (!type) {
        type = st->asteria_error;
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
    return exc;
}

static PyObject *raise_exc(PyObject *exc)
{
    if (exc) {
        PyErr_SetObject((PyObject *)Py_TYPE(exc), exc);
        Py_DECREF(exc);
    }
    return NULL;
}

/* Raises the mapped exception (new_ast_error with the table). Returns NULL. */
static PyObject *raise_ast_error(mod_state *st, int code, const char *detail)
{
    return raise_exc(new_ast_error(st, NULL, code, detail));
}

/* Store and Shadow report AST_EBUSY (a block with exported buffers, a full staging ring) as
 * BusyError, a subclass of AsteriaError, so callers can catch "try again later" alone. The
 * runtime keeps plain AsteriaError for it (unregister of a buffer a job holds). */
static PyObject *raise_busy_aware(mod_state *st, int code, const char *detail)
{
    return raise_exc(new_ast_error(st, code == AST_EBUSY ? st->busy_error : NULL, code, detail));
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

static int as_int(PyObject *o, int *out, const char *what)
{
    long v = PyLong_AsLong(o);
    if (v == -1 && PyErr_Occurred())
        return -1;
    if (v < INT32_MIN || v > INT32_MAX) {
        PyErr_Format(PyExc_OverflowError, "%s does not fit in a C int", what);
        return -1;
    }
    *out = (int)v;
    return 0;
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
                 "kl_qr (5), soap_rotate (6)",
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

/* ---- guard -------------------------------------------------------------------------------------- */

/* Fork: a call counted in a guard's inflight belongs to a thread that a forked child does not
 * have, so the child would wait for it forever when it closes the handle (a finalizer at exit).
 * Every live guard is on one process-wide list (guards, under guards_mtx, which guards the
 * list only); prepare takes guards_mtx and every guard's lock (held by nobody for long), the
 * parent releases them, the child releases them with inflight set to 0 and the idle condition
 * made anew (its waiters are not in the child either). */
static pthread_mutex_t guards_mtx = PTHREAD_MUTEX_INITIALIZER;
static guard *guards;
static pthread_once_t guards_once = PTHREAD_ONCE_INIT;

static void guards_prepare(void)
{
    pthread_mutex_lock(&guards_mtx);
    for (guard *g = guards; g; g = g->next)
        pthread_mutex_lock(&g->lock);
}

static void guards_parent(void)
{
    for (guard *g = guards; g; g = g->next)
        pthread_mutex_unlock(&g->lock);
    pthread_mutex_unlock(&guards_mtx);
}

static void guards_child(void)
{
    for (guard *g = guards; g; g = g->next) {
        g->inflight = 0;
        memset(&g->idle, 0, sizeof g->idle);
        pthread_cond_init(&g->idle, NULL);
        pthread_mutex_unlock(&g->lock);
    }
    pthread_mutex_unlock(&guards_mtx);
}

static void guards_install(void)
{
    pthread_atfork(guards_prepare, guards_parent, guards_child);
}

static void guard_init(guard *g)
{
    g->closed = 0;
    g->inflight = 0;
    pthread_mutex_init(&g->lock, NULL);
    pthread_cond_init(&g->idle, NULL);
    pthread_once(&guards_once, guards_install);
    pthread_mutex_lock(&guards_mtx);
    g->prev = NULL;
    g->next = guards;
    if (guards)
        guards->prev = g;
    guards = g;
    pthread_mutex_unlock(&guards_mtx);
}

static void guard_fini(guard *g)
{
    pthread_mutex_lock(&guards_mtx);
    if (g->prev || guards == g) {
        if (g->prev)
            g->prev->next = g->next;
        else
            guards = g->next;
        if (g->next)
            g->next->prev = g->prev;
    }
    pthread_mutex_unlock(&guards_mtx);
    pthread_cond_destroy(&g->idle);
    pthread_mutex_destroy(&g->lock);
}

/* For calls that keep the GIL: 0, or -1 with AST_ESHUTDOWN raised if the object is closed
 * (what: "runtime", "store", "shadow"). */
static int guard_open(guard *g, int open, mod_state *st, const char *what)
{
    if (g->closed || !open) {
        char msg[64];
        snprintf(msg, sizeof msg, "the %s is closed", what);
        raise_ast_error(st, AST_ESHUTDOWN, msg);
        return -1;
    }
    return 0;
}

/* Marks one call that will use the handle with the GIL released; -1 as guard_open. */
static int guard_enter(guard *g, int open, mod_state *st, const char *what)
{
    if (guard_open(g, open, st, what) < 0)
        return -1;
    pthread_mutex_lock(&g->lock);
    g->inflight++;
    pthread_mutex_unlock(&g->lock);
    return 0;
}

static void guard_leave(guard *g)
{
    pthread_mutex_lock(&g->lock);
    if (--g->inflight == 0)
        pthread_cond_broadcast(&g->idle);
    pthread_mutex_unlock(&g->lock);
}

/* Waits for every call in flight to leave. Called with the GIL released, after `closed` was set
 * with it held. */
static void guard_drain(guard *g)
{
    pthread_mutex_lock(&g->lock);
    while (g->inflight)
        pthread_cond_wait(&g->idle, &g->lock);
    pthread_mutex_unlock(&g->lock);
}

/* A path argument (str, bytes or os.PathLike) copied into buf; -1 with an exception set. */
static int copy_path(PyObject *o, char *buf, size_t len, const char *what)
{
    PyObject *b = NULL;
    if (!PyUnicode_FSConverter(o, &b))
        return -1;
    const char *p = PyBytes_AS_STRING(b);
    size_t n = (size_t)PyBytes_GET_SIZE(b);
    if (n >= len) {
        PyErr_Format(PyExc_ValueError, "%s is longer than %zu bytes", what, len - 1);
        Py_DECREF(b);
        return -1;
    }
    memcpy(buf, p, n + 1);
    Py_DECREF(b);
    return 0;
}

/* ---- Runtime ------------------------------------------------------------------------------------ */

static int rt_enter(RuntimeObject *self, mod_state *st)
{
    return guard_enter(&self->g, self->rt != NULL, st, "runtime");
}

static void rt_leave(RuntimeObject *self) { guard_leave(&self->g); }

/* For calls that keep the GIL: the runtime, or NULL with AST_ESHUTDOWN raised. */
static ast_runtime *rt_open(RuntimeObject *self, mod_state *st)
{
    if (guard_open(&self->g, self->rt != NULL, st, "runtime") < 0)
        return NULL;
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
    guard_init(&self->g);
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

/* Closes the runtime once: 0, or -1 with the trace-file write failure raised (the runtime is
 * freed either way). */
static int runtime_close_impl(RuntimeObject *self)
{
    if (self->g.closed)
        return 0;
    self->g.closed = 1;
    ast_runtime *rt = self->rt;
    if (!rt)
        return 0;
    char err[ERRBUF_LEN] = "";
    int rc;
    /* Destroy finishes running jobs (they may be long) and writes the trace: never with the GIL
     * held. */
    Py_BEGIN_ALLOW_THREADS
    guard_drain(&self->g);
    rc = ast_runtime_destroy_msg(rt, err, sizeof err);
    Py_END_ALLOW_THREADS
    self->rt = NULL;
    if (rc < 0) {
        raise_ast_error(type_state(Py_TYPE(self)), rc, detail_for(rc, err));
        return -1;
    }
    return 0;
}

static int runtime_traverse(RuntimeObject *self, visitproc visit, void *arg)
{
    Py_VISIT(Py_TYPE(self));
    return 0;
}

/* Reports a failure of an implicit close (dealloc) without losing an exception in flight. */
static void close_in_dealloc(int (*close)(PyObject *), PyObject *self)
{
    PyObject *t, *v, *tb;
    PyErr_Fetch(&t, &v, &tb);
    if (close(self) < 0)
        PyErr_WriteUnraisable(NULL);
    PyErr_Restore(t, v, tb);
}

static int runtime_close_obj(PyObject *self) { return runtime_close_impl((RuntimeObject *)self); }

static void runtime_dealloc(RuntimeObject *self)
{
    PyTypeObject *tp = Py_TYPE(self);
    PyObject_GC_UnTrack(self);
    close_in_dealloc(runtime_close_obj, (PyObject *)self);
    guard_fini(&self->g);
    tp->tp_free((PyObject *)self);
    Py_DECREF(tp);
}

PyDoc_STRVAR(runtime_close_doc,
             "close()\n--\n\nCancel nothing, wait (GIL released) for running jobs, drop queued ones "
             "and free the runtime. With config 'trace' set, completions not yet collected are "
             "traced and the trace file is written; if that write fails the runtime is still "
             "freed and the mapped OSError is raised (on deallocation it is reported as "
             "unraisable). Idempotent; also done on deallocation.");

static PyObject *runtime_close(RuntimeObject *self, PyObject *unused)
{
    if (runtime_close_impl(self) < 0)
        return NULL;
    Py_RETURN_NONE;
}

static PyObject *runtime_enter(RuntimeObject *self, PyObject *unused)
{
    return Py_NewRef(self);
}

static PyObject *runtime_exit(RuntimeObject *self, PyObject *args)
{
    if (runtime_close_impl(self) < 0)
        return NULL;
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
             "version=0, deadline=0, snapshot_step=0, n1=0, in2=None)\n--\n\n"
             "Queue one REFRESH job. op: an AST_OP_* code or its name ('eigh', 'inv_root',\n"
             "'newton_root', 'soap_qr', 'kl_qr', 'soap_rotate'); dtype: 'float32' or 'float64';\n"
             "in0/in1/in2/out0/out1: addresses (int, or None for in1/in2/out1) inside registered\n"
             "buffers. soap_rotate: in0 = X (batch x n x n1), in1 = A pair (batch x 2 x n x n) or\n"
             "None, in2 = B pair (batch x 2 x n1 x n1) or None (not both), out0 = A_new^T A_old X\n"
             "B_old^T B_new; n1 >= 1 is read by soap_rotate only, in2 must be None for the other\n"
             "ops. Returns the ticket.");

static PyObject *runtime_submit(RuntimeObject *self, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"op",  "dtype", "n",     "batch",   "in0",      "in1",
                             "out0", "out1", "p",     "eps",     "block",    "version",
                             "deadline", "snapshot_step", "n1", "in2", NULL};
    mod_state *st = type_state(Py_TYPE(self));
    PyObject *op_o, *dtype_o;
    ast_refresh req;
    memset(&req, 0, sizeof req);
    long long deadline = 0, snapshot_step = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OOiiO&O&O&O&|ddO&O&LLiO&:submit", kwlist,
                                     &op_o, &dtype_o, &req.n, &req.batch, conv_ptr, &req.in0,
                                     conv_optptr, &req.in1, conv_ptr, &req.out0, conv_optptr,
                                     &req.out1, &req.p, &req.eps, conv_u64, &req.block, conv_u64,
                                     &req.version, &deadline, &snapshot_step, &req.n1,
                                     conv_optptr, &req.in2))
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
             "TimeoutError and the job stays pending. Every SIGNAL_SLICE_MS (100 ms) the wait "
             "takes the GIL and runs the signal handlers; an exception they raise (Ctrl-C's "
             "KeyboardInterrupt) ends the wait, and the job stays pending too: wait again (or "
             "poll) for its result.");

/* The check of a wait that runs with the GIL released: takes the GIL, runs Python's signal
 * handlers, releases it again. AST_EINTR (the handler's exception set) when one raised. */
static int check_signals(void *arg)
{
    PyThreadState **ts = arg;
    PyEval_RestoreThread(*ts);
    int rc = PyErr_CheckSignals() < 0 ? AST_EINTR : 0;
    *ts = PyEval_SaveThread();
    return rc;
}

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
    PyThreadState *ts = PyEval_SaveThread();
    rc = ast_runtime_wait_check(rt, ticket, timeout_ns, SIGNAL_SLICE_NS, check_signals, &ts,
                                &res);
    if (rc < 0 && rc != AST_EINTR)
        ast_runtime_last_error(rt, err, sizeof err);
    PyEval_RestoreThread(ts);
    rt_leave(self);
    if (rc == AST_EINTR) /* a signal handler raised: its exception is set */
        return NULL;
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

/* ---- Runtime: trace -------------------------------------------------------------------------- */

static const struct {
    const char *name;
    ast_trace_kind kind;
} kind_table[] = {
    {"instant", AST_TRACE_CUSTOM_INSTANT},   {"span", AST_TRACE_CUSTOM_SPAN},
    {"job_queued", AST_TRACE_JOB_QUEUED},    {"job_started", AST_TRACE_JOB_STARTED},
    {"job_done", AST_TRACE_JOB_DONE},        {"job_run", AST_TRACE_JOB_RUN},
    {"copy_issued", AST_TRACE_COPY_ISSUED},  {"copy_done", AST_TRACE_COPY_DONE},
    {"copy", AST_TRACE_COPY},                {"barrier_begin", AST_TRACE_BARRIER_BEGIN},
    {"barrier_end", AST_TRACE_BARRIER_END},  {"barrier_wait", AST_TRACE_BARRIER_WAIT},
    {"install", AST_TRACE_INSTALL},
};
#define N_KINDS (sizeof kind_table / sizeof kind_table[0])

static const struct {
    const char *name;
    int lane;
} lane_table[] = {
    {"train", AST_TRACE_LANE_TRAIN},
    {"shadow", AST_TRACE_LANE_SHADOW},
    {"coherence", AST_TRACE_LANE_COHERENCE},
    {"nvme", AST_TRACE_LANE_NVME},
};
#define N_LANES (sizeof lane_table / sizeof lane_table[0])

static int parse_kind(PyObject *o, ast_trace_kind *out)
{
    if (PyLong_Check(o)) {
        long v = PyLong_AsLong(o);
        if (v == -1 && PyErr_Occurred())
            return -1;
        if (v >= 0 && v < AST_TRACE_KIND_COUNT) {
            *out = (ast_trace_kind)v;
            return 0;
        }
    } else if (PyUnicode_Check(o)) {
        for (size_t i = 0; i < N_KINDS; i++)
            if (!PyUnicode_CompareWithASCIIString(o, kind_table[i].name)) {
                *out = kind_table[i].kind;
                return 0;
            }
    }
    PyErr_Format(PyExc_ValueError,
                 "unknown trace kind %R; allowed: instant, span, job_queued, job_started, "
                 "job_done, job_run, copy_issued, copy_done, copy, barrier_begin, barrier_end, "
                 "barrier_wait, install (or their codes 0..12)",
                 o);
    return -1;
}

static int parse_lane(PyObject *o, int *out)
{
    if (PyLong_Check(o)) {
        long v = PyLong_AsLong(o);
        if (v == -1 && PyErr_Occurred())
            return -1;
        if (v >= AST_TRACE_LANE_MIN && v <= INT32_MAX - 1000) {
            *out = (int)v;
            return 0;
        }
    } else if (PyUnicode_Check(o)) {
        for (size_t i = 0; i < N_LANES; i++)
            if (!PyUnicode_CompareWithASCIIString(o, lane_table[i].name)) {
                *out = lane_table[i].lane;
                return 0;
            }
    }
    PyErr_Format(PyExc_ValueError,
                 "unknown trace lane %R; allowed: 'train', 'shadow', 'coherence', 'nvme', a "
                 "worker index >= 0, or a named lane in [%d, -1]",
                 o, AST_TRACE_LANE_MIN);
    return -1;
}

/* An optional unsigned argument: sets bit in *args when given. */
static int opt_u64(PyObject *o, uint64_t *out, unsigned *args, unsigned bit)
{
    if (o == Py_None)
        return 0;
    if (!conv_u64(o, out))
        return -1;
    *args |= bit;
    return 0;
}

PyDoc_STRVAR(runtime_trace_event_doc,
             "trace_event(kind, lane, name=None, *, cat=None, ts_ns=None, dur_ns=None, block=None, "
             "version=None, bytes=None, step=None, worker=None, status=None, direction=None)\n--\n\n"
             "Record one event in the runtime's trace (a no-op when config 'trace' is unset).\n"
             "kind: 'instant', 'span' (both need name), 'job_queued', 'job_started', 'job_done',\n"
             "'job_run', 'copy_issued', 'copy_done', 'copy', 'barrier_begin', 'barrier_end',\n"
             "'barrier_wait', 'install', or the code. lane: 'train', 'shadow', 'coherence', 'nvme',\n"
             "a worker index, or a lane in [-999, -1] (see trace_name_lane). ts_ns: a\n"
             "time.monotonic_ns() stamp (None: now); dur_ns: a span's length. block, version,\n"
             "bytes, step, worker, status (an AST_E* code) are written as args when not None;\n"
             "direction: 'd2h' or 'h2d'.");

static PyObject *runtime_trace_event(RuntimeObject *self, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"kind", "lane", "name", "cat", "ts_ns", "dur_ns", "block",
                             "version", "bytes", "step", "worker", "status", "direction", NULL};
    mod_state *st = type_state(Py_TYPE(self));
    PyObject *kind_o, *lane_o, *name_o = Py_None, *cat_o = Py_None, *ts_o = Py_None,
             *dur_o = Py_None, *block_o = Py_None, *version_o = Py_None, *bytes_o = Py_None,
             *step_o = Py_None, *worker_o = Py_None, *status_o = Py_None, *dir_o = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OO|O$OOOOOOOOOO:trace_event", kwlist, &kind_o,
                                     &lane_o, &name_o, &cat_o, &ts_o, &dur_o, &block_o,
                                     &version_o, &bytes_o, &step_o, &worker_o, &status_o, &dir_o))
        return NULL;
    ast_trace_ev ev;
    memset(&ev, 0, sizeof ev);
    if (parse_kind(kind_o, &ev.kind) < 0 || parse_lane(lane_o, &ev.lane) < 0)
        return NULL;
    if (name_o != Py_None && !(ev.name = utf8_no_nul(name_o, "name")))
        return NULL;
    if (cat_o != Py_None && !(ev.cat = utf8_no_nul(cat_o, "cat")))
        return NULL;
    if ((ts_o != Py_None && !conv_u64(ts_o, &ev.ts_ns)) ||
        (dur_o != Py_None && !conv_u64(dur_o, &ev.dur_ns)) ||
        opt_u64(block_o, &ev.block, &ev.args, AST_TRACE_ARG_BLOCK) < 0 ||
        opt_u64(version_o, &ev.version, &ev.args, AST_TRACE_ARG_VERSION) < 0 ||
        opt_u64(bytes_o, &ev.bytes, &ev.args, AST_TRACE_ARG_BYTES) < 0)
        return NULL;
    if (step_o != Py_None) {
        long long v = PyLong_AsLongLong(step_o);
        if (v == -1 && PyErr_Occurred())
            return NULL;
        ev.step = v;
        ev.args |= AST_TRACE_ARG_STEP;
    }
    if (worker_o != Py_None) {
        if (as_int(worker_o, &ev.worker, "worker") < 0)
            return NULL;
        ev.args |= AST_TRACE_ARG_WORKER;
    }
    if (status_o != Py_None) {
        if (as_int(status_o, &ev.status, "status") < 0)
            return NULL;
        ev.args |= AST_TRACE_ARG_STATUS;
    }
    if (dir_o != Py_None) {
        if (PyUnicode_Check(dir_o) && !PyUnicode_CompareWithASCIIString(dir_o, "d2h"))
            ev.dir = AST_TRACE_DIR_D2H;
        else if (PyUnicode_Check(dir_o) && !PyUnicode_CompareWithASCIIString(dir_o, "h2d"))
            ev.dir = AST_TRACE_DIR_H2D;
        else {
            PyErr_Format(PyExc_ValueError, "direction must be 'd2h', 'h2d' or None, got %R",
                         dir_o);
            return NULL;
        }
    }
    ast_runtime *rt = rt_open(self, st);
    if (!rt)
        return NULL;
    /* Kept with the GIL: a short critical section of the recorder; name and cat point into
     * Python strings, which the recorder copies. */
    int rc = ast_runtime_trace_event(rt, &ev);
    if (rc < 0) {
        char err[ERRBUF_LEN] = "";
        ast_runtime_last_error(rt, err, sizeof err);
        return raise_ast_error(st, rc, detail_for(rc, err));
    }
    Py_RETURN_NONE;
}

PyDoc_STRVAR(runtime_trace_name_lane_doc,
             "trace_name_lane(lane, name)\n--\n\nName a lane (an int in [-999, -1] or a worker "
             "index) in the trace; a no-op without a trace.");

static PyObject *runtime_trace_name_lane(RuntimeObject *self, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"lane", "name", NULL};
    mod_state *st = type_state(Py_TYPE(self));
    PyObject *lane_o, *name_o;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OU:trace_name_lane", kwlist, &lane_o, &name_o))
        return NULL;
    int lane;
    const char *name;
    if (parse_lane(lane_o, &lane) < 0 || !(name = utf8_no_nul(name_o, "name")))
        return NULL;
    ast_runtime *rt = rt_open(self, st);
    if (!rt)
        return NULL;
    int rc = ast_runtime_trace_name_lane(rt, lane, name);
    if (rc < 0) {
        char err[ERRBUF_LEN] = "";
        ast_runtime_last_error(rt, err, sizeof err);
        return raise_ast_error(st, rc, detail_for(rc, err));
    }
    Py_RETURN_NONE;
}

PyDoc_STRVAR(runtime_trace_write_doc,
             "trace_write(path=None)\n--\n\nWrite every event recorded so far as Chrome-trace JSON "
             "to path (None: config 'trace'), atomically, GIL released; recording goes on. "
             "AsteriaError (AST_ESTATE) without a trace; the mapped OSError (naming the path) if "
             "the file cannot be written.");

static PyObject *runtime_trace_write(RuntimeObject *self, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"path", NULL};
    mod_state *st = type_state(Py_TYPE(self));
    PyObject *path_o = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "|O:trace_write", kwlist, &path_o))
        return NULL;
    char *path = NULL;
    if (path_o != Py_None) {
        path = PyMem_RawMalloc(AST_PATH_MAX);
        if (!path)
            return PyErr_NoMemory();
        if (copy_path(path_o, path, AST_PATH_MAX, "path") < 0) {
            PyMem_RawFree(path);
            return NULL;
        }
    }
    if (rt_enter(self, st) < 0) {
        PyMem_RawFree(path);
        return NULL;
    }
    ast_runtime *rt = self->rt;
    char err[ERRBUF_LEN] = "";
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = ast_runtime_trace_write(rt, path);
    if (rc < 0)
        ast_runtime_last_error(rt, err, sizeof err);
    Py_END_ALLOW_THREADS
    rt_leave(self);
    PyMem_RawFree(path);
    if (rc < 0)
        return raise_ast_error(st, rc, detail_for(rc, err));
    Py_RETURN_NONE;
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
    return PyBool_FromLong(self->g.closed);
}

static PyObject *runtime_get_tracing(RuntimeObject *self, void *closure)
{
    ast_runtime *rt = rt_open(self, type_state(Py_TYPE(self)));
    if (!rt)
        return NULL;
    return PyBool_FromLong(ast_runtime_tracing(rt));
}

static PyObject *runtime_repr(RuntimeObject *self)
{
    if (self->g.closed || !self->rt)
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
    {"trace_event", (PyCFunction)(void (*)(void))runtime_trace_event,
     METH_VARARGS | METH_KEYWORDS, runtime_trace_event_doc},
    {"trace_name_lane", (PyCFunction)(void (*)(void))runtime_trace_name_lane,
     METH_VARARGS | METH_KEYWORDS, runtime_trace_name_lane_doc},
    {"trace_write", (PyCFunction)(void (*)(void))runtime_trace_write,
     METH_VARARGS | METH_KEYWORDS, runtime_trace_write_doc},
    {"close", (PyCFunction)runtime_close, METH_NOARGS, runtime_close_doc},
    {"__enter__", (PyCFunction)runtime_enter, METH_NOARGS, NULL},
    {"__exit__", (PyCFunction)runtime_exit, METH_VARARGS, NULL},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef runtime_getset[] = {
    {"config", (getter)runtime_get_config, NULL, "The effective config, as a dict.", NULL},
    {"closed", (getter)runtime_get_closed, NULL, "True after close().", NULL},
    {"tracing", (getter)runtime_get_tracing, NULL,
     "True if config 'trace' is set: the runtime records events and writes them at close().",
     NULL},
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

/* ---- Store ---------------------------------------------------------------------------------------
 *
 * Buffers over blocks. Store.buffer(id) returns a BlockBuffer: a buffer-protocol object over a
 * host-addressable block (tier host, host_pinned or uvm) that torch.frombuffer, numpy.frombuffer
 * or memoryview wrap without copying. torch.frombuffer and memoryview keep a reference to the
 * BlockBuffer, not a Py_buffer, so the export lasts exactly as long as the BlockBuffer object:
 * while it lives the block is pinned (move and free raise BusyError, close raises BusyError),
 * and it keeps the Store alive. The pins live in a small C table keyed by block id and are
 * checked and set with the GIL held before a move or free releases it, so another Python thread
 * can neither export a block that is being moved nor move one that is exported. data_ptr() is
 * the raw alternative, with no such protection.
 */

typedef struct {
    uint64_t id;      /* 0: empty slot (store ids are never 0) */
    uint32_t exports; /* live BlockBuffer objects over the block */
    uint32_t busy;    /* a move or free of the block runs with the GIL released */
} pin;

typedef struct {
    pin *slots;
    size_t cap, n; /* cap: 0 or a power of two; linear probing, backward-shift deletion */
} pin_table;

typedef struct {
    PyObject_HEAD
    ast_store *s;
    guard g;
    pin_table pins;
    uint64_t exports; /* live BlockBuffer objects over all blocks */
} StoreObject;

typedef struct {
    PyObject_HEAD
    StoreObject *store; /* strong reference */
    uint64_t id;
    void *ptr;
    size_t nbytes;
    ast_tier tier;
} BlockBufferObject;

static size_t pin_home(const pin_table *t, uint64_t id)
{
    uint64_t h = id * 0x9E3779B97F4A7C15u;
    return (size_t)(h ^ (h >> 32)) & (t->cap - 1);
}

static pin *pin_find(const pin_table *t, uint64_t id)
{
    if (!t->cap)
        return NULL;
    for (size_t i = pin_home(t, id);; i = (i + 1) & (t->cap - 1)) {
        if (t->slots[i].id == id)
            return &t->slots[i];
        if (!t->slots[i].id)
            return NULL;
    }
}

static void pin_place(pin_table *t, pin p)
{
    size_t i = pin_home(t, p.id);
    while (t->slots[i].id)
        i = (i + 1) & (t->cap - 1);
    t->slots[i] = p;
}

/* The pin of id, inserted (zeroed) if absent; NULL with MemoryError set. */
static pin *pin_get(pin_table *t, uint64_t id)
{
    pin *p = pin_find(t, id);
    if (p)
        return p;
    if ((t->n + 1) * 2 > t->cap) {
        size_t ncap = t->cap ? t->cap * 2 : 64;
        pin *ns = PyMem_Calloc(ncap, sizeof *ns);
        if (!ns) {
            PyErr_NoMemory();
            return NULL;
        }
        pin *old = t->slots;
        size_t ocap = t->cap;
        t->slots = ns;
        t->cap = ncap;
        for (size_t i = 0; i < ocap; i++)
            if (old[i].id)
                pin_place(t, old[i]);
        PyMem_Free(old);
    }
    pin_place(t, (pin){id, 0, 0});
    t->n++;
    return pin_find(t, id);
}

/* Drops p's slot if it pins nothing any more. */
static void pin_put(pin_table *t, pin *p)
{
    if (p->exports || p->busy)
        return;
    size_t mask = t->cap - 1, i = (size_t)(p - t->slots);
    for (size_t j = (i + 1) & mask; t->slots[j].id; j = (j + 1) & mask) {
        size_t k = pin_home(t, t->slots[j].id);
        int stays = i <= j ? (i < k && k <= j) : (i < k || k <= j);
        if (!stays) {
            t->slots[i] = t->slots[j];
            i = j;
        }
    }
    t->slots[i] = (pin){0, 0, 0};
    t->n--;
}

static int st_enter(StoreObject *self, mod_state *st)
{
    return guard_enter(&self->g, self->s != NULL, st, "store");
}

/* The store's last error for a call that failed with rc (GIL released by the caller). */
static void store_err(ast_store *s, char *err, size_t len)
{
    ast_store_last_error(s, err, len);
}

static int parse_tier(PyObject *o, ast_tier *out)
{
    const char *name = PyUnicode_Check(o) ? utf8_no_nul(o, "tier") : NULL;
    if (name && ast_tier_parse(name, out) == 0)
        return 0;
    if (PyErr_Occurred() && !PyErr_ExceptionMatches(PyExc_ValueError))
        return -1;
    PyErr_Clear();
    PyErr_Format(PyExc_ValueError,
                 "unknown tier %R; allowed: 'host', 'host_pinned', 'device', 'uvm', 'nvme'", o);
    return -1;
}

static PyObject *tier_str(ast_tier t)
{
    const char *n = ast_tier_name(t);
    return PyUnicode_FromString(n ? n : "unknown");
}

/* 0 if no block of ids is exported or busy; else -1 with BusyError naming the block. */
static int pins_check(StoreObject *self, mod_state *st, const uint64_t *ids, size_t n,
                      const char *what)
{
    char msg[256];
    for (size_t i = 0; i < n; i++) {
        pin *p = pin_find(&self->pins, ids[i]);
        if (p && p->exports) {
            snprintf(msg, sizeof msg,
                     "%s: block %" PRIu64 " has %u exported buffer(s) (Store.buffer); delete "
                     "them and every tensor or memoryview made from them first",
                     what, ids[i], (unsigned)p->exports);
            raise_busy_aware(st, AST_EBUSY, msg);
            return -1;
        }
        if (p && p->busy) {
            snprintf(msg, sizeof msg,
                     "%s: block %" PRIu64 " is being moved or freed by another thread", what,
                     ids[i]);
            raise_busy_aware(st, AST_EBUSY, msg);
            return -1;
        }
    }
    return 0;
}

static void pins_unmark(StoreObject *self, const uint64_t *ids, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        pin *p = pin_find(&self->pins, ids[i]);
        if (p) {
            p->busy = 0;
            pin_put(&self->pins, p);
        }
    }
}

/* Checks, then marks ids busy; -1 with an exception set (nothing left marked). */
static int pins_mark(StoreObject *self, mod_state *st, const uint64_t *ids, size_t n,
                     const char *what)
{
    if (pins_check(self, st, ids, n, what) < 0)
        return -1;
    for (size_t i = 0; i < n; i++) {
        pin *p = pin_get(&self->pins, ids[i]);
        if (!p) {
            pins_unmark(self, ids, i);
            return -1;
        }
        p->busy = 1;
    }
    return 0;
}

static PyObject *store_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"nvme_dir", "direct", "queue_depth", "nvme_budget_bytes", NULL};
    mod_state *st = type_state(type);
    PyObject *dir_o = Py_None;
    const char *direct = "require";
    unsigned int depth = 0;
    uint64_t budget = 0;
    if (!st || !PyArg_ParseTupleAndKeywords(args, kwds, "|OsIO&:Store", kwlist, &dir_o, &direct,
                                            &depth, conv_u64, &budget))
        return NULL;
    ast_store_opts o;
    ast_store_opts_init(&o);
    if (!strcmp(direct, "require"))
        o.direct = AST_DIRECT_REQUIRE;
    else if (!strcmp(direct, "fallback"))
        o.direct = AST_DIRECT_FALLBACK;
    else {
        PyErr_Format(PyExc_ValueError, "direct must be 'require' or 'fallback', got '%s'", direct);
        return NULL;
    }
    o.queue_depth = depth;
    o.nvme_budget_bytes = budget;
    char *dir = NULL;
    if (dir_o != Py_None) {
        dir = PyMem_RawMalloc(AST_PATH_MAX);
        if (!dir)
            return PyErr_NoMemory();
        if (copy_path(dir_o, dir, AST_PATH_MAX, "nvme_dir") < 0) {
            PyMem_RawFree(dir);
            return NULL;
        }
        o.nvme_dir = dir;
    }
    StoreObject *self = (StoreObject *)type->tp_alloc(type, 0);
    if (!self) {
        PyMem_RawFree(dir);
        return NULL;
    }
    guard_init(&self->g);
    ast_store *s = NULL;
    char err[ERRBUF_LEN] = "";
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = ast_store_open_msg(&o, &s, err, sizeof err);
    Py_END_ALLOW_THREADS
    PyMem_RawFree(dir);
    if (rc < 0) {
        Py_DECREF(self);
        return raise_busy_aware(st, rc, err);
    }
    self->s = s;
    return (PyObject *)self;
}

/* Closes once: 0, or -1 with BusyError raised (and the store left open) while buffers are
 * exported. */
static int store_close_impl(StoreObject *self)
{
    if (self->g.closed)
        return 0;
    if (self->exports) {
        char msg[160];
        snprintf(msg, sizeof msg, "close: %" PRIu64 " buffer(s) over store blocks are alive "
                 "(Store.buffer); delete them and every view made from them first",
                 self->exports);
        raise_busy_aware(type_state(Py_TYPE(self)), AST_EBUSY, msg);
        return -1;
    }
    self->g.closed = 1;
    ast_store *s = self->s;
    if (!s)
        return 0;
    /* Close removes every record file: I/O, so without the GIL. */
    Py_BEGIN_ALLOW_THREADS
    guard_drain(&self->g);
    ast_store_close(s);
    Py_END_ALLOW_THREADS
    self->s = NULL;
    return 0;
}

static int store_close_obj(PyObject *self) { return store_close_impl((StoreObject *)self); }

static int store_traverse(StoreObject *self, visitproc visit, void *arg)
{
    Py_VISIT(Py_TYPE(self));
    return 0;
}

static void store_dealloc(StoreObject *self)
{
    PyTypeObject *tp = Py_TYPE(self);
    PyObject_GC_UnTrack(self);
    /* Buffers hold a reference to their store: none can be alive here. */
    close_in_dealloc(store_close_obj, (PyObject *)self);
    guard_fini(&self->g);
    PyMem_Free(self->pins.slots);
    tp->tp_free((PyObject *)self);
    Py_DECREF(tp);
}

PyDoc_STRVAR(store_close_doc,
             "close()\n--\n\nFree every block and remove the store's record files (GIL released). "
             "BusyError while Store.buffer objects are alive. Idempotent; also done on "
             "deallocation.");

static PyObject *store_close(StoreObject *self, PyObject *unused)
{
    if (store_close_impl(self) < 0)
        return NULL;
    Py_RETURN_NONE;
}

static PyObject *store_enter(StoreObject *self, PyObject *unused) { return Py_NewRef(self); }

static PyObject *store_exit(StoreObject *self, PyObject *args)
{
    if (store_close_impl(self) < 0)
        return NULL;
    Py_RETURN_FALSE;
}

PyDoc_STRVAR(store_alloc_doc,
             "alloc(tier, nbytes)\n--\n\nA new zero-filled block of nbytes on tier ('host', "
             "'host_pinned', 'device', 'uvm', 'nvme'); returns its id (never 0). The CUDA tiers "
             "raise AsteriaError (AST_ENODEV) without a device; 'nvme' needs nvme_dir.");

static PyObject *store_alloc(StoreObject *self, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"tier", "nbytes", NULL};
    mod_state *st = type_state(Py_TYPE(self));
    PyObject *tier_o;
    size_t nbytes;
    ast_tier tier;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OO&:alloc", kwlist, &tier_o, conv_size,
                                     &nbytes) ||
        parse_tier(tier_o, &tier) < 0)
        return NULL;
    if (st_enter(self, st) < 0)
        return NULL;
    ast_store *s = self->s;
    uint64_t id = 0;
    char err[ERRBUF_LEN] = "";
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = ast_store_alloc(s, tier, nbytes, &id);
    if (rc < 0)
        store_err(s, err, sizeof err);
    Py_END_ALLOW_THREADS
    guard_leave(&self->g);
    if (rc < 0)
        return raise_busy_aware(st, rc, err);
    return PyLong_FromUnsignedLongLong(id);
}

PyDoc_STRVAR(store_free_doc,
             "free(id)\n--\n\nFree a block (its record file too). BusyError while buffers over it "
             "are alive.");

static PyObject *store_free(StoreObject *self, PyObject *arg)
{
    mod_state *st = type_state(Py_TYPE(self));
    uint64_t id;
    if (!conv_u64(arg, &id))
        return NULL;
    if (st_enter(self, st) < 0)
        return NULL;
    if (pins_mark(self, st, &id, 1, "free") < 0) {
        guard_leave(&self->g);
        return NULL;
    }
    ast_store *s = self->s;
    char err[ERRBUF_LEN] = "";
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = ast_store_free(s, id);
    if (rc < 0)
        store_err(s, err, sizeof err);
    Py_END_ALLOW_THREADS
    guard_leave(&self->g);
    pins_unmark(self, &id, 1);
    if (rc < 0)
        return raise_busy_aware(st, rc, err);
    Py_RETURN_NONE;
}

/* Tier, size and pointer of a block in one call (GIL released); rc 0 or the failure. */
static int store_describe(StoreObject *self, uint64_t id, ast_tier *tier, size_t *nbytes,
                          void **ptr, char *err, size_t len)
{
    ast_store *s = self->s;
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = ast_store_tier(s, id, tier);
    if (!rc)
        rc = ast_store_size(s, id, nbytes);
    if (!rc)
        *ptr = ast_store_data(s, id);
    if (rc < 0)
        store_err(s, err, len);
    Py_END_ALLOW_THREADS
    return rc;
}

PyDoc_STRVAR(store_data_ptr_doc,
             "data_ptr(id)\n--\n\nThe block's address as an int (host or device memory by tier), "
             "or None while it is on NVMe. Valid until the block is moved or freed; nothing "
             "guards its use (Store.buffer does).");

static PyObject *store_data_ptr(StoreObject *self, PyObject *arg)
{
    mod_state *st = type_state(Py_TYPE(self));
    uint64_t id;
    if (!conv_u64(arg, &id) || st_enter(self, st) < 0)
        return NULL;
    ast_tier tier;
    size_t n = 0;
    void *p = NULL;
    char err[ERRBUF_LEN] = "";
    int rc = store_describe(self, id, &tier, &n, &p, err, sizeof err);
    guard_leave(&self->g);
    if (rc < 0)
        return raise_busy_aware(st, rc, err);
    if (!p)
        Py_RETURN_NONE;
    return PyLong_FromVoidPtr(p);
}

PyDoc_STRVAR(store_size_doc, "size(id)\n--\n\nThe block's size in bytes.");

static PyObject *store_size(StoreObject *self, PyObject *arg)
{
    mod_state *st = type_state(Py_TYPE(self));
    uint64_t id;
    if (!conv_u64(arg, &id) || st_enter(self, st) < 0)
        return NULL;
    ast_tier tier;
    size_t n = 0;
    void *p = NULL;
    char err[ERRBUF_LEN] = "";
    int rc = store_describe(self, id, &tier, &n, &p, err, sizeof err);
    guard_leave(&self->g);
    if (rc < 0)
        return raise_busy_aware(st, rc, err);
    return PyLong_FromSize_t(n);
}

PyDoc_STRVAR(store_tier_doc, "tier(id)\n--\n\nThe block's tier name.");

static PyObject *store_tier(StoreObject *self, PyObject *arg)
{
    mod_state *st = type_state(Py_TYPE(self));
    uint64_t id;
    if (!conv_u64(arg, &id) || st_enter(self, st) < 0)
        return NULL;
    ast_tier tier;
    size_t n = 0;
    void *p = NULL;
    char err[ERRBUF_LEN] = "";
    int rc = store_describe(self, id, &tier, &n, &p, err, sizeof err);
    guard_leave(&self->g);
    if (rc < 0)
        return raise_busy_aware(st, rc, err);
    return tier_str(tier);
}

PyDoc_STRVAR(store_move_doc,
             "move(ids, tier)\n--\n\nMove the listed blocks to tier, NVMe I/O batched in one "
             "submission round, GIL released; returns how many moved (blocks already there "
             "count). Each block moves or stays intact. On failure raises the mapped exception "
             "(AsteriaError AST_ECORRUPT for a damaged record, naming block and file) whose "
             "message carries the store's error, with .moved the number of blocks that did move. "
             "BusyError, before anything moves, if a listed block has live buffers.");

static PyObject *store_move(StoreObject *self, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"ids", "tier", NULL};
    mod_state *st = type_state(Py_TYPE(self));
    PyObject *ids_o, *tier_o;
    ast_tier dst;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OO:move", kwlist, &ids_o, &tier_o) ||
        parse_tier(tier_o, &dst) < 0)
        return NULL;
    PyObject *seq = PySequence_Fast(ids_o, "ids must be an iterable of block ids");
    if (!seq)
        return NULL;
    size_t n = (size_t)PySequence_Fast_GET_SIZE(seq);
    uint64_t *ids = PyMem_RawMalloc((n ? n : 1) * sizeof *ids);
    if (!ids) {
        Py_DECREF(seq);
        return PyErr_NoMemory();
    }
    for (size_t i = 0; i < n; i++)
        if (!conv_u64(PySequence_Fast_GET_ITEM(seq, (Py_ssize_t)i), &ids[i])) {
            Py_DECREF(seq);
            PyMem_RawFree(ids);
            return NULL;
        }
    Py_DECREF(seq);
    if (st_enter(self, st) < 0) {
        PyMem_RawFree(ids);
        return NULL;
    }
    if (pins_mark(self, st, ids, n, "move") < 0) {
        guard_leave(&self->g);
        PyMem_RawFree(ids);
        return NULL;
    }
    ast_store *s = self->s;
    size_t moved = 0;
    char err[ERRBUF_LEN] = "";
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = ast_store_move(s, ids, n, dst, &moved);
    if (rc < 0)
        store_err(s, err, sizeof err);
    Py_END_ALLOW_THREADS
    guard_leave(&self->g);
    pins_unmark(self, ids, n);
    PyMem_RawFree(ids);
    if (rc == 0)
        return PyLong_FromSize_t(moved);
    char detail[ERRBUF_LEN + 64];
    snprintf(detail, sizeof detail, "%s; %zu of %zu blocks moved", err, moved, n);
    PyObject *exc = new_ast_error(st, rc == AST_EBUSY ? st->busy_error : NULL, rc, detail);
    if (!exc)
        return NULL;
    PyObject *m = PyLong_FromSize_t(moved);
    if (!m || PyObject_SetAttrString(exc, "moved", m) < 0) {
        Py_XDECREF(m);
        Py_DECREF(exc);
        return NULL;
    }
    Py_DECREF(m);
    return raise_exc(exc);
}

PyDoc_STRVAR(store_stats_doc,
             "stats()\n--\n\n{'bytes': {tier: live bytes}, 'blocks': {tier: count}, "
             "'nvme_bytes_written', 'nvme_bytes_read', 'nvme_write_ns', 'nvme_read_ns', "
             "'nvme_writes', 'nvme_reads' (records), 'nvme_direct': True (O_DIRECT), False "
             "(buffered fallback) or None (no NVMe tier)}.");

static PyObject *store_stats(StoreObject *self, PyObject *unused)
{
    mod_state *st = type_state(Py_TYPE(self));
    if (st_enter(self, st) < 0)
        return NULL;
    ast_store *s = self->s;
    ast_store_stats ss;
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = ast_store_stats_get(s, &ss);
    Py_END_ALLOW_THREADS
    guard_leave(&self->g);
    if (rc < 0)
        return raise_busy_aware(st, rc, NULL);
    PyObject *d = PyDict_New(), *bytes = PyDict_New(), *blocks = PyDict_New();
    if (!d || !bytes || !blocks)
        goto fail;
    for (int t = 0; t < AST_TIER_COUNT; t++)
        if (dict_set_steal(bytes, ast_tier_name((ast_tier)t),
                           PyLong_FromUnsignedLongLong(ss.bytes[t])) < 0 ||
            dict_set_steal(blocks, ast_tier_name((ast_tier)t),
                           PyLong_FromUnsignedLongLong(ss.blocks[t])) < 0)
            goto fail;
#define U64(f) dict_set_steal(d, #f, PyLong_FromUnsignedLongLong(ss.f))
    if (PyDict_SetItemString(d, "bytes", bytes) < 0 ||
        PyDict_SetItemString(d, "blocks", blocks) < 0 || U64(nvme_bytes_written) ||
        U64(nvme_bytes_read) || U64(nvme_write_ns) || U64(nvme_read_ns) || U64(nvme_writes) ||
        U64(nvme_reads) ||
        dict_set_steal(d, "nvme_direct",
                       ss.nvme_direct < 0 ? Py_NewRef(Py_None) : PyBool_FromLong(ss.nvme_direct)))
        goto fail;
#undef U64
    Py_DECREF(bytes);
    Py_DECREF(blocks);
    return d;
fail:
    Py_XDECREF(d);
    Py_XDECREF(bytes);
    Py_XDECREF(blocks);
    return NULL;
}

PyDoc_STRVAR(store_record_path_doc,
             "record_path(id)\n--\n\nPath of the record file of a block on NVMe (AsteriaError "
             "AST_ESTATE on another tier).");

static PyObject *store_record_path(StoreObject *self, PyObject *arg)
{
    mod_state *st = type_state(Py_TYPE(self));
    uint64_t id;
    if (!conv_u64(arg, &id) || st_enter(self, st) < 0)
        return NULL;
    ast_store *s = self->s;
    char path[AST_PATH_MAX + 64];
    char err[ERRBUF_LEN] = "";
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = ast_store_record_path(s, id, path, sizeof path);
    if (rc < 0)
        store_err(s, err, sizeof err);
    Py_END_ALLOW_THREADS
    guard_leave(&self->g);
    if (rc < 0)
        return raise_busy_aware(st, rc, err);
    return PyUnicode_DecodeFSDefault(path);
}

PyDoc_STRVAR(store_last_error_doc,
             "last_error()\n--\n\nThe store's last error message ('' if none).");

static PyObject *store_last_error(StoreObject *self, PyObject *unused)
{
    mod_state *st = type_state(Py_TYPE(self));
    if (st_enter(self, st) < 0)
        return NULL;
    ast_store *s = self->s;
    char buf[ERRBUF_LEN] = "";
    Py_BEGIN_ALLOW_THREADS
    store_err(s, buf, sizeof buf);
    Py_END_ALLOW_THREADS
    guard_leave(&self->g);
    return PyUnicode_DecodeUTF8(buf, (Py_ssize_t)strlen(buf), "replace");
}

PyDoc_STRVAR(store_buffer_doc,
             "buffer(id)\n--\n\nA writable BlockBuffer (buffer protocol, bytes) over a block on "
             "a host-addressable tier (host, host_pinned, uvm), for torch.frombuffer /\n"
             "memoryview without copying. Lifetime: while the BlockBuffer lives (torch.frombuffer "
             "and memoryview keep it alive) the block is pinned: move() and free() of it and "
             "close() raise BusyError. AsteriaError (AST_ESTATE) for a block on device or NVMe.");

static PyObject *store_buffer(StoreObject *self, PyObject *arg)
{
    mod_state *st = type_state(Py_TYPE(self));
    uint64_t id;
    if (!conv_u64(arg, &id) || st_enter(self, st) < 0)
        return NULL;
    /* Pin first (GIL held): a concurrent move or free of the block is refused from here on.
     * Several buffers may share a block; one being moved or freed cannot be exported. */
    pin *p = pin_find(&self->pins, id);
    if (p && p->busy) {
        char msg[160];
        snprintf(msg, sizeof msg, "buffer: block %" PRIu64 " is being moved or freed by another "
                 "thread", id);
        guard_leave(&self->g);
        return raise_busy_aware(st, AST_EBUSY, msg);
    }
    if (!(p = pin_get(&self->pins, id))) {
        guard_leave(&self->g);
        return NULL;
    }
    p->exports++;
    self->exports++;
    ast_tier tier;
    size_t n = 0;
    void *ptr = NULL;
    char err[ERRBUF_LEN] = "";
    int rc = store_describe(self, id, &tier, &n, &ptr, err, sizeof err);
    guard_leave(&self->g);
    if (rc == 0 && (tier == AST_TIER_DEVICE || tier == AST_TIER_NVME || !ptr)) {
        snprintf(err, sizeof err, "buffer: block %" PRIu64 " is on tier %s; buffers need a "
                 "host-addressable tier (host, host_pinned, uvm)", id, ast_tier_name(tier));
        rc = AST_ESTATE;
    }
    BlockBufferObject *b = NULL;
    if (rc == 0)
        b = PyObject_New(BlockBufferObject, st->blockbuf_type);
    if (!b) {
        p = pin_find(&self->pins, id); /* the table may have grown meanwhile */
        p->exports--;
        self->exports--;
        pin_put(&self->pins, p);
        return rc < 0 ? raise_busy_aware(st, rc, err) : NULL;
    }
    b->store = (StoreObject *)Py_NewRef(self);
    b->id = id;
    b->ptr = ptr;
    b->nbytes = n;
    b->tier = tier;
    return (PyObject *)b;
}

PyDoc_STRVAR(store_exports_doc,
             "exports(id=None)\n--\n\nLive BlockBuffer objects over block id (None: over all "
             "blocks).");

static PyObject *store_exports(StoreObject *self, PyObject *args)
{
    PyObject *id_o = Py_None;
    if (!PyArg_ParseTuple(args, "|O:exports", &id_o))
        return NULL;
    if (id_o == Py_None)
        return PyLong_FromUnsignedLongLong(self->exports);
    uint64_t id;
    if (!conv_u64(id_o, &id))
        return NULL;
    pin *p = pin_find(&self->pins, id);
    return PyLong_FromUnsignedLong(p ? p->exports : 0);
}

static PyObject *store_get_closed(StoreObject *self, void *closure)
{
    return PyBool_FromLong(self->g.closed);
}

static PyMethodDef store_methods[] = {
    {"alloc", (PyCFunction)(void (*)(void))store_alloc, METH_VARARGS | METH_KEYWORDS,
     store_alloc_doc},
    {"free", (PyCFunction)store_free, METH_O, store_free_doc},
    {"data_ptr", (PyCFunction)store_data_ptr, METH_O, store_data_ptr_doc},
    {"size", (PyCFunction)store_size, METH_O, store_size_doc},
    {"tier", (PyCFunction)store_tier, METH_O, store_tier_doc},
    {"move", (PyCFunction)(void (*)(void))store_move, METH_VARARGS | METH_KEYWORDS,
     store_move_doc},
    {"stats", (PyCFunction)store_stats, METH_NOARGS, store_stats_doc},
    {"record_path", (PyCFunction)store_record_path, METH_O, store_record_path_doc},
    {"last_error", (PyCFunction)store_last_error, METH_NOARGS, store_last_error_doc},
    {"buffer", (PyCFunction)store_buffer, METH_O, store_buffer_doc},
    {"exports", (PyCFunction)store_exports, METH_VARARGS, store_exports_doc},
    {"close", (PyCFunction)store_close, METH_NOARGS, store_close_doc},
    {"__enter__", (PyCFunction)store_enter, METH_NOARGS, NULL},
    {"__exit__", (PyCFunction)store_exit, METH_VARARGS, NULL},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef store_getset[] = {
    {"closed", (getter)store_get_closed, NULL, "True after close().", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

PyDoc_STRVAR(store_doc,
             "Store(nvme_dir=None, direct='require', queue_depth=0, nvme_budget_bytes=0)\n--\n\n"
             "Blocks of optimizer state, each on one tier: host, host_pinned, device, uvm, nvme "
             "(record files under nvme_dir,\nthrough io_uring with O_DIRECT; direct='fallback' "
             "accepts a filesystem without O_DIRECT). A missing nvme_dir raises\n"
             "FileNotFoundError naming it. Block ids are ints (never 0).");

static PyType_Slot store_slots[] = {
    {Py_tp_new, store_new},
    {Py_tp_dealloc, store_dealloc},
    {Py_tp_traverse, store_traverse},
    {Py_tp_methods, store_methods},
    {Py_tp_getset, store_getset},
    {Py_tp_doc, (void *)store_doc},
    {0, NULL},
};

static PyType_Spec store_spec = {
    .name = "asteria._C.Store",
    .basicsize = sizeof(StoreObject),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_IMMUTABLETYPE,
    .slots = store_slots,
};

/* ---- BlockBuffer ------------------------------------------------------------------------------ */

static void blockbuf_dealloc(BlockBufferObject *self)
{
    PyTypeObject *tp = Py_TYPE(self);
    StoreObject *s = self->store;
    pin *p = pin_find(&s->pins, self->id);
    if (p) {
        p->exports--;
        pin_put(&s->pins, p);
    }
    s->exports--;
    Py_DECREF(s);
    tp->tp_free((PyObject *)self);
    Py_DECREF(tp);
}

static int blockbuf_getbuffer(BlockBufferObject *self, Py_buffer *view, int flags)
{
    return PyBuffer_FillInfo(view, (PyObject *)self, self->ptr, (Py_ssize_t)self->nbytes, 0,
                             flags);
}

static PyObject *blockbuf_get_id(BlockBufferObject *self, void *c)
{
    return PyLong_FromUnsignedLongLong(self->id);
}

static PyObject *blockbuf_get_nbytes(BlockBufferObject *self, void *c)
{
    return PyLong_FromSize_t(self->nbytes);
}

static PyObject *blockbuf_get_ptr(BlockBufferObject *self, void *c)
{
    return PyLong_FromVoidPtr(self->ptr);
}

static PyObject *blockbuf_get_tier(BlockBufferObject *self, void *c)
{
    return tier_str(self->tier);
}

static Py_ssize_t blockbuf_len(BlockBufferObject *self) { return (Py_ssize_t)self->nbytes; }

static PyObject *blockbuf_repr(BlockBufferObject *self)
{
    return PyUnicode_FromFormat("<%s block=%llu tier=%s nbytes=%zu>", Py_TYPE(self)->tp_name,
                                (unsigned long long)self->id, ast_tier_name(self->tier),
                                self->nbytes);
}

static PyGetSetDef blockbuf_getset[] = {
    {"id", (getter)blockbuf_get_id, NULL, "The block id.", NULL},
    {"nbytes", (getter)blockbuf_get_nbytes, NULL, "The block size in bytes.", NULL},
    {"ptr", (getter)blockbuf_get_ptr, NULL, "The block address.", NULL},
    {"tier", (getter)blockbuf_get_tier, NULL, "The block tier at export.", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyType_Slot blockbuf_slots[] = {
    {Py_tp_dealloc, blockbuf_dealloc},
    {Py_tp_repr, blockbuf_repr},
    {Py_tp_getset, blockbuf_getset},
    {Py_sq_length, blockbuf_len},
    {Py_bf_getbuffer, blockbuf_getbuffer},
    {Py_tp_doc, (void *)"A writable bytes buffer over one host-addressable Store block (see "
                        "Store.buffer). Pins the block while alive."},
    {0, NULL},
};

static PyType_Spec blockbuf_spec = {
    .name = "asteria._C.BlockBuffer",
    .basicsize = sizeof(BlockBufferObject),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_IMMUTABLETYPE | Py_TPFLAGS_DISALLOW_INSTANTIATION,
    .slots = blockbuf_slots,
};

/* ---- Shadow --------------------------------------------------------------------------------------
 *
 * Snapshot tickets are ints (the ticket id); the binding keeps each live ticket's host pointer
 * and size in a table touched with the GIL held, and passes a stack copy to calls that release
 * it.
 */

typedef struct {
    PyObject_HEAD
    ast_shadow *sh;
    guard g;
    ast_shadow_ticket *tickets; /* live snapshot tickets; id 0: free entry */
    size_t captickets;
} ShadowObject;

static int sh_enter(ShadowObject *self, mod_state *st)
{
    return guard_enter(&self->g, self->sh != NULL, st, "shadow");
}

static ast_shadow_ticket *ticket_find(ShadowObject *self, uint64_t id)
{
    for (size_t i = 0; id && i < self->captickets; i++)
        if (self->tickets[i].id == id)
            return &self->tickets[i];
    return NULL;
}

/* The ticket of id (a copy) or -1 with FileNotFoundError (AST_ENOENT) raised. */
static int ticket_get(ShadowObject *self, mod_state *st, uint64_t id, ast_shadow_ticket *out)
{
    ast_shadow_ticket *t = ticket_find(self, id);
    if (!t) {
        char msg[96];
        snprintf(msg, sizeof msg, "snapshot ticket %" PRIu64 " unknown or released", id);
        raise_ast_error(st, AST_ENOENT, msg);
        return -1;
    }
    *out = *t;
    return 0;
}

static int ticket_add(ShadowObject *self, const ast_shadow_ticket *t)
{
    ast_shadow_ticket *slot = NULL;
    for (size_t i = 0; !slot && i < self->captickets; i++)
        if (!self->tickets[i].id)
            slot = &self->tickets[i];
    if (!slot) {
        size_t ncap = self->captickets ? self->captickets * 2 : 64;
        ast_shadow_ticket *nt = PyMem_Realloc(self->tickets, ncap * sizeof *nt);
        if (!nt) {
            PyErr_NoMemory();
            return -1;
        }
        memset(nt + self->captickets, 0, (ncap - self->captickets) * sizeof *nt);
        slot = nt + self->captickets;
        self->tickets = nt;
        self->captickets = ncap;
    }
    *slot = *t;
    return 0;
}

/* The shadow's last error for a call that failed (GIL released by the caller). */
static void shadow_err(ast_shadow *sh, char *err, size_t len)
{
    ast_shadow_last_error(sh, err, len);
}

static int conv_opt_size(PyObject *o, void *out)
{
    if (o == Py_None)
        return 1;
    return conv_size(o, out);
}

static PyObject *shadow_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"mode", "snapshot_ring_bytes", "prefetch_ring_bytes", "slots",
                             "device", NULL};
    mod_state *st = type_state(type);
    const char *mode = "auto";
    ast_shadow_opts o;
    ast_shadow_opts_init(&o);
    size_t slots = o.max_slots;
    if (!st || !PyArg_ParseTupleAndKeywords(args, kwds, "|sO&O&O&i:Shadow", kwlist, &mode,
                                            conv_opt_size, &o.snapshot_bytes, conv_opt_size,
                                            &o.ring_bytes, conv_opt_size, &slots, &o.device))
        return NULL;
    if (!strcmp(mode, "auto"))
        o.mode = AST_SHADOW_AUTO;
    else if (!strcmp(mode, "host"))
        o.mode = AST_SHADOW_HOST;
    else if (!strcmp(mode, "cuda"))
        o.mode = AST_SHADOW_CUDA;
    else {
        PyErr_Format(PyExc_ValueError, "mode must be 'auto', 'host' or 'cuda', got '%s'", mode);
        return NULL;
    }
    if (slots > UINT32_MAX) {
        PyErr_SetString(PyExc_OverflowError, "slots does not fit in a C unsigned int");
        return NULL;
    }
    o.max_slots = (unsigned)slots;
    ShadowObject *self = (ShadowObject *)type->tp_alloc(type, 0);
    if (!self)
        return NULL;
    guard_init(&self->g);
    ast_shadow *sh = NULL;
    char err[ERRBUF_LEN] = "";
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = ast_shadow_create_msg(&o, &sh, err, sizeof err);
    Py_END_ALLOW_THREADS
    if (rc < 0) {
        Py_DECREF(self);
        return raise_busy_aware(st, rc, err);
    }
    self->sh = sh;
    return (PyObject *)self;
}

static int shadow_close_impl(ShadowObject *self)
{
    if (self->g.closed)
        return 0;
    self->g.closed = 1;
    ast_shadow *sh = self->sh;
    if (!sh)
        return 0;
    /* Destroy waits for every copy in flight. */
    Py_BEGIN_ALLOW_THREADS
    guard_drain(&self->g);
    ast_shadow_destroy(sh);
    Py_END_ALLOW_THREADS
    self->sh = NULL;
    return 0;
}

static int shadow_close_obj(PyObject *self) { return shadow_close_impl((ShadowObject *)self); }

static int shadow_traverse(ShadowObject *self, visitproc visit, void *arg)
{
    Py_VISIT(Py_TYPE(self));
    return 0;
}

static void shadow_dealloc(ShadowObject *self)
{
    PyTypeObject *tp = Py_TYPE(self);
    PyObject_GC_UnTrack(self);
    close_in_dealloc(shadow_close_obj, (PyObject *)self);
    guard_fini(&self->g);
    PyMem_Free(self->tickets);
    tp->tp_free((PyObject *)self);
    Py_DECREF(tp);
}

PyDoc_STRVAR(shadow_close_doc,
             "close()\n--\n\nWait (GIL released) for every copy in flight and free the stream, "
             "events and rings; pointers it handed out become invalid. Idempotent; also done on "
             "deallocation.");

static PyObject *shadow_close(ShadowObject *self, PyObject *unused)
{
    shadow_close_impl(self);
    Py_RETURN_NONE;
}

static PyObject *shadow_enter(ShadowObject *self, PyObject *unused) { return Py_NewRef(self); }

static PyObject *shadow_exit(ShadowObject *self, PyObject *args)
{
    shadow_close_impl(self);
    Py_RETURN_FALSE;
}

/* Raises the failure of a shadow call: the message the call left, if it is this code's. */
static PyObject *shadow_raise(mod_state *st, int rc, const char *err)
{
    const char *d = detail_for(rc, err);
    /* last_error is per handle and kept across successes: use it only if it names this code. */
    if (d == err && err[0])
        d = NULL;
    return raise_busy_aware(st, rc, d);
}

PyDoc_STRVAR(shadow_snapshot_doc,
             "snapshot(src_ptr, nbytes, wait_event_ptr=0)\n--\n\nCopy nbytes at src_ptr (device "
             "memory on the CUDA path, host memory on the host path) into the snapshot ring,\n"
             "after the shadow stream waited on wait_event_ptr (a cudaEvent_t as int; 0: none; "
             "CUDA path only). Returns the ticket (int). BusyError when the ring is full\n"
             "(release snapshots); ValueError for a size above the ring capacity. GIL released.");

/* Issues the snapshot of the pieces (entered with sh_enter; leaves the guard). */
static PyObject *snapshot_issue(ShadowObject *self, mod_state *st, const ast_shadow_piece *pc,
                                int npc, void *ev)
{
    ast_shadow *sh = self->sh;
    ast_shadow_ticket t;
    char err[ERRBUF_LEN] = "";
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = ast_shadow_snapshotv(sh, pc, npc, ev, &t);
    if (rc < 0)
        shadow_err(sh, err, sizeof err);
    Py_END_ALLOW_THREADS
    if (rc == 0 && ticket_add(self, &t) < 0) {
        /* No room to remember it: give the slot back rather than leak it. */
        Py_BEGIN_ALLOW_THREADS
        ast_shadow_snapshot_release(sh, &t);
        Py_END_ALLOW_THREADS
        guard_leave(&self->g);
        return NULL;
    }
    guard_leave(&self->g);
    if (rc < 0)
        return shadow_raise(st, rc, err);
    return PyLong_FromUnsignedLongLong(t.id);
}

static PyObject *shadow_snapshot(ShadowObject *self, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"src_ptr", "nbytes", "wait_event_ptr", NULL};
    mod_state *st = type_state(Py_TYPE(self));
    ast_shadow_piece one;
    void *ev = NULL;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O&O&|O&:snapshot", kwlist, conv_ptr, &one.src,
                                     conv_size, &one.nbytes, conv_optptr, &ev) ||
        sh_enter(self, st) < 0)
        return NULL;
    return snapshot_issue(self, st, &one, 1, ev);
}

#define GATHER_MAX_PIECES 65536

PyDoc_STRVAR(shadow_snapshot_gather_doc,
             "snapshot_gather(pieces, wait_event_ptr=0)\n--\n\nLike snapshot, for a sequence "
             "of (src_ptr, nbytes) pairs copied back to back into ONE slot\n(the stacked operand "
             "of a batched job, without stacking it first). ValueError for an empty\nsequence, a "
             "zero-sized or NULL piece, or a total above the ring capacity. GIL released.");

static PyObject *shadow_snapshot_gather(ShadowObject *self, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"pieces", "wait_event_ptr", NULL};
    mod_state *st = type_state(Py_TYPE(self));
    PyObject *seq_in;
    void *ev = NULL;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O|O&:snapshot_gather", kwlist, &seq_in,
                                     conv_optptr, &ev))
        return NULL;
    PyObject *seq = PySequence_Fast(seq_in, "pieces must be a sequence of (src_ptr, nbytes)");
    if (!seq)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    if (n < 1 || n > GATHER_MAX_PIECES) {
        Py_DECREF(seq);
        return PyErr_Format(PyExc_ValueError, "snapshot_gather: %zd pieces; allowed 1 to %d", n,
                            GATHER_MAX_PIECES);
    }
    ast_shadow_piece *pc = PyMem_Calloc((size_t)n, sizeof *pc);
    if (!pc) {
        Py_DECREF(seq);
        return PyErr_NoMemory();
    }
    PyObject *out = NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *item = PySequence_Fast_GET_ITEM(seq, i);
        if (!PyTuple_Check(item) || PyTuple_GET_SIZE(item) != 2) {
            PyErr_Format(PyExc_TypeError, "snapshot_gather: piece %zd must be a (src_ptr, "
                         "nbytes) tuple", i);
            goto done;
        }
        if (!conv_ptr(PyTuple_GET_ITEM(item, 0), &pc[i].src) ||
            !conv_size(PyTuple_GET_ITEM(item, 1), &pc[i].nbytes))
            goto done;
    }
    if (sh_enter(self, st) < 0)
        goto done;
    out = snapshot_issue(self, st, pc, (int)n, ev);
done:
    PyMem_Free(pc);
    Py_DECREF(seq);
    return out;
}

/* Snapshot calls that take a ticket: 0 query, 1 wait, 2 event, 3 release. */
static PyObject *shadow_ticket_call(ShadowObject *self, PyObject *arg, int what)
{
    mod_state *st = type_state(Py_TYPE(self));
    uint64_t id;
    ast_shadow_ticket t;
    if (!conv_u64(arg, &id) || sh_enter(self, st) < 0)
        return NULL;
    if (ticket_get(self, st, id, &t) < 0) {
        guard_leave(&self->g);
        return NULL;
    }
    ast_shadow *sh = self->sh;
    void *ev = NULL;
    char err[ERRBUF_LEN] = "";
    int rc;
    Py_BEGIN_ALLOW_THREADS
    switch (what) {
    case 0:
        rc = ast_shadow_snapshot_query(sh, &t);
        break;
    case 1:
        rc = ast_shadow_snapshot_wait(sh, &t);
        break;
    case 2:
        rc = ast_shadow_snapshot_event(sh, &t, &ev);
        break;
    default:
        rc = ast_shadow_snapshot_release(sh, &t);
        break;
    }
    if (rc < 0 && !(what == 0 && rc == AST_EBUSY))
        shadow_err(sh, err, sizeof err);
    Py_END_ALLOW_THREADS
    guard_leave(&self->g);
    if (what == 3 && (rc == 0 || rc == AST_ENOENT)) {
        ast_shadow_ticket *e = ticket_find(self, id);
        if (e)
            memset(e, 0, sizeof *e);
    }
    if (what == 0 && (rc == 0 || rc == AST_EBUSY))
        return PyBool_FromLong(rc == 0);
    if (rc < 0)
        return shadow_raise(st, rc, err);
    if (what == 1)
        return PyLong_FromVoidPtr(t.host);
    if (what == 2)
        return PyLong_FromVoidPtr(ev);
    Py_RETURN_NONE;
}

PyDoc_STRVAR(shadow_snapshot_query_doc,
             "snapshot_query(ticket)\n--\n\nTrue once the snapshot copy has landed, False while "
             "in flight.");

static PyObject *shadow_snapshot_query(ShadowObject *self, PyObject *arg)
{
    return shadow_ticket_call(self, arg, 0);
}

PyDoc_STRVAR(shadow_snapshot_wait_doc,
             "snapshot_wait(ticket)\n--\n\nBlock (GIL released, no spinning) until the copy has "
             "landed; returns the staged host pointer (int), valid until snapshot_release.");

static PyObject *shadow_snapshot_wait(ShadowObject *self, PyObject *arg)
{
    return shadow_ticket_call(self, arg, 1);
}

PyDoc_STRVAR(shadow_snapshot_event_doc,
             "snapshot_event(ticket)\n--\n\nThe cudaEvent_t (int) recorded after the snapshot "
             "copy, for the main stream to wait on before overwriting the source; 0 on the host "
             "path.");

static PyObject *shadow_snapshot_event(ShadowObject *self, PyObject *arg)
{
    return shadow_ticket_call(self, arg, 2);
}

PyDoc_STRVAR(shadow_snapshot_release_doc,
             "snapshot_release(ticket)\n--\n\nGive the snapshot slot back; its host pointer must "
             "not be read afterwards.");

static PyObject *shadow_snapshot_release(ShadowObject *self, PyObject *arg)
{
    return shadow_ticket_call(self, arg, 3);
}

PyDoc_STRVAR(shadow_prefetch_doc,
             "prefetch(host_ptr, nbytes, key)\n--\n\nCopy nbytes at host_ptr into the prefetch "
             "ring for key (an int unique among staged keys); returns the slot's device\n"
             "pointer (host memory on the host path), usable once ready_event(key) is waited on. "
             "BusyError when the ring is full (release keys); AsteriaError (AST_ESTATE)\n"
             "if key is already staged. GIL released.");

static PyObject *shadow_prefetch(ShadowObject *self, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"host_ptr", "nbytes", "key", NULL};
    mod_state *st = type_state(Py_TYPE(self));
    void *src, *dev = NULL;
    size_t nbytes;
    uint64_t key;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O&O&O&:prefetch", kwlist, conv_ptr, &src,
                                     conv_size, &nbytes, conv_u64, &key) ||
        sh_enter(self, st) < 0)
        return NULL;
    ast_shadow *sh = self->sh;
    char err[ERRBUF_LEN] = "";
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = ast_shadow_prefetch(sh, src, nbytes, key, &dev);
    if (rc < 0)
        shadow_err(sh, err, sizeof err);
    Py_END_ALLOW_THREADS
    guard_leave(&self->g);
    if (rc < 0)
        return shadow_raise(st, rc, err);
    return PyLong_FromVoidPtr(dev);
}

/* Prefetch calls that take a key: 0 lookup, 1 wait, 2 ready event, 3 release, 4 release after
 * stream. */
static PyObject *shadow_key_call(ShadowObject *self, uint64_t key, int what, uintptr_t stream)
{
    mod_state *st = type_state(Py_TYPE(self));
    if (sh_enter(self, st) < 0)
        return NULL;
    ast_shadow *sh = self->sh;
    void *p = NULL;
    size_t n = 0;
    char err[ERRBUF_LEN] = "";
    int rc;
    Py_BEGIN_ALLOW_THREADS
    switch (what) {
    case 0:
        rc = ast_shadow_lookup(sh, key, &p, &n);
        break;
    case 1:
        rc = ast_shadow_prefetch_wait(sh, key);
        break;
    case 2:
        rc = ast_shadow_ready_event(sh, key, &p);
        break;
    case 3:
        rc = ast_shadow_release(sh, key);
        break;
    default:
        rc = ast_shadow_release_after(sh, key, stream);
        break;
    }
    if (rc < 0 && !(what == 0 && (rc == AST_EBUSY || rc == AST_ENOENT)))
        shadow_err(sh, err, sizeof err);
    Py_END_ALLOW_THREADS
    guard_leave(&self->g);
    if (what == 0) {
        if (rc == AST_ENOENT)
            Py_RETURN_NONE;
        if (rc == 0 || rc == AST_EBUSY)
            return Py_BuildValue("(NnO)", PyLong_FromVoidPtr(p), (Py_ssize_t)n,
                                 rc == 0 ? Py_True : Py_False);
    }
    if (rc < 0)
        return shadow_raise(st, rc, err);
    if (what == 2)
        return PyLong_FromVoidPtr(p);
    Py_RETURN_NONE;
}

static PyObject *shadow_key_arg(ShadowObject *self, PyObject *arg, int what)
{
    uint64_t key;
    if (!conv_u64(arg, &key))
        return NULL;
    return shadow_key_call(self, key, what, 0);
}

PyDoc_STRVAR(shadow_lookup_doc,
             "lookup(key)\n--\n\n(device_ptr, nbytes, ready) of key's slot, ready True once its "
             "copy completed (the pointer is usable in stream order before that); None if key "
             "is not staged.");

static PyObject *shadow_lookup(ShadowObject *self, PyObject *arg)
{
    return shadow_key_arg(self, arg, 0);
}

PyDoc_STRVAR(shadow_prefetch_wait_doc,
             "prefetch_wait(key)\n--\n\nBlock (GIL released) until key's copy has completed.");

static PyObject *shadow_prefetch_wait(ShadowObject *self, PyObject *arg)
{
    return shadow_key_arg(self, arg, 1);
}

PyDoc_STRVAR(shadow_ready_event_doc,
             "ready_event(key)\n--\n\nThe slot's ready cudaEvent_t as an int (0 on the host "
             "path), valid until release; torch.cuda.Event cannot wrap it, wait on it with "
             "cudaStreamWaitEvent.");

static PyObject *shadow_ready_event(ShadowObject *self, PyObject *arg)
{
    return shadow_key_arg(self, arg, 2);
}

PyDoc_STRVAR(shadow_release_doc,
             "release(key)\n--\n\nRelease key's slot now (no reads of it pending).");

static PyObject *shadow_release(ShadowObject *self, PyObject *arg)
{
    return shadow_key_arg(self, arg, 3);
}

PyDoc_STRVAR(shadow_release_after_doc,
             "release_after(key, stream)\n--\n\nRelease key's slot once the work queued so far on "
             "stream (a cudaStream_t as int, e.g. torch.cuda.current_stream().cuda_stream; 0: "
             "the default stream) has passed. On the host path the same as release.");

static PyObject *shadow_release_after(ShadowObject *self, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"key", "stream", NULL};
    uint64_t key;
    void *stream = NULL;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O&|O&:release_after", kwlist, conv_u64, &key,
                                     conv_optptr, &stream))
        return NULL;
    return shadow_key_call(self, key, 4, (uintptr_t)stream);
}

PyDoc_STRVAR(shadow_stream_handle_doc,
             "stream_handle()\n--\n\nThe shadow cudaStream_t as an int, for "
             "torch.cuda.ExternalStream. AsteriaError (AST_ENODEV) on the host path.");

static PyObject *shadow_stream_handle(ShadowObject *self, PyObject *unused)
{
    mod_state *st = type_state(Py_TYPE(self));
    if (guard_open(&self->g, self->sh != NULL, st, "shadow") < 0)
        return NULL;
    uintptr_t h = 0;
    int rc = ast_shadow_stream_handle(self->sh, &h);
    if (rc == AST_ENODEV)
        return raise_ast_error(st, rc, "stream_handle: the shadow runs on the host path (no "
                               "CUDA stream)");
    if (rc < 0)
        return raise_ast_error(st, rc, NULL);
    return PyLong_FromVoidPtr((void *)h);
}

PyDoc_STRVAR(shadow_stats_doc,
             "stats()\n--\n\nCopy statistics (d2h_bytes, h2d_bytes, d2h_copies, h2d_copies, busy) "
             "and ring occupancy (ring_* for the prefetch ring, snapshot_* for the snapshot "
             "ring), is_cuda, device, priority.");

static PyObject *shadow_stats(ShadowObject *self, PyObject *unused)
{
    mod_state *st = type_state(Py_TYPE(self));
    if (sh_enter(self, st) < 0)
        return NULL;
    ast_shadow *sh = self->sh;
    ast_shadow_stats s;
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = ast_shadow_stats_get(sh, &s);
    Py_END_ALLOW_THREADS
    guard_leave(&self->g);
    if (rc < 0)
        return raise_ast_error(st, rc, NULL);
    PyObject *d = PyDict_New();
    if (!d)
        return NULL;
#define U64(f) dict_set_steal(d, #f, PyLong_FromUnsignedLongLong(s.f))
    if (U64(d2h_bytes) || U64(h2d_bytes) || U64(d2h_copies) || U64(h2d_copies) || U64(busy) ||
        U64(ring_capacity) || U64(ring_used) || U64(ring_high_water) || U64(ring_wraps) ||
        U64(ring_slots) || U64(snapshot_capacity) || U64(snapshot_used) ||
        U64(snapshot_high_water) || U64(snapshot_wraps) || U64(snapshot_slots) ||
        dict_set_steal(d, "is_cuda", PyBool_FromLong(s.is_cuda)) ||
        dict_set_steal(d, "device", PyLong_FromLong(s.device)) ||
        dict_set_steal(d, "priority", PyLong_FromLong(s.priority))) {
        Py_DECREF(d);
        return NULL;
    }
#undef U64
    return d;
}

PyDoc_STRVAR(shadow_last_error_doc,
             "last_error()\n--\n\nThe shadow's last error message ('' if none).");

static PyObject *shadow_last_error(ShadowObject *self, PyObject *unused)
{
    mod_state *st = type_state(Py_TYPE(self));
    if (sh_enter(self, st) < 0)
        return NULL;
    ast_shadow *sh = self->sh;
    char buf[ERRBUF_LEN] = "";
    Py_BEGIN_ALLOW_THREADS
    shadow_err(sh, buf, sizeof buf);
    Py_END_ALLOW_THREADS
    guard_leave(&self->g);
    return PyUnicode_DecodeUTF8(buf, (Py_ssize_t)strlen(buf), "replace");
}

static PyObject *shadow_get_is_cuda(ShadowObject *self, void *closure)
{
    if (guard_open(&self->g, self->sh != NULL, type_state(Py_TYPE(self)), "shadow") < 0)
        return NULL;
    return PyBool_FromLong(ast_shadow_is_cuda(self->sh));
}

static PyObject *shadow_get_closed(ShadowObject *self, void *closure)
{
    return PyBool_FromLong(self->g.closed);
}

static PyMethodDef shadow_methods[] = {
    {"snapshot", (PyCFunction)(void (*)(void))shadow_snapshot, METH_VARARGS | METH_KEYWORDS,
     shadow_snapshot_doc},
    {"snapshot_gather", (PyCFunction)(void (*)(void))shadow_snapshot_gather,
     METH_VARARGS | METH_KEYWORDS, shadow_snapshot_gather_doc},
    {"snapshot_query", (PyCFunction)shadow_snapshot_query, METH_O, shadow_snapshot_query_doc},
    {"snapshot_wait", (PyCFunction)shadow_snapshot_wait, METH_O, shadow_snapshot_wait_doc},
    {"snapshot_event", (PyCFunction)shadow_snapshot_event, METH_O, shadow_snapshot_event_doc},
    {"snapshot_release", (PyCFunction)shadow_snapshot_release, METH_O,
     shadow_snapshot_release_doc},
    {"prefetch", (PyCFunction)(void (*)(void))shadow_prefetch, METH_VARARGS | METH_KEYWORDS,
     shadow_prefetch_doc},
    {"lookup", (PyCFunction)shadow_lookup, METH_O, shadow_lookup_doc},
    {"prefetch_wait", (PyCFunction)shadow_prefetch_wait, METH_O, shadow_prefetch_wait_doc},
    {"ready_event", (PyCFunction)shadow_ready_event, METH_O, shadow_ready_event_doc},
    {"release", (PyCFunction)shadow_release, METH_O, shadow_release_doc},
    {"release_after", (PyCFunction)(void (*)(void))shadow_release_after,
     METH_VARARGS | METH_KEYWORDS, shadow_release_after_doc},
    {"stream_handle", (PyCFunction)shadow_stream_handle, METH_NOARGS, shadow_stream_handle_doc},
    {"stats", (PyCFunction)shadow_stats, METH_NOARGS, shadow_stats_doc},
    {"last_error", (PyCFunction)shadow_last_error, METH_NOARGS, shadow_last_error_doc},
    {"close", (PyCFunction)shadow_close, METH_NOARGS, shadow_close_doc},
    {"__enter__", (PyCFunction)shadow_enter, METH_NOARGS, NULL},
    {"__exit__", (PyCFunction)shadow_exit, METH_VARARGS, NULL},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef shadow_getset[] = {
    {"is_cuda", (getter)shadow_get_is_cuda, NULL, "True on the CUDA path, False on the host path.",
     NULL},
    {"closed", (getter)shadow_get_closed, NULL, "True after close().", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

PyDoc_STRVAR(shadow_doc,
             "Shadow(mode='auto', snapshot_ring_bytes=None, prefetch_ring_bytes=None, slots=None, "
             "device=-1)\n--\n\n"
             "The shadow copy engine: D2H snapshots into a pinned ring and H2D prefetches into a "
             "device ring on a lowest-priority\nCUDA stream. mode 'host' (or 'auto' without a "
             "device) runs the same API on host memory with memcpy; 'cuda' without\na device "
             "raises AsteriaError (AST_ENODEV). Ring sizes default to 64 MiB, slots (live per "
             "ring) to 64. A full ring\nraises BusyError. Pointers and events are ints.");

static PyType_Slot shadow_slots[] = {
    {Py_tp_new, shadow_new},
    {Py_tp_dealloc, shadow_dealloc},
    {Py_tp_traverse, shadow_traverse},
    {Py_tp_methods, shadow_methods},
    {Py_tp_getset, shadow_getset},
    {Py_tp_doc, (void *)shadow_doc},
    {0, NULL},
};

static PyType_Spec shadow_spec = {
    .name = "asteria._C.Shadow",
    .basicsize = sizeof(ShadowObject),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_IMMUTABLETYPE,
    .slots = shadow_slots,
};

/* ---- Coherence ------------------------------------------------------------------------------------
 *
 * The CoherenceRegistry (coherence.h). Every registry call is short, never blocks and never
 * calls out, so the binding keeps the GIL across each one: no call runs with it released, which
 * also makes close() (destroy, with the GIL held) unable to race with another call. The message
 * of a failure is read back with ast_coherence_last_error right after the call, still under the
 * GIL, so it is this call's.
 */

typedef struct {
    PyObject_HEAD
    ast_coherence *reg;
} CoherenceObject;

static const char *const coh_level_names[AST_COH_LEVEL_COUNT] = {
    "intra_node", "inter_node", "flat", "flat_inter_node"};

/* The registry, or NULL with AST_ESHUTDOWN raised once closed. */
static ast_coherence *coh_open(CoherenceObject *self, mod_state *st)
{
    if (!self->reg) {
        raise_ast_error(st, AST_ESHUTDOWN, "the coherence registry is closed");
        return NULL;
    }
    return self->reg;
}

/* Raises the failure rc of the call just made on reg (BusyError for AST_EBUSY). */
static PyObject *coh_raise(mod_state *st, ast_coherence *reg, int rc)
{
    char err[ERRBUF_LEN] = "";
    ast_coherence_last_error(reg, err, sizeof err);
    return raise_busy_aware(st, rc, err);
}

/* A sequence of ints as a PyMem array of C ints (*n entries); -1 with an exception set. */
static int int_array(PyObject *o, const char *what, int **out, int *n)
{
    PyObject *seq = PySequence_Fast(o, what);
    if (!seq)
        return -1;
    Py_ssize_t len = PySequence_Fast_GET_SIZE(seq);
    if (len > INT32_MAX) {
        Py_DECREF(seq);
        PyErr_Format(PyExc_OverflowError, "%s is too long", what);
        return -1;
    }
    int *a = PyMem_Malloc((size_t)(len ? len : 1) * sizeof *a);
    if (!a) {
        Py_DECREF(seq);
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t i = 0; i < len; i++)
        if (as_int(PySequence_Fast_GET_ITEM(seq, i), &a[i], what) < 0) {
            PyMem_Free(a);
            Py_DECREF(seq);
            return -1;
        }
    Py_DECREF(seq);
    *out = a;
    *n = (int)len;
    return 0;
}

/* A sequence of ints as a PyMem array of uint64 (*n entries); -1 with an exception set. */
static int u64_array(PyObject *o, const char *what, uint64_t **out, size_t *n)
{
    PyObject *seq = PySequence_Fast(o, what);
    if (!seq)
        return -1;
    Py_ssize_t len = PySequence_Fast_GET_SIZE(seq);
    uint64_t *a = PyMem_Malloc((size_t)(len ? len : 1) * sizeof *a);
    if (!a) {
        Py_DECREF(seq);
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t i = 0; i < len; i++)
        if (!conv_u64(PySequence_Fast_GET_ITEM(seq, i), &a[i])) {
            PyMem_Free(a);
            Py_DECREF(seq);
            return -1;
        }
    Py_DECREF(seq);
    *out = a;
    *n = (size_t)len;
    return 0;
}

/* An optional per-rank int list (node_ids, replica_group) of exactly world entries. */
static int world_array(PyObject *o, const char *what, int world, int **out)
{
    *out = NULL;
    if (o == Py_None)
        return 0;
    int n;
    if (int_array(o, what, out, &n) < 0)
        return -1;
    if (n != world) {
        PyMem_Free(*out);
        *out = NULL;
        PyErr_Format(PyExc_ValueError, "%s has %d entries; allowed: one per rank (%d)", what, n,
                     world);
        return -1;
    }
    return 0;
}

static PyObject *coherence_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"world_size", "rank",      "ranks_per_node", "node_ids",
                             "staleness",  "replica_group", NULL};
    mod_state *st = type_state(type);
    ast_coherence_opts o;
    ast_coherence_opts_init(&o);
    PyObject *node_o = Py_None, *group_o = Py_None;
    if (!st || !PyArg_ParseTupleAndKeywords(args, kwds, "|ii$iOiO:Coherence", kwlist,
                                            &o.world_size, &o.rank, &o.ranks_per_node, &node_o,
                                            &o.staleness, &group_o))
        return NULL;
    int world = o.world_size > 0 ? o.world_size : 0;
    int *node_ids = NULL, *groups = NULL;
    if (world_array(node_o, "node_ids", world, &node_ids) < 0 ||
        world_array(group_o, "replica_group", world, &groups) < 0) {
        PyMem_Free(node_ids);
        return NULL;
    }
    o.node_ids = node_ids;
    o.replica_group = groups;
    char err[ERRBUF_LEN] = "";
    ast_coherence *reg = NULL;
    int rc = ast_coherence_create_msg(&o, &reg, err, sizeof err);
    PyMem_Free(node_ids);
    PyMem_Free(groups);
    if (rc < 0)
        return raise_ast_error(st, rc, err);
    CoherenceObject *self = (CoherenceObject *)type->tp_alloc(type, 0);
    if (!self) {
        ast_coherence_destroy(reg);
        return NULL;
    }
    self->reg = reg;
    return (PyObject *)self;
}

static void coherence_close_impl(CoherenceObject *self)
{
    ast_coherence_destroy(self->reg);
    self->reg = NULL;
}

static int coherence_traverse(CoherenceObject *self, visitproc visit, void *arg)
{
    Py_VISIT(Py_TYPE(self));
    return 0;
}

static void coherence_dealloc(CoherenceObject *self)
{
    PyTypeObject *tp = Py_TYPE(self);
    PyObject_GC_UnTrack(self);
    coherence_close_impl(self);
    tp->tp_free((PyObject *)self);
    Py_DECREF(tp);
}

static PyObject *coherence_close(CoherenceObject *self, PyObject *unused)
{
    coherence_close_impl(self);
    Py_RETURN_NONE;
}

static PyObject *coherence_enter(CoherenceObject *self, PyObject *unused)
{
    return Py_NewRef(self);
}

static PyObject *coherence_exit(CoherenceObject *self, PyObject *args)
{
    coherence_close_impl(self);
    Py_RETURN_FALSE;
}

PyDoc_STRVAR(coherence_register_block_doc,
             "register_block(block, cost, replicas=None)\n--\n\nRegister a block before the plan. "
             "replicas: the ranks holding a replica (None: the default replica group).");

static PyObject *coherence_register_block(CoherenceObject *self, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"block", "cost", "replicas", NULL};
    mod_state *st = type_state(Py_TYPE(self));
    uint64_t block, cost;
    PyObject *rep_o = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O&O&|O:register_block", kwlist, conv_u64,
                                     &block, conv_u64, &cost, &rep_o))
        return NULL;
    ast_coherence *reg = coh_open(self, st);
    if (!reg)
        return NULL;
    int *ranks = NULL, n = 0;
    if (rep_o != Py_None && int_array(rep_o, "replicas", &ranks, &n) < 0)
        return NULL;
    /* An empty list is the caller's mistake, not "the default": pass it as a list. */
    int rc = ast_coherence_register_block(reg, block, cost, rep_o == Py_None ? NULL : ranks,
                                          rep_o == Py_None ? 0 : (n ? n : -1));
    PyMem_Free(ranks);
    if (rc < 0)
        return coh_raise(st, reg, rc);
    Py_RETURN_NONE;
}

PyDoc_STRVAR(coherence_extend_doc,
             "extend(blocks, costs, replicas=None)\n--\n\nRegister a batch of blocks sharing one "
             "replica list and fix their owners at once (LPT among them, continuing from the "
             "current loads), before or after plan(). Atomic.");

static PyObject *coherence_extend(CoherenceObject *self, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"blocks", "costs", "replicas", NULL};
    mod_state *st = type_state(Py_TYPE(self));
    PyObject *ids_o, *costs_o, *rep_o = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OO|O:extend", kwlist, &ids_o, &costs_o,
                                     &rep_o))
        return NULL;
    ast_coherence *reg = coh_open(self, st);
    if (!reg)
        return NULL;
    uint64_t *ids = NULL, *costs = NULL;
    size_t n = 0, nc = 0;
    int *ranks = NULL, nr = 0;
    PyObject *ret = NULL;
    if (u64_array(ids_o, "blocks", &ids, &n) < 0 || u64_array(costs_o, "costs", &costs, &nc) < 0 ||
        (rep_o != Py_None && int_array(rep_o, "replicas", &ranks, &nr) < 0))
        goto done;
    if (n != nc) {
        PyErr_Format(PyExc_ValueError, "extend: %zu blocks but %zu costs", n, nc);
        goto done;
    }
    int rc = ast_coherence_extend(reg, ids, costs, n, rep_o == Py_None ? NULL : ranks,
                                  rep_o == Py_None ? 0 : (nr ? nr : -1));
    if (rc < 0)
        coh_raise(st, reg, rc);
    else
        ret = Py_NewRef(Py_None);
done:
    PyMem_Free(ids);
    PyMem_Free(costs);
    PyMem_Free(ranks);
    return ret;
}

static PyObject *coherence_plan(CoherenceObject *self, PyObject *unused)
{
    mod_state *st = type_state(Py_TYPE(self));
    ast_coherence *reg = coh_open(self, st);
    if (!reg)
        return NULL;
    int rc = ast_coherence_plan(reg);
    if (rc < 0)
        return coh_raise(st, reg, rc);
    Py_RETURN_NONE;
}

static PyObject *coherence_owner(CoherenceObject *self, PyObject *arg)
{
    mod_state *st = type_state(Py_TYPE(self));
    uint64_t block;
    int owner;
    if (!conv_u64(arg, &block))
        return NULL;
    ast_coherence *reg = coh_open(self, st);
    if (!reg)
        return NULL;
    int rc = ast_coherence_owner(reg, block, &owner);
    if (rc < 0)
        return coh_raise(st, reg, rc);
    return PyLong_FromLong(owner);
}

static PyObject *coherence_is_owner(CoherenceObject *self, PyObject *arg)
{
    mod_state *st = type_state(Py_TYPE(self));
    uint64_t block;
    if (!conv_u64(arg, &block))
        return NULL;
    ast_coherence *reg = coh_open(self, st);
    if (!reg)
        return NULL;
    int rc = ast_coherence_is_owner(reg, block);
    if (rc < 0)
        return coh_raise(st, reg, rc);
    return PyBool_FromLong(rc);
}

static PyObject *coherence_load(CoherenceObject *self, PyObject *arg)
{
    mod_state *st = type_state(Py_TYPE(self));
    int rank;
    if (as_int(arg, &rank, "rank") < 0)
        return NULL;
    ast_coherence *reg = coh_open(self, st);
    if (!reg)
        return NULL;
    uint64_t cost;
    int rc = ast_coherence_load(reg, rank, &cost);
    if (rc < 0)
        return coh_raise(st, reg, rc);
    return PyLong_FromUnsignedLongLong(cost);
}

/* replicas() (reps 0) and representatives() (reps 1) as a tuple of ints. */
static PyObject *coherence_rank_list(CoherenceObject *self, PyObject *arg, int reps)
{
    mod_state *st = type_state(Py_TYPE(self));
    uint64_t block;
    if (!conv_u64(arg, &block))
        return NULL;
    ast_coherence *reg = coh_open(self, st);
    if (!reg)
        return NULL;
    int (*fn)(ast_coherence *, uint64_t, int *, size_t, size_t *) =
        reps ? ast_coherence_representatives : ast_coherence_replicas;
    size_t n = 0;
    int rc = fn(reg, block, NULL, 0, &n);
    if (rc < 0)
        return coh_raise(st, reg, rc);
    int *ranks = PyMem_Malloc((n ? n : 1) * sizeof *ranks);
    if (!ranks)
        return PyErr_NoMemory();
    rc = fn(reg, block, ranks, n, &n);
    PyObject *out = NULL;
    if (rc < 0)
        coh_raise(st, reg, rc);
    else
        out = PyTuple_New((Py_ssize_t)n);
    for (size_t i = 0; out && i < n; i++) {
        PyObject *v = PyLong_FromLong(ranks[i]);
        if (!v)
            Py_CLEAR(out);
        else
            PyTuple_SET_ITEM(out, (Py_ssize_t)i, v);
    }
    PyMem_Free(ranks);
    return out;
}

static PyObject *coherence_replicas(CoherenceObject *self, PyObject *arg)
{
    return coherence_rank_list(self, arg, 0);
}

static PyObject *coherence_representatives(CoherenceObject *self, PyObject *arg)
{
    return coherence_rank_list(self, arg, 1);
}

static PyObject *coherence_block_info(CoherenceObject *self, PyObject *arg)
{
    mod_state *st = type_state(Py_TYPE(self));
    uint64_t block;
    if (!conv_u64(arg, &block))
        return NULL;
    ast_coherence *reg = coh_open(self, st);
    if (!reg)
        return NULL;
    ast_coherence_block b;
    int rc = ast_coherence_block_info(reg, block, &b);
    if (rc < 0)
        return coh_raise(st, reg, rc);
    PyObject *d = PyDict_New();
    if (!d)
        return NULL;
#define U64(f) dict_set_steal(d, #f, PyLong_FromUnsignedLongLong(b.f))
#define I64(f) dict_set_steal(d, #f, PyLong_FromLongLong(b.f))
    if (U64(cost) || I64(owner) || I64(nreplicas) ||
        dict_set_steal(d, "is_replica", PyBool_FromLong(b.is_replica)) || U64(version) ||
        I64(snapshot_step) || U64(held_version) || I64(last_recv_step) || U64(synced_version) ||
        I64(last_sync_step) || U64(due_version) || U64(installed_version)) {
        Py_DECREF(d);
        return NULL;
    }
#undef U64
#undef I64
    return d;
}

/* Calls taking (block, version, step): 0 publish, 1 received, 2 mark_synced. */
static PyObject *coherence_bvs(CoherenceObject *self, PyObject *args, PyObject *kwds, int what)
{
    static char *kwlist[] = {"block", "version", "step", NULL};
    static const char *const fmt[3] = {"O&O&L:publish", "O&O&L:received", "O&O&L:mark_synced"};
    mod_state *st = type_state(Py_TYPE(self));
    uint64_t block, version;
    long long step;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, fmt[what], kwlist, conv_u64, &block, conv_u64,
                                     &version, &step))
        return NULL;
    ast_coherence *reg = coh_open(self, st);
    if (!reg)
        return NULL;
    int rc = what == 0   ? ast_coherence_publish(reg, block, version, step)
             : what == 1 ? ast_coherence_received(reg, block, version, step)
                         : ast_coherence_mark_synced(reg, block, version, step);
    if (rc < 0)
        return coh_raise(st, reg, rc);
    Py_RETURN_NONE;
}

static PyObject *coherence_publish(CoherenceObject *self, PyObject *args, PyObject *kwds)
{
    return coherence_bvs(self, args, kwds, 0);
}

static PyObject *coherence_received(CoherenceObject *self, PyObject *args, PyObject *kwds)
{
    return coherence_bvs(self, args, kwds, 1);
}

static PyObject *coherence_mark_synced(CoherenceObject *self, PyObject *args, PyObject *kwds)
{
    return coherence_bvs(self, args, kwds, 2);
}

static PyObject *coherence_nblocks(CoherenceObject *self, PyObject *unused)
{
    mod_state *st = type_state(Py_TYPE(self));
    ast_coherence *reg = coh_open(self, st);
    if (!reg)
        return NULL;
    size_t n;
    int rc = ast_coherence_nblocks(reg, &n);
    if (rc < 0)
        return coh_raise(st, reg, rc);
    return PyLong_FromSize_t(n);
}

/* The exchange vector's length check shared by export and import; -1 with ValueError set. */
static int xchg_len(ast_coherence *reg, Py_ssize_t nbytes, const char *what, size_t *n)
{
    size_t blocks = 0;
    ast_coherence_nblocks(reg, &blocks);
    size_t want = AST_COH_XCHG_STRIDE * blocks;
    if ((size_t)nbytes != want * sizeof(int64_t)) {
        PyErr_Format(PyExc_ValueError,
                     "%s: the buffer has %zd bytes; allowed: %zu int64 (%d per block x %zu "
                     "blocks), %zu bytes",
                     what, nbytes, want, AST_COH_XCHG_STRIDE, blocks, want * sizeof(int64_t));
        return -1;
    }
    *n = want;
    return 0;
}

PyDoc_STRVAR(coherence_versions_export_doc,
             "versions_export(step, out=None)\n--\n\nWrite this rank's exchange vector for step "
             "(int64, 3 per block in ascending block id order) into out, a writable C-contiguous "
             "buffer of exactly that size (e.g. tensor.numpy()); with out None return a new "
             "bytearray. Returns out.");

static PyObject *coherence_versions_export(CoherenceObject *self, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"step", "out", NULL};
    mod_state *st = type_state(Py_TYPE(self));
    long long step;
    PyObject *out = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "L|O:versions_export", kwlist, &step, &out))
        return NULL;
    ast_coherence *reg = coh_open(self, st);
    if (!reg)
        return NULL;
    if (out == Py_None) {
        size_t blocks = 0;
        ast_coherence_nblocks(reg, &blocks);
        out = PyByteArray_FromStringAndSize(
            NULL, (Py_ssize_t)(AST_COH_XCHG_STRIDE * blocks * sizeof(int64_t)));
        if (!out)
            return NULL;
    } else {
        Py_INCREF(out);
    }
    Py_buffer view;
    if (PyObject_GetBuffer(out, &view, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) {
        Py_DECREF(out);
        return NULL;
    }
    size_t n;
    int rc = 0;
    if (xchg_len(reg, view.len, "versions_export", &n) < 0)
        rc = 1;
    else if (((uintptr_t)view.buf % sizeof(int64_t)) != 0) {
        /* bytearray storage is malloc'd; a foreign buffer may not be aligned: go through a copy */
        int64_t *tmp = PyMem_Malloc((n ? n : 1) * sizeof *tmp);
        if (!tmp) {
            PyErr_NoMemory();
            rc = 1;
        } else {
            rc = ast_coherence_versions_export(reg, step, tmp, n);
            if (rc == 0)
                memcpy(view.buf, tmp, n * sizeof *tmp);
            PyMem_Free(tmp);
        }
    } else {
        rc = ast_coherence_versions_export(reg, step, view.buf, n);
    }
    PyBuffer_Release(&view);
    if (rc) {
        Py_DECREF(out);
        return rc < 0 ? coh_raise(st, reg, rc) : NULL;
    }
    return out;
}

PyDoc_STRVAR(coherence_versions_import_doc,
             "versions_import(step, vec)\n--\n\nRead the all-reduced (MAX) exchange vector of step "
             "from vec, a C-contiguous buffer of int64 with exactly 3 entries per block.");

static PyObject *coherence_versions_import(CoherenceObject *self, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"step", "vec", NULL};
    mod_state *st = type_state(Py_TYPE(self));
    long long step;
    Py_buffer view;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "Ly*:versions_import", kwlist, &step, &view))
        return NULL;
    ast_coherence *reg = coh_open(self, st);
    if (!reg) {
        PyBuffer_Release(&view);
        return NULL;
    }
    size_t n;
    int rc = 0;
    if (!PyBuffer_IsContiguous(&view, 'C')) {
        PyErr_SetString(PyExc_ValueError, "versions_import: vec must be C-contiguous");
        rc = 1;
    } else if (xchg_len(reg, view.len, "versions_import", &n) < 0) {
        rc = 1;
    } else {
        int64_t *tmp = PyMem_Malloc((n ? n : 1) * sizeof *tmp);
        if (!tmp) {
            PyErr_NoMemory();
            rc = 1;
        } else {
            memcpy(tmp, view.buf, n * sizeof *tmp);
            rc = ast_coherence_versions_import(reg, step, tmp, n);
            PyMem_Free(tmp);
        }
    }
    PyBuffer_Release(&view);
    if (rc)
        return rc < 0 ? coh_raise(st, reg, rc) : NULL;
    Py_RETURN_NONE;
}

PyDoc_STRVAR(coherence_due_doc,
             "due(step)\n--\n\nThe blocks this rank replicates that must sync at step, ascending "
             "(a tuple of ints). Evaluates step.");

static PyObject *coherence_due(CoherenceObject *self, PyObject *arg)
{
    mod_state *st = type_state(Py_TYPE(self));
    long long step = PyLong_AsLongLong(arg);
    if (step == -1 && PyErr_Occurred())
        return NULL;
    ast_coherence *reg = coh_open(self, st);
    if (!reg)
        return NULL;
    size_t cap = 0, n = 0;
    ast_coherence_nblocks(reg, &cap);
    uint64_t *ids = PyMem_Malloc((cap ? cap : 1) * sizeof *ids);
    if (!ids)
        return PyErr_NoMemory();
    int rc = ast_coherence_due(reg, step, ids, cap, &n);
    PyObject *out = NULL;
    if (rc < 0)
        coh_raise(st, reg, rc);
    else
        out = PyTuple_New((Py_ssize_t)n);
    for (size_t i = 0; out && i < n; i++) {
        PyObject *v = PyLong_FromUnsignedLongLong(ids[i]);
        if (!v)
            Py_CLEAR(out);
        else
            PyTuple_SET_ITEM(out, (Py_ssize_t)i, v);
    }
    PyMem_Free(ids);
    return out;
}

PyDoc_STRVAR(coherence_install_version_doc,
             "install_version(block, step)\n--\n\nThe version every replica installs at step (0: "
             "none yet). BusyError when this rank replicates the block but does not hold that "
             "version (sync first).");

static PyObject *coherence_install_version(CoherenceObject *self, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"block", "step", NULL};
    mod_state *st = type_state(Py_TYPE(self));
    uint64_t block, version = 0;
    long long step;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O&L:install_version", kwlist, conv_u64, &block,
                                     &step))
        return NULL;
    ast_coherence *reg = coh_open(self, st);
    if (!reg)
        return NULL;
    int rc = ast_coherence_install_version(reg, block, step, &version);
    if (rc < 0)
        return coh_raise(st, reg, rc);
    return PyLong_FromUnsignedLongLong(version);
}

static PyObject *coherence_hier_plan(CoherenceObject *self, PyObject *arg)
{
    mod_state *st = type_state(Py_TYPE(self));
    uint64_t block;
    if (!conv_u64(arg, &block))
        return NULL;
    ast_coherence *reg = coh_open(self, st);
    if (!reg)
        return NULL;
    ast_coherence_hier h;
    int rc = ast_coherence_hier_plan(reg, block, &h);
    if (rc < 0)
        return coh_raise(st, reg, rc);
    static const char *const inter[3] = {"none", "send", "recv"};
    PyObject *d = PyDict_New();
    if (!d)
        return NULL;
#define I(f) dict_set_steal(d, #f, PyLong_FromLong(h.f))
#define B(f) dict_set_steal(d, #f, PyBool_FromLong(h.f))
    if (I(owner) || I(owner_node) || I(node) || I(nodes) || I(node_replicas) || B(is_replica) ||
        B(is_representative) || I(representative) || I(inter_root) || B(write_shm) ||
        B(read_shm) ||
        dict_set_steal(d, "inter", PyUnicode_FromString(inter[h.inter])) ||
        dict_set_steal(d, "recv_level", h.recv_level >= 0 && h.recv_level < AST_COH_LEVEL_COUNT
                                            ? PyUnicode_FromString(coh_level_names[h.recv_level])
                                            : Py_NewRef(Py_None)) ||
        B(flat_recv) || B(flat_recv_inter)) {
        Py_DECREF(d);
        return NULL;
    }
#undef I
#undef B
    return d;
}

PyDoc_STRVAR(coherence_count_bytes_doc,
             "count_bytes(level, nbytes)\n--\n\nAdd bytes this rank received at a level: "
             "'intra_node', 'inter_node', 'flat', 'flat_inter_node'.");

static PyObject *coherence_count_bytes(CoherenceObject *self, PyObject *args)
{
    mod_state *st = type_state(Py_TYPE(self));
    const char *level;
    uint64_t nbytes;
    if (!PyArg_ParseTuple(args, "sO&:count_bytes", &level, conv_u64, &nbytes))
        return NULL;
    int lv = -1;
    for (int i = 0; i < AST_COH_LEVEL_COUNT; i++)
        if (!strcmp(level, coh_level_names[i]))
            lv = i;
    if (lv < 0) {
        PyErr_Format(PyExc_ValueError,
                     "unknown level '%s'; allowed: intra_node, inter_node, flat, flat_inter_node",
                     level);
        return NULL;
    }
    ast_coherence *reg = coh_open(self, st);
    if (!reg)
        return NULL;
    int rc = ast_coherence_count_bytes(reg, (ast_coherence_level)lv, nbytes);
    if (rc < 0)
        return coh_raise(st, reg, rc);
    Py_RETURN_NONE;
}

/* barrier_begin (end 0) / barrier_end (end 1). */
static PyObject *coherence_barrier(CoherenceObject *self, PyObject *arg, int end)
{
    mod_state *st = type_state(Py_TYPE(self));
    long long step = PyLong_AsLongLong(arg);
    if (step == -1 && PyErr_Occurred())
        return NULL;
    ast_coherence *reg = coh_open(self, st);
    if (!reg)
        return NULL;
    int rc = end ? ast_coherence_barrier_end(reg, step) : ast_coherence_barrier_begin(reg, step);
    if (rc < 0)
        return coh_raise(st, reg, rc);
    Py_RETURN_NONE;
}

static PyObject *coherence_barrier_begin(CoherenceObject *self, PyObject *arg)
{
    return coherence_barrier(self, arg, 0);
}

static PyObject *coherence_barrier_end(CoherenceObject *self, PyObject *arg)
{
    return coherence_barrier(self, arg, 1);
}

PyDoc_STRVAR(coherence_stats_doc,
             "stats()\n--\n\nblocks, owned, load, published, imported, received, synced, "
             "installs, due_listed, bytes_<level> for each level, barrier_waits, barrier_wait_ns, "
             "barrier_max_wait_ns, max_lag_steps, evaluated_step, world_size, rank, node, nodes, "
             "staleness.");

static PyObject *coherence_stats(CoherenceObject *self, PyObject *unused)
{
    mod_state *st = type_state(Py_TYPE(self));
    ast_coherence *reg = coh_open(self, st);
    if (!reg)
        return NULL;
    ast_coherence_stats s;
    int rc = ast_coherence_stats_get(reg, &s);
    if (rc < 0)
        return coh_raise(st, reg, rc);
    PyObject *d = PyDict_New();
    if (!d)
        return NULL;
#define U64(f) dict_set_steal(d, #f, PyLong_FromUnsignedLongLong(s.f))
#define I64(f) dict_set_steal(d, #f, PyLong_FromLongLong(s.f))
    if (U64(blocks) || U64(owned) || U64(load) || U64(published) || U64(imported) ||
        U64(received) || U64(synced) || U64(installs) || U64(due_listed) || U64(barrier_waits) ||
        U64(barrier_wait_ns) || U64(barrier_max_wait_ns) || I64(max_lag_steps) ||
        I64(evaluated_step) || I64(world_size) || I64(rank) || I64(node) || I64(nodes) ||
        I64(staleness)) {
        Py_DECREF(d);
        return NULL;
    }
#undef U64
#undef I64
    for (int i = 0; i < AST_COH_LEVEL_COUNT; i++) {
        char key[32];
        snprintf(key, sizeof key, "bytes_%s", coh_level_names[i]);
        if (dict_set_steal(d, key, PyLong_FromUnsignedLongLong(s.bytes[i])) < 0) {
            Py_DECREF(d);
            return NULL;
        }
    }
    return d;
}

static PyObject *coherence_last_error(CoherenceObject *self, PyObject *unused)
{
    mod_state *st = type_state(Py_TYPE(self));
    ast_coherence *reg = coh_open(self, st);
    if (!reg)
        return NULL;
    char buf[ERRBUF_LEN] = "";
    ast_coherence_last_error(reg, buf, sizeof buf);
    return PyUnicode_DecodeUTF8(buf, (Py_ssize_t)strlen(buf), "replace");
}

static PyObject *coherence_get_closed(CoherenceObject *self, void *closure)
{
    return PyBool_FromLong(self->reg == NULL);
}

static PyMethodDef coherence_methods[] = {
    {"register_block", (PyCFunction)(void (*)(void))coherence_register_block,
     METH_VARARGS | METH_KEYWORDS, coherence_register_block_doc},
    {"extend", (PyCFunction)(void (*)(void))coherence_extend, METH_VARARGS | METH_KEYWORDS,
     coherence_extend_doc},
    {"plan", (PyCFunction)coherence_plan, METH_NOARGS,
     PyDoc_STR("plan()\n--\n\nFix every owner (LPT); a second call does nothing.")},
    {"owner", (PyCFunction)coherence_owner, METH_O,
     PyDoc_STR("owner(block)\n--\n\nThe rank that computes the block's refresh.")},
    {"is_owner", (PyCFunction)coherence_is_owner, METH_O,
     PyDoc_STR("is_owner(block)\n--\n\nTrue if this rank owns the block.")},
    {"load", (PyCFunction)coherence_load, METH_O,
     PyDoc_STR("load(rank)\n--\n\nTotal cost of the blocks a rank owns.")},
    {"replicas", (PyCFunction)coherence_replicas, METH_O,
     PyDoc_STR("replicas(block)\n--\n\nThe ranks holding a replica, ascending.")},
    {"representatives", (PyCFunction)coherence_representatives, METH_O,
     PyDoc_STR("representatives(block)\n--\n\nOne rank per node holding a replica (its lowest "
               "replica rank), ascending.")},
    {"block_info", (PyCFunction)coherence_block_info, METH_O,
     PyDoc_STR("block_info(block)\n--\n\nThe block's cost, owner, versions and steps (a dict).")},
    {"publish", (PyCFunction)(void (*)(void))coherence_publish, METH_VARARGS | METH_KEYWORDS,
     PyDoc_STR("publish(block, version, step)\n--\n\nOwner: the refresh snapshotted at step is "
               "ready as version.")},
    {"nblocks", (PyCFunction)coherence_nblocks, METH_NOARGS,
     PyDoc_STR("nblocks()\n--\n\nRegistered blocks (the exchange vector has 3 int64 per block).")},
    {"versions_export", (PyCFunction)(void (*)(void))coherence_versions_export,
     METH_VARARGS | METH_KEYWORDS, coherence_versions_export_doc},
    {"versions_import", (PyCFunction)(void (*)(void))coherence_versions_import,
     METH_VARARGS | METH_KEYWORDS, coherence_versions_import_doc},
    {"received", (PyCFunction)(void (*)(void))coherence_received, METH_VARARGS | METH_KEYWORDS,
     PyDoc_STR("received(block, version, step)\n--\n\nNon-owner replica: the data of version "
               "landed here.")},
    {"due", (PyCFunction)coherence_due, METH_O, coherence_due_doc},
    {"mark_synced", (PyCFunction)(void (*)(void))coherence_mark_synced,
     METH_VARARGS | METH_KEYWORDS,
     PyDoc_STR("mark_synced(block, version, step)\n--\n\nEvery replica, after the transfer of "
               "version completed.")},
    {"install_version", (PyCFunction)(void (*)(void))coherence_install_version,
     METH_VARARGS | METH_KEYWORDS, coherence_install_version_doc},
    {"hier_plan", (PyCFunction)coherence_hier_plan, METH_O,
     PyDoc_STR("hier_plan(block)\n--\n\nThis rank's part in moving the block (a dict: write_shm, "
               "read_shm, inter 'none'/'send'/'recv', inter_root, recv_level, flat_recv, ...).")},
    {"count_bytes", (PyCFunction)coherence_count_bytes, METH_VARARGS, coherence_count_bytes_doc},
    {"barrier_begin", (PyCFunction)coherence_barrier_begin, METH_O,
     PyDoc_STR("barrier_begin(step)\n--\n\nOpen the bracket of a wait at the bounded barrier.")},
    {"barrier_end", (PyCFunction)coherence_barrier_end, METH_O,
     PyDoc_STR("barrier_end(step)\n--\n\nClose it and count the wait.")},
    {"stats", (PyCFunction)coherence_stats, METH_NOARGS, coherence_stats_doc},
    {"last_error", (PyCFunction)coherence_last_error, METH_NOARGS,
     PyDoc_STR("last_error()\n--\n\nThe registry's last error message ('' if none).")},
    {"close", (PyCFunction)coherence_close, METH_NOARGS,
     PyDoc_STR("close()\n--\n\nFree the registry. Idempotent; also done on deallocation.")},
    {"__enter__", (PyCFunction)coherence_enter, METH_NOARGS, NULL},
    {"__exit__", (PyCFunction)coherence_exit, METH_VARARGS, NULL},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef coherence_getset[] = {
    {"closed", (getter)coherence_get_closed, NULL, "True after close().", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

PyDoc_STRVAR(coherence_doc,
             "Coherence(world_size=1, rank=0, *, ranks_per_node=1, node_ids=None, staleness=5, "
             "replica_group=None)\n--\n\n"
             "The CoherenceRegistry of one rank (include/asteria/coherence.h, docs/coherence.md): "
             "owners by LPT, announced versions,\nthe install and due rules, hierarchical plans, "
             "byte and barrier accounting. node_ids / replica_group: one int per\nrank (the "
             "gathered GROUP_RANK; HSDP shard indices). It moves no data: the caller does, with "
             "torch.distributed.");

static PyType_Slot coherence_slots[] = {
    {Py_tp_new, coherence_new},
    {Py_tp_dealloc, coherence_dealloc},
    {Py_tp_traverse, coherence_traverse},
    {Py_tp_methods, coherence_methods},
    {Py_tp_getset, coherence_getset},
    {Py_tp_doc, (void *)coherence_doc},
    {0, NULL},
};

static PyType_Spec coherence_spec = {
    .name = "asteria._C.Coherence",
    .basicsize = sizeof(CoherenceObject),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_IMMUTABLETYPE,
    .slots = coherence_slots,
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

    st->runtime_type = (PyTypeObject *)PyType_FromModuleAndSpec(m, &runtime_spec, NULL);
    if (!st->runtime_type || PyModule_AddType(m, st->runtime_type) < 0)
        return -1;
    st->store_type = (PyTypeObject *)PyType_FromModuleAndSpec(m, &store_spec, NULL);
    if (!st->store_type || PyModule_AddType(m, st->store_type) < 0)
        return -1;
    st->blockbuf_type = (PyTypeObject *)PyType_FromModuleAndSpec(m, &blockbuf_spec, NULL);
    if (!st->blockbuf_type || PyModule_AddType(m, st->blockbuf_type) < 0)
        return -1;
    st->shadow_type = (PyTypeObject *)PyType_FromModuleAndSpec(m, &shadow_spec, NULL);
    if (!st->shadow_type || PyModule_AddType(m, st->shadow_type) < 0)
        return -1;
    st->coherence_type = (PyTypeObject *)PyType_FromModuleAndSpec(m, &coherence_spec, NULL);
    if (!st->coherence_type || PyModule_AddType(m, st->coherence_type) < 0)
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
        add_int(m, "COH_XCHG_STRIDE", AST_COH_XCHG_STRIDE) ||
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
    Py_VISIT(st->store_type);
    Py_VISIT(st->blockbuf_type);
    Py_VISIT(st->shadow_type);
    Py_VISIT(st->coherence_type);
    Py_VISIT(st->asteria_error);
    Py_VISIT(st->busy_error);
    return 0;
}

static int mod_clear(PyObject *m)
{
    mod_state *st = PyModule_GetState(m);
    if (!st)
        return 0;
    Py_CLEAR(st->runtime_type);
    Py_CLEAR(st->result_type);
    Py_CLEAR(st->store_type);
    Py_CLEAR(st->blockbuf_type);
    Py_CLEAR(st->shadow_type);
    Py_CLEAR(st->coherence_type);
    Py_CLEAR(st->asteria_error);
    Py_CLEAR(st->busy_error);
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

PyMODINIT_FUNC PyInit__C(void) { return PyModuleDef_Init(&asteria_module); }
