/* Unit + oracle tests: the byte-level BPE tokenizer against Hugging Face tokenizers' ids
 * (tests/fixtures/qwen3-tokenizer/cases.json for the real Qwen3 vocabulary,
 * tests/fixtures/tiny-bonsai2-tokenizer-cases.json for the tiny pack's tokenizer). */
#include "support.h"

#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>
#include <utf8proc.h>

#include "dflash/tokenizer.h"

static df_tokenizer *g_qwen3, *g_tiny;

static df_tokenizer *load_or_fail(const char *rel) {
    df_error err = {0};
    df_tokenizer *tok = NULL;
    df_status st = df_tokenizer_load(&tok, tu_fixture(rel), &err);
    if (st != DF_OK) fprintf(stderr, "load %s: %s\n", rel, err.msg);
    return tok;
}

static int group_setup(void **state) {
    (void)state;
    g_qwen3 = load_or_fail("qwen3-tokenizer/tokenizer.json");
    g_tiny = load_or_fail("tiny-bonsai2/tokenizer.json");
    return g_qwen3 && g_tiny ? 0 : -1;
}

static int group_teardown(void **state) {
    (void)state;
    df_tokenizer_free(g_qwen3);
    df_tokenizer_free(g_tiny);
    return 0;
}

/* ---- helpers ------------------------------------------------------------------------ */

static int32_t *encode_ok(const df_tokenizer *tok, const char *s, size_t n, int parse_special, size_t *n_ids) {
    df_error err = {0};
    int32_t *ids = NULL;
    df_status st = df_tokenizer_encode(tok, s, n, parse_special, &ids, n_ids, &err);
    if (st != DF_OK) fprintf(stderr, "encode: %s\n", err.msg);
    assert_int_equal(st, DF_OK);
    assert_non_null(ids);
    return ids;
}

static char *decode_ok(const df_tokenizer *tok, const int32_t *ids, size_t n, int skip_special, size_t *len) {
    df_error err = {0};
    char *s = NULL;
    assert_int_equal(df_tokenizer_decode(tok, ids, n, skip_special, &s, len, &err), DF_OK);
    assert_non_null(s);
    assert_int_equal(strlen(s), *len); /* none of the test texts hold NUL except where noted */
    return s;
}

/* Streams ids through df_detok and returns the concatenated text (malloc'd); every push's
 * output must be valid UTF-8 on its own. */
static char *detok_all(const df_tokenizer *tok, const int32_t *ids, size_t n, int skip_special, size_t *len) {
    size_t cap = DF_DETOK_OUT_MAX(df_tokenizer_max_piece_len(tok));
    char *chunk = malloc(cap), *all = malloc(n * cap + 4);
    assert_non_null(chunk);
    assert_non_null(all);
    df_detok d;
    df_detok_init(&d, tok, skip_special);
    size_t o = 0;
    for (size_t i = 0; i < n; i++) {
        df_error err = {0};
        size_t w = df_detok_push(&d, ids[i], chunk, cap, &err);
        assert_int_equal(err.code, DF_OK);
        utf8proc_int32_t cp;
        for (size_t j = 0; j < w;) { /* whole characters only */
            utf8proc_ssize_t l = utf8proc_iterate((const utf8proc_uint8_t *)chunk + j, (utf8proc_ssize_t)(w - j), &cp);
            assert_true(l > 0);
            j += (size_t)l;
        }
        memcpy(all + o, chunk, w);
        o += w;
    }
    o += df_detok_flush(&d, all + o, 4);
    all[o] = 0;
    *len = o;
    free(chunk);
    return all;
}

static char *nfc(const char *s, size_t n, size_t *out_len) {
    utf8proc_uint8_t *r = NULL;
    utf8proc_ssize_t l =
        utf8proc_map((const utf8proc_uint8_t *)s, (utf8proc_ssize_t)n, &r, UTF8PROC_STABLE | UTF8PROC_COMPOSE);
    assert_true(l >= 0);
    *out_len = (size_t)l;
    return (char *)r;
}

