/*
 * coherence.c - the CoherenceRegistry (coherence.h): owners, announced versions, the due and
 * install rules, hierarchical plans, byte and barrier accounting.
 *
 * Owns: the block table (id -> cost, interned replica set, owner, versions), the interned
 * replica sets with their per-node representatives, the per-rank loads, the counters behind
 * ast_coherence_stats and the last-error message. May call: libc, pthreads, util.h (the block
 * index, the hash mix, the last-error setter). Moves no data.
 *
 * Locking: one mutex per registry, held by every public function for its whole duration;
 * nothing inside blocks or calls out, so there is no lock order to keep. ast_coherence_destroy
 * must not race with other calls.
 *
 * Versions per block: `cur` is the newest announced version whose snapshot step t satisfies
 * t + S <= evaluated (the newest step evaluated); `pend` holds, ascending, the announced versions
 * not yet there. Evaluating a newer step moves entries from pend to cur, superseded ones
 * dropped, so the install answer for any step >= evaluated is cur after that move - which is why
 * evaluated steps may not go backwards and why an announcement landing in the past is refused.
 */
#include "asteria/coherence.h"

#include "asteria/errors.h"
#include "util.h"

#include <inttypes.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

struct ver {
    uint64_t v;    /* 0: none */
    int64_t t;     /* snapshot step; -1 with v == 0 */
    uint64_t prev; /* the version announced before it (0: none) */
};

/* A replica set, shared by every block registered with the same ranks. */
struct vset {
    int *ranks;     /* ascending */
    int n;
    uint64_t hash;
    int self_member;
    int nnodes;
    int *node_id;   /* per node holding a member, ascending node id */
    int *node_rep;  /* its lowest member rank */
    int *node_cnt;  /* its member count */
};

struct blk {
    ast__hnode node;      /* in reg->index, key = id */
    uint64_t id;
    uint64_t cost;
    struct vset *set;
    int owner;            /* -1 before the plan */
    struct ver pub;       /* newest announced */
    struct ver cur;       /* newest announced with t + S <= evaluated */
    struct ver *pend;     /* announced, t + S > evaluated, ascending */
    size_t npend, cappend;
    uint64_t held, synced, installed;
    int64_t sync_step, recv_step;
};

struct ast_coherence {
    pthread_mutex_t mu;
    int world, rank, S;
    int *node;          /* node id per rank */
    int nodes;          /* distinct node ids */
    struct vset *default_set; /* the replicas of this rank's group (opts.replica_group) */

    struct vset **sets;
    size_t nsets, capsets;

    struct blk *blocks; /* ascending by id after the plan */
    size_t nblocks, capblocks;
    ast__htable index;  /* id -> block; re-linked whenever blocks[] moves (reindex) */
    int planned;
    uint64_t *load;     /* per rank */

    int64_t evaluated;  /* newest evaluated step, -1: none */
    int barrier_open;
    int64_t barrier_step;
    uint64_t barrier_t0;

    ast_coherence_stats st;
    ast__last_error err;
};

static uint64_t sat_add(uint64_t a, uint64_t b)
{
    return a > UINT64_MAX - b ? UINT64_MAX : a + b;
}

uint64_t ast_coherence_dim_cost(uint64_t n)
{
    if (n != 0 && n > UINT64_MAX / n)
        return UINT64_MAX;
    uint64_t sq = n * n;
    if (n != 0 && sq > UINT64_MAX / n)
        return UINT64_MAX;
    return sq * n;
}

void ast_coherence_opts_init(ast_coherence_opts *o)
{
    if (!o)
        return;
    memset(o, 0, sizeof *o);
    o->world_size = 1;
    o->rank = 0;
    o->ranks_per_node = 1;
    o->staleness = 5;
}

/* ---- replica sets ------------------------------------------------------------------------- */

static int cmp_int(const void *a, const void *b)
{
    int x = *(const int *)a, y = *(const int *)b;
    return (x > y) - (x < y);
}

static void vset_free(struct vset *s)
{
    if (!s)
        return;
    free(s->ranks);
    free(s->node_id);
    free(s->node_rep);
    free(s->node_cnt);
    free(s);
}

static uint64_t ranks_hash(const int *r, int n)
{
    uint64_t h = ast__mix64((uint64_t)n + 0x9e3779b97f4a7c15ULL);
    for (int i = 0; i < n; i++)
        h = ast__mix64(h ^ (uint64_t)(unsigned)r[i]);
    return h;
}

/* Builds a set from sorted, distinct, in-range ranks (the array is adopted). */
static struct vset *vset_new(const ast_coherence *reg, int *sorted, int n)
{
    struct vset *s = calloc(1, sizeof *s);
    if (!s) {
        free(sorted);
        return NULL;
    }
    s->ranks = sorted;
    s->n = n;
    s->hash = ranks_hash(sorted, n);
    s->node_id = malloc((size_t)n * sizeof(int));
    s->node_rep = malloc((size_t)n * sizeof(int));
    s->node_cnt = malloc((size_t)n * sizeof(int));
    if (!s->node_id || !s->node_rep || !s->node_cnt) {
        vset_free(s);
        return NULL;
    }
    /* Ranks ascend, so the first member met on a node is its lowest: the representative. */
    for (int i = 0; i < n; i++) {
        int r = sorted[i], nd = reg->node[r], k;
        if (r == reg->rank)
            s->self_member = 1;
        for (k = 0; k < s->nnodes && s->node_id[k] != nd; k++)
            ;
        if (k == s->nnodes) {
            s->node_id[k] = nd;
            s->node_rep[k] = r;
            s->node_cnt[k] = 0;
            s->nnodes++;
        }
        s->node_cnt[k]++;
    }
    /* Ascending node id order, keeping rep and count alongside (insertion sort: few nodes). */
    for (int i = 1; i < s->nnodes; i++) {
        int id = s->node_id[i], rep = s->node_rep[i], cnt = s->node_cnt[i], j = i - 1;
        for (; j >= 0 && s->node_id[j] > id; j--) {
            s->node_id[j + 1] = s->node_id[j];
            s->node_rep[j + 1] = s->node_rep[j];
            s->node_cnt[j + 1] = s->node_cnt[j];
        }
        s->node_id[j + 1] = id;
        s->node_rep[j + 1] = rep;
        s->node_cnt[j + 1] = cnt;
    }
    return s;
}

