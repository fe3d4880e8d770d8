/* Unit tests: safetensors reading and header validation (files written at test time). */
#include "support.h"

#include <math.h>
#include <string.h>

#include "dflash/safetensors.h"
#include "st_write.h"

typedef df_status (*open_fn)(df_tensor_set **out, const char *path, df_error *err);

/* Opens path with open; expects failure with code and every needle in the message. */
static void expect_error(open_fn open, const char *path, df_status code, const char *n1,
                         const char *n2) {
    df_tensor_set *s = (df_tensor_set *)1;
    df_error err = {0};
    df_status st = open(&s, path, &err);
    if (st != code || (n1 && !strstr(err.msg, n1)) || (n2 && !strstr(err.msg, n2)))
        fail_msg("expected %s with \"%s\" / \"%s\", got %s: %s", df_status_name(code),
                 n1 ? n1 : "", n2 ? n2 : "", df_status_name(st), err.msg);
    assert_null(s);
}

#define expect_open_error(...) expect_error(df_tensors_open_file, __VA_ARGS__)
#define expect_dir_error(...) expect_error(df_tensors_open_dir, __VA_ARGS__)

/* A small file with one tensor of each dtype. */
static void small_file(tw_file *f) {
    memset(f, 0, sizeof *f);
    float a[6] = {1, 2, 3, 4, 5, 6};
    uint16_t h[4] = {0x3c00, 0xc000, 0x3800, 0x0000}; /* 1, -2, 0.5, 0 */
    uint16_t bf[2] = {0x3f80, 0xc040};                /* 1, -3 */
    uint32_t u[3] = {1, 0xffffffffu, 7};
    int32_t i32[2] = {-5, 9};
    uint8_t u8[3] = {1, 2, 3};
    int64_t i64[1] = {-1234567890123ll};
    tw_add(f, "a", "F32", 2, (int64_t[]){2, 3}, a);
    tw_add(f, "h", "F16", 1, (int64_t[]){4}, h);
    tw_add(f, "bf", "BF16", 2, (int64_t[]){1, 2}, bf);
    tw_add(f, "u", "U32", 1, (int64_t[]){3}, u);
    tw_add(f, "i", "I32", 1, (int64_t[]){2}, i32);
    tw_add(f, "b", "U8", 1, (int64_t[]){3}, u8);
    tw_add(f, "l", "I64", 0, NULL, i64);
    tw_add(f, "empty", "F32", 2, (int64_t[]){0, 5}, NULL);
}

static void test_read_all_dtypes(void **state) {
    (void)state;
    tw_file f;
    small_file(&f);
    const char *p = tw_path(tw_dir, "small.safetensors");
    tw_save(&f, p);
    tw_free(&f);
    df_tensor_set *s = NULL;
    df_error err = {0};
    assert_int_equal(df_tensors_open_file(&s, p, &err), DF_OK);
    assert_int_equal(df_tensors_count(s), 8);
    assert_int_equal(df_tensors_file_count(s), 1);
    assert_string_equal(df_tensors_format(s), "mlx");
    assert_string_equal(df_tensors_file_path(s, 0), p);
    assert_string_equal(df_tensors_file_path(s, 3), "?");
    df_tensor *t = df_tensors_find(s, "a");
    assert_non_null(t);
    assert_int_equal(t->dtype, DF_DTYPE_F32);
    assert_int_equal(t->ndim, 2);
    assert_int_equal(t->shape[1], 3);
    assert_int_equal(t->numel, 6);
    assert_int_equal(t->nbytes, 24);
    assert_true(((const float *)t->data)[5] == 6.0f);
    assert_false(t->used);
    assert_ptr_equal(df_tensors_take(s, "a"), t);
    assert_true(t->used);
    t = df_tensors_find(s, "h");
    assert_true(df_f16_to_f32(((const uint16_t *)t->data)[1]) == -2.0f);
    t = df_tensors_find(s, "bf");
    assert_int_equal(t->dtype, DF_DTYPE_BF16);
    assert_true(df_bf16_to_f32(((const uint16_t *)t->data)[1]) == -3.0f);
    assert_int_equal(((const uint32_t *)df_tensors_find(s, "u")->data)[1], 0xffffffffu);
    assert_int_equal(((const int32_t *)df_tensors_find(s, "i")->data)[0], -5);
    assert_int_equal(((const uint8_t *)df_tensors_find(s, "b")->data)[2], 3);
    t = df_tensors_find(s, "l");
    assert_int_equal(t->ndim, 0);
    assert_int_equal(t->numel, 1);
    assert_true(((const int64_t *)t->data)[0] == -1234567890123ll);
    t = df_tensors_find(s, "empty");
    assert_int_equal(t->numel, 0);
    assert_int_equal(t->nbytes, 0);
    assert_null(df_tensors_find(s, "nope"));
    assert_null(df_tensors_at(s, 8));
    df_tensors_free(s);
}

