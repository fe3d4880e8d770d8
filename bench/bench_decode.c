/* bench_decode: prefill and decode speed of a pack on the CPU, plain and the verify cost
 * curve t(B)/t(1) for B = 1..16 (the target run on B rows at once, as a verify pass does).
 *
 *   bench_decode [PACK_DIR] [--threads N] [--prompt N] [--gen N] [--repeats N]
 *
 * Prints tokens/s for prefill and decode, and for each B the time of one B-row pass
 * relative to one single-token decode step (median over repeats). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/threads.h"
#include "dflash/engine.h"
#include "dflash/generate.h"
#include "model/target.h"

static int cmp_d(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

int main(int argc, char **argv) {
    const char *dir = "models/demo";
    int threads = 0, n_prompt = 512, n_gen = 128, repeats = 9;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--threads") && i + 1 < argc) threads = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--prompt") && i + 1 < argc) n_prompt = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--gen") && i + 1 < argc) n_gen = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--repeats") && i + 1 < argc) repeats = atoi(argv[++i]);
        else if (argv[i][0] != '-') dir = argv[i];
        else {
            fprintf(stderr, "usage: bench_decode [PACK_DIR] [--threads N] [--prompt N] [--gen N] [--repeats N]\n");
            return 2;
        }
    }
    df_error err = {0};
    df_engine *e = NULL;
    df_engine_options opt = {.n_threads = threads};
    if (df_engine_load(&e, dir, &opt, &err) != DF_OK) {
        fprintf(stderr, "bench_decode: %s\n", err.msg);
        return 1;
    }
    const int V = df_engine_vocab_size(e);
    df_session *s = NULL;
    if (df_session_init(&s, e, n_prompt + n_gen + 64, &err) != DF_OK) {
        fprintf(stderr, "bench_decode: %s\n", err.msg);
        return 1;
    }
    int32_t *ids = malloc((size_t)(n_prompt + 16) * sizeof(int32_t));
    for (int i = 0; i < n_prompt + 16; i++) ids[i] = (int32_t)((i * 7919) % 1900 + 10);
    float *logits = malloc((size_t)16 * (size_t)V * sizeof(float));
    double t0 = df_now_ms();
    if (df_session_prefill(s, ids, n_prompt, logits, &err) != DF_OK) {
        fprintf(stderr, "bench_decode: %s\n", err.msg);
        return 1;
    }
    double t1 = df_now_ms();
    int32_t id = df_argmax(logits, V);
    for (int i = 0; i < n_gen; i++) {
        df_session_decode(s, id, logits, &err);
        id = df_argmax(logits, V);
    }
    double t2 = df_now_ms();
    printf("pack %s, %d threads\n", dir, df_engine_n_threads(e));
    printf("prefill: %d tokens in %.1f ms = %.1f tok/s\n", n_prompt, t1 - t0, n_prompt * 1000.0 / (t1 - t0));
    printf("decode:  %d tokens in %.1f ms = %.1f tok/s (%.3f ms/token) at context %d\n", n_gen, t2 - t1,
           n_gen * 1000.0 / (t2 - t1), (t2 - t1) / n_gen, n_prompt);
    /* verify cost curve: B rows at the same position, rolled back after each pass */
    double *samples = malloc((size_t)repeats * sizeof(double));
    double base = 0;
    printf("verify cost t(B)/t(1) at context %d (median of %d):\n", s->pos, repeats);
    const int pos = s->pos;
    for (int B = 1; B <= 16; B++) {
        for (int r = 0; r < repeats; r++) {
            s->pos = pos;
            double a = df_now_ms();
            df_target_forward_rows(s, ids, B, logits, 0, &err);
            samples[r] = df_now_ms() - a;
        }
        qsort(samples, (size_t)repeats, sizeof(double), cmp_d);
        double med = samples[repeats / 2];
        if (B == 1) base = med;
        printf("  B=%2d  %.3f ms  %.2fx\n", B, med, med / base);
    }
    free(samples);
    free(ids);
    free(logits);
    df_session_free(s);
    df_engine_free(e);
    return 0;
}
