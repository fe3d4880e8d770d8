/* Token sampling (include/dflash/generate.h): greedy argmax, or temperature with top-k,
 * top-p (nucleus, Holtzman et al. 2019) and min-p filters, drawn from a seeded
 * xoshiro256** generator (Blackman & Vigna) so that the same seed gives the same output. */
#include <float.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#ifdef __AVX2__
#include <immintrin.h>
#endif

#include "backend/backend.h"
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
    /* the n_top best (highest first, lower id first on ties) */
    int32_t ids[DF_MAX_TOP_LOGPROBS];
    float vals[DF_MAX_TOP_LOGPROBS];
    const int len = n_top > 0 ? df_top_k_insert(logits, n_vocab, n_top, ids, vals) : 0;
    for (int k = 0; k < len; k++) {
        info->top[k].id = ids[k];
        info->top[k].logprob = (float)((double)vals[k] - lse);
    }
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

uint64_t df_sampler_draw_bits(df_sampler *s) { return xoshiro_next(s->rng) >> 11; }

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
    free(s->work);
    s->probs = NULL;
    s->idx = NULL;
    s->work = NULL;
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

/* Orders candidate ids by logit, highest first; lower id first on ties (the rank order). */
static int cmp_desc(const void *a, const void *b, void *ctx) {
    const float *logits = ctx;
    int32_t i = *(const int32_t *)a, j = *(const int32_t *)b;
    float x = logits[i], y = logits[j];
    if (x > y) return -1;
    if (x < y) return 1;
    return (i > j) - (i < j);
}

/* The bits of a non-NaN float as an unsigned key in the order of the values (-0 taken as +0, so
 * that equal values share a key). */
