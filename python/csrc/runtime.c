/*
 * runtime.c - asteria._C.Runtime (runtime.h: the worker pool, jobs, waits, trace events); the
 * completions it returns are Results (result.c).
 * May call: the public libasteria API and the Python C API, and common.h (config.c's
 * config_apply and config_to_dict for the config a Runtime takes and reports; handle.c's calls
 * for every call on the runtime but wait, whose signal checks need the thread state).
 */
#include "common.h"

/* ---- Runtime ------------------------------------------------------------------------------------ */

static int runtime_error(void *rt, char *buf, size_t len)
{
    return ast_runtime_last_error(rt, buf, len);
}

/* The runtime's last_error is shared and kept across successes: detail_for keeps it only if it
 * names this failure's code. */
static PyObject *runtime_raise(mod_state *st, int rc, const char *err)
{
    return raise_ast_error(st, rc, detail_for(rc, err));
}

static const handle_kind runtime_kind = {"runtime", runtime_error, runtime_raise};

/* For calls that keep the GIL: the runtime, or NULL with AST_ESHUTDOWN raised. */
static ast_runtime *rt_open(RuntimeObject *self, mod_state *st)
{
    if (handle_open(&runtime_kind, &self->g, self->rt, st) < 0)
        return NULL;
    return self->rt;
}

/* A call that may block or compute (handle_call): 0, or -1 with the exception raised. */
static int rt_call(RuntimeObject *self, mod_state *st, int (*fn)(void *rt, void *arg), void *arg)
{
    return handle_call(&runtime_kind, &self->g, self->rt, st, fn, arg);
}

static PyObject *runtime_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"config", NULL};
    PyObject *config = Py_None;
    mod_state *st = type_state(type);
    if (!st || !PyArg_ParseTupleAndKeywords(args, kwds, "|O:Runtime", kwlist, &config))
        return NULL;
    /* A Config was validated when it was made; anything else is validated here, once. */
    ast_config cfg;
    ast_config_init(&cfg);
    if (Py_IS_TYPE(config, st->config_type))
        cfg = ((ConfigObject *)config)->cfg;
    else if (config_apply(st, &cfg, config) < 0)
        return NULL;
    char err[ERRBUF_LEN] = "";
    int rc;

    RuntimeObject *self = (RuntimeObject *)type_alloc(type);
    if (!self)
        return NULL;
    guard_init(&self->g);
    ast_runtime *rt = NULL;
    Py_BEGIN_ALLOW_THREADS
    rc = ast_runtime_create(&cfg, &rt, err, sizeof err);
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
    rc = ast_runtime_destroy(rt, err, sizeof err);
    Py_END_ALLOW_THREADS
    self->rt = NULL;
    if (rc < 0) {
        raise_ast_error(type_state(Py_TYPE(self)), rc, detail_for(rc, err));
        return -1;
    }
    return 0;
}

static int runtime_close_obj(PyObject *self) { return runtime_close_impl((RuntimeObject *)self); }

static void runtime_dealloc(RuntimeObject *self)
{
    PyObject_GC_UnTrack(self);
    close_in_dealloc(runtime_close_obj, (PyObject *)self);
    guard_fini(&self->g);
    heap_free(self);
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

PyDoc_STRVAR(runtime_register_doc,
             "register(ptr, nbytes)\n--\n\nDeclare host memory [ptr, ptr+nbytes) that jobs may "
             "read or write. Returns a handle for unregister().");

typedef struct {
    void *ptr;
    size_t nbytes;
    uint64_t handle;
} register_call;

static int do_register(void *rt, void *arg)
{
    register_call *c = arg;
    return ast_runtime_register(rt, c->ptr, c->nbytes, &c->handle);
}

static PyObject *runtime_register(RuntimeObject *self, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"ptr", "nbytes", NULL};
    register_call c = {NULL, 0, 0};
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O&O&:register", kwlist, conv_ptr, &c.ptr,
                                     conv_size, &c.nbytes))
        return NULL;
    if (rt_call(self, type_state(Py_TYPE(self)), do_register, &c) < 0)
        return NULL;
    return PyLong_FromUnsignedLongLong(c.handle);
}

PyDoc_STRVAR(runtime_unregister_doc,
             "unregister(handle)\n--\n\nForget a registered buffer (AST_EBUSY while a job uses it).");

static int do_unregister(void *rt, void *arg)
{
    return ast_runtime_unregister(rt, *(const uint64_t *)arg);
}

static PyObject *runtime_unregister(RuntimeObject *self, PyObject *arg)
{
    uint64_t handle;
    if (!conv_u64(arg, &handle) ||
        rt_call(self, type_state(Py_TYPE(self)), do_unregister, &handle) < 0)
        return NULL;
    Py_RETURN_NONE;
}

