/* test_coherence.c - the CoherenceRegistry, with 4 ranks (2 nodes x 2 ranks) simulated as 4
 * registries in one process: owners identical whatever the registration order, LPT balance vs
 * round-robin, due lists holding only changed blocks, the full step protocol on a random
 * publish schedule (identical installs on every rank, independent of when results are ready,
 * lag <= S), hierarchical plans and their byte counts, bad inputs, concurrent use, and
 * incremental registration (ast_coherence_extend), with the protocol running over a late batch. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <inttypes.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "asteria/coherence.h"
#include "asteria/errors.h"

#define W 4
#define RPN 2
#define MAXB 128

static uint64_t rng_next(uint64_t *s)
{
    uint64_t x = *s;
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    return *s = x;
}

static unsigned rng_below(uint64_t *s, unsigned n)
{
    return (unsigned)(rng_next(s) % n);
}

static void shuffle(uint64_t *a, size_t n, uint64_t *seed)
{
    for (size_t i = n; i > 1; i--) {
        size_t j = rng_below(seed, (unsigned)i);
        uint64_t t = a[i - 1];
        a[i - 1] = a[j];
        a[j] = t;
    }
}

static int owner_of(ast_coherence *reg, uint64_t id)
{
    int o = -1;
    assert_int_equal(ast_coherence_owner(reg, id, &o), 0);
    return o;
}

static ast_coherence *make_reg(int world, int rank, int rpn, int S, const int *groups)
{
    ast_coherence_opts o;
    ast_coherence_opts_init(&o);
    o.world_size = world;
    o.rank = rank;
    o.ranks_per_node = rpn;
    o.staleness = S;
    o.replica_group = groups;
    ast_coherence *reg = NULL;
    char err[256];
    assert_int_equal(ast_coherence_create(&o, &reg, err, sizeof err), 0);
    assert_non_null(reg);
    return reg;
}

/* A world of W registries; rank r registers ids[] (with costs[]) in its own shuffled order. */
static void make_world(ast_coherence **regs, int S, const uint64_t *ids, const uint64_t *costs,
                       size_t n, uint64_t order_seed)
{
    uint64_t perm[MAXB];
    for (int r = 0; r < W; r++) {
        regs[r] = make_reg(W, r, RPN, S, NULL);
        for (size_t i = 0; i < n; i++)
            perm[i] = i;
        shuffle(perm, n, &order_seed);
        for (size_t i = 0; i < n; i++)
            assert_int_equal(
                ast_coherence_register_block(regs[r], ids[perm[i]], costs[perm[i]], NULL, 0), 0);
        assert_int_equal(ast_coherence_plan(regs[r]), 0);
    }
}

static void destroy_world(ast_coherence **regs)
{
    for (int r = 0; r < W; r++)
        ast_coherence_destroy(regs[r]);
}

static void random_blocks(uint64_t *ids, uint64_t *costs, size_t n, uint64_t *seed)
{
    for (size_t i = 0; i < n; i++) {
        ids[i] = 1000 + 7 * i + rng_below(seed, 7); /* distinct, not contiguous */
        costs[i] = ast_coherence_dim_cost(32 + rng_below(seed, 2048));
    }
}

/* ---- owners ------------------------------------------------------------------------------- */

static void test_owner_identical(void **state)
{
    (void)state;
    uint64_t seed = 0x1234567, ids[64], costs[64];
    for (int round = 0; round < 8; round++) {
        random_blocks(ids, costs, 64, &seed);
        if (round == 0) /* equal costs: the id and rank tie-breaks decide */
            for (int i = 0; i < 64; i++)
                costs[i] = 1000;
        ast_coherence *regs[W];
        make_world(regs, 2, ids, costs, 64, seed + (uint64_t)round);
        uint64_t total = 0;
        for (int i = 0; i < 64; i++) {
            int o0;
            assert_int_equal(ast_coherence_owner(regs[0], ids[i], &o0), 0);
            assert_true(o0 >= 0 && o0 < W);
            for (int r = 1; r < W; r++) {
                int o;
                assert_int_equal(ast_coherence_owner(regs[r], ids[i], &o), 0);
                assert_int_equal(o, o0);
            }
            for (int r = 0; r < W; r++)
                assert_int_equal(ast_coherence_is_owner(regs[r], ids[i]), r == o0);
            total += costs[i];
        }
        uint64_t sum = 0;
        for (int r = 0; r < W; r++) {
            uint64_t l0, l;
            assert_int_equal(ast_coherence_load(regs[0], r, &l0), 0);
            for (int q = 1; q < W; q++) {
                assert_int_equal(ast_coherence_load(regs[q], r, &l), 0);
                assert_int_equal(l, l0);
            }
            ast_coherence_stats st;
            assert_int_equal(ast_coherence_stats_get(regs[r], &st), 0);
            assert_int_equal(st.load, l0);
            assert_int_equal(st.blocks, 64);
            sum += l0;
        }
        assert_int_equal(sum, total);
        if (round == 0) /* 64 equal blocks on 4 ranks: 16 each */
            for (int r = 0; r < W; r++) {
                ast_coherence_stats st;
                ast_coherence_stats_get(regs[r], &st);
                assert_int_equal(st.owned, 16);
            }
        destroy_world(regs);
    }
}

static void test_owner_tiebreak(void **state)
{
    (void)state;
    /* Equal costs: ids ascending go to ranks ascending. */
    const uint64_t ids[4] = {13, 11, 12, 10}, costs[4] = {5, 5, 5, 5};
    ast_coherence *regs[W];
    make_world(regs, 0, ids, costs, 4, 99);
    for (uint64_t id = 10; id <= 13; id++) {
        int o;
        assert_int_equal(ast_coherence_owner(regs[2], id, &o), 0);
        assert_int_equal(o, (int)(id - 10));
    }
    destroy_world(regs);

    /* LPT by hand on two explicit replicas {1, 3}: 9 -> 1, 7 -> 3, 4 -> 3 (7 < 9), 3 -> 1. */
    ast_coherence *reg = make_reg(W, 0, RPN, 0, NULL);
    const int rr[2] = {3, 1};
    assert_int_equal(ast_coherence_register_block(reg, 4, 3, rr, 2), 0);
    assert_int_equal(ast_coherence_register_block(reg, 1, 9, rr, 2), 0);
    assert_int_equal(ast_coherence_register_block(reg, 3, 4, rr, 2), 0);
    assert_int_equal(ast_coherence_register_block(reg, 2, 7, rr, 2), 0);
    assert_int_equal(ast_coherence_plan(reg), 0);
    assert_int_equal(ast_coherence_plan(reg), 0); /* second call: nothing changes */
    const int want[5] = {-1, 1, 3, 3, 1};
    for (uint64_t id = 1; id <= 4; id++)
        assert_int_equal(owner_of(reg, id), want[id]);
    uint64_t l;
    assert_int_equal(ast_coherence_load(reg, 1, &l), 0);
    assert_int_equal(l, 12);
    assert_int_equal(ast_coherence_load(reg, 3, &l), 0);
    assert_int_equal(l, 11);
    assert_int_equal(ast_coherence_load(reg, 0, &l), 0);
    assert_int_equal(l, 0);
    assert_int_equal(ast_coherence_is_owner(reg, 1), 0); /* rank 0 is no replica */
    ast_coherence_block bi;
    assert_int_equal(ast_coherence_block_info(reg, 1, &bi), 0);
    assert_int_equal(bi.is_replica, 0);
    assert_int_equal(bi.nreplicas, 2);
    ast_coherence_destroy(reg);
}

