/*
 * store.c - asteria._C.Store (store.h: host, pinned, UVM and NVMe blocks) and the
 * BlockBuffer exports of its blocks.
 * May call: the public libasteria API and the Python C API, common.h (handle.c's calls for
 * every call on the store: each takes the store's mutex, which a move holds across its I/O, so
 * each runs with the GIL released), and util.h (the pins' hash table; python/CMakeLists.txt
 * compiles util.c into the module when libasteria is a shared library, which does not export
 * its internals).
 */
#include "common.h"
#include "util.h"

#include "asteria/quant.h"

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
 *
 * Views over blocks. Store.view(id, dtype, shape) returns a DLPack capsule (dlpack.c) whose
 * owner is a BlockBuffer made for it (never seen by Python), so a tensor from torch.from_dlpack
 * pins its block exactly as a buffer does, for as long as the tensor's storage lives: the
 * block can be neither moved nor freed, nor the store closed, under a live view (BusyError).
 * Unlike buffer(), view() also takes uvm and device blocks (CUDA tensors).
 */

typedef struct {
    ast__hnode node;  /* in StoreObject.pins, key = block id */
    uint32_t exports; /* live BlockBuffer objects over the block */
    uint32_t busy;    /* a move or free of the block runs with the GIL released */
} pin;

typedef struct {
    PyObject_HEAD
    ast_store *s;
    guard g;
    ast__htable pins; /* block id -> pin, for blocks exported or busy only */
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

static pin *pin_find(const ast__htable *t, uint64_t id)
{
    ast__hnode *x = ast__htable_find(t, id);
    return x ? AST__CONTAINER_OF(x, pin, node) : NULL;
}

/* The pin of id, inserted (zeroed) if absent; NULL with MemoryError set. A pin stays where it
 * is until pin_put drops it, so a pointer to it survives the table's growth. */
static pin *pin_get(ast__htable *t, uint64_t id)
{
    pin *p = pin_find(t, id);
    if (p)
        return p;
    if (ast__htable_reserve(t, t->n + 1) != 0 || !(p = PyMem_Calloc(1, sizeof *p))) {
        PyErr_NoMemory();
        return NULL;
    }
    p->node.key = id;
    ast__htable_insert(t, &p->node);
    return p;
}

/* Drops p if it pins nothing any more. */
static void pin_put(ast__htable *t, pin *p)
{
    if (p->exports || p->busy)
        return;
    ast__htable_remove(t, &p->node);
    PyMem_Free(p);
}

static int store_error(void *s, char *buf, size_t len) { return ast_store_last_error(s, buf, len); }

/* A store's failures: BusyError for AST_EBUSY, the message as the store left it. */
static const handle_kind store_kind = {"store", store_error, raise_busy_aware};

static int st_enter(StoreObject *self, mod_state *st)
{
    return handle_enter(&store_kind, &self->g, self->s, st);
}

static int parse_tier(PyObject *o, ast_tier *out)
{
    const char *name = PyUnicode_Check(o) ? utf8_no_nul(o, "tier") : NULL;
    if (name && ast_tier_parse(name, out) == 0)
        return 0;
    if (PyErr_Occurred() && !PyErr_ExceptionMatches(PyExc_ValueError))
        return -1;
    PyErr_Clear();
    /* the names from libasteria's table, in ast_tier's order */
    char allowed[128] = "";
    size_t used = 0;
    for (int t = 0; t < AST_TIER_COUNT && used < sizeof allowed; t++) {
        int w = snprintf(allowed + used, sizeof allowed - used, "%s'%s'", t ? ", " : "",
                         ast_tier_name((ast_tier)t));
        used = w < 0 ? sizeof allowed : used + (size_t)w;
    }
    PyErr_Format(PyExc_ValueError, "unknown tier %R; allowed: %s", o, allowed);
    return -1;
}

/* One block as a call on the store takes or gives it (alloc: tier and nbytes in, id out;
 * describe: id in, the rest out). */
typedef struct {
    uint64_t id;
    ast_tier tier;
    size_t nbytes;
    void *ptr;
} block_call;

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
                     "%s: block %" PRIu64 " has %u exported buffer(s) (Store.buffer, "
                     "Store.view); delete them and every tensor or memoryview made from them "
                     "first",
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
        dir = malloc(AST_PATH_MAX);
        if (!dir)
            return PyErr_NoMemory();
        if (copy_path(dir_o, dir, AST_PATH_MAX, "nvme_dir") < 0) {
            free(dir);
            return NULL;
        }
        o.nvme_dir = dir;
    }
    StoreObject *self = (StoreObject *)type_alloc(type);
    if (!self) {
        free(dir);
        return NULL;
    }
    guard_init(&self->g);
    ast_store *s = NULL;
    char err[ERRBUF_LEN] = "";
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = ast_store_open(&o, &s, err, sizeof err);
    Py_END_ALLOW_THREADS
    free(dir);
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
        snprintf(msg, sizeof msg, "close: %" PRIu64 " buffer(s) or view(s) over store blocks "
                 "are alive (Store.buffer, Store.view); delete them and every tensor made "
                 "from them first",
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

static void store_dealloc(StoreObject *self)
{
    PyObject_GC_UnTrack(self);
    /* Buffers hold a reference to their store: none can be alive here. */
    close_in_dealloc(store_close_obj, (PyObject *)self);
    guard_fini(&self->g);
    for (ast__hnode *x = ast__htable_first(&self->pins), *next; x; x = next) {
        next = ast__htable_after(&self->pins, x);
        PyMem_Free(AST__CONTAINER_OF(x, pin, node));
    }
    ast__htable_free(&self->pins);
    heap_free(self);
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

PyDoc_STRVAR(store_alloc_doc,
             "alloc(tier, nbytes)\n--\n\nA new zero-filled block of nbytes on tier ('host', "
             "'host_pinned', 'device', 'uvm', 'nvme'); returns its id (never 0). The CUDA tiers "
             "raise AsteriaError (AST_ENODEV) without a device; 'nvme' needs nvme_dir.");

static int do_alloc(void *s, void *arg)
{
    block_call *c = arg;
    return ast_store_alloc(s, c->tier, c->nbytes, &c->id);
}

static PyObject *store_alloc(StoreObject *self, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"tier", "nbytes", NULL};
    PyObject *tier_o;
    block_call c = {0, AST_TIER_HOST, 0, NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OO&:alloc", kwlist, &tier_o, conv_size,
                                     &c.nbytes) ||
        parse_tier(tier_o, &c.tier) < 0 ||
        handle_call(&store_kind, &self->g, self->s, type_state(Py_TYPE(self)), do_alloc, &c) < 0)
        return NULL;
    return PyLong_FromUnsignedLongLong(c.id);
}

