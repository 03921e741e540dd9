/*
 * testing.h - test-only entry points of libasteria. Not public API: nothing here is declared in
 * include/asteria/, listed in src/asteria.map or promised to stay. The C tests include it (their
 * include path has src/), and asteria._C binds it under a name that says so
 * (_C._test_set_job_delay), because the Python suite runs against the installed wheel.
 */
#ifndef ASTERIA_TESTING_H
#define ASTERIA_TESTING_H

#include "asteria/runtime.h"

/* Largest delay ast__runtime_set_job_delay takes: ten minutes. */
#define AST__JOB_DELAY_MAX_MS 600000

/* Every job submitted to rt after this call sleeps delay_ms on its worker before computing, to
 * simulate a slow rank or keep a job running while a test forks or signals. Returns 0 on
 * success; AST_EINVAL when rt is NULL or delay_ms is outside 0..AST__JOB_DELAY_MAX_MS. */
int ast__runtime_set_job_delay(ast_runtime *rt, int delay_ms);

#endif