PyDoc_STRVAR(runtime_submit_doc,
             "submit(op, dtype, n, batch, in0, in1, out0, out1, p=0.0, eps=0.0, block=0, "
             "version=0, deadline=0, snapshot_step=0, n1=0, in2=None)\n--\n\n"
             "Queue one REFRESH job. op: an AST_OP_* code or its name (a key of OPS, the op\n"
             "table of libasteria); dtype: 'float32' or 'float64';\n"
             "in0/in1/in2/out0/out1: addresses (int, or None for in1/in2/out0/out1: the op\n"
             "table says which an op needs) inside registered buffers. gram_ema: in0 = G\n"
             "(batch x n x n1), out0 = L (batch x n x n) or None, out1 = R (batch x n1 x n1) or\n"
             "None (not both), each updated in place: L = p L + eps G G^T, R = p R + eps G^T G.\n"
             "soap_rotate: in0 = X (batch x n x n1), in1 = A pair (batch x 2 x n x n) or\n"
             "None, in2 = B pair (batch x 2 x n1 x n1) or None (not both), out0 = A_new^T A_old X\n"
             "B_old^T B_new. n1 >= 1 is read by soap_rotate and gram_ema only; in2 must be\n"
             "None for the other ops. Returns the ticket.");

typedef struct {
    ast_refresh req;
    uint64_t ticket;
} submit_call;

static int do_submit(void *rt, void *arg)
{
    submit_call *c = arg;
    return ast_runtime_submit(rt, &c->req, &c->ticket);
}

static PyObject *runtime_submit(RuntimeObject *self, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"op",  "dtype", "n",     "batch",   "in0",      "in1",
                             "out0", "out1", "p",     "eps",     "block",    "version",
                             "deadline", "snapshot_step", "n1", "in2", NULL};
    mod_state *st = type_state(Py_TYPE(self));
    PyObject *op_o, *dtype_o;
    submit_call c;
    memset(&c, 0, sizeof c);
    ast_refresh *req = &c.req;
    long long deadline = 0, snapshot_step = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OOiiO&O&O&O&|ddO&O&LLiO&:submit", kwlist,
                                     &op_o, &dtype_o, &req->n, &req->batch, conv_ptr, &req->in0,
                                     conv_optptr, &req->in1, conv_optptr, &req->out0,
                                     conv_optptr, &req->out1, &req->p, &req->eps, conv_u64,
                                     &req->block, conv_u64, &req->version, &deadline,
                                     &snapshot_step, &req->n1, conv_optptr, &req->in2))
        return NULL;
    if (parse_op(st, op_o, &req->op) < 0 || parse_dtype(dtype_o, &req->dtype) < 0)
        return NULL;
    req->deadline = deadline;
    req->snapshot_step = snapshot_step;
    if (rt_call(self, st, do_submit, &c) < 0)
        return NULL;
    return PyLong_FromUnsignedLongLong(c.ticket);
}

PyDoc_STRVAR(runtime_cancel_doc,
             "cancel(ticket)\n--\n\nTrue if the job was still queued and is now cancelled (its "
             "result, status AST_ECANCELED, is still collected by poll/wait); False if it runs or "
             "finished.");

static int do_cancel(void *rt, void *arg)
{
    return ast_runtime_cancel(rt, *(const uint64_t *)arg);
}

static PyObject *runtime_cancel(RuntimeObject *self, PyObject *arg)
{
    mod_state *st = type_state(Py_TYPE(self));
    uint64_t ticket;
    int rc;
    if (!conv_u64(arg, &ticket) ||
        handle_try(&runtime_kind, &self->g, self->rt, st, do_cancel, &ticket, &rc, NULL) < 0)
        return NULL;
    if (rc == 0)
        Py_RETURN_TRUE;
    if (rc == AST_EBUSY || rc == AST_ENOENT)
        Py_RETURN_FALSE;
    return raise_ast_error(st, rc, NULL);
}

PyDoc_STRVAR(runtime_poll_doc,
             "poll()\n--\n\nCollect every completed job without blocking: a list of Result.");

typedef struct {
    ast_result buf[POLL_CHUNK];
    size_t n;
} poll_call;

static int do_poll(void *rt, void *arg)
{
    poll_call *c = arg;
    return ast_runtime_poll(rt, c->buf, POLL_CHUNK, &c->n);
}

static PyObject *runtime_poll(RuntimeObject *self, PyObject *unused)
{
    mod_state *st = type_state(Py_TYPE(self));
    PyObject *list = PyList_New(0);
    if (!list)
        return NULL;
    poll_call c;
    do {
        c.n = 0;
        if (rt_call(self, st, do_poll, &c) < 0)
            goto fail;
        for (size_t i = 0; i < c.n; i++) {
            PyObject *r = make_result(st, &c.buf[i]);
            if (!r || PyList_Append(list, r) < 0) {
                Py_XDECREF(r);
                goto fail;
            }
            Py_DECREF(r);
        }
    } while (c.n == POLL_CHUNK);
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
    if (handle_enter(&runtime_kind, &self->g, self->rt, st) < 0)
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
    guard_leave(&self->g);
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
    return rt ? handle_message(&runtime_kind, rt) : NULL;
}

/* ---- Runtime: trace -------------------------------------------------------------------------- */

/* A name and the code it stands for: trace kinds and lanes. */
typedef struct {
    const char *name;
    int code;
} named_code;

