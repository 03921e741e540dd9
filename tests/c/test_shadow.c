/* test_shadow.c - the shadow copy engine on its host path (always runs, with or without a
 * device): snapshot round trip, prefetch ring wrap-around and AST_EBUSY without corruption,
 * release order, statistics per direction, bad arguments, concurrent use, trace events. */
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <setjmp.h>
#include <cmocka.h>

#include <pthread.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "asteria/errors.h"
#include "asteria/shadow.h"
#include "asteria/trace.h"

static ast_shadow *make(size_t snapshot_bytes, size_t ring_bytes, unsigned max_slots)
{
    ast_shadow_opts o;
    ast_shadow_opts_init(&o);
    o.mode = AST_SHADOW_HOST;
    o.snapshot_bytes = snapshot_bytes;
    o.ring_bytes = ring_bytes;
    o.max_slots = max_slots;
    ast_shadow *sh = NULL;
    char err[512];
    assert_int_equal(ast_shadow_create(&o, &sh, err, sizeof err), 0);
    assert_non_null(sh);
    assert_int_equal(ast_shadow_is_cuda(sh), 0);
    return sh;
}

/* Deterministic bytes for (key, i). */
static unsigned char pat(uint64_t key, size_t i)
{
    return (unsigned char)(key * 131u + i * 7u + (i >> 8));
}

static void fill(unsigned char *p, size_t n, uint64_t key)
{
    for (size_t i = 0; i < n; i++)
        p[i] = pat(key, i);
}

static int check(const unsigned char *p, size_t n, uint64_t key)
{
    for (size_t i = 0; i < n; i++)
        if (p[i] != pat(key, i))
            return 0;
    return 1;
}

static size_t round_up(size_t n)
{
    return (n + AST_SHADOW_ALIGN - 1) / AST_SHADOW_ALIGN * AST_SHADOW_ALIGN;
}

static void test_snapshot_round_trip(void **state)
{
    (void)state;
    ast_shadow *sh = make(1 << 16, 1 << 16, 8);
    unsigned char src[5000];
    fill(src, sizeof src, 9);
    ast_shadow_ticket t;
    assert_int_equal(ast_shadow_snapshot(sh, src, sizeof src, NULL, &t), 0);
    assert_int_not_equal(t.id, 0);
    assert_non_null(t.host);
    assert_int_equal(t.nbytes, sizeof src);
    assert_int_equal((uintptr_t)t.host % AST_SHADOW_ALIGN, 0);
    assert_int_equal(ast_shadow_snapshot_wait(sh, &t), 0);
    assert_int_equal(ast_shadow_snapshot_query(sh, &t), 0);
    void *ev = (void *)0x1;
    assert_int_equal(ast_shadow_snapshot_event(sh, &t, &ev), 0);
    assert_null(ev);
    /* The snapshot is a copy: later changes of the source do not reach it. */
    memset(src, 0, sizeof src);
    assert_true(check(t.host, t.nbytes, 9));
    assert_int_equal(ast_shadow_snapshot_release(sh, &t), 0);
    assert_int_equal(ast_shadow_snapshot_query(sh, &t), AST_ENOENT);
    assert_int_equal(ast_shadow_snapshot_wait(sh, &t), AST_ENOENT);
    assert_int_equal(ast_shadow_snapshot_release(sh, &t), AST_ENOENT);
    ast_shadow_ticket none = {0};
    assert_int_equal(ast_shadow_snapshot_query(sh, &none), AST_ENOENT);

    ast_shadow_stats st;
    assert_int_equal(ast_shadow_stats_get(sh, &st), 0);
    assert_int_equal(st.d2h_bytes, 5000);
    assert_int_equal(st.d2h_copies, 1);
    assert_int_equal(st.snapshot_slots, 0);
    assert_int_equal(st.snapshot_used, 0);
    assert_int_equal(st.snapshot_high_water, round_up(5000));
    assert_int_equal(st.is_cuda, 0);
    assert_int_equal(st.device, -1);
    ast_shadow_destroy(sh);
}

/* A gathered snapshot is the pieces back to back in one slot; bad pieces and a full ring
 * copy nothing and hold nothing. */
