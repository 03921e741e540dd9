/* test_errors.c - the AST_E* table: names, messages, errno mapping. */
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <setjmp.h>
#include <cmocka.h>

#include <errno.h>
#include <string.h>

#include "asteria/errors.h"

static void test_every_code_has_name_and_message(void **state)
{
    (void)state;
    int seen = 0;
#define CHECK(name, val, msg)                                                       \
    assert_string_equal(ast_err_name(val), "AST_" #name);                          \
    assert_string_equal(ast_strerror(val), msg);                                    \
    assert_int_equal(AST_##name, val);                                              \
    seen++;
    AST_ERRNO_MAP(CHECK)
#undef CHECK
    assert_int_equal(seen, -(AST__ERR_MIN + 1));
    assert_string_equal(ast_err_name(0), "AST_OK");
    assert_string_equal(ast_strerror(0), "success");
}

static void test_unknown_codes(void **state)
{
    (void)state;
    assert_string_equal(ast_err_name(-999), "AST_EUNKNOWN");
    assert_string_equal(ast_strerror(12345), "unknown error");
}

static void test_codes_are_distinct(void **state)
{
    (void)state;
    int codes[] = {
#define LIST(name, val, msg) val,
        AST_ERRNO_MAP(LIST)
#undef LIST
    };
    size_t n = sizeof codes / sizeof codes[0];
    for (size_t i = 0; i < n; i++)
        for (size_t j = i + 1; j < n; j++)
            assert_int_not_equal(codes[i], codes[j]);
}

static void test_errno_mapping(void **state)
{
    (void)state;
    assert_int_equal(ast_err_from_errno(0), AST_OK);
    assert_int_equal(ast_err_from_errno(ENOSPC), AST_ENOSPC);
    assert_int_equal(ast_err_from_errno(EROFS), AST_EACCES);
    assert_int_equal(ast_err_from_errno(EACCES), AST_EACCES);
    assert_int_equal(ast_err_from_errno(ENOENT), AST_ENOENT);
    assert_int_equal(ast_err_from_errno(ENOMEM), AST_ENOMEM);
    assert_int_equal(ast_err_from_errno(EINVAL), AST_EINVAL);
    assert_int_equal(ast_err_from_errno(EIO), AST_EIO);
    assert_int_equal(ast_err_from_errno(EXDEV), AST_EIO);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_every_code_has_name_and_message),
        cmocka_unit_test(test_unknown_codes),
        cmocka_unit_test(test_codes_are_distinct),
        cmocka_unit_test(test_errno_mapping),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
