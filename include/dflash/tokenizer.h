/* dflash: Hugging Face tokenizer.json byte-level BPE (the Qwen family).
 *
 * Pipeline (tokenizers' BPE + ByteLevel, MODEL.md §3): added tokens are matched in the raw
 * text first (longest first); the text between them is NFC-normalised (utf8proc), split by
 * the pre-tokenizer's Split regex read from the file (PCRE2, UTF + UCP; behaviour
 * "Isolated"), each piece mapped to the byte-level alphabet and merged by BPE rank.
 * Merges may be "a b" strings or ["a","b"] pairs. Decoding maps byte-level symbols back
 * to bytes; added tokens decode to their content.
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

/* Loads a tokenizer.json file. Errors: DF_ERR_IO, DF_ERR_FORMAT (bad JSON, unsupported
 * model/pre-tokenizer type, regex that does not compile), DF_ERR_NOMEM. */
df_status df_tokenizer_load(df_tokenizer **out, const char *path, df_error *err);
/* As df_tokenizer_load from an in-memory JSON text of len bytes. */
df_status df_tokenizer_load_json(df_tokenizer **out, const char *json, size_t len, df_error *err);
void df_tokenizer_free(df_tokenizer *tok);

/* Encodes len bytes of UTF-8 text (no special tokens added; added tokens in the text are
 * recognised when parse_special != 0). *ids is malloc'd (caller frees), *n_ids its length.
 * Invalid UTF-8 is an error (DF_ERR_INVALID_ARG) naming the byte offset. */
df_status df_tokenizer_encode(const df_tokenizer *tok, const char *text, size_t len, int parse_special,
                              int32_t **ids, size_t *n_ids, df_error *err);

/* The bytes of one token (byte-level symbols mapped back; added tokens give their content).
 * Ids outside the vocabulary give an empty piece. *len receives the length; the returned
 * pointer is owned by the tokenizer. */
const char *df_tokenizer_piece(const df_tokenizer *tok, int32_t id, size_t *len);

/* Decodes ids to a malloc'd NUL-terminated string (*out; *out_len without the NUL).
 * skip_special != 0 drops added tokens marked special. Unknown ids decode to nothing. */
df_status df_tokenizer_decode(const df_tokenizer *tok, const int32_t *ids, size_t n, int skip_special,
                              char **out, size_t *out_len, df_error *err);

/* Looks up a token string (vocabulary or added token); -1 when absent. */
int32_t df_tokenizer_token_id(const df_tokenizer *tok, const char *token);
/* 1 if id is an added token marked special. */
int df_tokenizer_is_special(const df_tokenizer *tok, int32_t id);
/* Number of ids (max id + 1 over vocabulary and added tokens). */
int32_t df_tokenizer_vocab_size(const df_tokenizer *tok);

/* Incremental decoder: feed ids one at a time, receive text that is always whole UTF-8
 * (bytes of an unfinished sequence are held back until it completes; df_detok_flush emits
 * what remains, invalid bytes as U+FFFD). */
typedef struct df_detok {
    const df_tokenizer *tok;
    int skip_special;
    unsigned char pending[8];
    size_t n_pending;
} df_detok;

void df_detok_init(df_detok *d, const df_tokenizer *tok, int skip_special);
/* Appends the text made complete by id to buf (capacity cap); returns the number of bytes
 * written (the output never exceeds 4*8+piece length; a too-small cap is DF_ERR_RANGE via
 * *err and 0 bytes). */
size_t df_detok_push(df_detok *d, int32_t id, char *buf, size_t cap, df_error *err);
size_t df_detok_flush(df_detok *d, char *buf, size_t cap);

#ifdef __cplusplus
}
#endif
#endif
