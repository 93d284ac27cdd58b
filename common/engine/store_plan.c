#include "common/engine/store_plan.h"

#include <math.h>
#include <string.h>


void store_plan_input_defaults(store_plan_input *in, const kv_geometry *g)
{
    memset(in, 0, sizeof(*in));
    in->bytes_per_token = (double)kv_block_bytes(g) / g->block_tokens;
    in->window_state_bytes = (double)kv_window_state_bytes(g);
}

const char *store_plan_limit_name(const store_plan_result *r)
{
    return r->capacity_limited ? "capacity" : "bandwidth";
}

static di_status need_positive(const char *name, double x, di_error *err)
{
    if (!(isfinite(x) && x > 0.0))
        return di_fail(err, DI_EINVAL, "%s %g must be a finite number > 0", name, x);
    return DI_OK;
}

static di_status need_fraction(const char *name, double x, di_error *err)
{
    if (!(x >= 0.0 && x <= 1.0))
        return di_fail(err, DI_EINVAL, "%s %g outside [0, 1]", name, x);
    return DI_OK;
}

static di_status check_retention(const store_plan_input *in, di_error *err)
{
    if (in->num_retention == 0 || in->num_retention > STORE_PLAN_MAX_RETENTION)
        return di_fail(err, DI_EINVAL, "retention has %u classes, need 1..%u",
                       in->num_retention, STORE_PLAN_MAX_RETENTION);
    double sum = 0.0;
    for (uint32_t i = 0; i < in->num_retention; i++) {
        const store_retention *r = &in->retention[i];
        if (!(r->share > 0.0 && r->share <= 1.0))
            return di_fail(err, DI_EINVAL, "retention[%u].share %g outside (0, 1]", i,
                           r->share);
        if (!(isfinite(r->days) && r->days > 0.0))
            return di_fail(err, DI_EINVAL, "retention[%u].days %g must be a finite number > 0",
                           i, r->days);
        sum += r->share;
    }
    if (fabs(sum - 1.0) > 1e-9)
        return di_fail(err, DI_EINVAL, "retention shares sum to %.12g, must sum to 1", sum);
    return DI_OK;
}

static di_status check_input(const store_plan_input *in, di_error *err)
{
    di_status st;
    if ((st = need_positive("tokens_per_day", in->tokens_per_day, err)) ||
        (st = need_fraction("input_share", in->input_share, err)) ||
        (st = need_fraction("input_hit_rate", in->input_hit_rate, err)) ||
        (st = check_retention(in, err)) ||
        (st = need_positive("bytes_per_token", in->bytes_per_token, err)) ||
        (st = need_positive("avg_request_tokens", in->avg_request_tokens, err)) ||
        (st = need_positive("server.ssd_tb", in->server.ssd_tb, err)) ||
        (st = need_positive("server.read_gb_s", in->server.read_gb_s, err)) ||
        (st = need_positive("window_state_bytes", in->window_state_bytes, err)))
        return st;
    if (in->server.ssds == 0)
        return di_fail(err, DI_EINVAL, "server.ssds must be at least 1");
    if (in->server.ec_data == 0)
        return di_fail(err, DI_EINVAL, "server.ec_data must be at least 1");
    return DI_OK;
}

/* ceil(x) for x >= 0, forgiving a relative 1e-9 above a positive integer (float noise on an
 * exact fit), so 21.00000000000001 servers are 21 while any x in (0, 1] is 1. False when x is
 * not a count a double holds exactly (NaN, infinite, above 2^53). */
static bool servers_for(double x, uint64_t *out)
{
    if (!(x >= 0.0 && x <= 9007199254740992.0))
        return false;
    double f = floor(x);
    *out = (uint64_t)f + (x > f && !(f >= 1.0 && x - f <= 1e-9 * x));
    return true;
}

/* Every figure of r finite and every server count exact: DI_OK, else DI_ERANGE. */
static di_status check_range(const store_plan_result *r, const double *ratios, size_t n,
                             di_error *err)
{
    const double figures[] = {r->new_tokens_per_day, r->held_tokens, r->held_bytes,
                              r->read_bytes_per_s, r->write_bytes_per_s,
                              r->window_state_bytes_per_token, r->requests_per_day,
                              r->held_window_state_bytes};
    for (size_t i = 0; i < sizeof figures / sizeof figures[0]; i++)
        if (!isfinite(figures[i]))
            return di_fail(err, DI_ERANGE, "the inputs give %g held bytes and %g requests a "
                           "day, beyond what can be planned: check the units", r->held_bytes,
                           r->requests_per_day);
    uint64_t unused;
    for (size_t i = 0; i < n; i++)
        if (!servers_for(ratios[i], &unused))
            return di_fail(err, DI_ERANGE, "the inputs need %g servers, beyond what can be "
                           "planned: check the units of the server and the traffic", ratios[i]);
    return DI_OK;
}

di_status store_plan_compute(const store_plan_input *in, store_plan_result *out,
                             di_error *err)
{
    if (!in || !out)
        return di_fail(err, DI_EINVAL, "store plan input or output is NULL");
    di_status st = check_input(in, err);
    if (st != DI_OK)
        return st;
    store_plan_result r = {0};
    double input = in->tokens_per_day * in->input_share;
    double output = in->tokens_per_day - input;
    r.new_tokens_per_day = input * (1.0 - in->input_hit_rate) +
                           (in->store_decode_kv ? output : 0.0);
    for (uint32_t i = 0; i < in->num_retention; i++)
        r.mean_retention_days += in->retention[i].share * in->retention[i].days;
    r.held_tokens = r.new_tokens_per_day * r.mean_retention_days;
    r.held_bytes = r.held_tokens * in->bytes_per_token;

    const store_server *sv = &in->server;
    double raw = sv->ssds * sv->ssd_tb * 1e12;
    r.usable_bytes_per_server = raw * sv->ec_data / ((double)sv->ec_data + sv->ec_parity);
    double cap_ratio = r.held_bytes / r.usable_bytes_per_server;

    r.read_bytes_per_s = input * in->input_hit_rate / STORE_PLAN_SECONDS_PER_DAY *
                         in->bytes_per_token;
    r.write_bytes_per_s = r.new_tokens_per_day / STORE_PLAN_SECONDS_PER_DAY *
                          in->bytes_per_token * ((double)sv->ec_data + sv->ec_parity) /
                          sv->ec_data;
    double bw_ratio = r.read_bytes_per_s / (sv->read_gb_s * 1e9);
    r.capacity_limited = cap_ratio >= bw_ratio;

    r.window_state_bytes_per_request = in->window_state_bytes;
    r.window_state_bytes_per_token = in->window_state_bytes / in->avg_request_tokens;
    r.requests_per_day = in->tokens_per_day / in->avg_request_tokens;
    r.held_window_state_bytes = r.requests_per_day * r.mean_retention_days *
                                in->window_state_bytes;
    double ws_ratio = (r.held_bytes + r.held_window_state_bytes) / r.usable_bytes_per_server;
    const double ratios[3] = {cap_ratio, bw_ratio, ws_ratio};
    st = check_range(&r, ratios, 3, err);
    if (st != DI_OK)
        return st;
    servers_for(cap_ratio, &r.servers_capacity);
    servers_for(bw_ratio, &r.servers_bandwidth);
    servers_for(ws_ratio, &r.servers_with_window_state);
    r.servers = r.servers_capacity > r.servers_bandwidth ? r.servers_capacity
                                                         : r.servers_bandwidth;
    *out = r;
    return DI_OK;
}
