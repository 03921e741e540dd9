/*
 * util.h - helpers every module of libasteria shares, once: the monotonic clock, the formatting
 * of error messages, and one hash table. Internal: nothing here is declared in include/asteria/
 * or exported by src/asteria.map (the ast__ prefix marks library internals).
 *
 * No state and no locks: the hash table is a plain value guarded by whatever guards its owner.
 */
#ifndef ASTERIA_UTIL_H
#define ASTERIA_UTIL_H

#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

/* ---- clock ---------------------------------------------------------------------------------- */

/* CLOCK_MONOTONIC in nanoseconds: the time base of every stamp the library records (job queued /
 * started / done, barrier waits, trace events). */
uint64_t ast__now_ns(void);

/* ---- error messages ------------------------------------------------------------------------- */

/* Formats a message into buf (nothing when buf is NULL or len is 0; truncated to len) and
 * returns code, so that an error path is one statement:
 *   return ast__errorf(err, len, AST_EINVAL, "key '%s': ...", key); */
int ast__errorf(char *buf, size_t len, int code, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
int ast__verrorf(char *buf, size_t len, int code, const char *fmt, va_list ap)
    __attribute__((format(printf, 4, 0)));
/* The same, prefixed with the code's symbolic name ("AST_EINVAL: ..."): the form of the
 * last-error text a handle keeps (runtime, shadow, trace). The caller holds the lock that guards
 * buf. */
int ast__verrorf_named(char *buf, size_t len, int code, const char *fmt, va_list ap)
    __attribute__((format(printf, 4, 0)));

/* ---- hash table ----------------------------------------------------------------------------- */

/* A chained hash table over intrusive nodes keyed by a uint64_t: the node lives inside the
 * owner's record (find it back with AST__CONTAINER_OF), so the table allocates only its bucket
 * array, and an insert after ast__htable_reserve cannot fail. Keys may repeat (walk them with
 * ast__htable_next), so a hash of a longer key (a string) can be the key. A record that moves in
 * memory (realloc, qsort) must be re-linked: ast__htable_clear, then insert each again. */
typedef struct ast__hnode {
    struct ast__hnode *next;
    uint64_t key;
} ast__hnode;

typedef struct ast__htable {
    ast__hnode **b;
    size_t nb; /* buckets: a power of two, or 0 */
    size_t n;  /* linked nodes */
} ast__htable;

#define AST__CONTAINER_OF(ptr, type, member) \
    ((type *)(void *)((char *)(ptr) - offsetof(type, member)))

/* Grows the bucket array to hold want nodes at load factor <= 1 (existing nodes are re-linked).
 * Returns 0 on success (also when it is large enough already); AST_ENOMEM, table unchanged. */
int ast__htable_reserve(ast__htable *t, size_t want);
/* Links x (x->key set by the caller). Room must have been reserved: n + 1 <= nb. */
void ast__htable_insert(ast__htable *t, ast__hnode *x);
/* Returns the first node with key, or NULL. */
ast__hnode *ast__htable_find(const ast__htable *t, uint64_t key);
/* Returns the next node after x with x's key, or NULL. */
ast__hnode *ast__htable_next(const ast__hnode *x);
/* Unlinks x, which must be linked in t. */
void ast__htable_remove(ast__htable *t, ast__hnode *x);
/* Unlinks every node; the buckets stay allocated. */
void ast__htable_clear(ast__htable *t);
/* Frees the buckets (the nodes belong to their owners) and leaves an empty table. */
void ast__htable_free(ast__htable *t);

#endif
