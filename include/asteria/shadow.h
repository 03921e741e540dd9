/*
 * asteria/shadow.h - the shadow pipeline's copy engine: factor snapshots out (D2H), roots and
 * eigenbases in (H2D), on a low-priority stream, off the training critical path.
 *
 * Owns: the shadow stream (CUDA: created with cudaStreamNonBlocking at the LOWEST priority of
 * the device's range, i.e. the numerically greatest value), two staging rings and their slot
 * events, the copy statistics and the last-error message.
 *  - Snapshot ring: page-locked host memory (cudaHostAlloc). ast_shadow_snapshot copies a
 *    device buffer into a slot after the stream has waited on the caller's event (recorded on
 *    the main stream after the factor update), so the snapshot sees exactly that state.
 *  - Prefetch ring: device memory (cudaMalloc). ast_shadow_prefetch copies a host buffer into
 *    a slot and records a ready event the main stream waits on before reading the slot.
 *
 * Both rings allocate slots contiguously in FIFO order and wrap around at the end; space is
 * reclaimed from the oldest slot once it is released. A slot is never overwritten while in
 * use: when the ring has no room (or max_slots slots are live) the call fails with AST_EBUSY
 * and nothing changes. Released slots behind an older live slot wait for it (ring order).
 *
 * Host path: without CUDA in the build, without a device, or with opts.mode AST_SHADOW_HOST,
 * the same API runs on host memory: the "device" ring is malloc'ed, copies are memcpy's done
 * at issue, events are NULL and stream handles do not exist (AST_ENODEV). The state machine,
 * ring accounting and statistics are the same code as with CUDA; ast_shadow_is_cuda says
 * which path a handle is on.
 *
 * Pointers: with CUDA, snapshot sources are device (or any UVA-addressable) memory and
 * prefetch sources should be page-locked host memory (pageable sources work, but the copy
 * may then block the caller). A source must not change until its copy completes (for a
 * snapshot: have the main stream wait on ast_shadow_snapshot_event before overwriting the
 * factor in place). Every CUDA call is made on the device the handle was created for; the
 * calling thread's current device is restored before returning.
 *
 * Thread safety: every function may be called from any thread concurrently, except
 * ast_shadow_destroy, which must not race with other calls on the same handle. One ticket or
 * key must not be released while another thread waits on it.
 */
#ifndef ASTERIA_SHADOW_H
#define ASTERIA_SHADOW_H

#include <stddef.h>
#include <stdint.h>

#include "asteria/trace.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct ast_shadow ast_shadow;

typedef enum ast_shadow_mode {
    AST_SHADOW_AUTO = 0, /* CUDA when built and a device exists, else host */
    AST_SHADOW_HOST = 1, /* host memory and memcpy, even with a device */
    AST_SHADOW_CUDA = 2  /* CUDA or fail with AST_ENODEV */
} ast_shadow_mode;

typedef struct ast_shadow_opts {
    ast_shadow_mode mode;
    int device;              /* CUDA device ordinal; -1: the calling thread's current device */
    size_t snapshot_bytes;   /* capacity of the pinned snapshot ring (default 64 MiB) */
    size_t ring_bytes;       /* capacity of the device prefetch ring (default 64 MiB) */
    unsigned max_slots;      /* live slots per ring (default 64) */
    ast_trace *trace;        /* NULL, or a recorder for copy events (lane "shadow stream");
                                it must outlive the shadow handle */
} ast_shadow_opts;

/* Sets the defaults (mode auto, the sizes and slot counts noted above, no trace).
 * No return value. */
void ast_shadow_opts_init(ast_shadow_opts *o);

/* Slots start at multiples of this, so staged data suits any vector load. */
#define AST_SHADOW_ALIGN 256u

typedef struct ast_shadow_ticket {
    uint64_t id;             /* names the snapshot slot; 0: none */
    void *host;              /* the staged copy: read it after _wait / _query report 0 */
    size_t nbytes;
} ast_shadow_ticket;

typedef struct ast_shadow_stats {
    uint64_t d2h_bytes, h2d_bytes;   /* bytes of the copies issued, per direction */
    uint64_t d2h_copies, h2d_copies;
    uint64_t busy;                   /* calls refused with AST_EBUSY (a ring full) */
    /* prefetch (device) ring */
    uint64_t ring_capacity;
    uint64_t ring_used;              /* bytes not available now (live slots + skipped tail) */
    uint64_t ring_high_water;        /* largest ring_used seen */
    uint64_t ring_wraps;             /* slots placed at offset 0 because the tail did not fit */
    uint64_t ring_slots;             /* slots not yet reclaimed (held, or released behind one) */
    /* snapshot (pinned host) ring, same meanings */
    uint64_t snapshot_capacity, snapshot_used, snapshot_high_water, snapshot_wraps, snapshot_slots;
    int is_cuda;
    int device;                      /* -1 on the host path */
    int priority;                    /* the stream's priority; 0 on the host path */
} ast_shadow_stats;

/* RETURN VALUE: 0; AST_EINVAL (NULL out, zero capacity, max_slots 0); AST_ENODEV (mode CUDA
 * without a device); AST_ECUDA; AST_ENOMEM. *out is NULL on failure, and the cause is written
 * into errbuf (may be NULL; len bytes, truncated). */
int ast_shadow_create(const ast_shadow_opts *opts, ast_shadow **out, char *errbuf, size_t len);
/* Waits for every copy in flight, then frees the stream, events and both rings. NULL is a
 * no-op. No return value. */
void ast_shadow_destroy(ast_shadow *sh);