static void test_snapshotv_gathers_into_one_slot(void **state)
{
    (void)state;
    ast_shadow *sh = make(1 << 13, 1 << 13, 8);
    unsigned char a[300], b[1000], c[17];
    fill(a, sizeof a, 1);
    fill(b, sizeof b, 2);
    fill(c, sizeof c, 3);
    const ast_shadow_piece pc[3] = {{a, sizeof a}, {b, sizeof b}, {c, sizeof c}};
    ast_shadow_ticket t;
    assert_int_equal(ast_shadow_snapshotv(sh, pc, 3, NULL, &t), 0);
    assert_int_equal(t.nbytes, 1317);
    assert_int_equal((uintptr_t)t.host % AST_SHADOW_ALIGN, 0);
    assert_int_equal(ast_shadow_snapshot_wait(sh, &t), 0);
    memset(b, 0, sizeof b); /* a copy: the sources may change now */
    const unsigned char *h = t.host;
    assert_true(check(h, 300, 1));
    assert_true(check(h + 300, 1000, 2));
    assert_true(check(h + 1300, 17, 3));
    ast_shadow_stats st;
    assert_int_equal(ast_shadow_stats_get(sh, &st), 0);
    assert_int_equal(st.d2h_bytes, 1317);
    assert_int_equal(st.d2h_copies, 1);
    assert_int_equal(st.snapshot_slots, 1);
    assert_int_equal(st.snapshot_used, round_up(1317));

    ast_shadow_ticket u = {.id = 77};
    assert_int_equal(ast_shadow_snapshotv(sh, pc, 0, NULL, &u), AST_EINVAL);
    assert_int_equal(u.id, 0);
    assert_int_equal(ast_shadow_snapshotv(sh, NULL, 2, NULL, &u), AST_EINVAL);
    const ast_shadow_piece holey[2] = {{a, sizeof a}, {NULL, 8}};
    assert_int_equal(ast_shadow_snapshotv(sh, holey, 2, NULL, &u), AST_EINVAL);
    char err[256];
    ast_shadow_last_error(sh, err, sizeof err);
    assert_non_null(strstr(err, "piece 1 of 2"));
    const ast_shadow_piece empty[2] = {{a, sizeof a}, {b, 0}};
    assert_int_equal(ast_shadow_snapshotv(sh, empty, 2, NULL, &u), AST_EINVAL);
    /* together above the capacity, though each piece fits */
    static unsigned char big[5000];
    const ast_shadow_piece two[2] = {{big, sizeof big}, {big, sizeof big}};
    assert_int_equal(ast_shadow_snapshotv(sh, two, 2, NULL, &u), AST_EINVAL);
    /* fits the capacity, not the room the live slot leaves */
    const ast_shadow_piece most[2] = {{big, sizeof big}, {big, 2000}};
    assert_int_equal(ast_shadow_snapshotv(sh, most, 2, NULL, &u), AST_EBUSY);
    assert_int_equal(ast_shadow_stats_get(sh, &st), 0);
    assert_int_equal(st.d2h_bytes, 1317);
    assert_int_equal(st.snapshot_slots, 1);
    assert_int_equal(ast_shadow_snapshot_release(sh, &t), 0);
    assert_int_equal(ast_shadow_snapshotv(sh, most, 2, NULL, &u), 0);
    assert_int_equal(u.nbytes, 7000);
    assert_int_equal(ast_shadow_snapshot_release(sh, &u), 0);
    ast_shadow_destroy(sh);
}

typedef struct live {
    uint64_t key;
    unsigned char *p;
    size_t n;
} live;

/* Every live slot: in the ring, aligned, disjoint from the others, data intact. */
static void check_live(ast_shadow *sh, const live *l, size_t nl, uintptr_t lo, size_t cap)
{
    for (size_t i = 0; i < nl; i++) {
        uintptr_t a = (uintptr_t)l[i].p;
        assert_int_equal(a % AST_SHADOW_ALIGN, 0);
        assert_true(a >= lo && a + l[i].n <= lo + cap);
        for (size_t j = i + 1; j < nl; j++) {
            uintptr_t b = (uintptr_t)l[j].p;
            assert_true(a + round_up(l[i].n) <= b || b + round_up(l[j].n) <= a);
        }
        void *p;
        size_t n;
        assert_int_equal(ast_shadow_lookup(sh, l[i].key, &p, &n), 0);
        assert_ptr_equal(p, l[i].p);
        assert_int_equal(n, l[i].n);
        assert_true(check(l[i].p, l[i].n, l[i].key));
    }
}

