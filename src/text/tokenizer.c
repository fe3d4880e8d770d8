/* Byte-level BPE over a Hugging Face tokenizer.json (see include/dflash/tokenizer.h).
 *
 * Layout: the vocabulary is an open-addressing string map (key: the token's tokenizer.json
 * spelling in the byte-level alphabet); merges are an open-addressing map from the id pair
 * (a, b) to (rank, id of a+b), built once at load, so the merge loop works on ids only and
 * never builds strings. Every id has its decoded bytes precomputed for decoding.
 *
 * The merge loop follows tokenizers' `Word::merge_all` (bpe/word.rs): a min-heap of candidate
 * pairs ordered by (rank, position), a doubly linked list of symbols, and entries checked
 * for staleness when popped (the pair at the position must still give the same merged id).
 * Lowest rank first, leftmost first among equal ranks: O(n log n) per piece.
 */
#include "dflash/tokenizer.h"

#include "core/files.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <jansson.h>
#include <pcre2.h>
#include <errno.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <utf8proc.h>

/* ---------------------------------------------------------------------------------------- */
/* UTF-8                                                                                     */

enum { U8_VALID, U8_INVALID, U8_SHORT };

/* Classifies the bytes at s[i] (i < n), per Unicode 15 §3.9 (Table 3-7). U8_VALID: *len bytes
 * are one scalar value. U8_INVALID: *len bytes are a maximal invalid subpart (one U+FFFD).
 * U8_SHORT: s[i..n) (*len bytes) is a valid prefix that the end of the data cut short. */
static int u8_class(const unsigned char *s, size_t n, size_t i, size_t *len) {
    unsigned c = s[i];
    if (c < 0x80) {
        *len = 1;
        return U8_VALID;
    }
    size_t need;
    unsigned lo = 0x80, hi = 0xBF;
    if (c >= 0xC2 && c <= 0xDF) {
        need = 2;
    } else if (c >= 0xE0 && c <= 0xEF) {
        need = 3;
        if (c == 0xE0) lo = 0xA0;
        if (c == 0xED) hi = 0x9F;
    } else if (c >= 0xF0 && c <= 0xF4) {
        need = 4;
        if (c == 0xF0) lo = 0x90;
        if (c == 0xF4) hi = 0x8F;
    } else {
        *len = 1;
        return U8_INVALID;
    }
    for (size_t k = 1; k < need; k++) {
        if (i + k >= n) {
            *len = k;
            return U8_SHORT;
        }
        unsigned b = s[i + k];
        if (b < lo || b > hi) {
            *len = k;
            return U8_INVALID;
        }
        lo = 0x80;
        hi = 0xBF;
    }
    *len = need;
    return U8_VALID;
}

/* Offset of the first byte that is not part of valid UTF-8, or n when all is valid. */
static size_t u8_first_invalid(const unsigned char *s, size_t n) {
    size_t i = 0;
    while (i < n) {
        if (s[i] < 0x80) {
            i++;
            continue;
        }
        size_t l;
        if (u8_class(s, n, i, &l) != U8_VALID) return i;
        i += l;
    }
    return n;
}

static const char u8_replacement[3] = {(char)0xEF, (char)0xBF, (char)0xBD}; /* U+FFFD */

/* ---------------------------------------------------------------------------------------- */
/* Hash maps (open addressing, linear probing, fixed capacity chosen at load)               */

typedef struct str_slot {
    uint32_t hash, off, len;
    int32_t id; /* -1: empty */
} str_slot;

typedef struct strmap {
    str_slot *slot;
    uint32_t mask;
    char *pool; /* key bytes */
    size_t pool_len, pool_cap;
} strmap;

static uint32_t str_hash(const char *s, size_t n) { /* FNV-1a */
    uint32_t h = 2166136261u;
    for (size_t i = 0; i < n; i++) h = (h ^ (unsigned char)s[i]) * 16777619u;
    return h;
}

static size_t pow2_at_least(size_t n) {
    size_t c = 16;
    while (c < n) c <<= 1;
    return c;
}

static int strmap_init(strmap *m, size_t n_keys, size_t key_bytes) {
    size_t cap = pow2_at_least(n_keys * 2 + 1);
    m->slot = malloc(cap * sizeof *m->slot);
    m->pool = malloc(key_bytes + 1);
    if (!m->slot || !m->pool) return -1;
    for (size_t i = 0; i < cap; i++) m->slot[i].id = -1;
    m->mask = (uint32_t)(cap - 1);
    m->pool_len = 0;
    m->pool_cap = key_bytes + 1;
    return 0;
}

static void strmap_free(strmap *m) {
    free(m->slot);
    free(m->pool);
}

static str_slot *strmap_find(const strmap *m, const char *s, size_t n, uint32_t h) {
    for (uint32_t i = h & m->mask;; i = (i + 1) & m->mask) {
        str_slot *e = &m->slot[i];
        if (e->id < 0) return e;
        if (e->hash == h && e->len == n && memcmp(m->pool + e->off, s, n) == 0) return e;
    }
}

static int32_t strmap_get(const strmap *m, const char *s, size_t n) {
    if (!m->slot) return -1;
    return strmap_find(m, s, n, str_hash(s, n))->id;
}

/* Inserts or overwrites; the caller sized the map and pool for every key. */
static void strmap_put(strmap *m, const char *s, size_t n, int32_t id) {
    uint32_t h = str_hash(s, n);
    str_slot *e = strmap_find(m, s, n, h);
    if (e->id < 0) {
        memcpy(m->pool + m->pool_len, s, n);
        e->hash = h;
        e->off = (uint32_t)m->pool_len;
        e->len = (uint32_t)n;
        m->pool_len += n;
    }
    e->id = id;
}

typedef struct pair_slot {
    uint64_t key;  /* (uint64_t)left id << 32 | right id */
    uint32_t rank; /* position in model.merges */
    int32_t id;    /* merged token; -1: empty slot */
} pair_slot;

static inline uint64_t pair_key(int32_t a, int32_t b) { return (uint64_t)(uint32_t)a << 32 | (uint32_t)b; }

static inline uint32_t pair_index(uint64_t key, unsigned shift) {
    return (uint32_t)((key * 0x9E3779B97F4A7C15ull) >> shift);
}

/* ---------------------------------------------------------------------------------------- */
/* The tokenizer                                                                             */

enum { TF_PRESENT = 1, TF_ADDED = 2, TF_SPECIAL = 4 };

typedef struct added_tok {
    char *content;
    size_t len;
    int32_t id;
    unsigned char special, lstrip, rstrip, single_word, normalized;
} added_tok;

struct df_tokenizer {
    int32_t n_ids;       /* vocab_size: max id + 1 */
    uint32_t *piece_off; /* [n_ids] offset of each id's decoded bytes in pieces */
    uint32_t *piece_len; /* [n_ids] their length (0 for holes) */
    unsigned char *flags; /* [n_ids] TF_* */
    char *pieces;         /* decoded bytes, each NUL-terminated; pieces[0] = "" for holes */
    size_t max_piece;

    strmap vocab;       /* tokenizer.json spelling -> id */
    pair_slot *merges;  /* [1 << merge_bits] */
    unsigned merge_shift; /* 64 - merge_bits */
    uint32_t merge_mask;  /* (1 << merge_bits) - 1 */
    int32_t byte_id[256]; /* id of the single byte-level symbol for each byte, -1 if none */
    uint16_t byte_cp[256]; /* the byte-level alphabet: code point of each byte */
    int32_t unk_id;       /* -1: none */
    int fuse_unk, ignore_merges, nfc;

    added_tok *added;           /* sorted by first byte, then longest first */
    size_t n_added;
    uint32_t added_start[257];  /* added[added_start[b] .. added_start[b+1]) start with byte b */
    unsigned char first_raw[256], first_norm[256]; /* a raw / normalized added token starts with b */
    int any_norm_added;

    pcre2_code *re; /* the Split regex; NULL: each stretch is one piece */

