/* test_runtime.c - runtime: config handling, buffer registration, REFRESH jobs end to end
 * (soap_rotate's and gram_ema's submit validation and runs through the pool too), the op table
 * (ast_op_name, the wording of its submit checks), a failing block's own status on every
 * failure (no failure streak), barrier stats, shutdown with jobs pending, the runtime's trace,
 * waits that check between slices (ast_runtime_wait_check), the test-only job stretch. */
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <setjmp.h>
#include <cmocka.h>

#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "asteria/errors.h"
#include "asteria/runtime.h"

#include "ref_gram_ema.h"
#include "ref_rotate.h"
#include "test_helpers.h"
#include "testing.h"

static ast_runtime *make_rt(int workers)
{
    ast_config c;
    ast_config_init(&c);
    c.workers = workers;
    snprintf(c.cpuset, sizeof c.cpuset, "0");
    c.pin = 0;
    ast_runtime *rt = NULL;
    char err[256];
    assert_int_equal(ast_runtime_create(&c, &rt, err, sizeof err), 0);
    assert_non_null(rt);
    return rt;
}

/* Symmetric positive definite n x n: B B^T + n I, deterministic. */
static void spd(double *a, int n, unsigned seed)
{
    double *b = malloc(sizeof(double) * n * n);
    srand(seed);
    for (int i = 0; i < n * n; i++)
        b[i] = (double)rand() / RAND_MAX - 0.5;
    for (int i = 0; i < n; i++)
        for (int j = 0; j < n; j++) {
            double s = 0;
            for (int k = 0; k < n; k++)
                s += b[i * n + k] * b[j * n + k];
            a[i * n + j] = s + (i == j ? n : 0);
        }
    free(b);
}

static void test_create_rejects_bad_config(void **state)
{
    (void)state;
    ast_config c;
    ast_config_init(&c);
    c.workers = -1;
    ast_runtime *rt = (ast_runtime *)0x1;
    char err[256] = "";
    assert_int_equal(ast_runtime_create(&c, &rt, err, sizeof err), AST_EINVAL);
    assert_null(rt);
    assert_non_null(strstr(err, "workers"));
    /* errbuf may be NULL; a NULL out is refused, with a message when there is a buffer */
    assert_int_equal(ast_runtime_create(&c, &rt, NULL, 0), AST_EINVAL);
    assert_int_equal(ast_runtime_create(NULL, NULL, NULL, 0), AST_EINVAL);
    assert_int_equal(ast_runtime_create(NULL, NULL, err, sizeof err), AST_EINVAL);
    assert_non_null(strstr(err, "out is NULL"));
}

static void test_eigh_job_end_to_end(void **state)
{
    (void)state;
    ast_runtime *rt = make_rt(1);
    const int n = 24, batch = 3;
    double *f = malloc(sizeof(double) * batch * n * n);
    double *q = calloc((size_t)batch * n * n, sizeof(double));
    double *w = calloc((size_t)batch * n, sizeof(double));
    for (int b = 0; b < batch; b++)
        spd(f + b * n * n, n, 10 + b);
    uint64_t hf, hq, hw;
    assert_int_equal(ast_runtime_register(rt, f, sizeof(double) * batch * n * n, &hf), 0);
    assert_int_equal(ast_runtime_register(rt, q, sizeof(double) * batch * n * n, &hq), 0);
    assert_int_equal(ast_runtime_register(rt, w, sizeof(double) * batch * n, &hw), 0);
    ast_refresh r = {.op = AST_OP_EIGH, .dtype = AST_F64, .n = n, .batch = batch, .in0 = f,
                     .out0 = q, .out1 = w, .block = 7, .version = 1, .deadline = 5,
                     .snapshot_step = 3};
    uint64_t t;
    assert_int_equal(ast_runtime_submit(rt, &r, &t), 0);
    /* In use: cannot be unregistered. */
    ast_result res;
    int urc = ast_runtime_unregister(rt, hq);
    assert_true(urc == AST_EBUSY || urc == 0);
    if (urc == 0)
        fail_msg("buffer unregistered while its job's completion was not yet drained");
    assert_int_equal(ast_runtime_wait(rt, t, -1, &res), 0);
    assert_int_equal(res.status, 0);
    assert_int_equal(res.block, 7);
    assert_int_equal(res.version, 1);
    assert_int_equal(res.snapshot_step, 3);
    for (int b = 0; b < batch; b++) {
        const double *A = f + b * n * n, *Q = q + b * n * n, *W = w + b * n;
        for (int j = 1; j < n; j++)
            assert_true(W[j - 1] >= W[j]);
        for (int i = 0; i < n; i++)
            for (int j = 0; j < n; j++) { /* (A Q)_ij == Q_ij w_j */
                double s = 0;
                for (int k = 0; k < n; k++)
                    s += A[i * n + k] * Q[k * n + j];
                assert_true(fabs(s - Q[i * n + j] * W[j]) < 1e-9 * W[0]);
            }
    }
    assert_int_equal(ast_runtime_unregister(rt, hq), 0);
    assert_int_equal(ast_runtime_unregister(rt, hq), AST_ENOENT);
    ast_stats st;
    assert_int_equal(ast_runtime_stats_get(rt, &st), 0);
    assert_int_equal(st.jobs_submitted, 1);
    assert_int_equal(st.jobs_done, 1);
    assert_int_equal(st.jobs_failed, 0);
    assert_int_equal(st.workers, 1);
    ast_runtime_destroy(rt, NULL, 0);
    free(f);
    free(q);
    free(w);
}

static void test_unregistered_pointer_is_erange(void **state)
{
    (void)state;
    ast_runtime *rt = make_rt(1);
    double f[16], q[16], w[4];
    uint64_t h, t;
    assert_int_equal(ast_runtime_register(rt, f, sizeof f, &h), 0);
    ast_refresh r = {.op = AST_OP_EIGH, .dtype = AST_F64, .n = 4, .batch = 1, .in0 = f,
                     .out0 = q, .out1 = w, .block = 1, .version = 1};
    assert_int_equal(ast_runtime_submit(rt, &r, &t), AST_ERANGE);
    char msg[512];
    ast_runtime_last_error(rt, msg, sizeof msg);
    assert_non_null(strstr(msg, "out0"));
    /* A range that runs past the end of a registered buffer is refused too. */
    r.out0 = f + 8;
    assert_int_equal(ast_runtime_submit(rt, &r, &t), AST_ERANGE);
    r.op = (ast_op)99;
    assert_int_equal(ast_runtime_submit(rt, &r, &t), AST_EINVAL);
    ast_runtime_destroy(rt, NULL, 0);
}

/* The runtime keeps no failure streak (the optimizer's schedule counts consecutive failures,
 * docs/departures.md): a block that fails again and again reports its own status every time,
 * never AST_EFAILED, and keeps its previous result; a success after them is a plain success. */
