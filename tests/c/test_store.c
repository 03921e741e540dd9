/*
 * test_store.c - the store: tiers, accounting, batched NVMe moves, and every NVMe fault case.
 *
 * Fault cases run for real wherever this machine allows and through testing.h's injected faults
 * always (so a machine without mount rights still covers every path):
 *   - missing directory: real.
 *   - read-only directory: chmod 0555 (real for non-root; root bypasses permissions, so it is
 *     skipped for root), a read-only bind mount (real, needs CAP_SYS_ADMIN), injected EROFS.
 *   - no O_DIRECT: a ramfs mount (real: ramfs refuses O_DIRECT; tmpfs accepts it since Linux
 *     6.6), injected probe result (NO_ODIRECT).
 *   - ENOSPC: a 1 MiB tmpfs mount (real, from fallocate and, with the reservation disabled, from
 *     the write completions), injected -ENOSPC completions, and the store's nvme_budget_bytes.
 *   - corruption, truncation, foreign records: real (bytes flipped, files truncated or copied).
 *   - formats (ast_store_set_format): each record's header names its block's format; a record
 *     of another format (written through the engine, valid checksums) is refused naming both.
 *   - fork: a real fork(); parent and child do I/O at the same time.
 * Mounts are made in a private mount namespace (unshare(CLONE_NEWNS) at start), so they vanish
 * with the process even if it crashes; without the capability those sub-cases print a note.
 * Directories live under $ASTERIA_TEST_TMPDIR (or /tmp) and are removed.
 */
#include "asteria/build_config.h"
#include "asteria/errors.h"
#include "asteria/quant.h"
#include "asteria/store.h"
#include "cuda_mem.h"
#include "nvme.h"
#include "test_helpers.h"
#include "testing.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <ftw.h>
#include <inttypes.h>
#include <pthread.h>
#include <sched.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmocka.h>

static int g_can_mount; /* private mount namespace obtained */

/* ---- helpers -------------------------------------------------------------------------------- */

static void make_dir(char *out, size_t len, const char *what)
{
    static unsigned counter;
    snprintf(out, len, "%s/store-%ld-%u-%s", test_tmp_root(), (long)getpid(), counter++, what);
    assert_int_equal(mkdir(out, 0755), 0);
}

static int rm_one(const char *p, const struct stat *st, int flag, struct FTW *f)
{
    (void)st;
    (void)flag;
    (void)f;
    remove(p);
    return 0;
}

static void rm_rf(const char *dir)
{
    nftw(dir, rm_one, 16, FTW_DEPTH | FTW_PHYS);
}

/* Files in dir whose names start with "ast-" (and end with suffix, if given). */
static int count_files(const char *dir, const char *suffix)
{
    DIR *d = opendir(dir);
    struct dirent *e;
    int n = 0;
    assert_non_null(d);
    while ((e = readdir(d)) != NULL) {
        size_t l = strlen(e->d_name);
        if (strncmp(e->d_name, "ast-", 4) != 0)
            continue;
        if (suffix && (l < strlen(suffix) || strcmp(e->d_name + l - strlen(suffix), suffix)))
            continue;
        n++;
    }
    closedir(d);
    return n;
}

static void fill_random(void *p, size_t n, uint64_t seed)
{
    unsigned char *c = p;
    uint64_t x = seed * 0x9E3779B97F4A7C15ull + 1;
    for (size_t i = 0; i < n; i += 8) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        memcpy(c + i, &x, n - i < 8 ? n - i : 8);
    }
}

static void check_random(const void *p, size_t n, uint64_t seed)
{
    unsigned char *want = malloc(n);
    assert_non_null(want);
    fill_random(want, n, seed);
    assert_memory_equal(p, want, n);
    free(want);
}

static int all_zero(const void *p, size_t n)
{
    const unsigned char *c = p;
    for (size_t i = 0; i < n; i++)
        if (c[i])
            return 0;
    return 1;
}

static ast_store *open_store_f(const char *dir, ast_direct_policy direct, unsigned qd,
                               uint64_t budget, unsigned faults)
{
    ast_store_opts o;
    ast_store *s = NULL;
    char err[512];
    int rc;

    ast_store_opts_init(&o);
    o.nvme_dir = dir;
    o.direct = direct;
    o.queue_depth = qd;
    o.nvme_budget_bytes = budget;
    rc = faults ? ast__store_open_faults(&o, faults, &s, err, sizeof err)
                : ast_store_open(&o, &s, err, sizeof err);
    if (rc)
        fail_msg("ast_store_open(%s): %s: %s", dir ? dir : "(none)", ast_err_name(rc), err);
    return s;
}

static ast_store *open_store(const char *dir, ast_direct_policy direct, unsigned qd,
                             uint64_t budget)
{
    return open_store_f(dir, direct, qd, budget, 0);
}

static int open_rc(const char *dir, ast_direct_policy direct, unsigned faults, char *err,
                   size_t len, ast_store **out)
{
    ast_store_opts o;
    ast_store_opts_init(&o);
    o.nvme_dir = dir;
    o.direct = direct;
    *out = NULL;
    return ast__store_open_faults(&o, faults, out, err, len);
}

static uint64_t alloc_random(ast_store *s, ast_tier t, size_t n, uint64_t seed)
{
    uint64_t id = 0;
    void *p;
    assert_int_equal(ast_store_alloc(s, t, n, &id), 0);
    assert_true(id != 0);
    p = ast_store_data(s, id);
    assert_non_null(p);
    assert_true(all_zero(p, n));
    fill_random(p, n, seed);
    return id;
}

static void expect_tier(ast_store *s, uint64_t id, ast_tier want)
{
    ast_tier t;
    assert_int_equal(ast_store_tier(s, id, &t), 0);
    assert_int_equal(t, want);
}

static void expect_acct(ast_store *s, ast_tier t, uint64_t bytes, uint64_t blocks)
{
    ast_store_stats st;
    assert_int_equal(ast_store_stats_get(s, &st), 0);
    assert_int_equal(st.bytes[t], bytes);
    assert_int_equal(st.blocks[t], blocks);
}

static void expect_error_mentions(ast_store *s, const char *a, const char *b)
{
    char msg[1024];
    assert_int_equal(ast_store_last_error(s, msg, sizeof msg), 0);
    if ((a && !strstr(msg, a)) || (b && !strstr(msg, b)))
        fail_msg("last error \"%s\" does not mention \"%s\" and \"%s\"", msg, a ? a : "",
                 b ? b : "");
}

static void record_path(ast_store *s, uint64_t id, char *buf, size_t len)
{
    assert_int_equal(ast_store_record_path(s, id, buf, len), 0);
}

static void flip_byte(const char *path, off_t off)
{
    int fd = open(path, O_RDWR);
    unsigned char c;
    assert_true(fd >= 0);
    assert_int_equal(pread(fd, &c, 1, off), 1);
    c ^= 0x5a;
    assert_int_equal(pwrite(fd, &c, 1, off), 1);
    close(fd);
}

static void copy_file(const char *from, const char *to)
{
    char buf[65536];
    int in = open(from, O_RDONLY), out = open(to, O_WRONLY | O_TRUNC);
    ssize_t n;
    assert_true(in >= 0 && out >= 0);
    while ((n = read(in, buf, sizeof buf)) > 0)
        assert_int_equal(write(out, buf, (size_t)n), n);
    close(in);
    close(out);
}

static off_t file_size(const char *path)
{
    struct stat st;
    assert_int_equal(stat(path, &st), 0);
    return st.st_size;
}

static int mount_fs(const char *type, const char *opts, const char *dir)
{
    if (!g_can_mount)
        return -1;
    return mount(type, dir, type, 0, opts);
}

static void note(const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    printf("[  NOTE    ] ");
    vprintf(fmt, ap);
    printf("\n");
    va_end(ap);
    fflush(stdout);
}

