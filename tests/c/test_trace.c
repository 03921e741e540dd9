/* test_trace.c - the event recorder: concurrent recording, Chrome-trace JSON that parses and
 * is in timestamp order, lane metadata, escaping, atomic writes and write errors. */
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <setjmp.h>
#include <cmocka.h>

#include <dirent.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "asteria/errors.h"
#include "asteria/trace.h"
#include "test_helpers.h"

static char tmpdir[1024];
static int have_python = -1;

static int setup(void **state)
{
    (void)state;
    snprintf(tmpdir, sizeof tmpdir, "%s/trace.XXXXXX", test_tmp_root());
    if (!mkdtemp(tmpdir))
        return -1;
    if (have_python < 0) {
        have_python = system("python3 -c pass >/dev/null 2>&1") == 0;
        if (!have_python)
            printf("note: python3 not found; the JSON parse checks are skipped\n");
    }
    return 0;
}

static int teardown(void **state)
{
    (void)state;
    char cmd[1200];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", tmpdir);
    return system(cmd) == 0 ? 0 : -1;
}

/* Runs a Python check on a trace file: 0 pass (or no Python), non-zero fail. */
static int py_check(const char *trace_path, const char *body)
{
    if (!have_python)
        return 0;
    char script[1100];
    snprintf(script, sizeof script, "%s/check.py", tmpdir);
    FILE *f = fopen(script, "w");
    assert_non_null(f);
    fprintf(f, "import json, sys\n"
               "d = json.load(open(sys.argv[1], encoding='utf-8'))\n"
               "ev = d['traceEvents']\n"
               "real = [e for e in ev if e['ph'] != 'M']\n"
               "meta = [e for e in ev if e['ph'] == 'M']\n"
               "%s\n",
            body);
    fclose(f);
    char cmd[2400];
    snprintf(cmd, sizeof cmd, "python3 '%s' '%s'", script, trace_path);
    return system(cmd);
}

/* Entries in tmpdir whose names start with prefix. */
static int count_entries(const char *prefix)
{
    DIR *d = opendir(tmpdir);
    assert_non_null(d);
    int n = 0;
    struct dirent *e;
    while ((e = readdir(d)))
        if (strncmp(e->d_name, prefix, strlen(prefix)) == 0)
            n++;
    closedir(d);
    return n;
}

#define THREADS 8
#define PER_THREAD 5000

typedef struct worker_arg {
    ast_trace *tr;
    int lane;
} worker_arg;

static void *record_many(void *p)
{
    worker_arg *a = p;
    static const char *names[] = {"refresh", "eigh", "inv root", "qr"};
    for (int i = 0; i < PER_THREAD; i++) {
        ast_trace_ev ev = {.kind = AST_TRACE_JOB_RUN, .name = names[i % 4], .lane = a->lane,
                           .ts_ns = ast_trace_now(a->tr), .dur_ns = 10,
                           .args = AST_TRACE_ARG_BLOCK | AST_TRACE_ARG_VERSION | AST_TRACE_ARG_WORKER,
                           .block = (uint64_t)i, .version = 1, .worker = a->lane};
        if (ast_trace_event(a->tr, &ev))
            return (void *)1;
    }
    return NULL;
}

static void test_concurrent_events_all_recorded(void **state)
{
    (void)state;
    ast_trace *tr;
    assert_int_equal(ast_trace_create(&tr), 0);
    pthread_t th[THREADS];
    worker_arg args[THREADS];
    for (int i = 0; i < THREADS; i++) {
        args[i] = (worker_arg){tr, i};
        assert_int_equal(pthread_create(&th[i], NULL, record_many, &args[i]), 0);
    }
    /* A write while recording goes on sees a consistent prefix. */
    char mid[1100];
    snprintf(mid, sizeof mid, "%s/mid.json", tmpdir);
    assert_int_equal(ast_trace_write_json(tr, mid), 0);
    for (int i = 0; i < THREADS; i++) {
        void *r;
        pthread_join(th[i], &r);
        assert_null(r);
    }
    assert_int_equal(ast_trace_count(tr), THREADS * PER_THREAD);
    assert_int_equal(ast_trace_dropped(tr), 0);

    char path[1100];
    snprintf(path, sizeof path, "%s/many.json", tmpdir);
    assert_int_equal(ast_trace_write_json(tr, path), 0);
    assert_int_equal(py_check(path, "assert len(real) == 40000, len(real)\n"
                                    "ts = [e['ts'] for e in real]\n"
                                    "assert ts == sorted(ts)\n"
                                    "for w in range(8):\n"
                                    "    assert sum(1 for e in real if e['tid'] == 1000 + w) == 5000\n"
                                    "    assert any(m['name'] == 'thread_name' and "
                                    "m['args']['name'] == 'worker %d' % w for m in meta)\n"
                                    "assert {e['name'] for e in real} == "
                                    "{'refresh', 'eigh', 'inv root', 'qr'}\n"
                                    "assert all(e['ph'] == 'X' and e['cat'] == 'job' for e in real)\n"),
                     0);
    assert_int_equal(py_check(mid, "pass"), 0);
    ast_trace_destroy(tr);
}

