
/*
 * Copyright (C) resty-loom authors
 *
 * The configuration strings of the Lua and Java offload runtimes:
 * "key=value" words separated by white space. Included by each runtime's
 * one C file (the functions are static).
 */


#ifndef LOOM_RT_CONFIG_H
#define LOOM_RT_CONFIG_H

#include <stdio.h>
#include <stdlib.h>
#include <string.h>


/* the value of key in "k=v k=v", as a new string, or NULL */
static char *
loom_rt_config_get(const char *cfg, const char *key)
{
    size_t       klen, vlen;
    const char  *p, *v;

    klen = strlen(key);
    p = cfg;

    for ( ;; ) {
        while (*p == ' ' || *p == '\t' || *p == '\n') {
            p++;
        }

        if (*p == '\0') {
            return NULL;
        }

        v = p;
        while (*v != '\0' && *v != ' ' && *v != '\t' && *v != '\n') {
            v++;
        }

        if ((size_t) (v - p) > klen && strncmp(p, key, klen) == 0
            && p[klen] == '=')
        {
            vlen = v - p - klen - 1;
            return strndup(p + klen + 1, vlen);
        }

        p = v;
    }
}


/*
 * Refuses (-1, the reason in err) a configuration with a word that is
 * not <key>=<value> with a key from keys (NULL-terminated; known lists
 * them for the message): a misspelled key would otherwise be ignored
 * and its default used without a word
 */
static int
loom_rt_config_check(const char *cfg, const char *const *keys,
    const char *known, char *err, size_t err_size)
{
    size_t        len, klen;
    const char   *p, *v, *const *k;

    for (p = cfg; ; p = v) {
        while (*p == ' ' || *p == '\t' || *p == '\n') {
            p++;
        }

        if (*p == '\0') {
            return 0;
        }

        v = p;
        while (*v != '\0' && *v != ' ' && *v != '\t' && *v != '\n') {
            v++;
        }

        len = v - p;

        for (k = keys; *k != NULL; k++) {
            klen = strlen(*k);

            if (len > klen && strncmp(p, *k, klen) == 0 && p[klen] == '=') {
                break;
            }
        }

        if (*k == NULL) {
            snprintf(err, err_size, "bad configuration \"%.*s\": want "
                     "<key>=<value>, the keys being %s", (int) len, p, known);
            return -1;
        }
    }
}


#endif /* LOOM_RT_CONFIG_H */
