/* config_geometry.c: the KV geometry of the shipped v41-flash config. */
#include <assert.h>

#include "common/model/config.h"

void kv_geometry_v41_flash(uint32_t nextn, kv_geometry *out)
{
    /* The shipped config is the one source of the geometry and of the model id, so blocks
     * written through either path carry the same fingerprint. */
    model_config cfg;
    di_status st = model_config_builtin("v41-flash", &cfg, NULL);
    assert(st == DI_OK);
    (void)st;
    model_config_kv_geometry(&cfg, nextn, out);
}