static inline uint32_t order_key(float v) {
    if (v == 0.0f) v = 0.0f;
    uint32_t u;
    memcpy(&u, &v, sizeof u);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

/* Radix selection (two levels of 2048 buckets on the logits' order keys, then a sort of the
 * last crossing bucket): of the candidates (idx[0..n), or every id 0..n-1 when all is set, idx
 * then only an output of n entries), puts at the front of idx the smallest set of
 * highest-ranked ones (rank: cmp_desc) that holds `want` candidates (p == NULL) or whose
 * probabilities p[id] (unnormalised) sum to at least `want` (sums in double); returns its size
 * (all n, in idx, when the candidates never reach `want`). The whole buckets taken come first,
 * in a fixed order, then the crossing bucket's candidates in rank order. O(n) plus the sort of
 * the candidates that share the crossing bucket's top 22 key bits. */
static int select_prefix(const float *logits, const float *p, int32_t *idx, int n, int all, double want,
                         df_sampler_work *w) {
    int lo = 0, hi = n; /* idx[0..lo): taken; idx[lo..hi): undecided */
    double got = 0.0;
    for (int level = 0; level < 2; level++) {
        const int shift = level == 0 ? 21 : 10;
        memset(w->count, 0, sizeof w->count);
        if (p) memset(w->mass, 0, sizeof w->mass);
        for (int i = lo; i < hi; i++) {
            const int32_t id = all ? i : idx[i];
            const int k = (int)((order_key(logits[id]) >> shift) & 2047u);
            w->count[k]++;
            if (p) w->mass[k] += (double)p[id];
        }
        int cross = -1;
        for (int k = 2047; k >= 0; k--) {
            const double add = p ? w->mass[k] : (double)w->count[k];
            if (w->count[k] > 0 && got + add >= want) {
                cross = k;
                break;
            }
            got += add;
        }
        if (cross < 0) { /* the target is never reached: all of them */
            if (all)
                for (int i = 0; i < n; i++) idx[i] = i;
            return hi;
        }
        if (all) { /* ids above the crossing bucket to the front, those in it from the back, then joined */
            int a = 0, c = n;
            for (int i = 0; i < n; i++) {
                const int k = (int)((order_key(logits[i]) >> shift) & 2047u);
                if (k > cross) idx[a++] = i;
                else if (k == cross) idx[--c] = i;
            }
            const int nc = n - c;
            for (int j = 0; j < nc; j++) idx[a + j] = idx[n - 1 - j]; /* ascending ids again */
            lo = a;
            hi = a + nc;
            all = 0;
            continue;
        }
        /* three-way partition of idx[lo..hi): above the crossing bucket, in it, below */
        int a = lo, m = lo, b = hi;
        while (m < b) {
            const int k = (int)((order_key(logits[idx[m]]) >> shift) & 2047u);
            int32_t t = idx[m];
            if (k > cross) {
                idx[m++] = idx[a];
                idx[a++] = t;
            } else if (k == cross) {
                m++;
            } else {
                idx[m] = idx[--b];
                idx[b] = t;
            }
        }
        lo = a;
        hi = m;
    }
    qsort_r(idx + lo, (size_t)(hi - lo), sizeof *idx, cmp_desc, (void *)logits);
    for (int i = lo; i < hi; i++) {
        got += p ? (double)p[idx[i]] : 1.0;
        if (got >= want) return i + 1;
    }
    return hi;
}

/* probs[i] = e^((logits[i] - mx) / t) for i < n; returns their sum (in double, four interleaved
 * partial sums added in a fixed order). A division, not a product by 1/t: a temperature whose
 * reciprocal overflows (a float below 2^-126) must still give 0 for the best logit. */
static double softmax_terms(const float *restrict logits, int n, float mx, float t, float *restrict probs) {
    int j = 0;
#ifdef __AVX2__
    /* df_exp_nonpos (backend.h) eight at a time: the same operations in the same order (no fused multiply-add),
     * so the same bits */
    const __m256 vmx = _mm256_set1_ps(mx), vt = _mm256_set1_ps(t), l2e = _mm256_set1_ps(1.44269504f);
    const __m256 lo = _mm256_set1_ps(-126.0f), magic = _mm256_set1_ps(12582912.0f), cut = _mm256_set1_ps(-87.0f);
    const float cf[7] = {1.5403530e-4f, 1.3333558e-3f, 9.6181291e-3f, 5.5504109e-2f, 2.4022651e-1f, 6.9314718e-1f, 1.0f};
    for (; j + 8 <= n; j += 8) {
        const __m256 x = _mm256_div_ps(_mm256_sub_ps(_mm256_loadu_ps(logits + j), vmx), vt);
        const __m256 tc = _mm256_max_ps(_mm256_mul_ps(x, l2e), lo);
        const __m256 nn = _mm256_sub_ps(_mm256_add_ps(tc, magic), magic);
        const __m256 f = _mm256_sub_ps(tc, nn);
        __m256 q = _mm256_set1_ps(cf[0]);
        for (int k = 1; k < 7; k++) q = _mm256_add_ps(_mm256_mul_ps(q, f), _mm256_set1_ps(cf[k]));
        const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(nn), _mm256_set1_epi32(127)), 23);
        const __m256 r = _mm256_mul_ps(q, _mm256_castsi256_ps(e));
        _mm256_storeu_ps(probs + j, _mm256_and_ps(r, _mm256_cmp_ps(x, cut, _CMP_GE_OQ)));
    }
#endif
    for (; j < n; j++) probs[j] = df_exp_nonpos((logits[j] - mx) / t);
    double s0 = 0.0, s1 = 0.0, s2 = 0.0, s3 = 0.0;
    int i = 0;
    for (; i + 4 <= n; i += 4) {
        s0 += probs[i];
        s1 += probs[i + 1];
        s2 += probs[i + 2];
        s3 += probs[i + 3];
    }
    for (; i < n; i++) s0 += probs[i];
    return (s0 + s1) + (s2 + s3);
}

/* Grows the sampler's scratch to a vocabulary of n_vocab; 0 when out of memory. */
static int sampler_scratch(df_sampler *s, int n_vocab) {
    if (s->cap >= n_vocab && s->work) return 1;
    float *pr = realloc(s->probs, (size_t)n_vocab * sizeof(float));
    if (pr) s->probs = pr;
    int32_t *ix = realloc(s->idx, (size_t)n_vocab * sizeof(int32_t));
    if (ix) s->idx = ix;
    if (!s->work) s->work = malloc(sizeof *s->work);
    if (!pr || !ix || !s->work) return 0;
    s->cap = n_vocab;
    return 1;
}

/* The filters after top-k and the draw: the candidates idx[0..n) (every id 0..n-1 when all is
 * set), their logits by id, mx the largest of them (finite). */
