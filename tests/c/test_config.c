/* test_config.c - defaults, the key/value setter and its messages, whole-config validation. */
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <setjmp.h>
#include <cmocka.h>

#include <string.h>

#include "asteria/errors.h"
#include "asteria/runtime.h"

static void test_defaults_match_design(void **state)
{
    (void)state;
    ast_config c;
    ast_config_init(&c);
    assert_int_equal(c.mode, AST_MODE_ASYNC);
    assert_int_equal(c.staleness, 5);
    assert_int_equal(c.install, AST_INSTALL_DETERMINISTIC);
    assert_int_equal(c.workers, 0);
    assert_string_equal(c.placement, "auto");
    assert_true(c.device_budget_bytes == -1);
    assert_string_equal(c.nvme_dir, "");
    assert_string_equal(c.trace, "");
    assert_int_equal(ast_config_validate(&c, NULL, 0), 0);
}

static void test_set_good_values(void **state)
{
    (void)state;
    ast_config c;
    ast_config_init(&c);
    char err[512];
    assert_int_equal(ast_config_set(&c, "mode", "sync", err, sizeof err), 0);
    assert_int_equal(c.mode, AST_MODE_SYNC);
    assert_int_equal(ast_config_set(&c, "install", "eager", err, sizeof err), 0);
    assert_int_equal(c.install, AST_INSTALL_EAGER);
    assert_int_equal(ast_config_set(&c, "staleness", "0", err, sizeof err), 0);
    assert_int_equal(c.staleness, 0);
    assert_int_equal(ast_config_set(&c, "workers", "4", err, sizeof err), 0);
    assert_int_equal(c.workers, 4);
    assert_int_equal(ast_config_set(&c, "device_budget_bytes", "1048576", err, sizeof err), 0);
    assert_true(c.device_budget_bytes == 1048576);
    assert_int_equal(ast_config_set(&c, "placement", "factors=device,roots=host_pinned", err,
                                    sizeof err), 0);
    assert_string_equal(c.placement, "factors=device,roots=host_pinned");
    assert_int_equal(ast_config_set(&c, "nvme_dir", "/tmp/x", err, sizeof err), 0);
    assert_string_equal(c.nvme_dir, "/tmp/x");
    assert_int_equal(ast_config_set(&c, "pin", "false", err, sizeof err), 0);
    assert_int_equal(c.pin, 0);
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
    assert_non_null(strstr(err, must_contain));
    assert_memory_equal(&c, &before, sizeof c); /* a rejected set changes nothing */
}

static void test_bad_values_name_key_and_allowed(void **state)
{
    (void)state;
    expect_reject("mode", "fast", "\"sync\", \"async\"");
    expect_reject("install", "lazy", "\"deterministic\", \"eager\"");
    expect_reject("staleness", "-1", "0 <= S");
    expect_reject("staleness", "2.5", "0 <= S");
    expect_reject("staleness", "", "0 <= S");
    expect_reject("workers", "0", "1..1024");
    expect_reject("workers", "many", "1..1024");
    expect_reject("device_budget_bytes", "-5", ">= 0");
    expect_reject("placement", "roots=gpu", "host_pinned");
    expect_reject("placement", "weights=host", "factors");
    expect_reject("placement", "nonsense", "kind=tier");
    expect_reject("pin", "maybe", "true, false");
    expect_reject("max_failures", "0", ">= 1");
    expect_reject("stalenes", "5", "allowed keys");
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
}

static void test_long_path_rejected(void **state)
{
    (void)state;
    ast_config c;
    ast_config_init(&c);
    char big[AST_PATH_MAX + 10];
    memset(big, 'a', sizeof big - 1);
    big[sizeof big - 1] = '\0';
    char err[256];
    assert_int_equal(ast_config_set(&c, "nvme_dir", big, err, sizeof err), AST_EINVAL);
    assert_non_null(strstr(err, "nvme_dir"));
    assert_string_equal(c.nvme_dir, "");
}

static void test_validate_catches_struct_edits(void **state)
{
    (void)state;
    ast_config c;
    ast_config_init(&c);
    char err[256];
    c.staleness = -3;
    assert_int_equal(ast_config_validate(&c, err, sizeof err), AST_EINVAL);
    assert_non_null(strstr(err, "staleness"));
    ast_config_init(&c);
    c.mode = (ast_mode)7;
    assert_int_equal(ast_config_validate(&c, err, sizeof err), AST_EINVAL);
    assert_non_null(strstr(err, "mode"));
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_defaults_match_design),
        cmocka_unit_test(test_set_good_values),
        cmocka_unit_test(test_bad_values_name_key_and_allowed),
        cmocka_unit_test(test_unknown_key_lists_keys),
        cmocka_unit_test(test_long_path_rejected),
        cmocka_unit_test(test_validate_catches_struct_edits),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