    /* [n_ids] WHOLE_*: does BPE of the token's own bytes give back just this token? Filled
     * lazily by encode (see bpe_piece). */
    _Atomic unsigned char *whole;
};

enum { WHOLE_UNKNOWN = 0, WHOLE_YES = 1, WHOLE_NO = 2 };
#define WHOLE_MAX 64 /* pieces up to this many bytes try the whole-token lookup */

/* GPT-2's bytes_to_unicode: printable Latin-1 bytes map to themselves, the other 68 bytes
 * to U+0100.. in byte order. cp_to_byte is its inverse over U+0000..U+0143 (-1: none). */
#define BL_CP_MAX 324
static void bytelevel_tables(uint16_t byte_to_cp[256], int16_t cp_to_byte[BL_CP_MAX]) {
    unsigned extra = 0;
    for (int i = 0; i < BL_CP_MAX; i++) cp_to_byte[i] = -1;
    for (unsigned b = 0; b < 256; b++) {
        int printable = (b >= 0x21 && b <= 0x7E) || (b >= 0xA1 && b <= 0xAC) || b >= 0xAE;
        byte_to_cp[b] = (uint16_t)(printable ? b : 256 + extra++);
        cp_to_byte[byte_to_cp[b]] = (int16_t)b;
    }
}

static size_t cp_to_utf8(unsigned cp, char *out) {
    if (cp < 0x80) {
        out[0] = (char)cp;
        return 1;
    }
    out[0] = (char)(0xC0 | (cp >> 6));
    out[1] = (char)(0x80 | (cp & 0x3F));
    return 2; /* byte-level code points are all below U+0800 */
}

/* Maps a byte-level token spelling back to bytes (out has room for n bytes). Characters
 * outside the byte-level alphabet keep their UTF-8 bytes, as tokenizers' ByteLevel decoder. */
static size_t bytelevel_decode(const int16_t cp_to_byte[BL_CP_MAX], const char *s, size_t n, char *out) {
    size_t o = 0, i = 0;
    while (i < n) {
        utf8proc_int32_t cp;
        utf8proc_ssize_t l = utf8proc_iterate((const utf8proc_uint8_t *)s + i, (utf8proc_ssize_t)(n - i), &cp);
        if (l <= 0) { /* not UTF-8 (jansson guarantees it is): copy the byte */
            out[o++] = s[i++];
            continue;
        }
        if (cp >= 0 && cp < BL_CP_MAX && cp_to_byte[cp] >= 0) {
            out[o++] = (char)cp_to_byte[cp];
        } else {
            memcpy(out + o, s + i, (size_t)l);
            o += (size_t)l;
        }
        i += (size_t)l;
    }
    return o;
}

void df_tokenizer_free(df_tokenizer *tok) {
    if (!tok) return;
    free(tok->piece_off);
    free(tok->piece_len);
    free(tok->flags);
    free(tok->pieces);
    free((void *)tok->whole);
    strmap_free(&tok->vocab);
    free(tok->merges);
    for (size_t i = 0; i < tok->n_added; i++) free(tok->added[i].content);
    free(tok->added);
    pcre2_code_free(tok->re);
    free(tok);
}

/* ---------------------------------------------------------------------------------------- */
/* Loading                                                                                   */

#define MAX_ID (1 << 24)
#define GPT2_PATTERN "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+"

static const char *jstr(json_t *obj, const char *key) {
    json_t *v = json_object_get(obj, key);
    return json_is_string(v) ? json_string_value(v) : NULL;
}

/* A boolean field: 0/1, def when absent or null, -1 when of another type. */
static int jbool(json_t *obj, const char *key, int def) {
    json_t *v = json_object_get(obj, key);
    if (!v || json_is_null(v)) return def;
    if (!json_is_boolean(v)) return -1;
    return json_is_true(v);
}

static int cmp_added(const void *a, const void *b) {
    const added_tok *x = a, *y = b;
    unsigned char fx = (unsigned char)x->content[0], fy = (unsigned char)y->content[0];
    if (fx != fy) return fx < fy ? -1 : 1;
    if (x->len != y->len) return x->len > y->len ? -1 : 1;
    return x->id < y->id ? -1 : x->id > y->id;
}

static df_status load_added(df_tokenizer *tok, json_t *arr, df_error *err) {
    if (!arr || json_is_null(arr)) return DF_OK;
    if (!json_is_array(arr)) return df_error_set(err, DF_ERR_FORMAT, "added_tokens is not an array");
    size_t n = json_array_size(arr);
    tok->added = calloc(n ? n : 1, sizeof *tok->added);
    if (!tok->added) return df_error_set(err, DF_ERR_NOMEM, "out of memory for %zu added tokens", n);
    for (size_t i = 0; i < n; i++) {
        json_t *t = json_array_get(arr, i), *jid = json_object_get(t, "id"), *jc = json_object_get(t, "content");
        if (!json_is_integer(jid) || !json_is_string(jc) || json_string_length(jc) == 0)
            return df_error_set(err, DF_ERR_FORMAT, "added_tokens[%zu]: needs an integer id and a non-empty content",
                                i);
        json_int_t id = json_integer_value(jid);
        if (id < 0 || id >= MAX_ID)
            return df_error_set(err, DF_ERR_RANGE, "added_tokens[%zu]: id %lld outside [0, %d)", i, (long long)id,
                                MAX_ID);
        added_tok *a = &tok->added[tok->n_added];
        a->len = json_string_length(jc);
        a->content = malloc(a->len + 1);
        if (!a->content) return df_error_set(err, DF_ERR_NOMEM, "out of memory");
        memcpy(a->content, json_string_value(jc), a->len + 1);
        a->id = (int32_t)id;
        tok->n_added++;
        int special = jbool(t, "special", 0);
        int flags[4] = {jbool(t, "lstrip", 0), jbool(t, "rstrip", 0), jbool(t, "single_word", 0),
                        jbool(t, "normalized", !special)};
        if (special < 0 || flags[0] < 0 || flags[1] < 0 || flags[2] < 0 || flags[3] < 0)
            return df_error_set(err, DF_ERR_FORMAT, "added_tokens[%zu] (%s): a flag is not a boolean", i, a->content);
        a->special = (unsigned char)special;
        a->lstrip = (unsigned char)flags[0];
        a->rstrip = (unsigned char)flags[1];
        a->single_word = (unsigned char)flags[2];
        a->normalized = (unsigned char)flags[3];
    }
    qsort(tok->added, tok->n_added, sizeof *tok->added, cmp_added);
    size_t k = 0;
    for (unsigned b = 0; b < 256; b++) {
        tok->added_start[b] = (uint32_t)k;
        while (k < tok->n_added && (unsigned char)tok->added[k].content[0] == b) {
            if (tok->added[k].normalized) {
                tok->first_norm[b] = 1;
                tok->any_norm_added = 1;
            } else {
                tok->first_raw[b] = 1;
            }
            k++;
        }
    }
    tok->added_start[256] = (uint32_t)k;
    return DF_OK;
}

static df_status load_normalizer(df_tokenizer *tok, json_t *norm, df_error *err) {
    if (!norm || json_is_null(norm)) return DF_OK;
    const char *type = jstr(norm, "type");
    if (type && strcmp(type, "NFC") == 0) {
        tok->nfc = 1;
        return DF_OK;
    }
    if (type && strcmp(type, "Sequence") == 0) {
        json_t *list = json_object_get(norm, "normalizers");
        for (size_t i = 0; i < json_array_size(list); i++) {
            df_status st = load_normalizer(tok, json_array_get(list, i), err);
            if (st) return st;
        }
        return DF_OK;
    }
    return df_error_set(err, DF_ERR_UNSUPPORTED, "normalizer type \"%s\" (only NFC is supported)",
                        type ? type : "(none)");
}

/* Reads one pre-tokenizer; *pattern / *literal receive a regex when it splits, *bytelevel
 * is set by a ByteLevel step. */
