/*
 * cuda_mem.c - thin wrappers over the CUDA runtime's memory calls (see cuda_mem.h).
 *
 * Owns: cudaError_t -> AST_E* translation, in this file only. May call: the CUDA runtime.
 * No state and no locks.
 */
#include "cuda_mem.h"

#include "asteria/build_config.h"
#include "asteria/errors.h"

#include <stdio.h>
#include <string.h>

#if ASTERIA_HAVE_CUDA
#include <cuda_runtime.h>

int ast__cuda_status(int status, const char *call, char *err, size_t len)
{
    cudaError_t e = (cudaError_t)status;
    if (e == cudaSuccess)
        return 0;
    /* Taken out of the thread's slot before anything else runs on this thread (cuda_mem.h). */
    (void)cudaGetLastError();
    if (err && len)
        snprintf(err, len, "%s: %s (%s)", call, cudaGetErrorString(e), cudaGetErrorName(e));
    return e == cudaErrorNotReady ? AST__CUDA_NOT_READY : AST_ECUDA;
}

/* A memory call that did not succeed: AST_ECUDA (NotReady from a synchronous call is one too). */
static int cuda_fail(cudaError_t e, const char *call, size_t nbytes, char *err, size_t len)
{
    char what[96];
    snprintf(what, sizeof what, "%s(%zu bytes)", call, nbytes);
    int rc = ast__cuda_status(e, what, err, len);
    return rc < 0 ? rc : AST_ECUDA;
}

int ast__cuda_device_count(void)
{
    int n = 0;
    /* No driver, an old driver or no device all come back as errors here: they mean "none". */
    if (ast__cuda_status(cudaGetDeviceCount(&n), "cudaGetDeviceCount", NULL, 0))
        return 0;
    return n > 0 ? n : 0;
}

int ast__cuda_host_alloc(void **out, size_t nbytes, char *err, size_t len)
{
    void *p = NULL;
    cudaError_t e = cudaHostAlloc(&p, nbytes ? nbytes : 1, cudaHostAllocDefault);
    if (e != cudaSuccess)
        return cuda_fail(e, "cudaHostAlloc", nbytes, err, len);
    memset(p, 0, nbytes);
    *out = p;
    return 0;
}

int ast__cuda_host_free(void *p, char *err, size_t len)
{
    cudaError_t e = cudaFreeHost(p);
    return e == cudaSuccess ? 0 : cuda_fail(e, "cudaFreeHost", 0, err, len);
}

int ast__cuda_malloc(void **out, size_t nbytes, char *err, size_t len)
{
    void *p = NULL;
    cudaError_t e = cudaMalloc(&p, nbytes ? nbytes : 1);
    if (e != cudaSuccess)
        return cuda_fail(e, "cudaMalloc", nbytes, err, len);
    e = cudaMemset(p, 0, nbytes);
    if (e == cudaSuccess)
        e = cudaStreamSynchronize(0);
    if (e != cudaSuccess) {
        int rc = cuda_fail(e, "cudaMemset", nbytes, err, len);
        ast__cuda_status(cudaFree(p), "cudaFree", NULL, 0);
        return rc;
    }
    *out = p;
    return 0;
}

int ast__cuda_free(void *p, char *err, size_t len)
{
    cudaError_t e = cudaFree(p);
    return e == cudaSuccess ? 0 : cuda_fail(e, "cudaFree", 0, err, len);
}

/* Managed blocks are host memory that the device reads in place, through its own page tables:
 * preferred location the host, mapped for the current device. Without this advice the first
 * device access migrates the pages into device memory (page faults, on x86 where
 * concurrentManagedAccess is what makes the tier usable) and they stay there until the host
 * touches them again: the tier would take device memory that every byte count reports as host.
 * Where the device uses the host's page tables (pageableMemoryAccessUsesHostPageTables) the
 * advice changes nothing. CUDA 13 takes a cudaMemLocation, CUDA 12 a device ordinal. */
static cudaError_t advise_host_resident(void *p, size_t n, const char **call)
{
    int dev;
    cudaError_t e;
    *call = "cudaGetDevice";
    if ((e = cudaGetDevice(&dev)) != cudaSuccess)
        return e;
#if CUDART_VERSION >= 13000
    const struct cudaMemLocation host = {.type = cudaMemLocationTypeHost, .id = 0};
    const struct cudaMemLocation gpu = {.type = cudaMemLocationTypeDevice, .id = dev};
    *call = "cudaMemAdvise(SetPreferredLocation host)";
    if ((e = cudaMemAdvise(p, n, cudaMemAdviseSetPreferredLocation, host)) != cudaSuccess)
        return e;
    *call = "cudaMemAdvise(SetAccessedBy device)";
    return cudaMemAdvise(p, n, cudaMemAdviseSetAccessedBy, gpu);
#else
    *call = "cudaMemAdvise(SetPreferredLocation host)";
    if ((e = cudaMemAdvise(p, n, cudaMemAdviseSetPreferredLocation, cudaCpuDeviceId)) !=
        cudaSuccess)
        return e;
    *call = "cudaMemAdvise(SetAccessedBy device)";
    return cudaMemAdvise(p, n, cudaMemAdviseSetAccessedBy, dev);
#endif
}

