
/*
 * Copyright (C) resty-loom authors
 *
 * A yield that gives the event loop a turn, for resty.loom.yield.
 *
 * Without OpenResty's delayed-events patch, ngx.sleep(0) is a 0 ms timer.
 * A coroutine resumed by a timer runs inside ngx_event_expire_timers(),
 * which does not update the clock: the new timer has already expired and
 * runs in the same pass, so a loop that "yields" with ngx.sleep(0) never
 * lets epoll run and every request waits for it to finish. Here a yield
 * posts one event to ngx_posted_next_events (nginx >= 1.17.5): the next
 * turn of the loop polls with a zero timeout first, serves what is ready,
 * runs due timers, and only then, among the posted events, posts the
 * semaphore the yielding coroutines wait on (with lua-nginx-module's own
 * ngx_http_lua_ffi_sema_post, resolved with dlsym).
 */


#include "ngx_loom.h"
#include <ngx_event.h>
#include <dlfcn.h>


typedef int (*ngx_loom_yield_sema_post_pt)(void *sem, int n);


int ngx_loom_ffi_yield(void *sem);


static void ngx_loom_yield_handler(ngx_event_t *ev);


static ngx_event_t                   ngx_loom_yield_ev;
static ngx_loom_yield_sema_post_pt   ngx_loom_yield_post;
/* the one semaphore resty.loom.yield waits on, and the posts it is owed */
static void                         *ngx_loom_yield_sem;
static int                           ngx_loom_yield_n;


/*
 * Asks for sem to be posted once on the next turn of the event loop.
 * LOOM_FFI_DECLINED: not possible here (an nginx without
 * ngx_posted_next_events, lua-nginx-module's semaphore not found, or posts
 * still owed to another semaphore); the caller falls back to a 1 ms sleep.
 */
int
ngx_loom_ffi_yield(void *sem)
{
#if (nginx_version >= 1017005)
    if (ngx_loom_yield_post == NULL) {
        ngx_loom_yield_post = (ngx_loom_yield_sema_post_pt)
                              dlsym(RTLD_DEFAULT, "ngx_http_lua_ffi_sema_post");
        if (ngx_loom_yield_post == NULL) {
            return LOOM_FFI_DECLINED;
        }
    }

    if (ngx_loom_yield_n > 0 && ngx_loom_yield_sem != sem) {
        return LOOM_FFI_DECLINED;
    }

    ngx_loom_yield_sem = sem;
    ngx_loom_yield_n++;

    if (!ngx_loom_yield_ev.posted) {
        ngx_loom_yield_ev.handler = ngx_loom_yield_handler;
        ngx_loom_yield_ev.log = ngx_cycle->log;
        ngx_post_event(&ngx_loom_yield_ev, &ngx_posted_next_events);
    }

    return LOOM_FFI_OK;
#else
    return LOOM_FFI_DECLINED;
#endif
}


static void
ngx_loom_yield_handler(ngx_event_t *ev)
{
    int  n;

    /* a coroutine resumed by this post may yield again: the next turn */
    n = ngx_loom_yield_n;
    ngx_loom_yield_n = 0;

    (void) ngx_loom_yield_post(ngx_loom_yield_sem, n);
}

/* vi:set ft=c ts=4 sw=4 et fdm=marker: */
