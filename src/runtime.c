/*
 * runtime.c - the Asteria runtime: REFRESH job submission over the worker pool.
 *
 * Owns: the validated config, the pool, the registered host-buffer table (with a reference
 * count per buffer held by every job that reads or writes it), the stats counters, the
 * last-error message and, when config.trace is set, the trace recorder (trace.h) and the writing
 * of its file at destroy. It keeps no failure streak: a result carries its job's own status, and
 * the consecutive-failure rule is the optimizer's (python/asteria/optim/schedule.py), the one
 * count every executor reaches (docs/departures.md).
 *
 * Ops: the runtime knows none by name. ast_runtime_submit checks a request with the op table
 * (op_table.h, op_table.c: ast__op_check, then each pointer against the row's args and the
 * registered buffers) and a worker runs the row through the dispatch (op_run.h), as a direct
 * call of asteria/linalg.h does. A new op changes nothing here.
 *
 * May call: the pool, the op table, the dispatch (and through it the kernels; ast_linalg_init
 * and ast_linalg_last_retried), the trace recorder, config and util.h.
 *
 * Trace events are recorded where the runtime already is: "job queued" in submit (stamped
 * before the pool sees the job, so it precedes the pool's started_ns); "job started", the
 * "refresh" span and "job done" when the owner collects the completion (poll / wait), from the
 * pool's started_ns / done_ns, on the worker's lane; barrier spans in wait; installs in
 * note_install. Completions never collected are drained at destroy so they are traced too.
 *
 * Locking: rt->mu guards buffers[], the live-job list and err. It is never held while calling
 * into the pool's blocking functions, while a job computes, or while calling into the trace
 * recorder (which has its own mutex and never calls back), so there is no lock order to keep.
 * Jobs run on pool workers and touch only their own rjob, the buffers whose references they
 * hold and (a stretched job, testing.h) the runtime's atomic stretch totals, so they take no
 * runtime lock. Stats counters that jobs or callers bump concurrently are
 * C11 atomics. rt->trace is set at creation and freed at destroy only.
 */
#include "asteria/runtime.h"

#include "asteria/errors.h"
#include "asteria/linalg.h"
#include "asteria/pool.h"
#include "asteria/trace.h"
#include "op_run.h"
#include "op_table.h"
#include "testing.h"
#include "util.h"

#include <errno.h>
#include <inttypes.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

typedef struct rbuf {
    uint64_t handle;
    uintptr_t base;
    size_t nbytes;
    unsigned refs;   /* jobs that still use it */
} rbuf;

typedef struct rjob {
    struct rjob *prev, *next; /* rt->live list: jobs whose completion is not yet drained */
    ast_refresh req;
    const ast__op *op;             /* req.op's row in the op table (op_table.h) */
    uint64_t bufs[AST__ARG_COUNT]; /* the buffers it holds a reference on, one per pointer */
    int nbufs;
    int failed_index;
    int retried;
    int delay_ms; /* rt->job_delay_ms at submit (testing.h) */
    double stretch;          /* its op's job stretch at submit, 1: none (testing.h) */
    struct ast_runtime *rt;  /* its runtime, for the stretch totals */
} rjob;

struct ast_runtime {
    ast_config cfg;
    ast_pool *pool;
    pthread_mutex_t mu;
    rbuf *buffers;
    size_t nbuffers, capbuffers;
    uint64_t next_handle;
    rjob *live;
    ast_trace *trace; /* NULL unless cfg.trace is set */
    ast__last_error err; /* named: "AST_EXXX: ..." */

    _Atomic uint64_t jobs_submitted, jobs_done, jobs_failed, jobs_superseded, jobs_cancelled;
    _Atomic uint64_t jobs_retried, nonfinite_skipped, installs, barrier_waits, barrier_wait_ns;
    _Atomic uint64_t bytes_registered;
    _Atomic int64_t max_install_lag, last_install_step;
    _Atomic int job_delay_ms; /* test hook, testing.h */
    /* test hook, testing.h: the job stretch (factor, op mask; set while no submit runs) and
     * its totals */
    _Atomic double job_stretch;
    _Atomic unsigned job_stretch_ops;
    _Atomic uint64_t stretch_compute_ns, stretch_slept_ns;
};

