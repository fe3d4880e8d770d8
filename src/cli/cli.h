/* dflash command line: option tables, help text and helpers shared by the commands.
 *
 * Each command declares its options in a table (name, value kind, destination, default as
 * shown, help); cli_parse fills the destinations from argv ("--name VALUE" or
 * "--name=VALUE"), prints the help for --help, and rejects unknown options, missing or
 * malformed values and out-of-range numbers with a message on stderr. A separate value never
 * starts with "--" (that is the next option, and the option before it lacks its value):
 * such a value is written "--name=VALUE". Negative numbers ("-1") are values.
 */
#ifndef DFLASH_CLI_H
#define DFLASH_CLI_H

#include <stddef.h>
#include <stdint.h>

/* Exit codes */
#define CLI_EXIT_OK 0
#define CLI_EXIT_FAIL 1     /* the command ran and failed (model not loadable, ...) */
#define CLI_EXIT_USAGE 2    /* bad command line */

typedef enum cli_kind {
    CLI_STR,      /* const char ** */
    CLI_INT,      /* int *, within [lo, hi] */
    CLI_FLOAT,    /* float *, within [lo, hi] */
    CLI_FLOAT_GT, /* float *, within (lo, hi]: above lo (as the server's top_p) */
    CLI_U64,      /* uint64_t * */
    CLI_SIZE,     /* size_t *, within [lo, hi] */
    CLI_FLAG,     /* int *, set to 1; takes no value */
    CLI_LIST      /* cli_list *, repeatable */
} cli_kind;

typedef struct cli_list {
    const char **items;
    int n, max;
} cli_list;

typedef struct cli_opt {
    const char *name;      /* without the dashes: "max-tokens" */
    const char *metavar;   /* "N"; NULL for flags */
    cli_kind kind;
    void *dest;
    const char *def;       /* the default, as --help shows it */
    const char *help;
    double lo, hi;         /* range of numbers (ignored when lo == hi == 0) */
    int given;             /* set by cli_parse */
} cli_opt;

typedef struct cli_command {
    const char *name;      /* "generate" */
    const char *usage;     /* after "dflash generate " */
    const char *summary;   /* one paragraph */
    cli_opt *opts;
    int n_opts;
} cli_command;

/* Parses argv[0..argc) (the command's arguments, without "dflash CMD").
 * Returns -1 to go on, CLI_EXIT_OK after printing --help, CLI_EXIT_USAGE on an error. */
int cli_parse(cli_command *cmd, int argc, char **argv);
/* 1 when the argument arg is an option (it starts with "--"), so it cannot be the value of the
 * option before it; 0 for a value (including negative numbers like "-1"). */
int cli_is_option(const char *arg);

/* The arguments of a command that walks its own options (synth, bench), with each
 * "--name=VALUE" split into "--name" and VALUE: argv[argc] is NULL, is_value[i] is 1 where
 * argv[i] came from the right of an '=' (a value even when it starts with "--"). */
typedef struct cli_args {
    int argc;
    char **argv;
    unsigned char *is_value;
    char *store; /* the split names */
} cli_args;

/* Splits argv[0..argc) into *out (its own allocations: cli_args_free). 0, or -1 when out of
 * memory. */
int cli_args_split(cli_args *out, int argc, char **argv);
void cli_args_free(cli_args *a);
/* Runs a command's own option walker fn on argv split by cli_args_split; fn's exit status, or
 * CLI_EXIT_FAIL (with a message naming the command) when out of memory. */
int cli_run_split(const char *command, int argc, char **argv,
                  int (*fn)(int argc, char **argv, const unsigned char *is_value));
