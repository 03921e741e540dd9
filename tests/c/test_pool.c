/*
 * test_pool.c - the worker pool (asteria/pool.h): ordering, supersede, cancel, wait, shutdown,
 * fork, core sets, stats.
 *
 * Jobs that must stay "running" block on a gate the test opens, so every ordering below is
 * forced, not hoped for. CMocka asserts only run on the main thread; helper threads record what
 * they saw and the main thread checks it after joining them.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <errno.h>
#include <pthread.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "asteria/build_config.h"
#include "asteria/errors.h"
#include "asteria/pool.h"

#if defined(__SANITIZE_THREAD__)
#define UNDER_TSAN 1
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define UNDER_TSAN 1
#endif
#endif
#ifndef UNDER_TSAN
#define UNDER_TSAN 0
#endif

#define SEC 1000000000LL

/* ---- helpers -------------------------------------------------------------------------------- */

typedef struct gate {
    pthread_mutex_t m;
    pthread_cond_t c;
    int open;
    int entered;
} gate;

static void gate_init(gate *g)
{
    pthread_mutex_init(&g->m, NULL);
    pthread_cond_init(&g->c, NULL);
    g->open = 0;
    g->entered = 0;
}

static void gate_fini(gate *g)
{
    pthread_cond_destroy(&g->c);
    pthread_mutex_destroy(&g->m);
}

static void gate_open(gate *g)
{
    pthread_mutex_lock(&g->m);
    g->open = 1;
    pthread_cond_broadcast(&g->c);
    pthread_mutex_unlock(&g->m);
}

/* Waits until n jobs are blocked on the gate (so they are certainly running). */
static void gate_wait_entered(gate *g, int n)
{
    pthread_mutex_lock(&g->m);
    while (g->entered < n)
        pthread_cond_wait(&g->c, &g->m);
    pthread_mutex_unlock(&g->m);
}

typedef struct order_log {
    pthread_mutex_t m;
    int n;
    int ids[512];
} order_log;

typedef struct tjob {
    int id;
    int ret;              /* what run() returns */
    gate *gate;           /* block on it first, if set */
    order_log *log;       /* append id when run, if set */
    long sleep_us;
    ast_pool *resubmit;   /* after the gate: submit into this pool, result in inner_rc */
    int inner_rc;
    int ran;              /* set by run() */
    int finished;         /* set by run() just before it returns */
    int cpu;              /* sched_getcpu() inside run() */
    pid_t pid;            /* getpid() inside run() */
    uint64_t ticket;      /* set by the submitter */
    int completions;      /* counted by the drainer */
    ast_completion c;     /* the completion the drainer saw */
} tjob;

static int noop_run(void *ctx)
{
    (void)ctx;
    return 0;
}

static int tjob_run(void *arg)
{
    tjob *j = arg;
    j->ran = 1;
    j->cpu = sched_getcpu();
    j->pid = getpid();
    if (j->gate) {
        pthread_mutex_lock(&j->gate->m);
        j->gate->entered++;
        pthread_cond_broadcast(&j->gate->c);
        while (!j->gate->open)
            pthread_cond_wait(&j->gate->c, &j->gate->m);
        pthread_mutex_unlock(&j->gate->m);
    }
    if (j->resubmit) {
        ast_job again = {.block = 999999, .version = 1, .deadline = 0, .run = noop_run};
        uint64_t t;
        j->inner_rc = ast_pool_submit(j->resubmit, &again, &t);
    }
    if (j->sleep_us) {
        struct timespec ts = {.tv_sec = j->sleep_us / 1000000, .tv_nsec = (j->sleep_us % 1000000) * 1000};
        nanosleep(&ts, NULL);
    }
    if (j->log) {
        pthread_mutex_lock(&j->log->m);
        j->log->ids[j->log->n++] = j->id;
        pthread_mutex_unlock(&j->log->m);
    }
    j->finished = 1;
    return j->ret;
}

static uint64_t submit(ast_pool *p, tjob *j, uint64_t block, uint64_t version, int64_t deadline)
{
    ast_job job = {.block = block, .version = version, .deadline = deadline, .run = tjob_run, .ctx = j};
    uint64_t t = 0;
    assert_int_equal(ast_pool_submit(p, &job, &t), 0);
    assert_true(t != 0);
    j->ticket = t;
    return t;
}

/* Initialises gate g (closed) and parks a worker of p in gj (its gate set to g), submitted with
 * block and deadline; returns gj's ticket once the worker has entered the gate. */
static uint64_t hold_worker(ast_pool *p, gate *g, tjob *gj, uint64_t block, int64_t deadline)
{
    gate_init(g);
    gj->gate = g;
    uint64_t t = submit(p, gj, block, 1, deadline);
    gate_wait_entered(g, 1);
    return t;
}

static ast_pool *make_pool(int workers, const char *cpuset)
{
    ast_pool_opts o;
    ast_pool_opts_init(&o);
    o.workers = workers;
    o.cpuset = cpuset;
    ast_pool *p = NULL;
    assert_int_equal(ast_pool_create(&o, &p), 0);
    assert_non_null(p);
    return p;
}

/* Drains until `want` completions were seen, recording each in its tjob (ctx). */
static void drain_n(ast_pool *p, size_t want)
{
    size_t seen = 0;
    while (seen < want) {
        ast_completion c[16];
        size_t n = 0;
        int rc = ast_pool_wait_any(p, 10 * SEC, c, 16, &n);
        assert_int_equal(rc, 0);
        for (size_t i = 0; i < n; i++) {
            tjob *j = c[i].ctx;
            assert_non_null(j);
            j->completions++;
            j->c = c[i];
        }
        seen += n;
    }
    assert_int_equal(seen, want);
}

