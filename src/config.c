/*
 * config.c - ast_config defaults, the key/value setter and validation.
 *
 * Owns: the mapping from the Python dict keys of DESIGN.md's "Runtime config" table to the
 * ast_config struct, and every message that explains a rejected key or value (it names the key
 * and the allowed values, so the Python layer can raise it unchanged). The test hook
 * "debug_job_delay_ms" is accepted but left out of ast_config_keys(), which lists the public keys.
 * No state and no locks: a config is a plain value owned by its caller.
 */
#include "asteria/runtime.h"

#include "asteria/errors.h"
#include "asteria/store.h"

#include <errno.h>
#include <inttypes.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define KEYS "mode, staleness, install, workers, cpuset, pin, placement, device_budget_bytes, " \
             "host_budget_bytes, nvme_dir, trace, max_failures"

static const char *const placement_kinds[] = {"factors", "roots", "eigenbases", "moments"};
#define N_PLACEMENT_KINDS (sizeof placement_kinds / sizeof placement_kinds[0])

void ast_config_init(ast_config *cfg)
{
    memset(cfg, 0, sizeof *cfg);
    cfg->mode = AST_MODE_ASYNC;
    cfg->staleness = 5;
    cfg->install = AST_INSTALL_DETERMINISTIC;
    cfg->workers = 0;
    cfg->pin = 1;
    snprintf(cfg->placement, sizeof cfg->placement, "auto");
    cfg->device_budget_bytes = -1;
    cfg->host_budget_bytes = -1;
    cfg->max_failures = 3;
}

const char *ast_config_keys(void) { return KEYS; }

static int fail(char *errbuf, size_t len, const char *fmt, ...)
{
    if (errbuf && len) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(errbuf, len, fmt, ap);
        va_end(ap);
    }
    return AST_EINVAL;
}

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

static int set_path(char *dst, size_t cap, const char *key, const char *value, char *errbuf,
                    size_t len)
{
    size_t n = strlen(value);
    if (n >= cap)
        return fail(errbuf, len, "config key '%s': path is %zu bytes long; allowed: at most %zu",
                    key, n, cap - 1);
    memcpy(dst, value, n + 1);
    return 0;
}

/* "auto" or a comma list kind=tier with kinds from placement_kinds and tier names of store.h. */
static int check_placement(const char *value, char *errbuf, size_t len)
{
    if (!strcmp(value, "auto"))
        return 0;
    char buf[512];
    if (strlen(value) >= sizeof buf)
        return fail(errbuf, len, "config key 'placement': value too long");
    memcpy(buf, value, strlen(value) + 1);
    char *save = NULL;
    int items = 0;
    for (char *tok = strtok_r(buf, ",", &save); tok; tok = strtok_r(NULL, ",", &save)) {
        char *eq = strchr(tok, '=');
        if (!eq)
            return fail(errbuf, len,
                        "config key 'placement': item '%s' is not kind=tier; allowed: \"auto\" or "
                        "kind=tier items with kinds factors, roots, eigenbases, moments and tiers "
                        "device, host_pinned, host, uvm, nvme",
                        tok);
        *eq = '\0';
        int known = 0;
        for (size_t i = 0; i < N_PLACEMENT_KINDS; i++)
            known |= !strcmp(tok, placement_kinds[i]);
        if (!known)
            return fail(errbuf, len,
                        "config key 'placement': unknown state kind '%s'; allowed: factors, roots, "
                        "eigenbases, moments",
                        tok);
        ast_tier t;
        if (ast_tier_parse(eq + 1, &t) != 0)
            return fail(errbuf, len,
                        "config key 'placement': unknown tier '%s' for '%s'; allowed: device, "
                        "host_pinned, host, uvm, nvme",
                        eq + 1, tok);
        items++;
    }
    if (!items)
        return fail(errbuf, len, "config key 'placement': empty; allowed: \"auto\" or kind=tier items");
    return 0;
}

