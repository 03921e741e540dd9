/*
 * test_cuda_mem.c - the CUDA memory wrappers and the store's CUDA tiers, on a real device.
 *
 * Exits 77 (skip) with the reason printed when libasteria is built without CUDA or
 * ast__cuda_device_count() finds no device, unless ASTERIA_REQUIRE_GPU=1 says a device is
 * expected (tests/gpu/run.sh, where torch sees one): then no device is a failure (1), e.g. a
 * driver older than the CUDA runtime libasteria was built with; compiled on every build. Every
 * wrapper, failing ones included, leaves the thread's last-error slot clean. With a device: pinned and
 * device allocations are zero-filled, H2D/D2H copies round-trip, blocks move HOST -> HOST_PINNED
 * -> DEVICE -> HOST (and DEVICE -> NVME -> DEVICE where a scratch directory allows) with their
 * bytes and the per-tier accounting intact, and the UVM tier follows the device's reported
 * coherence: allocated when either attribute says coherent, AST_ENOTSUP otherwise.
 * Under ASan the CUDA runtime needs ASAN_OPTIONS=protect_shadow_gap=0.
 */
#include "asteria/build_config.h"
#include "asteria/errors.h"
#include "asteria/store.h"
#include "cuda_mem.h"

#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cmocka.h>

#include "test_helpers.h"

static void fill_random(unsigned char *c, size_t n, uint64_t seed)
{
    uint64_t x = seed * 0x9E3779B97F4A7C15ull + 1;
    for (size_t i = 0; i < n; i++) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        c[i] = (unsigned char)x;
    }
}

static int all_zero(const unsigned char *c, size_t n)
{
    for (size_t i = 0; i < n; i++)
        if (c[i])
            return 0;
    return 1;
}

static void expect_acct(ast_store *s, ast_tier t, uint64_t bytes, uint64_t blocks)
{
    ast_store_stats st;
    assert_int_equal(ast_store_stats_get(s, &st), 0);
    assert_int_equal(st.bytes[t], bytes);
    assert_int_equal(st.blocks[t], blocks);
}

static void expect_tier(ast_store *s, uint64_t id, ast_tier want)
{
    ast_tier t;
    assert_int_equal(ast_store_tier(s, id, &t), 0);
    assert_int_equal(t, want);
}

/* The bytes of a block wherever it lives, copied to host memory. */
static void read_back(ast_store *s, uint64_t id, unsigned char *out, size_t n)
{
    char err[256];
    void *p = ast_store_data(s, id);
    assert_non_null(p);
    if (ast__cuda_memcpy(out, p, n, err, sizeof err) != 0)
        fail_msg("%s", err);
}

#include "cuda_slot.h"

static void test_wrappers(void **state)
{
    const size_t n = (1u << 20) + 13;
    unsigned char *h = malloc(n), *back = malloc(n);
    void *pinned = NULL, *dev = NULL;
    char err[256];
    (void)state;

    assert_true(ast__cuda_device_count() > 0);
    assert_int_equal(ast__cuda_host_alloc(&pinned, n, err, sizeof err), 0);
    assert_true(all_zero(pinned, n));
    assert_int_equal(ast__cuda_malloc(&dev, n, err, sizeof err), 0);
    assert_int_equal(ast__cuda_memcpy(back, dev, n, err, sizeof err), 0);
    assert_true(all_zero(back, n));

    fill_random(h, n, 1);
    assert_int_equal(ast__cuda_memcpy(dev, h, n, err, sizeof err), 0);      /* H2D pageable */
    assert_int_equal(ast__cuda_memcpy(pinned, dev, n, err, sizeof err), 0); /* D2H pinned */
    assert_memory_equal(pinned, h, n);

    assert_int_equal(ast__cuda_free(dev, err, sizeof err), 0);
    assert_int_equal(ast__cuda_host_free(pinned, err, sizeof err), 0);
    /* An impossible allocation is a CUDA error with the runtime's message, not a crash. */
    assert_int_equal(ast__cuda_malloc(&dev, (size_t)1 << 62, err, sizeof err), AST_ECUDA);
    assert_non_null(strstr(err, "cudaMalloc"));
    SLOT_CLEAN("a failed ast__cuda_malloc");
    printf("[  NOTE    ] oversized cudaMalloc: %s\n", err);
    free(h);
    free(back);
}