static void assert_queue_empty(ast_pool *p)
{
    ast_completion c;
    size_t n = 99;
    assert_int_equal(ast_pool_poll(p, &c, 1, &n), 0);
    assert_int_equal(n, 0);
}

static void assert_stats_balance(ast_pool *p)
{
    ast_pool_stats s;
    assert_int_equal(ast_pool_stats_get(p, &s), 0);
    assert_int_equal(s.submitted, s.queued + s.running + s.done + s.superseded + s.cancelled);
    assert_true(s.failed <= s.done);
}

static int64_t mono_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * SEC + ts.tv_nsec;
}

/* Parses a plain "a-b,c" list into a bitmask of cpus < 64; -1 on anything else. */
static long long parse_list(const char *s)
{
    long long m = 0;
    while (*s) {
        char *e;
        long a = strtol(s, &e, 10), b = a;
        if (e == s)
            return -1;
        if (*e == '-') {
            s = e + 1;
            b = strtol(s, &e, 10);
            if (e == s)
                return -1;
        }
        if (a < 0 || b >= 64 || b < a)
            return -1;
        for (long i = a; i <= b; i++)
            m |= 1LL << i;
        s = *e == ',' ? e + 1 : e;
        if (*e && *e != ',')
            return -1;
    }
    return m;
}

/* ---- tests ---------------------------------------------------------------------------------- */

static void test_args(void **state)
{
    (void)state;
    ast_pool_opts o;
    ast_pool_opts_init(&o);
    assert_int_equal(o.workers, 0);
    assert_null(o.cpuset);
    assert_int_equal(o.pin, 1);

    ast_pool *p = (ast_pool *)&o;
    o.workers = -1;
    assert_int_equal(ast_pool_create(&o, &p), AST_EINVAL);
    assert_null(p);
    o.workers = 1;
    o.pin = 2;
    assert_int_equal(ast_pool_create(&o, &p), AST_EINVAL);
    assert_int_equal(ast_pool_create(&o, NULL), AST_EINVAL);

    assert_int_equal(ast_pool_create(NULL, &p), 0);
    ast_pool_stats s;
    assert_int_equal(ast_pool_stats_get(p, &s), 0);
    assert_true(s.workers >= 1);
    assert_int_equal(s.submitted, 0);

    ast_job bad = {.block = 1, .version = 1, .run = NULL};
    uint64_t t;
    assert_int_equal(ast_pool_submit(p, &bad, &t), AST_EINVAL);
    assert_int_equal(ast_pool_submit(p, NULL, &t), AST_EINVAL);
    ast_completion c;
    assert_int_equal(ast_pool_poll(p, &c, 1, NULL), AST_EINVAL);
    assert_int_equal(ast_pool_poll(p, NULL, 1, &(size_t){0}), AST_EINVAL);
    assert_int_equal(ast_pool_wait(p, 1, 0, NULL), AST_EINVAL);
    assert_int_equal(ast_pool_wait_any(p, 0, &c, 0, &(size_t){0}), AST_EINVAL);

    /* A NULL ticket pointer is allowed; the job still completes. */
    ast_job ok = {.block = 1, .version = 1, .run = noop_run};
    assert_int_equal(ast_pool_submit(p, &ok, NULL), 0);
    size_t n = 0;
    assert_int_equal(ast_pool_wait_any(p, 10 * SEC, &c, 1, &n), 0);
    assert_int_equal(n, 1);
    assert_int_equal(c.status, 0);
    assert_int_equal(c.ticket, 1);
    ast_pool_destroy(p);
    ast_pool_destroy(NULL);
}

#define SUBMITTERS 4
#define PER_SUBMITTER 150
#define BLOCKS_PER_SUBMITTER 50

typedef struct submitter {
    ast_pool *pool;
    int idx;
    tjob *jobs;
    int errors;
} submitter;

static void *submitter_main(void *arg)
{
    submitter *s = arg;
    for (int i = 0; i < PER_SUBMITTER; i++) {
        tjob *j = &s->jobs[i];
        j->id = s->idx * PER_SUBMITTER + i;
        j->ret = i % 7 == 3 ? AST_ENOCONV : 0;
        j->sleep_us = i % 5 == 0 ? 200 : 0;
        /* Each block gets versions 1, 2, 3 as the submitter walks its blocks three times. */
        ast_job job = {.block = (uint64_t)(s->idx * 1000 + i % BLOCKS_PER_SUBMITTER),
                       .version = (uint64_t)(i / BLOCKS_PER_SUBMITTER + 1),
                       .deadline = i % 11,
                       .run = tjob_run,
                       .ctx = j};
        uint64_t t = 0;
        if (ast_pool_submit(s->pool, &job, &t) != 0 || t == 0)
            s->errors++;
        j->ticket = t;
    }
    return NULL;
}

