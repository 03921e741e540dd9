/*
 * bench_linalg.c - blocks per second of the REFRESH kernels (eigh, inverse 4th root, SOAP's QR
 * refresh), each measured three ways in the same run so that the ratios do not depend on how
 * the machine drifts between runs:
 *   bare   the ast_linalg_* call in a loop on the main thread (one OpenBLAS thread),
 *   pool1  the same jobs through an ast_pool with 1 worker,
 *   pool2  ... with 2 workers.
 * Pools are created with an explicit cpuset of every core this process may run on (the default
 * set leaves out the caller's core, which on a 2-core machine leaves one) and pin = 1; the main
 * thread sleeps in ast_pool_wait_any while the workers run. Every job has its own input and
 * output buffers and its own block id, so nothing is superseded and no two workers share a
 * cache line.
 *
 * The machine is shared and noisy, so the three ways are interleaved: each (op, n) runs
 * --rounds rounds of bare, pool1, pool2 back to back, and reports the median over rounds of the
 * blocks per second and of the per-round ratios (adjacent in time, so a burst of foreign load
 * skews one round, not the result). Jobs per round come from one timed warm-up call so that
 * the bare work of all rounds lasts about --budget seconds (at least 2 per round, one per
 * worker of pool2; at most MAX_JOBS_ROUND). The load average before and after goes to the JSON.
 *
 * Writes JSON (machine, versions, command line, timestamp, per op and size: blocks_per_s for
 * bare/pool1/pool2 and the ratios pool2/pool1, pool1/bare) and prints a table.
 *
 * Usage: bench_linalg [--dtype f32|f64] [--sizes 256,512,1024,2048] [--budget SECONDS]
 *                     [--rounds R] [--quick] [--out PATH]
 * Default: float32 (the training dtype), the four sizes, budget 3 s, 3 rounds: about 2.5
 * minutes on 2 cores. --quick: n = 64, 128 with a tiny budget, a smoke test.
 */
#include "asteria/build_config.h"
#include "asteria/errors.h"
#include "asteria/linalg.h"
#include "asteria/pool.h"

#include <cblas.h>
#include <errno.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/utsname.h>
#include <time.h>
#include <unistd.h>

#define MAX_SIZES 16
#define MAX_ROUNDS 15
#define MIN_JOBS_ROUND 2
#define MAX_JOBS_ROUND 128
#define ROOT_P 4        /* Shampoo's -1/(2*order) for a matrix */
#define ROOT_EPS 1e-12  /* Shampoo's default epsilon */

typedef enum op { OP_EIGH, OP_ROOT, OP_SOAP, OP_COUNT } op;
static const char *const op_names[OP_COUNT] = {"eigh", "inv_root", "soap_refresh"};

typedef enum mode { M_BARE, M_POOL1, M_POOL2, M_COUNT } mode;
static const char *const mode_names[M_COUNT] = {"bare", "pool1", "pool2"};

typedef struct job_ctx {
    op kind;
    ast_dtype dt;
    int n;
    void *a, *q, *out, *vec;
    int64_t *perm;
} job_ctx;

typedef struct measure {
    double seconds, blocks_per_s;
    double utilisation; /* worker busy time / (wall time * workers) */
    double foreign;     /* CPU share used by other processes (and hypervisor steal) meanwhile */
} measure;

typedef struct result {
    op kind;
    int n, jobs_per_round, rounds;
    double warmup_s;
    measure m[M_COUNT][MAX_ROUNDS];
} result;

static double median(double *v, int k)
{
    for (int i = 1; i < k; i++)
        for (int j = i; j > 0 && v[j - 1] > v[j]; j--) {
            double t = v[j];
            v[j] = v[j - 1];
            v[j - 1] = t;
        }
    return k % 2 ? v[k / 2] : 0.5 * (v[k / 2 - 1] + v[k / 2]);
}

