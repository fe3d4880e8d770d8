/* dflash command line: chat requests read from files and rendered with the pack's template,
 * exactly as the server does (src/server/openai.c validates, src/server/prompt.c renders). */
#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include <jansson.h>

#include "cli/cli.h"
#include "server/openai.h"

/* The most bytes of a request file (the server's default body limit is far below). */
#define CLI_REQUEST_MAX ((size_t)256 << 20)

/* Room kept before a request's text, for {"messages": (read_raw_request). */
enum { PRE = 13 };

/* The whole text of request file `path` ("-": standard input; pipes and other streams are read
 * to their end, so `/dev/stdin` and `<(...)` work), at text + PRE, NUL-terminated, with PRE + 2
 * bytes of room around it; *len: its length. NULL after an error message (a folder, an open or
 * read error, more than CLI_REQUEST_MAX bytes). */
static char *read_request_text(const char *cmd, const char *path, size_t *len) {
    const int is_stdin = strcmp(path, "-") == 0;
    if (is_stdin && cli_stdin_closed) {
        cli_error(cmd, "-: standard input is closed");
        return NULL;
    }
    struct stat sb;
    if (!is_stdin && stat(path, &sb) != 0) {
        cli_error(cmd, "%s: %s", path, strerror(errno));
        return NULL;
    }
    if (!is_stdin && S_ISDIR(sb.st_mode)) {
        cli_error(cmd, "%s: is a folder, not a file", path);
        return NULL;
    }
    if (!is_stdin && S_ISREG(sb.st_mode) && (uint64_t)sb.st_size > CLI_REQUEST_MAX) {
        cli_error(cmd, "%s: larger than %zu bytes", path, CLI_REQUEST_MAX);
        return NULL;
    }
    FILE *f = is_stdin ? stdin : fopen(path, "rb");
    if (!f) {
        cli_error(cmd, "%s: %s", path, strerror(errno));
        return NULL;
    }
    size_t cap = 65536, n = 0;
    char *text = malloc(cap);
    int too_big = 0;
    while (text) {
        if (n > CLI_REQUEST_MAX) { /* a stream: stop once past the limit */
            too_big = 1;
            break;
        }
        if (PRE + n + 2 >= cap) { /* room for one byte past the limit at most */
            const size_t ncap = cap * 2 < CLI_REQUEST_MAX + PRE + 3 ? cap * 2 : CLI_REQUEST_MAX + PRE + 3;
            char *t = realloc(text, ncap);
            if (!t) {
                free(text);
                text = NULL;
                break;
            }
            text = t;
            cap = ncap;
        }
        const size_t k = fread(text + PRE + n, 1, cap - PRE - n - 2, f);
        n += k;
        if (k == 0) break;
    }
    const int bad = ferror(f);
    if (!is_stdin) fclose(f);
    if (!text || bad || too_big) {
        if (!text) cli_error(cmd, "out of memory reading %s", path);
        else if (too_big) cli_error(cmd, "%s: larger than %zu bytes", path, CLI_REQUEST_MAX);
        else cli_error(cmd, "%s: cannot read the file", path);
        free(text);
        return NULL;
    }
    text[PRE + n] = 0;
    *len = n;
    return text;
}

/* A request whose numbers the JSON parser cannot hold: its text (read_request_text's) as the
 * server would read it (a bare list of messages wrapped as {"messages": ...}), so that the
 * error names the field and its range as the server's does; any "model" is accepted. */
static int read_raw_request(const char *cmd, const char *path, char *text, size_t len, int vocab,
                            df_api_request *req) {
    size_t i = 0;
    while (i < len && (text[PRE + i] == ' ' || text[PRE + i] == '\t' || text[PRE + i] == '\r' || text[PRE + i] == '\n'))
        i++;
    char *body = text + PRE;
    if (i < len && text[PRE + i] == '[') { /* {"messages": [...]} */
        memcpy(text, "{\"messages\": ", PRE);
        body = text;
        len += PRE;
        body[len++] = '}';
    }
    df_api_context ctx = {.model_id = NULL, .vocab = vocab, .max_top_logprobs = 20};
    df_api_error e;
    const int rc = df_api_request_parse(req, DF_API_CHAT, body, len, &ctx, &e);
    if (rc && e.param[0]) cli_error(cmd, "%s: %s (param %s)", path, e.message, e.param);
    else if (rc) cli_error(cmd, "%s: %s", path, e.message);
    return rc;
}

