/* Tokenizer throughput: encodes about 1 MB of mixed text (the Qwen3 oracle cases plus code and
 * prose in several scripts, shuffled and repeated) with the real Qwen3 tokenizer, one call for
 * the whole text and one call per paragraph, and prints MB/s (1 MB = 10^6 bytes of UTF-8 input).
 *
 * usage: bench_tokenizer [tokenizer.json [cases.json]] [--dump FILE]
 * Defaults: $DFLASH_FIXTURES/qwen3-tokenizer/{tokenizer,cases}.json, else
 * build/tests/fixtures/... (run `ctest -R fixtures_setup` once to unpack the tokenizer).
 * --dump writes the benchmark text to FILE (to time another tokenizer on the same bytes).
 */
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "dflash/tokenizer.h"

static const char *const k_extra[] = {
    "def merge_sort(xs: list[int]) -> list[int]:\n    if len(xs) <= 1:\n        return xs\n"
    "    mid = len(xs) // 2\n    left, right = merge_sort(xs[:mid]), merge_sort(xs[mid:])\n"
    "    out = []\n    while left and right:\n        out.append(left.pop(0) if left[0] <= right[0] else right.pop(0))\n"
    "    return out + left + right\n",
    "static int cmp(const void *a, const void *b) {\n\tconst int *x = a, *y = b;\n\treturn (*x > *y) - (*x < *y);\n}\n"
    "int main(int argc, char **argv) {\n\tqsort(v, n, sizeof *v, cmp);\n\tprintf(\"%d\\n\", v[0]);\n}\n",
    "{\"model\": \"qwen3\", \"messages\": [{\"role\": \"user\", \"content\": \"Summarise the report.\"}],"
    " \"temperature\": 0.7, \"max_tokens\": 512, \"stream\": true}\n",
    "The committee met on Tuesday to review the quarterly figures. Revenue rose 4.2% year over year, "
    "while operating costs fell slightly thanks to lower energy prices. Several members asked whether "
    "the new pricing model would survive a downturn; the finance team promised a sensitivity analysis "
    "before the next meeting.\n\n",
    "Il était une fois, dans un petit village au bord de la mer, une vieille femme qui réparait les filets "
    "des pêcheurs. Chaque matin, elle s'asseyait devant sa porte et regardait les bateaux partir. "
    "Über den Wolken muss die Freiheit wohl grenzenlos sein, sagte der Pilot und lächelte.\n",
    "Машинное обучение — это область искусственного интеллекта, изучающая методы построения алгоритмов, "
    "способных обучаться на данных. Ελληνικά: η γλώσσα έχει ιστορία τριών χιλιάδων ετών.\n",
    "大型语言模型通过在海量文本上进行预训练来学习语言的统计规律，然后通过指令微调和人类反馈强化学习来对齐人类偏好。"
    "推理时，模型逐个生成词元，每一步都依赖之前的全部上下文。\n",
    "東京は日本の首都であり、世界有数の大都市です。春には桜が咲き、多くの人々が公園で花見を楽しみます。"
    "한국어는 한글로 표기하며, 세종대왕이 1443년에 창제하였다.\n",
    "العربية لغة سامية يتحدث بها أكثر من أربعمائة مليون شخص. हिन्दी भारत की सबसे अधिक बोली जाने वाली भाषा है। "
    "ภาษาไทยเป็นภาษาราชการของประเทศไทย\n",
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\nWhat is 17 * 23?<|im_end|>\n"
    "<|im_start|>assistant\n<think>\n17 * 23 = 17 * 20 + 17 * 3 = 340 + 51 = 391.\n</think>\n\n17 × 23 = 391.<|im_end|>\n",
    "Emoji and symbols: 😀 👍🏽 🇫🇷 ✓ → ∑ ∫ √ ∞ ≤ ≥ ½ ° € £ ¥ © ® ™ … — “quoted” ‘single’\n",
    "| id | name  | score |\n|----|-------|-------|\n| 1  | alpha | 0.93  |\n| 2  | beta  | 0.87  |\n\n",
};

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* CPU time of this thread: on a shared, busy machine it counts only our own running time. */
static double cpu_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

typedef struct {
    char *p;
    size_t n, cap;
} buf;

static void buf_add(buf *b, const char *s, size_t n) {
    if (b->n + n + 1 > b->cap) {
        b->cap = 2 * (b->n + n + 1);
        b->p = realloc(b->p, b->cap);
        if (!b->p) {
            fprintf(stderr, "out of memory\n");
            exit(1);
        }
    }
    memcpy(b->p + b->n, s, n);
    b->n += n;
    b->p[b->n] = 0;
}