static void test_load_balance(void **state)
{
    (void)state;
    uint64_t seed = 0xabcdef12345ULL;
    double lpt_sum = 0, rr_sum = 0;
    const int rounds = 50;
    for (int round = 0; round < rounds; round++) {
        const size_t n = 24 + rng_below(&seed, 40);
        uint64_t ids[MAXB], costs[MAXB];
        random_blocks(ids, costs, n, &seed);
        ast_coherence *reg = make_reg(W, 0, RPN, 1, NULL);
        for (size_t i = 0; i < n; i++)
            assert_int_equal(ast_coherence_register_block(reg, ids[i], costs[i], NULL, 0), 0);
        assert_int_equal(ast_coherence_plan(reg), 0);
        double total = 0, maxcost = 0, lpt_max = 0, rr_load[W] = {0}, rr_max = 0;
        for (size_t i = 0; i < n; i++) {
            total += (double)costs[i];
            if ((double)costs[i] > maxcost)
                maxcost = (double)costs[i];
            rr_load[i % W] += (double)costs[i]; /* naive: ids in order, round-robin */
        }
        for (int r = 0; r < W; r++) {
            uint64_t l;
            assert_int_equal(ast_coherence_load(reg, r, &l), 0);
            if ((double)l > lpt_max)
                lpt_max = (double)l;
            if (rr_load[r] > rr_max)
                rr_max = rr_load[r];
        }
        double mean = total / W;
        /* Graham: LPT <= (4/3 - 1/(3m)) OPT, and OPT >= max(mean, largest block). */
        double opt_lb = mean > maxcost ? mean : maxcost;
        assert_true(lpt_max <= (4.0 / 3.0 - 1.0 / (3.0 * W)) * opt_lb * (1 + 1e-12));
        assert_true(lpt_max <= rr_max * (1 + 1e-12));
        lpt_sum += lpt_max / mean;
        rr_sum += rr_max / mean;
        ast_coherence_destroy(reg);
    }
    printf("max/mean load over %d random cost sets: LPT %.3f, round-robin %.3f\n", rounds,
           lpt_sum / rounds, rr_sum / rounds);
    assert_true(lpt_sum / rounds < 1.10);
    assert_true(lpt_sum < rr_sum);
}

/* ---- versions and the due list ------------------------------------------------------------ */

/* The version exchange of one step: element-wise MAX over every rank's export, imported
 * everywhere (what an all_reduce(MAX) on the replica group does). */
static void exchange(ast_coherence **regs, int world, int64_t step)
{
    size_t nb;
    assert_int_equal(ast_coherence_nblocks(regs[0], &nb), 0);
    const size_t len = AST_COH_XCHG_STRIDE * nb;
    int64_t *sum = calloc(len + 1, sizeof *sum), *v = calloc(len + 1, sizeof *v);
    assert_non_null(sum);
    assert_non_null(v);
    for (int r = 0; r < world; r++) {
        assert_int_equal(ast_coherence_versions_export(regs[r], step, v, len), 0);
        for (size_t i = 0; i < len; i++)
            if (v[i] > sum[i])
                sum[i] = v[i];
    }
    for (int r = 0; r < world; r++)
        assert_int_equal(ast_coherence_versions_import(regs[r], step, sum, len), 0);
    free(sum);
    free(v);
}

/* Moves one due block as a replica set would, checks its plan, and reports the bytes. */
static void sync_block(ast_coherence **regs, int world, uint64_t id, int64_t step, uint64_t bytes)
{
    ast_coherence_block bi;
    assert_int_equal(ast_coherence_block_info(regs[0], id, &bi), 0);
    uint64_t v = bi.due_version;
    assert_true(v > bi.synced_version); /* only a changed block travels */
    ast_coherence_hier h[16];
    int has[16] = {0}, shm[16] = {0}; /* shm indexed by node id */
    int owner = owner_of(regs[0], id);
    for (int r = 0; r < world; r++) {
        assert_int_equal(ast_coherence_hier_plan(regs[r], id, &h[r]), 0);
        assert_int_equal(h[r].owner, owner);
    }
    has[owner] = 1;
    /* (1) owner writes its node copy; (2) its node reads */
    for (int r = 0; r < world; r++)
        if (h[r].write_shm && r == owner)
            shm[h[r].node] = 1;
    for (int r = 0; r < world; r++)
        if (h[r].read_shm && h[r].node == h[r].owner_node) {
            assert_true(shm[h[r].node]);
            has[r] = 1;
        }
    /* (3) the owner node's representative broadcasts to the others */
    int sends = 0;
    for (int r = 0; r < world; r++)
        if (h[r].inter == AST_COH_INTER_SEND) {
            assert_true(has[r]);
            assert_int_equal(r, h[r].inter_root);
            sends++;
        }
    for (int r = 0; r < world; r++)
        if (h[r].inter == AST_COH_INTER_RECV) {
            assert_int_equal(sends, 1);
            has[r] = 1;
        }
    /* (4) the other representatives write their node copies; (5) their nodes read */
    for (int r = 0; r < world; r++)
        if (h[r].write_shm && r != owner) {
            assert_true(has[r]);
            shm[h[r].node] = 1;
        }
    for (int r = 0; r < world; r++)
        if (h[r].read_shm && h[r].node != h[r].owner_node) {
            assert_true(shm[h[r].node]);
            has[r] = 1;
        }
    for (int r = 0; r < world; r++) {
        assert_int_equal(has[r], h[r].is_replica);
        if (h[r].recv_level >= 0)
            assert_int_equal(ast_coherence_count_bytes(regs[r], h[r].recv_level, bytes), 0);
        if (h[r].flat_recv)
            assert_int_equal(ast_coherence_count_bytes(regs[r], AST_COH_FLAT, bytes), 0);
        if (h[r].flat_recv_inter)
            assert_int_equal(ast_coherence_count_bytes(regs[r], AST_COH_FLAT_INTER_NODE, bytes),
                             0);
        if (r != owner && h[r].is_replica)
            assert_int_equal(ast_coherence_received(regs[r], id, v, step), 0);
    }
    for (int r = 0; r < world; r++)
        assert_int_equal(ast_coherence_mark_synced(regs[r], id, v, step), 0);
}

static void due_all(ast_coherence **regs, int world, int64_t step, uint64_t *out, size_t *n)
{
    uint64_t other[MAXB];
    size_t m;
    assert_int_equal(ast_coherence_due(regs[0], step, out, MAXB, n), 0);
    for (int r = 1; r < world; r++) {
        assert_int_equal(ast_coherence_due(regs[r], step, other, MAXB, &m), 0);
        assert_int_equal(m, *n);
        assert_memory_equal(other, out, m * sizeof *out);
    }
    for (size_t i = 1; i < *n; i++)
        assert_true(out[i - 1] < out[i]);
}

