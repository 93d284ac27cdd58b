/* di-plan varlen: how many drafts each request checks, from confidences and step times. */
#include <errno.h>
#include <math.h>
#include <stdlib.h>

#include "common/engine/varlen.h"
#include "common/util/json_read.h"
#include "tools/plan/plan_cmd.h"

/* Parses a graph size key ("16") into rows. */
static di_status graph_rows(const char *name, uint32_t *rows, di_error *err)
{
    char *end = NULL;
    errno = 0;
    unsigned long long v = strtoull(name, &end, 10);
    if (name[0] < '0' || name[0] > '9' || *end || errno || v == 0 || v > UINT32_MAX)
        return di_fail(err, DI_EINVAL, "key 'step_ms': graph size '%s' is not a positive "
                       "integer", name);
    *rows = (uint32_t)v;
    return DI_OK;
}

/* Reads "step_ms" ({"<rows>": ms}) into a malloc'd table. */
static di_status read_times(const json_t *in, varlen_graph_time **out, size_t *n, di_error *err)
{
    json_t *obj;
    di_status st = di_json_object(in, "step_ms", &obj, err);
    if (st != DI_OK)
        return st;
    size_t count = json_object_size(obj);
    if (count == 0)
        return di_fail(err, DI_EINVAL, "key 'step_ms': no graph sizes");
    varlen_graph_time *t = malloc(count * sizeof(*t));
    if (!t)
        return di_fail(err, DI_ENOMEM, "key 'step_ms': out of memory");
    size_t k = 0;
    const char *name;
    json_t *v;
    json_object_foreach(obj, name, v) {
        if ((st = graph_rows(name, &t[k].rows, err)) != DI_OK)
            break;
        if (!json_is_number(v) || !(json_number_value(v) > 0) ||
            !isfinite(json_number_value(v))) {
            st = di_fail(err, DI_EINVAL, "key 'step_ms'.'%s': expected a number of ms > 0, "
                         "got %s", name, di_json_type_name(v));
            break;
        }
        t[k++].step_ms = json_number_value(v);
    }
    if (st != DI_OK) {
        free(t);
        return st;
    }
    *out = t;
    *n = count;
    return DI_OK;
}

static di_status plan_json_out(const varlen_plan *p, json_t **out, di_error *err)
{
    json_t *o = json_object();
    if (!o)
        return di_fail(err, DI_ENOMEM, "out of memory building the output");
    di_status st;
    if ((st = plan_set(o, "rows", json_integer(p->rows), err)) ||
        (st = plan_set(o, "drafts", plan_u32_array(p->drafts, p->num_requests), err)) ||
        (st = plan_set(o, "graph_rows", json_integer(p->graph_rows), err)) ||
        (st = plan_set(o, "expected_tokens", json_real(p->expected_tokens), err)) ||
        (st = plan_set(o, "step_ms", json_real(p->step_ms), err)) ||
        (st = plan_set(o, "tokens_per_ms", json_real(p->tokens_per_ms), err))) {
        json_decref(o);
        return st;
    }
    *out = o;
    return DI_OK;
}

di_status plan_cmd_varlen(const json_t *in, json_t **out, di_error *err)
{
    plan_matrix conf = {0};
    varlen_graph_time *times = NULL;
    size_t ntimes = 0;
    varlen_request *reqs = NULL;
    varlen_plan plan = {0};
    double sampler_ms = 0;
    di_status st;
    if ((st = plan_read_matrix(in, "confidences", 0.0, 1.0, false, &conf, err)) ||
        (st = read_times(in, &times, &ntimes, err)) ||
        (st = di_json_num(in, "sampler_ms", &sampler_ms, err)))
        goto done;
    if (conf.rows > VARLEN_MAX_REQUESTS) {
        st = di_fail(err, DI_EINVAL, "key 'confidences': %zu requests, at most %u", conf.rows,
                     VARLEN_MAX_REQUESTS);
        goto done;
    }
    if (!(reqs = malloc(conf.rows * sizeof(*reqs)))) {
        st = di_fail(err, DI_ENOMEM, "key 'confidences': out of memory");
        goto done;
    }
    for (size_t i = 0, k = 0; i < conf.rows; k += conf.row_len[i], i++) {
        uint32_t nd = conf.row_len[i] > VARLEN_MAX_DRAFTS ? VARLEN_MAX_DRAFTS + 1
                                                          : (uint32_t)conf.row_len[i];
        reqs[i] = (varlen_request){.conf = conf.vals + k, .num_drafts = nd};
    }
    if ((st = varlen_schedule(reqs, (uint32_t)conf.rows, times, ntimes, sampler_ms, &plan,
                              err)) != DI_OK)
        goto done;
    st = plan_json_out(&plan, out, err);
done:
    varlen_plan_free(&plan);
    free(reqs);
    free(times);
    plan_matrix_free(&conf);
    return st;
}