/* Checks every case of a cases.json: ids, decoded text, streamed text, NFC round trip. */
static void check_cases(const df_tokenizer *tok, const char *rel, size_t min_cases) {
    json_error_t je;
    json_t *root = json_load_file(tu_fixture(rel), JSON_ALLOW_NUL, &je);
    if (!root) fprintf(stderr, "%s: %s\n", rel, je.text);
    assert_non_null(root);
    json_t *cases = json_object_get(root, "cases");
    assert_true(json_array_size(cases) >= min_cases);
    size_t failures = 0;
    for (size_t c = 0; c < json_array_size(cases); c++) {
        json_t *cs = json_array_get(cases, c), *jt = json_object_get(cs, "text"),
               *jids = json_object_get(cs, "ids"), *jdec = json_object_get(cs, "decoded");
        const char *text = json_string_value(jt);
        size_t tl = json_string_length(jt), n = 0;
        int32_t *ids = encode_ok(tok, text, tl, 1, &n);
        int same = n == json_array_size(jids);
        for (size_t i = 0; same && i < n; i++) same = ids[i] == json_integer_value(json_array_get(jids, i));
        if (!same) {
            fprintf(stderr, "case %zu %.60s: ids differ\n  got     ", c, text);
            for (size_t i = 0; i < n; i++) fprintf(stderr, " %d", ids[i]);
            fprintf(stderr, "\n  expected");
            for (size_t i = 0; i < json_array_size(jids); i++)
                fprintf(stderr, " %lld", (long long)json_integer_value(json_array_get(jids, i)));
            fprintf(stderr, "\n");
            failures++;
        }
        /* decode the expected ids (not ours) so a decode bug cannot hide behind an encode bug */
        size_t ne = json_array_size(jids);
        int32_t *eids = malloc((ne ? ne : 1) * sizeof *eids);
        for (size_t i = 0; i < ne; i++) eids[i] = (int32_t)json_integer_value(json_array_get(jids, i));
        df_error err = {0};
        char *dec = NULL;
        size_t dl = 0;
        assert_int_equal(df_tokenizer_decode(tok, eids, ne, 0, &dec, &dl, &err), DF_OK);
        if (dl != json_string_length(jdec) || memcmp(dec, json_string_value(jdec), dl) != 0) {
            fprintf(stderr, "case %zu %.60s: decoded text differs: %s\n", c, text, dec);
            failures++;
        }
        size_t sl = 0;
        char *streamed = detok_all(tok, eids, ne, 0, &sl);
        if (sl != dl || memcmp(streamed, dec, dl) != 0) {
            fprintf(stderr, "case %zu %.60s: streamed text differs: %s\n", c, text, streamed);
            failures++;
        }
        size_t nl = 0;
        char *norm = nfc(text, tl, &nl);
        if (nl != dl || memcmp(norm, dec, dl) != 0) {
            fprintf(stderr, "case %zu %.60s: decode(encode(x)) != NFC(x)\n", c, text);
            failures++;
        }
        free(norm);
        free(streamed);
        free(dec);
        free(eids);
        free(ids);
    }
    json_decref(root);
    assert_int_equal(failures, 0);
}

/* ---- oracle tests ----------------------------------------------------------------- */

static void test_qwen3_cases(void **state) {
    (void)state;
    check_cases(g_qwen3, "qwen3-tokenizer/cases.json", 30);
}

static void test_tiny_cases(void **state) {
    (void)state;
    check_cases(g_tiny, "tiny-bonsai2-tokenizer-cases.json", 20);
}

/* A long input (which encode serves through its per-call piece cache) joined by <|endoftext|>
 * must encode as the concatenation of its parts, each with the oracle ids. */
