/* KV store sizing: the explainer's Pass 5 example worked by hand, the limit switching to
 * bandwidth, the defaults from the KV layout, rounding, and every validation. */
#include <criterion/criterion.h>
#include <math.h>
#include <string.h>

#include "common/engine/store_plan.h"
#include "common/model/config.h"

/* Relative closeness. */
#define cr_assert_rel(x, want, rel)                                                            \
    cr_assert(fabs((x) - (want)) <= (rel) * fabs(want), "%s = %.15g, want %.15g", #x,         \
              (double)(x), (double)(want))

/* The explainer's "Size the KV store" inputs. */
static store_plan_input example(void)
{
    store_plan_input in;
    kv_geometry g;
    kv_geometry_v41_flash(5, &g);
    store_plan_input_defaults(&in, &g);
    in.tokens_per_day = 155e12;
    in.input_share = 0.9;
    in.input_hit_rate = 0.8;
    in.store_decode_kv = true;
    in.retention[0] = (store_retention){0.6, 3};
    in.retention[1] = (store_retention){0.4, 7};
    in.num_retention = 2;
    in.bytes_per_token = 891;
    in.avg_request_tokens = 20000;
    in.server = (store_server){.ssds = 20, .ssd_tb = 30.73, .read_gb_s = 40, .ec_data = 10,
                               .ec_parity = 2};
    return in;
}

/* By hand:
 *   input 155e12 x 0.9 = 139.5e12/day, output 15.5e12/day
 *   new stored = 139.5e12 x 0.2 + 15.5e12 = 27.9e12 + 15.5e12 = 43.4e12 tokens/day
 *   mean retention = 0.6 x 3 + 0.4 x 7 = 1.8 + 2.8 = 4.6 days
 *   held = 43.4e12 x 4.6 = 199.64e12 tokens; x 891 = 1.7787924e17 bytes (177.9 PB)
 *   usable per server = 20 x 30.73e12 x 10/12 = 614.6e12 x 10/12 = 512.1667e12 bytes
 *   servers for capacity = ceil(1.7787924e17 / 5.121667e14) = ceil(347.31) = 348
 *   reads: 139.5e12 x 0.8 = 111.6e12 hit tokens/day / 86,400 = 1.2917e9 tokens/s
 *          x 891 = 1.150875e12 bytes/s; / 40e9 = 28.77 -> 29 servers
 *   limit: capacity (348 > 29)
 *   writes: 43.4e12 x 891 / 86,400 = 447.56e9 bytes/s, x 12/10 = 537.075e9 with parity
 *   window state (V4.1-Flash, nextn 5): 128 header + 20 layers x 134 x 528 = 1,415,168,
 *          plus 3 C2 compressors x (2 - 1 + 6 pending) x 2 x 512 x 4 bytes = 86,016:
 *          1,501,184 bytes per request, / 20,000 = 75.0592 bytes per token
 *   requests = 155e12 / 20,000 = 7.75e9/day; held window states = 7.75e9 x 4.6 x 1,501,184 =
 *          5.35172096e16 bytes; with the blocks 2.3139645e17 / 5.121667e14 = 451.8 -> 452
 *          servers: keeping each request's window state as long as its blocks costs 30% more.
 */
Test(store_plan, explainer_example)
{
    store_plan_input in = example();
    cr_assert_eq(in.window_state_bytes, 1501184.0, "default window state");
    store_plan_result r;
    di_error e;
    cr_assert_eq(store_plan_compute(&in, &r, &e), DI_OK, "%s", e.msg);
    cr_assert_rel(r.new_tokens_per_day, 43.4e12, 1e-12);
    cr_assert_rel(r.mean_retention_days, 4.6, 1e-12);
    cr_assert_rel(r.held_tokens, 199.64e12, 1e-12);
    cr_assert_rel(r.held_bytes, 1.7787924e17, 1e-12);
    cr_assert_rel(r.usable_bytes_per_server, 614.6e12 * 10 / 12, 1e-12);
    cr_assert_eq(r.servers_capacity, 348);
    cr_assert_rel(r.read_bytes_per_s, 111.6e12 / 86400 * 891, 1e-12);
    cr_assert_rel(r.read_bytes_per_s, 1.150875e12, 1e-12);
    cr_assert_eq(r.servers_bandwidth, 29);
    cr_assert_eq(r.servers, 348);
    cr_assert(r.capacity_limited);
    cr_assert_str_eq(store_plan_limit_name(&r), "capacity");
    cr_assert_rel(r.write_bytes_per_s, 537.075e9, 1e-12);
    cr_assert_eq(r.window_state_bytes_per_request, 1501184.0);
    cr_assert_rel(r.window_state_bytes_per_token, 75.0592, 1e-12);
    cr_assert_rel(r.requests_per_day, 7.75e9, 1e-12);
    cr_assert_rel(r.held_window_state_bytes, 5.35172096e16, 1e-12);
    cr_assert_eq(r.servers_with_window_state, 452);
}

