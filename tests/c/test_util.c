/* test_util.c - the shared internals of src/util.h: clock, error messages, hash table. */
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <setjmp.h>
#include <cmocka.h>

#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "asteria/errors.h"
#include "util.h"

static void test_clock_is_monotonic(void **state)
{
    (void)state;
    uint64_t a = ast__now_ns(), b = ast__now_ns();
    assert_true(a > 0 && b >= a);
}

static void test_errorf(void **state)
{
    (void)state;
    char buf[32];
    assert_int_equal(ast__errorf(buf, sizeof buf, AST_EINVAL, "key '%s'", "workers"), AST_EINVAL);
    assert_string_equal(buf, "key 'workers'");
    assert_int_equal(ast__errorf(NULL, 0, AST_ENOMEM, "ignored"), AST_ENOMEM);
    assert_int_equal(ast__errorf(buf, 5, AST_EINVAL, "truncated"), AST_EINVAL);
    assert_string_equal(buf, "trun");
}

static int named(char *buf, size_t len, int code, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    int rc = ast__verrorf_named(buf, len, code, fmt, ap);
    va_end(ap);
    return rc;
}

static void test_verrorf_named(void **state)
{
    (void)state;
    char buf[64];
    assert_int_equal(named(buf, sizeof buf, AST_ERANGE, "ptr %d", 7), AST_ERANGE);
    assert_string_equal(buf, "AST_ERANGE: ptr 7");
    assert_int_equal(named(buf, 6, AST_ERANGE, "ptr %d", 7), AST_ERANGE);
    assert_string_equal(buf, "AST_E");
}

static void test_set_error(void **state)
{
    (void)state;
    ast__last_error plain = {0}, named = {0};
    pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
    named.named = 1;
    assert_int_equal(ast__set_error(&plain, NULL, AST_ENOENT, "block %d", 3), AST_ENOENT);
    assert_string_equal(plain.text, "block 3");
    assert_int_equal(ast__set_error(&named, &mu, AST_EBUSY, "slot %d", 4), AST_EBUSY);
    assert_string_equal(named.text, "AST_EBUSY: slot 4");
    /* the mutex was released: taking it again does not deadlock */
    assert_int_equal(pthread_mutex_trylock(&mu), 0);
    pthread_mutex_unlock(&mu);
    char big[2 * AST__LAST_ERROR_BYTES];
    memset(big, 'x', sizeof big - 1);
    big[sizeof big - 1] = '\0';
    ast__set_error(&plain, NULL, AST_EINVAL, "%s", big);
    assert_int_equal(strlen(plain.text), AST__LAST_ERROR_BYTES - 1);
}

static void test_get_error(void **state)
{
    (void)state;
    ast__last_error e = {0};
    pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
    char buf[8] = "junk";
    assert_int_equal(ast__get_error(&e, &mu, buf, sizeof buf), 0);
    assert_string_equal(buf, "");
    ast__set_error(&e, NULL, AST_EIO, "record %d torn", 12);
    assert_int_equal(ast__get_error(&e, NULL, buf, sizeof buf), 0);
    assert_string_equal(buf, "record "); /* truncated to the buffer */
    assert_int_equal(ast__get_error(&e, &mu, NULL, 8), AST_EINVAL);
    assert_int_equal(ast__get_error(&e, &mu, buf, 0), AST_EINVAL);
    /* the mutex was released */
    assert_int_equal(pthread_mutex_trylock(&mu), 0);
    pthread_mutex_unlock(&mu);
}

static void test_batch_fail(void **state)
{
    (void)state;
    ast__batch_err e;
    ast__batch_err_init(&e);
    assert_int_equal(e.code, 0);
    assert_int_equal(e.failed, 0);
    /* the lowest position wins whatever the order of the failures */
    assert_int_equal(ast__batch_fail(&e, 5, NULL, AST_EIO, "item %d", 5), AST_EIO);
    assert_int_equal(ast__batch_fail(&e, 2, NULL, AST_ENOSPC, "item %d", 2), AST_ENOSPC);
    assert_int_equal(ast__batch_fail(&e, 7, NULL, AST_ECORRUPT, "item %d", 7), AST_ECORRUPT);
    assert_int_equal(e.idx, 2);
    assert_int_equal(e.code, AST_ENOSPC);
    assert_int_equal(e.failed, 3);
    assert_string_equal(e.msg, "item 2");
    /* an item keeps its first cause: a second failure of it is ignored */
    int item = 0;
    ast__batch_err_init(&e);
    ast__batch_fail(&e, 1, &item, AST_EIO, "first");
    ast__batch_fail(&e, 1, &item, AST_ECORRUPT, "second");
    assert_int_equal(item, AST_EIO);
    assert_int_equal(e.code, AST_EIO);
    assert_int_equal(e.failed, 1);
    assert_string_equal(e.msg, "first");
}

