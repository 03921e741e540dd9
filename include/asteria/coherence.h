/*
 * asteria/coherence.h - the CoherenceRegistry: which rank computes each replicated block's
 * refresh, which version every replica installs at which step, which blocks must travel now,
 * and how they travel (inside a node through host memory, then among node representatives).
 *
 * Owns: per block its cost, replica set, owner, announced versions (version and snapshot step),
 * the version this rank holds, the version last synced and last installed; per rank the owned
 * cost (load); the byte counters per level, the barrier accounting, the last-error message.
 * It moves no data and opens no connection: the transport is torch.distributed (gloo on CPU,
 * NCCL on GPU) driven by the caller, who follows the plans given here and reports what it moved
 * (docs/coherence.md has the protocol, the byte definitions and the determinism argument).
 *
 * Life cycle: create -> register every block (any order) -> ast_coherence_plan (owners are fixed
 * from now on; registering is refused) -> per step: publish / versions exchange / due / sync /
 * received / mark_synced / install_version. A caller that meets its blocks lazily adds them in
 * batches with ast_coherence_extend instead, before or after the plan.
 *
 * The rules, each a pure function of what was registered and announced, so every rank that saw
 * the same registrations and announcements gives the same answers:
 *  - Owner: LPT. Blocks sorted by cost descending, ties by block id ascending; each goes to the
 *    replica rank with the least cost owned so far, ties to the lowest rank.
 *  - Install: at step s a replica installs the newest announced version whose snapshot step t
 *    satisfies t + S <= s (S: the staleness budget); version 0 means "none yet".
 *  - Due: at step s a block this rank replicates is due when that install version is newer
 *    than the version last marked synced. Blocks whose version did not change never appear.
 *  - Late announcements are refused (AST_ESTATE): a version with t + S <= the newest step
 *    already evaluated (by ast_coherence_due or ast_coherence_install_version) would change an
 *    answer already given.
 *
 * Steps are >= 0 and the steps passed to ast_coherence_due / ast_coherence_install_version never
 * decrease (an older step is AST_EINVAL). Every failure other than a NULL handle sets the
 * last-error message.
 *
 * Thread safety: one mutex per registry; every function holds it for its whole (short, never
 * blocking) duration, so any function may be called from any thread concurrently, e.g. publish
 * from a worker-completion thread while the training thread asks what is due. ast_coherence_
 * destroy must not race with other calls on the same registry. Registries share nothing.
 */
#ifndef ASTERIA_COHERENCE_H
#define ASTERIA_COHERENCE_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct ast_coherence ast_coherence;

typedef struct ast_coherence_opts {
    int world_size;           /* ranks in the job (>= 1) */
    int rank;                 /* this rank, in [0, world_size) */
    /* Topology. node_ids (world_size entries, each >= 0; the launcher's GROUP_RANK of every
     * rank, gathered) wins when not NULL; otherwise node = rank / ranks_per_node (torchrun's
     * contiguous numbering with LOCAL_WORLD_SIZE = ranks_per_node, >= 1). */
    int ranks_per_node;
    const int *node_ids;
    int staleness;            /* S >= 0: a refresh snapshotted at step t is installed at t + S */
    /* Replication when a block is registered without an explicit replica list: NULL, every rank
     * replicates every block (DDP); else world_size entries, each >= 0: ranks with equal ids
     * hold replicas of the same blocks (HSDP: the id is the rank's shard index, so a block is
     * replicated across the replicate dimension). Arrays are copied at create. */
    const int *replica_group;
} ast_coherence_opts;

/* Sets the defaults: world_size 1, rank 0, ranks_per_node 1, staleness 5, DDP replication.
 * No return value. */
void ast_coherence_opts_init(ast_coherence_opts *o);

/* RETURN VALUE: 0; AST_EINVAL (NULL arguments, world_size < 1, rank out of range, staleness < 0,
 * ranks_per_node < 1 without node_ids, a negative node or replica group id); AST_ENOMEM.
 * *out is NULL on failure, and the cause is written into errbuf (may be NULL; len bytes,
 * truncated). */
int ast_coherence_create(const ast_coherence_opts *o, ast_coherence **out, char *errbuf,
                         size_t len);
/* Frees reg (NULL is a no-op). No return value. */
void ast_coherence_destroy(ast_coherence *reg);

/* Copy of the last error message ("" if none). RETURN VALUE: 0; AST_EINVAL (NULL or empty buf). */
int ast_coherence_last_error(ast_coherence *reg, char *buf, size_t len);

