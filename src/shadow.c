/*
 * shadow.c - the shadow copy engine: snapshot (D2H) and prefetch (H2D) staging rings on a
 * low-priority stream (see shadow.h).
 *
 * Owns: the shadow stream, the two rings (memory, slot descriptors, per-slot events), the
 * copy statistics and the last-error text. May call: the CUDA runtime (streams, events, async
 * copies; every cudaError_t is read by ast__cuda_status of cuda_mem.h, which also serves the
 * allocations), trace.h, util.h, libc.
 *
 * Priority: the stream has the lowest priority of the device's range. That is the priority of
 * PyTorch's default streams too, so copies here compete with training on equal terms; training
 * that must win runs on a stream of higher priority (torch.cuda.Stream(priority=-1)).
 *
 * One code path for both backends: every ring operation, slot state change and statistic is
 * shared; only the four be_* functions (copy, query, wait, record a release) differ, and on the
 * host path they are memcpy or no-ops.
 *
 * Slot life cycle (per ring, slots in FIFO order, descriptor of sequence s at slots[s % max]):
 *   ISSUING --copy enqueued--> INFLIGHT --event passed--> READY
 *   any of INFLIGHT / READY --release--> RELEASED, --release_after--> RELEASE_PENDING
 *   RELEASED, or RELEASE_PENDING once its release event passed, is reclaimed when it is the
 *   oldest live slot; its bytes return to the ring.
 * A slot in ISSUING is never reclaimed, handed out or released, so the copy may be enqueued
 * without the lock while the slot's bytes stay reserved.
 *
 * Stream ordering (CUDA path). Every copy runs on the shadow stream and ends by recording its
 * slot's done event.
 *   snapshot (D2H into a pinned slot): the shadow stream first waits on the caller's event
 *   (recorded on the producer's stream after it wrote the source); host threads read the slot
 *   only after the done event passed (snapshot_wait / snapshot_query); a producer that
 *   overwrites the source in place makes its stream wait on snapshot_event first. The slot is
 *   reused after snapshot_release, which its last host reader calls: no stream reads a
 *   snapshot slot.
 *   prefetch (H2D into a device slot): the consumer's stream waits on the done event
 *   (ready_event) or a host thread waits for it (prefetch_wait; lookup polls). release_after
 *   records the slot's release event on the consumer's stream after the reads it queued; the
 *   slot's bytes return to the ring only once that event has passed (ring_reclaim), so a later
 *   copy never overwrites bytes a queued consumer kernel has yet to read. release (no event) is
 *   for a consumer that has finished reading (the host path, or after a synchronisation).
 * Every status from the runtime goes through ast__cuda_status (cuda_mem.h), which also takes
 * it out of the calling thread's last-error slot: cudaEventQuery answers cudaErrorNotReady on
 * every poll of a copy in flight (snapshot_query, snapshot_wait's first poll, lookup, and the
 * release events' queries in every reclaim: prefetch, release, stats), and the slot it would
 * otherwise leave is the one PyTorch checks after each kernel launch.
 *
 * Locking: sh->mu guards both rings (offsets, sequence numbers, slot states), the statistics
 * and err (the last-error text). It is held around non-blocking CUDA calls only (cudaEventQuery,
 * cudaEventRecord). The copy itself (cudaStreamWaitEvent + cudaMemcpyAsync + cudaEventRecord,
 * which can block on a pageable source, or a memcpy on the host path) runs with the lock
 * released, and so does cudaEventSynchronize in the waits. Lock order: sh->mu, then the trace
 * recorder's mutex (trace never calls back). Immutable after creation, read without the lock:
 * the stream, the ring bases and capacities, the event handles, cuda, device, priority.
 */
#include "asteria/shadow.h"

#include "asteria/build_config.h"
#include "asteria/errors.h"
#include "util.h"
#include "asteria/trace.h"

#include "cuda_mem.h"

#include <inttypes.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#if ASTERIA_HAVE_CUDA
#include <cuda_runtime.h>
#endif

#define DEFAULT_RING_BYTES ((size_t)64 << 20)
#define DEFAULT_MAX_SLOTS 64u

typedef enum slot_state {
    S_FREE = 0,
    S_ISSUING,
    S_INFLIGHT,
    S_READY,
    S_RELEASE_PENDING,
    S_RELEASED
} slot_state;

typedef struct slot {
    uint64_t seq;
    uint64_t key;           /* prefetch key; unused for snapshots */
    size_t off, nbytes;
    slot_state state;
    uint64_t issued_ns;     /* trace base, for the copy span */
    void *done_ev;          /* cudaEvent_t recorded after the copy (NULL on the host path) */
    void *release_ev;       /* cudaEvent_t recorded on the consumer's stream by release_after */
} slot;

