/* The subcommands of di-plan: one row each. --help and key checking are generated from here. */
#include "tools/plan/plan_cmd.h"

const plan_command plan_commands[] = {
    {
        .name = "eplb",
        .help = "place experts on GPUs from a load window; keep the current layout unless the "
                "plan is better",
        .inputs = (const plan_key[]){
            {"num_gpus", true, "GPUs in the expert-parallel group (>= 1)"},
            {"slots_per_gpu", true, "expert slots per GPU (>= 1); GPUs x slots >= experts"},
            {"load", true, "[[tokens per expert] per step]: the window; every step lists "
                           "every expert, tokens >= 0"},
            {"current", false, "[[expert id per slot] per GPU]: the layout in use (default: "
                               "the start-up layout, copies to experts 0, 1, 2, ...)"},
            {NULL, false, NULL},
        },
        .outputs = "gpus (layout to use), moe_lb_current, moe_lb_plan, kept_current",
        .example = "{\"num_gpus\": 2, \"slots_per_gpu\": 3, \"load\": [[3, 2, 6, 1]]}",
        .run = plan_cmd_eplb,
    },
    {
        .name = "varlen",
        .help = "choose how many drafts each request checks (MTP varlen greedy scan)",
        .inputs = (const plan_key[]){
            {"confidences", true, "[[cumulative acceptance chance per draft] per request], "
                                  "each in [0, 1], non-increasing within a request"},
            {"step_ms", true, "{\"<graph rows>\": ms, ...}: measured step time per graph "
                              "size; a step uses the smallest size that fits"},
            {"sampler_ms", true, "sampler time per step (ms, >= 0)"},
            {NULL, false, NULL},
        },
        .outputs = "rows, drafts (per request), graph_rows, expected_tokens, step_ms, "
                   "tokens_per_ms",
        .example = "{\"confidences\": [[0.9, 0.6], [0.5]], \"step_ms\": {\"2\": 6.0, \"4\": 6.2},"
                   " \"sampler_ms\": 0.2}",
        .run = plan_cmd_varlen,
    },
    {
        .name = "graphs",
        .help = "list the recorded-graph sizes of a decode configuration",
        .inputs = (const plan_key[]){
            {"max_num_seqs", true, "running requests per rank (>= 1)"},
            {"nextn", true, "drafts per request (0..64)"},
            {"interval", false, "powers of two up to it, then its multiples (default 8)"},
            {NULL, false, NULL},
        },
        .outputs = "sizes, max_rows",
        .example = "{\"max_num_seqs\": 4, \"nextn\": 5}",
        .run = plan_cmd_graphs,
    },
    {
        .name = "store",
        .help = "size the shared KV store: bytes held, servers for capacity and for reads",
        .inputs = (const plan_key[]){
            {"tokens_per_day", true, "tokens served per day, input and output"},
            {"input_share", true, "fraction of tokens that are input, [0, 1]"},
            {"input_hit_rate", true, "fraction of input tokens found in the store, [0, 1]"},
            {"store_decode_kv", true, "true when output tokens' KV is stored too"},
            {"retention", true, "[{\"share\", \"days\"}, ...]: shares sum to 1"},
            {"bytes_per_token", false, "KV bytes per token (default 891, V4.1-Flash)"},
            {"avg_request_tokens", true, "mean tokens per request"},
            {"server", true, "{\"ssds\", \"ssd_tb\", \"read_gb_s\", \"ec_data\", "
                             "\"ec_parity\"}: one storage server (TB, GB decimal)"},
            {"window_state_bytes", false, "bytes of one window state (default 1501184, "
                                          "V4.1-Flash stored region, nextn 5)"},
            {NULL, false, NULL},
        },
        .outputs = "held_tokens, held_bytes, servers_capacity, servers_bandwidth, servers, "
                   "limit, window_state_bytes_per_request, window_state_bytes_per_token, ...",
        .example = "{\"tokens_per_day\": 155e12, \"input_share\": 0.9, \"input_hit_rate\": 0.8, "
                   "\"store_decode_kv\": true, \"retention\": [{\"share\": 0.6, \"days\": 3}, "
                   "{\"share\": 0.4, \"days\": 7}], \"avg_request_tokens\": 20000, \"server\": "
                   "{\"ssds\": 20, \"ssd_tb\": 30.73, \"read_gb_s\": 40, \"ec_data\": 10, "
                   "\"ec_parity\": 2}}",
        .run = plan_cmd_store,
    },
    {
        .name = "kv",
        .help = "KV sizes of a model: block and per-token bytes, state slot, window state, "
                "blocks per request",
        .inputs = (const plan_key[]){
            {"config", false, "a shipped config name (v41-flash, tiny, small, demo), a config.json "
                              "path or model directory, or an inline config object (default "
                              "v41-flash)"},
            {"nextn", false, "drafts per decode step (0..64, default 5): ring = window + "
                             "max(backtracking, nextn + 1)"},
            {"backtracking", false, "extra ring positions kept for rollback (default 0)"},
            {"tokens", false, "a request length or a list of them (tokens)"},
            {NULL, false, NULL},
        },
        .outputs = "block_bytes, bytes_per_token, ring_positions, state_slot_bytes, "
                   "window_state_bytes, requests [{tokens, blocks, paged_kv_bytes, ...}], ...",
        .example = "{\"config\": \"v41-flash\", \"tokens\": [16389, 50000]}",
        .run = plan_cmd_kv,
    },
};

const size_t plan_num_commands = sizeof(plan_commands) / sizeof(plan_commands[0]);
