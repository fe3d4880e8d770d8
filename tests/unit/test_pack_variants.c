/* Unit tests: packs that must load: the tiny pack split into shards (binds identically),
 * a synthetic qwen3_5 pack with per-module quantization overrides (2/3/4/5/6/8 bits,
 * groups 32/64), dense and BF16 modules, HF conv layout and tied embeddings. */
#include "support.h"

#include <string.h>

#include "dflash/pack.h"
#include "st_write.h"

static df_pack *load(const char *dir) {
    df_pack *p = NULL;
    df_error err = {0};
    if (df_pack_load(&p, dir, &err) != DF_OK) fail_msg("load %s: %s", dir, err.msg);
    return p;
}

/* ---- sharded = single file -------------------------------------------------------- */

static void same_vec(const df_vecf *a, const df_vecf *b) {
    assert_int_equal(a->n, b->n);
    if (a->n) assert_memory_equal(a->data, b->data, (size_t)a->n * sizeof(float));
}

static void same_linear(const df_linear *a, const df_linear *b) {
    if (!a->w) {
        assert_null(b->w);
        return;
    }
    assert_string_equal(a->name, b->name);
    assert_int_equal(a->rows, b->rows);
    assert_int_equal(a->cols, b->cols);
    assert_int_equal(a->bits, b->bits);
    assert_int_equal(a->group_size, b->group_size);
    assert_int_equal(a->wdtype, b->wdtype);
    assert_int_equal(a->hadamard_block, b->hadamard_block);
    size_t wbytes = a->bits ? (size_t)a->rows * (size_t)a->cols * (size_t)a->bits / 8
                            : (size_t)a->rows * (size_t)a->cols * df_dtype_size(a->wdtype);
    assert_memory_equal(a->w, b->w, wbytes);
    if (a->bits) {
        assert_int_equal(a->sdtype, b->sdtype);
        size_t sbytes = (size_t)a->rows * (size_t)(a->cols / a->group_size) * 2;
        assert_memory_equal(a->scales, b->scales, sbytes);
        assert_memory_equal(a->biases, b->biases, sbytes);
    }
    if (a->hadamard_block) assert_memory_equal(a->signs, b->signs, (size_t)a->cols * sizeof(float));
}

static void test_sharded_equals_single(void **state) {
    (void)state;
    char d[1024];
    snprintf(d, sizeof d, "%s", tw_subdir(tw_dir));
    tw_pack_copy(tu_fixture("tiny-bonsai2"), d);
    tw_pack_shard(d, 130, NULL, "model-00002-of-00002.safetensors");
    df_pack *a = load(tu_fixture("tiny-bonsai2")), *b = load(d);
    assert_int_equal(df_tensors_file_count(a->tensors), 1);
    assert_int_equal(df_tensors_file_count(b->tensors), 2);
    assert_int_equal(df_tensors_count(a->tensors), df_tensors_count(b->tensors));
    assert_int_equal(a->cfg.n_layers, b->cfg.n_layers);
    same_linear(&a->embed, &b->embed);
    same_linear(&a->lm_head, &b->lm_head);
    same_vec(&a->final_norm, &b->final_norm);
    for (int i = 0; i < a->cfg.n_layers; i++) {
        const df_layer_weights *x = &a->layers[i], *y = &b->layers[i];
        assert_int_equal(x->kind, y->kind);
        const df_linear *lx[] = {&x->q_proj, &x->k_proj, &x->v_proj, &x->o_proj, &x->in_proj_qkv,
                                 &x->in_proj_z, &x->in_proj_b, &x->in_proj_a, &x->out_proj,
                                 &x->gate_proj, &x->up_proj, &x->down_proj};
        const df_linear *ly[] = {&y->q_proj, &y->k_proj, &y->v_proj, &y->o_proj, &y->in_proj_qkv,
                                 &y->in_proj_z, &y->in_proj_b, &y->in_proj_a, &y->out_proj,
                                 &y->gate_proj, &y->up_proj, &y->down_proj};
        for (size_t k = 0; k < sizeof lx / sizeof lx[0]; k++) same_linear(lx[k], ly[k]);
        const df_vecf *vx[] = {&x->input_norm, &x->post_norm, &x->q_norm, &x->k_norm, &x->conv1d,
                               &x->gdn_norm, &x->A_log, &x->dt_bias};
        const df_vecf *vy[] = {&y->input_norm, &y->post_norm, &y->q_norm, &y->k_norm, &y->conv1d,
                               &y->gdn_norm, &y->A_log, &y->dt_bias};
        for (size_t k = 0; k < sizeof vx / sizeof vx[0]; k++) same_vec(vx[k], vy[k]);
    }
    /* the bound data of a tensor in the second shard comes from that shard */
    df_tensor *t = df_tensors_find(b->tensors, "language_model.model.norm.weight");
    assert_int_equal(t->file_index, 1);
    df_pack_free(a);
    df_pack_free(b);
}