typedef struct ring {
    const char *what;       /* "snapshot ring" / "prefetch ring", for messages */
    const char *opt;        /* the option that sizes it */
    ast_trace_dir dir;
    char *base;
    size_t cap;             /* a multiple of AST_SHADOW_ALIGN */
    slot *slots;
    unsigned max;
    uint64_t tail_seq, head_seq; /* live slots: [tail_seq, head_seq) */
    size_t head;            /* byte offset where the next slot would start */
    uint64_t hwm, wraps;
} ring;

struct ast_shadow {
    pthread_mutex_t mu;
    int cuda;
    int device;
    int priority;
    void *stream;           /* cudaStream_t */
    ast_trace *trace;
    ring snap, pre;
    uint64_t d2h_bytes, h2d_bytes, d2h_copies, h2d_copies, busy;
    ast__last_error err; /* named: "AST_E...: message" */
};

/* ---- backend: the only code that differs between CUDA and host ------------------------------ */

#if ASTERIA_HAVE_CUDA
/* A call that did not succeed, through the one reader of CUDA statuses (cuda_mem.h), which
 * also clears the thread's last-error slot. NotReady from a call that waits is an error too. */
static int cuda_fail(cudaError_t e, const char *call, char *err, size_t len)
{
    int rc = ast__cuda_status(e, call, err, len);
    return rc < 0 ? rc : AST_ECUDA;
}

/* Makes sh's device current for the calling thread; *prev receives the one to restore (-1:
 * nothing to restore). Failing to make it current is an error of the call: every copy, event
 * and slot of sh belongs to that device. */
static int dev_enter(ast_shadow *sh, int *prev)
{
    char err[256];
    cudaError_t e;
    *prev = -1;
    if (!sh->cuda)
        return 0;
    if ((e = cudaGetDevice(prev)) != cudaSuccess) {
        *prev = -1;
        cuda_fail(e, "cudaGetDevice", err, sizeof err);
        return ast__set_error(&sh->err, &sh->mu, AST_ECUDA, "device %d: %s", sh->device, err);
    }
    if (*prev != sh->device && (e = cudaSetDevice(sh->device)) != cudaSuccess) {
        *prev = -1;
        cuda_fail(e, "cudaSetDevice", err, sizeof err);
        return ast__set_error(&sh->err, &sh->mu, AST_ECUDA, "device %d: %s", sh->device, err);
    }
    return 0;
}

static void dev_leave(const ast_shadow *sh, int prev)
{
    if (sh->cuda && prev >= 0 && prev != sh->device)
        ast__cuda_status(cudaSetDevice(prev), "cudaSetDevice", NULL, 0);
}
#else
static int dev_enter(ast_shadow *sh, int *prev)
{
    *prev = -1;
    return 0;
}

static void dev_leave(const ast_shadow *sh, int prev)
{
}
#endif

/* Enqueues the pieces back to back at dst after wait_event, then records done_ev (host path:
 * copies now). */
static int be_copy(ast_shadow *sh, char *dst, const ast_shadow_piece *pc, int npc,
                   void *wait_event, void *done_ev, char *err, size_t len)
{
#if ASTERIA_HAVE_CUDA
    if (sh->cuda) {
        cudaStream_t s = (cudaStream_t)sh->stream;
        cudaError_t e;
        if (wait_event && (e = cudaStreamWaitEvent(s, (cudaEvent_t)wait_event, 0)) != cudaSuccess)
            return cuda_fail(e, "cudaStreamWaitEvent", err, len);
        for (int i = 0; i < npc; dst += pc[i].nbytes, i++)
            if ((e = cudaMemcpyAsync(dst, pc[i].src, pc[i].nbytes, cudaMemcpyDefault, s)) !=
                cudaSuccess)
                return cuda_fail(e, "cudaMemcpyAsync", err, len);
        if ((e = cudaEventRecord((cudaEvent_t)done_ev, s)) != cudaSuccess)
            return cuda_fail(e, "cudaEventRecord", err, len);
        return 0;
    }
#endif
    for (int i = 0; i < npc; dst += pc[i].nbytes, i++)
        memcpy(dst, pc[i].src, pc[i].nbytes);
    return 0;
}

/* 1: the work before ev has completed; 0: not yet; < 0: error. */
static int be_passed(ast_shadow *sh, void *ev, char *err, size_t len)
{
#if ASTERIA_HAVE_CUDA
    if (sh->cuda) {
        /* NotReady is the common answer here, and the runtime keeps it in the thread's
         * last-error slot: ast__cuda_status takes it out (cuda_mem.h says why) */
        int rc = ast__cuda_status(cudaEventQuery((cudaEvent_t)ev), "cudaEventQuery", err, len);
        return rc == 0 ? 1 : rc == AST__CUDA_NOT_READY ? 0 : rc;
    }
#endif
    return 1;
}

/* Blocks (the events use cudaEventBlockingSync: the thread sleeps) until ev has passed. */
static int be_wait(ast_shadow *sh, void *ev, char *err, size_t len)
{
#if ASTERIA_HAVE_CUDA
    if (sh->cuda) {
        cudaError_t e = cudaEventSynchronize((cudaEvent_t)ev);
        return e == cudaSuccess ? 0 : cuda_fail(e, "cudaEventSynchronize", err, len);
    }
#endif
    return 0;
}