/* Sets rt's last error under rt->mu and returns code (util's one setter); _LOCKED: for a caller
 * that holds rt->mu. */
#define RT_ERROR(rt, code, ...) ast__set_error(&(rt)->err, &(rt)->mu, (code), __VA_ARGS__)
#define RT_ERROR_LOCKED(rt, code, ...) ast__set_error(&(rt)->err, NULL, (code), __VA_ARGS__)

int ast_runtime_create(const ast_config *cfg, ast_runtime **out, char *errbuf, size_t len)
{
    if (errbuf && len)
        errbuf[0] = '\0';
    if (!out)
        return ast__errorf(errbuf, len, AST_EINVAL, "ast_runtime_create: out is NULL");
    *out = NULL;
    ast_config defaults;
    if (!cfg) {
        ast_config_init(&defaults);
        cfg = &defaults;
    }
    int rc = ast_config_validate(cfg, errbuf, len);
    if (rc)
        return rc;
    ast_runtime *rt = calloc(1, sizeof *rt);
    if (!rt)
        return ast__errorf(errbuf, len, AST_ENOMEM, "ast_runtime_create: out of memory");
    rt->cfg = *cfg;
    rt->err.named = 1;
    rt->next_handle = 1;
    atomic_init(&rt->max_install_lag, -1);
    atomic_init(&rt->last_install_step, -1);
    atomic_init(&rt->job_stretch, 1.0);
    if (pthread_mutex_init(&rt->mu, NULL)) {
        free(rt);
        return ast__errorf(errbuf, len, AST_ENOMEM, "ast_runtime_create: no mutex");
    }
    if (cfg->trace[0] && (rc = ast_trace_create(&rt->trace)) != 0) {
        ast__errorf(errbuf, len, rc, "trace '%s': %s", cfg->trace, ast_strerror(rc));
        pthread_mutex_destroy(&rt->mu);
        free(rt);
        return rc;
    }
    ast_linalg_init();
    ast_pool_opts po;
    ast_pool_opts_init(&po);
    po.workers = cfg->workers;
    po.cpuset = cfg->cpuset[0] ? cfg->cpuset : NULL;
    po.pin = cfg->pin;
    rc = ast_pool_create(&po, &rt->pool);
    if (rc) {
        ast__errorf(errbuf, len, rc, "worker pool: %s (workers=%d, cpuset='%s')", ast_strerror(rc),
                    cfg->workers, cfg->cpuset);
        ast_trace_destroy(rt->trace);
        pthread_mutex_destroy(&rt->mu);
        free(rt);
        return rc;
    }
    *out = rt;
    return 0;
}

int ast_runtime_destroy(ast_runtime *rt, char *errbuf, size_t len)
{
    if (errbuf && len)
        errbuf[0] = '\0';
    if (!rt)
        return 0;
    /* Completions the owner never collected are drained first so the trace shows them; the
     * pool then finishes running jobs and drops queued ones (their events are lost). */
    if (rt->trace && rt->pool) {
        ast_result scratch[64];
        size_t n;
        do {
            n = 0;
            if (ast_runtime_poll(rt, scratch, 64, &n))
                break;
        } while (n == 64);
    }
    /* Every job context not drained by the owner is still on the live list and is freed here. */
    ast_pool_destroy(rt->pool);
    rt->pool = NULL;
    int rc = 0;
    if (rt->trace && rt->cfg.trace[0]) {
        rc = ast_runtime_trace_write(rt, NULL);
        if (rc && errbuf && len)
            ast_runtime_last_error(rt, errbuf, len);
    }
    ast_trace_destroy(rt->trace);
    for (rjob *j = rt->live, *next; j; j = next) {
        next = j->next;
        free(j);
    }
    free(rt->buffers);
    pthread_mutex_destroy(&rt->mu);
    free(rt);
    return rc;
}

const ast_config *ast_runtime_config(const ast_runtime *rt) { return rt ? &rt->cfg : NULL; }

int ast__runtime_set_job_delay(ast_runtime *rt, int delay_ms)
{
    if (!rt || delay_ms < 0 || delay_ms > AST__JOB_DELAY_MAX_MS)
        return AST_EINVAL;
    atomic_store(&rt->job_delay_ms, delay_ms);
    return 0;
}