static df_status load_pretok_one(json_t *pt, const char **pattern, int *literal, int *bytelevel, df_error *err) {
    const char *type = jstr(pt, "type");
    if (type && strcmp(type, "ByteLevel") == 0) {
        if (jbool(pt, "add_prefix_space", 1) != 0)
            return df_error_set(err, DF_ERR_UNSUPPORTED, "pre_tokenizer ByteLevel with add_prefix_space");
        if (*bytelevel) return df_error_set(err, DF_ERR_UNSUPPORTED, "pre_tokenizer with two ByteLevel steps");
        *bytelevel = 1;
        if (jbool(pt, "use_regex", 1) == 1) {
            if (*pattern) return df_error_set(err, DF_ERR_UNSUPPORTED, "pre_tokenizer with two regex splits");
            *pattern = GPT2_PATTERN;
            *literal = 0;
        }
        return DF_OK;
    }
    if (type && strcmp(type, "Split") == 0) {
        if (*bytelevel) return df_error_set(err, DF_ERR_UNSUPPORTED, "pre_tokenizer Split after ByteLevel");
        if (*pattern) return df_error_set(err, DF_ERR_UNSUPPORTED, "pre_tokenizer with two regex splits");
        const char *beh = jstr(pt, "behavior");
        if (!beh || strcmp(beh, "Isolated") != 0)
            return df_error_set(err, DF_ERR_UNSUPPORTED, "pre_tokenizer Split behavior \"%s\" (only Isolated)",
                                beh ? beh : "(none)");
        if (jbool(pt, "invert", 0) != 0)
            return df_error_set(err, DF_ERR_UNSUPPORTED, "pre_tokenizer Split with invert");
        json_t *pat = json_object_get(pt, "pattern");
        const char *re = jstr(pat, "Regex"), *lit = jstr(pat, "String");
        if (!re && !lit) return df_error_set(err, DF_ERR_FORMAT, "pre_tokenizer Split: pattern has no Regex or String");
        *pattern = re ? re : lit;
        *literal = re == NULL;
        return DF_OK;
    }
    if (type && strcmp(type, "Sequence") == 0) {
        json_t *list = json_object_get(pt, "pretokenizers");
        if (!json_is_array(list)) return df_error_set(err, DF_ERR_FORMAT, "pre_tokenizer Sequence: no pretokenizers");
        for (size_t i = 0; i < json_array_size(list); i++) {
            df_status st = load_pretok_one(json_array_get(list, i), pattern, literal, bytelevel, err);
            if (st) return st;
        }
        return DF_OK;
    }
    return df_error_set(err, DF_ERR_UNSUPPORTED, "pre_tokenizer type \"%s\" (Split, ByteLevel or Sequence)",
                        type ? type : "(none)");
}

/* Unicode White_Space, the set that `\s` means in Oniguruma (which tokenizers' regexes run
 * on). PCRE2's `\s` with UCP also takes U+180E (kept in its `\h`), so the pattern's `\s` and
 * `\S` are spelled out with this list before compiling. */
#define WHITE_SPACE "\\t\\n\\x0b\\f\\r\\x20\\x85\\xa0\\x{1680}\\x{2000}-\\x{200a}\\x{2028}\\x{2029}\\x{202f}\\x{205f}\\x{3000}"

/* Copies pattern with `\s` / `\S` (outside character classes; `\s` inside them too) replaced by
 * WHITE_SPACE. Returns a malloc'd string or NULL when out of memory. */
static char *spell_out_space(const char *pat) {
    size_t n = strlen(pat), count = 0;
    for (size_t i = 0; i < n; i++)
        if (pat[i] == '\\') count++;
    char *out = malloc(n + count * (sizeof WHITE_SPACE + 3) + 1);
    if (!out) return NULL;
    size_t o = 0;
    int in_class = 0;
    for (size_t i = 0; i < n;) {
        char c = pat[i];
        if (c == '\\' && i + 1 < n) {
            char d = pat[i + 1];
            const char *rep = NULL;
            if (d == 's') rep = in_class ? WHITE_SPACE : "[" WHITE_SPACE "]";
            else if (d == 'S' && !in_class) rep = "[^" WHITE_SPACE "]";
            if (rep) {
                memcpy(out + o, rep, strlen(rep));
                o += strlen(rep);
            } else {
                out[o++] = c;
                out[o++] = d;
            }
            i += 2;
            continue;
        }
        if (!in_class && c == '[') { /* a ']' right after "[" or "[^" is a literal */
            in_class = 1;
            out[o++] = pat[i++];
            if (i < n && pat[i] == '^') out[o++] = pat[i++];
            if (i < n && pat[i] == ']') out[o++] = pat[i++];
            continue;
        }
        if (in_class && c == '[' && i + 1 < n && pat[i + 1] == ':') { /* [:alpha:] */
            const char *end = strstr(pat + i + 2, ":]");
            size_t l = end ? (size_t)(end + 2 - (pat + i)) : 1;
            memcpy(out + o, pat + i, l);
            o += l;
            i += l;
            continue;
        }
        if (in_class && c == ']') in_class = 0;
        out[o++] = pat[i++];
    }
    out[o] = 0;
    return out;
}

static df_status load_pretok(df_tokenizer *tok, json_t *pt, df_error *err) {
    const char *pattern = NULL;
    int literal = 0, bytelevel = 0;
    if (!pt || json_is_null(pt))
        return df_error_set(err, DF_ERR_UNSUPPORTED, "no pre_tokenizer (a ByteLevel step is required)");
    df_status st = load_pretok_one(pt, &pattern, &literal, &bytelevel, err);
    if (st) return st;
    if (!bytelevel) return df_error_set(err, DF_ERR_UNSUPPORTED, "pre_tokenizer has no ByteLevel step");
    if (!pattern) return DF_OK;
    int ec;
    PCRE2_SIZE eo;
    char *spelled = literal ? NULL : spell_out_space(pattern);
    if (!literal && !spelled) return df_error_set(err, DF_ERR_NOMEM, "out of memory");
    tok->re = pcre2_compile((PCRE2_SPTR)(literal ? pattern : spelled), PCRE2_ZERO_TERMINATED,
                            PCRE2_UTF | PCRE2_UCP | (literal ? PCRE2_LITERAL : 0u), &ec, &eo, NULL);
    free(spelled);
    if (!tok->re) {
        PCRE2_UCHAR msg[256];
        pcre2_get_error_message(ec, msg, sizeof msg);
        return df_error_set(err, DF_ERR_FORMAT, "pre_tokenizer regex /%s/ does not compile: %s (offset %zu after "
                            "spelling out \\s)", pattern, (const char *)msg, (size_t)eo);
    }
    pcre2_jit_compile(tok->re, PCRE2_JIT_COMPLETE); /* optional: without JIT the interpreter runs */
    return DF_OK;
}

static df_status check_decoder(json_t *dec, df_error *err) {
    if (!dec || json_is_null(dec)) return DF_OK;
    const char *type = jstr(dec, "type");
    if (type && strcmp(type, "ByteLevel") == 0) return DF_OK;
    return df_error_set(err, DF_ERR_UNSUPPORTED, "decoder type \"%s\" (only ByteLevel)", type ? type : "(none)");
}

/* Splits merges[i] into its two tokens (pointers into the JSON or into buf). */
static df_status merge_parts(json_t *m, size_t i, const char **a, size_t *na, const char **b, size_t *nb,
                             df_error *err) {
    if (json_is_string(m)) {
        const char *s = json_string_value(m), *sp = strchr(s, ' ');
        size_t n = json_string_length(m);
        if (!sp || memchr(sp + 1, ' ', n - (size_t)(sp + 1 - s)))
            return df_error_set(err, DF_ERR_FORMAT, "model.merges[%zu] \"%s\" is not two tokens separated by a space",
                                i, s);
        *a = s;
        *na = (size_t)(sp - s);
        *b = sp + 1;
        *nb = n - *na - 1;
        return DF_OK;
    }
    if (json_is_array(m) && json_array_size(m) == 2 && json_is_string(json_array_get(m, 0)) &&
        json_is_string(json_array_get(m, 1))) {
        *a = json_string_value(json_array_get(m, 0));
        *na = json_string_length(json_array_get(m, 0));
        *b = json_string_value(json_array_get(m, 1));
        *nb = json_string_length(json_array_get(m, 1));
        return DF_OK;
    }
    return df_error_set(err, DF_ERR_FORMAT, "model.merges[%zu] is neither \"a b\" nor [\"a\", \"b\"]", i);
}