/* Records ev on the consumer's stream. */
static int be_record(ast_shadow *sh, void *ev, uintptr_t stream, char *err, size_t len)
{
#if ASTERIA_HAVE_CUDA
    if (sh->cuda) {
        cudaError_t e = cudaEventRecord((cudaEvent_t)ev, (cudaStream_t)stream);
        return e == cudaSuccess ? 0 : cuda_fail(e, "cudaEventRecord(consumer stream)", err, len);
    }
#endif
    return 0;
}

/* ---- rings (sh->mu held) ------------------------------------------------------------------ */

static uint64_t ring_live(const ring *r)
{
    return r->head_seq - r->tail_seq;
}

static slot *ring_at(ring *r, uint64_t seq)
{
    return &r->slots[seq % r->max];
}

/* Bytes not available: live slots plus the tail skipped by a wrap. */
static size_t ring_used(ring *r)
{
    if (!ring_live(r))
        return 0;
    size_t tail = ring_at(r, r->tail_seq)->off;
    return r->head > tail ? r->head - tail : r->cap - (tail - r->head);
}

/* Returns released slots at the tail to the ring. */
static int ring_reclaim(ast_shadow *sh, ring *r)
{
    char err[256];
    while (ring_live(r)) {
        slot *s = ring_at(r, r->tail_seq);
        if (s->state == S_RELEASE_PENDING) {
            int p = be_passed(sh, s->release_ev, err, sizeof err);
            if (p < 0)
                return ast__set_error(&sh->err, NULL, p, "%s: %s", r->what, err);
            if (!p)
                break;
        } else if (s->state != S_RELEASED) {
            break;
        }
        s->state = S_FREE;
        r->tail_seq++;
    }
    return 0;
}

/* Reserves AST_SHADOW_ALIGN-rounded nbytes (<= cap, checked by the caller) in FIFO order. */
static int ring_alloc(ast_shadow *sh, ring *r, size_t nbytes, slot **out)
{
    int rc = ring_reclaim(sh, r);
    if (rc)
        return rc;
    size_t a = (nbytes + AST_SHADOW_ALIGN - 1) / AST_SHADOW_ALIGN * AST_SHADOW_ALIGN;
    size_t off;
    if (ring_live(r) == r->max) {
        sh->busy++;
        return ast__set_error(&sh->err, NULL, AST_EBUSY, "%s: all %u slots are in use", r->what,
                              r->max);
    }
    if (!ring_live(r)) {
        off = 0;
    } else {
        size_t tail = ring_at(r, r->tail_seq)->off;
        if (r->head > tail && r->cap - r->head >= a) {
            off = r->head;
        } else if (r->head > tail && tail >= a) {
            off = 0;
            r->wraps++;
        } else if (r->head <= tail && tail - r->head >= a) {
            off = r->head;
        } else {
            sh->busy++;
            return ast__set_error(&sh->err, NULL, AST_EBUSY,
                                  "%s: no room for %zu bytes (%zu of %zu in use by %" PRIu64
                                  " slots); release slots first", r->what, nbytes, ring_used(r),
                                  r->cap, ring_live(r));
        }
    }
    slot *s = ring_at(r, r->head_seq);
    s->seq = r->head_seq++;
    s->off = off;
    s->nbytes = nbytes;
    s->key = 0;
    s->state = S_ISSUING;
    r->head = off + a;
    size_t used = ring_used(r);
    if (used > r->hwm)
        r->hwm = used;
    *out = s;
    return 0;
}

/* The live slot of sequence seq, or NULL. */
static slot *ring_find_seq(ring *r, uint64_t seq)
{
    if (seq < r->tail_seq || seq >= r->head_seq)
        return NULL;
    slot *s = ring_at(r, seq);
    return s->seq == seq ? s : NULL;
}

static int held(const slot *s)
{
    return s && (s->state == S_ISSUING || s->state == S_INFLIGHT || s->state == S_READY);
}

static slot *ring_find_key(ring *r, uint64_t key)
{
    for (uint64_t q = r->tail_seq; q < r->head_seq; q++) {
        slot *s = ring_at(r, q);
        if (s->key == key && held(s))
            return s;
    }
    return NULL;
}

static void trace_copy(ast_shadow *sh, ast_trace_kind kind, const ring *r, const slot *s)
{
    if (!sh->trace)
        return;
    uint64_t now = ast_trace_now(sh->trace);
    ast_trace_ev ev = {.kind = kind, .lane = AST_TRACE_LANE_SHADOW, .ts_ns = now,
                       .args = AST_TRACE_ARG_BYTES, .bytes = s->nbytes, .dir = r->dir};
    if (r->dir == AST_TRACE_DIR_H2D) {
        ev.args |= AST_TRACE_ARG_BLOCK;
        ev.block = s->key;
    }
    if (kind == AST_TRACE_COPY) {
        ev.ts_ns = s->issued_ns;
        ev.dur_ns = now > s->issued_ns ? now - s->issued_ns : 0;
    }
    ast_trace_event(sh->trace, &ev);
}

