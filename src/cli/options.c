/* dflash command line: option parsing, --help, model folder resolution (see cli.h). */
#include "cli/cli.h"
#include "core/threads.h"

#include "dflash/speculative.h"
#include "dflash/tokenizer.h"

#include <ctype.h>
#include <errno.h>
#include <float.h>
#include <limits.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

void cli_error(const char *cmd, const char *fmt, ...) {
    fprintf(stderr, "dflash %s: ", cmd);
    va_list ap;
    va_start(ap, fmt);
    vfprintf(stderr, fmt, ap);
    va_end(ap);
    fputc('\n', stderr);
}

int cli_usage_error(const cli_command *cmd, const char *fmt, ...) {
    fprintf(stderr, "dflash %s: ", cmd->name);
    va_list ap;
    va_start(ap, fmt);
    vfprintf(stderr, fmt, ap);
    va_end(ap);
    fprintf(stderr, "\nusage: dflash %s %s\n(see 'dflash %s --help')\n", cmd->name, cmd->usage, cmd->name);
    return CLI_EXIT_USAGE;
}

/* The offset of text's first byte that is not UTF-8, or -1 when it is all valid. */
static long long utf8_bad_at(const char *text) {
    const size_t len = strlen(text), bad = df_utf8_invalid_at(text, len);
    return bad < len ? (long long)bad : -1;
}

int cli_check_utf8(const cli_command *cmd, const char *opt, const char *text) {
    const long long bad = utf8_bad_at(text);
    return bad >= 0 ? cli_usage_error(cmd, "%s: the text is not valid UTF-8 (byte %lld)", opt, bad) : 0;
}

int cli_check_utf8_data(const cli_command *cmd, const char *what, const char *text) {
    const long long bad = utf8_bad_at(text);
    if (bad < 0) return 0;
    cli_error(cmd->name, "%s: the text is not valid UTF-8 (byte %lld)", what, bad);
    return CLI_EXIT_FAIL;
}

int cli_is_option(const char *arg) { return strncmp(arg, "--", 2) == 0; }

void cli_note_threads(const char *cmd, int threads) {
    const int cpus = df_cpu_count();
    if (threads > cpus)
        fprintf(stderr,
                "dflash %s: note: --threads %d is more than the %d CPU%s online; the extra threads take turns and "
                "slow decoding down\n",
                cmd, threads, cpus, cpus == 1 ? "" : "s");
}

int cli_args_split(cli_args *out, int argc, char **argv) {
    memset(out, 0, sizeof *out);
    size_t bytes = 0;
    int n = 0;
    for (int i = 0; i < argc; i++) {
        const char *eq = cli_is_option(argv[i]) ? strchr(argv[i], '=') : NULL;
        n += eq && eq > argv[i] + 2 ? 2 : 1;
        if (eq) bytes += (size_t)(eq - argv[i]) + 1;
    }
    out->argv = calloc((size_t)n + 1, sizeof *out->argv);
    out->is_value = calloc((size_t)n + 1, 1);
    out->store = malloc(bytes + 1);
    if (!out->argv || !out->is_value || !out->store) {
        cli_args_free(out);
        return -1;
    }
    char *st = out->store;
    for (int i = 0; i < argc; i++) {
        const char *eq = cli_is_option(argv[i]) ? strchr(argv[i], '=') : NULL;
        if (eq && eq > argv[i] + 2) {
            const size_t k = (size_t)(eq - argv[i]);
            memcpy(st, argv[i], k);
            st[k] = 0;
            out->argv[out->argc++] = st;
            st += k + 1;
            out->is_value[out->argc] = 1;
            out->argv[out->argc++] = (char *)(eq + 1);
        } else {
            out->argv[out->argc++] = argv[i];
        }
    }
    return 0;
}

void cli_args_free(cli_args *a) {
    free(a->argv);
    free(a->is_value);
    free(a->store);
    memset(a, 0, sizeof *a);
}

int cli_run_split(const char *command, int argc, char **argv,
                  int (*fn)(int argc, char **argv, const unsigned char *is_value)) {
    cli_args a;
    if (cli_args_split(&a, argc, argv) != 0) {
        fprintf(stderr, "dflash %s: out of memory\n", command);
        return CLI_EXIT_FAIL;
    }
    const int rc = fn(a.argc, a.argv, a.is_value);
    cli_args_free(&a);
    return rc;
}

cli_opt *cli_find(cli_command *cmd, const char *name) {
    for (int i = 0; i < cmd->n_opts; i++)
        if (strcmp(cmd->opts[i].name, name) == 0) return &cmd->opts[i];
    return NULL;
}