static df_status load_merges(df_tokenizer *tok, json_t *merges, df_error *err) {
    size_t n = json_array_size(merges);
    if (merges && !json_is_array(merges)) return df_error_set(err, DF_ERR_FORMAT, "model.merges is not an array");
    size_t cap = pow2_at_least(n * 2 + 1);
    unsigned bits = 0;
    while (((size_t)1 << bits) < cap) bits++;
    tok->merge_shift = 64 - bits;
    tok->merge_mask = (uint32_t)(cap - 1);
    tok->merges = malloc(cap * sizeof *tok->merges);
    char *buf = NULL;
    size_t buf_cap = 0;
    if (!tok->merges) return df_error_set(err, DF_ERR_NOMEM, "out of memory for %zu merges", n);
    for (size_t i = 0; i < cap; i++) tok->merges[i].id = -1;
    for (size_t i = 0; i < n; i++) {
        const char *a = NULL, *b = NULL;
        size_t na = 0, nb = 0;
        df_status st = merge_parts(json_array_get(merges, i), i, &a, &na, &b, &nb, err);
        if (st) {
            free(buf);
            return st;
        }
        if (na + nb > buf_cap) {
            free(buf);
            buf_cap = 2 * (na + nb);
            buf = malloc(buf_cap);
            if (!buf) return df_error_set(err, DF_ERR_NOMEM, "out of memory");
        }
        memcpy(buf, a, na);
        memcpy(buf + na, b, nb);
        int32_t ia = strmap_get(&tok->vocab, a, na), ib = strmap_get(&tok->vocab, b, nb);
        int32_t im = strmap_get(&tok->vocab, buf, na + nb);
        if (ia < 0 || ib < 0 || im < 0) {
            const char *which = ia < 0 ? "left" : ib < 0 ? "right" : "merged";
            int nw = (int)(ia < 0 ? na : ib < 0 ? nb : na + nb);
            const char *w = ia < 0 ? a : ib < 0 ? b : buf;
            df_error_set(err, DF_ERR_FORMAT, "model.merges[%zu]: %s token \"%.*s\" is not in the vocabulary", i, which,
                         nw, w);
            free(buf);
            return DF_ERR_FORMAT;
        }
        uint64_t key = pair_key(ia, ib);
        for (uint32_t h = pair_index(key, tok->merge_shift);; h = (h + 1) & (uint32_t)(cap - 1)) {
            pair_slot *e = &tok->merges[h];
            if (e->id < 0 || e->key == key) { /* a repeated pair keeps its last rank, as tokenizers */
                e->key = key;
                e->rank = (uint32_t)i;
                e->id = im;
                break;
            }
        }
    }
    free(buf);
    return DF_OK;
}

static df_status load_model(df_tokenizer *tok, json_t *model, df_error *err) {
    if (!json_is_object(model)) return df_error_set(err, DF_ERR_FORMAT, "no model object");
    const char *type = jstr(model, "type");
    if (type && strcmp(type, "BPE") != 0)
        return df_error_set(err, DF_ERR_UNSUPPORTED, "model type \"%s\" (only BPE)", type);
    json_t *dropout = json_object_get(model, "dropout");
    if (dropout && !json_is_null(dropout) && json_number_value(dropout) != 0.0)
        return df_error_set(err, DF_ERR_UNSUPPORTED, "model.dropout");
    if (jbool(model, "byte_fallback", 0) != 0) return df_error_set(err, DF_ERR_UNSUPPORTED, "model.byte_fallback");
    const char *pre = jstr(model, "continuing_subword_prefix"), *suf = jstr(model, "end_of_word_suffix");
    if ((pre && *pre) || (suf && *suf))
        return df_error_set(err, DF_ERR_UNSUPPORTED, "model.continuing_subword_prefix / end_of_word_suffix");
    tok->ignore_merges = jbool(model, "ignore_merges", 0) == 1;
    tok->fuse_unk = jbool(model, "fuse_unk", 0) == 1;

    json_t *vocab = json_object_get(model, "vocab");
    if (!json_is_object(vocab)) return df_error_set(err, DF_ERR_FORMAT, "model.vocab is not an object");
    const char *key;
    json_t *val;
    size_t key_bytes = 0;
    json_int_t max_id = -1;
    json_object_foreach(vocab, key, val) {
        if (!json_is_integer(val) || json_integer_value(val) < 0 || json_integer_value(val) >= MAX_ID)
            return df_error_set(err, json_is_integer(val) ? DF_ERR_RANGE : DF_ERR_FORMAT,
                                "model.vocab[\"%s\"]: id is not an integer in [0, %d)", key, MAX_ID);
        key_bytes += strlen(key);
        if (json_integer_value(val) > max_id) max_id = json_integer_value(val);
    }
    for (size_t i = 0; i < tok->n_added; i++) {
        if (tok->added[i].id > max_id) max_id = tok->added[i].id;
        key_bytes += tok->added[i].len;
    }
    tok->n_ids = (int32_t)(max_id + 1);
    size_t n = (size_t)tok->n_ids;
    tok->piece_off = calloc(n ? n : 1, sizeof *tok->piece_off);
    tok->piece_len = calloc(n ? n : 1, sizeof *tok->piece_len);
    tok->flags = calloc(n ? n : 1, 1);
    tok->whole = calloc(n ? n : 1, sizeof *tok->whole);
    tok->pieces = malloc(key_bytes + json_object_size(vocab) + tok->n_added + 1); /* bytes + NULs */
    if (!tok->piece_off || !tok->piece_len || !tok->flags || !tok->whole || !tok->pieces ||
        strmap_init(&tok->vocab, json_object_size(vocab), key_bytes))
        return df_error_set(err, DF_ERR_NOMEM, "out of memory for a vocabulary of %zu ids", n);

    int16_t cp2b[BL_CP_MAX];
    bytelevel_tables(tok->byte_cp, cp2b);
    size_t pl = 0;
    tok->pieces[pl++] = 0; /* holes point here */
    json_object_foreach(vocab, key, val) {
        int32_t id = (int32_t)json_integer_value(val);
        size_t kl = strlen(key);
        strmap_put(&tok->vocab, key, kl, id);
        size_t dl = bytelevel_decode(cp2b, key, kl, tok->pieces + pl);
        tok->piece_off[id] = (uint32_t)pl;
        tok->piece_len[id] = (uint32_t)dl;
        tok->flags[id] = TF_PRESENT;
        pl += dl;
        tok->pieces[pl++] = 0;
    }
    for (size_t i = 0; i < tok->n_added; i++) {
        const added_tok *a = &tok->added[i];
        memcpy(tok->pieces + pl, a->content, a->len);
        tok->piece_off[a->id] = (uint32_t)pl;
        tok->piece_len[a->id] = (uint32_t)a->len;
        tok->flags[a->id] = (unsigned char)(TF_PRESENT | TF_ADDED | (a->special ? TF_SPECIAL : 0));
        pl += a->len;
        tok->pieces[pl++] = 0;
    }
    for (size_t i = 0; i < n; i++)
        if (tok->piece_len[i] > tok->max_piece) tok->max_piece = tok->piece_len[i];

    for (unsigned b = 0; b < 256; b++) {
        char s[2];
        tok->byte_id[b] = strmap_get(&tok->vocab, s, cp_to_utf8(tok->byte_cp[b], s));
    }
    tok->unk_id = -1;
    const char *unk = jstr(model, "unk_token");
    if (unk) {
        tok->unk_id = strmap_get(&tok->vocab, unk, strlen(unk));
        if (tok->unk_id < 0)
            return df_error_set(err, DF_ERR_FORMAT, "model.unk_token \"%s\" is not in the vocabulary", unk);
    }
    return load_merges(tok, json_object_get(model, "merges"), err);
}

