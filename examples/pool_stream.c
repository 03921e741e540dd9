/*
 * pool_stream.c - the pure-C "main job" example: a training loop that streams factor snapshots
 * through the worker pool and installs the refreshed SOAP eigenbases as they come back.
 *
 * Every step the main thread (the "training thread") updates the Kronecker factor of a window of
 * blocks (an EMA of random rank-one terms, like L = lerp(L, G G^T, 1-b)), snapshots each one and
 * submits its SOAP refresh (ast_linalg_soap_refresh: one QR power-iteration step of the basis)
 * with deadline = step + staleness. A newer snapshot of a block supersedes its queued older one,
 * so an overloaded pool drops stale work instead of falling further behind. At the end of every
 * step the main thread drains the done-queue without blocking and installs each new basis; after
 * the last step it waits for the rest. It prints throughput, supersede count and job latency.
 *
 *   pool_stream [--blocks 200] [--n 256] [--workers 0] [--steps 20] [--per-step 40]
 *               [--step-ms 20] [--staleness 5] [--seed 1]
 *
 * --workers 0 lets the pool pick (the cores this thread does not run on). Exit status: 0 when
 * every job completed exactly once and every block ends with its last snapshot's basis
 * installed; 1 otherwise.
 *
 * Ownership: a basis (Q) is immutable once published and reference counted by the main thread
 * only; a job holds a reference to the basis it refines, so installing a newer basis never
 * changes memory a worker is reading. Workers touch only their own job's buffers.
 */
#define _POSIX_C_SOURCE 200809L

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "asteria/errors.h"
#include "asteria/linalg.h"
#include "asteria/pool.h"

typedef struct basis {
    int refs;   /* main thread only */
    float q[];  /* n x n, eigenvectors as columns */
} basis;

typedef struct block {
    float *f;            /* the live factor, updated every time the block is snapshotted */
    basis *q;            /* installed basis */
    uint64_t installed;  /* version of q (0: the initial identity) */
    uint64_t submitted;  /* latest version submitted */
} block;

typedef struct job {
    int n;
    float *f;            /* the snapshot this job refines against */
    basis *q;            /* the basis it starts from (a reference) */
    basis *q_new;        /* its result, refs = 1, allocated by the worker */
    int64_t *perm;
} job;

typedef struct args {
    int blocks, n, workers, steps, per_step, step_ms, staleness;
    unsigned long long seed;
} args;

static uint64_t rng_state;

static double rng_uniform(void)
{
    rng_state ^= rng_state >> 12;
    rng_state ^= rng_state << 25;
    rng_state ^= rng_state >> 27;
    return (double)((rng_state * 0x2545F4914F6CDD1Dull) >> 11) * 0x1.0p-53 * 2.0 - 1.0;
}

static basis *basis_new(int n)
{
    basis *b = malloc(sizeof *b + (size_t)n * (size_t)n * sizeof(float));
    if (b)
        b->refs = 1;
    return b;
}

static void basis_put(basis *b)
{
    if (b && --b->refs == 0)
        free(b);
}

static uint64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static int refresh_run(void *ctx)
{
    job *j = ctx;
    j->q_new = basis_new(j->n);
    if (!j->q_new)
        return AST_ENOMEM;
    return ast_linalg_soap_refresh(AST_F32, j->n, j->f, j->q->q, j->q_new->q, j->perm);
}

static void job_free(job *j)
{
    basis_put(j->q);
    basis_put(j->q_new);
    free(j->f);
    free(j->perm);
    free(j);
}

/* F = b F + (1-b) g g^T with a fresh random g: a factor EMA, symmetric by construction. */
static void factor_update(float *f, int n, float *g)
{
    const float b = 0.95f;
    for (int i = 0; i < n; i++)
        g[i] = (float)rng_uniform();
    for (int i = 0; i < n; i++)
        for (int k = 0; k < n; k++)
            f[(size_t)i * n + k] = b * f[(size_t)i * n + k] + (1.0f - b) * g[i] * g[k];
}

static int cmp_u64(const void *a, const void *b)
{
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return x < y ? -1 : x > y;
}

static double pct_ms(const uint64_t *v, size_t n, double p)
{
    if (!n)
        return 0.0;
    size_t i = (size_t)ceil(p * (double)n) - 1;
    return (double)v[i < n ? i : n - 1] / 1e6;
}

/* max |Q^T Q - I|: the installed basis must stay orthonormal. */
static double orth_error(const float *q, int n)
{
    double worst = 0.0;
    for (int a = 0; a < n; a++)
        for (int b = a; b < n; b++) {
            double s = 0.0;
            for (int i = 0; i < n; i++)
                s += (double)q[(size_t)i * n + a] * q[(size_t)i * n + b];
            double e = fabs(s - (a == b ? 1.0 : 0.0));
            if (e > worst)
                worst = e;
        }
    return worst;
}

