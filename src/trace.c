/*
 * trace.c - the runtime event recorder and its Chrome-trace JSON writer (see trace.h).
 *
 * Owns: the event chunks, the intern table and its string arena, the lane names, the
 * last-error text. May call: libc, POSIX and util.h (clock, hash table, last-error setter).
 *
 * Storage: one mutex-guarded store (not per-thread buffers): recording threads are few (the
 * training thread, a handful of workers, the shadow path) and events are coarse (one per job
 * or copy), so a short critical section costs less than per-thread buffers' registration and
 * merge. Events live in fixed-size chunks that never move; names and categories are interned
 * into an arena whose blocks never move, so an event stores two pointers, not copies, and an
 * append is an intern lookup plus a struct copy.
 *
 * Locking: tr->mu guards the chunks, count, dropped, max_events, the intern table and arena,
 * the lane names and err (the last-error text). Hashing and argument checks happen before it
 * is taken; file formatting and I/O happen after it is released, on a private copy of the
 * events. base_ns is written once at creation and read without the lock.
 */
#include "asteria/trace.h"

#include "asteria/build_config.h"
#include "asteria/errors.h"
#include "util.h"

#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <limits.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#define CHUNK_EVENTS 4096u
#define ARENA_BLOCK 8192u
#define NAME_MAX_LEN 1023u
#define TID_WORKER_BASE 1000

typedef struct rec {
    uint64_t ts, dur, block, version, bytes;
    int64_t step;
    const char *name, *cat;    /* interned: stable until destroy */
    int32_t lane, worker, status;
    uint8_t span, dir;
    uint16_t args;
} rec;

typedef struct arena_block {
    struct arena_block *next;
    size_t used;
    char data[];
} arena_block;

/* An interned string, in the arena; linked in tr->strings under its hash. */
typedef struct interned {
    ast__hnode node;
    char s[];
} interned;

typedef struct lane_name {
    int lane;
    const char *name;          /* interned */
} lane_name;

struct ast_trace {
    pthread_mutex_t mu;
    uint64_t base_ns;
    rec **chunks;
    size_t nchunks, capchunks;
    size_t count, dropped, max_events;
    ast__htable strings; /* interned names, keyed by their hash */
    arena_block *arena;
    lane_name *lanes;
    size_t nlanes, caplanes;
    atomic_uint_fast64_t tmp_seq; /* temporary file names, unique per recorder */
    ast__last_error err; /* named: "AST_E...: message" */
};

static const struct {
    const char *cat, *name;
    int span;
} kinds[AST_TRACE_KIND_COUNT] = {
    [AST_TRACE_CUSTOM_INSTANT] = {"asteria", NULL, 0},
    [AST_TRACE_CUSTOM_SPAN] = {"asteria", NULL, 1},
    [AST_TRACE_JOB_QUEUED] = {"job", "job queued", 0},
    [AST_TRACE_JOB_STARTED] = {"job", "job started", 0},
    [AST_TRACE_JOB_DONE] = {"job", "job done", 0},
    [AST_TRACE_JOB_RUN] = {"job", "refresh", 1},
    [AST_TRACE_COPY_ISSUED] = {"copy", "copy issued", 0},
    [AST_TRACE_COPY_DONE] = {"copy", "copy done", 0},
    [AST_TRACE_COPY] = {"copy", "copy", 1},
    [AST_TRACE_BARRIER_BEGIN] = {"barrier", "barrier wait begin", 0},
    [AST_TRACE_BARRIER_END] = {"barrier", "barrier wait end", 0},
    [AST_TRACE_BARRIER_WAIT] = {"barrier", "barrier wait", 1},
    [AST_TRACE_INSTALL] = {"install", "install", 0},
};


/* Thread-safe errno text (GNU strerror_r: _GNU_SOURCE is set for the library). */
static const char *errtext(int e, char *buf, size_t len)
{
    return strerror_r(e, buf, len);
}

int ast_trace_create(ast_trace **out)
{
    if (!out)
        return AST_EINVAL;
    *out = NULL;
    ast_trace *tr = calloc(1, sizeof *tr);
    if (!tr)
        return AST_ENOMEM;
    if (pthread_mutex_init(&tr->mu, NULL)) {
        free(tr);
        return AST_ENOMEM;
    }
    tr->err.named = 1;
    atomic_init(&tr->tmp_seq, 0);
    tr->base_ns = ast__now_ns();
    *out = tr;
    return 0;
}

