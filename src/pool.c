/*
 * pool.c - the worker pool that runs REFRESH jobs off the training thread (asteria/pool.h).
 *
 * Owns: per pool, N worker pthreads (pinned with hwloc when built with it), a deadline-ordered
 * binary heap of queued jobs, two hash tables (util.h: ticket -> job record for every job whose
 * completion has not been drained yet; block -> its queued job), the done-queue, the stats.
 * Process-wide: the registry of live pools that the fork handlers walk.
 * May call: errors.h, util.h, hwloc, pthreads, libc. Never calls back into the runtime.
 *
 * Cores: see core_set() for the default set. Worker i binds itself (inside the thread, hwloc
 * HWLOC_CPUBIND_THREAD) to the i-th core of the set, round robin. ast_pool_cpuset reports the
 * cores workers are bound to as an hwloc list, or "unpinned (<why>)" when none is (pin=0, built
 * without hwloc, binding unsupported or refused). Workers run with all signals blocked.
 * Stats: submitted counts accepted jobs; queued and running are current counts; done counts
 * jobs that ran to the end, failed those of them whose status is not 0; superseded and
 * cancelled the rest. So while the pool lives,
 * submitted == queued + running + done + superseded + cancelled.
 *
 * Lock discipline
 *  - registry_mtx (the one global, with its list head `registry` and `atfork_once`) guards the
 *    list of live pools and nothing else. Held only to link a pool (end of ast_pool_create,
 *    once its workers run), to unlink it (start of ast_pool_destroy, before it shuts down) and
 *    by the fork handlers. Nobody takes it while holding a pool mutex.
 *  - pool->mtx guards everything mutable in a pool: the heap, both hash tables, every job
 *    record's state / status / timestamps / worker, the done-queue, the ticket counter, the
 *    stats, stopping / need_start / nstarted / ndone_waiters, and per worker current, alive,
 *    started, bound_pu. Immutable after create (read without the lock): nworkers, pin, each
 *    worker's plan_pu, unpinned_why, the hwloc topology.
 *  - Lock order: registry_mtx, then pool mutexes in registry order. Only the prepare handler
 *    holds more than one lock; every other path holds at most one.
 *  - pool->work_cv (with pool->mtx): workers wait for "heap non-empty or stopping".
 *    pool->done_cv (with pool->mtx): owners wait for "done-queue changed" (ast_pool_wait,
 *    ast_pool_wait_any), and ast_pool_create waits for its workers to report in. A completion
 *    is published with one broadcast, and only when someone waits (ndone_waiters); waiters for
 *    different tickets share the variable, so it must be a broadcast.
 *  - Runs with no lock held: job->run() (which may call ast_pool_submit), the hwloc binding
 *    call, pthread_join, the hwloc topology load, the malloc of a new job record.
 *
 * Fork (pthread_atfork, installed once): prepare takes registry_mtx then every pool's mutex, so
 * no pool is mid-update when the address space is copied; the parent handler releases them.
 * The child handler, for every live pool, re-initialises its mutex and condition
 * variables (their owners/waiters do not exist in the child), then keeps every job that was in
 * flight at fork time, so that the child computes the same results the parent does (a job's
 * ctx, its inputs included, is copied with the address space):
 *  - queued jobs stay queued.
 *  - running jobs go back to the queue (state QUEUED, started_ns 0, worker -1) and run again
 *    from the start in the child: run() must therefore not depend on a previous, partial run
 *    of itself (the runtime's jobs read their inputs and write their outputs only). Such a job
 *    is not in queued_blocks (in_blocks 0): in the parent it could no longer be superseded,
 *    and the child keeps that. The heap always has room for every queued and running job
 *    (submit reserves it), so the handler does not allocate.
 *  - completions already in the done-queue are kept; the child drains them as usual.
 *  - worker threads do not exist in the child; they are restarted (and pinned again) by the
 *    child's first submit, or by its first poll or wait while jobs are queued, so a child that
 *    never uses the pool (a data-loader process) never starts threads. The registry mutex is
 *    re-initialised last.
 * A job's run() must not fork: in the child, a worker-turned-main thread would have no pool
 * state to return to.
 */
#include "asteria/pool.h"

#include "asteria/build_config.h"
#include "asteria/errors.h"
#include "util.h"

#include <errno.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#if ASTERIA_HAVE_HWLOC
#include <hwloc.h>
#endif

