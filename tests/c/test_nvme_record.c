/*
 * test_nvme_record.c - the NVMe record format (src/nvme.h), through the engine itself: a record
 * carries its payload's type and block size (raw bytes, or an int8 / int4 form of
 * asteria/quant.h) and reads back only as what it was written as; a record of another payload
 * format, or of another format version, is refused with a message naming the file, what it
 * holds and what was expected. The store's own moves (raw records) are test_store.c's.
 *
 * Needs liburing (the engine): without it every case skips. Directories live under
 * $ASTERIA_TEST_TMPDIR (or /tmp) and are removed.
 */
#include "asteria/build_config.h"
#include "asteria/errors.h"
#include "asteria/quant.h"
#include "nvme.h"
#include "test_helpers.h"

#include <fcntl.h>
#include <ftw.h>
#include <inttypes.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cmocka.h>

#define NEED_NVME()                                                                            \
    do {                                                                                       \
        if (!ASTERIA_HAVE_URING)                                                               \
            skip();                                                                            \
    } while (0)

/* ---- helpers -------------------------------------------------------------------------------- */

static int rm_one(const char *p, const struct stat *st, int flag, struct FTW *f)
{
    (void)st, (void)flag, (void)f;
    remove(p);
    return 0;
}

static ast__nvme *open_engine(char *dir, size_t len, const char *what)
{
    static unsigned counter;
    ast__nvme_opts o = {.direct = AST_DIRECT_FALLBACK, .store_id = 0x5eed0000u + counter};
    ast__nvme *n = NULL;
    char err[512];
    snprintf(dir, len, "%s/nvrec-%ld-%u-%s", test_tmp_root(), (long)getpid(), counter++, what);
    assert_int_equal(mkdir(dir, 0755), 0);
    o.dir = dir;
    int rc = ast__nvme_open(&o, &n, err, sizeof err);
    if (rc)
        fail_msg("ast__nvme_open(%s): %s: %s", dir, ast_err_name(rc), err);
    return n;
}

static void close_engine(ast__nvme *n, const char *dir)
{
    ast__nvme_close(n);
    nftw(dir, rm_one, 16, FTW_DEPTH | FTW_PHYS);
}

/* CRC-32C (Castagnoli, reflected 0x82f63b78), bit by bit: the records' checksum. */
static uint32_t crc32c(uint32_t crc, const unsigned char *p, size_t n)
{
    uint32_t c = ~crc;
    for (size_t i = 0; i < n; i++) {
        c ^= p[i];
        for (int k = 0; k < 8; k++)
            c = c & 1u ? (c >> 1) ^ 0x82f63b78u : c >> 1;
    }
    return ~c;
}