static void test_repeated_failure_keeps_own_status(void **state)
{
    (void)state;
    ast_runtime *rt = make_rt(1);
    const int n = 4, fails = 5;
    double f[16], x[16];
    for (int i = 0; i < 16; i++) {
        f[i] = (i % 5 == 0) ? 1.0 : 0.0;
        x[i] = 42.0;
    }
    f[5] = NAN;
    uint64_t h1, h2, t;
    ast_runtime_register(rt, f, sizeof f, &h1);
    ast_runtime_register(rt, x, sizeof x, &h2);
    ast_refresh r = {.op = AST_OP_INV_ROOT, .dtype = AST_F64, .n = n, .batch = 1, .in0 = f,
                     .out0 = x, .p = 4, .eps = 1e-6, .block = 3};
    ast_result res;
    for (int k = 1; k <= fails; k++) { /* more than the old C limit's default of 3 */
        r.version = (uint64_t)k;
        assert_int_equal(ast_runtime_submit(rt, &r, &t), 0);
        assert_int_equal(ast_runtime_wait(rt, t, -1, &res), 0);
        assert_int_equal(res.status, AST_ENONFINITE);
        assert_int_equal(res.block, 3);
        for (int i = 0; i < 16; i++)
            assert_true(x[i] == 42.0); /* previous result kept */
    }
    char msg[512] = "";
    ast_runtime_last_error(rt, msg, sizeof msg);
    assert_null(strstr(msg, "AST_EFAILED"));
    f[5] = 1.0;
    r.version = fails + 1;
    assert_int_equal(ast_runtime_submit(rt, &r, &t), 0);
    assert_int_equal(ast_runtime_wait(rt, t, -1, &res), 0);
    assert_int_equal(res.status, 0);
    assert_true(fabs(x[0] - pow(1.0 + 1e-6, -0.25)) < 1e-12);
    ast_stats st;
    ast_runtime_stats_get(rt, &st);
    assert_int_equal(st.jobs_failed, fails);
    assert_int_equal(st.jobs_done, fails + 1);
    ast_runtime_destroy(rt, NULL, 0);
}

static void test_install_and_nonfinite_stats(void **state)
{
    (void)state;
    ast_runtime *rt = make_rt(1);
    ast_runtime_note_install(rt, 10, 12);
    ast_runtime_note_install(rt, 20, 25);
    ast_runtime_note_install(rt, 30, 31);
    ast_runtime_note_nonfinite(rt);
    ast_stats st;
    ast_runtime_stats_get(rt, &st);
    assert_int_equal(st.installs, 3);
    assert_int_equal(st.max_install_lag, 5);
    assert_int_equal(st.last_installed_version_step, 31);
    assert_int_equal(st.nonfinite_skipped, 1);
    ast_runtime_destroy(rt, NULL, 0);
}

static void test_destroy_with_pending_jobs(void **state)
{
    (void)state;
    ast_runtime *rt = make_rt(1);
    const int n = 96, jobs = 12;
    double *f = malloc(sizeof(double) * n * n);
    double *q = malloc(sizeof(double) * jobs * n * n);
    spd(f, n, 1);
    uint64_t h, t;
    ast_runtime_register(rt, f, sizeof(double) * n * n, &h);
    ast_runtime_register(rt, q, sizeof(double) * jobs * n * n, &h);
    for (int i = 0; i < jobs; i++) {
        ast_refresh r = {.op = AST_OP_EIGH, .dtype = AST_F64, .n = n, .batch = 1, .in0 = f,
                         .out0 = q + (size_t)i * n * n, .block = (uint64_t)i + 1, .version = 1,
                         .deadline = i};
        assert_int_equal(ast_runtime_submit(rt, &r, &t), 0);
    }
    ast_runtime_destroy(rt, NULL, 0); /* must not leak job contexts (ASan build checks) nor hang */
    free(f);
    free(q);
}

/* ---- soap_rotate ------------------------------------------------------------------------- */

static void expect_submit_error(ast_runtime *rt, const ast_refresh *r, int code,
                                const char *needle1, const char *needle2)
{
    uint64_t t;
    assert_int_equal(ast_runtime_submit(rt, r, &t), code);
    char msg[512];
    ast_runtime_last_error(rt, msg, sizeof msg);
    if (!strstr(msg, needle1) || (needle2 && !strstr(msg, needle2)))
        fail_msg("message '%s' does not name '%s'%s%s", msg, needle1, needle2 ? " and " : "",
                 needle2 ? needle2 : "");
}

static void test_soap_rotate_submit_validation(void **state)
{
    (void)state;
    ast_runtime *rt = make_rt(1);
    enum { N = 4, N1 = 3, B = 2 };
    double x[B * N * N1], ap[B * 2 * N * N], bp[B * 2 * N1 * N1], out[B * N * N1], other[64];
    memset(x, 0, sizeof x);
    memset(ap, 0, sizeof ap);
    memset(bp, 0, sizeof bp);
    uint64_t h;
    assert_int_equal(ast_runtime_register(rt, x, sizeof x, &h), 0);
    assert_int_equal(ast_runtime_register(rt, ap, sizeof ap, &h), 0);
    assert_int_equal(ast_runtime_register(rt, bp, sizeof bp, &h), 0);
    assert_int_equal(ast_runtime_register(rt, out, sizeof out, &h), 0);
    ast_refresh r = {.op = AST_OP_SOAP_ROTATE, .dtype = AST_F64, .n = N, .n1 = 0, .batch = B,
                     .in0 = x, .in1 = ap, .in2 = bp, .out0 = out, .block = 1, .version = 1};
    expect_submit_error(rt, &r, AST_EINVAL, "n1=0", "n1 >= 1");
    r.n1 = -2;
    expect_submit_error(rt, &r, AST_EINVAL, "n1=-2", "n1 >= 1");
    r.n1 = N1;
    r.in1 = r.in2 = NULL;
    expect_submit_error(rt, &r, AST_EINVAL, "neither in1", "either or both");
    /* in2 outside any registered buffer, and running past the end of one. */
    r.in1 = ap;
    r.in2 = other;
    expect_submit_error(rt, &r, AST_ERANGE, "in2", "registered buffer");
    r.in2 = bp + 1;
    expect_submit_error(rt, &r, AST_ERANGE, "in2", NULL);
    /* X, the A pair and the output are sized by n x n1 and n x n: one element too far fails. */
    r.in2 = bp;
    r.in0 = x + 1;
    expect_submit_error(rt, &r, AST_ERANGE, "in0", NULL);
    r.in0 = x;
    r.in1 = ap + 1;
    expect_submit_error(rt, &r, AST_ERANGE, "in1", NULL);
    r.in1 = ap;
    r.out0 = out + 1;
    expect_submit_error(rt, &r, AST_ERANGE, "out0", NULL);
    r.out0 = out;
    r.out1 = out;
    expect_submit_error(rt, &r, AST_EINVAL, "out1 must be NULL", NULL);
    r.out1 = NULL;
    r.out0 = NULL;
    expect_submit_error(rt, &r, AST_EINVAL, "out0 is required", NULL);
    /* in2 given to another op. */
    ast_refresh k = {.op = AST_OP_KL_QR, .dtype = AST_F64, .n = 2, .batch = 1, .in0 = ap,
                     .in1 = ap + 4, .in2 = bp, .out0 = out, .block = 2, .version = 1};
    expect_submit_error(rt, &k, AST_EINVAL, "in2 must be NULL", "soap_rotate");
    /* An unknown op names soap_rotate among the allowed ones. */
    k.op = (ast_op)8;
    k.in2 = NULL;
    expect_submit_error(rt, &k, AST_EINVAL, "soap_rotate (6)", "gram_ema (7)");
    ast_stats st;
    assert_int_equal(ast_runtime_stats_get(rt, &st), 0);
    assert_int_equal(st.jobs_submitted, 0);
    ast_runtime_destroy(rt, NULL, 0);
}