#define POOL_MAX_WORKERS 4096
#define CPU_INDEX_MAX (1L << 20)

/* ---- the pool --------------------------------------------------------------------------- */

enum rec_state { REC_QUEUED, REC_RUNNING, REC_DONE };

/* One submitted job, alive from submit until its completion is drained (or the pool dies). */
typedef struct rec {
    ast__hnode by_ticket; /* in pool->tickets while alive */
    ast__hnode by_block;  /* in pool->queued_blocks while REC_QUEUED */
    ast_job job;
    uint64_t ticket;
    enum rec_state state;
    int in_blocks;   /* by_block is linked in pool->queued_blocks */
    size_t heap_idx;
    int status, worker;
    uint64_t queued_ns, started_ns, done_ns;
    struct rec *dprev, *dnext; /* done-queue links while REC_DONE */
} rec;

typedef struct worker {
    ast_pool *pool;
    pthread_t tid;
    int idx;
    int plan_pu;  /* OS index of the core this worker binds to, -1: no binding */
    int bound_pu; /* the core it is bound to, -1 if none */
    int alive;    /* a joinable thread exists */
    int started;  /* it reported in (after its binding attempt) */
    rec *current;
} worker;

struct ast_pool {
    pthread_mutex_t mtx;
    pthread_cond_t work_cv, done_cv;

    rec **heap;
    size_t nheap, capheap;
    ast__htable tickets, queued_blocks;
    rec *done_head, *done_tail;
    uint64_t next_ticket;
    int ndone_waiters;
    int nstarted;
    int stopping;
    int need_start; /* forked child: workers are restarted by the next submit */
    ast_pool_stats st;

    int nworkers, pin;
    worker *w;
    const char *unpinned_why; /* shown by ast_pool_cpuset when no worker is bound */
#if ASTERIA_HAVE_HWLOC
    hwloc_topology_t topo;
#endif

    ast_pool *reg_prev, *reg_next;
};

static pthread_mutex_t registry_mtx = PTHREAD_MUTEX_INITIALIZER;
static ast_pool *registry;
static pthread_once_t atfork_once = PTHREAD_ONCE_INIT;


static int init_sync(ast_pool *p)
{
    pthread_condattr_t ca;
    if (pthread_condattr_init(&ca))
        return AST_ENOMEM;
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    int rc = pthread_mutex_init(&p->mtx, NULL);
    if (!rc) {
        rc = pthread_cond_init(&p->work_cv, &ca);
        if (!rc) {
            rc = pthread_cond_init(&p->done_cv, &ca);
            if (rc)
                pthread_cond_destroy(&p->work_cv);
        }
        if (rc)
            pthread_mutex_destroy(&p->mtx);
    }
    pthread_condattr_destroy(&ca);
    return rc ? ast_err_from_errno(rc) : 0;
}

/* ---- heap: smallest (deadline, ticket) on top ------------------------------------------- */

static int rec_before(const rec *a, const rec *b)
{
    if (a->job.deadline != b->job.deadline)
        return a->job.deadline < b->job.deadline;
    return a->ticket < b->ticket;
}

static void heap_set(ast_pool *p, size_t i, rec *r)
{
    p->heap[i] = r;
    r->heap_idx = i;
}

static void heap_sift_up(ast_pool *p, size_t i)
{
    rec *r = p->heap[i];
    while (i > 0) {
        size_t up = (i - 1) / 2;
        if (!rec_before(r, p->heap[up]))
            break;
        heap_set(p, i, p->heap[up]);
        i = up;
    }
    heap_set(p, i, r);
}

static void heap_sift_down(ast_pool *p, size_t i)
{
    rec *r = p->heap[i];
    for (;;) {
        size_t c = 2 * i + 1;
        if (c >= p->nheap)
            break;
        if (c + 1 < p->nheap && rec_before(p->heap[c + 1], p->heap[c]))
            c++;
        if (!rec_before(p->heap[c], r))
            break;
        heap_set(p, i, p->heap[c]);
        i = c;
    }
    heap_set(p, i, r);
}

static int heap_reserve(ast_pool *p, size_t want)
{
    if (want <= p->capheap)
        return 0;
    size_t cap = p->capheap ? p->capheap * 2 : 64;
    while (cap < want)
        cap *= 2;
    rec **h = realloc(p->heap, cap * sizeof *h);
    if (!h)
        return AST_ENOMEM;
    p->heap = h;
    p->capheap = cap;
    return 0;
}

