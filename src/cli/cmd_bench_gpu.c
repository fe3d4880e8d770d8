/* dflash bench: decode speed against the weight-streaming floor, the verify cost curve, the
 * drafter pass, speculative decoding at a synthetic acceptance rate, and device memory.
 *
 *   dflash bench [--model DIR] [--drafter DIR] [--device cuda|cpu] [--ctx N] [--gen N]
 *                [--block B[,B...]] [--synthetic-acceptance TAU]... [--repeats N]
 *                [--memory-ctx N[,N...]] [--window N] [--threads N] [--no-verify-curve]
 *                [--draft-quant-pass BITS[,BITS]] [--draft-quant BITS]
 *
 * --draft-quant-pass 8,4 also times the drafter pass with its weights quantized at load to
 * those bits (df_drafter_quantize); --draft-quant BITS runs the drafter of every speculative run
 * (synthetic acceptance, identity) with weights quantized so, as `serve --draft-quant` does.
 * Speed at synthetic acceptance: the drafter runs for real every round, then its proposals are
 * replaced (df_spec_params.override) by the target's own greedy output with one position
 * corrupted, so that a round accepts a = floor(TAU-1) or ceil(TAU-1) drafts (mean TAU-1, i.e.
 * TAU tokens per round); the output is checked token for token against the plain greedy run of
 * the same prompt in the same process. The figure is a speed at an assumed acceptance, not a
 * measurement of a drafter's quality.
 *
 * The floor of a decode step: bytes that must be read per token (every linear but the
 * embedding, without the biases of ternary weights, which are their scales negated; GDN states
 * read + written, the KV cache read at the context length, float32 as stored) over the measured
 * device copy bandwidth (read + write bytes per second). */
#include <ctype.h>
#include <errno.h>
#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "cli/cli.h"
#include "cli/commands_gpu.h"
#include "core/threads.h"
#include "dflash/drafter.h"
#include "dflash/engine.h"
#include "dflash/generate.h"
#include "dflash/speculative.h"
#include "decode/textout.h"
#include "model/target.h"
#ifdef DFLASH_WITH_CUDA
#include "backend/cuda/cuda_backend.h"
#endif

#define MAX_LIST 8

typedef struct bench_opts {
    const char *model, *drafter, *device;
    int ctx, gen, repeats, window, threads, verify_curve;
    int blocks[MAX_LIST], n_blocks;
    double taus[MAX_LIST];
    int n_taus;
    int mem_ctx[MAX_LIST], n_mem;
    int quant[MAX_LIST], n_quant; /* --draft-quant-pass: bits of extra drafter pass timings */
    int draft_quant;              /* --draft-quant: the drafter's weight bits in the speculative runs (0: as stored) */
    int id_prompts, id_tokens;    /* --identity N,T: speculative == plain check */
} bench_opts;

/* An int from the whole of s (decimal, no sign for lists); 0 on success. */
static int strict_int(const char *s, int *out) {
    if (!s || !*s || isspace((unsigned char)*s)) return -1;
    char *end = NULL;
    errno = 0;
    const long v = strtol(s, &end, 10);
    if (errno || end == s || *end || v < INT_MIN || v > INT_MAX) return -1;
    *out = (int)v;
    return 0;
}

/* A comma-separated list of 1..max ints ("4,8,16": no empty items); the count, or -1 for a
 * malformed list, -2 for more than max items. */
static int parse_list(const char *s, int *out, int max) {
    int n = 0;
    char item[32];
    for (;;) {
        const char *c = strchr(s, ',');
        const size_t len = c ? (size_t)(c - s) : strlen(s);
        if (len == 0 || len >= sizeof item) return -1;
        if (n == max) return -2;
        memcpy(item, s, len);
        item[len] = 0;
        if (strict_int(item, &out[n]) != 0) return -1;
        n++;
        if (!c) return n;
        s = c + 1;
    }
}