/* INFLIGHT -> READY once the copy's event has passed. 0 ready, AST_EBUSY not yet, < 0 error. */
static int slot_poll(ast_shadow *sh, ring *r, slot *s)
{
    char err[256];
    if (s->state == S_READY)
        return 0;
    if (s->state == S_ISSUING)
        return AST_EBUSY;
    int p = be_passed(sh, s->done_ev, err, sizeof err);
    if (p < 0)
        return ast__set_error(&sh->err, NULL, p, "%s: %s", r->what, err);
    if (!p)
        return AST_EBUSY;
    s->state = S_READY;
    trace_copy(sh, AST_TRACE_COPY, r, s);
    return 0;
}

/* Blocks until s (seq) is READY; called with sh->mu held, drops it around the wait. */
static int slot_wait(ast_shadow *sh, ring *r, slot *s)
{
    char err[256];
    int rc = slot_poll(sh, r, s);
    if (rc != AST_EBUSY)
        return rc;
    if (s->state == S_ISSUING)
        return ast__set_error(&sh->err, NULL, AST_EBUSY,
                              "%s: copy still being issued by another thread", r->what);
    uint64_t seq = s->seq;
    void *ev = s->done_ev;
    pthread_mutex_unlock(&sh->mu);
    rc = be_wait(sh, ev, err, sizeof err);
    pthread_mutex_lock(&sh->mu);
    if (rc)
        return ast__set_error(&sh->err, NULL, rc, "%s: %s", r->what, err);
    s = ring_find_seq(r, seq);
    if (!held(s))
        return ast__set_error(&sh->err, NULL, AST_ENOENT, "%s: slot released during the wait",
                              r->what);
    return slot_poll(sh, r, s);
}

/* Reserves a slot (for a prefetch: refusing a key already staged), issues the copy with the
 * lock dropped, and publishes the slot as INFLIGHT; *seq and *off describe it. */
static int ring_issue(ast_shadow *sh, ring *r, const ast_shadow_piece *pc, int npc, size_t n,
                      uint64_t key, void *wait_event, uint64_t *seq, size_t *off)
{
    char err[256];
    pthread_mutex_lock(&sh->mu);
    slot *s = NULL;
    int rc = 0;
    if (r->dir == AST_TRACE_DIR_H2D && ring_find_key(r, key))
        rc = ast__set_error(&sh->err, NULL, AST_ESTATE, "%s: key %" PRIu64
                            " is already staged; release it first", r->what, key);
    if (!rc)
        rc = ring_alloc(sh, r, n, &s);
    if (rc) {
        pthread_mutex_unlock(&sh->mu);
        return rc;
    }
    s->key = key;
    *seq = s->seq;
    *off = s->off;
    void *done_ev = s->done_ev;
    if (sh->trace)
        s->issued_ns = ast_trace_now(sh->trace);
    trace_copy(sh, AST_TRACE_COPY_ISSUED, r, s);
    pthread_mutex_unlock(&sh->mu);

    rc = be_copy(sh, r->base + *off, pc, npc, wait_event, done_ev, err, sizeof err);

    pthread_mutex_lock(&sh->mu);
    s = ring_at(r, *seq); /* ISSUING: nobody else changes it */
    if (rc) {
        s->state = S_RELEASED;
        ring_reclaim(sh, r);
        ast__set_error(&sh->err, NULL, rc, "%s: %zu bytes: %s", r->what, n, err);
    } else {
        s->state = S_INFLIGHT;
        if (r->dir == AST_TRACE_DIR_D2H) {
            sh->d2h_bytes += n;
            sh->d2h_copies++;
        } else {
            sh->h2d_bytes += n;
            sh->h2d_copies++;
        }
    }
    pthread_mutex_unlock(&sh->mu);
    return rc;
}

/* ---- create / destroy --------------------------------------------------------------------- */

void ast_shadow_opts_init(ast_shadow_opts *o)
{
    memset(o, 0, sizeof *o);
    o->mode = AST_SHADOW_AUTO;
    o->device = -1;
    o->snapshot_bytes = DEFAULT_RING_BYTES;
    o->ring_bytes = DEFAULT_RING_BYTES;
    o->max_slots = DEFAULT_MAX_SLOTS;
}

static void ring_free(ast_shadow *sh, ring *r)
{
    if (r->slots) {
        for (unsigned i = 0; i < r->max; i++) {
#if ASTERIA_HAVE_CUDA
            if (r->slots[i].done_ev)
                ast__cuda_status(cudaEventDestroy((cudaEvent_t)r->slots[i].done_ev),
                                 "cudaEventDestroy", NULL, 0);
            if (r->slots[i].release_ev)
                ast__cuda_status(cudaEventDestroy((cudaEvent_t)r->slots[i].release_ev),
                                 "cudaEventDestroy", NULL, 0);
#endif
        }
        free(r->slots);
    }
    if (r->base) {
        if (!sh->cuda)
            free(r->base);
        else if (r->dir == AST_TRACE_DIR_D2H)
            ast__cuda_host_free(r->base, NULL, 0);
        else
            ast__cuda_free(r->base, NULL, 0);
    }
}

