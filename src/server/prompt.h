/* dflash server: chat prompts — the pack's template (or a built-in ChatML one), tool_choice,
 * and tokenization that treats every string of the request as untrusted text.
 *
 * Shared by the server and the command line (`dflash render`, `dflash generate --messages`),
 * so both send the model the same tokens for the same request. Private to src/server and
 * src/cli.
 */
#ifndef DFLASH_SERVER_PROMPT_H
#define DFLASH_SERVER_PROMPT_H

#include <stddef.h>
#include <stdint.h>

#include <jansson.h>

#include "dflash/chat.h"
#include "dflash/status.h"
#include "dflash/tokenizer.h"

/* How a request asks for tool calls (OpenAI tool_choice). */
typedef enum df_tool_choice {
    DF_TOOL_CHOICE_NONE,     /* tools are not shown to the template and calls are not parsed */
    DF_TOOL_CHOICE_AUTO,     /* tools shown, calls parsed */
    DF_TOOL_CHOICE_REQUIRED, /* as auto, and the answer is started with "<tool_call>\n" */
    DF_TOOL_CHOICE_NAMED     /* as required, and the call's function name is written too */
} df_tool_choice;

/* The chat side of a loaded pack. */
typedef struct df_chat_setup {
    df_chat_template *tmpl;  /* the pack's template, or the built-in ChatML one */
    int builtin;             /* 1: the pack has no template; the built-in ChatML is used */
    int xml_tools;           /* the template writes calls in the Qwen3.5 XML form (else Qwen3 JSON) */
    int default_enable_thinking; /* enable_thinking when a request gives none: 0 or 1 */
    const df_tokenizer *tok;
    /* the tokenizer's special tokens (added tokens marked special), longest first */
    char **special;
    size_t *special_len;
    int32_t *special_id;
    int n_special;
    size_t max_ids; /* > 0: df_chat_build does not tokenize a prompt of more than
                       DF_PROMPT_EXACT_BYTES that has at least this many tokens by its length
                       alone (df_chat_built.too_long); 0 (default): no limit */
} df_chat_setup;

/* Prompts up to this many bytes are always tokenized, so that a refusal for the context's size
 * gives their exact token count; longer ones are refused by their length alone when that
 * already proves them too long (tokenizing them would cost time and many times their size in
 * memory). */
#define DF_PROMPT_EXACT_BYTES ((size_t)1 << 20)

/* Loads the pack's chat template (df_chat_template_read: chat_template.jinja, chat_template.json,
 * tokenizer_config.json), or the built-in ChatML template when the pack has none, and lists
 * the tokenizer's special tokens. Errors: a template that exists but does not parse
 * (DF_ERR_FORMAT, naming the file), DF_ERR_NOMEM. */
df_status df_chat_setup_init(df_chat_setup *cs, const char *pack_dir, const df_tokenizer *tok,
                             int default_enable_thinking, df_error *err);
void df_chat_setup_free(df_chat_setup *cs);

/* A rendered chat prompt. */
typedef struct df_chat_built {
    char *text;        /* the prompt: template output + prefix (malloc'd, NUL-terminated) */
    size_t len;
    char *prefix;      /* the start of the assistant's answer written for tool_choice
                          required/named ("" otherwise): feed it to the output parser first */
    int thinking_open; /* the model's output starts inside <think> (for the parser) */
    int32_t *ids;      /* the prompt's tokens (when asked for), else NULL */
    size_t n_ids;
    int too_long;      /* 1: not tokenized, as no token covers more than the tokenizer's longest
                          piece and the prompt's bytes make at least n_ids >= max_ids tokens */
} df_chat_built;

/* Renders request (an OpenAI chat-completions body whose fields were validated: messages,
 * tools, enable_thinking, chat_template_kwargs, add_generation_prompt) with the template:
 *  - role "developer" is rendered as "system";
 *  - tool_choice NONE leaves the tools out; REQUIRED appends "<tool_call>\n" to the prompt
 *    (after closing an open <think>: a forced call skips the reasoning); NAMED appends also
 *    "<function=NAME>\n" (XML templates) or {"name": "NAME", "arguments":  (JSON templates);
 *  - with want_ids, the prompt is tokenized so that text coming from the request can never
 *    become a special token (a "<|im_end|>" written in a message is encoded as plain text):
 *    special tokens are recognised only where the template itself wrote them. Whenever the
 *    request contains no special token's text, the ids equal df_tokenizer_encode(text,
 *    parse_special = 1).
 * Errors: DF_ERR_INVALID_ARG for template errors and raise_exception (the message as the
 * template gave it), for a request the template cannot take; DF_ERR_RANGE (template limits),
 * DF_ERR_NOMEM. */
df_status df_chat_build(const df_chat_setup *cs, const json_t *request, df_tool_choice choice, const char *tool_name,
                        int want_ids, df_chat_built *out, df_error *err);
void df_chat_built_free(df_chat_built *b);

#endif