void ast_trace_destroy(ast_trace *tr)
{
    if (!tr)
        return;
    for (size_t i = 0; i < tr->nchunks; i++)
        free(tr->chunks[i]);
    free(tr->chunks);
    while (tr->arena) {
        arena_block *b = tr->arena;
        tr->arena = b->next;
        free(b);
    }
    ast__htable_free(&tr->strings);
    free(tr->lanes);
    pthread_mutex_destroy(&tr->mu);
    free(tr);
}

uint64_t ast_trace_now(const ast_trace *tr)
{
    return ast_trace_from_monotonic(tr, ast__now_ns());
}

uint64_t ast_trace_from_monotonic(const ast_trace *tr, uint64_t monotonic_ns)
{
    return monotonic_ns > tr->base_ns ? monotonic_ns - tr->base_ns : 0;
}

/* ---- intern table (tr->mu held) ----------------------------------------------------------- */

static uint64_t fnv1a(const char *s, size_t n)
{
    uint64_t h = 1469598103934665603u;
    for (size_t i = 0; i < n; i++) {
        h ^= (unsigned char)s[i];
        h *= 1099511628211u;
    }
    return h;
}

/* size bytes from the arena, aligned for an interned entry. */
static void *arena_alloc(ast_trace *tr, size_t size)
{
    const size_t align = _Alignof(interned);
    arena_block *b = tr->arena;
    size_t at = b ? (b->used + align - 1) / align * align : 0;
    if (!b || at > ARENA_BLOCK || ARENA_BLOCK - at < size) {
        b = malloc(sizeof *b + ARENA_BLOCK);
        if (!b)
            return NULL;
        b->used = 0;
        b->next = tr->arena;
        tr->arena = b;
        at = 0;
    }
    b->used = at + size;
    return b->data + at;
}

static const char *intern(ast_trace *tr, const char *s, size_t n, uint64_t h)
{
    for (ast__hnode *x = ast__htable_find(&tr->strings, h); x; x = ast__htable_next(x)) {
        const interned *e = AST__CONTAINER_OF(x, interned, node);
        if (strncmp(e->s, s, n) == 0 && e->s[n] == 0)
            return e->s;
    }
    if (ast__htable_reserve(&tr->strings, tr->strings.n + 1))
        return NULL;
    interned *e = arena_alloc(tr, sizeof *e + n + 1);
    if (!e)
        return NULL;
    memcpy(e->s, s, n);
    e->s[n] = '\0';
    e->node.key = h;
    ast__htable_insert(&tr->strings, &e->node);
    return e->s;
}

/* ---- recording ---------------------------------------------------------------------------- */

static int lane_ok(int lane)
{
    return lane >= AST_TRACE_LANE_MIN && lane <= INT_MAX - TID_WORKER_BASE;
}

static int name_len(const char *s, size_t *n)
{
    *n = strnlen(s, NAME_MAX_LEN + 1);
    return *n <= NAME_MAX_LEN;
}

int ast_trace_event(ast_trace *tr, const ast_trace_ev *ev)
{
    if (!tr || !ev || (unsigned)ev->kind >= AST_TRACE_KIND_COUNT || !lane_ok(ev->lane))
        return AST_EINVAL;
    const char *name = ev->name ? ev->name : kinds[ev->kind].name;
    const char *cat = ev->cat ? ev->cat : kinds[ev->kind].cat;
    size_t nn, cn;
    if (!name || !name_len(name, &nn) || !name_len(cat, &cn))
        return AST_EINVAL;
    uint64_t nh = fnv1a(name, nn), ch = fnv1a(cat, cn);

    rec r = {.ts = ev->ts_ns, .dur = kinds[ev->kind].span ? ev->dur_ns : 0, .block = ev->block,
             .version = ev->version, .bytes = ev->bytes, .step = ev->step, .lane = ev->lane,
             .worker = ev->worker, .status = ev->status, .span = (uint8_t)kinds[ev->kind].span,
             .dir = (uint8_t)ev->dir, .args = (uint16_t)ev->args};
    int rc = 0;
    pthread_mutex_lock(&tr->mu);
    if (tr->max_events && tr->count >= tr->max_events) {
        rc = AST_ENOSPC;
        goto drop;
    }
    r.name = intern(tr, name, nn, nh);
    r.cat = intern(tr, cat, cn, ch);
    if (!r.name || !r.cat) {
        rc = AST_ENOMEM;
        goto drop;
    }
    size_t ci = tr->count / CHUNK_EVENTS;
    if (ci == tr->nchunks) {
        if (tr->nchunks == tr->capchunks) {
            size_t ncap = tr->capchunks ? tr->capchunks * 2 : 16;
            rec **nc = realloc(tr->chunks, ncap * sizeof *nc);
            if (!nc) {
                rc = AST_ENOMEM;
                goto drop;
            }
            tr->chunks = nc;
            tr->capchunks = ncap;
        }
        tr->chunks[ci] = malloc(CHUNK_EVENTS * sizeof(rec));
        if (!tr->chunks[ci]) {
            rc = AST_ENOMEM;
            goto drop;
        }
        tr->nchunks++;
    }
    tr->chunks[ci][tr->count % CHUNK_EVENTS] = r;
    tr->count++;
    pthread_mutex_unlock(&tr->mu);
    return 0;
drop:
    tr->dropped++;
    pthread_mutex_unlock(&tr->mu);
    return rc;
}

