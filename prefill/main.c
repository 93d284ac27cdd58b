/* di-prefill: the prefill service (common/serve/engsvc.h). See --help and docs/services.md. */
#include "common/serve/engsvc_main.h"

int main(int argc, char **argv)
{
    return engsvc_program(ENGSVC_PREFILL, argc, argv);
}
