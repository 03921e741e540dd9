/* test_shadow_cuda.c - the shadow copy engine on a real device: the stream's priority is the
 * lowest of the range, D2H / H2D round trips through device memory, a snapshot gated on the
 * main stream's event sees that stream's memset, ready events order the main stream's reads,
 * release_after holds a slot until the consumer stream passes. Exits 77 without a device. */
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <setjmp.h>
#include <cmocka.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "asteria/build_config.h"
#include "asteria/errors.h"
#include "asteria/shadow.h"

#if ASTERIA_HAVE_CUDA
#include <cuda_runtime.h>

#define CK(call) assert_int_equal((int)(call), (int)cudaSuccess)

static ast_shadow *make(size_t bytes)
{
    ast_shadow_opts o;
    ast_shadow_opts_init(&o);
    o.mode = AST_SHADOW_CUDA;
    o.snapshot_bytes = bytes;
    o.ring_bytes = bytes;
    o.max_slots = 8;
    ast_shadow *sh = NULL;
    char err[512] = "";
    int rc = ast_shadow_create_msg(&o, &sh, err, sizeof err);
    if (rc)
        fail_msg("ast_shadow_create: %s: %s", ast_err_name(rc), err);
    assert_int_equal(ast_shadow_is_cuda(sh), 1);
    return sh;
}

static unsigned char pat(uint64_t key, size_t i)
{
    return (unsigned char)(key * 131u + i * 7u + (i >> 8));
}

/* Host function that holds a stream back, so later work on it is visibly delayed. */
static void CUDART_CB hold_stream(void *arg)
{
    struct timespec ts = {0, (long)(uintptr_t)arg * 1000000L};
    nanosleep(&ts, NULL);
}

static void test_stream_is_lowest_priority_and_non_blocking(void **state)
{
    (void)state;
    ast_shadow *sh = make(1 << 20);
    uintptr_t h = 0;
    assert_int_equal(ast_shadow_stream_handle(sh, &h), 0);
    assert_true(h != 0);
    int least, greatest, prio;
    unsigned flags;
    CK(cudaDeviceGetStreamPriorityRange(&least, &greatest));
    CK(cudaStreamGetPriority((cudaStream_t)h, &prio));
    CK(cudaStreamGetFlags((cudaStream_t)h, &flags));
    printf("priority range: least %d, greatest %d; shadow stream %d\n", least, greatest, prio);
    assert_int_equal(prio, least);     /* the lowest priority: the numerically greatest value */
    assert_true(prio >= greatest);
    assert_true(flags & cudaStreamNonBlocking);
    ast_shadow_stats st;
    assert_int_equal(ast_shadow_stats_get(sh, &st), 0);
    assert_int_equal(st.is_cuda, 1);
    assert_int_equal(st.priority, least);
    int dev;
    CK(cudaGetDevice(&dev));
    assert_int_equal(st.device, dev);
    ast_shadow_destroy(sh);
}

static void test_round_trip_through_device_memory(void **state)
{
    (void)state;
    const size_t n = (size_t)3 << 20;
    ast_shadow *sh = make((size_t)8 << 20);
    unsigned char *host, *back;
    void *dbuf;
    CK(cudaMallocHost((void **)&host, n));
    CK(cudaMallocHost((void **)&back, n));
    CK(cudaMalloc(&dbuf, n));
    for (size_t i = 0; i < n; i++)
        host[i] = pat(5, i);
    CK(cudaMemcpy(dbuf, host, n, cudaMemcpyHostToDevice));

    /* D2H: device buffer -> pinned staging slot. */
    ast_shadow_ticket t;
    assert_int_equal(ast_shadow_snapshot(sh, dbuf, n, NULL, &t), 0);
    assert_int_equal(ast_shadow_snapshot_wait(sh, &t), 0);
    assert_int_equal(ast_shadow_snapshot_query(sh, &t), 0);
    struct cudaPointerAttributes pa;
    CK(cudaPointerGetAttributes(&pa, t.host));
    assert_int_equal(pa.type, cudaMemoryTypeHost);
    assert_memory_equal(t.host, host, n);

    /* H2D: pinned host -> device ring slot, then back for comparison. */
    for (size_t i = 0; i < n; i++)
        host[i] = pat(6, i);
    void *slot;
    assert_int_equal(ast_shadow_prefetch(sh, host, n, 6, &slot), 0);
    assert_int_equal(ast_shadow_prefetch_wait(sh, 6), 0);
    void *p;
    size_t got;
    assert_int_equal(ast_shadow_lookup(sh, 6, &p, &got), 0);
    assert_ptr_equal(p, slot);
    assert_int_equal(got, n);
    CK(cudaPointerGetAttributes(&pa, slot));
    assert_int_equal(pa.type, cudaMemoryTypeDevice);
    CK(cudaMemcpy(back, slot, n, cudaMemcpyDeviceToHost));
    assert_memory_equal(back, host, n);

    ast_shadow_stats st;
    assert_int_equal(ast_shadow_stats_get(sh, &st), 0);
    assert_int_equal(st.d2h_bytes, n);
    assert_int_equal(st.h2d_bytes, n);
    assert_int_equal(ast_shadow_snapshot_release(sh, &t), 0);
    assert_int_equal(ast_shadow_release(sh, 6), 0);
    CK(cudaFree(dbuf));
    CK(cudaFreeHost(host));
    CK(cudaFreeHost(back));
    ast_shadow_destroy(sh);
}

