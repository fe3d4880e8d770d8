/* See textout.h. */
#include "decode/textout.h"

#include <stdlib.h>
#include <string.h>

static int reserve(char **buf, size_t *cap, size_t need) {
    if (need <= *cap) return 1;
    size_t c = *cap ? *cap : 256;
    while (c < need) c *= 2;
    char *p = realloc(*buf, c);
    if (!p) return 0;
    *buf = p;
    *cap = c;
    return 1;
}

/* Length of the UTF-8 sequence led by byte b (0: not a lead byte). */
static int utf8_len(unsigned char b) {
    if (b < 0x80) return 1;
    if (b >= 0xC2 && b <= 0xDF) return 2;
    if (b >= 0xE0 && b <= 0xEF) return 3;
    if (b >= 0xF0 && b <= 0xF4) return 4;
    return 0;
}

/* 1 if s[0..len) is a valid sequence (continuations, no overlongs/surrogates/> U+10FFFF). */
static int utf8_valid(const unsigned char *s, int len) {
    for (int i = 1; i < len; i++)
        if ((s[i] & 0xC0) != 0x80) return 0;
    if (len == 3) {
        if (s[0] == 0xE0 && s[1] < 0xA0) return 0;
        if (s[0] == 0xED && s[1] > 0x9F) return 0;
    }
    if (len == 4) {
        if (s[0] == 0xF0 && s[1] < 0x90) return 0;
        if (s[0] == 0xF4 && s[1] > 0x8F) return 0;
    }
    return 1;
}

size_t df_utf8_sanitize(const unsigned char *src, size_t n, unsigned char pend[8], int *n_pend, int final,
                        char *dst) {
    unsigned char buf[8];
    size_t w = 0;
    size_t i = 0;
    /* process pending bytes followed by src as one stream */
    int np = *n_pend;
    memcpy(buf, pend, (size_t)np);
    *n_pend = 0;
    size_t total = (size_t)np + n;
#define AT(k) ((k) < (size_t)np ? buf[(k)] : src[(k) - (size_t)np])
    while (i < total) {
        unsigned char b = AT(i);
        int len = utf8_len(b);
        if (len == 0) {
            memcpy(dst + w, "\xEF\xBF\xBD", 3);
            w += 3;
            i++;
            continue;
        }
        if (i + (size_t)len > total) {
            /* unfinished: valid so far? then hold it, unless final */
            int ok = 1;
            for (size_t k = i + 1; k < total; k++)
                if ((AT(k) & 0xC0) != 0x80) ok = 0;
            if (ok && !final) {
                for (size_t k = i; k < total; k++) pend[(*n_pend)++] = AT(k);
                break;
            }
            memcpy(dst + w, "\xEF\xBF\xBD", 3);
            w += 3;
            i++;
            continue;
        }
        unsigned char seq[4];
        for (int k = 0; k < len; k++) seq[k] = AT(i + (size_t)k);
        if (!utf8_valid(seq, len)) {
            memcpy(dst + w, "\xEF\xBF\xBD", 3);
            w += 3;
            i++;
            continue;
        }
        memcpy(dst + w, seq, (size_t)len);
        w += (size_t)len;
        i += (size_t)len;
    }
#undef AT
    return w;
}

void df_textout_init(df_textout *o, const df_tokenizer *tok, const df_gen_params *params, df_gen_callback cb,
                     void *user) {
    memset(o, 0, sizeof *o);
    o->tok = tok;
    o->params = params;
    o->cb = cb;
    o->user = user;
}

/* Hands the recorded logprobs of the tokens whose text begins before byte `upto` of the text
 * to params->on_token, in order; returns non-zero when it asks to stop. */
static int release_info(df_textout *o, size_t upto) {
    int stop = 0;
    for (; o->n_released < o->n_info && o->info_at[o->n_released] < upto; o->n_released++)
        if (o->params->on_token && o->params->on_token(o->user, &o->info[o->n_released])) stop = 1;
    return stop;
}

/* Emits the first n bytes of held text to the callback and the result text (the logprobs of
 * the tokens it comes from first). */
static int emit(df_textout *o, size_t n, int32_t id) {
    if (!reserve(&o->text, &o->cap_text, o->n_text + n + 1)) return -1;
    memcpy(o->text + o->n_text, o->held, n);
    o->n_text += n;
    o->text[o->n_text] = 0;
    int stop = release_info(o, o->n_text);
    if (o->cb && o->cb(o->user, id, o->held, n)) stop = 1;
    memmove(o->held, o->held + n, o->n_held - n);
    o->n_held -= n;
    return stop;
}