/* NVMe cases need liburing; without it the store must refuse an nvme_dir, and they skip. */
#define NEED_NVME()                                                                            \
    do {                                                                                       \
        if (!ASTERIA_HAVE_URING)                                                               \
            skip();                                                                            \
    } while (0)

static void test_no_uring_refuses_nvme(void **state)
{
    char dir[512], err[512];
    ast_store *s;
    (void)state;
    if (ASTERIA_HAVE_URING)
        skip();
    make_dir(dir, sizeof dir, "nouring");
    assert_int_equal(open_rc(dir, AST_DIRECT_REQUIRE, 0, err, sizeof err, &s), AST_ENOTSUP);
    assert_non_null(strstr(err, "liburing"));
    rm_rf(dir);
}

/* ---- tiers without NVMe --------------------------------------------------------------------- */

static void test_tier_names(void **state)
{
    ast_tier t;
    (void)state;
    for (int i = 0; i < AST_TIER_COUNT; i++) {
        assert_int_equal(ast_tier_parse(ast_tier_name((ast_tier)i), &t), 0);
        assert_int_equal(t, i);
    }
    assert_string_equal(ast_tier_name(AST_TIER_HOST_PINNED), "host_pinned");
    assert_null(ast_tier_name(AST_TIER_COUNT));
    assert_int_equal(ast_tier_parse("ssd", &t), AST_EINVAL);
    assert_int_equal(ast_tier_parse(NULL, &t), AST_EINVAL);
}

/* The listing order holds every tier once, device first (the order users read them in). */
static void test_tier_listing_order(void **state)
{
    (void)state;
    int seen[AST_TIER_COUNT] = {0};
    for (int i = 0; i < AST_TIER_COUNT; i++) {
        const ast_tier t = ast_tier_listed(i);
        assert_true((unsigned)t < AST_TIER_COUNT);
        assert_int_equal(seen[t]++, 0);
        assert_non_null(ast_tier_name(t));
    }
    assert_int_equal(ast_tier_listed(0), AST_TIER_DEVICE);
    assert_int_equal(ast_tier_listed(AST_TIER_COUNT - 1), AST_TIER_NVME);
    assert_int_equal(ast_tier_listed(-1), AST_TIER_COUNT);
    assert_int_equal(ast_tier_listed(AST_TIER_COUNT), AST_TIER_COUNT);
}

static void test_host_tier(void **state)
{
    ast_store *s = open_store(NULL, AST_DIRECT_REQUIRE, 0, 0);
    ast_store_stats st;
    uint64_t a, b, bogus = 12345;
    size_t n, moved = 99;
    char path[256];
    (void)state;

    a = alloc_random(s, AST_TIER_HOST, 1000, 1);
    expect_acct(s, AST_TIER_HOST, 1000, 1);
    b = alloc_random(s, AST_TIER_HOST, 24, 2);
    expect_acct(s, AST_TIER_HOST, 1024, 2);
    assert_int_equal(ast_store_size(s, a, &n), 0);
    assert_int_equal(n, 1000);
    expect_tier(s, a, AST_TIER_HOST);
    check_random(ast_store_data(s, a), 1000, 1);

    /* A same-tier move is a no-op that counts as moved. */
    assert_int_equal(ast_store_move(s, &a, 1, AST_TIER_HOST, &moved), 0);
    assert_int_equal(moved, 1);
    check_random(ast_store_data(s, a), 1000, 1);

    assert_int_equal(ast_store_stats_get(s, &st), 0);
    assert_int_equal(st.nvme_direct, -1);
    assert_int_equal(ast_store_move(s, &a, 1, AST_TIER_NVME, &moved), AST_ENOTSUP);
    assert_int_equal(moved, 0);
    expect_error_mentions(s, "nvme", "nvme_dir");
    assert_int_equal(ast_store_alloc(s, AST_TIER_NVME, 10, &bogus), AST_ENOTSUP);
    assert_int_equal(ast_store_record_path(s, a, path, sizeof path), AST_ESTATE);

    assert_int_equal(ast_store_alloc(s, AST_TIER_HOST, 0, &bogus), AST_EINVAL);
    assert_int_equal(ast_store_alloc(s, AST_TIER_COUNT, 8, &bogus), AST_EINVAL);
    assert_int_equal(ast_store_free(s, 12345), AST_ENOENT);
    expect_error_mentions(s, "12345", NULL);
    assert_null(ast_store_data(s, 12345));
    assert_int_equal(ast_store_move(s, &bogus, 1, AST_TIER_HOST, &moved), AST_ENOENT);
    {
        uint64_t twice[2] = {a, a};
        assert_int_equal(ast_store_move(s, twice, 2, AST_TIER_HOST, &moved), AST_EINVAL);
        assert_int_equal(moved, 0);
    }
    assert_int_equal(ast_store_free(s, a), 0);
    expect_acct(s, AST_TIER_HOST, 24, 1);
    assert_int_equal(ast_store_free(s, b), 0);
    expect_acct(s, AST_TIER_HOST, 0, 0);
    ast_store_close(s);
}

/* Many blocks, so the table grows and deletes shift entries. */
static void test_block_table(void **state)
{
    ast_store *s = open_store(NULL, AST_DIRECT_REQUIRE, 0, 0);
    enum { N = 3000 };
    uint64_t *ids = malloc(N * sizeof *ids);
    size_t n;
    (void)state;

    assert_non_null(ids);
    for (int i = 0; i < N; i++)
        assert_int_equal(ast_store_alloc(s, AST_TIER_HOST, (size_t)(i % 13) + 1, &ids[i]), 0);
    for (int i = 0; i < N; i += 3)
        assert_int_equal(ast_store_free(s, ids[i]), 0);
    for (int i = 0; i < N; i++) {
        int rc = ast_store_size(s, ids[i], &n);
        if (i % 3 == 0) {
            assert_int_equal(rc, AST_ENOENT);
        } else {
            assert_int_equal(rc, 0);
            assert_int_equal(n, (size_t)(i % 13) + 1);
        }
    }
    {
        uint64_t live = 0;
        for (int i = 0; i < N; i++)
            if (i % 3)
                live += (uint64_t)(i % 13) + 1;
        expect_acct(s, AST_TIER_HOST, live, N - N / 3);
    }
    free(ids);
    ast_store_close(s);
}

static void test_cuda_tiers_absent(void **state)
{
    ast_store *s;
    uint64_t id, h;
    size_t moved = 7;
    (void)state;

    if (ast__cuda_device_count() > 0)
        skip(); /* test_cuda_mem covers these tiers on a machine with a device */
    s = open_store(NULL, AST_DIRECT_REQUIRE, 0, 0);
    assert_int_equal(ast_store_alloc(s, AST_TIER_HOST_PINNED, 64, &id), AST_ENODEV);
    expect_error_mentions(s, "host_pinned", "CUDA");
    assert_int_equal(ast_store_alloc(s, AST_TIER_DEVICE, 64, &id), AST_ENODEV);
    expect_error_mentions(s, "device", "no CUDA device");
    assert_int_equal(ast_store_alloc(s, AST_TIER_UVM, 64, &id), AST_ENODEV);
    expect_error_mentions(s, "uvm", NULL);

    h = alloc_random(s, AST_TIER_HOST, 4000, 9);
    assert_int_equal(ast_store_move(s, &h, 1, AST_TIER_DEVICE, &moved), AST_ENODEV);
    assert_int_equal(moved, 0);
    expect_tier(s, h, AST_TIER_HOST);
    check_random(ast_store_data(s, h), 4000, 9);
    expect_acct(s, AST_TIER_HOST, 4000, 1);
    expect_acct(s, AST_TIER_DEVICE, 0, 0);
    ast_store_close(s);
}

/* ---- NVMe round trips ---------------------------------------------------------------------- */

