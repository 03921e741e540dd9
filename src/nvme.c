/*
 * nvme.c - the NVMe tier's record engine: record format, probe, batched io_uring I/O (nvme.h).
 *
 * Owns: an engine's ring, its staging arena and the record files of its store id. May call:
 * liburing, cuda_mem (staging device-side payloads), POSIX file calls, util.h (the clock, the
 * message formatter, a batch's first failure), quant.h (the names and block sizes of a payload
 * format). errno and CQE results become AST_E* codes here
 * through ast_err_from_errno. The fault injection that testing.h declares (ast__nvme_inject_fault,
 * the opts' faults) is implemented here, where the failing calls are.
 *
 * Locking: none; one thread at a time per engine (store.c holds its mutex around every call).
 *
 * A batch runs in two alternating groups of slots (half the depth each, at most half the
 * arena's bytes each). Filling a group hands its slots to the next chunks of the batch in record
 * order (starting a record opens its file), stages the writes' chunks into the slots, prepares
 * one SQE per chunk and submits them without waiting. Then the OLDER group is finished: its CQEs
 * are reaped (remainders of short transfers and -EAGAIN/-EINTR resubmitted in the same slot),
 * its reads post-processed in stream order (header check, running CRC, payload copy-out) and
 * the records whose ops are all done and post-processed finalised (rename, or verify); then it
 * is filled again. So this thread's copies and CRCs run while the kernel works on the other
 * group, a slot is never touched while the kernel owns it, and since groups finish in the order
 * they were filled, a read's CRC is accumulated in file order without a CRC combine.
 *
 * Framed records (nvme.h, ast__nvme_io.framed: host blocks of 64 KiB and more) use no slot
 * memory: the kernel reads the whole record straight into the block's frame, or writes it from
 * there once header, CRC, trailer and padding are laid around the payload; the read's header
 * and CRC are checked over the frame when its last op is done. One pass over the payload (the
 * CRC) is the only CPU work left per byte.
 *
 * Checksums are CRC-32C: SSE4.2's crc32 instruction in three lanes (about 3 GB/s here under
 * load, where zlib's crc32, the format-1 checksum, ran at 1 GB/s: slower than the disk).
 *
 * Fork (nvme.h): the ring is set up by ring_setup() in the process that uses it; run_batch()
 * compares getpid() with the ring's owner pid first and, in a forked child, replaces the
 * inherited ring (never submitting to it) before any SQE is prepared.
 */
#include "nvme.h"

#include "asteria/build_config.h"
#include "asteria/errors.h"
#include "cuda_mem.h"
#include "testing.h"
#include "util.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>
#include <pthread.h>

#if ASTERIA_HAVE_URING
#include <liburing.h>
#endif

#define DEFAULT_DEPTH 64u
#define ARENA_TARGET (16u << 20) /* staging bytes aimed at, whatever the depth */
#define SLOT_MIN (64u << 10)
#define SLOT_MAX (1u << 20)
#define DIRECT_CHUNK (1u << 20)  /* bytes per SQE of a framed record (no slot involved) */
#define MAX_RETRIES 64u          /* completions without progress before a chunk is given up */
#define PATH_BYTES 4096

enum op_kind { OP_WRITE, OP_READ, OP_SYNC };

/* One SQE's worth of work; op k uses staging slot k. */
struct op {
    size_t rec;
    int kind;
    uint64_t off;    /* file offset of the chunk */
    size_t len;
    size_t done;     /* bytes completed so far */
    unsigned tries;  /* completions that made no progress */
    int faulted;     /* the injected fault of this op has fired */
};

struct ast__nvme {
    char *dir;
    uint64_t store_id;
    int direct;
    int fixed;
    int broken;  /* the ring failed in a way that leaves it unusable: every later batch fails */
    int anonymous; /* forked child: new records are unlinked at once and handed over as fds */
    int have_ring; /* ring holds a ring set up by (or inherited from) ring_pid's process */
    pid_t ring_pid; /* the process that set the ring up */
    unsigned depth;
    size_t slot_size;
    unsigned char *arena;
    struct op *ops;
    unsigned faults, fault_skip;
#if ASTERIA_HAVE_URING
    struct io_uring ring;
#endif
};

static uint64_t round_up(uint64_t v, uint64_t a)
{
    return (v + a - 1) / a * a;
}

uint64_t ast__nvme_record_bytes(size_t nbytes)
{
    return round_up((uint64_t)AST__NVME_HEADER + nbytes + AST__NVME_TRAILER, AST__NVME_ALIGN);
}

/* Path of a file of block_id written by store owner (0: this engine's store id). */
static int owner_path(const ast__nvme *n, uint64_t owner, uint64_t block_id, const char *suffix,
                      char *buf, size_t len)
{
    int w = snprintf(buf, len, "%s/ast-%016" PRIx64 "-%016" PRIx64 "%s", n->dir,
                     owner ? owner : n->store_id, block_id, suffix);
    return (w < 0 || (size_t)w >= len) ? AST_EINVAL : 0;
}

static int path_of(const ast__nvme *n, uint64_t block_id, const char *suffix, char *buf,
                   size_t len)
{
    return owner_path(n, 0, block_id, suffix, buf, len);
}

int ast__nvme_record_path(const ast__nvme *n, uint64_t block_id, char *buf, size_t len)
{
    return path_of(n, block_id, ".rec", buf, len);
}

int ast__nvme_owner_path(const ast__nvme *n, uint64_t owner, uint64_t block_id, char *buf,
                         size_t len)
{
    return owner_path(n, owner, block_id, ".rec", buf, len);
}

static int open_flags(const ast__nvme *n, int base)
{
    return base | O_CLOEXEC | (n->direct ? O_DIRECT : 0);
}

int ast__nvme_open_record(const ast__nvme *n, uint64_t owner, uint64_t block_id, int *fd)
{
    char path[PATH_BYTES];
    int rc = owner_path(n, owner, block_id, ".rec", path, sizeof path);
    *fd = -1;
    if (rc)
        return rc;
    *fd = open(path, open_flags(n, O_RDONLY));
    return *fd < 0 ? ast_err_from_errno(errno) : 0;
}

void ast__nvme_adopt(ast__nvme *n, uint64_t store_id)
{
    n->store_id = store_id;
    n->anonymous = 1;
}

int ast__nvme_direct(const ast__nvme *n)
{
    return n->direct;
}

int ast__nvme_fixed(const ast__nvme *n)
{
    return n->fixed;
}

void ast__nvme_inject_fault(ast__nvme *n, unsigned faults, unsigned skip)
{
    n->faults = faults;
    n->fault_skip = skip;
}

int ast__nvme_remove(ast__nvme *n, uint64_t block_id)
{
    char path[PATH_BYTES];
    int rc = ast__nvme_record_path(n, block_id, path, sizeof path);
    if (rc)
        return rc;
    if (unlink(path) != 0 && errno != ENOENT)
        return ast_err_from_errno(errno);
    return 0;
}

#if ASTERIA_HAVE_URING

static const unsigned char REC_MAGIC[4] = {'A', 'S', 'T', 'R'};
static const unsigned char END_MAGIC[4] = {'R', 'T', 'S', 'A'};

static void put_le(unsigned char *p, uint64_t v, unsigned bytes)
{
    for (unsigned i = 0; i < bytes; i++)
        p[i] = (unsigned char)(v >> (8 * i));
}