static void print_help(const cli_command *cmd) {
    printf("usage: dflash %s %s\n\n%s\n\noptions:\n", cmd->name, cmd->usage, cmd->summary);
    for (int i = 0; i <= cmd->n_opts; i++) {
        const cli_opt *o = i < cmd->n_opts ? &cmd->opts[i] : NULL;
        char left[64];
        snprintf(left, sizeof left, "--%s%s%s", o ? o->name : "help", o && o->metavar ? " " : "",
                 o && o->metavar ? o->metavar : "");
        printf("  %-22s %s", left, o ? o->help : "show this help and exit");
        if (o && o->kind == CLI_LIST) printf(" (repeatable)");
        if (o) printf(" (default: %s)", o->def);
        putchar('\n');
    }
}

static int bad_value(const cli_command *cmd, const cli_opt *o, const char *v, const char *why) {
    return cli_usage_error(cmd, "invalid value '%s' for --%s: %s", v, o->name, why);
}

static int in_range(const cli_opt *o, double x) {
    if (o->lo == 0 && o->hi == 0) return 1;
    return (o->kind == CLI_FLOAT_GT ? x > o->lo : x >= o->lo) && x <= o->hi;
}

static int range_error(const cli_command *cmd, const cli_opt *o, const char *v) {
    char why[96];
    if (o->kind == CLI_INT || o->kind == CLI_SIZE)
        snprintf(why, sizeof why, "expected an integer from %lld to %lld", (long long)o->lo, (long long)o->hi);
    else if (o->kind == CLI_FLOAT_GT)
        snprintf(why, sizeof why, "expected a number above %g and at most %g", o->lo, o->hi);
    else
        snprintf(why, sizeof why, "expected a number from %g to %g", o->lo, o->hi);
    return bad_value(cmd, o, v, why);
}

/* Stores value v into o's destination; returns 0 or CLI_EXIT_USAGE. */
static int set_value(const cli_command *cmd, cli_opt *o, const char *v) {
    char *end = NULL;
    errno = 0;
    switch (o->kind) {
    case CLI_STR:
        if (!v[0] && o->metavar && (!strcmp(o->metavar, "DIR") || !strcmp(o->metavar, "FILE")))
            return bad_value(cmd, o, v, "expected a path, got an empty one");
        *(const char **)o->dest = v;
        return 0;
    case CLI_LIST: {
        cli_list *l = o->dest;
        if (l->n >= l->max) {
            char why[64];
            snprintf(why, sizeof why, "at most %d may be given", l->max);
            return bad_value(cmd, o, v, why);
        }
        l->items[l->n++] = v;
        return 0;
    }
    case CLI_INT:
    case CLI_SIZE: {
        if (isspace((unsigned char)v[0])) return bad_value(cmd, o, v, "expected an integer"); /* as trailing space */
        long long x = strtoll(v, &end, 10);
        if (errno == ERANGE && end != v && !*end && !(o->lo == 0 && o->hi == 0))
            return range_error(cmd, o, v); /* an integer past 64 bits: past the range too */
        if (errno || end == v || *end) return bad_value(cmd, o, v, "expected an integer");
        if (!in_range(o, (double)x)) return range_error(cmd, o, v);
        if (o->kind == CLI_INT) {
            if (x < INT_MIN || x > INT_MAX) return bad_value(cmd, o, v, "out of range");
            *(int *)o->dest = (int)x;
        } else {
            if (x < 0) return bad_value(cmd, o, v, "expected a non-negative integer");
            *(size_t *)o->dest = (size_t)x;
        }
        return 0;
    }
    case CLI_U64: { /* a 64-bit value: 0..2^64-1, or a negative int64 taken modulo 2^64 (as the server's "seed") */
        if (isspace((unsigned char)v[0])) return bad_value(cmd, o, v, "expected an integer from -9223372036854775808 to 18446744073709551615");
        if (v[0] == '-') {
            long long x = strtoll(v, &end, 10);
            if (errno || end == v || *end) return bad_value(cmd, o, v, "expected an integer from -9223372036854775808 to 18446744073709551615");
            *(uint64_t *)o->dest = (uint64_t)x;
            return 0;
        }
        unsigned long long x = strtoull(v, &end, 10);
        if (errno || end == v || *end) return bad_value(cmd, o, v, "expected an integer from -9223372036854775808 to 18446744073709551615");
        *(uint64_t *)o->dest = (uint64_t)x;
        return 0;
    }
    case CLI_FLOAT:
    case CLI_FLOAT_GT: {
        /* decimal only: strtod would also take hex floats ("0x1"), "inf" and "nan" */
        if (strpbrk(v, "xXnN")) return bad_value(cmd, o, v, "expected a number");
        double x = strtod(v, &end);
        const int erange = errno == ERANGE; /* past the double range: overflow, or underflow to ~0 */
        if ((errno && !erange) || end == v || *end || isspace((unsigned char)v[0]))
            return bad_value(cmd, o, v, "expected a number");
        /* as the server, whose JSON numbers parse the same way: 1e400 is out of range, 1e-400 is 0 */
        if (!isfinite(x) || !in_range(o, x)) return range_error(cmd, o, v);
        float f = (float)x;
        /* above an open lower bound, a value float32 rounds onto the bound is the next float */
        if (o->kind == CLI_FLOAT_GT && f <= (float)o->lo) f = o->lo == 0 ? FLT_MIN : nextafterf((float)o->lo, INFINITY);
        *(float *)o->dest = f;
        return 0;
    }
    case CLI_FLAG:
        *(int *)o->dest = 1;
        return 0;
    }
    return CLI_EXIT_USAGE;
}

