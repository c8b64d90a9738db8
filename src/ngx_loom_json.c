
/*
 * Copyright (C) resty-loom authors
 *
 * What resty.loom.publish must do with a string before it goes into a JSON
 * body as it is: a plain scan here keeps the loop out of Lua, where it
 * would abort the compiled trace of every send() that has attributes.
 */


#include "ngx_loom.h"


int ngx_loom_ffi_json_class(const u_char *s, size_t len);


/*
 * 0: printable ASCII without '"' or '\' (goes in as it is); 1: valid
 * UTF-8 that needs escaping; -1: not valid UTF-8 (no overlongs, no
 * surrogates, nothing above U+10FFFF).
 */
int
ngx_loom_ffi_json_class(const u_char *s, size_t len)
{
    int      flag;
    u_char   c, lo, hi;
    size_t   i, j, extra;

    flag = 0;

    for (i = 0; i < len; /* void */) {
        c = s[i];

        if (c < 0x80) {
            if (c < 0x20 || c == '"' || c == '\\' || c == 0x7f) {
                flag = 1;
            }

            i++;
            continue;
        }

        flag = 1;
        lo = 0x80;
        hi = 0xbf;

        if (c >= 0xc2 && c <= 0xdf) {
            extra = 1;

        } else if (c >= 0xe0 && c <= 0xef) {
            extra = 2;
            if (c == 0xe0) {
                lo = 0xa0;
            } else if (c == 0xed) {
                hi = 0x9f;
            }

        } else if (c >= 0xf0 && c <= 0xf4) {
            extra = 3;
            if (c == 0xf0) {
                lo = 0x90;
            } else if (c == 0xf4) {
                hi = 0x8f;
            }

        } else {
            return -1;
        }

        if (i + extra >= len) {
            return -1;                  /* cut short */
        }

        if (s[i + 1] < lo || s[i + 1] > hi) {
            return -1;
        }

        for (j = i + 2; j <= i + extra; j++) {
            if (s[j] < 0x80 || s[j] > 0xbf) {
                return -1;
            }
        }

        i += extra + 1;
    }

    return flag;
}

/* vi:set ft=c ts=4 sw=4 et fdm=marker: */