static int vset_node_index(const struct vset *s, int node)
{
    for (int k = 0; k < s->nnodes; k++)
        if (s->node_id[k] == node)
            return k;
    return -1;
}

/* Interns a sorted rank list: returns the existing equal set (freeing sorted) or a new one. */
static int vset_intern(ast_coherence *reg, int *sorted, int n, struct vset **out)
{
    uint64_t h = ranks_hash(sorted, n);
    for (size_t i = 0; i < reg->nsets; i++) {
        struct vset *s = reg->sets[i];
        if (s->hash == h && s->n == n && memcmp(s->ranks, sorted, (size_t)n * sizeof(int)) == 0) {
            free(sorted);
            *out = s;
            return 0;
        }
    }
    if (reg->nsets == reg->capsets) {
        size_t cap = reg->capsets ? 2 * reg->capsets : 8;
        struct vset **p = realloc(reg->sets, cap * sizeof *p);
        if (!p) {
            free(sorted);
            return AST_ENOMEM;
        }
        reg->sets = p;
        reg->capsets = cap;
    }
    struct vset *s = vset_new(reg, sorted, n);
    if (!s)
        return AST_ENOMEM;
    reg->sets[reg->nsets++] = s;
    *out = s;
    return 0;
}

/* ---- block table -------------------------------------------------------------------------- */

static struct blk *lookup(ast_coherence *reg, uint64_t id)
{
    ast__hnode *x = ast__htable_find(&reg->index, id);
    return x ? AST__CONTAINER_OF(x, struct blk, node) : NULL;
}

/* Re-links every block into the index: after blocks[] was reallocated or sorted. */
static void reindex(ast_coherence *reg)
{
    ast__htable_clear(&reg->index);
    for (size_t i = 0; i < reg->nblocks; i++)
        ast__htable_insert(&reg->index, &reg->blocks[i].node);
}

/* Finds a block for a query that needs the plan; sets the message on failure. */
static int planned_block(ast_coherence *reg, uint64_t id, const char *what, struct blk **out)
{
    if (!reg->planned)
        return ast__set_error(&reg->err, NULL, AST_ESTATE,
                              "%s: ast_coherence_plan has not been called", what);
    *out = lookup(reg, id);
    if (!*out)
        return ast__set_error(&reg->err, NULL, AST_ENOENT, "%s: block %" PRIu64
                              " is not registered", what, id);
    return 0;
}

static int step_arg(ast_coherence *reg, int64_t step, const char *what)
{
    if (step < 0)
        return ast__set_error(&reg->err, NULL, AST_EINVAL, "%s: step %" PRId64 " is negative", what,
                              step);
    return 0;
}

/* ---- create / destroy --------------------------------------------------------------------- */

int ast_coherence_create(const ast_coherence_opts *o, ast_coherence **out, char *errbuf,
                         size_t len)
{
    if (errbuf && len)
        errbuf[0] = '\0';
    if (!out)
        return ast__errorf(errbuf, len, AST_EINVAL, "coherence: out is NULL");
    *out = NULL;
    if (!o)
        return ast__errorf(errbuf, len, AST_EINVAL, "coherence: opts is NULL");
    if (o->world_size < 1)
        return ast__errorf(errbuf, len, AST_EINVAL, "coherence: world_size %d < 1", o->world_size);
    if (o->rank < 0 || o->rank >= o->world_size)
        return ast__errorf(errbuf, len, AST_EINVAL, "coherence: rank %d outside [0, %d)", o->rank,
                           o->world_size);
    if (o->staleness < 0)
        return ast__errorf(errbuf, len, AST_EINVAL, "coherence: staleness %d < 0", o->staleness);
    if (!o->node_ids && o->ranks_per_node < 1)
        return ast__errorf(errbuf, len, AST_EINVAL,
                           "coherence: ranks_per_node %d < 1 and no node_ids given",
                           o->ranks_per_node);
    for (int r = 0; o->node_ids && r < o->world_size; r++)
        if (o->node_ids[r] < 0)
            return ast__errorf(errbuf, len, AST_EINVAL, "coherence: node_ids[%d] = %d is negative",
                               r, o->node_ids[r]);
    for (int r = 0; o->replica_group && r < o->world_size; r++)
        if (o->replica_group[r] < 0)
            return ast__errorf(errbuf, len, AST_EINVAL,
                               "coherence: replica_group[%d] = %d is negative", r,
                               o->replica_group[r]);

    ast_coherence *reg = calloc(1, sizeof *reg);
    if (!reg)
        return ast__errorf(errbuf, len, AST_ENOMEM, "coherence: out of memory");
    pthread_mutex_init(&reg->mu, NULL);
    reg->world = o->world_size;
    reg->rank = o->rank;
    reg->S = o->staleness;
    reg->evaluated = -1;
    reg->st.max_lag_steps = -1;
    reg->node = malloc((size_t)reg->world * sizeof(int));
    reg->load = calloc((size_t)reg->world, sizeof(uint64_t));
    int *members = malloc((size_t)reg->world * sizeof(int));
    int *seen = malloc((size_t)reg->world * sizeof(int));
    if (!reg->node || !reg->load || !members || !seen) {
        free(members);
        free(seen);
        ast_coherence_destroy(reg);
        return ast__errorf(errbuf, len, AST_ENOMEM, "coherence: out of memory");
    }
    int nm = 0;
    for (int r = 0; r < reg->world; r++) {
        reg->node[r] = o->node_ids ? o->node_ids[r] : r / o->ranks_per_node;
        if (!o->replica_group || o->replica_group[r] == o->replica_group[reg->rank])
            members[nm++] = r;
        seen[r] = reg->node[r];
    }
    qsort(seen, (size_t)reg->world, sizeof(int), cmp_int);
    for (int r = 0; r < reg->world; r++)
        reg->nodes += r == 0 || seen[r] != seen[r - 1];
    free(seen);
    if (vset_intern(reg, members, nm, &reg->default_set) != 0) {
        ast_coherence_destroy(reg);
        return ast__errorf(errbuf, len, AST_ENOMEM, "coherence: out of memory");
    }
    reg->st.world_size = reg->world;
    reg->st.rank = reg->rank;
    reg->st.node = reg->node[reg->rank];
    reg->st.nodes = reg->nodes;
    reg->st.staleness = reg->S;
    reg->st.evaluated_step = -1;
    *out = reg;
    return 0;
}