static uint64_t get_le(const unsigned char *p, unsigned bytes)
{
    uint64_t v = 0;
    for (unsigned i = 0; i < bytes; i++)
        v |= (uint64_t)p[i] << (8 * i);
    return v;
}

/* CRC-32C (Castagnoli, reflected polynomial 0x82F63B78), zlib's calling convention: crc_of(0,
 * NULL, 0) starts, crc_of(crc, more) continues. SSE4.2's crc32 instruction where the CPU has it
 * (three lanes: 2.4-3.5 GB/s measured here on a loaded VM; zlib's crc32 ran at 1 GB/s, slower
 * than the disk), else slicing-by-8 tables. The two gave equal values for lengths 0..88k in a
 * one-off check; the test suite exercises only the path of the machine it runs on. */
#define CRC_POLY 0x82F63B78u
#define CRC_LANE 8192u /* bytes per lane of the three-lane hardware loop */
static uint32_t crc_tab[8][256];
static uint32_t crc_lane_shift[4][256]; /* appends CRC_LANE zero bytes to a raw CRC register */
static int crc_have_hw;
static pthread_once_t crc_once = PTHREAD_ONCE_INIT;
static int have_crc_hw(void);

/* GF(2) 32x32 matrices as 32 columns: the operators that feed zero bits through the CRC
 * register (Mark Adler's crc32c.c construction), so three lanes' CRCs can be joined. */
static uint32_t gf2_times(const uint32_t *mat, uint32_t vec)
{
    uint32_t sum = 0;
    for (; vec; vec >>= 1, mat++)
        if (vec & 1)
            sum ^= *mat;
    return sum;
}

static void gf2_square(uint32_t *sq, const uint32_t *mat)
{
    for (int k = 0; k < 32; k++)
        sq[k] = gf2_times(mat, mat[k]);
}

/* op = the operator appending len zero bytes (len a power of two). */
static void crc_zeros_op(uint32_t *op, size_t len)
{
    uint32_t odd[32], row = 1;

    odd[0] = CRC_POLY; /* one zero bit */
    for (int k = 1; k < 32; k++, row <<= 1)
        odd[k] = row;
    gf2_square(op, odd);  /* two bits */
    gf2_square(odd, op);  /* four bits */
    for (;;) {
        gf2_square(op, odd); /* one byte, then four, ... */
        if ((len >>= 1) == 0)
            return;
        gf2_square(odd, op);
        if ((len >>= 1) == 0)
            break;
    }
    memcpy(op, odd, sizeof odd);
}

static void crc_init(void)
{
    uint32_t op[32];

    crc_have_hw = have_crc_hw();
    for (unsigned i = 0; i < 256; i++) {
        uint32_t c = i;
        for (int k = 0; k < 8; k++)
            c = c & 1 ? (c >> 1) ^ CRC_POLY : c >> 1;
        crc_tab[0][i] = c;
    }
    crc_zeros_op(op, CRC_LANE);
    for (unsigned i = 0; i < 256; i++)
        for (unsigned t = 0; t < 4; t++)
            crc_lane_shift[t][i] = gf2_times(op, i << (8 * t));
    for (unsigned i = 0; i < 256; i++)
        for (unsigned t = 1; t < 8; t++)
            crc_tab[t][i] = (crc_tab[t - 1][i] >> 8) ^ crc_tab[0][crc_tab[t - 1][i] & 0xff];
}

static uint32_t crc_shift_lane(uint32_t c)
{
    return crc_lane_shift[0][c & 0xff] ^ crc_lane_shift[1][(c >> 8) & 0xff] ^
           crc_lane_shift[2][(c >> 16) & 0xff] ^ crc_lane_shift[3][c >> 24];
}

static uint32_t crc_sw(uint32_t c, const unsigned char *p, size_t n)
{
    while (n >= 8) {
        uint64_t w;
        memcpy(&w, p, 8);
        w ^= c; /* little-endian: the low byte is the first */
        c = crc_tab[7][w & 0xff] ^ crc_tab[6][(w >> 8) & 0xff] ^ crc_tab[5][(w >> 16) & 0xff] ^
            crc_tab[4][(w >> 24) & 0xff] ^ crc_tab[3][(w >> 32) & 0xff] ^
            crc_tab[2][(w >> 40) & 0xff] ^ crc_tab[1][(w >> 48) & 0xff] ^ crc_tab[0][w >> 56];
        p += 8;
        n -= 8;
    }
    while (n--)
        c = (c >> 8) ^ crc_tab[0][(c ^ *p++) & 0xff];
    return c;
}

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
/* clang names crc32 apart from sse4.2 */
__attribute__((target("sse4.2,crc32"))) static uint32_t crc_hw(uint32_t c,
                                                                const unsigned char *p, size_t n)
{
    uint64_t c64 = c;
    /* Three independent lanes hide the instruction's 3-cycle latency; the lanes' registers are
     * joined by appending CRC_LANE zero bytes (a table lookup) and xor. */
    while (n >= 3 * CRC_LANE) {
        uint64_t c1 = 0, c2 = 0;
        for (size_t j = 0; j < CRC_LANE; j += 8) {
            uint64_t w0, w1, w2;
            memcpy(&w0, p + j, 8);
            memcpy(&w1, p + CRC_LANE + j, 8);
            memcpy(&w2, p + 2 * CRC_LANE + j, 8);
            c64 = __builtin_ia32_crc32di(c64, w0);
            c1 = __builtin_ia32_crc32di(c1, w1);
            c2 = __builtin_ia32_crc32di(c2, w2);
        }
        c64 = crc_shift_lane((uint32_t)c64) ^ (uint32_t)c1;
        c64 = crc_shift_lane((uint32_t)c64) ^ (uint32_t)c2;
        p += 3 * CRC_LANE;
        n -= 3 * CRC_LANE;
    }
    while (n >= 8) {
        uint64_t w;
        memcpy(&w, p, 8);
        c64 = __builtin_ia32_crc32di(c64, w);
        p += 8;
        n -= 8;
    }
    c = (uint32_t)c64;
    while (n--)
        c = __builtin_ia32_crc32qi(c, *p++);
    return c;
}
static int have_crc_hw(void)
{
    return __builtin_cpu_supports("sse4.2") ? 1 : 0;
}
#else
static uint32_t crc_hw(uint32_t c, const unsigned char *p, size_t n)
{
    return crc_sw(c, p, n);
}
static int have_crc_hw(void)
{
    return 0;
}
#endif

static uint32_t crc_of(uint32_t crc, const unsigned char *p, size_t n)
{
    uint32_t c = ~crc;
    if (!p || !n)
        return crc;
    pthread_once(&crc_once, crc_init);
    c = crc_have_hw ? crc_hw(c, p, n) : crc_sw(c, p, n);
    return ~c;
}

static void encode_header(const ast__nvme *n, const ast__nvme_io *io, unsigned char *h)
{
    memset(h, 0, AST__NVME_HEADER);
    memcpy(h, REC_MAGIC, 4);
    put_le(h + 4, AST__NVME_VERSION, 2);
    put_le(h + 6, AST__NVME_HEADER, 2);
    put_le(h + 8, n->store_id, 8);
    put_le(h + 16, io->block_id, 8);
    put_le(h + 24, io->generation, 8);
    put_le(h + 32, io->len, 8);
    h[40] = (unsigned char)io->qtype;
    put_le(h + 44, io->qblock, 4);
    put_le(h + 60, crc_of(0, h, 60), 4);
}

