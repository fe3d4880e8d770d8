/* dflash server: the OpenAI request schema (parsing + validation) and response shapes.
 * Private to src/server. */
#ifndef DFLASH_SERVER_OPENAI_H
#define DFLASH_SERVER_OPENAI_H

#include <stddef.h>

#include <jansson.h>

#include "dflash/generate.h"
#include "dflash/pack.h"

/* An OpenAI error: {"error": {"message", "type", "code", "param"}} with an HTTP status. */
typedef struct df_api_error {
    int status;               /* HTTP status */
    const char *type;         /* "invalid_request_error", "server_error", ... */
    const char *code;         /* NULL = JSON null */
    char param[96];           /* "" = JSON null */
    char message[480];
} df_api_error;

/* Fills e and returns -1 (so validators can `return api_error(...)`). param may be NULL. */
int df_api_error_set(df_api_error *e, int status, const char *type, const char *code, const char *param,
                     const char *fmt, ...) __attribute__((format(printf, 6, 7)));
/* {"error": {...}} */
json_t *df_api_error_json(const df_api_error *e);

/* A validated POST /v1/chat/completions request. */
typedef struct df_chat_request {
    json_t *root;              /* the parsed body; stop strings point into it */
    int n_messages;
    const char **roles;        /* [n_messages] role names as rendered (static strings) */
    char **contents;           /* [n_messages] text (malloc'd) */
    df_gen_params gen;         /* max_tokens as requested (0 = not given) */
} df_chat_request;

/* Parses and validates body (len bytes). Fields the request omits (or sets to null) take
 * the pack's generation defaults gen_defaults (else greedy-off values, temperature 1).
 * model_id: a "model" field must equal it (404 otherwise). Returns 0, or -1 with e set
 * (400/404); on failure req holds nothing to free. */
int df_chat_request_parse(df_chat_request *req, const char *body, size_t len, const char *model_id,
                          const df_generation_defaults *gen_defaults, df_api_error *e);
void df_chat_request_free(df_chat_request *req);

/* A JSON string of len bytes of text that should be UTF-8; if it is not, every byte
 * outside ASCII (and NUL) becomes '?'. NULL only when out of memory. */
json_t *df_json_text(const char *text, size_t len);

#endif