static void test_long_input_matches_parts(void **state) {
    (void)state;
    json_error_t je;
    json_t *root = json_load_file(tu_fixture("qwen3-tokenizer/cases.json"), 0, &je);
    assert_non_null(root);
    json_t *cases = json_object_get(root, "cases");
    size_t cap = 1 << 16, tl = 0, ne = 0;
    char *text = malloc(cap);
    int32_t *expect = malloc(cap * sizeof *expect);
    for (int round = 0; round < 4; round++) {
        for (size_t c = 0; c < json_array_size(cases); c++) {
            json_t *cs = json_array_get(cases, c), *jids = json_object_get(cs, "ids");
            const char *t = json_string_value(json_object_get(cs, "text"));
            size_t l = strlen(t);
            assert_true(tl + l + 16 < cap && ne + json_array_size(jids) + 1 < cap);
            memcpy(text + tl, t, l);
            memcpy(text + tl + l, "<|endoftext|>", 13);
            tl += l + 13;
            for (size_t i = 0; i < json_array_size(jids); i++)
                expect[ne++] = (int32_t)json_integer_value(json_array_get(jids, i));
            expect[ne++] = 151643;
        }
    }
    assert_true(tl > 4096);
    size_t n = 0;
    int32_t *ids = encode_ok(g_qwen3, text, tl, 1, &n);
    assert_int_equal(n, ne);
    assert_memory_equal(ids, expect, n * sizeof *ids);
    free(ids);
    free(expect);
    free(text);
    json_decref(root);
}

static void test_vocab_queries(void **state) {
    (void)state;
    assert_int_equal(df_tokenizer_vocab_size(g_qwen3), 151669);
    assert_int_equal(df_tokenizer_vocab_size(g_tiny), 2017);
    assert_int_equal(df_tokenizer_token_id(g_qwen3, "<|im_end|>"), 151645);
    assert_int_equal(df_tokenizer_token_id(g_qwen3, "<think>"), 151667);
    assert_int_equal(df_tokenizer_token_id(g_qwen3, "Hello"), 9707);
    assert_int_equal(df_tokenizer_token_id(g_qwen3, "\xc4\xa0world"), 1879); /* "Ġworld" */
    assert_int_equal(df_tokenizer_token_id(g_qwen3, "no such token, surely"), -1);
    assert_int_equal(df_tokenizer_token_id(g_tiny, "<|im_start|>"), 1985);
    assert_int_equal(df_tokenizer_token_id(g_tiny, "</think>"), 2009);
    assert_true(df_tokenizer_is_special(g_tiny, 1986));
    assert_false(df_tokenizer_is_special(g_tiny, 2008)); /* <think> is added but not special */
    assert_false(df_tokenizer_is_special(g_tiny, 100));
    assert_false(df_tokenizer_is_special(g_tiny, 2040));
    assert_false(df_tokenizer_is_special(g_tiny, -7));
    size_t len = 0;
    assert_string_equal(df_tokenizer_piece(g_qwen3, 1879, &len), " world");
    assert_int_equal(len, 6);
    assert_string_equal(df_tokenizer_piece(g_tiny, 2008, &len), "<think>");
    assert_true(df_tokenizer_max_piece_len(g_qwen3) >= 16);
}

/* ---- decoding ------------------------------------------------------------------------ */

static void test_out_of_vocab_ids(void **state) {
    (void)state;
    /* The tiny model's embedding has 2048 rows; 2017..2047 have no token. */
    const int32_t ids[] = {2017, 2030, 2047, 2048, -1, INT32_MAX, INT32_MIN, 1 << 30};
    for (size_t i = 0; i < sizeof ids / sizeof ids[0]; i++) {
        size_t len = 99;
        const char *p = df_tokenizer_piece(g_tiny, ids[i], &len);
        assert_non_null(p);
        assert_int_equal(len, 0);
        assert_string_equal(p, "");
    }
    size_t n = 0;
    int32_t *hi = encode_ok(g_tiny, "hi there", 8, 1, &n);
    int32_t mixed[16];
    size_t m = 0;
    for (size_t i = 0; i < sizeof ids / sizeof ids[0]; i++) {
        mixed[m++] = ids[i];
        if (i < n) mixed[m++] = hi[i];
    }
    for (size_t i = sizeof ids / sizeof ids[0]; i < n; i++) mixed[m++] = hi[i];
    size_t len = 0;
    char *s = decode_ok(g_tiny, mixed, m, 0, &len);
    assert_string_equal(s, "hi there");
    free(s);
    char *st = detok_all(g_tiny, mixed, m, 0, &len);
    assert_string_equal(st, "hi there");
    free(st);
    free(hi);
    s = decode_ok(g_tiny, ids, 0, 0, &len); /* nothing at all */
    assert_string_equal(s, "");
    free(s);
}