/* "raw bytes", "int8 in blocks of 64", or a foreign record's "payload type 9 (block size 0)". */
static void describe_format(unsigned qtype, uint64_t qblock, char *buf, size_t len)
{
    const char *name = ast_qtype_name((ast_qtype)qtype);
    if (qtype == AST_QTYPE_NONE && qblock == 0)
        snprintf(buf, len, "raw bytes");
    else if (name && qtype != AST_QTYPE_NONE)
        snprintf(buf, len, "%s in blocks of %" PRIu64, name, qblock);
    else
        snprintf(buf, len, "payload type %u (block size %" PRIu64 ")", qtype, qblock);
}

/* 0 when io's payload type and block size are a format (nvme.h); else AST_EINVAL with why. The
 * block sizes quant.c takes are the rule (ast_quant_layout_get). */
static int check_format(const ast__nvme_io *io, char *why, size_t len)
{
    ast_quant_layout l;
    char what[64];
    describe_format((unsigned)io->qtype, io->qblock, what, sizeof what);
    if (io->qtype == AST_QTYPE_NONE && io->qblock == 0)
        return 0;
    if (io->qtype == AST_QTYPE_NONE)
        return ast__errorf(why, len, AST_EINVAL, "record format %s: raw bytes have block size 0",
                           what);
    if (ast_quant_layout_get(io->qtype, 0, io->qblock, &l) != 0) {
        char msg[256];
        ast_quant_last_error(msg, sizeof msg);
        return ast__errorf(why, len, AST_EINVAL, "record format %s: %s", what, msg);
    }
    return 0;
}

/* Files of this store are "ast-<store id>-*"; close removes exactly those. */
static void remove_store_files(const ast__nvme *n)
{
    char prefix[64];
    DIR *d = opendir(n->dir);
    struct dirent *e;

    if (!d)
        return;
    snprintf(prefix, sizeof prefix, "ast-%016" PRIx64 "-", n->store_id);
    while ((e = readdir(d)) != NULL) {
        if (strncmp(e->d_name, prefix, strlen(prefix)) == 0)
            unlinkat(dirfd(d), e->d_name, 0);
    }
    closedir(d);
}

/* ---- probe -------------------------------------------------------------------------------- */

/* Opens the probe file, honouring injected faults, as open(2) would report them. */
static int probe_open(const ast__nvme *n, const char *path, int direct)
{
    if (n->faults & AST__FAULT_EROFS) {
        errno = EROFS;
        return -1;
    }
    if (direct && (n->faults & AST__FAULT_NO_ODIRECT)) {
        errno = EINVAL;
        return -1;
    }
    return open(path, O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC | (direct ? O_DIRECT : 0), 0600);
}

/* Creates, writes one aligned block to and removes a probe file: tells whether the directory is
 * writable and whether its filesystem takes O_DIRECT (EINVAL from open or from the first aligned
 * write means it does not). *direct_ok reports the latter; a nonzero return the former. */
static int probe_file(const ast__nvme *n, const char *path, int direct, int *direct_ok,
                      char *err, size_t len)
{
    void *buf = NULL;
    int fd, rc = 0;
    ssize_t w;

    *direct_ok = 1;
    if (posix_memalign(&buf, AST__NVME_ALIGN, AST__NVME_ALIGN) != 0)
        return ast__errorf(err, len, AST_ENOMEM, "nvme_dir '%s': no memory for the probe", n->dir);
    memset(buf, 0, AST__NVME_ALIGN);
    fd = probe_open(n, path, direct);
    if (fd < 0) {
        if (direct && errno == EINVAL) {
            /* Some filesystems (ramfs) create the file before refusing O_DIRECT. */
            unlink(path);
            *direct_ok = 0;
        } else {
            rc = ast__errorf(err, len, ast_err_from_errno(errno),
                             "nvme_dir '%s': cannot create a file there: %s", n->dir,
                             strerror(errno));
        }
        free(buf);
        return rc;
    }
    w = pwrite(fd, buf, AST__NVME_ALIGN, 0);
    if (w != (ssize_t)AST__NVME_ALIGN) {
        int e = w < 0 ? errno : EIO;
        if (direct && e == EINVAL)
            *direct_ok = 0;
        else
            rc = ast__errorf(err, len, ast_err_from_errno(e),
                             "nvme_dir '%s': cannot write a probe file there: %s", n->dir,
                             strerror(e));
    }
    close(fd);
    unlink(path);
    free(buf);
    return rc;
}

static int probe_dir(ast__nvme *n, ast_direct_policy policy, char *err, size_t len)
{
    char path[PATH_BYTES];
    struct stat st;
    int ok = 0, rc;

    if (stat(n->dir, &st) != 0)
        return ast__errorf(err, len, ast_err_from_errno(errno), "nvme_dir '%s': %s", n->dir,
                           strerror(errno));
    if (!S_ISDIR(st.st_mode))
        return ast__errorf(err, len, AST_ENOENT, "nvme_dir '%s': not a directory", n->dir);
    rc = snprintf(path, sizeof path, "%s/ast-%016" PRIx64 "-probe", n->dir, n->store_id);
    if (rc < 0 || (size_t)rc >= sizeof path)
        return ast__errorf(err, len, AST_EINVAL, "nvme_dir '%s': path too long", n->dir);

    rc = probe_file(n, path, 1, &ok, err, len);
    if (rc)
        return rc;
    if (ok) {
        n->direct = 1;
        return 0;
    }
    if (policy == AST_DIRECT_REQUIRE)
        return ast__errorf(err, len, AST_ENOTSUP, "nvme_dir '%s': its filesystem does not support "
                           "O_DIRECT (open or aligned write returned EINVAL); AST_DIRECT_FALLBACK "
                           "would use buffered I/O + fdatasync", n->dir);
    n->direct = 0;
    return probe_file(n, path, 0, &ok, err, len);
}

/* ---- open / close -------------------------------------------------------------------------- */

/* Sets up this process's ring and registers the staging arena with it. */
static int ring_setup(ast__nvme *n, char *err, size_t len)
{
    struct iovec *iov;
    int rc = io_uring_queue_init(n->depth, &n->ring, 0);

    if (rc < 0) {
        int code = (rc == -ENOSYS || rc == -EPERM) ? AST_ENOTSUP : ast_err_from_errno(-rc);
        return ast__errorf(err, len, code, "nvme_dir '%s': io_uring_queue_init(%u): %s%s", n->dir,
                           n->depth, strerror(-rc),
                           code == AST_ENOTSUP ? " (io_uring disabled by sysctl or seccomp?)" : "");
    }
    n->have_ring = 1;
    n->ring_pid = getpid();
    n->broken = 0;
    iov = calloc(n->depth, sizeof *iov);
    if (!iov) {
        n->fixed = 0;
        return 0;
    }
    for (unsigned i = 0; i < n->depth; i++) {
        iov[i].iov_base = n->arena + (size_t)i * n->slot_size;
        iov[i].iov_len = n->slot_size;
    }
    /* Registration pins the arena; where RLIMIT_MEMLOCK refuses, plain I/O on it still works. */
    n->fixed = io_uring_register_buffers(&n->ring, iov, n->depth) == 0;
    free(iov);
    return 0;
}

