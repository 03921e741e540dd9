/*
 * asteria/runtime.h - the Asteria runtime: configuration, REFRESH job submission, stats.
 *
 * Owns: the validated ast_config, one worker pool, the table of registered host buffers, the
 * stats counters, the last-error message and, when config.trace is set, a trace recorder
 * (trace.h) whose file is written at destroy.
 *
 * A REFRESH request names an operation (ast_op; src/op_table.c keeps one row per op: name,
 * argument checks, kernel) and host pointers (in0..in2, out0, out1) that must lie inside
 * buffers registered with ast_runtime_register (AST_ERANGE otherwise), so a job never touches
 * memory its owner has not declared. Outputs are written only when the job succeeds. A
 * completion reports its job's own status, however often that block failed before: the runtime
 * keeps no failure streak. Consecutive failures are counted by the caller (the Python optimizer's
 * schedule, runtime key max_failures, which is not a libasteria key; docs/departures.md).
 *
 * Trace (config.trace non-empty): the runtime records, on lane "train" (AST_TRACE_LANE_TRAIN),
 * "job queued" at submit, "barrier wait" spans in ast_runtime_wait (only when it blocked) and
 * "install" at ast_runtime_note_install (args: step = install step, version = snapshot step:
 * trace.h has one step field); and on the lane of the worker that ran a job (its index),
 * "job started", the "refresh" span and "job done" (args block, version, worker, status), from
 * the pool's started_ns / done_ns, when its completion is collected (poll, wait, or destroy,
 * which drains completions not yet collected). Jobs still running or queued at destroy get no
 * done event. Callers add their own events (copies, syncs) with ast_runtime_trace_event.
 *
 * Thread safety: all functions are thread-safe. The runtime mutex guards the buffer table and
 * the last-error text; stats counters are atomics; the trace recorder has its own mutex, never
 * taken with the runtime mutex held. Jobs run on pool workers with no runtime lock held.
 * ast_runtime_destroy must not race with other calls.
 * No global mutable state: everything hangs off the ast_runtime handle.
 */
#ifndef ASTERIA_RUNTIME_H
#define ASTERIA_RUNTIME_H

#include <stddef.h>
#include <stdint.h>

#include "asteria/linalg.h"
#include "asteria/pool.h"
#include "asteria/trace.h"

