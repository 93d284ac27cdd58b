#include "common/util/json_read.h"

#include <math.h>
#include <stdlib.h>
#include <sys/stat.h>

const char *di_json_type_name(const json_t *v)
{
    if (!v)
        return "nothing";
    switch (json_typeof(v)) {
    case JSON_OBJECT:
        return "object";
    case JSON_ARRAY:
        return "array";
    case JSON_STRING:
        return "string";
    case JSON_INTEGER:
        return "integer";
    case JSON_REAL:
        return "real";
    case JSON_TRUE:
    case JSON_FALSE:
        return "boolean";
    case JSON_NULL:
        return "null";
    }
    return "unknown";
}

/* Looks up key: *v = NULL when absent or null. Fails only when obj is not an object. */
static di_status lookup(const json_t *obj, const char *key, json_t **v, di_error *err)
{
    if (!json_is_object(obj))
        return di_fail(err, DI_EINVAL, "reading key '%s': expected an object, got %s", key,
                       di_json_type_name(obj));
    json_t *x = json_object_get(obj, key);
    *v = (x && !json_is_null(x)) ? x : NULL;
    return DI_OK;
}

static di_status missing(const char *key, di_error *err)
{
    return di_fail(err, DI_EINVAL, "missing key '%s'", key);
}

static di_status wrong(const char *key, const char *want, const json_t *v, di_error *err)
{
    return di_fail(err, DI_EINVAL, "key '%s': expected %s, got %s", key, want,
                   di_json_type_name(v));
}

static di_status read_int(const json_t *obj, const char *key, int64_t *out, bool required,
                          di_error *err)
{
    json_t *v;
    di_status st = lookup(obj, key, &v, err);
    if (st)
        return st;
    if (!v)
        return required ? missing(key, err) : DI_OK;
    if (json_is_integer(v)) {
        *out = (int64_t)json_integer_value(v);
        return DI_OK;
    }
    if (json_is_real(v)) {
        double d = json_real_value(v);
        if (d == floor(d) && fabs(d) < 9.0e15) {
            *out = (int64_t)d;
            return DI_OK;
        }
        return di_fail(err, DI_EINVAL, "key '%s': expected an integer, got %g", key, d);
    }
    return wrong(key, "an integer", v, err);
}

di_status di_json_int(const json_t *obj, const char *key, int64_t *out, di_error *err)
{
    return read_int(obj, key, out, true, err);
}

di_status di_json_int_opt(const json_t *obj, const char *key, int64_t *out, di_error *err)
{
    return read_int(obj, key, out, false, err);
}

static di_status read_int_range(const json_t *obj, const char *key, int64_t lo, int64_t hi,
                                int64_t *out, bool required, di_error *err)
{
    int64_t v = 0;
    json_t *x;
    di_status st = lookup(obj, key, &x, err);
    if (st)
        return st;
    if (!x)
        return required ? missing(key, err) : DI_OK;
    st = read_int(obj, key, &v, true, err);
    if (st)
        return st;
    if (v < lo || v > hi)
        return di_fail(err, DI_EINVAL, "key '%s': %lld is outside [%lld, %lld]", key,
                       (long long)v, (long long)lo, (long long)hi);
    *out = v;
    return DI_OK;
}

di_status di_json_int_range(const json_t *obj, const char *key, int64_t lo, int64_t hi,
                            int64_t *out, di_error *err)
{
    return read_int_range(obj, key, lo, hi, out, true, err);
}

di_status di_json_int_range_opt(const json_t *obj, const char *key, int64_t lo, int64_t hi,
                                int64_t *out, di_error *err)
{
    return read_int_range(obj, key, lo, hi, out, false, err);
}

static di_status read_num(const json_t *obj, const char *key, double *out, bool required,
                          di_error *err)
{
    json_t *v;
    di_status st = lookup(obj, key, &v, err);
    if (st)
        return st;
    if (!v)
        return required ? missing(key, err) : DI_OK;
    if (!json_is_number(v))
        return wrong(key, "a number", v, err);
    double d = json_number_value(v);
    if (!isfinite(d))
        return di_fail(err, DI_EINVAL, "key '%s': expected a finite number", key);
    *out = d;
    return DI_OK;
}

di_status di_json_num(const json_t *obj, const char *key, double *out, di_error *err)
{
    return read_num(obj, key, out, true, err);
}