/* A ring of this process: after a fork the inherited ring is the parent's (its SQ and CQ are
 * shared memory), so the child drops its copies of it and sets up its own. */
static int ring_of_this_process(ast__nvme *n, char *err, size_t len)
{
    char why[512];
    int rc;

    if (n->have_ring && n->ring_pid == getpid())
        return 0;
    if (n->have_ring)
        io_uring_queue_exit(&n->ring);
    n->have_ring = 0;
    rc = ring_setup(n, why, sizeof why);
    if (rc)
        ast__errorf(err, len, rc, "this process (pid %ld, forked from the store's creator) could "
                    "not set up its own io_uring ring: %s", (long)getpid(), why);
    return rc;
}

int ast__nvme_open(const ast__nvme_opts *o, ast__nvme **out, char *err, size_t len)
{
    ast__nvme *n;
    unsigned depth;
    int rc;

    *out = NULL;
    if (!o || !o->dir || !o->dir[0])
        return ast__errorf(err, len, AST_EINVAL, "nvme_dir is empty");
    if (o->direct != AST_DIRECT_REQUIRE && o->direct != AST_DIRECT_FALLBACK)
        return ast__errorf(err, len, AST_EINVAL, "direct policy %d is neither REQUIRE nor FALLBACK",
                           (int)o->direct);
    depth = o->queue_depth ? o->queue_depth : DEFAULT_DEPTH;
    if (depth > AST__NVME_MAX_DEPTH)
        return ast__errorf(err, len, AST_EINVAL, "queue_depth %u is above the maximum %u", depth,
                           AST__NVME_MAX_DEPTH);

    n = calloc(1, sizeof *n);
    if (!n || !(n->dir = strdup(o->dir))) {
        free(n);
        return ast__errorf(err, len, AST_ENOMEM, "nvme_dir '%s': out of memory", o->dir);
    }
    n->store_id = o->store_id;
    n->faults = o->faults;
    n->depth = depth;
    n->slot_size = (ARENA_TARGET / depth) / AST__NVME_ALIGN * AST__NVME_ALIGN;
    if (n->slot_size < SLOT_MIN)
        n->slot_size = SLOT_MIN;
    if (n->slot_size > SLOT_MAX)
        n->slot_size = SLOT_MAX;

    rc = probe_dir(n, o->direct, err, len);
    if (rc) {
        free(n->dir);
        free(n);
        return rc;
    }

    n->ops = calloc(depth, sizeof *n->ops);
    if (!n->ops ||
        posix_memalign((void **)&n->arena, AST__NVME_ALIGN, (size_t)depth * n->slot_size) != 0) {
        n->arena = NULL;
        ast__nvme_close(n);
        return ast__errorf(err, len, AST_ENOMEM,
                           "nvme_dir '%s': no memory for %u staging slots of %zu bytes", o->dir,
                           depth, n->slot_size);
    }
    memset(n->arena, 0, (size_t)depth * n->slot_size);
    rc = ring_setup(n, err, len);
    if (rc) {
        ast__nvme_close(n);
        return rc;
    }
    *out = n;
    return 0;
}

void ast__nvme_close(ast__nvme *n)
{
    if (!n)
        return;
    /* In a forked child that never ran a batch this unmaps and closes the child's copies of the
     * parent's ring: the parent's ring is not affected. */
    if (n->have_ring)
        io_uring_queue_exit(&n->ring);
    remove_store_files(n);
    free(n->arena);
    free(n->ops);
    free(n->dir);
    free(n);
}

/* ---- batches ------------------------------------------------------------------------------- */

enum rec_state { REC_PENDING, REC_ACTIVE, REC_DONE, REC_FAILED };

struct rec {
    int state;
    int err;           /* first failure; the record fails once its ops are drained */
    int fd;
    int borrowed;      /* fd is the caller's (ast__nvme_io.fd): never closed here */
    int in_place;      /* write: overwrite the existing record through fd, no tmp / rename */
    int direct;        /* framed host payload: the kernel reads / writes the whole record
                          straight from / into the frame, no staging slot, no copy */
    int faulty;        /* the injected ENOSPC applies to this record */
    int sync_state;    /* buffered writes: 0 none yet, 1 issued, 2 done */
    unsigned inflight; /* ops of this record owned by the kernel */
    unsigned queued;   /* ops of this record not yet post-processed (absorb_group) */
    uint64_t stream;   /* bytes to transfer */
    uint64_t staged;   /* bytes handed to ops */
    uint64_t done;     /* write: bytes written; read: bytes post-processed (a prefix) */
    uint64_t file_size;
    uint32_t crc;
    int header_checked;
    int pad_bad;       /* read: a nonzero byte in the padding */
    unsigned char hdr[AST__NVME_HEADER];
    unsigned char trl[AST__NVME_TRAILER];
};

struct batch {
    ast__nvme *n;
    ast__nvme_io *ios;
    struct rec *recs;
    size_t count;
    int writing;
    unsigned ngroups;     /* 2: slots split in halves that alternate (1 when depth is 1) */
    unsigned gsize;       /* slots per group; op k uses slot k and belongs to group k / gsize */
    unsigned nops[2];     /* ops issued into each group and not yet post-processed */
    uint64_t gbytes[2];   /* bytes of those ops: a group carries at most gsize slots' worth,
                             framed records included, so the two groups keep alternating */
    unsigned inflight[2]; /* SQEs of each group owned by the kernel */
    uint64_t bytes;
    ast__batch_err fail; /* the lowest failed record's first cause */
    char *err;
    size_t errlen;
};

static unsigned char *slot(const ast__nvme *n, unsigned k)
{
    return n->arena + (size_t)k * n->slot_size;
}

/* The frame of record i (ast__nvme_io.framed): its stream laid out in memory, aligned. */
static unsigned char *frame(const struct batch *b, size_t i)
{
    return (unsigned char *)b->ios[i].data - AST__NVME_HEADER;
}

/* The batch's result: each record's code, and the message of the lowest failed record (its
 * first cause, kept by b->fail) naming its block and file. */
static int report(struct batch *b)
{
    char path[PATH_BYTES];
    size_t i = b->fail.idx;

    for (size_t k = 0; k < b->count; k++)
        b->ios[k].result = b->recs[k].err;
    if (i == SIZE_MAX)
        return 0;
    if (ast__nvme_owner_path(b->n, b->writing ? 0 : b->ios[i].owner, b->ios[i].block_id, path,
                             sizeof path) != 0)
        snprintf(path, sizeof path, "%s/...", b->n->dir);
    return ast__errorf(b->err, b->errlen, b->fail.code, "block %" PRIu64 ", file %s: %s",
                       b->ios[i].block_id, path, b->fail.msg);
}

/* The part [*s0, *s1) of stream range [lo, hi) inside chunk [a, a + nb); 0 if empty. */
static int overlap(uint64_t a, uint64_t nb, uint64_t lo, uint64_t hi, uint64_t *s0, uint64_t *s1)
{
    *s0 = a > lo ? a : lo;
    *s1 = a + nb < hi ? a + nb : hi;
    return *s0 < *s1;
}

static int copy_payload(void *dst, const void *src, size_t n, int on_device, char *msg,
                        size_t len)
{
    if (on_device)
        return ast__cuda_memcpy(dst, src, n, msg, len);
    memcpy(dst, src, n);
    return 0;
}