/* The refresh cost of one n x n factor, n^3 (saturating); a block's cost is the sum over its
 * factors (Shampoo's m x n block: m^3 + n^3). RETURN VALUE: n^3, or UINT64_MAX when it
 * overflows. */
uint64_t ast_coherence_dim_cost(uint64_t n);

/* Registers a block. replica_ranks (nreplicas distinct ranks in [0, world_size), any order)
 * names the ranks holding a replica; NULL with nreplicas 0 takes opts.replica_group: the ranks of
 * this rank's group (all ranks for DDP). This rank need not be among them. Every replica of a
 * block must register it with the same cost and replica set. A rank may register only the
 * blocks it replicates when replica sets are identical or disjoint (DDP, HSDP); with
 * overlapping sets every rank must register every block, or owners may differ.
 * RETURN VALUE: 0; AST_EINVAL (cost 0, a rank out of range or repeated, nreplicas < 1 with a
 * list, a list with nreplicas 0, block already registered); AST_ESTATE (after the plan);
 * AST_ENOMEM. */
int ast_coherence_register_block(ast_coherence *reg, uint64_t block, uint64_t cost,
                                 const int *replica_ranks, int nreplicas);

/* Fixes every owner (the LPT rule above); a second call does nothing. RETURN VALUE: 0;
 * AST_ENOMEM. */
int ast_coherence_plan(ast_coherence *reg);

/* Incremental registration, for callers that meet blocks lazily (an optimizer learns its blocks
 * at their first refresh): registers n blocks sharing one replica list (as register_block:
 * NULL with nreplicas 0 takes the default) and fixes their owners at once, before or after
 * ast_coherence_plan. Owners already fixed never change. The new blocks (with any registered but
 * not yet planned) go through the LPT rule among themselves - cost descending, id ascending, each
 * to the replica owning the least cost so far, ties to the lowest rank - where "so far" counts
 * every block planned before. Owners are therefore a function of the sequence of batches: every
 * replica must extend with the same batches in the same order (and, as for register_block, with
 * identical or disjoint replica sets). After it the registry is planned. Atomic: on failure
 * nothing is registered.
 * RETURN VALUE: 0; AST_EINVAL (ids or costs NULL with n > 0, a cost 0, an id repeated or already
 * registered, a bad replica list as for register_block); AST_ENOMEM. */
int ast_coherence_extend(ast_coherence *reg, const uint64_t *ids, const uint64_t *costs, size_t n,
                         const int *replica_ranks, int nreplicas);

/* Queries, valid after the plan. RETURN VALUE: 0 (is_owner: 1 or 0); AST_EINVAL (NULL out, rank
 * out of range); AST_ENOENT (unknown block); AST_ESTATE (before the plan). */
int ast_coherence_owner(ast_coherence *reg, uint64_t block, int *rank);
int ast_coherence_is_owner(ast_coherence *reg, uint64_t block);
/* *cost receives the total cost of the blocks owned by rank. RETURN VALUE: 0; AST_EINVAL (NULL
 * cost, rank out of range); AST_ESTATE (before the plan). */
int ast_coherence_load(ast_coherence *reg, int rank, uint64_t *cost);
/* The replicas of a block in ascending rank order, and its representatives (one per node that
 * holds a replica: the lowest replica rank of that node), ascending. *n is the full count; at
 * most cap entries are written (ranks may be NULL with cap 0 to ask for the count).
 * RETURN VALUE: 0; AST_EINVAL (NULL n, ranks NULL with cap > 0); AST_ENOENT (unknown block);
 * AST_ESTATE (before the plan). */
int ast_coherence_replicas(ast_coherence *reg, uint64_t block, int *ranks, size_t cap, size_t *n);
int ast_coherence_representatives(ast_coherence *reg, uint64_t block, int *ranks, size_t cap,
                                  size_t *n);

typedef struct ast_coherence_block {
    uint64_t cost;
    int owner;
    int nreplicas;
    int is_replica;            /* this rank holds a replica */
    uint64_t version;          /* newest announced version (0: none) */
    int64_t snapshot_step;     /* its snapshot step (-1: none) */
    uint64_t held_version;     /* newest version this rank has the data of (owner: published) */
    int64_t last_recv_step;    /* step of the last ast_coherence_received that raised it (-1) */
    uint64_t synced_version;   /* version of the last ast_coherence_mark_synced */
    int64_t last_sync_step;    /* step of the last ast_coherence_mark_synced (-1: never) */
    uint64_t due_version;      /* the Install rule's version at the newest evaluated step: the
                                  version a due block must sync */
    uint64_t installed_version;/* last version this rank installed (install_version) */
} ast_coherence_block;