/* Sizes around the record's alignment edges: header 64 + payload + trailer 8 vs 4096, and
 * records larger than one staging slot. */
static const size_t EDGE_SIZES[] = {1,    7,     4024, 4025, 4026, 4031, 4032, 4033,
                                    4096, 65536, 100003, (1u << 20) - 72, (3u << 20) + 123};
#define NEDGE (sizeof EDGE_SIZES / sizeof EDGE_SIZES[0])

static void roundtrip(const char *dir, ast_direct_policy pol, unsigned qd, unsigned faults,
                      int want_direct)
{
    ast_store *s = open_store_f(dir, pol, qd, 0, faults);
    uint64_t ids[NEDGE];
    uint64_t total = 0;
    ast_store_stats st;
    size_t moved;
    char path[512];

    for (size_t i = 0; i < NEDGE; i++) {
        ids[i] = alloc_random(s, AST_TIER_HOST, EDGE_SIZES[i], 100 + i);
        total += EDGE_SIZES[i];
    }
    expect_acct(s, AST_TIER_HOST, total, NEDGE);
    assert_int_equal(ast_store_move(s, ids, NEDGE, AST_TIER_NVME, &moved), 0);
    assert_int_equal(moved, NEDGE);
    expect_acct(s, AST_TIER_HOST, 0, 0);
    expect_acct(s, AST_TIER_NVME, total, NEDGE);
    assert_int_equal(ast_store_stats_get(s, &st), 0);
    assert_int_equal(st.nvme_direct, want_direct);
    assert_int_equal(st.nvme_writes, NEDGE);
    assert_true(st.nvme_bytes_written >= total);
    assert_true(st.nvme_write_ns > 0);
    for (size_t i = 0; i < NEDGE; i++) {
        expect_tier(s, ids[i], AST_TIER_NVME);
        assert_null(ast_store_data(s, ids[i]));
        record_path(s, ids[i], path, sizeof path);
        assert_int_equal(file_size(path), (off_t)ast__nvme_record_bytes(EDGE_SIZES[i]));
        assert_int_equal(file_size(path) % 4096, 0);
    }
    assert_int_equal(count_files(dir, ".rec"), NEDGE);
    assert_int_equal(count_files(dir, ".tmp"), 0);

    assert_int_equal(ast_store_move(s, ids, NEDGE, AST_TIER_HOST, &moved), 0);
    assert_int_equal(moved, NEDGE);
    for (size_t i = 0; i < NEDGE; i++)
        check_random(ast_store_data(s, ids[i]), EDGE_SIZES[i], 100 + i);
    expect_acct(s, AST_TIER_HOST, total, NEDGE);
    expect_acct(s, AST_TIER_NVME, 0, 0);
    assert_int_equal(ast_store_stats_get(s, &st), 0);
    assert_int_equal(st.nvme_reads, NEDGE);
    assert_true(st.nvme_bytes_read >= total);
    assert_true(st.nvme_read_ns > 0);
    /* Loaded records stay, stale (their generation is behind), to be rewritten in place. */
    assert_int_equal(count_files(dir, ".rec"), NEDGE);
    for (size_t i = 0; i < NEDGE; i++)
        fill_random(ast_store_data(s, ids[i]), EDGE_SIZES[i], 200 + i);
    assert_int_equal(ast_store_move(s, ids, NEDGE, AST_TIER_NVME, &moved), 0);
    assert_int_equal(count_files(dir, ".rec"), NEDGE);
    assert_int_equal(count_files(dir, ".tmp"), 0);
    assert_int_equal(ast_store_move(s, ids, NEDGE, AST_TIER_HOST, &moved), 0);
    for (size_t i = 0; i < NEDGE; i++)
        check_random(ast_store_data(s, ids[i]), EDGE_SIZES[i], 200 + i);
    ast_store_close(s);
    assert_int_equal(count_files(dir, NULL), 0);
}

static void test_nvme_roundtrip(void **state)
{
    char dir[512];
    (void)state;
    NEED_NVME();
    make_dir(dir, sizeof dir, "rt");
    {
        ast_store *s = open_store(dir, AST_DIRECT_REQUIRE, 0, 0);
        note("staging buffers %s with io_uring", ast__nvme_fixed(ast__store_nvme(s))
                                                      ? "registered"
                                                      : "NOT registered (RLIMIT_MEMLOCK?)");
        ast_store_close(s);
    }
    roundtrip(dir, AST_DIRECT_REQUIRE, 0, 0, 1);
    roundtrip(dir, AST_DIRECT_REQUIRE, 1, 0, 1); /* one slot: every chunk is its own round */
    rm_rf(dir);
}

/* Many blocks through a small ring: many rounds per batch; moves of subsets; mixed sources. */
static void test_nvme_batched(void **state)
{
    enum { N = 200 };
    char dir[512];
    uint64_t ids[N], half[N / 2], total = 0;
    size_t sizes[N], moved;
    ast_store *s;
    (void)state;
    NEED_NVME();

    make_dir(dir, sizeof dir, "batch");
    s = open_store(dir, AST_DIRECT_REQUIRE, 4, 0);
    for (int i = 0; i < N; i++) {
        sizes[i] = 1 + (size_t)((i * 7919u) % 30000u);
        ids[i] = alloc_random(s, AST_TIER_HOST, sizes[i], 1000 + (uint64_t)i);
        total += sizes[i];
    }
    assert_int_equal(ast_store_move(s, ids, N, AST_TIER_NVME, &moved), 0);
    assert_int_equal(moved, N);
    expect_acct(s, AST_TIER_NVME, total, N);

    /* Every other block back, then everything (a mix of HOST and NVME sources). */
    for (int i = 0; i < N / 2; i++)
        half[i] = ids[2 * i];
    assert_int_equal(ast_store_move(s, half, N / 2, AST_TIER_HOST, &moved), 0);
    assert_int_equal(moved, N / 2);
    {
        uint64_t odd = 0;
        for (int i = 1; i < N; i += 2)
            odd += sizes[i];
        expect_acct(s, AST_TIER_NVME, odd, N / 2);
        expect_acct(s, AST_TIER_HOST, total - odd, N / 2);
    }
    assert_int_equal(ast_store_move(s, ids, N, AST_TIER_HOST, &moved), 0);
    assert_int_equal(moved, N);
    for (int i = 0; i < N; i++)
        check_random(ast_store_data(s, ids[i]), sizes[i], 1000 + (uint64_t)i);
    expect_acct(s, AST_TIER_HOST, total, N);
    expect_acct(s, AST_TIER_NVME, 0, 0);

    /* A second trip uses a new generation of each record. */
    assert_int_equal(ast_store_move(s, ids, N, AST_TIER_NVME, &moved), 0);
    assert_int_equal(ast_store_move(s, ids, N, AST_TIER_HOST, &moved), 0);
    for (int i = 0; i < N; i++)
        check_random(ast_store_data(s, ids[i]), sizes[i], 1000 + (uint64_t)i);
    ast_store_close(s);
    assert_int_equal(count_files(dir, NULL), 0);
    rm_rf(dir);
}