static void heap_push(ast_pool *p, rec *r)
{
    heap_set(p, p->nheap++, r);
    heap_sift_up(p, r->heap_idx);
}

static void heap_remove(ast_pool *p, rec *r)
{
    size_t i = r->heap_idx;
    rec *last = p->heap[--p->nheap];
    if (last == r)
        return;
    heap_set(p, i, last);
    if (i > 0 && rec_before(last, p->heap[(i - 1) / 2]))
        heap_sift_up(p, i);
    else
        heap_sift_down(p, i);
}

/* ---- job life cycle (all with pool->mtx held) ------------------------------------------- */

static void done_push(ast_pool *p, rec *r)
{
    r->state = REC_DONE;
    r->dnext = NULL;
    r->dprev = p->done_tail;
    if (p->done_tail)
        p->done_tail->dnext = r;
    else
        p->done_head = r;
    p->done_tail = r;
}

static void done_unlink(ast_pool *p, rec *r)
{
    if (r->dprev)
        r->dprev->dnext = r->dnext;
    else
        p->done_head = r->dnext;
    if (r->dnext)
        r->dnext->dprev = r->dprev;
    else
        p->done_tail = r->dprev;
}

static void wake_owners(ast_pool *p)
{
    if (p->ndone_waiters)
        pthread_cond_broadcast(&p->done_cv);
}

static void unlink_block(ast_pool *p, rec *r)
{
    if (r->in_blocks)
        ast__htable_remove(&p->queued_blocks, &r->by_block);
    r->in_blocks = 0;
}

/* A queued job leaves the queue without running: superseded, cancelled or dropped. */
static void settle_queued(ast_pool *p, rec *r, int status, uint64_t t)
{
    heap_remove(p, r);
    unlink_block(p, r);
    p->st.queued--;
    r->status = status;
    r->done_ns = t;
    done_push(p, r);
}

/* Takes the completion of r out of the pool and frees the record. */
static void drain_rec(ast_pool *p, rec *r, ast_completion *out)
{
    done_unlink(p, r);
    ast__htable_remove(&p->tickets, &r->by_ticket);
    *out = (ast_completion){
        .ticket = r->ticket,
        .block = r->job.block,
        .version = r->job.version,
        .deadline = r->job.deadline,
        .status = r->status,
        .ctx = r->job.ctx,
        .queued_ns = r->queued_ns,
        .started_ns = r->started_ns,
        .done_ns = r->done_ns,
        .worker = r->worker,
    };
    free(r);
}

static size_t drain_some(ast_pool *p, ast_completion *out, size_t cap)
{
    size_t n = 0;
    while (n < cap && p->done_head) {
        drain_rec(p, p->done_head, &out[n]);
        n++;
    }
    return n;
}

/* ---- workers ---------------------------------------------------------------------------- */

static void bind_self(worker *w, int *bound)
{
    *bound = -1;
#if ASTERIA_HAVE_HWLOC
    ast_pool *p = w->pool;
    if (w->plan_pu < 0)
        return;
    hwloc_bitmap_t set = hwloc_bitmap_alloc();
    if (!set)
        return;
    hwloc_bitmap_only(set, (unsigned)w->plan_pu);
    if (hwloc_set_cpubind(p->topo, set, HWLOC_CPUBIND_THREAD) == 0)
        *bound = w->plan_pu;
    hwloc_bitmap_free(set);
#endif
}