int ast_trace_instant(ast_trace *tr, int lane, const char *cat, const char *name, uint64_t ts_ns)
{
    ast_trace_ev ev = {.kind = AST_TRACE_CUSTOM_INSTANT, .name = name, .cat = cat, .lane = lane,
                       .ts_ns = ts_ns};
    return ast_trace_event(tr, &ev);
}

int ast_trace_complete(ast_trace *tr, int lane, const char *cat, const char *name,
                       uint64_t ts_ns, uint64_t dur_ns)
{
    ast_trace_ev ev = {.kind = AST_TRACE_CUSTOM_SPAN, .name = name, .cat = cat, .lane = lane,
                       .ts_ns = ts_ns, .dur_ns = dur_ns};
    return ast_trace_event(tr, &ev);
}

int ast_trace_name_lane(ast_trace *tr, int lane, const char *name)
{
    size_t n;
    if (!tr || !name || !lane_ok(lane) || !name_len(name, &n))
        return AST_EINVAL;
    uint64_t h = fnv1a(name, n);
    int rc = 0;
    pthread_mutex_lock(&tr->mu);
    const char *s = intern(tr, name, n, h);
    size_t i = 0;
    while (i < tr->nlanes && tr->lanes[i].lane != lane)
        i++;
    if (!s) {
        rc = AST_ENOMEM;
    } else if (i < tr->nlanes) {
        tr->lanes[i].name = s;
    } else {
        if (tr->nlanes == tr->caplanes) {
            size_t ncap = tr->caplanes ? tr->caplanes * 2 : 8;
            lane_name *nl = realloc(tr->lanes, ncap * sizeof *nl);
            if (!nl) {
                rc = AST_ENOMEM;
                goto out;
            }
            tr->lanes = nl;
            tr->caplanes = ncap;
        }
        tr->lanes[tr->nlanes++] = (lane_name){lane, s};
    }
out:
    pthread_mutex_unlock(&tr->mu);
    return rc;
}

void ast_trace_set_max_events(ast_trace *tr, size_t max_events)
{
    if (!tr)
        return;
    pthread_mutex_lock(&tr->mu);
    tr->max_events = max_events;
    pthread_mutex_unlock(&tr->mu);
}

/* A counter of tr (count or dropped) read under tr->mu. */
static size_t counter_get(ast_trace *tr, const size_t *counter)
{
    pthread_mutex_lock(&tr->mu);
    size_t n = *counter;
    pthread_mutex_unlock(&tr->mu);
    return n;
}

size_t ast_trace_count(ast_trace *tr)
{
    return tr ? counter_get(tr, &tr->count) : 0;
}

size_t ast_trace_dropped(ast_trace *tr)
{
    return tr ? counter_get(tr, &tr->dropped) : 0;
}

int ast_trace_last_error(ast_trace *tr, char *buf, size_t len)
{
    if (!tr)
        return AST_EINVAL;
    return ast__get_error(&tr->err, &tr->mu, buf, len);
}

/* ---- JSON writer (no lock held) ----------------------------------------------------------- */