static void test_job_events_in_timestamp_order(void **state)
{
    (void)state;
    ast_trace *tr;
    assert_int_equal(ast_trace_create(&tr), 0);
    unsigned a = AST_TRACE_ARG_BLOCK | AST_TRACE_ARG_VERSION | AST_TRACE_ARG_WORKER;
    /* Recorded out of order, as separate threads would publish them. */
    ast_trace_ev done = {.kind = AST_TRACE_JOB_DONE, .lane = 3, .ts_ns = 3000, .args = a | AST_TRACE_ARG_STATUS,
                         .block = 42, .version = 7, .worker = 3, .status = 0};
    ast_trace_ev run = {.kind = AST_TRACE_JOB_RUN, .lane = 3, .ts_ns = 2000, .dur_ns = 1000,
                        .args = a, .block = 42, .version = 7, .worker = 3};
    ast_trace_ev started = {.kind = AST_TRACE_JOB_STARTED, .lane = 3, .ts_ns = 2000, .args = a,
                            .block = 42, .version = 7, .worker = 3};
    ast_trace_ev queued = {.kind = AST_TRACE_JOB_QUEUED, .lane = AST_TRACE_LANE_TRAIN,
                           .ts_ns = 1000, .args = a, .block = 42, .version = 7, .worker = -1};
    ast_trace_ev copy = {.kind = AST_TRACE_COPY, .lane = AST_TRACE_LANE_SHADOW, .ts_ns = 500,
                         .dur_ns = 250, .args = AST_TRACE_ARG_BYTES | AST_TRACE_ARG_BLOCK,
                         .bytes = 4096, .block = 42, .dir = AST_TRACE_DIR_D2H};
    assert_int_equal(ast_trace_event(tr, &done), 0);
    assert_int_equal(ast_trace_event(tr, &run), 0);
    assert_int_equal(ast_trace_event(tr, &started), 0);
    assert_int_equal(ast_trace_event(tr, &queued), 0);
    assert_int_equal(ast_trace_event(tr, &copy), 0);
    assert_int_equal(ast_trace_instant(tr, AST_TRACE_LANE_TRAIN, "install", "install", 3500), 0);
    assert_int_equal(ast_trace_count(tr), 6);

    char path[1100];
    snprintf(path, sizeof path, "%s/job.json", tmpdir);
    assert_int_equal(ast_trace_write_json(tr, path), 0);
    char *s = slurp(path);
    assert_non_null(s);
    char *q = strstr(s, "\"job queued\""), *st = strstr(s, "\"job started\""),
         *dn = strstr(s, "\"job done\"");
    assert_non_null(q);
    assert_non_null(st);
    assert_non_null(dn);
    assert_true(q < st && st < dn);
    assert_non_null(strstr(s, "\"ts\":1.000"));
    assert_non_null(strstr(s, "\"dur\":0.250"));
    assert_non_null(strstr(s, "\"dir\":\"d2h\""));
    assert_non_null(strstr(s, "\"status\":\"AST_OK\""));
    free(s);
    assert_int_equal(
        py_check(path,
                 "job = [e for e in real if e['cat'] == 'job' and e['args'].get('block') == 42]\n"
                 "q = next(e['ts'] for e in job if e['name'] == 'job queued')\n"
                 "s = next(e['ts'] for e in job if e['name'] == 'job started')\n"
                 "d = next(e['ts'] for e in job if e['name'] == 'job done')\n"
                 "assert q < s < d, (q, s, d)\n"
                 "r = next(e for e in job if e['name'] == 'refresh')\n"
                 "assert r['ph'] == 'X' and r['ts'] == s and r['ts'] + r['dur'] == d\n"
                 "assert r['args'] == {'block': 42, 'version': 7, 'worker': 3}\n"
                 "ts = [e['ts'] for e in real]\n"
                 "assert ts == sorted(ts)\n"
                 "names = {m['tid']: m['args']['name'] for m in meta if m['name'] == 'thread_name'}\n"
                 "assert names == {1: 'train', 2: 'shadow stream', 1003: 'worker 3'}, names\n"
                 "assert any(m['name'] == 'process_name' for m in meta)\n"
                 "c = next(e for e in real if e['cat'] == 'copy')\n"
                 "assert c['args'] == {'block': 42, 'bytes': 4096, 'dir': 'd2h'}\n"
                 "assert all(e['s'] == 't' for e in real if e['ph'] == 'i')\n"),
        0);
    ast_trace_destroy(tr);
}

