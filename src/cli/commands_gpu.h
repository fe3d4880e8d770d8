/* CLI commands of the GPU work (issue 6), for the dispatcher in src/cli/main.c:
 *   dflash synth --config 27b|tiny --out DIR [...]     (cmd_synth.c)
 *   dflash bench --model DIR [...]                     (cmd_bench_gpu.c)
 * Each takes the arguments after the command name (argv[0] = the command name itself) and
 * returns the process exit status (0 ok, 1 failure, 2 usage). They print to stdout/stderr:
 * CLI code, not library code. */
#ifndef DFLASH_CLI_COMMANDS_GPU_H
#define DFLASH_CLI_COMMANDS_GPU_H

int df_cmd_synth(int argc, char **argv);
int df_cmd_bench(int argc, char **argv);

#endif
