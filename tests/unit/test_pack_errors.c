/* Unit tests: every way a pack can be wrong gives its own clear error (naming the file and
 * the tensor or field) and never a crash. Each case copies the tiny pack into a temp
 * folder and corrupts it in C. */
#include "support.h"

#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "dflash/pack.h"
#include "st_write.h"

#define L0 "language_model.model.layers.0."
#define TINY_ST "model.safetensors"

/* A fresh copy of the tiny pack; returns its folder (valid until the next call). */
static const char *fresh(void) {
    static char d[1024];
    snprintf(d, sizeof d, "%s", tw_subdir(tw_dir));
    tw_pack_copy(tu_fixture("tiny-bonsai2"), d);
    return d;
}

static void expect_load_error(const char *dir, df_status code, const char *n1, const char *n2) {
    df_pack *p = (df_pack *)1;
    df_error err = {0};
    df_status st = df_pack_load(&p, dir, &err);
    if (getenv("TU_VERBOSE")) fprintf(stderr, "  [%s] %s\n", df_status_name(st), err.msg);
    if (st != code || (n1 && !strstr(err.msg, n1)) || (n2 && !strstr(err.msg, n2)))
        fail_msg("expected %s with \"%s\" / \"%s\", got %s: %s", df_status_name(code),
                 n1 ? n1 : "", n2 ? n2 : "", df_status_name(st), err.msg);
    assert_null(p);
}

static void expect_load_ok(const char *dir) {
    df_pack *p = NULL;
    df_error err = {0};
    if (df_pack_load(&p, dir, &err) != DF_OK) fail_msg("load: %s", err.msg);
    df_pack_free(p);
}

/* ---- tensor edits ----------------------------------------------------------------- */

static void st_load(const char *dir, tw_file *f) { tw_read(f, tw_path(dir, TINY_ST)); }

static void st_store(const char *dir, tw_file *f) {
    tw_save(f, tw_path(dir, TINY_ST));
    tw_free(f);
}

/* A tensor given another dtype and shape (zero-filled). */
typedef struct retype_case {
    const char *tensor, *dtype;
    int ndim;
    int64_t shape[3];
    const char *n1, *n2;
} retype_case;

static void run_retype_cases(const retype_case *cases, size_t n) {
    for (size_t i = 0; i < n; i++) {
        const char *d = fresh();
        tw_file f;
        st_load(d, &f);
        tw_retype(tw_get(&f, cases[i].tensor), cases[i].dtype, cases[i].ndim, cases[i].shape);
        st_store(d, &f);
        expect_load_error(d, DF_ERR_MODEL, cases[i].n1, cases[i].n2);
    }
}

static void test_wrong_dtype(void **state) {
    (void)state;
    static const retype_case cases[] = {
        {L0 "mlp.up_proj.scales", "F32", 2, {768, 2}, "tensor " L0 "mlp.up_proj.scales (",
         "model.safetensors): dtype F32, expected F16 or BF16"},
        {L0 "linear_attn.A_log", "I32", 1, {4}, "tensor " L0 "linear_attn.A_log (",
         "dtype I32, expected F32 or F16 or BF16"},
        {L0 "linear_attn.in_proj_a.weight", "U32", 2, {4, 256},
         "tensor " L0 "linear_attn.in_proj_a.weight (",
         "U32 (quantized) weight but " L0 "linear_attn.in_proj_a.scales is missing"},
        /* biases must have the scales' dtype */
        {L0 "mlp.gate_proj.biases", "BF16", 2, {768, 2}, "tensor " L0 "mlp.gate_proj.biases (",
         "dtype BF16, expected F16"},
        {L0 "linear_attn.in_proj_qkv.signs", "F16", 1, {256},
         "tensor " L0 "linear_attn.in_proj_qkv.signs (", "dtype F16, expected F32"},
    };
    run_retype_cases(cases, sizeof cases / sizeof cases[0]);
}