/* ---- a synthetic qwen3_5 pack ----------------------------------------------------- */

enum { H = 128, NL = 2, NH = 2, NKV = 1, HD = 64, NK = 1, NV = 2, DK = 32, DV = 32, KC = 4,
       INTER = 256, VOCAB = 64, KD = NK * DK, VD = NV * DV, CONV_C = 2 * KD + VD };

/* Quantized when bits > 0 (scales of dtype sdt), else dense of dtype sdt. */
static void add_lin(tw_file *f, const char *mod, int64_t rows, int64_t cols, int bits, int group,
                    const char *sdt) {
    char n[256];
    snprintf(n, sizeof n, "%s.weight", mod);
    if (!bits) {
        tw_add(f, n, sdt, 2, (int64_t[]){rows, cols}, NULL);
        return;
    }
    tw_add(f, n, "U32", 2, (int64_t[]){rows, cols * bits / 32}, NULL);
    snprintf(n, sizeof n, "%s.scales", mod);
    tw_add(f, n, sdt, 2, (int64_t[]){rows, cols / group}, NULL);
    snprintf(n, sizeof n, "%s.biases", mod);
    tw_add(f, n, sdt, 2, (int64_t[]){rows, cols / group}, NULL);
}

static void add_vec(tw_file *f, const char *name, int64_t n, const char *dt) {
    tw_add(f, name, dt, 1, &n, NULL);
}

#define LP(i, s) "language_model.model.layers." #i "." s