int ast__cuda_managed_alloc(void **out, size_t nbytes, char *err, size_t len)
{
    void *p = NULL;
    const char *call = "cudaMallocManaged";
    cudaError_t e = cudaMallocManaged(&p, nbytes ? nbytes : 1, cudaMemAttachGlobal);
    if (e != cudaSuccess)
        return cuda_fail(e, call, nbytes, err, len);
    /* a block the device cannot read in place is not this tier's: refused, so that the
     * planner's probe falls back to pinned memory and the staging ring */
    if ((e = advise_host_resident(p, nbytes ? nbytes : 1, &call)) != cudaSuccess) {
        int rc = cuda_fail(e, call, nbytes, err, len);
        ast__cuda_status(cudaFree(p), "cudaFree", NULL, 0);
        return rc;
    }
    /* Zeroed from the host: ordered with the caller's next host access, unlike cudaMemset. */
    memset(p, 0, nbytes);
    *out = p;
    return 0;
}

int ast__cuda_memcpy(void *dst, const void *src, size_t n, char *err, size_t len)
{
    cudaError_t e = cudaMemcpy(dst, src, n, cudaMemcpyDefault);
    /* cudaMemcpy from pageable memory may return before the DMA lands, and the block is then
     * handed to code that may read it from a non-blocking stream: wait for the copy itself
     * (the legacy stream), not for the whole device. */
    if (e == cudaSuccess)
        e = cudaStreamSynchronize(0);
    return e == cudaSuccess ? 0 : cuda_fail(e, "cudaMemcpy", n, err, len);
}

int ast__cuda_coherent_host_access(int *coherent, ast__cuda_coherence *c, char *err, size_t len)
{
    ast__cuda_coherence r = {0, 0, 0};
    cudaError_t e;

    *coherent = 0;
    if (ast__cuda_device_count() == 0) {
        if (err && len)
            snprintf(err, len, "no CUDA device (cudaGetDeviceCount reports none)");
        return AST_ENODEV;
    }
    e = cudaGetDevice(&r.device);
    if (e == cudaSuccess)
        e = cudaDeviceGetAttribute(&r.concurrent_managed, cudaDevAttrConcurrentManagedAccess,
                                   r.device);
    if (e == cudaSuccess)
        e = cudaDeviceGetAttribute(&r.pageable_host_tables,
                                   cudaDevAttrPageableMemoryAccessUsesHostPageTables, r.device);
    if (e != cudaSuccess)
        return cuda_fail(e, "cudaDeviceGetAttribute", 0, err, len);
    *coherent = r.concurrent_managed || r.pageable_host_tables;
    if (c)
        *c = r;
    return 0;
}

#else /* !ASTERIA_HAVE_CUDA */

static int no_cuda(int code, char *err, size_t len)
{
    if (err && len)
        snprintf(err, len, "libasteria was built without CUDA (ASTERIA_WITH_CUDA=OFF)");
    return code;
}

int ast__cuda_device_count(void)
{
    return 0;
}

int ast__cuda_host_alloc(void **out, size_t nbytes, char *err, size_t len)
{
    *out = NULL;
    return no_cuda(AST_ENODEV, err, len);
}

int ast__cuda_host_free(void *p, char *err, size_t len)
{
    return no_cuda(AST_ENOTSUP, err, len);
}

int ast__cuda_malloc(void **out, size_t nbytes, char *err, size_t len)
{
    *out = NULL;
    return no_cuda(AST_ENODEV, err, len);
}

int ast__cuda_free(void *p, char *err, size_t len)
{
    return no_cuda(AST_ENOTSUP, err, len);
}

int ast__cuda_managed_alloc(void **out, size_t nbytes, char *err, size_t len)
{
    *out = NULL;
    return no_cuda(AST_ENODEV, err, len);
}

int ast__cuda_memcpy(void *dst, const void *src, size_t n, char *err, size_t len)
{
    return no_cuda(AST_ENOTSUP, err, len);
}

int ast__cuda_coherent_host_access(int *coherent, ast__cuda_coherence *c, char *err, size_t len)
{
    *coherent = 0;
    return no_cuda(AST_ENODEV, err, len);
}

#endif
