/* Token sampling (include/dflash/generate.h): greedy argmax, or temperature with top-k,
 * top-p (nucleus, Holtzman et al. 2019) and min-p filters, drawn from a seeded
 * xoshiro256** generator (Blackman & Vigna) so that the same seed gives the same output. */
#include <float.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "dflash/generate.h"

df_sampling_params df_sampling_default(void) {
    df_sampling_params p = {.temperature = 0.0f, .top_p = 1.0f, .top_k = 0, .min_p = 0.0f, .seed = 0,
                            .has_seed = 0, .repetition_penalty = 1.0f};
    return p;
}

int df_sampling_has_processors(const df_sampling_params *p) {
    return (p->repetition_penalty != 1.0f && p->repetition_penalty > 0.0f) || p->presence_penalty != 0.0f ||
           p->frequency_penalty != 0.0f || p->n_logit_bias > 0;
}

void df_sampling_apply_processors(const df_sampling_params *p, float *logits, int n_vocab, const int32_t *prompt,
                                  int n_prompt, const int32_t *gen, int n_gen) {
    if (p->repetition_penalty != 1.0f && p->repetition_penalty > 0.0f) {
        /* each seen token once: mark by flipping through a visited pass over both lists */
        const int32_t *lists[2] = {prompt, gen};
        const int lens[2] = {n_prompt, n_gen};
        unsigned char *seen = calloc((size_t)n_vocab, 1);
        for (int l = 0; l < 2 && seen; l++)
            for (int i = 0; i < lens[l]; i++) {
                int32_t id = lists[l][i];
                if (id < 0 || id >= n_vocab || seen[id]) continue;
                seen[id] = 1;
                float v = logits[id] > 0.0f ? logits[id] / p->repetition_penalty : logits[id] * p->repetition_penalty;
                /* a penalty near 0 sends a positive logit past the float range: the largest finite
                 * value keeps it first without making the logits non-finite */
                if (v > FLT_MAX) v = FLT_MAX;
                else if (v < -FLT_MAX) v = -FLT_MAX;
                logits[id] = v;
            }
        free(seen);
    }
    if (p->presence_penalty != 0.0f || p->frequency_penalty != 0.0f) {
        int *count = calloc((size_t)n_vocab, sizeof(int));
        if (count) {
            for (int i = 0; i < n_gen; i++)
                if (gen[i] >= 0 && gen[i] < n_vocab) count[gen[i]]++;
            for (int i = 0; i < n_gen; i++) {
                int32_t id = gen[i];
                if (id < 0 || id >= n_vocab || count[id] == 0) continue;
                logits[id] -= p->presence_penalty + p->frequency_penalty * (float)count[id];
                count[id] = 0; /* once per token */
            }
            free(count);
        }
    }
    for (int i = 0; i < p->n_logit_bias; i++) {
        int32_t id = p->logit_bias[i].id;
        if (id >= 0 && id < n_vocab) logits[id] += p->logit_bias[i].bias;
    }
}

void df_token_info_compute(df_token_info *info, const float *logits, int n_vocab, int32_t id, int n_top) {
    if (n_top < 0) n_top = 0;
    if (n_top > DF_MAX_TOP_LOGPROBS) n_top = DF_MAX_TOP_LOGPROBS;
    float mx = logits[0];
    for (int i = 1; i < n_vocab; i++)
        if (logits[i] > mx) mx = logits[i];
    double sum = 0.0;
    for (int i = 0; i < n_vocab; i++) sum += exp((double)(logits[i] - mx));
    const double lse = (double)mx + log(sum);
    info->id = id;
    info->logprob = (float)((double)logits[id] - lse);
    /* top n by a bounded insertion pass (highest first, lower id first on ties) */
    int len = 0;
    for (int i = 0; i < n_vocab && n_top > 0; i++) {
        float v = logits[i];
        if (len == n_top && !(v > logits[info->top[len - 1].id])) continue;
        int pos = len < n_top ? len++ : n_top - 1;
        while (pos > 0 && v > logits[info->top[pos - 1].id]) {
            info->top[pos] = info->top[pos - 1];
            pos--;
        }
        info->top[pos].id = i;
    }
    for (int k = 0; k < len; k++) info->top[k].logprob = (float)((double)logits[info->top[k].id] - lse);
    info->n_top = len;
}

static uint64_t splitmix64(uint64_t *x) {
    uint64_t z = (*x += 0x9e3779b97f4a7c15ULL);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
}

static uint64_t rotl(uint64_t x, int k) { return (x << k) | (x >> (64 - k)); }

