/*
 * errors.c - ast_strerror / ast_err_name / errno translation, generated from AST_ERRNO_MAP.
 * Owns no state; safe from any thread.
 */
#include "asteria/errors.h"

#include <errno.h>

const char *ast_strerror(int code)
{
    switch (code) {
    case AST_OK:
        return "success";
#define AST__ERR_MSG(name, val, msg) \
    case AST_##name:                 \
        return msg;
        AST_ERRNO_MAP(AST__ERR_MSG)
#undef AST__ERR_MSG
    default:
        return "unknown error";
    }
}

const char *ast_err_name(int code)
{
    switch (code) {
    case AST_OK:
        return "AST_OK";
#define AST__ERR_NAME(name, val, msg) \
    case AST_##name:                  \
        return "AST_" #name;
        AST_ERRNO_MAP(AST__ERR_NAME)
#undef AST__ERR_NAME
    default:
        return "AST_EUNKNOWN";
    }
}

int ast_err_from_errno(int err)
{
    switch (err) {
    case 0:
        return AST_OK;
    case ENOMEM:
        return AST_ENOMEM;
    case ENOENT:
    case ENOTDIR:
        return AST_ENOENT;
    case EBUSY:
        return AST_EBUSY;
    case ENOSPC:
    case EDQUOT:
        return AST_ENOSPC;
    case EACCES:
    case EPERM:
    case EROFS:
        return AST_EACCES;
    case EINVAL:
        return AST_EINVAL;
    case EOPNOTSUPP:
        return AST_ENOTSUP;
    case ETIMEDOUT:
        return AST_ETIMEDOUT;
    case ECANCELED:
        return AST_ECANCELED;
    default:
        return AST_EIO;
    }
}
