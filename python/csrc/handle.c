/*
 * handle.c - the calls made on a bound type's libasteria handle. A handle_kind says how a type's
 * handle names itself, reads its last error and raises a failure, so that Runtime, Store, Shadow
 * and Coherence enter the handle's guard (errors.c), release the GIL, read the message and raise
 * alike (module.c's rules).
 * May call: the public libasteria API and the Python C API, and common.h.
 */
#include "common.h"

int handle_enter(const handle_kind *k, guard *g, const void *h, mod_state *st)
{
    return guard_enter(g, h != NULL, st, k->what);
}

int handle_open(const handle_kind *k, guard *g, const void *h, mod_state *st)
{
    return guard_open(g, h != NULL, st, k->what);
}

int handle_run(const handle_kind *k, void *h, int (*fn)(void *h, void *arg), void *arg, char *err)
{
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = fn(h, arg);
    /* Read before the GIL is taken back: another thread's call may set a newer message. */
    if (rc < 0 && err)
        k->last_error(h, err, ERRBUF_LEN);
    Py_END_ALLOW_THREADS
    return rc;
}

int handle_try(const handle_kind *k, guard *g, void *h, mod_state *st,
               int (*fn)(void *h, void *arg), void *arg, int *rc, char *err)
{
    if (handle_enter(k, g, h, st) < 0)
        return -1;
    *rc = handle_run(k, h, fn, arg, err);
    guard_leave(g);
    return 0;
}

int handle_call(const handle_kind *k, guard *g, void *h, mod_state *st,
                int (*fn)(void *h, void *arg), void *arg)
{
    char err[ERRBUF_LEN] = "";
    int rc;
    if (handle_try(k, g, h, st, fn, arg, &rc, err) < 0)
        return -1;
    if (rc < 0) {
        k->raise(st, rc, err);
        return -1;
    }
    return 0;
}

PyObject *handle_raise(const handle_kind *k, void *h, mod_state *st, int rc)
{
    char err[ERRBUF_LEN] = "";
    k->last_error(h, err, sizeof err);
    return k->raise(st, rc, err);
}

PyObject *handle_message(const handle_kind *k, void *h)
{
    char buf[ERRBUF_LEN] = "";
    k->last_error(h, buf, sizeof buf);
    return error_text(buf);
}

PyObject *handle_message_released(const handle_kind *k, guard *g, void *h, mod_state *st)
{
    if (handle_enter(k, g, h, st) < 0)
        return NULL;
    char buf[ERRBUF_LEN] = "";
    Py_BEGIN_ALLOW_THREADS
    k->last_error(h, buf, sizeof buf);
    Py_END_ALLOW_THREADS
    guard_leave(g);
    return error_text(buf);
}