static void test_concurrent_submit_drain(void **state)
{
    (void)state;
    ast_pool *p = make_pool(2, NULL);
    static tjob jobs[SUBMITTERS][PER_SUBMITTER];
    memset(jobs, 0, sizeof jobs);
    submitter sub[SUBMITTERS];
    pthread_t th[SUBMITTERS];
    for (int i = 0; i < SUBMITTERS; i++) {
        sub[i] = (submitter){.pool = p, .idx = i, .jobs = jobs[i]};
        assert_int_equal(pthread_create(&th[i], NULL, submitter_main, &sub[i]), 0);
    }
    /* Drain while the submitters are still submitting. */
    drain_n(p, SUBMITTERS * PER_SUBMITTER);
    for (int i = 0; i < SUBMITTERS; i++) {
        assert_int_equal(pthread_join(th[i], NULL), 0);
        assert_int_equal(sub[i].errors, 0);
    }
    assert_queue_empty(p);

    uint64_t ran = 0, failed = 0, superseded = 0;
    static uint8_t seen_ticket[SUBMITTERS * PER_SUBMITTER + 1];
    memset(seen_ticket, 0, sizeof seen_ticket);
    for (int s = 0; s < SUBMITTERS; s++) {
        for (int i = 0; i < PER_SUBMITTER; i++) {
            tjob *j = &jobs[s][i];
            assert_int_equal(j->completions, 1);
            assert_int_equal(j->c.ticket, j->ticket);
            assert_true(j->ticket >= 1 && j->ticket <= SUBMITTERS * PER_SUBMITTER);
            assert_int_equal(seen_ticket[j->ticket], 0);
            seen_ticket[j->ticket] = 1;
            assert_int_equal(j->c.block, (uint64_t)(s * 1000 + i % BLOCKS_PER_SUBMITTER));
            assert_int_equal(j->c.version, (uint64_t)(i / BLOCKS_PER_SUBMITTER + 1));
            assert_true(j->c.queued_ns > 0 && j->c.done_ns >= j->c.queued_ns);
            if (j->ran) {
                ran++;
                assert_int_equal(j->c.status, j->ret);
                failed += j->ret != 0;
                assert_true(j->c.worker == 0 || j->c.worker == 1);
                assert_true(j->c.started_ns >= j->c.queued_ns && j->c.done_ns >= j->c.started_ns);
            } else {
                superseded++;
                assert_int_equal(j->c.status, AST_ESUPERSEDED);
                assert_int_equal(j->c.worker, -1);
                assert_int_equal(j->c.started_ns, 0);
                /* Only an older version can be superseded: the last one always runs. */
                assert_true(i < 2 * BLOCKS_PER_SUBMITTER);
            }
        }
    }
    ast_pool_stats st;
    assert_int_equal(ast_pool_stats_get(p, &st), 0);
    assert_int_equal(st.submitted, SUBMITTERS * PER_SUBMITTER);
    assert_int_equal(st.done, ran);
    assert_int_equal(st.failed, failed);
    assert_int_equal(st.superseded, superseded);
    assert_int_equal(st.cancelled, 0);
    assert_int_equal(st.queued, 0);
    assert_int_equal(st.running, 0);
    assert_int_equal(st.workers, 2);
    assert_true(failed > 0);
    assert_true(st.busy_ns > 0);
    print_message("concurrent: %llu jobs ran, %llu superseded\n", (unsigned long long)ran,
                  (unsigned long long)superseded);
    assert_stats_balance(p);
    ast_pool_destroy(p);
}

static void test_deadline_order(void **state)
{
    (void)state;
    enum { N = 64 };
    ast_pool *p = make_pool(1, NULL);
    static order_log log;
    memset(&log, 0, sizeof log);
    pthread_mutex_init(&log.m, NULL);
    gate g;
    tjob gj = {.id = -1};
    hold_worker(p, &g, &gj, 100000, -1000);

    /* Shuffled deadlines with ties (pairs share one), a fixed seed so a failure reproduces. */
    int64_t dl[N];
    for (int i = 0; i < N; i++)
        dl[i] = i / 2 - 10;
    uint32_t seed = 12345;
    for (int i = N - 1; i > 0; i--) {
        seed = seed * 1103515245u + 12345u;
        int k = (int)((seed >> 8) % (uint32_t)(i + 1));
        int64_t tmp = dl[i];
        dl[i] = dl[k];
        dl[k] = tmp;
    }
    static tjob js[N];
    memset(js, 0, sizeof js);
    for (int i = 0; i < N; i++) {
        js[i].id = i;
        js[i].log = &log;
        submit(p, &js[i], (uint64_t)i, 1, dl[i]);
    }
    ast_pool_stats st;
    assert_int_equal(ast_pool_stats_get(p, &st), 0);
    assert_int_equal(st.queued, N);
    assert_int_equal(st.running, 1);
    assert_int_equal(log.n, 0);

    gate_open(&g);
    drain_n(p, N + 1);
    assert_int_equal(log.n, N);
    for (int k = 1; k < N; k++) {
        int a = log.ids[k - 1], b = log.ids[k];
        int in_order = dl[a] < dl[b] || (dl[a] == dl[b] && js[a].ticket < js[b].ticket);
        if (!in_order)
            fail_msg("run %d: job %d (deadline %lld) ran before job %d (deadline %lld)", k, a,
                     (long long)dl[a], b, (long long)dl[b]);
    }
    /* The order is also visible in the completions' start times. */
    for (int k = 1; k < N; k++)
        assert_true(js[log.ids[k - 1]].c.started_ns <= js[log.ids[k]].c.started_ns);
    assert_stats_balance(p);
    ast_pool_destroy(p);
    pthread_mutex_destroy(&log.m);
    gate_fini(&g);
}

