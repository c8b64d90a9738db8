
/*
 * Copyright (C) resty-loom authors
 *
 * The Lua backtrace of a stall, taken on the main thread: LuaJIT's
 * profiler calls back at a VM safe point, where the stack is dumped and
 * the request or timer that runs is noted.
 */


#include "ngx_loom_watchdog.h"
#include <dlfcn.h>


#define LOOM_WD_DEPTH        48
#define LOOM_WD_LUA_TIMER  0x0080
#define LOOM_LUA_REGISTRY  (-10000)


/* Lua VM and ngx_lua entry points, resolved with dlsym */
void (*wd_profile_start)(lua_State *L, const char *mode,
    loom_profile_cb_pt cb, void *data);
const char *(*wd_dumpstack)(lua_State *L, const char *fmt,
    int depth, size_t *len);
static int (*wd_getstack)(lua_State *L, int level, loom_lua_debug_t *ar);
static const char *(*wd_getlocal)(lua_State *L, const loom_lua_debug_t *ar,
    int n);
static const char *(*wd_tolstring)(lua_State *L, int idx, size_t *len);
static void (*wd_settop)(lua_State *L, int idx);
static int (*wd_getinfo)(lua_State *L, const char *what,
    loom_lua_debug_t *ar);
static void (*wd_setfield)(lua_State *L, int idx, const char *k);
static void *(*wd_get_request)(lua_State *L);
static int (*wd_get_phase)(void *r, char **err);
int (*wd_sema_post)(void *sem, int n);

/* main thread only: the function an off-CPU sample was taken in */
static uint64_t         wd_fn_seq;


int
wd_resolve(void)
{
    wd_profile_start = (void (*)(lua_State *, const char *,
                                 loom_profile_cb_pt, void *))
                       dlsym(RTLD_DEFAULT, "luaJIT_profile_start");
    wd_dumpstack = (const char *(*)(lua_State *, const char *, int,
                                    size_t *))
                   dlsym(RTLD_DEFAULT, "luaJIT_profile_dumpstack");
    wd_getstack = (int (*)(lua_State *, int, loom_lua_debug_t *))
                  dlsym(RTLD_DEFAULT, "lua_getstack");
    wd_getlocal = (const char *(*)(lua_State *, const loom_lua_debug_t *,
                                   int))
                  dlsym(RTLD_DEFAULT, "lua_getlocal");
    wd_tolstring = (const char *(*)(lua_State *, int, size_t *))
                   dlsym(RTLD_DEFAULT, "lua_tolstring");
    wd_settop = (void (*)(lua_State *, int)) dlsym(RTLD_DEFAULT,
                                                   "lua_settop");
    wd_getinfo = (int (*)(lua_State *, const char *, loom_lua_debug_t *))
                 dlsym(RTLD_DEFAULT, "lua_getinfo");
    wd_setfield = (void (*)(lua_State *, int, const char *))
                  dlsym(RTLD_DEFAULT, "lua_setfield");
    wd_get_request = (void *(*)(lua_State *))
                     dlsym(RTLD_DEFAULT, "ngx_http_lua_get_request");
    wd_get_phase = (int (*)(void *, char **))
                   dlsym(RTLD_DEFAULT, "ngx_http_lua_ffi_get_phase");
    wd_sema_post = (int (*)(void *, int))
                   dlsym(RTLD_DEFAULT, "ngx_http_lua_ffi_sema_post");

    return wd_profile_start != NULL && wd_dumpstack != NULL
           && wd_getstack != NULL && wd_getlocal != NULL
           && wd_tolstring != NULL && wd_settop != NULL;
}


/*
 * Where the running timer comes from: the innermost frame with a local
 * "loom_timer_site" ("<created at>|<callback defined at>": the watchdog's
 * ngx.timer wrapper, or resty.loom.timer's run_next) and, in the same
 * frame, "loom_timer_name" (a resty.loom.timer name), appended after a
 * second "|".
 */
static void
wd_timer_site(lua_State *L)
{
    int                level, n, found;
    size_t             len, nlen, room;
    const char        *name, *s, *tname;
    loom_lua_debug_t   ar;

    for (level = 0; level < 200 && wd_getstack(L, level, &ar); level++) {
        found = 0;
        tname = NULL;
        nlen = 0;

        for (n = 1; n < 256; n++) {
            name = wd_getlocal(L, &ar, n);
            if (name == NULL) {
                break;
            }

            if (ngx_strcmp(name, "loom_timer_site") == 0) {
                s = wd_tolstring(L, -1, &len);
                if (s != NULL) {
                    len = ngx_min(len, LOOM_WD_SITE_LEN - 1);
                    ngx_memcpy(wd_ctx_site, s, len);
                    wd_ctx_site[len] = '\0';
                    found = 1;
                }

            } else if (ngx_strcmp(name, "loom_timer_name") == 0) {
                /* the value stays referenced by the frame once popped */
                tname = wd_tolstring(L, -1, &nlen);
            }

            wd_settop(L, -2);
        }

        if (!found) {
            continue;
        }

        if (tname != NULL) {
            len = ngx_strlen(wd_ctx_site);
            room = LOOM_WD_SITE_LEN - 1 - len;
            if (room > 1) {
                nlen = ngx_min(nlen, room - 1);
                wd_ctx_site[len] = '|';
                ngx_memcpy(wd_ctx_site + len + 1, tname, nlen);
                wd_ctx_site[len + 1 + nlen] = '\0';
            }
        }

        return;
    }
}


