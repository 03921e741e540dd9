/*
 * config.c - asteria._C.Config (a validated ast_config, handed to Runtime() as it is) and the
 * conversion between a dict of config keys and an ast_config, both ways.
 * May call: the public libasteria API (runtime.h's ast_config_*), the Python C API, and
 * common.h.
 */
#include "common.h"

/* ---- config -------------------------------------------------------------------------------------- */

/* The string form ast_config_set takes: bools "true"/"false" (so a bool is refused where C wants
 * a number), anything else str(). */
static PyObject *config_value_str(PyObject *v)
{
    if (PyBool_Check(v))
        return PyUnicode_FromString(v == Py_True ? "true" : "false");
    return PyObject_Str(v);
}

int config_apply(mod_state *st, ast_config *cfg, PyObject *config)
{
    if (config == Py_None)
        return 0;
    if (!PyDict_Check(config) && !PyObject_HasAttrString(config, "items")) {
        raise_wrong_type("config must be a dict", config);
        return -1;
    }
    /* A copy of the items: str() of a value may run code that mutates the mapping. */
    PyObject *items = PyMapping_Items(config);
    if (!items)
        return -1;
    int ret = -1;
    for (Py_ssize_t i = 0; i < PyList_Size(items); i++) {
        PyObject *kv = PyList_GetItem(items, i);
        if (!PyTuple_Check(kv) || PyTuple_Size(kv) != 2) {
            PyErr_SetString(PyExc_TypeError, "config items must be (key, value) pairs");
            goto done;
        }
        PyObject *k = PyTuple_GetItem(kv, 0), *v = PyTuple_GetItem(kv, 1);
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

/* A fixed-size C string field as str, or None when empty. */
static PyObject *str_or_none(const char *s, size_t cap)
{
    size_t n = strnlen(s, cap);
    if (!n)
        Py_RETURN_NONE;
    return PyUnicode_DecodeUTF8(s, (Py_ssize_t)n, "surrogateescape");
}

/* The dict form of a config; feeding it back to validate_config() gives the same config. */
PyObject *config_to_dict(const ast_config *c)
{
    PyObject *d = PyDict_New();
    if (!d)
        return NULL;
    if (dict_set_steal(d, "workers", c->workers > 0 ? PyLong_FromLong(c->workers) : Py_NewRef(Py_None)) ||
        dict_set_steal(d, "cpuset", str_or_none(c->cpuset, sizeof c->cpuset)) ||
        dict_set_steal(d, "pin", PyBool_FromLong(c->pin)) ||
        dict_set_steal(d, "trace", str_or_none(c->trace, sizeof c->trace))) {
        Py_DECREF(d);
        return NULL;
    }
    return d;
}

/* ---- Config: a validated ast_config, handed to Runtime() as it is -------------------------- */

PyObject *config_validate(mod_state *st, PyObject *config)
{
    ast_config cfg;
    ast_config_init(&cfg);
    if (config_apply(st, &cfg, config) < 0)
        return NULL;
    ConfigObject *self = PyObject_New(ConfigObject, st->config_type);
    if (!self)
        return NULL;
    self->cfg = cfg;
    return (PyObject *)self;
}

static void config_dealloc(ConfigObject *self)
{
    PyTypeObject *tp = Py_TYPE(self);
    PyObject_Free(self);
    Py_DECREF(tp);
}

static PyObject *config_as_dict(ConfigObject *self, PyObject *unused)
{
    return config_to_dict(&self->cfg);
}

/* Pickled as validate_config(as_dict()): a config read back is validated where it enters. */
static PyObject *config_reduce(ConfigObject *self, PyObject *unused)
{
    PyObject *m = PyType_GetModule(Py_TYPE(self));
    PyObject *fn = m ? PyObject_GetAttrString(m, "validate_config") : NULL;
    PyObject *d = fn ? config_to_dict(&self->cfg) : NULL;
    PyObject *out = d ? Py_BuildValue("(O(O))", fn, d) : NULL;
    Py_XDECREF(fn);
    Py_XDECREF(d);
    return out;
}

static PyObject *config_richcompare(PyObject *a, PyObject *b, int op)
{
    if ((op != Py_EQ && op != Py_NE) || !Py_IS_TYPE(b, Py_TYPE(a)))
        Py_RETURN_NOTIMPLEMENTED;
    PyObject *da = config_to_dict(&((ConfigObject *)a)->cfg);
    PyObject *db = da ? config_to_dict(&((ConfigObject *)b)->cfg) : NULL;
    PyObject *out = db ? PyObject_RichCompare(da, db, op) : NULL;
    Py_XDECREF(da);
    Py_XDECREF(db);
    return out;
}

static PyObject *config_repr(ConfigObject *self)
{
    PyObject *d = config_to_dict(&self->cfg);
    if (!d)
        return NULL;
    PyObject *out = PyUnicode_FromFormat("<%s %R>", config_spec.name, d);
    Py_DECREF(d);
    return out;
}

static PyMethodDef config_methods[] = {
    {"as_dict", (PyCFunction)config_as_dict, METH_NOARGS,
     PyDoc_STR("as_dict()\n--\n\nThe config as a dict of config_keys() (None for a default).")},
    {"__reduce__", (PyCFunction)config_reduce, METH_NOARGS, NULL},
    {NULL, NULL, 0, NULL},
};

PyDoc_STRVAR(config_doc,
             "The C part of a runtime config (the keys of config_keys()), validated by "
             "libasteria's ast_config_set.\nMade by validate_config(); Runtime() takes it as it "
             "is, with no second parse.");

static PyType_Slot config_slots[] = {
    {Py_tp_dealloc, config_dealloc},
    {Py_tp_repr, config_repr},
    {Py_tp_richcompare, config_richcompare},
    {Py_tp_methods, config_methods},
    {Py_tp_doc, (void *)config_doc},
    {0, NULL},
};

PyType_Spec config_spec = {
    .name = "asteria._C.Config",
    .basicsize = sizeof(ConfigObject),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_IMMUTABLETYPE | Py_TPFLAGS_DISALLOW_INSTANTIATION,
    .slots = config_slots,
};