/* Prints a usage error for cmd to stderr and returns CLI_EXIT_USAGE. */
int cli_usage_error(const cli_command *cmd, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
/* The option named name (for .given). */
cli_opt *cli_find(cli_command *cmd, const char *name);

/* The model folder: `given` if non-NULL, else $DFLASH_MODEL, else the embedded demo model
 * (<exe dir>/../models/demo, then <source dir>/models/demo). Prints an error and returns -1
 * when there is none. */
int cli_model_dir(const char *given, char *out, size_t cap);
/* The embedded demo model's folder (models/demo next to the binary's folder, else in the source
 * tree), quietly: 0, or -1 when not found. */
int cli_demo_model_dir(char *out, size_t cap);
/* The public name of a model folder: its basename (after resolving "." and links), as text for
 * JSON and logs (control characters, and every non-ASCII byte of a name that is not UTF-8,
 * become '_'). */
void cli_model_id(const char *dir, char *out, size_t cap);
/* Parses "1,2,3" (option `what` of cmd) into a malloc'd id array: decimal integers that fit 32
 * bits (negative ones too: the caller checks the ids against its vocabulary and names the range).
 * Returns -1 if malformed, after cmd's usage error on stderr. */
int cli_parse_ids(const cli_command *cmd, const char *what, const char *s, int32_t **ids, size_t *n);
/* 0 when text (the value of option `opt` of cmd, e.g. "--prompt") is valid UTF-8; else cmd's
 * usage error naming the option and the first bad byte, and CLI_EXIT_USAGE. */
int cli_check_utf8(const cli_command *cmd, const char *opt, const char *text);
/* The same for text read from `what` (a file): a data error, cmd's error naming it and the
 * byte, and CLI_EXIT_FAIL (no usage text: the command line was right). */
int cli_check_utf8_data(const cli_command *cmd, const char *what, const char *text);
/* Prints `dflash CMD: message` to stderr. */
void cli_error(const char *cmd, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

/* 1 when the process started with its standard input closed (main then opens /dev/null in its
 * place, so that no file opened later takes descriptor 0): reading "-" is then an error. */
extern int cli_stdin_closed;

/* Reads a chat request file (an OpenAI chat-completions body, or a JSON array of messages;
 * path "-" = standard input, and pipes are read to their end) and validates it as the server
 * does (df_api_request_parse; the file's "model" is not
 * checked). vocab bounds logit_bias ids. Prints the error (naming the file) and returns -1,
 * or 0 with *req filled (free with df_api_request_free). */
struct df_api_request;
/* The whole text of file `path` ("-": standard input; streams read to their end), malloc'd and
 * NUL-terminated, *len its length (it may hold NUL bytes). NULL after an error message naming
 * the file (a folder, an open or read error, more than 256 MiB). */
char *cli_read_text(const char *cmd, const char *path, size_t *len);

int cli_read_chat_request(const char *cmd, const char *path, const char *model_id, int vocab,
                          struct df_api_request *req);
/* Prints a note to stderr naming the top-level fields of the chat request root (a jansson
 * object) that `dflash generate` does not apply (stream, logprobs, n, model, ...); nothing
 * when there are none. */
struct json_t;
void cli_note_ignored_fields(const char *cmd, const char *path, struct json_t *root);

/* A note on stderr ("dflash CMD: note: ...") when --threads asks for more threads than the CPUs
 * online: allowed, but compute threads beyond the CPUs take turns and slow decoding down. */
void cli_note_threads(const char *cmd, int threads);

/* The speculative decoding options shared by generate and serve (cli_opt table entries):
 * drafter (const char *), spec (df_spec_params), window (int), no_draft (int), quant (int). */
#define CLI_DRAFT_OPTIONS(drafter, spec, window, no_draft, quant)                                                   \
    {"drafter", "DIR", CLI_STR, &(drafter), "none", "DFlash drafter folder: greedy requests are decoded speculatively", 0, 0, 0}, \
    {"draft-block", "N", CLI_INT, &(spec).block, "4 (or the drafter's block size if smaller)", "tokens per draft block (the first one when adaptive)", 2, 16, 0}, \
    {"draft-adaptive", NULL, CLI_FLAG, &(spec).adaptive, "off", "adapt the block size to the acceptance", 0, 0, 0}, \
    {"draft-block-min", "N", CLI_INT, &(spec).block_min, "2", "with --draft-adaptive: smallest block", 2, 16, 0}, \
    {"draft-block-max", "N", CLI_INT, &(spec).block_max, "16", "with --draft-adaptive: largest block", 2, 16, 0}, \
    {"draft-always", NULL, CLI_FLAG, &(spec).no_fallback, "off", "draft every round; without it, plain steps are taken for a while when drafting is measured slower per token than plain decoding (the output is the same)", 0, 0, 0}, \
    {"draft-window", "N", CLI_INT, &(window), "2048", "drafter context positions kept", 1, 1 << 20, 0}, \
    {"draft-quant", "BITS", CLI_INT, &(quant), "off", "quantize the drafter's weights at load to 8 or 4 bits (faster drafts; the output never changes; 0 = off)", -(1 << 30), 1 << 30, 0}, \
    {"no-draft", NULL, CLI_FLAG, &(no_draft), "off", "load the drafter but decode plainly (x-dflash: fallback; reason=disabled)", 0, 0, 0}

/* Checks the combination of the CLI_DRAFT_OPTIONS given: draft options need --drafter, the
 * block range needs --draft-adaptive and must be ordered, --draft-quant is 4 or 8. Returns 0, or CLI_EXIT_USAGE after
 * printing the error. */
struct df_spec_params;
int cli_check_draft_options(cli_command *cmd, const char *drafter, int no_draft, const struct df_spec_params *spec,
                            int quant);

/* The commands (argv without "dflash CMD"). */
int cmd_generate(int argc, char **argv);
int cmd_tokenize(int argc, char **argv);
int cmd_serve(int argc, char **argv);
int cmd_render(int argc, char **argv);

#endif
