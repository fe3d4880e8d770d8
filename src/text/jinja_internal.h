/* Internal interface of the Jinja2 engine (lexer, parser, evaluator) and small text
 * utilities shared with the chat module. Not a public API. */
#ifndef DF_TEXT_JINJA_INTERNAL_H
#define DF_TEXT_JINJA_INTERNAL_H

#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include "dflash/jinja.h"

/* ---- growable byte buffer ------------------------------------------------------------- */

/* A NUL-terminated growable string. Zero-initialise; jbuf_free releases. Functions return 0
 * on success and -1 when memory runs out or the length would pass `limit` (when nonzero). */
typedef struct jbuf {
    char *p;
    size_t n, cap;
    size_t limit;  /* 0 = none */
    int over_limit; /* 1 once an append was refused for the limit (not for memory) */
} jbuf;

int jbuf_put(jbuf *b, const char *s, size_t n);
int jbuf_putc(jbuf *b, char c);
int jbuf_puts(jbuf *b, const char *s);
int jbuf_printf(jbuf *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
void jbuf_free(jbuf *b);
/* Hands the buffer's string to the caller (never NULL when ok) and resets b. */
char *jbuf_take(jbuf *b, size_t *len);

/* ---- arena ---------------------------------------------------------------------------- */

typedef struct jarena_chunk jarena_chunk;
typedef struct jarena {
    jarena_chunk *head;
} jarena;

/* Zeroed memory that lives until jarena_free; NULL when memory runs out. */
void *jarena_alloc(jarena *a, size_t n);
char *jarena_strndup(jarena *a, const char *s, size_t n);
void jarena_free(jarena *a);

/* ---- UTF-8 and Python formatting helpers ---------------------------------------------- */

/* Number of code points in s[0..n) (continuation bytes are not counted). */
size_t ju8_len(const char *s, size_t n);
/* Byte offset of code point index i in s[0..n) (n when i is past the end). */
size_t ju8_offset(const char *s, size_t n, size_t i);
/* Decodes one code point at s (n bytes available); sets *adv to its byte length (>= 1).
 * Invalid bytes decode as themselves with length 1. */
int32_t ju8_decode(const char *s, size_t n, size_t *adv);
/* Appends code point c as UTF-8. */
int ju8_put(jbuf *b, int32_t c);
/* Offset of the first byte of s[0..n) that is not part of valid UTF-8 (n when all valid;
 * overlong forms, surrogates and values past U+10FFFF are invalid). */
size_t ju8_invalid_at(const char *s, size_t n);
/* Appends s with every invalid byte replaced by U+FFFD. */
int ju8_sanitize(jbuf *b, const char *s, size_t n);
/* 1 for the ASCII whitespace Python's str.strip() removes (space, \t, \n, \r, \v, \f). */
int ju_isspace(int c);

/* Python's repr() of a float (shortest round-trip: "1.0", "0.1", "1e-05", "1e+16", "inf",
 * "nan"). buf must hold 32 bytes. */
void jpy_float_repr(double d, char *buf);
/* Python's repr() of a string ('...' or "..."). */
int jpy_str_repr(jbuf *b, const char *s, size_t n);
/* Options of Python's json.dumps. */
typedef struct jpy_json_opts {
    int indent;           /* < 0: None (one line) */
    int sort_keys;
    int ensure_ascii;     /* escape non-ASCII as \uXXXX */
    const char *item_sep; /* NULL: ", " without indent, "," with */
    const char *key_sep;  /* NULL: ": " */
} jpy_json_opts;
/* json.dumps of v appended to b. Returns 0, -1 (memory or b's limit), -2 (too deep). */
int jpy_dump_json(jbuf *b, const json_t *v, const jpy_json_opts *o, int depth);

#endif
