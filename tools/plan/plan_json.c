#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "common/util/json_read.h"
#include "tools/plan/plan_cmd.h"

static const plan_key *find_key(const plan_key *keys, const char *name)
{
    for (const plan_key *k = keys; k->name; k++)
        if (strcmp(k->name, name) == 0)
            return k;
    return NULL;
}

di_status plan_check_keys(const json_t *obj, const plan_key *keys, const char *what,
                          di_error *err)
{
    if (!json_is_object(obj))
        return di_fail(err, DI_EINVAL, "%s: expected an object, got %s", what,
                       di_json_type_name(obj));
    const char *name;
    json_t *v;
    json_object_foreach((json_t *)obj, name, v) {
        if (!find_key(keys, name))
            return di_fail(err, DI_EINVAL, "%s: unknown key '%s'", what, name);
    }
    for (const plan_key *k = keys; k->name; k++) {
        json_t *x = json_object_get(obj, k->name);
        if (k->required && (!x || json_is_null(x)))
            return di_fail(err, DI_EINVAL, "%s: missing key '%s'", what, k->name);
    }
    return DI_OK;
}

void plan_matrix_free(plan_matrix *m)
{
    if (!m)
        return;
    free(m->vals);
    free(m->row_len);
    memset(m, 0, sizeof(*m));
}

/* Checks the shape of key's array of arrays and counts its numbers. */
static di_status matrix_shape(const json_t *arr, const char *key, bool equal_rows,
                              size_t *total, di_error *err)
{
    size_t rows = json_array_size(arr);
    if (rows == 0)
        return di_fail(err, DI_EINVAL, "key '%s': empty array", key);
    size_t n = 0;
    for (size_t i = 0; i < rows; i++) {
        const json_t *row = json_array_get(arr, i);
        if (!json_is_array(row))
            return di_fail(err, DI_EINVAL, "key '%s'[%zu]: expected an array, got %s", key, i,
                           di_json_type_name(row));
        size_t len = json_array_size(row);
        size_t first = json_array_size(json_array_get(arr, 0));
        if (equal_rows && len == 0)
            return di_fail(err, DI_EINVAL, "key '%s'[%zu]: empty array", key, i);
        if (equal_rows && len != first)
            return di_fail(err, DI_EINVAL, "key '%s'[%zu]: %zu entries, but '%s'[0] has %zu",
                           key, i, len, key, first);
        n += len;
    }
    *total = n;
    return DI_OK;
}

di_status plan_read_matrix(const json_t *obj, const char *key, double lo, double hi,
                           bool equal_rows, plan_matrix *out, di_error *err)
{
    json_t *arr;
    di_status st = di_json_array(obj, key, &arr, err);
    size_t total = 0;
    if (st != DI_OK || (st = matrix_shape(arr, key, equal_rows, &total, err)) != DI_OK)
        return st;
    plan_matrix m = {.rows = json_array_size(arr), .total = total};
    m.vals = malloc((total ? total : 1) * sizeof(double));
    m.row_len = malloc(m.rows * sizeof(size_t));
    if (!m.vals || !m.row_len) {
        plan_matrix_free(&m);
        return di_fail(err, DI_ENOMEM, "key '%s': out of memory for %zu numbers", key, total);
    }
    size_t k = 0;
    for (size_t i = 0; i < m.rows; i++) {
        const json_t *row = json_array_get(arr, i);
        m.row_len[i] = json_array_size(row);
        for (size_t j = 0; j < m.row_len[i]; j++) {
            const json_t *v = json_array_get(row, j);
            if (!json_is_number(v)) {
                plan_matrix_free(&m);
                return di_fail(err, DI_EINVAL, "key '%s'[%zu][%zu]: expected a number, got %s",
                               key, i, j, di_json_type_name(v));
            }
            double x = json_number_value(v);
            if (!(x >= lo && x <= hi)) {
                plan_matrix_free(&m);
                if (isinf(hi))
                    return di_fail(err, DI_EINVAL, "key '%s'[%zu][%zu]: %g must be >= %g", key,
                                   i, j, x, lo);
                return di_fail(err, DI_EINVAL, "key '%s'[%zu][%zu]: %g outside [%g, %g]", key,
                               i, j, x, lo, hi);
            }
            m.vals[k++] = x;
        }
    }
    *out = m;
    return DI_OK;
}

di_status plan_matrix_int_check(const plan_matrix *m, const char *key, double lo, double hi,
                                di_error *err)
{
    size_t k = 0;
    for (size_t i = 0; i < m->rows; i++)
        for (size_t j = 0; j < m->row_len[i]; j++, k++) {
            double x = m->vals[k];
            if (x != floor(x) || x < lo || x > hi)
                return di_fail(err, DI_EINVAL, "key '%s'[%zu][%zu]: %g is not an integer in "
                               "[%g, %g]", key, i, j, x, lo, hi);
        }
    return DI_OK;
}

di_status plan_set(json_t *obj, const char *key, json_t *value, di_error *err)
{
    if (!value || json_object_set_new(obj, key, value) != 0)
        return di_fail(err, DI_ENOMEM, "out of memory building output key '%s'", key);
    return DI_OK;
}

di_status plan_set_append(json_t *array, json_t *value, di_error *err)
{
    if (!value || json_array_append_new(array, value) != 0)
        return di_fail(err, DI_ENOMEM, "out of memory building an output array");
    return DI_OK;
}

json_t *plan_u32_array(const uint32_t *v, size_t n)
{
    json_t *a = json_array();
    for (size_t i = 0; a && i < n; i++)
        if (json_array_append_new(a, json_integer(v[i])))
            json_decref(a), a = NULL;
    return a;
}