/* Length of the well-formed UTF-8 sequence at p (RFC 3629: no overlongs, no surrogates), or 0. */
static size_t utf8_seq(const unsigned char *p)
{
    unsigned char c = p[0];
    unsigned char lo = 0x80, hi = 0xBF;
    size_t n;
    if (c >= 0xC2 && c <= 0xDF) {
        n = 2;
    } else if (c >= 0xE0 && c <= 0xEF) {
        n = 3;
        if (c == 0xE0)
            lo = 0xA0;
        else if (c == 0xED)
            hi = 0x9F;
    } else if (c >= 0xF0 && c <= 0xF4) {
        n = 4;
        if (c == 0xF0)
            lo = 0x90;
        else if (c == 0xF4)
            hi = 0x8F;
    } else {
        return 0;
    }
    if (p[1] < lo || p[1] > hi)
        return 0;
    for (size_t i = 2; i < n; i++)
        if (p[i] < 0x80 || p[i] > 0xBF)
            return 0;
    return n;
}

/* A JSON string: quotes, backslashes and control characters escaped; bytes that are not
 * well-formed UTF-8 become U+FFFD, so the file is always valid JSON in UTF-8. */
static void put_str(FILE *f, const char *s)
{
    const unsigned char *p = (const unsigned char *)s;
    putc('"', f);
    while (*p) {
        unsigned char c = *p;
        if (c == '"' || c == '\\') {
            putc('\\', f);
            putc(c, f);
            p++;
        } else if (c < 0x20) {
            switch (c) {
            case '\n': fputs("\\n", f); break;
            case '\r': fputs("\\r", f); break;
            case '\t': fputs("\\t", f); break;
            case '\b': fputs("\\b", f); break;
            case '\f': fputs("\\f", f); break;
            default: fprintf(f, "\\u%04x", c); break;
            }
            p++;
        } else if (c < 0x80) {
            putc(c, f);
            p++;
        } else {
            size_t n = utf8_seq(p);
            if (n) {
                fwrite(p, 1, n, f);
                p += n;
            } else {
                fputs("\\ufffd", f);
                p++;
            }
        }
    }
    putc('"', f);
}

/* Chrome-trace stamps are microseconds; the fraction keeps nanosecond resolution. */
static void put_us(FILE *f, uint64_t ns)
{
    fprintf(f, "%" PRIu64 ".%03u", ns / 1000u, (unsigned)(ns % 1000u));
}

static int lane_tid(int lane)
{
    return lane < 0 ? -lane : TID_WORKER_BASE + lane;
}

typedef struct order {
    uint64_t ts;
    size_t i;
} order;

static int order_cmp(const void *a, const void *b)
{
    const order *x = a, *y = b;
    if (x->ts != y->ts)
        return x->ts < y->ts ? -1 : 1;
    return x->i < y->i ? -1 : x->i > y->i;
}

static int int_cmp(const void *a, const void *b)
{
    int x = *(const int *)a, y = *(const int *)b;
    return (x > y) - (x < y);
}

static const char *dir_name(unsigned d)
{
    return d == AST_TRACE_DIR_D2H ? "d2h" : d == AST_TRACE_DIR_H2D ? "h2d" : NULL;
}

