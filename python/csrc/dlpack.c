/*
 * dlpack.c - tensor views of memory the extension owns (store blocks, shadow ring slots and
 * snapshot copies), handed out as DLPack capsules for torch.from_dlpack.
 *
 * Owns: the view spec (dtype and shape, checked against the memory's size) and the capsule: a
 * legacy DLManagedTensor under the name "dltensor" (DLPack 0.6 and 1.x alike), whose deleter
 * runs the owner's release hook and drops the reference the view holds on its owner. What the
 * owner does while views live (a pinned block, a deferred close) is the owner's rule:
 * store.c and shadow.c say which.
 * May call: the Python C API and common.h.
 *
 * The deleter may run on any thread (torch frees a tensor wherever its last reference goes), so
 * it takes the GIL itself; at interpreter shutdown it leaves the owner alone (a leak, not a
 * crash). Device types: kDLCPU for host and pinned memory, kDLCUDA with the device index for
 * device and managed memory (torch 2.11's from_dlpack refuses kDLCUDAHost and kDLCUDAManaged).
 */
#include "common.h"

#include <dlpack/dlpack.h>

typedef struct {
    DLManagedTensor mt; /* first: the capsule's pointer is the context's */
    PyObject *owner;    /* strong reference */
    void (*release)(PyObject *owner);
    int64_t shape[VIEW_MAX_DIMS];
} view_ctx;

static const struct {
    const char *name;
    uint8_t code, bits;
} view_dtypes[] = {
    {"float32", kDLFloat, 32},  {"float64", kDLFloat, 64}, {"float16", kDLFloat, 16},
    {"bfloat16", kDLBfloat, 16}, {"int32", kDLInt, 32},     {"int64", kDLInt, 64},
};

static int spec_dtype(PyObject *dtype, view_spec *v)
{
    /* str() takes a torch.dtype ("torch.float32") without importing torch */
    PyObject *s = PyObject_Str(dtype);
    if (!s)
        return -1;
    const char *name = PyUnicode_AsUTF8AndSize(s, NULL);
    if (!name) {
        Py_DECREF(s);
        return -1;
    }
    const char *bare = strncmp(name, "torch.", 6) == 0 ? name + 6 : name;
    for (size_t i = 0; i < sizeof view_dtypes / sizeof view_dtypes[0]; i++)
        if (strcmp(bare, view_dtypes[i].name) == 0) {
            v->code = view_dtypes[i].code;
            v->bits = view_dtypes[i].bits;
            Py_DECREF(s);
            return 0;
        }
    PyErr_Format(PyExc_ValueError, "view: unsupported dtype %R; allowed: float32, float64, "
                 "float16, bfloat16, int32, int64 (names or torch dtypes)", dtype);
    Py_DECREF(s);
    return -1;
}

int view_spec_parse(PyObject *dtype, PyObject *shape, view_spec *v)
{
    if (spec_dtype(dtype, v) < 0)
        return -1;
    PyObject *seq = PySequence_Fast(shape, "view: shape must be a sequence of ints");
    if (!seq)
        return -1;
    Py_ssize_t n = fast_len(seq);
    if (n > VIEW_MAX_DIMS) {
        PyErr_Format(PyExc_ValueError, "view: shape %R has %zd dimensions; at most %d", shape, n,
                     VIEW_MAX_DIMS);
        Py_DECREF(seq);
        return -1;
    }
    uint64_t numel = 1;
    for (Py_ssize_t i = 0; i < n; i++) {
        long long d = PyLong_AsLongLong(fast_item(seq, i));
        if (d == -1 && PyErr_Occurred()) {
            Py_DECREF(seq);
            return -1;
        }
        if (d < 0 || (d && numel > UINT64_MAX / 8 / (uint64_t)d)) {
            PyErr_Format(PyExc_ValueError, "view: bad shape %R (negative or too large)", shape);
            Py_DECREF(seq);
            return -1;
        }
        v->shape[i] = d;
        numel *= (uint64_t)d;
    }
    Py_DECREF(seq);
    v->ndim = (int)n;
    v->nbytes = numel * (v->bits / 8);
    return 0;
}

static void view_deleter(DLManagedTensor *mt)
{
    view_ctx *c = mt->manager_ctx;
    if (!Py_IsInitialized())
        return; /* shutdown: the owner is gone or going; leak the context */
    PyGILState_STATE g = PyGILState_Ensure();
    if (c->release)
        c->release(c->owner);
    Py_DECREF(c->owner);
    PyGILState_Release(g);
    free(c);
}

/* A capsule torch never consumed (it renames the ones it takes to "used_dltensor"). */
static void capsule_destructor(PyObject *cap)
{
    if (!PyCapsule_IsValid(cap, "dltensor"))
        return;
    DLManagedTensor *mt = PyCapsule_GetPointer(cap, "dltensor");
    mt->deleter(mt);
}

PyObject *view_export(const view_spec *v, PyObject *owner, void (*release)(PyObject *),
                      void *ptr, size_t avail, int cuda_device, const char *what)
{
    if (v->nbytes != avail) {
        PyErr_Format(PyExc_ValueError, "view: %s is %zu bytes; the view's shape and dtype "
                     "(%d-bit elements) make %llu bytes: they must be equal", what, avail,
                     (int)v->bits, (unsigned long long)v->nbytes);
        goto fail;
    }
    view_ctx *c = calloc(1, sizeof *c);
    if (!c) {
        PyErr_NoMemory();
        goto fail;
    }
    memcpy(c->shape, v->shape, sizeof c->shape);
    c->owner = owner;
    c->release = release;
    DLTensor *t = &c->mt.dl_tensor;
    t->data = ptr;
    t->device.device_type = cuda_device < 0 ? kDLCPU : kDLCUDA;
    t->device.device_id = cuda_device < 0 ? 0 : cuda_device;
    t->ndim = v->ndim;
    t->dtype.code = v->code;
    t->dtype.bits = v->bits;
    t->dtype.lanes = 1;
    t->shape = c->shape;
    t->strides = NULL; /* compact, row-major */
    t->byte_offset = 0;
    c->mt.manager_ctx = c;
    c->mt.deleter = view_deleter;
    PyObject *cap = PyCapsule_New(&c->mt, "dltensor", capsule_destructor);
    if (!cap) {
        free(c);
        goto fail;
    }
    return cap;
fail:
    if (release)
        release(owner);
    Py_DECREF(owner);
    return NULL;
}