/* ---- gram_ema -------------------------------------------------------------------------------- */

static void test_gram_ema_submit_validation(void **state)
{
    (void)state;
    ast_runtime *rt = make_rt(1);
    enum { N = 4, N1 = 3, B = 2, NG = B * N * N1, NL = B * N * N, NR = B * N1 * N1, GAP = 8 };
    /* One allocation with unregistered gaps, so that a range one element too long runs into a
     * gap (AST_ERANGE) rather than into the next buffer (an overlap). */
    double mem[NG + GAP + NL + GAP + NR + GAP], other[64];
    memset(mem, 0, sizeof mem);
    double *g = mem, *l = g + NG + GAP, *r = l + NL + GAP;
    uint64_t h;
    assert_int_equal(ast_runtime_register(rt, g, sizeof(double) * NG, &h), 0);
    assert_int_equal(ast_runtime_register(rt, l, sizeof(double) * NL, &h), 0);
    assert_int_equal(ast_runtime_register(rt, r, sizeof(double) * NR, &h), 0);
    ast_refresh e = {.op = AST_OP_GRAM_EMA, .dtype = AST_F64, .n = N, .n1 = 0, .batch = B,
                     .in0 = g, .out0 = l, .out1 = r, .p = 0.95, .eps = 0.05, .block = 1,
                     .version = 1};
    expect_submit_error(rt, &e, AST_EINVAL, "n1=0", "n1 >= 1");
    e.n1 = N1;
    e.out0 = e.out1 = NULL;
    expect_submit_error(rt, &e, AST_EINVAL, "neither out0 (L) nor out1 (R)", "either or both");
    e.out0 = l;
    e.out1 = r;
    e.in1 = l;
    expect_submit_error(rt, &e, AST_EINVAL, "in1 must be NULL for op 7", NULL);
    e.in1 = NULL;
    e.in2 = r;
    expect_submit_error(rt, &e, AST_EINVAL, "in2 must be NULL for op 7", "soap_rotate (6)");
    e.in2 = NULL;
    e.p = NAN;
    expect_submit_error(rt, &e, AST_EINVAL, "gram_ema p=nan", "finite");
    e.p = 0.95;
    e.eps = INFINITY;
    expect_submit_error(rt, &e, AST_EINVAL, "eps=inf", "finite");
    e.eps = 0.05;
    /* L and R are updated in place: neither may overlap G, nor each other. */
    e.out0 = g;
    expect_submit_error(rt, &e, AST_EINVAL, "out0 (L) overlaps in0 (G)", "separate memory");
    e.out0 = l;
    e.out1 = g + NG - 1;
    expect_submit_error(rt, &e, AST_EINVAL, "out1 (R) overlaps in0 (G)", NULL);
    e.out1 = l + 1;
    expect_submit_error(rt, &e, AST_EINVAL, "out0 (L) overlaps out1 (R)", NULL);
    /* Outside any registered buffer, and running past the end of one (sized n x n1, n x n and
     * n1 x n1). */
    e.out1 = other;
    expect_submit_error(rt, &e, AST_ERANGE, "out1", "registered buffer");
    e.out1 = r + 1;
    expect_submit_error(rt, &e, AST_ERANGE, "out1", NULL);
    e.out1 = r;
    e.out0 = l + 1;
    expect_submit_error(rt, &e, AST_ERANGE, "out0", NULL);
    e.out0 = l;
    e.in0 = g + 1;
    expect_submit_error(rt, &e, AST_ERANGE, "in0", NULL);
    e.in0 = NULL;
    expect_submit_error(rt, &e, AST_EINVAL, "in0 is required", NULL);
    ast_stats st;
    assert_int_equal(ast_runtime_stats_get(rt, &st), 0);
    assert_int_equal(st.jobs_submitted, 0);
    ast_runtime_destroy(rt, NULL, 0);
}

/* Rectangular, batched, both factors, through the pool, in place; then L alone; then a NaN in
 * block 1's G: the job fails there and every block's L and R is as it was. */
