/*
 * asteria/pool.h - the worker pool that runs REFRESH jobs off the training thread.
 *
 * Owns: N pthreads pinned with hwloc, a job queue ordered by deadline step, a done-queue drained
 * by the owner thread, supersede / cancel, clean shutdown, fork safety.
 *
 * Model (libuv's threadpool, adapted):
 *  - ast_pool_submit() enqueues a job keyed by (block, version). A queued job of the same block
 *    with a lower version is superseded: it is removed from the queue and completes with status
 *    AST_ESUPERSEDED. Submitting a version <= one already queued for the block is AST_EINVAL.
 *  - Workers pop the job with the smallest deadline (ties: lowest ticket, i.e. FIFO) and run it
 *    with no pool lock held.
 *  - Every job, whatever its fate (ran, failed, cancelled, superseded, dropped at shutdown),
 *    produces exactly one ast_completion, carrying its ctx so the owner can free it.
 *  - Completions are drained by the owner: ast_pool_poll() (non-blocking), ast_pool_wait()
 *    (one ticket, blocking on a condition variable, never spinning).
 *  - Cancel succeeds only while the job is still queued.
 *  - Fork: in a forked child the jobs that were queued or running at the fork are kept and run
 *    (a running one again, from the start) on the child's own workers, started by its first
 *    submit, poll or wait; completions already published stay to be drained (pool.c).
 *
 * Thread safety: every function may be called from any thread, except ast_pool_destroy, which
 * must not race with other calls on the same pool. Job run functions must not call back into
 * the pool that runs them except ast_pool_submit.
 */
#ifndef ASTERIA_POOL_H
#define ASTERIA_POOL_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct ast_pool ast_pool;

typedef struct ast_pool_opts {
    int workers;         /* >= 1; 0 means: one per core of the core set */
    const char *cpuset;  /* hwloc list syntax ("0-3,6"), or NULL: the cores the calling thread
                            does not currently run on (all cores if that leaves none) */
    int pin;             /* 1: bind each worker to one core of the set (round robin); 0: no binding */
} ast_pool_opts;

/* Sets the defaults: workers 0, cpuset NULL, pin 1. No return value. */
void ast_pool_opts_init(ast_pool_opts *o);

typedef struct ast_job {
    uint64_t block;              /* supersede key */
    uint64_t version;            /* monotonically increasing per block */
    int64_t deadline;            /* step by which the result must be installed: queue order */
    int (*run)(void *ctx);       /* runs on a worker; returns 0 or a negative AST_E* code */
    void *ctx;
} ast_job;

typedef struct ast_completion {
    uint64_t ticket;
    uint64_t block;
    uint64_t version;
    int64_t deadline;
    int status;                  /* run()'s result, or AST_ECANCELED / AST_ESUPERSEDED / AST_ESHUTDOWN */
    void *ctx;
    uint64_t queued_ns, started_ns, done_ns; /* CLOCK_MONOTONIC; started_ns == 0 if never ran */
    int worker;                  /* index of the worker that ran it, -1 if none */
} ast_completion;

typedef struct ast_pool_stats {
    uint64_t submitted, queued, running, done, failed, superseded, cancelled;
    uint64_t busy_ns;            /* total time workers spent inside run() */
    int workers;
} ast_pool_stats;

/* Creates a pool (opts NULL: the defaults) and starts its workers; *out receives it (NULL on
 * failure). Returns 0 on success; AST_EINVAL for a NULL out, workers out of range, pin not 0/1,
 * or a cpuset that does not parse or names no core; AST_ENOMEM when memory or threads cannot
 * be had (or the mapped pthread_create error). */
int ast_pool_create(const ast_pool_opts *opts, ast_pool **out);
/* Stops accepting jobs, completes every queued job with AST_ESHUTDOWN, waits for running jobs,
 * joins the workers and frees the pool. Undrained completions are discarded: call
 * ast_pool_poll first if ctx pointers must be freed. NULL is a no-op. No return value. */
void ast_pool_destroy(ast_pool *pool);

/* Queues a job; *ticket (may be NULL) receives its ticket. Returns 0 on success; AST_EINVAL for
 * a NULL pool, job or run, or a version <= the one queued for the block; AST_ENOMEM;
 * AST_ESHUTDOWN while the pool is being destroyed; in a forked child, the failure to start the
 * workers (AST_ENOMEM or the mapped pthread_create error). */
int ast_pool_submit(ast_pool *pool, const ast_job *job, uint64_t *ticket);
/* Returns 0 when the job was removed from the queue (a completion with AST_ECANCELED is
 * published); AST_EBUSY while it runs; AST_ENOENT for a finished or unknown ticket; AST_EINVAL
 * for a NULL pool. */
int ast_pool_cancel(ast_pool *pool, uint64_t ticket);
/* Moves up to cap completions to out; *n receives the count. Never blocks.
 * In a forked child, poll, wait and wait_any first start the workers when jobs are queued
 * (see Fork above); if the threads cannot be created they return that failure (AST_ENOMEM
 * or the mapped pthread_create error) and hand out nothing (*n = 0).
 * Returns 0 on success (also when nothing was ready: *n = 0); AST_EINVAL for a NULL pool, out
 * or n; the worker start failure above. */
int ast_pool_poll(ast_pool *pool, ast_completion *out, size_t cap, size_t *n);
/* Blocks until the job with this ticket has completed, removes its completion from the
 * done-queue and copies it to out. timeout_ns < 0: wait forever; AST_ETIMEDOUT on expiry;
 * AST_ENOENT if the ticket is unknown or its completion was already drained.
 * Returns 0 when out holds the completion (its own status says how the job ended); AST_EINVAL
 * for a NULL pool or out; AST_ETIMEDOUT; AST_ENOENT; the worker start failure of ast_pool_poll. */
int ast_pool_wait(ast_pool *pool, uint64_t ticket, int64_t timeout_ns, ast_completion *out);
/* Blocks until the done-queue is non-empty or timeout; then behaves as ast_pool_poll.
 * Returns 0 with *n >= 1; AST_ETIMEDOUT when nothing completed in time; AST_EINVAL for a NULL
 * pool, out or n, or cap 0; the worker start failure of ast_pool_poll. */
int ast_pool_wait_any(ast_pool *pool, int64_t timeout_ns, ast_completion *out, size_t cap,
                      size_t *n);
/* Copies the counters into out. Returns 0; AST_EINVAL for a NULL pool or out. */
int ast_pool_stats_get(ast_pool *pool, ast_pool_stats *out);
/* Cores the workers were bound to, as an hwloc list string ("unpinned (<why>)" when none is),
 * into buf. Returns 0 on success; AST_EINVAL for a NULL pool or buf, or a buf of len too small
 * for the string; AST_ENOMEM. */
int ast_pool_cpuset(ast_pool *pool, char *buf, size_t len);

#ifdef __cplusplus
}
#endif
#endif