typedef struct item {
    ast__hnode node;
    int value;
} item;

static void test_htable(void **state)
{
    (void)state;
    ast__htable t = {0};
    assert_null(ast__htable_find(&t, 1)); /* empty, no buckets */
    enum { N = 1000 };
    item *items = calloc(N + 2, sizeof *items);
    assert_non_null(items);
    for (int i = 0; i < N; i++) {
        assert_int_equal(ast__htable_reserve(&t, t.n + 1), 0);
        items[i].node.key = (uint64_t)i * 3;
        items[i].value = i;
        ast__htable_insert(&t, &items[i].node);
    }
    assert_int_equal(t.n, N);
    assert_true(t.nb >= N && (t.nb & (t.nb - 1)) == 0);
    for (int i = 0; i < N; i++) {
        ast__hnode *x = ast__htable_find(&t, (uint64_t)i * 3);
        assert_non_null(x);
        assert_int_equal(AST__CONTAINER_OF(x, item, node)->value, i);
        assert_null(ast__htable_next(x));
        assert_null(ast__htable_find(&t, (uint64_t)i * 3 + 1));
    }
    /* repeated keys: both found, through next */
    assert_int_equal(ast__htable_reserve(&t, t.n + 2), 0);
    items[N].node.key = items[N + 1].node.key = 1; /* no other item has key 1 */
    items[N].value = -1;
    items[N + 1].value = -2;
    ast__htable_insert(&t, &items[N].node);
    ast__htable_insert(&t, &items[N + 1].node);
    int seen = 0;
    for (ast__hnode *x = ast__htable_find(&t, 1); x; x = ast__htable_next(x))
        seen |= 1 << -AST__CONTAINER_OF(x, item, node)->value;
    assert_int_equal(seen, 0x6);
    ast__htable_remove(&t, &items[N].node);
    ast__htable_remove(&t, &items[5].node);
    assert_null(ast__htable_find(&t, 15));
    assert_int_equal(AST__CONTAINER_OF(ast__htable_find(&t, 1), item, node)->value, -2);
    assert_int_equal(t.n, N);
    /* the walk meets every linked node once */
    size_t walked = 0;
    long long sum = 0;
    for (ast__hnode *x = ast__htable_first(&t); x; x = ast__htable_after(&t, x)) {
        walked++;
        sum += AST__CONTAINER_OF(x, item, node)->value;
    }
    assert_int_equal(walked, t.n);
    assert_true(sum == (long long)N * (N - 1) / 2 - 5 - 2);
    ast__htable_clear(&t);
    assert_int_equal(t.n, 0);
    assert_null(ast__htable_first(&t));
    assert_null(ast__htable_find(&t, 1));
    ast__htable_free(&t);
    assert_null(t.b);
    assert_int_equal(t.nb, 0);
    free(items);
}

static void test_mix64(void **state)
{
    (void)state;
    /* consecutive keys land far apart: every one differs from its neighbour in many bits */
    for (uint64_t k = 0; k < 64; k++)
        assert_true(__builtin_popcountll(ast__mix64(k) ^ ast__mix64(k + 1)) > 8);
    assert_int_equal(ast__mix64(0), 0);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_clock_is_monotonic),
        cmocka_unit_test(test_errorf),
        cmocka_unit_test(test_verrorf_named),
        cmocka_unit_test(test_set_error),
        cmocka_unit_test(test_get_error),
        cmocka_unit_test(test_batch_fail),
        cmocka_unit_test(test_htable),
        cmocka_unit_test(test_mix64),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