static void test_store_tiers(void **state)
{
    const size_t n = 3 * 100000 + 7;
    unsigned char *want = malloc(n), *got = malloc(n);
    ast_store *s = NULL;
    uint64_t id, z;
    size_t moved;
    (void)state;

    assert_int_equal(ast_store_open(NULL, &s, NULL, 0), 0);
    assert_int_equal(ast_store_alloc(s, AST_TIER_HOST, n, &id), 0);
    fill_random(want, n, 7);
    memcpy(ast_store_data(s, id), want, n);

    assert_int_equal(ast_store_move(s, &id, 1, AST_TIER_HOST_PINNED, &moved), 0);
    assert_int_equal(moved, 1);
    expect_tier(s, id, AST_TIER_HOST_PINNED);
    expect_acct(s, AST_TIER_HOST, 0, 0);
    expect_acct(s, AST_TIER_HOST_PINNED, n, 1);
    assert_memory_equal(ast_store_data(s, id), want, n); /* pinned memory is host-addressable */

    assert_int_equal(ast_store_move(s, &id, 1, AST_TIER_DEVICE, &moved), 0);
    expect_tier(s, id, AST_TIER_DEVICE);
    expect_acct(s, AST_TIER_HOST_PINNED, 0, 0);
    expect_acct(s, AST_TIER_DEVICE, n, 1);
    read_back(s, id, got, n);
    assert_memory_equal(got, want, n);

    assert_int_equal(ast_store_move(s, &id, 1, AST_TIER_HOST, &moved), 0);
    expect_acct(s, AST_TIER_DEVICE, 0, 0);
    expect_acct(s, AST_TIER_HOST, n, 1);
    assert_memory_equal(ast_store_data(s, id), want, n);

    assert_int_equal(ast_store_alloc(s, AST_TIER_DEVICE, 5000, &z), 0);
    read_back(s, z, got, 5000);
    assert_true(all_zero(got, 5000));
    assert_int_equal(ast_store_alloc(s, AST_TIER_HOST_PINNED, 5000, &z), 0);
    assert_true(all_zero(ast_store_data(s, z), 5000));
    ast_store_close(s);
    free(want);
    free(got);
}

/* DEVICE -> NVME -> DEVICE: the records are staged through cudaMemcpy chunk by chunk. */
static void test_device_nvme(void **state)
{
    enum { N = 6 };
    const size_t sizes[N] = {1, 4096, 70000, (1u << 20) + 5, (2u << 20) + 333, 12};
    const char *root = test_tmp_root();
    unsigned char *want = malloc(3u << 20), *got = malloc(3u << 20);
    ast_store_opts o;
    ast_store *s = NULL;
    char dir[512], err[512];
    uint64_t ids[N];
    size_t moved;
    char errs[512];
    (void)state;

    snprintf(dir, sizeof dir, "%s/cuda-nvme-%ld", root, (long)getpid());
    assert_int_equal(mkdir(dir, 0755), 0);
    ast_store_opts_init(&o);
    o.nvme_dir = dir;
    o.direct = AST_DIRECT_FALLBACK;
    if (ast_store_open(&o, &s, err, sizeof err) != 0)
        fail_msg("%s", err);
    for (int i = 0; i < N; i++) {
        char e[256];
        assert_int_equal(ast_store_alloc(s, AST_TIER_DEVICE, sizes[i], &ids[i]), 0);
        fill_random(want, sizes[i], 50 + (uint64_t)i);
        assert_int_equal(ast__cuda_memcpy(ast_store_data(s, ids[i]), want, sizes[i], e, sizeof e),
                         0);
    }
    if (ast_store_move(s, ids, N, AST_TIER_NVME, &moved) != 0) {
        ast_store_last_error(s, errs, sizeof errs);
        fail_msg("%s", errs);
    }
    expect_acct(s, AST_TIER_DEVICE, 0, 0);
    assert_int_equal(ast_store_move(s, ids, N, AST_TIER_DEVICE, &moved), 0);
    assert_int_equal(moved, N);
    for (int i = 0; i < N; i++) {
        expect_tier(s, ids[i], AST_TIER_DEVICE);
        fill_random(want, sizes[i], 50 + (uint64_t)i);
        read_back(s, ids[i], got, sizes[i]);
        assert_memory_equal(got, want, sizes[i]);
    }
    ast_store_close(s);
    rmdir(dir);
    free(want);
    free(got);
}

