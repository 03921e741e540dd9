/* cuda_slot.h - a CUDA test's check that the calling thread's last-error slot is clean: what
 * PyTorch's C10_CUDA_KERNEL_LAUNCH_CHECK reads after its launches, so a library call that leaves
 * a status there (cudaErrorNotReady included) breaks torch's next kernel. Reading the slot with
 * cudaGetLastError also resets it for the next check. Without CUDA, a no-op. Include after
 * <cmocka.h> (fail_msg). */
#ifndef ASTERIA_TESTS_CUDA_SLOT_H
#define ASTERIA_TESTS_CUDA_SLOT_H

#if ASTERIA_HAVE_CUDA
#include <cuda_runtime.h>
#define SLOT_CLEAN(what)                                                                          \
    do {                                                                                          \
        cudaError_t e_ = cudaGetLastError();                                                      \
        if (e_ != cudaSuccess)                                                                    \
            fail_msg("%s left %s in the thread's last-error slot", what, cudaGetErrorName(e_));   \
    } while (0)
#else
#define SLOT_CLEAN(what) ((void)0)
#endif

#endif
