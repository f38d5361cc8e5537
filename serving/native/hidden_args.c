/*
 * LD_PRELOAD shim: append secret arguments to a program's argv without putting them on its command line.
 *
 * tritonserver takes its API key only as an argument (--http-restricted-api=...:header=KEY), and a command line is
 * world-readable in /proc/PID/cmdline. This shim wraps __libc_start_main: it reads extra arguments from the
 * environment variable UNROLL_HIDDEN_ARGS (one per line), hands main() a new argv with them appended, and removes
 * the variable and itself (LD_PRELOAD) from the environment that children inherit. /proc/PID/cmdline keeps showing
 * the original arguments; /proc/PID/environ, where the key still lies, is readable by the same user only.
 * Built and used by unroll/serving/hidden_args.py.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

typedef int (*main_fn)(int, char **, char **);
typedef int (*start_fn)(main_fn, int, char **, void (*)(void), void (*)(void), void (*)(void), void *);

static main_fn real_main;

static void drop_self_from_preload(void) {
    const char *preload = getenv("LD_PRELOAD");
    if (preload == NULL) return;
    char *kept = calloc(strlen(preload) + 1, 1);
    char *copy = strdup(preload);
    if (kept == NULL || copy == NULL) { unsetenv("LD_PRELOAD"); return; }
    for (char *save = NULL, *tok = strtok_r(copy, ": ", &save); tok; tok = strtok_r(NULL, ": ", &save)) {
        if (strstr(tok, "unroll_hidden_args") != NULL) continue;
        if (*kept) strcat(kept, ":");
        strcat(kept, tok);
    }
    if (*kept) setenv("LD_PRELOAD", kept, 1); else unsetenv("LD_PRELOAD");
    free(copy);
    free(kept);
}

static int main_with_hidden_args(int argc, char **argv, char **envp) {
    const char *hidden = getenv("UNROLL_HIDDEN_ARGS");
    char **args = argv;
    if (hidden != NULL && *hidden) {
        char *text = strdup(hidden);
        int extra = 1;
        for (const char *c = hidden; *c; c++) extra += (*c == '\n');
        args = calloc((size_t)argc + (size_t)extra + 1, sizeof(char *));
        if (text == NULL || args == NULL) return 70;  /* EX_SOFTWARE: never start without the arguments */
        memcpy(args, argv, (size_t)argc * sizeof(char *));
        for (char *save = NULL, *tok = strtok_r(text, "\n", &save); tok; tok = strtok_r(NULL, "\n", &save))
            args[argc++] = tok;
        args[argc] = NULL;
    }
    unsetenv("UNROLL_HIDDEN_ARGS");
    drop_self_from_preload();
    (void)envp;
    return real_main(argc, args, environ);
}

int __libc_start_main(main_fn main, int argc, char **argv, void (*init)(void), void (*fini)(void),
                      void (*rtld_fini)(void), void *stack_end) {
    start_fn real_start = (start_fn)dlsym(RTLD_NEXT, "__libc_start_main");
    real_main = main;
    return real_start(main_with_hidden_args, argc, argv, init, fini, rtld_fini, stack_end);
}
