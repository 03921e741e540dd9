/*
 * shadow.c - asteria._C.Shadow (shadow.h: the snapshot and prefetch rings, on a CUDA
 * stream or the host path).
 * May call: the public libasteria API and the Python C API, and common.h (handle.c's calls for
 * every call that takes the shadow's mutex: each runs with the GIL released).
 */
#include "common.h"

/* ---- Shadow --------------------------------------------------------------------------------------
 *
 * Snapshot tickets are ints (the ticket id); the binding keeps each live ticket's host pointer
 * and size in a table touched with the GIL held, and passes a stack copy to calls that release
 * it.
 *
 * Views (slot_view, snapshot_view) are DLPack capsules (dlpack.c) holding a reference to the
 * Shadow, counted in `views`. Lifetime: the rings are freed only when no view lives. close()
 * with views alive closes the handle at once (every method then raises) but defers freeing the
 * stream and rings to the release of the last view, so no tensor ever points into freed
 * memory. A view stays valid memory until then; what it reads is the ring's business: a slot
 * released (or a ticket released) may be reused by the next copy, as with the raw pointers.
 */

typedef struct {
    PyObject_HEAD
    ast_shadow *sh;
    guard g;
    ast_shadow_ticket *tickets; /* live snapshot tickets; id 0: free entry */
    size_t captickets;
    int device;      /* the CUDA device of the rings; -1 on the host path */
    uint64_t views;  /* live views (GIL held) */
} ShadowObject;