/* Without decode KV only the missed input is stored: 27.9e12/day x 4.6 x 891 =
 * 1.1435094e17 bytes / 5.121667e14 = 223.27 -> 224 servers. Reads are unchanged. */
Test(store_plan, decode_kv_not_stored)
{
    store_plan_input in = example();
    in.store_decode_kv = false;
    store_plan_result r;
    cr_assert_eq(store_plan_compute(&in, &r, NULL), DI_OK);
    cr_assert_rel(r.new_tokens_per_day, 27.9e12, 1e-12);
    cr_assert_rel(r.held_bytes, 1.1435094e17, 1e-12);
    cr_assert_eq(r.servers_capacity, 224);
    cr_assert_eq(r.servers_bandwidth, 29);
}

/* A high hit rate and a short retention make reads the limit: 99% hits, half a day, no decode
 * KV. Stored 139.5e12 x 0.01 = 1.395e12/day x 0.5 x 891 = 6.214725e14 bytes / 5.121667e14 =
 * 1.21 -> 2 servers. Reads 139.5e12 x 0.99 / 86,400 x 891 = 1.4242078125e12 B/s / 40e9 = 35.6
 * -> 36 servers: bandwidth. */
Test(store_plan, bandwidth_limited)
{
    store_plan_input in = example();
    in.input_hit_rate = 0.99;
    in.store_decode_kv = false;
    in.retention[0] = (store_retention){1.0, 0.5};
    in.num_retention = 1;
    store_plan_result r;
    cr_assert_eq(store_plan_compute(&in, &r, NULL), DI_OK);
    cr_assert_rel(r.held_bytes, 6.214725e14, 1e-12);
    cr_assert_eq(r.servers_capacity, 2);
    cr_assert_rel(r.read_bytes_per_s, 1.4242078125e12, 1e-12);
    cr_assert_eq(r.servers_bandwidth, 36);
    cr_assert_eq(r.servers, 36);
    cr_assert_not(r.capacity_limited);
    cr_assert_str_eq(store_plan_limit_name(&r), "bandwidth");
}

/* An exact fit needs exactly that many servers, even when float rounding lands just above
 * it: shares 0.2 and 0.8 of 7 days give a mean of 7.000000000000001 in doubles. 3e12 new
 * tokens/day of 1 byte, kept 7 days, on servers of one 1 TB SSD with no parity: 21e12 bytes,
 * 21 servers, not 22. */
Test(store_plan, exact_fit_does_not_round_up)
{
    store_plan_input in = example();
    in.tokens_per_day = 3e12;
    in.input_share = 1.0;
    in.input_hit_rate = 0.0;
    in.store_decode_kv = false;
    in.retention[0] = (store_retention){0.2, 7};
    in.retention[1] = (store_retention){0.8, 7};
    in.num_retention = 2;
    in.bytes_per_token = 1;
    in.server = (store_server){.ssds = 1, .ssd_tb = 1, .read_gb_s = 1, .ec_data = 1,
                               .ec_parity = 0};
    store_plan_result r;
    cr_assert_eq(store_plan_compute(&in, &r, NULL), DI_OK);
    cr_assert_gt(r.held_bytes, 21e12, "the case must exercise rounding noise");
    cr_assert_eq(r.servers_capacity, 21);
    cr_assert_eq(r.servers_bandwidth, 0, "no hits, nothing to read");
    cr_assert(r.capacity_limited);
}

/* Any data at all needs a server: 1,000 tokens a day held 1 day are 891 KB, a tiny fraction
 * of one server (2e-9 of 512 TB), which the rounding tolerance must not round to 0. The
 * same for reads. */
Test(store_plan, a_little_data_needs_one_server)
{
    store_plan_input in = example();
    in.tokens_per_day = 1000;
    in.retention[0] = (store_retention){1, 1};
    in.num_retention = 1;
    store_plan_result r;
    di_error e;
    cr_assert_eq(store_plan_compute(&in, &r, &e), DI_OK, "%s", e.msg);
    cr_assert_gt(r.held_bytes, 0);
    cr_assert_lt(r.held_bytes / r.usable_bytes_per_server, 1e-9, "the case hits the tolerance");
    cr_assert_eq(r.servers_capacity, 1);
    cr_assert_eq(r.servers_bandwidth, 1, "reads of hit tokens need a server too");
    cr_assert_eq(r.servers, 1);
    cr_assert_eq(r.servers_with_window_state, 1);
}

