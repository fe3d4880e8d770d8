/* OpenAI-compatible HTTP server (placeholder until the server module lands). */
#include "dflash/status.h"
int df_server_placeholder(void);
int df_server_placeholder(void) { return 0; }
