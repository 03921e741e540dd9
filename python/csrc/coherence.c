/*
 * coherence.c - asteria._C.Coherence (coherence.h: the registry of replicated blocks).
 * May call: the public libasteria API and the Python C API, and common.h (handle.c's
 * handle_raise and handle_message for a failure's message and last_error()).
 */
#include "common.h"

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

static int coherence_error(void *reg, char *buf, size_t len)
{
    return ast_coherence_last_error(reg, buf, len);
}

/* No guard: every call keeps the GIL (see above). A failure raises BusyError for AST_EBUSY. */
static const handle_kind coherence_kind = {"coherence registry", coherence_error,
                                           raise_busy_aware};

/* Raises the failure rc of the call just made on reg, with its message. */
static PyObject *coh_raise(mod_state *st, ast_coherence *reg, int rc)
{
    return handle_raise(&coherence_kind, reg, st, rc);
}

/* A sequence of ints as a PyMem array of C ints (*n entries); -1 with an exception set. */
static int int_array(PyObject *o, const char *what, int **out, int *n)
{
    PyObject *seq = PySequence_Fast(o, what);
    if (!seq)
        return -1;
    Py_ssize_t len = fast_len(seq);
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
        if (as_int(fast_item(seq, i), &a[i], what) < 0) {
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
    Py_ssize_t len = fast_len(seq);
    uint64_t *a = PyMem_Malloc((size_t)(len ? len : 1) * sizeof *a);
    if (!a) {
        Py_DECREF(seq);
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t i = 0; i < len; i++)
        if (!conv_u64(fast_item(seq, i), &a[i])) {
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
    int rc = ast_coherence_create(&o, &reg, err, sizeof err);
    PyMem_Free(node_ids);
    PyMem_Free(groups);
    if (rc < 0)
        return raise_ast_error(st, rc, err);
    CoherenceObject *self = (CoherenceObject *)type_alloc(type);
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

static void coherence_dealloc(CoherenceObject *self)
{
    PyObject_GC_UnTrack(self);
    coherence_close_impl(self);
    heap_free(self);
}

static PyObject *coherence_close(CoherenceObject *self, PyObject *unused)
{
    coherence_close_impl(self);
    Py_RETURN_NONE;
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

/* ---- the plain calls --------------------------------------------------------------------------
 *
 * Most registry calls read one argument (a block id, a rank, a step; or a block, version and
 * step given by keyword), make one libasteria call and return one value. Each is a row of
 * COH_PLAIN_CALLS below: how its argument is read, the call, how its result becomes a Python
 * object; coh_run does the rest for all of them (parse, coh_open, call, coh_raise), so they
 * fail alike.
 */

/* How a call's argument is read: none (METH_NOARGS); a block id, a rank or a step (METH_O); or
 * by keyword (block, version, step) / (block, step). */
typedef enum { IN_NONE, IN_BLOCK, IN_RANK, IN_STEP, IN_BVS, IN_BS } coh_in_kind;

typedef struct {
    uint64_t block, version;
    long long step;
    int rank;
} coh_in;

/* What a call writes: one of these, per its row. */
typedef union {
    int rank;
    uint64_t u64;
    size_t size;
    ast_coherence_block block;
    ast_coherence_hier hier;
    ast_coherence_stats stats;
} coh_out;

typedef struct {
    coh_in_kind in;
    const char *format; /* IN_BVS / IN_BS: PyArg_ParseTupleAndKeywords's format */
    int (*call)(ast_coherence *reg, const coh_in *a, coh_out *v);
    PyObject *(*result)(int rc, const coh_out *v); /* rc: the call's return value, >= 0 */
} coh_call;

/* Reads args / kwds as in says and opens the registry: the registry, or NULL with an
 * exception set. format: PyArg's format for the keyword kinds. */
static ast_coherence *coh_enter(CoherenceObject *self, mod_state *st, coh_in_kind in,
                                const char *format, PyObject *args, PyObject *kwds, coh_in *a)
{
    static char *kw_bvs[] = {"block", "version", "step", NULL};
    static char *kw_bs[] = {"block", "step", NULL};
    int ok = 1;
    switch (in) {
    case IN_NONE:
        break;
    case IN_BLOCK:
        ok = conv_u64(args, &a->block);
        break;
    case IN_RANK:
        ok = as_int(args, &a->rank, "rank") == 0;
        break;
    case IN_STEP:
        a->step = PyLong_AsLongLong(args);
        ok = !(a->step == -1 && PyErr_Occurred());
        break;
    case IN_BVS:
        ok = PyArg_ParseTupleAndKeywords(args, kwds, format, kw_bvs, conv_u64, &a->block,
                                         conv_u64, &a->version, &a->step);
        break;
    case IN_BS:
        ok = PyArg_ParseTupleAndKeywords(args, kwds, format, kw_bs, conv_u64, &a->block,
                                         &a->step);
        break;
    }
    return ok ? coh_open(self, st) : NULL;
}

static PyObject *coh_run(CoherenceObject *self, PyObject *args, PyObject *kwds, const coh_call *c)
{
    mod_state *st = type_state(Py_TYPE(self));
    coh_in a = {0};
    ast_coherence *reg = coh_enter(self, st, c->in, c->format, args, kwds, &a);
    if (!reg)
        return NULL;
    coh_out v;
    memset(&v, 0, sizeof v);
    int rc = c->call(reg, &a, &v);
    if (rc < 0)
        return coh_raise(st, reg, rc);
    return c->result(rc, &v);
}

static PyObject *ret_none(int rc, const coh_out *v) { Py_RETURN_NONE; }
static PyObject *ret_bool(int rc, const coh_out *v) { return PyBool_FromLong(rc); }
static PyObject *ret_rank(int rc, const coh_out *v) { return PyLong_FromLong(v->rank); }
static PyObject *ret_u64(int rc, const coh_out *v) { return PyLong_FromUnsignedLongLong(v->u64); }
static PyObject *ret_size(int rc, const coh_out *v) { return PyLong_FromSize_t(v->size); }

/* The dict a struct result becomes: fill sets its keys (nonzero on failure); NULL with an
 * exception set. */
static PyObject *dict_of(int (*fill)(PyObject *d, const coh_out *v), const coh_out *v)
{
    PyObject *d = PyDict_New();
    if (d && fill(d, v)) {
        Py_DECREF(d);
        return NULL;
    }
    return d;
}

static int fill_block(PyObject *d, const coh_out *v)
{
    const ast_coherence_block *b = &v->block;
#define U64(f) dict_set_steal(d, #f, PyLong_FromUnsignedLongLong(b->f))
#define I64(f) dict_set_steal(d, #f, PyLong_FromLongLong(b->f))
    int bad = U64(cost) || I64(owner) || I64(nreplicas) ||
              dict_set_steal(d, "is_replica", PyBool_FromLong(b->is_replica)) || U64(version) ||
              I64(snapshot_step) || U64(held_version) || I64(last_recv_step) ||
              U64(synced_version) || I64(last_sync_step) || U64(due_version) ||
              U64(installed_version);
#undef U64
#undef I64
    return bad;
}

static int fill_hier(PyObject *d, const coh_out *v)
{
    static const char *const inter[3] = {"none", "send", "recv"};
    const ast_coherence_hier *h = &v->hier;
#define I(f) dict_set_steal(d, #f, PyLong_FromLong(h->f))
#define B(f) dict_set_steal(d, #f, PyBool_FromLong(h->f))
    int bad =
        I(owner) || I(owner_node) || I(node) || I(nodes) || I(node_replicas) || B(is_replica) ||
        B(is_representative) || I(representative) || I(inter_root) || B(write_shm) ||
        B(read_shm) || dict_set_steal(d, "inter", PyUnicode_FromString(inter[h->inter])) ||
        dict_set_steal(d, "recv_level", h->recv_level >= 0 && h->recv_level < AST_COH_LEVEL_COUNT
                                            ? PyUnicode_FromString(coh_level_names[h->recv_level])
                                            : Py_NewRef(Py_None)) ||
        B(flat_recv) || B(flat_recv_inter);
#undef I
#undef B
    return bad;
}

static int fill_stats(PyObject *d, const coh_out *v)
{
    const ast_coherence_stats *s = &v->stats;
#define U64(f) dict_set_steal(d, #f, PyLong_FromUnsignedLongLong(s->f))
#define I64(f) dict_set_steal(d, #f, PyLong_FromLongLong(s->f))
    int bad = U64(blocks) || U64(owned) || U64(load) || U64(published) || U64(imported) ||
              U64(received) || U64(synced) || U64(installs) || U64(due_listed) ||
              U64(barrier_waits) || U64(barrier_wait_ns) || U64(barrier_max_wait_ns) ||
              I64(max_lag_steps) || I64(evaluated_step) || I64(world_size) || I64(rank) ||
              I64(node) || I64(nodes) || I64(staleness);
#undef U64
#undef I64
    for (int i = 0; !bad && i < AST_COH_LEVEL_COUNT; i++) {
        char key[32];
        snprintf(key, sizeof key, "bytes_%s", coh_level_names[i]);
        bad = dict_set_steal(d, key, PyLong_FromUnsignedLongLong(s->bytes[i])) < 0;
    }
    return bad;
}

static PyObject *ret_block(int rc, const coh_out *v) { return dict_of(fill_block, v); }
static PyObject *ret_hier(int rc, const coh_out *v) { return dict_of(fill_hier, v); }
static PyObject *ret_stats(int rc, const coh_out *v) { return dict_of(fill_stats, v); }

/* Each plain call: its method name, how it is bound (NOARGS, O or KEYWORDS), how its argument
 * is read, the call (reg, a: the coh_in read, v: the coh_out it fills) and its result. The
 * docstring is coherence_<name>_doc. */
#define COH_PLAIN_CALLS(X)                                                                        \
    X(plan, NOARGS, IN_NONE, ast_coherence_plan(reg), ret_none)                                   \
    X(nblocks, NOARGS, IN_NONE, ast_coherence_nblocks(reg, &v->size), ret_size)                   \
    X(stats, NOARGS, IN_NONE, ast_coherence_stats_get(reg, &v->stats), ret_stats)                 \
    X(owner, O, IN_BLOCK, ast_coherence_owner(reg, a->block, &v->rank), ret_rank)                 \
    X(is_owner, O, IN_BLOCK, ast_coherence_is_owner(reg, a->block), ret_bool)                     \
    X(block_info, O, IN_BLOCK, ast_coherence_block_info(reg, a->block, &v->block), ret_block)     \
    X(hier_plan, O, IN_BLOCK, ast_coherence_hier_plan(reg, a->block, &v->hier), ret_hier)         \
    X(load, O, IN_RANK, ast_coherence_load(reg, a->rank, &v->u64), ret_u64)                       \
    X(barrier_begin, O, IN_STEP, ast_coherence_barrier_begin(reg, a->step), ret_none)             \
    X(barrier_end, O, IN_STEP, ast_coherence_barrier_end(reg, a->step), ret_none)                 \
    X(publish, KEYWORDS, IN_BVS, ast_coherence_publish(reg, a->block, a->version, a->step),       \
      ret_none)                                                                                   \
    X(received, KEYWORDS, IN_BVS, ast_coherence_received(reg, a->block, a->version, a->step),     \
      ret_none)                                                                                   \
    X(mark_synced, KEYWORDS, IN_BVS,                                                              \
      ast_coherence_mark_synced(reg, a->block, a->version, a->step), ret_none)                    \
    X(install_version, KEYWORDS, IN_BS,                                                           \
      ast_coherence_install_version(reg, a->block, a->step, &v->u64), ret_u64)

/* The Python-side shape of each binding: C parameters, what coh_run gets, the METH_ flags. */
#define COH_PARAMS_NOARGS PyObject *args
#define COH_PARAMS_O PyObject *args
#define COH_PARAMS_KEYWORDS PyObject *args, PyObject *kwds
#define COH_KWDS_NOARGS NULL
#define COH_KWDS_O NULL
#define COH_KWDS_KEYWORDS kwds
#define COH_FLAGS_NOARGS METH_NOARGS
#define COH_FLAGS_O METH_O
#define COH_FLAGS_KEYWORDS (METH_VARARGS | METH_KEYWORDS)
/* PyArg format of the keyword kinds; the name after ':' names the method in its errors. */
#define COH_FORMAT_IN_NONE ""
#define COH_FORMAT_IN_BLOCK ""
#define COH_FORMAT_IN_RANK ""
#define COH_FORMAT_IN_STEP ""
#define COH_FORMAT_IN_BVS "O&O&L"
#define COH_FORMAT_IN_BS "O&L"

#define COH_DEFINE(name, bind, in, expr, result)                                                  \
    static int coh_call_##name(ast_coherence *reg, const coh_in *a, coh_out *v) { return expr; }  \
    static PyObject *coherence_##name(CoherenceObject *self, COH_PARAMS_##bind)                   \
    {                                                                                             \
        static const coh_call c = {in, COH_FORMAT_##in ":" #name, coh_call_##name, result};       \
        return coh_run(self, args, COH_KWDS_##bind, &c);                                          \
    }
#define COH_METHOD_DEF(name, bind, in, expr, result)                                              \
    {#name, (PyCFunction)(void (*)(void))coherence_##name, COH_FLAGS_##bind,                      \
     coherence_##name##_doc},

PyDoc_STRVAR(coherence_plan_doc,
             "plan()\n--\n\nFix every owner (LPT); a second call does nothing.");
PyDoc_STRVAR(coherence_nblocks_doc,
             "nblocks()\n--\n\nRegistered blocks (the exchange vector has 3 int64 per block).");
PyDoc_STRVAR(coherence_stats_doc,
             "stats()\n--\n\nblocks, owned, load, published, imported, received, synced, "
             "installs, due_listed, bytes_<level> for each level, barrier_waits, barrier_wait_ns, "
             "barrier_max_wait_ns, max_lag_steps, evaluated_step, world_size, rank, node, nodes, "
             "staleness.");
PyDoc_STRVAR(coherence_owner_doc,
             "owner(block)\n--\n\nThe rank that computes the block's refresh.");
PyDoc_STRVAR(coherence_is_owner_doc, "is_owner(block)\n--\n\nTrue if this rank owns the block.");
PyDoc_STRVAR(coherence_block_info_doc,
             "block_info(block)\n--\n\nThe block's cost, owner, versions and steps (a dict).");
PyDoc_STRVAR(coherence_hier_plan_doc,
             "hier_plan(block)\n--\n\nThis rank's part in moving the block (a dict: write_shm, "
             "read_shm, inter 'none'/'send'/'recv', inter_root, recv_level, flat_recv, ...).");
PyDoc_STRVAR(coherence_load_doc, "load(rank)\n--\n\nTotal cost of the blocks a rank owns.");
PyDoc_STRVAR(coherence_barrier_begin_doc,
             "barrier_begin(step)\n--\n\nOpen the bracket of a wait at the bounded barrier.");
PyDoc_STRVAR(coherence_barrier_end_doc, "barrier_end(step)\n--\n\nClose it and count the wait.");
PyDoc_STRVAR(coherence_publish_doc,
             "publish(block, version, step)\n--\n\nOwner: the refresh snapshotted at step is "
             "ready as version.");
PyDoc_STRVAR(coherence_received_doc,
             "received(block, version, step)\n--\n\nNon-owner replica: the data of version "
             "landed here.");
PyDoc_STRVAR(coherence_mark_synced_doc,
             "mark_synced(block, version, step)\n--\n\nEvery replica, after the transfer of "
             "version completed.");
PyDoc_STRVAR(coherence_install_version_doc,
             "install_version(block, step)\n--\n\nThe version every replica installs at step (0: "
             "none yet). BusyError when this rank replicates the block but does not hold that "
             "version (sync first).");

COH_PLAIN_CALLS(COH_DEFINE)

/* ---- the calls that return a list ---------------------------------------------------------- */

/* A tuple of the n values at a (C ints, or uint64_t when u64 is set); NULL with an exception
 * set. */
static PyObject *tuple_of(const void *a, size_t n, int u64)
{
    PyObject *out = PyTuple_New((Py_ssize_t)n);
    for (size_t i = 0; out && i < n; i++) {
        PyObject *v = u64 ? PyLong_FromUnsignedLongLong(((const uint64_t *)a)[i])
                          : PyLong_FromLong(((const int *)a)[i]);
        if (!v)
            Py_CLEAR(out);
        else
            PyTuple_SetItem(out, (Py_ssize_t)i, v);
    }
    return out;
}

/* replicas() (reps 0) and representatives() (reps 1) as a tuple of ints. */
static PyObject *coherence_rank_list(CoherenceObject *self, PyObject *arg, int reps)
{
    mod_state *st = type_state(Py_TYPE(self));
    coh_in a = {0};
    ast_coherence *reg = coh_enter(self, st, IN_BLOCK, NULL, arg, NULL, &a);
    if (!reg)
        return NULL;
    int (*fn)(ast_coherence *, uint64_t, int *, size_t, size_t *) =
        reps ? ast_coherence_representatives : ast_coherence_replicas;
    size_t n = 0;
    int rc = fn(reg, a.block, NULL, 0, &n);
    if (rc < 0)
        return coh_raise(st, reg, rc);
    int *ranks = PyMem_Malloc((n ? n : 1) * sizeof *ranks);
    if (!ranks)
        return PyErr_NoMemory();
    rc = fn(reg, a.block, ranks, n, &n);
    PyObject *out = rc < 0 ? coh_raise(st, reg, rc) : tuple_of(ranks, n, 0);
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

PyDoc_STRVAR(coherence_due_doc,
             "due(step)\n--\n\nThe blocks this rank replicates that must sync at step, ascending "
             "(a tuple of ints). Evaluates step.");

static PyObject *coherence_due(CoherenceObject *self, PyObject *arg)
{
    mod_state *st = type_state(Py_TYPE(self));
    coh_in a = {0};
    ast_coherence *reg = coh_enter(self, st, IN_STEP, NULL, arg, NULL, &a);
    if (!reg)
        return NULL;
    size_t cap = 0, n = 0;
    ast_coherence_nblocks(reg, &cap);
    uint64_t *ids = PyMem_Malloc((cap ? cap : 1) * sizeof *ids);
    if (!ids)
        return PyErr_NoMemory();
    int rc = ast_coherence_due(reg, a.step, ids, cap, &n);
    PyObject *out = rc < 0 ? coh_raise(st, reg, rc) : tuple_of(ids, n, 1);
    PyMem_Free(ids);
    return out;
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

/* versions_export (export 1) / versions_import (export 0) of the n int64 at buf through an
 * aligned copy, for a buffer that may not be aligned. Returns the call's rc, or 1 with
 * MemoryError set. */
static int xchg_copy(ast_coherence *reg, long long step, void *buf, size_t n, int export)
{
    int64_t *tmp = PyMem_Malloc((n ? n : 1) * sizeof *tmp);
    if (!tmp) {
        PyErr_NoMemory();
        return 1;
    }
    int rc;
    if (export) {
        rc = ast_coherence_versions_export(reg, step, tmp, n);
        if (rc == 0)
            memcpy(buf, tmp, n * sizeof *tmp);
    } else {
        memcpy(tmp, buf, n * sizeof *tmp);
        rc = ast_coherence_versions_import(reg, step, tmp, n);
    }
    PyMem_Free(tmp);
    return rc;
}

/* The exchange of step over view, export's (this rank's vector written into it) or import's
 * (the all-reduced one read from it): its length checked, then the call, through an aligned
 * copy for an import or an unaligned buffer (bytearray storage is malloc'd; a foreign buffer
 * may not be aligned). 0, or -1 with the exception raised. */
static int xchg_view(mod_state *st, ast_coherence *reg, long long step, Py_buffer *view,
                     int export, const char *what)
{
    size_t n;
    if (xchg_len(reg, view->len, what, &n) < 0)
        return -1;
    int rc;
    if (!export || ((uintptr_t)view->buf % sizeof(int64_t)) != 0)
        rc = xchg_copy(reg, step, view->buf, n, export);
    else
        rc = ast_coherence_versions_export(reg, step, view->buf, n);
    if (rc < 0)
        coh_raise(st, reg, rc);
    return rc ? -1 : 0;
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
    int rc = xchg_view(st, reg, step, &view, 1, "versions_export");
    PyBuffer_Release(&view);
    if (rc < 0) {
        Py_DECREF(out);
        return NULL;
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
    int rc = -1;
    if (!PyBuffer_IsContiguous(&view, 'C'))
        PyErr_SetString(PyExc_ValueError, "versions_import: vec must be C-contiguous");
    else
        rc = xchg_view(st, reg, step, &view, 0, "versions_import");
    PyBuffer_Release(&view);
    if (rc < 0)
        return NULL;
    Py_RETURN_NONE;
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

static PyObject *coherence_last_error(CoherenceObject *self, PyObject *unused)
{
    mod_state *st = type_state(Py_TYPE(self));
    ast_coherence *reg = coh_open(self, st);
    return reg ? handle_message(&coherence_kind, reg) : NULL;
}

static PyObject *coherence_get_closed(CoherenceObject *self, void *closure)
{
    return PyBool_FromLong(self->reg == NULL);
}

static PyMethodDef coherence_methods[] = {
    COH_PLAIN_CALLS(COH_METHOD_DEF)
    {"register_block", (PyCFunction)(void (*)(void))coherence_register_block,
     METH_VARARGS | METH_KEYWORDS, coherence_register_block_doc},
    {"extend", (PyCFunction)(void (*)(void))coherence_extend, METH_VARARGS | METH_KEYWORDS,
     coherence_extend_doc},
    {"replicas", (PyCFunction)coherence_replicas, METH_O,
     PyDoc_STR("replicas(block)\n--\n\nThe ranks holding a replica, ascending.")},
    {"representatives", (PyCFunction)coherence_representatives, METH_O,
     PyDoc_STR("representatives(block)\n--\n\nOne rank per node holding a replica (its lowest "
               "replica rank), ascending.")},
    {"versions_export", (PyCFunction)(void (*)(void))coherence_versions_export,
     METH_VARARGS | METH_KEYWORDS, coherence_versions_export_doc},
    {"versions_import", (PyCFunction)(void (*)(void))coherence_versions_import,
     METH_VARARGS | METH_KEYWORDS, coherence_versions_import_doc},
    {"due", (PyCFunction)coherence_due, METH_O, coherence_due_doc},
    {"count_bytes", (PyCFunction)coherence_count_bytes, METH_VARARGS, coherence_count_bytes_doc},
    {"last_error", (PyCFunction)coherence_last_error, METH_NOARGS,
     PyDoc_STR("last_error()\n--\n\nThe registry's last error message ('' if none).")},
    {"close", (PyCFunction)coherence_close, METH_NOARGS,
     PyDoc_STR("close()\n--\n\nFree the registry. Idempotent; also done on deallocation.")},
    {"__enter__", ctx_enter, METH_NOARGS, NULL},
    {"__exit__", ctx_exit, METH_VARARGS, NULL},
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
    {Py_tp_traverse, type_traverse},
    {Py_tp_methods, coherence_methods},
    {Py_tp_getset, coherence_getset},
    {Py_tp_doc, (void *)coherence_doc},
    {0, NULL},
};

PyType_Spec coherence_spec = {
    .name = "asteria._C.Coherence",
    .basicsize = sizeof(CoherenceObject),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_IMMUTABLETYPE,
    .slots = coherence_slots,
};
