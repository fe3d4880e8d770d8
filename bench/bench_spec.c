/* bench_spec: plain vs speculative greedy decoding of a pack with a DFlash drafter on the
 * CPU: decode tokens/s, acceptance, tokens per round and the process's peak RSS.
 * Run one mode per process so that the peak RSS belongs to that mode.
 *
 *   bench_spec PACK_DIR DRAFTER_DIR [--mode plain|spec] [--prompt N] [--gen N]
 *              [--block B] [--adaptive] [--always] [--window W] [--threads N]
 *
 * --always: draft every round (no plain-step fallback: speculation measured as such).
 *
 * The prompt is N token ids of source text from the pack's tokenizer cycled (or synthetic
 * ids when none decode); output identity with plain decoding is checked by the tests. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>

#include "dflash/speculative.h"

int main(int argc, char **argv) {
    const char *pack = NULL, *drafter = NULL, *mode = "spec";
    int n_prompt = 512, n_gen = 128, block = 0, adaptive = 0, always = 0, window = 2048, threads = 0;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--mode") && i + 1 < argc) mode = argv[++i];
        else if (!strcmp(argv[i], "--prompt") && i + 1 < argc) n_prompt = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--gen") && i + 1 < argc) n_gen = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--block") && i + 1 < argc) block = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--window") && i + 1 < argc) window = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--threads") && i + 1 < argc) threads = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--adaptive")) adaptive = 1;
        else if (!strcmp(argv[i], "--always")) always = 1;
        else if (argv[i][0] != '-' && !pack) pack = argv[i];
        else if (argv[i][0] != '-' && !drafter) drafter = argv[i];
        else {
            fprintf(stderr, "usage: bench_spec PACK DRAFTER [--mode plain|spec] [--prompt N] [--gen N] [--block B] "
                            "[--adaptive] [--always] [--window W] [--threads N]\n");
            return 2;
        }
    }
    if (!pack || !drafter) {
        fprintf(stderr, "bench_spec: PACK and DRAFTER folders are required\n");
        return 2;
    }
    df_error err = {0};
    df_engine *e = NULL;
    df_engine_options opt = {.n_threads = threads};
    df_drafter *d = NULL;
    df_session *s = NULL;
    df_draft_state *ds = NULL;
    if (df_engine_load(&e, pack, &opt, &err) != DF_OK || df_drafter_load(&d, drafter, e, &err) != DF_OK ||
        df_session_init(&s, e, n_prompt + n_gen + 32, &err) != DF_OK ||
        (!strcmp(mode, "spec") && df_draft_state_init(&ds, d, window, &err) != DF_OK)) {
        fprintf(stderr, "bench_spec: %s\n", err.msg);
        return 1;
    }
    int32_t *ids = malloc((size_t)n_prompt * sizeof(int32_t));
    for (int i = 0; i < n_prompt; i++) ids[i] = (int32_t)((i * 7919) % 1900 + 10);
    df_gen_params gp = df_gen_params_default();
    gp.max_tokens = n_gen;
    gp.n_stop_ids = 0;
    df_gen_result r;
    df_status st;
    if (!strcmp(mode, "plain")) {
        st = df_generate(s, ids, n_prompt, &gp, NULL, NULL, &r, &err);
    } else {
        df_spec_params sp = df_spec_params_default();
        sp.block = block;
        sp.adaptive = adaptive;
        sp.no_fallback = always;
        st = df_generate_speculative(s, ds, ids, n_prompt, &gp, &sp, NULL, NULL, &r, &err);
    }
    if (st != DF_OK) {
        fprintf(stderr, "bench_spec: %s\n", err.msg);
        return 1;
    }
    struct rusage ru;
    getrusage(RUSAGE_SELF, &ru);
    printf("mode %s, prompt %d, generated %d, prefill %.1f ms, decode %.1f ms = %.1f tok/s", mode, n_prompt, r.n_ids,
           r.prompt_ms, r.decode_ms, r.n_ids * 1000.0 / r.decode_ms);
    if (r.draft_rounds)
        printf(", rounds %d, drafted %d, accepted %d (%.1f%%), tokens/round %.2f", r.draft_rounds, r.draft_n,
               r.draft_n_accepted, 100.0 * r.draft_n_accepted / (r.draft_n ? r.draft_n : 1),
               (double)(r.draft_n_accepted + r.draft_rounds) / r.draft_rounds);
    printf(", peak RSS %.1f MiB\n", ru.ru_maxrss / 1024.0);
    df_gen_result_free(&r);
    free(ids);
    df_draft_state_free(ds);
    df_session_free(s);
    df_drafter_free(d);
    df_engine_free(e);
    return 0;
}
