/* dflash server: the OpenAI request schema (parsing + validation) and response pieces.
 * Private to src/server and src/cli. */
#ifndef DFLASH_SERVER_OPENAI_H
#define DFLASH_SERVER_OPENAI_H

#include <stddef.h>

#include <jansson.h>

#include "dflash/generate.h"
#include "dflash/pack.h"
#include "dflash/tokenizer.h"
#include "server/prompt.h"

/* An OpenAI error: {"error": {"message", "type", "code", "param"}} with an HTTP status,
 * and for exceed_context_size_error the counts (n_prompt_tokens, n_ctx). */
typedef struct df_api_error {
    int status;               /* HTTP status */
    const char *type;         /* "invalid_request_error", "server_error", ... */
    const char *code;         /* NULL = JSON null */
    char param[96];           /* "" = JSON null */
    char message[480];
    long long n_prompt_tokens, n_ctx; /* > 0: added to the error object */
} df_api_error;

/* Fills e and returns -1 (so validators can `return df_api_error_set(...)`). param may be NULL. */
int df_api_error_set(df_api_error *e, int status, const char *type, const char *code, const char *param,
                     const char *fmt, ...) __attribute__((format(printf, 6, 7)));
/* {"error": {...}} */
json_t *df_api_error_json(const df_api_error *e);

typedef enum df_api_route {
    DF_API_CHAT,        /* POST /v1/chat/completions */
    DF_API_COMPLETIONS  /* POST /v1/completions */
} df_api_route;

#define DF_API_MAX_PROMPTS 64

/* What validation needs to know about the served model. */
typedef struct df_api_context {
    const char *model_id;                      /* a request's "model" must equal it (404); NULL: any */
    const df_generation_defaults *gen_defaults; /* for omitted sampling fields (may be NULL) */
    int vocab;                                 /* logit_bias keys and prompt ids must be < vocab (the
                                                  model's embedding rows: an id past the tokenizer's is
                                                  a valid input that reads as no text, as in outputs) */
    int max_top_logprobs;                      /* top_logprobs / logprobs upper bound */
    int test_hooks;                            /* honour "dflash_forced_output", "dflash_delay_ms" */
} df_api_context;

/* A validated completion request. Not copyable (gen.sampling.logit_bias points into it). */
typedef struct df_api_request {
    df_api_route route;
    json_t *root;              /* the parsed body; strings below point into it */
    df_gen_params gen;         /* sampling, stop, logprobs; max_tokens 0 = not given */
    df_logit_bias bias[DF_MAX_LOGIT_BIAS];
    int stream, include_usage;
    /* chat */
    df_tool_choice tool_choice;
    const char *tool_name;     /* NAMED: the function */
    const json_t *tools;       /* the request's tools (NULL when none or empty) */
    /* completions: each prompt is a JSON string or an array of token ids */
    const json_t *prompts[DF_API_MAX_PROMPTS];
    int n_prompts;
    int echo;
    /* test hooks: text whose tokens replace the sampled ones (NULL = none); milliseconds the
     * worker sleeps at each of the generation's stop checks (each token, each prefill chunk),
     * so that tests of queueing and cancellation hold a generation running on any device */
    const char *forced_output;
    int delay_ms;
} df_api_request;

/* Parses and validates body (len bytes) for route. Unknown fields are ignored; a known
 * field with a wrong type or value is a 400 naming it in "param"; null counts as omitted.
 * Omitted sampling fields take ctx->gen_defaults (else temperature 1, others off).
 * Returns 0, or -1 with e set (400/404); on failure req holds nothing to free. */
int df_api_request_parse(df_api_request *req, df_api_route route, const char *body, size_t len,
                         const df_api_context *ctx, df_api_error *e);
void df_api_request_free(df_api_request *req);

/* A JSON string of len bytes of text that should be UTF-8; if it is not, every byte
 * outside ASCII (and NUL) becomes '?'. NULL only when out of memory. */
json_t *df_json_text(const char *text, size_t len);

/* ---- response pieces --------------------------------------------------------------------- */

/* {"prompt_tokens", "completion_tokens", "total_tokens"} */
json_t *df_api_usage(int prompt_tokens, int completion_tokens);

/* llama.cpp's timings: prompt_n, prompt_ms, prompt_per_second, predicted_n, predicted_ms,
 * predicted_per_second (df_decode_tokens_per_second of n_after_first, the tokens after the
 * first of each generation summed in res), and with speculative decoding draft_rounds,
 * draft_n, draft_n_accepted, plain_steps (rounds decoded as plain steps), draft_ms, verify_ms. */
json_t *df_api_timings(const df_gen_result *res, int n_prompt, int n_after_first, int speculative);

/* One chat logprobs entry {"token", "logprob", "bytes", "top_logprobs": [...]} for info. */
json_t *df_api_logprob_entry(const df_tokenizer *tok, const df_token_info *info);

/* Where the legacy completions text_offset stands: the characters (Unicode code points, as a
 * Python str counts them) of the returned text that come before the next token, and the bytes
 * of a UTF-8 sequence that the tokens so far left unfinished. A token's offset is where its
 * text begins in the returned text (a token that only starts a multi-byte character points at
 * that character; bytes left unfinished that a token does not continue come out as one U+FFFD
 * each before its text), so offsets index the text (echo included) and never pass its end. */
typedef struct df_api_text_offset {
    size_t chars;
    unsigned char pend[8];
    int n_pend;
    int skip_special;      /* special tokens add no text (df_gen_params.skip_special) */
} df_api_text_offset;

/* A state that starts after text[len] (the echoed prompt; NULL/0 for none), as the answer
 * returns it (df_json_text). */
void df_api_text_offset_init(df_api_text_offset *o, const char *text, size_t len, int skip_special);

/* The legacy completions logprobs object {"tokens", "token_logprobs", "top_logprobs",
 * "text_offset"} for n tokens; offsets from *off, which advances past their text. */
json_t *df_api_completion_logprobs(const df_tokenizer *tok, const df_token_info *info, int n, df_api_text_offset *off);

#endif