static void test_supersede(void **state)
{
    (void)state;
    ast_pool *p = make_pool(1, NULL);
    gate g;
    tjob gj = {.id = 0};
    uint64_t tg = hold_worker(p, &g, &gj, 9, 0);

    tjob v1 = {.id = 1}, v2 = {.id = 2}, g2 = {.id = 3};
    uint64_t t1 = submit(p, &v1, 7, 1, 5);
    uint64_t t2 = submit(p, &v2, 7, 2, 6);
    /* The superseded completion is published at once, while the worker is still busy. */
    ast_completion c;
    size_t n = 0;
    assert_int_equal(ast_pool_poll(p, &c, 1, &n), 0);
    assert_int_equal(n, 1);
    assert_int_equal(c.ticket, t1);
    assert_int_equal(c.status, AST_ESUPERSEDED);
    assert_int_equal(c.version, 1);
    assert_ptr_equal(c.ctx, &v1);
    assert_int_equal(c.started_ns, 0);
    assert_int_equal(c.worker, -1);

    /* Not newer than the queued version: refused, nothing changes. */
    ast_job same = {.block = 7, .version = 2, .deadline = 0, .run = tjob_run, .ctx = &v1};
    uint64_t tx = 0;
    assert_int_equal(ast_pool_submit(p, &same, &tx), AST_EINVAL);
    same.version = 1;
    assert_int_equal(ast_pool_submit(p, &same, &tx), AST_EINVAL);
    assert_int_equal(tx, 0);

    /* A newer version of the running block is simply queued; the running one is untouched. */
    uint64_t tg2 = submit(p, &g2, 9, 2, 0);
    ast_pool_stats st;
    assert_int_equal(ast_pool_stats_get(p, &st), 0);
    assert_int_equal(st.superseded, 1);
    assert_int_equal(st.queued, 2);
    assert_int_equal(st.running, 1);

    gate_open(&g);
    drain_n(p, 3);
    assert_int_equal(v1.ran, 0);
    assert_int_equal(gj.c.ticket, tg);
    assert_int_equal(gj.c.status, 0);
    assert_int_equal(gj.ran, 1);
    assert_int_equal(v2.c.ticket, t2);
    assert_int_equal(v2.c.status, 0);
    assert_int_equal(v2.ran, 1);
    assert_int_equal(g2.c.ticket, tg2);
    assert_int_equal(g2.ran, 1);
    /* After it ran, a block may be submitted again at any version. */
    tjob v3 = {.id = 4};
    submit(p, &v3, 7, 1, 0);
    drain_n(p, 1);
    assert_int_equal(v3.c.status, 0);
    assert_int_equal(ast_pool_stats_get(p, &st), 0);
    assert_int_equal(st.superseded, 1);
    assert_int_equal(st.done, 4);
    assert_stats_balance(p);
    ast_pool_destroy(p);
    gate_fini(&g);
}

static void test_cancel(void **state)
{
    (void)state;
    ast_pool *p = make_pool(1, NULL);
    gate g;
    tjob gj = {.id = 0}, q = {.id = 1}, r = {.id = 2};
    uint64_t tg = hold_worker(p, &g, &gj, 1, 0);
    uint64_t tq = submit(p, &q, 2, 1, 0);
    uint64_t tr = submit(p, &r, 3, 1, 1);

    assert_int_equal(ast_pool_cancel(p, tg), AST_EBUSY);
    assert_int_equal(ast_pool_cancel(p, tq), 0);
    /* Cancelled is finished: a second cancel finds nothing to cancel. */
    assert_int_equal(ast_pool_cancel(p, tq), AST_ENOENT);
    assert_int_equal(ast_pool_cancel(p, 987654), AST_ENOENT);

    ast_completion c;
    assert_int_equal(ast_pool_wait(p, tq, 0, &c), 0);
    assert_int_equal(c.status, AST_ECANCELED);
    assert_ptr_equal(c.ctx, &q);
    assert_int_equal(c.worker, -1);
    assert_int_equal(c.started_ns, 0);
    assert_int_equal(ast_pool_cancel(p, tq), AST_ENOENT);

    /* A cancelled job frees its block: the same version may be queued again. */
    tjob q2 = {.id = 3};
    submit(p, &q2, 2, 1, 0);

    gate_open(&g);
    assert_int_equal(ast_pool_wait(p, tg, 10 * SEC, &c), 0);
    assert_int_equal(c.status, 0);
    assert_int_equal(ast_pool_cancel(p, tg), AST_ENOENT);
    assert_int_equal(ast_pool_wait(p, tr, 10 * SEC, &c), 0);
    drain_n(p, 1);
    assert_int_equal(q2.c.status, 0);
    assert_int_equal(q.ran, 0);
    assert_int_equal(r.ran, 1);

    ast_pool_stats st;
    assert_int_equal(ast_pool_stats_get(p, &st), 0);
    assert_int_equal(st.cancelled, 1);
    assert_int_equal(st.done, 3);
    assert_stats_balance(p);
    ast_pool_destroy(p);
    gate_fini(&g);
}

static void test_cancel_done_undrained(void **state)
{
    (void)state;
    ast_pool *p = make_pool(1, NULL);
    tjob a = {.id = 0};
    uint64_t ta = submit(p, &a, 1, 1, 0);
    ast_pool_stats st;
    do {
        assert_int_equal(ast_pool_stats_get(p, &st), 0);
        sched_yield();
    } while (st.done < 1);
    assert_int_equal(ast_pool_cancel(p, ta), AST_ENOENT);
    drain_n(p, 1);
    assert_int_equal(a.c.status, 0);
    ast_pool_destroy(p);
}