/* A header whose length is not a multiple of 8 leaves tensors misaligned in the mapping:
 * they are handed out as aligned copies. */
static void test_misaligned_header(void **state) {
    (void)state;
    float a[3] = {1.5f, -2.5f, 3.5f};
    char data[16];
    memcpy(data, a, 12);
    const char *p = tw_path(tw_dir, "odd.safetensors");
    tw_save_raw(p, "{\"x\":{\"dtype\":\"F32\",\"shape\":[3],\"data_offsets\":[0,12]}}", 1, data, 12);
    df_tensor_set *s = NULL;
    df_error err = {0};
    assert_int_equal(df_tensors_open_file(&s, p, &err), DF_OK);
    df_tensor *t = df_tensors_find(s, "x");
    assert_int_equal((uintptr_t)t->data % 4, 0);
    assert_memory_equal(t->data, a, 12);
    assert_null(df_tensors_format(s));
    df_tensors_free(s);
}

static void test_header_errors(void **state) {
    (void)state;
    char data[64] = {0};
    const char *p = tw_path(tw_dir, "bad.safetensors");
    struct {
        const char *hdr;
        size_t len;
        df_status code;
        const char *n1, *n2;
    } cases[] = {
        {"{\"x\":{\"dtype\":\"F32\",\"shape\":[3],\"data_offsets\":[0,12]", 12, DF_ERR_FORMAT,
         "header is not valid JSON", NULL},
        {"[1,2]", 0, DF_ERR_FORMAT, "header is not a JSON object", NULL},
        {"{\"x\":{\"dtype\":\"Q3\",\"shape\":[3],\"data_offsets\":[0,12]}}", 12, DF_ERR_FORMAT,
         "tensor x: unknown dtype \"Q3\"", NULL},
        {"{\"x\":{\"dtype\":\"F64\",\"shape\":[3],\"data_offsets\":[0,24]}}", 24, DF_ERR_FORMAT,
         "tensor x: unsupported dtype \"F64\"", NULL},
        {"{\"w\":{\"dtype\":\"F32\",\"shape\":[4],\"data_offsets\":[0,12]}}", 12, DF_ERR_FORMAT,
         "tensor w: data_offsets [0, 12] hold 12 bytes but shape and dtype F32 need 16", NULL},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},"
         "\"b\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[4,12]}}", 12, DF_ERR_FORMAT,
         "tensors a [0, 8) and b [4, 12) overlap", NULL},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},"
         "\"far\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[40,48]}}", 16, DF_ERR_FORMAT,
         "tensor far: data_offsets [40, 48] past the end of the data region (16 bytes)", NULL},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},"
         "\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[8,16]}}", 16, DF_ERR_FORMAT,
         "duplicate tensor name \"a\"", NULL},
        {"{\"x\":{\"dtype\":\"F32\",\"shape\":[-1],\"data_offsets\":[0,0]}}", 0, DF_ERR_FORMAT,
         "tensor x: shape[0] is not a non-negative integer", NULL},
        {"{\"x\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[8,4]}}", 8, DF_ERR_FORMAT,
         "tensor x: bad data_offsets [8, 4]", NULL},
        {"{\"x\":{\"dtype\":\"F32\",\"shape\":[1]}}", 8, DF_ERR_FORMAT,
         "tensor x: \"data_offsets\" must be", NULL},
        {"{\"x\":{\"shape\":[1],\"data_offsets\":[0,4]}}", 8, DF_ERR_FORMAT,
         "tensor x: missing or non-string \"dtype\"", NULL},
        {"{\"x\":[1]}", 8, DF_ERR_FORMAT, "tensor x: header entry is not an object", NULL},
        {"{\"x\":{\"dtype\":\"U8\",\"shape\":[1,1,1,1,1,1,1,1,1],\"data_offsets\":[0,1]}}", 8,
         DF_ERR_FORMAT, "tensor x: 9 dimensions", NULL},
        {"{\"x\":{\"dtype\":\"F32\",\"shape\":[4294967296,4294967296,16],\"data_offsets\":[0,4]}}",
         8, DF_ERR_FORMAT, "tensor x: shape product overflows", NULL},
        {"{\"__metadata__\":7}", 0, DF_ERR_FORMAT, "__metadata__ is not an object", NULL},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        tw_save_raw(p, cases[i].hdr, 8, data, cases[i].len);
        expect_open_error(p, cases[i].code, cases[i].n1, cases[i].n2);
        expect_open_error(p, cases[i].code, "bad.safetensors", NULL);
    }
}

