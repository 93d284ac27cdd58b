/* di-plan eplb: plan an expert placement from a load window and decide whether to apply it. */
#include <math.h>
#include <stdlib.h>

#include "common/engine/eplb.h"
#include "common/util/json_read.h"
#include "tools/plan/plan_cmd.h"

/* The parsed input. */
typedef struct eplb_args {
    int64_t num_gpus;      /* GPUs in the EP group */
    int64_t slots_per_gpu; /* expert slots per GPU */
    plan_matrix load;      /* [steps][experts] tokens */
    plan_matrix current;   /* [gpus][slots] expert ids; rows == 0 when absent */
} eplb_args;

static void args_free(eplb_args *a)
{
    plan_matrix_free(&a->load);
    plan_matrix_free(&a->current);
}

/* Reads "current" and checks it against the shape and the expert count. */
static di_status read_current(const json_t *in, eplb_args *a, uint32_t experts, di_error *err)
{
    di_status st = plan_read_matrix(in, "current", 0, experts - 1.0, false, &a->current, err);
    if (st != DI_OK)
        return st;
    if (a->current.rows != (size_t)a->num_gpus)
        return di_fail(err, DI_EINVAL, "key 'current': %zu GPUs, but num_gpus is %lld",
                       a->current.rows, (long long)a->num_gpus);
    for (size_t g = 0; g < a->current.rows; g++)
        if (a->current.row_len[g] != (size_t)a->slots_per_gpu)
            return di_fail(err, DI_EINVAL, "key 'current'[%zu]: %zu slots, but slots_per_gpu "
                           "is %lld", g, a->current.row_len[g], (long long)a->slots_per_gpu);
    return plan_matrix_int_check(&a->current, "current", 0, experts - 1.0, err);
}

static di_status read_args(const json_t *in, eplb_args *a, di_error *err)
{
    di_status st;
    if ((st = di_json_int_range(in, "num_gpus", 1, EPLB_MAX_SLOTS, &a->num_gpus, err)) ||
        (st = di_json_int_range(in, "slots_per_gpu", 1, EPLB_MAX_SLOTS, &a->slots_per_gpu,
                                err)) ||
        (st = plan_read_matrix(in, "load", 0, INFINITY, true, &a->load, err)))
        return st;
    uint64_t slots = (uint64_t)a->num_gpus * (uint64_t)a->slots_per_gpu;
    size_t experts = a->load.row_len[0];
    if (slots > EPLB_MAX_SLOTS)
        return di_fail(err, DI_EINVAL, "num_gpus x slots_per_gpu = %llu slots, more than %u",
                       (unsigned long long)slots, EPLB_MAX_SLOTS);
    if (experts > EPLB_MAX_EXPERTS || a->load.rows > EPLB_MAX_STEPS)
        return di_fail(err, DI_EINVAL, "key 'load': %zu steps x %zu experts, at most %u x %u",
                       a->load.rows, experts, EPLB_MAX_STEPS, EPLB_MAX_EXPERTS);
    if (slots < experts)
        return di_fail(err, DI_EINVAL, "num_gpus x slots_per_gpu = %llu slots cannot hold the "
                       "%zu experts of key 'load'", (unsigned long long)slots, experts);
    json_t *cur = json_object_get(in, "current");
    if (cur && !json_is_null(cur))
        return read_current(in, a, (uint32_t)experts, err);
    return DI_OK;
}

/* The current layout: "current" when given, else the start-up layout. */
static di_status current_layout(const eplb_args *a, uint32_t experts, eplb_layout *out,
                                di_error *err)
{
    if (a->current.rows == 0)
        return eplb_startup_layout(experts, (uint32_t)a->num_gpus, (uint32_t)a->slots_per_gpu,
                                   out, err);
    di_status st = eplb_layout_init(out, (uint32_t)a->num_gpus, (uint32_t)a->slots_per_gpu, err);
    if (st != DI_OK)
        return st;
    for (size_t s = 0; s < a->current.total; s++)
        out->slot_expert[s] = (int32_t)a->current.vals[s];
    return DI_OK;
}

static json_t *layout_json(const eplb_layout *l)
{
    json_t *gpus = json_array();
    for (uint32_t g = 0; gpus && g < l->num_gpus; g++) {
        json_t *row = json_array();
        for (uint32_t k = 0; row && k < l->slots_per_gpu; k++)
            if (json_array_append_new(
                    row, json_integer(l->slot_expert[(size_t)g * l->slots_per_gpu + k])))
                json_decref(row), row = NULL;
        if (!row || json_array_append_new(gpus, row))
            json_decref(gpus), gpus = NULL;
    }
    return gpus;
}

static di_status decision_json(const eplb_decision *d, json_t **out, di_error *err)
{
    json_t *o = json_object();
    if (!o)
        return di_fail(err, DI_ENOMEM, "out of memory building the output");
    di_status st;
    if ((st = plan_set(o, "gpus", layout_json(&d->layout), err)) ||
        (st = plan_set(o, "moe_lb_current", json_real(d->moe_lb_current), err)) ||
        (st = plan_set(o, "moe_lb_plan", json_real(d->moe_lb_plan), err)) ||
        (st = plan_set(o, "kept_current", json_boolean(d->kept_current), err))) {
        json_decref(o);
        return st;
    }
    *out = o;
    return DI_OK;
}

di_status plan_cmd_eplb(const json_t *in, json_t **out, di_error *err)
{
    eplb_args a = {0};
    eplb_layout cur = {0};
    eplb_decision d = {0};
    di_status st = read_args(in, &a, err);
    if (st != DI_OK)
        goto done;
    uint32_t experts = (uint32_t)a.load.row_len[0];
    eplb_window w = {.load = a.load.vals, .num_steps = (uint32_t)a.load.rows,
                     .num_experts = experts};
    if ((st = current_layout(&a, experts, &cur, err)) != DI_OK ||
        (st = eplb_rebalance(&w, &cur, &d, err)) != DI_OK)
        goto done;
    st = decision_json(&d, out, err);
done:
    eplb_decision_free(&d);
    eplb_layout_free(&cur);
    args_free(&a);
    return st;
}