static void test_names_are_escaped(void **state)
{
    (void)state;
    ast_trace *tr;
    assert_int_equal(ast_trace_create(&tr), 0);
    const char *nasty = "say \"hi\" \\ back\nline\x01 caf\xc3\xa9 bad\xff end";
    assert_int_equal(ast_trace_instant(tr, 0, "cat \"q\"", nasty, 10), 0);
    assert_int_equal(ast_trace_name_lane(tr, 0, "lane \"zero\""), 0);
    assert_int_equal(ast_trace_name_lane(tr, -7, "nvme\tqueue"), 0);
    char path[1100];
    snprintf(path, sizeof path, "%s/esc.json", tmpdir);
    assert_int_equal(ast_trace_write_json(tr, path), 0);
    char *s = slurp(path);
    assert_non_null(strstr(s, "\"say \\\"hi\\\" \\\\ back\\nline\\u0001 caf\xc3\xa9 bad\\ufffd end\""));
    free(s);
    assert_int_equal(
        py_check(path,
                 "assert real[0]['name'] == 'say \"hi\" \\\\ back\\nline\\x01 caf\\u00e9 bad\\ufffd end'\n"
                 "assert real[0]['cat'] == 'cat \"q\"'\n"
                 "names = {m['tid']: m['args']['name'] for m in meta if m['name'] == 'thread_name'}\n"
                 "assert names == {1000: 'lane \"zero\"', 7: 'nvme\\tqueue'}, names\n"),
        0);
    ast_trace_destroy(tr);
}

static void test_unwritable_path_reports_and_leaves_nothing(void **state)
{
    (void)state;
    ast_trace *tr;
    char msg[1024];
    assert_int_equal(ast_trace_create(&tr), 0);
    assert_int_equal(ast_trace_instant(tr, AST_TRACE_LANE_TRAIN, NULL, "x", 1), 0);

    char path[1100];
    snprintf(path, sizeof path, "%s/no/such/dir/t.json", tmpdir);
    assert_int_equal(ast_trace_write_json(tr, path), AST_ENOENT);
    assert_int_equal(ast_trace_last_error(tr, msg, sizeof msg), 0);
    assert_non_null(strstr(msg, "AST_ENOENT"));
    assert_non_null(strstr(msg, path));

    /* The path is a directory: formatting succeeds, rename fails, the temp file goes. */
    snprintf(path, sizeof path, "%s/adir", tmpdir);
    assert_int_equal(mkdir(path, 0777), 0);
    assert_int_equal(ast_trace_write_json(tr, path), AST_EIO);
    assert_int_equal(ast_trace_last_error(tr, msg, sizeof msg), 0);
    assert_non_null(strstr(msg, "rename"));
    assert_int_equal(count_entries("adir"), 1);

    /* A read-only directory (permissions do not bind root, so only checked as a user). */
    char ro[1050];
    snprintf(ro, sizeof ro, "%s/ro", tmpdir);
    assert_int_equal(mkdir(ro, 0555), 0);
    snprintf(path, sizeof path, "%s/t.json", ro);
    if (geteuid() != 0) {
        assert_int_equal(ast_trace_write_json(tr, path), AST_EACCES);
        assert_int_equal(ast_trace_last_error(tr, msg, sizeof msg), 0);
        assert_non_null(strstr(msg, path));
        DIR *d = opendir(ro);
        struct dirent *e;
        int n = 0;
        while ((e = readdir(d)))
            n += e->d_name[0] != '.';
        closedir(d);
        assert_int_equal(n, 0);
    } else {
        printf("note: running as root; the read-only directory case is skipped\n");
    }
    chmod(ro, 0755);

    assert_int_equal(ast_trace_write_json(tr, ""), AST_EINVAL);
    assert_int_equal(ast_trace_write_json(tr, NULL), AST_EINVAL);
    ast_trace_destroy(tr);
}

