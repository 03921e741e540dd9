/*
 * asteria/trace.h - a recorder of timestamped runtime events, exported as Chrome-trace JSON.
 *
 * Owns: the recorded events, an intern table of their names and categories, the names of the
 * lanes (Chrome "threads") they are drawn on, and the last-error message.
 *
 * Timestamps are CLOCK_MONOTONIC nanoseconds relative to the recorder's creation
 * (ast_trace_now). ast_trace_from_monotonic converts the absolute CLOCK_MONOTONIC stamps other
 * modules already carry (ast_completion's queued_ns / started_ns / done_ns) to that base.
 *
 * ast_trace_write_json writes the Chrome trace-event format ({"traceEvents": [...]}) that
 * Perfetto and chrome://tracing open: ph "X" for spans, "i" for instants, "M" metadata naming
 * the process and every lane that has events ("train", "worker 0", "shadow stream", ...).
 * Events are written in timestamp order (ties keep recording order). The file is written
 * to a temporary name in the same directory, fsync'ed and renamed over the real name, so a
 * half-written trace never exists under the real name.
 *
 * Thread safety: every function may be called from any thread concurrently, except
 * ast_trace_destroy, which must not race with other calls on the same recorder. One mutex
 * guards the event store; the critical section of ast_trace_event is an intern lookup and
 * an append to a chunked array (chunks never move, so an append never copies old events).
 * ast_trace_write_json copies the events out under the mutex and formats and writes them
 * with no lock held, so recording continues while a trace is written.
 */
#ifndef ASTERIA_TRACE_H
#define ASTERIA_TRACE_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct ast_trace ast_trace;

/* Lanes: a worker's lane is its index (>= 0); named lanes are negative, in [-999, -1]. */
#define AST_TRACE_LANE_TRAIN (-1)     /* the training thread */
#define AST_TRACE_LANE_SHADOW (-2)    /* the shadow CUDA stream (or its host stand-in) */
#define AST_TRACE_LANE_COHERENCE (-3) /* coherence syncs */
#define AST_TRACE_LANE_NVME (-4)      /* NVMe tier I/O */
#define AST_TRACE_LANE_MIN (-999)

/* What an event records. Each kind has a category, a default name and a phase; CUSTOM_*
 * take the name and category from the event. */
typedef enum ast_trace_kind {
    AST_TRACE_CUSTOM_INSTANT = 0, /* "i" */
    AST_TRACE_CUSTOM_SPAN = 1,    /* "X", ts .. ts + dur */
    AST_TRACE_JOB_QUEUED = 2,     /* "i" job   "job queued"    (lane of the submitter) */
    AST_TRACE_JOB_STARTED = 3,    /* "i" job   "job started"   (worker lane) */
    AST_TRACE_JOB_DONE = 4,       /* "i" job   "job done"      (worker lane) */
    AST_TRACE_JOB_RUN = 5,        /* "X" job   "refresh"       (worker lane, started .. done) */
    AST_TRACE_COPY_ISSUED = 6,    /* "i" copy  "copy issued" */
    AST_TRACE_COPY_DONE = 7,      /* "i" copy  "copy done" */
    AST_TRACE_COPY = 8,           /* "X" copy  "copy"          (issued .. done) */
    AST_TRACE_BARRIER_BEGIN = 9,  /* "i" barrier "barrier wait begin" */
    AST_TRACE_BARRIER_END = 10,   /* "i" barrier "barrier wait end" */
    AST_TRACE_BARRIER_WAIT = 11,  /* "X" barrier "barrier wait" */
    AST_TRACE_INSTALL = 12,       /* "i" install "install" */
    AST_TRACE_KIND_COUNT = 13
} ast_trace_kind;

typedef enum ast_trace_dir {
    AST_TRACE_DIR_NONE = 0,
    AST_TRACE_DIR_D2H = 1, /* written as "d2h" */
    AST_TRACE_DIR_H2D = 2  /* written as "h2d" */
} ast_trace_dir;

