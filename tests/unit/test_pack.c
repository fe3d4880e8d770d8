/* Unit tests: loading the tiny Ternary Bonsai 2 pack and checking what was bound. */
#include "support.h"

#include <math.h>
#include <string.h>

#include "dflash/pack.h"

static df_pack *load_tiny(void) {
    df_error err = {0};
    df_pack *p = NULL;
    df_status st = df_pack_load(&p, tu_fixture("tiny-bonsai2"), &err);
    if (st != DF_OK) fail_msg("load: %s", err.msg);
    assert_non_null(p);
    return p;
}

static void check_q2(const df_linear *l, int rows, int cols) {
    assert_non_null(l->name);
    assert_int_equal(l->rows, rows);
    assert_int_equal(l->cols, cols);
    assert_int_equal(l->bits, 2);
    assert_int_equal(l->group_size, 128);
    assert_int_equal(l->wdtype, DF_DTYPE_U32);
    assert_int_equal(l->sdtype, DF_DTYPE_F16);
    assert_non_null(l->w);
    assert_non_null(l->scales);
    assert_non_null(l->biases);
    assert_int_equal(l->hadamard_block, 256);
    assert_non_null(l->signs);
    for (int i = 0; i < cols; i++) assert_true(fabsf(l->signs[i]) == 1.0f);
}

static void check_dense(const df_linear *l, int rows, int cols) {
    assert_int_equal(l->rows, rows);
    assert_int_equal(l->cols, cols);
    assert_int_equal(l->bits, 0);
    assert_int_equal(l->wdtype, DF_DTYPE_F16);
    assert_non_null(l->w);
    assert_null(l->scales);
    assert_int_equal(l->hadamard_block, 0);
    assert_null(l->signs);
}

static void test_tiny_config(void **state) {
    (void)state;
    df_pack *p = load_tiny();
    const df_text_config *c = &p->cfg;
    assert_string_equal(c->model_type, "prism_hadamard_qwen35");
    assert_int_equal(c->hidden_size, 256);
    assert_int_equal(c->n_layers, 8);
    assert_int_equal(c->n_heads, 4);
    assert_int_equal(c->n_kv_heads, 2);
    assert_int_equal(c->head_dim, 64);
    assert_int_equal(c->lin_n_k_heads, 2);
    assert_int_equal(c->lin_n_v_heads, 4);
    assert_int_equal(c->lin_k_head_dim, 64);
    assert_int_equal(c->lin_v_head_dim, 64);
    assert_int_equal(c->conv_kernel, 4);
    assert_int_equal(c->intermediate_size, 768);
    assert_int_equal(c->vocab_size, 2048);
    assert_int_equal(c->max_position_embeddings, 4096);
    assert_true(fabsf(c->rms_norm_eps - 1e-6f) < 1e-12f);
    assert_true(c->rope_theta == 1e7f);
    assert_true(c->partial_rotary_factor == 0.25f);
    assert_int_equal(c->mrope_section[0], 3);
    assert_int_equal(c->mrope_section[1], 3);
    assert_int_equal(c->mrope_section[2], 2);
    assert_int_equal(c->mrope_interleaved, 1);
    assert_int_equal(c->tie_word_embeddings, 0);
    assert_int_equal(c->n_eos, 2);
    assert_int_equal(c->eos_ids[0], 1986);
    assert_int_equal(c->eos_ids[1], 1984);
    for (int i = 0; i < 8; i++)
        assert_int_equal(c->layer_kinds[i],
                         (i == 3 || i == 7) ? DF_LAYER_FULL_ATTENTION : DF_LAYER_LINEAR_ATTENTION);
    assert_true(p->gen.has_temperature && p->gen.temperature == 0.6f);
    assert_true(p->gen.has_top_p && p->gen.top_p == 0.95f);
    assert_true(p->gen.has_top_k && p->gen.top_k == 20);
    assert_false(p->gen.has_min_p);
    assert_false(p->gen.has_repetition_penalty);
    assert_non_null(strstr(p->dir, "tiny-bonsai2"));
    df_pack_free(p);
}

