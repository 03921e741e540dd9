/*
 * asteria/quant.h - orthogonal matrices (eigenbases) block-quantized to 8 or 4 bits for the
 * tiers outside the device, and the Bjorck rectification that makes a widened basis orthogonal
 * again ("4-bit Shampoo", Wang et al., NeurIPS 2024).
 *
 * Owns: the quantized format (below), its quantize / dequantize kernels and the rectify kernel.
 * An eigenbasis's entries are bounded by 1 and its error can be pulled back (rectify), which is
 * what makes 8 and 4 bits enough for it; eigenvalues and small matrices stay float32.
 *
 * The format of `count` float32 values x quantized with block size B:
 *  - The values are cut into nblocks = ceil(count / B) consecutive blocks of B (the last one
 *    holds what is left). B is even (an int4 block starts on a byte), 2 <= B <=
 *    AST_QUANT_BLOCK_MAX; AST_QUANT_BLOCK_DEFAULT is 64 (4-bit Shampoo's).
 *  - Per block b: the scale s_b = absmax_b / qmax (a float32 division; qmax 127 for int8, 7 for
 *    int4: symmetric, -qmax..qmax, the code -qmax-1 is never written) and the codes
 *      q_i = clamp(round_half_even(x_i / s_b), -qmax, qmax)   (float32 division)
 *    with q_i = 0 in a block whose s_b is 0 (every |x_i| <= qmax * 2^-150 there).
 *  - Widened: x'_i = (float)q_i * s_b (one float32 multiply); to bfloat16, that product rounded
 *    to nearest even. So |x_i - x'_i| <= s_b / 2 up to the two roundings (a relative 2^-24 of
 *    s_b / 2 in the division, half an ulp of x'_i in the multiply), the format's step being
 *    s_b = absmax_b / qmax.
 *  - Layout, ast_quant_layout_get's fields: bytes [0, value_bytes) the codes: int8 one byte
 *    each (two's complement); int4 two a byte, value 2k in the low nibble and value 2k + 1 in
 *    the high one, each nibble two's complement (-7..7), the high nibble after an odd count's
 *    last value 0. Then zeros up to scales_offset (value_bytes rounded up to 4, so that the
 *    scales are float32-aligned wherever the buffer is), then the nblocks float32 scales in the
 *    host's byte order: nbytes = scales_offset + 4 nblocks. Values first, scales last: each
 *    part is one contiguous array a device kernel reads as it is.
 * Quantize and dequantize are exact functions of their input: asteria.tiers.quant's torch
 * kernels give the same bytes and the same widened values bit for bit (tests/python/
 * test_quant.py).
 *
 * Rectify (Bjorck, the Newton-Schulz iteration of the polar factor): V <- 1.5 V - 0.5 V (V^T V),
 * in float32, one cblas_ssyrk (V^T V) and one cblas_sgemm per step. With A = V^T V - I one step
 * gives A' = -(3/4) A^2 + (1/4) A^3, so ||A'||_F <= (3/4 + ||A||_2 / 4) ||A||_2 ||A||_F:
 * quadratic convergence while the singular values of V are in (0, sqrt 3).
 *
 * Errors: every call returns 0 or a negative AST_E* code (asteria/errors.h); a failed call
 * writes no output and leaves a message that names the argument and what is allowed, which
 * ast_quant_last_error() reads on the same thread.
 *
 * Threading: no shared mutable state (the last-error message is per thread); any thread may
 * call any function. Rectify keeps OpenBLAS at one thread per call (ast_linalg_init).
 */
#ifndef ASTERIA_QUANT_H
#define ASTERIA_QUANT_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* What a block of bytes holds. AST_QTYPE_NONE: raw bytes (a store block, a float32 basis). */
typedef enum ast_qtype { AST_QTYPE_NONE = 0, AST_QTYPE_INT8 = 1, AST_QTYPE_INT4 = 2 } ast_qtype;