static void test_due_changed_only(void **state)
{
    (void)state;
    uint64_t ids[8], costs[8];
    for (int i = 0; i < 8; i++) {
        ids[i] = (uint64_t)i;
        costs[i] = 100 + (uint64_t)i;
    }
    ast_coherence *regs[W];
    make_world(regs, 2, ids, costs, 8, 5);
    uint64_t due[MAXB];
    size_t n;

    /* block 1 snapshotted at 0, block 5 at 1: due at 2 and 3; nothing else ever travels */
    assert_int_equal(ast_coherence_publish(regs[owner_of(regs[0], 1)], 1, 1, 0), 0);
    exchange(regs, W, 0);
    due_all(regs, W, 0, due, &n);
    assert_int_equal(n, 0);
    assert_int_equal(ast_coherence_publish(regs[owner_of(regs[0], 5)], 5, 1, 1), 0);
    exchange(regs, W, 1);
    due_all(regs, W, 1, due, &n);
    assert_int_equal(n, 0);
    ast_coherence_block bi;
    assert_int_equal(ast_coherence_block_info(regs[owner_of(regs[0], 1) ^ 1], 1, &bi), 0);
    assert_int_equal(bi.version, 0); /* not due yet: the other replicas have not heard of it */
    exchange(regs, W, 2);
    due_all(regs, W, 2, due, &n);
    assert_int_equal(n, 1);
    assert_int_equal(due[0], 1);
    /* capacity smaller than the list: the count is still the full one */
    assert_int_equal(ast_coherence_due(regs[0], 2, NULL, 0, &n), 0);
    assert_int_equal(n, 1);
    sync_block(regs, W, 1, 2, 64);
    due_all(regs, W, 2, due, &n);
    assert_int_equal(n, 0);
    exchange(regs, W, 3);
    due_all(regs, W, 3, due, &n);
    assert_int_equal(n, 1);
    assert_int_equal(due[0], 5);
    sync_block(regs, W, 5, 3, 64);
    for (int64_t s = 4; s < 11; s++) {
        exchange(regs, W, s);
        due_all(regs, W, s, due, &n);
        assert_int_equal(n, 0);
    }
    /* block 1 again, snapshotted at 10 and 11 (published early): each version travels at its
     * own install step, and only block 1 does */
    int o1 = owner_of(regs[0], 1);
    assert_int_equal(ast_coherence_publish(regs[o1], 1, 2, 10), 0);
    assert_int_equal(ast_coherence_publish(regs[o1], 1, 3, 11), 0);
    exchange(regs, W, 11);
    due_all(regs, W, 11, due, &n);
    assert_int_equal(n, 0);
    exchange(regs, W, 12);
    due_all(regs, W, 12, due, &n);
    assert_int_equal(n, 1);
    assert_int_equal(due[0], 1);
    assert_int_equal(ast_coherence_block_info(regs[3], 1, &bi), 0);
    assert_int_equal(bi.due_version, 2);
    sync_block(regs, W, 1, 12, 64);
    exchange(regs, W, 13);
    due_all(regs, W, 13, due, &n);
    assert_int_equal(n, 1);
    assert_int_equal(due[0], 1);
    assert_int_equal(ast_coherence_block_info(regs[3], 1, &bi), 0);
    assert_int_equal(bi.due_version, 3);
    assert_int_equal(bi.version, 3);
    sync_block(regs, W, 1, 13, 64);
    assert_int_equal(ast_coherence_block_info(regs[3], 1, &bi), 0);
    assert_int_equal(bi.synced_version, 3);
    assert_int_equal(bi.last_sync_step, 13);
    assert_int_equal(bi.held_version, 3);
    assert_int_equal(bi.last_recv_step, owner_of(regs[0], 1) == 3 ? -1 : 13);
    exchange(regs, W, 14);
    due_all(regs, W, 14, due, &n);
    assert_int_equal(n, 0);
    for (int r = 0; r < W; r++) {
        ast_coherence_stats st;
        assert_int_equal(ast_coherence_stats_get(regs[r], &st), 0);
        assert_int_equal(st.synced, 4);
    }
    destroy_world(regs);
}

/* ---- the full protocol on a random schedule ----------------------------------------------- */

#define STEPS 120
#define NB 24

struct job {
    int64_t t;      /* snapshot step */
    int64_t ready;  /* step at whose end the owner's worker has the result */
    int fails;      /* the refresh failed: the previous result stays, nothing is announced */
};

/* Runs STEPS steps of the protocol and writes the version every rank installs at every step
 * into log[step][rank][block]. The snapshot schedule comes from sched_seed, readiness from
 * ready_seed (timing: it must not change what is installed). */
static void run_protocol(int S, uint64_t sched_seed, uint64_t ready_seed,
                         uint64_t (*log)[W][NB], ast_coherence_stats *st)
{
    uint64_t ids[NB], costs[NB], bytes[NB];
    uint64_t seed = sched_seed;
    random_blocks(ids, costs, NB, &seed);
    for (int i = 0; i < NB; i++)
        bytes[i] = 8u * (32u + (unsigned)(ids[i] % 100)) * 64u;
    ast_coherence *regs[W];
    make_world(regs, S, ids, costs, NB, sched_seed ^ 0x55);
    int owner[NB];
    for (int i = 0; i < NB; i++)
        owner[i] = owner_of(regs[0], ids[i]);

    static struct job q[NB][STEPS];
    size_t qh[NB] = {0}, qt[NB] = {0};
    uint64_t ver[NB] = {0};
    uint64_t rs = ready_seed, travelled = 0;
    for (int64_t s = 0; s < STEPS; s++) {
        /* refresh snapshots taken at step s, each block with probability 1/4 */
        for (int i = 0; i < NB; i++)
            if (rng_below(&seed, 4) == 0) {
                struct job *j = &q[i][qt[i]++];
                j->t = s;
                j->ready = s + rng_below(&rs, (unsigned)S + 3);
                j->fails = rng_below(&seed, 10) == 0;
            }
        /* owners: publish what is ready, in snapshot order; wait (the bounded barrier) for
         * whatever must be installed at this step */
        for (int i = 0; i < NB; i++) {
            ast_coherence *reg = regs[owner[i]];
            while (qh[i] < qt[i]) {
                struct job *j = &q[i][qh[i]];
                int forced = j->t + S <= s;
                if (!forced && j->ready > s)
                    break;
                if (forced && j->ready > s) {
                    assert_int_equal(ast_coherence_barrier_begin(reg, s), 0);
                    assert_int_equal(ast_coherence_barrier_end(reg, s), 0);
                }
                if (!j->fails)
                    assert_int_equal(ast_coherence_publish(reg, ids[i], ++ver[i], j->t), 0);
                qh[i]++;
            }
        }
        exchange(regs, W, s);
        uint64_t due[MAXB];
        size_t n;
        due_all(regs, W, s, due, &n);
        travelled += n;
        for (size_t k = 0; k < n; k++) {
            int i = 0;
            while (ids[i] != due[k])
                i++;
            sync_block(regs, W, due[k], s, bytes[i]);
        }
        for (int i = 0; i < NB; i++)
            for (int r = 0; r < W; r++) {
                uint64_t v;
                assert_int_equal(ast_coherence_install_version(regs[r], ids[i], s, &v), 0);
                log[s][r][i] = v;
            }
    }

    /* every announced version travelled exactly once, except those not due by the end */
    uint64_t announced = 0, undue = 0;
    for (int i = 0; i < NB; i++) {
        announced += ver[i];
        ast_coherence_block bi;
        assert_int_equal(ast_coherence_block_info(regs[owner[i]], ids[i], &bi), 0);
        undue += bi.version - bi.synced_version; /* the owner knows versions not yet due */
    }
    assert_int_equal(travelled + undue, announced);

    /* totals per level over the world, and the expected values from the replica layout */
    uint64_t sum[AST_COH_LEVEL_COUNT] = {0};
    ast_coherence_stats one;
    for (int r = 0; r < W; r++) {
        assert_int_equal(ast_coherence_stats_get(regs[r], &one), 0);
        for (int l = 0; l < AST_COH_LEVEL_COUNT; l++)
            sum[l] += one.bytes[l];
        if (r == 0)
            *st = one;
        else {
            st->installs += one.installs;
            st->barrier_waits += one.barrier_waits;
            if (one.max_lag_steps > st->max_lag_steps)
                st->max_lag_steps = one.max_lag_steps;
        }
        assert_true(one.max_lag_steps <= S);
    }
    const int nodes = W / RPN;
    assert_true(sum[AST_COH_FLAT] > 0);
    /* hierarchical inter-node = (nodes - 1) / (world - 1) of the flat exchange... */
    assert_int_equal(sum[AST_COH_INTER_NODE] * (W - 1), sum[AST_COH_FLAT] * (nodes - 1));
    /* ...and 1 / ranks_per_node of what a flat broadcast sends across node boundaries */
    assert_int_equal(sum[AST_COH_INTER_NODE] * RPN, sum[AST_COH_FLAT_INTER_NODE]);
    /* every non-owner delivery is either intra- or inter-node */
    assert_int_equal(sum[AST_COH_INTRA_NODE] + sum[AST_COH_INTER_NODE], sum[AST_COH_FLAT]);
    destroy_world(regs);
}