static void *worker_main(void *arg)
{
    worker *w = arg;
    ast_pool *p = w->pool;
    char name[32];
    snprintf(name, sizeof name, "ast-pool-%d", w->idx);
    name[15] = '\0'; /* the kernel's limit for a thread name */
    pthread_setname_np(pthread_self(), name);
    int bound;
    bind_self(w, &bound);

    pthread_mutex_lock(&p->mtx);
    w->bound_pu = bound;
    w->started = 1;
    p->nstarted++;
    pthread_cond_broadcast(&p->done_cv);
    for (;;) {
        while (!p->nheap && !p->stopping)
            pthread_cond_wait(&p->work_cv, &p->mtx);
        if (!p->nheap)
            break; /* stopping: the queue was emptied by destroy, nothing more will come */
        rec *r = p->heap[0];
        heap_remove(p, r);
        unlink_block(p, r);
        r->state = REC_RUNNING;
        r->worker = w->idx;
        r->started_ns = ast__now_ns();
        w->current = r;
        p->st.queued--;
        p->st.running++;
        pthread_mutex_unlock(&p->mtx);

        int status = r->job.run(r->job.ctx);
        uint64_t t = ast__now_ns();

        pthread_mutex_lock(&p->mtx);
        w->current = NULL;
        r->status = status;
        r->done_ns = t;
        p->st.running--;
        p->st.done++;
        if (status != 0)
            p->st.failed++;
        p->st.busy_ns += t - r->started_ns;
        done_push(p, r);
        wake_owners(p);
    }
    pthread_mutex_unlock(&p->mtx);
    return NULL;
}

/* Starts every worker that has no thread. Workers inherit a full signal mask, so signals meant
 * for the process (SIGINT in a training script) land on the owner's threads. */
static int start_workers(ast_pool *p)
{
    sigset_t all, old;
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &old);
    int rc = 0;
    for (int i = 0; i < p->nworkers && !rc; i++) {
        worker *w = &p->w[i];
        if (w->alive)
            continue;
        w->started = 0;
        w->bound_pu = -1;
        int e = pthread_create(&w->tid, NULL, worker_main, w);
        if (e)
            rc = e == EAGAIN ? AST_ENOMEM : ast_err_from_errno(e);
        else
            w->alive = 1;
    }
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    return rc;
}

/* In a forked child: starts the workers when there is work for them (always when `submitting`),
 * so a child that never uses the pool starts no threads. 0 or start_workers' code. */
static int restart_workers(ast_pool *p, int submitting)
{
    if (!p->need_start || (!submitting && !p->nheap) || p->stopping)
        return 0;
    int rc = start_workers(p);
    if (!rc)
        p->need_start = 0;
    return rc;
}

/* ---- cpuset ------------------------------------------------------------------------------ */

/* A decimal core index at c; the character after it, or NULL if there is none or it is huge. */
static const char *parse_index(const char *c, long *v)
{
    if (*c < '0' || *c > '9')
        return NULL;
    *v = 0;
    while (*c >= '0' && *c <= '9') {
        *v = *v * 10 + (*c++ - '0');
        if (*v > CPU_INDEX_MAX)
            return NULL;
    }
    return c;
}

/* Strict hwloc list syntax: "N" or "A-B" (A <= B) items separated by single commas, decimal,
 * nothing else. hwloc's own parser accepts more ("0x3", "2a", "1-"), which a config must not.
 * Counts the cores and reports the largest index. */
static int cpulist_check(const char *s, long *count, long *maxv)
{
    long cnt = 0, mx = -1;
    const char *c = s;
    for (;;) {
        long lo, hi;
        if (!(c = parse_index(c, &lo)))
            return AST_EINVAL;
        hi = lo;
        if (*c == '-' && (!(c = parse_index(c + 1, &hi)) || hi < lo))
            return AST_EINVAL;
        cnt += hi - lo + 1;
        if (hi > mx)
            mx = hi;
        if (*c == '\0')
            break;
        if (*c++ != ',')
            return AST_EINVAL;
    }
    *count = cnt;
    *maxv = mx;
    return 0;
}

#if ASTERIA_HAVE_HWLOC
/* The core set as a PU bitmap.
 *  - opts->cpuset: every core named must exist and be allowed to this process by the OS
 *    (cgroup); it is an explicit request, so it may lie outside the process's current affinity.
 *  - default: the cores the process may run on (the union of its threads' affinities, so a
 *    launcher's taskset / numactl is respected even when the caller pinned itself), minus the
 *    core (all its hardware threads) the calling thread last ran on; all of them if that
 *    leaves none. */
