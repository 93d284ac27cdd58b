/* di-plan store: how many storage servers the shared KV store needs, and why. */
#include <stdio.h>

#include "common/engine/store_plan.h"
#include "common/model/config.h"
#include "common/util/json_read.h"
#include "tools/plan/plan_cmd.h"

static const plan_key server_keys[] = {
    {"ssds", true, "SSDs per server"},
    {"ssd_tb", true, "capacity of one SSD (TB, 1e12 bytes)"},
    {"read_gb_s", true, "read bandwidth of one server (GB/s, 1e9 bytes/s)"},
    {"ec_data", true, "erasure-coding data units"},
    {"ec_parity", true, "erasure-coding parity units"},
    {NULL, false, NULL},
};

static const plan_key retention_keys[] = {
    {"share", true, "fraction of stored tokens in this class"},
    {"days", true, "days they are kept"},
    {NULL, false, NULL},
};

static di_status read_server(const json_t *in, store_server *sv, di_error *err)
{
    json_t *o;
    int64_t ssds, data, parity;
    di_status st;
    if ((st = di_json_object(in, "server", &o, err)) ||
        (st = plan_check_keys(o, server_keys, "key 'server'", err)))
        return st;
    if ((st = di_json_int_range(o, "ssds", 1, 1 << 20, &ssds, err)) ||
        (st = di_json_num(o, "ssd_tb", &sv->ssd_tb, err)) ||
        (st = di_json_num(o, "read_gb_s", &sv->read_gb_s, err)) ||
        (st = di_json_int_range(o, "ec_data", 1, 1 << 10, &data, err)) ||
        (st = di_json_int_range(o, "ec_parity", 0, 1 << 10, &parity, err))) {
        di_error_prefix(err, "key 'server': ");
        return st;
    }
    sv->ssds = (uint32_t)ssds;
    sv->ec_data = (uint32_t)data;
    sv->ec_parity = (uint32_t)parity;
    return DI_OK;
}

static di_status read_retention(const json_t *in, store_plan_input *p, di_error *err)
{
    json_t *arr;
    di_status st = di_json_array(in, "retention", &arr, err);
    if (st != DI_OK)
        return st;
    size_t n = json_array_size(arr);
    if (n == 0 || n > STORE_PLAN_MAX_RETENTION)
        return di_fail(err, DI_EINVAL, "key 'retention': %zu classes, need 1..%u", n,
                       STORE_PLAN_MAX_RETENTION);
    for (size_t i = 0; i < n; i++) {
        const json_t *c = json_array_get(arr, i);
        char what[48];
        snprintf(what, sizeof(what), "key 'retention'[%zu]", i);
        if ((st = plan_check_keys(c, retention_keys, what, err)))
            return st;
        if ((st = di_json_num(c, "share", &p->retention[i].share, err)) ||
            (st = di_json_num(c, "days", &p->retention[i].days, err))) {
            di_error_prefix(err, "%s: ", what);
            return st;
        }
    }
    p->num_retention = (uint32_t)n;
    return DI_OK;
}

static di_status result_json(const store_plan_result *r, json_t **out, di_error *err)
{
    json_t *o = json_object();
    if (!o)
        return di_fail(err, DI_ENOMEM, "out of memory building the output");
    di_status st;
    if ((st = plan_set(o, "new_tokens_per_day", json_real(r->new_tokens_per_day), err)) ||
        (st = plan_set(o, "mean_retention_days", json_real(r->mean_retention_days), err)) ||
        (st = plan_set(o, "held_tokens", json_real(r->held_tokens), err)) ||
        (st = plan_set(o, "held_bytes", json_real(r->held_bytes), err)) ||
        (st = plan_set(o, "usable_bytes_per_server", json_real(r->usable_bytes_per_server),
                       err)) ||
        (st = plan_set(o, "servers_capacity", json_integer((json_int_t)r->servers_capacity),
                       err)) ||
        (st = plan_set(o, "read_bytes_per_s", json_real(r->read_bytes_per_s), err)) ||
        (st = plan_set(o, "write_bytes_per_s", json_real(r->write_bytes_per_s), err)) ||
        (st = plan_set(o, "servers_bandwidth", json_integer((json_int_t)r->servers_bandwidth),
                       err)) ||
        (st = plan_set(o, "servers", json_integer((json_int_t)r->servers), err)) ||
        (st = plan_set(o, "limit", json_string(store_plan_limit_name(r)), err)) ||
        (st = plan_set(o, "window_state_bytes_per_request",
                       json_real(r->window_state_bytes_per_request), err)) ||
        (st = plan_set(o, "window_state_bytes_per_token",
                       json_real(r->window_state_bytes_per_token), err)) ||
        (st = plan_set(o, "requests_per_day", json_real(r->requests_per_day), err)) ||
        (st = plan_set(o, "held_window_state_bytes", json_real(r->held_window_state_bytes),
                       err)) ||
        (st = plan_set(o, "servers_with_window_state",
                       json_integer((json_int_t)r->servers_with_window_state), err))) {
        json_decref(o);
        return st;
    }
    *out = o;
    return DI_OK;
}

di_status plan_cmd_store(const json_t *in, json_t **out, di_error *err)
{
    store_plan_input p;
    kv_geometry g;
    kv_geometry_v41_flash(5, &g);
    store_plan_input_defaults(&p, &g);
    di_status st;
    if ((st = di_json_num(in, "tokens_per_day", &p.tokens_per_day, err)) ||
        (st = di_json_num(in, "input_share", &p.input_share, err)) ||
        (st = di_json_num(in, "input_hit_rate", &p.input_hit_rate, err)) ||
        (st = di_json_bool(in, "store_decode_kv", &p.store_decode_kv, err)) ||
        (st = read_retention(in, &p, err)) ||
        (st = di_json_num_opt(in, "bytes_per_token", &p.bytes_per_token, err)) ||
        (st = di_json_num(in, "avg_request_tokens", &p.avg_request_tokens, err)) ||
        (st = read_server(in, &p.server, err)) ||
        (st = di_json_num_opt(in, "window_state_bytes", &p.window_state_bytes, err)))
        return st;
    store_plan_result r;
    if ((st = store_plan_compute(&p, &r, err)))
        return st;
    return result_json(&r, out, err);
}
