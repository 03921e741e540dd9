/*
 * store.c - blocks of optimizer state, one tier each; per-tier accounting; moves (store.h).
 *
 * Owns: the block table (id -> tier, size, memory, NVMe record generation), the counters behind
 * ast_store_stats, the store's NVMe engine (nvme.c) and its last-error message. May call:
 * cuda_mem.h (pinned, device and managed memory, copies), nvme.h (records), quant.h (the rule
 * for a block's format: ast_quant_layout_get), util.h (the block table is an ast__htable; the
 * last-error text and a move's first failure are util's), libc.
 * Implements the store's test hooks of testing.h (an open with faults armed, the engine).
 *
 * Locking: one mutex per store. Every public function holds it for its whole duration, the I/O
 * batches of a move to or from NVME included, so allocation, free, lookups and stats on a store
 * wait while one of its moves does I/O. That keeps a block from being freed, moved or read
 * back while its record is in flight without a per-block "busy" state every caller would have to
 * handle; moves are issued in batches by one planner, so the serialisation costs little. The
 * engine and cuda_mem take no locks, so there is no lock order to keep. ast_store_close must
 * not race with any other call on the same store.
 *
 * Fork (pthread_atfork, installed by the first open; registry_mtx guards the list of open
 * stores, `stores`, and nothing else). The NVMe records and the io_uring ring belong to the
 * process that opened the store; a forked child gets a working copy of the store that can
 * never harm them:
 *  - prepare (in the parent) takes registry_mtx, then every store's mutex (so no move is
 *    mid-batch when memory is copied), and opens a read descriptor of every NVME block's
 *    record (blk.fork_fd); the parent handler closes those and unlocks.
 *  - the child handler releases every store's mutex (prepare took it in the thread that
 *    forked, the child's one thread; no other thread of the parent holds a store mutex then),
 *    gives the store a new random store id and tells the engine (ast__nvme_adopt): the child's
 *    records are unlinked files kept as descriptors (blk.rfd, owner 0), so they never take a
 *    name the parent could see and vanish with the child however it exits; the engine sets up
 *    the child's own ring on its first batch. Each NVME block keeps its record's owner id
 *    (blk.owner) and the descriptor opened before the fork (blk.rfd), so the child reads the
 *    value the block had at the fork even after the parent has replaced or removed that file;
 *    a record the prepare handler could not open is read by path, and a record the parent has
 *    changed since is then reported (AST_ENOENT or AST_EFOREIGN), never used. The child never
 *    unlinks a record it does not own.
 *  - Cost: one open(2) per NVME block per fork, and a child keeps the pre-fork records' disk
 *    space alive (through those descriptors) until it reads the blocks back, frees them,
 *    closes the store or exits. fork() waits for a move in progress on another thread.
 * Lock order: registry_mtx, then store mutexes in registry order; only prepare holds more
 * than one. Nobody takes registry_mtx while holding a store mutex.
 *
 * Record files: a block's record file stays after the block is read back (blk.named), stale,
 * and is rewritten in place by its next move to NVME (blk.shared excepted: after a fork the
 * child may still read that inode, so the parent writes a new file and renames it over);
 * free and close remove it.
 *
 * Formats: a block's format (blk.qtype, blk.qblock; raw bytes unless ast_store_set_format says
 * otherwise) goes into the header of each record written for it and is what a read back
 * expects (ast__nvme_io.qtype / .qblock): a record of another format is refused (AST_EFOREIGN,
 * naming both). The store never looks inside the bytes.
 *
 * Accounting: bytes[] counts block payload bytes (an NVMe record's header and padding are not
 * counted; nvme_bytes_written/read count everything the kernel transferred).
 * nvme_budget_bytes caps bytes[AST_TIER_NVME].
 */
#include "asteria/store.h"

#include "asteria/build_config.h"
#include "asteria/errors.h"
#include "cuda_mem.h"
#include "nvme.h"
#include "asteria/quant.h"
#include "testing.h"
#include "util.h"

#include <fcntl.h>
#include <inttypes.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <time.h>
#include <unistd.h>

#define MSG_BYTES (AST__LAST_ERROR_BYTES / 2) /* a cause, quoted in the last-error text */

struct blk {
    ast__hnode node; /* in s->tab, key = id */
    uint64_t id;
    ast_tier tier;
    size_t nbytes;
    void *ptr;     /* NULL on NVME */
    uint64_t gen;  /* generation of the block's newest NVMe record */
    uint64_t owner; /* store id that wrote that record: 0 this store, else (forked child) the
                       parent's */
    int rfd;       /* NVME: a descriptor of the record opened before a fork, or a forked
                      child's own unlinked record; else -1 */
    int fork_fd;   /* NVME, during a fork only: the descriptor the child inherits as rfd */
    int named;     /* a record file of this store's id exists under the block's name (on NVME:
                      its current record; elsewhere: a stale one, rewritten in place next time) */
    int shared;    /* the named file's inode may be held by a forked child: the next write
                      makes a new file (tmp + rename) instead of rewriting it in place */
    ast_qtype qtype;  /* what the bytes hold (ast_store_set_format); AST_QTYPE_NONE: raw */
    uint32_t qblock;  /* its values per scale; 0 with AST_QTYPE_NONE */
    uint64_t mark; /* stamp of the last move batch that named it: catches duplicate ids */
};

