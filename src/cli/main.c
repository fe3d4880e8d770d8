/* dflash command-line entry point: dflash serve | generate | tokenize. */
#include <stdio.h>
#include <string.h>

int main(int argc, char **argv) {
    if (argc < 2 || strcmp(argv[1], "--help") == 0) {
        printf("usage: dflash <serve|generate|tokenize> [options]\n");
        return argc < 2 ? 2 : 0;
    }
    fprintf(stderr, "dflash: unknown command '%s'\n", argv[1]);
    return 2;
}