static uint64_t xoshiro_next(uint64_t s[4]) {
    uint64_t result = rotl(s[1] * 5, 7) * 9;
    uint64_t t = s[1] << 17;
    s[2] ^= s[0];
    s[3] ^= s[1];
    s[1] ^= s[2];
    s[0] ^= s[3];
    s[2] ^= t;
    s[3] = rotl(s[3], 45);
    return result;
}

void df_sampler_init(df_sampler *s, const df_sampling_params *p) {
    memset(s, 0, sizeof *s);
    s->p = *p;
    uint64_t seed = p->seed;
    if (!p->has_seed) {
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        seed = (uint64_t)ts.tv_nsec ^ ((uint64_t)ts.tv_sec << 20) ^ (uint64_t)(uintptr_t)s;
    }
    for (int i = 0; i < 4; i++) s->rng[i] = splitmix64(&seed);
}

void df_sampler_free(df_sampler *s) {
    free(s->probs);
    free(s->idx);
    s->probs = NULL;
    s->idx = NULL;
    s->cap = 0;
}

int32_t df_argmax(const float *logits, int n) {
    int32_t best = 0;
    float mx = logits[0];
    int nan = isnan(mx);
    for (int i = 1; i < n; i++) {
        const float v = logits[i];
        if (v > mx) {
            mx = v;
            best = i;
        } else if (isnan(v)) {
            nan = 1;
        }
    }
    return nan || !isfinite(mx) ? -1 : best;
}

/* Orders candidate ids by logit, highest first; lower id first on ties. */
static int cmp_desc(const void *a, const void *b, void *ctx) {
    const float *logits = ctx;
    int32_t i = *(const int32_t *)a, j = *(const int32_t *)b;
    float x = logits[i], y = logits[j];
    if (x > y) return -1;
    if (x < y) return 1;
    return (i > j) - (i < j);
}

/* Keeps the k best ids of idx[0..n) in idx[0..k), sorted (a bounded insertion pass). */
static int select_top_k(const float *logits, int32_t *idx, int n, int k) {
    int len = 0;
    for (int i = 0; i < n; i++) {
        int32_t id = idx[i];
        float v = logits[id];
        if (len == k && !(v > logits[idx[len - 1]])) continue;
        int pos = len < k ? len++ : k - 1;
        while (pos > 0 && v > logits[idx[pos - 1]]) {
            idx[pos] = idx[pos - 1];
            pos--;
        }
        idx[pos] = id;
    }
    return len;
}

int32_t df_sampler_sample(df_sampler *s, float *logits, int n_vocab) {
    const df_sampling_params *p = &s->p;
    if (!(p->temperature > 0.0f)) return df_argmax(logits, n_vocab);
    if (s->cap < n_vocab) {
        float *pr = realloc(s->probs, (size_t)n_vocab * sizeof(float));
        if (pr) s->probs = pr;
        int32_t *ix = realloc(s->idx, (size_t)n_vocab * sizeof(int32_t));
        if (ix) s->idx = ix;
        if (!pr || !ix) return df_argmax(logits, n_vocab); /* no memory: degrade to greedy */
        s->cap = n_vocab;
    }
    int32_t *idx = s->idx;
    float *probs = s->probs;
    for (int i = 0; i < n_vocab; i++) {
        if (isnan(logits[i])) return -1;
        idx[i] = i;
    }
    int n = n_vocab;
    if (p->top_k > 0 && p->top_k < n) {
        n = select_top_k(logits, idx, n, p->top_k);
    } else {
        qsort_r(idx, (size_t)n, sizeof *idx, cmp_desc, logits);
    }
    /* softmax with temperature over the candidates (sorted, highest first) */
    const float mx = logits[idx[0]];
    if (!isfinite(mx)) return -1;
    double sum = 0.0;
    for (int i = 0; i < n; i++) {
        probs[i] = expf((logits[idx[i]] - mx) / p->temperature);
        sum += probs[i];
    }
    for (int i = 0; i < n; i++) probs[i] = (float)(probs[i] / sum);
    if (p->top_p > 0.0f && p->top_p < 1.0f) {
        double c = 0.0;
        int keep = n;
        for (int i = 0; i < n; i++) {
            c += probs[i];
            if (c >= p->top_p) {
                keep = i + 1;
                break;
            }
        }
        n = keep;
    }
    if (p->min_p > 0.0f) {
        float thr = probs[0] * p->min_p;
        int keep = 1;
        while (keep < n && probs[keep] >= thr) keep++;
        n = keep;
    }
    double total = 0.0;
    for (int i = 0; i < n; i++) total += probs[i];
    double r = (double)(xoshiro_next(s->rng) >> 11) * (1.0 / 9007199254740992.0) * total;
    double c = 0.0;
    for (int i = 0; i < n; i++) {
        c += probs[i];
        if (r < c) return idx[i];
    }
    return idx[n - 1];
}