static void test_install_random(void **state)
{
    (void)state;
    static uint64_t a[STEPS][W][NB], b[STEPS][W][NB];
    for (int S = 0; S <= 4; S++) {
        uint64_t sched = 0x9e3779b97f4a7c15ULL * (uint64_t)(S + 1);
        ast_coherence_stats sa, sb;
        run_protocol(S, sched, 1 + (uint64_t)S, a, &sa);
        run_protocol(S, sched, 0xfeed + (uint64_t)S, b, &sb); /* other timing, same schedule */
        assert_memory_equal(a, b, sizeof a);
        for (int s = 0; s < STEPS; s++)
            for (int i = 0; i < NB; i++)
                for (int r = 1; r < W; r++)
                    assert_int_equal(a[s][r][i], a[s][0][i]);
        assert_true(sa.installs > 0);
        /* deterministic install: every new version lands exactly S steps after its snapshot */
        assert_int_equal(sa.max_lag_steps, S);
        assert_int_equal(sb.max_lag_steps, S);
        printf("S=%d: %" PRIu64 " installs on 4 ranks, barrier waits %" PRIu64 " vs %" PRIu64
               " (timing differs, installs do not)\n",
               S, sa.installs, sa.barrier_waits, sb.barrier_waits);
    }
}

/* ---- hierarchical plan -------------------------------------------------------------------- */

static void check_reps(ast_coherence **regs, int world, uint64_t id, int expect_nodes)
{
    ast_coherence_hier h[16];
    int reps_per_node[16] = {0}, sends = 0, recvs = 0, receivers = 0, replicas = 0;
    for (int r = 0; r < world; r++) {
        assert_int_equal(ast_coherence_hier_plan(regs[r], id, &h[r]), 0);
        if (h[r].is_representative)
            reps_per_node[h[r].node]++;
        sends += h[r].inter == AST_COH_INTER_SEND;
        recvs += h[r].inter == AST_COH_INTER_RECV;
        receivers += h[r].recv_level >= 0;
        replicas += h[r].is_replica;
    }
    int nodes_seen = 0;
    for (int k = 0; k < 16; k++) {
        assert_true(reps_per_node[k] <= 1);
        nodes_seen += reps_per_node[k];
    }
    assert_int_equal(nodes_seen, expect_nodes);
    assert_int_equal(h[0].nodes, expect_nodes);
    assert_int_equal(sends, expect_nodes > 1);
    assert_int_equal(recvs, expect_nodes - 1);
    assert_int_equal(receivers, replicas - 1);
    /* representatives: the lowest replica rank of each node, also through the list call */
    int reps[16];
    size_t n;
    assert_int_equal(ast_coherence_representatives(regs[0], id, reps, 16, &n), 0);
    assert_int_equal((int)n, expect_nodes);
    for (int r = 0; r < world; r++)
        if (h[r].is_representative) {
            int found = 0;
            for (size_t k = 0; k < n; k++)
                found |= reps[k] == r;
            assert_true(found);
            for (int q = 0; q < r; q++)
                assert_false(h[q].is_replica && h[q].node == h[r].node);
        }
}