/* where the sampled coroutine comes from: request or timer */
static void
wd_describe(lua_State *L, uint64_t seq)
{
    int                  phase;
    char                *err;
    u_char              *p, *last;
    ngx_http_request_t  *r;

    wd_ctx_seq = seq;
    wd_ctx_phase = 0;
    wd_ctx_timer = 0;
    wd_ctx_request[0] = '\0';
    wd_ctx_site[0] = '\0';

    r = (wd_get_request != NULL) ? wd_get_request(L) : NULL;
    if (r == NULL) {
        return;
    }

    phase = (wd_get_phase != NULL) ? wd_get_phase(r, &err) : 0;
    wd_ctx_phase = phase > 0 ? phase : 0;

    if (phase == LOOM_WD_LUA_TIMER) {
        wd_ctx_timer = 1;
        wd_timer_site(L);
        return;
    }

    p = (u_char *) wd_ctx_request;
    last = p + LOOM_WD_REQUEST_LEN - 1;

    p = ngx_slprintf(p, last, "%V %V", &r->main->method_name,
                     &r->main->unparsed_uri);

    if (r != r->main) {
        p = ngx_slprintf(p, last, " (subrequest %V)", &r->uri);
    }

    *p = '\0';
}


void
ngx_loom_wd_profile_cb(void *data, lua_State *L, int samples, int vmstate)
{
    int                n;
    int                sm_offcpu;
    size_t             len, bt_len;
    uint64_t           seq;
    const char        *s;
    loom_lua_debug_t   ar;
    loom_wd_sample_t  *sm;

    seq = wd_load(&wd_req_seq);
    sm_offcpu = wd_load(&wd_req_offcpu);

    /* only for the stall in progress: never a late or stray SIGPROF */
    if (seq == 0 || seq != wd_seq || wd_busy_since == 0) {
        return;
    }

    if (wd_ctx_seq != seq) {
        wd_describe(L, seq);
    }

    n = (wd_load(&wd_cb_seq) == seq) ? wd_cb_n : 0;
    if (n >= wd_max_samples) {
        return;
    }

    s = wd_dumpstack(L, "pf@lZ;", -LOOM_WD_DEPTH, &len);
    if (s == NULL) {
        return;
    }

    wd_store(&wd_cb_n, n + 1);
    wd_store(&wd_cb_seq, seq);
    wd_stats.samples++;

    if (n == 0) {
        bt_len = ngx_min(len, LOOM_WD_BT_LEN - 1);
        pthread_mutex_lock(&wd_lock);
        ngx_memcpy(wd_first_bt, s, bt_len);
        wd_first_bt[bt_len] = '\0';
        wd_first_bt_seq = seq;
        pthread_mutex_unlock(&wd_lock);
    }

    if (wd_nsamples > wd_mark_n
        && wd_samples[wd_nsamples - 1].seq != seq)
    {
        /* early samples of an iteration that did not become a stall */
        wd_nsamples = wd_mark_n;
        wd_text_used = wd_mark_used;
    }

    if (wd_nsamples == LOOM_WD_SAMPLES
        || wd_text_used + len > LOOM_WD_TEXT)
    {
        wd_stats.samples_dropped++;
        return;
    }

    sm = &wd_samples[wd_nsamples++];
    sm->seq = seq;
    sm->off = wd_text_used;
    sm->len = (uint32_t) len;
    sm->vmstate = vmstate;
    sm->offcpu = sm_offcpu;

    ngx_memcpy(wd_text + wd_text_used, s, len);
    wd_text_used += len;

    if (sm_offcpu && wd_fn_seq != seq && wd_getinfo != NULL
        && wd_setfield != NULL)
    {
        /*
         * the sample is taken at the instruction after the blocking call;
         * the Lua side finds the call's line in this function's bytecode
         */
        wd_fn_seq = seq;
        if (wd_getstack(L, 0, &ar) && wd_getinfo(L, "f", &ar)) {
            wd_setfield(L, LOOM_LUA_REGISTRY, "loom.watchdog.fn");
        }
    }

    if (sm_offcpu) {
        /* one sample per blocking call; the next request says its kind */
        wd_store(&wd_req_offcpu, 0);
    }
}

/* vi:set ft=c ts=4 sw=4 et fdm=marker: */
