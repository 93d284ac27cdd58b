/* di-plan kv: KV sizes of a model config: block and per-token bytes, state slot, window state,
 * and for each request length its blocks and paged KV bytes. */
#include <inttypes.h>
#include <stdio.h>

#include "common/model/config.h"
#include "common/kvfmt/kv_layout.h"
#include "common/util/json_read.h"
#include "tools/plan/plan_cmd.h"

/* The config: a shipped name or a path (string), or an inline config object. */
static di_status read_config(const json_t *in, model_config *cfg, di_error *err)
{
    const json_t *c = json_object_get(in, "config");
    if (!c || json_is_null(c))
        return model_config_builtin("v41-flash", cfg, err);
    di_status st;
    if (json_is_string(c))
        st = model_config_resolve(json_string_value(c), cfg, err);
    else if (json_is_object(c))
        st = model_config_from_json(c, "inline", cfg, err);
    else
        return di_fail(err, DI_EINVAL, "key 'config': expected a name, a path or an object, got %s",
                       di_json_type_name(c));
    if (st)
        di_error_prefix(err, "key 'config': ");
    return st;
}

/* "tokens": one length or a list of lengths, each in [0, max_position_embeddings]. */
static di_status read_lengths(const json_t *in, uint64_t limit, uint64_t **out, size_t *n,
                              di_error *err)
{
    const json_t *t = json_object_get(in, "tokens");
    if (!t || json_is_null(t)) {
        *out = NULL;
        *n = 0;
        return DI_OK;
    }
    size_t count = json_is_array(t) ? json_array_size(t) : 1;
    uint64_t *v = calloc(count ? count : 1, sizeof(*v));
    if (!v)
        return di_fail(err, DI_ENOMEM, "out of memory for %zu lengths", count);
    for (size_t i = 0; i < count; i++) {
        const json_t *x = json_is_array(t) ? json_array_get(t, i) : t;
        if (!json_is_integer(x) || json_integer_value(x) < 0 ||
            (uint64_t)json_integer_value(x) > limit) {
            free(v);
            return di_fail(err, DI_EINVAL,
                           "key 'tokens'%s: expected an integer in [0, %" PRIu64 "]",
                           json_is_array(t) ? "[i]" : "", limit);
        }
        v[i] = (uint64_t)json_integer_value(x);
    }
    *out = v;
    *n = count;
    return DI_OK;
}

/* Every request's paged KV bytes fit a JSON integer (int64): DI_ERANGE naming the length
 * otherwise. */
static di_status check_lengths(const kv_geometry *g, const uint64_t *lens, size_t n,
                               di_error *err)
{
    uint64_t block = kv_block_bytes(g);
    for (size_t i = 0; i < n; i++)
        if (kv_blocks_for_tokens(g, lens[i]) > (uint64_t)INT64_MAX / block)
            return di_fail(err, DI_ERANGE, "key 'tokens': %" PRIu64 " tokens need more than "
                           "2^63 bytes of paged KV in %" PRIu64 "-byte blocks", lens[i], block);
    return DI_OK;
}

static json_t *request_row(const kv_geometry *g, uint64_t tokens)
{
    uint64_t blocks = kv_blocks_for_tokens(g, tokens);
    json_t *r = json_object();
    if (!r)
        return NULL;
    json_object_set_new(r, "tokens", json_integer((json_int_t)tokens));
    json_object_set_new(r, "blocks", json_integer((json_int_t)blocks));
    json_object_set_new(r, "paged_kv_bytes", json_integer((json_int_t)(blocks * kv_block_bytes(g))));
    json_object_set_new(r, "state_slot_bytes", json_integer((json_int_t)kv_state_slot_bytes(g)));
    /* the next token (position = tokens) lands in this ring slot of every layer */
    json_object_set_new(r, "next_ring_slot", json_integer(kv_ring_slot(g, tokens)));
    return r;
}

di_status plan_cmd_kv(const json_t *in, json_t **out, di_error *err)
{
    int64_t nextn = 5, backtracking = 0;
    di_status st;
    if ((st = di_json_int_range_opt(in, "nextn", 0, 64, &nextn, err)) ||
        (st = di_json_int_range_opt(in, "backtracking", 0, 1 << 16, &backtracking, err)))
        return st;
    model_config cfg;
    if ((st = read_config(in, &cfg, err)))
        return st;
    kv_geometry g;
    model_config_kv_geometry(&cfg, (uint32_t)nextn, &g);
    g.ring_positions = kv_ring_positions_for(g.window, (uint32_t)nextn, (uint32_t)backtracking);
    uint64_t *lens = NULL;
    size_t n = 0;
    if ((st = read_lengths(in, cfg.max_position_embeddings, &lens, &n, err)))
        return st;
    if ((st = check_lengths(&g, lens, n, err))) {
        free(lens);
        return st;
    }

    json_t *o = json_object(), *reqs = json_array();
    if (!o || !reqs) {
        json_decref(o);
        json_decref(reqs);
        free(lens);
        return di_fail(err, DI_ENOMEM, "out of memory building the output");
    }
    st = DI_OK;
    for (size_t i = 0; !st && i < n; i++)
        st = plan_set_append(reqs, request_row(&g, lens[i]), err);
    char id[24];
    snprintf(id, sizeof(id), "0x%016" PRIx64, g.model_id);
    double per_token = (double)kv_block_bytes(&g) / g.block_tokens;
    if (st || (st = plan_set(o, "model", json_string(cfg.name), err)) ||
        (st = plan_set(o, "model_id", json_string(id), err)) ||
        (st = plan_set(o, "nextn", json_integer(nextn), err)) ||
        (st = plan_set(o, "block_tokens", json_integer(g.block_tokens), err)) ||
        (st = plan_set(o, "block_bytes", json_integer((json_int_t)kv_block_bytes(&g)), err)) ||
        (st = plan_set(o, "block_header_bytes", json_integer(KV_HEADER_BYTES), err)) ||
        (st = plan_set(o, "bytes_per_token", json_real(per_token), err)) ||
        (st = plan_set(o, "main_entry_bytes", json_integer((json_int_t)kv_main_entry_bytes(&g)), err)) ||
        (st = plan_set(o, "index_entry_bytes", json_integer((json_int_t)kv_index_entry_bytes(&g)), err)) ||
        (st = plan_set(o, "ring_positions", json_integer(g.ring_positions), err)) ||
        (st = plan_set(o, "ring_entry_bytes", json_integer((json_int_t)kv_ring_entry_bytes(&g)), err)) ||
        (st = plan_set(o, "ring_bytes_per_layer", json_integer((json_int_t)kv_ring_bytes(&g)), err)) ||
        (st = plan_set(o, "compressor_state_bytes",
                       json_integer((json_int_t)kv_compressor_state_bytes(&g)), err)) ||
        (st = plan_set(o, "state_slot_bytes", json_integer((json_int_t)kv_state_slot_bytes(&g)), err)) ||
        (st = plan_set(o, "window_state_bytes",
                       json_integer((json_int_t)kv_window_state_bytes(&g)), err)) ||
        (st = plan_set(o, "window_state_stored_layers", json_integer(g.yoco_boundary), err))) {
        json_decref(reqs);
        json_decref(o);
    } else if ((st = plan_set(o, "requests", reqs, err))) /* takes reqs either way */
        json_decref(o);
    else
        *out = o;
    free(lens);
    return st;
}