static int core_set(ast_pool *p, const char *spec, hwloc_bitmap_t set)
{
    hwloc_const_bitmap_t allowed = hwloc_topology_get_allowed_cpuset(p->topo);
    if (spec) {
        long count, maxv;
        if (cpulist_check(spec, &count, &maxv) || hwloc_bitmap_list_sscanf(set, spec) < 0)
            return AST_EINVAL;
        if (hwloc_bitmap_iszero(set) || !hwloc_bitmap_isincluded(set, allowed))
            return AST_EINVAL;
        return 0;
    }
    hwloc_bitmap_t base = hwloc_bitmap_alloc(), here = hwloc_bitmap_alloc();
    if (!base || !here) {
        hwloc_bitmap_free(base);
        hwloc_bitmap_free(here);
        return AST_ENOMEM;
    }
    if (hwloc_get_cpubind(p->topo, base, HWLOC_CPUBIND_PROCESS) == 0)
        hwloc_bitmap_and(base, base, allowed);
    else
        hwloc_bitmap_zero(base);
    if (hwloc_bitmap_iszero(base))
        hwloc_bitmap_copy(base, allowed);
    hwloc_bitmap_copy(set, base);
    if (hwloc_get_last_cpu_location(p->topo, here, HWLOC_CPUBIND_THREAD) == 0 &&
        !hwloc_bitmap_iszero(here)) {
        hwloc_obj_t pu = hwloc_get_pu_obj_by_os_index(p->topo, (unsigned)hwloc_bitmap_first(here));
        hwloc_obj_t core = pu ? hwloc_get_ancestor_obj_by_type(p->topo, HWLOC_OBJ_CORE, pu) : NULL;
        hwloc_bitmap_andnot(set, base, core ? core->cpuset : here);
        if (hwloc_bitmap_iszero(set))
            hwloc_bitmap_copy(set, base);
    }
    hwloc_bitmap_free(base);
    hwloc_bitmap_free(here);
    return 0;
}

static int plan_workers(ast_pool *p, const ast_pool_opts *o)
{
    if (hwloc_topology_init(&p->topo))
        return AST_ENOMEM;
    if (hwloc_topology_load(p->topo)) {
        hwloc_topology_destroy(p->topo);
        p->topo = NULL;
        return AST_EIO;
    }
    hwloc_bitmap_t set = hwloc_bitmap_alloc();
    if (!set)
        return AST_ENOMEM;
    int rc = core_set(p, o->cpuset, set);
    int ncores = rc ? 0 : hwloc_bitmap_weight(set);
    if (!rc && ncores <= 0)
        rc = AST_EINVAL;
    if (!rc) {
        p->nworkers = o->workers ? o->workers : ncores < POOL_MAX_WORKERS ? ncores : POOL_MAX_WORKERS;
        p->w = calloc((size_t)p->nworkers, sizeof *p->w);
        if (!p->w)
            rc = AST_ENOMEM;
    }
    if (!rc) {
        const struct hwloc_topology_support *sup = hwloc_topology_get_support(p->topo);
        int can_bind = sup->cpubind->set_thisthread_cpubind || sup->cpubind->set_thread_cpubind;
        int i = 0, pu = -1;
        while (i < p->nworkers) {
            pu = hwloc_bitmap_next(set, pu);
            if (pu < 0)
                continue; /* wrap around: round robin over the set */
            p->w[i++].plan_pu = p->pin && can_bind ? pu : -1;
        }
        p->unpinned_why = !p->pin      ? "unpinned (pin=0)"
                          : !can_bind ? "unpinned (hwloc cannot bind threads here)"
                                      : "unpinned (binding failed)";
    }
    hwloc_bitmap_free(set);
    return rc;
}
#else
static int plan_workers(ast_pool *p, const ast_pool_opts *o)
{
    long ncores;
    if (o->cpuset) {
        long maxv;
        int rc = cpulist_check(o->cpuset, &ncores, &maxv);
        if (rc)
            return rc;
        long conf = sysconf(_SC_NPROCESSORS_CONF);
        if (conf > 0 && maxv >= conf)
            return AST_EINVAL;
    } else {
        ncores = sysconf(_SC_NPROCESSORS_ONLN) - 1;
    }
    if (ncores < 1)
        ncores = 1;
    p->nworkers = o->workers ? o->workers : (int)(ncores < POOL_MAX_WORKERS ? ncores : POOL_MAX_WORKERS);
    p->w = calloc((size_t)p->nworkers, sizeof *p->w);
    if (!p->w)
        return AST_ENOMEM;
    for (int i = 0; i < p->nworkers; i++)
        p->w[i].plan_pu = -1;
    p->unpinned_why = "unpinned (built without hwloc)";
    return 0;
}
#endif

/* ---- fork -------------------------------------------------------------------------------- */