int main(int argc, char **argv) {
    const char *tok_path = NULL, *cases_path = NULL, *dump = NULL;
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--dump") == 0 && i + 1 < argc) dump = argv[++i];
        else if (!tok_path) tok_path = argv[i];
        else cases_path = argv[i];
    }
    const char *fx = getenv("DFLASH_FIXTURES");
    char tp[4096], cp[4096];
    snprintf(tp, sizeof tp, "%s/qwen3-tokenizer/tokenizer.json", fx ? fx : "build/tests/fixtures");
    snprintf(cp, sizeof cp, "%s/qwen3-tokenizer/cases.json", fx ? fx : "build/tests/fixtures");
    if (!tok_path) tok_path = tp;
    if (!cases_path) cases_path = cp;

    df_error err = {0};
    df_tokenizer *tok = NULL;
    double t0 = now_s();
    if (df_tokenizer_load(&tok, tok_path, &err)) {
        fprintf(stderr, "bench_tokenizer: %s\n", err.msg);
        return 1;
    }
    double load_s = now_s() - t0;

    /* The pieces: every case text, plus the extra code and prose. */
    json_error_t je;
    json_t *root = json_load_file(cases_path, 0, &je);
    if (!root) {
        fprintf(stderr, "bench_tokenizer: %s: %s\n", cases_path, je.text);
        return 1;
    }
    json_t *cases = json_object_get(root, "cases");
    size_t n_cases = json_array_size(cases), n_extra = sizeof k_extra / sizeof k_extra[0];
    size_t n_pieces = n_cases + n_extra;
    const char **piece = malloc(n_pieces * sizeof *piece);
    for (size_t i = 0; i < n_cases; i++) piece[i] = json_string_value(json_object_get(json_array_get(cases, i), "text"));
    for (size_t i = 0; i < n_extra; i++) piece[n_cases + i] = k_extra[i];

    /* ~1 MB: pieces in a shuffled order (xorshift, fixed seed), a numbered header per round so
     * that the text does not repeat exactly; paragraph boundaries remembered for the chunked run. */
    buf text = {0};
    size_t *para = malloc(sizeof *para * 65536), n_para = 0;
    uint64_t rng = 0x9E3779B97F4A7C15ull;
    for (unsigned round = 0; text.n < 1000000; round++) {
        char head[64];
        int hl = snprintf(head, sizeof head, "\n\n## Section %u (%u items)\n\n", round, round * 7 % 97);
        buf_add(&text, head, (size_t)hl);
        for (size_t k = 0; k < n_pieces; k++) {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            const char *s = piece[rng % n_pieces];
            buf_add(&text, s, strlen(s));
            buf_add(&text, "\n", 1);
            if (n_para < 65536) para[n_para++] = text.n;
        }
    }
    if (dump) {
        FILE *f = fopen(dump, "wb");
        if (!f || fwrite(text.p, 1, text.n, f) != text.n || fclose(f)) {
            fprintf(stderr, "bench_tokenizer: cannot write %s\n", dump);
            return 1;
        }
    }

    enum { REPS = 7 };
    double whole[REPS], whole_cpu[REPS], chunked[REPS], chunked_cpu[REPS], dec[REPS];
    size_t n_tokens = 0;
    for (int r = 0; r < REPS; r++) {
        int32_t *ids = NULL;
        size_t n = 0;
        double a = now_s(), c = cpu_s();
        if (df_tokenizer_encode(tok, text.p, text.n, 1, &ids, &n, &err)) {
            fprintf(stderr, "bench_tokenizer: %s\n", err.msg);
            return 1;
        }
        whole[r] = now_s() - a;
        whole_cpu[r] = cpu_s() - c;
        n_tokens = n;
        char *out = NULL;
        size_t out_len = 0;
        a = now_s();
        if (df_tokenizer_decode(tok, ids, n, 0, &out, &out_len, &err)) {
            fprintf(stderr, "bench_tokenizer: %s\n", err.msg);
            return 1;
        }
        dec[r] = now_s() - a;
        free(out);
        free(ids);
        a = now_s();
        c = cpu_s();
        size_t prev = 0;
        for (size_t k = 0; k < n_para; k++) {
            if (df_tokenizer_encode(tok, text.p + prev, para[k] - prev, 1, &ids, &n, &err)) {
                fprintf(stderr, "bench_tokenizer: %s\n", err.msg);
                return 1;
            }
            free(ids);
            prev = para[k];
        }
        if (df_tokenizer_encode(tok, text.p + prev, text.n - prev, 1, &ids, &n, &err)) return 1;
        free(ids);
        chunked[r] = now_s() - a;
        chunked_cpu[r] = cpu_s() - c;
    }
    qsort(whole, REPS, sizeof whole[0], cmp_double);
    qsort(chunked, REPS, sizeof chunked[0], cmp_double);
    qsort(dec, REPS, sizeof dec[0], cmp_double);
    qsort(whole_cpu, REPS, sizeof whole_cpu[0], cmp_double);
    qsort(chunked_cpu, REPS, sizeof chunked_cpu[0], cmp_double);
    double mb = (double)text.n / 1e6;
    printf("tokenizer: %s (vocab %d), loaded in %.3f s\n", tok_path, df_tokenizer_vocab_size(tok), load_s);
    printf("text: %zu bytes, %zu tokens (%.2f bytes/token), %zu paragraphs\n", text.n, n_tokens,
           (double)text.n / (double)n_tokens, n_para + 1);
    printf("encode, one call:        %.2f MB/s wall (median of %d; best %.2f), %.2f MB/s of CPU time (median), "
           "%.0f tokens/s\n",
           mb / whole[REPS / 2], REPS, mb / whole[0], mb / whole_cpu[REPS / 2], (double)n_tokens / whole[REPS / 2]);
    printf("encode, per paragraph:   %.2f MB/s wall (median of %d; best %.2f), %.2f MB/s of CPU time (median)\n",
           mb / chunked[REPS / 2], REPS, mb / chunked[0], mb / chunked_cpu[REPS / 2]);
    printf("decode, one call:        %.2f MB/s (median of %d)\n", mb / dec[REPS / 2], REPS);
    free(para);
    free(piece);
    free(text.p);
    json_decref(root);
    df_tokenizer_free(tok);
    return 0;
}
