/*
 * test_quant.c - asteria/quant.h: the quantized format against a plain restatement of its
 * definition (nearbyintf and fabsf where the library has bit tricks, a bfloat16 rounding by
 * comparing the two neighbours), the error bound the header states, ties, zero and subnormal
 * blocks, the Bjorck rectification's quadratic convergence, and every bad argument.
 *
 * The error bound of a widened value (header): with t = x / s_b, the division gives t(1 + d1),
 * |d1| <= u (u = 2^-24), the code is within 1/2 of that, and the multiply gives q s_b (1 + d2),
 * |d2| <= u. So |x - x'| <= s_b |t - q| + u |x'| <= s_b / 2 + u (s_b |t| + |x'|)
 *   <= s_b / 2 + u (s_b (qmax + 1) + |x'|),
 * which is what check_bound allows: the format's step over two, plus the two roundings.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>

#include "asteria/errors.h"
#include "asteria/linalg.h"
#include "asteria/quant.h"
#include "test_helpers.h"

#include <lapacke.h>
#include <float.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define U32 0x1p-24
/* The rounding floor of ||V^T V - I||_F for an n x n float32 V (test_rectify_quadratic). */
#define FLOOR(n) ((double)(n) * sqrt((double)(n)) * U32)

#define assert_le(x, bound)                                                                    \
    do {                                                                                       \
        double x_ = (x), b_ = (bound);                                                         \
        if (!(x_ <= b_))                                                                       \
            fail_msg("%s = %.6e exceeds %.6e (line %d)", #x, x_, b_, __LINE__);                 \
    } while (0)

static const ast_qtype QTYPES[] = {AST_QTYPE_INT8, AST_QTYPE_INT4};

static void *xalloc(size_t bytes)
{
    void *p = malloc(bytes ? bytes : 1);
    assert_non_null(p);
    return p;
}

static void expect_message(const char *a, const char *b)
{
    char msg[256];
    assert_int_equal(ast_quant_last_error(msg, sizeof msg), 0);
    if ((a && !strstr(msg, a)) || (b && !strstr(msg, b)))
        fail_msg("message \"%s\" does not name \"%s\" and \"%s\"", msg, a ? a : "", b ? b : "");
}

/* ---- the restatement ---------------------------------------------------------------------- */

static int qmax_of(ast_qtype t) { return t == AST_QTYPE_INT8 ? 127 : 7; }

static size_t ref_nbytes(ast_qtype t, size_t count, size_t block, size_t *scales_at)
{
    size_t vb = t == AST_QTYPE_INT8 ? count : (count + 1) / 2;
    *scales_at = (vb + 3) / 4 * 4;
    return *scales_at + 4 * ((count + block - 1) / block);
}

/* The header's definition, one value at a time: nearbyintf rounds half to even in the default
 * mode; the codes are packed as the header draws them. */
static unsigned char *ref_quantize(ast_qtype t, size_t count, size_t block, const float *x,
                                   size_t *nbytes)
{
    size_t at;
    *nbytes = ref_nbytes(t, count, block, &at);
    unsigned char *q = calloc(*nbytes ? *nbytes : 1, 1);
    assert_non_null(q);
    const float qmax = (float)qmax_of(t);
    for (size_t b = 0; b * block < count; b++) {
        size_t end = b * block + block < count ? b * block + block : count;
        float amax = 0.0f;
        for (size_t i = b * block; i < end; i++)
            amax = fabsf(x[i]) > amax ? fabsf(x[i]) : amax;
        float s = amax / qmax;
        memcpy(q + at + 4 * b, &s, 4);
        for (size_t i = b * block; i < end; i++) {
            float c = s == 0.0f ? 0.0f : nearbyintf(x[i] / s);
            int code = (int)(c > qmax ? qmax : c < -qmax ? -qmax : c);
            if (t == AST_QTYPE_INT8)
                q[i] = (unsigned char)(int8_t)code;
            else
                q[i / 2] |= (unsigned char)((code & 0xf) << (i % 2 ? 4 : 0));
        }
    }
    return q;
}

/* float32 -> bfloat16 by choosing the nearer of the two neighbours (the even one on a tie). */
static uint16_t ref_bf16(float f)
{
    uint32_t u;
    memcpy(&u, &f, 4);
    uint32_t lo = u & 0xffff0000u, hi = lo + 0x10000u;
    float flo, fhi;
    memcpy(&flo, &lo, 4);
    memcpy(&fhi, &hi, 4);
    double dl = fabs((double)f - flo), dh = fabs((double)fhi - f);
    if (dl < dh || (dl == dh && !((lo >> 16) & 1u)))
        return (uint16_t)(lo >> 16);
    return (uint16_t)(hi >> 16);
}

static float scale_of(const unsigned char *q, size_t at, size_t b)
{
    float s;
    memcpy(&s, q + at + 4 * b, 4);
    return s;
}

/* |x - x'| within the bound of the file's header, value by value; returns max |x - x'| / s. */
static double check_bound(ast_qtype t, size_t count, size_t block, const float *x,
                          const float *w, const unsigned char *q)
{
    size_t at;
    ref_nbytes(t, count, block, &at);
    double worst = 0.0;
    for (size_t i = 0; i < count; i++) {
        double s = scale_of(q, at, i / block), err = fabs((double)x[i] - w[i]);
        double bound = s / 2 + U32 * (s * (qmax_of(t) + 1) + fabs((double)w[i]));
        if (!(err <= bound))
            fail_msg("value %zu: |%.9g - %.9g| = %.3e exceeds %.3e (scale %.3e)", i, x[i], w[i],
                     err, bound, s);
        if (s > 0)
            worst = fmax(worst, err / s);
    }
    return worst;
}

/* ---- layout and names --------------------------------------------------------------------- */

static void test_names(void **state)
{
    (void)state;
    ast_qtype t;
    for (int i = 0; i <= 2; i++) {
        assert_int_equal(ast_qtype_parse(ast_qtype_name((ast_qtype)i), &t), 0);
        assert_int_equal(t, i);
    }
    assert_string_equal(ast_qtype_name(AST_QTYPE_INT4), "int4");
    assert_null(ast_qtype_name((ast_qtype)3));
    assert_int_equal(ast_qtype_parse("int2", &t), AST_EINVAL);
    expect_message("'int2'", "int8, int4");
    assert_int_equal(ast_qtype_parse(NULL, &t), AST_EINVAL);
    expect_message("name", NULL);
    assert_int_equal(ast_qtype_parse("int8", NULL), AST_EINVAL);
    expect_message("out", NULL);
}

static void test_layout(void **state)
{
    (void)state;
    const size_t counts[] = {0, 1, 2, 3, 63, 64, 65, 127, 1000, 4096, 65537};
    const size_t blocks[] = {2, 32, 64, 128, 1000, AST_QUANT_BLOCK_MAX};
    ast_quant_layout l;
    for (size_t ti = 0; ti < 2; ti++)
        for (size_t ci = 0; ci < sizeof counts / sizeof counts[0]; ci++)
            for (size_t bi = 0; bi < sizeof blocks / sizeof blocks[0]; bi++) {
                size_t at, n = ref_nbytes(QTYPES[ti], counts[ci], blocks[bi], &at);
                assert_int_equal(ast_quant_layout_get(QTYPES[ti], counts[ci], blocks[bi], &l), 0);
                assert_int_equal(l.count, counts[ci]);
                assert_int_equal(l.block, blocks[bi]);
                assert_int_equal(l.nblocks, (counts[ci] + blocks[bi] - 1) / blocks[bi]);
                assert_int_equal(l.scales_offset, at);
                assert_int_equal(l.nbytes, n);
                assert_true(l.value_bytes <= l.scales_offset && l.scales_offset % 4 == 0);
            }
    /* 1024 x 1024 at the default block: int8 1 + 4/64 bytes a value, int4 1/2 + 4/64. */
    assert_int_equal(ast_quant_layout_get(AST_QTYPE_INT8, 1 << 20, 64, &l), 0);
    assert_int_equal(l.nbytes, (1 << 20) + 4 * (1 << 14));
    assert_int_equal(ast_quant_layout_get(AST_QTYPE_INT4, 1 << 20, 64, &l), 0);
    assert_int_equal(l.nbytes, (1 << 19) + 4 * (1 << 14));

    const size_t bad_blocks[] = {0, 1, 63, AST_QUANT_BLOCK_MAX + 2};
    for (size_t i = 0; i < sizeof bad_blocks / sizeof bad_blocks[0]; i++) {
        assert_int_equal(ast_quant_layout_get(AST_QTYPE_INT8, 10, bad_blocks[i], &l), AST_EINVAL);
        expect_message("block", "even");
    }
    assert_int_equal(ast_quant_layout_get(AST_QTYPE_NONE, 10, 64, &l), AST_EINVAL);
    expect_message("type 0", "AST_QTYPE_INT8");
    assert_int_equal(ast_quant_layout_get((ast_qtype)7, 10, 64, &l), AST_EINVAL);
    expect_message("type 7", NULL);
    assert_int_equal(ast_quant_layout_get(AST_QTYPE_INT8, SIZE_MAX - 1, 64, &l), AST_EINVAL);
    expect_message("count", "size_t");
    assert_int_equal(ast_quant_layout_get(AST_QTYPE_INT8, 10, 64, NULL), AST_EINVAL);
    expect_message("out", NULL);
}

/* ---- quantize / dequantize ---------------------------------------------------------------- */

/* Values of several shapes: an orthogonal basis's entries (about 1 / sqrt(n)), wide ranges
 * within a block, exact zeros. */
static void fill(float *x, size_t count, int kind)
{
    for (size_t i = 0; i < count; i++) {
        double v = nrand();
        if (kind == 0)
            v /= 32.0;
        else if (kind == 1)
            v *= exp(8 * (urand() - 0.5));
        else if (kind == 2 && urand() < 0.3)
            v = 0.0;
        x[i] = (float)v;
    }
}

/* x quantized at the layout's size and widened into w: the quantized form (free it). */
static unsigned char *round_trip(ast_qtype t, size_t count, size_t block, const float *x,
                                 float *w)
{
    ast_quant_layout l;
    assert_int_equal(ast_quant_layout_get(t, count, block, &l), 0);
    unsigned char *q = xalloc(l.nbytes);
    assert_int_equal(ast_quant_quantize(t, count, block, x, q, l.nbytes), 0);
    assert_int_equal(ast_quant_dequantize(t, count, block, q, l.nbytes, w), 0);
    return q;
}

static void test_restatement_and_bound(void **state)
{
    (void)state;
    const size_t counts[] = {1, 2, 7, 64, 65, 200, 1023, 4096};
    const size_t blocks[] = {2, 32, 64, 128};
    rng_seed(11);
    for (size_t ti = 0; ti < 2; ti++)
        for (size_t ci = 0; ci < sizeof counts / sizeof counts[0]; ci++)
            for (size_t bi = 0; bi < sizeof blocks / sizeof blocks[0]; bi++)
                for (int kind = 0; kind < 3; kind++) {
                    const ast_qtype t = QTYPES[ti];
                    const size_t count = counts[ci], block = blocks[bi];
                    float *x = xalloc(count * 4), *w = xalloc(count * 4);
                    uint16_t *h = xalloc(count * 2);
                    fill(x, count, kind);
                    size_t nb;
                    unsigned char *want = ref_quantize(t, count, block, x, &nb);
                    unsigned char *q = xalloc(nb);
                    memset(q, 0xa5, nb); /* padding bytes are written too */
                    assert_int_equal(ast_quant_quantize(t, count, block, x, q, nb), 0);
                    if (memcmp(q, want, nb))
                        fail_msg("%s count %zu block %zu kind %d: bytes differ from the "
                                 "restatement", ast_qtype_name(t), count, block, kind);
                    assert_int_equal(ast_quant_dequantize(t, count, block, q, nb, w), 0);
                    for (size_t i = 0; i < count; i++) {
                        size_t at;
                        ref_nbytes(t, count, block, &at);
                        int code = t == AST_QTYPE_INT8 ? (int8_t)q[i]
                                                       : (int)((q[i / 2] >> (i % 2 ? 4 : 0)) & 0xf);
                        if (t == AST_QTYPE_INT4 && code > 7)
                            code -= 16;
                        float want_w = (float)code * scale_of(q, at, i / block);
                        assert_memory_equal(&w[i], &want_w, 4);
                    }
                    check_bound(t, count, block, x, w, q);
                    assert_int_equal(ast_quant_dequantize_bf16(t, count, block, q, nb, h), 0);
                    for (size_t i = 0; i < count; i++)
                        if (h[i] != ref_bf16(w[i]))
                            fail_msg("bf16 of %.9g: 0x%04x, the nearest is 0x%04x", w[i], h[i],
                                     ref_bf16(w[i]));
                    free(x), free(w), free(h), free(want), free(q);
                }
}

/* The bound is the format's: the largest error over many values comes close to s / 2. */
static void test_bound_is_tight(void **state)
{
    (void)state;
    const size_t count = 1 << 14;
    rng_seed(5);
    float *x = xalloc(count * 4), *w = xalloc(count * 4);
    fill(x, count, 0);
    for (size_t ti = 0; ti < 2; ti++) {
        unsigned char *q = round_trip(QTYPES[ti], count, 64, x, w);
        double worst = check_bound(QTYPES[ti], count, 64, x, w, q);
        assert_true(worst > 0.49 && worst <= 0.5 + 1e-5);
        free(q);
    }
    free(x), free(w);
}

/* s = 1 exactly (absmax = qmax): the codes of k + 1/2 go to the even neighbour. */
static void test_ties_round_to_even(void **state)
{
    (void)state;
    const float x8[] = {127.0f, 0.5f, 1.5f, 2.5f, -0.5f, -1.5f, -2.5f, 126.5f, -126.5f, 3.5f};
    const int8_t c8[] = {127, 0, 2, 2, 0, -2, -2, 126, -126, 4};
    const float x4[] = {7.0f, 0.5f, 1.5f, 2.5f, 3.5f, -3.5f, 6.5f, -6.5f, -0.5f, 4.5f};
    const int c4[] = {7, 0, 2, 2, 4, -4, 6, -6, 0, 4};
    unsigned char q[64];
    ast_quant_layout l;
    assert_int_equal(ast_quant_layout_get(AST_QTYPE_INT8, 10, 64, &l), 0);
    assert_int_equal(ast_quant_quantize(AST_QTYPE_INT8, 10, 64, x8, q, l.nbytes), 0);
    assert_memory_equal(q, c8, 10);
    assert_true(scale_of(q, l.scales_offset, 0) == 1.0f);
    assert_int_equal(ast_quant_layout_get(AST_QTYPE_INT4, 10, 64, &l), 0);
    assert_int_equal(ast_quant_quantize(AST_QTYPE_INT4, 10, 64, x4, q, l.nbytes), 0);
    for (int i = 0; i < 10; i++) {
        int code = (q[i / 2] >> (i % 2 ? 4 : 0)) & 0xf;
        assert_int_equal(code > 7 ? code - 16 : code, c4[i]);
    }
    assert_true(scale_of(q, l.scales_offset, 0) == 1.0f);
}

/* A zero block has scale 0 and codes 0; a subnormal block stays within -qmax..qmax. */
static void test_zero_and_subnormal_blocks(void **state)
{
    (void)state;
    float x[8] = {0.0f, -0.0f, 0.0f, 0.0f, 190 * 0x1p-149f, -190 * 0x1p-149f, 0x1p-149f, 0.0f};
    float w[8];
    unsigned char q[64];
    for (size_t ti = 0; ti < 2; ti++) {
        ast_quant_layout l;
        size_t nb;
        assert_int_equal(ast_quant_layout_get(QTYPES[ti], 8, 4, &l), 0);
        assert_int_equal(ast_quant_quantize(QTYPES[ti], 8, 4, x, q, l.nbytes), 0);
        unsigned char *want = ref_quantize(QTYPES[ti], 8, 4, x, &nb);
        assert_memory_equal(q, want, nb);
        free(want);
        assert_true(scale_of(q, l.scales_offset, 0) == 0.0f);
        assert_int_equal(ast_quant_dequantize(QTYPES[ti], 8, 4, q, l.nbytes, w), 0);
        for (int i = 0; i < 4; i++)
            assert_true(w[i] == 0.0f);
        for (int i = 4; i < 8; i++)
            assert_true(fabsf(w[i]) <= 1.5f * 190 * 0x1p-149f);
    }
}

static void test_nonfinite(void **state)
{
    (void)state;
    const float bad[] = {NAN, INFINITY, -INFINITY};
    float x[100];
    unsigned char q[256], before[256];
    rng_seed(3);
    fill(x, 100, 0);
    for (size_t ti = 0; ti < 2; ti++)
        for (size_t k = 0; k < 3; k++) {
            ast_quant_layout l;
            assert_int_equal(ast_quant_layout_get(QTYPES[ti], 100, 32, &l), 0);
            x[70] = bad[k];
            memset(q, 0x3c, sizeof q);
            memcpy(before, q, sizeof q);
            assert_int_equal(ast_quant_quantize(QTYPES[ti], 100, 32, x, q, l.nbytes),
                             AST_ENONFINITE);
            assert_memory_equal(q, before, sizeof q); /* nothing written */
            expect_message("values 64..95", "NaN or Inf");
            x[70] = 0.25f;
        }
}

static void test_bad_args(void **state)
{
    (void)state;
    float x[64] = {0}, w[64];
    uint16_t h[64];
    unsigned char q[256];
    ast_quant_layout l;
    assert_int_equal(ast_quant_layout_get(AST_QTYPE_INT4, 64, 64, &l), 0);

    assert_int_equal(ast_quant_quantize(AST_QTYPE_INT4, 64, 64, x, q, l.nbytes + 1), AST_EINVAL);
    expect_message("qbytes 37", "takes 36 bytes");
    assert_int_equal(ast_quant_quantize(AST_QTYPE_INT4, 64, 64, NULL, q, l.nbytes), AST_EINVAL);
    expect_message("x is NULL", NULL);
    assert_int_equal(ast_quant_quantize(AST_QTYPE_INT4, 64, 64, x, NULL, l.nbytes), AST_EINVAL);
    expect_message("q is NULL", NULL);
    assert_int_equal(ast_quant_quantize(AST_QTYPE_INT4, 64, 3, x, q, l.nbytes), AST_EINVAL);
    expect_message("ast_quant_quantize: block 3", NULL);
    assert_int_equal(ast_quant_quantize(AST_QTYPE_NONE, 64, 64, x, q, l.nbytes), AST_EINVAL);
    expect_message("type 0", NULL);
    assert_int_equal(ast_quant_quantize(AST_QTYPE_INT4, 8, 64, x, (unsigned char *)x + 4, 8),
                     AST_EINVAL);
    expect_message("overlap", NULL);
    /* count 0: nothing to do, NULL buffers fine */
    assert_int_equal(ast_quant_quantize(AST_QTYPE_INT8, 0, 64, NULL, NULL, 0), 0);
    assert_int_equal(ast_quant_dequantize(AST_QTYPE_INT8, 0, 64, NULL, 0, NULL), 0);

    assert_int_equal(ast_quant_quantize(AST_QTYPE_INT4, 64, 64, x, q, l.nbytes), 0);
    assert_int_equal(ast_quant_dequantize(AST_QTYPE_INT4, 64, 64, q, l.nbytes - 4, w),
                     AST_EINVAL);
    expect_message("ast_quant_dequantize: qbytes 32", NULL);
    assert_int_equal(ast_quant_dequantize_bf16(AST_QTYPE_INT4, 64, 64, q, l.nbytes, NULL),
                     AST_EINVAL);
    expect_message("ast_quant_dequantize_bf16: x is NULL", NULL);
    const float bad_scales[] = {-1.0f, INFINITY, NAN};
    for (int k = 0; k < 3; k++) {
        memcpy(q + l.scales_offset, &bad_scales[k], 4);
        memset(w, 0x11, sizeof w);
        assert_int_equal(ast_quant_dequantize(AST_QTYPE_INT4, 64, 64, q, l.nbytes, w),
                         AST_EINVAL);
        expect_message("scale 0", "not a quantized form");
        assert_int_equal(ast_quant_dequantize_bf16(AST_QTYPE_INT4, 64, 64, q, l.nbytes, h),
                         AST_EINVAL);
        for (int i = 0; i < 64; i++) /* untouched */
            assert_int_equal(((unsigned char *)w)[4 * i], 0x11);
    }
    char buf[8];
    assert_int_equal(ast_quant_last_error(NULL, 8), AST_EINVAL);
    assert_int_equal(ast_quant_last_error(buf, 0), AST_EINVAL);
}

/* ---- rectify ------------------------------------------------------------------------------- */

/* A random orthogonal n x n matrix (row-major, float64): the Q of a Gaussian matrix's QR. */
static void random_orthogonal(int n, double *q)
{
    double *tau = xalloc((size_t)n * 8);
    for (size_t i = 0; i < (size_t)n * n; i++)
        q[i] = nrand();
    assert_int_equal(LAPACKE_dgeqrf(LAPACK_ROW_MAJOR, n, n, q, n, tau), 0);
    assert_int_equal(LAPACKE_dorgqr(LAPACK_ROW_MAJOR, n, n, n, q, n, tau), 0);
    free(tau);
}

/* ||V^T V - I||_F and ||V^T V - I||_2 in float64 (the 2-norm from the symmetric eigenvalues). */
static void orth_dev(int n, const float *v, double *fro, double *two)
{
    double *a = xalloc((size_t)n * n * 8), *w = xalloc((size_t)n * 8);
    double acc = 0.0;
    for (int i = 0; i < n; i++)
        for (int j = 0; j < n; j++) {
            double s = 0.0;
            for (int k = 0; k < n; k++)
                s += (double)v[(size_t)k * n + i] * v[(size_t)k * n + j];
            s -= i == j;
            a[(size_t)i * n + j] = s;
            acc += s * s;
        }
    *fro = sqrt(acc);
    if (two) {
        assert_int_equal(LAPACKE_dsyev(LAPACK_ROW_MAJOR, 'N', 'U', n, a, n, w), 0);
        *two = fmax(fabs(w[0]), fabs(w[n - 1]));
    }
    free(a), free(w);
}

/* V = Q + E with Q orthogonal: one step takes A = V^T V - I to A' = -(3/4) A^2 + (1/4) A^3 (the
 * header's derivation: V' = V (I - A / 2), V'^T V' = (I + A)(I - A / 2)^2, polynomials in A
 * commute), so ||A'||_F <= ||A^2||_F 3/4 + ||A^3||_F / 4 <= (3/4 + ||A||_2 / 4) ||A||_2 ||A||_F,
 * c = 3/4 + ||A||_2 / 4 < 1 when ||A||_2 < 1. On top comes the float32 step's rounding floor
 * (FLOOR): each entry of V^T V and of V G is an n-term float32 sum, wrong by up to about n u
 * (worst case; sqrt(n) u typically), so the n^2 entries of A' carry about n u sqrt(n) in the
 * Frobenius norm. Measured: 1.2e-6 at n = 64, where FLOOR is 3.1e-5. */
static void test_rectify_quadratic(void **state)
{
    (void)state;
    const int n = 64;
    const double sizes[] = {0.3, 0.1, 0.02};
    double *q = xalloc((size_t)n * n * 8);
    float *v = xalloc((size_t)n * n * 4), *v3 = xalloc((size_t)n * n * 4);
    const double floor_ = FLOOR(n);
    rng_seed(17);
    random_orthogonal(n, q);
    for (size_t si = 0; si < sizeof sizes / sizeof sizes[0]; si++) {
        for (size_t i = 0; i < (size_t)n * n; i++)
            v[i] = (float)(q[i] + sizes[si] / (2.0 * n) * nrand());
        double fro, two, after, err[4];
        orth_dev(n, v, &fro, &two);
        memcpy(v3, v, (size_t)n * n * 4);
        assert_int_equal(ast_quant_rectify(1, n, v, 1, err), 0);
        orth_dev(n, v, &after, NULL);
        const double c = 0.75 + two / 4;
        assert_le(after, c * two * fro + floor_);
        assert_le(after, c * fro * fro + floor_);
        assert_true(after < fro);
        /* the library's own measure agrees with the float64 one */
        assert_le(fabs(err[0] - fro), floor_);
        assert_le(fabs(err[1] - after), floor_);
        /* three steps: down to the rounding floor */
        assert_int_equal(ast_quant_rectify(1, n, v3, 3, err), 0);
        assert_true(err[1] < err[0] && err[2] <= fmax(err[1], floor_));
        assert_le(err[3], floor_);
        orth_dev(n, v3, &after, NULL);
        assert_le(after, floor_);
        print_message("[  INFO    ] ||A||_F %.3e (2-norm %.3e) -> one step %.3e (bound %.3e), "
                      "three %.3e\n", fro, two, err[1], c * two * fro + floor_, err[3]);
    }
    free(q), free(v), free(v3);
}

static void test_rectify_batch_and_failures(void **state)
{
    (void)state;
    const int n = 16;
    const size_t nn = (size_t)n * n;
    double *q = xalloc(nn * 8), err[3 * 3];
    float *v = xalloc(3 * nn * 4), *keep = xalloc(3 * nn * 4);
    rng_seed(23);
    random_orthogonal(n, q);
    for (size_t i = 0; i < 3 * nn; i++)
        v[i] = (float)(q[i % nn] + 0.01 * nrand());
    memcpy(keep, v, 3 * nn * 4);

    /* steps 0: measures only */
    assert_int_equal(ast_quant_rectify(3, n, v, 0, err), 0);
    assert_memory_equal(v, keep, 3 * nn * 4);
    assert_true(err[0] > 0.01 && err[1] > 0.01 && err[2] > 0.01);
    assert_int_equal(ast_quant_rectify(3, n, v, 0, NULL), 0);

    /* a NaN in the second matrix: the first is written, the second and third are not */
    v[nn + 5] = NAN;
    keep[nn + 5] = NAN;
    assert_int_equal(ast_quant_rectify(3, n, v, 2, err), AST_ENONFINITE);
    expect_message("matrix 1", "NaN or Inf");
    assert_true(memcmp(v, keep, nn * 4) != 0);
    assert_memory_equal(v + nn, keep + nn, 2 * nn * 4);

    /* singular values beyond sqrt 3 diverge: the result overflows, V is kept */
    for (size_t i = 0; i < nn; i++)
        v[i] = i % (n + 1) == 0 ? 3.0f : 0.0f;
    memcpy(keep, v, nn * 4);
    assert_int_equal(ast_quant_rectify(1, n, v, 8, NULL), AST_ENONFINITE);
    expect_message("matrix 0", "Bjorck step");
    assert_memory_equal(v, keep, nn * 4);

    assert_int_equal(ast_quant_rectify(-1, n, v, 1, NULL), AST_EINVAL);
    expect_message("batch -1", NULL);
    assert_int_equal(ast_quant_rectify(1, 0, v, 1, NULL), AST_EINVAL);
    expect_message("n 0", NULL);
    assert_int_equal(ast_quant_rectify(1, n, v, AST_QUANT_MAX_STEPS + 1, NULL), AST_EINVAL);
    expect_message("steps 17", "0..16");
    assert_int_equal(ast_quant_rectify(1, n, NULL, 1, NULL), AST_EINVAL);
    expect_message("v is NULL", NULL);
    assert_int_equal(ast_quant_rectify(0, n, v, 1, NULL), 0);
    free(q), free(v), free(keep);
}

/* A quantized orthogonal basis: rectify after dequantize restores orthogonality to rounding. */
static void test_quantized_basis_rectified(void **state)
{
    (void)state;
    const int n = 128;
    const size_t nn = (size_t)n * n;
    double *q = xalloc(nn * 8), err[4];
    float *x = xalloc(nn * 4), *w = xalloc(nn * 4);
    rng_seed(29);
    random_orthogonal(n, q);
    for (size_t i = 0; i < nn; i++)
        x[i] = (float)q[i];
    for (size_t ti = 0; ti < 2; ti++) {
        free(round_trip(QTYPES[ti], nn, 64, x, w));
        assert_int_equal(ast_quant_rectify(1, n, w, 3, err), 0);
        assert_true(err[1] < err[0] && err[2] < err[1]);
        assert_le(err[3], FLOOR(n));
        print_message("[  INFO    ] %s n %d: ||V^T V - I||_F %.3e -> %.3e -> %.3e -> %.3e\n",
                      ast_qtype_name(QTYPES[ti]), n, err[0], err[1], err[2], err[3]);
    }
    free(q), free(x), free(w);
}

int main(void)
{
    /* OpenBLAS on one thread before this file's own BLAS / LAPACK calls (the references): its
     * threads are not TSan's, and libasteria runs it so */
    ast_linalg_init();
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_names),
        cmocka_unit_test(test_layout),
        cmocka_unit_test(test_restatement_and_bound),
        cmocka_unit_test(test_bound_is_tight),
        cmocka_unit_test(test_ties_round_to_even),
        cmocka_unit_test(test_zero_and_subnormal_blocks),
        cmocka_unit_test(test_nonfinite),
        cmocka_unit_test(test_bad_args),
        cmocka_unit_test(test_rectify_quadratic),
        cmocka_unit_test(test_rectify_batch_and_failures),
        cmocka_unit_test(test_quantized_basis_rectified),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