static void test_hier_plan(void **state)
{
    (void)state;
    /* DDP on 2 x 2 */
    uint64_t ids[16], costs[16];
    for (int i = 0; i < 16; i++) {
        ids[i] = (uint64_t)(100 + i);
        costs[i] = ast_coherence_dim_cost((uint64_t)(64 + 16 * i));
    }
    ast_coherence *regs[W];
    make_world(regs, 1, ids, costs, 16, 7);
    int owners_seen[W] = {0};
    for (int i = 0; i < 16; i++) {
        check_reps(regs, W, ids[i], 2);
        ast_coherence_hier h;
        int o = owner_of(regs[0], ids[i]);
        owners_seen[o] = 1;
        assert_int_equal(ast_coherence_hier_plan(regs[o], ids[i], &h), 0);
        assert_int_equal(h.write_shm, 1); /* the owner's node has another replica */
        assert_int_equal(h.read_shm, 0);
        assert_int_equal(h.recv_level, -1);
        assert_int_equal(h.inter_root, (o / RPN) * RPN); /* local rank 0 of the owner's node */
    }
    for (int r = 0; r < W; r++)
        assert_true(owners_seen[r]);
    int ranks[W];
    size_t n;
    assert_int_equal(ast_coherence_replicas(regs[1], ids[0], ranks, W, &n), 0);
    assert_int_equal(n, W);
    for (int r = 0; r < W; r++)
        assert_int_equal(ranks[r], r);
    assert_int_equal(ast_coherence_representatives(regs[1], ids[0], NULL, 0, &n), 0);
    assert_int_equal(n, 2);
    destroy_world(regs);

    /* HSDP on 2 x 2: shard within a node, replicate across nodes. Ranks 0 and 2 hold shard 0,
     * 1 and 3 shard 1; each registers only its shard's blocks (same ids in both groups). */
    const int group[W] = {0, 1, 0, 1};
    ast_coherence *h[W];
    for (int r = 0; r < W; r++) {
        h[r] = make_reg(W, r, RPN, 1, group);
        for (int i = 0; i < 8; i++)
            assert_int_equal(ast_coherence_register_block(h[r], ids[(i * 3 + r) % 8],
                                                          costs[(i * 3 + r) % 8], NULL, 0), 0);
        assert_int_equal(ast_coherence_plan(h[r]), 0);
    }
    for (int i = 0; i < 8; i++) {
        int o0 = owner_of(h[0], ids[i]), o1 = owner_of(h[1], ids[i]);
        assert_int_equal(owner_of(h[2], ids[i]), o0);
        assert_int_equal(owner_of(h[3], ids[i]), o1);
        assert_true(o0 == 0 || o0 == 2);
        assert_true(o1 == 1 || o1 == 3);
        ast_coherence_hier p;
        assert_int_equal(ast_coherence_hier_plan(h[o0 == 0 ? 2 : 0], ids[i], &p), 0);
        assert_int_equal(p.nodes, 2);
        assert_int_equal(p.node_replicas, 1);
        assert_int_equal(p.inter, AST_COH_INTER_RECV);
        assert_int_equal(p.recv_level, AST_COH_INTER_NODE);
        assert_int_equal(p.write_shm, 0); /* nobody else on its node reads this shard */
        assert_int_equal(p.read_shm, 0);
        assert_int_equal(p.inter_root, o0);
    }
    for (int r = 0; r < W; r++)
        ast_coherence_destroy(h[r]);

    /* Uneven nodes from the launcher: 6 ranks on node ids {3, 3, 3, 0, 7, 7}; a block on an
     * explicit replica subset {1, 2, 3, 5}. */
    const int nodes[6] = {3, 3, 3, 0, 7, 7};
    ast_coherence *u[6];
    const int rr[4] = {5, 3, 2, 1};
    for (int r = 0; r < 6; r++) {
        ast_coherence_opts o;
        ast_coherence_opts_init(&o);
        o.world_size = 6;
        o.rank = r;
        o.ranks_per_node = 0;
        o.node_ids = nodes;
        assert_int_equal(ast_coherence_create(&o, &u[r], NULL, 0), 0);
        assert_int_equal(ast_coherence_register_block(u[r], 42, 1000, rr, 4), 0);
        assert_int_equal(ast_coherence_register_block(u[r], 43, 1000, NULL, 0), 0);
        assert_int_equal(ast_coherence_plan(u[r]), 0);
        ast_coherence_stats st;
        assert_int_equal(ast_coherence_stats_get(u[r], &st), 0);
        assert_int_equal(st.nodes, 3);
        assert_int_equal(st.node, nodes[r]);
    }
    check_reps(u, 6, 42, 3);
    check_reps(u, 6, 43, 3);
    int reps[8];
    assert_int_equal(ast_coherence_representatives(u[4], 42, reps, 8, &n), 0);
    assert_int_equal(n, 3);
    assert_int_equal(reps[0], 1);
    assert_int_equal(reps[1], 3);
    assert_int_equal(reps[2], 5);
    ast_coherence_hier p;
    assert_int_equal(ast_coherence_hier_plan(u[0], 42, &p), 0);
    assert_int_equal(p.is_replica, 0);
    assert_int_equal(p.representative, 1);
    assert_int_equal(p.recv_level, -1);
    assert_int_equal(p.inter, AST_COH_INTER_NONE);
    assert_int_equal(ast_coherence_hier_plan(u[4], 42, &p), 0);
    assert_int_equal(p.is_replica, 0);
    assert_int_equal(p.representative, 5); /* node 7's one replica of block 42 */
    assert_int_equal(p.node_replicas, 1);
    for (int r = 0; r < 6; r++)
        ast_coherence_destroy(u[r]);
}

/* ---- bad inputs ----------------------------------------------------------------------------- */

static void expect_msg(ast_coherence *reg, const char *needle)
{
    char buf[512];
    assert_int_equal(ast_coherence_last_error(reg, buf, sizeof buf), 0);
    if (!strstr(buf, needle))
        fail_msg("last error \"%s\" does not mention \"%s\"", buf, needle);
}

