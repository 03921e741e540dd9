/* test_config.c - defaults, the key/value setter and its messages, whole-config validation.
 * The optimizer's keys (mode, staleness, install, placement, budgets, nvme_dir, max_failures)
 * are not C's: their checks are in tests/python/test_config.py. */
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <setjmp.h>
#include <cmocka.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "asteria/errors.h"
#include "asteria/runtime.h"

static void test_defaults_match_design(void **state)
{
    (void)state;
    ast_config c;
    ast_config_init(&c);
    assert_int_equal(c.workers, 0);
    assert_string_equal(c.cpuset, "");
    assert_int_equal(c.pin, 1);
    assert_string_equal(c.trace, "");
    assert_int_equal(ast_config_validate(&c, NULL, 0), 0);
}

static void test_set_good_values(void **state)
{
    (void)state;
    ast_config c;
    ast_config_init(&c);
    char err[512];
    assert_int_equal(ast_config_set(&c, "workers", "4", err, sizeof err), 0);
    assert_int_equal(c.workers, 4);
    assert_int_equal(ast_config_set(&c, "cpuset", "0-3", err, sizeof err), 0);
    assert_string_equal(c.cpuset, "0-3");
    assert_int_equal(ast_config_set(&c, "pin", "false", err, sizeof err), 0);
    assert_int_equal(c.pin, 0);
    assert_int_equal(ast_config_set(&c, "pin", "1", err, sizeof err), 0);
    assert_int_equal(c.pin, 1);
    assert_int_equal(ast_config_set(&c, "trace", "/tmp/asteria-test-trace.json", err, sizeof err),
                     0);
    assert_string_equal(c.trace, "/tmp/asteria-test-trace.json");
    assert_int_equal(ast_config_set(&c, "trace", "", err, sizeof err), 0);
    assert_string_equal(c.trace, "");
    assert_int_equal(ast_config_validate(&c, err, sizeof err), 0);
}

/* Each rejection must name the key and the allowed values. */
static void expect_reject(const char *key, const char *value, const char *must_contain)
{
    ast_config c, before;
    ast_config_init(&c);
    before = c;
    char err[512] = "";
    assert_int_equal(ast_config_set(&c, key, value, err, sizeof err), AST_EINVAL);
    assert_non_null(strstr(err, key));
    if (!strstr(err, must_contain))
        fail_msg("'%s'='%s': message \"%s\" lacks \"%s\"", key, value, err, must_contain);
    assert_memory_equal(&c, &before, sizeof c); /* a rejected set changes nothing */
}

static void test_bad_values_name_key_and_allowed(void **state)
{
    (void)state;
    expect_reject("workers", "0", "1..1024");
    expect_reject("workers", "many", "1..1024");
    expect_reject("workers", "2.5", "1..1024");
    expect_reject("workers", "", "1..1024");
    expect_reject("workers", "1025", "1..1024");
    expect_reject("pin", "maybe", "true, false");
    expect_reject("trace", "/", "a file path (this is a directory)");
    expect_reject("trace", "/nonexistent-asteria/dir/trace.json",
                  "in an existing directory this process can write");
    expect_reject("maxfailures", "5", "allowed keys");
}

/* Keys that are not C's are unknown to C: the Python layer keeps them (max_failures too: the
 * optimizer's schedule counts consecutive failures, the runtime does not). */
static void test_optimizer_keys_are_not_c_keys(void **state)
{
    (void)state;
    const char *keys[] = {"mode", "staleness", "install", "placement", "device_budget_bytes",
                          "host_budget_bytes", "nvme_dir", "debug_job_delay_ms", "max_failures",
                          "on_failure"};
    for (size_t i = 0; i < sizeof keys / sizeof keys[0]; i++) {
        expect_reject(keys[i], "1", "unknown runtime key");
        assert_null(strstr(ast_config_keys(), keys[i]));
    }
}

static void test_unknown_key_lists_keys(void **state)
{
    (void)state;
    ast_config c;
    ast_config_init(&c);
    char err[512];
    assert_int_equal(ast_config_set(&c, "colour", "red", err, sizeof err), AST_EINVAL);
    assert_non_null(strstr(err, "'colour'"));
    assert_non_null(strstr(err, ast_config_keys()));
    assert_string_equal(ast_config_keys(), "workers, cpuset, pin, trace");
}

static void test_long_values_rejected(void **state)
{
    (void)state;
    ast_config c;
    ast_config_init(&c);
    char big[AST_PATH_MAX + 10];
    memset(big, 'a', sizeof big - 1);
    big[sizeof big - 1] = '\0';
    char err[256];
    assert_int_equal(ast_config_set(&c, "trace", big, err, sizeof err), AST_EINVAL);
    assert_non_null(strstr(err, "trace"));
    assert_string_equal(c.trace, "");
    assert_int_equal(ast_config_set(&c, "cpuset", big, err, sizeof err), AST_EINVAL);
    assert_non_null(strstr(err, "cpuset"));
    assert_string_equal(c.cpuset, "");
}

/* ast_config_validate applies the setter's rule of each key to a struct filled in by hand. */
static void test_validate_catches_struct_edits(void **state)
{
    (void)state;
    ast_config c;
    ast_config_init(&c);
    char err[256];
    c.workers = 0; /* the struct's "auto" */
    assert_int_equal(ast_config_validate(&c, err, sizeof err), 0);
    c.workers = -3;
    assert_int_equal(ast_config_validate(&c, err, sizeof err), AST_EINVAL);
    assert_non_null(strstr(err, "workers"));
    ast_config_init(&c);
    c.pin = 7;
    assert_int_equal(ast_config_validate(&c, err, sizeof err), AST_EINVAL);
    assert_non_null(strstr(err, "pin"));
    ast_config_init(&c);
    memset(c.cpuset, 'x', sizeof c.cpuset); /* no terminating NUL */
    assert_int_equal(ast_config_validate(&c, err, sizeof err), AST_EINVAL);
    assert_non_null(strstr(err, "cpuset"));
    ast_config_init(&c);
    snprintf(c.trace, sizeof c.trace, "/");
    assert_int_equal(ast_config_validate(&c, err, sizeof err), AST_EINVAL);
    assert_non_null(strstr(err, "trace"));
    assert_non_null(strstr(err, "directory"));
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_defaults_match_design),
        cmocka_unit_test(test_set_good_values),
        cmocka_unit_test(test_bad_values_name_key_and_allowed),
        cmocka_unit_test(test_optimizer_keys_are_not_c_keys),
        cmocka_unit_test(test_unknown_key_lists_keys),
        cmocka_unit_test(test_long_values_rejected),
        cmocka_unit_test(test_validate_catches_struct_edits),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
