/*
 * cuda_mem.h - internal: the one thin layer between libasteria and the CUDA runtime for memory.
 *
 * Owns: translation of cudaError_t into AST_E* codes and messages; nothing else. No state of its
 * own (the CUDA runtime keeps the per-thread current device).
 *
 * Always compiled. With ASTERIA_HAVE_CUDA == 0 every call reports "no device": the count is 0,
 * allocations return AST_ENODEV, copies AST_ENOTSUP. With CUDA built, a missing driver or device
 * is not an error of these functions: ast__cuda_device_count() returns 0.
 *
 * Errors from the CUDA runtime become AST_ECUDA; when err is not NULL a message naming the CUDA
 * call and cudaGetErrorString() is written to it (err may be NULL, len is its size). Every status
 * libasteria gets from the runtime, here and in shadow.c, is read by ast__cuda_status(), which
 * also leaves the calling thread's last-error slot clean (see there).
 *
 * Allocations go to the calling thread's current CUDA device. Every call is thread-safe in the
 * sense the CUDA runtime is; nothing here takes a lock.
 */
#ifndef ASTERIA_CUDA_MEM_H
#define ASTERIA_CUDA_MEM_H

#include <stddef.h>

#include "asteria/build_config.h"

#if ASTERIA_HAVE_CUDA
/* What ast__cuda_status() returns for cudaErrorNotReady: the work queried has not finished. */
#define AST__CUDA_NOT_READY 1

/* The one reading of a CUDA runtime status (a cudaError_t, as int) for every libasteria call
 * into the runtime: 0 for cudaSuccess; AST__CUDA_NOT_READY for cudaErrorNotReady (an event or
 * stream query whose work is still running: not a failure); AST_ECUDA for anything else. For
 * every status but cudaSuccess, "call: text (name)" is written to err (when not NULL).
 *
 * Every status but cudaSuccess, cudaErrorNotReady included, is also taken out of the calling
 * thread's last-error slot (cudaGetLastError()). The runtime keeps the status of a call that did
 * not return cudaSuccess there, one slot per host thread and cudart instance, and code that
 * reads the slot after its own kernel launches (PyTorch's C10_CUDA_KERNEL_LAUNCH_CHECK) would
 * raise our NotReady as its own "device not ready" error on the training thread, or inside
 * backward on autograd's thread. A sticky error (a lost context, no usable driver) stays in the
 * slot whatever anyone does; the runtime reports it to every later call anyway. */
int ast__cuda_status(int status, const char *call, char *err, size_t len);
#endif

/* Number of CUDA devices; 0 when CUDA is not built, there is no driver, or no device. */
int ast__cuda_device_count(void);

/* Zero-filled page-locked host memory (cudaHostAlloc). */
int ast__cuda_host_alloc(void **out, size_t nbytes, char *err, size_t len);
int ast__cuda_host_free(void *p, char *err, size_t len);

/* Zero-filled device memory (cudaMalloc + cudaMemset, synchronised before return so the zeros
 * are in place whatever stream touches the block next). */
int ast__cuda_malloc(void **out, size_t nbytes, char *err, size_t len);
int ast__cuda_free(void *p, char *err, size_t len);

/* Zero-filled managed memory (cudaMallocManaged, cudaMemAttachGlobal), advised to stay in host
 * memory and be read there by the current device (preferred location host, accessed by the
 * device: no migration into device memory); a device that refuses the advice gets AST_ECUDA
 * and no block. Callers check
 * ast__cuda_coherent_host_access() first: on a device without it, host access to managed memory
 * while the device runs faults. Freed with ast__cuda_free. */
int ast__cuda_managed_alloc(void **out, size_t nbytes, char *err, size_t len);

/* Synchronous copy of n bytes between any two of host, pinned, device and managed memory
 * (cudaMemcpyDefault through unified addressing); returns after the data is at dst. */
int ast__cuda_memcpy(void *dst, const void *src, size_t n, char *err, size_t len);

/* Coherent host access of the current device, as two device attributes report it. */
typedef struct ast__cuda_coherence {
    int device;                  /* the ordinal the attributes were read from */
    int concurrent_managed;      /* cudaDevAttrConcurrentManagedAccess */
    int pageable_host_tables;    /* cudaDevAttrPageableMemoryAccessUsesHostPageTables */
} ast__cuda_coherence;

/* Reads both attributes of the current device and sets *coherent to 1 when either is set (the
 * host may then touch managed memory while the device works: page-fault migration, or hardware
 * coherence through the host page tables), else 0. Nothing is assumed from the device's name or
 * architecture. AST_ENODEV without a device; the raw attributes in *c (may be NULL). */
int ast__cuda_coherent_host_access(int *coherent, ast__cuda_coherence *c, char *err, size_t len);

#endif