/* Fills a slot with stream bytes [a, a + nb) of record i: header, payload, trailer, padding.
 * Staging runs in stream order, so the CRC is complete when the trailer is reached. */
static int stage_write(struct batch *b, size_t i, unsigned char *p, uint64_t a, uint64_t nb)
{
    const ast__nvme_io *io = &b->ios[i];
    struct rec *r = &b->recs[i];
    const uint64_t H = AST__NVME_HEADER, P = H + io->len, T = P + AST__NVME_TRAILER;
    uint64_t s0, s1;
    char msg[256];

    memset(p, 0, nb);
    if (overlap(a, nb, 0, H, &s0, &s1))
        memcpy(p + (s0 - a), r->hdr + s0, s1 - s0);
    if (io->data && overlap(a, nb, H, P, &s0, &s1)) {
        int rc = copy_payload(p + (s0 - a), (const unsigned char *)io->data + (s0 - H), s1 - s0,
                              io->on_device, msg, sizeof msg);
        if (rc) {
            ast__batch_fail(&b->fail, i, &b->recs[i].err, rc, "staging the payload: %s", msg);
            return rc;
        }
    }
    if (overlap(a, nb, 0, P, &s0, &s1))
        r->crc = crc_of(r->crc, p + (s0 - a), s1 - s0);
    if (overlap(a, nb, P, T, &s0, &s1)) {
        unsigned char t[AST__NVME_TRAILER];
        put_le(t, r->crc, 4);
        memcpy(t + 4, END_MAGIC, 4);
        memcpy(p + (s0 - a), t + (s0 - P), s1 - s0);
    }
    return 0;
}

static void prep_sqe(struct batch *b, unsigned k)
{
    ast__nvme *n = b->n;
    struct op *o = &n->ops[k];
    struct rec *r = &b->recs[o->rec];
    struct io_uring_sqe *sqe = io_uring_get_sqe(&n->ring);
    unsigned char *buf = (r->direct ? frame(b, o->rec) + o->off : slot(n, k)) + o->done;
    int fixed = n->fixed && !r->direct;
    unsigned nb = (unsigned)(o->len - o->done);
    uint64_t off = o->off + o->done;

    if (!sqe) { /* cannot happen: the ring has at least depth entries; flush and retry anyway */
        io_uring_submit(&n->ring);
        sqe = io_uring_get_sqe(&n->ring);
    }
    switch (o->kind) {
    case OP_WRITE:
        if (fixed)
            io_uring_prep_write_fixed(sqe, r->fd, buf, nb, off, (int)k);
        else
            io_uring_prep_write(sqe, r->fd, buf, nb, off);
        break;
    case OP_READ:
        if (fixed)
            io_uring_prep_read_fixed(sqe, r->fd, buf, nb, off, (int)k);
        else
            io_uring_prep_read(sqe, r->fd, buf, nb, off);
        break;
    default:
        io_uring_prep_fsync(sqe, r->fd, IORING_FSYNC_DATASYNC);
        break;
    }
    io_uring_sqe_set_data64(sqe, k);
    b->inflight[k / b->gsize]++;
}

static void issue(struct batch *b, size_t i, int kind, unsigned g)
{
    ast__nvme *n = b->n;
    struct rec *r = &b->recs[i];
    unsigned k = g * b->gsize + b->nops[g];
    struct op *o = &n->ops[k];

    memset(o, 0, sizeof *o);
    o->rec = i;
    o->kind = kind;
    if (kind != OP_SYNC) {
        size_t chunk = r->direct ? DIRECT_CHUNK : n->slot_size;
        o->off = r->staged;
        o->len = r->stream - r->staged < chunk ? (size_t)(r->stream - r->staged) : chunk;
        if (kind == OP_WRITE && !r->direct && stage_write(b, i, slot(n, k), o->off, o->len) != 0)
            return;
        r->staged += o->len;
        b->gbytes[g] += o->len;
    } else {
        r->sync_state = 1;
    }
    b->nops[g]++;
    r->inflight++;
    r->queued++;
    prep_sqe(b, k);
}

/* A framed record to write: header, CRC, trailer and zero padding go around the payload in
 * its frame, so the kernel writes the whole stream from there. */
static void frame_write(struct batch *b, size_t i)
{
    const ast__nvme_io *io = &b->ios[i];
    struct rec *r = &b->recs[i];
    unsigned char *f = frame(b, i);
    const uint64_t P = AST__NVME_HEADER + io->len, T = P + AST__NVME_TRAILER;

    memcpy(f, r->hdr, AST__NVME_HEADER);
    r->crc = crc_of(0, f, P);
    put_le(f + P, r->crc, 4);
    memcpy(f + P + 4, END_MAGIC, 4);
    memset(f + T, 0, r->stream - T);
}

/* Record i's file is open for writing: header, running CRC, the frame, armed faults. */
static void begin_write(struct batch *b, size_t i)
{
    ast__nvme *n = b->n;
    struct rec *r = &b->recs[i];

    if (n->faults & AST__FAULT_ENOSPC) {
        if (n->fault_skip)
            n->fault_skip--;
        else
            r->faulty = 1;
    }
    encode_header(n, &b->ios[i], r->hdr);
    r->crc = crc_of(0, NULL, 0);
    if (r->direct)
        frame_write(b, i);
}

