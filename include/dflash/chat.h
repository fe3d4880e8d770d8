/* dflash: chat prompts and chat output.
 *
 * 1. Prompt rendering: an OpenAI chat-completions request body (messages, tools,
 *    enable_thinking, chat_template_kwargs, add_generation_prompt) is turned into the
 *    template variables transformers' apply_chat_template would pass, and rendered with the
 *    pack's own Jinja chat template (dflash/jinja.h).
 * 2. Output parsing: the model's text is split into reasoning (`<think>…</think>`), content
 *    and tool calls (`<tool_call>` blocks in the Qwen3.5 XML form or the Qwen3 JSON form),
 *    incrementally (for streaming) or at once. The incremental parser may be fed any split of
 *    the text (even mid-tag or mid-UTF-8 character); the deltas it emits, concatenated, are
 *    exactly the non-streamed result.
 */
#ifndef DFLASH_CHAT_H
#define DFLASH_CHAT_H

#include <stddef.h>
#include <stdint.h>

#include <jansson.h>

#include "dflash/jinja.h"
#include "dflash/status.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ==== prompt rendering ================================================================== */

typedef struct df_chat_template df_chat_template;

/* Parses a chat template (Jinja source of len bytes). Errors as df_jinja_parse. */
df_status df_chat_template_parse(const char *src, size_t len, df_chat_template **out, df_error *err);

/* Reads a pack's chat template text: PACK/chat_template.jinja if present, else the
 * "chat_template" key of PACK/chat_template.json, else that of PACK/tokenizer_config.json (a
 * string, or a list of {"name", "template"} from which "default" is taken). *text is malloc'd
 * and NUL-terminated; no template (none of these files, or a tokenizer_config.json without the
 * key) is DF_OK with *text NULL. A file that is there but cannot be read (a FIFO, a folder, a
 * link loop) is an error, never taken for an absent one. Errors: DF_ERR_IO (a file that cannot
 * be read), DF_ERR_FORMAT (bad JSON, a chat_template.json without a template, a key of the
 * wrong type, an empty chat_template.jinja), DF_ERR_NOMEM. Messages name the file. */
df_status df_chat_template_read(const char *pack_dir, char **text, size_t *len, df_error *err);

/* df_chat_template_read + df_chat_template_parse; no template is DF_ERR_IO. */
df_status df_chat_template_load(const char *pack_dir, df_chat_template **out, df_error *err);

void df_chat_template_free(df_chat_template *t);

/* The parsed Jinja template inside (owned by t). */
const df_jinja_template *df_chat_template_jinja(const df_chat_template *t);

/* 1 when the template takes OpenAI content-part lists as they are (see
 * df_jinja_handles_content_lists). */
int df_chat_template_handles_content_lists(const df_chat_template *t);

typedef struct df_chat_render_options {
    /* Value of enable_thinking when the request gives none (neither top-level nor in
     * chat_template_kwargs): -1 leaves it undefined (the template's default), 0 false, 1 true. */
    int default_enable_thinking;
    /* Further template variables of lowest precedence (e.g. bos_token, eos_token), or NULL. */
    const json_t *extra_vars;
    /* Render limits, or NULL for the defaults. */
    const df_jinja_limits *limits;
} df_chat_render_options;

/* A rendered prompt. */
typedef struct df_chat_prompt {
    char *text; /* malloc'd, NUL-terminated */
    size_t len;
    /* 1 when the prompt ends with an open `<think>` (Qwen3.5's generation prompt with thinking
     * on): the model's output starts inside its reasoning. Pass it to the output parser. */
    int thinking_open;
} df_chat_prompt;

/* Renders the prompt of an OpenAI chat-completions request body.
 *
 * Template variables: messages (normalised, below), tools (when present and not null),
 * add_generation_prompt (the request's, default true), enable_thinking (request top-level,
 * else chat_template_kwargs.enable_thinking, else opt->default_enable_thinking), every other
 * chat_template_kwargs entry, and opt->extra_vars.
 * Messages are normalised as vLLM and transformers users expect:
 *  - content given as a list of parts is passed as is when the template handles lists;
 *    otherwise a list of text parts only becomes the concatenation of their texts (other
 *    lists are passed as is, and the template decides, as transformers would); a null or
 *    missing content becomes "" for such a template (as vLLM does);
 *  - an assistant tool call's function.arguments given as a JSON string holding an object
 *    is parsed into that object (templates iterate or tojson it).
 * opt may be NULL (enable_thinking left to the template).
 * Errors: DF_ERR_INVALID_ARG for a malformed request, naming the field ("messages[1].role:
 * expected a string"), for an empty conversation ("Cannot apply chat template to an empty
 * conversation. Provide at least one message."), for chat_template_kwargs that try to set
 * messages, tools or add_generation_prompt, and for template errors (raise_exception messages
 * as they are; see df_jinja_render); DF_ERR_RANGE, DF_ERR_NOMEM as df_jinja_render.
 * On success fill *out (free with df_chat_prompt_free). */
df_status df_chat_render(const df_chat_template *t, const json_t *request, const df_chat_render_options *opt,
                         df_chat_prompt *out, df_error *err);

void df_chat_prompt_free(df_chat_prompt *p);

/* The first template variable that a request's own fields set (messages, tools,
 * add_generation_prompt) and that kwargs (a request's chat_template_kwargs object) names, or
 * NULL (also when kwargs is not an object). df_chat_render refuses such kwargs; request
 * validators use it to name the field. */