static void test_bad_inputs(void **state)
{
    (void)state;
    ast_coherence_opts o;
    ast_coherence *reg = (ast_coherence *)&o;
    char err[256];
    ast_coherence_opts_init(&o);
    o.staleness = -1;
    assert_int_equal(ast_coherence_create(&o, &reg, err, sizeof err), AST_EINVAL);
    assert_null(reg);
    assert_non_null(strstr(err, "staleness -1"));
    ast_coherence_opts_init(&o);
    o.world_size = 4;
    o.rank = 4;
    assert_int_equal(ast_coherence_create(&o, &reg, NULL, 0), AST_EINVAL);
    o.rank = 0;
    o.ranks_per_node = 0;
    assert_int_equal(ast_coherence_create(&o, &reg, err, sizeof err), AST_EINVAL);
    assert_non_null(strstr(err, "ranks_per_node"));
    const int bad_nodes[4] = {0, 0, -1, 1};
    o.node_ids = bad_nodes;
    assert_int_equal(ast_coherence_create(&o, &reg, NULL, 0), AST_EINVAL);
    assert_int_equal(ast_coherence_create(NULL, &reg, NULL, 0), AST_EINVAL);
    assert_int_equal(ast_coherence_create(&o, NULL, NULL, 0), AST_EINVAL);

    reg = make_reg(W, 1, RPN, 2, NULL);
    int o_;
    uint64_t v;
    size_t n;
    /* before the plan */
    assert_int_equal(ast_coherence_owner(reg, 1, &o_), AST_ESTATE);
    assert_int_equal(ast_coherence_due(reg, 0, NULL, 0, &n), AST_ESTATE);
    assert_int_equal(ast_coherence_publish(reg, 1, 1, 0), AST_ESTATE);
    /* registration */
    const int out_of_range[2] = {0, 7}, dup[2] = {2, 2};
    assert_int_equal(ast_coherence_register_block(reg, 1, 10, out_of_range, 2), AST_EINVAL);
    expect_msg(reg, "replica rank 7 outside [0, 4)");
    assert_int_equal(ast_coherence_register_block(reg, 1, 10, dup, 2), AST_EINVAL);
    expect_msg(reg, "listed twice");
    assert_int_equal(ast_coherence_register_block(reg, 1, 0, NULL, 0), AST_EINVAL);
    assert_int_equal(ast_coherence_register_block(reg, 1, 10, dup, 0), AST_EINVAL);
    assert_int_equal(ast_coherence_register_block(reg, 1, 10, NULL, 2), AST_EINVAL);
    assert_int_equal(ast_coherence_register_block(reg, 1, 10, NULL, 0), 0);
    assert_int_equal(ast_coherence_register_block(reg, 1, 10, NULL, 0), AST_EINVAL);
    expect_msg(reg, "already registered");
    assert_int_equal(ast_coherence_register_block(reg, 2, 5, NULL, 0), 0);
    assert_int_equal(ast_coherence_plan(reg), 0);
    assert_int_equal(ast_coherence_register_block(reg, 3, 5, NULL, 0), AST_ESTATE);
    /* queries: block 1 (the costlier) is rank 0's, block 2 is rank 1's (this one) */
    assert_int_equal(ast_coherence_owner(reg, 99, &o_), AST_ENOENT);
    expect_msg(reg, "block 99");
    assert_int_equal(ast_coherence_is_owner(reg, 99), AST_ENOENT);
    assert_int_equal(ast_coherence_owner(reg, 1, NULL), AST_EINVAL);
    assert_int_equal(ast_coherence_owner(reg, 1, &o_), 0);
    assert_int_equal(o_, 0);
    assert_int_equal(ast_coherence_is_owner(reg, 2), 1);
    assert_int_equal(ast_coherence_load(reg, 4, &v), AST_EINVAL);
    assert_int_equal(ast_coherence_install_version(reg, 99, 0, &v), AST_ENOENT);
    ast_coherence_hier h;
    assert_int_equal(ast_coherence_hier_plan(reg, 99, &h), AST_ENOENT);
    assert_int_equal(ast_coherence_count_bytes(reg, AST_COH_LEVEL_COUNT, 1), AST_EINVAL);
    /* versions */
    assert_int_equal(ast_coherence_publish(reg, 1, 1, 0), AST_EINVAL);
    expect_msg(reg, "not the owner");
    assert_int_equal(ast_coherence_publish(reg, 2, 1, -1), AST_EINVAL);
    assert_int_equal(ast_coherence_publish(reg, 2, 0, 0), AST_EINVAL);
    assert_int_equal(ast_coherence_publish(reg, 2, 2, 3), 0);
    assert_int_equal(ast_coherence_publish(reg, 2, 2, 4), AST_EINVAL);
    assert_int_equal(ast_coherence_publish(reg, 2, 3, 3), AST_EINVAL);
    assert_int_equal(ast_coherence_received(reg, 2, 2, 0), AST_EINVAL);
    expect_msg(reg, "its owner");
    assert_int_equal(ast_coherence_received(reg, 1, 1, 0), AST_ESTATE);
    expect_msg(reg, "never announced");
    assert_int_equal(ast_coherence_mark_synced(reg, 1, 1, 0), AST_ESTATE);
    /* the exchange at step 3: block 1 (rank 0's), then block 2 (this rank's, nothing due) */
    int64_t good[6] = {1, 1, 0, 0, 0, 0};
    assert_int_equal(ast_coherence_versions_import(reg, 3, good, 5), AST_EINVAL);
    assert_int_equal(ast_coherence_versions_import(reg, 3, NULL, 6), AST_EINVAL);
    assert_int_equal(ast_coherence_versions_import(reg, -1, good, 6), AST_EINVAL);
    int64_t not_due[6] = {1, 2, 0, 0, 0, 0};
    assert_int_equal(ast_coherence_versions_import(reg, 3, not_due, 6), AST_EINVAL);
    expect_msg(reg, "not due at step 3");
    int64_t theirs[6] = {1, 1, 0, 3, 1, 2};
    assert_int_equal(ast_coherence_versions_import(reg, 3, theirs, 6), AST_ESTATE);
    expect_msg(reg, "owners disagree");
    ast_coherence_block bi;
    assert_int_equal(ast_coherence_block_info(reg, 1, &bi), 0);
    assert_int_equal(bi.version, 0); /* all or nothing: block 1's entry was not applied */
    int64_t skipped[6] = {2, 1, 1, 0, 0, 0};
    assert_int_equal(ast_coherence_versions_import(reg, 3, skipped, 6), AST_ESTATE);
    expect_msg(reg, "an exchange was skipped");
    int64_t negative[6] = {1, -1, 0, 0, 0, 0};
    assert_int_equal(ast_coherence_versions_import(reg, 3, negative, 6), AST_EINVAL);
    assert_int_equal(ast_coherence_versions_import(reg, 3, good, 6), 0);
    assert_int_equal(ast_coherence_versions_import(reg, 3, good, 6), 0); /* again: no change */
    int64_t contradicts[6] = {1, 0, 0, 0, 0, 0};
    assert_int_equal(ast_coherence_versions_import(reg, 3, contradicts, 6), AST_EINVAL);
    expect_msg(reg, "contradicts");
    int64_t mine[6];
    assert_int_equal(ast_coherence_versions_export(reg, 5, mine, 6), 0);
    assert_int_equal(mine[0], 0); /* not this rank's block */
    assert_int_equal(mine[3], 2); /* block 2: version 2, snapshot 3, due at 5 */
    assert_int_equal(mine[4], 3);
    assert_int_equal(mine[5], 0);
    /* steps: block 1's version (snapshot 1) installs at 3; this rank has not received it */
    assert_int_equal(ast_coherence_install_version(reg, 1, 2, &v), 0);
    assert_int_equal(v, 0);
    assert_int_equal(ast_coherence_install_version(reg, 1, 3, &v), AST_EBUSY);
    assert_int_equal(v, 1);
    expect_msg(reg, "sync first");
    assert_int_equal(ast_coherence_due(reg, 2, NULL, 0, &n), AST_EINVAL);
    expect_msg(reg, "older than step 3");
    assert_int_equal(ast_coherence_due(reg, -1, NULL, 0, &n), AST_EINVAL);
    assert_int_equal(ast_coherence_mark_synced(reg, 1, 1, 3), AST_ESTATE);
    expect_msg(reg, "has not received");
    assert_int_equal(ast_coherence_received(reg, 1, 1, 3), 0);
    assert_int_equal(ast_coherence_received(reg, 1, 1, 3), 0);
    assert_int_equal(ast_coherence_received(reg, 1, 0, 3), AST_EINVAL);
    assert_int_equal(ast_coherence_mark_synced(reg, 1, 1, 3), 0);
    assert_int_equal(ast_coherence_mark_synced(reg, 1, 0, 3), AST_EINVAL);
    assert_int_equal(ast_coherence_install_version(reg, 1, 3, &v), 0);
    assert_int_equal(v, 1);
    /* late: a snapshot at step 1 would have been due at 3, already evaluated */
    assert_int_equal(ast_coherence_publish(reg, 2, 3, 1), AST_EINVAL); /* not after step 3 */
    assert_int_equal(ast_coherence_versions_export(reg, 2, mine, 6), AST_EINVAL);
    expect_msg(reg, "older than step 3");
    ast_coherence *r0 = make_reg(W, 0, RPN, 2, NULL);
    assert_int_equal(ast_coherence_register_block(r0, 1, 10, NULL, 0), 0);
    assert_int_equal(ast_coherence_plan(r0), 0);
    assert_int_equal(ast_coherence_due(r0, 5, NULL, 0, &n), 0);
    assert_int_equal(ast_coherence_publish(r0, 1, 1, 3), AST_ESTATE);
    expect_msg(r0, "late");
    assert_int_equal(ast_coherence_publish(r0, 1, 1, 4), 0);
    ast_coherence_destroy(r0);
    ast_coherence *r1 = make_reg(W, 1, RPN, 2, NULL); /* block 1 is rank 0's */
    assert_int_equal(ast_coherence_register_block(r1, 1, 10, NULL, 0), 0);
    assert_int_equal(ast_coherence_plan(r1), 0);
    assert_int_equal(ast_coherence_due(r1, 5, NULL, 0, &n), 0);
    int64_t late[3] = {1, 3, 0}; /* due at 5, which this rank has evaluated without it */
    assert_int_equal(ast_coherence_versions_import(r1, 5, late, 3), AST_ESTATE);
    expect_msg(r1, "late");
    assert_int_equal(ast_coherence_versions_import(r1, 4, late, 3), AST_EINVAL);
    ast_coherence_destroy(r1);
    /* barrier brackets */
    assert_int_equal(ast_coherence_barrier_end(reg, 3), AST_ESTATE);
    assert_int_equal(ast_coherence_barrier_begin(reg, 3), 0);
    assert_int_equal(ast_coherence_barrier_begin(reg, 3), AST_ESTATE);
    assert_int_equal(ast_coherence_barrier_end(reg, 4), AST_EINVAL);
    assert_int_equal(ast_coherence_barrier_end(reg, 3), 0);
    ast_coherence_stats st;
    assert_int_equal(ast_coherence_stats_get(reg, &st), 0);
    assert_int_equal(st.barrier_waits, 1);
    assert_int_equal(st.installs, 1);
    assert_int_equal(st.max_lag_steps, 2);
    assert_int_equal(ast_coherence_last_error(reg, err, 0), AST_EINVAL);
    ast_coherence_destroy(reg);
    ast_coherence_destroy(NULL);
    assert_int_equal(ast_coherence_dim_cost(10), 1000);
    assert_int_equal(ast_coherence_dim_cost(UINT64_MAX / 2), UINT64_MAX);
}