/* Opens record i's file and sizes its transfer. */
static void start_record(struct batch *b, size_t i)
{
    ast__nvme *n = b->n;
    ast__nvme_io *io = &b->ios[i];
    struct rec *r = &b->recs[i];
    char path[PATH_BYTES];
    struct stat st;

    r->state = REC_ACTIVE;
    r->fd = -1;
    r->direct = io->framed && io->data && !io->on_device;
    if (n->broken) {
        ast__batch_fail(&b->fail, i, &b->recs[i].err, AST_EIO,
                        "the io_uring ring failed earlier (%s)", strerror(-n->broken));
        return;
    }
    if (check_format(io, path, sizeof path) != 0) {
        ast__batch_fail(&b->fail, i, &b->recs[i].err, AST_EINVAL, "%s", path);
        return;
    }
    if (b->writing && io->in_place) {
        if (path_of(n, io->block_id, ".rec", path, sizeof path) != 0) {
            ast__batch_fail(&b->fail, i, &b->recs[i].err, AST_EINVAL, "path too long");
            return;
        }
        r->fd = open(path, open_flags(n, O_RDWR));
        if (r->fd < 0 && errno != ENOENT) {
            ast__batch_fail(&b->fail, i, &b->recs[i].err, ast_err_from_errno(errno),
                            "cannot open %s to rewrite it: %s", path, strerror(errno));
            return;
        }
    }
    if (r->fd >= 0) { /* in place */
        r->in_place = 1;
        r->stream = ast__nvme_record_bytes(io->len);
        /* Someone may have truncated or grown it: the record must fill the file exactly. */
        if (fstat(r->fd, &st) != 0 || (uint64_t)st.st_size != r->stream) {
            if (ftruncate(r->fd, (off_t)r->stream) != 0) {
                ast__batch_fail(&b->fail, i, &b->recs[i].err, ast_err_from_errno(errno),
                                "ftruncate to %" PRIu64 ": %s", r->stream, strerror(errno));
                return;
            }
        }
        begin_write(b, i);
        return;
    }
    if (b->writing) {
        if (path_of(n, io->block_id, ".tmp", path, sizeof path) != 0) {
            ast__batch_fail(&b->fail, i, &b->recs[i].err, AST_EINVAL, "path too long");
            return;
        }
        if (n->faults & AST__FAULT_EROFS)
            errno = EROFS;
        else
            r->fd = open(path, open_flags(n, O_RDWR | O_CREAT | O_TRUNC), 0600);
        if (r->fd < 0) {
            ast__batch_fail(&b->fail, i, &b->recs[i].err, ast_err_from_errno(errno),
                            "cannot create %s: %s", path, strerror(errno));
            return;
        }
        r->stream = ast__nvme_record_bytes(io->len);
        if (!(n->faults & AST__FAULT_NO_FALLOCATE) &&
            fallocate(r->fd, 0, 0, (off_t)r->stream) != 0 && errno != EOPNOTSUPP &&
            errno != ENOSYS) {
            ast__batch_fail(&b->fail, i, &b->recs[i].err, ast_err_from_errno(errno),
                            "cannot reserve %" PRIu64 " bytes: %s", r->stream, strerror(errno));
            return;
        }
        begin_write(b, i);
        return;
    }
    if (io->fd >= 0) {
        r->fd = io->fd;
        r->borrowed = 1;
    } else {
        if (owner_path(n, io->owner, io->block_id, ".rec", path, sizeof path) != 0) {
            ast__batch_fail(&b->fail, i, &b->recs[i].err, AST_EINVAL, "path too long");
            return;
        }
        r->fd = open(path, open_flags(n, O_RDONLY));
        if (r->fd < 0) {
            ast__batch_fail(&b->fail, i, &b->recs[i].err, ast_err_from_errno(errno),
                            "cannot open the record: %s", strerror(errno));
            return;
        }
    }
    if (fstat(r->fd, &st) != 0) {
        ast__batch_fail(&b->fail, i, &b->recs[i].err, ast_err_from_errno(errno), "fstat: %s",
                        strerror(errno));
        return;
    }
    r->file_size = (uint64_t)st.st_size;
    r->stream = ast__nvme_record_bytes(io->len);
    if (round_up(r->file_size, AST__NVME_ALIGN) < r->stream)
        r->stream = round_up(r->file_size, AST__NVME_ALIGN);
    r->crc = crc_of(0, NULL, 0);
}

/* Header of record i, complete in r->hdr: damaged is ECORRUPT, intact but not ours EFOREIGN. */
static void check_header(struct batch *b, size_t i)
{
    const ast__nvme_io *io = &b->ios[i];
    struct rec *r = &b->recs[i];
    const unsigned char *h = r->hdr;
    uint64_t sid = get_le(h + 8, 8), bid = get_le(h + 16, 8), gen = get_le(h + 24, 8);
    uint64_t plen = get_le(h + 32, 8);
    uint64_t owner = io->owner ? io->owner : b->n->store_id;

    r->header_checked = 1;
    if (memcmp(h, REC_MAGIC, 4) != 0 || get_le(h + 60, 4) != crc_of(0, h, 60))
        ast__batch_fail(&b->fail, i, &b->recs[i].err, AST_ECORRUPT,
                        "record header damaged (bad magic or header checksum)");
    else if (get_le(h + 4, 2) != AST__NVME_VERSION || get_le(h + 6, 2) != AST__NVME_HEADER)
        ast__batch_fail(&b->fail, i, &b->recs[i].err, AST_ECORRUPT,
                        "record format version %u (header %u bytes); this build reads version %u",
                        (unsigned)get_le(h + 4, 2), (unsigned)get_le(h + 6, 2), AST__NVME_VERSION);
    else if (sid != owner)
        ast__batch_fail(&b->fail, i, &b->recs[i].err, AST_EFOREIGN, "record belongs to store %016"
                        PRIx64 ", not to store %016" PRIx64, sid, owner);
    else if (bid != io->block_id)
        ast__batch_fail(&b->fail, i, &b->recs[i].err, AST_EFOREIGN, "record holds block %" PRIu64
                        ", not block %" PRIu64, bid, io->block_id);
    else if (gen != io->generation)
        ast__batch_fail(&b->fail, i, &b->recs[i].err, AST_EFOREIGN, "stale record: generation %"
                        PRIu64 ", expected %" PRIu64, gen, io->generation);
    else if (h[40] != (unsigned)io->qtype || get_le(h + 44, 4) != io->qblock) {
        char found[64], want[64];
        describe_format(h[40], get_le(h + 44, 4), found, sizeof found);
        describe_format((unsigned)io->qtype, io->qblock, want, sizeof want);
        ast__batch_fail(&b->fail, i, &b->recs[i].err, AST_EFOREIGN, "record holds %s, expected %s",
                        found, want);
    }
    else if (plen != io->len)
        ast__batch_fail(&b->fail, i, &b->recs[i].err, AST_ECORRUPT, "record payload is %" PRIu64
                        " bytes, the block has %zu", plen, io->len);
}

/* Consumes stream bytes [a, a + nb) of record i from a slot, in stream order. */
static void absorb_read(struct batch *b, size_t i, const unsigned char *p, uint64_t a,
                        uint64_t nb)
{
    const ast__nvme_io *io = &b->ios[i];
    struct rec *r = &b->recs[i];
    const uint64_t H = AST__NVME_HEADER, P = H + io->len, T = P + AST__NVME_TRAILER;
    uint64_t s0, s1;
    char msg[256];

    if (r->err || a != r->done) /* after a gap (the file ended early) nothing is usable */
        return;
    r->done = a + nb;
    if (overlap(a, nb, 0, H, &s0, &s1))
        memcpy(r->hdr + s0, p + (s0 - a), s1 - s0);
    if (!r->header_checked && r->done >= H) {
        check_header(b, i);
        if (r->err)
            return;
    }
    if (overlap(a, nb, 0, P, &s0, &s1))
        r->crc = crc_of(r->crc, p + (s0 - a), s1 - s0);
    if (overlap(a, nb, H, P, &s0, &s1)) {
        int rc = copy_payload((unsigned char *)io->data + (s0 - H), p + (s0 - a), s1 - s0,
                              io->on_device, msg, sizeof msg);
        if (rc)
            ast__batch_fail(&b->fail, i, &b->recs[i].err, rc, "copying the payload out: %s", msg);
    }
    if (overlap(a, nb, P, T, &s0, &s1))
        memcpy(r->trl + (s0 - P), p + (s0 - a), s1 - s0);
    /* The padding carries no data, but a flipped byte anywhere in the file is still damage. */
    if (overlap(a, nb, T, UINT64_MAX, &s0, &s1)) {
        for (uint64_t j = s0; j < s1; j++) {
            if (p[j - a] != 0) {
                r->pad_bad = 1;
                break;
            }
        }
    }
}

