/*
 * common.h - what the files of asteria._C share: the module state, the guard that keeps a handle
 * alive across calls that released the GIL, the error mapping and the argument converters
 * (errors.c), the calls on a handle inside its guard (handle.c), the config conversion
 * (config.c) and each bound type's spec. One file per bound type: config.c, runtime.c,
 * store.c, shadow.c, coherence.c; module.c puts them together; testing.c is the separate
 * test-only module asteria._C_testing. Internal to the extension (the module's symbols are
 * hidden: python/CMakeLists.txt).
 *
 * The binding's rules (GIL, locking, fork, signals) are in module.c's header comment; each
 * file follows them.
 */
#ifndef ASTERIA_PY_COMMON_H
#define ASTERIA_PY_COMMON_H
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
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/*
 * The module builds on the limited API (Py_LIMITED_API 3.11, one abi3 wheel for every CPython
 * >= 3.11: python/CMakeLists.txt) and on the full one (3.10). 3.11 is the floor because the
 * buffer protocol (Py_buffer, Py_bf_getbuffer: BlockBuffer's export, Coherence's inputs) entered
 * the limited API then. So: PyTypeObject is opaque (slots through PyType_GetSlot, the bound
 * types' names from their specs), no PyMem_Raw* (malloc where the GIL is released), no
 * unchecked item macros.
 */
#if defined(Py_LIMITED_API) && !defined(Py_TYPE)
/* The full API's Py_TYPE casts its argument; the limited one (3.11+) takes PyObject * only, and
 * the bound types' methods pass their own object pointers. */
#define Py_TYPE(ob) Py_TYPE((PyObject *)(ob))
#endif

#define ERRBUF_LEN 1024
#define POLL_CHUNK 64
/* A blocking wait wakes this often to run Python's signal handlers (Ctrl-C). */
#define SIGNAL_SLICE_NS (100 * 1000 * 1000LL)

typedef struct {
    PyTypeObject *runtime_type;
    PyTypeObject *config_type;
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
    ast_config cfg;
} ConfigObject;

typedef struct {
    PyObject_HEAD
    ast_runtime *rt;
    guard g;
} RuntimeObject;

static inline mod_state *type_state(PyTypeObject *tp) { return PyType_GetModuleState(tp); }
static inline PyObject *type_alloc(PyTypeObject *tp)
{
    return ((allocfunc)PyType_GetSlot(tp, Py_tp_alloc))(tp, 0);
}
/* The end of a bound type's dealloc: frees self (the type's tp_free) and drops the reference
 * the instance held to its heap type. */
static inline void heap_free(void *self)
{
    PyTypeObject *tp = Py_TYPE(self);
    ((freefunc)PyType_GetSlot(tp, Py_tp_free))(self);
    Py_DECREF(tp);
}
/* Length and (borrowed) items of PySequence_Fast's result, a list or a tuple. */
static inline Py_ssize_t fast_len(PyObject *seq)
{
    return PyList_Check(seq) ? PyList_Size(seq) : PyTuple_Size(seq);
}
static inline PyObject *fast_item(PyObject *seq, Py_ssize_t i)
{
    return PyList_Check(seq) ? PyList_GetItem(seq, i) : PyTuple_GetItem(seq, i);
}

/* ---- errors.c ---- */
PyObject *raise_ast_error(mod_state *st, int code, const char *detail);
/* A libasteria message (a detail, a last-error text) as str. */
PyObject *error_text(const char *text);
const char *utf8_no_nul(PyObject *s, const char *what);
int guard_enter(guard *g, int open, mod_state *st, const char *what);
void guard_fini(guard *g);
void guard_init(guard *g);
int conv_ptr(PyObject *o, void *out);
int guard_open(guard *g, int open, mod_state *st, const char *what);
int parse_op(mod_state *st, PyObject *o, ast_op *out);
void guard_leave(guard *g);
int conv_u64(PyObject *o, void *out);
void guard_drain(guard *g);
int parse_dtype(PyObject *o, ast_dtype *out);
int conv_size(PyObject *o, void *out);
const char *detail_for(int code, const char *detail);
int conv_optptr(PyObject *o, void *out);
int as_int(PyObject *o, int *out, const char *what);
int copy_path(PyObject *o, char *buf, size_t len, const char *what);
PyObject *raise_busy_aware(mod_state *st, int code, const char *detail);
PyObject *new_ast_error(mod_state *st, PyObject *type, int code, const char *detail);
PyObject *raise_exc(PyObject *exc);
/* TypeError "<expected>, not <type name of o>"; NULL. */
PyObject *raise_wrong_type(const char *expected, PyObject *o);
int dict_set_steal(PyObject *d, const char *key, PyObject *v);
void close_in_dealloc(int (*close)(PyObject *), PyObject *self);
/* The tp_traverse of a bound type: an instance holds no Python object but its heap type. */
int type_traverse(PyObject *self, visitproc visit, void *arg);
/* __enter__ of a bound type (its __exit__ closes it): self. */
PyObject *ctx_enter(PyObject *self, PyObject *unused);
/* __exit__ of a bound type: its close() (the types are final: always the type's own), then
 * False; close's exception propagates. */
