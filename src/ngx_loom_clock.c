
/*
 * Copyright (C) resty-loom authors
 *
 * Clocks for resty.loom.timer. The CPU's time-stamp counter times each
 * callback of a run of timers: on the virtual machines it runs on, a read
 * of the counter costs a third of a clock_gettime() (10 ns against 33 ns,
 * through the FFI). The caller scales the ticks against clock_gettime()
 * at the start of each run; 0 means no counter here.
 *
 * The event loop's millisecond clock (ngx_current_msec) tells, read
 * through a pointer without a call, whether the loop has turned: without
 * statistics a lane reads the counter only after some runs, and after any
 * callback that yielded.
 */


#include "ngx_loom.h"

#if (defined __x86_64__ || defined __i386__)
#include <x86intrin.h>
#endif


double ngx_loom_ffi_tsc(void);
const uint32_t *ngx_loom_ffi_loop_msec(void);


double
ngx_loom_ffi_tsc(void)
{
#if (defined __x86_64__ || defined __i386__)
    return (double) __rdtsc();
#else
    return 0;
#endif
}


/* the low 32 bits of ngx_current_msec: they change whenever it does */
const uint32_t *
ngx_loom_ffi_loop_msec(void)
{
    const uint32_t  *p;

    p = (const uint32_t *) (const void *) &ngx_current_msec;

#if (NGX_HAVE_LITTLE_ENDIAN)
    return p;
#else
    return p + (sizeof(ngx_msec_t) / sizeof(uint32_t) - 1);
#endif
}
