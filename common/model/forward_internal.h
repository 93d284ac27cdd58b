/* forward_internal.h: the structs shared by forward.c, forward_blocks.c and draft.c (not a
 * public header). */
#ifndef DI_MODEL_FORWARD_INTERNAL_H
#define DI_MODEL_FORWARD_INTERNAL_H

#include <stdbool.h>
#include <stdint.h>

#include "common/model/forward.h"

/* Weight pointers of one layer or draft stage, as the ops take them. On a host backend: bf16/f32
 * vectors and matrices naturally aligned (copied when the checkpoint's are not), FP8/FP4 bytes
 * in place. On a device backend (kern_backend.device_memory): every one a copy in backend
 * memory (fwd_model.dev_chunks); the host views are not read after fwd_model_create. */
typedef struct fwd_site_w {
    const float *fn;                 /* [24, hc*D] */
    const float *base;               /* [24] */
    const float *scale;              /* [3] */
} fwd_site_w;

typedef struct fwd_layer_w {
    uint32_t id;                     /* backbone layer, or n_layers + stage */
    const model_layer_role *role;
    const uint16_t *attn_norm, *ffn_norm;          /* [D] */
    fwd_site_w hc_attn, hc_ffn;
    /* attention */
    const uint8_t *wq_a, *wq_a_s;                  /* [qlr, D] FP8 */
    const uint16_t *q_norm;                        /* [qlr] */
    const uint8_t *wq_b, *wq_b_s;                  /* [H*hd, qlr] FP8 */
    const uint8_t *wkv, *wkv_s;                    /* [hd, D] FP8 */
    const uint16_t *kv_norm;                       /* [hd] */
    const uint16_t *wo_a;                          /* [G*olr, H*hd/G] BF16 */
    const uint8_t *wo_b, *wo_b_s;                  /* [D, G*olr] FP8 */
    const float *sink;                             /* [H] */
    /* compressor (KV sources) */
    const uint16_t *c_wkv, *c_wgate, *c_norm;      /* [hd, D], [hd, D] (ratio > 1), [hd] */
    /* indexer */
    const uint8_t *i_wq_b, *i_wq_b_s;              /* [ih*id, qlr] FP8 */
    const uint16_t *i_wproj;                       /* [ih, D] */
    const uint16_t *i_wk, *i_knorm;                /* [id, hd], [id] (key owners) */
    /* MoE */
    uint32_t n_experts, top_k;
    const uint16_t *gate;                          /* [E, D] */
    const float *gate_bias;                        /* [E] */
    kern_expert *experts;                          /* [E] FP4 (owned array) */
    kern_expert shared;                            /* FP8 */
    /* Engram in front of the layer */
    int32_t engram_slot;                           /* -1 none */
    const model_engram_weights *engram;
    const uint8_t *e_wkv, *e_wkv_s;                /* [(hc+1)*D, cols*width] FP8 */
    const uint16_t *e_q, *e_k;                     /* [hc, D] */
    const uint8_t *e_table, *e_table_s;            /* [rows, width] E4M3, [rows, width/32];
                                                      NULL when seeded */
} fwd_layer_w;

struct fwd_model {
    const model_weights *w;          /* not owned */
    const model_config *cfg;         /* &w->config */
    const kern_backend *be;          /* not owned */
    fwd_options opt;                 /* copied; token_map replaced by tmap */
    kv_geometry geom;                /* ring = window + nextn + 1 */
    fwd_layer_w *layers;             /* [n_layers + n_mtp] */
    int32_t *tmap;                   /* [vocab] Engram compressed ids (owned) */
    int32_t engram_pad;              /* tmap[engram_pad_id] */
    uint64_t *e_mult, *e_primes, *e_offsets; /* Engram constants, flat [n_eng, ...] */
    /* model-level weights */
    const uint16_t *embed, *head, *norm;           /* [V, D], [V, D], [D] */
    const uint8_t *main_proj, *main_proj_s;        /* draft stage 0: [D, taps*D] FP8 */
    const uint16_t *main_norm, *draft_norm;        /* [D] */
    const uint16_t *markov_embed, *markov_head;    /* [V, rank] */
    const uint16_t *conf_proj;                     /* [1, D + rank] */
    double index_w_scale;            /* index_head_dim^-0.5 * index_n_heads^-0.5 */
    /* copies made for alignment or format */
    void **owned;
    uint32_t n_owned, cap_owned;
    /* device backends (kern_backend.device_memory): every weight the ops read, copied into
     * chunks of backend memory */
    void **dev_chunks;
    uint32_t n_dev_chunks, cap_dev_chunks;
    size_t dev_used, dev_cap;                      /* bytes used / held in the last chunk */
};

/* Which rows are live and where they sit: changes once per step at YOCO compaction. */
typedef struct fwd_rows {
    uint32_t n;                      /* rows */
    uint32_t n_live;                 /* rows before the placeholder rows (the last n - n_live) */
    int64_t *pos;                    /* [n] positions (host) */
    int32_t *row_seq;                /* [n] sequence of each row (host) */
    int32_t *src;                    /* [n] row index in the step as submitted (host) */
    kern_seq *seqs;                  /* [n_seqs] (host) */
    int64_t *keep;                   /* [n_seqs] YOCO keep-window start (0 = keep all) */
    uint32_t n_seqs;
} fwd_rows;