static void test_skip_special(void **state) {
    (void)state;
    const char *text = "<|im_start|>user\n<think>hi</think><|im_end|>";
    size_t n = 0, len = 0;
    int32_t *ids = encode_ok(g_qwen3, text, strlen(text), 1, &n);
    char *all = decode_ok(g_qwen3, ids, n, 0, &len);
    assert_string_equal(all, text);
    char *some = decode_ok(g_qwen3, ids, n, 1, &len);
    assert_string_equal(some, "user\n<think>hi</think>"); /* <think> is not special */
    char *streamed = detok_all(g_qwen3, ids, n, 1, &len);
    assert_string_equal(streamed, some);
    free(streamed);
    free(all);
    free(some);
    free(ids);
}

/* The id of the vocabulary token whose piece is the single byte b (-1 if none). */
static int32_t byte_token(const df_tokenizer *tok, unsigned char b) {
    for (int32_t i = 0; i < df_tokenizer_vocab_size(tok); i++) {
        size_t len;
        const char *p = df_tokenizer_piece(tok, i, &len);
        if (len == 1 && (unsigned char)p[0] == b) return i;
    }
    return -1;
}

static void test_detok_split_sequence(void **state) {
    (void)state;
    /* U+1F600 (F0 9F 98 80) and U+00E9 (C3 A9) fed one byte token at a time. */
    const unsigned char bytes[] = {'a', 0xF0, 0x9F, 0x98, 0x80, 0xC3, 0xA9, 'b'};
    const size_t expect_len[] = {1, 0, 0, 0, 4, 0, 2, 1};
    int32_t ids[8];
    for (size_t i = 0; i < 8; i++) {
        ids[i] = byte_token(g_tiny, bytes[i]);
        assert_true(ids[i] >= 0);
    }
    df_detok d;
    df_detok_init(&d, g_tiny, 0);
    char out[64];
    size_t o = 0;
    for (size_t i = 0; i < 8; i++) {
        df_error err = {0};
        size_t w = df_detok_push(&d, ids[i], out + o, sizeof out - o, &err);
        assert_int_equal(w, expect_len[i]);
        o += w;
    }
    assert_int_equal(df_detok_flush(&d, out + o, sizeof out - o), 0);
    assert_memory_equal(out, "a\xF0\x9F\x98\x80\xC3\xA9" "b", 8);

    /* A real multi-byte token split: the Qwen3 ids of an emoji run, streamed. */
    const char *emoji = "x😀👍🏽y";
    size_t n = 0, len = 0;
    int32_t *eids = encode_ok(g_qwen3, emoji, strlen(emoji), 1, &n);
    assert_true(n > 3); /* the emoji are spread over several byte-level tokens */
    char *s = detok_all(g_qwen3, eids, n, 0, &len);
    assert_string_equal(s, emoji);
    free(s);
    free(eids);
}

