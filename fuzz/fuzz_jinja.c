/* libFuzzer target: the Jinja2 engine. The input is a template; it is parsed and, when it
 * parses, rendered with chat-like variables under small limits. Any crash, leak, sanitizer
 * report or a status outside the documented ones is a finding. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "dflash/jinja.h"

static json_t *g_vars;

static const char VARS[] =
    "{\"messages\": [{\"role\": \"system\", \"content\": \"sys\"}, {\"role\": \"user\", \"content\": [{\"type\": "
    "\"text\", \"text\": \"hi\"}, {\"type\": \"image_url\", \"image_url\": {\"url\": \"data:x\"}}]}, {\"role\": "
    "\"assistant\", \"content\": \"<think>\\nr\\n</think>\\n\\nok\", \"tool_calls\": [{\"type\": \"function\", "
    "\"function\": {\"name\": \"f\", \"arguments\": {\"a\": 1, \"b\": [1.5, null, true]}}}]}, {\"role\": \"tool\", "
    "\"content\": \"{\\\"t\\\": 1}\"}], \"tools\": [{\"type\": \"function\", \"function\": {\"name\": \"f\", "
    "\"parameters\": {\"type\": \"object\", \"properties\": {\"a\": {\"type\": \"integer\"}}}}}], "
    "\"add_generation_prompt\": true, \"enable_thinking\": false, \"n\": 3, \"x\": 2.5, \"s\": \"héllo\"}";

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (!g_vars) g_vars = json_loads(VARS, 0, NULL);
    df_jinja_template *t = NULL;
    df_error err = {0};
    df_status st = df_jinja_parse((const char *)data, size, &t, &err);
    if (st != DF_OK) {
        if (st != DF_ERR_FORMAT && st != DF_ERR_NOMEM) abort();
        return 0;
    }
    df_jinja_limits lim = {.max_output = 1 << 20, .max_steps = 200000, .max_depth = 30};
    char *out = NULL;
    size_t len = 0;
    st = df_jinja_render(t, g_vars, &lim, &out, &len, &err);
    if (st == DF_OK) {
        if (!out || strlen(out) > len) abort();
        free(out);
    } else if (out || (st != DF_ERR_INVALID_ARG && st != DF_ERR_RANGE && st != DF_ERR_NOMEM)) {
        abort();
    }
    (void)df_jinja_handles_content_lists(t);
    df_jinja_free(t);
    return 0;
}