static void test_wrong_shape(void **state) {
    (void)state;
    static const retype_case cases[] = {
        {"language_model.model.layers.1.linear_attn.norm.weight", "F16", 1, {32},
         "tensor language_model.model.layers.1.linear_attn.norm.weight (",
         "shape [32], expected [64]"},
        {"language_model.model.layers.2.mlp.down_proj.weight", "U32", 2, {256, 24},
         "tensor language_model.model.layers.2.mlp.down_proj.weight (",
         "shape [256, 24], expected [256, 48] (2-bit, group 128)"},
        {"language_model.model.layers.3.self_attn.q_proj.scales", "F16", 2, {256, 2},
         "tensor language_model.model.layers.3.self_attn.q_proj.scales (",
         "shape [256, 2], expected [512, 2]"},
        {L0 "linear_attn.conv1d.weight", "F16", 3, {512, 3, 1},
         "tensor " L0 "linear_attn.conv1d.weight (", "shape [512, 3, 1], expected [512, 4, 1]"},
        {"language_model.lm_head.signs", "F32", 1, {128}, "tensor language_model.lm_head.signs (",
         "shape [128], expected [256]"},
    };
    run_retype_cases(cases, sizeof cases / sizeof cases[0]);
}

static void test_missing_tensor(void **state) {
    (void)state;
    tw_file f;
    const char *d = fresh();
    st_load(d, &f);
    tw_remove(&f, "language_model.model.layers.7.self_attn.k_norm.weight");
    st_store(d, &f);
    expect_load_error(d, DF_ERR_MODEL,
                      "missing tensor language_model.model.layers.7.self_attn.k_norm.weight", NULL);

    d = fresh();
    st_load(d, &f);
    tw_remove(&f, L0 "mlp.gate_proj.biases");
    st_store(d, &f);
    expect_load_error(d, DF_ERR_MODEL, "missing tensor " L0 "mlp.gate_proj.biases", NULL);

    d = fresh();
    st_load(d, &f);
    tw_remove(&f, "language_model.model.norm.weight");
    st_store(d, &f);
    expect_load_error(d, DF_ERR_MODEL, "missing tensor language_model.model.norm.weight", NULL);

    d = fresh();
    st_load(d, &f);
    tw_remove(&f, "language_model.model.embed_tokens.signs");
    st_store(d, &f);
    expect_load_error(d, DF_ERR_MODEL, "missing tensor language_model.model.embed_tokens.signs", NULL);
}

static void test_unexpected_tensor(void **state) {
    (void)state;
    tw_file f;
    const char *d = fresh();
    st_load(d, &f);
    tw_add(&f, L0 "mlp.extra.weight", "F16", 1, (int64_t[]){4}, NULL);
    st_store(d, &f);
    expect_load_error(d, DF_ERR_MODEL, "unexpected tensor " L0 "mlp.extra.weight (",
                      "model.safetensors)");

    d = fresh();
    st_load(d, &f);
    tw_add(&f, L0 "linear_attn.conv1d.bias", "F16", 1, (int64_t[]){512}, NULL);
    st_store(d, &f);
    expect_load_error(d, DF_ERR_MODEL, "unexpected tensor " L0 "linear_attn.conv1d.bias", NULL);

    d = fresh(); /* vision tower tensors are accepted and left unbound */
    st_load(d, &f);
    tw_add(&f, "vision_tower.blocks.0.norm1.weight", "F16", 1, (int64_t[]){64}, NULL);
    st_store(d, &f);
    expect_load_ok(d);
}