const char *df_chat_kwargs_reserved(const json_t *kwargs);

/* ==== output parsing ==================================================================== */

typedef struct df_chat_parse_options {
    /* The output starts inside `<think>` (df_chat_prompt.thinking_open). Otherwise a `<think>`
     * at the very start of the output (after whitespace) opens the reasoning. */
    int thinking_open;
    /* Parse `<tool_call>` blocks (set when the request offers tools and tool_choice is not
     * "none"); 0 leaves them in the content. */
    int parse_tool_calls;
    /* The request's tools (OpenAI format) or NULL: an XML parameter's value is converted by
     * the JSON-schema type of that parameter (integer, number, boolean, null, object, array;
     * also a list of types) and kept as a string otherwise or when it does not parse. */
    const json_t *tools;
    /* Tool call ids are "call_" + 24 hex digits derived from this seed and the call's index. */
    uint64_t id_seed;
} df_chat_parse_options;

typedef enum df_chat_delta_kind {
    DF_CHAT_DELTA_REASONING,  /* text: more reasoning_content */
    DF_CHAT_DELTA_CONTENT,    /* text: more content */
    DF_CHAT_DELTA_TOOL_START, /* tool_index, id, name: a new tool call */
    DF_CHAT_DELTA_TOOL_ARGS   /* tool_index, text: more of that call's arguments (a JSON text) */
} df_chat_delta_kind;

typedef struct df_chat_delta {
    df_chat_delta_kind kind;
    int tool_index; /* 0, 1, ... in order of the calls */
    char *text;     /* NUL-terminated; REASONING, CONTENT, TOOL_ARGS (else NULL) */
    size_t len;
    char *id;   /* TOOL_START */
    char *name; /* TOOL_START */
} df_chat_delta;

/* A list of deltas, owned by the caller (zero-initialise). */
typedef struct df_chat_deltas {
    df_chat_delta *items;
    size_t n, cap;
} df_chat_deltas;

/* Frees the deltas' strings and empties the list (keeps its storage for reuse). */
void df_chat_deltas_reset(df_chat_deltas *d);
/* Frees everything. */
void df_chat_deltas_free(df_chat_deltas *d);

typedef struct df_chat_parser df_chat_parser;

/* A parser for one output. opt is copied (tools are referenced, not copied: keep them alive
 * while the parser is). Errors: DF_ERR_NOMEM. */
df_status df_chat_parser_new(const df_chat_parse_options *opt, df_chat_parser **out, df_error *err);

/* Feeds the next len bytes of output and appends the deltas that are now certain to *out.
 * Text that could still be the start of a tag, a tool call that has not closed yet,
 * whitespace whose fate depends on what follows, and an unfinished UTF-8 character are held
 * back. A tool call is emitted (TOOL_START then TOOL_ARGS with the complete arguments) when
 * its `</tool_call>` arrives and it parses; a malformed or unterminated one becomes content,
 * character for character. Whitespace at the start and end of the reasoning and content,
 * and around tool calls, is dropped. Errors: DF_ERR_NOMEM only. */
df_status df_chat_parser_feed(df_chat_parser *p, const char *text, size_t len, df_chat_deltas *out, df_error *err);

/* Ends the output: flushes what was held back (an unterminated tool call as content).
 * Further feeds are ignored. Errors: DF_ERR_NOMEM only. */
df_status df_chat_parser_finish(df_chat_parser *p, df_chat_deltas *out, df_error *err);

/* Number of tool calls emitted so far (for finish_reason "tool_calls"). */
int df_chat_parser_tool_calls(const df_chat_parser *p);

void df_chat_parser_free(df_chat_parser *p);

typedef struct df_chat_tool_call {
    char *id;
    char *name;
    char *arguments; /* a JSON text (an object), as OpenAI's function.arguments */
} df_chat_tool_call;

/* A parsed assistant message. Zero-initialise; free with df_chat_message_free. */
typedef struct df_chat_message {
    char *reasoning; /* NUL-terminated, "" when none */
    size_t reasoning_len;
    char *content;
    size_t content_len;
    df_chat_tool_call *tool_calls;
    size_t n_tool_calls;
} df_chat_message;

/* Appends deltas to m (reasoning and content concatenated, tool calls started and their
 * arguments concatenated): applying every delta of a stream gives df_chat_parse's result.
 * Errors: DF_ERR_NOMEM, DF_ERR_INVALID_ARG (a delta for a tool call that was not started). */
df_status df_chat_message_apply(df_chat_message *m, const df_chat_deltas *d, df_error *err);

/* Parses a whole output: a parser fed text at once, then finished, its deltas applied.
 * *out is overwritten (free with df_chat_message_free). */
df_status df_chat_parse(const char *text, size_t len, const df_chat_parse_options *opt, df_chat_message *out,
                        df_error *err);

void df_chat_message_free(df_chat_message *m);

/* The OpenAI assistant message: {"role": "assistant", "content": ..., "reasoning_content":
 * ... (only when not empty), "tool_calls": [{"id", "type": "function", "function": {"name",
 * "arguments"}}] (only when there are calls)}; content is null when empty and there are tool
 * calls. NULL when memory runs out or a text is not valid UTF-8 (the server's detokenizer
 * never produces invalid UTF-8). */
json_t *df_chat_message_to_json(const df_chat_message *m);

#ifdef __cplusplus
}
#endif
#endif