int ast__runtime_set_job_stretch(ast_runtime *rt, double factor, unsigned ops)
{
    unsigned all = (2u << ast_op_count()) - 2u; /* bits 1..ast_op_count() */
    if (!rt || !(factor >= 1.0 && factor <= AST__JOB_STRETCH_MAX) || (ops & ~all))
        return AST_EINVAL;
    atomic_store(&rt->job_stretch_ops, ops);
    atomic_store(&rt->job_stretch, factor);
    return 0;
}

int ast__runtime_job_stretch_totals(ast_runtime *rt, uint64_t *compute_ns, uint64_t *slept_ns)
{
    if (!rt || !compute_ns || !slept_ns)
        return AST_EINVAL;
    *compute_ns = atomic_load(&rt->stretch_compute_ns);
    *slept_ns = atomic_load(&rt->stretch_slept_ns);
    return 0;
}

/* The stretch a job of op submitted now gets: the runtime's factor where ops takes op, else 1. */
static double stretch_of(ast_runtime *rt, int op)
{
    unsigned ops = atomic_load(&rt->job_stretch_ops);
    return !ops || (ops >> op & 1u) ? atomic_load(&rt->job_stretch) : 1.0;
}

int ast_runtime_last_error(ast_runtime *rt, char *buf, size_t len)
{
    if (!rt)
        return AST_EINVAL;
    return ast__get_error(&rt->err, &rt->mu, buf, len);
}

int ast_runtime_register(ast_runtime *rt, void *ptr, size_t nbytes, uint64_t *handle)
{
    if (!rt)
        return AST_EINVAL;
    if (!ptr || !nbytes || !handle)
        return RT_ERROR(rt, AST_EINVAL, "register: pointer %p, %zu bytes; allowed: a non-NULL "
                        "pointer and nbytes >= 1", ptr, nbytes);
    pthread_mutex_lock(&rt->mu);
    if (rt->nbuffers == rt->capbuffers) {
        size_t cap = rt->capbuffers ? rt->capbuffers * 2 : 64;
        rbuf *nb = realloc(rt->buffers, cap * sizeof *nb);
        if (!nb) {
            pthread_mutex_unlock(&rt->mu);
            return RT_ERROR(rt, AST_ENOMEM, "register: no memory for the buffer table");
        }
        rt->buffers = nb;
        rt->capbuffers = cap;
    }
    rbuf *b = &rt->buffers[rt->nbuffers++];
    b->handle = rt->next_handle++;
    b->base = (uintptr_t)ptr;
    b->nbytes = nbytes;
    b->refs = 0;
    *handle = b->handle;
    pthread_mutex_unlock(&rt->mu);
    atomic_fetch_add(&rt->bytes_registered, nbytes);
    return 0;
}

static rbuf *find_handle_locked(ast_runtime *rt, uint64_t handle)
{
    for (size_t i = 0; i < rt->nbuffers; i++)
        if (rt->buffers[i].handle == handle)
            return &rt->buffers[i];
    return NULL;
}

int ast_runtime_unregister(ast_runtime *rt, uint64_t handle)
{
    if (!rt)
        return AST_EINVAL;
    pthread_mutex_lock(&rt->mu);
    rbuf *b = find_handle_locked(rt, handle);
    if (!b) {
        pthread_mutex_unlock(&rt->mu);
        return RT_ERROR(rt, AST_ENOENT, "unregister: no buffer with handle %" PRIu64, handle);
    }
    if (b->refs) {
        unsigned refs = b->refs;
        pthread_mutex_unlock(&rt->mu);
        return RT_ERROR(rt, AST_EBUSY, "unregister: buffer %" PRIu64 " is used by %u job(s)",
                        handle, refs);
    }
    size_t nbytes = b->nbytes;
    *b = rt->buffers[--rt->nbuffers];
    pthread_mutex_unlock(&rt->mu);
    atomic_fetch_sub(&rt->bytes_registered, nbytes);
    return 0;
}

