/* json_read.h: typed reads from jansson objects with messages that name the key.
 *
 * Every reader takes the object, the key, an out-parameter and a di_error, and fails with
 * DI_EINVAL and a message such as "key 'top_p': expected a number, got string" or
 * "missing key 'num_gpus'". Outputs are written only on success. The _opt variants leave the
 * output untouched (the caller's default) when the key is absent or null.
 */
#ifndef DI_UTIL_JSON_READ_H
#define DI_UTIL_JSON_READ_H

#include <jansson.h>
#include <stdbool.h>
#include <stdint.h>

#include "common/util/status.h"

/* Name of a JSON value's type, for messages ("object", "array", "string", ...). */
const char *di_json_type_name(const json_t *v);

di_status di_json_int(const json_t *obj, const char *key, int64_t *out, di_error *err);
di_status di_json_int_opt(const json_t *obj, const char *key, int64_t *out, di_error *err);
/* An integer in [lo, hi]. */
di_status di_json_int_range(const json_t *obj, const char *key, int64_t lo, int64_t hi,
                            int64_t *out, di_error *err);
di_status di_json_int_range_opt(const json_t *obj, const char *key, int64_t lo, int64_t hi,
                                int64_t *out, di_error *err);
/* A number (integer or real). */
di_status di_json_num(const json_t *obj, const char *key, double *out, di_error *err);
di_status di_json_num_opt(const json_t *obj, const char *key, double *out, di_error *err);
di_status di_json_bool(const json_t *obj, const char *key, bool *out, di_error *err);
di_status di_json_bool_opt(const json_t *obj, const char *key, bool *out, di_error *err);
/* Borrowed string (valid while obj lives). */
di_status di_json_str(const json_t *obj, const char *key, const char **out, di_error *err);
di_status di_json_str_opt(const json_t *obj, const char *key, const char **out, di_error *err);
/* Borrowed array / object. */
di_status di_json_array(const json_t *obj, const char *key, json_t **out, di_error *err);
di_status di_json_object(const json_t *obj, const char *key, json_t **out, di_error *err);

/* An array of integers into a malloc'd int64_t[] (*out, *n). Caller frees *out. */
di_status di_json_int_array(const json_t *obj, const char *key, int64_t **out, size_t *n,
                            di_error *err);

/* Parses a whole buffer or file, failing with "line L column C: <jansson text>". A path that
 * is missing is DI_ENOENT, one that is not a regular file (FIFO, device) DI_EINVAL. The caller
 * owns the result (json_decref). */
di_status di_json_parse(const char *text, size_t len, const char *what, json_t **out,
                        di_error *err);
di_status di_json_load_file(const char *path, json_t **out, di_error *err);

#endif