static uint32_t le32(const unsigned char *p)
{
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

static void put32(unsigned char *p, uint32_t v)
{
    for (int i = 0; i < 4; i++)
        p[i] = (unsigned char)(v >> (8 * i));
}

static unsigned char *read_file(const char *path, size_t *len)
{
    struct stat st;
    assert_int_equal(stat(path, &st), 0);
    *len = (size_t)st.st_size;
    unsigned char *buf = malloc(*len);
    int fd = open(path, O_RDONLY);
    assert_non_null(buf);
    assert_true(fd >= 0);
    assert_int_equal(pread(fd, buf, *len, 0), (ssize_t)*len);
    close(fd);
    return buf;
}

static void write_file(const char *path, const unsigned char *buf, size_t len)
{
    int fd = open(path, O_WRONLY);
    assert_true(fd >= 0);
    assert_int_equal(pwrite(fd, buf, len, 0), (ssize_t)len);
    close(fd);
}

static void expect_mentions(const char *msg, const char *a, const char *b)
{
    if ((a && !strstr(msg, a)) || (b && !strstr(msg, b)))
        fail_msg("message \"%s\" does not mention \"%s\" and \"%s\"", msg, a ? a : "",
                 b ? b : "");
}

/* A quantized form of count random values (or count random bytes for AST_QTYPE_NONE). */
static unsigned char *payload(ast_qtype t, size_t count, size_t block, size_t *len)
{
    uint64_t x = 0x9e3779b97f4a7c15ull * (count + 1);
    if (t == AST_QTYPE_NONE) {
        unsigned char *p = malloc(count);
        assert_non_null(p);
        for (size_t i = 0; i < count; i++) {
            x ^= x << 13, x ^= x >> 7, x ^= x << 17;
            p[i] = (unsigned char)x;
        }
        *len = count;
        return p;
    }
    float *v = malloc(count * sizeof *v);
    ast_quant_layout l;
    assert_non_null(v);
    for (size_t i = 0; i < count; i++) {
        x ^= x << 13, x ^= x >> 7, x ^= x << 17;
        v[i] = (float)((double)(x >> 11) * 0x1p-53 - 0.5);
    }
    assert_int_equal(ast_quant_layout_get(t, count, block, &l), 0);
    unsigned char *q = malloc(l.nbytes);
    assert_non_null(q);
    assert_int_equal(ast_quant_quantize(t, count, block, v, q, l.nbytes), 0);
    free(v);
    *len = l.nbytes;
    return q;
}

static int write_one(ast__nvme *n, uint64_t block_id, const void *data, size_t len, ast_qtype t,
                     uint32_t qblock, char *err, size_t errlen)
{
    ast__nvme_io io = {.block_id = block_id, .generation = 1, .data = (void *)data, .len = len,
                       .fd = -1, .qtype = t, .qblock = qblock};
    return ast__nvme_write(n, &io, 1, NULL, err, errlen);
}

static int read_one(ast__nvme *n, uint64_t block_id, void *data, size_t len, ast_qtype t,
                    uint32_t qblock, char *err, size_t errlen)
{
    ast__nvme_io io = {.block_id = block_id, .generation = 1, .data = data, .len = len,
                       .fd = -1, .qtype = t, .qblock = qblock};
    return ast__nvme_read(n, &io, 1, NULL, err, errlen);
}

/* ---- cases ---------------------------------------------------------------------------------- */

static const struct {
    ast_qtype t;
    uint32_t block;
    size_t count;
} FORMATS[] = {
    {AST_QTYPE_NONE, 0, 5000},      {AST_QTYPE_INT8, 64, 4096},  {AST_QTYPE_INT4, 32, 1001},
    {AST_QTYPE_INT4, 128, 1 << 18}, {AST_QTYPE_INT8, 2, 70000},
};

/* Each format is written, its header carries version 3, the type and the block size under a
 * valid header CRC, and it reads back, staged and (a framed buffer) straight into the frame. */
static void test_format_roundtrip(void **state)
{
    (void)state;
    NEED_NVME();
    char dir[512], path[600], err[1024];
    ast__nvme *n = open_engine(dir, sizeof dir, "roundtrip");
    for (size_t f = 0; f < sizeof FORMATS / sizeof FORMATS[0]; f++) {
        size_t len, flen;
        unsigned char *p = payload(FORMATS[f].t, FORMATS[f].count, FORMATS[f].block, &len);
        int rc = write_one(n, f + 1, p, len, FORMATS[f].t, FORMATS[f].block, err, sizeof err);
        if (rc)
            fail_msg("write of format %zu: %s: %s", f, ast_err_name(rc), err);
        assert_int_equal(ast__nvme_record_path(n, f + 1, path, sizeof path), 0);
        unsigned char *file = read_file(path, &flen);
        assert_int_equal(flen, ast__nvme_record_bytes(len));
        assert_memory_equal(file, "ASTR", 4);
        assert_int_equal(file[4] | file[5] << 8, 3);
        assert_int_equal(file[40], FORMATS[f].t);
        assert_int_equal(le32(file + 44), FORMATS[f].block);
        assert_int_equal(le32(file + 60), crc32c(0, file, 60));
        assert_int_equal(le32(file + 64 + len), crc32c(0, file, 64 + len));
        free(file);

        unsigned char *back = malloc(len);
        assert_non_null(back);
        rc = read_one(n, f + 1, back, len, FORMATS[f].t, FORMATS[f].block, err, sizeof err);
        if (rc)
            fail_msg("read of format %zu: %s: %s", f, ast_err_name(rc), err);
        assert_memory_equal(back, p, len);
        free(back);

        /* framed: the record's bytes go straight into a 4 KiB-aligned frame */
        size_t rb = (size_t)ast__nvme_record_bytes(len);
        unsigned char *fr = aligned_alloc(AST__NVME_ALIGN, rb);
        assert_non_null(fr);
        ast__nvme_io io = {.block_id = f + 1, .generation = 1, .data = fr + AST__NVME_HEADER,
                           .len = len, .fd = -1, .framed = 1, .qtype = FORMATS[f].t,
                           .qblock = FORMATS[f].block};
        assert_int_equal(ast__nvme_read(n, &io, 1, NULL, err, sizeof err), 0);
        assert_memory_equal(fr + AST__NVME_HEADER, p, len);
        io.qblock = FORMATS[f].block + 2; /* framed reads check the format too */
        if (FORMATS[f].t == AST_QTYPE_NONE)
            io.qtype = AST_QTYPE_INT8;
        assert_int_equal(ast__nvme_read(n, &io, 1, NULL, err, sizeof err), AST_EFOREIGN);
        expect_mentions(err, "record holds", path);
        free(fr);
        free(p);
    }
    close_engine(n, dir);
}

/* A record read as another payload format is AST_EFOREIGN, naming both formats and the file;
 * read as what it is, it still loads. */
static void test_foreign_format_refused(void **state)
{
    (void)state;
    NEED_NVME();
    char dir[512], path[600], err[1024];
    ast__nvme *n = open_engine(dir, sizeof dir, "foreign");
    size_t len, rlen;
    unsigned char *p = payload(AST_QTYPE_INT4, 4096, 64, &len);
    unsigned char *raw = payload(AST_QTYPE_NONE, len, 0, &rlen);
    unsigned char *back = malloc(len);
    assert_non_null(back);
    assert_int_equal(write_one(n, 7, p, len, AST_QTYPE_INT4, 64, err, sizeof err), 0);
    assert_int_equal(write_one(n, 8, raw, rlen, AST_QTYPE_NONE, 0, err, sizeof err), 0);
    assert_int_equal(ast__nvme_record_path(n, 7, path, sizeof path), 0);

    assert_int_equal(read_one(n, 7, back, len, AST_QTYPE_INT8, 64, err, sizeof err),
                     AST_EFOREIGN);
    expect_mentions(err, "record holds int4 in blocks of 64, expected int8 in blocks of 64", path);
    expect_mentions(err, "block 7", NULL);
    assert_int_equal(read_one(n, 7, back, len, AST_QTYPE_INT4, 32, err, sizeof err),
                     AST_EFOREIGN);
    expect_mentions(err, "holds int4 in blocks of 64, expected int4 in blocks of 32", NULL);
    assert_int_equal(read_one(n, 7, back, len, AST_QTYPE_NONE, 0, err, sizeof err),
                     AST_EFOREIGN);
    expect_mentions(err, "holds int4 in blocks of 64, expected raw bytes", NULL);
    assert_int_equal(read_one(n, 8, back, len, AST_QTYPE_INT8, 64, err, sizeof err),
                     AST_EFOREIGN);
    expect_mentions(err, "holds raw bytes, expected int8 in blocks of 64", NULL);

    /* a batch: the foreign record fails alone, the others load */
    unsigned char *b2 = malloc(len);
    assert_non_null(b2);
    ast__nvme_io ios[2] = {
        {.block_id = 7, .generation = 1, .data = back, .len = len, .fd = -1,
         .qtype = AST_QTYPE_INT8, .qblock = 64},
        {.block_id = 8, .generation = 1, .data = b2, .len = rlen, .fd = -1},
    };
    assert_int_equal(ast__nvme_read(n, ios, 2, NULL, err, sizeof err), AST_EFOREIGN);
    assert_int_equal(ios[0].result, AST_EFOREIGN);
    assert_int_equal(ios[1].result, 0);
    assert_memory_equal(b2, raw, rlen);
    assert_int_equal(read_one(n, 7, back, len, AST_QTYPE_INT4, 64, err, sizeof err), 0);
    assert_memory_equal(back, p, len);
    free(p), free(raw), free(back), free(b2);
    close_engine(n, dir);
}

/* A record of format version 2 (no payload type: bytes 40..59 zero), its checksums intact, is
 * refused by version, not read as raw bytes. */
static void test_other_version_refused(void **state)
{
    (void)state;
    NEED_NVME();
    char dir[512], path[600], err[1024];
    ast__nvme *n = open_engine(dir, sizeof dir, "version");
    size_t len, flen;
    unsigned char *p = payload(AST_QTYPE_NONE, 3000, 0, &len), *back = malloc(len);
    assert_non_null(back);
    assert_int_equal(write_one(n, 3, p, len, AST_QTYPE_NONE, 0, err, sizeof err), 0);
    assert_int_equal(ast__nvme_record_path(n, 3, path, sizeof path), 0);
    unsigned char *file = read_file(path, &flen);
    file[4] = 2;
    file[5] = 0;
    put32(file + 60, crc32c(0, file, 60));
    put32(file + 64 + len, crc32c(0, file, 64 + len));
    write_file(path, file, flen);
    assert_int_equal(read_one(n, 3, back, len, AST_QTYPE_NONE, 0, err, sizeof err),
                     AST_ECORRUPT);
    expect_mentions(err, "record format version 2", "this build reads version 3");
    expect_mentions(err, path, NULL);
    free(file), free(p), free(back);
    close_engine(n, dir);
}

/* A payload type or block size that is no format fails the record before its file is made. */
static void test_bad_format_args(void **state)
{
    (void)state;
    NEED_NVME();
    char dir[512], path[600], err[1024];
    ast__nvme *n = open_engine(dir, sizeof dir, "badargs");
    unsigned char buf[256] = {0};
    const struct {
        ast_qtype t;
        uint32_t block;
        const char *says;
    } bad[] = {
        {AST_QTYPE_INT8, 0, "block 0"},
        {AST_QTYPE_INT4, 63, "block 63"},
        {AST_QTYPE_INT8, AST_QUANT_BLOCK_MAX + 2, "must be even"},
        {AST_QTYPE_NONE, 64, "raw bytes have block size 0"},
        {(ast_qtype)9, 64, "payload type 9"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        assert_int_equal(write_one(n, 11, buf, sizeof buf, bad[i].t, bad[i].block, err,
                                   sizeof err),
                         AST_EINVAL);
        expect_mentions(err, "record format", bad[i].says);
        assert_int_equal(read_one(n, 11, buf, sizeof buf, bad[i].t, bad[i].block, err,
                                  sizeof err),
                         AST_EINVAL);
        expect_mentions(err, "record format", bad[i].says);
    }
    assert_int_equal(ast__nvme_record_path(n, 11, path, sizeof path), 0);
    assert_int_equal(access(path, F_OK), -1); /* no record */
    strcpy(path + strlen(path) - strlen(".rec"), ".tmp");
    assert_int_equal(access(path, F_OK), -1); /* and no tmp file */
    close_engine(n, dir);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_format_roundtrip),
        cmocka_unit_test(test_foreign_format_refused),
        cmocka_unit_test(test_other_version_refused),
        cmocka_unit_test(test_bad_format_args),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