/* The option of cmd named by the nlen bytes at name, or NULL. */
static cli_opt *find_opt(cli_command *cmd, const char *name, size_t nlen) {
    for (int k = 0; k < cmd->n_opts; k++)
        if (strlen(cmd->opts[k].name) == nlen && strncmp(cmd->opts[k].name, name, nlen) == 0) return &cmd->opts[k];
    return NULL;
}

int cli_parse(cli_command *cmd, int argc, char **argv) {
    /* --help (or -h) where an option may stand, before any error: the value of an option that
     * takes one is skipped, so `--prompt -h` prompts with "-h" */
    for (int i = 0; i < argc; i++) {
        const char *a = argv[i];
        if (strcmp(a, "--help") == 0 || strcmp(a, "-h") == 0) {
            print_help(cmd);
            return CLI_EXIT_OK;
        }
        if (strncmp(a, "--", 2) != 0 || strchr(a, '=')) continue;
        const cli_opt *o = find_opt(cmd, a + 2, strlen(a + 2));
        if (o && o->kind != CLI_FLAG && i + 1 < argc && !cli_is_option(argv[i + 1])) i++;
    }
    for (int i = 0; i < argc; i++) {
        const char *a = argv[i];
        if (strncmp(a, "--", 2) != 0 || !a[2]) return cli_usage_error(cmd, "unexpected argument '%s'", a);
        const char *name = a + 2, *eq = strchr(name, '=');
        size_t nlen = eq ? (size_t)(eq - name) : strlen(name);
        cli_opt *o = find_opt(cmd, name, nlen);
        if (!o) return cli_usage_error(cmd, "unknown option '%.*s'", (int)(nlen + 2), a);
        const char *v = NULL;
        if (o->kind == CLI_FLAG) {
            if (eq) return cli_usage_error(cmd, "option --%s takes no value", o->name);
        } else if (eq) {
            v = eq + 1;
        } else {
            if (i + 1 >= argc) return cli_usage_error(cmd, "option --%s needs a value (%s)", o->name, o->metavar);
            if (cli_is_option(argv[i + 1]))
                return cli_usage_error(cmd,
                                       "option --%s needs a value (%s), but '%s' follows it (a value that starts "
                                       "with '--' is written --%s=VALUE)",
                                       o->name, o->metavar, argv[i + 1], o->name);
            v = argv[++i];
        }
        if (o->given && o->kind != CLI_LIST) return cli_usage_error(cmd, "option --%s given twice", o->name);
        int rc = set_value(cmd, o, v);
        if (rc) return rc;
        o->given = 1;
    }
    return -1;
}

/* ---- model folder ---------------------------------------------------------------------- */

static int is_model_dir(const char *dir) {
    char path[PATH_MAX];
    struct stat st;
    if (snprintf(path, sizeof path, "%s/config.json", dir) >= (int)sizeof path) return 0;
    return stat(path, &st) == 0 && S_ISREG(st.st_mode);
}

int cli_model_dir(const char *given, char *out, size_t cap) {
    const char *env = getenv("DFLASH_MODEL");
    const char *chosen = given ? given : (env && env[0] ? env : NULL);
    if (chosen) {
        if (snprintf(out, cap, "%s", chosen) >= (int)cap) {
            fprintf(stderr, "dflash: model path too long\n");
            return -1;
        }
        return 0;
    }
    if (cli_demo_model_dir(out, cap) == 0) return 0;
    fprintf(stderr, "dflash: no model given and the embedded demo model (models/demo) was not found; "
                    "use --model DIR or set DFLASH_MODEL\n");
    return -1;
}