static void test_nvme_alloc_and_free(void **state)
{
    char dir[512], path[512];
    ast_store *s;
    uint64_t a, b;
    size_t moved;
    (void)state;
    NEED_NVME();

    make_dir(dir, sizeof dir, "alloc");
    s = open_store(dir, AST_DIRECT_REQUIRE, 0, 0);
    assert_int_equal(ast_store_alloc(s, AST_TIER_NVME, 10000, &a), 0);
    assert_int_equal(ast_store_alloc(s, AST_TIER_NVME, 5, &b), 0);
    expect_acct(s, AST_TIER_NVME, 10005, 2);
    assert_null(ast_store_data(s, a));
    record_path(s, b, path, sizeof path);
    assert_int_equal(access(path, F_OK), 0);
    assert_int_equal(ast_store_free(s, b), 0);
    assert_int_equal(access(path, F_OK), -1); /* freeing an NVME block removes its record */
    expect_acct(s, AST_TIER_NVME, 10000, 1);
    assert_int_equal(ast_store_move(s, &a, 1, AST_TIER_HOST, &moved), 0);
    assert_true(all_zero(ast_store_data(s, a), 10000));
    expect_acct(s, AST_TIER_HOST, 10000, 1);
    expect_acct(s, AST_TIER_NVME, 0, 0);
    {
        char small[8];
        assert_int_equal(ast_store_move(s, &a, 1, AST_TIER_NVME, &moved), 0);
        assert_int_equal(ast_store_record_path(s, a, small, sizeof small), AST_EINVAL);
    }
    ast_store_close(s);
    assert_int_equal(count_files(dir, NULL), 0);
    rm_rf(dir);
}

/* Short completions and -EAGAIN are resubmitted (injected: the kernel rarely does either on a
 * local filesystem); the data must still round-trip. */
static void test_nvme_short_and_eagain(void **state)
{
    const unsigned faults[] = {AST__FAULT_SHORT_IO, AST__FAULT_EAGAIN,
                               AST__FAULT_SHORT_IO | AST__FAULT_EAGAIN};
    char dir[512];
    (void)state;
    NEED_NVME();

    make_dir(dir, sizeof dir, "short");
    for (size_t f = 0; f < sizeof faults / sizeof faults[0]; f++) {
        /* Default depth: 256 KiB slots, so the 1 MiB block still spans several chunks. */
        ast_store *s = open_store(dir, AST_DIRECT_REQUIRE, 0, 0);
        const size_t m = NEDGE - 1; /* all but the 3 MiB block */
        uint64_t ids[NEDGE];
        size_t moved;
        ast__nvme_inject_fault(ast__store_nvme(s), faults[f], 0);
        for (size_t i = 0; i < m; i++)
            ids[i] = alloc_random(s, AST_TIER_HOST, EDGE_SIZES[i], 7 * f + i);
        assert_int_equal(ast_store_move(s, ids, m, AST_TIER_NVME, &moved), 0);
        assert_int_equal(ast_store_move(s, ids, m, AST_TIER_HOST, &moved), 0);
        assert_int_equal(moved, m);
        for (size_t i = 0; i < m; i++)
            check_random(ast_store_data(s, ids[i]), EDGE_SIZES[i], 7 * f + i);
        ast_store_close(s);
    }
    rm_rf(dir);
}

/* ---- directory faults ---------------------------------------------------------------------- */

static void test_missing_dir(void **state)
{
    char dir[512], missing[600], err[512];
    ast_store *s;
    (void)state;
    NEED_NVME();

    make_dir(dir, sizeof dir, "missing");
    snprintf(missing, sizeof missing, "%s/does/not/exist", dir);
    assert_int_equal(open_rc(missing, AST_DIRECT_REQUIRE, 0, err, sizeof err, &s), AST_ENOENT);
    assert_null(s);
    assert_non_null(strstr(err, missing));
    /* A file where a directory should be. */
    snprintf(missing, sizeof missing, "%s/file", dir);
    close(open(missing, O_CREAT | O_WRONLY, 0600));
    assert_int_equal(open_rc(missing, AST_DIRECT_REQUIRE, 0, err, sizeof err, &s), AST_ENOENT);
    assert_non_null(strstr(err, "not a directory"));
    rm_rf(dir);
}

static void expect_readonly(const char *dir, unsigned faults)
{
    char err[512];
    ast_store *s;
    assert_int_equal(open_rc(dir, AST_DIRECT_REQUIRE, faults, err, sizeof err, &s), AST_EACCES);
    assert_null(s);
    assert_non_null(strstr(err, dir));
}

static void test_readonly_dir(void **state)
{
    char dir[512], ro[600];
    (void)state;
    NEED_NVME();

    make_dir(dir, sizeof dir, "ro");
    /* chmod: real for an unprivileged user; root (CAP_DAC_OVERRIDE) writes anyway. */
    assert_int_equal(chmod(dir, 0555), 0);
    if (geteuid() != 0)
        expect_readonly(dir, 0);
    else
        note("read-only dir: chmod 0555 not checked (running as root bypasses permissions)");
    assert_int_equal(chmod(dir, 0755), 0);

    /* A read-only bind mount: EROFS even for root. */
    snprintf(ro, sizeof ro, "%s/robind", dir);
    assert_int_equal(mkdir(ro, 0755), 0);
    if (g_can_mount && mount(dir, ro, NULL, MS_BIND, NULL) == 0) {
        assert_int_equal(mount(NULL, ro, NULL, MS_REMOUNT | MS_BIND | MS_RDONLY, NULL), 0);
        expect_readonly(ro, 0);
        umount2(ro, MNT_DETACH);
    } else {
        note("read-only dir: no read-only bind mount possible here; injected EROFS only");
    }

    /* Injected EROFS, at open and for a directory that turns read-only after open. */
    expect_readonly(dir, AST__FAULT_EROFS);
    {
        ast_store *s = open_store(dir, AST_DIRECT_REQUIRE, 0, 0);
        uint64_t id = alloc_random(s, AST_TIER_HOST, 5000, 77);
        size_t moved = 9;
        ast__nvme_inject_fault(ast__store_nvme(s), AST__FAULT_EROFS, 0);
        assert_int_equal(ast_store_move(s, &id, 1, AST_TIER_NVME, &moved), AST_EACCES);
        assert_int_equal(moved, 0);
        expect_tier(s, id, AST_TIER_HOST);
        check_random(ast_store_data(s, id), 5000, 77);
        expect_error_mentions(s, "block 1", dir);
        expect_acct(s, AST_TIER_HOST, 5000, 1);
        expect_acct(s, AST_TIER_NVME, 0, 0);
        ast__nvme_inject_fault(ast__store_nvme(s), 0, 0);
        assert_int_equal(ast_store_move(s, &id, 1, AST_TIER_NVME, &moved), 0);
        ast_store_close(s);
    }
    rm_rf(dir);
}

static void check_no_odirect(const char *dir, unsigned faults)
{
    char err[512];
    ast_store *s;
    ast_store_stats st;

    assert_int_equal(open_rc(dir, AST_DIRECT_REQUIRE, faults, err, sizeof err, &s), AST_ENOTSUP);
    assert_null(s);
    assert_non_null(strstr(err, "O_DIRECT"));
    assert_non_null(strstr(err, dir));
    assert_int_equal(open_rc(dir, AST_DIRECT_FALLBACK, faults, err, sizeof err, &s), 0);
    assert_int_equal(ast_store_stats_get(s, &st), 0);
    assert_int_equal(st.nvme_direct, 0);
    assert_int_equal(ast__nvme_direct(ast__store_nvme(s)), 0);
    ast_store_close(s);
    /* Buffered + fdatasync carries the same data. */
    roundtrip(dir, AST_DIRECT_FALLBACK, 0, faults, 0);
}

static void test_no_odirect(void **state)
{
    char dir[512], ram[600];
    (void)state;
    NEED_NVME();

    make_dir(dir, sizeof dir, "nodirect");
    snprintf(ram, sizeof ram, "%s/ramfs", dir);
    assert_int_equal(mkdir(ram, 0755), 0);
    if (mount_fs("ramfs", NULL, ram) == 0) {
        check_no_odirect(ram, 0); /* real: ramfs refuses O_DIRECT */
        umount2(ram, MNT_DETACH);
    } else {
        note("no-O_DIRECT: cannot mount ramfs here; injected probe result only");
    }
    check_no_odirect(dir, AST__FAULT_NO_ODIRECT);
    rm_rf(dir);
}