PyDoc_STRVAR(store_free_doc,
             "free(id)\n--\n\nFree a block (its record file too). BusyError while buffers over it "
             "are alive.");

static int do_free(void *s, void *arg) { return ast_store_free(s, *(const uint64_t *)arg); }

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
    char err[ERRBUF_LEN] = "";
    int rc = handle_run(&store_kind, self->s, do_free, &id, err);
    guard_leave(&self->g);
    pins_unmark(self, &id, 1);
    if (rc < 0)
        return raise_busy_aware(st, rc, err);
    Py_RETURN_NONE;
}

/* A block's tier, size and address, read in one call (GIL released). */
static int do_describe(void *s, void *arg)
{
    block_call *c = arg;
    int rc = ast_store_tier(s, c->id, &c->tier);
    if (!rc)
        rc = ast_store_size(s, c->id, &c->nbytes);
    if (!rc)
        c->ptr = ast_store_data(s, c->id);
    return rc;
}

/* The block whose id is arg, described (the argument of data_ptr, size and tier). Returns 0,
 * or -1 with a Python exception set. */
static int describe_arg(StoreObject *self, PyObject *arg, block_call *c)
{
    mod_state *st = type_state(Py_TYPE(self));
    if (!conv_u64(arg, &c->id))
        return -1;
    return handle_call(&store_kind, &self->g, self->s, st, do_describe, c);
}

PyDoc_STRVAR(store_data_ptr_doc,
             "data_ptr(id)\n--\n\nThe block's address as an int (host or device memory by tier), "
             "or None while it is on NVMe. Valid until the block is moved or freed; nothing "
             "guards its use (Store.buffer does).");

static PyObject *store_data_ptr(StoreObject *self, PyObject *arg)
{
    block_call c = {0, AST_TIER_HOST, 0, NULL};
    if (describe_arg(self, arg, &c) < 0)
        return NULL;
    if (!c.ptr)
        Py_RETURN_NONE;
    return PyLong_FromVoidPtr(c.ptr);
}

PyDoc_STRVAR(store_size_doc, "size(id)\n--\n\nThe block's size in bytes.");

static PyObject *store_size(StoreObject *self, PyObject *arg)
{
    block_call c = {0, AST_TIER_HOST, 0, NULL};
    return describe_arg(self, arg, &c) < 0 ? NULL : PyLong_FromSize_t(c.nbytes);
}

