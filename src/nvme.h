/*
 * nvme.h - internal: the NVMe tier's record engine (liburing, O_DIRECT, checksummed records).
 *
 * Owns: one directory's record files of one store, the io_uring ring, and a staging arena of
 * aligned buffers registered with the ring. Knows nothing of tiers or accounting (store.c does).
 *
 * Record file <dir>/ast-<store id>-<block id>.rec (ids as 16 hex digits), little-endian (format
 * 3: format 2 had no payload type, format 1 had zlib's crc32 where the later ones have CRC-32C;
 * a record of another format version is refused, naming the version found and the one read):
 *
 *   offset 0   header, 64 bytes
 *      0 u32 magic "ASTR"        4 u16 format version (3)     6 u16 header size (64)
 *      8 u64 store id           16 u64 block id              24 u64 generation
 *     32 u64 payload length     40 u8 payload type            41 u8[3] zero
 *     44 u32 payload block size 48 u8[12] zero                60 u32 crc32c of bytes 0..59
 *   offset 64  payload
 *   then       trailer, 8 bytes: u32 crc32c of header + payload, u32 magic "RTSA"
 *   then       zeros up to a multiple of AST__NVME_ALIGN (the file's size)
 *
 * Payload type and block size (ast__nvme_io.qtype, .qblock) say what the payload holds: an
 * ast_qtype of asteria/quant.h, AST_QTYPE_NONE (0) with block size 0 for raw bytes (every block
 * of the store's own), or AST_QTYPE_INT8 / AST_QTYPE_INT4 with the values per scale of the
 * quantized form, so a quantized basis is never widened with another layout than it was
 * written in.
 *
 * The header's own CRC separates "damaged" from "someone else's": a header that fails it is
 * AST_ECORRUPT, and so is one of another format version or header size; an intact header of
 * another store, block or generation, or of another payload type or block size than the reader
 * expects, is AST_EFOREIGN (the message names the one found and the one expected); a file
 * shorter or longer than the record it should hold is AST_ECORRUPT; a payload that fails the
 * record CRC is AST_ECORRUPT.
 *
 * A new record is written to <name>.tmp and renamed over the record name only once every byte
 * is written (and, buffered, fdatasync'ed), so a failed write never leaves a partial record under
 * the real name. A record that already exists under the name (the store keeps a block's record
 * after reading it back, stale) is rewritten in place (ast__nvme_io.in_place): no tmp file, no
 * rename, no new inode (on this machine's ext4 with discard, unlinking a just-written record
 * cost 2 ms and creating one 0.2 ms); a failed in-place write leaves a damaged record whose
 * block is not on NVMe, which the generation and CRC checks would refuse anyway. Durability
 * policy: records are scratch state of one process's store (the store id is
 * random per open, and close removes the files), so nothing is fsync'ed for crash safety. With
 * O_DIRECT the write completions already report device errors; in buffered fallback every record
 * is fdatasync'ed before the rename so that ENOSPC/EIO from writeback surface while the block's
 * previous copy still exists. Space is reserved with fallocate() first, so ENOSPC usually comes
 * before any data moves; a write completion's ENOSPC is handled the same way.
 *
 * Batches: ast__nvme_write/read stage records in slot-sized chunks (framed records go straight
 * from / to their frame in chunks of up to 1 MiB) through two alternating groups of SQEs, so
 * that the CPU work on one group overlaps the kernel's on the other (nvme.c). Short transfers
 * and -EAGAIN/-EINTR are resubmitted for the remainder.
 *
 * Fork: the io_uring ring belongs to the process that set it up. A batch run in another process
 * (a forked child: getpid() differs from the ring's owner) first leaves the inherited ring alone
 * (its mappings and descriptor are this process's copies: unmapping and closing them does not
 * touch the parent's ring) and sets up a ring of its own; if that fails, every record of the
 * batch fails with a message that says so. The store gives a child engine a new store id
 * (ast__nvme_adopt), so the child's records never take the parent's file names (they are kept
 * as unlinked files, open descriptors that vanish with the child), and reads a
 * record written before the fork by its owner id (and, where it could, through a descriptor
 * opened before the fork), so the parent may replace or remove that file meanwhile.
 *
 * Locking: none inside. An engine is used by one thread at a time; the store calls it with its
 * mutex held.
 */
#ifndef ASTERIA_NVME_H
#define ASTERIA_NVME_H

#include "asteria/quant.h"
#include "asteria/store.h"

#include <stddef.h>
#include <stdint.h>

#define AST__NVME_ALIGN 4096u   /* logical block size: offsets, lengths, buffers, file sizes */
#define AST__NVME_HEADER 64u
#define AST__NVME_TRAILER 8u
#define AST__NVME_VERSION 3u
#define AST__NVME_MAX_DEPTH 1024u
/* Host blocks of at least this many bytes are allocated framed (ast__nvme_io.framed): the cost
 * is at most one 4 KiB page and a header per block (6% at this size, less above). */
#define AST__NVME_FRAME_MIN (64u << 10)

typedef struct ast__nvme ast__nvme;

typedef struct ast__nvme_opts {
    const char *dir;
    ast_direct_policy direct;
    unsigned queue_depth;  /* ring entries and staging slots; 0: 64 */
    uint64_t store_id;
    unsigned faults;       /* test faults armed from the start (testing.h); 0 otherwise */
} ast__nvme_opts;