static void test_detok_invalid_and_flush(void **state) {
    (void)state;
    int32_t f0 = byte_token(g_tiny, 0xF0), x9f = byte_token(g_tiny, 0x9F), a = byte_token(g_tiny, 'A'),
            ff = byte_token(g_tiny, 0xFF), c3 = byte_token(g_tiny, 0xC3);
    assert_true(f0 >= 0 && x9f >= 0 && a >= 0 && ff >= 0 && c3 >= 0);
    df_detok d;
    df_detok_init(&d, g_tiny, 0);
    char out[64];
    df_error err = {0};
    /* F0 9F then 'A': the cut sequence becomes one U+FFFD, then 'A' */
    assert_int_equal(df_detok_push(&d, f0, out, sizeof out, &err), 0);
    assert_int_equal(df_detok_push(&d, x9f, out, sizeof out, &err), 0);
    assert_int_equal(df_detok_push(&d, a, out, sizeof out, &err), 4);
    assert_memory_equal(out, "\xEF\xBF\xBD" "A", 4);
    /* FF can never start a sequence: emitted at once */
    assert_int_equal(df_detok_push(&d, ff, out, sizeof out, &err), 3);
    /* a held C3 flushed at the end: one U+FFFD */
    assert_int_equal(df_detok_push(&d, c3, out, sizeof out, &err), 0);
    assert_int_equal(df_detok_flush(&d, out, 2), 0); /* too small: kept */
    assert_int_equal(df_detok_flush(&d, out, sizeof out), 3);
    assert_memory_equal(out, "\xEF\xBF\xBD", 3);
    assert_int_equal(df_detok_flush(&d, out, sizeof out), 0);
    /* the same ids through df_tokenizer_decode give the same text */
    const int32_t ids[] = {f0, x9f, a, ff, c3};
    size_t len = 0;
    char *s = decode_ok(g_tiny, ids, 5, 0, &len);
    assert_string_equal(s, "\xEF\xBF\xBD" "A\xEF\xBF\xBD\xEF\xBF\xBD");
    free(s);
    /* a buffer too small: DF_ERR_RANGE, nothing written, state unchanged */
    int32_t word = df_tokenizer_token_id(g_tiny, "<tool_call>");
    df_detok_init(&d, g_tiny, 0);
    assert_int_equal(df_detok_push(&d, c3, out, sizeof out, &err), 0);
    err.code = DF_OK;
    assert_int_equal(df_detok_push(&d, word, out, 5, &err), 0);
    assert_int_equal(err.code, DF_ERR_RANGE);
    assert_int_equal(d.n_pending, 1);
    assert_int_equal(df_detok_push(&d, word, out, sizeof out, &err), 3 + 11);
    assert_memory_equal(out, "\xEF\xBF\xBD<tool_call>", 14);
}

/* ---- encoding -------------------------------------------------------------------------- */

static void test_invalid_utf8(void **state) {
    (void)state;
    static const struct {
        const char *s;
        size_t n, at;
    } bad[] = {
        {"abc\xFF", 4, 3},           {"\x80", 1, 0},           {"ok \xC3", 4, 3},      /* truncated */
        {"\xC0\xAF", 2, 0},          {"\xE0\x80\xAF", 3, 0},   {"x\xED\xA0\x80", 4, 1}, /* surrogate */
        {"\xF4\x90\x80\x80", 4, 0},  {"\xF0\x9F\x98", 3, 0},   {"a\xC3(b", 4, 1},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        df_error err = {0};
        int32_t *ids = (int32_t *)&err; /* must be reset to NULL */
        size_t n = 7;
        assert_int_equal(df_tokenizer_encode(g_qwen3, bad[i].s, bad[i].n, 1, &ids, &n, &err), DF_ERR_INVALID_ARG);
        assert_null(ids);
        assert_int_equal(n, 0);
        char want[32];
        snprintf(want, sizeof want, "at byte %zu", bad[i].at);
        assert_non_null(strstr(err.msg, want));
    }
}

static void test_parse_special_off(void **state) {
    (void)state;
    const char *text = "<|im_start|>user <think>";
    size_t n = 0;
    int32_t *on = encode_ok(g_tiny, text, strlen(text), 1, &n);
    assert_int_equal(on[0], 1985);
    assert_int_equal(on[n - 1], 2008);
    free(on);
    int32_t *off = encode_ok(g_tiny, text, strlen(text), 0, &n);
    for (size_t i = 0; i < n; i++) assert_int_not_equal(off[i], 1985);
    assert_int_equal(off[n - 1], 2008); /* non-special added tokens still match */
    size_t len = 0;
    char *s = decode_ok(g_tiny, off, n, 1, &len);
    assert_string_equal(s, text); /* the text survives skip_special: it is plain text */
    free(s);
    free(off);
}

