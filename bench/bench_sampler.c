/* Sampler throughput: the host's cost of drawing one token from a vocabulary of 248320 logits
 * (the Qwen3.5 vocabulary), per filter setting, and of drawing from a device's top-k list
 * (df_sampler_sample_top), in ms per token (mean over --draws draws of the same logits).
 *
 * usage: bench_sampler [--draws N] [--peaked]
 * Logits: uniform in [-10, 10] (a wide nucleus: the worst case for top-p), or with --peaked a
 * few dozen tokens 8-16 above a background in [-8, -4] (closer to a language model's).
 * Built with -DBENCH_WHOLE_ONLY it times only df_sampler_sample (to time an older sampler.c,
 * compiled in its place, that has no top-k list entry points).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "backend/backend.h"
#include "dflash/generate.h"

static double now_ms(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec * 1e3 + (double)t.tv_nsec / 1e6;
}

int main(int argc, char **argv) {
    int draws = 40, peaked = 0;
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--draws") == 0 && i + 1 < argc) draws = atoi(argv[++i]);
        else if (strcmp(argv[i], "--peaked") == 0) peaked = 1;
        else {
            fprintf(stderr, "usage: bench_sampler [--draws N] [--peaked]\n");
            return 2;
        }
    }
    if (draws < 1) draws = 1;
    enum { V = 248320 };
    float *l = malloc(V * sizeof *l);
    if (!l) return 1;
    unsigned x = 12345;
    for (int i = 0; i < V; i++) {
        x = x * 1664525u + 1013904223u;
        const float u = (float)(x >> 8) / 16777216.0f;
        l[i] = peaked ? -8.0f + 4.0f * u + ((x >> 3) % 5000 == 0 ? 8.0f + 8.0f * u : 0.0f) : 20.0f * u - 10.0f;
    }
    struct {
        const char *name;
        float temperature, top_p, min_p;
        int top_k;
    } cases[] = {
        {"greedy (argmax)", 0.0f, 1.0f, 0.0f, 0},
        {"temperature 1", 1.0f, 1.0f, 0.0f, 0},
        {"temperature 1, top-p 0.9", 1.0f, 0.9f, 0.0f, 0},
        {"temperature 0.7, min-p 0.05", 0.7f, 1.0f, 0.05f, 0},
        {"temperature 0.7, top-k 20", 0.7f, 1.0f, 0.0f, 20},
        {"temperature 0.7, top-k 20, top-p 0.8", 0.7f, 0.8f, 0.0f, 20},
        {"temperature 1, top-k 1000", 1.0f, 1.0f, 0.0f, 1000},
    };
    printf("sampler, vocabulary %d, %s logits, %d draws each (ms per token):\n", V, peaked ? "peaked" : "uniform",
           draws);
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        df_sampling_params p = df_sampling_default();
        p.temperature = cases[c].temperature;
        p.top_p = cases[c].top_p;
        p.min_p = cases[c].min_p;
        p.top_k = cases[c].top_k;
        p.seed = 1;
        p.has_seed = 1;
        df_sampler s;
        df_sampler_init(&s, &p);
        (void)df_sampler_sample(&s, l, V); /* scratch allocated */
        double t0 = now_ms();
        for (int d = 0; d < draws; d++) (void)df_sampler_sample(&s, l, V);
        const double whole = (now_ms() - t0) / draws;
        printf("  %-40s %8.3f", cases[c].name, whole);
#ifndef BENCH_WHOLE_ONLY
        if (df_sampler_top_k_only(&s, V)) { /* the same draws from the k best (a device's top_k) */
            int32_t ids[DF_SAMPLE_TOP_MAX];
            float vals[DF_SAMPLE_TOP_MAX];
            df_top_k_host(l, V, p.top_k, ids, vals);
            t0 = now_ms();
            for (int d = 0; d < draws; d++) (void)df_sampler_sample_top(&s, ids, vals, p.top_k, V);
            printf("   from the top-%d list: %.4f", p.top_k, (now_ms() - t0) / draws);
        }
#endif
        printf("\n");
        df_sampler_free(&s);
    }
    free(l);
    return 0;
}