struct ast_store {
    pthread_mutex_t mu;
    ast__htable tab; /* id -> block */
    uint64_t next_id;
    uint64_t stamp;
    uint64_t store_id;
    uint64_t nvme_budget;
    ast__nvme *nvme;
    int child;       /* a forked child's copy: records are unlinked files, kept as descriptors */
    ast_store_stats st;
    int cuda_probed;
    int ndev;
    ast__last_error err;
    ast_store *reg_prev, *reg_next; /* the registry of open stores (fork handlers) */
};

static pthread_mutex_t registry_mtx = PTHREAD_MUTEX_INITIALIZER;
static ast_store *stores;
static pthread_once_t atfork_once = PTHREAD_ONCE_INIT;

/* Every tier with its name, in the order tiers are listed to users (ast_tier_listed): the one
 * list of the tier names. asteria._C.tiers() hands it to Python, where the package's tier list
 * (asteria.config.TIERS) and the optimizer's per-tier stats keys are made from it. */
static const struct tier_row {
    ast_tier tier;
    const char *name;
} TIERS[AST_TIER_COUNT] = {{AST_TIER_DEVICE, "device"}, {AST_TIER_HOST_PINNED, "host_pinned"},
                           {AST_TIER_HOST, "host"}, {AST_TIER_UVM, "uvm"}, {AST_TIER_NVME, "nvme"}};

const char *ast_tier_name(ast_tier t)
{
    for (int i = 0; i < AST_TIER_COUNT; i++)
        if (TIERS[i].tier == t)
            return TIERS[i].name;
    return NULL;
}

int ast_tier_parse(const char *name, ast_tier *out)
{
    if (!name || !out)
        return AST_EINVAL;
    for (int i = 0; i < AST_TIER_COUNT; i++) {
        if (strcmp(name, TIERS[i].name) == 0) {
            *out = TIERS[i].tier;
            return 0;
        }
    }
    return AST_EINVAL;
}

ast_tier ast_tier_listed(int i)
{
    return i >= 0 && i < AST_TIER_COUNT ? TIERS[i].tier : AST_TIER_COUNT;
}

void ast_store_opts_init(ast_store_opts *o)
{
    if (!o)
        return;
    memset(o, 0, sizeof *o);
    o->nvme_dir = NULL;
    o->direct = AST_DIRECT_REQUIRE;
}

/* ---- block table --------------------------------------------------------------------------- */

static struct blk *blk_of(ast__hnode *x)
{
    return AST__CONTAINER_OF(x, struct blk, node);
}

static struct blk *lookup(const ast_store *s, uint64_t id)
{
    ast__hnode *x = ast__htable_find(&s->tab, id);
    return x ? blk_of(x) : NULL;
}

/* ---- helpers (store mutex held) -------------------------------------------------------------- */

static int valid_tier(ast_tier t)
{
    return (unsigned)t < AST_TIER_COUNT;
}

/* Device and managed memory are copied with the CUDA runtime, everything else with memcpy. */
static int device_side(ast_tier t)
{
    return t == AST_TIER_DEVICE || t == AST_TIER_UVM;
}

/* Whether blocks can live in tier t on this store and machine; the message says why not. */
static int tier_ready(ast_store *s, ast_tier t)
{
    char msg[256] = "";
    ast__cuda_coherence c;
    int coherent, rc;

    switch (t) {
    case AST_TIER_HOST:
        return 0;
    case AST_TIER_NVME:
        return s->nvme ? 0
                       : ast__set_error(&s->err, NULL, AST_ENOTSUP, "tier nvme: this store has no "
                                        "NVMe tier (ast_store_opts.nvme_dir was NULL)");
    default:
        break;
    }
    if (!s->cuda_probed) {
        s->ndev = ast__cuda_device_count();
        s->cuda_probed = 1;
    }
    if (s->ndev == 0)
        return ast__set_error(&s->err, NULL, AST_ENODEV, "tier %s: no CUDA device (%s)",
                              ast_tier_name(t),
                              ASTERIA_HAVE_CUDA
                                  ? "cudaGetDeviceCount reports none or no driver is loaded"
                                  : "libasteria was built without CUDA");
    if (t != AST_TIER_UVM)
        return 0;
    rc = ast__cuda_coherent_host_access(&coherent, &c, msg, sizeof msg);
    if (rc)
        return ast__set_error(&s->err, NULL, rc, "tier uvm: %s", msg);
    if (!coherent)
        return ast__set_error(&s->err, NULL, AST_ENOTSUP, "tier uvm: device %d has no coherent "
                              "host access to managed memory (concurrentManagedAccess=%d, "
                              "pageableMemoryAccessUsesHostPageTables=%d)", c.device,
                              c.concurrent_managed, c.pageable_host_tables);
    return 0;
}

