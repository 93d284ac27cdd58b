/* di-plan graphs: the recorded-graph sizes for a decode configuration. */
#include "common/engine/graphs.h"
#include "common/util/json_read.h"
#include "tools/plan/plan_cmd.h"

di_status plan_cmd_graphs(const json_t *in, json_t **out, di_error *err)
{
    int64_t seqs = 0, nextn = 0, interval = 8;
    di_status st;
    if ((st = di_json_int_range(in, "max_num_seqs", 1, 1 << 20, &seqs, err)) ||
        (st = di_json_int_range(in, "nextn", 0, 64, &nextn, err)) ||
        (st = di_json_int_range_opt(in, "interval", 1, 1 << 20, &interval, err)))
        return st;
    graph_sizes g;
    if ((st = graph_sizes_init(&g, (uint32_t)seqs, (uint32_t)nextn, (uint32_t)interval, err)))
        return st;
    json_t *o = json_object();
    st = o ? DI_OK : di_fail(err, DI_ENOMEM, "out of memory building the output");
    if (st || (st = plan_set(o, "sizes", plan_u32_array(g.sizes, g.count), err)) ||
        (st = plan_set(o, "max_rows", json_integer(g.max_rows), err)))
        json_decref(o);
    else
        *out = o;
    graph_sizes_free(&g);
    return st;
}