static void test_gram_ema_job(void **state)
{
    (void)state;
    ast_runtime *rt = make_rt(2);
    enum { N = 7, N1 = 4, B = 3 };
    const int ng = N * N1, nl = N * N, nr = N1 * N1;
    double *g = malloc(sizeof(double) * B * ng), *l = malloc(sizeof(double) * B * nl);
    double *r = malloc(sizeof(double) * B * nr), *l0 = malloc(sizeof(double) * B * nl);
    double *r0 = malloc(sizeof(double) * B * nr);
    double ref_l[N * N], ref_r[N1 * N1];
    srand(78);
    for (int i = 0; i < B * ng; i++)
        g[i] = (double)rand() / RAND_MAX - 0.5;
    for (int b = 0; b < B; b++) {
        spd(l + b * nl, N, 10 + b);
        spd(r + b * nr, N1, 20 + b);
    }
    uint64_t h;
    assert_int_equal(ast_runtime_register(rt, g, sizeof(double) * B * ng, &h), 0);
    assert_int_equal(ast_runtime_register(rt, l, sizeof(double) * B * nl, &h), 0);
    assert_int_equal(ast_runtime_register(rt, r, sizeof(double) * B * nr, &h), 0);
    ast_refresh e = {.op = AST_OP_GRAM_EMA, .dtype = AST_F64, .n = N, .n1 = N1, .batch = B,
                     .in0 = g, .out0 = l, .out1 = r, .p = 0.95, .eps = 0.05, .block = 9,
                     .version = 1, .snapshot_step = 4};
    memcpy(l0, l, sizeof(double) * B * nl);
    memcpy(r0, r, sizeof(double) * B * nr);
    uint64_t t;
    ast_result res;
    assert_int_equal(ast_runtime_submit(rt, &e, &t), 0);
    assert_int_equal(ast_runtime_wait(rt, t, -1, &res), 0);
    assert_int_equal(res.status, 0);
    assert_int_equal(res.failed_index, -1);
    assert_int_equal(res.retried_f64, 0);
    assert_int_equal(res.snapshot_step, 4);
    for (int b = 0; b < B; b++) {
        ref_gram_ema(N, N1, g + b * ng, 0.95, 0.05, l0 + b * nl, r0 + b * nr, ref_l, ref_r);
        for (int i = 0; i < nl; i++)
            assert_true(fabs(l[b * nl + i] - ref_l[i]) < 1e-12);
        for (int i = 0; i < nr; i++)
            assert_true(fabs(r[b * nr + i] - ref_r[i]) < 1e-12);
        for (int i = 0; i < N; i++)
            for (int j = 0; j < N; j++)
                assert_true(l[b * nl + i * N + j] == l[b * nl + j * N + i]);
        for (int i = 0; i < N1; i++)
            for (int j = 0; j < N1; j++)
                assert_true(r[b * nr + i * N1 + j] == r[b * nr + j * N1 + i]);
    }
    /* L alone: R keeps what it has. */
    memcpy(l0, l, sizeof(double) * B * nl);
    memcpy(r0, r, sizeof(double) * B * nr);
    e.out1 = NULL;
    e.version = 2;
    assert_int_equal(ast_runtime_submit(rt, &e, &t), 0);
    assert_int_equal(ast_runtime_wait(rt, t, -1, &res), 0);
    assert_int_equal(res.status, 0);
    assert_memory_equal(r, r0, sizeof(double) * B * nr);
    for (int b = 0; b < B; b++) {
        ref_gram_ema(N, N1, g + b * ng, 0.95, 0.05, l0 + b * nl, NULL, ref_l, NULL);
        for (int i = 0; i < nl; i++)
            assert_true(fabs(l[b * nl + i] - ref_l[i]) < 1e-12);
    }
    /* A NaN in block 1's G: nothing is written, block 0 included. */
    memcpy(l0, l, sizeof(double) * B * nl);
    g[ng + 3] = NAN;
    e.out1 = r;
    e.version = 3;
    assert_int_equal(ast_runtime_submit(rt, &e, &t), 0);
    assert_int_equal(ast_runtime_wait(rt, t, -1, &res), 0);
    assert_int_equal(res.status, AST_ENONFINITE);
    assert_int_equal(res.failed_index, 1);
    assert_memory_equal(l, l0, sizeof(double) * B * nl);
    assert_memory_equal(r, r0, sizeof(double) * B * nr);
    ast_runtime_destroy(rt, NULL, 0);
    free(g);
    free(l);
    free(r);
    free(l0);
    free(r0);
}

/* ast_op_name covers every code 1 .. ast_op_count() with a distinct name and answers NULL outside
 * it; the count ends at the last ast_op value. */
static void test_op_names(void **state)
{
    (void)state;
    static const char *const want[] = {NULL, "eigh", "inv_root", "newton_root", "soap_qr",
                                       "kl_qr", "soap_rotate", "gram_ema"};
    const int count = ast_op_count();
    assert_int_equal(count, AST_OP_GRAM_EMA);
    assert_int_equal(count, (int)(sizeof want / sizeof want[0]) - 1);
    for (int op = 1; op <= count; op++) {
        const char *name = ast_op_name(op);
        assert_non_null(name);
        assert_string_equal(name, want[op]);
        for (int other = 1; other < op; other++)
            assert_string_not_equal(name, ast_op_name(other));
    }
    const int outside[] = {0, -1, count + 1, count + 100, INT_MAX, INT_MIN};
    for (size_t i = 0; i < sizeof outside / sizeof outside[0]; i++)
        assert_null(ast_op_name(outside[i]));
}

/* ast_op_info_get hands out the table's properties: the basis takers, the one in-place op,
 * every required pointer with a shape and every pointer it refuses without one. */
static void test_op_info(void **state)
{
    (void)state;
    ast_op_info info;
    for (int op = 1; op <= ast_op_count(); op++) {
        assert_int_equal(ast_op_info_get(op, &info), 0);
        assert_string_equal(info.name, ast_op_name(op));
        assert_int_equal(info.takes_basis, op == AST_OP_SOAP_QR || op == AST_OP_KL_QR);
        assert_int_equal(info.in_place, op == AST_OP_GRAM_EMA);
        assert_int_equal(info.need[0], AST_ARG_REQUIRED);
        for (int i = 0; i < AST_OP_ARGS; i++)
            assert_int_equal(info.need[i] == AST_ARG_NONE, info.shape[i] == AST_SHAPE_NONE);
        if (info.takes_basis) {
            assert_int_equal(info.need[1], AST_ARG_REQUIRED);
            assert_int_equal(info.shape[1], info.shape[0]);
        }
    }
    assert_int_equal(ast_op_info_get(AST_OP_EIGH, &info), 0);
    assert_int_equal(info.shape[4], AST_SHAPE_N); /* the eigenvalues */
    assert_int_equal(ast_op_info_get(0, &info), AST_EINVAL);
    assert_int_equal(ast_op_info_get(ast_op_count() + 1, &info), AST_EINVAL);
    assert_int_equal(ast_op_info_get(AST_OP_EIGH, NULL), AST_EINVAL);
}

static void expect_submit_message(ast_runtime *rt, const ast_refresh *r, int code,
                                  const char *want)
{
    uint64_t t;
    assert_int_equal(ast_runtime_submit(rt, r, &t), code);
    char msg[512];
    ast_runtime_last_error(rt, msg, sizeof msg);
    assert_string_equal(msg, want);
}