/* Checks the directory (exists, writable, O_DIRECT per policy) with a probe file, sets up the
 * ring and the registered staging arena. AST_ENOENT (missing directory), AST_EACCES (not
 * writable or read-only filesystem), AST_ENOTSUP (no O_DIRECT under AST_DIRECT_REQUIRE, no
 * io_uring, or built without liburing), AST_ENOSPC, AST_EINVAL; err names the path and cause. */
int ast__nvme_open(const ast__nvme_opts *o, ast__nvme **out, char *err, size_t len);
/* Tears the ring down and removes every file of this store id in the directory. NULL is fine. */
void ast__nvme_close(ast__nvme *n);
/* In a forked child: the engine writes records under store_id from now on, and each new record
 * is unlinked as soon as it is complete and handed to the caller as an open descriptor
 * (ast__nvme_io.fd, read through it), so a child's records vanish with the child however it
 * ends (os._exit included) and never take a name the parent could see. The next batch sets up
 * this process's own ring. Records of the old id are left alone. */
void ast__nvme_adopt(ast__nvme *n, uint64_t store_id);
/* Opens the record of block_id written by store owner (0: this engine's store id) for reading,
 * with the flags the engine reads with. RETURN VALUE: 0 with *fd set; else the AST_E* code of
 * open(2) (AST_ENOENT for a missing record, AST_EINVAL for a path too long). */
int ast__nvme_open_record(const ast__nvme *n, uint64_t owner, uint64_t block_id, int *fd);

/* 1: O_DIRECT in use; 0: buffered + fdatasync. */
int ast__nvme_direct(const ast__nvme *n);
/* 1: staging buffers are registered with the ring (fixed-buffer I/O); 0: registration was refused
 * (for instance by RLIMIT_MEMLOCK) and plain reads/writes on the same buffers are used. */
int ast__nvme_fixed(const ast__nvme *n);
/* Size on disk of the record of a payload of nbytes. */
uint64_t ast__nvme_record_bytes(size_t nbytes);
int ast__nvme_record_path(const ast__nvme *n, uint64_t block_id, char *buf, size_t len);
/* Path of the record of block_id written by store owner (0: this engine's store id). */
int ast__nvme_owner_path(const ast__nvme *n, uint64_t owner, uint64_t block_id, char *buf,
                         size_t len);
/* Removes a block's record file (absent is fine). */
int ast__nvme_remove(ast__nvme *n, uint64_t block_id);

/* One record of a batch. */
typedef struct ast__nvme_io {
    uint64_t block_id;
    uint64_t generation;
    void *data;     /* write: the payload (NULL: zeros); read: where the verified payload goes */
    size_t len;     /* payload bytes */
    int on_device;  /* data is device memory: staged with ast__cuda_memcpy instead of memcpy */
    int framed;     /* data sits in a frame (AST__NVME_FRAME_MIN): data - AST__NVME_HEADER is
                       4096-aligned and ast__nvme_record_bytes(len) bytes are the engine's to
                       use, so the record goes straight between the frame and the file: the
                       engine writes header, trailer and padding around the payload (a write)
                       or reads the whole record into it (a read), no staging copy */
    int result;     /* out: 0 or AST_E* for this record */
    uint64_t owner; /* read: store id that wrote the record (0: this engine's); write: ignored */
    int in_place;   /* write: the block's named record of this engine's store id may exist
                       and no other process holds it: rewrite that file in place (no tmp, no
                       rename, no new inode); where it is missing, write a new record */
    int fd;         /* read: an open descriptor of the record, left open (-1: open it by path);
                       write, out: the new record's descriptor when the engine was adopted
                       (the record has no name), else -1 */
    ast_qtype qtype; /* write: what the payload holds, recorded in the header; read: what it
                        must hold (AST_EFOREIGN otherwise). AST_QTYPE_NONE: raw bytes */
    uint32_t qblock; /* the quantized form's values per scale (ast_quant_layout_get's block);
                        0 with AST_QTYPE_NONE. A type or block size of neither kind fails the
                        record with AST_EINVAL before its file is touched */
} ast__nvme_io;

typedef struct ast__nvme_xfer {
    uint64_t bytes;    /* bytes the kernel transferred (headers and padding included) */
    uint64_t ns;       /* wall time of the batch */
    uint64_t records;  /* records that succeeded */
} ast__nvme_xfer;

/* Writes (resp. reads and verifies) count records in one batch. Every record succeeds or fails
 * on its own (ios[i].result); a failed write leaves no record file, a failed read leaves the
 * file as it was and may have scribbled on ios[i].data. Returns 0 when all succeeded, else the
 * code of the lowest-index failure, whose message (naming the block, the file and the cause) is
 * written to err. x (may be NULL) receives the batch's transfer counts. */
int ast__nvme_write(ast__nvme *n, ast__nvme_io *ios, size_t count, ast__nvme_xfer *x,
                    char *err, size_t len);
int ast__nvme_read(ast__nvme *n, ast__nvme_io *ios, size_t count, ast__nvme_xfer *x,
                   char *err, size_t len);

#endif