static void test_corrupt_file_in_pack(void **state) {
    (void)state;
    const char *d = fresh();
    size_t len;
    char *buf = tu_read_file(tw_path(d, TINY_ST), &len);
    assert_int_equal(tu_write_file(tw_path(d, TINY_ST), buf, len / 2), 0);
    expect_load_error(d, DF_ERR_FORMAT, "model.safetensors: file truncated", "(tensor language_model.");
    /* header length beyond the file */
    buf[3] = 0x7f;
    assert_int_equal(tu_write_file(tw_path(d, TINY_ST), buf, len), 0);
    expect_load_error(d, DF_ERR_FORMAT, "model.safetensors: header length", "exceeds the file size");
    free(buf);

    /* header edits on the real tensor list */
    struct {
        const char *tensor, *field;
        long long a, b;
        const char *n1, *n2;
    } cases[] = {
        {"language_model.model.norm.weight", "data_offsets", 10000000, 10000512,
         "tensor language_model.model.norm.weight: data_offsets [10000000, 10000512] past the end",
         NULL},
        {"language_model.model.norm.weight", "data_offsets", 0, 512, "overlap",
         "language_model.model.norm.weight"},
        {"language_model.model.norm.weight", "shape", 300, -1,
         "tensor language_model.model.norm.weight: data_offsets", "hold 512 bytes but shape and "
         "dtype F16 need 600"},
        {"language_model.model.norm.weight", "dtype", 0, 0,
         "tensor language_model.model.norm.weight: unknown dtype \"F12\"", NULL},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        d = fresh();
        tw_file f;
        st_load(d, &f);
        uint8_t *data;
        size_t dlen;
        json_t *h = tw_header(&f, &data, &dlen);
        json_t *e = json_object_get(h, cases[i].tensor);
        assert_non_null(e);
        if (!strcmp(cases[i].field, "dtype")) {
            json_object_set_new(e, "dtype", json_string("F12"));
        } else if (!strcmp(cases[i].field, "shape")) {
            json_object_set_new(e, "shape", json_pack("[I]", (json_int_t)cases[i].a));
        } else {
            json_int_t b = cases[i].a, en = cases[i].b;
            json_object_set_new(e, "data_offsets", json_pack("[II]", b, en));
        }
        tw_save_json(tw_path(d, TINY_ST), h, data, dlen);
        json_decref(h);
        free(data);
        tw_free(&f);
        expect_load_error(d, DF_ERR_FORMAT, cases[i].n1, cases[i].n2);
        expect_load_error(d, DF_ERR_FORMAT, "model.safetensors: ", NULL);
    }
}

/* ---- config edits ----------------------------------------------------------------- */

/* A config.json edit: in the object `where` names ("top", "text", "rope", "quant", or
 * "mod:<path>" for a Hadamard manifest entry, "modules" to append value to the list),
 * set key to the JSON value (NULL: delete the key). */
typedef struct cfg_case {
    const char *where, *key, *value;
    df_status code;
    const char *n1, *n2;
} cfg_case;

static json_t *cfg_target(json_t *c, const char *where) {
    json_t *text = json_object_get(c, "text_config");
    if (!strcmp(where, "top")) return c;
    if (!strcmp(where, "text")) return text;
    if (!strcmp(where, "rope")) return json_object_get(text, "rope_parameters");
    if (!strcmp(where, "quant")) return json_object_get(c, "quantization");
    if (!strcmp(where, "modules")) return json_object_get(c, "modules");
    json_t *mods = json_object_get(c, "modules");
    for (size_t i = 0; i < json_array_size(mods); i++) {
        json_t *e = json_array_get(mods, i);
        if (!strcmp(json_string_value(json_object_get(e, "path")), where + 4)) return e;
    }
    fail_msg("no config object %s", where);
    return NULL;
}

static void run_cfg_cases(const cfg_case *cases, size_t n) {
    for (size_t i = 0; i < n; i++) {
        const char *d = fresh();
        json_t *c = tw_load_json(tw_path(d, "config.json"));
        json_t *obj = cfg_target(c, cases[i].where);
        json_t *v = cases[i].value ? json_loads(cases[i].value, JSON_DECODE_ANY, NULL) : NULL;
        if (cases[i].value) assert_non_null(v);
        if (json_is_array(obj))
            json_array_append_new(obj, v);
        else if (v)
            json_object_set_new(obj, cases[i].key, v);
        else
            json_object_del(obj, cases[i].key);
        tw_write_json(tw_path(d, "config.json"), c);
        json_decref(c);
        expect_load_error(d, cases[i].code, cases[i].n1, cases[i].n2);
    }
}

#define LT_8(l2) "[\"linear_attention\",\"linear_attention\"," l2 ",\"full_attention\"," \
                 "\"linear_attention\",\"linear_attention\",\"linear_attention\",\"full_attention\"]"