/* The op table's checks word their failures exactly as the runtime always has. */
static void test_submit_messages_from_the_op_table(void **state)
{
    (void)state;
    ast_runtime *rt = make_rt(1);
    double f[16], q[16], x[16], w[4];
    int64_t perm[4];
    spd(f, 4, 3);
    memset(q, 0, sizeof q);
    uint64_t h;
    assert_int_equal(ast_runtime_register(rt, f, sizeof f, &h), 0);
    assert_int_equal(ast_runtime_register(rt, q, sizeof q, &h), 0);
    assert_int_equal(ast_runtime_register(rt, x, sizeof x, &h), 0);
    assert_int_equal(ast_runtime_register(rt, w, sizeof w, &h), 0);
    assert_int_equal(ast_runtime_register(rt, perm, sizeof perm, &h), 0);
    ast_refresh r = {.op = AST_OP_INV_ROOT, .dtype = AST_F64, .n = 4, .batch = 1, .in0 = f,
                     .out0 = x, .p = 0, .block = 1, .version = 1};
    expect_submit_message(rt, &r, AST_EINVAL, "AST_EINVAL: submit: root p=0; allowed: p > 0");
    r.op = AST_OP_NEWTON_ROOT;
    r.p = 2.5;
    expect_submit_message(rt, &r, AST_EINVAL,
                          "AST_EINVAL: submit: newton_root needs an integer p, got 2.5");
    r.p = 2;
    r.out1 = w;
    expect_submit_message(rt, &r, AST_EINVAL, "AST_EINVAL: submit: out1 must be NULL for op 3");
    r.out1 = NULL;
    r.op = (ast_op)0;
    expect_submit_message(rt, &r, AST_EINVAL,
                          "AST_EINVAL: submit: op 0; allowed: eigh (1), inv_root (2), "
                          "newton_root (3), soap_qr (4), kl_qr (5), soap_rotate (6), "
                          "gram_ema (7)");
    r.op = AST_OP_SOAP_QR;
    r.in1 = q;
    expect_submit_message(rt, &r, AST_EINVAL, "AST_EINVAL: submit: out1 is required for op 4");
    r.op = AST_OP_KL_QR;
    r.in2 = q;
    expect_submit_message(rt, &r, AST_EINVAL,
                          "AST_EINVAL: submit: in2 must be NULL for op 5 (only soap_rotate (6) "
                          "takes in2)");
    r.in2 = NULL;
    r.in1 = NULL;
    expect_submit_message(rt, &r, AST_EINVAL, "AST_EINVAL: submit: in1 is required for op 5");
    r.dtype = (ast_dtype)7;
    expect_submit_message(rt, &r, AST_EINVAL,
                          "AST_EINVAL: submit: dtype 7; allowed: float32 (0), float64 (1)");
    r.dtype = AST_F64;
    r.n = INT_MAX;
    r.batch = INT_MAX;
    expect_submit_message(rt, &r, AST_EINVAL,
                          "AST_EINVAL: submit: n=2147483647 batch=2147483647; the buffer sizes "
                          "overflow size_t");
    /* eigh accepts an in1 (range-checked, unused): a job with one runs. */
    ast_refresh e = {.op = AST_OP_EIGH, .dtype = AST_F64, .n = 4, .batch = 1, .in0 = f, .in1 = q,
                     .out0 = x, .out1 = w, .block = 2, .version = 1};
    uint64_t t;
    ast_result res;
    assert_int_equal(ast_runtime_submit(rt, &e, &t), 0);
    assert_int_equal(ast_runtime_wait(rt, t, -1, &res), 0);
    assert_int_equal(res.status, 0);
    assert_true(w[0] >= w[3]);
    ast_runtime_destroy(rt, NULL, 0);
}

/* Rectangular, batched, both pairs, through the pool; then the left pair alone. */
static void test_soap_rotate_job(void **state)
{
    (void)state;
    ast_runtime *rt = make_rt(2);
    enum { N = 7, N1 = 4, B = 3 };
    const int nx = N * N1, na = 2 * N * N, nb = 2 * N1 * N1;
    double *x = malloc(sizeof(double) * B * nx), *ap = malloc(sizeof(double) * B * na);
    double *bp = malloc(sizeof(double) * B * nb), *out = malloc(sizeof(double) * B * nx);
    double ref[N * N1], id[2 * N1 * N1];
    srand(77);
    for (int i = 0; i < B * nx; i++)
        x[i] = (double)rand() / RAND_MAX - 0.5;
    for (int i = 0; i < B * na; i++)
        ap[i] = (double)rand() / RAND_MAX - 0.5;
    for (int i = 0; i < B * nb; i++)
        bp[i] = (double)rand() / RAND_MAX - 0.5;
    for (int i = 0; i < B * nx; i++)
        out[i] = 42.0;
    memset(id, 0, sizeof id);
    for (int i = 0; i < N1; i++)
        id[i * N1 + i] = id[N1 * N1 + i * N1 + i] = 1;
    uint64_t h;
    assert_int_equal(ast_runtime_register(rt, x, sizeof(double) * B * nx, &h), 0);
    assert_int_equal(ast_runtime_register(rt, ap, sizeof(double) * B * na, &h), 0);
    assert_int_equal(ast_runtime_register(rt, bp, sizeof(double) * B * nb, &h), 0);
    assert_int_equal(ast_runtime_register(rt, out, sizeof(double) * B * nx, &h), 0);
    ast_refresh r = {.op = AST_OP_SOAP_ROTATE, .dtype = AST_F64, .n = N, .n1 = N1, .batch = B,
                     .in0 = x, .in1 = ap, .in2 = bp, .out0 = out, .block = 9, .version = 1,
                     .snapshot_step = 4};
    uint64_t t;
    ast_result res;
    assert_int_equal(ast_runtime_submit(rt, &r, &t), 0);
    assert_int_equal(ast_runtime_wait(rt, t, -1, &res), 0);
    assert_int_equal(res.status, 0);
    assert_int_equal(res.failed_index, -1);
    assert_int_equal(res.snapshot_step, 4);
    for (int b = 0; b < B; b++) {
        ref_soap_rotate(N, N1, x + b * nx, ap + b * na, bp + b * nb, ref);
        for (int i = 0; i < nx; i++)
            assert_true(fabs(out[b * nx + i] - ref[i]) < 1e-12);
    }
    /* Left pair only: the reference with B = identity. */
    r.in2 = NULL;
    r.version = 2;
    assert_int_equal(ast_runtime_submit(rt, &r, &t), 0);
    assert_int_equal(ast_runtime_wait(rt, t, -1, &res), 0);
    assert_int_equal(res.status, 0);
    for (int b = 0; b < B; b++) {
        ref_soap_rotate(N, N1, x + b * nx, ap + b * na, id, ref);
        for (int i = 0; i < nx; i++)
            assert_true(fabs(out[b * nx + i] - ref[i]) < 1e-12);
    }
    /* A NaN in block 1's X: the job fails there, the output keeps what it had from block 1 on. */
    memcpy(ref, out + nx, sizeof ref);
    x[nx + 3] = NAN;
    r.version = 3;
    assert_int_equal(ast_runtime_submit(rt, &r, &t), 0);
    assert_int_equal(ast_runtime_wait(rt, t, -1, &res), 0);
    assert_int_equal(res.status, AST_ENONFINITE);
    assert_int_equal(res.failed_index, 1);
    assert_memory_equal(ref, out + nx, sizeof ref);
    ast_runtime_destroy(rt, NULL, 0);
    free(x);
    free(ap);
    free(bp);
    free(out);
}