static int parse_int(const char *s, int lo, int hi, int *out)
{
    char *end;
    long v = strtol(s, &end, 10);
    if (end == s || *end || v < lo || v > hi)
        return -1;
    *out = (int)v;
    return 0;
}

static int parse_args(int argc, char **argv, args *a)
{
    *a = (args){.blocks = 200, .n = 256, .workers = 0, .steps = 20, .per_step = 40,
                .step_ms = 20, .staleness = 5, .seed = 1};
    struct {
        const char *name;
        int *dst, lo, hi;
    } opt[] = {{"--blocks", &a->blocks, 1, 100000},   {"--n", &a->n, 1, 8192},
               {"--workers", &a->workers, 0, 4096},   {"--steps", &a->steps, 1, 1000000},
               {"--per-step", &a->per_step, 1, 100000}, {"--step-ms", &a->step_ms, 0, 60000},
               {"--staleness", &a->staleness, 0, 1000000}};
    for (int i = 1; i < argc; i++) {
        int matched = 0;
        if (!strcmp(argv[i], "--seed") && i + 1 < argc) {
            a->seed = strtoull(argv[++i], NULL, 10);
            continue;
        }
        for (size_t k = 0; k < sizeof opt / sizeof opt[0] && !matched; k++) {
            if (strcmp(argv[i], opt[k].name))
                continue;
            if (i + 1 >= argc || parse_int(argv[i + 1], opt[k].lo, opt[k].hi, opt[k].dst)) {
                fprintf(stderr, "%s needs an integer in [%d, %d]\n", opt[k].name, opt[k].lo,
                        opt[k].hi);
                return -1;
            }
            i++;
            matched = 1;
        }
        if (!matched) {
            fprintf(stderr,
                    "usage: %s [--blocks B] [--n N] [--workers W] [--steps T] [--per-step K]\n"
                    "          [--step-ms MS] [--staleness S] [--seed X]\n",
                    argv[0]);
            return -1;
        }
    }
    if (a->per_step > a->blocks)
        a->per_step = a->blocks;
    return 0;
}

typedef struct tally {
    uint64_t completions, ran, superseded, failed, installs;
    uint64_t *latency, *runtime; /* per job that ran, ns */
} tally;

/* Settles one completion on the main thread: installs a newer basis, frees the job. */
static void settle(const ast_completion *c, block *blocks, tally *t)
{
    job *j = c->ctx;
    block *b = &blocks[c->block];
    t->completions++;
    if (c->status == AST_ESUPERSEDED) {
        t->superseded++;
    } else if (c->started_ns) {
        t->latency[t->ran] = c->done_ns - c->queued_ns;
        t->runtime[t->ran] = c->done_ns - c->started_ns;
        t->ran++;
        if (c->status != 0) {
            t->failed++;
            fprintf(stderr, "block %llu version %llu: %s (previous basis kept)\n",
                    (unsigned long long)c->block, (unsigned long long)c->version,
                    ast_strerror(c->status));
        } else if (c->version > b->installed) {
            basis_put(b->q);
            b->q = j->q_new;
            j->q_new = NULL;
            b->installed = c->version;
            t->installs++;
        }
    } else {
        t->failed++;
    }
    job_free(j);
}

static size_t drain(ast_pool *pool, int64_t timeout_ns, block *blocks, tally *t)
{
    ast_completion c[64];
    size_t n = 0;
    if (timeout_ns == 0)
        ast_pool_poll(pool, c, 64, &n);
    else
        ast_pool_wait_any(pool, timeout_ns, c, 64, &n);
    for (size_t i = 0; i < n; i++)
        settle(&c[i], blocks, t);
    return n;
}

