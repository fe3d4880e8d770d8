/* dflash tokenize: text to token ids (a JSON array), or ids back to text. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli/cli.h"
#include "dflash/pack.h"
#include "dflash/tokenizer.h"

int cmd_tokenize(int argc, char **argv) {
    const char *model = NULL, *tokenizer = NULL, *text = NULL, *file = NULL, *decode = NULL;
    int skip_special = 0, no_special = 0;
    cli_opt opts[] = {
        {"model", "DIR", CLI_STR, &model, "$DFLASH_MODEL, else the embedded demo model", "model pack folder (its tokenizer.json)", 0, 0, 0},
        {"tokenizer", "FILE", CLI_STR, &tokenizer, "none", "a tokenizer.json file, instead of --model", 0, 0, 0},
        {"text", "TEXT", CLI_STR, &text, "none", "text to encode (special tokens recognised); prints a JSON array of ids", 0, 0, 0},
        {"file", "FILE", CLI_STR, &file, "none", "encode the text of FILE ('-': standard input), as --text does", 0, 0, 0},
        {"no-special", NULL, CLI_FLAG, &no_special, "off", "with --text or --file: special tokens' text is plain text (as for a message's content)", 0, 0, 0},
        {"decode", "IDS", CLI_STR, &decode, "none", "comma-separated ids to decode; prints the text", 0, 0, 0},
        {"skip-special", NULL, CLI_FLAG, &skip_special, "off", "with --decode: drop special tokens", 0, 0, 0},
    };
    cli_command cmd = {"tokenize", "[--model DIR | --tokenizer FILE] (--text TEXT | --file FILE | --decode IDS) [options]",
                       "Encodes text with the model's tokenizer, or decodes token ids.", opts,
                       (int)(sizeof opts / sizeof opts[0])};
    int rc = cli_parse(&cmd, argc, argv);
    if (rc >= 0) return rc;
    if (!!text + !!file + !!decode != 1) return cli_usage_error(&cmd, "give exactly one of --text, --file and --decode");
    if (model && tokenizer) return cli_usage_error(&cmd, "give --model or --tokenizer, not both");
    if (skip_special && !decode) return cli_usage_error(&cmd, "--skip-special applies to --decode only");
    if (no_special && decode) return cli_usage_error(&cmd, "--no-special applies to --text and --file only");
    char *file_text = NULL;
    size_t text_len = text ? strlen(text) : 0;
    if (file) {
        if (!(file_text = cli_read_text("tokenize", file, &text_len))) return CLI_EXIT_FAIL;
        if (strlen(file_text) != text_len) {
            cli_error("tokenize", "%s: holds a NUL byte (at byte %zu): not text", file, strlen(file_text));
            free(file_text);
            return CLI_EXIT_FAIL;
        }
        text = file_text;
    }

    int32_t *ids = NULL;
    size_t n = 0;
    if (decode && cli_parse_ids(&cmd, "--decode", decode, &ids, &n)) return CLI_EXIT_USAGE;
    if (text) { /* the file's bytes are data; --text is the command line */
        const int st = file_text ? cli_check_utf8_data(&cmd, file, text) : cli_check_utf8(&cmd, "--text", text);
        if (st) {
            free(ids);
            free(file_text);
            return st;
        }
    }
    char path[4096];
    int model_vocab = 0; /* a pack's: ids past the tokenizer's, up to it, decode to no text */
    if (tokenizer) {
        snprintf(path, sizeof path, "%s", tokenizer);
    } else {
        char dir[4000];
        if (cli_model_dir(model, dir, sizeof dir)) {
            free(ids);
            free(file_text);
            return CLI_EXIT_FAIL;
        }
        snprintf(path, sizeof path, "%s/tokenizer.json", dir);
        df_error verr = {0};
        if (decode && df_pack_vocab_size(dir, &model_vocab, &verr) != DF_OK) model_vocab = 0;
    }
    df_error err = {0};
    df_tokenizer *tok = NULL;
    rc = CLI_EXIT_FAIL;
    if (df_tokenizer_load(&tok, path, &err) != DF_OK) {
        cli_error("tokenize", "%s", err.msg);
        goto done;
    }
    if (text) {
        if (df_tokenizer_encode(tok, text, text_len, !no_special, &ids, &n, &err) != DF_OK) {
            cli_error("tokenize", "%s", err.msg);
            goto done;
        }
        putchar('[');
        for (size_t i = 0; i < n; i++) printf("%s%d", i ? "," : "", (int)ids[i]);
        puts("]");
    } else {
        char *out = NULL;
        size_t len = 0;
        const int32_t tv = df_tokenizer_vocab_size(tok), vocab = model_vocab > tv ? model_vocab : tv;
        for (size_t i = 0; i < n; i++)
            if (ids[i] < 0 || ids[i] >= vocab) {
                cli_error("tokenize", "--decode: token id %d is outside 0..%d (the %s)", (int)ids[i], (int)vocab - 1,
                          model_vocab > tv ? "model's vocabulary" : "tokenizer's ids");
                rc = CLI_EXIT_USAGE;
                goto done;
            }
        if (df_tokenizer_decode(tok, ids, n, skip_special, &out, &len, &err) != DF_OK) {
            cli_error("tokenize", "%s", err.msg);
            goto done;
        }
        fwrite(out, 1, len, stdout);
        putchar('\n');
        free(out);
    }
    rc = CLI_EXIT_OK;
done:
    free(ids);
    free(file_text);
    df_tokenizer_free(tok);
    return rc;
}
