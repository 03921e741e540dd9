/*
 * testing.h - test-only entry points of libasteria: a job delay and a job stretch on a runtime,
 * and fault injection into the store's NVMe engine for failures a test machine cannot provoke
 * for real. Not public API: nothing here is declared in include/asteria/ or promised to stay.
 * The C tests include it (their include path has src/). The job delay and the job stretch are
 * also bound for the Python suite and the benchmarks, which run against the installed wheel, in
 * the test-only module asteria._C_testing (python/csrc/testing.c), which the package never
 * imports; so they alone have a node in src/asteria.map (a shared libasteria must export them
 * to that module).
 * Implemented by runtime.c (job delay, job stretch), store.c (an open with faults, the engine)
 * and nvme.c (the faults themselves).
 */
#ifndef ASTERIA_TESTING_H
#define ASTERIA_TESTING_H

#include "asteria/runtime.h"
#include "asteria/store.h"
#include "nvme.h"

/* Largest delay ast__runtime_set_job_delay takes: ten minutes. */
#define AST__JOB_DELAY_MAX_MS 600000

/* Every job submitted to rt after this call sleeps delay_ms on its worker before computing, to
 * simulate a slow rank or keep a job running while a test forks or signals. Returns 0 on
 * success; AST_EINVAL when rt is NULL or delay_ms is outside 0..AST__JOB_DELAY_MAX_MS. */
int ast__runtime_set_job_delay(ast_runtime *rt, int delay_ms);

/* Largest factor ast__runtime_set_job_stretch takes. */
#define AST__JOB_STRETCH_MAX 1000.0

/* A slower host on this one: every job of an op in ops (a mask of 1u << ast_op bits; 0: every
 * op) submitted to rt after this call holds its worker factor times as long as it computed.
 * The worker times the op's compute (c ns of CLOCK_MONOTONIC wall time around the op's run
 * function; the job delay's sleep before it is not counted), then sleeps until at least
 * ceil((factor - 1) x c) ns later (clock_nanosleep to an absolute deadline, resumed after a
 * signal) before the pool sees the job return: its completion, its result and its done_ns come
 * no sooner, so done_ns - started_ns >= factor x c. The sleep burns no CPU: W workers compute
 * as W cores 1/factor as fast would. factor 1 (the default) takes the job's old path (no clock
 * read, no sleep). The outputs do not depend on it. Call it while no submit to rt is under way:
 * a submit reads the factor and the mask apart. Returns 0 on success; AST_EINVAL when rt
 * is NULL, factor is not a finite number in 1..AST__JOB_STRETCH_MAX, or ops has a bit that
 * names no op (valid: bits 1..ast_op_count()). */
int ast__runtime_set_job_stretch(ast_runtime *rt, double factor, unsigned ops);

/* The stretched jobs' totals since rt was created (jobs run at factor > 1 only): in *compute_ns
 * their computes' wall time, in *slept_ns the sleeps that stretched them, each as long as the
 * worker slept (at least ceil((factor - 1) x its compute)). Returns 0; AST_EINVAL when an
 * argument is NULL. */
int ast__runtime_job_stretch_totals(ast_runtime *rt, uint64_t *compute_ns, uint64_t *slept_ns);

/* ---- NVMe fault injection ------------------------------------------------------------------ */

enum ast__fault {
    AST__FAULT_NO_ODIRECT = 1u << 0,   /* open: the probe's O_DIRECT open fails with EINVAL */
    AST__FAULT_EROFS = 1u << 1,        /* open and record creation fail with EROFS */
    AST__FAULT_ENOSPC = 1u << 2,       /* write completions fail with -ENOSPC (past skip records) */
    AST__FAULT_SHORT_IO = 1u << 3,     /* each SQE's first completion reports half the bytes */
    AST__FAULT_EAGAIN = 1u << 4,       /* each SQE's first completion reports -EAGAIN */
    AST__FAULT_NO_FALLOCATE = 1u << 5  /* skip the space reservation: ENOSPC comes from writes */
};
/* Arms faults (a mask of AST__FAULT_*; 0 disarms) on an engine. AST__FAULT_ENOSPC spares the
 * next skip records. Stays armed until changed. No return value. */
void ast__nvme_inject_fault(ast__nvme *n, unsigned faults, unsigned skip);

/* ast_store_open with faults (a mask of AST__FAULT_*) armed on the engine from its probe on
 * (ast__nvme_opts.faults). Returns as ast_store_open. */
int ast__store_open_faults(const ast_store_opts *opts, unsigned faults, ast_store **out,
                           char *errbuf, size_t len);
/* Returns the store's engine (the store is its only owner); NULL without an NVMe tier. */
ast__nvme *ast__store_nvme(ast_store *s);

#endif
