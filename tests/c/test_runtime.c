/* test_runtime.c - runtime: config handling, buffer registration, REFRESH jobs end to end,
 * consecutive-failure rule, barrier stats, shutdown with jobs pending. */
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <setjmp.h>
#include <cmocka.h>

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "asteria/errors.h"
#include "asteria/runtime.h"

static ast_runtime *make_rt(int workers, int max_failures)
{
    ast_config c;
    ast_config_init(&c);
    c.workers = workers;
    c.max_failures = max_failures;
    snprintf(c.cpuset, sizeof c.cpuset, "0");
    c.pin = 0;
    ast_runtime *rt = NULL;
    char err[256];
    assert_int_equal(ast_runtime_create_msg(&c, &rt, err, sizeof err), 0);
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
    c.staleness = -1;
    ast_runtime *rt = (ast_runtime *)0x1;
    char err[256] = "";
    assert_int_equal(ast_runtime_create_msg(&c, &rt, err, sizeof err), AST_EINVAL);
    assert_null(rt);
    assert_non_null(strstr(err, "staleness"));
}

static void test_eigh_job_end_to_end(void **state)
{
    (void)state;
    ast_runtime *rt = make_rt(1, 3);
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
    ast_runtime_destroy(rt);
    free(f);
    free(q);
    free(w);
}

static void test_unregistered_pointer_is_erange(void **state)
{
    (void)state;
    ast_runtime *rt = make_rt(1, 3);
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
    ast_runtime_destroy(rt);
}

static void test_repeated_failure_surfaces(void **state)
{
    (void)state;
    ast_runtime *rt = make_rt(1, 2);
    const int n = 4;
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
    r.version = 1;
    assert_int_equal(ast_runtime_submit(rt, &r, &t), 0);
    assert_int_equal(ast_runtime_wait(rt, t, -1, &res), 0);
    assert_int_equal(res.status, AST_ENONFINITE);
    r.version = 2;
    assert_int_equal(ast_runtime_submit(rt, &r, &t), 0);
    assert_int_equal(ast_runtime_wait(rt, t, -1, &res), 0);
    assert_int_equal(res.status, AST_EFAILED); /* second consecutive failure, K = 2 */
    for (int i = 0; i < 16; i++)
        assert_true(x[i] == 42.0); /* previous result kept */
    /* A success resets the count. */
    f[5] = 1.0;
    r.version = 3;
    assert_int_equal(ast_runtime_submit(rt, &r, &t), 0);
    assert_int_equal(ast_runtime_wait(rt, t, -1, &res), 0);
    assert_int_equal(res.status, 0);
    assert_true(fabs(x[0] - pow(1.0 + 1e-6, -0.25)) < 1e-12);
    ast_stats st;
    ast_runtime_stats_get(rt, &st);
    assert_int_equal(st.jobs_failed, 2);
    assert_int_equal(st.jobs_done, 3);
    ast_runtime_destroy(rt);
}

static void test_install_and_nonfinite_stats(void **state)
{
    (void)state;
    ast_runtime *rt = make_rt(1, 3);
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
    ast_runtime_destroy(rt);
}

static void test_destroy_with_pending_jobs(void **state)
{
    (void)state;
    ast_runtime *rt = make_rt(1, 3);
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
    ast_runtime_destroy(rt); /* must not leak job contexts (ASan build checks) nor hang */
    free(f);
    free(q);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_create_rejects_bad_config),
        cmocka_unit_test(test_eigh_job_end_to_end),
        cmocka_unit_test(test_unregistered_pointer_is_erange),
        cmocka_unit_test(test_repeated_failure_surfaces),
        cmocka_unit_test(test_install_and_nonfinite_stats),
        cmocka_unit_test(test_destroy_with_pending_jobs),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
