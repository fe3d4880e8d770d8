/* libFuzzer target: request rendering. The input is a chat-completions request body (JSON);
 * it is rendered with the Qwen3.5 and Qwen3 templates from tests/fixtures. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "dflash/chat.h"

static df_chat_template *g_t[2];

static df_chat_template *load(const char *name) {
    char path[4096];
    snprintf(path, sizeof path, "%s/chat-templates/%s", DFLASH_FIXTURES_DIR, name);
    FILE *f = fopen(path, "rb");
    if (!f) abort();
    static char buf[1 << 16];
    size_t n = fread(buf, 1, sizeof buf, f);
    fclose(f);
    df_chat_template *t;
    df_error err = {0};
    if (df_chat_template_parse(buf, n, &t, &err) != DF_OK) abort();
    return t;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (!g_t[0]) {
        g_t[0] = load("qwen3.5.jinja");
        g_t[1] = load("qwen3.jinja");
    }
    json_t *req = json_loadb((const char *)data, size, 0, NULL);
    if (!req) return 0;
    df_jinja_limits lim = {.max_output = 1 << 20, .max_steps = 500000};
    df_chat_render_options opt = {.default_enable_thinking = -1, .limits = &lim};
    for (int i = 0; i < 2; i++) {
        df_chat_prompt p;
        df_error err = {0};
        df_status st = df_chat_render(g_t[i], req, &opt, &p, &err);
        if (st == DF_OK) {
            if (!p.text || strlen(p.text) > p.len) abort();
        } else if (p.text || (st != DF_ERR_INVALID_ARG && st != DF_ERR_RANGE && st != DF_ERR_NOMEM)) {
            abort();
        }
        df_chat_prompt_free(&p);
    }
    json_decref(req);
    return 0;
}