static int shadow_error(void *sh, char *buf, size_t len)
{
    return ast_shadow_last_error(sh, buf, len);
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

static const handle_kind shadow_kind = {"shadow", shadow_error, shadow_raise};

static int sh_enter(ShadowObject *self, mod_state *st)
{
    return handle_enter(&shadow_kind, &self->g, self->sh, st);
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
    ShadowObject *self = (ShadowObject *)type_alloc(type);
    if (!self)
        return NULL;
    guard_init(&self->g);
    ast_shadow *sh = NULL;
    char err[ERRBUF_LEN] = "";
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = ast_shadow_create(&o, &sh, err, sizeof err);
    Py_END_ALLOW_THREADS
    if (rc < 0) {
        Py_DECREF(self);
        return raise_busy_aware(st, rc, err);
    }
    self->sh = sh;
    self->device = -1;
    if (ast_shadow_is_cuda(sh)) {
        ast_shadow_stats ss;
        Py_BEGIN_ALLOW_THREADS
        rc = ast_shadow_stats_get(sh, &ss);
        Py_END_ALLOW_THREADS
        if (rc < 0) {
            Py_DECREF(self);
            return raise_ast_error(st, rc, NULL);
        }
        self->device = ss.device;
    }
    return (PyObject *)self;
}

/* Frees the stream and rings (no view may live). Destroy waits for every copy in flight. */
static void shadow_destroy(ShadowObject *self)
{
    ast_shadow *sh = self->sh;
    if (!sh)
        return;
    Py_BEGIN_ALLOW_THREADS
    guard_drain(&self->g);
    ast_shadow_destroy(sh);
    Py_END_ALLOW_THREADS
    self->sh = NULL;
}

static int shadow_close_impl(ShadowObject *self)
{
    if (self->g.closed)
        return 0;
    self->g.closed = 1;
    if (!self->views)
        shadow_destroy(self);
    return 0;
}

static int shadow_close_obj(PyObject *self) { return shadow_close_impl((ShadowObject *)self); }

static void shadow_dealloc(ShadowObject *self)
{
    PyObject_GC_UnTrack(self);
    close_in_dealloc(shadow_close_obj, (PyObject *)self);
    guard_fini(&self->g);
    PyMem_Free(self->tickets);
    heap_free(self);
}

PyDoc_STRVAR(shadow_close_doc,
             "close()\n--\n\nWait (GIL released) for every copy in flight and free the stream, "
             "events and rings; pointers it handed out become invalid. While views\n(slot_view, "
             "snapshot_view) live, the freeing waits for the last one to go (the handle is "
             "closed at once). Idempotent; also done on\ndeallocation.");

static PyObject *shadow_close(ShadowObject *self, PyObject *unused)
{
    shadow_close_impl(self);
    Py_RETURN_NONE;
}

PyDoc_STRVAR(shadow_snapshot_doc,
             "snapshot(src_ptr, nbytes, wait_event_ptr=0)\n--\n\nCopy nbytes at src_ptr (device "
             "memory on the CUDA path, host memory on the host path) into the snapshot ring,\n"
             "after the shadow stream waited on wait_event_ptr (a cudaEvent_t as int; 0: none; "
             "CUDA path only). Returns the ticket (int). BusyError when the ring is full\n"
             "(release snapshots); ValueError for a size above the ring capacity. GIL released.");

typedef struct {
    const ast_shadow_piece *pc;
    int npc;
    void *ev;
    ast_shadow_ticket t;
} snapshot_call;

static int do_snapshot(void *sh, void *arg)
{
    snapshot_call *c = arg;
    return ast_shadow_snapshotv(sh, c->pc, c->npc, c->ev, &c->t);
}

static int do_snapshot_release(void *sh, void *arg)
{
    return ast_shadow_snapshot_release(sh, arg);
}

/* Issues the snapshot of the pieces (entered with sh_enter; leaves the guard). */
static PyObject *snapshot_issue(ShadowObject *self, mod_state *st, const ast_shadow_piece *pc,
                                int npc, void *ev)
{
    snapshot_call c = {pc, npc, ev, {0}};
    char err[ERRBUF_LEN] = "";
    int rc = handle_run(&shadow_kind, self->sh, do_snapshot, &c, err);
    if (rc == 0 && ticket_add(self, &c.t) < 0) {
        /* No room to remember it: give the slot back rather than leak it. */
        handle_run(&shadow_kind, self->sh, do_snapshot_release, &c.t, NULL);
        guard_leave(&self->g);
        return NULL;
    }
    guard_leave(&self->g);
    if (rc < 0)
        return shadow_raise(st, rc, err);
    return PyLong_FromUnsignedLongLong(c.t.id);
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
    Py_ssize_t n = fast_len(seq);
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
        PyObject *item = fast_item(seq, i);
        if (!PyTuple_Check(item) || PyTuple_Size(item) != 2) {
            PyErr_Format(PyExc_TypeError, "snapshot_gather: piece %zd must be a (src_ptr, "
                         "nbytes) tuple", i);
            goto done;
        }
        if (!conv_ptr(PyTuple_GetItem(item, 0), &pc[i].src) ||
            !conv_size(PyTuple_GetItem(item, 1), &pc[i].nbytes))
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

/* Snapshot calls that take a ticket: 0 query, 1 wait, 2 event, 3 release. The call reads the
 * message itself: a query's AST_EBUSY (in flight) is an answer, not a failure. */
typedef struct {
    int what;
    ast_shadow_ticket *t;
    void *ev;
    char err[ERRBUF_LEN];
} ticket_call;

static int do_ticket(void *sh, void *arg)
{
    ticket_call *c = arg;
    int rc;
    switch (c->what) {
    case 0:
        rc = ast_shadow_snapshot_query(sh, c->t);
        break;
    case 1:
        rc = ast_shadow_snapshot_wait(sh, c->t);
        break;
    case 2:
        rc = ast_shadow_snapshot_event(sh, c->t, &c->ev);
        break;
    default:
        rc = ast_shadow_snapshot_release(sh, c->t);
        break;
    }
    if (rc < 0 && !(c->what == 0 && rc == AST_EBUSY))
        ast_shadow_last_error(sh, c->err, sizeof c->err);
    return rc;
}

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
    ticket_call c = {what, &t, NULL, ""};
    int rc = handle_run(&shadow_kind, self->sh, do_ticket, &c, NULL);
    guard_leave(&self->g);
    void *ev = c.ev;
    const char *err = c.err;
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
PyDoc_STRVAR(shadow_snapshot_wait_doc,
             "snapshot_wait(ticket)\n--\n\nBlock (GIL released, no spinning) until the copy has "
             "landed; returns the staged host pointer (int), valid until snapshot_release.");
PyDoc_STRVAR(shadow_snapshot_event_doc,
             "snapshot_event(ticket)\n--\n\nThe cudaEvent_t (int) recorded after the snapshot "
             "copy, for the main stream to wait on before overwriting the source; 0 on the host "
             "path.");
PyDoc_STRVAR(shadow_snapshot_release_doc,
             "snapshot_release(ticket)\n--\n\nGive the snapshot slot back; its host pointer must "
             "not be read afterwards.");

/* The methods of one int argument, each a `what` of one of the two dispatchers (name,
 * dispatcher, what): a function shadow_<name> and a method row with shadow_<name>_doc. C has
 * no closures, so a row per method is the one way to bind one function for several names. */
#define SHADOW_TICKET_METHODS(X)                                                                  \
    X(snapshot_query, shadow_ticket_call, 0)                                                      \
    X(snapshot_wait, shadow_ticket_call, 1)                                                       \
    X(snapshot_event, shadow_ticket_call, 2)                                                      \
    X(snapshot_release, shadow_ticket_call, 3)
#define SHADOW_KEY_METHODS(X)                                                                     \
    X(lookup, shadow_key_arg, 0)                                                                  \
    X(prefetch_wait, shadow_key_arg, 1)                                                           \
    X(ready_event, shadow_key_arg, 2)                                                             \
    X(release, shadow_key_arg, 3)
#define SHADOW_ARG_DEFINE(name, call, what)                                                       \
    static PyObject *shadow_##name(ShadowObject *self, PyObject *arg)                             \
    {                                                                                             \
        return call(self, arg, what);                                                             \
    }
#define SHADOW_ARG_METHOD_DEF(name, call, what)                                                   \
    {#name, (PyCFunction)shadow_##name, METH_O, shadow_##name##_doc},

SHADOW_TICKET_METHODS(SHADOW_ARG_DEFINE)

PyDoc_STRVAR(shadow_prefetch_doc,
             "prefetch(host_ptr, nbytes, key)\n--\n\nCopy nbytes at host_ptr into the prefetch "
             "ring for key (an int unique among staged keys); returns the slot's device\n"
             "pointer (host memory on the host path), usable once ready_event(key) is waited on. "
             "BusyError when the ring is full (release keys); AsteriaError (AST_ESTATE)\n"
             "if key is already staged. GIL released.");

typedef struct {
    void *src, *dev;
    size_t nbytes;
    uint64_t key;
} prefetch_call;

static int do_prefetch(void *sh, void *arg)
{
    prefetch_call *c = arg;
    return ast_shadow_prefetch(sh, c->src, c->nbytes, c->key, &c->dev);
}

static PyObject *shadow_prefetch(ShadowObject *self, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"host_ptr", "nbytes", "key", NULL};
    mod_state *st = type_state(Py_TYPE(self));
    prefetch_call c = {NULL, NULL, 0, 0};
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O&O&O&:prefetch", kwlist, conv_ptr, &c.src,
                                     conv_size, &c.nbytes, conv_u64, &c.key) ||
        handle_call(&shadow_kind, &self->g, self->sh, st, do_prefetch, &c) < 0)
        return NULL;
    return PyLong_FromVoidPtr(c.dev);
}

