/* Unit tests: chat prompt rendering and model-output parsing (src/text/chat*.c). */
#include "support.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "dflash/chat.h"

/* ==== prompt rendering ================================================================== */

static df_chat_template *load_template(const char *rel) {
    size_t len;
    char *src = tu_read_file(tu_fixture(rel), &len);
    assert_non_null(src);
    df_chat_template *t;
    df_error err = {0};
    assert_int_equal(df_chat_template_parse(src, len, &t, &err), DF_OK);
    free(src);
    return t;
}

/* Every conversation of cases.json, as an OpenAI request, through df_chat_render. */
static void test_fixture_cases(void **state) {
    (void)state;
    json_t *cases = json_load_file(tu_fixture("chat-templates/cases.json"), 0, NULL);
    assert_non_null(cases);
    df_chat_template *q35 = load_template("chat-templates/qwen3.5.jinja");
    df_chat_template *q3 = load_template("chat-templates/qwen3.jinja");
    const char *key;
    json_t *exp;
    int checked = 0;
    json_object_foreach(json_object_get(cases, "renders"), key, exp) {
        const char *conv = strchr(key, '/') + 1;
        df_chat_template *t = !strncmp(key, "qwen35/", 7) ? q35 : q3;
        json_t *req = json_object_get(json_object_get(cases, "convs"), conv);
        df_chat_prompt p;
        df_error err = {0};
        df_status st = df_chat_render(t, req, NULL, &p, &err);
        if (json_is_true(json_object_get(exp, "ok"))) {
            const char *text = json_string_value(json_object_get(exp, "text"));
            if (st != DF_OK || p.len != strlen(text) || memcmp(p.text, text, p.len))
                fail_msg("%s: status %d (%s)\n got [%s]", key, st, err.msg, p.text ? p.text : "");
            /* Qwen3.5's generation prompt opens <think> unless thinking is off */
            int open = t == q35 && !json_is_false(json_object_get(req, "enable_thinking"));
            assert_int_equal(p.thinking_open, open);
        } else {
            /* raise_exception messages exactly; Jinja2 errors with our position suffix */
            const char *msg = json_string_value(json_object_get(exp, "error"));
            size_t ml = strlen(msg);
            if (st != DF_ERR_INVALID_ARG || strncmp(err.msg, msg, ml) ||
                (err.msg[ml] && strncmp(err.msg + ml, " (template line ", 16)))
                fail_msg("%s: status %d, message [%s], expected [%s]", key, st, err.msg, msg);
            assert_null(p.text);
        }
        df_chat_prompt_free(&p);
        checked++;
    }
    assert_int_equal(checked, 16);
    df_chat_template_free(q35);
    df_chat_template_free(q3);
    json_decref(cases);
}

static char *render_req(df_chat_template *t, const char *req_json, const df_chat_render_options *opt,
                        df_status want, df_error *err, int *thinking_open) {
    json_error_t je;
    json_t *req = json_loads(req_json, 0, &je);
    if (!req) fail_msg("bad test JSON: %s", je.text);
    df_chat_prompt p;
    df_status st = df_chat_render(t, req, opt, &p, err);
    json_decref(req);
    if (st != want) fail_msg("status %d (%s), wanted %d", st, err->msg, want);
    if (thinking_open) *thinking_open = p.thinking_open;
    return p.text;
}

