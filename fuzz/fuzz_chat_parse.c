/* libFuzzer target: the model-output parser. Byte 0 sets the options (bit 0: output starts
 * inside <think>; bit 1: parse tool calls), byte 1 seeds the piece sizes; the rest is the
 * output. The text is parsed whole and fed in pieces; the streamed deltas must concatenate to
 * exactly the whole result (abort otherwise), and valid UTF-8 input must give valid UTF-8
 * deltas. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "dflash/chat.h"

static json_t *g_tools;

static const char TOOLS[] =
    "[{\"type\": \"function\", \"function\": {\"name\": \"f\", \"parameters\": {\"type\": \"object\", \"properties\": "
    "{\"i\": {\"type\": \"integer\"}, \"n\": {\"type\": \"number\"}, \"b\": {\"type\": \"boolean\"}, \"o\": {\"type\": "
    "\"object\"}, \"a\": {\"type\": \"array\"}, \"u\": {\"type\": [\"integer\", \"null\"]}, \"s\": {\"type\": "
    "\"string\"}}}}}]";

static int same(const df_chat_message *a, const df_chat_message *b) {
    if (a->reasoning_len != b->reasoning_len || memcmp(a->reasoning, b->reasoning, a->reasoning_len)) return 0;
    if (a->content_len != b->content_len || memcmp(a->content, b->content, a->content_len)) return 0;
    if (a->n_tool_calls != b->n_tool_calls) return 0;
    for (size_t i = 0; i < a->n_tool_calls; i++)
        if (strcmp(a->tool_calls[i].id, b->tool_calls[i].id) || strcmp(a->tool_calls[i].name, b->tool_calls[i].name) ||
            strcmp(a->tool_calls[i].arguments, b->tool_calls[i].arguments))
            return 0;
    return 1;
}

static int valid_utf8(const char *s, size_t n) {
    json_t *j = json_stringn(s, n);
    json_decref(j);
    return j != NULL;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size < 2) return 0;
    if (!g_tools) g_tools = json_loads(TOOLS, 0, NULL);
    df_chat_parse_options o = {.thinking_open = data[0] & 1, .parse_tool_calls = (data[0] >> 1) & 1,
                               .tools = g_tools, .id_seed = data[0]};
    uint32_t rng = data[1] * 2654435761u + 1;
    const char *text = (const char *)data + 2;
    size_t len = size - 2;
    int utf8 = valid_utf8(text, len);
    df_error err = {0};
    df_chat_message whole, streamed = {0};
    if (df_chat_parse(text, len, &o, &whole, &err) != DF_OK) abort();
    df_chat_parser *p;
    if (df_chat_parser_new(&o, &p, &err) != DF_OK) abort();
    df_chat_deltas d = {0};
    size_t pos = 0;
    while (pos < len) {
        rng = rng * 1103515245u + 12345u;
        size_t step = 1 + (rng >> 16) % 13;
        if (step > len - pos) step = len - pos;
        if (df_chat_parser_feed(p, text + pos, step, &d, &err) != DF_OK) abort();
        pos += step;
        for (size_t i = 0; i < d.n; i++)
            if (d.items[i].text && (d.items[i].len == 0 || (utf8 && !valid_utf8(d.items[i].text, d.items[i].len))))
                abort();
        if (df_chat_message_apply(&streamed, &d, &err) != DF_OK) abort();
        df_chat_deltas_reset(&d);
    }
    if (df_chat_parser_finish(p, &d, &err) != DF_OK || df_chat_message_apply(&streamed, &d, &err) != DF_OK) abort();
    if (!same(&whole, &streamed)) abort();
    for (size_t i = 0; i < whole.n_tool_calls; i++) { /* arguments are always a JSON object */
        json_t *a = json_loads(whole.tool_calls[i].arguments, JSON_ALLOW_NUL, NULL);
        if (!json_is_object(a)) abort();
        json_decref(a);
    }
    json_t *j = df_chat_message_to_json(&whole);
    if (utf8 && !j) abort();
    json_decref(j);
    df_chat_deltas_free(&d);
    df_chat_parser_free(p);
    df_chat_message_free(&whole);
    df_chat_message_free(&streamed);
    return 0;
}