#define AST_QUANT_BLOCK_DEFAULT 64
#define AST_QUANT_BLOCK_MAX 65536
#define AST_QUANT_MAX_STEPS 16 /* Bjorck steps a rectify call takes at most */

/* Returns "none", "int8" or "int4"; NULL for an unknown type. */
const char *ast_qtype_name(ast_qtype t);
/* Parses a name of ast_qtype_name into *out. Returns 0; AST_EINVAL for an unknown name or NULL
 * arguments. */
int ast_qtype_parse(const char *name, ast_qtype *out);

/* Where the parts of a quantized form lie (the format above). */
typedef struct ast_quant_layout {
    size_t count;         /* values */
    size_t block;         /* values per scale */
    size_t nblocks;       /* scales: ceil(count / block) */
    size_t value_bytes;   /* the codes: count (int8) or ceil(count / 2) (int4) */
    size_t scales_offset; /* the first scale: value_bytes rounded up to 4 */
    size_t nbytes;        /* the whole form: scales_offset + 4 nblocks */
} ast_quant_layout;

/* The layout of count values of type t (AST_QTYPE_INT8 or AST_QTYPE_INT4) in blocks of block.
 * count 0 is allowed (every size 0). RETURN VALUE: 0; AST_EINVAL (an unknown or NONE type, a
 * block out of range or odd, a size beyond a size_t, out NULL). */
int ast_quant_layout_get(ast_qtype t, size_t count, size_t block, ast_quant_layout *out);

/* Quantizes the count float32 values x into q, qbytes bytes (exactly the layout's nbytes).
 * Padding bytes are written (zero), so equal inputs give equal bytes. x and q must not overlap.
 * RETURN VALUE: 0; AST_EINVAL (as ast_quant_layout_get; x or q NULL with count > 0, qbytes not
 * nbytes, overlapping buffers); AST_ENONFINITE (NaN or Inf in x: q untouched). */
int ast_quant_quantize(ast_qtype t, size_t count, size_t block, const float *x, void *q,
                       size_t qbytes);

/* Widens q (qbytes bytes, exactly the layout's nbytes) into count float32 values (x) or
 * bfloat16 values (x, as their 16-bit patterns). A scale that is not finite or negative means
 * the bytes are not a quantized form. RETURN VALUE (both): 0; AST_EINVAL (as
 * ast_quant_layout_get; q or x NULL with count > 0, qbytes not nbytes, overlapping buffers, a
 * scale negative or not finite: x untouched). */
int ast_quant_dequantize(ast_qtype t, size_t count, size_t block, const void *q, size_t qbytes,
                         float *x);
int ast_quant_dequantize_bf16(ast_qtype t, size_t count, size_t block, const void *q,
                              size_t qbytes, uint16_t *x);

/* steps Bjorck steps V <- 1.5 V - 0.5 V (V^T V) on each of batch n x n float32 matrices (row-
 * major, contiguous), in place. orth_err (may be NULL) receives batch * (steps + 1) values:
 * for matrix i, ||V^T V - I||_F before each step and after the last (orth_err[i*(steps+1)+k]);
 * the last costs one more ssyrk, done only when orth_err is given. steps 0 with orth_err
 * measures and writes nothing else. Workspace: 3 n^2 floats. A matrix is written only once its
 * result is finite; the batch stops at the first failure (matrices before it are written).
 * RETURN VALUE: 0; AST_EINVAL (batch < 0, n < 1 or n^2 beyond a size_t, v NULL, steps outside
 * 0..AST_QUANT_MAX_STEPS); AST_ENOMEM; AST_ENONFINITE (NaN/Inf in V or in a step's result:
 * that matrix untouched). */
int ast_quant_rectify(int batch, int n, float *v, int steps, double *orth_err);

/* Copies the message of this thread's most recent failed ast_quant_* / ast_qtype_parse call
 * into buf (truncated to len; "" when none failed). Returns 0; AST_EINVAL for a NULL buf or len
 * 0. */
int ast_quant_last_error(char *buf, size_t len);

#ifdef __cplusplus
}
#endif
#endif