static void test_render_requests(void **state) {
    (void)state;
    df_chat_template *q35 = load_template("chat-templates/qwen3.5.jinja");
    df_chat_template *q3 = load_template("chat-templates/qwen3.jinja");
    df_error err = {0};
    int open;
    char *s;
    assert_int_equal(df_chat_template_handles_content_lists(q35), 1);
    assert_int_equal(df_chat_template_handles_content_lists(q3), 0);

    /* text parts are concatenated for a template without list support */
    s = render_req(q3, "{\"messages\": [{\"role\": \"user\", \"content\": [{\"type\": \"text\", \"text\": \"Hel\"},"
                       " {\"type\": \"text\", \"text\": \"lo\"}]}]}",
                   NULL, DF_OK, &err, &open);
    assert_string_equal(s, "<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n");
    assert_int_equal(open, 0);
    free(s);
    /* ... and passed as a list to Qwen3.5's, which renders them itself */
    s = render_req(q35, "{\"messages\": [{\"role\": \"user\", \"content\": [{\"type\": \"text\", \"text\": \"Hel\"},"
                        " {\"type\": \"text\", \"text\": \"lo\"}]}]}",
                   NULL, DF_OK, &err, &open);
    assert_string_equal(s, "<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n<think>\n");
    assert_int_equal(open, 1);
    free(s);

    /* enable_thinking: top-level, in chat_template_kwargs, or the server default */
    const char *nothink = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n";
    s = render_req(q35, "{\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}], \"enable_thinking\": false}", NULL,
                   DF_OK, &err, &open);
    assert_string_equal(s, nothink);
    assert_int_equal(open, 0);
    free(s);
    s = render_req(q35,
                   "{\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}],"
                   " \"chat_template_kwargs\": {\"enable_thinking\": false}}",
                   NULL, DF_OK, &err, &open);
    assert_string_equal(s, nothink);
    free(s);
    df_chat_render_options off = {.default_enable_thinking = 0};
    s = render_req(q35, "{\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}]}", &off, DF_OK, &err, &open);
    assert_string_equal(s, nothink);
    free(s);
    s = render_req(q35, "{\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}], \"enable_thinking\": true}", &off,
                   DF_OK, &err, &open);
    assert_int_equal(open, 1);
    free(s);
    /* no generation prompt */
    s = render_req(q35, "{\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}], \"add_generation_prompt\": false}",
                   NULL, DF_OK, &err, &open);
    assert_string_equal(s, "<|im_start|>user\nhi<|im_end|>\n");
    assert_int_equal(open, 0);
    free(s);

    /* OpenAI tool calls carry arguments as a JSON string: templates get the object */
    const char *req_tc =
        "{\"messages\": [{\"role\": \"user\", \"content\": \"w?\"}, {\"role\": \"assistant\", \"content\": null,"
        " \"tool_calls\": [{\"id\": \"call_1\", \"type\": \"function\", \"function\": {\"name\": \"get_weather\","
        " \"arguments\": \"{\\\"city\\\":\\\"Paris\\\",\\\"days\\\":3}\"}}]}, {\"role\": \"tool\", \"tool_call_id\":"
        " \"call_1\", \"content\": \"sunny\"}]}";
    s = render_req(q35, req_tc, NULL, DF_OK, &err, NULL);
    assert_string_equal(s, "<|im_start|>user\nw?<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
                           "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
                           "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call><|im_end|>\n"
                           "<|im_start|>user\n<tool_response>\nsunny\n</tool_response><|im_end|>\n"
                           "<|im_start|>assistant\n<think>\n");
    free(s);
    s = render_req(q3, req_tc, NULL, DF_OK, &err, NULL);
    assert_non_null(strstr(s, "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\", \"days\": 3}}"
                              "\n</tool_call>"));
    free(s);

    /* raise_exception reaches the caller as is */
    render_req(q35, "{\"messages\": [{\"role\": \"narrator\", \"content\": \"x\"}]}", NULL, DF_ERR_INVALID_ARG, &err,
               NULL);
    assert_string_equal(err.msg, "No user query found in messages.");
    render_req(q35, "{\"messages\": [{\"role\": \"user\", \"content\": [{\"type\": \"input_audio\"}]}]}", NULL,
               DF_ERR_INVALID_ARG, &err, NULL);
    assert_string_equal(err.msg, "Unexpected item type in content.");

    /* malformed requests name the field */
    static const struct {
        const char *req, *msg;
    } bad[] = {
        {"[]", "request body: expected a JSON object"},
        {"{}", "messages: expected an array"},
        {"{\"messages\": []}", "Cannot apply chat template to an empty conversation. Provide at least one message."},
        {"{\"messages\": [1]}", "messages[0]: expected an object"},
        {"{\"messages\": [{\"content\": \"x\"}]}", "messages[0].role: expected a string"},
        {"{\"messages\": [{\"role\": \"user\", \"content\": 5}]}",
         "messages[0].content: expected a string, an array of content parts or null"},
        {"{\"messages\": [{\"role\": \"user\", \"content\": [{\"text\": \"x\"}]}]}",
         "messages[0].content[0]: expected an object with a string \"type\""},
        {"{\"messages\": [{\"role\": \"user\", \"content\": [{\"type\": \"text\"}]}]}",
         "messages[0].content[0].text: expected a string"},
        {"{\"messages\": [{\"role\": \"user\", \"content\": \"x\"}], \"tools\": {}}", "tools: expected an array"},
        {"{\"messages\": [{\"role\": \"user\", \"content\": \"x\"}], \"chat_template_kwargs\": {\"messages\": []}}",
         "chat_template_kwargs.messages: may not be set here (use the request field)"},
        {"{\"messages\": [{\"role\": \"user\", \"content\": \"x\"}], \"enable_thinking\": \"no\"}",
         "enable_thinking: expected a boolean"},
        {"{\"messages\": [{\"role\": \"assistant\", \"content\": \"x\", \"tool_calls\": 3}]}",
         "messages[0].tool_calls: expected an array"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        render_req(q35, bad[i].req, NULL, DF_ERR_INVALID_ARG, &err, NULL);
        assert_string_equal(err.msg, bad[i].msg);
    }
    df_chat_template_free(q35);
    df_chat_template_free(q3);
}

static void test_template_from_pack(void **state) {
    (void)state;
    df_error err = {0};
    char *text;
    size_t len;
    /* chat_template.jinja */
    assert_int_equal(df_chat_template_read(tu_fixture("tiny-bonsai2"), &text, &len, &err), DF_OK);
    size_t flen;
    char *expect = tu_read_file(tu_fixture("chat-templates/qwen3.5.jinja"), &flen);
    assert_int_equal(len, flen);
    assert_memory_equal(text, expect, len);
    free(text);
    free(expect);
    /* tokenizer_config.json's chat_template */
    assert_int_equal(df_chat_template_read(tu_fixture("qwen3-tokenizer"), &text, &len, &err), DF_OK);
    assert_non_null(strstr(text, "<tool_call>\\n{\\\"name\\\": <function-name>"));
    free(text);
    df_chat_template *t;
    assert_int_equal(df_chat_template_load(tu_fixture("qwen3-tokenizer"), &t, &err), DF_OK);
    assert_non_null(df_chat_template_jinja(t));
    df_chat_template_free(t);
    /* chat_template.json with a list of named templates */
    const char *dir = tu_tmpdir();
    char path[512];
    snprintf(path, sizeof path, "%s/chat_template.json", dir);
    const char *js = "{\"chat_template\": [{\"name\": \"tool_use\", \"template\": \"T\"},"
                     " {\"name\": \"default\", \"template\": \"{{ messages[0].content }}\"}]}";
    assert_int_equal(tu_write_file(path, js, strlen(js)), 0);
    assert_int_equal(df_chat_template_load(dir, &t, &err), DF_OK);
    df_chat_prompt p;
    json_t *req = json_loads("{\"messages\": [{\"role\": \"user\", \"content\": \"X\"}]}", 0, NULL);
    assert_int_equal(df_chat_render(t, req, NULL, &p, &err), DF_OK);
    assert_string_equal(p.text, "X");
    df_chat_prompt_free(&p);
    json_decref(req);
    df_chat_template_free(t);
    /* a broken template is reported with the folder */
    const char *broken = "{\"chat_template\": \"{% if %}\"}";
    assert_int_equal(tu_write_file(path, broken, strlen(broken)), 0);
    assert_int_equal(df_chat_template_load(dir, &t, &err), DF_ERR_FORMAT);
    assert_non_null(strstr(err.msg, "chat template: template syntax error at line 1, column 7"));
    assert_int_equal(tu_write_file(path, "{\"x\": 1}", 8), 0);
    assert_int_equal(df_chat_template_read(dir, &text, &len, &err), DF_ERR_FORMAT);
    remove(path);
    text = (char *)"x";
    assert_int_equal(df_chat_template_read(dir, &text, &len, &err), DF_OK); /* none */
    assert_null(text);
    assert_int_equal(df_chat_template_load(dir, &t, &err), DF_ERR_IO);
    /* a tokenizer_config.json without the key: no template (the built-in one applies); with a
     * key of the wrong type: a format error */
    snprintf(path, sizeof path, "%s/tokenizer_config.json", dir);
    const char *tc = "{\"eos_token\": \"<|im_end|>\"}";
    assert_int_equal(tu_write_file(path, tc, strlen(tc)), 0);
    assert_int_equal(df_chat_template_read(dir, &text, &len, &err), DF_OK);
    assert_null(text);
    const char *tc2 = "{\"chat_template\": 7}";
    assert_int_equal(tu_write_file(path, tc2, strlen(tc2)), 0);
    assert_int_equal(df_chat_template_read(dir, &text, &len, &err), DF_ERR_FORMAT);
    remove(path);
    /* present but unreadable (a FIFO, a folder, a link loop) or empty: errors naming the file,
     * never "no template" */
    snprintf(path, sizeof path, "%s/chat_template.jinja", dir);
    assert_int_equal(mkfifo(path, 0600), 0);
    assert_int_equal(df_chat_template_read(dir, &text, &len, &err), DF_ERR_IO);
    assert_non_null(strstr(err.msg, "chat_template.jinja: not a regular file"));
    remove(path);
    assert_int_equal(mkdir(path, 0700), 0);
    assert_int_equal(df_chat_template_read(dir, &text, &len, &err), DF_ERR_IO);
    assert_non_null(strstr(err.msg, "is a folder"));
    rmdir(path);
    assert_int_equal(symlink("chat_template.jinja", path), 0);
    assert_int_equal(df_chat_template_read(dir, &text, &len, &err), DF_ERR_IO);
    assert_non_null(strstr(err.msg, "chat_template.jinja: cannot open"));
    remove(path);
    assert_int_equal(tu_write_file(path, "", 0), 0);
    assert_int_equal(df_chat_template_read(dir, &text, &len, &err), DF_ERR_FORMAT);
    assert_non_null(strstr(err.msg, "empty chat template"));
    remove(path);
    snprintf(path, sizeof path, "%s/tokenizer_config.json", dir);
    assert_int_equal(mkfifo(path, 0600), 0);
    assert_int_equal(df_chat_template_read(dir, &text, &len, &err), DF_ERR_IO);
    remove(path);
    rmdir(dir);
}

/* ==== output parsing ==================================================================== */

static const char *TOOLS =
    "[{\"type\": \"function\", \"function\": {\"name\": \"get_weather\", \"parameters\": {\"type\": \"object\","
    "  \"properties\": {\"city\": {\"type\": \"string\"}, \"days\": {\"type\": \"integer\"}}}}},"
    " {\"type\": \"function\", \"function\": {\"name\": \"write_file\", \"parameters\": {\"type\": \"object\","
    "  \"properties\": {\"path\": {\"type\": \"string\"}, \"content\": {\"type\": \"string\"}}}}},"
    " {\"type\": \"function\", \"function\": {\"name\": \"configure\", \"parameters\": {\"type\": \"object\","
    "  \"properties\": {\"value\": {\"type\": \"number\"}, \"count\": {\"type\": \"integer\"},"
    "   \"enabled\": {\"type\": \"boolean\"}, \"tags\": {\"type\": \"array\"}, \"opts\": {\"type\": \"object\"},"
    "   \"limit\": {\"type\": [\"integer\", \"null\"]}, \"label\": {\"type\": \"string\"}}}}}]";

struct out_case {
    const char *name;
    const char *text;
    int thinking_open, tools;
    const char *reasoning, *content;
    int ncalls;
    const char *calls[3][2]; /* name, arguments */
};

#define XML_WEATHER(city) "<tool_call>\n<function=get_weather>\n<parameter=city>\n" city "\n</parameter>\n</function>\n</tool_call>"

static const struct out_case OUT_CASES[] = {
    {"plain", "Hello world", 0, 1, "", "Hello world", 0, {{0}}},
    {"thinking_then_answer", "Let me think.\n</think>\n\nThe answer is 4.", 1, 1, "Let me think.", "The answer is 4.", 0,
     {{0}}},
    {"think_tags_in_output", "<think>\nhmm, 2+2\n</think>\n\nIt is 4.", 0, 1, "hmm, 2+2", "It is 4.", 0, {{0}}},
    {"think_open_without_close", "<think>\nstill thinking about", 0, 1, "still thinking about", "", 0, {{0}}},
    {"thinking_open_unterminated", "thinking forever and ever", 1, 1, "thinking forever and ever", "", 0, {{0}}},
    {"thinking_disabled", "Just the answer.\n", 0, 1, "", "Just the answer.", 0, {{0}}},
    {"empty_thinking", "\n\n</think>\n\nAnswer", 1, 1, "", "Answer", 0, {{0}}},
    {"multiline_reasoning", "Step 1: x\n\nStep 2: y\n</think>\n\nDone", 1, 0, "Step 1: x\n\nStep 2: y", "Done", 0,
     {{0}}},
    {"tool_after_reasoning", "I should check the weather.\n</think>\n\n" XML_WEATHER("Paris"), 1, 1,
     "I should check the weather.", "", 1, {{"get_weather", "{\"city\": \"Paris\"}"}}},
    {"two_tool_calls", XML_WEATHER("Paris") "\n" XML_WEATHER("Oslo"), 0, 1, "", "", 2,
     {{"get_weather", "{\"city\": \"Paris\"}"}, {"get_weather", "{\"city\": \"Oslo\"}"}}},
    {"content_then_tool", "Let me look that up.\n\n" XML_WEATHER("Rome"), 0, 1, "", "Let me look that up.", 1,
     {{"get_weather", "{\"city\": \"Rome\"}"}}},
    {"json_tool_call",
     "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Oslo\", \"days\": 2}}\n</tool_call>", 0, 1, "",
     "", 1, {{"get_weather", "{\"city\": \"Oslo\", \"days\": 2}"}}},
    {"two_json_calls",
     "<think>\nBoth.\n</think>\n\n<tool_call>\n{\"name\":\"get_weather\",\"arguments\":{\"city\":\"A\"}}\n</tool_call>\n"
     "<tool_call>\n{\"name\": \"write_file\", \"arguments\": {\"path\": \"x.txt\", \"content\": \"é\\n\"}}\n</tool_call>",
     0, 1, "Both.", "", 2,
     {{"get_weather", "{\"city\": \"A\"}"}, {"write_file", "{\"path\": \"x.txt\", \"content\": \"é\\n\"}"}}},
    {"typed_parameters",
     "<tool_call>\n<function=configure>\n<parameter=value>\n21.5\n</parameter>\n<parameter=count>\n3\n</parameter>\n"
     "<parameter=enabled>\nTrue\n</parameter>\n<parameter=tags>\n[\"a\", \"b\"]\n</parameter>\n<parameter=limit>\nnull\n"
     "</parameter>\n<parameter=label>\n42\n</parameter>\n</function>\n</tool_call>",
     0, 1, "", "", 1,
     {{"configure", "{\"value\": 21.5, \"count\": 3, \"enabled\": true, \"tags\": [\"a\", \"b\"], \"limit\": null, "
                    "\"label\": \"42\"}"}}},
    {"multiline_json_value",
     "<tool_call>\n<function=configure>\n<parameter=opts>\n{\n  \"a\": 1,\n  \"b\": [1, 2],\n  \"c\": {\"d\": \"e\"}\n}\n"
     "</parameter>\n</function>\n</tool_call>",
     0, 1, "", "", 1, {{"configure", "{\"opts\": {\"a\": 1, \"b\": [1, 2], \"c\": {\"d\": \"e\"}}}"}}},
    {"multiline_string_with_brackets",
     "<tool_call>\n<function=write_file>\n<parameter=path>\nsrc/a.py\n</parameter>\n<parameter=content>\n"
     "def f(a, b):\n    return a < b and b > 0\n\n<div class=\"x\">html</div>\n</parameter>\n</function>\n</tool_call>",
     0, 1, "", "", 1,
     {{"write_file", "{\"path\": \"src/a.py\", \"content\": \"def f(a, b):\\n    return a < b and b > 0\\n\\n<div "
                     "class=\\\"x\\\">html</div>\"}"}}},
    {"unparseable_typed_value",
     "<tool_call>\n<function=configure>\n<parameter=count>\nthree\n</parameter>\n<parameter=value>\n1.5.2\n</parameter>\n"
     "<parameter=opts>\n{oops}\n</parameter>\n</function>\n</tool_call>",
     0, 1, "", "", 1, {{"configure", "{\"count\": \"three\", \"value\": \"1.5.2\", \"opts\": \"{oops}\"}"}}},
    {"number_split_in_stream",
     "<tool_call>\n<function=configure>\n<parameter=count>\n123456789\n</parameter>\n<parameter=value>\n-0.000125\n"
     "</parameter>\n</function>\n</tool_call>",
     0, 1, "", "", 1, {{"configure", "{\"count\": 123456789, \"value\": -0.000125}"}}},
    {"unknown_parameter_and_tool",
     "<tool_call>\n<function=get_weather>\n<parameter=zip>\n75001\n</parameter>\n</function>\n</tool_call>"
     "<tool_call>\n<function=other>\n<parameter=n>\n5\n</parameter>\n</function>\n</tool_call>",
     0, 1, "", "", 2, {{"get_weather", "{\"zip\": \"75001\"}"}, {"other", "{\"n\": \"5\"}"}}},
    {"unterminated_tool_call", "Sure.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nPar", 0, 1, "",
     "Sure.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nPar", 0, {{0}}},
    {"malformed_tool_call", "<tool_call>\nnot a call\n</tool_call>", 0, 1, "", "<tool_call>\nnot a call\n</tool_call>",
     0, {{0}}},
    {"malformed_json_call", "Try:\n<tool_call>\n{\"name\": \"x\", \"arguments\": {bad}}\n</tool_call>\nok", 0, 1, "",
     "Try:\n<tool_call>\n{\"name\": \"x\", \"arguments\": {bad}}\n</tool_call>\nok", 0, {{0}}},
    {"tools_not_parsed", XML_WEATHER("Paris"), 0, 0, "", XML_WEATHER("Paris"), 0, {{0}}},
    {"tool_call_inside_reasoning", "maybe " XML_WEATHER("X") "\n</think>\nNo call.", 1, 1, "maybe " XML_WEATHER("X"),
     "No call.", 0, {{0}}},
    {"unicode", "Grüße, 日本語 🎉!\n</think>\n\nÅnswer ✓", 1, 1, "Grüße, 日本語 🎉!", "Ånswer ✓", 0, {{0}}},
    {"tag_lookalikes", "a < b and <tool and </think <think", 0, 1, "", "a < b and <tool and </think <think", 0, {{0}}},
    {"close_think_in_content", "no thinking</think> here", 0, 1, "", "no thinking</think> here", 0, {{0}}},
    {"whitespace_only", " \n\t\n ", 0, 1, "", "", 0, {{0}}},
    {"think_not_at_start", "Hello <think>x</think>", 0, 1, "", "Hello <think>x</think>", 0, {{0}}},
    {"missing_close_parameter",
     "<tool_call>\n<function=get_weather>\n<parameter=city>\nRome\n<parameter=days>\n4\n</function>\n</tool_call>", 0, 1,
     "", "", 1, {{"get_weather", "{\"city\": \"Rome\", \"days\": 4}"}}},
    {"missing_close_function", "<tool_call>\n<function=get_weather>\n<parameter=city>\nLima\n</parameter>\n</tool_call>",
     0, 1, "", "", 1, {{"get_weather", "{\"city\": \"Lima\"}"}}},
    {"text_after_tool_call", XML_WEATHER("Kyiv") "\nDone.", 0, 1, "", "Done.", 1,
     {{"get_weather", "{\"city\": \"Kyiv\"}"}}},
    {"text_between_calls", "A\n" XML_WEATHER("B") "\nC\n" XML_WEATHER("D") "\n", 0, 1, "", "A\nC", 2,
     {{"get_weather", "{\"city\": \"B\"}"}, {"get_weather", "{\"city\": \"D\"}"}}},
    {"json_arguments_as_string",
     "<tool_call>\n{\"name\": \"configure\", \"arguments\": \"{\\\"count\\\": 1}\"}\n</tool_call>", 0, 1, "", "", 1,
     {{"configure", "{\"count\": 1}"}}},
    {"no_parameters", "<tool_call>\n<function=get_weather>\n</function>\n</tool_call>", 0, 1, "", "", 1,
     {{"get_weather", "{}"}}},
    {"partial_open_tag_at_end", "Answer <tool_ca", 0, 1, "", "Answer <tool_ca", 0, {{0}}},
    {"partial_close_think_at_end", "reason </thi", 1, 1, "reason </thi", "", 0, {{0}}},
    {"empty_output", "", 1, 1, "", "", 0, {{0}}},
    {"tool_call_with_reasoning_and_trailing_ws",
     "Need data.\n</think>\n\nChecking.\n\n" XML_WEATHER("Nice") "\n\n", 1, 1, "Need data.", "Checking.", 1,
     {{"get_weather", "{\"city\": \"Nice\"}"}}},
};

static json_t *g_tools;

static df_chat_parse_options opts_for(const struct out_case *c) {
    df_chat_parse_options o = {.thinking_open = c->thinking_open, .parse_tool_calls = c->tools,
                               .tools = c->tools ? g_tools : NULL, .id_seed = 1234};
    return o;
}

static int valid_utf8(const char *s, size_t n) {
    json_t *j = json_stringn(s, n);
    json_decref(j);
    return j != NULL;
}

/* Feeds text in pieces of the given sizes (sizes cycles; NULL = 1 byte) and applies the deltas. */
static void parse_chunked(const struct out_case *c, const size_t *sizes, size_t nsizes, df_chat_message *m) {
    df_chat_parse_options o = opts_for(c);
    df_chat_parser *p;
    df_error err = {0};
    assert_int_equal(df_chat_parser_new(&o, &p, &err), DF_OK);
    memset(m, 0, sizeof *m);
    df_chat_deltas d = {0};
    size_t len = strlen(c->text), pos = 0, k = 0;
    while (pos < len) {
        size_t step = sizes ? sizes[k++ % nsizes] : 1;
        if (step > len - pos) step = len - pos;
        assert_int_equal(df_chat_parser_feed(p, c->text + pos, step, &d, &err), DF_OK);
        pos += step;
        for (size_t i = 0; i < d.n; i++) {
            if (d.items[i].text && !valid_utf8(d.items[i].text, d.items[i].len))
                fail_msg("%s: a delta is not valid UTF-8", c->name);
            if (d.items[i].text && d.items[i].len == 0) fail_msg("%s: empty delta", c->name);
        }
        assert_int_equal(df_chat_message_apply(m, &d, &err), DF_OK);
        df_chat_deltas_reset(&d);
    }
    assert_int_equal(df_chat_parser_finish(p, &d, &err), DF_OK);
    assert_int_equal(df_chat_message_apply(m, &d, &err), DF_OK);
    assert_int_equal(df_chat_parser_tool_calls(p), (int)m->n_tool_calls);
    df_chat_deltas_free(&d);
    df_chat_parser_free(p);
}

static void assert_same_message(const char *what, const struct out_case *c, const df_chat_message *a,
                                const df_chat_message *b) {
    if (strcmp(a->reasoning, b->reasoning) || strcmp(a->content, b->content) || a->n_tool_calls != b->n_tool_calls)
        fail_msg("%s (%s): streamed [%s|%s|%zu] vs whole [%s|%s|%zu]", c->name, what, a->reasoning, a->content,
                 a->n_tool_calls, b->reasoning, b->content, b->n_tool_calls);
    for (size_t i = 0; i < a->n_tool_calls; i++) {
        assert_string_equal(a->tool_calls[i].id, b->tool_calls[i].id);
        assert_string_equal(a->tool_calls[i].name, b->tool_calls[i].name);
        assert_string_equal(a->tool_calls[i].arguments, b->tool_calls[i].arguments);
    }
}

static void test_output_cases(void **state) {
    (void)state;
    assert_true(sizeof OUT_CASES / sizeof OUT_CASES[0] >= 30);
    uint64_t rng = 88172645463325252ull;
    for (size_t i = 0; i < sizeof OUT_CASES / sizeof OUT_CASES[0]; i++) {
        const struct out_case *c = &OUT_CASES[i];
        df_chat_parse_options o = opts_for(c);
        df_chat_message whole;
        df_error err = {0};
        assert_int_equal(df_chat_parse(c->text, strlen(c->text), &o, &whole, &err), DF_OK);
        if (strcmp(whole.reasoning, c->reasoning) || strcmp(whole.content, c->content) ||
            whole.n_tool_calls != (size_t)c->ncalls)
            fail_msg("%s: got reasoning [%s] content [%s] %zu calls", c->name, whole.reasoning, whole.content,
                     whole.n_tool_calls);
        for (int k = 0; k < c->ncalls; k++) {
            if (strcmp(whole.tool_calls[k].name, c->calls[k][0]) || strcmp(whole.tool_calls[k].arguments, c->calls[k][1]))
                fail_msg("%s: call %d is %s %s", c->name, k, whole.tool_calls[k].name, whole.tool_calls[k].arguments);
            assert_int_equal(strncmp(whole.tool_calls[k].id, "call_", 5), 0);
            assert_int_equal(strlen(whole.tool_calls[k].id), 29);
            for (int j = 0; j < k; j++) assert_string_not_equal(whole.tool_calls[j].id, whole.tool_calls[k].id);
        }
        /* every split: 1-byte pieces, then random sizes */
        df_chat_message m;
        parse_chunked(c, NULL, 0, &m);
        assert_same_message("1-byte pieces", c, &m, &whole);
        df_chat_message_free(&m);
        for (int trial = 0; trial < 20; trial++) {
            size_t sizes[64];
            for (int k = 0; k < 64; k++) {
                rng ^= rng << 13, rng ^= rng >> 7, rng ^= rng << 17;
                sizes[k] = 1 + rng % (trial < 10 ? 8 : 40);
            }
            parse_chunked(c, sizes, 64, &m);
            assert_same_message("random pieces", c, &m, &whole);
            df_chat_message_free(&m);
        }
        df_chat_message_free(&whole);
    }
}

/* Every split point of each case into two pieces (a tag, a number, a UTF-8 character cut
 * anywhere). */
static void test_output_every_split(void **state) {
    (void)state;
    for (size_t i = 0; i < sizeof OUT_CASES / sizeof OUT_CASES[0]; i++) {
        const struct out_case *c = &OUT_CASES[i];
        df_chat_parse_options o = opts_for(c);
        df_chat_message whole, m;
        df_error err = {0};
        assert_int_equal(df_chat_parse(c->text, strlen(c->text), &o, &whole, &err), DF_OK);
        for (size_t cut = 1; cut < strlen(c->text); cut++) {
            size_t sizes[2] = {cut, strlen(c->text)};
            parse_chunked(c, sizes, 2, &m);
            assert_same_message("two pieces", c, &m, &whole);
            df_chat_message_free(&m);
        }
        df_chat_message_free(&whole);
    }
}

static void test_deltas_and_json(void **state) {
    (void)state;
    const char *text = "Plan.\n</think>\n\nOK.\n" XML_WEATHER("Paris");
    df_chat_parse_options o = {.thinking_open = 1, .parse_tool_calls = 1, .tools = g_tools, .id_seed = 7};
    df_chat_parser *p;
    df_error err = {0};
    df_chat_deltas d = {0};
    assert_int_equal(df_chat_parser_new(&o, &p, &err), DF_OK);
    /* the reasoning streams before </think> arrives */
    assert_int_equal(df_chat_parser_feed(p, text, 9, &d, &err), DF_OK);
    assert_int_equal(d.n, 1);
    assert_int_equal(d.items[0].kind, DF_CHAT_DELTA_REASONING);
    assert_string_equal(d.items[0].text, "Plan.");
    df_chat_deltas_reset(&d);
    assert_int_equal(df_chat_parser_feed(p, text + 9, strlen(text) - 9, &d, &err), DF_OK);
    assert_int_equal(d.n, 3);
    assert_int_equal(d.items[0].kind, DF_CHAT_DELTA_CONTENT);
    assert_string_equal(d.items[0].text, "OK.");
    assert_int_equal(d.items[1].kind, DF_CHAT_DELTA_TOOL_START);
    assert_int_equal(d.items[1].tool_index, 0);
    assert_string_equal(d.items[1].name, "get_weather");
    assert_int_equal(d.items[2].kind, DF_CHAT_DELTA_TOOL_ARGS);
    assert_string_equal(d.items[2].text, "{\"city\": \"Paris\"}");
    char id[64];
    snprintf(id, sizeof id, "%s", d.items[1].id);
    df_chat_deltas_free(&d);
    df_chat_parser_free(p);

    df_chat_message m;
    assert_int_equal(df_chat_parse(text, strlen(text), &o, &m, &err), DF_OK);
    assert_string_equal(m.tool_calls[0].id, id); /* deterministic given the seed */
    json_t *j = df_chat_message_to_json(&m);
    char *s = json_dumps(j, JSON_COMPACT);
    char expect[512];
    snprintf(expect, sizeof expect,
             "{\"role\":\"assistant\",\"content\":\"OK.\",\"reasoning_content\":\"Plan.\",\"tool_calls\":[{\"id\":\"%s\","
             "\"type\":\"function\",\"function\":{\"name\":\"get_weather\",\"arguments\":\"{\\\"city\\\": \\\"Paris\\\"}\"}}]}",
             id);
    assert_string_equal(s, expect);
    free(s);
    json_decref(j);
    df_chat_message_free(&m);
    /* another seed, other ids */
    o.id_seed = 8;
    assert_int_equal(df_chat_parse(text, strlen(text), &o, &m, &err), DF_OK);
    assert_string_not_equal(m.tool_calls[0].id, id);
    df_chat_message_free(&m);
    /* content is null when there are only tool calls */
    o.thinking_open = 0;
    assert_int_equal(df_chat_parse(XML_WEATHER("X"), strlen(XML_WEATHER("X")), &o, &m, &err), DF_OK);
    j = df_chat_message_to_json(&m);
    assert_true(json_is_null(json_object_get(j, "content")));
    assert_null(json_object_get(j, "reasoning_content"));
    json_decref(j);
    df_chat_message_free(&m);
}

static int setup(void **state) {
    (void)state;
    g_tools = json_loads(TOOLS, 0, NULL);
    return g_tools ? 0 : -1;
}

static int teardown(void **state) {
    (void)state;
    json_decref(g_tools);
    return 0;
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_fixture_cases),        cmocka_unit_test(test_render_requests),
        cmocka_unit_test(test_template_from_pack),   cmocka_unit_test(test_output_cases),
        cmocka_unit_test(test_output_every_split),   cmocka_unit_test(test_deltas_and_json),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
