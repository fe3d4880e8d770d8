/* dflash command-line entry point: dflash serve | generate | render | tokenize | synth | bench. */
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>

#include "cli/cli.h"
#include "cli/commands_gpu.h"

#define DFLASH_VERSION_STRING "0.1.0"

/* synth and bench take argv[0] = their own name */
static int cmd_synth(int argc, char **argv) { return df_cmd_synth(argc + 1, argv - 1); }
static int cmd_bench(int argc, char **argv) { return df_cmd_bench(argc + 1, argv - 1); }

static const struct {
    const char *name;
    int (*run)(int argc, char **argv);
    const char *summary;
} commands[] = {
    {"serve", cmd_serve, "serve the model over an OpenAI-compatible HTTP API"},
    {"generate", cmd_generate, "generate text from a prompt (streams to stdout, or --json)"},
    {"render", cmd_render, "print the prompt a chat request renders to with the pack's chat template"},
    {"tokenize", cmd_tokenize, "encode text to token ids, or decode ids to text"},
    {"synth", cmd_synth, "write a random pack with the exact shapes of a real one (e.g. --config 27b)"},
    {"bench", cmd_bench, "measure decode, verify and speculative speed (also at a synthetic acceptance)"},
};
#define N_COMMANDS ((int)(sizeof commands / sizeof commands[0]))

static void usage(FILE *f) {
    fprintf(f, "usage: dflash <command> [options]\n\ncommands:\n");
    for (int i = 0; i < N_COMMANDS; i++) fprintf(f, "  %-10s %s\n", commands[i].name, commands[i].summary);
    fprintf(f, "\n'dflash <command> --help' (or 'dflash help <command>') lists the command's options and their\n"
               "defaults; 'dflash --version' prints the version.\n"
               "With no --model, commands use $DFLASH_MODEL, else the embedded demo model (models/demo).\n");
}

int cli_stdin_closed = 0;
static int stdout_closed = 0;

/* A closed standard stream would be the next file opened (a model file read as a request on
 * "-", an output file written with the text meant for standard output): standard input and
 * error get /dev/null, standard output /dev/full (so that output written to it fails, as on the
 * closed stream). Opened in order, each takes the lowest free descriptor: its own. */
static void keep_standard_streams(void) {
    for (int fd = 0; fd <= 2; fd++) {
        if (fcntl(fd, F_GETFD) != -1 || errno != EBADF) continue;
        if (fd == 0) cli_stdin_closed = 1;
        if (fd == 1) stdout_closed = 1;
        (void)open(fd == 1 ? "/dev/full" : "/dev/null", fd == 0 ? O_RDONLY : O_WRONLY);
    }
}

/* rc, or 1 when output to standard output could not be written (a full disk, a closed pipe):
 * then with a message naming what (the command). */
static int flushed(const char *what, int rc) {
    if (fflush(stdout) != 0 || ferror(stdout)) {
        fprintf(stderr, "dflash%s%s: cannot write the output: %s\n", what[0] ? " " : "", what,
                stdout_closed ? "standard output is closed" : strerror(errno));
        if (rc == CLI_EXIT_OK) rc = 1;
    }
    return rc;
}

int main(int argc, char **argv) {
    keep_standard_streams();
    /* a write to a reader that left fails with EPIPE, which every command reports (exit 1,
     * "cannot write the output: Broken pipe"), instead of killing the process */
    signal(SIGPIPE, SIG_IGN);
    if (argc < 2) {
        usage(stderr);
        return CLI_EXIT_USAGE;
    }
    const int is_help = strcmp(argv[1], "--help") == 0 || strcmp(argv[1], "-h") == 0 || strcmp(argv[1], "help") == 0;
    if (is_help && argc == 3) { /* "dflash help COMMAND": that command's help */
        for (int i = 0; i < N_COMMANDS; i++) {
            if (strcmp(argv[2], commands[i].name) != 0) continue;
            char help[] = "--help";
            char *sub[] = {help, NULL};
            return flushed(commands[i].name, commands[i].run(1, sub));
        }
        fprintf(stderr, "dflash: unknown command '%s'\n", argv[2]);
        usage(stderr);
        return CLI_EXIT_USAGE;
    }
    if ((is_help || strcmp(argv[1], "--version") == 0 || strcmp(argv[1], "version") == 0) && argc > 2) {
        fprintf(stderr, "dflash: unexpected argument '%s' after '%s'\n", argv[2], argv[1]);
        usage(stderr);
        return CLI_EXIT_USAGE;
    }
    if (strcmp(argv[1], "--help") == 0 || strcmp(argv[1], "-h") == 0 || strcmp(argv[1], "help") == 0) {
        usage(stdout);
        return flushed("", CLI_EXIT_OK);
    }
    if (strcmp(argv[1], "--version") == 0 || strcmp(argv[1], "version") == 0) {
#ifdef DFLASH_WITH_CUDA
        printf("dflash %s (CUDA backend built)\n", DFLASH_VERSION_STRING);
#else
        printf("dflash %s (CPU only)\n", DFLASH_VERSION_STRING);
#endif
        return flushed("", CLI_EXIT_OK);
    }
    for (int i = 0; i < N_COMMANDS; i++) {
        if (strcmp(argv[1], commands[i].name) != 0) continue;
        return flushed(argv[1], commands[i].run(argc - 2, argv + 2));
    }
    fprintf(stderr, "dflash: unknown command '%s'\n", argv[1]);
    usage(stderr);
    return CLI_EXIT_USAGE;
}
