/* store_plan.h: sizing the shared KV store (explainer Pass 5 "Size the KV store", Pass 4 "A
 * tiny KV cache, kept for days").
 *
 * Units: tokens, bytes, seconds, days of 86,400 s. TB and GB are decimal (1e12, 1e9 bytes).
 *
 * Formulas, in order:
 *   input tokens/day        = tokens_per_day * input_share
 *   output tokens/day       = tokens_per_day * (1 - input_share)
 *   new tokens stored/day   = input tokens/day * (1 - input_hit_rate)
 *                             + output tokens/day             (only when store_decode_kv)
 *     A cache hit stores nothing new: its blocks are already held. Each new token is stored
 *     once (the store dedups by hash chain), for the retention of its class.
 *   mean retention (days)   = sum over classes of share * days
 *   held_tokens             = new tokens stored/day * mean retention     (steady state: each
 *                             day's tokens stay for their class's days)
 *   held_bytes              = held_tokens * bytes_per_token
 *   usable bytes per server = ssds * ssd_tb * 1e12 * ec_data / (ec_data + ec_parity)
 *   servers_capacity        = ceil(held_bytes / usable bytes per server)
 *   read demand (bytes/s)   = input tokens/day * input_hit_rate / 86,400 * bytes_per_token
 *     (every cache-hit input token is read back from the store once)
 *   servers_bandwidth       = ceil(read demand / (read_gb_s * 1e9))
 *   servers                 = max(servers_capacity, servers_bandwidth)
 *   limit                   = "capacity" when held_bytes / usable >= read demand / read speed,
 *                             else "bandwidth"
 *   window_state_bytes_per_request = window_state_bytes (one window state per request)
 *   window_state_bytes_per_token   = window_state_bytes / avg_request_tokens
 *   requests/day            = tokens_per_day / avg_request_tokens
 *   held_window_state_bytes = requests/day * mean retention * window_state_bytes
 *   servers_with_window_state = ceil((held_bytes + held_window_state_bytes) / usable)
 *
 * Choices where the explainer is silent:
 *   - read_gb_s is what a server can serve; erasure coding costs no read bandwidth (healthy
 *     reads touch data units only) and parity only costs capacity.
 *   - Writes are not a limit here (the explainer gives no write speed); write demand is
 *     reported (parity included) for information.
 *   - Each request keeps ONE window state (the last multiple of 128 of its prompt or
 *     response) for as long as its blocks. Window states are not deduplicated: two requests
 *     sharing a prefix still end at different points.
 *   - ceil() forgives a relative 1e-9 above an integer, so float rounding cannot add a server;
 *     any positive amount below one server still needs one.
 *   - The default window_state_bytes is V4.1-Flash's stored region with nextn 5:
 *     kv_window_state_bytes(kv_geometry_v41_flash(5)) = 128 + 20 * 134 * 528 + the C2
 *     compressors' pending state = 1,501,184 bytes; the default bytes_per_token is
 *     kv_block_bytes / 128 = 891.
 */
#ifndef DI_ENGINE_STORE_PLAN_H
#define DI_ENGINE_STORE_PLAN_H

#include <stdbool.h>
#include <stdint.h>

#include "common/kvfmt/kv_layout.h"
#include "common/util/status.h"

#define STORE_PLAN_MAX_RETENTION 16u
#define STORE_PLAN_SECONDS_PER_DAY 86400.0

/* One retention class: a share of the stored tokens kept for some days. */
typedef struct store_retention {
    double share; /* fraction of stored tokens in this class; (0, 1], classes sum to 1 */
    double days;  /* how long they are kept (days); > 0 */
} store_retention;

/* One storage server. */
typedef struct store_server {
    uint32_t ssds;      /* SSDs per server; >= 1 */
    double ssd_tb;      /* raw capacity of one SSD (TB = 1e12 bytes); > 0 */
    double read_gb_s;   /* read bandwidth the server serves (GB/s = 1e9 bytes/s); > 0 */
    uint32_t ec_data;   /* erasure-coding data units; >= 1 */
    uint32_t ec_parity; /* erasure-coding parity units; >= 0 */
} store_server;

/* The traffic and hardware assumptions, written by the caller (store_plan_input_defaults
 * fills the model-dependent fields first). */
typedef struct store_plan_input {
    double tokens_per_day;     /* tokens served per day, input and output; > 0 */
    double input_share;        /* fraction of those that are input (prompt) tokens; [0, 1] */
    double input_hit_rate;     /* fraction of input tokens found in the store; [0, 1] */
    bool store_decode_kv;      /* output tokens' KV is written to the store too */
    store_retention retention[STORE_PLAN_MAX_RETENTION]; /* retention classes */
    uint32_t num_retention;    /* classes used; 1..STORE_PLAN_MAX_RETENTION */
    double bytes_per_token;    /* KV bytes per stored token (891 for V4.1-Flash); > 0 */
    double avg_request_tokens; /* mean tokens of a request (prompt + output); > 0 */
    store_server server;       /* one storage server */
    double window_state_bytes; /* bytes of one stored window state; > 0 */
} store_plan_input;

/* What the store needs, written by store_plan_compute. */
typedef struct store_plan_result {
    double new_tokens_per_day;      /* tokens written to the store per day */
    double mean_retention_days;     /* sum of share * days */
    double held_tokens;             /* tokens held in steady state */
    double held_bytes;              /* their KV bytes */
    double usable_bytes_per_server; /* capacity after erasure coding (bytes) */
    uint64_t servers_capacity;      /* servers needed to hold held_bytes */
    double read_bytes_per_s;        /* cache-hit KV read back per second */
    double write_bytes_per_s;       /* new KV written per second, parity included */
    uint64_t servers_bandwidth;     /* servers needed to serve the reads */
    uint64_t servers;               /* max of the two */
    bool capacity_limited;          /* true: "capacity" is the limit; false: "bandwidth" */
    double window_state_bytes_per_request; /* one window state */
    double window_state_bytes_per_token;   /* spread over avg_request_tokens */
    double requests_per_day;        /* tokens_per_day / avg_request_tokens */
    double held_window_state_bytes; /* window states kept as long as their blocks */
    uint64_t servers_with_window_state; /* capacity servers for blocks + window states */
} store_plan_result;

/* Fills bytes_per_token and window_state_bytes with the figures of geometry g (V4.1-Flash with
 * nextn 5: kv_geometry_v41_flash(5) of common/model/config.h) and leaves every other field
 * zero. */
void store_plan_input_defaults(store_plan_input *in, const kv_geometry *g);

/* "capacity" or "bandwidth". */
const char *store_plan_limit_name(const store_plan_result *r);

/* Applies the formulas above. DI_EINVAL naming the field when a share or rate is outside
 * [0, 1], retention shares do not sum to 1 (within 1e-9), a size, count or speed is not
 * positive, or a number is not finite; DI_ERANGE when a result overflows (a figure is not
 * finite, or a server count passes 2^53). *out written only on success. */
di_status store_plan_compute(const store_plan_input *in, store_plan_result *out,
                             di_error *err);

#endif