/* Prefetch calls that take a key: 0 lookup, 1 wait, 2 ready event, 3 release, 4 release after
 * stream. The call reads the message itself: a lookup's AST_EBUSY (in flight) and AST_ENOENT
 * (not staged) are answers, not failures. */
typedef struct {
    int what;
    uint64_t key;
    uintptr_t stream;
    void *p;
    size_t n;
    char err[ERRBUF_LEN];
} key_call;

static int do_key(void *sh, void *arg)
{
    key_call *c = arg;
    int rc;
    switch (c->what) {
    case 0:
        rc = ast_shadow_lookup(sh, c->key, &c->p, &c->n);
        break;
    case 1:
        rc = ast_shadow_prefetch_wait(sh, c->key);
        break;
    case 2:
        rc = ast_shadow_ready_event(sh, c->key, &c->p);
        break;
    case 3:
        rc = ast_shadow_release(sh, c->key);
        break;
    default:
        rc = ast_shadow_release_after(sh, c->key, c->stream);
        break;
    }
    if (rc < 0 && !(c->what == 0 && (rc == AST_EBUSY || rc == AST_ENOENT)))
        ast_shadow_last_error(sh, c->err, sizeof c->err);
    return rc;
}

static PyObject *shadow_key_call(ShadowObject *self, uint64_t key, int what, uintptr_t stream)
{
    mod_state *st = type_state(Py_TYPE(self));
    key_call c = {what, key, stream, NULL, 0, ""};
    int rc;
    if (handle_try(&shadow_kind, &self->g, self->sh, st, do_key, &c, &rc, NULL) < 0)
        return NULL;
    void *p = c.p;
    size_t n = c.n;
    const char *err = c.err;
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
PyDoc_STRVAR(shadow_prefetch_wait_doc,
             "prefetch_wait(key)\n--\n\nBlock (GIL released) until key's copy has completed.");
PyDoc_STRVAR(shadow_ready_event_doc,
             "ready_event(key)\n--\n\nThe slot's ready cudaEvent_t as an int (0 on the host "
             "path), valid until release; torch.cuda.Event cannot wrap it, wait on it with "
             "cudaStreamWaitEvent.");
PyDoc_STRVAR(shadow_release_doc,
             "release(key)\n--\n\nRelease key's slot now (no reads of it pending).");

SHADOW_KEY_METHODS(SHADOW_ARG_DEFINE)

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

/* The release hook of a view: the last one of a closed shadow frees it. */
static void shadow_view_release(PyObject *owner)
{
    ShadowObject *self = (ShadowObject *)owner;
    if (!--self->views && self->g.closed)
        shadow_destroy(self);
}

static PyObject *shadow_view(ShadowObject *self, void *ptr, size_t n, int cuda,
                             const view_spec *v, const char *what)
{
    self->views++;
    return view_export(v, Py_NewRef((PyObject *)self), shadow_view_release, ptr, n,
                       cuda ? self->device : -1, what);
}

PyDoc_STRVAR(shadow_slot_view_doc,
             "slot_view(key, dtype, shape)\n--\n\nA DLPack capsule (\"dltensor\") over key's "
             "prefetch slot, for torch.from_dlpack: a CUDA tensor on the shadow's device (a CPU\n"
             "tensor on the host path) of shape and dtype (float32, float64, float16, bfloat16, "
             "int32, int64; a name or a torch.dtype), whose bytes must be\nexactly the slot's "
             "(ValueError otherwise). Read it in stream order after the slot's ready event; its "
             "contents are the slot's until\nrelease(key). The view keeps the Shadow alive and "
             "its rings allocated (see close). FileNotFoundError if key is not staged.");

/* A lookup whose failure message nobody reads. */
static int do_lookup(void *sh, void *arg)
{
    key_call *c = arg;
    return ast_shadow_lookup(sh, c->key, &c->p, &c->n);
}

static PyObject *shadow_slot_view(ShadowObject *self, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"key", "dtype", "shape", NULL};
    mod_state *st = type_state(Py_TYPE(self));
    uint64_t key;
    PyObject *dtype, *shape;
    view_spec v;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O&OO:slot_view", kwlist, conv_u64, &key,
                                     &dtype, &shape) ||
        view_spec_parse(dtype, shape, &v) < 0)
        return NULL;
    ast_shadow *sh = self->sh;
    key_call c = {0, key, 0, NULL, 0, ""};
    int rc;
    if (handle_try(&shadow_kind, &self->g, sh, st, do_lookup, &c, &rc, NULL) < 0)
        return NULL;
    if (rc == AST_ENOENT) {
        char msg[96];
        snprintf(msg, sizeof msg, "slot_view: key %" PRIu64 " is not staged", key);
        return raise_ast_error(st, rc, msg);
    }
    if (rc < 0 && rc != AST_EBUSY) /* EBUSY: copy in flight, the pointer is valid */
        return raise_ast_error(st, rc, NULL);
    char what[64];
    snprintf(what, sizeof what, "prefetch slot %" PRIu64, key);
    return shadow_view(self, c.p, c.n, ast_shadow_is_cuda(sh), &v, what);
}