static void test_empty_and_long_inputs(void **state) {
    (void)state;
    size_t n = 99;
    int32_t *ids = encode_ok(g_qwen3, "", 0, 1, &n);
    assert_int_equal(n, 0);
    free(ids);
    /* long runs: one letter (one huge regex piece), spaces (the \s+(?!\S) lookahead), mixed */
    size_t big = 200000;
    char *s = malloc(big + 1);
    const char fill[] = {'a', ' ', '\n', '7'};
    for (size_t f = 0; f < sizeof fill; f++) {
        memset(s, fill[f], big);
        s[big - 1] = 'z';
        for (int t = 0; t < 2; t++) {
            const df_tokenizer *tok = t ? g_tiny : g_qwen3;
            ids = encode_ok(tok, s, big, 1, &n);
            assert_true(n > 0 && n <= big);
            size_t len = 0;
            char *back = decode_ok(tok, ids, n, 0, &len);
            assert_int_equal(len, big);
            assert_memory_equal(back, s, big);
            free(back);
            free(ids);
        }
    }
    free(s);
}

static void test_round_trip_nfc(void **state) {
    (void)state;
    static const char *texts[] = {
        "e\xCC\x81 o\xCC\x88 A\xCC\x8A \xE1\x84\x80\xE1\x85\xA1 (decomposed Latin, Hangul jamo)",
        "\xE2\x84\xAB \xE2\x84\xA6 (Angstrom and Ohm signs: singletons that NFC replaces)",
        "tabs\tand\r\nCRLF\r\n\r\n  \t\n",
        "mixed \xD7\x90\xD6\xB7 \xE0\xA4\x95\xE0\xA4\xBC \xE0\xBD\x80\xE0\xBE\xB5 marks",
        "<|im_start|>e\xCC\x81<|im_end|>\xCC\x81", /* a mark right after an added token */
        "a\0b", /* NUL is valid UTF-8 */
    };
    const size_t lens[] = {0, 0, 0, 0, 0, 3};
    for (int t = 0; t < 2; t++) {
        const df_tokenizer *tok = t ? g_tiny : g_qwen3;
        for (size_t i = 0; i < sizeof texts / sizeof texts[0]; i++) {
            size_t tl = lens[i] ? lens[i] : strlen(texts[i]), n = 0, nl = 0;
            int32_t *ids = encode_ok(tok, texts[i], tl, 1, &n);
            df_error err = {0};
            char *dec = NULL;
            size_t dl = 0;
            assert_int_equal(df_tokenizer_decode(tok, ids, n, 0, &dec, &dl, &err), DF_OK);
            char *norm = nfc(texts[i], tl, &nl);
            assert_int_equal(dl, nl);
            assert_memory_equal(dec, norm, nl);
            free(norm);
            free(dec);
            free(ids);
        }
    }
}

/* ---- loading ----------------------------------------------------------------------------- */

/* The tiny tokenizer.json with its ["a","b"] merges rewritten as "a b" strings must load and
 * encode the same. */
static void test_string_merges(void **state) {
    (void)state;
    json_error_t je;
    json_t *root = json_load_file(tu_fixture("tiny-bonsai2/tokenizer.json"), 0, &je);
    assert_non_null(root);
    json_t *merges = json_object_get(json_object_get(root, "model"), "merges");
    assert_true(json_array_size(merges) > 100);
    assert_true(json_is_array(json_array_get(merges, 0)));
    for (size_t i = 0; i < json_array_size(merges); i++) {
        json_t *m = json_array_get(merges, i);
        char buf[512];
        snprintf(buf, sizeof buf, "%s %s", json_string_value(json_array_get(m, 0)),
                 json_string_value(json_array_get(m, 1)));
        json_array_set_new(merges, i, json_string(buf));
    }
    char *text = json_dumps(root, JSON_COMPACT);
    json_decref(root);
    df_tokenizer *tok = NULL;
    df_error err = {0};
    assert_int_equal(df_tokenizer_load_json(&tok, text, strlen(text), &err), DF_OK);
    free(text);
    const char *sample = "def main():\n    print('hello, world')  # ok\n<|im_end|>";
    size_t n1 = 0, n2 = 0;
    int32_t *a = encode_ok(tok, sample, strlen(sample), 1, &n1), *b = encode_ok(g_tiny, sample, strlen(sample), 1, &n2);
    assert_int_equal(n1, n2);
    assert_memory_equal(a, b, n1 * sizeof *a);
    free(a);
    free(b);
    df_tokenizer_free(tok);
}