df_status df_tokenizer_load_json(df_tokenizer **out, const char *json, size_t len, df_error *err) {
    *out = NULL;
    json_error_t je;
    json_t *root = json_loadb(json, len, 0, &je);
    if (!root)
        return df_error_set(err, DF_ERR_FORMAT, "bad JSON at line %d column %d: %s", je.line, je.column, je.text);
    df_tokenizer *tok = calloc(1, sizeof *tok);
    df_status st = DF_OK;
    if (!tok) {
        st = df_error_set(err, DF_ERR_NOMEM, "out of memory");
    } else if (!json_is_object(root)) {
        st = df_error_set(err, DF_ERR_FORMAT, "the top level is not an object");
    } else {
        st = load_added(tok, json_object_get(root, "added_tokens"), err);
        if (!st) st = load_model(tok, json_object_get(root, "model"), err);
        if (!st) st = load_normalizer(tok, json_object_get(root, "normalizer"), err);
        if (!st) st = load_pretok(tok, json_object_get(root, "pre_tokenizer"), err);
        if (!st) st = check_decoder(json_object_get(root, "decoder"), err);
    }
    json_decref(root);
    if (st) {
        df_tokenizer_free(tok);
        return st;
    }
    *out = tok;
    return DF_OK;
}

df_status df_tokenizer_load(df_tokenizer **out, const char *path, df_error *err) {
    *out = NULL;
    FILE *f = df_fopen_regular(path, err);
    if (!f) return err ? err->code : DF_ERR_IO;
    char *buf = NULL;
    size_t n = 0, cap = 0;
    for (;;) {
        if (n == cap) {
            cap = cap ? cap * 2 : (1u << 20);
            char *nb = realloc(buf, cap);
            if (!nb) {
                free(buf);
                fclose(f);
                return df_error_set(err, DF_ERR_NOMEM, "%s: out of memory reading the file", path);
            }
            buf = nb;
        }
        size_t r = fread(buf + n, 1, cap - n, f);
        n += r;
        if (r == 0) break;
    }
    int bad = ferror(f);
    fclose(f);
    if (bad) {
        free(buf);
        return df_error_set(err, DF_ERR_IO, "%s: read error", path);
    }
    df_status st = df_tokenizer_load_json(out, buf, n, err);
    free(buf);
    if (st) df_error_prefix(err, "%s", path);
    return st;
}

/* ---------------------------------------------------------------------------------------- */
/* Encoding                                                                                  */

typedef struct heap_ent {
    uint64_t key;        /* rank << 32 | position: the min-heap order */
    int32_t id;          /* the merged id this entry was made for */
    int32_t left, right; /* the pair it was made for */
} heap_ent;

#define BPE_SMALL 128

typedef struct enc {
    const df_tokenizer *tok;
    int32_t *ids;
    size_t n, cap;
    pcre2_match_data *md;
    /* BPE scratch for one piece of up to scap bytes */
    int32_t *sym, *prev, *next;
    heap_ent *heap;
    size_t scap;
    int32_t sym_small[3 * BPE_SMALL]; /* the scratch for pieces up to BPE_SMALL bytes, */
    heap_ent heap_small[3 * BPE_SMALL]; /* so that short encodes do not allocate it */
    struct piece_cache *cache; /* [cache_mask + 1], or NULL for short inputs */
    uint32_t cache_mask;
    df_error *err;
} enc;

/* A per-call, direct-mapped cache of piece -> ids, sized to the input (up to 4096 entries of one
 * cache line, 256 KB: it stays in L2 where the vocabulary and merge tables do not). Words repeat
 * (Zipf), so most pieces of a long text are found here. Per call, so nothing is shared. */
#define PC_KEY 26
#define PC_IDS 8
typedef struct piece_cache {
    uint32_t hash;
    uint8_t len, n; /* len 0: empty */
    unsigned char key[PC_KEY];
    int32_t ids[PC_IDS];
} piece_cache;

static int enc_push(enc *e, int32_t id) {
    if (e->n == e->cap) {
        size_t nc = e->cap ? e->cap * 2 : 256;
        int32_t *p = realloc(e->ids, nc * sizeof *p);
        if (!p) return -1;
        e->ids = p;
        e->cap = nc;
    }
    e->ids[e->n++] = id;
    return 0;
}

static inline const pair_slot *merge_get(const df_tokenizer *tok, int32_t a, int32_t b) {
    uint64_t key = pair_key(a, b);
    for (uint32_t h = pair_index(key, tok->merge_shift);; h = (h + 1) & tok->merge_mask) {
        const pair_slot *s = &tok->merges[h];
        if (s->id < 0) return NULL;
        if (s->key == key) return s;
    }
}

static void heap_push(heap_ent *h, size_t *n, heap_ent ent) {
    uint64_t key = ent.key;
    size_t i = (*n)++;
    while (i > 0) {
        size_t p = (i - 1) / 2;
        if (h[p].key <= key) break;
        h[i] = h[p];
        i = p;
    }
    h[i] = ent;
}

static heap_ent heap_pop(heap_ent *h, size_t *n) {
    heap_ent top = h[0], last = h[--(*n)];
    size_t i = 0, m = *n;
    for (;;) {
        size_t c = 2 * i + 1;
        if (c >= m) break;
        if (c + 1 < m && h[c + 1].key < h[c].key) c++;
        if (last.key <= h[c].key) break;
        h[i] = h[c];
        i = c;
    }
    if (m) h[i] = last;
    return top;
}

/* Pushes the candidate merge of symbols at pos and its successor, if there is one. */
static inline void push_pair(const df_tokenizer *tok, enc *e, size_t *nh, int32_t pos) {
    int32_t nx = e->next[pos];
    if (nx < 0) return;
    const pair_slot *m = merge_get(tok, e->sym[pos], e->sym[nx]);
    if (m) heap_push(e->heap, nh, (heap_ent){(uint64_t)m->rank << 32 | (uint32_t)pos, m->id, e->sym[pos], e->sym[nx]});
}

/* The merge loop over one piece of n >= 2 bytes (tokenizers' Word::merge_all). */
static int bpe_merge(enc *e, const unsigned char *p, size_t n) {
    const df_tokenizer *tok = e->tok;
    if (n > e->scap) {
        size_t c = n;
        if (e->sym != e->sym_small) {
            free(e->sym);
            free(e->heap);
        }
        e->sym = malloc(3 * c * sizeof *e->sym);
        e->heap = malloc(3 * c * sizeof *e->heap);
        if (!e->sym || !e->heap) {
            e->scap = 0;
            return -1;
        }
        e->prev = e->sym + c;
        e->next = e->sym + 2 * c;
        e->scap = c;
    }
    int32_t m = 0;
    for (size_t i = 0; i < n; i++) {
        int32_t id = tok->byte_id[p[i]];
        if (id < 0) {
            if (tok->unk_id < 0) continue; /* no symbol, no unk: dropped, as tokenizers */
            if (tok->fuse_unk && m > 0 && e->sym[m - 1] == tok->unk_id) continue;
            id = tok->unk_id;
        }
        e->sym[m] = id;
        e->prev[m] = m - 1;
        e->next[m] = m + 1;
        m++;
    }
    if (m == 0) return 0;
    e->next[m - 1] = -1;
    size_t nh = 0;
    for (int32_t i = 0; i + 1 < m; i++) /* the table is large: start every probe's load at once */
        __builtin_prefetch(&tok->merges[pair_index(pair_key(e->sym[i], e->sym[i + 1]), tok->merge_shift)]);
    for (int32_t i = 0; i + 1 < m; i++) push_pair(tok, e, &nh, i);
    while (nh) {
        heap_ent top = heap_pop(e->heap, &nh);
        int32_t pos = (int32_t)(uint32_t)top.key;
        if (e->sym[pos] < 0) continue; /* merged away */
        int32_t nx = e->next[pos];
        if (nx < 0) continue;
        if (e->sym[pos] != top.left || e->sym[nx] != top.right) { /* the pair changed: still valid? */
            const pair_slot *cur = merge_get(tok, e->sym[pos], e->sym[nx]);
            if (!cur || cur->id != top.id) continue; /* stale entry */
        }
        e->sym[pos] = top.id;
        e->sym[nx] = -1;
        e->next[pos] = e->next[nx];
        if (e->next[nx] >= 0) e->prev[e->next[nx]] = pos;
        if (e->prev[pos] >= 0) push_pair(tok, e, &nh, e->prev[pos]);
        push_pair(tok, e, &nh, pos);
    }
    for (int32_t i = 0; i >= 0; i = e->next[i])
        if (enc_push(e, e->sym[i])) return -1;
    return 0;
}