static const named_code kind_table[] = {
    {"instant", AST_TRACE_CUSTOM_INSTANT},   {"span", AST_TRACE_CUSTOM_SPAN},
    {"job_queued", AST_TRACE_JOB_QUEUED},    {"job_started", AST_TRACE_JOB_STARTED},
    {"job_done", AST_TRACE_JOB_DONE},        {"job_run", AST_TRACE_JOB_RUN},
    {"copy_issued", AST_TRACE_COPY_ISSUED},  {"copy_done", AST_TRACE_COPY_DONE},
    {"copy", AST_TRACE_COPY},                {"barrier_begin", AST_TRACE_BARRIER_BEGIN},
    {"barrier_end", AST_TRACE_BARRIER_END},  {"barrier_wait", AST_TRACE_BARRIER_WAIT},
    {"install", AST_TRACE_INSTALL},
};
#define N_KINDS (sizeof kind_table / sizeof kind_table[0])

static const named_code lane_table[] = {
    {"train", AST_TRACE_LANE_TRAIN},
    {"shadow", AST_TRACE_LANE_SHADOW},
    {"coherence", AST_TRACE_LANE_COHERENCE},
    {"nvme", AST_TRACE_LANE_NVME},
};
#define N_LANES (sizeof lane_table / sizeof lane_table[0])

/* o as an int in [lo, hi] or a name of table (n entries): 0 with *out set, 1 if it is neither
 * (nothing raised), -1 with the int conversion's exception set. */
static int parse_named(PyObject *o, const named_code *table, size_t n, long lo, long hi,
                       int *out)
{
    if (PyLong_Check(o)) {
        long v = PyLong_AsLong(o);
        if (v == -1 && PyErr_Occurred())
            return -1;
        if (v >= lo && v <= hi) {
            *out = (int)v;
            return 0;
        }
    } else if (PyUnicode_Check(o)) {
        for (size_t i = 0; i < n; i++)
            if (!PyUnicode_CompareWithASCIIString(o, table[i].name)) {
                *out = table[i].code;
                return 0;
            }
    }
    return 1;
}

static int parse_kind(PyObject *o, ast_trace_kind *out)
{
    int code;
    int rc = parse_named(o, kind_table, N_KINDS, 0, AST_TRACE_KIND_COUNT - 1, &code);
    if (rc <= 0) {
        if (rc == 0)
            *out = (ast_trace_kind)code;
        return rc;
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
    int rc = parse_named(o, lane_table, N_LANES, AST_TRACE_LANE_MIN, INT32_MAX - 1000, out);
    if (rc <= 0)
        return rc;
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
    if (rc < 0)
        return handle_raise(&runtime_kind, rt, st, rc);
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
    if (rc < 0)
        return handle_raise(&runtime_kind, rt, st, rc);
    Py_RETURN_NONE;
}

PyDoc_STRVAR(runtime_trace_write_doc,
             "trace_write(path=None)\n--\n\nWrite every event recorded so far as Chrome-trace JSON "
             "to path (None: config 'trace'), atomically, GIL released; recording goes on. "
             "AsteriaError (AST_ESTATE) without a trace; the mapped OSError (naming the path) if "
             "the file cannot be written.");

static int do_trace_write(void *rt, void *arg) { return ast_runtime_trace_write(rt, arg); }

static PyObject *runtime_trace_write(RuntimeObject *self, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"path", NULL};
    mod_state *st = type_state(Py_TYPE(self));
    PyObject *path_o = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "|O:trace_write", kwlist, &path_o))
        return NULL;
    char *path = NULL;
    if (path_o != Py_None) {
        path = malloc(AST_PATH_MAX);
        if (!path)
            return PyErr_NoMemory();
        if (copy_path(path_o, path, AST_PATH_MAX, "path") < 0) {
            free(path);
            return NULL;
        }
    }
    int rc = rt_call(self, st, do_trace_write, path);
    free(path);
    if (rc < 0)
        return NULL;
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
        return PyUnicode_FromFormat("<%s closed>", runtime_spec.name);
    ast_stats s;
    if (ast_runtime_stats_get(self->rt, &s) < 0)
        s.workers = -1;
    return PyUnicode_FromFormat("<%s workers=%d>", runtime_spec.name, s.workers);
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
    {"__enter__", ctx_enter, METH_NOARGS, NULL},
    {"__exit__", ctx_exit, METH_VARARGS, NULL},
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
             "buffers.\nconfig: a Config from validate_config() (taken as it is), or a dict of the "
             "keys in config_keys()\n(validated as validate_config() does); None keeps the "
             "defaults.");

static PyType_Slot runtime_slots[] = {
    {Py_tp_new, runtime_new},
    {Py_tp_dealloc, runtime_dealloc},
    {Py_tp_traverse, type_traverse},
    {Py_tp_repr, runtime_repr},
    {Py_tp_methods, runtime_methods},
    {Py_tp_getset, runtime_getset},
    {Py_tp_doc, (void *)runtime_doc},
    {0, NULL},
};

PyType_Spec runtime_spec = {
    .name = "asteria._C.Runtime",
    .basicsize = sizeof(RuntimeObject),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_IMMUTABLETYPE,
    .slots = runtime_slots,
};