/* The state of one block, for diagnostics and tests. RETURN VALUE: 0; AST_EINVAL (NULL out);
 * AST_ENOENT (unknown block); AST_ESTATE (before the plan). */
int ast_coherence_block_info(ast_coherence *reg, uint64_t block, ast_coherence_block *out);

/* Owner only: the refresh of `block` whose inputs were snapshotted at `step` is ready as
 * `version`. Versions and snapshot steps strictly increase per block.
 * RETURN VALUE: 0; AST_EINVAL (this rank is not the owner, version or step not above the last
 * announced one, step < 0); AST_ENOENT; AST_ESTATE (before the plan; late: step + S <= the
 * newest evaluated step). */
int ast_coherence_publish(ast_coherence *reg, uint64_t block, uint64_t version, int64_t step);

/* The version exchange that carries announcements to the other replicas, once per step at
 * which a version may become due, before ast_coherence_due of that step. Layout:
 * AST_COH_XCHG_STRIDE int64 per registered block in ascending block-id order: (version,
 * snapshot step, previous version) of the version the Install rule gives at `step`, for the
 * blocks this rank owns; (0, 0, 0) for the others and for owned blocks with nothing due yet.
 * The caller element-wise all-reduces the vectors with MAX over the replica group (each entry
 * has one non-zero contributor, its owner) and imports the result on every rank, owner
 * included. "previous version" lets a replica notice a version it never saw (an exchange was
 * skipped at a step where one became due). Import validates every entry before applying any.
 * RETURN VALUE: 0; AST_EINVAL (NULL vector, n != stride x blocks, step < 0 or older than one
 * evaluated, a negative entry, an entry not due at `step`, one contradicting an announced
 * version of the same number); AST_ESTATE (before the plan; an entry older than one announced;
 * a skipped version; an owned block's entry that differs from this rank's own - owners
 * disagree; a late entry). */
#define AST_COH_XCHG_STRIDE 3
int ast_coherence_versions_export(ast_coherence *reg, int64_t step, int64_t *vec, size_t n);
int ast_coherence_versions_import(ast_coherence *reg, int64_t step, const int64_t *vec,
                                  size_t n);
/* *n receives the number of registered blocks (the exchange vector has AST_COH_XCHG_STRIDE
 * times as many). RETURN VALUE: 0; AST_EINVAL (NULL reg or n). */
int ast_coherence_nblocks(ast_coherence *reg, size_t *n);

/* Non-owner replica: the data of `version` landed here at `step` (re-reporting a held version
 * does nothing). RETURN VALUE: 0; AST_EINVAL (this rank is the owner or no replica, version
 * below the held one, step < 0); AST_ENOENT; AST_ESTATE (before the plan; a version never
 * announced). */
int ast_coherence_received(ast_coherence *reg, uint64_t block, uint64_t version, int64_t step);

/* The blocks this rank replicates that must sync at `step` (the Due rule), ascending by block
 * id so every replica issues its transfers in the same order. *n is the full count; at most cap
 * ids are written. Evaluates `step`. RETURN VALUE: 0; AST_EINVAL (NULL n, blocks_out NULL with
 * cap > 0, step < 0 or older than one evaluated); AST_ESTATE (before the plan). */
int ast_coherence_due(ast_coherence *reg, int64_t step, uint64_t *blocks_out, size_t cap,
                      size_t *n);
/* Every replica, after the transfer of `version` completed: the block stops being due until a
 * newer version reaches its install step. RETURN VALUE: 0; AST_EINVAL (version below the synced
 * one, step < 0); AST_ENOENT; AST_ESTATE (before the plan; version never announced; a non-owner
 * replica that has not received it). */
int ast_coherence_mark_synced(ast_coherence *reg, uint64_t block, uint64_t version, int64_t step);

/* The version every replica installs at `step` (the Install rule; 0: none yet). Evaluates
 * `step`; when the answer changes, counts an install and its lag (step - snapshot step).
 * RETURN VALUE: 0; AST_EBUSY (this rank replicates the block but does not hold that version:
 * sync first; *version is still set, nothing is counted); AST_EINVAL (NULL version, step < 0 or
 * older than one evaluated); AST_ENOENT; AST_ESTATE (before the plan). */