di_status di_json_num_opt(const json_t *obj, const char *key, double *out, di_error *err)
{
    return read_num(obj, key, out, false, err);
}

static di_status read_bool(const json_t *obj, const char *key, bool *out, bool required,
                           di_error *err)
{
    json_t *v;
    di_status st = lookup(obj, key, &v, err);
    if (st)
        return st;
    if (!v)
        return required ? missing(key, err) : DI_OK;
    if (!json_is_boolean(v))
        return wrong(key, "true or false", v, err);
    *out = json_is_true(v);
    return DI_OK;
}

di_status di_json_bool(const json_t *obj, const char *key, bool *out, di_error *err)
{
    return read_bool(obj, key, out, true, err);
}

di_status di_json_bool_opt(const json_t *obj, const char *key, bool *out, di_error *err)
{
    return read_bool(obj, key, out, false, err);
}

static di_status read_str(const json_t *obj, const char *key, const char **out, bool required,
                          di_error *err)
{
    json_t *v;
    di_status st = lookup(obj, key, &v, err);
    if (st)
        return st;
    if (!v)
        return required ? missing(key, err) : DI_OK;
    if (!json_is_string(v))
        return wrong(key, "a string", v, err);
    *out = json_string_value(v);
    return DI_OK;
}

di_status di_json_str(const json_t *obj, const char *key, const char **out, di_error *err)
{
    return read_str(obj, key, out, true, err);
}

di_status di_json_str_opt(const json_t *obj, const char *key, const char **out, di_error *err)
{
    return read_str(obj, key, out, false, err);
}

di_status di_json_array(const json_t *obj, const char *key, json_t **out, di_error *err)
{
    json_t *v;
    di_status st = lookup(obj, key, &v, err);
    if (st)
        return st;
    if (!v)
        return missing(key, err);
    if (!json_is_array(v))
        return wrong(key, "an array", v, err);
    *out = v;
    return DI_OK;
}

di_status di_json_object(const json_t *obj, const char *key, json_t **out, di_error *err)
{
    json_t *v;
    di_status st = lookup(obj, key, &v, err);
    if (st)
        return st;
    if (!v)
        return missing(key, err);
    if (!json_is_object(v))
        return wrong(key, "an object", v, err);
    *out = v;
    return DI_OK;
}

di_status di_json_int_array(const json_t *obj, const char *key, int64_t **out, size_t *n,
                            di_error *err)
{
    json_t *arr;
    di_status st = di_json_array(obj, key, &arr, err);
    if (st)
        return st;
    size_t len = json_array_size(arr);
    int64_t *vals = malloc((len ? len : 1) * sizeof(*vals));
    if (!vals)
        return di_fail(err, DI_ENOMEM, "key '%s': out of memory for %zu integers", key, len);
    for (size_t i = 0; i < len; i++) {
        json_t *x = json_array_get(arr, i);
        if (!json_is_integer(x)) {
            free(vals);
            return di_fail(err, DI_EINVAL, "key '%s'[%zu]: expected an integer, got %s", key,
                           i, di_json_type_name(x));
        }
        vals[i] = (int64_t)json_integer_value(x);
    }
    *out = vals;
    *n = len;
    return DI_OK;
}

di_status di_json_parse(const char *text, size_t len, const char *what, json_t **out,
                        di_error *err)
{
    json_error_t je;
    json_t *root = json_loadb(text, len, JSON_REJECT_DUPLICATES, &je);
    if (!root)
        return di_fail(err, DI_EINVAL, "%s: invalid JSON at line %d column %d: %s",
                       what ? what : "input", je.line, je.column, je.text);
    *out = root;
    return DI_OK;
}

di_status di_json_load_file(const char *path, json_t **out, di_error *err)
{
    struct stat sb;
    if (stat(path, &sb) == 0 && !S_ISREG(sb.st_mode)) /* a FIFO would block, a device never ends */
        return di_fail(err, DI_EINVAL, "%s: not a regular file", path);
    json_error_t je;
    json_t *root = json_load_file(path, JSON_REJECT_DUPLICATES, &je);
    if (!root) {
        if (je.line < 0 || je.line == -1)
            return di_fail(err, DI_ENOENT, "%s: %s", path, je.text);
        return di_fail(err, DI_EINVAL, "%s: invalid JSON at line %d column %d: %s", path,
                       je.line, je.column, je.text);
    }
    *out = root;
    return DI_OK;
}