static void atfork_prepare(void)
{
    pthread_mutex_lock(&registry_mtx);
    for (ast_pool *p = registry; p; p = p->reg_next)
        pthread_mutex_lock(&p->mtx);
}

static void atfork_parent(void)
{
    for (ast_pool *p = registry; p; p = p->reg_next)
        pthread_mutex_unlock(&p->mtx);
    pthread_mutex_unlock(&registry_mtx);
}

static void atfork_child(void)
{
    for (ast_pool *p = registry; p; p = p->reg_next) {
        /* The old objects may record owners and waiters that do not exist here. */
        memset(&p->mtx, 0, sizeof p->mtx);
        memset(&p->work_cv, 0, sizeof p->work_cv);
        memset(&p->done_cv, 0, sizeof p->done_cv);
        init_sync(p);
        p->ndone_waiters = 0;
        for (int i = 0; i < p->nworkers; i++) {
            worker *w = &p->w[i];
            rec *r = w->current;
            if (r) { /* its worker does not exist here: it runs again from the start */
                r->state = REC_QUEUED;
                r->started_ns = 0;
                r->worker = -1;
                heap_push(p, r);
                w->current = NULL;
                p->st.running--;
                p->st.queued++;
            }
            w->alive = 0;
            w->started = 0;
        }
        p->nstarted = 0;
        p->need_start = 1;
    }
    pthread_mutex_init(&registry_mtx, NULL);
}

static void install_atfork(void)
{
    pthread_atfork(atfork_prepare, atfork_parent, atfork_child);
}

/* ---- public API ---------------------------------------------------------------------------- */

void ast_pool_opts_init(ast_pool_opts *o)
{
    if (!o)
        return;
    o->workers = 0;
    o->cpuset = NULL;
    o->pin = 1;
}

static void free_pool(ast_pool *p)
{
    rec *r = p->done_head;
    while (r) {
        rec *next = r->dnext;
        free(r);
        r = next;
    }
    free(p->heap);
    ast__htable_free(&p->tickets);
    ast__htable_free(&p->queued_blocks);
    free(p->w);
#if ASTERIA_HAVE_HWLOC
    if (p->topo)
        hwloc_topology_destroy(p->topo);
#endif
    free(p);
}

/* Stops the workers of a pool that is not (or no longer) in the registry. */
static void stop_pool(ast_pool *p)
{
    pthread_mutex_lock(&p->mtx);
    p->stopping = 1;
    uint64_t t = ast__now_ns();
    while (p->nheap)
        settle_queued(p, p->heap[p->nheap - 1], AST_ESHUTDOWN, t);
    pthread_cond_broadcast(&p->work_cv);
    pthread_cond_broadcast(&p->done_cv);
    pthread_mutex_unlock(&p->mtx);
    for (int i = 0; i < p->nworkers; i++) {
        if (p->w[i].alive) {
            pthread_join(p->w[i].tid, NULL);
            p->w[i].alive = 0;
        }
    }
}

int ast_pool_create(const ast_pool_opts *opts, ast_pool **out)
{
    if (!out)
        return AST_EINVAL;
    *out = NULL;
    ast_pool_opts o;
    ast_pool_opts_init(&o);
    if (opts)
        o = *opts;
    if (o.workers < 0 || o.workers > POOL_MAX_WORKERS || (o.pin != 0 && o.pin != 1))
        return AST_EINVAL;

    ast_pool *p = calloc(1, sizeof *p);
    if (!p)
        return AST_ENOMEM;
    p->pin = o.pin;
    p->next_ticket = 1;
    int rc = plan_workers(p, &o);
    if (!rc)
        rc = ast__htable_reserve(&p->tickets, 64);
    if (!rc)
        rc = ast__htable_reserve(&p->queued_blocks, 64);
    if (!rc)
        rc = heap_reserve(p, 64);
    if (rc) {
        free_pool(p);
        return rc;
    }
    rc = init_sync(p);
    if (rc) {
        free_pool(p);
        return rc;
    }
    for (int i = 0; i < p->nworkers; i++) {
        p->w[i].pool = p;
        p->w[i].idx = i;
        p->w[i].bound_pu = -1;
    }
    p->st.workers = p->nworkers;
    pthread_once(&atfork_once, install_atfork);

    pthread_mutex_lock(&p->mtx);
    rc = start_workers(p);
    if (!rc) {
        while (p->nstarted < p->nworkers)
            pthread_cond_wait(&p->done_cv, &p->mtx);
    }
    pthread_mutex_unlock(&p->mtx);
    if (rc) {
        stop_pool(p);
        pthread_cond_destroy(&p->work_cv);
        pthread_cond_destroy(&p->done_cv);
        pthread_mutex_destroy(&p->mtx);
        free_pool(p);
        return rc;
    }

    pthread_mutex_lock(&registry_mtx);
    p->reg_next = registry;
    if (registry)
        registry->reg_prev = p;
    registry = p;
    pthread_mutex_unlock(&registry_mtx);
    *out = p;
    return 0;
}

