/*
 * quant.c - the block-quantized format of asteria/quant.h: its layout, quantize, dequantize (to
 * float32 and bfloat16) and the Bjorck rectification of a widened basis.
 *
 * Owns: this thread's last-error message, nothing else. May call: OpenBLAS (cblas_ssyrk and
 * cblas_sgemm, through linalg_prim.h, which also maps a prefixed OpenBLAS's names),
 * ast_linalg_init, util.h (the message formatter). Locking: none; no shared mutable state.
 *
 * The per-value loops are plain C over one block that the compiler vectorises (built with
 * -O3: CMakeLists.txt sets it for this file; GCC's -O2 cost model leaves loops of unknown trip
 * count scalar). They hold no branch and call no libm function:
 *  - absmax: an unsigned max over the values' bit patterns with the sign bit cleared. For
 *    non-negative floats the patterns order as the values do, and every Inf or NaN pattern lies
 *    above every finite one, so the same max says whether the block is finite.
 *  - round half to even: (v + 1.5 * 2^23) - 1.5 * 2^23, exact for |v| <= 2^22 under the default
 *    rounding mode (the sum's ulp is 1 and the constant is even, so a tie goes to the even
 *    integer), as torch.round does; the codes are at most qmax + 1/2 before the clamp.
 *  - the clamp matters only for a subnormal scale (a block whose absmax is below 2^-126 * qmax):
 *    there the division that makes s_b can lose most of its bits and x / s_b exceed qmax.
 *  - bfloat16: round to nearest even on the float32 pattern (add 0x7fff plus the kept part's
 *    lowest bit, keep the high 16 bits), what torch's float32 -> bfloat16 conversion does for
 *    finite values.
 * The arithmetic (one float32 division per code, one multiply per widened value) is the whole of
 * the format's definition, so torch's kernels (asteria.tiers.quant) give the same bits; no
 * FMA contraction can apply (no multiply feeds an add).
 */
#include "asteria/quant.h"

#include "asteria/errors.h"
#include "asteria/linalg.h"
#include "linalg_prim.h"
#include "util.h"

#include <math.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define ROUND_MAGIC 12582912.0f /* 1.5 * 2^23 */
#define FINITE_LIMIT 0x7f800000u /* the pattern of +Inf: finite magnitudes are below it */

static _Thread_local char tl_msg[256];

