/* test_util.c - the shared internals of src/util.h: clock, error formatting, hash table. */
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <setjmp.h>
#include <cmocka.h>

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
    ast__htable_clear(&t);
    assert_int_equal(t.n, 0);
    assert_null(ast__htable_find(&t, 1));
    ast__htable_free(&t);
    assert_null(t.b);
    assert_int_equal(t.nb, 0);
    free(items);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_clock_is_monotonic),
        cmocka_unit_test(test_errorf),
        cmocka_unit_test(test_verrorf_named),
        cmocka_unit_test(test_htable),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