/* ---- trace ------------------------------------------------------------------------------- */

static void trace_path(char *buf, size_t len, const char *name)
{
    snprintf(buf, len, "%s/%s.%ld.json", test_tmp_root(), name, (long)getpid());
}

/* The "ts" (microseconds) of the first event line naming `name` whose args contain `arg`
 * (e.g. "\"block\":12,"); -1 if none. The writer puts one event per line. */
static double event_ts(const char *doc, const char *name, const char *arg, int *tid)
{
    char key[128];
    snprintf(key, sizeof key, "{\"name\":\"%s\",", name);
    for (const char *line = doc; line && *line;) {
        const char *end = strchr(line, '\n');
        size_t n = end ? (size_t)(end - line) : strlen(line);
        char *l = malloc(n + 1);
        memcpy(l, line, n);
        l[n] = '\0';
        double ts = -1;
        const char *t = strstr(l, "\"ts\":"), *a = strstr(l, "\"args\":{");
        if (!strncmp(l, key, strlen(key)) && t && a && strstr(a, arg)) {
            sscanf(t + 5, "%lf", &ts);
            const char *p = strstr(l, "\"tid\":");
            if (tid && p)
                sscanf(p + 6, "%d", tid);
        }
        free(l);
        if (ts >= 0)
            return ts;
        line = end ? end + 1 : NULL;
    }
    return -1;
}

static ast_runtime *make_traced_rt(int workers, const char *path)
{
    ast_config c;
    ast_config_init(&c);
    c.workers = workers;
    c.pin = 0;
    snprintf(c.cpuset, sizeof c.cpuset, "0");
    snprintf(c.trace, sizeof c.trace, "%s", path);
    ast_runtime *rt = NULL;
    char err[256];
    assert_int_equal(ast_runtime_create(&c, &rt, err, sizeof err), 0);
    assert_true(ast_runtime_tracing(rt));
    return rt;
}

static void test_trace_job_order_and_caller_events(void **state)
{
    (void)state;
    char path[1200];
    trace_path(path, sizeof path, "runtime_trace");
    unlink(path);
    ast_runtime *rt = make_traced_rt(2, path);
    const int n = 64, jobs = 3;
    double *f = malloc(sizeof(double) * n * n);
    double *q = calloc((size_t)jobs * n * n, sizeof(double));
    spd(f, n, 4);
    uint64_t h, t[3];
    assert_int_equal(ast_runtime_register(rt, f, sizeof(double) * n * n, &h), 0);
    assert_int_equal(ast_runtime_register(rt, q, sizeof(double) * jobs * n * n, &h), 0);
    for (int i = 0; i < jobs; i++) {
        ast_refresh r = {.op = AST_OP_EIGH, .dtype = AST_F64, .n = n, .batch = 1, .in0 = f,
                         .out0 = q + (size_t)i * n * n, .block = 11 + (uint64_t)i, .version = 2,
                         .deadline = i};
        assert_int_equal(ast_runtime_submit(rt, &r, &t[i]), 0);
    }
    ast_result res;
    for (int i = 0; i < jobs; i++) {
        assert_int_equal(ast_runtime_wait(rt, t[i], -1, &res), 0);
        assert_int_equal(res.status, 0);
    }
    ast_runtime_note_install(rt, 4, 9);
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    uint64_t mono = (uint64_t)now.tv_sec * 1000000000u + (uint64_t)now.tv_nsec;
    ast_trace_ev ev = {.kind = AST_TRACE_COPY, .lane = AST_TRACE_LANE_SHADOW, .ts_ns = mono,
                       .dur_ns = 5000, .args = AST_TRACE_ARG_BYTES | AST_TRACE_ARG_BLOCK,
                       .bytes = 4096, .block = 77, .dir = AST_TRACE_DIR_H2D};
    assert_int_equal(ast_runtime_trace_event(rt, &ev), 0);
    ev.kind = AST_TRACE_CUSTOM_INSTANT; /* a custom kind needs a name */
    assert_int_equal(ast_runtime_trace_event(rt, &ev), AST_EINVAL);
    char msg[512];
    ast_runtime_last_error(rt, msg, sizeof msg);
    assert_non_null(strstr(msg, "trace_event"));
    ev.lane = -1000;
    ev.name = "x";
    assert_int_equal(ast_runtime_trace_event(rt, &ev), AST_EINVAL);
    assert_int_equal(ast_runtime_trace_name_lane(rt, -7, "rank 0 sync"), 0);
    ast_trace_ev sync = {.kind = AST_TRACE_CUSTOM_SPAN, .name = "sync", .lane = -7,
                         .dur_ns = 100};
    assert_int_equal(ast_runtime_trace_event(rt, &sync), 0);

    char err[512] = "x";
    assert_int_equal(ast_runtime_destroy(rt, err, sizeof err), 0);
    assert_string_equal(err, "");
    free(f);
    free(q);

    char *doc = slurp(path);
    assert_non_null(doc);
    for (int i = 0; i < jobs; i++) {
        char arg[64];
        snprintf(arg, sizeof arg, "\"block\":%d,", 11 + i);
        int wtid = -1;
        double tq = event_ts(doc, "job queued", arg, NULL);
        double ts = event_ts(doc, "job started", arg, &wtid);
        double td = event_ts(doc, "job done", arg, NULL);
        double tr = event_ts(doc, "refresh", arg, NULL);
        assert_true(tq >= 0 && ts >= 0 && td >= 0 && tr >= 0);
        assert_true(tq < ts);
        assert_true(ts < td);
        assert_true(tr == ts);
        assert_true(wtid >= 1000 && wtid < 1002); /* a worker lane (tid 1000 + index) */
    }
    assert_true(event_ts(doc, "install", "\"step\":9", NULL) >= 0);
    assert_true(event_ts(doc, "copy", "\"bytes\":4096", NULL) >= 0);
    assert_non_null(strstr(doc, "\"dir\":\"h2d\""));
    assert_non_null(strstr(doc, "rank 0 sync"));
    free(doc);
    if (system("python3 -c pass >/dev/null 2>&1") == 0) {
        char cmd[1400];
        snprintf(cmd, sizeof cmd, "python3 -c \"import json,sys; d=json.load(open(sys.argv[1])); "
                 "assert len(d['traceEvents']) > 12\" '%s'", path);
        assert_int_equal(system(cmd), 0);
    }
    unlink(path);
}