static int ring_init(ast_shadow *sh, ring *r, size_t cap, unsigned max, char *err, size_t len)
{
    r->cap = (cap + AST_SHADOW_ALIGN - 1) / AST_SHADOW_ALIGN * AST_SHADOW_ALIGN;
    r->max = max;
    r->slots = calloc(max, sizeof *r->slots);
    if (!r->slots)
        return AST_ENOMEM;
    int rc = 0;
    void *p = NULL;
    if (!sh->cuda) {
        p = aligned_alloc(AST_SHADOW_ALIGN, r->cap);
        if (!p)
            rc = AST_ENOMEM;
        else
            memset(p, 0, r->cap);
    } else if (r->dir == AST_TRACE_DIR_D2H) {
        rc = ast__cuda_host_alloc(&p, r->cap, err, len);
    } else {
        rc = ast__cuda_malloc(&p, r->cap, err, len);
    }
    if (rc == AST_ENOMEM)
        return ast__errorf(err, len, rc, "%s: cannot allocate %zu bytes", r->what, r->cap);
    if (rc)
        return rc;
    r->base = p;
#if ASTERIA_HAVE_CUDA
    for (unsigned i = 0; sh->cuda && i < max; i++) {
        cudaEvent_t d, q;
        cudaError_t e =
            cudaEventCreateWithFlags(&d, cudaEventDisableTiming | cudaEventBlockingSync);
        if (e != cudaSuccess)
            return cuda_fail(e, "cudaEventCreateWithFlags", err, len);
        r->slots[i].done_ev = d;
        e = cudaEventCreateWithFlags(&q, cudaEventDisableTiming);
        if (e != cudaSuccess)
            return cuda_fail(e, "cudaEventCreateWithFlags", err, len);
        r->slots[i].release_ev = q;
    }
#endif
    return 0;
}

/* Chooses the path: CUDA when allowed and a device exists, on opts.device or the current one. */
static int pick_path(ast_shadow *sh, const ast_shadow_opts *o, int ndev, char *err, size_t len)
{
#if ASTERIA_HAVE_CUDA
    if (o->mode == AST_SHADOW_HOST || ndev == 0)
        return 0;
    int dev = o->device;
    if (dev >= ndev)
        return ast__errorf(err, len, AST_EINVAL, "opts.device %d: only %d CUDA device(s)", dev,
                           ndev);
    cudaError_t e;
    if (dev < 0 && (e = cudaGetDevice(&dev)) != cudaSuccess)
        return cuda_fail(e, "cudaGetDevice", err, len);
    sh->device = dev;
    sh->cuda = 1;
#endif
    return 0;
}

/* The shadow stream, on the current device: non-blocking (no implicit sync with the legacy
 * default stream, which PyTorch uses) and at the lowest priority. */
static int stream_init(ast_shadow *sh, char *err, size_t len)
{
#if ASTERIA_HAVE_CUDA
    if (!sh->cuda)
        return 0;
    cudaError_t e;
    int least, greatest;
    if ((e = cudaDeviceGetStreamPriorityRange(&least, &greatest)) != cudaSuccess)
        return cuda_fail(e, "cudaDeviceGetStreamPriorityRange", err, len);
    /* "least" is the lowest priority, which CUDA gives the numerically greatest value. */
    cudaStream_t s;
    if ((e = cudaStreamCreateWithPriority(&s, cudaStreamNonBlocking, least)) != cudaSuccess)
        return cuda_fail(e, "cudaStreamCreateWithPriority", err, len);
    sh->stream = s;
    if ((e = cudaStreamGetPriority(s, &sh->priority)) != cudaSuccess)
        return cuda_fail(e, "cudaStreamGetPriority", err, len);
#endif
    return 0;
}

void ast_shadow_destroy(ast_shadow *sh)
{
    if (!sh)
        return;
    int prev;
    dev_enter(sh, &prev); /* on failure the frees below still run, on the current device */
#if ASTERIA_HAVE_CUDA
    /* Only the shadow stream is waited for. A consumer stream may still read a prefetch slot
     * it was given before release_after: the cudaFree of the device ring below synchronises the
     * whole device first (the runtime's documented behaviour for cudaFree), so that read
     * finishes before the memory goes. The snapshot ring is host memory read by host threads
     * only after their copy's event passed. */
    if (sh->stream)
        ast__cuda_status(cudaStreamSynchronize((cudaStream_t)sh->stream),
                         "cudaStreamSynchronize", NULL, 0);
#endif
    ring_free(sh, &sh->snap);
    ring_free(sh, &sh->pre);
#if ASTERIA_HAVE_CUDA
    if (sh->stream)
        ast__cuda_status(cudaStreamDestroy((cudaStream_t)sh->stream), "cudaStreamDestroy",
                         NULL, 0);
#endif
    dev_leave(sh, prev);
    pthread_mutex_destroy(&sh->mu);
    free(sh);
}