static int32_t sample_tail(df_sampler *s, const float *logits, int32_t *idx, int n, int all, float mx) {
    const df_sampling_params *p = &s->p;
    float *probs = s->probs; /* indexed by token id */
    /* softmax with temperature over the candidates, unnormalised (the best one has 1) */
    const float t = p->temperature;
    double sum = 0.0;
    if (all) {
        sum = softmax_terms(logits, n, mx, t, probs);
    } else {
        for (int i = 0; i < n; i++) {
            const int32_t id = idx[i];
            probs[id] = df_exp_nonpos((logits[id] - mx) / t);
            sum += probs[id];
        }
    }
    if (p->top_p > 0.0f && p->top_p < 1.0f) {
        n = select_prefix(logits, probs, idx, n, all, (double)p->top_p * sum, s->work);
        all = 0;
    }
    if (p->min_p > 0.0f) { /* relative to the best candidate's probability, which is 1 here */
        int keep = 0;
        for (int i = 0; i < n; i++) {
            const int32_t id = all ? i : idx[i];
            if (probs[id] >= p->min_p) idx[keep++] = id;
        }
        n = keep;
        all = 0;
    }
    double total = sum;
    if (!all) {
        total = 0.0;
        for (int i = 0; i < n; i++) total += probs[idx[i]];
    }
    double r = (double)df_sampler_draw_bits(s) * (1.0 / 9007199254740992.0) * total;
    double c = 0.0;
    for (int i = 0; i < n; i++) {
        c += probs[all ? i : idx[i]];
        if (r < c) return all ? i : idx[i];
    }
    return all ? n - 1 : idx[n - 1];
}

int32_t df_sampler_sample(df_sampler *s, float *logits, int n_vocab) {
    const df_sampling_params *p = &s->p;
    if (!(p->temperature > 0.0f)) return df_argmax(logits, n_vocab);
    if (!sampler_scratch(s, n_vocab)) return df_argmax(logits, n_vocab); /* no memory: degrade to greedy */
    int32_t *idx = s->idx;
    float mx = -INFINITY;
    for (int i = 0; i < n_vocab; i++) {
        const float v = logits[i];
        if (isnan(v)) return -1;
        mx = v > mx ? v : mx;
    }
    if (!isfinite(mx)) return -1;
    /* the candidates: idx[0..n), or every id while all is set */
    int n = n_vocab, all = 1;
    if (p->top_k > 0 && p->top_k < n) {
        if (p->top_k <= DF_SAMPLE_TOP_MAX) { /* the k best in rank order, then df_sample_top_list */
            float vals[DF_SAMPLE_TOP_MAX];
            n = df_top_k_insert(logits, n_vocab, p->top_k, idx, vals);
            return df_sample_top_list(idx, vals, n, &(df_top_draw){.k = n, .temperature = p->temperature,
                                                                  .top_p = p->top_p, .min_p = p->min_p},
                                      df_sampler_draw_bits(s));
        }
        n = select_prefix(logits, NULL, idx, n, 1, (double)p->top_k, s->work);
        all = 0;
    }
    return sample_tail(s, logits, idx, n, all, mx);
}

int df_sampler_top_k_only(const df_sampler *s, int n_vocab) {
    const df_sampling_params *p = &s->p;
    return p->temperature > 0.0f && p->top_k > 0 && p->top_k <= DF_SAMPLE_TOP_MAX && p->top_k < n_vocab &&
           !df_sampling_has_processors(p);
}

int32_t df_sampler_sample_top(df_sampler *s, const int32_t *ids, const float *vals, int k, int n_vocab) {
    if (k != s->p.top_k || !df_sampler_top_k_only(s, n_vocab) || ids[0] < 0 || !isfinite(vals[0])) return -1;
    for (int j = 0; j < k; j++)
        if (ids[j] < 0 || ids[j] >= n_vocab || isnan(vals[j]) || (j > 0 && vals[j] > vals[j - 1])) return -1;
    return df_sample_top_list(ids, vals, k, &(df_top_draw){.k = k, .temperature = s->p.temperature,
                                                          .top_p = s->p.top_p, .min_p = s->p.min_p},
                              df_sampler_draw_bits(s));
}