#ifdef __cplusplus
extern "C" {
#endif

#define AST_PATH_MAX 4096

/* The runtime's configuration: only what libasteria itself reads. The optimizer's own keys
 * (mode, staleness, install, placement, budgets, nvme_dir, max_failures, on_failure, ...) live
 * in the Python layer (asteria.RuntimeConfig), which validates them and hands C only these. */
typedef struct ast_config {
    int workers;                   /* "workers": 1..1024, or 0 = the cores the caller does not use */
    char cpuset[256];              /* "cpuset": hwloc list, or "" = near the accelerator */
    int pin;                       /* "pin": 1/0 bind workers to cores (default 1) */
    char trace[AST_PATH_MAX];      /* "trace": "" = no trace; else a file path, not a directory, in
                                    * an existing directory this process can write */
} ast_config;

/* Sets the defaults: workers 0, cpuset "", pin 1, trace "". No return value. */
void ast_config_init(ast_config *cfg);
/* Sets one key from its string form (a Python dict passes straight through): the one validator
 * of each key. Returns 0 on success; AST_EINVAL for an unknown key, a bad value or a NULL
 * argument, with a message naming the key and the allowed values written into errbuf (may be
 * NULL; len bytes, truncated) and cfg unchanged. */
int ast_config_set(ast_config *cfg, const char *key, const char *value, char *errbuf, size_t len);
/* Checks a whole struct (one filled in by hand) with the same rule per key as ast_config_set.
 * Returns 0 if every field is valid; AST_EINVAL otherwise, with the same message contract. */
int ast_config_validate(const ast_config *cfg, char *errbuf, size_t len);
/* Returns the comma-separated list of every accepted key (a static string). */
const char *ast_config_keys(void);

typedef struct ast_runtime ast_runtime;

typedef enum ast_op {
    AST_OP_EIGH = 1,        /* in0 = F;        out0 = Q (columns, descending), out1 = w (may be NULL) */
    AST_OP_INV_ROOT = 2,    /* in0 = F;        out0 = (F + eps I)^(-1/p) */
    AST_OP_NEWTON_ROOT = 3, /* in0 = F;        out0 = coupled-Newton (F + eps I)^(-1/p), p integer */
    AST_OP_SOAP_QR = 4,     /* in0 = F, in1 = Q; out0 = Q_new, out1 = perm (int64, n per block) */
    AST_OP_KL_QR = 5,       /* in0 = F, in1 = Q; out0 = Q_new */
    /* in0 = X (batch x n x n1), in1 = A pair (batch x 2 x n x n) or NULL, in2 = B pair
     * (batch x 2 x n1 x n1) or NULL, not both NULL; out0 = A_new^T A_old X B_old^T B_new
     * (batch x n x n1), a NULL pair being the identity (ast_linalg_soap_rotate) */
    AST_OP_SOAP_ROTATE = 6,
    /* in0 = G (batch x n x n1); out0 = L (batch x n x n) or NULL, out1 = R (batch x n1 x n1)
     * or NULL, not both, each updated IN PLACE: L = p L + eps G G^T, R = p R + eps G^T G
     * (p = beta, the old factor's weight; eps = alpha, the new product's), exactly symmetric
     * (ast_linalg_gram_ema) */
    AST_OP_GRAM_EMA = 7
} ast_op;

/* The REFRESH ops are one table in src/op_table.c, a row per op (name, properties, argument
 * checks, kernel), which ast_runtime_submit reads and a pool worker runs; a new op is its value
 * above, its kernel (src/linalg_kernels.c), its row there and its direct entry points named after
 * it (asteria/linalg.h, src/linalg.c). */
/* Returns the name of op ("eigh", "inv_root", ...: a static string), or NULL for a code that
 * names no op. */
const char *ast_op_name(int op);
/* Returns the number of ops; their codes are 1 .. ast_op_count(), each with a name. */
int ast_op_count(void);

/* The buffer one pointer of a request spans per batch entry, n and n1 being the request's, in
 * its dtype unless said otherwise. */
typedef enum ast_shape {
    AST_SHAPE_NONE = 0,     /* the op takes no such pointer */
    AST_SHAPE_NN = 1,       /* n x n: a factor, a basis, a root, L */
    AST_SHAPE_N = 2,        /* n: eigenvalues */
    AST_SHAPE_PERM = 3,     /* n int64: a permutation */
    AST_SHAPE_NN1 = 4,      /* n x n1: X of soap_rotate, G of gram_ema */
    AST_SHAPE_N1N1 = 5,     /* n1 x n1: R */
    AST_SHAPE_PAIR_NN = 6,  /* 2 x n x n: an (old, new) pair of bases */
    AST_SHAPE_PAIR_N1N1 = 7 /* 2 x n1 x n1 */
} ast_shape;

/* How an op takes one pointer of a request. */
typedef enum ast_arg_need {
    AST_ARG_NONE = 0,     /* must be NULL */
    AST_ARG_OPTIONAL = 1, /* may be NULL */
    AST_ARG_REQUIRED = 2
} ast_arg_need;

/* A request's pointers, in this order in ast_op_info's arrays: in0, in1, in2, out0, out1. */
#define AST_OP_ARGS 5

/* The properties of one op, as the op table holds them (executors outside C read them here
 * rather than naming ops). */
typedef struct ast_op_info {
    const char *name;       /* ast_op_name's answer */
    int takes_basis;        /* 1: in1 is the previous basis, of F's shape, and is required */
    int in_place;           /* 1: out0 / out1 are read and updated in place (never retried) */
    int need[AST_OP_ARGS];  /* ast_arg_need per pointer */
    int shape[AST_OP_ARGS]; /* ast_shape per pointer (its span: batch times that) */
} ast_op_info;

/* Fills *out with op's properties. Returns 0; AST_EINVAL for a code that names no op or a NULL
 * out (out unchanged). */
int ast_op_info_get(int op, ast_op_info *out);

typedef struct ast_refresh {
    ast_op op;
    ast_dtype dtype;
    int n;                  /* block dimension */
    int batch;              /* same-shape blocks, laid out contiguously */
    const void *in0, *in1;
    void *out0, *out1;
    double p;               /* root exponent denominator (inverse p-th root); gram_ema: beta */
    double eps;             /* the roots' eps; gram_ema: alpha */
    uint64_t block;         /* caller's block key (supersede) */
    uint64_t version;
    int64_t deadline;       /* step by which it must be installed */
    int64_t snapshot_step;  /* step whose end state the inputs are (for version stats) */
    int n1;                 /* soap_rotate: columns of X, gram_ema: columns of G (>= 1);
                             * other ops ignore it */
    const void *in2;        /* soap_rotate: the B pair or NULL; must be NULL for other ops */
} ast_refresh;

typedef struct ast_result {
    uint64_t ticket, block, version;
    int64_t snapshot_step;
    int status;             /* 0, a linalg AST_E*, AST_ECANCELED, AST_ESUPERSEDED, AST_ESHUTDOWN */
    int retried_f64;
    int failed_index;       /* first failing block of a batch, -1 if none */
    uint64_t queued_ns, started_ns, done_ns;
    int worker;
} ast_result;

typedef struct ast_stats {
    uint64_t jobs_submitted, jobs_queued, jobs_running, jobs_done;
    uint64_t jobs_failed, jobs_superseded, jobs_cancelled, jobs_retried_f64;
    uint64_t nonfinite_skipped;     /* refreshes skipped by the caller for non-finite inputs */
    uint64_t installs;              /* results installed by the caller */
    int64_t max_install_lag;        /* largest (install step - snapshot step) the caller reported */
    int64_t last_installed_version_step;
    uint64_t barrier_waits, barrier_wait_ns;
    uint64_t worker_busy_ns;
    uint64_t bytes_registered;
    int workers;
} ast_stats;

/* Creates a runtime from cfg (NULL: the defaults), which is checked with ast_config_validate
 * first; *out receives it (NULL on failure). Returns 0 on success; AST_EINVAL for a NULL out or
 * an invalid cfg; AST_ENOMEM; the codes of ast_pool_create (workers, cpuset) and of
 * ast_trace_create. The failure detail (naming the key, for a bad config) is written to errbuf
 * (may be NULL; len bytes, truncated). */
int ast_runtime_create(const ast_config *cfg, ast_runtime **out, char *errbuf, size_t len);
/* Destroys rt: drains the completions not yet collected (so the trace shows them), lets running
 * jobs finish, drops queued ones, writes the configured trace file and frees everything. NULL
 * is a no-op. Must not race with other calls on rt.
 * RETURN VALUE: 0 (also when no trace is configured); else the code of ast_runtime_trace_write
 * (AST_ENOENT, AST_EACCES, AST_ENOSPC, AST_EIO, AST_ENOMEM), with its message, naming the path
 * and the failing call, in errbuf (may be NULL; len bytes, truncated). rt is freed either way. */
int ast_runtime_destroy(ast_runtime *rt, char *errbuf, size_t len);
/* Returns rt's validated config (owned by rt, valid until destroy), or NULL for a NULL rt. */
const ast_config *ast_runtime_config(const ast_runtime *rt);
/* Copies the last error message set on this runtime ("" if none) into buf (truncated).
 * Returns 0; AST_EINVAL for a NULL rt or buf, or len 0. */
int ast_runtime_last_error(ast_runtime *rt, char *buf, size_t len);

/* Declares [ptr, ptr + nbytes) as memory jobs may read and write; *handle receives its handle.
 * Returns 0 on success; AST_EINVAL for a NULL rt, ptr or handle, or nbytes 0; AST_ENOMEM. */
int ast_runtime_register(ast_runtime *rt, void *ptr, size_t nbytes, uint64_t *handle);
/* Forgets a registered buffer. Returns 0 on success; AST_EINVAL for a NULL rt; AST_ENOENT for
 * an unknown handle; AST_EBUSY while a job whose completion was not collected uses it. */
int ast_runtime_unregister(ast_runtime *rt, uint64_t handle);

/* Queues a REFRESH job; *ticket (may be NULL) receives its ticket. Returns 0 on success;
 * AST_EINVAL for a malformed request (dtype, n, batch, p, eps, n1, a missing input or output, an
 * operand that must be NULL, gram_ema outputs that overlap G or each other, a version not above
 * the block's queued one); AST_ERANGE for a
 * pointer range outside every registered buffer; AST_ENOMEM; AST_ESHUTDOWN while rt is being
 * destroyed. Failures set the last-error message. */
int ast_runtime_submit(ast_runtime *rt, const ast_refresh *req, uint64_t *ticket);
/* Returns 0 when the job was still queued and is cancelled (its completion reports
 * AST_ECANCELED); AST_EBUSY while it runs; AST_ENOENT for a finished or unknown ticket;
 * AST_EINVAL for a NULL rt; AST_ESHUTDOWN. */
int ast_runtime_cancel(ast_runtime *rt, uint64_t ticket);
/* Moves up to cap finished jobs' results into out; *n receives the count. Never blocks.
 * Returns 0 (also with *n = 0); AST_EINVAL for a NULL rt, out or n; AST_ESHUTDOWN; the worker
 * start failure of ast_pool_poll in a forked child. */
int ast_runtime_poll(ast_runtime *rt, ast_result *out, size_t cap, size_t *n);
/* Bounded barrier: waits for one ticket; the wait time is counted in barrier stats. timeout_ns
 * < 0: no limit. Returns 0 with *out filled (out->status tells how the job ended);
 * AST_ETIMEDOUT; AST_ENOENT for an unknown or already collected ticket; AST_EINVAL for a NULL
 * rt or out; AST_ESHUTDOWN. */
int ast_runtime_wait(ast_runtime *rt, uint64_t ticket, int64_t timeout_ns, ast_result *out);
/* ast_runtime_wait that wakes at least every slice_ns to call check(arg), with no library lock
 * held (so check may take the caller's own locks, e.g. re-acquire Python's GIL and run its
 * signal handlers). check returns 0 to go on waiting; anything else ends the wait. The wait
 * counts as one barrier wait in stats and trace, however many slices it took.
 * RETURN VALUE: as ast_runtime_wait (0 with *out filled; AST_ETIMEDOUT once timeout_ns (< 0:
 * none) has passed; AST_ENOENT; AST_EINVAL for NULL rt / out / check or slice_ns <= 0;
 * AST_ESHUTDOWN), and AST_EINTR when check asked to stop. After AST_EINTR and AST_ETIMEDOUT
 * the job is untouched: still registered, running or queued, and waitable (or pollable) later;
 * its result is not lost. */
int ast_runtime_wait_check(ast_runtime *rt, uint64_t ticket, int64_t timeout_ns,
                           int64_t slice_ns, int (*check)(void *arg), void *arg,
                           ast_result *out);

/* The caller reports what it did with results, so stats can prove the staleness bound. A NULL
 * rt is a no-op. No return value. */
void ast_runtime_note_install(ast_runtime *rt, int64_t snapshot_step, int64_t install_step);
void ast_runtime_note_nonfinite(ast_runtime *rt);

/* Copies the counters into out. Returns 0; AST_EINVAL for a NULL rt or out. */
int ast_runtime_stats_get(ast_runtime *rt, ast_stats *out);

/* Returns 1 if rt records a trace (config.trace non-empty), else 0 (also for a NULL rt). */
int ast_runtime_tracing(const ast_runtime *rt);
/* Records one caller event in rt's trace (see trace.h for the fields). Unlike ast_trace_event,
 * ev->ts_ns is an absolute CLOCK_MONOTONIC stamp, the clock of ast_result's *_ns fields and of
 * Python's time.monotonic_ns(); 0 means now. dur_ns is as in trace.h.
 * RETURN VALUE: 0, also when rt records no trace (the event is discarded); AST_EINVAL (NULL
 * arguments, unknown kind, lane outside [AST_TRACE_LANE_MIN, -1] and not a worker index, a
 * custom kind without a name, a name or category over 1023 bytes); AST_ENOMEM; AST_ENOSPC (the
 * recorder's event cap). Failures set the last-error message. */
int ast_runtime_trace_event(ast_runtime *rt, const ast_trace_ev *ev);
/* Names a lane in the trace (ast_trace_name_lane). RETURN VALUE: 0 (also without a trace);
 * AST_EINVAL; AST_ENOMEM. */
int ast_runtime_trace_name_lane(ast_runtime *rt, int lane, const char *name);
/* Writes every event recorded so far as Chrome-trace JSON to path (NULL or "": config.trace),
 * atomically (trace.h); recording goes on. RETURN VALUE: 0; AST_ESTATE (rt records no trace);
 * the codes of ast_trace_write_json. Failures set the last-error message (naming the path). */
int ast_runtime_trace_write(ast_runtime *rt, const char *path);

#ifdef __cplusplus
}
#endif
#endif
