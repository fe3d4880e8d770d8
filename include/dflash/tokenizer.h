/* dflash: Hugging Face tokenizer.json byte-level BPE (the Qwen family).
 *
 * Pipeline (tokenizers' BPE + ByteLevel, MODEL.md §3):
 *  1. added tokens (`added_tokens`, `normalized: false`) are matched in the raw text first,
 *     leftmost then longest first (honouring their lstrip / rstrip / single_word flags);
 *  2. the text between them is NFC-normalised (utf8proc) when the normalizer is NFC;
 *     added tokens with `normalized: true` are then matched in the normalised text;
 *  3. the pre-tokenizer's Split regex, read from the file, cuts each stretch into pieces
 *     (PCRE2 with UTF + UCP, JIT when available; behaviour "Isolated": matches and the gaps
 *     between them are both pieces). A lone ByteLevel pre-tokenizer with use_regex uses the
 *     GPT-2 pattern;
 *  4. each piece's bytes are mapped to the byte-level alphabet (GPT-2 bytes_to_unicode, no
 *     prefix space) and merged by BPE: always the pair of lowest merge rank (rank = position
 *     in `model.merges`), leftmost first, exactly as tokenizers' `Word::merge_all`.
 * Merges may be "a b" strings or ["a","b"] pairs. Decoding maps byte-level symbols back to
 * bytes; added tokens decode to their content; invalid UTF-8 in the joined bytes becomes
 * U+FFFD (one per maximal invalid subpart, as Rust's from_utf8_lossy, which tokenizers uses).
 *
 * Agreement with tokenizers (0.23.2): every id of the oracle cases, and differential fuzzing of
 * ~100k random texts, match, except where the Unicode tables differ: PCRE2 10.42 knows Unicode
 * 14 (letters assigned later are "unassigned" to \p{L}) and tokenizers' NFC tables predate
 * Unicode 11 (about 100 combining marks added since are not reordered by tokenizers; utf8proc
 * reorders them as Unicode 15 says). `\s` means Unicode White_Space, as in Oniguruma.
 * Decoding differs only for added tokens with non-ASCII content, which tokenizers runs through
 * the ByteLevel decoder (garbling them) and dflash returns as written.
 *
 * A loaded tokenizer is logically immutable (the one lazily filled table uses atomics): every
 * function taking `const df_tokenizer *` may be called from several threads at once.
 */
#ifndef DFLASH_TOKENIZER_H
#define DFLASH_TOKENIZER_H

#include <stddef.h>
#include <stdint.h>

#include "dflash/status.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct df_tokenizer df_tokenizer;

/* Loads a tokenizer.json file. Errors: DF_ERR_IO (cannot read), DF_ERR_FORMAT (bad JSON,
 * missing or mistyped field, merge naming a token not in the vocabulary, regex that does not
 * compile), DF_ERR_UNSUPPORTED (a model/normalizer/pre-tokenizer/decoder type or option other
 * than those listed above, e.g. byte_fallback, dropout, a continuing_subword_prefix),
 * DF_ERR_RANGE (ids above 2^24), DF_ERR_NOMEM. Messages name the file and the field. */
df_status df_tokenizer_load(df_tokenizer **out, const char *path, df_error *err);
/* As df_tokenizer_load from an in-memory JSON text of len bytes (need not be NUL-terminated). */
df_status df_tokenizer_load_json(df_tokenizer **out, const char *json, size_t len, df_error *err);
/* Frees a tokenizer (NULL is fine). */
void df_tokenizer_free(df_tokenizer *tok);

/* Offset of the first byte of s[0..n) that is not part of valid UTF-8 (n when the text is
 * valid; overlong forms, surrogates and values past U+10FFFF are invalid). */
size_t df_utf8_invalid_at(const char *s, size_t n);

/* Encodes len bytes of UTF-8 text; no special tokens are added around it. Added tokens in the
 * text are recognised; with parse_special == 0 those marked `special: true` (<|im_start|>,
 * <|endoftext|>, ...) are not, and are encoded as plain text instead, like tokenizers'
 * `encode_special_tokens = true` (use it for untrusted user text). Non-special added tokens
 * (<think>, <tool_call>) are always recognised, as in tokenizers.
 * *ids is malloc'd (caller frees; non-NULL even when *n_ids == 0), *n_ids its length.
 * Errors: DF_ERR_INVALID_ARG for invalid UTF-8 (the message names the byte offset),
 * DF_ERR_RANGE when PCRE2 hits its match limits, DF_ERR_NOMEM. On error *ids is NULL. */
