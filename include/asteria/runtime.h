/*
 * asteria/runtime.h - the Asteria runtime: configuration, REFRESH job submission, stats.
 *
 * Owns: the validated ast_config, one worker pool, the table of registered host buffers, the
 * per-block failure counters, the stats counters and the last-error message.
 *
 * A REFRESH request names an operation from linalg.h and host pointers that must lie inside
 * buffers registered with ast_runtime_register (AST_ERANGE otherwise), so a job never touches
 * memory its owner has not declared. Outputs are written only when the job succeeds. After
 * config.max_failures consecutive failures of one block its completion reports AST_EFAILED.
 *
 * Thread safety: all functions are thread-safe. The runtime mutex guards the buffer table,
 * failure counters and last-error text; stats counters are atomics. Jobs run on pool workers
 * with no runtime lock held. ast_runtime_destroy must not race with other calls.
 * No global mutable state: everything hangs off the ast_runtime handle.
 */
#ifndef ASTERIA_RUNTIME_H
#define ASTERIA_RUNTIME_H

#include <stddef.h>
#include <stdint.h>

#include "asteria/linalg.h"
#include "asteria/pool.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef enum ast_mode { AST_MODE_SYNC = 0, AST_MODE_ASYNC = 1 } ast_mode;
typedef enum ast_install { AST_INSTALL_DETERMINISTIC = 0, AST_INSTALL_EAGER = 1 } ast_install;

#define AST_PATH_MAX 4096

typedef struct ast_config {
    ast_mode mode;                 /* "mode": sync | async (default async) */
    int staleness;                 /* "staleness": S >= 0 (default 5) */
    ast_install install;           /* "install": deterministic | eager */
    int workers;                   /* "workers": >= 1, or 0 = cores not used by the caller */
    char cpuset[256];              /* "cpuset": hwloc list or "" = auto */
    int pin;                       /* "pin": 1/0 bind workers to cores (default 1) */
    char placement[512];           /* "placement": "auto" or kind=tier,... e.g. "factors=device,roots=host_pinned" */
    int64_t device_budget_bytes;   /* "device_budget_bytes": -1 = none */
    int64_t host_budget_bytes;     /* "host_budget_bytes": -1 = none */
    char nvme_dir[AST_PATH_MAX];   /* "nvme_dir": "" = no NVMe tier */
    char trace[AST_PATH_MAX];      /* "trace": "" = no trace */
    int max_failures;              /* "max_failures": K >= 1 (default 3) */
} ast_config;

/* Defaults as in DESIGN.md's config table. */
void ast_config_init(ast_config *cfg);
/* Sets one key from its string form (a Python dict passes straight through). On a bad key or
 * value returns AST_EINVAL and writes a message naming the key and the allowed values into
 * errbuf (may be NULL). */
int ast_config_set(ast_config *cfg, const char *key, const char *value, char *errbuf, size_t len);
/* Whole-struct validation (ranges, combinations); same message contract. */
int ast_config_validate(const ast_config *cfg, char *errbuf, size_t len);
/* Comma-separated list of every accepted key. */
const char *ast_config_keys(void);

typedef struct ast_runtime ast_runtime;

typedef enum ast_op {
    AST_OP_EIGH = 1,        /* in0 = F;        out0 = Q (columns, descending), out1 = w (may be NULL) */
    AST_OP_INV_ROOT = 2,    /* in0 = F;        out0 = (F + eps I)^(-1/p) */
    AST_OP_NEWTON_ROOT = 3, /* in0 = F;        out0 = coupled-Newton (F + eps I)^(-1/p), p integer */
    AST_OP_SOAP_QR = 4,     /* in0 = F, in1 = Q; out0 = Q_new, out1 = perm (int64, n per block) */
    AST_OP_KL_QR = 5        /* in0 = F, in1 = Q; out0 = Q_new */
} ast_op;

typedef struct ast_refresh {
    ast_op op;
    ast_dtype dtype;
    int n;                  /* block dimension */
    int batch;              /* same-shape blocks, laid out contiguously */
    const void *in0, *in1;
    void *out0, *out1;
    double p;               /* root exponent denominator (inverse p-th root) */
    double eps;
    uint64_t block;         /* caller's block key (supersede, failure counting) */
    uint64_t version;
    int64_t deadline;       /* step by which it must be installed */
    int64_t snapshot_step;  /* step whose end state the inputs are (for version stats) */
} ast_refresh;

typedef struct ast_result {
    uint64_t ticket, block, version;
    int64_t snapshot_step;
    int status;             /* 0, a linalg AST_E*, AST_EFAILED, AST_ECANCELED, AST_ESUPERSEDED, AST_ESHUTDOWN */
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

int ast_runtime_create(const ast_config *cfg, ast_runtime **out);
/* Same, with the failure detail written to errbuf. */
int ast_runtime_create_msg(const ast_config *cfg, ast_runtime **out, char *errbuf, size_t len);
void ast_runtime_destroy(ast_runtime *rt);
const ast_config *ast_runtime_config(const ast_runtime *rt);
/* Copy of the last error message set on this runtime ("" if none). */
int ast_runtime_last_error(ast_runtime *rt, char *buf, size_t len);

int ast_runtime_register(ast_runtime *rt, void *ptr, size_t nbytes, uint64_t *handle);
int ast_runtime_unregister(ast_runtime *rt, uint64_t handle);

int ast_runtime_submit(ast_runtime *rt, const ast_refresh *req, uint64_t *ticket);
int ast_runtime_cancel(ast_runtime *rt, uint64_t ticket);
int ast_runtime_poll(ast_runtime *rt, ast_result *out, size_t cap, size_t *n);
/* Bounded barrier: waits for one ticket; the wait time is counted in barrier stats. */
int ast_runtime_wait(ast_runtime *rt, uint64_t ticket, int64_t timeout_ns, ast_result *out);

/* The caller reports what it did with results, so stats can prove the staleness bound. */
void ast_runtime_note_install(ast_runtime *rt, int64_t snapshot_step, int64_t install_step);
void ast_runtime_note_nonfinite(ast_runtime *rt);

int ast_runtime_stats_get(ast_runtime *rt, ast_stats *out);

#ifdef __cplusplus
}
#endif
#endif
