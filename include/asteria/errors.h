/*
 * asteria/errors.h - the one error table of libasteria.
 *
 * Owns: the AST_E* codes, ast_strerror(), ast_err_name().
 * Every libasteria function that can fail returns int: 0 on success or a negative AST_E* code.
 * Codes are generated from one X-macro table (the libuv model), so the enum, the names and the
 * messages can never drift apart. No state, no locks: safe from any thread.
 */
#ifndef ASTERIA_ERRORS_H
#define ASTERIA_ERRORS_H

#ifdef __cplusplus
extern "C" {
#endif

/* X(NAME, value, message) */
#define AST_ERRNO_MAP(X)                                                                   \
    X(EINVAL, -1, "invalid argument")                                                     \
    X(ENOMEM, -2, "out of memory")                                                        \
    X(ENOENT, -3, "no such job, block or file")                                           \
    X(EBUSY, -4, "resource busy (job already running)")                                   \
    X(ECANCELED, -5, "job cancelled")                                                     \
    X(ESUPERSEDED, -6, "job superseded by a newer snapshot of the same block")            \
    X(ENOCONV, -7, "linear algebra did not converge")                                     \
    X(ENONFINITE, -8, "non-finite value (NaN or Inf) in input or result")                 \
    X(EIO, -9, "input/output error")                                                      \
    X(ENOSPC, -10, "no space left on the NVMe tier device")                               \
    X(ECORRUPT, -11, "record checksum mismatch (corrupted or torn record)")               \
    X(EFOREIGN, -12, "record does not belong to this store")                              \
    X(ENOTSUP, -13, "operation not supported by this build or filesystem")                \
    X(EACCES, -14, "permission denied (directory missing, read-only or not accessible)")  \
    X(ETIMEDOUT, -15, "timed out")                                                        \
    X(ESHUTDOWN, -16, "runtime or pool is shutting down")                                 \
    X(ENODEV, -17, "no CUDA device present")                                              \
    X(EFAILED, -18, "block refresh failed; its previous result is kept")                  \
    X(ESTATE, -19, "operation not valid in the current state")                            \
    X(ECUDA, -20, "CUDA runtime error")                                                   \
    X(ERANGE, -21, "buffer range outside every registered host buffer")                   \
    X(EINTR, -22, "wait interrupted (its check callback asked it to stop)")

typedef enum ast_errno {
    AST_OK = 0,
#define AST__ERR_ENUM(name, val, msg) AST_##name = (val),
    AST_ERRNO_MAP(AST__ERR_ENUM)
#undef AST__ERR_ENUM
    AST__ERR_MIN = -23
} ast_errno;

/* Returns the human-readable message for a code (a static string); never NULL ("unknown error"
 * for foreign codes). */
const char *ast_strerror(int code);
/* Returns the symbolic name ("AST_ENOSPC", a static string); never NULL ("AST_EUNKNOWN" for
 * foreign codes). */
const char *ast_err_name(int code);
/* Returns the AST_E* code closest to a positive errno value (AST_EIO when none is closer). */
int ast_err_from_errno(int err);

#ifdef __cplusplus
}
#endif
#endif