void ast_coherence_destroy(ast_coherence *reg)
{
    if (!reg)
        return;
    for (size_t i = 0; i < reg->nblocks; i++)
        free(reg->blocks[i].pend);
    for (size_t i = 0; i < reg->nsets; i++)
        vset_free(reg->sets[i]);
    free(reg->sets);
    free(reg->blocks);
    ast__htable_free(&reg->index);
    free(reg->node);
    free(reg->load);
    pthread_mutex_destroy(&reg->mu);
    free(reg);
}

int ast_coherence_last_error(ast_coherence *reg, char *buf, size_t len)
{
    if (!reg)
        return AST_EINVAL;
    return ast__get_error(&reg->err, &reg->mu, buf, len);
}

/* ---- registration and the plan ------------------------------------------------------------ */

/* The replica set of a registration: the default set, or the interned sorted copy of rr. Checks
 * the list as register_block documents; id only names the block in messages. */
static int replica_set(ast_coherence *reg, uint64_t id, const int *rr, int n, const char *what,
                       struct vset **out)
{
    if (rr ? n < 1 : n != 0)
        return ast__set_error(&reg->err, NULL, AST_EINVAL, "%s %" PRIu64
                              ": nreplicas %d with %s replica list", what, id, n, rr ? "a" : "no");
    *out = reg->default_set;
    if (!rr)
        return 0;
    int *sorted = malloc((size_t)n * sizeof(int));
    if (!sorted)
        return ast__set_error(&reg->err, NULL, AST_ENOMEM, "%s %" PRIu64 ": out of memory", what,
                              id);
    for (int i = 0; i < n; i++) {
        if (rr[i] < 0 || rr[i] >= reg->world) {
            free(sorted);
            return ast__set_error(&reg->err, NULL, AST_EINVAL, "%s %" PRIu64
                                  ": replica rank %d outside [0, %d)", what, id, rr[i], reg->world);
        }
        sorted[i] = rr[i];
    }
    qsort(sorted, (size_t)n, sizeof(int), cmp_int);
    for (int i = 1; i < n; i++)
        if (sorted[i] == sorted[i - 1]) {
            int dup = sorted[i];
            free(sorted);
            return ast__set_error(&reg->err, NULL, AST_EINVAL, "%s %" PRIu64
                                  ": replica rank %d listed twice", what, id, dup);
        }
    if (vset_intern(reg, sorted, n, out) != 0)
        return ast__set_error(&reg->err, NULL, AST_ENOMEM, "%s %" PRIu64 ": out of memory", what,
                              id);
    return 0;
}

/* Room for `more` blocks in the table and the hash, so that adding them cannot fail. */
static int reserve_blocks(ast_coherence *reg, size_t more)
{
    size_t need = reg->nblocks + more;
    if (need > reg->capblocks) {
        size_t cap = reg->capblocks ? reg->capblocks : 64;
        while (cap < need)
            cap *= 2;
        if (ast__htable_reserve(&reg->index, cap) != 0)
            return AST_ENOMEM;
        struct blk *p = realloc(reg->blocks, cap * sizeof *p);
        if (!p)
            return AST_ENOMEM;
        reg->blocks = p;
        reg->capblocks = cap;
        reindex(reg);
    }
    return 0;
}

/* Appends a checked block; reserve_blocks made the room. */
static void add_block(ast_coherence *reg, uint64_t id, uint64_t cost, struct vset *set)
{
    struct blk *b = &reg->blocks[reg->nblocks];
    memset(b, 0, sizeof *b);
    b->id = id;
    b->cost = cost;
    b->set = set;
    b->owner = -1;
    b->pub.t = b->cur.t = -1;
    b->sync_step = b->recv_step = -1;
    b->node.key = id;
    ast__htable_insert(&reg->index, &b->node);
    reg->nblocks++;
}

static int do_register(ast_coherence *reg, uint64_t id, uint64_t cost, const int *rr, int n)
{
    if (reg->planned)
        return ast__set_error(&reg->err, NULL, AST_ESTATE, "register_block %" PRIu64
                              ": the plan is fixed", id);
    if (cost == 0)
        return ast__set_error(&reg->err, NULL, AST_EINVAL, "register_block %" PRIu64 ": cost 0",
                              id);
    if (rr ? n < 1 : n != 0)
        return ast__set_error(&reg->err, NULL, AST_EINVAL, "register_block %" PRIu64
                              ": nreplicas %d with %s replica list", id, n, rr ? "a" : "no");
    if (lookup(reg, id))
        return ast__set_error(&reg->err, NULL, AST_EINVAL, "register_block %" PRIu64
                              ": already registered", id);
    struct vset *set;
    int rc = replica_set(reg, id, rr, n, "register_block", &set);
    if (rc)
        return rc;
    if (reserve_blocks(reg, 1) != 0)
        return ast__set_error(&reg->err, NULL, AST_ENOMEM, "register_block %" PRIu64
                              ": out of memory", id);
    add_block(reg, id, cost, set);
    return 0;
}

int ast_coherence_register_block(ast_coherence *reg, uint64_t block, uint64_t cost,
                                 const int *replica_ranks, int nreplicas)
{
    if (!reg)
        return AST_EINVAL;
    pthread_mutex_lock(&reg->mu);
    int rc = do_register(reg, block, cost, replica_ranks, nreplicas);
    pthread_mutex_unlock(&reg->mu);
    return rc;
}

static int cmp_id(const void *a, const void *b)
{
    uint64_t x = ((const struct blk *)a)->id, y = ((const struct blk *)b)->id;
    return (x > y) - (x < y);
}

/* LPT order: cost descending, then id ascending (ids are unique, so the order is total). */
static int cmp_lpt(const void *a, const void *b)
{
    const struct blk *x = *(const struct blk *const *)a, *y = *(const struct blk *const *)b;
    if (x->cost != y->cost)
        return x->cost < y->cost ? 1 : -1;
    return (x->id > y->id) - (x->id < y->id);
}

