/* dflash synth: writes a synthetic pack with production shapes (include/dflash/synth.h).
 *
 *   dflash synth --config 27b|tiny --out DIR [--tokenizer DIR] [--no-drafter] [--seed N] [--threads N]
 *
 * The 27b config writes about 7.6 GB (target) + 3.5 GB (drafter in DIR/drafter): generate it
 * where it is used, never commit it. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli/cli.h"
#include "cli/commands_gpu.h"
#include "core/threads.h"
#include "dflash/synth.h"

static void progress(void *user, const char *file, double done, double total) {
    double *last = user;
    double now = df_now_ms();
    if (done < total && now - *last < 2000.0) return;
    *last = now;
    if (total < 1e9) fprintf(stderr, "synth: %s %.2f / %.2f MB\n", file, done / 1e6, total / 1e6);
    else fprintf(stderr, "synth: %s %.2f / %.2f GB\n", file, done / 1e9, total / 1e9);
}

static const char SYNTH_HELP[] =
    "usage: dflash synth --out DIR [options]\n\n"
    "Writes a random pack with the exact shapes and formats of a preset (for speed and memory\n"
    "measurements; its text is meaningless) and a DFlash drafter in DIR/drafter.\n\n"
    "options:\n"
    "  --out DIR           output folder: new, or without pack files (required)\n"
    "  --config 27b|tiny   preset: Ternary Bonsai 2 27B shapes (about 11 GB) or a tiny one (default: 27b)\n"
    "  --tokenizer DIR     folder whose tokenizer.json (+ tokenizer_config.json, chat_template.jinja)\n"
    "                      is copied (default: $DFLASH_MODEL, else the embedded demo model)\n"
    "  --no-drafter        no drafter\n"
    "  --seed N            random seed, an integer from 0 to 2^64-1 (default: 1)\n"
    "  --threads N         writer threads (default: all CPUs)\n"
    "  --help              show this help and exit\n";

/* A usage error's tail, as the other commands print it (the help's first line, then a pointer
 * to --help). */
static int usage(void) {
    fputs("usage: dflash synth --out DIR [options]\n(see 'dflash synth --help')\n", stderr);
    return 2;
}

static int synth_main(int argc, char **argv, const unsigned char *is_value) {
    df_synth_options o;
    memset(&o, 0, sizeof o);
    o.preset = "27b";
    o.tokenizer_dir = NULL; /* default: the embedded demo model's folder, see below */
    o.drafter = 1;
    o.seed = 1;
    static const char *const once[] = {"--config", "--out", "--tokenizer", "--no-drafter", "--seed", "--threads"};
    /* options followed by a value, which is never the next option (see cli_is_option) */
    static const char *const valued[] = {"--config", "--out", "--tokenizer", "--seed", "--threads"};
    int seen[sizeof once / sizeof once[0]] = {0};
    for (int i = 1; i < argc; i++) {
        for (size_t k = 0; k < sizeof once / sizeof once[0]; k++)
            if (!strcmp(argv[i], once[k]) && seen[k]++) {
                fprintf(stderr, "dflash synth: option %s given twice\n(see 'dflash synth --help')\n", argv[i]);
                return 2;
            }
        for (size_t k = 0; k < sizeof valued / sizeof valued[0]; k++)
            if (!strcmp(argv[i], valued[k]) && (i + 1 >= argc || (cli_is_option(argv[i + 1]) && !is_value[i + 1]))) {
                fprintf(stderr, "dflash synth: option %s needs a value\n(see 'dflash synth --help')\n", argv[i]);
                return 2;
            }
        if (!strcmp(argv[i], "--config") && i + 1 < argc) {
            o.preset = argv[++i];
            if (strcmp(o.preset, "27b") != 0 && strcmp(o.preset, "tiny") != 0) {
                fprintf(stderr, "dflash synth: --config takes 27b or tiny (got '%s')\n", o.preset);
                return usage();
            }
        }
        else if (!strcmp(argv[i], "--out") && i + 1 < argc) o.out_dir = argv[++i];
        else if (!strcmp(argv[i], "--tokenizer") && i + 1 < argc) o.tokenizer_dir = argv[++i];
        else if (!strcmp(argv[i], "--no-drafter")) o.drafter = 0;
        else if (!strcmp(argv[i], "--seed") && i + 1 < argc) {
            const char *v = argv[++i];
            char *end = NULL;
            errno = 0;
            const unsigned long long x = v[0] >= '0' && v[0] <= '9' ? strtoull(v, &end, 10) : 0;
            if (!end || *end || errno) {
                fprintf(stderr, "dflash synth: --seed takes an integer from 0 to 18446744073709551615 (got '%s')\n",
                        v);
                return usage();
            }
            o.seed = x;
        }
        else if (!strcmp(argv[i], "--threads") && i + 1 < argc) {
            char *end = NULL;
            const long t = strtol(argv[++i], &end, 10);
            if (end == argv[i] || *end || t < 0 || t > 4096) {
                fprintf(stderr, "dflash synth: --threads takes an integer within 0..4096 (got '%s')\n", argv[i]);
                return usage();
            }
            o.n_threads = (int)t;
        }
        else if (!strcmp(argv[i], "--help")) {
            fputs(SYNTH_HELP, stdout);
            return 0;
        }
        else {
            fprintf(stderr, "dflash synth: unknown option or missing value: %s\n", argv[i]);
            return usage();
        }
    }
    if (!o.out_dir) {
        fprintf(stderr, "dflash synth: --out DIR is required\n");
        return usage();
    }
    if (!o.out_dir[0] || (o.tokenizer_dir && !o.tokenizer_dir[0])) {
        fprintf(stderr, "dflash synth: --out and --tokenizer take a folder, not an empty path\n");
        return usage();
    }
    char tokdir[4096];
    if (!o.tokenizer_dir) { /* $DFLASH_MODEL, else the embedded demo model */
        const char *env = getenv("DFLASH_MODEL");
        if (env && env[0]) o.tokenizer_dir = env;
        else if (cli_demo_model_dir(tokdir, sizeof tokdir) == 0) o.tokenizer_dir = tokdir;
        else o.tokenizer_dir = "models/demo"; /* df_synth_pack reports what is missing */
    }
    double last = 0;
    o.progress = progress;
    o.progress_user = &last;
    double t0 = df_now_ms();
    df_error err = {0};
    if (df_synth_pack(&o, &err) != DF_OK) {
        fprintf(stderr, "dflash synth: %s\n", strncmp(err.msg, "synth: ", 7) == 0 ? err.msg + 7 : err.msg);
        return 1;
    }
    printf("synth: wrote %s pack to %s%s in %.1f s\n", o.preset, o.out_dir, o.drafter ? " (+ drafter/)" : "",
           (df_now_ms() - t0) / 1000.0);
    return 0;
}

int df_cmd_synth(int argc, char **argv) { return cli_run_split("synth", argc, argv, synth_main); }
