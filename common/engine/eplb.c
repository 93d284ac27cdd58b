#include "common/engine/eplb.h"

#include <assert.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

/* a < b by more than the tie tolerance. */
static bool clearly_less(double a, double b)
{
    return b - a > EPLB_TIE_REL * fmax(fabs(a), fabs(b));
}

static double cell(const eplb_window *w, uint32_t step, uint32_t expert)
{
    return w->load[(size_t)step * w->num_experts + expert];
}

static di_status check_window(const eplb_window *w, di_error *err)
{
    if (!w || !w->load)
        return di_fail(err, DI_EINVAL, "load window is NULL");
    if (w->num_steps == 0 || w->num_steps > EPLB_MAX_STEPS)
        return di_fail(err, DI_EINVAL, "load window has %u steps, need 1..%u", w->num_steps,
                       EPLB_MAX_STEPS);
    if (w->num_experts == 0 || w->num_experts > EPLB_MAX_EXPERTS)
        return di_fail(err, DI_EINVAL, "load window has %u experts, need 1..%u", w->num_experts,
                       EPLB_MAX_EXPERTS);
    if ((uint64_t)w->num_steps * w->num_experts > EPLB_MAX_WINDOW_CELLS)
        return di_fail(err, DI_EINVAL, "load window of %u steps x %u experts exceeds %u loads",
                       w->num_steps, w->num_experts, EPLB_MAX_WINDOW_CELLS);
    double total = 0.0;
    for (uint32_t s = 0; s < w->num_steps; s++)
        for (uint32_t e = 0; e < w->num_experts; e++) {
            double x = cell(w, s, e);
            if (!(isfinite(x) && x >= 0.0))
                return di_fail(err, DI_EINVAL, "load[%u][%u] = %g, must be finite and >= 0",
                               s, e, x);
            total += x;
        }
    if (!(total > 0.0) || !isfinite(total))
        return di_fail(err, DI_EINVAL,
                       "load window has no tokens (or too many): moe_lb is undefined");
    return DI_OK;
}

static di_status check_shape(uint32_t num_gpus, uint32_t slots_per_gpu, di_error *err)
{
    if (num_gpus == 0)
        return di_fail(err, DI_EINVAL, "num_gpus must be at least 1");
    if (slots_per_gpu == 0)
        return di_fail(err, DI_EINVAL, "slots_per_gpu must be at least 1");
    if ((uint64_t)num_gpus * slots_per_gpu > EPLB_MAX_SLOTS)
        return di_fail(err, DI_EINVAL, "%u GPUs x %u slots exceeds %u slots", num_gpus,
                       slots_per_gpu, EPLB_MAX_SLOTS);
    return DI_OK;
}

/* DI_EINVAL when a stage would take more than EPLB_MAX_WORK steps. */
static di_status check_work(const char *stage, uint64_t a, uint64_t b, uint64_t c, di_error *err)
{
    double work = (double)a * (double)b * (double)c;
    if (work > (double)EPLB_MAX_WORK)
        return di_fail(err, DI_EINVAL, "%s: %llu x %llu x %llu = %.3g steps of work, above the "
                       "%.3g this planner takes: use a shorter window or fewer slots", stage,
                       (unsigned long long)a, (unsigned long long)b, (unsigned long long)c, work,
                       (double)EPLB_MAX_WORK);
    return DI_OK;
}

static size_t layout_slots(const eplb_layout *l)
{
    return (size_t)l->num_gpus * l->slots_per_gpu;
}

di_status eplb_redundant_count(uint32_t num_experts, uint32_t min_redundant, uint32_t ep_size,
                               uint32_t *out, di_error *err)
{
    if (num_experts == 0)
        return di_fail(err, DI_EINVAL, "num_experts must be at least 1");
    if (ep_size == 0)
        return di_fail(err, DI_EINVAL, "ep_size must be at least 1");
    uint64_t total = (uint64_t)num_experts + min_redundant;
    uint64_t pad = (ep_size - total % ep_size) % ep_size;
    if (total + pad > EPLB_MAX_SLOTS)
        return di_fail(err, DI_EINVAL, "%llu slots exceed %u",
                       (unsigned long long)(total + pad), EPLB_MAX_SLOTS);
    *out = (uint32_t)(min_redundant + pad);
    return DI_OK;
}