/* lstrip / rstrip / single_word / normalized added tokens: the tiny tokenizer with the flags
 * changed as the fixture's "added_flag_variant" says, against tokenizers' ids. (Decoded text is
 * not compared: tokenizers runs added tokens through the ByteLevel decoder, which garbles a
 * non-ASCII content such as "café"; dflash decodes an added token to its content.) */
static void test_added_flag_variant(void **state) {
    (void)state;
    json_error_t je;
    json_t *cases = json_load_file(tu_fixture("tiny-bonsai2-tokenizer-cases.json"), JSON_ALLOW_NUL, &je);
    json_t *root = json_load_file(tu_fixture("tiny-bonsai2/tokenizer.json"), 0, &je);
    assert_non_null(cases);
    assert_non_null(root);
    json_t *variant = json_object_get(cases, "added_flag_variant"), *changes = json_object_get(variant, "changes");
    assert_true(json_array_size(changes) >= 5);
    json_t *added = json_object_get(root, "added_tokens");
    size_t applied = 0;
    for (size_t i = 0; i < json_array_size(added); i++) {
        json_t *a = json_array_get(added, i);
        for (size_t k = 0; k < json_array_size(changes); k++) {
            json_t *ch = json_array_get(changes, k);
            if (strcmp(json_string_value(json_object_get(a, "content")),
                       json_string_value(json_object_get(ch, "match"))) == 0) {
                assert_int_equal(json_object_update(a, json_object_get(ch, "set")), 0);
                applied++;
            }
        }
    }
    assert_int_equal(applied, json_array_size(changes));
    char *text = json_dumps(root, JSON_COMPACT);
    df_tokenizer *tok = NULL;
    df_error err = {0};
    assert_int_equal(df_tokenizer_load_json(&tok, text, strlen(text), &err), DF_OK);
    json_t *list = json_object_get(variant, "cases");
    assert_true(json_array_size(list) >= 10);
    size_t failures = 0;
    for (size_t c = 0; c < json_array_size(list); c++) {
        json_t *cs = json_array_get(list, c), *jt = json_object_get(cs, "text"), *jids = json_object_get(cs, "ids");
        size_t n = 0;
        int32_t *ids = encode_ok(tok, json_string_value(jt), json_string_length(jt), 1, &n);
        int same = n == json_array_size(jids);
        for (size_t i = 0; same && i < n; i++) same = ids[i] == json_integer_value(json_array_get(jids, i));
        if (!same) {
            fprintf(stderr, "variant case %zu %s: ids differ\n", c, json_string_value(jt));
            failures++;
        }
        free(ids);
    }
    assert_int_equal(failures, 0);
    df_tokenizer_free(tok);
    free(text);
    json_decref(root);
    json_decref(cases);
}

static df_status load_str(const char *json, df_error *err) {
    df_tokenizer *tok = NULL;
    df_status st = df_tokenizer_load_json(&tok, json, strlen(json), err);
    df_tokenizer_free(tok);
    return st;
}

#define PRE "\"pre_tokenizer\":{\"type\":\"ByteLevel\",\"add_prefix_space\":false,\"use_regex\":true}"