static void write_synthetic(const char *d) {
    tw_file f = {0};
    add_lin(&f, "language_model.model.embed_tokens", VOCAB, H, 8, 64, "F16");
    /* layer 0: Gated DeltaNet */
    add_vec(&f, LP(0, "input_layernorm.weight"), H, "BF16");
    add_vec(&f, LP(0, "post_attention_layernorm.weight"), H, "F32");
    add_lin(&f, LP(0, "linear_attn.in_proj_qkv"), CONV_C, H, 3, 32, "F16");
    add_lin(&f, LP(0, "linear_attn.in_proj_z"), VD, H, 5, 32, "F16");
    add_lin(&f, LP(0, "linear_attn.in_proj_b"), NV, H, 0, 0, "F32");
    add_lin(&f, LP(0, "linear_attn.in_proj_a"), NV, H, 0, 0, "BF16");
    add_lin(&f, LP(0, "linear_attn.out_proj"), H, VD, 6, 32, "F16");
    float conv[CONV_C * KC];
    for (int c = 0; c < CONV_C; c++)
        for (int k = 0; k < KC; k++) conv[c * KC + k] = (float)c + 0.25f * (float)k;
    tw_add(&f, LP(0, "linear_attn.conv1d.weight"), "F32", 3, (int64_t[]){CONV_C, 1, KC}, conv);
    add_vec(&f, LP(0, "linear_attn.norm.weight"), DV, "F16");
    add_vec(&f, LP(0, "linear_attn.A_log"), NV, "F32");
    uint16_t dtb[NV] = {0x3f80, 0xc000}; /* bf16 1, -2 */
    tw_add(&f, LP(0, "linear_attn.dt_bias"), "BF16", 1, (int64_t[]){NV}, dtb);
    add_lin(&f, LP(0, "mlp.gate_proj"), INTER, H, 4, 64, "F16");
    add_lin(&f, LP(0, "mlp.up_proj"), INTER, H, 4, 64, "F16");
    add_lin(&f, LP(0, "mlp.down_proj"), H, INTER, 4, 64, "F16");
    /* layer 1: gated attention */
    add_vec(&f, LP(1, "input_layernorm.weight"), H, "F16");
    add_vec(&f, LP(1, "post_attention_layernorm.weight"), H, "F16");
    add_lin(&f, LP(1, "self_attn.q_proj"), NH * 2 * HD, H, 4, 64, "BF16");
    add_lin(&f, LP(1, "self_attn.k_proj"), NKV * HD, H, 4, 64, "F16");
    add_lin(&f, LP(1, "self_attn.v_proj"), NKV * HD, H, 4, 64, "F16");
    add_lin(&f, LP(1, "self_attn.o_proj"), H, NH * HD, 2, 32, "F16");
    add_vec(&f, LP(1, "self_attn.q_norm.weight"), HD, "F16");
    add_vec(&f, LP(1, "self_attn.k_norm.weight"), HD, "F16");
    add_lin(&f, LP(1, "mlp.gate_proj"), INTER, H, 4, 64, "F16");
    add_lin(&f, LP(1, "mlp.up_proj"), INTER, H, 4, 64, "F16");
    add_lin(&f, LP(1, "mlp.down_proj"), H, INTER, 0, 0, "BF16");
    add_vec(&f, "language_model.model.norm.weight", H, "F16");
    add_vec(&f, "vision_tower.patch_embed.proj.bias", 16, "F16");
    tw_save(&f, tw_path(d, "weights.safetensors")); /* the only *.safetensors of the folder */
    tw_free(&f);

    json_t *q = json_pack("{sisiss}", "bits", 4, "group_size", 64, "mode", "affine");
    json_object_set_new(q, "language_model.model.embed_tokens", json_pack("{sisi}", "bits", 8, "group_size", 64));
    json_object_set_new(q, LP(0, "linear_attn.in_proj_qkv"), json_pack("{sisi}", "bits", 3, "group_size", 32));
    json_object_set_new(q, "model.layers.0.linear_attn.in_proj_z", json_pack("{sisi}", "bits", 5, "group_size", 32));
    json_object_set_new(q, LP(0, "linear_attn.out_proj"), json_pack("{sisi}", "bits", 6, "group_size", 32));
    json_object_set_new(q, LP(1, "self_attn.o_proj"), json_pack("{sisi}", "bits", 2, "group_size", 32));
    json_object_set_new(q, LP(1, "mlp.down_proj"), json_false());
    json_t *c = json_pack("{ss si si si si si si si si si si si si sb s[ii] so}",
                          "model_type", "qwen3_5", "hidden_size", H, "num_hidden_layers", NL,
                          "num_attention_heads", NH, "num_key_value_heads", NKV, "head_dim", HD,
                          "linear_num_key_heads", NK, "linear_num_value_heads", NV,
                          "linear_key_head_dim", DK, "linear_value_head_dim", DV,
                          "linear_conv_kernel_dim", KC, "intermediate_size", INTER,
                          "vocab_size", VOCAB, "tie_word_embeddings", 1, "eos_token_id", 5, 6,
                          "quantization", q);
    json_object_set_new(c, "layer_types", json_pack("[ss]", "linear_attention", "full_attention"));
    json_object_set_new(c, "rope_parameters",
                        json_pack("{sfsfs[iii]sb}", "rope_theta", 1e6, "partial_rotary_factor", 0.25,
                                  "mrope_section", 4, 2, 2, "mrope_interleaved", 1));
    tw_write_json(tw_path(d, "config.json"), c);
    json_decref(c);
}

static void check_q(const df_linear *l, int rows, int cols, int bits, int group, df_dtype sdt) {
    assert_int_equal(l->rows, rows);
    assert_int_equal(l->cols, cols);
    assert_int_equal(l->bits, bits);
    assert_int_equal(l->group_size, group);
    assert_int_equal(l->wdtype, DF_DTYPE_U32);
    assert_int_equal(l->sdtype, sdt);
    assert_non_null(l->scales);
    assert_non_null(l->biases);
    assert_int_equal(l->hadamard_block, 0);
    assert_null(l->signs);
}

