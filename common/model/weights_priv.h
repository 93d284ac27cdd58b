/* weights_priv.h: what weights.c shares with weights_load.c. Private to the weights module. */
#ifndef DI_MODEL_WEIGHTS_PRIV_H
#define DI_MODEL_WEIGHTS_PRIV_H

#include "common/model/weights.h"

/* model_weights_manifest with each spec's dst pointing into w's views (w's arrays allocated). */
di_status model_manifest_into(const model_config *cfg, model_weights *w, model_spec_fn fn,
                              void *userdata, di_error *err);

#endif
