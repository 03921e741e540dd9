/*
 * config.c - ast_config defaults, the key/value setter and validation.
 *
 * Owns: the rule of each key that libasteria reads (workers, cpuset, pin, trace) and every
 * message that explains a rejected key or value. A message names the key and the
 * allowed values in the words of asteria.RuntimeConfig ("runtime key 'workers': got ...;
 * allowed: ..."), so the Python layer raises it unchanged. Each key has one check function,
 * used by both ast_config_set (string form) and ast_config_validate (struct form), so the two
 * cannot disagree.
 * May call: libc (stat, access for the trace path). No state and no locks: a config is a plain
 * value owned by its caller.
 */
#include "asteria/runtime.h"

#include "asteria/errors.h"
#include "util.h"

#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#define KEYS "workers, cpuset, pin, trace"
#define WORKERS_MAX 1024
#define WORKERS_ALLOWED \
    "an integer 1..1024 (or None for the cores the training thread does not use)"

void ast_config_init(ast_config *cfg)
{
    memset(cfg, 0, sizeof *cfg);
    cfg->workers = 0;
    cfg->pin = 1;
}

const char *ast_config_keys(void) { return KEYS; }

/* Whole-string integer parse: "12" ok, "12x", "", "1e3" rejected. */
static int parse_i64(const char *s, int64_t *out)
{
    if (!s || !*s)
        return -1;
    char *end = NULL;
    errno = 0;
    long long v = strtoll(s, &end, 10);
    if (errno || *end != '\0')
        return -1;
    *out = v;
    return 0;
}

static int parse_bool(const char *s, int *out)
{
    if (!strcmp(s, "1") || !strcmp(s, "true") || !strcmp(s, "True")) {
        *out = 1;
        return 0;
    }
    if (!strcmp(s, "0") || !strcmp(s, "false") || !strcmp(s, "False")) {
        *out = 0;
        return 0;
    }
    return -1;
}

/* ---- one check per key ------------------------------------------------------------------- */

static int check_string(const char *key, const char *value, size_t cap, char *errbuf, size_t len)
{
    size_t n = strnlen(value, cap);
    if (n >= cap)
        return ast__errorf(errbuf, len, AST_EINVAL,
                           "runtime key '%s': value is %zu bytes or longer; allowed: at most %zu "
                           "bytes", key, n, cap - 1);
    return 0;
}

/* A trace file path: "" (no trace), or a path that is not a directory, whose parent directory
 * exists and can be written (the trace is written there at destroy; better to refuse now than
 * after a whole run). */
static int check_trace(const char *value, char *errbuf, size_t len)
{
    int rc = check_string("trace", value, AST_PATH_MAX, errbuf, len);
    if (rc || !value[0])
        return rc;
    struct stat sb;
    if (stat(value, &sb) == 0 && S_ISDIR(sb.st_mode))
        return ast__errorf(errbuf, len, AST_EINVAL,
                           "runtime key 'trace': got '%s'; allowed: a file path (this is a "
                           "directory)", value);
    char parent[AST_PATH_MAX];
    const char *slash = strrchr(value, '/');
    if (!slash)
        snprintf(parent, sizeof parent, ".");
    else if (slash == value)
        snprintf(parent, sizeof parent, "/");
    else
        snprintf(parent, sizeof parent, "%.*s", (int)(slash - value), value);
    if (stat(parent, &sb) != 0 || !S_ISDIR(sb.st_mode) || access(parent, W_OK | X_OK) != 0)
        return ast__errorf(errbuf, len, AST_EINVAL,
                           "runtime key 'trace': got '%s'; allowed: a file path in an existing "
                           "directory this process can write", value);
    return 0;
}

/* value: the string form that was parsed into v (ast_config_set), or NULL (a struct field). */
static int check_workers(int64_t v, const char *value, char *errbuf, size_t len)
{
    if (value && v >= 1 && v <= WORKERS_MAX)
        return 0;
    if (value)
        return ast__errorf(errbuf, len, AST_EINVAL,
                           "runtime key 'workers': got '%s'; allowed: " WORKERS_ALLOWED, value);
    if (v >= 0 && v <= WORKERS_MAX)
        return 0;
    return ast__errorf(errbuf, len, AST_EINVAL,
                       "runtime key 'workers': got %" PRId64 "; allowed: " WORKERS_ALLOWED
                       ", or 0 in the struct for that default", v);
}

static int check_pin(int v, char *errbuf, size_t len)
{
    if (v != 0 && v != 1)
        return ast__errorf(errbuf, len, AST_EINVAL,
                           "runtime key 'pin': got %d; allowed: true (1), false (0)", v);
    return 0;
}

/* ---- the two entry points ------------------------------------------------------------------ */

int ast_config_set(ast_config *cfg, const char *key, const char *value, char *errbuf, size_t len)
{
    if (!cfg || !key || !value)
        return ast__errorf(errbuf, len, AST_EINVAL, "ast_config_set: NULL argument");
    if (errbuf && len)
        errbuf[0] = '\0';
    int64_t v;
    int rc;
    if (!strcmp(key, "workers")) {
        if (parse_i64(value, &v))
            v = -1;
        if ((rc = check_workers(v, value, errbuf, len)))
            return rc;
        cfg->workers = (int)v;
        return 0;
    }
    if (!strcmp(key, "pin")) {
        int b;
        if (parse_bool(value, &b))
            return ast__errorf(errbuf, len, AST_EINVAL,
                               "runtime key 'pin': got '%s'; allowed: true, false", value);
        cfg->pin = b;
        return 0;
    }
    if (!strcmp(key, "cpuset")) {
        if ((rc = check_string(key, value, sizeof cfg->cpuset, errbuf, len)))
            return rc;
        memcpy(cfg->cpuset, value, strlen(value) + 1);
        return 0;
    }
    if (!strcmp(key, "trace")) {
        if ((rc = check_trace(value, errbuf, len)))
            return rc;
        memcpy(cfg->trace, value, strlen(value) + 1);
        return 0;
    }
    return ast__errorf(errbuf, len, AST_EINVAL, "unknown runtime key '%s'; allowed keys: " KEYS,
                       key);
}

int ast_config_validate(const ast_config *cfg, char *errbuf, size_t len)
{
    if (!cfg)
        return ast__errorf(errbuf, len, AST_EINVAL, "ast_config_validate: NULL config");
    int rc;
    if ((rc = check_workers(cfg->workers, NULL, errbuf, len)) ||
        (rc = check_pin(cfg->pin, errbuf, len)) ||
        (rc = check_string("cpuset", cfg->cpuset, sizeof cfg->cpuset, errbuf, len)))
        return rc;
    return check_trace(cfg->trace, errbuf, len);
}