/* BPE over one pre-tokenized piece of n bytes. A piece that is itself a vocabulary token is
 * looked up once (a hash probe instead of the merge loop's dozen): the first time a token is
 * met, the merge loop runs and whether it yields exactly that token is remembered in
 * tok->whole (relaxed atomics: every thread computes the same value). With ignore_merges
 * (tokenizers' BPE option) a whole-piece token is taken without asking. */
static int bpe_lookup(enc *e, const unsigned char *p, size_t n) {
    const df_tokenizer *tok = e->tok;
    if (n <= WHOLE_MAX || tok->ignore_merges) {
        char small[2 * WHOLE_MAX];
        char *s = n <= WHOLE_MAX ? small : malloc(2 * n);
        if (!s) return -1;
        size_t l = 0;
        for (size_t i = 0; i < n; i++) l += cp_to_utf8(tok->byte_cp[p[i]], s + l);
        int32_t id = strmap_get(&tok->vocab, s, l);
        if (s != small) free(s);
        if (id >= 0) {
            if (tok->ignore_merges) return enc_push(e, id);
            unsigned char w = atomic_load_explicit(&tok->whole[id], memory_order_relaxed);
            if (w == WHOLE_YES) return enc_push(e, id);
            if (w == WHOLE_UNKNOWN) {
                size_t before = e->n;
                if (bpe_merge(e, p, n)) return -1;
                w = e->n == before + 1 && e->ids[before] == id ? WHOLE_YES : WHOLE_NO;
                atomic_store_explicit(&tok->whole[id], w, memory_order_relaxed);
                return 0;
            }
        }
    }
    return bpe_merge(e, p, n);
}

/* BPE over one pre-tokenized piece of n bytes, through the per-call cache. */
static int bpe_piece(enc *e, const unsigned char *p, size_t n) {
    const df_tokenizer *tok = e->tok;
    if (n == 0) return 0;
    if (n == 1) {
        int32_t id = tok->byte_id[p[0]] >= 0 ? tok->byte_id[p[0]] : tok->unk_id;
        return id >= 0 ? enc_push(e, id) : 0;
    }
    if (!e->cache || n > PC_KEY) return bpe_lookup(e, p, n);
    uint32_t h = str_hash((const char *)p, n);
    piece_cache *c = &e->cache[h & e->cache_mask];
    if (c->len == n && c->hash == h && memcmp(c->key, p, n) == 0) {
        for (unsigned i = 0; i < c->n; i++)
            if (enc_push(e, c->ids[i])) return -1;
        return 0;
    }
    size_t before = e->n;
    if (bpe_lookup(e, p, n)) return -1;
    size_t got = e->n - before;
    if (got <= PC_IDS) {
        c->hash = h;
        c->len = (uint8_t)n;
        c->n = (uint8_t)got;
        memcpy(c->key, p, n);
        memcpy(c->ids, e->ids + before, got * sizeof *e->ids);
    }
    return 0;
}

/* Splits a (normalized) stretch with the pre-tokenizer regex and BPE-encodes the pieces. */
static df_status split_pieces(enc *e, const char *s, size_t n) {
    const df_tokenizer *tok = e->tok;
    if (!tok->re) return bpe_piece(e, (const unsigned char *)s, n) ? df_error_set(e->err, DF_ERR_NOMEM, "out of memory")
                                                                   : DF_OK;
    size_t pos = 0, gap = 0;
    while (pos < n) {
        int rc = pcre2_match(tok->re, (PCRE2_SPTR)s, n, pos, PCRE2_NO_UTF_CHECK, e->md, NULL);
        if (rc == PCRE2_ERROR_JIT_STACKLIMIT)
            rc = pcre2_match(tok->re, (PCRE2_SPTR)s, n, pos, PCRE2_NO_UTF_CHECK | PCRE2_NO_JIT, e->md, NULL);
        if (rc == PCRE2_ERROR_NOMATCH) break;
        if (rc < 0) {
            PCRE2_UCHAR msg[256];
            pcre2_get_error_message(rc, msg, sizeof msg);
            return df_error_set(e->err, DF_ERR_RANGE, "pre-tokenizer regex failed near byte %zu: %s", pos,
                                (const char *)msg);
        }
        const PCRE2_SIZE *ov = pcre2_get_ovector_pointer(e->md);
        size_t ms = ov[0], me = ov[1];
        if (me <= ms) { /* an empty match: step over one character */
            size_t l = 1;
            if (ms < n) u8_class((const unsigned char *)s, n, ms, &l);
            pos = ms + l;
            continue;
        }
        if ((ms > gap && bpe_piece(e, (const unsigned char *)s + gap, ms - gap)) ||
            bpe_piece(e, (const unsigned char *)s + ms, me - ms))
            return df_error_set(e->err, DF_ERR_NOMEM, "out of memory");
        gap = pos = me;
    }
    if (gap < n && bpe_piece(e, (const unsigned char *)s + gap, n - gap))
        return df_error_set(e->err, DF_ERR_NOMEM, "out of memory");
    return DF_OK;
}

/* Unicode White_Space (Rust's char::is_whitespace, used by tokenizers for lstrip/rstrip). */
static int is_space_cp(utf8proc_int32_t c) {
    return (c >= 9 && c <= 13) || c == 0x20 || c == 0x85 || c == 0xA0 || c == 0x1680 || (c >= 0x2000 && c <= 0x200A) ||
           c == 0x2028 || c == 0x2029 || c == 0x202F || c == 0x205F || c == 0x3000;
}

/* A word character for single_word: the regex crate's Unicode `\w`, which tokenizers uses
 * (`\w$` / `^\w` in added_vocabulary.rs): Alphabetic, marks, Nd, Pc and the joiners. Alphabetic
 * is the letters, Nl and Other_Alphabetic; the latter is marks except the circled letters (So). */
static int is_word_cp(utf8proc_int32_t c) {
    switch (utf8proc_category(c)) {
    case UTF8PROC_CATEGORY_LU: case UTF8PROC_CATEGORY_LL: case UTF8PROC_CATEGORY_LT:
    case UTF8PROC_CATEGORY_LM: case UTF8PROC_CATEGORY_LO: case UTF8PROC_CATEGORY_MN:
    case UTF8PROC_CATEGORY_MC: case UTF8PROC_CATEGORY_ME: case UTF8PROC_CATEGORY_ND:
    case UTF8PROC_CATEGORY_NL: case UTF8PROC_CATEGORY_PC:
        return 1;
    default:
        return c == 0x200C || c == 0x200D || (c >= 0x24B6 && c <= 0x24E9) || (c >= 0x1F130 && c <= 0x1F149) ||
               (c >= 0x1F150 && c <= 0x1F169) || (c >= 0x1F170 && c <= 0x1F189);
    }
}