di_status eplb_layout_init(eplb_layout *out, uint32_t num_gpus, uint32_t slots_per_gpu,
                           di_error *err)
{
    di_status st = check_shape(num_gpus, slots_per_gpu, err);
    if (st != DI_OK)
        return st;
    size_t n = (size_t)num_gpus * slots_per_gpu;
    int32_t *slots = malloc(n * sizeof(*slots));
    if (!slots)
        return di_fail(err, DI_ENOMEM, "out of memory for %zu expert slots", n);
    for (size_t i = 0; i < n; i++)
        slots[i] = EPLB_NO_EXPERT;
    *out = (eplb_layout){.num_gpus = num_gpus, .slots_per_gpu = slots_per_gpu,
                         .slot_expert = slots};
    return DI_OK;
}

void eplb_layout_free(eplb_layout *l)
{
    if (!l)
        return;
    free(l->slot_expert);
    memset(l, 0, sizeof(*l));
}

static di_status layout_clone(const eplb_layout *src, eplb_layout *out, di_error *err)
{
    eplb_layout l;
    di_status st = eplb_layout_init(&l, src->num_gpus, src->slots_per_gpu, err);
    if (st != DI_OK)
        return st;
    memcpy(l.slot_expert, src->slot_expert, layout_slots(src) * sizeof(int32_t));
    *out = l;
    return DI_OK;
}

di_status eplb_startup_layout(uint32_t num_experts, uint32_t num_gpus, uint32_t slots_per_gpu,
                              eplb_layout *out, di_error *err)
{
    if (num_experts == 0 || num_experts > EPLB_MAX_EXPERTS)
        return di_fail(err, DI_EINVAL, "num_experts %u outside 1..%u", num_experts,
                       EPLB_MAX_EXPERTS);
    di_status st = check_shape(num_gpus, slots_per_gpu, err);
    if (st != DI_OK)
        return st;
    if ((uint64_t)num_gpus * slots_per_gpu < num_experts)
        return di_fail(err, DI_EINVAL, "%u GPUs x %u slots cannot hold %u experts", num_gpus,
                       slots_per_gpu, num_experts);
    eplb_layout l;
    if ((st = eplb_layout_init(&l, num_gpus, slots_per_gpu, err)) != DI_OK)
        return st;
    for (size_t s = 0; s < layout_slots(&l); s++)
        l.slot_expert[s] = (int32_t)(s % num_experts);
    *out = l;
    return DI_OK;
}

/* Counts each expert's copies into cnt[num_experts] (zeroed here). */
static void count_copies(const eplb_layout *l, uint32_t num_experts, uint32_t *cnt)
{
    memset(cnt, 0, num_experts * sizeof(*cnt));
    for (size_t s = 0; s < layout_slots(l); s++)
        if (l->slot_expert[s] != EPLB_NO_EXPERT)
            cnt[l->slot_expert[s]]++;
}

di_status eplb_layout_check(const eplb_layout *l, uint32_t num_experts, bool allow_empty,
                            bool every_expert, di_error *err)
{
    if (!l || !l->slot_expert)
        return di_fail(err, DI_EINVAL, "layout is NULL");
    di_status st = check_shape(l->num_gpus, l->slots_per_gpu, err);
    if (st != DI_OK)
        return st;
    for (size_t s = 0; s < layout_slots(l); s++) {
        int32_t e = l->slot_expert[s];
        if (e == EPLB_NO_EXPERT && allow_empty)
            continue;
        if (e < 0 || (uint32_t)e >= num_experts)
            return di_fail(err, DI_EINVAL, "GPU %zu slot %zu holds expert %d, outside [0, %u)",
                           s / l->slots_per_gpu, s % l->slots_per_gpu, e, num_experts);
    }
    if (!every_expert)
        return DI_OK;
    uint32_t *cnt = malloc(num_experts * sizeof(*cnt));
    if (!cnt)
        return di_fail(err, DI_ENOMEM, "out of memory for %u experts", num_experts);
    count_copies(l, num_experts, cnt);
    for (uint32_t e = 0; e < num_experts; e++)
        if (cnt[e] == 0) {
            free(cnt);
            return di_fail(err, DI_EINVAL, "expert %u has no copy in the layout", e);
        }
    free(cnt);
    return DI_OK;
}

