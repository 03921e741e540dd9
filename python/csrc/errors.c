/*
 * errors.c - the one mapping from AST_E* codes to Python exceptions, the argument
 * converters (an op is parsed against libasteria's own op table: ast_op_name / ast_op_count, so
 * the binding keeps no list of ops), the guard of a handle (see module.c for the rules; handle.c
 * makes the calls inside it), and what every bound type shares: tp_traverse, __enter__ and
 * __exit__ (type_traverse, ctx_enter, ctx_exit).
 * May call: the public libasteria API and the Python C API, and common.h.
 */
#include "common.h"

/* ---- errors --------------------------------------------------------------------------------- */

/* The runtime's last_error is shared per runtime and not reset on success, and some failures do
 * not set it; it describes this failure only if it carries this code's name as its prefix. */
const char *detail_for(int code, const char *detail)
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

/* A message of libasteria's (a detail, a last-error text) as str. Decoded with "replace": a
 * message cut to its buffer may end inside a UTF-8 sequence (a path). */
PyObject *error_text(const char *text)
{
    return PyUnicode_DecodeUTF8(text, (Py_ssize_t)strlen(text), "replace");
}

/* The one mapping from an AST_E* code to a Python exception, as a new exception object. The
 * message is "<detail> (<AST_ENAME>: <strerror>)"; every exception carries .code and .name.
 * type NULL: the table below; else that class (a subclass of the table's, e.g. BusyError). */