/* Host blocks of AST__NVME_FRAME_MIN bytes and more are framed (nvme.h): the payload starts
 * AST__NVME_HEADER bytes into a 4096-aligned buffer of the record's size, so moves to and from
 * NVME run without a staging copy. The size alone tells whether a host block is framed. */
static int framed(ast_tier t, size_t n)
{
    return t == AST_TIER_HOST && n >= AST__NVME_FRAME_MIN;
}

/* zero: the block must read as zeros (alloc); a read-back's destination need not be. */
static int mem_alloc_z(ast_tier t, size_t n, void **p, int zero, char *msg, size_t len)
{
    switch (t) {
    case AST_TIER_HOST:
        if (framed(t, n)) {
            size_t fb = (size_t)ast__nvme_record_bytes(n);
            void *f = NULL;
            if (posix_memalign(&f, AST__NVME_ALIGN, fb) != 0)
                return ast__errorf(msg, len, AST_ENOMEM, "posix_memalign(%zu) failed", fb);
            if (zero)
                memset(f, 0, fb);
            *p = (unsigned char *)f + AST__NVME_HEADER;
            return 0;
        }
        *p = zero ? calloc(1, n) : malloc(n);
        if (!*p)
            return ast__errorf(msg, len, AST_ENOMEM, "calloc(%zu) failed", n);
        return 0;
    case AST_TIER_HOST_PINNED:
        return ast__cuda_host_alloc(p, n, msg, len);
    case AST_TIER_DEVICE:
        return ast__cuda_malloc(p, n, msg, len);
    case AST_TIER_UVM:
        return ast__cuda_managed_alloc(p, n, msg, len);
    default:
        return ast__errorf(msg, len, AST_EINVAL, "tier %d has no memory of its own", (int)t);
    }
}

static int mem_alloc(ast_tier t, size_t n, void **p, char *msg, size_t len)
{
    return mem_alloc_z(t, n, p, 1, msg, len);
}

static void mem_free(ast_tier t, void *p, size_t n)
{
    switch (t) {
    case AST_TIER_HOST:
        if (p && framed(t, n))
            p = (unsigned char *)p - AST__NVME_HEADER;
        free(p);
        break;
    case AST_TIER_HOST_PINNED:
        ast__cuda_host_free(p, NULL, 0);
        break;
    case AST_TIER_DEVICE:
    case AST_TIER_UVM:
        ast__cuda_free(p, NULL, 0);
        break;
    default:
        break;
    }
}

static int mem_copy(ast_tier dt, void *dst, ast_tier st, const void *src, size_t n, char *msg,
                    size_t len)
{
    if (device_side(dt) || device_side(st))
        return ast__cuda_memcpy(dst, src, n, msg, len);
    memcpy(dst, src, n);
    return 0;
}

static void account(ast_store *s, ast_tier t, size_t nbytes, int sign)
{
    if (sign > 0) {
        s->st.bytes[t] += nbytes;
        s->st.blocks[t]++;
    } else {
        s->st.bytes[t] -= nbytes;
        s->st.blocks[t]--;
    }
}

static void count_io(ast_store *s, int writing, const ast__nvme_xfer *x)
{
    if (writing) {
        s->st.nvme_bytes_written += x->bytes;
        s->st.nvme_write_ns += x->ns;
        s->st.nvme_writes += x->records;
    } else {
        s->st.nvme_bytes_read += x->bytes;
        s->st.nvme_read_ns += x->ns;
        s->st.nvme_reads += x->records;
    }
}

/* NVMe budget check for adding nbytes on top of pending bytes already granted in this call. */
static int within_budget(const ast_store *s, uint64_t pending, size_t nbytes)
{
    return s->nvme_budget == 0 || s->st.bytes[AST_TIER_NVME] + pending + nbytes <= s->nvme_budget;
}

static uint64_t random_id(void)
{
    uint64_t v = 0;
    struct timespec ts;

    if (getrandom(&v, sizeof v, 0) != (ssize_t)sizeof v) {
        clock_gettime(CLOCK_REALTIME, &ts);
        v = ((uint64_t)ts.tv_sec << 32) ^ (uint64_t)ts.tv_nsec ^ ((uint64_t)getpid() << 16) ^
            (uint64_t)(uintptr_t)&v;
    }
    return v ? v : 1;
}

static void drop_fd(struct blk *b)
{
    if (b->rfd >= 0)
        close(b->rfd);
    b->rfd = -1;
}

/* A block was read back from NVME: this store's named record stays (stale, to be rewritten in
 * place by the next move to NVME, which saves an unlink now and a create then: unlinking a
 * just-written file cost 2 ms on this machine's ext4 with discard, creating one 0.2 ms); a
 * parent's record (forked child) or a child's unlinked record is let go. */