/* moe_lb with copy counts already known and checked. */
static double moe_lb_of(const eplb_window *w, const eplb_layout *l, const uint32_t *cnt)
{
    double sum_max = 0.0, sum_total = 0.0;
    for (uint32_t s = 0; s < w->num_steps; s++) {
        double step_max = 0.0;
        for (uint32_t g = 0; g < l->num_gpus; g++) {
            double gpu = 0.0;
            for (uint32_t k = 0; k < l->slots_per_gpu; k++) {
                int32_t e = l->slot_expert[(size_t)g * l->slots_per_gpu + k];
                if (e != EPLB_NO_EXPERT)
                    gpu += cell(w, s, (uint32_t)e) / cnt[e];
            }
            step_max = fmax(step_max, gpu);
            sum_total += gpu;
        }
        sum_max += step_max;
    }
    return sum_max / (sum_total / l->num_gpus);
}

di_status eplb_moe_lb(const eplb_window *w, const eplb_layout *l, double *out, di_error *err)
{
    di_status st = check_window(w, err);
    if (st != DI_OK || (st = eplb_layout_check(l, w->num_experts, true, false, err)) != DI_OK)
        return st;
    uint32_t *cnt = malloc(w->num_experts * sizeof(*cnt));
    if (!cnt)
        return di_fail(err, DI_ENOMEM, "out of memory for %u experts", w->num_experts);
    count_copies(l, w->num_experts, cnt);
    for (uint32_t e = 0; e < w->num_experts; e++) {
        if (cnt[e])
            continue;
        for (uint32_t s = 0; s < w->num_steps; s++)
            if (cell(w, s, e) > 0.0) {
                free(cnt);
                return di_fail(err, DI_EINVAL, "expert %u has tokens at step %u but no copy",
                               e, s);
            }
    }
    *out = moe_lb_of(w, l, cnt);
    free(cnt);
    return DI_OK;
}

/* ---- stage A ---------------------------------------------------------------------------- */

/* Per step: the hottest copy (value, expert) and the second hottest value. */
typedef struct step_top {
    double top1;   /* largest load per copy at this step */
    double top2;   /* largest among the other experts (0 when there is none) */
    uint32_t arg1; /* expert holding top1 (lowest id on ties) */
} step_top;

static void copy_tops(const eplb_window *w, const uint32_t *cnt, step_top *top)
{
    for (uint32_t s = 0; s < w->num_steps; s++) {
        step_top t = {0.0, 0.0, 0};
        for (uint32_t e = 0; e < w->num_experts; e++) {
            double x = cell(w, s, e) / cnt[e];
            if (e == 0 || x > t.top1) {
                if (e > 0)
                    t.top2 = t.top1;
                t.top1 = x;
                t.arg1 = e;
            } else if (x > t.top2) {
                t.top2 = x;
            }
        }
        top[s] = t;
    }
}

/* One stage-A round: the expert whose extra copy leaves the smallest summed hottest copy.
 * Only an expert that is the hottest at a step changes that step's hottest copy, so each
 * candidate's score is the current sum minus its own steps' reductions. */
static uint32_t best_copy_target(const eplb_window *w, const uint32_t *cnt, const step_top *top,
                                 double *score)
{
    double base = 0.0;
    for (uint32_t s = 0; s < w->num_steps; s++)
        base += top[s].top1;
    for (uint32_t e = 0; e < w->num_experts; e++)
        score[e] = base;
    for (uint32_t s = 0; s < w->num_steps; s++) {
        uint32_t e = top[s].arg1;
        double after = fmax(cell(w, s, e) / (cnt[e] + 1), top[s].top2);
        score[e] -= top[s].top1 - after;
    }
    uint32_t best = 0;
    for (uint32_t e = 1; e < w->num_experts; e++)
        if (clearly_less(score[e], score[best]))
            best = e;
    return best;
}