static void complete(struct batch *b, unsigned k, int res)
{
    ast__nvme *n = b->n;
    struct op *o = &n->ops[k];
    struct rec *r = &b->recs[o->rec];

    b->inflight[k / b->gsize]--;
    /* Injected faults pretend the kernel said less than it did; resubmitting is idempotent. */
    if (!o->faulted && res > 0 && (n->faults & AST__FAULT_EAGAIN)) {
        o->faulted = 1;
        res = -EAGAIN;
    } else if (!o->faulted && o->kind != OP_SYNC && (n->faults & AST__FAULT_SHORT_IO) &&
               res > (int)AST__NVME_ALIGN) {
        o->faulted = 1;
        res = (int)round_up((uint64_t)res / 2, AST__NVME_ALIGN);
    }
    if (o->kind == OP_WRITE && r->faulty && res >= 0)
        res = -ENOSPC;

    if (res < 0) {
        if ((res == -EAGAIN || res == -EINTR) && o->tries++ < MAX_RETRIES) {
            prep_sqe(b, k);
            return;
        }
        r->inflight--;
        if (o->kind == OP_SYNC)
            ast__batch_fail(&b->fail, o->rec, &b->recs[o->rec].err, ast_err_from_errno(-res),
                            "fdatasync: %s", strerror(-res));
        else
            ast__batch_fail(&b->fail, o->rec, &b->recs[o->rec].err, ast_err_from_errno(-res),
                            "%s of %zu bytes at offset %" PRIu64 ": %s",
                            o->kind == OP_WRITE ? "write" : "read", o->len - o->done,
                            o->off + o->done, strerror(-res));
        return;
    }
    if (o->kind == OP_SYNC) {
        r->sync_state = 2;
        r->inflight--;
        return;
    }
    b->bytes += (uint64_t)res;
    o->done += (size_t)res;
    if (o->done < o->len) {
        int eof = o->kind == OP_READ && (res == 0 || o->off + o->done >= r->file_size);
        if (!eof) {
            if (res == 0 && o->tries++ >= MAX_RETRIES) {
                r->inflight--;
                ast__batch_fail(&b->fail, o->rec, &b->recs[o->rec].err, AST_EIO, "write at offset %"
                                PRIu64 " makes no progress", o->off + o->done);
                return;
            }
            prep_sqe(b, k);
            return;
        }
    }
    r->inflight--;
    if (o->kind == OP_WRITE)
        r->done += o->len;
}

/* Submits what is prepared and reaps completions until the kernel owns no SQE of group g
 * (the other group's completions are handled as they come: a retry stays in its slot). */
static void finish_group(struct batch *b, unsigned g)
{
    ast__nvme *n = b->n;

    while (b->inflight[g]) {
        struct io_uring_cqe *cqe;
        unsigned head, seen = 0;
        int rc = io_uring_submit_and_wait(&n->ring, 1);

        if (rc < 0 && rc != -EINTR && rc != -EAGAIN && rc != -EBUSY) {
            /* The ring refused work it had accepted before: nothing can be trusted now. */
            n->broken = rc;
            for (unsigned h = 0; h < b->ngroups; h++) {
                for (unsigned j = 0; j < b->nops[h]; j++) {
                    const struct op *o = &n->ops[h * b->gsize + j];
                    b->recs[o->rec].inflight = 0;
                    ast__batch_fail(&b->fail, o->rec, &b->recs[o->rec].err, AST_EIO,
                                    "io_uring_submit: %s", strerror(-rc));
                }
                b->inflight[h] = 0;
            }
            return;
        }
        io_uring_for_each_cqe(&n->ring, head, cqe)
        {
            complete(b, (unsigned)io_uring_cqe_get_data64(cqe), cqe->res);
            seen++;
        }
        io_uring_cq_advance(&n->ring, seen);
    }
}

/* Hands group g's slots to the next chunks of the batch, in record order, and submits them. */
static void fill_group(struct batch *b, unsigned g, size_t cursor, size_t *hi)
{
    ast__nvme *n = b->n;

    const uint64_t cap = (uint64_t)b->gsize * n->slot_size;

    b->nops[g] = 0;
    b->gbytes[g] = 0;
    /* The record at the cursor always gets a slot, so every group makes progress. */
    for (size_t i = cursor; i < b->count && b->nops[g] < b->gsize && b->gbytes[g] < cap; i++) {
        struct rec *r = &b->recs[i];
        if (r->state == REC_PENDING) {
            start_record(b, i);
            *hi = i + 1;
        }
        if (r->state != REC_ACTIVE || r->err)
            continue;
        if (b->writing && !n->direct && r->done == r->stream && r->sync_state == 0)
            issue(b, i, OP_SYNC, g);
        while (!r->err && r->staged < r->stream && b->nops[g] < b->gsize && b->gbytes[g] < cap)
            issue(b, i, b->writing ? OP_WRITE : OP_READ, g);
    }
    if (b->nops[g])
        io_uring_submit(&n->ring);
}

/* With group g's I/O complete: consumes its reads in stream order. Groups are finished in the
 * order they were filled, so each record's chunks arrive in file order. */
static void absorb_group(struct batch *b, unsigned g)
{
    ast__nvme *n = b->n;

    for (unsigned j = 0; j < b->nops[g]; j++) {
        unsigned k = g * b->gsize + j;
        const struct op *o = &n->ops[k];
        struct rec *r = &b->recs[o->rec];
        if (o->kind == OP_READ && r->direct) {
            if (!r->err && o->off == r->done) /* after a gap nothing is usable */
                r->done = o->off + o->done;
        } else if (o->kind == OP_READ) {
            absorb_read(b, o->rec, slot(n, k), o->off, o->done);
        }
        r->queued--;
    }
    b->nops[g] = 0;
}

/* Consumes what the kernel read of a framed record: header check, CRC, trailer, padding. */
static void frame_read(struct batch *b, size_t i)
{
    const ast__nvme_io *io = &b->ios[i];
    struct rec *r = &b->recs[i];
    const unsigned char *f = frame(b, i);
    const uint64_t H = AST__NVME_HEADER, P = H + io->len, T = P + AST__NVME_TRAILER;

    if (r->done < H)
        return; /* verify_read reports the truncation */
    memcpy(r->hdr, f, H);
    check_header(b, i);
    if (r->err)
        return;
    r->crc = crc_of(0, f, r->done < P ? r->done : P);
    if (r->done >= T)
        memcpy(r->trl, f + P, AST__NVME_TRAILER);
    for (uint64_t j = T; j < r->done; j++) {
        if (f[j] != 0) {
            r->pad_bad = 1;
            break;
        }
    }
}

static void verify_read(struct batch *b, size_t i)
{
    const ast__nvme_io *io = &b->ios[i];
    struct rec *r = &b->recs[i];
    uint64_t want = ast__nvme_record_bytes(io->len);
    uint32_t stored;

    if (r->done < AST__NVME_HEADER || r->file_size < want)
        ast__batch_fail(&b->fail, i, &b->recs[i].err, AST_ECORRUPT,
                        "truncated record: the file has %" PRIu64
                        " bytes, the record of a %zu-byte block has %" PRIu64, r->file_size,
                        io->len, want);
    else if (r->file_size > want)
        ast__batch_fail(&b->fail, i, &b->recs[i].err, AST_ECORRUPT,
                        "oversized record: the file has %" PRIu64
                        " bytes, the record of a %zu-byte block has %" PRIu64, r->file_size,
                        io->len, want);
    else if (r->done < AST__NVME_HEADER + io->len + AST__NVME_TRAILER)
        ast__batch_fail(&b->fail, i, &b->recs[i].err, AST_ECORRUPT, "truncated record: only %"
                        PRIu64 " bytes could be read", r->done);
    else if ((stored = (uint32_t)get_le(r->trl, 4)) != r->crc ||
             memcmp(r->trl + 4, END_MAGIC, 4) != 0)
        ast__batch_fail(&b->fail, i, &b->recs[i].err, AST_ECORRUPT,
                        "checksum mismatch: stored crc32 %08" PRIx32 ", computed %08" PRIx32,
                        stored, r->crc);
    else if (r->pad_bad)
        ast__batch_fail(&b->fail, i, &b->recs[i].err, AST_ECORRUPT,
                        "damaged padding after the payload (nonzero bytes)");
}