static int fail(int code, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static int fail(int code, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    ast__verrorf(tl_msg, sizeof tl_msg, code, fmt, ap);
    va_end(ap);
    return code;
}

int ast_quant_last_error(char *buf, size_t len)
{
    if (!buf || !len)
        return AST_EINVAL;
    snprintf(buf, len, "%s", tl_msg);
    return 0;
}

/* ---- types ------------------------------------------------------------------------------- */

static const char *const QTYPE_NAMES[] = {"none", "int8", "int4"};

const char *ast_qtype_name(ast_qtype t)
{
    return (unsigned)t < sizeof QTYPE_NAMES / sizeof QTYPE_NAMES[0] ? QTYPE_NAMES[t] : NULL;
}

int ast_qtype_parse(const char *name, ast_qtype *out)
{
    if (!name || !out)
        return fail(AST_EINVAL, "ast_qtype_parse: %s is NULL", name ? "out" : "name");
    for (unsigned t = 0; t < sizeof QTYPE_NAMES / sizeof QTYPE_NAMES[0]; t++) {
        if (!strcmp(name, QTYPE_NAMES[t])) {
            *out = (ast_qtype)t;
            return 0;
        }
    }
    return fail(AST_EINVAL, "ast_qtype_parse: unknown type '%s'; allowed: none, int8, int4",
                name);
}

static int qmax_of(ast_qtype t) { return t == AST_QTYPE_INT8 ? 127 : 7; }

/* ---- layout ------------------------------------------------------------------------------ */

static int layout(const char *fn, ast_qtype t, size_t count, size_t block, ast_quant_layout *l)
{
    if (t != AST_QTYPE_INT8 && t != AST_QTYPE_INT4)
        return fail(AST_EINVAL, "%s: type %d: allowed AST_QTYPE_INT8 (%d), AST_QTYPE_INT4 (%d)",
                    fn, (int)t, AST_QTYPE_INT8, AST_QTYPE_INT4);
    if (block < 2 || block > AST_QUANT_BLOCK_MAX || block % 2)
        return fail(AST_EINVAL, "%s: block %zu: must be even, 2..%d", fn, block,
                    AST_QUANT_BLOCK_MAX);
    l->count = count;
    l->block = block;
    l->nblocks = count / block + (count % block != 0);
    l->value_bytes = t == AST_QTYPE_INT8 ? count : count / 2 + count % 2;
    if (l->value_bytes > SIZE_MAX - 3 || l->nblocks > (SIZE_MAX - l->value_bytes - 3) / 4)
        return fail(AST_EINVAL, "%s: count %zu: the quantized form's size exceeds a size_t", fn,
                    count);
    l->scales_offset = (l->value_bytes + 3) & ~(size_t)3;
    l->nbytes = l->scales_offset + 4 * l->nblocks;
    return 0;
}

int ast_quant_layout_get(ast_qtype t, size_t count, size_t block, ast_quant_layout *out)
{
    ast_quant_layout l;
    if (!out)
        return fail(AST_EINVAL, "ast_quant_layout_get: out is NULL");
    int rc = layout("ast_quant_layout_get", t, count, block, &l);
    if (rc == 0)
        *out = l;
    return rc;
}

static int overlap(const void *a, size_t na, const void *b, size_t nb)
{
    uintptr_t pa = (uintptr_t)a, pb = (uintptr_t)b;
    return na && nb && pa < pb + nb && pb < pa + na;
}

/* The checks quantize and dequantize share: layout, pointers, the quantized buffer's size and
 * overlap. xsize: bytes per widened value. */
static int check_io(const char *fn, ast_qtype t, size_t count, size_t block, const void *q,
                    size_t qbytes, const void *x, size_t xsize, ast_quant_layout *l)
{
    int rc = layout(fn, t, count, block, l);
    if (rc)
        return rc;
    if (count && (!q || !x))
        return fail(AST_EINVAL, "%s: %s is NULL", fn, q ? "x" : "q");
    if (qbytes != l->nbytes)
        return fail(AST_EINVAL, "%s: qbytes %zu: the %s form of %zu values in blocks of %zu "
                    "takes %zu bytes", fn, qbytes, ast_qtype_name(t), count, block, l->nbytes);
    if (count > SIZE_MAX / xsize || overlap(q, qbytes, x, count * xsize))
        return fail(AST_EINVAL, "%s: q and x overlap", fn);
    return 0;
}

/* ---- quantize ---------------------------------------------------------------------------- */

static uint32_t absmax_bits(const float *x, size_t m)
{
    uint32_t mx = 0;
    for (size_t i = 0; i < m; i++) {
        uint32_t u;
        memcpy(&u, x + i, sizeof u);
        u &= 0x7fffffffu;
        mx = u > mx ? u : mx;
    }
    return mx;
}

static inline float code_of(float x, float s, float qmax)
{
    float r = (x / s + ROUND_MAGIC) - ROUND_MAGIC;
    r = r > qmax ? qmax : r;
    return r < -qmax ? -qmax : r;
}

static void quant_i8(const float *restrict x, size_t m, float s, int8_t *restrict q)
{
    for (size_t i = 0; i < m; i++)
        q[i] = (int8_t)code_of(x[i], s, 127.0f);
}

/* Values 2k and 2k + 1 into byte k (low, high nibble); an odd m's last value alone. */
static void quant_i4(const float *restrict x, size_t m, float s, uint8_t *restrict q)
{
    for (size_t k = 0; k < m / 2; k++) {
        int lo = (int)code_of(x[2 * k], s, 7.0f), hi = (int)code_of(x[2 * k + 1], s, 7.0f);
        q[k] = (uint8_t)((lo & 0xf) | (hi & 0xf) << 4);
    }
    if (m % 2)
        q[m / 2] = (uint8_t)((int)code_of(x[m - 1], s, 7.0f) & 0xf);
}

int ast_quant_quantize(ast_qtype t, size_t count, size_t block, const float *x, void *q,
                       size_t qbytes)
{
    static const char fn[] = "ast_quant_quantize";
    ast_quant_layout l;
    int rc = check_io(fn, t, count, block, q, qbytes, x, sizeof(float), &l);
    if (rc || count == 0)
        return rc;
    /* Every block is checked before a byte is written: q is untouched on failure. */
    for (size_t b = 0; b < l.nblocks; b++) {
        size_t m = b + 1 < l.nblocks ? block : count - b * block;
        if (absmax_bits(x + b * block, m) >= FINITE_LIMIT)
            return fail(AST_ENONFINITE, "%s: x holds NaN or Inf in values %zu..%zu", fn,
                        b * block, b * block + m - 1);
    }
    unsigned char *out = q;
    const float qmax = (float)qmax_of(t);
    for (size_t b = 0; b < l.nblocks; b++) {
        const float *xb = x + b * block;
        size_t m = b + 1 < l.nblocks ? block : count - b * block;
        uint32_t bits = absmax_bits(xb, m);
        float amax, s;
        memcpy(&amax, &bits, sizeof amax);
        s = amax / qmax;
        if (s == 0.0f)
            memset(out + (t == AST_QTYPE_INT8 ? b * block : b * block / 2), 0,
                   t == AST_QTYPE_INT8 ? m : (m + 1) / 2);
        else if (t == AST_QTYPE_INT8)
            quant_i8(xb, m, s, (int8_t *)(out + b * block));
        else
            quant_i4(xb, m, s, out + b * block / 2);
        memcpy(out + l.scales_offset + 4 * b, &s, sizeof s);
    }
    memset(out + l.value_bytes, 0, l.scales_offset - l.value_bytes);
    return 0;
}

/* ---- dequantize -------------------------------------------------------------------------- */

static int check_scales(const char *fn, const unsigned char *q, const ast_quant_layout *l)
{
    for (size_t b = 0; b < l->nblocks; b++) {
        uint32_t u;
        memcpy(&u, q + l->scales_offset + 4 * b, sizeof u);
        if (u >= FINITE_LIMIT) {
            float s;
            memcpy(&s, &u, sizeof s);
            return fail(AST_EINVAL, "%s: scale %zu is %g: not a quantized form (scales are "
                        "finite and >= 0)", fn, b, (double)s);
        }
    }
    return 0;
}

static inline int nibble(unsigned v) { return (int)((v & 0xfu) ^ 8u) - 8; }

static inline uint16_t bf16_of(float v)
{
    uint32_t u;
    memcpy(&u, &v, sizeof u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

static void deq_i8_f32(const int8_t *restrict q, size_t m, float s, float *restrict x)
{
    for (size_t i = 0; i < m; i++)
        x[i] = (float)q[i] * s;
}

static void deq_i4_f32(const uint8_t *restrict q, size_t m, float s, float *restrict x)
{
    for (size_t k = 0; k < m / 2; k++) {
        x[2 * k] = (float)nibble(q[k]) * s;
        x[2 * k + 1] = (float)nibble(q[k] >> 4) * s;
    }
    if (m % 2)
        x[m - 1] = (float)nibble(q[m / 2]) * s;
}

static void deq_i8_bf16(const int8_t *restrict q, size_t m, float s, uint16_t *restrict x)
{
    for (size_t i = 0; i < m; i++)
        x[i] = bf16_of((float)q[i] * s);
}

static void deq_i4_bf16(const uint8_t *restrict q, size_t m, float s,
                        uint16_t *restrict x)
{
    for (size_t k = 0; k < m / 2; k++) {
        x[2 * k] = bf16_of((float)nibble(q[k]) * s);
        x[2 * k + 1] = bf16_of((float)nibble(q[k] >> 4) * s);
    }
    if (m % 2)
        x[m - 1] = bf16_of((float)nibble(q[m / 2]) * s);
}

static int dequantize(const char *fn, ast_qtype t, size_t count, size_t block, const void *q,
                      size_t qbytes, void *x, int bf16)
{
    ast_quant_layout l;
    int rc = check_io(fn, t, count, block, q, qbytes, x, bf16 ? 2 : 4, &l);
    if (rc || count == 0)
        return rc;
    const unsigned char *in = q;
    if ((rc = check_scales(fn, in, &l)) != 0)
        return rc;
    for (size_t b = 0; b < l.nblocks; b++) {
        size_t m = b + 1 < l.nblocks ? block : count - b * block, at = b * block;
        float s;
        memcpy(&s, in + l.scales_offset + 4 * b, sizeof s);
        if (t == AST_QTYPE_INT8 && !bf16)
            deq_i8_f32((const int8_t *)in + at, m, s, (float *)x + at);
        else if (t == AST_QTYPE_INT8)
            deq_i8_bf16((const int8_t *)in + at, m, s, (uint16_t *)x + at);
        else if (!bf16)
            deq_i4_f32(in + at / 2, m, s, (float *)x + at);
        else
            deq_i4_bf16(in + at / 2, m, s, (uint16_t *)x + at);
    }
    return 0;
}

int ast_quant_dequantize(ast_qtype t, size_t count, size_t block, const void *q, size_t qbytes,
                         float *x)
{
    return dequantize("ast_quant_dequantize", t, count, block, q, qbytes, x, 0);
}

int ast_quant_dequantize_bf16(ast_qtype t, size_t count, size_t block, const void *q,
                              size_t qbytes, uint16_t *x)
{
    return dequantize("ast_quant_dequantize_bf16", t, count, block, q, qbytes, x, 1);
}

/* ---- rectify ----------------------------------------------------------------------------- */

/* G = V^T V (n x n, full): one ssyrk on the upper triangle, mirrored. */
static void gram(int n, const float *v, float *g)
{
    cblas_ssyrk(CblasRowMajor, CblasUpper, CblasTrans, n, n, 1.0f, v, n, 0.0f, g, n);
    for (int i = 1; i < n; i++)
        for (int j = 0; j < i; j++)
            g[(size_t)i * n + j] = g[(size_t)j * n + i];
}

/* ||G - I||_F, accumulated in double. */
static double dist_identity(int n, const float *g)
{
    double acc = 0.0;
    for (int i = 0; i < n; i++)
        for (int j = 0; j < n; j++) {
            double d = (double)g[(size_t)i * n + j] - (i == j);
            acc += d * d;
        }
    return sqrt(acc);
}

int ast_quant_rectify(int batch, int n, float *v, int steps, double *orth_err)
{
    static const char fn[] = "ast_quant_rectify";
    if (batch < 0)
        return fail(AST_EINVAL, "%s: batch %d: must be >= 0", fn, batch);
    if (n < 1)
        return fail(AST_EINVAL, "%s: n %d: must be >= 1", fn, n);
    if (steps < 0 || steps > AST_QUANT_MAX_STEPS)
        return fail(AST_EINVAL, "%s: steps %d: allowed 0..%d", fn, steps, AST_QUANT_MAX_STEPS);
    if (!v)
        return fail(AST_EINVAL, "%s: v is NULL", fn);
    const size_t nn = (size_t)n * (size_t)n;
    if (nn > SIZE_MAX / (3 * sizeof(float)) || (size_t)batch > SIZE_MAX / sizeof(float) / nn)
        return fail(AST_EINVAL, "%s: n %d, batch %d: the matrices' size exceeds a size_t", fn, n,
                    batch);
    if (batch == 0 || (steps == 0 && !orth_err))
        return 0;
    float *ws = malloc(3 * nn * sizeof(float));
    if (!ws)
        return fail(AST_ENOMEM, "%s: no memory for the workspace of n %d (%zu bytes)", fn, n,
                    3 * nn * sizeof(float));
    float *g = ws, *next[2] = {ws + nn, ws + 2 * nn};
    int rc = 0;
    ast_linalg_init();
    for (int i = 0; i < batch && !rc; i++) {
        float *vi = v + (size_t)i * nn;
        double *err = orth_err ? orth_err + (size_t)i * (size_t)(steps + 1) : NULL;
        if (absmax_bits(vi, nn) >= FINITE_LIMIT) {
            rc = fail(AST_ENONFINITE, "%s: matrix %d holds NaN or Inf", fn, i);
            break;
        }
        const float *cur = vi;
        for (int k = 0; k < steps; k++) {
            float *out = next[k % 2];
            gram(n, cur, g);
            if (err)
                err[k] = dist_identity(n, g);
            /* out = 1.5 V - 0.5 V G */
            memcpy(out, cur, nn * sizeof(float));
            cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, n, n, n, -0.5f, cur, n, g, n,
                        1.5f, out, n);
            cur = out;
        }
        if (steps && absmax_bits(cur, nn) >= FINITE_LIMIT) {
            rc = fail(AST_ENONFINITE, "%s: matrix %d: a Bjorck step gave NaN or Inf (its singular "
                      "values are far from 1)", fn, i);
            break;
        }
        if (err) {
            gram(n, cur, g);
            err[steps] = dist_identity(n, g);
        }
        if (steps)
            memcpy(vi, cur, nn * sizeof(float));
    }
    free(ws);
    return rc;
}