PyDoc_STRVAR(shadow_snapshot_view_doc,
             "snapshot_view(ticket, dtype, shape)\n--\n\nA DLPack capsule (\"dltensor\") over "
             "the host copy of a snapshot ticket (a CPU tensor; read it after snapshot_wait),\n"
             "dtype and shape as for slot_view, bytes exactly the ticket's. Its contents are the "
             "ticket's until snapshot_release(ticket). The view\nkeeps the Shadow alive and its "
             "rings allocated (see close). FileNotFoundError for an unknown ticket.");

static PyObject *shadow_snapshot_view(ShadowObject *self, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"ticket", "dtype", "shape", NULL};
    mod_state *st = type_state(Py_TYPE(self));
    uint64_t id;
    PyObject *dtype, *shape;
    view_spec v;
    ast_shadow_ticket t;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O&OO:snapshot_view", kwlist, conv_u64, &id,
                                     &dtype, &shape) ||
        view_spec_parse(dtype, shape, &v) < 0 ||
        handle_open(&shadow_kind, &self->g, self->sh, st) < 0 || ticket_get(self, st, id, &t) < 0)
        return NULL;
    char what[64];
    snprintf(what, sizeof what, "snapshot ticket %" PRIu64, id);
    return shadow_view(self, t.host, t.nbytes, 0, &v, what);
}