static void test_ring_wraps_refuses_when_full_and_release_frees(void **state)
{
    (void)state;
    const size_t cap = 4096;
    ast_shadow *sh = make(4096, cap, 8);
    unsigned char *src = malloc(cap);
    live l[16];
    size_t nl = 0;
    uintptr_t lo = UINTPTR_MAX;
    unsigned busy_seen = 0;
    uint64_t h2d = 0;
    srand(7);

    /* Find the ring's base: the first slot of an empty ring starts at offset 0. */
    fill(src, 1, 0);
    void *p0;
    assert_int_equal(ast_shadow_prefetch(sh, src, 1, 999999, &p0), 0);
    lo = (uintptr_t)p0;
    assert_int_equal(ast_shadow_release(sh, 999999), 0);
    h2d += 1;

    for (uint64_t key = 1; key <= 400; key++) {
        size_t n = 1 + (size_t)rand() % 1500;
        fill(src, n, key);
        void *p = NULL;
        int rc;
        while ((rc = ast_shadow_prefetch(sh, src, n, key, &p)) == AST_EBUSY) {
            busy_seen++;
            assert_null(p);
            char msg[512];
            ast_shadow_last_error(sh, msg, sizeof msg);
            assert_non_null(strstr(msg, "AST_EBUSY"));
            /* The refusal left every in-use slot as it was. */
            check_live(sh, l, nl, lo, cap);
            assert_true(nl > 0);
            /* Release the oldest (FIFO consumer) or, now and then, a newer one first: space
             * only returns once the oldest goes. */
            size_t victim = (key % 5 == 0 && nl > 1) ? 1 : 0;
            assert_int_equal(ast_shadow_release(sh, l[victim].key), 0);
            assert_int_equal(ast_shadow_lookup(sh, l[victim].key, NULL, NULL), AST_ENOENT);
            memmove(&l[victim], &l[victim + 1], (nl - victim - 1) * sizeof *l);
            nl--;
        }
        assert_int_equal(rc, 0);
        h2d += n;
        /* The source may change once the copy completed. */
        memset(src, 0xAB, n);
        assert_int_equal(ast_shadow_prefetch_wait(sh, key), 0);
        void *ev = (void *)0x1;
        assert_int_equal(ast_shadow_ready_event(sh, key, &ev), 0);
        assert_null(ev);
        l[nl++] = (live){key, p, n};
        check_live(sh, l, nl, lo, cap);
    }
    ast_shadow_stats st;
    assert_int_equal(ast_shadow_stats_get(sh, &st), 0);
    assert_int_equal(st.ring_capacity, cap);
    assert_true(st.ring_wraps > 10);
    assert_true(st.ring_high_water <= cap && st.ring_high_water > cap / 2);
    assert_int_equal(st.busy, busy_seen);
    assert_int_equal(st.h2d_bytes, h2d);
    assert_int_equal(st.h2d_copies, 401);
    assert_int_equal(st.ring_slots, nl);
    assert_int_equal(st.d2h_bytes, 0);
    while (nl)
        assert_int_equal(ast_shadow_release(sh, l[--nl].key), 0);
    assert_int_equal(ast_shadow_stats_get(sh, &st), 0);
    assert_int_equal(st.ring_slots, 0);
    assert_int_equal(st.ring_used, 0);
    free(src);
    ast_shadow_destroy(sh);
}