int cli_demo_model_dir(char *out, size_t cap) {
    char exe[PATH_MAX];
    ssize_t n = readlink("/proc/self/exe", exe, sizeof exe - 1);
    if (n > 0) {
        exe[n] = 0;
        char *slash = strrchr(exe, '/');
        if (slash) {
            *slash = 0;
            if (snprintf(out, cap, "%s/../models/demo", exe) < (int)cap && is_model_dir(out)) return 0;
        }
    }
#ifdef DFLASH_SOURCE_DIR
    if (snprintf(out, cap, "%s/models/demo", DFLASH_SOURCE_DIR) < (int)cap && is_model_dir(out)) return 0;
#endif
    return -1;
}

void cli_model_id(const char *dir, char *out, size_t cap) {
    char *real = realpath(dir, NULL);
    const char *p = real ? real : dir;
    size_t n = strlen(p);
    while (n > 1 && p[n - 1] == '/') n--;
    size_t start = n;
    while (start > 0 && p[start - 1] != '/') start--;
    snprintf(out, cap, "%.*s", (int)(n - start), p + start);
    if (!out[0]) snprintf(out, cap, "model");
    free(real);
    /* the id is text in JSON answers and log lines: control characters become '_', and a name
     * that is not UTF-8 keeps its ASCII bytes only (the others become '_') */
    const size_t len = strlen(out);
    const int bad_utf8 = df_utf8_invalid_at(out, len) < len;
    for (size_t i = 0; i < len; i++) {
        const unsigned char c = (unsigned char)out[i];
        if (c < 0x20 || c == 0x7f || (bad_utf8 && c >= 0x80)) out[i] = '_';
    }
}

int cli_parse_ids(const cli_command *cmd, const char *what, const char *s, int32_t **ids, size_t *n) {
    size_t cap = 1;
    for (const char *p = s; *p; p++) cap += *p == ',';
    int32_t *v = malloc(cap * sizeof *v);
    if (!v) return -1;
    size_t k = 0;
    const char *p = s;
    while (*p) {
        char *end;
        errno = 0;
        const int digit = (p[0] >= '0' && p[0] <= '9') || (p[0] == '-' && p[1] >= '0' && p[1] <= '9');
        long x = digit ? strtol(p, &end, 10) : 0;
        if (!digit || end == p || (*end && *end != ',')) { /* not a number (no sign but '-', no spaces) */
            free(v);
            cli_usage_error(cmd, "%s: expected comma-separated token ids (like 1,2,3), got '%s'", what, s);
            return -1;
        }
        if (errno || x < INT32_MIN || x > INT32_MAX) { /* past 32 bits: a number, but never a token id (the
                                                           rest, negative ones too, the command checks against
                                                           its vocabulary) */
            const int len = (int)(end - p);
            free(v);
            cli_usage_error(cmd, "%s: token id %.*s is outside every vocabulary", what, len > 40 ? 40 : len, p);
            return -1;
        }
        v[k++] = (int32_t)x;
        p = *end ? end + 1 : end;
        if (*end == ',' && !*p) {
            free(v);
            cli_usage_error(cmd, "%s: trailing comma in '%s'", what, s);
            return -1;
        }
    }
    if (k == 0) {
        free(v);
        cli_usage_error(cmd, "%s: no token ids given", what);
        return -1;
    }
    *ids = v;
    *n = k;
    return 0;
}

int cli_check_draft_options(cli_command *cmd, const char *drafter, int no_draft, const struct df_spec_params *spec,
                            int quant) {
    if (quant != 0 && quant != 4 && quant != 8) return cli_usage_error(cmd, "--draft-quant must be 4 or 8, or 0 for off (got %d)", quant);
    if (!drafter)
        for (int i = 0; i < cmd->n_opts; i++)
            if (!strncmp(cmd->opts[i].name, "draft-", 6) && cmd->opts[i].given)
                return cli_usage_error(cmd, "--%s needs --drafter", cmd->opts[i].name);
    if (!drafter && no_draft) return cli_usage_error(cmd, "--no-draft needs --drafter");
    if (!spec->adaptive && (cli_find(cmd, "draft-block-min")->given || cli_find(cmd, "draft-block-max")->given))
        return cli_usage_error(cmd, "--draft-block-min and --draft-block-max need --draft-adaptive");
    if (spec->block_min > spec->block_max)
        return cli_usage_error(cmd, "--draft-block-min %d is above --draft-block-max %d", spec->block_min,
                               spec->block_max);
    if (spec->adaptive && spec->block != 0 && (spec->block < spec->block_min || spec->block > spec->block_max))
        return cli_usage_error(cmd, "--draft-block %d lies outside --draft-block-min %d .. --draft-block-max %d",
                               spec->block, spec->block_min, spec->block_max);
    if (no_draft && spec->no_fallback) return cli_usage_error(cmd, "--draft-always and --no-draft contradict each other");
    return 0;
}
