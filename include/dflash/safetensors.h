/* dflash: safetensors files, memory-mapped.
 *
 * Format (https://github.com/huggingface/safetensors): an 8-byte little-endian header
 * length N, N bytes of JSON mapping tensor names to {dtype, shape, data_offsets:[begin,end]}
 * (offsets relative to the end of the header) plus an optional "__metadata__" object,
 * then the data. A tensor set is one file or several (a sharded pack with
 * model.safetensors.index.json); tensor data stays in the read-only mapping.
 *
 * Every header is validated before any data pointer is handed out: JSON syntax, known
 * dtype, shape product * dtype size == end - begin, offsets inside the file, no overlap,
 * no duplicate names. A lying header is DF_ERR_FORMAT naming file and tensor.
 */
#ifndef DFLASH_SAFETENSORS_H
#define DFLASH_SAFETENSORS_H

#include <stddef.h>
#include <stdint.h>

#include "dflash/status.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef enum df_dtype {
    DF_DTYPE_INVALID = 0,
    DF_DTYPE_F32,
    DF_DTYPE_F16,
    DF_DTYPE_BF16,
    DF_DTYPE_U32,
    DF_DTYPE_I32,
    DF_DTYPE_U8,
    DF_DTYPE_I64
} df_dtype;

/* Bytes per element of dtype (0 for DF_DTYPE_INVALID). */
size_t df_dtype_size(df_dtype t);
/* The safetensors spelling: "F32", "F16", "BF16", "U32", "I32", "U8", "I64". */
const char *df_dtype_name(df_dtype t);

#define DF_TENSOR_MAX_DIMS 8

typedef struct df_tensor {
    const char *name;                 /* owned by the set */
    df_dtype dtype;
    int ndim;                         /* 0..DF_TENSOR_MAX_DIMS */
    int64_t shape[DF_TENSOR_MAX_DIMS];
    int64_t numel;                    /* product of shape (1 for a scalar) */
    const void *data;                 /* into the read-only mapping; nbytes long */
    size_t nbytes;
    int file_index;                   /* which file of the set holds it */
    int used;                         /* set by df_tensors_take; for "unexpected tensor" checks */
} df_tensor;

typedef struct df_tensor_set df_tensor_set;

/* Opens and maps one safetensors file. Errors: DF_ERR_IO (open/map), DF_ERR_FORMAT
 * (truncated, bad JSON, lying offsets, unknown dtype), DF_ERR_NOMEM. */
df_status df_tensors_open_file(df_tensor_set **out, const char *path, df_error *err);

/* Opens the tensors of a pack folder: model.safetensors.index.json when present (every
 * shard it names; a tensor the index maps to shard X must be in X), else model.safetensors,
 * else the single *.safetensors file in the folder. Same errors as df_tensors_open_file;
 * a tensor present in two shards is DF_ERR_FORMAT. */
df_status df_tensors_open_dir(df_tensor_set **out, const char *dir, df_error *err);

/* Finds a tensor by exact name; NULL when absent. */
df_tensor *df_tensors_find(df_tensor_set *set, const char *name);
/* As df_tensors_find and marks the tensor used. */
df_tensor *df_tensors_take(df_tensor_set *set, const char *name);

size_t df_tensors_count(const df_tensor_set *set);
df_tensor *df_tensors_at(df_tensor_set *set, size_t i);
/* The __metadata__ "format" value of the first file, or NULL. */
const char *df_tensors_format(const df_tensor_set *set);
/* Path of file i of the set (for error messages); "?" when out of range. */
const char *df_tensors_file_path(const df_tensor_set *set, int file_index);
/* Number of files in the set (1 for a single file, the shard count for an index). */
int df_tensors_file_count(const df_tensor_set *set);
/* The read-only mapping of file file_index (the whole file): its address, and its size in bytes
 * in *bytes; NULL (and 0) when out of range. It does not change while the set lives. */
const void *df_tensors_file_map(const df_tensor_set *set, int file_index, size_t *bytes);

void df_tensors_free(df_tensor_set *set);

/* Conversions (exact for f16/bf16 -> f32; f32 -> f16 rounds to nearest even). */
float df_f16_to_f32(uint16_t h);
uint16_t df_f32_to_f16(float f);
float df_bf16_to_f32(uint16_t h);

#ifdef __cplusplus
}
#endif
#endif