di_status eplb_replicate(const eplb_window *w, uint32_t redundant, uint32_t *copies,
                         di_error *err)
{
    di_status st = check_window(w, err);
    if (st != DI_OK)
        return st;
    if (!copies)
        return di_fail(err, DI_EINVAL, "copies output is NULL");
    if ((uint64_t)w->num_experts + redundant > EPLB_MAX_SLOTS)
        return di_fail(err, DI_EINVAL, "%u experts + %u redundant exceed %u slots",
                       w->num_experts, redundant, EPLB_MAX_SLOTS);
    if ((st = check_work("stage A (redundant x steps x experts)", redundant, w->num_steps,
                         w->num_experts, err)) != DI_OK)
        return st;
    uint32_t *cnt = malloc(w->num_experts * sizeof(*cnt));
    double *score = malloc(w->num_experts * sizeof(*score));
    step_top *top = malloc(w->num_steps * sizeof(*top));
    if (!cnt || !score || !top) {
        free(cnt);
        free(score);
        free(top);
        return di_fail(err, DI_ENOMEM, "out of memory for stage A");
    }
    for (uint32_t e = 0; e < w->num_experts; e++)
        cnt[e] = 1;
    for (uint32_t r = 0; r < redundant; r++) {
        copy_tops(w, cnt, top);
        cnt[best_copy_target(w, cnt, top, score)]++;
    }
    memcpy(copies, cnt, w->num_experts * sizeof(*cnt));
    free(cnt);
    free(score);
    free(top);
    return DI_OK;
}

/* ---- stage B ---------------------------------------------------------------------------- */

/* A copy to place: its expert and its load summed over the window. */
typedef struct placed_copy {
    double weight;   /* sum over steps of the expert's tokens / its copy count */
    uint32_t expert; /* logical expert */
} placed_copy;

static int cmp_heaviest(const void *pa, const void *pb)
{
    const placed_copy *a = pa, *b = pb;
    if (a->weight != b->weight)
        return a->weight > b->weight ? -1 : 1;
    return a->expert < b->expert ? -1 : (a->expert > b->expert);
}

/* Working state of stage B. */
typedef struct placer {
    const eplb_window *w;  /* the window */
    const uint32_t *cnt;   /* copies per expert */
    uint32_t num_gpus;     /* GPUs */
    uint32_t slots;        /* slots per GPU */
    double *gpu_load;      /* [num_gpus][num_steps] load placed so far */
    step_top *top;         /* per step: busiest GPU (arg1), its load, the runner-up load */
    uint32_t *fill;        /* [num_gpus] slots used */
} placer;

/* Summed busiest-GPU load if expert e's copy went to GPU g. */
static double place_score(const placer *p, uint32_t g, uint32_t e)
{
    const double *gl = p->gpu_load + (size_t)g * p->w->num_steps;
    double sum = 0.0;
    for (uint32_t s = 0; s < p->w->num_steps; s++) {
        double other = p->top[s].arg1 == g ? p->top[s].top2 : p->top[s].top1;
        sum += fmax(gl[s] + cell(p->w, s, e) / p->cnt[e], other);
    }
    return sum;
}

/* Adds expert e's copy to GPU g and updates the per-step busiest GPUs (loads only grow). */
static void place_on(placer *p, uint32_t g, uint32_t e, eplb_layout *l)
{
    l->slot_expert[(size_t)g * p->slots + p->fill[g]++] = (int32_t)e;
    double *gl = p->gpu_load + (size_t)g * p->w->num_steps;
    for (uint32_t s = 0; s < p->w->num_steps; s++) {
        gl[s] += cell(p->w, s, e) / p->cnt[e];
        step_top *t = &p->top[s];
        if (t->arg1 == g) {
            t->top1 = gl[s];
        } else if (gl[s] > t->top1) {
            t->top2 = t->top1;
            t->top1 = gl[s];
            t->arg1 = g;
        } else if (gl[s] > t->top2) {
            t->top2 = gl[s];
        }
    }
}