/* The LPT rule over the blocks that have no owner yet, continuing from the current loads (every
 * block on the first plan). order: scratch for nblocks pointers. Cannot fail. */
static void assign_owners(ast_coherence *reg, struct blk **order)
{
    /* The table is sorted by id first: registration order must leave no trace. */
    if (reg->nblocks) {
        qsort(reg->blocks, reg->nblocks, sizeof *reg->blocks, cmp_id);
        reindex(reg);
    }
    size_t n = 0;
    for (size_t i = 0; i < reg->nblocks; i++)
        if (reg->blocks[i].owner < 0)
            order[n++] = &reg->blocks[i];
    if (n)
        qsort(order, n, sizeof *order, cmp_lpt);
    for (size_t i = 0; i < n; i++) {
        struct blk *b = order[i];
        int best = b->set->ranks[0]; /* ranks ascend: strict < keeps the lowest on ties */
        for (int k = 1; k < b->set->n; k++)
            if (reg->load[b->set->ranks[k]] < reg->load[best])
                best = b->set->ranks[k];
        b->owner = best;
        reg->load[best] = sat_add(reg->load[best], b->cost);
        if (best == reg->rank) {
            reg->st.owned++;
            reg->st.load = sat_add(reg->st.load, b->cost);
        }
    }
    reg->st.blocks = reg->nblocks;
    reg->planned = 1;
}

static int do_plan(ast_coherence *reg)
{
    if (reg->planned)
        return 0;
    struct blk **order = malloc((reg->nblocks ? reg->nblocks : 1) * sizeof *order);
    if (!order)
        return ast__set_error(&reg->err, NULL, AST_ENOMEM, "plan: out of memory");
    assign_owners(reg, order);
    free(order);
    return 0;
}

int ast_coherence_plan(ast_coherence *reg)
{
    if (!reg)
        return AST_EINVAL;
    pthread_mutex_lock(&reg->mu);
    int rc = do_plan(reg);
    pthread_mutex_unlock(&reg->mu);
    return rc;
}

static int cmp_u64(const void *a, const void *b)
{
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return (x > y) - (x < y);
}

static int do_extend(ast_coherence *reg, const uint64_t *ids, const uint64_t *costs, size_t n,
                     const int *rr, int nr)
{
    if (n && (!ids || !costs))
        return ast__set_error(&reg->err, NULL, AST_EINVAL,
                              "extend: NULL ids or costs for %zu blocks", n);
    for (size_t i = 0; i < n; i++) {
        if (costs[i] == 0)
            return ast__set_error(&reg->err, NULL, AST_EINVAL, "extend %" PRIu64 ": cost 0",
                                  ids[i]);
        if (lookup(reg, ids[i]))
            return ast__set_error(&reg->err, NULL, AST_EINVAL, "extend %" PRIu64
                                  ": already registered", ids[i]);
    }
    if (n > 1) {
        uint64_t *sorted = malloc(n * sizeof *sorted);
        if (!sorted)
            return ast__set_error(&reg->err, NULL, AST_ENOMEM, "extend: out of memory");
        memcpy(sorted, ids, n * sizeof *sorted);
        qsort(sorted, n, sizeof *sorted, cmp_u64);
        uint64_t dup = 0;
        int repeated = 0;
        for (size_t i = 1; i < n && !repeated; i++)
            if (sorted[i] == sorted[i - 1]) {
                dup = sorted[i];
                repeated = 1;
            }
        free(sorted);
        if (repeated)
            return ast__set_error(&reg->err, NULL, AST_EINVAL, "extend %" PRIu64 ": listed twice",
                                  dup);
    }
    struct vset *set;
    int rc = replica_set(reg, n ? ids[0] : 0, rr, nr, "extend", &set);
    if (rc)
        return rc;
    struct blk **order = malloc((reg->nblocks + n ? reg->nblocks + n : 1) * sizeof *order);
    if (!order || reserve_blocks(reg, n) != 0) {
        free(order);
        return ast__set_error(&reg->err, NULL, AST_ENOMEM, "extend: out of memory");
    }
    for (size_t i = 0; i < n; i++)
        add_block(reg, ids[i], costs[i], set);
    assign_owners(reg, order);
    free(order);
    return 0;
}

int ast_coherence_extend(ast_coherence *reg, const uint64_t *ids, const uint64_t *costs, size_t n,
                         const int *replica_ranks, int nreplicas)
{
    if (!reg)
        return AST_EINVAL;
    pthread_mutex_lock(&reg->mu);
    int rc = do_extend(reg, ids, costs, n, replica_ranks, nreplicas);
    pthread_mutex_unlock(&reg->mu);
    return rc;
}

/* ---- queries ------------------------------------------------------------------------------ */

int ast_coherence_owner(ast_coherence *reg, uint64_t block, int *rank)
{
    if (!reg)
        return AST_EINVAL;
    pthread_mutex_lock(&reg->mu);
    struct blk *b = NULL;
    int rc = rank ? planned_block(reg, block, "owner", &b) : ast__set_error(&reg->err, NULL,
                                                                            AST_EINVAL,
                                                                            "owner: NULL out");
    if (rc == 0)
        *rank = b->owner;
    pthread_mutex_unlock(&reg->mu);
    return rc;
}

int ast_coherence_is_owner(ast_coherence *reg, uint64_t block)
{
    if (!reg)
        return AST_EINVAL;
    pthread_mutex_lock(&reg->mu);
    struct blk *b = NULL;
    int rc = planned_block(reg, block, "is_owner", &b);
    if (rc == 0)
        rc = b->owner == reg->rank;
    pthread_mutex_unlock(&reg->mu);
    return rc;
}

int ast_coherence_load(ast_coherence *reg, int rank, uint64_t *cost)
{
    if (!reg)
        return AST_EINVAL;
    pthread_mutex_lock(&reg->mu);
    int rc = 0;
    if (!cost)
        rc = ast__set_error(&reg->err, NULL, AST_EINVAL, "load: NULL out");
    else if (rank < 0 || rank >= reg->world)
        rc = ast__set_error(&reg->err, NULL, AST_EINVAL, "load: rank %d outside [0, %d)", rank,
                            reg->world);
    else if (!reg->planned)
        rc = ast__set_error(&reg->err, NULL, AST_ESTATE,
                            "load: ast_coherence_plan has not been called");
    else
        *cost = reg->load[rank];
    pthread_mutex_unlock(&reg->mu);
    return rc;
}