static void test_wait_specific(void **state)
{
    (void)state;
    ast_pool *p = make_pool(1, NULL);
    gate g;
    tjob gj = {.id = 0}, a = {.id = 1}, b = {.id = 2}, c3 = {.id = 3}, t = {.id = 4},
         d = {.id = 5, .sleep_us = 1000};
    hold_worker(p, &g, &gj, 0, 0);
    uint64_t ta = submit(p, &a, 1, 1, 1);
    submit(p, &b, 2, 1, 1);
    submit(p, &c3, 3, 1, 1);
    uint64_t tt = submit(p, &t, 4, 1, 2);
    submit(p, &d, 5, 1, 3);
    gate_open(&g);

    /* gate, a, b and c complete before t (deadline order): they sit in the done-queue while we
     * wait for t, and must still be there afterwards. */
    ast_completion c;
    assert_int_equal(ast_pool_wait(p, tt, 10 * SEC, &c), 0);
    assert_int_equal(c.ticket, tt);
    assert_ptr_equal(c.ctx, &t);
    assert_int_equal(c.status, 0);
    assert_int_equal(ast_pool_wait(p, tt, 0, &c), AST_ENOENT);
    assert_int_equal(ast_pool_wait(p, ta, 0, &c), 0);
    assert_ptr_equal(c.ctx, &a);
    drain_n(p, 4);
    assert_int_equal(gj.completions, 1);
    assert_int_equal(b.completions, 1);
    assert_int_equal(c3.completions, 1);
    assert_int_equal(d.completions, 1);
    assert_int_equal(t.completions, 0);
    assert_int_equal(a.completions, 0);
    assert_queue_empty(p);
    ast_pool_destroy(p);
    gate_fini(&g);
}

typedef struct waiter {
    ast_pool *pool;
    uint64_t ticket;
    int rc;
    ast_completion c;
} waiter;

static void *waiter_main(void *arg)
{
    waiter *w = arg;
    w->rc = ast_pool_wait(w->pool, w->ticket, 10 * SEC, &w->c);
    return NULL;
}

/* Several threads each wait for their own ticket at once; each gets exactly its own. */
static void test_wait_many_waiters(void **state)
{
    (void)state;
    enum { W = 6 };
    ast_pool *p = make_pool(2, NULL);
    gate g;
    gate_init(&g);
    tjob js[W];
    waiter ws[W];
    pthread_t th[W];
    memset(js, 0, sizeof js);
    for (int i = 0; i < W; i++) {
        js[i].id = i;
        js[i].gate = i == 0 ? &g : NULL;
        ws[i] = (waiter){.pool = p, .ticket = submit(p, &js[i], (uint64_t)i, 1, W - i)};
        assert_int_equal(pthread_create(&th[i], NULL, waiter_main, &ws[i]), 0);
    }
    gate_open(&g);
    for (int i = 0; i < W; i++) {
        assert_int_equal(pthread_join(th[i], NULL), 0);
        assert_int_equal(ws[i].rc, 0);
        assert_int_equal(ws[i].c.ticket, ws[i].ticket);
        assert_ptr_equal(ws[i].c.ctx, &js[i]);
    }
    assert_queue_empty(p);
    ast_pool_destroy(p);
    gate_fini(&g);
}

static void test_wait_timeout(void **state)
{
    (void)state;
    ast_pool *p = make_pool(1, NULL);
    gate g;
    tjob gj = {.id = 0};
    uint64_t tg = hold_worker(p, &g, &gj, 0, 0);

    ast_completion c;
    int64_t t0 = mono_ns();
    assert_int_equal(ast_pool_wait(p, tg, 50 * 1000000LL, &c), AST_ETIMEDOUT);
    int64_t dt = mono_ns() - t0;
    assert_true(dt >= 50 * 1000000LL);
    assert_true(dt < 5 * SEC);
    assert_int_equal(ast_pool_wait(p, tg, 0, &c), AST_ETIMEDOUT);

    size_t n = 7;
    t0 = mono_ns();
    assert_int_equal(ast_pool_wait_any(p, 30 * 1000000LL, &c, 1, &n), AST_ETIMEDOUT);
    assert_int_equal(n, 0);
    assert_true(mono_ns() - t0 >= 30 * 1000000LL);
    assert_int_equal(ast_pool_wait_any(p, 0, &c, 1, &n), AST_ETIMEDOUT);
    assert_int_equal(ast_pool_wait(p, 424242, -1, &c), AST_ENOENT);

    gate_open(&g);
    assert_int_equal(ast_pool_wait(p, tg, -1, &c), 0);
    assert_int_equal(c.status, 0);
    assert_int_equal(c.worker, 0);
    ast_pool_destroy(p);
    gate_fini(&g);
}

typedef struct releaser {
    gate *g;
    long delay_ms;
} releaser;

static void *releaser_main(void *arg)
{
    releaser *r = arg;
    struct timespec ts = {.tv_sec = r->delay_ms / 1000, .tv_nsec = (r->delay_ms % 1000) * 1000000L};
    nanosleep(&ts, NULL);
    gate_open(r->g);
    return NULL;
}