int main(int argc, char **argv)
{
    args a;
    if (parse_args(argc, argv, &a))
        return 2;
    rng_state = a.seed * 0x9E3779B97F4A7C15ull + 1;
    ast_linalg_init();

    ast_pool_opts o;
    ast_pool_opts_init(&o);
    o.workers = a.workers;
    ast_pool *pool = NULL;
    int rc = ast_pool_create(&o, &pool);
    if (rc) {
        fprintf(stderr, "ast_pool_create: %s\n", ast_strerror(rc));
        return 1;
    }
    char cores[256];
    ast_pool_cpuset(pool, cores, sizeof cores);
    ast_pool_stats st;
    ast_pool_stats_get(pool, &st);

    const int n = a.n;
    const size_t nn = (size_t)n * (size_t)n;
    uint64_t total = (uint64_t)a.steps * (uint64_t)a.per_step;
    block *blocks = calloc((size_t)a.blocks, sizeof *blocks);
    float *g = malloc((size_t)n * sizeof *g);
    tally t = {.latency = malloc(total * sizeof(uint64_t)), .runtime = malloc(total * sizeof(uint64_t))};
    if (!blocks || !g || !t.latency || !t.runtime) {
        fprintf(stderr, "out of memory\n");
        return 1;
    }
    for (int b = 0; b < a.blocks; b++) {
        blocks[b].f = calloc(nn, sizeof(float));
        blocks[b].q = basis_new(n);
        if (!blocks[b].f || !blocks[b].q) {
            fprintf(stderr, "out of memory\n");
            return 1;
        }
        memset(blocks[b].q->q, 0, nn * sizeof(float));
        for (int i = 0; i < n; i++) {
            blocks[b].f[(size_t)i * n + i] = 1.0f + (float)i / (float)n;
            blocks[b].q->q[(size_t)i * n + i] = 1.0f;
        }
    }
    printf("pool_stream: %d blocks of n=%d float32, %d steps x %d snapshots, step %d ms, "
           "staleness %d\n",
           a.blocks, n, a.steps, a.per_step, a.step_ms, a.staleness);
    printf("pool: workers %d, cores %s\n", st.workers, cores);

    uint64_t t0 = now_ns(), submitted = 0;
    int next = 0, errors = 0;
    for (int step = 0; step < a.steps && !errors; step++) {
        for (int k = 0; k < a.per_step; k++) {
            block *b = &blocks[next];
            factor_update(b->f, n, g);
            job *j = calloc(1, sizeof *j);
            if (!j || !(j->f = malloc(nn * sizeof(float))) ||
                !(j->perm = malloc((size_t)n * sizeof(int64_t)))) {
                fprintf(stderr, "out of memory\n");
                return 1;
            }
            memcpy(j->f, b->f, nn * sizeof(float));
            j->n = n;
            j->q = b->q;
            b->q->refs++;
            ast_job req = {.block = (uint64_t)next, .version = b->submitted + 1,
                           .deadline = step + a.staleness, .run = refresh_run, .ctx = j};
            rc = ast_pool_submit(pool, &req, NULL);
            if (rc) {
                fprintf(stderr, "ast_pool_submit: %s\n", ast_strerror(rc));
                job_free(j);
                errors++;
                break;
            }
            b->submitted++;
            submitted++;
            next = (next + 1) % a.blocks;
        }
        /* The training step; then its end: install whatever is ready, never block. */
        struct timespec ts = {.tv_sec = a.step_ms / 1000, .tv_nsec = (a.step_ms % 1000) * 1000000L};
        nanosleep(&ts, NULL);
        while (drain(pool, 0, blocks, &t))
            ;
    }
    uint64_t t_stream = now_ns();
    while (t.completions < submitted) {
        if (!drain(pool, 30 * 1000000000LL, blocks, &t)) {
            fprintf(stderr, "no completion within 30 s\n");
            errors++;
            break;
        }
    }
    uint64_t t1 = now_ns();
    ast_pool_stats_get(pool, &st);

    int stale = 0;
    for (int b = 0; b < a.blocks; b++)
        stale += blocks[b].installed != blocks[b].submitted;
    double orth = orth_error(blocks[0].q->q, n);
    qsort(t.latency, t.ran, sizeof(uint64_t), cmp_u64);
    qsort(t.runtime, t.ran, sizeof(uint64_t), cmp_u64);
    double wall = (double)(t1 - t0) / 1e9;
    double busy = (double)st.busy_ns / 1e9 / (wall * st.workers);

    printf("submitted %llu  ran %llu  superseded %llu  failed %llu  installed %llu\n",
           (unsigned long long)submitted, (unsigned long long)t.ran,
           (unsigned long long)t.superseded, (unsigned long long)t.failed,
           (unsigned long long)t.installs);
    printf("throughput %.1f blocks/s over %.2f s (stream %.2f s, final drain %.2f s), "
           "workers busy %.0f%%\n",
           (double)t.ran / wall, wall, (double)(t_stream - t0) / 1e9,
           (double)(t1 - t_stream) / 1e9, 100.0 * busy);
    printf("job latency queued->done: p50 %.2f ms  p99 %.2f ms;  run time: p50 %.2f ms  "
           "p99 %.2f ms\n",
           pct_ms(t.latency, t.ran, 0.50), pct_ms(t.latency, t.ran, 0.99),
           pct_ms(t.runtime, t.ran, 0.50), pct_ms(t.runtime, t.ran, 0.99));
    printf("blocks without their last snapshot installed: %d; block 0 max|Q^T Q - I| = %.2e\n",
           stale, orth);

    if (st.submitted != submitted || st.superseded != t.superseded || st.done != t.ran ||
        st.queued || st.running)
        errors++;
    if (t.failed || stale || !(orth < 1e-3))
        errors++;

    ast_pool_destroy(pool);
    for (int b = 0; b < a.blocks; b++) {
        free(blocks[b].f);
        basis_put(blocks[b].q);
    }
    free(blocks);
    free(g);
    free(t.latency);
    free(t.runtime);
    if (errors)
        fprintf(stderr, "pool_stream: FAILED\n");
    return errors ? 1 : 0;
}
