/* dflash-gpu: a stand-alone entry point for the GPU work's commands (synth, bench) until the
 * dispatcher of src/cli/main.c wires them in; used by tools/gpu_run.sh on the device machine. */
#include <stdio.h>
#include <string.h>

#include "cli/commands_gpu.h"

int main(int argc, char **argv) {
    if (argc >= 2 && strcmp(argv[1], "synth") == 0) return df_cmd_synth(argc - 1, argv + 1);
    if (argc >= 2 && strcmp(argv[1], "bench") == 0) return df_cmd_bench(argc - 1, argv + 1);
    fprintf(stderr, "usage: dflash-gpu synth|bench [options]\n");
    return 2;
}