/* ---- concurrency ---------------------------------------------------------------------------- */

#define THREADS 4
#define PER_THREAD 200

struct worker_arg {
    ast_coherence *reg;
    int index;
};

static void *publisher(void *p)
{
    struct worker_arg *a = p;
    for (int k = 1; k <= PER_THREAD; k++) {
        uint64_t id = (uint64_t)a->index;
        /* snapshot steps far ahead of what the main thread evaluates: never late */
        if (ast_coherence_publish(a->reg, id, (uint64_t)k, 100000 + k) != 0)
            return (void *)1;
        if (ast_coherence_count_bytes(a->reg, AST_COH_INTER_NODE, 3) != 0)
            return (void *)1;
        ast_coherence_stats st;
        ast_coherence_block bi;
        if (ast_coherence_stats_get(a->reg, &st) != 0 ||
            ast_coherence_block_info(a->reg, id, &bi) != 0 || bi.version != (uint64_t)k)
            return (void *)1;
    }
    return NULL;
}

static void test_threads(void **state)
{
    (void)state;
    ast_coherence *reg = make_reg(1, 0, 1, 3, NULL);
    for (uint64_t id = 0; id < THREADS; id++)
        assert_int_equal(ast_coherence_register_block(reg, id, 1 + id, NULL, 0), 0);
    assert_int_equal(ast_coherence_plan(reg), 0);
    pthread_t th[THREADS];
    struct worker_arg args[THREADS];
    for (int i = 0; i < THREADS; i++) {
        args[i].reg = reg;
        args[i].index = i;
        assert_int_equal(pthread_create(&th[i], NULL, publisher, &args[i]), 0);
    }
    for (int64_t s = 0; s < 500; s++) {
        uint64_t due[THREADS];
        size_t n;
        assert_int_equal(ast_coherence_due(reg, s, due, THREADS, &n), 0);
        assert_int_equal(n, 0);
        assert_int_equal(ast_coherence_barrier_begin(reg, s), 0);
        assert_int_equal(ast_coherence_barrier_end(reg, s), 0);
    }
    for (int i = 0; i < THREADS; i++) {
        void *ret;
        pthread_join(th[i], &ret);
        assert_null(ret);
    }
    ast_coherence_stats st;
    assert_int_equal(ast_coherence_stats_get(reg, &st), 0);
    assert_int_equal(st.published, THREADS * PER_THREAD);
    assert_int_equal(st.bytes[AST_COH_INTER_NODE], 3u * THREADS * PER_THREAD);
    assert_int_equal(st.barrier_waits, 500);
    /* one rank: the newest version of each block is due at snapshot + S */
    uint64_t due[THREADS];
    size_t n;
    assert_int_equal(ast_coherence_due(reg, 100000 + PER_THREAD + 3, due, THREADS, &n), 0);
    assert_int_equal(n, THREADS);
    uint64_t v;
    assert_int_equal(ast_coherence_install_version(reg, 2, 100000 + PER_THREAD + 3, &v), 0);
    assert_int_equal(v, PER_THREAD);
    ast_coherence_destroy(reg);
}

/* ---- incremental registration (ast_coherence_extend) -------------------------------------- */

