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
 * Formats: a block holds raw bytes unless ast_store_set_format gives it a quantized format
 * (asteria/quant.h: an eigenbasis block-quantized to int8 or int4). Its NVMe records name that
 * format, and reading one back refuses a record of another format (AST_EFOREIGN) instead of
 * handing bytes of another layout to a reader that would widen them wrongly. The store never
 * interprets the bytes: the format is the writer's word, checked against the record's.
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

#include "asteria/quant.h"

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

/* Returns the tier's name, "device", "host_pinned", "host", "uvm" or "nvme"; NULL for an unknown
 * tier. */
const char *ast_tier_name(ast_tier t);
/* Parses a tier name into *out. Returns 0; AST_EINVAL for an unknown name or NULL arguments. */
int ast_tier_parse(const char *name, ast_tier *out);
/* Returns the i-th tier (0 <= i < AST_TIER_COUNT) in the order tiers are listed to users:
 * device, host_pinned, host, uvm, nvme (asteria._C.tiers() hands the names out in it, and the
 * Python package's tier list and messages follow it); AST_TIER_COUNT for any other i. */
ast_tier ast_tier_listed(int i);

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

/* Sets the defaults: no NVMe tier, AST_DIRECT_REQUIRE, queue depth 0 (64), no budget.
 * No return value. */
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

/* Opens a store (opts NULL: no NVMe tier); *out receives it (NULL on failure). Returns 0 on
 * success; AST_EINVAL for a NULL out or bad options; AST_ENOMEM; for nvme_dir: AST_ENOENT
 * (missing), AST_EACCES (not writable), AST_ENOTSUP (no O_DIRECT under AST_DIRECT_REQUIRE, or
 * built without liburing), AST_EIO. On failure a message that names the cause is written into
 * errbuf (may be NULL; len bytes, truncated). */
int ast_store_open(const ast_store_opts *opts, ast_store **out, char *errbuf, size_t len);
/* Frees every block and removes the store's record files (in a forked child: the child's own
 * records only). NULL is a no-op. No return value. */
void ast_store_close(ast_store *s);

/* New zero-filled block of nbytes in tier; *id receives its handle (never 0). Returns 0 on
 * success; AST_EINVAL for NULL arguments, an unknown tier or nbytes 0; AST_ENODEV / AST_ECUDA
 * for a CUDA tier that cannot be had; AST_ENOTSUP (UVM without coherent host access, NVME
 * without an nvme_dir); AST_ENOMEM; AST_ENOSPC (NVMe budget or device full); AST_EIO. Failures
 * set the last-error message. */
int ast_store_alloc(ast_store *s, ast_tier tier, size_t nbytes, uint64_t *id);
/* Frees a block (and its record). Returns 0; AST_ENOENT for an unknown id; AST_EINVAL for a
 * NULL s. */
int ast_store_free(ast_store *s, uint64_t id);
/* Returns the host- (or device-) addressable pointer of a block; NULL if the block is on NVME
 * or unknown. */
void *ast_store_data(ast_store *s, uint64_t id);
/* *nbytes / *tier receive the block's size / tier. Returns 0; AST_ENOENT for an unknown id;
 * AST_EINVAL for NULL arguments. */
int ast_store_size(ast_store *s, uint64_t id, size_t *nbytes);
int ast_store_tier(ast_store *s, uint64_t id, ast_tier *tier);
/* Moves n blocks to tier dst. To or from NVME the I/O of all n is batched in one io_uring
 * submission round. All-or-nothing per block: a block whose move failed stays where it was;
 * the first error is returned and *moved (may be NULL) counts the blocks that did move.
 * Returns 0 when every block is in dst; else the first failure: AST_EINVAL (NULL arguments,
 * unknown tier), AST_ENOENT (unknown id), AST_EBUSY, the allocation codes of ast_store_alloc,
 * or an NVMe read's AST_EIO / AST_ECORRUPT / AST_EFOREIGN. */
int ast_store_move(ast_store *s, const uint64_t *ids, size_t n, ast_tier dst, size_t *moved);
/* Sets what block id's bytes hold: AST_QTYPE_NONE with qblock 0 (raw bytes, every new block's
 * format) or AST_QTYPE_INT8 / AST_QTYPE_INT4 with the quantized form's values per scale
 * (ast_quant_layout_get's block rule). Every record written for the block from now on carries
 * it, and a read back expects it. Returns 0; AST_EINVAL (NULL s, a type or block size of
 * neither kind); AST_ENOENT (unknown id); AST_ESTATE (the block is on NVME and the format
 * differs: its record holds the present one; setting the same format is fine). */
int ast_store_set_format(ast_store *s, uint64_t id, ast_qtype qtype, uint32_t qblock);
/* *qtype / *qblock receive block id's format. Returns 0; AST_ENOENT for an unknown id;
 * AST_EINVAL for NULL arguments. */
int ast_store_format(ast_store *s, uint64_t id, ast_qtype *qtype, uint32_t *qblock);
/* Copies the counters into out. Returns 0; AST_EINVAL for a NULL s or out. */
int ast_store_stats_get(ast_store *s, ast_store_stats *out);
/* Detail of the last failure on this store (thread-safe copy into buf). Returns 0; AST_EINVAL
 * for a NULL s or buf, or len 0. */
int ast_store_last_error(ast_store *s, char *buf, size_t len);
/* Path of the record file backing a block on NVME (for diagnostics and fault tests); in a
 * forked child, for a block not written since the fork, the parent's record. Returns 0;
 * AST_ENOENT for an unknown id; AST_ESTATE for a block not on NVME; AST_EINVAL for NULL
 * arguments or a buf too small. */
int ast_store_record_path(ast_store *s, uint64_t id, char *buf, size_t len);

#ifdef __cplusplus
}
#endif
#endif