/* Shared by replicas() and representatives(): copy up to cap of src, report the full count. */
static int rank_list(ast_coherence *reg, uint64_t block, int reps, int *ranks, size_t cap,
                     size_t *n)
{
    const char *what = reps ? "representatives" : "replicas";
    if (!n || (!ranks && cap))
        return ast__set_error(&reg->err, NULL, AST_EINVAL, "%s: NULL output", what);
    struct blk *b = NULL;
    int rc = planned_block(reg, block, what, &b);
    if (rc)
        return rc;
    const int *src = reps ? b->set->node_rep : b->set->ranks;
    size_t cnt = (size_t)(reps ? b->set->nnodes : b->set->n);
    if (reps) {
        /* node_rep is in node-id order; hand it out in rank order. */
        int *tmp = malloc(cnt * sizeof(int));
        if (!tmp)
            return ast__set_error(&reg->err, NULL, AST_ENOMEM, "%s: out of memory", what);
        memcpy(tmp, src, cnt * sizeof(int));
        qsort(tmp, cnt, sizeof(int), cmp_int);
        if (cap)
            memcpy(ranks, tmp, (cnt < cap ? cnt : cap) * sizeof(int));
        free(tmp);
    } else if (cap) {
        memcpy(ranks, src, (cnt < cap ? cnt : cap) * sizeof(int));
    }
    *n = cnt;
    return 0;
}

int ast_coherence_replicas(ast_coherence *reg, uint64_t block, int *ranks, size_t cap, size_t *n)
{
    if (!reg)
        return AST_EINVAL;
    pthread_mutex_lock(&reg->mu);
    int rc = rank_list(reg, block, 0, ranks, cap, n);
    pthread_mutex_unlock(&reg->mu);
    return rc;
}

int ast_coherence_representatives(ast_coherence *reg, uint64_t block, int *ranks, size_t cap,
                                  size_t *n)
{
    if (!reg)
        return AST_EINVAL;
    pthread_mutex_lock(&reg->mu);
    int rc = rank_list(reg, block, 1, ranks, cap, n);
    pthread_mutex_unlock(&reg->mu);
    return rc;
}

int ast_coherence_nblocks(ast_coherence *reg, size_t *n)
{
    if (!reg)
        return AST_EINVAL;
    pthread_mutex_lock(&reg->mu);
    int rc = 0;
    if (!n)
        rc = ast__set_error(&reg->err, NULL, AST_EINVAL, "nblocks: NULL out");
    else
        *n = reg->nblocks;
    pthread_mutex_unlock(&reg->mu);
    return rc;
}

int ast_coherence_block_info(ast_coherence *reg, uint64_t block, ast_coherence_block *out)
{
    if (!reg)
        return AST_EINVAL;
    pthread_mutex_lock(&reg->mu);
    struct blk *b = NULL;
    int rc = out ? planned_block(reg, block, "block_info", &b)
                 : ast__set_error(&reg->err, NULL, AST_EINVAL, "block_info: NULL out");
    if (rc == 0) {
        out->cost = b->cost;
        out->owner = b->owner;
        out->nreplicas = b->set->n;
        out->is_replica = b->set->self_member;
        out->version = b->pub.v;
        out->snapshot_step = b->pub.t;
        out->held_version = b->held;
        out->last_recv_step = b->recv_step;
        out->synced_version = b->synced;
        out->last_sync_step = b->sync_step;
        out->due_version = b->cur.v;
        out->installed_version = b->installed;
    }
    pthread_mutex_unlock(&reg->mu);
    return rc;
}

/* ---- versions ----------------------------------------------------------------------------- */

/* Whether announcing (v, t) for b is allowed now; sets the message if not. */
static int check_announce(ast_coherence *reg, const struct blk *b, uint64_t v, int64_t t,
                          const char *what)
{
    if (t < 0)
        return ast__set_error(&reg->err, NULL, AST_EINVAL, "%s %" PRIu64 ": snapshot step %" PRId64
                              " is negative", what, b->id, t);
    if (v <= b->pub.v || t <= b->pub.t)
        return ast__set_error(&reg->err, NULL, AST_EINVAL, "%s %" PRIu64 ": version %" PRIu64
                              " at step %" PRId64 " does not follow version %" PRIu64 " at step %"
                              PRId64, what, b->id, v, t, b->pub.v, b->pub.t);
    if (t <= reg->evaluated - reg->S)
        return ast__set_error(&reg->err, NULL, AST_ESTATE, "%s %" PRIu64 ": late: version %" PRIu64
                              " (snapshot step %" PRId64 ") was due by step %" PRId64 ", but step %"
                              PRId64 " is already evaluated", what, b->id, v, t, t + reg->S,
                              reg->evaluated);
    return 0;
}

static int announce(ast_coherence *reg, struct blk *b, uint64_t v, int64_t t)
{
    if (b->npend == b->cappend) {
        size_t cap = b->cappend ? 2 * b->cappend : 4;
        struct ver *p = realloc(b->pend, cap * sizeof *p);
        if (!p)
            return ast__set_error(&reg->err, NULL, AST_ENOMEM, "announce %" PRIu64
                                  ": out of memory", b->id);
        b->pend = p;
        b->cappend = cap;
    }
    b->pend[b->npend].v = v;
    b->pend[b->npend].t = t;
    b->pend[b->npend].prev = b->pub.v;
    b->pub = b->pend[b->npend];
    b->npend++;
    return 0;
}