PyDoc_STRVAR(store_tier_doc, "tier(id)\n--\n\nThe block's tier name.");

static PyObject *store_tier(StoreObject *self, PyObject *arg)
{
    block_call c = {0, AST_TIER_HOST, 0, NULL};
    return describe_arg(self, arg, &c) < 0 ? NULL : tier_str(c.tier);
}

PyDoc_STRVAR(store_move_doc,
             "move(ids, tier)\n--\n\nMove the listed blocks to tier, NVMe I/O batched in one "
             "submission round, GIL released; returns how many moved (blocks already there "
             "count). Each block moves or stays intact. On failure raises the mapped exception "
             "(AsteriaError AST_ECORRUPT for a damaged record, naming block and file) whose "
             "message carries the store's error, with .moved the number of blocks that did move. "
             "BusyError, before anything moves, if a listed block has live buffers.");

typedef struct {
    const uint64_t *ids;
    ast_tier dst;
    size_t n, moved;
} move_call;

static int do_move(void *s, void *arg)
{
    move_call *c = arg;
    return ast_store_move(s, c->ids, c->n, c->dst, &c->moved);
}

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
    size_t n = (size_t)fast_len(seq);
    uint64_t *ids = malloc((n ? n : 1) * sizeof *ids);
    if (!ids) {
        Py_DECREF(seq);
        return PyErr_NoMemory();
    }
    for (size_t i = 0; i < n; i++)
        if (!conv_u64(fast_item(seq, (Py_ssize_t)i), &ids[i])) {
            Py_DECREF(seq);
            free(ids);
            return NULL;
        }
    Py_DECREF(seq);
    if (st_enter(self, st) < 0) {
        free(ids);
        return NULL;
    }
    if (pins_mark(self, st, ids, n, "move") < 0) {
        guard_leave(&self->g);
        free(ids);
        return NULL;
    }
    move_call c = {ids, dst, n, 0};
    char err[ERRBUF_LEN] = "";
    int rc = handle_run(&store_kind, self->s, do_move, &c, err);
    guard_leave(&self->g);
    pins_unmark(self, ids, n);
    free(ids);
    size_t moved = c.moved;
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

static int do_stats(void *s, void *arg) { return ast_store_stats_get(s, arg); }

static PyObject *store_stats(StoreObject *self, PyObject *unused)
{
    mod_state *st = type_state(Py_TYPE(self));
    ast_store_stats ss;
    int rc;
    if (handle_try(&store_kind, &self->g, self->s, st, do_stats, &ss, &rc, NULL) < 0)
        return NULL;
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

PyDoc_STRVAR(store_set_format_doc,
             "set_format(id, qtype, block=0)\n--\n\nWhat the block's bytes hold: qtype 'none' "
             "(raw bytes, block 0: every new block's format) or 'int8' / 'int4' with the quantized "
             "form's values per scale (asteria/quant.h). Its NVMe records carry it and a read "
             "back refuses a record of another format (AsteriaError AST_EFOREIGN). ValueError for "
             "an unknown qtype; AsteriaError AST_EINVAL for a bad block size, AST_ESTATE for "
             "another format while the block is on NVMe.");

typedef struct {
    uint64_t id;
    ast_qtype qtype;
    uint32_t qblock;
} format_call;

static int do_set_format(void *s, void *arg)
{
    format_call *c = arg;
    return ast_store_set_format(s, c->id, c->qtype, c->qblock);
}

static int do_format(void *s, void *arg)
{
    format_call *c = arg;
    return ast_store_format(s, c->id, &c->qtype, &c->qblock);
}

static PyObject *store_set_format(StoreObject *self, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"id", "qtype", "block", NULL};
    PyObject *id_o, *qtype_o;
    unsigned long block = 0;
    format_call c = {0, AST_QTYPE_NONE, 0};
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OO|k:set_format", kwlist, &id_o, &qtype_o,
                                     &block) ||
        !conv_u64(id_o, &c.id))
        return NULL;
    const char *name = PyUnicode_Check(qtype_o) ? utf8_no_nul(qtype_o, "qtype") : NULL;
    if (!name) {
        if (!PyErr_Occurred())
            raise_wrong_type("qtype must be a str ('none', 'int8' or 'int4')", qtype_o);
        return NULL;
    }
    if (ast_qtype_parse(name, &c.qtype) != 0) {
        PyErr_Format(PyExc_ValueError, "unknown qtype %R; allowed: 'none', 'int8', 'int4'",
                     qtype_o);
        return NULL;
    }
    if (block > UINT32_MAX) {
        PyErr_Format(PyExc_ValueError, "block %lu; allowed: 0 (qtype 'none') or an even size "
                     "2..%d", block, AST_QUANT_BLOCK_MAX);
        return NULL;
    }
    c.qblock = (uint32_t)block;
    if (handle_call(&store_kind, &self->g, self->s, type_state(Py_TYPE(self)), do_set_format,
                    &c) < 0)
        return NULL;
    Py_RETURN_NONE;
}