int ast_coherence_install_version(ast_coherence *reg, uint64_t block, int64_t step,
                                  uint64_t *version);

typedef enum ast_coherence_inter {
    AST_COH_INTER_NONE = 0,
    AST_COH_INTER_SEND = 1,   /* broadcast root among the block's representatives */
    AST_COH_INTER_RECV = 2
} ast_coherence_inter;

typedef enum ast_coherence_level {
    AST_COH_INTRA_NODE = 0,      /* taken from the node's shared host copy */
    AST_COH_INTER_NODE = 1,      /* received from another node */
    AST_COH_FLAT = 2,            /* what a flat owner-to-every-replica broadcast would deliver */
    AST_COH_FLAT_INTER_NODE = 3, /* the part of AST_COH_FLAT that would cross nodes */
    AST_COH_LEVEL_COUNT = 4
} ast_coherence_level;

/* This rank's part in moving one changed block (docs/coherence.md, "Hierarchical plan"). In
 * order: (1) the owner writes its host copy into its node's shared buffer; (2) on the owner's
 * node every other replica reads it, the representative included; (3) the owner node's
 * representative broadcasts it to the other representatives; (4) each of them writes it into
 * its node's shared buffer; (5) the other replicas of those nodes read it. */
typedef struct ast_coherence_hier {
    int owner, owner_node;
    int node;                  /* this rank's node id */
    int nodes;                 /* nodes holding a replica of the block */
    int node_replicas;         /* replicas on this rank's node */
    int is_replica;
    int is_representative;     /* this rank is its node's representative for the block */
    int representative;        /* its node's representative (-1: no replica on this node) */
    int inter_root;            /* representative of the owner's node: the broadcast root */
    int write_shm;             /* step (1) or (4): write the node's shared copy (only when the
                                  node has other replicas to read it) */
    int read_shm;              /* step (2) or (5): take the copy from the node's shared buffer */
    ast_coherence_inter inter; /* step (3) */
    int recv_level;            /* level at which this rank receives the block (-1: it does not) */
    int flat_recv;             /* 1: a flat broadcast would deliver it to this rank */
    int flat_recv_inter;       /* 1: ... across a node boundary */
} ast_coherence_hier;

/* RETURN VALUE: 0; AST_EINVAL (NULL out); AST_ENOENT; AST_ESTATE (before the plan). */
int ast_coherence_hier_plan(ast_coherence *reg, uint64_t block, ast_coherence_hier *out);

/* The caller reports bytes this rank received at a level (docs/coherence.md defines each), so
 * summing a counter over the ranks of a group gives the group's traffic with nothing counted
 * twice. RETURN VALUE: 0; AST_EINVAL (unknown level). */
int ast_coherence_count_bytes(ast_coherence *reg, ast_coherence_level level, uint64_t bytes);

/* Brackets the caller's wait at the bounded barrier of `step` (for the owner's refresh results
 * or for a transfer); one bracket open at a time. RETURN VALUE: 0; AST_EINVAL (step < 0, end for
 * another step than begin); AST_ESTATE (begin while open, end while none is open). */
int ast_coherence_barrier_begin(ast_coherence *reg, int64_t step);
int ast_coherence_barrier_end(ast_coherence *reg, int64_t step);

typedef struct ast_coherence_stats {
    uint64_t blocks;               /* registered */
    uint64_t owned;                /* owned by this rank */
    uint64_t load;                 /* their total cost */
    uint64_t published;            /* versions this rank announced as owner */
    uint64_t imported;             /* versions learnt through the exchange */
    uint64_t received, synced, installs;
    uint64_t due_listed;           /* ids returned by ast_coherence_due, summed over calls */
    uint64_t bytes[AST_COH_LEVEL_COUNT];
    uint64_t barrier_waits, barrier_wait_ns, barrier_max_wait_ns;
    int64_t max_lag_steps;         /* largest install step - snapshot step counted (-1: none) */
    int64_t evaluated_step;        /* newest step evaluated (-1: none) */
    int world_size, rank, node, nodes, staleness;
} ast_coherence_stats;

/* Copies the counters into out. RETURN VALUE: 0; AST_EINVAL (NULL reg or out). */
int ast_coherence_stats_get(ast_coherence *reg, ast_coherence_stats *out);

#ifdef __cplusplus
}
#endif
#endif