/* The registered buffer that holds [p, p+nbytes) entirely, or NULL. */
static rbuf *find_range_locked(ast_runtime *rt, const void *p, size_t nbytes)
{
    uintptr_t a = (uintptr_t)p;
    for (size_t i = 0; i < rt->nbuffers; i++) {
        rbuf *b = &rt->buffers[i];
        if (a >= b->base && nbytes <= b->nbytes && a - b->base <= b->nbytes - nbytes)
            return b;
    }
    return NULL;
}

static void unlink_locked(ast_runtime *rt, rjob *j)
{
    if (j->prev)
        j->prev->next = j->next;
    else if (rt->live == j)
        rt->live = j->next;
    if (j->next)
        j->next->prev = j->prev;
    j->prev = j->next = NULL;
}

/* Holds the worker after a stretched job's compute, begun at t0 (testing.h): a sleep to an
 * absolute deadline, so a signal's wake-up only resumes it, and the job returns no sooner. */
static void stretch_hold(rjob *j, uint64_t t0)
{
    uint64_t t1 = ast__now_ns(), c = t1 - t0;
    double want = (double)c * (j->stretch - 1.0);
    uint64_t until = t1 + (uint64_t)want;
    if ((double)(until - t1) < want)
        until++; /* rounded up: the hold is never short of factor x c */
    struct timespec d = {(time_t)(until / 1000000000u), (long)(until % 1000000000u)};
    while (clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &d, NULL) == EINTR)
        ;
    atomic_fetch_add(&j->rt->stretch_compute_ns, c);
    atomic_fetch_add(&j->rt->stretch_slept_ns, ast__now_ns() - t1);
}

static int job_run(void *ctx)
{
    rjob *j = ctx;
    const ast_refresh *r = &j->req;
    j->failed_index = -1;
    if (j->delay_ms > 0) {
        struct timespec d = {j->delay_ms / 1000, (long)(j->delay_ms % 1000) * 1000000L};
        while (nanosleep(&d, &d) != 0)
            ;
    }
    const ast__op_args args = ast__op_args_of(j->op, r);
    uint64_t t0 = j->stretch > 1.0 ? ast__now_ns() : 0;
    int rc = ast__op_run(j->op, r->dtype, &args, r->batch, &j->failed_index);
    j->retried = ast_linalg_last_retried();
    if (j->stretch > 1.0)
        stretch_hold(j, t0);
    return rc;
}

