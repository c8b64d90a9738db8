
/*
 * Copyright (C) resty-loom authors
 *
 * Shared layouts of the event-loop watchdog. lib/resty/loom/watchdog.lua
 * declares the same structures with ffi.cdef: keep both in step.
 */


#ifndef _NGX_LOOM_WATCHDOG_H_INCLUDED_
#define _NGX_LOOM_WATCHDOG_H_INCLUDED_


#include <stdint.h>


#define LOOM_WD_NBUCKETS      18
#define LOOM_WD_NSYSCALLS      4
#define LOOM_WD_REQUEST_LEN  256
#define LOOM_WD_SITE_LEN     320
#define LOOM_WD_BT_LEN      1024


/* options handed over by watchdog.start() and watchdog.configure() */
typedef struct {
    double    threshold_ms;     /* an iteration this long is a stall */
    double    interval_ms;      /* watchdog tick */
    double    long_ms;          /* log "still blocked" from the thread */
    int       max_samples;      /* Lua stack samples per stall */
    int       profile;          /* take Lua backtraces (jit.profile hook) */
    int       breakpoints;      /* use a return breakpoint off-CPU */
} loom_wd_conf_t;


/* loop figures, written by the worker's main thread only */
typedef struct {
    uint64_t  iterations;
    uint64_t  busy_ns;          /* sum of busy time */
    uint64_t  max_ns;
    uint64_t  stalls;           /* iterations over the threshold */
    uint64_t  reports_dropped;
    uint64_t  samples;          /* Lua stack samples taken */
    uint64_t  samples_dropped;
    uint64_t  signals;          /* sample requests sent by the thread */
    uint64_t  breakpoints;      /* return breakpoints armed */
    uint64_t  started_ns;       /* CLOCK_MONOTONIC at start */
    uint64_t  buckets[LOOM_WD_NBUCKETS];
    int       running;
    int       profiler;         /* 1: backtraces available */
    int       bp_state;         /* 0 untried, 1 works, -1 unavailable */
    int       bp_errno;
} loom_wd_stats_t;


/* one finished stall */
typedef struct {
    uint64_t  seq;              /* loop iteration number */
    double    start;            /* wall clock, seconds since the epoch */
    double    duration_ms;
    double    cpu_ms;           /* on-CPU time of the main thread */
    double    runq_ms;          /* runnable, waiting for a CPU */
    double    detect_ms;        /* stall start -> the thread noticed */
    double    report_ms;        /* stall start -> report ready in C */
    uint32_t  ticks;            /* /proc samples taken during the stall */
    uint32_t  ticks_running;
    uint32_t  ticks_sleeping;
    uint32_t  ticks_disk;
    int32_t   sys_nr[LOOM_WD_NSYSCALLS];
    uint32_t  sys_n[LOOM_WD_NSYSCALLS];
    uint32_t  lua_samples;
    int32_t   phase;            /* ngx_lua context bit, 0: unknown */
    int32_t   detected;         /* noticed while it happened */
    int32_t   cpu_known;
    int32_t   runq_known;
    int32_t   timer;            /* 1: a timer (fake request) ran */
    int32_t   bt_signal;        /* samples asked for with a signal */
    int32_t   bt_breakpoint;    /* samples asked for with a breakpoint */
    char      wchan[48];
    char      request[LOOM_WD_REQUEST_LEN];
    char      site[LOOM_WD_SITE_LEN];   /* timer creation site */
} loom_wd_report_t;


/* one Lua stack sample; text is in the samples arena */
typedef struct {
    uint64_t  seq;
    uint32_t  off;
    uint32_t  len;
    int32_t   vmstate;          /* 'N' 'I' 'C' 'G' 'J' */
    int32_t   offcpu;           /* taken right after a blocking call */
} loom_wd_sample_t;


#endif /* _NGX_LOOM_WATCHDOG_H_INCLUDED_ */

/* vi:set ft=c ts=4 sw=4 et fdm=marker: */