static void test_trace_uncollected_and_write_errors(void **state)
{
    (void)state;
    char path[1200];
    trace_path(path, sizeof path, "runtime_trace_nodir");
    /* A directory that does not exist: refused at create (config key "trace"); one removed
     * after create: the write at destroy fails and says where. */
    char bad[1300], baddir[1250];
    snprintf(baddir, sizeof baddir, "%s.missing", path);
    snprintf(bad, sizeof bad, "%s/t.json", baddir);
    ast_config c;
    ast_config_init(&c);
    snprintf(c.trace, sizeof c.trace, "%s", bad);
    ast_runtime *rt = NULL;
    char cerr[1400] = "";
    assert_int_equal(ast_runtime_create(&c, &rt, cerr, sizeof cerr), AST_EINVAL);
    assert_non_null(strstr(cerr, "'trace'"));
    rmdir(baddir);
    assert_int_equal(mkdir(baddir, 0700), 0);
    rt = make_traced_rt(1, bad);
    assert_int_equal(rmdir(baddir), 0);
    double f[16], q[16];
    spd(f, 4, 2);
    uint64_t h, t;
    ast_runtime_register(rt, f, sizeof f, &h);
    ast_runtime_register(rt, q, sizeof q, &h);
    ast_refresh r = {.op = AST_OP_EIGH, .dtype = AST_F64, .n = 4, .batch = 1, .in0 = f,
                     .out0 = q, .block = 5, .version = 1};
    assert_int_equal(ast_runtime_submit(rt, &r, &t), 0);
    /* An explicit write to a good path works while recording goes on; the job's completion is
     * never collected by the caller, so destroy drains it into the trace. */
    assert_int_equal(ast_runtime_trace_write(rt, path), 0);
    assert_int_equal(ast_runtime_trace_write(rt, bad), AST_ENOENT);
    char msg[1400];
    ast_runtime_last_error(rt, msg, sizeof msg);
    assert_non_null(strstr(msg, bad));
    /* Wait until it ran, without collecting it. */
    ast_stats st;
    for (int i = 0; i < 2000; i++) {
        ast_runtime_stats_get(rt, &st);
        if (!st.jobs_queued && !st.jobs_running)
            break;
        usleep(1000);
    }
    char err[1400] = "";
    assert_int_equal(ast_runtime_destroy(rt, err, sizeof err), AST_ENOENT);
    assert_non_null(strstr(err, bad));
    struct stat sb;
    assert_int_not_equal(stat(bad, &sb), 0);

    /* The same job traced to a good path: destroy drains the uncollected completion. */
    rt = make_traced_rt(1, path);
    ast_runtime_register(rt, f, sizeof f, &h);
    ast_runtime_register(rt, q, sizeof q, &h);
    assert_int_equal(ast_runtime_submit(rt, &r, &t), 0);
    for (int i = 0; i < 2000; i++) {
        ast_runtime_stats_get(rt, &st);
        if (!st.jobs_queued && !st.jobs_running)
            break;
        usleep(1000);
    }
    ast_runtime_destroy(rt, NULL, 0);
    char *doc = slurp(path);
    assert_non_null(doc);
    double tq = event_ts(doc, "job queued", "\"block\":5,", NULL);
    double td = event_ts(doc, "job done", "\"block\":5,", NULL);
    assert_true(tq >= 0 && td > tq);
    free(doc);
    unlink(path);

    /* Without a trace: events are discarded, writes refused. */
    rt = make_rt(1);
    assert_false(ast_runtime_tracing(rt));
    ast_trace_ev ev = {.kind = AST_TRACE_COPY_ISSUED, .lane = AST_TRACE_LANE_SHADOW};
    assert_int_equal(ast_runtime_trace_event(rt, &ev), 0);
    assert_int_equal(ast_runtime_trace_write(rt, path), AST_ESTATE);
    assert_int_equal(ast_runtime_destroy(rt, err, sizeof err), 0);
}

/* What the check callback of test_wait_check saw. */
struct checks {
    int calls, stop_at;
    uint64_t last_ns, max_gap_ns;
};

static uint64_t mono_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static int count_check(void *arg)
{
    struct checks *c = arg;
    uint64_t t = mono_ns();
    if (t - c->last_ns > c->max_gap_ns)
        c->max_gap_ns = t - c->last_ns;
    c->last_ns = t;
    return ++c->calls == c->stop_at ? AST_EINTR : 0;
}

/* ast_runtime_wait_check wakes every slice to call its check; a nonzero check ends the wait
 * with AST_EINTR and leaves the job pending, its buffers held, its result collectable later;
 * the interrupted and the final wait are one barrier wait each. */
static void test_wait_check(void **state)
{
    (void)state;
    ast_config c;
    ast_config_init(&c);
    c.workers = 1;
    snprintf(c.cpuset, sizeof c.cpuset, "0");
    c.pin = 0;
    ast_runtime *rt = NULL;
    char err[256];
    assert_int_equal(ast_runtime_create(&c, &rt, err, sizeof err), 0);
    assert_int_equal(ast__runtime_set_job_delay(rt, 600), 0);
    const int n = 16;
    double *f = malloc(sizeof(double) * n * n), *q = calloc((size_t)n * n, sizeof(double));
    spd(f, n, 3);
    uint64_t hf, hq, t;
    assert_int_equal(ast_runtime_register(rt, f, sizeof(double) * n * n, &hf), 0);
    assert_int_equal(ast_runtime_register(rt, q, sizeof(double) * n * n, &hq), 0);
    ast_refresh r = {.op = AST_OP_EIGH, .dtype = AST_F64, .n = n, .batch = 1, .in0 = f,
                     .out0 = q, .block = 1, .version = 1, .deadline = 1};
    assert_int_equal(ast_runtime_submit(rt, &r, &t), 0);

    ast_result res;
    assert_int_equal(ast_runtime_wait_check(rt, t, -1, 0, count_check, NULL, &res), AST_EINVAL);
    assert_int_equal(ast_runtime_wait_check(rt, t, -1, 1000, NULL, NULL, &res), AST_EINVAL);
    const uint64_t slice = 20 * 1000 * 1000;
    struct checks ck = {.stop_at = 3, .last_ns = mono_ns()};
    uint64_t t0 = ck.last_ns;
    assert_int_equal(ast_runtime_wait_check(rt, t, -1, (int64_t)slice, count_check, &ck, &res),
                     AST_EINTR);
    assert_int_equal(ck.calls, 3);
    assert_true(mono_ns() - t0 < 300 * 1000 * 1000ull); /* long before the job's 600 ms */
    assert_true(ck.max_gap_ns < 5 * slice);
    ast_runtime_last_error(rt, err, sizeof err);
    assert_non_null(strstr(err, "interrupted"));
    /* Still pending: its buffers are held, and a timed wait runs out without checking. */
    assert_int_equal(ast_runtime_unregister(rt, hq), AST_EBUSY);
    struct checks idle = {.stop_at = -1, .last_ns = mono_ns()};
    assert_int_equal(ast_runtime_wait_check(rt, t, 10 * 1000 * 1000, (int64_t)slice, count_check,
                                            &idle, &res), AST_ETIMEDOUT);
    assert_int_equal(idle.calls, 0);
    /* Waited again: the result is there, computed from the same inputs. */
    struct checks go = {.stop_at = -1, .last_ns = mono_ns()};
    assert_int_equal(ast_runtime_wait_check(rt, t, -1, (int64_t)slice, count_check, &go, &res),
                     0);
    assert_int_equal(res.status, 0);
    assert_true(go.calls >= 1);
    for (int j = 0; j < n; j++) /* orthonormal columns: the eigenbasis was written */
        for (int k = 0; k < n; k++) {
            double d = 0;
            for (int i = 0; i < n; i++)
                d += q[i * n + j] * q[i * n + k];
            assert_true(fabs(d - (j == k)) < 1e-9);
        }
    assert_int_equal(ast_runtime_unregister(rt, hq), 0);
    assert_int_equal(ast_runtime_unregister(rt, hf), 0);
    ast_stats st;
    assert_int_equal(ast_runtime_stats_get(rt, &st), 0);
    assert_int_equal(st.barrier_waits, 3);
    assert_int_equal(st.jobs_done, 1);
    assert_int_equal(st.bytes_registered, 0);
    ast_runtime_destroy(rt, NULL, 0);
    free(f);
    free(q);
}