static void place_all(placer *p, const placed_copy *order, size_t n, eplb_layout *l)
{
    for (size_t i = 0; i < n; i++) {
        uint32_t e = order[i].expert;
        uint32_t best = UINT32_MAX;
        double best_score = 0.0;
        for (uint32_t g = 0; g < p->num_gpus; g++) {
            if (p->fill[g] == p->slots)
                continue;
            double sc = place_score(p, g, e);
            if (best == UINT32_MAX || clearly_less(sc, best_score)) {
                best = g;
                best_score = sc;
            }
        }
        assert(best != UINT32_MAX); /* copies == slots, so a GPU has room */
        place_on(p, best, e, l);
    }
}

static di_status check_copies(const eplb_window *w, const uint32_t *copies, uint64_t slots,
                              di_error *err)
{
    if (!copies)
        return di_fail(err, DI_EINVAL, "copies is NULL");
    uint64_t total = 0;
    for (uint32_t e = 0; e < w->num_experts; e++) {
        if (copies[e] == 0)
            return di_fail(err, DI_EINVAL, "expert %u has 0 copies, needs at least 1", e);
        total += copies[e];
    }
    if (total != slots)
        return di_fail(err, DI_EINVAL, "%llu copies for %llu slots",
                       (unsigned long long)total, (unsigned long long)slots);
    return DI_OK;
}

di_status eplb_place(const eplb_window *w, const uint32_t *copies, uint32_t num_gpus,
                     uint32_t slots_per_gpu, eplb_layout *out, di_error *err)
{
    di_status st = check_window(w, err);
    if (st != DI_OK || (st = check_shape(num_gpus, slots_per_gpu, err)) != DI_OK)
        return st;
    size_t n = (size_t)num_gpus * slots_per_gpu;
    if ((st = check_copies(w, copies, n, err)) != DI_OK ||
        (st = check_work("stage B (slots x GPUs x steps)", n, num_gpus, w->num_steps, err)) !=
            DI_OK)
        return st;
    if (!out)
        return di_fail(err, DI_EINVAL, "layout output is NULL");
    eplb_layout l;
    if ((st = eplb_layout_init(&l, num_gpus, slots_per_gpu, err)) != DI_OK)
        return st;
    placer p = {.w = w, .cnt = copies, .num_gpus = num_gpus, .slots = slots_per_gpu};
    placed_copy *order = malloc(n * sizeof(*order));
    p.gpu_load = calloc((size_t)num_gpus * w->num_steps, sizeof(double));
    p.top = calloc(w->num_steps, sizeof(step_top));
    p.fill = calloc(num_gpus, sizeof(uint32_t));
    if (!order || !p.gpu_load || !p.top || !p.fill) {
        st = di_fail(err, DI_ENOMEM, "out of memory for stage B");
        goto done;
    }
    size_t k = 0;
    for (uint32_t e = 0; e < w->num_experts; e++) {
        double sum = 0.0;
        for (uint32_t s = 0; s < w->num_steps; s++)
            sum += cell(w, s, e);
        for (uint32_t c = 0; c < copies[e]; c++)
            order[k++] = (placed_copy){.weight = sum / copies[e], .expert = e};
    }
    qsort(order, n, sizeof(*order), cmp_heaviest);
    place_all(&p, order, n, &l);
    *out = l;
    l.slot_expert = NULL;
done:
    eplb_layout_free(&l);
    free(order);
    free(p.gpu_load);
    free(p.top);
    free(p.fill);
    return st;
}

