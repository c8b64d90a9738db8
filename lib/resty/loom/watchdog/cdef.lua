-- The C side of the watchdog (src/ngx_loom_watchdog*.c): its structures
-- and entry points, declared once for the watchdog's modules. Keep in step
-- with src/ngx_loom_watchdog.h.


local ffi = require "ffi"


ffi.cdef[[
typedef struct {
    double    threshold_ms;
    double    interval_ms;
    double    long_ms;
    int       max_samples;
    int       profile;
    int       breakpoints;
} loom_wd_conf_t;

typedef struct {
    uint64_t  iterations;
    uint64_t  busy_ns;
    uint64_t  max_ns;
    uint64_t  stalls;
    uint64_t  reports_dropped;
    uint64_t  samples;
    uint64_t  samples_dropped;
    uint64_t  signals;
    uint64_t  breakpoints;
    uint64_t  started_ns;
    uint64_t  buckets[18];
    int       running;
    int       profiler;
    int       bp_state;
    int       bp_errno;
} loom_wd_stats_t;

typedef struct {
    uint64_t  seq;
    double    start;
    double    duration_ms;
    double    cpu_ms;
    double    runq_ms;
    double    detect_ms;
    double    report_ms;
    uint32_t  ticks;
    uint32_t  ticks_running;
    uint32_t  ticks_sleeping;
    uint32_t  ticks_disk;
    int32_t   sys_nr[4];
    uint32_t  sys_n[4];
    uint32_t  lua_samples;
    int32_t   phase;
    int32_t   detected;
    int32_t   cpu_known;
    int32_t   runq_known;
    int32_t   timer;
    int32_t   bt_signal;
    int32_t   bt_breakpoint;
    char      wchan[48];
    char      request[256];
    char      site[320];
} loom_wd_report_t;

typedef struct {
    uint64_t  seq;
    uint32_t  off;
    uint32_t  len;
    int32_t   vmstate;
    int32_t   offcpu;
} loom_wd_sample_t;

int ngx_loom_ffi_watchdog_start(const loom_wd_conf_t *conf, void *sem,
    char **err);
int ngx_loom_ffi_watchdog_configure(const loom_wd_conf_t *conf);
int ngx_loom_ffi_watchdog_enable(int on);
void ngx_loom_ffi_watchdog_detach(void);
const loom_wd_stats_t *ngx_loom_ffi_watchdog_stats(void);
int ngx_loom_ffi_watchdog_pop(loom_wd_report_t *out);
const loom_wd_sample_t *ngx_loom_ffi_watchdog_samples(int *n,
    const char **text);
void ngx_loom_ffi_watchdog_samples_reset(void);
double ngx_loom_ffi_watchdog_busy_ms(void);
double ngx_loom_ffi_watchdog_wall(void);
void ngx_loom_ffi_watchdog_log(int level, const char *msg, size_t len);
]]


return { _VERSION = "0.2.0" }
