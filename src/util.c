/*
 * util.c - the shared internals of util.h: clock, error messages, hash table.
 * May call: libc, pthreads and ast_err_name (errors.h). No state; the only lock taken is the
 * one a caller hands to ast__set_error.
 */
#include "util.h"

#include "asteria/errors.h"

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

uint64_t ast__now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

int ast__verrorf(char *buf, size_t len, int code, const char *fmt, va_list ap)
{
    if (buf && len)
        vsnprintf(buf, len, fmt, ap);
    return code;
}

int ast__errorf(char *buf, size_t len, int code, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    ast__verrorf(buf, len, code, fmt, ap);
    va_end(ap);
    return code;
}

int ast__verrorf_named(char *buf, size_t len, int code, const char *fmt, va_list ap)
{
    if (!buf || !len)
        return code;
    int n = snprintf(buf, len, "%s: ", ast_err_name(code));
    if (n >= 0 && (size_t)n < len)
        vsnprintf(buf + n, len - (size_t)n, fmt, ap);
    return code;
}

int ast__set_error(ast__last_error *e, pthread_mutex_t *mu, int code, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    if (mu)
        pthread_mutex_lock(mu);
    if (e->named)
        ast__verrorf_named(e->text, sizeof e->text, code, fmt, ap);
    else
        ast__verrorf(e->text, sizeof e->text, code, fmt, ap);
    if (mu)
        pthread_mutex_unlock(mu);
    va_end(ap);
    return code;
}

int ast__get_error(ast__last_error *e, pthread_mutex_t *mu, char *buf, size_t len)
{
    if (!buf || !len)
        return AST_EINVAL;
    if (mu)
        pthread_mutex_lock(mu);
    snprintf(buf, len, "%s", e->text);
    if (mu)
        pthread_mutex_unlock(mu);
    return 0;
}

void ast__batch_err_init(ast__batch_err *e)
{
    e->idx = SIZE_MAX;
    e->code = 0;
    e->failed = 0;
    e->msg[0] = '\0';
}

int ast__batch_fail(ast__batch_err *e, size_t idx, int *item, int code, const char *fmt, ...)
{
    if (item) {
        if (*item)
            return code;
        *item = code;
    }
    e->failed++;
    if (idx >= e->idx)
        return code;
    e->idx = idx;
    e->code = code;
    va_list ap;
    va_start(ap, fmt);
    ast__verrorf(e->msg, sizeof e->msg, code, fmt, ap);
    va_end(ap);
    return code;
}

/* ---- hash table ------------------------------------------------------------------------------ */

uint64_t ast__mix64(uint64_t x)
{
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdULL;
    x ^= x >> 33;
    x *= 0xc4ceb9fe1a85ec53ULL;
    x ^= x >> 33;
    return x;
}

static size_t slot(const ast__htable *t, uint64_t key)
{
    return (size_t)ast__mix64(key) & (t->nb - 1);
}

int ast__htable_reserve(ast__htable *t, size_t want)
{
    if (want <= t->nb)
        return 0;
    size_t nb = t->nb ? t->nb : 64;
    while (nb < want)
        nb *= 2;
    ast__hnode **b = calloc(nb, sizeof *b);
    if (!b)
        return AST_ENOMEM;
    ast__htable old = *t;
    t->b = b;
    t->nb = nb;
    for (size_t i = 0; i < old.nb; i++) {
        ast__hnode *x = old.b[i];
        while (x) {
            ast__hnode *next = x->next;
            size_t s = slot(t, x->key);
            x->next = t->b[s];
            t->b[s] = x;
            x = next;
        }
    }
    free(old.b);
    return 0;
}

void ast__htable_insert(ast__htable *t, ast__hnode *x)
{
    size_t s = slot(t, x->key);
    x->next = t->b[s];
    t->b[s] = x;
    t->n++;
}

ast__hnode *ast__htable_find(const ast__htable *t, uint64_t key)
{
    if (!t->nb)
        return NULL;
    for (ast__hnode *x = t->b[slot(t, key)]; x; x = x->next)
        if (x->key == key)
            return x;
    return NULL;
}

ast__hnode *ast__htable_next(const ast__hnode *x)
{
    for (ast__hnode *y = x->next; y; y = y->next)
        if (y->key == x->key)
            return y;
    return NULL;
}

void ast__htable_remove(ast__htable *t, ast__hnode *x)
{
    ast__hnode **p = &t->b[slot(t, x->key)];
    while (*p != x)
        p = &(*p)->next;
    *p = x->next;
    t->n--;
}

static ast__hnode *first_from(const ast__htable *t, size_t i)
{
    for (; i < t->nb; i++)
        if (t->b[i])
            return t->b[i];
    return NULL;
}

ast__hnode *ast__htable_first(const ast__htable *t)
{
    return first_from(t, 0);
}

ast__hnode *ast__htable_after(const ast__htable *t, const ast__hnode *x)
{
    return x->next ? x->next : first_from(t, slot(t, x->key) + 1);
}

void ast__htable_clear(ast__htable *t)
{
    if (t->nb)
        memset(t->b, 0, t->nb * sizeof *t->b);
    t->n = 0;
}

void ast__htable_free(ast__htable *t)
{
    free(t->b);
    memset(t, 0, sizeof *t);
}
