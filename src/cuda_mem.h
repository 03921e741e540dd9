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
 * call and cudaGetErrorString() is written to it (err may be NULL, len is its size).
 *
 * Allocations go to the calling thread's current CUDA device. Every call is thread-safe in the
 * sense the CUDA runtime is; nothing here takes a lock.
 */
#ifndef ASTERIA_CUDA_MEM_H
#define ASTERIA_CUDA_MEM_H

#include <stddef.h>

/* Number of CUDA devices; 0 when CUDA is not built, there is no driver, or no device. */
int ast__cuda_device_count(void);

/* Zero-filled page-locked host memory (cudaHostAlloc). */
int ast__cuda_host_alloc(void **out, size_t nbytes, char *err, size_t len);
int ast__cuda_host_free(void *p, char *err, size_t len);

/* Zero-filled device memory (cudaMalloc + cudaMemset, synchronised before return so the zeros
 * are in place whatever stream touches the block next). */
int ast__cuda_malloc(void **out, size_t nbytes, char *err, size_t len);
int ast__cuda_free(void *p, char *err, size_t len);

/* Zero-filled managed memory (cudaMallocManaged, cudaMemAttachGlobal). Callers check
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