int ast_shadow_create(const ast_shadow_opts *opts, ast_shadow **out, char *errbuf, size_t len)
{
    if (errbuf && len)
        errbuf[0] = '\0';
    if (!out)
        return ast__errorf(errbuf, len, AST_EINVAL, "ast_shadow_create: out is NULL");
    *out = NULL;
    ast_shadow_opts o;
    if (opts)
        o = *opts;
    else
        ast_shadow_opts_init(&o);
    if (!o.snapshot_bytes || !o.ring_bytes || !o.max_slots ||
        (unsigned)o.mode > AST_SHADOW_CUDA || o.snapshot_bytes > SIZE_MAX / 2 ||
        o.ring_bytes > SIZE_MAX / 2) {
        return ast__errorf(errbuf, len, AST_EINVAL,
                           "snapshot_bytes (%zu), ring_bytes (%zu) and max_slots (%u) must be > 0, "
                           "mode one of auto/host/cuda",
                           o.snapshot_bytes, o.ring_bytes, o.max_slots);
    }
    int ndev = ast__cuda_device_count();
    if (o.mode == AST_SHADOW_CUDA && ndev == 0) {
        return ast__errorf(errbuf, len, AST_ENODEV, "%s",
                           ASTERIA_HAVE_CUDA ? "mode cuda: no CUDA device present"
                                             : "mode cuda: libasteria was built without CUDA");
    }
    ast_shadow *sh = calloc(1, sizeof *sh);
    if (!sh)
        return ast__errorf(errbuf, len, AST_ENOMEM, "ast_shadow_create: out of memory");
    if (pthread_mutex_init(&sh->mu, NULL)) {
        free(sh);
        return ast__errorf(errbuf, len, AST_ENOMEM, "ast_shadow_create: no mutex");
    }
    sh->err.named = 1;
    sh->device = -1;
    sh->trace = o.trace;
    sh->snap = (ring){.what = "snapshot ring", .opt = "snapshot_bytes", .dir = AST_TRACE_DIR_D2H};
    sh->pre = (ring){.what = "prefetch ring", .opt = "ring_bytes", .dir = AST_TRACE_DIR_H2D};

    int prev = -1;
    int rc = pick_path(sh, &o, ndev, errbuf, len);
    if (!rc && (rc = dev_enter(sh, &prev)) != 0)
        ast__errorf(errbuf, len, rc, "%s", sh->err.text);
    if (!rc)
        rc = stream_init(sh, errbuf, len);
    if (!rc)
        rc = ring_init(sh, &sh->snap, o.snapshot_bytes, o.max_slots, errbuf, len);
    if (!rc)
        rc = ring_init(sh, &sh->pre, o.ring_bytes, o.max_slots, errbuf, len);
    dev_leave(sh, prev);
    if (rc) {
        ast_shadow_destroy(sh);
        return rc;
    }
    *out = sh;
    return 0;
}

int ast_shadow_is_cuda(const ast_shadow *sh)
{
    return sh && sh->cuda;
}

int ast_shadow_stream_handle(const ast_shadow *sh, uintptr_t *out)
{
    if (!sh || !out)
        return AST_EINVAL;
    *out = (uintptr_t)sh->stream;
    return sh->cuda ? 0 : AST_ENODEV;
}

/* ---- snapshots ---------------------------------------------------------------------------- */

static int check_copy_args(ast_shadow *sh, const ring *r, const void *src, size_t nbytes,
                           void *wait_event)
{
    if (!src || !nbytes)
        return ast__set_error(&sh->err, &sh->mu, AST_EINVAL, "%s: NULL source or zero size",
                              r->what);
    if (nbytes > r->cap)
        return ast__set_error(&sh->err, &sh->mu, AST_EINVAL, "%s: a copy of %zu bytes exceeds the "
                              "ring capacity of %zu bytes (raise opts.%s)", r->what, nbytes, r->cap,
                              r->opt);
    if (wait_event && !sh->cuda)
        return ast__set_error(&sh->err, &sh->mu, AST_EINVAL,
                              "%s: an event to wait on needs the CUDA path", r->what);
    return 0;
}

/* Checks a copy of nbytes in total and issues it into r on sh's device (ring_issue's
 * arguments); *seq and *off receive its slot. */
static int issue_copy(ast_shadow *sh, ring *r, const ast_shadow_piece *pieces, int npieces,
                      size_t nbytes, uint64_t key, void *wait_event, uint64_t *seq, size_t *off)
{
    int prev;
    int rc = check_copy_args(sh, r, pieces[0].src, nbytes, wait_event);
    if (!rc && (rc = dev_enter(sh, &prev)) == 0) {
        rc = ring_issue(sh, r, pieces, npieces, nbytes, key, wait_event, seq, off);
        dev_leave(sh, prev);
    }
    return rc;
}