static void record_read_back(struct blk *b)
{
    drop_fd(b);
    b->owner = 0;
}

/* A block is freed: its record goes, if this store named it. */
static void forget_record(ast_store *s, struct blk *b)
{
    if (b->named)
        ast__nvme_remove(s->nvme, b->id);
    drop_fd(b);
    b->named = 0;
    b->owner = 0;
}

/* A record of block b was just written; fd is the descriptor of a forked child's unnamed
 * record, else -1. */
static void record_written(ast_store *s, struct blk *b, int fd)
{
    drop_fd(b);
    b->rfd = fd;
    b->named = !s->child;
    b->shared = 0;
    b->owner = 0;
}

/* ---- fork (see the header comment) --------------------------------------------------------- */

static void atfork_prepare(void)
{
    pthread_mutex_lock(&registry_mtx);
    for (ast_store *s = stores; s; s = s->reg_next) {
        pthread_mutex_lock(&s->mu);
        for (ast__hnode *x = ast__htable_first(&s->tab); x; x = ast__htable_after(&s->tab, x)) {
            struct blk *b = blk_of(x);
            if (b->tier != AST_TIER_NVME)
                continue;
            if (b->rfd >= 0)
                b->fork_fd = fcntl(b->rfd, F_DUPFD_CLOEXEC, 0);
            else if (ast__nvme_open_record(s->nvme, b->owner, b->id, &b->fork_fd) != 0)
                b->fork_fd = -1; /* the child reads it by path and checks it */
        }
    }
}

static void atfork_parent(void)
{
    for (ast_store *s = stores; s; s = s->reg_next) {
        for (ast__hnode *x = ast__htable_first(&s->tab); x; x = ast__htable_after(&s->tab, x)) {
            struct blk *b = blk_of(x);
            if (b->tier == AST_TIER_NVME)
                b->shared = 1; /* the child may read this inode: never rewrite it in place */
            if (b->fork_fd >= 0) {
                close(b->fork_fd);
                b->fork_fd = -1;
            }
        }
        pthread_mutex_unlock(&s->mu);
    }
    pthread_mutex_unlock(&registry_mtx);
}

static void atfork_child(void)
{
    for (ast_store *s = stores; s; s = s->reg_next) {
        uint64_t parent_id = s->store_id;
        /* prepare locked it in the thread that forked, which is this process's one thread */
        pthread_mutex_unlock(&s->mu);
        if (!s->nvme)
            continue;
        s->store_id = random_id();
        s->child = 1;
        ast__nvme_adopt(s->nvme, s->store_id);
        for (ast__hnode *x = ast__htable_first(&s->tab); x; x = ast__htable_after(&s->tab, x)) {
            struct blk *b = blk_of(x);
            /* The named records are the parent's. */
            b->named = 0;
            b->shared = 0;
            if (b->tier != AST_TIER_NVME)
                continue;
            if (b->owner == 0)
                b->owner = parent_id;
            drop_fd(b);
            b->rfd = b->fork_fd;
            b->fork_fd = -1;
        }
    }
    pthread_mutex_unlock(&registry_mtx);
}

static void install_atfork(void)
{
    pthread_atfork(atfork_prepare, atfork_parent, atfork_child);
}

/* ---- open / close -------------------------------------------------------------------------- */

int ast__store_open_faults(const ast_store_opts *opts, unsigned faults, ast_store **out,
                           char *errbuf, size_t len)
{
    ast_store_opts defaults;
    ast_store *s;
    int rc;

    if (errbuf && len)
        errbuf[0] = '\0';
    if (!out)
        return ast__errorf(errbuf, len, AST_EINVAL, "ast_store_open: out is NULL");
    *out = NULL;
    if (!opts) {
        ast_store_opts_init(&defaults);
        opts = &defaults;
    }
    s = calloc(1, sizeof *s);
    if (!s)
        return ast__errorf(errbuf, len, AST_ENOMEM, "ast_store_open: out of memory");
    pthread_mutex_init(&s->mu, NULL);
    s->next_id = 1;
    s->store_id = random_id();
    s->nvme_budget = opts->nvme_budget_bytes;
    s->st.nvme_direct = -1;
    if (opts->nvme_dir) {
        ast__nvme_opts no = {opts->nvme_dir, opts->direct, opts->queue_depth, s->store_id,
                             faults};
        rc = ast__nvme_open(&no, &s->nvme, errbuf, len);
        if (rc) {
            ast_store_close(s);
            return rc;
        }
        s->st.nvme_direct = ast__nvme_direct(s->nvme);
    }
    pthread_once(&atfork_once, install_atfork);
    pthread_mutex_lock(&registry_mtx);
    s->reg_next = stores;
    if (stores)
        stores->reg_prev = s;
    stores = s;
    pthread_mutex_unlock(&registry_mtx);
    *out = s;
    return 0;
}

