
/*
 * Copyright (C) resty-loom authors
 *
 * The CPU's time-stamp counter, for resty.loom.timer: it times each
 * callback of a run of timers, and on the virtual machines it runs on a
 * read of the counter costs a third of a clock_gettime() (10 ns against
 * 33 ns, through the FFI). The caller scales the ticks against
 * clock_gettime() at the start of each run; 0 means no counter here.
 */


#include "ngx_loom.h"

#if (defined __x86_64__ || defined __i386__)
#include <x86intrin.h>
#endif


double ngx_loom_ffi_tsc(void);


double
ngx_loom_ffi_tsc(void)
{
#if (defined __x86_64__ || defined __i386__)
    return (double) __rdtsc();
#else
    return 0;
#endif
}