static void test_shutdown_in_flight(void **state)
{
    (void)state;
    enum { Q = 20 };
    ast_pool *p = make_pool(2, NULL);
    gate g;
    gate_init(&g);
    tjob run0 = {.id = 0, .gate = &g, .resubmit = p, .sleep_us = 20000};
    tjob run1 = {.id = 1, .gate = &g, .resubmit = p, .sleep_us = 20000};
    submit(p, &run0, 0, 1, 0);
    submit(p, &run1, 1, 1, 0);
    gate_wait_entered(&g, 2);
    tjob queued[Q];
    memset(queued, 0, sizeof queued);
    for (int i = 0; i < Q; i++)
        submit(p, &queued[i], (uint64_t)(10 + i), 1, 5);

    /* The gate opens while destroy is already waiting for the running jobs: they must finish
     * (their late submit is refused), the queued ones must never start. */
    releaser rel = {.g = &g, .delay_ms = 200};
    pthread_t th;
    assert_int_equal(pthread_create(&th, NULL, releaser_main, &rel), 0);
    ast_pool_destroy(p);
    assert_int_equal(pthread_join(th, NULL), 0);

    assert_int_equal(run0.finished, 1);
    assert_int_equal(run1.finished, 1);
    assert_int_equal(run0.inner_rc, AST_ESHUTDOWN);
    assert_int_equal(run1.inner_rc, AST_ESHUTDOWN);
    for (int i = 0; i < Q; i++)
        assert_int_equal(queued[i].ran, 0);
    gate_fini(&g);
}

/* Completions left in the done-queue are freed by destroy (ASan checks the leak). */
static void test_destroy_undrained(void **state)
{
    (void)state;
    ast_pool *p = make_pool(2, NULL);
    tjob js[10];
    memset(js, 0, sizeof js);
    for (int i = 0; i < 10; i++)
        submit(p, &js[i], (uint64_t)i, 1, 0);
    ast_pool_stats st;
    do {
        assert_int_equal(ast_pool_stats_get(p, &st), 0);
        sched_yield();
    } while (st.done < 10);
    ast_pool_destroy(p);
    for (int i = 0; i < 10; i++)
        assert_int_equal(js[i].ran, 1);
}

/* The child's checks, reported through the exit status (no CMocka in the child). The jobs in
 * flight at the fork (one running, one queued) are the child's work too: they run again in the
 * child, on the child's own workers, and complete with status 0 as in the parent. */
static int fork_child(ast_pool *p, gate *g, tjob *done_j, tjob *run_j, tjob *queued_j,
                      uint64_t tr, uint64_t tq)
{
    ast_completion c[8];
    size_t n = 0;
    ast_pool_stats st;
    if (ast_pool_stats_get(p, &st) || st.queued != 2 || st.running != 0 || st.done != 1 ||
        st.failed != 0 || st.submitted != 3)
        return 10;
    if (UNDER_TSAN) {
        /* TSan cannot start threads in the child of a multi-threaded process (it aborts it:
         * die_after_fork), so the re-run half of this test cannot run under it. */
        return 0;
    }
    /* The gate as the child sees it: its waiter is a thread that does not exist here. Opened
     * before the poll below starts the child's workers. */
    gate_init(g);
    g->open = 1;
    run_j->ran = 0;
    if (ast_pool_poll(p, c, 8, &n) || n != 1 || c[0].ctx != done_j || c[0].status != 0)
        return 11;
    ast_completion cr, cq;
    if (ast_pool_wait(p, tr, 10 * SEC, &cr) || cr.status != 0 || cr.ctx != run_j ||
        !run_j->ran || !run_j->finished || run_j->pid != getpid() || cr.started_ns == 0 ||
        cr.worker < 0)
        return 12;
    if (ast_pool_wait(p, tq, 10 * SEC, &cq) || cq.status != 0 || cq.ctx != queued_j ||
        !queued_j->ran || queued_j->pid != getpid())
        return 13;
    if (ast_pool_stats_get(p, &st) || st.queued != 0 || st.running != 0 || st.done != 3 ||
        st.failed != 0)
        return 14;
    tjob j = {.id = 7};
    ast_job job = {.block = 1, .version = 1, .deadline = 0, .run = tjob_run, .ctx = &j};
    uint64_t t;
    if (ast_pool_submit(p, &job, &t))
        return 15;
    ast_completion cj;
    if (ast_pool_wait(p, t, 10 * SEC, &cj) || cj.status != 0 || cj.ctx != &j || !j.ran ||
        j.pid != getpid() || cj.worker < 0)
        return 16;
    ast_pool_destroy(p);
    return 0;
}

static void test_fork(void **state)
{
    (void)state;
    if (UNDER_TSAN)
        print_message("test_fork: under ThreadSanitizer the child only checks how in-flight jobs "
                      "were kept; restarting workers in a forked child is not supported by TSan\n");
    ast_pool *p = make_pool(1, NULL);
    gate g;
    gate_init(&g);
    tjob dj = {.id = 0}, rj = {.id = 1, .gate = &g}, qj = {.id = 2};
    uint64_t td = submit(p, &dj, 0, 1, 0);
    ast_pool_stats st;
    do {
        assert_int_equal(ast_pool_stats_get(p, &st), 0);
        sched_yield();
    } while (st.done < 1);
    uint64_t tr = submit(p, &rj, 1, 1, 0);
    gate_wait_entered(&g, 1);
    uint64_t tq = submit(p, &qj, 2, 1, 0);

    fflush(NULL);
    pid_t pid = fork();
    assert_true(pid >= 0);
    if (pid == 0)
        _exit(fork_child(p, &g, &dj, &rj, &qj, tr, tq));

    /* The parent is unaffected: its running and queued jobs complete normally. */
    gate_open(&g);
    ast_completion c;
    assert_int_equal(ast_pool_wait(p, tr, 10 * SEC, &c), 0);
    assert_int_equal(c.status, 0);
    assert_int_equal(rj.pid, getpid());
    assert_int_equal(ast_pool_wait(p, tq, 10 * SEC, &c), 0);
    assert_int_equal(c.status, 0);
    assert_int_equal(qj.ran, 1);
    assert_int_equal(ast_pool_wait(p, td, 0, &c), 0);
    assert_int_equal(c.status, 0);

    int wst = 0;
    assert_int_equal(waitpid(pid, &wst, 0), pid);
    assert_true(WIFEXITED(wst));
    if (WEXITSTATUS(wst) != 0)
        fail_msg("fork child failed its check %d", WEXITSTATUS(wst));

    /* And the parent keeps working after the fork. */
    tjob after = {.id = 3};
    uint64_t ta = submit(p, &after, 3, 1, 0);
    assert_int_equal(ast_pool_wait(p, ta, 10 * SEC, &c), 0);
    assert_int_equal(c.status, 0);
    assert_int_equal(after.pid, getpid());
    ast_pool_destroy(p);
    gate_fini(&g);
}