void ast_pool_destroy(ast_pool *p)
{
    if (!p)
        return;
    pthread_mutex_lock(&registry_mtx);
    if (p->reg_prev)
        p->reg_prev->reg_next = p->reg_next;
    else
        registry = p->reg_next;
    if (p->reg_next)
        p->reg_next->reg_prev = p->reg_prev;
    pthread_mutex_unlock(&registry_mtx);

    stop_pool(p);
    pthread_cond_destroy(&p->work_cv);
    pthread_cond_destroy(&p->done_cv);
    pthread_mutex_destroy(&p->mtx);
    free_pool(p);
}

int ast_pool_submit(ast_pool *p, const ast_job *job, uint64_t *ticket)
{
    if (!p || !job || !job->run)
        return AST_EINVAL;
    rec *r = calloc(1, sizeof *r);
    if (!r)
        return AST_ENOMEM;
    r->job = *job;
    r->worker = -1;
    r->queued_ns = ast__now_ns();

    pthread_mutex_lock(&p->mtx);
    int rc = p->stopping ? AST_ESHUTDOWN : restart_workers(p, 1);
    rec *old = NULL;
    if (!rc) {
        ast__hnode *x = ast__htable_find(&p->queued_blocks, job->block);
        old = x ? AST__CONTAINER_OF(x, rec, by_block) : NULL;
        if (old && old->job.version >= job->version)
            rc = AST_EINVAL;
    }
    /* Grow everything first so that nothing below can fail half-way. */
    if (!rc)
        rc = ast__htable_reserve(&p->tickets, p->tickets.n + 1);
    if (!rc)
        rc = ast__htable_reserve(&p->queued_blocks, p->queued_blocks.n + 1);
    if (!rc) /* room for the running jobs too: a fork puts them back in the heap */
        rc = heap_reserve(p, p->nheap + (size_t)p->st.running + 1);
    if (rc) {
        pthread_mutex_unlock(&p->mtx);
        free(r);
        return rc;
    }
    if (old) {
        settle_queued(p, old, AST_ESUPERSEDED, r->queued_ns);
        p->st.superseded++;
        wake_owners(p);
    }
    r->ticket = p->next_ticket++;
    r->state = REC_QUEUED;
    r->in_blocks = 1;
    r->by_ticket.key = r->ticket;
    r->by_block.key = job->block;
    ast__htable_insert(&p->tickets, &r->by_ticket);
    ast__htable_insert(&p->queued_blocks, &r->by_block);
    heap_push(p, r);
    p->st.submitted++;
    p->st.queued++;
    if (ticket)
        *ticket = r->ticket;
    pthread_cond_signal(&p->work_cv);
    pthread_mutex_unlock(&p->mtx);
    return 0;
}

int ast_pool_cancel(ast_pool *p, uint64_t ticket)
{
    if (!p)
        return AST_EINVAL;
    pthread_mutex_lock(&p->mtx);
    ast__hnode *x = ast__htable_find(&p->tickets, ticket);
    rec *r = x ? AST__CONTAINER_OF(x, rec, by_ticket) : NULL;
    int rc = !r || r->state == REC_DONE ? AST_ENOENT : r->state == REC_RUNNING ? AST_EBUSY : 0;
    if (!rc) {
        settle_queued(p, r, AST_ECANCELED, ast__now_ns());
        p->st.cancelled++;
        wake_owners(p);
    }
    pthread_mutex_unlock(&p->mtx);
    return rc;
}