int ast_store_open(const ast_store_opts *opts, ast_store **out, char *errbuf, size_t len)
{
    return ast__store_open_faults(opts, 0, out, errbuf, len);
}

void ast_store_close(ast_store *s)
{
    if (!s)
        return;
    pthread_mutex_lock(&registry_mtx);
    if (s->reg_prev || stores == s) {
        if (s->reg_prev)
            s->reg_prev->reg_next = s->reg_next;
        else
            stores = s->reg_next;
        if (s->reg_next)
            s->reg_next->reg_prev = s->reg_prev;
    }
    pthread_mutex_unlock(&registry_mtx);
    for (ast__hnode *x = ast__htable_first(&s->tab), *next; x; x = next) {
        struct blk *b = blk_of(x);
        next = ast__htable_after(&s->tab, x);
        mem_free(b->tier, b->ptr, b->nbytes);
        drop_fd(b);
        free(b);
    }
    ast__nvme_close(s->nvme); /* removes every record file of this store, NVME blocks' too */
    ast__htable_free(&s->tab);
    pthread_mutex_destroy(&s->mu);
    free(s);
}

ast__nvme *ast__store_nvme(ast_store *s)
{
    return s ? s->nvme : NULL;
}

/* ---- blocks -------------------------------------------------------------------------------- */

int ast_store_alloc(ast_store *s, ast_tier tier, size_t nbytes, uint64_t *id)
{
    char msg[MSG_BYTES] = "";
    struct blk *b;
    int rc;

    if (!s || !id || !valid_tier(tier))
        return AST_EINVAL;
    pthread_mutex_lock(&s->mu);
    if (nbytes == 0 || nbytes > SIZE_MAX / 2) {
        rc = ast__set_error(&s->err, NULL, AST_EINVAL,
                            "alloc: %zu bytes is not a valid block size", nbytes);
        goto out;
    }
    rc = tier_ready(s, tier);
    if (rc)
        goto out;
    b = calloc(1, sizeof *b);
    if (!b) {
        rc = ast__set_error(&s->err, NULL, AST_ENOMEM, "alloc: out of memory");
        goto out;
    }
    b->id = s->next_id;
    b->tier = tier;
    b->nbytes = nbytes;
    b->rfd = -1;
    b->fork_fd = -1;
    if (tier == AST_TIER_NVME) {
        /* A zero-filled block on NVME is a record of zeros (data NULL). */
        ast__nvme_io io = {.block_id = b->id, .generation = 1, .len = nbytes, .fd = -1};
        ast__nvme_xfer x = {0, 0, 0};
        if (!within_budget(s, 0, nbytes)) {
            rc = ast__set_error(&s->err, NULL, AST_ENOSPC, "alloc on nvme: no space left for %zu "
                                "bytes under nvme_budget_bytes %" PRIu64 " (%" PRIu64 " in use)",
                                nbytes, s->nvme_budget, s->st.bytes[AST_TIER_NVME]);
            free(b);
            goto out;
        }
        rc = ast__nvme_write(s->nvme, &io, 1, &x, msg, sizeof msg);
        count_io(s, 1, &x);
        b->gen = 1;
        if (rc == 0)
            record_written(s, b, io.fd);
    } else {
        rc = mem_alloc(tier, nbytes, &b->ptr, msg, sizeof msg);
    }
    if (rc == 0 && (rc = ast__htable_reserve(&s->tab, s->tab.n + 1)) != 0) {
        mem_free(tier, b->ptr, nbytes);
        if (tier == AST_TIER_NVME)
            forget_record(s, b);
        snprintf(msg, sizeof msg, "out of memory for the block table");
    }
    if (rc) {
        free(b);
        rc = ast__set_error(&s->err, NULL, rc, "alloc of %zu bytes on %s: %s", nbytes,
                            ast_tier_name(tier), msg);
        goto out;
    }
    b->node.key = b->id;
    ast__htable_insert(&s->tab, &b->node);
    s->next_id++;
    account(s, tier, nbytes, +1);
    *id = b->id;
out:
    pthread_mutex_unlock(&s->mu);
    return rc;
}

static struct blk *find(ast_store *s, uint64_t id, const char *what)
{
    struct blk *b = id ? lookup(s, id) : NULL;
    if (!b)
        ast__set_error(&s->err, NULL, AST_ENOENT, "%s: no block %" PRIu64 " in this store", what,
                       id);
    return b;
}

int ast_store_free(ast_store *s, uint64_t id)
{
    struct blk *b;
    int rc = 0;

    if (!s)
        return AST_EINVAL;
    pthread_mutex_lock(&s->mu);
    b = find(s, id, "free");
    if (!b) {
        rc = AST_ENOENT;
    } else {
        forget_record(s, b); /* its record, even a stale one; one that cannot go goes at close */
        if (b->tier != AST_TIER_NVME)
            mem_free(b->tier, b->ptr, b->nbytes);
        account(s, b->tier, b->nbytes, -1);
        ast__htable_remove(&s->tab, &b->node);
        free(b);
    }
    pthread_mutex_unlock(&s->mu);
    return rc;
}