/* ENOSPC part way through a batch: the blocks that fit move, the others stay on HOST, intact. */
static void check_enospc(const char *dir, ast_store *s, size_t nblocks, size_t bsize,
                         size_t want_moved, int allow_none)
{
    uint64_t *ids = calloc(nblocks, sizeof *ids);
    size_t moved = 0, on_nvme = 0;
    ast_tier t;
    int rc;

    assert_non_null(ids);
    for (size_t i = 0; i < nblocks; i++)
        ids[i] = alloc_random(s, AST_TIER_HOST, bsize, 500 + i);
    rc = ast_store_move(s, ids, nblocks, AST_TIER_NVME, &moved);
    assert_int_equal(rc, AST_ENOSPC);
    if (want_moved != (size_t)-1)
        assert_int_equal(moved, want_moved);
    /* Where ENOSPC comes only from write completions, records written side by side share the
     * space and none may fit (allow_none). */
    assert_true(moved < nblocks && (moved >= 1 || allow_none));
    expect_error_mentions(s, "block", "space");
    for (size_t i = 0; i < nblocks; i++) {
        assert_int_equal(ast_store_tier(s, ids[i], &t), 0);
        if (t == AST_TIER_NVME) {
            on_nvme++;
        } else {
            assert_int_equal(t, AST_TIER_HOST);
            check_random(ast_store_data(s, ids[i]), bsize, 500 + i);
        }
    }
    assert_int_equal(on_nvme, moved);
    expect_acct(s, AST_TIER_NVME, moved * bsize, moved);
    expect_acct(s, AST_TIER_HOST, (nblocks - moved) * bsize, nblocks - moved);
    assert_int_equal(count_files(dir, ".tmp"), 0); /* no half-written record left behind */
    assert_int_equal(count_files(dir, ".rec"), (int)moved);
    assert_int_equal(ast_store_move(s, ids, nblocks, AST_TIER_HOST, &moved), 0);
    for (size_t i = 0; i < nblocks; i++)
        check_random(ast_store_data(s, ids[i]), bsize, 500 + i);
    for (size_t i = 0; i < nblocks; i++)
        assert_int_equal(ast_store_free(s, ids[i]), 0);
    free(ids);
}

static void test_enospc(void **state)
{
    char dir[512], small[600];
    ast_store *s;
    (void)state;
    NEED_NVME();

    make_dir(dir, sizeof dir, "enospc");
    snprintf(small, sizeof small, "%s/tmpfs", dir);
    assert_int_equal(mkdir(small, 0755), 0);
    if (mount_fs("tmpfs", "size=1m", small) == 0) {
        /* Real: a 1 MiB filesystem and 6 records of 300 KiB; fallocate refuses the 4th. */
        s = open_store(small, AST_DIRECT_REQUIRE, 0, 0);
        check_enospc(small, s, 6, 300 << 10, (size_t)-1, 0);
        /* Real, without the reservation: the kernel's write completions say -ENOSPC. */
        ast__nvme_inject_fault(ast__store_nvme(s), AST__FAULT_NO_FALLOCATE, 0);
        check_enospc(small, s, 6, 300 << 10, (size_t)-1, 1);
        ast_store_close(s);
        umount2(small, MNT_DETACH);
    } else {
        note("ENOSPC: cannot mount a small tmpfs here; injected ENOSPC and budget only");
    }
    /* Injected -ENOSPC completions after 3 records. */
    s = open_store(dir, AST_DIRECT_REQUIRE, 0, 0);
    ast__nvme_inject_fault(ast__store_nvme(s), AST__FAULT_ENOSPC, 3);
    check_enospc(dir, s, 8, 20000, 3, 0);
    ast_store_close(s);
    /* The store's own budget: 2.5 blocks' worth. */
    s = open_store(dir, AST_DIRECT_REQUIRE, 0, 50000);
    check_enospc(dir, s, 5, 20000, 2, 0);
    ast_store_close(s);
    rm_rf(dir);
}

/* ---- record faults ------------------------------------------------------------------------- */

/* A failed load leaves the block on NVME with its record untouched; fixing the file (where the
 * test can) makes the load succeed with the original data. */
static void expect_load_fails(ast_store *s, uint64_t id, int code, const char *path,
                              const char *cause)
{
    size_t moved = 9;
    char idstr[32];
    assert_int_equal(ast_store_move(s, &id, 1, AST_TIER_HOST, &moved), code);
    assert_int_equal(moved, 0);
    expect_tier(s, id, AST_TIER_NVME);
    assert_null(ast_store_data(s, id));
    assert_int_equal(access(path, F_OK), 0);
    snprintf(idstr, sizeof idstr, "block %" PRIu64, id);
    expect_error_mentions(s, idstr, path);
    expect_error_mentions(s, cause, NULL);
}

/* A store in a new directory dir (named for what) holding one block of n random bytes (seed)
 * moved to NVME (direct I/O required); *id receives the block, path its record's path. */
static ast_store *store_with_record(char *dir, size_t dlen, const char *what, size_t n,
                                    uint64_t seed, uint64_t *id, char *path, size_t plen)
{
    size_t moved;
    make_dir(dir, dlen, what);
    ast_store *s = open_store(dir, AST_DIRECT_REQUIRE, 0, 0);
    *id = alloc_random(s, AST_TIER_HOST, n, seed);
    assert_int_equal(ast_store_move(s, id, 1, AST_TIER_NVME, &moved), 0);
    record_path(s, *id, path, plen);
    return s;
}

static void test_corrupt_record(void **state)
{
    const size_t n = 10000;
    /* payload, header field (store id), header crc, trailer crc, padding */
    const off_t where[] = {64 + 5000, 9, 61, 64 + 10000 + 1, 12000};
    const char *cause[] = {"checksum", "header", "header", "checksum", "padding"};
    char dir[512], path[512];
    ast_store *s;
    uint64_t id;
    size_t moved;
    (void)state;
    NEED_NVME();

    s = store_with_record(dir, sizeof dir, "corrupt", n, 4242, &id, path, sizeof path);
    for (size_t i = 0; i < sizeof where / sizeof where[0]; i++) {
        flip_byte(path, where[i]);
        expect_load_fails(s, id, AST_ECORRUPT, path, cause[i]);
        expect_acct(s, AST_TIER_NVME, n, 1);
        flip_byte(path, where[i]); /* undo: the record was left as it was */
    }
    assert_int_equal(ast_store_move(s, &id, 1, AST_TIER_HOST, &moved), 0);
    check_random(ast_store_data(s, id), n, 4242);
    ast_store_close(s);
    rm_rf(dir);
}

static void test_truncated_record(void **state)
{
    const size_t n = 3 * 4096 + 100; /* a 4-block record */
    const off_t cut[] = {4 * 4096 - 1, 3 * 4096, 4096, 100, 0};
    char dir[512], path[512], save[600];
    ast_store *s;
    uint64_t id;
    size_t moved;
    (void)state;
    NEED_NVME();

    s = store_with_record(dir, sizeof dir, "trunc", n, 31, &id, path, sizeof path);
    snprintf(save, sizeof save, "%s/saved", dir);
    close(open(save, O_CREAT | O_WRONLY, 0600));
    copy_file(path, save);
    for (size_t i = 0; i < sizeof cut / sizeof cut[0]; i++) {
        assert_int_equal(truncate(path, cut[i]), 0);
        expect_load_fails(s, id, AST_ECORRUPT, path, "truncated");
        copy_file(save, path);
    }
    /* Longer than the record is damage too. */
    assert_int_equal(truncate(path, 5 * 4096), 0);
    expect_load_fails(s, id, AST_ECORRUPT, path, "oversized");
    copy_file(save, path);
    assert_int_equal(truncate(path, 4 * 4096), 0);
    /* And a missing file. */
    assert_int_equal(rename(path, save), 0);
    assert_int_equal(ast_store_move(s, &id, 1, AST_TIER_HOST, &moved), AST_ENOENT);
    expect_tier(s, id, AST_TIER_NVME);
    assert_int_equal(rename(save, path), 0);
    assert_int_equal(ast_store_move(s, &id, 1, AST_TIER_HOST, &moved), 0);
    check_random(ast_store_data(s, id), n, 31);
    ast_store_close(s);
    rm_rf(dir);
}

