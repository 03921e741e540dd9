/*
 * util.h - helpers every module of libasteria shares, once: the monotonic clock, the formatting
 * of error messages (a plain buffer, a handle's last-error text, a batch's first failure), and
 * one hash table. Internal: nothing here is declared in include/asteria/ or exported by
 * src/asteria.map (the ast__ prefix marks library internals).
 *
 * No state of its own: a last-error text, a batch's failure record and a hash table are plain
 * values guarded by whatever guards their owner; ast__set_error takes the owner's mutex only
 * when the caller passes it.
 */
#ifndef ASTERIA_UTIL_H
#define ASTERIA_UTIL_H

#include <pthread.h>
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
/* The same, prefixed with the code's symbolic name ("AST_EINVAL: ..."): the form of a named
 * last-error text (below). The caller holds the lock that guards buf. */
int ast__verrorf_named(char *buf, size_t len, int code, const char *fmt, va_list ap)
    __attribute__((format(printf, 4, 0)));

/* A handle's last-error text, which its ast_*_last_error copies out; the handle's mutex guards
 * it. named (set at creation): every text starts with the code's symbolic name, the form the
 * runtime, the shadow and the trace recorder keep; the store and the coherence registry keep
 * the bare message (tests and callers read both forms). */
#define AST__LAST_ERROR_BYTES 1024
typedef struct ast__last_error {
    int named;
    char text[AST__LAST_ERROR_BYTES];
} ast__last_error;

/* Sets e's text and returns code: `return ast__set_error(&s->err, NULL, AST_EINVAL, ...);`.
 * mu: the mutex that guards e, taken around the write; NULL when the caller holds it. */
int ast__set_error(ast__last_error *e, pthread_mutex_t *mu, int code, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
/* Copies e's text into buf (truncated to len): the one body of every ast_*_last_error.
 * mu: the mutex that guards e, taken around the read; NULL when the caller holds it.
 * Returns 0; AST_EINVAL for a NULL buf or len 0. */
int ast__get_error(ast__last_error *e, pthread_mutex_t *mu, char *buf, size_t len);

/* The first failure of a batch whose items (the blocks of a store move, the records of an NVMe
 * batch) succeed or fail on their own: the batch goes on past a failed item and reports the
 * failure at the lowest position, whatever order the items failed in, and how many failed. */
#define AST__BATCH_MSG_BYTES 512
typedef struct ast__batch_err {
    size_t idx;    /* position of the reported failure; SIZE_MAX: none yet */
    int code;      /* its code; 0: none yet */
    size_t failed; /* failures counted */
    char msg[AST__BATCH_MSG_BYTES];
} ast__batch_err;

/* No failure yet. */
void ast__batch_err_init(ast__batch_err *e);
/* Counts a failure of the item at idx and returns code. Its code and formatted message become
 * the batch's when idx is below every earlier failure's. item (may be NULL) is the item's own
 * code: an item that has failed already keeps its first cause (the call is ignored), else it is
 * set to code. */
int ast__batch_fail(ast__batch_err *e, size_t idx, int *item, int code, const char *fmt, ...)
    __attribute__((format(printf, 5, 6)));

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

/* The murmur3 finaliser: every bit of x reaches every bit of the result, so consecutive keys
 * (tickets, block ids) spread over every bucket; also the step of a hash over a longer key. */
uint64_t ast__mix64(uint64_t x);
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
/* Every linked node, bucket by bucket: first, then after(x) until NULL. x may be freed once
 * after(x) has returned; ast__htable_clear or ast__htable_free must then follow before the
 * table is used again. */
ast__hnode *ast__htable_first(const ast__htable *t);
ast__hnode *ast__htable_after(const ast__htable *t, const ast__hnode *x);
/* Unlinks every node; the buckets stay allocated. */
void ast__htable_clear(ast__htable *t);
/* Frees the buckets (the nodes belong to their owners) and leaves an empty table. */
void ast__htable_free(ast__htable *t);

#endif