static void test_snapshot_is_gated_on_main_stream_event(void **state)
{
    (void)state;
    const size_t n = (size_t)16 << 20;
    ast_shadow *sh = make(n);
    cudaStream_t main_s;
    cudaEvent_t updated;
    void *factor;
    CK(cudaStreamCreateWithFlags(&main_s, cudaStreamNonBlocking));
    CK(cudaEventCreateWithFlags(&updated, cudaEventDisableTiming));
    CK(cudaMalloc(&factor, n));
    CK(cudaMemset(factor, 0x11, n));
    CK(cudaDeviceSynchronize());

    /* The "factor update": held back 300 ms, then a memset, then the event. */
    CK(cudaLaunchHostFunc(main_s, hold_stream, (void *)(uintptr_t)300));
    CK(cudaMemsetAsync(factor, 0x5A, n, main_s));
    CK(cudaEventRecord(updated, main_s));

    ast_shadow_ticket t;
    assert_int_equal(ast_shadow_snapshot(sh, factor, n, (void *)updated, &t), 0);
    /* The copy waits for the update, which is still held back. */
    assert_int_equal(ast_shadow_snapshot_query(sh, &t), AST_EBUSY);
    assert_int_equal(ast_shadow_snapshot_wait(sh, &t), 0);
    const unsigned char *h = t.host;
    size_t bad = 0;
    for (size_t i = 0; i < n; i++)
        bad += h[i] != 0x5A;
    assert_int_equal(bad, 0);

    /* The main stream waits on the snapshot before overwriting the factor in place. */
    void *snap_ev;
    assert_int_equal(ast_shadow_snapshot_event(sh, &t, &snap_ev), 0);
    assert_non_null(snap_ev);
    CK(cudaStreamWaitEvent(main_s, (cudaEvent_t)snap_ev, 0));
    CK(cudaMemsetAsync(factor, 0x22, n, main_s));
    CK(cudaStreamSynchronize(main_s));
    assert_int_equal(h[0], 0x5A);
    assert_int_equal(ast_shadow_snapshot_release(sh, &t), 0);

    CK(cudaFree(factor));
    CK(cudaEventDestroy(updated));
    CK(cudaStreamDestroy(main_s));
    ast_shadow_destroy(sh);
}

/* A gathered snapshot of three device buffers, gated on one main-stream event: each lands
 * back to back in one pinned slot, with the value after the update. */
static void test_gathered_snapshot_of_device_buffers(void **state)
{
    (void)state;
    const size_t sizes[3] = {(size_t)1 << 20, 4096 + 17, (size_t)3 << 20};
    const size_t total = sizes[0] + sizes[1] + sizes[2];
    ast_shadow *sh = make(total + 4096);
    cudaStream_t main_s;
    cudaEvent_t updated;
    void *buf[3];
    ast_shadow_piece pc[3];
    CK(cudaStreamCreateWithFlags(&main_s, cudaStreamNonBlocking));
    CK(cudaEventCreateWithFlags(&updated, cudaEventDisableTiming));
    CK(cudaLaunchHostFunc(main_s, hold_stream, (void *)(uintptr_t)100));
    for (int i = 0; i < 3; i++) {
        CK(cudaMalloc(&buf[i], sizes[i]));
        CK(cudaMemsetAsync(buf[i], 0x30 + i, sizes[i], main_s));
        pc[i] = (ast_shadow_piece){buf[i], sizes[i]};
    }
    CK(cudaEventRecord(updated, main_s));

    ast_shadow_ticket t;
    assert_int_equal(ast_shadow_snapshotv(sh, pc, 3, (void *)updated, &t), 0);
    assert_int_equal(t.nbytes, total);
    assert_int_equal(ast_shadow_snapshot_wait(sh, &t), 0);
    const unsigned char *h = t.host;
    size_t bad = 0, off = 0;
    for (int i = 0; i < 3; off += sizes[i], i++)
        for (size_t k = 0; k < sizes[i]; k++)
            bad += h[off + k] != (unsigned char)(0x30 + i);
    assert_int_equal(bad, 0);
    ast_shadow_stats st;
    assert_int_equal(ast_shadow_stats_get(sh, &st), 0);
    assert_int_equal(st.d2h_bytes, total);
    assert_int_equal(st.d2h_copies, 1);
    assert_int_equal(ast_shadow_snapshot_release(sh, &t), 0);

    for (int i = 0; i < 3; i++)
        CK(cudaFree(buf[i]));
    CK(cudaEventDestroy(updated));
    CK(cudaStreamDestroy(main_s));
    ast_shadow_destroy(sh);
}