int ast_runtime_submit(ast_runtime *rt, const ast_refresh *req, uint64_t *ticket)
{
    if (!rt || !req || !ticket)
        return AST_EINVAL;
    if (!rt->pool)
        return RT_ERROR(rt, AST_ESHUTDOWN, "submit: runtime is shutting down");
    const ast__op *op;
    size_t sizes[AST__ARG_COUNT];
    char why[512];
    int rc = ast__op_check(req, &op, sizes, why, sizeof why);
    if (rc)
        return RT_ERROR(rt, rc, "submit: %s", why);
    rjob *j = calloc(1, sizeof *j);
    if (!j)
        return RT_ERROR(rt, AST_ENOMEM, "submit: no memory for a job record");
    j->req = *req;
    j->op = op;
    j->failed_index = -1;
    j->delay_ms = atomic_load(&rt->job_delay_ms);
    j->stretch = stretch_of(rt, req->op);
    j->rt = rt;
    const void *const ptrs[AST__ARG_COUNT] = {req->in0, req->in1, req->in2, req->out0, req->out1};
    static const char *const names[AST__ARG_COUNT] = {"in0", "in1", "in2", "out0", "out1"};
    pthread_mutex_lock(&rt->mu);
    rbuf *held[AST__ARG_COUNT];
    int nheld = 0;
    for (int i = 0; i < AST__ARG_COUNT; i++) {
        if (!ptrs[i]) {
            if (op->args[i] == AST__ARG_REQUIRED) {
                rc = RT_ERROR_LOCKED(rt, AST_EINVAL, "submit: %s is required for op %d", names[i],
                                     (int)req->op);
                goto refuse;
            }
            continue;
        }
        if (op->args[i] == AST__ARG_NONE) {
            /* in2 is the one pointer few ops take: the message says which. */
            char only[256] = "";
            if (i == AST__ARG_IN2) {
                char takers[200];
                int k = ast__op_list(takers, sizeof takers, i);
                snprintf(only, sizeof only, " (only %s take%s in2)", takers, k == 1 ? "s" : "");
            }
            rc = RT_ERROR_LOCKED(rt, AST_EINVAL, "submit: %s must be NULL for op %d%s", names[i],
                                 (int)req->op, only);
            goto refuse;
        }
        rbuf *b = find_range_locked(rt, ptrs[i], sizes[i]);
        if (!b) {
            rc = RT_ERROR_LOCKED(rt, AST_ERANGE,
                                 "submit: %s [%p, +%zu bytes) is not inside a registered buffer",
                                 names[i], ptrs[i], sizes[i]);
            goto refuse;
        }
        held[nheld++] = b;
    }
    for (int i = 0; i < nheld; i++) {
        held[i]->refs++;
        j->bufs[j->nbufs++] = held[i]->handle;
    }
    j->next = rt->live;
    if (rt->live)
        rt->live->prev = j;
    rt->live = j;
    pthread_mutex_unlock(&rt->mu);

    ast_job job = {.block = req->block, .version = req->version, .deadline = req->deadline,
                   .run = job_run, .ctx = j};
    uint64_t queued_at = rt->trace ? ast_trace_now(rt->trace) : 0;
    rc = ast_pool_submit(rt->pool, &job, ticket);
    if (rc) {
        pthread_mutex_lock(&rt->mu);
        for (int i = 0; i < j->nbufs; i++) {
            rbuf *b = find_handle_locked(rt, j->bufs[i]);
            if (b)
                b->refs--;
        }
        unlink_locked(rt, j);
        pthread_mutex_unlock(&rt->mu);
        free(j);
        return RT_ERROR(rt, rc, "submit: pool refused block %" PRIu64 " version %" PRIu64,
                        req->block, req->version);
    }
    atomic_fetch_add(&rt->jobs_submitted, 1);
    if (rt->trace) {
        ast_trace_ev ev = {.kind = AST_TRACE_JOB_QUEUED, .lane = AST_TRACE_LANE_TRAIN,
                           .ts_ns = queued_at, .args = AST_TRACE_ARG_BLOCK | AST_TRACE_ARG_VERSION,
                           .block = req->block, .version = req->version};
        ast_trace_event(rt->trace, &ev);
    }
    return 0;

refuse: /* with rt->mu held and the refusal recorded: nothing is held yet but j */
    pthread_mutex_unlock(&rt->mu);
    free(j);
    return rc;
}

int ast_runtime_cancel(ast_runtime *rt, uint64_t ticket)
{
    if (!rt)
        return AST_EINVAL;
    if (!rt->pool)
        return RT_ERROR(rt, AST_ESHUTDOWN, "cancel: runtime is shutting down");
    int rc = ast_pool_cancel(rt->pool, ticket);
    if (rc == AST_EBUSY)
        return RT_ERROR(rt, rc, "cancel: ticket %" PRIu64 " is already running", ticket);
    if (rc == AST_ENOENT)
        return RT_ERROR(rt, rc, "cancel: ticket %" PRIu64 " is finished or unknown", ticket);
    return rc;
}

/* The trace events of one collected completion: for a job that ran, "job started", the
 * "refresh" span and "job done" on the worker's lane; for one that never ran (cancelled,
 * superseded, dropped at shutdown), "job done" on the train lane. Recording failures (a full
 * or out-of-memory recorder) are counted by the recorder as dropped events. */
static void trace_completion(ast_runtime *rt, const ast_completion *c, const ast_result *r)
{
    ast_trace *tr = rt->trace;
    uint64_t done = c->done_ns ? ast_trace_from_monotonic(tr, c->done_ns) : ast_trace_now(tr);
    ast_trace_ev ev = {.kind = AST_TRACE_JOB_DONE, .lane = AST_TRACE_LANE_TRAIN, .ts_ns = done,
                       .args = AST_TRACE_ARG_BLOCK | AST_TRACE_ARG_VERSION, .block = r->block,
                       .version = r->version, .status = r->status, .worker = c->worker};
    if (c->started_ns && c->worker >= 0) {
        uint64_t start = ast_trace_from_monotonic(tr, c->started_ns);
        ev.lane = c->worker;
        ev.args |= AST_TRACE_ARG_WORKER;
        ev.kind = AST_TRACE_JOB_STARTED;
        ev.ts_ns = start;
        ast_trace_event(tr, &ev);
        ev.args |= AST_TRACE_ARG_STATUS;
        ev.kind = AST_TRACE_JOB_RUN;
        ev.dur_ns = done > start ? done - start : 0;
        ast_trace_event(tr, &ev);
        ev.kind = AST_TRACE_JOB_DONE;
        ev.ts_ns = done;
        ev.dur_ns = 0;
    }
    ev.args |= AST_TRACE_ARG_STATUS;
    ast_trace_event(tr, &ev);
}