static void test_rewrite_replaces_whole_file(void **state)
{
    (void)state;
    ast_trace *tr;
    assert_int_equal(ast_trace_create(&tr), 0);
    char path[1100];
    snprintf(path, sizeof path, "%s/re.json", tmpdir);
    FILE *f = fopen(path, "w");
    fputs("old content that is not JSON and is rather long ...........................", f);
    fclose(f);
    assert_int_equal(ast_trace_complete(tr, AST_TRACE_LANE_SHADOW, "copy", "snap", 5, 5), 0);
    assert_int_equal(ast_trace_write_json(tr, path), 0);
    char *s = slurp(path);
    assert_null(strstr(s, "old content"));
    assert_int_equal(s[0], '{');
    free(s);
    assert_int_equal(count_entries("re.json"), 1);
    assert_int_equal(py_check(path, "assert len(real) == 1 and real[0]['name'] == 'snap'\n"), 0);
    ast_trace_destroy(tr);
}

static void test_bad_arguments_and_limits(void **state)
{
    (void)state;
    ast_trace *tr;
    assert_int_equal(ast_trace_create(NULL), AST_EINVAL);
    assert_int_equal(ast_trace_create(&tr), 0);
    ast_trace_ev ev = {.kind = AST_TRACE_CUSTOM_INSTANT, .lane = 0};
    assert_int_equal(ast_trace_event(tr, &ev), AST_EINVAL); /* custom kinds need a name */
    ev.name = "x";
    ev.lane = AST_TRACE_LANE_MIN - 1;
    assert_int_equal(ast_trace_event(tr, &ev), AST_EINVAL);
    ev.lane = 0;
    ev.kind = AST_TRACE_KIND_COUNT;
    assert_int_equal(ast_trace_event(tr, &ev), AST_EINVAL);
    char *big = malloc(2000);
    memset(big, 'a', 1999);
    big[1999] = '\0';
    assert_int_equal(ast_trace_instant(tr, 0, NULL, big, 0), AST_EINVAL);
    free(big);
    assert_int_equal(ast_trace_count(tr), 0);

    ast_trace_set_max_events(tr, 3);
    for (int i = 0; i < 5; i++)
        assert_int_equal(ast_trace_instant(tr, 0, NULL, "e", (uint64_t)i), i < 3 ? 0 : AST_ENOSPC);
    assert_int_equal(ast_trace_count(tr), 3);
    assert_int_equal(ast_trace_dropped(tr), 2);

    uint64_t a = ast_trace_now(tr);
    uint64_t b = ast_trace_now(tr);
    assert_true(b >= a);
    assert_int_equal(ast_trace_from_monotonic(tr, 1), 0);
    ast_trace_destroy(tr);
    ast_trace_destroy(NULL);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(test_concurrent_events_all_recorded, setup, teardown),
        cmocka_unit_test_setup_teardown(test_job_events_in_timestamp_order, setup, teardown),
        cmocka_unit_test_setup_teardown(test_names_are_escaped, setup, teardown),
        cmocka_unit_test_setup_teardown(test_unwritable_path_reports_and_leaves_nothing, setup,
                                        teardown),
        cmocka_unit_test_setup_teardown(test_rewrite_replaces_whole_file, setup, teardown),
        cmocka_unit_test_setup_teardown(test_bad_arguments_and_limits, setup, teardown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