/* Copies block id's memory, size and tier, under the lock, to those of ptr, nbytes and tier
 * that are not NULL. what: the caller, for the error message. */
static int blk_get(ast_store *s, uint64_t id, const char *what, void **ptr, size_t *nbytes,
                   ast_tier *tier)
{
    pthread_mutex_lock(&s->mu);
    struct blk *b = find(s, id, what);
    if (b && ptr)
        *ptr = b->ptr;
    if (b && nbytes)
        *nbytes = b->nbytes;
    if (b && tier)
        *tier = b->tier;
    pthread_mutex_unlock(&s->mu);
    return b ? 0 : AST_ENOENT;
}

void *ast_store_data(ast_store *s, uint64_t id)
{
    void *p = NULL;

    if (s)
        blk_get(s, id, "data", &p, NULL, NULL);
    return p;
}

int ast_store_size(ast_store *s, uint64_t id, size_t *nbytes)
{
    if (!s || !nbytes)
        return AST_EINVAL;
    return blk_get(s, id, "size", NULL, nbytes, NULL);
}

int ast_store_tier(ast_store *s, uint64_t id, ast_tier *tier)
{
    if (!s || !tier)
        return AST_EINVAL;
    return blk_get(s, id, "tier", NULL, NULL, tier);
}

/* ---- moves --------------------------------------------------------------------------------- */

static int move_memory(struct blk *b, ast_tier dst, char *msg, size_t len)
{
    void *p = NULL;
    int rc = mem_alloc(dst, b->nbytes, &p, msg, len);
    if (rc)
        return rc;
    rc = mem_copy(dst, p, b->tier, b->ptr, b->nbytes, msg, len);
    if (rc) {
        mem_free(dst, p, b->nbytes);
        return rc;
    }
    mem_free(b->tier, b->ptr, b->nbytes);
    b->ptr = p;
    return 0;
}

/* The two arrays of an NVMe batch of n blocks. On failure both are NULL and every block has
 * failed (AST_ENOMEM, in e). */
static int batch_alloc(struct blk **bl, const size_t *pos, size_t n, ast__batch_err *e,
                       ast__nvme_io **ios, size_t **at)
{
    *ios = calloc(n ? n : 1, sizeof **ios);
    *at = calloc(n ? n : 1, sizeof **at);
    if (*ios && *at)
        return 0;
    for (size_t i = 0; i < n; i++)
        ast__batch_fail(e, pos[i], NULL, AST_ENOMEM,
                        "block %" PRIu64 ": out of memory for the batch", bl[i]->id);
    free(*ios);
    free(*at);
    *ios = NULL;
    *at = NULL;
    return AST_ENOMEM;
}

/* The position of the batch's first failed record, the one the engine's message is about;
 * SIZE_MAX if none failed. */
static size_t first_failed(const ast__nvme_io *ios, size_t m)
{
    for (size_t j = 0; j < m; j++)
        if (ios[j].result)
            return j;
    return SIZE_MAX;
}

/* Writes the listed blocks (positions pos[0..n) in ids) to NVME in one batch. */
static size_t move_to_nvme(ast_store *s, struct blk **bl, const size_t *pos, size_t n,
                           ast__batch_err *e)
{
    ast__nvme_io *ios;
    size_t *at;
    ast__nvme_xfer x = {0, 0, 0};
    char msg[MSG_BYTES] = "";
    uint64_t pending = 0;
    size_t m = 0, moved = 0, first = SIZE_MAX;

    if (batch_alloc(bl, pos, n, e, &ios, &at))
        return 0;
    for (size_t i = 0; i < n; i++) {
        struct blk *b = bl[i];
        if (!within_budget(s, pending, b->nbytes)) {
            ast__batch_fail(e, pos[i], NULL, AST_ENOSPC, "block %" PRIu64 " (%zu bytes): no space "
                            "left under nvme_budget_bytes %" PRIu64 " (%" PRIu64 " in use)", b->id,
                            b->nbytes, s->nvme_budget, s->st.bytes[AST_TIER_NVME] + pending);
            continue;
        }
        pending += b->nbytes;
        ios[m] = (ast__nvme_io){.block_id = b->id, .generation = b->gen + 1, .data = b->ptr,
                                .len = b->nbytes, .on_device = device_side(b->tier),
                                .framed = framed(b->tier, b->nbytes),
                                .in_place = b->named && !b->shared, .fd = -1,
                                .qtype = b->qtype, .qblock = b->qblock};
        at[m++] = i;
    }
    if (m && ast__nvme_write(s->nvme, ios, m, &x, msg, sizeof msg) != 0)
        first = first_failed(ios, m);
    count_io(s, 1, &x);
    for (size_t j = 0; j < m; j++) {
        struct blk *b = bl[at[j]];
        if (ios[j].result) {
            ast__batch_fail(e, pos[at[j]], NULL, ios[j].result, "%s",
                            j == first ? msg : ast_strerror(ios[j].result));
            continue;
        }
        account(s, b->tier, b->nbytes, -1);
        mem_free(b->tier, b->ptr, b->nbytes);
        b->ptr = NULL;
        b->tier = AST_TIER_NVME;
        b->gen = ios[j].generation;
        record_written(s, b, ios[j].fd);
        account(s, AST_TIER_NVME, b->nbytes, +1);
        moved++;
    }
    free(ios);
    free(at);
    return moved;
}