static int cmp_d(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static double median(double *v, int n) {
    qsort(v, (size_t)n, sizeof(double), cmp_d);
    return v[n / 2];
}

static void sync_dev(df_engine *e) {
#ifdef DFLASH_WITH_CUDA
    if (strcmp(e->be->ops->name, "cuda") == 0) df_backend_cuda_sync(e->be);
#else
    (void)e;
#endif
}

static int is_cuda(df_engine *e) { return strcmp(e->be->ops->name, "cuda") == 0; }

/* Bytes a decode step at context ctx must read (float32 KV and states as stored); a ternary
 * weight's biases (its scales negated) are not counted: they need not be read. */
static double linear_bytes(const df_linear *L) {
    if (L->bits > 0)
        return (double)L->rows * (double)L->cols * L->bits / 8.0 +
               (df_linear_biases_negate_scales(L) ? 1.0 : 2.0) * (double)L->rows * (double)(L->cols / L->group_size) * 2.0;
    return (double)L->rows * (double)L->cols * (L->wdtype == DF_DTYPE_F32 ? 4.0 : 2.0);
}

static void step_bytes(const df_pack *pk, int ctx, double *weights, double *states, double *kv) {
    const df_text_config *c = &pk->cfg;
    double w = linear_bytes(&pk->lm_head), st = 0, k = 0;
    for (int l = 0; l < c->n_layers; l++) {
        const df_layer_weights *L = &pk->layers[l];
        if (L->kind == DF_LAYER_FULL_ATTENTION) {
            w += linear_bytes(&L->q_proj) + linear_bytes(&L->k_proj) + linear_bytes(&L->v_proj) +
                 linear_bytes(&L->o_proj);
            k += 2.0 * (double)ctx * c->n_kv_heads * c->head_dim * 4.0;
        } else {
            w += linear_bytes(&L->in_proj_qkv) + linear_bytes(&L->in_proj_z) + linear_bytes(&L->in_proj_a) +
                 linear_bytes(&L->in_proj_b) + linear_bytes(&L->out_proj);
            st += 2.0 * (double)c->lin_n_v_heads * c->lin_k_head_dim * c->lin_v_head_dim * 4.0;
        }
        w += linear_bytes(&L->gate_proj) + linear_bytes(&L->up_proj) + linear_bytes(&L->down_proj);
    }
    *weights = w;
    *states = st;
    *kv = k;
}

/* ---- synthetic acceptance -------------------------------------------------------------------- */

#ifdef DFLASH_WITH_CUDA
static df_cuda_stats g_stats_mark;
#endif

/* Remembers the CUDA backend's step counters (cuda_stats_print reports the steps since). */
static void cuda_stats_mark(df_engine *e) {
#ifdef DFLASH_WITH_CUDA
    if (is_cuda(e)) df_backend_cuda_stats(e->be, &g_stats_mark);
#else
    (void)e;
#endif
}

/* Prints the CUDA backend's steps since the last mark: how many ran, were replayed as graphs,
 * or were captured. */
static void cuda_stats_print(df_engine *e, const char *indent) {
#ifdef DFLASH_WITH_CUDA
    if (is_cuda(e)) {
        df_cuda_stats cs;
        df_backend_cuda_stats(e->be, &cs);
        const long n = cs.graph_replays - g_stats_mark.graph_replays;
        printf("%sCUDA steps: %ld, replayed as graphs: %ld, graphs captured: %ld; host time per replayed step: %.1f us "
               "before it (the device idle), %.1f us to launch it\n",
               indent, cs.steps - g_stats_mark.steps, n, cs.graph_captures - g_stats_mark.graph_captures,
               n > 0 ? (cs.host_between_ms - g_stats_mark.host_between_ms) * 1e3 / (double)n : 0.0,
               n > 0 ? (cs.host_launch_ms - g_stats_mark.host_launch_ms) * 1e3 / (double)n : 0.0);
        const long ns = cs.steps - g_stats_mark.steps;
        if (ns > 0)
            printf("%s  commands recorded per step: %.0f; host ms per step in weight lookups %.3f, in records %.3f "
                   "(DFLASH_CUDA_HOST_PROFILE=1; all steps)\n",
                   indent, (double)(cs.commands - g_stats_mark.commands) / (double)ns,
                   (cs.host_weights_ms - g_stats_mark.host_weights_ms) / (double)ns,
                   (cs.host_record_ms - g_stats_mark.host_record_ms) / (double)ns);
        g_stats_mark = cs;
    }
#else
    (void)e;
    (void)indent;
#endif
}

typedef struct synth_acc {
    const int32_t *plain;
    int n_plain, vocab;
    double tau;
    uint64_t rng;
} synth_acc;

static void synth_propose(void *user, int n_generated, int32_t bonus, int B, int32_t *drafts) {
    (void)bonus;
    synth_acc *s = user;
    s->rng = s->rng * 6364136223846793005ULL + 1442695040888963407ULL;
    double u = (double)(s->rng >> 11) / 9007199254740992.0;
    double want = s->tau - 1.0;
    int a = (int)floor(want) + (u < want - floor(want) ? 1 : 0);
    if (a > B - 1) a = B - 1;
    if (a < 0) a = 0;
    for (int k = 0; k < B - 1; k++) {
        int idx = n_generated + k;
        int32_t v = idx < s->n_plain ? s->plain[idx] : 0;
        if (k == a) v = (v + 1) % s->vocab; /* the first wrong draft */
        drafts[k] = v;
    }
}

/* ---- phases ----------------------------------------------------------------------------------- */

static int32_t *make_prompt(int n, int vocab) {
    int32_t *p = malloc((size_t)(n > 0 ? n : 1) * sizeof(int32_t));
    int range = vocab > 200100 ? 200000 : vocab - 100;
    for (int i = 0; p && i < n; i++) p[i] = (int32_t)(((int64_t)i * 7919 + 11) % range + 50);
    return p;
}

/* Greedy plain decoding of gen tokens after a ctx-token prompt: the ids (an EOS id ends the run;
 * the ids after it are -1), *n the ids generated, the prefill time and the mean step time. NULL
 * with err set on failure (DF_ERR_NUMERIC for non-finite logits). */
static int32_t *plain_run(df_session *s, const int32_t *prompt, int ctx, int gen, double *prefill_ms, double *ms, int *n_out,
                          df_error *err) {
    df_engine *e = s->eng;
    const int V = df_engine_vocab_size(e);
    df_ahead g; /* the loop of df_generate: each step queued before the previous token is read */
    int on = 0;  /* g begun */
    float *lg = malloc((size_t)V * sizeof(float));
    int32_t *out = malloc((size_t)gen * sizeof(int32_t));
    if (!lg || !out) {
        free(lg);
        free(out);
        df_error_set(err, DF_ERR_NOMEM, "out of memory");
        return NULL;
    }
    df_session_reset(s);
    double t0 = df_now_ms();
    if (df_session_prefill(s, prompt, ctx, lg, err) != DF_OK) goto fail;
    double t1 = df_now_ms();
    out[0] = df_argmax(lg, V);
    if (out[0] < 0) {
        df_gen_non_finite(err, 0);
        goto fail;
    }
    int n = 1;
    for (; n < gen; n++) {
        if (df_engine_is_eos(e, out[n - 1])) break;
        if (!on && df_ahead_begin(s, &g, out[0], NULL, err) != DF_OK) goto fail;
        on = 1;
        if (df_ahead_next(s, &g, n + 1 < gen, &out[n], err) != DF_OK) goto fail;
        if (out[n] < 0) {
            df_gen_non_finite(err, n);
            goto fail;
        }
    }
    if (on) df_ahead_end(s, &g);
    on = 0;
    sync_dev(e);
    double t2 = df_now_ms();
    *prefill_ms = t1 - t0;
    *ms = (t2 - t1) / (double)(n > 1 ? n - 1 : 1);
    free(lg);
    for (int i = n; i < gen; i++) out[i] = -1;
    *n_out = n;
    return out;
fail:
    if (on) df_ahead_end(s, &g);
    free(lg);
    free(out);
    return NULL;
}

static size_t peak_bytes(df_engine *e) {
#ifdef DFLASH_WITH_CUDA
    if (is_cuda(e)) {
        df_cuda_stats st;
        df_backend_cuda_stats(e->be, &st);
        return st.peak_bytes;
    }
#endif
    (void)e;
    return 0;
}

static void reset_peak(df_engine *e) {
#ifdef DFLASH_WITH_CUDA
    if (is_cuda(e)) df_backend_cuda_reset_peak(e->be);
#else
    (void)e;
#endif
}

/* Peak device memory (bytes held by the backend: weights, buffers, scratch) of a plain session
 * at context C: up to 4096 positions a real prefill + 8 decode steps; beyond, a 16-row-tile
 * prefill of C positions reads the cache O(C^2/16) times (hours at 32k), so the positions are
 * advanced without a prefill (the KV cache for C positions is allocated all the same) before
 * the decode steps. Then a 16-row verify-shaped pass at C: *verify_peak. */
static int mem_plain(df_engine *e, const int32_t *prompt, int C, size_t *plain_peak, size_t *verify_peak,
                     df_error *err) {
    df_session *ms = NULL;
    reset_peak(e);
    if (df_session_init(&ms, e, C + 80, err) != DF_OK) return 0;
    int ok = 1;
    if (C <= 4096) ok = df_session_prefill(ms, prompt, C, NULL, err) == DF_OK;
    else ms->pos = C - 16;
    int32_t id = prompt[1], am[16];
    for (int i = 0; ok && i < 8; i++) ok = df_target_forward_argmax(ms, &id, 1, am, err) == DF_OK;
    sync_dev(e);
    *plain_peak = peak_bytes(e);
    ms->pos -= 8;
    if (ok) ok = df_target_forward_argmax(ms, prompt, 16, am, err) == DF_OK;
    sync_dev(e);
    *verify_peak = peak_bytes(e);
    df_session_free(ms);
    return ok;
}

static size_t weight_bytes(df_engine *e) {
#ifdef DFLASH_WITH_CUDA
    if (is_cuda(e)) {
        df_cuda_stats st;
        df_backend_cuda_stats(e->be, &st);
        return st.weight_bytes;
    }
#endif
    (void)e;
    return 0;
}

static const char BENCH_HELP[] =
    "usage: dflash bench [--model DIR] [options]\n\n"
    "Decode speed against the weight-streaming floor, the verify cost curve, the drafter pass, speculative\n"
    "speed at a synthetic acceptance rate, and device memory.\n\n"
    "options:\n"
    "  --model DIR                  model pack folder (default: $DFLASH_MODEL, else the demo model)\n"
    "  --drafter DIR                DFlash drafter (default: DIR/drafter when present)\n"
    "  --device cuda|cpu            (default: cuda)\n"
    "  --ctx N                      prompt length, >= 1 (default: 1024)\n"
    "  --gen N                      tokens generated per run, >= 2 (default: 128)\n"
    "  --repeats N                  samples per median, >= 1 (default: 7)\n"
    "  --block B[,B...]             draft blocks of the synthetic-acceptance runs, 2..16 (default: 16)\n"
    "  --synthetic-acceptance TAU   tokens per round to simulate, > 1 (repeatable; default: none)\n"
    "  --memory-ctx N[,N...]        contexts of the peak-memory measurement, >= 1 (default: none)\n"
    "  --window N                   drafter context window, >= 1 (default: 4096)\n"
    "  --threads N                  CPU threads (default: all)\n"
    "  --no-verify-curve            skip t(B)/t(1) for B = 1..16\n"
    "  --draft-quant-pass BITS,...  also time the drafter pass with 8/4-bit weights (default: none)\n"
    "  --draft-quant BITS           run the drafter with its weights quantized to 8 or 4 bits at load, as\n"
    "                               serve --draft-quant (proposals change, never the output; 0, the default:\n"
    "                               as stored)\n"
    "  --identity N,T               check speculative == plain greedy on N prompts x T tokens, with the\n"
    "                               real drafter (default block) and at synthetic acceptance 4.5 (block 8)\n"
    "  --help                       show this help and exit\n";

static int usage_error(const char *fmt, const char *arg) {
    fprintf(stderr, "dflash bench: ");
    fprintf(stderr, fmt, arg);
    fprintf(stderr, "\n(see 'dflash bench --help')\n");
    return 2;
}

/* Drafter pass time at B = 8 and 16 over nctx context rows of random features (printed). */
static int draft_pass_times(df_engine *e, df_draft_state *ds, int32_t tok, int nctx, int repeats, const char *label,
                            df_error *err) {
    const df_drafter_config *dc = df_drafter_get_config(df_draft_state_drafter(ds));
    const int F = dc->n_taps * dc->hidden_size;
    float *feats = malloc((size_t)16 * (size_t)F * sizeof(float));
    double *smp = malloc((size_t)repeats * sizeof(double));
    if (!feats || !smp) {
        free(feats);
        free(smp);
        df_error_set(err, DF_ERR_NOMEM, "bench: out of memory");
        return 0;
    }
    uint64_t r = 99;
    for (size_t i = 0; i < (size_t)16 * (size_t)F; i++) {
        r = r * 6364136223846793005ULL + 1442695040888963407ULL;
        feats[i] = (float)((double)(r >> 40) / (double)(1ULL << 24)) - 0.5f;
    }
    int ok = 1;
    for (int i = 0; ok && i < nctx; i += 16) {
        int n = nctx - i < 16 ? nctx - i : 16;
        ok = df_draft_add_context(ds, feats, n, i, err) == DF_OK;
    }
    const int bs[] = {8, 16};
    for (int k = 0; ok && k < 2; k++) {
        int32_t drafts[16];
        for (int rr = -1; ok && rr < repeats; rr++) {
            sync_dev(e);
            double a = df_now_ms();
            ok = df_draft_block(ds, tok, nctx, bs[k], drafts, NULL, NULL, err) == DF_OK;
            sync_dev(e);
            if (rr >= 0) smp[rr] = df_now_ms() - a;
        }
        if (ok)
            printf("drafter pass%s B=%d over %d context rows: %.3f ms (median of %d)\n", label, bs[k], nctx,
                   median(smp, repeats), repeats);
    }
    free(feats);
    free(smp);
    return ok;
}

/* Parses a list option's value into out (1..MAX_LIST items); 2 after a usage message. */
static int list_opt(const char *name, const char *v, int *out, int *n) {
    const int k = parse_list(v, out, MAX_LIST);
    if (k == -2) {
        fprintf(stderr, "dflash bench: %s takes at most %d values (got %s)\n(see 'dflash bench --help')\n", name,
                MAX_LIST, v);
        return 2;
    }
    if (k < 0) {
        fprintf(stderr, "dflash bench: %s takes comma-separated integers, e.g. 4,8,16 (got '%s')\n"
                        "(see 'dflash bench --help')\n", name, v);
        return 2;
    }
    *n = k;
    return 0;
}

static int bench_main(int argc, char **argv, const unsigned char *is_value) {
    bench_opts o = {.device = "cuda", .ctx = 1024, .gen = 128, .repeats = 7, .window = 4096, .verify_curve = 1};
    o.blocks[0] = 16;
    o.n_blocks = 1;
    /* options given once (all but --synthetic-acceptance, which repeats) */
    static const char *const once[] = {"--model",  "--drafter", "--device",           "--ctx",
                                       "--gen",    "--repeats", "--window",           "--threads",
                                       "--block",  "--memory-ctx", "--no-verify-curve", "--draft-quant-pass",
                                       "--identity", "--draft-quant"};
    /* options followed by a value, which is never the next option (see cli_is_option) */
    static const char *const valued[] = {"--model",   "--drafter", "--device",     "--ctx",
                                         "--gen",     "--repeats", "--window",     "--threads",
                                         "--block",   "--memory-ctx", "--draft-quant-pass", "--identity",
                                         "--synthetic-acceptance", "--draft-quant"};
    int seen[sizeof once / sizeof once[0]] = {0};
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        const char *v = i + 1 < argc && (!cli_is_option(argv[i + 1]) || is_value[i + 1]) ? argv[i + 1] : NULL;
        for (size_t k = 0; k < sizeof once / sizeof once[0]; k++)
            if (!strcmp(a, once[k]) && seen[k]++) return usage_error("option %s given twice", a);
        for (size_t k = 0; k < sizeof valued / sizeof valued[0]; k++)
            if (!strcmp(a, valued[k]) && !v) return usage_error("option %s needs a value", a);
        int *num = !strcmp(a, "--ctx")       ? &o.ctx
                   : !strcmp(a, "--gen")     ? &o.gen
                   : !strcmp(a, "--repeats") ? &o.repeats
                   : !strcmp(a, "--window")  ? &o.window
                   : !strcmp(a, "--threads") ? &o.threads
                   : !strcmp(a, "--draft-quant") ? &o.draft_quant
                                             : NULL;
        if (num && v) {
            if (strict_int(v, num) != 0) {
                fprintf(stderr, "dflash bench: %s takes an integer of at most %d (got '%s')\n(see 'dflash bench --help')\n",
                        a, INT_MAX, v);
                return 2;
            }
            i++;
        } else if (!strcmp(a, "--model") && v) o.model = argv[++i];
        else if (!strcmp(a, "--drafter") && v) o.drafter = argv[++i];
        else if (!strcmp(a, "--device") && v) o.device = argv[++i];
        else if (!strcmp(a, "--block") && v) {
            if (list_opt(a, argv[++i], o.blocks, &o.n_blocks)) return 2;
        } else if (!strcmp(a, "--memory-ctx") && v) {
            if (list_opt(a, argv[++i], o.mem_ctx, &o.n_mem)) return 2;
        } else if (!strcmp(a, "--draft-quant-pass") && v) {
            if (list_opt(a, argv[++i], o.quant, &o.n_quant)) return 2;
        } else if (!strcmp(a, "--synthetic-acceptance") && v) {
            if (o.n_taus == MAX_LIST) return usage_error("--synthetic-acceptance is given at most 8 times (got %s more)", v);
            char *end = NULL;
            const double t = strtod(v, &end);
            if (end == v || *end || !isfinite(t) || !(t > 1.0) || t > 1000.0)
                return usage_error("--synthetic-acceptance takes a number of tokens per round > 1 and <= 1000 (got '%s')",
                                   v);
            o.taus[o.n_taus++] = t;
            i++;
        } else if (!strcmp(a, "--no-verify-curve")) o.verify_curve = 0;
        else if (!strcmp(a, "--identity") && v) {
            int nt[2] = {0, 0};
            if (parse_list(argv[++i], nt, 2) != 2 || nt[0] < 1 || nt[1] < 2)
                return usage_error("--identity takes N,T: prompts >= 1 and tokens >= 2 (got %s)", argv[i]);
            o.id_prompts = nt[0];
            o.id_tokens = nt[1];
        }
        else if (!strcmp(a, "--help")) {
            fputs(BENCH_HELP, stdout);
            return 0;
        } else return usage_error("unknown option or missing value: %s", a);
    }
    char mpath[3072];
    if (cli_model_dir(o.model, mpath, sizeof mpath) != 0) return CLI_EXIT_FAIL; /* (it said why) */
    o.model = mpath;
    if (o.ctx < 1) return usage_error("%s", "--ctx must be >= 1");
    if (o.gen < 2) return usage_error("%s", "--gen must be >= 2");
    if (o.repeats < 1) return usage_error("%s", "--repeats must be >= 1");
    if (o.window < 1) return usage_error("%s", "--window must be >= 1");
    if ((o.model && !o.model[0]) || (o.drafter && !o.drafter[0]))
        return usage_error("%s", "--model and --drafter take a folder, not an empty path");
    for (int i = 0; i < o.n_mem; i++)
        if (o.mem_ctx[i] < 1) return usage_error("%s", "--memory-ctx takes contexts >= 1");
    if (o.threads < 0 || o.threads > 4096) return usage_error("%s", "--threads must lie within 0..4096 (0: all CPUs)");
    if (strcmp(o.device, "cuda") != 0 && strcmp(o.device, "cpu") != 0)
        return usage_error("--device must be cuda or cpu (got %s)", o.device);
    for (int i = 0; i < o.n_blocks; i++)
        if (o.blocks[i] < 2 || o.blocks[i] > 16) return usage_error("%s", "--block values must lie within 2..16");
    for (int i = 0; i < o.n_quant; i++)
        if (o.quant[i] != 4 && o.quant[i] != 8) return usage_error("%s", "--draft-quant-pass values must be 4 or 8");
    if (o.draft_quant != 0 && o.draft_quant != 4 && o.draft_quant != 8)
        return usage_error("%s", "--draft-quant takes 8, 4 or 0 (as stored)");
    char dpath[4096];
    if (!o.drafter) {
        struct stat sb;
        snprintf(dpath, sizeof dpath, "%s/drafter/config.json", o.model);
        if (stat(dpath, &sb) == 0) {
            snprintf(dpath, sizeof dpath, "%s/drafter", o.model);
            o.drafter = dpath;
        }
    }
    if (!o.drafter && (o.n_taus || o.n_quant || o.id_prompts || o.draft_quant))
        return usage_error("%s", "--synthetic-acceptance, --draft-quant-pass, --draft-quant and --identity need a drafter "
                                 "(--drafter DIR, or a drafter/ folder in the model folder)");
    if (o.drafter) { /* checked now, not after the plain runs it follows (its weights load later) */
        char cpath[4096];
        snprintf(cpath, sizeof cpath, "%s/config.json", o.drafter);
        FILE *cf = fopen(cpath, "rb");
        if (!cf) {
            fprintf(stderr, "dflash bench: --drafter: %s: %s\n", cpath, strerror(errno));
            return 1;
        }
        fclose(cf);
    }
    setvbuf(stdout, NULL, _IOLBF, 0);
    df_error err = {0};
    double bw = 0;
#ifdef DFLASH_WITH_CUDA
    if (!strcmp(o.device, "cuda")) {
        char name[256];
        size_t total = 0;
        if (df_cuda_device_info(name, sizeof name, &total, &err) != DF_OK ||
            df_cuda_copy_bandwidth((size_t)2 << 30, &bw, &err) != DF_OK) {
            fprintf(stderr, "dflash bench: %s (no usable GPU? --device cpu runs the CPU backend)\n", err.msg);
            return 1;
        }
        printf("device: %s, %.1f GiB; device-to-device copy bandwidth %.0f GB/s (read + write, 2 GiB buffer)\n", name,
               (double)total / (1 << 30), bw);
    }
#endif
    double t0 = df_now_ms();
    df_engine *e = NULL;
    df_engine_options eo = {.n_threads = o.threads, .device = o.device};
    if (df_engine_load(&e, o.model, &eo, &err) != DF_OK) {
        fprintf(stderr, "dflash bench: %s\n", err.msg);
        return 1;
    }
    const df_pack *pk = df_engine_pack(e);
    const int V = df_engine_vocab_size(e);
    char *model_real = realpath(o.model, NULL); /* the folder as the user would name it */
    printf("pack %s: %d layers, hidden %d, vocab %d; loaded (mapped) in %.1f s\n", model_real ? model_real : o.model,
           pk->cfg.n_layers, pk->cfg.hidden_size, V, (df_now_ms() - t0) / 1000.0);
    free(model_real);
    int max_mem = 0;
    for (int i = 0; i < o.n_mem; i++)
        if (o.mem_ctx[i] > max_mem) max_mem = o.mem_ctx[i];
    df_session *s = NULL;
    int32_t *prompt = make_prompt(o.ctx + 64 > max_mem ? o.ctx + 64 : max_mem, V);
    int rc = 1;
    int32_t *plain = NULL;
    df_drafter *d = NULL;
    df_draft_state *ds = NULL;
    if ((long)o.ctx + o.gen + 64 > pk->cfg.max_position_embeddings) {
        df_error_set(&err, DF_ERR_RANGE, "--ctx %d + --gen %d (+ 64 positions of room) exceeds the model's context of %d",
                     o.ctx, o.gen, pk->cfg.max_position_embeddings);
        rc = CLI_EXIT_USAGE; /* a value only the loaded model can check: malformed all the same (README) */
        goto out;
    }
    if (df_session_init(&s, e, o.ctx + o.gen + 64, &err) != DF_OK) goto out;

    /* warm-up: uploads the weights */
    t0 = df_now_ms();
    if (df_session_prefill(s, prompt, 17, NULL, &err) != DF_OK) goto out;
    {
        int32_t id = prompt[0], am;
        for (int i = 0; i < 4; i++)
            if (df_target_forward_argmax(s, &id, 1, &am, &err) != DF_OK) goto out;
    }
    sync_dev(e);
    printf("warm-up (weights uploaded on first use): %.1f s\n", (df_now_ms() - t0) / 1000.0);

    /* plain decode vs the floor (a first run captures the steps' graphs; the second is timed) */
    double prefill_ms = 0, step_ms = 0;
    int n_plain = 0;
    plain = plain_run(s, prompt, o.ctx, o.gen, &prefill_ms, &step_ms, &n_plain, &err);
    if (!plain) goto out;
    free(plain);
    cuda_stats_mark(e);
    plain = plain_run(s, prompt, o.ctx, o.gen, &prefill_ms, &step_ms, &n_plain, &err);
    if (!plain) goto out;
    double wb, sb, kvb;
    step_bytes(pk, o.ctx, &wb, &sb, &kvb);
    printf("prefill: %d tokens in %.1f ms = %.1f tok/s\n", o.ctx, prefill_ms, o.ctx * 1000.0 / prefill_ms);
    printf("plain decode at context %d: %.3f ms/token = %.1f tok/s (%d tokens%s, device argmax)\n", o.ctx, step_ms,
           1000.0 / step_ms, n_plain, n_plain < o.gen ? ": an EOS id ended the run" : "");
    cuda_stats_print(e, "  ");
    if (bw > 0) {
        double bytes = wb + sb + kvb, floor_ms = bytes / (bw * 1e9) * 1000.0;
        printf("  floor: %.3f GB/token (weights %.3f + GDN states %.3f + KV %.3f) / %.0f GB/s = %.3f ms = %.1f tok/s;"
               " ratio %.1f%% of the floor\n",
               bytes / 1e9, wb / 1e9, sb / 1e9, kvb / 1e9, bw, floor_ms, 1000.0 / floor_ms, 100.0 * floor_ms / step_ms);
    }

    /* the product's plain loop (df_generate, as `generate` and the server run it): greedy;
     * sampled without a top-k (the logits come to the host each step); sampled from a top-k
     * (the token drawn on the device, each step queued ahead) */
    {
        const char *label[3] = {"greedy", "temperature 1, top-p 0.95", "temperature 0.7, top-k 20"};
        printf("generate loop at context %d (df_generate: prefill, then %d tokens):", o.ctx, o.gen);
        for (int k = 0; k < 3; k++) {
            df_gen_params gp = df_gen_params_default();
            gp.max_tokens = o.gen;
            if (k > 0) {
                gp.sampling.temperature = k == 1 ? 1.0f : 0.7f;
                gp.sampling.top_p = k == 1 ? 0.95f : 1.0f;
                gp.sampling.top_k = k == 2 ? 20 : 0;
                gp.sampling.seed = 1;
                gp.sampling.has_seed = 1;
            }
            df_gen_result res;
            if (df_generate(s, prompt, o.ctx, &gp, NULL, NULL, &res, &err) != DF_OK) goto out;
            printf("%s %s %.1f tok/s (%d tokens)", k ? ";" : "", label[k],
                   df_decode_tokens_per_second(res.n_ids - 1, res.decode_ms), res.n_ids);
            df_gen_result_free(&res);
        }
        printf("\n");
    }

    /* verify cost curve */
    if (o.verify_curve) {
        double *smp = malloc((size_t)o.repeats * sizeof(double)), base = 0;
        const int pos = s->pos;
        printf("verify cost t(B)/t(1) at context %d (median of %d; B rows through the target + device argmax):\n", pos,
               o.repeats);
        for (int B = 1; B <= 16; B++) {
            int32_t am[16];
            for (int r = 0; r < o.repeats; r++) {
                s->pos = pos;
                sync_dev(e);
                double a = df_now_ms();
                if (df_target_forward_argmax(s, prompt, B, am, &err) != DF_OK) {
                    free(smp);
                    goto out;
                }
                sync_dev(e);
                smp[r] = df_now_ms() - a;
            }
            double med = median(smp, o.repeats);
            if (B == 1) base = med;
            printf("  B=%2d  %.3f ms  %.2fx\n", B, med, med / base);
        }
        s->pos = pos;
        free(smp);
    }

    /* peak device memory of plain decoding, before the drafter's weights are on the device */
    size_t pplain[MAX_LIST] = {0}, pverify[MAX_LIST] = {0};
    const size_t wtarget = weight_bytes(e); /* every target weight is on the device after a decode step */
    if (o.n_mem && !is_cuda(e)) printf("peak device memory: CUDA only\n");
    if (o.n_mem && is_cuda(e)) {
        df_session_free(s); /* measured alone */
        s = NULL;
        for (int mi = 0; mi < o.n_mem; mi++) {
            if (!mem_plain(e, prompt, o.mem_ctx[mi], &pplain[mi], &pverify[mi], &err)) goto out;
            printf("peak device memory at context %d: plain %.2f GiB (target weights %.2f GiB; %s)\n", o.mem_ctx[mi],
                   (double)pplain[mi] / (1 << 30), (double)weight_bytes(e) / (1 << 30),
                   o.mem_ctx[mi] <= 4096 ? "prefill + decode" : "KV cache allocated by advancing positions, then decode");
        }
        if (df_session_init(&s, e, o.ctx + o.gen + 64, &err) != DF_OK) goto out;
    }

    if (o.drafter) {
        t0 = df_now_ms();
        if (df_drafter_load(&d, o.drafter, e, &err) != DF_OK) goto out;
        if (o.draft_quant && df_drafter_quantize(d, o.draft_quant, &err) != DF_OK) goto out;
        if (df_draft_state_init(&ds, d, o.window, &err) != DF_OK) goto out;
        const df_drafter_config *dc = df_drafter_get_config(d);
        char qlabel[64] = "";
        if (o.draft_quant) snprintf(qlabel, sizeof qlabel, ", weights quantized to %d bits at load", o.draft_quant);
        printf("drafter %s: %d layers, block %d, taps %d%s; loaded in %.1f s\n", o.drafter, dc->n_layers,
               dc->block_size, dc->n_taps, qlabel, (df_now_ms() - t0) / 1000.0);
        /* drafter pass time over a context of min(ctx, window) random features */
        const int nctx = o.ctx < o.window ? o.ctx : o.window;
        char plabel[48] = "", slabel[48] = "";
        if (o.draft_quant) {
            snprintf(plabel, sizeof plabel, " (%d-bit weights)", o.draft_quant);
            snprintf(slabel, sizeof slabel, ", drafter weights %d-bit", o.draft_quant);
        }
        if (!draft_pass_times(e, ds, prompt[0], nctx, o.repeats, plabel, &err)) goto out;
        /* token identity, speculative vs plain, over several prompts */
        for (int pi = 0; pi < o.id_prompts; pi++) {
            const int n = 64 + 97 * pi < o.ctx ? 64 + 97 * pi : o.ctx;
            int32_t *pp = malloc((size_t)n * sizeof(int32_t));
            if (!pp) goto out;
            for (int k = 0; k < n; k++) pp[k] = prompt[(k * (pi + 3) + pi * 11) % o.ctx];
            df_gen_params gp = df_gen_params_default();
            gp.max_tokens = o.id_tokens;
            df_gen_result want, got;
            if (df_generate(s, pp, n, &gp, NULL, NULL, &want, &err) != DF_OK) {
                free(pp);
                goto out;
            }
            const char *verdict[3] = {"NO", "NO", "NO"};
            long accepted[3] = {0, 0, 0}, plain_steps = 0;
            /* modes: 0 the drafter drafting every round, 1 synthetic tau 4.5 at block 8, 2 the
             * drafter with the default plain-step fallback */
            for (int mode = 0; mode < 3; mode++) {
                df_spec_params sp = df_spec_params_default();
                if (mode < 2) sp.no_fallback = 1; /* speculation measured as such: every round drafts */
                synth_acc sa = {.plain = want.ids, .n_plain = want.n_ids, .vocab = V, .tau = 4.5, .rng = 777u + (unsigned)pi};
                if (mode == 1) {
                    sp.block = 8;
                    sp.override = synth_propose;
                    sp.override_user = &sa;
                }
                if (df_generate_speculative(s, ds, pp, n, &gp, &sp, NULL, NULL, &got, &err) != DF_OK) {
                    df_gen_result_free(&want);
                    free(pp);
                    goto out;
                }
                const int same = got.n_ids == want.n_ids &&
                                 memcmp(got.ids, want.ids, (size_t)want.n_ids * sizeof(int32_t)) == 0;
                verdict[mode] = same ? "yes" : "NO";
                accepted[mode] = got.draft_n_accepted;
                if (mode == 2) plain_steps = got.plain_steps;
                df_gen_result_free(&got);
            }
            printf("identity: prompt %d (%d tokens), %d tokens generated: speculative == plain with the drafter "
                   "(default block): %s (%ld drafts accepted); at synthetic tau 4.5, block 8: %s (%ld accepted); "
                   "with the plain-step fallback: %s (%ld accepted, %ld plain steps)\n",
                   pi, n, want.n_ids, verdict[0], accepted[0], verdict[1], accepted[1], verdict[2], accepted[2],
                   plain_steps);
            df_gen_result_free(&want);
            free(pp);
            if (strcmp(verdict[0], "yes") || strcmp(verdict[1], "yes") || strcmp(verdict[2], "yes")) goto out;
        }

        /* speed at synthetic acceptance */
        const int ngen = n_plain < o.gen ? 0 : o.gen;
        if (o.n_taus && ngen == 0) printf("speed at synthetic acceptance: skipped (the plain run hit an EOS id)\n");
        for (int ti = 0; ti < o.n_taus && ngen; ti++) {
            for (int bi = 0; bi < o.n_blocks; bi++) {
                synth_acc sa = {.plain = plain, .n_plain = o.gen, .vocab = V, .tau = o.taus[ti], .rng = 12345};
                df_spec_params sp = df_spec_params_default();
                sp.no_fallback = 1; /* speculation measured as such: every round drafts */
                sp.block = o.blocks[bi];
                sp.override = synth_propose;
                sp.override_user = &sa;
                df_gen_params gp = df_gen_params_default();
                gp.max_tokens = o.gen;
                /* plain decoding again, just before: the machine's speed drifts over minutes */
                double pf_ms = 0, near_ms = 0;
                int n_again = 0;
                int32_t *again = plain_run(s, prompt, o.ctx, o.gen, &pf_ms, &near_ms, &n_again, &err);
                if (!again) goto out;
                free(again);
                df_gen_result res;
                /* a warm-up run first (the rounds' steps are captured as graphs on their second
                 * occurrence), then the measured one */
                if (df_generate_speculative(s, ds, prompt, o.ctx, &gp, &sp, NULL, NULL, &res, &err) != DF_OK) goto out;
                df_gen_result_free(&res);
                sa.rng = 12345;
                cuda_stats_mark(e);
                if (df_generate_speculative(s, ds, prompt, o.ctx, &gp, &sp, NULL, NULL, &res, &err) != DF_OK) goto out;
                int same = res.n_ids == o.gen && memcmp(res.ids, plain, (size_t)o.gen * sizeof(int32_t)) == 0;
                double tpr = res.draft_rounds ? (double)(res.draft_n_accepted + res.draft_rounds) / res.draft_rounds : 0;
                double spec_ms = res.decode_ms / (double)(res.n_ids > 1 ? res.n_ids - 1 : 1);
                if (res.draft_rounds == 0)
                    printf("speed at synthetic acceptance tau %.2f, block %d: no round ran (--gen %d leaves no room for "
                           "one); tokens identical to plain: %s\n",
                           o.taus[ti], o.blocks[bi], o.gen, same ? "yes" : "NO");
                else
                    printf("speed at synthetic acceptance tau %.2f, block %d%s: measured %.2f tokens/round over %d "
                           "round(s); %.3f ms/token = %.1f tok/s vs plain %.1f tok/s (measured just before): %.2fx; "
                           "tokens identical to plain: %s\n",
                           o.taus[ti], o.blocks[bi], slabel,
                           tpr, res.draft_rounds, spec_ms, 1000.0 / spec_ms, 1000.0 / near_ms, near_ms / spec_ms,
                           same ? "yes" : "NO");
                if (o.taus[ti] > (double)o.blocks[bi])
                    printf("  note: a round of block %d gives at most %d tokens, so tau %.2f is out of reach\n",
                           o.blocks[bi], o.blocks[bi], o.taus[ti]);
                cuda_stats_print(e, "  ");
                df_gen_result_free(&res);
                if (!same) goto out;
                /* the same run again, the device awaited at each phase's end: where a round's time goes */
                sa.rng = 12345;
                sp.phase_sync = 1;
                if (df_generate_speculative(s, ds, prompt, o.ctx, &gp, &sp, NULL, NULL, &res, &err) != DF_OK) goto out;
                const double nr = (double)res.draft_rounds;
                if (res.draft_rounds > 0)
                    printf("  per round (phases awaited): drafter pass %.3f ms, verify pass %.3f ms, GDN settle %.3f ms, "
                           "drafter context %.3f ms\n",
                           res.draft_ms / nr, res.verify_ms / nr, res.settle_ms / nr, res.context_ms / nr);
                df_gen_result_free(&res);
            }
        }
        /* peak device memory of speculative decoding (drafter weights now on the device) */
        double overhead = -1;
        for (int mi = 0; mi < o.n_mem && is_cuda(e); mi++) {
            const int C = o.mem_ctx[mi];
            if (C <= 4096) {
                df_session *ms = NULL;
                df_session_free(s);
                s = NULL;
                reset_peak(e);
                if (df_session_init(&ms, e, C + 80, &err) != DF_OK) goto out;
                df_spec_params sp = df_spec_params_default();
                sp.no_fallback = 1; /* speculation measured as such: every round drafts */
                df_gen_params gp = df_gen_params_default();
                gp.max_tokens = 32;
                df_gen_result res;
                df_status gs = df_generate_speculative(ms, ds, prompt, C, &gp, &sp, NULL, NULL, &res, &err);
                df_session_free(ms);
                if (gs != DF_OK) goto out;
                df_gen_result_free(&res);
                size_t pspec = peak_bytes(e);
                overhead = (double)pspec - (double)pverify[mi];
                printf("peak device memory at context %d: speculative %.2f GiB (measured: block %d, drafter window %d; "
                       "drafter weights %.2f GiB; +%.2f GiB over plain)\n", C, (double)pspec / (1 << 30),
                       sp.block ? sp.block : dc->block_size, o.window,
                       ((double)weight_bytes(e) - (double)wtarget) / (1 << 30),
                       ((double)pspec - (double)pplain[mi]) / (1 << 30));
            } else if (overhead >= 0) {
                printf("peak device memory at context %d: speculative %.2f GiB (plain + 16-row verify pass measured at %d "
                       "= %.2f GiB, + drafter weights/draft state/rollback buffers %.2f GiB measured at a smaller "
                       "context)\n", C, ((double)pverify[mi] + overhead) / (1 << 30), C,
                       (double)pverify[mi] / (1 << 30), overhead / (1 << 30));
            }
        }
        for (int qi = 0; qi < o.n_quant; qi++) { /* the same drafter with weights quantized at load
                                                  * (last: their device copies stay in the weight
                                                  * table and would count in the memory figures) */
            df_drafter *dq = NULL;
            df_draft_state *dsq = NULL;
            char label[48];
            snprintf(label, sizeof label, " (%d-bit weights)", o.quant[qi]);
            int ok = df_drafter_load(&dq, o.drafter, e, &err) == DF_OK &&
                     df_drafter_quantize(dq, o.quant[qi], &err) == DF_OK &&
                     df_draft_state_init(&dsq, dq, o.window, &err) == DF_OK &&
                     draft_pass_times(e, dsq, prompt[0], nctx, o.repeats, label, &err);
            df_draft_state_free(dsq);
            df_drafter_free(dq);
            if (!ok) goto out;
        }
    }

    rc = 0;
out:
    if (rc) fprintf(stderr, "dflash bench: %s\n", err.msg[0] ? err.msg : "failed");
#ifdef DFLASH_WITH_CUDA
    if (e && is_cuda(e) && df_backend_cuda_last_error(e->be)[0])
        fprintf(stderr, "dflash bench: CUDA backend: %s\n", df_backend_cuda_last_error(e->be));
#endif
    free(plain);
    free(prompt);
    df_draft_state_free(ds);
    df_drafter_free(d);
    df_session_free(s);
    df_engine_free(e);
    return rc;
}

int df_cmd_bench(int argc, char **argv) { return cli_run_split("bench", argc, argv, bench_main); }