int ast_config_set(ast_config *cfg, const char *key, const char *value, char *errbuf, size_t len)
{
    if (!cfg || !key || !value)
        return fail(errbuf, len, "ast_config_set: NULL argument");
    if (errbuf && len)
        errbuf[0] = '\0';
    int64_t v;
    if (!strcmp(key, "mode")) {
        if (!strcmp(value, "sync"))
            cfg->mode = AST_MODE_SYNC;
        else if (!strcmp(value, "async"))
            cfg->mode = AST_MODE_ASYNC;
        else
            return fail(errbuf, len, "config key 'mode': got '%s'; allowed: \"sync\", \"async\"",
                        value);
        return 0;
    }
    if (!strcmp(key, "install")) {
        if (!strcmp(value, "deterministic"))
            cfg->install = AST_INSTALL_DETERMINISTIC;
        else if (!strcmp(value, "eager"))
            cfg->install = AST_INSTALL_EAGER;
        else
            return fail(errbuf, len,
                        "config key 'install': got '%s'; allowed: \"deterministic\", \"eager\"",
                        value);
        return 0;
    }
    if (!strcmp(key, "staleness")) {
        if (parse_i64(value, &v) || v < 0 || v > 1000000)
            return fail(errbuf, len,
                        "config key 'staleness': got '%s'; allowed: an integer S with 0 <= S <= "
                        "precondition_frequency",
                        value);
        cfg->staleness = (int)v;
        return 0;
    }
    if (!strcmp(key, "workers")) {
        if (parse_i64(value, &v) || v < 0 || v > 1024 || (v == 0 && strcmp(value, "0")))
            return fail(errbuf, len,
                        "config key 'workers': got '%s'; allowed: an integer 1..1024 (or None for "
                        "the cores the training thread does not use)",
                        value);
        if (v == 0)
            return fail(errbuf, len,
                        "config key 'workers': got 0; allowed: an integer 1..1024 (or None for the "
                        "cores the training thread does not use)");
        cfg->workers = (int)v;
        return 0;
    }
    if (!strcmp(key, "max_failures")) {
        if (parse_i64(value, &v) || v < 1 || v > 1000000)
            return fail(errbuf, len, "config key 'max_failures': got '%s'; allowed: an integer >= 1",
                        value);
        cfg->max_failures = (int)v;
        return 0;
    }
    if (!strcmp(key, "debug_job_delay_ms")) {
        if (parse_i64(value, &v) || v < 0 || v > 600000)
            return fail(errbuf, len,
                        "config key 'debug_job_delay_ms': got '%s'; allowed: an integer 0..600000",
                        value);
        cfg->debug_job_delay_ms = (int)v;
        return 0;
    }
    if (!strcmp(key, "pin")) {
        int b;
        if (parse_bool(value, &b))
            return fail(errbuf, len, "config key 'pin': got '%s'; allowed: true, false", value);
        cfg->pin = b;
        return 0;
    }
    if (!strcmp(key, "device_budget_bytes") || !strcmp(key, "host_budget_bytes")) {
        if (parse_i64(value, &v) || v < -1)
            return fail(errbuf, len,
                        "config key '%s': got '%s'; allowed: a byte count >= 0 (or None for no "
                        "budget)",
                        key, value);
        if (key[0] == 'd')
            cfg->device_budget_bytes = v;
        else
            cfg->host_budget_bytes = v;
        return 0;
    }
    if (!strcmp(key, "cpuset"))
        return set_path(cfg->cpuset, sizeof cfg->cpuset, key, value, errbuf, len);
    if (!strcmp(key, "nvme_dir"))
        return set_path(cfg->nvme_dir, sizeof cfg->nvme_dir, key, value, errbuf, len);
    if (!strcmp(key, "trace"))
        return set_path(cfg->trace, sizeof cfg->trace, key, value, errbuf, len);
    if (!strcmp(key, "placement")) {
        int rc = check_placement(value, errbuf, len);
        if (rc)
            return rc;
        return set_path(cfg->placement, sizeof cfg->placement, key, value, errbuf, len);
    }
    return fail(errbuf, len, "unknown config key '%s'; allowed keys: " KEYS, key);
}

int ast_config_validate(const ast_config *cfg, char *errbuf, size_t len)
{
    if (!cfg)
        return fail(errbuf, len, "ast_config_validate: NULL config");
    if (cfg->mode != AST_MODE_SYNC && cfg->mode != AST_MODE_ASYNC)
        return fail(errbuf, len, "config key 'mode': invalid value %d; allowed: sync, async",
                    (int)cfg->mode);
    if (cfg->install != AST_INSTALL_DETERMINISTIC && cfg->install != AST_INSTALL_EAGER)
        return fail(errbuf, len,
                    "config key 'install': invalid value %d; allowed: deterministic, eager",
                    (int)cfg->install);
    if (cfg->staleness < 0)
        return fail(errbuf, len, "config key 'staleness': %d < 0; allowed: 0 <= S <= "
                    "precondition_frequency", cfg->staleness);
    if (cfg->workers < 0 || cfg->workers > 1024)
        return fail(errbuf, len, "config key 'workers': %d; allowed: 1..1024 or 0 for auto",
                    cfg->workers);
    if (cfg->max_failures < 1)
        return fail(errbuf, len, "config key 'max_failures': %d; allowed: >= 1", cfg->max_failures);
    if (cfg->debug_job_delay_ms < 0 || cfg->debug_job_delay_ms > 600000)
        return fail(errbuf, len, "config key 'debug_job_delay_ms': %d; allowed: 0..600000",
                    cfg->debug_job_delay_ms);
    if (cfg->device_budget_bytes < -1 || cfg->host_budget_bytes < -1)
        return fail(errbuf, len, "config budgets: allowed a byte count >= 0 or -1 for none");
    return check_placement(cfg->placement, errbuf, len);
}