static void test_foreign_record(void **state)
{
    char dir[512], pa[512], pb[512], pc[512], po[512], save[600];
    ast_store *s, *other;
    uint64_t ids[3], oid;
    size_t moved;
    (void)state;
    NEED_NVME();

    make_dir(dir, sizeof dir, "foreign");
    s = open_store(dir, AST_DIRECT_REQUIRE, 0, 0);
    other = open_store(dir, AST_DIRECT_REQUIRE, 0, 0);
    ids[0] = alloc_random(s, AST_TIER_HOST, 6000, 1);
    ids[1] = alloc_random(s, AST_TIER_HOST, 6000, 2);
    ids[2] = alloc_random(s, AST_TIER_HOST, 60000, 3);
    oid = alloc_random(other, AST_TIER_HOST, 6000, 4);
    assert_int_equal(ast_store_move(s, ids, 3, AST_TIER_NVME, &moved), 0);
    assert_int_equal(ast_store_move(other, &oid, 1, AST_TIER_NVME, &moved), 0);
    record_path(s, ids[0], pa, sizeof pa);
    record_path(s, ids[1], pb, sizeof pb);
    record_path(s, ids[2], pc, sizeof pc);
    record_path(other, oid, po, sizeof po);
    snprintf(save, sizeof save, "%s/saved", dir);
    close(open(save, O_CREAT | O_WRONLY, 0600));
    copy_file(pb, save);

    copy_file(pa, pb); /* another block's record, same size */
    expect_load_fails(s, ids[1], AST_EFOREIGN, pb, "holds block");
    copy_file(pc, pb); /* another block's record, another size: foreign before truncated */
    expect_load_fails(s, ids[1], AST_EFOREIGN, pb, "holds block");
    copy_file(po, pb); /* another store's record */
    expect_load_fails(s, ids[1], AST_EFOREIGN, pb, "belongs to store");

    /* A stale record of the same block: an older generation. */
    copy_file(save, pb);
    assert_int_equal(ast_store_move(s, &ids[1], 1, AST_TIER_HOST, &moved), 0);
    assert_int_equal(ast_store_move(s, &ids[1], 1, AST_TIER_NVME, &moved), 0);
    copy_file(save, pb);
    expect_load_fails(s, ids[1], AST_EFOREIGN, pb, "stale");

    /* The others still load; batch with one bad record: the rest move, the first error wins. */
    assert_int_equal(ast_store_move(s, ids, 3, AST_TIER_HOST, &moved), AST_EFOREIGN);
    assert_int_equal(moved, 2);
    expect_tier(s, ids[1], AST_TIER_NVME);
    check_random(ast_store_data(s, ids[0]), 6000, 1);
    check_random(ast_store_data(s, ids[2]), 60000, 3);
    expect_acct(s, AST_TIER_NVME, 6000, 1);
    expect_acct(s, AST_TIER_HOST, 66000, 2);

    ast_store_close(other);
    assert_int_equal(access(po, F_OK), -1);
    assert_int_equal(access(pb, F_OK), 0); /* the other store removed only its own files */
    ast_store_close(s);
    assert_int_equal(count_files(dir, NULL), 0);
    rm_rf(dir);
}

/* ---- formats ------------------------------------------------------------------------------- */

static void expect_format(ast_store *s, uint64_t id, ast_qtype t, uint32_t block)
{
    ast_qtype got = (ast_qtype)99;
    uint32_t gb = 99;
    assert_int_equal(ast_store_format(s, id, &got, &gb), 0);
    assert_int_equal(got, t);
    assert_int_equal(gb, block);
}

/* The record's header bytes 40 (payload type) and 44..47 (block size, little-endian). */
static void expect_record_format(const char *path, unsigned t, uint32_t block)
{
    unsigned char h[64];
    int fd = open(path, O_RDONLY);
    assert_true(fd >= 0);
    assert_int_equal(pread(fd, h, sizeof h, 0), (ssize_t)sizeof h);
    close(fd);
    assert_int_equal(h[40], t);
    assert_int_equal((uint32_t)h[44] | (uint32_t)h[45] << 8 | (uint32_t)h[46] << 16 |
                         (uint32_t)h[47] << 24,
                     block);
}

static void test_formats(void **state)
{
    char dir[512], path[3][512];
    const size_t n = 4096 + 4 * 64; /* an int8 form of 4096 values in blocks of 64 */
    ast_store *s;
    uint64_t ids[3];
    size_t moved;
    (void)state;

    /* Host blocks: raw by default; bad formats are refused naming the block and the cause. */
    s = open_store(NULL, AST_DIRECT_REQUIRE, 0, 0);
    ids[0] = alloc_random(s, AST_TIER_HOST, n, 7);
    expect_format(s, ids[0], AST_QTYPE_NONE, 0);
    assert_int_equal(ast_store_set_format(s, ids[0], AST_QTYPE_NONE, 64), AST_EINVAL);
    expect_error_mentions(s, "block size 0", NULL);
    assert_int_equal(ast_store_set_format(s, ids[0], AST_QTYPE_INT8, 63), AST_EINVAL);
    expect_error_mentions(s, "int8 in blocks of 63", NULL);
    assert_int_equal(ast_store_set_format(s, ids[0], AST_QTYPE_INT4, 0), AST_EINVAL);
    assert_int_equal(ast_store_set_format(s, ids[0], (ast_qtype)9, 64), AST_EINVAL);
    expect_error_mentions(s, "unknown payload type 9", NULL);
    assert_int_equal(ast_store_set_format(s, ids[0] + 100, AST_QTYPE_INT8, 64), AST_ENOENT);
    assert_int_equal(ast_store_set_format(NULL, ids[0], AST_QTYPE_INT8, 64), AST_EINVAL);
    assert_int_equal(ast_store_format(s, ids[0], NULL, NULL), AST_EINVAL);
    expect_format(s, ids[0], AST_QTYPE_NONE, 0); /* failures changed nothing */
    assert_int_equal(ast_store_set_format(s, ids[0], AST_QTYPE_INT4, 128), 0);
    expect_format(s, ids[0], AST_QTYPE_INT4, 128);
    ast_store_close(s);

    NEED_NVME();
    make_dir(dir, sizeof dir, "formats");
    s = open_store(dir, AST_DIRECT_REQUIRE, 0, 0);
    ids[0] = alloc_random(s, AST_TIER_HOST, n, 1);
    ids[1] = alloc_random(s, AST_TIER_HOST, n, 2);
    ids[2] = alloc_random(s, AST_TIER_HOST, n, 3);
    assert_int_equal(ast_store_set_format(s, ids[0], AST_QTYPE_INT8, 64), 0);
    assert_int_equal(ast_store_set_format(s, ids[1], AST_QTYPE_INT4, 64), 0);
    assert_int_equal(ast_store_move(s, ids, 3, AST_TIER_NVME, &moved), 0);
    for (int i = 0; i < 3; i++)
        record_path(s, ids[i], path[i], sizeof path[i]);
    expect_record_format(path[0], AST_QTYPE_INT8, 64);
    expect_record_format(path[1], AST_QTYPE_INT4, 64);
    expect_record_format(path[2], AST_QTYPE_NONE, 0);
    /* On NVMe the format is the record's: the same one is fine, another is refused. */
    assert_int_equal(ast_store_set_format(s, ids[0], AST_QTYPE_INT8, 64), 0);
    assert_int_equal(ast_store_set_format(s, ids[0], AST_QTYPE_INT4, 64), AST_ESTATE);
    expect_error_mentions(s, "is on nvme", NULL);
    expect_format(s, ids[0], AST_QTYPE_INT8, 64);

    /* A record of another format, intact (the engine wrote it, checksums and all), under the
     * block's name and generation: refused naming both formats and the file; the block and
     * its accounting stay as they were. */
    {
        unsigned char *bytes = malloc(n);
        ast__nvme_io io = {.block_id = ids[0], .generation = 1, .data = bytes, .len = n,
                           .in_place = 1, .fd = -1, .qtype = AST_QTYPE_INT4, .qblock = 64};
        char err[256];
        assert_non_null(bytes);
        fill_random(bytes, n, 1);
        assert_int_equal(ast__nvme_write(ast__store_nvme(s), &io, 1, NULL, err, sizeof err), 0);
        expect_record_format(path[0], AST_QTYPE_INT4, 64);
        expect_load_fails(s, ids[0], AST_EFOREIGN, path[0],
                          "record holds int4 in blocks of 64, expected int8 in blocks of 64");
        expect_acct(s, AST_TIER_NVME, 3 * n, 3);
        io.qtype = AST_QTYPE_INT8; /* the same bytes in the block's format: loads */
        assert_int_equal(ast__nvme_write(ast__store_nvme(s), &io, 1, NULL, err, sizeof err), 0);
        free(bytes);
    }
    /* A damaged type byte fails the header's own checksum: damage, not a foreign record. */
    flip_byte(path[1], 40);
    expect_load_fails(s, ids[1], AST_ECORRUPT, path[1], "header");
    flip_byte(path[1], 40);

    assert_int_equal(ast_store_move(s, ids, 3, AST_TIER_HOST, &moved), 0);
    for (int i = 0; i < 3; i++)
        check_random(ast_store_data(s, ids[i]), n, (uint64_t)i + 1);
    expect_format(s, ids[1], AST_QTYPE_INT4, 64); /* kept across moves */
    /* Back on the host the format may change; the next record carries the new one. */
    assert_int_equal(ast_store_set_format(s, ids[1], AST_QTYPE_NONE, 0), 0);
    assert_int_equal(ast_store_move(s, &ids[1], 1, AST_TIER_NVME, &moved), 0);
    expect_record_format(path[1], AST_QTYPE_NONE, 0);
    assert_int_equal(ast_store_move(s, &ids[1], 1, AST_TIER_HOST, &moved), 0);
    check_random(ast_store_data(s, ids[1]), n, 2);
    ast_store_close(s);
    assert_int_equal(count_files(dir, NULL), 0);
    rm_rf(dir);
}