/* Reads the listed NVME blocks into fresh memory of tier dst in one batch. */
static size_t move_from_nvme(ast_store *s, struct blk **bl, const size_t *pos, size_t n,
                             ast_tier dst, ast__batch_err *e)
{
    ast__nvme_io *ios;
    size_t *at;
    ast__nvme_xfer x = {0, 0, 0};
    char msg[MSG_BYTES] = "";
    size_t m = 0, moved = 0, first = SIZE_MAX;

    if (batch_alloc(bl, pos, n, e, &ios, &at))
        return 0;
    for (size_t i = 0; i < n; i++) {
        struct blk *b = bl[i];
        void *p = NULL;
        int rc = mem_alloc_z(dst, b->nbytes, &p, 0, msg, sizeof msg);
        if (rc) {
            ast__batch_fail(e, pos[i], NULL, rc, "block %" PRIu64 ": %s", b->id, msg);
            continue;
        }
        ios[m] = (ast__nvme_io){.block_id = b->id, .generation = b->gen, .data = p,
                                .len = b->nbytes, .on_device = device_side(dst),
                                .framed = framed(dst, b->nbytes), .owner = b->owner, .fd = b->rfd,
                                .qtype = b->qtype, .qblock = b->qblock};
        at[m++] = i;
    }
    msg[0] = '\0';
    if (m && ast__nvme_read(s->nvme, ios, m, &x, msg, sizeof msg) != 0)
        first = first_failed(ios, m);
    count_io(s, 0, &x);
    for (size_t j = 0; j < m; j++) {
        struct blk *b = bl[at[j]];
        if (ios[j].result) {
            mem_free(dst, ios[j].data, b->nbytes); /* the record and the block stay on NVME */
            ast__batch_fail(e, pos[at[j]], NULL, ios[j].result, "%s",
                            j == first ? msg : ast_strerror(ios[j].result));
            continue;
        }
        record_read_back(b); /* stale now; its generation guards it */
        account(s, AST_TIER_NVME, b->nbytes, -1);
        b->ptr = ios[j].data;
        b->tier = dst;
        account(s, dst, b->nbytes, +1);
        moved++;
    }
    free(ios);
    free(at);
    return moved;
}

int ast_store_move(ast_store *s, const uint64_t *ids, size_t n, ast_tier dst, size_t *moved)
{
    ast__batch_err e;
    struct blk **bl = NULL;
    size_t *pos = NULL;
    size_t done = 0, nw = 0, nr = 0;
    uint64_t stamp;
    int rc = 0;

    if (moved)
        *moved = 0;
    if (!s || (!ids && n) || !valid_tier(dst))
        return AST_EINVAL;
    if (n == 0)
        return 0;
    pthread_mutex_lock(&s->mu);
    ast__batch_err_init(&e);
    bl = malloc(n * sizeof *bl);
    pos = malloc(n * sizeof *pos);
    if (!bl || !pos) {
        rc = ast__set_error(&s->err, NULL, AST_ENOMEM, "move of %zu blocks: out of memory", n);
        goto out;
    }
    /* Refuse a malformed request before anything moves. */
    stamp = ++s->stamp;
    for (size_t i = 0; i < n; i++) {
        struct blk *b = find(s, ids[i], "move");
        if (!b) {
            rc = AST_ENOENT;
            goto out;
        }
        if (b->mark == stamp) {
            rc = ast__set_error(&s->err, NULL, AST_EINVAL,
                                "move: block %" PRIu64 " is listed twice", ids[i]);
            goto out;
        }
        b->mark = stamp;
    }
    rc = tier_ready(s, dst);
    if (rc)
        goto out;

    /* Memory to memory, one block at a time; NVMe transfers are collected for one batch. */
    for (size_t i = 0; i < n; i++) {
        struct blk *b = lookup(s, ids[i]);
        char msg[MSG_BYTES] = "";
        ast_tier from = b->tier;

        if (from == dst) {
            done++;
        } else if (dst == AST_TIER_NVME || from == AST_TIER_NVME) {
            bl[nw + nr] = b;
            pos[nw + nr] = i;
            if (dst == AST_TIER_NVME)
                nw++;
            else
                nr++;
        } else if ((rc = move_memory(b, dst, msg, sizeof msg)) != 0) {
            ast__batch_fail(&e, i, NULL, rc, "block %" PRIu64 " from %s: %s", b->id,
                            ast_tier_name(from), msg);
        } else {
            account(s, from, b->nbytes, -1);
            account(s, dst, b->nbytes, +1);
            done++;
        }
    }
    /* Only one of nw and nr can be nonzero: dst is NVME or it is not. */
    if (nw)
        done += move_to_nvme(s, bl, pos, nw, &e);
    if (nr)
        done += move_from_nvme(s, bl, pos, nr, dst, &e);

    rc = e.code;
    if (rc) {
        if (e.failed > 1)
            ast__set_error(&s->err, NULL, rc, "move to %s: %s (and %zu more blocks failed)",
                           ast_tier_name(dst), e.msg, e.failed - 1);
        else
            ast__set_error(&s->err, NULL, rc, "move to %s: %s", ast_tier_name(dst), e.msg);
    }
out:
    if (moved)
        *moved = done;
    pthread_mutex_unlock(&s->mu);
    free(bl);
    free(pos);
    return rc;
}

