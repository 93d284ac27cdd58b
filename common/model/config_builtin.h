/* config_builtin.h: the shipped configs compiled into the library. meson generates
 * config_builtin.c from the JSON files in common/model/configs/. Private to the config module. */
#ifndef DI_MODEL_CONFIG_BUILTIN_H
#define DI_MODEL_CONFIG_BUILTIN_H

#include <stddef.h>

typedef struct model_config_builtin_entry {
    const char *name; /* "v41-flash", "tiny", "small", "demo" */
    const char *json; /* the file's text */
} model_config_builtin_entry;

extern const model_config_builtin_entry model_config_builtins[];
extern const size_t model_config_builtin_count;
/* The names, NULL-terminated, and as one "a, b, c" string for messages. */
extern const char *const model_config_builtin_name_list[];
extern const char model_config_builtin_known[];

#endif