static void test_bad_config(void **state) {
    (void)state;
    static const cfg_case cases[] = {
        {"text", "hidden_size", NULL, DF_ERR_FORMAT,
         "config.json: missing required field \"hidden_size\"", NULL},
        {"top", "model_type", "\"llama\"", DF_ERR_UNSUPPORTED,
         "config.json: unknown model_type \"llama\"", NULL},
        {"text", "layer_types", "[\"linear_attention\"]", DF_ERR_FORMAT,
         "config.json: field text_config.layer_types must be a list of 8 entries", NULL},
        {"text", "layer_types", LT_8("\"sliding_attention\""), DF_ERR_FORMAT,
         "field text_config.layer_types[2] must be", NULL},
        /* a valid layer_types that does not match the tensors */
        {"text", "layer_types", LT_8("\"full_attention\""), DF_ERR_MODEL,
         "missing tensor language_model.model.layers.2.self_attn.q_proj.weight", NULL},
        {"text", "num_key_value_heads", "3", DF_ERR_FORMAT,
         "num_attention_heads 4 is not a multiple of num_key_value_heads 3", NULL},
        {"text", "hidden_size", "\"256\"", DF_ERR_FORMAT,
         "field text_config.hidden_size must be an integer", NULL},
        {"text", "num_hidden_layers", "0", DF_ERR_FORMAT,
         "field text_config.num_hidden_layers = 0 is out of range", NULL},
        {"rope", "mrope_section", "[3,3,3]", DF_ERR_FORMAT,
         "mrope_section must be 3 non-negative integers summing to rot/2 = 8", NULL},
        {"rope", "partial_rotary_factor", "1.5", DF_ERR_FORMAT,
         "field rope_parameters.partial_rotary_factor = 1.5 is out of range", NULL},
        {"top", "eos_token_id", "4096", DF_ERR_FORMAT, "field eos_token_id must be a token id", NULL},
        {"top", "gdn_activation_layout", "\"interleaved\"", DF_ERR_UNSUPPORTED,
         "field gdn_activation_layout must be \"grouped\"", NULL},
        {"top", "tie_word_embeddings", "true", DF_ERR_FORMAT, "tie_word_embeddings disagree", NULL},
        /* scaled or malformed rotary settings are refused, never run unscaled */
        {"rope", "rope_type", "\"yarn\"", DF_ERR_UNSUPPORTED,
         "field rope_parameters.rope_type must be \"default\"", "scaled rotary embeddings are not supported"},
        {"rope", "rope_type", "4", DF_ERR_UNSUPPORTED, "field rope_parameters.rope_type must be", NULL},
        {"text", "rope_parameters", "\"x\"", DF_ERR_FORMAT, "field text_config.rope_parameters must be an object",
         NULL},
        {"text", "attention_bias", "true", DF_ERR_UNSUPPORTED, "field attention_bias must be false", NULL},
    };
    run_cfg_cases(cases, sizeof cases / sizeof cases[0]);

    const char *d = fresh();
    assert_int_equal(tu_write_file(tw_path(d, "config.json"), "{\"model_type\": ", 15), 0);
    expect_load_error(d, DF_ERR_FORMAT, "config.json: not valid JSON", NULL);

    d = fresh();
    assert_int_equal(remove(tw_path(d, "config.json")), 0);
    expect_load_error(d, DF_ERR_IO, "config.json: cannot open", NULL);

    d = fresh();
    const char *g = "{\"temperature\": -1}";
    assert_int_equal(tu_write_file(tw_path(d, "generation_config.json"), g, strlen(g)), 0);
    expect_load_error(d, DF_ERR_FORMAT, "generation_config.json: field temperature", NULL);

    d = fresh(); /* generation_config.json is optional */
    assert_int_equal(remove(tw_path(d, "generation_config.json")), 0);
    expect_load_ok(d);
}

/* A pack file that is a FIFO (whose open or read would block forever), a folder or a link
 * loop: a clear error naming it, at once. */