static void test_extend(void **state)
{
    (void)state;
    /* One batch on a fresh registry equals register + plan of the same blocks. */
    uint64_t seed = 0x5eed5eedULL, ids[64], costs[64];
    random_blocks(ids, costs, 64, &seed);
    ast_coherence *regs[W];
    make_world(regs, 2, ids, costs, 64, 7);
    ast_coherence *ext[W];
    for (int r = 0; r < W; r++) {
        ext[r] = make_reg(W, r, RPN, 2, NULL);
        assert_int_equal(ast_coherence_extend(ext[r], ids, costs, 64, NULL, 0), 0);
        for (int i = 0; i < 64; i++) {
            int a, b;
            assert_int_equal(ast_coherence_owner(regs[r], ids[i], &a), 0);
            assert_int_equal(ast_coherence_owner(ext[r], ids[i], &b), 0);
            assert_int_equal(a, b);
        }
    }
    destroy_world(regs);

    /* A second batch (each rank in its own order): old owners stay, new ones agree everywhere,
     * and LPT continues from the loads. */
    int before[64];
    for (int i = 0; i < 64; i++)
        assert_int_equal(ast_coherence_owner(ext[0], ids[i], &before[i]), 0);
    uint64_t ids2[16], costs2[16];
    for (int i = 0; i < 16; i++) {
        ids2[i] = 5 + 3 * (uint64_t)i; /* below and between nothing: ids 5..50 are new */
        costs2[i] = ast_coherence_dim_cost(64 + 16 * (uint64_t)(i % 5));
    }
    for (int r = 0; r < W; r++) {
        uint64_t pi[16], pc[16], perm[16];
        for (int i = 0; i < 16; i++)
            perm[i] = (uint64_t)i;
        uint64_t s2 = 77 + (uint64_t)r;
        shuffle(perm, 16, &s2);
        for (int i = 0; i < 16; i++) {
            pi[i] = ids2[perm[i]];
            pc[i] = costs2[perm[i]];
        }
        assert_int_equal(ast_coherence_extend(ext[r], pi, pc, 16, NULL, 0), 0);
        size_t nb;
        assert_int_equal(ast_coherence_nblocks(ext[r], &nb), 0);
        assert_int_equal(nb, 80);
    }
    uint64_t load0[W];
    for (int q = 0; q < W; q++)
        assert_int_equal(ast_coherence_load(ext[0], q, &load0[q]), 0);
    for (int r = 0; r < W; r++) {
        for (int i = 0; i < 64; i++) {
            int o;
            assert_int_equal(ast_coherence_owner(ext[r], ids[i], &o), 0);
            assert_int_equal(o, before[i]);
        }
        for (int i = 0; i < 16; i++) {
            int a, b;
            assert_int_equal(ast_coherence_owner(ext[0], ids2[i], &a), 0);
            assert_int_equal(ast_coherence_owner(ext[r], ids2[i], &b), 0);
            assert_int_equal(a, b);
        }
        for (int q = 0; q < W; q++) {
            uint64_t l;
            assert_int_equal(ast_coherence_load(ext[r], q, &l), 0);
            assert_int_equal(l, load0[q]);
        }
    }
    for (int r = 0; r < W; r++)
        ast_coherence_destroy(ext[r]);

    /* LPT continuation by hand, replicas {0, 1}: first batch 9 -> 0, 4 -> 1 (loads 9, 4); second
     * batch 5 -> 1 (4 < 9: loads 9, 9), 2 -> 0 (tie: lowest rank). */
    ast_coherence *reg = make_reg(W, 1, RPN, 0, NULL);
    const int rr[2] = {1, 0};
    const uint64_t a_ids[2] = {1, 2}, a_costs[2] = {9, 4};
    const uint64_t b_ids[2] = {3, 4}, b_costs[2] = {2, 5};
    assert_int_equal(ast_coherence_extend(reg, a_ids, a_costs, 2, rr, 2), 0);
    assert_int_equal(ast_coherence_extend(reg, b_ids, b_costs, 2, rr, 2), 0);
    const int want[5] = {-1, 0, 1, 0, 1};
    for (uint64_t id = 1; id <= 4; id++)
        assert_int_equal(owner_of(reg, id), want[id]);
    ast_coherence_stats st;
    assert_int_equal(ast_coherence_stats_get(reg, &st), 0);
    assert_int_equal(st.blocks, 4);
    assert_int_equal(st.owned, 2);
    assert_int_equal(st.load, 9);

    /* Atomic failures: nothing is registered. */
    const uint64_t dup_ids[3] = {10, 11, 10}, ok_costs[3] = {1, 1, 1};
    assert_int_equal(ast_coherence_extend(reg, dup_ids, ok_costs, 3, NULL, 0), AST_EINVAL);
    const uint64_t old_ids[2] = {12, 2};
    assert_int_equal(ast_coherence_extend(reg, old_ids, ok_costs, 2, NULL, 0), AST_EINVAL);
    const uint64_t zc_ids[2] = {12, 13}, zc_costs[2] = {1, 0};
    assert_int_equal(ast_coherence_extend(reg, zc_ids, zc_costs, 2, NULL, 0), AST_EINVAL);
    const int bad_rr[2] = {0, 9};
    assert_int_equal(ast_coherence_extend(reg, zc_ids, ok_costs, 2, bad_rr, 2), AST_EINVAL);
    assert_int_equal(ast_coherence_extend(reg, NULL, ok_costs, 2, NULL, 0), AST_EINVAL);
    char err[256];
    assert_int_equal(ast_coherence_last_error(reg, err, sizeof err), 0);
    assert_non_null(strstr(err, "extend"));
    size_t nb;
    assert_int_equal(ast_coherence_nblocks(reg, &nb), 0);
    assert_int_equal(nb, 4);
    assert_int_equal(ast_coherence_register_block(reg, 20, 1, NULL, 0), AST_ESTATE);
    assert_int_equal(ast_coherence_extend(reg, NULL, NULL, 0, NULL, 0), 0);
    ast_coherence_destroy(reg);
}

/* Blocks met lazily: a first refresh of blocks 1..4, then blocks 5..6 extended while 1..4 are in
 * flight; the exchange vector grows with them and the full protocol still installs the same
 * versions on every rank at t + S. */
static void test_extend_protocol(void **state)
{
    (void)state;
    const int S = 2;
    ast_coherence *regs[W];
    const uint64_t first[4] = {1, 2, 3, 4}, fc[4] = {8, 8, 8, 8};
    const uint64_t later[2] = {5, 6}, lc[2] = {27, 1};
    for (int r = 0; r < W; r++) {
        regs[r] = make_reg(W, r, RPN, S, NULL);
        assert_int_equal(ast_coherence_extend(regs[r], first, fc, 4, NULL, 0), 0);
    }
    for (int r = 0; r < W; r++)
        for (int i = 0; i < 4; i++)
            if (ast_coherence_is_owner(regs[r], first[i]) == 1)
                assert_int_equal(ast_coherence_publish(regs[r], first[i], 1, 10), 0);
    for (int r = 0; r < W; r++) {
        assert_int_equal(ast_coherence_extend(regs[r], later, lc, 2, NULL, 0), 0);
        ast_coherence_stats st;
        assert_int_equal(ast_coherence_stats_get(regs[r], &st), 0);
        assert_int_equal(st.blocks, 6);
    }
    int owner5;
    assert_int_equal(ast_coherence_owner(regs[2], 5, &owner5), 0);
    /* all four ranks carry cost 8; 27 goes to rank 0, 1 to rank 1 */
    assert_int_equal(owner5, 0);
    for (int r = 0; r < W; r++)
        if (ast_coherence_is_owner(regs[r], 5) == 1)
            assert_int_equal(ast_coherence_publish(regs[r], 5, 1, 11), 0);
    for (int64_t step = 12; step <= 13; step++) {
        int64_t acc[6 * AST_COH_XCHG_STRIDE] = {0}, v[6 * AST_COH_XCHG_STRIDE];
        for (int r = 0; r < W; r++) {
            assert_int_equal(ast_coherence_versions_export(regs[r], step, v, 18), 0);
            for (int k = 0; k < 18; k++)
                acc[k] = v[k] > acc[k] ? v[k] : acc[k];
        }
        for (int r = 0; r < W; r++) {
            assert_int_equal(ast_coherence_versions_import(regs[r], step, acc, 18), 0);
            uint64_t due[6];
            size_t n;
            assert_int_equal(ast_coherence_due(regs[r], step, due, 6, &n), 0);
            assert_int_equal(n, step == 12 ? 4 : 1);
            for (size_t k = 0; k < n; k++) {
                if (ast_coherence_is_owner(regs[r], due[k]) == 0)
                    assert_int_equal(ast_coherence_received(regs[r], due[k], 1, step), 0);
                assert_int_equal(ast_coherence_mark_synced(regs[r], due[k], 1, step), 0);
            }
            for (uint64_t b = 1; b <= 6; b++) {
                uint64_t ver;
                assert_int_equal(ast_coherence_install_version(regs[r], b, step, &ver), 0);
                assert_int_equal(ver, b <= 4 || (b == 5 && step == 13) ? 1u : 0u);
            }
        }
    }
    for (int r = 0; r < W; r++) {
        ast_coherence_stats st;
        assert_int_equal(ast_coherence_stats_get(regs[r], &st), 0);
        assert_int_equal(st.max_lag_steps, S);
        assert_int_equal(st.installs, 5);
    }
    destroy_world(regs);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_owner_identical),
        cmocka_unit_test(test_owner_tiebreak),
        cmocka_unit_test(test_load_balance),
        cmocka_unit_test(test_due_changed_only),
        cmocka_unit_test(test_install_random),
        cmocka_unit_test(test_hier_plan),
        cmocka_unit_test(test_bad_inputs),
        cmocka_unit_test(test_threads),
        cmocka_unit_test(test_extend),
        cmocka_unit_test(test_extend_protocol),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