/* Bytes at the end of held that are a proper prefix of some stop string. */
static size_t stop_prefix_tail(const df_textout *o) {
    size_t best = 0;
    for (int i = 0; i < o->params->n_stop; i++) {
        const char *st = o->params->stop[i];
        size_t ls = strlen(st);
        for (size_t k = ls - 1; k > best; k--) {
            if (k <= o->n_held && memcmp(o->held + o->n_held - k, st, k) == 0) {
                best = k;
                break;
            }
        }
    }
    return best;
}

df_status df_textout_push(df_textout *o, int32_t id, int is_eos, df_error *err) {
    if (o->n_ids == o->cap_ids) {
        int c = o->cap_ids ? o->cap_ids * 2 : 64;
        int32_t *p = realloc(o->ids, (size_t)c * sizeof *p);
        if (!p) return df_error_set(err, DF_ERR_NOMEM, "out of memory");
        o->ids = p;
        o->cap_ids = c;
    }
    o->ids[o->n_ids++] = id;
    if (is_eos) {
        o->finish = DF_FINISH_STOP;
        return DF_OK;
    }
    size_t plen = 0;
    const char *piece = "";
    if (!(o->params->skip_special && df_tokenizer_is_special(o->tok, id))) piece = df_tokenizer_piece(o->tok, id, &plen);
    if (!piece) plen = 0;
    if (!reserve(&o->held, &o->cap_held, o->n_held + 3 * (plen + 8) + 1))
        return df_error_set(err, DF_ERR_NOMEM, "out of memory");
    o->n_held += df_utf8_sanitize((const unsigned char *)piece, plen, o->pend, &o->n_pend, 0, o->held + o->n_held);
    /* earliest stop string in held */
    size_t cut = (size_t)-1;
    for (int i = 0; i < o->params->n_stop; i++) {
        const char *st = o->params->stop[i];
        const char *f = memmem(o->held, o->n_held, st, strlen(st));
        if (f && (size_t)(f - o->held) < cut) cut = (size_t)(f - o->held);
    }
    int r;
    if (cut != (size_t)-1) {
        r = emit(o, cut, id);
        o->n_held = 0;
        o->finish = DF_FINISH_STOP;
        o->stop_cut = 1;
    } else {
        r = emit(o, o->n_held - stop_prefix_tail(o), id);
        if (r > 0) o->finish = DF_FINISH_CANCELLED;
    }
    if (r < 0) return df_error_set(err, DF_ERR_NOMEM, "out of memory");
    return DF_OK;
}

df_status df_textout_token_info(df_textout *o, const df_token_info *info, df_error *err) {
    if (o->n_info == o->cap_info) {
        int c = o->cap_info ? o->cap_info * 2 : 64;
        df_token_info *p = realloc(o->info, (size_t)c * sizeof *p);
        if (p) o->info = p;
        size_t *a = realloc(o->info_at, (size_t)c * sizeof *a);
        if (a) o->info_at = a;
        if (!p || !a) return df_error_set(err, DF_ERR_NOMEM, "out of memory");
        o->cap_info = c;
    }
    o->info_at[o->n_info] = o->n_text + o->n_held; /* the token's text comes next */
    o->info[o->n_info++] = *info;
    return DF_OK;
}

void df_textout_finish(df_textout *o, df_gen_result *res) {
    if (!o->stop_cut && o->finish != DF_FINISH_CANCELLED) {
        if (reserve(&o->held, &o->cap_held, o->n_held + 3 * 8 + 1)) {
            o->n_held += df_utf8_sanitize(NULL, 0, o->pend, &o->n_pend, 1, o->held + o->n_held);
            if (o->n_held) emit(o, o->n_held, o->n_ids ? o->ids[o->n_ids - 1] : -1);
        }
        release_info(o, (size_t)-1); /* tokens without text at the end (EOS) */
    }
    o->n_info = o->n_released; /* a stop string's tokens, or those never handed out */
    res->ids = o->ids;
    res->n_ids = o->n_ids;
    if (!o->text) {
        o->text = malloc(1);
        if (o->text) o->text[0] = 0;
    }
    res->text = o->text;
    res->text_len = o->n_text;
    res->finish = o->finish == DF_FINISH_NONE ? DF_FINISH_LENGTH : o->finish;
    res->token_info = o->info;
    res->n_token_info = o->info ? o->n_info : 0;
    free(o->info_at);
    free(o->held);
    memset(o, 0, sizeof *o);
}