int ast_shadow_snapshot(ast_shadow *sh, const void *src, size_t nbytes, void *wait_event,
                        ast_shadow_ticket *t)
{
    const ast_shadow_piece one = {src, nbytes};
    return ast_shadow_snapshotv(sh, &one, 1, wait_event, t);
}

int ast_shadow_snapshotv(ast_shadow *sh, const ast_shadow_piece *pieces, int npieces,
                         void *wait_event, ast_shadow_ticket *t)
{
    if (!sh || !t)
        return AST_EINVAL;
    memset(t, 0, sizeof *t);
    if (!pieces || npieces < 1)
        return ast__set_error(&sh->err, &sh->mu, AST_EINVAL, "%s: no pieces to copy (npieces %d)",
                              sh->snap.what, npieces);
    size_t nbytes = 0;
    for (int i = 0; i < npieces; i++) {
        if (!pieces[i].src || !pieces[i].nbytes)
            return ast__set_error(&sh->err, &sh->mu, AST_EINVAL,
                                  "%s: piece %d of %d has a NULL source or zero size",
                                  sh->snap.what, i, npieces);
        if (pieces[i].nbytes > SIZE_MAX - nbytes)
            return ast__set_error(&sh->err, &sh->mu, AST_EINVAL, "%s: the pieces' sizes overflow",
                                  sh->snap.what);
        nbytes += pieces[i].nbytes;
    }
    uint64_t seq;
    size_t off;
    int rc = issue_copy(sh, &sh->snap, pieces, npieces, nbytes, 0, wait_event, &seq, &off);
    if (!rc) {
        t->id = seq + 1;
        t->host = sh->snap.base + off;
        t->nbytes = nbytes;
    }
    return rc;
}

/* The held snapshot slot of t (sh->mu held), or NULL with the error set. */
static slot *find_ticket(ast_shadow *sh, const ast_shadow_ticket *t)
{
    slot *s = t && t->id ? ring_find_seq(&sh->snap, t->id - 1) : NULL;
    if (!held(s)) {
        ast__set_error(&sh->err, NULL, AST_ENOENT, "snapshot ticket %" PRIu64
                       " unknown or released", t ? t->id : 0);
        return NULL;
    }
    return s;
}

/* The held prefetch slot of key (sh->mu held), or NULL with the error set. */
static slot *find_key(ast_shadow *sh, uint64_t key)
{
    slot *s = ring_find_key(&sh->pre, key);
    if (!s)
        ast__set_error(&sh->err, NULL, AST_ENOENT, "prefetch ring: key %" PRIu64 " is not staged",
                       key);
    return s;
}

/* Marks s released (or pending on stream) and reclaims (sh->mu held). */
static int slot_release(ast_shadow *sh, ring *r, slot *s, int after, uintptr_t stream)
{
    char err[256];
    if (s->state == S_ISSUING)
        return ast__set_error(&sh->err, NULL, AST_EBUSY,
                              "%s: copy still being issued by another thread", r->what);
    if (after && sh->cuda) {
        int rc = be_record(sh, s->release_ev, stream, err, sizeof err);
        if (rc)
            return ast__set_error(&sh->err, NULL, rc, "%s: %s", r->what, err);
        s->state = S_RELEASE_PENDING;
    } else {
        s->state = S_RELEASED;
    }
    return ring_reclaim(sh, r);
}

/* What slot_call does to the slot it finds. */
enum slot_op { OP_POLL, OP_WAIT, OP_RELEASE, OP_RELEASE_AFTER };

/* Runs op, on sh's device with sh->mu held, on the held snapshot slot of t when snap, else on
 * the staged prefetch slot of key (AST_ENOENT, error set, when there is none). When found,
 * *dev and *nbytes (either may be NULL) receive the slot's place and size, read under the lock
 * before op. stream: OP_RELEASE_AFTER's stream. */
static int slot_call(ast_shadow *sh, int snap, const ast_shadow_ticket *t, uint64_t key,
                     enum slot_op op, uintptr_t stream, void **dev, size_t *nbytes)
{
    if (!sh)
        return AST_EINVAL;
    ring *r = snap ? &sh->snap : &sh->pre;
    int prev, rc;
    if ((rc = dev_enter(sh, &prev)) != 0)
        return rc;
    pthread_mutex_lock(&sh->mu);
    slot *s = snap ? find_ticket(sh, t) : find_key(sh, key);
    if (s && dev) /* before op: a release may reclaim s */
        *dev = r->base + s->off;
    if (s && nbytes)
        *nbytes = s->nbytes;
    if (!s)
        rc = AST_ENOENT;
    else if (op == OP_POLL)
        rc = slot_poll(sh, r, s);
    else if (op == OP_WAIT)
        rc = slot_wait(sh, r, s);
    else
        rc = slot_release(sh, r, s, op == OP_RELEASE_AFTER, stream);
    pthread_mutex_unlock(&sh->mu);
    dev_leave(sh, prev);
    return rc;
}