/* Moves every block's pending versions that step makes installable into cur. */
static int evaluate(ast_coherence *reg, int64_t step, const char *what)
{
    int rc = step_arg(reg, step, what);
    if (rc)
        return rc;
    if (step < reg->evaluated)
        return ast__set_error(&reg->err, NULL, AST_EINVAL, "%s: step %" PRId64
                              " is older than step %" PRId64 " already evaluated", what, step,
                              reg->evaluated);
    if (step == reg->evaluated)
        return 0;
    for (size_t i = 0; i < reg->nblocks; i++) {
        struct blk *b = &reg->blocks[i];
        size_t k = 0;
        while (k < b->npend && b->pend[k].t <= step - reg->S)
            k++;
        if (k) {
            b->cur = b->pend[k - 1];
            memmove(b->pend, b->pend + k, (b->npend - k) * sizeof *b->pend);
            b->npend -= k;
        }
    }
    reg->evaluated = step;
    reg->st.evaluated_step = step;
    return 0;
}

int ast_coherence_publish(ast_coherence *reg, uint64_t block, uint64_t version, int64_t step)
{
    if (!reg)
        return AST_EINVAL;
    pthread_mutex_lock(&reg->mu);
    struct blk *b = NULL;
    int rc = planned_block(reg, block, "publish", &b);
    if (rc == 0 && b->owner != reg->rank)
        rc = ast__set_error(&reg->err, NULL, AST_EINVAL, "publish %" PRIu64
                            ": rank %d is not the owner (rank %d is)", block, reg->rank, b->owner);
    if (rc == 0)
        rc = check_announce(reg, b, version, step, "publish");
    if (rc == 0)
        rc = announce(reg, b, version, step);
    if (rc == 0) {
        b->held = version;
        reg->st.published++;
    }
    pthread_mutex_unlock(&reg->mu);
    return rc;
}

/* The Install rule's answer at step >= evaluated, without evaluating it. */
static struct ver due_at(const ast_coherence *reg, const struct blk *b, int64_t step)
{
    struct ver e = b->cur;
    for (size_t k = 0; k < b->npend && b->pend[k].t <= step - reg->S; k++)
        e = b->pend[k];
    if (!e.v)
        e.t = 0;
    return e;
}

static int exchange_args(ast_coherence *reg, int64_t step, const void *vec, size_t n,
                         const char *what)
{
    if (!reg->planned)
        return ast__set_error(&reg->err, NULL, AST_ESTATE,
                              "%s: ast_coherence_plan has not been called", what);
    if (!vec && n)
        return ast__set_error(&reg->err, NULL, AST_EINVAL, "%s: NULL vector", what);
    if (n != AST_COH_XCHG_STRIDE * reg->nblocks)
        return ast__set_error(&reg->err, NULL, AST_EINVAL,
                              "%s: %zu entries, expected %d x %zu blocks", what, n,
                              AST_COH_XCHG_STRIDE, reg->nblocks);
    int rc = step_arg(reg, step, what);
    if (rc == 0 && step < reg->evaluated)
        rc = ast__set_error(&reg->err, NULL, AST_EINVAL, "%s: step %" PRId64 " is older than step %"
                            PRId64 " already evaluated", what, step, reg->evaluated);
    return rc;
}

int ast_coherence_versions_export(ast_coherence *reg, int64_t step, int64_t *vec, size_t n)
{
    if (!reg)
        return AST_EINVAL;
    pthread_mutex_lock(&reg->mu);
    int rc = exchange_args(reg, step, vec, n, "versions_export");
    for (size_t i = 0; rc == 0 && i < reg->nblocks; i++) {
        const struct blk *b = &reg->blocks[i];
        struct ver e = {0, 0, 0};
        if (b->owner == reg->rank)
            e = due_at(reg, b, step);
        vec[AST_COH_XCHG_STRIDE * i] = (int64_t)e.v;
        vec[AST_COH_XCHG_STRIDE * i + 1] = e.t;
        vec[AST_COH_XCHG_STRIDE * i + 2] = (int64_t)e.prev;
    }
    pthread_mutex_unlock(&reg->mu);
    return rc;
}

/* One entry of an imported vector: 0 nothing new, 1 a new version, or a negative code. */
static int import_check(ast_coherence *reg, const struct blk *b, int64_t step, const int64_t *x)
{
    int64_t v = x[0], t = x[1], prev = x[2];
    if (v < 0 || t < 0 || prev < 0)
        return ast__set_error(&reg->err, NULL, AST_EINVAL, "versions_import %" PRIu64
                              ": negative entry (%" PRId64 ", %" PRId64 ", %" PRId64 ")", b->id, v,
                              t, prev);
    if (b->owner == reg->rank) {
        struct ver e = due_at(reg, b, step);
        if ((uint64_t)v != e.v || t != e.t || (uint64_t)prev != e.prev)
            return ast__set_error(&reg->err, NULL, AST_ESTATE, "versions_import %" PRIu64
                                  ": entry (%" PRId64 ", %" PRId64 ") differs from this owner's (%"
                                  PRIu64 ", %" PRId64 "): owners disagree", b->id, v, t, e.v, e.t);
        return 0;
    }
    if (v && t > step - reg->S)
        return ast__set_error(&reg->err, NULL, AST_EINVAL, "versions_import %" PRIu64 ": version %"
                              PRId64 " (snapshot step %" PRId64 ") is not due at step %" PRId64,
                              b->id, v, t, step);
    if ((uint64_t)v == b->pub.v) {
        if (v && (t != b->pub.t || (uint64_t)prev != b->pub.prev))
            return ast__set_error(&reg->err, NULL, AST_EINVAL, "versions_import %" PRIu64
                                  ": version %" PRId64 " at step %" PRId64 " contradicts step %"
                                  PRId64, b->id, v, t, b->pub.t);
        return 0;
    }
    if ((uint64_t)v < b->pub.v)
        return ast__set_error(&reg->err, NULL, AST_ESTATE, "versions_import %" PRIu64 ": version %"
                              PRId64 " is older than announced version %" PRIu64, b->id, v,
                              b->pub.v);
    if ((uint64_t)prev != b->pub.v)
        return ast__set_error(&reg->err, NULL, AST_ESTATE, "versions_import %" PRIu64 ": version %"
                              PRId64 " follows version %" PRId64 ", never seen here (newest: %"
                              PRIu64 "): an exchange was skipped", b->id, v, prev, b->pub.v);
    int rc = check_announce(reg, b, (uint64_t)v, t, "versions_import");
    return rc ? rc : 1;
}