/* Median over rounds of mode m's blocks per second, or with den >= 0 of the ratio m / den. */
static double summary(const result *r, mode m, int den)
{
    double v[MAX_ROUNDS];
    for (int i = 0; i < r->rounds; i++)
        v[i] = r->m[m][i].blocks_per_s / (den >= 0 ? r->m[den][i].blocks_per_s : 1);
    return median(v, r->rounds);
}

/* The worst foreign CPU share seen in any round of any way: how far to trust this row. */
static double max_foreign(const result *r)
{
    double x = 0;
    for (int m = 0; m < M_COUNT; m++)
        for (int i = 0; i < r->rounds; i++)
            x = r->m[m][i].foreign > x ? r->m[m][i].foreign : x;
    return x;
}

static double median_utilisation(const result *r, mode m)
{
    double v[MAX_ROUNDS];
    for (int i = 0; i < r->rounds; i++)
        v[i] = r->m[m][i].utilisation;
    return median(v, r->rounds);
}

static double now_s(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

static void die(const char *what, int rc)
{
    fprintf(stderr, "bench_linalg: %s: %s (%s)\n", what, ast_strerror(rc), ast_err_name(rc));
    exit(1);
}

static void *xmalloc(size_t bytes)
{
    void *p = malloc(bytes);
    if (!p) {
        fprintf(stderr, "bench_linalg: out of memory (%zu bytes)\n", bytes);
        exit(1);
    }
    return p;
}

static int run_job(void *arg)
{
    const job_ctx *c = arg;
    switch (c->kind) {
    case OP_EIGH:
        return ast_linalg_eigh(c->dt, c->n, c->a, c->vec, c->out);
    case OP_ROOT:
        return ast_linalg_inv_root(c->dt, c->n, c->a, ROOT_P, ROOT_EPS, c->out);
    case OP_SOAP:
        return ast_linalg_soap_refresh(c->dt, c->n, c->a, c->q, c->out, c->perm);
    case OP_COUNT:
        break;
    }
    return AST_EINVAL;
}

/* ---- inputs ----------------------------------------------------------------------------- */

typedef struct inputs {
    void *spd;   /* G G^T / n + I: a well-conditioned factor */
    void *basis; /* an orthogonal matrix: qr(G).Q */
} inputs;

/* src (count float64 values) in dtype dt at dst (float32 values rounded). */
static void store_as(ast_dtype dt, void *dst, const double *src, size_t count)
{
    for (size_t i = 0; i < count; i++) {
        if (dt == AST_F32)
            ((float *)dst)[i] = (float)src[i];
        else
            ((double *)dst)[i] = src[i];
    }
}

/* Built in float64, then stored in dt: one path for both dtypes. */
static void make_inputs(ast_dtype dt, int n, inputs *in)
{
    const size_t nn = (size_t)n * n, es = ast_dtype_size(dt);
    double *g = xmalloc(nn * sizeof *g), *a = xmalloc(nn * sizeof *a), *e = xmalloc(nn * sizeof *e);
    void *gd = xmalloc(nn * es), *id = xmalloc(nn * es);
    in->spd = xmalloc(nn * es);
    in->basis = xmalloc(nn * es);
    uint64_t s = 0x2545F4914F6CDD1DULL;
    for (size_t i = 0; i < nn; i++) {
        s ^= s << 13, s ^= s >> 7, s ^= s << 17;
        g[i] = (double)(s >> 11) * 0x1p-53 - 0.5;
    }
    memset(e, 0, nn * sizeof *e);
    cblas_dsyrk(CblasRowMajor, CblasUpper, CblasNoTrans, n, n, 1.0 / n, g, n, 0, a, n);
    for (int i = 0; i < n; i++) {
        a[(size_t)i * n + i] += 1;
        e[(size_t)i * n + i] = 1;
        for (int j = 0; j < i; j++)
            a[(size_t)i * n + j] = a[(size_t)j * n + i];
    }
    store_as(dt, gd, g, nn);
    store_as(dt, in->spd, a, nn);
    store_as(dt, id, e, nn);
    int rc = ast_linalg_qr_refresh(dt, n, id, gd, in->basis);
    if (rc)
        die("building the orthogonal basis", rc);
    free(g);
    free(a);
    free(e);
    free(gd);
    free(id);
}

static job_ctx *make_jobs(op kind, ast_dtype dt, int n, const inputs *in, int jobs)
{
    const size_t nn = (size_t)n * n, es = ast_dtype_size(dt);
    job_ctx *c = xmalloc((size_t)jobs * sizeof *c);
    for (int j = 0; j < jobs; j++) {
        c[j] = (job_ctx){.kind = kind, .dt = dt, .n = n};
        c[j].a = xmalloc(nn * es);
        memcpy(c[j].a, in->spd, nn * es);
        c[j].out = xmalloc(nn * es);
        memset(c[j].out, 0, nn * es); /* fault the pages in before timing */
        if (kind == OP_EIGH)
            c[j].vec = xmalloc((size_t)n * es);
        if (kind == OP_SOAP) {
            c[j].q = xmalloc(nn * es);
            memcpy(c[j].q, in->basis, nn * es);
            c[j].perm = xmalloc((size_t)n * sizeof(int64_t));
        }
    }
    return c;
}

static void free_jobs(job_ctx *c, int jobs)
{
    for (int j = 0; j < jobs; j++) {
        free(c[j].a);
        free(c[j].q);
        free(c[j].out);
        free(c[j].vec);
        free(c[j].perm);
    }
    free(c);
}

/* ---- measurements ------------------------------------------------------------------------- */

/* What the whole machine and this process spent, to tell foreign load from our own. */
typedef struct cpu_sample {
    double wall, own, busy; /* seconds; busy: all CPUs, non-idle incl. steal, from /proc/stat */
} cpu_sample;

static cpu_sample cpu_now(void)
{
    cpu_sample c = {.wall = now_s()};
    struct rusage ru;
    if (getrusage(RUSAGE_SELF, &ru) == 0)
        c.own = (double)ru.ru_utime.tv_sec + 1e-6 * (double)ru.ru_utime.tv_usec +
                (double)ru.ru_stime.tv_sec + 1e-6 * (double)ru.ru_stime.tv_usec;
    FILE *f = fopen("/proc/stat", "r");
    unsigned long long v[8] = {0};
    if (f) {
        if (fscanf(f, "cpu %llu %llu %llu %llu %llu %llu %llu %llu", &v[0], &v[1], &v[2], &v[3],
                   &v[4], &v[5], &v[6], &v[7]) == 8)
            c.busy = (double)(v[0] + v[1] + v[2] + v[5] + v[6] + v[7]) /
                     (double)sysconf(_SC_CLK_TCK);
        fclose(f);
    }
    return c;
}

static double foreign_share(cpu_sample a, cpu_sample b)
{
    double x = ((b.busy - a.busy) - (b.own - a.own)) /
               ((b.wall - a.wall) * (double)sysconf(_SC_NPROCESSORS_ONLN));
    return x > 0 ? x : 0;
}

static measure run_bare(job_ctx *c, int jobs)
{
    cpu_sample c0 = cpu_now();
    for (int j = 0; j < jobs; j++) {
        int rc = run_job(&c[j]);
        if (rc)
            die(op_names[c[j].kind], rc);
    }
    cpu_sample c1 = cpu_now();
    double dt = c1.wall - c0.wall;
    return (measure){.seconds = dt,
                     .blocks_per_s = jobs / dt,
                     .utilisation = 1,
                     .foreign = foreign_share(c0, c1)};
}

static uint64_t next_block = 1;

/* Submits jobs [first, first+count) and sleeps in ast_pool_wait_any until all completed. */
static void pool_round(ast_pool *pool, job_ctx *c, int first, int count)
{
    for (int j = first; j < first + count; j++) {
        ast_job job = {.block = next_block++, .version = 1, .deadline = j, .run = run_job,
                       .ctx = &c[j]};
        uint64_t ticket;
        int rc = ast_pool_submit(pool, &job, &ticket);
        if (rc)
            die("ast_pool_submit", rc);
    }
    ast_completion done[64];
    for (int left = count; left > 0;) {
        size_t got = 0;
        int rc = ast_pool_wait_any(pool, -1, done, 64, &got);
        if (rc)
            die("ast_pool_wait_any", rc);
        for (size_t i = 0; i < got; i++)
            if (done[i].status)
                die("pool job", done[i].status);
        left -= (int)got;
    }
}

static measure run_pool(ast_pool *pool, int workers, job_ctx *c, int jobs)
{
    ast_pool_stats s0, s1;
    ast_pool_stats_get(pool, &s0);
    cpu_sample c0 = cpu_now();
    pool_round(pool, c, 0, jobs);
    cpu_sample c1 = cpu_now();
    ast_pool_stats_get(pool, &s1);
    double dt = c1.wall - c0.wall;
    return (measure){.seconds = dt,
                     .blocks_per_s = jobs / dt,
                     .utilisation = (double)(s1.busy_ns - s0.busy_ns) * 1e-9 / (dt * workers),
                     .foreign = foreign_share(c0, c1)};
}

/* ---- machine description ---------------------------------------------------------------- */

/* The CPUs this process may run on as an hwloc list ("0-1", "0,2-3"); returns their count. */
static int allowed_cpus(char *buf, size_t len)
{
    cpu_set_t set;
    CPU_ZERO(&set);
    if (sched_getaffinity(0, sizeof set, &set) != 0) {
        snprintf(buf, len, "0");
        return 1;
    }
    size_t off = 0;
    int count = 0;
    buf[0] = '\0';
    for (int c = 0; c < CPU_SETSIZE; c++) {
        if (!CPU_ISSET(c, &set))
            continue;
        int e = c;
        while (e + 1 < CPU_SETSIZE && CPU_ISSET(e + 1, &set))
            e++;
        off += (size_t)snprintf(buf + off, off < len ? len - off : 0, "%s%d", off ? "," : "", c);
        if (e > c)
            off += (size_t)snprintf(buf + off, off < len ? len - off : 0, "-%d", e);
        count += e - c + 1;
        c = e;
    }
    return count;
}

static void cpu_model(char *buf, size_t len)
{
    snprintf(buf, len, "unknown");
    FILE *f = fopen("/proc/cpuinfo", "r");
    if (!f)
        return;
    char line[512];
    while (fgets(line, sizeof line, f)) {
        char *colon = strchr(line, ':');
        if (strncmp(line, "model name", 10) == 0 && colon) {
            colon++;
            while (*colon == ' ' || *colon == '\t')
                colon++;
            colon[strcspn(colon, "\n")] = '\0';
            snprintf(buf, len, "%s", colon);
            break;
        }
    }
    fclose(f);
}

static void json_str(FILE *f, const char *s)
{
    fputc('"', f);
    for (; *s; s++) {
        unsigned char ch = (unsigned char)*s;
        if (ch == '"' || ch == '\\')
            fprintf(f, "\\%c", ch);
        else if (ch < 0x20)
            fprintf(f, "\\u%04x", ch);
        else
            fputc(ch, f);
    }
    fputc('"', f);
}

static void mkdir_parent(const char *path)
{
    char dir[4096];
    snprintf(dir, sizeof dir, "%s", path);
    for (char *p = dir + 1; *p; p++) {
        if (*p != '/')
            continue;
        *p = '\0';
        if (mkdir(dir, 0777) != 0 && errno != EEXIST)
            return;
        *p = '/';
    }
}

/* Other processes on the machine skew every number; the load average says whether they did. */
static double load1(void)
{
    double l[1];
    return getloadavg(l, 1) == 1 ? l[0] : -1;
}

static void write_json(const char *path, int argc, char **argv, ast_dtype dt, double budget,
                       const char *cpus, const char *pool_sets[M_COUNT], const double load[2],
                       const result *r, int nr)
{
    mkdir_parent(path);
    FILE *f = fopen(path, "w");
    if (!f) {
        fprintf(stderr, "bench_linalg: cannot write %s: %s\n", path, strerror(errno));
        exit(1);
    }
    struct utsname u;
    uname(&u);
    char model[256], stamp[64], cmd[4096] = "";
    cpu_model(model, sizeof model);
    time_t t = time(NULL);
    struct tm tm;
    gmtime_r(&t, &tm);
    strftime(stamp, sizeof stamp, "%Y-%m-%dT%H:%M:%SZ", &tm);
    for (int i = 0; i < argc; i++) {
        strncat(cmd, argv[i], sizeof cmd - strlen(cmd) - 2);
        if (i + 1 < argc)
            strncat(cmd, " ", sizeof cmd - strlen(cmd) - 1);
    }

    fprintf(f, "{\n  \"benchmark\": \"bench_linalg\",\n  \"timestamp\": ");
    json_str(f, stamp);
    fprintf(f, ",\n  \"command\": ");
    json_str(f, cmd);
    fprintf(f, ",\n  \"machine\": {\"sysname\": ");
    json_str(f, u.sysname);
    fprintf(f, ", \"nodename\": ");
    json_str(f, u.nodename);
    fprintf(f, ", \"release\": ");
    json_str(f, u.release);
    fprintf(f, ", \"version\": ");
    json_str(f, u.version);
    fprintf(f, ", \"machine\": ");
    json_str(f, u.machine);
    fprintf(f, ", \"cpu_model\": ");
    json_str(f, model);
    fprintf(f, ", \"nproc\": %ld, \"allowed_cpus\": ", sysconf(_SC_NPROCESSORS_ONLN));
    json_str(f, cpus);
    fprintf(f, ", \"loadavg1_start\": %.2f, \"loadavg1_end\": %.2f", load[0], load[1]);
    fprintf(f, "},\n  \"versions\": {\"asteria\": ");
    json_str(f, ASTERIA_VERSION_STRING);
    fprintf(f, ", \"openblas_config\": ");
    json_str(f, openblas_get_config());
    fprintf(f, ", \"openblas_threads_per_call\": %d},\n", openblas_get_num_threads());
    fprintf(f, "  \"settings\": {\"dtype\": \"%s\", \"budget_s\": %g, \"rounds\": %d, "
               "\"inv_root_p\": %d, \"inv_root_eps\": %g, \"pool_pin\": 1, \"pool1_cpus\": ",
            dt == AST_F32 ? "f32" : "f64", budget, r[0].rounds, ROOT_P, ROOT_EPS);
    json_str(f, pool_sets[M_POOL1]);
    fprintf(f, ", \"pool2_cpus\": ");
    json_str(f, pool_sets[M_POOL2]);
    fprintf(f, ",\n    \"summary\": \"blocks_per_s and worker_utilisation: median over rounds; "
               "ratios: median over rounds of the per-round ratio; foreign_cpu_share: CPU time of "
               "other processes and hypervisor steal / (wall * nproc) during a measurement\"},\n"
               "  \"results\": [\n");
    for (int i = 0; i < nr; i++) {
        const result *x = &r[i];
        fprintf(f, "    {\"op\": \"%s\", \"n\": %d, \"jobs_per_round\": %d, \"rounds\": %d, "
                   "\"warmup_s\": %.6f",
                op_names[x->kind], x->n, x->jobs_per_round, x->rounds, x->warmup_s);
        for (int m = 0; m < M_COUNT; m++) {
            fprintf(f, ",\n     \"%s\": {\"blocks_per_s\": %.6g, \"worker_utilisation\": %.4f, "
                       "\"per_round_blocks_per_s\": [",
                    mode_names[m], summary(x, (mode)m, -1), median_utilisation(x, (mode)m));
            for (int k = 0; k < x->rounds; k++)
                fprintf(f, "%s%.6g", k ? ", " : "", x->m[m][k].blocks_per_s);
            fprintf(f, "], \"per_round_foreign_cpu_share\": [");
            for (int k = 0; k < x->rounds; k++)
                fprintf(f, "%s%.3f", k ? ", " : "", x->m[m][k].foreign);
            fprintf(f, "]}");
        }
        fprintf(f, ",\n     \"ratio_pool2_pool1\": %.4f, \"ratio_pool1_bare\": %.4f, "
                   "\"max_foreign_cpu_share\": %.3f}%s\n",
                summary(x, M_POOL2, M_POOL1), summary(x, M_POOL1, M_BARE), max_foreign(x),
                i + 1 < nr ? "," : "");
    }
    fprintf(f, "  ]\n}\n");
    if (fclose(f) != 0) {
        fprintf(stderr, "bench_linalg: writing %s failed\n", path);
        exit(1);
    }
}

/* ---- main -------------------------------------------------------------------------------- */

static void usage(void)
{
    fprintf(stderr, "usage: bench_linalg [--dtype f32|f64] [--sizes N,N,...] [--budget SECONDS]\n"
                    "                    [--rounds R] [--quick] [--out PATH]\n");
    exit(2);
}

static int parse_sizes(const char *s, int *sizes)
{
    int k = 0;
    while (*s && k < MAX_SIZES) {
        char *end;
        long v = strtol(s, &end, 10);
        if (end == s || v < 1 || v > 32766)
            usage();
        sizes[k++] = (int)v;
        s = *end == ',' ? end + 1 : end;
        if (*end && *end != ',')
            usage();
    }
    return k;
}

int main(int argc, char **argv)
{
    ast_dtype dt = AST_F32;
    int sizes[MAX_SIZES] = {256, 512, 1024, 2048}, nsizes = 4;
    double budget = 3.0;
    int rounds = 3;
    const char *out = "benchmarks/results/bench_linalg.json";
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--dtype") && i + 1 < argc) {
            i++;
            if (!strcmp(argv[i], "f32"))
                dt = AST_F32;
            else if (!strcmp(argv[i], "f64"))
                dt = AST_F64;
            else
                usage();
        } else if (!strcmp(argv[i], "--sizes") && i + 1 < argc) {
            nsizes = parse_sizes(argv[++i], sizes);
        } else if (!strcmp(argv[i], "--budget") && i + 1 < argc) {
            budget = atof(argv[++i]);
            if (!(budget > 0))
                usage();
        } else if (!strcmp(argv[i], "--rounds") && i + 1 < argc) {
            rounds = atoi(argv[++i]);
            if (rounds < 1 || rounds > MAX_ROUNDS)
                usage();
        } else if (!strcmp(argv[i], "--quick")) {
            sizes[0] = 64, sizes[1] = 128, nsizes = 2;
            budget = 0.05;
            rounds = 2;
        } else if (!strcmp(argv[i], "--out") && i + 1 < argc) {
            out = argv[++i];
        } else {
            usage();
        }
    }

    ast_linalg_init();
    double load[2] = {load1(), 0};
    char cpus[256], sets[M_COUNT][256] = {"main thread", "", ""};
    allowed_cpus(cpus, sizeof cpus);
    ast_pool *pools[M_COUNT] = {NULL, NULL, NULL};
    for (int m = M_POOL1; m <= M_POOL2; m++) {
        ast_pool_opts o;
        ast_pool_opts_init(&o);
        o.workers = m == M_POOL1 ? 1 : 2;
        o.cpuset = cpus;
        o.pin = 1;
        int rc = ast_pool_create(&o, &pools[m]);
        if (rc)
            die("ast_pool_create", rc);
        ast_pool_cpuset(pools[m], sets[m], sizeof sets[m]);
    }
    const char *pool_sets[M_COUNT] = {sets[0], sets[1], sets[2]};
    fprintf(stderr, "bench_linalg: dtype %s, cpus %s, pool1 on %s, pool2 on %s, budget %.2fs\n",
            dt == AST_F32 ? "f32" : "f64", cpus, sets[M_POOL1], sets[M_POOL2], budget);
    if (load[0] > 0.5)
        fprintf(stderr, "bench_linalg: warning: load average %.2f, other processes will skew the "
                        "numbers\n", load[0]);

    result *res = xmalloc((size_t)nsizes * OP_COUNT * sizeof *res);
    int nr = 0;
    for (int s = 0; s < nsizes; s++) {
        const int n = sizes[s];
        inputs in;
        make_inputs(dt, n, &in);
        for (int k = 0; k < OP_COUNT; k++) {
            result *r = &res[nr++];
            r->kind = (op)k;
            r->n = n;
            /* One call sizes the run and warms the main thread (OpenBLAS buffers, malloc). */
            job_ctx *probe = make_jobs(r->kind, dt, n, &in, 1);
            double t0 = now_s();
            int rc = run_job(probe);
            r->warmup_s = now_s() - t0;
            if (rc)
                die(op_names[k], rc);
            free_jobs(probe, 1);
            int jr = (int)(budget / (rounds * r->warmup_s) + 0.5);
            jr += jr & 1;
            jr = jr < MIN_JOBS_ROUND ? MIN_JOBS_ROUND : jr > MAX_JOBS_ROUND ? MAX_JOBS_ROUND : jr;
            r->jobs_per_round = jr;
            r->rounds = rounds;

            job_ctx *c = make_jobs(r->kind, dt, n, &in, jr);
            /* Every worker's first OpenBLAS call and page faults stay out of the rounds. */
            pool_round(pools[M_POOL1], c, 0, 1);
            pool_round(pools[M_POOL2], c, 0, 2);
            for (int i = 0; i < rounds; i++) {
                r->m[M_BARE][i] = run_bare(c, jr);
                r->m[M_POOL1][i] = run_pool(pools[M_POOL1], 1, c, jr);
                r->m[M_POOL2][i] = run_pool(pools[M_POOL2], 2, c, jr);
            }
            free_jobs(c, jr);
            fprintf(stderr,
                    "  %-12s n=%-5d jobs=%dx%-3d bare %9.3f  pool1 %9.3f  pool2 %9.3f blocks/s\n",
                    op_names[k], n, rounds, jr, summary(r, M_BARE, -1), summary(r, M_POOL1, -1),
                    summary(r, M_POOL2, -1));
        }
        free(in.spd);
        free(in.basis);
    }
    for (int m = M_POOL1; m <= M_POOL2; m++)
        ast_pool_destroy(pools[m]);

    load[1] = load1();
    write_json(out, argc, argv, dt, budget, cpus, pool_sets, load, res, nr);

    printf("\nbench_linalg (%s; blocks per second, median of rounds; pool2/pool1 is the "
           "2-worker speed-up)\n",
           dt == AST_F32 ? "float32" : "float64");
    printf("%-13s %5s %7s %11s %11s %11s %12s %11s %8s\n", "op", "n", "jobs", "bare", "pool1",
           "pool2", "pool2/pool1", "pool1/bare", "foreign");
    for (int i = 0; i < nr; i++) {
        const result *x = &res[i];
        char jobs[32];
        snprintf(jobs, sizeof jobs, "%dx%d", x->rounds, x->jobs_per_round);
        printf("%-13s %5d %7s %11.3f %11.3f %11.3f %12.3f %11.3f %7.0f%%\n", op_names[x->kind],
               x->n, jobs, summary(x, M_BARE, -1), summary(x, M_POOL1, -1),
               summary(x, M_POOL2, -1), summary(x, M_POOL2, M_POOL1),
               summary(x, M_POOL1, M_BARE), 100 * max_foreign(x));
    }
    printf("foreign: the largest CPU share other processes took during any measurement of the "
           "row\nresults: %s\n", out);
    free(res);
    return 0;
}