/* The code point ending just before s[i] (s is valid UTF-8, i > 0). */
static utf8proc_int32_t cp_before(const char *s, size_t i, size_t *len) {
    size_t j = i - 1;
    while (j > 0 && ((unsigned char)s[j] & 0xC0) == 0x80) j--;
    utf8proc_int32_t c;
    utf8proc_iterate((const utf8proc_uint8_t *)s + j, (utf8proc_ssize_t)(i - j), &c);
    *len = i - j;
    return c;
}

static utf8proc_int32_t cp_at(const char *s, size_t n, size_t i, size_t *len) {
    utf8proc_int32_t c;
    utf8proc_ssize_t l = utf8proc_iterate((const utf8proc_uint8_t *)s + i, (utf8proc_ssize_t)(n - i), &c);
    *len = l > 0 ? (size_t)l : 1;
    return c;
}

/* Finds the next added token of class `normalized` in s[from..n): leftmost, then longest
 * (aho-corasick LeftmostLongest, as tokenizers' AddedVocabulary). A single_word token next to a
 * word character is not taken and its bytes stay text. lstrip / rstrip widen the match over
 * whitespace, never below `from`. Returns the token or NULL; *ms / *me: the matched span. */
static const added_tok *find_added(const df_tokenizer *tok, const char *s, size_t n, size_t from,
                                   int normalized, int parse_special, size_t *ms, size_t *me) {
    const unsigned char *first = normalized ? tok->first_norm : tok->first_raw;
    for (size_t i = from; i < n; i++) {
        unsigned char c = (unsigned char)s[i];
        if (!first[c]) continue;
        for (uint32_t k = tok->added_start[c]; k < tok->added_start[c + 1]; k++) {
            const added_tok *a = &tok->added[k];
            if (a->normalized != normalized || (a->special && !parse_special)) continue;
            if (a->len > n - i || memcmp(s + i, a->content, a->len) != 0) continue;
            size_t st = i, en = i + a->len, l;
            if (a->single_word) {
                if ((st > 0 && is_word_cp(cp_before(s, st, &l))) || (en < n && is_word_cp(cp_at(s, n, en, &l)))) {
                    i = en - 1; /* the rejected span stays text; the search goes on after it */
                    break;
                }
            }
            if (a->lstrip)
                while (st > from && is_space_cp(cp_before(s, st, &l))) st -= l;
            if (a->rstrip)
                while (en < n && is_space_cp(cp_at(s, n, en, &l))) en += l;
            *ms = st;
            *me = en;
            return a;
        }
    }
    return NULL;
}

/* Encodes normalized text: added tokens with normalized: true first, the rest by regex + BPE. */
static df_status encode_normalized(enc *e, const char *s, size_t n, int parse_special) {
    size_t pos = 0;
    while (pos < n) {
        size_t ms = n, me = n;
        const added_tok *a =
            e->tok->any_norm_added ? find_added(e->tok, s, n, pos, 1, parse_special, &ms, &me) : NULL;
        df_status st = split_pieces(e, s + pos, ms - pos);
        if (st) return st;
        if (!a) break;
        if (enc_push(e, a->id)) return df_error_set(e->err, DF_ERR_NOMEM, "out of memory");
        pos = me;
    }
    return DF_OK;
}

/* Is c "NFC-inert": unchanged by NFC and a safe place to cut a text for it? True when c has
 * combining class 0, no canonical decomposition, and cannot be the second character of a
 * canonical composition (those are all marks, or Hangul vowel / trailing jamo). Then
 * NFC(x + c y) = NFC(x) + NFC(c y) and NFC keeps c itself. Code points below U+0300 are all
 * inert. (Unicode 15 §3.11; UAX #15 §9, "stable code points".) */
static int nfc_inert(utf8proc_int32_t c) {
    if (c < 0x300) return 1;
    if ((c >= 0x1161 && c <= 0x1175) || (c >= 0x11A8 && c <= 0x11C2)) return 0;
    const utf8proc_property_t *p = utf8proc_get_property(c);
    if (p->combining_class != 0) return 0;
    if (p->decomp_seqindex != UINT16_MAX && p->decomp_type == 0) return 0; /* canonical mapping */
    return p->category < UTF8PROC_CATEGORY_MN || p->category > UTF8PROC_CATEGORY_ME;
}

static int buf_append(char **b, size_t *n, size_t *cap, const char *s, size_t len) {
    if (len == 0) return 0;
    if (*n + len > *cap) {
        size_t nc = 2 * (*n + len) + 64;
        char *p = realloc(*b, nc);
        if (!p) return -1;
        *b = p;
        *cap = nc;
    }
    memcpy(*b + *n, s, len);
    *n += len;
    return 0;
}

/* NFC-normalises a stretch and encodes it. Only the runs of non-inert characters, each with the
 * character before it (a starter they may compose with), go through utf8proc; the rest is
 * already NFC and is copied (or, when the whole stretch is inert, used in place). */
static df_status encode_stretch(enc *e, const char *s, size_t n, int parse_special) {
    if (n == 0) return DF_OK;
    if (!e->tok->nfc) return encode_normalized(e, s, n, parse_special);
    char *out = NULL;
    size_t on = 0, ocap = 0, copied = 0, prev = 0, i = 0;
    df_status st = DF_OK;
    while (i < n && !st) {
        if ((unsigned char)s[i] < 0xCC) { /* below U+0300 (continuation bytes included) */
            if (((unsigned char)s[i] & 0xC0) != 0x80) prev = i;
            i++;
            continue;
        }
        size_t l;
        if (nfc_inert(cp_at(s, n, i, &l))) {
            prev = i;
            i += l;
            continue;
        }
        size_t seg = i > copied ? prev : i, end = i + l;
        while (end < n && !nfc_inert(cp_at(s, n, end, &l))) end += l;
        utf8proc_uint8_t *norm = NULL;
        utf8proc_ssize_t nl = utf8proc_map((const utf8proc_uint8_t *)s + seg, (utf8proc_ssize_t)(end - seg), &norm,
                                           UTF8PROC_STABLE | UTF8PROC_COMPOSE);
        if (nl < 0)
            st = df_error_set(e->err, nl == UTF8PROC_ERROR_NOMEM ? DF_ERR_NOMEM : DF_ERR_INVALID_ARG,
                              "NFC normalization failed: %s", utf8proc_errmsg(nl));
        else if (buf_append(&out, &on, &ocap, s + copied, seg - copied) ||
                 buf_append(&out, &on, &ocap, (const char *)norm, (size_t)nl))
            st = df_error_set(e->err, DF_ERR_NOMEM, "out of memory");
        free(norm);
        copied = i = end;
    }
    if (!st && !out) return encode_normalized(e, s, n, parse_special);
    if (!st && buf_append(&out, &on, &ocap, s + copied, n - copied))
        st = df_error_set(e->err, DF_ERR_NOMEM, "out of memory");
    if (!st) st = encode_normalized(e, out, on, parse_special);
    free(out);
    return st;
}

size_t df_utf8_invalid_at(const char *s, size_t n) { return n ? u8_first_invalid((const unsigned char *)s, n) : 0; }