PyDoc_STRVAR(shadow_stream_handle_doc,
             "stream_handle()\n--\n\nThe shadow cudaStream_t as an int, for "
             "torch.cuda.ExternalStream. AsteriaError (AST_ENODEV) on the host path.");

static PyObject *shadow_stream_handle(ShadowObject *self, PyObject *unused)
{
    mod_state *st = type_state(Py_TYPE(self));
    if (handle_open(&shadow_kind, &self->g, self->sh, st) < 0)
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

static int do_stats(void *sh, void *arg) { return ast_shadow_stats_get(sh, arg); }

static PyObject *shadow_stats(ShadowObject *self, PyObject *unused)
{
    mod_state *st = type_state(Py_TYPE(self));
    ast_shadow_stats s;
    int rc;
    if (handle_try(&shadow_kind, &self->g, self->sh, st, do_stats, &s, &rc, NULL) < 0)
        return NULL;
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
    return handle_message_released(&shadow_kind, &self->g, self->sh, type_state(Py_TYPE(self)));
}

static PyObject *shadow_get_is_cuda(ShadowObject *self, void *closure)
{
    if (handle_open(&shadow_kind, &self->g, self->sh, type_state(Py_TYPE(self))) < 0)
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
    SHADOW_TICKET_METHODS(SHADOW_ARG_METHOD_DEF)
    {"prefetch", (PyCFunction)(void (*)(void))shadow_prefetch, METH_VARARGS | METH_KEYWORDS,
     shadow_prefetch_doc},
    SHADOW_KEY_METHODS(SHADOW_ARG_METHOD_DEF)
    {"release_after", (PyCFunction)(void (*)(void))shadow_release_after,
     METH_VARARGS | METH_KEYWORDS, shadow_release_after_doc},
    {"slot_view", (PyCFunction)(void (*)(void))shadow_slot_view, METH_VARARGS | METH_KEYWORDS,
     shadow_slot_view_doc},
    {"snapshot_view", (PyCFunction)(void (*)(void))shadow_snapshot_view,
     METH_VARARGS | METH_KEYWORDS, shadow_snapshot_view_doc},
    {"stream_handle", (PyCFunction)shadow_stream_handle, METH_NOARGS, shadow_stream_handle_doc},
    {"stats", (PyCFunction)shadow_stats, METH_NOARGS, shadow_stats_doc},
    {"last_error", (PyCFunction)shadow_last_error, METH_NOARGS, shadow_last_error_doc},
    {"close", (PyCFunction)shadow_close, METH_NOARGS, shadow_close_doc},
    {"__enter__", ctx_enter, METH_NOARGS, NULL},
    {"__exit__", ctx_exit, METH_VARARGS, NULL},
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
    {Py_tp_traverse, type_traverse},
    {Py_tp_methods, shadow_methods},
    {Py_tp_getset, shadow_getset},
    {Py_tp_doc, (void *)shadow_doc},
    {0, NULL},
};

PyType_Spec shadow_spec = {
    .name = "asteria._C.Shadow",
    .basicsize = sizeof(ShadowObject),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_IMMUTABLETYPE,
    .slots = shadow_slots,
};