/* RETURN VALUE: 1 on the CUDA path, 0 on the host path (and for a NULL sh). */
int ast_shadow_is_cuda(const ast_shadow *sh);
/* The raw cudaStream_t, for torch.cuda.ExternalStream. RETURN VALUE: 0; AST_ENODEV on the host
 * path (*out = 0). */
int ast_shadow_stream_handle(const ast_shadow *sh, uintptr_t *out);

/* D2H snapshot: reserves nbytes in the snapshot ring, makes the shadow stream wait on
 * wait_event (a cudaEvent_t; NULL: no wait, the caller guarantees src is stable), issues the
 * copy and fills *t. RETURN VALUE: 0; AST_EINVAL (NULL or zero-sized arguments, nbytes above
 * the ring capacity, an event on the host path); AST_EBUSY (ring full: release snapshots);
 * AST_ECUDA. */
int ast_shadow_snapshot(ast_shadow *sh, const void *src, size_t nbytes, void *wait_event,
                        ast_shadow_ticket *t);
/* One source of a gathered snapshot. */
typedef struct ast_shadow_piece {
    const void *src;
    size_t nbytes;
} ast_shadow_piece;
/* Gathered D2H snapshot: the npieces sources copied back to back into ONE slot (t->host holds
 * piece i at the sum of the sizes before it), after wait_event, as ast_shadow_snapshot does for
 * one source; the stacked operand of a batched job, without stacking it first. RETURN VALUE:
 * as ast_shadow_snapshot; AST_EINVAL also for npieces < 1 or any NULL / zero-sized piece; a
 * failure copies nothing and holds no slot. */
int ast_shadow_snapshotv(ast_shadow *sh, const ast_shadow_piece *pieces, int npieces,
                         void *wait_event, ast_shadow_ticket *t);
/* RETURN VALUE: 0 when the copy has landed in t->host; AST_EBUSY while in flight (_query only);
 * AST_ENOENT unknown or released ticket; AST_EINVAL NULL arguments; AST_ECUDA. _wait blocks
 * (without spinning) until it has landed. */
int ast_shadow_snapshot_query(ast_shadow *sh, const ast_shadow_ticket *t);
int ast_shadow_snapshot_wait(ast_shadow *sh, const ast_shadow_ticket *t);
/* The cudaEvent_t recorded after the snapshot copy (NULL on the host path), valid until the
 * ticket is released: the main stream waits on it before overwriting the source.
 * RETURN VALUE: 0; AST_ENOENT unknown or released ticket; AST_EINVAL NULL arguments. */
int ast_shadow_snapshot_event(ast_shadow *sh, const ast_shadow_ticket *t, void **event);
/* Gives the slot back; t->host must not be read afterwards. RETURN VALUE: 0; AST_ENOENT
 * unknown or released ticket; AST_EINVAL NULL arguments. */
int ast_shadow_snapshot_release(ast_shadow *sh, const ast_shadow_ticket *t);

/* H2D prefetch: reserves nbytes in the device ring for key (unique among live slots), issues
 * the copy and records the slot's ready event. *dev (may be NULL) receives the slot's device
 * pointer, usable in stream order once the main stream waits on the ready event.
 * RETURN VALUE: 0; AST_EINVAL (as for snapshots); AST_ESTATE (key already staged); AST_EBUSY
 * (ring full: release keys); AST_ECUDA. */
int ast_shadow_prefetch(ast_shadow *sh, const void *src, size_t nbytes, uint64_t key,
                        void **dev);
/* The slot's ready cudaEvent_t (*event NULL on the host path), valid until release.
 * RETURN VALUE: 0; AST_ENOENT unknown key; AST_EBUSY while another thread is still issuing the
 * copy; AST_EINVAL NULL arguments. */
int ast_shadow_ready_event(ast_shadow *sh, uint64_t key, void **event);
/* Pointer and size of key's slot once its copy has completed. RETURN VALUE: 0; AST_EBUSY while
 * in flight (the pointer is still returned, for stream-ordered use); AST_ENOENT unknown key;
 * AST_EINVAL NULL sh; AST_ECUDA. */
int ast_shadow_lookup(ast_shadow *sh, uint64_t key, void **dev, size_t *nbytes);
/* Blocks until key's copy has completed. RETURN VALUE: 0; AST_ENOENT unknown key; AST_EINVAL
 * NULL sh; AST_ECUDA. */
int ast_shadow_prefetch_wait(ast_shadow *sh, uint64_t key);
/* Releases key's slot now: the caller has no reads of it pending. RETURN VALUE: 0; AST_ENOENT
 * unknown key; AST_EBUSY while its copy is still being issued; AST_EINVAL NULL sh; AST_ECUDA. */
int ast_shadow_release(ast_shadow *sh, uint64_t key);
/* Releases key's slot once the work queued so far on stream (a cudaStream_t as uintptr_t; 0 is
 * the default stream) has passed: an event owned by the slot is recorded on stream and the space
 * is reclaimed only after it completes. On the host path the same as ast_shadow_release.
 * RETURN VALUE: as ast_shadow_release. */
int ast_shadow_release_after(ast_shadow *sh, uint64_t key, uintptr_t stream);

/* Copies the counters into out. RETURN VALUE: 0; AST_EINVAL NULL sh or out. */
int ast_shadow_stats_get(ast_shadow *sh, ast_shadow_stats *out);
/* Copy of the last error message ("" if none) into buf. RETURN VALUE: 0; AST_EINVAL NULL sh
 * or buf, or len 0. */
int ast_shadow_last_error(ast_shadow *sh, char *buf, size_t len);

#ifdef __cplusplus
}
#endif
#endif