PyObject *ctx_exit(PyObject *self, PyObject *args);
/* ---- handle.c: the calls made on a handle ---- */
/* What the calls on a handle need of its type. */
typedef struct {
    const char *what; /* names the handle in AST_ESHUTDOWN's message: "runtime", "store", ... */
    /* The handle's ast_*_last_error (with or without the GIL: the callers say). */
    int (*last_error)(void *h, char *buf, size_t len);
    /* Raises the failure rc of a call on the handle, err the message read after it; NULL. */
    PyObject *(*raise)(mod_state *st, int rc, const char *err);
} handle_kind;

/* guard_enter / guard_open of handle h (open while h is not NULL). */
int handle_enter(const handle_kind *k, guard *g, const void *h, mod_state *st);
int handle_open(const handle_kind *k, guard *g, const void *h, mod_state *st);
/* fn(h, arg) with the GIL released, on a handle entered with handle_enter; on failure, if err
 * is not NULL, the handle's message is read into err (ERRBUF_LEN bytes) before the GIL is taken
 * back (another thread's call may set a newer one). Returns fn's rc. */
int handle_run(const handle_kind *k, void *h, int (*fn)(void *h, void *arg), void *arg, char *err);
/* handle_enter, handle_run, guard_leave: 0 with *rc fn's result (err as handle_run), or -1
 * with AST_ESHUTDOWN raised (closed). */
int handle_try(const handle_kind *k, guard *g, void *h, mod_state *st,
               int (*fn)(void *h, void *arg), void *arg, int *rc, char *err);
/* A call that may block or compute: handle_try, a failure raised by k->raise with its message.
 * 0, or -1 with the exception raised. */
int handle_call(const handle_kind *k, guard *g, void *h, mod_state *st,
                int (*fn)(void *h, void *arg), void *arg);
/* With the GIL held, right after a call on h failed with rc: raises it with the handle's
 * message. NULL. */
PyObject *handle_raise(const handle_kind *k, void *h, mod_state *st, int rc);
/* last_error() of a handle as str: read with the GIL held (the caller checked h open), or
 * inside its guard with the GIL released (a store's or a shadow's mutex may be held across
 * I/O). */
PyObject *handle_message(const handle_kind *k, void *h);
PyObject *handle_message_released(const handle_kind *k, guard *g, void *h, mod_state *st);
/* ---- dlpack.c: tensor views as DLPack capsules ---- */
#define VIEW_MAX_DIMS 8
typedef struct {
    uint8_t code, bits; /* DLDataType's */
    int ndim;
    int64_t shape[VIEW_MAX_DIMS];
    uint64_t nbytes;
} view_spec;
/* dtype: a name ("float32", "bfloat16", ...) or a torch.dtype; shape: a sequence of ints. */
int view_spec_parse(PyObject *dtype, PyObject *shape, view_spec *v);
/* A "dltensor" capsule over ptr (avail bytes, which the spec must match exactly; cuda_device
 * -1: host memory). Steals owner, which the view keeps until its deleter runs release(owner)
 * (if not NULL) and drops it; on failure both happen at once. */
PyObject *view_export(const view_spec *v, PyObject *owner, void (*release)(PyObject *),
                      void *ptr, size_t avail, int cuda_device, const char *what);
/* ---- config.c ---- */
/* Applies config (a mapping of key -> value, or None: the defaults) to cfg through
 * ast_config_set, C's one validator of each key; None values keep the default. 0, or -1 with
 * ValueError (naming the key and the allowed values) or TypeError raised. */
int config_apply(mod_state *st, ast_config *cfg, PyObject *config);
/* A new Config (validated) from a mapping, as config_apply takes it; NULL with an exception. */
PyObject *config_validate(mod_state *st, PyObject *config);
/* The dict form of a config; validate_config() of it gives the same config. */
PyObject *config_to_dict(const ast_config *c);
/* ---- result.c ---- */
/* A new Result (st->result_type) holding r; NULL with an exception set. */
PyObject *make_result(mod_state *st, const ast_result *r);
/* ---- quant.c: the quantized-basis kernels (module functions) ---- */
/* Adds quant_layout, quant_quantize, quant_dequantize, quant_rectify and the QUANT_* constants
 * to the module. 0, or -1 with an exception. */
int quant_module_add(PyObject *m);
/* ---- module.c ---- */
/* asteria._C's definition: how testing.c recognises this module's objects. */
extern struct PyModuleDef asteria_module_def;

/* ---- the bound types ---- */
extern PyType_Spec runtime_spec;
extern PyType_Spec config_spec;
extern PyStructSequence_Desc result_desc;
extern PyType_Spec store_spec;
extern PyType_Spec blockbuf_spec;
extern PyType_Spec shadow_spec;
extern PyType_Spec coherence_spec;

#endif