/* Turns a pool completion into a result on the owner's thread: drops the job's buffer
 * references, counts, frees the job. The result's status is the job's own. */
static void finish(ast_runtime *rt, const ast_completion *c, ast_result *r)
{
    rjob *j = c->ctx;
    memset(r, 0, sizeof *r);
    r->ticket = c->ticket;
    r->block = c->block;
    r->version = c->version;
    r->status = c->status;
    r->queued_ns = c->queued_ns;
    r->started_ns = c->started_ns;
    r->done_ns = c->done_ns;
    r->worker = c->worker;
    r->failed_index = -1;
    r->snapshot_step = j ? j->req.snapshot_step : -1;
    if (j) {
        r->failed_index = j->failed_index;
        r->retried_f64 = j->retried;
    }
    pthread_mutex_lock(&rt->mu);
    if (j) {
        for (int i = 0; i < j->nbufs; i++) {
            rbuf *b = find_handle_locked(rt, j->bufs[i]);
            if (b && b->refs)
                b->refs--;
        }
        unlink_locked(rt, j);
    }
    pthread_mutex_unlock(&rt->mu);
    if (c->status == AST_ESUPERSEDED)
        atomic_fetch_add(&rt->jobs_superseded, 1);
    else if (c->status == AST_ECANCELED)
        atomic_fetch_add(&rt->jobs_cancelled, 1);
    else if (c->status != AST_ESHUTDOWN) { /* the job ran */
        atomic_fetch_add(&rt->jobs_done, 1);
        if (c->status)
            atomic_fetch_add(&rt->jobs_failed, 1);
        if (r->retried_f64)
            atomic_fetch_add(&rt->jobs_retried, 1);
    }
    if (rt->trace)
        trace_completion(rt, c, r);
    free(j);
}

int ast_runtime_poll(ast_runtime *rt, ast_result *out, size_t cap, size_t *n)
{
    if (!rt || !n || (cap && !out))
        return AST_EINVAL;
    *n = 0;
    if (!rt->pool)
        return AST_ESHUTDOWN;
    ast_completion c[64];
    while (*n < cap) {
        size_t want = cap - *n < 64 ? cap - *n : 64, got = 0;
        int rc = ast_pool_poll(rt->pool, c, want, &got);
        if (rc)
            return rc;
        for (size_t i = 0; i < got; i++)
            finish(rt, &c[i], &out[(*n)++]);
        if (got < want)
            break;
    }
    return 0;
}

/* One wait for ticket: whole (slice_ns < 0) or in slices of slice_ns with check() between. */
static int wait_ticket(ast_runtime *rt, uint64_t ticket, int64_t timeout_ns, int64_t slice_ns,
                       int (*check)(void *), void *arg, ast_completion *c)
{
    if (slice_ns < 0)
        return ast_pool_wait(rt->pool, ticket, timeout_ns, c);
    uint64_t t0 = ast__now_ns();
    for (;;) {
        int64_t left = -1;
        if (timeout_ns >= 0) {
            uint64_t spent = ast__now_ns() - t0;
            left = spent >= (uint64_t)timeout_ns ? 0 : timeout_ns - (int64_t)spent;
        }
        int64_t step = left >= 0 && left < slice_ns ? left : slice_ns;
        int rc = ast_pool_wait(rt->pool, ticket, step, c);
        if (rc != AST_ETIMEDOUT || left == step)
            return rc;
        if (check(arg) != 0)
            return AST_EINTR;
    }
}