int ast_coherence_versions_import(ast_coherence *reg, int64_t step, const int64_t *vec,
                                  size_t n)
{
    if (!reg)
        return AST_EINVAL;
    pthread_mutex_lock(&reg->mu);
    int rc = exchange_args(reg, step, vec, n, "versions_import");
    for (size_t i = 0; rc == 0 && i < reg->nblocks; i++) {
        int c = import_check(reg, &reg->blocks[i], step, vec + AST_COH_XCHG_STRIDE * i);
        if (c < 0)
            rc = c;
    }
    /* Each block's pending list grows by at most one entry; reserve before applying any, so a
     * failed allocation leaves everything as it was. */
    for (size_t i = 0; rc == 0 && i < reg->nblocks; i++) {
        struct blk *b = &reg->blocks[i];
        if (b->owner != reg->rank && (uint64_t)vec[AST_COH_XCHG_STRIDE * i] > b->pub.v &&
            b->npend == b->cappend) {
            size_t cap = b->cappend ? 2 * b->cappend : 4;
            struct ver *p = realloc(b->pend, cap * sizeof *p);
            if (!p)
                rc = ast__set_error(&reg->err, NULL, AST_ENOMEM, "versions_import: out of memory");
            else {
                b->pend = p;
                b->cappend = cap;
            }
        }
    }
    for (size_t i = 0; rc == 0 && i < reg->nblocks; i++) {
        struct blk *b = &reg->blocks[i];
        const int64_t *x = vec + AST_COH_XCHG_STRIDE * i;
        if (b->owner != reg->rank && (uint64_t)x[0] > b->pub.v) {
            announce(reg, b, (uint64_t)x[0], x[1]);
            reg->st.imported++;
        }
    }
    pthread_mutex_unlock(&reg->mu);
    return rc;
}

/* The block and step checks of received and mark_synced (reg->mu held); *b receives the block. */
static int block_step_args(ast_coherence *reg, uint64_t block, int64_t step, const char *what,
                           struct blk **b)
{
    int rc = planned_block(reg, block, what, b);
    return rc ? rc : step_arg(reg, step, what);
}

/* The version check of received and mark_synced (reg->mu held): version was announced for
 * block b and is not older than floor, the version this rank already has (floor_name: "held"
 * or "synced"). */
static int version_arg(ast_coherence *reg, const struct blk *b, uint64_t block, uint64_t version,
                       const char *what, uint64_t floor, const char *floor_name)
{
    if (version > b->pub.v)
        return ast__set_error(&reg->err, NULL, AST_ESTATE, "%s %" PRIu64 ": version %" PRIu64
                              " was never announced (newest: %" PRIu64 ")", what, block, version,
                              b->pub.v);
    if (version < floor)
        return ast__set_error(&reg->err, NULL, AST_EINVAL, "%s %" PRIu64 ": version %" PRIu64
                              " is older than %s version %" PRIu64, what, block, version,
                              floor_name, floor);
    return 0;
}

int ast_coherence_received(ast_coherence *reg, uint64_t block, uint64_t version, int64_t step)
{
    if (!reg)
        return AST_EINVAL;
    pthread_mutex_lock(&reg->mu);
    struct blk *b = NULL;
    int rc = block_step_args(reg, block, step, "received", &b);
    if (rc == 0 && (b->owner == reg->rank || !b->set->self_member))
        rc = ast__set_error(&reg->err, NULL, AST_EINVAL, "received %" PRIu64 ": rank %d is %s",
                            block, reg->rank,
                            b->owner == reg->rank ? "its owner" : "not a replica");
    if (rc == 0)
        rc = version_arg(reg, b, block, version, "received", b->held, "held");
    if (rc == 0 && version > b->held) {
        b->held = version;
        b->recv_step = step;
        reg->st.received++;
    }
    pthread_mutex_unlock(&reg->mu);
    return rc;
}

int ast_coherence_due(ast_coherence *reg, int64_t step, uint64_t *blocks_out, size_t cap,
                      size_t *n)
{
    if (!reg)
        return AST_EINVAL;
    pthread_mutex_lock(&reg->mu);
    int rc = 0;
    if (!n || (!blocks_out && cap))
        rc = ast__set_error(&reg->err, NULL, AST_EINVAL, "due: NULL output");
    else if (!reg->planned)
        rc = ast__set_error(&reg->err, NULL, AST_ESTATE,
                            "due: ast_coherence_plan has not been called");
    else
        rc = evaluate(reg, step, "due");
    if (rc == 0) {
        size_t cnt = 0;
        for (size_t i = 0; i < reg->nblocks; i++) {
            const struct blk *b = &reg->blocks[i];
            if (b->set->self_member && b->cur.v > b->synced) {
                if (cnt < cap)
                    blocks_out[cnt] = b->id;
                cnt++;
            }
        }
        *n = cnt;
        reg->st.due_listed += cnt < cap ? cnt : cap;
    }
    pthread_mutex_unlock(&reg->mu);
    return rc;
}

int ast_coherence_mark_synced(ast_coherence *reg, uint64_t block, uint64_t version, int64_t step)
{
    if (!reg)
        return AST_EINVAL;
    pthread_mutex_lock(&reg->mu);
    struct blk *b = NULL;
    int rc = block_step_args(reg, block, step, "mark_synced", &b);
    if (rc == 0)
        rc = version_arg(reg, b, block, version, "mark_synced", b->synced, "synced");
    if (rc == 0 && b->set->self_member && version > b->held)
        rc = ast__set_error(&reg->err, NULL, AST_ESTATE, "mark_synced %" PRIu64
                            ": rank %d has not received version %" PRIu64 " (holds %" PRIu64 ")",
                            block, reg->rank, version, b->held);
    if (rc == 0 && version > b->synced) {
        b->synced = version;
        b->sync_step = step;
        reg->st.synced++;
    }
    pthread_mutex_unlock(&reg->mu);
    return rc;
}

