/*
 * test_cuda_status.c - ast__cuda_status (cuda_mem.h), the one reader of the CUDA runtime's
 * statuses in libasteria: cudaSuccess is 0, cudaErrorNotReady is AST__CUDA_NOT_READY (work not
 * finished, not a failure), anything else AST_ECUDA with the call, the runtime's text and the
 * status's name in the message. Pure logic on given statuses: it runs on every machine of a CUDA
 * build, with or without a driver or a device (the statuses are given, not provoked). That it
 * also leaves the thread's last-error slot clean after a real NotReady is checked on a device,
 * by test_shadow_cuda (every call path of the shadow that polls). Exits 77 without CUDA.
 */
#include "asteria/build_config.h"
#include "asteria/errors.h"
#include "cuda_mem.h"

#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include <cmocka.h>

#if ASTERIA_HAVE_CUDA
#include <cuda_runtime.h>

static void test_success_is_zero_and_writes_nothing(void **state)
{
    char err[128] = "untouched";
    (void)state;
    assert_int_equal(ast__cuda_status(cudaSuccess, "cudaEventQuery", err, sizeof err), 0);
    assert_string_equal(err, "untouched");
}

static void test_not_ready_is_not_a_failure(void **state)
{
    char err[128] = "";
    (void)state;
    int rc = ast__cuda_status(cudaErrorNotReady, "cudaEventQuery", err, sizeof err);
    assert_int_equal(rc, AST__CUDA_NOT_READY);
    assert_true(rc > 0); /* callers test rc < 0 for failures */
    assert_non_null(strstr(err, "cudaEventQuery"));
    assert_non_null(strstr(err, "cudaErrorNotReady"));
}

static void test_errors_name_the_call_and_the_status(void **state)
{
    const cudaError_t errs[] = {cudaErrorInvalidValue, cudaErrorMemoryAllocation,
                                cudaErrorInvalidResourceHandle, cudaErrorInsufficientDriver,
                                cudaErrorNoDevice, cudaErrorIllegalAddress};
    (void)state;
    for (size_t i = 0; i < sizeof errs / sizeof errs[0]; i++) {
        char err[256] = "";
        assert_int_equal(ast__cuda_status(errs[i], "cudaStreamWaitEvent", err, sizeof err),
                         AST_ECUDA);
        assert_non_null(strstr(err, "cudaStreamWaitEvent: "));
        assert_non_null(strstr(err, cudaGetErrorName(errs[i])));
        assert_non_null(strstr(err, cudaGetErrorString(errs[i])));
    }
}

static void test_no_message_buffer(void **state)
{
    char tiny[8] = "xxxxxxx";
    (void)state;
    assert_int_equal(ast__cuda_status(cudaErrorInvalidValue, "cudaFree", NULL, 0), AST_ECUDA);
    assert_int_equal(ast__cuda_status(cudaErrorNotReady, "cudaEventQuery", NULL, 0),
                     AST__CUDA_NOT_READY);
    assert_int_equal(ast__cuda_status(cudaErrorInvalidValue, "cudaFree", tiny, sizeof tiny),
                     AST_ECUDA);
    assert_int_equal(strlen(tiny), sizeof tiny - 1); /* truncated, terminated */
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_success_is_zero_and_writes_nothing),
        cmocka_unit_test(test_not_ready_is_not_a_failure),
        cmocka_unit_test(test_errors_name_the_call_and_the_status),
        cmocka_unit_test(test_no_message_buffer),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}

#else

int main(void)
{
    printf("SKIP: libasteria was built without CUDA (ASTERIA_WITH_CUDA=OFF): no CUDA status to "
           "read\n");
    return 77;
}

#endif