static void test_tiny_tensors(void **state) {
    (void)state;
    df_pack *p = load_tiny();
    check_q2(&p->embed, 2048, 256);
    assert_string_equal(p->embed.name, "language_model.model.embed_tokens");
    check_q2(&p->lm_head, 2048, 256);
    assert_string_equal(p->lm_head.name, "language_model.lm_head");
    assert_ptr_not_equal(p->lm_head.w, p->embed.w);
    assert_int_equal(p->final_norm.n, 256);
    for (int i = 0; i < 8; i++) {
        const df_layer_weights *L = &p->layers[i];
        assert_int_equal(L->input_norm.n, 256);
        assert_int_equal(L->post_norm.n, 256);
        check_q2(&L->gate_proj, 768, 256);
        check_q2(&L->up_proj, 768, 256);
        check_q2(&L->down_proj, 256, 768);
        if (L->kind == DF_LAYER_FULL_ATTENTION) {
            check_q2(&L->q_proj, 512, 256);
            check_q2(&L->k_proj, 128, 256);
            check_q2(&L->v_proj, 128, 256);
            check_q2(&L->o_proj, 256, 256);
            assert_int_equal(L->q_norm.n, 64);
            assert_int_equal(L->k_norm.n, 64);
            assert_null(L->in_proj_qkv.w);
            assert_null(L->conv1d.data);
        } else {
            check_q2(&L->in_proj_qkv, 512, 256);
            check_q2(&L->in_proj_z, 256, 256);
            check_dense(&L->in_proj_b, 4, 256);
            check_dense(&L->in_proj_a, 4, 256);
            check_q2(&L->out_proj, 256, 256);
            assert_int_equal(L->conv1d.n, 512 * 4);
            assert_int_equal(L->gdn_norm.n, 64);
            assert_int_equal(L->A_log.n, 4);
            assert_int_equal(L->dt_bias.n, 4);
            assert_null(L->q_proj.w);
        }
    }
    /* bound pointers are the tensors' data; converted vectors equal the stored values */
    df_tensor *t = df_tensors_find(p->tensors, "language_model.model.layers.0.mlp.up_proj.weight");
    assert_non_null(t);
    assert_ptr_equal(t->data, p->layers[0].up_proj.w);
    t = df_tensors_find(p->tensors, "language_model.model.layers.0.linear_attn.A_log");
    assert_int_equal(t->dtype, DF_DTYPE_F32);
    assert_memory_equal(t->data, p->layers[0].A_log.data, 4 * sizeof(float));
    t = df_tensors_find(p->tensors, "language_model.model.layers.0.linear_attn.conv1d.weight");
    assert_int_equal(t->dtype, DF_DTYPE_F16);
    const uint16_t *h = t->data;
    for (int i = 0; i < 512 * 4; i++)
        assert_true(df_f16_to_f32(h[i]) == p->layers[0].conv1d.data[i]);
    t = df_tensors_find(p->tensors, "language_model.model.norm.weight");
    h = t->data;
    for (int i = 0; i < 256; i++) assert_true(df_f16_to_f32(h[i]) == p->final_norm.data[i]);
    /* every tensor of the file was used */
    for (size_t i = 0; i < df_tensors_count(p->tensors); i++)
        assert_true(df_tensors_at(p->tensors, i)->used);
    df_pack_free(p);
}