static void test_uvm_detection(void **state)
{
    ast__cuda_coherence c;
    ast_store *s = NULL;
    char err[256], msg[512];
    int coherent = -1;
    uint64_t id;
    int rc;
    (void)state;

    assert_int_equal(ast__cuda_coherent_host_access(&coherent, &c, err, sizeof err), 0);
    SLOT_CLEAN("ast__cuda_coherent_host_access");
    printf("[  NOTE    ] device %d: concurrentManagedAccess=%d "
           "pageableMemoryAccessUsesHostPageTables=%d -> coherent=%d\n",
           c.device, c.concurrent_managed, c.pageable_host_tables, coherent);
    assert_int_equal(coherent, c.concurrent_managed || c.pageable_host_tables);

    assert_int_equal(ast_store_open(NULL, &s, NULL, 0), 0);
    rc = ast_store_alloc(s, AST_TIER_UVM, 1 << 16, &id);
    SLOT_CLEAN("ast_store_alloc(uvm)");
    if (coherent) {
        unsigned char *p;
        size_t moved;
        assert_int_equal(rc, 0);
        p = ast_store_data(s, id);
        assert_true(all_zero(p, 1 << 16));
        fill_random(p, 1 << 16, 3); /* written from the host, as coherence allows */
        expect_acct(s, AST_TIER_UVM, 1 << 16, 1);
        assert_int_equal(ast_store_move(s, &id, 1, AST_TIER_HOST, &moved), 0);
        {
            unsigned char *want = malloc(1 << 16);
            fill_random(want, 1 << 16, 3);
            assert_memory_equal(ast_store_data(s, id), want, 1 << 16);
            free(want);
        }
        expect_acct(s, AST_TIER_UVM, 0, 0);
    } else {
        assert_int_equal(rc, AST_ENOTSUP);
        assert_int_equal(ast_store_last_error(s, msg, sizeof msg), 0);
        assert_non_null(strstr(msg, "coherent"));
    }
    ast_store_close(s);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_wrappers),
        cmocka_unit_test(test_store_tiers),
        cmocka_unit_test(test_device_nvme),
        cmocka_unit_test(test_uvm_detection),
    };
    if (!ASTERIA_HAVE_CUDA) {
        printf("SKIP: libasteria was built without CUDA (ASTERIA_WITH_CUDA=OFF)\n");
        return 77;
    }
    if (ast__cuda_device_count() == 0) {
        const char *req = getenv("ASTERIA_REQUIRE_GPU");
        if (req && !strcmp(req, "1")) {
            printf("FAIL: ASTERIA_REQUIRE_GPU=1 but libasteria's CUDA runtime finds no device "
                   "(cudaGetDeviceCount reports none or an error: no driver, or one older "
                   "than the runtime it was built with)\n");
            return 1;
        }
        printf("SKIP: no CUDA device (cudaGetDeviceCount reports none or no driver is loaded)\n");
        return 77;
    }
    return cmocka_run_group_tests(tests, NULL, NULL);
}
