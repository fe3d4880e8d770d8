/* dflash render: the exact prompt an OpenAI chat-completions request renders to with the
 * pack's chat template (as the server renders it: tool_choice, thinking, untrusted text). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli/cli.h"
#include "dflash/pack.h"
#include "server/openai.h"
#include "server/prompt.h"

int cmd_render(int argc, char **argv) {
    const char *model = NULL, *request = NULL;
    int thinking = 0, ids = 0;
    cli_opt opts[] = {
        {"model", "DIR", CLI_STR, &model, "$DFLASH_MODEL, else the embedded demo model", "model pack folder (chat template and tokenizer)", 0, 0, 0},
        {"request", "FILE", CLI_STR, &request, "none (required)", "an OpenAI chat-completions request body (JSON), or a JSON array of messages", 0, 0, 0},
        {"enable-thinking", NULL, CLI_FLAG, &thinking, "off", "thinking on when the request does not say (as dflash serve --enable-thinking)", 0, 0, 0},
        {"ids", NULL, CLI_FLAG, &ids, "off", "print the prompt's token ids (a JSON array) instead of its text", 0, 0, 0},
    };
    cli_command cmd = {"render", "--request FILE.json [options]",
                       "Prints the exact prompt the request renders to with the pack's chat template (a built-in\n"
                       "ChatML one when the pack has none), as `dflash serve` would send it to the model. A template\n"
                       "error (raise_exception) is printed to stderr with exit status 1.",
                       opts, (int)(sizeof opts / sizeof opts[0])};
    int rc = cli_parse(&cmd, argc, argv);
    if (rc >= 0) return rc;
    if (!request) return cli_usage_error(&cmd, "--request is required");
    char dir[4000], path[4096], id[256];
    if (cli_model_dir(model, dir, sizeof dir)) return CLI_EXIT_FAIL;
    cli_model_id(dir, id, sizeof id);
    snprintf(path, sizeof path, "%s/tokenizer.json", dir);

    df_error err = {0};
    df_tokenizer *tok = NULL;
    df_chat_setup cs = {0};
    df_api_request req = {0};
    df_chat_built built = {0};
    rc = CLI_EXIT_FAIL;
    if (df_tokenizer_load(&tok, path, &err) || df_chat_setup_init(&cs, dir, tok, thinking, &err)) {
        cli_error("render", "%s", err.msg);
        goto done;
    }
    /* logit_bias ids are checked as the server checks them: against the model's vocabulary
     * (config.json's vocab_size, which may exceed the tokenizer's), else the tokenizer's */
    int vocab = 0;
    df_error verr = {0};
    if (df_pack_vocab_size(dir, &vocab, &verr) != DF_OK || vocab < df_tokenizer_vocab_size(tok))
        vocab = df_tokenizer_vocab_size(tok);
    if (cli_read_chat_request("render", request, id, vocab, &req)) goto done;
    if (df_chat_build(&cs, req.root, req.tool_choice, req.tool_name, ids, &built, &err)) {
        cli_error("render", "%s", err.msg);
        goto done;
    }
    if (ids) {
        putchar('[');
        for (size_t i = 0; i < built.n_ids; i++) printf("%s%d", i ? "," : "", (int)built.ids[i]);
        puts("]");
    } else {
        fwrite(built.text, 1, built.len, stdout);
    }
    rc = fflush(stdout) == 0 ? CLI_EXIT_OK : CLI_EXIT_FAIL;
done:
    df_chat_built_free(&built);
    df_api_request_free(&req);
    df_chat_setup_free(&cs);
    df_tokenizer_free(tok);
    return rc;
}