/* ---- threads ------------------------------------------------------------------------------- */

struct worker {
    ast_store *s;
    unsigned seed;
};

static void *worker_main(void *arg)
{
    struct worker *w = arg;
    for (unsigned it = 0; it < 12; it++) {
        uint64_t ids[4];
        size_t moved;
        ast_store_stats st;
        for (unsigned j = 0; j < 4; j++) {
            size_t n = 1 + (w->seed * 131 + it * 17 + j * 1009) % 9000;
            if (ast_store_alloc(w->s, AST_TIER_HOST, n, &ids[j]) != 0)
                return (void *)1;
            fill_random(ast_store_data(w->s, ids[j]), n, w->seed * 1000 + it * 4 + j);
        }
        if (ast_store_move(w->s, ids, 4, AST_TIER_NVME, &moved) != 0 || moved != 4)
            return (void *)2;
        ast_store_stats_get(w->s, &st);
        if (ast_store_move(w->s, ids, 4, AST_TIER_HOST, &moved) != 0 || moved != 4)
            return (void *)3;
        for (unsigned j = 0; j < 4; j++) {
            size_t n = 1 + (w->seed * 131 + it * 17 + j * 1009) % 9000;
            unsigned char *want = malloc(n);
            int same;
            fill_random(want, n, w->seed * 1000 + it * 4 + j);
            same = memcmp(ast_store_data(w->s, ids[j]), want, n) == 0;
            free(want);
            if (!same || ast_store_free(w->s, ids[j]) != 0)
                return (void *)4;
        }
    }
    return NULL;
}

static void test_threads(void **state)
{
    enum { T = 4 };
    char dir[512];
    pthread_t th[T];
    struct worker w[T];
    ast_store *s;
    (void)state;
    NEED_NVME();

    make_dir(dir, sizeof dir, "threads");
    s = open_store(dir, AST_DIRECT_REQUIRE, 8, 0);
    for (unsigned i = 0; i < T; i++) {
        w[i].s = s;
        w[i].seed = i + 1;
        assert_int_equal(pthread_create(&th[i], NULL, worker_main, &w[i]), 0);
    }
    for (unsigned i = 0; i < T; i++) {
        void *r;
        pthread_join(th[i], &r);
        assert_null(r);
    }
    expect_acct(s, AST_TIER_HOST, 0, 0);
    expect_acct(s, AST_TIER_NVME, 0, 0);
    ast_store_close(s);
    assert_int_equal(count_files(dir, NULL), 0);
    rm_rf(dir);
}

/* ---- fork ----------------------------------------------------------------------------------- */

enum { FK_N = 12, FK_SIZE = 20000, FK_ROUNDS = 8 };

static uint64_t fk_seed(int who, int round, int i)
{
    return (uint64_t)who * 1000000u + (uint64_t)round * 1000u + (uint64_t)i + 1;
}

static void fk_fill(ast_store *s, const uint64_t *ids, uint64_t (*seeds)[FK_N], int who, int round)
{
    for (int i = 0; i < FK_N; i++) {
        (*seeds)[i] = fk_seed(who, round, i);
        fill_random(ast_store_data(s, ids[i]), FK_SIZE, (*seeds)[i]);
    }
}

static int fk_same(ast_store *s, const uint64_t *ids, const uint64_t *seeds)
{
    unsigned char *want = malloc(FK_SIZE);
    int ok = want != NULL;
    for (int i = 0; ok && i < FK_N; i++) {
        const void *p = ast_store_data(s, ids[i]);
        fill_random(want, FK_SIZE, seeds[i]);
        ok = p && memcmp(p, want, FK_SIZE) == 0;
    }
    free(want);
    return ok;
}

/* Every block to NVME and back, FK_ROUNDS times, new values each round: 0, or the round that
 * failed (1-based). Parent and child run it at the same time. */
static int fk_churn(ast_store *s, const uint64_t *ids, uint64_t (*seeds)[FK_N], int who)
{
    size_t moved;
    for (int r = 0; r < FK_ROUNDS; r++) {
        fk_fill(s, ids, seeds, who, 10 + r);
        if (ast_store_move(s, ids, FK_N, AST_TIER_NVME, &moved) || moved != FK_N ||
            ast_store_move(s, ids, FK_N, AST_TIER_HOST, &moved) || moved != FK_N ||
            !fk_same(s, ids, *seeds))
            return r + 1;
    }
    return 0;
}

static void fk_send(int fd)
{
    char c = 1;
    assert_true(write(fd, &c, 1) == 1);
}

static int fk_recv(int fd)
{
    char c;
    return read(fd, &c, 1) == 1 ? 0 : -1;
}