static void test_load_errors(void **state) {
    (void)state;
    df_error err = {0};
    df_tokenizer *tok = (df_tokenizer *)&err;
    assert_int_equal(df_tokenizer_load(&tok, "/nonexistent/tokenizer.json", &err), DF_ERR_IO);
    assert_null(tok);
    assert_non_null(strstr(err.msg, "/nonexistent/tokenizer.json"));
    /* a FIFO (an open or read that would block forever) and a folder: clear errors, at once */
    char dir[] = "/tmp/dflash-tok-XXXXXX", fifo[64];
    assert_non_null(mkdtemp(dir));
    snprintf(fifo, sizeof fifo, "%s/tokenizer.json", dir);
    assert_int_equal(mkfifo(fifo, 0600), 0);
    assert_int_equal(df_tokenizer_load(&tok, fifo, &err), DF_ERR_IO);
    assert_non_null(strstr(err.msg, "not a regular file"));
    assert_int_equal(unlink(fifo), 0);
    assert_int_equal(df_tokenizer_load(&tok, dir, &err), DF_ERR_IO);
    assert_non_null(strstr(err.msg, "is a folder"));
    assert_int_equal(rmdir(dir), 0);

    assert_int_equal(load_str("{\"model\": ", &err), DF_ERR_FORMAT);
    assert_non_null(strstr(err.msg, "line"));
    /* a minimal valid file */
    assert_int_equal(load_str("{\"model\":{\"type\":\"BPE\",\"vocab\":{\"a\":0,\"b\":1,\"ab\":2},\"merges\":[\"a b\"]}," PRE "}",
                              &err),
                     DF_OK);
    assert_int_equal(load_str("{\"model\":{\"type\":\"BPE\",\"vocab\":{\"a\":0,\"b\":1},\"merges\":[\"a b\"]}," PRE "}", &err),
                     DF_ERR_FORMAT);
    assert_non_null(strstr(err.msg, "merges[0]"));
    assert_int_equal(load_str("{\"model\":{\"type\":\"BPE\",\"vocab\":{\"a\":0},\"merges\":[\"a\"]}," PRE "}", &err),
                     DF_ERR_FORMAT);
    assert_int_equal(load_str("{\"model\":{\"type\":\"WordPiece\",\"vocab\":{}}," PRE "}", &err), DF_ERR_UNSUPPORTED);
    assert_int_equal(load_str("{\"model\":{\"type\":\"BPE\",\"vocab\":{\"a\":-3},\"merges\":[]}," PRE "}", &err),
                     DF_ERR_RANGE);
    assert_int_equal(load_str("{\"model\":{\"vocab\":{},\"merges\":[]},\"normalizer\":{\"type\":\"NFKC\"}," PRE "}", &err),
                     DF_ERR_UNSUPPORTED);
    assert_non_null(strstr(err.msg, "NFKC"));
    assert_int_equal(load_str("{\"model\":{\"vocab\":{},\"merges\":[]},\"pre_tokenizer\":{\"type\":\"Sequence\","
                              "\"pretokenizers\":[{\"type\":\"Split\",\"pattern\":{\"Regex\":\"(\"},\"behavior\":"
                              "\"Isolated\"},{\"type\":\"ByteLevel\",\"add_prefix_space\":false,\"use_regex\":false}]}}",
                              &err),
                     DF_ERR_FORMAT);
    assert_non_null(strstr(err.msg, "regex"));
    assert_int_equal(load_str("{\"model\":{\"vocab\":{},\"merges\":[]},\"pre_tokenizer\":{\"type\":\"Split\",\"pattern\":{"
                              "\"Regex\":\"a\"},\"behavior\":\"Removed\"}}",
                              &err),
                     DF_ERR_UNSUPPORTED);
    assert_int_equal(load_str("{\"model\":{\"vocab\":{},\"merges\":[]},\"added_tokens\":[{\"id\":\"x\"}]," PRE "}", &err),
                     DF_ERR_FORMAT);
    assert_int_equal(load_str("[1,2]", &err), DF_ERR_FORMAT);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_qwen3_cases),
        cmocka_unit_test(test_tiny_cases),
        cmocka_unit_test(test_long_input_matches_parts),
        cmocka_unit_test(test_vocab_queries),
        cmocka_unit_test(test_out_of_vocab_ids),
        cmocka_unit_test(test_skip_special),
        cmocka_unit_test(test_detok_split_sequence),
        cmocka_unit_test(test_detok_invalid_and_flush),
        cmocka_unit_test(test_invalid_utf8),
        cmocka_unit_test(test_parse_special_off),
        cmocka_unit_test(test_empty_and_long_inputs),
        cmocka_unit_test(test_round_trip_nfc),
        cmocka_unit_test(test_string_merges),
        cmocka_unit_test(test_added_flag_variant),
        cmocka_unit_test(test_load_errors),
    };
    return cmocka_run_group_tests(tests, group_setup, group_teardown);
}
