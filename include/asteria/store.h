/*
 * asteria/store.h - blocks of optimizer state, each living in one memory tier.
 *
 * Owns: block memory in the tiers HOST (pageable malloc), HOST_PINNED (cudaHostAlloc when CUDA is
 * built and a device exists, else refused with AST_ENODEV), DEVICE (cudaMalloc), UVM
 * (cudaMallocManaged, only where the device reports coherent host access) and NVME (records in
 * files under a directory, through liburing with O_DIRECT); byte accounting per tier.
 *
 * NVMe records carry a header (magic, store id, block id, generation, length) and a CRC32 of
 * header and payload, so a torn, corrupted or foreign record is detected and reported, never
 * returned as data. A block moved to NVME keeps no host copy; moving it back reads and verifies
 * it. A failed move leaves the block where it was, its data intact. A block read back keeps its
 * record file, stale (its generation is behind), until it is freed or the store closed: the
 * next move to NVME rewrites that file in place, which is cheaper than removing a file and
 * creating another. Host blocks of 64 KiB and more are allocated in a 4 KiB-aligned "frame" a
 * record's size (at most 4 KiB more than the block) so that their I/O needs no staging copy;
 * ast_store_data() of such a block is 64-byte aligned.
 *
 * Fork: records and the io_uring ring belong to the process that opened the store. In a forked
 * child the store works on a copy: blocks keep their values (an NVME block reads back the
 * record as it was at the fork, even after the parent replaced it), new records get the
 * child's own store id, the child sets up its own ring on first use, and close removes only
 * the child's records. Nothing a child does changes the parent's records or ring.
 *
 * Thread safety: one mutex per store serialises allocation, moves and accounting;
 * ast_store_data() pointers stay valid until the block is moved or freed, which the caller must
 * not race with its own use of the pointer.
 */
#ifndef ASTERIA_STORE_H
#define ASTERIA_STORE_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef enum ast_tier {
    AST_TIER_HOST = 0,
    AST_TIER_HOST_PINNED = 1,
    AST_TIER_DEVICE = 2,
    AST_TIER_UVM = 3,
    AST_TIER_NVME = 4,
    AST_TIER_COUNT = 5
} ast_tier;

/* "host", "host_pinned", "device", "uvm", "nvme"; NULL for an unknown tier. */
const char *ast_tier_name(ast_tier t);
/* Parses a tier name; AST_EINVAL if unknown. */
int ast_tier_parse(const char *name, ast_tier *out);

typedef enum ast_direct_policy {
    AST_DIRECT_REQUIRE = 0,  /* refuse (AST_ENOTSUP) a directory whose filesystem lacks O_DIRECT */
    AST_DIRECT_FALLBACK = 1  /* fall back to buffered I/O + fdatasync, and say so */
} ast_direct_policy;

typedef struct ast_store_opts {
    const char *nvme_dir;       /* NULL: no NVMe tier */
    ast_direct_policy direct;
    unsigned queue_depth;       /* io_uring entries; 0: default 64 */
    uint64_t nvme_budget_bytes; /* 0: unlimited (the filesystem decides: ENOSPC) */
} ast_store_opts;

void ast_store_opts_init(ast_store_opts *o);

typedef struct ast_store ast_store;

typedef struct ast_store_stats {
    uint64_t bytes[AST_TIER_COUNT];   /* live bytes per tier */
    uint64_t blocks[AST_TIER_COUNT];
    uint64_t nvme_bytes_written, nvme_bytes_read;
    uint64_t nvme_write_ns, nvme_read_ns;
    uint64_t nvme_writes, nvme_reads;
    int nvme_direct;                  /* 1 O_DIRECT in use, 0 buffered fallback, -1 no NVMe tier */
} ast_store_stats;

int ast_store_open(const ast_store_opts *opts, ast_store **out);
/* Like ast_store_open, but on failure writes a message that names the cause into errbuf. */
int ast_store_open_msg(const ast_store_opts *opts, ast_store **out, char *errbuf, size_t len);
/* Frees every block and removes the store's record files (in a forked child: the child's own
 * records only). */
void ast_store_close(ast_store *s);

/* New zero-filled block of nbytes in tier; *id receives its handle (never 0). */
int ast_store_alloc(ast_store *s, ast_tier tier, size_t nbytes, uint64_t *id);
int ast_store_free(ast_store *s, uint64_t id);
/* Host- (or device-) addressable pointer of a block; NULL if the block is on NVME or unknown. */
void *ast_store_data(ast_store *s, uint64_t id);
int ast_store_size(ast_store *s, uint64_t id, size_t *nbytes);
int ast_store_tier(ast_store *s, uint64_t id, ast_tier *tier);
/* Moves n blocks to tier dst. To or from NVME the I/O of all n is batched in one io_uring
 * submission round. All-or-nothing per block: a block whose move failed stays where it was;
 * the first error is returned and *moved (may be NULL) counts the blocks that did move. */
int ast_store_move(ast_store *s, const uint64_t *ids, size_t n, ast_tier dst, size_t *moved);
int ast_store_stats_get(ast_store *s, ast_store_stats *out);
/* Detail of the last failure on this store (thread-safe copy into buf). */
int ast_store_last_error(ast_store *s, char *buf, size_t len);
/* Path of the record file backing a block on NVME (for diagnostics and fault tests); in a
 * forked child, for a block not written since the fork, the parent's record. */
int ast_store_record_path(ast_store *s, uint64_t id, char *buf, size_t len);

#ifdef __cplusplus
}
#endif
#endif