static void test_file_errors(void **state) {
    (void)state;
    const char *p = tw_path(tw_dir, "short.safetensors");
    expect_open_error(tw_path(tw_dir, "absent.safetensors"), DF_ERR_IO, "absent.safetensors",
                      "cannot open");
    assert_int_equal(tu_write_file(p, "\x10\0\0", 3), 0);
    expect_open_error(p, DF_ERR_FORMAT, "short.safetensors", "too short for the 8-byte header");
    /* header length beyond the file */
    uint8_t buf[24] = {0xff, 0xff, 0, 0, 0, 0, 0, 0, '{', '}'};
    assert_int_equal(tu_write_file(p, buf, sizeof buf), 0);
    expect_open_error(p, DF_ERR_FORMAT, "short.safetensors: header length 65535 exceeds the file size",
                      NULL);
    buf[0] = 2;
    buf[1] = 0;
    buf[7] = 0x80; /* 2^63 + 2 */
    assert_int_equal(tu_write_file(p, buf, sizeof buf), 0);
    expect_open_error(p, DF_ERR_FORMAT, "exceeds the file size", NULL);
    /* an empty header object is a valid, empty file */
    tw_save_raw(p, "{}", 8, NULL, 0);
    df_tensor_set *s = NULL;
    df_error err = {0};
    assert_int_equal(df_tensors_open_file(&s, p, &err), DF_OK);
    assert_int_equal(df_tensors_count(s), 0);
    df_tensors_free(s);
    /* a folder is not a file */
    expect_open_error(tw_dir, DF_ERR_IO, "is a folder, not a file", NULL);
}

/* The tiny pack's file cut inside its data: a truncated file, naming the first cut tensor. */
static void test_truncated_pack_file(void **state) {
    (void)state;
    size_t len;
    char *d = tu_read_file(tu_fixture("tiny-bonsai2/model.safetensors"), &len);
    assert_non_null(d);
    const char *p = tw_path(tw_dir, "model.safetensors");
    assert_int_equal(tu_write_file(p, d, len - 1000), 0);
    expect_open_error(p, DF_ERR_FORMAT, "model.safetensors: file truncated",
                      "(tensor language_model.");
    /* cut inside the header */
    assert_int_equal(tu_write_file(p, d, 1000), 0);
    expect_open_error(p, DF_ERR_FORMAT, "header length 31544 exceeds the file size (1000 bytes)",
                      NULL);
    free(d);
}

/* Every prefix of a small file, and random byte changes in its header: an error or a
 * valid set, never a crash or an out-of-bounds read (run under ASan). */
static void test_no_crash_on_corruption(void **state) {
    (void)state;
    tw_file f;
    small_file(&f);
    uint8_t *data;
    size_t len;
    json_t *h = tw_header(&f, &data, &len);
    char *hs = json_dumps(h, JSON_COMPACT);
    const char *p = tw_path(tw_dir, "fuzz.safetensors");
    tw_save_raw(p, hs, 8, data, len);
    size_t flen;
    uint8_t *full = (uint8_t *)tu_read_file(p, &flen);
    for (size_t cut = 0; cut < flen; cut++) {
        assert_int_equal(tu_write_file(p, full, cut), 0);
        df_tensor_set *s = NULL;
        df_error err = {0};
        assert_int_not_equal(df_tensors_open_file(&s, p, &err), DF_OK);
        assert_true(err.msg[0] != 0);
        assert_null(s);
    }
    uint32_t rng = 12345;
    uint8_t *mut = malloc(flen);
    for (int it = 0; it < 3000; it++) {
        memcpy(mut, full, flen);
        for (int k = 0; k < 1 + it % 3; k++) {
            rng = rng * 1664525u + 1013904223u;
            size_t at = 8 + (rng >> 8) % (flen - 8 - len);
            rng = rng * 1664525u + 1013904223u;
            static const char alphabet[] = "{}[]\",:0123456789-eE FUIB.x";
            mut[at] = (uint8_t)((rng >> 24) & 1 ? (uint32_t)(uint8_t)alphabet[(rng >> 8) % (sizeof alphabet - 1)]
                                                : (rng >> 16));
        }
        assert_int_equal(tu_write_file(p, mut, flen), 0);
        df_tensor_set *s = NULL;
        df_error err = {0};
        if (df_tensors_open_file(&s, p, &err) == DF_OK) {
            for (size_t i = 0; i < df_tensors_count(s); i++) {
                df_tensor *t = df_tensors_at(s, i);
                volatile uint8_t sum = 0;
                for (size_t b = 0; b < t->nbytes; b++) sum ^= ((const uint8_t *)t->data)[b];
                (void)sum;
            }
            df_tensors_free(s);
        } else {
            assert_true(err.msg[0] != 0);
        }
    }
    free(mut);
    free(full);
    free(hs);
    free(data);
    json_decref(h);
    tw_free(&f);
}