static void test_ready_event_and_release_after(void **state)
{
    (void)state;
    const size_t n = (size_t)4 << 20;
    ast_shadow *sh = make(n);
    cudaStream_t main_s;
    unsigned char *host, *back;
    void *dst;
    CK(cudaStreamCreateWithFlags(&main_s, cudaStreamNonBlocking));
    CK(cudaMallocHost((void **)&host, n));
    CK(cudaMallocHost((void **)&back, n));
    CK(cudaMalloc(&dst, n));
    for (size_t i = 0; i < n; i++)
        host[i] = pat(8, i);

    void *slot, *ev;
    assert_int_equal(ast_shadow_prefetch(sh, host, n, 8, &slot), 0);
    assert_int_equal(ast_shadow_ready_event(sh, 8, &ev), 0);
    assert_non_null(ev);
    /* The consumer reads the slot in stream order after the ready event, with no host wait. */
    CK(cudaStreamWaitEvent(main_s, (cudaEvent_t)ev, 0));
    CK(cudaMemcpyAsync(dst, slot, n, cudaMemcpyDeviceToDevice, main_s));
    /* Hold the consumer back, release after its queued work: the slot stays reserved. */
    CK(cudaLaunchHostFunc(main_s, hold_stream, (void *)(uintptr_t)200));
    assert_int_equal(ast_shadow_release_after(sh, 8, (uintptr_t)main_s), 0);
    assert_int_equal(ast_shadow_lookup(sh, 8, NULL, NULL), AST_ENOENT);
    ast_shadow_stats st;
    assert_int_equal(ast_shadow_stats_get(sh, &st), 0);
    assert_int_equal(st.ring_slots, 1);
    assert_int_equal(ast_shadow_prefetch(sh, host, n, 9, NULL), AST_EBUSY);
    CK(cudaStreamSynchronize(main_s));
    assert_int_equal(ast_shadow_stats_get(sh, &st), 0);
    assert_int_equal(st.ring_slots, 0);
    CK(cudaMemcpy(back, dst, n, cudaMemcpyDeviceToHost));
    assert_memory_equal(back, host, n);
    /* Space is back. */
    assert_int_equal(ast_shadow_prefetch(sh, host, n, 9, NULL), 0);
    assert_int_equal(ast_shadow_prefetch_wait(sh, 9), 0);
    assert_int_equal(ast_shadow_release(sh, 9), 0);

    CK(cudaFree(dst));
    CK(cudaFreeHost(host));
    CK(cudaFreeHost(back));
    CK(cudaStreamDestroy(main_s));
    ast_shadow_destroy(sh);
}

int main(void)
{
    int n = 0;
    cudaError_t e = cudaGetDeviceCount(&n);
    if (e != cudaSuccess || n == 0) {
        printf("skip: no CUDA device (cudaGetDeviceCount: %s, count %d)\n",
               e != cudaSuccess ? cudaGetErrorString(e) : "no error", n);
        return 77;
    }
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_stream_is_lowest_priority_and_non_blocking),
        cmocka_unit_test(test_round_trip_through_device_memory),
        cmocka_unit_test(test_snapshot_is_gated_on_main_stream_event),
        cmocka_unit_test(test_gathered_snapshot_of_device_buffers),
        cmocka_unit_test(test_ready_event_and_release_after),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}

#else

int main(void)
{
    printf("skip: libasteria was built without CUDA (ASTERIA_WITH_CUDA=OFF)\n");
    return 77;
}

#endif