static void test_full_ring_exact_and_out_of_order_release(void **state)
{
    (void)state;
    ast_shadow *sh = make(4096, 1024, 8); /* four 256-byte slots */
    unsigned char src[512];
    void *p[5];
    for (uint64_t k = 0; k < 4; k++) {
        fill(src, 256, k);
        assert_int_equal(ast_shadow_prefetch(sh, src, 256, k, &p[k]), 0);
    }
    fill(src, 1, 4);
    assert_int_equal(ast_shadow_prefetch(sh, src, 1, 4, &p[4]), AST_EBUSY);
    assert_int_equal(ast_shadow_lookup(sh, 4, NULL, NULL), AST_ENOENT);
    /* Releasing a newer slot does not free space while the oldest is in use. */
    assert_int_equal(ast_shadow_release(sh, 2), 0);
    assert_int_equal(ast_shadow_prefetch(sh, src, 1, 4, &p[4]), AST_EBUSY);
    /* A key still staged cannot be staged twice. */
    assert_int_equal(ast_shadow_prefetch(sh, src, 1, 3, NULL), AST_ESTATE);
    for (uint64_t k = 0; k < 4; k++)
        if (k != 2)
            assert_true(check(p[k], 256, k));
    /* The oldest goes: its slot comes back (and the released key 2 stays behind key 1). */
    assert_int_equal(ast_shadow_release(sh, 0), 0);
    assert_int_equal(ast_shadow_prefetch(sh, src, 200, 4, &p[4]), 0);
    assert_ptr_equal(p[4], p[0]);
    ast_shadow_stats st;
    assert_int_equal(ast_shadow_stats_get(sh, &st), 0);
    assert_int_equal(st.ring_used, 1024);
    assert_int_equal(st.ring_high_water, 1024);
    assert_int_equal(st.ring_slots, 4);
    assert_int_equal(st.busy, 2);
    /* Key 1 goes: keys 1 and 2 are reclaimed together; 512 bytes fit at the tail side. */
    assert_int_equal(ast_shadow_release(sh, 1), 0);
    assert_int_equal(ast_shadow_stats_get(sh, &st), 0);
    assert_int_equal(st.ring_slots, 2);
    assert_int_equal(st.ring_used, 512);
    assert_int_equal(ast_shadow_prefetch(sh, src, 512, 5, &p[0]), 0);
    assert_ptr_equal(p[0], p[1]);
    assert_true(check(p[3], 256, 3));
    /* release_after on the host path is an immediate release. */
    assert_int_equal(ast_shadow_release_after(sh, 3, 0), 0);
    assert_int_equal(ast_shadow_lookup(sh, 3, NULL, NULL), AST_ENOENT);
    ast_shadow_destroy(sh);
}

static void test_stats_bytes_per_direction(void **state)
{
    (void)state;
    ast_shadow *sh = make(1 << 14, 1 << 14, 16);
    unsigned char src[1000];
    fill(src, sizeof src, 3);
    ast_shadow_ticket t[3];
    for (int i = 0; i < 3; i++)
        assert_int_equal(ast_shadow_snapshot(sh, src, 1000, NULL, &t[i]), 0);
    assert_int_equal(ast_shadow_prefetch(sh, src, 500, 1, NULL), 0);
    assert_int_equal(ast_shadow_prefetch(sh, src, 700, 2, NULL), 0);
    ast_shadow_stats st;
    assert_int_equal(ast_shadow_stats_get(sh, &st), 0);
    assert_int_equal(st.d2h_bytes, 3000);
    assert_int_equal(st.d2h_copies, 3);
    assert_int_equal(st.h2d_bytes, 1200);
    assert_int_equal(st.h2d_copies, 2);
    assert_int_equal(st.snapshot_slots, 3);
    assert_int_equal(st.snapshot_used, 3 * round_up(1000));
    assert_int_equal(st.ring_used, round_up(500) + round_up(700));
    assert_int_equal(st.ring_wraps, 0);
    assert_int_equal(st.priority, 0);
    for (int i = 0; i < 3; i++) {
        assert_true(check(t[i].host, 1000, 3));
        assert_int_equal(ast_shadow_snapshot_release(sh, &t[i]), 0);
    }
    /* Failed calls move no bytes. */
    assert_int_equal(ast_shadow_prefetch(sh, src, 1 << 15, 3, NULL), AST_EINVAL);
    assert_int_equal(ast_shadow_stats_get(sh, &st), 0);
    assert_int_equal(st.h2d_bytes, 1200);
    assert_int_equal(st.snapshot_slots, 0);
    ast_shadow_destroy(sh);
}