int ast_shadow_snapshot_query(ast_shadow *sh, const ast_shadow_ticket *t)
{
    return slot_call(sh, 1, t, 0, OP_POLL, 0, NULL, NULL);
}

int ast_shadow_snapshot_wait(ast_shadow *sh, const ast_shadow_ticket *t)
{
    return slot_call(sh, 1, t, 0, OP_WAIT, 0, NULL, NULL);
}

int ast_shadow_snapshot_event(ast_shadow *sh, const ast_shadow_ticket *t, void **event)
{
    if (!sh || !event)
        return AST_EINVAL;
    *event = NULL;
    pthread_mutex_lock(&sh->mu);
    slot *s = find_ticket(sh, t);
    int rc = s ? 0 : AST_ENOENT;
    if (s)
        *event = s->done_ev;
    pthread_mutex_unlock(&sh->mu);
    return rc;
}

int ast_shadow_snapshot_release(ast_shadow *sh, const ast_shadow_ticket *t)
{
    return slot_call(sh, 1, t, 0, OP_RELEASE, 0, NULL, NULL);
}

/* ---- prefetch ----------------------------------------------------------------------------- */

int ast_shadow_prefetch(ast_shadow *sh, const void *src, size_t nbytes, uint64_t key,
                        void **dev)
{
    if (!sh)
        return AST_EINVAL;
    if (dev)
        *dev = NULL;
    const ast_shadow_piece one = {src, nbytes};
    uint64_t seq;
    size_t off;
    int rc = issue_copy(sh, &sh->pre, &one, 1, nbytes, key, NULL, &seq, &off);
    if (!rc && dev)
        *dev = sh->pre.base + off;
    return rc;
}

int ast_shadow_ready_event(ast_shadow *sh, uint64_t key, void **event)
{
    if (!sh || !event)
        return AST_EINVAL;
    *event = NULL;
    int rc = 0;
    pthread_mutex_lock(&sh->mu);
    slot *s = find_key(sh, key);
    if (!s)
        rc = AST_ENOENT;
    else if (s->state == S_ISSUING)
        rc = ast__set_error(&sh->err, NULL, AST_EBUSY, "prefetch ring: key %" PRIu64
                            " is still being issued", key);
    else
        *event = s->done_ev;
    pthread_mutex_unlock(&sh->mu);
    return rc;
}

int ast_shadow_lookup(ast_shadow *sh, uint64_t key, void **dev, size_t *nbytes)
{
    if (!sh)
        return AST_EINVAL;
    if (dev)
        *dev = NULL;
    if (nbytes)
        *nbytes = 0;
    return slot_call(sh, 0, NULL, key, OP_POLL, 0, dev, nbytes);
}

int ast_shadow_prefetch_wait(ast_shadow *sh, uint64_t key)
{
    return slot_call(sh, 0, NULL, key, OP_WAIT, 0, NULL, NULL);
}

int ast_shadow_release(ast_shadow *sh, uint64_t key)
{
    return slot_call(sh, 0, NULL, key, OP_RELEASE, 0, NULL, NULL);
}

int ast_shadow_release_after(ast_shadow *sh, uint64_t key, uintptr_t stream)
{
    return slot_call(sh, 0, NULL, key, OP_RELEASE_AFTER, stream, NULL, NULL);
}

/* ---- stats / errors ----------------------------------------------------------------------- */

int ast_shadow_stats_get(ast_shadow *sh, ast_shadow_stats *out)
{
    if (!sh || !out)
        return AST_EINVAL;
    int prev, rc;
    if ((rc = dev_enter(sh, &prev)) != 0)
        return rc;
    pthread_mutex_lock(&sh->mu);
    ring_reclaim(sh, &sh->pre);
    ring_reclaim(sh, &sh->snap);
    *out = (ast_shadow_stats){
        .d2h_bytes = sh->d2h_bytes, .h2d_bytes = sh->h2d_bytes,
        .d2h_copies = sh->d2h_copies, .h2d_copies = sh->h2d_copies, .busy = sh->busy,
        .ring_capacity = sh->pre.cap, .ring_used = ring_used(&sh->pre),
        .ring_high_water = sh->pre.hwm, .ring_wraps = sh->pre.wraps,
        .ring_slots = ring_live(&sh->pre),
        .snapshot_capacity = sh->snap.cap, .snapshot_used = ring_used(&sh->snap),
        .snapshot_high_water = sh->snap.hwm, .snapshot_wraps = sh->snap.wraps,
        .snapshot_slots = ring_live(&sh->snap),
        .is_cuda = sh->cuda, .device = sh->device, .priority = sh->priority};
    pthread_mutex_unlock(&sh->mu);
    dev_leave(sh, prev);
    return 0;
}

int ast_shadow_last_error(ast_shadow *sh, char *buf, size_t len)
{
    if (!sh)
        return AST_EINVAL;
    return ast__get_error(&sh->err, &sh->mu, buf, len);
}