int ast_coherence_install_version(ast_coherence *reg, uint64_t block, int64_t step,
                                  uint64_t *version)
{
    if (!reg)
        return AST_EINVAL;
    pthread_mutex_lock(&reg->mu);
    struct blk *b = NULL;
    int rc = version ? planned_block(reg, block, "install_version", &b)
                     : ast__set_error(&reg->err, NULL, AST_EINVAL, "install_version: NULL out");
    if (rc == 0)
        rc = evaluate(reg, step, "install_version");
    if (rc == 0) {
        *version = b->cur.v;
        if (b->set->self_member && b->cur.v > b->held)
            rc = ast__set_error(&reg->err, NULL, AST_EBUSY, "install_version %" PRIu64 ": version %"
                                PRIu64 " is due at step %" PRId64 " but rank %d holds version %"
                                PRIu64 " (sync first)", block, b->cur.v, step, reg->rank, b->held);
        else if (b->set->self_member && b->cur.v != b->installed) {
            int64_t lag = step - b->cur.t;
            b->installed = b->cur.v;
            reg->st.installs++;
            if (lag > reg->st.max_lag_steps)
                reg->st.max_lag_steps = lag;
        }
    }
    pthread_mutex_unlock(&reg->mu);
    return rc;
}

/* ---- hierarchical plan -------------------------------------------------------------------- */

static void hier_fill(const ast_coherence *reg, const struct blk *b, ast_coherence_hier *h)
{
    const struct vset *s = b->set;
    int me = reg->rank, my_node = reg->node[me];
    int ko = vset_node_index(s, reg->node[b->owner]); /* the owner is a member: ko >= 0 */
    int km = vset_node_index(s, my_node);

    memset(h, 0, sizeof *h);
    h->owner = b->owner;
    h->owner_node = reg->node[b->owner];
    h->node = my_node;
    h->nodes = s->nnodes;
    h->node_replicas = km >= 0 ? s->node_cnt[km] : 0;
    h->is_replica = s->self_member;
    h->representative = km >= 0 ? s->node_rep[km] : -1;
    h->inter_root = s->node_rep[ko];
    h->inter = AST_COH_INTER_NONE;
    h->recv_level = -1;
    if (!s->self_member)
        return;
    int on_owner_node = km == ko;
    /* The rank that writes a node's shared copy: the owner on its node, else the representative
     * (after receiving it from the inter-node broadcast). */
    int source = on_owner_node ? b->owner : s->node_rep[km];
    h->is_representative = me == s->node_rep[km];
    h->write_shm = me == source && h->node_replicas > 1;
    h->read_shm = me != source;
    if (s->nnodes > 1) {
        if (me == h->inter_root)
            h->inter = AST_COH_INTER_SEND;
        else if (h->is_representative && !on_owner_node)
            h->inter = AST_COH_INTER_RECV;
    }
    if (h->read_shm)
        h->recv_level = AST_COH_INTRA_NODE;
    else if (h->inter == AST_COH_INTER_RECV)
        h->recv_level = AST_COH_INTER_NODE;
    h->flat_recv = me != b->owner;
    h->flat_recv_inter = !on_owner_node;
}

int ast_coherence_hier_plan(ast_coherence *reg, uint64_t block, ast_coherence_hier *out)
{
    if (!reg)
        return AST_EINVAL;
    pthread_mutex_lock(&reg->mu);
    struct blk *b = NULL;
    int rc = out ? planned_block(reg, block, "hier_plan", &b)
                 : ast__set_error(&reg->err, NULL, AST_EINVAL, "hier_plan: NULL out");
    if (rc == 0)
        hier_fill(reg, b, out);
    pthread_mutex_unlock(&reg->mu);
    return rc;
}

/* ---- accounting --------------------------------------------------------------------------- */

int ast_coherence_count_bytes(ast_coherence *reg, ast_coherence_level level, uint64_t bytes)
{
    if (!reg)
        return AST_EINVAL;
    pthread_mutex_lock(&reg->mu);
    int rc = 0;
    if ((unsigned)level >= AST_COH_LEVEL_COUNT)
        rc = ast__set_error(&reg->err, NULL, AST_EINVAL, "count_bytes: unknown level %d",
                            (int)level);
    else
        reg->st.bytes[level] = sat_add(reg->st.bytes[level], bytes);
    pthread_mutex_unlock(&reg->mu);
    return rc;
}

int ast_coherence_barrier_begin(ast_coherence *reg, int64_t step)
{
    if (!reg)
        return AST_EINVAL;
    pthread_mutex_lock(&reg->mu);
    int rc = step_arg(reg, step, "barrier_begin");
    if (rc == 0 && reg->barrier_open)
        rc = ast__set_error(&reg->err, NULL, AST_ESTATE, "barrier_begin %" PRId64
                            ": the barrier of step %" PRId64 " is still open", step,
                            reg->barrier_step);
    if (rc == 0) {
        reg->barrier_open = 1;
        reg->barrier_step = step;
        reg->barrier_t0 = ast__now_ns();
    }
    pthread_mutex_unlock(&reg->mu);
    return rc;
}

int ast_coherence_barrier_end(ast_coherence *reg, int64_t step)
{
    if (!reg)
        return AST_EINVAL;
    pthread_mutex_lock(&reg->mu);
    int rc = 0;
    if (!reg->barrier_open)
        rc = ast__set_error(&reg->err, NULL, AST_ESTATE, "barrier_end %" PRId64
                            ": no barrier is open", step);
    else if (step != reg->barrier_step)
        rc = ast__set_error(&reg->err, NULL, AST_EINVAL, "barrier_end %" PRId64
                            ": the open barrier is step %" PRId64, step, reg->barrier_step);
    if (rc == 0) {
        uint64_t waited = ast__now_ns() - reg->barrier_t0;
        reg->barrier_open = 0;
        reg->st.barrier_waits++;
        reg->st.barrier_wait_ns = sat_add(reg->st.barrier_wait_ns, waited);
        if (waited > reg->st.barrier_max_wait_ns)
            reg->st.barrier_max_wait_ns = waited;
    }
    pthread_mutex_unlock(&reg->mu);
    return rc;
}

int ast_coherence_stats_get(ast_coherence *reg, ast_coherence_stats *out)
{
    if (!reg || !out)
        return AST_EINVAL;
    pthread_mutex_lock(&reg->mu);
    *out = reg->st;
    pthread_mutex_unlock(&reg->mu);
    return 0;
}