static void test_bad_arguments(void **state)
{
    (void)state;
    char msg[512];
    ast_shadow_opts o;
    ast_shadow_opts_init(&o);
    o.ring_bytes = 0;
    ast_shadow *bad = (ast_shadow *)0x1;
    assert_int_equal(ast_shadow_create(&o, &bad, msg, sizeof msg), AST_EINVAL);
    assert_null(bad);
    assert_non_null(strstr(msg, "ring_bytes"));
    assert_int_equal(ast_shadow_create(NULL, NULL, NULL, 0), AST_EINVAL);

    ast_shadow *sh = make(1024, 2048, 4);
    unsigned char src[4096] = {0};
    assert_int_equal(ast_shadow_prefetch(sh, src, 4096, 1, NULL), AST_EINVAL);
    assert_int_equal(ast_shadow_last_error(sh, msg, sizeof msg), 0);
    assert_non_null(strstr(msg, "AST_EINVAL"));
    assert_non_null(strstr(msg, "4096"));
    assert_non_null(strstr(msg, "exceeds"));
    assert_non_null(strstr(msg, "ring_bytes"));
    ast_shadow_ticket t;
    assert_int_equal(ast_shadow_snapshot(sh, src, 1025, NULL, &t), AST_EINVAL);
    assert_int_equal(t.id, 0);
    assert_int_equal(ast_shadow_last_error(sh, msg, sizeof msg), 0);
    assert_non_null(strstr(msg, "snapshot_bytes"));
    assert_int_equal(ast_shadow_snapshot(sh, NULL, 10, NULL, &t), AST_EINVAL);
    assert_int_equal(ast_shadow_snapshot(sh, src, 0, NULL, &t), AST_EINVAL);
    assert_int_equal(ast_shadow_snapshot(sh, src, 10, NULL, NULL), AST_EINVAL);
    /* No events exist on the host path. */
    assert_int_equal(ast_shadow_snapshot(sh, src, 10, (void *)0x1234, &t), AST_EINVAL);
    assert_int_equal(ast_shadow_last_error(sh, msg, sizeof msg), 0);
    assert_non_null(strstr(msg, "CUDA"));
    assert_int_equal(ast_shadow_prefetch(sh, NULL, 10, 1, NULL), AST_EINVAL);
    assert_int_equal(ast_shadow_lookup(sh, 77, NULL, NULL), AST_ENOENT);
    assert_int_equal(ast_shadow_prefetch_wait(sh, 77), AST_ENOENT);
    assert_int_equal(ast_shadow_release(sh, 77), AST_ENOENT);
    void *ev;
    assert_int_equal(ast_shadow_ready_event(sh, 77, &ev), AST_ENOENT);
    assert_int_equal(ast_shadow_ready_event(sh, 77, NULL), AST_EINVAL);
    uintptr_t h = 1;
    assert_int_equal(ast_shadow_stream_handle(sh, &h), AST_ENODEV);
    assert_int_equal(h, 0);
    ast_shadow_stats st;
    assert_int_equal(ast_shadow_stats_get(sh, &st), 0);
    assert_int_equal(st.d2h_copies + st.h2d_copies, 0);
    assert_int_equal(st.ring_capacity, 2048);
    assert_int_equal(st.snapshot_capacity, 1024);
    ast_shadow_destroy(sh);
    ast_shadow_destroy(NULL);

    /* Capacities round up to whole aligned slots. */
    sh = make(1000, 1000, 2);
    assert_int_equal(ast_shadow_stats_get(sh, &st), 0);
    assert_int_equal(st.ring_capacity, 1024);
    assert_int_equal(ast_shadow_prefetch(sh, src, 1024, 1, NULL), 0);
    ast_shadow_destroy(sh);

    /* Forcing CUDA either works (a device is present) or says there is none. */
    ast_shadow_opts_init(&o);
    o.mode = AST_SHADOW_CUDA;
    o.snapshot_bytes = o.ring_bytes = 1 << 12;
    int rc = ast_shadow_create(&o, &sh, msg, sizeof msg);
    if (rc == 0) {
        assert_int_equal(ast_shadow_is_cuda(sh), 1);
        ast_shadow_destroy(sh);
    } else {
        assert_int_equal(rc, AST_ENODEV);
        assert_non_null(strstr(msg, "mode cuda"));
    }
}