int ast_pool_poll(ast_pool *p, ast_completion *out, size_t cap, size_t *n)
{
    if (!p || !n || (cap && !out))
        return AST_EINVAL;
    pthread_mutex_lock(&p->mtx);
    int rc = restart_workers(p, 0);
    *n = rc ? 0 : drain_some(p, out, cap);
    pthread_mutex_unlock(&p->mtx);
    return rc;
}

static struct timespec abs_deadline(int64_t timeout_ns)
{
    uint64_t t = ast__now_ns() + (uint64_t)timeout_ns;
    return (struct timespec){.tv_sec = (time_t)(t / 1000000000ull),
                             .tv_nsec = (long)(t % 1000000000ull)};
}

/* One bounded wait on done_cv; AST_ETIMEDOUT once the absolute deadline has passed. */
static int wait_done(ast_pool *p, int64_t timeout_ns, const struct timespec *until)
{
    if (timeout_ns == 0)
        return AST_ETIMEDOUT;
    p->ndone_waiters++;
    int e = timeout_ns < 0 ? pthread_cond_wait(&p->done_cv, &p->mtx)
                           : pthread_cond_timedwait(&p->done_cv, &p->mtx, until);
    p->ndone_waiters--;
    return e == ETIMEDOUT ? AST_ETIMEDOUT : 0;
}

int ast_pool_wait(ast_pool *p, uint64_t ticket, int64_t timeout_ns, ast_completion *out)
{
    if (!p || !out)
        return AST_EINVAL;
    struct timespec until = timeout_ns > 0 ? abs_deadline(timeout_ns) : (struct timespec){0};
    pthread_mutex_lock(&p->mtx);
    int rc = restart_workers(p, 0);
    while (!rc || rc == AST_ETIMEDOUT) {
        ast__hnode *x = ast__htable_find(&p->tickets, ticket);
        rec *r = x ? AST__CONTAINER_OF(x, rec, by_ticket) : NULL;
        if (!r) {
            rc = AST_ENOENT;
            break;
        }
        if (r->state == REC_DONE) {
            drain_rec(p, r, out);
            rc = 0;
            break;
        }
        if (rc == AST_ETIMEDOUT)
            break;
        rc = wait_done(p, timeout_ns, &until);
    }
    pthread_mutex_unlock(&p->mtx);
    return rc;
}

int ast_pool_wait_any(ast_pool *p, int64_t timeout_ns, ast_completion *out, size_t cap,
                      size_t *n)
{
    if (!p || !n || !cap || !out)
        return AST_EINVAL;
    struct timespec until = timeout_ns > 0 ? abs_deadline(timeout_ns) : (struct timespec){0};
    pthread_mutex_lock(&p->mtx);
    int rc = restart_workers(p, 0);
    while (!rc && !p->done_head)
        rc = wait_done(p, timeout_ns, &until);
    *n = rc && rc != AST_ETIMEDOUT ? 0 : drain_some(p, out, cap);
    pthread_mutex_unlock(&p->mtx);
    return *n ? 0 : rc ? rc : AST_ETIMEDOUT;
}

int ast_pool_stats_get(ast_pool *p, ast_pool_stats *out)
{
    if (!p || !out)
        return AST_EINVAL;
    pthread_mutex_lock(&p->mtx);
    *out = p->st;
    pthread_mutex_unlock(&p->mtx);
    return 0;
}

int ast_pool_cpuset(ast_pool *p, char *buf, size_t len)
{
    if (!p || !buf || !len)
        return AST_EINVAL;
    int need = 0, nbound = 0;
#if ASTERIA_HAVE_HWLOC
    hwloc_bitmap_t set = hwloc_bitmap_alloc();
    if (!set)
        return AST_ENOMEM;
    pthread_mutex_lock(&p->mtx);
    for (int i = 0; i < p->nworkers; i++) {
        /* A worker not (re)started yet, as in a forked child, reports where it will bind. */
        int pu = p->w[i].started ? p->w[i].bound_pu : p->w[i].plan_pu;
        if (pu >= 0) {
            hwloc_bitmap_set(set, (unsigned)pu);
            nbound++;
        }
    }
    pthread_mutex_unlock(&p->mtx);
    if (nbound)
        need = hwloc_bitmap_list_snprintf(buf, len, set);
    hwloc_bitmap_free(set);
#endif
    if (!nbound)
        need = snprintf(buf, len, "%s", p->unpinned_why);
    return need < 0 || (size_t)need >= len ? AST_EINVAL : 0;
}