char *cli_read_text(const char *cmd, const char *path, size_t *len) {
    char *text = read_request_text(cmd, path, len);
    if (text) memmove(text, text + PRE, *len + 1);
    return text;
}

int cli_read_chat_request(const char *cmd, const char *path, const char *model_id, int vocab, df_api_request *req) {
    size_t tlen = 0;
    char *text = read_request_text(cmd, path, &tlen);
    if (!text) return -1;
    json_error_t je;
    json_t *root = json_loadb(text + PRE, tlen, JSON_DECODE_ANY, &je);
    if (!root && (strstr(je.text, "too big") || strstr(je.text, "real number overflow"))) {
        const int rc = read_raw_request(cmd, path, text, tlen, vocab, req); /* names the field and its range */
        free(text);
        return rc;
    }
    free(text);
    if (!root) {
        if (je.line < 0) cli_error(cmd, "%s: %s", path, je.text);
        else if (strstr(je.text, "JSON_ALLOW_NUL"))
            cli_error(cmd, "%s: strings containing the NUL character (\\u0000) are not supported (line %d, column %d)",
                      path, je.line, je.column);
        else cli_error(cmd, "%s: invalid JSON at line %d, column %d: %s", path, je.line, je.column, je.text);
        return -1;
    }
    if (json_is_array(root)) { /* a bare list of messages */
        json_t *obj = json_pack("{s:o}", "messages", root);
        root = obj;
    }
    if (!json_is_object(root)) {
        cli_error(cmd, "%s: expected a chat request object or an array of messages", path);
        json_decref(root);
        return -1;
    }
    /* the file's "model" is not checked against the served id */
    json_t *model = json_object_get(root, "model");
    const char *id = json_is_string(model) ? json_string_value(model) : model_id;
    char *body = json_dumps(root, JSON_COMPACT);
    df_api_context ctx = {.model_id = id ? id : "", .vocab = vocab, .max_top_logprobs = 20};
    df_api_error e;
    int rc = body ? df_api_request_parse(req, DF_API_CHAT, body, strlen(body), &ctx, &e) : -1;
    if (!body) cli_error(cmd, "out of memory");
    else if (rc && e.param[0]) cli_error(cmd, "%s: %s (param %s)", path, e.message, e.param);
    else if (rc) cli_error(cmd, "%s: %s", path, e.message);
    free(body);
    json_decref(root);
    return rc;
}

void cli_note_ignored_fields(const char *cmd, const char *path, json_t *root) {
    /* what generate applies: the prompt's fields (rendered) and the sampling fields */
    static const char *const applied[] = {
        "messages", "tools", "tool_choice", "enable_thinking", "chat_template_kwargs", "add_generation_prompt",
        "temperature", "top_p",
        "top_k", "min_p", "seed", "max_tokens", "max_completion_tokens", "stop", "repetition_penalty",
        "presence_penalty", "frequency_penalty", "logit_bias"};
    char list[512] = "";
    size_t len = 0;
    const char *key;
    json_t *v;
    json_object_foreach(root, key, v) {
        int known = 0;
        for (size_t i = 0; i < sizeof applied / sizeof applied[0] && !known; i++) known = strcmp(key, applied[i]) == 0;
        if (known || len + 8 >= sizeof list) continue;
        int n = snprintf(list + len, sizeof list - len, "%s%.64s", len ? ", " : "", key);
        if (n > 0) len += (size_t)n < sizeof list - len ? (size_t)n : sizeof list - len - 1;
    }
    if (len)
        fprintf(stderr, "dflash %s: note: %s: fields this command does not act on (the server's, or unknown ones) are ignored: %s\n",
                cmd, path, list);
}