/* One member of an event's "args" object: *sep (then ","), the key, the value as fmt says. */
static void put_arg(FILE *f, const char **sep, const char *key, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
static void put_arg(FILE *f, const char **sep, const char *key, const char *fmt, ...)
{
    va_list ap;
    fprintf(f, "%s\"%s\":", *sep, key);
    va_start(ap, fmt);
    vfprintf(f, fmt, ap);
    va_end(ap);
    *sep = ",";
}

static void put_event(FILE *f, const rec *r, long pid)
{
    fputs("{\"name\":", f);
    put_str(f, r->name);
    fputs(",\"cat\":", f);
    put_str(f, r->cat);
    fputs(r->span ? ",\"ph\":\"X\",\"ts\":" : ",\"ph\":\"i\",\"s\":\"t\",\"ts\":", f);
    put_us(f, r->ts);
    if (r->span) {
        fputs(",\"dur\":", f);
        put_us(f, r->dur);
    }
    fprintf(f, ",\"pid\":%ld,\"tid\":%d,\"args\":{", pid, lane_tid(r->lane));
    const char *sep = "";
    if (r->args & AST_TRACE_ARG_BLOCK)
        put_arg(f, &sep, "block", "%" PRIu64, r->block);
    if (r->args & AST_TRACE_ARG_VERSION)
        put_arg(f, &sep, "version", "%" PRIu64, r->version);
    if (r->args & AST_TRACE_ARG_BYTES)
        put_arg(f, &sep, "bytes", "%" PRIu64, r->bytes);
    if (r->args & AST_TRACE_ARG_STEP)
        put_arg(f, &sep, "step", "%" PRId64, r->step);
    if (r->args & AST_TRACE_ARG_WORKER)
        put_arg(f, &sep, "worker", "%d", (int)r->worker);
    if (r->args & AST_TRACE_ARG_STATUS)
        put_arg(f, &sep, "status", "\"%s\"", ast_err_name(r->status));
    if (dir_name(r->dir))
        put_arg(f, &sep, "dir", "\"%s\"", dir_name(r->dir));
    fputs("}}", f);
}

static void put_lane_meta(FILE *f, long pid, int lane, const lane_name *names, size_t nnames)
{
    char dflt[32];
    const char *name = NULL;
    for (size_t i = 0; i < nnames; i++)
        if (names[i].lane == lane)
            name = names[i].name;
    if (!name) {
        if (lane >= 0)
            snprintf(dflt, sizeof dflt, "worker %d", lane);
        else if (lane == AST_TRACE_LANE_TRAIN)
            snprintf(dflt, sizeof dflt, "train");
        else if (lane == AST_TRACE_LANE_SHADOW)
            snprintf(dflt, sizeof dflt, "shadow stream");
        else if (lane == AST_TRACE_LANE_COHERENCE)
            snprintf(dflt, sizeof dflt, "coherence");
        else if (lane == AST_TRACE_LANE_NVME)
            snprintf(dflt, sizeof dflt, "nvme");
        else
            snprintf(dflt, sizeof dflt, "lane %d", lane);
        name = dflt;
    }
    fprintf(f, ",\n{\"name\":\"thread_name\",\"ph\":\"M\",\"pid\":%ld,\"tid\":%d,"
               "\"args\":{\"name\":",
            pid, lane_tid(lane));
    put_str(f, name);
    fprintf(f, "}},\n{\"name\":\"thread_sort_index\",\"ph\":\"M\",\"pid\":%ld,\"tid\":%d,"
               "\"args\":{\"sort_index\":%d}}",
            pid, lane_tid(lane), lane_tid(lane));
}

/* Writes the whole document; the caller checks the stream's error state. */
static void put_doc(FILE *f, const rec *evs, const order *ord, size_t n, const int *lanes,
                    size_t nl, const lane_name *names, size_t nnames, size_t dropped)
{
    long pid = (long)getpid();
    fprintf(f, "{\"displayTimeUnit\":\"ns\",\"otherData\":{\"producer\":\"asteria %s\","
               "\"dropped_events\":%zu},\n\"traceEvents\":[\n",
            ASTERIA_VERSION_STRING, dropped);
    fprintf(f, "{\"name\":\"process_name\",\"ph\":\"M\",\"pid\":%ld,\"tid\":0,"
               "\"args\":{\"name\":\"asteria\"}}",
            pid);
    for (size_t i = 0; i < nl; i++)
        put_lane_meta(f, pid, lanes[i], names, nnames);
    for (size_t i = 0; i < n; i++) {
        fputs(",\n", f);
        put_event(f, &evs[ord[i].i], pid);
    }
    fputs("\n]}\n", f);
}

/* Sorted distinct lanes of the events and of the named lanes. */
static int *collect_lanes(const rec *evs, size_t n, const lane_name *names, size_t nnames,
                          size_t *nl)
{
    int *l = malloc((n + nnames + 1) * sizeof *l);
    if (!l)
        return NULL;
    size_t k = 0;
    for (size_t i = 0; i < nnames; i++)
        l[k++] = names[i].lane;
    for (size_t i = 0; i < n; i++)
        l[k++] = evs[i].lane;
    qsort(l, k, sizeof *l, int_cmp);
    size_t u = 0;
    for (size_t i = 0; i < k; i++)
        if (u == 0 || l[u - 1] != l[i])
            l[u++] = l[i];
    *nl = u;
    return l;
}

/* Formats into a temporary file next to path, fsyncs it and renames it over path. */
static int write_file(ast_trace *tr, const char *path, const rec *evs, const order *ord,
                      size_t n, const int *lanes, size_t nl, const lane_name *names,
                      size_t nnames, size_t dropped)
{
    char eb[128];
    size_t plen = strlen(path);
    char *tmp = malloc(plen + 64);
    if (!tmp)
        return ast__set_error(&tr->err, &tr->mu, AST_ENOMEM, "trace: out of memory writing '%s'",
                              path);
    int fd = -1;
    for (int tries = 0; fd < 0 && tries < 16; tries++) {
        snprintf(tmp, plen + 64, "%s.tmp.%ld.%" PRIxPTR ".%" PRIuFAST64, path, (long)getpid(),
                 (uintptr_t)tr, (uint_fast64_t)atomic_fetch_add(&tr->tmp_seq, 1));
        fd = open(tmp, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0666);
        if (fd < 0 && errno != EEXIST)
            break;
    }
    if (fd < 0) {
        int e = errno;
        free(tmp);
        return ast__set_error(&tr->err, &tr->mu, ast_err_from_errno(e),
                              "trace: cannot create a file next to '%s': %s", path,
                              errtext(e, eb, sizeof eb));
    }
    FILE *f = fdopen(fd, "w");
    if (!f) {
        int e = errno;
        close(fd);
        unlink(tmp);
        free(tmp);
        return ast__set_error(&tr->err, &tr->mu, ast_err_from_errno(e),
                              "trace: fdopen for '%s': %s", path, errtext(e, eb, sizeof eb));
    }
    setvbuf(f, NULL, _IOFBF, 1 << 16);
    errno = 0;
    put_doc(f, evs, ord, n, lanes, nl, names, nnames, dropped);

    int e = 0;
    const char *what = NULL;
    if (fflush(f) || ferror(f)) {
        e = errno ? errno : EIO;
        what = "write";
    } else if (fsync(fileno(f))) {
        e = errno;
        what = "fsync";
    }
    if (fclose(f) && !what) {
        e = errno;
        what = "close";
    }
    if (!what && rename(tmp, path)) {
        e = errno;
        what = "rename";
    }
    if (what) {
        unlink(tmp);
        free(tmp);
        int code = ast_err_from_errno(e);
        if (code == AST_EINVAL || code == AST_EBUSY)
            code = AST_EIO;
        return ast__set_error(&tr->err, &tr->mu, code, "trace: %s of '%s' failed: %s", what, path,
                              errtext(e, eb, sizeof eb));
    }
    free(tmp);
    return 0;
}

int ast_trace_write_json(ast_trace *tr, const char *path)
{
    if (!tr)
        return AST_EINVAL;
    if (!path || !*path)
        return ast__set_error(&tr->err, &tr->mu, AST_EINVAL, "trace: empty output path");

    pthread_mutex_lock(&tr->mu);
    size_t n = tr->count, nnames = tr->nlanes, dropped = tr->dropped;
    rec *evs = malloc((n ? n : 1) * sizeof *evs);
    lane_name *names = malloc((nnames ? nnames : 1) * sizeof *names);
    if (evs && names) {
        for (size_t c = 0; c * CHUNK_EVENTS < n; c++) {
            size_t k = n - c * CHUNK_EVENTS < CHUNK_EVENTS ? n - c * CHUNK_EVENTS : CHUNK_EVENTS;
            memcpy(evs + c * CHUNK_EVENTS, tr->chunks[c], k * sizeof *evs);
        }
        if (nnames)
            memcpy(names, tr->lanes, nnames * sizeof *names);
    }
    pthread_mutex_unlock(&tr->mu);

    int rc = AST_ENOMEM;
    order *ord = NULL;
    int *lanes = NULL;
    size_t nl = 0;
    if (evs && names)
        ord = malloc((n ? n : 1) * sizeof *ord);
    if (ord)
        lanes = collect_lanes(evs, n, names, nnames, &nl);
    if (lanes) {
        for (size_t i = 0; i < n; i++)
            ord[i] = (order){evs[i].ts, i};
        qsort(ord, n, sizeof *ord, order_cmp);
        rc = write_file(tr, path, evs, ord, n, lanes, nl, names, nnames, dropped);
    } else {
        rc = ast__set_error(&tr->err, &tr->mu, AST_ENOMEM,
                            "trace: out of memory formatting %zu events", n);
    }
    free(lanes);
    free(ord);
    free(names);
    free(evs);
    return rc;
}