/* ---- formats ------------------------------------------------------------------------------ */

int ast_store_set_format(ast_store *s, uint64_t id, ast_qtype qtype, uint32_t qblock)
{
    ast_quant_layout l;
    struct blk *b;
    int rc = 0;

    if (!s)
        return AST_EINVAL;
    pthread_mutex_lock(&s->mu);
    b = find(s, id, "set_format");
    if (!b) {
        rc = AST_ENOENT;
    } else if (qtype == AST_QTYPE_NONE ? qblock != 0
                                       : ast_quant_layout_get(qtype, 0, qblock, &l) != 0) {
        const char *name = ast_qtype_name(qtype);
        char why[160] = "raw bytes have block size 0";
        if (qtype != AST_QTYPE_NONE)
            ast_quant_last_error(why, sizeof why);
        if (name)
            rc = ast__set_error(&s->err, NULL, AST_EINVAL, "set_format: block %" PRIu64 ": %s "
                                "in blocks of %" PRIu32 ": %s", id, name, qblock, why);
        else
            rc = ast__set_error(&s->err, NULL, AST_EINVAL, "set_format: block %" PRIu64 ": "
                                "unknown payload type %d; allowed: none, int8, int4", id,
                                (int)qtype);
    } else if (b->tier == AST_TIER_NVME && (b->qtype != qtype || b->qblock != qblock)) {
        rc = ast__set_error(&s->err, NULL, AST_ESTATE, "set_format: block %" PRIu64 " is on "
                            "nvme: its record holds the bytes in their present format (move "
                            "it back first)", id);
    } else {
        b->qtype = qtype;
        b->qblock = qblock;
    }
    pthread_mutex_unlock(&s->mu);
    return rc;
}

int ast_store_format(ast_store *s, uint64_t id, ast_qtype *qtype, uint32_t *qblock)
{
    struct blk *b;

    if (!s || !qtype || !qblock)
        return AST_EINVAL;
    pthread_mutex_lock(&s->mu);
    b = find(s, id, "format");
    if (b) {
        *qtype = b->qtype;
        *qblock = b->qblock;
    }
    pthread_mutex_unlock(&s->mu);
    return b ? 0 : AST_ENOENT;
}

/* ---- introspection ------------------------------------------------------------------------- */

int ast_store_stats_get(ast_store *s, ast_store_stats *out)
{
    if (!s || !out)
        return AST_EINVAL;
    pthread_mutex_lock(&s->mu);
    *out = s->st;
    pthread_mutex_unlock(&s->mu);
    return 0;
}

int ast_store_last_error(ast_store *s, char *buf, size_t len)
{
    if (!s)
        return AST_EINVAL;
    return ast__get_error(&s->err, &s->mu, buf, len);
}

int ast_store_record_path(ast_store *s, uint64_t id, char *buf, size_t len)
{
    struct blk *b;
    int rc;

    if (!s || !buf || !len)
        return AST_EINVAL;
    pthread_mutex_lock(&s->mu);
    b = find(s, id, "record_path");
    if (!b)
        rc = AST_ENOENT;
    else if (b->tier != AST_TIER_NVME)
        rc = ast__set_error(&s->err, NULL, AST_ESTATE,
                            "record_path: block %" PRIu64 " is on tier %s, not on nvme", id,
                            ast_tier_name(b->tier));
    else if (b->owner == 0 && !b->named)
        rc = ast__set_error(&s->err, NULL, AST_ESTATE, "record_path: block %" PRIu64 " was "
                            "written by this forked child: its record has no name (an open, "
                            "unlinked file)", id);
    else if ((rc = ast__nvme_owner_path(s->nvme, b->owner, id, buf, len)) != 0)
        rc = ast__set_error(&s->err, NULL, rc, "record_path: a buffer of %zu bytes is too small",
                            len);
    pthread_mutex_unlock(&s->mu);
    return rc;
}