/* One eigh job of f (n x n float64) into q on rt, waited for: its result, and in *waited_ns the
 * time from before the submit to the wait's return. */
static ast_result eigh_once(ast_runtime *rt, double *f, double *q, int n, uint64_t *waited_ns)
{
    uint64_t hf, hq, t;
    assert_int_equal(ast_runtime_register(rt, f, sizeof(double) * n * n, &hf), 0);
    assert_int_equal(ast_runtime_register(rt, q, sizeof(double) * n * n, &hq), 0);
    ast_refresh r = {.op = AST_OP_EIGH, .dtype = AST_F64, .n = n, .batch = 1, .in0 = f,
                     .out0 = q, .block = 1, .version = 1, .deadline = 1};
    ast_result res;
    uint64_t t0 = mono_ns();
    assert_int_equal(ast_runtime_submit(rt, &r, &t), 0);
    assert_int_equal(ast_runtime_wait(rt, t, -1, &res), 0);
    *waited_ns = mono_ns() - t0;
    assert_int_equal(res.status, 0);
    assert_int_equal(ast_runtime_unregister(rt, hq), 0);
    assert_int_equal(ast_runtime_unregister(rt, hf), 0);
    return res;
}

/* The job stretch (testing.h): bad arguments refused; factor 1 runs no stretch; a stretched
 * job holds its worker at least factor x its compute, in the pool's stamps and before the wait
 * returns, with the same bits out; ops outside the mask are not stretched. Bounds only: a sleep
 * lasts at least its deadline, however loaded the machine. */
static void test_job_stretch(void **state)
{
    (void)state;
    ast_runtime *rt = make_rt(1);
    uint64_t comp = 1, slept = 1, waited;
    assert_int_equal(ast__runtime_set_job_stretch(NULL, 2.0, 0), AST_EINVAL);
    assert_int_equal(ast__runtime_set_job_stretch(rt, 0.5, 0), AST_EINVAL);
    assert_int_equal(ast__runtime_set_job_stretch(rt, NAN, 0), AST_EINVAL);
    assert_int_equal(ast__runtime_set_job_stretch(rt, AST__JOB_STRETCH_MAX + 1, 0), AST_EINVAL);
    assert_int_equal(ast__runtime_set_job_stretch(rt, 2.0, 1u), AST_EINVAL); /* bit 0: no op */
    assert_int_equal(ast__runtime_set_job_stretch(rt, 2.0, 2u << ast_op_count()), AST_EINVAL);
    assert_int_equal(ast__runtime_job_stretch_totals(rt, NULL, &slept), AST_EINVAL);
    assert_int_equal(ast__runtime_job_stretch_totals(NULL, &comp, &slept), AST_EINVAL);
    const int n = 96;
    double *f = malloc(sizeof(double) * n * n), *q1 = calloc((size_t)n * n, sizeof(double));
    double *q3 = calloc((size_t)n * n, sizeof(double));
    spd(f, n, 5);
    assert_int_equal(ast__runtime_set_job_stretch(rt, 1.0, 0), 0);
    eigh_once(rt, f, q1, n, &waited);
    assert_int_equal(ast__runtime_job_stretch_totals(rt, &comp, &slept), 0);
    assert_int_equal(comp, 0);
    assert_int_equal(slept, 0);

    assert_int_equal(ast__runtime_set_job_stretch(rt, 3.0, 1u << AST_OP_EIGH), 0);
    ast_result res = eigh_once(rt, f, q3, n, &waited);
    assert_int_equal(ast__runtime_job_stretch_totals(rt, &comp, &slept), 0);
    assert_true(comp > 0);
    assert_true(slept >= 2 * comp);
    assert_true(res.done_ns - res.started_ns >= comp + slept);
    assert_true(waited >= comp + slept);
    assert_memory_equal(q1, q3, sizeof(double) * n * n);

    /* an op outside the mask runs unstretched */
    assert_int_equal(ast__runtime_set_job_stretch(rt, 3.0, 1u << AST_OP_INV_ROOT), 0);
    eigh_once(rt, f, q3, n, &waited);
    uint64_t comp2, slept2;
    assert_int_equal(ast__runtime_job_stretch_totals(rt, &comp2, &slept2), 0);
    assert_int_equal(comp2, comp);
    assert_int_equal(slept2, slept);
    ast_runtime_destroy(rt, NULL, 0);
    free(f);
    free(q1);
    free(q3);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_create_rejects_bad_config),
        cmocka_unit_test(test_eigh_job_end_to_end),
        cmocka_unit_test(test_unregistered_pointer_is_erange),
        cmocka_unit_test(test_repeated_failure_keeps_own_status),
        cmocka_unit_test(test_install_and_nonfinite_stats),
        cmocka_unit_test(test_destroy_with_pending_jobs),
        cmocka_unit_test(test_soap_rotate_submit_validation),
        cmocka_unit_test(test_op_names),
        cmocka_unit_test(test_op_info),
        cmocka_unit_test(test_submit_messages_from_the_op_table),
        cmocka_unit_test(test_soap_rotate_job),
        cmocka_unit_test(test_gram_ema_submit_validation),
        cmocka_unit_test(test_gram_ema_job),
        cmocka_unit_test(test_trace_job_order_and_caller_events),
        cmocka_unit_test(test_trace_uncollected_and_write_errors),
        cmocka_unit_test(test_wait_check),
        cmocka_unit_test(test_job_stretch),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