/* The child of test_fork; its exit status names the first check that failed. */
static int fk_child(ast_store *s, const uint64_t *ids, const uint64_t *at_fork, int to_parent,
                    int from_parent)
{
    uint64_t seeds[FK_N], id = 0;
    char path[512];
    size_t moved;
    int rc;

    if (fk_recv(from_parent)) /* the parent has replaced (and unlinked) the records by now */
        return 20;
    /* The blocks have the values they had at the fork: the even ones come from records the
     * parent has removed since, through the descriptors the fork handler opened. */
    if (ast_store_move(s, ids, FK_N, AST_TIER_HOST, &moved) || moved != FK_N)
        return 21;
    if (!fk_same(s, ids, at_fork))
        return 22;
    /* The child's own records: with the parent's ring this I/O would take the parent's
     * completions (or the parent ours). */
    if ((rc = fk_churn(s, ids, &seeds, 2)) != 0)
        return 30 + rc;
    if (ast_store_alloc(s, AST_TIER_NVME, 5000, &id) ||
        ast_store_move(s, ids, FK_N, AST_TIER_NVME, &moved) || moved != FK_N)
        return 40;
    /* A child's record has no name the parent could see. */
    if (ast_store_record_path(s, ids[0], path, sizeof path) != AST_ESTATE)
        return 41;
    fk_send(to_parent); /* the child has written */
    if (ast_store_move(s, ids, FK_N, AST_TIER_HOST, &moved) || moved != FK_N ||
        !fk_same(s, ids, seeds))
        return 42;
    if ((rc = fk_churn(s, ids, &seeds, 3)) != 0)
        return 50 + rc;
    if (ast_store_move(s, ids, FK_N, AST_TIER_NVME, &moved) || moved != FK_N)
        return 60;
    ast_store_close(s); /* must not remove the parent's records */
    return 0;
}

/* fork() with the NVMe tier: the parent writes after a child wrote, the child exits (once
 * through ast_store_close, once through _exit with its blocks on NVME), and the parent reads
 * everything back. Both processes do I/O at the same time, so the child's ring must be its
 * own; the child's reads see the values of the fork even though the parent replaced those
 * records meanwhile; no file of the child is left behind. */
static void test_fork(void **state)
{
    char dir[512];
    uint64_t ids[FK_N], at_fork[FK_N], seeds[FK_N], even[FK_N / 2];
    int to_parent[2], from_parent[2], wst;
    size_t moved;
    ast_store *s;
    pid_t pid;
    (void)state;
    NEED_NVME();

    make_dir(dir, sizeof dir, "fork");
    s = open_store(dir, AST_DIRECT_FALLBACK, 4, 0);
    for (int i = 0; i < FK_N; i++)
        ids[i] = alloc_random(s, AST_TIER_HOST, FK_SIZE, 0);
    fk_fill(s, ids, &seeds, 1, 0);
    memcpy(at_fork, seeds, sizeof seeds);
    for (int i = 0; i < FK_N / 2; i++)
        even[i] = ids[2 * i];
    assert_int_equal(ast_store_move(s, even, FK_N / 2, AST_TIER_NVME, &moved), 0);
    assert_int_equal(count_files(dir, ".rec"), FK_N / 2);

    assert_int_equal(pipe(to_parent), 0);
    assert_int_equal(pipe(from_parent), 0);
    fflush(NULL);
    pid = fork();
    assert_true(pid >= 0);
    if (pid == 0) {
        close(to_parent[0]);
        close(from_parent[1]);
        _exit(fk_child(s, ids, at_fork, to_parent[1], from_parent[0]));
    }
    close(to_parent[1]);
    close(from_parent[0]);

    /* Replace the records the child inherited: read back (the old record is unlinked), new
     * values, written again under the same names. */
    assert_int_equal(ast_store_move(s, ids, FK_N, AST_TIER_HOST, &moved), 0);
    assert_true(fk_same(s, ids, at_fork));
    fk_fill(s, ids, &seeds, 1, 1);
    assert_int_equal(ast_store_move(s, even, FK_N / 2, AST_TIER_NVME, &moved), 0);
    fk_send(from_parent[1]);
    assert_int_equal(fk_recv(to_parent[0]), 0); /* the child has written */
    /* The parent writes after the child wrote, while the child goes on with its I/O. */
    assert_int_equal(ast_store_move(s, ids, FK_N, AST_TIER_HOST, &moved), 0);
    assert_true(fk_same(s, ids, seeds));
    assert_int_equal(fk_churn(s, ids, &seeds, 1), 0);
    assert_int_equal(ast_store_move(s, ids, FK_N, AST_TIER_NVME, &moved), 0);
    assert_int_equal(moved, FK_N);

    assert_int_equal(waitpid(pid, &wst, 0), pid);
    assert_true(WIFEXITED(wst));
    if (WEXITSTATUS(wst) != 0)
        fail_msg("fork child failed its check %d", WEXITSTATUS(wst));
    close(to_parent[0]);
    close(from_parent[1]);
    /* The child closed its store: the parent's records are all there, and nothing else. */
    assert_int_equal(count_files(dir, NULL), FK_N);
    assert_int_equal(ast_store_move(s, ids, FK_N, AST_TIER_HOST, &moved), 0);
    assert_int_equal(moved, FK_N);
    assert_true(fk_same(s, ids, seeds));

    /* A child that ends with _exit, its blocks on NVME and its store open, leaves no file (the
     * parent's are its even blocks' records and the odd blocks' stale ones). */
    assert_int_equal(ast_store_move(s, even, FK_N / 2, AST_TIER_NVME, &moved), 0);
    assert_int_equal(count_files(dir, NULL), FK_N);
    fflush(NULL);
    pid = fork();
    assert_true(pid >= 0);
    if (pid == 0) {
        uint64_t mine[FK_N];
        int bad = ast_store_move(s, ids, FK_N, AST_TIER_HOST, &moved) != 0 ||
                  !fk_same(s, ids, seeds) || fk_churn(s, ids, &mine, 4) != 0 ||
                  ast_store_move(s, ids, FK_N, AST_TIER_NVME, &moved) != 0;
        _exit(bad ? 70 : 0);
    }
    assert_int_equal(waitpid(pid, &wst, 0), pid);
    assert_true(WIFEXITED(wst));
    assert_int_equal(WEXITSTATUS(wst), 0);
    assert_int_equal(count_files(dir, NULL), FK_N);
    assert_int_equal(ast_store_move(s, ids, FK_N, AST_TIER_HOST, &moved), 0);
    assert_true(fk_same(s, ids, seeds));
    assert_int_equal(fk_churn(s, ids, &seeds, 1), 0);
    ast_store_close(s);
    assert_int_equal(count_files(dir, NULL), 0);
    rm_rf(dir);
}

static int group_setup(void **state)
{
    (void)state;
    /* A private mount namespace: test mounts cannot leak to the host or outlive the process. */
    if (unshare(CLONE_NEWNS) == 0 && mount(NULL, "/", NULL, MS_REC | MS_PRIVATE, NULL) == 0)
        g_can_mount = 1;
    else
        note("no private mount namespace (%s): real mount-based fault cases are skipped",
             strerror(errno));
    return 0;
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_tier_names),
        cmocka_unit_test(test_tier_listing_order),
        cmocka_unit_test(test_host_tier),
        cmocka_unit_test(test_block_table),
        cmocka_unit_test(test_cuda_tiers_absent),
        cmocka_unit_test(test_no_uring_refuses_nvme),
        cmocka_unit_test(test_nvme_roundtrip),
        cmocka_unit_test(test_nvme_batched),
        cmocka_unit_test(test_nvme_alloc_and_free),
        cmocka_unit_test(test_nvme_short_and_eagain),
        cmocka_unit_test(test_missing_dir),
        cmocka_unit_test(test_readonly_dir),
        cmocka_unit_test(test_no_odirect),
        cmocka_unit_test(test_enospc),
        cmocka_unit_test(test_corrupt_record),
        cmocka_unit_test(test_truncated_record),
        cmocka_unit_test(test_foreign_record),
        cmocka_unit_test(test_formats),
        cmocka_unit_test(test_threads),
        cmocka_unit_test(test_fork),
    };
    return cmocka_run_group_tests(tests, group_setup, NULL);
}