static int wait_impl(ast_runtime *rt, uint64_t ticket, int64_t timeout_ns, int64_t slice_ns,
                     int (*check)(void *), void *arg, ast_result *out)
{
    if (!rt || !out)
        return AST_EINVAL;
    if (!rt->pool)
        return AST_ESHUTDOWN;
    ast_completion c;
    int rc = ast_pool_wait(rt->pool, ticket, 0, &c);
    if (rc == AST_ETIMEDOUT) {
        uint64_t t0 = ast__now_ns();
        rc = wait_ticket(rt, ticket, timeout_ns, slice_ns, check, arg, &c);
        uint64_t t1 = ast__now_ns();
        atomic_fetch_add(&rt->barrier_waits, 1);
        atomic_fetch_add(&rt->barrier_wait_ns, t1 - t0);
        if (rt->trace) {
            ast_trace_ev ev = {.kind = AST_TRACE_BARRIER_WAIT, .lane = AST_TRACE_LANE_TRAIN,
                               .ts_ns = ast_trace_from_monotonic(rt->trace, t0),
                               .dur_ns = t1 - t0, .args = AST_TRACE_ARG_STATUS, .status = rc};
            if (rc == 0) {
                ev.args |= AST_TRACE_ARG_BLOCK | AST_TRACE_ARG_VERSION;
                ev.block = c.block;
                ev.version = c.version;
            }
            ast_trace_event(rt->trace, &ev);
        }
    }
    if (rc == AST_ETIMEDOUT)
        return RT_ERROR(rt, rc, "wait: ticket %" PRIu64 " not done within %" PRId64 " ns",
                        ticket, timeout_ns);
    if (rc == AST_EINTR)
        return RT_ERROR(rt, rc, "wait: ticket %" PRIu64 " interrupted; the job is still "
                        "pending", ticket);
    if (rc == AST_ENOENT)
        return RT_ERROR(rt, rc, "wait: ticket %" PRIu64 " is unknown or was already collected",
                        ticket);
    if (rc)
        return RT_ERROR(rt, rc, "wait: ticket %" PRIu64 ": %s", ticket, ast_strerror(rc));
    finish(rt, &c, out);
    return 0;
}

int ast_runtime_wait(ast_runtime *rt, uint64_t ticket, int64_t timeout_ns, ast_result *out)
{
    return wait_impl(rt, ticket, timeout_ns, -1, NULL, NULL, out);
}

int ast_runtime_wait_check(ast_runtime *rt, uint64_t ticket, int64_t timeout_ns,
                           int64_t slice_ns, int (*check)(void *arg), void *arg,
                           ast_result *out)
{
    if (!check || slice_ns <= 0)
        return AST_EINVAL;
    return wait_impl(rt, ticket, timeout_ns, slice_ns, check, arg, out);
}

void ast_runtime_note_install(ast_runtime *rt, int64_t snapshot_step, int64_t install_step)
{
    if (!rt)
        return;
    atomic_fetch_add(&rt->installs, 1);
    int64_t lag = install_step - snapshot_step;
    int64_t cur = atomic_load(&rt->max_install_lag);
    while (lag > cur && !atomic_compare_exchange_weak(&rt->max_install_lag, &cur, lag))
        ;
    atomic_store(&rt->last_install_step, install_step);
    if (rt->trace) {
        /* trace.h has one step field: version carries the snapshot step (see runtime.h). */
        ast_trace_ev ev = {.kind = AST_TRACE_INSTALL, .lane = AST_TRACE_LANE_TRAIN,
                           .ts_ns = ast_trace_now(rt->trace),
                           .args = AST_TRACE_ARG_STEP | AST_TRACE_ARG_VERSION,
                           .step = install_step, .version = (uint64_t)snapshot_step};
        ast_trace_event(rt->trace, &ev);
    }
}

void ast_runtime_note_nonfinite(ast_runtime *rt)
{
    if (rt)
        atomic_fetch_add(&rt->nonfinite_skipped, 1);
}