static void test_cpuset_invalid(void **state)
{
    (void)state;
    const char *bad[] = {"", "abc", "0-", "3-1", "0x3", "1,,2", "-1", " 0", "0 ", "2a", "0,",
                         "99999", "4000000000"};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        ast_pool_opts o;
        ast_pool_opts_init(&o);
        o.cpuset = bad[i];
        ast_pool *p = NULL;
        int rc = ast_pool_create(&o, &p);
        if (rc != AST_EINVAL)
            fail_msg("cpuset \"%s\": expected AST_EINVAL, got %s", bad[i], ast_err_name(rc));
        assert_null(p);
    }
}

/* Runs n jobs and returns the mask of the cpus they ran on. */
static long long cpus_used(ast_pool *p, int n)
{
    tjob js[8];
    memset(js, 0, sizeof js);
    for (int i = 0; i < n; i++) {
        js[i].sleep_us = 2000;
        submit(p, &js[i], (uint64_t)(5000 + i), 1, 0);
    }
    drain_n(p, (size_t)n);
    long long m = 0;
    for (int i = 0; i < n; i++) {
        assert_true(js[i].cpu >= 0 && js[i].cpu < 64);
        m |= 1LL << js[i].cpu;
    }
    return m;
}

static void test_cpuset_explicit(void **state)
{
    (void)state;
    char buf[128];
    ast_pool *p = make_pool(2, "0");
    ast_pool_stats st;
    assert_int_equal(ast_pool_stats_get(p, &st), 0);
    assert_int_equal(st.workers, 2);
    assert_int_equal(ast_pool_cpuset(p, buf, sizeof buf), 0);
    if (ASTERIA_HAVE_HWLOC) {
        assert_string_equal(buf, "0");
        assert_int_equal(cpus_used(p, 6), 1LL);
    } else {
        assert_string_equal(buf, "unpinned (built without hwloc)");
    }
    char tiny[1];
    assert_int_equal(ast_pool_cpuset(p, tiny, sizeof tiny), AST_EINVAL);
    ast_pool_destroy(p);

    /* workers = 0: one per core of the set. */
    p = make_pool(0, "0");
    assert_int_equal(ast_pool_stats_get(p, &st), 0);
    assert_int_equal(st.workers, 1);
    ast_pool_destroy(p);

    ast_pool_opts o;
    ast_pool_opts_init(&o);
    o.workers = 1;
    o.pin = 0;
    assert_int_equal(ast_pool_create(&o, &p), 0);
    assert_int_equal(ast_pool_cpuset(p, buf, sizeof buf), 0);
    assert_string_equal(buf, ASTERIA_HAVE_HWLOC ? "unpinned (pin=0)" : "unpinned (built without hwloc)");
    ast_pool_destroy(p);

    long ncpu = sysconf(_SC_NPROCESSORS_ONLN);
    if (ASTERIA_HAVE_HWLOC && ncpu >= 2) {
        p = make_pool(0, "0-1");
        assert_int_equal(ast_pool_stats_get(p, &st), 0);
        assert_int_equal(st.workers, 2);
        assert_int_equal(ast_pool_cpuset(p, buf, sizeof buf), 0);
        assert_string_equal(buf, "0-1");
        ast_pool_destroy(p);
        p = make_pool(3, "1");
        assert_int_equal(cpus_used(p, 4), 1LL << 1);
        ast_pool_destroy(p);
    }
}

typedef struct pinned_creator {
    int cpu;
    int seen_cpu;
    int rc;
    ast_pool *pool;
} pinned_creator;

static void *pinned_creator_main(void *arg)
{
    pinned_creator *pc = arg;
    sched_yield();
    pc->seen_cpu = sched_getcpu();
    ast_pool_opts o;
    ast_pool_opts_init(&o);
    pc->rc = ast_pool_create(&o, &pc->pool);
    return NULL;
}

/* The caller is a thread pinned to one known core (so "where the caller runs" is not a guess);
 * the rest of the process keeps its mask, which is the set the default is taken from. */
