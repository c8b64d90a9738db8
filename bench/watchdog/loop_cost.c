
/*
 * Copyright (C) resty-loom authors
 *
 * What the watchdog adds to one event-loop iteration, in ns: the module's
 * own per-iteration code (src/ngx_loom_watchdog_loop.h, compiled with the
 * module's -O) around a process_events that returns at once, against the
 * bare call, N times each, alternated, medians. Also the parts alone: one
 * clock read, one histogram update. bench/watchdog/run.py builds and runs
 * it; prints one JSON line.
 *
 *   cc -O -I src bench/watchdog/loop_cost.c -o build/wd-loop-cost
 *   build/wd-loop-cost [iterations per run] [runs]
 */


#include <stdio.h>
#include <stdlib.h>
#include "ngx_loom_watchdog_loop.h"


int               wd_enabled = 1;
uint64_t          wd_threshold_ns = 100000000;
uint64_t          wd_seq;
uint64_t          wd_busy_since;
loom_wd_stats_t   wd_stats;

static volatile uint64_t  sink;


/* stands for ngx_epoll_process_events: an opaque call */
__attribute__((noinline)) static long
process_events(long timer)
{
    __asm__ __volatile__("" ::: "memory");
    return timer;
}


__attribute__((noinline)) static long
loop_bare(long n)
{
    long  i, rc;

    rc = 0;
    for (i = 0; i < n; i++) {
        rc += process_events(i);
    }

    return rc;
}


/* the body of ngx_loom_wd_process_events, ngx_loom_watchdog.c */
__attribute__((noinline)) static long
loop_hook(long n)
{
    long      i, rc, timer;
    uint64_t  now, since, busy;

    rc = 0;
    for (i = 0; i < n; i++) {
        timer = i;

        if (!__atomic_load_n(&wd_enabled, __ATOMIC_RELAXED)) {
            rc += process_events(timer);
            continue;
        }

        if (wd_iter_end(&now, &since, &busy)) {
            sink = now + since + busy;      /* ngx_loom_wd_finish() */
            timer = 0;
        }

        rc += process_events(timer);

        wd_iter_start();
    }

    return rc;
}


__attribute__((noinline)) static long
loop_clock(long n)
{
    long  i;

    for (i = 0; i < n; i++) {
        sink = wd_now();
    }

    return 0;
}


__attribute__((noinline)) static long
loop_record(long n)
{
    long  i;

    for (i = 0; i < n; i++) {
        wd_record((uint64_t) (i & 0xffff) * 3);  /* < 50 us: bucket 0 */
    }

    return 0;
}


static double
run(long (*f)(long), long n)
{
    uint64_t  t0, t1;

    t0 = wd_now();
    sink = (uint64_t) f(n);
    t1 = wd_now();

    return (double) (t1 - t0) / (double) n;
}


static int
cmp(const void *a, const void *b)
{
    double  x = *(const double *) a, y = *(const double *) b;

    return (x > y) - (x < y);
}


int
main(int argc, char **argv)
{
    int     r, runs;
    long    n;
    double  bare[64], hook[64], clock1[64], rec[64], added[64];

    n = argc > 1 ? atol(argv[1]) : 2000000;
    runs = argc > 2 ? atoi(argv[2]) : 15;
    if (runs < 1 || runs > 64 || n < 1) {
        fprintf(stderr, "usage: %s [iterations] [runs <= 64]\n", argv[0]);
        return 1;
    }

    (void) run(loop_hook, n);       /* warm up */

    for (r = 0; r < runs; r++) {
        bare[r] = run(loop_bare, n);
        hook[r] = run(loop_hook, n);
        clock1[r] = run(loop_clock, n);
        rec[r] = run(loop_record, n);
        added[r] = hook[r] - bare[r];
    }

    qsort(bare, runs, sizeof(double), cmp);
    qsort(hook, runs, sizeof(double), cmp);
    qsort(clock1, runs, sizeof(double), cmp);
    qsort(rec, runs, sizeof(double), cmp);
    qsort(added, runs, sizeof(double), cmp);

    printf("{\"iterations_per_run\": %ld, \"runs\": %d, "
           "\"bare_call_ns\": %.2f, \"with_hook_ns\": %.2f, "
           "\"added_ns_per_iteration\": %.2f, "
           "\"added_ns_min\": %.2f, \"added_ns_max\": %.2f, "
           "\"clock_read_ns\": %.2f, \"histogram_update_ns\": %.2f}\n",
           n, runs, bare[runs / 2], hook[runs / 2], added[runs / 2],
           added[0], added[runs - 1], clock1[runs / 2], rec[runs / 2]);

    return 0;
}
