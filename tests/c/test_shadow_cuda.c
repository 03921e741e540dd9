/* test_shadow_cuda.c - the shadow copy engine on a real device: the stream's priority is the
 * lowest of the range, D2H / H2D round trips through device memory, a snapshot gated on the
 * main stream's event sees that stream's memset, ready events order the main stream's reads,
 * release_after holds a slot until the consumer stream passes, and no call leaves a status in
 * the calling thread's last-error slot (every path that polls a copy in flight sees
 * cudaErrorNotReady; PyTorch reads that slot after each kernel launch). Exits 77 without a
 * device, or 1 when ASTERIA_REQUIRE_GPU=1 says one is expected (tests/gpu/run.sh sets it where
 * torch sees a GPU: a libasteria that cannot reach it is a failure there, not a skip). */
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
#include "cuda_slot.h"

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
    int rc = ast_shadow_create(&o, &sh, err, sizeof err);
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
    SLOT_CLEAN("ast_shadow_snapshot_query on a copy in flight");
    assert_int_equal(ast_shadow_snapshot_wait(sh, &t), 0);
    SLOT_CLEAN("ast_shadow_snapshot_wait");
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
    SLOT_CLEAN("ast_shadow_stats_get with a release pending on a held stream");
    assert_int_equal(st.ring_slots, 1);
    assert_int_equal(ast_shadow_prefetch(sh, host, n, 9, NULL), AST_EBUSY);
    SLOT_CLEAN("ast_shadow_prefetch into a ring whose release is pending");
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

/* Every entry point that polls an event whose work is still queued gets cudaErrorNotReady from
 * the runtime; none may leave it (or anything else) in the thread's last-error slot. The shadow
 * stream and a consumer stream are held back by host functions, so each poll sees work in
 * flight. */
static void test_not_ready_leaves_the_error_slot_clean(void **state)
{
    (void)state;
    const size_t n = (size_t)1 << 20;
    ast_shadow *sh = make(8 * n);
    cudaStream_t main_s, shadow_s;
    cudaEvent_t updated;
    unsigned char *host;
    void *factor;
    uintptr_t h;
    CK(cudaStreamCreateWithFlags(&main_s, cudaStreamNonBlocking));
    CK(cudaEventCreateWithFlags(&updated, cudaEventDisableTiming));
    CK(cudaMallocHost((void **)&host, n));
    CK(cudaMalloc(&factor, n));
    CK(cudaDeviceSynchronize());
    assert_int_equal(ast_shadow_stream_handle(sh, &h), 0);
    shadow_s = (cudaStream_t)h;
    SLOT_CLEAN("setup");

    /* snapshot: gated on an event the held main stream has not reached */
    CK(cudaLaunchHostFunc(main_s, hold_stream, (void *)(uintptr_t)300));
    CK(cudaEventRecord(updated, main_s));
    ast_shadow_ticket t;
    assert_int_equal(ast_shadow_snapshot(sh, factor, n, (void *)updated, &t), 0);
    SLOT_CLEAN("ast_shadow_snapshot");
    assert_int_equal(ast_shadow_snapshot_query(sh, &t), AST_EBUSY);
    SLOT_CLEAN("ast_shadow_snapshot_query (copy in flight)");
    ast_shadow_stats st;
    assert_int_equal(ast_shadow_stats_get(sh, &st), 0);
    SLOT_CLEAN("ast_shadow_stats_get (copy in flight)");
    assert_int_equal(ast_shadow_snapshot_wait(sh, &t), 0); /* polls first, then blocks */
    SLOT_CLEAN("ast_shadow_snapshot_wait (polled a copy in flight)");
    assert_int_equal(ast_shadow_snapshot_release(sh, &t), 0);
    SLOT_CLEAN("ast_shadow_snapshot_release");

    /* prefetch: the shadow stream itself held back, so the H2D copy stays in flight */
    CK(cudaLaunchHostFunc(shadow_s, hold_stream, (void *)(uintptr_t)300));
    void *slot;
    assert_int_equal(ast_shadow_prefetch(sh, host, n, 1, &slot), 0);
    SLOT_CLEAN("ast_shadow_prefetch");
    assert_int_equal(ast_shadow_lookup(sh, 1, NULL, NULL), AST_EBUSY);
    SLOT_CLEAN("ast_shadow_lookup (copy in flight)");
    assert_int_equal(ast_shadow_prefetch_wait(sh, 1), 0);
    SLOT_CLEAN("ast_shadow_prefetch_wait (polled a copy in flight)");

    /* release_after on a held consumer: every reclaim queries the pending release event */
    void *ev;
    assert_int_equal(ast_shadow_ready_event(sh, 1, &ev), 0);
    CK(cudaStreamWaitEvent(main_s, (cudaEvent_t)ev, 0));
    CK(cudaMemcpyAsync(factor, slot, n, cudaMemcpyDeviceToDevice, main_s));
    CK(cudaLaunchHostFunc(main_s, hold_stream, (void *)(uintptr_t)300));
    assert_int_equal(ast_shadow_release_after(sh, 1, (uintptr_t)main_s), 0);
    SLOT_CLEAN("ast_shadow_release_after (consumer held)");
    assert_int_equal(ast_shadow_stats_get(sh, &st), 0);
    assert_int_equal(st.ring_slots, 1);
    SLOT_CLEAN("ast_shadow_stats_get (release pending)");
    assert_int_equal(ast_shadow_prefetch(sh, host, n, 2, NULL), 0);
    SLOT_CLEAN("ast_shadow_prefetch (reclaim polled a pending release)");
    assert_int_equal(ast_shadow_prefetch_wait(sh, 2), 0);
    assert_int_equal(ast_shadow_release(sh, 2), 0);
    SLOT_CLEAN("ast_shadow_release (reclaim polled a pending release)");

    CK(cudaStreamSynchronize(main_s));
    assert_int_equal(ast_shadow_stats_get(sh, &st), 0);
    assert_int_equal(st.ring_slots, 0);
    SLOT_CLEAN("ast_shadow_stats_get (all passed)");
    ast_shadow_destroy(sh);
    SLOT_CLEAN("ast_shadow_destroy");
    CK(cudaFree(factor));
    CK(cudaFreeHost(host));
    CK(cudaEventDestroy(updated));
    CK(cudaStreamDestroy(main_s));
}

int main(void)
{
    int n = 0;
    cudaError_t e = cudaGetDeviceCount(&n);
    if (e != cudaSuccess || n == 0) {
        const char *req = getenv("ASTERIA_REQUIRE_GPU");
        int required = req && !strcmp(req, "1");
        printf("%s: no CUDA device for libasteria's CUDA runtime %d (cudaGetDeviceCount: %s "
               "(%s), count %d)%s\n", required ? "FAIL" : "skip", CUDART_VERSION,
               e != cudaSuccess ? cudaGetErrorString(e) : "no error",
               e != cudaSuccess ? cudaGetErrorName(e) : "cudaSuccess", n,
               required ? "; ASTERIA_REQUIRE_GPU=1: a device is expected here (an older "
                          "driver than this runtime reports cudaErrorInsufficientDriver)"
                        : "");
        return required ? 1 : 77;
    }
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_stream_is_lowest_priority_and_non_blocking),
        cmocka_unit_test(test_round_trip_through_device_memory),
        cmocka_unit_test(test_snapshot_is_gated_on_main_stream_event),
        cmocka_unit_test(test_gathered_snapshot_of_device_buffers),
        cmocka_unit_test(test_ready_event_and_release_after),
        cmocka_unit_test(test_not_ready_leaves_the_error_slot_clean),
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