PyDoc_STRVAR(store_format_doc,
             "format(id)\n--\n\nThe block's format: (qtype, block), ('none', 0) for raw bytes.");

static PyObject *store_format(StoreObject *self, PyObject *arg)
{
    format_call c = {0, AST_QTYPE_NONE, 0};
    if (!conv_u64(arg, &c.id) ||
        handle_call(&store_kind, &self->g, self->s, type_state(Py_TYPE(self)), do_format, &c) < 0)
        return NULL;
    return Py_BuildValue("(sk)", ast_qtype_name(c.qtype), (unsigned long)c.qblock);
}

PyDoc_STRVAR(store_record_path_doc,
             "record_path(id)\n--\n\nPath of the record file of a block on NVMe (AsteriaError "
             "AST_ESTATE on another tier).");

typedef struct {
    uint64_t id;
    char path[AST_PATH_MAX + 64];
} record_path_call;

static int do_record_path(void *s, void *arg)
{
    record_path_call *c = arg;
    return ast_store_record_path(s, c->id, c->path, sizeof c->path);
}

static PyObject *store_record_path(StoreObject *self, PyObject *arg)
{
    mod_state *st = type_state(Py_TYPE(self));
    record_path_call c;
    if (!conv_u64(arg, &c.id) ||
        handle_call(&store_kind, &self->g, self->s, st, do_record_path, &c) < 0)
        return NULL;
    return PyUnicode_DecodeFSDefault(c.path);
}

PyDoc_STRVAR(store_last_error_doc,
             "last_error()\n--\n\nThe store's last error message ('' if none).");

static PyObject *store_last_error(StoreObject *self, PyObject *unused)
{
    return handle_message_released(&store_kind, &self->g, self->s, type_state(Py_TYPE(self)));
}

/* A new BlockBuffer over block id, pinning it: the export behind buffer() and view(). Refuses
 * NVMe blocks, and device blocks unless host_only is 0. */
static BlockBufferObject *store_export(StoreObject *self, mod_state *st, uint64_t id,
                                       int host_only, const char *what)
{
    if (st_enter(self, st) < 0)
        return NULL;
    /* Pin first (GIL held): a concurrent move or free of the block is refused from here on.
     * Several buffers may share a block; one being moved or freed cannot be exported. */
    pin *p = pin_find(&self->pins, id);
    if (p && p->busy) {
        char msg[160];
        snprintf(msg, sizeof msg, "%s: block %" PRIu64 " is being moved or freed by another "
                 "thread", what, id);
        guard_leave(&self->g);
        raise_busy_aware(st, AST_EBUSY, msg);
        return NULL;
    }
    if (!(p = pin_get(&self->pins, id))) {
        guard_leave(&self->g);
        return NULL;
    }
    p->exports++;
    self->exports++;
    block_call c = {id, AST_TIER_HOST, 0, NULL};
    char err[ERRBUF_LEN] = "";
    int rc = handle_run(&store_kind, self->s, do_describe, &c, err);
    guard_leave(&self->g);
    ast_tier tier = c.tier;
    if (rc == 0 && ((host_only && tier == AST_TIER_DEVICE) || tier == AST_TIER_NVME || !c.ptr)) {
        snprintf(err, sizeof err, "%s: block %" PRIu64 " is on tier %s; %s", what, id,
                 ast_tier_name(tier), host_only ? "buffers need a host-addressable tier (host, "
                 "host_pinned, uvm)" : "views need a block in memory (not on NVMe)");
        rc = AST_ESTATE;
    }
    BlockBufferObject *b = NULL;
    if (rc == 0)
        b = PyObject_New(BlockBufferObject, st->blockbuf_type);
    if (!b) {
        p->exports--;
        self->exports--;
        pin_put(&self->pins, p);
        if (rc < 0)
            raise_busy_aware(st, rc, err);
        return NULL;
    }
    b->store = (StoreObject *)Py_NewRef((PyObject *)self);
    b->id = id;
    b->ptr = c.ptr;
    b->nbytes = c.nbytes;
    b->tier = tier;
    return b;
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
    if (!conv_u64(arg, &id))
        return NULL;
    return (PyObject *)store_export(self, st, id, 1, "buffer");
}