/* Completes what can be completed of record i once none of its ops is in flight. */
static void finalize(struct batch *b, size_t i)
{
    ast__nvme *n = b->n;
    struct rec *r = &b->recs[i];
    char tmp[PATH_BYTES], path[PATH_BYTES];

    if (r->state != REC_ACTIVE || r->inflight || r->queued)
        return;
    if (!r->err) {
        if (r->staged < r->stream)
            return; /* more chunks to come */
        if (b->writing) {
            if (!n->direct && r->sync_state != 2)
                return; /* the next round issues (or has issued) its fdatasync */
            path_of(n, b->ios[i].block_id, ".tmp", tmp, sizeof tmp);
            ast__nvme_record_path(n, b->ios[i].block_id, path, sizeof path);
            if (r->in_place)
                ; /* rewritten under its own name: nothing to rename */
            else if (n->anonymous) { /* the record is its descriptor: it dies with this process */
                if (unlink(tmp) != 0)
                    ast__batch_fail(&b->fail, i, &b->recs[i].err, ast_err_from_errno(errno),
                                    "unlink %s: %s", tmp, strerror(errno));
            } else if (rename(tmp, path) != 0)
                ast__batch_fail(&b->fail, i, &b->recs[i].err, ast_err_from_errno(errno),
                                "rename from %s: %s", tmp, strerror(errno));
            if (!r->err && n->anonymous) { /* the record is its descriptor: the caller's now */
                b->ios[i].fd = r->fd;
                r->fd = -1;
            }
        } else {
            if (r->direct)
                frame_read(b, i);
            if (!r->err)
                verify_read(b, i);
        }
    }
    if (r->fd >= 0 && !r->borrowed)
        close(r->fd);
    r->fd = -1;
    if (r->err) {
        if (b->writing && !r->in_place &&
            path_of(n, b->ios[i].block_id, ".tmp", tmp, sizeof tmp) == 0)
            unlink(tmp);
        r->state = REC_FAILED;
        return;
    }
    r->state = REC_DONE;
}

static int run_batch(ast__nvme *n, ast__nvme_io *ios, size_t count, int writing,
                     ast__nvme_xfer *x, char *err, size_t len)
{
    struct batch b;
    size_t cursor = 0, hi = 0, ok = 0;
    uint64_t t0 = ast__now_ns();
    int rc;

    memset(&b, 0, sizeof b);
    b.n = n;
    b.ios = ios;
    b.count = count;
    b.writing = writing;
    ast__batch_err_init(&b.fail);
    b.err = err;
    b.errlen = len;
    if (err && len)
        err[0] = '\0';
    for (size_t i = 0; i < count; i++)
        ios[i].result = 0;
    if (count && !(b.recs = calloc(count, sizeof *b.recs)))
        return ast__errorf(err, len, AST_ENOMEM, "no memory for a batch of %zu records", count);
    if (count) {
        char why[768];
        rc = ring_of_this_process(n, why, sizeof why);
        if (rc) {
            for (size_t i = 0; i < count; i++)
                ast__batch_fail(&b.fail, i, &b.recs[i].err, rc, "%s", why);
            rc = report(&b);
            free(b.recs);
            if (x)
                *x = (ast__nvme_xfer){0, ast__now_ns() - t0, 0};
            return rc;
        }
    }

    /* Two groups of slots alternate: while the kernel works on one, this thread stages the
     * next writes into the other or checks and copies out the reads the other just finished. */
    b.ngroups = n->depth >= 2 ? 2 : 1;
    b.gsize = n->depth / b.ngroups;
    for (unsigned g = 0, idle = 0; cursor < count;) {
        unsigned h;
        fill_group(&b, g, cursor, &hi);
        h = b.ngroups == 2 ? g ^ 1 : g;
        if (b.ngroups == 2 && b.nops[h] == 0 && b.nops[g] != 0) {
            g = h; /* nothing older in flight: start the other group before waiting */
            continue;
        }
        if (b.nops[h] == 0 && b.nops[g] == 0) {
            if (idle++) { /* nothing in flight and nothing to issue twice: cannot progress */
                for (size_t i = cursor; i < count; i++)
                    if (b.recs[i].state != REC_DONE && b.recs[i].state != REC_FAILED)
                        ast__batch_fail(&b.fail, i, &b.recs[i].err, AST_EIO,
                                        "internal: the batch stopped making progress");
            }
        } else {
            idle = 0;
            finish_group(&b, h);
            absorb_group(&b, h);
        }
        for (size_t i = cursor; i < hi; i++)
            finalize(&b, i);
        while (cursor < count && (b.recs[cursor].state == REC_DONE ||
                                  b.recs[cursor].state == REC_FAILED))
            cursor++;
        if (idle > 1) {
            for (size_t i = cursor; i < count; i++)
                if (b.recs[i].state == REC_PENDING)
                    b.recs[i].state = REC_FAILED;
            break;
        }
        g = h;
    }
    for (size_t i = 0; i < count; i++)
        ok += b.recs[i].state == REC_DONE;
    rc = report(&b);
    free(b.recs);
    if (x) {
        x->bytes = b.bytes;
        x->ns = ast__now_ns() - t0;
        x->records = ok;
    }
    return rc;
}

int ast__nvme_write(ast__nvme *n, ast__nvme_io *ios, size_t count, ast__nvme_xfer *x,
                    char *err, size_t len)
{
    return run_batch(n, ios, count, 1, x, err, len);
}

int ast__nvme_read(ast__nvme *n, ast__nvme_io *ios, size_t count, ast__nvme_xfer *x, char *err,
                   size_t len)
{
    return run_batch(n, ios, count, 0, x, err, len);
}

#else /* !ASTERIA_HAVE_URING */

int ast__nvme_open(const ast__nvme_opts *o, ast__nvme **out, char *err, size_t len)
{
    *out = NULL;
    return ast__errorf(err, len, AST_ENOTSUP, "nvme_dir '%s': libasteria was built without "
                       "liburing (ASTERIA_WITH_URING=OFF), so there is no NVMe tier",
                       o && o->dir ? o->dir : "");
}

void ast__nvme_close(ast__nvme *n)
{
    /* ast__nvme_open never succeeds without liburing: there is nothing to close. */
    (void)n;
}

static int no_uring(size_t count, ast__nvme_io *ios, char *err, size_t len)
{
    for (size_t i = 0; i < count; i++)
        ios[i].result = AST_ENOTSUP;
    return ast__errorf(err, len, AST_ENOTSUP, "built without liburing");
}

int ast__nvme_write(ast__nvme *n, ast__nvme_io *ios, size_t count, ast__nvme_xfer *x,
                    char *err, size_t len)
{
    return no_uring(count, ios, err, len);
}

int ast__nvme_read(ast__nvme *n, ast__nvme_io *ios, size_t count, ast__nvme_xfer *x, char *err,
                   size_t len)
{
    return no_uring(count, ios, err, len);
}

#endif