df_status df_tokenizer_encode(const df_tokenizer *tok, const char *text, size_t len, int parse_special,
                              int32_t **ids, size_t *n_ids, df_error *err) {
    *ids = NULL;
    *n_ids = 0;
    if (!text && len) return df_error_set(err, DF_ERR_INVALID_ARG, "encode: NULL text");
    size_t bad = u8_first_invalid((const unsigned char *)text, len);
    if (bad < len)
        return df_error_set(err, DF_ERR_INVALID_ARG, "encode: invalid UTF-8 at byte %zu (0x%02X)", bad,
                            (unsigned)(unsigned char)text[bad]);
    enc enc_state = {.tok = tok, .err = err}, *e = &enc_state; /* about 11 KB of stack */
    e->sym = e->sym_small;
    e->prev = e->sym + BPE_SMALL;
    e->next = e->sym + 2 * BPE_SMALL;
    e->heap = e->heap_small;
    e->scap = BPE_SMALL;
    df_status st = DF_OK;
    if (tok->re && !(e->md = pcre2_match_data_create_from_pattern(tok->re, NULL)))
        st = df_error_set(err, DF_ERR_NOMEM, "out of memory");
    if (len >= 2048) { /* a cache pays off past a few hundred pieces */
        size_t entries = 64;
        while (entries < 4096 && entries * 16 < len) entries <<= 1;
        e->cache = calloc(entries, sizeof *e->cache);
        e->cache_mask = (uint32_t)(entries - 1); /* no cache (NULL) is fine too */
    }
    if (!st && enc_push(e, 0) == 0) e->n = 0; /* *ids is non-NULL even for empty output */
    else if (!st) st = df_error_set(err, DF_ERR_NOMEM, "out of memory");
    size_t pos = 0;
    while (!st && pos < len) {
        size_t ms = len, me = len;
        const added_tok *a = find_added(tok, text, len, pos, 0, parse_special, &ms, &me);
        st = encode_stretch(e, text + pos, ms - pos, parse_special);
        if (st || !a) break;
        if (enc_push(e, a->id)) st = df_error_set(err, DF_ERR_NOMEM, "out of memory");
        pos = me;
    }
    pcre2_match_data_free(e->md);
    if (e->sym != e->sym_small) {
        free(e->sym);
        free(e->heap);
    }
    free(e->cache);
    if (st) {
        free(e->ids);
        return st;
    }
    *ids = e->ids;
    *n_ids = e->n;
    return DF_OK;
}

/* ---------------------------------------------------------------------------------------- */
/* Decoding                                                                                  */

const char *df_tokenizer_piece(const df_tokenizer *tok, int32_t id, size_t *len) {
    if (id < 0 || id >= tok->n_ids || !tok->flags[id]) {
        if (len) *len = 0;
        return tok->pieces; /* "" */
    }
    if (len) *len = tok->piece_len[id];
    return tok->pieces + tok->piece_off[id];
}

size_t df_tokenizer_max_piece_len(const df_tokenizer *tok) { return tok->max_piece; }

int32_t df_tokenizer_vocab_size(const df_tokenizer *tok) { return tok->n_ids; }

int df_tokenizer_is_special(const df_tokenizer *tok, int32_t id) {
    return id >= 0 && id < tok->n_ids && (tok->flags[id] & TF_SPECIAL) != 0;
}

int32_t df_tokenizer_token_id(const df_tokenizer *tok, const char *token) {
    size_t n = strlen(token);
    for (size_t i = 0; i < tok->n_added; i++)
        if (tok->added[i].len == n && memcmp(tok->added[i].content, token, n) == 0) return tok->added[i].id;
    return strmap_get(&tok->vocab, token, n);
}

/* Is id's piece part of the output? */
static int emits(const df_tokenizer *tok, int32_t id, int skip_special) {
    if (id < 0 || id >= tok->n_ids || !tok->flags[id]) return 0;
    return !(skip_special && (tok->flags[id] & TF_SPECIAL));
}

/* Copies s[0..n) to out with each maximal invalid subpart replaced by U+FFFD; when hold is set
 * a valid prefix cut short by the end is not written (*held gets its length). out needs 3n. */
static size_t lossy_copy(const unsigned char *s, size_t n, int hold, char *out, size_t *held) {
    size_t o = 0, i = 0;
    *held = 0;
    while (i < n) {
        size_t l;
        int k = s[i] < 0x80 ? U8_VALID : u8_class(s, n, i, &l);
        if (s[i] < 0x80) l = 1;
        if (k == U8_VALID) {
            memcpy(out + o, s + i, l);
            o += l;
        } else if (k == U8_SHORT && hold) {
            *held = l;
            break;
        } else {
            memcpy(out + o, u8_replacement, 3);
            o += 3;
        }
        i += l;
    }
    return o;
}

df_status df_tokenizer_decode(const df_tokenizer *tok, const int32_t *ids, size_t n, int skip_special, char **out,
                              size_t *out_len, df_error *err) {
    *out = NULL;
    if (out_len) *out_len = 0;
    size_t total = 0;
    for (size_t i = 0; i < n; i++)
        if (emits(tok, ids[i], skip_special)) total += tok->piece_len[ids[i]];
    unsigned char *raw = malloc(total + 1);
    if (!raw) return df_error_set(err, DF_ERR_NOMEM, "out of memory decoding %zu ids", n);
    size_t r = 0;
    for (size_t i = 0; i < n; i++) {
        if (!emits(tok, ids[i], skip_special)) continue;
        memcpy(raw + r, tok->pieces + tok->piece_off[ids[i]], tok->piece_len[ids[i]]);
        r += tok->piece_len[ids[i]];
    }
    if (u8_first_invalid(raw, r) == r) { /* the common case: already valid */
        raw[r] = 0;
        *out = (char *)raw;
        if (out_len) *out_len = r;
        return DF_OK;
    }
    char *s = malloc(3 * r + 1);
    if (!s) {
        free(raw);
        return df_error_set(err, DF_ERR_NOMEM, "out of memory decoding %zu ids", n);
    }
    size_t held, o = lossy_copy(raw, r, 0, s, &held);
    free(raw);
    s[o] = 0;
    *out = s;
    if (out_len) *out_len = o;
    return DF_OK;
}

void df_detok_init(df_detok *d, const df_tokenizer *tok, int skip_special) {
    memset(d, 0, sizeof *d);
    d->tok = tok;
    d->skip_special = skip_special;
}

size_t df_detok_push(df_detok *d, int32_t id, char *buf, size_t cap, df_error *err) {
    const df_tokenizer *tok = d->tok;
    if (!emits(tok, id, d->skip_special)) return 0;
    const unsigned char *p = (const unsigned char *)tok->pieces + tok->piece_off[id];
    size_t n = tok->piece_len[id];
    /* Characters that start in the held bytes end within the piece's first 3 bytes: decide
     * them on a small joined buffer, then continue in the piece itself. */
    unsigned char join[8];
    size_t hp = d->n_pending, jn = hp + (n < 4 ? n : 4), o = 0, i = 0, held = 0;
    memcpy(join, d->pending, hp);
    memcpy(join + hp, p, jn - hp);
    char tmp[16];
    while (i < hp) {
        size_t l;
        int k = u8_class(join, jn, i, &l);
        if (k == U8_SHORT) { /* the whole piece is inside join: still unfinished */
            held = l;
            break;
        }
        size_t w = k == U8_VALID ? l : 3;
        memcpy(tmp + o, k == U8_VALID ? (const char *)join + i : u8_replacement, w);
        o += w;
        i += l;
    }
    unsigned char newpend[4];
    size_t nnew = 0;
    if (held) {
        memcpy(newpend, join + i, held);
        nnew = held;
        if (o > cap) goto too_small;
        memcpy(buf, tmp, o);
    } else {
        size_t start = i - hp; /* bytes of the piece already consumed */
        /* worst case 3 bytes out per byte in; check exactly by a counting pass when tight */
        size_t need = o, j = start;
        while (j < n) {
            size_t l;
            int k = p[j] < 0x80 ? U8_VALID : u8_class(p, n, j, &l);
            if (p[j] < 0x80) l = 1;
            if (k == U8_SHORT) break;
            need += k == U8_VALID ? l : 3;
            j += l;
        }
        if (need > cap) goto too_small;
        memcpy(buf, tmp, o);
        size_t h;
        o += lossy_copy(p + start, n - start, 1, buf + o, &h);
        memcpy(newpend, p + n - h, h);
        nnew = h;
    }
    memcpy(d->pending, newpend, nnew);
    d->n_pending = nnew;
    return o;
too_small:
    df_error_set(err, DF_ERR_RANGE, "detok: output buffer of %zu bytes is too small", cap);
    return 0;
}

size_t df_detok_flush(df_detok *d, char *buf, size_t cap) {
    if (!d->n_pending) return 0;
    if (cap < 3) return 0;
    memcpy(buf, u8_replacement, 3);
    d->n_pending = 0;
    return 3;
}
