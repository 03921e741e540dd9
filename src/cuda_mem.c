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

static int cuda_fail(cudaError_t e, const char *call, size_t nbytes, char *err, size_t len)
{
    /* The runtime also keeps e as the thread's last error; code that checks cudaGetLastError()
     * after its own launches (PyTorch does) would otherwise blame itself for our failure. */
    cudaGetLastError();
    if (err && len)
        snprintf(err, len, "%s(%zu bytes): %s (%s)", call, nbytes, cudaGetErrorString(e),
                 cudaGetErrorName(e));
    return AST_ECUDA;
}

int ast__cuda_device_count(void)
{
    int n = 0;
    /* No driver, an old driver or no device all come back as errors here: they mean "none". */
    if (cudaGetDeviceCount(&n) != cudaSuccess) {
        cudaGetLastError(); /* likewise: none of our business to leave behind */
        return 0;
    }
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
        cudaFree(p);
        return cuda_fail(e, "cudaMemset", nbytes, err, len);
    }
    *out = p;
    return 0;
}

int ast__cuda_free(void *p, char *err, size_t len)
{
    cudaError_t e = cudaFree(p);
    return e == cudaSuccess ? 0 : cuda_fail(e, "cudaFree", 0, err, len);
}

int ast__cuda_managed_alloc(void **out, size_t nbytes, char *err, size_t len)
{
    void *p = NULL;
    cudaError_t e = cudaMallocManaged(&p, nbytes ? nbytes : 1, cudaMemAttachGlobal);
    if (e != cudaSuccess)
        return cuda_fail(e, "cudaMallocManaged", nbytes, err, len);
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