static void check_dense(const df_linear *l, int rows, int cols, df_dtype wdt) {
    assert_int_equal(l->rows, rows);
    assert_int_equal(l->cols, cols);
    assert_int_equal(l->bits, 0);
    assert_int_equal(l->wdtype, wdt);
    assert_non_null(l->w);
    assert_null(l->scales);
}

static void test_synthetic_overrides(void **state) {
    (void)state;
    char d[1024];
    snprintf(d, sizeof d, "%s", tw_subdir(tw_dir));
    write_synthetic(d);
    df_pack *p = load(d);
    const df_text_config *c = &p->cfg;
    assert_string_equal(c->model_type, "qwen3_5");
    assert_int_equal(c->layer_kinds[0], DF_LAYER_LINEAR_ATTENTION);
    assert_int_equal(c->layer_kinds[1], DF_LAYER_FULL_ATTENTION);
    assert_true(c->rope_theta == 1e6f);
    assert_int_equal(c->mrope_section[0], 4);
    assert_int_equal(c->n_eos, 2);
    assert_int_equal(c->max_position_embeddings, 32768); /* default */
    assert_false(p->gen.has_temperature);                 /* no generation_config.json */

    check_q(&p->embed, VOCAB, H, 8, 64, DF_DTYPE_F16);
    assert_int_equal(c->tie_word_embeddings, 1);
    assert_ptr_equal(p->lm_head.w, p->embed.w);
    assert_int_equal(p->lm_head.bits, 8);
    const df_layer_weights *L = &p->layers[0];
    check_q(&L->in_proj_qkv, CONV_C, H, 3, 32, DF_DTYPE_F16);
    check_q(&L->in_proj_z, VD, H, 5, 32, DF_DTYPE_F16);
    check_dense(&L->in_proj_b, NV, H, DF_DTYPE_F32);
    check_dense(&L->in_proj_a, NV, H, DF_DTYPE_BF16);
    check_q(&L->out_proj, H, VD, 6, 32, DF_DTYPE_F16);
    check_q(&L->gate_proj, INTER, H, 4, 64, DF_DTYPE_F16);
    check_q(&L->down_proj, H, INTER, 4, 64, DF_DTYPE_F16);
    assert_int_equal(L->conv1d.n, CONV_C * KC);
    for (int ch = 0; ch < CONV_C; ch++)
        for (int k = 0; k < KC; k++)
            assert_true(L->conv1d.data[ch * KC + k] == (float)ch + 0.25f * (float)k);
    assert_true(L->dt_bias.data[0] == 1.0f && L->dt_bias.data[1] == -2.0f);
    L = &p->layers[1];
    check_q(&L->q_proj, NH * 2 * HD, H, 4, 64, DF_DTYPE_BF16);
    check_q(&L->k_proj, NKV * HD, H, 4, 64, DF_DTYPE_F16);
    check_q(&L->o_proj, H, NH * HD, 2, 32, DF_DTYPE_F16);
    check_q(&L->up_proj, INTER, H, 4, 64, DF_DTYPE_F16);
    check_dense(&L->down_proj, H, INTER, DF_DTYPE_BF16);
    assert_string_equal(L->down_proj.name, LP(1, "mlp.down_proj"));
    /* the vision tower tensor is left unbound */
    assert_false(df_tensors_find(p->tensors, "vision_tower.patch_embed.proj.bias")->used);
    df_pack_free(p);

    /* tied embeddings: an lm_head tensor is unexpected */
    tw_file f;
    tw_read(&f, tw_path(d, "weights.safetensors"));
    add_lin(&f, "language_model.lm_head", VOCAB, H, 0, 0, "F16");
    tw_save(&f, tw_path(d, "weights.safetensors"));
    tw_free(&f);
    df_error err = {0};
    assert_int_equal(df_pack_load(&p, d, &err), DF_ERR_MODEL);
    assert_non_null(strstr(err.msg, "unexpected tensor language_model.lm_head.weight"));
    assert_non_null(strstr(err.msg, "tie_word_embeddings is true"));
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_sharded_equals_single),
        cmocka_unit_test(test_synthetic_overrides),
    };
    return cmocka_run_group_tests(tests, tw_setup, tw_teardown);
}