PyDoc_STRVAR(store_view_doc,
             "view(id, dtype, shape, device=-1)\n--\n\nA DLPack capsule (\"dltensor\") over a "
             "block, for torch.from_dlpack: a compact tensor of shape and dtype (float32,\n"
             "float64, float16, bfloat16, int32, int64; a name or a torch.dtype) whose bytes "
             "must be exactly the block's (ValueError otherwise). Host and\nhost_pinned blocks "
             "give CPU tensors; a device block a CUDA tensor on device (its CUDA index, "
             "required); a uvm block a CUDA tensor\non device, or a CPU tensor without one.\nLifetime: the view holds a BlockBuffer, so while any "
             "tensor over it lives the block is pinned as by buffer(): move(), free()\nand "
             "close() raise BusyError, and the Store outlives the view. AsteriaError "
             "(AST_ESTATE) for a block on NVMe.");

static PyObject *store_view(StoreObject *self, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"id", "dtype", "shape", "device", NULL};
    mod_state *st = type_state(Py_TYPE(self));
    uint64_t id;
    PyObject *dtype, *shape;
    int device = -1;
    view_spec v;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O&OO|i:view", kwlist, conv_u64, &id, &dtype,
                                     &shape, &device) ||
        view_spec_parse(dtype, shape, &v) < 0)
        return NULL;
    BlockBufferObject *b = store_export(self, st, id, 0, "view");
    if (!b)
        return NULL;
    /* managed memory is host-addressable: a CPU view without device, a CUDA one with it */
    int cuda = b->tier == AST_TIER_DEVICE || (b->tier == AST_TIER_UVM && device >= 0);
    if ((b->tier == AST_TIER_DEVICE) != (device >= 0) && b->tier != AST_TIER_UVM) {
        PyErr_Format(PyExc_ValueError, "view: block %llu is on tier %s: %s",
                     (unsigned long long)id, ast_tier_name(b->tier),
                     device < 0 ? "give device=<CUDA device index>"
                                : "its views are CPU tensors (no device)");
        Py_DECREF(b);
        return NULL;
    }
    char what[96];
    snprintf(what, sizeof what, "block %" PRIu64 " (tier %s)", id, ast_tier_name(b->tier));
    return view_export(&v, (PyObject *)b, NULL, b->ptr, b->nbytes, cuda ? device : -1, what);
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
    {"set_format", (PyCFunction)(void (*)(void))store_set_format, METH_VARARGS | METH_KEYWORDS,
     store_set_format_doc},
    {"format", (PyCFunction)store_format, METH_O, store_format_doc},
    {"last_error", (PyCFunction)store_last_error, METH_NOARGS, store_last_error_doc},
    {"buffer", (PyCFunction)store_buffer, METH_O, store_buffer_doc},
    {"view", (PyCFunction)(void (*)(void))store_view, METH_VARARGS | METH_KEYWORDS,
     store_view_doc},
    {"exports", (PyCFunction)store_exports, METH_VARARGS, store_exports_doc},
    {"close", (PyCFunction)store_close, METH_NOARGS, store_close_doc},
    {"__enter__", ctx_enter, METH_NOARGS, NULL},
    {"__exit__", ctx_exit, METH_VARARGS, NULL},
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
    {Py_tp_traverse, type_traverse},
    {Py_tp_methods, store_methods},
    {Py_tp_getset, store_getset},
    {Py_tp_doc, (void *)store_doc},
    {0, NULL},
};

PyType_Spec store_spec = {
    .name = "asteria._C.Store",
    .basicsize = sizeof(StoreObject),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_IMMUTABLETYPE,
    .slots = store_slots,
};

/* ---- BlockBuffer ------------------------------------------------------------------------------ */

static void blockbuf_dealloc(BlockBufferObject *self)
{
    StoreObject *s = self->store;
    pin *p = pin_find(&s->pins, self->id);
    if (p) {
        p->exports--;
        pin_put(&s->pins, p);
    }
    s->exports--;
    Py_DECREF(s);
    heap_free(self);
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
    return PyUnicode_FromFormat("<%s block=%llu tier=%s nbytes=%zu>", blockbuf_spec.name,
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

PyType_Spec blockbuf_spec = {
    .name = "asteria._C.BlockBuffer",
    .basicsize = sizeof(BlockBufferObject),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_IMMUTABLETYPE | Py_TPFLAGS_DISALLOW_INSTANTIATION,
    .slots = blockbuf_slots,
};