/* Which optional arguments an event carries (bits of ast_trace_ev.args). */
#define AST_TRACE_ARG_BLOCK 0x01u
#define AST_TRACE_ARG_VERSION 0x02u
#define AST_TRACE_ARG_BYTES 0x04u
#define AST_TRACE_ARG_WORKER 0x08u
#define AST_TRACE_ARG_STATUS 0x10u
#define AST_TRACE_ARG_STEP 0x20u

typedef struct ast_trace_ev {
    ast_trace_kind kind;
    const char *name;   /* NULL: the kind's default name; required for CUSTOM_*. Copied. */
    const char *cat;    /* NULL: the kind's category ("asteria" for CUSTOM_*). Copied. */
    int lane;           /* AST_TRACE_LANE_* or a worker index */
    uint64_t ts_ns;     /* ns since the recorder's creation (ast_trace_now) */
    uint64_t dur_ns;    /* spans only */
    unsigned args;      /* AST_TRACE_ARG_* bits: which of the fields below are written */
    uint64_t block, version, bytes;
    int64_t step;
    int worker;
    int status;         /* an AST_E* code, written with its name */
    ast_trace_dir dir;  /* written when not NONE */
} ast_trace_ev;

/* RETURN VALUE: 0, AST_EINVAL (out NULL), AST_ENOMEM. *out is NULL on failure. */
int ast_trace_create(ast_trace **out);
/* Frees tr and its events (NULL is a no-op). No return value. */
void ast_trace_destroy(ast_trace *tr);

/* RETURN VALUE: the nanoseconds since tr was created (CLOCK_MONOTONIC). */
uint64_t ast_trace_now(const ast_trace *tr);
/* RETURN VALUE: the absolute CLOCK_MONOTONIC stamp converted to tr's base; 0 for stamps before
 * creation. */
uint64_t ast_trace_from_monotonic(const ast_trace *tr, uint64_t monotonic_ns);

/* Records one event. RETURN VALUE: 0; AST_EINVAL (unknown kind, lane out of range, CUSTOM_*
 * without a name, name or category longer than 1023 bytes); AST_ENOMEM, or AST_ENOSPC when the
 * limit set by ast_trace_set_max_events is reached: the event is dropped and counted. */
int ast_trace_event(ast_trace *tr, const ast_trace_ev *ev);
/* Shorthands for ast_trace_event with kind CUSTOM_INSTANT / CUSTOM_SPAN and no arguments.
 * RETURN VALUE: as ast_trace_event. */
int ast_trace_instant(ast_trace *tr, int lane, const char *cat, const char *name, uint64_t ts_ns);
int ast_trace_complete(ast_trace *tr, int lane, const char *cat, const char *name,
                       uint64_t ts_ns, uint64_t dur_ns);

/* Names a lane ("nvme", "rank 3 sync"); replaces the default name. RETURN VALUE: 0,
 * AST_EINVAL, AST_ENOMEM. */
int ast_trace_name_lane(ast_trace *tr, int lane, const char *name);
/* Caps the number of events kept (0: no cap, the default); later events are dropped. A NULL tr
 * is a no-op. No return value. */
void ast_trace_set_max_events(ast_trace *tr, size_t max_events);

/* RETURN VALUE: the number of events recorded so far / dropped so far (0 for a NULL tr). */
size_t ast_trace_count(ast_trace *tr);
size_t ast_trace_dropped(ast_trace *tr);

/* Writes every event recorded so far to path as Chrome-trace JSON, atomically (see above).
 * RETURN VALUE: 0; AST_EINVAL (NULL or empty path); AST_EACCES (directory not writable or
 * read-only), AST_ENOENT (directory missing), AST_ENOSPC, AST_EIO (others, e.g. path is a
 * directory), AST_ENOMEM. On failure no file is left at path or at the temporary name, and
 * ast_trace_last_error describes the cause (naming the path and the failing call). */
int ast_trace_write_json(ast_trace *tr, const char *path);

/* Copy of the last error message ("" if none) into buf. RETURN VALUE: 0, AST_EINVAL. */
int ast_trace_last_error(ast_trace *tr, char *buf, size_t len);

#ifdef __cplusplus
}
#endif
#endif