static void test_max_slots_bound(void **state)
{
    (void)state;
    ast_shadow *sh = make(1 << 16, 1 << 16, 3);
    unsigned char src[16] = {1};
    ast_shadow_ticket t[4];
    for (int i = 0; i < 3; i++)
        assert_int_equal(ast_shadow_snapshot(sh, src, sizeof src, NULL, &t[i]), 0);
    assert_int_equal(ast_shadow_snapshot(sh, src, sizeof src, NULL, &t[3]), AST_EBUSY);
    char msg[256];
    ast_shadow_last_error(sh, msg, sizeof msg);
    assert_non_null(strstr(msg, "slots"));
    assert_int_equal(ast_shadow_snapshot_release(sh, &t[0]), 0);
    assert_int_equal(ast_shadow_snapshot(sh, src, sizeof src, NULL, &t[3]), 0);
    /* A stale ticket naming a reused descriptor is refused. */
    assert_int_equal(ast_shadow_snapshot_query(sh, &t[0]), AST_ENOENT);
    assert_int_equal(ast_shadow_snapshot_query(sh, &t[3]), 0);
    ast_shadow_destroy(sh);
}

#define THREADS 4
#define ROUNDS 300

typedef struct targ {
    ast_shadow *sh;
    int id;
} targ;

static void *hammer(void *p)
{
    targ *a = p;
    unsigned char src[700];
    for (int r = 0; r < ROUNDS; r++) {
        uint64_t key = (uint64_t)a->id * 100000u + (uint64_t)r;
        size_t n = 1 + (size_t)((key * 2654435761u) % sizeof src);
        fill(src, n, key);
        int rc;
        while ((rc = ast_shadow_prefetch(a->sh, src, n, key, NULL)) == AST_EBUSY)
            sched_yield();
        if (rc)
            return (void *)"prefetch";
        ast_shadow_ticket t;
        while ((rc = ast_shadow_snapshot(a->sh, src, n, NULL, &t)) == AST_EBUSY)
            sched_yield();
        if (rc || ast_shadow_snapshot_wait(a->sh, &t) || !check(t.host, n, key))
            return (void *)"snapshot";
        if (ast_shadow_snapshot_release(a->sh, &t))
            return (void *)"snapshot release";
        void *dev;
        size_t got;
        if (ast_shadow_prefetch_wait(a->sh, key) || ast_shadow_lookup(a->sh, key, &dev, &got) ||
            got != n || !check(dev, n, key))
            return (void *)"lookup";
        if (ast_shadow_release(a->sh, key))
            return (void *)"release";
    }
    return NULL;
}

static void test_concurrent_use(void **state)
{
    (void)state;
    ast_trace *tr;
    assert_int_equal(ast_trace_create(&tr), 0);
    ast_shadow_opts o;
    ast_shadow_opts_init(&o);
    o.mode = AST_SHADOW_HOST;
    o.snapshot_bytes = 2048;
    o.ring_bytes = 2048;
    o.max_slots = 3;
    o.trace = tr;
    ast_shadow *sh;
    assert_int_equal(ast_shadow_create(&o, &sh, NULL, 0), 0);
    pthread_t th[THREADS];
    targ args[THREADS];
    for (int i = 0; i < THREADS; i++) {
        args[i] = (targ){sh, i};
        assert_int_equal(pthread_create(&th[i], NULL, hammer, &args[i]), 0);
    }
    for (int i = 0; i < THREADS; i++) {
        void *r;
        pthread_join(th[i], &r);
        if (r)
            fail_msg("thread %d failed at %s", i, (const char *)r);
    }
    ast_shadow_stats st;
    assert_int_equal(ast_shadow_stats_get(sh, &st), 0);
    assert_int_equal(st.h2d_copies, THREADS * ROUNDS);
    assert_int_equal(st.d2h_copies, THREADS * ROUNDS);
    assert_int_equal(st.ring_slots, 0);
    assert_int_equal(st.snapshot_slots, 0);
    /* Each copy: an "issued" instant and a "copy" span once seen complete. */
    assert_int_equal(ast_trace_count(tr), 4 * THREADS * ROUNDS);
    ast_shadow_destroy(sh);
    ast_trace_destroy(tr);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_snapshot_round_trip),
        cmocka_unit_test(test_snapshotv_gathers_into_one_slot),
        cmocka_unit_test(test_ring_wraps_refuses_when_full_and_release_frees),
        cmocka_unit_test(test_full_ring_exact_and_out_of_order_release),
        cmocka_unit_test(test_stats_bytes_per_direction),
        cmocka_unit_test(test_bad_arguments),
        cmocka_unit_test(test_max_slots_bound),
        cmocka_unit_test(test_concurrent_use),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