int ast_runtime_stats_get(ast_runtime *rt, ast_stats *out)
{
    if (!rt || !out)
        return AST_EINVAL;
    memset(out, 0, sizeof *out);
    if (rt->pool) {
        ast_pool_stats ps;
        if (ast_pool_stats_get(rt->pool, &ps) == 0) {
            out->jobs_queued = ps.queued;
            out->jobs_running = ps.running;
            out->worker_busy_ns = ps.busy_ns;
            out->workers = ps.workers;
        }
    }
    out->jobs_submitted = atomic_load(&rt->jobs_submitted);
    out->jobs_done = atomic_load(&rt->jobs_done);
    out->jobs_failed = atomic_load(&rt->jobs_failed);
    out->jobs_superseded = atomic_load(&rt->jobs_superseded);
    out->jobs_cancelled = atomic_load(&rt->jobs_cancelled);
    out->jobs_retried_f64 = atomic_load(&rt->jobs_retried);
    out->nonfinite_skipped = atomic_load(&rt->nonfinite_skipped);
    out->installs = atomic_load(&rt->installs);
    out->max_install_lag = atomic_load(&rt->max_install_lag);
    out->last_installed_version_step = atomic_load(&rt->last_install_step);
    out->barrier_waits = atomic_load(&rt->barrier_waits);
    out->barrier_wait_ns = atomic_load(&rt->barrier_wait_ns);
    out->bytes_registered = atomic_load(&rt->bytes_registered);
    return 0;
}

/* ---- trace ------------------------------------------------------------------------------- */

int ast_runtime_tracing(const ast_runtime *rt)
{
    return rt && rt->trace;
}

int ast_runtime_trace_event(ast_runtime *rt, const ast_trace_ev *ev)
{
    if (!rt || !ev)
        return AST_EINVAL;
    if (!rt->trace)
        return 0;
    ast_trace_ev e = *ev;
    e.ts_ns = e.ts_ns ? ast_trace_from_monotonic(rt->trace, e.ts_ns) : ast_trace_now(rt->trace);
    int rc = ast_trace_event(rt->trace, &e);
    if (rc == AST_EINVAL)
        return RT_ERROR(rt, rc, "trace_event: kind %d, lane %d, name %s%s%s; allowed: a kind "
                        "below %d, a lane in [%d, -1] or a worker index >= 0, a name (required "
                        "for custom kinds) and category of at most 1023 bytes",
                        (int)ev->kind, ev->lane, ev->name ? "'" : "", ev->name ? ev->name : "NULL",
                        ev->name ? "'" : "", AST_TRACE_KIND_COUNT, AST_TRACE_LANE_MIN);
    if (rc == AST_ENOSPC)
        return RT_ERROR(rt, rc, "trace_event: the recorder's event limit is reached; the event "
                        "was dropped");
    if (rc)
        return RT_ERROR(rt, rc, "trace_event: %s", ast_strerror(rc));
    return 0;
}

int ast_runtime_trace_name_lane(ast_runtime *rt, int lane, const char *name)
{
    if (!rt)
        return AST_EINVAL;
    if (!rt->trace)
        return 0;
    int rc = ast_trace_name_lane(rt->trace, lane, name);
    if (rc == AST_EINVAL)
        return RT_ERROR(rt, rc, "trace_name_lane: lane %d, name %s; allowed: a lane in [%d, -1] "
                        "or a worker index >= 0 and a non-NULL name of at most 1023 bytes",
                        lane, name ? name : "NULL", AST_TRACE_LANE_MIN);
    if (rc)
        return RT_ERROR(rt, rc, "trace_name_lane: %s", ast_strerror(rc));
    return 0;
}

int ast_runtime_trace_write(ast_runtime *rt, const char *path)
{
    if (!rt)
        return AST_EINVAL;
    if (!rt->trace)
        return RT_ERROR(rt, AST_ESTATE, "trace_write: this runtime records no trace (config key "
                        "'trace' is empty)");
    if (!path || !*path)
        path = rt->cfg.trace;
    int rc = ast_trace_write_json(rt->trace, path);
    if (rc) {
        /* The recorder's message already names the code: keep only its detail. */
        char msg[1024];
        ast_trace_last_error(rt->trace, msg, sizeof msg);
        const char *d = msg, *name = ast_err_name(rc);
        size_t n = strlen(name);
        if (!strncmp(d, name, n) && d[n] == ':')
            d += n + 1 + (d[n + 1] == ' ');
        return RT_ERROR(rt, rc, "%s", d);
    }
    return 0;
}