df_status df_tokenizer_encode(const df_tokenizer *tok, const char *text, size_t len, int parse_special,
                              int32_t **ids, size_t *n_ids, df_error *err);

/* The bytes of one token: a vocabulary token's byte-level symbols mapped back to bytes (may be
 * part of a UTF-8 sequence), or an added token's content. Ids outside the vocabulary (< 0,
 * >= vocab_size, or holes such as padded embedding rows) give an empty piece. *len (may be
 * NULL) receives the length; the pointer is owned by the tokenizer and NUL-terminated. */
const char *df_tokenizer_piece(const df_tokenizer *tok, int32_t id, size_t *len);
/* The longest piece in bytes (bounds df_detok_push's output, see DF_DETOK_OUT_MAX). */
size_t df_tokenizer_max_piece_len(const df_tokenizer *tok);

/* Decodes ids to a malloc'd NUL-terminated UTF-8 string (*out; *out_len, may be NULL, gets the
 * length without the NUL). skip_special != 0 drops added tokens marked special. Unknown ids
 * decode to nothing; invalid UTF-8 in the joined bytes becomes U+FFFD. Errors: DF_ERR_NOMEM. */
df_status df_tokenizer_decode(const df_tokenizer *tok, const int32_t *ids, size_t n, int skip_special,
                              char **out, size_t *out_len, df_error *err);

/* Looks up a token by its tokenizer.json spelling: an added token's content ("<|im_end|>"),
 * else a vocabulary key in the byte-level alphabet ("Ġhello" for " hello"); -1 when absent. */
int32_t df_tokenizer_token_id(const df_tokenizer *tok, const char *token);
/* 1 if id is an added token marked `special: true`, else 0. */
int df_tokenizer_is_special(const df_tokenizer *tok, int32_t id);
/* Number of ids (max id + 1 over vocabulary and added tokens). The model's embedding may have
 * more rows; those ids decode to nothing. */
int32_t df_tokenizer_vocab_size(const df_tokenizer *tok);

/* Incremental decoder: feed ids one at a time, receive text that is always whole UTF-8. The
 * bytes of an unfinished but so far valid sequence (at most 3) are held back until it
 * completes; bytes that can never become valid are emitted at once as U+FFFD, so the
 * concatenation of all pushes and the final flush equals df_tokenizer_decode of the same ids.
 * A df_detok holds no allocation: copy or drop it freely. */
typedef struct df_detok {
    const df_tokenizer *tok;
    int skip_special;
    unsigned char pending[4]; /* held-back prefix of an unfinished UTF-8 sequence */
    size_t n_pending;         /* 0..3 */
} df_detok;

/* Upper bound on the bytes one df_detok_push can write for a piece of piece_len bytes
 * (every held or new byte could become a 3-byte U+FFFD). */
#define DF_DETOK_OUT_MAX(piece_len) (3 * ((size_t)(piece_len) + 3))

void df_detok_init(df_detok *d, const df_tokenizer *tok, int skip_special);
/* Appends the text made complete by id to buf (capacity cap bytes, no NUL written); returns
 * the number of bytes written. A cap of DF_DETOK_OUT_MAX(df_tokenizer_max_piece_len(tok))
 * always suffices. If the text does not fit, nothing is written, the state is unchanged,
 * 0 is returned and err (may be NULL) gets DF_ERR_RANGE. Unknown ids write nothing. */
size_t df_detok_push(df_detok *d, int32_t id, char *buf, size_t cap, df_error *err);
/* Emits what is held back (an unfinished sequence: one U+FFFD, 3 bytes) and resets the state.
 * Returns the bytes written; with cap < 3 and something held, writes nothing and returns 0
 * (the state is kept). */
size_t df_detok_flush(df_detok *d, char *buf, size_t cap);

#ifdef __cplusplus
}
#endif
#endif