static void test_special_files(void **state) {
    (void)state;
    static const char *names[] = {"config.json", TINY_ST, "generation_config.json"};
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++) {
        const char *d = fresh();
        const char *p = tw_path(d, names[i]);
        assert_int_equal(remove(p), 0);
        assert_int_equal(mkfifo(p, 0600), 0);
        expect_load_error(d, DF_ERR_IO, names[i], "not a regular file");
        assert_int_equal(unlink(p), 0);
        assert_int_equal(mkdir(p, 0700), 0);
        expect_load_error(d, DF_ERR_IO, names[i], "is a folder, not a file");
        assert_int_equal(rmdir(p), 0);
    }
    /* a symbolic link that loops, where an optional file would be: an error, not "absent" */
    static const char *loops[] = {"config.json", "generation_config.json"};
    for (size_t i = 0; i < sizeof loops / sizeof loops[0]; i++) {
        const char *d = fresh();
        const char *p = tw_path(d, loops[i]);
        assert_int_equal(remove(p), 0);
        assert_int_equal(symlink(loops[i], p), 0);
        expect_load_error(d, DF_ERR_IO, loops[i], "cannot open");
    }
}

static void test_bad_quantization(void **state) {
    (void)state;
    static const cfg_case cases[] = {
        {"quant", "bits", "7", DF_ERR_UNSUPPORTED,
         "config.json: field quantization: bits 7 is not supported", NULL},
        {"quant", "group_size", "96", DF_ERR_UNSUPPORTED,
         "field quantization: group_size 96 is not supported", NULL},
        {"quant", "mode", "\"mxfp4\"", DF_ERR_UNSUPPORTED, "mode must be \"affine\"", NULL},
        /* bits that do not match the packed weights */
        {"quant", "bits", "4", DF_ERR_MODEL, "tensor language_model.model.embed_tokens.weight (",
         "shape [2048, 16], expected [2048, 32] (4-bit, group 128)"},
        {"quant", "language_model.lm_head", "{\"bits\":3,\"group_size\":64}", DF_ERR_MODEL,
         "tensor language_model.lm_head.weight (", "expected [2048, 24] (3-bit, group 64)"},
        {"quant", "language_model.lm_head", "false", DF_ERR_MODEL,
         "tensor language_model.lm_head.scales (", "marks it not quantized (false)"},
        {"quant", "model.layers.0.mlp.up_proj", "{\"bits\":9,\"group_size\":64}", DF_ERR_UNSUPPORTED,
         "field quantization.\"model.layers.0.mlp.up_proj\": bits 9 is not supported", NULL},
        {"top", "quantization", NULL, DF_ERR_MODEL,
         "tensor language_model.model.embed_tokens.scales (", "quantization is absent"},
    };
    run_cfg_cases(cases, sizeof cases / sizeof cases[0]);

    const char *d = fresh(); /* in_proj_a / in_proj_b must be dense */
    tw_file f;
    st_load(d, &f);
    tw_add(&f, L0 "linear_attn.in_proj_b.scales", "F16", 2, (int64_t[]){4, 2}, NULL);
    st_store(d, &f);
    expect_load_error(d, DF_ERR_MODEL, "tensor " L0 "linear_attn.in_proj_b.scales (",
                      L0 "linear_attn.in_proj_b must be dense");

    d = fresh(); /* a quantized weight without scales */
    st_load(d, &f);
    tw_remove(&f, L0 "mlp.up_proj.scales");
    st_store(d, &f);
    expect_load_error(d, DF_ERR_MODEL, "tensor " L0 "mlp.up_proj.weight (",
                      "U32 (quantized) weight but " L0 "mlp.up_proj.scales is missing");
}