PyObject *new_ast_error(mod_state *st, PyObject *type, int code, const char *detail)
{
    const char *name = ast_err_name(code), *what = ast_strerror(code);
    PyObject *msg;
    if (detail && detail[0]) {
        PyObject *d = error_text(detail);
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
        exc = PyObject_CallFunctionObjArgs(type, msg, NULL);
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

PyObject *raise_wrong_type(const char *expected, PyObject *o)
{
    PyObject *name = PyObject_GetAttrString((PyObject *)Py_TYPE(o), "__name__");
    if (name) {
        PyErr_Format(PyExc_TypeError, "%s, not %U", expected, name);
        Py_DECREF(name);
    }
    return NULL;
}

PyObject *raise_exc(PyObject *exc)
{
    if (exc) {
        PyErr_SetObject((PyObject *)Py_TYPE(exc), exc);
        Py_DECREF(exc);
    }
    return NULL;
}

/* Raises the mapped exception (new_ast_error with the table). Returns NULL. */
PyObject *raise_ast_error(mod_state *st, int code, const char *detail)
{
    return raise_exc(new_ast_error(st, NULL, code, detail));
}

/* Store and Shadow report AST_EBUSY (a block with exported buffers, a full staging ring) as
 * BusyError, a subclass of AsteriaError, so callers can catch "try again later" alone. The
 * runtime keeps plain AsteriaError for it (unregister of a buffer a job holds). */
PyObject *raise_busy_aware(mod_state *st, int code, const char *detail)
{
    return raise_exc(new_ast_error(st, code == AST_EBUSY ? st->busy_error : NULL, code, detail));
}

/* ---- argument converters (PyArg "O&") --------------------------------------------------------- */

int conv_u64(PyObject *o, void *out)
{
    unsigned long long v = PyLong_AsUnsignedLongLong(o);
    if (v == (unsigned long long)-1 && PyErr_Occurred())
        return 0;
    *(uint64_t *)out = (uint64_t)v;
    return 1;
}

int conv_ptr(PyObject *o, void *out)
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

int conv_optptr(PyObject *o, void *out)
{
    if (o == Py_None) {
        *(void **)out = NULL;
        return 1;
    }
    return conv_ptr(o, out);
}

int conv_size(PyObject *o, void *out)
{
    size_t v = PyLong_AsSize_t(o);
    if (v == (size_t)-1 && PyErr_Occurred())
        return 0;
    *(size_t *)out = v;
    return 1;
}

int as_int(PyObject *o, int *out, const char *what)
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

const char *utf8_no_nul(PyObject *s, const char *what)
{
    Py_ssize_t n;
    const char *p = PyUnicode_AsUTF8AndSize(s, &n);
    if (p && (size_t)n != strlen(p)) {
        PyErr_Format(PyExc_ValueError, "%s contains an embedded null character", what);
        return NULL;
    }
    return p;
}

int parse_op(mod_state *st, PyObject *o, ast_op *out)
{
    const int count = ast_op_count();
    if (PyLong_Check(o)) {
        long v = PyLong_AsLong(o);
        if (v == -1 && PyErr_Occurred())
            return -1;
        if (v >= 1 && v <= count && ast_op_name((int)v)) {
            *out = (ast_op)v;
            return 0;
        }
    } else if (PyUnicode_Check(o)) {
        const char *s = utf8_no_nul(o, "op");
        if (!s)
            return -1;
        for (int c = 1; c <= count; c++) {
            const char *name = ast_op_name(c);
            if (name && !strcmp(name, s)) {
                *out = (ast_op)c;
                return 0;
            }
        }
    } else {
        raise_wrong_type("op must be an int or a str", o);
        return -1;
    }
    char allowed[512] = "";
    size_t used = 0;
    for (int c = 1; c <= count && used < sizeof allowed; c++) {
        const char *name = ast_op_name(c);
        if (!name)
            continue;
        int w = snprintf(allowed + used, sizeof allowed - used, "%s%s (%d)", used ? ", " : "",
                         name, c);
        used = w < 0 ? sizeof allowed : used + (size_t)w;
    }
    PyErr_Format(PyExc_ValueError, "unknown op %R; allowed: %s", o, allowed);
    return -1;
}

int parse_dtype(PyObject *o, ast_dtype *out)
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

void guard_init(guard *g)
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

void guard_fini(guard *g)
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
int guard_open(guard *g, int open, mod_state *st, const char *what)
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
int guard_enter(guard *g, int open, mod_state *st, const char *what)
{
    if (guard_open(g, open, st, what) < 0)
        return -1;
    pthread_mutex_lock(&g->lock);
    g->inflight++;
    pthread_mutex_unlock(&g->lock);
    return 0;
}

void guard_leave(guard *g)
{
    pthread_mutex_lock(&g->lock);
    if (--g->inflight == 0)
        pthread_cond_broadcast(&g->idle);
    pthread_mutex_unlock(&g->lock);
}

/* Waits for every call in flight to leave. Called with the GIL released, after `closed` was set
 * with it held. */
void guard_drain(guard *g)
{
    pthread_mutex_lock(&g->lock);
    while (g->inflight)
        pthread_cond_wait(&g->idle, &g->lock);
    pthread_mutex_unlock(&g->lock);
}

/* A path argument (str, bytes or os.PathLike) copied into buf; -1 with an exception set. */
int copy_path(PyObject *o, char *buf, size_t len, const char *what)
{
    PyObject *b = NULL;
    if (!PyUnicode_FSConverter(o, &b))
        return -1;
    const char *p = PyBytes_AsString(b);
    size_t n = (size_t)PyBytes_Size(b);
    if (n >= len) {
        PyErr_Format(PyExc_ValueError, "%s is longer than %zu bytes", what, len - 1);
        Py_DECREF(b);
        return -1;
    }
    memcpy(buf, p, n + 1);
    Py_DECREF(b);
    return 0;
}

/* ---- helpers of several types ---- */

int dict_set_steal(PyObject *d, const char *key, PyObject *v)
{
    if (!v)
        return -1;
    int rc = PyDict_SetItemString(d, key, v);
    Py_DECREF(v);
    return rc;
}

/* Reports a failure of an implicit close (dealloc) without losing an exception in flight. */
void close_in_dealloc(int (*close)(PyObject *), PyObject *self)
{
    PyObject *t, *v, *tb;
    PyErr_Fetch(&t, &v, &tb);
    if (close(self) < 0)
        PyErr_WriteUnraisable(NULL);
    PyErr_Restore(t, v, tb);
}

int type_traverse(PyObject *self, visitproc visit, void *arg)
{
    Py_VISIT(Py_TYPE(self));
    return 0;
}

PyObject *ctx_enter(PyObject *self, PyObject *unused) { return Py_NewRef(self); }

PyObject *ctx_exit(PyObject *self, PyObject *args)
{
    PyObject *r = PyObject_CallMethod(self, "close", NULL);
    if (!r)
        return NULL;
    Py_DECREF(r);
    Py_RETURN_FALSE;
}