static void test_cpuset_default(void **state)
{
    (void)state;
    if (!ASTERIA_HAVE_HWLOC) {
        print_message("test_cpuset_default: built without hwloc, no pinning to check\n");
        return;
    }
    cpu_set_t mask, one;
    assert_int_equal(pthread_getaffinity_np(pthread_self(), sizeof mask, &mask), 0);
    int ncpu = CPU_COUNT(&mask);
    int last = -1;
    for (int i = 0; i < CPU_SETSIZE && i < 64; i++)
        if (CPU_ISSET(i, &mask))
            last = i;
    assert_true(last >= 0);
    CPU_ZERO(&one);
    CPU_SET(last, &one);
    pthread_attr_t attr;
    assert_int_equal(pthread_attr_init(&attr), 0);
    assert_int_equal(pthread_attr_setaffinity_np(&attr, sizeof one, &one), 0);
    pinned_creator pc = {.cpu = last, .seen_cpu = -1};
    pthread_t th;
    assert_int_equal(pthread_create(&th, &attr, pinned_creator_main, &pc), 0);
    assert_int_equal(pthread_join(th, NULL), 0);
    pthread_attr_destroy(&attr);
    assert_int_equal(pc.seen_cpu, last);
    assert_int_equal(pc.rc, 0);
    ast_pool *p = pc.pool;

    char buf[256];
    assert_int_equal(ast_pool_cpuset(p, buf, sizeof buf), 0);
    long long m = parse_list(buf);
    if (m < 0)
        fail_msg("default cpuset \"%s\" is not a plain list", buf);
    ast_pool_stats st;
    assert_int_equal(ast_pool_stats_get(p, &st), 0);
    print_message("test_cpuset_default: caller on core %d of %d, workers on \"%s\"\n", last, ncpu,
                  buf);
    if (ncpu > 1) {
        if (m & (1LL << last))
            fail_msg("default cpuset \"%s\" contains the caller's core %d", buf, last);
        assert_true(m != 0);
        long long outside = 0;
        for (int i = 0; i < 64; i++)
            if ((m >> i & 1) && !CPU_ISSET(i, &mask))
                outside |= 1LL << i;
        assert_int_equal(outside, 0);
        assert_int_equal(st.workers, __builtin_popcountll((unsigned long long)m));
        assert_true(st.workers <= ncpu - 1);
        assert_int_equal(cpus_used(p, 4) & ~m, 0);
    } else {
        /* One core only: the default falls back to it rather than to nothing. */
        assert_int_equal(m, 1LL << last);
        assert_int_equal(st.workers, 1);
    }
    ast_pool_destroy(p);
}

static void test_stats(void **state)
{
    (void)state;
    enum { N = 40 };
    ast_pool *p = make_pool(2, NULL);
    gate g;
    tjob gj = {.id = -1};
    hold_worker(p, &g, &gj, 1000, 0);
    ast_pool_stats st;
    assert_int_equal(ast_pool_stats_get(p, &st), 0);
    assert_int_equal(st.running, 1);
    assert_int_equal(st.queued, 0);

    int64_t t0 = mono_ns();
    static tjob js[N];
    memset(js, 0, sizeof js);
    uint64_t tk[N];
    for (int i = 0; i < N; i++) {
        js[i].sleep_us = 2000;
        js[i].ret = i % 4 == 0 ? AST_ENONFINITE : 0;
        tk[i] = submit(p, &js[i], (uint64_t)i, 1, 1);
    }
    int cancelled = 0;
    for (int i = N - 5; i < N; i++)
        cancelled += ast_pool_cancel(p, tk[i]) == 0;
    assert_true(cancelled >= 1);
    tjob sup = {.id = 77};
    submit(p, &sup, 0, 2, 1); /* supersedes block 0 only if it is still queued */
    gate_open(&g);
    drain_n(p, N + 2);
    int64_t wall = mono_ns() - t0;

    uint64_t ran = 0, failed = 0, superseded = 0, ncancelled = 0, slept = 0;
    for (int i = 0; i < N; i++) {
        ran += js[i].ran;
        slept += js[i].ran * 2000000ull;
        failed += js[i].ran && js[i].ret;
        superseded += js[i].c.status == AST_ESUPERSEDED;
        ncancelled += js[i].c.status == AST_ECANCELED;
    }
    ran += gj.ran + sup.ran;
    assert_int_equal(ast_pool_stats_get(p, &st), 0);
    assert_int_equal(st.submitted, N + 2);
    assert_int_equal(st.done, ran);
    assert_int_equal(st.failed, failed);
    assert_int_equal(st.cancelled, (uint64_t)cancelled);
    assert_int_equal(st.cancelled, ncancelled);
    assert_int_equal(st.superseded, superseded);
    assert_int_equal(st.queued, 0);
    assert_int_equal(st.running, 0);
    assert_stats_balance(p);
    /* busy time: at least the sleeps of the jobs that ran, at most workers * wall time. */
    assert_true(st.busy_ns >= slept);
    assert_true(st.busy_ns <= (uint64_t)(2 * (wall + mono_ns() - t0)));
    ast_pool_destroy(p);
    gate_fini(&g);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_args),
        cmocka_unit_test(test_concurrent_submit_drain),
        cmocka_unit_test(test_deadline_order),
        cmocka_unit_test(test_supersede),
        cmocka_unit_test(test_cancel),
        cmocka_unit_test(test_cancel_done_undrained),
        cmocka_unit_test(test_wait_specific),
        cmocka_unit_test(test_wait_many_waiters),
        cmocka_unit_test(test_wait_timeout),
        cmocka_unit_test(test_shutdown_in_flight),
        cmocka_unit_test(test_destroy_undrained),
        cmocka_unit_test(test_fork),
        cmocka_unit_test(test_cpuset_invalid),
        cmocka_unit_test(test_cpuset_explicit),
        cmocka_unit_test(test_cpuset_default),
        cmocka_unit_test(test_stats),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