di_status eplb_plan(const eplb_window *w, uint32_t num_gpus, uint32_t slots_per_gpu,
                    eplb_layout *out, di_error *err)
{
    di_status st = check_window(w, err);
    if (st != DI_OK || (st = check_shape(num_gpus, slots_per_gpu, err)) != DI_OK)
        return st;
    uint64_t slots = (uint64_t)num_gpus * slots_per_gpu;
    if (slots < w->num_experts)
        return di_fail(err, DI_EINVAL, "%u GPUs x %u slots cannot hold %u experts", num_gpus,
                       slots_per_gpu, w->num_experts);
    uint32_t *copies = malloc(w->num_experts * sizeof(*copies));
    if (!copies)
        return di_fail(err, DI_ENOMEM, "out of memory for %u experts", w->num_experts);
    st = eplb_replicate(w, (uint32_t)(slots - w->num_experts), copies, err);
    if (st == DI_OK)
        st = eplb_place(w, copies, num_gpus, slots_per_gpu, out, err);
    free(copies);
    return st;
}

/* The window, then a layout in use (every expert, no empty slot), named in the message. */
static di_status check_in_use(const eplb_window *w, const eplb_layout *l, const char *name,
                              di_error *err)
{
    di_status st = check_window(w, err);
    if (st == DI_OK && (st = eplb_layout_check(l, w->num_experts, false, true, err)) != DI_OK)
        di_error_prefix(err, "%s layout: ", name);
    return st;
}

di_status eplb_rebalance(const eplb_window *w, const eplb_layout *current, eplb_decision *out,
                         di_error *err)
{
    di_status st = check_in_use(w, current, "current", err);
    if (st != DI_OK)
        return st;
    if (!out)
        return di_fail(err, DI_EINVAL, "decision output is NULL");
    eplb_layout plan = {0}, chosen = {0};
    double lb_cur = 0.0, lb_plan = 0.0;
    if ((st = eplb_plan(w, current->num_gpus, current->slots_per_gpu, &plan, err)) != DI_OK)
        return st;
    if ((st = eplb_moe_lb(w, current, &lb_cur, err)) != DI_OK ||
        (st = eplb_moe_lb(w, &plan, &lb_plan, err)) != DI_OK)
        goto fail;
    bool keep = !clearly_less(lb_plan, lb_cur);
    if (keep) {
        if ((st = layout_clone(current, &chosen, err)) != DI_OK)
            goto fail;
        eplb_layout_free(&plan);
    } else {
        chosen = plan;
    }
    *out = (eplb_decision){.layout = chosen, .moe_lb_current = lb_cur, .moe_lb_plan = lb_plan,
                           .kept_current = keep};
    return DI_OK;
fail:
    eplb_layout_free(&plan);
    return st;
}

di_status eplb_judge(const eplb_window *w, const eplb_layout *applied,
                     const eplb_layout *previous, bool was_revert, eplb_verdict *out,
                     di_error *err)
{
    di_status st = check_in_use(w, applied, "applied", err);
    if (st != DI_OK || (st = check_in_use(w, previous, "previous", err)) != DI_OK)
        return st;
    if (applied->num_gpus != previous->num_gpus ||
        applied->slots_per_gpu != previous->slots_per_gpu)
        return di_fail(err, DI_EINVAL,
                       "applied layout of %u x %u slots, previous layout of %u x %u",
                       applied->num_gpus, applied->slots_per_gpu, previous->num_gpus,
                       previous->slots_per_gpu);
    if (!out)
        return di_fail(err, DI_EINVAL, "verdict output is NULL");
    double lb_applied = 0.0, lb_previous = 0.0;
    if ((st = eplb_moe_lb(w, applied, &lb_applied, err)) != DI_OK ||
        (st = eplb_moe_lb(w, previous, &lb_previous, err)) != DI_OK)
        return st;
    *out = (eplb_verdict){.moe_lb_applied = lb_applied, .moe_lb_previous = lb_previous,
                          .revert = !was_revert && clearly_less(lb_previous, lb_applied)};
    return DI_OK;
}

void eplb_decision_free(eplb_decision *d)
{
    if (!d)
        return;
    eplb_layout_free(&d->layout);
    memset(d, 0, sizeof(*d));
}