struct fwd_run {
    fwd_model *m;
    uint32_t max_rows;               /* T at most */
    /* residual stream and mixing coefficients (backend memory) */
    uint16_t *h, *h2;                /* [T, hc, D] current stream and the expand target */
    float *pre;                      /* [T, hc] carried pre-mix */
    float *a_pre, *a_post, *a_comb;  /* attention site [T, hc], [T, hc], [T, hc, hc] */
    float *f_pre, *f_post, *f_comb;  /* FFN site */
    float *onehot;                   /* [hc] = (1, 0, ...) */
    float *mean_pre;                 /* [hc] = 1/hc each */
    uint16_t *x;                     /* [T, D] normed sublayer input */
    uint16_t *y;                     /* [T, D] sublayer output */
    /* attention */
    uint16_t *qr;                    /* [T, qlr] */
    uint16_t *q;                     /* [T, H, hd] */
    uint16_t *kv;                    /* [T, hd] */
    uint8_t *local;                  /* [T, ring entry] */
    uint16_t *o;                     /* [T, H, hd] */
    uint16_t *z;                     /* [T, G*olr] */
    /* compressor */
    float *ca, *cg;                  /* [T, hd] */
    uint16_t *latent, *cmain;        /* [T, hd] */
    uint16_t *ckey;                  /* [T, id] */
    /* indexer */
    uint16_t *iq;                    /* [T, ih, id] */
    uint16_t *iw;                    /* [T, ih] */
    float *scores;                   /* [T, scores_stride] */
    size_t scores_stride;            /* entries per row of the current scores */
    size_t scores_cap;               /* allocated floats */
    uint8_t *cand;                   /* [T, cand_stride] candidate blocks of the publisher */
    size_t cand_stride;
    int32_t *topk;                   /* [T, index_topk] the band's current top-k lists */
    /* MoE */
    float *glog;                     /* [T, max experts] */
    int32_t *eids;                   /* [T, max top-k] */
    float *ew;                       /* [T, max top-k] */
    /* Engram */
    int64_t *hash;                   /* [T, n_eng, cols] */
    uint16_t *erows;                 /* [T, cols*width] */
    uint16_t *ekv;                   /* [T, (hc+1)*D] */
    /* draft taps and the draft's main input */
    uint16_t *taps;                  /* [T, n_taps*D] */
    uint16_t *mx;                    /* [T, D] */
    /* final rows */
    uint16_t *hfin;                  /* [T, D] */
    uint16_t *hsel;                  /* [T, D] rows whose logits are wanted */
    float *logits;                   /* [logits_rows, V] head output, grown on demand */
    uint32_t logits_rows;
    /* host metadata */
    fwd_rows rows, rows2;            /* live rows; rows2 is the compaction target */
    int32_t *nvis;                   /* [T] visible compressed entries */
    int32_t *emit_row;               /* [T] rows completing a compressed group */
    int64_t *emit_id;                /* [T] their entry ids */
    int64_t *emit_pos;               /* [T] their RoPE positions j*r */
    int32_t *emit_seq;               /* [T] their sequences */
    int32_t *ids;                    /* [T] token ids in row order */
    const int32_t *ids_dev;          /* [T] fwd_step.ids_dev of the step running, or NULL */
    int32_t *sel;                    /* [T] rows gathered for the head */
};

/* ---- shared helpers (forward.c) ---- */

/* Records the failure of an op call with what the forward was doing. */
di_status fwd_op_fail(di_error *err, di_status st, const char *what, int32_t layer);
#define FWD_TRY(err, layer, call)                                                         \
    do {                                                                                  \
        di_status st_ = (call);                                                           \
        if (st_ != DI_OK)                                                                 \
            return fwd_op_fail((err), st_, #call, (layer));                               \
    } while (0)

/* Hands a tensor to the dump hook (host copy through the backend); no-op without a hook. */
void fwd_dump(const fwd_run *r, const char *name, int32_t layer, fwd_dtype dt, const void *data,
              uint64_t d0, uint64_t d1, uint64_t d2);

/* ---- blocks (forward_blocks.c) ---- */

/* RoPE parameters of a layer with the given compression ratio (0: rope_theta, no YaRN). */
kern_rope fwd_rope_params(const fwd_model *m, uint32_t ratio);

/* One hyper-connection site around a sublayer: mixes of the current stream, collapse with
 * `pre_in` (stride 0 when one row for all), the site's norm into r->x. The caller runs the
 * sublayer into r->y, then fwd_hc_expand. */
di_status fwd_hc_site_in(fwd_run *r, uint32_t T, const fwd_site_w *site, const uint16_t *norm,
                         const float *pre_in, size_t pre_stride, float *pre_out, float *post,
                         float *comb, int32_t layer, di_error *err);
di_status fwd_hc_expand(fwd_run *r, uint32_t T, const float *post, const float *comb,
                        int32_t layer, di_error *err);

/* Attention of a layer or stage on r->x (rows r->rows) into r->y. commit: write this step's
 * window entries into the rings after the attention read them (0 for the draft block, whose
 * rows are not part of the sequence). compact_hook runs after the layer's compressor (the YOCO
 * boundary) and may shrink the rows. */
typedef di_status (*fwd_compact_fn)(fwd_run *r, di_error *err);
di_status fwd_attention(fwd_run *r, fwd_kv *kv, const fwd_layer_w *L, size_t ring_offset,
                        int commit, fwd_compact_fn compact_hook, di_error *err);
/* MoE of a layer or stage on r->x into r->y. */
di_status fwd_moe(fwd_run *r, const fwd_layer_w *L, di_error *err);
/* Engram module in front of a layer, updating r->h in place. */
di_status fwd_engram(fwd_run *r, const fwd_layer_w *L, di_error *err);

/* ---- draft rings (draft.c) ---- */

/* Writes every live row's draft-stage ring entries from r->taps (MODEL.md §2.11 prefill). */
di_status fwd_draft_rings(fwd_run *r, fwd_kv *kv, di_error *err);

#endif