static void test_open_dir(void **state) {
    (void)state;
    char sub[512];
    snprintf(sub, sizeof sub, "%s/d1", tw_dir);
    assert_int_equal(mkdir(sub, 0700), 0);
    expect_dir_error(sub, DF_ERR_IO, "no model.safetensors", NULL);
    tw_file f;
    small_file(&f);
    tw_save(&f, tw_path(sub, "weights.safetensors"));
    df_tensor_set *s = NULL;
    df_error err = {0};
    assert_int_equal(df_tensors_open_dir(&s, sub, &err), DF_OK); /* the single file */
    assert_int_equal(df_tensors_count(s), 8);
    df_tensors_free(s);
    tw_save(&f, tw_path(sub, "other.safetensors"));
    expect_dir_error(sub, DF_ERR_FORMAT, "2 *.safetensors files", NULL);
    tw_save(&f, tw_path(sub, "model.safetensors")); /* model.safetensors wins */
    assert_int_equal(df_tensors_open_dir(&s, sub, &err), DF_OK);
    assert_non_null(strstr(df_tensors_file_path(s, 0), "/model.safetensors"));
    df_tensors_free(s);
    expect_dir_error(tw_path(tw_dir, "nope"), DF_ERR_IO, "cannot open folder", NULL);
    tw_free(&f);
}

/* Index files: shards split by the test, and each way an index can be wrong. */
static void test_index(void **state) {
    (void)state;
    char sub[512];
    snprintf(sub, sizeof sub, "%s/d2", tw_dir);
    assert_int_equal(mkdir(sub, 0700), 0);
    tw_file a = {0}, b = {0};
    tw_add(&a, "x", "F32", 1, (int64_t[]){2}, (float[]){1, 2});
    tw_add(&a, "y", "F16", 1, (int64_t[]){1}, NULL);
    tw_add(&b, "z", "I32", 1, (int64_t[]){1}, (int32_t[]){42});
    tw_save(&a, tw_path(sub, "s1.safetensors"));
    tw_save(&b, tw_path(sub, "s2.safetensors"));
    const char *ix = tw_path(sub, "model.safetensors.index.json");
    struct {
        const char *json;
        df_status code;
        const char *n1, *n2;
    } cases[] = {
        {"{\"weight_map\":{\"x\":\"s1.safetensors\",\"y\":\"s1.safetensors\","
         "\"z\":\"s2.safetensors\"}}", DF_OK, NULL, NULL},
        {"{\"weight_map\":{\"x\":\"s1.safetensors\",\"y\":\"s1.safetensors\","
         "\"z\":\"s3.safetensors\"}}", DF_ERR_IO, "names shard s3.safetensors, which does not exist",
         "model.safetensors.index.json"},
        {"{\"weight_map\":{\"x\":\"s1.safetensors\",\"y\":\"s2.safetensors\","
         "\"z\":\"s2.safetensors\"}}", DF_ERR_FORMAT,
         "tensor y is mapped to shard s2.safetensors but is in ", "s1.safetensors"},
        {"{\"weight_map\":{\"x\":\"s1.safetensors\",\"y\":\"s1.safetensors\","
         "\"w\":\"s2.safetensors\"}}", DF_ERR_FORMAT,
         "tensor w is mapped to shard s2.safetensors but is not in it", NULL},
        {"{\"weight_map\":{\"x\":\"s1.safetensors\",\"z\":\"s2.safetensors\"}}", DF_ERR_FORMAT,
         "tensor y in ", "s1.safetensors is not listed in the index"},
        {"{\"weight_map\":{\"x\":\"../s1.safetensors\"}}", DF_ERR_FORMAT,
         "weight_map entry for tensor x is not a file name", NULL},
        {"{\"weight_map\":{}}", DF_ERR_FORMAT, "missing or empty \"weight_map\"", NULL},
        {"{\"weight_map\":", DF_ERR_FORMAT, "model.safetensors.index.json: not valid JSON", NULL},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        assert_int_equal(tu_write_file(ix, cases[i].json, strlen(cases[i].json)), 0);
        if (cases[i].code != DF_OK) {
            expect_dir_error(sub, cases[i].code, cases[i].n1, cases[i].n2);
            continue;
        }
        df_tensor_set *s = NULL;
        df_error err = {0};
        assert_int_equal(df_tensors_open_dir(&s, sub, &err), DF_OK);
        assert_int_equal(df_tensors_file_count(s), 2);
        assert_int_equal(df_tensors_count(s), 3);
        assert_int_equal(df_tensors_find(s, "z")->file_index, 1);
        assert_int_equal(((const int32_t *)df_tensors_find(s, "z")->data)[0], 42);
        df_tensors_free(s);
    }
    /* a tensor in two shards */
    tw_add(&b, "x", "F32", 1, (int64_t[]){2}, NULL);
    tw_save(&b, tw_path(sub, "s2.safetensors"));
    const char *two = "{\"weight_map\":{\"x\":\"s1.safetensors\",\"y\":\"s1.safetensors\","
                      "\"z\":\"s2.safetensors\"}}";
    assert_int_equal(tu_write_file(ix, two, strlen(two)), 0);
    expect_dir_error(sub, DF_ERR_FORMAT, "tensor x is present in two files", "s2.safetensors");
    /* a corrupt shard names itself */
    assert_int_equal(tu_write_file(tw_path(sub, "s2.safetensors"), "\x05\0\0\0\0\0\0\0{\"a\":", 13),
                     0);
    expect_dir_error(sub, DF_ERR_FORMAT, "s2.safetensors: header is not valid JSON", NULL);
    tw_free(&a);
    tw_free(&b);
}

