/* dflash: a Jinja2 template engine for chat templates.
 *
 * Implements the subset of Jinja2 (3.1) that Hugging Face chat templates use, with the
 * environment transformers' apply_chat_template sets up: trim_blocks and lstrip_blocks on,
 * keep_trailing_newline off (a single trailing newline of the template is dropped), newlines
 * normalised to "\n", the loopcontrols extension ({% break %}, {% continue %}) and the
 * {% generation %} tag (its body is rendered as is), an immutable sandbox (no mutating
 * methods), and the globals raise_exception(msg), strftime_now(fmt), namespace(), range(),
 * dict().
 *
 * Supported: {{ }} / {% %} / {# #} with whitespace control (-, +), {% raw %}; if/elif/else;
 * for (with unpacking, an inline `if` filter, else, loop.index/index0/revindex/revindex0/
 * first/last/length/previtem/nextitem/depth/cycle()); set (expression, namespace attribute,
 * tuple unpacking, block form {% set x %}...{% endset %}); macro with default arguments and
 * caller-less calls; expressions with literals (strings with Python escapes, integers,
 * floats, lists, dicts, tuples), subscripts, slices ([::-1], [1:]), attributes, calls,
 * filters, tests, arithmetic (+ - * / // % **), ~, comparisons (chained), in / not in,
 * and / or / not, and conditional expressions (a if c else b).
 * Filters: tojson (transformers' version: separators ", " and ": ", non-ASCII as is,
 * `indent`, `sort_keys`), trim, items, length/count, string, safe, lower, upper, replace,
 * join, first, last, default/d, capitalize, title, int, float, abs, list, reverse, unique,
 * sort, map, select, reject, selectattr, rejectattr, dictsort, min, max, sum, round, wordcount,
 * indent, escape/e. An unknown filter or test is an error when it runs (as in Jinja2,
 * where one inside an untaken branch does not stop the template).
 * Tests: string, mapping, iterable, sequence, number, integer, float, boolean, defined,
 * undefined, none, true, false, callable, even, odd, divisibleby, eq/equalto/==, ne/!=,
 * lt/<, le/<=, gt/>, ge/>=, in, sameas, lower, upper.
 * Methods: str.startswith/endswith/split/rsplit/strip/lstrip/rstrip/upper/lower/title/
 * capitalize/replace/join/find/count/splitlines/isdigit/isalpha/isspace;
 * dict.items/keys/values/get.
 * Values follow Python and Jinja2 semantics: undefined values print as "", are falsy and
 * iterate as empty; using one in arithmetic, as an object or as a function raises Jinja2's
 * UndefinedError message (e.g. "'list object' has no attribute 'startswith'").
 *
 * Known differences: tuples are lists at run time (printing one shows [..] where Python
 * shows (..)); an undefined value put in a list or dict literal becomes none.
 *
 * Not supported (a clear syntax error): extends/block/include/import, call blocks, filter
 * blocks, recursive loops, star arguments (*args, **kwargs).
 *
 * Thread safety: a parsed template is immutable; any number of threads may render it at once.
 */
#ifndef DFLASH_JINJA_H
#define DFLASH_JINJA_H

#include <stddef.h>
#include <stdint.h>

#include <jansson.h>

#include "dflash/status.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct df_jinja_template df_jinja_template;

/* Resource limits for one render (a template is code: a hostile or buggy one must not hang
 * or exhaust the server). Zero fields take the defaults below. */
typedef struct df_jinja_limits {
    size_t max_output;  /* bytes of rendered text, and of any one string built (default 64 MiB) */
    uint64_t max_steps; /* evaluation steps: statements, expression nodes, loop iterations
                           (default 100,000,000; the Qwen3.5 template uses ~50 per message) */
    int max_depth;      /* nested macro calls (default 100) */
} df_jinja_limits;

#define DF_JINJA_DEFAULT_MAX_OUTPUT ((size_t)64 << 20)
#define DF_JINJA_DEFAULT_MAX_STEPS 100000000ull
#define DF_JINJA_DEFAULT_MAX_DEPTH 100

/* Parses a template of len bytes (UTF-8; need not be NUL-terminated).
 * Errors: DF_ERR_FORMAT with "template syntax error at line L, column C: <what>" (line and
 * column are 1-based; the column counts characters), DF_ERR_NOMEM. */
df_status df_jinja_parse(const char *src, size_t len, df_jinja_template **out, df_error *err);

/* Frees a template (NULL is allowed). */
void df_jinja_free(df_jinja_template *t);

/* Renders t with the template variables vars (a JSON object, or NULL for none; it is only
 * read). *out receives a malloc'd NUL-terminated string (caller frees), *out_len its length
 * without the NUL (out_len may be NULL). limits may be NULL for the defaults.
 * Errors:
 *  - raise_exception(msg) in the template: DF_ERR_INVALID_ARG with exactly msg as the message
 *    (the server answers it with HTTP 400);
 *  - any other template runtime error (undefined used as an object, type errors, ...):
 *    DF_ERR_INVALID_ARG with Jinja2's message followed by " (template line L, column C)";
 *  - a limit exceeded: DF_ERR_RANGE; out of memory: DF_ERR_NOMEM.
 * On error *out is NULL. */
df_status df_jinja_render(const df_jinja_template *t, const json_t *vars, const df_jinja_limits *limits,
                          char **out, size_t *out_len, df_error *err);

/* Returns 1 if the template ever inspects or iterates a `content` value as a list (a `for`
 * over an expression ending in `content`, or a type test such as `content is string` on
 * one): such templates take OpenAI content-part lists as they are. 0 otherwise. */
int df_jinja_handles_content_lists(const df_jinja_template *t);

/* Serialises v as Python's json.dumps(v, ensure_ascii=False, indent=indent) does, which is
 * what transformers' `tojson` filter writes: separators ", " and ": " when indent < 0 (no
 * indentation), "," and ": " with newlines and indent spaces per level when indent >= 0;
 * non-ASCII characters kept as is; floats in Python's shortest repr (1.0, 1e-05, 1e+16).
 * sort_keys != 0 sorts object keys by code point. *out is malloc'd and NUL-terminated.
 * Errors: DF_ERR_NOMEM, DF_ERR_RANGE (nesting deeper than 10,000). */
df_status df_jinja_dump_json(const json_t *v, int indent, int sort_keys, char **out, size_t *out_len,
                             df_error *err);

#ifdef __cplusplus
}
#endif
#endif