/* Inputs whose answer does not fit the result (servers beyond 2^53, bytes beyond a double)
 * are refused with a message, not turned into a garbage server count. */
Test(store_plan, results_out_of_range_are_refused)
{
    store_plan_result r;
    memset(&r, 0x5a, sizeof r);
    store_plan_result before = r;
    di_error e;
    store_plan_input in = example();
    in.tokens_per_day = 1e300; /* held bytes overflow to inf */
    cr_assert_eq(store_plan_compute(&in, &r, &e), DI_ERANGE);
    cr_assert(strstr(e.msg, "servers") || strstr(e.msg, "bytes"), "%s", e.msg);
    in = example();
    in.server.ssd_tb = 1e-300; /* finite bytes, but 1e300 servers */
    cr_assert_eq(store_plan_compute(&in, &r, &e), DI_ERANGE);
    in = example();
    in.avg_request_tokens = 1e-300; /* window states per request overflow */
    cr_assert_eq(store_plan_compute(&in, &r, &e), DI_ERANGE);
    cr_assert_eq(memcmp(&r, &before, sizeof r), 0, "output untouched on failure");
}

Test(store_plan, defaults_come_from_the_kv_layout)
{
    store_plan_input in;
    memset(&in, 0x7f, sizeof(in));
    kv_geometry g;
    kv_geometry_v41_flash(5, &g);
    store_plan_input_defaults(&in, &g);
    cr_assert_eq(in.bytes_per_token, 891.0, "114,048-byte block / 128 tokens");
    cr_assert_eq(in.window_state_bytes, 1501184.0);
    cr_assert_eq(in.tokens_per_day, 0.0);
    cr_assert_eq(in.num_retention, 0);
}

/* Every field is validated, the message names it, and the output is untouched. */
static void expect_einval(store_plan_input in, const char *needle)
{
    store_plan_result r;
    memset(&r, 0x3c, sizeof(r));
    store_plan_result before = r;
    di_error e = {0};
    cr_assert_eq(store_plan_compute(&in, &r, &e), DI_EINVAL, "expected failure for %s", needle);
    cr_assert(strstr(e.msg, needle) != NULL, "message '%s' lacks '%s'", e.msg, needle);
    cr_assert(memcmp(&r, &before, sizeof(r)) == 0, "output touched on failure");
}

Test(store_plan, validation)
{
    store_plan_input in = example();
    in.tokens_per_day = 0;
    expect_einval(in, "tokens_per_day");
    in = example();
    in.tokens_per_day = INFINITY;
    expect_einval(in, "tokens_per_day");
    in = example();
    in.input_share = 1.5;
    expect_einval(in, "input_share 1.5 outside [0, 1]");
    in = example();
    in.input_hit_rate = -0.1;
    expect_einval(in, "input_hit_rate");
    in = example();
    in.input_hit_rate = NAN;
    expect_einval(in, "input_hit_rate");
    in = example();
    in.retention[1].share = 0.3;
    expect_einval(in, "retention shares sum to 0.9");
    in = example();
    in.retention[0].share = 0;
    expect_einval(in, "retention[0].share");
    in = example();
    in.retention[1].days = 0;
    expect_einval(in, "retention[1].days");
    in = example();
    in.num_retention = 0;
    expect_einval(in, "retention has 0 classes");
    in = example();
    in.num_retention = STORE_PLAN_MAX_RETENTION + 1;
    expect_einval(in, "retention has");
    in = example();
    in.bytes_per_token = -891;
    expect_einval(in, "bytes_per_token");
    in = example();
    in.avg_request_tokens = 0;
    expect_einval(in, "avg_request_tokens");
    in = example();
    in.server.ssds = 0;
    expect_einval(in, "server.ssds");
    in = example();
    in.server.ssd_tb = 0;
    expect_einval(in, "server.ssd_tb");
    in = example();
    in.server.read_gb_s = -40;
    expect_einval(in, "server.read_gb_s");
    in = example();
    in.server.ec_data = 0;
    expect_einval(in, "server.ec_data");
    in = example();
    in.window_state_bytes = 0;
    expect_einval(in, "window_state_bytes");
    cr_assert_eq(store_plan_compute(NULL, NULL, NULL), DI_EINVAL);
}