static void test_f16_conversions(void **state) {
    (void)state;
    /* f16 -> f32 -> f16 is the identity on every non-NaN half */
    for (uint32_t h = 0; h < 0x10000u; h++) {
        float f = df_f16_to_f32((uint16_t)h);
        if (isnan(f)) {
            assert_true(((h >> 10) & 0x1f) == 0x1f && (h & 0x3ff));
            assert_true(isnan(df_f16_to_f32(df_f32_to_f16(f))));
            continue;
        }
        assert_int_equal(df_f32_to_f16(f), h);
    }
    assert_true(df_f16_to_f32(0x0001) == ldexpf(1.0f, -24));
    assert_true(df_f16_to_f32(0x7bff) == 65504.0f);
    assert_true(isinf(df_f16_to_f32(0x7c00)));
    /* rounding to nearest even, overflow, underflow */
    assert_int_equal(df_f32_to_f16(1.0f + ldexpf(1.0f, -11)), 0x3c00);            /* tie -> even */
    assert_int_equal(df_f32_to_f16(1.0f + 3 * ldexpf(1.0f, -11)), 0x3c02);        /* tie -> even */
    assert_int_equal(df_f32_to_f16(1.0f + ldexpf(1.0f, -11) + ldexpf(1.0f, -20)), 0x3c01);
    assert_int_equal(df_f32_to_f16(65520.0f), 0x7c00);
    assert_int_equal(df_f32_to_f16(65519.0f), 0x7bff);
    assert_int_equal(df_f32_to_f16(ldexpf(1.0f, -25)), 0x0000);                   /* tie -> 0 */
    assert_int_equal(df_f32_to_f16(ldexpf(1.5f, -25)), 0x0001);
    assert_int_equal(df_f32_to_f16(ldexpf(3.0f, -25)), 0x0002);                   /* 1.5 ulp: tie -> even */
    assert_int_equal(df_f32_to_f16(-ldexpf(1.0f, -30)), 0x8000);
    assert_int_equal(df_f32_to_f16(ldexpf(1023.0f, -24) + ldexpf(1.0f, -25)), 0x0400); /* up to normal */
    assert_true(df_bf16_to_f32(0x3f80) == 1.0f);
    assert_true(df_bf16_to_f32(0xbf00) == -0.5f);
    assert_int_equal(df_dtype_size(DF_DTYPE_BF16), 2);
    assert_int_equal(df_dtype_size(DF_DTYPE_I64), 8);
    assert_int_equal(df_dtype_size(DF_DTYPE_INVALID), 0);
    assert_string_equal(df_dtype_name(DF_DTYPE_U32), "U32");
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_read_all_dtypes),
        cmocka_unit_test(test_misaligned_header),
        cmocka_unit_test(test_header_errors),
        cmocka_unit_test(test_file_errors),
        cmocka_unit_test(test_truncated_pack_file),
        cmocka_unit_test(test_no_crash_on_corruption),
        cmocka_unit_test(test_open_dir),
        cmocka_unit_test(test_index),
        cmocka_unit_test(test_f16_conversions),
    };
    return cmocka_run_group_tests(tests, tw_setup, tw_teardown);
}