static void test_bad_hadamard(void **state) {
    (void)state;
    static const cfg_case cases[] = {
        {"mod:model.layers.0.mlp.down_proj", "block", "512", DF_ERR_MODEL,
         "config.json modules entry model.layers.0.mlp.down_proj: Hadamard block 512 does not "
         "divide the input width 768", NULL},
        {"mod:lm_head", "block", "96", DF_ERR_MODEL, "config.json: field modules[",
         "(lm_head): Hadamard block 96 is not a power of two"},
        /* signs for a module the manifest does not rotate */
        {"mod:model.layers.0.mlp.up_proj", "block", "0", DF_ERR_MODEL,
         "unexpected tensor " L0 "mlp.up_proj.signs (", "Hadamard signs of a module with no block"},
        {"modules", NULL, "{\"path\":\"model.layers.0.mlp.nope\",\"block\":256}", DF_ERR_MODEL,
         "config.json modules entry model.layers.0.mlp.nope names no linear module", NULL},
        {"mod:model.embed_tokens", "embedding", "false", DF_ERR_MODEL,
         "modules entry model.embed_tokens: \"embedding\" is false but the module is an embedding",
         NULL},
        {"mod:lm_head", "embedding", "true", DF_ERR_MODEL,
         "modules entry lm_head: \"embedding\" is true but the module is not an embedding", NULL},
        {"modules", NULL, "{\"path\":\"lm_head\",\"block\":256}", DF_ERR_FORMAT,
         "field modules: lm_head is listed twice", NULL},
        {"mod:lm_head", "dtype", "\"bfloat16\"", DF_ERR_UNSUPPORTED,
         "(lm_head): dtype must be \"float16\"", NULL},
    };
    run_cfg_cases(cases, sizeof cases / sizeof cases[0]);

    const char *d = fresh(); /* a rotated module with no signs */
    tw_file f;
    st_load(d, &f);
    tw_remove(&f, "language_model.model.layers.3.self_attn.v_proj.signs");
    st_store(d, &f);
    expect_load_error(d, DF_ERR_MODEL,
                      "missing tensor language_model.model.layers.3.self_attn.v_proj.signs", NULL);

    d = fresh(); /* signs that are not ±1 */
    st_load(d, &f);
    ((float *)tw_get(&f, L0 "mlp.up_proj.signs")->data)[3] = 0.5f;
    st_store(d, &f);
    expect_load_error(d, DF_ERR_MODEL, "tensor " L0 "mlp.up_proj.signs (",
                      "element 3 is 0.5, signs must be +1 or -1");
}

/* ---- sharded packs ---------------------------------------------------------------- */

static void test_bad_shards(void **state) {
    (void)state;
    const char *d = fresh();
    tw_pack_shard(d, 100, NULL, "model-00002-of-00003.safetensors");
    expect_load_error(d, DF_ERR_IO, "model.safetensors.index.json: names shard "
                      "model-00002-of-00003.safetensors, which does not exist", NULL);

    d = fresh();
    tw_pack_shard(d, 100, "language_model.model.layers.5.mlp.up_proj.weight",
                 "model-00002-of-00002.safetensors");
    expect_load_error(d, DF_ERR_FORMAT,
                      "tensor language_model.model.layers.5.mlp.up_proj.weight is mapped to shard ",
                      "but is in ");

    d = fresh(); /* a corrupt shard is named */
    tw_pack_shard(d, 100, NULL, "model-00002-of-00002.safetensors");
    size_t len;
    char *buf = tu_read_file(tw_path(d, "model-00002-of-00002.safetensors"), &len);
    assert_int_equal(tu_write_file(tw_path(d, "model-00002-of-00002.safetensors"), buf, len - 7), 0);
    free(buf);
    expect_load_error(d, DF_ERR_FORMAT, "model-00002-of-00002.safetensors: file truncated", NULL);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_wrong_dtype),
        cmocka_unit_test(test_wrong_shape),
        cmocka_unit_test(test_missing_tensor),
        cmocka_unit_test(test_unexpected_tensor),
        cmocka_unit_test(test_corrupt_file_in_pack),
        cmocka_unit_test(test_bad_config),
        cmocka_unit_test(test_special_files),
        cmocka_unit_test(test_bad_quantization),
        cmocka_unit_test(test_bad_hadamard),
        cmocka_unit_test(test_bad_shards),
    };
    return cmocka_run_group_tests(tests, tw_setup, tw_teardown);
}