static void test_config_parse_text(void **state) {
    (void)state;
    df_text_config c;
    df_error err = {0};
    /* top-level fields, interval-derived layer types, rope at top level, eos list */
    const char *js = "{\"model_type\":\"qwen3_5\",\"hidden_size\":64,\"num_hidden_layers\":6,"
                     "\"num_attention_heads\":2,\"num_key_value_heads\":1,\"head_dim\":32,"
                     "\"linear_num_key_heads\":1,\"linear_num_value_heads\":2,"
                     "\"linear_key_head_dim\":16,\"linear_value_head_dim\":16,"
                     "\"intermediate_size\":128,\"vocab_size\":100,\"full_attention_interval\":3,"
                     "\"rope_theta\":5000,\"partial_rotary_factor\":0.5,\"eos_token_id\":[7,9,7],"
                     "\"tie_word_embeddings\":true}";
    assert_int_equal(df_text_config_parse(&c, js, &err), DF_OK);
    assert_int_equal(c.n_layers, 6);
    for (int i = 0; i < 6; i++)
        assert_int_equal(c.layer_kinds[i],
                         (i + 1) % 3 == 0 ? DF_LAYER_FULL_ATTENTION : DF_LAYER_LINEAR_ATTENTION);
    assert_true(c.rope_theta == 5000.0f);
    assert_int_equal(c.mrope_section[0], 8); /* plain partial RoPE: rot/2 on the T axis */
    assert_int_equal(c.mrope_section[1], 0);
    assert_int_equal(c.conv_kernel, 4);
    assert_int_equal(c.n_eos, 2);
    assert_int_equal(c.tie_word_embeddings, 1);
    df_text_config_free(&c);

    /* default interval 4 */
    const char *js2 = "{\"model_type\":\"qwen3_5\",\"text_config\":{\"hidden_size\":64,"
                      "\"num_hidden_layers\":8,\"num_attention_heads\":2,\"num_key_value_heads\":1,"
                      "\"linear_num_key_heads\":1,\"linear_num_value_heads\":2,"
                      "\"linear_key_head_dim\":16,\"linear_value_head_dim\":16,"
                      "\"intermediate_size\":128,\"vocab_size\":100,"
                      "\"rope_parameters\":{\"mrope_section\":[1,1,2]}}}";
    assert_int_equal(df_text_config_parse(&c, js2, &err), DF_OK);
    assert_int_equal(c.head_dim, 32);
    assert_int_equal(c.layer_kinds[3], DF_LAYER_FULL_ATTENTION);
    assert_int_equal(c.layer_kinds[4], DF_LAYER_LINEAR_ATTENTION);
    assert_int_equal(c.layer_kinds[7], DF_LAYER_FULL_ATTENTION);
    assert_int_equal(c.mrope_section[2], 2);
    df_text_config_free(&c);
}

/* Ternary weights (biases = −scales bit for bit) are recognized; any other bias is not. */
static void test_biases_negate_scales(void **state) {
    (void)state;
    uint16_t sc[4] = {0x2a00, 0x1c33, 0x0000, 0x3c00}, bi[4];
    for (int i = 0; i < 4; i++) bi[i] = (uint16_t)(sc[i] ^ 0x8000u);
    df_linear L = {.rows = 2, .cols = 128, .bits = 2, .group_size = 64, .sdtype = DF_DTYPE_F16, .scales = sc,
                   .biases = bi};
    assert_int_equal(df_linear_biases_negate_scales(&L), 1);
    L.sdtype = DF_DTYPE_BF16;
    assert_int_equal(df_linear_biases_negate_scales(&L), 1);
    bi[2] = 0x0000; /* +0 where the scale is +0: the same value, not the same bits */
    assert_int_equal(df_linear_biases_negate_scales(&L), 0);
    bi[2] = 0x8000;
    bi[3] = 0xbc01;
    assert_int_equal(df_linear_biases_negate_scales(&L), 0);
    bi[3] = 0xbc00;
    assert_int_equal(df_linear_biases_negate_scales(&L), 1);
    L.biases = NULL;
    assert_int_equal(df_linear_biases_negate_scales(&L), 0);
    L.biases = bi;
    L.bits = 0; /* dense */
    assert_int_equal(df_linear_biases_negate_scales(&L), 0);
}

static void test_generation_config(void **state) {
    (void)state;
    df_generation_defaults g;
    df_error err = {0};
    assert_int_equal(df_generation_config_parse(&g, NULL,
                                                "{\"temperature\":0,\"min_p\":0.05,"
                                                "\"repetition_penalty\":1.1,\"eos_token_id\":3}",
                                                &err),
                     DF_OK);
    assert_true(g.has_temperature && g.temperature == 0.0f);
    assert_true(g.has_min_p && g.min_p == 0.05f);
    assert_true(g.has_repetition_penalty);
    assert_false(g.has_top_k);
    assert_int_equal(df_generation_config_parse(&g, NULL, "{\"top_p\":1.5}", &err), DF_ERR_FORMAT);
    assert_non_null(strstr(err.msg, "top_p"));
    assert_int_equal(df_generation_config_parse(&g, NULL, "{\"top_k\":\"x\"}", &err), DF_ERR_FORMAT);
    assert_non_null(strstr(err.msg, "top_k"));
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_tiny_config),
        cmocka_unit_test(test_biases_negate_scales),
        cmocka_unit_test(test_tiny_tensors),
        cmocka_unit_test(test_config_parse_text),
        cmocka_unit_test(test_generation_config),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
